"""The HTTP conformance suite: one scenario list, one expected answer per scenario, run against
the same small app (apps/) on each of the five adapters, over real HTTP, on a throwaway cluster.
README.md lists the scenarios; where adapters differ on purpose, the test says so.

Run by scripts/clients-conformance.sh (PG_BIN picks the server; the Python package, the Node
package's node_modules and the Rust example must be built). IDEMPOTENCY_TEST_POOLER=transaction
(or session) puts PgBouncer in that mode between the apps and the cluster (tests/integration/
pooler.py); the script runs the suite direct and through both."""

import collections
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))

from cluster import Cluster, free_port  # noqa: E402
import pooler  # noqa: E402

ADAPTERS = ["asgi", "django", "express", "fastify", "axum"]
RUST_APP = os.path.join(ROOT, "clients", "rust", "target", "debug", "examples", "conformance")


def command(adapter):
    return {
        "asgi": [sys.executable, os.path.join(HERE, "apps", "asgi_app.py")],
        "django": [sys.executable, os.path.join(HERE, "apps", "django_app.py")],
        "express": ["node", os.path.join(HERE, "apps", "node_app.js"), "express"],
        "fastify": ["node", os.path.join(HERE, "apps", "node_app.js"), "fastify"],
        "axum": [RUST_APP],
    }[adapter]


class App:
    def __init__(self, adapter, conninfo, **env):
        self.adapter, self.port = adapter, free_port()
        e = dict(os.environ, CONNINFO=conninfo, PORT=str(self.port), **{k: str(v) for k, v in env.items()})
        self.proc = subprocess.Popen(command(adapter), env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.request("GET", "/runs")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"{adapter} app exited: {self.proc.stderr.read().decode()[-2000:]}")
            assert time.monotonic() < deadline, f"{adapter} app did not start"
            time.sleep(0.1)

    def request(self, method, path, body=None, key=None, headers=(), timeout=30):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        c.putrequest(method, path, skip_accept_encoding=True)
        data = b""
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            if not isinstance(body, bytes):
                c.putheader("content-type", "application/json")
        for k in ([key] if isinstance(key, str) else key or []):
            c.putheader("idempotency-key", k)
        for k, v in headers:
            c.putheader(k, v)
        c.putheader("content-length", str(len(data)))
        c.endheaders(data)
        r = c.getresponse()
        out = (r.status, {k.lower(): v for k, v in r.getheaders()}, r.read(), r.headers)
        c.close()
        return out

    def runs(self):
        return json.loads(self.request("GET", "/runs")[2])["runs"]

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# Every app instance keeps its connections for the whole run: in session mode each holds a
# server connection of the pooler's, so the pool and the server make room for all of them.
SERVER_CONNECTIONS = 300


@pytest.fixture(scope="session")
def cluster():
    c = Cluster(settings={"max_connections": str(SERVER_CONNECTIONS)}).start()
    with psycopg.connect(c.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION idempotency")
        conn.execute("CREATE ROLE app LOGIN")
        conn.execute("GRANT USAGE ON SCHEMA idempotency TO app")
    yield c
    c.destroy()


@pytest.fixture(scope="session")
def pooler_route(cluster):
    """The PgBouncer that IDEMPOTENCY_TEST_POOLER names between the apps and the cluster, or None."""
    bouncer = pooler.target(cluster, users=("postgres", "app"), pool_size=SERVER_CONNECTIONS - 20,
                            max_client_conn=1000)
    yield bouncer
    if bouncer is not None:
        bouncer.stop()


@pytest.fixture(scope="session")
def blackhole():
    """Accepts TCP connections, never answers: a database that does not answer."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    yield f"host=127.0.0.1 port={s.getsockname()[1]} user=app dbname=shop"
    s.close()


APPS = {}


@pytest.fixture(scope="session", autouse=True)
def stop_apps():
    yield
    for a in APPS.values():
        a.stop()


ROUTE = {}


@pytest.fixture(scope="session", autouse=True)
def apps_route(pooler_route):
    ROUTE["bouncer"] = pooler_route


def app_for(adapter, kind, cluster, blackhole):
    if (adapter, kind) not in APPS:
        bouncer = ROUTE.get("bouncer")
        conninfo = bouncer.conninfo(user="app") if bouncer else cluster.conninfo().replace("user=postgres", "user=app")
        env = {"main": {}, "twin": {}, "wait": {"WAIT": 5}, "down": {"CONNECT_TIMEOUT": 1},
               "open": {"CONNECT_TIMEOUT": 1, "FAIL_OPEN": 1}}[kind]
        APPS[(adapter, kind)] = App(adapter, blackhole if kind in ("down", "open") else conninfo, **env)
    return APPS[(adapter, kind)]


@pytest.fixture(params=ADAPTERS)
def adapter(request):
    return request.param


@pytest.fixture
def app(adapter, cluster, blackhole):
    return app_for(adapter, "main", cluster, blackhole)


def is_problem(r, status):
    return r[0] == status and r[1].get("content-type") == "application/problem+json" and json.loads(r[2])["status"] == status


# --- the scenarios ---------------------------------------------------------------------------

def test_first_request_then_replay_with_members_reordered(app, adapter):
    k = f'"{adapter}-first"'
    a = app.request("POST", "/orders", {"a": 1, "b": [1, 2]}, k)
    assert a[0] == 201 and a[1]["idempotency-key"] == k and "idempotent-replayed" not in a[1]
    assert a[1]["location"].startswith("/orders/") and "set-cookie" in a[1] and "x-request-id" in a[1]
    assert a[1]["content-type"].startswith("application/json") and "idempotency-expires" in a[1]
    b = app.request("POST", "/orders", b'{ "b": [1, 2], "a": 1 }', k, [("content-type", "application/json")])
    assert b[0] == 201 and b[2] == a[2] and b[1]["idempotent-replayed"] == "true"
    assert b[1]["content-type"] == a[1]["content-type"]
    assert (b[1]["location"], b[1]["etag"]) == (a[1]["location"], a[1]["etag"])      # the allow-list
    assert "set-cookie" not in b[1] and "x-request-id" not in b[1]                    # never replayed
    assert b[1]["idempotency-expires"] == a[1]["idempotency-expires"]


def test_other_body_or_added_query_string_is_422(app, adapter):
    k = f'"{adapter}-other"'
    assert app.request("POST", "/orders", {"a": 1}, k)[0] == 201
    before = app.runs()
    assert is_problem(app.request("POST", "/orders", {"a": 2}, k), 422)
    assert is_problem(app.request("POST", "/orders?x=1", {"a": 1}, k), 422)
    assert app.runs() == before


def test_concurrent_duplicate_without_wait_is_409_with_retry_after(app, adapter):
    k = f'"{adapter}-busy"'
    first = {}
    t = threading.Thread(target=lambda: first.update(r=app.request("POST", "/orders", {"a": 1}, k, [("x-sleep-ms", "1500")])))
    t.start()
    time.sleep(0.5)
    dup = app.request("POST", "/orders", {"a": 1}, k)
    t.join()
    assert is_problem(dup, 409) and int(dup[1]["retry-after"]) >= 1
    assert first["r"][0] == 201


def test_concurrent_duplicate_with_wait_replays_the_first_answer(adapter, cluster, blackhole):
    app = app_for(adapter, "wait", cluster, blackhole)
    k = f'"{adapter}-wait"'
    first = {}
    t = threading.Thread(target=lambda: first.update(r=app.request("POST", "/orders", {"a": 1}, k, [("x-sleep-ms", "1500")])))
    t.start()
    time.sleep(0.5)
    dup = app.request("POST", "/orders", {"a": 1}, k)
    t.join()
    assert dup[0] == 201 and dup[1]["idempotent-replayed"] == "true" and dup[2] == first["r"][2]


MALFORMED = ['k-1', '1', '?1', '"unterminated', '""', '"a" x', '"a\\x"', '"a";P=1', '"' + "k" * 256 + '"', ":YQ==:",
             "@1", '%"x"', '("a")', '"tab\there"']


@pytest.mark.parametrize("value", MALFORMED)
def test_malformed_key_is_400_and_runs_nothing(app, value):
    before = app.runs()
    r = app.request("POST", "/orders", {"a": 1}, value)
    assert is_problem(r, 400), r
    assert json.loads(r[2])["title"] == "Idempotency-Key is malformed" or "Idempotency-Key" in json.loads(r[2])["detail"]
    assert app.runs() == before


def test_missing_key_and_two_key_headers_are_400(app, adapter):
    before = app.runs()
    assert is_problem(app.request("POST", "/orders", {"a": 1}), 400)
    r = app.request("POST", "/orders", {"a": 1}, [f'"{adapter}-x"', f'"{adapter}-y"'])
    assert is_problem(r, 400)
    assert "more than once" in json.loads(r[2])["detail"]
    assert app.runs() == before


@pytest.mark.parametrize("route", ["/fail", "/throw"])
def test_handler_answering_500_or_throwing_releases_the_key(app, adapter, route):
    k = f'"{adapter}-{route[1:]}"'
    before = app.runs()
    assert app.request("POST", route, {"a": 1}, k)[0] == 500
    assert app.request("POST", route, {"a": 1}, k)[0] == 500
    assert app.runs() == before + 2                    # released: the retry ran again


def test_handler_answering_400_is_its_own_and_is_replayed(app, adapter):
    k = f'"{adapter}-reject"'
    a = app.request("POST", "/reject", {"a": 1}, k)
    assert a[0] == 400 and a[1]["content-type"].startswith("application/json") and json.loads(a[2]) == {"error": "bad"}
    b = app.request("POST", "/reject", {"a": 1}, k)
    assert b[0] == 400 and b[2] == a[2] and b[1]["content-type"] == a[1]["content-type"]
    assert b[1]["idempotent-replayed"] == "true"


@pytest.mark.parametrize("ctype,body", [("text/plain", b"hello"), ("application/x-www-form-urlencoded", b"a=1&b=2"),
                                        (None, b"")])
def test_non_json_and_empty_bodies_are_accepted_and_replayed(app, adapter, ctype, body):
    k = f'"{adapter}-body-{ctype}"'
    h = [("content-type", ctype)] if ctype else []
    a = app.request("POST", "/text", body, k, h)
    assert a[0] == 200 and a[2] == f"got {len(body)} bytes".encode(), a
    assert a[1]["content-type"] == "text/plain; charset=utf-8"
    b = app.request("POST", "/text", body, k, h)
    assert b[2] == a[2] and b[1]["content-type"] == a[1]["content-type"] and b[1]["idempotent-replayed"] == "true"
    if body:
        assert is_problem(app.request("POST", "/text", body + b"!", k, h), 422)


def test_get_passes_through_without_a_key(app):
    r = app.request("GET", "/orders")
    assert r[0] == 200 and json.loads(r[2]) == [] and "idempotency-key" not in r[1]


def test_database_down_is_503_within_the_connect_timeout(adapter, cluster, blackhole):
    app = app_for(adapter, "down", cluster, blackhole)
    started = time.monotonic()
    r = app.request("POST", "/orders", {"a": 1}, f'"{adapter}-down"')
    assert time.monotonic() - started < 5
    assert is_problem(r, 503) and r[1]["retry-after"] == "1"
    assert app.runs() == 0


def test_database_down_fail_open_runs_the_handler(adapter, cluster, blackhole):
    app = app_for(adapter, "open", cluster, blackhole)
    r = app.request("POST", "/orders", {"a": 1}, f'"{adapter}-open"')
    assert r[0] == 201 and app.runs() == 1


@pytest.mark.parametrize("ctype,body", [("application/json", b'{"b": 2, "a": 1.50}'), ("text/plain", b"hello"),
                                        (None, b"")])
def test_the_same_request_has_the_same_fingerprint_in_every_adapter(cluster, blackhole, ctype, body):
    h = [("content-type", ctype)] if ctype else []
    for a in ADAPTERS:
        r = app_for(a, "main", cluster, blackhole).request("POST", "/text", body, f'"fp-{a}-{ctype}"', h)
        assert r[0] == 200, (a, r)
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        hashes = conn.execute("SELECT key, request_hash FROM idempotency.idempotency_keys WHERE key LIKE %s",
                              (f"fp-%-{ctype}",)).fetchall()
    assert len(hashes) == len(ADAPTERS) and len({h for _, h in hashes}) == 1, hashes


def test_racing_duplicates_on_two_instances_run_each_handler_once(adapter, cluster, blackhole):
    # Two instances of the app (as behind a load balancer), 16 duplicates of each of 50 keys, all
    # of one key's duplicates in flight together: every key's handler runs once over both
    # instances; each duplicate gets the replay or 409.
    instances = [app_for(adapter, "main", cluster, blackhole), app_for(adapter, "twin", cluster, blackhole)]
    keys, duplicates = 50, 16
    before = sum(a.runs() for a in instances)
    calls = [(instances[d % 2], f'"{adapter}-race-{k}"') for k in range(keys) for d in range(duplicates)]

    def post(call):
        app, key = call
        return key, app.request("POST", "/orders", {"race": key}, key, [("x-sleep-ms", "100")])

    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(post, calls))
    by_key = collections.defaultdict(list)
    for key, r in answers:
        by_key[key].append(r)
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        completed = conn.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key LIKE %s "
                                 "AND status = 'completed'", (f"{adapter}-race-%",)).fetchone()[0]
    statuses = collections.Counter(r[0] for _, r in answers)
    assert completed == keys, (statuses, [r[2][:200] for _, r in answers if r[0] >= 500][:3])
    for key, rs in by_key.items():
        firsts = [r for r in rs if r[0] == 201 and "idempotent-replayed" not in r[1]]
        assert len(firsts) == 1, (key, [(r[0], r[2][:80]) for r in rs])
        for r in rs:
            replay = r[0] == 201 and r[1].get("idempotent-replayed") == "true" and r[2] == firsts[0][2]
            assert r is firsts[0] or replay or is_problem(r, 409), (key, r[0], r[2][:200])
    # Every key ran at least once (its first answer) and 50 runs in all: each ran exactly once.
    assert sum(a.runs() for a in instances) - before == keys
