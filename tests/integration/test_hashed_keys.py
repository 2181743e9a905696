"""Keys stored hashed (idempotency.set_key_storage('sha256')): callers change nothing, the store,
its indexes and the server log never hold a plain key, and switching is tested both ways."""

import hashlib
import hmac
import os
import threading
import time
import uuid

import psycopg
import pytest

from cluster import EDITION, Cluster
from helpers import claim


@pytest.fixture
def hashed_cluster():
    c = Cluster(settings={"log_min_messages": "warning"}, dbname="hashed").start()
    with psycopg.connect(c.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION idempotency")
        conn.execute("CREATE EXTENSION pageinspect")
    yield c
    c.destroy()


def stored_form(conn, key):
    """How the store keeps `key`: the hex HMAC-SHA256 of its SHA-256 under the store's secret
    (a plain SHA-256 would be reversible with a dictionary)."""
    secret = conn.execute("SELECT key_secret FROM idempotency.config").fetchone()[0]
    assert secret is not None and len(secret) == 32
    digest = hashlib.sha256(key.encode()).digest()
    keyed = hmac.new(secret, digest, "sha256").hexdigest()
    assert keyed != digest.hex()
    return keyed


def relation_bytes(conn, cluster):
    """The bytes on disk of the store, its indexes and the audit table (after a checkpoint)."""
    conn.execute("CHECKPOINT")
    paths = conn.execute(
        "SELECT pg_relation_filepath(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'idempotency' AND c.relkind IN ('r', 'i') AND pg_relation_filepath(c.oid) IS NOT NULL"
    ).fetchall()
    data = b""
    for (p,) in paths:
        full = os.path.join(cluster.data, p)
        if os.path.exists(full):
            with open(full, "rb") as f:
                data += f.read()
    return data


def test_hashed_end_to_end(hashed_cluster):
    c = hashed_cluster
    key = f"jane.doe@example.com:{uuid.uuid4()}"
    with psycopg.connect(c.conninfo(), autocommit=True) as db:
        assert db.execute("SELECT idempotency.set_key_storage('sha256')").fetchone()[0] == 0
        first = claim(db, key, {"amount": 100}, scope="shop")
        assert first[0] == "new"
        db.execute("SELECT idempotency.checkpoint(%s, 'charged', 'shop', %s)", (key, first[1]))
        db.execute("SET idempotency.audit = on")
        db.execute("SELECT idempotency.complete(%s, '{\"ok\": true}', 201, 'shop', %s)", (key, first[1]))
        replay = claim(db, key, {"amount": 100}, scope="shop")
        assert replay[:4] == ("replay", first[1], {"ok": True}, 201)
        assert claim(db, key, {"amount": 999}, scope="shop")[0] == "mismatch"  # logs a WARNING
        with pytest.raises(psycopg.Error) as e:  # IK002 names the key as (hashed), nothing of its hash
            db.execute("SELECT idempotency.complete(%s, '{}', scope => 'shop')", (key,))
        assert e.value.sqlstate == "IK002"
        assert key not in str(e.value) and stored_form(db, key)[:8] not in str(e.value)
        assert "key (hashed)" in str(e.value)
        # lookup gives the key as the caller gave it, not its stored form.
        row = db.execute("SELECT * FROM idempotency.lookup(%s, 'shop')", (key,)).fetchone()
        assert row[1] == key
        stored = db.execute("SELECT scope, key FROM idempotency.idempotency_keys").fetchall()
        assert stored == [("shop", stored_form(db, key))]
        assert db.execute("SELECT key, key_is_hash FROM idempotency.audit").fetchall() == [(stored_form(db, key), True)]
        # The index entries (as pageinspect shows them) and the files on disk hold no plain key.
        items = db.execute(
            "SELECT string_agg(data, ' ') FROM bt_page_items('idempotency.idempotency_keys_pkey', 1)"
        ).fetchone()[0]
        assert key.encode().hex() not in items.replace(" ", "")
        assert stored_form(db, key).encode().hex() in items.replace(" ", "")
        disk = relation_bytes(db, c)
        assert key.encode() not in disk and stored_form(db, key).encode() in disk
        # Derived keys of a hashed key are hashed in turn.
        child = db.execute("SELECT idempotency.derive_key(%s, 'charge')", (key,)).fetchone()[0]
        assert claim(db, child, scope="shop")[0] == "new"
        assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key = %s",
                          (stored_form(db, child),)).fetchone()[0] == 1
        assert db.execute("SELECT idempotency.forget(%s, 'shop')", (key,)).fetchone()[0] is True
        assert claim(db, key, {"amount": 100}, scope="shop")[0] == "new"
        hashed = stored_form(db, key)
    log = c.server_log()
    assert "key reused with a different request" in log
    assert "key=(hashed)" in log and hashed[:8] not in log
    assert key not in log and "jane.doe" not in log


def test_switch_migrates_plain_keys_and_refuses_to_go_back(hashed_cluster):
    c = hashed_cluster
    with psycopg.connect(c.conninfo(), autocommit=True) as db:
        db.execute("SET idempotency.audit = on")
        for i in range(50):
            claim(db, f"k{i}", {"i": i}, scope="s")
            if i % 2 == 0:
                db.execute("SELECT idempotency.complete(%s, %s, scope => 's')", (f"k{i}", f'{{"i": {i}}}'))
        assert db.execute("SELECT idempotency.set_key_storage('sha256')").fetchone()[0] == 50
        assert db.execute("SELECT idempotency.set_key_storage('sha256')").fetchone()[0] == 0  # no-op
        keys = {k for (k,) in db.execute("SELECT key FROM idempotency.idempotency_keys").fetchall()}
        assert keys == {stored_form(db, f"k{i}") for i in range(50)}
        assert db.execute("SELECT bool_and(key_is_hash), count(*) FROM idempotency.audit").fetchone() == (True, 25)
        # Callers change nothing: the same plain keys find their rows.
        for i in range(50):
            outcome = claim(db, f"k{i}", {"i": i}, scope="s")
            assert outcome[0] == ("replay" if i % 2 == 0 else "in_progress"), (i, outcome)
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="50 live keys"):
            db.execute("SELECT idempotency.set_key_storage('plain')")
        assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 50
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="mode must be"):
            db.execute("SELECT idempotency.set_key_storage('md5')")
        with pytest.raises(psycopg.errors.NullValueNotAllowed, match="mode must not be NULL"):
            db.execute("SELECT idempotency.set_key_storage(NULL)")
        for i in range(50):
            db.execute("SELECT idempotency.forget(%s, 's')", (f"k{i}",))
        assert db.execute("SELECT idempotency.set_key_storage('plain')").fetchone()[0] == 0
        claim(db, "plain-again", scope="s")
        assert db.execute("SELECT key FROM idempotency.idempotency_keys").fetchall() == [("plain-again",)]


def test_switch_waits_for_open_claims_and_other_sessions_follow(hashed_cluster):
    c = hashed_cluster
    with psycopg.connect(c.conninfo()) as a, psycopg.connect(c.conninfo(), autocommit=True) as b, \
            psycopg.connect(c.conninfo(), autocommit=True) as other:
        assert claim(other, "warm-up")[0] == "new"  # this session has cached the plain mode
        assert claim(a, "open")[0] == "new"  # uncommitted
        done = []
        t = threading.Thread(target=lambda: done.append(
            b.execute("SELECT idempotency.set_key_storage('sha256')").fetchone()[0]))
        t.start()
        time.sleep(0.5)
        assert not done  # waits for the open claim's transaction
        a.commit()
        t.join(10)
        assert done == [2]
        # The session that had cached "plain" now claims with hashed keys.
        assert claim(other, "open")[0] == "in_progress"
        assert claim(other, "fresh")[0] == "new"
        keys = {k for (k,) in other.execute("SELECT key FROM idempotency.idempotency_keys").fetchall()}
        assert keys == {stored_form(other, "warm-up"), stored_form(other, "open"), stored_form(other, "fresh")}


def test_a_lock_number_computed_from_the_key_does_not_hold_a_hashed_key(hashed_cluster):
    """The portable edition marks a key with an advisory lock on a hash of its scope and stored
    key. Stored plain, any role can compute that number and hold it (a claim of the key then
    answers in_progress); stored hashed, the number comes from the keyed hash, which a role
    without the store's secret cannot compute: holding the number of the plain key changes
    nothing, in either edition."""
    c = hashed_cluster
    with psycopg.connect(c.conninfo(), autocommit=True) as db, \
            psycopg.connect(c.conninfo(), autocommit=True) as other:
        # Stored plain, the number held elsewhere is the key's (the formula below is right).
        other.execute("SELECT pg_advisory_lock(hashtextextended('4:shoporder-41', 5432))")
        assert claim(db, "order-41", scope="shop")[0] == ("in_progress" if EDITION == "portable" else "new")
        other.execute("SELECT pg_advisory_unlock_all()")
        db.execute("SELECT idempotency.forget('order-41', 'shop')")
        db.execute("SELECT idempotency.set_key_storage('sha256')")
        done = claim(db, "order-42", scope="shop")
        db.execute("SELECT idempotency.complete('order-42', '{\"ok\": 1}', scope => 'shop', token => %s)", (done[1],))
        for key in ("order-42", "order-43"):  # the lock numbers of the plain keys
            other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 5432))", (f"4:shop{key}",))
        assert other.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
                             ).fetchone()[0] == 2
        assert claim(db, "order-42", scope="shop")[0] == "replay"
        assert claim(db, "order-43", scope="shop")[0] == "new"
