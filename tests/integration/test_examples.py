"""The README's worked stored procedure (examples/place_order.sql) and the demo script."""

import os
import subprocess

import pytest
from psycopg.types.json import Jsonb

from cluster import PG_BIN
from test_concurrency import race

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture
def shop(db):
    with open(os.path.join(ROOT, "examples", "place_order.sql")) as f:
        db.execute("DROP SCHEMA IF EXISTS shop CASCADE")
        db.execute(f.read())


def test_place_order_charges_once(shop, db):
    order = {"items": [{"sku": "A1", "qty": 2}], "amount": 59.90, "currency": "EUR"}
    call = "SELECT shop.place_order(%s, %s, %s)"

    first = db.execute(call, ("client-7", "key-1", Jsonb(order))).fetchone()[0]
    assert first["status"] == 201
    # Retries, one of them with the members in another order: the same answer, replayed.
    for again in (order, dict(reversed(list(order.items())))):
        r = db.execute(call, ("client-7", "key-1", Jsonb(again))).fetchone()[0]
        assert r["status"] == 201 and r["body"] == first["body"]
        assert r["headers"]["Idempotent-Replayed"] == "true"
    # The same key with another amount is refused; another client's key-1 is its own.
    assert db.execute(call, ("client-7", "key-1", Jsonb({**order, "amount": 1}))).fetchone()[0]["status"] == 422
    other = db.execute(call, ("client-8", "key-1", Jsonb(order))).fetchone()[0]
    assert other["status"] == 201 and other["body"]["order_id"] != first["body"]["order_id"]
    assert db.execute(call, ("client-7", None, Jsonb(order))).fetchone()[0]["status"] == 400
    assert db.execute("SELECT count(*) FROM shop.orders").fetchone()[0] == 2
    outbox = db.execute("SELECT idempotency_key FROM shop.payment_outbox ORDER BY order_id").fetchall()
    assert [k for (k,) in outbox] == [first["body"]["charge_key"], other["body"]["charge_key"]]


def test_place_order_storm_creates_one_order(shop, cluster, db):
    order = {"items": [{"sku": "B2", "qty": 1}], "amount": 10, "currency": "USD"}
    answers = race(
        cluster,
        lambda conn, i: conn.execute("SELECT shop.place_order('storm', 'k', %s)", (Jsonb(order),)).fetchone()[0],
        n=20,
    )
    assert sorted(a["status"] for a in answers).count(201) >= 1
    assert all(a["status"] in (201, 409) for a in answers), answers
    assert db.execute("SELECT count(*) FROM shop.orders WHERE client_id = 'storm'").fetchone()[0] == 1
    created = [a for a in answers if a["status"] == 201]
    assert all(a["body"] == created[0]["body"] for a in created)


def test_demo_script_runs(cluster, db):
    db.execute("DROP DATABASE IF EXISTS demo")
    db.execute("CREATE DATABASE demo")
    conn = f"host={cluster.dir} port={cluster.port} user=postgres dbname=demo"
    out = subprocess.run(
        [f"{PG_BIN}/psql", "-X", "-v", "ON_ERROR_STOP=1", "-v", f"conn={conn}", "-d", conn,
         "-f", os.path.join(ROOT, "examples", "demo.sql")],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr
    for expected in ("replay", "mismatch", "in_progress", "image-resized", "stale worker refused",
                     "forged key refused"):
        assert expected in out.stdout + out.stderr, expected
    db.execute("DROP DATABASE demo")
