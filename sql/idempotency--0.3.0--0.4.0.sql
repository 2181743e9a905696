-- idempotency 0.3.0 -> 0.4.0 (see CHANGELOG.md)
--
-- idempotency.distribute() for Citus (docs/scaling.md; the library finds out by itself whether
-- the table is distributed), batches (claim_many, complete_many) and the sweep index. The store
-- keeps its columns and rows, but its index on expires_at is replaced by the sweep index, built
-- under a lock that blocks writes to the store while it runs (seconds per million rows): run
-- the update when a pause of the writes is acceptable. Every object is left as a fresh 0.4.0
-- install creates it (tests/integration/test_upgrade.py compares the two catalogs).

\echo Use "ALTER EXTENSION idempotency UPDATE TO '0.4.0'" to load this file. \quit

-- forget judges liveness outside RETURNING (Citus refuses now() there).
CREATE OR REPLACE FUNCTION idempotency.forget(key text, scope text DEFAULT '')
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_key text;
    v_expires_at timestamptz;
BEGIN
    v_key := idempotency._stored_key(forget.key, forget.scope);
    DELETE FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) forget.scope
       AND k.key OPERATOR(pg_catalog.=) v_key
    RETURNING k.expires_at INTO v_expires_at;
    -- Judged here, not in RETURNING: Citus allows only immutable functions there.
    RETURN COALESCE(v_expires_at OPERATOR(pg_catalog.>) pg_catalog.now(), false);
END
$fn$;

-- set_key_storage refuses a store distributed by Citus.
CREATE OR REPLACE FUNCTION idempotency.set_key_storage(mode text)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_current text;
    v_secret bytea;
    v_rows bigint := 0;
BEGIN
    IF mode IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'mode must not be NULL';
    ELSIF mode OPERATOR(pg_catalog.<>) ALL (ARRAY['plain', 'sha256']::text[]) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('mode must be ''plain'' or ''sha256'' (got %L)',
                                        pg_catalog.left(mode, 40));
    END IF;
    -- On Citus the switch would have to reach the backends of every node at once (each caches
    -- the mode) and Citus refuses the rekeying UPDATE: choose the storage before distributing.
    -- (Nested: the catalog exists only where Citus is installed.)
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                    WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
            RAISE EXCEPTION USING
                ERRCODE = 'feature_not_supported',
                MESSAGE = 'idempotency.set_key_storage cannot change a store distributed by Citus',
                HINT = 'choose the key storage before idempotency.distribute(); see docs/scaling.md';
        END IF;
    END IF;
    -- Waits for running claims; claims that come later wait here and then see the new mode.
    LOCK TABLE idempotency.idempotency_keys, idempotency.audit IN ACCESS EXCLUSIVE MODE;
    SELECT c.key_storage, c.key_secret INTO v_current, v_secret FROM idempotency.config AS c;
    IF COALESCE(v_current, 'plain') OPERATOR(pg_catalog.=) mode THEN
        RETURN 0;
    END IF;
    IF mode OPERATOR(pg_catalog.=) 'sha256' THEN
        v_secret := COALESCE(v_secret, idempotency._random_secret());
        UPDATE idempotency.idempotency_keys AS k
           SET key = idempotency._rekey(pg_catalog.sha256(pg_catalog.convert_to(k.key, 'UTF8')), v_secret);
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        UPDATE idempotency.audit AS a
           SET key = idempotency._rekey(pg_catalog.sha256(pg_catalog.convert_to(a.key, 'UTF8')), v_secret),
               key_is_hash = true
         WHERE NOT a.key_is_hash;
    ELSE
        DELETE FROM idempotency.idempotency_keys AS k
         WHERE k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now();
        SELECT pg_catalog.count(*) INTO v_rows FROM idempotency.idempotency_keys;
        IF v_rows OPERATOR(pg_catalog.>) 0 THEN
            RAISE EXCEPTION USING
                ERRCODE = '55000',
                MESSAGE = pg_catalog.format('cannot set mode to ''plain'': %s live keys are stored hashed and cannot be turned back into keys', v_rows),
                HINT = 'switch when they have expired (or after forgetting them); until then the store stays sha256';
        END IF;
    END IF;
    INSERT INTO idempotency.config AS c (singleton, key_storage, key_secret) VALUES (true, mode, v_secret)
        ON CONFLICT (singleton) DO UPDATE
        SET key_storage = excluded.key_storage, key_secret = COALESCE(c.key_secret, excluded.key_secret);
    PERFORM idempotency._store_changed();
    RETURN v_rows;
END
$fn$;

-- Citus ---------------------------------------------------------------------------------------

-- On the coordinator of a Citus cluster: distributes the store by scope so that a tenant's keys
-- live on the node holding the tenant's rows (docs/scaling.md). Applications colocate their
-- tables with it: create_distributed_table(..., colocate_with => 'idempotency.idempotency_keys'),
-- distribution column of type text COLLATE "C". Each step is skipped when it was done before,
-- so a second call changes nothing (it only raises the token sequences of nodes added since).
-- - idempotency_keys: hash-distributed by scope, in its own colocation group;
-- - audit: distributed by scope with the keys (an audit row is written with its key's
--   completion, on the same node, in the same local transaction); Citus needs the distribution
--   column in every unique constraint, so its primary key becomes (scope, id);
-- - config and signing_secrets: reference tables (a copy on every node), so a call that runs on
--   a worker hashes and verifies keys with the coordinator's secrets;
-- - claim, complete, checkpoint, release, forget and lookup: delegated by their scope argument
--   to the node holding the scope's shard;
-- - token_seq: each node's sequence starts at its group id << 48, so nodes hand out disjoint
--   tokens (a takeover's token is also above the key's previous one, whatever node runs it).
CREATE FUNCTION idempotency.distribute(shard_count integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_changed boolean := false;
    v_rel regclass;
    v_fn regprocedure;
    v_node record;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_extension AS e WHERE e.extname OPERATOR(pg_catalog.=) 'citus') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'feature_not_supported',
            MESSAGE = 'idempotency.distribute needs Citus: the citus extension is not installed in this database',
            HINT = 'on a Citus coordinator run CREATE EXTENSION citus first; a single PostgreSQL node needs no distribution';
    END IF;
    IF (SELECT g.groupid FROM pg_catalog.pg_dist_local_group AS g) OPERATOR(pg_catalog.<>) 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = 'idempotency.distribute must run on the Citus coordinator; this node is a worker',
            HINT = 'connect to the coordinator and call idempotency.distribute() there';
    END IF;

    IF (SELECT c.relkind FROM pg_catalog.pg_class AS c
         WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) OPERATOR(pg_catalog.=) 'p' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'feature_not_supported',
            MESSAGE = 'idempotency.distribute cannot distribute a partitioned store (idempotency.partitions)',
            HINT = 'on Citus create the extension with idempotency.partitions = 0: the shards split the store instead';
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                    WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
        PERFORM pg_catalog.create_distributed_table('idempotency.idempotency_keys', 'scope',
                                                    colocate_with => 'none',
                                                    shard_count => distribute.shard_count);
        v_changed := true;
    ELSIF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                       WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
                         AND p.partmethod OPERATOR(pg_catalog.=) 'h'
                         AND pg_catalog.column_to_column_name(p.logicalrelid, p.partkey) OPERATOR(pg_catalog.=) 'scope') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = 'idempotency.idempotency_keys is a Citus table, but not hash-distributed by scope',
            HINT = 'undistribute it (SELECT undistribute_table(''idempotency.idempotency_keys'')) and call idempotency.distribute() again';
    END IF;

    IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                    WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.audit'::pg_catalog.regclass) THEN
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_constraint AS c
                        WHERE c.conrelid OPERATOR(pg_catalog.=) 'idempotency.audit'::pg_catalog.regclass
                          AND c.conname OPERATOR(pg_catalog.=) 'audit_pkey'
                          AND c.conkey OPERATOR(pg_catalog.=) ARRAY[2, 1]::pg_catalog.int2[]) THEN
            ALTER TABLE idempotency.audit DROP CONSTRAINT audit_pkey,
                ADD CONSTRAINT audit_pkey PRIMARY KEY (scope, id);
        END IF;
        PERFORM pg_catalog.create_distributed_table('idempotency.audit', 'scope',
                                                    colocate_with => 'idempotency.idempotency_keys');
        v_changed := true;
    END IF;

    FOREACH v_rel IN ARRAY ARRAY['idempotency.config', 'idempotency.signing_secrets']::pg_catalog.regclass[] LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                        WHERE p.logicalrelid OPERATOR(pg_catalog.=) v_rel) THEN
            PERFORM pg_catalog.create_reference_table(v_rel);
            v_changed := true;
        END IF;
    END LOOP;

    FOREACH v_fn IN ARRAY ARRAY[
        'idempotency.claim(text, jsonb, text, interval, interval)',
        'idempotency.complete(text, jsonb, integer, text, bigint, interval)',
        'idempotency.checkpoint(text, text, text, bigint)',
        'idempotency.release(text, text, bigint)',
        'idempotency.forget(text, text)',
        'idempotency.lookup(text, text)',
        -- A batch has one scope: delegated whole to the worker holding its shard.
        'idempotency.claim_many(text[], jsonb[], text, interval, interval)',
        'idempotency.complete_many(text[], jsonb[], integer[], text, bigint[], interval)']::pg_catalog.regprocedure[] LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_object AS o
                        WHERE o.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
                          AND o.objid OPERATOR(pg_catalog.=) v_fn::pg_catalog.oid
                          AND o.distribution_argument_index IS NOT NULL) THEN
            PERFORM pg_catalog.create_distributed_function(v_fn, distribution_arg_name => 'scope',
                                                           colocate_with => 'idempotency.idempotency_keys');
            v_changed := true;
        END IF;
    END LOOP;

    -- Disjoint token ranges, on every node (nodes added later get theirs at the next call).
    FOR v_node IN
        SELECT r.nodeid, r.result FROM pg_catalog.run_command_on_all_nodes(
            $cmd$SELECT pg_catalog.setval('idempotency.token_seq',
                       GREATEST(s.last_value, (g.groupid::bigint OPERATOR(pg_catalog.<<) 48) OPERATOR(pg_catalog.+) 1))
                   FROM idempotency.token_seq AS s, pg_catalog.pg_dist_local_group AS g$cmd$) AS r
         WHERE NOT r.success
    LOOP
        RAISE WARNING 'idempotency.distribute: could not set the token range of node %: %', v_node.nodeid, v_node.result
            USING HINT = 'call idempotency.distribute() again once every node is reachable';
    END LOOP;

    IF NOT v_changed THEN
        RAISE NOTICE 'idempotency.distribute: the store is distributed already; nothing changed';
    END IF;
END
$fn$;

REVOKE EXECUTE ON FUNCTION idempotency.distribute(integer) FROM PUBLIC;

-- The key in the form the store keeps it has a name that says so: _key becomes _stored_key (the
-- C symbol is unchanged), and the functions that call it call it by its new name (forget's new
-- body above already does).
ALTER FUNCTION idempotency._key(text, text) RENAME TO _stored_key;

CREATE OR REPLACE FUNCTION idempotency._raise_not_claimed(p_key text, p_scope text, p_token bigint, p_action text)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    r record;
    v_key text := idempotency._stored_key(p_key, p_scope);
    -- Messages show a hashed key only as a prefix of its hash.
    v_label text := CASE WHEN v_key OPERATOR(pg_catalog.=) p_key THEN pg_catalog.quote_literal(p_key)
                         ELSE 'sha256:' OPERATOR(pg_catalog.||) pg_catalog.left(v_key, 12) OPERATOR(pg_catalog.||) '...' END;
BEGIN
    SELECT k.status, k.token, k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() AS live
      INTO r
      FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) v_key;
    IF NOT FOUND OR NOT r.live THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK001',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: no live claim', p_action, v_label, p_scope),
            HINT = 'claim the key first; a claim that expired, was released or rolled back is gone';
    ELSIF r.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK002',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: it is already completed', p_action, v_label, p_scope),
            HINT = 'a completed key replays its stored response; claim it to read that response';
    ELSIF p_token OPERATOR(pg_catalog.<) r.token THEN
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: token %s is stale, the current token is %s',
                                        p_action, v_label, p_scope, p_token, r.token),
            HINT = 'another worker took the key over after this lease ran out (or the token is another key''s); abandon this attempt';
    ELSE
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: token %s was never issued for it, the current token is %s',
                                        p_action, v_label, p_scope, p_token, r.token),
            HINT = 'pass the token that claim returned for this key';
    END IF;
    RETURN NULL;  -- not reached
END
$fn$;

CREATE OR REPLACE FUNCTION idempotency.checkpoint(
    key            text,
    recovery_point text,
    scope          text DEFAULT '',
    token          bigint DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_key text;
BEGIN
    v_key := idempotency._stored_key(checkpoint.key, checkpoint.scope);
    PERFORM idempotency._check_recovery_point(checkpoint.recovery_point);
    UPDATE idempotency.idempotency_keys AS k
       SET recovery_point = checkpoint.recovery_point
     WHERE k.scope OPERATOR(pg_catalog.=) checkpoint.scope
       AND k.key OPERATOR(pg_catalog.=) v_key
       AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
       AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
       AND (checkpoint.token IS NULL OR k.token OPERATOR(pg_catalog.=) checkpoint.token);
    IF NOT FOUND THEN
        PERFORM idempotency._raise_not_claimed(checkpoint.key, checkpoint.scope, checkpoint.token, 'checkpoint');
    END IF;
END
$fn$;

CREATE OR REPLACE FUNCTION idempotency.release(key text, scope text DEFAULT '', token bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_key text;
BEGIN
    v_key := idempotency._stored_key(release.key, release.scope);
    DELETE FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) release.scope
       AND k.key OPERATOR(pg_catalog.=) v_key
       AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
       AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
       AND (release.token IS NULL OR k.token OPERATOR(pg_catalog.=) release.token);
    IF FOUND THEN
        PERFORM idempotency._count('release');
        RETURN true;
    END IF;
    RETURN false;
END
$fn$;

CREATE OR REPLACE FUNCTION idempotency.lookup(key text, scope text DEFAULT '')
RETURNS idempotency.idempotency_keys
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_key text;
    r idempotency.idempotency_keys;
BEGIN
    v_key := idempotency._stored_key(lookup.key, lookup.scope);
    SELECT k.* INTO r
      FROM idempotency.idempotency_keys AS k
     WHERE k.scope OPERATOR(pg_catalog.=) lookup.scope
       AND k.key OPERATOR(pg_catalog.=) v_key
       AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now();
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN r;
END
$fn$;

-- Statistics of the whole cluster where the store is distributed ---------------------------

-- The counters of the whole store: this node's, or, where the store is a Citus distributed table,
-- the sum over every node of the cluster (each node counts the calls it ran, and its sweeper the
-- rows it swept). Last sweep: the least recent of the nodes' last sweeps (a node whose sweeper
-- stalled shows), its rows summed; the sweeper is enabled only if it is on every node.
CREATE FUNCTION idempotency._cluster_stats(
    OUT preloaded          boolean,
    OUT claims_new         bigint,
    OUT claims_replay      bigint,
    OUT claims_in_progress bigint,
    OUT claims_mismatch    bigint,
    OUT completions        bigint,
    OUT releases           bigint,
    OUT rows_swept         bigint,
    OUT last_sweep_at      timestamptz,
    OUT last_sweep_rows    bigint
)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_docs jsonb[] := '{}';
    v_node record;
BEGIN
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                    WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
                      AND p.partmethod OPERATOR(pg_catalog.=) 'h') THEN
            FOR v_node IN
                SELECT r.nodeid, r.success, r.result
                  FROM pg_catalog.run_command_on_all_nodes(
                           $c$SELECT pg_catalog.row_to_json(s) FROM idempotency._shared_stats() AS s$c$) AS r
            LOOP
                IF NOT v_node.success AND pg_catalog.strpos(v_node.result, 'idempotency._shared_stats:') OPERATOR(pg_catalog.>) 0 THEN
                    RAISE EXCEPTION USING
                        ERRCODE = 'insufficient_privilege',
                        MESSAGE = pg_catalog.format('idempotency.stats: this role may not read the counters of Citus node %s',
                                                    v_node.nodeid),
                        HINT = 'grant SELECT on the view on every node: SELECT run_command_on_all_nodes(''GRANT SELECT ON idempotency.stats TO <role>'')';
                END IF;
                IF NOT v_node.success THEN
                    RAISE EXCEPTION USING
                        ERRCODE = 'connection_exception',
                        MESSAGE = pg_catalog.format('idempotency.stats could not read the counters of Citus node %s: %s',
                                                    v_node.nodeid, v_node.result),
                        HINT = 'the store is distributed: its statistics need every node (see pg_dist_node)';
                END IF;
                v_docs := v_docs OPERATOR(pg_catalog.||) v_node.result::jsonb;
            END LOOP;
            RETURN QUERY
            SELECT pg_catalog.bool_and(j.preloaded),
                   pg_catalog.sum(j.claims_new)::bigint, pg_catalog.sum(j.claims_replay)::bigint,
                   pg_catalog.sum(j.claims_in_progress)::bigint, pg_catalog.sum(j.claims_mismatch)::bigint,
                   pg_catalog.sum(j.completions)::bigint, pg_catalog.sum(j.releases)::bigint,
                   pg_catalog.sum(j.rows_swept)::bigint,
                   CASE WHEN pg_catalog.bool_and(j.last_sweep_at IS NOT NULL)
                        THEN pg_catalog.min(j.last_sweep_at) END,
                   pg_catalog.sum(j.last_sweep_rows)::bigint
              FROM pg_catalog.unnest(v_docs) AS d(doc),
                   pg_catalog.jsonb_to_record(d.doc) AS j(preloaded boolean, claims_new bigint,
                       claims_replay bigint, claims_in_progress bigint, claims_mismatch bigint,
                       completions bigint, releases bigint, rows_swept bigint,
                       last_sweep_at timestamptz, last_sweep_rows bigint);
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM idempotency._shared_stats();
END
$fn$;

-- The view reads them: the store's contents and the counters of the whole store.
CREATE OR REPLACE VIEW idempotency.stats AS
SELECT pg_catalog.current_database() AS database,
       t.rows_in_progress,
       t.rows_completed,
       t.rows_expired,
       t.oldest_expiry,
       s.last_sweep_at,
       s.last_sweep_rows,
       s.claims_new,
       s.claims_replay,
       s.claims_in_progress,
       s.claims_mismatch,
       s.completions,
       s.releases,
       s.rows_swept,
       s.preloaded AS sweeper_enabled
  FROM (SELECT pg_catalog.count(*) FILTER (
                   WHERE k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
                     AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()) AS rows_in_progress,
               pg_catalog.count(*) FILTER (
                   WHERE k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status
                     AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()) AS rows_completed,
               pg_catalog.count(*) FILTER (
                   WHERE k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()) AS rows_expired,
               pg_catalog.min(k.expires_at) AS oldest_expiry
          FROM idempotency.idempotency_keys AS k) AS t,
       idempotency._cluster_stats() AS s;

-- The sweeper's index on the expiry the claim set, instead of expires_at (which complete moves,
-- so that no completion in a later transaction than its claim was a HOT update). Built under a
-- lock that blocks writes to the store while it runs (seconds per million rows).
DROP INDEX idempotency.idempotency_keys_expires_at_idx;
CREATE INDEX idempotency_keys_sweep_idx ON idempotency.idempotency_keys
    (((created_at AT TIME ZONE 'UTC') OPERATOR(pg_catalog.+) ttl));

-- Batches (0.4.0): claim_many and complete_many, one call for a batch of messages (a queue
-- consumer's batch, a webhook delivery's events). Each position is answered as claim /
-- complete would answer it alone, in input order; bad arrays are refused before anything is
-- written. claim_many inserts the absent keys of a batch in one statement (C).
CREATE FUNCTION idempotency.claim_many(
    keys     text[],
    requests jsonb[] DEFAULT NULL,
    scope    text DEFAULT '',
    ttl      interval DEFAULT NULL,
    lease    interval DEFAULT NULL
) RETURNS TABLE (
    ord             integer,
    key             text,
    outcome         idempotency.outcome,
    token           bigint,
    response        jsonb,
    response_status integer,
    retry_after     interval,
    expires_at      timestamptz,
    recovery_point  text
)
LANGUAGE c VOLATILE PARALLEL UNSAFE SECURITY DEFINER ROWS 100
AS 'MODULE_PATHNAME', 'idempotency_claim_many';

-- complete for each position, in input order, in one statement: a position whose claim is
-- gone, completed or fenced raises complete's own error (IK001..IK003) and the statement
-- writes nothing. NULL responses: no response for any key; NULL response_statuses: 200 each;
-- NULL tokens (or a NULL element): no token check for that key.
CREATE FUNCTION idempotency.complete_many(
    keys              text[],
    responses         jsonb[],
    response_statuses integer[] DEFAULT NULL,
    scope             text DEFAULT '',
    tokens            bigint[] DEFAULT NULL,
    ttl               interval DEFAULT NULL
) RETURNS SETOF timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    n integer;
    i integer;
    v_status integer;
    v_len integer;
BEGIN
    IF complete_many.keys IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'keys must not be NULL';
    END IF;
    IF pg_catalog.array_ndims(complete_many.keys) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '2202E', MESSAGE = 'keys must be a one-dimensional array';
    END IF;
    IF pg_catalog.array_ndims(complete_many.responses) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '2202E', MESSAGE = 'responses must be a one-dimensional array';
    END IF;
    IF pg_catalog.array_ndims(complete_many.response_statuses) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '2202E', MESSAGE = 'response_statuses must be a one-dimensional array';
    END IF;
    IF pg_catalog.array_ndims(complete_many.tokens) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '2202E', MESSAGE = 'tokens must be a one-dimensional array';
    END IF;
    n := pg_catalog.cardinality(complete_many.keys);
    IF complete_many.responses IS NOT NULL
       AND pg_catalog.cardinality(complete_many.responses) OPERATOR(pg_catalog.<>) n THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format(
            'responses must have one element per key: it has %s, keys has %s',
            pg_catalog.cardinality(complete_many.responses), n);
    END IF;
    IF complete_many.response_statuses IS NOT NULL
       AND pg_catalog.cardinality(complete_many.response_statuses) OPERATOR(pg_catalog.<>) n THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format(
            'response_statuses must have one element per key: it has %s, keys has %s',
            pg_catalog.cardinality(complete_many.response_statuses), n);
    END IF;
    IF complete_many.tokens IS NOT NULL
       AND pg_catalog.cardinality(complete_many.tokens) OPERATOR(pg_catalog.<>) n THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format(
            'tokens must have one element per key: it has %s, keys has %s',
            pg_catalog.cardinality(complete_many.tokens), n);
    END IF;
    -- Every position is checked before the first is completed.
    FOR i IN 1 .. n LOOP
        IF complete_many.keys[pg_catalog.array_lower(complete_many.keys, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1] IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = pg_catalog.format('keys[%s] must not be NULL', i);
        END IF;
        v_len := pg_catalog.char_length(complete_many.keys[pg_catalog.array_lower(complete_many.keys, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1]);
        IF v_len OPERATOR(pg_catalog.=) 0 THEN
            RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format('keys[%s] must not be empty', i);
        ELSIF v_len OPERATOR(pg_catalog.>) 255 THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = pg_catalog.format('keys[%s] must be at most 255 characters (got %s)', i, v_len);
        END IF;
        IF complete_many.response_statuses IS NOT NULL THEN
            v_status := complete_many.response_statuses[pg_catalog.array_lower(complete_many.response_statuses, 1) OPERATOR(pg_catalog.+) i OPERATOR(pg_catalog.-) 1];
            IF v_status IS NULL THEN
                RAISE EXCEPTION USING ERRCODE = '22004',
                    MESSAGE = pg_catalog.format('response_statuses[%s] must not be NULL', i);
            END IF;
            IF v_status OPERATOR(pg_catalog.<) 100 OR v_status OPERATOR(pg_catalog.>) 599 THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = pg_catalog.format('response_statuses[%s] must be between 100 and 599 (got %s)', i, v_status);
            END IF;
        END IF;
    END LOOP;
    RETURN QUERY
        SELECT idempotency.complete(u.k, u.r, COALESCE(u.s, 200), complete_many.scope, u.t, complete_many.ttl)
          FROM ROWS FROM (pg_catalog.unnest(complete_many.keys),
                          pg_catalog.unnest(complete_many.responses),
                          pg_catalog.unnest(complete_many.response_statuses),
                          pg_catalog.unnest(complete_many.tokens))
               WITH ORDINALITY AS u(k, r, s, t, o)
         ORDER BY u.o;
END
$fn$;
