\set k random(1, 10000)
SELECT * FROM idempotency.claim('r' || :k, '{"amount": 100, "currency": "EUR"}');
