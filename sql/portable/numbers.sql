-- Portable edition: numbers of the canonical form.
--
-- Exact numbers in the ECMAScript layout, and in 'rfc8785' mode the nearest double written as
-- ECMAScript's Number::toString does (crates/idempotency-core/src/canonical.rs).
--
-- Part of the canonical form in SQL and PL/pgSQL (canonical.sql; sql/portable/README.md).

-- The ECMAScript Number::toString layout of an exact decimal number written as
-- -?digits(.digits)?([eE][+-]?digits)? (numeric's output, or float8's shortest output).
CREATE FUNCTION idempotency._canon_layout(num text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_rest   text := num;
    v_sign   text := '';
    v_exp    integer := 0;
    v_at     integer;
    v_int    text;
    v_frac   text := '';
    v_digits text;
    v_s      text;
    v_k      integer;
    v_n      integer;
BEGIN
    IF pg_catalog.left(v_rest, 1) OPERATOR(pg_catalog.=) '-' THEN
        v_sign := '-';
        v_rest := pg_catalog.substr(v_rest, 2);
    END IF;
    v_at := pg_catalog.strpos(pg_catalog.lower(v_rest), 'e');
    IF v_at OPERATOR(pg_catalog.>) 0 THEN
        v_exp := pg_catalog.substr(v_rest, v_at OPERATOR(pg_catalog.+) 1)::pg_catalog.int4;
        v_rest := pg_catalog.left(v_rest, v_at OPERATOR(pg_catalog.-) 1);
    END IF;
    v_at := pg_catalog.strpos(v_rest, '.');
    IF v_at OPERATOR(pg_catalog.>) 0 THEN
        v_int := pg_catalog.left(v_rest, v_at OPERATOR(pg_catalog.-) 1);
        v_frac := pg_catalog.substr(v_rest, v_at OPERATOR(pg_catalog.+) 1);
    ELSE
        v_int := v_rest;
    END IF;
    v_digits := pg_catalog.ltrim(v_int OPERATOR(pg_catalog.||) v_frac, '0');
    IF v_digits OPERATOR(pg_catalog.=) '' THEN
        RETURN '0';  -- zero, -0 included
    END IF;
    v_s := pg_catalog.rtrim(v_digits, '0');
    v_k := pg_catalog.length(v_s);
    -- value = 0.s * 10^n
    v_n := v_exp OPERATOR(pg_catalog.-) pg_catalog.length(v_frac)
           OPERATOR(pg_catalog.+) pg_catalog.length(v_digits);
    IF v_k OPERATOR(pg_catalog.<=) v_n AND v_n OPERATOR(pg_catalog.<=) 21 THEN
        RETURN v_sign OPERATOR(pg_catalog.||) v_s
               OPERATOR(pg_catalog.||) pg_catalog.repeat('0', v_n OPERATOR(pg_catalog.-) v_k);
    ELSIF 0 OPERATOR(pg_catalog.<) v_n AND v_n OPERATOR(pg_catalog.<=) 21 THEN
        RETURN v_sign OPERATOR(pg_catalog.||) pg_catalog.left(v_s, v_n)
               OPERATOR(pg_catalog.||) '.'
               OPERATOR(pg_catalog.||) pg_catalog.substr(v_s, v_n OPERATOR(pg_catalog.+) 1);
    ELSIF -6 OPERATOR(pg_catalog.<) v_n AND v_n OPERATOR(pg_catalog.<=) 0 THEN
        RETURN v_sign OPERATOR(pg_catalog.||) '0.'
               OPERATOR(pg_catalog.||) pg_catalog.repeat('0', OPERATOR(pg_catalog.-) v_n)
               OPERATOR(pg_catalog.||) v_s;
    END IF;
    RETURN v_sign OPERATOR(pg_catalog.||) pg_catalog.left(v_s, 1)
           OPERATOR(pg_catalog.||) CASE WHEN v_k OPERATOR(pg_catalog.>) 1
                                        THEN '.' OPERATOR(pg_catalog.||) pg_catalog.substr(v_s, 2)
                                        ELSE '' END
           OPERATOR(pg_catalog.||) 'e'
           OPERATOR(pg_catalog.||) CASE WHEN v_n OPERATOR(pg_catalog.>) 0 THEN '+' ELSE '-' END
           OPERATOR(pg_catalog.||) pg_catalog.abs(v_n OPERATOR(pg_catalog.-) 1)::pg_catalog.text;
END
$fn$;

-- Whether x >= 2^k, exactly (x >= 0).
CREATE FUNCTION idempotency._canon_at_least_pow2(x numeric, k integer)
RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT CASE WHEN k OPERATOR(pg_catalog.>=) 0
                THEN x OPERATOR(pg_catalog.>=) pg_catalog.power(2::pg_catalog.numeric, k::pg_catalog.numeric)
                ELSE x OPERATOR(pg_catalog.*) pg_catalog.power(2::pg_catalog.numeric, (OPERATOR(pg_catalog.-) k)::pg_catalog.numeric)
                     OPERATOR(pg_catalog.>=) 1::pg_catalog.numeric END
$fn$;

-- A number in 'rfc8785' mode: the nearest double (ties to even), written as ECMAScript writes
-- it; NULL when it is outside the double range (the caller raises 22003). The rounding is
-- done here in exact numeric arithmetic rather than left to the C library's strtod (through
-- float8in): m * 2^e with m an integer below 2^53, then made a float8 without rounding (halves
-- of m, times an exact power of 2).
-- Bounds, exactly: |x| >= 2^1024 - 2^970 rounds to infinity; |x| <= 2^-1075 rounds to zero.
-- float8's output with extra_float_digits > 0 is the shortest spelling that reads back as the
-- same double: the digits ECMAScript chooses.
CREATE FUNCTION idempotency._canon_double(num numeric)
RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
SET extra_float_digits = 1
AS $fn$
DECLARE
    v_abs numeric := pg_catalog.abs(num);
    v_e   integer;
    v_p   numeric;
    v_y   numeric;
    v_m   numeric;
    v_r   numeric;
    v_d   float8;
    v_text   text;
    v_best   integer;
    v_c      numeric;
    v_f      integer;
    v_n      numeric;
    v_digits integer;
    v_i      integer;
BEGIN
    IF v_abs OPERATOR(pg_catalog.>=) 179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792::pg_catalog.numeric THEN
        RETURN NULL;
    END IF;
    IF v_abs OPERATOR(pg_catalog.*) 404804506614621236704990693437834614099113299528284236713802716054860679135990693783920767402874248990374155728633623822779617474771586953734026799881477019843034848553132722728933815484186432682479535356945490137124014966849385397236206711298319112681620113024717539104666829230461005064372655017292012526615415482186989568::pg_catalog.numeric
       OPERATOR(pg_catalog.<=) 1::pg_catalog.numeric THEN
        RETURN '0';  -- -0 too
    END IF;
    -- The binary exponent e with 2^52 <= |x| / 2^e < 2^53, at least -1074 (subnormals).
    v_e := pg_catalog.floor(pg_catalog.log(2::pg_catalog.numeric, v_abs))::pg_catalog.int4 OPERATOR(pg_catalog.-) 52;
    WHILE NOT idempotency._canon_at_least_pow2(v_abs, v_e OPERATOR(pg_catalog.+) 52) LOOP
        v_e := v_e OPERATOR(pg_catalog.-) 1;
    END LOOP;
    WHILE idempotency._canon_at_least_pow2(v_abs, v_e OPERATOR(pg_catalog.+) 53) LOOP
        v_e := v_e OPERATOR(pg_catalog.+) 1;
    END LOOP;
    IF v_e OPERATOR(pg_catalog.<) -1074 THEN
        v_e := -1074;
    END IF;
    -- m = |x| / 2^e rounded to an integer, ties to even; v_r is the sign of (remainder - half).
    IF v_e OPERATOR(pg_catalog.>=) 0 THEN
        v_p := pg_catalog.power(2::pg_catalog.numeric, v_e::pg_catalog.numeric);
        v_m := pg_catalog.div(v_abs, v_p);
        v_r := (v_abs OPERATOR(pg_catalog.-) (v_m OPERATOR(pg_catalog.*) v_p)) OPERATOR(pg_catalog.*) 2
               OPERATOR(pg_catalog.-) v_p;
    ELSE
        v_y := v_abs OPERATOR(pg_catalog.*) pg_catalog.power(2::pg_catalog.numeric, (OPERATOR(pg_catalog.-) v_e)::pg_catalog.numeric);
        v_m := pg_catalog.trunc(v_y);
        v_r := (v_y OPERATOR(pg_catalog.-) v_m) OPERATOR(pg_catalog.*) 2 OPERATOR(pg_catalog.-) 1;
    END IF;
    IF v_r OPERATOR(pg_catalog.>) 0
       OR v_r OPERATOR(pg_catalog.=) 0 AND pg_catalog.mod(v_m, 2::pg_catalog.numeric) OPERATOR(pg_catalog.=) 1 THEN
        v_m := v_m OPERATOR(pg_catalog.+) 1;
    END IF;
    IF v_m OPERATOR(pg_catalog.=) 9007199254740992::pg_catalog.numeric THEN  -- rounded up to 2^53
        v_m := 4503599627370496::pg_catalog.numeric;
        v_e := v_e OPERATOR(pg_catalog.+) 1;
    END IF;
    v_d := (pg_catalog.div(v_m, 67108864::pg_catalog.numeric)::pg_catalog.float8 OPERATOR(pg_catalog.*) 67108864::pg_catalog.float8
            OPERATOR(pg_catalog.+) pg_catalog.mod(v_m, 67108864::pg_catalog.numeric)::pg_catalog.float8)
           OPERATOR(pg_catalog.*) pg_catalog.power(2::pg_catalog.float8, v_e::pg_catalog.float8);
    -- float8's output is the shortest spelling strictly inside the interval that reads back as
    -- this double (PostgreSQL's Ryu leaves its bounds out). ECMAScript also takes a bound when
    -- it reads back as this double, which it does when m is even (ties go to even): 1e+23, not
    -- 9.999999999999999e+22. A bound with fewer digits than float8's spelling is the answer.
    -- The bounds are c * 2^f: (2m - 1) and (2m + 1) times 2^(e - 1); below a power of two
    -- (m = 2^52, not the smallest normal) the lower gap is half as wide: (4m - 1) * 2^(e - 2).
    -- With f < 0 a bound is an odd number times 5^-f over 10^-f: at least 17 significant digits,
    -- never fewer than float8's; so only integer bounds (f >= 0) are looked at.
    v_text := v_d::pg_catalog.text;
    IF v_e OPERATOR(pg_catalog.>=) 1 AND pg_catalog.mod(v_m, 2::pg_catalog.numeric) OPERATOR(pg_catalog.=) 0 THEN
        v_best := pg_catalog.length(pg_catalog.rtrim(pg_catalog.ltrim(pg_catalog.replace(
                      pg_catalog.split_part(v_text, 'e', 1), '.', ''), '0'), '0'));
        FOR v_i IN 1 .. 2 LOOP
            IF v_i OPERATOR(pg_catalog.=) 2 THEN
                v_c := (2 OPERATOR(pg_catalog.*) v_m) OPERATOR(pg_catalog.+) 1;
                v_f := v_e OPERATOR(pg_catalog.-) 1;
            ELSIF v_m OPERATOR(pg_catalog.=) 4503599627370496::pg_catalog.numeric THEN
                v_c := (4 OPERATOR(pg_catalog.*) v_m) OPERATOR(pg_catalog.-) 1;
                v_f := v_e OPERATOR(pg_catalog.-) 2;
            ELSE
                v_c := (2 OPERATOR(pg_catalog.*) v_m) OPERATOR(pg_catalog.-) 1;
                v_f := v_e OPERATOR(pg_catalog.-) 1;
            END IF;
            CONTINUE WHEN v_f OPERATOR(pg_catalog.<) 0;
            v_n := pg_catalog.trunc(v_c OPERATOR(pg_catalog.*) pg_catalog.power(2::pg_catalog.numeric, v_f::pg_catalog.numeric));
            v_digits := pg_catalog.length(pg_catalog.rtrim(v_n::pg_catalog.text, '0'));
            IF v_digits OPERATOR(pg_catalog.<) v_best THEN
                v_best := v_digits;
                v_text := v_n::pg_catalog.text;
            END IF;
        END LOOP;
    END IF;
    RETURN CASE WHEN num OPERATOR(pg_catalog.<) 0 THEN '-' ELSE '' END
           OPERATOR(pg_catalog.||) idempotency._canon_layout(v_text);
END
$fn$;
