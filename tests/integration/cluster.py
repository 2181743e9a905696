"""A throwaway PostgreSQL 15 cluster owned by the `postgres` OS user (initdb refuses root).

Used by the integration tests and by scripts/demo.sh. The extension must already be installed
into the system PostgreSQL (`cargo pgrx install`)."""

import os
import shutil
import socket
import subprocess
import tempfile
import time

PG_BIN = os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin")


def _as_postgres(*cmd, check=True, **kw):
    prefix = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]
    return subprocess.run(prefix + list(cmd), check=check, **kw)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, settings=None, dbname="idem"):
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

    def start(self):
        _as_postgres(f"{PG_BIN}/initdb", "-D", self.data, "-A", "trust", "-U", "postgres",
                     "--no-sync", "-E", "UTF8", "--locale=C.UTF-8", stdout=subprocess.DEVNULL)
        with open(os.path.join(self.data, "postgresql.auto.conf"), "a") as f:
            for k, v in self.settings.items():
                f.write(f"{k} = {v}\n")
        self.pg_ctl("start", "-w", "-l", self.log)
        subprocess.run([f"{PG_BIN}/createdb", "-h", self.dir, "-p", str(self.port), "-U", "postgres",
                        self.dbname], check=True)
        return self

    def pg_ctl(self, *args):
        _as_postgres(f"{PG_BIN}/pg_ctl", "-D", self.data, *args, stdout=subprocess.DEVNULL)

    def stop(self, mode="fast"):
        self.pg_ctl("stop", "-m", mode, "-w")

    def destroy(self):
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
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
