"""Who may use the extension: nobody but the owner until granted; the README's grants suffice;
claim's lookup below SQL does not bypass table privileges."""

import psycopg
import pytest

from test_concurrency import claim

GRANTS = """
GRANT USAGE ON SCHEMA idempotency TO app;
GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency.idempotency_keys TO app;
GRANT USAGE ON SEQUENCE idempotency.token_seq TO app;
"""


@pytest.fixture
def app(cluster, db):
    db.execute("DROP DATABASE IF EXISTS privileges")
    db.execute("DROP ROLE IF EXISTS app")
    db.execute("CREATE ROLE app LOGIN")
    db.execute("CREATE DATABASE privileges")
    info = cluster.conninfo().replace("dbname=idem", "dbname=privileges")
    with psycopg.connect(info, autocommit=True) as owner:
        owner.execute("CREATE EXTENSION idempotency")
        with psycopg.connect(info.replace("user=postgres", "user=app"), autocommit=True) as c:
            yield owner, c
    db.execute("DROP DATABASE privileges")
    db.execute("DROP ROLE app")


def test_nothing_without_grants_everything_with_them(app):
    owner, c = app
    for sql in ["SELECT idempotency.claim('k')", "SELECT count(*) FROM idempotency.idempotency_keys"]:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute(sql)
    owner.execute(GRANTS)
    first = claim(c, "k", {"a": 1})
    assert first[0] == "new"
    c.execute("SELECT idempotency.complete('k', '{\"ok\": true}', token => %s)", (first[1],))
    assert claim(c, "k", {"a": 1})[0] == "replay"
    assert c.execute("SELECT (idempotency.lookup('k')).status::text").fetchone()[0] == "completed"
    assert claim(c, "j")[0] == "new"
    assert c.execute("SELECT idempotency.release('j')").fetchone()[0] is True
    assert c.execute("SELECT idempotency.forget('k')").fetchone()[0] is True
    assert c.execute("SELECT idempotency.sweep()").fetchone()[0] == 0


def test_claim_does_not_read_around_revoked_privileges(app):
    owner, c = app
    owner.execute(GRANTS)
    assert claim(c, "k", {"a": 1})[0] == "new"
    c.execute("SELECT idempotency.complete('k', '{\"secret\": 1}')")
    assert claim(c, "k", {"a": 1})[0] == "replay"  # answered from the probe, no SQL
    owner.execute("REVOKE SELECT ON idempotency.idempotency_keys FROM app")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        claim(c, "k", {"a": 1})
