-- Batch floor: a bare multi-row INSERT ... ON CONFLICT DO NOTHING of 100 fresh rows into a table
-- with the store's two indexes (bench.floor_batch), one autocommitted statement.
\set k random(1, 1000000000000000)
INSERT INTO bench.floor_batch (scope, key, request_hash, status, token, locked_until, expires_at, ttl)
SELECT '', 'fb' || :client_id || '-' || :k || '-' || i, sha256('{"amount":100,"currency":"EUR"}'), 'in_progress',
       :k::bigint * 100 + i, now() + interval '5 minutes', now() + interval '24 hours', interval '24 hours'
  FROM generate_series(1, 100) AS i
ON CONFLICT (scope, key) DO NOTHING;
