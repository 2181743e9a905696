'use strict';
// pg-idempotency: the idempotency PostgreSQL extension from Node.js. A thin layer over its SQL
// API: hashing, expiry, leases and fencing are the extension's.

const { idempotent, currentClaim } = require('./lib/idempotent');
const { idempotentTransaction } = require('./lib/transaction');
const { idempotentBatch, claimMany, completeMany } = require('./lib/batch');
const { expressIdempotency } = require('./lib/express');
const { fastifyIdempotency } = require('./lib/fastify');
const { parseValue: parseIdempotencyKey, sfString } = require('./lib/key');
const { IdempotencyError, InProgressError, MismatchError, FencedError } = require('./lib/errors');

module.exports = {
  idempotent,
  currentClaim,
  idempotentTransaction,
  idempotentBatch,
  claimMany,
  completeMany,
  expressIdempotency,
  fastifyIdempotency,
  parseIdempotencyKey,
  sfString,
  IdempotencyError,
  InProgressError,
  MismatchError,
  FencedError,
};
