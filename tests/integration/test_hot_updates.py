"""HOT completions and the sweep index.

A completion in a later transaction than its claim (the leased style) moves expires_at; the
sweeper's index is on the claim-time expiry (created_at + ttl) instead, so the completion
changes no indexed column and is a HOT update. The sweep still finds expired rows through that
index, never by a sequential scan, and deletes exactly the expired rows, including rows whose
expires_at is later than their sweep key (completed late or with a longer TTL). A HOT update
also needs room on the claim's page: the store's fill factor (25) keeps it for the completions,
also with 200 claims in flight."""

import os
import re

import pytest
from psycopg.types.json import Jsonb

from helpers import claim

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
RESPONSE = {"id": "msg_0123456789abcdef", "status": "sent", "to": "someone@example.com",
            "provider": "smtp", "queued_at": "2026-11-30T21:00:00Z"}


def hot_counters(conn):
    """(n_tup_upd, n_tup_hot_upd) of the store, with this session's counts flushed."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return conn.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                        "WHERE relid = 'idempotency.idempotency_keys'::regclass").fetchone()


def index_entries(conn, index):
    """Entries in the leaf pages of a btree index (pageinspect), without the high keys (the
    first item of every leaf page but the rightmost)."""
    conn.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
    return conn.execute("""SELECT coalesce(sum(s.live_items) - count(*) FILTER (WHERE s.btpo_next <> 0), 0)
                             FROM generate_series(1, pg_relation_size(%s::regclass) / 8192 - 1) AS b,
                                  LATERAL bt_page_stats(%s, b::int) AS s WHERE s.type = 'l'""",
                        (index, index)).fetchone()[0]


def sweep_sql(conn):
    """The sweep statement as the library runs it: a sweep (of an empty store) prepares it in the
    session, whose plan cache keeps its text as the identifier of its memory context."""
    assert conn.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 0
    conn.execute("SELECT idempotency.sweep()")
    texts = [r[0] for r in conn.execute(
        "SELECT ident FROM pg_backend_memory_contexts WHERE name = 'CachedPlanSource' "
        "AND ident LIKE 'DELETE FROM idempotency.idempotency_keys %' AND ident LIKE '%RETURNING%'")]
    assert len(texts) == 1, texts
    return texts[0]


def test_the_statements_sweep_key_is_the_expression_the_sweep_index_is_on():
    """Every statement that reads the sweep key is built from one text of it (`SWEEP_KEY`): it
    must be the expression the install script indexes, or the sweep would scan the table."""
    folder = os.path.join(ROOT, "src", "store", "sql")
    src = "".join(open(os.path.join(folder, name)).read() for name in sorted(os.listdir(folder)))
    key = re.search(r'pub\(crate\) const SWEEP_KEY: &str = "(.*?)";', src, re.S).group(1)
    script = open(os.path.join(ROOT, "sql", "idempotency.sql")).read()
    index = re.search(r"CREATE INDEX idempotency_keys_sweep_idx[^;]*;", script).group(0)
    assert key in " ".join(index.split()), (key, index)
    assert src.count("AT TIME ZONE 'UTC') OPERATOR(pg_catalog.+)") == 1, "a second copy of the sweep key"


@pytest.mark.parametrize("path", ["direct", "sql"])
@pytest.mark.parametrize("in_flight", [1, 8])
def test_leased_completions_in_later_transactions_are_hot_updates(connect, path, in_flight):
    a = connect()
    if path == "sql":
        a.execute("SET idempotency.force_sql_path = on")
    n = 200
    keys = [f"hot-{path}-{in_flight}-{i}" for i in range(n)]
    upd0, hot0 = hot_counters(a)
    tokens = {}
    for start in range(0, n, in_flight):
        group = keys[start:start + in_flight]
        for k in group:  # each claim commits on its own (autocommit)...
            outcome, token, *_ = claim(a, k, {"k": k}, lease="5 minutes")
            assert outcome == "new"
            tokens[k] = token
        for k in group:  # ...and each completion in a later transaction
            a.execute("SELECT idempotency.complete(%s, %s, token => %s)", (k, Jsonb(RESPONSE), tokens[k]))
    upd1, hot1 = hot_counters(a)
    # The setup: every key exists, completed in a transaction after its claim's (expires_at
    # moved past the claim-time expiry: the column the old sweep index covered changed).
    done = a.execute("""SELECT count(*) FILTER (WHERE status = 'completed' AND completed_at > created_at
                                                  AND expires_at > created_at + ttl)
                          FROM idempotency.idempotency_keys WHERE key LIKE %s""",
                     (f"hot-{path}-{in_flight}-%",)).fetchone()[0]
    assert done == n
    updates, hot = upd1 - upd0, hot1 - hot0
    assert updates >= n
    assert hot / updates >= 0.9, (updates, hot)
    # The rows read back as completed.
    assert all(claim(a, k, {"k": k})[0] == "replay" for k in keys[::37])
    # A HOT update adds no index entry: after a vacuum (which removes the entries of rows other
    # tests deleted) each index holds one entry per row, not one per version.
    a.execute("VACUUM idempotency.idempotency_keys")
    rows = a.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0]
    assert rows == n
    for index in ("idempotency.idempotency_keys_pkey", "idempotency.idempotency_keys_sweep_idx"):
        assert index_entries(a, index) == rows, index


def filler_response(size, seed):
    """A JSON response of about `size` bytes of text whose body compresses little (random
    alphanumerics, like the ids and tokens of real responses)."""
    import json
    import random
    import string
    rng = random.Random(seed)
    doc = {"id": f"msg_{seed:016x}", "status": "sent", "provider": "smtp", "body": ""}
    doc["body"] = "".join(rng.choices(string.ascii_letters + string.digits, k=max(0, size - len(json.dumps(doc)))))
    return doc


@pytest.mark.parametrize("size", [100, 400, 2048])
def test_completions_stay_hot_with_200_claims_in_flight(connect, size):
    """Page space with many claims in flight (queue consumers holding many leased messages,
    webhook handlers with slow side effects): every claim on a page is in flight before the
    first of them completes, so the page must hold the completed rows of all the claims the
    fill factor let in. At fillfactor 90 a page took about 50 claims, room for the completed
    rows of 30 (100-byte responses) or 14 (400 bytes): the rest moved to other pages, non-HOT,
    adding an entry to each index (70% and 34% HOT)."""
    a = connect()
    in_flight, n = 200, 1200
    keys = [f"inflight-{size}-{i}" for i in range(n)]
    upd0, hot0 = hot_counters(a)
    pending = []
    for i, k in enumerate(keys + [None] * in_flight):
        if k is not None:  # each claim commits on its own...
            outcome, token, *_ = claim(a, k, {"k": k}, lease="5 minutes")
            assert outcome == "new"
            pending.append((k, token))
        if len(pending) > in_flight or (k is None and pending):  # ...completed 200 claims later
            done_key, token = pending.pop(0)
            a.execute("SELECT idempotency.complete(%s, %s, token => %s)",
                      (done_key, Jsonb(filler_response(size, i)), token))
    upd1, hot1 = hot_counters(a)
    # The setup: every key completed with a response of the size asked, in a later transaction.
    done, length = a.execute("""SELECT count(*) FILTER (WHERE status = 'completed' AND completed_at > created_at),
                                       min(length(response::text))
                                  FROM idempotency.idempotency_keys WHERE key LIKE %s""",
                             (f"inflight-{size}-%",)).fetchone()
    assert done == n
    assert size * 0.9 <= length <= size * 1.1
    updates, hot = upd1 - upd0, hot1 - hot0
    assert updates == n
    assert hot / updates >= 0.9, (updates, hot)


def fill(conn, rows):
    """`rows` completed keys written straight into the table as claims make them, with a
    one-hour TTL: every other one expired 5 to 60 minutes ago, the others expire 5 to 60 minutes
    from now (none while the test runs)."""
    conn.execute("""INSERT INTO idempotency.idempotency_keys AS k
                        (key, status, token, created_at, completed_at, expires_at, ttl, response, response_status)
                    SELECT 'bulk-' || i, 'completed', i, e - interval '1 hour', e - interval '1 hour', e,
                           interval '1 hour', '{}', 200
                      FROM (SELECT i, now() + CASE WHEN i %% 2 = 0 THEN -1 ELSE 1 END
                                              * (interval '5 minutes' + random() * interval '55 minutes') AS e
                              FROM generate_series(1, %s::int) AS i) AS s""", (rows,))


def test_the_sweep_finds_expired_rows_through_the_index_not_a_sequential_scan(connect):
    a = connect()
    statement = sweep_sql(a)
    fill(a, 50_000)
    a.execute("ANALYZE idempotency.idempotency_keys")
    assert a.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 50_000
    a.execute(f"PREPARE sweep_stmt(bigint, text, timestamp) AS {statement}")
    for mode in ("force_custom_plan", "force_generic_plan"):
        a.execute(f"SET plan_cache_mode = {mode}")
        for start in ("-infinity", "2000-01-01"):
            plan = "\n".join(r[0] for r in a.execute(
                f"EXPLAIN EXECUTE sweep_stmt(10000, '', '{start}')").fetchall())
            assert "Seq Scan" not in plan, plan
            assert "idempotency_keys_sweep_idx" in plan, plan
    a.execute("DEALLOCATE sweep_stmt")
    a.execute("RESET plan_cache_mode")
    expired = a.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE expires_at <= now()").fetchone()[0]
    assert expired == 25_000
    assert a.execute("SELECT idempotency.sweep()").fetchone()[0] == expired
    assert a.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 50_000 - expired


@pytest.mark.parametrize("batch", [1, 3, 1000])
def test_the_sweep_deletes_every_expired_row_and_no_live_one(connect, batch):
    """Rows whose sweep key (created_at + ttl) has passed but whose expires_at has not (completed
    late or with a longer TTL) stay, ahead of and among expired rows in the index; every expired
    row goes, whatever the batch size (each batch starts where the last one ended)."""
    a = connect()
    # (key, created_at ago, ttl, expires_at from now): sweep key = now - ago + ttl.
    rows = [
        ("expired-plain", "3 hours", "1 hour", "-2 hours"),
        ("expired-late", "3 hours", "1 hour", "-1 minute"),          # completed ~2 h late
        ("live-late", "3 hours", "1 hour", "1 minute"),              # key passed long ago
        ("live-late-2", "2 hours", "1 hour", "10 minutes"),
        ("expired-shorter-ttl", "2 hours", "30 minutes", "-30 minutes"),
        ("live-longer-ttl", "90 minutes", "1 hour", "2 hours"),
        ("expired-recent", "70 minutes", "1 hour", "-5 minutes"),
        ("live-late-3", "61 minutes", "1 hour", "30 seconds"),
        ("expired-just", "50 minutes", "45 minutes", "-1 second"),
        ("live-fresh", "1 minute", "1 hour", "59 minutes"),
    ]
    for i, (key, ago, ttl, left) in enumerate(rows):
        a.execute("""INSERT INTO idempotency.idempotency_keys
                         (key, status, token, created_at, completed_at, expires_at, ttl, response, response_status)
                     VALUES (%s, 'completed', %s, now() - %s::interval, now() - %s::interval,
                             now() + %s::interval, %s::interval, '{}', 200)""",
                  (key, 1_000_000 + i, ago, ago, left, ttl))
    # And through the API: a claim completed with a longer TTL (its key moves with the TTL), and
    # claims whose one-second TTL runs out.
    assert claim(a, "api-longer-ttl", None, ttl="1 second")[0] == "new"
    a.execute("SELECT idempotency.complete('api-longer-ttl', '{}', ttl => '1 hour')")
    assert claim(a, "api-expired", None, ttl="1 second")[0] == "new"
    a.execute("SELECT idempotency.complete('api-expired', '{}')")
    assert claim(a, "api-expired-in-progress", None, ttl="1 second")[0] == "new"
    a.execute("SELECT pg_sleep(1.1)")
    expired = {r[0] for r in a.execute(
        "SELECT key FROM idempotency.idempotency_keys WHERE expires_at <= now()").fetchall()}
    assert expired == {"expired-plain", "expired-late", "expired-shorter-ttl", "expired-recent",
                       "expired-just", "api-expired", "api-expired-in-progress"}
    passed = {r[0] for r in a.execute(
        """SELECT key FROM idempotency.idempotency_keys
            WHERE (created_at AT TIME ZONE 'UTC') + ttl <= now() AT TIME ZONE 'UTC' AND expires_at > now()""").fetchall()}
    assert passed == {"live-late", "live-late-2", "live-longer-ttl", "live-late-3"}
    live = {r[0] for r in a.execute(
        "SELECT key FROM idempotency.idempotency_keys WHERE expires_at > now()").fetchall()}
    assert a.execute("SELECT idempotency.sweep(%s)", (batch,)).fetchone()[0] == len(expired)
    left = {r[0] for r in a.execute("SELECT key FROM idempotency.idempotency_keys").fetchall()}
    assert left == live
    assert a.execute("SELECT idempotency.sweep(%s)", (batch,)).fetchone()[0] == 0


def test_a_store_not_yet_updated_is_swept_through_its_index_on_expires_at(connect):
    """The new library serves a 0.3.0 schema until ALTER EXTENSION UPDATE: without the sweep
    index it sweeps through the index on expires_at, never by sorting every expired row."""
    a = connect()
    a.execute("DROP INDEX idempotency.idempotency_keys_sweep_idx")
    a.execute("CREATE INDEX idempotency_keys_expires_at_idx ON idempotency.idempotency_keys (expires_at)")
    try:
        fill(a, 2_000)
        a.execute("ANALYZE idempotency.idempotency_keys")
        assert a.execute("SELECT idempotency.sweep(300)").fetchone()[0] == 1_000
        assert a.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE expires_at > now()").fetchone()[0] \
            == a.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 1_000
    finally:
        a.execute("DROP INDEX IF EXISTS idempotency.idempotency_keys_expires_at_idx")
        a.execute("CREATE INDEX IF NOT EXISTS idempotency_keys_sweep_idx ON idempotency.idempotency_keys "
                  "(((created_at AT TIME ZONE 'UTC') OPERATOR(pg_catalog.+) ttl))")
