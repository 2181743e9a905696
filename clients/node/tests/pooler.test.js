'use strict';
// Two instances of a service on one store, each with a pool of its own, racing duplicates: the
// deployment a connection pooler serves. Run with IDEMPOTENCY_TEST_POOLER=transaction (or
// session) the instances reach the cluster through PgBouncer (tests/cluster.js); direct, they
// reach it themselves. Each key's side effect runs once, and every duplicate is answered with the
// stored result or as in progress.

const { test: nodeTest, before, after } = require('node:test');

const test = (title, fn) => nodeTest(title, { timeout: 60000 }, fn);
const assert = require('node:assert/strict');
const http = require('node:http');
const express = require('express');
const Fastify = require('fastify');
const { idempotent, expressIdempotency, fastifyIdempotency } = require('..');
const { startCluster } = require('./cluster');

const KEYS = 50;
const DUPLICATES = 16; // per key, split between the two instances
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

let cluster;
let inspect;

before(async () => {
  cluster = await startCluster();
  inspect = cluster.directPool({ max: 2 });
});

after(async () => {
  await inspect.end();
  cluster.destroy();
});

function post(base, key) {
  return new Promise((resolve, reject) => {
    const body = Buffer.from(JSON.stringify({ amount: 5 }));
    const req = http.request(new URL('/orders', base), {
      method: 'POST',
      agent: false, // a connection per request: every duplicate really is in flight at once
      headers: { 'content-type': 'application/json', 'content-length': body.length, 'idempotency-key': `"${key}"`, 'x-client-id': 'c' },
    }, (res) => {
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => resolve({ status: res.statusCode, headers: res.headers, raw: Buffer.concat(chunks) }));
    });
    req.on('error', reject);
    req.setTimeout(30000, () => req.destroy(new Error(`no answer for ${key} in 30 s`)));
    req.end(body);
  });
}

test(`two HTTP instances (Express and Fastify), ${DUPLICATES} racing duplicates of each of ${KEYS} keys: each handler runs once per key, every duplicate replays or gets 409`, async () => {
  const effects = new Map();
  const handle = async (key) => {
    effects.set(key, (effects.get(key) ?? 0) + 1);
    await sleep(100); // the duplicates arrive while it runs
    return { order: key, amount: 5 };
  };
  const pools = [cluster.pool({ max: 10 }), cluster.pool({ max: 10 })];
  const options = (pool) => ({ pool, client: (req) => req.headers['x-client-id'], lease: 20 });

  const a = express();
  a.post('/orders', expressIdempotency(options(pools[0])), (req, res, next) => {
    handle(req.headers['idempotency-key']).then((r) => res.status(201).json(r), next);
  });
  const serverA = await new Promise((resolve) => { const s = a.listen(0, '127.0.0.1', () => resolve(s)); });
  const b = Fastify();
  await b.register(fastifyIdempotency, options(pools[1]));
  b.post('/orders', async (request, reply) => reply.code(201).send(await handle(request.headers['idempotency-key'])));
  await b.listen({ port: 0, host: '127.0.0.1' });
  const bases = [`http://127.0.0.1:${serverA.address().port}`, `http://127.0.0.1:${b.server.address().port}`];
  try {
    const keys = Array.from({ length: KEYS }, (_, i) => `race-${i}`);
    const sent = [];
    for (let d = 0; d < DUPLICATES; d += 1) {
      for (const key of keys) sent.push(post(bases[d % 2], key).then((r) => ({ key, ...r })));
    }
    const answers = await Promise.all(sent);
    assert.equal(answers.length, KEYS * DUPLICATES);
    assert.ok(answers.some((r) => r.status === 409), 'duplicates arrived while the first request of their key ran');
    for (const key of keys) {
      assert.equal(effects.get(`"${key}"`), 1, `${key} ran once`);
      const mine = answers.filter((r) => r.key === key);
      const first = mine.filter((r) => r.status === 201 && r.headers['idempotent-replayed'] === undefined);
      assert.equal(first.length, 1, `${key}: one answer is the handler's own`);
      for (const r of mine) {
        if (r === first[0]) continue;
        if (r.status === 409) {
          assert.ok(Number(r.headers['retry-after']) >= 1, `${key}: 409 with Retry-After`);
        } else {
          assert.equal(r.status, 201, `${key}: ${r.status} ${r.raw}`);
          assert.equal(r.headers['idempotent-replayed'], 'true');
          assert.ok(r.raw.equals(first[0].raw), `${key}: the replay is the first answer`);
        }
      }
    }
    const { rows } = await inspect.query(`SELECT count(*)::int AS n FROM idempotency.idempotency_keys
      WHERE scope = 'c:POST /orders' AND status = 'completed'`);
    assert.equal(rows[0].n, KEYS, 'every key is stored completed');
  } finally {
    await new Promise((resolve) => { serverA.closeAllConnections(); serverA.close(resolve); });
    await b.close();
    await Promise.all(pools.map((p) => p.end()));
  }
});

test(`two idempotent() wrappers on two pools, ${DUPLICATES} racing duplicates of each of ${KEYS} keys: the function runs once per key, every duplicate gets its result`, async () => {
  const effects = new Map();
  const pools = [cluster.pool({ max: 10 }), cluster.pool({ max: 10 })];
  const [a, b] = pools.map((pool) => idempotent(async (id) => {
    effects.set(id, (effects.get(id) ?? 0) + 1);
    await sleep(100);
    return { sent: id };
  }, { key: (id) => `receipt-${id}`, scope: 'receipts', pool, lease: 20, wait: 20 }));
  try {
    const calls = [];
    for (let d = 0; d < DUPLICATES; d += 1) {
      for (let id = 0; id < KEYS; id += 1) calls.push((d % 2 ? a : b).detailed(id).then((r) => ({ id, ...r })));
    }
    const results = await Promise.all(calls);
    for (let id = 0; id < KEYS; id += 1) {
      assert.equal(effects.get(id), 1, `receipt ${id} went out once`);
      const mine = results.filter((r) => r.id === id);
      assert.equal(mine.length, DUPLICATES);
      assert.equal(mine.filter((r) => r.outcome === 'new').length, 1);
      assert.equal(mine.filter((r) => r.outcome === 'replay').length, DUPLICATES - 1);
      for (const r of mine) assert.deepEqual(r.value, { sent: id });
    }
  } finally {
    await Promise.all(pools.map((p) => p.end()));
  }
});
