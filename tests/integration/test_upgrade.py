"""Upgrades: install each previous release (0.1.0 to 0.5.0: install scripts frozen in sql/releases/),
write keys of every kind, ALTER EXTENSION idempotency UPDATE, and check that every key still
behaves and that the upgraded schema is exactly what a fresh install of the new release creates."""

import os
import shutil
import subprocess

import psycopg
import pytest

from helpers import claim

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cluster import PG_BIN

PG_CONFIG = os.path.join(PG_BIN, "pg_config")
PREVIOUS = ["0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0"]


def current_version():
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        for line in f:
            if line.startswith("version"):
                return line.split('"')[1]
    raise AssertionError("no version in Cargo.toml")


@pytest.fixture(scope="module", autouse=True)
def previous_releases_installed():
    """Puts the frozen install scripts of earlier releases next to the installed extension
    (cargo pgrx install copies only the current one and the upgrade scripts)."""
    sharedir = subprocess.run([PG_CONFIG, "--sharedir"], check=True, capture_output=True, text=True).stdout.strip()
    for v in PREVIOUS:
        src = os.path.join(ROOT, "sql", "releases", f"idempotency--{v}.sql")
        dst = os.path.join(sharedir, "extension", f"idempotency--{v}.sql")
        if not os.path.exists(dst) or open(src).read() != open(dst).read():
            shutil.copyfile(src, dst)
    # The chain of upgrade scripts, each release to the next.
    for a, b in zip(PREVIOUS, PREVIOUS[1:] + [current_version()]):
        up = os.path.join(sharedir, "extension", f"idempotency--{a}--{b}.sql")
        assert os.path.exists(up), f"{up} missing: run cargo pgrx install"


@pytest.fixture
def fresh_db(cluster, db):
    made = []

    def make(name):
        db.execute(f"DROP DATABASE IF EXISTS {name}")
        db.execute(f"CREATE DATABASE {name}")
        made.append(name)
        conn = psycopg.connect(cluster.conninfo().replace("dbname=idem", f"dbname={name}"), autocommit=True)
        return conn

    yield make
    for name in made:
        db.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


CATALOG = """
SELECT 'function ' || p.oid::regprocedure::text,
       concat_ws(' | ', pg_get_function_result(p.oid), p.prokind, p.provolatile, p.proparallel,
                 p.prosecdef, p.proconfig::text, p.prosrc, p.probin, l.lanname,
                 pg_get_function_arguments(p.oid), p.proacl::text)
  FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
 WHERE p.pronamespace = 'idempotency'::regnamespace
UNION ALL
SELECT 'relation ' || c.relname,
       concat_ws(' | ', c.relkind, c.relacl::text, c.reloptions::text,
                 CASE WHEN c.relkind = 'v' THEN pg_get_viewdef(c.oid) END,
                 CASE WHEN c.relkind = 'i' THEN pg_get_indexdef(c.oid) END,
                 obj_description(c.oid, 'pg_class'))
  FROM pg_class c WHERE c.relnamespace = 'idempotency'::regnamespace
UNION ALL
SELECT 'column ' || c.relname || '.' || a.attname,
       concat_ws(' | ', format_type(a.atttypid, a.atttypmod), a.attnotnull, a.attidentity,
                 pg_get_expr(d.adbin, d.adrelid), a.attnum, co.collname)
  FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
  LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
  LEFT JOIN pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 100
 WHERE c.relnamespace = 'idempotency'::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
   AND c.relkind IN ('r', 'v')
UNION ALL
SELECT 'constraint ' || conrelid::regclass::text || '.' || conname, pg_get_constraintdef(oid)
  FROM pg_constraint WHERE connamespace = 'idempotency'::regnamespace
UNION ALL
SELECT 'type ' || t.typname, concat_ws(' | ', t.typtype,
       (SELECT string_agg(enumlabel, ',' ORDER BY enumsortorder) FROM pg_enum WHERE enumtypid = t.oid))
  FROM pg_type t WHERE t.typnamespace = 'idempotency'::regnamespace AND t.typtype IN ('e', 'c')
   AND NOT EXISTS (SELECT FROM pg_class c WHERE c.reltype = t.oid AND c.relkind <> 'c')
UNION ALL
SELECT 'sequence ' || s.seqrelid::regclass::text,
       concat_ws(' | ', format_type(s.seqtypid, NULL), s.seqincrement, s.seqmin, s.seqmax, s.seqcache)
  FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
 WHERE c.relnamespace = 'idempotency'::regnamespace
UNION ALL
SELECT 'config dump', string_agg(x::regclass::text, ', ' ORDER BY x::regclass::text)
  FROM pg_extension e, unnest(e.extconfig) AS x WHERE e.extname = 'idempotency'
UNION ALL
SELECT 'members', count(*)::text FROM pg_depend
 WHERE refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency') AND deptype = 'e'
UNION ALL
SELECT 'schema acl', coalesce(nspacl::text, '') FROM pg_namespace WHERE nspname = 'idempotency'
UNION ALL
SELECT 'monitoring schema', concat_ws(' | ', coalesce(nspacl::text, ''), obj_description(oid, 'pg_namespace'))
  FROM pg_namespace WHERE nspname = 'idempotency_monitor'
UNION ALL
SELECT 'monitoring relation ' || c.relname,
       concat_ws(' | ', c.relkind, c.relacl::text, pg_get_viewdef(c.oid))
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'idempotency_monitor'
ORDER BY 1
"""


def catalog(conn):
    return dict(conn.execute(CATALOG).fetchall())


def test_upgraded_schema_equals_a_fresh_install(fresh_db):
    old = fresh_db("upgrade_old")
    new = fresh_db("upgrade_new")
    for v in PREVIOUS:
        old.execute(f"DROP EXTENSION IF EXISTS idempotency")
        old.execute(f"CREATE EXTENSION idempotency VERSION '{v}'")
        old.execute("ALTER EXTENSION idempotency UPDATE")
        assert old.execute("SELECT extversion FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0] == current_version()
        new.execute("DROP EXTENSION IF EXISTS idempotency")
        new.execute("CREATE EXTENSION idempotency")
        upgraded, fresh = catalog(old), catalog(new)
        differ = {k: (upgraded.get(k), fresh.get(k)) for k in upgraded.keys() | fresh.keys()
                  if upgraded.get(k) != fresh.get(k)}
        assert not differ, f"from {v}: " + "\n".join(f"{k}:\n  upgraded: {a}\n  fresh:    {b}" for k, a, b in
                                                  ((k, *differ[k]) for k in sorted(differ)))
        assert len(fresh) > 80


def test_keys_survive_the_upgrade(cluster, fresh_db):
    db = fresh_db("upgrade_keys")
    db.execute(f"CREATE EXTENSION idempotency VERSION '{PREVIOUS[-1]}'")
    done = claim(db, "done", {"a": 1}, scope="s")
    db.execute("SELECT idempotency.complete('done', '{\"order\": 7}', 201, 's', %s)", (done[1],))
    leased = claim(db, "leased", {"b": 2}, scope="s", lease="1 hour")
    db.execute("SELECT idempotency.checkpoint('leased', 'charged', 's', %s)", (leased[1],))
    short = claim(db, "short-lease", scope="s", ttl="1 hour", lease="1 second")
    claim(db, "expired", scope="s", ttl="1 second", lease="1 second")
    plain = claim(db, "no-request")
    # 0.1.0's privilege model: table grants to an application role.
    db.execute("DROP ROLE IF EXISTS legacy_app")
    db.execute("CREATE ROLE legacy_app LOGIN")
    db.execute("GRANT USAGE ON SCHEMA idempotency TO legacy_app; "
               "GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency.idempotency_keys TO legacy_app; "
               "GRANT USAGE ON SEQUENCE idempotency.token_seq TO legacy_app")
    db.execute("SELECT pg_sleep(1.1)")

    db.execute("ALTER EXTENSION idempotency UPDATE")
    assert db.execute("SELECT extversion FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0] == current_version()

    # A session opened before the update and one opened after behave alike.
    with psycopg.connect(cluster.conninfo().replace("dbname=idem", "dbname=upgrade_keys"), autocommit=True) as new, \
            psycopg.connect(cluster.conninfo().replace("dbname=idem", "dbname=upgrade_keys").replace(
                "user=postgres", "user=legacy_app"), autocommit=True) as app:
        for c in (db, new, app):
            assert claim(c, "done", {"a": 1}, scope="s")[:4] == ("replay", done[1], {"order": 7}, 201)
            assert claim(c, "done", {"a": 9}, scope="s")[0] == "mismatch"
            r = claim(c, "leased", {"b": 2}, scope="s")
            assert r[0] == "in_progress" and r[5] == "charged"
        taken = claim(new, "short-lease", scope="s")
        assert taken[0] == "new" and taken[1] > short[1]  # taken over, token larger
        again = claim(app, "expired", scope="s")
        assert again[0] == "new" and again[1] > taken[1]  # the sequence carried on
        new.execute("SELECT idempotency.complete('leased', '{\"ok\": 1}', scope => 's', token => %s)", (leased[1],))
        assert claim(app, "leased", {"b": 2}, scope="s")[2] == {"ok": 1}
        assert app.execute("SELECT idempotency.release('no-request', token => %s)", (plain[1],)).fetchone()[0] is True
        # The new features work on the upgraded store.
        new.execute("SET idempotency.audit = on")
        t = claim(new, "audited")[1]
        new.execute("SELECT idempotency.complete('audited', '{}', token => %s)", (t,))
        assert new.execute("SELECT count(*) FROM idempotency.audit").fetchone()[0] == 1
        assert new.execute("SELECT idempotency.set_key_storage('sha256')").fetchone()[0] == 5
        assert claim(app, "done", {"a": 1}, scope="s")[0] == "replay"
    db.execute("DROP OWNED BY legacy_app")
    db.execute("DROP ROLE legacy_app")


def test_the_upgrade_gives_the_store_the_fill_factor_that_keeps_completions_hot(fresh_db):
    """Many claims in flight: at fillfactor 90 a page took more claims than it could hold
    completed, and their completions moved to other pages (non-HOT). The upgrade lowers the
    store's fill factor to 25, on a plain table and on each partition of a partitioned store,
    but keeps one changed by hand (the update from 0.4.0, which made that change)."""
    def fillfactors(conn):
        return dict(conn.execute("""SELECT c.relname, array_to_string(c.reloptions, ',') FROM pg_class c
                                     WHERE c.relnamespace = 'idempotency'::regnamespace
                                       AND c.relname LIKE 'idempotency_keys%' AND c.relkind IN ('r', 'p')""").fetchall())

    plain = fresh_db("upgrade_ff_plain")
    plain.execute(f"CREATE EXTENSION idempotency VERSION '0.4.0'")
    assert fillfactors(plain) == {"idempotency_keys": "fillfactor=90"}
    plain.execute("ALTER EXTENSION idempotency UPDATE")
    assert fillfactors(plain) == {"idempotency_keys": "fillfactor=25"}

    parted = fresh_db("upgrade_ff_parted")
    parted.execute("SET idempotency.partitions = 3")
    parted.execute(f"CREATE EXTENSION idempotency VERSION '0.4.0'")
    parted.execute("RESET idempotency.partitions")
    parted.execute("ALTER TABLE idempotency.idempotency_keys_p2 SET (fillfactor = 70)")
    assert fillfactors(parted) == {"idempotency_keys": None, "idempotency_keys_p0": "fillfactor=90",
                                   "idempotency_keys_p1": "fillfactor=90", "idempotency_keys_p2": "fillfactor=70"}
    parted.execute("ALTER EXTENSION idempotency UPDATE")
    assert fillfactors(parted) == {"idempotency_keys": None, "idempotency_keys_p0": "fillfactor=25",
                                   "idempotency_keys_p1": "fillfactor=25", "idempotency_keys_p2": "fillfactor=70"}


def test_keys_stored_hashed_by_0_2_0_are_rekeyed(cluster, fresh_db):
    """0.2.0 kept hashed keys as their plain SHA-256; 0.3.0 keeps a keyed hash. The upgrade
    rewrites them without the keys, and every key still replays (or stays in progress)."""
    import hashlib
    import hmac
    db = fresh_db("upgrade_hashed")
    db.execute("CREATE EXTENSION idempotency VERSION '0.2.0'")
    db.execute("SELECT idempotency.set_key_storage('sha256')")
    db.execute("SET idempotency.audit = on")
    done = claim(db, "alice@example.com", {"a": 1}, scope="s")
    db.execute("SELECT idempotency.complete('alice@example.com', '{\"ok\": 1}', scope => 's')")
    leased = claim(db, "bob@example.com", scope="s", lease="1 hour")
    stored = dict(db.execute("SELECT key, status::text FROM idempotency.idempotency_keys").fetchall())
    plain_sha = {hashlib.sha256(k.encode()).hexdigest() for k in ("alice@example.com", "bob@example.com")}
    assert set(stored) == plain_sha  # what 0.2.0 wrote (the new library serves the old schema alike)
    assert claim(db, "alice@example.com", {"a": 1}, scope="s")[0] == "replay"

    db.execute("ALTER EXTENSION idempotency UPDATE")
    secret = db.execute("SELECT key_secret FROM idempotency.config").fetchone()[0]
    assert len(secret) == 32
    keyed = {hmac.new(secret, hashlib.sha256(k.encode()).digest(), "sha256").hexdigest()
             for k in ("alice@example.com", "bob@example.com")}
    assert {k for (k,) in db.execute("SELECT key FROM idempotency.idempotency_keys")} == keyed
    assert {k for (k,) in db.execute("SELECT key FROM idempotency.audit")} <= keyed
    assert db.execute("SELECT count(*) FROM idempotency.audit WHERE key_is_hash").fetchone()[0] == 1
    with psycopg.connect(cluster.conninfo().replace("dbname=idem", "dbname=upgrade_hashed"), autocommit=True) as new:
        for c in (db, new):
            assert claim(c, "alice@example.com", {"a": 1}, scope="s")[:3] == ("replay", done[1], {"ok": 1})
            assert claim(c, "bob@example.com", scope="s")[0] == "in_progress"
        new.execute("SELECT idempotency.complete('bob@example.com', '{}', scope => 's', token => %s)", (leased[1],))
        assert claim(db, "bob@example.com", scope="s")[0] == "replay"


def test_per_role_settings_become_binding_rows(cluster, db, fresh_db):
    """0.4.0 bound a role through ALTER ROLE ... SET, which the role could undo; the update
    copies each role's scope prefix, audit = on and size limits in force in the database (this
    database's value over the one for every database) into idempotency.role_settings, where they
    bind. A prefix written from a database of another encoding is not valid text here: left out,
    with a WARNING, never decoded lossily."""
    from psycopg import sql
    roles = ["mig_a", "mig_b", "mig_c", "mig_d", "mig_e"]
    for r in roles:
        db.execute(f"DROP ROLE IF EXISTS {r}")
        db.execute(f"CREATE ROLE {r} LOGIN")
    up = fresh_db("upgrade_roles")
    fresh_db("upgrade_roles_other")
    db.execute("DROP DATABASE IF EXISTS upgrade_roles_latin1")
    db.execute("CREATE DATABASE upgrade_roles_latin1 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    try:
        up.execute(f"CREATE EXTENSION idempotency VERSION '0.4.0'")
        for statement in [
            "ALTER ROLE mig_a SET idempotency.scope_prefix = 'a:'",
            "ALTER ROLE mig_a IN DATABASE upgrade_roles SET idempotency.scope_prefix = 'a2:'",
            "ALTER ROLE mig_b SET idempotency.audit = on",
            "ALTER ROLE mig_b SET idempotency.max_response_size = '1.5MB'",
            "ALTER ROLE mig_c IN DATABASE upgrade_roles_other SET idempotency.scope_prefix = 'x:'",
            "ALTER ROLE mig_c IN DATABASE upgrade_roles SET idempotency.max_recovery_point_size = 16",
            "ALTER ROLE mig_c SET idempotency.audit = off",
            "ALTER ROLE mig_d SET idempotency.scope_prefix = 'd:'",
            "ALTER ROLE mig_d IN DATABASE upgrade_roles SET idempotency.scope_prefix = ''",
            "ALTER ROLE mig_e SET idempotency.audit = yes",
            "ALTER DATABASE upgrade_roles SET idempotency.audit = on",
        ]:
            up.execute(statement)
        with psycopg.connect(cluster.conninfo().replace("dbname=idem", "dbname=upgrade_roles_latin1")
                             + " client_encoding=UTF8", autocommit=True) as latin1:
            latin1.execute(sql.SQL("ALTER ROLE mig_e SET idempotency.scope_prefix = {}").format(sql.Literal("müller:")))
        assert up.execute("SELECT count(*) FROM pg_db_role_setting WHERE setrole = ANY (%s::regrole[])",
                          (roles,)).fetchone()[0] == 9
        warnings = []
        up.add_notice_handler(lambda d: warnings.append(d.message_primary) if d.severity == "WARNING" else None)
        up.execute("ALTER EXTENSION idempotency UPDATE")
        rows = up.execute("SELECT role::text, scope_prefix, audit, max_response_size, max_recovery_point_size "
                          "FROM idempotency.role_settings WHERE role::text LIKE 'mig\\_%%' ORDER BY 1").fetchall()
        assert rows == [("mig_a", "a2:", False, None, None),
                        ("mig_b", None, True, 1536, None),
                        ("mig_c", None, False, None, 16),
                        ("mig_e", None, True, None, None)]
        # (Other tests' roles in this cluster may have settings of their own: only these count.)
        mine = [w for w in warnings if "mig_" in w]
        assert len(mine) == 1 and "idempotency.scope_prefix of role mig_e" in mine[0], warnings
        # Bound: mig_b's own RESET ALL (which removes its audit = on) leaves auditing on.
        up.execute("GRANT USAGE ON SCHEMA idempotency TO mig_b")
        info = cluster.conninfo().replace("dbname=idem", "dbname=upgrade_roles").replace("user=postgres", "user=mig_b")
        with psycopg.connect(info, autocommit=True) as b:
            b.execute("SELECT idempotency.canonical_json('{}')")
            b.execute("ALTER ROLE mig_b RESET ALL")
        assert up.execute("SELECT setconfig FROM pg_db_role_setting WHERE setrole = 'mig_b'::regrole").fetchone()[0] \
            == ["idempotency.max_response_size=1.5MB"]
        up.execute("ALTER DATABASE upgrade_roles RESET ALL")
        with psycopg.connect(info, autocommit=True) as b:
            assert b.execute("SELECT current_setting('idempotency.audit', true)").fetchone()[0] in (None, "off")
            b.execute("SELECT idempotency.complete('k', '{}', token => %s)", (claim(b, "k")[1],))
        assert up.execute("SELECT key, completed_by FROM idempotency.audit").fetchall() == [("k", "mig_b")]
        up.execute("DROP OWNED BY mig_b")
    finally:
        up.close()
        for name in ("upgrade_roles", "upgrade_roles_other", "upgrade_roles_latin1"):
            db.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        for r in roles:
            db.execute(f"DROP ROLE IF EXISTS {r}")


def test_grants_keep_working_and_old_monitors_are_named(cluster, fresh_db):
    """The application grant (USAGE on schema idempotency) works unchanged after the update; a
    role set up by 0.4.0's monitoring recipe (USAGE on the schema and SELECT on the view), which
    holds the whole API, is named in a WARNING with how to move it to the monitoring schema."""
    roles = ("upg_app", "upg_oldmon", "upg_mon")
    with psycopg.connect(cluster.conninfo(), autocommit=True) as su:
        for r in roles:
            su.execute(f"DROP ROLE IF EXISTS {r}")
            su.execute(f"CREATE ROLE {r} LOGIN")
    try:
        old = fresh_db("upgrade_grants")
        old.execute("CREATE EXTENSION idempotency VERSION '0.4.0'")
        old.execute("GRANT USAGE ON SCHEMA idempotency TO upg_app, upg_oldmon")
        old.execute("GRANT SELECT ON idempotency.stats TO upg_oldmon")
        warnings = []
        old.add_notice_handler(lambda d: warnings.append((d.severity_nonlocalized, d.message_primary, d.message_hint)))
        old.execute("ALTER EXTENSION idempotency UPDATE")
        named = [w for w in warnings if w[0] == "WARNING" and "idempotency.stats" in w[1]]
        assert len(named) == 1, warnings
        assert "upg_oldmon" in named[0][1] and "upg_app" not in named[0][1], named
        assert "idempotency_monitor" in named[0][2]
        old.execute("GRANT USAGE ON SCHEMA idempotency_monitor TO upg_mon")
        info = cluster.conninfo().replace("dbname=idem", "dbname=upgrade_grants")
        with psycopg.connect(info.replace("user=postgres", "user=upg_app"), autocommit=True) as app:
            assert claim(app, "k", {"a": 1})[0] == "new"
        with psycopg.connect(info.replace("user=postgres", "user=upg_mon"), autocommit=True) as mon:
            assert mon.execute("SELECT rows_in_progress FROM idempotency_monitor.stats").fetchone()[0] == 1
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                mon.execute("SELECT idempotency.forget('k')")
        old.close()
    finally:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as su:
            su.execute("DROP DATABASE IF EXISTS upgrade_grants WITH (FORCE)")
            for r in roles:
                su.execute(f"DROP ROLE IF EXISTS {r}")


def test_released_scripts_are_frozen():
    """The install scripts of earlier releases (sql/releases/, the portable edition's in
    sql/releases/portable/) are what was released: each matches its SHA256SUMS line, and every
    script there has one. (A merge that renames dist/'s scripts into place can carry later edits
    into them; the updates from them would then miss those edits.)"""
    import hashlib
    for folder in (os.path.join(ROOT, "sql", "releases"), os.path.join(ROOT, "sql", "releases", "portable")):
        with open(os.path.join(folder, "SHA256SUMS")) as f:
            sums = dict(reversed(line.split()) for line in f if line.strip())
        scripts = sorted(n for n in os.listdir(folder) if n.endswith(".sql"))
        assert scripts and sorted(sums) == scripts, f"{folder}: SHA256SUMS lists {sorted(sums)}, the folder {scripts}"
        for name in scripts:
            with open(os.path.join(folder, name), "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == sums[name], f"{folder}/{name} changed since its release"
