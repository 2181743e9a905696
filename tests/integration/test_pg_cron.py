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
        db.execute("SELECT cron.schedule('idempotency-sweep', %s, 'SELECT idempotency.sweep()')", (schedule,))

        deadline = time.time() + (30 if seconds else 100)
        while db.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key LIKE 'old-%%'").fetchone()[0]:
            assert time.time() < deadline, "pg_cron did not sweep the expired keys"
            time.sleep(1)
        assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 5
        runs = db.execute("SELECT status, command FROM cron.job_run_details").fetchall()
        assert ("succeeded", "SELECT idempotency.sweep()") in runs, runs
        db.execute("SELECT cron.unschedule('idempotency-sweep')")
