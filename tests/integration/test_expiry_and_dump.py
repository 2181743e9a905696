"""Expiry in real time (checked on read, whether or not anything swept), sweeping, and
pg_dump keeping the store."""

import subprocess
import time

import psycopg

from cluster import PG_BIN
from helpers import claim


def test_expired_key_is_new_without_any_sweep(db):
    assert claim(db, "ttl-1", {"a": 1}, ttl="1 second", lease="1 second")[0] == "new"
    db.execute("SELECT idempotency.complete('ttl-1', '{\"v\": 1}')")
    assert claim(db, "ttl-1", {"a": 1})[0] == "replay"
    time.sleep(1.2)
    assert db.execute("SELECT idempotency.lookup('ttl-1') IS NULL").fetchone()[0]
    r = claim(db, "ttl-1", {"a": 2})  # a different request: not a mismatch any more
    assert r[0] == "new" and r[2] is None, r


def test_sweep_removes_only_expired_rows(db):
    db.execute("SELECT idempotency.claim('short-' || i, ttl => '1 second', lease => '1 second') FROM generate_series(1, 300) i")
    db.execute("SELECT idempotency.claim('long-' || i) FROM generate_series(1, 50) i")
    time.sleep(1.2)
    assert db.execute("SELECT idempotency.sweep(100)").fetchone()[0] == 300
    assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 50


def test_pg_dump_keeps_keys_and_tokens(cluster, db):
    r = claim(db, "dumped", {"a": 1})
    db.execute("SELECT idempotency.complete('dumped', '{\"kept\": true}', 201)")
    conn = ["-h", cluster.dir, "-p", str(cluster.port), "-U", "postgres"]
    dump = subprocess.run([f"{PG_BIN}/pg_dump", *conn, "-Fc", cluster.dbname], check=True, capture_output=True).stdout
    subprocess.run([f"{PG_BIN}/createdb", *conn, "restored"], check=True)
    subprocess.run([f"{PG_BIN}/pg_restore", *conn, "-d", "restored"], input=dump, check=True)
    with psycopg.connect(f"host={cluster.dir} port={cluster.port} user=postgres dbname=restored", autocommit=True) as other:
        again = claim(other, "dumped", {"a": 1})
        assert again[0] == "replay" and again[2] == {"kept": True} and again[3] == 201, again
        fresh = claim(other, "after-restore")
        assert fresh[1] > r[1], "the token sequence was restored too"
    subprocess.run([f"{PG_BIN}/dropdb", *conn, "restored"], check=True)


def test_cached_plans_survive_reinstalling_the_extension_in_one_session(cluster, db):
    db.execute("DROP DATABASE IF EXISTS reinstall")
    db.execute("CREATE DATABASE reinstall")
    with psycopg.connect(cluster.conninfo().replace("dbname=idem", "dbname=reinstall"), autocommit=True) as c:
        c.execute("CREATE EXTENSION idempotency")
        assert claim(c, "k")[0] == "new"
        assert c.execute("SELECT idempotency.sweep()").fetchone()[0] == 0
        c.execute("DROP EXTENSION idempotency")
        c.execute("CREATE EXTENSION idempotency")
        assert claim(c, "k")[0] == "new"
        assert claim(c, "k")[0] == "in_progress"
        assert c.execute("SELECT idempotency.sweep()").fetchone()[0] == 0
    db.execute("DROP DATABASE reinstall")


def test_takeover_with_the_sequence_set_back_never_hands_out_its_token_again(db):
    """A token sequence behind a key's token (set back by hand, or restored from an older dump;
    on Citus: another node's sequence): the takeover's token is above the key's and the
    sequence is moved past it, so a later claim of the key (after forget) never gets the
    taken-over holder's token, whose late complete is refused (IK003). Before, the takeover
    wrote old + 1, a value the sequence then handed out again."""
    db.execute("SELECT setval('idempotency.token_seq', GREATEST(last_value, 100)) FROM idempotency.token_seq")
    first = claim(db, "set-back", {"a": 1}, ttl="1 hour", lease="1 second")
    assert first[0] == "new"
    db.execute("SELECT setval('idempotency.token_seq', %s)", (first[1] - 5,))
    time.sleep(1.2)
    taken = claim(db, "set-back", {"a": 1}, lease="1 minute")
    assert taken[0] == "new" and taken[1] > first[1], (first, taken)
    later = []
    for _ in range(8):
        assert db.execute("SELECT idempotency.forget('set-back')").fetchone()[0] is True
        r = claim(db, "set-back", {"a": 2}, lease="1 minute")
        assert r[0] == "new"
        later.append(r[1])
    assert taken[1] not in later, (taken, later)
    try:
        db.execute("SELECT idempotency.complete('set-back', '{\"stale\": true}', token => %s)", (taken[1],))
    except psycopg.Error as e:
        assert e.sqlstate == "IK003", e
    else:
        raise AssertionError(f"the taken-over holder's token {taken[1]} completed the claim of {later[-1]}")
