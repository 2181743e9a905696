'use strict';
// The database side: a pg Pool (given, or made from a connection string / the PG* environment
// variables) and every statement of the SQL API the package sends. Statements of the leased
// style run on their own (autocommit) and are repeated after a lost connection or a
// serialization failure; each of them is safe to repeat (see README, "Failures").

const { IdempotencyError, FencedError } = require('./errors');
const { traced } = require('./otel');

// Errors that say the connection broke, not that the statement was refused: the statement may or
// may not have run, and repeating it on another connection is safe. SQLSTATE class 08 covers
// PgBouncer's own errors as well (08P01: 'server conn crashed?', 'pgbouncer cannot connect to
// server', 'query_wait_timeout').
const LOST_CODES = new Set([
  '57P01', '57P02', '57P03', // admin shutdown, crash shutdown, cannot connect now (starting up)
  'ECONNRESET', 'ECONNREFUSED', 'ENOENT', 'EPIPE', 'ETIMEDOUT', 'EHOSTUNREACH', 'ENETUNREACH',
]);

function connectionLost(err) {
  return Boolean(err) && (LOST_CODES.has(err.code) || /^08[0-9A-Z]{3}$/.test(String(err.code)) ||
    /Connection terminated|not queryable|Client was closed|Connection ended|timeout exceeded when trying to connect|server conn crashed|server closed the connection unexpectedly/i
      .test(String(err.message)));
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// A number of seconds or a PostgreSQL interval string ('5 minutes'); null/undefined: the default.
function interval(value, name) {
  if (value === undefined || value === null) return null;
  if (typeof value === 'number') {
    if (!Number.isFinite(value)) throw new TypeError(`${name} must be a finite number of seconds`);
    return `${value.toFixed(6)} seconds`;
  }
  if (typeof value === 'string') return value;
  throw new TypeError(`${name} must be a number of seconds or a PostgreSQL interval string`);
}

function checkKey(key, what = 'key') {
  if (typeof key !== 'string') throw new TypeError(`${what} must be a string`);
  return key;
}

const CLAIM_COLUMNS = `c.outcome::text AS outcome, c.token::text AS token, c.response, c.response_status,
       extract(epoch FROM c.retry_after)::float8 AS retry_after, c.expires_at, c.recovery_point`;

// The length (seconds) of the lease a new claim got, given the claim's ttl and lease parameters:
// the lease, or least(default_lease, ttl) as the extension computes it when none is passed (NULL
// where those settings are not defined). The completion of the claim is repeated after lost
// connections for as long as the lease lasts (Db.until). Evaluated after the claim (the select
// list of its row), so the extension's settings are defined by then.
const leaseSeconds = (ttl, lease) => `extract(epoch FROM coalesce(${lease}::interval,
       least(current_setting('idempotency.default_lease', true)::interval,
             coalesce(${ttl}::interval, current_setting('idempotency.default_ttl', true)::interval))))::float8 AS lease_seconds`;

// The claim of the leased style and of the one-transaction helper. `request` is JSON text or null.
const CLAIM_SQL = `SELECT ${CLAIM_COLUMNS}, ${leaseSeconds('$4', '$5')}
  FROM idempotency.claim($1, $2::jsonb, scope => $3, ttl => $4::interval, lease => $5::interval) c`;

function claimRow(row) {
  return {
    outcome: row.outcome,
    token: row.token, // a bigint, kept as text: never through a JavaScript number
    response: row.response,
    responseStatus: row.response_status,
    retryAfter: row.retry_after === null ? null : Math.max(1, Math.ceil(row.retry_after)),
    expiresAt: row.expires_at,
    recoveryPoint: row.recovery_point,
    // When the lease of a new claim ends, by this process' clock (from the answer: a little after
    // the server's own count began); null when unknown.
    leaseEnd: row.lease_seconds === null || row.lease_seconds === undefined ? null
      : Date.now() + row.lease_seconds * 1000,
  };
}

class Db {
  // options: { pool } or { connectionString } (or neither: the PG* environment variables);
  // patience: how long (ms) a statement is repeated after lost connections; connectTimeout
  // (seconds, default 5): how long one connection attempt of an owned pool may take.
  constructor(options = {}) {
    this.patience = options.reconnectTimeout ?? 30000;
    this.onLost = options.onConnectionLost ?? (() => {});
    if (options.pool) {
      this.pool = options.pool;
      this.owned = false;
    } else {
      const { Pool } = require('pg');
      this.pool = new Pool({
        ...(options.connectionString ? { connectionString: options.connectionString } : {}),
        max: options.poolSize ?? 10,
        connectionTimeoutMillis: Math.round((options.connectTimeout ?? 5) * 1000),
        application_name: options.applicationName ?? 'pg-idempotency',
      });
      // An idle connection that the server drops emits 'error' on the pool: without a listener
      // the process would die. The next statement simply gets a new connection.
      this.pool.on('error', (err) => this.onLost(err));
      this.owned = true;
    }
  }

  // One statement, repeated after a lost connection (until `patience` ms, default this.patience,
  // run out) or a 40001/40P01. `op` (lib/otel.js) counts the repeats after lost connections.
  async query(sql, params, patience = this.patience, op = undefined) {
    const deadline = Date.now() + patience;
    let pause = 100;
    for (;;) {
      try {
        return (await this.pool.query(sql, params)).rows;
      } catch (err) {
        if (err.code === '40001' || err.code === '40P01') {
          await sleep(20 + Math.random() * 30);
        } else if (connectionLost(err) && Date.now() < deadline) {
          this.onLost(err);
          if (op) op.retried();
          await sleep(pause);
          pause = Math.min(pause * 2, 1000);
        } else {
          throw err;
        }
      }
    }
  }

  // How long (ms from now) to repeat a statement that finishes a claim (complete, checkpoint,
  // release) whose lease ends at `leaseEnd`: until then no other call can take the key over, so
  // the completion is still ours to store after a pooler or server dropped the connection; at
  // least `patience`, as every statement.
  until(leaseEnd) {
    return Math.max(this.patience, leaseEnd === null || leaseEnd === undefined ? 0 : leaseEnd - Date.now());
  }

  async end() {
    if (this.owned) await this.pool.end();
  }
}

// The statements, each on a queryable: a Db (repeated on lost connections, each time on a
// connection of the pool that is not the broken one) or a pg Client/Pool (the caller's
// transaction: never repeated). `leaseEnd`: the statement finishes a claim whose lease ends then.
async function run(q, sql, params, leaseEnd, op) {
  if (q instanceof Db) return q.query(sql, params, leaseEnd === undefined ? q.patience : q.until(leaseEnd), op);
  return (await q.query(sql, params)).rows;
}

async function claim(q, { key, request, scope, ttl, lease, claimWait }) {
  return traced('claim', { scope, key, claimWait }, async (op) => {
    const rows = await run(q, CLAIM_SQL, [key, request, scope, ttl, lease], undefined, op);
    const c = claimRow(rows[0]);
    op.claimed(c);
    return c;
  });
}

// idempotency.claim_many: one claim row per key, in input order. `requests`: JSON texts or null.
async function claimMany(q, { keys, requests, scope, ttl, lease }) {
  const rows = await run(q, `SELECT ${CLAIM_COLUMNS}, ${leaseSeconds('$4', '$5')}
  FROM idempotency.claim_many($1::text[], $2::jsonb[], scope => $3, ttl => $4::interval,
                              lease => $5::interval) c
 ORDER BY c.ord`, [keys, requests, scope, ttl, lease]);
  return rows.map(claimRow);
}

// idempotency.complete_many: all or nothing; each new expires_at, in input order.
async function completeMany(q, { keys, responses, statuses, scope, tokens, ttl, leaseEnd }) {
  const rows = await run(q, `SELECT t.e AS expires_at
  FROM idempotency.complete_many($1::text[], $2::jsonb[], response_statuses => $3::int[], scope => $4,
                                 tokens => $5::bigint[], ttl => $6::interval) WITH ORDINALITY AS t(e, i)
 ORDER BY t.i`, [keys, responses, statuses, scope, tokens, ttl], leaseEnd);
  return rows.map((r) => r.expires_at);
}

function fenced(err) {
  return err && (err.code === 'IK002' || err.code === 'IK003');
}

async function complete(q, { key, response, status, scope, token, ttl, leaseEnd }) {
  return traced('complete', { scope, key, token }, async (op) => {
    const rows = await run(q,
      `SELECT idempotency.complete($1, $2::jsonb, $3::int, scope => $4, token => $5::bigint,
                                   ttl => $6::interval) AS expires_at`,
      [key, response, status, scope, token, ttl], leaseEnd, op);
    return rows[0].expires_at;
  });
}

// After IK002 (already completed) from a complete with `token`: whether the completion stored is
// this token's own, that is whether an earlier attempt of the same complete committed and only
// its answer was lost with the connection (a takeover completes with a larger token). Returns
// the stored row's expires_at then, else null.
async function ownCompletion(q, { key, scope, token }) {
  const rows = await run(q, `SELECT r.expires_at FROM idempotency.lookup($1, $2) r
    WHERE r.status = 'completed' AND r.token = $3::bigint`, [key, scope, token]);
  return rows.length ? rows[0].expires_at : null;
}

async function checkpoint(q, { key, point, scope, token, leaseEnd }) {
  return traced('checkpoint', { scope, key, token }, async (op) => {
    try {
      await run(q, 'SELECT idempotency.checkpoint($1, $2, scope => $3, token => $4::bigint)',
        [key, point, scope, token], leaseEnd, op);
    } catch (err) {
      if (fenced(err)) throw new FencedError({ key, scope, cause: err });
      throw err;
    }
  });
}

async function release(q, { key, scope, token, leaseEnd }) {
  return traced('release', { scope, key, token }, async (op) => {
    const rows = await run(q, 'SELECT idempotency.release($1, scope => $2, token => $3::bigint) AS released',
      [key, scope, token], leaseEnd, op);
    op.released(rows[0].released);
    return rows[0].released;
  });
}

async function deriveKey(q, { parent, step, params }) {
  const rows = await run(q, 'SELECT idempotency.derive_key($1, $2, $3::jsonb) AS key',
    [checkKey(parent, 'parent'), checkKey(step, 'step'), toJsonText(params, 'params')]);
  return rows[0].key;
}

async function lookupExpires(q, { key, scope }) {
  const rows = await run(q, 'SELECT (idempotency.lookup($1, $2)).expires_at AS expires_at', [key, scope]);
  return rows[0].expires_at;
}

function toJsonText(value, what) {
  if (value === undefined) return null;
  let text;
  try {
    text = JSON.stringify(value);
  } catch (err) {
    throw new IdempotencyError(`${what} is not JSON-serializable: ${err.message}`,
      { code: 'IDEMPOTENCY_NOT_JSON', cause: err });
  }
  return text === undefined ? null : text;
}

module.exports = {
  Db, connectionLost, interval, checkKey, claim, complete, checkpoint, release, lookupExpires,
  fenced, toJsonText, sleep, CLAIM_COLUMNS, deriveKey, claimMany, completeMany, run, leaseSeconds,
  ownCompletion, claimRow,
};
