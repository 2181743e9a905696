-- idempotency 0.1.0 -> 0.2.0 (see CHANGELOG.md)
--
-- Privileges: the functions that read or write the store run as the extension's owner
-- (SECURITY DEFINER), so an application role needs only USAGE on schema idempotency and has no
-- privilege on any table; idempotency.scope_prefix keeps tenants apart; keys can be stored
-- hashed (set_key_storage); signed keys (sign_key, verify_key); an audit trail
-- (idempotency.audit). Every object is left as a fresh 0.2.0 install creates it
-- (tests/integration/test_upgrade.py compares the two catalogs).

\echo Use "ALTER EXTENSION idempotency UPDATE TO '0.2.0'" to load this file. \quit

ALTER FUNCTION idempotency.claim(text, jsonb, text, interval, interval) SECURITY DEFINER;
ALTER FUNCTION idempotency._complete(text, jsonb, integer, text, bigint, interval) SECURITY DEFINER;
ALTER FUNCTION idempotency.sweep(integer) SECURITY DEFINER;

-- Checks key and scope (the shared argument rules and the session's scope_prefix) and returns
-- the key in the form the store keeps it: itself, or its SHA-256 in hex (set_key_storage).
CREATE FUNCTION idempotency._key(key text, scope text)
RETURNS text
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'idempotency_key';

CREATE OR REPLACE FUNCTION idempotency._raise_not_claimed(p_key text, p_scope text, p_token bigint, p_action text)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    r record;
    v_key text := idempotency._key(p_key, p_scope);
    -- Messages show a hashed key only as a prefix of its hash.
    v_label text := CASE WHEN v_key OPERATOR(pg_catalog.=) p_key THEN pg_catalog.quote_literal(p_key)
                         ELSE 'sha256:' OPERATOR(pg_catalog.||) pg_catalog.left(v_key, 12) OPERATOR(pg_catalog.||) '…' END;
BEGIN
    SELECT k.status, k.token, k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() AS live
      INTO r
      FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) v_key;
    IF NOT FOUND OR NOT r.live THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK001',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: no live claim', p_action, v_label, p_scope),
            HINT = 'claim the key first; a claim that expired, was released or rolled back is gone';
    ELSIF r.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK002',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: it is already completed', p_action, v_label, p_scope),
            HINT = 'a completed key replays its stored response; claim it to read that response';
    ELSE
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: token %s is stale, the current token is %s',
                                        p_action, v_label, p_scope, p_token, r.token),
            HINT = 'another worker took the key over after this lease ran out; abandon this attempt';
    END IF;
    RETURN NULL;  -- not reached
END
$fn$;

CREATE OR REPLACE FUNCTION idempotency.checkpoint(
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
BEGIN
    v_key := idempotency._key(checkpoint.key, checkpoint.scope);
    UPDATE idempotency.idempotency_keys AS k
       SET recovery_point = checkpoint.recovery_point
     WHERE k.scope OPERATOR(pg_catalog.=) checkpoint.scope
       AND k.key OPERATOR(pg_catalog.=) v_key
       AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
       AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
       AND (checkpoint.token IS NULL OR k.token OPERATOR(pg_catalog.=) checkpoint.token);
    IF NOT FOUND THEN
        PERFORM idempotency._raise_not_claimed(checkpoint.key, checkpoint.scope, checkpoint.token, 'checkpoint');
    END IF;
END
$fn$;

CREATE OR REPLACE FUNCTION idempotency.release(key text, scope text DEFAULT '', token bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_key text;
BEGIN
    v_key := idempotency._key(release.key, release.scope);
    DELETE FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) release.scope
       AND k.key OPERATOR(pg_catalog.=) v_key
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

CREATE OR REPLACE FUNCTION idempotency.forget(key text, scope text DEFAULT '')
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_key text;
    v_live boolean;
BEGIN
    v_key := idempotency._key(forget.key, forget.scope);
    DELETE FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) forget.scope
       AND k.key OPERATOR(pg_catalog.=) v_key
    RETURNING k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() INTO v_live;
    RETURN COALESCE(v_live, false);
END
$fn$;

CREATE OR REPLACE FUNCTION idempotency.lookup(key text, scope text DEFAULT '')
RETURNS idempotency.idempotency_keys
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_key text;
    r idempotency.idempotency_keys;
BEGIN
    v_key := idempotency._key(lookup.key, lookup.scope);
    SELECT k.* INTO r
      FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) lookup.scope
       AND k.key OPERATOR(pg_catalog.=) v_key
       AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now();
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN r;
END
$fn$;

DROP FUNCTION idempotency._check_args(text, text, interval);

-- Keys stored hashed ------------------------------------------------------------------------

-- How the store keeps keys: no row (or 'plain') keeps them as given, 'sha256' keeps the hex
-- SHA-256 of each key. Changed only by set_key_storage; dumped by pg_dump with the keys.
CREATE TABLE idempotency.config (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key_storage text NOT NULL
        CHECK (key_storage OPERATOR(pg_catalog.=) ANY (ARRAY['plain', 'sha256']::text[]))
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.config', '');

CREATE FUNCTION idempotency._store_changed()
RETURNS void
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'idempotency_store_changed';

-- Switches how the store keeps keys. To 'sha256': every stored key (and every audit row) is
-- replaced by its hash in this transaction; callers change nothing. To 'plain': refused while
-- any live key is stored hashed (a hash cannot be turned back into its key). Returns the
-- number of keys rewritten.
CREATE FUNCTION idempotency.set_key_storage(mode text)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_current text;
    v_rows bigint := 0;
BEGIN
    IF mode IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'mode must not be NULL';
    ELSIF mode OPERATOR(pg_catalog.<>) ALL (ARRAY['plain', 'sha256']::text[]) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('mode must be ''plain'' or ''sha256'' (got %L)',
                                        pg_catalog.left(mode, 40));
    END IF;
    -- Waits for running claims; claims that come later wait here and then see the new mode.
    LOCK TABLE idempotency.idempotency_keys, idempotency.audit IN ACCESS EXCLUSIVE MODE;
    SELECT c.key_storage INTO v_current FROM idempotency.config AS c;
    IF COALESCE(v_current, 'plain') OPERATOR(pg_catalog.=) mode THEN
        RETURN 0;
    END IF;
    IF mode OPERATOR(pg_catalog.=) 'sha256' THEN
        UPDATE idempotency.idempotency_keys AS k
           SET key = pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(k.key, 'UTF8')), 'hex');
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        UPDATE idempotency.audit AS a
           SET key = pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(a.key, 'UTF8')), 'hex'),
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
    INSERT INTO idempotency.config AS c (singleton, key_storage) VALUES (true, mode)
        ON CONFLICT (singleton) DO UPDATE SET key_storage = excluded.key_storage;
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

CREATE FUNCTION idempotency._sign(key text, kid integer, secret bytea)
RETURNS text
LANGUAGE c IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_sign';

CREATE FUNCTION idempotency._signed_kid(signed text)
RETURNS integer
LANGUAGE c IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_signed_kid';

CREATE FUNCTION idempotency._verify(signed text, secret bytea)
RETURNS text
LANGUAGE c IMMUTABLE PARALLEL SAFE
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

-- Superusers only; the internal helpers are not for applications either.
REVOKE EXECUTE ON FUNCTION idempotency.set_key_storage(text), idempotency.rotate_signing_secret(),
    idempotency.retire_signing_secret(integer), idempotency._store_changed(),
    idempotency._random_secret(), idempotency._count(text), idempotency._announce()
    FROM PUBLIC;

-- Superusers only; the internal helpers are not for applications either.
REVOKE EXECUTE ON FUNCTION idempotency.set_key_storage(text), idempotency.rotate_signing_secret(),
    idempotency.retire_signing_secret(integer), idempotency._store_changed(),
    idempotency._random_secret(), idempotency._count(text), idempotency._announce()
    FROM PUBLIC;
