'use strict';
// Batches against a throwaway cluster: claimMany/completeMany, and idempotentBatch for a queue
// consumer's batch (every per-position outcome in one batch, a failing handler, a retried batch,
// input order, a fenced complete_many, a terminated backend mid-batch).

const { test: nodeTest, before, after } = require('node:test');

const test = (title, fn) => nodeTest(title, { timeout: 90000 }, fn);
const assert = require('node:assert/strict');
const {
  idempotentBatch, claimMany, completeMany, InProgressError, MismatchError, FencedError,
} = require('..');
const { startCluster, POOLER } = require('./cluster');
const { LosingProxy } = require('./losing-proxy');

let cluster;
let pool;
let direct; // the server itself, not through a pooler: to terminate server connections
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

before(async () => {
  cluster = await startCluster();
  pool = cluster.pool();
  direct = cluster.directPool();
});

after(async () => {
  await pool.end();
  await direct.end();
  cluster.destroy();
});

async function row(key, scope = '') {
  const { rows } = await pool.query(
    'SELECT status::text, token::text, response, response_status FROM idempotency.lookup($1, $2)',
    [key, scope]);
  return rows[0].status === null ? null : rows[0];
}

const msg = (id, body = {}) => ({ id, receipt: `r-${id}`, ...body });

test('claimMany answers each position in input order; completeMany stores them', async () => {
  await claimMany(pool, ['done'], { requests: [{ n: 1 }], scope: 'q' })
    .then((cs) => completeMany(pool, ['done'], [{ ok: 1 }], { scope: 'q', tokens: [cs[0].token] }));
  await claimMany(pool, ['held'], { scope: 'q', lease: 300 });
  const keys = ['z-new', 'done', 'held', 'done', 'a-new', 'z-new', 'z-new'];
  const requests = [{ n: 9 }, { n: 1 }, null, { n: 2 }, null, { n: 9 }, { n: 8 }];
  const cs = await claimMany(pool, keys, { requests, scope: 'q', lease: 60 });
  assert.deepEqual(cs.map((c) => c.key), keys);
  assert.deepEqual(cs.map((c) => c.outcome),
    ['new', 'replay', 'in_progress', 'mismatch', 'new', 'in_progress', 'mismatch']);
  assert.deepEqual(cs[1].response, { ok: 1 });
  assert.ok(cs[2].retryAfter > 240);
  assert.equal(typeof cs[0].token, 'string');
  const expires = await completeMany(pool, ['z-new', 'a-new'], [{ r: 'z' }, [1, 2]],
    { scope: 'q', statuses: [201, 200], tokens: [cs[0].token, cs[4].token], ttl: 3600 });
  assert.equal(expires.length, 2);
  assert.ok(expires.every((e) => e instanceof Date));
  assert.deepEqual(await row('z-new', 'q'), { status: 'completed', token: cs[0].token, response: { r: 'z' }, response_status: 201 });
  const again = await claimMany(pool, ['a-new', 'z-new'], { scope: 'q' });
  assert.deepEqual(again.map((c) => [c.outcome, c.response]), [['replay', [1, 2]], ['replay', { r: 'z' }]]);
  assert.deepEqual(await claimMany(pool, [], { scope: 'q' }), []);
});

test('completeMany is all or nothing and throws FencedError naming the key', async () => {
  const [a, b] = await claimMany(pool, ['a', 'b'], { scope: 's' });
  await completeMany(pool, ['b'], ['other'], { scope: 's', tokens: [b.token] });
  await assert.rejects(completeMany(pool, ['a', 'b'], ['ra', 'rb'], { scope: 's', tokens: [a.token, b.token] }),
    (err) => err instanceof FencedError && err.key === 'b' && err.cause.code === 'IK002');
  assert.equal((await row('a', 's')).status, 'in_progress'); // nothing written
  await assert.rejects(completeMany(pool, ['a', 'b'], ['ra'], { scope: 's' }), /one element per key \(2\)/);
  await assert.rejects(claimMany(pool, ['a'], { requests: [1, 2] }), /one element per key \(1\)/);
  await assert.rejects(claimMany(pool, ['a', 7]), /keys\[1\] must be a string/);
});

test('a batch with every outcome: new, replay, in_progress, mismatch, a duplicate within the batch, in input order', async () => {
  const opts = { key: (m) => m.id, request: (m) => ({ n: m.n }), scope: 'mixed', pool };
  await idempotentBatch((m) => ({ n: m.n }), opts)([msg('m-done', { n: 1 })]);
  await idempotentBatch(() => 'first', opts)([msg('m-used', { n: 1 })]);
  await claimMany(pool, ['m-held'], { requests: [{ n: 3 }], scope: 'mixed', lease: 300 });
  const calls = [];
  const batch = [msg('m-new', { n: 4 }), msg('m-done', { n: 1 }), msg('m-held', { n: 3 }), msg('m-used', { n: 2 }),
    msg('m-new', { n: 4 }), msg('m-last', { n: 5 })];
  const items = await idempotentBatch(async (m) => {
    calls.push(m.id);
    return { handled: m.id, n: m.n };
  }, opts)(batch);
  assert.deepEqual(items.map((it) => it.message), batch);
  assert.deepEqual(items.map((it) => it.key), batch.map((m) => m.id));
  assert.deepEqual(items.map((it) => it.outcome), ['new', 'replay', 'failed', 'failed', 'replay', 'new']);
  assert.deepEqual(calls, ['m-new', 'm-last']); // the duplicate within the batch ran once
  assert.deepEqual(items[0].value, { handled: 'm-new', n: 4 });
  assert.deepEqual(items[1].value, { n: 1 });
  assert.ok(items[2].error instanceof InProgressError && items[2].error.retryAfter > 240);
  assert.ok(items[3].error instanceof MismatchError && items[3].error.key === 'm-used');
  assert.deepEqual(items[4].value, items[0].value);
  assert.deepEqual(items.map((it) => it.ok), [true, true, false, false, true, true]);
  assert.equal((await row('m-new', 'mixed')).status, 'completed');
  assert.equal((await row('m-held', 'mixed')).status, 'in_progress');
});

test('a failing handler releases only its key; the retried batch replays the others and runs only it', async () => {
  const runs = [];
  const broken = new Set(['m2']);
  const consume = idempotentBatch(async (m) => {
    runs.push(m.id);
    if (broken.has(m.id)) throw new Error(`downstream refused ${m.id}`);
    return { sent: m.id };
  }, { key: (m) => `msg:${m.id}`, scope: 'mail', pool, concurrency: 3 });
  const batch = [1, 2, 3, 4].map((i) => msg(`m${i}`));
  const first = await consume(batch);
  assert.deepEqual(first.map((it) => it.outcome), ['new', 'failed', 'new', 'new']);
  assert.match(first[1].error.message, /downstream refused m2/);
  assert.equal(await row('msg:m2', 'mail'), null); // released
  for (const i of [1, 3, 4]) assert.equal((await row(`msg:m${i}`, 'mail')).status, 'completed');
  assert.deepEqual(first.filter((it) => !it.ok).map((it) => it.message.receipt), ['r-m2']);

  broken.clear();
  runs.length = 0;
  const retry = await consume(batch);
  assert.deepEqual(runs, ['m2']);
  assert.deepEqual(retry.map((it) => it.outcome), ['replay', 'new', 'replay', 'replay']);
  assert.deepEqual(retry.map((it) => it.value), [1, 2, 3, 4].map((i) => ({ sent: `m${i}` })));
});

test('wait: a key another consumer finishes meanwhile is a replay', async () => {
  const [held] = await claimMany(pool, ['w'], { scope: 'wait', lease: 60 });
  setTimeout(() => completeMany(pool, ['w'], [{ by: 'other' }], { scope: 'wait', tokens: [held.token] }), 300);
  const items = await idempotentBatch(() => 'mine', { key: (m) => m.id, scope: 'wait', pool, wait: 5 })(
    [{ id: 'w' }, { id: 'v' }]);
  assert.deepEqual(items.map((it) => [it.outcome, it.value]), [['replay', { by: 'other' }], ['new', 'mine']]);
});

test('a position taken over after its lease: complete_many refused, the others completed one by one', async () => {
  let overtaken = false;
  const items = await idempotentBatch(async (m) => {
    if (!overtaken) {
      overtaken = true;
      await sleep(1300); // the lease (1 s) ends; another consumer takes p over and finishes it
      const [c] = await claimMany(pool, [m.id], { scope: 'fence', lease: 1 });
      assert.equal(c.outcome, 'new');
      await completeMany(pool, [m.id], [{ by: 'other' }], { scope: 'fence', tokens: [c.token] });
    }
    return { by: 'me', id: m.id };
  }, { key: (m) => m.id, scope: 'fence', lease: 1, pool })([{ id: 'p' }, { id: 'q' }]);
  assert.deepEqual(items.map((it) => [it.outcome, it.value]), [['replay', { by: 'other' }], ['new', { by: 'me', id: 'q' }]]);
  assert.deepEqual((await row('q', 'fence')).response, { by: 'me', id: 'q' });
});

test('a terminated backend mid-batch: the statements are repeated on a new connection', async () => {
  let lost = 0;
  const consume = idempotentBatch(async (m) => {
    // The batch's own connection dies between claim_many and complete_many.
    if (m.id === 'b') await direct.query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'batch-lost-test'");
    return m.id;
  }, { key: (m) => m.id, scope: 'lost', connectionString: cluster.url(), applicationName: 'batch-lost-test', poolSize: 1,
    onConnectionLost: () => { lost += 1; } });
  try {
    const items = await consume([{ id: 'a' }, { id: 'b' }]);
    assert.deepEqual(items.map((it) => [it.outcome, it.value]), [['new', 'a'], ['new', 'b']]);
    assert.equal((await row('b', 'lost')).status, 'completed');
    // A pooler in transaction mode replaces the terminated server connection itself: the
    // package's connection to it never breaks.
    if (POOLER !== 'transaction') assert.ok(lost > 0, 'the terminated connection was seen and the statement repeated');
  } finally {
    await consume.close();
  }
});

test("complete_many's answer lost after it committed: the messages stay new, each ran once, a redelivery replays", async () => {
  const proxy = await new LosingProxy(cluster.config(), 'idempotency.complete_many(').start();
  const lossy = cluster.pool(proxy.config());
  const runs = [];
  const consume = idempotentBatch(async (m) => { runs.push(m.id); return { done: m.id }; },
    { key: (m) => m.id, scope: 'lost-answer', pool: lossy, lease: 20 });
  try {
    const items = await consume([{ id: 'x' }, { id: 'y' }]);
    assert.equal(proxy.cut, 1, 'the connection broke after complete_many');
    assert.equal(proxy.seen, 2, 'complete_many was sent again');
    assert.deepEqual(items.map((it) => [it.outcome, it.value]), [['new', { done: 'x' }], ['new', { done: 'y' }]]);
    assert.deepEqual((await row('y', 'lost-answer')).response, { done: 'y' });
    const again = await consume([{ id: 'x' }, { id: 'y' }]);
    assert.deepEqual(again.map((it) => it.outcome), ['replay', 'replay']);
    assert.deepEqual(runs, ['x', 'y']);
  } finally {
    await lossy.end();
    await proxy.close();
  }
});

test('bad options are refused before anything is claimed', async () => {
  assert.throws(() => idempotentBatch(() => 1, { key: 'constant', pool }), /options.key must be a function/);
  const run = idempotentBatch(() => 1, { key: (m) => m.id, pool });
  await assert.rejects(run([{ id: 5 }]), /the key of message 0 must be a string/);
  assert.deepEqual(await run([]), []);
});
