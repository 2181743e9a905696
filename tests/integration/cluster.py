"""A throwaway PostgreSQL 15 cluster owned by the `postgres` OS user (initdb refuses root).

Used by the integration tests and by scripts/demo.sh. The extension must already be installed
into the system PostgreSQL (`cargo pgrx install`)."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

# The server's binaries: PostgreSQL 15 from Debian unless scripts/test.sh runs the suite against
# another major version (PG_BIN=<prefix>/bin, see scripts/pg-server.sh).
PG_BIN = os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin")

# IDEMPOTENCY_EDITION=portable runs the suite against the portable edition (dist/, docs/managed.md)
# on a server without the native library (PG_BIN of scripts/pg-tle.sh or scripts/pg-portable.sh):
# with pg_tle there, the pg_tle route (pg_tle preloaded; where a test says CREATE EXTENSION
# idempotency, conftest.py creates pg_tle and registers the pg_tle script in that database
# first); without it, the plain route (conftest.py runs dist/idempotency-portable.sql instead).
EDITION = os.environ.get("IDEMPOTENCY_EDITION", "native")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PORTABLE_PLAIN = os.path.join(ROOT, "dist", "idempotency-portable.sql")
_PGTLE_SCRIPTS = {}


def pgtle_script(kind="pgtle"):
    """The path of a pg_tle script, made from the committed plain script as a user makes it:
    scripts/portable.py pgtle (the install) or pgtle-update (the update from the previous
    release), written once per test run into a temporary file."""
    if kind not in _PGTLE_SCRIPTS:
        out = subprocess.run([os.path.join(ROOT, "scripts", "portable.py"), kind], check=True,
                             capture_output=True, text=True).stdout
        fd, path = tempfile.mkstemp(prefix=f"idempotency-{kind}-", suffix=".sql")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(out)
        os.chmod(path, 0o644)
        _PGTLE_SCRIPTS[kind] = path
    return _PGTLE_SCRIPTS[kind]


def pkglibdir(bin_dir):
    return subprocess.run([f"{bin_dir}/pg_config", "--pkglibdir"], check=True, capture_output=True,
                          text=True).stdout.strip()


def portable_route(bin_dir):
    """'pgtle' or 'plain' for a server without the native library; raises where it has it."""
    lib = pkglibdir(bin_dir)
    if os.path.exists(os.path.join(lib, "idempotency.so")):
        raise RuntimeError(f"IDEMPOTENCY_EDITION=portable needs a server without idempotency.so; {lib} has it "
                           "(PG_BIN from scripts/pg-tle.sh or scripts/pg-portable.sh)")
    return "pgtle" if os.path.exists(os.path.join(lib, "pg_tle.so")) else "plain"


def _as_postgres(*cmd, check=True, **kw):
    prefix = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]
    return subprocess.run(prefix + list(cmd), check=check, **kw)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, settings=None, dbname="idem", bin=None):
        self.bin = bin or PG_BIN
        self.dir = tempfile.mkdtemp(prefix="idempotency-it-")
        os.chmod(self.dir, 0o777)
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(self.dir, "server.log")
        self.port = free_port()
        self.dbname = dbname
        self.settings = {
            "listen_addresses": "''",
            "unix_socket_directories": f"'{self.dir}'",
            "port": str(self.port),
            "max_connections": "100",
            "shared_buffers": "128MB",
            "fsync": "off",
            "log_min_messages": "warning",
            "restart_after_crash": "on",
        }
        self.settings.update(settings or {})
        self.edition = EDITION
        if self.edition == "portable":
            self.route = portable_route(self.bin)
            # No library of ours to preload; pg_tle's where that route is taken.
            libs = [l.strip() for l in self.settings.get("shared_preload_libraries", "''").strip("'").split(",")]
            libs = [l for l in libs if l and l != "idempotency"]
            if self.route == "pgtle" and "pg_tle" not in libs:
                libs.append("pg_tle")
            self.settings["shared_preload_libraries"] = "'" + ",".join(libs) + "'"

    def start(self):
        self.initdb()
        with open(os.path.join(self.data, "postgresql.auto.conf"), "a") as f:
            for k, v in self.settings.items():
                f.write(f"{k} = {v}\n")
        self.pg_ctl("start", "-w", "-l", self.log)
        subprocess.run([f"{self.bin}/createdb", "-h", self.dir, "-p", str(self.port), "-U", "postgres",
                        self.dbname], check=True)
        return self

    def initdb(self, *extra):
        _as_postgres(f"{self.bin}/initdb", "-D", self.data, "-A", "trust", "-U", "postgres",
                     "--no-sync", "-E", "UTF8", "--locale=C.UTF-8", *extra, stdout=subprocess.DEVNULL)

    def pg_ctl(self, *args):
        _as_postgres(f"{self.bin}/pg_ctl", "-D", self.data, *args, stdout=subprocess.DEVNULL)

    def stop(self, mode="fast"):
        self.pg_ctl("stop", "-m", mode, "-w")

    def destroy(self):
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass
        for p in self.processes():  # after a killed postmaster, nothing of it may stay
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def conninfo(self):
        return f"host={self.dir} port={self.port} user=postgres dbname={self.dbname}"

    def wait_ready(self, timeout=30):
        import psycopg
        deadline = time.time() + timeout
        while True:
            try:
                with psycopg.connect(self.conninfo(), autocommit=True) as c:
                    c.execute("SELECT 1")
                    return
            except psycopg.OperationalError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)

    def server_log(self):
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return f.read()

    def restart(self):
        """Starts the server again after a stop or a crash (crash recovery runs first)."""
        self.pg_ctl("start", "-w", "-t", "120", "-l", self.log)

    def postmaster_pid(self):
        with open(os.path.join(self.data, "postmaster.pid")) as f:
            return int(f.readline())

    def processes(self):
        """Pids of every process of this cluster: PostgreSQL processes chdir to their data
        directory, so /proc/<pid>/cwd names the cluster even for orphaned backends."""
        data = os.path.realpath(self.data)
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/cwd") == data:
                    pids.append(int(entry))
            except OSError:
                pass  # gone, or not ours to look at
        return pids

    def kill_postmaster(self, grace=5.0):
        """SIGKILL of the postmaster, as the OOM killer does it. Its orphaned children notice
        the postmaster's death and exit on their own (a backend in the middle of a statement
        may still commit it); the ones left after `grace` seconds are SIGKILLed, since a new
        postmaster refuses to start while the old shared memory is attached. postmaster.pid
        stays behind, stale. Returns (orphans at the kill, orphans that had to be killed)."""
        pid = self.postmaster_pid()
        os.kill(pid, signal.SIGKILL)
        orphans = [p for p in self.processes() if p != pid]
        deadline = time.monotonic() + grace
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.processes()
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.processes(), f"processes of the killed cluster survive: {self.processes()}"
        # A new postmaster refuses to start while the pid in the stale postmaster.pid answers
        # kill(pid, 0), which a zombie does: wait until init has reaped the old postmaster.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        return len(orphans), len(left)

    def promote(self):
        self.pg_ctl("promote", "-w", "-t", "60")

    @classmethod
    def standby_of(cls, primary, application_name="standby1", slot=None, settings=None):
        """A streaming standby of `primary`, made with `pg_basebackup -R` into its own data
        directory, with its own port and socket directory. Not started: call start_standby()."""
        s = cls(settings=settings, dbname=primary.dbname)
        _as_postgres(f"{primary.bin}/pg_basebackup", "-h", primary.dir, "-p", str(primary.port), "-U", "postgres",
                     "-D", s.data, "-R", "-X", "stream", "-c", "fast", "--no-sync",
                     *(["-S", slot] if slot else []), stdout=subprocess.DEVNULL)
        # The copy carries the primary's settings (port, socket directory); later lines win.
        conninfo = (f"host={primary.dir} port={primary.port} user=postgres "
                    f"application_name={application_name}")
        s.settings["primary_conninfo"] = f"'{conninfo}'"
        if slot:
            s.settings["primary_slot_name"] = f"'{slot}'"
        with open(os.path.join(s.data, "postgresql.auto.conf"), "a") as f:
            for k, v in s.settings.items():
                f.write(f"{k} = {v}\n")
        return s

    def start_standby(self):
        self.pg_ctl("start", "-w", "-t", "120", "-l", self.log)
        return self
