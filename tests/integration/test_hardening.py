"""The holes an outside review found in 0.2.0, each tried the way an attacker or a
careless caller would: a tenant's startup options against its scope prefix and audit, with and
without preloading; sweeps and counters across tenants; calendar arithmetic in TTLs and
leases; the answer to a busy key; signatures and hashes of keys; derived keys; messages and
size limits. Each test fails on 0.2.0."""

import os

import psycopg
import pytest
from psycopg.types.json import Jsonb

from cluster import Cluster
from helpers import claim


@pytest.fixture(scope="module", params=["late", "preloaded"])
def tenant_cluster(request):
    """A cluster with the extension, loaded per session ("late") or preloaded, and roles:
    shop_a and shop_b with scope prefixes set by the superuser (b's per database, a's per
    role), app without one, monitor granted the stats view."""
    settings = {"shared_preload_libraries": "'idempotency'", "idempotency.sweep_interval": "'1h'"} \
        if request.param == "preloaded" else {}
    c = Cluster(settings=settings).start()
    with psycopg.connect(c.conninfo(), autocommit=True) as su:
        su.execute("CREATE EXTENSION idempotency")
        for role in ("shop_a", "shop_b", "app", "monitor", "auditor"):
            su.execute(f"CREATE ROLE {role} LOGIN")
            su.execute(f"GRANT USAGE ON SCHEMA idempotency TO {role}")
        su.execute("ALTER ROLE shop_a SET idempotency.scope_prefix = 'shop_a:'")
        su.execute("ALTER ROLE shop_b IN DATABASE idem SET idempotency.scope_prefix = 'shop_b:'")
        su.execute("GRANT SELECT ON idempotency.stats TO monitor")
        su.execute("ALTER ROLE auditor SET idempotency.audit = on")
    c.mode = request.param
    yield c
    c.destroy()


def login(cluster, role, options=None, env=None):
    info = cluster.conninfo().replace("user=postgres", f"user={role}")
    if options:
        info += f" options='{options}'"
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return psycopg.connect(info, autocommit=True)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def su(tenant_cluster):
    with psycopg.connect(tenant_cluster.conninfo(), autocommit=True) as conn:
        conn.execute("DELETE FROM idempotency.idempotency_keys")
        conn.execute("DELETE FROM idempotency.audit")
        yield conn


def shop_a_order(tenant_cluster, su):
    """shop_a's completed order-77, checked to be stored as expected."""
    with login(tenant_cluster, "shop_a") as a:
        assert a.execute("SHOW idempotency.scope_prefix").fetchone()[0] == "shop_a:"
        assert claim(a, "order-77", {"n": 1}, scope="shop_a:orders")[0] == "new"
        a.execute("SELECT idempotency.complete('order-77', '{\"card\": \"4242\"}', scope => 'shop_a:orders')")
    row = su.execute("SELECT status::text, response FROM idempotency.idempotency_keys "
                     "WHERE scope = 'shop_a:orders' AND key = 'order-77'").fetchone()
    assert row == ("completed", {"card": "4242"})
    return row


ATTACKS = [
    "SELECT idempotency.claim('order-77', '{\"n\": 1}', 'shop_a:orders')",
    "SELECT idempotency.lookup('order-77', 'shop_a:orders')",
    "SELECT idempotency.forget('order-77', 'shop_a:orders')",
    "SELECT idempotency.complete('order-77', '{}', scope => 'shop_a:orders')",
    "SELECT idempotency.release('order-77', 'shop_a:orders')",
    "SELECT idempotency._stored_key('order-77', 'shop_a:orders')",
]


@pytest.mark.native_only("the library refuses a prefix set by a startup option; "
                         "the portable edition binds tenants by idempotency.role_settings (test_binding_settings.py)")
@pytest.mark.parametrize("how", ["options", "PGOPTIONS"])
@pytest.mark.parametrize("value", ["x", "", "shop_a:"])
def test_a_startup_option_cannot_lift_the_prefix(tenant_cluster, su, how, value):
    """0.2.0: shop_b connecting with PGOPTIONS='-c idempotency.scope_prefix=x' got one WARNING,
    then replay of shop_a's stored response (the placeholder was refused, the default '' left)."""
    before = shop_a_order(tenant_cluster, su)
    opt = f"-c idempotency.scope_prefix={value}"
    try:
        b = login(tenant_cluster, "shop_b", **({"options": opt} if how == "options" else {"env": {"PGOPTIONS": opt}}))
    except psycopg.OperationalError as e:
        # Preloaded, the server refuses a non-superuser's startup option outright.
        assert tenant_cluster.mode == "preloaded" and "permission denied" in str(e)
        return
    with b:
        assert tenant_cluster.mode == "late"
        for sql in ATTACKS:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                b.execute(sql)
        # Not even its own scopes: the prefix in force is not the one the superuser set.
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as e:
            b.execute("SELECT idempotency.claim('k', NULL, 'shop_b:1')")
        assert "scope_prefix" in str(e.value)
    after = su.execute("SELECT status::text, response FROM idempotency.idempotency_keys "
                       "WHERE scope = 'shop_a:orders' AND key = 'order-77'").fetchone()
    assert after == before


def test_the_role_keeps_its_prefix_without_startup_options(tenant_cluster, su):
    shop_a_order(tenant_cluster, su)
    with login(tenant_cluster, "shop_b") as b:
        assert claim(b, "k", scope="shop_b:1")[0] == "new"
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            b.execute(ATTACKS[0])
        # A superuser may still set any prefix for a session.
    with login(tenant_cluster, "postgres", options="-c idempotency.scope_prefix=shop_a:") as p:
        assert claim(p, "order-77", {"n": 1}, scope="shop_a:orders")[0] == "replay"


def test_a_role_cannot_reset_its_own_prefix_in_the_catalog(tenant_cluster, su):
    """Before the library is loaded in its session the setting is a placeholder: the role's own
    ALTER ROLE ... SET must not replace the superuser's value either."""
    with login(tenant_cluster, "shop_a") as a:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            a.execute("ALTER ROLE shop_a SET idempotency.scope_prefix = ''")
    with login(tenant_cluster, "shop_a") as a:
        assert a.execute("SHOW idempotency.scope_prefix").fetchone()[0] == "shop_a:"
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            a.execute("SELECT idempotency.lookup('k', 'shop_b:1')")


def audit_rows(su):
    return su.execute("SELECT key, completed_by FROM idempotency.audit ORDER BY id").fetchall()


@pytest.mark.parametrize("how", ["SET", "options", "PGOPTIONS", "set_config"])
def test_a_superusers_audit_on_is_binding(tenant_cluster, su, how):
    """0.2.0: a role told ALTER ROLE ... SET idempotency.audit = on ran SET ... = off and
    completed unaudited."""
    kw = {}
    if how == "options":
        kw = {"options": "-c idempotency.audit=off"}
    elif how == "PGOPTIONS":
        kw = {"env": {"PGOPTIONS": "-c idempotency.audit=off"}}
    with login(tenant_cluster, "auditor", **kw) as conn:
        if how == "SET":
            conn.execute("SET idempotency.audit = off")
        elif how == "set_config":
            conn.execute("SELECT set_config('idempotency.audit', 'off', false)")
        assert conn.execute("SHOW idempotency.audit").fetchone()[0] in ("off", "on")
        assert claim(conn, f"audited-{how}")[0] == "new"
        conn.execute("SELECT idempotency.complete(%s, '{}')", (f"audited-{how}",))
    assert audit_rows(su) == [(f"audited-{how}", "auditor")]


def test_audit_off_is_the_roles_choice_without_a_superusers_on(tenant_cluster, su):
    with login(tenant_cluster, "app") as conn:
        conn.execute("SET idempotency.audit = off")
        assert claim(conn, "unaudited")[0] == "new"
        conn.execute("SELECT idempotency.complete('unaudited', '{}')")
        conn.execute("SET idempotency.audit = on")
        assert claim(conn, "audited")[0] == "new"
        conn.execute("SELECT idempotency.complete('audited', '{}')")
    assert audit_rows(su) == [("audited", "app")]


@pytest.mark.native_only("the role's own ALTER ROLE SET of the audit setting is what the library lets it do; "
                         "without the library PostgreSQL refuses it (a placeholder a superuser set)")
def test_a_roles_own_setting_cannot_undo_a_database_wide_audit(tenant_cluster, su):
    su.execute("ALTER DATABASE idem SET idempotency.audit = on")
    try:
        with login(tenant_cluster, "app") as conn:
            # Allowed once the setting is defined in the session (it is not superuser-only);
            # before that PostgreSQL refuses a non-superuser's setting of a placeholder.
            conn.execute("SELECT idempotency.derive_key('load', 'library')")
            conn.execute("ALTER ROLE app SET idempotency.audit = off")
        with login(tenant_cluster, "app") as conn:
            assert conn.execute("SELECT setting FROM pg_settings WHERE name = 'idempotency.audit'").fetchone() in (None, ("off",))
            assert claim(conn, "db-wide")[0] == "new"
            conn.execute("SELECT idempotency.complete('db-wide', '{}')")
        assert audit_rows(su) == [("db-wide", "app")]
    finally:
        su.execute("ALTER DATABASE idem RESET idempotency.audit")
        su.execute("ALTER ROLE app RESET idempotency.audit")


def expire(su, scope, key):
    su.execute("SELECT idempotency.claim(%s, NULL, %s)", (key, scope))
    su.execute("UPDATE idempotency.idempotency_keys SET created_at = now() - ttl - interval '1 second', "
               "expires_at = now() - interval '1 second', "
               "locked_until = now() - interval '1 second' WHERE scope = %s AND key = %s", (scope, key))


def test_a_tenants_sweep_touches_only_its_own_rows(tenant_cluster, su):
    """0.2.0: any granted role's sweep() deleted every tenant's expired rows and, inside an open
    transaction, held their row locks (their re-claim answered in_progress)."""
    expire(su, "shop_a:1", "old-a")
    expire(su, "shop_b:1", "old-b")
    assert su.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE expires_at <= now()").fetchone()[0] == 2
    with login(tenant_cluster, "shop_a") as a, login(tenant_cluster, "shop_b") as b:
        a.autocommit = False
        assert a.execute("SELECT idempotency.sweep()").fetchone()[0] == 1
        # shop_a's transaction is still open: shop_b's expired key is neither gone nor locked.
        assert claim(b, "old-b", scope="shop_b:1")[0] == "new"
        a.commit()
    assert su.execute("SELECT scope, key FROM idempotency.idempotency_keys ORDER BY 1").fetchall() == [("shop_b:1", "old-b")]


def test_sweeping_the_whole_store_is_for_the_owner(tenant_cluster, su):
    expire(su, "x", "old")
    with login(tenant_cluster, "app") as app:
        for f in ("sweep", "sweep_audit"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as e:
                app.execute(f"SELECT idempotency.{f}()")
            assert "owner" in str(e.value)
    assert su.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 1
    assert su.execute("SELECT idempotency.sweep()").fetchone()[0] == 1


@pytest.mark.native_only("the counters live in the library's shared memory (NULL in the portable edition)")
def test_database_wide_counters_are_for_the_stats_readers(tenant_cluster, su):
    for role in ("shop_a", "app"):
        with login(tenant_cluster, role) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT * FROM idempotency._shared_stats()")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT * FROM idempotency.stats")
    with login(tenant_cluster, "monitor") as m:
        row = m.execute("SELECT sweeper_enabled, claims_new IS NOT NULL FROM idempotency.stats").fetchone()
        assert row == (tenant_cluster.mode == "preloaded",) * 2


def test_a_key_signed_for_one_tenant_does_not_verify_for_another(tenant_cluster, su):
    """0.2.0: a key signed for tenant B verified for tenant A."""
    if su.execute("SELECT count(*) FROM idempotency.signing_secrets").fetchone()[0] == 0:
        su.execute("SELECT idempotency.rotate_signing_secret()")
    with login(tenant_cluster, "shop_b") as b, login(tenant_cluster, "shop_a") as a:
        signed = b.execute("SELECT idempotency.sign_key('checkout-1')").fetchone()[0]
        assert b.execute("SELECT idempotency.verify_key(%s)", (signed,)).fetchone()[0] == "checkout-1"
        with pytest.raises(psycopg.Error) as e:
            a.execute("SELECT idempotency.verify_key(%s)", (signed,))
        assert e.value.sqlstate == "IK004"
    with pytest.raises(psycopg.Error) as e:  # nor for a role without a prefix
        su.execute("SELECT idempotency.verify_key(%s)", (signed,))
    assert e.value.sqlstate == "IK004"


def test_an_overlong_signed_key_is_refused_from_its_length(db):
    with pytest.raises(psycopg.Error) as e:
        db.execute("SELECT idempotency.verify_key(repeat('k', 100 * 1024 * 1024) || '.1.' || repeat('A', 43))")
    assert e.value.sqlstate == "IK004" and "longer than any signed key" in str(e.value)


# TTL and lease -------------------------------------------------------------------------------

@pytest.mark.parametrize("ttl, message", [
    # Positive counted in 30-day months (-360 + 361 days), before now on the calendar.
    ("-12 months +361 days", "ttl must end in the future"),
    ("-1 year +362 days", "ttl must end in the future"),
    # 3660 days counted in 30-day months, over ten calendar years.
    ("122 months", "ttl must be at most 10 years"),
])
def test_ttls_are_checked_on_the_calendar(db, ttl, message):
    """0.2.0 validated with 30-day months but stored with calendar arithmetic: such a TTL gave an
    expires_at already past (two `new` back to back)."""
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        db.execute("SELECT idempotency.claim('cal', ttl => %s::interval)", (ttl,))
    assert message in str(e.value)
    assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 0
    assert claim(db, "cal", ttl="1 hour")[0] == "new"
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        db.execute("SELECT idempotency.complete('cal', '{}', ttl => %s::interval)", (ttl,))
    assert message in str(e.value)
    assert db.execute("SELECT status::text FROM idempotency.idempotency_keys").fetchone()[0] == "in_progress"


def test_no_lease_given_means_at_most_the_ttl(db):
    """0.2.0: claim(key, ttl => '1 second') failed "lease must not be longer than ttl"."""
    assert claim(db, "short", ttl="1 second")[0] == "new"
    row = db.execute("SELECT locked_until = expires_at, expires_at - created_at FROM idempotency.idempotency_keys").fetchone()
    assert row[0] is True and row[1].total_seconds() == 1
    db.execute("SET idempotency.default_lease = '1min'")
    assert claim(db, "long", ttl="1 hour")[0] == "new"
    row = db.execute("SELECT locked_until - created_at FROM idempotency.idempotency_keys WHERE key = 'long'").fetchone()
    assert row[0].total_seconds() == 60


@pytest.mark.parametrize("args, names", [
    ({"ttl": "1 hour", "lease": "2 hours"}, ['lease ("02:00:00")', 'ttl ("01:00:00")']),
    ({"lease": "25 hours"}, ["lease", "idempotency.default_ttl"]),
])
def test_a_lease_longer_than_the_ttl_names_what_set_each(db, args, names):
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        claim(db, "k", **args)
    for n in names:
        assert n in str(e.value)


def test_a_busy_key_answers_a_short_retry_after(connect):
    """0.2.0: a duplicate meeting another transaction's uncommitted claim got the whole lease
    (299 s for a transaction that commits 2 s later)."""
    holder, other = connect(autocommit=False), connect()
    assert claim(holder, "busy", lease="5 minutes")[0] == "new"
    outcome, _, _, _, retry_after, _ = claim(other, "busy")
    assert (outcome, retry_after.total_seconds()) == ("in_progress", 1.0)
    other.execute("SET idempotency.busy_retry_after = '250ms'")
    assert claim(other, "busy")[4].total_seconds() == 0.25
    holder.commit()
    # Committed, the lease is what to wait for.
    assert claim(other, "busy")[4].total_seconds() > 290


# Derived keys, messages, limits --------------------------------------------------------------

def test_derived_keys_are_injective_and_keep_their_0_2_0_form(db):
    """0.2.0: derive_key('order-1','charge','{"amount":5}') = derive_key('order-1:charge',
    '7e84cbf0f7a7c92c')."""
    with_params = db.execute("SELECT idempotency.derive_key('order-1', 'charge', '{\"amount\": 5}')").fetchone()[0]
    assert with_params == "order-1:charge:7e84cbf0f7a7c92c"  # what 0.2.0 derived: work in flight finds it
    with pytest.raises(psycopg.errors.InvalidParameterValue) as e:
        db.execute("SELECT idempotency.derive_key('order-1:charge', '7e84cbf0f7a7c92c')")
    assert "step" in str(e.value)
    assert db.execute("SELECT idempotency.derive_key('order-1', 'charge')").fetchone()[0] == "order-1:charge"


def test_a_token_never_issued_is_not_called_a_takeover(db):
    """0.2.0 said "another worker took the key over" for any wrong token."""
    token = claim(db, "tok", lease="1 minute")[1]
    with pytest.raises(psycopg.Error) as e:
        db.execute("SELECT idempotency.complete('tok', '{}', token => %s)", (token + 1000,))
    assert e.value.sqlstate == "IK003" and "never issued" in str(e.value)
    assert "took the key over" not in str(e.value.diag.message_hint)
    with pytest.raises(psycopg.Error) as e:
        db.execute("SELECT idempotency.complete('tok', '{}', token => %s)", (token - 1,))
    assert e.value.sqlstate == "IK003" and "stale" in str(e.value)


def test_a_mismatch_returns_the_keys_expiry(db):
    assert claim(db, "m", {"a": 1})[0] == "new"
    stored = db.execute("SELECT expires_at FROM idempotency.idempotency_keys").fetchone()[0]
    row = db.execute("SELECT outcome::text, expires_at FROM idempotency.claim('m', '{\"a\": 2}')").fetchone()
    assert row == ("mismatch", stored)


def test_range_errors_spell_the_number_canonically(db):
    """0.2.0 reported 1e309 as "10e308"."""
    with pytest.raises(psycopg.errors.NumericValueOutOfRange) as e:
        db.execute("SELECT idempotency.canonical_json('1e309', 'rfc8785')")
    assert "number 1e+309 is outside" in str(e.value)


def test_responses_and_recovery_points_have_size_limits(db):
    """0.2.0 stored a 300 MB recovery point."""
    token = claim(db, "big", lease="1 minute")[1]
    with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
        db.execute("SELECT idempotency.checkpoint('big', repeat('x', 65 * 1024), token => %s)", (token,))
    assert "recovery_point" in str(e.value) and "idempotency.max_recovery_point_size" in str(e.value)
    with pytest.raises(psycopg.errors.ProgramLimitExceeded) as e:
        db.execute("SELECT idempotency.complete('big', jsonb_build_object('s', repeat('x', 5 * 1024 * 1024)), token => %s)", (token,))
    assert "response" in str(e.value) and "idempotency.max_response_size" in str(e.value)
    assert db.execute("SELECT status::text, recovery_point FROM idempotency.idempotency_keys").fetchone() == ("in_progress", None)
    # Within the limits both are stored.
    db.execute("SELECT idempotency.checkpoint('big', repeat('x', 1000), token => %s)", (token,))
    db.execute("SELECT idempotency.complete('big', jsonb_build_object('s', repeat('x', 1000)), token => %s)", (token,))
    assert db.execute("SELECT status::text FROM idempotency.idempotency_keys").fetchone()[0] == "completed"


def test_hashed_keys_are_keyed_not_plain_sha256(db):
    """0.2.0's set_key_storage('sha256') kept the plain SHA-256: alice@example.com reversible
    with a dictionary."""
    import hashlib
    try:
        db.execute("SELECT idempotency.set_key_storage('sha256')")
        assert claim(db, "alice@example.com", {"a": 1})[0] == "new"
        stored = db.execute("SELECT key FROM idempotency.idempotency_keys").fetchone()[0]
        assert len(stored) == 64 and stored != hashlib.sha256(b"alice@example.com").hexdigest()
        secret = db.execute("SELECT key_secret FROM idempotency.config").fetchone()[0]
        assert len(secret) == 32
        import hmac
        assert stored == hmac.new(secret, hashlib.sha256(b"alice@example.com").digest(), "sha256").hexdigest()
        db.execute("SELECT idempotency.complete('alice@example.com', '{\"ok\": 1}')")
        assert claim(db, "alice@example.com", {"a": 1})[:3][0] == "replay"
    finally:
        db.execute("DELETE FROM idempotency.idempotency_keys")
        db.execute("SELECT idempotency.set_key_storage('plain')")


def test_no_rust_backtrace_reaches_the_client(connect, cluster):
    """An ERROR raised inside a server call (here a statement timeout while claim waits) must
    not carry a Rust backtrace in its DETAIL, even with RUST_BACKTRACE set for the server."""
    holder, waiter = connect(autocommit=False), connect()
    assert claim(holder, "bt")[0] == "new"
    waiter.execute("SET idempotency.claim_wait = '10s'")
    waiter.execute("SET statement_timeout = '200ms'")
    with pytest.raises(psycopg.errors.QueryCanceled) as e:
        claim(waiter, "bt")
    detail = e.value.diag.message_detail or ""
    assert "backtrace" not in detail.lower() and "rust_begin_unwind" not in detail and "at /" not in detail, detail
    holder.rollback()
