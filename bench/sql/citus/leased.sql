\set s random(1, 1000)
\set k random(1, 1000000000000000)
SELECT token FROM idempotency.claim('l:client_id-:k', '{"amount": 100, "currency": "EUR"}', 't:s') \gset
SELECT idempotency.complete('l:client_id-:k', '{"ok": true}', 200, 't:s', :token);
