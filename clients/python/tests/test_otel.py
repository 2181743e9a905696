"""OpenTelemetry spans and metrics (the `otel` extra), read back with the SDK's in-memory exporter
and reader, against the throwaway cluster; and the package without OpenTelemetry installed.

They need only the direct route: the spans do not depend on the route (scripts/clients-python.sh
runs them in the direct mode only)."""

import datetime as dt
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import psycopg
import pytest

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pg_idempotency import Fenced, Store, idempotency_transaction
from pg_idempotency._otel import key_hash

pytestmark = pytest.mark.skipif(os.environ.get("IDEMPOTENCY_TEST_POOLER", "direct") not in ("", "direct"),
                                reason="OpenTelemetry tests run in the direct mode only")

SECRET_KEY = "order-7f3a-SECRETKEY"
SECRET_REQUEST = {"card": "4111-SECRETREQUEST", "amount": 42}


@pytest.fixture(scope="module")
def otel():
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tp)
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    return exporter, reader


@pytest.fixture
def spans(otel):
    exporter, _ = otel
    exporter.clear()
    return lambda: [s for s in exporter.get_finished_spans() if s.name.startswith("idempotency.")]


def points(reader, name):
    """{frozenset(attributes): value} of a metric (cumulative): a sum's value, a histogram's count."""
    out = {}
    data = reader.get_metrics_data()
    for rm in (data.resource_metrics if data else []):
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    for p in m.data.data_points:
                        out[frozenset(p.attributes.items())] = getattr(p, "value", None) if hasattr(p, "value") \
                            else p.count
    return out


def delta(before, after):
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def assert_no_secret(all_spans):
    for s in all_spans:
        for name, value in s.attributes.items():
            text = json.dumps(value) if not isinstance(value, str) else value
            for secret in (SECRET_KEY, "SECRETKEY", "SECRETREQUEST"):
                assert secret not in text, f"{s.name} {name} carries the key or the request"
        assert "SECRET" not in (s.status.description or "")
        assert not s.events


def test_spans_of_new_replay_mismatch_in_progress_and_takeover(conninfo, otel, spans):
    _, reader = otel
    claims0 = points(reader, "idempotency.claims")
    durations0 = points(reader, "idempotency.claim.duration")
    store = Store(conninfo)
    scope = "tenant-1"
    lease = dt.timedelta(milliseconds=600)
    first = store.claim(SECRET_KEY, SECRET_REQUEST, scope, lease=lease)
    assert first.outcome == "new"
    busy = store.claim(SECRET_KEY, SECRET_REQUEST, scope)
    assert busy.outcome == "in_progress"
    wrong = store.claim(SECRET_KEY, {"card": "other-SECRETREQUEST"}, scope)
    assert wrong.outcome == "mismatch"
    store.checkpoint(SECRET_KEY, "charged", scope, first.token)
    time.sleep(0.8)  # the first attempt's lease runs out: the next claim takes it over
    second = store.claim(SECRET_KEY, SECRET_REQUEST, scope, lease=dt.timedelta(seconds=30))
    assert second.outcome == "new" and second.token > first.token and second.recovery_point == "charged"
    with pytest.raises(Fenced):
        store.complete(SECRET_KEY, {"ok": True}, 201, scope, first.token)  # the stale attempt is fenced off
    store.complete(SECRET_KEY, {"ok": True}, 201, scope, second.token)
    again = store.claim(SECRET_KEY, SECRET_REQUEST, scope)
    assert again.outcome == "replay"
    other = store.claim("release-me-SECRETKEY", None, scope)
    assert store.release("release-me-SECRETKEY", scope, other.token)
    store.close()

    got = spans()
    assert [s.name for s in got] == ["idempotency.claim"] * 3 + ["idempotency.checkpoint", "idempotency.claim"] + \
        ["idempotency.complete"] * 2 + ["idempotency.claim", "idempotency.claim", "idempotency.release"]
    a = [dict(s.attributes) for s in got]
    h = key_hash(scope, SECRET_KEY)
    assert h == "c8e6b9416ff4a7bd"  # SHA-256 of scope NUL key: the same in the Node and Rust packages
    assert all(x["idempotency.scope"] == scope for x in a)
    assert all(x["idempotency.key_hash"] == h for x in a[:8])
    new, busy_, mismatch, checkpoint, takeover, stale, complete, replay, _, release = a
    assert new["idempotency.outcome"] == "new" and new["idempotency.replay"] is False
    assert new["idempotency.token"] == first.token and new["idempotency.resumed"] is False
    assert new["idempotency.retries"] == 0
    assert busy_["idempotency.outcome"] == "in_progress" and busy_["idempotency.replay"] is False
    assert 0 < busy_["idempotency.retry_after"] <= 1 and "idempotency.token" not in busy_
    assert mismatch["idempotency.outcome"] == "mismatch" and "idempotency.token" not in mismatch
    assert checkpoint["idempotency.token"] == first.token and "error.type" not in checkpoint
    assert takeover["idempotency.outcome"] == "new" and takeover["idempotency.token"] == second.token
    assert takeover["idempotency.resumed"] is True
    assert stale["idempotency.token"] == first.token and stale["error.type"] == "IK003"
    assert got[5].status.status_code == trace.StatusCode.ERROR
    assert complete["idempotency.token"] == second.token and "error.type" not in complete
    assert replay["idempotency.outcome"] == "replay" and replay["idempotency.replay"] is True
    assert replay["idempotency.token"] == second.token
    assert release["idempotency.released"] is True and release["idempotency.token"] == other.token
    assert all(s.kind == trace.SpanKind.CLIENT for s in got)
    assert_no_secret(got)

    claims = delta(claims0, points(reader, "idempotency.claims"))
    by = lambda o: frozenset({"idempotency.outcome": o}.items())  # noqa: E731
    assert claims == {by("new"): 3, by("in_progress"): 1, by("mismatch"): 1, by("replay"): 1}
    durations = delta(durations0, points(reader, "idempotency.claim.duration"))
    assert durations == claims


def test_a_completion_repeated_on_a_new_connection_is_counted(conninfo, db, otel, spans):
    _, reader = otel
    retries0 = points(reader, "idempotency.completion.retries")
    store = Store(conninfo, application_name="otel_retry")
    c = store.claim(SECRET_KEY, SECRET_REQUEST)
    db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'otel_retry'")
    time.sleep(0.1)
    store.complete(SECRET_KEY, {"ok": 1}, 200, "", c.token, lease_ends=c.lease_ends)
    store.close()
    complete = [s for s in spans() if s.name == "idempotency.complete"]
    assert len(complete) == 1 and complete[0].attributes["idempotency.retries"] >= 1
    n = complete[0].attributes["idempotency.retries"]
    assert delta(retries0, points(reader, "idempotency.completion.retries")) == {
        frozenset({"idempotency.operation": "complete"}.items()): n}


def test_the_transaction_style_and_the_claim_wait(conninfo, otel, spans):
    with psycopg.connect(conninfo) as conn:
        with idempotency_transaction(conn, SECRET_KEY, request=SECRET_REQUEST,
                                     wait=dt.timedelta(milliseconds=250)) as c:
            c.complete({"ok": True})
    claim, complete = spans()
    assert claim.name == "idempotency.claim" and claim.attributes["idempotency.outcome"] == "new"
    assert claim.attributes["idempotency.claim_wait"] == 0.25
    assert complete.name == "idempotency.complete" and complete.attributes["idempotency.token"] == c.token
    assert_no_secret([claim, complete])


def test_the_histogram_has_buckets_in_seconds(conninfo, otel):
    _, reader = otel
    Store(conninfo).claim("bucket-key")
    data = reader.get_metrics_data()
    bounds = [p.explicit_bounds for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
              if m.name == "idempotency.claim.duration" for p in m.data.data_points]
    assert bounds and tuple(bounds[0])[:3] == (0.001, 0.0025, 0.005)
    assert [m.unit for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
            if m.name == "idempotency.claim.duration"][0] == "s"


def test_without_opentelemetry_the_package_works_and_imports_none_of_it(conninfo):
    """As if `opentelemetry-api` were not installed: its import fails."""
    script = textwrap.dedent("""
        import sys
        sys.modules["opentelemetry"] = None  # import opentelemetry... raises ImportError
        import pg_idempotency
        from pg_idempotency import Store, _otel
        assert _otel.ENABLED is False
        store = Store(sys.argv[1])
        c = store.claim("no-otel", {"a": 1})
        assert c.outcome == "new", c
        store.checkpoint("no-otel", "p", token=c.token)
        store.complete("no-otel", {"ok": True}, token=c.token)
        assert store.claim("no-otel", {"a": 1}).outcome == "replay"
        loaded = [m for m, v in sys.modules.items() if m.startswith("opentelemetry") and v is not None]
        assert not loaded, loaded
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script, conninfo], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_asgi_middleware_spans_and_its_wait(conninfo, otel, spans):
    from starlette.testclient import TestClient
    from test_asgi import make_app, post

    calls = []
    with TestClient(make_app(conninfo, calls, wait=dt.timedelta(seconds=10)), raise_server_exceptions=False) as client:
        first = {}
        t = threading.Thread(target=lambda: first.update(r=post(client, '"SECRETKEY-h"', SECRET_REQUEST,
                                                                **{"x-delay": "0.5"})))
        t.start()
        deadline = time.monotonic() + 20
        while not calls:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        again = post(client, '"SECRETKEY-h"', SECRET_REQUEST)  # waits for the first answer, then replays
        t.join()
        assert first["r"].status_code == 201 and again.headers["idempotent-replayed"] == "true"
        assert post(client, '"SECRETKEY-h"', {"card": "other-SECRETREQUEST"}).status_code == 422
    got = spans()
    claims = [s for s in got if s.name == "idempotency.claim"]
    by = {s.attributes["idempotency.outcome"]: s.attributes for s in claims}
    assert sorted(by) == ["mismatch", "new", "replay"] and len(claims) == 3
    assert by["replay"]["idempotency.waited"] > 0 and "idempotency.waited" not in by["new"]
    assert {s.attributes["idempotency.scope"] for s in got} == {"c1:POST /orders"}
    assert [s.name for s in got].count("idempotency.complete") == 1
    assert_no_secret(got)
