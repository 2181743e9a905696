'use strict';
// The Fastify plugin through real HTTP requests (tests/http-suite.js).

const Fastify = require('fastify');
const { fastifyIdempotency } = require('..');
const { httpSuite } = require('./http-suite');

httpSuite('fastify', async (options, handler) => {
  const app = Fastify();
  await app.register(fastifyIdempotency, options);
  app.addContentTypeParser('*', { parseAs: 'buffer' }, (req, body, done) => done(null, body));
  const route = async (request, reply) => {
    const r = await handler({ headers: request.headers, body: request.body, path: request.routeOptions.url });
    if (r.text !== undefined) return reply.code(r.status).headers(r.headers).send(r.text);
    return reply.code(r.status).send(r.body);
  };
  app.post('/orders', route);
  app.post('/refunds', route);
  app.get('/orders', async () => []);
  await app.listen({ port: 0, host: '127.0.0.1' });
  return { url: `http://127.0.0.1:${app.server.address().port}`, close: () => app.close() };
});
