#!/usr/bin/env bash
# Makes pg_cron available to a PostgreSQL server for the tests (schedule_sweep, sweeping without
# the background sweeper) and prints that server's pg_config path (nothing else on stdout):
#   scripts/pg-cron.sh 15                      Debian's postgresql-15-cron (installed if missing)
#   scripts/pg-cron.sh 18                      pg_cron built into the server scripts/pg-server.sh 18 gives
#   scripts/pg-cron.sh 18 /path/to/pg_config   ... into another server tree of that version
#
# For tests only: real servers install pg_cron from their packages, or have it from the
# service. 16-18 build an unchanged release tarball, pg_cron-$PG_CRON_VERSION.tar.gz, checked
# against the SHA256SUMS next to it, in PG_CRON_TARBALL_DIR (default: ../shared/vendor/pg_cron
# beside the clone). The build is kept in a cache outside the clone (IDEMPOTENCY_CACHE, default
# /var/cache/idempotency) as a staged install, one per version and server tree; every run copies
# the staged files into the server when they are missing or differ there.
set -euo pipefail

major=${1:?usage: scripts/pg-cron.sh MAJOR [PG_CONFIG]}
version=${PG_CRON_VERSION:-1.6.7}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
cache=${IDEMPOTENCY_CACHE:-/var/cache/idempotency}
tarballs=${PG_CRON_TARBALL_DIR:-$root/../shared/vendor/pg_cron}

# shellcheck source=scripts/vendor.sh
. "$here/vendor.sh"

if [ "$major" = 15 ] && [ -z "${2:-}" ]; then
    vendor_need_packages pg-cron.sh postgresql-15-cron
    "$here/pg-server.sh" 15
    exit 0
fi

pg_config=${2:-$("$here/pg-server.sh" "$major")}
[ -x "$pg_config" ] || { echo "pg-cron.sh: no pg_config at $pg_config" >&2; exit 1; }
got_major=$("$pg_config" --version | sed -n 's/^PostgreSQL \([0-9]*\).*/\1/p')
[ "$got_major" = "$major" ] || { echo "pg-cron.sh: $pg_config is PostgreSQL $got_major, not $major" >&2; exit 1; }

tarball="$tarballs/pg_cron-$version.tar.gz"
if [ ! -f "$tarball" ] || [ ! -f "$tarballs/SHA256SUMS" ]; then
    echo "pg-cron.sh: $tarball (and SHA256SUMS beside it) not found; set PG_CRON_TARBALL_DIR to the" \
         "directory holding the pg_cron source tarball" >&2
    exit 1
fi

tree=$(echo "$pg_config" | sha256sum | cut -c1-12)
stage="$cache/pg-cron/$version-pg$major-$tree"
if [ ! -f "$stage/.built" ]; then
    vendor_check_sum pg-cron.sh "$tarball"
    # The server headers include gssapi: libkrb5-dev is needed (as for Citus and pg_tle).
    vendor_need_packages pg-cron.sh libkrb5-dev
    echo "pg-cron.sh: building pg_cron $version against $pg_config (seconds)" >&2
    vendor_unpack "$tarball"
    vendor_build_pgxs "$VENDOR_SRC" "$pg_config" "$stage"
fi
if [ -n "$(vendor_install_stage "$stage")" ]; then
    echo "pg-cron.sh: pg_cron $version installed into $(dirname "$(dirname "$pg_config")")" >&2
fi
echo "$pg_config"
