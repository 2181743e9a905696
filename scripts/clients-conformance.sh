#!/usr/bin/env bash
# The HTTP conformance suite (clients/conformance): one scenario list run against the same small
# app on each of the five adapters (ASGI, Django, Express, Fastify, axum), over real HTTP, on a
# throwaway cluster of PG_BIN's server (default /usr/lib/postgresql/15/bin; the extension must be
# installed into it), direct and through PgBouncer in each mode of IDEMPOTENCY_POOLER_MODES
# (default "direct transaction"; "direct transaction session" adds session mode).
#
# Runs after scripts/clients-python.sh (its virtualenv, CLIENTS_PYTHON_VENV, with the wheel and
# its test dependencies) and scripts/clients-node.sh (clients/node/node_modules); builds the Rust
# example app itself.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=$(realpath -m "${CLIENTS_PYTHON_VENV:-target/clients-python-venv}")
[ -x "$VENV/bin/python" ] || { echo "run scripts/clients-python.sh first ($VENV)" >&2; exit 1; }
[ -d clients/node/node_modules ] || { echo "run scripts/clients-node.sh first (clients/node/node_modules)" >&2; exit 1; }

echo "== clients/conformance: the axum app (cargo build --example conformance)"
(cd clients/rust && cargo build --locked --quiet --example conformance)

cd clients/conformance
# Direct, and through PgBouncer in each mode of IDEMPOTENCY_POOLER_MODES.
for mode in ${IDEMPOTENCY_POOLER_MODES:-direct transaction}; do
    echo "== clients/conformance: the scenarios against the five adapters ($mode; PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin})"
    IDEMPOTENCY_TEST_POOLER=$mode "$VENV/bin/python" -m pytest -q -p no:cacheprovider test_conformance.py
done
