-- Portable edition: members left out of canonical_hash.
--
-- As crates/idempotency-core/src/exclusion.rs: plain names and JSON Pointers (RFC 6901), near-linear
-- in the document and the list.
--
-- Part of the canonical form in SQL and PL/pgSQL (canonical.sql; sql/portable/README.md).

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
