"""A persistence layer for AWS Lambda Powertools' idempotency utility (aws-lambda-powertools 3.x):
its `@idempotent` and `@idempotent_function` keep their records in PostgreSQL through the
extension instead of DynamoDB or Redis.

    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent
    from pg_idempotency.powertools import PostgresPersistenceLayer

    persistence_layer = PostgresPersistenceLayer(conninfo="host=... dbname=...")

    @idempotent(persistence_store=persistence_layer, config=IdempotencyConfig(event_key_jmespath="body"))
    def handler(event, context): ...

How the contract maps onto the SQL API:

- `_put_record` (INPROGRESS) is `claim(key, request, scope, ttl, lease)`. Powertools' key
  (`<function>#<hash of the event key>`) is the key; `scope` is the layer's (default
  "powertools"); the TTL is `expires_after_seconds`; the lease is the Lambda's remaining time
  when the context is registered (`in_progress_expiry_timestamp`), else `lease` (default: the
  server's default_lease). `new` keeps the token for `_update_record` / `_delete_record`; any
  other outcome raises IdempotencyItemAlreadyExistsError carrying the record (COMPLETED with the
  stored response for replay, INPROGRESS with the lease's end for in_progress), so Powertools
  needs no second read. An INPROGRESS record whose lease ran out is taken over by the next claim
  (`new`), which Powertools' DynamoDB layer only does with a registered Lambda context.
- Payload validation (`payload_validation_jmespath`): the claim's request is
  `{"payload_hash": <Powertools' hash>}`, so the extension detects a different payload
  (`mismatch`), raised as IdempotencyValidationError.
- `_update_record` (COMPLETED) is `complete(key, response, 200, scope, token, ttl)`: the
  response is the JSON Powertools serialised, stored as jsonb.
- `_delete_record` (the function raised) is `release(key, scope, token)`: it never deletes a
  completed record.
- `_get_record` is `lookup(key, scope)`; IdempotencyItemNotFoundError when there is none.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Optional

from aws_lambda_powertools.utilities.idempotency.exceptions import (IdempotencyItemAlreadyExistsError,
                                                                     IdempotencyItemNotFoundError,
                                                                     IdempotencyValidationError)
from aws_lambda_powertools.utilities.idempotency.persistence.base import BasePersistenceLayer
from aws_lambda_powertools.utilities.idempotency.persistence.datarecord import STATUS_CONSTANTS, DataRecord

from ._core import IN_PROGRESS, MISMATCH, NEW, REPLAY, Store

_STATUS = {"in_progress": STATUS_CONSTANTS["INPROGRESS"], "completed": STATUS_CONSTANTS["COMPLETED"]}


class PostgresPersistenceLayer(BasePersistenceLayer):
    def __init__(self, conninfo: Optional[str] = None, *, scope: str = "powertools",
                 lease: Optional[dt.timedelta] = None, store: Optional[Store] = None):
        super().__init__()
        self.store = store or Store(conninfo, application_name="pg_idempotency_powertools")
        self.scope = scope
        self.lease = lease
        self._tokens: dict = {}
        self._payloads: dict = {}
        self._lock = threading.Lock()

    def _request(self, payload_hash: str):
        return {"payload_hash": payload_hash} if self.payload_validation_enabled and payload_hash else None

    def _put_record(self, data_record: DataRecord) -> None:
        ttl = dt.timedelta(seconds=self.expires_after_seconds)
        lease = self.lease
        if data_record.in_progress_expiry_timestamp is not None:
            left = data_record.in_progress_expiry_timestamp / 1000 - time.time()
            lease = dt.timedelta(seconds=max(1.0, left))
        if lease is not None and lease > ttl:
            lease = ttl
        key = data_record.idempotency_key
        request = self._request(data_record.payload_hash)
        c = self.store.claim(key, request, self.scope, ttl, lease)
        with self._lock:
            self._payloads[key] = data_record.payload_hash
        if c.outcome == NEW:
            with self._lock:
                self._tokens[key] = c.token
            return
        if c.outcome == MISMATCH:
            raise IdempotencyValidationError("Payload does not match stored record for this event key")
        expires = int(c.expires_at.timestamp()) if c.expires_at is not None else None
        if c.outcome == REPLAY:
            old = DataRecord(key, status=STATUS_CONSTANTS["COMPLETED"], expiry_timestamp=expires,
                             response_data=c.response_text or "", payload_hash=data_record.payload_hash)
        else:
            assert c.outcome == IN_PROGRESS
            until = time.time() + (c.retry_after.total_seconds() if c.retry_after else 1.0)
            old = DataRecord(key, status=STATUS_CONSTANTS["INPROGRESS"], expiry_timestamp=expires,
                             in_progress_expiry_timestamp=int(until * 1000), payload_hash=data_record.payload_hash)
        raise IdempotencyItemAlreadyExistsError(old_data_record=old)

    def _update_record(self, data_record: DataRecord) -> None:
        key = data_record.idempotency_key
        with self._lock:
            token = self._tokens.pop(key, None)
        response = data_record.response_data if data_record.response_data else "null"
        self.store.complete(key, response, 200, self.scope, token, dt.timedelta(seconds=self.expires_after_seconds),
                            response_is_json=True)

    def _delete_record(self, data_record: DataRecord) -> None:
        key = data_record.idempotency_key
        with self._lock:
            token = self._tokens.pop(key, None)
        self.store.release(key, self.scope, token)

    def _get_record(self, idempotency_key) -> DataRecord:
        r = self.store.lookup(idempotency_key, self.scope)
        if r is None:
            raise IdempotencyItemNotFoundError
        in_progress_until = None
        if r.status == "in_progress" and r.locked_until is not None:
            in_progress_until = int(r.locked_until.timestamp() * 1000)
        # The extension keeps a SHA-256 of the claim's request, not Powertools' hash: the payload
        # this process last claimed the key with is reported, which the claim already compared.
        with self._lock:
            payload_hash = self._payloads.get(idempotency_key, "")
        return DataRecord(idempotency_key, status=_STATUS[r.status], expiry_timestamp=int(r.expires_at.timestamp()),
                          in_progress_expiry_timestamp=in_progress_until,
                          response_data=r.response_text or "", payload_hash=payload_hash)


__all__ = ["PostgresPersistenceLayer"]
