"""The ASGI middleware on a Starlette app, through Starlette's TestClient (httpx)."""

import asyncio
import datetime as dt
import email.utils
import json
import threading
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pg_idempotency.asgi import IdempotencyMiddleware, header_client


def wait_for(condition, timeout=20):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def make_app(conninfo, calls, **kw):
    async def orders(request):
        body = await request.json()
        calls.append(body)
        await asyncio.sleep(float(request.headers.get("x-delay", "0")))
        if body.get("explode"):
            raise RuntimeError("handler crashed")
        if body.get("status"):
            return JSONResponse({"error": "bad"}, status_code=body["status"])
        return JSONResponse({"order_id": len(calls), **body}, status_code=201,
                            headers={"location": "/orders/1", "etag": '"v1"', "set-cookie": "session=first-caller",
                                     "x-request-id": "req-1"})

    async def anybody(request):
        body = await request.body()
        calls.append(body)
        return PlainTextResponse(f"got {len(body)} bytes", status_code=201)

    async def ping(request):
        calls.append("ping")
        return PlainTextResponse("pong")

    app = Starlette(routes=[Route("/orders", orders, methods=["POST"]), Route("/ping", ping, methods=["GET", "POST"]),
                                Route("/any", anybody, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, conninfo=conninfo, client=header_client("x-client-id"),
                       ttl=dt.timedelta(hours=1), lease=dt.timedelta(seconds=30), **kw)
    return app


@pytest.fixture
def calls():
    return []


@pytest.fixture
def client(conninfo, calls):
    with TestClient(make_app(conninfo, calls), raise_server_exceptions=False) as c:
        yield c


def post(client, key, body, client_id="c1", **headers):
    h = {"x-client-id": client_id, "content-type": "application/json", **headers}
    if key is not None:
        h["idempotency-key"] = key if key.isascii() else key.encode("utf-8")
    return client.post("/orders", content=body if isinstance(body, str) else json.dumps(body), headers=h)


def expires_of(db, key, scope):
    (t,) = db.execute("SELECT expires_at FROM idempotency.lookup(%s, %s)", (key, scope)).fetchone()
    return t.replace(microsecond=0)


def test_create_then_replay(client, calls, db):
    r1 = post(client, '"k-1"', '{"amount": 59.90, "item": "A1"}')
    assert r1.status_code == 201 and r1.headers["location"] == "/orders/1"
    assert "idempotent-replayed" not in r1.headers and r1.headers["idempotency-key"] == '"k-1"'
    r2 = post(client, '"k-1";p=1', '{ "item": "A1", "amount": 59.9 }')   # params ignored, same JSON
    assert r2.status_code == 201 and r2.content == r1.content
    assert r2.headers["idempotent-replayed"] == "true" and r2.headers["location"] == "/orders/1"
    assert r2.headers["content-type"] == r1.headers["content-type"]
    # Header leak: the first answer is the handler's; a replay carries only the allow-list.
    assert r1.headers["set-cookie"] == "session=first-caller" and r1.headers["x-request-id"] == "req-1"
    assert r2.headers["etag"] == '"v1"'
    assert "set-cookie" not in r2.headers and "x-request-id" not in r2.headers
    expires = expires_of(db, "k-1", "c1:POST /orders")
    assert email.utils.parsedate_to_datetime(r1.headers["idempotency-expires"]) == expires
    assert email.utils.parsedate_to_datetime(r2.headers["idempotency-expires"]) == expires
    assert len(calls) == 1
    assert post(client, '"k-1"', {"item": "A1"}, client_id="c2").status_code == 201   # per client
    assert len(calls) == 2


def test_mismatch_is_422(client, calls, db):
    post(client, '"k-2"', {"item": "A"})
    r = post(client, '"k-2"', {"item": "B"})
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
    assert r.json()["title"] == "Idempotency-Key is already used" and r.json()["status"] == 422
    expires = expires_of(db, "k-2", "c1:POST /orders")
    assert email.utils.parsedate_to_datetime(r.headers["idempotency-expires"]) == expires
    r = client.post("/orders?x=1", content='{"item": "A"}', headers={"idempotency-key": '"k-2"', "x-client-id": "c1",
                                                                     "content-type": "application/json"})
    assert r.status_code == 422                              # the query is part of the request
    assert len(calls) == 1


@pytest.mark.parametrize("value,detail", [
    (None, "requires an Idempotency-Key header"), ('""', "empty"), ("k-3", "a bare Token, not a String"),
    ("1", "an Integer or Decimal, not a String"), ("?1", "a Boolean, not a String"),
    ('"abc', "no closing quote"), ('"a\\x"', "bad escape"), ('"a" x', "after the closing quote"),
    ('"a";P=1', "malformed parameter"), ('"' + "k" * 256 + '"', "too long"), ('"a\u00e9"', "bad character"),
])
def test_malformed_keys_are_400(client, calls, value, detail):
    r = post(client, value, {"item": "A"})
    assert r.status_code == 400 and r.headers["content-type"] == "application/problem+json", r.text
    assert detail in r.json()["detail"], r.json()
    assert calls == []


def test_bad_body_claims_nothing(client, calls, db):
    r = post(client, '"k-4"', '{"item": ')
    assert r.status_code == 400 and calls == []
    r = post(client, '"k-4"', '{"item": "\\u0000"}')
    assert r.status_code in (400, 422) and calls == []
    assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 0


def test_in_progress_is_409_with_retry_after(conninfo, calls):
    with TestClient(make_app(conninfo, calls)) as client:
        t = threading.Thread(target=post, args=(client, '"k-5"', {"item": "A"}), kwargs={"x-delay": "1"})
        t.start()
        wait_for(lambda: calls)
        r = post(client, '"k-5"', {"item": "A"})
        assert r.status_code == 409 and 25 <= int(r.headers["retry-after"]) <= 30
        assert r.json()["title"] == "A request is outstanding for this Idempotency-Key"
        assert "idempotency-expires" in r.headers
        t.join()
        assert post(client, '"k-5"', {"item": "A"}).headers["idempotent-replayed"] == "true"
        assert len(calls) == 1


def test_a_storm_of_identical_requests_runs_once(conninfo, calls):
    app = make_app(conninfo, calls, wait=dt.timedelta(seconds=10))
    with TestClient(app) as client:
        results = [None] * 10
        barrier = threading.Barrier(10)

        def run(i):
            barrier.wait()
            results[i] = post(client, '"k-6"', {"item": "A"}, **{"x-delay": "0.5"})

        threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(calls) == 1
    assert {r.status_code for r in results} == {201} and len({r.content for r in results}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in results) == 9


def test_handler_errors_release_the_key(client, calls, db):
    r = post(client, '"k-7"', {"explode": True})
    assert r.status_code == 500
    assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 0
    r = post(client, '"k-8"', {"status": 503})               # a 5xx answer is not stored either
    assert r.status_code == 503 and "idempotency-expires" not in r.headers
    assert post(client, '"k-8"', {"status": 503}).status_code == 503 and len(calls) == 3
    assert post(client, '"k-9"', {"status": 402}).status_code == 402   # a 4xx answer is stored
    r = post(client, '"k-9"', {"status": 402})
    assert r.status_code == 402 and r.headers["idempotent-replayed"] == "true" and len(calls) == 4


def test_other_methods_pass_through_and_optional_keys(conninfo, calls):
    with TestClient(make_app(conninfo, calls)) as client:
        assert client.get("/ping").text == "pong"
    with TestClient(make_app(conninfo, calls, required=False)) as client:
        assert client.post("/ping").text == "pong"
        r = client.post("/ping", headers={"idempotency-key": '"p"'})
        assert client.post("/ping", headers={"idempotency-key": '"p"'}).headers["idempotent-replayed"] == "true"
    assert calls == ["ping", "ping", "ping"] and r.text == "pong"


def test_database_restart_between_requests_and_mid_request(cluster, conninfo, calls, db):
    app = make_app(conninfo, calls)
    with TestClient(app) as client:
        assert post(client, '"k-10"', {"item": "A"}).status_code == 201
        cluster.stop("fast")
        cluster.restart()
        r = post(client, '"k-10"', {"item": "A"})            # the middleware reconnects
        assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true"

        t = threading.Thread(target=lambda: results.append(post(client, '"k-11"', {"item": "B"}, **{"x-delay": "1"})))
        results = []
        t.start()
        wait_for(lambda: len(calls) >= 2)
        cluster.stop("fast")                                 # mid-request, after its claim
        cluster.restart()
        t.join()
        assert results[0].status_code == 201
        assert post(client, '"k-11"', {"item": "B"}).headers["idempotent-replayed"] == "true"
    assert len(calls) == 2


def test_fastapi(conninfo):
    fastapi = pytest.importorskip("fastapi")
    calls = []
    app = fastapi.FastAPI()

    @app.post("/payments", status_code=201)
    async def pay(payment: dict):
        calls.append(payment)
        return {"payment_id": len(calls), **payment}

    app.add_middleware(IdempotencyMiddleware, conninfo=conninfo, client=header_client("x-client-id"))
    with TestClient(app) as client:
        h = {"idempotency-key": '"pay-1"', "x-client-id": "c9"}
        r1 = client.post("/payments", json={"amount": 5}, headers=h)
        r2 = client.post("/payments", json={"amount": 5}, headers=h)
        r3 = client.post("/payments", json={"amount": 6}, headers=h)
        r4 = client.post("/payments", json={"amount": 5}, headers={"x-client-id": "c9"})
    assert (r1.status_code, r2.status_code, r3.status_code, r4.status_code) == (201, 201, 422, 400)
    assert r2.content == r1.content and r2.headers["idempotent-replayed"] == "true" and len(calls) == 1


@pytest.mark.parametrize("key,ctype,body", [("b-text", "text/plain", b"hello"),
                                            ("b-form", "application/x-www-form-urlencoded", b"a=1&b=2"),
                                            ("b-empty", None, b"")])
def test_any_body_fingerprint_is_the_reference_one(client, calls, db, key, ctype, body):
    """Any body is accepted; its fingerprint is the one the Node and Rust clients give the same
    request (a JSON type as jsonb, any other body by its SHA-256, an empty body as none)."""
    h = {"x-client-id": "c1", "idempotency-key": f'"{key}"', **({"content-type": ctype} if ctype else {})}
    assert client.post("/any", content=body, headers=h).status_code == 201
    assert client.post("/any", content=body, headers=h).headers["idempotent-replayed"] == "true"
    ref = "NULL::jsonb" if not body else "jsonb_build_object('sha256', encode(sha256(%(b)s::bytea), 'hex'))"
    db.execute("SELECT idempotency.claim(%(k)s, request => to_jsonb(encode(idempotency.request_fingerprint("
               f"'POST', '/any', '{{}}'::jsonb, {ref}), 'hex')), scope => 'reference')", {"k": key, "b": body})
    same = db.execute("SELECT a.request_hash = b.request_hash FROM idempotency.idempotency_keys a "
                      "JOIN idempotency.idempotency_keys b ON b.key = a.key AND b.scope = 'reference' "
                      "WHERE a.key = %s AND a.scope = 'c1:POST /any'", (key,)).fetchall()
    assert same == [(True,)]
    assert len(calls) == 1


@pytest.mark.parametrize("fail_open", [False, True])
def test_database_down_is_503_within_the_connect_timeout(blackhole, calls, fail_open):
    """A database that does not answer: 503 problem+json with Retry-After within the configured
    connect time (it was a generic 500 after 30 s), the handler not run; fail_open (opt-in) runs
    the handler without the store."""
    with TestClient(make_app(blackhole, calls, connect_timeout=2, fail_open=fail_open),
                    raise_server_exceptions=False) as client:
        started = time.monotonic()
        r = post(client, '"down-1"', {"item": "A"})
        elapsed = time.monotonic() - started
    assert elapsed < 6, elapsed
    if fail_open:
        assert r.status_code == 201 and len(calls) == 1
        assert "idempotency-expires" not in r.headers
    else:
        assert r.status_code == 503, r.text
        assert r.headers["content-type"] == "application/problem+json" and r.headers["retry-after"] == "1"
        assert r.json()["title"] == "Database unavailable"
        assert calls == []


def test_lenient_keys_accept_a_bare_key(conninfo, calls):
    """Stripe-style callers send the key unquoted; the draft refuses it (the default, with the
    same wording as Node and Rust); lenient_keys=True takes the bare token as the key, the same
    key as its quoted form."""
    with TestClient(make_app(conninfo, calls)) as strict:
        r = post(strict, "8e03978e-40d5-43e8-bc93-6894a57f9324", {"item": "A"})
        assert r.status_code == 400
        assert r.json()["detail"].startswith("Idempotency-Key is an Integer or Decimal, not a String: the key must "
                                             "be a structured-field String (RFC 9651) in double quotes")
    with TestClient(make_app(conninfo, calls, lenient_keys=True)) as lenient:
        r1 = post(lenient, "8e03978e-40d5-43e8-bc93-6894a57f9324", {"item": "A"})
        assert r1.status_code == 201 and r1.headers["idempotency-key"] == "8e03978e-40d5-43e8-bc93-6894a57f9324"
        r2 = post(lenient, '"8e03978e-40d5-43e8-bc93-6894a57f9324"', {"item": "A"})
        assert r2.headers["idempotent-replayed"] == "true"
        assert post(lenient, "a b", {"item": "A"}).status_code == 400
        assert post(lenient, "k" * 256, {"item": "A"}).status_code == 400
    assert len(calls) == 1


def test_a_pool_serves_concurrent_requests(conninfo, calls):
    """The middleware shared one connection per event loop: with `pool=` (a psycopg_pool
    AsyncConnectionPool) each statement takes a pooled connection; the claim still commits on
    its own (autocommit), so a replay finds it."""
    psycopg_pool = pytest.importorskip("psycopg_pool")
    pool = psycopg_pool.AsyncConnectionPool(conninfo, min_size=1, max_size=4, open=False)
    with TestClient(make_app(None, calls, pool=pool)) as client:
        r1 = post(client, '"pool-1"', {"item": "A"})
        r2 = post(client, '"pool-1"', {"item": "A"})
        assert r1.status_code == 201 and r2.headers["idempotent-replayed"] == "true"
        assert pool.get_stats()["requests_num"] >= 3
    assert len(calls) == 1


class _AsyncAnswerLost:
    """An AsyncConnection whose first `idempotency.complete` commits, then breaks before its answer."""

    def __init__(self, conn, lost):
        self._conn, self._lost = conn, lost

    async def execute(self, sql, params=None, **kw):
        cur = await self._conn.execute(sql, params, **kw)
        if "idempotency.complete(" in sql and not self._lost:
            self._lost.append(sql)
            await self._conn.close()
            import psycopg
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return cur


def test_a_completion_whose_answer_was_lost_sends_the_handlers_live_response(conninfo, calls, db):
    from pg_idempotency import AsyncStore

    lost = []

    class AnswerLostStore(AsyncStore):
        async def connection(self):
            return _AsyncAnswerLost(await super().connection(), lost)

    app = make_app(conninfo, calls, store=AnswerLostStore(conninfo))
    with TestClient(app, raise_server_exceptions=False) as c:
        first = post(c, '"lost-1"', {"a": 1})
        assert lost, "the first complete's answer was not lost"
        assert first.status_code == 201 and "idempotent-replayed" not in first.headers
        assert first.headers["set-cookie"] == "session=first-caller"          # the live response
        assert db.execute("SELECT status::text FROM idempotency.idempotency_keys WHERE key = 'lost-1'").fetchall() \
            == [("completed",)]
        again = post(c, '"lost-1"', {"a": 1})
        assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json() and len(calls) == 1
