import os

import psycopg
import pytest

from cluster import Cluster

# Servers inherit the environment: with RUST_BACKTRACE set (as on CI's machines) pgrx would put
# Rust backtraces into errors' DETAIL, which test_hardening checks never reaches a client.
os.environ.setdefault("RUST_BACKTRACE", "1")


@pytest.fixture(scope="session")
def cluster():
    c = Cluster().start()
    with psycopg.connect(c.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION idempotency")
    yield c
    c.destroy()


@pytest.fixture
def connect(cluster):
    """Opens autocommit sessions; all are closed after the test."""
    opened = []

    def _connect(autocommit=True):
        conn = psycopg.connect(cluster.conninfo(), autocommit=autocommit)
        opened.append(conn)
        return conn

    yield _connect
    for conn in opened:
        try:
            conn.close()
        except Exception:
            pass


@pytest.fixture
def db(connect):
    return connect()


@pytest.fixture(autouse=True)
def clean_table(cluster):
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("DELETE FROM idempotency.idempotency_keys")
    yield
