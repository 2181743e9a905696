"""The audit trail: with idempotency.audit on, every complete appends exactly one row in the
completing transaction; release, rollback and audit off write none; rows outlive their key and
are deleted only past idempotency.audit_retention."""

import psycopg
import pytest

from helpers import claim


@pytest.fixture
def audit(db):
    db.execute("DELETE FROM idempotency.audit")
    yield db
    db.execute("DELETE FROM idempotency.audit")


def rows(db):
    return db.execute(
        "SELECT scope, key, key_is_hash, request_hash IS NOT NULL, token, response_status, completed_by "
        "FROM idempotency.audit ORDER BY id"
    ).fetchall()


def test_one_row_per_completion_only_when_on(audit, connect):
    db = audit
    t1 = claim(db, "off", {"a": 1})[1]
    db.execute("SELECT idempotency.complete('off', '{}', token => %s)", (t1,))
    assert rows(db) == []  # off by default

    app = connect(autocommit=False)
    app.execute("SET LOCAL idempotency.audit = on")  # for this transaction only
    t2 = claim(app, "pay-1", {"amount": 5}, scope="shop")[1]
    app.execute("SELECT idempotency.complete('pay-1', '{\"ok\": 1}', 201, 'shop', %s)", (t2,))
    assert len(rows(db)) == 0  # not visible before commit
    app.commit()
    assert rows(db) == [("shop", "pay-1", False, True, t2, 201, "postgres")]
    # SET LOCAL ended with the transaction: the next completion is not audited.
    t3 = claim(app, "pay-2")[1]
    app.execute("SELECT idempotency.complete('pay-2', '{}', token => %s)", (t3,))
    app.commit()
    assert len(rows(db)) == 1


def test_never_on_release_rollback_or_failed_complete(audit, connect):
    db = audit
    db.execute("SET idempotency.audit = on")
    claim(db, "released")
    assert db.execute("SELECT idempotency.release('released')").fetchone()[0] is True
    tx = connect(autocommit=False)
    tx.execute("SET idempotency.audit = on")
    claim(tx, "rolled-back")
    tx.execute("SELECT idempotency.complete('rolled-back', '{}')")
    tx.rollback()
    for sql in ["SELECT idempotency.complete('never-claimed', '{}')",
                "SELECT idempotency.complete('released', '{}')"]:
        with pytest.raises(psycopg.Error):
            db.execute(sql)
    t = claim(db, "done")[1]
    db.execute("SELECT idempotency.complete('done', '{}', token => %s)", (t,))
    with pytest.raises(psycopg.Error) as e:  # a second completion is refused: no second row
        db.execute("SELECT idempotency.complete('done', '{}', token => %s)", (t,))
    assert e.value.sqlstate == "IK002"
    assert [r[1] for r in rows(db)] == ["done"]


@pytest.mark.native_only("the background worker deletes audit rows past idempotency.audit_retention; "
                         "in the portable edition a scheduled idempotency.sweep_audit() does")
def test_rows_outlive_the_key_and_follow_retention(cluster, audit):
    db = audit
    db.execute("SET idempotency.audit = on")
    for i in range(5):
        t = claim(db, f"k{i}", ttl="1 second", lease="1 second")[1]
        db.execute("SELECT idempotency.complete(%s, '{}', token => %s, ttl => '00:00:00.01')", (f"k{i}", t))
    db.execute("SELECT pg_sleep(0.05)")
    assert db.execute("SELECT idempotency.sweep()").fetchone()[0] == 5
    assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 0
    assert len(rows(db)) == 5  # the key sweeper never touches the audit trail
    assert db.execute("SELECT idempotency.forget('k0')").fetchone()[0] is False
    # Retention 0 (the default) keeps rows; past a retention they are deleted in batches.
    assert db.execute("SELECT idempotency.sweep_audit()").fetchone()[0] == 0
    db.execute("UPDATE idempotency.audit SET completed_at = now() - interval '3 days' WHERE key IN ('k0', 'k1', 'k2')")
    db.execute("ALTER SYSTEM SET idempotency.audit_retention = '2d'")
    db.execute("SELECT pg_reload_conf()")
    try:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as fresh:
            assert fresh.execute("SHOW idempotency.audit_retention").fetchone()[0] == "2d"
            assert fresh.execute("SELECT idempotency.sweep_audit(2)").fetchone()[0] == 3
        assert sorted(r[1] for r in rows(db)) == ["k3", "k4"]
    finally:
        db.execute("ALTER SYSTEM RESET idempotency.audit_retention")
        db.execute("SELECT pg_reload_conf()")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="batch_size"):
        db.execute("SELECT idempotency.sweep_audit(0)")
