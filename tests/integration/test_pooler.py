"""The SQL API behind PgBouncer (Debian's 1.18, tests/integration/pooler.py) in transaction mode,
where each transaction of a client may run on another server connection: both styles of the
quickstart, the answers to a concurrent duplicate (at once, or after claim_wait set per
transaction), leases, takeover and fencing, batches; what a session-level SET does there (the
reason settings are per transaction or per role); and bindings of clients that one service role
serves, switching roles per transaction. Both editions (scripts/test.sh runs this file on each)."""

import threading
import time

import psycopg
import pytest

from pooler import PgBouncer


@pytest.fixture(scope="module")
def bouncer(cluster):
    b = PgBouncer(cluster, "transaction", pool_size=4).start()
    yield b
    b.stop()


@pytest.fixture
def pooled(bouncer):
    """Opens autocommit client connections through the pooler; closed after the test."""
    opened = []

    def _open(user="postgres", autocommit=True):
        conn = psycopg.connect(bouncer.conninfo(user=user), autocommit=autocommit, prepare_threshold=None)
        opened.append(conn)
        return conn

    yield _open
    for conn in opened:
        conn.close()


def claim(conn, key, request=None, **kw):
    args = "".join(f", {k} => %({k})s" for k in kw)
    return conn.execute(f"SELECT outcome::text, token, response, recovery_point, "
                        f"extract(epoch FROM retry_after) FROM idempotency.claim(%(key)s, %(request)s::jsonb{args})",
                        dict(key=key, request=None if request is None else psycopg.types.json.Jsonb(request),
                             **kw)).fetchone()


def test_both_quickstart_styles_answer_as_direct(pooled, db):
    a, b = pooled(), pooled(autocommit=False)
    # One transaction: claim, the work, complete, commit; the retry replays.
    with b.transaction():
        assert claim(b, "qs-1", {"amount": 1000}, scope="client-7")[0] == "new"
        b.execute("SELECT idempotency.complete('qs-1', '{\"order_id\": 42}', 201, scope => 'client-7')")
    b.commit()
    replay = claim(a, "qs-1", {"amount": 1000}, scope="client-7")
    assert (replay[0], replay[2]) == ("replay", {"order_id": 42})
    assert claim(a, "qs-1", {"amount": 1}, scope="client-7")[0] == "mismatch"
    # Leased: claim and commit, complete in a later transaction (another server connection,
    # maybe) with the token.
    outcome, token, *_ = claim(a, "qs-2", lease="2 minutes")
    assert outcome == "new"
    b.execute("SELECT idempotency.checkpoint('qs-2', 'charged', token => %s)", (token,))
    b.commit()
    a.execute("SELECT idempotency.complete('qs-2', '{\"charge\": \"ch_1\"}', token => %s)", (token,))
    assert db.execute("SELECT status::text, response FROM idempotency.idempotency_keys WHERE key = 'qs-2'"
                      ).fetchone() == ("completed", {"charge": "ch_1"})
    assert claim(pooled(), "qs-2")[:3] == ("replay", token, {"charge": "ch_1"})


def test_a_duplicate_of_an_open_transaction_is_in_progress_at_once(pooled):
    holder, other = pooled(autocommit=False), pooled()
    assert claim(holder, "busy-1")[0] == "new"           # the transaction stays open
    started = time.monotonic()
    outcome, _, _, _, retry = claim(other, "busy-1")
    assert outcome == "in_progress" and retry == 1 and time.monotonic() - started < 1
    holder.rollback()
    assert claim(other, "busy-1")[0] == "new"            # the rollback released it


def test_claim_wait_set_for_the_transaction_waits_and_replays(pooled):
    holder, waiter = pooled(autocommit=False), pooled(autocommit=False)
    assert claim(holder, "wait-1", {"a": 1})[0] == "new"
    holder.execute("SELECT idempotency.complete('wait-1', '{\"ok\": true}')")
    threading.Timer(0.5, holder.commit).start()
    waiter.execute("SET LOCAL idempotency.claim_wait = '10s'")
    started = time.monotonic()
    answer = claim(waiter, "wait-1", {"a": 1})
    waited = time.monotonic() - started
    assert (answer[0], answer[2]) == ("replay", {"ok": True})
    waiter.commit()
    assert 0.3 < waited < 9
    assert claim(waiter, "wait-1", {"a": 1})[0] == "replay"
    waiter.commit()
    # SET LOCAL ended with its transaction: the server connection carries no wait to a next client.
    assert all(pooled().execute("SELECT current_setting('idempotency.claim_wait', true)").fetchone()[0]
               in (None, "", "0") for _ in range(4))


def test_a_lease_runs_out_and_the_takeover_fences_the_old_token(pooled, db):
    a, b = pooled(), pooled()
    outcome, first, *_ = claim(a, "lease-1", {"job": 1}, lease="1 second")
    assert outcome == "new"
    a.execute("SELECT idempotency.checkpoint('lease-1', 'step-2', token => %s)", (first,))
    assert claim(b, "lease-1", {"job": 1})[0] == "in_progress"
    time.sleep(1.1)
    outcome, second, _, point, _ = claim(b, "lease-1", {"job": 1})
    assert (outcome, point) == ("new", "step-2") and second > first
    with pytest.raises(psycopg.Error) as stale:
        a.execute("SELECT idempotency.complete('lease-1', '{}', token => %s)", (first,))
    assert stale.value.sqlstate == "IK003"
    assert a.execute("SELECT idempotency.release('lease-1', token => %s)", (first,)).fetchone() == (False,)
    b.execute("SELECT idempotency.complete('lease-1', '{\"done\": 2}', token => %s)", (second,))
    assert db.execute("SELECT token, response FROM idempotency.idempotency_keys WHERE key = 'lease-1'"
                      ).fetchone() == (second, {"done": 2})


def test_batches_claim_and_complete_across_server_connections(pooled):
    a, b = pooled(), pooled()
    rows = a.execute("SELECT key, outcome::text, token FROM idempotency.claim_many(ARRAY['b1', 'b2', 'b3']) "
                     "ORDER BY ord").fetchall()
    assert [r[1] for r in rows] == ["new"] * 3
    b.execute("SELECT idempotency.complete_many(ARRAY['b1', 'b2', 'b3'], ARRAY['{\"n\":1}', '{\"n\":2}', "
              "'{\"n\":3}']::jsonb[], tokens => %s)", ([r[2] for r in rows],)).fetchall()
    again = a.execute("SELECT outcome::text, response FROM idempotency.claim_many(ARRAY['b1', 'b2', 'b3']) "
                      "ORDER BY ord").fetchall()
    assert again == [("replay", {"n": 1}), ("replay", {"n": 2}), ("replay", {"n": 3})]


def test_a_session_set_stays_on_the_server_connection_for_the_next_client(bouncer, cluster):
    # Why the docs say per transaction or per role: one server connection (a pool of one),
    # a plain SET by one client is what the next client's calls run with.
    one = PgBouncer(cluster, "transaction", pool_size=1).start()
    try:
        with psycopg.connect(one.conninfo(), autocommit=True) as first:
            first.execute("SET idempotency.default_ttl = '2s'")
            first.execute("SET LOCAL idempotency.busy_retry_after = '7s'")  # no transaction: no effect
        with psycopg.connect(one.conninfo(), autocommit=True) as nxt:
            assert nxt.execute("SELECT current_setting('idempotency.default_ttl')").fetchone()[0] in ("2s", "2")
            with nxt.transaction():
                nxt.execute("SET LOCAL idempotency.default_ttl = '1h'")
            assert nxt.execute("SELECT current_setting('idempotency.default_ttl')").fetchone()[0] in ("2s", "2")
    finally:
        one.stop()


def test_the_pooler_refuses_startup_options(bouncer):
    # PgBouncer passes no startup option (PGOPTIONS, options=-c ...) to the server: it refuses
    # the connection instead. A setting a session needs from its start is set per role.
    with pytest.raises(psycopg.OperationalError, match="options"):
        psycopg.connect(bouncer.conninfo(), options="-c idempotency.claim_wait=1s", connect_timeout=5).close()


def test_clients_of_one_pooled_role_are_bound_by_the_role_they_switch_to(cluster, db):
    # PgBouncer logs every client in as one service role; each transaction switches to the
    # client's own role, as PostgREST and Supabase do (set_config('role', ..., true)).
    db.execute("DROP ROLE IF EXISTS pool_svc")
    db.execute("DROP ROLE IF EXISTS shop_a_role")
    db.execute("CREATE ROLE shop_a_role")
    db.execute("CREATE ROLE pool_svc LOGIN IN ROLE shop_a_role")
    db.execute("GRANT USAGE ON SCHEMA idempotency TO shop_a_role, pool_svc")
    db.execute("INSERT INTO idempotency.role_settings (role, scope_prefix) VALUES ('shop_a_role', 'shop_a:')")
    svc = PgBouncer(cluster, "transaction", pool_size=2, users=("postgres", "client_a"), force_user="pool_svc").start()
    try:
        with psycopg.connect(svc.conninfo(user="client_a"), autocommit=False) as conn:
            assert conn.execute("SELECT session_user").fetchone() == ("pool_svc",)
            conn.rollback()
            conn.execute("SELECT set_config('role', 'shop_a_role', true)")
            assert conn.execute("SELECT current_user").fetchone() == ("shop_a_role",)
            assert claim(conn, "x", scope="shop_a:1")[0] == "new"
            conn.rollback()
            conn.execute("SELECT set_config('role', 'shop_a_role', true)")
            with pytest.raises(psycopg.Error) as refused:
                claim(conn, "x", scope="shop_b:1")
            assert refused.value.sqlstate == "42501"
            conn.rollback()
        assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE scope LIKE 'shop_b:%'"
                          ).fetchone() == (0,)
    finally:
        svc.stop()
        db.execute("DELETE FROM idempotency.role_settings WHERE role = 'shop_a_role'::regrole")
        db.execute("DROP OWNED BY pool_svc, shop_a_role")
        db.execute("DROP ROLE pool_svc, shop_a_role")
