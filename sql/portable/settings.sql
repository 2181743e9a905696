-- Portable edition: settings and what binds a role.
--
-- The native library defines idempotency.* as settings; without it they are placeholders that hold
-- text, read here with current_setting(name, true), with the native defaults and units. What binds
-- a role comes from idempotency.role_settings (the row of the role the session switched to with
-- SET ROLE when it has one, else the session user's), which the role can neither read nor change,
-- exactly as the native edition reads it. Inside the SECURITY DEFINER functions CURRENT_USER is
-- the owner; the setting role still names the role SET ROLE set ('none' when the session did not
-- switch, switched back, or ran SET SESSION AUTHORIZATION), looked up by name in pg_roles. Size
-- limits and audit are floors: a session lowers a limit or turns audit on, never the reverse.
--
-- Part of the store in SQL and PL/pgSQL: sql/portable/README.md says how the files fit together.

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
    -- The session's row (the SET ROLE role's when it has one, else the session user's).
    SELECT CASE WHEN what OPERATOR(pg_catalog.=) 'response' THEN r.max_response_size
                ELSE r.max_recovery_point_size END
      INTO v_bound FROM idempotency.role_settings AS r
     WHERE r.role::pg_catalog.oid OPERATOR(pg_catalog.=) COALESCE(
           (SELECT s.role::pg_catalog.oid FROM idempotency.role_settings AS s
             WHERE s.role::pg_catalog.oid OPERATOR(pg_catalog.=)
                   (SELECT b.oid FROM pg_catalog.pg_roles AS b
                     WHERE b.rolname OPERATOR(pg_catalog.=) pg_catalog.current_setting('role')::pg_catalog.name)),
           (SELECT a.oid FROM pg_catalog.pg_roles AS a WHERE a.rolname OPERATOR(pg_catalog.=) SESSION_USER));
    IF what OPERATOR(pg_catalog.=) 'response' THEN
        setting := 'idempotency.max_response_size';
        v_default := 4096;
    ELSE
        setting := 'idempotency.max_recovery_point_size';
        v_default := 64;
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

-- No session caches role_settings in this edition: every call reads the role's row.
BODY idempotency._role_settings_changed
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN NULL;
END
$fn$;
