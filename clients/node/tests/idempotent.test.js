'use strict';
// idempotent(): every outcome, a race, a crash taken over after the lease, fencing and a database
// restart mid-call, against a throwaway cluster (tests/cluster.js).

const { test: nodeTest, before, after } = require('node:test');

const test = (title, fn, options = {}) => nodeTest(title, { timeout: 90000, ...options }, fn); // a hang fails, never blocks
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');
const {
  idempotent, currentClaim, InProgressError, MismatchError, IdempotencyError,
} = require('..');
const { startCluster, POOLER, NO_RESTART } = require('./cluster');
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

// Waits until (scope, key) is claimed: no fixed sleeps that a loaded machine could outrun.
async function claimed(key, scope = '') {
  for (let i = 0; i < 200; i += 1) {
    const r = await row(key, scope);
    if (r && r.status === 'in_progress') return r;
    await sleep(25);
  }
  throw new Error(`${scope}/${key} never got claimed`);
}

async function row(key, scope = '') {
  const { rows } = await pool.query(
    'SELECT status::text, token::text, response, response_status, recovery_point FROM idempotency.lookup($1, $2)',
    [key, scope]);
  return rows[0].status === null ? null : rows[0];
}

test('new runs the function and stores its result; replay returns it without running', async () => {
  let runs = 0;
  const charge = idempotent(async (order, amount) => {
    runs += 1;
    return { charge: `ch_${order}`, amount };
  }, { key: (order) => `order-${order}`, scope: 'charges', pool });
  const first = await charge.detailed(42, 25);
  assert.deepEqual(first.value, { charge: 'ch_42', amount: 25 });
  assert.equal(first.outcome, 'new');
  assert.equal(first.replayed, false);
  assert.ok(first.expiresAt instanceof Date && first.expiresAt > new Date());
  const again = await charge.detailed(42, 25);
  assert.deepEqual(again, { ...first, outcome: 'replay', replayed: true, expiresAt: again.expiresAt });
  assert.equal(await charge(42, 25.0).then((v) => v.amount), 25);
  assert.equal(runs, 1);
  const r = await row('order-42', 'charges');
  assert.equal(r.status, 'completed');
  assert.equal(r.response_status, 200);
  assert.equal(r.token, first.token);
});

test('the same key for other arguments is a mismatch: MismatchError, nothing runs', async () => {
  let runs = 0;
  const charge = idempotent(async (order, amount) => { runs += 1; return amount; },
    { key: (order) => `m-${order}`, pool });
  await charge(1, 10);
  await assert.rejects(charge(1, 11), (err) => {
    assert.ok(err instanceof MismatchError && err instanceof IdempotencyError);
    assert.equal(err.code, 'IDEMPOTENCY_MISMATCH');
    assert.equal(err.key, 'm-1');
    return true;
  });
  assert.equal(runs, 1);
});

test('request chooses what is compared; request: null compares nothing', async () => {
  let runs = 0;
  const byOrder = idempotent(async (order, note) => { runs += 1; return note; },
    { key: 'req-1', pool, request: (order) => ({ order }) });
  assert.equal(await byOrder(7, 'first'), 'first');
  assert.equal(await byOrder(7, 'second'), 'first'); // note is not part of the request
  await assert.rejects(byOrder(8, 'x'), MismatchError);
  const any = idempotent(async (x) => { runs += 1; return x; }, { key: 'req-2', pool, request: null });
  assert.equal(await any(1), 1);
  assert.equal(await any(2), 1);
  assert.equal(runs, 2);
});

test('a function that throws releases the key: the retry runs as new', async () => {
  let runs = 0;
  const flaky = idempotent(async () => {
    runs += 1;
    if (runs === 1) throw new Error('SMTP refused');
    return 'sent';
  }, { key: 'flaky', pool });
  await assert.rejects(flaky(), /SMTP refused/);
  assert.equal(await row('flaky'), null);
  assert.equal(await flaky(), 'sent');
  assert.equal(runs, 2);
});

test('releaseOnError: false keeps the key in progress until its lease ends', async () => {
  const f = idempotent(async () => { throw new Error('unsure'); }, { key: 'kept', pool, releaseOnError: false, lease: 30, wait: 0 });
  await assert.rejects(f(), /unsure/);
  assert.equal((await row('kept')).status, 'in_progress');
  await assert.rejects(f(), (err) => err instanceof InProgressError && err.retryAfter > 25 && err.retryAfter <= 30);
});

test('in_progress: waits for the running call and replays its result, or throws InProgressError with retryAfter', async () => {
  let release;
  const gate = new Promise((r) => { release = r; });
  let runs = 0;
  const slow = idempotent(async () => { runs += 1; await gate; return 'done'; }, { key: 'slow', pool, lease: 20, wait: 0 });
  const first = slow();
  await claimed('slow');
  await assert.rejects(slow(), (err) => {
    assert.ok(err instanceof InProgressError);
    assert.equal(err.code, 'IDEMPOTENCY_IN_PROGRESS');
    assert.ok(err.retryAfter >= 19 && err.retryAfter <= 20, `retryAfter ${err.retryAfter}`);
    assert.ok(err.expiresAt instanceof Date);
    return true;
  });
  const patient = idempotent(async () => { runs += 1; return 'other'; }, { key: 'slow', pool, wait: 30 });
  const waiting = patient.detailed();
  await sleep(300);
  release();
  assert.equal(await first, 'done');
  const replayed = await waiting; // polls while it waits: replays long before the 20 s lease ends
  assert.equal(replayed.outcome, 'replay');
  assert.equal(replayed.value, 'done');
  assert.equal(runs, 1);
});

test('a waiting call replays the result once the running call completes', async () => {
  let runs = 0;
  const f = idempotent(async () => { runs += 1; await sleep(1500); return runs; }, { key: 'waiter', pool, lease: 10, wait: 20 });
  const first = f.detailed();
  await claimed('waiter');
  const second = await f.detailed();
  assert.equal((await first).outcome, 'new');
  assert.equal(second.outcome, 'replay');
  assert.equal(second.value, 1);
  assert.equal(runs, 1);
});

test('a race of 12 concurrent identical calls from two pools runs the function once', async () => {
  const other = cluster.pool();
  let runs = 0;
  const make = (p) => idempotent(async (to) => { runs += 1; await sleep(300); return { sent_to: to }; },
    { key: 'race', scope: 'receipts', pool: p, lease: 10, wait: 20 });
  const [a, b] = [make(pool), make(other)];
  const results = await Promise.all(Array.from({ length: 12 }, (_, i) => (i % 2 ? a : b).detailed('bob@example.com')));
  await other.end();
  assert.equal(runs, 1);
  assert.equal(results.filter((r) => r.outcome === 'new').length, 1);
  assert.equal(results.filter((r) => r.outcome === 'replay').length, 11);
  for (const r of results) assert.deepEqual(r.value, { sent_to: 'bob@example.com' });
});

test('a process killed mid-function: retries get in_progress until the lease ends, then take over at the checkpoint', async () => {
  const effects = path.join(cluster.dir, 'effects.log'); // removed with the cluster
  const child = spawn(process.execPath, [path.join(__dirname, 'fixtures', 'crash-child.js'), 'receipt-9', effects, '3'],
    { env: cluster.env(), stdio: ['ignore', 'pipe', 'inherit'] });
  const firstToken = await new Promise((resolve, reject) => {
    let out = '';
    child.stdout.on('data', (d) => {
      out += d;
      const m = /sent (\d+)/.exec(out);
      if (m) resolve(m[1]);
    });
    child.on('exit', (code) => reject(new Error(`child exited with ${code} before sending`)));
  });
  child.kill('SIGKILL');
  await new Promise((r) => child.on('exit', r));
  assert.equal(fs.readFileSync(effects, 'utf8'), 'alice@example.com\n');
  assert.deepEqual(await row('receipt-9', 'crash').then((r) => [r.status, r.recovery_point]), ['in_progress', 'sent']);

  let runs = 0;
  const retry = (wait) => idempotent(async (to) => {
    runs += 1;
    const claim = currentClaim();
    assert.ok(BigInt(claim.token) > BigInt(firstToken), 'a takeover gets a larger token');
    if (claim.recoveryPoint !== 'sent') fs.appendFileSync(effects, `${to}\n`);
    return { sent_to: to, resumed_from: claim.recoveryPoint };
  }, { key: 'receipt-9', scope: 'crash', lease: 3, wait, pool });
  await assert.rejects(retry(0)('alice@example.com'),
    (err) => err instanceof InProgressError && err.retryAfter >= 1 && err.retryAfter <= 3);
  const taken = retry(10); // waits out the dead process' lease, then takes the key over
  const result = await taken.detailed('alice@example.com');
  assert.equal(result.outcome, 'new');
  assert.deepEqual(result.value, { sent_to: 'alice@example.com', resumed_from: 'sent' });
  assert.equal(fs.readFileSync(effects, 'utf8'), 'alice@example.com\n', 'the e-mail went out once');
  assert.equal((await taken.detailed('alice@example.com')).outcome, 'replay');
  assert.equal(runs, 1);
});

test('a stale call whose lease ran out is fenced off and answers the stored result', async () => {
  const log = [];
  const stale = idempotent(async () => { log.push('stale'); await sleep(2500); return 'stale'; }, { key: 'fence', pool, lease: 1, wait: 0 });
  const fresh = idempotent(async () => { log.push('fresh'); return 'fresh'; }, { key: 'fence', pool, lease: 5, wait: 10 });
  const s = stale.detailed();
  await claimed('fence');
  const f = await fresh.detailed(); // waits out the 1 s lease, takes over
  assert.equal(f.outcome, 'new');
  const late = await s; // its complete is refused (IK003): it claims again and gets the replay
  assert.equal(late.outcome, 'replay');
  assert.equal(late.value, 'fresh');
  assert.deepEqual(log, ['stale', 'fresh']);
});

test('a database restart mid-function: complete reconnects, nothing runs twice', async () => {
  let runs = 0;
  let lost = 0;
  const f = idempotent(async () => {
    runs += 1;
    cluster.stop('fast'); // every connection of the pool is gone
    setTimeout(() => cluster.restart(), 1000); // down for a second
    return 'survived';
  }, { key: 'restart', pool, lease: 30, onConnectionLost: () => { lost += 1; } });
  const r = await f.detailed();
  assert.equal(r.outcome, 'new');
  assert.equal(r.value, 'survived');
  const again = await f.detailed();
  assert.equal(again.outcome, 'replay');
  assert.equal(again.value, 'survived');
  assert.equal(runs, 1);
  // A pooler in transaction mode holds the statement until the server is back: the package's
  // connection to it never breaks.
  if (POOLER !== 'transaction') assert.ok(lost > 0, 'the repeated statement was reported');
  assert.equal((await row('restart')).status, 'completed');
}, { skip: NO_RESTART });

// The server process of the connection that runs a statement, once the statement waits for a
// lock (`what`: a piece of its text).
async function waitingBackend(what) {
  for (let i = 0; i < 400; i += 1) {
    const { rows } = await direct.query(`SELECT pid FROM pg_stat_activity
      WHERE state = 'active' AND wait_event_type = 'Lock' AND strpos(query, $1) > 0`, [what]);
    if (rows.length === 1) return rows[0].pid;
    await sleep(25);
  }
  throw new Error(`no statement with '${what}' ever waited for a lock`);
}

test('the server connection killed while complete runs: the completion is repeated on a new connection while the lease lasts', async () => {
  const effects = [];
  const locker = await direct.connect();
  try {
    const f = idempotent(async (order) => {
      effects.push(order);
      // The key's row stays locked until the test has killed the complete waiting for it.
      await locker.query('BEGIN');
      const { rows } = await locker.query('SELECT 1 FROM idempotency.idempotency_keys WHERE key = $1 FOR UPDATE', ['killed-complete']);
      assert.equal(rows.length, 1, 'the claimed row is locked');
      return { charged: order };
    }, {
      key: 'killed-complete', pool, lease: 20,
      // Nothing else is repeated after a lost connection: only the lease keeps the completion going.
      reconnectTimeout: 0,
    });
    const call = f.detailed(7);
    const pid = await waitingBackend('idempotency.complete(');
    const { rows } = await direct.query('SELECT pg_terminate_backend($1) AS killed', [pid]);
    assert.equal(rows[0].killed, true);
    await locker.query('ROLLBACK');
    const r = await call;
    assert.equal(r.outcome, 'new');
    assert.deepEqual(r.value, { charged: 7 });
    assert.ok(r.expiresAt instanceof Date);
    const stored = await row('killed-complete');
    assert.deepEqual([stored.status, stored.token, stored.response], ['completed', r.token, { charged: 7 }]);
    const again = await f.detailed(7);
    assert.deepEqual([again.outcome, again.value], ['replay', { charged: 7 }]);
    assert.deepEqual(effects, [7], 'the side effect ran once');
  } finally {
    locker.release();
  }
});

test("complete's answer lost after it committed: the repeated complete finds its own completion; the caller gets its result as new", async () => {
  const proxy = await new LosingProxy(cluster.config(), 'idempotency.complete($1').start();
  const lossy = cluster.pool(proxy.config());
  let runs = 0;
  const f = idempotent(async (order) => { runs += 1; return { charged: order }; },
    { key: 'lost-answer', pool: lossy, lease: 20 });
  try {
    const r = await f.detailed(8);
    assert.equal(proxy.cut, 1, 'the connection broke after the complete');
    assert.equal(proxy.seen, 2, 'the complete was sent again');
    assert.deepEqual([r.outcome, r.replayed, r.value], ['new', false, { charged: 8 }]);
    const stored = await row('lost-answer');
    assert.deepEqual([stored.status, stored.token], ['completed', r.token]);
    assert.equal(r.expiresAt.getTime(), (await pool.query("SELECT (idempotency.lookup('lost-answer')).expires_at AS e")).rows[0].e.getTime());
    const again = await f.detailed(8);
    assert.deepEqual([again.outcome, again.value], ['replay', { charged: 8 }]);
    assert.equal(runs, 1);
  } finally {
    await lossy.end();
    await proxy.close();
  }
});

test("currentClaim().deriveKey is derive_key of the claim's key, and survives a terminated connection", async () => {
  let lost = 0;
  const f = idempotent(async (step) => {
    const claim = currentClaim();
    // The wrapper's own connection dies between the claim and the derivation: the statement is
    // repeated on a new connection instead of failing the call (and releasing the key).
    await direct.query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'derive-key-test'");
    return claim.deriveKey(step, { n: 1 });
  }, { key: 'derive', connectionString: cluster.url(), applicationName: 'derive-key-test', lease: 30,
    onConnectionLost: () => { lost += 1; } });
  try {
    const r = await f.detailed('email');
    const { rows } = await pool.query("SELECT idempotency.derive_key('derive', 'email', '{\"n\": 1}') AS k");
    assert.equal(r.outcome, 'new');
    assert.equal(r.value, rows[0].k);
    // A pooler in transaction mode replaces the terminated server connection itself.
    if (POOLER !== 'transaction') assert.ok(lost > 0, 'the terminated connection was seen and the statement repeated');
  } finally {
    await f.close();
  }
});

test('a connection string (or the PG* variables) gives the wrapper a pool of its own; close() ends it', async () => {
  const f = idempotent(async (n) => n * 2, { key: (n) => `cs-${n}`, connectionString: cluster.url(), ttl: '1 hour', lease: '10 seconds' });
  assert.equal(await f(21), 42);
  assert.equal((await f.detailed(21)).replayed, true);
  await f.close();
});

test('an application role with only GRANT USAGE ON SCHEMA idempotency can use every path', async () => {
  // On an existing server (IDEMPOTENCY_TEST_CONNINFO) an earlier test file may have made the role.
  await pool.query(`DO $$ BEGIN CREATE ROLE app LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
    GRANT USAGE ON SCHEMA idempotency TO app`);
  const appPool = cluster.pool({ user: 'app' });
  try {
    let runs = 0;
    const f = idempotent(async (n) => {
      runs += 1;
      await currentClaim().checkpoint('half');
      if (runs === 1) throw new Error('first attempt fails');
      return n;
    }, { key: 'as-app', pool: appPool });
    await assert.rejects(f(1), /first attempt/); // release
    assert.equal(await f(1), 1); // claim, checkpoint, complete
    assert.equal((await f.detailed(1)).outcome, 'replay');
    await assert.rejects(f(2), MismatchError);
  } finally {
    await appPool.end();
  }
});

test('bad options and bad keys: errors from the extension or TypeErrors, nothing stored', async () => {
  assert.throws(() => idempotent(async () => 1, {}), TypeError);
  assert.throws(() => idempotent(async () => 1, { key: 'x', ttl: {} }), TypeError);
  await assert.rejects(idempotent(async () => 1, { key: '', pool })(), (err) => err.code === '22023');
  await assert.rejects(idempotent(async () => 1, { key: 'x'.repeat(256), pool })(), (err) => err.code === '22023');
  await assert.rejects(idempotent(async () => 1, { key: 'neg', lease: 0, pool })(), (err) => err.code === '22023');
  await assert.rejects(idempotent(async () => 1, { key: (n) => n, pool })(5), TypeError);
  assert.equal(await row('neg'), null);
});

test('a result that cannot be stored never runs the side effect again: IDEMPOTENCY_UNSTORABLE now and on every retry', async () => {
  let runs = 0;
  const f = idempotent(async () => { runs += 1; return { amount: 10n }; }, { key: 'unstorable', pool });
  for (let i = 0; i < 2; i += 1) {
    await assert.rejects(f(), (err) => err instanceof IdempotencyError && err.code === 'IDEMPOTENCY_UNSTORABLE');
  }
  assert.equal(runs, 1);
  assert.equal((await row('unstorable')).status, 'completed');
  // serialize / deserialize: a bigint stored as a string, rebuilt on a replay
  const g = idempotent(async () => { runs += 1; return { amount: 10n }; }, {
    key: 'serialized', pool,
    serialize: (v) => JSON.stringify({ amount: String(v.amount) }),
    deserialize: (j) => ({ amount: BigInt(j.amount) }),
  });
  assert.deepEqual(await g(), { amount: 10n });
  const again = await g.detailed();
  assert.equal(again.replayed, true);
  assert.deepEqual(again.value, { amount: 10n });
  assert.equal(runs, 2);
});
