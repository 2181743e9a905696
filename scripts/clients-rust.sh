#!/usr/bin/env bash
# The Rust client (clients/rust, the idempotency-axum crate): formatting, lints, its tests
# against throwaway clusters, and the package.
#
# The tests start their own clusters with PG_BIN's initdb and pg_ctl (default
# /usr/lib/postgresql/15/bin) and need the extension installed into that server first
# (cargo pgrx install --pg-config "$PG_BIN/pg_config"). They run direct and through PgBouncer in
# each mode of IDEMPOTENCY_POOLER_MODES (default "direct transaction"; "direct transaction session" adds session mode).
#
# The spans and metrics (features `tracing`, `metrics`, `otel`; off by default): clippy with each,
# the default build checked to bring in nothing of OpenTelemetry, and tests/otel.rs (feature
# `otel`: a tracing subscriber layer and the SDK's in-memory metric exporter) in the direct mode
# only (the spans do not depend on the route).
set -euo pipefail
cd "$(dirname "$0")/../clients/rust"

echo "== clients/rust: cargo fmt --check, cargo clippy"
cargo fmt -- --check
cargo clippy --locked --all-targets -- -D warnings
for features in tracing metrics otel; do
    cargo clippy --locked --all-targets --features "$features" -- -D warnings
done

echo "== clients/rust: the default build brings in nothing of OpenTelemetry"
if cargo tree --locked -e normal --prefix none | grep -q '^opentelemetry'; then
    echo "opentelemetry is a dependency of the default build" >&2
    exit 1
fi

# Direct, and through PgBouncer in each mode of IDEMPOTENCY_POOLER_MODES.
for mode in ${IDEMPOTENCY_POOLER_MODES:-direct transaction}; do
    echo "== clients/rust: unit tests and tests against throwaway clusters (PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}; $mode)"
    IDEMPOTENCY_TEST_POOLER=$mode cargo test --locked
    if [ "$mode" = direct ]; then
        echo "== clients/rust: spans and metrics (--features otel, direct mode only)"
        IDEMPOTENCY_TEST_POOLER=$mode cargo test --locked --features otel --test otel
    fi
done

echo "== clients/rust: cargo package (builds the packaged crate)"
cargo package --locked
ls -l "${CARGO_TARGET_DIR:-target}"/package/idempotency-axum-*.crate
