"""Expiry in real time (checked on read, whether or not anything swept), sweeping, and
pg_dump keeping the store."""

import subprocess
import threading
import time

import psycopg
import pytest

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


BIGINT_MAX = 9223372036854775807
HIGHEST_MOVED_PAST = BIGINT_MAX // 2  # half the token sequence's maximum


def write_row(conn, key, token, state):
    """Writes a row of the store as a restored dump (or a hand-written INSERT) would: an expired
    claim, or a live one whose lease ran out (a takeover), with the token given. Returns the
    token read back."""
    if state == "expired":
        times = "now() - interval '2 hours', now() - interval '90 minutes', now() - interval '1 hour'"
    else:
        times = "now() - interval '1 minute', now() - interval '1 second', now() + interval '59 minutes'"
    conn.execute(
        "INSERT INTO idempotency.idempotency_keys "
        "(scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl) "
        f"VALUES ('', %s, NULL, 'in_progress', %s, {times}, interval '1 hour')",
        (key, token),
    )
    return conn.execute("SELECT token FROM idempotency.idempotency_keys WHERE scope = '' AND key = %s",
                        (key,)).fetchone()[0]


def last_token(conn):
    return conn.execute("SELECT last_value FROM idempotency.token_seq").fetchone()[0]


@pytest.mark.parametrize("state", ["expired", "lease_over"])
@pytest.mark.parametrize("token", [BIGINT_MAX, BIGINT_MAX - 1, BIGINT_MAX - 1000, HIGHEST_MOVED_PAST + 1])
def test_a_key_whose_token_leaves_no_room_above_it_is_refused_and_other_keys_still_claim(db, token, state):
    """A row whose token is in the upper half of the token sequence's range (restored from a
    crafted dump, or written by hand): its restart or takeover is refused with 22003, naming the
    key and its token, and the sequence is not moved, so every other key still claims. Before,
    the claim set the sequence past the token (bigint's maximum for the first), and every later
    claim of any key failed with 2200H. Forgetting the key makes it claimable again."""
    claim(db, "before-poisoned")  # the sequence has handed out a value: last_value is one of them
    assert write_row(db, "poisoned", token, state) == token
    before = last_token(db)
    try:
        claim(db, "poisoned", {"a": 1})
    except psycopg.Error as e:
        assert e.sqlstate == "22003", e
        assert '"poisoned"' in e.diag.message_primary and str(token) in e.diag.message_primary, e.diag.message_primary
        assert "idempotency.forget" in e.diag.message_hint, e.diag.message_hint
    else:
        raise AssertionError(f"the claim of a key with token {token} was not refused")
    try:
        db.execute("SELECT * FROM idempotency.claim_many(ARRAY['poisoned'])").fetchall()
    except psycopg.Error as e:
        assert e.sqlstate == "22003", e
    else:
        raise AssertionError(f"claim_many of a key with token {token} was not refused")
    after = last_token(db)
    assert after < HIGHEST_MOVED_PAST and after - before <= 4, (before, after)
    other = claim(db, "other-key")
    assert other[0] == "new" and before < other[1] < HIGHEST_MOVED_PAST, other
    assert db.execute("SELECT token FROM idempotency.idempotency_keys WHERE key = 'poisoned'").fetchone()[0] == token
    # True for the live row, false for the expired one (counts as absent), deleted either way.
    assert db.execute("SELECT idempotency.forget('poisoned')").fetchone()[0] is (state == "lease_over")
    again = claim(db, "poisoned", {"a": 1})
    assert again[0] == "new" and again[1] > other[1], again


@pytest.mark.parametrize("token", [0, -1, -BIGINT_MAX - 1])
def test_a_key_whose_token_is_zero_or_negative_is_claimed_with_a_token_from_the_sequence(db, token):
    """Tokens from the sequence start at 1; a row with a token of zero or below (written by
    hand) is restarted with the sequence's next value, above it, and the sequence is not set
    back."""
    claim(db, "before-low")
    assert write_row(db, "low", token, "expired") == token
    before = last_token(db)
    r = claim(db, "low", {"a": 1})
    assert r[0] == "new" and before < r[1] <= before + 2, (before, r)
    assert claim(db, "after-low")[1] > r[1]


def test_a_restored_row_with_a_token_at_bigints_maximum_is_refused_and_the_restored_store_claims(cluster, db):
    """pg_dump keeps such a row as it is, and restore loads it (a constraint refusing it would
    fail the whole table's restore); in the restored database its claim is refused (22003) and
    every other key claims, as in the original."""
    claim(db, "restored-before")
    assert write_row(db, "restored-poisoned", BIGINT_MAX, "expired") == BIGINT_MAX
    conn = ["-h", cluster.dir, "-p", str(cluster.port), "-U", "postgres"]
    dump = subprocess.run([f"{PG_BIN}/pg_dump", *conn, "-Fc", cluster.dbname], check=True, capture_output=True).stdout
    subprocess.run([f"{PG_BIN}/createdb", *conn, "restored-max"], check=True)
    try:
        subprocess.run([f"{PG_BIN}/pg_restore", *conn, "-d", "restored-max"], input=dump, check=True)
        with psycopg.connect(f"host={cluster.dir} port={cluster.port} user=postgres dbname=restored-max",
                             autocommit=True) as other:
            assert other.execute("SELECT token FROM idempotency.idempotency_keys WHERE key = 'restored-poisoned'"
                                 ).fetchone()[0] == BIGINT_MAX
            try:
                claim(other, "restored-poisoned")
            except psycopg.Error as e:
                assert e.sqlstate == "22003", e
            else:
                raise AssertionError("the restored row's claim was not refused")
            assert last_token(other) < HIGHEST_MOVED_PAST
            fresh = [claim(other, f"after-restore-{i}") for i in range(3)]
            assert all(r[0] == "new" for r in fresh), fresh
    finally:
        subprocess.run([f"{PG_BIN}/dropdb", *conn, "restored-max"], check=True)


def _expired(db, *keys):
    """Claims and completes each key with a 1 s TTL, then waits until all have expired."""
    for k in keys:
        assert claim(db, k, {"a": 1}, ttl="1 second", lease="1 second")[0] == "new"
        db.execute("SELECT idempotency.complete(%s, '{\"v\": 1}')", (k,))
    time.sleep(1.2)  # the TTL running out is the subject
    expired = db.execute("SELECT count(*) FROM idempotency.idempotency_keys "
                         "WHERE key = ANY(%s) AND expires_at <= now()", (list(keys),)).fetchone()[0]
    assert expired == len(keys)


def _claim_in_thread(connect, key, request, setting=None):
    """Starts a claim in a session of its own; returns (thread, result list)."""
    out = []

    def run():
        with connect() as c:
            if setting:
                c.execute(setting)
            t0 = time.monotonic()
            out.append((claim(c, key, request), time.monotonic() - t0))

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_an_expired_key_a_sweep_is_deleting_is_new_once_the_sweep_ends(db, connect):
    """An expired key counts as absent whatever a sweep is doing: a claim that meets the sweep's
    transaction holding the key waits for it (not answering in_progress) and is new."""
    _expired(db, "swept-1")
    with connect() as sweeper:
        sweeper.execute("BEGIN")
        assert sweeper.execute("SELECT idempotency.sweep()").fetchone()[0] == 1
        t, out = _claim_in_thread(connect, "swept-1", {"a": 2})
        t.join(0.3)
        assert t.is_alive() and not out, out  # waiting for the sweep, not answered
        sweeper.execute("COMMIT")
        t.join(10)
    (outcome, token, *_), _ = out[0]
    assert outcome == "new" and token is not None, out
    assert db.execute("SELECT status::text FROM idempotency.idempotency_keys WHERE key = 'swept-1'").fetchone() == ("in_progress",)


def test_a_claim_waits_for_a_sweep_at_most_busy_retry_after(db, connect):
    """A sweep in a transaction that outlasts busy_retry_after: the claim answers in_progress
    with that retry, and the key is new once the sweep has ended."""
    _expired(db, "swept-2")
    with connect() as sweeper:
        sweeper.execute("BEGIN")
        assert sweeper.execute("SELECT idempotency.sweep()").fetchone()[0] == 1
        t, out = _claim_in_thread(connect, "swept-2", {"a": 2}, "SET idempotency.busy_retry_after = 200")
        t.join(10)
        (outcome, _, _, _, retry_after, *_), took = out[0]
        assert outcome == "in_progress" and retry_after.total_seconds() == 0.2, out
        assert took >= 0.19, took
        sweeper.execute("COMMIT")
    assert claim(db, "swept-2", {"a": 2})[0] == "new"


def test_an_expired_key_another_claimer_is_restarting_is_in_progress_at_once(db, connect):
    """Only a sweep is waited for: an expired key that another open transaction has claimed
    anew answers in_progress without waiting."""
    _expired(db, "restarted")
    with connect() as holder:
        holder.execute("BEGIN")
        assert claim(holder, "restarted", {"a": 2})[0] == "new"
        t, out = _claim_in_thread(connect, "restarted", {"a": 2}, "SET idempotency.busy_retry_after = 5000")
        t.join(10)
        (outcome, *_), took = out[0]
        assert outcome == "in_progress" and took < 2.5, out
        holder.execute("ROLLBACK")
