\set k random(1, 1000000000000000)
SELECT token FROM idempotency.claim('l' || :client_id || '-' || :k, '{"amount": 100, "currency": "EUR"}') \gset
SELECT idempotency.complete('l' || :client_id || '-' || :k, '{"ok": true}', token => :token);
