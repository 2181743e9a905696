"""Settings that bind a role: its scope prefix, audit on and size limits, kept by the extension's
owner in idempotency.role_settings (one row per login role, applied to the session user).

PostgreSQL lets a role ALTER ROLE itself for every parameter it may SET, and a tenant that owns
its database ALTER DATABASE it: in 0.4.0 such a role undid a superuser's ALTER ROLE ... SET
idempotency.audit = on (RESET, SET ... = off, RESET ALL, the IN DATABASE form, ALTER DATABASE),
and without preloading a startup option displaced a per-role size limit. A row of the table binds
whatever the role does to its settings, with and without shared_preload_libraries. Each test
fails on 0.4.0 (no such table) and with the table unread."""

import os
import subprocess

import psycopg
import pytest
from psycopg.types.json import Jsonb

from cluster import Cluster
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


def assert_bound(su, conn, tag, limits_named=True):
    """The tenant's row binds in this session: prefix, audit, both size limits (refused naming
    the row's columns, unless a lower limit applies)."""
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as e:
        conn.execute("SELECT idempotency.claim('k', NULL, 'other:1')")
    assert 'scope "other:1"' in str(e.value)
    token = claim(conn, f"k-{tag}", scope="tenant:1", lease="1 minute")[1]
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
    holds (54000 program_limit_exceeded, as for the setting)."""
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
        # Preloaded, the superuser's per-role 1 kB (lower than the row's 1 MB) still applies;
        # loaded late, the startup option displaced it and the row's limit is the one in force.
        assert_bound(su, t, how, limits_named=bcluster.mode == "late")


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
