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

if [ "$major" = 15 ] && [ -z "${2:-}" ]; then
    if ! dpkg -s postgresql-15-cron >/dev/null 2>&1; then
        echo "pg-cron.sh: installing postgresql-15-cron" >&2
        apt-get install -y -q postgresql-15-cron >&2 \
            || { apt-get update -q >&2 && apt-get install -y -q postgresql-15-cron >&2; }
    fi
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
    want=$(awk -v f="pg_cron-$version.tar.gz" '$2 == f { print $1 }' "$tarballs/SHA256SUMS")
    got=$(sha256sum "$tarball" | cut -d' ' -f1)
    if [ -z "$want" ] || [ "$want" != "$got" ]; then
        echo "pg-cron.sh: $tarball does not match its SHA256SUMS entry" >&2
        exit 1
    fi
    # The server headers include gssapi: libkrb5-dev is needed (as for Citus and pg_tle).
    if ! dpkg -s libkrb5-dev >/dev/null 2>&1; then
        apt-get install -y -q libkrb5-dev >&2 || { apt-get update -q >&2 && apt-get install -y -q libkrb5-dev >&2; }
    fi
    echo "pg-cron.sh: building pg_cron $version against $pg_config (seconds)" >&2
    src=$(mktemp -d)
    trap 'rm -rf "$src"' EXIT
    tar xzf "$tarball" -C "$src"
    dir=$(find "$src" -mindepth 1 -maxdepth 1 -type d | head -n 1)
    rm -rf "$stage.new"
    mkdir -p "$stage.new"
    (
        cd "$dir"
        make -s -j"$(nproc)" PG_CONFIG="$pg_config"
        make -s install PG_CONFIG="$pg_config" DESTDIR="$stage.new"
    ) >&2
    touch "$stage.new/.built"
    rm -rf "$stage" && mv "$stage.new" "$stage"
fi

# The staged tree holds the server's absolute paths (its lib and share directories).
changed=0
while IFS= read -r -d '' f; do
    rel=${f#"$stage"}
    if ! cmp -s "$f" "$rel"; then
        mkdir -p "$(dirname "$rel")"
        cp "$f" "$rel"
        chmod a+rX "$rel"
        changed=1
    fi
done < <(find "$stage" -type f ! -name .built -print0)
if [ "$changed" = 1 ]; then
    echo "pg-cron.sh: pg_cron $version installed into $(dirname "$(dirname "$pg_config")")" >&2
fi
echo "$pg_config"
