"""META.json (the PGXN distribution metadata) against the PGXN Meta Spec v1.0.0 and the crate, and
the versions that must agree (Cargo.toml, the core crate, the control file). Reads the files;
needs no server."""

import json
import os
import re
import tomllib

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$")
# The license strings the spec defines (a subset: the ones a PostgreSQL extension plausibly uses).
PGXN_LICENSES = {"agpl_3", "apache_1_1", "apache_2_0", "artistic_2", "bsd", "freebsd", "gpl_2", "gpl_3",
                 "lgpl_2_1", "lgpl_3_0", "mit", "mozilla_1_1", "open_source", "postgresql", "unrestricted"}


def load():
    with open(os.path.join(ROOT, "META.json")) as f:
        return json.load(f)


def cargo_version():
    with open(os.path.join(ROOT, "Cargo.toml"), "rb") as f:
        return tomllib.load(f)["package"]["version"]


def test_meta_json_has_the_required_keys():
    meta = load()
    for key in ("name", "abstract", "version", "maintainer", "license", "provides", "meta-spec"):
        assert meta.get(key), f"META.json lacks {key}"
    assert meta["name"] == "idempotency"
    assert meta["meta-spec"]["version"] == "1.0.0"
    assert SEMVER.match(meta["version"]), meta["version"]
    assert meta["license"] in PGXN_LICENSES
    maintainers = meta["maintainer"] if isinstance(meta["maintainer"], list) else [meta["maintainer"]]
    assert all(isinstance(m, str) and m for m in maintainers)
    ext = meta["provides"]["idempotency"]
    assert ext["version"] == meta["version"]
    assert os.path.isfile(os.path.join(ROOT, ext["file"])), ext["file"]
    assert os.path.isfile(os.path.join(ROOT, ext["docfile"])), ext["docfile"]
    # PostgreSQL 15 to 18, the versions scripts/test.sh tests (a PGXN version range).
    assert meta["prereqs"]["runtime"]["requires"]["PostgreSQL"] == ">= 15.0.0, < 19.0.0"


def test_meta_json_license_matches_cargo():
    with open(os.path.join(ROOT, "Cargo.toml"), "rb") as f:
        assert tomllib.load(f)["package"]["license"].lower() == load()["license"]


def test_meta_json_version_is_the_crate_version():
    assert load()["version"] == cargo_version()


def test_the_core_crate_has_the_extensions_version():
    """The pure core (crates/idempotency-core) is released with the extension: one version, so a
    reader of its manifest is not told it is older than the code it holds."""
    with open(os.path.join(ROOT, "crates", "idempotency-core", "Cargo.toml"), "rb") as f:
        assert tomllib.load(f)["package"]["version"] == cargo_version()


def test_the_control_files_default_version_is_the_crate_version():
    """idempotency.control says default_version = '@CARGO_VERSION@', which cargo pgrx replaces with
    Cargo.toml's package.version when it installs or packages the extension (test_packages.py checks
    the packaged control file): one version, written in Cargo.toml (scripts/set-version.sh)."""
    with open(os.path.join(ROOT, "idempotency.control")) as f:
        m = re.search(r"^default_version = '([^']*)'$", f.read(), re.M)
    assert m, "idempotency.control has no default_version"
    assert m.group(1) in ("@CARGO_VERSION@", cargo_version())
