#!/usr/bin/env bash
# Prepares a PostgreSQL server of major version NN for the portable edition's pg_tle route, as a
# managed service has it: pg_tle installed, and no file of the native extension at all (no
# idempotency.so, no idempotency.control: pg_tle refuses to install an extension whose name a
# control file on the server already has). Prints that server's pg_config (nothing else on
# stdout):
#   scripts/pg-tle.sh 17  ->  /var/cache/idempotency/pg-tle/17/bin/pg_config
#
# The server is a copy of the one scripts/pg-server.sh NN provides (a relocatable build: 16 to
# 18; Debian's packaged 15 cannot be copied elsewhere), without the native extension's files,
# in a cache outside the clone (IDEMPOTENCY_CACHE, default /var/cache/idempotency). pg_tle is
# built from an unchanged source tarball, pg_tle-*.tar.gz, checked against the SHA256SUMS next
# to it, in PG_TLE_TARBALL_DIR (default: ../shared/vendor/pg_tle beside the clone), once per
# tarball and server (a staged install, copied into the server when missing or different).
# For tests only: on RDS, Aurora and Supabase pg_tle is the service's own.
set -euo pipefail

major=${1:?usage: scripts/pg-tle.sh MAJOR}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
cache=${IDEMPOTENCY_CACHE:-/var/cache/idempotency}
tarballs=${PG_TLE_TARBALL_DIR:-$root/../shared/vendor/pg_tle}

source_config=$("$here/pg-server.sh" "$major")
case "$source_config" in
    "$cache"/pg/*) ;;
    *) echo "pg-tle.sh: PostgreSQL $major here is $source_config, not a relocatable build that can be" \
            "copied (16 to 18 are)" >&2
       exit 2 ;;
esac

tarball=$(ls "$tarballs"/pg_tle-*.tar.gz 2>/dev/null | head -n 1 || true)
if [ -z "$tarball" ] || [ ! -f "$tarballs/SHA256SUMS" ]; then
    echo "pg-tle.sh: no pg_tle-*.tar.gz (and SHA256SUMS beside it) in $tarballs; set" \
         "PG_TLE_TARBALL_DIR to the directory holding the pg_tle source tarball" >&2
    exit 1
fi
name=$(basename "$tarball")
# shellcheck source=scripts/vendor.sh
. "$here/vendor.sh"
vendor_check_sum pg-tle.sh "$tarball"

# The server: a copy without the native extension (copied again when the source is newer).
server="$cache/pg-tle/$major"
if [ ! -x "$server/bin/pg_config" ] || [ "$(dirname "$(dirname "$source_config")")/bin/postgres" -nt "$server/bin/postgres" ]; then
    rm -rf "$server.new"
    mkdir -p "$(dirname "$server")"
    cp -a "$(dirname "$(dirname "$source_config")")" "$server.new"
    rm -rf "$server" && mv "$server.new" "$server"
fi
pg_config="$server/bin/pg_config"
rm -f "$("$pg_config" --pkglibdir)"/idempotency*.so "$("$pg_config" --sharedir)"/extension/idempotency*

stage="$cache/pg-tle/${name%.tar.gz}-pg$major"
if [ ! -f "$stage/.built" ]; then
    # pg_tle's build runs flex; the server headers include gssapi.
    vendor_need_packages pg-tle.sh flex libkrb5-dev
    echo "pg-tle.sh: building $name against $pg_config" >&2
    vendor_unpack "$tarball"
    vendor_build_pgxs "$VENDOR_SRC" "$pg_config" "$stage"
fi
vendor_install_stage "$stage" >/dev/null
echo "$pg_config"
