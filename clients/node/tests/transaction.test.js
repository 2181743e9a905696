'use strict';
// idempotentTransaction(): the one-transaction style on the caller's client.

const { test: nodeTest, before, after } = require('node:test');

const test = (title, fn, options = {}) => nodeTest(title, { timeout: 90000, ...options }, fn); // a hang fails, never blocks
const assert = require('node:assert/strict');
const { idempotentTransaction, InProgressError, MismatchError } = require('..');
const { startCluster, NO_RESTART } = require('./cluster');

let cluster;
let pool;

before(async () => {
  cluster = await startCluster();
  pool = cluster.pool();
  await pool.query('CREATE TABLE payments (id bigserial PRIMARY KEY, account text, amount numeric)');
});

after(async () => {
  await pool.end();
  cluster.destroy();
});

const count = async () => Number((await pool.query('SELECT count(*) FROM payments')).rows[0].count);

async function pay(client, key, request, { fail = false, ...extra } = {}) {
  return idempotentTransaction(client, { key, request, scope: 'payments', ...extra }, async (c, ctx) => {
    const { rows } = await c.query('INSERT INTO payments (account, amount) VALUES ($1, $2) RETURNING id::text',
      [request.account, request.amount]);
    if (fail) throw new Error('card declined by a bug');
    ctx.status = 201;
    return { payment: rows[0].id };
  });
}

test('new commits the work with the claim; replay returns the stored result and status', async () => {
  const client = await pool.connect();
  try {
    const first = await pay(client, 'p-1', { account: 'a', amount: 10 });
    assert.equal(first.outcome, 'new');
    assert.equal(first.status, 201);
    const again = await pay(client, 'p-1', { amount: 10.0, account: 'a' });
    assert.deepEqual([again.outcome, again.replayed, again.status, again.value], ['replay', true, 201, first.value]);
    assert.ok(again.expiresAt instanceof Date);
    assert.equal(await count(), 1);
    await assert.rejects(pay(client, 'p-1', { account: 'a', amount: 11 }), MismatchError);
    assert.equal(await count(), 1);
  } finally {
    client.release();
  }
});

test('a throw rolls back the work and the claim: the retry is new', async () => {
  const client = await pool.connect();
  try {
    const before = await count();
    await assert.rejects(pay(client, 'p-2', { account: 'b', amount: 5 }, { fail: true }), /declined/);
    assert.equal(await count(), before);
    assert.equal((await pool.query("SELECT idempotency.lookup('p-2', 'payments') IS NULL AS gone")).rows[0].gone, true);
    assert.equal((await pay(client, 'p-2', { account: 'b', amount: 5 })).outcome, 'new');
    assert.equal(await count(), before + 1);
  } finally {
    client.release();
  }
});

test('a claim held by another open transaction: InProgressError at once, or a wait (claimWait) and the replay', async () => {
  const [a, b] = [await pool.connect(), await pool.connect()];
  try {
    await a.query('BEGIN');
    const held = pay(a, 'p-3', { account: 'c', amount: 1 }, { begin: false });
    const first = await held; // claimed and completed, not committed yet
    assert.equal(first.outcome, 'new');
    await assert.rejects(pay(b, 'p-3', { account: 'c', amount: 1 }), (err) => err instanceof InProgressError && err.retryAfter >= 1);
    const waiting = pay(b, 'p-3', { account: 'c', amount: 1 }, { claimWait: 5 });
    setTimeout(() => a.query('COMMIT'), 300);
    const replay = await waiting;
    assert.equal(replay.outcome, 'replay');
    assert.deepEqual(replay.value, first.value);
  } finally {
    a.release();
    b.release();
  }
});

test('begin: false works inside the caller\'s transaction, which the caller rolls back', async () => {
  const client = await pool.connect();
  try {
    const before = await count();
    await client.query('BEGIN');
    const r = await pay(client, 'p-4', { account: 'd', amount: 2 }, { begin: false });
    assert.equal(r.outcome, 'new');
    await client.query('ROLLBACK');
    assert.equal(await count(), before);
    assert.equal((await pay(client, 'p-4', { account: 'd', amount: 2 })).outcome, 'new');
  } finally {
    client.release();
  }
});

test('a database restart mid-transaction: the work and the claim roll back together, the retry is new and runs once', async () => {
  const before = await count();
  const client = await pool.connect();
  client.on('error', () => {}); // the server goes away under it
  await assert.rejects(idempotentTransaction(client, { key: 'p-5', request: { amount: 7 }, scope: 'payments' }, async (c) => {
    await c.query("INSERT INTO payments (account, amount) VALUES ('e', 7)");
    cluster.stop('fast');
    cluster.restart();
    await c.query('SELECT 1'); // the connection is gone: the transaction never commits
  }));
  client.release(true);
  await new Promise((r) => setTimeout(r, 200)); // the pool drops its idle connections that the restart closed
  const again = await pool.connect();
  try {
    const r = await pay(again, 'p-5', { account: 'e', amount: 7 });
    assert.equal(r.outcome, 'new');
    assert.equal((await pay(again, 'p-5', { account: 'e', amount: 7 })).outcome, 'replay');
  } finally {
    again.release();
  }
  assert.equal(await count(), before + 1);
}, { skip: NO_RESTART });
