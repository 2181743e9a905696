"""The privilege model: after CREATE EXTENSION, PUBLIC can neither call the functions nor touch
the tables; the README's one grant (USAGE on the schema) gives an application role everything it
needs; that role still cannot read, rewrite or delete rows except through the functions; the
administrative functions are for superusers; idempotency.scope_prefix keeps two tenants
apart, without a way for a tenant to lift it; the monitoring recipe gives the counters and
nothing else; a granted role cannot compute the stored form of a key; and what the shared token
sequence tells a tenant is what docs/security.md says."""

import os
import re

import psycopg
import pytest

from cluster import Cluster
from helpers import claim

GRANT = "GRANT USAGE ON SCHEMA idempotency TO {role}"
# The monitoring recipe of the README and docs/security.md, verbatim.
MONITOR_RECIPE = "GRANT USAGE ON SCHEMA idempotency_monitor TO monitor;"
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
ROLES = ("app", "shop_a", "shop_b", "monitor")


@pytest.fixture
def tenants(cluster, db):
    """A database with the extension and three login roles: app (no grant yet), shop_a and
    shop_b (granted, with scope prefixes 'a:' and 'b:' set by the superuser)."""
    db.execute("DROP DATABASE IF EXISTS privileges")
    for r in ROLES:
        db.execute(f"DROP ROLE IF EXISTS {r}")
        db.execute(f"CREATE ROLE {r} LOGIN")
    db.execute("CREATE DATABASE privileges")
    info = cluster.conninfo().replace("dbname=idem", "dbname=privileges")
    conns = []

    def login(role):
        c = psycopg.connect(info.replace("user=postgres", f"user={role}"), autocommit=True)
        conns.append(c)
        return c

    owner = login("postgres")
    owner.execute("CREATE EXTENSION idempotency")
    for role, prefix in (("shop_a", "a:"), ("shop_b", "b:")):
        owner.execute(GRANT.format(role=role))
        owner.execute(f"ALTER ROLE {role} IN DATABASE privileges SET idempotency.scope_prefix = '{prefix}'")
    yield owner, login
    for c in conns:
        c.close()
    db.execute("DROP DATABASE privileges")
    for r in ROLES:
        db.execute(f"DROP ROLE {r}")


def denied(conn, sql, params=None):
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as e:
        conn.execute(sql, params)
    return str(e.value)


def test_public_gets_nothing(tenants):
    owner, login = tenants
    c = login("app")
    for sql in [
        "SELECT idempotency.claim('k')",
        "SELECT idempotency.lookup('k')",
        "SELECT idempotency.canonical_hash('{}')",
        "SELECT count(*) FROM idempotency.idempotency_keys",
        "SELECT count(*) FROM idempotency.audit",
        "SELECT count(*) FROM idempotency.signing_secrets",
        "SELECT * FROM idempotency.stats",
        "SELECT nextval('idempotency.token_seq')",
    ]:
        denied(c, sql)
    # Not even by OID through a regprocedure: the schema is closed to PUBLIC.
    denied(c, "SELECT 'idempotency.claim(text,jsonb,text,interval,interval)'::regprocedure")
    assert owner.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 0


def test_one_grant_gives_every_operation(tenants):
    owner, login = tenants
    owner.execute(GRANT.format(role="app"))
    c = login("app")
    first = claim(c, "k", {"a": 1})
    assert first[0] == "new"
    c.execute("SELECT idempotency.checkpoint('k', 'step-1', token => %s)", (first[1],))
    c.execute("SELECT idempotency.complete('k', '{\"ok\": true}', token => %s)", (first[1],))
    assert claim(c, "k", {"a": 1})[0] == "replay"
    assert claim(c, "k", {"a": 2})[0] == "mismatch"
    assert c.execute("SELECT (idempotency.lookup('k')).status::text").fetchone()[0] == "completed"
    assert claim(c, "j")[0] == "new"
    assert c.execute("SELECT idempotency.release('j')").fetchone()[0] is True
    assert c.execute("SELECT idempotency.forget('k')").fetchone()[0] is True
    # Sweeping the whole store is the owner's (a role with a scope prefix sweeps its own rows:
    # test_hardening.py).
    denied(c, "SELECT idempotency.sweep()")
    denied(c, "SELECT idempotency.sweep_audit()")
    assert len(c.execute("SELECT idempotency.canonical_hash('{\"a\": 1}')").fetchone()[0]) == 32
    assert c.execute("SELECT idempotency.derive_key('p', 's')").fetchone()[0].startswith("p:")
    owner.execute("SELECT idempotency.rotate_signing_secret()")
    signed = c.execute("SELECT idempotency.sign_key('order-1')").fetchone()[0]
    assert c.execute("SELECT idempotency.verify_key(%s)", (signed,)).fetchone()[0] == "order-1"
    # The functions ran as the extension's owner; the role itself holds no table privilege.
    assert owner.execute(
        "SELECT count(*) FROM information_schema.role_table_grants WHERE grantee = 'app'"
    ).fetchone()[0] == 0


def test_rows_change_only_through_the_functions(tenants):
    owner, login = tenants
    owner.execute(GRANT.format(role="app"))
    c = login("app")
    token = claim(c, "k", {"a": 1})[1]
    c.execute("SET idempotency.audit = on")
    c.execute("SELECT idempotency.complete('k', '{\"amount\": 100}', token => %s)", (token,))
    for sql in [
        "SELECT * FROM idempotency.idempotency_keys",
        "UPDATE idempotency.idempotency_keys SET response = '{\"amount\": 1}'",
        "DELETE FROM idempotency.idempotency_keys",
        "INSERT INTO idempotency.idempotency_keys (key, status, token, expires_at, ttl) "
        "VALUES ('x', 'completed', 1, now() + interval '1 day', interval '1 day')",
        "TRUNCATE idempotency.idempotency_keys",
        "SELECT * FROM idempotency.audit",
        "UPDATE idempotency.audit SET response_status = 500",
        "DELETE FROM idempotency.audit",
        "TRUNCATE idempotency.audit",
        "SELECT * FROM idempotency.signing_secrets",
        "SELECT setval('idempotency.token_seq', 1)",
        "ALTER TABLE idempotency.idempotency_keys ADD COLUMN evil int",
        "CREATE TABLE idempotency.evil (x int)",
        "SELECT idempotency.set_key_storage('sha256')",
        "SELECT idempotency.rotate_signing_secret()",
        "SELECT idempotency.retire_signing_secret(1)",
        "SELECT idempotency._store_changed()",
        "SELECT idempotency._random_secret()",
    ]:
        denied(c, sql)
    row = owner.execute(
        "SELECT response, response_status FROM idempotency.idempotency_keys WHERE key = 'k'"
    ).fetchone()
    assert row == ({"amount": 100}, 200)
    assert owner.execute("SELECT count(*), min(completed_by) FROM idempotency.audit").fetchone() == (1, "app")


@pytest.mark.native_only("idempotency.scope_prefix is a superuser-only setting only where the library defines it; "
                         "the portable edition binds tenants by idempotency.role_settings (test_binding_settings.py)")
def test_tenants_are_kept_apart(tenants):
    owner, login = tenants
    a, b = login("shop_a"), login("shop_b")
    assert a.execute("SHOW idempotency.scope_prefix").fetchone()[0] == "a:"
    token = claim(a, "order-1", {"x": 1}, scope="a:client-1")[1]
    a.execute("SELECT idempotency.checkpoint('order-1', 'charged', 'a:client-1', %s)", (token,))
    a.execute("SELECT idempotency.complete('order-1', '{\"card\": \"4242\"}', scope => 'a:client-1')")
    claim(a, "order-2", scope="a:client-1")
    # Everything shop_b could do to shop_a's keys is refused, naming the scope.
    for sql in [
        "SELECT idempotency.claim('order-1', '{\"x\": 1}', 'a:client-1')",
        "SELECT idempotency.lookup('order-1', 'a:client-1')",
        "SELECT idempotency.release('order-2', 'a:client-1')",
        "SELECT idempotency.forget('order-1', 'a:client-1')",
        "SELECT idempotency.complete('order-2', '{}', scope => 'a:client-1')",
        "SELECT idempotency.checkpoint('order-2', 'x', 'a:client-1')",
        "SELECT idempotency._complete('order-2', '{}', 200, 'a:client-1', NULL, NULL)",
        "SELECT idempotency._raise_not_claimed('order-1', 'a:client-1', NULL, 'complete')",
        "SELECT idempotency.claim('order-1', '{\"x\": 1}')",  # the default scope '' too
    ]:
        message = denied(b, sql)
        assert 'scope "a:client-1"' in message or 'scope ""' in message, message
    # (_stored_key is refused to every granted role: test_granted_role_cannot_compute_the_stored_form_of_a_key)
    denied(b, "SELECT idempotency._stored_key('order-1', 'a:client-1')")
    # ... and shop_b cannot lift its prefix.
    for sql in [
        "SET idempotency.scope_prefix = ''",
        "SET idempotency.scope_prefix = 'a:'",
        "RESET idempotency.scope_prefix",
        "SELECT set_config('idempotency.scope_prefix', '', false)",
        "ALTER ROLE shop_b SET idempotency.scope_prefix = ''",
    ]:
        denied(b, sql)
    assert b.execute("SHOW idempotency.scope_prefix").fetchone()[0] == "b:"
    # shop_b's own scopes work, even with the same key; shop_a's keys are untouched.
    assert claim(b, "order-1", {"x": 1}, scope="b:client-1")[0] == "new"
    rows = owner.execute(
        "SELECT scope, key, status::text, recovery_point FROM idempotency.idempotency_keys ORDER BY 1, 2"
    ).fetchall()
    assert rows == [
        ("a:client-1", "order-1", "completed", "charged"),
        ("a:client-1", "order-2", "in_progress", None),
        ("b:client-1", "order-1", "in_progress", None),
    ]
    assert claim(a, "order-1", {"x": 1}, scope="a:client-1")[0] == "replay"


@pytest.mark.native_only("the library refuses a prefix the role set itself; "
                         "the portable edition binds tenants by idempotency.role_settings (test_binding_settings.py)")
def test_prefix_cannot_be_dodged_before_the_library_loads(cluster, tenants):
    """Without shared_preload_libraries the setting is a placeholder until the library loads
    in the session; a value the role set itself is then thrown away, the superuser's kept."""
    owner, login = tenants
    b = login("shop_b")
    try:
        b.execute("SET idempotency.scope_prefix = ''")
    except psycopg.errors.InsufficientPrivilege:
        pass  # already loaded in this session: refused outright, which is as good
    denied(b, "SELECT idempotency.lookup('k', 'a:1')")
    assert b.execute("SHOW idempotency.scope_prefix").fetchone()[0] == "b:"


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_monitoring_recipe_reads_the_counters_and_nothing_else(tenants):
    """0.4.0: the recipe (GRANT USAGE ON SCHEMA idempotency, SELECT ON idempotency.stats TO
    monitor, itself a syntax error) gave the monitor the schema, and with it the whole API with
    no prefix: claim('mon-victim', ..., 'a:orders') replayed shop_a's stored card number, and
    forget deleted it."""
    owner, login = tenants
    for doc in ("README.md", "docs/security.md"):
        assert MONITOR_RECIPE in read(doc), doc
        assert "GRANT USAGE ON SCHEMA idempotency, SELECT" not in read(doc), doc
    owner.execute(MONITOR_RECIPE)
    # The monitoring view is idempotency.stats: the same columns, in the same order.
    columns = "SELECT array_agg(attname::text || ':' || format_type(atttypid, atttypmod) ORDER BY attnum) " \
              "FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
    assert owner.execute(columns, ("idempotency.stats",)).fetchone() \
        == owner.execute(columns, ("idempotency_monitor.stats",)).fetchone()
    a = login("shop_a")
    token = claim(a, "mon-victim", {"a": 1}, scope="a:orders")[1]
    a.execute("SELECT idempotency.complete('mon-victim', '{\"card\": \"4242\"}', scope => 'a:orders', token => %s)",
              (token,))
    m = login("monitor")
    row = m.execute("SELECT database, rows_completed, rows_in_progress, claims_new IS NULL OR claims_new >= 1 "
                    "FROM idempotency_monitor.stats").fetchone()
    assert row == ("privileges", 1, 0, True)
    for sql in [
        "SELECT * FROM idempotency.claim('mon-victim', '{\"a\":1}', 'a:orders')",
        "SELECT idempotency.forget('mon-victim', 'a:orders')",
        "SELECT idempotency.lookup('mon-victim', 'a:orders')",
        "SELECT idempotency.release('mon-victim', 'a:orders')",
        "SELECT idempotency.complete('mon-victim', '{}', scope => 'a:orders')",
        "SELECT idempotency.claim_many('{mon-victim}', NULL, 'a:orders')",
        "SELECT idempotency.sign_key('k')",
        "SELECT idempotency.canonical_hash('{}')",
        "SELECT idempotency.sweep()",
        "SELECT * FROM idempotency.stats",
        "SELECT * FROM idempotency._shared_stats()",
        "SELECT * FROM idempotency.idempotency_keys",
        "SELECT * FROM idempotency.audit",
        "SELECT nextval('idempotency.token_seq')",
        "SELECT 'idempotency.forget(text,text)'::regprocedure",
        "CREATE VIEW idempotency_monitor.evil AS SELECT 1",
    ]:
        denied(m, sql)
    assert owner.execute("SELECT response FROM idempotency.idempotency_keys WHERE key = 'mon-victim'").fetchone() \
        == ({"card": "4242"},)
    # An application role's grant does not give the counters (they are the whole database's).
    for role in ("shop_a", "app"):
        denied(login(role), "SELECT * FROM idempotency_monitor.stats")


def test_granted_role_cannot_compute_the_stored_form_of_a_key(tenants):
    """0.4.0, keys stored hashed: _stored_key was executable by PUBLIC, lookup returned the stored
    hash and error messages its first 12 hex digits, so any granted role could hash a dictionary
    and check it against a leaked copy of the table."""
    owner, login = tenants
    owner.execute(GRANT.format(role="app"))
    assert owner.execute("SELECT idempotency.set_key_storage('sha256')").fetchone()[0] == 0
    c = login("app")
    key = "alice@example.com"
    first = claim(c, key, {"a": 1})
    stored = owner.execute("SELECT key FROM idempotency.idempotency_keys").fetchone()[0]
    assert re.fullmatch(r"[0-9a-f]{64}", stored) and stored != key
    for sql in [
        "SELECT idempotency._stored_key(%s, '')",
        "SELECT idempotency._check_recovery_point(%s)",
        "SELECT idempotency._signed_kid(%s)",
        "SELECT idempotency._verify(%s, '\\x00')",
        "SELECT idempotency._sign(%s, 1, '\\x00')",
    ]:
        denied(c, sql, (key,))
    # lookup gives the key as the caller gave it, never the stored hash.
    row = c.execute("SELECT key, status::text, token FROM idempotency.lookup(%s)", (key,)).fetchone()
    assert row == (key, "in_progress", first[1])
    # Messages and the mismatch WARNING carry nothing of the stored form: no prefix of its hash.
    notices = []
    c.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    assert claim(c, key, {"a": 2})[0] == "mismatch"
    texts = list(notices)
    for sql, params in [
        ("SELECT idempotency.complete(%s, '{}', token => %s)", (key, first[1] + 1)),
        ("SELECT idempotency.checkpoint(%s, 'x', token => %s)", (key, first[1] + 1)),
        ("SELECT idempotency.complete('bob@example.com', '{}')", None),
    ]:
        with pytest.raises(psycopg.Error) as e:
            c.execute(sql, params)
        assert e.value.sqlstate in ("IK001", "IK003"), str(e.value)
        texts.append(str(e.value))
    bob = owner.execute("SELECT idempotency._stored_key('bob@example.com', '')").fetchone()[0]
    assert len(texts) == 4 and "key reused" in texts[0]
    for t in texts:
        assert stored[:8] not in t and bob[:8] not in t and key not in t, t
    # The owner still finds the key.
    assert c.execute("SELECT idempotency.forget(%s)", (key,)).fetchone()[0] is True


def test_tokens_show_other_scopes_claim_volume_as_documented(tenants):
    """The token sequence is shared by every scope of the database: a tenant's next token is
    above its last by one plus the claims of every other tenant in between (docs/security.md,
    which says so and why). What it must keep: one key's tokens strictly increase across
    forget, expiry and sweep (and a crash: the next test)."""
    owner, login = tenants
    text = " ".join(read("docs/security.md").split())
    assert "tokens come from one sequence per database" in text
    assert "how many claims" in text
    a, b = login("shop_a"), login("shop_b")
    t1 = claim(a, "a-1", scope="a:1")[1]
    for i in range(7):
        assert claim(b, f"b-{i}", scope="b:1")[0] == "new"
    t2 = claim(a, "a-2", scope="a:1")[1]
    assert t2 - t1 == 8, (t1, t2)
    tokens = [claim(a, "same", scope="a:1")[1]]
    assert a.execute("SELECT idempotency.forget('same', 'a:1')").fetchone()[0] is True
    tokens.append(claim(a, "same", scope="a:1")[1])
    owner.execute("UPDATE idempotency.idempotency_keys SET expires_at = now() - interval '1 second', "
                  "created_at = now() - interval '2 days' WHERE key = 'same'")
    assert owner.execute("SELECT idempotency.sweep()").fetchone()[0] >= 1
    tokens.append(claim(a, "same", scope="a:1")[1])
    assert tokens == sorted(set(tokens)), tokens


def test_one_keys_tokens_increase_across_a_crash_restart():
    """The sequence outlives every row and a crash (it is WAL-logged ahead of the values it
    hands out): a key forgotten or expired before the crash gets a larger token after it."""
    c = Cluster().start()
    try:
        with psycopg.connect(c.conninfo(), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION idempotency")
            before = [claim(conn, "same", scope="s")[1]]
            conn.execute("SELECT idempotency.forget('same', 's')")
            before.append(claim(conn, "same", scope="s")[1])
        c.stop("immediate")
        c.restart()
        with psycopg.connect(c.conninfo(), autocommit=True) as conn:
            conn.execute("SELECT idempotency.forget('same', 's')")
            after = claim(conn, "same", scope="s")[1]
        assert before[0] < before[1] < after, (before, after)
    finally:
        c.destroy()
