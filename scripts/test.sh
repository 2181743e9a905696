#!/usr/bin/env bash
# Runs every test: installs the prerequisites, checks formatting and lints, runs the unit and
# #[pg_test] tests (cargo pgrx test), installs the extension into the system PostgreSQL 15 and
# runs the integration tests against throwaway clusters (concurrency, crashes, oracle, dump).
set -euo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
scripts/bootstrap.sh

echo "== cargo fmt --check, cargo clippy"
cargo fmt --all -- --check
cargo clippy --all-targets -- -D warnings
# The canonicalizer fuzz harness is a crate of its own (run by tests/integration/test_fuzz.py).
(cd fuzz && cargo fmt -- --check && cargo clippy --release -- -D warnings)

echo "== examples/http-service: fmt, clippy, unit tests (its end-to-end tests run with pytest)"
cargo fmt --manifest-path examples/http-service/Cargo.toml -- --check
cargo clippy --manifest-path examples/http-service/Cargo.toml --locked --all-targets -- -D warnings
cargo test --manifest-path examples/http-service/Cargo.toml --locked -q

echo "== unit and #[pg_test] tests (cargo pgrx test)"
# initdb refuses root: the test cluster runs as postgres, in a fresh directory it creates itself.
pgdata=$(mktemp -u /tmp/idempotency-pgrx-XXXXXX)
trap 'rm -rf "$pgdata"' EXIT
# One test at a time: the tests share keys ('k'), each in a transaction it rolls back, and a
# claim meeting another session's uncommitted claim of the same key answers in_progress at once
# (by design): run side by side, two tests could see each other's keys.
RUST_TEST_THREADS=1 cargo pgrx test pg15 --runas postgres --pgdata "$pgdata"

echo "== integration tests (pytest, real sessions against throwaway clusters)"
cargo pgrx install --pg-config "$PG_CONFIG" >/dev/null
python3 -m pytest -q tests/integration
