'use strict';
// The Express middleware through real HTTP requests (tests/http-suite.js).

const express = require('express');
const { expressIdempotency } = require('..');
const { httpSuite } = require('./http-suite');

httpSuite('express', async (options, handler) => {
  const app = express();
  const idem = expressIdempotency(options);
  const route = (req, res, next) => { // Express 4 does not catch a rejected handler: next(err)
    handler({ headers: req.headers, body: req.body, path: req.path })
      .then((r) => (r.text !== undefined ? res.status(r.status).set(r.headers).send(r.text)
        : res.status(r.status).json(r.body)), next);
  };
  app.post('/orders', idem, express.json(), route); // express.json() finds the body read: skips
  app.post('/refunds', idem, route);
  app.get('/orders', idem, (req, res) => res.json([]));
  app.use((err, req, res, next) => res.status(500).json({ error: 'internal' })); // quiet 500s
  const server = await new Promise((resolve) => { const s = app.listen(0, '127.0.0.1', () => resolve(s)); });
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    close: () => new Promise((resolve) => { server.closeAllConnections(); server.close(resolve); }),
  };
});
