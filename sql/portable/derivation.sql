-- Portable edition: derive_key, cron_key and request_fingerprint in PL/pgSQL, with the native
-- edition's results, checks, SQLSTATEs and messages (crates/idempotency-core/src/derivation.rs
-- and arguments.rs). Every function pins search_path; every reference is schema-qualified.

-- Refuses a document nested deeper than @MAX_DEPTH@ levels, naming the argument (as reading a jsonb
-- argument does in the native edition, before any other check of the call).
CREATE FUNCTION idempotency._canon_check_depth(doc jsonb, arg text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF pg_catalog.jsonb_path_exists(doc,
           'strict $.**{@MAX_DEPTH@ to last} ? (@.type() == "object" || @.type() == "array")') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'statement_too_complex',
            MESSAGE = arg OPERATOR(pg_catalog.||) ': document is nested deeper than @MAX_DEPTH@ levels';
    END IF;
END
$fn$;

-- A key-like argument: not NULL, not empty (unless allowed), at most @MAX_KEY_CHARS@ characters.
CREATE FUNCTION idempotency._canon_check_key(arg text, value text, allow_empty boolean)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF value IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = arg OPERATOR(pg_catalog.||) ' must not be NULL';
    END IF;
    IF NOT allow_empty AND value OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = arg OPERATOR(pg_catalog.||) ' must not be empty';
    END IF;
    IF pg_catalog.length(value) OPERATOR(pg_catalog.>) @MAX_KEY_CHARS@ THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('%s must be at most @MAX_KEY_CHARS@ characters (got %s)', arg, pg_catalog.length(value));
    END IF;
END
$fn$;

BODY idempotency.derive_key
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_key text;
BEGIN
    PERFORM idempotency._canon_unicode(parent, 'parent');
    PERFORM idempotency._canon_unicode(step, 'step');
    PERFORM idempotency._canon_unicode_doc(params, 'params');
    IF params IS NOT NULL THEN
        PERFORM idempotency._canon_check_depth(params, 'params');
    END IF;
    PERFORM idempotency._canon_check_key('parent', parent, false);
    IF step IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'step must not be NULL';
    END IF;
    IF step OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'step must not be empty';
    END IF;
    IF pg_catalog.strpos(step, ':') OPERATOR(pg_catalog.>) 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'step must not contain '':'' (it separates the parts of a derived key)';
    END IF;
    IF step OPERATOR(pg_catalog.~) '^[0-9a-f]{16}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('step must not be 16 lowercase hex digits (got "%s"): that form marks the params hash, so the key could equal another derivation''s', step);
    END IF;
    v_key := parent OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) step;
    IF params IS NOT NULL THEN
        v_key := v_key OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) pg_catalog.left(pg_catalog.encode(
                     pg_catalog.sha256(pg_catalog.convert_to(idempotency._canon_text(params, true, 'params'), 'UTF8')),
                     'hex'), 16);
    END IF;
    IF pg_catalog.length(v_key) OPERATOR(pg_catalog.>) @MAX_KEY_CHARS@ THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'derived key would be longer than @MAX_KEY_CHARS@ characters: shorten parent or step';
    END IF;
    RETURN v_key;
END
$fn$;

-- The proleptic Gregorian date (y, m, d) of a day counted from 1970-01-01, years astronomical
-- (0 is 1 BC), for any day (PostgreSQL's date stops at 4713 BC), as the native edition computes
-- it (Howard Hinnant's civil_from_days).
CREATE FUNCTION idempotency._canon_civil(days numeric, OUT y numeric, OUT m numeric, OUT d numeric)
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_z numeric := days OPERATOR(pg_catalog.+) 719468;
    v_era numeric;
    v_doe numeric;
    v_yoe numeric;
    v_doy numeric;
    v_mp numeric;
BEGIN
    v_era := pg_catalog.div(v_z OPERATOR(pg_catalog.-) CASE WHEN v_z OPERATOR(pg_catalog.<) 0 THEN 146096 ELSE 0 END, 146097);
    v_doe := v_z OPERATOR(pg_catalog.-) (v_era OPERATOR(pg_catalog.*) 146097);
    v_yoe := pg_catalog.div(v_doe OPERATOR(pg_catalog.-) pg_catalog.div(v_doe, 1460) OPERATOR(pg_catalog.+) pg_catalog.div(v_doe, 36524)
                            OPERATOR(pg_catalog.-) pg_catalog.div(v_doe, 146096), 365);
    v_doy := v_doe OPERATOR(pg_catalog.-) (365 OPERATOR(pg_catalog.*) v_yoe OPERATOR(pg_catalog.+) pg_catalog.div(v_yoe, 4)
                                          OPERATOR(pg_catalog.-) pg_catalog.div(v_yoe, 100));
    v_mp := pg_catalog.div(5 OPERATOR(pg_catalog.*) v_doy OPERATOR(pg_catalog.+) 2, 153);
    d := v_doy OPERATOR(pg_catalog.-) pg_catalog.div(153 OPERATOR(pg_catalog.*) v_mp OPERATOR(pg_catalog.+) 2, 5) OPERATOR(pg_catalog.+) 1;
    m := CASE WHEN v_mp OPERATOR(pg_catalog.<) 10 THEN v_mp OPERATOR(pg_catalog.+) 3 ELSE v_mp OPERATOR(pg_catalog.-) 9 END;
    y := v_yoe OPERATOR(pg_catalog.+) (v_era OPERATOR(pg_catalog.*) 400)
         OPERATOR(pg_catalog.+) CASE WHEN m OPERATOR(pg_catalog.<=) 2 THEN 1 ELSE 0 END;
END
$fn$;

-- The day, counted from 1970-01-01, of the first of month m of year y (astronomical), as the
-- native edition computes it (Howard Hinnant's days_from_civil).
CREATE FUNCTION idempotency._canon_month_start(y numeric, m numeric)
RETURNS numeric
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_y numeric := y OPERATOR(pg_catalog.-) CASE WHEN m OPERATOR(pg_catalog.<=) 2 THEN 1 ELSE 0 END;
    v_era numeric;
    v_yoe numeric;
    v_doy numeric;
BEGIN
    v_era := pg_catalog.div(v_y OPERATOR(pg_catalog.-) CASE WHEN v_y OPERATOR(pg_catalog.<) 0 THEN 399 ELSE 0 END, 400);
    v_yoe := v_y OPERATOR(pg_catalog.-) (v_era OPERATOR(pg_catalog.*) 400);
    v_doy := pg_catalog.div(153 OPERATOR(pg_catalog.*) (m OPERATOR(pg_catalog.+) CASE WHEN m OPERATOR(pg_catalog.>) 2 THEN -3 ELSE 9 END)
                            OPERATOR(pg_catalog.+) 2, 5);
    RETURN v_era OPERATOR(pg_catalog.*) 146097
           OPERATOR(pg_catalog.+) (v_yoe OPERATOR(pg_catalog.*) 365 OPERATOR(pg_catalog.+) pg_catalog.div(v_yoe, 4)
                                   OPERATOR(pg_catalog.-) pg_catalog.div(v_yoe, 100) OPERATOR(pg_catalog.+) v_doy)
           OPERATOR(pg_catalog.-) 719468;
END
$fn$;

-- job:<slot start, UTC>/<slot length>: a slot is whole months (floored to calendar months
-- since 1970-01) or a fixed length without months (floored on the Unix epoch).
BODY idempotency.cron_key
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    c_day    CONSTANT numeric := 86400000000;
    v_months numeric;
    v_days   numeric;
    v_micros numeric;
    v_unix   numeric;
    v_start  numeric;
    v_len    numeric;
    v_index  numeric;
    v_date   record;
    v_start_day numeric;
    v_length text;
    v_in_day numeric;
    v_secs   numeric;
    v_frac   numeric;
    v_key    text;
BEGIN
    PERFORM idempotency._canon_unicode(job, 'job');
    PERFORM idempotency._canon_check_key('job', job, false);
    IF scheduled_at IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'scheduled_at must not be NULL';
    END IF;
    IF slot IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'slot must not be NULL';
    END IF;
    IF NOT pg_catalog.isfinite(scheduled_at) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'scheduled_at must be finite';
    END IF;
    v_months := pg_catalog.trunc((pg_catalog.extract('year', slot) OPERATOR(pg_catalog.*) 12)
                OPERATOR(pg_catalog.+) pg_catalog.extract('month', slot));
    v_days := pg_catalog.trunc(pg_catalog.extract('day', slot));
    -- Whole microseconds, without the scale extract gives them.
    v_micros := pg_catalog.trunc(pg_catalog.extract('hour', slot) OPERATOR(pg_catalog.*) 3600000000
                OPERATOR(pg_catalog.+) (pg_catalog.extract('minute', slot) OPERATOR(pg_catalog.*) 60000000)
                OPERATOR(pg_catalog.+) pg_catalog.extract('microseconds', slot));
    -- Microseconds since 1970 UTC, exactly (extract's epoch of a timestamptz is rounded in the
    -- last thirty years of its range): the days, and the microseconds of the day.
    v_unix := ((pg_catalog.timezone('UTC', scheduled_at)::pg_catalog.date OPERATOR(pg_catalog.-) '1970-01-01'::pg_catalog.date)::pg_catalog.numeric
               OPERATOR(pg_catalog.*) c_day)
              OPERATOR(pg_catalog.+) pg_catalog.trunc(pg_catalog.extract('epoch', pg_catalog.timezone('UTC', scheduled_at)::pg_catalog.time)
                                                      OPERATOR(pg_catalog.*) 1000000);
    -- The native edition counts Unix microseconds in 64 bits: the last thirty years of
    -- timestamptz's range are beyond them.
    IF v_unix OPERATOR(pg_catalog.>) 9223372036854775807 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'scheduled_at is out of range';
    END IF;
    IF v_months OPERATOR(pg_catalog.<>) 0 THEN
        IF v_days OPERATOR(pg_catalog.<>) 0 OR v_micros OPERATOR(pg_catalog.<>) 0 OR v_months OPERATOR(pg_catalog.<) 0 THEN
            RAISE EXCEPTION USING
                ERRCODE = 'invalid_parameter_value',
                MESSAGE = 'slot must be whole months, or a positive length without months';
        END IF;
        -- The month of the day (floored: a Euclidean quotient), counted from 1970-01.
        v_date := idempotency._canon_civil(pg_catalog.div(v_unix OPERATOR(pg_catalog.-)
                      CASE WHEN v_unix OPERATOR(pg_catalog.<) 0 THEN c_day OPERATOR(pg_catalog.-) 1 ELSE 0 END, c_day));
        v_index := (v_date.y OPERATOR(pg_catalog.-) 1970) OPERATOR(pg_catalog.*) 12
                   OPERATOR(pg_catalog.+) (v_date.m OPERATOR(pg_catalog.-) 1);
        -- Floored to a multiple of the slot's months (a Euclidean remainder: never negative).
        v_index := v_index OPERATOR(pg_catalog.-)
                   pg_catalog.mod(pg_catalog.mod(v_index, v_months) OPERATOR(pg_catalog.+) v_months, v_months);
        v_start := idempotency._canon_month_start(
                       1970 OPERATOR(pg_catalog.+) pg_catalog.div(v_index OPERATOR(pg_catalog.-)
                           CASE WHEN v_index OPERATOR(pg_catalog.<) 0 THEN 11 ELSE 0 END, 12),
                       pg_catalog.mod(pg_catalog.mod(v_index, 12) OPERATOR(pg_catalog.+) 12, 12) OPERATOR(pg_catalog.+) 1)
                   OPERATOR(pg_catalog.*) c_day;
        -- A start beyond 64-bit microseconds (a slot of a million years, floored from before
        -- 1970), which the native edition counts in.
        IF v_start OPERATOR(pg_catalog.<) -9223372036854775808 THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'slot is too long';
        END IF;
        v_length := 'P' OPERATOR(pg_catalog.||) v_months::pg_catalog.text OPERATOR(pg_catalog.||) 'M';
    ELSE
        v_len := (v_days OPERATOR(pg_catalog.*) c_day) OPERATOR(pg_catalog.+) v_micros;
        IF v_len OPERATOR(pg_catalog.<=) 0 THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'slot must be a positive interval';
        END IF;
        -- The native edition counts slots in 64-bit microseconds.
        IF v_len OPERATOR(pg_catalog.>) 9223372036854775807 THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = 'slot is too long';
        END IF;
        v_start := v_unix OPERATOR(pg_catalog.-)
                   pg_catalog.mod(pg_catalog.mod(v_unix, v_len) OPERATOR(pg_catalog.+) v_len, v_len);
        IF pg_catalog.mod(v_len, c_day) OPERATOR(pg_catalog.=) 0 THEN
            v_length := pg_catalog.format('P%sD', pg_catalog.div(v_len, c_day));
        ELSE
            v_secs := pg_catalog.div(v_len, 1000000);
            v_frac := pg_catalog.mod(v_len, 1000000);
            v_length := 'PT' OPERATOR(pg_catalog.||) v_secs::pg_catalog.text
                        OPERATOR(pg_catalog.||) CASE WHEN v_frac OPERATOR(pg_catalog.=) 0 THEN ''
                            ELSE '.' OPERATOR(pg_catalog.||) pg_catalog.rtrim(pg_catalog.lpad(v_frac::pg_catalog.text, 6, '0'), '0') END
                        OPERATOR(pg_catalog.||) 'S';
        END IF;
    END IF;
    -- The start as YYYY-MM-DDTHH:MM:SS[.fraction]Z.
    v_start_day := pg_catalog.div(v_start OPERATOR(pg_catalog.-)
                       CASE WHEN v_start OPERATOR(pg_catalog.<) 0 THEN c_day OPERATOR(pg_catalog.-) 1 ELSE 0 END, c_day);
    v_date := idempotency._canon_civil(v_start_day);
    v_in_day := v_start OPERATOR(pg_catalog.-) (v_start_day OPERATOR(pg_catalog.*) c_day);
    v_secs := pg_catalog.div(v_in_day, 1000000);
    v_frac := pg_catalog.mod(v_in_day, 1000000);
    v_key := job OPERATOR(pg_catalog.||) ':'
             -- The year in at least four characters, its sign included (lpad cuts a longer text).
             OPERATOR(pg_catalog.||) CASE WHEN v_date.y OPERATOR(pg_catalog.<) 0
                 THEN '-' OPERATOR(pg_catalog.||) pg_catalog.lpad(pg_catalog.abs(v_date.y)::pg_catalog.text,
                          GREATEST(3, pg_catalog.length(pg_catalog.abs(v_date.y)::pg_catalog.text)), '0')
                 ELSE pg_catalog.lpad(v_date.y::pg_catalog.text, GREATEST(4, pg_catalog.length(v_date.y::pg_catalog.text)), '0') END
             OPERATOR(pg_catalog.||) pg_catalog.format('-%s-%s', pg_catalog.lpad(v_date.m::pg_catalog.text, 2, '0'),
                                                      pg_catalog.lpad(v_date.d::pg_catalog.text, 2, '0'))
             OPERATOR(pg_catalog.||) pg_catalog.format('T%s:%s:%s',
                 pg_catalog.lpad(pg_catalog.div(v_secs, 3600)::pg_catalog.text, 2, '0'),
                 pg_catalog.lpad(pg_catalog.mod(pg_catalog.div(v_secs, 60), 60)::pg_catalog.text, 2, '0'),
                 pg_catalog.lpad(pg_catalog.mod(v_secs, 60)::pg_catalog.text, 2, '0'))
             OPERATOR(pg_catalog.||) CASE WHEN v_frac OPERATOR(pg_catalog.=) 0 THEN ''
                 ELSE '.' OPERATOR(pg_catalog.||) pg_catalog.rtrim(pg_catalog.lpad(v_frac::pg_catalog.text, 6, '0'), '0') END
             OPERATOR(pg_catalog.||) 'Z/' OPERATOR(pg_catalog.||) v_length;
    IF pg_catalog.length(v_key) OPERATOR(pg_catalog.>) @MAX_KEY_CHARS@ THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'cron key would be longer than @MAX_KEY_CHARS@ characters: shorten job';
    END IF;
    RETURN v_key;
END
$fn$;

-- SHA-256 of the canonical form of {"body": body, "method": METHOD, "path": path, "query": query}
-- (query NULL: {}; body NULL: null).
BODY idempotency.request_fingerprint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM idempotency._canon_unicode(method, 'method');
    PERFORM idempotency._canon_unicode(path, 'path');
    PERFORM idempotency._canon_unicode_doc(query, 'query');
    IF query IS NOT NULL THEN
        PERFORM idempotency._canon_check_depth(query, 'query');
        IF pg_catalog.jsonb_typeof(query) OPERATOR(pg_catalog.<>) 'object' THEN
            RAISE EXCEPTION USING
                ERRCODE = 'invalid_parameter_value',
                MESSAGE = 'query must be a JSON object of parameter names to values';
        END IF;
    END IF;
    PERFORM idempotency._canon_unicode_doc(body, 'body');
    IF body IS NOT NULL THEN
        PERFORM idempotency._canon_check_depth(body, 'body');
    END IF;
    IF method IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'method must not be NULL';
    END IF;
    IF method OPERATOR(pg_catalog.!~) '^[A-Za-z0-9!#$%&''*+.^_`|~-]+$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'method must be a non-empty HTTP token such as POST';
    END IF;
    IF path IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'path must not be NULL';
    END IF;
    RETURN pg_catalog.sha256(pg_catalog.convert_to(idempotency._canon_text(
        pg_catalog.jsonb_build_object(
            'body', COALESCE(body, 'null'::pg_catalog.jsonb),
            'method', pg_catalog.translate(method, 'abcdefghijklmnopqrstuvwxyz', 'ABCDEFGHIJKLMNOPQRSTUVWXYZ'),
            'path', path,
            'query', COALESCE(query, '{}'::pg_catalog.jsonb)),
        true, 'body', 1001), 'UTF8'));
END
$fn$;
