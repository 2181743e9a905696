import os
import re

import psycopg
import pytest

from cluster import EDITION, PORTABLE_PLAIN, PG_BIN, Cluster, pgtle_script, portable_route

# Servers inherit the environment: with RUST_BACKTRACE set (as on CI's machines) pgrx would put
# Rust backtraces into errors' DETAIL, which test_hardening checks never reaches a client.
os.environ.setdefault("RUST_BACKTRACE", "1")


# --- the portable edition (IDEMPOTENCY_EDITION=portable, see cluster.py) ----------------------

def pytest_collection_modifyitems(config, items):
    """Tests of what only the native edition has are skipped, with their reason, when the suite
    runs against the portable edition: @pytest.mark.native_only("reason"); tests of what only an
    extension has (CREATE EXTENSION, natively or through pg_tle), on its plain route:
    @pytest.mark.extension_only("reason")."""
    if EDITION != "portable":
        return
    plain = portable_route(PG_BIN) == "plain"
    for item in items:
        mark = item.get_closest_marker("native_only")
        if mark is not None:
            reason = mark.args[0] if mark.args else "native edition only"
            item.add_marker(pytest.mark.skip(reason=f"native edition only: {reason}"))
        mark = item.get_closest_marker("extension_only")
        if mark is not None and plain:
            item.add_marker(pytest.mark.skip(reason=f"not in the portable plain script: {mark.args[0]}"))


if EDITION == "portable":
    # Where a test creates the extension: on the plain route (no CREATE EXTENSION) the plain
    # script runs instead, and DROP EXTENSION drops the schemas it made; on the pg_tle route
    # pg_tle is created and the extension registered in that database first (not in template1:
    # a database restored from a dump brings its own registration).
    _ROUTE = portable_route(PG_BIN)
    _CREATE = re.compile(r"^\s*CREATE\s+EXTENSION\s+(IF\s+NOT\s+EXISTS\s+)?idempotency\s*;?\s*$", re.I)
    _DROP = re.compile(r"^\s*DROP\s+EXTENSION\s+(IF\s+EXISTS\s+)?idempotency(\s+CASCADE)?\s*;?\s*$", re.I)
    _EMBEDDED = re.compile(r"^CREATE EXTENSION IF NOT EXISTS idempotency;$", re.M | re.I)
    with open(PORTABLE_PLAIN, encoding="utf-8") as _f:
        _PLAIN = _f.read()
    with open(pgtle_script(), encoding="utf-8") as _f:
        _PGTLE = ("CREATE EXTENSION IF NOT EXISTS pg_tle;\n" + _f.read().rstrip().rstrip(";")
                  + "\nWHERE NOT EXISTS (SELECT FROM pgtle.available_extensions() AS a WHERE a.name = 'idempotency');\n")

    def _rewrite(query):
        if not isinstance(query, str):
            return query
        if _ROUTE == "pgtle":
            if _CREATE.match(query):
                return _PGTLE + query
            return _EMBEDDED.sub(lambda m: _PGTLE + m.group(0), query)
        # A script of several statements that makes sure the extension exists (examples/).
        query = _EMBEDDED.sub("DO $$BEGIN IF to_regnamespace('idempotency') IS NULL THEN RAISE EXCEPTION "
                              "'portable plain route: install dist/idempotency-portable.sql first'; END IF; END$$;",
                              query)
        m = _CREATE.match(query)
        if m:
            if m.group(1):
                return ("DO $$BEGIN IF to_regnamespace('idempotency') IS NULL THEN "
                        "RAISE EXCEPTION 'portable plain route: IF NOT EXISTS is run as CREATE'; END IF; END$$")
            return _PLAIN.replace("\nBEGIN;\n", "\n", 1).replace("\nCOMMIT;\n", "\n")
        m = _DROP.match(query)
        if m:
            return ("DROP SCHEMA " + ("IF EXISTS " if m.group(1) else "")
                    + "idempotency, idempotency_monitor CASCADE")
        return query

    _connection_execute = psycopg.Connection.execute
    _cursor_execute = psycopg.Cursor.execute

    def _conn_execute(self, query, *args, **kw):
        return _connection_execute(self, _rewrite(query), *args, **kw)

    def _cur_execute(self, query, *args, **kw):
        return _cursor_execute(self, _rewrite(query), *args, **kw)

    psycopg.Connection.execute = _conn_execute
    psycopg.Cursor.execute = _cur_execute


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
