#!/usr/bin/env bash
# Builds and tests the Node client, clients/node (npm package pg-idempotency):
#   1. npm ci (the versions of package-lock.json);
#   2. the type check: tsc --noEmit of tests/types/usage.ts against index.d.ts;
#   3. npm pack: the artifact, clients/node/dist/pg-idempotency-<version>.tgz;
#   4. the artifact installed into a fresh npm project, which loads it;
#   5. the tests (node:test) against throwaway PostgreSQL clusters, direct and through PgBouncer in
#      each mode of IDEMPOTENCY_POOLER_MODES (default "direct transaction"; "direct transaction session" adds session mode): PG_BIN (default
#      /usr/lib/postgresql/15/bin) with the extension installed (`cargo pgrx install`); as root
#      the clusters run as the postgres OS user (runuser), as tests/integration/cluster.py does.
#      tests/otel.test.js (spans and metrics through @opentelemetry/api, read back with the SDK's
#      in-memory exporter) runs in the direct mode only: it skips itself in the others.
# Step 4 installs the package without its optional peer @opentelemetry/api and checks that nothing
# of OpenTelemetry is loaded.
# Needs Node.js 18.18 or later and the npm registry (or a warm npm cache).
set -euo pipefail
cd "$(dirname "$0")/../clients/node"

echo "== clients/node: npm ci"
npm ci --no-audit --no-fund --loglevel=error

echo "== clients/node: type check (index.d.ts)"
npm run --silent typecheck

echo "== clients/node: npm pack"
rm -rf dist && mkdir dist
tgz="$PWD/dist/$(npm pack --silent --pack-destination dist | tail -n 1)"
echo "$tgz"

echo "== clients/node: the packed artifact in a fresh npm project"
fresh=$(mktemp -d /tmp/pg-idempotency-fresh-XXXXXX)
trap 'rm -rf "$fresh"' EXIT
(cd "$fresh" && npm init -y >/dev/null &&
    npm install --no-audit --no-fund --loglevel=error "$tgz" pg@8 >/dev/null &&
    node -e "const m = require('pg-idempotency'); for (const f of ['idempotent', 'idempotentTransaction', 'idempotentBatch', 'claimMany', 'completeMany', 'expressIdempotency', 'fastifyIdempotency']) if (typeof m[f] !== 'function') throw new Error(f + ' missing'); if (Object.keys(require.cache).some((p) => p.includes('@opentelemetry'))) throw new Error('OpenTelemetry loaded without the optional peer'); console.log('pg-idempotency loads from the tarball, without @opentelemetry/api')")

# Direct, and through PgBouncer in each mode of IDEMPOTENCY_POOLER_MODES.
for mode in ${IDEMPOTENCY_POOLER_MODES:-direct transaction}; do
    echo "== clients/node: tests (node --test, throwaway clusters on ${PG_BIN:-/usr/lib/postgresql/15/bin}; $mode)"
    IDEMPOTENCY_TEST_POOLER=$mode npm test
done
