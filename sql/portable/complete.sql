-- Portable edition: completions.
--
-- One statement checks, marks and updates; a refused completion leaves the key alone.
--
-- Part of the store in SQL and PL/pgSQL: sql/portable/README.md says how the files fit together.

-- complete's work as the store's owner; the completing role (for the audit row) is passed by
-- _complete, which runs as the caller. One statement reads what the checks need (the store's
-- configuration, the session's row of idempotency.role_settings (the SET ROLE role's when it has
-- one, else the session user's), whether ALTER ROLE of the session user or ALTER DATABASE turned
-- audit on); _stored_key, _p_check_size, _p_refuse_read_only and _p_mark are
-- called only where one may fail or the database is not UTF-8 (their checks are made here the
-- same way: a change there changes this copy too); each statement and each nested call costs
-- more than the work of this path, run by every completion.
CREATE FUNCTION idempotency._p_complete(
    p_key text, p_response jsonb, p_status integer, p_scope text, p_token bigint, p_ttl interval, p_role name)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    c record;
    v_key text;
    v_expires_at timestamptz;
    v_hash bytea;
    v_token bigint;
    v_raw text;
    v_xact text;
    v_state text;
    v_count integer;
    v_lock bigint;
    v_set text;
    v_busy boolean;
    v_live boolean;
BEGIN
    -- The role the caller ran as, where the session may act as it (inside another SECURITY
    -- DEFINER function it may not: then, and for a role passed by anyone else, the session's
    -- login role, which the native edition names there too unless SET ROLE changed it).
    IF p_role IS NULL OR p_role OPERATOR(pg_catalog.<>) SESSION_USER
                         AND NOT pg_catalog.pg_has_role(SESSION_USER, p_role, 'MEMBER') THEN
        p_role := SESSION_USER;
    END IF;
    SELECT pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8'
           AND p_key IS NOT NULL AND p_key OPERATOR(pg_catalog.<>) '' AND pg_catalog.length(p_key) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           AND p_scope IS NOT NULL AND pg_catalog.length(p_scope) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           -- _p_scope_prefix
           AND pg_catalog.starts_with(p_scope, COALESCE(r.scope_prefix,
                   pg_catalog.current_setting('idempotency.scope_prefix', true), '')) AS ok,
           -- _stored_key's form of the key
           CASE WHEN x.key_storage IS NULL OR x.key_storage OPERATOR(pg_catalog.=) 'plain' THEN p_key
                WHEN x.key_secret IS NULL THEN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(p_key, 'UTF8')), 'hex')
           END AS stored,
           r.max_response_size,
           -- Whether the key has a live claim this call may complete, as last committed (the
           -- update's own test): only then is the key marked before the update (see below). A
           -- scalar subquery, not EXISTS, which the planner may turn into a hash of every key of
           -- the scope.
           COALESCE((SELECT true FROM idempotency.idempotency_keys AS k
                    WHERE k.scope OPERATOR(pg_catalog.=) p_scope
                      AND k.key OPERATOR(pg_catalog.=) CASE WHEN x.key_storage IS NULL OR x.key_storage OPERATOR(pg_catalog.=) 'plain' THEN p_key
                                                            WHEN x.key_secret IS NULL THEN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(p_key, 'UTF8')), 'hex')
                                                       END
                      AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
                      AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
                      AND (p_token IS NULL OR k.token OPERATOR(pg_catalog.=) p_token)), false) AS live,
           -- Whether the role is audited: its row, or idempotency.audit set on by ALTER ROLE or
           -- ALTER DATABASE (spelled as PostgreSQL spells on, without spaces)
           r.audit IS TRUE OR EXISTS (
               SELECT FROM pg_catalog.pg_db_role_setting AS s
                WHERE s.setdatabase OPERATOR(pg_catalog.=) ANY (ARRAY[(SELECT d.oid FROM pg_catalog.pg_database AS d
                                               WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()), 0]::pg_catalog.oid[])
                  AND s.setrole OPERATOR(pg_catalog.=) ANY (ARRAY[a.role, 0]::pg_catalog.oid[])
                  AND EXISTS (SELECT FROM pg_catalog.unnest(s.setconfig) AS e(entry)
                               WHERE pg_catalog.lower(pg_catalog.split_part(e.entry, '=', 1)) OPERATOR(pg_catalog.=) 'idempotency.audit'
                                 AND pg_catalog.lower(pg_catalog.substr(e.entry,
                                       pg_catalog.strpos(e.entry, '=') OPERATOR(pg_catalog.+) 1))
                                     OPERATOR(pg_catalog.=) ANY (ARRAY['on', 'true', 'tru', 'tr', 't', 'yes', 'ye', 'y', '1']))) AS audit
      INTO c
      FROM (SELECT pg_catalog.to_regrole(pg_catalog.quote_ident(SESSION_USER))::pg_catalog.oid AS role) AS a
      -- The SET ROLE role's row when it has one, else the session user's.
      LEFT JOIN idempotency.role_settings AS r ON r.role::pg_catalog.oid OPERATOR(pg_catalog.=) COALESCE(
                (SELECT s.role::pg_catalog.oid FROM idempotency.role_settings AS s
                  WHERE s.role::pg_catalog.oid OPERATOR(pg_catalog.=)
                        (SELECT b.oid FROM pg_catalog.pg_roles AS b
                          WHERE b.rolname OPERATOR(pg_catalog.=) pg_catalog.current_setting('role')::pg_catalog.name)),
                a.role)
      LEFT JOIN idempotency.config AS x ON true;
    IF c.ok AND c.stored IS NOT NULL THEN
        v_key := c.stored;
        v_live := c.live;
    ELSE
        v_key := idempotency._stored_key(p_key, p_scope);  -- raises, or the keyed hash or a key of a database that is not UTF-8
    END IF;
    IF p_status IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'response_status must not be NULL';
    ELSIF p_status OPERATOR(pg_catalog.<) 100 OR p_status OPERATOR(pg_catalog.>) 599 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('response_status must be between 100 and 599 (got %s)', p_status);
    END IF;
    IF p_ttl IS NOT NULL THEN
        PERFORM idempotency._p_duration('ttl', p_ttl);
    END IF;
    -- _p_check_size is called where the response may be too large (it raises): larger than the
    -- smallest limit there is (1 kB) while idempotency.max_response_size exists (set anywhere, by
    -- the session or an administrator), else larger than the default or the role's row allows.
    IF p_response IS NOT NULL THEN
        v_raw := pg_catalog.current_setting('idempotency.max_response_size', true);
        IF pg_catalog.pg_column_size(p_response) OPERATOR(pg_catalog.>) 1024
           AND (v_raw IS NOT NULL
                OR pg_catalog.pg_column_size(p_response)::bigint OPERATOR(pg_catalog.>)
                   (LEAST(4096, c.max_response_size)::bigint OPERATOR(pg_catalog.*) 1024)) THEN
            PERFORM idempotency._p_check_size('response', pg_catalog.pg_column_size(p_response)::bigint, 'response');
        ELSIF pg_catalog.btrim(v_raw) OPERATOR(pg_catalog.<>) ALL ('{"",4MB}'::pg_catalog.text[]) THEN
            -- A bad value is refused by the call that reads it (natively by its SET), whatever
            -- the response's size.
            PERFORM idempotency._p_setting('idempotency.max_response_size', 4096, 'kB');
        END IF;
    END IF;
    IF pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on' THEN
        PERFORM idempotency._p_refuse_read_only('complete');  -- raises
    END IF;
    IF v_live IS NULL THEN
        -- (The key's stored form was not known to the first statement.)
        v_live := EXISTS (SELECT FROM idempotency.idempotency_keys AS k
                           WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) v_key
                             AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
                             AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
                             AND (p_token IS NULL OR k.token OPERATOR(pg_catalog.=) p_token));
    END IF;
    v_lock := pg_catalog.hashtextextended(pg_catalog.length(p_scope)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                                          OPERATOR(pg_catalog.||) p_scope OPERATOR(pg_catalog.||) v_key, 5432);
    v_busy := false;
    IF v_live THEN
        -- _p_mark(scope, key, true) (as the trigger would), then the update, which the trigger
        -- need not mark again.
        v_xact := pg_catalog.pg_current_xact_id()::pg_catalog.text;
        v_state := pg_catalog.current_setting('idempotency_portable.marks', true);
        v_count := CASE WHEN pg_catalog.split_part(v_state, ':', 1) OPERATOR(pg_catalog.=) v_xact
                        THEN pg_catalog.split_part(v_state, ':', 2)::pg_catalog.int4 ELSE 0 END;
        IF v_count OPERATOR(pg_catalog.<) @PORTABLE_MARKS_PER_TRANSACTION@ THEN
            IF pg_catalog.pg_try_advisory_xact_lock(v_lock) OR idempotency._p_lock_retry(v_lock) THEN
                v_set := pg_catalog.set_config('idempotency_portable.marks',
                                               v_xact OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) (v_count OPERATOR(pg_catalog.+) 1), false);
            ELSE
                -- Another open transaction marked the key: it is writing the key's row.
                v_busy := true;
            END IF;
        END IF;
        v_set := pg_catalog.set_config('idempotency_portable.marked', 'on', true);
    ELSE
        -- No live claim to complete: the call is refused (IK001..IK003) and changes no row, so
        -- it does not mark the key. A transaction's advisory lock is let go only when it ends,
        -- and while the refusal ran, claims of the key answered in_progress where, as natively,
        -- a completed key replays and an absent, expired or lease-over one is claimed. Only
        -- whether another open transaction marked the key is tested (a shared lock, released
        -- at once, as a claim tests it): one writing the row (a takeover, a forget) is waited
        -- for below. A live claim committed since the test is completed by the update all the
        -- same, and marked by the trigger.
        v_busy := NOT (pg_catalog.pg_try_advisory_lock_shared(v_lock) AND pg_catalog.pg_advisory_unlock_shared(v_lock));
    END IF;
    FOR v_try IN 1 .. 2 LOOP
        UPDATE idempotency.idempotency_keys AS k SET
               status = 'completed'::idempotency.key_status, response = p_response, response_status = p_status,
               completed_at = pg_catalog.now(), locked_until = NULL,
               expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) COALESCE(p_ttl, k.ttl),
               ttl = COALESCE(p_ttl, k.ttl)
         WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) v_key
           AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
           AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
           AND (p_token IS NULL OR k.token OPERATOR(pg_catalog.=) p_token)
        RETURNING k.expires_at, k.request_hash, k.token INTO v_expires_at, v_hash, v_token;
        -- Nothing to change in the row this statement saw, while another open transaction is
        -- writing it (a takeover of an expired claim, a forget): in READ COMMITTED, wait for that
        -- transaction, as the native edition does (not for one that only locks the row, nor in
        -- REPEATABLE READ, where the native edition answers from its snapshot at once), and try
        -- once more on what it left (a new statement sees it).
        EXIT WHEN v_token IS NOT NULL OR v_try OPERATOR(pg_catalog.=) 2 OR NOT v_busy
                  OR pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed';
        PERFORM FROM idempotency.idempotency_keys AS k
          WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) v_key
          FOR NO KEY UPDATE;
        EXIT WHEN NOT FOUND;
    END LOOP;
    v_set := pg_catalog.set_config('idempotency_portable.marked', 'off', true);
    IF v_token IS NULL THEN
        RETURN NULL;
    END IF;
    -- (A value of idempotency.audit that is not a Boolean is refused even where the role's row
    -- audits: natively its SET is.)
    -- ('off', the native edition's default where its library loads, and '' or nothing, unset,
    -- are off without the call.)
    -- An administrator's on is a floor: a session's off (SET, a startup option) does not undo
    -- the server's configuration (read only where the placeholder exists: else nothing set it).
    IF COALESCE(pg_catalog.current_setting('idempotency.audit', true), '') OPERATOR(pg_catalog.<>) ALL ('{"",off}'::pg_catalog.text[])
       AND idempotency._p_setting_on('idempotency.audit')
       OR c.audit
       OR pg_catalog.current_setting('idempotency.audit', true) IS NOT NULL
          AND idempotency._p_admin_on('idempotency.audit') THEN
        INSERT INTO idempotency.audit
               (scope, key, key_is_hash, request_hash, token, response_status, completed_at, completed_by)
        VALUES (p_scope, v_key, v_key OPERATOR(pg_catalog.<>) p_key, v_hash, v_token, p_status, pg_catalog.now(), p_role);
    END IF;
    RETURN v_expires_at;
END
$fn$;

-- Runs as the caller (the audit row names the completing role: CURRENT_USER here), the work as
-- the owner. A single-expression SQL function without SET search_path (every name in it is
-- schema-qualified), so the planner inlines it into complete's expression, itself inlined into
-- the caller's statement: a call of a PL/pgSQL function fewer on the path of every completion.
BODY idempotency._complete
LANGUAGE sql
AS $fn$
    SELECT idempotency._p_complete($1, $2, $3, $4, $5, $6, CURRENT_USER)
$fn$;
