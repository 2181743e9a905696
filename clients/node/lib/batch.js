'use strict';
// A queue consumer's batch (an SQS receive of 10, a Kafka poll of hundreds): one claim_many for
// the whole batch, the handler for the messages that are new, one complete_many for their
// results, a release for each message whose handler threw. One message's failure never fails
// the batch: every message gets an item, in input order.

const db = require('./db');
const { IdempotencyError, InProgressError, MismatchError, FencedError } = require('./errors');

function fencedError(err, scope) {
  return err && (err.code === 'IK001' || err.code === 'IK002' || err.code === 'IK003')
    ? new FencedError({ key: keyOf(err), scope, cause: err }) : null;
}

// The key the extension names in a complete_many error ("cannot complete key 'm2' in scope ..."), if any.
function keyOf(err) {
  const m = /key '((?:[^']|'')*)'/.exec(String(err.message));
  return m ? m[1].replace(/''/g, "'") : undefined;
}

function checkKeys(keys) {
  if (!Array.isArray(keys)) throw new TypeError('keys must be an array of strings');
  keys.forEach((k, i) => db.checkKey(k, `keys[${i}]`));
  return keys;
}

function sameLength(name, arr, keys) {
  if (arr !== undefined && arr !== null && (!Array.isArray(arr) || arr.length !== keys.length)) {
    throw new TypeError(`${name} must be an array with one element per key (${keys.length})`);
  }
}

// claimMany(queryable, keys, options): idempotency.claim_many on a pg Pool or Client. Each
// result is what claim would answer for that key alone; a key repeated within the call is
// in_progress at its later positions (mismatch with a different request).
async function claimMany(q, keys, options = {}) {
  checkKeys(keys);
  sameLength('options.requests', options.requests, keys);
  const requests = options.requests == null ? null
    : options.requests.map((r, i) => db.toJsonText(r, `requests[${i}]`));
  const scope = options.scope ?? '';
  const rows = await db.claimMany(q, {
    keys, requests, scope, ttl: db.interval(options.ttl, 'ttl'), lease: db.interval(options.lease, 'lease'),
  });
  // leaseEnd is for the package's own completion (idempotentBatch), not part of this answer.
  return rows.map(({ leaseEnd, ...c }, i) => ({ key: keys[i], scope, ...c }));
}

// completeMany(queryable, keys, responses, options): idempotency.complete_many, all or nothing.
// Throws FencedError (naming the refused key) when one position's claim is gone, completed or
// taken over; nothing is stored then.
async function completeMany(q, keys, responses, options = {}) {
  checkKeys(keys);
  sameLength('responses', responses, keys);
  sameLength('options.statuses', options.statuses, keys);
  sameLength('options.tokens', options.tokens, keys);
  const scope = options.scope ?? '';
  const texts = responses == null ? null
    : (options.responsesAreJson ? responses : responses.map((r, i) => db.toJsonText(r, `responses[${i}]`)));
  try {
    return await db.completeMany(q, {
      keys, responses: texts, statuses: options.statuses ?? null, scope,
      tokens: options.tokens ?? null, ttl: db.interval(options.ttl, 'ttl'),
    });
  } catch (err) {
    throw fencedError(err, scope) ?? err;
  }
}

// idempotentBatch(handler, options) -> async (messages) => items.
function idempotentBatch(handler, options = {}) {
  if (typeof handler !== 'function') throw new TypeError('idempotentBatch(handler, options): handler must be a function');
  if (typeof options.key !== 'function') {
    throw new TypeError('idempotentBatch: options.key must be a function of the message (its id, a business id)');
  }
  const scope = options.scope ?? '';
  const ttl = db.interval(options.ttl, 'ttl');
  const lease = db.interval(options.lease, 'lease');
  const waitMs = (options.wait ?? 0) * 1000;
  const releaseOnError = options.releaseOnError ?? true;
  const concurrency = options.concurrency ?? 1;
  if (!Number.isInteger(concurrency) || concurrency < 1) throw new TypeError('concurrency must be a positive integer');
  let q = null;
  const conn = () => (q ??= new db.Db(options));

  async function processBatch(messages) {
    const msgs = Array.from(messages);
    const keys = msgs.map((m, i) => db.checkKey(options.key(m), `the key of message ${i}`));
    const requests = typeof options.request === 'function'
      ? msgs.map((m, i) => db.toJsonText(options.request(m), `the request of message ${i}`)) : null;
    const d = conn();
    const items = new Array(msgs.length).fill(null);
    const item = (i, outcome, value, error) => ({
      message: msgs[i], key: keys[i], outcome, value, error, ok: error === undefined,
    });
    let pending = msgs.map((_, i) => i);
    const deadline = Date.now() + waitMs;
    let poll = 50;
    while (pending.length > 0) {
      const claims = await db.claimMany(d, {
        keys: pending.map((i) => keys[i]),
        requests: requests && pending.map((i) => requests[i]),
        scope, ttl, lease,
      });
      const first = new Map(); // key -> position claimed new in this round
      const fresh = []; const waiting = []; const followers = [];
      pending.forEach((i, n) => {
        const c = claims[n];
        if (c.outcome === 'replay') items[i] = item(i, 'replay', c.response);
        else if (c.outcome === 'mismatch') items[i] = item(i, 'failed', undefined, new MismatchError({ key: keys[i], scope }));
        else if (c.outcome === 'in_progress') (first.has(keys[i]) ? followers : waiting).push([i, c]);
        else {
          first.set(keys[i], i);
          fresh.push([i, c]);
        }
      });
      // The handler for the new ones, `concurrency` at a time.
      const done = [];
      let next = 0;
      const worker = async () => {
        while (next < fresh.length) {
          const [i, c] = fresh[next++];
          try {
            const value = await handler(msgs[i]);
            const text = db.toJsonText(value, `the handler's result for key '${keys[i]}'`);
            items[i] = item(i, 'new', value);
            done.push([i, c, text]);
          } catch (err) {
            const release = typeof releaseOnError === 'function' ? releaseOnError(err) : releaseOnError;
            if (release) {
              try {
                await db.release(d, { key: keys[i], scope, token: c.token, leaseEnd: c.leaseEnd });
              } catch (releaseErr) {
                if (err && typeof err === 'object') err.releaseError = releaseErr; // the lease ends it
              }
            }
            items[i] = item(i, 'failed', undefined, err);
          }
        }
      };
      await Promise.all(Array.from({ length: Math.min(concurrency, fresh.length) }, worker));
      done.sort((a, b) => a[0] - b[0]);
      const { again, expired } = await complete(d, done, keys, scope, ttl, options.status ?? 200);
      for (const i of again) items[i] = null; // fenced: claim again for the stored answer
      for (const i of expired) {
        items[i] = item(i, 'failed', undefined, new IdempotencyError(
          `idempotency key '${keys[i]}' (scope '${scope}') expired or was forgotten before its result could be stored`,
          { code: 'IDEMPOTENCY_EXPIRED', key: keys[i], scope }));
      }
      for (const [i] of followers) {
        const j = first.get(keys[i]);
        if (items[j] === null) again.push(i);
        else if (items[j].ok) items[i] = item(i, 'replay', items[j].value);
        else items[i] = item(i, 'failed', undefined, items[j].error);
      }
      const left = deadline - Date.now();
      if (waiting.length > 0 && left <= 0) {
        for (const [i, c] of waiting) {
          items[i] = item(i, 'failed', undefined,
            new InProgressError({ key: keys[i], scope, retryAfter: c.retryAfter ?? 1, expiresAt: c.expiresAt }));
        }
        waiting.length = 0;
      }
      if (waiting.length > 0 && again.length === 0) {
        const shortest = Math.min(...waiting.map(([, c]) => (c.retryAfter ?? 1) * 1000));
        await db.sleep(Math.max(0, Math.min(poll, left, shortest)));
        poll = Math.min(poll * 2, 1000);
      }
      pending = [...again, ...waiting.map(([i]) => i)].sort((a, b) => a - b);
    }
    return items;
  }

  processBatch.close = async () => {
    if (q !== null) await q.end();
  };
  return processBatch;
}

// complete_many for the handled positions (repeated after lost connections while the shortest
// lease lasts); when it is refused (one position taken over or completed, or our own
// complete_many committed before its connection was lost), one by one: a position whose stored
// completion is our own (IK002 for our token) stays done. Returns the positions refused
// (IK002/IK003), to be claimed again, and those whose claim was gone (IK001), as idempotent() does.
async function complete(d, done, keys, scope, ttl, status) {
  if (done.length === 0) return { again: [], expired: [] };
  const ends = done.map(([, c]) => c.leaseEnd).filter((e) => e !== null && e !== undefined);
  const leaseEnd = ends.length ? Math.min(...ends) : null;
  try {
    await db.completeMany(d, {
      keys: done.map(([i]) => keys[i]), responses: done.map(([, , t]) => t),
      statuses: done.map(() => status), scope, tokens: done.map(([, c]) => c.token), ttl, leaseEnd,
    });
    return { again: [], expired: [] };
  } catch (err) {
    if (!fencedError(err, scope)) throw err;
  }
  const refused = []; const expired = [];
  for (const [i, c, text] of done) {
    try {
      await db.complete(d, { key: keys[i], response: text, status, scope, token: c.token, ttl, leaseEnd: c.leaseEnd });
    } catch (err) {
      if (err.code === 'IK002' && await db.ownCompletion(d, { key: keys[i], scope, token: c.token }) !== null) continue;
      if (db.fenced(err)) refused.push(i);
      else if (err.code === 'IK001') expired.push(i);
      else throw err;
    }
  }
  return { again: refused, expired };
}

module.exports = { idempotentBatch, claimMany, completeMany };
