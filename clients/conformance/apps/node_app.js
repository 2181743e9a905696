'use strict';
// The conformance app on the Express middleware or the Fastify plugin (argv[2]: express |
// fastify). Environment: CONNINFO (a libpq keyword string), PORT, WAIT, CONNECT_TIMEOUT,
// FAIL_OPEN (see ../README.md for the routes).

const path = require('node:path');
const node = path.join(__dirname, '..', '..', 'node');
const { expressIdempotency, fastifyIdempotency } = require(node);

// libpq keywords to a URL for pg.
const kv = Object.fromEntries(process.env.CONNINFO.split(/\s+/).filter(Boolean).map((p) => p.split('=')));
const connectionString = kv.host.startsWith('/')
  ? `postgresql://${kv.user}@/${kv.dbname}?host=${encodeURIComponent(kv.host)}&port=${kv.port}`
  : `postgresql://${kv.user}@${kv.host}:${kv.port}/${kv.dbname}`;
const options = {
  connectionString,
  wait: Number(process.env.WAIT ?? 0),
  connectTimeout: Number(process.env.CONNECT_TIMEOUT ?? 5),
  failOpen: process.env.FAIL_OPEN === '1',
  onError: () => {},
};
let runs = 0;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const len = (b) => (b === undefined || b === null ? 0 : Buffer.isBuffer(b) ? b.length : Buffer.byteLength(typeof b === 'string' ? b : JSON.stringify(b)));

async function main(kind) {
  const port = Number(process.env.PORT);
  if (kind === 'express') {
    const express = require(path.join(node, 'node_modules', 'express'));
    const app = express();
    app.use(expressIdempotency(options));
    app.post('/orders', async (req, res) => {
      const n = ++runs;
      await sleep(Number(req.headers['x-sleep-ms'] ?? 0));
      res.status(201).set({ location: `/orders/${n}`, etag: `"v${n}"`, 'set-cookie': `s=${n}`, 'x-request-id': `r${n}` }).json({ run: n });
    });
    app.get('/orders', (req, res) => res.json([]));
    app.post('/text', (req, res) => { runs++; res.type('text/plain; charset=utf-8').send(`got ${len(req.rawBody)} bytes`); });
    app.post('/fail', (req, res) => { runs++; res.status(500).json({ error: 'boom' }); });
    app.post('/reject', (req, res) => { runs++; res.status(400).json({ error: 'bad' }); });
    app.post('/throw', () => { runs++; throw new Error('the handler throws'); });
    app.get('/runs', (req, res) => res.json({ runs }));
    app.use((err, req, res, next) => res.status(500).json({ error: 'internal' }));
    app.listen(port, '127.0.0.1');
  } else {
    const Fastify = require(path.join(node, 'node_modules', 'fastify'));
    const app = Fastify();
    await app.register(fastifyIdempotency, options);
    app.addContentTypeParser('*', { parseAs: 'buffer' }, (req, body, done) => done(null, body));
    app.removeContentTypeParser('text/plain');
    app.addContentTypeParser('text/plain', { parseAs: 'buffer' }, (req, body, done) => done(null, body));
    app.post('/orders', async (request, reply) => {
      const n = ++runs;
      await sleep(Number(request.headers['x-sleep-ms'] ?? 0));
      return reply.code(201).headers({ location: `/orders/${n}`, etag: `"v${n}"`, 'set-cookie': `s=${n}`, 'x-request-id': `r${n}` }).send({ run: n });
    });
    app.get('/orders', async () => []);
    app.post('/text', async (request, reply) => { runs++; return reply.type('text/plain; charset=utf-8').send(`got ${len(request.body)} bytes`); });
    app.post('/fail', async (request, reply) => { runs++; return reply.code(500).send({ error: 'boom' }); });
    app.post('/reject', async (request, reply) => { runs++; return reply.code(400).send({ error: 'bad' }); });
    app.post('/throw', async () => { runs++; throw new Error('the handler throws'); });
    app.get('/runs', async () => ({ runs }));
    await app.listen({ port, host: '127.0.0.1' });
  }
}

main(process.argv[2]).catch((err) => { console.error(err); process.exit(1); });
