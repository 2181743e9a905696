\set s random(1, 1000)
\set k random(1, 1000000000000000)
BEGIN;
SELECT * FROM idempotency.claim('e:client_id-:k', '{"amount": 100, "currency": "EUR"}', 't:s');
SELECT idempotency.complete('e:client_id-:k', '{"ok": true}', 200, 't:s');
END;
