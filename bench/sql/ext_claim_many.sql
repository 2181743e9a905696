-- claim_many of 100 fresh keys, each with a request, one autocommitted statement.
\set k random(1, 1000000000000000)
SELECT count(*) FROM idempotency.claim_many(
    ARRAY(SELECT 'b' || :client_id || '-' || :k || '-' || i FROM generate_series(1, 100) AS i),
    array_fill('{"amount": 100, "currency": "EUR"}'::jsonb, ARRAY[100]));
