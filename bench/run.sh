#!/usr/bin/env bash
# One command for the benchmarks: installs the prerequisites (the test ones plus redis-server and
# matplotlib), builds and installs a release build of the extension, and runs bench/bench.py,
# which starts its own cluster and Redis servers and writes bench/RESULTS.md and the chart.
# Takes about 20 minutes with the defaults; pass --quick for a smoke run of the harness.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
python3 -c "import matplotlib" 2>/dev/null || python3 -m pip install -q --root-user-action=ignore "matplotlib>=3.7,<4"
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >/dev/null
exec python3 bench/bench.py "$@"
