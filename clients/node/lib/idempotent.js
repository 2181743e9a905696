'use strict';
// The leased style around a function with an external side effect: claim (committed), run the
// function, then complete with its result, or release the key when it throws. Hashing, expiry,
// leases and fencing are the extension's: this file only sends the statements and reads the
// outcome.

const { AsyncLocalStorage } = require('node:async_hooks');
const db = require('./db');
const { IdempotencyError, InProgressError, MismatchError, FencedError } = require('./errors');

const current = new AsyncLocalStorage();

// What a running function can learn about its claim (currentClaim()), and its checkpoint().
class Claim {
  constructor(q, { key, scope, token, recoveryPoint, expiresAt, leaseEnd }) {
    this.key = key;
    this.scope = scope;
    this.token = token;
    this.recoveryPoint = recoveryPoint;
    this.expiresAt = expiresAt;
    Object.defineProperty(this, 'q', { value: q });
    Object.defineProperty(this, 'leaseEnd', { value: leaseEnd ?? null });
  }

  // Records progress (a takeover after a crash gets it back in recoveryPoint). Throws
  // FencedError when another call has taken the key over.
  async checkpoint(point) {
    await db.checkpoint(this.q, { key: this.key, point, scope: this.scope, token: this.token, leaseEnd: this.leaseEnd });
    this.recoveryPoint = point;
  }

  // idempotency.derive_key(this.key, step, params): the key of one downstream side effect (an
  // SMTP message id, a payment provider's Idempotency-Key). On the wrapper's connection, so a
  // lost connection is repeated on a new one like every other statement of the claim.
  async deriveKey(step, params) {
    return db.deriveKey(this.q, { parent: this.key, step, params });
  }
}

function currentClaim() {
  return current.getStore();
}

function idempotent(fn, options = {}) {
  if (typeof fn !== 'function') throw new TypeError('idempotent(fn, options): fn must be a function');
  if (options.key === undefined) throw new TypeError('idempotent: options.key is required (a string or a function of the arguments)');
  const scope = options.scope ?? '';
  const ttl = db.interval(options.ttl, 'ttl');
  const lease = db.interval(options.lease, 'lease');
  const waitMs = (options.wait ?? 10) * 1000;
  const releaseOnError = options.releaseOnError ?? true;
  const status = options.status ?? 200;
  let q = null;
  const conn = () => (q ??= new db.Db(options));

  async function detailed(...args) {
    const key = db.checkKey(typeof options.key === 'function' ? options.key(...args) : options.key);
    const payload = options.request === null ? undefined
      : typeof options.request === 'function' ? options.request(...args) : args;
    const request = db.toJsonText(payload, 'the request');
    const deadline = Date.now() + waitMs;
    const d = conn();
    let poll = 50; // while waiting: claim again every 50 ms, doubling up to 1 s (at most retry_after)
    for (;;) {
      const c = await db.claim(d, { key, request, scope, ttl, lease });
      if (c.outcome === 'replay') {
        if (c.responseStatus === 500 && c.response && typeof c.response === 'object' && UNSTORABLE in c.response) {
          throw unstorable(key, scope, c.response[UNSTORABLE]);
        }
        const value = options.deserialize ? options.deserialize(c.response) : c.response;
        return { value, outcome: 'replay', replayed: true, token: c.token, expiresAt: c.expiresAt };
      }
      if (c.outcome === 'mismatch') throw new MismatchError({ key, scope });
      if (c.outcome === 'in_progress') {
        const left = deadline - Date.now();
        if (left <= 0) throw new InProgressError({ key, scope, retryAfter: c.retryAfter ?? 1, expiresAt: c.expiresAt });
        await db.sleep(Math.min((c.retryAfter ?? 1) * 1000, left, poll));
        poll = Math.min(poll * 2, 1000);
        continue;
      }
      // new: a first call, or a takeover after the holder's lease ran out (recoveryPoint set).
      const claim = new Claim(d, {
        key, scope, token: c.token, recoveryPoint: c.recoveryPoint, expiresAt: c.expiresAt, leaseEnd: c.leaseEnd,
      });
      let value;
      try {
        value = await current.run(claim, () => fn(...args));
      } catch (err) {
        if (err instanceof FencedError) continue; // taken over: claim again for the final answer
        const release = typeof releaseOnError === 'function' ? releaseOnError(err) : releaseOnError;
        if (release) {
          try {
            await db.release(d, { key, scope, token: c.token, leaseEnd: c.leaseEnd });
          } catch (releaseErr) {
            // The key stays in progress until its lease ends; the function's error matters more.
            err.releaseError = releaseErr;
          }
        }
        throw err;
      }
      let response;
      let failure = null;
      try {
        response = options.serialize ? options.serialize(value) : db.toJsonText(value, 'the result');
        if (response !== null && response !== undefined) JSON.parse(response);
      } catch (err) {
        // The side effect ran: the key is completed with the error, so that it never runs again
        // for this key (this call and every retry throw IDEMPOTENCY_UNSTORABLE).
        failure = err.message;
        response = JSON.stringify({ [UNSTORABLE]: failure });
      }
      try {
        let expiresAt;
        try {
          // Repeated on new connections after a lost one, for as long as the lease lasts.
          expiresAt = await db.complete(d, {
            key, response, status: failure === null ? status : 500, scope, token: c.token, ttl, leaseEnd: c.leaseEnd,
          });
        } catch (err) {
          // IK002 for our own token: an attempt whose answer was lost with its connection had
          // committed. The result stored is this call's: it is answered as new, not as a replay.
          expiresAt = err.code === 'IK002' ? await db.ownCompletion(d, { key, scope, token: c.token }) : null;
          if (expiresAt === null) throw err;
        }
        if (failure !== null) throw unstorable(key, scope, failure);
        return { value, outcome: 'new', replayed: false, token: c.token, expiresAt };
      } catch (err) {
        if (err instanceof IdempotencyError && err.code === 'IDEMPOTENCY_UNSTORABLE') throw err;
        // IK002/IK003: completed or taken over by another call meanwhile (our lease ran out):
        // claim again for the stored answer.
        if (db.fenced(err)) continue;
        if (err.code === 'IK001') {
          throw new IdempotencyError(`idempotency key '${key}' (scope '${scope}') expired or was forgotten before its result could be stored`,
            { code: 'IDEMPOTENCY_EXPIRED', key, scope, cause: err });
        }
        throw err;
      }
    }
  }

  async function wrapped(...args) {
    return (await detailed(...args)).value;
  }
  wrapped.detailed = detailed;
  wrapped.close = async () => {
    if (q !== null) await q.end();
  };
  return wrapped;
}

// The stored form of a result that could not be serialized (status 500).
const UNSTORABLE = 'pg_idempotency_unstorable';

function unstorable(key, scope, detail) {
  return new IdempotencyError(`idempotency key '${key}' (scope '${scope}'): the result could not be stored (${detail}); `
    + 'the function ran once and will not run again for this key', { code: 'IDEMPOTENCY_UNSTORABLE', key, scope });
}

module.exports = { idempotent, currentClaim, Claim };
