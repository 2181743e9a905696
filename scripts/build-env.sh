# The build's path mappings, shared by scripts/test.sh and scripts/package.sh (sourced, not run):
# idempotency.so must not record the build machine's directories (a panic's location names its
# source file; the C shim's error reports name their header), so rustc and the C compiler map
# them to fixed names:
#
#   $CARGO_HOME                     ->  /cargo        (the crates' sources: pgrx-0.18.1/src/...)
#   the cargo target directory      ->  /target       (generated bindings, the C shim)
#   this repository                 ->  /idempotency  (its own sources are named relatively anyway)
#   $IDEMPOTENCY_CACHE              ->  /idempotency-cache  (the relocatable servers' headers)
#
# They are passed as target-specific settings (CARGO_TARGET_<TRIPLE>_RUSTFLAGS and
# CFLAGS_<triple>, which only cargo and the cc crate read), not RUSTFLAGS: RUSTFLAGS would
# replace the link argument cargo-pgrx adds for the cdylib (and CFLAGS would reach the C
# extensions the tests build with make). Every build of the extension must see the same
# values, or cargo rebuilds everything: scripts/test.sh sources this file before its first
# cargo command, so the packages it makes (scripts/package.sh, debug profile) reuse its builds.
# A RUSTFLAGS or CARGO_ENCODED_RUSTFLAGS already in the environment would override the mapping:
# scripts/package.sh refuses to run with them set. SOURCE_DATE_EPOCH is removed from the build's
# environment: the cc crate watches it, so a value that differs between two builds (the package's
# times are the commit's) would make cargo build pgrx-pg-sys and everything above it again; the
# library's bytes do not depend on it (scripts/package.sh sets the package's times itself).

_be_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
_be_cargo_home=$(cd "${CARGO_HOME:-$HOME/.cargo}" 2>/dev/null && pwd -P || echo "${CARGO_HOME:-$HOME/.cargo}")
_be_target=${CARGO_TARGET_DIR:-$_be_root/target}
mkdir -p "$_be_target"
_be_target=$(cd "$_be_target" && pwd -P)
_be_cache=${IDEMPOTENCY_CACHE:-/var/cache/idempotency}
_be_triple=$(rustc -vV | sed -n 's/^host: //p')
_be_var=$(echo "$_be_triple" | tr 'a-z-' 'A-Z_')

# rustc applies the last mapping that matches: the most specific directories come last.
_be_rust="--remap-path-prefix=$_be_cache=/idempotency-cache"
_be_rust+=" --remap-path-prefix=$_be_root=/idempotency"
_be_rust+=" --remap-path-prefix=$_be_cargo_home=/cargo"
_be_rust+=" --remap-path-prefix=$_be_target=/target"
_be_c="-ffile-prefix-map=$_be_cache=/idempotency-cache"
_be_c+=" -ffile-prefix-map=$_be_root=/idempotency"
_be_c+=" -ffile-prefix-map=$_be_cargo_home=/cargo"
_be_c+=" -ffile-prefix-map=$_be_target=/target"

export "CARGO_TARGET_${_be_var}_RUSTFLAGS=$_be_rust"
export "CFLAGS_$(echo "$_be_triple" | tr '-' '_')=$_be_c"
unset _be_root _be_cargo_home _be_target _be_cache _be_triple _be_var _be_rust _be_c
unset SOURCE_DATE_EPOCH
