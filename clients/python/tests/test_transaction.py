"""idempotency_transaction: claim, the caller's writes and complete in one transaction."""

import asyncio
import datetime as dt
import threading

import psycopg
import pytest

from pg_idempotency import InProgress, Mismatch, aidempotency_transaction, idempotency_transaction


@pytest.fixture
def shop(db):
    db.execute("CREATE TABLE IF NOT EXISTS orders (id serial PRIMARY KEY, item text)")
    db.execute("TRUNCATE orders")
    return db


def place(conn, key, item, **kw):
    with idempotency_transaction(conn, key, request={"item": item}, scope="orders", **kw) as c:
        if c.replayed:
            return c.response_status, c.response, True
        (order_id,) = conn.execute("INSERT INTO orders (item) VALUES (%s) RETURNING id", (item,)).fetchone()
        c.complete({"order_id": order_id}, 201)
        return 201, {"order_id": order_id}, False


def count(db):
    return db.execute("SELECT count(*) FROM orders").fetchone()[0]


def test_new_replay_mismatch(conninfo, shop, row):
    conn = psycopg.connect(conninfo, autocommit=True)
    status, body, replayed = place(conn, "o-1", "book")
    assert (status, replayed) == (201, False)
    assert place(conn, "o-1", "book") == (201, body, True)
    with pytest.raises(Mismatch):
        place(conn, "o-1", "pen")
    assert count(shop) == 1 and row("o-1", "orders")[:3] == ("completed", body, 201)


def test_an_error_rolls_back_the_claim_with_the_writes(conninfo, shop, row):
    conn = psycopg.connect(conninfo, autocommit=True)
    with pytest.raises(ZeroDivisionError):
        with idempotency_transaction(conn, "o-2", request={"item": "x"}, scope="orders"):
            conn.execute("INSERT INTO orders (item) VALUES ('x')")
            raise ZeroDivisionError("the work fails before complete")
    assert row("o-2", "orders") is None and count(shop) == 0
    assert place(conn, "o-2", "x")[2] is False              # the retry is new
    with pytest.raises(RuntimeError, match="without complete"):
        with idempotency_transaction(conn, "o-3", scope="orders"):
            pass
    assert row("o-3", "orders") is None


def test_inside_the_callers_transaction(conninfo, shop, row):
    conn = psycopg.connect(conninfo)                          # not autocommit
    with conn.transaction():
        conn.execute("SELECT 1")                             # the caller's own work
        place(conn, "o-4", "a")                              # a savepoint in it
    assert row("o-4", "orders")[0] == "completed"            # committed with the caller's block
    try:
        with conn.transaction():
            place(conn, "o-5", "b")
            raise ValueError("the caller aborts")
    except ValueError:
        pass
    assert row("o-5", "orders") is None and count(shop) == 1


def test_another_open_transaction_is_in_progress_or_waited_for(conninfo, shop):
    a = psycopg.connect(conninfo, autocommit=True)
    b = psycopg.connect(conninfo, autocommit=True)
    with a.transaction():
        with idempotency_transaction(a, "o-6", request={"item": "c"}, scope="orders") as c:
            a.execute("INSERT INTO orders (item) VALUES ('c')")
            c.complete({"order_id": 1}, 201)
            with pytest.raises(InProgress) as e:                # b meets a's uncommitted claim
                place(b, "o-6", "c")
            assert dt.timedelta(0) < e.value.retry_after <= dt.timedelta(seconds=1)
            result = []
            t = threading.Thread(target=lambda: result.append(place(b, "o-6", "c", wait=dt.timedelta(seconds=5))))
            t.start()
            t.join(0.3)
            assert t.is_alive()                                # waiting on a's transaction
    t.join(10)
    assert result == [(201, {"order_id": 1}, True)] and count(shop) == 1


def test_async(conninfo, shop):
    async def main():
        conn = await psycopg.AsyncConnection.connect(conninfo, autocommit=True)
        for expect in (False, True):
            async with aidempotency_transaction(conn, "o-7", request={"item": "d"}, scope="orders") as c:
                assert c.replayed is expect
                if not c.replayed:
                    await conn.execute("INSERT INTO orders (item) VALUES ('d')")
                    await c.acomplete({"ok": True})
        assert c.response == {"ok": True}
        await conn.close()

    asyncio.run(main())
    assert count(shop) == 1
