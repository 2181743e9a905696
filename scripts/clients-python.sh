#!/usr/bin/env bash
# Builds the Python client (clients/python, the `pg-idempotency` wheel) and runs its tests
# against a throwaway cluster, in a virtualenv of its own so that the tests import the built wheel,
# not the source tree.
#
# The extension must be installed into the server first (cargo pgrx install); PG_BIN picks the
# server's binaries (default /usr/lib/postgresql/15/bin, as tests/integration/cluster.py).
# CLIENTS_PYTHON_VENV (default target/clients-python-venv) is the virtualenv; the wheel is left
# in clients/python/dist. Needs PyPI (pip) and python3 with venv.
#
# The tests run once per route in IDEMPOTENCY_POOLER_MODES (default "direct transaction"; "direct transaction session" adds session mode):
# direct to the cluster, and through PgBouncer in transaction (and session) mode
# (IDEMPOTENCY_TEST_POOLER, tests/integration/pooler.py). The OpenTelemetry tests (tests/test_otel.py,
# the `otel` extra read back with the SDK's in-memory exporter) run in the direct mode only: they
# skip themselves in the others.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=$(realpath -m "${CLIENTS_PYTHON_VENV:-target/clients-python-venv}")
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "build>=1,<2"

echo "== clients/python: python -m build (wheel and sdist)"
rm -rf clients/python/dist clients/python/build
"$VENV/bin/python" -m build -q clients/python --outdir clients/python/dist >/dev/null
wheel=$(ls clients/python/dist/pg_idempotency-*-py3-none-any.whl)
echo "built $wheel"

echo "== clients/python: install the wheel with its test dependencies"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${wheel}[test,binary]"

cd clients/python
for mode in ${IDEMPOTENCY_POOLER_MODES:-direct transaction}; do
    echo "== clients/python: tests against a throwaway cluster ($mode)"
    IDEMPOTENCY_TEST_POOLER=$mode "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests
done
