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
