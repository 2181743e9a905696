\set k random(1, 1000000000000000)
BEGIN;
SELECT * FROM idempotency.claim('e' || :client_id || '-' || :k, '{"amount": 100, "currency": "EUR"}');
SELECT idempotency.complete('e' || :client_id || '-' || :k, '{"ok": true}');
END;
