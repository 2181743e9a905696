"""Under READ COMMITTED, claim inserts a fresh key and complete updates its row directly (heap and
indexes, no statement). These tests hold those writes to what the SQL statements they replace
would do: stale tokens and expired claims are refused, index entries are complete (amcheck), and
a table changed by hand (a trigger) goes back to the statements, so the trigger fires. The races
(a completion waits for a concurrent one and re-checks like UPDATE, an uncommitted claim is not
completed by another session) are isolation specs: tests/isolation/specs/claim-complete.spec."""

import time

import psycopg
import pytest
from psycopg.types.json import Jsonb

from helpers import claim, paths_taken


def complete(conn, key, response, **kw):
    args = "".join(f", {k} => %({k})s" for k in kw)
    return conn.execute(f"SELECT idempotency.complete(%(key)s, %(response)s{args})",
                        {"key": key, "response": Jsonb(response), **kw}).fetchone()[0]


def sqlstate_of(fn):
    try:
        fn()
    except psycopg.Error as e:
        return e.sqlstate
    return None


def test_stale_token_and_expired_claim_are_refused_and_change_nothing(connect):
    a = connect()
    first = claim(a, "cc-4", None, lease="1 second")
    time.sleep(1.1)
    second = claim(a, "cc-4", None)
    assert second[0] == "new" and second[1] > first[1]
    assert sqlstate_of(lambda: complete(a, "cc-4", {"v": 1}, token=first[1])) == "IK003"
    assert claim(a, "cc-4", None)[0] == "in_progress"
    assert claim(a, "cc-5", None, ttl="1 second", lease="1 second")[0] == "new"
    time.sleep(1.1)
    assert sqlstate_of(lambda: complete(a, "cc-5", {"v": 1})) == "IK001"
    assert a.execute("SELECT status::text FROM idempotency.idempotency_keys WHERE key = 'cc-5'").fetchone()[0] \
        == "in_progress"


def test_one_transaction_claim_and_complete_write_a_consistent_row_and_indexes(connect):
    a = connect()
    a.execute("CREATE EXTENSION IF NOT EXISTS amcheck")
    for i in range(300):
        with a.transaction():
            assert claim(a, f"ix-{i}", {"i": i})[0] == "new"
            # A different TTL moves expires_at (a non-HOT update with new index entries).
            complete(a, f"ix-{i}", {"i": i}, ttl="3 days" if i % 2 else None)
    row = a.execute("""SELECT status::text, response, response_status, locked_until, completed_at = created_at,
                              expires_at - completed_at, ttl, length(request_hash)
                         FROM idempotency.idempotency_keys WHERE key = 'ix-1'""").fetchone()
    assert row[0] == "completed" and row[1] == {"i": 1} and row[2] == 200 and row[3] is None and row[4]
    assert row[5] == row[6] and row[6].days == 3 and row[7] == 32
    a.execute("SET enable_seqscan = off")
    assert a.execute("SELECT count(*) FROM idempotency.idempotency_keys "
                     "WHERE expires_at > now() + interval '2 days'").fetchone()[0] == 150
    for index in ("idempotency_keys_pkey", "idempotency_keys_sweep_idx"):
        a.execute("SELECT bt_index_check(%s::regclass, heapallindexed => true)", (f"idempotency.{index}",))
    # The claims replay from the index probe.
    assert all(claim(a, f"ix-{i}", {"i": i})[0] == "replay" for i in range(0, 300, 37))


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_snapshot_isolation_uses_the_statements(connect, isolation):
    """Under REPEATABLE READ a row completed by a transaction that committed after the snapshot
    is a serialization failure, as the UPDATE statement makes it."""
    a, b = connect(), connect()
    assert claim(a, "rr-1", None)[0] == "new"
    b.execute(f"BEGIN ISOLATION LEVEL {isolation}")
    b.execute("SELECT 1 FROM idempotency.lookup('rr-1')").fetchall()  # takes the snapshot
    complete(a, "rr-1", {"by": "a"})
    assert sqlstate_of(lambda: complete(b, "rr-1", {"by": "b"})) == "40001"
    b.execute("ROLLBACK")


def test_a_trigger_added_by_hand_sends_writes_through_sql(connect):
    a = connect()
    a.execute("CREATE TABLE IF NOT EXISTS public.seen (key text, op text)")
    a.execute("""CREATE OR REPLACE FUNCTION public.note() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN INSERT INTO public.seen VALUES (NEW.key, TG_OP); RETURN NEW; END $$""")
    a.execute("CREATE TRIGGER note AFTER INSERT OR UPDATE ON idempotency.idempotency_keys "
              "FOR EACH ROW EXECUTE FUNCTION public.note()")
    try:
        with a.transaction():
            assert claim(a, "trig-1", None)[0] == "new"
            complete(a, "trig-1", {"ok": True})
        assert a.execute("SELECT op FROM public.seen WHERE key = 'trig-1' ORDER BY op").fetchall() \
            == [("INSERT",), ("UPDATE",)]
    finally:
        a.execute("DROP TRIGGER note ON idempotency.idempotency_keys")
    with a.transaction():
        assert claim(a, "trig-2", None)[0] == "new"
        complete(a, "trig-2", {"ok": True})
    assert a.execute("SELECT count(*) FROM public.seen WHERE key = 'trig-2'").fetchone()[0] == 0
    assert claim(a, "trig-2", None)[0] == "replay"
    a.execute("DROP TABLE public.seen")
    a.execute("DROP FUNCTION public.note()")


def test_replays_return_stored_responses_of_every_size_and_storage(connect):
    """A replay reads the row below SQL and copies its columns out before the scan ends: small
    responses stored inline with a one-byte header, compressed ones, and ones stored out of line
    must come back exactly, as REPEATABLE READ's SQL path returns them."""
    import random
    r = random.Random(42)
    a, b = connect(), connect()
    responses = {
        "small": {"ok": True},
        "compressible": {"items": ["same text again"] * 2000},
        "out-of-line": {"blob": "".join(r.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(300_000))},
    }
    for name, response in responses.items():
        assert claim(a, f"size-{name}", {"n": name})[0] == "new"
        complete(a, f"size-{name}", response)
    stored = dict(b.execute(
        "SELECT key, pg_column_size(response) FROM idempotency.idempotency_keys WHERE key LIKE 'size-%'").fetchall())
    assert stored["size-small"] < 127 and stored["size-compressible"] < 10_000 and stored["size-out-of-line"] > 200_000
    for name, response in responses.items():
        row = claim(b, f"size-{name}", {"n": name})
        assert row[0] == "replay" and row[2] == response and row[3] == 200, name
        with b.transaction():
            b.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            assert claim(b, f"size-{name}", {"n": name})[2] == response, name


def test_force_sql_path_sends_writes_through_the_statements(connect):
    """With idempotency.force_sql_path on, a fresh claim's insert and a completion's update run
    as the INSERT and UPDATE statements (as a trigger on the table makes them, without one),
    and leave the same rows and answers as the direct writes do."""
    direct, forced = connect(), connect()
    forced.execute("SET idempotency.force_sql_path = on")
    taken = {}
    for conn, key in ((direct, "fsp-direct"), (forced, "fsp-sql")):
        def write():
            with conn.transaction():
                assert claim(conn, key, None)[0] == "new"
                complete(conn, key, {"ok": True}, response_status=201)
        taken[key] = paths_taken(conn, write)
        replay = claim(conn, key, None)
        assert replay[0] == "replay", replay
    assert taken["fsp-direct"] == ["claim direct", "complete direct"]
    assert taken["fsp-sql"] == ["claim forced_sql_writes", "complete forced_sql_writes"]
    rows = direct.execute(
        """SELECT key, status::text, response, response_status, locked_until IS NULL,
                  completed_at = created_at, expires_at - completed_at, request_hash IS NULL
             FROM idempotency.idempotency_keys WHERE key IN ('fsp-direct', 'fsp-sql')
            ORDER BY key""").fetchall()
    assert len(rows) == 2 and rows[0][1:] == rows[1][1:], rows
    # Off again, the same session writes directly (no statement prepared for it meanwhile).
    plain = connect()
    plain.execute("SET idempotency.force_sql_path = on")
    plain.execute("RESET idempotency.force_sql_path")

    def write():
        with plain.transaction():
            assert claim(plain, "fsp-reset", None)[0] == "new"
            complete(plain, "fsp-reset", {"ok": True})
    assert paths_taken(plain, write) == ["claim direct", "complete direct"]


@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"])
def test_each_call_reports_the_path_of_the_table_it_takes(connect, isolation):
    """Which path a call takes (docs/architecture.md) is decided once per call, and reported at
    DEBUG1: the direct path on the table as the extension made it under READ COMMITTED, the
    statements for the writes on a changed table (here a trigger), the snapshot path under
    REPEATABLE READ and SERIALIZABLE on either; a replay reports its path and writes nothing."""
    a = connect()
    a.execute("CREATE OR REPLACE FUNCTION public.keep() RETURNS trigger LANGUAGE plpgsql AS "
              "$$ BEGIN RETURN NEW; END $$")
    rc = isolation == "READ COMMITTED"
    for changed in (False, True):
        if changed:
            a.execute("CREATE TRIGGER keep BEFORE INSERT OR UPDATE ON idempotency.idempotency_keys "
                      "FOR EACH ROW EXECUTE FUNCTION public.keep()")
        key = f"path-{isolation}-{changed}"

        def calls():
            with a.transaction():
                a.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
                assert claim(a, key, {"n": 1})[0] == "new"
                complete(a, key, {"ok": True})
                assert claim(a, key, {"n": 1})[0] == "replay"
                a.execute("SELECT * FROM idempotency.claim_many(ARRAY[%s, %s], NULL)",
                          (key, key + "-2")).fetchall()
        try:
            taken = paths_taken(a, calls)
        finally:
            a.execute("DROP TRIGGER IF EXISTS keep ON idempotency.idempotency_keys")
        path = ("sql_writes" if changed else "direct") if rc else "snapshot"
        # claim_many claims the key it finds (and, off READ COMMITTED, every key) one by one.
        many = [f"claim_many {path}", "claim " + path] + ([] if rc else ["claim " + path])
        assert taken == [f"claim {path}", f"complete {path}", f"claim {path}"] + many, taken
        assert a.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key LIKE %s",
                         (key + "%",)).fetchone()[0] == 2
    a.execute("DROP FUNCTION public.keep()")
