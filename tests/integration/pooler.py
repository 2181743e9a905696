"""PgBouncer in front of a throwaway cluster, as production runs it: the tests' clients connect
to the pooler, which hands each transaction (transaction mode) or each client connection
(session mode) one of its server connections.

Debian's `pgbouncer` package (1.18, installed by scripts/bootstrap.sh) is started on a port of its
own, with an ini and a user list of its own in a temporary directory, as the postgres OS user
(PgBouncer refuses to run as root). Users are let in without a password (`auth_type = trust`),
so the user list names every role a test connects as: `add_user` adds one and reloads. After a
server restart PgBouncer tries to log in again after a second (`server_login_retry`, 15 s by
default), so the tests that restart the server do not wait on the pooler.

`IDEMPOTENCY_TEST_POOLER` (`direct`, `transaction` or `session`) says which route the clients'
suites take: `target(cluster)` starts the pooler the variable names in front of `cluster` and
returns it, or None for `direct` (or unset)."""

import os
import shutil
import signal
import subprocess
import tempfile
import time

from cluster import free_port

PGBOUNCER = os.environ.get("PGBOUNCER", shutil.which("pgbouncer") or "/usr/sbin/pgbouncer")
MODES = ("direct", "transaction", "session")


def _as_postgres(cmd, **kw):
    prefix = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]
    return subprocess.Popen(prefix + list(cmd), **kw)


class PgBouncer:
    """One PgBouncer in `mode` (`transaction` or `session`) in front of `cluster`'s databases.

    pool_size   server connections per (database, user) pair (PgBouncer's default_pool_size).
                Session mode needs one per client connection open at once: a client beyond the
                pool waits in PgBouncer's queue until another disconnects.
    force_user  every client is logged in to the server as this one role (the `user=` of a
                `[databases]` entry), as a pooler with one service role does."""

    def __init__(self, cluster, mode="transaction", pool_size=40, users=("postgres",), force_user=None,
                 max_client_conn=400):
        if mode not in ("transaction", "session"):
            raise ValueError(f"mode must be 'transaction' or 'session', not {mode!r}")
        self.cluster, self.mode, self.pool_size = cluster, mode, pool_size
        self.force_user, self.max_client_conn = force_user, max_client_conn
        self.dir = tempfile.mkdtemp(prefix="idempotency-pgbouncer-")
        os.chmod(self.dir, 0o777)
        self.port = free_port()
        self.users = list(dict.fromkeys(users))
        self.ini = os.path.join(self.dir, "pgbouncer.ini")
        self.log = os.path.join(self.dir, "pgbouncer.log")
        self.proc = None

    def _write(self):
        forced = f" user={self.force_user}" if self.force_user else ""
        with open(os.path.join(self.dir, "userlist.txt"), "w") as f:
            for u in self.users:
                f.write(f'"{u}" ""\n')
        with open(self.ini, "w") as f:
            f.write(f"""[databases]
* = host={self.cluster.dir} port={self.cluster.port}{forced}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir = {self.dir}
auth_type = trust
auth_file = {self.dir}/userlist.txt
admin_users = postgres
pool_mode = {self.mode}
default_pool_size = {self.pool_size}
max_client_conn = {self.max_client_conn}
logfile = {self.log}
pidfile = {self.dir}/pgbouncer.pid
ignore_startup_parameters = extra_float_digits
server_reset_query = DISCARD ALL
server_check_delay = 0
server_login_retry = 1
""")
        os.chmod(self.dir, 0o777)
        for name in os.listdir(self.dir):
            os.chmod(os.path.join(self.dir, name), 0o666)

    def start(self):
        self._write()
        # PgBouncer writes its log to standard error as well as to its logfile: into a file, since
        # a pipe nobody reads fills up (a line per connection) and stops PgBouncer mid-run.
        with open(os.path.join(self.dir, "stderr.log"), "wb") as err:
            self.proc = _as_postgres([PGBOUNCER, self.ini], stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 15
        while True:
            try:
                import psycopg
                with psycopg.connect(self.conninfo(), autocommit=True, connect_timeout=2) as c:
                    c.execute("SELECT 1")
                return self
            except Exception:
                if self.proc.poll() is not None:
                    with open(os.path.join(self.dir, "stderr.log"), encoding="utf-8", errors="replace") as f:
                        raise RuntimeError(f"pgbouncer exited: {f.read()[-2000:]}\n{self.read_log()[-2000:]}")
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def add_user(self, *names):
        """Lets these roles connect through the pooler (RELOAD rereads the user list)."""
        new = [n for n in names if n not in self.users]
        if new:
            self.users += new
            self._write()
            self.admin("RELOAD")

    def admin(self, command):
        """A command on PgBouncer's admin console (RELOAD, SHOW POOLS, ...): its rows."""
        import psycopg
        with psycopg.connect(f"host=127.0.0.1 port={self.port} dbname=pgbouncer user=postgres",
                             autocommit=True) as c:
            cur = c.execute(command, prepare=False)
            return cur.fetchall() if cur.description else []

    def conninfo(self, user="postgres", dbname=None):
        return f"host=127.0.0.1 port={self.port} user={user} dbname={dbname or self.cluster.dbname}"

    def url(self, user="postgres", dbname=None):
        return f"postgres://{user}@127.0.0.1:{self.port}/{dbname or self.cluster.dbname}"

    def read_log(self):
        try:
            with open(self.log, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def pid(self):
        """PgBouncer's own pid (from its pidfile): the process started is runuser's, which does
        not pass a signal on to PgBouncer."""
        try:
            with open(os.path.join(self.dir, "pgbouncer.pid")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def stop(self):
        pid = self.pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGINT)  # PgBouncer's immediate shutdown
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    os.kill(pid, 0)
                    time.sleep(0.05)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def mode_from_env():
    mode = os.environ.get("IDEMPOTENCY_TEST_POOLER", "direct") or "direct"
    if mode not in MODES:
        raise ValueError(f"IDEMPOTENCY_TEST_POOLER must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def target(cluster, **kw):
    """The PgBouncer that IDEMPOTENCY_TEST_POOLER names, started in front of `cluster`; None for
    `direct`."""
    mode = mode_from_env()
    if mode == "direct":
        return None
    return PgBouncer(cluster, mode, **kw).start()
