"""claim_many and complete_many: each position answers as claim / complete would alone, in
input order; bad arrays are refused naming the argument, with nothing written."""

import psycopg
import pytest
from psycopg.types.json import Jsonb

from cluster import Cluster
from helpers import claim

COLS = "ord, key, outcome::text, token, response, response_status, retry_after, expires_at, recovery_point"


def claim_many(conn, keys, requests=None, **kw):
    args = "".join(f", {k} => %({k})s" for k in kw)
    reqs = None if requests is None else [None if r is None else Jsonb(r) for r in requests]
    return conn.execute(
        f"SELECT {COLS} FROM idempotency.claim_many(%(keys)s::text[], %(requests)s::jsonb[]{args})",
        {"keys": keys, "requests": reqs, **kw},
    ).fetchall()


def complete_many(conn, keys, responses, **kw):
    args = "".join(f", {k} => %({k})s" for k in kw)
    resp = None if responses is None else [None if r is None else Jsonb(r) for r in responses]
    return [r[0] for r in conn.execute(
        f"SELECT * FROM idempotency.complete_many(%(keys)s::text[], %(responses)s::jsonb[]{args})",
        {"keys": keys, "responses": resp, **kw},
    ).fetchall()]


def rows(conn):
    return conn.execute(
        "SELECT scope, key, status::text, token, response, response_status FROM idempotency.idempotency_keys ORDER BY 1, 2"
    ).fetchall()


def test_fresh_keys_are_new_in_input_order_with_increasing_tokens(db):
    keys = [f"m{i}" for i in (5, 3, 9, 1, 7)]
    out = claim_many(db, keys, [{"n": i} for i in range(5)])
    assert [r[0] for r in out] == [1, 2, 3, 4, 5]
    assert [r[1] for r in out] == keys
    assert {r[2] for r in out} == {"new"}
    tokens = [r[3] for r in out]
    assert len(set(tokens)) == 5 and all(t is not None for t in tokens)
    assert all(r[7] is not None for r in out)
    assert len(rows(db)) == 5
    # each row is the claim claim() would have written: a retry with the same request is in progress
    assert claim(db, "m3", {"n": 1})[0] == "in_progress"
    assert claim(db, "m3", {"n": 2})[0] == "mismatch"


@pytest.mark.parametrize("path", ["direct", "sql"])
def test_every_outcome_per_position(db, path):
    # The fresh keys' set-based insert goes below SQL, or through one INSERT statement when
    # the direct writes are off (as for a table with a trigger or a publication).
    db.execute(f"SET idempotency.force_sql_path = {'on' if path == 'sql' else 'off'}")
    claim(db, "done", {"a": 1})
    db.execute("SELECT idempotency.complete('done', '{\"ok\":1}', 201)")
    claim(db, "busy", {"a": 1})
    claim(db, "other", {"a": 1})
    claim(db, "old", {"a": 1}, ttl="1 second")
    db.execute("UPDATE idempotency.idempotency_keys SET expires_at = now() - interval '1 second', "
               "locked_until = now() - interval '1 second', created_at = now() - interval '1 hour' WHERE key = 'old'")
    out = claim_many(db, ["fresh", "done", "busy", "other", "old"], [{"a": 1}] * 3 + [{"a": 2}, {"a": 1}])
    assert [(r[1], r[2]) for r in out] == [
        ("fresh", "new"), ("done", "replay"), ("busy", "in_progress"), ("other", "mismatch"), ("old", "new")]
    assert out[1][4] == {"ok": 1} and out[1][5] == 201
    assert out[2][6] is not None  # retry_after
    old_token = db.execute("SELECT token FROM idempotency.idempotency_keys WHERE key = 'old'").fetchone()[0]
    assert out[4][3] == old_token


def test_lease_over_is_a_takeover_with_recovery_point(db):
    t = claim(db, "slow", {"a": 1})[1]
    db.execute("SELECT idempotency.checkpoint('slow', 'step-2', token => %s)", (t,))
    db.execute("UPDATE idempotency.idempotency_keys SET locked_until = now() - interval '1 second' WHERE key = 'slow'")
    out = claim_many(db, ["slow"], [{"a": 1}])
    assert out[0][2] == "new" and out[0][3] > t and out[0][8] == "step-2"


def test_repeated_key_later_positions_answer_as_duplicates(db):
    out = claim_many(db, ["x", "y", "x", "x"], [{"v": 1}, {"v": 1}, {"v": 1}, {"v": 2}])
    assert [r[2] for r in out] == ["new", "new", "in_progress", "mismatch"]
    assert len(rows(db)) == 2


def test_requests_null_array_and_null_element_skip_the_hash_check(db):
    claim(db, "h", {"a": 1})
    out = claim_many(db, ["h", "n1"], None)
    assert [r[2] for r in out] == ["in_progress", "new"]
    out = claim_many(db, ["h", "n2"], [None, {"b": 1}])
    assert [r[2] for r in out] == ["in_progress", "new"]
    hashes = dict(db.execute("SELECT key, request_hash IS NULL FROM idempotency.idempotency_keys").fetchall())
    assert hashes == {"h": False, "n1": True, "n2": False}


def test_ttl_and_lease_are_applied_to_each_key(db):
    out = claim_many(db, ["t1", "t2"], ttl="1 hour", lease="10 minutes")
    r = db.execute("SELECT key, expires_at - created_at, locked_until - created_at FROM idempotency.idempotency_keys ORDER BY key").fetchall()
    import datetime
    assert all(x[1] == datetime.timedelta(hours=1) and x[2] == datetime.timedelta(minutes=10) for x in r)
    assert {o[2] for o in out} == {"new"}


def test_scope_is_applied(db):
    claim_many(db, ["s1"], scope="tenant-a")
    assert rows(db)[0][0] == "tenant-a"
    assert claim_many(db, ["s1"], scope="tenant-b")[0][2] == "new"


def test_empty_batch_returns_no_rows(db):
    assert claim_many(db, []) == []
    assert complete_many(db, [], []) == []


@pytest.mark.parametrize("path", ["direct", "sql"])
def test_large_batch_spans_several_statements(db, path):
    # The fresh keys' set-based insert goes below SQL, or through one INSERT statement when
    # the direct writes are off (as for a table with a trigger or a publication).
    db.execute(f"SET idempotency.force_sql_path = {'on' if path == 'sql' else 'off'}")
    keys = [f"big{i}" for i in range(1000)] + ["big5"]
    out = claim_many(db, keys)
    assert [r[2] for r in out] == ["new"] * 1000 + ["in_progress"]
    assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 1000


@pytest.mark.parametrize("path", ["direct", "sql"])
def test_uncommitted_claim_in_another_session_is_busy_without_waiting(connect, path):
    a, b = connect(autocommit=False), connect()
    b.execute(f"SET idempotency.force_sql_path = {'on' if path == 'sql' else 'off'}")
    claim(a, "pending")
    b.execute("SET statement_timeout = '5s'")
    out = claim_many(b, ["pending", "free"])
    assert [r[2] for r in out] == ["in_progress", "new"]
    a.rollback()


def test_one_transaction_rollback_removes_the_batch(connect):
    a = connect(autocommit=False)
    claim_many(a, ["r1", "r2"])
    a.rollback()
    assert claim_many(a, ["r1"])[0][2] == "new"
    a.commit()


def test_complete_many_stores_each_response_in_order(db):
    out = claim_many(db, ["c1", "c2", "c3"])
    tokens = [r[3] for r in out]
    exp = complete_many(db, ["c3", "c1", "c2"], [{"r": 3}, {"r": 1}, None],
                        response_statuses=[203, 201, 202], tokens=[tokens[2], tokens[0], None], ttl="2 hours")
    assert len(exp) == 3 and all(e is not None for e in exp)
    assert rows(db) == [("", "c1", "completed", tokens[0], {"r": 1}, 201),
                        ("", "c2", "completed", tokens[1], None, 202),
                        ("", "c3", "completed", tokens[2], {"r": 3}, 203)]
    again = claim_many(db, ["c1", "c2"])
    assert [(r[2], r[4], r[5]) for r in again] == [("replay", {"r": 1}, 201), ("replay", None, 202)]


def test_complete_many_defaults_status_200_and_null_responses(db):
    claim_many(db, ["d1", "d2"])
    complete_many(db, ["d1", "d2"], None)
    assert [r[5] for r in rows(db)] == [200, 200]


@pytest.mark.parametrize("case,state", [
    ("IK001", "absent"), ("IK002", "completed"), ("IK003", "stale token")])
def test_complete_many_raises_completes_error_and_writes_nothing(db, case, state):
    out = claim_many(db, ["ok", "bad"])
    tokens = [out[0][3], out[1][3]]
    if state == "absent":
        keys = ["ok", "missing"]
    elif state == "completed":
        db.execute("SELECT idempotency.complete('bad', '{}')")
        keys = ["ok", "bad"]
    else:
        keys = ["ok", "bad"]
        tokens[1] = tokens[1] - 1000
    before = rows(db)
    with pytest.raises(psycopg.Error) as e:
        complete_many(db, keys, [{}, {}], tokens=tokens)
    assert e.value.sqlstate == case
    assert rows(db) == before


BAD_CLAIM_MANY = [
    ("SELECT * FROM idempotency.claim_many(NULL)", "22004", "keys"),
    ("SELECT * FROM idempotency.claim_many(ARRAY['a', NULL])", "22004", "keys[2]"),
    ("SELECT * FROM idempotency.claim_many(ARRAY['a', ''])", "22023", "keys[2]"),
    ("SELECT * FROM idempotency.claim_many(ARRAY[repeat('k', 256)])", "22023", "keys[1]"),
    ("SELECT * FROM idempotency.claim_many(ARRAY[['a'], ['b']])", "2202E", "keys"),
    ("SELECT * FROM idempotency.claim_many(ARRAY['a', 'b'], ARRAY['{}']::jsonb[])", "22023", "requests"),
    ("SELECT * FROM idempotency.claim_many(ARRAY['a'], ARRAY[['{}']]::jsonb[])", "2202E", "requests"),
    ("SELECT * FROM idempotency.claim_many(ARRAY['a'], scope => NULL)", "22004", "scope"),
    ("SELECT * FROM idempotency.claim_many(ARRAY['a'], ttl => '-1 hour')", "22023", "ttl"),
    ("SELECT * FROM idempotency.claim_many(ARRAY['a'], ttl => '1 hour', lease => '2 hours')", "22023", "lease"),
]

BAD_COMPLETE_MANY = [
    ("SELECT * FROM idempotency.complete_many(NULL, NULL)", "22004", "keys"),
    ("SELECT * FROM idempotency.complete_many(ARRAY['a', NULL], NULL)", "22004", "keys[2]"),
    ("SELECT * FROM idempotency.complete_many(ARRAY[['a'], ['b']], NULL)", "2202E", "keys"),
    ("SELECT * FROM idempotency.complete_many(ARRAY['a', 'b'], ARRAY['{}']::jsonb[])", "22023", "responses"),
    ("SELECT * FROM idempotency.complete_many(ARRAY['a'], NULL, ARRAY[200, 201])", "22023", "response_statuses"),
    ("SELECT * FROM idempotency.complete_many(ARRAY['a'], NULL, ARRAY[NULL]::int[])", "22004", "response_statuses[1]"),
    ("SELECT * FROM idempotency.complete_many(ARRAY['a'], NULL, ARRAY[99])", "22023", "response_statuses[1]"),
    ("SELECT * FROM idempotency.complete_many(ARRAY['a'], NULL, tokens => ARRAY[1, 2]::bigint[])", "22023", "tokens"),
    ("SELECT * FROM idempotency.complete_many(ARRAY['a'], NULL, tokens => ARRAY[[1]]::bigint[])", "2202E", "tokens"),
]


@pytest.mark.parametrize("sql,code,arg", BAD_CLAIM_MANY + BAD_COMPLETE_MANY)
def test_bad_arrays_are_refused_naming_the_argument_and_write_nothing(db, sql, code, arg):
    claim_many(db, ["a", "b"])
    before = rows(db)
    with pytest.raises(psycopg.Error) as e:
        db.execute(sql)
    assert e.value.sqlstate == code, e.value
    assert arg in str(e.value)
    assert rows(db) == before


def test_bad_element_late_in_the_batch_writes_nothing(db):
    with pytest.raises(psycopg.Error) as e:
        db.execute("SELECT * FROM idempotency.claim_many(ARRAY['p1', 'p2', 'p3'], ARRAY['{}', '{}', NULL]::jsonb[], ttl => '0 seconds')")
    assert e.value.sqlstate == "22023"
    assert rows(db) == []


def test_hashed_keys_and_counters(cluster, connect):
    db = connect()
    before = db.execute("SELECT claims_new, claims_in_progress FROM idempotency.stats").fetchone()
    claim_many(db, ["cnt1", "cnt2", "cnt1"])
    after = db.execute("SELECT claims_new, claims_in_progress FROM idempotency.stats").fetchone()
    if before[0] is not None:
        assert (after[0] - before[0], after[1] - before[1]) == (2, 1)


def test_audit_rows_for_complete_many(db):
    db.execute("SET idempotency.audit = on")
    claim_many(db, ["au1", "au2"])
    n = db.execute("SELECT count(*) FROM idempotency.audit").fetchone()[0]
    complete_many(db, ["au1", "au2"], [{}, {}])
    assert db.execute("SELECT count(*) FROM idempotency.audit").fetchone()[0] == n + 2


def test_app_role_with_only_the_documented_grants(cluster, connect):
    admin = connect()
    admin.execute("DROP ROLE IF EXISTS batch_app")
    admin.execute("CREATE ROLE batch_app LOGIN")
    admin.execute("GRANT USAGE ON SCHEMA idempotency TO batch_app")
    app = connect()
    app.execute("SET ROLE batch_app")
    out = claim_many(app, ["g1", "g2"], scope="app")
    assert [r[2] for r in out] == ["new", "new"]
    exp = complete_many(app, ["g1", "g2"], [{}, {}], scope="app", tokens=[out[0][3], out[1][3]])
    assert len(exp) == 2
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        app.execute("SELECT * FROM idempotency.idempotency_keys")
    app.execute("RESET ROLE")


def test_scope_prefix_is_enforced(cluster, connect):
    admin = connect()
    admin.execute("DROP ROLE IF EXISTS batch_tenant")
    admin.execute("CREATE ROLE batch_tenant LOGIN")
    admin.execute("GRANT USAGE ON SCHEMA idempotency TO batch_tenant")
    admin.execute("ALTER ROLE batch_tenant SET idempotency.scope_prefix = 'tenant-a/'")
    conn = psycopg.connect(cluster.conninfo().replace("user=postgres", "user=batch_tenant"), autocommit=True)
    try:
        assert conn.execute("SHOW idempotency.scope_prefix").fetchone()[0] == "tenant-a/"
        assert claim_many(conn, ["k"], scope="tenant-a/x")[0][2] == "new"
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            claim_many(conn, ["k2"], scope="tenant-b/x")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            complete_many(conn, ["k"], [{}], scope="tenant-b/x")
        assert complete_many(conn, ["k"], [{}], scope="tenant-a/x")[0] is not None
    finally:
        conn.close()
    assert rows(admin) == [("tenant-a/x", "k", "completed", rows(admin)[0][3], {}, 200)]


@pytest.fixture
def hashed_cluster():
    c = Cluster(settings={"log_min_messages": "warning"}, dbname="batchhashed").start()
    with psycopg.connect(c.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION idempotency")
    yield c
    c.destroy()


def test_hashed_keys_store_no_plain_key_and_answer_as_claim(hashed_cluster):
    with psycopg.connect(hashed_cluster.conninfo(), autocommit=True) as db:
        db.execute("SELECT idempotency.set_key_storage('sha256')")
        claim(db, "plain-existing", {"a": 1})
        out = claim_many(db, ["plain-existing", "plain-new", "plain-new"], [{"a": 1}] * 3)
        assert [(r[1], r[2]) for r in out] == [
            ("plain-existing", "in_progress"), ("plain-new", "new"), ("plain-new", "in_progress")]
        stored = [r[0] for r in db.execute("SELECT key FROM idempotency.idempotency_keys").fetchall()]
        assert len(stored) == 2 and not any(k.startswith("plain") for k in stored)
        assert claim(db, "plain-new", {"a": 1})[0] == "in_progress"
        complete_many(db, ["plain-new"], [{"ok": True}], tokens=[out[1][3]])
        assert claim(db, "plain-new", {"a": 1})[0] == "replay"


def test_queue_pattern_handles_a_batch_with_claim_many(cluster, connect):
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "patterns", "queue.sql")
    db = connect()
    db.execute(open(path).read())
    db.execute("TRUNCATE queue.messages, queue.dead_letters, queue.points_ledger RESTART IDENTITY")
    for i in range(8):
        db.execute("SELECT queue.publish(%s, %s)", (f"bm-{i}", Jsonb({"customer": "c", "points": i})))
    db.execute("SELECT queue.publish('bm-3', %s)", (Jsonb({"customer": "c", "points": 3}),))   # duplicate in the batch
    db.execute("SELECT queue.publish('bm-5', %s)", (Jsonb({"customer": "c", "points": 500}),))  # id reused
    claim(db, "bm-7", {"customer": "c", "points": 7}, scope="queue:points")
    db.execute("SELECT idempotency.complete('bm-7', '{}', scope => 'queue:points')")           # done before
    counts = db.execute(
        "SELECT queue.handle_batch(ARRAY(SELECT m FROM queue.receive_batch(10, '2 seconds') AS m ORDER BY m.id), 'c1', '2 seconds')"
    ).fetchone()[0]
    assert counts == {"processed": 7, "acked_duplicate": 1, "requeued": 1, "dead_lettered": 1}
    assert db.execute("SELECT count(*), sum(points) FROM queue.points_ledger").fetchone() == (7, 0 + 1 + 2 + 3 + 4 + 5 + 6)
    assert db.execute("SELECT message_id FROM queue.messages").fetchall() == [("bm-3",)]
    assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE scope = 'queue:points' AND status = 'completed'").fetchone()[0] == 8


def test_key_being_completed_by_an_open_transaction_does_not_make_the_batch_wait(connect):
    a, b = connect(), connect(autocommit=False)
    t = claim(a, "completing")[1]
    b.execute("SELECT idempotency.complete('completing', '{}', token => %s)", (t,))  # not committed
    a.execute("SET statement_timeout = '5s'")
    out = claim_many(a, ["completing", "fresh-1", "fresh-2"])
    assert [r[2] for r in out] == ["in_progress", "new", "new"]
    b.commit()
    assert claim_many(a, ["completing"])[0][2] == "replay"


def test_batch_inside_a_plpgsql_exception_block(db):
    claim(db, "exists")
    db.execute("""DO $$
        BEGIN
            BEGIN
                PERFORM * FROM idempotency.claim_many(ARRAY['blk-1', 'exists', 'blk-2']);
                RAISE EXCEPTION 'undo';
            EXCEPTION WHEN raise_exception THEN NULL;
            END;
            PERFORM * FROM idempotency.claim_many(ARRAY['blk-3']);
        END $$""")
    assert [r[1] for r in rows(db)] == ["blk-3", "exists"]


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_claim_many_agrees_with_claim_on_a_store_with_an_insert_rule(db, isolation):
    """0.4.0: with an ON INSERT rule on the store (an owner's change, which claim handles through
    its SQL insert), claim_many failed ("INSERT with ON CONFLICT clause cannot be used with table
    that has INSERT or UPDATE rules") where claim of the same keys answered new."""
    db.execute("CREATE TABLE public.seen_by_rule (key text)")
    db.execute("CREATE RULE note_insert AS ON INSERT TO idempotency.idempotency_keys "
               "DO ALSO INSERT INTO public.seen_by_rule VALUES (NEW.key)")
    try:
        assert db.execute("SELECT count(*) FROM pg_rules WHERE tablename = 'idempotency_keys'").fetchone()[0] == 1

        def outcome(f):
            with db.transaction():
                db.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
                try:
                    return "ok", f()
                except psycopg.Error as e:
                    return "error", e.sqlstate

        one = outcome(lambda: [claim(db, k)[0] for k in ("r-1", "r-2")])
        many = outcome(lambda: [r[2] for r in claim_many(db, ["m-1", "m-2", "r-1"])])
        if one[0] == "ok":
            assert one == ("ok", ["new", "new"])
            assert many == ("ok", ["new", "new", "in_progress"]), many
            assert sorted(r[0] for r in db.execute("SELECT key FROM public.seen_by_rule").fetchall()) \
                == ["m-1", "m-2", "r-1", "r-2"]
        else:
            assert many == one, (one, many)
        assert isolation == "repeatable read" or one[0] == "ok", one
    finally:
        db.execute("DROP TABLE public.seen_by_rule CASCADE")
