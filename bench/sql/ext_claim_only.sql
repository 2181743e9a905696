-- Claim-only deduplication: one autocommitted claim of a fresh key (against Redis SET NX EX).
\set k random(1, 1000000000000000)
SELECT outcome FROM idempotency.claim('c' || :client_id || '-' || :k, '{"amount": 100, "currency": "EUR"}');
