-- Portable edition: signed keys and keys stored as keyed hashes.
--
-- As crates/idempotency-core/src/signing.rs: HMAC-SHA-256, base64url without padding, the same
-- messages signed and the same secrets' rotation.
--
-- Part of the store in SQL and PL/pgSQL: sql/portable/README.md says how the files fit together.

-- HMAC-SHA256 (RFC 2104) on the core sha256(): the native edition's keyed hashes and signatures.
CREATE FUNCTION idempotency._p_hmac(secret bytea, message bytea)
RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_key bytea := secret;
    v_ipad bytea;
    v_opad bytea;
BEGIN
    IF pg_catalog.length(v_key) OPERATOR(pg_catalog.>) 64 THEN
        v_key := pg_catalog.sha256(v_key);
    END IF;
    v_key := v_key OPERATOR(pg_catalog.||) pg_catalog.decode(pg_catalog.repeat('00', 64 OPERATOR(pg_catalog.-) pg_catalog.length(v_key)), 'hex');
    v_ipad := v_key;
    v_opad := v_key;
    FOR i IN 0 .. 63 LOOP
        v_ipad := pg_catalog.set_byte(v_ipad, i, pg_catalog.get_byte(v_key, i) OPERATOR(pg_catalog.#) 54);
        v_opad := pg_catalog.set_byte(v_opad, i, pg_catalog.get_byte(v_key, i) OPERATOR(pg_catalog.#) 92);
    END LOOP;
    RETURN pg_catalog.sha256(v_opad OPERATOR(pg_catalog.||) pg_catalog.sha256(v_ipad OPERATOR(pg_catalog.||) message));
END
$fn$;

-- base64url without padding (RFC 4648 section 5), and its strict inverse (NULL when malformed).
CREATE FUNCTION idempotency._p_b64url(bytes bytea)
RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT pg_catalog.translate(pg_catalog.rtrim(pg_catalog.encode(bytes, 'base64'), '='), E'+/\n', '-_')
$fn$;

-- A secret argument: 16 bytes at least.
CREATE FUNCTION idempotency._p_check_secret(secret bytea)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF secret IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'secret must not be NULL';
    ELSIF pg_catalog.length(secret) OPERATOR(pg_catalog.<) 16 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'secret must be at least 16 bytes';
    END IF;
END
$fn$;

-- The message a signature covers: "<kid>.<key>", then a zero byte and the scope prefix if any.
CREATE FUNCTION idempotency._p_signed_message(kid integer, key text)
RETURNS bytea
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_prefix text := idempotency._p_scope_prefix();
    v_message bytea := pg_catalog.convert_to(kid::text OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||) key, 'UTF8');
BEGIN
    IF v_prefix OPERATOR(pg_catalog.<>) '' THEN
        v_message := v_message OPERATOR(pg_catalog.||) '\x00'::bytea OPERATOR(pg_catalog.||) pg_catalog.convert_to(v_prefix, 'UTF8');
    END IF;
    RETURN v_message;
END
$fn$;

-- A signed key's parts (key, secret id, signature), or NULLs when it is not shaped like one.
CREATE FUNCTION idempotency._p_parse_signed(signed text, OUT key text, OUT kid integer, OUT signature bytea)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_m text[];
BEGIN
    v_m := pg_catalog.regexp_match(signed, '^(.*)\.([^.]*)\.([^.]*)$', 's');
    IF v_m IS NULL OR v_m[1] OPERATOR(pg_catalog.=) '' OR pg_catalog.length(v_m[3]) OPERATOR(pg_catalog.<>) 43
       OR pg_catalog.length(v_m[1]) OPERATOR(pg_catalog.>) @MAX_KEY_CHARS@
       OR v_m[2] OPERATOR(pg_catalog.!~) '^[1-9][0-9]{0,9}$'
       OR v_m[2]::bigint OPERATOR(pg_catalog.>) 2147483647
       -- 43 characters of base64url hold 32 bytes and two bits that must be zero
       OR v_m[3] OPERATOR(pg_catalog.!~) '^[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]$' THEN
        RETURN;
    END IF;
    key := v_m[1];
    kid := v_m[2]::integer;
    signature := pg_catalog.decode(pg_catalog.translate(v_m[3], '-_', '+/') OPERATOR(pg_catalog.||) '=', 'base64');
END
$fn$;

BODY idempotency._rekey
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF digest IS NULL OR pg_catalog.length(digest) OPERATOR(pg_catalog.<>) 32 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'digest must be a 32-byte SHA-256';
    END IF;
    PERFORM idempotency._p_check_secret(secret);
    RETURN pg_catalog.encode(idempotency._p_hmac(secret, digest), 'hex');
END
$fn$;

BODY idempotency._sign
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM idempotency._canon_unicode(key, 'key');
    PERFORM idempotency._canon_check_key('key', key, false);
    IF kid IS NULL OR kid OPERATOR(pg_catalog.<=) 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'kid must be a positive integer';
    END IF;
    PERFORM idempotency._p_check_secret(secret);
    RETURN key OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||) kid OPERATOR(pg_catalog.||) '.'
           OPERATOR(pg_catalog.||) idempotency._p_b64url(idempotency._p_hmac(secret, idempotency._p_signed_message(kid, key)));
END
$fn$;

BODY idempotency._signed_kid
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT p.kid FROM idempotency._p_parse_signed(signed) AS p
$fn$;

BODY idempotency._verify
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p record;
BEGIN
    PERFORM idempotency._p_check_secret(secret);
    SELECT * INTO p FROM idempotency._p_parse_signed(signed);
    IF p.key IS NULL THEN
        RETURN NULL;
    END IF;
    IF idempotency._p_hmac(secret, idempotency._p_signed_message(p.kid, p.key)) OPERATOR(pg_catalog.=) p.signature THEN
        RETURN p.key;
    END IF;
    RETURN NULL;
END
$fn$;

-- 32 bytes from the server's strong random source (gen_random_uuid, in core since PostgreSQL
-- 13: 122 random bits each), so a secret never appears in any SQL text or log.
BODY idempotency._random_secret
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT pg_catalog.sha256(pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
                             OPERATOR(pg_catalog.||) pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
                             OPERATOR(pg_catalog.||) pg_catalog.uuid_send(pg_catalog.gen_random_uuid()))
$fn$;
