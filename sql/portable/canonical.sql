-- Portable edition: canonical_json and canonical_hash in SQL and PL/pgSQL.
--
-- The same bytes as the native edition (crates/idempotency-core/src/canonical.rs and
-- exclusion.rs): RFC 8785 layout, member names in UTF-16 code-unit order, strings escaped as
-- the RFC says, numbers exact (their decimal value in the ECMAScript layout) or, in 'rfc8785'
-- mode, rounded to the nearest double and written as ECMAScript's Number::toString does.
-- Nesting deeper than 1000 levels is 54001, as in the native edition. Hashes are SHA-256 of
-- the UTF-8 bytes of the exact form, whatever the database encoding.
--
-- No recursion in PL/pgSQL (a document 1000 levels deep would exceed the stack): a recursive
-- query lists every value with its position, and the pieces are joined in that order.
-- Every function pins search_path; every reference is schema-qualified.

-- In a database whose encoding is not UTF-8, text is hashed as Unicode: a character without a
-- Unicode equivalent (EUC_JP 0xA2AF, say) is refused with 22P05 naming the argument, as the
-- native edition refuses it. Nothing to check in a UTF-8 database.
CREATE FUNCTION idempotency._canon_unicode(value text, arg text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_msg text;
BEGIN
    IF value IS NULL OR pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8' THEN
        RETURN;
    END IF;
    BEGIN
        PERFORM pg_catalog.convert_to(value, 'UTF8');
    EXCEPTION WHEN untranslatable_character THEN
        GET STACKED DIAGNOSTICS v_msg = MESSAGE_TEXT;
        RAISE EXCEPTION USING
            ERRCODE = 'untranslatable_character',
            MESSAGE = arg OPERATOR(pg_catalog.||) ': '
                      OPERATOR(pg_catalog.||) pg_catalog.replace(v_msg, 'in encoding "UTF8"', 'in Unicode');
    END;
END
$fn$;

-- The same for the strings of a document.
CREATE FUNCTION idempotency._canon_unicode_doc(value jsonb, arg text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF value IS NOT NULL AND pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.<>) 'UTF8' THEN
        PERFORM idempotency._canon_unicode(value::pg_catalog.text, arg);
    END IF;
END
$fn$;

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

-- A member name's place in UTF-16 code-unit order, as bytes compared with memcmp: its UTF-8
-- bytes, which are in code point order, except that a character of U+E000..U+FFFF (UTF-8 lead
-- byte EE or EF) must come after every supplementary character (whose UTF-16 form starts with
-- a surrogate, D800..DBFF): such a character is given the prefix F8, a byte UTF-8 never has.
CREATE FUNCTION idempotency._canon_name_order(name text)
RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_utf8 bytea := pg_catalog.convert_to(name, 'UTF8');
BEGIN
    IF pg_catalog.position(v_utf8, pg_catalog.decode('ee', 'hex')) OPERATOR(pg_catalog.=) 0
       AND pg_catalog.position(v_utf8, pg_catalog.decode('ef', 'hex')) OPERATOR(pg_catalog.=) 0 THEN
        RETURN v_utf8;
    END IF;
    -- In hex: end every character with ',' (one alternative per UTF-8 length), then prefix
    -- the characters led by ee or ef.
    RETURN pg_catalog.decode(
        pg_catalog.replace(
            pg_catalog.regexp_replace(
                ',' OPERATOR(pg_catalog.||) pg_catalog.regexp_replace(
                    pg_catalog.encode(v_utf8, 'hex'),
                    '([0-7].|[cd].[89ab].|e.[89ab].[89ab].|f.[89ab].[89ab].[89ab].)', E'\\1,', 'g'),
                ',(e[ef])', E',f8\\1', 'g'),
            ',', ''),
        'hex');
END
$fn$;

-- The canonical form of a non-NULL document; `exact` chooses the number mode; `arg` names
-- the argument in errors ("doc: document is nested deeper than 1000 levels"). `depth` is the
-- nesting allowed: 1000, as for any argument; request_fingerprint writes its arguments, each
-- checked, one level down.
CREATE FUNCTION idempotency._canon_text(doc jsonb, exact boolean, arg text, depth integer DEFAULT 1000)
RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_kind     text := pg_catalog.jsonb_typeof(doc);
    v_fail     text;
    v_bad_num  text;
    v_out      text;
    v_flat     boolean;
BEGIN
    -- A container of scalars only (no nested object or array), in a UTF-8 database: written in
    -- one statement. Its strings and names come out of jsonb escaped as RFC 8785 says; integers
    -- of at most 21 digits (15 in 'rfc8785' mode, exact as doubles) are written as integers
    -- (other numbers: the general path below); member names sort in UTF-16 code-unit order as
    -- their UTF-8 bytes do (COLLATE "C"), unless one has a character of U+E000..U+FFFF (see
    -- _canon_name_order: then the general path).
    IF depth OPERATOR(pg_catalog.>=) 1 AND (v_kind OPERATOR(pg_catalog.=) 'object' OR v_kind OPERATOR(pg_catalog.=) 'array')
       AND pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8' THEN
        IF v_kind OPERATOR(pg_catalog.=) 'object' THEN
            -- Of scalars, its numbers integers below 10^21 in magnitude (10^15 in 'rfc8785'
            -- mode; written from their value: 1.0 is 1), no member name with a character of
            -- U+E000..U+FFFF: one jsonpath test (no row per member to test). claim has a copy
            -- of the exact mode's test and of the statement below: a change here changes that
            -- copy too.
            IF NOT (CASE WHEN exact THEN pg_catalog.jsonb_path_exists(doc,
                   'strict $ ? (exists (@.* ? (@.type() == "object" || @.type() == "array" || (@.type() == "number" && (@ >= 1e21 || @ <= -1e21 || @.floor() != @)))) || exists (@.keyvalue() ? (@.key like_regex "[\uE000-\uFFFF]")))')
                        ELSE pg_catalog.jsonb_path_exists(doc,
                   'strict $ ? (exists (@.* ? (@.type() == "object" || @.type() == "array" || (@.type() == "number" && (@ >= 1e15 || @ <= -1e15 || @.floor() != @)))) || exists (@.keyvalue() ? (@.key like_regex "[\uE000-\uFFFF]")))') END) THEN
                SELECT '{' OPERATOR(pg_catalog.||) COALESCE(pg_catalog.string_agg(
                           pg_catalog.to_json(e.key)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                           OPERATOR(pg_catalog.||) CASE WHEN pg_catalog.jsonb_typeof(e.value) OPERATOR(pg_catalog.=) 'number'
                                                        THEN pg_catalog.trunc(e.value::pg_catalog.numeric)::pg_catalog.text
                                                        ELSE e.value::pg_catalog.text END, ','
                           ORDER BY e.key COLLATE pg_catalog."C"), '') OPERATOR(pg_catalog.||) '}'
                  INTO v_out
                  FROM pg_catalog.jsonb_each(doc) AS e;
                RETURN v_out;
            END IF;
        ELSIF v_kind OPERATOR(pg_catalog.=) 'array' THEN
            SELECT pg_catalog.bool_and(CASE pg_catalog.jsonb_typeof(a.value)
                       WHEN 'string' THEN true WHEN 'boolean' THEN true WHEN 'null' THEN true
                       WHEN 'number' THEN a.value::pg_catalog.text OPERATOR(pg_catalog.~)
                                          CASE WHEN exact THEN '^(0|-?[1-9][0-9]{0,20})$' ELSE '^(0|-?[1-9][0-9]{0,14})$' END
                       ELSE false END),
                   '[' OPERATOR(pg_catalog.||) COALESCE(pg_catalog.string_agg(a.value::pg_catalog.text, ',' ORDER BY a.pos), '')
                   OPERATOR(pg_catalog.||) ']'
              INTO v_flat, v_out
              FROM pg_catalog.jsonb_array_elements(doc) WITH ORDINALITY AS a(value, pos);
            IF v_flat IS NOT FALSE THEN
                RETURN v_out;
            END IF;
        END IF;
    END IF;
    IF v_kind OPERATOR(pg_catalog.=) 'number' THEN
        v_out := CASE WHEN exact THEN idempotency._canon_layout(doc::pg_catalog.text)
                      ELSE idempotency._canon_double(doc::pg_catalog.numeric) END;
        IF v_out IS NULL THEN
            v_bad_num := doc::pg_catalog.text;
        ELSE
            RETURN v_out;
        END IF;
    ELSIF v_kind OPERATOR(pg_catalog.<>) 'object' AND v_kind OPERATOR(pg_catalog.<>) 'array' THEN
        RETURN doc::pg_catalog.text;  -- a string (escaped as RFC 8785 says), true, false, null
    ELSE
        -- Every value: its path (per level, its 4-byte rank in canonical order), its level
        -- (the document is level 0; a container at level 1000 is nested 1001 deep), and what
        -- is written before it ("," and the member's name). Containers at level `depth` are
        -- not opened (they are the error). The pieces: each value's head and opening (or scalar), and each container's
        -- closing at its path followed by \xff, after all its children's paths.
        WITH RECURSIVE node(path, level, kind, v, head) AS (
            SELECT ''::pg_catalog.bytea, 0, v_kind, doc, ''::pg_catalog.text
            UNION ALL
            SELECT n.path OPERATOR(pg_catalog.||) pg_catalog.int4send(c.pos::pg_catalog.int4),
                   n.level OPERATOR(pg_catalog.+) 1, pg_catalog.jsonb_typeof(c.v), c.v, c.head
              FROM node AS n,
                   LATERAL (
                       SELECT m.value AS v, m.pos,
                              CASE WHEN m.pos OPERATOR(pg_catalog.>) 1 THEN ',' ELSE '' END
                              OPERATOR(pg_catalog.||) pg_catalog.to_json(m.key)::pg_catalog.text
                              OPERATOR(pg_catalog.||) ':' AS head
                         FROM (SELECT e.key, e.value,
                                      pg_catalog.row_number() OVER (
                                          ORDER BY CASE WHEN pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8'
                                                             AND e.key OPERATOR(pg_catalog.!~) '[\uE000-\uFFFF]'
                                                        THEN pg_catalog.convert_to(e.key, 'UTF8')
                                                        ELSE idempotency._canon_name_order(e.key) END) AS pos
                                 FROM pg_catalog.jsonb_each(
                                          CASE WHEN n.kind OPERATOR(pg_catalog.=) 'object' THEN n.v
                                               ELSE '{}'::pg_catalog.jsonb END) AS e) AS m
                       UNION ALL
                       SELECT a.value, a.pos,
                              CASE WHEN a.pos OPERATOR(pg_catalog.>) 1 THEN ',' ELSE '' END
                         FROM pg_catalog.jsonb_array_elements(
                                  CASE WHEN n.kind OPERATOR(pg_catalog.=) 'array' THEN n.v
                                       ELSE '[]'::pg_catalog.jsonb END)
                              WITH ORDINALITY AS a(value, pos)
                   ) AS c
             WHERE n.level OPERATOR(pg_catalog.<) depth
               AND n.kind OPERATOR(pg_catalog.=) ANY ('{object,array}'::pg_catalog.text[])
        ),
        piece(path, level, kind, v, text) AS (
            SELECT n.path, n.level, n.kind, n.v,
                   n.head OPERATOR(pg_catalog.||) CASE n.kind
                       WHEN 'object' THEN '{'
                       WHEN 'array' THEN '['
                       WHEN 'number' THEN
                           CASE WHEN n.v::pg_catalog.text OPERATOR(pg_catalog.~)
                                     CASE WHEN exact THEN '^(0|-?[1-9][0-9]{0,20})$' ELSE '^(0|-?[1-9][0-9]{0,14})$' END
                                THEN n.v::pg_catalog.text
                                WHEN exact THEN idempotency._canon_layout(n.v::pg_catalog.text)
                                ELSE idempotency._canon_double(n.v::pg_catalog.numeric) END
                       ELSE n.v::pg_catalog.text END
              FROM node AS n
            UNION ALL
            SELECT n.path OPERATOR(pg_catalog.||) pg_catalog.decode('ff', 'hex'), n.level, 'close', NULL,
                   CASE n.kind WHEN 'object' THEN '}' ELSE ']' END
              FROM node AS n
             WHERE n.kind OPERATOR(pg_catalog.=) ANY ('{object,array}'::pg_catalog.text[])
        )
        -- The first failure in canonical order is the one the native edition meets.
        SELECT f.kind, f.v::pg_catalog.text,
               (SELECT pg_catalog.string_agg(p.text, '' ORDER BY p.path) FROM piece AS p)
          INTO v_fail, v_bad_num, v_out
          FROM (SELECT 1) AS one
          LEFT JOIN LATERAL (
              SELECT p.kind, p.v FROM piece AS p
               WHERE p.kind OPERATOR(pg_catalog.=) 'number' AND p.text IS NULL
                  OR p.level OPERATOR(pg_catalog.>=) depth
                     AND p.kind OPERATOR(pg_catalog.=) ANY ('{object,array}'::pg_catalog.text[])
               ORDER BY p.path LIMIT 1) AS f ON true;
        IF v_fail IS NULL THEN
            RETURN v_out;
        END IF;
        IF v_fail OPERATOR(pg_catalog.<>) 'number' THEN
            RAISE EXCEPTION USING
                ERRCODE = 'statement_too_complex',
                MESSAGE = arg OPERATOR(pg_catalog.||) ': document is nested deeper than 1000 levels';
        END IF;
    END IF;
    -- The number as exact mode writes it (1e+309), abbreviated as the native edition does.
    v_bad_num := idempotency._canon_layout(v_bad_num);
    IF pg_catalog.length(v_bad_num) OPERATOR(pg_catalog.>) 40 THEN
        v_bad_num := pg_catalog.left(v_bad_num, 40) OPERATOR(pg_catalog.||) '...';
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'numeric_value_out_of_range',
        MESSAGE = pg_catalog.format('%s: number %s is outside the IEEE-754 double range', arg, v_bad_num),
        HINT = 'RFC 8785 allows only IEEE-754 doubles: send such numbers as JSON strings, or use numbers => ''exact''';
END
$fn$;

-- A value as Rust's Debug writes a string, cut after 40 characters (the native edition's
-- messages quote arguments so).
CREATE FUNCTION idempotency._canon_quote(value text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_cut boolean := pg_catalog.length(value) OPERATOR(pg_catalog.>) 40;
    v_out text := '';
    v_c   text;
    v_cp  integer;
    v_utf8 boolean := pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8';
BEGIN
    IF value OPERATOR(pg_catalog.=) '' THEN
        RETURN '""';
    END IF;
    FOREACH v_c IN ARRAY pg_catalog.regexp_split_to_array(pg_catalog.left(value, 40), '') LOOP
        -- ascii() gives the code point in UTF-8 databases, of ASCII characters in others.
        v_cp := CASE WHEN pg_catalog.octet_length(v_c) OPERATOR(pg_catalog.=) 1 OR v_utf8
                     THEN pg_catalog.ascii(v_c) ELSE 160 END;
        v_out := v_out OPERATOR(pg_catalog.||) CASE
            WHEN v_cp OPERATOR(pg_catalog.=) 34 THEN E'\\"'
            WHEN v_cp OPERATOR(pg_catalog.=) 92 THEN E'\\\\'
            WHEN v_cp OPERATOR(pg_catalog.=) 9 THEN E'\\t'
            WHEN v_cp OPERATOR(pg_catalog.=) 10 THEN E'\\n'
            WHEN v_cp OPERATOR(pg_catalog.=) 13 THEN E'\\r'
            WHEN v_cp OPERATOR(pg_catalog.<) 32
                 OR v_cp OPERATOR(pg_catalog.>=) 127 AND v_cp OPERATOR(pg_catalog.<) 160
                THEN pg_catalog.format(E'\\u{%s}', pg_catalog.to_hex(v_cp))
            ELSE v_c END;
    END LOOP;
    v_out := '"' OPERATOR(pg_catalog.||) v_out OPERATOR(pg_catalog.||) '"';
    IF v_cut AND v_utf8 THEN
        -- An ellipsis (a statement of its own: chr(8230) does not exist in other encodings).
        v_out := v_out OPERATOR(pg_catalog.||) pg_catalog.chr(8230);
    ELSIF v_cut THEN
        v_out := v_out OPERATOR(pg_catalog.||) '...';
    END IF;
    RETURN v_out;
END
$fn$;

-- A message for a database whose encoding is not UTF-8, as the native edition writes it there:
-- every character outside ASCII as \u{hex of its code point}.
CREATE FUNCTION idempotency._canon_message(message text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_out text := '';
    v_c   text;
    v_b   bytea;
    v_cp  integer;
BEGIN
    IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8'
       OR pg_catalog.octet_length(message) OPERATOR(pg_catalog.=) pg_catalog.length(message) THEN
        RETURN message;  -- UTF-8, or ASCII only (every multibyte encoding's other characters take 2+ bytes)
    END IF;
    FOREACH v_c IN ARRAY pg_catalog.regexp_split_to_array(message, '') LOOP
        v_b := pg_catalog.convert_to(v_c, 'UTF8');
        IF pg_catalog.length(v_b) OPERATOR(pg_catalog.=) 1 AND pg_catalog.get_byte(v_b, 0) OPERATOR(pg_catalog.<) 128 THEN
            v_out := v_out OPERATOR(pg_catalog.||) v_c;
            CONTINUE;
        END IF;
        -- The code point from its UTF-8 bytes.
        v_cp := pg_catalog.get_byte(v_b, 0) OPERATOR(pg_catalog.&)
                CASE pg_catalog.length(v_b) WHEN 2 THEN 31 WHEN 3 THEN 15 ELSE 7 END;
        FOR v_i IN 1 .. pg_catalog.length(v_b) OPERATOR(pg_catalog.-) 1 LOOP
            v_cp := (v_cp OPERATOR(pg_catalog.*) 64) OPERATOR(pg_catalog.+) (pg_catalog.get_byte(v_b, v_i) OPERATOR(pg_catalog.&) 63);
        END LOOP;
        v_out := v_out OPERATOR(pg_catalog.||) pg_catalog.format(E'\\u{%s}', pg_catalog.to_hex(v_cp));
    END LOOP;
    RETURN v_out;
END
$fn$;

-- Removes what `entries` name, one entry after the other, as the native edition does: a plain
-- name removes a top-level member; an entry starting with '/' is an RFC 6901 JSON Pointer
-- (an array index only in its canonical spelling: 0, or digits without a leading 0); a path
-- that does not exist removes nothing; a malformed pointer is 22P02.
CREATE FUNCTION idempotency._canon_exclude(doc jsonb, entries text[])
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_doc    jsonb := doc;
    v_entry  text;
    v_tokens text[];
    v_cur    jsonb;
    v_found  boolean;
    v_i      integer;
    v_n      integer;
BEGIN
    FOREACH v_entry IN ARRAY entries LOOP
        IF pg_catalog.left(v_entry, 1) OPERATOR(pg_catalog.<>) '/' THEN
            IF pg_catalog.jsonb_typeof(v_doc) OPERATOR(pg_catalog.=) 'object' THEN
                v_doc := v_doc OPERATOR(pg_catalog.-) v_entry;
            END IF;
            CONTINUE;
        END IF;
        IF v_entry OPERATOR(pg_catalog.=) '/' THEN
            v_tokens := '{""}';
        ELSE
            v_tokens := pg_catalog.string_to_array(pg_catalog.substr(v_entry, 2), '/');
        END IF;
        v_n := pg_catalog.cardinality(v_tokens);
        FOR v_i IN 1 .. v_n LOOP
            IF v_tokens[v_i] OPERATOR(pg_catalog.~) '~([^01]|$)' THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'invalid_text_representation',
                    MESSAGE = idempotency._canon_message(pg_catalog.format(
                        'exclude: "%s" is not a member name or an RFC 6901 JSON Pointer',
                        CASE WHEN pg_catalog.length(v_entry) OPERATOR(pg_catalog.>) 80
                             THEN pg_catalog.left(v_entry, 80) OPERATOR(pg_catalog.||) '...'
                             ELSE v_entry END)),
                    HINT = 'use ~0 for ''~'' and ~1 for ''/'' inside a pointer token';
            END IF;
            v_tokens[v_i] := pg_catalog.replace(pg_catalog.replace(v_tokens[v_i], '~1', '/'), '~0', '~');
        END LOOP;
        v_cur := v_doc;
        v_found := true;
        FOR v_i IN 1 .. v_n LOOP
            IF pg_catalog.jsonb_typeof(v_cur) OPERATOR(pg_catalog.=) 'object' THEN
                v_cur := v_cur OPERATOR(pg_catalog.->) v_tokens[v_i];
            ELSIF pg_catalog.jsonb_typeof(v_cur) OPERATOR(pg_catalog.=) 'array'
                  AND v_tokens[v_i] OPERATOR(pg_catalog.~) '^(0|[1-9][0-9]{0,8})$' THEN
                v_cur := v_cur OPERATOR(pg_catalog.->) v_tokens[v_i]::pg_catalog.int4;
            ELSE
                v_cur := NULL;
            END IF;
            IF v_cur IS NULL THEN
                v_found := false;
                EXIT;
            END IF;
        END LOOP;
        IF v_found THEN
            v_doc := v_doc OPERATOR(pg_catalog.#-) v_tokens;
        END IF;
    END LOOP;
    RETURN v_doc;
END
$fn$;

CREATE FUNCTION idempotency.canonical_json(doc jsonb, numbers text DEFAULT 'exact')
RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM idempotency._canon_unicode(numbers, 'numbers');
    IF numbers IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'numbers must not be NULL';
    END IF;
    IF numbers OPERATOR(pg_catalog.<>) 'exact' AND numbers OPERATOR(pg_catalog.<>) 'rfc8785' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = idempotency._canon_message(pg_catalog.format(
                'numbers must be ''exact'' or ''rfc8785'' (got %s)', idempotency._canon_quote(numbers)));
    END IF;
    IF doc IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM idempotency._canon_unicode_doc(doc, 'doc');
    RETURN idempotency._canon_text(doc, numbers OPERATOR(pg_catalog.=) 'exact', 'doc');
END
$fn$;

CREATE FUNCTION idempotency.canonical_hash(doc jsonb, exclude text[] DEFAULT '{}')
RETURNS bytea
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_entry text;
BEGIN
    IF exclude IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'exclude must not be NULL';
    END IF;
    IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.<>) 'UTF8' THEN
        FOREACH v_entry IN ARRAY exclude LOOP
            PERFORM idempotency._canon_unicode(v_entry, 'exclude');
        END LOOP;
    END IF;
    IF doc IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM idempotency._canon_unicode_doc(doc, 'doc');
    IF pg_catalog.cardinality(exclude) OPERATOR(pg_catalog.>) 0 THEN
        FOREACH v_entry IN ARRAY exclude LOOP
            IF v_entry IS NULL THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'null_value_not_allowed', MESSAGE = 'exclude element must not be NULL';
            END IF;
        END LOOP;
        -- The whole document is read (and its depth checked) before any entry applies.
        IF pg_catalog.jsonb_path_exists(doc,
               'strict $.**{1000 to last} ? (@.type() == "object" || @.type() == "array")') THEN
            RAISE EXCEPTION USING
                ERRCODE = 'statement_too_complex',
                MESSAGE = 'doc: document is nested deeper than 1000 levels';
        END IF;
        doc := idempotency._canon_exclude(doc, exclude);
    END IF;
    RETURN pg_catalog.sha256(pg_catalog.convert_to(idempotency._canon_text(doc, true, 'doc'), 'UTF8'));
END
$fn$;
