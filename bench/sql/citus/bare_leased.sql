\set s random(1, 1000)
\set k random(1, 1000000000000000)
INSERT INTO bench.bare (scope, key, request_hash, status, token, locked_until, expires_at, ttl)
VALUES ('t:s', 'c:client_id-:k', sha256('{"amount":100,"currency":"EUR"}'), 'in_progress', :k,
        now() + interval '5 minutes', now() + interval '24 hours', interval '24 hours')
ON CONFLICT (scope, key) DO NOTHING;
UPDATE bench.bare SET status = 'completed', response = '{"ok": true}', response_status = 200,
       completed_at = now(), locked_until = NULL, expires_at = now() + interval '24 hours'
 WHERE scope = 't:s' AND key = 'c:client_id-:k';
