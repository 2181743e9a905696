-- Portable edition: argument checks and the stored form of a key.
--
-- The native edition's rules (crates/idempotency-core/src/arguments.rs, src/api/): the same checks
-- in the same order, with the same SQLSTATEs and messages.
--
-- Part of the store in SQL and PL/pgSQL: sql/portable/README.md says how the files fit together.

-- Claims, completions and sweeps write: refused at once in a read-only transaction.
CREATE FUNCTION idempotency._p_refuse_read_only(function_name text)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'read_only_sql_transaction',
            MESSAGE = pg_catalog.format('idempotency.%s cannot run in a read-only transaction%s', function_name,
                                        CASE WHEN pg_catalog.pg_is_in_recovery() THEN ' (this server is a standby)' ELSE '' END),
            HINT = 'claim, complete and sweep on the primary; idempotency.lookup works on a standby';
    END IF;
END
$fn$;

-- The scope argument's rules: not NULL, at most @MAX_KEY_CHARS@ characters, under the session's prefix.
CREATE FUNCTION idempotency._p_check_scope(scope text)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_prefix text;
BEGIN
    IF scope IS NULL OR pg_catalog.length(scope) OPERATOR(pg_catalog.>) @MAX_KEY_CHARS@ THEN
        PERFORM idempotency._canon_check_key('scope', scope, true);  -- raises
    END IF;
    v_prefix := idempotency._p_scope_prefix();
    IF NOT pg_catalog.starts_with(scope, v_prefix) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'insufficient_privilege',
            MESSAGE = idempotency._canon_message(pg_catalog.format('scope %s is outside this role''s scopes: its scope prefix is %s',
                                        idempotency._p_debug(scope), idempotency._p_debug(v_prefix)));
    END IF;
END
$fn$;

-- A text as Rust's Debug writes a string, whole (the native edition's messages quote values
-- so): _canon_quote's escapes of each piece of 40 characters (which it does not cut), inside
-- one pair of quotes.
CREATE FUNCTION idempotency._p_debug(value text)
RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT '"' OPERATOR(pg_catalog.||)
           pg_catalog.string_agg(pg_catalog.substr(p.quoted, 2, pg_catalog.length(p.quoted) OPERATOR(pg_catalog.-) 2), '' ORDER BY p.n)
           OPERATOR(pg_catalog.||) '"'
      FROM (SELECT idempotency._canon_quote(pg_catalog.substr(value, i, 40)) AS quoted, i AS n
              FROM pg_catalog.generate_series(1, GREATEST(pg_catalog.length(value), 1), 40) AS i) AS p
$fn$;

-- The owner of the store: the extension's owner, or the schema's where the plain script made it.
CREATE FUNCTION idempotency._p_owner()
RETURNS oid
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT COALESCE((SELECT e.extowner FROM pg_catalog.pg_extension AS e
                      WHERE e.extname OPERATOR(pg_catalog.=) 'idempotency'),
                    (SELECT n.nspowner FROM pg_catalog.pg_namespace AS n
                      WHERE n.nspname OPERATOR(pg_catalog.=) 'idempotency'))
$fn$;

-- Which rows a sweep may touch: all for the store's owner and superusers (and members of the
-- owner's role), those under the session's scope prefix for a tenant, none otherwise.
CREATE FUNCTION idempotency._p_sweep_prefix(function_name text)
RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_prefix text;
BEGIN
    IF (SELECT a.rolsuper FROM pg_catalog.pg_roles AS a WHERE a.rolname OPERATOR(pg_catalog.=) SESSION_USER)
       OR pg_catalog.pg_has_role(SESSION_USER, idempotency._p_owner(), 'USAGE') THEN
        RETURN '';
    END IF;
    v_prefix := idempotency._p_scope_prefix();
    IF v_prefix OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'insufficient_privilege',
            MESSAGE = pg_catalog.format('idempotency.%s of the whole store is for the extension''s owner and superusers', function_name),
            HINT = 'run it as the owner (the background sweeper or pg_cron do), or bind this role to a scope prefix (idempotency.role_settings) to sweep only its own scopes';
    END IF;
    RETURN v_prefix;
END
$fn$;

-- The batch_size argument of the sweep functions (NULL: idempotency.sweep_batch_size).
CREATE FUNCTION idempotency._p_batch_size(batch_size integer)
RETURNS integer
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_batch integer := COALESCE(batch_size, idempotency._p_setting('idempotency.sweep_batch_size', 10000, ''));
BEGIN
    IF v_batch OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('batch_size must be positive (got %s)', v_batch);
    END IF;
    RETURN v_batch;
END
$fn$;

-- A TTL or lease checked on its own (positive, at most ten years, months counted as 30 days)
-- and on the clock (now() + it after now() and at most ten calendar years ahead); returns
-- now() + it. `name` is the argument or the setting that gave the value.
CREATE FUNCTION idempotency._p_duration(name text, value interval)
RETURNS timestamptz
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_months numeric;
    v_days numeric;
    v_micros numeric;
    v_total numeric;
    v_ends timestamptz;
BEGIN
    IF NOT pg_catalog.isfinite(value) THEN
        v_total := CASE WHEN value OPERATOR(pg_catalog.>) '0'::interval THEN 1e30 ELSE -1 END;
    ELSE
        v_months := EXTRACT(year FROM value) OPERATOR(pg_catalog.*) 12 OPERATOR(pg_catalog.+) EXTRACT(month FROM value);
        v_days := EXTRACT(day FROM value);
        v_micros := EXTRACT(epoch FROM (value OPERATOR(pg_catalog.-)
                        pg_catalog.make_interval(months => v_months::integer, days => v_days::integer)))
                    OPERATOR(pg_catalog.*) 1000000;
        v_total := (v_months OPERATOR(pg_catalog.*) 30 OPERATOR(pg_catalog.+) v_days) OPERATOR(pg_catalog.*) 86400000000
                   OPERATOR(pg_catalog.+) v_micros;
    END IF;
    IF v_total OPERATOR(pg_catalog.<=) 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('%s must be a positive interval', name);
    END IF;
    IF v_total OPERATOR(pg_catalog.>) 316224000000000 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('%s must be at most 10 years', name);
    END IF;
    v_ends := pg_catalog.now() OPERATOR(pg_catalog.+) value;
    IF v_ends OPERATOR(pg_catalog.<=) pg_catalog.now() THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('%s must end in the future: now() + %s is not after now() (%s)',
                                        name, name, idempotency._canon_quote(value::text));
    END IF;
    IF v_ends OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.+) '120 months'::interval) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('%s must be at most 10 years (got %s)', name, idempotency._canon_quote(value::text));
    END IF;
    RETURN v_ends;
END
$fn$;

-- The TTL and lease of a claim: each argument, or its setting when NULL; with no lease given,
-- least(idempotency.default_lease, ttl); a lease that would outlive the key is refused.
CREATE FUNCTION idempotency._p_ttl_and_lease(ttl interval, lease interval, OUT ttl_value interval, OUT lease_value interval)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_ttl_name text := 'ttl';
    v_lease_name text := 'lease';
    v_ttl_ends timestamptz;
    v_lease_ends timestamptz;
BEGIN
    IF ttl IS NULL THEN
        v_ttl_name := 'idempotency.default_ttl';
        ttl_value := pg_catalog.make_interval(secs => idempotency._p_setting('idempotency.default_ttl', @DEFAULT_TTL_SECS@, 's'));
    ELSE
        ttl_value := ttl;
    END IF;
    v_ttl_ends := idempotency._p_duration(v_ttl_name, ttl_value);
    IF lease IS NULL THEN
        lease_value := pg_catalog.make_interval(secs => idempotency._p_setting('idempotency.default_lease', @DEFAULT_LEASE_SECS@, 's'));
        v_lease_ends := idempotency._p_duration('idempotency.default_lease', lease_value);
        IF v_lease_ends OPERATOR(pg_catalog.>) v_ttl_ends THEN
            lease_value := ttl_value;
            v_lease_ends := v_ttl_ends;
        ELSE
            v_lease_name := 'idempotency.default_lease';
        END IF;
    ELSE
        lease_value := lease;
        v_lease_ends := idempotency._p_duration('lease', lease_value);
    END IF;
    IF v_lease_ends OPERATOR(pg_catalog.>) v_ttl_ends THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('%s (%s) must not be longer than %s (%s): the lease would outlive the key',
                                        v_lease_name, idempotency._canon_quote(lease_value::text),
                                        v_ttl_name, idempotency._canon_quote(ttl_value::text));
    END IF;
END
$fn$;

-- SHA-256 of a request's exact canonical form; errors name `arg`.
CREATE FUNCTION idempotency._p_request_hash(request jsonb, arg text)
RETURNS bytea
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF request IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM idempotency._canon_unicode_doc(request, arg);
    RETURN pg_catalog.sha256(pg_catalog.convert_to(idempotency._canon_text(request, true, arg), 'UTF8'));
END
$fn$;


-- A stored key as messages name it: quoted, or (hashed) where the store keeps keys hashed.
CREATE FUNCTION idempotency._p_key_label(stored text)
RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN CASE WHEN EXISTS (SELECT FROM idempotency.config AS c
                              WHERE c.key_storage OPERATOR(pg_catalog.=) 'sha256')
                THEN '(hashed)' ELSE idempotency._p_debug(stored) END;
END
$fn$;

BODY idempotency._stored_key
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    c record;
BEGIN
    -- The checks of _canon_unicode, _canon_check_key and _p_check_scope tested in the statement
    -- that reads the store's configuration and the scope prefix (the expression of
    -- _p_scope_prefix, which must stay the same: a change there changes this copy too); their
    -- functions are called
    -- only where one may fail (they raise its error) or the database is not UTF-8 (each
    -- statement, and each nested call, costs more than the checks on this path, run by every
    -- claim and completion, in every transaction).
    SELECT pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8'
           AND key IS NOT NULL AND key OPERATOR(pg_catalog.<>) '' AND pg_catalog.length(key) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           AND scope IS NOT NULL AND pg_catalog.length(scope) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           AND pg_catalog.starts_with(scope, COALESCE(
                   (SELECT r.scope_prefix FROM idempotency.role_settings AS r
                     WHERE r.role::pg_catalog.oid OPERATOR(pg_catalog.=) COALESCE(
                           (SELECT s.role::pg_catalog.oid FROM idempotency.role_settings AS s
                             WHERE s.role::pg_catalog.oid OPERATOR(pg_catalog.=)
                                   (SELECT b.oid FROM pg_catalog.pg_roles AS b
                                     WHERE b.rolname OPERATOR(pg_catalog.=) pg_catalog.current_setting('role')::pg_catalog.name)),
                           (SELECT a.oid FROM pg_catalog.pg_roles AS a WHERE a.rolname OPERATOR(pg_catalog.=) SESSION_USER))),
                   pg_catalog.current_setting('idempotency.scope_prefix', true), '')) AS ok,
           x.key_storage, x.key_secret
      INTO c
      FROM (SELECT) AS one LEFT JOIN idempotency.config AS x ON true;
    IF c.ok IS NOT TRUE THEN
        IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.<>) 'UTF8' THEN
            PERFORM idempotency._canon_unicode(key, 'key');
            PERFORM idempotency._canon_unicode(scope, 'scope');
        END IF;
        PERFORM idempotency._canon_check_key('key', key, false);
        PERFORM idempotency._p_check_scope(scope);
    END IF;
    IF c.key_storage IS NULL OR c.key_storage OPERATOR(pg_catalog.=) 'plain' THEN
        RETURN key;
    ELSIF c.key_secret IS NULL THEN
        RETURN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(key, 'UTF8')), 'hex');
    END IF;
    RETURN pg_catalog.encode(idempotency._p_hmac(c.key_secret, pg_catalog.sha256(pg_catalog.convert_to(key, 'UTF8'))), 'hex');
END
$fn$;

BODY idempotency._check_recovery_point
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF recovery_point IS NOT NULL THEN
        PERFORM idempotency._p_check_size('recovery_point',
            pg_catalog.octet_length(recovery_point)::bigint OPERATOR(pg_catalog.+) 4, 'recovery_point');
    END IF;
END
$fn$;
