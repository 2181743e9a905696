#!/usr/bin/env bash
# Runs every test, on every supported PostgreSQL major version: installs the prerequisites,
# runs the checks that read files only (tests/static: the docs' links, the layering of src/, the
# product's text, the packaging metadata; no server, nothing built, seconds), checks formatting
# and lints (each version's code paths), runs the unit and #[pg_test] tests
# (cargo pgrx test pgNN), the isolation specs (tests/isolation, PostgreSQL's isolation tester)
# and the integration tests against throwaway clusters (concurrency, crashes, oracle, dump,
# upgrades, ...): the whole suite on PostgreSQL 15, its core on 16, 17
# and 18 (README, "Tests", says which files).
#
# IDEMPOTENCY_PG_VERSIONS (default "15 16 17 18") chooses the versions, e.g. "15" for a quick
# local run; the whole integration suite runs on the first one listed. The core's tests marked
# slow (backlogs swept under claim load, pg_cron's recipe) run on the first and the last version;
# IDEMPOTENCY_SLOW_EVERYWHERE=1 runs them on the versions between too (CI keeps to 60 minutes
# without them). The #[pg_test] tests (cargo pgrx test, a build of its own per version: minutes
# on two cores) run on the first version; IDEMPOTENCY_PGRX_TEST_EVERYWHERE=1 runs them on every
# version (the integration core, which calls every function through every path, runs on every
# version either way, so each version's compat code is exercised).
#
# After each version's integration tests its Debian package is made (scripts/package.sh with
# IDEMPOTENCY_PACKAGE_PROFILE=debug: it packages the debug build `cargo pgrx install` just made,
# in seconds; a release build takes ten minutes or more per version) and tested as a user installs
# it (tests/integration/test_packages.py): apt-get install into Debian's 15, the update from the
# previous release's package and apt-get remove; on 16-18 the payload in a copy of the server. The
# previous release's package is built once and cached in $IDEMPOTENCY_CACHE/packages (default
# /var/cache/idempotency, keyed by its commit); IDEMPOTENCY_SKIP_PREVIOUS_PACKAGE=1 skips only the
# update test where that cache is cold and the build is not wanted.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's header says when it starts; the run ends with how long each step took (CI must
# keep to 60 minutes on a fresh machine: this shows where they go).
steps=()
step() {
    steps+=("$SECONDS $*")
    echo "== $* [at ${SECONDS}s]"
}
report_steps() {
    local i start next
    echo "== time per step (s)"
    for i in "${!steps[@]}"; do
        start=${steps[$i]%% *}
        next=$SECONDS
        [ $((i + 1)) -lt ${#steps[@]} ] && next=${steps[$((i + 1))]%% *}
        printf '%6d  %s\n' $((next - start)) "${steps[$i]#* }"
    done
    echo "   total ${SECONDS}s"
}

read -r -a VERSIONS <<<"${IDEMPOTENCY_PG_VERSIONS:-15 16 17 18}"
# The integration suite's core, run on every version (the rest needs the HTTP and Node
# examples, a standby or minutes of soak, and runs on the first version).
CORE=(test_concurrency.py test_model.py test_canonical_oracle.py test_encodings.py test_worker.py
      test_crash.py test_privileges.py test_search_path.py test_upgrade.py test_direct_writes.py
      test_direct_fidelity.py test_hardening.py test_expiry_and_dump.py test_bad_input.py
      test_hot_updates.py test_batch.py test_partitioned.py test_damaged_jsonb.py
      test_binding_settings.py test_portable.py test_pg_cron.py test_pooler.py)

pgdata_dirs=()
packages=$(mktemp -d /tmp/idempotency-packages-XXXXXX)
trap 'rm -rf "${pgdata_dirs[@]}" "$packages"; report_steps' EXIT
step "the prerequisites (scripts/bootstrap.sh)"
scripts/bootstrap.sh
# The build's path mappings (no path of this machine in idempotency.so), the same for every build
# below, so that scripts/package.sh reuses the builds of cargo pgrx install.
source scripts/build-env.sh

# First what needs neither a server nor a build: a dead link or an upward call fails in seconds.
step "static checks (tests/static: docs, links, layering, product text, packaging files), no server"
python3 -m pytest -q tests/static

step "dist/: the portable edition is what scripts/portable.py builds from the sources"
scripts/portable.py --check

step "cargo fmt --check, cargo clippy (PostgreSQL ${VERSIONS[*]})"
cargo fmt --all -- --check
for v in "${VERSIONS[@]}"; do
    cargo clippy --all-targets --no-default-features --features "pg$v" -- -D warnings
done
cargo clippy -p idempotency-core --all-targets --all-features -- -D warnings
# The canonicalizer fuzz harness is a crate of its own (run by tests/integration/test_fuzz.py).
(cd fuzz && cargo fmt -- --check && cargo clippy --release -- -D warnings)

step "the pure core (crates/idempotency-core): unit and property tests, no PostgreSQL"
cargo test -p idempotency-core -q

step "examples/http-service: fmt, clippy, unit tests (its end-to-end tests run with pytest)"
cargo fmt --manifest-path examples/http-service/Cargo.toml -- --check
cargo clippy --manifest-path examples/http-service/Cargo.toml --locked --all-targets -- -D warnings
cargo test --manifest-path examples/http-service/Cargo.toml --locked -q

# The previous release, whose package the update test on 15 installs first (git tag v0.5.0).
previous_commit=77427ba9c848efa40e8bfaab4402f2e19f2f5a14
previous_packages=${IDEMPOTENCY_CACHE:-/var/cache/idempotency}/packages/0.5.0-$previous_commit-debug
first=${VERSIONS[0]}
last=${VERSIONS[-1]}
for v in "${VERSIONS[@]}"; do
    pg_config=$(scripts/pg-server.sh "$v")
    if [ "$v" = "$first" ] || [ "${IDEMPOTENCY_PGRX_TEST_EVERYWHERE:-0}" = 1 ]; then
        step "PostgreSQL $v: unit and #[pg_test] tests (cargo pgrx test pg$v)"
        # initdb refuses root: the test cluster runs as postgres, in a fresh directory.
        pgdata=$(mktemp -u /tmp/idempotency-pgrx-XXXXXX)
        pgdata_dirs+=("$pgdata")
        # The tests run side by side, each in a transaction it rolls back; each claims keys of
        # its own (a claim meeting another session's uncommitted claim of the same key answers
        # in_progress at once, by design).
        cargo pgrx test "pg$v" --runas postgres --pgdata "$pgdata"
    else
        step "PostgreSQL $v: #[pg_test] tests skipped (they run on $first; IDEMPOTENCY_PGRX_TEST_EVERYWHERE=1 runs them here)"
    fi

    cargo pgrx install --pg-config "$pg_config" >/dev/null
    step "PostgreSQL $v: isolation specs (tests/isolation: races as deterministic permutations)"
    scripts/isolation.sh "$pg_config"

    step "PostgreSQL $v: integration tests (pytest, real sessions against throwaway clusters)"
    scripts/pg-cron.sh "$v" >/dev/null  # schedule_sweep's tests (Debian's package on 15, built on 16-18)
    # No -m: the tests marked slow (pytest.ini) run too; `-m "not slow"` is only for quick local runs.
    if [ "$v" = "$first" ]; then
        PG_BIN=$(dirname "$pg_config") python3 -m pytest -q --durations=10 tests/integration
    elif [ "$v" = "$last" ] || [ "${IDEMPOTENCY_SLOW_EVERYWHERE:-0}" = 1 ]; then
        PG_BIN=$(dirname "$pg_config") python3 -m pytest -q --durations=10 "${CORE[@]/#/tests/integration/}"
    else
        PG_BIN=$(dirname "$pg_config") python3 -m pytest -q --durations=10 -m "not slow" \
            "${CORE[@]/#/tests/integration/}"
    fi

    step "PostgreSQL $v: its Debian package (scripts/package.sh, debug build), installed as a user would"
    # --allow-dirty: a local run may have changes; the refusal itself is tested (test_packages.py).
    # Twice on the first version: the test checks that both give the same bytes.
    again=()
    [ "$v" = "$first" ] && again=("$packages/$v-again")
    for out in "$packages/$v" "${again[@]}"; do
        IDEMPOTENCY_PACKAGE_PROFILE=debug scripts/package.sh --allow-dirty --out "$out" "$v" >/dev/null
    done
    previous=()
    if [ "$v" = 15 ]; then
        # After this version's packages: the previous release's build shares the target
        # directory (and its dependencies' builds) and leaves cargo part of 15's to build again.
        if [ -f "$previous_packages/SHA256SUMS" ]; then
            previous=("IDEMPOTENCY_PREVIOUS_PACKAGES=$previous_packages")
        elif [ "${IDEMPOTENCY_SKIP_PREVIOUS_PACKAGE:-0}" = 1 ]; then
            echo "   the previous release's package: skipped (IDEMPOTENCY_SKIP_PREVIOUS_PACKAGE=1, none cached)"
        elif git cat-file -e "$previous_commit^{commit}" 2>/dev/null; then
            echo "   the previous release's package: built once (under a minute), cached in $previous_packages"
            IDEMPOTENCY_PACKAGE_PROFILE=debug scripts/package.sh --commit "$previous_commit" \
                --out "$previous_packages" 15 >/dev/null
            previous=("IDEMPOTENCY_PREVIOUS_PACKAGES=$previous_packages")
        else
            echo "   the previous release's package: skipped (commit $previous_commit not in this clone, none cached)"
        fi
    fi
    env "${previous[@]}" IDEMPOTENCY_PACKAGES="$packages/$v" IDEMPOTENCY_PACKAGES_AGAIN="${again[*]}" \
        PG_BIN=$(dirname "$pg_config") python3 -m pytest -q -k "not refuses and not set_version" tests/integration/test_packages.py
done

# The portable edition (docs/managed.md) on servers that have no file of the native extension:
# the contract files that matter, the plain script on 15 (scripts/pg-portable.sh), pg_tle on 18
# (scripts/pg-tle.sh; skipped, saying so, where the pg_tle tarball is absent): the isolation specs
# (scripts/isolation.sh --portable), then the contract files. Tests of what only the native
# edition has are marked native_only and skipped with their reason.
PORTABLE=(test_model.py test_concurrency.py test_bad_input.py test_audit.py test_hashed_keys.py
          test_signed_keys.py test_privileges.py test_batch.py test_search_path.py
          test_expiry_and_dump.py test_patterns.py test_binding_settings.py test_partitioned.py
          test_hardening.py test_pooler.py test_portable_update.py test_monitoring.py)
for v in "${VERSIONS[@]}"; do
    case "$v" in
        15)
            step "the portable edition, plain script, on PostgreSQL 15 without the library"
            portable_config=$(scripts/pg-portable.sh 15)
            route=plain
            ;;
        18)
            if [ ! -f "${PG_TLE_TARBALL_DIR:-../shared/vendor/pg_tle}/SHA256SUMS" ]; then
                step "the portable edition through pg_tle: skipped (no pg_tle source tarball in ${PG_TLE_TARBALL_DIR:-../shared/vendor/pg_tle})"
                continue
            fi
            step "the portable edition through pg_tle, on PostgreSQL 18 without the library"
            portable_config=$(scripts/pg-tle.sh 18)
            route=pgtle
            ;;
        *) continue ;;
    esac
    step "the portable edition ($route): isolation specs (tests/isolation, as natively)"
    scripts/isolation.sh --portable "$route" "$portable_config"
    IDEMPOTENCY_EDITION=portable PG_BIN=$(dirname "$portable_config") \
        python3 -m pytest -q "${PORTABLE[@]/#/tests/integration/}"
done

# The client packages (clients/): each built into its artifact (a wheel, an npm tarball, a crate) and
# tested against throwaway clusters of the first version, where the extension is installed.
first_bin=$(dirname "$(scripts/pg-server.sh "$first")")
step "clients/python: the pg-idempotency wheel and its tests (PostgreSQL $first)"
PG_BIN=$first_bin scripts/clients-python.sh
step "clients/node: npm ci, type check, npm pack, the tests (PostgreSQL $first)"
PG_BIN=$first_bin scripts/clients-node.sh
step "clients/rust: fmt, clippy, the tests, cargo package (PostgreSQL $first)"
PG_BIN=$first_bin scripts/clients-rust.sh
step "clients/conformance: the HTTP conformance suite against the five adapters (PostgreSQL $first)"
PG_BIN=$first_bin scripts/clients-conformance.sh

# Citus (docs/scaling.md): a coordinator and two workers on PostgreSQL 18, Citus 14.0.1 built from
# its source tarball (scripts/citus.sh; CITUS_TARBALL_DIR, default ../shared/vendor/citus beside
# the clone). Where the tarballs are absent this is skipped, saying so.
for v in "${VERSIONS[@]}"; do
    [ "$v" = 18 ] || continue
    if [ -f "${CITUS_TARBALL_DIR:-../shared/vendor/citus}/SHA256SUMS" ]; then
        step "Citus 14.0.1 on PostgreSQL 18: a coordinator and two workers"
        pg_config=$(scripts/citus.sh 18)
        CITUS_PG_BIN=$(dirname "$pg_config") PG_BIN=$(dirname "$pg_config") \
            python3 -m pytest -q -m citus tests/integration/test_citus.py
    else
        step "Citus: skipped (no Citus source tarballs in ${CITUS_TARBALL_DIR:-../shared/vendor/citus})"
    fi
done

# pg_upgrade of a cluster with the extension and live keys to the newest version tested (17 or
# 18), once every server has the extension installed. From 16, not from Debian's 15: its 15.20
# marks every column with a `pg_attver` attoption that the PyPI builds of 17.11 and 18.6 do not
# know, so pg_upgrade from it fails here for any table, with or without the extension.
from="" to=""
for v in "${VERSIONS[@]}"; do
    case "$v" in
        16) from=$v ;;
        17 | 18) to=$v ;;
    esac
done
if [ -n "$from" ] && [ -n "$to" ]; then
    step "pg_upgrade from PostgreSQL $from to $to"
    PG_UPGRADE_FROM=$(dirname "$(scripts/pg-server.sh "$from")") \
        PG_UPGRADE_TO=$(dirname "$(scripts/pg-server.sh "$to")") \
        python3 -m pytest -q tests/integration/test_pg_upgrade.py
fi
