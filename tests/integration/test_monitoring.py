"""Monitoring: the signals of idempotency.stats (takeovers, stale tokens refused, claim waits,
the sweep's lag and last error), row counts that cost no scan of a large store, exact counts
from count_keys(), and the recipe of contrib/prometheus run for real: Debian's
prometheus-postgres-exporter, connected as a role granted only idempotency_monitor, exports
every signal of a scripted workload with its value, and promtool tests every alert rule."""

import os
import re
import socket
import subprocess
import threading
import time
import urllib.request

import psycopg
import pytest
from psycopg.types.json import Jsonb

from cluster import EDITION, Cluster

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CONTRIB = os.path.join(ROOT, "contrib", "prometheus")
EXPORTER = "/usr/bin/prometheus-postgres-exporter"
PROMTOOL = "/usr/bin/promtool"
NEW_COLUMNS = ["takeovers", "stale_tokens_refused", "claims_waited", "claim_wait_seconds",
               "sweep_lag_seconds", "last_sweep_error"]


@pytest.fixture(scope="module")
def preloaded():
    """A cluster with the library preloaded (the counters in shared memory) whose sweeper never
    comes round during the tests (the sweeps are the tests' own)."""
    c = Cluster(settings={
        "shared_preload_libraries": "'idempotency'",
        "idempotency.sweep_interval": "'1h'",
    }).start()
    with psycopg.connect(c.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION idempotency")
        conn.execute("CREATE ROLE monitor LOGIN")
        # The monitoring recipe (docs/operations.md), and nothing else.
        conn.execute("GRANT USAGE ON SCHEMA idempotency_monitor TO monitor")
    yield c
    c.destroy()


def connect(cluster, user="postgres"):
    return psycopg.connect(cluster.conninfo().replace("user=postgres", f"user={user}"), autocommit=True)


def stats(conn, view="idempotency.stats"):
    cur = conn.execute(f"SELECT * FROM {view}")
    return dict(zip([d.name for d in cur.description], cur.fetchone()))


def expire(conn, key):
    """Makes a key expired a minute ago, keeping the sweep index's rule (its claim-time expiry,
    created_at + ttl, no later than expires_at)."""
    conn.execute("UPDATE idempotency.idempotency_keys SET created_at = now() - ttl - interval '1 minute', "
                  "expires_at = now() - interval '1 minute' WHERE key = %s", (key,))


def workload(cluster):
    """new, replay, mismatch, in_progress, a wait for a busy key, a takeover, a stale
    completion, an expired key and a sweep; returns what the counters must say."""
    with connect(cluster) as a, connect(cluster) as b:
        a.execute("SELECT idempotency.claim('w-new', %s)", (Jsonb({"n": 1}),))
        a.execute("SELECT idempotency.complete('w-new', %s)", (Jsonb({"ok": True}),))
        assert a.execute("SELECT outcome::text FROM idempotency.claim('w-new', %s)",
                         (Jsonb({"n": 1}),)).fetchone()[0] == "replay"
        assert a.execute("SELECT outcome::text FROM idempotency.claim('w-new', %s)",
                         (Jsonb({"n": 2}),)).fetchone()[0] == "mismatch"
        a.execute("SELECT idempotency.claim('w-busy', lease => '1 hour')")
        assert a.execute("SELECT outcome::text FROM idempotency.claim('w-busy')").fetchone()[0] == "in_progress"
        # A crashed worker's lease runs out; the next claim takes the key over; the first
        # worker's completion comes back with its stale token and is refused (IK003).
        stale = a.execute("SELECT token FROM idempotency.claim('w-lease', lease => '1 hour')").fetchone()[0]
        a.execute("UPDATE idempotency.idempotency_keys SET locked_until = now() - interval '1 second' "
                  "WHERE key = 'w-lease'")
        outcome, token = a.execute("SELECT outcome::text, token FROM idempotency.claim('w-lease')").fetchone()
        assert (outcome, token > stale) == ("new", True)
        with pytest.raises(psycopg.Error) as e:
            a.execute("SELECT idempotency.complete('w-lease', '{}'::jsonb, token => %s)", (stale,))
        assert e.value.sqlstate == "IK003"
        a.execute("SELECT idempotency.complete('w-lease', '{}'::jsonb, token => %s)", (token,))
        # A claim that waits under claim_wait for another transaction's claim of its key.
        b.execute("BEGIN")
        b.execute("SELECT idempotency.claim('w-wait')")
        a.execute("SET idempotency.claim_wait = '300ms'")
        started = time.monotonic()
        assert a.execute("SELECT outcome::text FROM idempotency.claim('w-wait')").fetchone()[0] == "in_progress"
        waited = time.monotonic() - started
        a.execute("RESET idempotency.claim_wait")
        b.execute("ROLLBACK")
        a.execute("SELECT idempotency.claim('w-old')")
        expire(a, "w-old")
        before = stats(a)
        assert before["rows_expired"] == 1 and 55 <= before["sweep_lag_seconds"] <= 120, before
        assert a.execute("SELECT idempotency.sweep()").fetchone()[0] == 1
    return {
        # w-new, w-busy, w-lease twice (the takeover answers new), w-wait (b's), w-old
        "claims_new": 6, "claims_replay": 1, "claims_mismatch": 1,
        # w-busy's second claim, and the claim that waited for w-wait
        "claims_in_progress": 2,
        "completions": 2, "releases": 0, "rows_swept": 1, "last_sweep_rows": 1,
        "takeovers": 1, "stale_tokens_refused": 1, "claims_waited": 1,
        "rows_in_progress": 1, "rows_completed": 2, "rows_expired": 0,
    }, waited


# --- the view -----------------------------------------------------------------------------

def test_stats_views_append_the_new_columns_after_the_existing_ones(db):
    for view in ("idempotency.stats", "idempotency_monitor.stats"):
        cur = db.execute(f"SELECT * FROM {view}")
        names = [d.name for d in cur.description]
        assert names[:15] == ["database", "rows_in_progress", "rows_completed", "rows_expired",
                              "oldest_expiry", "last_sweep_at", "last_sweep_rows", "claims_new",
                              "claims_replay", "claims_in_progress", "claims_mismatch", "completions",
                              "releases", "rows_swept", "sweeper_enabled"]
        assert names[15:] == NEW_COLUMNS
    types = dict(db.execute(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = 'idempotency.stats'::regclass AND attnum > 15").fetchall())
    assert types == {"takeovers": "bigint", "stale_tokens_refused": "bigint", "claims_waited": "bigint",
                     "claim_wait_seconds": "double precision", "sweep_lag_seconds": "double precision",
                     "last_sweep_error": "text"}


def small_store(db):
    """The store as a fresh install has it: the other tests of the session's cluster left its
    table large (deleted rows), and the view estimates the rows of a large table."""
    db.execute("TRUNCATE idempotency.idempotency_keys")


def test_sweep_lag_is_the_age_of_the_oldest_expired_row_and_null_when_none(db):
    small_store(db)
    db.execute("SELECT idempotency.claim('lag-live')")
    assert stats(db)["sweep_lag_seconds"] is None
    for key, minutes in (("lag-a", 5), ("lag-b", 2)):
        db.execute("SELECT idempotency.claim(%s)", (key,))
        db.execute("UPDATE idempotency.idempotency_keys SET created_at = now() - ttl - %s::interval, "
                   "expires_at = now() - %s::interval WHERE key = %s", (f"{minutes} min", f"{minutes} min", key))
    s = stats(db)
    assert s["rows_expired"] == 2
    assert 300 <= s["sweep_lag_seconds"] < 310, s
    db.execute("SELECT idempotency.sweep()")
    assert stats(db)["sweep_lag_seconds"] is None


def test_oldest_expiry_counts_a_row_completed_after_a_later_claim(db):
    """A row whose expiry a completion moved later (its sweep-index key stays the claim's) is
    passed over for the row that expires first."""
    db.execute("SELECT idempotency.claim('first', ttl => '1 hour')")
    db.execute("SELECT idempotency.claim('second', ttl => '10 minutes')")
    # 'first' was claimed two hours ago and completed a moment ago (expiry now + 1 hour);
    # 'second' was claimed a moment ago and expires in ten minutes.
    db.execute("UPDATE idempotency.idempotency_keys SET created_at = now() - interval '2 hours', "
               "status = 'completed', locked_until = NULL, expires_at = now() + interval '1 hour' "
               "WHERE key = 'first'")
    expected = db.execute("SELECT min(expires_at) FROM idempotency.idempotency_keys").fetchone()[0]
    assert expected == db.execute("SELECT expires_at FROM idempotency.idempotency_keys "
                                  "WHERE key = 'second'").fetchone()[0]
    assert stats(db)["oldest_expiry"] == expected


def test_count_keys_counts_exactly(db):
    small_store(db)
    db.execute("SELECT idempotency.claim('ck-' || i) FROM generate_series(1, 5) i")
    db.execute("SELECT idempotency.complete('ck-' || i, '{}'::jsonb) FROM generate_series(1, 2) i")
    expire(db, "ck-5")
    assert db.execute("SELECT * FROM idempotency.count_keys()").fetchall() == [(2, 2, 1)]
    s = stats(db)  # a small store: the view counts exactly too
    assert (s["rows_in_progress"], s["rows_completed"], s["rows_expired"]) == (2, 2, 1)


def test_a_scrape_of_a_large_store_scans_no_table_and_estimates_its_rows(db):
    db.execute("INSERT INTO idempotency.idempotency_keys (key, status, token, locked_until, expires_at, ttl, "
               "created_at, completed_at) "
               "SELECT 'big-' || i, CASE WHEN i % 4 = 0 THEN 'in_progress' ELSE 'completed' END::idempotency.key_status, "
               "nextval('idempotency.token_seq'), CASE WHEN i % 4 = 0 THEN now() + interval '1 hour' END, "
               "CASE WHEN i % 10 = 0 THEN now() - interval '1 minute' ELSE now() + interval '1 day' END, "
               "interval '1 day', CASE WHEN i % 10 = 0 THEN now() - interval '1 day 1 minute' ELSE now() END, "
               "CASE WHEN i % 4 <> 0 THEN now() END "
               "FROM generate_series(1, 20000) i")
    db.execute("ANALYZE idempotency.idempotency_keys")
    pages = db.execute("SELECT pg_relation_size('idempotency.idempotency_keys') / 8192").fetchone()[0]
    assert pages > 128, "the store must be larger than the view counts exactly"
    exact = db.execute("SELECT * FROM idempotency.count_keys()").fetchone()
    assert exact == (4000, 14000, 2000)
    # Rows read by sequential scans (a bitmap heap scan counts in seq_scan, but reads its rows
    # through the index: idx_tup_fetch), as this backend counts them (not yet flushed).
    read = ("SELECT seq_tup_read, idx_scan FROM pg_stat_xact_user_tables "
            "WHERE relid = 'idempotency.idempotency_keys'::regclass")
    with db.transaction():
        before = db.execute(read).fetchone()
        s = stats(db)
        after = db.execute(read).fetchone()
    assert after[0] == before[0] and after[1] > before[1], (before, after)
    for column, n in zip(("rows_in_progress", "rows_completed", "rows_expired"), exact):
        assert abs(s[column] - n) <= 0.15 * n, (column, s[column], n)
    assert 60 <= s["sweep_lag_seconds"] < 120
    # Small again, so that the next tests' views count exactly.
    db.execute("TRUNCATE idempotency.idempotency_keys")


@pytest.mark.skipif(EDITION != "portable", reason="the portable edition's NULL counters")
def test_portable_edition_gives_null_for_the_shared_memory_counters(db):
    db.execute("SELECT idempotency.claim('p-old')")
    expire(db, "p-old")
    s = stats(db)
    assert [s[c] for c in NEW_COLUMNS if c != "sweep_lag_seconds"] == [None] * 5
    assert s["sweep_lag_seconds"] >= 60 and s["rows_expired"] == 1


# --- the counters (shared memory: the native edition) ---------------------------------------

@pytest.mark.native_only("the counters live in shared memory")
def test_counters_count_takeovers_stale_tokens_and_claim_waits(preloaded):
    with connect(preloaded) as conn:
        before = stats(conn)
        assert before["sweeper_enabled"] is True
        expected, waited = workload(preloaded)
        after = stats(conn)
        for column in ("takeovers", "stale_tokens_refused", "claims_waited"):
            assert after[column] - before[column] == expected[column], column
        assert 0.25 <= after["claim_wait_seconds"] - before["claim_wait_seconds"] <= waited + 0.05
        assert after["sweep_lag_seconds"] is None and after["last_sweep_error"] is None
        # The monitoring role reads the same row.
        with connect(preloaded, "monitor") as mon:
            mine = stats(mon, "idempotency_monitor.stats")
        assert {c: mine[c] for c in NEW_COLUMNS} == {c: stats(conn)[c] for c in NEW_COLUMNS}
        conn.execute("DELETE FROM idempotency.idempotency_keys")


@pytest.mark.native_only("the counters live in shared memory")
def test_last_sweep_error_shows_a_failed_sweep_until_a_sweep_finishes(preloaded):
    with connect(preloaded) as conn:
        conn.execute("SELECT idempotency.claim('e-old')")
        expire(conn, "e-old")
        conn.execute("CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS "
                     "$$BEGIN RAISE EXCEPTION 'no deletes today' USING ERRCODE = 'P0001'; END$$")
        conn.execute("CREATE TRIGGER refuse BEFORE DELETE ON idempotency.idempotency_keys "
                     "FOR EACH ROW EXECUTE FUNCTION public.refuse()")
        try:
            with pytest.raises(psycopg.errors.RaiseException):
                conn.execute("SELECT idempotency.sweep()")
            assert stats(conn)["last_sweep_error"] == "P0001: no deletes today"
        finally:
            conn.execute("DROP TRIGGER refuse ON idempotency.idempotency_keys")
            conn.execute("DROP FUNCTION public.refuse()")
        assert conn.execute("SELECT idempotency.sweep()").fetchone()[0] == 1
        assert stats(conn)["last_sweep_error"] is None


# --- the recipe, run ----------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
            if "idempotency_claims_new" in text:
                return text
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("the exporter served no idempotency metrics")
        time.sleep(0.2)


def metrics(text):
    """{name: value} of the idempotency_* samples of database idem."""
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(idempotency_\w+)\{([^}]*)\} (\S+)$', line)
        if m and 'database="idem"' in m.group(2):
            out[m.group(1)] = float(m.group(3))
    return out


@pytest.mark.native_only("the exporter reads the counters of shared memory")
def test_postgres_exporter_exports_every_signal_of_a_workload(preloaded):
    assert os.access(EXPORTER, os.X_OK), "scripts/bootstrap.sh installs prometheus-postgres-exporter"
    with connect(preloaded) as conn:
        conn.execute("DELETE FROM idempotency.idempotency_keys")
        before = stats(conn)
    expected, _ = workload(preloaded)
    port = free_port()
    env = dict(os.environ,
               DATA_SOURCE_NAME=f"host={preloaded.dir} port={preloaded.port} dbname=idem user=monitor sslmode=disable")
    proc = subprocess.Popen(
        [EXPORTER, f"--web.listen-address=127.0.0.1:{port}",
         f"--extend.query-path={os.path.join(CONTRIB, 'queries.yaml')}",
         "--disable-default-metrics", "--disable-settings-metrics"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    try:
        got = metrics(scrape(f"http://127.0.0.1:{port}/metrics"))
    finally:
        proc.terminate()
        proc.wait(10)
    assert got, "".join(output)
    for name in ("claims_new", "claims_replay", "claims_in_progress", "claims_mismatch", "completions",
                 "releases", "rows_swept", "takeovers", "stale_tokens_refused", "claims_waited"):
        assert got[f"idempotency_{name}"] == before[name] + expected[name], name
    for name in ("rows_in_progress", "rows_completed", "rows_expired", "last_sweep_rows"):
        assert got[f"idempotency_{name}"] == expected[name], name
    assert 0.25 <= got["idempotency_claim_wait_seconds"] - before["claim_wait_seconds"] < 5
    assert got["idempotency_sweep_lag_seconds"] == 0
    assert got["idempotency_last_sweep_failed"] == 0
    assert got["idempotency_sweeper_enabled"] == 1
    assert 0 <= got["idempotency_last_sweep_age_seconds"] < 60
    with connect(preloaded) as conn:
        conn.execute("DELETE FROM idempotency.idempotency_keys")


@pytest.mark.skipif(EDITION == "portable", reason="the rules are the same for both editions: tested once")
def test_alert_rules_pass_promtool_unit_tests():
    assert os.access(PROMTOOL, os.X_OK), "scripts/bootstrap.sh installs prometheus (promtool)"
    check = subprocess.run([PROMTOOL, "check", "rules", "alerts.yml"], cwd=CONTRIB, capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 4 rules found" in check.stdout, check.stdout + check.stderr
    tests = subprocess.run([PROMTOOL, "test", "rules", "alerts.test.yml"], cwd=CONTRIB, capture_output=True, text=True)
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr
    # Every alert has a unit test.
    alerts = set(re.findall(r"^\s+- alert: (\w+)$", open(os.path.join(CONTRIB, "alerts.yml")).read(), re.M))
    tested = set(re.findall(r"alertname: (\w+)$", open(os.path.join(CONTRIB, "alerts.test.yml")).read(), re.M))
    assert alerts == tested and len(alerts) == 4
