"""The client packages' examples (clients/python/examples/send_receipt.py with pg-idempotency over
psycopg 3, clients/node/examples/send_receipt.js with pg-idempotency over `pg`) run as real processes against a throwaway cluster (and through PgBouncer in transaction mode): a
failed send, a crash, a retry and two concurrent runs each end with the receipt sent exactly
once."""

import json
import os
import subprocess
import sys
import time

import pytest

from pooler import PgBouncer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CLIENTS = {
    "python": [sys.executable, os.path.join(ROOT, "clients", "python", "examples", "send_receipt.py")],
    "node": ["node", os.path.join(ROOT, "clients", "node", "examples", "send_receipt.js")],
}
# The Python package from its source tree (its only dependency, psycopg, is the suite's own).
PYTHON_CLIENT_SRC = os.path.join(ROOT, "clients", "python", "src")


@pytest.fixture
def bouncer(cluster, db):
    b = PgBouncer(cluster, "transaction", pool_size=4).start()
    yield b
    b.stop()
    # The pooler's server connections carry the example's application_name, which the other
    # tests count: gone before the next test.
    deadline = time.monotonic() + 10
    while db.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'send_receipt'").fetchone()[0]:
        assert time.monotonic() < deadline, "the pooler's server connections outlived it"
        time.sleep(0.05)


@pytest.fixture(params=sorted(CLIENTS))
def client(request, cluster, tmp_path):
    return example(request.param, cluster.dir, cluster.port, cluster.dbname, tmp_path)


@pytest.fixture(params=sorted(CLIENTS))
def pooled_client(request, bouncer, tmp_path):
    """The example through PgBouncer in transaction mode."""
    return example(request.param, "127.0.0.1", bouncer.port, bouncer.cluster.dbname, tmp_path)


def example(name, host, port, dbname, tmp_path):
    if name == "node":
        assert os.path.isdir(os.path.join(ROOT, "clients", "node", "node_modules", "pg")), \
            "run scripts/bootstrap.sh (npm ci in clients/node)"
    env = {**os.environ, "PGHOST": host, "PGPORT": str(port), "PGUSER": "postgres",
           "PGDATABASE": dbname,
           "PYTHONPATH": os.pathsep.join(filter(None, [PYTHON_CLIENT_SRC, os.environ.get("PYTHONPATH")]))}
    outbox = str(tmp_path / "outbox.log")

    def run(key, *extra, to="alice@example.com", wait=True):
        cmd = CLIENTS[name] + ["--key", key, "--to", to, "--outbox", outbox, *extra]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return finish(p) if wait else p

    def sent():
        if not os.path.exists(outbox):
            return []
        with open(outbox) as f:
            return [json.loads(line) for line in f]

    run.sent = sent
    return run


def finish(p):
    out, err = p.communicate(timeout=60)
    result = json.loads(out.strip().splitlines()[-1]) if p.returncode == 0 else None
    return p.returncode, result, err


def state(db, key):
    return db.execute("SELECT status::text, recovery_point FROM idempotency.lookup(%s, 'receipts')", (key,)).fetchone()


def test_failed_send_releases_then_retry_sends_once(client, db):
    rc, _, err = client("order-1", "--fail-send")
    assert rc == 1 and "key released" in err
    assert client.sent() == [] and state(db, "order-1") == (None, None)
    rc, first, _ = client("order-1")                     # the retry sends
    assert rc == 0 and first["outcome"] == "new"
    rc, again, _ = client("order-1")                     # a retry after success: replay
    assert rc == 0 and again == {"outcome": "replay", "response": first["response"]}
    assert [m["message_id"] for m in client.sent()] == ["order-1:email"]
    rc, _, err = client("order-1", to="mallory@example.com")   # same key, another receipt
    assert rc == 3 and "different receipt" in err
    assert len(client.sent()) == 1 and state(db, "order-1") == ("completed", "sent")


def test_crash_after_checkpoint_resumes_without_sending_again(client, db):
    rc, _, _ = client("order-2", "--crash-after", "checkpoint", "--lease", "1")
    assert rc == 70 and len(client.sent()) == 1
    assert state(db, "order-2") == ("in_progress", "sent")
    rc, result, _ = client("order-2", "--lease", "1")    # waits out the lease, takes over at 'sent'
    assert rc == 0 and result["outcome"] == "new"
    assert len(client.sent()) == 1 and state(db, "order-2") == ("completed", "sent")
    assert client("order-2")[1]["outcome"] == "replay"


def test_two_runs_at_once_send_once(client, db):
    procs = [client("order-3", "--effect-seconds", "1", "--lease", "5", wait=False) for _ in range(2)]
    results = [finish(p) for p in procs]
    assert [rc for rc, _, _ in results] == [0, 0], results
    assert sorted(r["outcome"] for _, r, _ in results) == ["new", "replay"]
    assert results[0][1]["response"] == results[1][1]["response"]
    assert len(client.sent()) == 1


def test_through_a_transaction_pooler_runs_at_once_and_again_send_once(pooled_client, db):
    # The second run polls the key (wait) while the first sends: many statements on one client
    # connection, each transaction on whichever server connection the pooler gives.
    procs = [pooled_client("order-p", "--effect-seconds", "1", "--lease", "5", wait=False) for _ in range(2)]
    results = [finish(p) for p in procs]
    assert [rc for rc, _, _ in results] == [0, 0], results
    assert sorted(r["outcome"] for _, r, _ in results) == ["new", "replay"]
    for _ in range(3):
        rc, again, err = pooled_client("order-p")
        assert rc == 0 and again["outcome"] == "replay", err
    assert len(pooled_client.sent()) == 1 and state(db, "order-p")[0] == "completed"


def test_lost_connection_after_the_claim_finishes_with_its_own_token(client, db):
    proc = client("order-4", "--effect-seconds", "3", "--lease", "30", wait=False)
    deadline = time.time() + 20
    while state(db, "order-4")[0] != "in_progress":       # claimed and committed: now sending
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    killed = db.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = 'send_receipt'").fetchone()[0]
    assert killed == 1
    rc, result, err = finish(proc)
    # It reconnected and checkpointed and completed with its token: no second send, and no
    # wait for its own 30-second lease.
    assert rc == 0 and result["outcome"] == "new" and "reconnecting" in err, err
    assert len(client.sent()) == 1 and state(db, "order-4") == ("completed", "sent")
