-- claim_many + complete_many of 100 fresh keys in one transaction.
\set k random(1, 1000000000000000)
BEGIN;
SELECT count(*) FROM idempotency.claim_many(
    ARRAY(SELECT 'bc' || :client_id || '-' || :k || '-' || i FROM generate_series(1, 100) AS i),
    array_fill('{"amount": 100, "currency": "EUR"}'::jsonb, ARRAY[100]));
SELECT count(*) FROM idempotency.complete_many(
    ARRAY(SELECT 'bc' || :client_id || '-' || :k || '-' || i FROM generate_series(1, 100) AS i),
    array_fill('{"ok": true}'::jsonb, ARRAY[100]));
END;
