#!/usr/bin/env python3
"""The extension through a connection pooler: PgBouncer in transaction mode in front of the
benchmark server, each workload against the floor through the same pooler, beside the same
pairs direct (no pooler) in the same rounds. Writes bench/RESULTS-pooler.md (or --out NAME.md).

Run through `bench/run.sh --pooler [--pg NN]` (it installs the prerequisites, PgBouncer among
them, and a release build). Options:
  --seconds N       length of each pgbench run (default 8)
  --rounds N        alternating rounds per comparison (default 5)
  --pool-size N     PgBouncer's default_pool_size, server connections of the pool (default 8)
  --protocols LIST  pgbench's query protocols, comma-separated: simple (pgbench's default),
                    extended (unnamed statements, what most drivers send) or both (the default)
  --package DIR     the tree `cargo pgrx package` wrote (default target/release/idempotency-pgNN),
                    whose library and SQL a private copy of the server gets
  --quick           a smoke run: 1 s runs, 1 round (checks the harness, not targets; the report
                    says so in its first lines)

What it measures, at 4 and 16 clients:
- claim + complete in one transaction (bench/sql/ext_one_tx.sql) against the floor's
  INSERT ... ON CONFLICT + UPDATE of a table of the store's shape (floor_write.sql);
- the replay of a completed key (ext_replay.sql) against a primary-key SELECT (floor_read.sql).
Each round runs the four variants (direct extension, direct floor, pooled extension, pooled
floor), in the reverse order every other round; each round's ratio is the extension's tps over
the floor's of the same route in that round, and the report gives the median of these ratios with
their minimum and maximum. Target: the extension through the pooler >= 0.95 of the floor through
the same pooler, judged by bench/spread.py's rule (yes, no, or not shown when the median meets it
but the spread crosses it). The load average is sampled before and after each run.

`-M prepared` is not measured: named prepared statements live in one server connection, and a
transaction pooler hands the next transaction to any of its connections (PgBouncer 1.18 cannot
track them).
"""

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
from cluster import PG_BIN, Cluster  # noqa: E402


def _integration_pooler():
    # tests/integration/pooler.py by its path: this file is also named pooler, and whichever of
    # the two comes first on sys.path would answer to `import pooler`.
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "integration_pooler", os.path.join(HERE, "..", "tests", "integration", "pooler.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_pooler = _integration_pooler()
PGBOUNCER, PgBouncer = _pooler.PGBOUNCER, _pooler.PgBouncer

from bench import REQUEST, SERVER_SETTINGS, populate_replay_keys, sql  # noqa: E402
import spread  # noqa: E402

CLIENTS = [4, 16]
ROUTES = ["direct", "pooler"]
# (label, the extension's script, the floor's label, the floor's script). Reads first, as in
# bench.py: the write runs grow both tables, and a bigger index is a slower lookup.
PAIRS = [
    ("replay", "ext_replay.sql", "primary-key SELECT", "floor_read.sql"),
    ("claim + complete, one transaction", "ext_one_tx.sql", "INSERT ON CONFLICT + UPDATE", "floor_write.sql"),
]
TARGET = 0.95
# The load average of the whole run, sampled before and after each run.
LOAD = spread.LoadLog()


def pgbench(host, port, dbname, script, clients, seconds, protocol):
    """tps of one pgbench run of bench/sql/`script` against host:port (a socket directory)."""
    out = subprocess.run(
        [f"{PG_BIN}/pgbench", "-h", host, "-p", str(port), "-U", "postgres", "-n",
         "-c", str(clients), "-j", str(min(clients, 4)), "-T", str(seconds), "-M", protocol,
         "-f", os.path.join(HERE, "sql", script), dbname],
        capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"pgbench {script} -M {protocol} on {host}:{port} failed:\n{out.stdout}\n{out.stderr}")
    return next(float(line.split()[2]) for line in out.stdout.splitlines() if line.startswith("tps ="))


def endpoints(cluster, bouncer):
    # Both routes through Unix sockets, so the pooler's hop is the only difference between
    # them (the tests' PgBouncer also listens there; its TCP port would add loopback TCP too).
    return {"direct": (cluster.dir, cluster.port), "pooler": (bouncer.dir, bouncer.port)}


def measure(cluster, bouncer, args):
    """{(label, protocol, clients, route): ([ext tps per round], [floor tps per round], [load
    average samples around the runs of that route's pair])}"""
    ends = endpoints(cluster, bouncer)
    out = {}
    for label, ext, _floor_label, floor in PAIRS:
        for protocol in args.protocols:
            for clients in CLIENTS:
                variants = [(route, script) for route in ROUTES for script in (ext, floor)]
                runs = {v: [] for v in variants}
                loads = {route: [] for route in ROUTES}
                for r in range(args.rounds):
                    for v in (variants if r % 2 == 0 else list(reversed(variants))):
                        host, port = ends[v[0]]
                        runs[v].append(LOAD.around(
                            lambda: pgbench(host, port, cluster.dbname, v[1], clients, args.seconds, protocol),
                            loads[v[0]]))
                for route in ROUTES:
                    out[(label, protocol, clients, route)] = (runs[(route, ext)], runs[(route, floor)], loads[route])
                print(f"  {label}, -M {protocol}, {clients} clients: " + ", ".join(
                    f"{route} {statistics.median(out[(label, protocol, clients, route)][0]):.0f} / floor "
                    f"{statistics.median(out[(label, protocol, clients, route)][1]):.0f} "
                    f"({fmt_ratio(out[(label, protocol, clients, route)])})" for route in ROUTES), flush=True)
    return out


def ratio(cell):
    """The first side's tps over the second's, round by round (a spread.Ratio), with the load
    samples of the cell if it has them."""
    return spread.Ratio.of(cell[0], cell[1], cell[2] if len(cell) > 2 else ())


def fmt_ratio(cell):
    return ratio(cell).cell()


def start_pooler(cluster, pool_size):
    """PgBouncer in transaction mode in front of `cluster`, its standard error drained if it is a
    pipe: PgBouncer logs every login there as well as to its file, and once a few hundred
    benchmark connections have filled a pipe nobody reads, PgBouncer blocks on its next log line,
    with every client (a run waited 11 minutes so)."""
    bouncer = PgBouncer(cluster, "transaction", pool_size=pool_size)
    bouncer.start()
    err = bouncer.proc.stderr
    if err is not None:
        threading.Thread(target=lambda: [None for _ in iter(lambda: err.read(65536), b"")], daemon=True).start()
    # bouncer.proc is runuser; PgBouncer is its child, which stop_pooler makes sure is gone.
    try:
        with open(f"/proc/{bouncer.proc.pid}/task/{bouncer.proc.pid}/children") as f:
            bouncer.children = [int(p) for p in f.read().split()]
    except OSError:
        bouncer.children = []
    return bouncer


def stop_pooler(bouncer):
    bouncer.stop()
    for pid in bouncer.children:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"pgbouncer" not in f.read():
                        break  # gone, and the pid taken by another process
                os.kill(pid, sig)
            except (OSError, ProcessLookupError):
                break
            time.sleep(2)


def check_pooled(bouncer, dbname):
    """The extension answers through the pooler: a completed key replays, asked with its
    arguments in the statement's text and as parameters of an unnamed statement."""
    import psycopg
    with psycopg.connect(f"host={bouncer.dir} port={bouncer.port} user=postgres dbname={dbname}",
                         autocommit=True) as c:
        simple = c.execute(f"SELECT outcome FROM idempotency.claim('r1', '{REQUEST}')").fetchone()[0]
        extended = c.execute("SELECT outcome FROM idempotency.claim(%s, %s::jsonb)", ("r2", REQUEST),
                             prepare=False).fetchone()[0]
    assert (simple, extended) == ("replay", "replay"), f"through the pooler: {simple}, {extended}"


def versions(cluster):
    pg = sql(cluster, "SHOW server_version")[0][0]
    bouncer = subprocess.run([PGBOUNCER, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    pgbench = subprocess.run([f"{PG_BIN}/pgbench", "--version"], capture_output=True, text=True).stdout.split()
    return pg, bouncer, f"pgbench {pgbench[2] if len(pgbench) > 2 else '?'}"


def pg_config(bin_dir, flag):
    return subprocess.run([f"{bin_dir}/pg_config", flag], capture_output=True, text=True,
                          check=True).stdout.strip()


def package_files(package):
    """(the library, [the extension's control and SQL files]) of `cargo pgrx package`'s tree for
    the server of PG_BIN (bench/run.sh --pooler makes it): a release build and the SQL generated
    from the same sources."""
    src_bin = os.path.realpath(PG_BIN)
    root = os.path.join(package, pg_config(src_bin, "--pkglibdir").lstrip("/"))
    ext = os.path.join(package, pg_config(src_bin, "--sharedir").lstrip("/"), "extension")
    if not os.path.exists(os.path.join(root, "idempotency.so")) or not os.path.isdir(ext):
        raise RuntimeError(f"no package of the extension in {package}: run `cargo pgrx package` "
                           "(bench/run.sh --pooler does)")
    return os.path.join(root, "idempotency.so"), [
        os.path.join(ext, f) for f in sorted(os.listdir(ext)) if f.startswith("idempotency")]


def private_server(tmp, package):
    """A copy of the server of PG_BIN in `tmp` with the package's library and extension files
    instead of the system's: its bin directory.

    The system's directories are shared with other builds of this tree, which install their
    own there (a debug build, or newer SQL, or no library for a moment while they replace it): a
    backend that looks the library up while it is missing fails, a server started after a debug
    install runs the debug build, and SQL newer than the library names functions it lacks.
    PostgreSQL finds its lib and share directories relative to its binaries, so the copy keeps
    the source's layout (as scripts/pg-portable.sh does)."""
    library, ext_files = package_files(package)
    src_bin = os.path.realpath(PG_BIN)
    src_lib, src_share = pg_config(src_bin, "--pkglibdir"), pg_config(src_bin, "--sharedir")
    prefix = os.path.dirname(src_bin)
    if os.path.commonpath([prefix, src_share]) == prefix:  # one prefix (a relocatable build)
        copies = [(prefix, os.path.join(tmp, "server"))]
        bin_dir = os.path.join(tmp, "server", "bin")
    else:  # Debian's: /usr/lib/postgresql/NN (bin, lib) and /usr/share/postgresql/NN
        major = os.path.basename(prefix)
        copies = [(prefix, os.path.join(tmp, "lib", "postgresql", major)),
                  (src_share, os.path.join(tmp, "share", "postgresql", major))]
        bin_dir = os.path.join(tmp, "lib", "postgresql", major, "bin")
    for src, dst in copies:
        shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("idempotency*"))
    lib, share = pg_config(bin_dir, "--pkglibdir"), pg_config(bin_dir, "--sharedir")
    if lib == src_lib or share == src_share:
        raise RuntimeError(f"the copy of the server in {tmp} finds the system's files, not its own")
    shutil.copy2(library, os.path.join(lib, "idempotency.so"))
    for f in ext_files:
        shutil.copy2(f, os.path.join(share, "extension"))
    subprocess.run(["chmod", "-R", "a+rX", tmp], check=True)
    return bin_dir


def default_package():
    major = pg_config(os.path.realpath(PG_BIN), "--version").split()[1].split(".")[0]
    return os.path.join(HERE, "..", "target", "release", f"idempotency-pg{major}")


def build_info(package):
    """What the benchmark runs: the packaged library's sha256 and time, and the tree it came from."""
    import hashlib
    library, _ = package_files(package)
    with open(library, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    built = time.strftime("%Y-%m-%d %H:%M", time.gmtime(os.path.getmtime(library)))

    def git(*a):
        return subprocess.run(["git", "-C", os.path.join(HERE, ".."), *a], capture_output=True,
                              text=True).stdout.strip()
    # The tree is shared with work in progress: say what of it differed from the commit as the
    # benchmark started (the build just before it compiled the tree as it was).
    dirty = [line.split(None, 1)[1] for line in git("status", "--porcelain", "--", "src", "sql", "crates", "Cargo.toml",
                                      "Cargo.lock").splitlines()]
    return f"{digest}, built {built} UTC from {git('rev-parse', '--short', 'HEAD')}" + (
        f"; uncommitted changes in the tree when the run started: {', '.join(dirty)}" if dirty else
        ", no uncommitted changes in src/, sql/ or crates/")


def write(path, args, vers, res, load_before, pools, started, took, build):
    pg, bouncer, pgbench_version = vers
    lines = ["# Through a connection pooler", ""]
    if args.quick:
        lines += ["**A `--quick` smoke run (1 s runs, 1 round): it checks the harness, it does not measure.",
                  "Do not read the figures below as results.**", ""]
    def para(text):
        return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False).splitlines() + [""]
    lines += para(
        f"`bench/run.sh --pooler` on PostgreSQL {pg}, {bouncer}, {pgbench_version}; started {started} UTC, "
        f"{max(1, round(took / 60))} min. The release build of `cargo pgrx package` (idempotency.so "
        f"sha256 {build}), in a private copy of the server's installation. One server (fsync on, synchronous_commit on, "
        "shared_buffers 256MB, the library preloaded, `client_min_messages = error` for the benchmark's "
        f"database); PgBouncer in `pool_mode = transaction`, `default_pool_size = {args.pool_size}` (server "
        "connections for the one database and user), `auth_type = trust`, in front of it "
        "(tests/integration/pooler.py). pgbench connects through Unix sockets on both routes: directly to "
        "the server's, or to PgBouncer's, which reaches the server through its socket.")
    lines += para(
        f"{args.seconds} s runs, {args.rounds} round{'s' if args.rounds > 1 else ''}; each round runs the "
        "four variants of a row (direct extension, direct floor, pooled extension, pooled floor), in the "
        "reverse order every other round; a round's ratio is the extension's tps over the floor's on the "
        "same route in that round, and tps are medians over the rounds. `-M prepared` is not run: a "
        "transaction pooler cannot serve named prepared statements."
        + (" This run had one round, so no ratio has a spread." if args.rounds < 2 else ""))
    lines += para(spread.rule_text())
    lines += para(
        f"Load average (1 minute) of this shared 2-core machine before the first run: {load_before:.2f}. "
        + spread.load_header(LOAD.samples) + " Read the ratios, not the absolute figures.")
    lines += [
        "| workload (against the floor) | protocol | clients | route | extension (tps) | floor (tps) | "
        "extension / floor, median (min-max) | target | met | load average, mean (min-max) |",
        "|---|---|---|---|---:|---:|---|---|---|---|",
    ]
    for label, _ext, floor_label, _floor in PAIRS:
        for protocol in args.protocols:
            for clients in CLIENTS:
                for route in ROUTES:
                    cell = res[(label, protocol, clients, route)]
                    r = ratio(cell)
                    target = met = ""
                    if route == "pooler":
                        target = f"≥ {TARGET:.2f}"
                        met = spread.met_cell(spread.judge(r, "≥", TARGET))
                    lines.append(f"| {label} ({floor_label}) | {protocol} | {clients} | {route} | "
                                 f"{statistics.median(cell[0]):.0f} | {statistics.median(cell[1]):.0f} | "
                                 f"{r.cell()} | {target} | {met} | {spread.load_cell(r.load)} |")
    lines += [
        "",
        "What the pooler costs each side: pooled tps over direct tps of the same side, medians over",
        "the rounds' ratios (min-max).",
        "",
        "| workload | protocol | clients | extension pooled / direct | floor pooled / direct |",
        "|---|---|---|---|---|",
    ]
    for label, _ext, _floor_label, _floor in PAIRS:
        for protocol in args.protocols:
            for clients in CLIENTS:
                d = res[(label, protocol, clients, "direct")]
                p = res[(label, protocol, clients, "pooler")]
                lines.append(f"| {label} | {protocol} | {clients} | {fmt_ratio((p[0], d[0]))} | "
                             f"{fmt_ratio((p[1], d[1]))} |")
    lines += ["", f"PgBouncer's pool at the end (SHOW POOLS): {pools}.", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool-size", type=int, default=8)
    ap.add_argument("--protocols", default="simple,extended")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="RESULTS-pooler")
    ap.add_argument("--package", help="cargo pgrx package's tree (default target/release/idempotency-pgNN)")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.rounds = 1, 1
    args.protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    if not args.protocols or any(p not in ("simple", "extended") for p in args.protocols):
        ap.error("--protocols takes simple and/or extended (a transaction pooler cannot serve prepared)")
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    t0 = time.monotonic()
    load_before = spread.loadavg()
    if args.package is None:
        args.package = default_package()
    build = build_info(args.package)
    tmp = tempfile.mkdtemp(prefix="idempotency-pooler-server-")
    cluster = bouncer = None
    try:
        cluster = Cluster(settings=SERVER_SETTINGS, dbname="bench", bin=private_server(tmp, args.package)).start()
        sql(cluster, "CREATE EXTENSION idempotency")
        with open(os.path.join(HERE, "sql", "setup.sql")) as f:
            sql(cluster, f.read())
        populate_replay_keys(cluster)
        # The other harnesses pass this in PGOPTIONS; PgBouncer refuses the `options` startup
        # parameter, so it is the database's setting here, for both routes alike.
        sql(cluster, f"ALTER DATABASE {cluster.dbname} SET client_min_messages = error")
        bouncer = start_pooler(cluster, args.pool_size)
        check_pooled(bouncer, cluster.dbname)
        vers = versions(cluster)
        print(f"PostgreSQL {vers[0]}, {vers[1]}, pool_mode transaction, default_pool_size {args.pool_size}",
              flush=True)
        # One short run per route first: the pool opens its server connections, and the first
        # measured round does not pay for them.
        for host, port in endpoints(cluster, bouncer).values():
            pgbench(host, port, cluster.dbname, "select_one.sql", max(CLIENTS), 1, "simple")
        res = measure(cluster, bouncer, args)
        pools = ", ".join(f"{k} {v}" for k, v in pool_state(bouncer, cluster.dbname).items())
    finally:
        if bouncer is not None:
            stop_pooler(bouncer)
        if cluster is not None:
            cluster.destroy()
        shutil.rmtree(tmp, ignore_errors=True)
    write(os.path.join(HERE, f"{args.out}.md"), args, vers, res, load_before, pools, started,
          time.monotonic() - t0, build)


def pool_state(bouncer, dbname):
    """The server connections of the benchmark's pool as PgBouncer reports them."""
    import psycopg
    with psycopg.connect(f"host=127.0.0.1 port={bouncer.port} dbname=pgbouncer user=postgres",
                         autocommit=True) as c:
        cur = c.execute("SHOW POOLS", prepare=False)
        names = [d.name for d in cur.description]
        for row in cur.fetchall():
            r = dict(zip(names, row))
            if r["database"] == dbname:
                return {k: r[k] for k in ("pool_mode", "sv_active", "sv_idle", "sv_used", "maxwait") if k in r}
    return {}


if __name__ == "__main__":
    main()
