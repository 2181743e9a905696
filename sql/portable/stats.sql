-- Portable edition: counters.
--
-- The native edition's counters live in shared memory, which this edition has not: stats
-- shows NULL for them (and for last_sweep_error). The row counts, oldest_expiry and
-- sweep_lag_seconds come from the table, as natively (sql/idempotency.sql).
--
-- Part of the store in SQL and PL/pgSQL: sql/portable/README.md says how the files fit together.

-- Counts nothing: the counters of the native edition live in shared memory (stats shows NULL).
BODY idempotency._count
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF event IS NULL OR event OPERATOR(pg_catalog.<>) ALL (ARRAY['release', 'stale_token']) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = idempotency._canon_message(pg_catalog.format('event must be ''release'' or ''stale_token'' (got %s)',
                                                                   idempotency._canon_quote(COALESCE(event, 'NULL'))));
    END IF;
END
$fn$;

-- The counters need shared memory: NULL in this edition, for the roles that may read them.
BODY idempotency._shared_stats
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    -- One check after the other: naming idempotency.stats needs USAGE on its schema.
    IF (SELECT a.rolsuper FROM pg_catalog.pg_roles AS a WHERE a.rolname OPERATOR(pg_catalog.=) CURRENT_USER) THEN
        preloaded := false;
        RETURN;
    END IF;
    IF pg_catalog.has_schema_privilege(CURRENT_USER, 'idempotency_monitor', 'USAGE') THEN
        preloaded := false;
        RETURN;
    END IF;
    IF NOT (pg_catalog.has_schema_privilege(CURRENT_USER, 'idempotency', 'USAGE')
            AND pg_catalog.has_table_privilege(CURRENT_USER, 'idempotency.stats', 'SELECT')) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'insufficient_privilege',
            MESSAGE = 'idempotency._shared_stats: the database-wide counters are for roles that may read idempotency.stats',
            HINT = 'for a monitoring role: GRANT USAGE ON SCHEMA idempotency_monitor TO <role>; (see the README''s Privileges and tenants)';
    END IF;
    preloaded := false;
END
$fn$;
