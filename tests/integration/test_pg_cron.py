"""The recipe of docs/operations.md for sweeping without the background sweeper: a cluster that
preloads pg_cron but not idempotency schedules `SELECT idempotency.sweep()`, and expired keys vanish
while live ones stay. pg_cron 1.5+ runs the job every 5 seconds; Debian 12's 1.4 schedules at
minute granularity, so there the test waits up to a minute and a half."""

import time

import psycopg
import pytest

from cluster import Cluster

pytestmark = pytest.mark.slow  # waits for pg_cron's next minute


@pytest.fixture(scope="module")
def cron_cluster():
    c = Cluster(settings={
        "shared_preload_libraries": "'pg_cron'",       # not idempotency: no background sweeper
        "cron.database_name": "'idem'",
        "cron.use_background_workers": "on",           # or cron.host: pg_cron then connects via libpq
        "max_worker_processes": "16",
    })
    c.start()
    try:
        yield c
    finally:
        c.destroy()


def test_pg_cron_sweeps_expired_keys(cron_cluster):
    notices = []
    with psycopg.connect(cron_cluster.conninfo(), autocommit=True) as db:
        db.add_notice_handler(lambda d: notices.append(d.message_primary))
        db.execute("CREATE EXTENSION idempotency")
        db.execute("CREATE EXTENSION pg_cron")
        assert any("sweep" in n for n in notices), notices   # CREATE EXTENSION says no sweeper runs
        version = db.execute("SELECT extversion FROM pg_extension WHERE extname = 'pg_cron'").fetchone()[0]
        major, minor = (int(x) for x in version.split("-")[0].split(".")[:2])
        seconds = (major, minor) >= (1, 5)
        schedule = "5 seconds" if seconds else "* * * * *"

        db.execute("SELECT count(*) FROM generate_series(1, 300) i, "
                   "idempotency.claim('old-' || i, ttl => '1 second', lease => '1 second')")
        db.execute("SELECT idempotency.complete('old-' || i, '{}') FROM generate_series(1, 100) i")
        db.execute("SELECT count(*) FROM generate_series(1, 5) i, idempotency.claim('live-' || i)")
        time.sleep(1.2)
        assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE expires_at <= now()").fetchone()[0] == 300

        # The recipe from docs/operations.md, "Without preloading: pg_cron".
        job = db.execute("SELECT idempotency.schedule_sweep(%s)",
                         ("5 seconds" if seconds else "1 minute",)).fetchone()[0]
        assert db.execute("SELECT schedule FROM cron.job WHERE jobid = %s", (job,)).fetchone() == (schedule,)

        deadline = time.time() + (30 if seconds else 100)
        while db.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key LIKE 'old-%%'").fetchone()[0]:
            assert time.time() < deadline, "pg_cron did not sweep the expired keys"
            time.sleep(1)
        assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 5
        runs = db.execute("SELECT status, command FROM cron.job_run_details").fetchall()
        assert ("succeeded", "SELECT idempotency.sweep()") in runs, runs
        db.execute("SELECT cron.unschedule(%s)", (job,))


def cron_version(db):
    version = db.execute("SELECT extversion FROM pg_extension WHERE extname = 'pg_cron'").fetchone()[0]
    return tuple(int(x) for x in version.split("-")[0].split(".")[:2])


def test_schedule_sweep_creates_one_job_and_replaces_it(cron_cluster):
    with psycopg.connect(cron_cluster.conninfo(), autocommit=True) as db:
        db.execute("CREATE EXTENSION IF NOT EXISTS idempotency")
        db.execute("CREATE EXTENSION IF NOT EXISTS pg_cron")
        user = db.execute("SELECT current_user").fetchone()[0]

        def jobs():
            return db.execute("SELECT jobid, schedule, command, database, username FROM cron.job "
                              "WHERE jobname = 'idempotency-sweep' ORDER BY jobid").fetchall()

        try:
            first = db.execute("SELECT idempotency.schedule_sweep()").fetchone()[0]
            assert jobs() == [(first, "* * * * *", "SELECT idempotency.sweep()", "idem", user)]
            for every, schedule in [("5 minutes", "*/5 * * * *"), ("2 hours", "0 */2 * * *"),
                                    ("1 day", "0 0 * * *"), ("1 hour", "0 * * * *"),
                                    ("00:20:00", "*/20 * * * *")]:
                assert db.execute("SELECT idempotency.schedule_sweep(%s)", (every,)).fetchone()[0] == first
                assert jobs() == [(first, schedule, "SELECT idempotency.sweep()", "idem", user)], every
            if cron_version(db) >= (1, 5):
                db.execute("SELECT idempotency.schedule_sweep('30 seconds')")
                assert jobs()[0][1] == "30 seconds"
            else:
                with pytest.raises(psycopg.errors.FeatureNotSupported, match="schedules by the minute"):
                    db.execute("SELECT idempotency.schedule_sweep('30 seconds')")
            kept = jobs()
            for every in ["7 minutes", "90 seconds", "0", "-1 minute", "1.5 seconds", "5 hours", "2 days",
                          "1 mon", None]:
                with pytest.raises(psycopg.errors.InvalidParameterValue, match=r"invalid every .*schedule_sweep"):
                    db.execute("SELECT idempotency.schedule_sweep(%s::interval)", (every,))
                assert jobs() == kept, every  # nothing changed
        finally:
            db.execute("SELECT cron.unschedule(jobid) FROM cron.job WHERE jobname = 'idempotency-sweep'")


def test_schedule_sweep_without_pg_cron_here_says_what_to_run(cron_cluster):
    """In a database pg_cron does not run from, the hint gives the call to make where it does; on
    a server without pg_cron, what to do instead."""
    with psycopg.connect(cron_cluster.conninfo(), autocommit=True) as db:
        db.execute("DROP DATABASE IF EXISTS other")
        db.execute("CREATE DATABASE other")
    try:
        with psycopg.connect(cron_cluster.conninfo() + " dbname=other", autocommit=True) as other:
            other.execute("CREATE EXTENSION idempotency")
            with pytest.raises(psycopg.errors.FeatureNotSupported) as err:
                other.execute("SELECT idempotency.schedule_sweep('10 minutes')")
            assert "not installed in database other" in err.value.diag.message_primary
            assert err.value.diag.message_hint == (
                "pg_cron runs jobs from database idem (cron.database_name); there, run SELECT "
                "cron.schedule_in_database('idempotency-sweep-other', '*/10 * * * *', "
                "'SELECT idempotency.sweep()', 'other')")
    finally:
        with psycopg.connect(cron_cluster.conninfo(), autocommit=True) as db:
            db.execute("DROP DATABASE other")


def test_schedule_sweep_without_pg_cron_is_0a000(connect):
    db = connect()
    with pytest.raises(psycopg.errors.FeatureNotSupported) as err:
        db.execute("SELECT idempotency.schedule_sweep()")
    assert "needs pg_cron" in err.value.diag.message_primary
    assert "CREATE EXTENSION pg_cron" in err.value.diag.message_hint
