"""A killed backend never leaves a key stuck: a one-transaction claim vanishes with its
transaction, and a leased claim whose holder died is taken over once the lease runs out."""

import os
import signal
import time

import psycopg

from helpers import claim


def test_terminated_backend_releases_its_one_transaction_claim(connect):
    victim, killer = connect(), connect()
    victim.execute("BEGIN")
    assert claim(victim, "crash-term", {"a": 1})[0] == "new"
    pid = victim.info.backend_pid
    assert claim(killer, "crash-term", {"a": 1})[0] == "in_progress"
    assert killer.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone()[0]
    r = claim(killer, "crash-term", {"a": 1})
    assert r[0] == "new", r


def test_sigkilled_backend_releases_its_one_transaction_claim(cluster, connect):
    victim = connect()
    victim.execute("BEGIN")
    assert claim(victim, "crash-kill", {"a": 1})[0] == "new"
    os.kill(victim.info.backend_pid, signal.SIGKILL)
    # The postmaster resets every backend after a crash; wait until it accepts connections.
    time.sleep(0.5)
    cluster.wait_ready()
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        r = claim(conn, "crash-kill", {"a": 1})
        assert r[0] == "new", r


def test_dead_leased_holder_is_taken_over_after_its_lease(cluster, connect):
    holder = connect()
    first = claim(holder, "crash-lease", {"a": 1}, lease="2 seconds")
    assert first[0] == "new"
    holder.execute("SELECT idempotency.checkpoint('crash-lease', 'charged', token => %s)", (first[1],))
    os.kill(holder.info.backend_pid, signal.SIGKILL)
    time.sleep(0.5)
    cluster.wait_ready()
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        r = claim(conn, "crash-lease", {"a": 1})
        assert r[0] == "in_progress" and r[4].total_seconds() <= 2, r
        time.sleep(2.1)
        r = claim(conn, "crash-lease", {"a": 1})
        assert r[0] == "new" and r[1] > first[1] and r[5] == "charged", r


def test_immediate_shutdown_under_load_keeps_every_acknowledged_completion():
    """pg_ctl -m immediate in the middle of claim/complete load, then restart: every complete
    acknowledged to a client replays; a one-transaction claim that was not committed is gone."""
    import threading

    from cluster import Cluster

    c = Cluster(settings={"fsync": "on"}).start()
    try:
        with psycopg.connect(c.conninfo(), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION idempotency")
        acked, stop = [], threading.Event()

        def load(n):
            try:
                with psycopg.connect(c.conninfo(), autocommit=True) as conn:
                    i = 0
                    while not stop.is_set():
                        key = f"crash-{n}-{i}"
                        with conn.transaction():
                            assert claim(conn, key, {"n": i})[0] == "new"
                            conn.execute("SELECT idempotency.complete(%s, %s)", (key, f'{{"i": {i}}}'))
                        acked.append((key, i))  # the commit returned: acknowledged
                        i += 1
            except psycopg.Error:
                pass  # the server went away mid-request: that request was not acknowledged

        threads = [threading.Thread(target=load, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        time.sleep(2)
        c.stop("immediate")
        stop.set()
        for t in threads:
            t.join(10)
        c.pg_ctl("start", "-w", "-l", c.log)
        assert len(acked) > 100
        with psycopg.connect(c.conninfo(), autocommit=True) as conn:
            for key, i in acked:
                r = claim(conn, key, {"n": i})
                assert r[0] == "replay" and r[2] == {"i": i}, (key, r)
            rows = conn.execute("SELECT count(*), count(*) FILTER (WHERE status = 'in_progress') "
                                "FROM idempotency.idempotency_keys").fetchone()
            assert rows[1] == 0, "a claim that never committed survived the crash"
            assert rows[0] >= len(acked)
    finally:
        c.destroy()
