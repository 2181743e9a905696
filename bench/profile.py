#!/usr/bin/env python3
"""Where claim-only deduplication spends its time, against Redis `SET NX EX`, at equal
durability (PostgreSQL `synchronous_commit = off`, Redis `appendfsync everysec`).

Runs each workload at 16 clients and measures, per operation:
  - the server's CPU time (every process of the PostgreSQL cluster, the backends included
    after they exit, read from /proc; the redis-server process),
  - the load generator's CPU time (pgbench, redis-benchmark),
and, for the PostgreSQL workloads, a sampled CPU profile of the server (perf, system-wide,
the cluster's processes only): the share of each shared object and the heaviest functions.

The ladder of workloads splits the gap into its steps:
  redis PING -> redis SET NX EX          (what Redis adds for a write)
  SELECT 1 -> bare INSERT ON CONFLICT    (what a PostgreSQL write transaction adds)
  bare INSERT -> claim                   (what the extension adds)
and SELECT 1 against PING is the cost of a PostgreSQL round trip itself (a process per
connection, the extended protocol, a snapshot), which no statement can avoid.

Run through bench/run.sh --profile (a release build installed, perf and redis-server present);
writes bench/PROFILE.md (bench/PROFILE-pgNN.md with --out).
"""

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench  # noqa: E402
from bench import SERVER_SETTINGS, Cluster, Redis, sql  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
SCRIPTS = [
    ("PostgreSQL: SELECT 1", "select_one.sql"),
    ("PostgreSQL: bare INSERT ON CONFLICT DO NOTHING", "floor_claim_only.sql"),
    ("PostgreSQL: claim, autocommitted", "ext_claim_only.sql"),
]
REDIS = [
    ("Redis: PING", ["PING"]),
    ("Redis: SET NX EX", bench.SETNX),
]


def cpu_of(pid, children=False):
    """utime + stime of `pid` in seconds (with the times of its waited-for children)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    # fields[0] is field 3 (state): utime is field 14, stime 15, cutime 16, cstime 17.
    t = int(fields[11]) + int(fields[12])
    if children:
        t += int(fields[13]) + int(fields[14])
    return t / TICKS


def cluster_cpu(cluster):
    """{pid: seconds} of the cluster's processes; the postmaster's entry includes the backends
    it has reaped."""
    master = cluster.postmaster_pid()
    return {p: cpu_of(p, children=(p == master)) for p in cluster.processes()}


def cpu_delta(before, after):
    return sum(t - before.get(p, 0.0) for p, t in after.items())


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def perf_record(seconds, out):
    return subprocess.Popen(["perf", "record", "-a", "-F", "499", "-g", "-o", out, "--", "sleep",
                             str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def perf_summary(data, pids):
    """(share by where the code runs, top functions), self time, of the samples of `pids`.
    The kernel's share is read from the symbols' [k] mark (perf's dso column folds some kernel
    samples into the process's binary when filtered by pid)."""
    out = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "--pid",
                          ",".join(str(p) for p in pids), "--sort", "dso,sym", "-g", "none",
                          "--percentage", "relative"], capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.match(r"\s+([\d.]+)%\s+(\S+)\s+\[([k.])\]\s+(.*\S)", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3), m.group(4)))
    where = {}
    for pct, dso, mark, _ in rows:
        key = "kernel" if mark == "k" else dso
        where[key] = where.get(key, 0.0) + pct
    shares = sorted(((v, k) for k, v in where.items() if v >= 0.5), reverse=True)
    top = [(pct, f"{'kernel' if mark == 'k' else dso}: {sym}") for pct, dso, mark, sym in rows[:12]]
    return shares, top


def run_pgbench(cluster, script, clients, seconds, logdir, profile_dir):
    before, cbefore = cluster_cpu(cluster), children_cpu()
    data = os.path.join(profile_dir, script + ".perf") if profile_dir else None
    rec = perf_record(max(1, seconds - 2), data) if data else None
    # The backends live as long as pgbench's connections: their pids are read during the run.
    pids = set()
    timer = threading.Timer(1.0, lambda: pids.update(cluster.processes()))
    timer.start()
    tps, p99 = bench.pgbench(cluster, script, clients, seconds, "profile-" + script[:-4], logdir,
                             options="-c synchronous_commit=off")
    timer.join()
    after, cafter = cluster_cpu(cluster), children_cpu()
    if rec:
        rec.wait()
    return tps, p99, cpu_delta(before, after), cafter - cbefore, (data, sorted(pids))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--out", default="PROFILE")
    ap.add_argument("--no-perf", action="store_true")
    args = ap.parse_args()
    use_perf = shutil.which("perf") is not None and not args.no_perf
    logdir = tempfile.mkdtemp(prefix="idempotency-profile-")
    os.chmod(logdir, 0o777)
    profile_dir = tempfile.mkdtemp(prefix="idempotency-perf-") if use_perf else None
    rows, profiles = [], {}
    cluster = Cluster(settings=SERVER_SETTINGS, dbname="bench").start()
    try:
        sql(cluster, "CREATE EXTENSION idempotency")
        with open(os.path.join(HERE, "sql", "setup.sql")) as f:
            sql(cluster, f.read())
        version = sql(cluster, "SHOW server_version")[0][0]
        # A warm-up run of each script, then the measured one.
        for name, script in SCRIPTS:
            print(f"== {name}", flush=True)
            bench.pgbench(cluster, script, args.clients, 2, "warm-" + script[:-4], logdir,
                          options="-c synchronous_commit=off")
            sql(cluster, "CHECKPOINT")
            tps, p99, server, client, (data, pids) = run_pgbench(
                cluster, script, args.clients, args.seconds, logdir, profile_dir)
            ops = tps * args.seconds
            rows.append((name, tps, p99, server / ops * 1e6, client / ops * 1e6))
            if use_perf:
                profiles[name] = perf_summary(data, pids)
    finally:
        cluster.stop()
    server = Redis(aof=True)
    try:
        for name, command in REDIS:
            print(f"== {name}", flush=True)
            bench.redis_bench(server.port, args.clients, 1, command)
            sbefore, cbefore = cpu_of(server.proc.pid), children_cpu()
            start = time.monotonic()
            rps, p99 = bench.redis_bench(server.port, args.clients, args.seconds, command)
            elapsed = time.monotonic() - start
            ops = rps * elapsed
            rows.append((name, rps, p99, (cpu_of(server.proc.pid) - sbefore) / ops * 1e6,
                         (children_cpu() - cbefore) / ops * 1e6))
    finally:
        server.stop()
    write(args, version, rows, profiles)


def write(args, version, rows, profiles):
    path = os.path.join(HERE, args.out + ".md")
    cores = os.cpu_count()
    with open(path, "w") as f:
        f.write("# Claim-only deduplication against Redis at equal durability: a CPU profile\n\n")
        f.write(f"Written by `bench/profile.py` ({time.strftime('%Y-%m-%d')}): PostgreSQL {version} "
                f"with `synchronous_commit = off`, Redis `appendfsync everysec`, {args.clients} clients, "
                f"{args.seconds} s per workload, on {cores} cores shared by server and load generator "
                f"(load average before the run: {os.getloadavg()[0]:.2f}). CPU per operation is "
                f"what the processes consumed (from /proc) divided by the operations done; "
                f"it does not depend on how busy the machine was as much as the rate does.\n\n")
        f.write("| workload | ops/s | p99 ms | server CPU µs/op | load generator CPU µs/op |\n")
        f.write("|---|---:|---:|---:|---:|\n")
        for name, ops, p99, s, c in rows:
            f.write(f"| {name} | {ops:,.0f} | {p99:.2f} | {s:.1f} | {c:.1f} |\n")
        by = {r[0]: r for r in rows}
        steps = [("a PostgreSQL round trip (SELECT 1) against PING", "PostgreSQL: SELECT 1", "Redis: PING"),
                 ("a write transaction (bare INSERT) against SELECT 1",
                  "PostgreSQL: bare INSERT ON CONFLICT DO NOTHING", "PostgreSQL: SELECT 1"),
                 ("the extension's claim against the bare INSERT",
                  "PostgreSQL: claim, autocommitted", "PostgreSQL: bare INSERT ON CONFLICT DO NOTHING"),
                 ("SET NX EX against PING", "Redis: SET NX EX", "Redis: PING")]
        f.write("\n| step | server CPU µs/op added |\n|---|---:|\n")
        for label, a, b in steps:
            if a in by and b in by:
                f.write(f"| {label} | {by[a][3] - by[b][3]:+.1f} |\n")
        for name, (shares, top) in profiles.items():
            per_op = by[name][3] / 100.0
            f.write(f"\n## {name}: where the server's CPU goes (perf, self time)\n\n")
            f.write("| share | µs/op | code |\n|---:|---:|---|\n")
            for pct, what in shares:
                f.write(f"| {pct:.1f}% | {pct * per_op:.1f} | {what} |\n")
            f.write("\n| share | µs/op | function |\n|---:|---:|---|\n")
            for pct, what in top:
                f.write(f"| {pct:.1f}% | {pct * per_op:.1f} | `{what}` |\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
