"""pg_idempotency: the PostgreSQL `idempotency` extension from Python.

- `@idempotent(key=..., scope=..., ttl=..., lease=...)`: a function with an external side effect
  runs once per key; retries get its stored result (leased style).
- `idempotency_transaction(conn, key, ...)`: claim and complete inside the caller's transaction
  (one-transaction style).
- `process_batch(messages, key=..., handler=...)`: a queue consumer's batch, claimed with one
  claim_many and completed with one complete_many; one Item per message, in input order.
- `Store` / `AsyncStore`: the SQL API calls (claim, claim_many, complete, complete_many, release,
  checkpoint, forget, lookup).
- `pg_idempotency.asgi.IdempotencyMiddleware`, `pg_idempotency.django.IdempotencyMiddleware`:
  the Idempotency-Key header for Starlette/FastAPI and Django.
- `pg_idempotency.powertools.PostgresPersistenceLayer`: a store for AWS Lambda Powertools.
"""

from ._core import (AsyncStore, ClaimResult, Fenced, IdempotencyError, InProgress, InvalidKey, Mismatch, Record,
                    Store)
from .batch import Item, aprocess_batch, process_batch
from .decorator import Attempt, CallResult, Unstorable, current_attempt, idempotent, to_jsonable
from .transaction import TransactionClaim, aidempotency_transaction, idempotency_transaction

__version__ = "0.1.0"

__all__ = [
    "idempotent", "current_attempt", "Attempt", "CallResult", "to_jsonable",
    "process_batch", "aprocess_batch", "Item",
    "idempotency_transaction", "aidempotency_transaction", "TransactionClaim",
    "Store", "AsyncStore", "ClaimResult", "Record",
    "IdempotencyError", "InProgress", "Mismatch", "Fenced", "InvalidKey", "Unstorable",
]
