'use strict';
// OpenTelemetry spans and metrics (with the optional peer dependency @opentelemetry/api), read
// back with the SDK's InMemorySpanExporter and a metric reader, against a throwaway cluster
// (tests/cluster.js); and the package without @opentelemetry/api. Direct mode only: the spans do
// not depend on the route (scripts/clients-node.sh says so too).

const { test: nodeTest, before, after } = require('node:test');

const assert = require('node:assert/strict');
const { spawnSync } = require('node:child_process');
const path = require('node:path');
const api = require('@opentelemetry/api');
const { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor } = require('@opentelemetry/sdk-trace-base');
const { MeterProvider, MetricReader } = require('@opentelemetry/sdk-metrics');
const { startCluster, POOLER } = require('./cluster');

const skip = POOLER !== 'direct' ? 'OpenTelemetry tests run in the direct mode only' : false;
const test = (title, fn) => nodeTest(title, { timeout: 90000, skip }, fn);

const exporter = new InMemorySpanExporter();
api.trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] }));
class Reader extends MetricReader {
  async onForceFlush() {}
  async onShutdown() {}
}
const reader = new Reader();
api.metrics.setGlobalMeterProvider(new MeterProvider({ readers: [reader] }));

// Loaded after the providers: either order works (the tracer is the API's proxy; the
// instruments follow the global meter provider).
const { idempotent, idempotentTransaction, FencedError } = require('..');
const db = require('../lib/db');
const { keyHash } = require('../lib/otel');

const SECRET_KEY = 'order-7f3a-SECRETKEY';
const SECRET_REQUEST = JSON.stringify({ card: '4111-SECRETREQUEST', amount: 42 });

let cluster;
let pool;
let direct;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

before(async () => {
  if (skip) return;
  cluster = await startCluster();
  pool = cluster.pool();
  direct = cluster.directPool();
});

after(async () => {
  if (skip) return;
  await pool.end();
  await direct.end();
  cluster.destroy();
});

const spans = () => exporter.getFinishedSpans().filter((s) => s.name.startsWith('idempotency.'));

// { 'attr=value,...': value } of a metric (cumulative): a sum's value, a histogram's count.
async function points(name) {
  const { resourceMetrics } = await reader.collect();
  const out = {};
  for (const sm of resourceMetrics.scopeMetrics) {
    for (const m of sm.metrics) {
      if (m.descriptor.name !== name) continue;
      for (const p of m.dataPoints) {
        const k = Object.entries(p.attributes).map(([a, v]) => `${a}=${v}`).sort().join(',');
        out[k] = typeof p.value === 'number' ? p.value : p.value.count;
      }
    }
  }
  return out;
}

function delta(before, after) {
  const out = {};
  for (const [k, v] of Object.entries(after)) if (v - (before[k] ?? 0)) out[k] = v - (before[k] ?? 0);
  return out;
}

function assertNoSecret(all) {
  for (const s of all) {
    for (const [name, value] of Object.entries(s.attributes)) {
      const text = typeof value === 'string' ? value : JSON.stringify(value);
      for (const secret of [SECRET_KEY, 'SECRETKEY', 'SECRETREQUEST']) {
        assert.ok(!text.includes(secret), `${s.name} ${name} carries the key or the request`);
      }
    }
    assert.ok(!String(s.status.message ?? '').includes('SECRET'));
    assert.equal(s.events.length, 0);
  }
}

test('spans of new, in_progress, mismatch, checkpoint, takeover, a fenced complete, replay and release', async () => {
  exporter.reset();
  const claims0 = await points('idempotency.claims');
  const durations0 = await points('idempotency.claim.duration');
  const d = new db.Db({ pool });
  const scope = 'tenant-1';
  const first = await db.claim(d, { key: SECRET_KEY, request: SECRET_REQUEST, scope, ttl: null, lease: '600 milliseconds' });
  assert.equal(first.outcome, 'new');
  const busy = await db.claim(d, { key: SECRET_KEY, request: SECRET_REQUEST, scope, ttl: null, lease: null });
  assert.equal(busy.outcome, 'in_progress');
  const wrong = await db.claim(d, { key: SECRET_KEY, request: '{"card":"other-SECRETREQUEST"}', scope, ttl: null, lease: null });
  assert.equal(wrong.outcome, 'mismatch');
  await db.checkpoint(d, { key: SECRET_KEY, point: 'charged', scope, token: first.token });
  await sleep(800); // the first attempt's lease runs out: the next claim takes it over
  const second = await db.claim(d, { key: SECRET_KEY, request: SECRET_REQUEST, scope, ttl: null, lease: '30 seconds' });
  assert.equal(second.outcome, 'new');
  assert.ok(BigInt(second.token) > BigInt(first.token));
  assert.equal(second.recoveryPoint, 'charged');
  await assert.rejects(db.complete(d, { key: SECRET_KEY, response: '{"ok":true}', status: 201, scope, token: first.token, ttl: null }),
    (err) => err.code === 'IK003');
  await db.complete(d, { key: SECRET_KEY, response: '{"ok":true}', status: 201, scope, token: second.token, ttl: null });
  const again = await db.claim(d, { key: SECRET_KEY, request: SECRET_REQUEST, scope, ttl: null, lease: null });
  assert.equal(again.outcome, 'replay');
  const other = await db.claim(d, { key: 'release-me-SECRETKEY', request: null, scope, ttl: null, lease: null });
  assert.equal(await db.release(d, { key: 'release-me-SECRETKEY', scope, token: other.token }), true);

  const got = spans();
  assert.deepEqual(got.map((s) => s.name), [
    'idempotency.claim', 'idempotency.claim', 'idempotency.claim', 'idempotency.checkpoint', 'idempotency.claim',
    'idempotency.complete', 'idempotency.complete', 'idempotency.claim', 'idempotency.claim', 'idempotency.release']);
  const a = got.map((s) => s.attributes);
  const h = keyHash(scope, SECRET_KEY);
  assert.equal(h, 'c8e6b9416ff4a7bd'); // SHA-256 of scope NUL key: the same in the Python and Rust packages
  for (const x of a) assert.equal(x['idempotency.scope'], scope);
  for (const x of a.slice(0, 8)) assert.equal(x['idempotency.key_hash'], h);
  const [nw, inProgress, mismatch, checkpoint, takeover, stale, complete, replay, , release] = a;
  assert.equal(nw['idempotency.outcome'], 'new');
  assert.equal(nw['idempotency.replay'], false);
  assert.equal(nw['idempotency.token'], Number(first.token));
  assert.equal(nw['idempotency.resumed'], false);
  assert.equal(nw['idempotency.retries'], 0);
  assert.equal(inProgress['idempotency.outcome'], 'in_progress');
  assert.equal(inProgress['idempotency.retry_after'], 1);
  assert.equal(inProgress['idempotency.token'], undefined);
  assert.equal(mismatch['idempotency.outcome'], 'mismatch');
  assert.equal(mismatch['idempotency.token'], undefined);
  assert.equal(checkpoint['idempotency.token'], Number(first.token));
  assert.equal(checkpoint['error.type'], undefined);
  assert.equal(takeover['idempotency.outcome'], 'new');
  assert.equal(takeover['idempotency.token'], Number(second.token));
  assert.equal(takeover['idempotency.resumed'], true);
  assert.equal(stale['error.type'], 'IK003');
  assert.equal(got[5].status.code, api.SpanStatusCode.ERROR);
  assert.equal(complete['idempotency.token'], Number(second.token));
  assert.equal(complete['error.type'], undefined);
  assert.equal(replay['idempotency.outcome'], 'replay');
  assert.equal(replay['idempotency.replay'], true);
  assert.equal(replay['idempotency.token'], Number(second.token));
  assert.equal(release['idempotency.released'], true);
  for (const s of got) assert.equal(s.kind, api.SpanKind.CLIENT);
  assertNoSecret(got);

  assert.deepEqual(delta(claims0, await points('idempotency.claims')), {
    'idempotency.outcome=new': 3, 'idempotency.outcome=in_progress': 1,
    'idempotency.outcome=mismatch': 1, 'idempotency.outcome=replay': 1,
  });
  assert.deepEqual(delta(durations0, await points('idempotency.claim.duration')),
    delta(claims0, await points('idempotency.claims')));
});

test('a completion repeated on a new connection is counted', async () => {
  exporter.reset();
  const retries0 = await points('idempotency.completion.retries');
  const own = cluster.pool({ application_name: 'otel_retry', max: 1 });
  own.on('error', () => {});
  const d = new db.Db({ pool: own });
  const c = await db.claim(d, { key: SECRET_KEY, request: SECRET_REQUEST, scope: '', ttl: null, lease: null });
  // The complete waits for a row lock held here; its connection is terminated while it waits.
  const locker = await direct.connect();
  await locker.query('BEGIN');
  await locker.query("SELECT 1 FROM idempotency.idempotency_keys WHERE scope = '' AND key = $1 FOR UPDATE", [SECRET_KEY]);
  const completing = db.complete(d, { key: SECRET_KEY, response: '{"ok":1}', status: 200, scope: '', token: c.token, ttl: null, leaseEnd: c.leaseEnd });
  let terminated = false;
  for (let i = 0; i < 200 && !terminated; i += 1) {
    const { rows } = await direct.query(`SELECT pg_terminate_backend(pid) AS t FROM pg_stat_activity
      WHERE application_name = 'otel_retry' AND wait_event_type = 'Lock'`);
    terminated = rows.length > 0;
    if (!terminated) await sleep(25);
  }
  assert.ok(terminated);
  await sleep(150);
  await locker.query('COMMIT');
  locker.release();
  await completing;
  await own.end();
  const complete = spans().filter((s) => s.name === 'idempotency.complete');
  assert.equal(complete.length, 1);
  const n = complete[0].attributes['idempotency.retries'];
  assert.ok(n >= 1, `retries ${n}`);
  assert.deepEqual(delta(retries0, await points('idempotency.completion.retries')), { 'idempotency.operation=complete': n });
});

test('idempotent() and idempotentTransaction() emit the same spans; the histogram is in seconds', async () => {
  exporter.reset();
  const charge = idempotent(async () => ({ ok: true }), { key: () => SECRET_KEY, scope: 'charges', pool });
  await charge('SECRETREQUEST');
  await charge('SECRETREQUEST');
  const client = await pool.connect();
  try {
    await idempotentTransaction(client, { key: 'tx-SECRETKEY', request: { a: 'SECRETREQUEST' }, claimWait: 0.25 }, async () => 'done');
  } finally {
    client.release();
  }
  const got = spans();
  assert.deepEqual(got.map((s) => [s.name, s.attributes['idempotency.outcome']]), [
    ['idempotency.claim', 'new'], ['idempotency.complete', undefined], ['idempotency.claim', 'replay'],
    ['idempotency.claim', 'new'], ['idempotency.complete', undefined]]);
  assert.equal(got[3].attributes['idempotency.claim_wait'], 0.25);
  assertNoSecret(got);
  const { resourceMetrics } = await reader.collect();
  const hist = resourceMetrics.scopeMetrics.flatMap((sm) => sm.metrics)
    .find((m) => m.descriptor.name === 'idempotency.claim.duration');
  assert.equal(hist.descriptor.unit, 's');
  assert.deepEqual(hist.dataPoints[0].value.buckets.boundaries.slice(0, 3), [0.001, 0.0025, 0.005]);
});

test('without @opentelemetry/api the package works and loads none of it', async () => {
  // A child process in which @opentelemetry/api cannot be resolved, as when it is not installed.
  const script = `
    const Module = require('node:module');
    const resolve = Module._resolveFilename;
    Module._resolveFilename = function (request, ...rest) {
      if (request.startsWith('@opentelemetry/')) {
        const err = new Error("Cannot find module '" + request + "'");
        err.code = 'MODULE_NOT_FOUND';
        throw err;
      }
      return resolve.call(this, request, ...rest);
    };
    const { idempotent } = require(${JSON.stringify(path.join(__dirname, '..'))});
    const { Pool } = require('pg');
    (async () => {
      const pool = new Pool(JSON.parse(process.argv[1]));
      let runs = 0;
      const f = idempotent(async () => { runs += 1; return 7; }, { key: () => 'no-otel', pool });
      if (await f() !== 7 || await f() !== 7 || runs !== 1) throw new Error('not idempotent');
      await pool.end();
      const loaded = Object.keys(require.cache).filter((p) => p.includes('@opentelemetry'));
      if (loaded.length) throw new Error('loaded ' + loaded.join(' '));
      if (require('${path.join(__dirname, '..', 'lib', 'otel.js').replace(/\\/g, '/')}').enabled) throw new Error('enabled');
      console.log('ok');
    })().catch((e) => { console.error(e); process.exit(1); });
  `;
  const out = spawnSync(process.execPath, ['-e', script, JSON.stringify(cluster.config())], { encoding: 'utf8', timeout: 60000 });
  assert.equal(out.status, 0, out.stderr);
  assert.equal(out.stdout.trim(), 'ok');
});
