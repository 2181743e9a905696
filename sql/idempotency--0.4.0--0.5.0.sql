-- idempotency 0.4.0 -> 0.5.0 (see CHANGELOG.md)
--
-- Every object is left as a fresh 0.5.0 install creates it (tests/integration/test_upgrade.py
-- compares the two catalogs).

\echo Use "ALTER EXTENSION idempotency UPDATE TO '0.5.0'" to load this file. \quit

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
