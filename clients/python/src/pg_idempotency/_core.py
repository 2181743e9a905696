"""The SQL API calls, their results and errors, and the two connection holders (sync and async).

Every statement here is one call of an `idempotency.*` function: the hashing, expiry, lease and
fencing rules are the extension's. JSON goes to the server as text (`::text::jsonb`) and comes
back as text, so numbers keep their exact spelling and the same statements run through psycopg
and through a Django cursor."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import psycopg

from . import _otel

# The lease a new claim got, in seconds (what locked_until - now() is in the claim's transaction):
# the lease asked for, else the server's idempotency.default_lease, at most the TTL. The client
# retries a completion that a broken connection interrupted for as long as the lease leaves time.
LEASE_COLUMN = """
       extract(epoch FROM least(coalesce(%(lease)s::interval,
                                         nullif(current_setting('idempotency.default_lease', true), '')::interval,
                                         interval '5 minutes'),
                                c.expires_at - now()))::float8"""

CLAIM_SQL = """
SELECT c.outcome::text, c.token, c.response::text, c.response_status,
       extract(epoch FROM c.retry_after)::float8, c.expires_at, c.recovery_point,""" + LEASE_COLUMN + """
  FROM idempotency.claim(%(key)s, request => %(request)s::text::jsonb, scope => %(scope)s,
                         ttl => %(ttl)s::interval, lease => %(lease)s::interval) c"""

COMPLETE_SQL = """
SELECT idempotency.complete(%(key)s, %(response)s::text::jsonb, %(status)s::int, scope => %(scope)s,
                            token => %(token)s::bigint, ttl => %(ttl)s::interval)"""

RELEASE_SQL = "SELECT idempotency.release(%(key)s, scope => %(scope)s, token => %(token)s::bigint)"

CHECKPOINT_SQL = """
SELECT idempotency.checkpoint(%(key)s, %(point)s, scope => %(scope)s, token => %(token)s::bigint)"""

FORGET_SQL = "SELECT idempotency.forget(%(key)s, scope => %(scope)s)"

LOOKUP_SQL = """
SELECT l.status::text, l.token, l.response::text, l.response_status, l.recovery_point,
       l.locked_until, l.expires_at
  FROM idempotency.lookup(%(key)s, scope => %(scope)s) l WHERE l.key IS NOT NULL"""

CLAIM_MANY_SQL = """
SELECT c.outcome::text, c.token, c.response::text, c.response_status,
       extract(epoch FROM c.retry_after)::float8, c.expires_at, c.recovery_point
  FROM idempotency.claim_many(%(keys)s::text[], requests => %(requests)s::text[]::jsonb[], scope => %(scope)s,
                              ttl => %(ttl)s::interval, lease => %(lease)s::interval) c
 ORDER BY c.ord"""

COMPLETE_MANY_SQL = """
SELECT e FROM idempotency.complete_many(%(keys)s::text[], %(responses)s::text[]::jsonb[],
                                        response_statuses => %(statuses)s::int[], scope => %(scope)s,
                                        tokens => %(tokens)s::bigint[], ttl => %(ttl)s::interval)
       WITH ORDINALITY AS t(e, i) ORDER BY t.i"""

# Errors of complete/checkpoint (docs/errors.md of the extension).
NOT_CLAIMED, ALREADY_COMPLETED, STALE_TOKEN = "IK001", "IK002", "IK003"

NEW, REPLAY, IN_PROGRESS, MISMATCH = "new", "replay", "in_progress", "mismatch"

DERIVE_KEY_SQL = "SELECT idempotency.derive_key(%(parent)s, %(step)s, %(params)s::text::jsonb)"

log = logging.getLogger("pg_idempotency")


class IdempotencyError(Exception):
    """Base class of the errors this package raises."""


class InProgress(IdempotencyError):
    """Another attempt holds the key (its lease runs, or its transaction is open). `retry_after`
    (a timedelta) is the time the extension says to wait before trying again."""

    def __init__(self, key: str, scope: str, retry_after: dt.timedelta):
        super().__init__(f"key {key!r} (scope {scope!r}) is in progress; retry after "
                         f"{retry_after.total_seconds():g} s")
        self.key, self.scope, self.retry_after = key, scope, retry_after


class Mismatch(IdempotencyError):
    """The key was used for a different request (its request hash differs)."""

    def __init__(self, key: str, scope: str):
        super().__init__(f"key {key!r} (scope {scope!r}) was used for a different request")
        self.key, self.scope = key, scope


class Fenced(IdempotencyError):
    """complete/checkpoint refused: the key is completed already (IK002), or another attempt took
    it over after this one's lease ran out (IK003), or the claim is gone (IK001)."""

    def __init__(self, sqlstate: str, message: str):
        super().__init__(message)
        self.sqlstate = sqlstate


class InvalidKey(IdempotencyError, ValueError):
    """The key (or scope) is not one the extension accepts: empty, over 255 characters, NUL, ...
    Raised before anything is claimed; the message is the extension's."""

    def __init__(self, message: str, sqlstate: str = "22023"):
        super().__init__(message)
        self.sqlstate = sqlstate


def invalid_key_or_raise(e: Exception):
    """Re-raises an argument error of claim (22023, 22004) as InvalidKey, any other as it is."""
    state = getattr(e, "sqlstate", None)
    if state in ("22023", "22004"):
        diag = getattr(e, "diag", None)
        raise InvalidKey(getattr(diag, "message_primary", None) or str(e), state) from e
    raise e


@dataclass(frozen=True)
class ClaimResult:
    """One row of `idempotency.claim`. `response` is the stored JSON decoded (replay only),
    `response_text` its exact text; `retry_after` a timedelta (in_progress only). `lease_ends` is
    when this attempt's lease runs out, on `time.monotonic()`'s clock (a new claim; None
    otherwise): a completion that a broken connection interrupted is retried until then."""

    key: str
    scope: str
    outcome: str
    token: Optional[int]
    response_text: Optional[str]
    response_status: Optional[int]
    retry_after: Optional[dt.timedelta]
    expires_at: Optional[dt.datetime]
    recovery_point: Optional[str]
    lease_ends: Optional[float] = None

    @property
    def response(self) -> Any:
        return None if self.response_text is None else json.loads(self.response_text)

    @classmethod
    def from_row(cls, key: str, scope: str, row) -> "ClaimResult":
        """From the 7 columns of claim_result, or 8 with the lease in seconds (LEASE_COLUMN)."""
        outcome, token, text, status, retry, expires, point = row[:7]
        lease = row[7] if len(row) > 7 and outcome == NEW else None
        return cls(key, scope, outcome, token, text, status,
                   None if retry is None else dt.timedelta(seconds=retry), expires, point,
                   None if lease is None else time.monotonic() + lease)


@dataclass(frozen=True)
class Record:
    """The live row of a key (`idempotency.lookup`)."""

    status: str
    token: int
    response_text: Optional[str]
    response_status: Optional[int]
    recovery_point: Optional[str]
    locked_until: Optional[dt.datetime]
    expires_at: dt.datetime

    @property
    def response(self) -> Any:
        return None if self.response_text is None else json.loads(self.response_text)


def to_json(value: Any) -> Optional[str]:
    """JSON text for a jsonb argument; None stays NULL."""
    return None if value is None else json.dumps(value, separators=(",", ":"))


def claim_params(key, request, scope, ttl, lease, request_is_json=False):
    return {"key": key, "request": request if request_is_json else to_json(request), "scope": scope,
            "ttl": ttl, "lease": lease}


def claim_many_params(keys, requests, scope, ttl, lease):
    keys = list(keys)
    if requests is not None:
        requests = [to_json(r) for r in requests]
        if len(requests) != len(keys):
            raise ValueError(f"requests has {len(requests)} elements, keys {len(keys)}: one request per key")
    return {"keys": keys, "requests": requests, "scope": scope, "ttl": ttl, "lease": lease}


def complete_many_params(keys, responses, statuses, scope, tokens, ttl, responses_are_json=False):
    keys = list(keys)
    responses = None if responses is None else [r if responses_are_json else to_json(r) for r in responses]
    statuses = None if statuses is None else list(statuses)
    tokens = None if tokens is None else list(tokens)
    for name, arr in (("responses", responses), ("statuses", statuses), ("tokens", tokens)):
        if arr is not None and len(arr) != len(keys):
            raise ValueError(f"{name} has {len(arr)} elements, keys {len(keys)}: one per key")
    return {"keys": keys, "responses": responses, "statuses": statuses, "scope": scope, "tokens": tokens,
            "ttl": ttl}


def fenced_or_raise(e: Exception):
    state = getattr(e, "sqlstate", None) or getattr(getattr(e, "__cause__", None), "sqlstate", None)
    if state in (NOT_CLAIMED, ALREADY_COMPLETED, STALE_TOKEN):
        diag = getattr(e, "diag", None) or getattr(e.__cause__, "diag", None)
        raise Fenced(state, getattr(diag, "message_primary", None) or str(e)) from e
    raise e


def _libpq_timeout(seconds: float) -> int:
    """libpq's connect_timeout: whole seconds, at least 2 (libpq's minimum)."""
    return max(2, math.ceil(seconds))


def is_unreachable(e: BaseException) -> bool:
    """The database cannot be reached (refused, timed out, lost): nothing was claimed."""
    return (_is_transient(e) if isinstance(e, psycopg.Error) else False) or isinstance(e, (OSError, TimeoutError)) \
        or type(e).__name__ in ("OperationalError", "InterfaceError")


def _is_transient(e: Exception) -> bool:
    """A lost connection or a server going down: the statement may be repeated on a new one."""
    return isinstance(e, (psycopg.OperationalError, psycopg.InterfaceError)) and not isinstance(
        e, psycopg.errors.QueryCanceled)


def _prepare(prepared_statements: bool) -> Optional[bool]:
    """psycopg's `prepare` argument: False never prepares on the server; None leaves it to
    psycopg (prepared from a statement's 6th execution on a connection)."""
    return None if prepared_statements else False


class _Calls:
    """The SQL API over `self.execute(sql, params) -> first row`."""

    def claim(self, key: str, request: Any = None, scope: str = "", ttl: Optional[dt.timedelta] = None,
              lease: Optional[dt.timedelta] = None) -> ClaimResult:
        """Raises InvalidKey for a key or scope the extension refuses."""
        with _otel.Op("claim", scope, key) as op:
            try:
                row = self.execute(CLAIM_SQL, claim_params(key, request, scope, ttl, lease))
            except psycopg.Error as e:
                invalid_key_or_raise(e)
            result = ClaimResult.from_row(key, scope, row)
            op.claimed(result)
            return result

    def _finishing_patience(self, lease_ends: Optional[float]) -> Optional[float]:
        """How long complete, release and checkpoint are repeated on a new connection when the
        connection breaks: the side effect has run, so for as long as the lease leaves time (a
        takeover after it would run the effect again), and at least reconnect_timeout."""
        if lease_ends is None:
            return None
        return max(self.reconnect_timeout, lease_ends - time.monotonic())

    def complete(self, key: str, response: Any, status: int = 200, scope: str = "", token: Optional[int] = None,
                 ttl: Optional[dt.timedelta] = None, response_is_json: bool = False,
                 lease_ends: Optional[float] = None) -> dt.datetime:
        """Raises Fenced (IK001, IK002, IK003). A broken connection is repeated on a new one with the
        same token, for as long as `lease_ends` (ClaimResult.lease_ends) leaves time; a repeat whose
        first try had committed raises Fenced (IK002)."""
        params = {"key": key, "response": response if response_is_json else to_json(response),
                  "status": status, "scope": scope, "token": token, "ttl": ttl}
        with _otel.Op("complete", scope, key, token):
            try:
                return self.execute(COMPLETE_SQL, params, patience=self._finishing_patience(lease_ends))[0]
            except Exception as e:
                fenced_or_raise(e)

    def claim_many(self, keys: Sequence[str], requests: Optional[Sequence[Any]] = None, scope: str = "",
                   ttl: Optional[dt.timedelta] = None, lease: Optional[dt.timedelta] = None) -> List[ClaimResult]:
        """idempotency.claim_many: one ClaimResult per key, in the order of `keys`, in one round trip.
        Each is what `claim` would answer for that key alone; a key repeated within the batch is
        `in_progress` at its later positions (`mismatch` with a different request)."""
        params = claim_many_params(keys, requests, scope, ttl, lease)
        rows = self.execute_all(CLAIM_MANY_SQL, params)
        return [ClaimResult.from_row(k, scope, r) for k, r in zip(params["keys"], rows)]

    def complete_many(self, keys: Sequence[str], responses: Optional[Sequence[Any]],
                      statuses: Optional[Sequence[int]] = None,
                      scope: str = "", tokens: Optional[Sequence[Optional[int]]] = None,
                      ttl: Optional[dt.timedelta] = None, responses_are_json: bool = False) -> List[dt.datetime]:
        """idempotency.complete_many: stores each key's response in one statement; returns each new
        expires_at in the order of `keys`. All or nothing: if one position's claim is gone, completed
        or taken over, Fenced is raised (naming that key) and nothing is stored."""
        params = complete_many_params(keys, responses, statuses, scope, tokens, ttl, responses_are_json)
        try:
            return [r[0] for r in self.execute_all(COMPLETE_MANY_SQL, params)]
        except Exception as e:
            fenced_or_raise(e)

    def release(self, key: str, scope: str = "", token: Optional[int] = None,
                lease_ends: Optional[float] = None) -> bool:
        with _otel.Op("release", scope, key, token) as op:
            released = self.execute(RELEASE_SQL, {"key": key, "scope": scope, "token": token},
                                    patience=self._finishing_patience(lease_ends))[0]
            op.released(released)
            return released

    def checkpoint(self, key: str, point: str, scope: str = "", token: Optional[int] = None,
                   lease_ends: Optional[float] = None) -> None:
        with _otel.Op("checkpoint", scope, key, token):
            try:
                self.execute(CHECKPOINT_SQL, {"key": key, "point": point, "scope": scope, "token": token},
                             patience=self._finishing_patience(lease_ends))
            except Exception as e:
                fenced_or_raise(e)

    def forget(self, key: str, scope: str = "") -> bool:
        return self.execute(FORGET_SQL, {"key": key, "scope": scope})[0]

    def lookup(self, key: str, scope: str = "") -> Optional[Record]:
        row = self.execute(LOOKUP_SQL, {"key": key, "scope": scope})
        return None if row is None else Record(*row)

    def completed_by(self, key: str, scope: str, token: Optional[int]) -> Optional[Record]:
        """The key's record when it is completed under `token`: what a `complete` refused with
        IK002 finds when its own first try had committed before the connection broke (tokens
        only grow, so no other attempt completes under this one)."""
        rec = None if token is None else self.lookup(key, scope)
        return rec if rec is not None and rec.status == "completed" and rec.token == token else None

    def derive_key(self, parent: str, step: str, params: Any = None) -> str:
        """idempotency.derive_key: the key of one downstream side effect of an operation."""
        return self.execute(DERIVE_KEY_SQL, {"parent": parent, "step": step, "params": to_json(params)})[0]


class _Holder:
    """A thread's connection: closed when the thread ends (its thread-local data goes away), so
    that a thread that used a Store leaves no connection open (no ResourceWarning)."""

    __slots__ = ("conn",)

    def __init__(self, conn):
        self.conn = conn

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def __del__(self):
        self.close()


class Store(_Calls):
    """The SQL API on autocommit connections of its own: one per thread, opened on first use from
    `conninfo` (None or "": the libpq environment variables PGHOST, PGDATABASE, ...).

    A statement that fails because the connection was lost (a server restart, a terminated
    backend) is repeated on a new connection for up to `reconnect_timeout`: every call is safe to
    repeat. A repeated claim whose first try had committed finds its own claim in progress (it is
    taken over after the lease); a repeated complete whose first try had committed raises Fenced
    (IK002), and the decorator then claims again and gets the replay. `connect_timeout` (seconds,
    libpq's, at least 2) bounds each connection attempt.

    Behind a pooler in transaction mode (PgBouncer, RDS Proxy, Supavisor) each transaction may
    run on another server connection, so no statement is prepared on the server (psycopg would
    prepare one at its 6th execution, and the next transaction would not find it, or find
    another of the same name). `prepared_statements=True` lets psycopg prepare them as it does
    by default: only for a direct connection, session mode, or a pooler that keeps prepared
    statements per client (PgBouncer 1.21 and later with max_prepared_statements)."""

    def __init__(self, conninfo: Optional[str] = None, *, reconnect_timeout: dt.timedelta = dt.timedelta(seconds=30),
                 application_name: str = "pg_idempotency", connect: Optional[Callable[[], psycopg.Connection]] = None,
                 connect_timeout: float = 5.0, prepared_statements: bool = False):
        self.conninfo = conninfo or ""
        self.prepare = _prepare(prepared_statements)
        self.connect_timeout = connect_timeout
        self.reconnect_timeout = reconnect_timeout.total_seconds()
        self.application_name = application_name
        self._connect = connect
        self._local = threading.local()

    def connection(self) -> psycopg.Connection:
        holder = getattr(self._local, "conn", None)
        conn = holder.conn if holder is not None else None
        if conn is None or conn.closed or conn.broken:
            if self._connect is not None:
                conn = self._connect()
            else:
                conn = psycopg.connect(self.conninfo, autocommit=True, application_name=self.application_name,
                                       connect_timeout=_libpq_timeout(self.connect_timeout))
            self._local.conn = _Holder(conn)
        return conn

    def execute(self, sql: str, params: dict, patience: Optional[float] = None):
        """The first row; a lost connection is retried for `patience` seconds (default
        reconnect_timeout)."""
        return self._run(sql, params, all_rows=False, patience=patience)

    def execute_all(self, sql: str, params: dict) -> list:
        return self._run(sql, params, all_rows=True)

    def _run(self, sql: str, params: dict, all_rows: bool, patience: Optional[float] = None):
        deadline = time.monotonic() + (self.reconnect_timeout if patience is None else patience)
        pause = 0.05
        while True:
            try:
                cur = self.connection().execute(sql, params, prepare=self.prepare)
                return cur.fetchall() if all_rows else cur.fetchone()
            except psycopg.errors.SerializationFailure:
                time.sleep(0.01)
            except psycopg.Error as e:
                if not _is_transient(e) or time.monotonic() + pause > deadline:
                    raise
                log.warning("connection lost (%s); reconnecting", str(e).strip())
                _otel.retried()
                self.close()
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

    def close(self) -> None:
        holder = getattr(self._local, "conn", None)
        self._local.conn = None
        if holder is not None:
            holder.close()


class AsyncStore(_Calls):
    """Store for asyncio: one AsyncConnection per event loop, shared by its tasks (psycopg
    serialises their statements; each is short), or, with `pool` (a psycopg_pool
    AsyncConnectionPool, opened on first use if it is not open yet), a connection of the pool per
    statement, so that concurrent requests do not queue behind one connection. Same reconnect
    rule, and the same `prepared_statements` rule (none prepared on the server unless True), as
    Store."""

    def __init__(self, conninfo: Optional[str] = None, *, reconnect_timeout: dt.timedelta = dt.timedelta(seconds=30),
                 application_name: str = "pg_idempotency", connect_timeout: float = 5.0, pool: Any = None,
                 prepared_statements: bool = False):
        self.pool = pool
        self.prepare = _prepare(prepared_statements)
        self._pool_opened = False
        self.conninfo = conninfo or ""
        self.connect_timeout = connect_timeout
        self.reconnect_timeout = reconnect_timeout.total_seconds()
        self.application_name = application_name
        self._conns: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]" = weakref.WeakKeyDictionary()
        self._locks: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock]" = weakref.WeakKeyDictionary()

    async def connection(self) -> psycopg.AsyncConnection:
        loop = asyncio.get_running_loop()
        lock = self._locks.setdefault(loop, asyncio.Lock())
        async with lock:
            conn = self._conns.get(loop)
            if conn is None or conn.closed or conn.broken:
                conn = await psycopg.AsyncConnection.connect(
                    self.conninfo, autocommit=True, application_name=self.application_name,
                    connect_timeout=_libpq_timeout(self.connect_timeout))
                self._conns[loop] = conn
            return conn

    async def execute(self, sql: str, params: dict, patience: Optional[float] = None):
        return await self._run(sql, params, all_rows=False, patience=patience)

    async def execute_all(self, sql: str, params: dict) -> list:
        return await self._run(sql, params, all_rows=True)

    async def _run(self, sql: str, params: dict, all_rows: bool, patience: Optional[float] = None):
        deadline = time.monotonic() + (self.reconnect_timeout if patience is None else patience)
        pause = 0.05
        while True:
            try:
                if self.pool is not None:
                    return await self._run_pooled(sql, params, all_rows)
                conn = await self.connection()
                cur = await conn.execute(sql, params, prepare=self.prepare)
                return await (cur.fetchall() if all_rows else cur.fetchone())
            except psycopg.errors.SerializationFailure:
                await asyncio.sleep(0.01)
            except psycopg.Error as e:
                if not _is_transient(e) or time.monotonic() + pause > deadline:
                    raise
                log.warning("connection lost (%s); reconnecting", str(e).strip())
                _otel.retried()
                await self.close()
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)

    async def _run_pooled(self, sql: str, params: dict, all_rows: bool):
        if not self._pool_opened:
            if getattr(self.pool, "closed", False):
                await self.pool.open(wait=False)
            self._pool_opened = True
        async with self.pool.connection(timeout=self.connect_timeout) as conn:
            if not conn.autocommit:
                # Each statement of the leased style commits on its own: a pool's connection
                # would otherwise roll the claim back when it is returned.
                await conn.set_autocommit(True)
            cur = await conn.execute(sql, params, prepare=self.prepare)
            return await (cur.fetchall() if all_rows else cur.fetchone())

    async def close(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        conn = self._conns.pop(loop, None)
        if conn is not None:
            try:
                await conn.close()
            except Exception:
                pass

    # The same calls, awaited.
    async def claim(self, key, request=None, scope="", ttl=None, lease=None) -> ClaimResult:
        with _otel.Op("claim", scope, key) as op:
            try:
                row = await self.execute(CLAIM_SQL, claim_params(key, request, scope, ttl, lease))
            except psycopg.Error as e:
                invalid_key_or_raise(e)
            result = ClaimResult.from_row(key, scope, row)
            op.claimed(result)
            return result

    async def complete(self, key, response, status=200, scope="", token=None, ttl=None, response_is_json=False,
                       lease_ends=None):
        params = {"key": key, "response": response if response_is_json else to_json(response),
                  "status": status, "scope": scope, "token": token, "ttl": ttl}
        with _otel.Op("complete", scope, key, token):
            try:
                return (await self.execute(COMPLETE_SQL, params, patience=self._finishing_patience(lease_ends)))[0]
            except Exception as e:
                fenced_or_raise(e)

    async def claim_many(self, keys, requests=None, scope="", ttl=None, lease=None) -> List[ClaimResult]:
        params = claim_many_params(keys, requests, scope, ttl, lease)
        rows = await self.execute_all(CLAIM_MANY_SQL, params)
        return [ClaimResult.from_row(k, scope, r) for k, r in zip(params["keys"], rows)]

    async def complete_many(self, keys, responses, statuses=None, scope="", tokens=None, ttl=None,
                            responses_are_json=False) -> List[dt.datetime]:
        params = complete_many_params(keys, responses, statuses, scope, tokens, ttl, responses_are_json)
        try:
            return [r[0] for r in await self.execute_all(COMPLETE_MANY_SQL, params)]
        except Exception as e:
            fenced_or_raise(e)

    async def release(self, key, scope="", token=None, lease_ends=None) -> bool:
        with _otel.Op("release", scope, key, token) as op:
            released = (await self.execute(RELEASE_SQL, {"key": key, "scope": scope, "token": token},
                                           patience=self._finishing_patience(lease_ends)))[0]
            op.released(released)
            return released

    async def checkpoint(self, key, point, scope="", token=None, lease_ends=None) -> None:
        with _otel.Op("checkpoint", scope, key, token):
            try:
                await self.execute(CHECKPOINT_SQL, {"key": key, "point": point, "scope": scope, "token": token},
                                   patience=self._finishing_patience(lease_ends))
            except Exception as e:
                fenced_or_raise(e)

    async def forget(self, key, scope="") -> bool:
        return (await self.execute(FORGET_SQL, {"key": key, "scope": scope}))[0]

    async def lookup(self, key, scope=""):
        row = await self.execute(LOOKUP_SQL, {"key": key, "scope": scope})
        return None if row is None else Record(*row)

    async def completed_by(self, key, scope, token) -> Optional[Record]:
        rec = None if token is None else await self.lookup(key, scope)
        return rec if rec is not None and rec.status == "completed" and rec.token == token else None

    async def derive_key(self, parent, step, params=None) -> str:
        return (await self.execute(DERIVE_KEY_SQL, {"parent": parent, "step": step, "params": to_json(params)}))[0]
