"""Databases in other encodings than UTF-8.

Canonical JSON, hashes, keys, scopes, derivations and fingerprints are defined over Unicode:
text is converted from the database encoding to UTF-8, so one document hashes the same in every
encoding that can hold it (checked against the RFC 8785 oracle and against a UTF-8 database),
and text handed back is converted to the database encoding. SQL_ASCII is refused. Sessions use
client_encoding UTF8: the server converts what they send into the database encoding."""

import hashlib
import json
import os
import shutil
import subprocess

import psycopg
import pytest
from psycopg.types.json import Jsonb

from cluster import PG_BIN
from test_canonical_oracle import oracle

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")

# Database name -> (encoding, Python codec of the same encoding).
DATABASES = {
    "enc_utf8": ("UTF8", "utf-8"),
    "enc_latin1": ("LATIN1", "latin-1"),
    "enc_eucjp": ("EUC_JP", "euc_jp"),
}
# Text each encoding can hold: ASCII and Latin-1 letters (EUC_JP has them in JIS X 0212), and
# Japanese for the multibyte encoding.
WORDS = {
    "enc_utf8": ["é", "ü", "ß", "Ça", "ñandú", "日本語", "ｶﾅ", "€"],
    "enc_latin1": ["é", "ü", "ß", "Ça", "ñandú", "\u00a0x\u00ff"],
    "enc_eucjp": ["é", "ü", "ß", "日本語", "ｶﾅ", "漢字かな"],
}


def conninfo(cluster, dbname):
    return f"host={cluster.dir} port={cluster.port} user=postgres dbname={dbname} client_encoding=UTF8"


@pytest.fixture(scope="module")
def databases(cluster):
    with psycopg.connect(cluster.conninfo(), autocommit=True) as admin:
        for name, (enc, _) in list(DATABASES.items()) + [("enc_sqlascii", ("SQL_ASCII", None))]:
            admin.execute(f"DROP DATABASE IF EXISTS {name}")
            admin.execute(
                f"CREATE DATABASE {name} WITH ENCODING '{enc}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
            )
    for name, (enc, _) in DATABASES.items():
        with psycopg.connect(conninfo(cluster, name), autocommit=True) as db:
            assert db.execute("SELECT pg_catalog.getdatabaseencoding()").fetchone()[0] == enc
            db.execute("CREATE EXTENSION idempotency")
    yield cluster
    with psycopg.connect(cluster.conninfo(), autocommit=True) as admin:
        for name in list(DATABASES) + ["enc_sqlascii"]:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def session(databases):
    opened = []

    def _open(name):
        conn = psycopg.connect(conninfo(databases, name), autocommit=True)
        opened.append(conn)
        conn.execute("DELETE FROM idempotency.idempotency_keys")
        return conn

    yield _open
    for conn in opened:
        conn.close()


def stored_as(db, text, codec):
    """Checks that the server holds `text` in its own encoding (what the session sent arrived)."""
    assert db.execute("SELECT octet_length(%s::text)", (text,)).fetchone()[0] == len(text.encode(codec))


def docs_for(name):
    words = WORDS[name]
    a, b = words[0], words[-1]
    return [
        json.dumps({"name": a}, ensure_ascii=False),
        json.dumps({w: i for i, w in enumerate(words)}, ensure_ascii=False),
        json.dumps({"z": [a, {b: [1.0, "x" + b]}], a: None, "a": 1e2, b + a: "\u00e9t\u00e9"}, ensure_ascii=False),
        json.dumps([b, a, {"": a * 3}], ensure_ascii=False),
        json.dumps(a + b, ensure_ascii=False),
        # \u escapes: the server turns them into the database encoding's characters.
        json.dumps({a: b}, ensure_ascii=True),
    ]


def canonical(db, docs):
    return [
        db.execute(
            "SELECT idempotency.canonical_json(%s::jsonb), encode(idempotency.canonical_hash(%s::jsonb), 'hex')",
            (d, d),
        ).fetchone()
        for d in docs
    ]


@pytest.mark.parametrize("name", list(DATABASES))
def test_canonical_forms_match_the_oracle_and_utf8(session, name):
    _, codec = DATABASES[name]
    db, utf8 = session(name), session("enc_utf8")
    docs = docs_for(name)
    for d in docs:
        stored_as(db, d, codec)
    got = canonical(db, docs)
    expected_json = oracle(docs, "--numbers", "exact")
    expected_hash = oracle(docs, "--numbers", "exact", "--sha256")
    assert [g[0] for g in got] == expected_json
    assert [g[1] for g in got] == expected_hash
    # The same documents in a UTF-8 database: byte for byte the same results.
    assert got == canonical(utf8, docs)


@pytest.mark.parametrize("name", list(DATABASES))
def test_different_text_is_a_mismatch(session, name):
    db = session(name)
    first, second = WORDS[name][0], WORDS[name][1]
    h1, h2 = (
        db.execute("SELECT idempotency.canonical_hash(%s)", (Jsonb({"name": w}),)).fetchone()[0]
        for w in (first, second)
    )
    assert h1 != h2
    assert bytes(h1) == hashlib.sha256(f'{{"name":"{first}"}}'.encode()).digest()
    key = "order-" + name
    claim = "SELECT outcome::text, token FROM idempotency.claim(%s, %s)"
    outcome, token = db.execute(claim, (key, Jsonb({"name": first}))).fetchone()
    assert outcome == "new"
    db.execute("SELECT idempotency.complete(%s, '{\"ok\": true}', token => %s)", (key, token))
    assert db.execute(claim, (key, Jsonb({"name": second}))).fetchone()[0] == "mismatch"
    assert db.execute(claim, (key, Jsonb({"name": first}))).fetchone()[0] == "replay"


@pytest.mark.parametrize("name", list(DATABASES))
def test_exclusions_agree_with_the_streaming_hash(session, name):
    db = session(name)
    a, b = WORDS[name][0], WORDS[name][-1]
    doc = Jsonb({"name": a, b: [a, {a: b}], "n": 1})
    q = "SELECT idempotency.canonical_hash(%s), idempotency.canonical_hash(%s, %s)"
    plain, excluded = db.execute(q, (doc, doc, ["nothere"])).fetchone()
    assert plain == excluded
    assert db.execute(q, (doc, doc, ["/nothere/x"])).fetchone()[1] == plain
    # A non-ASCII member name in exclude, as a plain name and as a JSON Pointer.
    without = db.execute("SELECT idempotency.canonical_hash(%s)", (Jsonb({"name": a, "n": 1}),)).fetchone()[0]
    assert db.execute(q, (doc, doc, [b])).fetchone()[1] == without
    assert db.execute(q, (doc, doc, ["/" + b])).fetchone()[1] == without


@pytest.mark.parametrize("name", list(DATABASES))
def test_non_ascii_keys_and_scopes(session, name):
    _, codec = DATABASES[name]
    db = session(name)
    words = WORDS[name]
    key, scope = f"clé-{words[-1]}", f"boutique-{words[1]}"
    request = Jsonb({"item": words[0]})
    claim = "SELECT outcome::text, token, response FROM idempotency.claim(%s, %s, scope => %s)"
    outcome, token, _ = db.execute(claim, (key, request, scope)).fetchone()
    assert outcome == "new"
    # Stored in the database encoding (the text columns read back as the same characters).
    row = db.execute(
        "SELECT key, scope, octet_length(key), octet_length(scope), encode(request_hash, 'hex') "
        "FROM idempotency.idempotency_keys"
    ).fetchall()
    expected_hash = oracle([json.dumps({"item": words[0]}, ensure_ascii=False)], "--numbers", "exact", "--sha256")[0]
    assert row == [(key, scope, len(key.encode(codec)), len(scope.encode(codec)), expected_hash)]
    db.execute("SELECT idempotency.checkpoint(%s, %s, %s, %s)", (key, f"étape {words[-1]}", scope, token))
    assert db.execute("SELECT (idempotency.lookup(%s, %s)).recovery_point", (key, scope)).fetchone()[0] == f"étape {words[-1]}"
    db.execute("SELECT idempotency.complete(%s, %s, 201, %s, %s)", (key, Jsonb({"ok": words[0]}), scope, token))
    assert db.execute(claim, (key, request, scope)).fetchone() == ("replay", token, {"ok": words[0]})
    assert db.execute("SELECT (idempotency.lookup(%s, %s)).key", (key, scope)).fetchone()[0] == key
    # Another key in the same scope is another row; another scope is another key space.
    assert db.execute(claim, (key + "2", request, scope)).fetchone()[0] == "new"
    assert db.execute(claim, (key, request, scope + "2")).fetchone()[0] == "new"
    assert db.execute("SELECT idempotency.release(%s, %s)", (key + "2", scope)).fetchone()[0] is True
    assert db.execute("SELECT idempotency.forget(%s, %s)", (key, scope)).fetchone()[0] is True
    assert db.execute("SELECT idempotency.lookup(%s, %s) IS NULL", (key, scope)).fetchone()[0] is True
    # Forgotten: new again. A different request is a mismatch (its WARNING names the key).
    assert db.execute(claim, (key, request, scope)).fetchone()[0] == "new"
    assert db.execute(claim, (key, Jsonb({"item": words[1]}), scope)).fetchone()[0] == "mismatch"


@pytest.mark.parametrize("name", ["enc_latin1", "enc_eucjp"])
def test_non_ascii_scope_prefix(session, name):
    db = session(name)
    prefix = f"tenant-{WORDS[name][0]}:"
    db.execute("SELECT set_config('idempotency.scope_prefix', %s, false)", (prefix,))
    claim = "SELECT outcome::text FROM idempotency.claim('k', scope => %s)"
    assert db.execute(claim, (prefix + "1",)).fetchone()[0] == "new"
    with pytest.raises(psycopg.Error) as e:
        db.execute(claim, ("tenant-x:1",))
    assert e.value.sqlstate == "42501"


@pytest.mark.parametrize("name", ["enc_utf8", "enc_eucjp"])
def test_a_prefix_set_from_a_latin1_database_is_refused_not_decoded_lossily(databases, session, name):
    """0.4.0: ALTER ROLE ... SET applies to every database, so 'müller:' and 'möller:' set from a
    LATIN1 database are LATIN1 bytes in every other one; a UTF-8 database decoded both lossily as
    'm\uFFFDller:', and each tenant read, replayed and forgot the other's keys (an EUC_JP
    database answered 22P05, "no equivalent in Unicode"). A prefix that is not valid text in the
    database encoding refuses every scoped call with 22021, naming the setting."""
    from psycopg import sql
    roles = {"enc_mueller": "müller:", "enc_moeller": "möller:"}
    latin1 = session("enc_latin1")
    target = session(name)  # its table emptied
    try:
        for role, prefix in roles.items():
            latin1.execute(f"DROP ROLE IF EXISTS {role}")
            latin1.execute(f"CREATE ROLE {role} LOGIN")
            latin1.execute(sql.SQL("ALTER ROLE {} SET idempotency.scope_prefix = {}").format(
                sql.Identifier(role), sql.Literal(prefix)))
            assert latin1.execute("SELECT setconfig FROM pg_db_role_setting WHERE setrole = %s::regrole",
                                  (role,)).fetchone()[0] == [f"idempotency.scope_prefix={prefix}"]
            for db in ("enc_latin1", name):
                with psycopg.connect(conninfo(databases, db), autocommit=True) as su:
                    su.execute(f"GRANT USAGE ON SCHEMA idempotency TO {role}")
        # Where it was set, the prefix is the one meant.
        with psycopg.connect(conninfo(databases, "enc_latin1").replace("user=postgres", "user=enc_mueller"),
                             autocommit=True) as m:
            assert m.execute("SELECT outcome::text FROM idempotency.claim('k', scope => 'müller:1')").fetchone()[0] == "new"
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                m.execute("SELECT idempotency.claim('k', scope => 'möller:1')")
        scopes = ["m\ufffdller:1", "müller:1"] if name == "enc_utf8" else ["müller:1"]
        for role in roles:
            with psycopg.connect(conninfo(databases, name).replace("user=postgres", f"user={role}"),
                                 autocommit=True) as t:
                for scope in scopes:
                    for call in ("SELECT idempotency.claim('k', scope => %s)",
                                 "SELECT idempotency.lookup('k', %s)",
                                 "SELECT idempotency.forget('k', %s)"):
                        with pytest.raises(psycopg.Error) as e:
                            t.execute(call, (scope,))
                        assert e.value.sqlstate == "22021", (role, call, e.value.sqlstate, str(e.value))
                        assert "idempotency.scope_prefix" in e.value.diag.message_primary
        assert target.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 0
    finally:
        for db in ("enc_latin1", name):
            with psycopg.connect(conninfo(databases, db), autocommit=True) as su:
                for role in roles:
                    su.execute(f"DO $$ BEGIN IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') "
                               f"THEN EXECUTE 'DROP OWNED BY {role}'; END IF; END $$")
        for role in roles:
            latin1.execute(f"DROP ROLE IF EXISTS {role}")


@pytest.mark.parametrize("name", list(DATABASES))
def test_derivations_and_fingerprints_match_utf8(session, name):
    db, utf8 = session(name), session("enc_utf8")
    words = WORDS[name]
    params = Jsonb({"montant": words[0], words[-1]: [1, words[1]]})
    derive = "SELECT idempotency.derive_key(%s, %s, %s)"
    args = (f"commande-{words[0]}", f"débit-{words[-1]}", params)
    derived = db.execute(derive, args).fetchone()[0]
    params_doc = json.dumps({"montant": words[0], words[-1]: [1, words[1]]}, ensure_ascii=False)
    params_hash = oracle([params_doc], "--numbers", "exact", "--sha256")[0]
    assert derived == f"{args[0]}:{args[1]}:{params_hash[:16]}"
    assert derived == utf8.execute(derive, args).fetchone()[0]
    assert db.execute(derive, (args[0], args[1], None)).fetchone()[0] == utf8.execute(derive, (args[0], args[1], None)).fetchone()[0]
    fp = "SELECT encode(idempotency.request_fingerprint(%s, %s, %s, %s), 'hex')"
    fargs = ("post", f"/commandes/{words[0]}", Jsonb({"q": words[-1]}), Jsonb({"x": words[1]}))
    got = db.execute(fp, fargs).fetchone()[0]
    doc = json.dumps(
        {"method": "POST", "path": f"/commandes/{words[0]}", "query": {"q": words[-1]}, "body": {"x": words[1]}},
        ensure_ascii=False,
    )
    assert got == oracle([doc], "--numbers", "exact", "--sha256")[0]
    assert got == utf8.execute(fp, fargs).fetchone()[0]
    cron = "SELECT idempotency.cron_key(%s, '2026-11-30 01:02:03+00', '1 day')"
    assert db.execute(cron, (f"rapport-{words[0]}",)).fetchone()[0] == f"rapport-{words[0]}:2026-11-30T00:00:00Z/P1D"


@pytest.mark.parametrize("name", ["enc_latin1", "enc_eucjp"])
def test_signed_and_hashed_keys(session, name):
    db = session(name)
    key = f"clé-{WORDS[name][-1]}"
    db.execute("SELECT idempotency.rotate_signing_secret()")
    signed = db.execute("SELECT idempotency.sign_key(%s)", (key,)).fetchone()[0]
    assert signed.startswith(key + ".")
    assert db.execute("SELECT idempotency.verify_key(%s)", (signed,)).fetchone()[0] == key
    db.execute("SELECT idempotency.set_key_storage('sha256')")
    try:
        claim = "SELECT outcome::text, token FROM idempotency.claim(idempotency.verify_key(%s), '{}')"
        outcome, token = db.execute(claim, (signed,)).fetchone()
        assert outcome == "new"
        stored = db.execute("SELECT key FROM idempotency.idempotency_keys").fetchall()
        assert len(stored) == 1 and stored[0][0] != key and stored[0][0].isascii()
        db.execute("SELECT idempotency.complete(%s, '{}', token => %s)", (key, token))
        assert db.execute(claim, (signed,)).fetchone() == ("replay", token)
        assert db.execute("SELECT idempotency.forget(%s)", (key,)).fetchone()[0] is True
    finally:
        db.execute("DELETE FROM idempotency.idempotency_keys")
        db.execute("SELECT idempotency.set_key_storage('plain')")


def test_untranslatable_text_is_22P05_naming_the_argument(session):
    """EUC_JP byte pairs such as 0xA2AF are valid in the database but have no Unicode character."""
    db = session("enc_eucjp")
    odd = "pg_catalog.convert_from('\\xa2af'::bytea, 'EUC_JP')"
    assert db.execute(f"SELECT octet_length({odd})").fetchone()[0] == 2
    cases = [
        (f"SELECT idempotency.claim('k' || {odd})", "key: "),
        (f"SELECT idempotency.claim('k', scope => {odd})", "scope: "),
        (f"SELECT idempotency.canonical_hash(pg_catalog.jsonb_build_object('a', {odd}))", "doc: "),
        (f"SELECT idempotency.canonical_json(pg_catalog.jsonb_build_object({odd}, 1))", "doc: "),
        (f"SELECT idempotency.claim('k', pg_catalog.jsonb_build_array({odd}))", "request: "),
        (f"SELECT idempotency.derive_key({odd}, 'step')", "parent: "),
        (f"SELECT idempotency.request_fingerprint('GET', {odd})", "path: "),
    ]
    for sql, prefix in cases:
        with pytest.raises(psycopg.Error) as e:
            db.execute(sql)
        assert e.value.sqlstate == "22P05", (sql, e.value.sqlstate, str(e.value))
        assert e.value.diag.message_primary.startswith(prefix), (sql, e.value.diag.message_primary)
        assert "0xa2 0xaf" in e.value.diag.message_primary
        assert "EUC_JP" in e.value.diag.message_primary
    assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 0


def frozen_release_installed(version):
    """Puts a frozen install script of an earlier release next to the installed extension, as
    test_upgrade.py does (cargo pgrx install copies only the current one)."""
    pg_config = os.path.join(PG_BIN, "pg_config")
    sharedir = subprocess.run([pg_config, "--sharedir"], check=True, capture_output=True, text=True).stdout.strip()
    src = os.path.join(ROOT, "sql", "releases", f"idempotency--{version}.sql")
    dst = os.path.join(sharedir, "extension", f"idempotency--{version}.sql")
    if not os.path.exists(dst) or open(src, "rb").read() != open(dst, "rb").read():
        shutil.copyfile(src, dst)


def test_sql_ascii_is_refused(databases):
    frozen_release_installed("0.2.0")
    with psycopg.connect(conninfo(databases, "enc_sqlascii"), autocommit=True) as db:
        assert db.execute("SELECT pg_catalog.getdatabaseencoding()").fetchone()[0] == "SQL_ASCII"
        with pytest.raises(psycopg.Error) as e:
            db.execute("CREATE EXTENSION idempotency")
        assert e.value.sqlstate == "0A000"
        assert "SQL_ASCII" in e.value.diag.message_primary
        assert "ENCODING 'UTF8'" in e.value.diag.message_hint
        assert db.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'").fetchone()[0] == 0
        # An extension created before the check (0.2.0's script has none): the library refuses
        # every call that reads text, and the update to 0.3.0 says why.
        db.execute("CREATE EXTENSION idempotency VERSION '0.2.0'")
        assert db.execute("SELECT extversion FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0] == "0.2.0"
        for sql in [
            "SELECT idempotency.claim('k')",
            "SELECT idempotency.canonical_hash('{\"a\": \"x\"}')",
            "SELECT idempotency.canonical_json('[1]')",
            "SELECT idempotency.derive_key('a', 'b')",
        ]:
            with pytest.raises(psycopg.Error) as e:
                db.execute(sql)
            assert e.value.sqlstate == "0A000", (sql, e.value.sqlstate, str(e.value))
            assert "SQL_ASCII" in e.value.diag.message_primary
        with pytest.raises(psycopg.Error) as e:
            db.execute("ALTER EXTENSION idempotency UPDATE TO '0.3.0'")
        assert e.value.sqlstate == "0A000"
        assert db.execute("SELECT extversion FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0] == "0.2.0"


def test_mule_internal_is_refused(databases):
    """0.4.0: a MULE_INTERNAL database accepted CREATE EXTENSION, then every call that reads text
    failed with 42883 (PostgreSQL has no conversion between MULE_INTERNAL and UTF-8). Refused
    as SQL_ASCII is: at CREATE EXTENSION, at ALTER EXTENSION UPDATE, and by the library."""
    frozen_release_installed("0.4.0")
    with psycopg.connect(databases.conninfo(), autocommit=True) as admin:
        admin.execute("DROP DATABASE IF EXISTS enc_mule")
        admin.execute("CREATE DATABASE enc_mule WITH ENCODING 'MULE_INTERNAL' LC_COLLATE 'C' LC_CTYPE 'C' "
                      "TEMPLATE template0")
    try:
        # No conversion to UTF8 exists: the session speaks SQL_ASCII (ASCII statements only).
        info = conninfo(databases, "enc_mule").replace("client_encoding=UTF8", "client_encoding=SQL_ASCII")
        with psycopg.connect(info, autocommit=True) as db:
            # (text comes back as bytes in a SQL_ASCII session)
            assert db.execute("SELECT pg_catalog.getdatabaseencoding()").fetchone()[0] in ("MULE_INTERNAL", b"MULE_INTERNAL")
            with pytest.raises(psycopg.Error) as e:
                db.execute("CREATE EXTENSION idempotency")
            assert e.value.sqlstate == "0A000", str(e.value)
            assert "MULE_INTERNAL" in e.value.diag.message_primary
            assert "ENCODING 'UTF8'" in e.value.diag.message_hint
            assert db.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'").fetchone()[0] == 0
            # An extension created by 0.4.0 (which did not check): the library refuses every call
            # with 0A000 (not 42883), and the update says why and changes nothing.
            db.execute("CREATE EXTENSION idempotency VERSION '0.4.0'")
            for sql in [
                "SELECT idempotency.claim('k')",
                "SELECT idempotency.claim('k', '{\"a\": \"x\"}', 's')",
                "SELECT idempotency.canonical_hash('{\"a\": \"x\"}')",
                "SELECT idempotency.canonical_json('[1]')",
                "SELECT idempotency.derive_key('a', 'b')",
                "SELECT idempotency.lookup('k')",
            ]:
                with pytest.raises(psycopg.Error) as e:
                    db.execute(sql)
                assert e.value.sqlstate == "0A000", (sql, e.value.sqlstate, str(e.value))
                assert "MULE_INTERNAL" in e.value.diag.message_primary
            with pytest.raises(psycopg.Error) as e:
                db.execute("ALTER EXTENSION idempotency UPDATE")
            assert e.value.sqlstate == "0A000", str(e.value)
            assert "MULE_INTERNAL" in e.value.diag.message_primary
            assert db.execute("SELECT extversion = '0.4.0' FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0]
            assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 0
    finally:
        with psycopg.connect(databases.conninfo(), autocommit=True) as admin:
            admin.execute("DROP DATABASE IF EXISTS enc_mule WITH (FORCE)")


def test_install_scripts_are_ascii():
    """Extension scripts are read in the database's encoding: only ASCII means the same in all."""
    # The portable edition's scripts too (dist/: the plain install and update; pg_tle's are made from them).
    dist = sorted(os.path.join("dist", f) for f in os.listdir(os.path.join(ROOT, "dist")) if f.endswith(".sql"))
    assert "dist/idempotency-portable.sql" in dist and len(dist) >= 2, dist
    for path in ["sql/idempotency.sql", "sql/idempotency--0.2.0--0.3.0.sql", "sql/idempotency--0.3.0--0.4.0.sql",
                 "sql/idempotency--0.4.0--0.5.0.sql", "sql/idempotency--0.5.0--0.6.0.sql"] + dist:
        with open(os.path.join(ROOT, path), "rb") as f:
            data = f.read()
        bad = [i for i, b in enumerate(data) if b > 0x7F]
        assert not bad, f"{path}: non-ASCII byte at offset {bad[0]}"
