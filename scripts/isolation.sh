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
#
# The same specs run against the portable edition (dist/, docs/managed.md) on a server that has
# no file of the native extension:
#   scripts/isolation.sh --portable plain "$(scripts/pg-portable.sh 15)" [spec ...]
#   scripts/isolation.sh --portable pgtle "$(scripts/pg-tle.sh 18)" [spec ...]
# plain: the test database gets dist/idempotency-portable.sql (psql -f, as on a service without
# pg_tle); pgtle: the cluster preloads pg_tle, and the test database gets CREATE EXTENSION
# pg_tle, the pg_tle script made from the plain one (scripts/portable.py pgtle) and CREATE
# EXTENSION idempotency (as tests/integration's portable runs do it). The specs create nothing of the extension themselves: the script prepares
# the database (natively pg_isolation_regress's --load-extension), so one spec runs on each
# edition. Where an edition answers otherwise by design, tests/isolation/expected/NAME_1.out is
# the alternative output the tester accepts, and the spec's header says why (docs/testing.md);
# today every spec has one expected output, for both editions.
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: scripts/isolation.sh [--portable plain|pgtle] PG_CONFIG [spec ...]"
edition=native
if [ "${1:-}" = --portable ]; then
    edition=${2:?$usage}
    shift 2
    case "$edition" in
        plain | pgtle) ;;
        *) echo "isolation.sh: --portable takes plain or pgtle, not $edition" >&2; exit 2 ;;
    esac
fi
pg_config=${1:?$usage}
shift
bin=$(dirname "$pg_config")
pkglibdir=$("$pg_config" --pkglibdir)
if [ "$edition" != native ]; then
    # The portable edition is tested where the native library cannot be what answers.
    if compgen -G "$pkglibdir/idempotency*" >/dev/null; then
        echo "isolation.sh: --portable needs a server without the native library; $pkglibdir has it" \
             "(scripts/pg-portable.sh or scripts/pg-tle.sh prepare one)" >&2
        exit 1
    fi
    if [ "$edition" = pgtle ] && [ ! -f "$pkglibdir/pg_tle.so" ]; then
        echo "isolation.sh: --portable pgtle needs pg_tle installed in $pkglibdir (scripts/pg-tle.sh)" >&2
        exit 1
    fi
fi
tester_dir="$pkglibdir/pgxs/src/test/isolation"
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
if [ "$edition" = pgtle ]; then
    echo "shared_preload_libraries = 'pg_tle'" >>"$dir/data/postgresql.auto.conf"
fi
as_postgres "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" start -w >/dev/null

db=idempotency_isolation
if [ "$edition" = native ]; then
    # pg_isolation_regress creates the database and the extension in it, then runs each spec.
    prepare=(--load-extension=idempotency)
else
    # The database is made here, with the portable edition in it, and the tester uses it as is.
    psql_db() {
        as_postgres "$bin/psql" -X -q -v ON_ERROR_STOP=1 -h "$dir" -p "$port" -U postgres -d "$db" "$@"
    }
    as_postgres "$bin/createdb" -h "$dir" -p "$port" -U postgres "$db"
    cp dist/idempotency-portable.sql "$dir/in/"
    python3 scripts/portable.py pgtle >"$dir/in/pgtle-idempotency.sql"
    if [ "$edition" = plain ]; then
        psql_db -c "SET client_min_messages = warning" -f "$dir/in/idempotency-portable.sql" >/dev/null
    else
        psql_db -c "SET client_min_messages = warning" -c "CREATE EXTENSION pg_tle" -f "$dir/in/pgtle-idempotency.sql" \
            -c "CREATE EXTENSION idempotency" >/dev/null
    fi
    # No function of the schema may be the native library's.
    c_functions=$(psql_db -A -t -c "SELECT count(*) FROM pg_catalog.pg_proc
        WHERE pronamespace = 'idempotency'::regnamespace AND (prolang = (SELECT oid FROM pg_catalog.pg_language WHERE lanname = 'c') OR probin IS NOT NULL)")
    if [ "$c_functions" != 0 ]; then
        echo "isolation.sh: $c_functions C functions in schema idempotency of the portable edition" >&2
        exit 1
    fi
    prepare=(--use-existing)
fi
(cd "$dir" && as_postgres "$tester_dir/pg_isolation_regress" \
    --bindir="$bin" --host="$dir" --port="$port" --user=postgres \
    --dbname="$db" "${prepare[@]}" \
    --inputdir="$dir/in" --outputdir="$dir/out" "${specs[@]}")
