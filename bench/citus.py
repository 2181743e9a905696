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

`--bare` runs only the Citus cluster and compares the store's styles with the bare statements
an application would run without the extension, on a distributed table of the store's shape
(`bench.bare`, distributed by scope, the same 1,000 scopes): `one_tx` against `bare_one_tx`
(BEGIN, INSERT ... ON CONFLICT DO NOTHING, UPDATE, END) and `leased` against `bare_leased` (the
INSERT and the UPDATE, each autocommitted), cell by cell in that order; then `one_tx` again with
`claim` and `complete` distributed with `force_delegation` (docs/scaling.md); then the cost of
delegation itself: the bare INSERT and UPDATE each in a PL/pgSQL function distributed as
`claim` and `complete` are (`bench.ins`, `bench.upd`, no extension involved:
`delegated_leased`) against `bare_leased`, the ceiling of any delegated call:

    PG_BIN=... python3 bench/citus.py --bare --seconds 5 --repeat 3 --clients 4,8

(`--repeat` rounds per cell, 3 by default with `--bare`, 1 without; the store's and the bare
script's runs alternating, the order reversed every other round; tps are medians, a ratio the
median of the rounds' ratios with their min-max, and the store's styles are judged against the
target of 0.90 by bench/spread.py's rule: yes, no, or not shown when the spread crosses it).
"""

import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
from cluster import PG_BIN, Cluster  # noqa: E402
from citus_cluster import CitusCluster, citus_missing  # noqa: E402

import psycopg  # noqa: E402

import spread  # noqa: E402

SCRIPTS = ["one_tx", "leased", "replay"]
SQL_ONLY_DB = "sql_only"
TARGET = 0.90  # the store's styles against the bare statements, on the cluster
# The load average of the whole run, sampled before and after each run.
LOAD = spread.LoadLog()


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
    ap.add_argument("--bare", action="store_true",
                    help="the store's styles against the bare statements, on the cluster only")
    ap.add_argument("--repeat", type=int,
                    help="rounds per cell, alternating, the median reported with the min-max "
                         "(default 3 with --bare, 1 without)")
    ap.add_argument("--out", help="with --bare: also write the report to bench/OUT.md")
    args = ap.parse_args()
    missing = citus_missing()
    if missing:
        sys.exit(missing)
    clients = [int(c) for c in args.clients.split(",")]
    if args.repeat is None:
        args.repeat = 3 if args.bare else 1
    if args.bare:
        return bare(clients, args.seconds, args.repeat, args.out)
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
        if args.repeat < 2:
            print("One round per cell: the ratios have no spread (--repeat N for N alternating rounds).")
        print("| script | clients | one node (tps) | one node, SQL path (tps) | Citus coordinator (tps) "
              "| SQL path / direct, median (min-max) | Citus / one node, median (min-max) |")
        print("|---|---|---|---|---|---|---|")
        for script in SCRIPTS:
            for n in clients:
                a, q, b, _ = rounds(args.repeat, [
                    lambda: pgbench(single, script, n, args.seconds),
                    lambda: pgbench(single, script, n, args.seconds, SQL_ONLY_DB),
                    lambda: pgbench(citus.coordinator, script, n, args.seconds)])
                print(f"| {script} | {n} | {statistics.median(a):.0f} | {statistics.median(q):.0f} | "
                      f"{statistics.median(b):.0f} | {spread.Ratio.of(q, a).cell()} | {spread.Ratio.of(b, a).cell()} |",
                      flush=True)
    finally:
        single.destroy()
        if citus:
            citus.destroy()


FORCED = ["idempotency.claim(text,jsonb,text,interval,interval)",
          "idempotency.complete(text,jsonb,integer,text,bigint,interval)"]

BARE_TABLE = """CREATE TABLE bench.bare (LIKE idempotency.idempotency_keys INCLUDING DEFAULTS
    INCLUDING CONSTRAINTS INCLUDING INDEXES) WITH (fillfactor = 25)"""

# The bare statements of bare_leased.sql, each in a PL/pgSQL function that Citus delegates to
# the scope's worker (as it delegates claim and complete): what a delegated call costs.
DELEGATED = ["""CREATE FUNCTION bench.ins(s text, k text, t bigint) RETURNS bigint LANGUAGE plpgsql AS $fn$
BEGIN
    INSERT INTO bench.bare (scope, key, request_hash, status, token, locked_until, expires_at, ttl)
    VALUES (s, k, sha256('{"amount":100,"currency":"EUR"}'), 'in_progress', t,
            now() + interval '5 minutes', now() + interval '24 hours', interval '24 hours')
    ON CONFLICT (scope, key) DO NOTHING;
    RETURN t;
END $fn$""", """CREATE FUNCTION bench.upd(s text, k text) RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    UPDATE bench.bare SET status = 'completed', response = '{"ok": true}', response_status = 200,
           completed_at = now(), locked_until = NULL, expires_at = now() + interval '24 hours'
     WHERE scope = s AND key = k;
END $fn$""", "SELECT create_distributed_function('bench.ins(text,text,bigint)', 's', colocate_with => 'bench.bare')",
             "SELECT create_distributed_function('bench.upd(text,text)', 's', colocate_with => 'bench.bare')"]


def rounds(repeat, runs):
    """Each of `runs` (functions returning tps) once per round, the order reversed every other
    round (on a busy machine the load changes from one run to the next, and a ratio is taken
    round by round): [tps per round] for each run, then the load average samples around them."""
    out = [[] for _ in runs]
    load = []
    for r in range(repeat):
        order = list(range(len(runs))) if r % 2 == 0 else list(reversed(range(len(runs))))
        for i in order:
            out[i].append(LOAD.around(runs[i], load))
    return out + [load]


def pair(node, ext, raw, n, seconds, repeat):
    """The store's `ext` against the bare `raw`, `repeat` alternating rounds: (tps of ext per
    round, tps of raw per round, spread.Ratio of ext over raw round by round)."""
    a, b, load = rounds(repeat, [lambda: pgbench(node, ext, n, seconds), lambda: pgbench(node, raw, n, seconds)])
    return a, b, spread.Ratio.of(a, b, load)


def pair_row(label, n, a, b, r, target=True):
    """A row: tps medians, the ratio with its spread, and (for the store's styles) the target
    judged, with the load during the cell's runs."""
    met = spread.met_cell(spread.judge(r, "≥", TARGET)) if target else ""
    goal = f"≥ {TARGET:.2f}" if target else ""
    return (f"| {label} | {n} | {statistics.median(a):.0f} | {statistics.median(b):.0f} | {r.cell()} | {goal} | "
            f"{met} | {spread.load_cell(r.load)} |")


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def bare(clients, seconds, repeat, out=None):
    """The store on the cluster against the bare INSERT + UPDATE on a distributed table of its
    shape (see the module's docstring)."""
    lines = []

    def emit(line):
        print(line, flush=True)
        lines.append(line)
    started = uptime()
    citus = CitusCluster().start()
    try:
        with citus.connect() as c:
            c.execute("SELECT idempotency.distribute()")
            setup(c)
            c.execute("CREATE SCHEMA bench")
            c.execute(BARE_TABLE)
            c.execute("SELECT create_distributed_table('bench.bare', 'scope', "
                      "colocate_with => 'idempotency.idempotency_keys')")
        emit("| style | clients | extension (tps) | bare statements (tps) | extension / bare, median (min-max) "
             "| target | met | load average, mean (min-max) |")
        emit("|---|---|---|---|---|---|---|---|")
        for n in clients:
            for ext, raw in (("one_tx", "bare_one_tx"), ("leased", "bare_leased")):
                emit(pair_row(ext, n, *pair(citus.coordinator, ext, raw, n, seconds, repeat)))
        # The one-transaction style with claim and complete force-delegated (docs/scaling.md):
        # the calls themselves run on the worker, inside the transaction.
        with citus.connect() as c:
            for f in FORCED:
                c.execute("SELECT create_distributed_function(%s, 'scope', colocate_with => "
                          "'idempotency.idempotency_keys', force_delegation => true)", (f,))
        for n in clients:
            emit(pair_row("one_tx, force_delegation", n,
                          *pair(citus.coordinator, "one_tx", "bare_one_tx", n, seconds, repeat)))
        with citus.connect() as c:
            for statement in DELEGATED:
                c.execute(statement)
        emit("")
        emit("A delegated call's own cost, no extension involved: the bare INSERT and UPDATE each in a "
             "PL/pgSQL function distributed as claim and complete are (delegated_leased) against the "
             "bare statements (bare_leased):")
        emit("")
        emit("| clients | delegated functions (tps) | bare statements (tps) | delegated / bare, median (min-max) "
             "| load average, mean (min-max) |")
        emit("|---|---|---|---|---|")
        for n in clients:
            a, b, r = pair(citus.coordinator, "delegated_leased", "bare_leased", n, seconds, repeat)
            emit(f"| {n} | {statistics.median(a):.0f} | {statistics.median(b):.0f} | {r.cell()} | "
                 f"{spread.load_cell(r.load)} |")
        with citus.connect() as c:
            server = c.execute("SELECT version()").fetchone()[0].split(" on ")[0]
            cit = c.execute("SELECT extversion FROM pg_extension WHERE extname = 'citus'").fetchone()[0]
    finally:
        citus.destroy()
    if out:
        with open(os.path.join(HERE, f"{out}.md"), "w", encoding="utf-8") as f:
            f.write("# Citus: the store against the bare statements\n\n"
                    f"Written by `bench/citus.py --bare --seconds {seconds} --repeat {repeat} "
                    f"--clients {','.join(map(str, clients))} --out {out}` ({server}, citus extension {cit}, a "
                    f"coordinator and two workers on one machine; {repeat} round{'s' if repeat > 1 else ''} per "
                    "cell, the store's and the bare script's runs alternating, tps the medians). The "
                    f"machine's load (`uptime`) at the start: `{started}`; at the end: `{uptime()}`.\n\n"
                    + spread.rule_text()
                    + (" This run had one round per cell, so no ratio has a spread." if repeat < 2 else "")
                    + "\n\n" + spread.load_header(LOAD.samples) + "\n\n")
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
