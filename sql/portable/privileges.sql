-- Portable edition: privileges of the helpers.
--
-- Last: every helper exists by now.
--
-- Part of the store in SQL and PL/pgSQL: sql/portable/README.md says how the files fit together.

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
