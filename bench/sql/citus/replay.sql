\set s random(1, 1000)
SELECT * FROM idempotency.claim('r', '{"amount": 100, "currency": "EUR"}', 't:s');
