#!/usr/bin/env bash
# Sets the release's version, the one edit a release starts with (docs/installing.md, "Building a
# release"):
#
#   scripts/set-version.sh 0.7.0
#
# Cargo.toml's version is the extension's (idempotency.control says default_version =
# '@CARGO_VERSION@', which cargo pgrx replaces with it); this writes it there and into the copies
# that must agree: crates/idempotency-core/Cargo.toml (released with the extension), META.json
# (its version and the extension's in "provides") and Cargo.lock. scripts/package.sh and
# tests/static/test_packaging.py refuse versions that disagree.
set -euo pipefail
cd "$(dirname "$0")/.."

new=${1:?usage: scripts/set-version.sh VERSION (e.g. 0.7.0)}
[[ "$new" =~ ^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$ ]] \
    || { echo "set-version.sh: '$new' is not a version MAJOR.MINOR.PATCH" >&2; exit 2; }
grep -q "^default_version = '@CARGO_VERSION@'$" idempotency.control \
    || { echo "set-version.sh: idempotency.control's default_version is not '@CARGO_VERSION@'" >&2; exit 2; }

python3 - "$new" <<'EOF'
import json, re, sys
new = sys.argv[1]
for path in ("Cargo.toml", "crates/idempotency-core/Cargo.toml"):
    with open(path) as f:
        text = f.read()
    # The first version line is [package]'s.
    text, n = re.subn(r'(?m)^version = "[^"]*"$', f'version = "{new}"', text, count=1)
    assert n == 1, f"no version line in {path}"
    with open(path, "w") as f:
        f.write(text)
with open("META.json") as f:
    meta = json.load(f)
meta["version"] = new
meta["provides"]["idempotency"]["version"] = new
with open("META.json", "w") as f:
    f.write(json.dumps(meta, indent=3, ensure_ascii=False) + "\n")
EOF
cargo update --offline --workspace -q
old=$(git show HEAD:Cargo.toml | sed -n 's/^version = "\(.*\)"$/\1/p' | head -n 1)
echo "set-version.sh: $old -> $new in Cargo.toml, crates/idempotency-core/Cargo.toml, META.json, Cargo.lock"
[ -f "sql/idempotency--$old--$new.sql" ] || [ "$old" = "$new" ] \
    || echo "set-version.sh: next, the upgrade script sql/idempotency--$old--$new.sql and CHANGELOG.md's heading"
