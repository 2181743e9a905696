#!/usr/bin/env python3
"""Benchmark harness: the extension against the floor and the alternatives, side by side in one
run with alternating rounds. Writes bench/RESULTS.md and bench/throughput_p99.png.

Run through bench/run.sh (it installs the prerequisites and a release build). Options:
  --seconds N   length of each pgbench/redis run (default 5)
  --rounds N    alternating rounds per comparison (default 2)
  --big N       rows for the scale comparison (default 10,000,000)
  --quick       a smoke run: 1 s runs, 1 round, 100,000 rows (checks the harness, not targets)
  --no-redis    skip the Redis comparisons (they do not depend on the PostgreSQL version)
  --no-scale    skip the 10M-row scale comparison
  --out NAME    write NAME.md (and a chart) instead of RESULTS.md; bench/run.sh --pg NN uses
                RESULTS-pgNN
  --summary     only rewrite the per-version table in RESULTS.md from RESULTS.md and the
                RESULTS-pgNN.md reports
"""

import argparse
import csv
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
from cluster import PG_BIN, Cluster, free_port  # noqa: E402

import psycopg  # noqa: E402

import hot_in_flight  # noqa: E402
import spread  # noqa: E402

CLIENTS = [1, 4, 16]
REQUEST = '{"amount": 100, "currency": "EUR"}'


PGBENCH_ENV = dict(os.environ, PGOPTIONS="-c client_min_messages=error")
# The benchmark server: durable (fsync, synchronous_commit on), the library preloaded.
SERVER_SETTINGS = {
    "shared_buffers": "256MB", "fsync": "on", "max_connections": "100",
    "shared_preload_libraries": "'idempotency'", "idempotency.sweep_interval": "'1s'",
    "log_min_messages": "error",
}


def pgbench_command(cluster, script, clients, seconds, prefix):
    """pgbench running `script` (bench/sql) prepared, logging each transaction under `prefix`."""
    return [f"{PG_BIN}/pgbench", "-h", cluster.dir, "-p", str(cluster.port), "-U", "postgres", "-n",
            "-c", str(clients), "-j", str(min(clients, 4)), "-T", str(seconds), "-M", "prepared",
            "-f", os.path.join(HERE, "sql", script), "-l", "--log-prefix", prefix, cluster.dbname]


def pgbench(cluster, script, clients, seconds, tag, logdir, options=""):
    """Runs one pgbench script (with `options` added to its sessions' PGOPTIONS, e.g.
    "-c synchronous_commit=off"); returns (tps, p99 latency in ms)."""
    prefix = os.path.join(logdir, f"{tag}-{clients}")
    for f in os.listdir(logdir):
        if f.startswith(os.path.basename(prefix) + "."):
            os.remove(os.path.join(logdir, f))
    env = dict(PGBENCH_ENV, PGOPTIONS=f"{PGBENCH_ENV['PGOPTIONS']} {options}".strip())
    out = subprocess.run(pgbench_command(cluster, script, clients, seconds, prefix),
                         capture_output=True, text=True, env=env, cwd=logdir)
    if out.returncode != 0:
        raise RuntimeError(f"pgbench {script} failed:\n{out.stdout}\n{out.stderr}")
    tps = None
    for line in out.stdout.splitlines():
        if line.startswith("tps ="):
            tps = float(line.split()[2])
    latencies = []
    for f in os.listdir(logdir):
        if f.startswith(os.path.basename(prefix) + "."):
            with open(os.path.join(logdir, f)) as fh:
                for row in fh:
                    parts = row.split()
                    if len(parts) >= 3:
                        latencies.append(int(parts[2]))
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1] / 1000.0 if latencies else float("nan")
    return tps, p99


def redis_bench(port, clients, seconds, command):
    """redis-benchmark for about `seconds`; returns (rps, p99 ms)."""
    n = max(2000, int(20000 * seconds * min(clients, 4)))
    out = subprocess.run(
        ["redis-benchmark", "-p", str(port), "-c", str(clients), "-n", str(n), "-r", "100000000",
         "--csv", *command],
        capture_output=True, text=True, check=True,
    )
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    return float(rows[-1]["rps"]), float(rows[-1]["p99_latency_ms"])


class Redis:
    def __init__(self, aof):
        self.dir = tempfile.mkdtemp(prefix="idempotency-redis-")
        self.port = free_port()
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", self.dir, "--daemonize", "no"]
        if aof:
            args += ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            args += ["--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            if subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


SETNX = ["SET", "idem:__rand_int__", '{"ok":true}', "NX", "EX", "86400"]
LUA = ["EVAL",
       "local v = redis.call('GET', KEYS[1]) if v then return v end "
       "redis.call('SET', KEYS[1], ARGV[1], 'EX', 86400) return false",
       "1", "idem:__rand_int__", '{"ok":true}']


def sql(cluster, statement, params=None):
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        cur = c.execute(statement, params)
        return cur.fetchall() if cur.description else None


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# The load average of the whole run, sampled before and after each measured run (the report's
# header gives its mean and range; each target row, the samples around its own runs).
LOAD = spread.LoadLog()


class Rounds(tuple):
    """(median tps, median p99 ms) of a variant's runs, which the tables and the chart read, with
    each round's (tps, p99) kept in .rounds and the load average samples around its runs in
    .load: a ratio to another variant is then taken round by round (ratio())."""

    def __new__(cls, rounds, load=()):
        rounds = [tuple(x) for x in rounds]
        self = super().__new__(cls, (median([x[0] for x in rounds]), median([x[1] for x in rounds])))
        self.rounds = rounds
        self.load = list(load)
        return self

    def scaled(self, factor):
        """The same rounds with their rate multiplied by `factor` (transactions to keys)."""
        return Rounds([(x[0] * factor, x[1]) for x in self.rounds], self.load)


def ratio(side, other, i=0):
    """side's figure (i = 0: the rate) over other's, round by round: a spread.Ratio with the load
    around the runs of both. A side measured once (a bare tuple) counts as one round."""
    def per_round(x):
        return [r[i] for r in x.rounds] if isinstance(x, Rounds) else [x[i]]
    return spread.Ratio.of(per_round(side), per_round(other),
                           load=getattr(side, "load", []) + getattr(other, "load", []))


def alternate(rounds, variants, run):
    """Runs every variant once per round, reversing the order every other round: {variant:
    Rounds}, whose round r of one variant ran next to round r of every other."""
    results = {v: [] for v in variants}
    loads = {v: [] for v in variants}
    for r in range(rounds):
        order = variants if r % 2 == 0 else list(reversed(variants))
        for v in order:
            results[v].append(LOAD.around(lambda: run(v), loads[v]))
    return {v: Rounds(xs, loads[v]) for v, xs in results.items()}


def write_table(variant):
    """The table a write workload updates (for its HOT ratio)."""
    if variant.startswith("floor:"):
        return "bench.floor"
    if variant.startswith("reference:"):
        return "bench.ref_keys"
    return "idempotency.idempotency_keys"


def update_counters(cluster, table):
    """(n_tup_upd, n_tup_hot_upd) of `table` once the benchmark's sessions have gone (a backend
    flushes its statistics as it exits; pgbench returns when its connections close, a moment
    before)."""
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        for _ in range(100):
            others = c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                               "AND backend_type = 'client backend' AND pid <> pg_backend_pid()").fetchone()[0]
            if others == 0:
                break
            time.sleep(0.05)
        c.execute("SELECT pg_stat_clear_snapshot()")
        return c.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass",
                         (table,)).fetchone()


def counting_hot(cluster, hot, variant, run, runs=None):
    """Runs run() (a write workload) and adds the updates it made, and how many were HOT, to
    hot[variant]; the run's own HOT ratio to runs[variant] (its spread over the runs)."""
    table = write_table(variant)
    upd0, hot0 = update_counters(cluster, table)
    result = run()
    upd1, hot1 = update_counters(cluster, table)
    total = hot.setdefault(variant, [0, 0])
    total[0] += upd1 - upd0
    total[1] += hot1 - hot0
    if runs is not None:
        runs.setdefault(variant, []).append(hot_ratio((upd1 - upd0, hot1 - hot0)))
    return result


def hot_ratio(counts):
    updates, hot_updates = counts
    return hot_updates / updates if updates else float("nan")


def populate_replay_keys(cluster):
    sql(cluster, f"""INSERT INTO idempotency.idempotency_keys
                       (key, request_hash, status, token, response, response_status, expires_at, ttl, completed_at)
                     SELECT 'r' || i, idempotency.canonical_hash('{REQUEST}'), 'completed', i, '{{"ok": true}}', 200,
                            now() + interval '1 day', interval '1 day', now()
                       FROM generate_series(1, 10000) i""")
    sql(cluster, """INSERT INTO bench.floor (key, status, token, response, response_status, expires_at, ttl)
                    SELECT 'r' || i, 'completed', i, '{"ok": true}', 200, now() + interval '1 day', interval '1 day'
                      FROM generate_series(1, 10000) i""")
    sql(cluster, f"""INSERT INTO idempotency.idempotency_keys
                       (key, request_hash, status, token, expires_at, ttl, locked_until)
                     SELECT 'hot-' || i, idempotency.canonical_hash('{REQUEST}'), 'in_progress', i,
                            now() + interval '1 day', interval '1 day', now() + interval '1 hour'
                       FROM generate_series(1, 100) i""")
    sql(cluster, "VACUUM ANALYZE")


def wal_bytes_per_tx(cluster, script, logdir):
    # Start both measurements right after a checkpoint, so they pay for the same kind of
    # full-page images (a checkpoint inside one of them made it look 40x heavier once).
    sql(cluster, "CHECKPOINT")
    before = sql(cluster, "SELECT wal_bytes FROM pg_stat_wal")[0][0]
    out = subprocess.run(
        [f"{PG_BIN}/pgbench", "-h", cluster.dir, "-p", str(cluster.port), "-U", "postgres", "-n", "-c", "1",
         "-t", "2000", "-M", "prepared", "-f", os.path.join(HERE, "sql", script), cluster.dbname],
        capture_output=True, text=True, check=True,
    )
    after = sql(cluster, "SELECT wal_bytes FROM pg_stat_wal")[0][0]
    del out
    return float(after - before) / 2000


def make_doc(size):
    """A JSON document of about `size` bytes with nested objects, arrays, strings and numbers."""
    import json
    import random
    r = random.Random(size)
    items = []
    total = 0
    while total < size:
        item = {"id": r.randint(1, 10**12), "name": "item-" + str(r.random()), "price": round(r.uniform(0, 1000), 2),
                "tags": [r.choice(["a", "bb", "ccc", "été", "€"]) for _ in range(3)], "ok": r.random() < 0.5,
                "nested": {"z": r.random(), "a": None, "m": "x" * r.randint(0, 20)}}
        items.append(item)
        total += len(json.dumps(item))
    return json.dumps({"order": {"items": items, "currency": "EUR"}, "customer": "c-42"})


def hashing(cluster, seconds):
    """MB/s of canonical_hash, sha256(doc::text) and the PL/pgSQL canonicalizer: {label: {name:
    best MB/s}}, and {label: {name: [MB/s per round, None where it did not run]}} with the load
    samples of each label, for the ratios round by round."""
    results, per_round, loads = {}, {}, {}
    for label, size, copies in [("200 B", 200, 20000), ("10 KB", 10_000, 2000), ("1 MB", 1_000_000, 20)]:
        doc = make_doc(size)
        sql(cluster, "DELETE FROM bench.docs")
        sql(cluster, "INSERT INTO bench.docs SELECT %s, (%s::jsonb || jsonb_build_object('copy', i)) FROM generate_series(1, %s) i",
            (label, doc, copies))
        nbytes = sql(cluster, "SELECT sum(length(doc::text)) FROM bench.docs")[0][0]
        # Alternating runs (the order reversed every other round), best run of each: a burst of
        # noise on this shared machine then hurts one run, not one side of the comparison.
        exprs = [("canonical_hash", "idempotency.canonical_hash(doc)"),
                 ("sha256(doc::text)", "sha256(convert_to(doc::text, 'UTF8'))"),
                 ("PL/pgSQL canonicalizer", "sha256(convert_to(bench.plpgsql_canonical(doc), 'UTF8'))")]
        rates = {name: [None] * 5 for name, _ in exprs}
        spent = {name: 0.0 for name, _ in exprs}
        loads[label] = []
        for i in range(5):
            for name, expr in (exprs if i % 2 == 0 else list(reversed(exprs))):
                if any(rates[name]) and spent[name] > seconds:
                    continue  # the PL/pgSQL canonicalizer is 20x slower: a run or two is plenty
                started = time.monotonic()
                LOAD.around(lambda: sql(cluster, f"SELECT count({expr}) FROM bench.docs"), loads[label])
                took = time.monotonic() - started
                spent[name] += took
                rates[name][i] = nbytes / took / 1e6
        row = {name: max(x for x in r if x is not None) for name, r in rates.items()}
        results[label] = row
        per_round[label] = rates
    return results, per_round, loads


# Expired rows as the sweeper meets them: random keys and request hashes, a response of a
# hundred bytes or so (repetitive rows would make their full-page images compress unrealistically).
EXPIRED_ROWS = """INSERT INTO idempotency.idempotency_keys
                    (key, request_hash, status, token, response, response_status, expires_at, ttl, completed_at,
                     created_at)
                  SELECT %s || i || ':' || md5(random()::text), sha256(random()::text::bytea), 'completed', -i,
                         jsonb_build_object('id', 'ch_' || md5(random()::text), 'amount', (random() * 10000)::int,
                                            'currency', 'EUR', 'status', 'succeeded'),
                         200, now() - interval '1 minute', interval '1 hour', now() - interval '61 minutes',
                         now() - interval '61 minutes'
                    FROM generate_series(1, 1000000) i"""


def swept_so_far(cluster):
    return sql(cluster, "SELECT rows_swept FROM idempotency._shared_stats()")[0][0]


def wait_swept(cluster, start, target, timeout=300):
    """Polls the sweeper's counter; returns (time of the first deleted row, time it reached target)."""
    first = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        swept = swept_so_far(cluster) - start
        now = time.monotonic()
        if swept > 0 and first is None:
            first = (now, swept)
        if swept >= target:
            return first, (now, swept)
        time.sleep(0.05)
    return first, None


def set_sweep_interval(cluster, value):
    sql(cluster, f"ALTER SYSTEM SET idempotency.sweep_interval = '{value}'")
    sql(cluster, "SELECT pg_reload_conf()")


SWEEP_ROUNDS = 5
SWEEP_WINDOW = 2.0      # seconds the sweeper sweeps, then as long parked, and so on, within one run
SWEEP_SETTLE = 0.3      # seconds after each switch whose transactions count for neither side
SWEEP_WARMUP = 1.0      # seconds of load, the sweeper parked, before the first window (counted for neither)
SWEEP_ON_DELAY = "50ms"  # the default sweep_delay: the sweeper as it runs out of the box
SWEEP_OFF_DELAY = "10s"  # parks it after its current batch (a reload ends its pause at once)


def set_sweep_delay(cluster, value):
    sql(cluster, f"ALTER SYSTEM SET idempotency.sweep_delay = '{value}'")
    sql(cluster, "SELECT pg_reload_conf()")


def expired_backlog(cluster, tag):
    """A million expired rows in the table, inserted with the sweeper parked, then vacuumed and
    analyzed."""
    set_sweep_delay(cluster, SWEEP_OFF_DELAY)
    set_sweep_interval(cluster, "1h")
    time.sleep(2)  # a batch in flight ends; the sweeper parks
    sql(cluster, EXPIRED_ROWS, (tag,))
    sql(cluster, "VACUUM ANALYZE idempotency.idempotency_keys")
    set_sweep_interval(cluster, "1s")  # a round starts, sweeps its first batch, and parks
    time.sleep(2)


def windowed_p99(cluster, seconds, tag, logdir, first_on):
    """8 claiming sessions for `seconds`; after SWEEP_WARMUP, the sweeper is switched on and off
    (parked) every SWEEP_WINDOW seconds. Returns {on: (tps, p99 ms, transactions)} over the transactions
    that ended inside the windows of each kind, SWEEP_SETTLE after the switch on."""
    prefix = os.path.join(logdir, f"{tag}-8")
    for f in os.listdir(logdir):
        if f.startswith(os.path.basename(prefix) + "."):
            os.remove(os.path.join(logdir, f))
    proc = subprocess.Popen(pgbench_command(cluster, "ext_one_tx.sql", 8, seconds, prefix),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=PGBENCH_ENV,
                            cwd=logdir)
    windows = []  # (start, on)
    on = first_on
    end = time.time() + seconds
    # The sessions connect and write before the first window: a sweeper woken while the server
    # still looks idle deletes a full batch, which no window of a running application sees.
    time.sleep(SWEEP_WARMUP)
    while time.time() < end - 0.5:
        set_sweep_delay(cluster, SWEEP_ON_DELAY if on else SWEEP_OFF_DELAY)
        windows.append((time.time(), on))
        time.sleep(min(SWEEP_WINDOW, max(0.0, end - 0.1 - time.time())))
        on = not on
    # Parked before the sessions stop: a sweeper still on then finds the server idle and sweeps
    # full batches, which no transaction of the run sees.
    set_sweep_delay(cluster, SWEEP_OFF_DELAY)
    end = time.time()
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench ext_one_tx.sql failed:\n{out}\n{err}")
    latencies = {True: [], False: []}
    for f in os.listdir(logdir):
        if f.startswith(os.path.basename(prefix) + "."):
            with open(os.path.join(logdir, f)) as fh:
                for row in fh:
                    parts = row.split()
                    if len(parts) < 6:
                        continue
                    ended = int(parts[4]) + int(parts[5]) / 1e6
                    for i, (t, kind) in enumerate(windows):
                        t_end = windows[i + 1][0] if i + 1 < len(windows) else end
                        if t + SWEEP_SETTLE <= ended < t_end:
                            latencies[kind].append(int(parts[2]))
                            break
    span = {True: 0.0, False: 0.0}
    for i, (t, kind) in enumerate(windows):
        t_end = windows[i + 1][0] if i + 1 < len(windows) else end
        span[kind] += max(0.0, t_end - t - SWEEP_SETTLE)
    res = {}
    for kind, xs in latencies.items():
        xs.sort()
        p99 = xs[int(len(xs) * 0.99) - 1] / 1000.0 if xs else float("nan")
        res[kind] = (len(xs) / span[kind] if span[kind] else float("nan"), p99, len(xs))
    return res


def sweep_bench(cluster, seconds, rounds, logdir):
    """The background sweeper's deletion rate on 1M expired rows (nothing else running), then, in
    each of at least SWEEP_ROUNDS rounds, the p99 of 8 claiming sessions while it sweeps a backlog
    of a million expired rows against while it does not.

    Within each round's run the sweeper sweeps for SWEEP_WINDOW seconds and is parked (the longest
    sweep_delay, applied by a reload after its current batch) for as long, in turn; the first
    window alternates from round to round. So both sides see the same table, the same minute of
    this shared machine and the same checkpoint distance: whole runs one after the other differed
    by up to 0.7 in this ratio. The transactions of each kind of window are pooled per round (those
    ending in the first SWEEP_SETTLE seconds after a switch count for neither side), and the
    ratio is the median of the rounds' ratios: each round's two sides are a pair, while the p99
    of one side moves by up to a third from round to round."""
    sql(cluster, "VACUUM idempotency.idempotency_keys")
    swept0 = swept_so_far(cluster)
    rate_load, load = [], []
    sql(cluster, EXPIRED_ROWS, ("x",))
    first, last = LOAD.around(lambda: wait_swept(cluster, swept0, 1_000_000), rate_load)
    rate = (last[1] - first[1]) / (last[0] - first[0]) if first and last and last[0] > first[0] else float("nan")

    runs = []
    length = max(4 * seconds, 20)
    # One backlog for every round: under load the sweeper deletes a few percent of it per run.
    swept_before_backlog = swept_so_far(cluster)
    expired_backlog(cluster, "y")
    for r in range(max(rounds, SWEEP_ROUNDS)):
        sql(cluster, "CHECKPOINT")
        swept1 = swept_so_far(cluster)
        res = LOAD.around(lambda: windowed_p99(cluster, length, "sweep-windows", logdir, first_on=r % 2 == 1),
                          load)
        during_swept = swept_so_far(cluster) - swept1
        without, during = res[False], res[True]
        runs.append((without, during, during_swept))
        print(f"   sweep round {r + 1}: p99 {without[1]:.2f} ms parked ({without[2]:,} transactions), "
              f"{during[1]:.2f} ms sweeping ({during[2]:,}); {during_swept:,} rows swept", flush=True)
    # The backlog's rest, swept before anything else runs.
    sql(cluster, "ALTER SYSTEM RESET idempotency.sweep_delay")
    sql(cluster, "SELECT pg_reload_conf()")
    first, last = wait_swept(cluster, swept_before_backlog, 1_000_000, timeout=60)
    deadline = time.monotonic() + 240
    while last is None and time.monotonic() < deadline and sql(
            cluster, "SELECT EXISTS (SELECT FROM idempotency.idempotency_keys WHERE key LIKE 'y%' "
                     "AND expires_at <= now())")[0][0]:
        time.sleep(0.5)
    return {"rows_per_second": rate, "length": length,
            "p99_without": median([w[1] for w, _, _ in runs]), "p99_during": median([d[1] for _, d, _ in runs]),
            "tps_without": median([w[0] for w, _, _ in runs]), "tps_during": median([d[0] for _, d, _ in runs]),
            "swept_during_load": int(median([n for _, _, n in runs])), "rounds": len(runs),
            "ratios": [d[1] / w[1] for w, d, _ in runs],
            "ratio": median([d[1] / w[1] for w, d, _ in runs]), "load": load, "rate_load": rate_load}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--big", type=int, default=10_000_000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--no-scale", action="store_true")
    ap.add_argument("--summary", action="store_true")
    ap.add_argument("--out", default="RESULTS",
                    help="name of the report (NAME.md) and chart (NAME.png is throughput_p99 for RESULTS)")
    args = ap.parse_args()
    if args.summary:
        write_summary()
        return
    if args.quick:
        args.seconds, args.rounds, args.big = 1, 1, 100_000
    logdir = tempfile.mkdtemp(prefix="idempotency-bench-")
    os.chmod(logdir, 0o777)
    cluster = Cluster(settings=SERVER_SETTINGS, dbname="bench").start()
    try:
        sql(cluster, "CREATE EXTENSION idempotency")
        with open(os.path.join(HERE, "sql", "setup.sql")) as f:
            sql(cluster, f.read())
        populate_replay_keys(cluster)
        report = {"settings": sql(cluster, "SELECT name, setting FROM pg_settings WHERE name IN "
                                           "('shared_buffers','fsync','synchronous_commit','max_connections')")}
        writes = {
            "floor: INSERT ON CONFLICT + UPDATE": "floor_write.sql",
            "reference: PL/pgSQL claim + complete": "reference.sql",
            "extension: claim + complete, one transaction": "ext_one_tx.sql",
            "extension: claim, then complete (leased)": "ext_leased.sql",
        }
        reads = {
            "floor: primary-key SELECT": "floor_read.sql",
            "extension: replay": "ext_replay.sql",
            "extension: mismatch": "ext_mismatch.sql",
        }
        # The batches first, on the store as populated: the write workloads leave it larger and
        # with free space scattered over its pages (pruned HOT chains), where a multi-insert
        # touches more pages than at the end of a fresh table, and which a copy of the rows does
        # not give the floor's table (on 16: 0.84x in a full run after the writes; 0.92x and
        # 1.06x in two runs on a store grown by 300,000 keys, the floor's table given a copy).
        print("== batches (100 keys per statement, 1 client)", flush=True)
        report["batch"] = batch_bench(cluster, args.seconds, args.rounds, logdir)
        # WAL next, while both tables hold the same 10,000 rows: later they differ in size, and
        # new keys spread over a bigger index pay more full-page images after a checkpoint.
        report["wal"] = {v: wal_bytes_per_tx(cluster, s, logdir) for v, s in [
            ("floor: INSERT ON CONFLICT + UPDATE", "floor_write.sql"),
            ("extension: claim + complete, one transaction", "ext_one_tx.sql")]}
        pg = {}
        # Reads first, for every client count, while both tables hold the same rows (the 10,000
        # completed keys, plus the WAL runs' 2,000 each): the write runs then grow each table at
        # its own pace (the extension's table by two scripts), and a bigger index is a slower
        # lookup, which would tilt the read comparisons.
        # Each write workload's HOT updates (n_tup_hot_upd / n_tup_upd of its table), over all
        # its runs: a completion that changes no indexed column adds no index entries.
        report["hot"], report["hot_runs"] = {}, {}
        for group, label in ((reads, "reads"), (writes, "writes")):
            for clients in CLIENTS:
                print(f"== PostgreSQL {label}, {clients} clients", flush=True)

                def run(v):
                    def bench():
                        return pgbench(cluster, group[v], clients, args.seconds, group[v][:-4], logdir)
                    return (counting_hot(cluster, report["hot"], v, bench, report["hot_runs"]) if group is writes
                            else bench())

                res = alternate(args.rounds, list(group), run)
                for v, r in res.items():
                    pg[(v, clients)] = r
        pg[("extension: in_progress, 16 sessions on 100 hot keys", 16)] = LOAD.around(lambda: pgbench(
            cluster, "ext_contention.sql", 16, args.seconds, "contention", logdir))
        # At Redis's durability (appendfsync everysec loses up to a second of writes on a crash):
        # the extension and the floor with synchronous_commit = off (up to three times
        # wal_writer_delay of commits lost, never a torn or corrupt store), claim-only
        # deduplication (against SET NX EX) and claim+complete (against the Lua check-and-set).
        if not args.no_redis:
            for clients in CLIENTS:
                print(f"== PostgreSQL at equal durability, {clients} clients", flush=True)
                res = alternate(args.rounds, list(EQUAL_DURABILITY), lambda v: pgbench(
                    cluster, EQUAL_DURABILITY[v], clients, args.seconds, "async-" + EQUAL_DURABILITY[v][:-4],
                    logdir, options="-c synchronous_commit=off"))
                for v, r in res.items():
                    pg[(v, clients)] = r
        print("== Redis", flush=True)
        redis = {}
        if shutil.which("redis-server") and not args.no_redis:
            for aof in (False, True):
                server = Redis(aof)
                try:
                    for clients in CLIENTS:
                        for name, cmd in [("SET NX EX", SETNX), ("Lua check-and-set", LUA)]:
                            label = f"redis: {name}" + (", appendfsync everysec" if aof else ", no persistence")
                            # Each round kept: round r pairs with round r of the PostgreSQL
                            # rows (those ran before, not alternating with these).
                            load = []
                            runs = [LOAD.around(lambda: redis_bench(server.port, clients, args.seconds, cmd), load)
                                    for _ in range(args.rounds)]
                            redis[(label, clients)] = Rounds(runs, load)
                finally:
                    server.stop()

        # The runs above left their keys behind: back to the 10,000 replay keys (and 100 hot ones).
        sql(cluster, "DELETE FROM idempotency.idempotency_keys WHERE key !~ '^(r|hot-)[0-9]+$'")
        sql(cluster, "VACUUM ANALYZE idempotency.idempotency_keys")
        scale = None
        if not args.no_scale:
            print("== scale", flush=True)
            scale = scale_bench(cluster, args, logdir)

        print("== sweep", flush=True)
        sweep = sweep_bench(cluster, args.seconds, args.rounds, logdir)

        print("== hashing", flush=True)
        hashes, report["hash_rounds"], report["hash_load"] = hashing(cluster, args.seconds)

        # Last, since it empties the store: completions with 200 claims in flight (8 sessions),
        # at the store's own fill factor (bench/hot_in_flight.py).
        print("== completions with 200 claims in flight", flush=True)
        in_flight_load = []
        report["in_flight"] = LOAD.around(
            lambda: hot_in_flight.measure(cluster, IN_FLIGHT_SIZES, pairs=250 if args.quick else 2000), in_flight_load)
        report["in_flight_load"] = in_flight_load
        report["version"] = sql(cluster, "SHOW server_version")[0][0]
    finally:
        cluster.destroy()
        shutil.rmtree(logdir, ignore_errors=True)
    write_results(args, report, pg, redis, scale, sweep, hashes)
    write_summary()


# The rows at Redis's durability (`appendfsync everysec`): synchronous_commit = off.
EQUAL_DURABILITY = {
    "floor: INSERT ON CONFLICT DO NOTHING (claim only), synchronous_commit = off": "floor_claim_only.sql",
    "extension: claim only, autocommitted, synchronous_commit = off": "ext_claim_only.sql",
    "floor: INSERT ON CONFLICT + UPDATE, synchronous_commit = off": "floor_write.sql",
    "extension: claim + complete, one transaction, synchronous_commit = off": "ext_one_tx.sql",
}
# Response sizes of the in-flight case (0: claims only, never completed), 200 in flight.
IN_FLIGHT_SIZES = [100, 400, 2048, 0]
BATCH = 100
BATCH_SCRIPTS = {
    "floor: multi-row INSERT ON CONFLICT DO NOTHING, 100 rows": "floor_batch.sql",
    "extension: claim_many, 100 fresh keys": "ext_claim_many.sql",
    "floor: multi-row INSERT + UPDATE, 100 rows, one transaction": "floor_batch_complete.sql",
    "extension: claim_many + complete_many, 100 keys, one transaction": "ext_claim_complete_many.sql",
}


def batch_bench(cluster, seconds, rounds, logdir):
    """claim_many (and claim_many + complete_many) of 100 fresh keys per statement against the
    bare multi-row statements on a table with the same two indexes, 1 client, alternating rounds:
    {name: (keys/s, p99 ms per statement)}.

    It runs first (see main). The floor's table first gets a copy of the store's rows, so both
    statements insert into tables and indexes of the same size."""
    sql(cluster, "TRUNCATE bench.floor_batch")
    sql(cluster, "INSERT INTO bench.floor_batch SELECT * FROM idempotency.idempotency_keys")
    sql(cluster, "VACUUM ANALYZE bench.floor_batch")
    sql(cluster, "VACUUM ANALYZE idempotency.idempotency_keys")
    sql(cluster, "CHECKPOINT")
    res = alternate(rounds, list(BATCH_SCRIPTS), lambda v: pgbench(
        cluster, BATCH_SCRIPTS[v], 1, seconds, BATCH_SCRIPTS[v][:-4], logdir))
    sql(cluster, "TRUNCATE bench.floor_batch")
    sql(cluster, "DELETE FROM idempotency.idempotency_keys WHERE key ~ '^(b|bc)[0-9]+-'")
    # Compact again (the batches added and deleted up to a million rows): the comparisons after
    # this one find the store as populated.
    sql(cluster, "VACUUM FULL ANALYZE idempotency.idempotency_keys")
    return {v: r.scaled(BATCH) for v, r in res.items()}


def scale_bench(cluster, args, logdir):
    """claim+complete at 4 clients on the 10,000 replay keys, then with args.big more rows."""
    small = sql(cluster, "SELECT count(*) FROM idempotency.idempotency_keys")[0][0]
    scale = {"load": []}
    # One run each (the big table's load takes minutes): the report says it has no spread.
    scale["small"] = (small, LOAD.around(lambda: pgbench(cluster, "ext_one_tx.sql", 4, args.seconds * 2,
                                                         "scale-small", logdir), scale["load"]))
    sql(cluster, f"""INSERT INTO idempotency.idempotency_keys
                       (key, request_hash, status, token, response, response_status, expires_at, ttl, completed_at)
                     SELECT 'big-' || i, (SELECT idempotency.canonical_hash('{REQUEST}')), 'completed', i, '{{"ok": true}}',
                            200, now() + interval '1 day', interval '1 day', now()
                       FROM generate_series(1, {args.big}) i""")
    sql(cluster, "VACUUM ANALYZE idempotency.idempotency_keys")
    big = sql(cluster, "SELECT count(*) FROM idempotency.idempotency_keys")[0][0]
    scale["big"] = (big, LOAD.around(lambda: pgbench(cluster, "ext_one_tx.sql", 4, args.seconds * 2,
                                                     "scale-big", logdir), scale["load"]))
    sql(cluster, "DELETE FROM idempotency.idempotency_keys WHERE key LIKE 'big-%'")
    sql(cluster, "VACUUM idempotency.idempotency_keys")
    return scale


def fmt(x, digits=0):
    return "n/a" if x is None or x != x else f"{x:,.{digits}f}"


def write_results(args, report, pg, redis, scale, sweep, hashes):
    floor, ref = "floor: INSERT ON CONFLICT + UPDATE", "reference: PL/pgSQL claim + complete"
    one, sel, replay = "extension: claim + complete, one transaction", "floor: primary-key SELECT", "extension: replay"
    lines = ["# Benchmark results", "",
             f"Generated by `bench/run.sh` ({args.seconds} s per run, {args.rounds} alternating rounds, medians). "
             f"Release build, PostgreSQL {report['version']}, default settings but `shared_buffers = 256MB` (fsync and "
             "synchronous_commit on), pgbench `-M prepared`, on a shared 2-core machine: read the ratios, "
             "not the absolute numbers. Whole runs differ by up to about 15% from one another on this "
             "machine, so a ratio that close to its threshold is not settled by one run. The batches run first "
             "(the floor's table given a copy of the store's rows; the store compacted after them), then the "
             "reads (primary-key SELECT, replay, mismatch), for every client count, while the floor's table and "
             "the extension's hold the same rows; then the writes.", "",
             spread.rule_text()
             + (" This run had one round per comparison, so no ratio has a spread." if args.rounds < 2 else ""), "",
             f"Server: PostgreSQL {report['version']}; run on {time.strftime('%Y-%m-%d', time.gmtime())}"
             + (" without the Redis comparisons" if not redis else "")
             + (" and without the scale comparison" if scale is None else "") + ".", "",
             spread.load_header(LOAD.samples), "",
             "## Throughput (transactions/s) and p99 latency (ms) by client count", "",
             "| comparison | " + " | ".join(f"{c} clients tps | p99" for c in CLIENTS) + " |",
             "|---|" + "---|---|" * len(CLIENTS)]
    names = sorted({k[0] for k in pg}, key=lambda n: (not n.startswith("floor"), n))
    for name in names + sorted({k[0] for k in redis}):
        src = pg if (name, CLIENTS[-1]) in pg or (name, 1) in pg else redis
        cells = []
        for c in CLIENTS:
            v = src.get((name, c))
            cells += [fmt(v[0]) if v else "", fmt(v[1], 2) if v else ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Targets", "",
              "| target | measured, median (min-max) | met | load average, mean (min-max) |", "|---|---|---|---|"]
    lines_note = []

    def target(desc, measured, op, goal, digits=2):
        """A row of the table: `measured` (a spread.Ratio) judged against `op goal`."""
        lines.append(f"| {desc} | {measured.cell(digits)} | {spread.met_cell(spread.judge(measured, op, goal))} | "
                     f"{spread.load_cell(measured.load)} |")

    def once(value, load):
        """A figure measured once: one round, no spread (the row says so)."""
        return spread.Ratio([value], load)

    for c in CLIENTS:
        if c in (4, 16):
            target(f"claim+complete ≥ 0.90 × floor at {c} clients", ratio(pg[(one, c)], pg[(floor, c)]), "≥", 0.90)
        target(f"claim+complete > PL/pgSQL reference at {c} clients", ratio(pg[(one, c)], pg[(ref, c)]), ">", 1.0)
    for c in CLIENTS:
        target(f"replay ≥ 0.80 × primary-key SELECT at {c} clients", ratio(pg[(replay, c)], pg[(sel, c)]), "≥", 0.80)
    batch = report.get("batch")
    if batch:
        names = list(BATCH_SCRIPTS)
        target("claim_many 100 fresh keys ≥ 0.90 × multi-row INSERT floor (keys/s, 1 client)",
               ratio(batch[names[1]], batch[names[0]]), "≥", 0.90)
    if scale:
        (n_small, (t_small, _)), (n_big, (t_big, _)) = scale["small"], scale["big"]
        target(f"claim+complete at {n_big:,} rows ≥ 0.80 × at {n_small:,} rows (4 clients; one run each, "
               "no spread)", once(t_big / t_small, scale["load"]), "≥", 0.80)
    target("sweep ≥ 100,000 rows/s (1M expired rows, background sweeper; one run, no spread)",
           once(sweep["rows_per_second"], sweep["rate_load"]), "≥", 100_000, digits=0)
    target(f"claim p99 during the sweep ≤ 1.05 × without (8 sessions, {sweep['rounds']} rounds' ratios, "
           f"{SWEEP_WINDOW:g} s windows; p99 {sweep['p99_during']:.2f} ms vs {sweep['p99_without']:.2f} ms, medians)",
           spread.Ratio(sweep["ratios"], sweep["load"]), "≤", 1.05)
    leased = "extension: claim, then complete (leased)"
    if leased in report.get("hot_runs", {}):
        load = [x for c in CLIENTS for x in getattr(pg.get((leased, c)), "load", [])]
        target("leased completions HOT ≥ 0.90 (n_tup_hot_upd / n_tup_upd, over its runs)",
               spread.Ratio(report["hot_runs"][leased], load), "≥", 0.90)
    setnx, lua = "redis: SET NX EX, appendfsync everysec", "redis: Lua check-and-set, appendfsync everysec"
    claim_only, pair = list(EQUAL_DURABILITY)[1], list(EQUAL_DURABILITY)[3]
    for i, name in ((1, claim_only), (3, pair)):
        floor_name = list(EQUAL_DURABILITY)[i - 1]
        if (name, 16) in pg and (floor_name, 16) in pg:
            lines_note.append(f"- {name} / {floor_name}, 16 clients: {ratio(pg[(name, 16)], pg[(floor_name, 16)]).cell()}.")
    for name, other, goal in ((claim_only, setnx, 0.5), (pair, lua, None)):
        if (name, 16) in pg and (other, 16) in redis:
            r = ratio(pg[(name, 16)], redis[(other, 16)])
            if goal is None:  # reported, no target
                lines_note.append(f"- {name} / {other}, 16 clients: {r.cell()}.")
            else:
                target(f"claim only (synchronous_commit = off) ≥ {goal:.1f} × SET NX EX (appendfsync everysec) "
                       "at 16 clients (round r of Redis's runs, after PostgreSQL's, against round r)", r, "≥", goal)
    for r in report.get("in_flight", {}).get("results", []):
        if r["size"]:
            target(f"completions HOT with 200 claims in flight, {r['size']:,} B responses ≥ 0.90 "
                   f"(n_tup_hot_upd / n_tup_upd, fillfactor {r['fillfactor']}; one run, no spread)",
                   once(r["ratio"], report.get("in_flight_load", [])), "≥", 0.90)
    hash_rounds = report.get("hash_rounds", {})
    for label in ("10 KB", "1 MB"):
        if label in hash_rounds:
            r = spread.Ratio.of(hash_rounds[label]["canonical_hash"], hash_rounds[label]["sha256(doc::text)"],
                                report["hash_load"][label])
        else:
            r = once(hashes[label]["canonical_hash"] / hashes[label]["sha256(doc::text)"], [])
        target(f"canonical_hash ≥ 0.5 × sha256(doc::text) at {label}", r, "≥", 0.5)
    if batch:
        names = list(BATCH_SCRIPTS)
        lines += ["", "## Batches: 100 keys per statement, 1 client (keys/s)", "",
                  "| comparison | keys/s | p99 per statement (ms) | ratio to its floor, median (min-max) |",
                  "|---|---|---|---|"]
        for i, name in enumerate(names):
            floor_name = names[i - i % 2]
            cell = "" if i % 2 == 0 else ratio(batch[name], batch[floor_name]).cell()
            lines.append(f"| {name} | {fmt(batch[name][0])} | {fmt(batch[name][1], 2)} | {cell} |")
    lines += ["", "## Hashing throughput (MB/s of document text)", "",
              "The best of up to five alternating runs of each; the target's ratio above is the median of "
              "the runs' ratios round by round.", "",
              "| document | canonical_hash | sha256(doc::text) | PL/pgSQL canonicalizer |", "|---|---|---|---|"]
    for label, row in hashes.items():
        lines.append(f"| {label} | {row['canonical_hash']:.1f} | {row['sha256(doc::text)']:.1f} | "
                     f"{row['PL/pgSQL canonicalizer']:.1f} |")
    if report.get("hot"):
        lines += ["", "## HOT updates per write workload", "",
                  "Updates of the workload's table over all its runs (every client count and round), from "
                  "`pg_stat_user_tables` (`n_tup_hot_upd / n_tup_upd`): a HOT update adds no index entries.", "",
                  "| workload | updates | HOT | HOT ratio | per run, median (min-max) |", "|---|---|---|---|---|"]
        for v, (updates, hot_updates) in report["hot"].items():
            per_run = spread.Ratio(report.get("hot_runs", {}).get(v, [])).cell()
            lines.append(f"| {v} | {updates:,} | {hot_updates:,} | {fmt(hot_ratio((updates, hot_updates)), 2)} | "
                         f"{per_run} |")
    if report.get("in_flight"):
        lines += ["", "## Completions with 200 claims in flight", "",
                  "`bench/hot_in_flight.py` (which also compares fill factors: `--fillfactor N`). The pairs/s "
                  "depend on the machine's load; the HOT ratio, the WAL and the sizes do not. One run per "
                  "response size, so its ratios have no spread.", "",
                  hot_in_flight.table(report["in_flight"]["results"], report["in_flight"]["args"]).rstrip()]
    if lines_note:
        lines += ["", "## At equal durability", "",
                  "Redis with `appendfsync everysec` loses up to a second of writes on a crash; PostgreSQL with "
                  "`synchronous_commit = off` up to three times `wal_writer_delay` (0.6 s) of commits, never a "
                  "torn store. For an idempotency key a lost claim means a retry runs the side effect again.",
                  ""] + lines_note
    lines += ["", "## Scale, sweep and WAL", ""]
    if scale:
        lines.append(f"- claim+complete, 4 clients: {t_small:,.0f} tps at {n_small:,} rows, "
                     f"{t_big:,.0f} tps at {n_big:,} rows.")
    lines += [
              f"- background sweeper (default settings): {sweep['rows_per_second']:,.0f} rows/s on 1,000,000 "
              f"expired rows with nothing else running. 8 claiming sessions, {sweep['rounds']} rounds of "
              f"{sweep['length']} s (medians), each on a table holding a million expired rows, the sweeper "
              f"sweeping them and parked in turn every {SWEEP_WINDOW:g} s: {sweep['tps_without']:,.0f} tps / p99 "
              f"{sweep['p99_without']:.2f} ms while it is parked, {sweep['tps_during']:,.0f} tps / p99 "
              f"{sweep['p99_during']:.2f} ms while it sweeps ({sweep['swept_during_load']:,} rows deleted per "
              f"run: under load it yields, deleting a hundredth of a batch per pause; the rest when the "
              f"server is idle). p99 ratio per round: "
              + ", ".join(f"{x:.2f}" for x in sweep["ratios"]) + ".",
              ] + [f"- WAL per transaction (2,000 transactions after a checkpoint, both tables at 10,000 rows), {k}: "
                   f"{v:,.0f} bytes." for k, v in report["wal"].items()]
    png = "throughput_p99.png" if args.out == "RESULTS" else f"throughput_p99-{args.out}.png"
    lines += ["", f"![throughput and p99 by client count]({png})", ""]
    path = os.path.join(HERE, f"{args.out}.md")
    # The Citus section (bench/citus.py's figures, its own run on a cluster) is kept.
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if "\n## Citus\n" in old:
            lines += ["", old[old.index("\n## Citus\n") + 1:].rstrip("\n"), ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    chart(pg, redis, png)
    print("\n".join(lines))


# The targets every supported version is held to (issue: PostgreSQL 16-18), as they are named in
# a report's Targets table; the per-version table in RESULTS.md shows them side by side.
SUMMARY_TARGETS = [
    ("claim+complete ≥ 0.90 × floor at 4 clients", "claim+complete / floor, 4 clients (≥ 0.90)"),
    ("claim+complete ≥ 0.90 × floor at 16 clients", "claim+complete / floor, 16 clients (≥ 0.90)"),
    ("replay ≥ 0.80 × primary-key SELECT at 1 clients", "replay / primary-key SELECT, 1 client (≥ 0.80)"),
    ("replay ≥ 0.80 × primary-key SELECT at 4 clients", "replay / primary-key SELECT, 4 clients (≥ 0.80)"),
    ("replay ≥ 0.80 × primary-key SELECT at 16 clients", "replay / primary-key SELECT, 16 clients (≥ 0.80)"),
    ("sweep ≥ 100,000 rows/s", "sweep, rows/s on an idle server (≥ 100,000)"),
    ("claim_many 100 fresh keys ≥ 0.90 × multi-row INSERT floor", "claim_many / multi-row INSERT, 100 keys (≥ 0.90)"),
    # The target was 1.25 before 0.4.0 (1.05): the prefix matches the reports of either.
    ("claim p99 during the sweep ≤", "claim p99 during a sweep / without (≤ 1.05)"),
    ("leased completions HOT ≥ 0.90", "leased completions, HOT updates / updates (≥ 0.90)"),
    ("claim only (synchronous_commit = off) ≥ 0.5 × SET NX EX", "claim only, synchronous_commit = off / SET NX EX everysec, 16 clients (≥ 0.5)"),
    ("completions HOT with 200 claims in flight, 100 B", "completions HOT, 200 claims in flight, 100 B (≥ 0.90)"),
    ("completions HOT with 200 claims in flight, 400 B", "completions HOT, 200 claims in flight, 400 B (≥ 0.90)"),
    ("completions HOT with 200 claims in flight, 2,048 B", "completions HOT, 200 claims in flight, 2 KB (≥ 0.90)"),
]
BEGIN, END = "<!-- per-version table: bench.py --summary -->", "<!-- end of per-version table -->"


def read_report(path):
    """The server version, the Targets rows (description -> (measured, verdict: spread.YES, NO or
    NOT_SHOWN)) and the load average over the run ((mean, min, max), None where the report has
    none) of a report. Reads both formats: the one before the spreads (`| target | measured |
    met |`, a bare figure, yes or **no**: judged as it was then) and the one with them (the
    measured cell `median (min-max)`, *not shown* too, and a load column)."""
    version, rows, load, section = None, {}, None, None
    with open(path) as f:
        for line in f:
            if line.startswith("Server: PostgreSQL "):
                version = line[len("Server: PostgreSQL "):].split(";")[0].strip()
            if line.startswith("## "):
                section = line[3:].strip()
            if load is None:
                load = spread.parse_load_header(line)
            if section != "Targets":
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 3 and cells[2] in spread.CELL_VERDICT:
                rows[cells[0]] = (cells[1], spread.CELL_VERDICT[cells[2]])
    return version, rows, load


def summary_cell(hit):
    """A cell of the per-version table: the measured ratio (`median (min-max)`, or the bare
    figure of a report without spreads), in bold if it missed its target, in italics and marked
    if its spread crossed it."""
    if hit is None:
        return ""
    measured, verdict = hit
    text = spread.measured_text(measured)
    if verdict == spread.NO:
        return f"**{text}**"
    if verdict == spread.NOT_SHOWN:
        return f"*{text}, not shown*"
    return text


README_BEGIN = "<!-- per-version targets: bench/bench.py --summary writes this table -->"
README_END = "<!-- end of per-version targets -->"


def write_summary(here=HERE, readme=os.path.join(HERE, "..", "README.md")):
    """Rewrites the per-version table in RESULTS.md from RESULTS.md and RESULTS-pgNN.md (in
    `here`), and its copy in `readme`."""
    reports = []
    for name in sorted(os.listdir(here)):
        if name == "RESULTS.md" or (name.startswith("RESULTS-pg") and name.endswith(".md")):
            version, rows, load = read_report(os.path.join(here, name))
            if version:
                reports.append((int(version.split(".")[0]), version, name, rows, load))
    reports.sort()
    main = os.path.join(here, "RESULTS.md")
    if not reports or not os.path.exists(main):
        return
    table = [BEGIN, "", "## Targets on every supported version", "",
             "The target ratios from the latest report of each version (`bench/run.sh --pg NN`; "
             "the full report of each is linked), each the median of its run's alternating rounds with "
             "their spread, `median (min-max)` (a bare figure was measured once, or comes from a report "
             "written before the spreads were recorded). A ratio that misses its target is in bold; one "
             "whose median meets it but whose spread crosses it is in italics, marked not shown "
             "(the rule: each report's header).", "",
             "| target | " + " | ".join(f"[{v}]({n})" for _, v, n, _, _ in reports) + " |",
             "|---|" + "---|" * len(reports)]
    for prefix, label in SUMMARY_TARGETS:
        cells = []
        for _, _, _, rows, _ in reports:
            hit = next((hit for d, hit in rows.items() if d.startswith(prefix)), None)
            cells.append(summary_cell(hit))
        table.append(f"| {label} | " + " | ".join(cells) + " |")
    # The machine's load during each run, where the report recorded it.
    if any(load for *_, load in reports):
        table.append("| load average during the run, 1-min mean (range) | " + " | ".join(
            "" if load is None else f"{load[0]:.2f} ({load[1]:.2f}-{load[2]:.2f})" for *_, load in reports) + " |")
    table += ["", END]
    with open(main) as f:
        text = f.read()
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + "\n".join(table) + text[text.index(END) + len(END):]
    else:
        at = text.find("\n## Throughput")
        text = (text[:at + 1] + "\n".join(table) + "\n" + text[at:]) if at >= 0 else text + "\n" + "\n".join(table) + "\n"
    with open(main, "w") as f:
        f.write(text)
    # The README's copy: the same rows, its links into bench/, between its own markers.
    if readme and os.path.exists(readme):
        with open(readme) as f:
            text = f.read()
        if README_BEGIN in text and README_END in text:
            rows = [line.replace("](RESULTS", "](bench/RESULTS") for line in table
                    if line.startswith("|")]
            text = (text[:text.index(README_BEGIN) + len(README_BEGIN)] + "\n" + "\n".join(rows) + "\n"
                    + text[text.index(README_END):])
            with open(readme, "w") as f:
                f.write(text)


def chart(pg, redis, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for ax in (a, b):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    series = {**pg, **redis}
    for name in sorted({k[0] for k in series}):
        xs = [c for c in CLIENTS if (name, c) in series]
        if len(xs) < 2:
            continue
        a.plot(xs, [series[(name, c)][0] for c in xs], marker="o", label=name)
        b.plot(xs, [series[(name, c)][1] for c in xs], marker="o", label=name)
    a.set(xlabel="clients", ylabel="transactions / s", title="throughput", xscale="log", yscale="log")
    b.set(xlabel="clients", ylabel="p99 latency (ms)", title="p99 latency", xscale="log", yscale="log")
    for ax in (a, b):
        ax.set_xticks(CLIENTS, [str(c) for c in CLIENTS])
        ax.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, png), dpi=110)


if __name__ == "__main__":
    main()
