'use strict';
// OpenTelemetry spans and metrics of the SQL API calls, when the application has installed
// @opentelemetry/api (an optional peer dependency); without it every call here does nothing and
// nothing of OpenTelemetry is loaded.
//
// One span per claim, complete, release and checkpoint (idempotency.claim, ...), the counter
// idempotency.claims (by idempotency.outcome), the histogram idempotency.claim.duration and the
// counter idempotency.completion.retries: the names and attributes are the same in the three
// client packages (docs/operations.md, "Client traces and metrics"). No attribute carries the key
// or the request: the key appears only as idempotency.key_hash, the first 16 hex digits of the
// SHA-256 of scope, a NUL byte and key.

const crypto = require('node:crypto');

let api = null;
try {
  api = require('@opentelemetry/api');
} catch (err) {
  if (err.code !== 'MODULE_NOT_FOUND') throw err;
}

const NAME = 'pg-idempotency';
const VERSION = require('../package.json').version;
const DURATION_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10];

function keyHash(scope, key) {
  return crypto.createHash('sha256').update(String(scope), 'utf8').update('\0').update(String(key), 'utf8')
    .digest('hex').slice(0, 16);
}

// A token (text: a bigint) as an attribute: a number when it is exact as one, else its text.
function tokenValue(token) {
  const n = Number(token);
  return Number.isSafeInteger(n) ? n : String(token);
}

// The instruments of the current global meter provider (the API has no proxy meter: a provider
// registered later gets its own instruments).
let instruments = null;
function meters() {
  const provider = api.metrics.getMeterProvider();
  if (!instruments || instruments.provider !== provider) {
    const meter = provider.getMeter(NAME, VERSION);
    instruments = {
      provider,
      claims: meter.createCounter('idempotency.claims', {
        unit: '{claim}', description: 'Claims, by the outcome the extension returned',
      }),
      duration: meter.createHistogram('idempotency.claim.duration', {
        unit: 's', description: 'Duration of a claim, reconnects included',
        advice: { explicitBucketBoundaries: DURATION_BUCKETS },
      }),
      retries: meter.createCounter('idempotency.completion.retries', {
        unit: '{retry}',
        description: 'complete, checkpoint and release repeated on a new connection after a broken one',
      }),
    };
  }
  return instruments;
}

// The error's SQLSTATE (IK003, ...) or class name; never its message (it may name the key).
function errorType(err) {
  if (err && typeof err.code === 'string' && /^[0-9A-Z]{5}$/.test(err.code)) return err.code;
  if (err && err.cause && typeof err.cause.code === 'string' && /^[0-9A-Z]{5}$/.test(err.cause.code)) return err.cause.code;
  return (err && (err.code || err.name)) || 'Error';
}

class Op {
  constructor(name, { scope, key, token, claimWait }) {
    this.name = name;
    this.retries = 0;
    this.outcome = null;
    this.error = null;
    this.started = performance.now();
    const attributes = { 'idempotency.scope': scope, 'idempotency.key_hash': keyHash(scope, key) };
    if (token !== undefined && token !== null) attributes['idempotency.token'] = tokenValue(token);
    if (claimWait !== undefined && claimWait !== null) attributes['idempotency.claim_wait'] = claimWait;
    this.span = api.trace.getTracer(NAME, VERSION).startSpan(`idempotency.${name}`, {
      kind: api.SpanKind.CLIENT, attributes,
    });
  }

  retried() { this.retries += 1; }

  claimed(c) {
    this.outcome = c.outcome;
    const s = this.span;
    s.setAttribute('idempotency.outcome', c.outcome);
    s.setAttribute('idempotency.replay', c.outcome === 'replay');
    if ((c.outcome === 'new' || c.outcome === 'replay') && c.token !== null && c.token !== undefined) {
      s.setAttribute('idempotency.token', tokenValue(c.token));
    }
    if (c.retryAfter !== null && c.retryAfter !== undefined) s.setAttribute('idempotency.retry_after', c.retryAfter);
    if (c.outcome === 'new') s.setAttribute('idempotency.resumed', c.recoveryPoint !== null && c.recoveryPoint !== undefined);
  }

  waited(seconds) { this.span.setAttribute('idempotency.waited', seconds); }

  released(released) { this.span.setAttribute('idempotency.released', Boolean(released)); }

  failed(err) { this.error = errorType(err); }

  end() {
    const s = this.span;
    s.setAttribute('idempotency.retries', this.retries);
    const attrs = {};
    if (this.error !== null) {
      s.setAttribute('error.type', this.error);
      s.setStatus({ code: api.SpanStatusCode.ERROR });
      attrs['error.type'] = this.error;
    }
    const m = meters();
    if (this.name === 'claim') {
      if (this.outcome !== null) attrs['idempotency.outcome'] = this.outcome;
      m.claims.add(1, attrs);
      m.duration.record((performance.now() - this.started) / 1000, attrs);
    } else if (this.retries) {
      m.retries.add(this.retries, { 'idempotency.operation': this.name });
    }
    s.end();
  }
}

// Without @opentelemetry/api: counts nothing, records nothing.
const NOOP = Object.freeze({
  retried() {}, claimed() {}, waited() {}, released() {}, failed() {},
});

// traced('claim', { scope, key, token?, claimWait? }, async (op) => ...): fn runs with its span
// current (a pg instrumentation's spans nest in it); the span ends when fn settles.
async function traced(name, attrs, fn) {
  if (api === null) return fn(NOOP);
  const op = new Op(name, attrs);
  try {
    return await api.context.with(api.trace.setSpan(api.context.active(), op.span), () => fn(op));
  } catch (err) {
    op.failed(err);
    throw err;
  } finally {
    op.end();
  }
}

module.exports = { traced, keyHash, enabled: api !== null, NOOP };
