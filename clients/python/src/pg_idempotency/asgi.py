"""ASGI middleware (Starlette, FastAPI, any ASGI app) for the Idempotency-Key header.

    app.add_middleware(IdempotencyMiddleware, conninfo="dbname=shop", client=header_client("x-client-id"))

Leased style: the claim commits before the handler runs, the handler's response is stored with
`complete` after it, so the handler's own database work is not part of the claim's transaction.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from typing import Callable, Iterable, Optional

from . import _otel
from ._core import ALREADY_COMPLETED, IN_PROGRESS, MISMATCH, NEW, AsyncStore, ClaimResult, Fenced, is_unreachable
from .http import (REPLAY_HEADERS, CLAIM_HTTP_SQL, EXPIRES_SQL, HEADER, KeyError400, Policy, Request, Response, claim_error,
                   claim_params, encode_response, finish, outcome_response, parse_key, problem, scope_of,
                   should_store, unavailable)


log = logging.getLogger("pg_idempotency")
_UNREACHABLE = object()


def _replaying(body: bytes, receive):
    """An ASGI receive that gives the body read already, then the client's messages."""
    sent = False

    async def replay_receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_receive


async def _bounded(aw, seconds: float):
    """`aw`, at most `seconds` plus a second for the statement once connected."""
    return await asyncio.wait_for(aw, seconds + 1.0)


def header_client(name: str) -> Callable:
    """A `client` function that reads the client's id from a request header (set by your
    authentication proxy): works for ASGI scopes and Django requests."""
    lname = name.lower()

    def client(request) -> str:
        if isinstance(request, dict):  # an ASGI scope
            for k, v in request.get("headers", []):
                if k.decode("latin-1").lower() == lname:
                    return v.decode("latin-1")
            return ""
        return request.headers.get(name, "")

    return client


def default_client(scope) -> str:
    """The authenticated user of Starlette's AuthenticationMiddleware (scope["user"]), else ""."""
    user = scope.get("user")
    if user is not None and getattr(user, "is_authenticated", False):
        return str(getattr(user, "identity", None) or getattr(user, "display_name", ""))
    return ""


async def _send_response(send, resp: Response):
    await send({"type": "http.response.start", "status": resp.status,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers]})
    await send({"type": "http.response.body", "body": resp.body})


class IdempotencyMiddleware:
    """Requests with a method in `methods` (POST and PATCH by default) need an Idempotency-Key
    (`required=False`: requests without one pass through untouched). See pg_idempotency.http for
    the rules; `client(scope)` names the caller (default: the authenticated user, else "")."""

    def __init__(self, app, conninfo: Optional[str] = None, *, store: Optional[AsyncStore] = None,
                 client: Callable = default_client, ttl: Optional[dt.timedelta] = None,
                 lease: Optional[dt.timedelta] = None, wait: dt.timedelta = dt.timedelta(0),
                 methods: Iterable[str] = ("POST", "PATCH"), required: bool = True,
                 store_server_errors: bool = False, problem_base: Optional[str] = None,
                 replay_headers: Iterable[str] = REPLAY_HEADERS, connect_timeout: float = 5.0,
                 fail_open: bool = False, lenient_keys: bool = False, pool=None, prepared_statements: bool = False):
        self.app = app
        # pool: a psycopg_pool.AsyncConnectionPool; without it one connection per event loop.
        # prepared_statements: see Store (False works behind a pooler in transaction mode).
        self.store = store or AsyncStore(conninfo, application_name="pg_idempotency_asgi",
                                         connect_timeout=connect_timeout, pool=pool,
                                         prepared_statements=prepared_statements)
        self.client = client
        self.policy = Policy(ttl=ttl, lease=lease, wait=wait, methods=frozenset(m.upper() for m in methods),
                             required=required, store_server_errors=store_server_errors,
                             replay_headers=frozenset(h.lower() for h in replay_headers),
                             connect_timeout=connect_timeout, fail_open=fail_open, lenient_keys=lenient_keys)
        if problem_base is not None:
            self.policy.problem_base = problem_base

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"].upper() not in self.policy.methods:
            return await self.app(scope, receive, send)
        headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", [])]
        values = [v for k, v in headers if k == HEADER]
        if not values and not self.policy.required:
            return await self.app(scope, receive, send)
        echo = values[0] if len(values) == 1 else None
        try:
            key = parse_key(values, self.policy.lenient_keys)
        except KeyError400 as e:
            title = "Idempotency-Key is missing" if not values else "Idempotency-Key is malformed"
            return await _send_response(send, finish(problem(self.policy, 400, "bad-key", title, str(e)), echo))

        body, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
        req = Request(scope["method"].upper(), scope["path"],
                      scope.get("query_string", b"").decode("latin-1"), headers, b"".join(body),
                      self.client(scope) or "")
        params = claim_params(req, key, self.policy)
        if isinstance(params, Response):
            return await _send_response(send, finish(params, echo))
        c = await self._claim(req, key, params)
        if c is _UNREACHABLE:
            if self.policy.fail_open:
                # Fail open (opted in): the handler runs without the store, unprotected.
                log.warning("pg_idempotency: the database is unreachable; running the handler without the store")
                return await self.app(scope, _replaying(req.body, receive), send)
            return await _send_response(send, finish(unavailable(self.policy), echo))
        if isinstance(c, Response):
            return await _send_response(send, finish(c, echo))
        if c.outcome != NEW:
            return await _send_response(send, await self._answer(c, echo))

        resp = await self._run(scope, req.body, receive, c)
        if not should_store(self.policy, resp):
            await self.store.release(key, c.scope, c.token, lease_ends=c.lease_ends)
            return await _send_response(send, finish(resp, echo))
        text, status = encode_response(resp, self.policy)
        try:
            expires = await self.store.complete(key, text, status, c.scope, c.token, self.policy.ttl,
                                                response_is_json=True, lease_ends=c.lease_ends)
        except Fenced as e:
            own = e.sqlstate == ALREADY_COMPLETED and await self.store.completed_by(key, c.scope, c.token)
            if own:
                # Our own complete had committed before the connection broke: the live answer.
                expires = own.expires_at
            else:
                # Our lease ran out and another request took the key over: answer with what the
                # store holds.
                c2 = await self._claim(req, key, params)
                if isinstance(c2, ClaimResult) and c2.outcome != NEW:
                    return await _send_response(send, await self._answer(c2, echo))
                expires = None
        await _send_response(send, finish(resp, echo, expires))

    async def _claim(self, req, key, params):
        with _otel.Op("claim", params["scope"], key) as op:
            started = time.monotonic()
            deadline = started + self.policy.wait.total_seconds()
            pause = 0.05
            while True:
                try:
                    row = await _bounded(
                        self.store.execute(CLAIM_HTTP_SQL, params, patience=self.policy.connect_timeout),
                        self.policy.connect_timeout)
                except Exception as e:
                    op.failed(e)
                    r = claim_error(self.policy, e)
                    if r is not None:
                        return r
                    if is_unreachable(e):
                        return _UNREACHABLE
                    log.error("pg_idempotency: the claim failed: %s", e)
                    return unavailable(self.policy)
                c = ClaimResult.from_row(key, params["scope"], row)
                left = deadline - time.monotonic()
                if c.outcome != IN_PROGRESS or left <= 0:
                    op.claimed(c)
                    if pause > 0.05:  # it waited for an in-progress key
                        op.waited(time.monotonic() - started)
                    return c
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, 0.5)

    async def _answer(self, c: ClaimResult, echo):
        expires = None
        if c.outcome == MISMATCH:
            row = await self.store.execute(EXPIRES_SQL, {"key": c.key, "scope": c.scope})
            expires = row[0] if row else None
        return outcome_response(self.policy, c, echo, expires)

    async def _run(self, scope, body: bytes, receive, c: ClaimResult) -> Response:
        replay_receive = _replaying(body, receive)
        status, headers, chunks = 500, [], []

        async def capture(message):
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await self.app(scope, replay_receive, capture)
        except Exception:
            await self.store.release(c.key, c.scope, c.token, lease_ends=c.lease_ends)
            raise
        return Response(status, headers, b"".join(chunks))


__all__ = ["IdempotencyMiddleware", "header_client", "default_client", "scope_of"]
