"""Settings that bind a role: its scope prefix, audit on and size limits, kept by the extension's
owner in idempotency.role_settings (one row per role: the row of the role the session switched to
with SET ROLE when it has one, else the login role's).

PostgreSQL lets a role ALTER ROLE itself for every parameter it may SET, and a tenant that owns
its database ALTER DATABASE it: in 0.4.0 such a role undid a superuser's ALTER ROLE ... SET
idempotency.audit = on (RESET, SET ... = off, RESET ALL, the IN DATABASE form, ALTER DATABASE),
and without preloading a startup option displaced a per-role size limit. A row of the table binds
whatever the role does to its settings, with and without shared_preload_libraries. Each test
fails on 0.4.0 (no such table) and with the table unread."""

import contextlib
import os
import subprocess
import time

import psycopg
import pytest
from psycopg.types.json import Jsonb

from cluster import EDITION, Cluster
from helpers import claim

DB = "tenantdb"
SETTINGS = ("idempotency.scope_prefix", "idempotency.audit",
            "idempotency.max_response_size", "idempotency.max_recovery_point_size")
BIG_RESPONSE = "jsonb_build_object('s', repeat('x', 3 * 1024 * 1024))"  # 3 MB


@pytest.fixture(scope="module", params=["late", "preloaded"])
def bcluster(request):
    """A cluster (library loaded per session, or preloaded) with a database owned by the tenant
    role, which is granted the API, and a second login role, other."""
    settings = {"shared_preload_libraries": "'idempotency'", "idempotency.sweep_interval": "'1h'"} \
        if request.param == "preloaded" else {}
    c = Cluster(settings=settings).start()
    with psycopg.connect(c.conninfo(), autocommit=True) as su:
        su.execute("CREATE ROLE tenant LOGIN")
        su.execute("CREATE ROLE other LOGIN")
        su.execute(f"CREATE DATABASE {DB} OWNER tenant")
    with connect(c, "postgres") as su:
        su.execute("CREATE EXTENSION idempotency")
        su.execute("GRANT USAGE ON SCHEMA idempotency TO tenant, other")
    c.mode = request.param
    yield c
    c.destroy()


def connect(cluster, role, options=None, pgoptions=None):
    info = cluster.conninfo().replace("user=postgres", f"user={role}").replace("dbname=idem", f"dbname={DB}")
    if options:
        info += f" options='{options}'"
    old = os.environ.get("PGOPTIONS")
    if pgoptions is not None:
        os.environ["PGOPTIONS"] = pgoptions
    try:
        return psycopg.connect(info, autocommit=True)
    finally:
        if pgoptions is not None:
            if old is None:
                os.environ.pop("PGOPTIONS", None)
            else:
                os.environ["PGOPTIONS"] = old


@pytest.fixture
def su(bcluster):
    """The superuser in the tenant's database, every table and every setting of the roles
    emptied."""
    with connect(bcluster, "postgres") as conn:
        for table in ("idempotency_keys", "audit", "role_settings"):
            conn.execute(f"DELETE FROM idempotency.{table}")
        for role in ("tenant", "other"):
            conn.execute(f"ALTER ROLE {role} RESET ALL")
            conn.execute(f"ALTER ROLE {role} IN DATABASE {DB} RESET ALL")
        conn.execute(f"ALTER DATABASE {DB} RESET ALL")
        conn.execute("REVOKE SET ON PARAMETER idempotency.max_response_size FROM tenant")
        yield conn


def bind_tenant(su):
    """The owner binds the tenant: prefix 'tenant:', audit on, responses up to 1 MB (the setting
    allows 4 MB), recovery points up to 1 kB (the setting allows 64 kB). Also the settings a
    superuser made in 0.4.0, which the vectors below undo."""
    su.execute("INSERT INTO idempotency.role_settings VALUES ('tenant', 'tenant:', true, 1024, 1)")
    su.execute("ALTER ROLE tenant SET idempotency.audit = on")
    su.execute(f"ALTER ROLE tenant IN DATABASE {DB} SET idempotency.audit = on")
    su.execute(f"ALTER DATABASE {DB} SET idempotency.audit = on")
    assert su.execute("SELECT role::text, scope_prefix, audit, max_response_size, max_recovery_point_size "
                      "FROM idempotency.role_settings").fetchall() == [("tenant", "tenant:", True, 1024, 1)]


def role_settings_of(su, role, database=0):
    """The entries of pg_db_role_setting for role (0: every database) in database (0: all)."""
    row = su.execute(
        "SELECT setconfig FROM pg_db_role_setting WHERE setrole = %s::regrole "
        "AND setdatabase = CASE WHEN %s = '0' THEN 0 ELSE (SELECT oid FROM pg_database WHERE datname = %s) END",
        (role, str(database), str(database))).fetchone()
    return row[0] if row else []


def try_each(conn, statements):
    """Runs each statement as the role; returns those PostgreSQL accepted."""
    accepted = []
    for sql in statements:
        try:
            conn.execute(sql)
            accepted.append(sql)
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.CantChangeRuntimeParam):
            pass
    return accepted


def undo_in_catalog(su, bcluster, vector):
    """As the tenant, one way of undoing its settings in pg_db_role_setting; checks that the
    undoing was written where PostgreSQL let it be."""
    with connect(bcluster, "tenant") as t:
        # Loaded late, the settings are placeholders until the library is loaded in the session,
        # and PostgreSQL lets only superusers change a placeholder in the catalog: load it.
        t.execute("SELECT idempotency.canonical_json('{}')")
        if vector == "ALTER ROLE RESET":
            accepted = try_each(t, [f"ALTER ROLE tenant RESET {s}" for s in SETTINGS])
            assert "idempotency.audit=on" not in role_settings_of(su, "tenant")
        elif vector == "ALTER ROLE SET off":
            accepted = try_each(t, ["ALTER ROLE tenant SET idempotency.audit = off",
                                    "ALTER ROLE tenant SET idempotency.scope_prefix = ''",
                                    "ALTER ROLE tenant SET idempotency.max_response_size = '1GB'",
                                    "ALTER ROLE tenant SET idempotency.max_recovery_point_size = '1GB'"])
            assert "idempotency.audit=off" in role_settings_of(su, "tenant")
        elif vector == "ALTER ROLE RESET ALL":
            accepted = try_each(t, ["ALTER ROLE tenant RESET ALL"])
            assert role_settings_of(su, "tenant") == []
        elif vector == "ALTER ROLE IN DATABASE":
            accepted = try_each(t, [f"ALTER ROLE tenant IN DATABASE {DB} SET idempotency.audit = off"]
                                + [f"ALTER ROLE tenant IN DATABASE {DB} SET {s} = ''" for s in SETTINGS[:1]]
                                + [f"ALTER ROLE tenant IN DATABASE {DB} SET {s} = '1GB'" for s in SETTINGS[2:]])
            assert "idempotency.audit=off" in role_settings_of(su, "tenant", DB)
        elif vector == "ALTER DATABASE":
            # The tenant owns its database.
            accepted = try_each(t, [f"ALTER DATABASE {DB} RESET ALL",
                                    f"ALTER DATABASE {DB} SET idempotency.audit = off",
                                    f"ALTER DATABASE {DB} SET idempotency.scope_prefix = ''",
                                    f"ALTER DATABASE {DB} SET idempotency.max_response_size = '1GB'"])
            assert f"ALTER DATABASE {DB} SET idempotency.audit = off" in accepted
        else:
            raise AssertionError(vector)
    assert accepted, "the role could not change any of its settings: the vector was not tried"


def assert_bound(su, conn, tag, limits_named=True, limits_untrusted=False):
    """The tenant's row binds in this session: prefix, audit, both size limits (refused naming
    the row's columns, unless a lower limit applies; with limits_untrusted, every response and
    recovery point is refused because the session's limits are not the ones an administrator
    set)."""
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as e:
        conn.execute("SELECT idempotency.claim('k', NULL, 'other:1')")
    assert 'scope "other:1"' in str(e.value)
    token = claim(conn, f"k-{tag}", scope="tenant:1", lease="1 minute")[1]
    if limits_untrusted:
        for sql in (f"SELECT idempotency.complete(%s, {BIG_RESPONSE}, scope => 'tenant:1', token => %s)",
                    "SELECT idempotency.complete(%s, '{}', scope => 'tenant:1', token => %s)",
                    "SELECT idempotency.checkpoint(%s, 'x', 'tenant:1', %s)"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as e:
                conn.execute(sql, (f"k-{tag}", token))
            assert "was set by a role that may not set it" in str(e.value)
        conn.execute("SELECT idempotency.complete(%s, NULL, scope => 'tenant:1', token => %s)", (f"k-{tag}", token))
        assert su.execute("SELECT key, completed_by FROM idempotency.audit").fetchall() == [(f"k-{tag}", "tenant")]
        assert su.execute("SELECT status::text, response, recovery_point FROM idempotency.idempotency_keys "
                          "WHERE key = %s", (f"k-{tag}",)).fetchone() == ("completed", None, None)
        return
    with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
        conn.execute(f"SELECT idempotency.complete(%s, {BIG_RESPONSE}, scope => 'tenant:1', token => %s)",
                     (f"k-{tag}", token))
    assert not limits_named or "idempotency.role_settings.max_response_size allows 1048576" in str(e.value)
    with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
        conn.execute("SELECT idempotency.checkpoint(%s, repeat('x', 2048), 'tenant:1', %s)", (f"k-{tag}", token))
    assert not limits_named or "idempotency.role_settings.max_recovery_point_size allows 1024" in str(e.value)
    conn.execute("SELECT idempotency.complete(%s, '{}', scope => 'tenant:1', token => %s)", (f"k-{tag}", token))
    assert su.execute("SELECT key, completed_by FROM idempotency.audit").fetchall() == [(f"k-{tag}", "tenant")]
    row = su.execute("SELECT status::text, response, recovery_point FROM idempotency.idempotency_keys "
                     "WHERE key = %s", (f"k-{tag}",)).fetchone()
    assert row == ("completed", {}, None)


@pytest.mark.parametrize("vector", ["ALTER ROLE RESET", "ALTER ROLE SET off", "ALTER ROLE RESET ALL",
                                    "ALTER ROLE IN DATABASE", "ALTER DATABASE"])
@pytest.mark.native_only("it undoes the settings in the catalog as far as the library lets a role; without the "
                         "library PostgreSQL refuses a role's change of a placeholder a superuser set, so there is nothing to undo")
def test_a_role_cannot_undo_its_row_in_the_catalog(bcluster, su, vector):
    """0.4.0: the role's own ALTER ROLE / ALTER DATABASE replaced the superuser's entry in
    pg_db_role_setting, and from its next login no audit rows were written."""
    bind_tenant(su)
    undo_in_catalog(su, bcluster, vector)
    with connect(bcluster, "tenant") as t:
        assert_bound(su, t, vector.replace(" ", "-"))


@pytest.mark.parametrize("vector", ["SET", "RESET", "RESET ALL", "set_config"])
def test_a_role_cannot_undo_its_row_in_the_session(bcluster, su, vector):
    bind_tenant(su)
    with connect(bcluster, "tenant") as t:
        if vector == "SET":
            try_each(t, ["SET idempotency.audit = off", "SET idempotency.scope_prefix = ''",
                         "SET idempotency.max_response_size = '1GB'"])
        elif vector == "RESET":
            try_each(t, [f"RESET {s}" for s in SETTINGS])
        elif vector == "RESET ALL":
            try_each(t, ["RESET ALL"])
        else:
            try_each(t, ["SELECT set_config('idempotency.audit', 'off', false)",
                         "SELECT set_config('idempotency.scope_prefix', '', false)"])
        assert_bound(su, t, vector.replace(" ", "-"))


@pytest.mark.parametrize("how", ["PGOPTIONS", "options"])
def test_a_startup_option_cannot_undo_the_row(bcluster, su, how):
    """0.4.0, without preload: PGOPTIONS='-c idempotency.max_response_size=1GB' displaced the
    superuser's per-role limit (the placeholder keeps only the winning value, and the role's value
    is then thrown away: the default 4 MB applied) and a 3 MB response was stored. The row's 1 MB
    and the superuser's 1 kB hold (54000 program_limit_exceeded, as for the setting), or natively,
    loaded late, the session's responses are refused (42501)."""
    bind_tenant(su)
    su.execute("ALTER ROLE tenant SET idempotency.max_response_size = '1kB'")
    su.execute("ALTER ROLE tenant SET idempotency.max_recovery_point_size = '1kB'")
    every = ("-c idempotency.audit=off -c idempotency.scope_prefix=other: "
             "-c idempotency.max_response_size=1GB -c idempotency.max_recovery_point_size=1GB")
    kw = {"pgoptions": every} if how == "PGOPTIONS" else {"options": every}
    try:
        t = connect(bcluster, "tenant", **kw)
    except psycopg.OperationalError as e:
        # Preloaded, PostgreSQL refuses a role's startup option for a superuser-only setting.
        assert bcluster.mode == "preloaded" and "permission denied" in str(e)
        kw = {"pgoptions": "-c idempotency.audit=off"} if how == "PGOPTIONS" else {"options": "-c idempotency.audit=off"}
        t = connect(bcluster, "tenant", **kw)
    with t:
        assert t.execute("SHOW idempotency.audit").fetchone()[0] == "off"
        # The superuser's per-role 1 kB (lower than the row's 1 MB) still applies. Natively,
        # loaded late, the startup option displaced it before the library could see it: every
        # response and recovery point of the session is refused (42501).
        assert_bound(su, t, how, limits_named=False,
                     limits_untrusted=EDITION == "native" and bcluster.mode == "late")


def test_a_role_may_lower_a_bound_limit_but_not_raise_it(bcluster, su):
    bind_tenant(su)
    su.execute("GRANT SET ON PARAMETER idempotency.max_response_size TO tenant")
    with connect(bcluster, "tenant") as t:
        t.execute("SET idempotency.max_response_size = '1GB'")
        token = claim(t, "k", scope="tenant:1", lease="1 minute")[1]
        with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
            t.execute(f"SELECT idempotency.complete('k', {BIG_RESPONSE}, scope => 'tenant:1', token => %s)", (token,))
        assert "idempotency.role_settings.max_response_size allows 1048576" in str(e.value)
        t.execute("SET idempotency.max_response_size = '100kB'")
        with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
            t.execute("SELECT idempotency.complete('k', jsonb_build_object('s', repeat('x', 200 * 1024)), "
                      "scope => 'tenant:1', token => %s)", (token,))
        assert "idempotency.max_response_size allows 102400" in str(e.value)


def test_a_tenants_audit_sweep_keeps_rows_its_session_retention_would_delete(bcluster, su):
    """sweep_audit of a tenant (bound, or naming a prefix itself) deletes only past the retention
    an administrator set: natively a server setting no session changes; without the library a
    placeholder, whose session value (SET, set_config, PGOPTIONS) bound the tenant's sweep and
    deleted its own audit trail, and another role's with the prefix of its choice."""
    bind_tenant(su)
    with connect(bcluster, "tenant") as t:
        for k in ("old", "new"):
            token = claim(t, k, scope="tenant:1")[1]
            t.execute("SELECT idempotency.complete(%s, '{}', scope => 'tenant:1', token => %s)", (k, token))
    su.execute("UPDATE idempotency.audit SET completed_at = now() - interval '3 days' WHERE key = 'old'")
    assert su.execute("SELECT key, completed_by FROM idempotency.audit ORDER BY key").fetchall() == \
        [("new", "tenant"), ("old", "tenant")]

    def connect_with(role, options):
        try:
            return connect(bcluster, role, pgoptions=options)
        except psycopg.OperationalError:  # natively refused: a server setting, or superusers' only
            return connect(bcluster, role)

    retention_1s = ["SET idempotency.audit_retention = '1s'",
                    "SELECT set_config('idempotency.audit_retention', '1', false)"]
    with connect_with("tenant", "-c idempotency.audit_retention=1") as t:
        try_each(t, retention_1s)
        assert t.execute("SELECT idempotency.sweep_audit()").fetchone()[0] == 0
        # The role's own ALTER ROLE, and ALTER DATABASE of the database it owns (refused: a
        # placeholder, or natively a server setting), for its next login.
        assert try_each(t, ["ALTER ROLE tenant SET idempotency.audit_retention = '1s'",
                            f"ALTER ROLE tenant IN DATABASE {DB} SET idempotency.audit_retention = '1s'",
                            f"ALTER DATABASE {DB} SET idempotency.audit_retention = '1s'"]) == []
    with connect(bcluster, "tenant") as t:
        assert t.execute("SELECT idempotency.sweep_audit()").fetchone()[0] == 0
    with connect_with("other", "-c idempotency.scope_prefix=tenant: -c idempotency.audit_retention=1") as o:
        try_each(o, retention_1s + ["SET idempotency.scope_prefix = 'tenant:'"])
        try:
            assert o.execute("SELECT idempotency.sweep_audit()").fetchone()[0] == 0
        except psycopg.errors.InsufficientPrivilege:
            pass  # natively the prefix is the superusers' to set: no prefix, no sweep
    assert su.execute("SELECT count(*) FROM idempotency.audit").fetchone()[0] == 2

    # An administrator's retention applies to the tenant's sweep: the row past it goes.
    if bcluster.edition == "portable":
        su.execute("ALTER ROLE tenant SET idempotency.audit_retention = '2d'")
    else:
        su.execute("ALTER SYSTEM SET idempotency.audit_retention = '2d'")
        su.execute("SELECT pg_reload_conf()")
    try:
        with connect(bcluster, "tenant") as t:
            assert t.execute("SELECT idempotency.sweep_audit()").fetchone()[0] == 1
    finally:
        if bcluster.edition != "portable":
            su.execute("ALTER SYSTEM RESET idempotency.audit_retention")
            su.execute("SELECT pg_reload_conf()")
    assert su.execute("SELECT key FROM idempotency.audit").fetchall() == [("new",)]


def test_the_rows_prefix_replaces_the_setting(bcluster, su):
    """ALTER ROLE ... SET idempotency.scope_prefix is a default the row overrides."""
    bind_tenant(su)
    su.execute("ALTER ROLE tenant SET idempotency.scope_prefix = 'old:'")
    with connect(bcluster, "tenant") as t:
        assert t.execute("SHOW idempotency.scope_prefix").fetchone()[0] == "old:"
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            t.execute("SELECT idempotency.claim('k', NULL, 'old:1')")
        assert claim(t, "k", scope="tenant:1")[0] == "new"
        # The whole-store operations follow the row's prefix too.
        assert t.execute("SELECT idempotency.sweep()").fetchone()[0] == 0
    # Without a row the setting applies, as before.
    su.execute("DELETE FROM idempotency.role_settings")
    with connect(bcluster, "tenant") as t:
        assert claim(t, "k", scope="old:1")[0] == "new"


def test_a_role_cannot_read_or_write_role_settings(bcluster, su):
    """Not even the owner of the database: only the extension's owner keeps the table."""
    bind_tenant(su)
    with connect(bcluster, "tenant") as t:
        assert t.execute("SELECT datdba::regrole::text FROM pg_database WHERE datname = %s", (DB,)).fetchone()[0] == "tenant"
        for sql in ["SELECT * FROM idempotency.role_settings",
                    "INSERT INTO idempotency.role_settings VALUES ('other', 'x:')",
                    "UPDATE idempotency.role_settings SET audit = false",
                    "DELETE FROM idempotency.role_settings",
                    "TRUNCATE idempotency.role_settings",
                    "ALTER TABLE idempotency.role_settings DISABLE TRIGGER ALL",
                    "DROP TABLE idempotency.role_settings",
                    "SELECT idempotency._role_settings_changed()"]:
            with pytest.raises((psycopg.errors.InsufficientPrivilege, psycopg.errors.FeatureNotSupported)):
                t.execute(sql)
    assert su.execute("SELECT count(*) FROM idempotency.role_settings WHERE audit").fetchone()[0] == 1
    assert su.execute("SELECT relacl FROM pg_class WHERE oid = 'idempotency.role_settings'::regclass").fetchone()[0] is None


def test_bad_rows_are_refused_naming_the_column(bcluster, su):
    for values, column in [("'tenant', ''", "scope_prefix"), ("'tenant', repeat('x', 256)", "scope_prefix"),
                           ("'tenant', NULL, false, 0", "max_response_size"),
                           ("'tenant', NULL, false, NULL, 1048577", "max_recovery_point_size")]:
        with pytest.raises(psycopg.errors.CheckViolation) as e:
            su.execute(f"INSERT INTO idempotency.role_settings VALUES ({values})")
        assert f"role_settings_{column}_check" in str(e.value)
    with pytest.raises(psycopg.errors.UndefinedObject):
        su.execute("INSERT INTO idempotency.role_settings VALUES ('no_such_role', 'x:')")
    assert su.execute("SELECT count(*) FROM idempotency.role_settings").fetchone()[0] == 0


def test_a_change_binds_sessions_from_their_next_transaction_after_commit(bcluster, su):
    """Every session caches its row; a change reaches the others when it commits (not before),
    and a REPEATABLE READ transaction that began before it does not keep the old row cached."""
    with connect(bcluster, "tenant") as t:
        t.execute("SELECT idempotency.complete(%s, '{}', scope => 'x:1', token => %s)",
                  ("before", claim(t, "before", scope="x:1")[1]))
        assert su.execute("SELECT count(*) FROM idempotency.audit").fetchone()[0] == 0
        with connect(bcluster, "postgres") as owner:
            owner.execute("BEGIN")
            owner.execute("INSERT INTO idempotency.role_settings (role, audit) VALUES ('tenant', true)")
            # Not committed: not in force.
            t.execute("SELECT idempotency.complete(%s, '{}', scope => 'x:1', token => %s)",
                      ("uncommitted", claim(t, "uncommitted", scope="x:1")[1]))
            assert su.execute("SELECT count(*) FROM idempotency.audit").fetchone()[0] == 0
            owner.execute("COMMIT")
            t.execute("SELECT idempotency.complete(%s, '{}', scope => 'x:1', token => %s)",
                      ("committed", claim(t, "committed", scope="x:1")[1]))
            assert su.execute("SELECT key FROM idempotency.audit").fetchall() == [("committed",)]
            # A rolled back change is not in force either.
            owner.execute("BEGIN")
            owner.execute("UPDATE idempotency.role_settings SET scope_prefix = 'y:'")
            owner.execute("ROLLBACK")
            assert claim(t, "still-x", scope="x:1")[0] == "new"
            # A REPEATABLE READ transaction whose snapshot predates the change.
            t.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            t.execute("SELECT 1")
            owner.execute("UPDATE idempotency.role_settings SET scope_prefix = 'y:'")
            claim(t, "rr-1", scope="y:1")
            claim(t, "rr-2", scope="y:1")
            t.execute("COMMIT")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                t.execute("SELECT idempotency.claim('after-rr', NULL, 'x:1')")
            assert claim(t, "after-rr", scope="y:1")[0] == "new"
            # TRUNCATE too.
            owner.execute("TRUNCATE idempotency.role_settings")
            assert claim(t, "after-truncate", scope="x:1")[0] == "new"


def test_role_settings_are_dumped_with_their_rows(bcluster, su):
    bind_tenant(su)
    dump = subprocess.run([os.path.join(bcluster.bin, "pg_dump"), "-h", bcluster.dir, "-p", str(bcluster.port),
                           "-U", "postgres", DB], check=True, capture_output=True, text=True).stdout
    restored = "tenantdb_restored"
    su.execute(f"DROP DATABASE IF EXISTS {restored}")
    su.execute(f"CREATE DATABASE {restored}")
    try:
        subprocess.run([os.path.join(bcluster.bin, "psql"), "-h", bcluster.dir, "-p", str(bcluster.port), "-U",
                        "postgres", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", restored],
                       input=dump, check=True, capture_output=True, text=True)
        info = bcluster.conninfo().replace("dbname=idem", f"dbname={restored}")
        with psycopg.connect(info, autocommit=True) as r:
            assert r.execute("SELECT role::text, scope_prefix, audit, max_response_size, max_recovery_point_size "
                             "FROM idempotency.role_settings").fetchall() == [("tenant", "tenant:", True, 1024, 1)]
    finally:
        su.execute(f"DROP DATABASE {restored} WITH (FORCE)")


@pytest.mark.native_only("the library reads the row below SQL and refuses an altered column; "
                         "the portable edition reads it through SQL, which converts the value")
def test_an_altered_table_is_refused_not_misread(bcluster, su):
    """The row is read below SQL: a column of another type is refused (55000, naming it)."""
    bind_tenant(su)
    su.execute("ALTER TABLE idempotency.role_settings ALTER COLUMN max_response_size TYPE bigint")
    try:
        with connect(bcluster, "tenant") as t:
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as e:
                t.execute("SELECT idempotency.claim('k', NULL, 'tenant:1')")
            assert "idempotency.role_settings.max_response_size" in str(e.value) and "integer" in str(e.value)
    finally:
        su.execute("ALTER TABLE idempotency.role_settings ALTER COLUMN max_response_size TYPE integer")
    with connect(bcluster, "tenant") as t:
        assert claim(t, "k", scope="tenant:1")[0] == "new"


# --- A role switched to with SET ROLE -----------------------------------------------------------
# A pooler that logs every client in as one role (PgBouncer's user=), or a service role that
# switches to each client's role per transaction (PostgREST, Supabase: SET LOCAL ROLE or
# set_config('role', ..., true)): the switched role's row binds when it has one, else the login
# role's. Before, only the login role's row was read, and a client bound to shop_a: claimed in
# shop_b:x behind the pooled role without an error.

# Identifiers: "Shop C" is a role whose name needs quoting (capitals, a space).
POOLED = ("pooler", "shop_a", "shop_b", '"Shop C"', "plain_member", "outsider")


@pytest.fixture
def pool(bcluster, su):
    """The login role pooler (no row), member of shop_a, shop_b, "Shop C" and plain_member (roles
    that do not log in), not of outsider; each granted the API. Rows: shop_a bound to 'shop_a:',
    shop_b to 'shop_b:', "Shop C" to 'shop_c:', outsider to 'outsider:'; plain_member has none."""
    for role in POOLED:
        if su.execute("SELECT count(*) FROM pg_roles WHERE rolname = %s", (role.strip('"'),)).fetchone()[0] == 0:
            su.execute(f"CREATE ROLE {role} {'LOGIN' if role == 'pooler' else 'NOLOGIN'}")
        su.execute(f"ALTER ROLE {role} RESET ALL")
        su.execute(f"ALTER ROLE {role} IN DATABASE {DB} RESET ALL")
    su.execute('GRANT shop_a, shop_b, "Shop C", plain_member TO pooler')
    su.execute(f"GRANT USAGE ON SCHEMA idempotency TO {', '.join(POOLED)}")
    su.execute("INSERT INTO idempotency.role_settings (role, scope_prefix) VALUES ('shop_a', 'shop_a:'), "
               """('shop_b', 'shop_b:'), ('"Shop C"', 'shop_c:'), ('outsider', 'outsider:')""")
    # (regrole's text is quoted where the name needs it.)
    assert rows_of(su) == [('"Shop C"', "shop_c:", False, None, None), ("outsider", "outsider:", False, None, None),
                           ("shop_a", "shop_a:", False, None, None), ("shop_b", "shop_b:", False, None, None)]
    assert su.execute("SELECT array_agg(b.rolname::text ORDER BY b.rolname COLLATE \"C\") FROM pg_auth_members AS m "
                      "JOIN pg_roles AS a ON a.oid = m.member JOIN pg_roles AS b ON b.oid = m.roleid "
                      "WHERE a.rolname = 'pooler'").fetchone()[0] == ["Shop C", "plain_member", "shop_a", "shop_b"]
    return su


def rows_of(su):
    return su.execute("SELECT role::text, scope_prefix, audit, max_response_size, max_recovery_point_size "
                      "FROM idempotency.role_settings ORDER BY role::text").fetchall()


def roles(conn):
    """(current_user, session_user) of the session."""
    return conn.execute("SELECT current_user::text, session_user::text").fetchone()


def refused(conn, scope, key="k"):
    """Whether a claim in `scope` is refused as outside the session's prefix (42501, naming the
    scope); anything else it raises is raised. Run in a savepoint inside a transaction, so that
    a refusal leaves the transaction (and a SET LOCAL ROLE made in it) usable."""
    try:
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
            with conn.transaction():
                claim(conn, key, scope=scope)
        else:
            claim(conn, key, scope=scope)
    except psycopg.errors.InsufficientPrivilege as e:
        assert f'scope "{scope}"' in str(e)
        return True
    return False


def switch(conn, how, role):
    """Switches the session's role: for the session (SET ROLE) or for the transaction (SET LOCAL
    ROLE, set_config(..., true); the caller opened it)."""
    if how == "SET ROLE":
        conn.execute(f"SET ROLE {role}")
    elif how == "SET LOCAL ROLE":
        conn.execute(f"SET LOCAL ROLE {role}")
    else:
        conn.execute("SELECT set_config('role', %s, true)", (role,))


@pytest.mark.parametrize("login_row", [None, "pool:"], ids=["login-unbound", "login-bound"])
@pytest.mark.parametrize("how", ["SET ROLE", "SET LOCAL ROLE", "set_config"])
def test_a_role_switched_to_is_bound_by_its_row(bcluster, pool, how, login_row):
    """A pooled login role that switches to shop_a is bound to shop_a: (42501 in shop_b:x, as for
    a login role's row); switched back (RESET ROLE, or the transaction ends) the login role's own
    row (or none) binds again."""
    if login_row:
        pool.execute("INSERT INTO idempotency.role_settings (role, scope_prefix) VALUES ('pooler', %s)", (login_row,))
        assert ("pooler", login_row, False, None, None) in rows_of(pool)
    with connect(bcluster, "pooler") as p:
        assert roles(p) == ("pooler", "pooler")
        assert refused(p, "shop_b:x") == bool(login_row)
        for round_ in range(2):
            # SET ROLE lasts until RESET ROLE; SET LOCAL ROLE and set_config(..., true) until the
            # transaction ends.
            with p.transaction() if how != "SET ROLE" else contextlib.nullcontext():
                switch(p, how, "shop_a")
                assert roles(p) == ("shop_a", "pooler")
                assert refused(p, "shop_b:x", key=f"b{round_}")
                assert claim(p, f"a{round_}", scope="shop_a:x")[0] == "new"
                if login_row:
                    assert refused(p, f"{login_row}x", key=f"p{round_}")
            if how == "SET ROLE":
                assert roles(p) == ("shop_a", "pooler")
                p.execute("RESET ROLE")
            assert roles(p) == ("pooler", "pooler")
            assert refused(p, "shop_b:x", key=f"b{round_}") == bool(login_row)
            if login_row:
                assert claim(p, f"p{round_}", scope=f"{login_row}x")[0] == "new"
    # The claims the switched role made are there, in its scope.
    assert pool.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE scope = 'shop_a:x'").fetchone()[0] == 2


def test_set_role_to_a_role_it_is_not_a_member_of_is_refused_and_changes_nothing(bcluster, pool):
    pool.execute("INSERT INTO idempotency.role_settings (role, scope_prefix) VALUES ('pooler', 'pool:')")
    assert ("pooler", "pool:", False, None, None) in rows_of(pool)
    with connect(bcluster, "pooler") as p:
        for sql in ["SET ROLE outsider", "SELECT set_config('role', 'outsider', false)"]:
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as e:
                p.execute(sql)
            assert 'permission denied to set role "outsider"' in str(e.value)
        with p.transaction():
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                with p.transaction():
                    p.execute("SET LOCAL ROLE outsider")
            assert roles(p) == ("pooler", "pooler")
            assert refused(p, "outsider:x")
        assert roles(p) == ("pooler", "pooler")
        assert refused(p, "outsider:x")
        assert claim(p, "k", scope="pool:x")[0] == "new"


@pytest.mark.parametrize("how", ["SET ROLE", "SET LOCAL ROLE", "set_config"])
def test_a_login_roles_row_binds_after_a_switch_to_a_role_without_one(bcluster, pool, how):
    """A role never escapes its login role's binding by switching: plain_member has no row, so
    pooler's binds (prefix and audit) while the session is plain_member."""
    pool.execute("INSERT INTO idempotency.role_settings (role, scope_prefix, audit) VALUES ('pooler', 'shop_a:', true)")
    assert ("pooler", "shop_a:", True, None, None) in rows_of(pool)
    assert pool.execute("SELECT count(*) FROM idempotency.role_settings WHERE role = 'plain_member'::regrole"
                        ).fetchone()[0] == 0
    with connect(bcluster, "pooler") as p:
        with p.transaction():
            switch(p, how, "plain_member")
            assert roles(p) == ("plain_member", "pooler")
            assert refused(p, "shop_b:x")
            token = claim(p, "k", scope="shop_a:x")[1]
            p.execute("SELECT idempotency.complete('k', '{}', scope => 'shop_a:x', token => %s)", (token,))
    assert pool.execute("SELECT key, completed_by FROM idempotency.audit").fetchall() == [("k", "plain_member")]


@pytest.mark.parametrize("how", ["SET ROLE", "SET LOCAL ROLE", "set_config"])
def test_a_switched_roles_row_lowers_the_size_limits_and_turns_audit_on(bcluster, pool, how):
    pool.execute("UPDATE idempotency.role_settings SET audit = true, max_response_size = 1024, "
                 "max_recovery_point_size = 1 WHERE role = 'shop_a'::regrole")
    assert ("shop_a", "shop_a:", True, 1024, 1) in rows_of(pool)
    with connect(bcluster, "pooler") as p:
        # Unswitched: no row, the settings' limits (4 MB, 64 kB), no audit.
        token = claim(p, "unswitched", scope="x")[1]
        p.execute("SELECT idempotency.checkpoint('unswitched', repeat('x', 2048), 'x', %s)", (token,))
        p.execute(f"SELECT idempotency.complete('unswitched', {BIG_RESPONSE}, scope => 'x', token => %s)", (token,))
        assert pool.execute("SELECT count(*) FROM idempotency.audit").fetchone()[0] == 0
        with p.transaction():
            switch(p, how, "shop_a")
            assert roles(p) == ("shop_a", "pooler")
            token = claim(p, "k", scope="shop_a:1", lease="1 minute")[1]
            with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
                with p.transaction():
                    p.execute(f"SELECT idempotency.complete('k', {BIG_RESPONSE}, scope => 'shop_a:1', token => %s)",
                              (token,))
            assert "idempotency.role_settings.max_response_size allows 1048576" in str(e.value)
            with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
                with p.transaction():
                    p.execute("SELECT idempotency.checkpoint('k', repeat('x', 2048), 'shop_a:1', %s)", (token,))
            assert "idempotency.role_settings.max_recovery_point_size allows 1024" in str(e.value)
            p.execute("SELECT idempotency.complete('k', '{}', scope => 'shop_a:1', token => %s)", (token,))
    assert pool.execute("SELECT key, completed_by FROM idempotency.audit").fetchall() == [("k", "shop_a")]


def test_a_switched_roles_row_never_raises_a_limit_an_administrator_set(bcluster, pool):
    """The row's limit lowers the setting, never raises it: a superuser's 1 kB for the login
    role holds against the switched role's 64 kB."""
    pool.execute("UPDATE idempotency.role_settings SET max_recovery_point_size = 64 WHERE role = 'shop_a'::regrole")
    pool.execute("ALTER ROLE pooler SET idempotency.max_recovery_point_size = '1kB'")
    assert ("shop_a", "shop_a:", False, None, 64) in rows_of(pool)
    assert role_settings_of(pool, "pooler") == ["idempotency.max_recovery_point_size=1kB"]
    with connect(bcluster, "pooler") as p:
        p.execute("SET ROLE shop_a")
        assert roles(p) == ("shop_a", "pooler")
        token = claim(p, "k", scope="shop_a:1", lease="1 minute")[1]
        with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
            p.execute("SELECT idempotency.checkpoint('k', repeat('x', 2048), 'shop_a:1', %s)", (token,))
        assert "idempotency.max_recovery_point_size allows 1024" in str(e.value)
        assert refused(p, "shop_b:1")


def test_set_session_authorization_binds_the_new_session_user(bcluster, pool):
    """SET SESSION AUTHORIZATION (superusers only) makes another role the session user and
    undoes SET ROLE: that role's row binds (or the row of a role it then SET ROLEs to); RESET
    SESSION AUTHORIZATION gives the superuser back, whom no row binds."""
    pool.execute("INSERT INTO idempotency.role_settings (role, scope_prefix) VALUES ('pooler', 'pool:')")
    assert ("pooler", "pool:", False, None, None) in rows_of(pool)
    with connect(bcluster, "postgres") as s:
        s.execute("SET ROLE shop_a")
        assert roles(s) == ("shop_a", "postgres")
        assert refused(s, "pool:x")
        s.execute("SET SESSION AUTHORIZATION pooler")
        assert roles(s) == ("pooler", "pooler")
        assert s.execute("SHOW role").fetchone()[0] == "none"
        assert refused(s, "shop_a:x")
        assert claim(s, "k", scope="pool:x")[0] == "new"
        s.execute("SET ROLE shop_b")
        assert roles(s) == ("shop_b", "pooler")
        assert refused(s, "pool:x")
        assert claim(s, "k", scope="shop_b:x")[0] == "new"
        s.execute("RESET SESSION AUTHORIZATION")
        assert roles(s) == ("postgres", "postgres")
        assert claim(s, "k", scope="anything:x")[0] == "new"


FUNCTIONS = {
    "sql SET LOCAL ROLE": "LANGUAGE sql AS $$ SET LOCAL ROLE shop_a; "
                          "SELECT current_user::text || ' ' || (idempotency.claim('f', NULL, s)).outcome::text $$",
    "plpgsql SET LOCAL ROLE": "LANGUAGE plpgsql AS $$ BEGIN SET LOCAL ROLE shop_a; "
                              "RETURN current_user::text || ' ' || (idempotency.claim('f', NULL, s)).outcome::text; END $$",
    "SET role clause": "LANGUAGE sql SET role = shop_a AS $$ "
                       "SELECT current_user::text || ' ' || (idempotency.claim('f', NULL, s)).outcome::text $$",
}


@pytest.mark.parametrize("kind", list(FUNCTIONS))
def test_a_switch_inside_a_function_binds_the_switched_role(bcluster, pool, kind):
    pool.execute("DROP FUNCTION IF EXISTS public.claim_as_shop_a(text)")
    pool.execute(f"CREATE FUNCTION public.claim_as_shop_a(s text) RETURNS text {FUNCTIONS[kind]}")
    pool.execute("GRANT EXECUTE ON FUNCTION public.claim_as_shop_a(text) TO pooler")
    with connect(bcluster, "pooler") as p:
        assert p.execute("SELECT public.claim_as_shop_a('shop_a:x')").fetchone()[0] == "shop_a new"
        assert roles(p) == ("pooler", "pooler")
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as e:
            p.execute("SELECT public.claim_as_shop_a('shop_b:x')")
        assert 'scope "shop_b:x"' in str(e.value)
        # Back as pooler (no row): nothing binds.
        assert roles(p) == ("pooler", "pooler")
        assert claim(p, "f", scope="shop_b:x")[0] == "new"


@pytest.mark.parametrize("how", ["PGOPTIONS", "options"])
def test_a_role_startup_option_binds_the_switched_role(bcluster, pool, how):
    kw = {"pgoptions": "-c role=shop_a"} if how == "PGOPTIONS" else {"options": "-c role=shop_a"}
    with connect(bcluster, "pooler", **kw) as p:
        assert roles(p) == ("shop_a", "pooler")
        assert refused(p, "shop_b:x")
        assert claim(p, "k", scope="shop_a:x")[0] == "new"
        p.execute("RESET ROLE")
        # RESET goes back to the startup value, which is shop_a; SET ROLE NONE to the login role.
        assert roles(p) == ("shop_a", "pooler")
        p.execute("SET ROLE NONE")
        assert roles(p) == ("pooler", "pooler")
        assert claim(p, "k", scope="shop_b:x")[0] == "new"


def test_a_role_switch_does_not_leak_a_cached_binding(bcluster, pool):
    """One session switching between two bound roles gets each one's prefix every time (the
    native edition caches the row per pair of roles), and a change of a row reaches it."""
    with connect(bcluster, "pooler") as p:
        for i in range(3):
            for role, mine, theirs in [("shop_a", "shop_a:", "shop_b:"), ("shop_b", "shop_b:", "shop_a:")]:
                if i == 1:
                    with p.transaction():
                        p.execute(f"SET LOCAL ROLE {role}")
                        assert roles(p) == (role, "pooler")
                        assert refused(p, f"{theirs}{i}")
                        assert claim(p, f"k{i}", scope=f"{mine}{i}")[0] == "new"
                else:
                    p.execute(f"SET ROLE {role}")
                    assert roles(p) == (role, "pooler")
                    assert refused(p, f"{theirs}{i}")
                    assert claim(p, f"k{i}", scope=f"{mine}{i}")[0] == "new"
            p.execute("RESET ROLE")
            assert not refused(p, f"anything:{i}")
        pool.execute("UPDATE idempotency.role_settings SET scope_prefix = 'shop_c:' WHERE role = 'shop_a'::regrole")
        assert ("shop_a", "shop_c:", False, None, None) in rows_of(pool)
        p.execute("SET ROLE shop_a")
        assert refused(p, "shop_a:9")
        assert claim(p, "k9", scope="shop_c:9")[0] == "new"
        p.execute("SET ROLE shop_b")
        assert claim(p, "k9", scope="shop_b:9")[0] == "new"


@pytest.mark.parametrize("how", ["SET ROLE", "set_config"])
def test_a_switched_role_whose_name_needs_quoting_is_bound_by_its_row(bcluster, pool, how):
    """The role is found by its name as PostgreSQL holds it (capitals, a space), not misread as
    another role or as none."""
    with connect(bcluster, "pooler") as p:
        with p.transaction():
            if how == "SET ROLE":
                p.execute('SET LOCAL ROLE "Shop C"')
            else:
                p.execute("SELECT set_config('role', 'Shop C', true)")
            assert roles(p) == ("Shop C", "pooler")
            assert refused(p, "shop_a:x")
            assert claim(p, "k", scope="shop_c:x")[0] == "new"


# --- Limits and audit are floors: a session lowers a limit or turns audit on, never the reverse --

MB5_RESPONSE = "jsonb_build_object('s', repeat('x', 5 * 1024 * 1024))"  # above the 4 MB default
KB200_RESPONSE = "jsonb_build_object('s', repeat('x', 200 * 1024))"


@contextlib.contextmanager
def server_setting(bcluster, su, name, value):
    """name = value in the server's configuration (ALTER SYSTEM, reloaded), for new sessions;
    removed afterwards."""
    # (ALTER SYSTEM takes a setting no library defines only where the session has its placeholder.)
    su.execute(f"SET {name} = '{value}'")
    su.execute(f"ALTER SYSTEM SET {name} = '{value}'")
    su.execute(f"RESET {name}")
    su.execute("SELECT pg_reload_conf()")
    try:
        for _ in range(100):
            with connect(bcluster, "postgres") as check:
                if check.execute("SELECT current_setting(%s, true)", (name,)).fetchone()[0] == value:
                    break
            time.sleep(0.05)
        else:
            raise AssertionError(f"{name} = {value} did not reach new sessions")
        yield
    finally:
        su.execute(f"ALTER SYSTEM RESET {name}")
        su.execute("SELECT pg_reload_conf()")
        time.sleep(0.2)


def tenant_raising(bcluster, how, name, value):
    """A tenant session that set name = value itself (SET, set_config, or a startup option);
    None where PostgreSQL refused the startup option (natively, preloaded: a superuser-only
    setting)."""
    if how == "PGOPTIONS":
        try:
            return connect(bcluster, "tenant", pgoptions=f"-c {name}={value}")
        except psycopg.OperationalError as e:
            assert EDITION == "native" and bcluster.mode == "preloaded" and "permission denied" in str(e)
            return None
    t = connect(bcluster, "tenant")
    sql = f"SET {name} = '{value}'" if how == "SET" else f"SELECT set_config('{name}', '{value}', false)"
    try:
        t.execute(sql)
    except psycopg.errors.InsufficientPrivilege:
        # Natively, with the library loaded, the limits are superuser-only settings.
        assert EDITION == "native" and name != "idempotency.audit"
    return t


def displaced_natively(bcluster, how):
    """Natively, loaded late (not preloaded), a role's startup option for a superuser-only setting
    reaches the placeholder before the library: the session's responses and recovery points are
    then refused (42501), not measured against a limit that may not be the administrator's. (A
    SET is refused at once, 42501, by the library that the first call loaded.)"""
    return EDITION == "native" and bcluster.mode == "late" and how == "PGOPTIONS"


@pytest.mark.parametrize("how", ["SET", "set_config", "PGOPTIONS"])
def test_a_session_cannot_raise_a_size_limit_above_the_default(bcluster, su, how):
    """Nothing set anywhere: the defaults (responses 4 MB, recovery points 64 kB) hold whatever
    the session sets. The portable edition took a role's own SET ... = '1GB' and stored a 5 MB
    response (natively the SET is refused, 42501)."""
    t = tenant_raising(bcluster, how, "idempotency.max_response_size", "1GB")
    if t is None:
        return
    with t:
        token = claim(t, f"raise-{how}", lease="1 minute")[1]
        assert token is not None
        with pytest.raises((psycopg.errors.ProgramLimitExceeded, psycopg.errors.InsufficientPrivilege)) as e:
            t.execute(f"SELECT idempotency.complete(%s, {MB5_RESPONSE}, token => %s)", (f"raise-{how}", token))
        if displaced_natively(bcluster, how):
            assert "was set by a role that may not set it" in str(e.value)
        else:
            assert "idempotency.max_response_size allows 4194304" in str(e.value)
    t = tenant_raising(bcluster, how, "idempotency.max_recovery_point_size", "1GB")
    if t is None:
        return
    with t:
        token = claim(t, f"raise-rp-{how}", lease="1 minute")[1]
        with pytest.raises((psycopg.errors.ProgramLimitExceeded, psycopg.errors.InsufficientPrivilege)) as e:
            t.execute("SELECT idempotency.checkpoint(%s, repeat('x', 100 * 1024), '', %s)", (f"raise-rp-{how}", token))
        if displaced_natively(bcluster, how):
            assert "was set by a role that may not set it" in str(e.value)
        else:
            assert "idempotency.max_recovery_point_size allows 65536" in str(e.value)
    assert su.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE response IS NOT NULL "
                      "OR recovery_point IS NOT NULL").fetchone()[0] == 0


@pytest.mark.parametrize("how", ["SET", "PGOPTIONS"])
@pytest.mark.parametrize("where", ["database", "role", "server"])
def test_a_session_cannot_raise_a_size_limit_above_what_an_administrator_set(bcluster, su, where, how):
    """An administrator's 100 kB (ALTER DATABASE, ALTER ROLE, the server's configuration) holds
    against the session's 1GB: a 200 kB response is refused naming the setting."""
    name = "idempotency.max_response_size"
    with contextlib.ExitStack() as stack:
        if where == "database":
            su.execute(f"ALTER DATABASE {DB} SET {name} = '100kB'")
        elif where == "role":
            su.execute(f"ALTER ROLE tenant SET {name} = '100kB'")
        else:
            stack.enter_context(server_setting(bcluster, su, name, "100kB"))
        t = tenant_raising(bcluster, how, name, "1GB")
        if t is None:
            return
        with t:
            token = claim(t, f"admin-{where}-{how}", lease="1 minute")[1]
            assert token is not None
            if displaced_natively(bcluster, how):
                with pytest.raises(psycopg.errors.InsufficientPrivilege) as e:
                    t.execute(f"SELECT idempotency.complete(%s, {KB200_RESPONSE}, token => %s)",
                              (f"admin-{where}-{how}", token))
                assert "idempotency.max_response_size of this session was set by a role" in str(e.value)
                return
            with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
                t.execute(f"SELECT idempotency.complete(%s, {KB200_RESPONSE}, token => %s)",
                          (f"admin-{where}-{how}", token))
            assert "idempotency.max_response_size allows 102400" in str(e.value)
            # A response under the administrator's limit is stored.
            t.execute("SELECT idempotency.complete(%s, '{\"ok\": 1}', token => %s)", (f"admin-{where}-{how}", token))
        assert su.execute("SELECT status::text FROM idempotency.idempotency_keys WHERE key = %s",
                          (f"admin-{where}-{how}",)).fetchone()[0] == "completed"


@pytest.mark.skipif(EDITION == "native", reason="natively the size limits are superuser settings: a role "
                    "lowers them through GRANT SET ON PARAMETER or its row of idempotency.role_settings")
def test_a_session_may_lower_a_size_limit(bcluster, su):
    """Lowering is the session's to choose: 100 kB refuses a 200 kB response, naming the setting."""
    with connect(bcluster, "tenant") as t:
        t.execute("SET idempotency.max_response_size = '100kB'")
        token = claim(t, "lower", lease="1 minute")[1]
        with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
            t.execute(f"SELECT idempotency.complete('lower', {KB200_RESPONSE}, token => %s)", (token,))
        assert "idempotency.max_response_size allows 102400" in str(e.value)


@pytest.mark.parametrize("how", ["SET", "set_config", "PGOPTIONS"])
@pytest.mark.parametrize("where", ["database", "server"])
def test_a_session_cannot_turn_off_audit_an_administrator_turned_on(bcluster, su, where, how):
    """idempotency.audit = on in the server's configuration (ALTER SYSTEM) or by ALTER DATABASE is
    a floor: the session's off (SET, set_config, a startup option) leaves the audit row written.
    The portable edition let the session's off undo the server's on."""
    key = f"audited-{where}-{how}"
    with contextlib.ExitStack() as stack:
        if where == "database":
            su.execute(f"ALTER DATABASE {DB} SET idempotency.audit = on")
        else:
            stack.enter_context(server_setting(bcluster, su, "idempotency.audit", "on"))
        t = tenant_raising(bcluster, how, "idempotency.audit", "off")
        assert t is not None
        with t:
            assert t.execute("SHOW idempotency.audit").fetchone()[0] == "off"
            token = claim(t, key, lease="1 minute")[1]
            assert token is not None
            t.execute("SELECT idempotency.complete(%s, '{\"ok\": 1}', token => %s)", (key, token))
    assert su.execute("SELECT key, completed_by::text FROM idempotency.audit WHERE key = %s",
                      (key,)).fetchall() == [(key, "tenant")]
