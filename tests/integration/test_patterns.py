"""The five usage patterns of examples/patterns/*.sql, each run as an application role against
a throwaway cluster of its own; where concurrency is the point, with real concurrent sessions
(one thread per session). Every test counts the side effect and asserts it happened once."""

import os
import threading
import time
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from psycopg.types.json import Jsonb

from cluster import Cluster
from helpers import race_sessions

PATTERNS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "patterns")
PATTERNS = ["payment", "webhook", "queue", "workflow", "cron"]
TABLES = [
    "payments.payments", "payments.accounts", "webhooks.invoices", "webhooks.event_log",
    "queue.messages", "queue.dead_letters", "queue.points_ledger", "workflow.external_calls",
    "workflow.external_effects", "workflow.faults", "cronjobs.sales", "cronjobs.daily_totals",
]


def read(name):
    with open(os.path.join(PATTERNS_DIR, f"{name}.sql")) as f:
        return f.read()


@pytest.fixture(scope="module")
def cluster():
    """A cluster of this module's own (it creates the role `app` that grants.sql names)."""
    c = Cluster(dbname="patterns").start()
    try:
        with psycopg.connect(c.conninfo(), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION idempotency")
            conn.execute("CREATE ROLE app LOGIN")
            for _ in range(2):  # every file loads twice without error: idempotent to load
                for name in PATTERNS:
                    conn.execute(read(name))
            conn.execute(read("grants"))
        yield c
    finally:
        c.destroy()


@pytest.fixture(autouse=True)
def fresh_tables(cluster):
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY")
    yield


@pytest.fixture
def app(cluster):
    """Opens sessions as the application role; all are closed after the test."""
    opened = []

    def _open(autocommit=True):
        conn = psycopg.connect(cluster.conninfo().replace("user=postgres", "user=app"), autocommit=autocommit)
        opened.append(conn)
        return conn

    yield _open
    for conn in opened:
        try:
            conn.close()
        except Exception:
            pass


def sessions(app, n, worker):
    """Runs worker(conn, i) in n threads, each with its own application session, released together."""
    return race_sessions([app() for _ in range(n)], worker)


def one(conn, sql, params=None):
    return conn.execute(sql, params).fetchone()[0]


def lookup(db, key, scope):
    """status, token, recovery_point, locked_until and the TTL the row was stored with."""
    return db.execute("SELECT status::text, token, recovery_point, locked_until, "
                      "       expires_at - coalesce(completed_at, created_at) "
                      "FROM idempotency.lookup(%s, %s)", (key, scope)).fetchone()


# ---------------------------------------------------------------------------------------------
# Payment endpoint: client key, 24 h, one transaction


def pay(conn, client, key, request):
    return one(conn, "SELECT payments.create_payment(%s, %s, %s)", (client, key, Jsonb(request)))


def test_payment_retry_replays_and_debits_once(app, db):
    db.execute("INSERT INTO payments.accounts VALUES ('acc-1', 'EUR', 100)")
    a = app()
    req = {"account": "acc-1", "amount": 25, "currency": "EUR"}
    first = pay(a, "client-1", "k1", req)
    assert first["status"] == 201 and "headers" not in first
    # Retries, one with members reordered and 25.0 spelt differently: the stored answer.
    for again in (req, {"currency": "EUR", "amount": 25.0, "account": "acc-1"}):
        r = pay(a, "client-1", "k1", again)
        assert (r["status"], r["body"], r["headers"]) == (201, first["body"], {"Idempotent-Replayed": "true"})
    assert pay(a, "client-1", "k1", {**req, "amount": 30})["status"] == 422
    assert pay(a, "client-1", None, req)["status"] == 400
    assert pay(a, "client-1", "x" * 256, req)["status"] == 400
    # A malformed request is refused before anything is claimed.
    for bad in ({"account": "acc-1", "amount": "25", "currency": "EUR"}, {"account": "acc-1", "amount": -5, "currency": "EUR"},
                {"amount": 25, "currency": "EUR"}, None):
        assert pay(a, "client-1", "k-bad", bad)["status"] == 400
    assert lookup(db, "k-bad", "POST /payments client-1") == (None,) * 5
    assert one(db, "SELECT balance FROM payments.accounts") == 75
    assert one(db, "SELECT count(*) FROM payments.payments") == 1
    status, _, _, _, ttl = lookup(db, "k1", "POST /payments client-1")
    assert status == "completed" and ttl == timedelta(hours=24)


def test_payment_business_refusal_is_stored_and_replayed(app, db):
    db.execute("INSERT INTO payments.accounts VALUES ('acc-2', 'EUR', 10)")
    a = app()
    req = {"account": "acc-2", "amount": 50, "currency": "EUR"}
    assert pay(a, "client-1", "k2", req)["status"] == 402
    db.execute("UPDATE payments.accounts SET balance = 1000")
    # Same key, same request: the same answer, even though it would now succeed.
    r = pay(a, "client-1", "k2", req)
    assert r["status"] == 402 and r["headers"] == {"Idempotent-Replayed": "true"}
    assert pay(a, "client-1", "k3", req)["status"] == 201   # a new key is a new payment
    assert pay(a, "client-1", "k4", {**req, "account": "nope"})["status"] == 404
    assert one(db, "SELECT balance FROM payments.accounts") == 950


def test_payment_rolled_back_attempt_leaves_the_key_new(app, db):
    db.execute("INSERT INTO payments.accounts VALUES ('acc-3', 'EUR', 100)")
    a = app(autocommit=False)
    req = {"account": "acc-3", "amount": 40, "currency": "EUR"}
    assert pay(a, "client-1", "k5", req)["status"] == 201
    a.rollback()                 # the request failed after the payment (e.g. the response was lost)
    assert lookup(db, "k5", "POST /payments client-1") == (None,) * 5
    assert one(db, "SELECT balance FROM payments.accounts") == 100
    r = pay(a, "client-1", "k5", req)
    a.commit()
    assert r["status"] == 201 and "headers" not in r
    assert one(db, "SELECT balance FROM payments.accounts") == 60
    assert one(db, "SELECT count(*) FROM payments.payments") == 1


def test_payment_concurrent_retries_charge_once(app, db):
    db.execute("INSERT INTO payments.accounts VALUES ('acc-4', 'EUR', 1000)")
    req = {"account": "acc-4", "amount": 7, "currency": "EUR"}

    def client(conn, i):
        answers = []
        while True:  # a well-behaved client: retry on 409 until it gets an answer
            r = pay(conn, "client-9", "storm", req)
            answers.append(r["status"])
            if r["status"] != 409:
                return answers, r["body"]
            time.sleep(0.02)

    results = sessions(app, 12, client)
    statuses = [s for answers, _ in results for s in answers]
    assert set(statuses) <= {201, 409} and statuses.count(201) == 12
    assert len({str(body) for _, body in results}) == 1      # everyone got the same payment
    assert one(db, "SELECT count(*) FROM payments.payments") == 1
    assert one(db, "SELECT balance FROM payments.accounts") == 993


# ---------------------------------------------------------------------------------------------
# Webhook inbox: event id, scope = provider, 7 days


def deliver(conn, provider, payload):
    return one(conn, "SELECT webhooks.receive(%s, %s)", (provider, Jsonb(payload)))


def paid_event(event_id, invoice, amount, attempt=1):
    return {"id": event_id, "type": "invoice.paid", "data": {"invoice": invoice, "amount": amount},
            "delivery_attempt": attempt}


def test_webhook_duplicate_delivery_is_200_and_does_nothing(app, db):
    db.execute("INSERT INTO webhooks.invoices (id, amount_due) VALUES ('in_1', 100)")
    a = app()
    assert deliver(a, "stripe", paid_event("evt_1", "in_1", 60, attempt=1))["status"] == 200
    for attempt in (2, 3):
        r = deliver(a, "stripe", paid_event("evt_1", "in_1", 60, attempt=attempt))
        assert r["status"] == 200 and r["headers"] == {"Idempotent-Replayed": "true"}
    assert db.execute("SELECT amount_paid, status FROM webhooks.invoices").fetchone() == (60, "partially_paid")
    assert one(db, "SELECT count(*) FROM webhooks.event_log") == 1
    # The same id from another provider is another event; the same id with other content is refused.
    assert deliver(a, "github", {"id": "evt_1", "type": "ping"})["status"] == 200
    assert deliver(a, "stripe", paid_event("evt_1", "in_1", 99))["status"] == 422
    assert deliver(a, "stripe", {"type": "ping"})["status"] == 400
    assert one(db, "SELECT count(*) FROM webhooks.event_log") == 2
    status, _, _, _, ttl = lookup(db, "evt_1", "stripe")
    assert status == "completed" and ttl == timedelta(days=7)


def test_webhook_delivery_during_processing_gets_409_not_200(app, db):
    db.execute("INSERT INTO webhooks.invoices (id, amount_due) VALUES ('in_2', 100)")
    first, second = app(autocommit=False), app()
    assert deliver(first, "stripe", paid_event("evt_2", "in_2", 100))["status"] == 200   # not committed
    r = deliver(second, "stripe", paid_event("evt_2", "in_2", 100, attempt=2))
    assert r["status"] == 409 and int(r["headers"]["Retry-After"]) >= 1
    first.rollback()             # the first copy failed: had the second been told 200, the event was lost
    assert deliver(second, "stripe", paid_event("evt_2", "in_2", 100, attempt=3))["status"] == 200
    assert db.execute("SELECT amount_paid, status FROM webhooks.invoices").fetchone() == (100, "paid")
    assert one(db, "SELECT count(*) FROM webhooks.event_log") == 1


def test_webhook_concurrent_redeliveries_process_once(app, db):
    db.execute("INSERT INTO webhooks.invoices (id, amount_due) VALUES ('in_3', 500)")

    def provider(conn, i):
        statuses = []
        while True:  # the provider redelivers until it gets a 2xx
            statuses.append(deliver(conn, "stripe", paid_event("evt_3", "in_3", 125, attempt=i))["status"])
            if statuses[-1] == 200:
                return statuses
            time.sleep(0.02)

    results = sessions(app, 10, provider)
    assert {s for r in results for s in r} <= {200, 409}
    assert db.execute("SELECT amount_paid FROM webhooks.invoices").fetchone() == (125,)
    assert one(db, "SELECT count(*) FROM webhooks.event_log") == 1


# ---------------------------------------------------------------------------------------------
# Queue consumer: message id, visibility x max deliveries


HANDLE = "SELECT queue.handle(m, %s, visibility => '2 seconds') FROM queue.receive('2 seconds') AS m"


def test_queue_two_consumers_receiving_one_message_process_it_once(app, db):
    a = app()
    body = {"customer": "cust-1", "points": 50}
    one(a, "SELECT queue.publish('msg-1', %s)", (Jsonb(body),))
    one(a, "SELECT queue.publish('msg-1', %s)", (Jsonb(body),))   # the producer published it twice
    c1, c2 = app(autocommit=False), app()
    assert one(c1, HANDLE, ("c1",)) == "processed"                 # c1 is still in its transaction
    assert one(c2, HANDLE, ("c2",)) == "requeued"                  # c2 got the duplicate meanwhile
    hidden = one(db, "SELECT visible_at - now() FROM queue.messages WHERE id = 2")
    assert timedelta(seconds=0.5) <= hidden <= timedelta(seconds=2)  # requeued with retry_after (>= 1 s)
    c1.commit()
    assert one(db, "SELECT count(*) FROM queue.messages") == 1
    time.sleep(hidden.total_seconds() + 0.1)
    assert one(c2, HANDLE, ("c2",)) == "acked_duplicate"           # replay: ack, no work
    assert one(db, "SELECT count(*) FROM queue.messages") == 0
    assert db.execute("SELECT count(*), sum(points) FROM queue.points_ledger").fetchone() == (1, 50)
    status, _, _, _, ttl = lookup(db, "msg-1", "queue:points")
    assert status == "completed" and ttl == timedelta(seconds=10)  # visibility 2 s x 5 deliveries


def test_queue_consumer_loops_process_each_message_once(app, db):
    a = app()
    n = 30
    for i in range(n):
        body = {"customer": f"cust-{i % 7}", "points": i + 1, "work_ms": 20}
        for _ in range(2):       # every message is delivered twice, back to back
            one(a, "SELECT queue.publish(%s, %s)", (f"m-{i}", Jsonb(body)))

    def consumer(conn, i):
        return one(conn, "CALL queue.consume(%s, NULL, visibility => '1 second', run_for => '60 seconds')",
                   (f"consumer-{i}",))

    counts = sessions(app, 4, consumer)
    total = {k: sum(c.get(k, 0) for c in counts) for k in ("processed", "acked_duplicate", "requeued", "dead_lettered")}
    assert total["processed"] == n and total["acked_duplicate"] == n and total["dead_lettered"] == 0, counts
    assert one(db, "SELECT count(*) FROM queue.messages") == 0
    assert db.execute("SELECT count(*), count(DISTINCT message_id), sum(points) FROM queue.points_ledger").fetchone() \
        == (n, n, n * (n + 1) // 2)
    print(f"queue storm: {counts}")


def test_queue_reused_id_and_poison_message_are_dead_lettered(app, db):
    a = app()
    one(a, "SELECT queue.publish('msg-7', %s)", (Jsonb({"customer": "c", "points": 1}),))
    assert one(a, HANDLE, ("c1",)) == "processed"
    one(a, "SELECT queue.publish('msg-7', %s)", (Jsonb({"customer": "c", "points": 1000}),))
    assert one(a, HANDLE, ("c1",)) == "dead_lettered"
    one(a, "SELECT queue.publish('msg-8', %s)", (Jsonb({"customer": "c", "points": 2}),))
    db.execute("UPDATE queue.messages SET deliveries = 5")   # it was handed out 5 times already
    assert one(a, HANDLE, ("c1",)) == "dead_lettered"
    assert db.execute("SELECT message_id, reason FROM queue.dead_letters ORDER BY id").fetchall() == [
        ("msg-7", "message id reused for another body"), ("msg-8", "too many deliveries")]
    assert db.execute("SELECT count(*), sum(points) FROM queue.points_ledger").fetchone() == (1, 1)
    assert one(a, HANDLE, ("c1",)) is None                          # an empty queue: nothing to do


# ---------------------------------------------------------------------------------------------
# Workflow: derived keys per step, checkpoints, leased


PARAMS = {"items": [{"sku": "A1", "qty": 2}], "amount": 30, "address": "1 Main St"}
FULFIL = "CALL workflow.fulfil_order(%s, %s, NULL, lease => %s)"


def calls(db):
    return dict(db.execute("SELECT system, count(*) FROM workflow.external_calls GROUP BY 1").fetchall())


def effects(db):
    return dict(db.execute("SELECT system, count(*) FROM workflow.external_effects GROUP BY 1").fetchall())


def run_in_thread(fn):
    box = {}

    def target():
        try:
            box["result"] = fn()
        except Exception as e:
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    return t, box


def wait_for(cond, timeout=20):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_workflow_crash_in_step_2_resumes_without_redoing_step_1(app, db):
    db.execute("INSERT INTO workflow.faults (step, action) VALUES ('charge', 'hang')")
    worker = app()
    pid = one(worker, "SELECT pg_backend_pid()")
    t, box = run_in_thread(lambda: one(worker, FULFIL, ("o-1", Jsonb(PARAMS), "3 seconds")))
    # The worker has charged (the provider committed) and hangs before its checkpoint: kill it.
    wait_for(lambda: one(db, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event = 'PgSleep'", (pid,)))
    assert one(db, "SELECT pg_terminate_backend(%s)", (pid,))
    t.join(10)
    assert "error" in box
    db.execute("DELETE FROM workflow.faults")
    status, token, rp, locked_until, _ = lookup(db, "order:o-1", "workflow:fulfil")
    assert (status, rp) == ("in_progress", "reserved") and calls(db) == {"inventory": 1, "payments": 1}

    retry = app()
    if one(db, "SELECT %s > clock_timestamp() + interval '0.5 seconds'", (locked_until,)):
        r = one(retry, FULFIL, ("o-1", Jsonb(PARAMS), "3 seconds"))   # the lease still runs
        assert r["status"] == "running" and r["retry_after_s"] >= 1
    wait_for(lambda: one(db, "SELECT %s <= now()", (locked_until,)))
    r = one(retry, FULFIL, ("o-1", Jsonb(PARAMS), "3 seconds"))       # takeover at 'reserved'
    assert r["status"] == "fulfilled" and r["charge"].startswith("payments-")
    # Step 1 was not redone; step 2 was re-sent with the same derived key and done once.
    assert calls(db) == {"inventory": 1, "payments": 2, "shipping": 1}
    assert effects(db) == {"inventory": 1, "payments": 1, "shipping": 1}
    assert one(db, "SELECT count(DISTINCT idempotency_key) FROM workflow.external_calls WHERE system = 'payments'") == 1
    status, new_token, rp, _, ttl = lookup(db, "order:o-1", "workflow:fulfil")
    assert status == "completed" and new_token > token
    assert ttl == timedelta(hours=72)
    # Done: a later call replays the result and calls nobody.
    assert one(retry, FULFIL, ("o-1", Jsonb(PARAMS), "3 seconds")) == r
    assert calls(db) == {"inventory": 1, "payments": 2, "shipping": 1}
    assert one(retry, FULFIL, ("o-1", Jsonb({**PARAMS, "amount": 31}), "3 seconds")) == {"status": "mismatch"}


def test_workflow_error_in_last_step_resumes_there(app, db):
    db.execute("INSERT INTO workflow.faults (step, action) VALUES ('ship', 'error')")
    a = app()
    with pytest.raises(psycopg.errors.RaiseException, match="injected fault in step ship"):
        a.execute(FULFIL, ("o-2", Jsonb(PARAMS), "1 second"))
    assert lookup(db, "order:o-2", "workflow:fulfil")[2] == "charged"
    db.execute("DELETE FROM workflow.faults")
    time.sleep(1.1)
    assert one(a, FULFIL, ("o-2", Jsonb(PARAMS), "1 second"))["status"] == "fulfilled"
    assert calls(db) == {"inventory": 1, "payments": 1, "shipping": 2}
    assert effects(db) == {"inventory": 1, "payments": 1, "shipping": 1}


def test_workflow_stale_worker_is_fenced_off(app, db):
    # Worker A is stuck after reserving until long after its lease; B takes over and finishes.
    db.execute("INSERT INTO workflow.faults (step, action, seconds) VALUES ('reserve', 'hang', 5)")
    a, b = app(), app()
    pid = one(a, "SELECT pg_backend_pid()")
    t, box = run_in_thread(lambda: one(a, FULFIL, ("o-3", Jsonb(PARAMS), "1 second")))
    wait_for(lambda: one(db, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event = 'PgSleep'", (pid,)))
    db.execute("DELETE FROM workflow.faults")
    time.sleep(1.1)
    r = one(b, FULFIL, ("o-3", Jsonb(PARAMS), "1 minute"))
    assert r["status"] == "fulfilled"
    t.join(10)
    assert box == {"result": {"status": "fenced"}}       # A's checkpoint was refused: it stopped
    assert calls(db) == {"inventory": 2, "payments": 1, "shipping": 1}
    assert effects(db) == {"inventory": 1, "payments": 1, "shipping": 1}


# ---------------------------------------------------------------------------------------------
# Cron job: cron_key(job, scheduled_at, slot)


JOB = "SELECT cronjobs.daily_totals_job(%s, %s)"


def test_cron_schedulers_firing_one_slot_run_it_once_and_the_next_slot_again(app, db):
    day = datetime(2026, 11, 29, tzinfo=timezone.utc)
    db.execute("INSERT INTO cronjobs.sales (sold_at, amount) SELECT %s + i * interval '1 hour', 10 "
               "FROM generate_series(0, 23) i", (day,))
    db.execute("INSERT INTO cronjobs.sales (sold_at, amount) VALUES (%s, 5)", (day + timedelta(days=1, hours=3),))
    slot = datetime(2026, 11, 30, 0, 0, tzinfo=timezone.utc)

    # Eight schedulers fire the same slot at once, each at its own second of the slot.
    answers = sessions(app, 8, lambda conn, i: one(conn, JOB, (slot + timedelta(seconds=i), f"s{i}")))
    assert answers.count("ran") == 1, answers
    assert all(a in ("ran", "skipped: running elsewhere", "skipped: done in this slot") for a in answers)
    rows = db.execute("SELECT slot_key, day, sales, total FROM cronjobs.daily_totals").fetchall()
    assert rows == [("daily-totals:2026-11-30T00:00:00Z/P1D", day.date(), 24, 240)]
    # A late firing in the same slot is skipped; the next slot runs again.
    assert one(app(), JOB, (slot + timedelta(hours=23, minutes=59), "late")) == "skipped: done in this slot"
    answers = sessions(app, 4, lambda conn, i: one(conn, JOB, (slot + timedelta(days=1, seconds=i), f"s{i}")))
    assert answers.count("ran") == 1, answers
    assert db.execute("SELECT day, sales, total FROM cronjobs.daily_totals ORDER BY day").fetchall()[1:] == [
        ((day + timedelta(days=1)).date(), 1, 5)]
    status, _, _, _, ttl = lookup(db, "daily-totals:2026-11-30T00:00:00Z/P1D", "cron")
    assert status == "completed" and ttl == timedelta(days=2)


def test_cron_failed_run_is_run_again_in_the_same_slot(app, db):
    slot = datetime(2026, 12, 5, 1, 0, tzinfo=timezone.utc)
    first = app(autocommit=False)
    assert one(first, JOB, (slot, "s1")) == "ran"
    assert one(app(), JOB, (slot, "s2")) == "skipped: running elsewhere"
    first.rollback()                                  # the run failed: its claim went with it
    assert one(app(), JOB, (slot + timedelta(minutes=5), "s2")) == "ran"
    assert one(db, "SELECT count(*) FROM cronjobs.daily_totals") == 1
