"""The direct paths (the dirty-snapshot look-up, the direct insert and update) against the
review of 0.2.0:

- a look-up that races a committed update of an indexed column (created_at) must not take the
  miss for absence (driven deterministically with the debug-build pause between the index
  scan and the heap fetch, `idempotency.debug_probe_pause`);
- a column whose type was changed by hand is refused clearly (55000), never misread or
  miswritten, and the server does not crash;
- CHECK constraints are recognised by name and definition, a published table and a table with
  rules go through SQL (so the executor's replica-identity and row-filter checks and the rules
  apply), and a crafted jsonb value is XX001 in every function that reads jsonb."""

import threading
import time

import psycopg
import pytest
from psycopg.types.json import Jsonb

from helpers import claim

PAUSE_MS = 400


def complete(conn, key, response, **kw):
    args = "".join(f", {k} => %({k})s" for k in kw)
    return conn.execute(f"SELECT idempotency.complete(%(key)s, %(response)s{args})",
                        {"key": key, "response": Jsonb(response), **kw}).fetchone()[0]


def error_of(fn):
    try:
        fn()
    except psycopg.Error as e:
        return e.sqlstate, str(e)
    return None, None


def postmaster_start(conn):
    return conn.execute("SELECT pg_postmaster_start_time()").fetchone()[0]


@pytest.fixture
def reinstall(cluster):
    """Puts the extension back as CREATE EXTENSION makes it after a test that altered it."""
    yield
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("DROP PUBLICATION IF EXISTS idem_pub")
        conn.execute("DROP EXTENSION idempotency CASCADE")
        conn.execute("CREATE EXTENSION idempotency")


# --- item 3: a look-up racing an update of an indexed column -------------------------------

def waiting_in_probe(a, pid):
    return a.execute("SELECT wait_event_type = 'Extension' FROM pg_stat_activity WHERE pid = %s",
                     (pid,)).fetchone()[0]


def race(connect, key, action, updates=3):
    """Runs `action(b)` in session B with the probe pause on; every time B waits between index
    and heap, session A commits a non-HOT update of the key's row (created_at is indexed, by the
    sweep index; moved earlier, as a restart moves it), for
    the first `updates` pauses. Returns (B's result or error, updates committed while B was
    inside a pause)."""
    a, b = connect(), connect()
    b.execute("SELECT idempotency.canonical_json('{}')")  # loads the library (and its settings)
    if b.execute("SELECT current_setting('idempotency.debug_probe_pause', true)").fetchone()[0] is None:
        pytest.skip("a release build: idempotency.debug_probe_pause exists in debug builds only")
    pid = b.info.backend_pid
    b.execute(f"SET idempotency.debug_probe_pause = {PAUSE_MS}")
    box = {}

    def run():
        try:
            box["result"] = action(b)
        except psycopg.Error as e:
            box["error"] = (e.sqlstate, str(e))

    t = threading.Thread(target=run)
    t.start()
    in_window = 0
    done = 0
    deadline = time.monotonic() + 60
    while t.is_alive() and time.monotonic() < deadline:
        if done < updates and waiting_in_probe(a, pid):
            n = a.execute("UPDATE idempotency.idempotency_keys SET created_at = created_at - interval '1 second' "
                          "WHERE key = %s", (key,)).rowcount
            assert n == 1
            done += 1
            # Committed (autocommit) while B still waits: B's index scan predates the update.
            if waiting_in_probe(a, pid):
                in_window += 1
            time.sleep(PAUSE_MS / 1000 + 0.05)  # let this pause end: the next one is a new one
        else:
            time.sleep(0.005)
    t.join(30)
    assert not t.is_alive()
    return box, in_window


def test_a_claim_that_races_an_update_of_the_row_still_replays(connect):
    a = connect()
    assert claim(a, "race-1", {"x": 1})[0] == "new"
    complete(a, "race-1", {"done": 1})
    box, in_window = race(connect, "race-1", lambda b: claim(b, "race-1", {"x": 1}))
    assert "error" not in box, box  # was 23505: the miss was taken for an absent key
    assert in_window >= 2, f"the updates did not land inside the look-up's window ({in_window})"
    assert box["result"][0] == "replay" and box["result"][2] == {"done": 1}, box
    assert a.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key = 'race-1'").fetchone()[0] == 1


def test_a_batch_claim_that_races_an_update_of_a_row_still_replays_it(connect):
    # claim_many inserts the keys its dirty look-up finds absent without confirming the miss:
    # the unique index catches the raced key, the batch's insert is undone and each key is
    # claimed one by one.
    a = connect()
    assert claim(a, "race-3", {"x": 3})[0] == "new"
    complete(a, "race-3", {"done": 3})

    def batch(b):
        return b.execute(
            "SELECT key, outcome::text, response FROM idempotency.claim_many("
            "ARRAY['race-3a', 'race-3', 'race-3b'], "
            "ARRAY['{\"x\": 0}', '{\"x\": 3}', '{\"x\": 0}']::jsonb[]) ORDER BY ord").fetchall()

    box, in_window = race(connect, "race-3", batch)
    assert "error" not in box, box
    assert in_window >= 2, f"the updates did not land inside the look-up's window ({in_window})"
    assert box["result"] == [("race-3a", "new", None), ("race-3", "replay", {"done": 3}),
                             ("race-3b", "new", None)], box
    assert a.execute("SELECT key, count(*) FROM idempotency.idempotency_keys WHERE key LIKE 'race-3%%' "
                     "GROUP BY key ORDER BY key").fetchall() == [("race-3", 1), ("race-3a", 1), ("race-3b", 1)]


def test_a_completion_that_races_an_update_of_the_row_completes(connect):
    a = connect()
    first = claim(a, "race-2", {"x": 2}, lease="10 minutes")
    assert first[0] == "new"
    token = first[1]
    box, in_window = race(connect, "race-2", lambda b: complete(b, "race-2", {"done": 2}, token=token))
    assert "error" not in box, box  # was IK003 "token N is stale, the current token is N"
    assert in_window >= 2, f"the updates did not land inside the look-up's window ({in_window})"
    assert box["result"] is not None
    row = a.execute("SELECT status::text, token, response FROM idempotency.idempotency_keys "
                    "WHERE key = 'race-2'").fetchone()
    assert row == ("completed", token, {"done": 2})
    assert claim(a, "race-2", {"x": 2})[0] == "replay"


# --- item 4: a column's type changed by hand ----------------------------------------------

ALTERS = {
    "token": ("token TYPE numeric USING token::numeric", "bigint"),
    "response": ("response TYPE json USING response::json", "jsonb"),
    "expires_at": ("expires_at TYPE timestamp USING expires_at::timestamp", "timestamp with time zone"),
    "request_hash": ("request_hash TYPE text USING pg_catalog.encode(request_hash, 'hex')", "bytea"),
}


@pytest.mark.parametrize("column", sorted(ALTERS))
def test_a_column_type_changed_by_hand_is_refused_clearly(connect, reinstall, column):
    alter, expected = ALTERS[column]
    a, other = connect(), connect()
    started = postmaster_start(other)
    # A completed row (request NULL: the request_hash check still holds after its change),
    # and a cached layout in session a.
    assert claim(a, "ty-1", None)[0] == "new"
    complete(a, "ty-1", {"kept": True}, response_status=201)
    assert claim(a, "ty-2", None, lease="10 minutes")[0] == "new"
    if column == "expires_at":  # the stats view reads it: take the view out of the way first
        other.execute("ALTER EXTENSION idempotency DROP VIEW idempotency.stats")
        other.execute("DROP VIEW idempotency.stats")
    other.execute(f"ALTER TABLE idempotency.idempotency_keys ALTER COLUMN {alter}")
    assert other.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                         "WHERE attrelid = 'idempotency.idempotency_keys'::regclass AND attname = %s",
                         (column,)).fetchone()[0] != expected
    fresh = connect()
    for conn in (a, fresh):  # a layout cached before the ALTER, and one read after it
        for call in (lambda: claim(conn, "ty-new", None),       # absent: would insert
                     lambda: claim(conn, "ty-1", None),         # completed: would replay
                     lambda: complete(conn, "ty-2", {"v": 1})):
            state, message = error_of(call)
            assert state == "55000", (column, state, message)
            assert f"idempotency_keys.{column} is" in message and expected in message, message
    # lookup reads through SQL and still works.
    row = fresh.execute("SELECT status::text, response::text, response_status FROM idempotency.lookup('ty-1')").fetchone()
    assert row[0] == "completed" and row[2] == 201 and "kept" in row[1]
    # Nothing crashed: the postmaster was not restarted and other sessions live on.
    assert other.execute("SELECT 1").fetchone()[0] == 1
    assert postmaster_start(connect()) == started
    assert fresh.execute("SELECT status::text FROM idempotency.idempotency_keys WHERE key = 'ty-2'").fetchone()[0] \
        == "in_progress"


# --- item 6: constraints, publications, rules, crafted jsonb -------------------------------

def warm_direct_path(conn, key):
    """A claim and a completion in `conn`, which caches the direct-write layout."""
    with conn.transaction():
        assert claim(conn, key, None)[0] == "new"
        complete(conn, key, {"warm": True})


def test_a_check_constraint_replaced_by_hand_is_enforced(connect, reinstall):
    a = connect()
    warm_direct_path(a, "chk-0")
    a.execute("ALTER TABLE idempotency.idempotency_keys DROP CONSTRAINT idempotency_keys_response_status_check")
    a.execute("ALTER TABLE idempotency.idempotency_keys ADD CONSTRAINT no_server_errors CHECK (response_status < 500)")
    assert a.execute("SELECT count(*) FROM pg_constraint WHERE conrelid = 'idempotency.idempotency_keys'::regclass "
                     "AND contype = 'c'").fetchone()[0] == 3  # same count as the extension's own
    assert claim(a, "chk-1", None)[0] == "new"
    state, message = error_of(lambda: complete(a, "chk-1", {"v": 1}, response_status=503))
    assert state == "23514" and "no_server_errors" in message, (state, message)
    assert a.execute("SELECT status::text FROM idempotency.idempotency_keys WHERE key = 'chk-1'").fetchone()[0] \
        == "in_progress"
    assert complete(a, "chk-1", {"v": 1}, response_status=201) is not None
    assert claim(a, "chk-1", None)[3] == 201


def test_a_published_table_without_replica_identity_refuses_completions_as_sql_does(connect, reinstall):
    a = connect()
    a.execute("ALTER TABLE idempotency.idempotency_keys REPLICA IDENTITY NOTHING")
    a.execute("CREATE PUBLICATION idem_pub")
    warm_direct_path(a, "pub-0")  # not published yet: the direct path, and nothing to refuse
    assert claim(a, "pub-1", None, lease="10 minutes")[0] == "new"
    # Published after the layout was cached: the relcache invalidation must reach it.
    a.execute("ALTER PUBLICATION idem_pub ADD TABLE idempotency.idempotency_keys")
    state, message = error_of(lambda: complete(a, "pub-1", {"v": 1}))
    assert state == "55000" and "replica identity" in message, (state, message)
    assert a.execute("SELECT status::text FROM idempotency.idempotency_keys WHERE key = 'pub-1'").fetchone()[0] \
        == "in_progress"
    # Inserts need no replica identity: a fresh claim still works.
    assert claim(a, "pub-2", None)[0] == "new"


def test_a_publication_row_filter_outside_the_replica_identity_is_checked(connect, reinstall):
    a = connect()
    warm_direct_path(a, "rf-0")
    assert claim(a, "rf-1", None, lease="10 minutes")[0] == "new"
    a.execute("CREATE PUBLICATION idem_pub FOR TABLE idempotency.idempotency_keys WHERE (response_status IS NULL)")
    state, message = error_of(lambda: complete(a, "rf-1", {"v": 1}))
    assert state == "42P10" and "replica identity" in message, (state, message)
    assert a.execute("SELECT status::text FROM idempotency.idempotency_keys WHERE key = 'rf-1'").fetchone()[0] \
        == "in_progress"


def test_rules_on_the_table_send_writes_through_sql(connect, reinstall):
    a = connect()
    warm_direct_path(a, "rule-0")
    a.execute("CREATE TABLE public.seen_by_rules (key text, op text)")
    try:
        a.execute("CREATE RULE note_insert AS ON INSERT TO idempotency.idempotency_keys "
                  "DO ALSO INSERT INTO public.seen_by_rules VALUES (NEW.key, 'INSERT')")
        a.execute("CREATE RULE note_update AS ON UPDATE TO idempotency.idempotency_keys "
                  "DO ALSO INSERT INTO public.seen_by_rules VALUES (NEW.key, 'UPDATE')")
        with a.transaction():
            assert claim(a, "rule-1", None)[0] == "new"
            complete(a, "rule-1", {"ok": True})
        assert a.execute("SELECT op FROM public.seen_by_rules WHERE key = 'rule-1' ORDER BY op").fetchall() \
            == [("INSERT",), ("UPDATE",)]
        assert claim(a, "rule-1", None)[0] == "replay"
    finally:
        a.execute("DROP TABLE public.seen_by_rules CASCADE")


# A jsonb object whose one key claims to be 256 MB long: the server's iterator would read it.
CRAFTED = "'\\x01000020f0ffff0f00000040'::bytea::jsonb"


def test_crafted_jsonb_is_data_corrupted_in_every_reader(connect):
    a, other = connect(), connect()
    started = postmaster_start(other)
    a.execute("CREATE CAST (bytea AS jsonb) WITHOUT FUNCTION")
    try:
        for sql in (f"SELECT idempotency.canonical_hash({CRAFTED}, '{{/a}}')",
                    f"SELECT idempotency.canonical_hash({CRAFTED})",
                    f"SELECT idempotency.canonical_json({CRAFTED})",
                    f"SELECT idempotency.derive_key('parent', 'step', {CRAFTED})",
                    f"SELECT idempotency.request_fingerprint('GET', '/x', {CRAFTED}, NULL)",
                    f"SELECT idempotency.request_fingerprint('POST', '/x', NULL, {CRAFTED})",
                    f"SELECT outcome FROM idempotency.claim('crafted', {CRAFTED})"):
            state, message = error_of(lambda: a.execute(sql).fetchall())
            assert state == "XX001", (sql, state, message)
    finally:
        a.execute("DROP CAST (bytea AS jsonb)")
    assert other.execute("SELECT 1").fetchone()[0] == 1
    assert postmaster_start(connect()) == started
    # Valid documents read the same as before.
    assert a.execute("SELECT idempotency.canonical_json('{\"b\": [1.50, \"x\"], \"a\": null}')").fetchone()[0] \
        == '{"a":null,"b":[1.5,"x"]}'
    assert a.execute("SELECT idempotency.canonical_hash('{\"a\": 1, \"b\": 2}', '{/b}') "
                     "= idempotency.canonical_hash('{\"a\": 1}')").fetchone()[0]
