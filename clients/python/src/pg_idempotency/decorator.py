"""`@idempotent`: the leased style around a function with an external side effect.

claim (committed at once) -> run the function -> complete with its result (or release when it
raises). A retry with the same key gets the stored result back without running the function."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import datetime as dt
import decimal
import enum
import functools
import inspect
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar, Union

from ._core import (ALREADY_COMPLETED, IN_PROGRESS, MISMATCH, NEW, REPLAY, AsyncStore, ClaimResult, Fenced,
                    IdempotencyError, InProgress, Mismatch, Store)

T = TypeVar("T")

# The stored form of a result that could not be serialized (status 500): a replay raises
# Unstorable instead of running the function again.
_UNSTORABLE = "pg_idempotency_unstorable"


class Unstorable(IdempotencyError, TypeError):
    """The function ran, but its result could not be serialized to JSON. The key is completed
    with this error, so that the side effect never runs again for it: the first call and every
    replay raise Unstorable. Pass `serialize=` (and `deserialize=`) for such results."""

    def __init__(self, key: str, scope: str, detail: str):
        super().__init__(f"key {key!r} (scope {scope!r}): the result could not be stored ({detail}); "
                         "the function ran once and will not run again for this key")
        self.key, self.scope, self.detail = key, scope, detail


@dataclass(frozen=True)
class CallResult(Generic[T]):
    """What `f.detailed(...)` returns: `value` is the function's own result when it ran in this
    call (`replayed` False), the stored result (through `deserialize`) on a replay."""

    value: T
    replayed: bool
    outcome: str  # "new" or "replay"
    token: Optional[int]
    expires_at: Optional[dt.datetime]


def to_jsonable(value: Any) -> Any:
    """The default serializer's fallback for what json cannot write itself: dataclasses (as
    dicts), datetime/date/time (ISO 8601), Decimal (a string, exact), UUID (a string), Enum (its
    value), set/frozenset (a list), objects with `model_dump()` (pydantic) or `_asdict()`
    (namedtuple)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return list(value)
    for method in ("model_dump", "_asdict"):
        if callable(getattr(value, method, None)):
            return getattr(value, method)()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def default_serialize(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=to_jsonable, allow_nan=False)

_ARGUMENTS = object()
_current: contextvars.ContextVar = contextvars.ContextVar("pg_idempotency_attempt", default=None)


class Attempt:
    """The running attempt of an @idempotent function, from `current_attempt()` inside it.

    `recovery_point` is what an earlier attempt recorded with `checkpoint()` before it died (set
    on a takeover after its lease ran out); `token` the fencing token of this attempt."""

    def __init__(self, store, claim: ClaimResult):
        self._store, self.key, self.scope = store, claim.key, claim.scope
        self.token, self.recovery_point = claim.token, claim.recovery_point
        self._lease_ends = claim.lease_ends

    def checkpoint(self, point: str) -> None:
        """Records progress (idempotency.checkpoint with this attempt's token). Raises Fenced if
        another attempt took the key over. From a coroutine use `await acheckpoint(point)`."""
        self._store.checkpoint(self.key, point, self.scope, self.token, lease_ends=self._lease_ends)
        self.recovery_point = point

    async def acheckpoint(self, point: str) -> None:
        await self._store.checkpoint(self.key, point, self.scope, self.token, lease_ends=self._lease_ends)
        self.recovery_point = point


def current_attempt() -> Optional[Attempt]:
    """The Attempt of the @idempotent function running in this context, or None."""
    return _current.get()


def idempotent(key: Union[str, Callable[..., str]], *, scope: str = "", ttl: Optional[dt.timedelta] = None,
               lease: Optional[dt.timedelta] = None, conninfo: Optional[str] = None, store=None,
               request: Any = _ARGUMENTS, wait: dt.timedelta = dt.timedelta(seconds=30),
               release_on_error: bool = True, serialize: Callable[[Any], str] = default_serialize,
               deserialize: Optional[Callable[[Any], Any]] = None):
    """Makes a function run at most once per key (within the key's TTL), however often it is called.

    key      a string (`"receipt:{order_id}"` is formatted with the call's arguments by name) or a
             callable taking the function's arguments and returning the key (1-255 characters).
    scope    the key's namespace (`idempotency.claim`'s scope).
    ttl      how long the result is kept and replayed (None: the server's idempotency.default_ttl).
    lease    how long an attempt owns the key; after it another call takes over (None: the
             server's default_lease, at most the ttl). Make it longer than the function runs.
    conninfo libpq connection string; None: the PG* environment variables. Or pass `store`
             (a Store, or an AsyncStore for a coroutine function) to share connections.
    request  what the key must always come with: by default the call's arguments (bound to the
             signature, defaults applied), which must then be JSON-serialisable; a callable of
             the arguments; or None for no check. A different request with the same key raises
             Mismatch.
    wait     how long a call waits for another attempt that holds the key (polling) before it
             raises InProgress with the server's retry_after.
    release_on_error  on an exception from the function, release the key so the next call runs
             it again (default). False keeps the claim until its lease ends, so a retry takes it
             over and sees the recovery point of `current_attempt().checkpoint()`.

    serialize   the result's JSON text (default: json with `to_jsonable` for dataclasses, dates,
             Decimal, UUID, Enum, sets, pydantic models). A result it cannot serialize completes
             the key with that error: the function never runs again for the key, the call and
             every replay raise Unstorable.
    deserialize applied to the stored JSON (decoded) on a replay, e.g. `lambda d: Receipt(**d)`;
             default: the decoded JSON as it is (tuples come back as lists, dict keys as strings,
             dates as strings).

    The first call returns the function's own return value, a replay the stored result (through
    `deserialize`). `f.detailed(...)` returns a CallResult that says which (`replayed`). A key
    the extension refuses (empty, over 255 characters) raises InvalidKey before anything runs."""

    def decorate(fn):
        sig = inspect.signature(fn)

        def key_of(args, kwargs):
            if callable(key):
                return key(*args, **kwargs)
            if "{" in key:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                return key.format(**bound.arguments)
            return key

        def request_of(args, kwargs):
            if request is None:
                return None
            if request is _ARGUMENTS:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                doc = dict(bound.arguments)
            else:
                doc = request(*args, **kwargs)
            try:
                json.dumps(doc)
            except (TypeError, ValueError) as e:
                raise TypeError(f"@idempotent({fn.__qualname__}): the request is not JSON-serialisable ({e}); "
                                "pass request=<callable of the arguments> or request=None") from e
            return doc

        def result_json(k, result):
            try:
                text = serialize(result)
                json.loads(text)  # the stored text must be JSON
                return text, None
            except (TypeError, ValueError) as e:
                return None, f"{type(e).__name__}: {e}"

        def replayed(c: ClaimResult) -> CallResult:
            doc = c.response
            if c.response_status == 500 and isinstance(doc, dict) and _UNSTORABLE in doc:
                raise Unstorable(c.key, c.scope, str(doc[_UNSTORABLE]))
            value = deserialize(doc) if deserialize is not None else doc
            return CallResult(value, True, REPLAY, c.token, c.expires_at)

        if inspect.iscoroutinefunction(fn):
            astore = store

            async def adetailed(*args, **kwargs) -> CallResult:
                nonlocal astore
                if astore is None:
                    astore = AsyncStore(conninfo)
                k, req = key_of(args, kwargs), request_of(args, kwargs)
                deadline = time.monotonic() + wait.total_seconds()
                pause = 0.05
                while True:
                    c = await astore.claim(k, req, scope, ttl, lease)
                    if c.outcome == REPLAY:
                        return replayed(c)
                    if c.outcome == MISMATCH:
                        raise Mismatch(k, scope)
                    if c.outcome == IN_PROGRESS:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise InProgress(k, scope, c.retry_after)
                        await asyncio.sleep(min(pause, left, c.retry_after.total_seconds()))
                        pause = min(pause * 2, 1.0)
                        continue
                    attempt = Attempt(astore, c)
                    tok = _current.set(attempt)
                    try:
                        result = await fn(*args, **kwargs)
                    except Exception:
                        if release_on_error:
                            await astore.release(k, scope, c.token, lease_ends=c.lease_ends)
                        raise
                    finally:
                        _current.reset(tok)
                    text, error = result_json(k, result)
                    try:
                        if error is not None:
                            await astore.complete(k, json.dumps({_UNSTORABLE: error}), 500, scope, c.token, ttl,
                                                  response_is_json=True, lease_ends=c.lease_ends)
                        else:
                            expires = await astore.complete(k, text, 200, scope, c.token, ttl, response_is_json=True,
                                                            lease_ends=c.lease_ends)
                    except Fenced as e:
                        own = e.sqlstate == ALREADY_COMPLETED and await astore.completed_by(k, scope, c.token)
                        if not own:
                            deadline = time.monotonic() + wait.total_seconds()  # claim again: the final answer
                            continue
                        expires = own.expires_at
                    if error is not None:
                        raise Unstorable(k, scope, error)
                    return CallResult(result, False, NEW, c.token, expires)

            @functools.wraps(fn)
            async def awrapper(*args, **kwargs):
                return (await adetailed(*args, **kwargs)).value

            awrapper.detailed = adetailed
            return awrapper

        sstore = store

        def detailed(*args, **kwargs) -> CallResult:
            nonlocal sstore
            if sstore is None:
                sstore = Store(conninfo)
            k, req = key_of(args, kwargs), request_of(args, kwargs)
            deadline = time.monotonic() + wait.total_seconds()
            pause = 0.05
            while True:
                c = sstore.claim(k, req, scope, ttl, lease)
                if c.outcome == REPLAY:
                    return replayed(c)
                if c.outcome == MISMATCH:
                    raise Mismatch(k, scope)
                if c.outcome == IN_PROGRESS:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise InProgress(k, scope, c.retry_after)
                    time.sleep(min(pause, left, c.retry_after.total_seconds()))
                    pause = min(pause * 2, 1.0)
                    continue
                assert c.outcome == NEW
                attempt = Attempt(sstore, c)
                tok = _current.set(attempt)
                try:
                    result = fn(*args, **kwargs)
                except Exception:
                    if release_on_error:
                        sstore.release(k, scope, c.token, lease_ends=c.lease_ends)
                    raise
                finally:
                    _current.reset(tok)
                text, error = result_json(k, result)
                try:
                    if error is not None:
                        # Stored as an error: the side effect ran and must not run again.
                        sstore.complete(k, json.dumps({_UNSTORABLE: error}), 500, scope, c.token, ttl,
                                        response_is_json=True, lease_ends=c.lease_ends)
                    else:
                        expires = sstore.complete(k, text, 200, scope, c.token, ttl, response_is_json=True,
                                                  lease_ends=c.lease_ends)
                except Fenced as e:
                    # Our own complete whose answer was lost to a broken connection, repeated: the
                    # key is completed under our token, and this call's result is the answer.
                    own = e.sqlstate == ALREADY_COMPLETED and sstore.completed_by(k, scope, c.token)
                    if not own:
                        # Taken over after our lease ran out: claim again for the stored answer.
                        deadline = time.monotonic() + wait.total_seconds()
                        continue
                    expires = own.expires_at
                if error is not None:
                    raise Unstorable(k, scope, error)
                return CallResult(result, False, NEW, c.token, expires)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return detailed(*args, **kwargs).value

        wrapper.detailed = detailed
        return wrapper

    return decorate
