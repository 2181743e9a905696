#!/usr/bin/env bash
# Builds Citus from source against PostgreSQL major version NN (the server that
# scripts/pg-server.sh NN provides), installs it into that server, and prints that server's
# pg_config path (nothing else on stdout):
#   scripts/citus.sh 18   ->  /var/cache/idempotency/pg/18/bin/pg_config, with citus.so installed
#
# For tests only: real deployments install Citus from its own packages (docs/scaling.md).
# The source is an unchanged release tarball, citus-$CITUS_VERSION.tar.gz, checked against the
# SHA256SUMS next to it, in CITUS_TARBALL_DIR (default: ../shared/vendor/citus beside the
# clone). The build is kept in a cache outside the clone (IDEMPOTENCY_CACHE, default
# /var/cache/idempotency, as scripts/pg-server.sh) as a staged install (make install
# DESTDIR=...), built once per Citus version and server; every run copies the staged files into
# the server when they are missing or differ there (pg-server.sh may have unpacked the server
# again), so running it twice builds and copies once.
set -euo pipefail

major=${1:?usage: scripts/citus.sh MAJOR}
version=${CITUS_VERSION:-14.0.1}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
cache=${IDEMPOTENCY_CACHE:-/var/cache/idempotency}
tarballs=${CITUS_TARBALL_DIR:-$root/../shared/vendor/citus}

case "$version:$major" in
    14.*:1[678]) ;;
    13.*:1[67]) ;;  # 13.2.2 does not compile against Debian's 15.20 (vendor README)
    *) echo "citus.sh: Citus $version is not built for PostgreSQL $major here (Citus 14.0.1: 16-18)" >&2
       exit 2 ;;
esac

pg_config=$("$here/pg-server.sh" "$major")
# shellcheck source=scripts/vendor.sh
. "$here/vendor.sh"

tarball="$tarballs/citus-$version.tar.gz"
if [ ! -f "$tarball" ] || [ ! -f "$tarballs/SHA256SUMS" ]; then
    echo "citus.sh: $tarball (and SHA256SUMS beside it) not found; set CITUS_TARBALL_DIR to the" \
         "directory holding the Citus source tarballs" >&2
    exit 1
fi

stage="$cache/citus/$version-pg$major"
if [ ! -f "$stage/.built" ]; then
    # Server headers include gssapi: libkrb5-dev is required. A server built with zstd
    # (HAVE_LIBZSTD in its pg_config.h, as the relocatable builds are) makes Citus's columnar
    # code include zstd.h whatever configure says: libzstd-dev is required then too.
    need=(libkrb5-dev)
    if grep -qs '^#define HAVE_LIBZSTD 1' "$("$pg_config" --includedir-server)/pg_config.h"; then
        need+=(libzstd-dev)
    fi
    vendor_need_packages citus.sh "${need[@]}"
    # Optional libraries: used when their headers are there, left out otherwise.
    opts=()
    dpkg -s libcurl4-openssl-dev >/dev/null 2>&1 || opts+=(--without-libcurl)
    dpkg -s liblz4-dev >/dev/null 2>&1 || opts+=(--without-lz4)
    dpkg -s libzstd-dev >/dev/null 2>&1 || opts+=(--without-zstd)

    vendor_check_sum citus.sh "$tarball"

    echo "citus.sh: building Citus $version against $pg_config (about a minute)" >&2
    vendor_unpack "$tarball"
    dir=$VENDOR_SRC
    rm -rf "$stage.new"
    mkdir -p "$stage.new"
    (
        cd "$dir"
        ./configure -q PG_CONFIG="$pg_config" "${opts[@]}"
        make -s -j"$(nproc)"
        make -s install DESTDIR="$stage.new"
    ) >&2
    touch "$stage.new/.built"
    rm -rf "$stage" && mv "$stage.new" "$stage"
fi

if [ -n "$(vendor_install_stage "$stage")" ]; then
    echo "citus.sh: Citus $version installed into $(dirname "$(dirname "$pg_config")")" >&2
fi
echo "$pg_config"
