#!/usr/bin/env python3
"""Citus against one node (docs/scaling.md): the same pgbench scripts (bench/sql/citus/, keys
spread over 1,000 scopes) against the coordinator of a Citus cluster (a coordinator and two
workers on this machine, tests/integration/citus_cluster.py) and against a single PostgreSQL
node, each with the extension. Prints a Markdown table of transactions per second and the ratio.

    PG_BIN=<bin of a server with Citus> python3 bench/citus.py [--seconds 10] [--clients 1,8]

e.g., with the server scripts/citus.sh 18 builds Citus into, on an idle machine:

    cargo pgrx install --release --pg-config /var/cache/idempotency/pg/18/bin/pg_config
    PG_BIN=/var/cache/idempotency/pg/18/bin python3 bench/citus.py --seconds 30 --clients 1,4,8

(`--seconds 1 --clients 1` checks that it runs.) One machine runs all nodes, so the figures show
the cost of the extra hop and of the SQL path, not Citus's scaling. A third column runs the same
scripts on the single node with the SQL-only path the store takes on Citus (a store of one hash
partition, `idempotency.partitions = 1`: no probe, no direct writes, plus partition routing).

- one_tx: claim + complete in one explicit transaction (on Citus: run on the coordinator, each
  statement routed to the shard's worker);
- leased: claim, then complete, each autocommitted (on Citus: each delegated to the worker);
- replay: claim of a completed key (on Citus: delegated).
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
from cluster import PG_BIN, Cluster  # noqa: E402
from citus_cluster import CitusCluster, citus_missing  # noqa: E402

import psycopg  # noqa: E402

SCRIPTS = ["one_tx", "leased", "replay"]
SQL_ONLY_DB = "sql_only"


def setup(conn):
    conn.execute("SELECT idempotency.claim('r', '{\"amount\": 100, \"currency\": \"EUR\"}', 't' || s) "
                 "FROM generate_series(1, 1000) AS s")
    conn.execute("SELECT idempotency.complete('r', '{\"ok\": true}', 200, 't' || s) "
                 "FROM generate_series(1, 1000) AS s")


def pgbench(node, script, clients, seconds, dbname=None):
    out = subprocess.run(
        [f"{PG_BIN}/pgbench", "-h", node.dir, "-p", str(node.port), "-U", "postgres", "-n",
         "-c", str(clients), "-j", str(min(clients, 4)), "-T", str(seconds), "-M", "simple",
         "-f", os.path.join(HERE, "sql", "citus", f"{script}.sql"), dbname or node.dbname],
        capture_output=True, text=True, env=dict(os.environ, PGOPTIONS="-c client_min_messages=error"))
    if out.returncode != 0:
        raise RuntimeError(f"pgbench {script}: {out.stdout}\n{out.stderr}")
    return next(float(line.split()[2]) for line in out.stdout.splitlines() if line.startswith("tps ="))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--clients", default="1,8")
    args = ap.parse_args()
    missing = citus_missing()
    if missing:
        sys.exit(missing)
    clients = [int(c) for c in args.clients.split(",")]
    single = Cluster(settings={"shared_preload_libraries": "'idempotency'"}).start()
    citus = None
    try:
        with psycopg.connect(single.conninfo(), autocommit=True) as c:
            c.execute("CREATE EXTENSION idempotency")
            setup(c)
            c.execute(f"CREATE DATABASE {SQL_ONLY_DB}")
        # The same node's SQL-only path (no probe, no direct writes), as on Citus: a store of one
        # hash partition, whose parent holds no rows (docs/scaling.md).
        with psycopg.connect(single.conninfo().replace(f"dbname={single.dbname}", f"dbname={SQL_ONLY_DB}"),
                             autocommit=True) as c:
            c.execute("SET idempotency.partitions = 1")
            c.execute("CREATE EXTENSION idempotency")
            setup(c)
        citus = CitusCluster().start()
        with citus.connect() as c:
            c.execute("SELECT idempotency.distribute()")
            setup(c)
        print("| script | clients | one node (tps) | one node, SQL path (tps) | Citus coordinator (tps) "
              "| SQL path / direct | Citus / one node |")
        print("|---|---|---|---|---|---|---|")
        for script in SCRIPTS:
            for n in clients:
                a = pgbench(single, script, n, args.seconds)
                q = pgbench(single, script, n, args.seconds, SQL_ONLY_DB)
                b = pgbench(citus.coordinator, script, n, args.seconds)
                print(f"| {script} | {n} | {a:.0f} | {q:.0f} | {b:.0f} | {q / a:.2f} | {b / a:.2f} |", flush=True)
    finally:
        single.destroy()
        if citus:
            citus.destroy()


if __name__ == "__main__":
    main()
