'use strict';
// Fastify (4 and 5) plugin: app.register(fastifyIdempotency, options) before the routes. It
// applies to the methods in options.methods (POST and PATCH by default); a route opts in or out
// with config: { idempotency: true | false }. The raw body is kept (a tee in preParsing) for an
// exact fingerprint; preHandler claims and answers replays, 409, 422 and 400 itself; onSend
// stores the handler's answer (complete) before it goes out.

const { Transform } = require('node:stream');
const { HttpIdempotency } = require('./http');

const kRaw = Symbol('pg-idempotency.rawBody');
const kTicket = Symbol('pg-idempotency.ticket');
const kBadBody = Symbol('pg-idempotency.badBody');

async function toBuffer(payload) {
  if (payload === null || payload === undefined) return Buffer.alloc(0);
  if (Buffer.isBuffer(payload)) return payload;
  if (typeof payload === 'string') return Buffer.from(payload);
  if (typeof payload.pipe === 'function') {
    const chunks = [];
    for await (const c of payload) chunks.push(Buffer.from(c));
    return Buffer.concat(chunks);
  }
  return Buffer.from(String(payload));
}

function fastifyIdempotency(fastify, options, done) {
  const core = new HttpIdempotency(options);
  const setting = (request) => (request.routeOptions ? request.routeOptions.config : request.context.config)?.idempotency;
  const applies = (request) => core.applies(request.method, setting(request));

  fastify.addHook('preParsing', async (request, reply, payload) => {
    if (!applies(request)) return payload;
    const chunks = [];
    const tee = new Transform({
      transform(chunk, encoding, cb) {
        chunks.push(Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk));
        cb(null, chunk);
      },
      flush(cb) {
        request[kRaw] = Buffer.concat(chunks);
        cb();
      },
    });
    Object.defineProperty(tee, 'receivedEncodedLength', { get: () => payload.receivedEncodedLength });
    payload.on('error', (err) => tee.destroy(err));
    return payload.pipe(tee);
  });

  fastify.addHook('preHandler', async (request, reply) => {
    if (!applies(request)) return undefined;
    const url = new URL(request.url, 'http://x');
    const raw = request[kRaw];
    const begun = await core.begin({
      method: request.method,
      path: url.pathname,
      search: url.search,
      keyValues: request.raw.headersDistinct ? request.raw.headersDistinct['idempotency-key'] : undefined,
      contentType: request.headers['content-type'],
      body: raw ?? null,
      parsedBody: raw === undefined ? request.body : undefined,
      native: request,
    });
    if (begun.action === 'next') return undefined;
    if (begun.action === 'respond') {
      const r = begun.response;
      reply.code(r.status).headers(r.headers).send(r.body);
      return reply;
    }
    request[kTicket] = begun.ticket;
    return undefined;
  });

  // A body Fastify's parser refuses (invalid JSON, an empty JSON body) is answered 400 by
  // Fastify before the claim; for the routes of this plugin the answer is problem+json, as the
  // other refusals are.
  fastify.addHook('onError', async (request, reply, error) => {
    if (applies(request) && !request[kTicket] && (error.statusCode ?? 500) === 400
        && (String(error.code ?? '').startsWith('FST_ERR_CTP') || error instanceof SyntaxError)) {
      request[kBadBody] = error.message;
    }
  });

  fastify.addHook('onSend', async (request, reply, payload) => {
    if (request[kBadBody] !== undefined && reply.statusCode === 400) {
      const values = request.raw.headersDistinct ? request.raw.headersDistinct['idempotency-key'] : undefined;
      const r = HttpIdempotency.decorate(
        core.problem(400, 'bad-request', 'Bad request', `the body is not JSON: ${request[kBadBody]}`),
        { rawKey: values && values.length === 1 ? values[0] : undefined },
      );
      request[kBadBody] = undefined;
      reply.headers(r.headers);
      return r.body;
    }
    const ticket = request[kTicket];
    if (!ticket) return payload;
    request[kTicket] = undefined;
    const r = await core.finish(ticket, {
      status: reply.statusCode,
      headers: reply.getHeaders(),
      body: await toBuffer(payload),
    });
    reply.code(r.status).headers(r.headers);
    return r.body;
  });

  fastify.addHook('onClose', async () => {
    await core.close();
  });
  done();
}

// Hooks apply to the routes of the context that registers the plugin, not only to its children.
fastifyIdempotency[Symbol.for('skip-override')] = true;
fastifyIdempotency[Symbol.for('fastify.display-name')] = 'pg-idempotency';
fastifyIdempotency[Symbol.for('plugin-meta')] = { name: 'pg-idempotency', fastify: '4.x || 5.x' };

module.exports = { fastifyIdempotency };
