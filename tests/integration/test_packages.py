"""The release's files (scripts/package.sh) tested the way a user installs them.

scripts/test.sh builds them (IDEMPOTENCY_PACKAGE_PROFILE=debug: the builds it already has) and
runs this file with IDEMPOTENCY_PACKAGES naming the output folder, after the integration tests of
each version:

* every version: the folder's files and SHA256SUMS, the package's fields and paths (the PostgreSQL
  project's apt layout for NN), a library that records no path of the build machine and needs
  only the C library, and building twice gives the same bytes;
* PostgreSQL 15 from Debian: `apt-get install ./postgresql-15-idempotency_*.deb` into the real
  server and package database, without the files `cargo pgrx install` put there, in a mount
  namespace of this process whose /usr and /var are overlaid (nothing outside it sees a change:
  the source install stays for the tests after this file and anything else on the machine; where
  no namespace can be made, the source install's files are set aside and put back afterwards,
  byte for byte), the demo's outcomes in a fresh cluster
  with the library preloaded, `ALTER EXTENSION ... UPDATE` from the previous release's package
  (IDEMPOTENCY_PREVIOUS_PACKAGES, built once and cached by scripts/test.sh) with keys in flight,
  then `apt-get remove` leaves no file and CREATE EXTENSION is refused;
* the relocatable servers of 16-18 (scripts/pg-server.sh, not apt): the package's payload
  (dpkg-deb -x) installed into a copy of the server, its paths mapped, and the demo's outcomes.

Without IDEMPOTENCY_PACKAGES only the refusals of scripts/package.sh run (they build nothing)."""

import contextlib
import ctypes
import filecmp
import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import zipfile

import psycopg
import pytest

from cluster import PG_BIN, ROOT, Cluster
from helpers import claim

# Absolute: apt-get takes a path with a slash in it for a file (else it is a package's name).
PACKAGES = os.path.abspath(os.environ["IDEMPOTENCY_PACKAGES"]) if os.environ.get("IDEMPOTENCY_PACKAGES") else None
PREVIOUS = (os.path.abspath(os.environ["IDEMPOTENCY_PREVIOUS_PACKAGES"])
            if os.environ.get("IDEMPOTENCY_PREVIOUS_PACKAGES") else None)
PACKAGE_SH = os.path.join(ROOT, "scripts", "package.sh")


def pg_config(bin_dir, what):
    return subprocess.run([os.path.join(bin_dir, "pg_config"), what], check=True, capture_output=True,
                          text=True).stdout.strip()


MAJOR = pg_config(PG_BIN, "--version").split()[1].split(".")[0]
APT = PG_BIN == f"/usr/lib/postgresql/{MAJOR}/bin" and subprocess.run(
    ["dpkg", "-s", f"postgresql-{MAJOR}"], capture_output=True).returncode == 0


def cargo_version():
    import tomllib
    with open(os.path.join(ROOT, "Cargo.toml"), "rb") as f:
        return tomllib.load(f)["package"]["version"]


VERSION = cargo_version()
ARCH = subprocess.run(["dpkg", "--print-architecture"], check=True, capture_output=True, text=True).stdout.strip()
PKG = f"postgresql-{MAJOR}-idempotency"


def deb_in(folder, version=VERSION):
    return os.path.join(folder, f"{PKG}_{version}-1_{ARCH}.deb")


def run(*cmd, check=True, **kw):
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, **kw)


def deb_contents(deb):
    """[(mode, owner, path)] of the package's payload, as dpkg-deb lists it."""
    rows = []
    listing = run("sh", "-c", 'dpkg-deb --fsys-tarfile "$0" | tar -tv --numeric-owner', deb).stdout
    for line in listing.splitlines():
        fields = line.split()
        rows.append((fields[0], fields[1], fields[-1].lstrip(".")))
    return rows


@pytest.fixture(autouse=True)
def clean_table():
    """conftest's autouse fixture starts a cluster with the source install: these tests start
    their own, with the package's files."""
    yield


needs_packages = pytest.mark.skipif(not PACKAGES, reason="IDEMPOTENCY_PACKAGES unset: scripts/test.sh builds the "
                                    "packages (scripts/package.sh) and sets it")


# --- the demo's outcomes -------------------------------------------------------------------------

def demo_outcomes(conn):
    """new, replay, mismatch, in_progress, takeover and sweep, as examples/demo.sql shows them."""
    outcome, token, *_ = claim(conn, "pay-123", {"amount": 1000, "currency": "EUR"}, scope="client-7")
    assert outcome == "new" and token > 0
    conn.execute("SELECT idempotency.complete('pay-123', '{\"charge_id\": \"ch_1\"}', 201, scope => 'client-7')")
    outcome, _, response, status, *_ = claim(conn, "pay-123", {"currency": "EUR", "amount": 1000.0}, scope="client-7")
    assert (outcome, response, status) == ("replay", {"charge_id": "ch_1"}, 201)
    conn.execute("SET client_min_messages = error")
    assert claim(conn, "pay-123", {"amount": 9999, "currency": "EUR"}, scope="client-7")[0] == "mismatch"
    conn.execute("RESET client_min_messages")
    outcome, first, *_ = claim(conn, "job-9", lease="1 second")
    assert outcome == "new"
    outcome, _, _, _, retry_after, _ = claim(conn, "job-9")
    assert outcome == "in_progress" and retry_after is not None
    conn.execute("SELECT idempotency.checkpoint('job-9', 'image-resized')")
    time.sleep(1.2)
    # Takeover: the lease ran out, the claim is new again with a larger token and the checkpoint.
    outcome, second, _, _, _, recovery_point = claim(conn, "job-9")
    assert (outcome, recovery_point) == ("new", "image-resized") and second > first
    with pytest.raises(psycopg.Error) as stale:
        conn.execute("SELECT idempotency.complete('job-9', '{}', token => %s)", (first,))
    assert stale.value.sqlstate == "IK003"  # the old worker is fenced off
    for i in range(3):
        assert claim(conn, f"tmp-{i}", ttl="1 second", lease="1 second")[0] == "new"
    time.sleep(1.2)
    assert conn.execute("SELECT idempotency.sweep()").fetchone()[0] >= 3


def preloaded_cluster(bin_dir):
    c = Cluster(settings={"shared_preload_libraries": "'idempotency'"}, bin=bin_dir)
    c.start()
    return c


def connect(cluster, dbname=None):
    info = cluster.conninfo()
    if dbname:
        info = info.replace(f"dbname={cluster.dbname}", f"dbname={dbname}")
    return psycopg.connect(info, autocommit=True)


# --- the folder and the package -------------------------------------------------------------------

@needs_packages
def test_the_folder_holds_the_release_files_and_their_checksums():
    names = sorted(os.listdir(PACKAGES))
    assert os.path.basename(deb_in(PACKAGES)) in names
    for sql in glob.glob(os.path.join(ROOT, "dist", "*.sql")):
        assert filecmp.cmp(sql, os.path.join(PACKAGES, os.path.basename(sql)), shallow=False), sql
    assert any(n.startswith("pgtle-idempotency") for n in names), names
    with zipfile.ZipFile(os.path.join(PACKAGES, f"idempotency-{VERSION}.zip")) as z:
        meta = json.loads(z.read(f"idempotency-{VERSION}/META.json"))
        assert meta["version"] == VERSION
        assert f"idempotency-{VERSION}/Cargo.toml" in z.namelist()
    sums = run("sha256sum", "-c", "SHA256SUMS", cwd=PACKAGES).stdout
    listed = sorted(line.rsplit(":", 1)[0] for line in sums.splitlines())
    assert listed == [n for n in names if n != "SHA256SUMS"]


@needs_packages
def test_the_package_has_the_fields_of_the_postgresql_projects_packages():
    deb = deb_in(PACKAGES)
    field = {}
    for name in ("Package", "Version", "Architecture", "Depends", "Section", "Homepage", "Description",
                 "Maintainer"):
        field[name] = run("dpkg-deb", "-f", deb, name).stdout.strip()
    assert field["Package"] == PKG and field["Version"] == f"{VERSION}-1"
    assert field["Section"] == "database" and field["Homepage"].startswith("https://")
    depends = [d.strip() for d in field["Depends"].split(",")]
    assert depends[0] == f"postgresql-{MAJOR}"
    assert any(re.fullmatch(r"libc6 \(>= 2\.\d+\)", d) for d in depends), depends
    assert field["Description"].splitlines()[0].strip()
    assert len(field["Description"].splitlines()) > 2  # a synopsis and a long description


@needs_packages
def test_the_package_holds_exactly_the_extensions_files_in_the_apt_layout():
    rows = deb_contents(deb_in(PACKAGES))
    assert all(owner == "0/0" for _, owner, _ in rows), rows
    files = {path: mode for mode, _, path in rows if not mode.startswith("d")}
    lib = f"/usr/lib/postgresql/{MAJOR}/lib"
    ext = f"/usr/share/postgresql/{MAJOR}/extension"
    if APT:  # the layout the PostgreSQL project's packages give the server, read from it
        assert pg_config(PG_BIN, "--pkglibdir") == lib
        assert pg_config(PG_BIN, "--sharedir") + "/extension" == ext
    upgrades = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "sql", "idempotency--*--*.sql")))
    expected = ({f"{lib}/idempotency.so", f"{ext}/idempotency.control", f"{ext}/idempotency--{VERSION}.sql",
                 f"/usr/share/doc/{PKG}/copyright"} | {f"{ext}/{u}" for u in upgrades})
    assert set(files) == expected
    assert set(files.values()) == {"-rw-r--r--"}
    tmp = tempfile.mkdtemp()
    try:
        run("dpkg-deb", "-x", deb_in(PACKAGES), tmp)
        for u in upgrades:
            assert filecmp.cmp(os.path.join(ROOT, "sql", u), tmp + f"{ext}/{u}", shallow=False), u
        with open(tmp + f"{ext}/idempotency.control") as f:
            assert f"default_version = '{VERSION}'" in f.read()
        with open(tmp + f"/usr/share/doc/{PKG}/copyright") as f:
            text = f.read()
        assert "License: PostgreSQL" in text and "Permission to use, copy, modify, and distribute" in text
    finally:
        shutil.rmtree(tmp)


@needs_packages
def test_the_library_records_no_path_of_the_build_machine():
    tmp = tempfile.mkdtemp()
    try:
        run("dpkg-deb", "-x", deb_in(PACKAGES), tmp)
        so = tmp + f"/usr/lib/postgresql/{MAJOR}/lib/idempotency.so"
        dynamic = run("readelf", "-d", so).stdout
        assert "RPATH" not in dynamic and "RUNPATH" not in dynamic, dynamic
        needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic))
        # The C library (libgcc_s, which unwinds Rust panics, comes with it: libc6 depends on it).
        assert needed <= {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2"}, needed
        ldd = run("ldd", so).stdout
        for line in ldd.splitlines():
            name = line.split()[0]
            assert name in needed or name.startswith(("linux-vdso", "/lib64/ld-linux")), ldd
        sections = run("readelf", "-S", "-W", so).stdout
        assert ".debug_info" not in sections and ".comment" not in sections
        strings = run("strings", "-n", "6", so).stdout
        cargo_home = os.path.realpath(os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo")))
        target = os.path.realpath(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")))
        cache = os.environ.get("IDEMPOTENCY_CACHE", "/var/cache/idempotency")
        for path in {os.path.realpath(ROOT), ROOT, cargo_home, target, cache, os.path.expanduser("~")}:
            assert path + "/" not in strings, f"idempotency.so names {path}"
        # The sources are named by their mapped paths (a panic's location).
        assert "/cargo/registry/src/" in strings
    finally:
        shutil.rmtree(tmp)


@needs_packages
def test_building_twice_gives_the_same_package():
    """Reproducible: the same sources and build give a byte-identical package (so the same file
    list and payload checksums). scripts/test.sh builds the folder twice on its first version
    (IDEMPOTENCY_PACKAGES_AGAIN; empty on the others); where that is unset the second build is made
    here, with the profile of IDEMPOTENCY_PACKAGE_PROFILE."""
    again = os.environ.get("IDEMPOTENCY_PACKAGES_AGAIN")
    if again == "":
        pytest.skip("scripts/test.sh builds the package twice on the first version only")
    made = None
    if again is None:
        made = tempfile.mkdtemp(prefix="idempotency-package-again-")
        again = os.path.join(made, "out")
        run(PACKAGE_SH, "--allow-dirty", "--out", again, MAJOR)
    try:
        first, second = deb_in(PACKAGES), deb_in(again)
        assert deb_contents(first) == deb_contents(second)
        assert run("sha256sum", first).stdout.split()[0] == run("sha256sum", second).stdout.split()[0]
        with open(os.path.join(PACKAGES, "SHA256SUMS")) as a, open(os.path.join(again, "SHA256SUMS")) as b:
            assert a.read() == b.read()
    finally:
        if made:
            shutil.rmtree(made)


# --- PostgreSQL 15 from Debian: apt-get install, update, remove -----------------------------------

def apt(*args):
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return run("apt-get", "-y", "-q", "--no-install-recommends", *args, env=env)


def installed_files():
    """The extension's files in the server's directories (the source install's or the package's)."""
    lib = pg_config(PG_BIN, "--pkglibdir")
    ext = pg_config(PG_BIN, "--sharedir") + "/extension"
    return sorted(glob.glob(f"{lib}/idempotency.so") + glob.glob(f"{ext}/idempotency.control")
                  + glob.glob(f"{ext}/idempotency--*.sql"))


CLONE_NEWNS = 0x00020000


@contextlib.contextmanager
def private_system():
    """This process in a mount namespace of its own, /usr and /var overlaid by a tmpfs: apt-get and
    dpkg install into Debian's real server and its real package database, and every change stays
    in the overlay, seen only by this process and its children (the clusters it starts); leaving
    it drops them. The other tests (and anything else running on the machine) never see the
    package, nor the source install's files missing. Yields False, changing nothing, where the
    kernel or the container refuses a namespace."""
    if os.environ.get("IDEMPOTENCY_APT_IN_PLACE") == "1":  # to test the other way (docs/testing.md)
        yield False
        return
    libc = ctypes.CDLL(None, use_errno=True)
    original = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    if libc.unshare(CLONE_NEWNS) != 0:
        os.close(original)
        yield False
        return
    base = tempfile.mkdtemp(prefix="idempotency-apt-")

    def leave():
        if libc.setns(original, CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "setns back to the original mount namespace")
        os.close(original)
        os.rmdir(base)

    try:
        run("mount", "--make-rprivate", "/")
        run("mount", "-t", "tmpfs", "tmpfs", base)
        for d in ("/usr", "/var"):
            upper, work = base + d + "-upper", base + d + "-work"
            os.makedirs(upper)
            os.makedirs(work)
            run("mount", "-t", "overlay", "overlay", "-o", f"lowerdir={d},upperdir={upper},workdir={work}", d)
    except (subprocess.CalledProcessError, OSError):
        leave()  # no overlay here (a container without the right): on the machine itself
        yield False
        return
    try:
        yield True
    finally:
        leave()


@pytest.fixture
def apt_server():
    """Debian's server without the files of the source install (cargo pgrx install), as a user's
    machine would be. In a private overlay of /usr and /var where the kernel allows one (see
    private_system); otherwise on the machine itself, the source install's files set aside and,
    afterwards, the package purged and those files put back exactly (mode and times too), for
    the tests that follow."""
    if not APT:
        pytest.skip(f"PostgreSQL {MAJOR} at {PG_BIN} is not Debian's apt package (the payload test covers it)")
    if os.geteuid() != 0:
        pytest.skip("apt-get install needs root")
    with private_system() as private:
        saved = tempfile.mkdtemp(prefix="idempotency-source-install-")
        kept = installed_files()
        for path in kept:
            shutil.copy2(path, os.path.join(saved, os.path.basename(path)))
            os.unlink(path)
        try:
            yield
        finally:
            if not private:
                run("dpkg", "--purge", PKG, check=False)
                for path in installed_files():
                    os.unlink(path)
                for path in kept:
                    shutil.copy2(os.path.join(saved, os.path.basename(path)), path)
            shutil.rmtree(saved)


def assert_removed_cleanly():
    apt("remove", PKG)
    listing = run("dpkg", "-L", PKG, check=False)
    assert listing.returncode != 0 and not listing.stdout.strip(), listing.stdout
    assert installed_files() == []
    assert not os.path.exists(f"/usr/share/doc/{PKG}")
    c = Cluster(bin=PG_BIN).start()
    try:
        with connect(c) as conn:
            with pytest.raises(psycopg.Error) as refused:
                conn.execute("CREATE EXTENSION idempotency")
            assert "idempotency" in str(refused.value)
            assert conn.execute("SELECT 1").fetchone() == (1,)  # refused, nothing else
    finally:
        c.destroy()


@needs_packages
def test_apt_get_install_the_package_then_remove_it(apt_server):
    assert installed_files() == []
    apt("install", deb_in(PACKAGES))
    assert run("dpkg-query", "-W", "-f", "${Status} ${Version}", PKG).stdout == f"install ok installed {VERSION}-1"
    c = preloaded_cluster(PG_BIN)
    try:
        with connect(c) as conn:
            conn.execute("CREATE EXTENSION idempotency")
            assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0] \
                == VERSION
            assert conn.execute("SELECT sweeper_enabled FROM idempotency.stats").fetchone()[0] is True
            demo_outcomes(conn)
    finally:
        c.destroy()
    assert_removed_cleanly()


@needs_packages
def test_apt_get_install_updates_the_previous_release_with_keys_in_flight(apt_server):
    if not PREVIOUS:
        pytest.skip("IDEMPOTENCY_PREVIOUS_PACKAGES unset (scripts/test.sh builds the previous release's package "
                    "once, or skips it with IDEMPOTENCY_SKIP_PREVIOUS_PACKAGE=1)")
    previous = glob.glob(os.path.join(PREVIOUS, f"{PKG}_*-1_{ARCH}.deb"))
    assert len(previous) == 1, previous
    old = re.search(r"_(.+)-1_", os.path.basename(previous[0])).group(1)
    apt("install", previous[0])
    c = preloaded_cluster(PG_BIN)
    try:
        with connect(c) as conn:
            conn.execute("CREATE EXTENSION idempotency")
            assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0] == old
            assert claim(conn, "done", {"n": 1})[0] == "new"
            conn.execute("SELECT idempotency.complete('done', '{\"ok\": 1}', 201)")
            outcome, held, *_ = claim(conn, "held", {"n": 2}, lease="1 hour")
            assert outcome == "new"
            outcome, crashed, *_ = claim(conn, "crashed", {"n": 3}, lease="2 seconds")
            assert outcome == "new"
        # The new package over the old one: dpkg replaces the files; the preloaded library is the
        # old one until the server restarts.
        apt("install", deb_in(PACKAGES))
        assert run("dpkg-query", "-W", "-f", "${Version}", PKG).stdout == f"{VERSION}-1"
        c.stop()
        c.pg_ctl("start", "-w", "-l", c.log)
        with connect(c) as conn:
            conn.execute("ALTER EXTENSION idempotency UPDATE")
            assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0] \
                == VERSION
            outcome, _, response, status, *_ = claim(conn, "done", {"n": 1})
            assert (outcome, response, status) == ("replay", {"ok": 1}, 201)
            assert claim(conn, "held", {"n": 2})[0] == "in_progress"
            conn.execute("SELECT idempotency.complete('held', '{\"ok\": 2}', token => %s)", (held,))
            assert claim(conn, "held", {"n": 2})[2] == {"ok": 2}
            time.sleep(2.2)
            outcome, token, *_ = claim(conn, "crashed", {"n": 3})
            assert outcome == "new" and token > crashed  # taken over
            demo_outcomes(conn)
    finally:
        c.destroy()
    assert_removed_cleanly()


# --- 16-18: the payload in a copy of the relocatable server ---------------------------------------

@pytest.fixture
def server_copy():
    """A copy of the server (hard links where possible) without the source install's files, the
    package's payload put where that server's pg_config says, the layout mapped:
    /usr/lib/postgresql/NN/lib -> pkglibdir, /usr/share/postgresql/NN/extension -> sharedir/extension."""
    if APT:
        pytest.skip("Debian's server: the apt-get tests install the package itself")
    prefix = os.path.dirname(PG_BIN)
    base = tempfile.mkdtemp(prefix="idempotency-payload-")
    os.chmod(base, 0o755)
    copy = os.path.join(base, "server")
    if subprocess.run(["cp", "-al", prefix, copy], capture_output=True).returncode != 0:
        shutil.rmtree(copy, ignore_errors=True)
        run("cp", "-a", prefix, copy)
    bin_dir = os.path.join(copy, "bin")
    lib, share = pg_config(bin_dir, "--pkglibdir"), pg_config(bin_dir, "--sharedir")
    assert lib.startswith(copy) and share.startswith(copy), "the server is not relocatable"
    ext = os.path.join(share, "extension")
    for path in glob.glob(f"{lib}/idempotency.so") + glob.glob(f"{ext}/idempotency*"):
        os.unlink(path)  # an unlink: the original server's file (a hard link) stays
    payload = os.path.join(base, "payload")
    run("dpkg-deb", "-x", deb_in(PACKAGES), payload)
    shutil.copy(f"{payload}/usr/lib/postgresql/{MAJOR}/lib/idempotency.so", lib)
    for f in glob.glob(f"{payload}/usr/share/postgresql/{MAJOR}/extension/*"):
        shutil.copy(f, ext)
    try:
        yield bin_dir
    finally:
        shutil.rmtree(base)


@needs_packages
def test_the_payload_installed_into_the_server_runs_the_demo(server_copy):
    c = preloaded_cluster(server_copy)
    try:
        with connect(c) as conn:
            conn.execute("CREATE EXTENSION idempotency")
            assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0] \
                == VERSION
            assert conn.execute("SELECT sweeper_enabled FROM idempotency.stats").fetchone()[0] is True
            demo_outcomes(conn)
    finally:
        c.destroy()


# --- refusals: nothing is built, nothing is written ----------------------------------------------

@pytest.fixture
def clone(tmp_path):
    """A clone of this commit, to make dirty or inconsistent without touching the checkout."""
    path = tmp_path / "clone"
    run("git", "clone", "-q", "--shared", "--no-hardlinks", ROOT, str(path))
    run("git", "-C", str(path), "checkout", "-q", run("git", "-C", ROOT, "rev-parse", "HEAD").stdout.strip())
    for k, v in (("user.name", "test"), ("user.email", "test@example.invalid")):
        run("git", "-C", str(path), "config", k, v)
    return path


def refuse(script, *args, env=None, out=None):
    r = run(script, *args, check=False, env=dict(os.environ, **(env or {})))
    assert r.returncode == 2, (r.stdout, r.stderr)
    if out is not None:
        assert not os.path.exists(out)
        assert not glob.glob(os.path.join(os.path.dirname(out), ".package-*"))
    return r.stderr


def test_package_refuses_without_a_major_version(tmp_path):
    out = str(tmp_path / "out")
    assert "no PostgreSQL major version given" in refuse(PACKAGE_SH, "--out", out, out=out)


@pytest.mark.parametrize("major", ["14", "19", "fifteen"])
def test_package_refuses_an_unsupported_major_version(tmp_path, major):
    out = str(tmp_path / "out")
    err = refuse(PACKAGE_SH, "--out", out, "15", major, out=out)
    assert f"PostgreSQL '{major}' is not supported (supported: 15 16 17 18)" in err


def test_package_refuses_a_missing_major_version(clone, tmp_path):
    out = str(tmp_path / "out")
    err = refuse(str(clone / "scripts" / "package.sh"), "--out", out, "16",
                 env={"PG_CONFIG_16": "/nonexistent/bin/pg_config"}, out=out)
    assert "PostgreSQL 16 is missing: no pg_config at /nonexistent/bin/pg_config" in err


def test_package_refuses_a_dirty_tree(clone, tmp_path):
    (clone / "sql" / "idempotency--0.6.0--9.9.9.sql").write_text("-- not committed\n")
    with open(clone / "README.md", "a") as f:
        f.write("\nedited\n")
    out = str(tmp_path / "out")
    err = refuse(str(clone / "scripts" / "package.sh"), "--out", out, "15", out=out)
    assert "the working tree has uncommitted changes" in err
    assert "README.md" in err and "sql/idempotency--0.6.0--9.9.9.sql" in err


@pytest.mark.parametrize("where", ["Cargo.toml", "idempotency.control", "META.json", "META.json provides",
                                   "core crate"])
def test_package_refuses_versions_that_disagree(clone, tmp_path, where):
    if where == "Cargo.toml":
        path, old, new, says = "Cargo.toml", f'version = "{VERSION}"', 'version = "9.9.9"', "Cargo.toml (package.version): 9.9.9"
    elif where == "idempotency.control":
        path, old, new, says = ("idempotency.control", "'@CARGO_VERSION@'", "'9.9.9'",
                                "idempotency.control (default_version): 9.9.9")
    elif where == "META.json":
        path, old, new, says = "META.json", f'"version": "{VERSION}",\n   "maintainer"', '"version": "9.9.9",\n   "maintainer"', "META.json (version): 9.9.9"
    elif where == "META.json provides":
        path, old, new, says = ("META.json", f'"version": "{VERSION}"\n', '"version": "9.9.9"\n',
                                "META.json (provides.idempotency.version): 9.9.9")
    else:
        path, old, new, says = ("crates/idempotency-core/Cargo.toml", f'version = "{VERSION}"', 'version = "9.9.9"',
                                "crates/idempotency-core/Cargo.toml (package.version): 9.9.9")
    text = (clone / path).read_text()
    assert old in text, (path, old)
    (clone / path).write_text(text.replace(old, new, 1))
    run("git", "-C", str(clone), "commit", "-q", "-am", "a version changed in one place only")
    out = str(tmp_path / "out")
    err = refuse(str(clone / "scripts" / "package.sh"), "--out", out, "15", out=out)
    assert "the versions disagree" in err and says in err, err


def test_set_version_keeps_the_versions_in_agreement(clone, tmp_path):
    """scripts/set-version.sh writes the version everywhere it must agree: scripts/package.sh then
    gets past its version check (and stops at the missing server it is given)."""
    run(str(clone / "scripts" / "set-version.sh"), "9.9.9")
    changed = run("git", "-C", str(clone), "status", "--porcelain").stdout.split()
    assert {"Cargo.toml", "Cargo.lock", "META.json", "crates/idempotency-core/Cargo.toml"} <= set(changed)
    run("git", "-C", str(clone), "commit", "-q", "-am", "9.9.9")
    out = str(tmp_path / "out")
    err = refuse(str(clone / "scripts" / "package.sh"), "--out", out, "16",
                 env={"PG_CONFIG_16": "/nonexistent/bin/pg_config"}, out=out)
    assert "disagree" not in err and "PostgreSQL 16 is missing" in err
