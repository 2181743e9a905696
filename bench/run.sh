#!/usr/bin/env bash
# One command for the benchmarks: installs the prerequisites (the test ones plus redis-server and
# matplotlib), builds and installs a release build of the extension, and runs bench/bench.py,
# which starts its own cluster and Redis servers and writes bench/RESULTS.md and the chart.
# Takes about 20 minutes with the defaults; pass --quick for a smoke run of the harness.
# --pg NN benchmarks PostgreSQL NN (15, the default, 16, 17, 18: scripts/pg-server.sh) and
# writes bench/RESULTS-pgNN.md instead; the per-version runs of bench/RESULTS.md's table pass
# --no-redis --no-scale too (docs/benchmarks.md). --hot-in-flight runs only the case of
# completions with 200 claims in flight (bench/hot_in_flight.py, a few minutes; its own options,
# e.g. --fillfactor 90, follow), which a full run includes. --edition portable runs
# bench/editions.py instead: the native and the portable edition side by side in one server
# (claim + complete and replay against the floor, canonical_hash), written to
# bench/RESULTS-editions[-pgNN].md; with --instructions too, bench/instructions.py counts the
# instructions per transaction of each under callgrind instead (a few minutes; written to
# bench/INSTRUCTIONS-editions[-pgNN].md). --profile runs bench/profile.py instead: claim-only
# deduplication against Redis SET NX EX at equal durability, CPU per operation of each server
# and a perf profile of PostgreSQL's (a few minutes), written to bench/PROFILE[-pgNN].md.
# --pooler runs bench/pooler.py instead: claim + complete and replay, each against the floor,
# through PgBouncer in transaction mode (pgbench's simple and extended protocols, not prepared,
# at 4 and 16 clients) beside the same pairs direct, in alternating rounds (about 25 minutes;
# --quick for a smoke run), written to bench/RESULTS-pooler[-pgNN].md.
# Other options go to the script that runs.
set -euo pipefail
cd "$(dirname "$0")/.."
pg=15
edition=native
args=()
in_flight=
profile=
instructions=
pooler=
while (($#)); do
    case "$1" in
        --pg) pg=$2; shift 2 ;;
        --edition) edition=$2; shift 2 ;;
        --hot-in-flight) in_flight=1; shift ;;
        --profile) profile=1; shift ;;
        --instructions) instructions=1; shift ;;
        --pooler) pooler=1; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
case "$edition" in
    native|portable) ;;
    *) echo "run.sh: --edition is native (the default) or portable" >&2; exit 2 ;;
esac
IDEMPOTENCY_PG_VERSIONS="$pg" scripts/bootstrap.sh
pg_config=$(scripts/pg-server.sh "$pg")
export PG_BIN
PG_BIN=$(dirname "$pg_config")
if [ -n "$pooler" ]; then
    [ "$edition" = native ] || { echo "run.sh: --pooler measures the native edition" >&2; exit 2; }
    # Packaged, not installed: bench/pooler.py runs a private copy of the server with this
    # build's library and SQL, which other builds installing theirs cannot change under it.
    cargo pgrx package --pg-config "$pg_config" >/dev/null
    [ "$pg" = 15 ] || args=(--out "RESULTS-pooler-pg$pg" "${args[@]}")
    exec python3 bench/pooler.py "${args[@]}"
fi
if [ "$edition" = portable ]; then
    cargo pgrx install --release --pg-config "$pg_config" >/dev/null
    if [ -n "$instructions" ]; then
        if ! command -v valgrind >/dev/null; then
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null
        fi
        [ "$pg" = 15 ] || args=(--out "INSTRUCTIONS-editions-pg$pg" "${args[@]}")
        exec python3 bench/instructions.py "${args[@]}"
    fi
    [ "$pg" = 15 ] || args=(--out "RESULTS-editions-pg$pg" "${args[@]}")
    exec python3 bench/editions.py "${args[@]}"
fi
if [ -n "$in_flight" ]; then
    cargo pgrx install --release --pg-config "$pg_config" >/dev/null
    exec python3 bench/hot_in_flight.py "${args[@]}"
fi
if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
if [ -n "$profile" ]; then
    if ! command -v perf >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-perf >/dev/null
    fi
    [ "$pg" = 15 ] || args=(--out "PROFILE-pg$pg" "${args[@]}")
    cargo pgrx install --release --pg-config "$pg_config" >/dev/null
    exec python3 bench/profile.py "${args[@]}"
fi
[ "$pg" = 15 ] || args=(--out "RESULTS-pg$pg" "${args[@]}")
python3 -c "import matplotlib" 2>/dev/null || python3 -m pip install -q --root-user-action=ignore "matplotlib>=3.7,<4"
cargo pgrx install --release --pg-config "$pg_config" >/dev/null
exec python3 bench/bench.py "${args[@]}"
