-- The floor of claim-only deduplication: the bare autocommitted INSERT ... ON CONFLICT DO
-- NOTHING of the row a claim writes.
\set k random(1, 1000000000000000)
INSERT INTO bench.floor (scope, key, request_hash, status, token, locked_until, expires_at, ttl)
VALUES ('', 'fc' || :client_id || '-' || :k, sha256('{"amount":100,"currency":"EUR"}'), 'in_progress', :k,
        now() + interval '5 minutes', now() + interval '24 hours', interval '24 hours')
ON CONFLICT (scope, key) DO NOTHING;
