"""The one-transaction style on the caller's psycopg connection: claim, the caller's own writes,
complete, all in one transaction (a savepoint when the caller already has one open). If anything
in the block raises, the claim rolls back with the writes and the next retry is new.

Its statements are never prepared on the server (`prepare=False`), so the caller's connection may
come from a pooler in transaction mode: a statement prepared in one transaction would be missing,
or another of the same name, in the next one on another server connection."""

from __future__ import annotations

import contextlib
import datetime as dt
from typing import Any, Optional

import psycopg

from . import _otel
from ._core import (CLAIM_SQL, COMPLETE_SQL, IN_PROGRESS, MISMATCH, NEW, REPLAY, ClaimResult, InProgress, Mismatch,
                    claim_params, fenced_or_raise, to_json)

_WAIT_SQL = "SELECT set_config('idempotency.claim_wait', %(ms)s, true)"


class TransactionClaim:
    """The claim inside `idempotency_transaction`. `replayed` is True when the key was completed
    before: `response` / `response_status` hold the stored answer and the block should return it.
    Otherwise (outcome "new") the block does its work and calls `complete(response, status)`."""

    def __init__(self, conn, result: ClaimResult, ttl):
        self._conn, self._ttl = conn, ttl
        self.result = result
        self.completed_expires_at: Optional[dt.datetime] = None

    outcome = property(lambda self: self.result.outcome)
    replayed = property(lambda self: self.result.outcome == REPLAY)
    token = property(lambda self: self.result.token)
    response = property(lambda self: self.result.response)
    response_status = property(lambda self: self.result.response_status)
    expires_at = property(lambda self: self.completed_expires_at or self.result.expires_at)

    def _params(self, response, status):
        r = self.result
        return {"key": r.key, "response": to_json(response), "status": status, "scope": r.scope,
                "token": r.token, "ttl": self._ttl}

    def complete(self, response: Any, status: int = 200) -> dt.datetime:
        """Stores the answer in the same transaction; returns the key's new expires_at."""
        if self.result.outcome != NEW:
            raise RuntimeError("complete() is only for a new claim")
        with _otel.Op("complete", self.result.scope, self.result.key, self.result.token):
            try:
                self.completed_expires_at = self._conn.execute(COMPLETE_SQL, self._params(response, status),
                                                               prepare=False).fetchone()[0]
            except psycopg.Error as e:
                fenced_or_raise(e)
        return self.completed_expires_at

    async def acomplete(self, response: Any, status: int = 200) -> dt.datetime:
        if self.result.outcome != NEW:
            raise RuntimeError("complete() is only for a new claim")
        with _otel.Op("complete", self.result.scope, self.result.key, self.result.token):
            try:
                cur = await self._conn.execute(COMPLETE_SQL, self._params(response, status), prepare=False)
                self.completed_expires_at = (await cur.fetchone())[0]
            except psycopg.Error as e:
                fenced_or_raise(e)
        return self.completed_expires_at


def _wait_params(wait):
    return {"ms": str(int(wait.total_seconds() * 1000))}


def _wait_seconds(wait) -> Optional[float]:
    return None if wait is None else wait.total_seconds()


def _check(result: ClaimResult):
    if result.outcome == MISMATCH:
        raise Mismatch(result.key, result.scope)
    if result.outcome == IN_PROGRESS:
        raise InProgress(result.key, result.scope, result.retry_after)


def _finish(c: TransactionClaim):
    if c.outcome == NEW and c.completed_expires_at is None:
        raise RuntimeError("idempotency_transaction: the block ended without complete(); the claim is rolled back")


@contextlib.contextmanager
def idempotency_transaction(conn: psycopg.Connection, key: str, *, request: Any = None, scope: str = "",
                            ttl: Optional[dt.timedelta] = None, wait: Optional[dt.timedelta] = None):
    """`with idempotency_transaction(conn, key, request=...) as c:` claims `key` in a transaction of
    `conn` (`conn.transaction()`: a new one, or a savepoint in the caller's). Raises Mismatch, or
    InProgress (with retry_after) when another transaction holds the key; `wait` lets the claim
    wait that long for the other transaction (idempotency.claim_wait), which then usually turns
    into a replay. A new claim must be completed with `c.complete(...)` before the block ends."""
    with conn.transaction():
        with _otel.Op("claim", scope, key, claim_wait=_wait_seconds(wait)) as op:
            if wait is not None:
                conn.execute(_WAIT_SQL, _wait_params(wait), prepare=False)
            row = conn.execute(CLAIM_SQL, claim_params(key, request, scope, ttl, None), prepare=False).fetchone()
            result = ClaimResult.from_row(key, scope, row)
            op.claimed(result)
        _check(result)
        c = TransactionClaim(conn, result, ttl)
        yield c
        _finish(c)


@contextlib.asynccontextmanager
async def aidempotency_transaction(conn: psycopg.AsyncConnection, key: str, *, request: Any = None, scope: str = "",
                                   ttl: Optional[dt.timedelta] = None, wait: Optional[dt.timedelta] = None):
    """idempotency_transaction for an AsyncConnection; complete with `await c.acomplete(...)`."""
    async with conn.transaction():
        with _otel.Op("claim", scope, key, claim_wait=_wait_seconds(wait)) as op:
            if wait is not None:
                await conn.execute(_WAIT_SQL, _wait_params(wait), prepare=False)
            cur = await conn.execute(CLAIM_SQL, claim_params(key, request, scope, ttl, None), prepare=False)
            result = ClaimResult.from_row(key, scope, await cur.fetchone())
            op.claimed(result)
        _check(result)
        c = TransactionClaim(conn, result, ttl)
        yield c
        _finish(c)
