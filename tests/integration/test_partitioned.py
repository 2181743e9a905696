"""The store hash-partitioned by scope on one node: CREATE EXTENSION with idempotency.partitions
set makes idempotency_keys a `PARTITION BY HASH (scope)` table (docs/scaling.md). Its parent
holds no rows, so claims go through SQL and sweeps run partition by partition; every function
keeps its contract. In a database of its own in the session's cluster."""

import os
import subprocess
import threading
import time

import psycopg
import pytest

from cluster import PG_BIN
from helpers import paths_taken

DB = "partitioned"
PARTS = 8


@pytest.fixture(scope="module")
def pinfo(cluster):
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        c.execute(f"CREATE DATABASE {DB}")
    info = cluster.conninfo().replace(f"dbname={cluster.dbname}", f"dbname={DB}")
    with psycopg.connect(info, autocommit=True) as c:
        c.execute(f"SET idempotency.partitions = {PARTS}")
        c.execute("CREATE EXTENSION idempotency")
    yield info
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


@pytest.fixture
def p(pinfo):
    with psycopg.connect(pinfo, autocommit=True) as c:
        c.execute("DELETE FROM idempotency.idempotency_keys")
        yield c


def claim(c, key, request=None, scope="", ttl=None, lease=None):
    return c.execute(
        "SELECT outcome::text, token, response, response_status FROM idempotency.claim(%s, %s::jsonb, %s, "
        "%s::interval, %s::interval)",
        (key, None if request is None else psycopg.types.json.Jsonb(request), scope, ttl, lease)).fetchone()


def complete(c, key, response, scope="", token=None, status=200):
    return c.execute("SELECT idempotency.complete(%s, %s::jsonb, %s, %s, %s)",
                     (key, psycopg.types.json.Jsonb(response), status, scope, token)).fetchone()[0]


def rows_per_partition(c):
    return dict(c.execute("SELECT tableoid::regclass::text, count(*) FROM idempotency.idempotency_keys "
                          "GROUP BY 1").fetchall())


@pytest.mark.native_only("the library's report of the path it takes")
def test_claims_batches_and_completions_take_the_sql_only_path(p):
    """The parent holds no rows, so the look-up below SQL would find nothing: every call goes
    through SQL (the `sql_only` path), at READ COMMITTED too, and says so at DEBUG1."""
    def calls():
        assert claim(p, "po-1")[0] == "new"
        assert complete(p, "po-1", {"ok": True}) is not None
        assert claim(p, "po-1")[0] == "replay"
        p.execute("SELECT * FROM idempotency.claim_many(ARRAY['po-2'], NULL)").fetchall()
    assert paths_taken(p, calls) == ["claim sql_only", "complete sql_only", "claim sql_only",
                                     "claim_many sql_only", "claim sql_only"]
    assert p.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 2


@pytest.mark.extension_only("the partitions are members of the extension, kept by pg_dump as configuration")
def test_create_extension_with_partitions_makes_a_hash_partitioned_store(p):
    kind, key = p.execute("SELECT c.relkind::text, pg_get_partkeydef(c.oid) FROM pg_class c "
                          "WHERE c.oid = 'idempotency.idempotency_keys'::regclass").fetchone()
    assert (kind, key) == ("p", "HASH (scope)")
    parts = [r[0] for r in p.execute(
        "SELECT relid::regclass::text FROM pg_partition_tree('idempotency.idempotency_keys') "
        "WHERE isleaf ORDER BY relid").fetchall()]
    assert parts == [f"idempotency.idempotency_keys_p{i}" for i in range(PARTS)]
    # The same constraints and indexes, under the same names, as the plain table's.
    names = {r[0] for r in p.execute("SELECT conname FROM pg_constraint "
                                     "WHERE conrelid = 'idempotency.idempotency_keys'::regclass").fetchall()}
    assert {"idempotency_keys_pkey", "idempotency_keys_lease_check",
            "idempotency_keys_request_hash_check", "idempotency_keys_response_status_check"} <= names
    indexes = {r[0] for r in p.execute("SELECT indexrelid::regclass::text FROM pg_index "
                                       "WHERE indrelid = 'idempotency.idempotency_keys'::regclass").fetchall()}
    assert "idempotency.idempotency_keys_pkey" in indexes
    assert "idempotency.idempotency_keys_sweep_idx" in indexes
    # Members of the extension, kept by pg_dump (config tables), dropped with it.
    members = p.execute("SELECT count(*) FROM pg_depend d JOIN pg_extension e ON e.oid = d.refobjid "
                        "WHERE e.extname = 'idempotency' AND d.classid = 'pg_class'::regclass "
                        "AND d.objid::regclass::text LIKE 'idempotency.idempotency_keys_p%' AND d.deptype = 'e'"
                        ).fetchone()[0]
    assert members == PARTS


@pytest.mark.native_only("it loads the library, whose setting refuses the value when set; "
                         "the portable install refuses it as the native install does (first half)")
def test_out_of_range_partitions_are_refused(cluster):
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        c.execute("DROP DATABASE IF EXISTS partitioned_bad WITH (FORCE)")
        c.execute("CREATE DATABASE partitioned_bad")
    info = cluster.conninfo().replace(f"dbname={cluster.dbname}", "dbname=partitioned_bad")
    try:
        # Set before the library is loaded: CREATE EXTENSION refuses it, and creates nothing.
        with psycopg.connect(info, autocommit=True) as c:
            c.execute("SET idempotency.partitions = 5000")
            with pytest.raises(psycopg.Error) as e:
                c.execute("CREATE EXTENSION idempotency")
            assert e.value.sqlstate == "22023"
            assert "idempotency.partitions" in e.value.diag.message_primary
            assert c.execute("SELECT count(*) FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0] == 0
        # With the library loaded the setting itself refuses it.
        with psycopg.connect(info, autocommit=True) as c:
            c.execute("LOAD 'idempotency'")
            with pytest.raises(psycopg.Error) as e:
                c.execute("SET idempotency.partitions = 5000")
            assert e.value.sqlstate == "22023"
    finally:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
            c.execute("DROP DATABASE IF EXISTS partitioned_bad WITH (FORCE)")


def test_claim_complete_replay_mismatch_over_many_scopes(p):
    scopes = [f"tenant-{i}" for i in range(200)]
    tokens = {}
    for s in scopes:
        r = claim(p, "order-1", {"amount": 10}, scope=s)
        assert r[0] == "new", (s, r)
        tokens[s] = r[1]
        assert claim(p, "order-1", {"amount": 10}, scope=s)[0] == "in_progress"
    for s in scopes:
        complete(p, "order-1", {"ok": s}, scope=s, token=tokens[s], status=201)
    for s in scopes:
        assert claim(p, "order-1", {"amount": 10}, scope=s) == ("replay", tokens[s], {"ok": s}, 201)
        assert claim(p, "order-1", {"amount": 11}, scope=s)[0] == "mismatch"
    parts = rows_per_partition(p)
    assert len(parts) == PARTS and sum(parts.values()) == len(scopes), parts
    assert p.execute("SELECT count(*) FROM ONLY idempotency.idempotency_keys").fetchone()[0] == 0
    # Inside a transaction, under REPEATABLE READ, and from a multi-row query.
    with p.transaction():
        p.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        assert claim(p, "order-1", {"amount": 10}, scope="tenant-7")[0] == "replay"
        assert claim(p, "rr", {"a": 1}, scope="tenant-7")[0] == "new"
    got = p.execute("SELECT (idempotency.claim('order-1', '{\"amount\": 10}', s)).outcome::text "
                    "FROM unnest(%s::text[]) AS s", (scopes[:20],)).fetchall()
    assert {o for (o,) in got} == {"replay"}
    assert p.execute("SELECT (idempotency.lookup('order-1', 'tenant-3')).response").fetchone()[0] == {"ok": "tenant-3"}
    assert p.execute("SELECT idempotency.forget('order-1', 'tenant-3')").fetchone()[0] is True
    assert claim(p, "order-1", {"amount": 10}, scope="tenant-3")[0] == "new"


def test_claim_many_and_complete_many_on_a_partitioned_store(p):
    keys = [f"b-{i}" for i in range(40)] + ["b-0"]
    rows = p.execute("SELECT ord, key, outcome::text, token FROM idempotency.claim_many(%s::text[], scope => 's')",
                     (keys,)).fetchall()
    assert [r[0] for r in rows] == list(range(1, 42))
    assert [r[2] for r in rows] == ["new"] * 40 + ["in_progress"]
    assert rows_per_partition(p) and sum(rows_per_partition(p).values()) == 40  # one scope: one partition
    firsts = rows[:40]
    done = p.execute("SELECT * FROM idempotency.complete_many(%s::text[], %s::jsonb[], scope => 's', "
                     "tokens => %s::bigint[])",
                     ([r[1] for r in firsts], ['{"ok": true}'] * 40, [r[3] for r in firsts])).fetchall()
    assert len(done) == 40
    again = p.execute("SELECT outcome::text, response FROM idempotency.claim_many(%s::text[], scope => 's')",
                      (keys,)).fetchall()
    assert again == [("replay", {"ok": True})] * 41


def test_takeover_gets_a_larger_token_and_the_stale_one_is_refused(p):
    first = claim(p, "job", {"n": 1}, scope="lease", lease="1 second")
    assert first[0] == "new"
    time.sleep(1.2)
    taken = claim(p, "job", {"n": 1}, scope="lease", lease="1 minute")
    assert taken[0] == "new" and taken[1] > first[1], (first, taken)
    with pytest.raises(psycopg.Error) as e:
        complete(p, "job", {"late": True}, scope="lease", token=first[1])
    assert e.value.sqlstate == "IK003"
    complete(p, "job", {"done": True}, scope="lease", token=taken[1])
    assert claim(p, "job", {"n": 1}, scope="lease")[:3] == ("replay", taken[1], {"done": True})
    assert p.execute("SELECT idempotency.release('gone', 'lease')").fetchone()[0] is False


def test_race_of_16_sessions_on_one_key(p, pinfo):
    barrier = threading.Barrier(16)
    outcomes, errors = [], []

    def run():
        try:
            with psycopg.connect(pinfo, autocommit=True) as c:
                barrier.wait()
                outcomes.append(claim(c, "race", {"x": 1}, scope="race-scope", lease="1 minute")[0])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(outcomes) == ["in_progress"] * 15 + ["new"]


@pytest.mark.native_only("the native edition's claim through SQL inserts first; the portable one answers in_progress")
def test_a_claim_meeting_an_open_completion_waits_for_it_then_replays(p, pinfo):
    """On a store only SQL reaches, a claim inserts first (one statement for a new key): a key
    whose row another transaction is completing makes that insert wait for the transaction (a
    lock wait, seen in pg_stat_activity), and the claim then replays what it committed."""
    r = claim(p, "open-complete", {"n": 1})
    assert r[0] == "new"
    got, errors = {}, []

    def retry():
        try:
            with psycopg.connect(pinfo, autocommit=True) as c:
                c.execute("SET application_name = 'open-complete-retry'")
                got["r"] = claim(c, "open-complete", {"n": 1})
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    with psycopg.connect(pinfo) as b:
        assert complete(b, "open-complete", {"ok": 1}, token=r[1], status=201) is not None
        t = threading.Thread(target=retry)
        t.start()
        deadline = time.monotonic() + 10
        waiting = None
        while time.monotonic() < deadline and not waiting:
            waiting = p.execute("SELECT wait_event_type FROM pg_stat_activity "
                                "WHERE application_name = 'open-complete-retry' AND wait_event_type = 'Lock'"
                                ).fetchone()
            time.sleep(0.05)
        assert waiting, "the retry's claim did not wait for the open completion"
        assert "r" not in got
        b.commit()
    t.join(10)
    assert not errors, errors
    assert got["r"] == ("replay", r[1], {"ok": 1}, 201)


def test_rolled_back_claim_leaves_the_key_new(p):
    with pytest.raises(RuntimeError):
        with p.transaction():
            assert claim(p, "buy", {"sku": 1}, scope="client-b")[0] == "new"
            raise RuntimeError("payment failed")
    assert claim(p, "buy", {"sku": 1}, scope="client-b")[0] == "new"


def test_sweep_deletes_only_expired_rows_in_every_partition(p):
    """The sweep matches rows by ctid, unique in one partition only: it runs partition by
    partition, so a live row at the same ctid in another partition stays."""
    live = [f"live-{i}" for i in range(120)]
    short = [f"short-{i}" for i in range(120)]
    for a, b in zip(live, short):  # interleaved: the same ctids in every partition
        t = claim(p, "k", scope=b, ttl="1 second", lease="1 second")[1]
        complete(p, "k", {"ok": 1}, scope=b, token=t)
        t = claim(p, "k", scope=a, ttl="1 hour")[1]
        complete(p, "k", {"ok": 1}, scope=a, token=t)
    time.sleep(1.2)
    swept = 0
    for _ in range(20):
        n = p.execute("SELECT idempotency.sweep(batch_size => 50)").fetchone()[0]
        swept += n
        if n == 0:
            break
    left = dict(p.execute("SELECT split_part(scope, '-', 1), count(*) FROM idempotency.idempotency_keys "
                          "GROUP BY 1").fetchall())
    assert left == {"live": len(live)}, left
    assert swept <= len(short)  # the background sweeper may have taken some
    stats = p.execute("SELECT rows_completed, rows_expired FROM idempotency.stats").fetchone()
    assert stats == (len(live), 0), stats


def test_stats_count_the_partitioned_store(p):
    """Rows by state; the counters too where the library is preloaded (else they read NULL)."""
    before = p.execute("SELECT claims_new, completions FROM idempotency.stats").fetchone()
    for i in range(10):
        t = claim(p, "s", scope=f"stats-{i}", lease="1 minute")[1]
        if i < 6:
            complete(p, "s", {"ok": 1}, scope=f"stats-{i}", token=t)
    row = p.execute("SELECT rows_in_progress, rows_completed, claims_new, completions, sweeper_enabled "
                    "FROM idempotency.stats").fetchone()
    assert row[:2] == (4, 6), row
    if row[4]:
        assert row[2:4] == (before[0] + 10, before[1] + 6), (before, row)
    else:
        assert row[2:4] == (None, None), row


def test_pg_dump_and_a_restore_with_the_setting_keep_the_partitioned_store(p, pinfo, cluster):
    t = claim(p, "dumped", {"v": 1}, scope="dump-scope")[1]
    complete(p, "dumped", {"v": 1}, scope="dump-scope", token=t)
    conn = ["-h", cluster.dir, "-p", str(cluster.port), "-U", "postgres"]
    dump = subprocess.run([f"{PG_BIN}/pg_dump", *conn, "-Fc", DB], check=True, capture_output=True).stdout
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        c.execute("DROP DATABASE IF EXISTS partitioned_restored WITH (FORCE)")
        c.execute("CREATE DATABASE partitioned_restored")
    try:
        env = dict(os.environ, PGOPTIONS=f"-c idempotency.partitions={PARTS}")
        subprocess.run([f"{PG_BIN}/pg_restore", *conn, "-d", "partitioned_restored", "--exit-on-error"],
                       input=dump, check=True, capture_output=True, env=env)
        info = pinfo.replace(f"dbname={DB}", "dbname=partitioned_restored")
        with psycopg.connect(info, autocommit=True) as r:
            assert r.execute("SELECT relkind::text FROM pg_class WHERE oid = "
                             "'idempotency.idempotency_keys'::regclass").fetchone()[0] == "p"
            assert claim(r, "dumped", {"v": 1}, scope="dump-scope")[:3] == ("replay", t, {"v": 1})
            assert claim(r, "new-after-restore", scope="dump-scope")[1] > t
    finally:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
            c.execute("DROP DATABASE IF EXISTS partitioned_restored WITH (FORCE)")
