'use strict';
// Typed errors. Every error of the package is an IdempotencyError with a stable `code`.

class IdempotencyError extends Error {
  constructor(message, { code = 'IDEMPOTENCY_ERROR', key, scope, cause } = {}) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = 'IdempotencyError';
    this.code = code;
    this.key = key;
    this.scope = scope;
  }
}

// claim answered in_progress (another call holds the key) and the wait ran out.
class InProgressError extends IdempotencyError {
  constructor({ key, scope, retryAfter, expiresAt }) {
    super(`idempotency key '${key}' (scope '${scope}') is in progress in another call; retry in ${retryAfter} s`,
      { code: 'IDEMPOTENCY_IN_PROGRESS', key, scope });
    this.name = 'InProgressError';
    this.retryAfter = retryAfter; // seconds (a number, at least 1)
    this.expiresAt = expiresAt ?? null; // Date or null
  }
}

// claim answered mismatch: the key was used for a different request.
class MismatchError extends IdempotencyError {
  constructor({ key, scope }) {
    super(`idempotency key '${key}' (scope '${scope}') was used for a different request`,
      { code: 'IDEMPOTENCY_MISMATCH', key, scope });
    this.name = 'MismatchError';
  }
}

// checkpoint/complete refused our token (IK002/IK003): another call took the key over after our
// lease ran out, or it is completed already.
class FencedError extends IdempotencyError {
  constructor({ key, scope, cause }) {
    super(`idempotency key '${key}' (scope '${scope}') is no longer ours: ${cause ? cause.message : 'fenced off'}`,
      { code: 'IDEMPOTENCY_FENCED', key, scope, cause });
    this.name = 'FencedError';
  }
}

module.exports = { IdempotencyError, InProgressError, MismatchError, FencedError };
