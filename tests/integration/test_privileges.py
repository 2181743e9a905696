"""The privilege model: after CREATE EXTENSION, PUBLIC can neither call the functions nor touch
the tables; the README's one grant (USAGE on the schema) gives an application role everything it
needs; that role still cannot read, rewrite or delete rows except through the functions; the
administrative functions are for superusers; and idempotency.scope_prefix keeps two tenants
apart, without a way for a tenant to lift it."""

import psycopg
import pytest

from helpers import claim

GRANT = "GRANT USAGE ON SCHEMA idempotency TO {role}"


@pytest.fixture
def tenants(cluster, db):
    """A database with the extension and three login roles: app (no grant yet), shop_a and
    shop_b (granted, with scope prefixes 'a:' and 'b:' set by the superuser)."""
    db.execute("DROP DATABASE IF EXISTS privileges")
    for r in ("app", "shop_a", "shop_b"):
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
    for r in ("app", "shop_a", "shop_b"):
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
        "SELECT idempotency._stored_key('order-1', 'a:client-1')",
        "SELECT idempotency.claim('order-1', '{\"x\": 1}')",  # the default scope '' too
    ]:
        message = denied(b, sql)
        assert 'scope "a:client-1"' in message or 'scope ""' in message, message
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
