"""The portable edition's store (dist/, built by scripts/portable.py: sql/idempotency.sql with each
C function replaced by a PL/pgSQL body) on servers that have no file of the native extension at
all, by both routes: the plain script on a copy of PostgreSQL 15 (scripts/pg-portable.sh), pg_tle
on a copy of PostgreSQL 18 (scripts/pg-tle.sh). Each test proves the library is absent first.

- a race of 16 sessions on one key: one `new`, the others `in_progress` at once (no waiting);
- an expired lease taken over with a larger token, the stale worker fenced off;
- installed by a role that is not a superuser (CREATEROLE, CREATEDB, and pgtle_admin for pg_tle,
  as on RDS), used by an application role that has only USAGE on the schema;
- a store dumped from one edition and restored into the other, both ways, on 15 and 18: every
  completed key replays, every in-progress key keeps its token and can be completed with it.

The whole contract suite runs against the portable edition too: IDEMPOTENCY_EDITION=portable
(tests/integration/cluster.py, scripts/test.sh)."""

import importlib.util
import os
import subprocess
import threading
import time

import psycopg
import pytest
from psycopg.types.json import Jsonb

from cluster import EDITION, Cluster, pgtle_script, pkglibdir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PLAIN = os.path.join(ROOT, "dist", "idempotency-portable.sql")
NATIVE_BIN = {15: "/usr/lib/postgresql/15/bin", 18: "/var/cache/idempotency/pg/18/bin"}

pytestmark = pytest.mark.skipif(EDITION == "portable", reason="makes its own servers of both editions")


def server_bin(script, major):
    """The bin directory of the server a script prepares (cached outside the clone)."""
    try:
        out = subprocess.run([os.path.join(ROOT, "scripts", script), str(major)], check=True,
                             capture_output=True, text=True, timeout=600).stdout.strip()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"scripts/{script} {major} failed: {getattr(e, 'stderr', '')[-500:]}")
    return os.path.dirname(out)


SERVERS = {"plain-15": ("pg-portable.sh", 15, "plain"), "pgtle-18": ("pg-tle.sh", 18, "pgtle")}


def psql(cluster, args, user="postgres", dbname=None):
    r = subprocess.run([f"{cluster.bin}/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", cluster.dir, "-p",
                        str(cluster.port), "-U", user, "-d", dbname or cluster.dbname] + args,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r


def install(cluster, route, user="postgres", dbname=None):
    if route == "plain":
        psql(cluster, ["-f", PLAIN], user, dbname)
    else:
        psql(cluster, ["-c", f"\\i {pgtle_script()}", "-c", "CREATE EXTENSION idempotency"], user, dbname)


def start(name):
    """A cluster of the named portable server, with pg_tle preloaded where that is the route."""
    script, major, route = SERVERS[name]
    bin_dir = server_bin(script, major)
    settings = {"shared_preload_libraries": "'pg_tle'"} if route == "pgtle" else {}
    c = Cluster(settings=settings, bin=bin_dir).start()
    if route == "pgtle":
        psql(c, ["-c", "CREATE EXTENSION pg_tle"])
    return c, route


def conninfo(cluster, user="postgres", dbname=None):
    return f"host={cluster.dir} port={cluster.port} user={user} dbname={dbname or cluster.dbname}"


def assert_no_library(cluster, route, conn):
    """No idempotency.so on the server; CREATE EXTENSION finds no native extension (plain) or
    the extension is pg_tle's (pgtle); no function of the schema is C."""
    lib = pkglibdir(cluster.bin)
    assert os.path.isdir(lib) and not os.path.exists(os.path.join(lib, "idempotency.so")), lib
    assert not [f for f in os.listdir(lib) if f.startswith("idempotency")]
    if route == "plain":
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="is not available"):
            conn.execute("CREATE EXTENSION idempotency SCHEMA public")
    else:
        assert conn.execute("SELECT count(*) FROM pgtle.available_extensions() WHERE name = 'idempotency'"
                            ).fetchone() == (1,)
        assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'idempotency'").fetchone() \
            is not None
    assert conn.execute(
        """SELECT count(*) FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace
              AND (p.prolang = (SELECT oid FROM pg_language WHERE lanname = 'c') OR p.probin IS NOT NULL)"""
    ).fetchone() == (0,)


@pytest.fixture(scope="module", params=sorted(SERVERS))
def portable(request):
    c, route = start(request.param)
    install(c, route)
    with psycopg.connect(conninfo(c), autocommit=True) as conn:
        assert_no_library(c, route, conn)
    yield c, route
    c.destroy()


def test_sixteen_sessions_racing_for_one_key_get_one_new_and_nobody_waits(portable):
    cluster, _ = portable
    conns = [psycopg.connect(conninfo(cluster)) for _ in range(16)]
    barrier = threading.Barrier(16)
    answered = threading.Barrier(16)
    outcomes = [None] * 16
    elapsed = [None] * 16

    def run(i):
        c = conns[i]
        barrier.wait()
        t = time.monotonic()
        outcomes[i] = c.execute("SELECT outcome::text, token FROM idempotency.claim('race', '{\"n\": 1}')").fetchone()
        elapsed[i] = time.monotonic() - t
        answered.wait()  # every session answered while the winner's transaction is still open
        c.commit()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in conns:
        c.close()
    assert sorted(o[0] for o in outcomes) == ["in_progress"] * 15 + ["new"], outcomes
    assert max(elapsed) < 10, elapsed
    with psycopg.connect(conninfo(cluster), autocommit=True) as c:
        winner = [o[1] for o in outcomes if o[0] == "new"][0]
        assert c.execute("SELECT token FROM idempotency.lookup('race')").fetchone() == (winner,)
        c.execute("SELECT idempotency.forget('race')")


def test_an_expired_lease_is_taken_over_with_a_larger_token_and_the_stale_worker_is_fenced(portable):
    cluster, _ = portable
    with psycopg.connect(conninfo(cluster), autocommit=True) as c:
        first = c.execute("SELECT outcome::text, token FROM idempotency.claim('tk', ttl => '1 hour', lease => '1 second')"
                          ).fetchone()
        assert first[0] == "new"
        c.execute("SELECT idempotency.checkpoint('tk', 'step-2', token => %s)", (first[1],))
        busy = c.execute("SELECT outcome::text FROM idempotency.claim('tk')").fetchone()
        assert busy == ("in_progress",)
        time.sleep(1.2)
        second = c.execute("SELECT outcome::text, token, recovery_point FROM idempotency.claim('tk')").fetchone()
        assert second[0] == "new" and second[1] > first[1] and second[2] == "step-2", (first, second)
        with pytest.raises(psycopg.Error) as e:
            c.execute("SELECT idempotency.complete('tk', '{}', token => %s)", (first[1],))
        assert e.value.sqlstate == "IK003" and "is stale" in str(e.value)
        c.execute("SELECT idempotency.complete('tk', '{\"ok\": 1}', token => %s)", (second[1],))
        assert c.execute("SELECT outcome::text, token, response FROM idempotency.claim('tk')").fetchone() == \
            ("replay", second[1], {"ok": 1})


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_installed_by_a_role_that_is_not_superuser_used_by_a_role_with_usage_only(name):
    cluster, route = start(name)
    try:
        with psycopg.connect(conninfo(cluster), autocommit=True) as su:
            su.execute("CREATE ROLE installer LOGIN CREATEROLE CREATEDB")
            if route == "pgtle":
                su.execute("GRANT pgtle_admin TO installer")
        with psycopg.connect(conninfo(cluster, "installer"), autocommit=True) as inst:
            inst.execute("CREATE DATABASE shop")
        if route == "pgtle":
            # pg_tle itself is the service's (created by its administrator, as on RDS).
            psql(cluster, ["-c", "CREATE EXTENSION pg_tle"], dbname="shop")
        install(cluster, route, user="installer", dbname="shop")
        with psycopg.connect(conninfo(cluster, "installer", "shop"), autocommit=True) as inst:
            assert inst.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone() == (False,)
            assert_no_library(cluster, route, inst)
            inst.execute("CREATE ROLE app LOGIN")
            inst.execute("GRANT USAGE ON SCHEMA idempotency TO app")
        with psycopg.connect(conninfo(cluster, "app", "shop"), autocommit=True) as app:
            r = app.execute("SELECT outcome::text, token FROM idempotency.claim('order-1', %s)",
                            (Jsonb({"sku": 7}),)).fetchone()
            assert r[0] == "new"
            app.execute("SELECT idempotency.complete('order-1', '{\"id\": 1}', 201)")
            assert app.execute("SELECT outcome::text, response, response_status FROM idempotency.claim('order-1', %s)",
                               (Jsonb({"sku": 7}),)).fetchone() == ("replay", {"id": 1}, 201)
            assert app.execute("SELECT (idempotency.lookup('order-1')).status::text").fetchone() == ("completed",)
            for sql in ("SELECT * FROM idempotency.idempotency_keys",
                        "DELETE FROM idempotency.idempotency_keys",
                        "SELECT idempotency.sweep()"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    app.execute(sql)
    finally:
        cluster.destroy()


def write_store(conn):
    """Completed and in-progress keys (with and without request hashes, a recovery point, a
    scope); returns what each must look like after a restore."""
    done = {}
    for i in range(3):
        req = Jsonb({"n": i, "big": 12345678901234567890}) if i else None
        conn.execute("SELECT idempotency.claim(%s, %s, scope => 'shop:1', ttl => '1 day')", (f"c{i}", req))
        conn.execute("SELECT idempotency.complete(%s, %s, 200 + %s, scope => 'shop:1')",
                     (f"c{i}", Jsonb({"answer": i}), i))
        done[f"c{i}"] = (req, {"answer": i}, 200 + i)
    open_ = {}
    for i in range(2):
        token = conn.execute("SELECT token FROM idempotency.claim(%s, %s, scope => 'shop:1', lease => '1 hour')",
                             (f"p{i}", Jsonb({"p": i}))).fetchone()[0]
        if i:
            conn.execute("SELECT idempotency.checkpoint(%s, 'half-way', scope => 'shop:1')", (f"p{i}",))
        open_[f"p{i}"] = (Jsonb({"p": i}), token, "half-way" if i else None)
    return done, open_


def check_store(conn, done, open_):
    for key, (req, response, status) in done.items():
        got = conn.execute("SELECT outcome::text, response, response_status FROM idempotency.claim(%s, %s, scope => 'shop:1')",
                           (key, req)).fetchone()
        assert got == ("replay", response, status), (key, got)
    top = 0
    for key, (req, token, point) in open_.items():
        got = conn.execute("SELECT outcome::text, recovery_point FROM idempotency.claim(%s, %s, scope => 'shop:1')",
                           (key, req)).fetchone()
        assert got == ("in_progress", point), (key, got)
        assert conn.execute("SELECT (idempotency.lookup(%s, 'shop:1')).token", (key,)).fetchone() == (token,)
        conn.execute("SELECT idempotency.complete(%s, '{\"late\": true}', scope => 'shop:1', token => %s)", (key, token))
        top = max(top, token)
    fresh = conn.execute("SELECT token FROM idempotency.claim('after-restore')").fetchone()[0]
    assert fresh > top, "the token sequence was restored with the rows"


DIRECTIONS = [("plain-15", "native", 15), ("native", "plain-15", 15),
              ("pgtle-18", "native", 18), ("native", "pgtle-18", 18)]


@pytest.mark.parametrize("source,target,major", DIRECTIONS,
                         ids=[f"{s}-to-{t}-{m}" for s, t, m in DIRECTIONS])
def test_a_store_dumped_from_one_edition_restores_into_the_other(source, target, major, tmp_path):
    """pg_dump --data-only --schema=idempotency of one edition, restored with psql into a
    database where the other edition was installed (docs/managed.md, "Moving between editions")."""
    clusters = []

    def side(name):
        if name == "native":
            if not os.path.exists(os.path.join(pkglibdir(NATIVE_BIN[major]), "idempotency.so")):
                pytest.skip(f"no native edition installed for PostgreSQL {major}")
            c = Cluster(bin=NATIVE_BIN[major]).start()
            clusters.append(c)
            with psycopg.connect(conninfo(c), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION idempotency")
            return c
        c, route = start(name)
        clusters.append(c)
        install(c, route)
        return c

    try:
        src = side(source)
        with psycopg.connect(conninfo(src), autocommit=True) as conn:
            done, open_ = write_store(conn)
        dump = tmp_path / "store.sql"
        subprocess.run([f"{src.bin}/pg_dump", "-h", src.dir, "-p", str(src.port), "-U", "postgres",
                        "--data-only", "--schema=idempotency", "-f", str(dump), src.dbname], check=True)
        os.chmod(tmp_path, 0o755)
        os.chmod(dump, 0o644)
        assert "COPY idempotency.idempotency_keys" in dump.read_text()
        dst = side(target)
        psql(dst, ["-f", str(dump)])
        with psycopg.connect(conninfo(dst), autocommit=True) as conn:
            check_store(conn, done, open_)
    finally:
        for c in clusters:
            c.destroy()


# Bad and refused calls: each edition must answer with the same SQLSTATE, message and hint.
CALLS = [
    "SELECT idempotency.claim(NULL)", "SELECT idempotency.claim('')", "SELECT idempotency.claim(repeat('k', 256))",
    "SELECT idempotency.claim('k', scope => NULL)", "SELECT idempotency.claim('k', ttl => '0')",
    "SELECT idempotency.claim('k', ttl => '-1 s')", "SELECT idempotency.claim('k', ttl => '11 years')",
    "SELECT idempotency.claim('k', ttl => '1 mon -30 days')",
    "SELECT idempotency.claim('k', ttl => '1 second', lease => '1 minute')", "SELECT idempotency.claim('k', lease => '0')",
    "SELECT idempotency.claim('k', request => '[1e400]')", "SELECT idempotency.complete('nokey', '{}')",
    "SELECT idempotency.complete('k', '{}', 99)", "SELECT idempotency.complete('k', '{}', NULL)",
    "SELECT idempotency.complete('k', '{}', ttl => '0')", "SELECT idempotency.checkpoint('nokey', 'x')",
    "SELECT idempotency.release('nokey')", "SELECT idempotency.forget('nokey')", "SELECT idempotency.lookup('nokey')",
    "SELECT idempotency.sweep(0)", "SELECT idempotency.claim_many(NULL)", "SELECT idempotency.claim_many('{{a},{b}}')",
    "SELECT idempotency.claim_many('{a,NULL}')", "SELECT idempotency.claim_many('{a,\"\"}')",
    "SELECT idempotency.claim_many('{a}', '{}')", "SELECT idempotency.verify_key('abc')",
    "SELECT idempotency.verify_key('k.1.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA')",
    "SELECT idempotency.sign_key(NULL)", "SELECT idempotency.set_key_storage('x')",
    "SET idempotency.max_response_size = 1; SELECT idempotency.claim('big'); "
    "SELECT idempotency.complete('big', jsonb_build_object('a', repeat('x', 5000)))",
    "SET idempotency.max_recovery_point_size = 1; SELECT idempotency.claim('rp'); "
    "SELECT idempotency.checkpoint('rp', repeat('x', 5000))",
    "SELECT idempotency.claim('dup', '{\"a\": 1}'); SELECT (idempotency.claim('dup', '{\"a\": 2}')).outcome::text",
    "SELECT idempotency.claim('dup2'); SELECT idempotency.complete('dup2', '{}', token => 999999)",
    "SELECT idempotency.claim('dup3'); SELECT idempotency.complete('dup3', '{}'); SELECT idempotency.complete('dup3', '{}')",
    "SELECT (idempotency.claim('sc', scope => 'a:1')).outcome::text; SELECT idempotency.rotate_signing_secret(); "
    "SELECT idempotency.verify_key(idempotency.sign_key('sc'))",
    # Values longer than 40 characters, quoted whole (the scope here, the key in the warning).
    "SET idempotency.scope_prefix = 't'; SELECT idempotency.claim('k', scope => repeat('s', 60) || E'\\\"')",
    "SELECT idempotency.claim(repeat('k', 255), '1'); SELECT (idempotency.claim(repeat('k', 255), '2')).outcome::text",
]


def answers(conn):
    """Each call's answer, or its error, and the warnings it raised."""
    out = []
    warnings = []
    conn.add_notice_handler(lambda d: warnings.append(d.message_primary) if d.severity_nonlocalized == "WARNING" else None)
    for sql in CALLS:
        warnings.clear()
        try:
            with conn.transaction():
                row = conn.execute(sql).fetchone()
                # A short text answer (an outcome, a key) is compared; rows with times are not.
                value = row[0] if row and isinstance(row[0], str) and len(row[0]) < 40 else None
                out.append(("ok", value, list(warnings)))
                raise psycopg.Rollback()
        except psycopg.Error as e:
            out.append((e.sqlstate, e.diag.message_primary, e.diag.message_hint, list(warnings)))
    return out


def test_refusals_have_the_native_editions_sqlstates_messages_and_hints():
    if not os.path.exists(os.path.join(pkglibdir(NATIVE_BIN[15]), "idempotency.so")):
        pytest.skip("no native edition installed for PostgreSQL 15")
    native = Cluster(bin=NATIVE_BIN[15]).start()
    try:
        portable, route = start("plain-15")
        try:
            with psycopg.connect(conninfo(native), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION idempotency")
                expected = answers(conn)
            install(portable, route)
            with psycopg.connect(conninfo(portable), autocommit=True) as conn:
                assert_no_library(portable, route, conn)
                got = answers(conn)
        finally:
            portable.destroy()
    finally:
        native.destroy()
    assert sum(e[0] != "ok" for e in expected) >= 25
    assert [(sql, e, g) for sql, e, g in zip(CALLS, expected, got) if e != g] == []


def test_the_portable_edition_works_where_the_native_library_is_preloaded():
    """A server moving from the portable edition to the native one preloads the library first:
    its settings prefix (idempotency.) is then reserved, and the portable edition's own session
    state must not live under it."""
    if not os.path.exists(os.path.join(pkglibdir(NATIVE_BIN[15]), "idempotency.so")):
        pytest.skip("no native edition installed for PostgreSQL 15")
    c = Cluster(bin=NATIVE_BIN[15], settings={"shared_preload_libraries": "'idempotency'"}).start()
    try:
        install(c, "plain")
        with psycopg.connect(conninfo(c), autocommit=True) as a, psycopg.connect(conninfo(c)) as b:
            assert a.execute("SELECT l.lanname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
                             "WHERE p.oid = 'idempotency.claim(text, jsonb, text, interval, interval)'::regprocedure").fetchone() == ("plpgsql",)
            assert a.execute("SELECT (idempotency.claim('moving', '{\"a\": 1}')).outcome::text").fetchone() == ("new",)
            a.execute("SELECT idempotency.complete('moving', '{\"ok\": true}')")
            assert a.execute("SELECT (c).outcome::text, (c).response FROM idempotency.claim('moving', '{\"a\": 1}') c"
                             ).fetchone() == ("replay", {"ok": True})
            # An open transaction's claim is answered in_progress at once in another session.
            assert b.execute("SELECT (idempotency.claim('open', '{}')).outcome::text").fetchone() == ("new",)
            a.execute("SET statement_timeout = '2s'")
            assert a.execute("SELECT (idempotency.claim('open', '{}')).outcome::text").fetchone() == ("in_progress",)
            b.rollback()
    finally:
        c.destroy()


def test_the_native_editions_default_settings_keep_claims_and_completions_on_their_short_path():
    """Where the native library is preloaded (a server moving between the editions), its
    settings read 1d, 5min and 4MB instead of nothing: those are the defaults, and a claim, its
    completion and a replay must not go down the general path for them (nested checks, the row
    trigger's call), which made each call several times slower. Counted with track_functions."""
    if not os.path.exists(os.path.join(pkglibdir(NATIVE_BIN[15]), "idempotency.so")):
        pytest.skip("no native edition installed for PostgreSQL 15")
    c = Cluster(bin=NATIVE_BIN[15], settings={"shared_preload_libraries": "'idempotency'",
                                              "track_functions": "'all'"}).start()
    try:
        install(c, "plain")
        with psycopg.connect(conninfo(c), autocommit=True) as a:
            assert a.execute("SHOW idempotency.default_ttl").fetchone() == ("1d",)  # the library's setting
            for i in range(3):
                with a.transaction():
                    assert a.execute("SELECT (idempotency.claim(%s, '{\"amount\": 100, \"currency\": \"EUR\"}')).outcome::text",
                                     (f"short-{i}",)).fetchone() == ("new",)
                    a.execute("SELECT idempotency.complete(%s, '{\"ok\": true}')", (f"short-{i}",))
                assert a.execute("SELECT (c).outcome::text, (c).response FROM idempotency.claim(%s, "
                                 "'{\"currency\": \"EUR\", \"amount\": 100}') c", (f"short-{i}",)
                                 ).fetchone() == ("replay", {"ok": True})
            a.execute("SELECT pg_stat_force_next_flush()")
        with psycopg.connect(conninfo(c), autocommit=True) as b:
            called = dict(b.execute("SELECT funcname, calls FROM pg_stat_user_functions "
                                    "WHERE schemaname = 'idempotency'").fetchall())
        assert called.get("claim") == 6 and called.get("_p_complete") == 3, called
        slow = {f: n for f, n in called.items()
                if f in ("_p_ttl_and_lease", "_p_setting", "_p_check_size", "_p_claim", "_p_claim_checked",
                         "_stored_key", "_canon_text", "_p_mark_row", "_p_mark", "_complete")}
        assert slow == {}, slow
    finally:
        c.destroy()


def test_schedule_sweep_makes_pg_cron_sweep_the_portable_store():
    """The route without a background sweeper: pg_cron (1.6.7, built into the library-free pg_tle
    server) runs the job schedule_sweep creates, and the expired keys go while live ones stay."""
    bin_dir = server_bin("pg-tle.sh", 18)
    try:
        subprocess.run([os.path.join(ROOT, "scripts", "pg-cron.sh"), "18", os.path.join(bin_dir, "pg_config")],
                       check=True, capture_output=True, text=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"scripts/pg-cron.sh 18 failed: {getattr(e, 'stderr', '')[-500:]}")
    c = Cluster(bin=bin_dir, settings={"shared_preload_libraries": "'pg_tle,pg_cron'",
                                       "cron.database_name": "'idem'", "cron.use_background_workers": "on",
                                       "max_worker_processes": "16"}).start()
    try:
        psql(c, ["-c", "CREATE EXTENSION pg_tle"])
        install(c, "pgtle")
        with psycopg.connect(conninfo(c), autocommit=True) as db:
            assert_no_library(c, "pgtle", db)
            db.execute("CREATE EXTENSION pg_cron")
            db.execute("SELECT count(*) FROM generate_series(1, 50) i, "
                       "idempotency.claim('old-' || i, ttl => '1 second', lease => '1 second')")
            db.execute("SELECT count(*) FROM generate_series(1, 5) i, idempotency.claim('live-' || i)")
            time.sleep(1.2)
            assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE expires_at <= now()"
                              ).fetchone() == (50,)
            job = db.execute("SELECT idempotency.schedule_sweep('2 seconds')").fetchone()[0]
            assert db.execute("SELECT schedule, command FROM cron.job WHERE jobid = %s", (job,)).fetchone() == \
                ("2 seconds", "SELECT idempotency.sweep()")
            deadline = time.monotonic() + 30
            while db.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key LIKE 'old-%%'").fetchone()[0]:
                assert time.monotonic() < deadline, db.execute(
                    "SELECT status, return_message FROM cron.job_run_details ORDER BY runid DESC LIMIT 3").fetchall()
                time.sleep(0.5)
            assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone() == (5,)
            db.execute("SELECT cron.unschedule(%s)", (job,))
    finally:
        c.destroy()


def test_the_build_refuses_a_c_function_without_a_portable_body(tmp_path):
    """A C function added to the native install script cannot be forgotten by the portable
    edition: the build fails, naming it (and builds again once its body exists)."""
    native = tmp_path / "idempotency.sql"
    with open(os.path.join(ROOT, "sql", "idempotency.sql"), encoding="utf-8") as f:
        text = f.read()
    native.write_text(text + "\nCREATE FUNCTION idempotency.brand_new(x integer)\nRETURNS integer\n"
                             "LANGUAGE c IMMUTABLE\nAS 'MODULE_PATHNAME', 'idempotency_brand_new';\n")
    spec = importlib.util.spec_from_file_location("portable", os.path.join(ROOT, "scripts", "portable.py"))
    portable = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(portable)
    sources = portable.SOURCES
    build = [os.path.join(ROOT, "scripts", "portable.py"), "build"]
    for mode in ("plain", "pgtle"):
        r = subprocess.run(["python3", *build, mode, str(native), *sources], capture_output=True, text=True)
        assert r.returncode != 0 and "brand_new" in r.stderr, r.stderr
    body = tmp_path / "brand_new.sql"
    body.write_text("CREATE FUNCTION idempotency.brand_new(x integer)\nRETURNS integer\nLANGUAGE sql IMMUTABLE\n"
                    "SET search_path = pg_catalog, pg_temp\nAS $fn$\n    SELECT x\n$fn$;\n")
    r = subprocess.run(["python3", *build, "plain", str(native), *sources, str(body)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "MODULE_PATHNAME" not in r.stdout and "LANGUAGE sql IMMUTABLE" in r.stdout
    # As built for CI: what scripts/portable.py writes is current.
    assert subprocess.run([os.path.join(ROOT, "scripts", "portable.py"), "--check"]).returncode == 0
