'use strict';
// The HTTP behaviour, the same for every framework: tests/express.test.js and
// tests/fastify.test.js run this suite against a real server of their framework, with real HTTP
// requests, on a throwaway cluster. `serve(options)` starts a server whose routes call
// `handler` and returns { url, close }.

const { test: nodeTest, before, after } = require('node:test');
const assert = require('node:assert/strict');
const http = require('node:http');
const path = require('node:path');
const { spawn } = require('node:child_process');
const { startCluster, NO_RESTART } = require('./cluster');
const { LosingProxy } = require('./losing-proxy');

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Raw HTTP, so that a header can be sent twice and bodies compared byte for byte.
function request(base, path, { method = 'POST', headers = {}, body } = {}) {
  return new Promise((resolve, reject) => {
    const data = body === undefined ? undefined : Buffer.from(typeof body === 'string' ? body : JSON.stringify(body));
    const req = http.request(new URL(path, base), {
      method,
      headers: { ...(data ? { 'content-type': 'application/json', 'content-length': data.length } : {}), ...headers },
    }, (res) => {
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => {
        const raw = Buffer.concat(chunks);
        let json;
        try { json = JSON.parse(raw.toString()); } catch { json = undefined; }
        resolve({ status: res.statusCode, headers: res.headers, raw, json });
      });
    });
    req.on('error', reject);
    req.setTimeout(30000, () => req.destroy(new Error(`no answer to ${method} ${path} in 30 s`)));
    if (data) req.write(data);
    req.end();
  });
}

// The application behind the routes: one execution per order, counted per key.
function makeApp(cluster) {
  const executions = new Map();
  const failedOnce = new Set();
  async function handler({ headers, body, path }) {
    const key = `${headers['x-client-id'] ?? ''} ${headers['idempotency-key'] ?? ''}`;
    executions.set(key, (executions.get(key) ?? 0) + 1);
    const delay = Number(headers['x-test-delay-ms'] ?? 0);
    if (delay) await sleep(delay);
    if (headers['x-test-fail-once'] && !failedOnce.has(key)) {
      failedOnce.add(key);
      throw new Error('a bug in the handler');
    }
    if (headers['x-test-restart']) {
      cluster.stop('fast'); // the database goes away mid-request, back after a second
      setTimeout(() => cluster.restart(), 1000);
    }
    if (headers['x-test-headers']) {
      return {
        status: 201,
        headers: {
          location: '/orders/7', etag: '"v1"', 'set-cookie': 'session=first-caller', 'x-request-id': 'req-1',
          'content-type': 'text/plain; charset=utf-8',
        },
        text: 'got 7 bytes',
      };
    }
    if (path === '/orders' && !(Number(body?.amount) > 0)) {
      return { status: 422, body: { type: 'https://shop.example/invalid-order', title: 'Invalid order', status: 422 } };
    }
    return { status: 201, body: { order: executions.size, amount: body?.amount ?? null, received: body } };
  }
  const count = (client, k) => executions.get(`${client} ${k}`) ?? 0;
  return { handler, count };
}

function httpSuite(name, serve) {
  const test = (title, fn, options = {}) => nodeTest(title, { timeout: 90000, ...options }, fn);
  let cluster;
  let pool; // superuser, for the tests' own looks at the store
  let appPool;
  let app;
  let srv; // wait 0: duplicates get 409 at once
  let waiting; // wait 10 s: duplicates wait and replay
  const post = (path, key, body, { client = 'client-7', headers = {}, server = srv } = {}) => request(server.url, path, {
    headers: { ...(client ? { 'x-client-id': client } : {}), ...(key === undefined ? {} : { 'idempotency-key': key }), ...headers },
    body,
  });

  before(async () => {
    cluster = await startCluster();
    pool = cluster.pool();
    app = makeApp(cluster);
    // The servers connect as an application role with the one grant it needs.
    // On an existing server (IDEMPOTENCY_TEST_CONNINFO) an earlier test file may have made the role.
    await pool.query(`DO $$ BEGIN CREATE ROLE app LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
      GRANT USAGE ON SCHEMA idempotency TO app`);
    appPool = cluster.pool({ user: 'app' });
    const client = (req) => req.headers['x-client-id'];
    srv = await serve({ pool: appPool, client, ttl: 3600, lease: 3 }, app.handler);
    waiting = await serve({ pool: appPool, client, ttl: 3600, lease: 10, wait: 10 }, app.handler);
  });

  after(async () => {
    await srv.close();
    await waiting.close();
    await appPool.end();
    await pool.end();
    cluster.destroy();
  });

  const expiresOf = async (key, scope) => (await pool.query(
    'SELECT (idempotency.lookup($1, $2)).expires_at AS e', [key, scope])).rows[0].e;

  test(`${name}: new, then a byte-identical replay flagged Idempotent-Replayed; reordered JSON replays too`, async () => {
    const body = '{"items":[{"sku":"A1","qty":2}],"amount":59.90,"currency":"EUR"}';
    const first = await post('/orders', '"k-1"', body);
    assert.equal(first.status, 201);
    assert.equal(first.headers['idempotency-key'], '"k-1"');
    assert.equal(first.headers['cache-control'], 'no-store');
    assert.equal(first.headers['idempotent-replayed'], undefined);
    assert.match(first.headers['content-type'], /^application\/json/);
    const stored = await expiresOf('k-1', 'client-7:POST /orders');
    assert.equal(Date.parse(first.headers['idempotency-expires']), Math.floor(stored.getTime() / 1000) * 1000);
    assert.ok(stored.getTime() > Date.now() + 3500 * 1000);
    const again = await post('/orders', '"k-1"', body);
    assert.equal(again.status, 201);
    assert.equal(again.headers['idempotent-replayed'], 'true');
    assert.equal(again.headers['idempotency-expires'], first.headers['idempotency-expires']);
    assert.equal(again.headers['content-type'], first.headers['content-type']);
    assert.ok(again.raw.equals(first.raw), 'the same bytes');
    const reordered = await post('/orders', '"k-1";p=1', '{ "currency": "EUR", "amount": 59.9, "items": [{"qty": 2, "sku": "A1"}] }');
    assert.equal(reordered.status, 201);
    assert.equal(reordered.headers['idempotent-replayed'], 'true');
    assert.equal(reordered.headers['idempotency-key'], '"k-1";p=1');
    assert.equal(app.count('client-7', '"k-1"'), 1);
  });

  test(`${name}: header leak and loss: the first answer keeps the handler's headers; a replay only the allow-list`, async () => {
    const first = await post('/orders', '"h-1"', { amount: 1 }, { headers: { 'x-test-headers': '1' } });
    assert.equal(first.status, 201);
    assert.equal(first.raw.toString(), 'got 7 bytes');
    assert.equal(first.headers['content-type'], 'text/plain; charset=utf-8');
    assert.equal(first.headers.location, '/orders/7');
    assert.deepEqual(first.headers['set-cookie'], ['session=first-caller']);
    assert.equal(first.headers['x-request-id'], 'req-1');
    const again = await post('/orders', '"h-1"', { amount: 1 });
    assert.equal(again.status, 201);
    assert.equal(again.headers['idempotent-replayed'], 'true');
    assert.equal(again.raw.toString(), 'got 7 bytes');
    assert.equal(again.headers['content-type'], 'text/plain; charset=utf-8');
    assert.equal(again.headers.location, '/orders/7');
    assert.equal(again.headers.etag, '"v1"');
    assert.equal(again.headers['set-cookie'], undefined, 'never the first caller\'s cookie');
    assert.equal(again.headers['x-request-id'], undefined);
    assert.equal(app.count('client-7', '"h-1"'), 1);
  });

  test(`${name}: any body is accepted and fingerprinted as the Python and Rust clients do (text, form, empty)`, async () => {
    const cases = [['b-text', 'text/plain', 'hello'], ['b-form', 'application/x-www-form-urlencoded', 'a=1&b=2'], ['b-empty', undefined, '']];
    for (const [k, type, body] of cases) {
      const send = () => request(srv.url, '/refunds', {
        headers: { 'x-client-id': 'client-7', 'idempotency-key': `"${k}"`, ...(type ? { 'content-type': type } : {}), 'content-length': Buffer.byteLength(body) },
        body: body === '' ? undefined : body,
      });
      const a = await send();
      assert.equal(a.status, 201, `${k}: ${a.raw}`);
      const b = await send();
      assert.equal(b.headers['idempotent-replayed'], 'true', k);
      // The reference fingerprint, the one the Python and Rust clients' tests check as well.
      const ref = body === '' ? 'NULL::jsonb' : "jsonb_build_object('sha256', encode(sha256($3::bytea), 'hex'))";
      await pool.query(`SELECT idempotency.claim($1, request => to_jsonb(encode(idempotency.request_fingerprint('POST', '/refunds', '{}'::jsonb, ${ref}), 'hex')), scope => $2) WHERE $3::bytea IS NOT NULL`,
        [k, 'reference', Buffer.from(body)]);
      const { rows } = await pool.query(`SELECT a.request_hash = b.request_hash AS same FROM idempotency.idempotency_keys a
        JOIN idempotency.idempotency_keys b ON b.key = a.key AND b.scope = 'reference' WHERE a.key = $1 AND a.scope = $2`,
      [k, 'client-7:POST /refunds']);
      assert.deepEqual(rows, [{ same: true }], k);
    }
    const other = await request(srv.url, '/refunds', {
      headers: { 'x-client-id': 'client-7', 'idempotency-key': '"b-text"', 'content-type': 'text/plain' }, body: 'hellO',
    });
    assert.equal(other.status, 422);
  });

  test(`${name}: a database that does not answer: 503 problem+json with Retry-After within connectTimeout; failOpen runs the handler`, async () => {
    // Accepts TCP connections, never answers: only a connect timeout ends the wait.
    const hole = require('node:net').createServer(() => {});
    await new Promise((resolve) => hole.listen(0, '127.0.0.1', resolve));
    const connectionString = `postgresql://app@127.0.0.1:${hole.address().port}/shop`;
    const client = (req) => req.headers['x-client-id'];
    try {
      for (const failOpen of [false, true]) {
        const down = await serve({ connectionString, client, connectTimeout: 1, failOpen, onError: () => {} }, app.handler);
        try {
          const started = Date.now();
          const r = await post('/orders', `"down-${failOpen}"`, { amount: 1 }, { server: down });
          assert.ok(Date.now() - started < 5000, `${Date.now() - started} ms`);
          if (failOpen) {
            assert.equal(r.status, 201);
            assert.equal(app.count('client-7', `"down-${failOpen}"`), 1);
          } else {
            assert.equal(r.status, 503);
            assert.equal(r.headers['content-type'], 'application/problem+json');
            assert.equal(r.headers['retry-after'], '1');
            assert.equal(app.count('client-7', `"down-${failOpen}"`), 0);
          }
        } finally {
          await down.close();
        }
      }
    } finally {
      hole.close();
    }
  });

  test(`${name}: lenientKeys accepts a bare (Stripe-style) key, the same key as its quoted form; refused by default`, async () => {
    const bare = 'ab8e03978e-40d5-43e8-bc93-6894a57f9324';
    const strict = await post('/orders', bare, { amount: 1 });
    assert.equal(strict.status, 400);
    assert.match(strict.json.detail, /^Idempotency-Key is a bare Token, not a String: the key must be a structured-field String \(RFC 9651\) in double quotes/);
    const lenient = await serve({ pool: appPool, client: (req) => req.headers['x-client-id'], lenientKeys: true }, app.handler);
    try {
      const a = await post('/orders', bare, { amount: 1 }, { server: lenient });
      assert.equal(a.status, 201);
      assert.equal(a.headers['idempotency-key'], bare);
      const b = await post('/orders', `"${bare}"`, { amount: 1 }, { server: lenient });
      assert.equal(b.headers['idempotent-replayed'], 'true');
      assert.equal((await post('/orders', 'a b', { amount: 1 }, { server: lenient })).status, 400);
      assert.equal((await post('/orders', 'k'.repeat(256), { amount: 1 }, { server: lenient })).status, 400);
    } finally {
      await lenient.close();
    }
  });

  test(`${name}: the same key for another body or query is 422 problem+json with Idempotency-Expires`, async () => {
    await post('/orders', '"k-2"', { amount: 5 });
    for (const [path, body] of [['/orders', { amount: 6 }], ['/orders?coupon=x', { amount: 5 }]]) {
      const r = await post(path, '"k-2"', body);
      assert.equal(r.status, 422);
      assert.equal(r.headers['content-type'], 'application/problem+json');
      assert.equal(r.json.type, 'https://developer.example.com/idempotency/key-reused');
      assert.equal(r.json.title, 'Idempotency-Key is already used');
      assert.ok(Date.parse(r.headers['idempotency-expires']) > Date.now());
    }
    assert.equal(app.count('client-7', '"k-2"'), 1);
  });

  test(`${name}: a missing or malformed key is 400 problem+json and runs nothing`, async () => {
    const missing = await post('/orders', undefined, { amount: 1 });
    assert.equal(missing.status, 400);
    assert.equal(missing.headers['content-type'], 'application/problem+json');
    assert.equal(missing.json.title, 'Idempotency-Key is missing');
    for (const [key, detail] of [
      ['k-3', /a bare Token, not a String/], ['1', /an Integer or Decimal/], ['?1', /a Boolean/],
      ['"k-3', /no closing quote/], ['"a\\b"', /bad escape/], ['"k" x', /after the closing quote/],
      ['"k";P=1', /malformed parameter at position 5/], ['""', /empty/], [`"${'x'.repeat(256)}"`, /too long: 256/],
      [['"a"', '"b"'], /more than once/],
    ]) {
      const r = await post('/orders', key, { amount: 1 });
      assert.equal(r.status, 400, String(key));
      assert.equal(r.json.title, 'Idempotency-Key is malformed');
      assert.equal(r.json.type, 'https://developer.example.com/idempotency/key-malformed');
      assert.match(r.json.detail, detail);
    }
    assert.equal(app.count('client-7', ''), 0);
  });

  test(`${name}: keys are scoped per client and route; no client is 401`, async () => {
    assert.equal((await post('/orders', '"k-4"', { amount: 1 })).status, 201);
    const other = await post('/orders', '"k-4"', { amount: 2 }, { client: 'client-8' });
    assert.equal(other.status, 201);
    assert.equal(other.headers['idempotent-replayed'], undefined);
    const route = await post('/refunds', '"k-4"', { amount: 3 });
    assert.equal(route.status, 201);
    assert.equal(route.headers['idempotent-replayed'], undefined);
    const anonymous = await post('/orders', '"k-4"', { amount: 1 }, { client: null });
    assert.equal(anonymous.status, 401);
    assert.equal(anonymous.headers['content-type'], 'application/problem+json');
  });

  test(`${name}: a duplicate during the first request is 409 with Retry-After; afterwards a replay`, async () => {
    const first = post('/orders', '"k-5"', { amount: 1 }, { headers: { 'x-test-delay-ms': '1200' } });
    for (let i = 0; i < 200 && (await expiresOf('k-5', 'client-7:POST /orders')) === null; i += 1) await sleep(25);
    const dup = await post('/orders', '"k-5"', { amount: 1 });
    assert.equal(dup.status, 409);
    assert.equal(dup.json.title, 'A request is outstanding for this Idempotency-Key');
    assert.ok(Number(dup.headers['retry-after']) >= 1 && Number(dup.headers['retry-after']) <= 3);
    assert.ok(Date.parse(dup.headers['idempotency-expires']) > Date.now());
    assert.equal((await first).status, 201);
    const later = await post('/orders', '"k-5"', { amount: 1 });
    assert.equal(later.headers['idempotent-replayed'], 'true');
    assert.equal(app.count('client-7', '"k-5"'), 1);
  });

  test(`${name}: a storm of 20 identical requests runs the handler once (409s without wait, all replays with it)`, async () => {
    const storm = (key, server) => Promise.all(Array.from({ length: 20 },
      () => post('/orders', key, { amount: 9 }, { server, headers: { 'x-test-delay-ms': '300' } })));
    const plain = await storm('"k-6"', srv);
    assert.equal(plain.filter((r) => r.status === 201 && !r.headers['idempotent-replayed']).length, 1);
    assert.ok(plain.every((r) => r.status === 409 || r.status === 201), plain.map((r) => r.status).join());
    const patient = await storm('"k-7"', waiting);
    assert.ok(patient.every((r) => r.status === 201 && r.raw.equals(patient[0].raw)));
    assert.equal(patient.filter((r) => r.headers['idempotent-replayed'] === 'true').length, 19);
    assert.equal(app.count('client-7', '"k-6"'), 1);
    assert.equal(app.count('client-7', '"k-7"'), 1);
  });

  test(`${name}: a handler that fails (500) releases the key; a stored 4xx replays`, async () => {
    const failed = await post('/orders', '"k-8"', { amount: 1 }, { headers: { 'x-test-fail-once': '1' } });
    assert.equal(failed.status, 500);
    assert.equal(failed.headers['idempotency-expires'], undefined);
    assert.equal(await expiresOf('k-8', 'client-7:POST /orders'), null);
    const retry = await post('/orders', '"k-8"', { amount: 1 }, { headers: { 'x-test-fail-once': '1' } });
    assert.equal(retry.status, 201);
    const invalid = await post('/orders', '"k-9"', { amount: 0 });
    assert.equal(invalid.status, 422);
    const replay = await post('/orders', '"k-9"', { amount: 0 });
    assert.equal(replay.status, 422);
    assert.equal(replay.headers['idempotent-replayed'], 'true');
    assert.ok(replay.raw.equals(invalid.raw));
    assert.equal(app.count('client-7', '"k-9"'), 1);
  });

  test(`${name}: the fingerprint is the exact body (numbers beyond a double); jsonb refusals claim nothing`, async () => {
    const big = '{"amount": 1, "id": 123456789012345678901234567890, "tiny": 1e-400}';
    assert.equal((await post('/orders', '"k-10"', big)).status, 201);
    const near = await post('/orders', '"k-10"', '{"amount": 1, "id": 123456789012345678901234567891, "tiny": 1e-400}');
    assert.equal(near.status, 422, 'a different number beyond double precision is another request');
    const nul = await post('/orders', '"k-11"', '{"amount": 1, "note": "a\\u0000b"}');
    assert.equal(nul.status, 422);
    assert.equal(nul.json.type, 'https://developer.example.com/idempotency/body-unstorable');
    const broken = await post('/orders', '"k-11"', '{"amount": ');
    assert.equal(broken.status, 400);
    // problem+json, as every other refusal (Fastify's own parser answered its own JSON)
    assert.equal(broken.headers['content-type'], 'application/problem+json');
    assert.equal(broken.json.title, 'Bad request');
    assert.equal(broken.headers['idempotency-key'], '"k-11"');
    assert.equal((await post('/orders', '"k-11"', { amount: 1 })).status, 201, 'the key stayed free');
  });

  test(`${name}: other methods pass through without a key`, async () => {
    const r = await request(srv.url, '/orders', { method: 'GET', headers: { 'x-client-id': 'client-7' } });
    assert.equal(r.status, 200);
  });

  test(`${name}: a server killed mid-request: 409 until the lease ends, then the retry runs as new`, async () => {
    const child = spawn(process.execPath, [path.join(__dirname, 'fixtures', 'crash-server.js'), name, '2'],
      { env: cluster.env(), stdio: ['ignore', 'pipe', 'inherit'] });
    let out = '';
    const seen = (what) => new Promise((resolve, reject) => {
      const check = () => {
        const m = what.exec(out);
        if (m) resolve(m);
      };
      child.stdout.on('data', (d) => { out += d; check(); });
      child.on('exit', (code) => reject(new Error(`the server exited (${code})`)));
      check();
    });
    const [, port] = await seen(/listening (\d+)/);
    const lost = post('/orders', '"k-13"', { amount: 4 }, { server: { url: `http://127.0.0.1:${port}` } }).catch((err) => err);
    await seen(/handling/);
    const token = async () => (await pool.query("SELECT token::text FROM idempotency.lookup('k-13', 'client-7:POST /orders')")).rows[0].token;
    const first = await token();
    child.kill('SIGKILL');
    await lost;
    const dup = await post('/orders', '"k-13"', { amount: 4 });
    assert.equal(dup.status, 409);
    const wait = Number(dup.headers['retry-after']);
    assert.ok(wait >= 1 && wait <= 2, `Retry-After ${wait}`);
    await sleep(wait * 1000 + 100);
    const retry = await post('/orders', '"k-13"', { amount: 4 });
    assert.equal(retry.status, 201);
    assert.equal(retry.headers['idempotent-replayed'], undefined);
    assert.ok(BigInt(await token()) > BigInt(first), 'taken over with a larger token');
    assert.equal(app.count('client-7', '"k-13"'), 1);
  });

  test(`${name}: the answer of complete lost after it committed: the request gets its own live answer, the retry replays`, async () => {
    const proxy = await new LosingProxy(cluster.config(), 'idempotency.complete($1').start();
    const lossy = cluster.pool(proxy.config({ user: 'app' }));
    const server = await serve({ pool: lossy, client: (req) => req.headers['x-client-id'], lease: 10 }, app.handler);
    try {
      const r = await post('/orders', '"k-14"', { amount: 2 }, { server, headers: { 'x-test-headers': '1' } });
      assert.equal(proxy.cut, 1, 'the connection broke after the complete');
      assert.equal(proxy.seen, 2, 'the complete was sent again');
      assert.equal(r.status, 201);
      assert.equal(r.headers['idempotent-replayed'], undefined);
      assert.equal(r.headers['set-cookie']?.[0], 'session=first-caller', 'the live answer, not the stored one');
      const expires = await expiresOf('k-14', 'client-7:POST /orders');
      assert.equal(Date.parse(r.headers['idempotency-expires']), Math.floor(expires.getTime() / 1000) * 1000);
      const again = await post('/orders', '"k-14"', { amount: 2 }, { server });
      assert.equal(again.headers['idempotent-replayed'], 'true');
      assert.ok(again.raw.equals(r.raw));
      assert.equal(app.count('client-7', '"k-14"'), 1);
    } finally {
      await server.close();
      await lossy.end();
      await proxy.close();
    }
  });

  test(`${name}: a database restart mid-request: the answer is stored after reconnecting, the retry replays`, async () => {
    const r = await post('/orders', '"k-12"', { amount: 3 }, { headers: { 'x-test-restart': '1' } });
    assert.equal(r.status, 201);
    assert.ok(Date.parse(r.headers['idempotency-expires']) > Date.now());
    const again = await post('/orders', '"k-12"', { amount: 3 });
    assert.equal(again.headers['idempotent-replayed'], 'true');
    assert.ok(again.raw.equals(r.raw));
    assert.equal(app.count('client-7', '"k-12"'), 1);
  }, { skip: NO_RESTART });
}

module.exports = { httpSuite, request };
