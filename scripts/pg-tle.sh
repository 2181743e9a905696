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
want=$(awk -v f="$name" '$2 == f { print $1 }' "$tarballs/SHA256SUMS")
got=$(sha256sum "$tarball" | cut -d' ' -f1)
if [ -z "$want" ] || [ "$want" != "$got" ]; then
    echo "pg-tle.sh: $tarball does not match its SHA256SUMS entry" >&2
    exit 1
fi

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
    missing=()
    for p in flex libkrb5-dev; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        if [ "$(id -u)" -ne 0 ]; then
            echo "pg-tle.sh: missing build packages: ${missing[*]} (apt-get install them, or run as root)" >&2
            exit 1
        fi
        echo "pg-tle.sh: installing ${missing[*]}" >&2
        apt-get install -y -q "${missing[@]}" >&2 \
            || { apt-get update -q >&2 && apt-get install -y -q "${missing[@]}" >&2; }
    fi
    echo "pg-tle.sh: building $name against $pg_config" >&2
    src=$(mktemp -d)
    trap 'rm -rf "$src"' EXIT
    tar xzf "$tarball" -C "$src"
    dir=$(find "$src" -mindepth 1 -maxdepth 1 -type d | head -n 1)
    [ -n "$dir" ] || dir=$src
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

# The staged tree holds the server's absolute paths: copy what is missing or different.
while IFS= read -r -d '' f; do
    rel=${f#"$stage"}
    if ! cmp -s "$f" "$rel"; then
        mkdir -p "$(dirname "$rel")"
        cp "$f" "$rel"
        chmod a+rX "$rel"
    fi
done < <(find "$stage" -type f ! -name .built -print0)
echo "$pg_config"
