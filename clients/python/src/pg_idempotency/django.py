"""Django middleware for the Idempotency-Key header (same rules as the ASGI one).

    MIDDLEWARE = [..., "pg_idempotency.django.IdempotencyMiddleware"]
    IDEMPOTENCY = {"CLIENT": "myapp.auth.client_id", "TTL": timedelta(hours=24)}

Settings (`settings.IDEMPOTENCY`, all optional): DATABASE (the alias whose database has the
extension, default "default"; its connection is used in Django's autocommit mode) or CONNINFO
(a libpq string: a connection of the middleware's own instead), CLIENT (callable or dotted path
taking the request; default: the authenticated user's pk, else ""), TTL, LEASE, WAIT
(timedeltas), METHODS (("POST", "PATCH")), REQUIRED (True), STORE_SERVER_ERRORS (False),
PROBLEM_BASE, CONNECT_TIMEOUT (seconds, default 5: how long the claim tries to reach the
database before it answers 503 with Retry-After), FAIL_OPEN (False: True runs the view without
the store when the database is unreachable, see the README for the risk), REPLAY_HEADERS (the headers a replay carries besides Content-Type; default Location,
Content-Location, ETag, Last-Modified, Link). With ATOMIC_REQUESTS the view's transaction is not the claim's: the claim commits
before the view runs and the response is stored after the view's transaction committed.
PREPARED_STATEMENTS (False): the middleware's statements are not prepared on the server, so it
works behind a pooler in transaction mode; True only for a direct connection, session mode or a
pooler that keeps prepared statements per client.
"""

from __future__ import annotations

import datetime as dt
import logging
import time

import psycopg

from django.conf import settings
from django.db import connections
from django.db.utils import InterfaceError, OperationalError
from django.http import HttpResponse
from django.utils.module_loading import import_string

from . import _otel
from ._core import (ALREADY_COMPLETED, IN_PROGRESS, MISMATCH, NEW, ClaimResult, Fenced, Store, _Calls,
                    _libpq_timeout, is_unreachable)
from .http import (REPLAY_HEADERS, CLAIM_HTTP_SQL, EXPIRES_SQL, KeyError400, Policy, Request, Response, claim_error, claim_params,
                   encode_response, finish, outcome_response, parse_key, problem, should_store,
                   unavailable)


log = logging.getLogger("pg_idempotency")
_UNREACHABLE = object()


def default_client(request) -> str:
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_authenticated", False):
        return str(user.pk)
    return ""


class _DjangoStore(_Calls):
    """The SQL API over a Django database connection (psycopg 2 or 3 backend). A statement that
    fails on a lost connection is repeated on a new one, outside atomic blocks."""

    def __init__(self, alias: str, reconnect_timeout: float = 30.0, prepared_statements: bool = False):
        self.alias, self.reconnect_timeout = alias, reconnect_timeout
        self.prepared_statements = prepared_statements

    def execute(self, sql, params, patience=None):
        deadline = time.monotonic() + (self.reconnect_timeout if patience is None else patience)
        pause = 0.05
        while True:
            conn = connections[self.alias]
            try:
                with conn.cursor() as cur:
                    inner = getattr(cur, "cursor", None)
                    if not self.prepared_statements and isinstance(inner, psycopg.Cursor):
                        # Not prepared on the server (see Store): through Django's error wrapper,
                        # so errors are Django's as with cur.execute.
                        with conn.wrap_database_errors:
                            inner.execute(sql, params, prepare=False)
                    else:
                        cur.execute(sql, params)  # psycopg 2 never prepares on the server
                    return cur.fetchone()
            except (OperationalError, InterfaceError):
                if conn.in_atomic_block or time.monotonic() + pause > deadline:
                    raise
                conn.close()
                time.sleep(pause)
                pause = min(pause * 2, 1.0)


def _to_django(resp: Response) -> HttpResponse:
    r = HttpResponse(resp.body, status=resp.status)
    if "Content-Type" in r:
        del r["Content-Type"]
    for k, v in resp.headers:
        r[k] = v
    return r


class IdempotencyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response
        conf = getattr(settings, "IDEMPOTENCY", {})
        connect_timeout = float(conf.get("CONNECT_TIMEOUT", 5))
        prepared = bool(conf.get("PREPARED_STATEMENTS", False))
        if conf.get("CONNINFO") is not None:
            self.store = Store(conf["CONNINFO"], application_name="pg_idempotency_django",
                               connect_timeout=connect_timeout, prepared_statements=prepared)
        else:
            alias = conf.get("DATABASE", "default")
            self.store = _DjangoStore(alias, prepared_statements=prepared)
            # A connection attempt to a database that does not answer is bounded (libpq's
            # connect_timeout), unless the database's OPTIONS set one already.
            options = connections[alias].settings_dict.setdefault("OPTIONS", {})
            options.setdefault("connect_timeout", _libpq_timeout(connect_timeout))
        client = conf.get("CLIENT", default_client)
        self.client = import_string(client) if isinstance(client, str) else client
        self.policy = Policy(ttl=conf.get("TTL"), lease=conf.get("LEASE"), wait=conf.get("WAIT", dt.timedelta(0)),
                             methods=frozenset(m.upper() for m in conf.get("METHODS", ("POST", "PATCH"))),
                             required=conf.get("REQUIRED", True),
                             store_server_errors=conf.get("STORE_SERVER_ERRORS", False),
                             replay_headers=frozenset(h.lower() for h in conf.get("REPLAY_HEADERS", REPLAY_HEADERS)),
                             connect_timeout=connect_timeout, fail_open=bool(conf.get("FAIL_OPEN", False)),
                             lenient_keys=bool(conf.get("LENIENT_KEYS", False)))
        if conf.get("PROBLEM_BASE"):
            self.policy.problem_base = conf["PROBLEM_BASE"]

    def __call__(self, request):
        method = request.method.upper()
        if method not in self.policy.methods:
            return self.get_response(request)
        raw = request.headers.get("Idempotency-Key")
        if raw is None and not self.policy.required:
            return self.get_response(request)
        values = [] if raw is None else [raw]
        try:
            key = parse_key(values, self.policy.lenient_keys)
        except KeyError400 as e:
            title = "Idempotency-Key is missing" if raw is None else "Idempotency-Key is malformed"
            return _to_django(finish(problem(self.policy, 400, "bad-key", title, str(e)), raw))
        headers = [(k.lower(), v) for k, v in request.headers.items()]
        req = Request(method, request.path, request.META.get("QUERY_STRING", ""), headers, request.body,
                      self.client(request) or "")
        params = claim_params(req, key, self.policy)
        if isinstance(params, Response):
            return _to_django(finish(params, raw))
        c = self._claim(key, params)
        if c is _UNREACHABLE:
            if self.policy.fail_open:
                # Fail open (opted in): the view runs without the store, unprotected.
                log.warning("pg_idempotency: the database is unreachable; running the view without the store")
                return self.get_response(request)
            return _to_django(finish(unavailable(self.policy), raw))
        if isinstance(c, Response):
            return _to_django(finish(c, raw))
        if c.outcome != NEW:
            return _to_django(self._answer(c, raw))
        try:
            response = self.get_response(request)
        except Exception:
            self.store.release(key, c.scope, c.token, lease_ends=c.lease_ends)
            raise
        body = b"".join(response.streaming_content) if response.streaming else response.content
        resp = Response(response.status_code, [(k.lower(), v) for k, v in response.items()], body)
        if not should_store(self.policy, resp):
            self.store.release(key, c.scope, c.token, lease_ends=c.lease_ends)
            return self._with_headers(response, body, finish(resp, raw))
        text, status = encode_response(resp, self.policy)
        try:
            expires = self.store.complete(key, text, status, c.scope, c.token, self.policy.ttl, response_is_json=True,
                                          lease_ends=c.lease_ends)
        except Fenced as e:
            own = e.sqlstate == ALREADY_COMPLETED and self.store.completed_by(key, c.scope, c.token)
            if own:
                # Our own complete had committed before the connection broke: the live answer.
                expires = own.expires_at
            else:
                c2 = self._claim(key, params)
                if isinstance(c2, ClaimResult) and c2.outcome != NEW:
                    return _to_django(self._answer(c2, raw))
                expires = None
        return self._with_headers(response, body, finish(resp, raw, expires))

    @staticmethod
    def _with_headers(response, body, resp: Response):
        """The view's own response object (cookies kept) with the idempotency headers added."""
        if response.streaming:
            response.streaming_content = [body]
        for k, v in resp.headers:
            if k in ("idempotency-key", "idempotency-expires", "idempotent-replayed", "retry-after"):
                response[k] = v
            elif k == "cache-control" and k not in response:
                response[k] = v
        return response

    def _claim(self, key, params):
        with _otel.Op("claim", params["scope"], key) as op:
            started = time.monotonic()
            deadline = started + self.policy.wait.total_seconds()
            pause = 0.05
            while True:
                try:
                    row = self.store.execute(CLAIM_HTTP_SQL, params, patience=self.policy.connect_timeout)
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
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.5)

    def _answer(self, c: ClaimResult, echo):
        expires = None
        if c.outcome == MISMATCH:
            row = self.store.execute(EXPIRES_SQL, {"key": c.key, "scope": c.scope})
            expires = row[0] if row else None
        return outcome_response(self.policy, c, echo, expires)
