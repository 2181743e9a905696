# Shared by the scripts that build a vendored PostgreSQL extension from its source tarball for
# the tests (scripts/citus.sh, scripts/pg-tle.sh, scripts/pg-cron.sh): sourced, not run. Each
# function takes the calling script's name first, for its messages.

# vendor_need_packages SCRIPT PACKAGE...: installs the Debian packages that are missing (as root).
vendor_need_packages() {
    local script=$1 p
    shift
    local missing=()
    for p in "$@"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "$script: missing build packages: ${missing[*]} (apt-get install them, or run as root)" >&2
        exit 1
    fi
    echo "$script: installing ${missing[*]}" >&2
    apt-get install -y -q "${missing[@]}" >&2 \
        || { apt-get update -q >&2 && apt-get install -y -q "${missing[@]}" >&2; }
}

# vendor_check_sum SCRIPT TARBALL: the tarball matches its line in the SHA256SUMS beside it.
vendor_check_sum() {
    local script=$1 tarball=$2
    local sums want got
    sums="$(dirname "$tarball")/SHA256SUMS"
    want=$(awk -v f="$(basename "$tarball")" '$2 == f { print $1 }' "$sums" 2>/dev/null || true)
    got=$(sha256sum "$tarball" | cut -d' ' -f1)
    if [ -z "$want" ] || [ "$want" != "$got" ]; then
        echo "$script: $tarball does not match its SHA256SUMS entry" >&2
        exit 1
    fi
}

# vendor_unpack TARBALL: unpacks into a temporary directory, removed when the script exits, and
# sets VENDOR_SRC to the source directory (call it directly, not in $(...): the trap must be the
# script's).
vendor_unpack() {
    local src
    src=$(mktemp -d)
    # shellcheck disable=SC2064  # the directory is known now
    trap "rm -rf '$src'" EXIT
    tar xzf "$1" -C "$src"
    VENDOR_SRC=$(find "$src" -mindepth 1 -maxdepth 1 -type d | head -n 1)
    [ -n "$VENDOR_SRC" ] || VENDOR_SRC=$src
}

# vendor_build_pgxs SOURCE_DIR PG_CONFIG STAGE: builds a PGXS extension and installs it staged
# (make install DESTDIR=STAGE), marked built.
vendor_build_pgxs() {
    local dir=$1 pg_config=$2 stage=$3
    rm -rf "$stage.new"
    mkdir -p "$stage.new"
    (
        cd "$dir"
        make -s -j"$(nproc)" PG_CONFIG="$pg_config"
        make -s install PG_CONFIG="$pg_config" DESTDIR="$stage.new"
    ) >&2
    touch "$stage.new/.built"
    rm -rf "$stage" && mv "$stage.new" "$stage"
}

# vendor_install_stage STAGE: copies the staged files that are missing or different into the
# server (the staged tree holds the server's absolute paths); prints "changed" if any was.
vendor_install_stage() {
    local stage=$1 f rel changed=
    while IFS= read -r -d '' f; do
        rel=${f#"$stage"}
        if ! cmp -s "$f" "$rel"; then
            mkdir -p "$(dirname "$rel")"
            cp "$f" "$rel"
            chmod a+rX "$rel"
            changed=changed
        fi
    done < <(find "$stage" -type f ! -name .built -print0)
    echo "$changed"
}
