-- idempotency: the store, its types and the SQL API.
--
-- Hand-written and pulled into the extension script by extension_sql_file! in src/lib.rs.
-- Functions written in Rust are declared here as LANGUAGE c with their V1 symbols (src/api.rs);
-- complete, checkpoint, release, forget and lookup are PL/pgSQL so that they can raise the
-- extension's own SQLSTATEs (IK001..IK003), which pgrx cannot raise from Rust.
-- Every function pins search_path and every reference is schema-qualified.
--
-- Privileges: the functions that read or write the store run as the extension's owner
-- (SECURITY DEFINER), so an application role needs only USAGE on the schema and can change
-- rows only through the functions; it gets no privilege on any table. The administrative
-- functions (set_key_storage, rotate_signing_secret, retire_signing_secret) are for
-- superusers only. A scope prefix per login role (idempotency.role_settings, kept by the
-- extension's owner) keeps tenants apart.
-- A monitoring role is granted schema idempotency_monitor instead: the counters, nothing else.

-- Encodings: keys, scopes and documents are hashed as Unicode, converted from the database
-- encoding. SQL_ASCII has no defined characters (any byte is taken as it comes), so no
-- conversion exists: refuse it here, clearly, rather than hash bytes whose meaning is unknown.
-- MULE_INTERNAL has characters, but PostgreSQL has no conversion between it and UTF-8.
-- The library refuses both at call time too (an extension created before this check).
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

CREATE TYPE idempotency.key_status AS ENUM ('in_progress', 'completed');
CREATE TYPE idempotency.outcome AS ENUM ('new', 'replay', 'in_progress', 'mismatch');

-- Fencing tokens come from one sequence, so a token is never reused, not even after a key was
-- released or forgotten and claimed again. (On Citus one per node, each handing out its own
-- class of tokens: distribute().)
CREATE SEQUENCE idempotency.token_seq AS bigint;

CREATE TABLE idempotency.idempotency_keys (
    scope           text COLLATE "C" NOT NULL DEFAULT '',
    key             text COLLATE "C" NOT NULL,
    request_hash    bytea,
    status          idempotency.key_status NOT NULL,
    token           bigint NOT NULL,
    response        jsonb,
    response_status integer,
    recovery_point  text,
    created_at      timestamptz NOT NULL DEFAULT pg_catalog.now(),
    completed_at    timestamptz,
    locked_until    timestamptz,
    expires_at      timestamptz NOT NULL,
    -- the TTL the claim asked for: complete(ttl => NULL) keeps the result this long
    ttl             interval NOT NULL,
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (scope, key),
    CONSTRAINT idempotency_keys_request_hash_check
        CHECK (request_hash IS NULL OR pg_catalog.length(request_hash) OPERATOR(pg_catalog.=) 32),
    CONSTRAINT idempotency_keys_response_status_check
        CHECK (response_status IS NULL OR response_status OPERATOR(pg_catalog.>=) 100
               AND response_status OPERATOR(pg_catalog.<=) 599),
    CONSTRAINT idempotency_keys_lease_check
        CHECK ((status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status) = (locked_until IS NOT NULL))
) WITH (fillfactor = 25);
-- fillfactor 25: a page takes claims until a quarter of it is full; the rest is the room their
-- completions (each with its response, next to the claim until pruning frees the claim) need to
-- stay HOT updates when many claims are in flight, up to responses of about 400 bytes (larger
-- ones are TOASTed out of the row). docs/architecture.md#fill-factor.

COMMENT ON TABLE idempotency.idempotency_keys IS
    'One row per claimed idempotency key; rows past expires_at count as absent and are swept.';

-- The sweeper finds expired rows through this index, on the expiry the claim set (in UTC):
-- created_at + ttl, never later than expires_at (docs/architecture.md#the-sweep-index). Not on
-- expires_at, which complete moves: an update that changes no indexed column is HOT, so a
-- completion in a later transaction than its claim adds no index entries.
CREATE INDEX idempotency_keys_sweep_idx ON idempotency.idempotency_keys
    (((created_at AT TIME ZONE 'UTC') OPERATOR(pg_catalog.+) ttl));

-- With idempotency.partitions set to N > 0 for this CREATE EXTENSION (SET by a superuser), the
-- store is hash-partitioned by scope: the same columns, defaults, constraints and indexes (under
-- the same names) on the partitioned table, in N partitions idempotency_keys_p0 .. p<N-1>, which
-- pg_dump keeps the rows of as well. Claims go through SQL, sweeps run partition by partition
-- (docs/scaling.md). 0 (the default): the plain table above.
DO $partition$
DECLARE
    v_parts integer := NULLIF(pg_catalog.current_setting('idempotency.partitions', true), '')::integer;
    v_index record;
    v_part text;
BEGIN
    IF v_parts IS NULL OR v_parts OPERATOR(pg_catalog.=) 0 THEN
        RETURN;
    END IF;
    IF v_parts OPERATOR(pg_catalog.<) 0 OR v_parts OPERATOR(pg_catalog.>) 1024 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('idempotency.partitions must be between 0 and 1024, not %s', v_parts);
    END IF;
    ALTER TABLE idempotency.idempotency_keys RENAME TO idempotency_keys_template;
    FOR v_index IN SELECT c.relname FROM pg_catalog.pg_index AS i
                     JOIN pg_catalog.pg_class AS c ON c.oid OPERATOR(pg_catalog.=) i.indexrelid
                    WHERE i.indrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys_template'::pg_catalog.regclass LOOP
        EXECUTE pg_catalog.format('ALTER INDEX idempotency.%I RENAME TO %I', v_index.relname, v_index.relname OPERATOR(pg_catalog.||) '_template');
    END LOOP;
    -- The indexes get their default names again (idempotency_keys_pkey); the sweep index, an
    -- expression index, is given its name back.
    CREATE TABLE idempotency.idempotency_keys (LIKE idempotency.idempotency_keys_template INCLUDING ALL)
        PARTITION BY HASH (scope);
    FOR v_index IN SELECT c.relname FROM pg_catalog.pg_index AS i
                     JOIN pg_catalog.pg_class AS c ON c.oid OPERATOR(pg_catalog.=) i.indexrelid
                    WHERE i.indrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
                      AND i.indexprs IS NOT NULL LOOP
        EXECUTE pg_catalog.format('ALTER INDEX idempotency.%I RENAME TO idempotency_keys_sweep_idx', v_index.relname);
    END LOOP;
    FOR i IN 0 .. v_parts OPERATOR(pg_catalog.-) 1 LOOP
        v_part := 'idempotency_keys_p' OPERATOR(pg_catalog.||) i;
        EXECUTE pg_catalog.format(
            'CREATE TABLE idempotency.%I PARTITION OF idempotency.idempotency_keys '
            'FOR VALUES WITH (MODULUS %s, REMAINDER %s) WITH (fillfactor = 25)', v_part, v_parts, i);
        PERFORM pg_catalog.pg_extension_config_dump(pg_catalog.format('idempotency.%I', v_part)::pg_catalog.regclass, '');
    END LOOP;
    DROP TABLE idempotency.idempotency_keys_template;
END
$partition$;

-- pg_dump keeps the rows and the token sequence of an extension-owned table.
SELECT pg_catalog.pg_extension_config_dump('idempotency.idempotency_keys', '');
SELECT pg_catalog.pg_extension_config_dump('idempotency.token_seq', '');

CREATE TYPE idempotency.claim_result AS (
    outcome         idempotency.outcome,
    token           bigint,
    response        jsonb,
    response_status integer,
    retry_after     interval,
    expires_at      timestamptz,
    recovery_point  text
);

CREATE FUNCTION idempotency.claim(
    key   text,
    request jsonb DEFAULT NULL,
    scope text DEFAULT '',
    ttl   interval DEFAULT NULL,
    lease interval DEFAULT NULL
) RETURNS idempotency.claim_result
LANGUAGE c VOLATILE PARALLEL UNSAFE SECURITY DEFINER
AS 'MODULE_PATHNAME', 'idempotency_claim';
-- claim, complete and sweep, the calls on every request's path, pin their search path inside
-- the C code (to pg_catalog alone, for every statement they run) instead of with a SET clause,
-- which costs a configuration save and restore per call and would stop complete from being
-- inlined. Their statements also name every table, type, function and operator with its
-- schema. The other functions pin search_path = pg_catalog, pg_temp with SET.

-- Checks key and scope (the shared argument rules and the session's scope_prefix) and returns
-- the key in the form the store keeps it: itself, or its keyed hash in hex (set_key_storage).
CREATE FUNCTION idempotency._stored_key(key text, scope text)
RETURNS text
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'idempotency_key';

-- Counts releases and IK003 answers ('stale_token') in shared memory (a no-op unless
-- preloaded); the C functions count the rest.
CREATE FUNCTION idempotency._count(event text)
RETURNS void
LANGUAGE c VOLATILE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_count';

-- Refuses a recovery point over idempotency.max_recovery_point_size (54000).
CREATE FUNCTION idempotency._check_recovery_point(recovery_point text)
RETURNS void
LANGUAGE c VOLATILE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_check_recovery_point';

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

-- Raises the error that explains why complete/checkpoint found no row it may change.
CREATE FUNCTION idempotency._raise_not_claimed(p_key text, p_scope text, p_token bigint, p_action text)
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
        -- Counted (stats.stale_tokens_refused) before the error undoes the transaction: the
        -- counters are not transactional.
        PERFORM idempotency._count('stale_token');
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: token %s is stale, the current token is %s',
                                        p_action, v_label, p_scope, p_token, r.token),
            HINT = 'another worker took the key over after this lease ran out (or the token is another key''s); abandon this attempt';
    ELSE
        PERFORM idempotency._count('stale_token');
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: token %s was never issued for it, the current token is %s',
                                        p_action, v_label, p_scope, p_token, r.token),
            HINT = 'pass the token that claim returned for this key';
    END IF;
    RETURN NULL;  -- not reached
END
$fn$;

CREATE FUNCTION idempotency._complete(
    key text, response jsonb, response_status integer, scope text, token bigint, ttl interval)
RETURNS timestamptz
LANGUAGE c VOLATILE PARALLEL UNSAFE SECURITY DEFINER
AS 'MODULE_PATHNAME', 'idempotency_complete';

-- A single-expression SQL function, so the planner inlines it into the caller's statement:
-- on success it costs one C call; otherwise _raise_not_claimed raises IK001..IK003.
-- (No SET search_path here, which would prevent inlining: every name is schema-qualified.)
CREATE FUNCTION idempotency.complete(
    key             text,
    response        jsonb,
    response_status integer DEFAULT 200,
    scope           text DEFAULT '',
    token           bigint DEFAULT NULL,
    ttl             interval DEFAULT NULL
) RETURNS timestamptz
LANGUAGE sql VOLATILE
AS $fn$
    SELECT COALESCE(idempotency._complete($1, $2, $3, $4, $5, $6),
                    idempotency._raise_not_claimed($1, $4, $5, 'complete'))
$fn$;

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

CREATE FUNCTION idempotency.checkpoint(
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

CREATE FUNCTION idempotency.release(key text, scope text DEFAULT '', token bigint DEFAULT NULL)
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

CREATE FUNCTION idempotency.forget(key text, scope text DEFAULT '')
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

CREATE FUNCTION idempotency.lookup(key text, scope text DEFAULT '')
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

CREATE FUNCTION idempotency.sweep(batch_size integer DEFAULT NULL)
RETURNS bigint
LANGUAGE c VOLATILE PARALLEL UNSAFE SECURITY DEFINER
AS 'MODULE_PATHNAME', 'idempotency_sweep';

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

-- Keys stored hashed ------------------------------------------------------------------------

-- How the store keeps keys: no row (or 'plain') keeps them as given, 'sha256' keeps the hex
-- HMAC-SHA256, under key_secret, of each key's SHA-256 (a keyed hash: without the secret a
-- stored key cannot be checked against a dictionary of e-mail addresses or order numbers).
-- Changed only by set_key_storage; dumped by pg_dump with the keys, secret included: a
-- restored store needs it to find its keys.
CREATE TABLE idempotency.config (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key_storage text NOT NULL
        CHECK (key_storage OPERATOR(pg_catalog.=) ANY (ARRAY['plain', 'sha256']::text[])),
    key_secret  bytea CHECK (key_secret IS NULL OR pg_catalog.length(key_secret) OPERATOR(pg_catalog.=) 32)
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.config', '');

CREATE FUNCTION idempotency._store_changed()
RETURNS void
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'idempotency_store_changed';

-- The stored form of a key whose SHA-256 is digest, under secret.
CREATE FUNCTION idempotency._rekey(digest bytea, secret bytea)
RETURNS text
LANGUAGE c IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_rekey';

-- Switches how the store keeps keys. To 'sha256': every stored key (and every audit row) is
-- replaced by its keyed hash in this transaction (the secret is made inside the server on
-- first use and kept); callers change nothing. To 'plain': refused while any live key is
-- stored hashed (a hash cannot be turned back into its key). Returns the number of keys
-- rewritten.
CREATE FUNCTION idempotency.set_key_storage(mode text)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_current text;
    v_secret bytea;
    v_rows bigint := 0;
BEGIN
    IF mode IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'mode must not be NULL';
    ELSIF mode OPERATOR(pg_catalog.<>) ALL (ARRAY['plain', 'sha256']::text[]) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('mode must be ''plain'' or ''sha256'' (got %L)',
                                        pg_catalog.left(mode, 40));
    END IF;
    -- On Citus the switch would have to reach the backends of every node at once (each caches
    -- the mode) and Citus refuses the rekeying UPDATE: choose the storage before distributing.
    -- (Nested: the catalog exists only where Citus is installed.)
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                    WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
            RAISE EXCEPTION USING
                ERRCODE = 'feature_not_supported',
                MESSAGE = 'idempotency.set_key_storage cannot change a store distributed by Citus',
                HINT = 'choose the key storage before idempotency.distribute(); see docs/scaling.md';
        END IF;
    END IF;
    -- Waits for running claims; claims that come later wait here and then see the new mode.
    LOCK TABLE idempotency.idempotency_keys, idempotency.audit IN ACCESS EXCLUSIVE MODE;
    SELECT c.key_storage, c.key_secret INTO v_current, v_secret FROM idempotency.config AS c;
    IF COALESCE(v_current, 'plain') OPERATOR(pg_catalog.=) mode THEN
        RETURN 0;
    END IF;
    IF mode OPERATOR(pg_catalog.=) 'sha256' THEN
        v_secret := COALESCE(v_secret, idempotency._random_secret());
        UPDATE idempotency.idempotency_keys AS k
           SET key = idempotency._rekey(pg_catalog.sha256(pg_catalog.convert_to(k.key, 'UTF8')), v_secret);
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        UPDATE idempotency.audit AS a
           SET key = idempotency._rekey(pg_catalog.sha256(pg_catalog.convert_to(a.key, 'UTF8')), v_secret),
               key_is_hash = true
         WHERE NOT a.key_is_hash;
    ELSE
        DELETE FROM idempotency.idempotency_keys AS k
         WHERE k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now();
        SELECT pg_catalog.count(*) INTO v_rows FROM idempotency.idempotency_keys;
        IF v_rows OPERATOR(pg_catalog.>) 0 THEN
            RAISE EXCEPTION USING
                ERRCODE = '55000',
                MESSAGE = pg_catalog.format('cannot set mode to ''plain'': %s live keys are stored hashed and cannot be turned back into keys', v_rows),
                HINT = 'switch when they have expired (or after forgetting them); until then the store stays sha256';
        END IF;
    END IF;
    INSERT INTO idempotency.config AS c (singleton, key_storage, key_secret) VALUES (true, mode, v_secret)
        ON CONFLICT (singleton) DO UPDATE
        SET key_storage = excluded.key_storage, key_secret = COALESCE(c.key_secret, excluded.key_secret);
    PERFORM idempotency._store_changed();
    RETURN v_rows;
END
$fn$;

-- Audit trail ---------------------------------------------------------------------------------

CREATE SEQUENCE idempotency.audit_id_seq AS bigint;

-- Append-only: one row per completion while idempotency.audit is on, written by complete in
-- the completing transaction. The key sweeper never touches it; the background worker deletes
-- rows older than idempotency.audit_retention (0, the default: kept).
CREATE TABLE idempotency.audit (
    id              bigint NOT NULL DEFAULT pg_catalog.nextval('idempotency.audit_id_seq') PRIMARY KEY,
    scope           text COLLATE "C" NOT NULL,
    key             text COLLATE "C" NOT NULL,
    -- key holds the hex SHA-256 of the key (the store kept keys hashed)
    key_is_hash     boolean NOT NULL,
    request_hash    bytea,
    token           bigint NOT NULL,
    response_status integer NOT NULL,
    completed_at    timestamptz NOT NULL,
    -- the role that completed: the session's current role, not the functions' owner
    completed_by    name NOT NULL
);
ALTER SEQUENCE idempotency.audit_id_seq OWNED BY idempotency.audit.id;
CREATE INDEX audit_completed_at_idx ON idempotency.audit (completed_at);
CREATE INDEX audit_scope_key_idx ON idempotency.audit (scope, key);
COMMENT ON TABLE idempotency.audit IS
    'One row per completion while idempotency.audit is on; append-only, kept after the key expires.';
SELECT pg_catalog.pg_extension_config_dump('idempotency.audit', '');
SELECT pg_catalog.pg_extension_config_dump('idempotency.audit_id_seq', '');

CREATE FUNCTION idempotency.sweep_audit(batch_size integer DEFAULT NULL)
RETURNS bigint
LANGUAGE c VOLATILE PARALLEL UNSAFE SECURITY DEFINER
AS 'MODULE_PATHNAME', 'idempotency_sweep_audit';

-- Signed keys ---------------------------------------------------------------------------------

-- Server secrets for sign_key/verify_key. Readable by no role but superusers (the functions
-- read it as its owner), made inside the server (never in SQL text or logs), and deliberately
-- not dumped by pg_dump: a restored database needs new secrets (rotate_signing_secret).
CREATE TABLE idempotency.signing_secrets (
    id         integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    secret     bytea NOT NULL CHECK (pg_catalog.length(secret) OPERATOR(pg_catalog.>=) 16),
    created_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);
COMMENT ON TABLE idempotency.signing_secrets IS
    'Secrets of sign_key/verify_key: the newest signs, all verify. Not dumped by pg_dump.';

-- _sign and _verify bind the signature to the session's idempotency.scope_prefix (a key signed
-- for one tenant does not verify for another): STABLE, not IMMUTABLE.
CREATE FUNCTION idempotency._sign(key text, kid integer, secret bytea)
RETURNS text
LANGUAGE c STABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_sign';

CREATE FUNCTION idempotency._signed_kid(signed text)
RETURNS integer
LANGUAGE c IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_signed_kid';

CREATE FUNCTION idempotency._verify(signed text, secret bytea)
RETURNS text
LANGUAGE c STABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_verify';

CREATE FUNCTION idempotency._random_secret()
RETURNS bytea
LANGUAGE c VOLATILE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_random_secret';

-- key + '.' + secret id + '.' + HMAC-SHA256 signature (base64url) with the newest secret.
CREATE FUNCTION idempotency.sign_key(key text)
RETURNS text
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    s record;
BEGIN
    IF sign_key.key IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'key must not be NULL';
    END IF;
    SELECT x.id, x.secret INTO s FROM idempotency.signing_secrets AS x ORDER BY x.id DESC LIMIT 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING
            ERRCODE = '55000',
            MESSAGE = 'cannot sign key: no signing secret exists',
            HINT = 'a superuser creates one with SELECT idempotency.rotate_signing_secret();';
    END IF;
    RETURN idempotency._sign(sign_key.key, s.id, s.secret);
END
$fn$;

-- The bare key of a signed key, or IK004 for a malformed, forged, altered or retired one.
CREATE FUNCTION idempotency.verify_key(signed text)
RETURNS text
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_kid integer;
    v_secret bytea;
    v_key text;
BEGIN
    IF signed IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'signed must not be NULL';
    END IF;
    -- 255 characters of key (4 bytes each at most), the secret id and the signature: anything
    -- longer is refused from its header, before any of it is read or MACed.
    IF pg_catalog.octet_length(signed) OPERATOR(pg_catalog.>) 1100 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK004',
            MESSAGE = pg_catalog.format('signed is not a signed key: %s bytes, longer than any signed key', pg_catalog.octet_length(signed));
    END IF;
    v_kid := idempotency._signed_kid(signed);
    IF v_kid IS NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK004',
            MESSAGE = 'signed is not a signed key: expected <key>.<secret id>.<signature>';
    END IF;
    SELECT x.secret INTO v_secret FROM idempotency.signing_secrets AS x
     WHERE x.id OPERATOR(pg_catalog.=) v_kid;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK004',
            MESSAGE = pg_catalog.format('signed names signing secret %s, which does not exist (retired, or never made here)', v_kid);
    END IF;
    v_key := idempotency._verify(signed, v_secret);
    IF v_key IS NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK004',
            MESSAGE = 'signed has a wrong signature: the key was forged or altered';
    END IF;
    RETURN v_key;
END
$fn$;

-- Makes a new secret (32 random bytes), which signs from now on; older ones still verify.
CREATE FUNCTION idempotency.rotate_signing_secret()
RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_id integer;
BEGIN
    INSERT INTO idempotency.signing_secrets (secret) VALUES (idempotency._random_secret())
    RETURNING id INTO v_id;
    RETURN v_id;
END
$fn$;

-- Deletes a secret: keys it signed no longer verify.
CREATE FUNCTION idempotency.retire_signing_secret(id integer)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF retire_signing_secret.id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'id must not be NULL';
    END IF;
    DELETE FROM idempotency.signing_secrets AS x WHERE x.id OPERATOR(pg_catalog.=) retire_signing_secret.id;
    RETURN FOUND;
END
$fn$;


CREATE FUNCTION idempotency.canonical_json(doc jsonb, numbers text DEFAULT 'exact')
RETURNS text
LANGUAGE c IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_canonical_json';

CREATE FUNCTION idempotency.canonical_hash(doc jsonb, exclude text[] DEFAULT '{}')
RETURNS bytea
LANGUAGE c IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_canonical_hash';

CREATE FUNCTION idempotency.derive_key(parent text, step text, params jsonb DEFAULT NULL)
RETURNS text
LANGUAGE c IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_derive_key';

CREATE FUNCTION idempotency.cron_key(job text, scheduled_at timestamptz, slot interval)
RETURNS text
LANGUAGE c IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_cron_key';

CREATE FUNCTION idempotency.request_fingerprint(
    method text,
    path   text,
    query  jsonb DEFAULT NULL,
    body   jsonb DEFAULT NULL
) RETURNS bytea
LANGUAGE c IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_request_fingerprint';

-- Citus ---------------------------------------------------------------------------------------

-- On the coordinator of a Citus cluster: distributes the store by scope so that a tenant's keys
-- live on the node holding the tenant's rows (docs/scaling.md). Applications colocate their
-- tables with it: create_distributed_table(..., colocate_with => 'idempotency.idempotency_keys'),
-- distribution column of type text COLLATE "C". Each step is skipped when it was done before,
-- so a second call changes nothing (it only raises the token sequences of nodes added since).
-- - idempotency_keys: hash-distributed by scope, in its own colocation group;
-- - audit: distributed by scope with the keys (an audit row is written with its key's
--   completion, on the same node, in the same local transaction); Citus needs the distribution
--   column in every unique constraint, so its primary key becomes (scope, id);
-- - config and signing_secrets: reference tables (a copy on every node), so a call that runs on
--   a worker hashes and verifies keys with the coordinator's secrets;
-- - claim, complete, checkpoint, release, forget and lookup: delegated by their scope argument
--   to the node holding the scope's shard;
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
CREATE FUNCTION idempotency.distribute(shard_count integer DEFAULT NULL)
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
    v_app_column name;
    v_app_type pg_catalog.regtype;
    v_app_collation oid;
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
        -- Checked before anything changes (the tenant columns are added on each node by a
        -- command of its own, which a later failure would not undo): the application's table is
        -- hash-distributed by a column of the store's type (and, for text, collation "C", the
        -- scope's, as Citus requires of colocated columns), and every node is reachable.
        IF distribute.colocate_with IS NOT NULL THEN
            SELECT a.attname, a.atttypid::pg_catalog.regtype, a.attcollation
              INTO v_app_column, v_app_type, v_app_collation
              FROM pg_catalog.pg_dist_partition AS p
              JOIN pg_catalog.pg_attribute AS a
                ON a.attrelid OPERATOR(pg_catalog.=) p.logicalrelid
               AND a.attname OPERATOR(pg_catalog.=) pg_catalog.column_to_column_name(p.logicalrelid, p.partkey)
             WHERE p.logicalrelid OPERATOR(pg_catalog.=) distribute.colocate_with
               AND p.partmethod OPERATOR(pg_catalog.=) 'h';
            IF NOT FOUND THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'invalid_parameter_value',
                    MESSAGE = pg_catalog.format('idempotency.distribute: colocate_with %s is not a hash-distributed Citus table',
                                                distribute.colocate_with),
                    HINT = 'distribute the application''s table by its tenant id first (create_distributed_table), or leave colocate_with out';
            END IF;
            IF v_app_type OPERATOR(pg_catalog.<>) v_type THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'invalid_parameter_value',
                    MESSAGE = pg_catalog.format('idempotency.distribute: colocate_with %s is distributed by %I of type %s, not tenant_type %s',
                                                distribute.colocate_with, v_app_column, v_app_type, v_type),
                    HINT = CASE WHEN v_app_type OPERATOR(pg_catalog.=) ANY (ARRAY['text', 'bigint', 'uuid']::pg_catalog.regtype[])
                                THEN pg_catalog.format('pass tenant_type => %L', v_app_type)
                                ELSE 'the store is distributed by text (its scope), bigint or uuid: colocate it with a table distributed by one of those' END;
            END IF;
            IF v_type OPERATOR(pg_catalog.=) 'text'::pg_catalog.regtype
               AND v_app_collation OPERATOR(pg_catalog.<>) 'pg_catalog."C"'::pg_catalog.regcollation THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'invalid_parameter_value',
                    MESSAGE = pg_catalog.format('idempotency.distribute: colocate_with %s is distributed by %I of collation %s, not "C" (the scope''s)',
                                                distribute.colocate_with, v_app_column, v_app_collation::pg_catalog.regcollation),
                    HINT = 'Citus colocates columns of the same collation: declare the application''s column COLLATE "C"';
            END IF;
        END IF;
        FOR v_node IN
            SELECT r.nodename, r.nodeport, r.success, r.result
              FROM pg_catalog.run_command_on_workers('SELECT 1') AS r
        LOOP
            IF NOT v_node.success THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'connection_exception',
                    MESSAGE = pg_catalog.format('idempotency.distribute: Citus node %s:%s is unreachable, and nothing was changed: %s',
                                                v_node.nodename, v_node.nodeport, v_node.result),
                    HINT = 'call idempotency.distribute() again once every node is reachable';
            END IF;
        END LOOP;
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

-- Observability -------------------------------------------------------------------------------

CREATE FUNCTION idempotency._sweeper_preloaded()
RETURNS boolean
LANGUAGE c STABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_sweeper_preloaded';

CREATE FUNCTION idempotency._shared_stats(
    OUT preloaded          boolean,
    OUT claims_new         bigint,
    OUT claims_replay      bigint,
    OUT claims_in_progress bigint,
    OUT claims_mismatch    bigint,
    OUT completions        bigint,
    OUT releases           bigint,
    OUT rows_swept         bigint,
    OUT last_sweep_at      timestamptz,
    OUT last_sweep_rows    bigint,
    OUT takeovers            bigint,
    OUT stale_tokens_refused bigint,
    OUT claims_waited        bigint,
    OUT claim_wait_seconds   double precision,
    OUT last_sweep_error     text
)
LANGUAGE c VOLATILE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_shared_stats';

-- The counters of the whole store: this node's, or, where the store is a Citus distributed table,
-- the sum over every node of the cluster (each node counts the calls it ran, and its sweeper the
-- rows it swept). Last sweep: the least recent of the nodes' last sweeps (a node whose sweeper
-- stalled shows), its rows summed; the sweeper is enabled only if it is on every node.
CREATE FUNCTION idempotency._cluster_stats(
    OUT preloaded          boolean,
    OUT claims_new         bigint,
    OUT claims_replay      bigint,
    OUT claims_in_progress bigint,
    OUT claims_mismatch    bigint,
    OUT completions        bigint,
    OUT releases           bigint,
    OUT rows_swept         bigint,
    OUT last_sweep_at      timestamptz,
    OUT last_sweep_rows    bigint,
    OUT takeovers            bigint,
    OUT stale_tokens_refused bigint,
    OUT claims_waited        bigint,
    OUT claim_wait_seconds   double precision,
    OUT last_sweep_error     text
)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_docs jsonb[] := '{}';
    v_node record;
BEGIN
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                    WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
                      AND p.partmethod OPERATOR(pg_catalog.=) 'h') THEN
            FOR v_node IN
                SELECT r.nodeid, r.success, r.result
                  FROM pg_catalog.run_command_on_all_nodes(
                           $c$SELECT pg_catalog.row_to_json(s) FROM idempotency._shared_stats() AS s$c$) AS r
            LOOP
                IF NOT v_node.success AND pg_catalog.strpos(v_node.result, 'idempotency._shared_stats:') OPERATOR(pg_catalog.>) 0 THEN
                    RAISE EXCEPTION USING
                        ERRCODE = 'insufficient_privilege',
                        MESSAGE = pg_catalog.format('idempotency.stats: this role may not read the counters of Citus node %s',
                                                    v_node.nodeid),
                        HINT = 'grant SELECT on the view on every node: SELECT run_command_on_all_nodes(''GRANT SELECT ON idempotency.stats TO <role>'')';
                END IF;
                IF NOT v_node.success THEN
                    RAISE EXCEPTION USING
                        ERRCODE = 'connection_exception',
                        MESSAGE = pg_catalog.format('idempotency.stats could not read the counters of Citus node %s: %s',
                                                    v_node.nodeid, v_node.result),
                        HINT = 'the store is distributed: its statistics need every node (see pg_dist_node)';
                END IF;
                v_docs := v_docs OPERATOR(pg_catalog.||)
                          (v_node.result::jsonb OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object('node', v_node.nodeid));
            END LOOP;
            RETURN QUERY
            SELECT pg_catalog.bool_and(j.preloaded),
                   pg_catalog.sum(j.claims_new)::bigint, pg_catalog.sum(j.claims_replay)::bigint,
                   pg_catalog.sum(j.claims_in_progress)::bigint, pg_catalog.sum(j.claims_mismatch)::bigint,
                   pg_catalog.sum(j.completions)::bigint, pg_catalog.sum(j.releases)::bigint,
                   pg_catalog.sum(j.rows_swept)::bigint,
                   CASE WHEN pg_catalog.bool_and(j.last_sweep_at IS NOT NULL)
                        THEN pg_catalog.min(j.last_sweep_at) END,
                   pg_catalog.sum(j.last_sweep_rows)::bigint,
                   pg_catalog.sum(j.takeovers)::bigint, pg_catalog.sum(j.stale_tokens_refused)::bigint,
                   pg_catalog.sum(j.claims_waited)::bigint,
                   pg_catalog.sum(j.claim_wait_seconds)::double precision,
                   -- A node whose last sweep failed shows, named.
                   pg_catalog.string_agg(pg_catalog.format('node %s: %s', j.node, j.last_sweep_error), '; ' ORDER BY j.node)
                       FILTER (WHERE j.last_sweep_error IS NOT NULL)
              FROM pg_catalog.unnest(v_docs) AS d(doc),
                   pg_catalog.jsonb_to_record(d.doc) AS j(preloaded boolean, claims_new bigint,
                       claims_replay bigint, claims_in_progress bigint, claims_mismatch bigint,
                       completions bigint, releases bigint, rows_swept bigint,
                       last_sweep_at timestamptz, last_sweep_rows bigint, takeovers bigint,
                       stale_tokens_refused bigint, claims_waited bigint,
                       claim_wait_seconds double precision, last_sweep_error text, node integer);
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM idempotency._shared_stats();
END
$fn$;

-- Monitoring: a schema of its own, so that a monitoring role is granted the counters and
-- nothing else (GRANT USAGE ON SCHEMA idempotency_monitor TO monitor). USAGE on schema
-- idempotency is the application's grant, the whole API. The view is idempotency.stats (the
-- same columns, kept in step: test_privileges.py); it reads the table as its owner, and its
-- counters (_shared_stats) answer roles granted this schema.
CREATE SCHEMA idempotency_monitor;
COMMENT ON SCHEMA idempotency_monitor IS
    'The counters of idempotency.stats for monitoring roles: GRANT USAGE ON SCHEMA idempotency_monitor TO <role>';

-- The exact row counts of the store: live rows by status, and expired rows not yet swept (a
-- scan of the whole table; the stats views estimate them). As the caller: for the store's
-- owner, superusers and roles granted SELECT on idempotency.idempotency_keys.
CREATE FUNCTION idempotency.count_keys()
RETURNS TABLE (rows_in_progress bigint, rows_completed bigint, rows_expired bigint)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT pg_catalog.count(*) FILTER (
               WHERE k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
                 AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()),
           pg_catalog.count(*) FILTER (
               WHERE k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status
                 AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()),
           pg_catalog.count(*) FILTER (
               WHERE k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now())
      FROM idempotency.idempotency_keys AS k
$fn$;

-- The store's rows for the stats views, at a cost that does not grow with the store: counted
-- exactly (count_keys) while the table is at most 128 pages (1 MB; also on Citus, whose
-- coordinator holds no rows), otherwise the planner's estimates (from the statistics that
-- ANALYZE and autovacuum keep, scaled to the table's current size). The oldest expiry through
-- the sweep index: the first row in its order, then the rows keyed no later than that row's
-- expiry (a row's key, the expiry its claim set, is never later than its expires_at: see
-- docs/architecture.md#the-sweep-index). SECURITY DEFINER, reading the table as its owner; in
-- this schema, so that it is named only by the views and by roles granted the schema.
CREATE FUNCTION idempotency_monitor._store_rows(
    OUT rows_in_progress bigint,
    OUT rows_completed   bigint,
    OUT rows_expired     bigint,
    OUT oldest_expiry    timestamptz
)
RETURNS record
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_pages bigint;
    v_first timestamptz;
    v_plan json;
BEGIN
    -- The table, or its partitions (a partitioned table has no pages of its own).
    SELECT COALESCE(pg_catalog.sum(pg_catalog.pg_relation_size(c.oid)), 0)
           OPERATOR(pg_catalog./) pg_catalog.current_setting('block_size')::bigint
      INTO v_pages
      FROM pg_catalog.pg_class AS c
     WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
        OR c.oid OPERATOR(pg_catalog.=) ANY (
               SELECT t.relid FROM pg_catalog.pg_partition_tree('idempotency.idempotency_keys'::pg_catalog.regclass) AS t
                WHERE t.isleaf);
    IF v_pages OPERATOR(pg_catalog.<=) 128 THEN
        SELECT c.rows_in_progress, c.rows_completed, c.rows_expired
          INTO rows_in_progress, rows_completed, rows_expired
          FROM idempotency.count_keys() AS c;
    ELSE
        EXECUTE 'EXPLAIN (FORMAT JSON) SELECT FROM idempotency.idempotency_keys AS k '
                'WHERE k.status OPERATOR(pg_catalog.=) ''in_progress''::idempotency.key_status '
                'AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()' INTO v_plan;
        rows_in_progress := (v_plan OPERATOR(pg_catalog.->) 0 OPERATOR(pg_catalog.->) 'Plan'
                             OPERATOR(pg_catalog.->>) 'Plan Rows')::numeric::bigint;
        EXECUTE 'EXPLAIN (FORMAT JSON) SELECT FROM idempotency.idempotency_keys AS k '
                'WHERE k.status OPERATOR(pg_catalog.=) ''completed''::idempotency.key_status '
                'AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()' INTO v_plan;
        rows_completed := (v_plan OPERATOR(pg_catalog.->) 0 OPERATOR(pg_catalog.->) 'Plan'
                           OPERATOR(pg_catalog.->>) 'Plan Rows')::numeric::bigint;
        EXECUTE 'EXPLAIN (FORMAT JSON) SELECT FROM idempotency.idempotency_keys AS k '
                'WHERE k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()' INTO v_plan;
        rows_expired := (v_plan OPERATOR(pg_catalog.->) 0 OPERATOR(pg_catalog.->) 'Plan'
                         OPERATOR(pg_catalog.->>) 'Plan Rows')::numeric::bigint;
    END IF;
    SELECT k.expires_at INTO v_first
      FROM idempotency.idempotency_keys AS k
     ORDER BY ((k.created_at AT TIME ZONE 'UTC') OPERATOR(pg_catalog.+) k.ttl)
     LIMIT 1;
    IF v_first IS NOT NULL THEN
        -- Planned with the bound's value, so that the range is read through the index.
        EXECUTE 'SELECT pg_catalog.min(k.expires_at) FROM idempotency.idempotency_keys AS k '
                'WHERE ((k.created_at AT TIME ZONE ''UTC'') OPERATOR(pg_catalog.+) k.ttl) '
                'OPERATOR(pg_catalog.<=) $1'
          INTO oldest_expiry USING v_first AT TIME ZONE 'UTC';
    END IF;
END
$fn$;

-- One row for the current database: the store's contents (expired rows count apart: they are
-- absent to claim and wait for the sweeper; estimated on a large store, count_keys counts
-- exactly), the counters since server start, and how far the sweep is behind.
CREATE VIEW idempotency.stats AS
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
       s.preloaded AS sweeper_enabled,
       s.takeovers,
       s.stale_tokens_refused,
       s.claims_waited,
       s.claim_wait_seconds,
       CASE WHEN t.oldest_expiry OPERATOR(pg_catalog.<=) pg_catalog.now()
            THEN pg_catalog.date_part('epoch', pg_catalog.now() OPERATOR(pg_catalog.-) t.oldest_expiry)
       END AS sweep_lag_seconds,
       s.last_sweep_error
  FROM idempotency_monitor._store_rows() AS t,
       idempotency._cluster_stats() AS s;

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
       s.preloaded AS sweeper_enabled,
       s.takeovers,
       s.stale_tokens_refused,
       s.claims_waited,
       s.claim_wait_seconds,
       CASE WHEN t.oldest_expiry OPERATOR(pg_catalog.<=) pg_catalog.now()
            THEN pg_catalog.date_part('epoch', pg_catalog.now() OPERATOR(pg_catalog.-) t.oldest_expiry)
       END AS sweep_lag_seconds,
       s.last_sweep_error
  FROM idempotency_monitor._store_rows() AS t,
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

CREATE FUNCTION idempotency._announce()
RETURNS void
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'idempotency_announce';

DO $notice$
BEGIN
    -- Databases found without the extension are not visited by the sweeper until they
    -- announce it here.
    PERFORM idempotency._announce();
    IF NOT idempotency._sweeper_preloaded() THEN
        -- CREATE EXTENSION runs its script with client_min_messages = warning; let this through.
        PERFORM pg_catalog.set_config('client_min_messages', 'notice', true);
        RAISE NOTICE 'idempotency: no background sweeper runs: the library is not in shared_preload_libraries'
            USING HINT = 'Add idempotency to shared_preload_libraries and restart PostgreSQL, '
                         'or schedule SELECT idempotency.sweep() (with pg_cron: SELECT idempotency.schedule_sweep()); '
                         'expired keys count as absent either way.';
    END IF;
END
$notice$;

-- Superusers only; the internal helpers are not for applications either.
REVOKE EXECUTE ON FUNCTION idempotency.set_key_storage(text), idempotency.rotate_signing_secret(),
    idempotency.retire_signing_secret(integer), idempotency._store_changed(),
    idempotency._random_secret(), idempotency._count(text), idempotency._announce(),
    idempotency._rekey(bytea, bytea), idempotency.distribute(integer),
    idempotency.distribute(regtype, integer, regclass), idempotency._node_sequences(bigint),
    idempotency._tenant_columns(regtype)
    FROM PUBLIC;
-- Helpers that only the SECURITY DEFINER functions call (as the owner). _stored_key in
-- particular computes a key's stored form (its keyed hash): no caller may have that computed.
REVOKE EXECUTE ON FUNCTION idempotency._stored_key(text, text), idempotency._check_recovery_point(text),
    idempotency._tenant_filter(text),
    idempotency._sign(text, integer, bytea), idempotency._signed_kid(text), idempotency._verify(text, bytea)
    FROM PUBLIC;

-- Batches (0.4.0): claim_many and complete_many, one call for a batch of messages (a queue
-- consumer's batch, a webhook delivery's events). Each position is answered as claim /
-- complete would answer it alone, in input order; bad arrays are refused before anything is
-- written. claim_many inserts the absent keys of a batch in one statement (C).
CREATE FUNCTION idempotency.claim_many(
    keys     text[],
    requests jsonb[] DEFAULT NULL,
    scope    text DEFAULT '',
    ttl      interval DEFAULT NULL,
    lease    interval DEFAULT NULL
) RETURNS TABLE (
    ord             integer,
    key             text,
    outcome         idempotency.outcome,
    token           bigint,
    response        jsonb,
    response_status integer,
    retry_after     interval,
    expires_at      timestamptz,
    recovery_point  text
)
LANGUAGE c VOLATILE PARALLEL UNSAFE SECURITY DEFINER ROWS 100
AS 'MODULE_PATHNAME', 'idempotency_claim_many';

-- complete for each position, in input order, in one statement: a position whose claim is
-- gone, completed or fenced raises complete's own error (IK001..IK003) and the statement
-- writes nothing. NULL responses: no response for any key; NULL response_statuses: 200 each;
-- NULL tokens (or a NULL element): no token check for that key.
CREATE FUNCTION idempotency.complete_many(
    keys              text[],
    responses         jsonb[],
    response_statuses integer[] DEFAULT NULL,
    scope             text DEFAULT '',
    tokens            bigint[] DEFAULT NULL,
    ttl               interval DEFAULT NULL
) RETURNS SETOF timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    n integer;
    i integer;
    v_status integer;
    v_len integer;
BEGIN
    IF complete_many.keys IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'keys must not be NULL';
    END IF;
    IF pg_catalog.array_ndims(complete_many.keys) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '2202E', MESSAGE = 'keys must be a one-dimensional array';
    END IF;
    IF pg_catalog.array_ndims(complete_many.responses) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '2202E', MESSAGE = 'responses must be a one-dimensional array';
    END IF;
    IF pg_catalog.array_ndims(complete_many.response_statuses) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '2202E', MESSAGE = 'response_statuses must be a one-dimensional array';
    END IF;
    IF pg_catalog.array_ndims(complete_many.tokens) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '2202E', MESSAGE = 'tokens must be a one-dimensional array';
    END IF;
    n := pg_catalog.cardinality(complete_many.keys);
    IF complete_many.responses IS NOT NULL
       AND pg_catalog.cardinality(complete_many.responses) OPERATOR(pg_catalog.<>) n THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format(
            'responses must have one element per key: it has %s, keys has %s',
            pg_catalog.cardinality(complete_many.responses), n);
    END IF;
    IF complete_many.response_statuses IS NOT NULL
       AND pg_catalog.cardinality(complete_many.response_statuses) OPERATOR(pg_catalog.<>) n THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format(
            'response_statuses must have one element per key: it has %s, keys has %s',
            pg_catalog.cardinality(complete_many.response_statuses), n);
    END IF;
    IF complete_many.tokens IS NOT NULL
       AND pg_catalog.cardinality(complete_many.tokens) OPERATOR(pg_catalog.<>) n THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format(
            'tokens must have one element per key: it has %s, keys has %s',
            pg_catalog.cardinality(complete_many.tokens), n);
    END IF;
    -- Every position is checked before the first is completed.
    FOR i IN 1 .. n LOOP
        IF complete_many.keys[pg_catalog.array_lower(complete_many.keys, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1] IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = pg_catalog.format('keys[%s] must not be NULL', i);
        END IF;
        v_len := pg_catalog.char_length(complete_many.keys[pg_catalog.array_lower(complete_many.keys, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1]);
        IF v_len OPERATOR(pg_catalog.=) 0 THEN
            RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format('keys[%s] must not be empty', i);
        ELSIF v_len OPERATOR(pg_catalog.>) 255 THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = pg_catalog.format('keys[%s] must be at most 255 characters (got %s)', i, v_len);
        END IF;
        IF complete_many.response_statuses IS NOT NULL THEN
            v_status := complete_many.response_statuses[pg_catalog.array_lower(complete_many.response_statuses, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1];
            IF v_status IS NULL THEN
                RAISE EXCEPTION USING ERRCODE = '22004',
                    MESSAGE = pg_catalog.format('response_statuses[%s] must not be NULL', i);
            END IF;
            IF v_status OPERATOR(pg_catalog.<) 100 OR v_status OPERATOR(pg_catalog.>) 599 THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = pg_catalog.format('response_statuses[%s] must be between 100 and 599 (got %s)', i, v_status);
            END IF;
        END IF;
    END LOOP;
    RETURN QUERY
        SELECT idempotency.complete(u.k, u.r, COALESCE(u.s, 200), complete_many.scope, u.t, complete_many.ttl)
          FROM ROWS FROM (pg_catalog.unnest(complete_many.keys),
                          pg_catalog.unnest(complete_many.responses),
                          pg_catalog.unnest(complete_many.response_statuses),
                          pg_catalog.unnest(complete_many.tokens))
               WITH ORDINALITY AS u(k, r, s, t, o)
         ORDER BY u.o;
END
$fn$;

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
