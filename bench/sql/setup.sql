-- Benchmark fixtures: the floor table, the PL/pgSQL reference implementation and the PL/pgSQL
-- canonicalizer. Run once per benchmark cluster after CREATE EXTENSION idempotency.
CREATE SCHEMA bench;

-- 1. The floor: the same table shape, written with bare statements.
CREATE TABLE bench.floor (LIKE idempotency.idempotency_keys INCLUDING ALL);

-- 2. The reference: what a careful user would write by hand in PL/pgSQL (brandur's design:
--    a unique key, INSERT ... ON CONFLICT, a lease, a request check), with the same outcomes.
CREATE TABLE bench.ref_keys (LIKE idempotency.idempotency_keys INCLUDING ALL);
CREATE SEQUENCE bench.ref_token;

CREATE FUNCTION bench.ref_claim(p_key text, p_request jsonb, p_scope text DEFAULT '',
                                p_ttl interval DEFAULT '24 hours', p_lease interval DEFAULT '5 minutes')
RETURNS TABLE (outcome text, token bigint, response jsonb, response_status int)
LANGUAGE plpgsql AS $$
DECLARE
    h bytea := sha256(convert_to(p_request::text, 'UTF8'));
    r bench.ref_keys;
    t bigint;
BEGIN
    INSERT INTO bench.ref_keys AS k (scope, key, request_hash, status, token, locked_until, expires_at, ttl)
    VALUES (p_scope, p_key, h, 'in_progress', nextval('bench.ref_token'), now() + p_lease, now() + p_ttl, p_ttl)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING k.token INTO t;
    IF FOUND THEN
        RETURN QUERY SELECT 'new', t, NULL::jsonb, NULL::int;
        RETURN;
    END IF;
    SELECT * INTO r FROM bench.ref_keys k WHERE k.scope = p_scope AND k.key = p_key FOR UPDATE;
    IF r.expires_at <= now() THEN
        UPDATE bench.ref_keys k SET request_hash = h, status = 'in_progress', token = nextval('bench.ref_token'),
               response = NULL, response_status = NULL, locked_until = now() + p_lease, expires_at = now() + p_ttl
         WHERE k.scope = p_scope AND k.key = p_key RETURNING k.token INTO t;
        RETURN QUERY SELECT 'new', t, NULL::jsonb, NULL::int;
    ELSIF r.request_hash <> h THEN
        RETURN QUERY SELECT 'mismatch', NULL::bigint, NULL::jsonb, NULL::int;
    ELSIF r.status = 'completed' THEN
        RETURN QUERY SELECT 'replay', r.token, r.response, r.response_status;
    ELSIF r.locked_until <= now() THEN
        UPDATE bench.ref_keys k SET token = nextval('bench.ref_token'), locked_until = now() + p_lease
         WHERE k.scope = p_scope AND k.key = p_key RETURNING k.token INTO t;
        RETURN QUERY SELECT 'new', t, NULL::jsonb, NULL::int;
    ELSE
        RETURN QUERY SELECT 'in_progress', NULL::bigint, NULL::jsonb, NULL::int;
    END IF;
END $$;

CREATE FUNCTION bench.ref_complete(p_key text, p_response jsonb, p_status int DEFAULT 200, p_scope text DEFAULT '')
RETURNS timestamptz LANGUAGE plpgsql AS $$
DECLARE e timestamptz;
BEGIN
    UPDATE bench.ref_keys k SET status = 'completed', response = p_response, response_status = p_status,
           completed_at = now(), locked_until = NULL, expires_at = now() + k.ttl
     WHERE k.scope = p_scope AND k.key = p_key AND k.status = 'in_progress'
    RETURNING k.expires_at INTO e;
    IF NOT FOUND THEN RAISE EXCEPTION 'no claim'; END IF;
    RETURN e;
END $$;

-- 7. A PL/pgSQL canonicalizer (sorted keys, no whitespace; numbers as jsonb prints them).
CREATE FUNCTION bench.plpgsql_canonical(doc jsonb) RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    CASE jsonb_typeof(doc)
    WHEN 'object' THEN
        RETURN '{' || coalesce((SELECT string_agg(to_jsonb(e.key)::text || ':' || bench.plpgsql_canonical(e.value), ','
                                                  ORDER BY e.key COLLATE "C")
                                  FROM jsonb_each(doc) e), '') || '}';
    WHEN 'array' THEN
        RETURN '[' || coalesce((SELECT string_agg(bench.plpgsql_canonical(a.v), ',' ORDER BY a.n)
                                  FROM jsonb_array_elements(doc) WITH ORDINALITY a(v, n)), '') || ']';
    ELSE
        RETURN doc::text;
    END CASE;
END $$;

CREATE TABLE bench.docs (size text, doc jsonb);

-- Batch floor (claim_many's comparison): the store's shape and two indexes.
CREATE TABLE bench.floor_batch (LIKE idempotency.idempotency_keys INCLUDING ALL);

-- The floor tables take the store's storage parameters (its fill factor), which LIKE does not
-- copy: the same table, its pages filled the same way.
DO $$
DECLARE
    v_options text := (SELECT array_to_string(reloptions, ', ') FROM pg_class
                        WHERE oid = 'idempotency.idempotency_keys'::regclass);
BEGIN
    IF v_options IS NOT NULL THEN
        EXECUTE format('ALTER TABLE bench.floor SET (%s)', v_options);
        EXECUTE format('ALTER TABLE bench.ref_keys SET (%s)', v_options);
        EXECUTE format('ALTER TABLE bench.floor_batch SET (%s)', v_options);
    END IF;
END
$$;
