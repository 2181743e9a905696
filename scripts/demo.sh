#!/usr/bin/env bash
# Sets everything up on a fresh machine, builds and installs the extension, starts a throwaway
# PostgreSQL 15 cluster and runs examples/demo.sql against it: new, replay, mismatch,
# in_progress, takeover, expiry and a rolled-back claim. The cluster is removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

PG_BIN=/usr/lib/postgresql/15/bin
# The demo needs PostgreSQL 15 only (scripts/test.sh also installs 16-18).
IDEMPOTENCY_PG_VERSIONS=${IDEMPOTENCY_PG_VERSIONS:-15} scripts/bootstrap.sh
echo "== building and installing the extension"
cargo pgrx install --pg-config "$PG_BIN/pg_config" >/dev/null

dir=$(mktemp -d /tmp/idempotency-demo-XXXXXX)
chmod 777 "$dir"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cleanup() {
    runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap cleanup EXIT
echo "== starting a throwaway cluster in $dir"
runuser -u postgres -- "$PG_BIN/initdb" -D "$dir/data" -A trust -U postgres --no-sync >/dev/null
runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w \
    -o "-c listen_addresses='' -c unix_socket_directories='$dir' -c port=$port" start >/dev/null
echo "== running examples/demo.sql"
psql -X -h "$dir" -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 \
    -v conn="host=$dir port=$port user=postgres dbname=postgres" -f examples/demo.sql
