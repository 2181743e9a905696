"""The portable edition updated in place from the previous release (docs/managed.md, "Updating"):
a store installed by the previous release's script (frozen in sql/releases/portable/), with keys
in every state, updated by the route's update (the plain route: dist/idempotency-portable--A--B.sql;
pg_tle: `scripts/portable.py pgtle-update`, then ALTER EXTENSION idempotency UPDATE) while a
session holds a claim in an open transaction; then every key answers as before and the schema is
exactly what a fresh install of this release creates (the catalog of test_upgrade.py, plus
function comments, triggers, the plain route's recorded release, pg_tle's version and members).

Runs against the portable edition only (IDEMPOTENCY_EDITION=portable, scripts/test.sh): the plain
route on a server without pg_tle (scripts/pg-portable.sh 15), pg_tle where it is preloaded
(scripts/pg-tle.sh 18)."""

import os
import re
import subprocess
import time

import psycopg
import pytest

from cluster import EDITION, pgtle_script, portable_route, PG_BIN
from helpers import claim
from test_upgrade import CATALOG

pytestmark = pytest.mark.skipif(EDITION != "portable",
                                reason="portable edition only: run with IDEMPOTENCY_EDITION=portable")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RELEASES = os.path.join(ROOT, "sql", "releases", "portable")
PREVIOUS = "0.5.0"


def current_version():
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        return re.search(r'^version = "(.*)"$', f.read(), re.M).group(1)


PLAIN_UPDATE = os.path.join(ROOT, "dist", f"idempotency-portable--{PREVIOUS}--{current_version()}.sql")

# What CATALOG (test_upgrade.py) leaves out and the portable edition has: comments on functions
# and on schema idempotency (the plain route's recorded release), triggers, and the extension's
# version and member objects (pg_tle).
MORE = """
SELECT 'function comment ' || p.oid::regprocedure::text, obj_description(p.oid, 'pg_proc')
  FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace AND obj_description(p.oid, 'pg_proc') IS NOT NULL
UNION ALL
SELECT 'schema', concat_ws(' | ', nspowner::regrole::text, obj_description(oid, 'pg_namespace'))
  FROM pg_namespace WHERE nspname = 'idempotency'
UNION ALL
SELECT 'trigger ' || tgrelid::regclass::text || '.' || tgname, concat_ws(' | ', pg_get_triggerdef(oid), tgenabled)
  FROM pg_trigger WHERE NOT tgisinternal
   AND tgrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'idempotency'::regnamespace)
UNION ALL
SELECT 'extension', concat_ws(' | ', extversion, extnamespace::regnamespace::text, extrelocatable)
  FROM pg_extension WHERE extname = 'idempotency'
UNION ALL
SELECT 'member ' || pg_describe_object(classid, objid, objsubid), deptype::text
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')
"""


def catalog(conn):
    rows = dict(conn.execute(CATALOG).fetchall())
    rows.update(conn.execute(MORE).fetchall())
    return rows


def differences(a, b):
    return {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


@pytest.fixture(scope="module")
def route():
    return portable_route(PG_BIN)


def psql(cluster, dbname, *args):
    return subprocess.run([f"{cluster.bin}/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", cluster.dir,
                           "-p", str(cluster.port), "-U", "postgres", "-d", dbname, *args],
                          capture_output=True, text=True, timeout=300)


def ok(result):
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture
def database(cluster, db, route):
    """make(name, release): a new database with the portable edition of the previous release
    (PREVIOUS, from its frozen script) or of this one (None, as a user installs it)."""
    made = []

    def make(name, release):
        db.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        db.execute(f"CREATE DATABASE {name}")
        made.append(name)
        if route == "pgtle":
            ok(psql(cluster, name, "-c", "CREATE EXTENSION pg_tle"))
            script = (os.path.join(RELEASES, f"pgtle-idempotency--{release}.sql") if release else pgtle_script())
            ok(psql(cluster, name, "-f", script))
            ok(psql(cluster, name, "-c", "CREATE EXTENSION idempotency"))
        else:
            script = (os.path.join(RELEASES, f"idempotency-portable--{release}.sql") if release
                      else os.path.join(ROOT, "dist", "idempotency-portable.sql"))
            ok(psql(cluster, name, "-f", script))
        conn = psycopg.connect(cluster.conninfo().replace("dbname=idem", f"dbname={name}"), autocommit=True)
        conn.execute("SET client_min_messages = warning")
        return conn

    yield make
    for name in made:
        db.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def update(cluster, dbname, route):
    """The route's update, as docs/managed.md tells a user to run it."""
    if route == "pgtle":
        ok(psql(cluster, dbname, "-f", pgtle_script("pgtle-update")))
        return ok(psql(cluster, dbname, "-c", "ALTER EXTENSION idempotency UPDATE"))
    return ok(psql(cluster, dbname, "-f", PLAIN_UPDATE))


def test_an_updated_store_has_the_schema_of_a_fresh_install(cluster, database, route):
    old = database("pupd_old", PREVIOUS)
    fresh = database("pupd_fresh", None)
    before = differences(catalog(old), catalog(fresh))
    # The releases differ (functions changed): a comparison that could not fail would prove nothing.
    assert any(k.startswith("function ") for k in before), before
    update(cluster, "pupd_old", route)
    after = differences(catalog(old), catalog(fresh))
    assert not after, "\n".join(f"{k}:\n  updated: {a}\n  fresh:   {b}" for k, (a, b) in sorted(after.items()))
    rows = catalog(fresh)
    assert len([k for k in rows if k.startswith("function ")]) > 80
    if route == "pgtle":
        assert rows["extension"].startswith(current_version() + " | idempotency")
        assert len([k for k in rows if k.startswith("member ")]) > 80
    else:
        assert rows["schema"] == f"postgres | idempotency {current_version()}, portable edition (plain script)"


def test_with_the_update_registered_create_extension_gives_this_release(cluster, database, db, route):
    """pg_tle: in a database where the previous release is registered but the extension was not
    created, the registered update path makes CREATE EXTENSION give this release."""
    if route != "pgtle":
        pytest.skip("pg_tle's registered versions (the plain route has no CREATE EXTENSION)")
    fresh = database("pupd_reg_fresh", None)
    db.execute("DROP DATABASE IF EXISTS pupd_registered")
    db.execute("CREATE DATABASE pupd_registered")
    try:
        ok(psql(cluster, "pupd_registered", "-c", "CREATE EXTENSION pg_tle"))
        ok(psql(cluster, "pupd_registered", "-f", os.path.join(RELEASES, f"pgtle-idempotency--{PREVIOUS}.sql")))
        ok(psql(cluster, "pupd_registered", "-f", pgtle_script("pgtle-update")))
        ok(psql(cluster, "pupd_registered", "-c", "CREATE EXTENSION idempotency"))
        with psycopg.connect(cluster.conninfo().replace("dbname=idem", "dbname=pupd_registered"),
                             autocommit=True) as c:
            diff = differences(catalog(c), catalog(fresh))
            assert not diff, sorted(diff)[:10]
            assert catalog(c)["extension"].startswith(current_version() + " | ")
    finally:
        db.execute("DROP DATABASE IF EXISTS pupd_registered WITH (FORCE)")


@pytest.mark.parametrize("storage", ["plain", "sha256"])
def test_every_key_answers_as_before_after_the_update(cluster, database, route, storage):
    name = f"pupd_keys_{storage}"
    db = database(name, PREVIOUS)
    kid = db.execute("SELECT idempotency.rotate_signing_secret()").fetchone()[0]
    signed = db.execute("SELECT idempotency.sign_key('order-1')").fetchone()[0]
    db.execute("SET idempotency.audit = on")
    done = claim(db, "done", {"a": 1}, scope="s")
    db.execute("SELECT idempotency.complete('done', '{\"order\": 7}', 201, 's', %s)", (done[1],))
    signed_done = claim(db, signed.split(".")[0], {"s": 1})
    db.execute("SELECT idempotency.complete(idempotency.verify_key(%s), '{\"signed\": true}', token => %s)",
               (signed, signed_done[1]))
    db.execute("RESET idempotency.audit")
    leased = claim(db, "leased", {"b": 2}, scope="s", lease="1 hour")
    db.execute("SELECT idempotency.checkpoint('leased', 'charged', 's', %s)", (leased[1],))
    short = claim(db, "short-lease", scope="s", ttl="1 hour", lease="1 second")
    claim(db, "expired", scope="s", ttl="1 second", lease="1 second")
    if storage == "sha256":
        assert db.execute("SELECT idempotency.set_key_storage('sha256')").fetchone()[0] == 5
        assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key = 'done'").fetchone()[0] == 0
    audit = db.execute("SELECT key, scope, response_status FROM idempotency.audit ORDER BY id").fetchall()
    assert len(audit) == 2

    # A request in flight through the update: its claim's transaction is open while the update runs.
    busy = psycopg.connect(cluster.conninfo().replace("dbname=idem", f"dbname={name}"))
    try:
        busy_claim = claim(busy, "in-flight", {"c": 3})
        assert busy_claim[0] == "new"
        db.execute("SELECT pg_sleep(1.1)")
        started = time.monotonic()
        update(cluster, name, route)
        assert time.monotonic() - started < 30
        # The request completes after the update, in the transaction it began before it.
        busy.execute("SELECT idempotency.complete('in-flight', '{\"late\": 1}', token => %s)", (busy_claim[1],))
        busy.commit()
    finally:
        busy.close()

    if route == "pgtle":
        assert db.execute("SELECT extversion FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0] \
            == current_version()
    with psycopg.connect(cluster.conninfo().replace("dbname=idem", f"dbname={name}"), autocommit=True) as new:
        for c in (db, new):
            assert claim(c, "done", {"a": 1}, scope="s")[:4] == ("replay", done[1], {"order": 7}, 201)
            assert claim(c, "done", {"a": 9}, scope="s")[0] == "mismatch"
            r = claim(c, "leased", {"b": 2}, scope="s")
            assert r[0] == "in_progress" and r[5] == "charged"
            assert claim(c, "in-flight", {"c": 3})[:3] == ("replay", busy_claim[1], {"late": 1})
            assert c.execute("SELECT idempotency.verify_key(%s)", (signed,)).fetchone()[0] == "order-1"
            key = c.execute("SELECT idempotency.verify_key(%s)", (signed,)).fetchone()[0]
            assert claim(c, key, {"s": 1})[:3] == ("replay", signed_done[1], {"signed": True})
        assert new.execute("SELECT idempotency.sign_key('order-1')").fetchone()[0].split(".")[1] == str(kid)
        taken = claim(new, "short-lease", scope="s")
        assert taken[0] == "new" and taken[1] > short[1]  # taken over, with a larger token
        with pytest.raises(psycopg.Error) as stale:  # the stale worker is fenced off
            new.execute("SELECT idempotency.complete('short-lease', '{}', scope => 's', token => %s)", (short[1],))
        assert stale.value.sqlstate == "IK003"
        again = claim(new, "expired", scope="s")
        assert again[0] == "new" and again[1] > taken[1]  # expired: new, the token sequence carried on
        new.execute("SELECT idempotency.complete('leased', '{\"ok\": 1}', scope => 's', token => %s)", (leased[1],))
        assert claim(db, "leased", {"b": 2}, scope="s")[2] == {"ok": 1}
        # The audit rows written before the update are there; completions go on being audited.
        assert new.execute("SELECT key, scope, response_status FROM idempotency.audit ORDER BY id LIMIT 2"
                           ).fetchall() == audit
        new.execute("SET idempotency.audit = on")
        t = claim(new, "audited-after")[1]
        new.execute("SELECT idempotency.complete('audited-after', '{}', token => %s)", (t,))
        assert new.execute("SELECT count(*) FROM idempotency.audit").fetchone()[0] == 3
        hashed = new.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key = 'done'").fetchone()[0]
        assert hashed == (0 if storage == "sha256" else 1)


def test_the_plain_update_refuses_a_database_it_was_not_made_for(cluster, database, db, route):
    if route != "plain":
        pytest.skip("the plain route's update script (pg_tle's update is ALTER EXTENSION's)")
    # A database without the edition: nothing is created.
    db.execute("DROP DATABASE IF EXISTS pupd_empty")
    db.execute("CREATE DATABASE pupd_empty")
    try:
        r = psql(cluster, "pupd_empty", "-f", PLAIN_UPDATE)
        assert r.returncode != 0 and 'schema "idempotency" does not exist' in r.stderr, r.stderr
        with psycopg.connect(cluster.conninfo().replace("dbname=idem", "dbname=pupd_empty")) as c:
            assert c.execute("SELECT to_regnamespace('idempotency')").fetchone()[0] is None
    finally:
        db.execute("DROP DATABASE IF EXISTS pupd_empty WITH (FORCE)")
    # This release already (a fresh install, or an update run twice): refused, nothing changed.
    fresh = database("pupd_twice", None)
    before = catalog(fresh)
    r = psql(cluster, "pupd_twice", "-f", PLAIN_UPDATE)
    assert r.returncode != 0 and f"is {current_version()} already" in r.stderr, r.stderr
    assert catalog(fresh) == before
    # A schema idempotency that is not the previous release's edition (one of its functions gone).
    other = database("pupd_other", PREVIOUS)
    other.execute("DROP FUNCTION idempotency.cron_key(text, timestamptz, interval)")
    before = catalog(other)
    r = psql(cluster, "pupd_other", "-f", PLAIN_UPDATE)
    assert r.returncode != 0 and f"does not hold the portable edition {PREVIOUS}" in r.stderr, r.stderr
    assert catalog(other) == before
