-- Portable edition: sweeps of expired keys and old audit rows.
--
-- No background sweeper runs in this edition: sweep() is called, or scheduled with pg_cron
-- (schedule_sweep).
--
-- Part of the store in SQL and PL/pgSQL: sql/portable/README.md says how the files fit together.

BODY idempotency.sweep
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_batch integer := idempotency._p_batch_size(sweep.batch_size);
    v_prefix text;
    v_total bigint := 0;
    v_n bigint;
BEGIN
    PERFORM idempotency._p_refuse_read_only('sweep');
    v_prefix := idempotency._p_sweep_prefix('sweep');
    -- The sweep's mark, before any row is locked: a claim of an expired key this transaction
    -- holds waits for it to end (idempotency._p_waited_for_sweep).
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(@SWEEP_LOCK_CLASS@,
                (pg_catalog.pg_current_xact_id()::pg_catalog.text::pg_catalog.int8)::pg_catalog.bit(32)::pg_catalog.int4);
    LOOP
        DELETE FROM idempotency.idempotency_keys AS k
         USING (SELECT s.scope, s.key FROM idempotency.idempotency_keys AS s
                 WHERE ((s.created_at AT TIME ZONE 'UTC') OPERATOR(pg_catalog.+) s.ttl)
                       OPERATOR(pg_catalog.<=) (pg_catalog.now() AT TIME ZONE 'UTC')
                   AND s.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()
                   AND pg_catalog.starts_with(s.scope, v_prefix)
                 ORDER BY ((s.created_at AT TIME ZONE 'UTC') OPERATOR(pg_catalog.+) s.ttl)
                 LIMIT v_batch FOR UPDATE SKIP LOCKED) AS d
         WHERE k.scope OPERATOR(pg_catalog.=) d.scope AND k.key OPERATOR(pg_catalog.=) d.key;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_total := v_total OPERATOR(pg_catalog.+) v_n;
        EXIT WHEN v_n OPERATOR(pg_catalog.<) v_batch;
    END LOOP;
    RETURN v_total;
END
$fn$;

-- Nothing to tell: no process of this edition caches how the store keeps keys.
BODY idempotency._store_changed
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
END
$fn$;

BODY idempotency.sweep_audit
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_batch integer := idempotency._p_batch_size(sweep_audit.batch_size);
    v_prefix text;
    v_retention integer;
    v_total bigint := 0;
    v_n bigint;
BEGIN
    PERFORM idempotency._p_refuse_read_only('sweep_audit');
    v_prefix := idempotency._p_sweep_prefix('sweep_audit');
    -- The retention binds every role but the store's owner (a whole-store sweep): natively a
    -- server setting (postgresql.conf, ALTER SYSTEM) no session changes, so here a tenant's
    -- sweep reads only what an administrator set, never the session's own value.
    v_retention := CASE WHEN v_prefix OPERATOR(pg_catalog.=) ''
                        THEN idempotency._p_setting('idempotency.audit_retention', 0, 's')
                        ELSE idempotency._p_setting_value('idempotency.audit_retention',
                                 idempotency._p_admin_setting('idempotency.audit_retention'), 0, 's') END;
    IF v_retention OPERATOR(pg_catalog.<=) 0 THEN
        RETURN 0;
    END IF;
    LOOP
        DELETE FROM idempotency.audit AS a
         WHERE a.id OPERATOR(pg_catalog.=) ANY (ARRAY(
               SELECT s.id FROM idempotency.audit AS s
                WHERE s.completed_at OPERATOR(pg_catalog.<) (pg_catalog.now()
                      OPERATOR(pg_catalog.-) pg_catalog.make_interval(secs => v_retention))
                  AND pg_catalog.starts_with(s.scope, v_prefix)
                LIMIT v_batch FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_total := v_total OPERATOR(pg_catalog.+) v_n;
        EXIT WHEN v_n OPERATOR(pg_catalog.<) v_batch;
    END LOOP;
    RETURN v_total;
END
$fn$;

-- No background sweeper in this edition (see idempotency.schedule_sweep).
BODY idempotency._sweeper_preloaded
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT false
$fn$;

-- No background sweeper to tell.
BODY idempotency._announce
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
END
$fn$;
