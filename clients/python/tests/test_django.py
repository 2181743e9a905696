"""The Django middleware through Django's test client, on Django's own database connection to the
throwaway cluster (the postgresql backend over psycopg 3)."""

import datetime as dt
import email.utils
import json
import threading
import time

import pytest

django = pytest.importorskip("django")

from django.conf import settings  # noqa: E402
from django.http import JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402

CALLS = []


def wait_for(condition, timeout=20):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def orders(request):
    body = json.loads(request.body)
    CALLS.append(body)
    time.sleep(float(request.headers.get("X-Delay", "0")))
    if body.get("explode"):
        raise RuntimeError("view crashed")
    r = JsonResponse({"order_id": len(CALLS), **body}, status=body.get("status", 201))
    r["Location"], r["X-Request-Id"] = "/orders/1", "req-1"
    r.set_cookie("session", "first-caller")
    return r


def client_id(request):
    return request.headers.get("X-Client-Id", "")


urlpatterns = [path("orders", orders)]


@pytest.fixture(scope="module")
def django_app(cluster, endpoint):
    if not settings.configured:
        settings.configure(
            DEBUG=False, ALLOWED_HOSTS=["*"], ROOT_URLCONF=__name__, USE_TZ=True, SECRET_KEY="test",
            MIDDLEWARE=["pg_idempotency.django.IdempotencyMiddleware"],
            DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": endpoint["dbname"],
                                   "HOST": endpoint["host"], "PORT": endpoint["port"], "USER": "postgres"}},
            IDEMPOTENCY={"CLIENT": f"{__name__}.client_id", "TTL": dt.timedelta(hours=1),
                         "LEASE": dt.timedelta(seconds=30), "WAIT": dt.timedelta(seconds=10)},
        )
        django.setup()
    from django.test import Client
    return Client


@pytest.fixture(autouse=True)
def reset():
    CALLS.clear()
    yield
    from django.db import connections
    connections.close_all()


def post(Client, key, body, client="c1", **extra):
    headers = {"X-Client-Id": client, **extra}
    if key is not None:
        headers["Idempotency-Key"] = key
    return Client(raise_request_exception=False).post(
        "/orders", data=body if isinstance(body, str) else json.dumps(body), content_type="application/json",
        headers=headers)


def test_create_replay_mismatch(django_app, db):
    r1 = post(django_app, '"d-1"', {"item": "A", "amount": 59.90})
    assert r1.status_code == 201 and "Idempotent-Replayed" not in r1
    r2 = post(django_app, '"d-1"', '{"amount": 59.9, "item": "A"}')
    assert r2.status_code == 201 and r2.content == r1.content and r2["Idempotent-Replayed"] == "true"
    assert r2["Content-Type"] == "application/json"
    # Header leak: the first answer is the view's; a replay carries only the allow-list.
    assert r1["X-Request-Id"] == "req-1" and r1.cookies["session"].value == "first-caller"
    assert r2["Location"] == "/orders/1" and "X-Request-Id" not in r2 and "session" not in r2.cookies
    (expires,) = db.execute("SELECT expires_at FROM idempotency.lookup('d-1', 'c1:POST /orders')").fetchone()
    assert email.utils.parsedate_to_datetime(r2["Idempotency-Expires"]) == expires.replace(microsecond=0)
    r3 = post(django_app, '"d-1"', {"item": "B"})
    assert r3.status_code == 422 and r3["Content-Type"] == "application/problem+json"
    assert json.loads(r3.content)["title"] == "Idempotency-Key is already used"
    assert post(django_app, '"d-1"', {"item": "A", "amount": 59.90}, client="c2").status_code == 201
    assert len(CALLS) == 2


@pytest.mark.parametrize("value,detail", [(None, "requires an Idempotency-Key header"),
                                                 ("d-2", "a bare Token, not a String"), ('"x', "no closing quote")])
def test_malformed_keys_are_400(django_app, value, detail):
    r = post(django_app, value, {"item": "A"})
    assert r.status_code == 400 and detail in json.loads(r.content)["detail"]
    assert CALLS == []


def test_race_runs_once(django_app):
    results = [None] * 6
    barrier = threading.Barrier(6)

    def run(i):
        barrier.wait()
        results[i] = post(django_app, '"d-3"', {"item": "A"}, X_Delay="0.5")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(CALLS) == 1 and {r.status_code for r in results} == {201}
    assert len({r.content for r in results}) == 1

    from pg_idempotency.django import IdempotencyMiddleware
    mw = IdempotencyMiddleware(lambda request: None)
    assert mw.policy.wait == dt.timedelta(seconds=10)


def test_409_and_errors_release(django_app, db):
    t = threading.Thread(target=post, args=(django_app, '"d-4"', {"item": "A"}), kwargs={"X_Delay": "1.5"})
    t.start()
    wait_for(lambda: CALLS)
    settings.IDEMPOTENCY["WAIT"] = dt.timedelta(0)
    try:
        r = post(django_app, '"d-4"', {"item": "A"})
    finally:
        settings.IDEMPOTENCY["WAIT"] = dt.timedelta(seconds=10)
    t.join()
    assert r.status_code == 409 and 25 <= int(r["Retry-After"]) <= 30
    r = post(django_app, '"d-5"', {"explode": True})
    assert r.status_code == 500
    assert db.execute("SELECT count(*) FROM idempotency.lookup('d-5', 'c1:POST /orders') WHERE key IS NOT NULL"
                      ).fetchone()[0] == 0
    assert post(django_app, '"d-6"', {"status": 404}).status_code == 404
    assert post(django_app, '"d-6"', {"status": 404})["Idempotent-Replayed"] == "true"


def test_database_restart_mid_request(django_app, cluster):
    results = []
    t = threading.Thread(target=lambda: results.append(post(django_app, '"d-7"', {"item": "A"}, X_Delay="1")))
    t.start()
    wait_for(lambda: CALLS)
    cluster.stop("fast")
    cluster.restart()
    t.join()
    assert results[0].status_code == 201
    r = post(django_app, '"d-7"', {"item": "A"})
    assert r.status_code == 201 and r["Idempotent-Replayed"] == "true" and len(CALLS) == 1


@pytest.mark.parametrize("fail_open", [False, True])
def test_database_down_is_503_within_the_connect_timeout(django_app, blackhole, fail_open):
    """A database that does not answer: 503 problem+json with Retry-After within CONNECT_TIMEOUT
    (it was a generic 500 after 30 s), the view not run; FAIL_OPEN runs the view without the store."""
    from django.test import override_settings
    conf = {"CLIENT": f"{__name__}.client_id", "CONNINFO": blackhole, "CONNECT_TIMEOUT": 2, "FAIL_OPEN": fail_open}
    with override_settings(IDEMPOTENCY=conf):
        started = time.monotonic()
        r = post(django_app, '"down-1"', {"item": "A"})
        elapsed = time.monotonic() - started
    assert elapsed < 6, elapsed
    if fail_open:
        assert r.status_code == 201 and len(CALLS) == 1
    else:
        assert r.status_code == 503, r.content
        assert r["Content-Type"] == "application/problem+json" and r["Retry-After"] == "1"
        assert CALLS == []


def test_same_wording_as_asgi_for_a_bad_body_and_two_key_lines(django_app, db):
    """Django's invalid-JSON detail held the server's DETAIL/CONTEXT lines, and two key lines
    (combined into one by the server) were "text after the key": the ASGI wording now."""
    r = post(django_app, '"d-json"', '{"item": "\\ud800"}')
    assert r.status_code == 400, r.content
    detail = json.loads(r.content)["detail"]
    assert "\n" not in detail and "CONTEXT" not in detail and "DETAIL" not in detail, detail
    r = post(django_app, '"d-a", "d-b"', {"item": "A"})
    assert r.status_code == 400
    assert json.loads(r.content)["detail"] == "Idempotency-Key was sent more than once; send exactly one"
    assert CALLS == []
