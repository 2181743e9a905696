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
    if column == "expires_at":  # the stats views read it: take them out of the way first
        for view in ("idempotency_monitor.stats", "idempotency.stats"):
            other.execute(f"ALTER EXTENSION idempotency DROP VIEW {view}")
            other.execute(f"DROP VIEW {view}")
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


def test_the_direct_writes_come_back_when_the_last_rule_is_dropped(connect, reinstall):
    """pg_class.relhasrules stays true after the last rule is dropped (until a VACUUM): judged by
    it, the store kept going through the statements for the rest of the server's life (every
    later direct-path test of a shared cluster failed). The rules themselves decide now."""
    a = connect()
    a.execute("CREATE TABLE public.seen_by_a_rule (key text)")
    a.execute("CREATE RULE note_insert AS ON INSERT TO idempotency.idempotency_keys "
              "DO ALSO INSERT INTO public.seen_by_a_rule VALUES (NEW.key)")
    a.execute("DROP TABLE public.seen_by_a_rule CASCADE")
    assert a.execute("SELECT relhasrules FROM pg_class WHERE oid = 'idempotency.idempotency_keys'::regclass "
                     "AND NOT EXISTS (SELECT FROM pg_rewrite WHERE ev_class = oid)").fetchone() == (True,)
    first = claim(a, "rule-gone", {"x": 3}, lease="10 minutes")
    assert first[0] == "new"
    box, in_window = race(connect, "rule-gone", lambda b: complete(b, "rule-gone", {"done": 3}, token=first[1]))
    assert "error" not in box, box
    # The completion's look-up (the direct path) ran, and paused where the test waits for it.
    assert in_window >= 2, f"the completion did not go through the direct path ({in_window})"


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


# --- the layout check: the primary key, inheritance, partitions, defaults, result types -----

def rr_claim(conn, key):
    """A claim under REPEATABLE READ: the SQL path, whose INSERT ... ON CONFLICT (scope, key)
    needs the primary key as its arbiter."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        return claim(conn, key, None)


def claim_many(conn, keys, scope=""):
    return conn.execute("SELECT key, outcome::text FROM idempotency.claim_many(%s, scope => %s) ORDER BY ord",
                        (keys, scope)).fetchall()


def rows_of(conn, key):
    return conn.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key = %s", (key,)).fetchone()[0]


PKEY = "idempotency.idempotency_keys_pkey"
NEW_INDEX = "CREATE UNIQUE INDEX idempotency_keys_pkey ON idempotency.idempotency_keys "
PRIMARY_KEY_REPLACEMENTS = {
    # The review's vector: two `new` for one key, duplicate rows, forget fails "more than one row".
    "partial": ([NEW_INDEX + "(scope, key) WHERE status = 'completed'"], "partial"),
    "collation": ([NEW_INDEX + '(scope COLLATE "POSIX", key COLLATE "POSIX")'], "collation"),
    "operator class": ([NEW_INDEX + "(scope text_pattern_ops, key text_pattern_ops)"], "operator class"),
    "deferrable": (["ALTER TABLE idempotency.idempotency_keys ADD CONSTRAINT idempotency_keys_pkey "
                    "PRIMARY KEY (scope, key) DEFERRABLE"], "deferrable"),
    # What a failed CREATE UNIQUE INDEX CONCURRENTLY leaves behind.
    "invalid": ([NEW_INDEX + "(scope, key)",
                 f"UPDATE pg_index SET indisvalid = false WHERE indexrelid = '{PKEY}'::regclass"], "not valid"),
}


@pytest.mark.parametrize("how", sorted(PRIMARY_KEY_REPLACEMENTS))
def test_a_primary_key_replaced_by_another_index_of_its_name_is_refused(connect, reinstall, how):
    """The owner replaces the primary key by an index of the same name that the look-up and the
    statements' ON CONFLICT (scope, key) cannot rely on. With a partial unique index (WHERE
    status = 'completed') claim answered `new` twice for one key and stored duplicate rows
    (the SQL path has no arbiter either: 42P10). Every claim, batch and completion is refused
    with 55000 naming the index and what differs, in a session that cached the layout before
    and in a fresh one."""
    statements, words = PRIMARY_KEY_REPLACEMENTS[how]
    a, other = connect(), connect()
    warm_direct_path(a, "pk-0")
    assert claim(a, "pk-1", None, lease="10 minutes")[0] == "new"
    other.execute("ALTER TABLE idempotency.idempotency_keys DROP CONSTRAINT idempotency_keys_pkey")
    for sql in statements:
        other.execute(sql)
    definition, valid, immediate = other.execute(
        "SELECT pg_get_indexdef(indexrelid), indisvalid, indimmediate FROM pg_index "
        f"WHERE indexrelid = '{PKEY}'::regclass").fetchone()
    assert "UNIQUE" in definition and "(scope" in definition
    assert (how == "partial") == ("WHERE" in definition)
    assert (how == "invalid") == (not valid) and (how == "deferrable") == (not immediate)
    fresh = connect()
    for conn in (a, fresh):
        for call in (lambda: claim(conn, "pk-1", None),       # in progress: would answer from the row
                     lambda: claim(conn, "pk-2", None),       # absent: would insert
                     lambda: rr_claim(conn, "pk-3"),
                     lambda: claim_many(conn, ["pk-1", "pk-4"]),
                     lambda: complete(conn, "pk-1", {"v": 1})):
            state, message = error_of(call)
            assert state == "55000", (how, state, message)
            assert "idempotency_keys_pkey" in message and words in message, message
    assert [rows_of(other, k) for k in ("pk-1", "pk-2", "pk-3", "pk-4")] == [1, 0, 0, 0]
    # Put back, the same sessions claim again.
    other.execute("ALTER TABLE idempotency.idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_pkey")
    other.execute(f"DROP INDEX IF EXISTS {PKEY}")
    other.execute("ALTER TABLE idempotency.idempotency_keys ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (scope, key)")
    assert claim(a, "pk-1", None)[0] == "in_progress"
    assert claim(fresh, "pk-2", None)[0] == "new"


CHILD_ROW = ("INSERT INTO {table} (scope, key, status, token, response, response_status, created_at, "
             "completed_at, expires_at, ttl) VALUES ('', %s, 'completed', 999999, '{{\"kept\": 1}}', 200, now(), "
             "now(), now() + interval '1 day', interval '1 day')")


def test_a_table_inheriting_from_the_store_is_refused_naming_it(connect, reinstall):
    """Tables inheriting from the store hold rows the look-up never sees: a key stored in the
    inheriting table (which every SQL statement on the store reads) was claimed `new` again,
    and the sweep, which matches rows by ctid, could delete a live row of the store for an
    expired one of the inheriting table. Claims, batches, completions and sweeps are refused
    with 55000 naming the inheriting table, also in a session whose layout was cached before;
    once the table is gone they work again, and a new inheriting table is seen again."""
    a, other = connect(), connect()
    warm_direct_path(a, "inh-0")
    assert claim(a, "inh-2", None, lease="10 minutes")[0] == "new"
    try:
        other.execute("CREATE TABLE public.store_child () INHERITS (idempotency.idempotency_keys)")
        other.execute(CHILD_ROW.format(table="public.store_child"), ("inh-1",))
        assert other.execute("SELECT tableoid::regclass::text, response FROM idempotency.idempotency_keys "
                             "WHERE key = 'inh-1'").fetchall() == [("store_child", {"kept": 1})]
        fresh = connect()
        for conn in (a, fresh):
            for call in (lambda: claim(conn, "inh-1", None),     # was `new`: a second row for the key
                         lambda: claim(conn, "inh-3", None),
                         lambda: claim_many(conn, ["inh-1", "inh-4"]),
                         lambda: complete(conn, "inh-2", {"v": 1}),
                         lambda: conn.execute("SELECT idempotency.sweep()").fetchone()):
                state, message = error_of(call)
                assert state == "55000", (state, message)
                assert "store_child" in message and "inherits" in message, message
        assert [rows_of(other, k) for k in ("inh-1", "inh-2", "inh-3", "inh-4")] == [1, 1, 0, 0]
        # Dropping the inheriting table sends the store no invalidation: a refused call looks again.
        other.execute("DROP TABLE public.store_child")
        assert claim(a, "inh-1", None)[0] == "new"
        assert complete(fresh, "inh-2", {"v": 2}) is not None
        # The store keeps relhassubclass after the drop: a new inheriting table must still be seen.
        assert other.execute("SELECT relhassubclass FROM pg_class "
                             "WHERE oid = 'idempotency.idempotency_keys'::regclass").fetchone()[0]
        other.execute("CREATE TABLE public.store_child2 () INHERITS (idempotency.idempotency_keys)")
        for conn in (a, fresh):
            state, message = error_of(lambda: claim(conn, "inh-5", None))
            assert state == "55000" and "store_child2" in message, (state, message)
    finally:
        other.execute("DROP TABLE IF EXISTS public.store_child, public.store_child2")


def test_a_store_attached_as_a_partition_keeps_to_its_bound(connect, reinstall):
    """ATTACH PARTITION of the store (FOR VALUES IN ('')): claims outside the partition bound
    were stored by the direct insert, where the INSERT refuses them (23514). A partition's
    writes go through the statements, in a session whose layout was cached before the ATTACH
    and in a fresh one; inside the bound claims and completions work as before."""
    a, other = connect(), connect()
    warm_direct_path(a, "part-0")
    try:
        other.execute("CREATE TABLE public.store_parent (LIKE idempotency.idempotency_keys) PARTITION BY LIST (scope)")
        other.execute("ALTER TABLE public.store_parent ATTACH PARTITION idempotency.idempotency_keys FOR VALUES IN ('')")
        assert other.execute("SELECT relispartition, pg_get_expr(relpartbound, oid) FROM pg_class "
                             "WHERE oid = 'idempotency.idempotency_keys'::regclass").fetchone() \
            == (True, "FOR VALUES IN ('')")
        fresh = connect()
        for conn in (a, fresh):
            for call in (lambda: claim(conn, "part-x", None, scope="elsewhere"),
                         lambda: claim_many(conn, ["part-y", "part-z"], scope="elsewhere")):
                state, message = error_of(call)
                assert state == "23514" and "partition" in message, (state, message)
        assert other.execute("SELECT count(*) FROM idempotency.idempotency_keys "
                             "WHERE scope = 'elsewhere'").fetchone()[0] == 0
        for conn, key in ((a, "part-1"), (fresh, "part-2")):
            assert claim(conn, key, None)[0] == "new"
            complete(conn, key, {"inside": True})
            assert claim(conn, key, None)[0] == "replay"
        assert claim_many(a, ["part-3", "part-1"]) == [("part-3", "new"), ("part-1", "replay")]
    finally:
        if other.execute("SELECT relispartition FROM pg_class "
                         "WHERE oid = 'idempotency.idempotency_keys'::regclass").fetchone()[0]:
            other.execute("ALTER TABLE public.store_parent DETACH PARTITION idempotency.idempotency_keys")
        other.execute("DROP TABLE IF EXISTS public.store_parent")


DEFAULT_CHANGES = {
    "default": "ALTER TABLE idempotency.idempotency_keys ALTER COLUMN recovery_point SET DEFAULT 'from-default'",
    "identity": "ALTER TABLE idempotency.idempotency_keys ALTER COLUMN token ADD GENERATED ALWAYS AS IDENTITY",
}


@pytest.mark.parametrize("change", sorted(DEFAULT_CHANGES))
def test_a_column_default_changed_by_hand_applies_to_fresh_claims(connect, reinstall, change):
    """The direct insert ignored column defaults: after ALTER COLUMN recovery_point SET DEFAULT
    'from-default' a READ COMMITTED claim stored NULL where the INSERT stores the default. A
    changed default (or an identity column, whose GENERATED ALWAYS the INSERT enforces: 428C9)
    sends the writes through the statements, in a session whose layout was cached before and
    in a fresh one, for claim and claim_many alike."""
    a, other = connect(), connect()
    warm_direct_path(a, "def-0")
    other.execute(DEFAULT_CHANGES[change])
    assert other.execute("SELECT atthasdef OR attidentity <> '' FROM pg_attribute "
                         "WHERE attrelid = 'idempotency.idempotency_keys'::regclass "
                         "AND attname = %s", ("recovery_point" if change == "default" else "token",)).fetchone()[0]
    fresh = connect()
    for n, conn in enumerate((a, fresh)):
        calls = (lambda: claim(conn, f"def-{n}-1", None), lambda: claim_many(conn, [f"def-{n}-2"]))
        for call in calls:
            if change == "identity":
                state, message = error_of(call)
                assert state == "428C9" and "token" in message, (state, message)
            else:
                call()
        stored = other.execute("SELECT key, recovery_point FROM idempotency.idempotency_keys "
                               "WHERE key LIKE %s ORDER BY key", (f"def-{n}-%",)).fetchall()
        expected = [] if change == "identity" else [(f"def-{n}-1", "from-default"), (f"def-{n}-2", "from-default")]
        assert stored == expected


# claim_result altered by its owner; the SQL of each change, and the words the error must contain.
RESULT_TYPE_CHANGES = {
    "type": ("ALTER ATTRIBUTE token TYPE text", "attribute 2 of idempotency.claim_result is token text"),
    "typmod": ("ALTER ATTRIBUTE expires_at TYPE timestamptz(0)",
               "attribute 6 of idempotency.claim_result is expires_at timestamp(0) with time zone"),
    "name": ("RENAME ATTRIBUTE response TO body", "attribute 3 of idempotency.claim_result is body jsonb"),
    "dropped": ("DROP ATTRIBUTE recovery_point", "attribute 7 of idempotency.claim_result is dropped"),
}


@pytest.mark.parametrize("change", sorted(RESULT_TYPE_CHANGES))
def test_claim_result_altered_by_hand_is_refused_not_a_crash(connect, reinstall, change):
    """ALTER TYPE idempotency.claim_result ALTER ATTRIBUTE token TYPE text, then SELECT * FROM
    idempotency.claim('rt-1') (even in a fresh session) was a SIGSEGV: claim checked only that
    its result type had 7 columns and then built it with the original types. Each attribute is
    checked (name, type, typmod, not dropped) and the type's change reaches a session that had
    cached the type: 55000 naming the attribute, nothing written, no crash."""
    alter, words = RESULT_TYPE_CHANGES[change]
    a, other = connect(), connect()
    started = postmaster_start(other)
    assert claim(a, "rt-0", None)[0] == "new"  # a caches claim_result's descriptor
    other.execute(f"ALTER TYPE idempotency.claim_result {alter}")
    fresh = connect()
    for conn in (a, fresh):
        state, message = error_of(lambda: conn.execute("SELECT * FROM idempotency.claim('rt-1')").fetchall())
        assert state == "55000", (change, state, message)
        assert words in message, message
    assert rows_of(other, "rt-1") == 0
    assert other.execute("SELECT 1").fetchone()[0] == 1
    assert postmaster_start(connect()) == started


def test_claim_result_extended_in_a_live_session_gets_the_new_column(connect, reinstall):
    """A later release that adds a column to claim_result (ALTER EXTENSION UPDATE while
    sessions run) must not break sessions that cached the old type: the new column is NULL."""
    a, other = connect(), connect()
    assert claim(a, "rx-0", None)[0] == "new"
    other.execute("ALTER TYPE idempotency.claim_result ADD ATTRIBUTE note text")
    row = a.execute("SELECT * FROM idempotency.claim('rx-1')").fetchone()
    assert len(row) == 8 and row[0] == "new" and row[7] is None
    assert a.execute("SELECT (idempotency.claim('rx-1')).outcome").fetchone()[0] == "in_progress"


REDECLARED = {
    "claim_many": (
        "idempotency.claim_many(text[], jsonb[], text, interval, interval)",
        "CREATE FUNCTION idempotency.claim_many(keys text[], requests jsonb[] DEFAULT NULL, "
        "scope text DEFAULT '', ttl interval DEFAULT NULL, lease interval DEFAULT NULL) "
        "RETURNS TABLE (ord integer, key text, outcome idempotency.outcome, token text, response jsonb, "
        "response_status integer, retry_after interval, expires_at timestamptz, recovery_point text) "
        "LANGUAGE c AS '$libdir/idempotency', 'idempotency_claim_many'",
        "SELECT * FROM idempotency.claim_many(ARRAY['rd-1'])",
        "attribute 4 of the result of idempotency.claim_many is token text"),
    "_shared_stats": (
        "idempotency._shared_stats()",
        "CREATE FUNCTION idempotency._shared_stats(OUT preloaded text, OUT claims_new bigint, "
        "OUT claims_replay bigint, OUT claims_in_progress bigint, OUT claims_mismatch bigint, "
        "OUT completions bigint, OUT releases bigint, OUT rows_swept bigint, "
        "OUT last_sweep_at timestamptz, OUT last_sweep_rows bigint) "
        "LANGUAGE c AS '$libdir/idempotency', 'idempotency_shared_stats'",
        "SELECT * FROM idempotency._shared_stats()",
        "attribute 1 of the result of idempotency._shared_stats is preloaded text"),
}


@pytest.mark.parametrize("function", sorted(REDECLARED))
def test_a_result_redeclared_with_other_column_types_is_refused_not_a_crash(connect, reinstall, function):
    """The other rows the library forms itself (claim_many's, _shared_stats's) are checked the
    same way: a superuser's redeclaration with a column of another type is 55000 naming the
    attribute, not a datum read as the wrong type."""
    signature, create, call, words = REDECLARED[function]
    a = connect()
    started = postmaster_start(a)
    a.execute(f"ALTER EXTENSION idempotency DROP FUNCTION {signature}")
    # Views of the extension built on it (the monitoring view on _shared_stats) are taken out of
    # the extension first: a cascade from a non-member into a member drops the whole extension.
    for (view,) in a.execute(
            "SELECT DISTINCT r.ev_class::regclass::text FROM pg_depend d JOIN pg_rewrite r ON r.oid = d.objid "
            "WHERE d.classid = 'pg_rewrite'::regclass AND d.refobjid = %s::regprocedure "
            "AND r.ev_class <> 0", (signature,)).fetchall():
        a.execute(f"ALTER EXTENSION idempotency DROP VIEW {view}")
    a.execute(f"DROP FUNCTION {signature} CASCADE")
    a.execute(create)
    a.execute(f"ALTER EXTENSION idempotency ADD FUNCTION {signature}")  # dropped with it
    state, message = error_of(lambda: a.execute(call).fetchall())
    assert state == "55000", (state, message)
    assert words in message, message
    assert rows_of(a, "rd-1") == 0
    assert postmaster_start(connect()) == started
