\set k random(1, 100)
SELECT * FROM idempotency.claim('hot-' || :k, '{"amount": 100, "currency": "EUR"}');
