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
    missing=()
    for p in "${need[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        if [ "$(id -u)" -ne 0 ]; then
            echo "citus.sh: missing build packages: ${missing[*]} (apt-get install them, or run as root)" >&2
            exit 1
        fi
        echo "citus.sh: installing ${missing[*]}" >&2
        apt-get install -y -q "${missing[@]}" >&2 \
            || { apt-get update -q >&2 && apt-get install -y -q "${missing[@]}" >&2; }
    fi
    # Optional libraries: used when their headers are there, left out otherwise.
    opts=()
    dpkg -s libcurl4-openssl-dev >/dev/null 2>&1 || opts+=(--without-libcurl)
    dpkg -s liblz4-dev >/dev/null 2>&1 || opts+=(--without-lz4)
    dpkg -s libzstd-dev >/dev/null 2>&1 || opts+=(--without-zstd)

    want=$(awk -v f="citus-$version.tar.gz" '$2 == f { print $1 }' "$tarballs/SHA256SUMS")
    got=$(sha256sum "$tarball" | cut -d' ' -f1)
    if [ -z "$want" ] || [ "$want" != "$got" ]; then
        echo "citus.sh: $tarball does not match its SHA256SUMS entry" >&2
        exit 1
    fi

    echo "citus.sh: building Citus $version against $pg_config (about a minute)" >&2
    src=$(mktemp -d)
    trap 'rm -rf "$src"' EXIT
    tar xzf "$tarball" -C "$src"
    dir=$(find "$src" -mindepth 1 -maxdepth 1 -type d | head -n 1)
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

# The staged tree holds absolute paths of the server (its lib and share directories): copy what
# is missing or different.
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
    echo "citus.sh: Citus $version installed into $(dirname "$(dirname "$pg_config")")" >&2
fi
echo "$pg_config"
