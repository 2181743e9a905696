"""Signed keys: sign_key / verify_key with server secrets that rotate, and that no one but a
superuser can see - not through SQL, pg_settings, pg_dump or the server log."""

import os
import subprocess

import psycopg
import pytest

from cluster import PG_BIN


def refused(conn, signed):
    with pytest.raises(psycopg.Error) as e:
        conn.execute("SELECT idempotency.verify_key(%s)", (signed,))
    assert e.value.sqlstate == "IK004", (signed, e.value.sqlstate, str(e.value))
    return str(e.value)


@pytest.fixture
def secrets(db):
    db.execute("DELETE FROM idempotency.signing_secrets")
    yield db
    db.execute("DELETE FROM idempotency.signing_secrets")


def test_sign_needs_a_secret(secrets):
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
        secrets.execute("SELECT idempotency.sign_key('k')")
    with pytest.raises(psycopg.errors.NullValueNotAllowed, match="key must not be NULL"):
        secrets.execute("SELECT idempotency.sign_key(NULL)")
    with pytest.raises(psycopg.errors.NullValueNotAllowed, match="signed must not be NULL"):
        secrets.execute("SELECT idempotency.verify_key(NULL)")


def test_round_trip_and_forgeries(secrets):
    db = secrets
    kid = db.execute("SELECT idempotency.rotate_signing_secret()").fetchone()[0]
    for key in ["order-42", "a.b.c", "workflow:step:{\"x\": 1}", "ключ-é-🔑", "x" * 255]:
        signed = db.execute("SELECT idempotency.sign_key(%s)", (key,)).fetchone()[0]
        assert signed.startswith(f"{key}.{kid}.")
        assert db.execute("SELECT idempotency.verify_key(%s)", (signed,)).fetchone()[0] == key
    signed = db.execute("SELECT idempotency.sign_key('order-42')").fetchone()[0]
    flips = 0
    # Every bit of every byte flipped, one at a time: refused (or no longer valid UTF-8).
    raw = signed.encode()
    for i in range(len(raw)):
        for bit in range(8):
            b = bytearray(raw)
            b[i] ^= 1 << bit
            try:
                tampered = b.decode()
            except UnicodeDecodeError:
                continue
            if "\x00" in tampered:
                continue
            refused(db, tampered)
            flips += 1
    assert flips > 100
    for bad in [
        signed[:-1],                      # truncated signature
        signed[:-10],
        signed + "A",                     # extended
        signed.rsplit(".", 1)[0],         # no signature
        "order-42",                       # bare key
        "order-43" + signed[len("order-42"):],  # signature of another key
        signed.replace(f".{kid}.", f".{kid + 1}."),  # another secret id
        signed.replace(f".{kid}.", f".0{kid}."),
        "",
        ".".join(["", str(kid), signed.rsplit(".", 1)[1]]),
    ]:
        refused(db, bad)


def test_rotation_and_retirement(secrets):
    db = secrets
    old = db.execute("SELECT idempotency.rotate_signing_secret()").fetchone()[0]
    by_old = db.execute("SELECT idempotency.sign_key('k')").fetchone()[0]
    new = db.execute("SELECT idempotency.rotate_signing_secret()").fetchone()[0]
    assert new > old
    by_new = db.execute("SELECT idempotency.sign_key('k')").fetchone()[0]
    assert by_new.startswith(f"k.{new}.") and by_new != by_old  # the newer secret signs
    for s in (by_old, by_new):  # both verify
        assert db.execute("SELECT idempotency.verify_key(%s)", (s,)).fetchone()[0] == "k"
    assert db.execute("SELECT idempotency.retire_signing_secret(%s)", (old,)).fetchone()[0] is True
    assert "does not exist" in refused(db, by_old)
    assert db.execute("SELECT idempotency.verify_key(%s)", (by_new,)).fetchone()[0] == "k"
    # A new secret never takes a retired one's id, so the old signature stays refused.
    again = db.execute("SELECT idempotency.rotate_signing_secret()").fetchone()[0]
    assert again > new
    refused(db, by_old)
    assert db.execute("SELECT idempotency.retire_signing_secret(%s)", (old,)).fetchone()[0] is False


@pytest.mark.extension_only("pg_dump leaves out an extension's tables that are not configuration; "
                            "the plain script's signing_secrets are ordinary tables (docs/managed.md)")
def test_secret_is_invisible(cluster, secrets):
    db = secrets
    db.execute("ALTER SYSTEM SET log_statement = 'all'")
    db.execute("SELECT pg_reload_conf()")
    try:
        db.execute("SELECT idempotency.rotate_signing_secret()")
        signed = db.execute("SELECT idempotency.sign_key('k')").fetchone()[0]
        db.execute("SELECT idempotency.verify_key(%s)", (signed,))
        with pytest.raises(psycopg.Error):
            db.execute("SELECT idempotency.verify_key(%s)", (signed[:-2] + "AA",))
    finally:
        db.execute("ALTER SYSTEM RESET log_statement")
        db.execute("SELECT pg_reload_conf()")
    secret = db.execute("SELECT encode(secret, 'hex') FROM idempotency.signing_secrets").fetchone()[0]
    secret_b64 = db.execute("SELECT encode(secret, 'base64') FROM idempotency.signing_secrets").fetchone()[0]
    assert len(secret) == 64

    db.execute("DROP ROLE IF EXISTS peeker")
    db.execute("CREATE ROLE peeker LOGIN")
    db.execute("GRANT USAGE ON SCHEMA idempotency TO peeker")
    try:
        with psycopg.connect(cluster.conninfo().replace("user=postgres", "user=peeker"), autocommit=True) as p:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                p.execute("SELECT * FROM idempotency.signing_secrets")
            settings = " ".join(str(r) for r in p.execute("SELECT name, setting, reset_val, boot_val FROM pg_settings").fetchall())
            assert secret not in settings.lower()
            # The role can still sign and verify: through the functions.
            assert p.execute("SELECT idempotency.verify_key(%s)", (signed,)).fetchone()[0] == "k"
    finally:
        db.execute("REVOKE ALL ON SCHEMA idempotency FROM peeker")
        db.execute("DROP ROLE peeker")

    dump = subprocess.run(
        [f"{PG_BIN}/pg_dump", "-h", cluster.dir, "-p", str(cluster.port), "-U", "postgres", "--inserts",
         cluster.dbname],
        check=True, capture_output=True, text=True,
    ).stdout
    assert "idempotency" in dump
    assert secret not in dump.lower() and secret_b64 not in dump
    # (No row: the statement in rotate_signing_secret's body is in a pg_tle install's dump.)
    assert "INSERT INTO idempotency.signing_secrets VALUES" not in dump

    log = cluster.server_log()
    assert "rotate_signing_secret" in log  # log_statement = all was on
    assert secret not in log.lower() and secret_b64 not in log
    assert os.path.exists(cluster.log)
