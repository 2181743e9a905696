#!/usr/bin/env bash
# The Rust client (clients/rust, the idempotency-axum crate): formatting, lints, its tests
# against throwaway clusters, and the package.
#
# The tests start their own clusters with PG_BIN's initdb and pg_ctl (default
# /usr/lib/postgresql/15/bin) and need the extension installed into that server first
# (cargo pgrx install --pg-config "$PG_BIN/pg_config"). They run direct and through PgBouncer in
# each mode of IDEMPOTENCY_POOLER_MODES (default "direct transaction session").
set -euo pipefail
cd "$(dirname "$0")/../clients/rust"

echo "== clients/rust: cargo fmt --check, cargo clippy"
cargo fmt -- --check
cargo clippy --locked --all-targets -- -D warnings

# Direct, and through PgBouncer in transaction and session mode (IDEMPOTENCY_POOLER_MODES).
for mode in ${IDEMPOTENCY_POOLER_MODES:-direct transaction session}; do
    echo "== clients/rust: unit tests and tests against throwaway clusters (PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}; $mode)"
    IDEMPOTENCY_TEST_POOLER=$mode cargo test --locked
done

echo "== clients/rust: cargo package (builds the packaged crate)"
cargo package --locked
ls -l target/package/idempotency-axum-*.crate
