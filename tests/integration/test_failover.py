"""A synchronous streaming standby (`pg_basebackup -R`, a replication slot,
`synchronous_standby_names` = its application_name, `synchronous_commit = on`): read-only use of
the standby, and failover under load (primary stopped with `-m immediate`, standby promoted):
on the new primary every completion acknowledged by the old one replays, and leased claims are
taken over after their lease (faultload.py keeps the ledger and does the checks).
Both clusters preload the library, so the sweeper runs on the standby's copy of the settings."""

import re
import time

import psycopg
import pytest
from psycopg.types.json import Jsonb

from cluster import Cluster
from faultload import Load, verify
from helpers import claim

pytestmark = pytest.mark.slow  # a standby, crashes under load, promotion

SETTINGS = {
    "fsync": "on",
    "wal_level": "replica",
    "max_wal_senders": "4",
    "shared_preload_libraries": "'idempotency'",
    "idempotency.sweep_interval": "'1s'",
}


def wait_for(predicate, timeout=20.0, step=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def replicated_pair():
    primary = Cluster(settings=SETTINGS).start()
    standby = None
    try:
        with psycopg.connect(primary.conninfo(), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION idempotency")
            conn.execute("SELECT pg_create_physical_replication_slot('standby1')")
        standby = Cluster.standby_of(primary, application_name="standby1", slot="standby1").start_standby()
        standby.wait_ready()
        with psycopg.connect(primary.conninfo(), autocommit=True) as conn:
            # Only now: the standby's copy of the settings must not wait for a standby itself.
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'standby1'")
            conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
            conn.execute("SELECT pg_reload_conf()")
            assert wait_for(lambda: conn.execute(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby1'"
            ).fetchone() == ("sync",)), "the standby never became synchronous"
        return primary, standby
    except BaseException:
        if standby is not None:
            standby.destroy()
        primary.destroy()
        raise


@pytest.fixture(scope="module")
def pair():
    primary, standby = replicated_pair()
    with psycopg.connect(primary.conninfo(), autocommit=True) as conn:
        conn.execute("SELECT idempotency.claim('done', '{\"a\": 1}')")
        conn.execute("SELECT idempotency.complete('done', '{\"order\": 7}', 201)")
        conn.execute("SELECT idempotency.claim('busy', '{\"a\": 2}', lease => '1 hour')")
    with psycopg.connect(standby.conninfo(), autocommit=True) as conn:
        # synchronous_commit = on waits for the standby's flush, not its replay: wait for it.
        assert wait_for(lambda: conn.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 2)
    yield primary, standby
    standby.destroy()
    primary.destroy()


CLIENT_PIDS = set()  # backends of the tests' own sessions on the standby


def standby_result(standby, sql):
    with psycopg.connect(standby.conninfo(), autocommit=True) as conn:
        CLIENT_PIDS.add(conn.info.backend_pid)
        try:
            return conn.execute(sql).fetchone()
        except psycopg.Error as e:
            return e.sqlstate, e.diag.message_primary


def test_lookup_works_on_the_standby(pair):
    _, standby = pair
    assert standby_result(standby, "SELECT pg_is_in_recovery()") == (True,)
    assert standby_result(standby, "SELECT status::text, response, response_status "
                          "FROM idempotency.lookup('done')") == ("completed", {"order": 7}, 201)
    assert standby_result(standby, "SELECT key FROM idempotency.lookup('absent')") == (None,)


def test_hashing_and_key_derivation_work_on_the_standby(pair):
    _, standby = pair
    assert standby_result(standby, "SELECT idempotency.derive_key('a', 'b')") == ("a:b",)
    assert len(standby_result(standby, "SELECT idempotency.canonical_hash('{\"a\": 1}')")[0]) == 32


# Every function that writes, or could answer a claim, refuses the standby with 25006
# read_only_sql_transaction; claim refuses even a key it could replay (its answer would
# come from a server that cannot record the next step).
@pytest.mark.parametrize("sql", [
    "SELECT idempotency.claim('fresh', '{\"a\": 3}')",
    "SELECT idempotency.claim('done', '{\"a\": 1}')",
    "SELECT idempotency.claim('busy', '{\"a\": 2}')",
    "SELECT idempotency.complete('busy', '{}')",
    "SELECT idempotency.release('busy')",
    "SELECT idempotency.checkpoint('busy', 'x')",
    "SELECT idempotency.forget('done')",
    "SELECT idempotency.sweep()",
])
def test_writes_on_the_standby_fail_read_only(pair, sql):
    got = standby_result(pair[1], sql)
    assert got[0] == "25006" and "read-only" in got[1], got


def test_the_sweeper_leaves_a_standby_alone(pair):
    _, standby = pair
    time.sleep(2.5)  # a few sweep intervals
    assert standby_result(standby, "SELECT count(*) FROM pg_stat_activity "
                          "WHERE backend_type LIKE 'idempotency%'") == (0,)
    # ERRORs in the standby's log come only from the tests' own sessions above.
    pids = {int(m) for m in re.findall(r"\[(\d+)\] (?:ERROR|FATAL|PANIC):", standby.server_log())}
    assert pids <= CLIENT_PIDS, standby.server_log()[-3000:]


def test_failover_under_load_keeps_every_acknowledged_completion():
    primary, standby = replicated_pair()
    try:
        load = Load(primary.conninfo(), prefix="failover").start()
        time.sleep(2.5)
        primary.stop("immediate")
        load.stop()
        assert not load.unexpected, load.unexpected
        standby.promote()
        standby.wait_ready()
        counts = verify(standby.conninfo(), load)
        assert counts["acked"] > 50 and counts["taken_over"] > 0, counts
        assert counts["in_progress_while_leased"] > counts["leased_in_progress"] // 2, counts
        with psycopg.connect(standby.conninfo(), autocommit=True) as conn:
            assert not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]
            # The new primary takes new claims, and its sweeper sweeps.
            r = claim(conn, "after-failover", {"a": 1})
            assert r[0] == "new", r
            conn.execute("SELECT idempotency.complete('after-failover', %s)", (Jsonb({"ok": True}),))
            conn.execute("SELECT idempotency.claim('expired-' || i, ttl => '1 hour') FROM generate_series(1, 100) i")
            conn.execute("UPDATE idempotency.idempotency_keys SET created_at = now() - ttl - interval '1 minute', "
                         "expires_at = now() - interval '1 minute' "
                         "WHERE key LIKE 'expired-%'")
            assert wait_for(lambda: conn.execute(
                "SELECT count(*) FROM idempotency.idempotency_keys WHERE key LIKE 'expired-%'").fetchone()[0] == 0)
        print(f"\nfailover: {len(load.records)} operations in the ledger; {counts}")
    finally:
        standby.destroy()
        primary.destroy()
