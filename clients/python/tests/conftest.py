"""A throwaway PostgreSQL cluster with the extension for the package's tests.

It reuses the project's tests/integration/cluster.py (a cluster owned by the postgres OS user;
PG_BIN picks the server, PostgreSQL 15 by default). The extension must be installed into that
server. The package under test is the installed one (scripts/clients-python.sh installs the
wheel), not the source tree.

IDEMPOTENCY_TEST_POOLER=transaction (or session) puts PgBouncer in that mode between the package
and the cluster (tests/integration/pooler.py): the package's connections (`conninfo`,
`endpoint`) go through the pooler, the tests' own inspections (`db`, `row`) go direct.

IDEMPOTENCY_TEST_CONNINFO runs them against a server the tests do not start instead (a libpq
string, e.g. to a pooler of your own in front of your server): its database must be one the tests
may empty, with the extension installable by that user; every connection takes that route, and
the tests that stop and restart the server are skipped. IDEMPOTENCY_TEST_POOLER then says what the
route is (`transaction` for a pooler in transaction mode), so that the tests it does not allow
are skipped."""

import os
import sys

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))

from cluster import Cluster  # noqa: E402
import pooler  # noqa: E402


# In session mode every client connection the tests leave open (each thread's Store connection,
# the decorators' own stores) holds a server connection until it is closed: room for all of them.
SERVER_CONNECTIONS = 300


EXISTING = os.environ.get("IDEMPOTENCY_TEST_CONNINFO")


class ExistingServer:
    """The server IDEMPOTENCY_TEST_CONNINFO names, with the Cluster methods the tests use."""

    def __init__(self, conninfo):
        self._conninfo = conninfo
        params = conninfo_to_dict(conninfo)
        self.dir = params.get("host") or os.environ.get("PGHOST", "/var/run/postgresql")
        self.port = int(params.get("port") or os.environ.get("PGPORT", 5432))
        self.dbname = params.get("dbname") or os.environ.get("PGDATABASE", "postgres")

    def conninfo(self):
        return self._conninfo

    def stop(self, mode="fast"):
        pytest.skip("IDEMPOTENCY_TEST_CONNINFO: the tests do not stop a server they did not start")

    restart = stop


@pytest.fixture(scope="session")
def cluster():
    if EXISTING:
        server = ExistingServer(EXISTING)
        with psycopg.connect(server.conninfo(), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS idempotency")
        yield server
        return
    c = Cluster(settings={"max_connections": str(SERVER_CONNECTIONS)}).start()
    with psycopg.connect(c.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION idempotency")
    yield c
    c.destroy()


@pytest.fixture(scope="session")
def route(cluster):
    """The PgBouncer that IDEMPOTENCY_TEST_POOLER names in front of the cluster, or None (direct,
    or a server of IDEMPOTENCY_TEST_CONNINFO, which is its own route)."""
    if EXISTING:
        yield None
        return
    bouncer = pooler.target(cluster, users=("postgres", "readme_app"), pool_size=SERVER_CONNECTIONS - 20)
    yield bouncer
    if bouncer is not None:
        bouncer.stop()


@pytest.fixture(scope="session")
def conninfo(cluster, route):
    """Where the package connects: through the pooler when there is one."""
    return route.conninfo() if route is not None else cluster.conninfo()


@pytest.fixture(scope="session")
def endpoint(cluster, route):
    """The package's route as libpq parameters: host, port, dbname."""
    if route is not None:
        return {"host": "127.0.0.1", "port": str(route.port), "dbname": cluster.dbname}
    return {"host": cluster.dir, "port": str(cluster.port), "dbname": cluster.dbname}


@pytest.fixture
def db(cluster):
    conn = psycopg.connect(cluster.conninfo(), autocommit=True)
    yield conn
    conn.close()


@pytest.fixture(autouse=True)
def clean_table(cluster):
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("DELETE FROM idempotency.idempotency_keys")


@pytest.fixture
def row(db):
    """row(key, scope) -> (status, response, response_status, recovery_point, token) or None."""
    return lambda key, scope="": db.execute("SELECT status::text, response, response_status, recovery_point, token "
                      "FROM idempotency.lookup(%s, %s) WHERE key IS NOT NULL", (key, scope)).fetchone()


@pytest.fixture
def blackhole():
    """A conninfo whose server accepts TCP connections and never answers (a database that is
    down behind a load balancer, a dropped network): only a connect timeout ends the wait."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield f"host=127.0.0.1 port={s.getsockname()[1]} dbname=shop user=app"
    s.close()
