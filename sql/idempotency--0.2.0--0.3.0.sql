-- idempotency 0.2.0 -> 0.3.0 (see CHANGELOG.md)
--
-- Hardening after an outside review: a scope prefix no startup option can lift, sweeps and
-- counters kept to their owners, keyed hashes for keys stored hashed (0.2.0's plain SHA-256
-- keys are rekeyed here, without the keys), signed keys bound to the tenant, size limits.
-- Every object is left as a fresh 0.3.0 install creates it (tests/integration/test_upgrade.py
-- compares the two catalogs).

\echo Use "ALTER EXTENSION idempotency UPDATE TO '0.3.0'" to load this file. \quit

-- Refuses a recovery point over idempotency.max_recovery_point_size (54000).
CREATE FUNCTION idempotency._check_recovery_point(recovery_point text)
RETURNS void
LANGUAGE c VOLATILE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_check_recovery_point';

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
                         ELSE 'sha256:' OPERATOR(pg_catalog.||) pg_catalog.left(v_key, 12) OPERATOR(pg_catalog.||) '...' END;
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
    ELSIF p_token OPERATOR(pg_catalog.<) r.token THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: token %s is stale, the current token is %s',
                                        p_action, v_label, p_scope, p_token, r.token),
            HINT = 'another worker took the key over after this lease ran out (or the token is another key''s); abandon this attempt';
    ELSE
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: token %s was never issued for it, the current token is %s',
                                        p_action, v_label, p_scope, p_token, r.token),
            HINT = 'pass the token that claim returned for this key';
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
    PERFORM idempotency._check_recovery_point(checkpoint.recovery_point);
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

-- Keys stored hashed: a keyed hash -------------------------------------------------------------

ALTER TABLE idempotency.config
    ADD COLUMN key_secret bytea CHECK (key_secret IS NULL OR pg_catalog.length(key_secret) OPERATOR(pg_catalog.=) 32);

-- The stored form of a key whose SHA-256 is digest, under secret.
CREATE FUNCTION idempotency._rekey(digest bytea, secret bytea)
RETURNS text
LANGUAGE c IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_rekey';
REVOKE EXECUTE ON FUNCTION idempotency._rekey(bytea, bytea) FROM PUBLIC;

CREATE OR REPLACE FUNCTION idempotency.set_key_storage(mode text)
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

-- 0.2.0 kept hashed keys as their plain hex SHA-256: rewrite them (and hashed audit rows) into
-- the keyed form under a new secret. The SHA-256 is all the keyed hash needs, so no key is
-- required; claims wait on the lock and then find their keys in the new form.
DO $rekey$
DECLARE
    v_secret bytea;
BEGIN
    IF EXISTS (SELECT FROM idempotency.config AS c WHERE c.key_storage OPERATOR(pg_catalog.=) 'sha256') THEN
        LOCK TABLE idempotency.idempotency_keys, idempotency.audit IN ACCESS EXCLUSIVE MODE;
        v_secret := idempotency._random_secret();
        UPDATE idempotency.idempotency_keys AS k
           SET key = idempotency._rekey(pg_catalog.decode(k.key, 'hex'), v_secret);
        UPDATE idempotency.audit AS a
           SET key = idempotency._rekey(pg_catalog.decode(a.key, 'hex'), v_secret)
         WHERE a.key_is_hash;
        UPDATE idempotency.config AS c SET key_secret = v_secret;
        PERFORM idempotency._store_changed();
    END IF;
END
$rekey$;

-- Signed keys are bound to the session's scope prefix ----------------------------------------

-- _sign and _verify bind the signature to the session's idempotency.scope_prefix (a key signed
-- for one tenant does not verify for another): STABLE, not IMMUTABLE.
ALTER FUNCTION idempotency._sign(text, integer, bytea) STABLE;
ALTER FUNCTION idempotency._verify(text, bytea) STABLE;

CREATE OR REPLACE FUNCTION idempotency.verify_key(signed text)
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

-- ---------------------------------------------------------------------------------------------
-- Encodings: the same check as at the top of
-- sql/idempotency.sql. A SQL_ASCII database cannot run 0.3.0 (its library refuses every call
-- that reads text there), so the update says so clearly instead of succeeding.
DO $encoding$
BEGIN
    IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'SQL_ASCII' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'feature_not_supported',
            MESSAGE = 'idempotency does not support databases with encoding SQL_ASCII: their text has no defined characters, so it cannot be hashed as Unicode',
            HINT = 'create the database with ENCODING ''UTF8'' and install the extension there';
    END IF;
END
$encoding$;
-- End of the encodings section.
-- ---------------------------------------------------------------------------------------------
