"""The background sweeper, in a cluster with shared_preload_libraries = 'idempotency'."""

import os
import signal
import threading
import time

import psycopg
import pytest

from cluster import Cluster
from helpers import claim


@pytest.fixture(scope="module")
def preloaded():
    c = Cluster(settings={
        "shared_preload_libraries": "'idempotency'",
        "idempotency.sweep_interval": "'1s'",
        "max_worker_processes": "16",
    }).start()
    with psycopg.connect(c.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION idempotency")
        conn.execute("CREATE DATABASE second")
        conn.execute("CREATE DATABASE plain")  # never gets the extension
    with psycopg.connect(c.conninfo().replace("dbname=idem", "dbname=second"), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION idempotency")
    yield c
    c.destroy()


def connect(cluster, db="idem"):
    return psycopg.connect(cluster.conninfo().replace("dbname=idem", f"dbname={db}"), autocommit=True)


def wait_for(predicate, timeout=15.0, step=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def seed(conn, prefix, expired, live):
    conn.execute(
        "SELECT idempotency.claim(%s || i, ttl => '1 hour') FROM generate_series(1, %s) i", (prefix + "-live-", live)
    )
    conn.execute(
        "SELECT idempotency.claim(%s || i, ttl => '1 hour') FROM generate_series(1, %s) i", (prefix + "-old-", expired)
    )
    conn.execute(
        # Claimed a TTL and a minute ago: the sweep index is on the claim-time expiry, created_at + ttl.
        "UPDATE idempotency.idempotency_keys SET created_at = now() - ttl - interval '1 minute', "
        "expires_at = now() - interval '1 minute' WHERE key LIKE %s",
        (prefix + "-old-%",),
    )


def count(conn, pattern):
    return conn.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key LIKE %s", (pattern,)).fetchone()[0]


def launcher_pid(conn):
    row = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency launcher'"
    ).fetchone()
    return row[0] if row else None


def test_expired_rows_vanish_in_every_database_live_rows_stay(preloaded):
    with connect(preloaded) as a, connect(preloaded, "second") as b:
        seed(a, "a", expired=500, live=20)
        seed(b, "b", expired=300, live=10)
        assert wait_for(lambda: count(a, "a-old-%") == 0 and count(b, "b-old-%") == 0)
        assert count(a, "a-live-%") == 20 and count(b, "b-live-%") == 10
        stats = a.execute("SELECT sweeper_enabled, rows_swept >= 500, last_sweep_at IS NOT NULL FROM idempotency.stats").fetchone()
        assert stats == (True, True, True)


def test_launcher_is_visible_and_databases_without_the_extension_cost_nothing(preloaded):
    with connect(preloaded) as a:
        assert launcher_pid(a) is not None
        # The launcher is connected to no database; sweepers come and go per database.
        assert a.execute("SELECT datname FROM pg_stat_activity WHERE backend_type = 'idempotency launcher'").fetchone()[0] is None
    # Sweepers ran in "plain" (no extension) and in "postgres" without failing.
    log = preloaded.server_log()
    assert "ERROR" not in log and "FATAL" not in log, log[-2000:]


def xact_commits(conn, db):
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (db,)).fetchone()[0]


def test_a_database_without_the_extension_is_not_visited(preloaded):
    with connect(preloaded) as a:
        time.sleep(2.5)  # the first rounds have visited every database
        plain, second = xact_commits(a, "plain"), xact_commits(a, "second")
        time.sleep(3.5)  # three more rounds
        assert xact_commits(a, "plain") == plain, "the sweeper kept visiting a database without the extension"
        assert xact_commits(a, "second") > second, "the sweeper stopped visiting a database with it"


def test_extension_created_and_dropped_later_is_noticed(preloaded):
    with connect(preloaded) as a:
        a.execute("CREATE DATABASE late")
    time.sleep(2.5)  # visited and found without the extension: no longer visited...
    with connect(preloaded, "late") as late:
        late.execute("CREATE EXTENSION idempotency")  # ...until CREATE EXTENSION announces it
        seed(late, "late", expired=50, live=5)
        assert wait_for(lambda: count(late, "late-old-%") == 0)
        late.execute("DROP EXTENSION idempotency")
    time.sleep(2.5)  # a few rounds over a database without the extension
    with connect(preloaded) as a:
        # DROP DATABASE is not held up by the sweeper.
        started = time.monotonic()
        a.execute("DROP DATABASE late")
        assert time.monotonic() - started < 5


def test_drop_database_gives_way_during_a_long_sweep(preloaded):
    with connect(preloaded) as a:
        a.execute("CREATE DATABASE doomed")
    with connect(preloaded, "doomed") as d:
        d.execute("CREATE EXTENSION idempotency")
        d.execute("""INSERT INTO idempotency.idempotency_keys (key, status, token, expires_at, ttl, locked_until,
                                                           created_at)
                     SELECT 'x' || i, 'in_progress', i, now() - interval '1 minute', interval '1 hour', now(),
                            now() - interval '61 minutes'
                       FROM generate_series(1, 300000) i""")
    with connect(preloaded) as a:
        assert wait_for(lambda: a.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency sweeper' AND datname = 'doomed'"
        ).fetchone()[0] > 0, timeout=5, step=0.02)
        a.execute("DROP DATABASE doomed")  # waits at most 5 s for other sessions, else fails


def test_an_error_in_one_database_does_not_stop_the_others(preloaded):
    with connect(preloaded) as a:
        a.execute("CREATE DATABASE broken")
    with connect(preloaded, "broken") as br, connect(preloaded, "second") as b:
        br.execute("CREATE EXTENSION idempotency")
        seed(br, "br", expired=20, live=0)
        # Break the sweep there: its DELETE now fails on every attempt.
        br.execute("""CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS
                      $$BEGIN RAISE EXCEPTION 'sweeping refused for the test'; END$$""")
        br.execute("""CREATE TRIGGER refuse BEFORE DELETE ON idempotency.idempotency_keys
                      FOR EACH ROW EXECUTE FUNCTION public.refuse()""")
        seed(b, "other", expired=25, live=0)
        assert wait_for(lambda: count(b, "other-old-%") == 0), "other databases are still swept"
        assert count(br, "br-old-%") == 20
        assert wait_for(lambda: "sweeping refused for the test" in preloaded.server_log(), timeout=5)
        # Mended, the next round sweeps it.
        br.execute("DROP TRIGGER refuse ON idempotency.idempotency_keys")
        assert wait_for(lambda: count(br, "br-old-%") == 0)
    with connect(preloaded) as a:
        a.execute("DROP DATABASE broken")


def test_reload_applies_new_settings(preloaded):
    with connect(preloaded) as a:
        a.execute("ALTER SYSTEM SET idempotency.sweep_interval = '1h'")
        a.execute("SELECT pg_reload_conf()")
        time.sleep(2.5)  # let the current round finish
        seed(a, "reload", expired=40, live=0)
        time.sleep(3)
        assert count(a, "reload-old-%") == 40, "swept although the interval is one hour"
        a.execute("ALTER SYSTEM SET idempotency.sweep_interval = '1s'")
        a.execute("ALTER SYSTEM SET idempotency.sweep_batch_size = 7")
        a.execute("SELECT pg_reload_conf()")
        assert wait_for(lambda: count(a, "reload-old-%") == 0, timeout=10)
        assert a.execute("SHOW idempotency.sweep_batch_size").fetchone()[0] == "7"
        a.execute("ALTER SYSTEM RESET idempotency.sweep_batch_size")
        a.execute("SELECT pg_reload_conf()")


def test_sweep_delay_paces_a_backlog(preloaded):
    def drain_seconds(delay):
        with connect(preloaded) as a:
            a.execute("ALTER SYSTEM SET idempotency.sweep_batch_size = 100")
            a.execute("ALTER SYSTEM SET idempotency.sweep_delay = %s" % repr(delay))
            a.execute("SELECT pg_reload_conf()")
            time.sleep(1.5)
            seed(a, f"paced-{delay}", expired=1000, live=0)
            started = time.monotonic()
            assert wait_for(lambda: count(a, f"paced-{delay}-old-%") == 0, timeout=30)
            return time.monotonic() - started

    try:
        assert drain_seconds("0") < 2.5  # ten batches at once
        # Ten batches and nine pauses: after the first (it cannot yet know the server is idle)
        # four times the delay, after the others a fifth of it: 4 + 8 x 0.2 s.
        assert drain_seconds("1s") > 5.2
    finally:
        with connect(preloaded) as a:
            a.execute("ALTER SYSTEM RESET idempotency.sweep_batch_size")
            a.execute("ALTER SYSTEM RESET idempotency.sweep_delay")
            a.execute("SELECT pg_reload_conf()")



def test_reloads_do_not_make_a_busy_server_look_idle(preloaded):
    """A reload wakes the sweeper in the middle of its pause, a moment after its batch: that
    short look sees little of the application's WAL, which must not count as an idle server
    (it sent full batches into the load). Only a whole quiet pause does."""
    with connect(preloaded) as a:
        a.execute("CREATE TABLE IF NOT EXISTS trickle (pad text)")
        a.execute("ALTER SYSTEM SET idempotency.sweep_batch_size = 2000")
        a.execute("ALTER SYSTEM SET idempotency.sweep_delay = '500ms'")
        a.execute("SELECT pg_reload_conf()")
        stop = threading.Event()

        def write():
            # About 30 KB of WAL a second: many pages in a whole pause of 2 s, less than a page
            # in the 100 ms between two reloads.
            with connect(preloaded) as w:
                while not stop.is_set():
                    w.execute("INSERT INTO trickle SELECT repeat('x', 500)")
                    time.sleep(0.02)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            time.sleep(1.5)
            seed(a, "reload", expired=20000, live=0)
            assert count(a, "reload-old-%") >= 20000 - 100  # seeded (a first batch may be gone)
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                a.execute("SELECT pg_reload_conf()")
                time.sleep(0.1)
            left = count(a, "reload-old-%")
        finally:
            stop.set()
            writer.join()
            a.execute("DROP TABLE IF EXISTS trickle")
            a.execute("ALTER SYSTEM RESET idempotency.sweep_batch_size")
            a.execute("ALTER SYSTEM RESET idempotency.sweep_delay")
            a.execute("SELECT pg_reload_conf()")
        # Busy throughout: at most a slice of 100 rows per reload (about 4,000); taken for idle,
        # full batches of 2,000 would have swept them all.
        assert left > 12000, left
        assert wait_for(lambda: count(a, "reload-old-%") == 0, timeout=30)

@pytest.mark.slow  # a backlog swept under claim load: 20-35 s
def test_sweeper_yields_to_sessions_that_write(preloaded):
    """While other sessions write WAL the sweeper deletes a hundredth of a batch (at least 100
    rows) at a time, with four times the pause; on an idle server it deletes full batches with a
    fifth of the pause."""
    def seeded(a, prefix):
        a.execute("SELECT pg_reload_conf()")
        time.sleep(1.5)
        seed(a, prefix, expired=20000, live=0)
        return time.monotonic()

    with connect(preloaded) as a:
        a.execute("CREATE TABLE IF NOT EXISTS filler (n int, pad text)")
        a.execute("ALTER SYSTEM SET idempotency.sweep_batch_size = 2000")
        a.execute("ALTER SYSTEM SET idempotency.sweep_delay = '500ms'")
        try:
            # Idle: a first batch of 100 rows (it cannot yet know the server is idle) and its
            # pause of 2 s, then ten full batches with nine pauses of 100 ms (of 500 ms each
            # before 0.4.0: at least 6.5 s in all).
            started = seeded(a, "idle")
            assert count(a, "idle-old-%") >= 20000 - 100  # seeded (a first batch may be gone)
            assert wait_for(lambda: count(a, "idle-old-%") == 0, timeout=20)
            idle_seconds = time.monotonic() - started
            assert idle_seconds < 5.5, idle_seconds

            stop = threading.Event()

            def write():
                with connect(preloaded) as w:
                    while not stop.is_set():
                        w.execute("INSERT INTO filler SELECT g, repeat('x', 200) FROM generate_series(1, 50) g")
                        time.sleep(0.005)

            writer = threading.Thread(target=write)
            writer.start()
            try:
                started = seeded(a, "busy")
                time.sleep(max(idle_seconds, 4.0))
                left = count(a, "busy-old-%")
            finally:
                stop.set()
                writer.join()
            # Idle, it had swept them all by now; yielding, one full batch at most before it
            # noticed the writer, then batches of 100 every two seconds.
            assert left > 10000, (left, idle_seconds)
            # Once the writer is gone it is back to full batches.
            assert wait_for(lambda: count(a, "busy-old-%") == 0, timeout=idle_seconds + 10)
        finally:
            a.execute("DROP TABLE IF EXISTS filler")
            a.execute("ALTER SYSTEM RESET idempotency.sweep_batch_size")
            a.execute("ALTER SYSTEM RESET idempotency.sweep_delay")
            a.execute("SELECT pg_reload_conf()")


def test_sweeper_compresses_its_full_page_images(preloaded):
    """With wal_compression off for the server, the sweeper's full-page images are lz4; a
    session's own sweep() writes them uncompressed."""
    def images_of_a_sweep(a, prefix, background):
        a.execute("ALTER SYSTEM SET idempotency.sweep_interval = '1h'")
        a.execute("SELECT pg_reload_conf()")
        time.sleep(2)  # the round the reload started has nothing left to do
        a.execute("""INSERT INTO idempotency.idempotency_keys
                       (key, request_hash, status, token, response, response_status, expires_at, ttl, completed_at,
                        created_at)
                     SELECT %s || i || md5(random()::text), sha256(random()::text::bytea), 'completed', -i,
                            jsonb_build_object('id', md5(random()::text)), 200, now() - interval '1 minute',
                            interval '1 hour', now() - interval '61 minutes', now() - interval '61 minutes'
                       FROM generate_series(1, 5000) i""", (prefix,))
        swept_before = a.execute("SELECT rows_swept FROM idempotency._shared_stats()").fetchone()[0]
        a.execute("CHECKPOINT")
        start = a.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        if background:
            a.execute("ALTER SYSTEM SET idempotency.sweep_interval = '1s'")
            a.execute("SELECT pg_reload_conf()")
            # Waits on the counters, not on the table: a query of this session that reads the
            # pages would prune them on access and write (uncompressed) images of its own.
            assert wait_for(lambda: a.execute("SELECT rows_swept FROM idempotency._shared_stats()")
                            .fetchone()[0] >= swept_before + 5000, timeout=20)
        else:
            a.execute("SELECT idempotency.sweep()")
        node = a.execute("SELECT pg_relation_filenode('idempotency.idempotency_keys')").fetchone()[0]
        # Up to the flushed WAL (15 refuses an end beyond it): a commit that wrote flushes it all.
        a.execute("SELECT txid_current()")
        # Every image of the table's pages in this window is the sweep's (autovacuum is off: it
        # would vacuum the 5,000 new rows, its images uncompressed): row locks, deletes, and on
        # a cluster with data checksums (18's default) the hint bits it sets.
        images = [r[0] for r in a.execute(
            "SELECT block_ref FROM pg_get_wal_records_info(%s, pg_current_wal_flush_lsn()) "
            "WHERE fpi_length > 0 AND block_ref LIKE %s", (start, f"%/{node} fork main %"))]
        assert count(a, prefix + "%") == 0  # after the WAL was read: this scan may prune pages
        return images

    with connect(preloaded) as a:
        a.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        a.execute("ALTER SYSTEM SET autovacuum = off")
        try:
            assert a.execute("SHOW wal_compression").fetchone()[0] == "off"
            swept = images_of_a_sweep(a, "fpi-bg-", background=True)
            assert swept and all("method: lz4" in r for r in swept), swept[:3]
            by_hand = images_of_a_sweep(a, "fpi-fn-", background=False)
            assert by_hand and not any("method:" in r for r in by_hand), by_hand[:3]
        finally:
            a.execute("ALTER SYSTEM SET idempotency.sweep_interval = '1s'")  # the fixture's
            a.execute("ALTER SYSTEM RESET autovacuum")
            a.execute("SELECT pg_reload_conf()")
            a.execute("DROP EXTENSION IF EXISTS pg_walinspect")


def test_sweepers_run_at_the_configured_niceness(preloaded):
    def newest_sweeper_nice(setting):
        with connect(preloaded) as a:
            if setting is None:
                a.execute("ALTER SYSTEM RESET idempotency.sweep_nice")
            else:
                a.execute(f"ALTER SYSTEM SET idempotency.sweep_nice = {setting}")
            a.execute("ALTER SYSTEM SET idempotency.sweep_batch_size = 100")
            a.execute("ALTER SYSTEM SET idempotency.sweep_delay = '200ms'")
            a.execute("SELECT pg_reload_conf()")
            time.sleep(1.5)
            seed(a, f"nice-{setting}", expired=1000, live=0)  # ten batches: about two seconds
            seen = {}  # pid -> (backend_start, nice)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and count(a, f"nice-{setting}-old-%") > 0:
                for pid, started in a.execute(
                        "SELECT pid, backend_start FROM pg_stat_activity WHERE backend_type = 'idempotency sweeper'"):
                    try:
                        with open(f"/proc/{pid}/stat") as f:
                            seen[pid] = (started, int(f.read().rsplit(")", 1)[1].split()[16]))
                    except (FileNotFoundError, ProcessLookupError):
                        pass
                time.sleep(0.05)
            assert seen, "no sweeper seen while it swept the backlog"
            return max(seen.values())[1]  # a sweeper started before the reload may still run

    try:
        assert newest_sweeper_nice(10) == 10
        assert newest_sweeper_nice(0) == 0
        assert newest_sweeper_nice(19) == 19
        assert newest_sweeper_nice(0) == 0
        assert newest_sweeper_nice(None) == 19  # the default: the CPU only when backends leave it
    finally:
        with connect(preloaded) as a:
            for g in ("sweep_nice", "sweep_batch_size", "sweep_delay"):
                a.execute(f"ALTER SYSTEM RESET idempotency.{g}")
            a.execute("SELECT pg_reload_conf()")


def test_audit_rows_are_swept_past_their_retention_only(preloaded):
    with connect(preloaded) as c:
        c.execute("DELETE FROM idempotency.audit")
        c.execute("SET idempotency.audit = on")
        for i in range(6):
            t = claim(c, f"audited-{i}")[1]
            c.execute("SELECT idempotency.complete(%s, '{}', token => %s)", (f"audited-{i}", t))
        c.execute("UPDATE idempotency.audit SET completed_at = now() - interval '2 hours' WHERE key IN ('audited-0', 'audited-1')")
        time.sleep(2.5)  # retention 0 (default): the sweeper keeps every audit row
        assert c.execute("SELECT count(*) FROM idempotency.audit").fetchone()[0] == 6
        c.execute("ALTER SYSTEM SET idempotency.audit_retention = '1h'")
        c.execute("SELECT pg_reload_conf()")
        try:
            assert wait_for(lambda: c.execute("SELECT count(*) FROM idempotency.audit").fetchone()[0] == 4)
            assert sorted(k for (k,) in c.execute("SELECT key FROM idempotency.audit").fetchall()) == [
                f"audited-{i}" for i in range(2, 6)]
        finally:
            c.execute("ALTER SYSTEM RESET idempotency.audit_retention")
            c.execute("SELECT pg_reload_conf()")
            c.execute("DELETE FROM idempotency.audit")


def test_counters_since_server_start(preloaded):
    with connect(preloaded) as a:
        before = a.execute("SELECT claims_new, claims_replay, claims_in_progress, claims_mismatch, completions, releases FROM idempotency.stats").fetchone()
        claim(a, "stat-1", {"x": 1})
        a.execute("SELECT idempotency.complete('stat-1', '{}')")
        claim(a, "stat-1", {"x": 1})
        claim(a, "stat-1", {"x": 2})
        claim(a, "stat-2")
        claim(a, "stat-2")
        a.execute("SELECT idempotency.release('stat-2')")
        after = a.execute("SELECT claims_new, claims_replay, claims_in_progress, claims_mismatch, completions, releases FROM idempotency.stats").fetchone()
        assert [x - y for x, y in zip(after, before)] == [2, 1, 1, 1, 1, 1]
        row = a.execute("SELECT rows_in_progress, rows_completed FROM idempotency.stats").fetchone()
        assert row[1] >= 1


def test_counters_add_up_across_sessions_live_and_gone(preloaded):
    """Each backend counts in a slot of its own and folds it into its database's as it exits:
    a reader sees every live session's counts, and an exit neither loses nor doubles any."""
    fields = "claims_new, claims_replay, claims_mismatch"
    with connect(preloaded) as mon:
        def counts():
            return mon.execute(f"SELECT {fields} FROM idempotency.stats").fetchone()
        before = counts()
        sessions = [connect(preloaded) for _ in range(3)]
        pids = []
        for i, s in enumerate(sessions):
            pids.append(s.execute("SELECT pg_backend_pid()").fetchone()[0])
            assert claim(s, f"across-{i}", {"n": i})[0] == "new"
            s.execute("SELECT idempotency.complete(%s, '{}')", (f"across-{i}",))
            assert claim(s, f"across-{i}", {"n": i})[0] == "replay"
            assert claim(s, f"across-{i}", {"n": -1})[0] == "mismatch"
        expected = [3, 3, 3]
        assert [a - b for a, b in zip(counts(), before)] == expected
        for s in sessions[:2]:
            s.close()
        assert [a - b for a, b in zip(counts(), before)] == expected
        sessions[2].close()

        def gone():
            return mon.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)).fetchone()[0] == 0
        assert wait_for(gone)
        assert [a - b for a, b in zip(counts(), before)] == expected


@pytest.mark.slow  # a backlog swept under claim load: 20-35 s
def test_sweep_of_a_million_rows_under_claim_load(preloaded):
    with connect(preloaded) as a:
        a.execute("""INSERT INTO idempotency.idempotency_keys (key, status, token, expires_at, ttl, locked_until,
                                                           created_at)
                     SELECT 'm' || i, 'in_progress', -i, now() - interval '1 minute', interval '1 hour', now(),
                            now() - interval '61 minutes'
                       FROM generate_series(1, 1000000) i""")
    stop = threading.Event()
    errors, done = [], []

    def load(n):
        try:
            with connect(preloaded) as c:
                i = 0
                while not stop.is_set():
                    key = f"load-{n}-{i}"
                    with c.transaction():
                        r = claim(c, key, {"n": i})
                        assert r[0] == "new", r
                        c.execute("SELECT idempotency.complete(%s, '{}')", (key,))
                    assert claim(c, key, {"n": i})[0] == "replay"
                    i += 1
                done.append(i)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=load, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    with connect(preloaded) as a:
        # Under load the sweeper yields (small batches, long pauses) but keeps making progress;
        # once the load stops it finishes at full speed. Progress, not pace: 3,000 rows are 30
        # of its yielding batches (100 rows per 200 ms pause, about 6 s on a machine of its own,
        # several times that where other work shares the cores).
        kept_sweeping = wait_for(lambda: 1000000 - count(a, "m%") > 3000, timeout=90, step=0.5)
        during_load = 1000000 - count(a, "m%")
        assert not stop.is_set() and all(t.is_alive() for t in threads), "the load ended early"
        stop.set()
        for t in threads:
            t.join(30)
        ok = wait_for(lambda: count(a, "m%") == 0, timeout=120, step=0.5)
    assert not errors, errors[:3]
    assert kept_sweeping, f"{during_load} rows swept in 90 s under the load"
    assert ok, "the million expired rows were not swept"
    assert sum(done) > 0
    with connect(preloaded) as a:
        assert count(a, "load-%") == sum(done), "the sweeper deleted live rows"


def test_worker_survives_a_killed_backend_and_its_own_sigkill(preloaded):
    with connect(preloaded) as a:
        victim = connect(preloaded)
        os.kill(victim.info.backend_pid, signal.SIGKILL)
    time.sleep(1)
    preloaded.wait_ready()
    with connect(preloaded) as a:
        assert wait_for(lambda: launcher_pid(a) is not None, timeout=20)
        pid = launcher_pid(a)
    os.kill(pid, signal.SIGKILL)
    time.sleep(1)
    preloaded.wait_ready()
    with connect(preloaded) as a:
        assert wait_for(lambda: launcher_pid(a) not in (None, pid), timeout=20), "launcher not restarted"
        seed(a, "after-kill", expired=30, live=3)
        assert wait_for(lambda: count(a, "after-kill-old-%") == 0)


def test_sigterm_stops_the_launcher_within_a_second_and_it_comes_back(preloaded):
    with connect(preloaded) as a:
        pid = launcher_pid(a)
        os.kill(pid, signal.SIGTERM)
        assert wait_for(lambda: launcher_pid(a) is None, timeout=1.0, step=0.05)
        assert wait_for(lambda: launcher_pid(a) not in (None, pid), timeout=15), "not restarted"


def test_server_shutdown_is_not_held_up_by_a_sweep(preloaded):
    with connect(preloaded) as a:
        a.execute("""INSERT INTO idempotency.idempotency_keys (key, status, token, expires_at, ttl, locked_until,
                                                           created_at)
                     SELECT 's' || i, 'in_progress', -i, now() - interval '1 minute', interval '1 hour', now(),
                            now() - interval '61 minutes'
                       FROM generate_series(1, 300000) i""")
        assert wait_for(lambda: a.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency sweeper'"
        ).fetchone()[0] > 0, timeout=5, step=0.02)
    started = time.monotonic()
    preloaded.stop("fast")
    assert time.monotonic() - started < 3
    preloaded.pg_ctl("start", "-w", "-l", preloaded.log)


def test_not_preloaded_says_so_and_counts_nothing(cluster):
    notices = []
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS fresh")
        conn.execute("CREATE DATABASE fresh")
    with psycopg.connect(cluster.conninfo().replace("dbname=idem", "dbname=fresh"), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append((d.severity_nonlocalized, d.message_primary, d.message_hint)))
        conn.execute("CREATE EXTENSION idempotency")
        assert any(sev == "NOTICE" and "no background sweeper" in msg and "shared_preload_libraries" in (hint or "")
                   for sev, msg, hint in notices), notices
        claim(conn, "k")
        row = conn.execute("SELECT sweeper_enabled, claims_new, rows_swept, last_sweep_at, rows_in_progress FROM idempotency.stats").fetchone()
        assert row == (False, None, None, None, 1)


def test_no_sweeper_in_the_servers_pg_upgrade_runs():
    """pg_upgrade starts both clusters in binary-upgrade mode (`-b`) to dump the old one and
    restore the new one: no sweeper may delete keys there (they would vanish between the dump
    and the copy, and be counted by a server that is then thrown away). The upgraded cluster's
    own sweeper sweeps them, and counts them."""
    c = Cluster(settings={"shared_preload_libraries": "'idempotency'", "idempotency.sweep_interval": "'1s'"}).start()
    try:
        with connect(c) as conn:
            conn.execute("CREATE EXTENSION idempotency")
            seed(conn, "u", expired=0, live=5)
            # Live for now: they expire in binary-upgrade mode, where no sweeper may take them.
            conn.execute("SELECT idempotency.claim('u-old-' || i, ttl => '1 hour') FROM generate_series(1, 50) i")
        c.stop()
        c.pg_ctl("start", "-w", "-l", c.log, "-o", "-b")
        with connect(c) as conn:
            assert conn.execute("SELECT current_setting('is_superuser')").fetchone()[0] == "on"
            conn.execute(
                "UPDATE idempotency.idempotency_keys SET created_at = now() - ttl - interval '1 minute', "
                "expires_at = now() - interval '1 minute' WHERE key LIKE 'u-old-%'"
            )
            assert count(conn, "u-old-%") == 50 and count(conn, "u-live-%") == 5
            time.sleep(3.5)  # three sweep intervals
            assert launcher_pid(conn) is None
            assert conn.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type LIKE 'idempotency%'").fetchone()[0] == 0
            assert count(conn, "u-old-%") == 50
            assert conn.execute("SELECT sweeper_enabled FROM idempotency.stats").fetchone()[0] is False
        c.stop()
        c.pg_ctl("start", "-w", "-l", c.log)
        with connect(c) as conn:
            assert wait_for(lambda: count(conn, "u-old-%") == 0)
            assert count(conn, "u-live-%") == 5
            row = conn.execute("SELECT sweeper_enabled, rows_swept FROM idempotency.stats").fetchone()
            assert row == (True, 50)
    finally:
        c.destroy()
