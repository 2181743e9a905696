#!/usr/bin/env python3
"""Instructions per transaction of the two editions, the floor, the wrapped floor and the
hand-written PL/pgSQL reference, counted by callgrind (docs/benchmarks.md, "The portable
edition"): unlike throughput on a shared machine, the counts do not move with the machine's
load, so they show what a change to a hot path saves. Writes bench/INSTRUCTIONS-editions.md (or
--out NAME.md).

Run through `bench/run.sh --edition portable --instructions [--pg NN]` (it installs valgrind and
a release build of the native edition). The server is the one bench/editions.py sets up (both
editions, each with its floor, the wrapped floor and the reference), restarted under
`valgrind --tool=callgrind`; each workload runs as `pgbench -M prepared` with one client, once
with 100 and once with 600 transactions, and the difference of its backend's counts is divided
by 500 (the connection's start and end cancel out). A few minutes.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
from cluster import PG_BIN, Cluster  # noqa: E402

import psycopg  # noqa: E402

from bench import SERVER_SETTINGS  # noqa: E402
from editions import EDITIONS, install  # noqa: E402

# (transaction, [(column, database, script)])
WORKLOADS = [
    ("replay", [("floor", "portable", "floor_read.sql"), ("wrapped floor", "portable", "wrapped_read.sql"),
                ("native", "native", "ext_replay.sql"), ("portable", "portable", "ext_replay.sql"),
                ("hand-written PL/pgSQL", "portable", "reference_replay.sql")]),
    ("claim + complete, one transaction",
     [("floor", "portable", "floor_write.sql"), ("wrapped floor", "portable", "wrapped_write.sql"),
      ("native", "native", "ext_one_tx.sql"), ("portable", "portable", "ext_one_tx.sql"),
      ("hand-written PL/pgSQL", "portable", "reference.sql")]),
]
FEW, MANY = 100, 600


def as_postgres(*cmd):
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else list(cmd)


def counted(path):
    """The instructions a callgrind output file counted."""
    with open(path, errors="replace") as f:
        m = re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M)
    return int(m.group(1)) if m else 0


def backend_count(cluster, watcher, outdir, db, script, transactions):
    """The instructions of the backend that ran `transactions` of `script`: of the backends of
    pgbench's connections (found by their application_name while it runs; pgbench opens one of
    its own first), the one that counted most. Each writes its output file as it exits."""
    app = f"callgrind-{time.monotonic_ns()}"
    run = subprocess.Popen([f"{PG_BIN}/pgbench", "-h", cluster.dir, "-p", str(cluster.port), "-U", "postgres", "-n",
                            "-c", "1", "-t", str(transactions), "-M", "prepared",
                            "-f", os.path.join(HERE, "sql", script), db],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=dict(os.environ, PGOPTIONS="-c client_min_messages=error", PGAPPNAME=app))
    pids = set()
    while run.poll() is None:
        pids.update(r[0] for r in watcher.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                                                  (app,)).fetchall())
        time.sleep(0.02)
    output = run.communicate()[0]
    if run.returncode != 0 or not pids:
        raise RuntimeError(f"pgbench {script} on {db}: {output}")
    counts = {}
    deadline = time.monotonic() + 120
    while len(counts) < len(pids) and time.monotonic() < deadline:
        for pid in pids - set(counts):
            path = os.path.join(outdir, f"callgrind.out.{pid}")
            try:
                os.kill(pid, 0)  # still writing its file
            except ProcessLookupError:
                if os.path.exists(path) and counted(path):
                    counts[pid] = counted(path)
        time.sleep(0.2)
    if len(counts) < len(pids):
        raise RuntimeError(f"no callgrind output for {script} on {db} (backends {sorted(pids)})")
    return max(counts.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="INSTRUCTIONS-editions")
    ap.add_argument("--script", default=os.path.join(HERE, "..", "dist", "idempotency-portable.sql"))
    args = ap.parse_args()
    cluster = Cluster(settings=SERVER_SETTINGS, dbname="bench").start()
    outdir = tempfile.mkdtemp(prefix="idempotency-callgrind-")
    os.chmod(outdir, 0o777)
    server = watcher = None
    try:
        for e in EDITIONS:
            install(cluster, e, args.script)
        version = subprocess.run([f"{PG_BIN}/postgres", "--version"], capture_output=True, text=True).stdout.strip()
        cluster.stop()
        # The same server under callgrind; no autovacuum and no background sweep while it counts.
        server = subprocess.Popen(as_postgres(
            "valgrind", "--tool=callgrind", "--trace-children=yes",
            f"--callgrind-out-file={outdir}/callgrind.out.%p", f"{PG_BIN}/postgres", "-D", cluster.data,
            "-c", "autovacuum=off", "-c", "idempotency.sweep_interval=1h"),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cluster.wait_ready(timeout=120)
        watcher = psycopg.connect(cluster.conninfo(), autocommit=True)
        table = {}
        for label, columns in WORKLOADS:
            for column, db, script in columns:
                few = backend_count(cluster, watcher, outdir, db, script, FEW)
                many = backend_count(cluster, watcher, outdir, db, script, MANY)
                table[(label, column)] = (many - few) / (MANY - FEW)
                print(f"  {label}, {column}: {table[(label, column)]:,.0f} instructions per transaction", flush=True)
    finally:
        if watcher is not None:
            watcher.close()
        if server is not None:
            try:  # a fast shutdown, to the postmaster (valgrind runs in its process)
                with open(os.path.join(cluster.data, "postmaster.pid")) as f:
                    os.kill(int(f.readline()), 2)
                server.wait(timeout=120)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                server.kill()
        cluster.destroy()
        shutil.rmtree(outdir, ignore_errors=True)
    columns = [c for c, _db, _s in WORKLOADS[0][1]]
    lines = [
        "# Instructions per transaction, the two editions side by side",
        "",
        f"`bench/run.sh --edition portable --instructions` on {version}: the server of",
        "bench/editions.py (the native library preloaded; the native edition and the portable one each in",
        "its own database) under `valgrind --tool=callgrind`; `pgbench -M prepared`, one client, "
        f"{FEW} and {MANY}",
        f"transactions, the difference of the backend's counts divided by {MANY - FEW}. Unlike throughput,",
        "these do not move with the load of the machine.",
        "",
        "| transaction | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for label, _columns in WORKLOADS:
        lines.append(f"| {label} | " + " | ".join(f"{table[(label, c)]:,.0f}" for c in columns) + " |")
    lines.append("")
    path = os.path.join(HERE, f"{args.out}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
