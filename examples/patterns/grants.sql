-- The privileges an application role (here: app) needs to call the pattern examples. This is
-- the only place the examples grant anything; tests/integration/test_patterns.py runs every
-- pattern as this role.

-- The extension: one grant (README "Privileges and tenants"); its functions do the rest.
GRANT USAGE ON SCHEMA idempotency TO app;

-- The examples' own tables (their functions run with the caller's privileges).
GRANT USAGE ON SCHEMA payments, webhooks, queue, workflow, cronjobs TO app;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA payments, webhooks, queue, workflow, cronjobs TO app;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA payments, webhooks, queue, workflow, cronjobs TO app;
