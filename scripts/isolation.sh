#!/usr/bin/env bash
# Runs the isolation specs (tests/isolation/specs/*.spec) with PostgreSQL's isolation tester
# against a throwaway cluster of the server whose pg_config is given, the extension installed
# into it (cargo pgrx install --pg-config PG_CONFIG):
#   scripts/isolation.sh /var/cache/idempotency/pg/17/bin/pg_config [spec ...]
#
# Each spec is a set of sessions and the permutations of their steps to run; the tester runs each
# permutation step by step, moves on when a step blocks on a lock, and the output (each step's
# result, and which step waited for which) must equal tests/isolation/expected/NAME.out. The
# tester (pg_isolation_regress and isolationtester) ships with the server's PGXS files: the
# postgresql-server-dev-NN package, or the relocatable builds scripts/pg-server.sh unpacks.
# initdb refuses root: the cluster and the tester run as the postgres user.
set -euo pipefail
cd "$(dirname "$0")/.."

pg_config=${1:?usage: scripts/isolation.sh PG_CONFIG [spec ...]}
shift
bin=$(dirname "$pg_config")
tester_dir="$("$pg_config" --pkglibdir)/pgxs/src/test/isolation"
if [ ! -x "$tester_dir/pg_isolation_regress" ] || [ ! -x "$tester_dir/isolationtester" ]; then
    echo "isolation.sh: no isolation tester in $tester_dir (install postgresql-server-dev-NN)" >&2
    exit 1
fi

if [ $# -gt 0 ]; then
    specs=("$@")
else
    specs=()
    for f in tests/isolation/specs/*.spec; do
        specs+=("$(basename "$f" .spec)")
    done
fi

as_postgres() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

dir=$(mktemp -d /tmp/idempotency-isolation-XXXXXX)
chmod 777 "$dir"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cleanup() {
    status=$?
    as_postgres "$bin/pg_ctl" -D "$dir/data" stop -m immediate -w >/dev/null 2>&1 || true
    if [ "$status" != 0 ] && [ -f "$dir/out/regression.diffs" ]; then
        cat "$dir/out/regression.diffs" >&2
    fi
    # ISOLATION_RESULTS=DIR keeps each spec's actual output there (to review a new spec's).
    if [ -n "${ISOLATION_RESULTS:-}" ] && [ -d "$dir/out/results" ]; then
        mkdir -p "$ISOLATION_RESULTS" && cp "$dir"/out/results/*.out "$ISOLATION_RESULTS"/
    fi
    rm -rf "$dir"
}
trap cleanup EXIT

# The specs and expected output are copied where the postgres user may read them, and the
# results are written beside them.
cp -r tests/isolation "$dir/in"
mkdir "$dir/out"
chmod -R a+rwX "$dir/in" "$dir/out"

as_postgres "$bin/initdb" -D "$dir/data" -A trust -U postgres --no-sync -E UTF8 --locale=C.UTF-8 >/dev/null
cat >>"$dir/data/postgresql.auto.conf" <<CONF
listen_addresses = ''
unix_socket_directories = '$dir'
port = $port
fsync = off
max_connections = 20
CONF
as_postgres "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" start -w >/dev/null

# pg_isolation_regress creates the database and the extension in it, then runs each spec.
(cd "$dir" && as_postgres "$tester_dir/pg_isolation_regress" \
    --bindir="$bin" --host="$dir" --port="$port" --user=postgres \
    --dbname=idempotency_isolation --load-extension=idempotency \
    --inputdir="$dir/in" --outputdir="$dir/out" "${specs[@]}")
