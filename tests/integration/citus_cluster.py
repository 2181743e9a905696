"""A throwaway Citus cluster on this machine: a coordinator and two workers, each its own
PostgreSQL cluster (tests/integration/cluster.py's Cluster) on its own port, with
shared_preload_libraries = 'citus,idempotency' (citus first, as it requires) and
wal_level = logical (shard moves use logical replication).

Citus comes from scripts/citus.sh NN, which builds it into the server of scripts/pg-server.sh
NN; CITUS_PG_BIN names that server's bin directory (default: PG_BIN, when Citus is installed
there). The extension must be installed into the same server (cargo pgrx install)."""

import os
import subprocess

import psycopg

from cluster import PG_BIN, Cluster

CITUS_PG_BIN = os.environ.get("CITUS_PG_BIN", PG_BIN)


def citus_missing():
    """Why Citus tests cannot run here, or None when they can."""
    pg_config = os.path.join(CITUS_PG_BIN, "pg_config")
    if not os.path.exists(pg_config):
        return f"no PostgreSQL server at CITUS_PG_BIN={CITUS_PG_BIN}"
    libdir = subprocess.run([pg_config, "--pkglibdir"], check=True, capture_output=True,
                            text=True).stdout.strip()
    if not os.path.exists(os.path.join(libdir, "citus.so")):
        return (f"Citus is not installed in {CITUS_PG_BIN} (build it with scripts/citus.sh 18 and "
                f"set CITUS_PG_BIN to the directory of the pg_config it prints)")
    if not os.path.exists(os.path.join(libdir, "idempotency.so")):
        return f"the extension is not installed in {CITUS_PG_BIN} (cargo pgrx install --pg-config {pg_config})"
    return None


SETTINGS = {
    "shared_preload_libraries": "'citus,idempotency'",
    "wal_level": "logical",
    # Nodes connect to each other over TCP on the loopback address (trust, from initdb -A trust).
    "listen_addresses": "'127.0.0.1'",
    "max_connections": "300",
    # Citus commits transactions that wrote on several nodes with two-phase commit.
    "max_prepared_transactions": "100",
    "max_worker_processes": "32",
}


class CitusCluster:
    """coordinator + workers; `start()` joins them and creates citus and idempotency."""

    def __init__(self, workers=2, settings=None):
        merged = dict(SETTINGS)
        merged.update(settings or {})
        self.settings = merged
        self.coordinator = Cluster(settings=merged, bin=CITUS_PG_BIN)
        self.workers = [Cluster(settings=merged, bin=CITUS_PG_BIN) for _ in range(workers)]

    @property
    def nodes(self):
        return [self.coordinator, *self.workers]

    def start(self):
        try:
            for n in self.nodes:
                n.start()
            for n in self.nodes:
                with psycopg.connect(n.conninfo(), autocommit=True) as c:
                    c.execute("CREATE EXTENSION citus")
            with psycopg.connect(self.coordinator.conninfo(), autocommit=True) as c:
                c.execute("SELECT citus_set_coordinator_host('127.0.0.1', %s)", (self.coordinator.port,))
                for w in self.workers:
                    c.execute("SELECT citus_add_node('127.0.0.1', %s)", (w.port,))
                # Propagated to the workers by Citus (each has the library installed).
                c.execute("CREATE EXTENSION idempotency")
        except Exception:
            self.destroy()
            raise
        return self

    def add_worker(self):
        """Starts another worker and adds it to the running cluster (Citus creates the extensions
        of the coordinator's database on it, as it activates the node); returns it."""
        w = Cluster(settings=self.settings, bin=CITUS_PG_BIN)
        self.workers.append(w)
        w.start()
        with psycopg.connect(w.conninfo(), autocommit=True) as c:
            c.execute("CREATE EXTENSION citus")
        with psycopg.connect(self.coordinator.conninfo(), autocommit=True) as c:
            c.execute("SELECT citus_add_node('127.0.0.1', %s)", (w.port,))
        return w

    def add_database(self, name):
        """Another database made a Citus cluster of its own on the same nodes (Citus keeps its
        metadata per database); returns a function giving a node's conninfo for it."""
        def info(node=None):
            return self.conninfo(node).replace(f"dbname={self.coordinator.dbname}", f"dbname={name}")
        for n in self.nodes:
            with psycopg.connect(n.conninfo(), autocommit=True) as c:
                c.execute(f"CREATE DATABASE {name}")
            with psycopg.connect(info(n), autocommit=True) as c:
                c.execute("CREATE EXTENSION citus")
        with psycopg.connect(info(), autocommit=True) as c:
            c.execute("SELECT citus_set_coordinator_host('127.0.0.1', %s)", (self.coordinator.port,))
            for w in self.workers:
                c.execute("SELECT citus_add_node('127.0.0.1', %s)", (w.port,))
        return info

    def destroy(self):
        for n in self.nodes:
            n.destroy()

    def conninfo(self, node=None):
        return (node or self.coordinator).conninfo()

    def connect(self, node=None, autocommit=True):
        return psycopg.connect(self.conninfo(node), autocommit=autocommit)

    def worker_of_port(self, port):
        return next(w for w in self.workers if w.port == port)
