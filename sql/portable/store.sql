-- Portable edition: the store in PL/pgSQL. Each BODY here gives a LANGUAGE c function of
-- sql/idempotency.sql its portable body, under the native declaration (sql/portable/README.md;
-- scripts/portable.py refuses to build while a C function has no body here or in the other
-- sql/portable/ files); the functions named idempotency._p_* are the edition's own helpers. The rules are the
-- native edition's (src/api.rs, src/store/, crates/idempotency-core/src/arguments.rs and
-- signing.rs): the same checks in the same order, SQLSTATEs and messages, the same rows, tokens
-- and stored keys. Every function pins search_path; every reference is schema-qualified.
--
-- Settings: the native library defines idempotency.* as settings; without it they are
-- placeholders that hold text, read here with current_setting(name, true), with the native
-- defaults and units. What binds a role comes from idempotency.role_settings (the row of the role
-- the session switched to with SET ROLE when it has one, else the session user's), which the role
-- can neither read nor change, exactly as the native edition reads it. Inside these SECURITY
-- DEFINER functions CURRENT_USER is the owner; the setting role still names the role SET ROLE
-- set ('none' when the session did not switch, switched back, or ran SET SESSION AUTHORIZATION),
-- looked up by name in pg_roles.

-- Helpers ---------------------------------------------------------------------------------------

-- An integer setting in its unit ('s', 'ms', 'kB', or '' for none), read as PostgreSQL reads
-- the native edition's settings; unset or empty: the native default.
CREATE FUNCTION idempotency._p_setting(name text, default_value integer, unit text)
RETURNS integer
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN idempotency._p_setting_value(name, pg_catalog.current_setting(name, true), default_value, unit);
END
$fn$;

-- The value `raw` of the integer setting `name` in `unit`, as PostgreSQL's parse_int reads a
-- setting the native library defines: a number as strtol reads it (decimal, 0x hexadecimal, 0
-- octal), or as strtod (a double) where strtol stops at '.', 'e' or 'E' (2.5, 1e3, .5, 010.5,
-- 0x1.8p1); then, where the setting has a unit, one of its units (a fraction rounded to the next
-- smaller unit); rounded half to even; within the range of an integer. Anything else is
-- refused naming the setting (22023), as PostgreSQL refuses such a SET natively.
CREATE FUNCTION idempotency._p_setting_value(name text, raw text, default_value integer, unit text)
RETURNS integer
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    -- isspace() of the C locale: space, \t, \n, \v, \f, \r
    c_space CONSTANT text := E' \t\n\f\r' OPERATOR(pg_catalog.||) pg_catalog.chr(11);
    v_raw text := pg_catalog.btrim(raw, c_space);
    v_m text[];
    v_digits text;
    v_after text;
    v_num numeric;
    v_value float8;
    v_rest text;
    v_units text[];
    v_mult float8[];
    v_i integer;
    v_hint text;
    v_lo integer;
    v_hi integer;
    v_unit text;
    v_bound_unit text;
    v_message text;
BEGIN
    IF v_raw IS NULL OR v_raw OPERATOR(pg_catalog.=) '' THEN
        RETURN default_value;
    END IF;
    IF v_raw OPERATOR(pg_catalog.~) '^[+-]?0[xX][0-9a-fA-F]' THEN
        -- strtol, base 16; where it stops at '.', strtod's hexadecimal form (0x1.8p1). Beyond
        -- 15 digits before the point: out of range.
        v_m := pg_catalog.regexp_match(v_raw, '^[+-]?0[xX]([0-9a-fA-F]+)(?:(\.)([0-9a-fA-F]*)(?:[pP]([+-]?[0-9]+))?)?(.*)$');
        IF pg_catalog.length(pg_catalog.ltrim(v_m[1], '0')) OPERATOR(pg_catalog.>) 15 THEN
            v_hint := 'Value exceeds integer range.';
        ELSIF v_m[2] IS NULL
              OR pg_catalog.length(pg_catalog.ltrim(pg_catalog.ltrim(COALESCE(v_m[4], '0'), '+-'), '0')) OPERATOR(pg_catalog.<=) 4
                 AND pg_catalog.abs(COALESCE(v_m[4], '0')::integer) OPERATOR(pg_catalog.<=) 1100 THEN
            -- (A binary exponent beyond 1100 puts any such number out of a double's range.)
            v_num := ('x' OPERATOR(pg_catalog.||) pg_catalog.lpad(v_m[1], 16, '0'))::pg_catalog.bit(64)::bigint::numeric;
            FOR v_i IN 1 .. LEAST(COALESCE(pg_catalog.length(v_m[3]), 0), 15) LOOP
                v_num := v_num OPERATOR(pg_catalog.+)
                         (('x' OPERATOR(pg_catalog.||) pg_catalog.lpad(pg_catalog.substr(v_m[3], v_i, 1), 16, '0'))::pg_catalog.bit(64)::bigint::numeric
                          OPERATOR(pg_catalog./) (16::numeric OPERATOR(pg_catalog.^) v_i));
            END LOOP;
            -- (Divided for a negative exponent: a numeric power would round a tiny result to 0.)
            v_num := CASE WHEN COALESCE(v_m[4], '0')::integer OPERATOR(pg_catalog.>=) 0
                          THEN v_num OPERATOR(pg_catalog.*) (2::numeric OPERATOR(pg_catalog.^) COALESCE(v_m[4], '0')::integer)
                          ELSE v_num OPERATOR(pg_catalog./) (2::numeric OPERATOR(pg_catalog.^) (OPERATOR(pg_catalog.-) v_m[4]::integer)) END;
            v_rest := v_m[5];
        END IF;
    ELSE
        v_m := pg_catalog.regexp_match(v_raw, '^([+-]?)([0-9]*)(.*)$');
        -- strtol's digits: octal after a leading 0 (up to the first 8 or 9), else decimal.
        v_digits := CASE WHEN v_m[2] OPERATOR(pg_catalog.~) '^0' THEN pg_catalog.substring(v_m[2], '^0[0-7]*') ELSE v_m[2] END;
        v_after := pg_catalog.substr(v_m[2], pg_catalog.length(v_digits) OPERATOR(pg_catalog.+) 1) OPERATOR(pg_catalog.||) v_m[3];
        IF pg_catalog.length(pg_catalog.ltrim(v_digits, '0')) OPERATOR(pg_catalog.>) 30 AND v_after OPERATOR(pg_catalog.!~) '^[.eE]' THEN
            -- (Far beyond an integer either way: no loop over a caller's long text.)
            v_hint := 'Value exceeds integer range.';
        ELSIF v_digits OPERATOR(pg_catalog.<>) '' AND v_after OPERATOR(pg_catalog.!~) '^[.eE]' THEN
            v_num := 0;
            FOR v_i IN 1 .. CASE WHEN v_digits OPERATOR(pg_catalog.~) '^0' THEN pg_catalog.length(v_digits) ELSE 0 END LOOP
                v_num := v_num OPERATOR(pg_catalog.*) 8 OPERATOR(pg_catalog.+) pg_catalog.substr(v_digits, v_i, 1)::numeric;
            END LOOP;
            IF v_digits OPERATOR(pg_catalog.!~) '^0' THEN
                v_num := v_digits::numeric;
            END IF;
            v_rest := v_after;
        ELSIF v_digits OPERATOR(pg_catalog.<>) '' OR v_raw OPERATOR(pg_catalog.~) '^[.eE]' THEN
            -- strtod (an exponent beyond a double's: ERANGE there, refused below).
            v_m := pg_catalog.regexp_match(v_raw, '^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:[eE]([+-]?[0-9]+))?(.*)$');
            IF v_m IS NOT NULL THEN
                v_rest := v_m[3];
                IF v_m[1]::numeric OPERATOR(pg_catalog.=) 0 THEN
                    v_num := 0;
                ELSIF pg_catalog.length(pg_catalog.ltrim(pg_catalog.ltrim(COALESCE(v_m[2], '0'), '+-'), '0')) OPERATOR(pg_catalog.<=) 4
                      AND pg_catalog.abs(COALESCE(v_m[2], '0')::integer) OPERATOR(pg_catalog.<=) 1000 THEN
                    v_num := (v_m[1] OPERATOR(pg_catalog.||) 'e' OPERATOR(pg_catalog.||) COALESCE(v_m[2], '0'))::numeric;
                END IF;
            END IF;
        END IF;
    END IF;
    -- As a double, as strtod leaves it (beyond its range, or below its smallest normal value:
    -- ERANGE, refused).
    IF v_num IS NOT NULL
       AND (pg_catalog.abs(v_num) OPERATOR(pg_catalog.>) 1.7976931348623157e308
            OR v_num OPERATOR(pg_catalog.<>) 0 AND pg_catalog.abs(v_num) OPERATOR(pg_catalog.<) 2.2250738585072014e-308) THEN
        v_num := NULL;
    END IF;
    v_value := v_num::float8;
    IF v_value IS NOT NULL AND pg_catalog.left(v_raw, 1) OPERATOR(pg_catalog.=) '-' AND v_value OPERATOR(pg_catalog.>) 0 THEN
        v_value := OPERATOR(pg_catalog.-) v_value;
    END IF;
    v_rest := pg_catalog.ltrim(v_rest, c_space);
    IF v_value IS NOT NULL AND v_rest OPERATOR(pg_catalog.<>) '' THEN
        -- A unit of the setting's, converted to it (PostgreSQL's conversion tables, in doubles).
        IF unit OPERATOR(pg_catalog.=) 'kB' THEN
            v_units := '{TB,GB,MB,kB,B}';
            v_mult := ARRAY[1073741824, 1048576, 1024, 1, 1.0::float8 OPERATOR(pg_catalog./) 1024];
        ELSIF unit OPERATOR(pg_catalog.=) 'ms' THEN
            v_units := '{d,h,min,s,ms,us}';
            v_mult := ARRAY[86400000, 3600000, 60000, 1000, 1, 1.0::float8 OPERATOR(pg_catalog./) 1000];
        ELSIF unit OPERATOR(pg_catalog.=) 's' THEN
            v_units := '{d,h,min,s,ms,us}';
            v_mult := ARRAY[86400, 3600, 60, 1, 1.0::float8 OPERATOR(pg_catalog./) 1000, 1.0::float8 OPERATOR(pg_catalog./) 1000000];
        END IF;
        v_i := pg_catalog.array_position(v_units, v_rest);
        IF v_i IS NULL THEN
            v_value := NULL;
            v_hint := CASE WHEN unit OPERATOR(pg_catalog.=) 'kB' THEN 'Valid units for this parameter are "B", "kB", "MB", "GB", and "TB".'
                           WHEN unit OPERATOR(pg_catalog.=) ANY ('{s,ms}'::text[]) THEN 'Valid units for this parameter are "us", "ms", "s", "min", "h", and "d".' END;
        ELSE
            v_value := v_value OPERATOR(pg_catalog.*) v_mult[v_i];
            IF v_i OPERATOR(pg_catalog.<) pg_catalog.array_length(v_units, 1) THEN
                -- A fraction such as 1.5min: to the nearest multiple of the next smaller unit.
                v_value := pg_catalog.round(v_value OPERATOR(pg_catalog./) v_mult[v_i OPERATOR(pg_catalog.+) 1])
                           OPERATOR(pg_catalog.*) v_mult[v_i OPERATOR(pg_catalog.+) 1];
            END IF;
        END IF;
    END IF;
    IF v_value IS NOT NULL THEN
        -- round() of a double is rint(): half to even.
        v_value := pg_catalog.round(v_value);
        IF v_value OPERATOR(pg_catalog.>=) -2147483648 AND v_value OPERATOR(pg_catalog.<=) 2147483647 THEN
            -- The range the native library gives the setting, refused as PostgreSQL refuses a
            -- value outside it (the range written with its unit from PostgreSQL 17 on).
            v_lo := CASE pg_catalog.lower(name)
                        WHEN 'idempotency.claim_wait' THEN 0 WHEN 'idempotency.sweep_delay' THEN 0
                        WHEN 'idempotency.sweep_nice' THEN 0 WHEN 'idempotency.audit_retention' THEN 0
                        WHEN 'idempotency.partitions' THEN 0 ELSE 1 END;
            v_hi := CASE pg_catalog.lower(name)
                        WHEN 'idempotency.default_ttl' THEN 315446400 WHEN 'idempotency.default_lease' THEN 315446400
                        WHEN 'idempotency.claim_wait' THEN 3600000 WHEN 'idempotency.busy_retry_after' THEN 3600000
                        WHEN 'idempotency.sweep_interval' THEN 86400 WHEN 'idempotency.sweep_batch_size' THEN 1000000
                        WHEN 'idempotency.sweep_delay' THEN 10000 WHEN 'idempotency.sweep_nice' THEN 19
                        WHEN 'idempotency.max_response_size' THEN 1048576 WHEN 'idempotency.max_recovery_point_size' THEN 1048576
                        WHEN 'idempotency.partitions' THEN 1024 ELSE 2147483647 END;
            IF v_value OPERATOR(pg_catalog.>=) v_lo AND v_value OPERATOR(pg_catalog.<=) v_hi THEN
                RETURN v_value::integer;
            END IF;
            v_unit := CASE WHEN unit OPERATOR(pg_catalog.=) '' THEN '' ELSE ' ' OPERATOR(pg_catalog.||) unit END;
            v_bound_unit := CASE WHEN pg_catalog.current_setting('server_version_num')::integer
                                      OPERATOR(pg_catalog.>=) 170000 THEN v_unit ELSE '' END;
            v_message := pg_catalog.format('%s%s is outside the valid range for parameter "%s" (%s%s .. %s%s)',
                                           v_value::integer, v_unit, name, v_lo, v_bound_unit, v_hi, v_bound_unit);
        ELSE
            v_hint := 'Value exceeds integer range.';
        END IF;
    END IF;
    IF v_message IS NULL THEN
        v_message := pg_catalog.format('invalid value for parameter "%s": "%s"', name, raw);
    END IF;
    -- A value an administrator set (ALTER DATABASE or ALTER ROLE ... SET, which PostgreSQL takes
    -- for a setting no library defines): natively a warning where the library loads, and the
    -- default. A session's own value: natively its SET is refused.
    IF raw IS NOT DISTINCT FROM idempotency._p_admin_setting(name)
       OR raw IS NOT DISTINCT FROM idempotency._p_server_setting(name) THEN
        IF v_hint IS NULL THEN
            RAISE WARNING USING ERRCODE = 'invalid_parameter_value', MESSAGE = v_message;
        ELSE
            RAISE WARNING USING ERRCODE = 'invalid_parameter_value', MESSAGE = v_message, HINT = v_hint;
        END IF;
        RETURN default_value;
    END IF;
    IF v_hint IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = v_message;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = v_message, HINT = v_hint;
END
$fn$;

-- A setting as an administrator set it, which the session cannot change: the value of ALTER
-- DATABASE / ALTER ROLE ... SET for the session's login role, in PostgreSQL's order (the
-- database and role together, the role, the database, ALTER ROLE ALL; where no native library
-- defines the setting only superusers, or roles granted SET on it, may write those), else
-- NULL. Not the session's own value (SET, set_config, a startup option such as PGOPTIONS) nor
-- postgresql.conf's or ALTER SYSTEM's, which current_setting cannot tell apart from it
-- (pg_settings does not show placeholders).
CREATE FUNCTION idempotency._p_admin_setting(name text)
RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT pg_catalog.substr(e.entry, pg_catalog.strpos(e.entry, '=') OPERATOR(pg_catalog.+) 1)
      FROM pg_catalog.pg_db_role_setting AS d, pg_catalog.unnest(d.setconfig) AS e(entry)
     WHERE d.setdatabase OPERATOR(pg_catalog.=) ANY (ARRAY[(SELECT b.oid FROM pg_catalog.pg_database AS b
                                  WHERE b.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()), 0]::pg_catalog.oid[])
       AND d.setrole OPERATOR(pg_catalog.=) ANY (ARRAY[(SELECT a.oid FROM pg_catalog.pg_roles AS a
                                  WHERE a.rolname OPERATOR(pg_catalog.=) SESSION_USER), 0]::pg_catalog.oid[])
       AND pg_catalog.lower(pg_catalog.split_part(e.entry, '=', 1)) OPERATOR(pg_catalog.=) pg_catalog.lower($1)
     ORDER BY d.setdatabase OPERATOR(pg_catalog.<>) 0 AND d.setrole OPERATOR(pg_catalog.<>) 0 DESC,
              d.setrole OPERATOR(pg_catalog.<>) 0 DESC, d.setdatabase OPERATOR(pg_catalog.<>) 0 DESC
     LIMIT 1
$fn$;

-- A setting as the server's configuration sets it (postgresql.conf, its includes, ALTER SYSTEM's
-- postgresql.auto.conf: the entry that applies, as the files read now), where the edition's owner
-- may read them (pg_show_all_file_settings: superusers, and roles a superuser granted it to);
-- else NULL. A session's SET hides that value from current_setting, and a startup option
-- (PGOPTIONS) replaces it as the value RESET returns, so neither can tell it.
CREATE FUNCTION idempotency._p_server_setting(name text)
RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF NOT pg_catalog.has_function_privilege('pg_catalog.pg_show_all_file_settings()', 'EXECUTE') THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT f.setting FROM pg_catalog.pg_show_all_file_settings() AS f
             WHERE pg_catalog.lower(f.name) OPERATOR(pg_catalog.=) pg_catalog.lower(_p_server_setting.name) AND f.applied
             ORDER BY f.seqno DESC LIMIT 1);
END
$fn$;

-- Whether an administrator turned a boolean setting on for this session, where the session cannot
-- undo it: ALTER DATABASE / ALTER ROLE ... SET for its login role (_p_admin_setting), else the
-- server's configuration (_p_server_setting); spelled as parse_bool reads true.
CREATE FUNCTION idempotency._p_admin_on(name text)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT COALESCE(pg_catalog.lower(pg_catalog.btrim(COALESCE(idempotency._p_admin_setting($1),
                                                              idempotency._p_server_setting($1))))
                    OPERATOR(pg_catalog.=) ANY (ARRAY['on', 'true', 'tru', 'tr', 't', 'yes', 'ye', 'y', '1']), false)
$fn$;

-- A boolean setting (unset or empty: false) as PostgreSQL's parse_bool reads it (a prefix of true,
-- false, yes, no, of at least two letters of on and off, 1, 0; any case, no spaces); any other
-- value is refused (22023) as PostgreSQL refuses such a SET natively.
CREATE FUNCTION idempotency._p_setting_on(name text)
RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_raw text := pg_catalog.current_setting(name, true);
    v text := pg_catalog.lower(v_raw);
    n integer := pg_catalog.length(v);
BEGIN
    IF v IS NULL OR v OPERATOR(pg_catalog.=) '' THEN
        RETURN false;  -- unset (a placeholder reset, or never set, reads '' or nothing)
    ELSIF v OPERATOR(pg_catalog.=) pg_catalog.left('true', n) OR v OPERATOR(pg_catalog.=) pg_catalog.left('yes', n)
          OR n OPERATOR(pg_catalog.>=) 2 AND v OPERATOR(pg_catalog.=) pg_catalog.left('on', n) OR v OPERATOR(pg_catalog.=) '1' THEN
        RETURN true;
    ELSIF v OPERATOR(pg_catalog.=) pg_catalog.left('false', n) OR v OPERATOR(pg_catalog.=) pg_catalog.left('no', n)
          OR n OPERATOR(pg_catalog.>=) 2 AND v OPERATOR(pg_catalog.=) pg_catalog.left('off', n) OR v OPERATOR(pg_catalog.=) '0' THEN
        RETURN false;
    END IF;
    -- (An administrator's value: natively a warning where the library loads, and off.)
    IF v_raw IS NOT DISTINCT FROM idempotency._p_admin_setting(name) THEN
        RAISE WARNING USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('parameter "%s" requires a Boolean value', name);
        RETURN false;
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'invalid_parameter_value',
        MESSAGE = pg_catalog.format('parameter "%s" requires a Boolean value', name);
END
$fn$;

-- The scope prefix of this session: its row of idempotency.role_settings (the SET ROLE role's when
-- it has one, else the session user's), which binds; else idempotency.scope_prefix (without the
-- library a session can set that itself: a default, not a boundary); else '' (every scope).
CREATE FUNCTION idempotency._p_scope_prefix()
RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    -- The session's row of idempotency.role_settings (the SET ROLE role's when it has one, else
    -- the session user's), read in the same statement (a nested call costs more than the lookup
    -- on this path, run by every claim and completion).
    RETURN COALESCE((SELECT r.scope_prefix FROM idempotency.role_settings AS r
                      WHERE r.role::pg_catalog.oid OPERATOR(pg_catalog.=) COALESCE(
                            (SELECT s.role::pg_catalog.oid FROM idempotency.role_settings AS s
                              WHERE s.role::pg_catalog.oid OPERATOR(pg_catalog.=)
                                    (SELECT b.oid FROM pg_catalog.pg_roles AS b
                                      WHERE b.rolname OPERATOR(pg_catalog.=) pg_catalog.current_setting('role')::pg_catalog.name)),
                            (SELECT a.oid FROM pg_catalog.pg_roles AS a WHERE a.rolname OPERATOR(pg_catalog.=) SESSION_USER))),
                    pg_catalog.current_setting('idempotency.scope_prefix', true), '');
END
$fn$;

-- The limit (kB) and the name of what set it. A session may lower a limit, never raise it: the
-- session's value (SET, set_config, a startup option), but no more than what an administrator set
-- (ALTER DATABASE / ALTER ROLE ... SET for the login role, else the server's configuration where
-- the owner may read it, else the native default), and no more than a lower value in the
-- session's row of idempotency.role_settings (the SET ROLE role's when it has one, else the
-- session user's).
CREATE FUNCTION idempotency._p_limit(what text, OUT limit_kb integer, OUT setting text)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_bound integer;
    v_default integer;
    v_admin text;
    v_cap integer;
BEGIN
    IF what OPERATOR(pg_catalog.=) 'response' THEN
        setting := 'idempotency.max_response_size';
        v_default := 4096;
        SELECT r.max_response_size INTO v_bound FROM idempotency.role_settings AS r
         WHERE r.role::pg_catalog.oid OPERATOR(pg_catalog.=) COALESCE(
               (SELECT s.role::pg_catalog.oid FROM idempotency.role_settings AS s
                 WHERE s.role::pg_catalog.oid OPERATOR(pg_catalog.=)
                       (SELECT b.oid FROM pg_catalog.pg_roles AS b
                         WHERE b.rolname OPERATOR(pg_catalog.=) pg_catalog.current_setting('role')::pg_catalog.name)),
               (SELECT a.oid FROM pg_catalog.pg_roles AS a WHERE a.rolname OPERATOR(pg_catalog.=) SESSION_USER));
    ELSE
        setting := 'idempotency.max_recovery_point_size';
        v_default := 64;
        SELECT r.max_recovery_point_size INTO v_bound FROM idempotency.role_settings AS r
         WHERE r.role::pg_catalog.oid OPERATOR(pg_catalog.=) COALESCE(
               (SELECT s.role::pg_catalog.oid FROM idempotency.role_settings AS s
                 WHERE s.role::pg_catalog.oid OPERATOR(pg_catalog.=)
                       (SELECT b.oid FROM pg_catalog.pg_roles AS b
                         WHERE b.rolname OPERATOR(pg_catalog.=) pg_catalog.current_setting('role')::pg_catalog.name)),
               (SELECT a.oid FROM pg_catalog.pg_roles AS a WHERE a.rolname OPERATOR(pg_catalog.=) SESSION_USER));
    END IF;
    limit_kb := idempotency._p_setting(setting, v_default, 'kB');
    -- Nothing of the setting anywhere (no placeholder: no SET, no startup option, no entry an
    -- administrator wrote, which every session would have): the default, which limit_kb is.
    IF pg_catalog.current_setting(setting, true) IS NOT NULL THEN
        v_admin := COALESCE(idempotency._p_admin_setting(setting), idempotency._p_server_setting(setting));
        v_cap := CASE WHEN v_admin IS NULL THEN v_default
                      ELSE idempotency._p_setting_value(setting, v_admin, v_default, 'kB') END;
        limit_kb := LEAST(limit_kb, v_cap);
    END IF;
    IF v_bound OPERATOR(pg_catalog.<) limit_kb THEN
        limit_kb := v_bound;
        setting := 'idempotency.role_settings.' OPERATOR(pg_catalog.||) pg_catalog.replace(setting, 'idempotency.', '');
    END IF;
END
$fn$;

-- Refuses a value larger than a size limit (54000), before anything is written.
CREATE FUNCTION idempotency._p_check_size(arg text, size bigint, what text)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    l record;
BEGIN
    SELECT * INTO l FROM idempotency._p_limit(what);
    IF size OPERATOR(pg_catalog.>) (l.limit_kb::bigint OPERATOR(pg_catalog.*) 1024) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'program_limit_exceeded',
            MESSAGE = pg_catalog.format('%s is too large: %s bytes, %s allows %s', arg, size, l.setting,
                                        l.limit_kb::bigint OPERATOR(pg_catalog.*) 1024),
            HINT = 'store a reference to large results (a row id, an object store key) instead, or raise the limit';
    END IF;
END
$fn$;

-- Claims, completions and sweeps write: refused at once in a read-only transaction.
CREATE FUNCTION idempotency._p_refuse_read_only(function_name text)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'read_only_sql_transaction',
            MESSAGE = pg_catalog.format('idempotency.%s cannot run in a read-only transaction%s', function_name,
                                        CASE WHEN pg_catalog.pg_is_in_recovery() THEN ' (this server is a standby)' ELSE '' END),
            HINT = 'claim, complete and sweep on the primary; idempotency.lookup works on a standby';
    END IF;
END
$fn$;

-- The scope argument's rules: not NULL, at most @MAX_KEY_CHARS@ characters, under the session's prefix.
CREATE FUNCTION idempotency._p_check_scope(scope text)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_prefix text;
BEGIN
    IF scope IS NULL OR pg_catalog.length(scope) OPERATOR(pg_catalog.>) @MAX_KEY_CHARS@ THEN
        PERFORM idempotency._canon_check_key('scope', scope, true);  -- raises
    END IF;
    v_prefix := idempotency._p_scope_prefix();
    IF NOT pg_catalog.starts_with(scope, v_prefix) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'insufficient_privilege',
            MESSAGE = idempotency._canon_message(pg_catalog.format('scope %s is outside this role''s scopes: its scope prefix is %s',
                                        idempotency._p_debug(scope), idempotency._p_debug(v_prefix)));
    END IF;
END
$fn$;

-- A text as Rust's Debug writes a string, whole (the native edition's messages quote values
-- so): _canon_quote's escapes of each piece of 40 characters (which it does not cut), inside
-- one pair of quotes.
CREATE FUNCTION idempotency._p_debug(value text)
RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT '"' OPERATOR(pg_catalog.||)
           pg_catalog.string_agg(pg_catalog.substr(p.quoted, 2, pg_catalog.length(p.quoted) OPERATOR(pg_catalog.-) 2), '' ORDER BY p.n)
           OPERATOR(pg_catalog.||) '"'
      FROM (SELECT idempotency._canon_quote(pg_catalog.substr(value, i, 40)) AS quoted, i AS n
              FROM pg_catalog.generate_series(1, GREATEST(pg_catalog.length(value), 1), 40) AS i) AS p
$fn$;

-- HMAC-SHA256 (RFC 2104) on the core sha256(): the native edition's keyed hashes and signatures.
CREATE FUNCTION idempotency._p_hmac(secret bytea, message bytea)
RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_key bytea := secret;
    v_ipad bytea;
    v_opad bytea;
BEGIN
    IF pg_catalog.length(v_key) OPERATOR(pg_catalog.>) 64 THEN
        v_key := pg_catalog.sha256(v_key);
    END IF;
    v_key := v_key OPERATOR(pg_catalog.||) pg_catalog.decode(pg_catalog.repeat('00', 64 OPERATOR(pg_catalog.-) pg_catalog.length(v_key)), 'hex');
    v_ipad := v_key;
    v_opad := v_key;
    FOR i IN 0 .. 63 LOOP
        v_ipad := pg_catalog.set_byte(v_ipad, i, pg_catalog.get_byte(v_key, i) OPERATOR(pg_catalog.#) 54);
        v_opad := pg_catalog.set_byte(v_opad, i, pg_catalog.get_byte(v_key, i) OPERATOR(pg_catalog.#) 92);
    END LOOP;
    RETURN pg_catalog.sha256(v_opad OPERATOR(pg_catalog.||) pg_catalog.sha256(v_ipad OPERATOR(pg_catalog.||) message));
END
$fn$;

-- base64url without padding (RFC 4648 section 5), and its strict inverse (NULL when malformed).
CREATE FUNCTION idempotency._p_b64url(bytes bytea)
RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT pg_catalog.translate(pg_catalog.rtrim(pg_catalog.encode(bytes, 'base64'), '='), E'+/\n', '-_')
$fn$;

-- A secret argument: 16 bytes at least.
CREATE FUNCTION idempotency._p_check_secret(secret bytea)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF secret IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'secret must not be NULL';
    ELSIF pg_catalog.length(secret) OPERATOR(pg_catalog.<) 16 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'secret must be at least 16 bytes';
    END IF;
END
$fn$;

-- The message a signature covers: "<kid>.<key>", then a zero byte and the scope prefix if any.
CREATE FUNCTION idempotency._p_signed_message(kid integer, key text)
RETURNS bytea
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_prefix text := idempotency._p_scope_prefix();
    v_message bytea := pg_catalog.convert_to(kid::text OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||) key, 'UTF8');
BEGIN
    IF v_prefix OPERATOR(pg_catalog.<>) '' THEN
        v_message := v_message OPERATOR(pg_catalog.||) '\x00'::bytea OPERATOR(pg_catalog.||) pg_catalog.convert_to(v_prefix, 'UTF8');
    END IF;
    RETURN v_message;
END
$fn$;

-- A signed key's parts (key, secret id, signature), or NULLs when it is not shaped like one.
CREATE FUNCTION idempotency._p_parse_signed(signed text, OUT key text, OUT kid integer, OUT signature bytea)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_m text[];
BEGIN
    v_m := pg_catalog.regexp_match(signed, '^(.*)\.([^.]*)\.([^.]*)$', 's');
    IF v_m IS NULL OR v_m[1] OPERATOR(pg_catalog.=) '' OR pg_catalog.length(v_m[3]) OPERATOR(pg_catalog.<>) 43
       OR pg_catalog.length(v_m[1]) OPERATOR(pg_catalog.>) @MAX_KEY_CHARS@
       OR v_m[2] OPERATOR(pg_catalog.!~) '^[1-9][0-9]{0,9}$'
       OR v_m[2]::bigint OPERATOR(pg_catalog.>) 2147483647
       -- 43 characters of base64url hold 32 bytes and two bits that must be zero
       OR v_m[3] OPERATOR(pg_catalog.!~) '^[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]$' THEN
        RETURN;
    END IF;
    key := v_m[1];
    kid := v_m[2]::integer;
    signature := pg_catalog.decode(pg_catalog.translate(v_m[3], '-_', '+/') OPERATOR(pg_catalog.||) '=', 'base64');
END
$fn$;

-- The owner of the store: the extension's owner, or the schema's where the plain script made it.
CREATE FUNCTION idempotency._p_owner()
RETURNS oid
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT COALESCE((SELECT e.extowner FROM pg_catalog.pg_extension AS e
                      WHERE e.extname OPERATOR(pg_catalog.=) 'idempotency'),
                    (SELECT n.nspowner FROM pg_catalog.pg_namespace AS n
                      WHERE n.nspname OPERATOR(pg_catalog.=) 'idempotency'))
$fn$;

-- Which rows a sweep may touch: all for the store's owner and superusers (and members of the
-- owner's role), those under the session's scope prefix for a tenant, none otherwise.
CREATE FUNCTION idempotency._p_sweep_prefix(function_name text)
RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_prefix text;
BEGIN
    IF (SELECT a.rolsuper FROM pg_catalog.pg_roles AS a WHERE a.rolname OPERATOR(pg_catalog.=) SESSION_USER)
       OR pg_catalog.pg_has_role(SESSION_USER, idempotency._p_owner(), 'USAGE') THEN
        RETURN '';
    END IF;
    v_prefix := idempotency._p_scope_prefix();
    IF v_prefix OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'insufficient_privilege',
            MESSAGE = pg_catalog.format('idempotency.%s of the whole store is for the extension''s owner and superusers', function_name),
            HINT = 'run it as the owner (the background sweeper or pg_cron do), or bind this role to a scope prefix (idempotency.role_settings) to sweep only its own scopes';
    END IF;
    RETURN v_prefix;
END
$fn$;

-- The batch_size argument of the sweep functions (NULL: idempotency.sweep_batch_size).
CREATE FUNCTION idempotency._p_batch_size(batch_size integer)
RETURNS integer
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_batch integer := COALESCE(batch_size, idempotency._p_setting('idempotency.sweep_batch_size', 10000, ''));
BEGIN
    IF v_batch OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('batch_size must be positive (got %s)', v_batch);
    END IF;
    RETURN v_batch;
END
$fn$;

-- A TTL or lease checked on its own (positive, at most ten years, months counted as 30 days)
-- and on the clock (now() + it after now() and at most ten calendar years ahead); returns
-- now() + it. `name` is the argument or the setting that gave the value.
CREATE FUNCTION idempotency._p_duration(name text, value interval)
RETURNS timestamptz
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_months numeric;
    v_days numeric;
    v_micros numeric;
    v_total numeric;
    v_ends timestamptz;
BEGIN
    IF NOT pg_catalog.isfinite(value) THEN
        v_total := CASE WHEN value OPERATOR(pg_catalog.>) '0'::interval THEN 1e30 ELSE -1 END;
    ELSE
        v_months := EXTRACT(year FROM value) OPERATOR(pg_catalog.*) 12 OPERATOR(pg_catalog.+) EXTRACT(month FROM value);
        v_days := EXTRACT(day FROM value);
        v_micros := EXTRACT(epoch FROM (value OPERATOR(pg_catalog.-)
                        pg_catalog.make_interval(months => v_months::integer, days => v_days::integer)))
                    OPERATOR(pg_catalog.*) 1000000;
        v_total := (v_months OPERATOR(pg_catalog.*) 30 OPERATOR(pg_catalog.+) v_days) OPERATOR(pg_catalog.*) 86400000000
                   OPERATOR(pg_catalog.+) v_micros;
    END IF;
    IF v_total OPERATOR(pg_catalog.<=) 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('%s must be a positive interval', name);
    END IF;
    IF v_total OPERATOR(pg_catalog.>) 316224000000000 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('%s must be at most 10 years', name);
    END IF;
    v_ends := pg_catalog.now() OPERATOR(pg_catalog.+) value;
    IF v_ends OPERATOR(pg_catalog.<=) pg_catalog.now() THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('%s must end in the future: now() + %s is not after now() (%s)',
                                        name, name, idempotency._canon_quote(value::text));
    END IF;
    IF v_ends OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.+) '120 months'::interval) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('%s must be at most 10 years (got %s)', name, idempotency._canon_quote(value::text));
    END IF;
    RETURN v_ends;
END
$fn$;

-- The TTL and lease of a claim: each argument, or its setting when NULL; with no lease given,
-- least(idempotency.default_lease, ttl); a lease that would outlive the key is refused.
CREATE FUNCTION idempotency._p_ttl_and_lease(ttl interval, lease interval, OUT ttl_value interval, OUT lease_value interval)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_ttl_name text := 'ttl';
    v_lease_name text := 'lease';
    v_ttl_ends timestamptz;
    v_lease_ends timestamptz;
BEGIN
    IF ttl IS NULL THEN
        v_ttl_name := 'idempotency.default_ttl';
        ttl_value := pg_catalog.make_interval(secs => idempotency._p_setting('idempotency.default_ttl', @DEFAULT_TTL_SECS@, 's'));
    ELSE
        ttl_value := ttl;
    END IF;
    v_ttl_ends := idempotency._p_duration(v_ttl_name, ttl_value);
    IF lease IS NULL THEN
        lease_value := pg_catalog.make_interval(secs => idempotency._p_setting('idempotency.default_lease', @DEFAULT_LEASE_SECS@, 's'));
        v_lease_ends := idempotency._p_duration('idempotency.default_lease', lease_value);
        IF v_lease_ends OPERATOR(pg_catalog.>) v_ttl_ends THEN
            lease_value := ttl_value;
            v_lease_ends := v_ttl_ends;
        ELSE
            v_lease_name := 'idempotency.default_lease';
        END IF;
    ELSE
        lease_value := lease;
        v_lease_ends := idempotency._p_duration('lease', lease_value);
    END IF;
    IF v_lease_ends OPERATOR(pg_catalog.>) v_ttl_ends THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('%s (%s) must not be longer than %s (%s): the lease would outlive the key',
                                        v_lease_name, idempotency._canon_quote(lease_value::text),
                                        v_ttl_name, idempotency._canon_quote(ttl_value::text));
    END IF;
END
$fn$;

-- SHA-256 of a request's exact canonical form; errors name `arg`.
CREATE FUNCTION idempotency._p_request_hash(request jsonb, arg text)
RETURNS bytea
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF request IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM idempotency._canon_unicode_doc(request, arg);
    RETURN pg_catalog.sha256(pg_catalog.convert_to(idempotency._canon_text(request, true, arg), 'UTF8'));
END
$fn$;

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

-- The answer to a claim that meets another open transaction's claim of the key.
CREATE FUNCTION idempotency._p_busy()
RETURNS idempotency.claim_result
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT ROW('in_progress', NULL, NULL, NULL,
               pg_catalog.make_interval(secs => GREATEST(idempotency._p_setting('idempotency.busy_retry_after', @DEFAULT_BUSY_RETRY_AFTER_MS@, 'ms'), 1)
                                                OPERATOR(pg_catalog./) 1000.0),
               NULL, NULL)::idempotency.claim_result
$fn$;

-- A token above the key's previous one `old`, for a restart or a takeover: the sequence's next
-- value, and where that is not above it (the sequence may lag behind the store after a restore
-- of rows without it), the sequence is first moved past it. Never into the upper half of the
-- sequence's range: the sequence is shared by every key, and one row whose token is there
-- (restored from a dump or written by hand; the sequence itself gets there only after handing
-- out half its range) would otherwise leave it next to nothing, or with bigint's maximum
-- nothing at all, so that every later claim of any key failed (2200H). The claim of such a key
-- is refused with 22003 instead (tokens must rise per key, so no smaller one is given), and the
-- sequence is left where it is: the key is usable again once forget or the sweep deleted its
-- row. As natively (next_token_above in src/store/sql.rs).
CREATE FUNCTION idempotency._p_token_above(p_key text, old bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_token bigint := pg_catalog.nextval('idempotency.token_seq');
    v_highest bigint;
BEGIN
    IF v_token OPERATOR(pg_catalog.>) old THEN
        RETURN v_token;
    END IF;
    SELECT s.seqmax OPERATOR(pg_catalog./) 2 INTO v_highest
      FROM pg_catalog.pg_sequence AS s
     WHERE s.seqrelid OPERATOR(pg_catalog.=) 'idempotency.token_seq'::pg_catalog.regclass;
    IF old OPERATOR(pg_catalog.>) v_highest THEN
        RAISE EXCEPTION USING
            ERRCODE = 'numeric_value_out_of_range',
            MESSAGE = idempotency._canon_message(pg_catalog.format(
                'idempotency.claim: key %s has token %s, above the highest token a claim moves the token sequence past (%s): no larger token is issued for it',
                idempotency._p_key_label(p_key), old, v_highest)),
            HINT = 'the row was restored from a dump or written by hand; delete it with idempotency.forget(key, scope) (the sweep deletes it once it expires), then claim the key again';
    END IF;
    PERFORM pg_catalog.setval('idempotency.token_seq', old, true);
    RETURN pg_catalog.nextval('idempotency.token_seq');
END
$fn$;

-- The claim algorithm on a key in its stored form, arguments checked: the outcome table
-- applied to the row, the row read and written through SQL. Never waits on another
-- transaction's claim of the key beyond idempotency.claim_wait (see _p_mark; a row
-- another transaction is changing is skipped, not waited for).
CREATE FUNCTION idempotency._p_claim(p_scope text, p_key text, p_hash bytea, p_ttl interval, p_lease interval)
RETURNS idempotency.claim_result
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    r record;
    res idempotency.claim_result;
    v_rounds integer := 0;
    v_token bigint;
    v_busy boolean;
    v_started timestamptz;
    v_wait integer;
    v_mark boolean;
    v_timeout text;
BEGIN
    LOOP
        v_busy := false;
        SELECT k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status AS completed,
               k.request_hash, k.token, k.response, k.response_status, k.recovery_point, k.expires_at,
               k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now() AS expired,
               k.locked_until OPERATOR(pg_catalog.<=) pg_catalog.now() AS lease_over,
               GREATEST(k.locked_until OPERATOR(pg_catalog.-) pg_catalog.now(), '1 second'::pg_catalog.interval) AS retry_after
          INTO r
          FROM idempotency.idempotency_keys AS k
         WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key;
        IF NOT FOUND THEN
            v_mark := idempotency._p_mark(p_scope, p_key, false);
            IF NOT v_mark THEN
                v_busy := true;
            ELSIF v_mark IS NULL THEN
                -- Past the transaction's marks: another open transaction past its own may have
                -- inserted the key unmarked, and an insert would wait for it (and it, in turn,
                -- for this one's unmarked keys: a deadlock). The insert waits a millisecond at
                -- most (lock_timeout, in a subtransaction that its timeout rolls back): a key
                -- it would wait for longer is busy, as natively. (The transaction holds the
                -- store's table lock from its earlier writes, so the wait can only be a row's.)
                BEGIN
                    v_timeout := pg_catalog.current_setting('lock_timeout');
                    PERFORM pg_catalog.set_config('lock_timeout', '1ms', true);
                    PERFORM pg_catalog.set_config('idempotency_portable.marked', 'on', true);
                    IF NOT EXISTS (SELECT FROM pg_catalog.pg_rewrite AS w
                                    WHERE w.ev_class OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
                        INSERT INTO idempotency.idempotency_keys AS k
                               (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl)
                        VALUES (p_scope, p_key, p_hash, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(),
                                pg_catalog.now() OPERATOR(pg_catalog.+) p_lease, pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, p_ttl)
                        ON CONFLICT (scope, key) DO NOTHING
                        RETURNING k.token, k.expires_at INTO res.token, res.expires_at;
                    ELSE
                        -- A store with rules refuses ON CONFLICT (as below).
                        INSERT INTO idempotency.idempotency_keys AS k
                               (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl)
                        VALUES (p_scope, p_key, p_hash, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(),
                                pg_catalog.now() OPERATOR(pg_catalog.+) p_lease, pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, p_ttl);
                        SELECT k.token, k.expires_at INTO res.token, res.expires_at
                          FROM idempotency.idempotency_keys AS k
                         WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key;
                    END IF;
                    PERFORM pg_catalog.set_config('idempotency_portable.marked', 'off', true);
                    PERFORM pg_catalog.set_config('lock_timeout', v_timeout, true);
                    IF res.token IS NOT NULL THEN
                        res.outcome := 'new';
                        RETURN res;
                    END IF;
                EXCEPTION
                    WHEN lock_not_available THEN
                        v_busy := true;
                    WHEN unique_violation THEN
                        NULL;  -- a row that got there first is read in the next round
                END;
            ELSIF NOT EXISTS (SELECT FROM pg_catalog.pg_rewrite AS w
                               WHERE w.ev_class OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
                INSERT INTO idempotency.idempotency_keys AS k
                       (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl)
                VALUES (p_scope, p_key, p_hash, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(),
                        pg_catalog.now() OPERATOR(pg_catalog.+) p_lease, pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, p_ttl)
                ON CONFLICT (scope, key) DO NOTHING
                RETURNING k.token, k.expires_at INTO res.token, res.expires_at;
                IF FOUND THEN
                    res.outcome := 'new';
                    RETURN res;
                END IF;
            ELSE
                -- A store with rules (an owner's change) refuses ON CONFLICT: the key, found
                -- absent and marked, is inserted without it; a row that got there first is read
                -- in the next round.
                BEGIN
                    INSERT INTO idempotency.idempotency_keys AS k
                           (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl)
                    VALUES (p_scope, p_key, p_hash, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(),
                            pg_catalog.now() OPERATOR(pg_catalog.+) p_lease, pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, p_ttl);
                    SELECT k.token, k.expires_at INTO res.token, res.expires_at
                      FROM idempotency.idempotency_keys AS k
                     WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key;
                    IF FOUND THEN
                        res.outcome := 'new';
                        RETURN res;
                    END IF;
                EXCEPTION WHEN unique_violation THEN
                    NULL;
                END;
            END IF;
        ELSIF NOT pg_catalog.pg_try_advisory_lock_shared(pg_catalog.hashtextextended(
                      pg_catalog.length(p_scope)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                      OPERATOR(pg_catalog.||) p_scope OPERATOR(pg_catalog.||) p_key, 5432)) THEN
            -- _p_marked written out: another open transaction is changing the row.
            v_busy := true;
        ELSIF NOT pg_catalog.pg_advisory_unlock_shared(pg_catalog.hashtextextended(
                      pg_catalog.length(p_scope)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                      OPERATOR(pg_catalog.||) p_scope OPERATOR(pg_catalog.||) p_key, 5432)) THEN
            NULL;  -- never: the shared lock taken just above is released
        ELSIF NOT r.expired AND r.request_hash IS NOT NULL AND p_hash IS NOT NULL
              AND r.request_hash OPERATOR(pg_catalog.<>) p_hash THEN
            RAISE WARNING '%', idempotency._canon_message(pg_catalog.format(
                'idempotency: key reused with a different request: scope=%s key=%s stored_hash=%s request_hash=%s',
                idempotency._p_debug(p_scope), idempotency._p_key_label(p_key),
                pg_catalog.encode(pg_catalog.substr(r.request_hash, 1, 6), 'hex'),
                pg_catalog.encode(pg_catalog.substr(p_hash, 1, 6), 'hex')));
            res.outcome := 'mismatch';
            res.expires_at := r.expires_at;
            RETURN res;
        ELSIF NOT r.expired AND r.completed THEN
            -- One statement (each costs, in every transaction).
            RETURN ROW('replay', r.token, r.response, r.response_status, NULL, r.expires_at, NULL)::idempotency.claim_result;
        ELSIF NOT r.expired AND NOT r.lease_over THEN
            res.outcome := 'in_progress';
            res.retry_after := r.retry_after;
            res.expires_at := r.expires_at;
            res.recovery_point := r.recovery_point;
            RETURN res;
        ELSE
            -- Expired (restart) or lease over (takeover): lock the newest version without
            -- waiting, and decide again on it.
            SELECT k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status AS completed,
                   k.request_hash, k.token, k.response, k.response_status, k.recovery_point, k.expires_at,
                   k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now() AS expired,
                   k.locked_until OPERATOR(pg_catalog.<=) pg_catalog.now() AS lease_over,
                   GREATEST(k.locked_until OPERATOR(pg_catalog.-) pg_catalog.now(), '1 second'::pg_catalog.interval) AS retry_after
              INTO r
              FROM idempotency.idempotency_keys AS k
             WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key
               FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                -- Still there: another claimer holds its row lock.
                v_busy := EXISTS (SELECT FROM idempotency.idempotency_keys AS k
                                   WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key);
            ELSIF r.expired THEN
                v_token := idempotency._p_token_above(p_key, r.token);
                UPDATE idempotency.idempotency_keys AS k SET
                       request_hash = p_hash, status = 'in_progress', token = v_token,
                       response = NULL, response_status = NULL, recovery_point = NULL,
                       created_at = pg_catalog.now(), completed_at = NULL,
                       locked_until = pg_catalog.now() OPERATOR(pg_catalog.+) p_lease,
                       expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, ttl = p_ttl
                 WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key
                   AND k.token OPERATOR(pg_catalog.<) v_token
                RETURNING k.token, k.expires_at, k.recovery_point INTO res.token, res.expires_at, res.recovery_point;
                IF FOUND THEN
                    res.outcome := 'new';
                    RETURN res;
                END IF;
            ELSIF (r.request_hash IS NULL OR p_hash IS NULL OR r.request_hash OPERATOR(pg_catalog.=) p_hash)
                  AND NOT r.completed AND r.lease_over THEN
                v_token := idempotency._p_token_above(p_key, r.token);
                UPDATE idempotency.idempotency_keys AS k SET
                       request_hash = COALESCE(k.request_hash, p_hash), token = v_token,
                       locked_until = pg_catalog.now() OPERATOR(pg_catalog.+) p_lease,
                       expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, ttl = p_ttl
                 WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key
                   AND k.token OPERATOR(pg_catalog.<) v_token
                RETURNING k.token, k.expires_at, k.recovery_point INTO res.token, res.expires_at, res.recovery_point;
                IF FOUND THEN
                    res.outcome := 'new';
                    RETURN res;
                END IF;
            END IF;
            -- Anything else: the row changed; read it again (answered in the next round).
        END IF;
        IF v_busy THEN
            v_wait := idempotency._p_setting('idempotency.claim_wait', 0, 'ms');
            v_started := COALESCE(v_started, pg_catalog.clock_timestamp());
            IF pg_catalog.clock_timestamp() OPERATOR(pg_catalog.>=)
               (v_started OPERATOR(pg_catalog.+) pg_catalog.make_interval(secs => GREATEST(v_wait, 0) OPERATOR(pg_catalog./) 1000.0)) THEN
                RETURN idempotency._p_busy();
            END IF;
            PERFORM pg_catalog.pg_sleep(0.005);
        ELSE
            v_rounds := v_rounds OPERATOR(pg_catalog.+) 1;
            IF v_rounds OPERATOR(pg_catalog.>=) 50 THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'serialization_failure',
                    MESSAGE = idempotency._canon_message(pg_catalog.format('idempotency.claim: key %s kept changing under concurrent claims',
                                                idempotency._p_key_label(p_key))),
                    HINT = 'retry the transaction';
            END IF;
        END IF;
    END LOOP;
END
$fn$;

-- claim, one step after the other (each check a function of its own): where claim's one-statement
-- path does not apply (a database that is not UTF-8).
CREATE FUNCTION idempotency._p_claim_checked(key text, request jsonb, scope text, ttl interval, lease interval)
RETURNS idempotency.claim_result
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_key text := idempotency._stored_key(_p_claim_checked.key, _p_claim_checked.scope);
    v_ttl interval;
    v_lease interval;
    v_hash bytea;
BEGIN
    SELECT d.ttl_value, d.lease_value INTO v_ttl, v_lease FROM idempotency._p_ttl_and_lease(_p_claim_checked.ttl, _p_claim_checked.lease) AS d;
    v_hash := idempotency._p_request_hash(_p_claim_checked.request, 'request');
    PERFORM idempotency._p_refuse_read_only('claim');
    RETURN idempotency._p_claim(_p_claim_checked.scope, v_key, v_hash, v_ttl, v_lease);
END
$fn$;


-- A stored key as messages name it: quoted, or (hashed) where the store keeps keys hashed.
CREATE FUNCTION idempotency._p_key_label(stored text)
RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN CASE WHEN EXISTS (SELECT FROM idempotency.config AS c
                              WHERE c.key_storage OPERATOR(pg_catalog.=) 'sha256')
                THEN '(hashed)' ELSE idempotency._p_debug(stored) END;
END
$fn$;

-- complete's work as the store's owner; the completing role (for the audit row) is passed by
-- _complete, which runs as the caller. One statement reads what the checks need (the store's
-- configuration, the session's row of idempotency.role_settings (the SET ROLE role's when it has
-- one, else the session user's), whether ALTER ROLE of the session user or ALTER DATABASE turned
-- audit on); _stored_key, _p_check_size, _p_refuse_read_only and _p_mark are
-- called only where one may fail or the database is not UTF-8 (their checks are made here the
-- same way: a change there changes this copy too); each statement and each nested call costs
-- more than the work of this path, run by every completion.
CREATE FUNCTION idempotency._p_complete(
    p_key text, p_response jsonb, p_status integer, p_scope text, p_token bigint, p_ttl interval, p_role name)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    c record;
    v_key text;
    v_expires_at timestamptz;
    v_hash bytea;
    v_token bigint;
    v_raw text;
    v_xact text;
    v_state text;
    v_count integer;
    v_lock bigint;
    v_set text;
    v_busy boolean;
    v_live boolean;
BEGIN
    -- The role the caller ran as, where the session may act as it (inside another SECURITY
    -- DEFINER function it may not: then, and for a role passed by anyone else, the session's
    -- login role, which the native edition names there too unless SET ROLE changed it).
    IF p_role IS NULL OR p_role OPERATOR(pg_catalog.<>) SESSION_USER
                         AND NOT pg_catalog.pg_has_role(SESSION_USER, p_role, 'MEMBER') THEN
        p_role := SESSION_USER;
    END IF;
    SELECT pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8'
           AND p_key IS NOT NULL AND p_key OPERATOR(pg_catalog.<>) '' AND pg_catalog.length(p_key) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           AND p_scope IS NOT NULL AND pg_catalog.length(p_scope) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           -- _p_scope_prefix
           AND pg_catalog.starts_with(p_scope, COALESCE(r.scope_prefix,
                   pg_catalog.current_setting('idempotency.scope_prefix', true), '')) AS ok,
           -- _stored_key's form of the key
           CASE WHEN x.key_storage IS NULL OR x.key_storage OPERATOR(pg_catalog.=) 'plain' THEN p_key
                WHEN x.key_secret IS NULL THEN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(p_key, 'UTF8')), 'hex')
           END AS stored,
           r.max_response_size,
           -- Whether the key has a live claim this call may complete, as last committed (the
           -- update's own test): only then is the key marked before the update (see below). A
           -- scalar subquery, not EXISTS, which the planner may turn into a hash of every key of
           -- the scope.
           COALESCE((SELECT true FROM idempotency.idempotency_keys AS k
                    WHERE k.scope OPERATOR(pg_catalog.=) p_scope
                      AND k.key OPERATOR(pg_catalog.=) CASE WHEN x.key_storage IS NULL OR x.key_storage OPERATOR(pg_catalog.=) 'plain' THEN p_key
                                                            WHEN x.key_secret IS NULL THEN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(p_key, 'UTF8')), 'hex')
                                                       END
                      AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
                      AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
                      AND (p_token IS NULL OR k.token OPERATOR(pg_catalog.=) p_token)), false) AS live,
           -- Whether the role is audited: its row, or idempotency.audit set on by ALTER ROLE or
           -- ALTER DATABASE (spelled as PostgreSQL spells on, without spaces)
           r.audit IS TRUE OR EXISTS (
               SELECT FROM pg_catalog.pg_db_role_setting AS s
                WHERE s.setdatabase OPERATOR(pg_catalog.=) ANY (ARRAY[(SELECT d.oid FROM pg_catalog.pg_database AS d
                                               WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()), 0]::pg_catalog.oid[])
                  AND s.setrole OPERATOR(pg_catalog.=) ANY (ARRAY[a.role, 0]::pg_catalog.oid[])
                  AND EXISTS (SELECT FROM pg_catalog.unnest(s.setconfig) AS e(entry)
                               WHERE pg_catalog.lower(pg_catalog.split_part(e.entry, '=', 1)) OPERATOR(pg_catalog.=) 'idempotency.audit'
                                 AND pg_catalog.lower(pg_catalog.substr(e.entry,
                                       pg_catalog.strpos(e.entry, '=') OPERATOR(pg_catalog.+) 1))
                                     OPERATOR(pg_catalog.=) ANY (ARRAY['on', 'true', 'tru', 'tr', 't', 'yes', 'ye', 'y', '1']))) AS audit
      INTO c
      FROM (SELECT pg_catalog.to_regrole(pg_catalog.quote_ident(SESSION_USER))::pg_catalog.oid AS role) AS a
      -- The SET ROLE role's row when it has one, else the session user's.
      LEFT JOIN idempotency.role_settings AS r ON r.role::pg_catalog.oid OPERATOR(pg_catalog.=) COALESCE(
                (SELECT s.role::pg_catalog.oid FROM idempotency.role_settings AS s
                  WHERE s.role::pg_catalog.oid OPERATOR(pg_catalog.=)
                        (SELECT b.oid FROM pg_catalog.pg_roles AS b
                          WHERE b.rolname OPERATOR(pg_catalog.=) pg_catalog.current_setting('role')::pg_catalog.name)),
                a.role)
      LEFT JOIN idempotency.config AS x ON true;
    IF c.ok AND c.stored IS NOT NULL THEN
        v_key := c.stored;
        v_live := c.live;
    ELSE
        v_key := idempotency._stored_key(p_key, p_scope);  -- raises, or the keyed hash or a key of a database that is not UTF-8
    END IF;
    IF p_status IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'response_status must not be NULL';
    ELSIF p_status OPERATOR(pg_catalog.<) 100 OR p_status OPERATOR(pg_catalog.>) 599 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('response_status must be between 100 and 599 (got %s)', p_status);
    END IF;
    IF p_ttl IS NOT NULL THEN
        PERFORM idempotency._p_duration('ttl', p_ttl);
    END IF;
    -- _p_check_size is called where the response may be too large (it raises): larger than the
    -- smallest limit there is (1 kB) while idempotency.max_response_size exists (set anywhere, by
    -- the session or an administrator), else larger than the default or the role's row allows.
    IF p_response IS NOT NULL AND pg_catalog.pg_column_size(p_response) OPERATOR(pg_catalog.>) 1024 THEN
        v_raw := pg_catalog.current_setting('idempotency.max_response_size', true);
        IF v_raw IS NOT NULL
           OR pg_catalog.pg_column_size(p_response)::bigint OPERATOR(pg_catalog.>)
              (LEAST(4096, c.max_response_size)::bigint OPERATOR(pg_catalog.*) 1024) THEN
            PERFORM idempotency._p_check_size('response', pg_catalog.pg_column_size(p_response)::bigint, 'response');
        END IF;
    END IF;
    IF pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on' THEN
        PERFORM idempotency._p_refuse_read_only('complete');  -- raises
    END IF;
    IF v_live IS NULL THEN
        -- (The key's stored form was not known to the first statement.)
        v_live := EXISTS (SELECT FROM idempotency.idempotency_keys AS k
                           WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) v_key
                             AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
                             AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
                             AND (p_token IS NULL OR k.token OPERATOR(pg_catalog.=) p_token));
    END IF;
    v_lock := pg_catalog.hashtextextended(pg_catalog.length(p_scope)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                                          OPERATOR(pg_catalog.||) p_scope OPERATOR(pg_catalog.||) v_key, 5432);
    v_busy := false;
    IF v_live THEN
        -- _p_mark(scope, key, true) (as the trigger would), then the update, which the trigger
        -- need not mark again.
        v_xact := pg_catalog.pg_current_xact_id()::pg_catalog.text;
        v_state := pg_catalog.current_setting('idempotency_portable.marks', true);
        v_count := CASE WHEN pg_catalog.split_part(v_state, ':', 1) OPERATOR(pg_catalog.=) v_xact
                        THEN pg_catalog.split_part(v_state, ':', 2)::pg_catalog.int4 ELSE 0 END;
        IF v_count OPERATOR(pg_catalog.<) @PORTABLE_MARKS_PER_TRANSACTION@ THEN
            IF pg_catalog.pg_try_advisory_xact_lock(v_lock) OR idempotency._p_lock_retry(v_lock) THEN
                v_set := pg_catalog.set_config('idempotency_portable.marks',
                                               v_xact OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) (v_count OPERATOR(pg_catalog.+) 1), false);
            ELSE
                -- Another open transaction marked the key: it is writing the key's row.
                v_busy := true;
            END IF;
        END IF;
        v_set := pg_catalog.set_config('idempotency_portable.marked', 'on', true);
    ELSE
        -- No live claim to complete: the call is refused (IK001..IK003) and changes no row, so
        -- it does not mark the key. A transaction's advisory lock is let go only when it ends,
        -- and while the refusal ran, claims of the key answered in_progress where, as natively,
        -- a completed key replays and an absent, expired or lease-over one is claimed. Only
        -- whether another open transaction marked the key is tested (a shared lock, released
        -- at once, as a claim tests it): one writing the row (a takeover, a forget) is waited
        -- for below. A live claim committed since the test is completed by the update all the
        -- same, and marked by the trigger.
        v_busy := NOT (pg_catalog.pg_try_advisory_lock_shared(v_lock) AND pg_catalog.pg_advisory_unlock_shared(v_lock));
    END IF;
    FOR v_try IN 1 .. 2 LOOP
        UPDATE idempotency.idempotency_keys AS k SET
               status = 'completed'::idempotency.key_status, response = p_response, response_status = p_status,
               completed_at = pg_catalog.now(), locked_until = NULL,
               expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) COALESCE(p_ttl, k.ttl),
               ttl = COALESCE(p_ttl, k.ttl)
         WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) v_key
           AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
           AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
           AND (p_token IS NULL OR k.token OPERATOR(pg_catalog.=) p_token)
        RETURNING k.expires_at, k.request_hash, k.token INTO v_expires_at, v_hash, v_token;
        -- Nothing to change in the row this statement saw, while another open transaction is
        -- writing it (a takeover of an expired claim, a forget): in READ COMMITTED, wait for that
        -- transaction, as the native edition does (not for one that only locks the row, nor in
        -- REPEATABLE READ, where the native edition answers from its snapshot at once), and try
        -- once more on what it left (a new statement sees it).
        EXIT WHEN v_token IS NOT NULL OR v_try OPERATOR(pg_catalog.=) 2 OR NOT v_busy
                  OR pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed';
        PERFORM FROM idempotency.idempotency_keys AS k
          WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) v_key
          FOR NO KEY UPDATE;
        EXIT WHEN NOT FOUND;
    END LOOP;
    v_set := pg_catalog.set_config('idempotency_portable.marked', 'off', true);
    IF v_token IS NULL THEN
        RETURN NULL;
    END IF;
    -- (A value of idempotency.audit that is not a Boolean is refused even where the role's row
    -- audits: natively its SET is.)
    -- ('off', the native edition's default where its library loads, and '' or nothing, unset,
    -- are off without the call.)
    -- An administrator's on is a floor: a session's off (SET, a startup option) does not undo
    -- the server's configuration (read only where the placeholder exists: else nothing set it).
    IF COALESCE(pg_catalog.current_setting('idempotency.audit', true), '') OPERATOR(pg_catalog.<>) ALL ('{"",off}'::pg_catalog.text[])
       AND idempotency._p_setting_on('idempotency.audit')
       OR c.audit
       OR pg_catalog.current_setting('idempotency.audit', true) IS NOT NULL
          AND idempotency._p_admin_on('idempotency.audit') THEN
        INSERT INTO idempotency.audit
               (scope, key, key_is_hash, request_hash, token, response_status, completed_at, completed_by)
        VALUES (p_scope, v_key, v_key OPERATOR(pg_catalog.<>) p_key, v_hash, v_token, p_status, pg_catalog.now(), p_role);
    END IF;
    RETURN v_expires_at;
END
$fn$;

-- The helpers are for the functions above (which run as the store's owner), not for callers;
-- _p_complete only checks the role it is given (complete's work runs through it as the owner).
DO $revoke$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::pg_catalog.regprocedure FROM pg_catalog.pg_proc AS p
              WHERE p.pronamespace OPERATOR(pg_catalog.=) 'idempotency'::pg_catalog.regnamespace
                AND p.proname OPERATOR(pg_catalog.~~) '\_p\_%'
                AND p.proname OPERATOR(pg_catalog.<>) '_p_complete' LOOP
        EXECUTE pg_catalog.format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$revoke$;

-- The LANGUAGE c functions of sql/idempotency.sql --------------------------------------------

-- One statement reads what a claim needs (the role's scope prefix, the store's configuration,
-- the key's row, the request's canonical form where it is an object of scalars), and the
-- common answers (replay, in_progress, new) are given from it: each statement and each nested
-- call costs more than the work of this path, run by every request. What _stored_key,
-- _p_ttl_and_lease, _p_request_hash, _p_refuse_read_only, _p_marked and _p_mark check is
-- checked here the same way (the expressions are theirs and _canon_text's: a change there
-- changes this copy too); their functions are called only where one may fail (they raise its
-- error). Everything else (a takeover, a restart, a mismatch, a busy key, a store with rules
-- or keyed hashes, a database that is not UTF-8) goes to _p_claim or _p_claim_checked, which
-- read again.
BODY idempotency.claim
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
-- One plan for the statement below whatever the arguments: a plan made for the arguments of
-- each call (PostgreSQL's choice where the store's tables were never analyzed) costs more
-- than the rest of the call.
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    c record;
    v_ttl interval;
    v_lease interval;
    v_hash bytea;
    v_xact text;
    v_state text;
    v_count integer;
    v_marked boolean;
    v_token bigint;
    v_expires_at timestamptz;
    v_set text;
    v_lock bigint;
BEGIN
    IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.<>) 'UTF8' THEN
        -- Keys, scopes and requests are checked as Unicode first (_canon_unicode).
        RETURN idempotency._p_claim_checked(claim.key, claim.request, claim.scope, claim.ttl, claim.lease);
    END IF;
    SELECT -- The checks of _canon_check_key and _p_check_scope (with _p_scope_prefix's prefix),
           -- and a store that keeps plain keys or unkeyed hashes.
           claim.key IS NOT NULL AND claim.key OPERATOR(pg_catalog.<>) '' AND pg_catalog.length(claim.key) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           AND claim.scope IS NOT NULL AND pg_catalog.length(claim.scope) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           AND pg_catalog.starts_with(claim.scope, COALESCE(p.scope_prefix,
                   pg_catalog.current_setting('idempotency.scope_prefix', true), ''))
           AND x.key_secret IS NULL AS ok,
           -- Neither ttl nor lease given nor set (or set to what the native edition shows for
           -- its defaults): one day and five minutes, which pass every check of _p_ttl_and_lease.
           -- (A default spelled otherwise, ' 1d' or '24h', takes _p_ttl_and_lease; so would every
           -- default if the core's constants changed and these spellings did not.)
           claim.ttl IS NULL AND claim.lease IS NULL
           AND COALESCE(pg_catalog.current_setting('idempotency.default_ttl', true), '')
               OPERATOR(pg_catalog.=) ANY ('{"",1d}'::pg_catalog.text[])
           AND COALESCE(pg_catalog.current_setting('idempotency.default_lease', true), '')
               OPERATOR(pg_catalog.=) ANY ('{"",5min}'::pg_catalog.text[]) AS defaults,
           k.stored, f.hash,
           r.key IS NOT NULL AS found, r.token, r.request_hash,
           -- Whether the row can be answered without a write (replay, in_progress): live, of
           -- the same request, and not in a read-only transaction. The answer itself, and the
           -- test of the key's mark, are written after the statement, where only the branch a
           -- call takes is prepared (each expression of a statement is prepared in every
           -- transaction, the branches of a CASE included).
           r.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
           AND (r.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status
                OR r.locked_until OPERATOR(pg_catalog.>) pg_catalog.now())
           AND (r.request_hash IS NULL OR claim.request IS NULL OR r.request_hash OPERATOR(pg_catalog.=) f.hash)
           AND pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'off' AS live,
           r.status, r.response, r.response_status, r.locked_until, r.expires_at, r.recovery_point
      INTO c
      FROM (SELECT) AS o
      LEFT JOIN idempotency.config AS x ON true
      -- _stored_key's form of the key
      CROSS JOIN LATERAL (SELECT CASE WHEN x.key_storage OPERATOR(pg_catalog.=) 'sha256'
                                      THEN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(claim.key, 'UTF8')), 'hex')
                                      ELSE claim.key END AS stored) AS k
      -- The SET ROLE role's row when it has one, else the session user's (_p_scope_prefix's).
      LEFT JOIN idempotency.role_settings AS p
             ON p.role::pg_catalog.oid OPERATOR(pg_catalog.=) COALESCE(
                (SELECT s.role::pg_catalog.oid FROM idempotency.role_settings AS s
                  WHERE s.role::pg_catalog.oid OPERATOR(pg_catalog.=)
                        (SELECT b.oid FROM pg_catalog.pg_roles AS b
                          WHERE b.rolname OPERATOR(pg_catalog.=) pg_catalog.current_setting('role')::pg_catalog.name)),
                pg_catalog.to_regrole(pg_catalog.quote_ident(SESSION_USER))::pg_catalog.oid)
      -- The key's row through its index, whatever the estimates of the joins (the key's form
      -- from an init plan: a parameter of the index scan, not a join clause).
      LEFT JOIN idempotency.idempotency_keys AS r
             ON r.scope OPERATOR(pg_catalog.=) claim.scope
            AND r.key OPERATOR(pg_catalog.=) CASE WHEN (SELECT y.key_storage FROM idempotency.config AS y) OPERATOR(pg_catalog.=) 'sha256'
                                                  THEN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(claim.key, 'UTF8')), 'hex')
                                                  ELSE claim.key END
      -- The SHA-256 of _canon_text's form of an object of scalars, in exact mode (NULL: another
      -- document, or none, or {}). Members are in UTF-16 order where no character of
      -- U+E000..U+FFFF (which UTF-16 puts after the characters above U+FFFF) is written: one
      -- regular expression on the text (a string value with one takes the general path too,
      -- which gives the same bytes), where a jsonpath test of each member name cost more than
      -- the whole aggregate. The aggregate is written twice and computed once (a subquery that
      -- names it once adds a plan node, which costs more).
      CROSS JOIN (SELECT CASE WHEN pg_catalog.string_agg(
                             pg_catalog.to_json(e.key)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                             OPERATOR(pg_catalog.||) CASE WHEN pg_catalog.jsonb_typeof(e.value) OPERATOR(pg_catalog.=) 'number'
                                                               AND pg_catalog.strpos(e.value::pg_catalog.text, '.') OPERATOR(pg_catalog.>) 0
                                                          THEN pg_catalog.rtrim(pg_catalog.rtrim(e.value::pg_catalog.text, '0'), '.')
                                                          ELSE e.value::pg_catalog.text END, ','
                             ORDER BY e.key COLLATE pg_catalog."C") COLLATE pg_catalog."C"
                                   OPERATOR(pg_catalog.!~) ('[' OPERATOR(pg_catalog.||) pg_catalog.chr(57344) OPERATOR(pg_catalog.||) '-'
                                                            OPERATOR(pg_catalog.||) pg_catalog.chr(65535) OPERATOR(pg_catalog.||) ']')
                         THEN pg_catalog.sha256(pg_catalog.convert_to('{' OPERATOR(pg_catalog.||) pg_catalog.string_agg(
                             pg_catalog.to_json(e.key)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                             OPERATOR(pg_catalog.||) CASE WHEN pg_catalog.jsonb_typeof(e.value) OPERATOR(pg_catalog.=) 'number'
                                                               AND pg_catalog.strpos(e.value::pg_catalog.text, '.') OPERATOR(pg_catalog.>) 0
                                                          THEN pg_catalog.rtrim(pg_catalog.rtrim(e.value::pg_catalog.text, '0'), '.')
                                                          ELSE e.value::pg_catalog.text END, ','
                             ORDER BY e.key COLLATE pg_catalog."C")
                                                                      OPERATOR(pg_catalog.||) '}', 'UTF8')) END AS hash
                    FROM pg_catalog.jsonb_each(CASE WHEN pg_catalog.jsonb_typeof(claim.request) OPERATOR(pg_catalog.=) 'object'
                                                     AND NOT pg_catalog.jsonb_path_exists(claim.request,
               'strict $ ? (exists (@.* ? (@.type() == "object" || @.type() == "array" || (@.type() == "number" && (@ >= 1e21 || @ <= -1e21 || (@.floor() != @ && @ > -0.000001 && @ < 0.000001))))))')
                                                    THEN claim.request END) AS e) AS f;
    -- The key's lock number (its mark).
    v_lock := pg_catalog.hashtextextended(pg_catalog.length(claim.scope)::pg_catalog.text
                                          OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) claim.scope
                                          OPERATOR(pg_catalog.||) c.stored, 5432);
    -- The answer without a write, given where nothing may fail before it (ok and defaults) and
    -- the key is not marked by another open transaction (_p_marked).
    IF c.ok AND c.defaults AND c.live
       AND pg_catalog.pg_try_advisory_lock_shared(v_lock) AND pg_catalog.pg_advisory_unlock_shared(v_lock) THEN
        IF c.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status THEN
            RETURN ROW('replay', c.token, c.response, c.response_status, NULL, c.expires_at, NULL)::idempotency.claim_result;
        END IF;
        RETURN ROW('in_progress', NULL, NULL, NULL,
                   GREATEST(c.locked_until OPERATOR(pg_catalog.-) pg_catalog.now(), '1 second'::pg_catalog.interval),
                   c.expires_at, c.recovery_point)::idempotency.claim_result;
    END IF;
    IF NOT c.ok THEN
        -- A check fails (raised there), or the store keeps keyed hashes.
        RETURN idempotency._p_claim_checked(claim.key, claim.request, claim.scope, claim.ttl, claim.lease);
    END IF;
    IF c.defaults THEN
        v_ttl := '@DEFAULT_TTL_SECS@ seconds'::pg_catalog.interval;
        v_lease := '@DEFAULT_LEASE_SECS@ seconds'::pg_catalog.interval;
    ELSE
        SELECT d.ttl_value, d.lease_value INTO v_ttl, v_lease FROM idempotency._p_ttl_and_lease(claim.ttl, claim.lease) AS d;
    END IF;
    v_hash := c.hash;
    IF v_hash IS NULL AND claim.request IS NOT NULL THEN
        v_hash := pg_catalog.sha256(pg_catalog.convert_to(idempotency._canon_text(claim.request, true, 'request'), 'UTF8'));
    END IF;
    IF pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on' THEN
        PERFORM idempotency._p_refuse_read_only('claim');  -- raises
    END IF;
    IF c.found THEN
        -- Answered by _p_claim: a mismatch, a takeover, a restart, a key another open
        -- transaction marked, or a request whose hash was not known in the statement above.
        NULL;
    ELSIF NOT EXISTS (SELECT FROM pg_catalog.pg_rewrite AS w
                       WHERE w.ev_class OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
        -- _p_mark(scope, key, false), then the insert, which the trigger need not mark again
        -- (a store with rules refuses ON CONFLICT: _p_claim inserts there).
        v_xact := pg_catalog.pg_current_xact_id()::pg_catalog.text;
        v_state := pg_catalog.current_setting('idempotency_portable.marks', true);
        v_count := CASE WHEN pg_catalog.split_part(v_state, ':', 1) OPERATOR(pg_catalog.=) v_xact
                        THEN pg_catalog.split_part(v_state, ':', 2)::pg_catalog.int4 ELSE 0 END;
        IF v_count OPERATOR(pg_catalog.<) @PORTABLE_MARKS_PER_TRANSACTION@ THEN
            v_marked := pg_catalog.pg_try_advisory_xact_lock(v_lock);
            IF v_marked THEN
                v_set := pg_catalog.set_config('idempotency_portable.marks',
                                               v_xact OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) (v_count OPERATOR(pg_catalog.+) 1), false);
            END IF;
        ELSE
            -- Not marked (the transaction's first @PORTABLE_MARKS_PER_TRANSACTION@ keys are): _p_claim inserts it without
            -- waiting for another transaction's unmarked row (see _p_mark).
            v_marked := false;
        END IF;
        IF v_marked THEN
            v_set := pg_catalog.set_config('idempotency_portable.marked', 'on', true);
            INSERT INTO idempotency.idempotency_keys AS k
                   (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl)
            VALUES (claim.scope, c.stored, v_hash, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(),
                    pg_catalog.now() OPERATOR(pg_catalog.+) v_lease, pg_catalog.now() OPERATOR(pg_catalog.+) v_ttl, v_ttl)
            ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING  -- (scope, key): names of claim's arguments
            RETURNING k.token, k.expires_at INTO v_token, v_expires_at;
            v_set := pg_catalog.set_config('idempotency_portable.marked', 'off', true);
            IF v_token IS NOT NULL THEN
                RETURN ROW('new', v_token, NULL, NULL, NULL, v_expires_at, NULL)::idempotency.claim_result;
            END IF;
        END IF;
    END IF;
    RETURN idempotency._p_claim(claim.scope, c.stored, v_hash, v_ttl, v_lease);
END
$fn$;

BODY idempotency._stored_key
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    c record;
BEGIN
    -- The checks of _canon_unicode, _canon_check_key and _p_check_scope tested in the statement
    -- that reads the store's configuration and the scope prefix (the expression of
    -- _p_scope_prefix, which must stay the same: a change there changes this copy too); their
    -- functions are called
    -- only where one may fail (they raise its error) or the database is not UTF-8 (each
    -- statement, and each nested call, costs more than the checks on this path, run by every
    -- claim and completion, in every transaction).
    SELECT pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8'
           AND key IS NOT NULL AND key OPERATOR(pg_catalog.<>) '' AND pg_catalog.length(key) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           AND scope IS NOT NULL AND pg_catalog.length(scope) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           AND pg_catalog.starts_with(scope, COALESCE(
                   (SELECT r.scope_prefix FROM idempotency.role_settings AS r
                     WHERE r.role::pg_catalog.oid OPERATOR(pg_catalog.=) COALESCE(
                           (SELECT s.role::pg_catalog.oid FROM idempotency.role_settings AS s
                             WHERE s.role::pg_catalog.oid OPERATOR(pg_catalog.=)
                                   (SELECT b.oid FROM pg_catalog.pg_roles AS b
                                     WHERE b.rolname OPERATOR(pg_catalog.=) pg_catalog.current_setting('role')::pg_catalog.name)),
                           (SELECT a.oid FROM pg_catalog.pg_roles AS a WHERE a.rolname OPERATOR(pg_catalog.=) SESSION_USER))),
                   pg_catalog.current_setting('idempotency.scope_prefix', true), '')) AS ok,
           x.key_storage, x.key_secret
      INTO c
      FROM (SELECT) AS one LEFT JOIN idempotency.config AS x ON true;
    IF c.ok IS NOT TRUE THEN
        IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.<>) 'UTF8' THEN
            PERFORM idempotency._canon_unicode(key, 'key');
            PERFORM idempotency._canon_unicode(scope, 'scope');
        END IF;
        PERFORM idempotency._canon_check_key('key', key, false);
        PERFORM idempotency._p_check_scope(scope);
    END IF;
    IF c.key_storage IS NULL OR c.key_storage OPERATOR(pg_catalog.=) 'plain' THEN
        RETURN key;
    ELSIF c.key_secret IS NULL THEN
        RETURN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(key, 'UTF8')), 'hex');
    END IF;
    RETURN pg_catalog.encode(idempotency._p_hmac(c.key_secret, pg_catalog.sha256(pg_catalog.convert_to(key, 'UTF8'))), 'hex');
END
$fn$;

-- Counts nothing: the counters of the native edition live in shared memory (stats shows NULL).
BODY idempotency._count
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF event IS DISTINCT FROM 'release' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = idempotency._canon_message(pg_catalog.format('event must be ''release'' (got %s)',
                                                                   idempotency._canon_quote(COALESCE(event, 'NULL'))));
    END IF;
END
$fn$;

BODY idempotency._check_recovery_point
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF recovery_point IS NOT NULL THEN
        PERFORM idempotency._p_check_size('recovery_point',
            pg_catalog.octet_length(recovery_point)::bigint OPERATOR(pg_catalog.+) 4, 'recovery_point');
    END IF;
END
$fn$;

-- Runs as the caller (the audit row names the completing role: CURRENT_USER here), the work as
-- the owner. A single-expression SQL function without SET search_path (every name in it is
-- schema-qualified), so the planner inlines it into complete's expression, itself inlined into
-- the caller's statement: a call of a PL/pgSQL function fewer on the path of every completion.
BODY idempotency._complete
LANGUAGE sql
AS $fn$
    SELECT idempotency._p_complete($1, $2, $3, $4, $5, $6, CURRENT_USER)
$fn$;

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

BODY idempotency._rekey
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF digest IS NULL OR pg_catalog.length(digest) OPERATOR(pg_catalog.<>) 32 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'digest must be a 32-byte SHA-256';
    END IF;
    PERFORM idempotency._p_check_secret(secret);
    RETURN pg_catalog.encode(idempotency._p_hmac(secret, digest), 'hex');
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

BODY idempotency._sign
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM idempotency._canon_unicode(key, 'key');
    PERFORM idempotency._canon_check_key('key', key, false);
    IF kid IS NULL OR kid OPERATOR(pg_catalog.<=) 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'kid must be a positive integer';
    END IF;
    PERFORM idempotency._p_check_secret(secret);
    RETURN key OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||) kid OPERATOR(pg_catalog.||) '.'
           OPERATOR(pg_catalog.||) idempotency._p_b64url(idempotency._p_hmac(secret, idempotency._p_signed_message(kid, key)));
END
$fn$;

BODY idempotency._signed_kid
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT p.kid FROM idempotency._p_parse_signed(signed) AS p
$fn$;

BODY idempotency._verify
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p record;
BEGIN
    PERFORM idempotency._p_check_secret(secret);
    SELECT * INTO p FROM idempotency._p_parse_signed(signed);
    IF p.key IS NULL THEN
        RETURN NULL;
    END IF;
    IF idempotency._p_hmac(secret, idempotency._p_signed_message(p.kid, p.key)) OPERATOR(pg_catalog.=) p.signature THEN
        RETURN p.key;
    END IF;
    RETURN NULL;
END
$fn$;

-- 32 bytes from the server's strong random source (gen_random_uuid, in core since PostgreSQL
-- 13: 122 random bits each), so a secret never appears in any SQL text or log.
BODY idempotency._random_secret
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT pg_catalog.sha256(pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
                             OPERATOR(pg_catalog.||) pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
                             OPERATOR(pg_catalog.||) pg_catalog.uuid_send(pg_catalog.gen_random_uuid()))
$fn$;

-- No background sweeper in this edition (see idempotency.schedule_sweep).
BODY idempotency._sweeper_preloaded
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT false
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

-- No background sweeper to tell.
BODY idempotency._announce
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
END
$fn$;

BODY idempotency.claim_many
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_variable
DECLARE
    n integer;
    v_stored text[] := '{}';
    v_hashes bytea[] := '{}';
    v_key text;
    v_ttl interval;
    v_lease interval;
    res idempotency.claim_result;
BEGIN
    IF claim_many.keys IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'keys must not be NULL';
    END IF;
    IF pg_catalog.array_ndims(claim_many.keys) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'array_subscript_error',
            MESSAGE = pg_catalog.format('keys must be a one-dimensional array (got %s dimensions)', pg_catalog.array_ndims(claim_many.keys));
    END IF;
    n := pg_catalog.cardinality(claim_many.keys);
    IF pg_catalog.array_ndims(claim_many.requests) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'array_subscript_error',
            MESSAGE = pg_catalog.format('requests must be a one-dimensional array (got %s dimensions)', pg_catalog.array_ndims(claim_many.requests));
    END IF;
    IF claim_many.requests IS NOT NULL AND pg_catalog.cardinality(claim_many.requests) OPERATOR(pg_catalog.<>) n THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = pg_catalog.format(
            'requests must have one element per key: it has %s, keys has %s', pg_catalog.cardinality(claim_many.requests), n);
    END IF;
    PERFORM idempotency._canon_unicode(claim_many.scope, 'scope');
    PERFORM idempotency._p_check_scope(claim_many.scope);
    FOR i IN 1 .. n LOOP
        v_key := claim_many.keys[pg_catalog.array_lower(claim_many.keys, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1];
        PERFORM idempotency._canon_unicode(v_key, 'keys');
        PERFORM idempotency._canon_check_key('keys[' OPERATOR(pg_catalog.||) i OPERATOR(pg_catalog.||) ']', v_key, false);
        v_stored := v_stored OPERATOR(pg_catalog.||) idempotency._stored_key(v_key, claim_many.scope);
    END LOOP;
    SELECT d.ttl_value, d.lease_value INTO v_ttl, v_lease FROM idempotency._p_ttl_and_lease(claim_many.ttl, claim_many.lease) AS d;
    FOR i IN 1 .. n LOOP
        v_hashes := v_hashes OPERATOR(pg_catalog.||) idempotency._p_request_hash(
            claim_many.requests[pg_catalog.array_lower(claim_many.requests, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1], 'requests');
    END LOOP;
    PERFORM idempotency._p_refuse_read_only('claim_many');
    FOR i IN 1 .. n LOOP
        res := idempotency._p_claim(claim_many.scope, v_stored[i], v_hashes[i], v_ttl, v_lease);
        ord := i;
        key := claim_many.keys[pg_catalog.array_lower(claim_many.keys, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1];
        outcome := res.outcome;
        token := res.token;
        response := res.response;
        response_status := res.response_status;
        retry_after := res.retry_after;
        expires_at := res.expires_at;
        recovery_point := res.recovery_point;
        RETURN NEXT;
    END LOOP;
END
$fn$;

-- No session caches role_settings in this edition: every call reads the role's row.
BODY idempotency._role_settings_changed
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN NULL;
END
$fn$;
