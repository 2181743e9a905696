\set k random(1, 1000000000000000)
BEGIN;
SELECT bench.wrapped_insert('w' || :client_id || '-' || :k, :k);
SELECT bench.wrapped_update('w' || :client_id || '-' || :k);
END;
