-- Portable edition: claims.
--
-- claim and claim_many, on the mark protocol of marks.sql.
--
-- Part of the store in SQL and PL/pgSQL: sql/portable/README.md says how the files fit together.

-- The answer to a claim that meets another open transaction's claim of the key.
CREATE FUNCTION idempotency._p_busy()
RETURNS idempotency.claim_result
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT ROW('in_progress', NULL, NULL, NULL,
               pg_catalog.make_interval(secs => GREATEST(idempotency._p_setting('idempotency.busy_retry_after', @DEFAULT_BUSY_RETRY_AFTER_MS@, 'ms'), 1)
                                                OPERATOR(pg_catalog./) 1000.0),
               NULL, NULL)::idempotency.claim_result
$fn$;

-- Whether the claim waited for a sweep that held the expired row it found and has now ended
-- (then the key is looked at again: an expired key counts as absent whatever a sweep is doing).
-- `p_xmax` is the row's holder: every sweep holds its transaction's mark,
-- pg_advisory_xact_lock_shared(@SWEEP_LOCK_CLASS@, its xid's low 32 bits), before it locks a row,
-- so a holder whose mark is held is a sweep. Its end is waited for as a lock wait (which
-- PostgreSQL's deadlock detection sees), at most busy_retry_after: a sweep called in a long
-- transaction keeps its rows until that ends (then false, and the key is busy). False at once
-- for any other holder (a claimer restarting the key, a forget).
CREATE FUNCTION idempotency._p_waited_for_sweep(p_xmax xid)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_mark integer := (p_xmax::pg_catalog.text::pg_catalog.int8)::pg_catalog.bit(32)::pg_catalog.int4;
    v_timeout text := pg_catalog.current_setting('lock_timeout');
BEGIN
    IF pg_catalog.pg_try_advisory_lock(@SWEEP_LOCK_CLASS@, v_mark) THEN
        PERFORM pg_catalog.pg_advisory_unlock(@SWEEP_LOCK_CLASS@, v_mark);
        RETURN false;
    END IF;
    PERFORM pg_catalog.set_config('lock_timeout', GREATEST(idempotency._p_setting(
                'idempotency.busy_retry_after', @DEFAULT_BUSY_RETRY_AFTER_MS@, 'ms'), 1)::pg_catalog.text, true);
    BEGIN
        PERFORM pg_catalog.pg_advisory_lock(@SWEEP_LOCK_CLASS@, v_mark);
        PERFORM pg_catalog.pg_advisory_unlock(@SWEEP_LOCK_CLASS@, v_mark);
    EXCEPTION WHEN lock_not_available THEN
        PERFORM pg_catalog.set_config('lock_timeout', v_timeout, true);
        RETURN false;
    END;
    PERFORM pg_catalog.set_config('lock_timeout', v_timeout, true);
    RETURN true;
END
$fn$;

-- A token above the key's previous one `old`, for a restart or a takeover: the sequence's next
-- value, and where that is not above it (the sequence may lag behind the store after a restore
-- of rows without it), the sequence is first moved past it. Never into the upper half of the
-- sequence's range: the sequence is shared by every key, and one row whose token is there
-- (restored from a dump or written by hand; the sequence itself gets there only after handing
-- out half its range) would otherwise leave it next to nothing, or with bigint's maximum
-- nothing at all, so that every later claim of any key failed (2200H). The claim of such a key
-- is refused with 22003 instead (tokens must rise per key, so no smaller one is given), and the
-- sequence is left where it is: the key is usable again once forget or the sweep deleted its
-- row. As natively (next_token_above in src/store/sql.rs).
CREATE FUNCTION idempotency._p_token_above(p_key text, old bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_token bigint := pg_catalog.nextval('idempotency.token_seq');
    v_highest bigint;
BEGIN
    IF v_token OPERATOR(pg_catalog.>) old THEN
        RETURN v_token;
    END IF;
    SELECT s.seqmax OPERATOR(pg_catalog./) 2 INTO v_highest
      FROM pg_catalog.pg_sequence AS s
     WHERE s.seqrelid OPERATOR(pg_catalog.=) 'idempotency.token_seq'::pg_catalog.regclass;
    IF old OPERATOR(pg_catalog.>) v_highest THEN
        RAISE EXCEPTION USING
            ERRCODE = 'numeric_value_out_of_range',
            MESSAGE = idempotency._canon_message(pg_catalog.format(
                'idempotency.claim: key %s has token %s, above the highest token a claim moves the token sequence past (%s): no larger token is issued for it',
                idempotency._p_key_label(p_key), old, v_highest)),
            HINT = 'the row was restored from a dump or written by hand; delete it with idempotency.forget(key, scope) (the sweep deletes it once it expires), then claim the key again';
    END IF;
    PERFORM pg_catalog.setval('idempotency.token_seq', old, true);
    RETURN pg_catalog.nextval('idempotency.token_seq');
END
$fn$;

-- The claim algorithm on a key in its stored form, arguments checked: the outcome table
-- applied to the row, the row read and written through SQL. Never waits on another
-- transaction's claim of the key beyond idempotency.claim_wait (see _p_mark; a row
-- another transaction is changing is skipped, not waited for).
CREATE FUNCTION idempotency._p_claim(p_scope text, p_key text, p_hash bytea, p_ttl interval, p_lease interval)
RETURNS idempotency.claim_result
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    r record;
    res idempotency.claim_result;
    v_rounds integer := 0;
    v_token bigint;
    v_busy boolean;
    v_started timestamptz;
    v_wait integer;
    v_mark boolean;
    v_timeout text;
    v_xmax xid;
    v_expired boolean;
BEGIN
    LOOP
        v_busy := false;
        SELECT k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status AS completed,
               k.request_hash, k.token, k.response, k.response_status, k.recovery_point, k.expires_at,
               k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now() AS expired,
               k.locked_until OPERATOR(pg_catalog.<=) pg_catalog.now() AS lease_over,
               GREATEST(k.locked_until OPERATOR(pg_catalog.-) pg_catalog.now(), '1 second'::pg_catalog.interval) AS retry_after,
               k.xmax AS holder
          INTO r
          FROM idempotency.idempotency_keys AS k
         WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key;
        IF NOT FOUND THEN
            v_mark := idempotency._p_mark(p_scope, p_key, false);
            IF NOT v_mark THEN
                v_busy := true;
            ELSIF v_mark IS NULL THEN
                -- Past the transaction's marks: another open transaction past its own may have
                -- inserted the key unmarked, and an insert would wait for it (and it, in turn,
                -- for this one's unmarked keys: a deadlock). The insert waits a millisecond at
                -- most (lock_timeout, in a subtransaction that its timeout rolls back): a key
                -- it would wait for longer is busy, as natively. (The transaction holds the
                -- store's table lock from its earlier writes, so the wait can only be a row's.)
                BEGIN
                    v_timeout := pg_catalog.current_setting('lock_timeout');
                    PERFORM pg_catalog.set_config('lock_timeout', '1ms', true);
                    PERFORM pg_catalog.set_config('idempotency_portable.marked', 'on', true);
                    IF NOT EXISTS (SELECT FROM pg_catalog.pg_rewrite AS w
                                    WHERE w.ev_class OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
                        INSERT INTO idempotency.idempotency_keys AS k
                               (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl)
                        VALUES (p_scope, p_key, p_hash, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(),
                                pg_catalog.now() OPERATOR(pg_catalog.+) p_lease, pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, p_ttl)
                        ON CONFLICT (scope, key) DO NOTHING
                        RETURNING k.token, k.expires_at INTO res.token, res.expires_at;
                    ELSE
                        -- A store with rules refuses ON CONFLICT (as below).
                        INSERT INTO idempotency.idempotency_keys AS k
                               (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl)
                        VALUES (p_scope, p_key, p_hash, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(),
                                pg_catalog.now() OPERATOR(pg_catalog.+) p_lease, pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, p_ttl);
                        SELECT k.token, k.expires_at INTO res.token, res.expires_at
                          FROM idempotency.idempotency_keys AS k
                         WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key;
                    END IF;
                    PERFORM pg_catalog.set_config('idempotency_portable.marked', 'off', true);
                    PERFORM pg_catalog.set_config('lock_timeout', v_timeout, true);
                    IF res.token IS NOT NULL THEN
                        res.outcome := 'new';
                        RETURN res;
                    END IF;
                EXCEPTION
                    WHEN lock_not_available THEN
                        v_busy := true;
                    WHEN unique_violation THEN
                        NULL;  -- a row that got there first is read in the next round
                END;
            ELSIF NOT EXISTS (SELECT FROM pg_catalog.pg_rewrite AS w
                               WHERE w.ev_class OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
                INSERT INTO idempotency.idempotency_keys AS k
                       (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl)
                VALUES (p_scope, p_key, p_hash, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(),
                        pg_catalog.now() OPERATOR(pg_catalog.+) p_lease, pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, p_ttl)
                ON CONFLICT (scope, key) DO NOTHING
                RETURNING k.token, k.expires_at INTO res.token, res.expires_at;
                IF FOUND THEN
                    res.outcome := 'new';
                    RETURN res;
                END IF;
            ELSE
                -- A store with rules (an owner's change) refuses ON CONFLICT: the key, found
                -- absent and marked, is inserted without it; a row that got there first is read
                -- in the next round.
                BEGIN
                    INSERT INTO idempotency.idempotency_keys AS k
                           (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl)
                    VALUES (p_scope, p_key, p_hash, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(),
                            pg_catalog.now() OPERATOR(pg_catalog.+) p_lease, pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, p_ttl);
                    SELECT k.token, k.expires_at INTO res.token, res.expires_at
                      FROM idempotency.idempotency_keys AS k
                     WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key;
                    IF FOUND THEN
                        res.outcome := 'new';
                        RETURN res;
                    END IF;
                EXCEPTION WHEN unique_violation THEN
                    NULL;
                END;
            END IF;
        ELSIF NOT pg_catalog.pg_try_advisory_lock_shared(pg_catalog.hashtextextended(
                      pg_catalog.length(p_scope)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                      OPERATOR(pg_catalog.||) p_scope OPERATOR(pg_catalog.||) p_key, 5432)) THEN
            -- _p_marked written out: another open transaction is changing the row (a sweep
            -- deleting it, expired, is waited for; then the key is looked at again).
            v_busy := NOT (r.expired AND idempotency._p_waited_for_sweep(r.holder));
        ELSIF NOT pg_catalog.pg_advisory_unlock_shared(pg_catalog.hashtextextended(
                      pg_catalog.length(p_scope)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                      OPERATOR(pg_catalog.||) p_scope OPERATOR(pg_catalog.||) p_key, 5432)) THEN
            NULL;  -- never: the shared lock taken just above is released
        ELSIF NOT r.expired AND r.request_hash IS NOT NULL AND p_hash IS NOT NULL
              AND r.request_hash OPERATOR(pg_catalog.<>) p_hash THEN
            RAISE WARNING '%', idempotency._canon_message(pg_catalog.format(
                'idempotency: key reused with a different request: scope=%s key=%s stored_hash=%s request_hash=%s',
                idempotency._p_debug(p_scope), idempotency._p_key_label(p_key),
                pg_catalog.encode(pg_catalog.substr(r.request_hash, 1, 6), 'hex'),
                pg_catalog.encode(pg_catalog.substr(p_hash, 1, 6), 'hex')));
            res.outcome := 'mismatch';
            res.expires_at := r.expires_at;
            RETURN res;
        ELSIF NOT r.expired AND r.completed THEN
            -- One statement (each costs, in every transaction).
            RETURN ROW('replay', r.token, r.response, r.response_status, NULL, r.expires_at, NULL)::idempotency.claim_result;
        ELSIF NOT r.expired AND NOT r.lease_over THEN
            res.outcome := 'in_progress';
            res.retry_after := r.retry_after;
            res.expires_at := r.expires_at;
            res.recovery_point := r.recovery_point;
            RETURN res;
        ELSE
            -- Expired (restart) or lease over (takeover): lock the newest version without
            -- waiting, and decide again on it.
            v_expired := r.expired;
            SELECT k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status AS completed,
                   k.request_hash, k.token, k.response, k.response_status, k.recovery_point, k.expires_at,
                   k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now() AS expired,
                   k.locked_until OPERATOR(pg_catalog.<=) pg_catalog.now() AS lease_over,
                   GREATEST(k.locked_until OPERATOR(pg_catalog.-) pg_catalog.now(), '1 second'::pg_catalog.interval) AS retry_after
              INTO r
              FROM idempotency.idempotency_keys AS k
             WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key
               FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                SELECT k.xmax INTO v_xmax
                  FROM idempotency.idempotency_keys AS k
                 WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key;
                IF FOUND AND v_expired AND idempotency._p_waited_for_sweep(v_xmax) THEN
                    NULL;  -- a sweep held the expired row and has ended: look again
                ELSE
                    -- Still there: another claimer holds its row lock.
                    v_busy := FOUND;
                END IF;
            ELSIF r.expired THEN
                v_token := idempotency._p_token_above(p_key, r.token);
                UPDATE idempotency.idempotency_keys AS k SET
                       request_hash = p_hash, status = 'in_progress', token = v_token,
                       response = NULL, response_status = NULL, recovery_point = NULL,
                       created_at = pg_catalog.now(), completed_at = NULL,
                       locked_until = pg_catalog.now() OPERATOR(pg_catalog.+) p_lease,
                       expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, ttl = p_ttl
                 WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key
                   AND k.token OPERATOR(pg_catalog.<) v_token
                RETURNING k.token, k.expires_at, k.recovery_point INTO res.token, res.expires_at, res.recovery_point;
                IF FOUND THEN
                    res.outcome := 'new';
                    RETURN res;
                END IF;
            ELSIF (r.request_hash IS NULL OR p_hash IS NULL OR r.request_hash OPERATOR(pg_catalog.=) p_hash)
                  AND NOT r.completed AND r.lease_over THEN
                v_token := idempotency._p_token_above(p_key, r.token);
                UPDATE idempotency.idempotency_keys AS k SET
                       request_hash = COALESCE(k.request_hash, p_hash), token = v_token,
                       locked_until = pg_catalog.now() OPERATOR(pg_catalog.+) p_lease,
                       expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) p_ttl, ttl = p_ttl
                 WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key
                   AND k.token OPERATOR(pg_catalog.<) v_token
                RETURNING k.token, k.expires_at, k.recovery_point INTO res.token, res.expires_at, res.recovery_point;
                IF FOUND THEN
                    res.outcome := 'new';
                    RETURN res;
                END IF;
            END IF;
            -- Anything else: the row changed; read it again (answered in the next round).
        END IF;
        IF v_busy THEN
            v_wait := idempotency._p_setting('idempotency.claim_wait', 0, 'ms');
            v_started := COALESCE(v_started, pg_catalog.clock_timestamp());
            IF pg_catalog.clock_timestamp() OPERATOR(pg_catalog.>=)
               (v_started OPERATOR(pg_catalog.+) pg_catalog.make_interval(secs => GREATEST(v_wait, 0) OPERATOR(pg_catalog./) 1000.0)) THEN
                RETURN idempotency._p_busy();
            END IF;
            PERFORM pg_catalog.pg_sleep(0.005);
        ELSE
            v_rounds := v_rounds OPERATOR(pg_catalog.+) 1;
            IF v_rounds OPERATOR(pg_catalog.>=) 50 THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'serialization_failure',
                    MESSAGE = idempotency._canon_message(pg_catalog.format('idempotency.claim: key %s kept changing under concurrent claims',
                                                idempotency._p_key_label(p_key))),
                    HINT = 'retry the transaction';
            END IF;
        END IF;
    END LOOP;
END
$fn$;

-- claim, one step after the other (each check a function of its own): where claim's one-statement
-- path does not apply (a database that is not UTF-8).
CREATE FUNCTION idempotency._p_claim_checked(key text, request jsonb, scope text, ttl interval, lease interval)
RETURNS idempotency.claim_result
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_key text := idempotency._stored_key(_p_claim_checked.key, _p_claim_checked.scope);
    v_ttl interval;
    v_lease interval;
    v_hash bytea;
BEGIN
    SELECT d.ttl_value, d.lease_value INTO v_ttl, v_lease FROM idempotency._p_ttl_and_lease(_p_claim_checked.ttl, _p_claim_checked.lease) AS d;
    v_hash := idempotency._p_request_hash(_p_claim_checked.request, 'request');
    PERFORM idempotency._p_refuse_read_only('claim');
    RETURN idempotency._p_claim(_p_claim_checked.scope, v_key, v_hash, v_ttl, v_lease);
END
$fn$;

-- The LANGUAGE c functions of sql/idempotency.sql --------------------------------------------

-- One statement reads what a claim needs (the role's scope prefix, the store's configuration,
-- the key's row, the request's canonical form where it is an object of scalars), and the
-- common answers (replay, in_progress, new) are given from it: each statement and each nested
-- call costs more than the work of this path, run by every request. What _stored_key,
-- _p_ttl_and_lease, _p_request_hash, _p_refuse_read_only, _p_marked and _p_mark check is
-- checked here the same way (the expressions are theirs and _canon_text's: a change there
-- changes this copy too); their functions are called only where one may fail (they raise its
-- error). Everything else (a takeover, a restart, a mismatch, a busy key, a store with rules
-- or keyed hashes, a database that is not UTF-8) goes to _p_claim or _p_claim_checked, which
-- read again.
BODY idempotency.claim
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
-- One plan for the statement below whatever the arguments: a plan made for the arguments of
-- each call (PostgreSQL's choice where the store's tables were never analyzed) costs more
-- than the rest of the call.
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    c record;
    v_ttl interval;
    v_lease interval;
    v_hash bytea;
    v_xact text;
    v_state text;
    v_count integer;
    v_marked boolean;
    v_token bigint;
    v_expires_at timestamptz;
    v_set text;
    v_lock bigint;
BEGIN
    IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.<>) 'UTF8' THEN
        -- Keys, scopes and requests are checked as Unicode first (_canon_unicode).
        RETURN idempotency._p_claim_checked(claim.key, claim.request, claim.scope, claim.ttl, claim.lease);
    END IF;
    SELECT -- The checks of _canon_check_key and _p_check_scope (with _p_scope_prefix's prefix),
           -- and a store that keeps plain keys or unkeyed hashes.
           claim.key IS NOT NULL AND claim.key OPERATOR(pg_catalog.<>) '' AND pg_catalog.length(claim.key) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           AND claim.scope IS NOT NULL AND pg_catalog.length(claim.scope) OPERATOR(pg_catalog.<=) @MAX_KEY_CHARS@
           AND pg_catalog.starts_with(claim.scope, COALESCE(p.scope_prefix,
                   pg_catalog.current_setting('idempotency.scope_prefix', true), ''))
           AND x.key_secret IS NULL AS ok,
           -- Neither ttl nor lease given nor set (or set to what the native edition shows for
           -- its defaults): one day and five minutes, which pass every check of _p_ttl_and_lease.
           -- (A default spelled otherwise, ' 1d' or '24h', takes _p_ttl_and_lease; so would every
           -- default if the core's constants changed and these spellings did not.)
           claim.ttl IS NULL AND claim.lease IS NULL
           AND COALESCE(pg_catalog.current_setting('idempotency.default_ttl', true), '')
               OPERATOR(pg_catalog.=) ANY ('{"",1d}'::pg_catalog.text[])
           AND COALESCE(pg_catalog.current_setting('idempotency.default_lease', true), '')
               OPERATOR(pg_catalog.=) ANY ('{"",5min}'::pg_catalog.text[]) AS defaults,
           k.stored, f.hash,
           r.key IS NOT NULL AS found, r.token, r.request_hash,
           -- Whether the row can be answered without a write (replay, in_progress): live, of
           -- the same request, and not in a read-only transaction. The answer itself, and the
           -- test of the key's mark, are written after the statement, where only the branch a
           -- call takes is prepared (each expression of a statement is prepared in every
           -- transaction, the branches of a CASE included).
           r.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
           AND (r.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status
                OR r.locked_until OPERATOR(pg_catalog.>) pg_catalog.now())
           AND (r.request_hash IS NULL OR claim.request IS NULL OR r.request_hash OPERATOR(pg_catalog.=) f.hash)
           AND pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'off' AS live,
           r.status, r.response, r.response_status, r.locked_until, r.expires_at, r.recovery_point
      INTO c
      FROM (SELECT) AS o
      LEFT JOIN idempotency.config AS x ON true
      -- _stored_key's form of the key
      CROSS JOIN LATERAL (SELECT CASE WHEN x.key_storage OPERATOR(pg_catalog.=) 'sha256'
                                      THEN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(claim.key, 'UTF8')), 'hex')
                                      ELSE claim.key END AS stored) AS k
      -- The SET ROLE role's row when it has one, else the session user's (_p_scope_prefix's).
      LEFT JOIN idempotency.role_settings AS p
             ON p.role::pg_catalog.oid OPERATOR(pg_catalog.=) COALESCE(
                (SELECT s.role::pg_catalog.oid FROM idempotency.role_settings AS s
                  WHERE s.role::pg_catalog.oid OPERATOR(pg_catalog.=)
                        (SELECT b.oid FROM pg_catalog.pg_roles AS b
                          WHERE b.rolname OPERATOR(pg_catalog.=) pg_catalog.current_setting('role')::pg_catalog.name)),
                pg_catalog.to_regrole(pg_catalog.quote_ident(SESSION_USER))::pg_catalog.oid)
      -- The key's row through its index, whatever the estimates of the joins (the key's form
      -- from an init plan: a parameter of the index scan, not a join clause).
      LEFT JOIN idempotency.idempotency_keys AS r
             ON r.scope OPERATOR(pg_catalog.=) claim.scope
            AND r.key OPERATOR(pg_catalog.=) CASE WHEN (SELECT y.key_storage FROM idempotency.config AS y) OPERATOR(pg_catalog.=) 'sha256'
                                                  THEN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(claim.key, 'UTF8')), 'hex')
                                                  ELSE claim.key END
      -- The SHA-256 of _canon_text's form of an object of scalars, in exact mode (NULL: another
      -- document, or none, or {}). Members are in UTF-16 order where no character of
      -- U+E000..U+FFFF (which UTF-16 puts after the characters above U+FFFF) is written: one
      -- regular expression on the text (a string value with one takes the general path too,
      -- which gives the same bytes), where a jsonpath test of each member name cost more than
      -- the whole aggregate. The aggregate is written twice and computed once (a subquery that
      -- names it once adds a plan node, which costs more).
      CROSS JOIN (SELECT CASE WHEN pg_catalog.string_agg(
                             pg_catalog.to_json(e.key)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                             OPERATOR(pg_catalog.||) CASE WHEN pg_catalog.jsonb_typeof(e.value) OPERATOR(pg_catalog.=) 'number'
                                                               AND pg_catalog.strpos(e.value::pg_catalog.text, '.') OPERATOR(pg_catalog.>) 0
                                                          THEN pg_catalog.rtrim(pg_catalog.rtrim(e.value::pg_catalog.text, '0'), '.')
                                                          ELSE e.value::pg_catalog.text END, ','
                             ORDER BY e.key COLLATE pg_catalog."C") COLLATE pg_catalog."C"
                                   OPERATOR(pg_catalog.!~) ('[' OPERATOR(pg_catalog.||) pg_catalog.chr(57344) OPERATOR(pg_catalog.||) '-'
                                                            OPERATOR(pg_catalog.||) pg_catalog.chr(65535) OPERATOR(pg_catalog.||) ']')
                         THEN pg_catalog.sha256(pg_catalog.convert_to('{' OPERATOR(pg_catalog.||) pg_catalog.string_agg(
                             pg_catalog.to_json(e.key)::pg_catalog.text OPERATOR(pg_catalog.||) ':'
                             OPERATOR(pg_catalog.||) CASE WHEN pg_catalog.jsonb_typeof(e.value) OPERATOR(pg_catalog.=) 'number'
                                                               AND pg_catalog.strpos(e.value::pg_catalog.text, '.') OPERATOR(pg_catalog.>) 0
                                                          THEN pg_catalog.rtrim(pg_catalog.rtrim(e.value::pg_catalog.text, '0'), '.')
                                                          ELSE e.value::pg_catalog.text END, ','
                             ORDER BY e.key COLLATE pg_catalog."C")
                                                                      OPERATOR(pg_catalog.||) '}', 'UTF8')) END AS hash
                    FROM pg_catalog.jsonb_each(CASE WHEN pg_catalog.jsonb_typeof(claim.request) OPERATOR(pg_catalog.=) 'object'
                                                     AND NOT pg_catalog.jsonb_path_exists(claim.request,
               'strict $ ? (exists (@.* ? (@.type() == "object" || @.type() == "array" || (@.type() == "number" && (@ >= 1e21 || @ <= -1e21 || (@.floor() != @ && @ > -0.000001 && @ < 0.000001))))))')
                                                    THEN claim.request END) AS e) AS f;
    -- The key's lock number (its mark).
    v_lock := pg_catalog.hashtextextended(pg_catalog.length(claim.scope)::pg_catalog.text
                                          OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) claim.scope
                                          OPERATOR(pg_catalog.||) c.stored, 5432);
    -- The answer without a write, given where nothing may fail before it (ok and defaults) and
    -- the key is not marked by another open transaction (_p_marked).
    IF c.ok AND c.defaults AND c.live
       AND pg_catalog.pg_try_advisory_lock_shared(v_lock) AND pg_catalog.pg_advisory_unlock_shared(v_lock) THEN
        IF c.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status THEN
            RETURN ROW('replay', c.token, c.response, c.response_status, NULL, c.expires_at, NULL)::idempotency.claim_result;
        END IF;
        RETURN ROW('in_progress', NULL, NULL, NULL,
                   GREATEST(c.locked_until OPERATOR(pg_catalog.-) pg_catalog.now(), '1 second'::pg_catalog.interval),
                   c.expires_at, c.recovery_point)::idempotency.claim_result;
    END IF;
    IF NOT c.ok THEN
        -- A check fails (raised there), or the store keeps keyed hashes.
        RETURN idempotency._p_claim_checked(claim.key, claim.request, claim.scope, claim.ttl, claim.lease);
    END IF;
    IF c.defaults THEN
        v_ttl := '@DEFAULT_TTL_SECS@ seconds'::pg_catalog.interval;
        v_lease := '@DEFAULT_LEASE_SECS@ seconds'::pg_catalog.interval;
    ELSE
        SELECT d.ttl_value, d.lease_value INTO v_ttl, v_lease FROM idempotency._p_ttl_and_lease(claim.ttl, claim.lease) AS d;
    END IF;
    v_hash := c.hash;
    IF v_hash IS NULL AND claim.request IS NOT NULL THEN
        v_hash := pg_catalog.sha256(pg_catalog.convert_to(idempotency._canon_text(claim.request, true, 'request'), 'UTF8'));
    END IF;
    IF pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on' THEN
        PERFORM idempotency._p_refuse_read_only('claim');  -- raises
    END IF;
    IF c.found THEN
        -- Answered by _p_claim: a mismatch, a takeover, a restart, a key another open
        -- transaction marked, or a request whose hash was not known in the statement above.
        NULL;
    ELSIF NOT EXISTS (SELECT FROM pg_catalog.pg_rewrite AS w
                       WHERE w.ev_class OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
        -- _p_mark(scope, key, false), then the insert, which the trigger need not mark again
        -- (a store with rules refuses ON CONFLICT: _p_claim inserts there).
        v_xact := pg_catalog.pg_current_xact_id()::pg_catalog.text;
        v_state := pg_catalog.current_setting('idempotency_portable.marks', true);
        v_count := CASE WHEN pg_catalog.split_part(v_state, ':', 1) OPERATOR(pg_catalog.=) v_xact
                        THEN pg_catalog.split_part(v_state, ':', 2)::pg_catalog.int4 ELSE 0 END;
        IF v_count OPERATOR(pg_catalog.<) @PORTABLE_MARKS_PER_TRANSACTION@ THEN
            v_marked := pg_catalog.pg_try_advisory_xact_lock(v_lock);
            IF v_marked THEN
                v_set := pg_catalog.set_config('idempotency_portable.marks',
                                               v_xact OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) (v_count OPERATOR(pg_catalog.+) 1), false);
            END IF;
        ELSE
            -- Not marked (the transaction's first @PORTABLE_MARKS_PER_TRANSACTION@ keys are): _p_claim inserts it without
            -- waiting for another transaction's unmarked row (see _p_mark).
            v_marked := false;
        END IF;
        IF v_marked THEN
            v_set := pg_catalog.set_config('idempotency_portable.marked', 'on', true);
            INSERT INTO idempotency.idempotency_keys AS k
                   (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl)
            VALUES (claim.scope, c.stored, v_hash, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(),
                    pg_catalog.now() OPERATOR(pg_catalog.+) v_lease, pg_catalog.now() OPERATOR(pg_catalog.+) v_ttl, v_ttl)
            ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING  -- (scope, key): names of claim's arguments
            RETURNING k.token, k.expires_at INTO v_token, v_expires_at;
            v_set := pg_catalog.set_config('idempotency_portable.marked', 'off', true);
            IF v_token IS NOT NULL THEN
                RETURN ROW('new', v_token, NULL, NULL, NULL, v_expires_at, NULL)::idempotency.claim_result;
            END IF;
        END IF;
    END IF;
    RETURN idempotency._p_claim(claim.scope, c.stored, v_hash, v_ttl, v_lease);
END
$fn$;

BODY idempotency.claim_many
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_variable
DECLARE
    n integer;
    v_stored text[] := '{}';
    v_hashes bytea[] := '{}';
    v_key text;
    v_ttl interval;
    v_lease interval;
    res idempotency.claim_result;
BEGIN
    IF claim_many.keys IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed', MESSAGE = 'keys must not be NULL';
    END IF;
    IF pg_catalog.array_ndims(claim_many.keys) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'array_subscript_error',
            MESSAGE = pg_catalog.format('keys must be a one-dimensional array (got %s dimensions)', pg_catalog.array_ndims(claim_many.keys));
    END IF;
    n := pg_catalog.cardinality(claim_many.keys);
    IF pg_catalog.array_ndims(claim_many.requests) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'array_subscript_error',
            MESSAGE = pg_catalog.format('requests must be a one-dimensional array (got %s dimensions)', pg_catalog.array_ndims(claim_many.requests));
    END IF;
    IF claim_many.requests IS NOT NULL AND pg_catalog.cardinality(claim_many.requests) OPERATOR(pg_catalog.<>) n THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = pg_catalog.format(
            'requests must have one element per key: it has %s, keys has %s', pg_catalog.cardinality(claim_many.requests), n);
    END IF;
    PERFORM idempotency._canon_unicode(claim_many.scope, 'scope');
    PERFORM idempotency._p_check_scope(claim_many.scope);
    FOR i IN 1 .. n LOOP
        v_key := claim_many.keys[pg_catalog.array_lower(claim_many.keys, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1];
        PERFORM idempotency._canon_unicode(v_key, 'keys');
        PERFORM idempotency._canon_check_key('keys[' OPERATOR(pg_catalog.||) i OPERATOR(pg_catalog.||) ']', v_key, false);
        v_stored := v_stored OPERATOR(pg_catalog.||) idempotency._stored_key(v_key, claim_many.scope);
    END LOOP;
    SELECT d.ttl_value, d.lease_value INTO v_ttl, v_lease FROM idempotency._p_ttl_and_lease(claim_many.ttl, claim_many.lease) AS d;
    FOR i IN 1 .. n LOOP
        v_hashes := v_hashes OPERATOR(pg_catalog.||) idempotency._p_request_hash(
            claim_many.requests[pg_catalog.array_lower(claim_many.requests, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1], 'requests');
    END LOOP;
    PERFORM idempotency._p_refuse_read_only('claim_many');
    FOR i IN 1 .. n LOOP
        res := idempotency._p_claim(claim_many.scope, v_stored[i], v_hashes[i], v_ttl, v_lease);
        ord := i;
        key := claim_many.keys[pg_catalog.array_lower(claim_many.keys, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1];
        outcome := res.outcome;
        token := res.token;
        response := res.response;
        response_status := res.response_status;
        retry_after := res.retry_after;
        expires_at := res.expires_at;
        recovery_point := res.recovery_point;
        RETURN NEXT;
    END LOOP;
END
$fn$;
