"""The worked stored procedure of docs/patterns.md (examples/place_order.sql) and the demo script."""

import os
import subprocess

import pytest
from psycopg.types.json import Jsonb

from cluster import PG_BIN
from helpers import race

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


def test_place_order_refuses_a_bad_key_or_client_before_writing(shop, db):
    """Each refusal is a 400 answer in the shape of the others, saying what is wrong, and
    nothing is written: no order, no charge, no claim."""
    order = {"items": [{"sku": "C3", "qty": 1}], "amount": 5, "currency": "EUR"}
    call = "SELECT shop.place_order(%s, %s, %s)"
    cases = [
        ("client-9", "k" * 240, "Idempotency-Key is malformed", "too long: 240 characters, at most 200"),
        ("client-9", "k" * 201, "Idempotency-Key is malformed", "too long: 201 characters"),
        ("client-9", "", "Idempotency-Key is malformed", "empty"),
        ("client-9", None, "Idempotency-Key is missing", "1 to 200 characters"),
        (None, "key-9", "Client id is missing", "1 to 64 characters"),
        ("", "key-9", "Client id is missing", "1 to 64 characters"),
        ("c" * 65, "key-9", "Client id is too long", "65 characters, at most 64"),
    ]
    for client, key, title, why in cases:
        r = db.execute(call, (client, key, Jsonb(order))).fetchone()[0]
        assert r["status"] == 400, (client, key, r)
        assert r["body"]["title"] == title and why in r["body"]["detail"], (client, key, r)
    assert db.execute("SELECT count(*) FROM shop.orders").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM shop.payment_outbox").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0] == 0

    # The longest accepted key and client id: the order is placed and charged.
    r = db.execute(call, ("c" * 64, "k" * 200, Jsonb(order))).fetchone()[0]
    assert r["status"] == 201, r
    charge_key = r["body"]["charge_key"]
    assert charge_key.startswith("k" * 200 + ":charge:") and len(charge_key) <= 255
    assert db.execute("SELECT idempotency_key, order_id FROM shop.payment_outbox").fetchall() == [
        (charge_key, r["body"]["order_id"])]


def test_place_order_charge_keys_do_not_collide_across_clients(shop, db):
    """('a/b', 'c') and ('a', 'b/c') are two clients' orders: each gets its own charge. A charge
    key built from client_id || '/' || key would be the same for both, and the outbox's ON
    CONFLICT DO NOTHING would drop the second order's charge."""
    order = {"items": [{"sku": "D4", "qty": 1}], "amount": 12, "currency": "EUR"}
    call = "SELECT shop.place_order(%s, %s, %s)"
    first = db.execute(call, ("a/b", "c", Jsonb(order))).fetchone()[0]
    second = db.execute(call, ("a", "b/c", Jsonb(order))).fetchone()[0]
    assert first["status"] == 201 and second["status"] == 201, (first, second)
    assert first["body"]["order_id"] != second["body"]["order_id"]
    assert first["body"]["charge_key"] != second["body"]["charge_key"]
    orders = db.execute("SELECT id, client_id FROM shop.orders ORDER BY id").fetchall()
    assert orders == [(first["body"]["order_id"], "a/b"), (second["body"]["order_id"], "a")]
    outbox = db.execute("SELECT idempotency_key, order_id, amount FROM shop.payment_outbox "
                        "ORDER BY order_id").fetchall()
    assert outbox == [(first["body"]["charge_key"], first["body"]["order_id"], 12),
                      (second["body"]["charge_key"], second["body"]["order_id"], 12)]


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
