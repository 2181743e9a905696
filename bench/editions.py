#!/usr/bin/env python3
"""The two editions side by side (docs/managed.md): the native edition (the library, preloaded)
and the portable edition (SQL and PL/pgSQL only, dist/idempotency-portable.sql), each in its own
database of one server, each against the bare statements in its own database. Writes
bench/RESULTS-editions.md (or --out NAME.md).

Run through `bench/run.sh --edition portable [--pg NN]` (it installs the prerequisites and a
release build of the native edition). Options:
  --seconds N   length of each pgbench run (default 5)
  --rounds N    alternating rounds per comparison (default 2)
  --quick       a smoke run: 1 s runs, 1 round (checks the harness, not targets)
  --script PATH the portable edition's script (default dist/idempotency-portable.sql)

What it measures, at 4 and 16 clients, in alternating rounds (the order reversed every other
round; tps are medians, a ratio the median of the rounds' ratios with their min-max, judged by
bench/spread.py's rule):
- claim + complete in one transaction against the floor (INSERT ... ON CONFLICT + UPDATE of a
  table of the store's shape): target >= 0.80 for the portable edition;
- the replay of a completed key against a primary-key SELECT of a row: target >= 0.80;
- canonical_hash of 1 KB and 100 KB documents, MB/s, and the portable edition's ratio to the
  native one;
- the ceiling of any edition written in PL/pgSQL under the same rules (SECURITY DEFINER, a
  pinned search_path): the floor's own statements, each wrapped in such a function and nothing
  else (bench/sql/wrapped_*.sql), against the floor, in the portable edition's database; and
  the benchmark's hand-written PL/pgSQL reference (bench/sql/reference.sql and
  reference_replay.sql) against the same floor.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from cluster import PG_BIN, Cluster  # noqa: E402

import psycopg  # noqa: E402

from bench import REQUEST, SERVER_SETTINGS, make_doc  # noqa: E402
import spread  # noqa: E402

EDITIONS = ["native", "portable"]
CLIENTS = [4, 16]
PGBENCH_ENV = dict(os.environ, PGOPTIONS="-c client_min_messages=error")
TARGET = 0.80  # the portable edition against the floor
# The load average of the whole run, sampled before and after each run.
LOAD = spread.LoadLog()
PAIRS = [
    ("claim + complete, one transaction", "ext_one_tx.sql", "floor: INSERT ON CONFLICT + UPDATE", "floor_write.sql"),
    ("replay", "ext_replay.sql", "floor: primary-key SELECT", "floor_read.sql"),
]
DOCS = [("1 KB", 1_000, 2000), ("100 KB", 100_000, 40)]
# (workload, the wrapped floor, the hand-written PL/pgSQL reference, the floor)
CEILINGS = [
    ("claim + complete, one transaction", "wrapped_write.sql", "reference.sql", "floor_write.sql"),
    ("replay", "wrapped_read.sql", "reference_replay.sql", "floor_read.sql"),
]
# The floor's statements in PL/pgSQL functions declared as the portable edition declares its
# own (SECURITY DEFINER, SET search_path), doing nothing else: what a call costs by itself.
WRAPPED = """
CREATE TYPE bench.read_result AS (response jsonb, response_status integer);
CREATE FUNCTION bench.wrapped_read(k text) RETURNS bench.read_result
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE r bench.read_result;
BEGIN
    SELECT f.response, f.response_status INTO r FROM bench.floor AS f
     WHERE f.scope OPERATOR(pg_catalog.=) '' AND f.key OPERATOR(pg_catalog.=) k;
    RETURN r;
END $fn$;
CREATE FUNCTION bench.wrapped_insert(k text, t bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
    INSERT INTO bench.floor (scope, key, request_hash, status, token, locked_until, expires_at, ttl)
    VALUES ('', k, pg_catalog.sha256('{"amount":100,"currency":"EUR"}'), 'in_progress', t,
            pg_catalog.now() OPERATOR(pg_catalog.+) interval '5 minutes',
            pg_catalog.now() OPERATOR(pg_catalog.+) interval '24 hours', interval '24 hours')
    ON CONFLICT (scope, key) DO NOTHING;
    RETURN t;
END $fn$;
CREATE FUNCTION bench.wrapped_update(k text) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
    UPDATE bench.floor AS f SET status = 'completed', response = '{"ok": true}', response_status = 200,
           completed_at = pg_catalog.now(), locked_until = NULL,
           expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) f.ttl
     WHERE f.scope OPERATOR(pg_catalog.=) '' AND f.key OPERATOR(pg_catalog.=) k;
END $fn$;
"""


def conninfo(cluster, db):
    return cluster.conninfo().replace(f"dbname={cluster.dbname}", f"dbname={db}")


def sql(cluster, db, statement, params=None):
    with psycopg.connect(conninfo(cluster, db), autocommit=True) as c:
        cur = c.execute(statement, params)
        return cur.fetchall() if cur.description else None


def pgbench(cluster, db, script, clients, seconds):
    out = subprocess.run(
        [f"{PG_BIN}/pgbench", "-h", cluster.dir, "-p", str(cluster.port), "-U", "postgres", "-n",
         "-c", str(clients), "-j", str(min(clients, 4)), "-T", str(seconds), "-M", "prepared",
         "-f", os.path.join(HERE, "sql", script), db],
        capture_output=True, text=True, env=PGBENCH_ENV)
    if out.returncode != 0:
        raise RuntimeError(f"pgbench {script} on {db} failed:\n{out.stdout}\n{out.stderr}")
    return next(float(line.split()[2]) for line in out.stdout.splitlines() if line.startswith("tps ="))


def install(cluster, edition, script):
    sql(cluster, cluster.dbname, f"CREATE DATABASE {edition}")
    if edition == "native":
        sql(cluster, edition, "CREATE EXTENSION idempotency")
    else:
        subprocess.run([f"{PG_BIN}/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", cluster.dir,
                        "-p", str(cluster.port), "-U", "postgres", "-d", edition,
                        "-f", script],
                       check=True, capture_output=True, env=PGBENCH_ENV)
        # The claim must be the portable edition's, not a library's.
        lang = sql(cluster, edition, "SELECT l.lanname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
                                     "WHERE p.oid = 'idempotency.claim(text, jsonb, text, interval, interval)'::regprocedure")[0][0]
        assert lang in ("sql", "plpgsql"), f"the portable claim is {lang}"
    with open(os.path.join(HERE, "sql", "setup.sql")) as f:
        sql(cluster, edition, f.read())
    sql(cluster, edition, f"""INSERT INTO idempotency.idempotency_keys
                               (key, request_hash, status, token, response, response_status, expires_at, ttl,
                                completed_at)
                             SELECT 'r' || i, idempotency.canonical_hash('{REQUEST}'), 'completed', i,
                                    '{{"ok": true}}', 200, now() + interval '1 day', interval '1 day', now()
                               FROM generate_series(1, 10000) i""")
    sql(cluster, edition, """INSERT INTO bench.floor (key, status, token, response, response_status, expires_at, ttl)
                             SELECT 'r' || i, 'completed', i, '{"ok": true}', 200, now() + interval '1 day',
                                    interval '1 day'
                               FROM generate_series(1, 10000) i""")
    # The hand-written reference's completed keys (it hashes the request's jsonb text).
    sql(cluster, edition, f"""INSERT INTO bench.ref_keys
                               (key, request_hash, status, token, response, response_status, expires_at, ttl,
                                completed_at)
                             SELECT 'r' || i, sha256(convert_to('{REQUEST}'::jsonb::text, 'UTF8')), 'completed', i,
                                    '{{"ok": true}}', 200, now() + interval '1 day', interval '1 day', now()
                               FROM generate_series(1, 10000) i""")
    if edition == "portable":
        sql(cluster, edition, WRAPPED)
    sql(cluster, edition, "VACUUM ANALYZE")


def throughput(cluster, args):
    """{(edition, label, clients): ([ext tps per round], [floor tps per round], [load samples])}:
    the rounds are kept, so the ratio of the two is taken round by round."""
    out = {}
    for clients in CLIENTS:
        for label, ext, _floor_label, floor in PAIRS:
            runs, load = {}, []
            variants = [(e, s) for e in EDITIONS for s in (ext, floor)]
            for r in range(args.rounds):
                for v in (variants if r % 2 == 0 else list(reversed(variants))):
                    runs.setdefault(v, []).append(
                        LOAD.around(lambda: pgbench(cluster, v[0], v[1], clients, args.seconds), load))
            for e in EDITIONS:
                out[(e, label, clients)] = (runs[(e, ext)], runs[(e, floor)], load)
            print(f"  {label}, {clients} clients: " + ", ".join(
                f"{e} {statistics.median(out[(e, label, clients)][0]):.0f} / floor "
                f"{statistics.median(out[(e, label, clients)][1]):.0f} ({ratio(out[(e, label, clients)]).cell()})"
                for e in EDITIONS), flush=True)
    return out


def ratio(cell):
    """The extension's tps over the floor's, round by round, of a throughput() cell."""
    return spread.Ratio.of(cell[0], cell[1], cell[2])


def ceiling(cluster, args):
    """{(label, clients): ([wrapped tps per round], [reference tps per round], [floor tps per
    round], [load samples])}, in the portable edition's database."""
    out = {}
    for clients in CLIENTS:
        for label, wrapped, reference, floor in CEILINGS:
            runs, load = {}, []
            order = [wrapped, reference, floor]
            for r in range(args.rounds):
                for s in (order if r % 2 == 0 else list(reversed(order))):
                    runs.setdefault(s, []).append(
                        LOAD.around(lambda: pgbench(cluster, "portable", s, clients, args.seconds), load))
            out[(label, clients)] = tuple(runs[s] for s in order) + (load,)
            w, ref, f = (statistics.median(runs[s]) for s in order)
            print(f"  ceiling {label}, {clients} clients: wrapped {w:.0f} / reference {ref:.0f} / floor {f:.0f}",
                  flush=True)
    return out


def hashing(cluster, args):
    """{(edition, label): best MB/s of canonical_hash} and {label: spread.Ratio of the portable
    edition's MB/s over the native one's, round by round}"""
    out, ratios = {}, {}
    for label, size, copies in DOCS:
        doc = make_doc(size)
        for e in EDITIONS:
            sql(cluster, e, "DELETE FROM bench.docs")
            sql(cluster, e, "INSERT INTO bench.docs SELECT %s, (%s::jsonb || jsonb_build_object('copy', i)) "
                            "FROM generate_series(1, %s) i", (label, doc, copies))
        nbytes = sql(cluster, "native", "SELECT sum(length(doc::text)) FROM bench.docs")[0][0]
        same = [sql(cluster, e, "SELECT md5(string_agg(idempotency.canonical_hash(doc)::text, ',' ORDER BY doc::text)) "
                                "FROM bench.docs")[0][0] for e in EDITIONS]
        assert same[0] == same[1], f"the editions hash the {label} documents differently"
        rates = {e: [] for e in EDITIONS}
        load = []
        for r in range(max(args.rounds, 3)):
            for e in (EDITIONS if r % 2 == 0 else list(reversed(EDITIONS))):
                started = time.monotonic()
                LOAD.around(lambda: sql(cluster, e, "SELECT count(idempotency.canonical_hash(doc)) FROM bench.docs"),
                            load)
                rates[e].append(nbytes / (time.monotonic() - started) / 1e6)
        for e in EDITIONS:
            out[(e, label)] = max(rates[e])
        ratios[label] = spread.Ratio.of(rates["portable"], rates["native"], load)
        print(f"  canonical_hash {label}: " + ", ".join(f"{e} {out[(e, label)]:.1f} MB/s" for e in EDITIONS),
              flush=True)
    return out, ratios


def write(path, args, version, tput, hashes, ceil, hash_ratios):
    lines = [
        "# The two editions side by side",
        "",
        f"`bench/run.sh --edition portable` on PostgreSQL {version}: one server (fsync on, synchronous_commit",
        "on, shared_buffers 256MB, the native library preloaded), the native edition and the portable one",
        "(dist/idempotency-portable.sql) each in its own database with its own floor table; pgbench",
        f"`-M prepared`, {args.seconds} s runs, {args.rounds} alternating rounds (tps: medians); on a shared 2-core",
        "machine: read the ratios, not the absolute figures.",
        "",
        spread.rule_text() + (" This run had one round per comparison, so no ratio has a spread."
                              if args.rounds < 2 else ""),
        "",
        spread.load_header(LOAD.samples),
        "",
        "| workload | clients | native (tps) | native / floor | portable (tps) | portable / floor | target | met "
        "| load average, mean (min-max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, _ext, floor_label, _floor in PAIRS:
        for clients in CLIENTS:
            native, portable = tput[("native", label, clients)], tput[("portable", label, clients)]
            r = ratio(portable)
            lines.append(f"| {label} (vs {floor_label}) | {clients} | {statistics.median(native[0]):.0f} | "
                         f"{ratio(native).cell()} | {statistics.median(portable[0]):.0f} | {r.cell()} | "
                         f"portable ≥ {TARGET:.2f} | {spread.met_cell(spread.judge(r, '≥', TARGET))} | "
                         f"{spread.load_cell(r.load)} |")
    lines += [
        "",
        "The ceiling of any edition in PL/pgSQL under the same rules: the floor's own statements, each",
        "in a PL/pgSQL function declared as the portable edition declares its own (SECURITY DEFINER,",
        "`SET search_path = pg_catalog, pg_temp`) and doing nothing else (bench/sql/wrapped_*.sql),",
        "against the floor, in the portable edition's database, same runs; beside it the benchmark's",
        "hand-written PL/pgSQL reference (bench/sql/setup.sql: INSERT ... ON CONFLICT, then the row",
        "read FOR UPDATE; the request's jsonb text hashed, no scope binding, no canonical form, a plain",
        "function), what a team without the extension would run on a managed service:",
        "",
        "| workload | clients | floor (tps) | wrapped floor / floor | hand-written PL/pgSQL / floor | portable / floor (table above) |",
        "|---|---|---|---|---|---|",
    ]
    for label, _wrapped, _reference, _floor in CEILINGS:
        for clients in CLIENTS:
            w, ref, f, load = ceil[(label, clients)]
            lines.append(f"| {label} | {clients} | {statistics.median(f):.0f} | "
                         f"{spread.Ratio.of(w, f, load).cell()} | {spread.Ratio.of(ref, f, load).cell()} | "
                         f"{ratio(tput[('portable', label, clients)]).cell()} |")
    lines += ["", "canonical_hash: the best of the runs of each edition; the ratio round by round "
              "(median, min-max).", "",
              "| canonical_hash | native (MB/s) | portable (MB/s) | portable / native |", "|---|---|---|---|"]
    for label, _size, _copies in DOCS:
        n, p = hashes[("native", label)], hashes[("portable", label)]
        lines.append(f"| {label} documents | {n:.1f} | {p:.1f} | {hash_ratios[label].cell()} |")
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="RESULTS-editions")
    ap.add_argument("--script", default=os.path.join(ROOT, "dist", "idempotency-portable.sql"))
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.rounds = 1, 1
    cluster = Cluster(settings=SERVER_SETTINGS, dbname="bench").start()
    try:
        for e in EDITIONS:
            install(cluster, e, args.script)
        version = sql(cluster, "native", "SHOW server_version")[0][0]
        tput = throughput(cluster, args)
        ceil = ceiling(cluster, args)
        hashes, hash_ratios = hashing(cluster, args)
        write(os.path.join(HERE, f"{args.out}.md"), args, version, tput, hashes, ceil, hash_ratios)
    finally:
        cluster.destroy()


if __name__ == "__main__":
    main()
