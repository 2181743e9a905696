\set k random(1, 1000000000000000)
BEGIN;
SELECT * FROM bench.ref_claim('p' || :client_id || '-' || :k, '{"amount": 100, "currency": "EUR"}');
SELECT bench.ref_complete('p' || :client_id || '-' || :k, '{"ok": true}');
END;
