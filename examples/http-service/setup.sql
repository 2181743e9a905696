-- Schema, tables and the application role of the example HTTP service (examples/http-service).
-- Run once per database as a superuser (psql -v ON_ERROR_STOP=1 -f setup.sql); safe to run again.
-- Every privilege the service needs is granted in this one file.

CREATE EXTENSION IF NOT EXISTS idempotency;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'http_example_app') THEN
        CREATE ROLE http_example_app LOGIN;   -- set a password (or use peer/cert auth) in production
    END IF;
END $$;

CREATE SCHEMA IF NOT EXISTS http_example;

CREATE TABLE IF NOT EXISTS http_example.orders (
    id         bigserial PRIMARY KEY,
    client_id  text NOT NULL,
    items      jsonb NOT NULL,
    amount     numeric NOT NULL CHECK (amount > 0),
    currency   text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS http_example.refunds (
    id                 bigserial PRIMARY KEY,
    order_id           bigint NOT NULL REFERENCES http_example.orders,
    client_id          text NOT NULL,
    amount             numeric NOT NULL CHECK (amount > 0),
    currency           text NOT NULL,
    provider_key       text NOT NULL UNIQUE,   -- the derived key the payment service saw
    provider_refund_id text NOT NULL,
    created_at         timestamptz NOT NULL DEFAULT now()
);

-- The grants, all of them. The application role owns nothing and cannot change the schema.
GRANT USAGE ON SCHEMA http_example TO http_example_app;
GRANT SELECT, INSERT ON http_example.orders, http_example.refunds TO http_example_app;
GRANT USAGE ON SEQUENCE http_example.orders_id_seq, http_example.refunds_id_seq TO http_example_app;
-- The extension: one grant (README "Privileges and tenants"); its functions do the rest.
GRANT USAGE ON SCHEMA idempotency TO http_example_app;
