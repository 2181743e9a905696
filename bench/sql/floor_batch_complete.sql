-- Batch floor of claim + complete: 100 rows inserted, then updated, in one transaction.
\set k random(1, 1000000000000000)
BEGIN;
INSERT INTO bench.floor_batch (scope, key, request_hash, status, token, locked_until, expires_at, ttl)
SELECT '', 'fc' || :client_id || '-' || :k || '-' || i, sha256('{"amount":100,"currency":"EUR"}'), 'in_progress',
       :k::bigint * 100 + i, now() + interval '5 minutes', now() + interval '24 hours', interval '24 hours'
  FROM generate_series(1, 100) AS i
ON CONFLICT (scope, key) DO NOTHING;
UPDATE bench.floor_batch SET status = 'completed', response = '{"ok": true}', response_status = 200,
       completed_at = now(), locked_until = NULL, expires_at = now() + ttl
 WHERE scope = '' AND key = ANY (ARRAY(SELECT 'fc' || :client_id || '-' || :k || '-' || i FROM generate_series(1, 100) AS i));
END;
