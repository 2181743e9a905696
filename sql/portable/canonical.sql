-- Portable edition: canonical_json and canonical_hash in SQL and PL/pgSQL.
--
-- The same bytes as the native edition (crates/idempotency-core/src/canonical.rs and
-- exclusion.rs): RFC 8785 layout, member names in UTF-16 code-unit order, strings escaped as
-- the RFC says, numbers exact (their decimal value in the ECMAScript layout) or, in 'rfc8785'
-- mode, rounded to the nearest double and written as ECMAScript's Number::toString does.
-- Nesting deeper than @MAX_DEPTH@ levels is 54001, as in the native edition. Hashes are SHA-256 of
-- the UTF-8 bytes of the exact form, whatever the database encoding.
--
-- No recursion in PL/pgSQL (a document @MAX_DEPTH@ levels deep would exceed the stack): a nested
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
-- the argument in errors ("doc: document is nested deeper than @MAX_DEPTH@ levels"). `depth` is the
-- nesting allowed: @MAX_DEPTH@, as for any argument; request_fingerprint writes its arguments, each
-- checked, one level down.
CREATE FUNCTION idempotency._canon_text(doc jsonb, exact boolean, arg text, depth integer DEFAULT @MAX_DEPTH@)
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
                MESSAGE = arg OPERATOR(pg_catalog.||) ': document is nested deeper than @MAX_DEPTH@ levels';
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

BODY idempotency.canonical_json
LANGUAGE plpgsql
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

BODY idempotency.canonical_hash
LANGUAGE plpgsql
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
               'strict $.**{@MAX_DEPTH@ to last} ? (@.type() == "object" || @.type() == "array")') THEN
            RAISE EXCEPTION USING
                ERRCODE = 'statement_too_complex',
                MESSAGE = 'doc: document is nested deeper than @MAX_DEPTH@ levels';
        END IF;
        doc := idempotency._canon_exclude(doc, exclude);
    END IF;
    RETURN pg_catalog.sha256(pg_catalog.convert_to(idempotency._canon_text(doc, true, 'doc'), 'UTF8'));
END
$fn$;
