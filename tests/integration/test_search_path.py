"""Functions and operators planted in a schema that comes first in search_path (even before
pg_catalog) change nothing: every function runs with a pinned search path and schema-qualified
statements."""

import hashlib
import hmac

import psycopg
import pytest

from helpers import claim

ATTACK = """
CREATE SCHEMA evil;
CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2000-01-01'::pg_catalog.timestamptz $$;
CREATE FUNCTION evil.sha256(bytea) RETURNS bytea LANGUAGE sql AS $$ SELECT '\\x00'::pg_catalog.bytea $$;
CREATE FUNCTION evil.length(bytea) RETURNS int LANGUAGE sql AS $$ SELECT 32 $$;
CREATE FUNCTION evil.format(text, VARIADIC text[]) RETURNS text LANGUAGE sql AS $$ SELECT 'pwned' $$;
CREATE FUNCTION evil.nextval(regclass) RETURNS bigint LANGUAGE sql AS $$ SELECT 424242::pg_catalog.int8 $$;
CREATE FUNCTION evil.texteq_always(text, text) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.texteq_always);
CREATE FUNCTION evil.tsle_always(timestamptz, timestamptz) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
CREATE OPERATOR evil.<= (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = evil.tsle_always);
CREATE OPERATOR evil.> (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = evil.tsle_always);
"""


@pytest.fixture
def attacked(cluster, db):
    db.execute("DROP DATABASE IF EXISTS attacked")
    db.execute("CREATE DATABASE attacked")
    with psycopg.connect(cluster.conninfo().replace("dbname=idem", "dbname=attacked"), autocommit=True) as c:
        c.execute("CREATE EXTENSION idempotency")
        c.execute(ATTACK)
        c.execute("SET search_path = evil, public, pg_catalog")
        # The planted objects do take effect for unqualified names in this session...
        assert c.execute("SELECT now() = '2000-01-01'::pg_catalog.timestamptz").fetchone()[0]
        assert c.execute("SELECT 'a'::text = 'b'::text").fetchone()[0]
        yield c
    db.execute("DROP DATABASE attacked")


def test_every_function_ignores_planted_objects(attacked):
    c = attacked
    first = claim(c, "k1", {"a": 1})
    assert first[0] == "new" and first[1] != 424242, first
    assert claim(c, "k2", {"a": 1})[0] == "new"  # '=' that is always true would make k2 hit k1
    assert claim(c, "k1", {"a": 1})[0] == "in_progress"
    assert claim(c, "k1", {"a": 2})[0] == "mismatch"
    c.execute("SELECT idempotency.checkpoint('k1', 'step-1')")
    expires = c.execute("SELECT idempotency.complete('k1', '{\"ok\": true}')").fetchone()[0]
    assert expires.year > 2000
    r = claim(c, "k1", {"a": 1})
    assert r[0] == "replay" and r[2] == {"ok": True}
    row = c.execute("SELECT (l).status::pg_catalog.text, (l).created_at > '2020-01-01'::pg_catalog.timestamptz "
                    "FROM idempotency.lookup('k1') l").fetchone()
    assert row == ("completed", True)
    assert c.execute("SELECT idempotency.release('k2')").fetchone()[0] is True
    assert c.execute("SELECT idempotency.forget('k1')").fetchone()[0] is True
    assert c.execute("SELECT idempotency.sweep()").fetchone()[0] == 0, "live rows must not be swept"
    h = c.execute("SELECT pg_catalog.encode(idempotency.canonical_hash('{\"a\": 1}'), 'hex')").fetchone()[0]
    assert h == "015abd7f5cc57a2dd94b7590f04ad8084273905ee33ec5cebeae62276a97f862"
    try:
        c.execute("SELECT idempotency.complete('absent', '{}')")
        raise AssertionError("expected IK001")
    except psycopg.Error as e:
        assert e.sqlstate == "IK001" and "pwned" not in str(e)
    assert c.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 0


MORE_ATTACK = """
CREATE FUNCTION evil.encode(bytea, text) RETURNS text LANGUAGE sql AS $$ SELECT 'pwned'::pg_catalog.text $$;
CREATE FUNCTION evil.convert_to(text, name) RETURNS bytea LANGUAGE sql AS $$ SELECT '\\x00'::pg_catalog.bytea $$;
CREATE FUNCTION evil.quote_literal(text) RETURNS text LANGUAGE sql AS $$ SELECT 'pwned'::pg_catalog.text $$;
CREATE FUNCTION evil.left(text, int) RETURNS text LANGUAGE sql AS $$ SELECT 'pwned'::pg_catalog.text $$;
CREATE FUNCTION evil.make_interval(years int DEFAULT 0, months int DEFAULT 0, weeks int DEFAULT 0, days int DEFAULT 0,
    hours int DEFAULT 0, mins int DEFAULT 0, secs double precision DEFAULT 0) RETURNS interval
    LANGUAGE sql AS $$ SELECT '-100 years'::pg_catalog.interval $$;
"""


def test_install_script_and_newer_functions_ignore_planted_objects(cluster, db):
    """CREATE EXTENSION itself runs with the attacker's objects first in search_path, then the
    signed-key, hashed-key and audit functions run under it too."""
    db.execute("DROP DATABASE IF EXISTS attacked2")
    db.execute("CREATE DATABASE attacked2")
    try:
        with psycopg.connect(cluster.conninfo().replace("dbname=idem", "dbname=attacked2"), autocommit=True) as c:
            c.execute(ATTACK)
            c.execute(MORE_ATTACK)
            c.execute("SET search_path = evil, public, pg_catalog")
            c.execute("CREATE EXTENSION idempotency")
            defaults = c.execute(
                "SELECT pg_catalog.string_agg(pg_catalog.pg_get_expr(d.adbin, d.adrelid), ' ') FROM pg_catalog.pg_attrdef d "
                "JOIN pg_catalog.pg_class r ON r.oid = d.adrelid WHERE r.relnamespace = 'idempotency'::pg_catalog.regnamespace"
            ).fetchone()[0]
            assert "evil" not in defaults and "pg_catalog.now()" in defaults
            c.execute("SELECT idempotency.rotate_signing_secret()")
            signed = c.execute("SELECT idempotency.sign_key('k')").fetchone()[0]
            assert c.execute("SELECT idempotency.verify_key(%s)", (signed,)).fetchone()[0] == "k"
            try:
                c.execute("SELECT idempotency.verify_key(%s)", ("k.1." + "A" * 43,))
                raise AssertionError("a forged key verified")
            except psycopg.Error as e:
                assert e.sqlstate == "IK004"
            c.execute("SET idempotency.audit = on")
            first = claim(c, "plain-key", {"a": 1})
            c.execute("SELECT idempotency.complete('plain-key', '{}', token => %s)", (first[1],))
            assert c.execute("SELECT idempotency.set_key_storage('sha256')").fetchone()[0] == 1
            key = c.execute("SELECT key FROM idempotency.idempotency_keys").fetchone()[0]
            secret = c.execute("SELECT key_secret FROM idempotency.config").fetchone()[0]
            # The planted evil.sha256 (which returns one zero byte) was not the one called.
            assert key == hmac.new(secret, hashlib.sha256(b"plain-key").digest(), "sha256").hexdigest()
            assert claim(c, "plain-key", {"a": 1})[0] == "replay"
            try:
                c.execute("SELECT idempotency.complete('plain-key', '{}')")
                raise AssertionError("expected IK002")
            except psycopg.Error as e:
                assert e.sqlstate == "IK002" and "pwned" not in str(e) and "key (hashed)" in str(e)
                assert key[:8] not in str(e)
            audit = c.execute("SELECT key, key_is_hash FROM idempotency.audit").fetchall()
            assert audit == [(key, True)]
            assert c.execute("SELECT idempotency.sweep_audit()").fetchone()[0] == 0  # retention 0: kept
    finally:
        db.execute("DROP DATABASE attacked2 WITH (FORCE)")
