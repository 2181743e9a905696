"""Helpers shared by the integration tests: one claim call as SQL, the paths the library reports
taking, and races of real sessions released together by a barrier (the at-most-one-`new` races
of test_concurrency.py, the storms of test_examples.py and test_patterns.py)."""

import threading

import psycopg
from psycopg.types.json import Jsonb

SESSIONS = 24


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
