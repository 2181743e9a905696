-- Portable edition: the mark protocol that orders the writes of one key.
--
-- A transaction marks each key it writes with a transaction-scoped advisory lock (its first
-- @PORTABLE_MARKS_PER_TRANSACTION@ keys), so that a claim of a key another open transaction is
-- writing answers in_progress instead of waiting on its row, as the native edition answers.
--
-- Part of the store in SQL and PL/pgSQL: sql/portable/README.md says how the files fit together.

-- A key's advisory lock number, its mark: a 64-bit hash of its scope and stored key,
-- pg_catalog.hashtextextended(length(scope) || ':' || scope || key, 5432), written out where it is
-- taken ("the key's lock number" there).

-- A write's mark where its first try failed. A claim's check of the key (a shared lock on its
-- number, released at once) holds the number for an instant: tried again for up to 127 ms
-- before the write goes on without the mark. Held longer, the number is another writer's mark
-- or some session's own lock of it, which marks the key either way; no write waits longer for
-- it (any role can compute the number and hold it).
CREATE FUNCTION idempotency._p_lock_retry(lock_id bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    FOR v_try IN 1 .. 7 LOOP
        PERFORM pg_catalog.pg_sleep((ARRAY[0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064])[v_try]);
        IF pg_catalog.pg_try_advisory_xact_lock(lock_id) THEN
            RETURN true;
        END IF;
    END LOOP;
    RETURN false;
END
$fn$;

-- Marks a key as changed by this transaction: a transaction-scoped advisory lock on its lock
-- number, taken by claim before it inserts a key (false when another open transaction holds
-- it: the claim answers from that) and by the trigger below before any row of the store is
-- inserted, updated or deleted (`wait`: tried again for a moment, _p_lock_retry, then true
-- either way; the row's own lock orders the writes, and a number held by any other session, an
-- application's pg_advisory_lock of it included, never makes a write wait long). A claim that
-- finds a key marked by another open transaction answers in_progress at once instead of
-- waiting for that transaction (the native edition sees the uncommitted change itself). A
-- transaction marks its first @PORTABLE_MARKS_PER_TRANSACTION@ keys (the lock table is shared and finite; a backfill of
-- 100,000 keys in one transaction must work): a claim of a later one by another session, within
-- its own first @PORTABLE_MARKS_PER_TRANSACTION@, waits until the backfill's transaction ends, as an INSERT would (a wait
-- one way only: the backfill waits for no claim). Past its first @PORTABLE_MARKS_PER_TRANSACTION@, a claim
-- gets NULL (not marked, and no other transaction marked the key) and inserts without waiting
-- (_p_claim): two such transactions claiming the same keys would otherwise each wait for the
-- other's unmarked rows, a deadlock.
CREATE FUNCTION idempotency._p_mark(scope text, key text, wait boolean)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_xact text := pg_catalog.pg_current_xact_id()::text;
    v_state text := pg_catalog.current_setting('idempotency_portable.marks', true);
    v_count integer := 0;
    v_lock bigint := pg_catalog.hashtextextended(pg_catalog.length(scope)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                                   OPERATOR(pg_catalog.||) scope OPERATOR(pg_catalog.||) key, 5432);  -- the key's lock number
BEGIN
    IF pg_catalog.split_part(v_state, ':', 1) OPERATOR(pg_catalog.=) v_xact THEN
        v_count := pg_catalog.split_part(v_state, ':', 2)::integer;
    END IF;
    IF v_count OPERATOR(pg_catalog.>=) @PORTABLE_MARKS_PER_TRANSACTION@ THEN
        -- Not marked; a key another transaction marked is still refused.
        IF wait THEN
            RETURN true;
        ELSIF idempotency._p_marked(scope, key) THEN
            RETURN false;
        END IF;
        RETURN NULL;
    END IF;
    IF NOT pg_catalog.pg_try_advisory_xact_lock(v_lock)
       AND NOT (wait AND idempotency._p_lock_retry(v_lock)) THEN
        RETURN wait;
    END IF;
    -- Session-level (not LOCAL): the SET clause of this function would undo a local change.
    -- Rolled back with the transaction, as the locks are released with it. Not under the
    -- prefix idempotency.: where the native library is loaded (a server moving between the
    -- editions) that prefix is reserved for its settings.
    PERFORM pg_catalog.set_config('idempotency_portable.marks',
                                  v_xact OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) (v_count OPERATOR(pg_catalog.+) 1), false);
    RETURN true;
END
$fn$;

-- Whether another open transaction marked the key (holds its lock): tested with a session-level
-- shared lock, released at once (a backend's own locks never conflict with it).
CREATE FUNCTION idempotency._p_marked(scope text, key text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_lock bigint := pg_catalog.hashtextextended(pg_catalog.length(scope)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                                   OPERATOR(pg_catalog.||) scope OPERATOR(pg_catalog.||) key, 5432);  -- the key's lock number
BEGIN
    IF NOT pg_catalog.pg_try_advisory_lock_shared(v_lock) THEN
        RETURN true;
    END IF;
    PERFORM pg_catalog.pg_advisory_unlock_shared(v_lock);
    RETURN false;
END
$fn$;

-- The trigger that marks every key whose row is inserted, updated or deleted (see _p_mark).
CREATE FUNCTION idempotency._p_mark_row()
RETURNS trigger
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_xact text;
    v_state text;
    v_count integer := 0;
    v_scope text;
    v_key text;
    v_lock bigint;
    v_marked boolean;
BEGIN
    IF TG_OP OPERATOR(pg_catalog.=) 'INSERT' THEN
        v_scope := NEW.scope;
        v_key := NEW.key;
    ELSE
        v_scope := OLD.scope;
        v_key := OLD.key;
    END IF;
    -- _p_mark(v_scope, v_key, true) written out (a nested call costs more than its work here,
    -- on every row a sweep, a release or a direct write changes).
    v_xact := pg_catalog.pg_current_xact_id()::pg_catalog.text;
    v_state := pg_catalog.current_setting('idempotency_portable.marks', true);
    IF pg_catalog.split_part(v_state, ':', 1) OPERATOR(pg_catalog.=) v_xact THEN
        v_count := pg_catalog.split_part(v_state, ':', 2)::pg_catalog.int4;
    END IF;
    IF v_count OPERATOR(pg_catalog.<) @PORTABLE_MARKS_PER_TRANSACTION@ THEN
        v_lock := pg_catalog.hashtextextended(pg_catalog.length(v_scope)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                                              OPERATOR(pg_catalog.||) v_scope OPERATOR(pg_catalog.||) v_key, 5432);
        v_marked := pg_catalog.pg_try_advisory_xact_lock(v_lock);
        -- _p_lock_retry written out (a trigger runs as whoever writes the row).
        FOR v_try IN 1 .. 7 LOOP
            EXIT WHEN v_marked;
            PERFORM pg_catalog.pg_sleep((ARRAY[0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064])[v_try]);
            v_marked := pg_catalog.pg_try_advisory_xact_lock(v_lock);
        END LOOP;
        IF v_marked THEN
            PERFORM pg_catalog.set_config('idempotency_portable.marks',
                                          v_xact OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) (v_count OPERATOR(pg_catalog.+) 1), false);
        END IF;
    END IF;
    IF TG_OP OPERATOR(pg_catalog.=) 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
$fn$;

-- Not where the writing function marked the key itself just before (claim's insert,
-- complete's update: idempotency_portable.marked is on for that statement), which spares the
-- call on the path of every request.
CREATE TRIGGER idempotency_keys_mark
    BEFORE INSERT OR UPDATE OR DELETE ON idempotency.idempotency_keys
    FOR EACH ROW
    WHEN (pg_catalog.current_setting('idempotency_portable.marked', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION idempotency._p_mark_row();
