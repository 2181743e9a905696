#!/usr/bin/env bash
# Prepares a PostgreSQL server of major version NN for the portable edition's plain route, as a
# managed service without pg_tle has it: no file of the native extension at all (no
# idempotency.so, no idempotency.control). Prints that server's pg_config (nothing else on
# stdout):
#   scripts/pg-portable.sh 15  ->  /var/cache/idempotency/pg-portable/15/lib/postgresql/15/bin/pg_config
#
# The server is a copy of the one scripts/pg-server.sh NN provides, without the native
# extension's files, in a cache outside the clone (IDEMPOTENCY_CACHE, default
# /var/cache/idempotency), copied again when the source server is newer. PostgreSQL finds its
# share and lib directories relative to its binaries, so the copy keeps the source's layout:
# Debian's 15 (/usr/lib/postgresql/15 and /usr/share/postgresql/15) becomes
# <cache>/pg-portable/15/lib/postgresql/15 and <cache>/pg-portable/15/share/postgresql/15; a
# relocatable build (16 to 18, one prefix) is copied whole.
set -euo pipefail

major=${1:?usage: scripts/pg-portable.sh MAJOR}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${IDEMPOTENCY_CACHE:-/var/cache/idempotency}

source_config=$("$here/pg-server.sh" "$major")
source_bin=$("$source_config" --bindir)
source_share=$("$source_config" --sharedir)
server="$cache/pg-portable/$major"

case "$source_config" in
    /usr/lib/postgresql/"$major"/bin/pg_config)
        # Debian's layout: /usr/lib/postgresql/NN (bin, lib) and /usr/share/postgresql/NN.
        src_lib=/usr/lib/postgresql/$major
        src_share=$source_share
        dst_lib=$server/lib/postgresql/$major
        dst_share=$server/share/postgresql/$major
        pg_config=$dst_lib/bin/pg_config
        ;;
    *)
        src_lib=$(dirname "$source_bin")
        src_share=
        dst_lib=$server
        dst_share=
        pg_config=$server/bin/pg_config
        ;;
esac

if [ ! -x "$pg_config" ] || [ "$source_bin/postgres" -nt "$(dirname "$pg_config")/postgres" ]; then
    echo "pg-portable.sh: copying PostgreSQL $major into $server" >&2
    rm -rf "$server.new"
    mkdir -p "$server.new"
    if [ -n "$src_share" ]; then
        mkdir -p "$server.new/lib/postgresql" "$server.new/share/postgresql"
        cp -a "$src_lib" "$server.new/lib/postgresql/$major"
        cp -a "$src_share" "$server.new/share/postgresql/$major"
    else
        rm -rf "$server.new"
        cp -a "$src_lib" "$server.new"
    fi
    rm -rf "$server" && mv "$server.new" "$server"
fi
rm -f "$("$pg_config" --pkglibdir)"/idempotency*.so "$("$pg_config" --sharedir)"/extension/idempotency*
# The copy must find its own files, not the source's.
if [ "$("$pg_config" --pkglibdir)" = "$("$source_config" --pkglibdir)" ]; then
    echo "pg-portable.sh: the copy of PostgreSQL $major in $server is not relocatable" >&2
    exit 1
fi
chmod -R a+rX "$server"
echo "$pg_config"
