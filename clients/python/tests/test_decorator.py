"""@idempotent against a real cluster: every outcome, a race, a crash taken over after the lease,
fencing, a database restart mid-function, the async variant."""

import asyncio
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

from pg_idempotency import Fenced, InProgress, Mismatch, Store, current_attempt, idempotent

SEC = dt.timedelta(seconds=1)


def test_new_then_replay_returns_the_stored_result(conninfo, row):
    calls = []

    @idempotent(key="receipt:{order_id}", scope="receipts", ttl=dt.timedelta(hours=1), conninfo=conninfo)
    def send_receipt(order_id, to, copies=1):
        calls.append((order_id, to))
        return {"message_id": f"m-{order_id}", "sent_to": to, "parts": (1, 2)}

    first = send_receipt(42, "a@example.com")
    assert first == {"message_id": "m-42", "sent_to": "a@example.com", "parts": (1, 2)}
    again = send_receipt(42, to="a@example.com")           # same arguments, bound by name
    assert again == {"message_id": "m-42", "sent_to": "a@example.com", "parts": [1, 2]}  # JSON
    assert calls == [(42, "a@example.com")]
    status, response, response_status, _, _ = row("receipt:42", "receipts")
    assert (status, response, response_status) == ("completed", json.loads(json.dumps(first)), 200)
    send_receipt(43, "a@example.com")                       # another key runs
    assert len(calls) == 2


def test_key_callable_and_mismatch(conninfo):
    calls = []

    @idempotent(key=lambda payment, **_: payment["id"], scope="pay", conninfo=conninfo)
    def charge(payment, note=""):
        calls.append(payment)
        return payment["amount"]

    assert charge({"id": "p1", "amount": 10}) == 10
    assert charge({"amount": 10, "id": "p1"}) == 10         # member order does not matter
    with pytest.raises(Mismatch) as e:
        charge({"id": "p1", "amount": 11})
    assert e.value.key == "p1" and e.value.scope == "pay"
    assert len(calls) == 1


def test_request_none_skips_the_payload_check_and_custom_request(conninfo):
    @idempotent(key="k-none", request=None, conninfo=conninfo)
    def f(x):
        return x

    assert f(1) == 1 and f(2) == 1                          # no check: the stored result

    @idempotent(key="k-req", request=lambda x, client: {"x": x}, conninfo=conninfo)
    def g(x, client):
        return x

    assert g(1, object()) == 1 and g(1, object()) == 1
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        idempotent(key="k-bad", conninfo=conninfo)(lambda client: 1)(object())


def test_exception_releases_the_key_and_the_retry_runs(conninfo, row):
    calls = []

    @idempotent(key="fail-once", conninfo=conninfo)
    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("SMTP refused")
        return "sent"

    with pytest.raises(RuntimeError):
        flaky()
    assert row("fail-once") is None                           # released
    assert flaky() == "sent" and flaky() == "sent"
    assert len(calls) == 2


def test_in_progress_waits_then_raises_with_retry_after(conninfo):
    started, finish = threading.Event(), threading.Event()

    @idempotent(key="slow", lease=dt.timedelta(seconds=30), wait=dt.timedelta(0), conninfo=conninfo)
    def slow():
        started.set()
        finish.wait(10)
        return "done"

    t = threading.Thread(target=slow)
    t.start()
    assert started.wait(10)
    with pytest.raises(InProgress) as e:
        slow()
    assert dt.timedelta(seconds=25) < e.value.retry_after <= dt.timedelta(seconds=30)
    # with a wait, a duplicate waits for the first call and gets its result
    waiting = idempotent(key="slow", lease=dt.timedelta(seconds=30), wait=dt.timedelta(seconds=10),
                         conninfo=conninfo)(lambda: "never runs")
    threading.Timer(0.3, finish.set).start()
    assert waiting() == "done"
    t.join()


def test_race_of_identical_calls_runs_once(conninfo):
    calls = []

    @idempotent(key="race", lease=dt.timedelta(seconds=30), wait=dt.timedelta(seconds=20), conninfo=conninfo)
    def work(n):
        calls.append(n)
        time.sleep(0.5)
        return {"ran": n}

    results = [None] * 12
    barrier = threading.Barrier(12)

    def run(i):
        barrier.wait()
        results[i] = work(7)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [{"ran": 7}] * 12


CRASHING = textwrap.dedent("""
    import datetime as dt, os, sys
    from pg_idempotency import current_attempt, idempotent

    @idempotent(key="order-9", scope="workflow", lease=dt.timedelta(seconds=4), conninfo=sys.argv[1])
    def fulfil(order):
        with open(sys.argv[2], "a") as f:
            f.write("charged\\n")
        current_attempt().checkpoint("charged")
        os._exit(70)                               # the process dies before shipping

    fulfil({"id": 9})
""")


def test_crash_mid_function_is_taken_over_after_the_lease(conninfo, tmp_path, row):
    log = tmp_path / "effects.log"
    script = tmp_path / "crash.py"
    script.write_text(CRASHING)
    p = subprocess.run([sys.executable, str(script), conninfo, str(log)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 70, p.stderr
    assert row("order-9", "workflow")[0] == "in_progress"

    attempts = []

    @idempotent(key="order-9", scope="workflow", lease=dt.timedelta(seconds=4), wait=dt.timedelta(0),
                conninfo=conninfo)
    def fulfil(order):
        a = current_attempt()
        attempts.append(a.recovery_point)
        with open(log, "a") as f:
            if a.recovery_point != "charged":
                f.write("charged\n")
            f.write("shipped\n")
        return {"order": order["id"], "status": "shipped"}

    with pytest.raises(InProgress) as e:                    # the dead process' lease still runs
        fulfil({"id": 9})
    assert e.value.retry_after <= dt.timedelta(seconds=4)
    time.sleep(e.value.retry_after.total_seconds() + 0.1)
    assert fulfil({"id": 9}) == {"order": 9, "status": "shipped"}   # takeover
    assert attempts == ["charged"]
    assert log.read_text().splitlines() == ["charged", "shipped"]
    assert fulfil({"id": 9}) == {"order": 9, "status": "shipped"}   # replay
    assert attempts == ["charged"]


def test_a_stale_attempt_is_fenced_and_returns_the_winner_result(conninfo):
    started = threading.Event()

    @idempotent(key="fence", lease=dt.timedelta(seconds=1), conninfo=conninfo)
    def stale():
        started.set()
        time.sleep(3)                                       # well past its lease
        return "stale"

    result = []
    t = threading.Thread(target=lambda: result.append(stale()))
    t.start()
    assert started.wait(10)
    time.sleep(1.2)
    winner = idempotent(key="fence", lease=dt.timedelta(seconds=10), conninfo=conninfo)(lambda: "winner")
    assert winner() == "winner"                             # took the key over
    t.join()
    assert result == ["winner"]                             # its complete was fenced: it replays


def test_checkpoint_of_a_fenced_attempt_raises(conninfo):
    store = Store(conninfo)
    c = store.claim("cp", scope="s", lease=SEC)
    time.sleep(1.1)
    c2 = store.claim("cp", scope="s")
    assert c2.outcome == "new" and c2.token > c.token
    with pytest.raises(Fenced) as e:
        store.checkpoint("cp", "x", "s", c.token)
    assert e.value.sqlstate == "IK003"


def test_database_restart_mid_function_reconnects_without_running_twice(cluster, conninfo):
    calls = []

    @idempotent(key="restart", lease=dt.timedelta(seconds=60), conninfo=conninfo)
    def work():
        calls.append(1)
        cluster.stop("fast")                                # the server goes away mid-function
        threading.Timer(1.0, cluster.restart).start()       # and comes back a second later
        return "ok"

    assert work() == "ok"                                   # complete reconnected, same token
    with psycopg.connect(conninfo) as conn:
        assert conn.execute("SELECT status::text FROM idempotency.lookup('restart')").fetchone() == ("completed",)
    assert work() == "ok" and calls == [1]


def test_terminated_backend_mid_function(conninfo, db, row):
    if os.environ.get("IDEMPOTENCY_TEST_CONNINFO") and os.environ.get("IDEMPOTENCY_TEST_POOLER") == "transaction":
        pytest.skip("behind a transaction pooler the test's own connection cannot tell the package's backend")
    calls = []

    @idempotent(key="killed", lease=dt.timedelta(seconds=60), conninfo=conninfo)
    def work():
        calls.append(1)
        db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'pg_idempotency'")
        return "ok"

    assert work() == "ok" and work() == "ok" and calls == [1]
    assert row("killed")[0] == "completed"


def test_connection_from_the_libpq_environment(endpoint, monkeypatch):
    monkeypatch.setenv("PGHOST", endpoint["host"])
    monkeypatch.setenv("PGPORT", endpoint["port"])
    monkeypatch.setenv("PGUSER", "postgres")
    monkeypatch.setenv("PGDATABASE", endpoint["dbname"])
    calls = []

    @idempotent(key="env", ttl=dt.timedelta(minutes=5))
    def f():
        calls.append(1)
        return 1

    assert f() == 1 and f() == 1 and calls == [1]


def test_async_variant(conninfo):
    calls = []

    @idempotent(key="async:{n}", lease=dt.timedelta(seconds=30), wait=dt.timedelta(seconds=10), conninfo=conninfo)
    async def work(n):
        calls.append(n)
        await current_attempt().acheckpoint("half")
        await asyncio.sleep(0.3)
        return {"n": n}

    async def main():
        results = await asyncio.gather(*[work(1) for _ in range(8)], work(2))
        assert results == [{"n": 1}] * 8 + [{"n": 2}]
        assert await work(1) == {"n": 1}
        with pytest.raises(Mismatch):
            await idempotent(key="async:1", conninfo=conninfo)(_other)(5)

    async def _other(x):
        return x

    asyncio.run(main())
    assert sorted(calls) == [1, 2]


def test_detailed_tells_a_replay_and_serializers_handle_common_results(conninfo):
    """A dataclass result raised TypeError after the side effect ran (and the key then waited out
    its lease, to run the side effect again): it is serialized now; `.detailed()` tells a replay
    from a new result; `deserialize` rebuilds the result on a replay."""
    import dataclasses
    import decimal

    @dataclasses.dataclass
    class Receipt:
        id: str
        amount: decimal.Decimal
        at: dt.datetime

    calls = []
    at = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)

    @idempotent(key="dc:{n}", conninfo=conninfo, deserialize=lambda d: Receipt(**d))
    def pay(n):
        calls.append(n)
        return Receipt(f"r-{n}", decimal.Decimal("59.90"), at)

    first = pay.detailed(1)
    assert first.replayed is False and first.outcome == "new" and first.value == Receipt("r-1", decimal.Decimal("59.90"), at)
    again = pay.detailed(1)
    assert again.replayed is True and again.outcome == "replay"
    assert again.value == Receipt("r-1", "59.90", at.isoformat())   # through deserialize, JSON values
    assert pay(1) == again.value and calls == [1]


def test_a_result_that_cannot_be_stored_never_runs_the_side_effect_again(conninfo, row):
    """The side effect ran, the result cannot be serialized: the key is completed with the error,
    so the call and every retry raise Unstorable and the function does not run again."""
    from pg_idempotency import IdempotencyError, Unstorable
    calls = []

    @idempotent(key="unstorable", conninfo=conninfo)
    def charge():
        calls.append(1)
        return object()

    for _ in range(2):
        with pytest.raises(Unstorable) as e:
            charge()
        assert isinstance(e.value, IdempotencyError) and isinstance(e.value, TypeError)
    assert calls == [1]
    assert row("unstorable")[0] == "completed"


@pytest.mark.parametrize("key", ["", "k" * 256])
def test_a_bad_key_is_the_packages_error(conninfo, key):
    """A key the extension refuses was a raw psycopg error: it is InvalidKey (an
    IdempotencyError and a ValueError), before anything runs."""
    from pg_idempotency import IdempotencyError, InvalidKey
    calls = []

    @idempotent(key=lambda: key, conninfo=conninfo)
    def f():
        calls.append(1)

    with pytest.raises(InvalidKey) as e:
        f()
    assert isinstance(e.value, IdempotencyError) and isinstance(e.value, ValueError)
    assert calls == []


def test_a_thread_leaves_no_connection_open(conninfo):
    """Each thread that called a Store left its connection to the garbage collector
    (ResourceWarning: connection was deleted while still open); it is closed when the thread ends."""
    import gc
    import warnings
    store = Store(conninfo)

    @idempotent(key="thread:{n}", store=store)
    def f(n):
        return n

    gc.collect()  # what earlier tests left behind is not this test's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=f, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        del threads, t
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
