"""pg_upgrade of a cluster with the extension and live keys to a newer major version: afterwards
every key behaves as before (replay, mismatch, in progress with its recovery point and then
completed with its token, takeover with a larger token, expiry) and the background sweeper runs.

Needs both servers with the extension installed: scripts/test.sh sets PG_UPGRADE_FROM and
PG_UPGRADE_TO (bin directories), 16 to the newest version tested (it says why not from
Debian's 15); otherwise skipped."""

import glob
import os
import subprocess
import time

import psycopg
import pytest

from cluster import Cluster, _as_postgres
from helpers import claim

FROM = os.environ.get("PG_UPGRADE_FROM")
TO = os.environ.get("PG_UPGRADE_TO")
pytestmark = [
    pytest.mark.slow,  # two servers, pg_upgrade
    pytest.mark.skipif(not (FROM and TO), reason="PG_UPGRADE_FROM and PG_UPGRADE_TO not set"),
]

SETTINGS = {"shared_preload_libraries": "'idempotency'", "idempotency.sweep_interval": "'1s'"}


def version(bin_dir):
    out = subprocess.run([f"{bin_dir}/pg_config", "--version"], check=True, capture_output=True, text=True).stdout
    return int(out.split()[1].split(".")[0])


def test_keys_and_sweeper_survive_pg_upgrade():
    old = Cluster(settings=SETTINGS, bin=FROM).start()
    new = Cluster(settings=SETTINGS, bin=TO)
    try:
        with psycopg.connect(old.conninfo(), autocommit=True) as db:
            db.execute("CREATE EXTENSION idempotency")
            done = claim(db, "done", {"a": 1}, scope="s")
            db.execute("SELECT idempotency.complete('done', '{\"order\": 7}', 201, 's', %s)", (done[1],))
            leased = claim(db, "leased", {"b": 2}, scope="s", lease="1 hour")
            db.execute("SELECT idempotency.checkpoint('leased', 'charged', 's', %s)", (leased[1],))
            short = claim(db, "short-lease", scope="s", ttl="1 hour", lease="2 seconds")
            claim(db, "expiring", scope="s", ttl="3 seconds", lease="1 second")
            rows = db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0]
            assert rows == 4
            # A binding row (its role column is a regrole: pg_upgrade keeps role OIDs).
            db.execute("CREATE ROLE tenant LOGIN")
            db.execute("GRANT USAGE ON SCHEMA idempotency TO tenant")
            db.execute("INSERT INTO idempotency.role_settings (role, scope_prefix) VALUES ('tenant', 'tenant:')")
            assert db.execute("SHOW server_version_num").fetchone()[0].startswith(str(version(FROM)))
        old.stop()

        # The new cluster: same encoding and locale; no data checksums (18 turns them on by
        # default, and pg_upgrade needs both sides alike).
        new.initdb(*(["--no-data-checksums"] if version(TO) >= 18 else []))
        with open(os.path.join(new.data, "postgresql.auto.conf"), "a") as f:
            for k, v in new.settings.items():
                f.write(f"{k} = {v}\n")
        # pg_upgrade writes its logs into the working directory and the new data directory.
        up = _as_postgres(f"{TO}/pg_upgrade", "-b", FROM, "-B", TO, "-d", old.data, "-D", new.data,
                          "-p", str(old.port), "-P", str(new.port), "--no-sync", cwd=new.dir,
                          check=False, capture_output=True, text=True)
        if up.returncode != 0:
            logs = ""
            for path in glob.glob(os.path.join(new.data, "pg_upgrade_output.d", "*", "log", "*.log")):
                with open(path, errors="replace") as f:
                    text = f.read()
                if "ERROR" in text or "FATAL" in text:
                    logs += f"\n--- {path}\n" + text[-3000:]
            raise AssertionError(up.stdout[-1500:] + logs)
        new.pg_ctl("start", "-w", "-l", new.log)

        with psycopg.connect(new.conninfo(), autocommit=True) as db:
            assert db.execute("SHOW server_version_num").fetchone()[0].startswith(str(version(TO)))
            assert db.execute("SELECT extversion FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0]
            assert claim(db, "done", {"a": 1}, scope="s")[:4] == ("replay", done[1], {"order": 7}, 201)
            assert claim(db, "done", {"a": 9}, scope="s")[0] == "mismatch"
            r = claim(db, "leased", {"b": 2}, scope="s")
            assert r[0] == "in_progress" and r[5] == "charged"
            time.sleep(2.1)
            taken = claim(db, "short-lease", scope="s")
            assert taken[0] == "new" and taken[1] > short[1]
            assert claim(db, "fresh", scope="s")[1] > taken[1]  # the token sequence carried on
            db.execute("SELECT idempotency.complete('leased', '{\"ok\": 1}', scope => 's', token => %s)", (leased[1],))
            assert claim(db, "leased", {"b": 2}, scope="s")[2] == {"ok": 1}
            assert db.execute("SELECT role::text, scope_prefix FROM idempotency.role_settings").fetchall() \
                == [("tenant", "tenant:")]
            with psycopg.connect(new.conninfo().replace("user=postgres", "user=tenant"), autocommit=True) as t:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    t.execute("SELECT idempotency.claim('k', NULL, 's')")
                assert claim(t, "k", scope="tenant:1")[0] == "new"
            # 'expiring' counts as absent once its TTL is over, and the sweeper deletes it.
            deadline = time.time() + 30
            while time.time() < deadline:
                gone = db.execute("SELECT count(*) = 0 FROM idempotency.idempotency_keys WHERE key = 'expiring'").fetchone()[0]
                if gone:
                    break
                time.sleep(0.5)
            assert gone, "the sweeper did not delete the expired key"
            # Swept by the upgraded cluster's sweeper, which counted it: no sweeper ran in the
            # servers pg_upgrade started (binary-upgrade mode), where 'expiring' had expired.
            assert db.execute("SELECT rows_swept FROM idempotency.stats").fetchone()[0] == 1
            assert db.execute("SELECT sweeper_enabled FROM idempotency.stats").fetchone()[0] is True
    finally:
        new.destroy()
        old.destroy()
