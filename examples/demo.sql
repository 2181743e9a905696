-- A tour of the extension: run by scripts/demo.sh against a throwaway cluster.
\pset footer off
\set QUIET on
CREATE EXTENSION idempotency;
CREATE EXTENSION dblink;   -- only to play a second session below
\set QUIET off

\echo
\echo '1. A payment request arrives with Idempotency-Key pay-123: the first claim is new.'
SELECT outcome, token, expires_at > now() AS live
  FROM idempotency.claim('pay-123', '{"amount": 1000, "currency": "EUR"}', scope => 'client-7');

\echo '   The charge runs, then the response is stored (one transaction or leased: see README).'
SELECT idempotency.complete('pay-123', '{"charge_id": "ch_1", "amount": 1000}', 201, scope => 'client-7') > now()
       AS completed;

\echo
\echo '2. The client retries (same body, keys reordered, 1000.0 spelt differently): replay.'
SELECT outcome, response, response_status
  FROM idempotency.claim('pay-123', '{"currency": "EUR", "amount": 1000.0}', scope => 'client-7');

\echo
\echo '3. The same key with a different body: mismatch (and one WARNING in the log).'
SET client_min_messages = error;
SELECT outcome FROM idempotency.claim('pay-123', '{"amount": 9999, "currency": "EUR"}', scope => 'client-7');
RESET client_min_messages;

\echo
\echo '4. Leased style: a worker claims and commits, then works outside the database.'
SELECT outcome, token FROM idempotency.claim('job-9', lease => '2 seconds') \gset job9_
\echo '   outcome' :job9_outcome ', token' :job9_token
\echo '   A duplicate delivery meanwhile gets in_progress and how long to wait:'
SELECT outcome, retry_after FROM idempotency.claim('job-9');
\echo '   Another session that claims inside an open transaction is seen at once, without waiting:'
SELECT dblink_connect('other', :'conn');
SELECT dblink_exec('other', 'BEGIN');
SELECT * FROM dblink('other', $$SELECT outcome::text FROM idempotency.claim('open-tx-key')$$) AS t(outcome text);
SELECT outcome, retry_after FROM idempotency.claim('open-tx-key');
SELECT dblink_exec('other', 'ROLLBACK');
\echo '   Its transaction rolled back, so the claim is gone and the key is new again:'
SELECT outcome FROM idempotency.claim('open-tx-key');

\echo
\echo '5. The worker of job-9 recorded a checkpoint, then crashed. When its lease runs out,'
\echo '   the next claim takes over with a larger token and learns where to resume.'
SELECT idempotency.checkpoint('job-9', 'image-resized');
SELECT pg_sleep(2.1);
SELECT outcome, token, recovery_point FROM idempotency.claim('job-9');
\echo '   The old worker is fenced off: its token is stale (SQLSTATE IK003).'
SELECT set_config('demo.old_token', :'job9_token', false) AS old_token;
DO $$
BEGIN
    PERFORM idempotency.complete('job-9', '{}', token => current_setting('demo.old_token')::bigint);
EXCEPTION WHEN SQLSTATE 'IK003' THEN
    RAISE NOTICE 'stale worker refused: %', SQLERRM;
END $$;

\echo
\echo '6. Keys expire after their TTL, whether or not anything swept them.'
SELECT outcome FROM idempotency.claim('short-lived', ttl => '1 second', lease => '1 second');
SELECT idempotency.complete('short-lived', '{"ok": true}') IS NOT NULL AS completed;
SELECT pg_sleep(1.1);
SELECT outcome FROM idempotency.claim('short-lived', '{"a different": "request"}');
\echo '   The sweeper (or idempotency.sweep(), by hand) deletes expired rows in batches:'
SELECT count(*) AS claimed FROM generate_series(1, 5) i, idempotency.claim('tmp-' || i, ttl => '1 second', lease => '1 second');
SELECT pg_sleep(1.1);
SELECT idempotency.sweep() AS rows_swept;

\echo
\echo '7. Derived keys for downstream side effects, and canonical hashing:'
SELECT idempotency.derive_key('pay-123', 'charge', '{"amount": 1000}') AS derived,
       idempotency.cron_key('nightly-report', '2026-11-30 01:59+00', '1 day') AS cron,
       idempotency.canonical_json('{"b": [1.50, 1e400], "a": "x"}') AS canonical;

\echo
\echo '8. Keys a client cannot forge: sign them when you hand them out, verify when they come back.'
SELECT idempotency.rotate_signing_secret() AS secret_id \gset
SELECT idempotency.sign_key('checkout:42') AS signed \gset
SELECT :'signed' AS signed_key, idempotency.verify_key(:'signed') AS verified;
SELECT set_config('demo.forged', regexp_replace(:'signed', '^checkout:42', 'checkout:43'), false) AS forged;
DO $$
BEGIN
    PERFORM idempotency.verify_key(current_setting('demo.forged'));
EXCEPTION WHEN SQLSTATE 'IK004' THEN
    RAISE NOTICE 'forged key refused: %', SQLERRM;
END $$;

\echo
\echo
SELECT scope, key, status, token, response_status, recovery_point FROM idempotency.idempotency_keys ORDER BY key;
