'use strict';
// The one-transaction style on the caller's pg client: claim, do the work, complete, commit. If
// anything throws, the transaction rolls back and the claim vanishes with it.

const db = require('./db');
const { InProgressError, MismatchError } = require('./errors');

async function idempotentTransaction(client, options, fn) {
  if (!client || typeof client.query !== 'function') throw new TypeError('idempotentTransaction: client must be a pg Client or PoolClient');
  if (typeof fn !== 'function') throw new TypeError('idempotentTransaction: fn must be a function');
  const key = db.checkKey(options.key);
  const scope = options.scope ?? '';
  const ttl = db.interval(options.ttl, 'ttl');
  const lease = db.interval(options.lease, 'lease');
  const request = options.request === undefined || options.request === null ? null
    : db.toJsonText(options.request, 'the request');
  const own = options.begin ?? true; // false: the caller has begun the transaction and commits it
  if (own) await client.query('BEGIN');
  try {
    if (options.claimWait !== undefined && options.claimWait !== null) {
      // How long the claim may wait for another open transaction's claim of the key.
      await client.query("SELECT set_config('idempotency.claim_wait', $1, true)", [typeof options.claimWait === 'number' ? `${Math.round(options.claimWait * 1000)}ms` : String(options.claimWait)]);
    }
    const claimWait = typeof options.claimWait === 'number' ? options.claimWait : undefined;
    const c = await db.claim(client, { key, request, scope, ttl, lease, claimWait });
    let result;
    if (c.outcome === 'replay') {
      result = { value: c.response, status: c.responseStatus, outcome: 'replay', replayed: true, expiresAt: c.expiresAt };
    } else if (c.outcome === 'in_progress') {
      throw new InProgressError({ key, scope, retryAfter: c.retryAfter ?? 1, expiresAt: c.expiresAt });
    } else if (c.outcome === 'mismatch') {
      throw new MismatchError({ key, scope });
    } else {
      const ctx = { key, scope, token: c.token, status: options.status ?? 200, expiresAt: c.expiresAt, client };
      const value = await fn(client, ctx);
      const expiresAt = await db.complete(client, {
        key, response: db.toJsonText(value, 'the result'), status: ctx.status, scope, token: c.token, ttl,
      });
      result = { value, status: ctx.status, outcome: 'new', replayed: false, expiresAt };
    }
    if (own) await client.query('COMMIT');
    return result;
  } catch (err) {
    if (own) await client.query('ROLLBACK').catch(() => {});
    throw err;
  }
}

module.exports = { idempotentTransaction };
