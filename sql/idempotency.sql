-- idempotency: the store, its types and the SQL API.
--
-- Hand-written and pulled into the extension script by extension_sql_file! in src/lib.rs.
-- Functions written in Rust are declared here as LANGUAGE c with their V1 symbols (src/api.rs);
-- complete, checkpoint, release, forget and lookup are PL/pgSQL so that they can raise the
-- extension's own SQLSTATEs (IK001..IK003), which pgrx cannot raise from Rust.
-- Every function pins search_path and every reference is schema-qualified.

CREATE TYPE idempotency.key_status AS ENUM ('in_progress', 'completed');
CREATE TYPE idempotency.outcome AS ENUM ('new', 'replay', 'in_progress', 'mismatch');

-- Fencing tokens come from one sequence, so a token is never reused, not even after a key was
-- released or forgotten and claimed again.
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
) WITH (fillfactor = 90);

COMMENT ON TABLE idempotency.idempotency_keys IS
    'One row per claimed idempotency key; rows past expires_at count as absent and are swept.';

-- The sweeper finds expired rows through this index.
CREATE INDEX idempotency_keys_expires_at_idx ON idempotency.idempotency_keys (expires_at);

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
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'idempotency_claim';
-- claim, complete and sweep, the calls on every request's path, pin their search path inside
-- the C code (to pg_catalog alone, for every statement they run) instead of with a SET clause,
-- which costs a configuration save and restore per call and would stop complete from being
-- inlined. Their statements also name every table, type, function and operator with its
-- schema. The other functions pin search_path = pg_catalog, pg_temp with SET.

CREATE FUNCTION idempotency._check_args(key text, scope text, ttl interval DEFAULT NULL)
RETURNS void
LANGUAGE c IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_check_args';

-- Counts releases in shared memory (a no-op unless preloaded); the C functions count the rest.
CREATE FUNCTION idempotency._count(event text)
RETURNS void
LANGUAGE c VOLATILE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_count';

-- Raises the error that explains why complete/checkpoint found no row it may change.
CREATE FUNCTION idempotency._raise_not_claimed(p_key text, p_scope text, p_token bigint, p_action text)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    r record;
BEGIN
    SELECT k.status, k.token, k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() AS live
      INTO r
      FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key;
    IF NOT FOUND OR NOT r.live THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK001',
            MESSAGE = pg_catalog.format('cannot %s key %L in scope %L: no live claim', p_action, p_key, p_scope),
            HINT = 'claim the key first; a claim that expired, was released or rolled back is gone';
    ELSIF r.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK002',
            MESSAGE = pg_catalog.format('cannot %s key %L in scope %L: it is already completed', p_action, p_key, p_scope),
            HINT = 'a completed key replays its stored response; claim it to read that response';
    ELSE
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %L in scope %L: token %s is stale, the current token is %s',
                                        p_action, p_key, p_scope, p_token, r.token),
            HINT = 'another worker took the key over after this lease ran out; abandon this attempt';
    END IF;
    RETURN NULL;  -- not reached
END
$fn$;

CREATE FUNCTION idempotency._complete(
    key text, response jsonb, response_status integer, scope text, token bigint, ttl interval)
RETURNS timestamptz
LANGUAGE c VOLATILE PARALLEL UNSAFE
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

CREATE FUNCTION idempotency.checkpoint(
    key            text,
    recovery_point text,
    scope          text DEFAULT '',
    token          bigint DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    PERFORM idempotency._check_args(checkpoint.key, checkpoint.scope);
    UPDATE idempotency.idempotency_keys AS k
       SET recovery_point = checkpoint.recovery_point
     WHERE k.scope OPERATOR(pg_catalog.=) checkpoint.scope
       AND k.key OPERATOR(pg_catalog.=) checkpoint.key
       AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
       AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
       AND (checkpoint.token IS NULL OR k.token OPERATOR(pg_catalog.=) checkpoint.token);
    IF NOT FOUND THEN
        PERFORM idempotency._raise_not_claimed(checkpoint.key, checkpoint.scope, checkpoint.token, 'checkpoint');
    END IF;
END
$fn$;

CREATE FUNCTION idempotency.release(key text, scope text DEFAULT '', token bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    PERFORM idempotency._check_args(release.key, release.scope);
    DELETE FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) release.scope
       AND k.key OPERATOR(pg_catalog.=) release.key
       AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
       AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
       AND (release.token IS NULL OR k.token OPERATOR(pg_catalog.=) release.token);
    IF FOUND THEN
        PERFORM idempotency._count('release');
        RETURN true;
    END IF;
    RETURN false;
END
$fn$;

CREATE FUNCTION idempotency.forget(key text, scope text DEFAULT '')
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_live boolean;
BEGIN
    PERFORM idempotency._check_args(forget.key, forget.scope);
    DELETE FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) forget.scope
       AND k.key OPERATOR(pg_catalog.=) forget.key
    RETURNING k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() INTO v_live;
    RETURN COALESCE(v_live, false);
END
$fn$;

CREATE FUNCTION idempotency.lookup(key text, scope text DEFAULT '')
RETURNS idempotency.idempotency_keys
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    r idempotency.idempotency_keys;
BEGIN
    PERFORM idempotency._check_args(lookup.key, lookup.scope);
    SELECT k.* INTO r
      FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) lookup.scope
       AND k.key OPERATOR(pg_catalog.=) lookup.key
       AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now();
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN r;
END
$fn$;

CREATE FUNCTION idempotency.sweep(batch_size integer DEFAULT NULL)
RETURNS bigint
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'idempotency_sweep';

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
    OUT last_sweep_rows    bigint
)
LANGUAGE c VOLATILE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_shared_stats';

-- One row for the current database: the store's contents (expired rows count apart: they are
-- absent to claim and wait for the sweeper) and the counters since server start.
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
       idempotency._shared_stats() AS s;

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
                         'or schedule SELECT idempotency.sweep(); expired keys count as absent either way.';
    END IF;
END
$notice$;
