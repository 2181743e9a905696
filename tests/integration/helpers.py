"""Helpers shared by the integration tests: one claim call as SQL, the paths the library reports
taking, and races of real sessions released together by a barrier (the at-most-one-`new` races
of test_concurrency.py, the storms of test_examples.py and test_patterns.py), and waiting for an
event with a deadline (wait_until) instead of sleeping for a guessed time."""

import threading
import time

import psycopg
from psycopg.types.json import Jsonb

SESSIONS = 24


def wait_until(predicate, timeout=30, interval=0.05, what="the condition"):
    """Calls predicate() until it returns a truthy value and returns that value; fails with an
    AssertionError naming `what` and the last value (or error) after `timeout` seconds. A
    predicate that raises (a server still restarting) counts as not yet true."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            last = predicate()
            if last:
                return last
        except Exception as e:  # e.g. psycopg.OperationalError while a node restarts
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def waiting_pids(conn, pid=None):
    """The backends that wait for a lock held by another session (pg_blocking_pids non-empty),
    or whether backend `pid` does: a session known to block before the test goes on."""
    if pid is not None:
        return conn.execute("SELECT cardinality(pg_blocking_pids(%s)) > 0", (pid,)).fetchone()[0]
    return [r[0] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE cardinality(pg_blocking_pids(pid)) > 0").fetchall()]


def last_sweep_at(conn):
    """The newest stats.last_sweep_at over the cluster's databases (NULL before any round)."""
    return conn.execute("SELECT max(last_sweep_at) FROM idempotency.stats").fetchone()[0]


def race(cluster, worker, n=SESSIONS):
    """Runs worker(conn, i) in n threads, each with its own session, released together."""
    conns = [psycopg.connect(cluster.conninfo(), autocommit=True) for _ in range(n)]
    try:
        return race_sessions(conns, worker)
    finally:
        for c in conns:
            c.close()


def race_sessions(conns, worker):
    """Runs worker(conns[i], i) in one thread per session, released together by a barrier."""
    n = len(conns)
    barrier = threading.Barrier(n)
    results = [None] * n
    errors = []

    def run(i):
        try:
            barrier.wait()
            results[i] = worker(conns[i], i)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def claim(conn, key, request=None, **kw):
    """idempotency.claim(key, request, <kw as named arguments>): (outcome, token, response,
    response_status, retry_after, recovery_point)."""
    args = ", ".join(f"{k} => %({k})s" for k in kw)
    sql = f"SELECT outcome::text, token, response, response_status, retry_after, recovery_point FROM idempotency.claim(%(key)s, %(request)s{', ' if args else ''}{args})"
    return conn.execute(sql, {"key": key, "request": Jsonb(request) if request is not None else None, **kw}).fetchone()


def paths_taken(conn, run):
    """Runs run() in the session `conn` with client_min_messages at debug1 and returns the paths
    the library reported taking, in order: ["claim direct", "complete sql_writes", ...] from its
    lines "idempotency: <call> takes the <path> path" (store::path::Path in the sources)."""
    lines = []

    def note(diagnostic):
        text = diagnostic.message_primary or ""
        if text.startswith("idempotency: ") and text.endswith(" path"):
            call, _, path = text.removeprefix("idempotency: ").removesuffix(" path").partition(" takes the ")
            lines.append(f"{call} {path}")

    conn.add_notice_handler(note)
    conn.execute("SET client_min_messages = debug1")
    try:
        run()
    finally:
        conn.execute("RESET client_min_messages")
        conn.remove_notice_handler(note)
    return lines
