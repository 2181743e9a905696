"""End-to-end tests of the example HTTP service (examples/http-service) with real HTTP requests.

The service binary is built here with `cargo build` (a no-op when it is up to date; set
HTTP_SERVICE_BIN to use another build). It runs as the application role that
examples/http-service/setup.sql creates, against its own database in the session's throwaway
cluster, and calls a fake payment service (examples/http-service/fake_provider.py) that records
every refund by its own idempotency key and can be told to crash or hang mid-request."""

import email.utils
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from cluster import PG_BIN, free_port

pytestmark = pytest.mark.slow  # builds the example service with cargo

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLE = os.path.join(ROOT, "examples", "http-service")
DB = "http_example"
REFUND_LEASE = 3  # seconds: how long a crashed refund waits before a retry takes it over
CLAIM_WAIT_MS = 2000


@pytest.fixture(scope="module")
def binary():
    return build_service()


def build_service():
    """The service binary (also used by test_citus.py)."""
    if os.environ.get("HTTP_SERVICE_BIN"):
        return os.environ["HTTP_SERVICE_BIN"]
    # A debug build: it compiles in about half the time of a release build, and is fast enough.
    subprocess.run(["cargo", "build", "--quiet", "--locked", "--manifest-path",
                    os.path.join(EXAMPLE, "Cargo.toml")], check=True)
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(EXAMPLE, "target")
    return os.path.join(target, "debug", "idempotency-http-service")


@pytest.fixture(scope="module")
def app_db(cluster):
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        c.execute(f"CREATE DATABASE {DB}")
    su = f"host={cluster.dir} port={cluster.port} user=postgres dbname={DB}"
    subprocess.run([f"{PG_BIN}/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", su,
                    "-f", os.path.join(EXAMPLE, "setup.sql")], check=True, capture_output=True)
    yield su, f"host={cluster.dir} port={cluster.port} user=http_example_app dbname={DB}"
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


@pytest.fixture
def sql(app_db):
    """A superuser session in the example's database, to look at what the service stored."""
    with psycopg.connect(app_db[0], autocommit=True) as c:
        yield lambda q, *a: c.execute(q, a).fetchall()


class Proc:
    def __init__(self, argv, env, port, log):
        self.argv, self.env, self.port, self.log = argv, env, port, log
        self.p = None

    def start(self, ready):
        out = open(self.log, "a")
        self.p = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.argv[0]} exited: {open(self.log).read()[-2000:]}")
            try:
                if ready():
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.argv[0]} did not get ready: {open(self.log).read()[-2000:]}")

    def kill9(self):
        self.p.kill()  # SIGKILL: no cleanup, connections just drop
        self.p.wait()

    def stop(self):
        if self.p and self.p.poll() is None:
            self.kill9()


def request(port, method, path, body=None, headers=None, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


class Provider(Proc):
    def charges(self):
        return json.loads(request(self.port, "GET", "/_charges")[2])

    def control(self, **doc):
        assert request(self.port, "POST", "/_control", doc)[0] == 200

    def ready(self):
        return request(self.port, "GET", "/_charges", timeout=1)[0] == 200


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="http-service-") as d:
        yield d


@pytest.fixture(scope="module")
def provider(workdir):
    port = free_port()
    p = Provider([sys.executable, os.path.join(EXAMPLE, "fake_provider.py"), "--port", str(port),
                  "--journal", os.path.join(workdir, "provider.jsonl")],
                 dict(os.environ), port, os.path.join(workdir, "provider.log"))
    p.start(p.ready)
    yield p
    p.control(release=True)
    p.stop()


class Service(Proc):
    def ready(self):
        return request(self.port, "GET", "/health", timeout=1)[0] == 200

    def restart(self):
        self.kill9()
        return self.start(self.ready)

    def post(self, path, body, key="k", client="c1", headers=None, timeout=30):
        h = {}
        if client is not None:
            h["Authorization"] = f"Bearer {client}"
        if key is not None:
            h["Idempotency-Key"] = f'"{key}"'
        h.update(headers or {})
        return request(self.port, "POST", path, body, h, timeout)


@pytest.fixture(scope="module")
def service(binary, app_db, provider, workdir):
    port = free_port()
    env = dict(os.environ, DATABASE_URL=app_db[1], LISTEN=f"127.0.0.1:{port}",
               PAYMENT_URL=f"http://127.0.0.1:{provider.port}", POOL_SIZE="20",
               REFUND_LEASE_SECS=str(REFUND_LEASE), PROVIDER_TIMEOUT_MS="2000",
               ORDER_LEASE_SECS="5", CLAIM_WAIT_MS=str(CLAIM_WAIT_MS), TEST_HOOKS="1")
    s = Service([binary], env, port, os.path.join(workdir, "service.log"))
    s.start(s.ready)
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def service_log(workdir):
    """Prints what the service and the provider logged during the test: pytest shows it when
    the test failed."""
    logs = [os.path.join(workdir, n) for n in ("service.log", "provider.log")]
    sizes = [os.path.getsize(f) if os.path.exists(f) else 0 for f in logs]
    yield
    for f, n in zip(logs, sizes):
        if os.path.exists(f):
            with open(f, errors="replace") as fh:
                fh.seek(n)
                print(f"--- {os.path.basename(f)}:\n{fh.read()[-20000:]}")


ORDER = {"items": [{"sku": "A1", "qty": 2}], "amount": 59.90, "currency": "EUR"}


def stored_row(sql, scope, key):
    row = sql("SELECT status::text, response_status, expires_at "
              "FROM idempotency.lookup(key => %s, scope => %s)", key, scope)[0]
    return row if row[0] is not None else None


def assert_expires(headers, sql, scope, key):
    """Idempotency-Expires is an IMF-fixdate equal to the stored expires_at (to the second, never
    later than it)."""
    value = headers["idempotency-expires"]
    assert value.endswith(" GMT") and len(value) == 29, value
    advertised = email.utils.parsedate_to_datetime(value)
    stored = stored_row(sql, scope, key)[2]
    assert advertised == stored.replace(microsecond=0), (value, stored)
    return advertised


def assert_problem(status, headers, body, want_status, title=None):
    assert status == want_status, body
    assert headers["content-type"] == "application/problem+json"
    doc = json.loads(body)
    assert doc["status"] == want_status and doc["type"].startswith("https://")
    if title:
        assert doc["title"] == title
    return doc


def wait_for(cond, what, timeout=15):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def wait_open_transaction(sql):
    """Until a session of the service sits in an open transaction (a handler sleeping after its
    one-transaction claim)."""
    wait_for(lambda: sql("SELECT count(*) FROM pg_stat_activity WHERE usename = 'http_example_app' "
                         "AND state = 'idle in transaction'")[0][0] > 0, "the claim")


def count(sql, table, client):
    return sql(f"SELECT count(*) FROM http_example.{table} WHERE client_id = %s", client)[0][0]


def test_order_is_created_once_and_replayed(service, sql):
    status, h, body = service.post("/orders", ORDER, key="order-1", client="alice")
    assert status == 201, body
    assert h["content-type"] == "application/json"
    assert h["idempotency-key"] == '"order-1"' and "idempotent-replayed" not in h
    first = json.loads(body)
    assert first["amount"] == 59.9 and first["currency"] == "EUR"
    assert stored_row(sql, "alice:POST /orders", "order-1")[:2] == ("completed", 201)
    expires = assert_expires(h, sql, "alice:POST /orders", "order-1")
    assert 86_000 < expires.timestamp() - time.time() <= 86_400

    # The same request again, then with other member order and whitespace: a replay, byte for byte.
    reordered = json.dumps(dict(reversed(list(ORDER.items()))), indent=2).encode()
    for again in (ORDER, reordered):
        s2, h2, b2 = service.post("/orders", again, key="order-1", client="alice")
        assert (s2, b2) == (201, body)
        assert h2["idempotent-replayed"] == "true" and h2["idempotency-key"] == '"order-1"'
        assert h2["idempotency-expires"] == h["idempotency-expires"]
    # Parameters after the String are ignored: the same key.
    s3, h3, b3 = service.post("/orders", ORDER, key=None, client="alice",
                              headers={"Idempotency-Key": '"order-1";p=1'})
    assert (s3, b3, h3["idempotent-replayed"]) == (201, body, "true")
    assert h3["idempotency-key"] == '"order-1";p=1'
    # Keys are scoped to the client: bob's order-1 is his own.
    s4, _, b4 = service.post("/orders", ORDER, key="order-1", client="bob")
    assert s4 == 201 and json.loads(b4)["order_id"] != first["order_id"]
    assert count(sql, "orders", "alice") == 1 and count(sql, "orders", "bob") == 1


def test_same_key_with_another_request_is_422(service, sql):
    assert service.post("/orders", ORDER, key="order-2", client="carol")[0] == 201
    for body, path in (({**ORDER, "amount": 1}, "/orders"), (ORDER, "/orders?coupon=X")):
        status, h, b = service.post(path, body, key="order-2", client="carol")
        doc = assert_problem(status, h, b, 422, "Idempotency-Key is already used")
        assert "different request" in doc["detail"]
        assert h["idempotency-key"] == '"order-2"' and "idempotent-replayed" not in h
        assert_expires(h, sql, "carol:POST /orders", "order-2")
    assert count(sql, "orders", "carol") == 1


def test_missing_or_malformed_key_is_400(service, sql):
    status, h, b = service.post("/orders", ORDER, key=None, client="dave")
    doc = assert_problem(status, h, b, 400, "Idempotency-Key is missing")
    assert "idempotency-key" not in h and "idempotency-expires" not in h
    cases = {
        '""': "empty",
        "": "empty",
        '"' + "x" * 256 + '"': "too long: 256 characters",
        '"a\u00e9"': "bad character at position 3 (byte 0xe9)",
        '"ab': "no closing quote",
        '"a\\nb"': "bad escape",
        '"ab" x': "after the closing quote at position 6",
        '"ab";X=1': "malformed parameter at position 6",
        '"ab";x=?2': "malformed parameter at position 8",
        # Items of another type than String (RFC 9651: a malformed field).
        "abc": "is a bare Token, not a String",
        "a b": "is a bare Token, not a String",
        "k\u00e9": "is a bare Token, not a String",
        "1": "is an Integer or Decimal, not a String",
        "?1": "is a Boolean, not a String",
        ":aGk=:": "is a Byte Sequence, not a String",
    }
    for raw, why in cases.items():
        status, h, b = service.post("/orders", ORDER, key=None, client="dave",
                                    headers={"Idempotency-Key": raw.encode("latin-1")})
        doc = assert_problem(status, h, b, 400, "Idempotency-Key is malformed")
        assert why in doc["detail"], (raw, doc)
        assert h["idempotency-key"].encode("latin-1") == raw.encode("latin-1")
        assert "idempotency-expires" not in h
    # 255 characters is the limit of the extension, and is accepted.
    assert service.post("/orders", ORDER, key="y" * 255, client="dave")[0] == 201
    # No client identity: 401, before anything else.
    status, h, b = service.post("/orders", ORDER, key="z", client=None)
    assert_problem(status, h, b, 401)
    assert h["www-authenticate"] == "Bearer"
    # A body that is not JSON, or not an order: refused before the key is claimed.
    status, h, b = service.post("/orders", b"{not json", key="bad-body", client="dave")
    assert_problem(status, h, b, 400)
    status, h, b = service.post("/orders", {"amount": -1}, key="bad-body", client="dave")
    assert_problem(status, h, b, 422)
    assert stored_row(sql, "dave:POST /orders", "bad-body") is None
    assert count(sql, "orders", "dave") == 1


def test_key_is_a_string_item_with_optional_parameters(service, sql):
    """RFC 9651: an Item is a String here, optionally with parameters (ignored); an Item of
    another type is a malformed field, refused with 400, never a key of its own."""
    scope = "dora:POST /orders"
    status, h, body = service.post("/orders", ORDER, key=None, client="dora",
                                   headers={"Idempotency-Key": '"param-1";p=1'})
    assert status == 201 and "idempotent-replayed" not in h, body
    assert h["idempotency-key"] == '"param-1";p=1'
    assert stored_row(sql, scope, "param-1")[:2] == ("completed", 201)
    for raw in ('"param-1"', '"param-1"; a=?0;b="x;y";c=tok/1;d=-1.5;e=:aGk=:;f=@1700000000;*g'):
        s2, h2, b2 = service.post("/orders", ORDER, key=None, client="dora",
                                  headers={"Idempotency-Key": raw})
        assert (s2, b2, h2.get("idempotent-replayed")) == (201, body, "true"), (raw, b2)
    for raw, kind in (("abc", "a bare Token"), ("1", "an Integer or Decimal"), ("?1", "a Boolean")):
        status, h, b = service.post("/orders", ORDER, key=None, client="dora",
                                    headers={"Idempotency-Key": raw})
        doc = assert_problem(status, h, b, 400, "Idempotency-Key is malformed")
        assert f"is {kind}, not a String" in doc["detail"], (raw, doc)
        assert h["idempotency-key"] == raw and "idempotency-expires" not in h
    # Nothing was claimed under the bare values ('?1' would be key '?1'); one order in all.
    assert sql("SELECT key FROM idempotency.idempotency_keys WHERE scope = %s", scope) == [("param-1",)]
    assert count(sql, "orders", "dora") == 1


def test_body_is_judged_as_jsonb_judges_it(service, sql):
    """JSON that jsonb accepts is accepted, whatever a double or a recursion limit would say:
    numbers beyond the range of a double and nesting deeper than 128 levels. Their exact
    values are stored, and the same bytes again are a replay."""
    big = "9" * 400
    deep = "[" * 200 + "1" + "]" * 200
    text = ('{"items": [{"sku": "A1", "qty": 1, "weight": 1e400, "serial": 123456789012345678901234567890, '
            f'"big": {big}, "deep": {deep}}}], "amount": 123456789012345678901234567890.5, '
            '"currency": "EUR"}').encode()
    status, h, b = service.post("/orders", text, key="big-1", client="owen")
    assert status == 201, b
    # What the service stored is what PostgreSQL reads from the text sent, exactly.
    assert sql("SELECT items = (%s::jsonb -> 'items'), amount = 123456789012345678901234567890.5 "
               "FROM http_example.orders WHERE client_id = 'owen'", text.decode()) == [(True, True)]
    assert sql("SELECT jsonb_path_query_first(items, '$[0].weight')::text = '1' || repeat('0', 400) "
               "FROM http_example.orders WHERE client_id = 'owen'") == [(True,)]
    s2, h2, b2 = service.post("/orders", text, key="big-1", client="owen")
    assert (s2, b2, h2.get("idempotent-replayed")) == (201, b, "true")
    assert count(sql, "orders", "owen") == 1


def test_body_that_jsonb_refuses_is_a_client_error(service, sql):
    """JSON that jsonb cannot hold, or text PostgreSQL does not read as JSON, is refused with
    400 or 422 saying why, never 503 "retry" (no retry can succeed). Nothing is claimed: the key
    stays free for the corrected request."""
    scope = "pia:POST /orders"
    item = '{{"items": [{{"sku": {}}}], "amount": 5, "currency": "EUR"}}'
    cases = [
        (item.format('"A\\u0000"'), 422, "\\u0000 cannot be converted to text"),
        (item.format('1e200000'), 422, "overflows numeric format"),
        # jsonb takes this, the fingerprint's canonical hashing (1000 levels) does not.
        (item.format("[" * 5000 + "]" * 5000), 422, "nested deeper than"),
        (item.format('"\\ud800"'), 400, "surrogate"),
    ]
    for text, want, why in cases:
        status, h, b = service.post("/orders", text.encode(), key="nul-1", client="pia")
        doc = assert_problem(status, h, b, want)
        assert "retry-after" not in h and "idempotency-expires" not in h
        assert why in doc["detail"], (text[:60], doc)
        assert stored_row(sql, scope, "nul-1") is None
    # A refund with such a body: the same.
    status, h, b = service.post("/refunds", b'{"order_id": 1, "amount": 1, "note": "\\u0000"}',
                                key="nul-2", client="pia")
    assert "cannot be converted to text" in assert_problem(status, h, b, 422)["detail"]
    assert stored_row(sql, "pia:POST /refunds", "nul-2") is None
    # A NUL in the query string is refused before anything reaches PostgreSQL.
    status, h, b = service.post("/orders?note=a%00b", ORDER, key="nul-1", client="pia")
    assert "NUL" in assert_problem(status, h, b, 400)["detail"]
    # The key was never used: the corrected request is new.
    status, h, b = service.post("/orders", ORDER, key="nul-1", client="pia")
    assert status == 201 and "idempotent-replayed" not in h, b
    assert count(sql, "orders", "pia") == 1


def test_storm_of_identical_posts_creates_one_order(service, sql):
    """100 concurrent identical POSTs: one order, and every client gets the same answer. The
    first request's transaction stays open for 300 ms; duplicates wait for it (claim_wait) and
    replay its answer."""
    barrier = threading.Barrier(100)

    def one(_):
        barrier.wait()
        return service.post("/orders", ORDER, key="storm", client="erin",
                            headers={"X-Test-Delay-Ms": "300"}, timeout=60)

    with ThreadPoolExecutor(100) as ex:
        answers = list(ex.map(one, range(100)))
    statuses = sorted({a[0] for a in answers})
    assert statuses == [201], [(a[0], a[2]) for a in answers if a[0] != 201][:3]
    assert len({a[2] for a in answers}) == 1
    assert sum(a[1].get("idempotent-replayed") == "true" for a in answers) == 99
    assert len({a[1]["idempotency-expires"] for a in answers}) == 1
    assert count(sql, "orders", "erin") == 1


def test_in_progress_is_409_with_retry_after(service, sql):
    first = {}
    t = threading.Thread(target=lambda: first.update(r=service.post(
        "/orders", ORDER, key="slow", client="fred", headers={"X-Test-Delay-Ms": "5000"})))
    t.start()
    wait_open_transaction(sql)
    started = time.time()
    status, h, b = service.post("/orders", ORDER, key="slow", client="fred")
    waited = time.time() - started
    assert_problem(status, h, b, 409, "A request is outstanding for this Idempotency-Key")
    assert 1 <= int(h["retry-after"]) <= 5
    assert h["idempotency-key"] == '"slow"'
    assert waited >= CLAIM_WAIT_MS / 1000 - 0.1  # it waited for the first transaction first
    t.join()
    assert first["r"][0] == 201
    s2, h2, b2 = service.post("/orders", ORDER, key="slow", client="fred")
    assert (s2, b2, h2["idempotent-replayed"]) == (201, first["r"][2], "true")
    assert count(sql, "orders", "fred") == 1


def test_order_retry_after_service_killed_mid_request(service, sql):
    """kill -9 while the handler sleeps inside its transaction: the claim rolls back with it, the
    retry against the restarted service creates the order, once."""
    errors = []

    def doomed():
        try:
            service.post("/orders", ORDER, key="crash-1", client="gina",
                         headers={"X-Test-Delay-Ms": "30000"})
        except (OSError, http.client.HTTPException) as e:
            errors.append(e)

    t = threading.Thread(target=doomed)
    t.start()
    wait_open_transaction(sql)
    service.restart()
    t.join()
    assert errors, "the request should have died with the service"
    status, h, b = service.post("/orders", ORDER, key="crash-1", client="gina")
    assert status == 201 and "idempotent-replayed" not in h
    s2, h2, b2 = service.post("/orders", ORDER, key="crash-1", client="gina")
    assert (s2, b2, h2["idempotent-replayed"]) == (201, b, "true")
    assert count(sql, "orders", "gina") == 1


def new_order(service, client):
    status, _, body = service.post("/orders", {**ORDER, "amount": 100}, key=f"o-{client}",
                                   client=client)
    assert status == 201
    return json.loads(body)["order_id"]


def retry_until_done(service, path, body, key, client, sql, limit=REFUND_LEASE + 10):
    """Retries like a client that honours Retry-After: 409s until the lease runs out, then the
    takeover finishes the work."""
    deadline = time.time() + limit
    seen = []
    while True:
        status, h, b = service.post(path, body, key=key, client=client)
        seen.append(status)
        if status != 409 or time.time() > deadline:
            return status, h, b, seen
        assert 1 <= int(h["retry-after"]) <= REFUND_LEASE
        assert_expires(h, sql, f"{client}:POST {path}", key)
        time.sleep(min(int(h["retry-after"]), 1))


def test_refund_survives_service_crash_while_provider_hangs(service, provider, sql):
    order_id = new_order(service, "hank")
    refund = {"order_id": order_id, "amount": 25.5}
    provider.control(next=["hang"])
    before = provider.charges()["executions"]
    errors = []

    def doomed():
        try:
            service.post("/refunds", refund, key="refund-1", client="hank")
        except (OSError, http.client.HTTPException) as e:
            errors.append(e)

    t = threading.Thread(target=doomed)
    t.start()
    # the provider performed it, and hangs
    wait_for(lambda: provider.charges()["executions"] > before, "the provider")
    service.restart()  # kill -9 mid-request
    t.join()
    assert errors, "the request should have died with the service"
    provider.control(release=True)

    # Right after the restart the claim's lease still runs: 409 with Retry-After.
    status, h, b = service.post("/refunds", refund, key="refund-1", client="hank")
    assert_problem(status, h, b, 409)
    assert_expires(h, sql, "hank:POST /refunds", "refund-1")
    status, h, b, seen = retry_until_done(service, "/refunds", refund, "refund-1", "hank", sql)
    assert status == 201, (seen, b)
    done = json.loads(b)
    ch = provider.charges()
    assert ch["executions"] == before + 1  # refunded once, though called twice with one key
    mine = [c for c in ch["charges"] if c["id"] == done["provider_refund_id"]]
    assert len(mine) == 1 and mine[0]["calls"] == 2 and mine[0]["key"].startswith("hank:POST /refunds/refund-1:refund:")
    assert count(sql, "refunds", "hank") == 1
    assert sql("SELECT provider_key FROM http_example.refunds WHERE client_id = 'hank'")[0][0] == mine[0]["key"]
    assert_expires(h, sql, "hank:POST /refunds", "refund-1")
    s2, h2, b2 = service.post("/refunds", refund, key="refund-1", client="hank")
    assert (s2, b2, h2["idempotent-replayed"]) == (201, b, "true")


def test_refund_survives_provider_crash_mid_request(service, provider, sql):
    order_id = new_order(service, "ivan")
    refund = {"order_id": order_id, "amount": 10}
    before = provider.charges()["executions"]
    provider.control(next=["crash"])
    status, h, b = service.post("/refunds", refund, key="refund-2", client="ivan")
    # The provider recorded the refund and died before answering: the outcome is in doubt, the
    # claim is kept (with its recovery point) and the client is told when to retry.
    assert_problem(status, h, b, 502)
    assert 1 <= int(h["retry-after"]) <= REFUND_LEASE
    assert_expires(h, sql, "ivan:POST /refunds", "refund-2")
    assert stored_row(sql, "ivan:POST /refunds", "refund-2")[0] == "in_progress"
    provider.p.wait()
    provider.start(provider.ready)  # back up, its journal intact
    status, h, b, seen = retry_until_done(service, "/refunds", refund, "refund-2", "ivan", sql)
    assert status == 201, (seen, b)
    assert provider.charges()["executions"] == before + 1
    assert count(sql, "refunds", "ivan") == 1


def test_refund_with_provider_down_is_released(service, provider, sql):
    order_id = new_order(service, "judy")
    refund = {"order_id": order_id, "amount": 1}
    provider.kill9()
    try:
        status, h, b = service.post("/refunds", refund, key="refund-3", client="judy")
        assert_problem(status, h, b, 503)
        assert h["retry-after"] == "1" and "idempotency-expires" not in h
        assert stored_row(sql, "judy:POST /refunds", "refund-3") is None  # released
    finally:
        provider.start(provider.ready)
    status, h, b = service.post("/refunds", refund, key="refund-3", client="judy")
    assert status == 201 and "idempotent-replayed" not in h
    assert count(sql, "refunds", "judy") == 1


def test_refund_errors_are_stored_and_replayed(service, sql):
    order_id = new_order(service, "kate")
    for body, want in (({"order_id": order_id + 1000, "amount": 1}, 404),
                       ({"order_id": order_id, "amount": 1000}, 422)):
        key = f"bad-{want}"
        status, h, b = service.post("/refunds", body, key=key, client="kate")
        assert_problem(status, h, b, want)
        assert_expires(h, sql, "kate:POST /refunds", key)
        s2, h2, b2 = service.post("/refunds", body, key=key, client="kate")
        assert (s2, b2, h2["idempotent-replayed"]) == (want, b, "true")
    assert count(sql, "refunds", "kate") == 0


def test_service_connects_as_the_application_role(service, sql):
    assert sql("SELECT rolsuper, rolcreaterole, rolcreatedb FROM pg_roles "
               "WHERE rolname = 'http_example_app'") == [(False, False, False)]
    users = sql("SELECT DISTINCT usename FROM pg_stat_activity WHERE datname = %s "
                "AND usename <> 'postgres'", DB)
    assert users == [("http_example_app",)]


def test_stale_refund_worker_is_fenced_off(service, provider, sql):
    """A worker that stalls past its lease (test hook: it sleeps before calling the provider) is
    overtaken by a retry; when it wakes up the provider deduplicates its call and the store
    refuses its completion, so it answers with the stored result: one refund."""
    order_id = new_order(service, "liam")
    refund = {"order_id": order_id, "amount": 5}
    before = provider.charges()["executions"]
    stale = {}
    t = threading.Thread(target=lambda: stale.update(r=service.post(
        "/refunds", refund, key="refund-4", client="liam",
        headers={"X-Test-Delay-Ms": str(REFUND_LEASE * 1000 + 1500)})))
    t.start()
    wait_for(lambda: stored_row(sql, "liam:POST /refunds", "refund-4"), "the claim")
    status, h, b, seen = retry_until_done(service, "/refunds", refund, "refund-4", "liam", sql)
    assert status == 201 and seen[0] == 409, seen
    t.join()
    s2, h2, b2 = stale["r"]
    assert (s2, b2, h2.get("idempotent-replayed")) == (201, b, "true")
    ch = provider.charges()
    assert ch["executions"] == before + 1
    assert [c["calls"] for c in ch["charges"] if c["id"] == json.loads(b)["provider_refund_id"]] == [2]
    assert count(sql, "refunds", "liam") == 1
