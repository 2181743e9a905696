#!/usr/bin/env bash
# Builds a release's files into one folder (docs/installing.md, "Building a release"):
#
#   scripts/package.sh all                 every supported major version (15 16 17 18)
#   scripts/package.sh 15 17               some of them
#
#   postgresql-NN-idempotency_<version>-1_<arch>.deb   per major: the PostgreSQL project's apt
#       layout (/usr/lib/postgresql/NN/lib/idempotency.so, /usr/share/postgresql/NN/extension/:
#       the control file, the install script and every upgrade script), made with dpkg-deb from
#       the files `cargo pgrx package` lays out
#   the portable edition's scripts (dist/*.sql, and the pg_tle scripts scripts/portable.py
#       makes from them where it has a pgtle mode)
#   idempotency-<version>.zip              the PGXN distribution (git archive of the commit)
#   SHA256SUMS                             over every file above (sha256sum -c SHA256SUMS)
#
# Options:
#   --out DIR       the output folder (default target/packages/idempotency-<version>); written
#                   only when everything is built (staged beside it, then renamed)
#   --commit REV    package an earlier commit (its sources from git archive, built with this
#                   script and this checkout's cargo target directory): the update tests' previous
#                   release
#   --allow-dirty   package a working tree with uncommitted changes (test builds only: the zip
#                   is always the commit's)
# IDEMPOTENCY_PACKAGE_PROFILE=debug packages the debug build (`cargo pgrx package --debug`): what
# scripts/test.sh does, reusing the builds of `cargo pgrx install` (seconds, not a release build's
# ten minutes per major version). The default is release. PG_CONFIG_NN chooses the pg_config of
# major NN (default: scripts/pg-server.sh NN). The payload is reproducible: files sorted, owned by
# root, modes 755/644, times SOURCE_DATE_EPOCH (default: the commit's time), xz.
#
# Refuses, writing nothing, when a major version is missing or unsupported, the tree is dirty, or
# the versions of Cargo.toml, idempotency.control and META.json disagree.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
SUPPORTED=(15 16 17 18)

die() {
    echo "package.sh: $*" >&2
    exit 2
}

out="" commit="" allow_dirty=0 majors=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=${2:?--out needs a folder}; shift 2 ;;
        --out=*) out=${1#--out=}; shift ;;
        --commit) commit=${2:?--commit needs a revision}; shift 2 ;;
        --commit=*) commit=${1#--commit=}; shift ;;
        --allow-dirty) allow_dirty=1; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        all) majors+=("${SUPPORTED[@]}"); shift ;;
        -*) die "unknown option $1 (see scripts/package.sh --help)" ;;
        *) majors+=("$1"); shift ;;
    esac
done

[ "${#majors[@]}" -gt 0 ] \
    || die "no PostgreSQL major version given: scripts/package.sh MAJOR... (supported: ${SUPPORTED[*]}; 'all' for every one)"
declare -A seen=()
wanted=()
for m in "${majors[@]}"; do
    case " ${SUPPORTED[*]} " in
        *" $m "*) ;;
        *) die "PostgreSQL '$m' is not supported (supported: ${SUPPORTED[*]})" ;;
    esac
    [ -n "${seen[$m]:-}" ] || wanted+=("$m")
    seen[$m]=1
done

profile=${IDEMPOTENCY_PACKAGE_PROFILE:-release}
case "$profile" in
    release) pgrx_profile=() xz_level=6 ;;
    # A debug library is 14 MB stripped: xz at its lowest level, seconds instead of 15 or more.
    debug) pgrx_profile=(--debug) xz_level=1 ;;
    *) die "IDEMPOTENCY_PACKAGE_PROFILE is '$profile': release or debug" ;;
esac
if [ -n "${RUSTFLAGS:-}${CARGO_ENCODED_RUSTFLAGS:-}" ]; then
    die "RUSTFLAGS is set: it would replace the path mappings of scripts/build-env.sh (unset it)"
fi

# The sources: this working tree (clean), or a commit's.
tmp=$(mktemp -d /tmp/idempotency-package-XXXXXX)
staging=""
trap 'rm -rf "$tmp" ${staging:+"$staging"}' EXIT
if [ -n "$commit" ]; then
    rev=$(git rev-parse --verify -q "$commit^{commit}") || die "no commit '$commit' in this clone"
    tree=$tmp/src
    mkdir -p "$tree"
    git archive "$rev" | tar -x -C "$tree"
else
    rev=$(git rev-parse HEAD)
    tree=$ROOT
    dirty=$(git status --porcelain --untracked-files=normal)
    if [ -n "$dirty" ] && [ "$allow_dirty" != 1 ]; then
        die "the working tree has uncommitted changes (commit or stash them; --allow-dirty for a test build):
$dirty"
    fi
fi
# The payload's times (not the build's: build-env.sh keeps SOURCE_DATE_EPOCH from cargo).
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct "$rev")}

# One version: Cargo.toml's, the control file's default_version ('@CARGO_VERSION@' is replaced by
# cargo pgrx with Cargo.toml's), META.json's and the extension's version in META.json.
version=$(python3 - "$tree" <<'EOF'
import json, os, re, sys, tomllib
tree = sys.argv[1]
with open(os.path.join(tree, "Cargo.toml"), "rb") as f:
    cargo = tomllib.load(f)["package"]["version"]
with open(os.path.join(tree, "idempotency.control")) as f:
    m = re.search(r"^\s*default_version\s*=\s*'([^']*)'", f.read(), re.M)
control = m.group(1) if m else None
with open(os.path.join(tree, "META.json")) as f:
    meta = json.load(f)
found = {
    "Cargo.toml (package.version)": cargo,
    "idempotency.control (default_version)": cargo if control == "@CARGO_VERSION@" else control,
    "META.json (version)": meta.get("version"),
    "META.json (provides.idempotency.version)": meta.get("provides", {}).get("idempotency", {}).get("version"),
}
core = os.path.join(tree, "crates", "idempotency-core", "Cargo.toml")
if os.path.exists(core):  # released with the extension
    with open(core, "rb") as f:
        found["crates/idempotency-core/Cargo.toml (package.version)"] = tomllib.load(f)["package"]["version"]
if len(set(found.values())) != 1:
    print("package.sh: the versions disagree:", file=sys.stderr)
    for where, v in found.items():
        print(f"  {where}: {v}" + (" (@CARGO_VERSION@)" if where.startswith("idempotency.control") and control == "@CARGO_VERSION@" else ""), file=sys.stderr)
    sys.exit(2)
print(cargo)
EOF
) || exit 2

# The pg_config of each major version, checked before anything is built.
declare -A pg_configs=()
for m in "${wanted[@]}"; do
    var=PG_CONFIG_$m
    if [ -n "${!var:-}" ]; then
        pgc=${!var}
    else
        pgc=$(scripts/pg-server.sh "$m" 2>"$tmp/pg-server.log") \
            || die "PostgreSQL $m is missing: scripts/pg-server.sh $m failed ($(tail -n 1 "$tmp/pg-server.log")); set PG_CONFIG_$m"
    fi
    [ -x "$pgc" ] || die "PostgreSQL $m is missing: no pg_config at $pgc"
    got=$("$pgc" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
    [ "$got" = "$m" ] || die "$pgc is PostgreSQL $got, not $m"
    pg_configs[$m]=$pgc
done

out=${out:-$ROOT/target/packages/idempotency-$version}
if [ -e "$out" ] && [ -n "$(ls -A "$out")" ] && [ ! -f "$out/SHA256SUMS" ]; then
    die "$out exists and is not an earlier output of this script (no SHA256SUMS): choose another --out"
fi
mkdir -p "$(dirname "$out")"
staging=$(mktemp -d "$(dirname "$out")/.package-XXXXXX")

# shellcheck source=scripts/build-env.sh
source "$ROOT/scripts/build-env.sh"
arch=$(dpkg --print-architecture)
json() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); [d:=d[k] for k in sys.argv[2:]]; print(d)' "$tree/META.json" "$@"; }
maintainer=$(json maintainer)
homepage=$(json resources homepage 2>/dev/null || echo "https://pgxn.org/dist/idempotency/")
summary=$(json abstract)
long=$(json description | fold -s -w 76 | sed 's/ *$//; s/^$/./; s/^/ /')
license=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["license"])' "$tree/META.json")
[ "$license" = postgresql ] || die "META.json's license is '$license': the copyright file below is the PostgreSQL Licence's"
year=$(date -u -d "@$epoch" +%Y)

for m in "${wanted[@]}"; do
    pkg=postgresql-$m-idempotency
    deb=${pkg}_$version-1_$arch.deb
    echo "== $deb ($profile build against ${pg_configs[$m]})" >&2
    stage=$tmp/stage-$m
    (cd "$tree" && cargo pgrx package --pg-config "${pg_configs[$m]}" "${pgrx_profile[@]}" --out-dir "$stage") \
        >"$tmp/pgrx-$m.log" 2>&1 || { cat "$tmp/pgrx-$m.log" >&2; die "cargo pgrx package failed for PostgreSQL $m"; }
    so=$(find "$stage" -name idempotency.so -type f)
    extdir=$(dirname "$(find "$stage" -name idempotency.control -type f)")
    [ -f "$so" ] && [ -f "$extdir/idempotency--$version.sql" ] \
        || die "cargo pgrx package laid out no idempotency.so or idempotency--$version.sql for $m"
    grep -q "^default_version = '$version'" "$extdir/idempotency.control" \
        || die "the packaged control file's default_version is not $version"

    root=$tmp/root-$m
    lib=$root/usr/lib/postgresql/$m/lib
    ext=$root/usr/share/postgresql/$m/extension
    doc=$root/usr/share/doc/$pkg
    mkdir -p "$lib" "$ext" "$doc" "$root/DEBIAN"
    # As Debian's packages ship libraries: no debugging sections (they name the build's files).
    strip --strip-unneeded --remove-section=.comment --remove-section=.note -o "$lib/idempotency.so" "$so"
    cp "$extdir/idempotency.control" "$extdir"/idempotency--*.sql "$ext/"
    cat >"$doc/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: idempotency
Upstream-Contact: $maintainer
Source: $homepage

Files: *
Copyright: $year, the idempotency authors
License: PostgreSQL

License: PostgreSQL
 Permission to use, copy, modify, and distribute this software and its
 documentation for any purpose, without fee, and without a written agreement
 is hereby granted, provided that the above copyright notice and this
 paragraph and the following two paragraphs appear in all copies.
 .
 IN NO EVENT SHALL THE AUTHORS BE LIABLE TO ANY PARTY FOR DIRECT, INDIRECT,
 SPECIAL, INCIDENTAL, OR CONSEQUENTIAL DAMAGES, INCLUDING LOST PROFITS,
 ARISING OUT OF THE USE OF THIS SOFTWARE AND ITS DOCUMENTATION, EVEN IF THE
 AUTHORS HAVE BEEN ADVISED OF THE POSSIBILITY OF SUCH DAMAGE.
 .
 THE AUTHORS SPECIFICALLY DISCLAIM ANY WARRANTIES, INCLUDING, BUT NOT LIMITED
 TO, THE IMPLIED WARRANTIES OF MERCHANTABILITY AND FITNESS FOR A PARTICULAR
 PURPOSE. THE SOFTWARE PROVIDED HEREUNDER IS ON AN "AS IS" BASIS, AND THE
 AUTHORS HAVE NO OBLIGATIONS TO PROVIDE MAINTENANCE, SUPPORT, UPDATES,
 ENHANCEMENTS, OR MODIFICATIONS.
EOF

    # The C library (and libgcc-s1, which unwinds Rust panics) at the versions the library's
    # symbols need, as dpkg-shlibdeps computes them for Debian's own packages.
    mkdir -p "$tmp/shlibs-$m/debian"
    printf 'Source: idempotency\n\nPackage: %s\nArchitecture: any\n' "$pkg" >"$tmp/shlibs-$m/debian/control"
    shlibs=$(cd "$tmp/shlibs-$m" && dpkg-shlibdeps -O "$lib/idempotency.so" 2>"$tmp/shlibdeps-$m.log" \
        | sed -n 's/^shlibs:Depends=//p') \
        || { cat "$tmp/shlibdeps-$m.log" >&2; die "dpkg-shlibdeps failed on the library for $m"; }

    find "$root" -type d -exec chmod 755 {} +
    find "$root" -type f -exec chmod 644 {} +
    (cd "$root" && find usr -type f | LC_ALL=C sort | xargs md5sum) >"$root/DEBIAN/md5sums"
    size=$(du -sk --apparent-size "$root/usr" | cut -f1)
    {
        echo "Package: $pkg"
        echo "Source: idempotency"
        echo "Version: $version-1"
        echo "Architecture: $arch"
        echo "Maintainer: $maintainer"
        echo "Installed-Size: $size"
        echo "Depends: postgresql-$m${shlibs:+, $shlibs}"
        echo "Section: database"
        echo "Priority: optional"
        echo "Homepage: $homepage"
        echo "Description: $summary"
        echo "$long"
    } >"$root/DEBIAN/control"
    chmod 644 "$root/DEBIAN/control" "$root/DEBIAN/md5sums"
    find "$root" -exec touch -h -d "@$epoch" {} +
    SOURCE_DATE_EPOCH=$epoch dpkg-deb --root-owner-group -Zxz -z"$xz_level" --build "$root" "$staging/$deb" >/dev/null
done

# The portable edition: its scripts as committed, and the pg_tle scripts made from them where
# scripts/portable.py makes them on demand.
cp "$tree"/dist/*.sql "$staging/"
if [ -f "$tree/scripts/portable.py" ] && grep -q '^ *scripts/portable.py pgtle ' "$tree/scripts/portable.py"; then
    for plain in "$tree"/dist/idempotency-portable*.sql; do
        name=$(basename "$plain")
        case "$name" in
            idempotency-portable.sql) mode=pgtle; pgtle_name=pgtle-idempotency.sql ;;
            idempotency-portable--*--*.sql) mode=pgtle-update; pgtle_name=pgtle-idempotency--${name#idempotency-portable--} ;;
            *) continue ;;
        esac
        [ -f "$staging/$pgtle_name" ] && continue
        grep -q "^ *scripts/portable.py $mode " "$tree/scripts/portable.py" || continue
        (cd "$tree" && python3 scripts/portable.py "$mode" "$plain") >"$staging/$pgtle_name" \
            || die "scripts/portable.py $mode $name failed"
    done
fi
# The PGXN distribution: the commit's files under idempotency-<version>/.
git archive --format zip --prefix "idempotency-$version/" -o "$staging/idempotency-$version.zip" "$rev"

(cd "$staging" && find . -maxdepth 1 -type f ! -name SHA256SUMS -printf '%f\n' | LC_ALL=C sort \
    | xargs sha256sum >SHA256SUMS)
find "$staging" -type f -exec chmod 644 {} +
chmod 755 "$staging"
rm -rf "$out"
mv "$staging" "$out"
staging=""
echo "$out"
