#!/usr/bin/env python3
"""HOT completions with many claims in flight.

8 sessions claim keys (autocommitted, with a lease) and complete each one in a later
transaction once `--in-flight` claims in all (spread over the sessions) are waiting, the way a
queue consumer holding many leased messages or a webhook handler with slow side effects does.
For each response size (0: claims only, never completed, the
deduplication-only use) it reports the share of the store's updates that were HOT
(`n_tup_hot_upd / n_tup_upd` of pg_stat_user_tables), the WAL written per claim+complete (the
LSN's advance over the run, after a checkpoint), claim+complete pairs per second, and the
store's size per row (heap, TOAST, indexes). The HOT ratio, the WAL and the size do not depend
on the machine's load; the rate does.

Usage (the extension installed for the server of PG_BIN; bench/run.sh --hot-in-flight runs it):
  PG_BIN=... python3 bench/hot_in_flight.py [--sizes 100,400,2048,0] [--in-flight 200]
      [--sessions 8] [--pairs 2000] [--fillfactor N] [--out FILE.md]
--fillfactor N sets the store's fill factor first (ALTER TABLE ... SET (fillfactor = N)), to
compare with the installed default; --pairs is per session.
"""

import argparse
import collections
import json
import os
import random
import string
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
from cluster import Cluster  # noqa: E402

import psycopg  # noqa: E402
from psycopg.types.json import Jsonb  # noqa: E402

REQUEST = {"amount": 100, "currency": "EUR"}
TARGET = 0.90


def response(size, rng):
    """A JSON response of about `size` bytes of text: a few fields and a body of random
    alphanumerics (which compress little, like the ids and tokens of real responses)."""
    doc = {"id": "msg_" + "".join(rng.choices(string.hexdigits.lower(), k=16)), "status": "sent",
           "provider": "smtp", "queued_at": "2026-11-30T21:00:00Z", "body": ""}
    pad = size - len(json.dumps(doc))
    doc["body"] = "".join(rng.choices(string.ascii_letters + string.digits, k=max(0, pad)))
    return doc


def session(conninfo, sid, per_session, in_flight, size, barrier, errors):
    rng = random.Random(sid)
    try:
        with psycopg.connect(conninfo, autocommit=True) as c:
            claim = c.cursor()
            pending = collections.deque()
            barrier.wait()
            for i in range(per_session + in_flight):
                if i < per_session:
                    key = f"f{size}-{sid}-{i}"
                    token = claim.execute(
                        "SELECT token FROM idempotency.claim(%s, %s, lease => '5 minutes')",
                        (key, Jsonb(REQUEST)), prepare=True).fetchone()[0]
                    pending.append((key, token))
                if size == 0:  # claim-only deduplication: no completions
                    pending.clear()
                if len(pending) > in_flight or (i >= per_session and pending):
                    key, token = pending.popleft()
                    c.execute("SELECT idempotency.complete(%s, %s, token => %s)",
                              (key, Jsonb(response(size, rng)), token), prepare=True)
    except Exception as e:  # reported by the caller
        errors.append(e)


def counters(c):
    c.execute("SELECT pg_stat_clear_snapshot()")
    return c.execute("""SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
                         WHERE relid = 'idempotency.idempotency_keys'::regclass""").fetchone()


def run(cluster, size, args):
    conninfo = cluster.conninfo()
    with psycopg.connect(conninfo, autocommit=True) as c:
        c.execute("TRUNCATE idempotency.idempotency_keys")
        c.execute("CHECKPOINT")
        upd0, hot0 = counters(c)
        lsn0 = c.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        per_session_in_flight = max(1, args.in_flight // args.sessions)
        barrier = threading.Barrier(args.sessions + 1)
        errors = []
        threads = [threading.Thread(target=session, args=(conninfo, s, args.pairs, per_session_in_flight,
                                                         size, barrier, errors))
                   for s in range(args.sessions)]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.monotonic()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        if errors:
            raise errors[0]
        lsn1 = c.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        wal = c.execute("SELECT pg_wal_lsn_diff(%s, %s)", (lsn1, lsn0)).fetchone()[0]
        # The sessions' statistics are flushed as they exit.
        for _ in range(100):
            if c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                         "AND backend_type = 'client backend' AND pid <> pg_backend_pid()").fetchone()[0] == 0:
                break
            time.sleep(0.05)
        upd1, hot1 = counters(c)
        pairs = args.pairs * args.sessions
        done = c.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE status = %s",
                         ("completed" if size else "in_progress",)).fetchone()[0]
        assert done == pairs, (done, pairs)
        heap, toast, indexes = c.execute(
            """SELECT pg_relation_size(c.oid), coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0),
                      pg_indexes_size(c.oid)
                 FROM pg_class c WHERE c.oid = 'idempotency.idempotency_keys'::regclass""").fetchone()
        ff = c.execute("""SELECT coalesce((SELECT option_value FROM pg_options_to_table(reloptions)
                                            WHERE option_name = 'fillfactor'), '100')
                            FROM pg_class WHERE oid = 'idempotency.idempotency_keys'::regclass""").fetchone()[0]
    updates, hot = upd1 - upd0, hot1 - hot0
    return {"size": size, "fillfactor": ff, "updates": updates, "hot": hot,
            "ratio": hot / updates if updates else float("nan"), "wal": wal / pairs,
            "rate": pairs / elapsed, "heap": heap / pairs, "toast": toast / pairs, "indexes": indexes / pairs,
            "pairs": pairs}


def measure(cluster, sizes, sessions=8, in_flight=200, pairs=2000):
    """The in-flight case on `cluster` (it empties the store) for each response size:
    {"results": [...], "args": ...} for table()."""
    args = argparse.Namespace(sessions=sessions, in_flight=in_flight, pairs=pairs)
    return {"results": [run(cluster, size, args) for size in sizes], "args": args}


def table(results, args):
    lines = [f"{args.sessions} sessions, {args.in_flight} claims in flight in all "
             f"({max(1, args.in_flight // args.sessions)} per session), {args.pairs * args.sessions:,} "
             "claim+complete pairs per response size, each claim autocommitted with a lease and completed "
             "in a later transaction.", "",
             "| response | fillfactor | updates | HOT | HOT ratio (≥ 0.90) | WAL bytes per pair | pairs/s "
             "| heap bytes per row | TOAST bytes per row | index bytes per row |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] >= TARGET else f"**{r['ratio']:.3f}**"
        if r["size"] == 0:
            lines.append(f"| claims only | {r['fillfactor']} | | | | {r['wal']:,.0f} | {r['rate']:,.0f} "
                         f"| {r['heap']:,.0f} | {r['toast']:,.0f} | {r['indexes']:,.0f} |")
            continue
        lines.append(f"| {r['size']:,} B | {r['fillfactor']} | {r['updates']:,} | {r['hot']:,} | {ratio} "
                     f"| {r['wal']:,.0f} | {r['rate']:,.0f} | {r['heap']:,.0f} | {r['toast']:,.0f} "
                     f"| {r['indexes']:,.0f} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100,400,2048,0")
    p.add_argument("--in-flight", type=int, default=200)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--fillfactor", type=int)
    p.add_argument("--toast-tuple-target", type=int)
    p.add_argument("--out")
    args = p.parse_args()
    cluster = Cluster(settings={"shared_buffers": "256MB", "fsync": "on", "max_wal_size": "4GB",
                                "checkpoint_timeout": "30min"}).start()
    try:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
            c.execute("CREATE EXTENSION idempotency")
            if args.fillfactor:
                c.execute(f"ALTER TABLE idempotency.idempotency_keys SET (fillfactor = {int(args.fillfactor)})")
            if args.toast_tuple_target:
                c.execute("ALTER TABLE idempotency.idempotency_keys SET (toast_tuple_target = "
                          f"{int(args.toast_tuple_target)})")
            server = c.execute("SHOW server_version").fetchone()[0]
        results = []
        for size in (int(s) for s in args.sizes.split(",")):
            r = run(cluster, size, args)
            print(f"{size} B: HOT {r['ratio']:.3f} ({r['hot']}/{r['updates']}), WAL {r['wal']:.0f} B/pair, "
                  f"{r['rate']:.0f} pairs/s, heap {r['heap']:.0f} B/row, toast {r['toast']:.0f}, "
                  f"indexes {r['indexes']:.0f}", flush=True)
            results.append(r)
        text = f"PostgreSQL {server}.\n\n" + table(results, args)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        return 0 if all(r["ratio"] >= TARGET for r in results if r["size"]) else 1
    finally:
        cluster.destroy()


if __name__ == "__main__":
    sys.exit(main())
