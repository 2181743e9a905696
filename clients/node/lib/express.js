'use strict';
// Express (4 and 5) middleware: app.post('/orders', idem, handler) or app.use(idem). The
// handler's response is held back until it is stored (complete), then sent with the
// idempotency headers; replays, 409, 422 and 400 are answered without calling the handler.

const { HttpIdempotency, isJsonType } = require('./http');

function readBody(req, limit) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    let size = 0;
    req.on('data', (c) => {
      size += c.length;
      if (size > limit) {
        reject(Object.assign(new Error('request body too large'), { status: 413 }));
        req.destroy();
        return;
      }
      chunks.push(c);
    });
    req.on('end', () => resolve(Buffer.concat(chunks)));
    req.on('error', reject);
  });
}

function toBuffer(chunk, encoding) {
  if (chunk === undefined || chunk === null) return null;
  if (Buffer.isBuffer(chunk)) return chunk;
  if (chunk instanceof Uint8Array) return Buffer.from(chunk);
  return Buffer.from(String(chunk), typeof encoding === 'string' ? encoding : 'utf8');
}

function send(res, r) {
  res.statusCode = r.status;
  for (const [k, v] of Object.entries(r.headers)) res.setHeader(k, v);
  res.removeHeader('transfer-encoding');
  res.setHeader('content-length', String(r.body.length));
  res.end(r.body);
}

function expressIdempotency(options = {}) {
  const core = new HttpIdempotency(options);
  const limit = options.bodyLimit ?? 1024 * 1024;

  async function idempotency(req, res, next) {
    if (!core.applies(req.method)) return next();
    // The raw body, for an exact fingerprint: read here unless a parser got to it first (then
    // req.rawBody, if it kept one, or the parsed req.body is used). It is parsed into req.body
    // for the handler; express.json() after this middleware finds the stream read and skips.
    let body = req.rawBody ?? null;
    if (body === null && req.body === undefined && !req.complete) {
      body = await readBody(req, limit);
      req.rawBody = body;
      req._body = true; // body-parser 1.x (Express 4) skips a request so marked
      if (body.length > 0 && isJsonType(req.headers['content-type'])) {
        try {
          req.body = JSON.parse(body.toString('utf8'));
        } catch {
          // PostgreSQL judges it in the claim (400 or 422)
        }
      }
    }
    const begun = await core.begin({
      method: req.method,
      path: (req.baseUrl ?? '') + (req.path ?? new URL(req.url, 'http://x').pathname),
      search: new URL(req.originalUrl ?? req.url, 'http://x').search,
      keyValues: req.headersDistinct ? req.headersDistinct['idempotency-key'] : rawValues(req, 'idempotency-key'),
      contentType: req.headers['content-type'],
      body,
      parsedBody: body === null ? req.body : undefined,
      native: req,
    });
    if (begun.action === 'next') return next();
    if (begun.action === 'respond') return send(res, begun.response);

    // new: hold the response back until it is stored.
    const chunks = [];
    const { writeHead, write, end } = res;
    const restore = () => Object.assign(res, { writeHead, write, end });
    res.writeHead = function deferredWriteHead(status, reason, headers) {
      if (typeof reason !== 'string') [headers, reason] = [reason, undefined];
      res.statusCode = status;
      if (reason) res.statusMessage = reason;
      if (Array.isArray(headers)) {
        for (let i = 0; i + 1 < headers.length; i += 2) res.setHeader(headers[i], headers[i + 1]);
      } else if (headers) {
        for (const [k, v] of Object.entries(headers)) res.setHeader(k, v);
      }
      return res;
    };
    res.write = function bufferedWrite(chunk, encoding, cb) {
      const b = toBuffer(chunk, encoding);
      if (b) chunks.push(b);
      const done = typeof encoding === 'function' ? encoding : cb;
      if (done) process.nextTick(done);
      return true;
    };
    res.end = function storedEnd(chunk, encoding, cb) {
      if (typeof chunk === 'function') [cb, chunk] = [chunk, undefined];
      else if (typeof encoding === 'function') [cb, encoding] = [encoding, undefined];
      const b = toBuffer(chunk, encoding);
      if (b) chunks.push(b);
      restore();
      core.finish(begun.ticket, {
        status: res.statusCode,
        headers: res.getHeaders(),
        body: Buffer.concat(chunks),
      }).then((r) => {
        send(res, r);
        if (cb) cb();
      }, (err) => {
        core.onError(err);
        res.destroy(err);
      });
      return res;
    };
    return next();
  }

  function middleware(req, res, next) {
    idempotency(req, res, next).catch(next);
  }
  middleware.close = () => core.close();
  return middleware;
}

function rawValues(req, name) {
  const out = [];
  for (let i = 0; i + 1 < req.rawHeaders.length; i += 2) {
    if (req.rawHeaders[i].toLowerCase() === name) out.push(req.rawHeaders[i + 1]);
  }
  return out.length ? out : undefined;
}

module.exports = { expressIdempotency };
