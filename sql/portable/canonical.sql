-- Portable edition: canonical_json and canonical_hash in SQL and PL/pgSQL.
--
-- The same bytes as the native edition (crates/idempotency-core/src/canonical.rs and
-- exclusion.rs): RFC 8785 layout, member names in UTF-16 code-unit order, strings escaped as
-- the RFC says, numbers exact (their decimal value in the ECMAScript layout) or, in 'rfc8785'
-- mode, rounded to the nearest double and written as ECMAScript's Number::toString does.
-- Nesting deeper than 1000 levels is 54001, as in the native edition. Hashes are SHA-256 of
-- the UTF-8 bytes of the exact form, whatever the database encoding.
--
-- No recursion in PL/pgSQL (a document 1000 levels deep would exceed the stack): a nested
-- document is written by loops over the tokens of its text, with a stack of their own.
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
-- One plan for each statement below whatever the document: PostgreSQL's plan for each call's
-- arguments is planned again in every call, which costs more than a small document's work.
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    v_kind     text := pg_catalog.jsonb_typeof(doc);
    v_fail     text;
    v_bad_num  text;
    v_out      text;
    v_flat     boolean;
    v_text     text;
    v_tok      text[];
    v_parts    text[];
    v_esc      boolean;
    v_mark     text;
    v_pair     text;
    v_close    integer[];
    v_t        text;
    v_s        text;
    v_pre      text;
    v_numt     text[] := '{}';
    v_n        integer;
    v_limit    integer;
    v_c        text;
    v_i        integer;
    v_j        integer;
    v_k        integer;
    v_sp       integer := 0;
    v_open     integer[] := '{}';
    v_obj      boolean[] := '{}';
    v_count    integer[] := '{}';
    v_m        integer := 0;
    v_ms       integer[] := '{}';
    v_mo       integer[] := '{}';
    v_mk       text[] := '{}';
    v_nums     integer[] := '{}';
    v_fmt      text[];
    v_deep     integer[] := '{}';
    v_bad      integer[] := '{}';
    v_badt     text[] := '{}';
    v_rs       integer[];
    v_re       integer[];
    v_rshift   integer[];
    v_rfirst   boolean[];
    v_diff     integer[];
    v_moved    boolean;
    v_bytes    boolean;
    v_shift    integer;
    v_pieces   text[];
    v_fail_at  integer;
BEGIN
    -- A container of scalars only (no nested object or array), in a UTF-8 database: written in
    -- one statement. Its strings and names come out of jsonb escaped as RFC 8785 says; integers
    -- of at most 21 digits (15 in 'rfc8785' mode, exact as doubles) are written as integers, and
    -- in exact mode fractions below 10^21 and not below 10^-6 in magnitude as jsonb writes them
    -- (never an exponent, never -0) without trailing zeros: what _canon_layout writes for them
    -- (other numbers: the general path below); member names sort in UTF-16 code-unit order as
    -- their UTF-8 bytes do (COLLATE "C"), unless one has a character of U+E000..U+FFFF (see
    -- _canon_name_order: then the general path).
    IF depth OPERATOR(pg_catalog.>=) 1 AND (v_kind OPERATOR(pg_catalog.=) 'object' OR v_kind OPERATOR(pg_catalog.=) 'array')
       AND pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8' THEN
        IF v_kind OPERATOR(pg_catalog.=) 'object' THEN
            -- Of scalars, its numbers below 10^21 in magnitude, integers or not below 10^-6 in
            -- exact mode (integers below 10^15 in 'rfc8785' mode; 1.0 is 1), no member name with a character of
            -- U+E000..U+FFFF: one jsonpath test (no row per member to test). claim has a copy
            -- of the exact mode's test of members and of the statement below (a change here
            -- changes that copy too); it tests member names by one regular expression on the
            -- text it writes instead, which costs it less than the jsonpath's test of each name.
            IF NOT (CASE WHEN exact THEN pg_catalog.jsonb_path_exists(doc,
                   'strict $ ? (exists (@.* ? (@.type() == "object" || @.type() == "array" || (@.type() == "number" && (@ >= 1e21 || @ <= -1e21 || (@.floor() != @ && @ > -0.000001 && @ < 0.000001))))) || exists (@.keyvalue() ? (@.key like_regex "[\uE000-\uFFFF]")))')
                        ELSE pg_catalog.jsonb_path_exists(doc,
                   'strict $ ? (exists (@.* ? (@.type() == "object" || @.type() == "array" || (@.type() == "number" && (@ >= 1e15 || @ <= -1e15 || @.floor() != @)))) || exists (@.keyvalue() ? (@.key like_regex "[\uE000-\uFFFF]")))') END) THEN
                SELECT '{' OPERATOR(pg_catalog.||) COALESCE(pg_catalog.string_agg(
                           pg_catalog.to_json(e.key)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                           OPERATOR(pg_catalog.||) CASE WHEN pg_catalog.jsonb_typeof(e.value) OPERATOR(pg_catalog.=) 'number'
                                                             AND pg_catalog.strpos(e.value::pg_catalog.text, '.') OPERATOR(pg_catalog.>) 0
                                                        THEN pg_catalog.rtrim(pg_catalog.rtrim(e.value::pg_catalog.text, '0'), '.')
                                                        ELSE e.value::pg_catalog.text END, ','
                           ORDER BY e.key COLLATE pg_catalog."C"), '') OPERATOR(pg_catalog.||) '}'
                  INTO v_out
                  FROM pg_catalog.jsonb_each(doc) AS e;
                RETURN v_out;
            END IF;
        ELSIF v_kind OPERATOR(pg_catalog.=) 'array'
              -- (Not with a nested container: its value would be written out here for nothing.)
              AND NOT pg_catalog.jsonb_path_exists(doc, 'strict $ ? (exists (@[*] ? (@.type() == "object" || @.type() == "array")))') THEN
            SELECT pg_catalog.bool_and(CASE pg_catalog.jsonb_typeof(a.value)
                       WHEN 'string' THEN true WHEN 'boolean' THEN true WHEN 'null' THEN true
                       WHEN 'number' THEN a.value::pg_catalog.text OPERATOR(pg_catalog.~)
                                          CASE WHEN exact THEN '^-?([1-9][0-9]{0,20}(\.[0-9]+)?|0(\.0{0,5}[1-9][0-9]*|\.0+)?)$'
                                               ELSE '^(0|-?[1-9][0-9]{0,14})$' END
                       ELSE false END),
                   '[' OPERATOR(pg_catalog.||) COALESCE(pg_catalog.string_agg(
                       CASE WHEN pg_catalog.jsonb_typeof(a.value) OPERATOR(pg_catalog.=) 'number'
                                 AND pg_catalog.strpos(a.value::pg_catalog.text, '.') OPERATOR(pg_catalog.>) 0
                            THEN pg_catalog.rtrim(pg_catalog.rtrim(a.value::pg_catalog.text, '0'), '.')
                            ELSE a.value::pg_catalog.text END, ',' ORDER BY a.pos), '')
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
        -- A walk of the document's text, in time and memory linear in it whatever its nesting
        -- (no value is copied once per level it is nested in). jsonb writes its text in one
        -- pass, strings and names escaped as RFC 8785 says. Cut at its quotes, the text is its
        -- strings (the even parts) between the rest (the odd parts: brackets, numbers, literals,
        -- ", " and ": "), which, joined with a mark in place of each string, is cut into
        -- tokens: a bracket, a value of an array, or a member (its name with ":", and its value
        -- unless the value is a container). Each token is one piece of the canonical form, so
        -- the form is the tokens in another order: within each object, its members (a member's
        -- token and its value's tokens) in canonical order of their names. A first pass over the
        -- tokens, with a stack of the open containers, writes the pieces and the commas of
        -- arrays, and finds the members, the numbers to rewrite and the containers nested too
        -- deep; one statement ranks the members of every object; each member's tokens then move
        -- by one shift (its place in its object plus its enclosing members' shifts: a running
        -- sum of differences), and the pieces are joined in that order.
        -- (Splitting and replacing are much faster than a regular expression over long strings.)
        v_text := doc::pg_catalog.text;
        -- A quote inside a string is escaped: \" and \\ are made control characters for the
        -- cut (jsonb writes none: it escapes them), and made again in each string taken.
        v_esc := pg_catalog.strpos(v_text, '\') OPERATOR(pg_catalog.>) 0;
        IF v_esc THEN
            v_text := pg_catalog.replace(pg_catalog.replace(v_text, '\\', pg_catalog.chr(1)), '\"', pg_catalog.chr(2));
        END IF;
        v_parts := pg_catalog.string_to_array(v_text, '"');
        v_text := NULL;
        -- The odd parts joined by the mark chr(3) (gathered in a loop: a statement costs more
        -- than a small document's parts); ": " made chr(4) (a member's name and its scalar value
        -- make one token); then cut at brackets, commas and spaces.
        v_mark := pg_catalog.chr(3);
        v_tok := '{}';
        FOR v_k IN 1 .. (pg_catalog.cardinality(v_parts) OPERATOR(pg_catalog.+) 1) OPERATOR(pg_catalog./) 2 LOOP
            v_tok[v_k] := v_parts[v_k OPERATOR(pg_catalog.*) 2 OPERATOR(pg_catalog.-) 1];
        END LOOP;
        v_tok := pg_catalog.array_remove(pg_catalog.string_to_array(
                     pg_catalog.replace(pg_catalog.replace(pg_catalog.replace(pg_catalog.replace(
                         pg_catalog.replace(pg_catalog.replace(pg_catalog.array_to_string(v_tok, v_mark),
                         ',', ' '), ': ', pg_catalog.chr(4)), '{', ' { '), '}', ' } '), '[', ' [ '), ']', ' ] '),
                     ' '), '');
        v_n := pg_catalog.cardinality(v_tok);
        v_limit := CASE WHEN exact THEN 21 ELSE 15 END;
        v_pair := v_mark OPERATOR(pg_catalog.||) pg_catalog.chr(4) OPERATOR(pg_catalog.||) v_mark;
        v_close := pg_catalog.array_fill(0, ARRAY[v_n]);
        v_j := 0;  -- the strings taken
        FOR v_i IN 1 .. v_n LOOP
            v_t := v_tok[v_i];
            v_c := pg_catalog.left(v_t, 1);
            IF v_c OPERATOR(pg_catalog.=) v_mark THEN
                v_j := v_j OPERATOR(pg_catalog.+) 1;
                v_s := CASE WHEN v_esc
                            THEN pg_catalog.replace(pg_catalog.replace(v_parts[v_j OPERATOR(pg_catalog.*) 2],
                                                                       pg_catalog.chr(2), '\"'), pg_catalog.chr(1), '\\')
                            ELSE v_parts[v_j OPERATOR(pg_catalog.*) 2] END;
                IF v_t OPERATOR(pg_catalog.=) v_mark THEN
                    -- A string in an array.
                    v_tok[v_i] := CASE WHEN v_count[v_sp] OPERATOR(pg_catalog.>) 0 THEN ',"' ELSE '"' END
                                  OPERATOR(pg_catalog.||) v_s OPERATOR(pg_catalog.||) '"';
                    v_count[v_sp] := v_count[v_sp] OPERATOR(pg_catalog.+) 1;
                    CONTINUE;
                END IF;
                -- A member: it runs to the next member of its object, or the object's end.
                v_m := v_m OPERATOR(pg_catalog.+) 1;
                v_ms[v_m] := v_i;
                v_mo[v_m] := v_open[v_sp];
                v_mk[v_m] := v_s;
                IF v_t OPERATOR(pg_catalog.=) v_pair THEN
                    -- Its value a string.
                    v_j := v_j OPERATOR(pg_catalog.+) 1;
                    v_tok[v_i] := '"' OPERATOR(pg_catalog.||) v_s OPERATOR(pg_catalog.||) '":"'
                                  OPERATOR(pg_catalog.||) CASE WHEN v_esc
                                      THEN pg_catalog.replace(pg_catalog.replace(v_parts[v_j OPERATOR(pg_catalog.*) 2],
                                                                                 pg_catalog.chr(2), '\"'), pg_catalog.chr(1), '\\')
                                      ELSE v_parts[v_j OPERATOR(pg_catalog.*) 2] END
                                  OPERATOR(pg_catalog.||) '"';
                    CONTINUE;
                END IF;
                v_pre := '"' OPERATOR(pg_catalog.||) v_s OPERATOR(pg_catalog.||) '":';
                v_t := pg_catalog.substr(v_t, 3);  -- the value, if a scalar
                v_c := pg_catalog.left(v_t, 1);
                -- (A container's members follow; or true, false, null, a number.)
            ELSIF v_c OPERATOR(pg_catalog.=) '}' THEN
                v_close[v_open[v_sp]] := v_i;
                v_sp := v_sp OPERATOR(pg_catalog.-) 1;
                CONTINUE;
            ELSIF v_c OPERATOR(pg_catalog.=) ']' THEN
                v_sp := v_sp OPERATOR(pg_catalog.-) 1;
                CONTINUE;
            ELSIF v_sp OPERATOR(pg_catalog.>) 0 AND NOT v_obj[v_sp] THEN
                -- A value in an array: after a comma unless it is the first.
                v_pre := CASE WHEN v_count[v_sp] OPERATOR(pg_catalog.>) 0 THEN ',' ELSE '' END;
                v_count[v_sp] := v_count[v_sp] OPERATOR(pg_catalog.+) 1;
            ELSE
                v_pre := '';  -- the document, or a member's container (its name is the token before)
            END IF;
            -- v_t is a value: a container opened, or a number or literal (after v_pre, the
            -- piece's comma or name).
            IF v_c OPERATOR(pg_catalog.=) '{' OR v_c OPERATOR(pg_catalog.=) '[' THEN
                v_tok[v_i] := v_pre OPERATOR(pg_catalog.||) v_c;
                -- Level v_sp (the document is level 0): from `depth` on, the error.
                IF v_sp OPERATOR(pg_catalog.>=) depth THEN
                    v_deep[pg_catalog.cardinality(v_deep) OPERATOR(pg_catalog.+) 1] := v_i;
                END IF;
                v_sp := v_sp OPERATOR(pg_catalog.+) 1;
                v_open[v_sp] := v_i;
                v_obj[v_sp] := v_c OPERATOR(pg_catalog.=) '{';
                v_count[v_sp] := 0;
            ELSIF v_t OPERATOR(pg_catalog.=) '' THEN
                v_tok[v_i] := v_pre;  -- a member whose value is the container that follows
            ELSIF v_c OPERATOR(pg_catalog.<>) 't' AND v_c OPERATOR(pg_catalog.<>) 'f' AND v_c OPERATOR(pg_catalog.<>) 'n'
                  AND (pg_catalog.strpos(v_t, '.') OPERATOR(pg_catalog.>) 0
                       OR pg_catalog.octet_length(v_t) OPERATOR(pg_catalog.>)
                          (v_limit OPERATOR(pg_catalog.+) CASE WHEN v_c OPERATOR(pg_catalog.=) '-' THEN 1 ELSE 0 END)) THEN
                -- A number to rewrite (a fraction, or an integer too long to be written as it
                -- is): a fraction as the flat case above writes it where it can; the others
                -- below, all in one statement.
                IF exact AND v_t OPERATOR(pg_catalog.~) '^-?([1-9][0-9]{0,20}\.[0-9]+|0(\.0{0,5}[1-9][0-9]*|\.0+))$' THEN
                    v_tok[v_i] := v_pre OPERATOR(pg_catalog.||) pg_catalog.rtrim(pg_catalog.rtrim(v_t, '0'), '.');
                ELSE
                    v_tok[v_i] := v_pre;
                    v_k := pg_catalog.cardinality(v_nums) OPERATOR(pg_catalog.+) 1;
                    v_nums[v_k] := v_i;
                    v_numt[v_k] := v_t;
                END IF;
            ELSE
                v_tok[v_i] := v_pre OPERATOR(pg_catalog.||) v_t;
            END IF;
        END LOOP;
        -- The other numbers: _canon_layout or _canon_double (NULL: outside the double range, an
        -- error below).
        IF pg_catalog.cardinality(v_nums) OPERATOR(pg_catalog.>) 0 THEN
            v_fmt := ARRAY(
                SELECT CASE WHEN exact THEN idempotency._canon_layout(x.t)
                            ELSE idempotency._canon_double(x.t::pg_catalog.numeric) END
                  FROM (SELECT pg_catalog.unnest(v_numt) AS t) AS x);
            FOR v_k IN 1 .. pg_catalog.cardinality(v_nums) LOOP
                v_i := v_nums[v_k];
                IF v_fmt[v_k] IS NULL THEN
                    v_bad[pg_catalog.cardinality(v_bad) OPERATOR(pg_catalog.+) 1] := v_i;
                    v_badt[pg_catalog.cardinality(v_badt) OPERATOR(pg_catalog.+) 1] := v_numt[v_k];
                ELSE
                    v_tok[v_i] := v_tok[v_i] OPERATOR(pg_catalog.||) v_fmt[v_k];
                END IF;
            END LOOP;
        END IF;
        -- The members of every object in canonical order of their names: the first written
        -- without a comma, each moved to its place in its object (a shift, 0 where jsonb's
        -- order of names, by length first, is already the canonical one). Names sort as their
        -- UTF-8 bytes (COLLATE "C" in a UTF-8 database) unless one has a character of
        -- U+E000..U+FFFF (see _canon_name_order).
        v_diff := pg_catalog.array_fill(0, ARRAY[v_n OPERATOR(pg_catalog.+) 1]);
        v_moved := false;
        IF v_m OPERATOR(pg_catalog.>) 1 THEN
            v_bytes := pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8';
            IF v_bytes THEN
                v_s := pg_catalog.array_to_string(v_mk, '');
                v_bytes := pg_catalog.octet_length(v_s) OPERATOR(pg_catalog.=) pg_catalog.length(v_s)
                           OR v_s OPERATOR(pg_catalog.!~) '[\uE000-\uFFFF]';
            END IF;
            SELECT pg_catalog.array_agg(r.s), pg_catalog.array_agg(r.e), pg_catalog.array_agg(r.shift),
                   pg_catalog.array_agg(r.before OPERATOR(pg_catalog.=) 0)
              INTO v_rs, v_re, v_rshift, v_rfirst
              FROM (SELECT w.s, w.e, w.before,
                           w.o OPERATOR(pg_catalog.+) 1 OPERATOR(pg_catalog.+) w.before OPERATOR(pg_catalog.-) w.s AS shift
                      FROM (SELECT m.s, m.e, m.o,
                                   (pg_catalog.sum(m.e OPERATOR(pg_catalog.-) m.s OPERATOR(pg_catalog.+) 1) OVER (
                                        PARTITION BY m.o
                                        ORDER BY CASE WHEN v_bytes THEN m.key END COLLATE pg_catalog."C",
                                                 CASE WHEN NOT v_bytes THEN idempotency._canon_name_order(m.key) END)
                                    OPERATOR(pg_catalog.-) (m.e OPERATOR(pg_catalog.-) m.s OPERATOR(pg_catalog.+) 1))::pg_catalog.int4 AS before
                              FROM (SELECT u.s, u.o,
                                           -- Its last token: before the next member of its object,
                                           -- or before its object's end.
                                           COALESCE(pg_catalog.lead(u.s) OVER (PARTITION BY u.o ORDER BY u.s), v_close[u.o])
                                           OPERATOR(pg_catalog.-) 1 AS e,
                                           -- The name (unescaped where it has an escape).
                                           CASE WHEN NOT v_esc OR pg_catalog.strpos(u.k, '\') OPERATOR(pg_catalog.=) 0 THEN u.k
                                                ELSE ('"' OPERATOR(pg_catalog.||) u.k OPERATOR(pg_catalog.||) '"')::pg_catalog.jsonb
                                                     OPERATOR(pg_catalog.#>>) '{}'::pg_catalog.text[] END AS key
                                      FROM (SELECT pg_catalog.unnest(v_ms) AS s, pg_catalog.unnest(v_mo) AS o,
                                                   pg_catalog.unnest(v_mk) AS k) AS u) AS m) AS w) AS r
             WHERE r.before OPERATOR(pg_catalog.<>) 0 OR r.shift OPERATOR(pg_catalog.<>) 0;
            FOR v_k IN 1 .. COALESCE(pg_catalog.cardinality(v_rs), 0) LOOP
                IF NOT v_rfirst[v_k] THEN
                    v_tok[v_rs[v_k]] := ',' OPERATOR(pg_catalog.||) v_tok[v_rs[v_k]];
                END IF;
                IF v_rshift[v_k] OPERATOR(pg_catalog.<>) 0 THEN
                    v_diff[v_rs[v_k]] := v_diff[v_rs[v_k]] OPERATOR(pg_catalog.+) v_rshift[v_k];
                    v_diff[v_re[v_k] OPERATOR(pg_catalog.+) 1] := v_diff[v_re[v_k] OPERATOR(pg_catalog.+) 1]
                                                                  OPERATOR(pg_catalog.-) v_rshift[v_k];
                    v_moved := true;
                END IF;
            END LOOP;
        END IF;
        IF pg_catalog.cardinality(v_deep) OPERATOR(pg_catalog.=) 0 AND pg_catalog.cardinality(v_bad) OPERATOR(pg_catalog.=) 0 THEN
            IF NOT v_moved THEN
                RETURN pg_catalog.array_to_string(v_tok, '');
            END IF;
            v_pieces := pg_catalog.array_fill(NULL::pg_catalog.text, ARRAY[v_n]);
            v_shift := 0;
            FOR v_i IN 1 .. v_n LOOP
                v_shift := v_shift OPERATOR(pg_catalog.+) v_diff[v_i];
                v_pieces[v_i OPERATOR(pg_catalog.+) v_shift] := v_tok[v_i];
            END LOOP;
            RETURN pg_catalog.array_to_string(v_pieces, '');
        END IF;
        -- The first failure in canonical order is the one the native edition meets.
        v_fail_at := NULL;
        v_shift := 0;
        v_k := 1;  -- the next of v_deep
        v_j := 1;  -- the next of v_bad
        FOR v_i IN 1 .. v_n LOOP
            v_shift := v_shift OPERATOR(pg_catalog.+) v_diff[v_i];
            IF v_i OPERATOR(pg_catalog.=) v_deep[v_k] OR v_i OPERATOR(pg_catalog.=) v_bad[v_j] THEN
                IF v_fail_at IS NULL OR v_i OPERATOR(pg_catalog.+) v_shift OPERATOR(pg_catalog.<) v_fail_at THEN
                    v_fail_at := v_i OPERATOR(pg_catalog.+) v_shift;
                    v_fail := CASE WHEN v_i OPERATOR(pg_catalog.=) v_deep[v_k] THEN 'deep' ELSE 'number' END;
                    v_bad_num := v_badt[v_j];
                END IF;
                IF v_i OPERATOR(pg_catalog.=) v_deep[v_k] THEN
                    v_k := v_k OPERATOR(pg_catalog.+) 1;
                ELSE
                    v_j := v_j OPERATOR(pg_catalog.+) 1;
                END IF;
            END IF;
        END LOOP;
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

-- The code points Rust's Debug writes as \u{hex} in a string (those neither printable nor
-- grapheme extenders, by the Unicode tables of the Rust that builds the native edition);
-- crates/idempotency-core checks this list against its own Rust's Debug.
CREATE FUNCTION idempotency._canon_debug_escapes()
RETURNS pg_catalog.int4multirange
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
SELECT '{
    [1,8],[11,12],[14,31],[127,160],[173,173],[768,879],[888,889],[896,899],[907,907],[909,909],
    [930,930],[1155,1161],[1328,1328],[1367,1368],[1419,1420],[1424,1469],[1471,1471],[1473,1474],
    [1476,1477],[1479,1487],[1515,1518],[1525,1541],[1552,1562],[1564,1564],[1611,1631],[1648,1648],
    [1750,1757],[1759,1764],[1767,1768],[1770,1773],[1806,1807],[1809,1809],[1840,1868],[1958,1968],
    [1970,1983],[2027,2035],[2043,2045],[2070,2073],[2075,2083],[2085,2087],[2089,2095],[2111,2111],
    [2137,2141],[2143,2143],[2155,2159],[2192,2207],[2250,2306],[2362,2362],[2364,2364],[2369,2376],
    [2381,2381],[2385,2391],[2402,2403],[2433,2433],[2436,2436],[2445,2446],[2449,2450],[2473,2473],
    [2481,2481],[2483,2485],[2490,2492],[2494,2494],[2497,2502],[2505,2506],[2509,2509],[2511,2523],
    [2526,2526],[2530,2533],[2558,2562],[2564,2564],[2571,2574],[2577,2578],[2601,2601],[2609,2609],
    [2612,2612],[2615,2615],[2618,2621],[2625,2648],[2653,2653],[2655,2661],[2672,2673],[2677,2677],
    [2679,2690],[2692,2692],[2702,2702],[2706,2706],[2729,2729],[2737,2737],[2740,2740],[2746,2748],
    [2753,2760],[2762,2762],[2765,2767],[2769,2783],[2786,2789],[2802,2808],[2810,2817],[2820,2820],
    [2829,2830],[2833,2834],[2857,2857],[2865,2865],[2868,2868],[2874,2876],[2878,2879],[2881,2886],
    [2889,2890],[2893,2907],[2910,2910],[2914,2917],[2936,2946],[2948,2948],[2955,2957],[2961,2961],
    [2966,2968],[2971,2971],[2973,2973],[2976,2978],[2981,2983],[2987,2989],[3002,3006],[3008,3008],
    [3011,3013],[3017,3017],[3021,3023],[3025,3045],[3067,3072],[3076,3076],[3085,3085],[3089,3089],
    [3113,3113],[3130,3132],[3134,3136],[3141,3159],[3163,3163],[3166,3167],[3170,3173],[3184,3190],
    [3201,3201],[3213,3213],[3217,3217],[3241,3241],[3252,3252],[3258,3260],[3263,3264],[3266,3266],
    [3269,3291],[3295,3295],[3298,3301],[3312,3312],[3316,3329],[3341,3341],[3345,3345],[3387,3388],
    [3390,3390],[3393,3397],[3401,3401],[3405,3405],[3408,3411],[3415,3415],[3426,3429],[3456,3457],
    [3460,3460],[3479,3481],[3506,3506],[3516,3516],[3518,3519],[3527,3535],[3538,3543],[3551,3557],
    [3568,3569],[3573,3584],[3633,3633],[3636,3646],[3655,3662],[3676,3712],[3715,3715],[3717,3717],
    [3723,3723],[3748,3748],[3750,3750],[3761,3761],[3764,3772],[3774,3775],[3781,3781],[3783,3791],
    [3802,3803],[3808,3839],[3864,3865],[3893,3893],[3895,3895],[3897,3897],[3912,3912],[3949,3966],
    [3968,3972],[3974,3975],[3981,4029],[4038,4038],[4045,4045],[4059,4095],[4141,4144],[4146,4151],
    [4153,4154],[4157,4158],[4184,4185],[4190,4192],[4209,4212],[4226,4226],[4229,4230],[4237,4237],
    [4253,4253],[4294,4294],[4296,4300],[4302,4303],[4681,4681],[4686,4687],[4695,4695],[4697,4697],
    [4702,4703],[4745,4745],[4750,4751],[4785,4785],[4790,4791],[4799,4799],[4801,4801],[4806,4807],
    [4823,4823],[4881,4881],[4886,4887],[4955,4959],[4989,4991],[5018,5023],[5110,5111],[5118,5119],
    [5760,5760],[5789,5791],[5881,5887],[5906,5918],[5938,5940],[5943,5951],[5970,5983],[5997,5997],
    [6001,6015],[6068,6069],[6071,6077],[6086,6086],[6089,6099],[6109,6111],[6122,6127],[6138,6143],
    [6155,6159],[6170,6175],[6265,6271],[6277,6278],[6313,6313],[6315,6319],[6390,6399],[6431,6434],
    [6439,6440],[6444,6447],[6450,6450],[6457,6463],[6465,6467],[6510,6511],[6517,6527],[6572,6575],
    [6602,6607],[6619,6621],[6679,6680],[6683,6685],[6742,6742],[6744,6752],[6754,6754],[6757,6764],
    [6771,6783],[6794,6799],[6810,6815],[6830,6915],[6964,6973],[6978,6980],[6989,6989],[7019,7027],
    [7040,7041],[7074,7077],[7080,7085],[7142,7142],[7144,7145],[7149,7149],[7151,7163],[7212,7219],
    [7222,7226],[7242,7244],[7307,7311],[7355,7356],[7368,7378],[7380,7392],[7394,7400],[7405,7405],
    [7412,7412],[7416,7417],[7419,7423],[7616,7679],[7958,7959],[7966,7967],[8006,8007],[8014,8015],
    [8024,8024],[8026,8026],[8028,8028],[8030,8030],[8062,8063],[8117,8117],[8133,8133],[8148,8149],
    [8156,8156],[8176,8177],[8181,8181],[8191,8207],[8232,8239],[8287,8303],[8306,8307],[8335,8335],
    [8349,8351],[8386,8447],[8588,8591],[9258,9279],[9291,9311],[11124,11125],[11503,11505],
    [11508,11512],[11558,11558],[11560,11564],[11566,11567],[11624,11630],[11633,11647],
    [11671,11679],[11687,11687],[11695,11695],[11703,11703],[11711,11711],[11719,11719],
    [11727,11727],[11735,11735],[11743,11775],[11870,11903],[11930,11930],[12020,12031],
    [12246,12271],[12288,12288],[12330,12335],[12352,12352],[12439,12442],[12544,12548],
    [12592,12592],[12687,12687],[12774,12782],[12831,12831],[42125,42127],[42183,42191],
    [42540,42559],[42607,42610],[42612,42621],[42654,42655],[42736,42737],[42744,42751],
    [42973,42992],[43010,43010],[43014,43014],[43019,43019],[43045,43046],[43052,43055],
    [43066,43071],[43128,43135],[43204,43213],[43226,43249],[43263,43263],[43302,43309],
    [43335,43345],[43347,43358],[43389,43394],[43443,43443],[43446,43449],[43452,43453],
    [43456,43456],[43470,43470],[43482,43485],[43493,43493],[43519,43519],[43561,43566],
    [43569,43570],[43573,43583],[43587,43587],[43596,43596],[43598,43599],[43610,43611],
    [43644,43644],[43696,43696],[43698,43700],[43703,43704],[43710,43711],[43713,43713],
    [43715,43738],[43756,43757],[43766,43776],[43783,43784],[43791,43792],[43799,43807],
    [43815,43815],[43823,43823],[43884,43887],[44005,44005],[44008,44008],[44013,44015],
    [44026,44031],[55204,55215],[55239,55242],[55292,55295],[57344,63743],[64110,64111],
    [64218,64255],[64263,64274],[64280,64284],[64286,64286],[64311,64311],[64317,64317],
    [64319,64319],[64322,64322],[64325,64325],[64976,65007],[65024,65039],[65050,65071],
    [65107,65107],[65127,65127],[65132,65135],[65141,65141],[65277,65280],[65438,65439],
    [65471,65473],[65480,65481],[65488,65489],[65496,65497],[65501,65503],[65511,65511],
    [65519,65531],[65534,65535],[65548,65548],[65575,65575],[65595,65595],[65598,65598],
    [65614,65615],[65630,65663],[65787,65791],[65795,65798],[65844,65846],[65935,65935],
    [65949,65951],[65953,65999],[66045,66175],[66205,66207],[66257,66272],[66300,66303],
    [66340,66348],[66379,66383],[66422,66431],[66462,66462],[66500,66503],[66518,66559],
    [66718,66719],[66730,66735],[66772,66775],[66812,66815],[66856,66863],[66916,66926],
    [66939,66939],[66955,66955],[66963,66963],[66966,66966],[66978,66978],[66994,66994],
    [67002,67002],[67005,67007],[67060,67071],[67383,67391],[67414,67423],[67432,67455],
    [67462,67462],[67505,67505],[67515,67583],[67590,67591],[67593,67593],[67638,67638],
    [67641,67643],[67645,67646],[67670,67670],[67743,67750],[67760,67807],[67827,67827],
    [67830,67834],[67868,67870],[67898,67902],[67930,67967],[68024,68027],[68048,68049],
    [68097,68111],[68116,68116],[68120,68120],[68150,68159],[68169,68175],[68185,68191],
    [68256,68287],[68325,68330],[68343,68351],[68406,68408],[68438,68439],[68467,68471],
    [68498,68504],[68509,68520],[68528,68607],[68681,68735],[68787,68799],[68851,68857],
    [68900,68911],[68922,68927],[68966,68973],[68998,69005],[69008,69215],[69247,69247],
    [69290,69292],[69294,69295],[69298,69313],[69320,69327],[69337,69375],[69416,69423],
    [69446,69456],[69466,69487],[69506,69509],[69514,69551],[69580,69599],[69623,69631],
    [69633,69633],[69688,69702],[69710,69713],[69744,69744],[69747,69748],[69750,69761],
    [69811,69814],[69817,69818],[69821,69821],[69826,69839],[69865,69871],[69882,69890],
    [69927,69931],[69933,69941],[69960,69967],[70003,70003],[70007,70017],[70070,70078],
    [70080,70080],[70089,70092],[70095,70095],[70112,70112],[70133,70143],[70162,70162],
    [70191,70193],[70196,70199],[70206,70206],[70209,70271],[70279,70279],[70281,70281],
    [70286,70286],[70302,70302],[70314,70319],[70367,70367],[70371,70383],[70394,70401],
    [70404,70404],[70413,70414],[70417,70418],[70441,70441],[70449,70449],[70452,70452],
    [70458,70460],[70462,70462],[70464,70464],[70469,70470],[70473,70474],[70477,70479],
    [70481,70492],[70500,70527],[70538,70538],[70540,70541],[70543,70543],[70582,70582],
    [70584,70584],[70587,70601],[70603,70603],[70606,70608],[70610,70610],[70614,70614],
    [70617,70655],[70712,70719],[70722,70724],[70726,70726],[70748,70748],[70750,70750],
    [70754,70783],[70832,70832],[70835,70840],[70842,70842],[70845,70845],[70847,70848],
    [70850,70851],[70856,70863],[70874,71039],[71087,71087],[71090,71095],[71100,71101],
    [71103,71104],[71132,71167],[71219,71226],[71229,71229],[71231,71232],[71237,71247],
    [71258,71263],[71277,71295],[71339,71339],[71341,71341],[71344,71351],[71354,71359],
    [71370,71375],[71396,71423],[71451,71453],[71455,71455],[71458,71461],[71463,71471],
    [71495,71679],[71727,71735],[71737,71738],[71740,71839],[71923,71934],[71943,71944],
    [71946,71947],[71956,71956],[71959,71959],[71984,71984],[71990,71990],[71993,71998],
    [72003,72003],[72007,72015],[72026,72095],[72104,72105],[72148,72155],[72160,72160],
    [72165,72191],[72193,72202],[72243,72248],[72251,72254],[72263,72271],[72273,72278],
    [72281,72283],[72330,72342],[72344,72345],[72355,72367],[72441,72447],[72458,72544],
    [72546,72548],[72550,72550],[72552,72639],[72674,72687],[72698,72703],[72713,72713],
    [72752,72765],[72767,72767],[72774,72783],[72813,72815],[72848,72872],[72874,72880],
    [72882,72883],[72885,72959],[72967,72967],[72970,72970],[73009,73029],[73031,73039],
    [73050,73055],[73062,73062],[73065,73065],[73103,73106],[73109,73109],[73111,73111],
    [73113,73119],[73130,73135],[73180,73183],[73194,73439],[73459,73460],[73465,73473],
    [73489,73489],[73526,73533],[73536,73538],[73562,73647],[73649,73663],[73714,73726],
    [74650,74751],[74863,74863],[74869,74879],[75076,77711],[77811,77823],[78896,78912],
    [78919,78943],[82939,82943],[83527,90367],[90398,90409],[90413,90415],[90426,92159],
    [92729,92735],[92767,92767],[92778,92781],[92863,92863],[92874,92879],[92910,92916],
    [92918,92927],[92976,92982],[92998,93007],[93018,93018],[93026,93026],[93048,93052],
    [93072,93503],[93562,93759],[93851,93855],[93881,93882],[93908,93951],[94027,94031],
    [94088,94098],[94112,94175],[94180,94193],[94199,94207],[101590,101630],[101663,101759],
    [101875,110575],[110580,110580],[110588,110588],[110591,110591],[110883,110897],[110899,110927],
    [110931,110932],[110934,110947],[110952,110959],[111356,113663],[113771,113775],[113789,113791],
    [113801,113807],[113818,113819],[113821,113822],[113824,117759],[118013,118015],[118452,118457],
    [118481,118495],[118513,118607],[118724,118783],[119030,119039],[119079,119080],[119141,119145],
    [119149,119170],[119173,119179],[119210,119213],[119275,119295],[119362,119364],[119366,119487],
    [119508,119519],[119540,119551],[119639,119647],[119673,119807],[119893,119893],[119965,119965],
    [119968,119969],[119971,119972],[119975,119976],[119981,119981],[119994,119994],[119996,119996],
    [120004,120004],[120070,120070],[120075,120076],[120085,120085],[120093,120093],[120122,120122],
    [120127,120127],[120133,120133],[120135,120137],[120145,120145],[120486,120487],[120780,120781],
    [121344,121398],[121403,121452],[121461,121461],[121476,121476],[121484,122623],[122655,122660],
    [122667,122927],[122990,123135],[123181,123190],[123198,123199],[123210,123213],[123216,123535],
    [123566,123583],[123628,123631],[123642,123646],[123648,124111],[124140,124143],[124154,124367],
    [124398,124399],[124411,124414],[124416,124607],[124639,124639],[124643,124643],[124646,124646],
    [124654,124655],[124661,124669],[124672,124895],[124903,124903],[124908,124908],[124911,124911],
    [124927,124927],[125125,125126],[125136,125183],[125252,125258],[125260,125263],[125274,125277],
    [125280,126064],[126133,126208],[126270,126463],[126468,126468],[126496,126496],[126499,126499],
    [126501,126502],[126504,126504],[126515,126515],[126520,126520],[126522,126522],[126524,126529],
    [126531,126534],[126536,126536],[126538,126538],[126540,126540],[126544,126544],[126547,126547],
    [126549,126550],[126552,126552],[126554,126554],[126556,126556],[126558,126558],[126560,126560],
    [126563,126563],[126565,126566],[126571,126571],[126579,126579],[126584,126584],[126589,126589],
    [126591,126591],[126602,126602],[126620,126624],[126628,126628],[126634,126634],[126652,126703],
    [126706,126975],[127020,127023],[127124,127135],[127151,127152],[127168,127168],[127184,127184],
    [127222,127231],[127406,127461],[127491,127503],[127548,127551],[127561,127567],[127570,127583],
    [127590,127743],[128729,128731],[128749,128751],[128765,128767],[128986,128991],[129004,129007],
    [129009,129023],[129036,129039],[129096,129103],[129114,129119],[129160,129167],[129198,129199],
    [129212,129215],[129218,129231],[129241,129279],[129624,129631],[129646,129647],[129661,129663],
    [129675,129677],[129735,129735],[129737,129740],[129757,129758],[129771,129774],[129785,129791],
    [129939,129939],[130043,131071],[173792,173823],[178206,178207],[183982,183983],[191457,191471],
    [192094,194559],[195102,196607],[201547,201551],[210042,1114111]
}'::pg_catalog.int4multirange
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
    v_escapes pg_catalog.int4multirange := idempotency._canon_debug_escapes();
BEGIN
    IF value OPERATOR(pg_catalog.=) '' THEN
        RETURN '""';
    END IF;
    FOREACH v_c IN ARRAY pg_catalog.regexp_split_to_array(pg_catalog.left(value, 40), '') LOOP
        -- ascii() gives the code point in UTF-8 databases, of ASCII characters in others.
        -- (Other encodings: a character outside ASCII stays as it is here, and _canon_message
        -- escapes it by its Unicode code point; ascii() would give a byte of LATIN1 or WIN1252,
        -- not the code point, and refuses a character of several bytes.)
        v_cp := CASE WHEN v_utf8 THEN pg_catalog.ascii(v_c)
                     WHEN pg_catalog.octet_length(v_c) OPERATOR(pg_catalog.<>) 1 THEN 160
                     WHEN pg_catalog.ascii(v_c) OPERATOR(pg_catalog.<) 128 THEN pg_catalog.ascii(v_c)
                     ELSE 160 END;
        v_out := v_out OPERATOR(pg_catalog.||) CASE
            WHEN v_cp OPERATOR(pg_catalog.=) 34 THEN E'\\"'
            WHEN v_cp OPERATOR(pg_catalog.=) 92 THEN E'\\\\'
            WHEN v_cp OPERATOR(pg_catalog.=) 9 THEN E'\\t'
            WHEN v_cp OPERATOR(pg_catalog.=) 10 THEN E'\\n'
            WHEN v_cp OPERATOR(pg_catalog.=) 13 THEN E'\\r'
            WHEN v_cp OPERATOR(pg_catalog.<) 32
                 OR v_cp OPERATOR(pg_catalog.>=) 127 AND v_cp OPERATOR(pg_catalog.<) 160
                 -- (Other encodings: their characters outside ASCII are escaped in the
                 -- message itself, _canon_message.)
                 OR v_utf8 AND v_cp OPERATOR(pg_catalog.>=) 160
                    AND v_cp OPERATOR(pg_catalog.<@) v_escapes
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
       OR pg_catalog.octet_length(pg_catalog.convert_to(message, 'UTF8')) OPERATOR(pg_catalog.=) pg_catalog.length(message) THEN
        RETURN message;  -- UTF-8, or ASCII only (every other character takes 2+ bytes in UTF-8)
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
        -- (An ellipsis, the native edition's mark of a value cut short, as three dots.)
        v_out := v_out OPERATOR(pg_catalog.||) CASE WHEN v_cp OPERATOR(pg_catalog.=) 8230 THEN '...'
                                                    ELSE pg_catalog.format(E'\\u{%s}', pg_catalog.to_hex(v_cp)) END;
    END LOOP;
    RETURN v_out;
END
$fn$;

-- Removes what `entries` name, with the native edition's result: a plain name removes a top-level
-- member; an entry starting with '/' is an RFC 6901 JSON Pointer (an array index only in its
-- canonical spelling: 0, or digits without a leading 0); a path that does not exist removes
-- nothing; a malformed pointer is 22P02 (the first one, in the entries' order).
--
-- In time near-linear in the document and the entries: removing one member copies the whole
-- document, so one removal per entry was quadratic (8,000 names from 8,000 members: 9 s). From an
-- object, the top-level members that plain names and one-token pointers name are removed together,
-- in one pass that hashes the names; they commute with every other entry (removing a member and
-- removing something inside it leave the same document in either order). Deeper pointers, and
-- pointers into an array (whose removals shift the later indexes), apply one after the other, in
-- the entries' order.
-- The tokens of an RFC 6901 JSON Pointer (`entry` starts with '/'), unescaped; 22P02 for a '~'
-- not followed by 0 or 1.
CREATE FUNCTION idempotency._canon_pointer(entry text)
RETURNS text[]
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_tokens text[];
    v_i      integer;
BEGIN
    IF entry OPERATOR(pg_catalog.=) '/' THEN
        RETURN '{""}';
    END IF;
    v_tokens := pg_catalog.string_to_array(pg_catalog.substr(entry, 2), '/');
    FOR v_i IN 1 .. pg_catalog.cardinality(v_tokens) LOOP
        IF v_tokens[v_i] OPERATOR(pg_catalog.~) '~([^01]|$)' THEN
            RAISE EXCEPTION USING
                ERRCODE = 'invalid_text_representation',
                MESSAGE = idempotency._canon_message(pg_catalog.format(
                    'exclude: "%s" is not a member name or an RFC 6901 JSON Pointer',
                    CASE WHEN pg_catalog.length(entry) OPERATOR(pg_catalog.>) 80
                         THEN pg_catalog.left(entry, 80) OPERATOR(pg_catalog.||) '...'
                         ELSE entry END)),
                HINT = 'use ~0 for ''~'' and ~1 for ''/'' inside a pointer token';
        END IF;
        v_tokens[v_i] := pg_catalog.replace(pg_catalog.replace(v_tokens[v_i], '~1', '/'), '~0', '~');
    END LOOP;
    RETURN v_tokens;
END
$fn$;

CREATE FUNCTION idempotency._canon_exclude(doc jsonb, entries text[])
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_doc    jsonb := doc;
    v_object boolean := pg_catalog.jsonb_typeof(doc) OPERATOR(pg_catalog.=) 'object';
    v_names  text[] := '{}';
    v_deep   integer[] := '{}';
    v_k      integer;
    v_entry  text;
    v_tokens text[];
    v_cur    jsonb;
    v_found  boolean;
    v_i      integer;
    v_n      integer;
BEGIN
    IF pg_catalog.array_ndims(entries) OPERATOR(pg_catalog.>) 1 THEN
        -- Taken in storage order, as the native edition takes a multi-dimensional array.
        entries := ARRAY(SELECT e.entry FROM pg_catalog.unnest(entries) WITH ORDINALITY AS e(entry, n)
                          ORDER BY e.n);
    END IF;
    FOR v_k IN 1 .. COALESCE(pg_catalog.cardinality(entries), 0) LOOP
        v_entry := entries[v_k];
        IF pg_catalog.left(v_entry, 1) OPERATOR(pg_catalog.<>) '/' THEN
            IF v_object THEN
                v_names := v_names OPERATOR(pg_catalog.||) v_entry;
            END IF;
            CONTINUE;
        END IF;
        v_tokens := idempotency._canon_pointer(v_entry);
        IF v_object AND pg_catalog.cardinality(v_tokens) OPERATOR(pg_catalog.=) 1 THEN
            v_names := v_names OPERATOR(pg_catalog.||) v_tokens[1];
        ELSE
            v_deep := v_deep OPERATOR(pg_catalog.||) v_k;
        END IF;
    END LOOP;
    IF pg_catalog.cardinality(v_names) OPERATOR(pg_catalog.>) 0 THEN
        -- A hash anti-join of the members with the names (jsonb's own removal of a text[]
        -- compares each member with every name).
        v_doc := COALESCE((SELECT pg_catalog.jsonb_object_agg(m.key, m.value)
                             FROM pg_catalog.jsonb_each(v_doc) AS m
                            WHERE NOT EXISTS (SELECT FROM (SELECT DISTINCT x.name
                                                             FROM pg_catalog.unnest(v_names) AS x(name)) AS d
                                               WHERE d.name OPERATOR(pg_catalog.=) m.key)),
                          '{}'::jsonb);
    END IF;
    FOREACH v_k IN ARRAY v_deep LOOP
        v_tokens := idempotency._canon_pointer(entries[v_k]);
        v_n := pg_catalog.cardinality(v_tokens);
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
