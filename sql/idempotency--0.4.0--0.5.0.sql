-- idempotency 0.4.0 -> 0.5.0 (see CHANGELOG.md)
--
-- Every object is left as a fresh 0.5.0 install creates it (tests/integration/test_upgrade.py
-- compares the two catalogs).

\echo Use "ALTER EXTENSION idempotency UPDATE TO '0.5.0'" to load this file. \quit

-- The encodings without a conversion to UTF-8: SQL_ASCII (refused since 0.3.0) and
-- MULE_INTERNAL, which 0.4.0 accepted and then failed every call in (42883).
DO $encoding$
BEGIN
    IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'SQL_ASCII' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'feature_not_supported',
            MESSAGE = 'idempotency does not support databases with encoding SQL_ASCII: their text has no defined characters, so it cannot be hashed as Unicode',
            HINT = 'create the database with ENCODING ''UTF8'' and install the extension there';
    END IF;
    IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'MULE_INTERNAL' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'feature_not_supported',
            MESSAGE = 'idempotency does not support databases with encoding MULE_INTERNAL: PostgreSQL has no conversion between it and UTF-8, so its text cannot be hashed as Unicode',
            HINT = 'create the database with ENCODING ''UTF8'' and install the extension there';
    END IF;
END
$encoding$;

-- The condition on the tenant that the PL/pgSQL functions add to their statements on a store
-- distributed by its tenant (distribute(tenant_type => ...), Citus), so that Citus sends each
-- to the tenant's shard alone: ' AND k.tenant OPERATOR(pg_catalog.=) <the scope as the type>'; ''
-- on any other store. A scope that is not the tenant id as the type writes it is refused
-- (22P02, naming scope), as claim and complete refuse it.
CREATE FUNCTION idempotency._tenant_filter(scope text)
RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_tenant pg_catalog.regtype;
BEGIN
    SELECT a.atttypid::pg_catalog.regtype INTO v_tenant FROM pg_catalog.pg_attribute AS a
     WHERE a.attrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
       AND a.attname OPERATOR(pg_catalog.=) 'tenant' AND NOT a.attisdropped;
    IF v_tenant IS NULL OR _tenant_filter.scope IS NULL THEN
        RETURN '';
    END IF;
    IF NOT (CASE WHEN v_tenant OPERATOR(pg_catalog.=) 'bigint'::pg_catalog.regtype
                THEN _tenant_filter.scope OPERATOR(pg_catalog.~) '^(0|-?[1-9][0-9]{0,18})$'
                     AND _tenant_filter.scope::pg_catalog.numeric
                         OPERATOR(pg_catalog.<=) 9223372036854775807::pg_catalog.numeric
                     AND _tenant_filter.scope::pg_catalog.numeric
                         OPERATOR(pg_catalog.>=) (-9223372036854775808)::pg_catalog.numeric
                ELSE _tenant_filter.scope OPERATOR(pg_catalog.~) '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
           END) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_text_representation',
            MESSAGE = pg_catalog.format('scope must be a tenant id of this store, a %s as PostgreSQL writes it: got %L',
                                        v_tenant, _tenant_filter.scope),
            HINT = 'the store is distributed by its tenant (idempotency.distribute(tenant_type => ...)): pass the tenant id as the scope';
    END IF;
    RETURN pg_catalog.format(' AND k.tenant OPERATOR(pg_catalog.=) %L::%s', _tenant_filter.scope, v_tenant);
END
$fn$;

REVOKE EXECUTE ON FUNCTION idempotency._tenant_filter(text) FROM PUBLIC;

-- Keys stored hashed: no caller learns the stored form of a key. lookup returns the key as given;
-- messages name a hashed key as (hashed); the helpers only the SECURITY DEFINER functions call
-- are no longer executable by PUBLIC.
CREATE OR REPLACE FUNCTION idempotency._raise_not_claimed(p_key text, p_scope text, p_token bigint, p_action text)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    r record;
    v_filter text;
    v_key text := idempotency._stored_key(p_key, p_scope);
    -- Messages name a hashed key as (hashed): nothing of its stored form, which the caller
    -- could otherwise have computed for any key and matched against a copy of the table.
    v_label text := CASE WHEN v_key OPERATOR(pg_catalog.=) p_key THEN pg_catalog.quote_literal(p_key)
                         ELSE '(hashed)' END;
BEGIN
    -- A store distributed by its tenant: the statement names the tenant too (_tenant_filter).
    v_filter := idempotency._tenant_filter(p_scope);
    IF v_filter OPERATOR(pg_catalog.=) '' THEN
        SELECT k.status, k.token, k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() AS live
          INTO r
          FROM idempotency.idempotency_keys AS k
         WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) v_key;
    ELSE
        EXECUTE 'SELECT k.status, k.token, k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() AS live '
                'FROM idempotency.idempotency_keys AS k WHERE k.scope OPERATOR(pg_catalog.=) $1 '
                'AND k.key OPERATOR(pg_catalog.=) $2' OPERATOR(pg_catalog.||) v_filter
          INTO r USING p_scope, v_key;
    END IF;
    IF r IS NULL OR NOT r.live THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK001',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: no live claim', p_action, v_label, p_scope),
            HINT = 'claim the key first; a claim that expired, was released or rolled back is gone';
    ELSIF r.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK002',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: it is already completed', p_action, v_label, p_scope),
            HINT = 'a completed key replays its stored response; claim it to read that response';
    ELSIF p_token OPERATOR(pg_catalog.<) r.token THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: token %s is stale, the current token is %s',
                                        p_action, v_label, p_scope, p_token, r.token),
            HINT = 'another worker took the key over after this lease ran out (or the token is another key''s); abandon this attempt';
    ELSE
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: token %s was never issued for it, the current token is %s',
                                        p_action, v_label, p_scope, p_token, r.token),
            HINT = 'pass the token that claim returned for this key';
    END IF;
    RETURN NULL;  -- not reached
END
$fn$;

CREATE OR REPLACE FUNCTION idempotency.lookup(key text, scope text DEFAULT '')
RETURNS idempotency.idempotency_keys
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_key text;
    v_filter text;
    r idempotency.idempotency_keys;
BEGIN
    v_key := idempotency._stored_key(lookup.key, lookup.scope);
    v_filter := idempotency._tenant_filter(lookup.scope);
    IF v_filter OPERATOR(pg_catalog.=) '' THEN
        SELECT k.* INTO r
          FROM idempotency.idempotency_keys AS k
         WHERE k.scope OPERATOR(pg_catalog.=) lookup.scope
           AND k.key OPERATOR(pg_catalog.=) v_key
           AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now();
    ELSE
        EXECUTE 'SELECT k.* FROM idempotency.idempotency_keys AS k '
                'WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2 '
                'AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()' OPERATOR(pg_catalog.||) v_filter
          INTO r USING lookup.scope, v_key;
    END IF;
    IF r.key IS NULL THEN
        RETURN NULL;
    END IF;
    -- The key as the caller gave it: where keys are stored hashed, the stored form is not
    -- returned (it would let the caller check a dictionary against a copy of the table).
    r.key := lookup.key;
    RETURN r;
END
$fn$;

REVOKE EXECUTE ON FUNCTION idempotency._stored_key(text, text), idempotency._check_recovery_point(text),
    idempotency._sign(text, integer, bytea), idempotency._signed_kid(text), idempotency._verify(text, bytea)
    FROM PUBLIC;

-- Monitoring gets a schema of its own (the recipe of 0.4.0 granted USAGE on schema idempotency,
-- i.e. the whole API). Application grants (USAGE on schema idempotency) are unchanged.
CREATE SCHEMA idempotency_monitor;
COMMENT ON SCHEMA idempotency_monitor IS
    'The counters of idempotency.stats for monitoring roles: GRANT USAGE ON SCHEMA idempotency_monitor TO <role>';
CREATE VIEW idempotency_monitor.stats AS
SELECT pg_catalog.current_database() AS database,
       t.rows_in_progress,
       t.rows_completed,
       t.rows_expired,
       t.oldest_expiry,
       s.last_sweep_at,
       s.last_sweep_rows,
       s.claims_new,
       s.claims_replay,
       s.claims_in_progress,
       s.claims_mismatch,
       s.completions,
       s.releases,
       s.rows_swept,
       s.preloaded AS sweeper_enabled
  FROM (SELECT pg_catalog.count(*) FILTER (
                   WHERE k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
                     AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()) AS rows_in_progress,
               pg_catalog.count(*) FILTER (
                   WHERE k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status
                     AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()) AS rows_completed,
               pg_catalog.count(*) FILTER (
                   WHERE k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()) AS rows_expired,
               pg_catalog.min(k.expires_at) AS oldest_expiry
          FROM idempotency.idempotency_keys AS k) AS t,
       -- Without Citus, this server's counters straight from the C function, which checks the
       -- querying role itself: the PL/pgSQL _cluster_stats would name idempotency._shared_stats
       -- as that role, and a role granted only the monitoring schema may name nothing in schema
       -- idempotency. Where Citus is installed, every node's (_cluster_stats). The conditions
       -- are evaluated once, before either function runs.
       (SELECT * FROM idempotency._shared_stats()
         WHERE pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NULL
        UNION ALL
        SELECT * FROM idempotency._cluster_stats()
         WHERE pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL) AS s;
GRANT SELECT ON idempotency_monitor.stats TO PUBLIC;

-- Roles set up by the earlier monitoring recipe keep the API: say which, and how to move them.
DO $monitors$
DECLARE
    v_roles text;
BEGIN
    SELECT pg_catalog.string_agg(pg_catalog.quote_ident(r.rolname), ', ' ORDER BY r.rolname) INTO v_roles
      FROM pg_catalog.pg_roles AS r
     WHERE NOT r.rolsuper
       AND r.rolname OPERATOR(pg_catalog.!~) '^pg_'
       AND r.oid OPERATOR(pg_catalog.<>) (SELECT n.nspowner FROM pg_catalog.pg_namespace AS n
                                           WHERE n.nspname OPERATOR(pg_catalog.=) 'idempotency')
       AND pg_catalog.has_schema_privilege(r.oid, 'idempotency', 'USAGE')
       AND pg_catalog.has_table_privilege(r.oid, 'idempotency.stats', 'SELECT');
    IF v_roles IS NOT NULL THEN
        RAISE WARNING 'idempotency: roles % may read idempotency.stats and hold USAGE on schema idempotency, which is the whole API', v_roles
            USING HINT = 'a monitoring role needs only the counters: REVOKE USAGE ON SCHEMA idempotency FROM <role>; GRANT USAGE ON SCHEMA idempotency_monitor TO <role>; (docs/security.md)';
    END IF;
END
$monitors$;

-- Binding settings (0.5.0) ----------------------------------------------------------------------

-- What binds a role, kept by the extension's owner: one row per login role, applied to the
-- session user (the role PostgreSQL applies ALTER ROLE ... SET to at login). A role can change
-- its own ALTER ROLE ... SET values, and a startup option can shadow them; it cannot write this
-- table. The scope prefix of a row replaces idempotency.scope_prefix, its audit = true adds to
-- idempotency.audit, its size limits (kB) lower idempotency.max_response_size and
-- idempotency.max_recovery_point_size (NULL: nothing bound). Dumped by pg_dump with its rows.
CREATE TABLE idempotency.role_settings (
    role                    pg_catalog.regrole PRIMARY KEY,
    scope_prefix            text COLLATE "C"
        CONSTRAINT role_settings_scope_prefix_check
        CHECK (scope_prefix OPERATOR(pg_catalog.<>) ''
               AND pg_catalog.char_length(scope_prefix) OPERATOR(pg_catalog.<=) 255),
    audit                   boolean NOT NULL DEFAULT false,
    max_response_size       integer
        CONSTRAINT role_settings_max_response_size_check
        CHECK (max_response_size OPERATOR(pg_catalog.>=) 1
               AND max_response_size OPERATOR(pg_catalog.<=) 1048576),
    max_recovery_point_size integer
        CONSTRAINT role_settings_max_recovery_point_size_check
        CHECK (max_recovery_point_size OPERATOR(pg_catalog.>=) 1
               AND max_recovery_point_size OPERATOR(pg_catalog.<=) 1048576)
);
COMMENT ON TABLE idempotency.role_settings IS
    'Settings that bind a login role (the session user): its scope prefix, audit on, size limits in kB. Kept by the extension''s owner; the role can neither read nor change them.';
SELECT pg_catalog.pg_extension_config_dump('idempotency.role_settings', '');

-- Every session caches its own row: a change tells every session to read it again once the
-- changing transaction commits (a relation cache invalidation of the table).
CREATE FUNCTION idempotency._role_settings_changed()
RETURNS trigger
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'idempotency_role_settings_changed';
CREATE TRIGGER role_settings_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.role_settings
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency._role_settings_changed();
-- Also where triggers are off for replication (session_replication_role = replica): a row
-- applied by a subscription binds as one written by hand.
ALTER TABLE idempotency.role_settings ENABLE ALWAYS TRIGGER role_settings_changed;
REVOKE EXECUTE ON FUNCTION idempotency._role_settings_changed() FROM PUBLIC;

-- Settings that bound a role before 0.5.0 were its ALTER ROLE ... SET values (for every database
-- and for this one); the role could undo them. Copied here they bind: the scope prefix and the
-- size limits in force for the role in this database (this database's value over the one for
-- every database), and audit = on from either. Those values stay in pg_db_role_setting as
-- defaults. A value the setting would refuse is left out with a WARNING.
DO $migrate$
DECLARE
    r record;
    v_value text;
    v_kb numeric;
    v_match text[];
BEGIN
    FOR r IN
        SELECT s.setrole AS role, s.setdatabase,
               pg_catalog.lower(pg_catalog.btrim(pg_catalog.split_part(c.entry, '=', 1))) AS name,
               pg_catalog.substr(c.entry, pg_catalog.strpos(c.entry, '=') OPERATOR(pg_catalog.+) 1) AS value
          FROM pg_catalog.pg_db_role_setting AS s, pg_catalog.unnest(s.setconfig) AS c(entry)
         WHERE s.setrole OPERATOR(pg_catalog.<>) 0
           AND (s.setdatabase OPERATOR(pg_catalog.=) 0
                OR s.setdatabase OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database AS d
                                                         WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()))
           AND pg_catalog.strpos(c.entry, '=') OPERATOR(pg_catalog.>) 0
           AND pg_catalog.lower(pg_catalog.btrim(pg_catalog.split_part(c.entry, '=', 1))) OPERATOR(pg_catalog.=) ANY (ARRAY[
                   'idempotency.scope_prefix', 'idempotency.audit',
                   'idempotency.max_response_size', 'idempotency.max_recovery_point_size'])
         -- every database's values first: this database's, applied after them, win
         ORDER BY s.setdatabase OPERATOR(pg_catalog.<>) 0, s.setrole
    LOOP
        BEGIN
            IF r.name OPERATOR(pg_catalog.=) 'idempotency.scope_prefix' THEN
                -- Text written from a database of another encoding may not be valid here.
                PERFORM pg_catalog.convert_to(r.value, pg_catalog.getdatabaseencoding());
                v_value := NULLIF(r.value, '');
                IF v_value IS NULL THEN
                    -- no prefix in force here: nothing to bind
                    UPDATE idempotency.role_settings AS t SET scope_prefix = NULL
                     WHERE t.role OPERATOR(pg_catalog.=) r.role::pg_catalog.regrole;
                ELSE
                    INSERT INTO idempotency.role_settings AS t (role, scope_prefix)
                         VALUES (r.role::pg_catalog.regrole, v_value)
                    ON CONFLICT (role) DO UPDATE SET scope_prefix = excluded.scope_prefix;
                END IF;
            ELSIF r.name OPERATOR(pg_catalog.=) 'idempotency.audit' THEN
                -- the spellings PostgreSQL reads as on
                IF pg_catalog.lower(pg_catalog.btrim(r.value)) OPERATOR(pg_catalog.=) ANY (ARRAY[
                       'on', 'true', 'tru', 'tr', 't', 'yes', 'ye', 'y', '1']) THEN
                    INSERT INTO idempotency.role_settings AS t (role, audit)
                         VALUES (r.role::pg_catalog.regrole, true)
                    ON CONFLICT (role) DO UPDATE SET audit = true;
                END IF;
            ELSE
                -- An amount of memory: a number, in kB unless a unit follows (as the setting reads it).
                v_match := pg_catalog.regexp_match(r.value, '^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(B|kB|MB|GB|TB)?\s*$');
                IF v_match IS NULL THEN
                    RAISE EXCEPTION USING ERRCODE = '22023',
                        MESSAGE = pg_catalog.format('%s is not an amount of memory', pg_catalog.quote_literal(pg_catalog.left(r.value, 40)));
                END IF;
                v_kb := pg_catalog.round(v_match[1]::pg_catalog.numeric OPERATOR(pg_catalog.*)
                            CASE v_match[2] WHEN 'B' THEN 1::pg_catalog.numeric OPERATOR(pg_catalog./) 1024
                                            WHEN 'MB' THEN 1024 WHEN 'GB' THEN 1048576
                                            WHEN 'TB' THEN 1073741824 ELSE 1 END);
                IF v_kb OPERATOR(pg_catalog.<) 1 OR v_kb OPERATOR(pg_catalog.>) 1048576 THEN
                    RAISE EXCEPTION USING ERRCODE = '22023',
                        MESSAGE = pg_catalog.format('%s is outside 1kB .. 1GB', pg_catalog.quote_literal(pg_catalog.left(r.value, 40)));
                END IF;
                IF r.name OPERATOR(pg_catalog.=) 'idempotency.max_response_size' THEN
                    INSERT INTO idempotency.role_settings AS t (role, max_response_size)
                         VALUES (r.role::pg_catalog.regrole, v_kb::pg_catalog.int4)
                    ON CONFLICT (role) DO UPDATE SET max_response_size = excluded.max_response_size;
                ELSE
                    INSERT INTO idempotency.role_settings AS t (role, max_recovery_point_size)
                         VALUES (r.role::pg_catalog.regrole, v_kb::pg_catalog.int4)
                    ON CONFLICT (role) DO UPDATE SET max_recovery_point_size = excluded.max_recovery_point_size;
                END IF;
            END IF;
        EXCEPTION WHEN data_exception OR integrity_constraint_violation THEN
            RAISE WARNING USING
                MESSAGE = pg_catalog.format('idempotency: %s of role %s is not copied to idempotency.role_settings: %s',
                                            r.name, r.role::pg_catalog.regrole, SQLERRM),
                HINT = 'set the role''s binding value by hand: INSERT INTO idempotency.role_settings ...';
        END;
    END LOOP;
    DELETE FROM idempotency.role_settings AS t
     WHERE t.scope_prefix IS NULL AND NOT t.audit
       AND t.max_response_size IS NULL AND t.max_recovery_point_size IS NULL;
END
$migrate$;

-- Sweeping without the background sweeper: a pg_cron job (the portable edition, a server that
-- does not preload the library). Creates or replaces the caller's pg_cron job named
-- 'idempotency-sweep' in this database (pg_cron's own, cron.database_name) and returns its id.
-- Not SECURITY DEFINER: the job runs as the role that schedules it, which needs pg_cron's
-- own grants (USAGE on schema cron) and EXECUTE on idempotency.sweep.
CREATE FUNCTION idempotency.schedule_sweep(every interval DEFAULT '1 minute')
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_seconds bigint;
    v_schedule text;
    v_version text;
    v_database text := pg_catalog.current_setting('cron.database_name', true);
    v_job bigint;
BEGIN
    IF every IS NULL OR every OPERATOR(pg_catalog.<=) '0'::interval OR NOT pg_catalog.isfinite(every) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('invalid every %s for idempotency.schedule_sweep: it must be a positive, finite interval',
                                        COALESCE(every::text, 'NULL')),
            HINT = 'pass how often to sweep, e.g. ''1 minute'' or ''30 seconds''';
    END IF;
    -- pg_cron takes whole seconds below a minute (1.5 and later) and cron expressions above;
    -- only periods a cron expression repeats evenly are taken, so the period is the one asked.
    IF pg_catalog.date_part('epoch', every) OPERATOR(pg_catalog.<>) pg_catalog.trunc(pg_catalog.date_part('epoch', every)) THEN
        v_seconds := 0;  -- a fraction of a second: refused below
    ELSE
        v_seconds := pg_catalog.date_part('epoch', every);
    END IF;
    IF v_seconds OPERATOR(pg_catalog.=) 0 THEN
        v_schedule := NULL;
    ELSIF v_seconds OPERATOR(pg_catalog.<) 60 THEN
        v_schedule := pg_catalog.format('%s seconds', v_seconds);
    ELSIF v_seconds OPERATOR(pg_catalog.<) 3600 AND v_seconds OPERATOR(pg_catalog.%) 60 OPERATOR(pg_catalog.=) 0
          AND 3600 OPERATOR(pg_catalog.%) v_seconds OPERATOR(pg_catalog.=) 0 THEN
        v_schedule := CASE WHEN v_seconds OPERATOR(pg_catalog.=) 60 THEN '* * * * *'
                           ELSE pg_catalog.format('*/%s * * * *', v_seconds OPERATOR(pg_catalog./) 60) END;
    ELSIF v_seconds OPERATOR(pg_catalog.<) 86400 AND v_seconds OPERATOR(pg_catalog.%) 3600 OPERATOR(pg_catalog.=) 0
          AND 86400 OPERATOR(pg_catalog.%) v_seconds OPERATOR(pg_catalog.=) 0 THEN
        v_schedule := CASE WHEN v_seconds OPERATOR(pg_catalog.=) 3600 THEN '0 * * * *'
                           ELSE pg_catalog.format('0 */%s * * *', v_seconds OPERATOR(pg_catalog./) 3600) END;
    ELSIF v_seconds OPERATOR(pg_catalog.=) 86400 THEN
        v_schedule := '0 0 * * *';
    END IF;
    IF v_schedule IS NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('invalid every %s for idempotency.schedule_sweep: pg_cron cannot repeat it evenly', every),
            HINT = 'pass 1 to 59 seconds, a number of minutes that divides an hour, a number of hours that divides a day, or 1 day';
    END IF;

    SELECT e.extversion INTO v_version FROM pg_catalog.pg_extension AS e
     WHERE e.extname OPERATOR(pg_catalog.=) 'pg_cron';
    IF v_version IS NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'feature_not_supported',
            MESSAGE = pg_catalog.format('idempotency.schedule_sweep needs pg_cron, which is not installed in database %s',
                                        pg_catalog.current_database()),
            HINT = CASE WHEN v_database IS NOT NULL AND v_database OPERATOR(pg_catalog.<>) pg_catalog.current_database()
                        THEN pg_catalog.format('pg_cron runs jobs from database %s (cron.database_name); there, run '
                                               'SELECT cron.schedule_in_database(%L, %L, %L, %L)', v_database,
                                               'idempotency-sweep-' OPERATOR(pg_catalog.||) pg_catalog.current_database(),
                                               v_schedule, 'SELECT idempotency.sweep()', pg_catalog.current_database())
                        ELSE 'preload pg_cron and CREATE EXTENSION pg_cron, or run SELECT idempotency.sweep() from a scheduler of your own; '
                             'with the native edition preloaded, its background sweeper sweeps' END;
    END IF;

    IF v_schedule OPERATOR(pg_catalog.~) 'seconds$'
       AND pg_catalog.string_to_array(pg_catalog.split_part(v_version, '-', 1), '.')::integer[]
           OPERATOR(pg_catalog.<) ARRAY[1, 5] THEN
        RAISE EXCEPTION USING
            ERRCODE = 'feature_not_supported',
            MESSAGE = pg_catalog.format('invalid every %s for idempotency.schedule_sweep: pg_cron %s schedules by the minute',
                                        every, v_version),
            HINT = 'pass a whole number of minutes, or update pg_cron to 1.5 or later for seconds';
    END IF;

    -- cron.schedule replaces the caller's job of the same name.
    EXECUTE 'SELECT cron.schedule($1, $2, $3)' INTO v_job
      USING 'idempotency-sweep', v_schedule, 'SELECT idempotency.sweep()';
    RETURN v_job;
END
$fn$;

-- Citus: token classes and audit id ranges per node -------------------------------------------

-- Each node hands out the tokens of its own class (t % 65536 = its group id) and audit ids from
-- group id << 48; a takeover takes a token of its node's class above the key's previous one.
-- A store distributed by 0.4.0: call SELECT idempotency.distribute() again after this update
-- (claims on a node without its class are refused until then).
-- On one Citus node (distribute() runs it on every node): gives this node's token sequence its
-- class (it counts by 65536 from a value t with t % 65536 = the node's group id, above floor
-- and above its own last value) and its audit id sequence its range (from group id << 48; the
-- coordinator's, group 0, from 1), unless they have them; and keeps complete from being inlined
-- there, so that Citus delegates it (below). Returns what it changed ('' for nothing).
CREATE FUNCTION idempotency._node_sequences(floor bigint)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_stride constant bigint := 65536;
    -- room for one more class above it
    v_max_floor constant bigint := 9223372036854775807 OPERATOR(pg_catalog.-) 131072;
    v_group bigint;
    v_increment bigint;
    v_last bigint;
    v_base bigint;
    v_next bigint;
    v_changes text[] := '{}';
    v_ddl text;
BEGIN
    IF floor IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'floor must not be NULL';
    ELSIF floor OPERATOR(pg_catalog.<) 0
          OR floor OPERATOR(pg_catalog.>) v_max_floor THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('floor must be between 0 and %s (got %s)', v_max_floor, floor);
    END IF;
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_local_group') IS NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'feature_not_supported',
            MESSAGE = 'idempotency._node_sequences needs Citus: the citus extension is not installed in this database',
            HINT = 'idempotency.distribute() runs it on every node of a Citus cluster';
    END IF;
    SELECT g.groupid INTO v_group FROM pg_catalog.pg_dist_local_group AS g;
    IF v_group OPERATOR(pg_catalog.>=) v_stride THEN
        RAISE EXCEPTION USING
            ERRCODE = 'program_limit_exceeded',
            MESSAGE = pg_catalog.format('idempotency: Citus group id %s is too large for a token class (at most %s)',
                                        v_group, v_stride OPERATOR(pg_catalog.-) 1);
    END IF;
    SELECT s.seqincrement INTO v_increment FROM pg_catalog.pg_sequence AS s
     WHERE s.seqrelid OPERATOR(pg_catalog.=) 'idempotency.token_seq'::pg_catalog.regclass;
    SELECT t.last_value INTO v_last FROM idempotency.token_seq AS t;
    IF v_increment OPERATOR(pg_catalog.<>) v_stride
       OR (v_last OPERATOR(pg_catalog.%) v_stride) OPERATOR(pg_catalog.<>) v_group THEN
        IF v_increment OPERATOR(pg_catalog.<>) v_stride THEN
            ALTER SEQUENCE idempotency.token_seq INCREMENT BY 65536;
        END IF;
        v_base := GREATEST(floor, v_last);
        v_next := (v_base OPERATOR(pg_catalog.-) (v_base OPERATOR(pg_catalog.%) v_stride)) OPERATOR(pg_catalog.+) v_group;
        IF v_next OPERATOR(pg_catalog.<=) v_base THEN
            v_next := v_next OPERATOR(pg_catalog.+) v_stride;
        END IF;
        PERFORM pg_catalog.setval('idempotency.token_seq', v_next, false);
        v_changes := v_changes OPERATOR(pg_catalog.||) pg_catalog.format(
            'tokens from %s by 65536 (group %s)', v_next, v_group);
    END IF;
    SELECT a.last_value INTO v_last FROM idempotency.audit_id_seq AS a;
    IF v_group OPERATOR(pg_catalog.>) 0
       AND (v_last OPERATOR(pg_catalog.>>) 48) OPERATOR(pg_catalog.<>) v_group THEN
        v_next := (v_group OPERATOR(pg_catalog.<<) 48) OPERATOR(pg_catalog.+) 1;
        PERFORM pg_catalog.setval('idempotency.audit_id_seq', GREATEST(v_next, v_last), false);
        v_changes := v_changes OPERATOR(pg_catalog.||) pg_catalog.format('audit ids from %s', GREATEST(v_next, v_last));
    END IF;
    -- complete is a one-expression SQL function, which the planner inlines into the statement
    -- that calls it; Citus looks for a call of a distributed function only after PostgreSQL's
    -- planner ran, and would find _complete and _raise_not_claimed instead: the call would run
    -- on the calling node and reach the shard statement by statement (BEGIN, UPDATE, COMMIT).
    -- A SET clause keeps a function from being inlined: complete stays a call of itself, which
    -- Citus delegates whole, and which the node it is delegated to recognizes as delegated
    -- (its UPDATE of the key's shard is allowed there). Each node's own catalog (not
    -- propagated: Citus would refuse the ALTER on a worker, and a node added later gets the
    -- extension as CREATE EXTENSION makes it). A single node keeps complete inlined.
    IF EXISTS (SELECT FROM pg_catalog.pg_proc AS p
                WHERE p.oid OPERATOR(pg_catalog.=) 'idempotency.complete(text, jsonb, integer, text, bigint, interval)'::pg_catalog.regprocedure
                  AND p.proconfig IS NULL) THEN
        v_ddl := pg_catalog.current_setting('citus.enable_ddl_propagation');
        PERFORM pg_catalog.set_config('citus.enable_ddl_propagation', 'off', true);
        ALTER FUNCTION idempotency.complete(text, jsonb, integer, text, bigint, interval)
            SET search_path = pg_catalog, pg_temp;
        PERFORM pg_catalog.set_config('citus.enable_ddl_propagation', v_ddl, true);
        v_changes := v_changes OPERATOR(pg_catalog.||) 'complete delegable as one call'::text;
    END IF;
    RETURN pg_catalog.array_to_string(v_changes, ', ');
END
$fn$;

-- On one Citus node (distribute(tenant_type => ...) runs it on the coordinator, in its
-- transaction, and on every worker): gives the keys and the audit table a column tenant of
-- that type, NOT NULL, the scope's value (CHECK scope = tenant::text: the scope is the tenant
-- id as the type writes it), a third column of their primary keys (Citus needs the
-- distribution column in every unique index). A worker's tables are Citus's shells, which
-- Citus does not alter; claim and complete plan their statements on them. Skipped where done;
-- returns what it changed ('' for nothing). A row whose scope is not a tenant id: 22P02.
CREATE FUNCTION idempotency._tenant_columns(tenant_type regtype)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_rel pg_catalog.regclass;
    v_bad text;
    v_ddl text := pg_catalog.current_setting('citus.enable_ddl_propagation', true);
    v_changes text[] := '{}';
BEGIN
    IF tenant_type IS NULL OR tenant_type OPERATOR(pg_catalog.<>) ALL (ARRAY['bigint', 'uuid']::pg_catalog.regtype[]) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('tenant_type must be bigint or uuid, not %s', COALESCE(tenant_type::pg_catalog.text, 'NULL'));
    END IF;
    IF v_ddl IS NOT NULL THEN
        PERFORM pg_catalog.set_config('citus.enable_ddl_propagation', 'off', true);
    END IF;
    FOREACH v_rel IN ARRAY ARRAY['idempotency.idempotency_keys', 'idempotency.audit']::pg_catalog.regclass[] LOOP
        IF EXISTS (SELECT FROM pg_catalog.pg_attribute AS a
                    WHERE a.attrelid OPERATOR(pg_catalog.=) v_rel AND a.attname OPERATOR(pg_catalog.=) 'tenant'
                      AND NOT a.attisdropped) THEN
            CONTINUE;
        END IF;
        EXECUTE pg_catalog.format('ALTER TABLE %s ADD COLUMN tenant %s', v_rel, tenant_type);
        BEGIN
            EXECUTE pg_catalog.format('UPDATE %s SET tenant = scope::%s', v_rel, tenant_type);
        EXCEPTION WHEN invalid_text_representation OR numeric_value_out_of_range THEN
            v_bad := SQLERRM;
        END;
        IF v_bad IS NULL THEN
            EXECUTE pg_catalog.format(
                'SELECT t.scope FROM %s AS t WHERE t.scope OPERATOR(pg_catalog.<>) t.tenant::pg_catalog.text LIMIT 1', v_rel)
                INTO v_bad;
        END IF;
        IF v_bad IS NOT NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'invalid_text_representation',
                MESSAGE = pg_catalog.format('idempotency.distribute: %s holds a scope that is not a %s tenant id as the type writes it: %s',
                                            v_rel, tenant_type, v_bad),
                HINT = 'a store distributed by its tenant keeps keys whose scope is the tenant id (''42''): forget the other keys first, or distribute by scope';
        END IF;
        EXECUTE pg_catalog.format(
            'ALTER TABLE %s ALTER COLUMN tenant SET NOT NULL, ADD CONSTRAINT %I CHECK (scope OPERATOR(pg_catalog.=) tenant::pg_catalog.text)',
            v_rel, (SELECT c.relname FROM pg_catalog.pg_class AS c WHERE c.oid OPERATOR(pg_catalog.=) v_rel) OPERATOR(pg_catalog.||) '_tenant_check');
        IF v_rel OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass THEN
            ALTER TABLE idempotency.idempotency_keys DROP CONSTRAINT idempotency_keys_pkey,
                ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (scope, key, tenant);
        ELSE
            ALTER TABLE idempotency.audit DROP CONSTRAINT audit_pkey,
                ADD CONSTRAINT audit_pkey PRIMARY KEY (scope, id, tenant);
        END IF;
        v_changes := v_changes OPERATOR(pg_catalog.||) pg_catalog.format('%s.tenant %s', v_rel, tenant_type);
    END LOOP;
    IF v_ddl IS NOT NULL THEN
        PERFORM pg_catalog.set_config('citus.enable_ddl_propagation', v_ddl, true);
    END IF;
    RETURN pg_catalog.array_to_string(v_changes, ', ');
END
$fn$;

-- - token_seq and audit_id_seq on every node (_node_sequences): node g hands out the tokens
--   t with t % 65536 = g, above every token handed out before, and audit ids from g << 48, so
--   no two nodes hand out the same token or audit id; a takeover takes a token of its node's
--   class above the key's previous one, whatever node gave that. A claim on a node without
--   them (added since) is refused until this function is called again.
CREATE OR REPLACE FUNCTION idempotency.distribute(shard_count integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    -- A new store distributed by scope; a distributed one kept as it is.
    PERFORM idempotency.distribute(NULL::pg_catalog.regtype, distribute.shard_count, NULL::pg_catalog.regclass);
END
$fn$;

-- distribute() with the tenant's type: tenant_type 'bigint' or 'uuid' distributes the store by a
-- column tenant of that type, added to the keys and the audit table, NOT NULL, the scope's
-- value (CHECK scope = tenant::text: the scope is the tenant id as the type writes it), a
-- third column of the primary keys (Citus needs the distribution column in every unique
-- index); colocate_with, the application's table distributed by its tenant id of that type
-- (NULL: a colocation group of the store's own). 'text' (or NULL for a new store): by scope,
-- as distribute(shard_count). NULL on a distributed store: as it is.
CREATE FUNCTION idempotency.distribute(
    tenant_type   regtype,
    shard_count   integer DEFAULT NULL,
    colocate_with regclass DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_changed boolean := false;
    v_rel regclass;
    v_fn regprocedure;
    v_node record;
    v_floor bigint := 0;
    v_type pg_catalog.regtype := tenant_type;
    v_current pg_catalog.regtype;
    v_column text;
BEGIN
    IF v_type IS NOT NULL AND v_type OPERATOR(pg_catalog.<>) ALL (ARRAY['text', 'bigint', 'uuid']::pg_catalog.regtype[]) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('tenant_type must be text, bigint or uuid, not %s', v_type),
            HINT = 'distribute by the type of the tenant id the application''s tables are distributed by; text: by scope';
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_extension AS e WHERE e.extname OPERATOR(pg_catalog.=) 'citus') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'feature_not_supported',
            MESSAGE = 'idempotency.distribute needs Citus: the citus extension is not installed in this database',
            HINT = 'on a Citus coordinator run CREATE EXTENSION citus first; a single PostgreSQL node needs no distribution';
    END IF;
    IF (SELECT g.groupid FROM pg_catalog.pg_dist_local_group AS g) OPERATOR(pg_catalog.<>) 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = 'idempotency.distribute must run on the Citus coordinator; this node is a worker',
            HINT = 'connect to the coordinator and call idempotency.distribute() there';
    END IF;

    IF (SELECT c.relkind FROM pg_catalog.pg_class AS c
         WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) OPERATOR(pg_catalog.=) 'p' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'feature_not_supported',
            MESSAGE = 'idempotency.distribute cannot distribute a partitioned store (idempotency.partitions)',
            HINT = 'on Citus create the extension with idempotency.partitions = 0: the shards split the store instead';
    END IF;
    SELECT pg_catalog.column_to_column_name(p.logicalrelid, p.partkey) INTO v_column
      FROM pg_catalog.pg_dist_partition AS p
     WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
       AND p.partmethod OPERATOR(pg_catalog.=) 'h';
    SELECT a.atttypid::pg_catalog.regtype INTO v_current FROM pg_catalog.pg_attribute AS a
     WHERE a.attrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
       AND a.attname OPERATOR(pg_catalog.=) v_column AND NOT a.attisdropped;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                    WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
        v_type := COALESCE(v_type, 'text'::pg_catalog.regtype);
        IF distribute.colocate_with IS NOT NULL AND distribute.shard_count IS NOT NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'invalid_parameter_value',
                MESSAGE = 'idempotency.distribute takes shard_count or colocate_with, not both',
                HINT = 'the store colocated with a table has that table''s shards';
        END IF;
        IF v_type OPERATOR(pg_catalog.<>) 'text'::pg_catalog.regtype THEN
            -- The statements that name the tenant are the library's (claim, complete).
            IF (SELECT l.lanname FROM pg_catalog.pg_proc AS f
                  JOIN pg_catalog.pg_language AS l ON l.oid OPERATOR(pg_catalog.=) f.prolang
                 WHERE f.oid OPERATOR(pg_catalog.=) 'idempotency.claim(text, jsonb, text, interval, interval)'::pg_catalog.regprocedure)
               OPERATOR(pg_catalog.<>) 'c' THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'feature_not_supported',
                    MESSAGE = 'idempotency.distribute: a store distributed by its tenant needs the native edition (the library)',
                    HINT = 'distribute the portable edition''s store by scope: idempotency.distribute()';
            END IF;
            PERFORM idempotency._tenant_columns(v_type);
            FOR v_node IN
                SELECT r.nodename, r.nodeport, r.success, r.result
                  FROM pg_catalog.run_command_on_workers(
                           pg_catalog.format('SELECT idempotency._tenant_columns(%L)', v_type)) AS r
            LOOP
                IF NOT v_node.success THEN
                    RAISE EXCEPTION USING
                        ERRCODE = 'connection_exception',
                        MESSAGE = pg_catalog.format('idempotency.distribute could not add the tenant column on Citus node %s:%s: %s',
                                                    v_node.nodename, v_node.nodeport, v_node.result),
                        HINT = 'call idempotency.distribute() again once every node is reachable';
                END IF;
            END LOOP;
            v_column := 'tenant';
        ELSE
            v_column := 'scope';
        END IF;
        PERFORM pg_catalog.create_distributed_table('idempotency.idempotency_keys', v_column,
                                                    colocate_with => COALESCE(distribute.colocate_with::pg_catalog.text, 'none'),
                                                    shard_count => distribute.shard_count);
        v_changed := true;
    ELSIF v_column IS NULL OR v_column OPERATOR(pg_catalog.<>) ALL (ARRAY['scope', 'tenant']) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = 'idempotency.idempotency_keys is a Citus table, but not hash-distributed by scope or tenant',
            HINT = 'Citus cannot convert the tables of an extension (undistribute_table refuses them): copy the store out, re-create the extension and copy it back (docs/scaling.md, "Undistributing the store"), then call idempotency.distribute()';
    ELSIF v_type IS NOT NULL AND v_type OPERATOR(pg_catalog.<>) v_current THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = pg_catalog.format('idempotency.distribute: the store is distributed by a tenant of type %s already, not %s',
                                        v_current, v_type),
            HINT = 'a distributed store keeps its distribution: copy the store out, re-create the extension and copy it back (docs/scaling.md, "Undistributing the store"), then distribute it again';
    ELSIF distribute.colocate_with IS NOT NULL
          AND (SELECT p.colocationid FROM pg_catalog.pg_dist_partition AS p
                WHERE p.logicalrelid OPERATOR(pg_catalog.=) distribute.colocate_with) IS DISTINCT FROM
              (SELECT p.colocationid FROM pg_catalog.pg_dist_partition AS p
                WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = pg_catalog.format('idempotency.distribute: the store is distributed already, and not colocated with %s',
                                        distribute.colocate_with),
            HINT = pg_catalog.format('colocate the table with the store: SELECT alter_distributed_table(%L, colocate_with => ''idempotency.idempotency_keys'')',
                                     distribute.colocate_with::pg_catalog.text);
    ELSE
        v_type := v_current;
    END IF;

    IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                    WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.audit'::pg_catalog.regclass) THEN
        IF v_column OPERATOR(pg_catalog.=) 'scope'
           AND NOT EXISTS (SELECT FROM pg_catalog.pg_constraint AS c
                            WHERE c.conrelid OPERATOR(pg_catalog.=) 'idempotency.audit'::pg_catalog.regclass
                              AND c.conname OPERATOR(pg_catalog.=) 'audit_pkey'
                              AND c.conkey OPERATOR(pg_catalog.=) ARRAY[2, 1]::pg_catalog.int2[]) THEN
            ALTER TABLE idempotency.audit DROP CONSTRAINT audit_pkey,
                ADD CONSTRAINT audit_pkey PRIMARY KEY (scope, id);
        END IF;
        PERFORM pg_catalog.create_distributed_table('idempotency.audit', v_column,
                                                    colocate_with => 'idempotency.idempotency_keys');
        v_changed := true;
    END IF;

    FOREACH v_rel IN ARRAY ARRAY['idempotency.config', 'idempotency.signing_secrets']::pg_catalog.regclass[] LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                        WHERE p.logicalrelid OPERATOR(pg_catalog.=) v_rel) THEN
            PERFORM pg_catalog.create_reference_table(v_rel);
            v_changed := true;
        END IF;
    END LOOP;

    -- A store distributed by scope: the functions by their scope argument; by its tenant: the
    -- overloads of claim and complete whose scope is of the tenant's type (a text argument
    -- cannot be the distribution argument of a function colocated with a bigint or uuid column).
    FOREACH v_fn IN ARRAY CASE WHEN v_type OPERATOR(pg_catalog.=) 'text'::pg_catalog.regtype THEN ARRAY[
        'idempotency.claim(text, jsonb, text, interval, interval)',
        'idempotency.complete(text, jsonb, integer, text, bigint, interval)',
        'idempotency.checkpoint(text, text, text, bigint)',
        'idempotency.release(text, text, bigint)',
        'idempotency.forget(text, text)',
        'idempotency.lookup(text, text)',
        -- A batch has one scope: delegated whole to the worker holding its shard.
        'idempotency.claim_many(text[], jsonb[], text, interval, interval)',
        'idempotency.complete_many(text[], jsonb[], integer[], text, bigint[], interval)']::pg_catalog.regprocedure[]
      ELSE ARRAY[
        pg_catalog.format('idempotency.claim(text, jsonb, %s, interval, interval)', v_type)::pg_catalog.regprocedure,
        pg_catalog.format('idempotency.complete(text, jsonb, integer, %s, bigint, interval)', v_type)::pg_catalog.regprocedure]
      END LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_object AS o
                        WHERE o.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
                          AND o.objid OPERATOR(pg_catalog.=) v_fn::pg_catalog.oid
                          AND o.distribution_argument_index IS NOT NULL) THEN
            PERFORM pg_catalog.create_distributed_function(v_fn, distribution_arg_name => 'scope',
                                                           colocate_with => 'idempotency.idempotency_keys');
            v_changed := true;
        END IF;
    END LOOP;

    -- Citus copies the rows of a table it distributes into the shards, and leaves them in the
    -- coordinator's own (shell) table too, where nothing reads or sweeps them: empty it. Every
    -- call looks, so a store distributed before with its rows left there is emptied as well.
    FOREACH v_rel IN ARRAY ARRAY['idempotency.idempotency_keys', 'idempotency.audit',
                                 'idempotency.config', 'idempotency.signing_secrets']::pg_catalog.regclass[] LOOP
        IF pg_catalog.pg_relation_size(v_rel) OPERATOR(pg_catalog.>) 0 THEN
            PERFORM pg_catalog.truncate_local_data_after_distributing_table(v_rel);
            RAISE NOTICE 'idempotency.distribute: emptied the coordinator''s local table of % (its rows are in the shards)', v_rel;
            v_changed := true;
        END IF;
    END LOOP;

    -- Token classes and audit id ranges, on every node (nodes added later get theirs at the
    -- next call; until then claims there are refused). A node given its class starts above
    -- every token any node handed out so far (its class may hold tokens handed out before
    -- the classes, on a single node or by an older release).
    FOR v_node IN
        SELECT r.nodeid, r.success, r.result FROM pg_catalog.run_command_on_all_nodes(
            $cmd$SELECT t.last_value FROM idempotency.token_seq AS t$cmd$) AS r
    LOOP
        IF NOT v_node.success THEN
            RAISE EXCEPTION USING
                ERRCODE = 'connection_exception',
                MESSAGE = pg_catalog.format('idempotency.distribute could not read the token sequence of Citus node %s: %s',
                                            v_node.nodeid, v_node.result),
                HINT = 'call idempotency.distribute() again once every node is reachable';
        END IF;
        v_floor := GREATEST(v_floor, v_node.result::bigint);
    END LOOP;
    v_floor := GREATEST(v_floor, (SELECT pg_catalog.max(k.token) FROM idempotency.idempotency_keys AS k));
    FOR v_node IN
        SELECT n.nodename, n.nodeport, r.success, r.result
          FROM pg_catalog.run_command_on_all_nodes(
                   pg_catalog.format('SELECT idempotency._node_sequences(%s)', v_floor)) AS r
          LEFT JOIN pg_catalog.pg_dist_node AS n ON n.nodeid OPERATOR(pg_catalog.=) r.nodeid
    LOOP
        IF NOT v_node.success THEN
            RAISE EXCEPTION USING
                ERRCODE = 'connection_exception',
                MESSAGE = pg_catalog.format('idempotency.distribute could not set the token and audit id ranges of Citus node %s:%s: %s',
                                            v_node.nodename, v_node.nodeport, v_node.result),
                HINT = 'call idempotency.distribute() again once every node is reachable';
        END IF;
        IF v_node.result OPERATOR(pg_catalog.<>) '' THEN
            RAISE NOTICE 'idempotency.distribute: node %:% now hands out %', v_node.nodename, v_node.nodeport, v_node.result;
            v_changed := true;
        END IF;
    END LOOP;

    IF NOT v_changed THEN
        RAISE NOTICE 'idempotency.distribute: the store is distributed already; nothing changed';
    END IF;
END
$fn$;

REVOKE EXECUTE ON FUNCTION idempotency._node_sequences(bigint),
    idempotency.distribute(regtype, integer, regclass), idempotency._tenant_columns(regtype) FROM PUBLIC;

-- Stores distributed by their tenant (distribute(tenant_type => 'bigint' or 'uuid'), Citus):
-- claim and complete with the tenant id as the scope, of the tenant's type. Each is the text
-- function called with the id's text form ('42'), which is the scope the key is kept under;
-- distribute() distributes the overloads of the store's type by their scope argument, colocated
-- with the store, so that Citus delegates a top-level call to the node holding the tenant's
-- shard (the text functions cannot be: their argument is not of the distribution column's
-- type). PL/pgSQL, not SQL: a SQL function would be inlined, and Citus would not see the call.
-- On any other store they are the text functions with the id's text form as the scope.
CREATE FUNCTION idempotency.claim(
    key     text,
    request jsonb,
    scope   bigint,
    ttl     interval DEFAULT NULL,
    lease   interval DEFAULT NULL
) RETURNS idempotency.claim_result
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN idempotency.claim(claim.key, claim.request, claim.scope::pg_catalog.text, claim.ttl, claim.lease);
END
$fn$;

CREATE FUNCTION idempotency.claim(
    key     text,
    request jsonb,
    scope   uuid,
    ttl     interval DEFAULT NULL,
    lease   interval DEFAULT NULL
) RETURNS idempotency.claim_result
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN idempotency.claim(claim.key, claim.request, claim.scope::pg_catalog.text, claim.ttl, claim.lease);
END
$fn$;

CREATE FUNCTION idempotency.complete(
    key             text,
    response        jsonb,
    response_status integer,
    scope           bigint,
    token           bigint DEFAULT NULL,
    ttl             interval DEFAULT NULL
) RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN idempotency.complete(complete.key, complete.response, complete.response_status,
                                complete.scope::pg_catalog.text, complete.token, complete.ttl);
END
$fn$;

CREATE FUNCTION idempotency.complete(
    key             text,
    response        jsonb,
    response_status integer,
    scope           uuid,
    token           bigint DEFAULT NULL,
    ttl             interval DEFAULT NULL
) RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN idempotency.complete(complete.key, complete.response, complete.response_status,
                                complete.scope::pg_catalog.text, complete.token, complete.ttl);
END
$fn$;

-- The store's fill factor from 90 to 25 (docs/architecture.md#fill-factor): the room a page keeps
-- for the completions of its claims, so that they stay HOT updates with many claims in flight.
-- A table (or partition) whose fill factor was changed from 90 keeps its own. New pages only:
-- the pages written so far fill up as before until the table is rewritten (VACUUM FULL).
DO $fillfactor$
DECLARE
    v_rel pg_catalog.regclass;
BEGIN
    FOR v_rel IN
        SELECT c.oid::pg_catalog.regclass FROM pg_catalog.pg_class AS c
         WHERE (c.oid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
                OR c.oid IN (SELECT i.inhrelid FROM pg_catalog.pg_inherits AS i
                              WHERE i.inhparent OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass))
           AND c.relkind OPERATOR(pg_catalog.=) 'r'
           AND c.reloptions OPERATOR(pg_catalog.@>) ARRAY['fillfactor=90']::pg_catalog.text[]
    LOOP
        EXECUTE pg_catalog.format('ALTER TABLE %s SET (fillfactor = 25)', v_rel);
    END LOOP;
END
$fillfactor$;

-- checkpoint, release and forget name the tenant on a store distributed by it (_tenant_filter).
CREATE OR REPLACE FUNCTION idempotency.checkpoint(
    key            text,
    recovery_point text,
    scope          text DEFAULT '',
    token          bigint DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_key text;
    v_filter text;
    v_rows bigint;
BEGIN
    v_key := idempotency._stored_key(checkpoint.key, checkpoint.scope);
    PERFORM idempotency._check_recovery_point(checkpoint.recovery_point);
    v_filter := idempotency._tenant_filter(checkpoint.scope);
    IF v_filter OPERATOR(pg_catalog.=) '' THEN
        UPDATE idempotency.idempotency_keys AS k
           SET recovery_point = checkpoint.recovery_point
         WHERE k.scope OPERATOR(pg_catalog.=) checkpoint.scope
           AND k.key OPERATOR(pg_catalog.=) v_key
           AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
           AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
           AND (checkpoint.token IS NULL OR k.token OPERATOR(pg_catalog.=) checkpoint.token);
        GET DIAGNOSTICS v_rows = ROW_COUNT;
    ELSE
        EXECUTE 'UPDATE idempotency.idempotency_keys AS k SET recovery_point = $1 '
                'WHERE k.scope OPERATOR(pg_catalog.=) $2 AND k.key OPERATOR(pg_catalog.=) $3 '
                'AND k.status OPERATOR(pg_catalog.=) ''in_progress''::idempotency.key_status '
                'AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() '
                'AND ($4 IS NULL OR k.token OPERATOR(pg_catalog.=) $4)' OPERATOR(pg_catalog.||) v_filter
          USING checkpoint.recovery_point, checkpoint.scope, v_key, checkpoint.token;
        GET DIAGNOSTICS v_rows = ROW_COUNT;
    END IF;
    IF v_rows OPERATOR(pg_catalog.=) 0 THEN
        PERFORM idempotency._raise_not_claimed(checkpoint.key, checkpoint.scope, checkpoint.token, 'checkpoint');
    END IF;
END
$fn$;

CREATE OR REPLACE FUNCTION idempotency.release(key text, scope text DEFAULT '', token bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_key text;
    v_filter text;
    v_rows bigint;
BEGIN
    v_key := idempotency._stored_key(release.key, release.scope);
    v_filter := idempotency._tenant_filter(release.scope);
    IF v_filter OPERATOR(pg_catalog.=) '' THEN
        DELETE FROM idempotency.idempotency_keys AS k
         WHERE k.scope OPERATOR(pg_catalog.=) release.scope
           AND k.key OPERATOR(pg_catalog.=) v_key
           AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
           AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
           AND (release.token IS NULL OR k.token OPERATOR(pg_catalog.=) release.token);
        GET DIAGNOSTICS v_rows = ROW_COUNT;
    ELSE
        EXECUTE 'DELETE FROM idempotency.idempotency_keys AS k '
                'WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2 '
                'AND k.status OPERATOR(pg_catalog.=) ''in_progress''::idempotency.key_status '
                'AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() '
                'AND ($3 IS NULL OR k.token OPERATOR(pg_catalog.=) $3)' OPERATOR(pg_catalog.||) v_filter
          USING release.scope, v_key, release.token;
        GET DIAGNOSTICS v_rows = ROW_COUNT;
    END IF;
    IF v_rows OPERATOR(pg_catalog.>) 0 THEN
        PERFORM idempotency._count('release');
        RETURN true;
    END IF;
    RETURN false;
END
$fn$;

CREATE OR REPLACE FUNCTION idempotency.forget(key text, scope text DEFAULT '')
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_key text;
    v_filter text;
    v_expires_at timestamptz;
BEGIN
    v_key := idempotency._stored_key(forget.key, forget.scope);
    v_filter := idempotency._tenant_filter(forget.scope);
    IF v_filter OPERATOR(pg_catalog.=) '' THEN
        DELETE FROM idempotency.idempotency_keys AS k
         WHERE k.scope OPERATOR(pg_catalog.=) forget.scope
           AND k.key OPERATOR(pg_catalog.=) v_key
        RETURNING k.expires_at INTO v_expires_at;
    ELSE
        EXECUTE 'DELETE FROM idempotency.idempotency_keys AS k '
                'WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2'
                OPERATOR(pg_catalog.||) v_filter OPERATOR(pg_catalog.||) ' RETURNING k.expires_at'
          INTO v_expires_at USING forget.scope, v_key;
    END IF;
    -- Judged here, not in RETURNING: Citus allows only immutable functions there.
    RETURN COALESCE(v_expires_at OPERATOR(pg_catalog.>) pg_catalog.now(), false);
END
$fn$;

