'use strict';
// The HTTP behaviour shared by the Express and Fastify middleware, following the IETF
// Idempotency-Key draft as examples/http-service does: the key per RFC 9651, the scope per client
// and route, the request fingerprint computed by the extension (request_fingerprint), 400 / 409 /
// 422 problem+json, Idempotent-Replayed, Idempotency-Expires. Framework-neutral: the adapters
// turn requests into `begin()` calls and responses into `finish()` calls.

const db = require('./db');
const { traced } = require('./otel');
const { parseHeader, KeyError } = require('./key');

const PROBLEM_JSON = 'application/problem+json';
// The headers of a handler's answer that are stored and replayed besides Content-Type (option
// replayHeaders): those that describe the resource, not the one response.
const REPLAY_HEADERS = ['location', 'content-location', 'etag', 'last-modified', 'link'];
// Never replayed, whatever replayHeaders says.
const NEVER_REPLAYED = new Set(['content-length', 'date', 'server', 'set-cookie', 'transfer-encoding', 'connection',
  'keep-alive', 'idempotency-expires', 'idempotency-key', 'idempotent-replayed', 'retry-after']);

// The claim of a request: `request` is the hex of idempotency.request_fingerprint(method, path,
// query, body), which claim hashes again. The body goes to PostgreSQL as text, so numbers keep
// their exact value; a JSON body (by its content type) is judged by jsonb, any other body is
// {"sha256": "<hex of its bytes>"}, an empty one none: the same fingerprint as the Python and
// Rust clients give the same request.
const FINGERPRINT = (body) => `to_jsonb(encode(idempotency.request_fingerprint($2, $3, $4::text::jsonb, ${body}), 'hex'))`;
const CLAIM_HTTP = {
  json: `SELECT ${db.CLAIM_COLUMNS}, ${db.leaseSeconds('$7', '$8')} FROM idempotency.claim($1, ${FINGERPRINT('$5::text::jsonb')},
           scope => $6, ttl => $7::interval, lease => $8::interval) c`,
  bytes: `SELECT ${db.CLAIM_COLUMNS}, ${db.leaseSeconds('$7', '$8')} FROM idempotency.claim($1, ${FINGERPRINT("jsonb_build_object('sha256', encode(sha256($5::bytea), 'hex'))")},
           scope => $6, ttl => $7::interval, lease => $8::interval) c`,
};

function imfFixdate(date) {
  // Floored to the second: never promises more than the store keeps. toUTCString is IMF-fixdate.
  return new Date(Math.floor(date.getTime() / 1000) * 1000).toUTCString();
}

function isJsonType(contentType) {
  if (!contentType) return false;
  const t = String(contentType).split(';')[0].trim().toLowerCase();
  return t === 'application/json' || t.endsWith('+json');
}

// The query string as a JSON object; a repeated name gives an array.
function queryObject(search) {
  const out = {};
  for (const [k, v] of new URLSearchParams(search)) {
    if (!Object.prototype.hasOwnProperty.call(out, k)) out[k] = v;
    else if (Array.isArray(out[k])) out[k].push(v);
    else out[k] = [out[k], v];
  }
  return out;
}

class HttpIdempotency {
  constructor(options = {}) {
    this.q = new db.Db(options);
    this.ttl = db.interval(options.ttl ?? 86400, 'ttl');
    this.lease = db.interval(options.lease ?? 60, 'lease');
    this.waitMs = (options.wait ?? 0) * 1000;
    this.methods = new Set((options.methods ?? ['POST', 'PATCH']).map((m) => m.toUpperCase()));
    this.required = options.required ?? true;
    this.client = options.client ?? null;
    this.problemBase = options.problemBase ?? 'https://developer.example.com/idempotency/';
    this.store = options.storeResponse ?? ((status) => status < 500);
    this.onError = options.onError ?? ((err) => console.error('pg-idempotency:', err));
    // How long the claim tries to reach the database (seconds) before it answers 503; failOpen:
    // run the handler without the store when the database is unreachable (off by default).
    this.connectTimeout = options.connectTimeout ?? 5;
    this.failOpen = options.failOpen ?? false;
    // Accept a bare (unquoted, Stripe-style) key as well as the draft's String (off by default).
    this.lenientKeys = options.lenientKeys ?? false;
    this.replayHeaders = new Set((options.replayHeaders ?? REPLAY_HEADERS).map((h) => String(h).toLowerCase()));
  }

  applies(method, routeSetting) {
    if (routeSetting === false) return false;
    return routeSetting === true || this.methods.has(String(method).toUpperCase());
  }

  problem(status, slug, title, detail, headers = {}) {
    const body = Buffer.from(JSON.stringify({ type: `${this.problemBase}${slug}`, title, status, detail }));
    return { status, headers: { 'content-type': PROBLEM_JSON, ...headers }, body };
  }

  // Adds the idempotency headers to a response: the key as sent, Idempotency-Expires,
  // Idempotent-Replayed, Retry-After, Cache-Control: no-store.
  static decorate(r, { rawKey, expiresAt, replayed, retryAfter }) {
    const h = r.headers;
    if (rawKey !== undefined) h['idempotency-key'] = rawKey;
    if (expiresAt) h['idempotency-expires'] = imfFixdate(expiresAt);
    if (replayed) h['idempotent-replayed'] = 'true';
    if (retryAfter !== undefined) h['retry-after'] = String(retryAfter);
    if (!Object.keys(h).some((k) => k.toLowerCase() === 'cache-control')) h['cache-control'] = 'no-store';
    return r;
  }

  // req: { method, path, search, keyValues (every Idempotency-Key field line), contentType,
  //        body (Buffer | string | null: the raw body), parsedBody (a parsed body when the raw one
  //        is gone), native (the framework's request, for options.client) }
  // Returns { action: 'next' } (not ours), { action: 'respond', response } or
  // { action: 'run', ticket }.
  async begin(req) {
    const rawKey = req.keyValues && req.keyValues.length === 1 ? req.keyValues[0] : undefined;
    const echo = { rawKey };
    let client = '';
    if (this.client) {
      client = await this.client(req.native);
      if (!client) {
        const r = this.problem(401, 'unauthenticated', 'Client is not authenticated',
          'This operation needs an authenticated client', { 'www-authenticate': 'Bearer' });
        return { action: 'respond', response: HttpIdempotency.decorate(r, echo) };
      }
    }
    let key;
    try {
      key = parseHeader(req.keyValues, this.lenientKeys);
    } catch (err) {
      if (!(err instanceof KeyError)) throw err;
      if (err.kind === 'missing' && !this.required) return { action: 'next' };
      const [slug, title] = err.kind === 'missing' ? ['key-missing', 'Idempotency-Key is missing']
        : ['key-malformed', 'Idempotency-Key is malformed'];
      return { action: 'respond', response: HttpIdempotency.decorate(this.problem(400, slug, title, err.message), echo) };
    }
    const method = String(req.method).toUpperCase();
    const scope = client ? `${client}:${method} ${req.path}` : `${method} ${req.path}`;
    // The body: JSON text (a JSON content type), or bytes (any other body), or none (empty).
    let body = null;
    let sql = CLAIM_HTTP.json;
    if (req.body !== null && req.body !== undefined) {
      const buf = Buffer.isBuffer(req.body) ? req.body : Buffer.from(String(req.body));
      if (buf.length > 0 && isJsonType(req.contentType)) {
        try {
          body = new TextDecoder('utf-8', { fatal: true }).decode(buf);
        } catch {
          return { action: 'respond', response: HttpIdempotency.decorate(this.problem(400, 'bad-request', 'Bad request', 'the JSON body is not UTF-8'), echo) };
        }
      } else if (buf.length > 0) {
        body = buf;
        sql = CLAIM_HTTP.bytes;
      }
    } else if (req.parsedBody !== undefined && req.parsedBody !== null) {
      // The raw body is gone (a parser ran first): a string is taken as the bytes it was, an
      // object as the JSON it was parsed from.
      if (typeof req.parsedBody === 'string' || Buffer.isBuffer(req.parsedBody)) {
        body = Buffer.from(req.parsedBody);
        sql = body.length ? CLAIM_HTTP.bytes : CLAIM_HTTP.json;
        if (!body.length) body = null;
      } else {
        body = JSON.stringify(req.parsedBody);
      }
    }
    const query = queryObject(req.search ?? '');
    const params = [key, method, req.path, JSON.stringify(query), body, scope, this.ttl, this.lease];
    const started = Date.now();
    const deadline = started + this.waitMs;
    let c;
    let polled = false;
    // The claim's span ends with the claim (and the waits for an in-progress key); the handler and
    // the completion are not in it.
    const failed = await traced('claim', { scope, key }, async (op) => {
      for (;;) {
        try {
          c = await this.claim(sql, params, this.connectTimeout * 1000, op);
        } catch (err) {
          op.failed(err);
          if (this.failOpen && db.connectionLost(err)) {
            // Fail open (opted in): the handler runs without the store, unprotected.
            this.onError(err);
            return { action: 'next' };
          }
          return { action: 'respond', response: HttpIdempotency.decorate(this.dbError(err), echo) };
        }
        if (c.outcome === 'in_progress' && Date.now() < deadline) {
          polled = true;
          await db.sleep(Math.min((c.retryAfter ?? 1) * 1000, 200, deadline - Date.now()));
          continue;
        }
        op.claimed(c);
        if (polled) op.waited((Date.now() - started) / 1000); // it waited for an in-progress key
        return null;
      }
    });
    if (failed) return failed;
    if (c.outcome === 'new') {
      return {
        action: 'run',
        ticket: { key, scope, token: c.token, expiresAt: c.expiresAt, leaseEnd: c.leaseEnd, rawKey, sql, params },
      };
    }
    return { action: 'respond', response: await this.answer(c, { key, scope, rawKey }) };
  }

  async claim(sql, params, patience, op) {
    const rows = await this.q.query(sql, params, patience, op);
    return db.claimRow(rows[0]);
  }

  // The answer for replay, in_progress and mismatch.
  async answer(c, { key, scope, rawKey }) {
    if (c.outcome === 'replay') {
      return HttpIdempotency.decorate(unpack(c.response, c.responseStatus, this.replayHeaders), { rawKey, expiresAt: c.expiresAt, replayed: true });
    }
    if (c.outcome === 'in_progress') {
      const secs = c.retryAfter ?? 1;
      const r = this.problem(409, 'request-outstanding', 'A request is outstanding for this Idempotency-Key',
        `The first request with this key is still being processed; retry in ${secs} s`);
      return HttpIdempotency.decorate(r, { rawKey, expiresAt: c.expiresAt, retryAfter: secs });
    }
    // mismatch: claim returns no expires_at; the stored row tells how long the key stays taken.
    let expiresAt = null;
    try {
      expiresAt = await db.lookupExpires(this.q, { key, scope });
    } catch (err) {
      this.onError(err);
    }
    const r = this.problem(422, 'key-reused', 'Idempotency-Key is already used',
      'This key was used for a different request (method, path, query or body); use a new key for a new request');
    return HttpIdempotency.decorate(r, { rawKey, expiresAt });
  }

  // A database error of the claim as a problem response.
  dbError(err) {
    switch (err.code) {
      case '22P02':
        return this.problem(400, 'bad-request', 'Bad request', `the body is not JSON that PostgreSQL accepts: ${message(err)}`);
      case '22P05': case '22003': case '54001': case '54000':
        return this.problem(422, 'body-unstorable', 'The body cannot be stored', `the body is JSON, but PostgreSQL cannot take it: ${message(err)}`);
      case '22023': case '22004':
        return this.problem(400, 'key-malformed', 'Idempotency-Key is malformed', err.message);
      default:
        this.onError(err);
        return this.problem(503, 'database', 'Database unavailable', 'retry with the same Idempotency-Key', { 'retry-after': '1' });
    }
  }

  // The handler's response { status, headers (all of them: what is stored is Content-Type and
  // the allow-list), body: Buffer }: stored with
  // complete (or the key released for a status that storeResponse refuses, 5xx by default),
  // then returned with the idempotency headers. If another request took the key over meanwhile,
  // the stored answer is returned instead.
  async finish(ticket, res) {
    const { key, scope, token, rawKey, leaseEnd } = ticket;
    // The live answer is the handler's: the adapter sends it with the headers it set already, so
    // only the idempotency headers go into `out`.
    const out = { status: res.status, headers: {}, body: res.body };
    const own = Object.keys(res.headers ?? {}).find((k) => k.toLowerCase() === 'cache-control');
    if (own !== undefined) out.headers['cache-control'] = res.headers[own];
    if (!this.store(res.status)) {
      try {
        await db.release(this.q, { key, scope, token, leaseEnd });
      } catch (err) {
        this.onError(err); // the key stays in progress until its lease ends
      }
      return HttpIdempotency.decorate(out, { rawKey });
    }
    try {
      let expiresAt;
      try {
        // Repeated on new connections after a lost one (a pooler's server connection gone, a
        // restart), for as long as the lease lasts.
        expiresAt = await db.complete(this.q, {
          key, response: JSON.stringify(pack(res, this.replayHeaders)), status: res.status, scope, token, ttl: this.ttl, leaseEnd,
        });
      } catch (err) {
        // IK002 for our own token: an attempt whose answer was lost with its connection had
        // committed. The answer stored is this request's: it goes out live, not as a replay.
        expiresAt = err.code === 'IK002' ? await db.ownCompletion(this.q, { key, scope, token }) : null;
        if (expiresAt === null) throw err;
      }
      return HttpIdempotency.decorate(out, { rawKey, expiresAt });
    } catch (err) {
      if (db.fenced(err)) {
        // Completed or taken over by another request: answer what the store holds.
        try {
          const c = await this.claim(ticket.sql, ticket.params);
          if (c.outcome !== 'new') return await this.answer(c, { key, scope, rawKey });
          await db.release(this.q, { key, scope, token: c.token });
        } catch (again) {
          this.onError(again);
        }
      } else {
        this.onError(err);
      }
      // Not stored: the answer still goes out, without a promise about the key.
      return HttpIdempotency.decorate(out, { rawKey });
    }
  }

  close() {
    return this.q.end();
  }
}

function message(err) {
  return err.detail ? `${err.message}: ${err.detail}` : err.message;
}

// The headers of an answer that a replay carries: Content-Type and the allow-list, as
// [[name, value], ...] with lower-case names (a header set twice gives two pairs).
function replayable(headers, allowed = new Set(REPLAY_HEADERS)) {
  const out = [];
  const pairs = Array.isArray(headers) ? headers : Object.entries(headers ?? {});
  for (const [k, v] of pairs) {
    const name = String(k).toLowerCase();
    if (v === undefined || v === null) continue;
    if (name !== 'content-type' && (!allowed.has(name) || NEVER_REPLAYED.has(name))) continue;
    for (const one of Array.isArray(v) ? v : [v]) out.push([name, String(one)]);
  }
  return out;
}

// A response as stored in `response` (jsonb), the same in the Python, Node and Rust clients:
// { headers: [[name, value], ...] (Content-Type and the allow-list), content_type, body } with the
// body's exact bytes, so that a replay is byte-identical: as text, or base64 when it is not UTF-8
// or holds a NUL (then encoding: 'base64', and body_base64 too, which the Python client before
// 0.5.0 reads). response_status holds the status. Clients before 0.5.0 read it (Node: body and
// content type; Python: body and headers).
function pack({ headers, body }, allowed) {
  const buf = body === null || body === undefined ? Buffer.alloc(0) : Buffer.from(body);
  let text = null;
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(buf);
    if (text.includes('\u0000')) text = null; // jsonb strings cannot hold NUL
  } catch {
    // not UTF-8: stored as base64
  }
  const kept = replayable(headers, allowed);
  const ct = kept.find(([k]) => k === 'content-type');
  const b64 = text === null ? buf.toString('base64') : null;
  return {
    headers: kept,
    ...(ct ? { content_type: ct[1] } : {}),
    body: text ?? b64,
    ...(text === null ? { encoding: 'base64', body_base64: b64 } : {}),
  };
}

const ENVELOPE = new Set(['headers', 'content_type', 'body', 'body_base64', 'encoding']);

// The stored answer as { status, headers, body }: the form above (also as older clients wrote
// it), or a plain JSON value that other code completed the key with (sent as JSON).
function unpack(response, status, allowed) {
  const headers = {};
  let body;
  status = status ?? 200;
  const envelope = response && typeof response === 'object' && !Array.isArray(response)
    && Object.keys(response).every((k) => ENVELOPE.has(k))
    && (typeof response.body === 'string' || typeof response.body_base64 === 'string');
  if (envelope) {
    if (typeof response.body_base64 === 'string') body = Buffer.from(response.body_base64, 'base64');
    else body = Buffer.from(response.body, response.encoding === 'base64' ? 'base64' : 'utf8');
    const pairs = Array.isArray(response.headers) ? response.headers.filter((p) => Array.isArray(p) && p.length === 2) : [];
    if (response.content_type && !pairs.some(([k]) => String(k).toLowerCase() === 'content-type')) {
      pairs.unshift(['content-type', response.content_type]);
    }
    for (const [k, v] of replayable(pairs, allowed)) {
      if (headers[k] === undefined) headers[k] = v;
      else headers[k] = [].concat(headers[k], v);
    }
  } else if (response === null || response === undefined) {
    body = Buffer.alloc(0);
  } else {
    // Completed by other code with a plain JSON response.
    body = Buffer.from(JSON.stringify(response));
    headers['content-type'] = status >= 400 ? PROBLEM_JSON : 'application/json';
  }
  return { status, headers, body };
}

module.exports = { HttpIdempotency, imfFixdate, queryObject, isJsonType, pack, unpack, replayable, PROBLEM_JSON, REPLAY_HEADERS };
