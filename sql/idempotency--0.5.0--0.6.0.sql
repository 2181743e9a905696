-- idempotency 0.5.0 -> 0.6.0 (see CHANGELOG.md)
--
-- Every object is left as a fresh 0.6.0 install creates it (tests/integration/test_upgrade.py
-- compares the two catalogs).

\echo Use "ALTER EXTENSION idempotency UPDATE TO '0.6.0'" to load this file. \quit

-- More counters in the stats views (takeovers, stale tokens refused, claim waits, the sweep's
-- lag and last error), row counts that cost nothing on a large store, and count_keys. The
-- views keep their OIDs and privileges (CREATE OR REPLACE appends columns): first they are
-- pointed away from the counters' functions, whose columns change, then back.
CREATE OR REPLACE VIEW idempotency.stats AS
SELECT NULL::name AS database,
       NULL::bigint AS rows_in_progress,
       NULL::bigint AS rows_completed,
       NULL::bigint AS rows_expired,
       NULL::timestamptz AS oldest_expiry,
       NULL::timestamptz AS last_sweep_at,
       NULL::bigint AS last_sweep_rows,
       NULL::bigint AS claims_new,
       NULL::bigint AS claims_replay,
       NULL::bigint AS claims_in_progress,
       NULL::bigint AS claims_mismatch,
       NULL::bigint AS completions,
       NULL::bigint AS releases,
       NULL::bigint AS rows_swept,
       NULL::boolean AS sweeper_enabled;

CREATE OR REPLACE VIEW idempotency_monitor.stats AS
SELECT NULL::name AS database,
       NULL::bigint AS rows_in_progress,
       NULL::bigint AS rows_completed,
       NULL::bigint AS rows_expired,
       NULL::timestamptz AS oldest_expiry,
       NULL::timestamptz AS last_sweep_at,
       NULL::bigint AS last_sweep_rows,
       NULL::bigint AS claims_new,
       NULL::bigint AS claims_replay,
       NULL::bigint AS claims_in_progress,
       NULL::bigint AS claims_mismatch,
       NULL::bigint AS completions,
       NULL::bigint AS releases,
       NULL::bigint AS rows_swept,
       NULL::boolean AS sweeper_enabled;

DROP FUNCTION idempotency._cluster_stats();
DROP FUNCTION idempotency._shared_stats();

CREATE FUNCTION idempotency._shared_stats(
    OUT preloaded          boolean,
    OUT claims_new         bigint,
    OUT claims_replay      bigint,
    OUT claims_in_progress bigint,
    OUT claims_mismatch    bigint,
    OUT completions        bigint,
    OUT releases           bigint,
    OUT rows_swept         bigint,
    OUT last_sweep_at      timestamptz,
    OUT last_sweep_rows    bigint,
    OUT takeovers            bigint,
    OUT stale_tokens_refused bigint,
    OUT claims_waited        bigint,
    OUT claim_wait_seconds   double precision,
    OUT last_sweep_error     text
)
LANGUAGE c VOLATILE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idempotency_shared_stats';

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
    OUT last_sweep_rows    bigint,
    OUT takeovers            bigint,
    OUT stale_tokens_refused bigint,
    OUT claims_waited        bigint,
    OUT claim_wait_seconds   double precision,
    OUT last_sweep_error     text
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
                v_docs := v_docs OPERATOR(pg_catalog.||)
                          (v_node.result::jsonb OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object('node', v_node.nodeid));
            END LOOP;
            RETURN QUERY
            SELECT pg_catalog.bool_and(j.preloaded),
                   pg_catalog.sum(j.claims_new)::bigint, pg_catalog.sum(j.claims_replay)::bigint,
                   pg_catalog.sum(j.claims_in_progress)::bigint, pg_catalog.sum(j.claims_mismatch)::bigint,
                   pg_catalog.sum(j.completions)::bigint, pg_catalog.sum(j.releases)::bigint,
                   pg_catalog.sum(j.rows_swept)::bigint,
                   CASE WHEN pg_catalog.bool_and(j.last_sweep_at IS NOT NULL)
                        THEN pg_catalog.min(j.last_sweep_at) END,
                   pg_catalog.sum(j.last_sweep_rows)::bigint,
                   pg_catalog.sum(j.takeovers)::bigint, pg_catalog.sum(j.stale_tokens_refused)::bigint,
                   pg_catalog.sum(j.claims_waited)::bigint,
                   pg_catalog.sum(j.claim_wait_seconds)::double precision,
                   -- A node whose last sweep failed shows, named.
                   pg_catalog.string_agg(pg_catalog.format('node %s: %s', j.node, j.last_sweep_error), '; ' ORDER BY j.node)
                       FILTER (WHERE j.last_sweep_error IS NOT NULL)
              FROM pg_catalog.unnest(v_docs) AS d(doc),
                   pg_catalog.jsonb_to_record(d.doc) AS j(preloaded boolean, claims_new bigint,
                       claims_replay bigint, claims_in_progress bigint, claims_mismatch bigint,
                       completions bigint, releases bigint, rows_swept bigint,
                       last_sweep_at timestamptz, last_sweep_rows bigint, takeovers bigint,
                       stale_tokens_refused bigint, claims_waited bigint,
                       claim_wait_seconds double precision, last_sweep_error text, node integer);
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM idempotency._shared_stats();
END
$fn$;

-- Counts its IK003 answers.
-- Raises the error that explains why complete/checkpoint found no row it may change.
CREATE OR REPLACE FUNCTION idempotency._raise_not_claimed(p_key text, p_scope text, p_token bigint, p_action text)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    r record;
    v_filter text;
    v_key text := idempotency._stored_key(p_key, p_scope);
    -- Messages name a hashed key as (hashed): nothing of its stored form, which the caller
    -- could otherwise have computed for any key and matched against a copy of the table.
    v_label text := CASE WHEN v_key OPERATOR(pg_catalog.=) p_key THEN pg_catalog.quote_literal(p_key)
                         ELSE '(hashed)' END;
BEGIN
    -- A store distributed by its tenant: the statement names the tenant too (_tenant_filter).
    v_filter := idempotency._tenant_filter(p_scope);
    IF v_filter OPERATOR(pg_catalog.=) '' THEN
        SELECT k.status, k.token, k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() AS live
          INTO r
          FROM idempotency.idempotency_keys AS k
         WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) v_key;
    ELSE
        EXECUTE 'SELECT k.status, k.token, k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() AS live '
                'FROM idempotency.idempotency_keys AS k WHERE k.scope OPERATOR(pg_catalog.=) $1 '
                'AND k.key OPERATOR(pg_catalog.=) $2' OPERATOR(pg_catalog.||) v_filter
          INTO r USING p_scope, v_key;
    END IF;
    IF r IS NULL OR NOT r.live THEN
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
        -- Counted (stats.stale_tokens_refused) before the error undoes the transaction: the
        -- counters are not transactional.
        PERFORM idempotency._count('stale_token');
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: token %s is stale, the current token is %s',
                                        p_action, v_label, p_scope, p_token, r.token),
            HINT = 'another worker took the key over after this lease ran out (or the token is another key''s); abandon this attempt';
    ELSE
        PERFORM idempotency._count('stale_token');
        RAISE EXCEPTION USING
            ERRCODE = 'IK003',
            MESSAGE = pg_catalog.format('cannot %s key %s in scope %L: token %s was never issued for it, the current token is %s',
                                        p_action, v_label, p_scope, p_token, r.token),
            HINT = 'pass the token that claim returned for this key';
    END IF;
    RETURN NULL;  -- not reached
END
$fn$;

-- The exact row counts of the store: live rows by status, and expired rows not yet swept (a
-- scan of the whole table; the stats views estimate them). As the caller: for the store's
-- owner, superusers and roles granted SELECT on idempotency.idempotency_keys.
CREATE FUNCTION idempotency.count_keys()
RETURNS TABLE (rows_in_progress bigint, rows_completed bigint, rows_expired bigint)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT pg_catalog.count(*) FILTER (
               WHERE k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status
                 AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()),
           pg_catalog.count(*) FILTER (
               WHERE k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status
                 AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()),
           pg_catalog.count(*) FILTER (
               WHERE k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now())
      FROM idempotency.idempotency_keys AS k
$fn$;

-- The store's rows for the stats views, at a cost that does not grow with the store: counted
-- exactly (count_keys) while the table is at most 128 pages (1 MB; also on Citus, whose
-- coordinator holds no rows), otherwise the planner's estimates (from the statistics that
-- ANALYZE and autovacuum keep, scaled to the table's current size). The oldest expiry through
-- the sweep index: the first row in its order, then the rows keyed no later than that row's
-- expiry (a row's key, the expiry its claim set, is never later than its expires_at: see
-- docs/architecture.md#the-sweep-index). SECURITY DEFINER, reading the table as its owner; in
-- this schema, so that it is named only by the views and by roles granted the schema.
CREATE FUNCTION idempotency_monitor._store_rows(
    OUT rows_in_progress bigint,
    OUT rows_completed   bigint,
    OUT rows_expired     bigint,
    OUT oldest_expiry    timestamptz
)
RETURNS record
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_pages bigint;
    v_first timestamptz;
    v_plan json;
BEGIN
    -- The table, or its partitions (a partitioned table has no pages of its own).
    SELECT COALESCE(pg_catalog.sum(pg_catalog.pg_relation_size(c.oid)), 0)
           OPERATOR(pg_catalog./) pg_catalog.current_setting('block_size')::bigint
      INTO v_pages
      FROM pg_catalog.pg_class AS c
     WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
        OR c.oid OPERATOR(pg_catalog.=) ANY (
               SELECT t.relid FROM pg_catalog.pg_partition_tree('idempotency.idempotency_keys'::pg_catalog.regclass) AS t
                WHERE t.isleaf);
    IF v_pages OPERATOR(pg_catalog.<=) 128 THEN
        SELECT c.rows_in_progress, c.rows_completed, c.rows_expired
          INTO rows_in_progress, rows_completed, rows_expired
          FROM idempotency.count_keys() AS c;
    ELSE
        EXECUTE 'EXPLAIN (FORMAT JSON) SELECT FROM idempotency.idempotency_keys AS k '
                'WHERE k.status OPERATOR(pg_catalog.=) ''in_progress''::idempotency.key_status '
                'AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()' INTO v_plan;
        rows_in_progress := (v_plan OPERATOR(pg_catalog.->) 0 OPERATOR(pg_catalog.->) 'Plan'
                             OPERATOR(pg_catalog.->>) 'Plan Rows')::numeric::bigint;
        EXECUTE 'EXPLAIN (FORMAT JSON) SELECT FROM idempotency.idempotency_keys AS k '
                'WHERE k.status OPERATOR(pg_catalog.=) ''completed''::idempotency.key_status '
                'AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()' INTO v_plan;
        rows_completed := (v_plan OPERATOR(pg_catalog.->) 0 OPERATOR(pg_catalog.->) 'Plan'
                           OPERATOR(pg_catalog.->>) 'Plan Rows')::numeric::bigint;
        EXECUTE 'EXPLAIN (FORMAT JSON) SELECT FROM idempotency.idempotency_keys AS k '
                'WHERE k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()' INTO v_plan;
        rows_expired := (v_plan OPERATOR(pg_catalog.->) 0 OPERATOR(pg_catalog.->) 'Plan'
                         OPERATOR(pg_catalog.->>) 'Plan Rows')::numeric::bigint;
    END IF;
    SELECT k.expires_at INTO v_first
      FROM idempotency.idempotency_keys AS k
     ORDER BY ((k.created_at AT TIME ZONE 'UTC') OPERATOR(pg_catalog.+) k.ttl)
     LIMIT 1;
    IF v_first IS NOT NULL THEN
        -- Planned with the bound's value, so that the range is read through the index.
        EXECUTE 'SELECT pg_catalog.min(k.expires_at) FROM idempotency.idempotency_keys AS k '
                'WHERE ((k.created_at AT TIME ZONE ''UTC'') OPERATOR(pg_catalog.+) k.ttl) '
                'OPERATOR(pg_catalog.<=) $1'
          INTO oldest_expiry USING v_first AT TIME ZONE 'UTC';
    END IF;
END
$fn$;

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
       s.preloaded AS sweeper_enabled,
       s.takeovers,
       s.stale_tokens_refused,
       s.claims_waited,
       s.claim_wait_seconds,
       CASE WHEN t.oldest_expiry OPERATOR(pg_catalog.<=) pg_catalog.now()
            THEN pg_catalog.date_part('epoch', pg_catalog.now() OPERATOR(pg_catalog.-) t.oldest_expiry)
       END AS sweep_lag_seconds,
       s.last_sweep_error
  FROM idempotency_monitor._store_rows() AS t,
       idempotency._cluster_stats() AS s;

CREATE OR REPLACE VIEW idempotency_monitor.stats AS
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
       s.preloaded AS sweeper_enabled,
       s.takeovers,
       s.stale_tokens_refused,
       s.claims_waited,
       s.claim_wait_seconds,
       CASE WHEN t.oldest_expiry OPERATOR(pg_catalog.<=) pg_catalog.now()
            THEN pg_catalog.date_part('epoch', pg_catalog.now() OPERATOR(pg_catalog.-) t.oldest_expiry)
       END AS sweep_lag_seconds,
       s.last_sweep_error
  FROM idempotency_monitor._store_rows() AS t,
       -- Without Citus, this server's counters straight from the C function, which checks the
       -- querying role itself: the PL/pgSQL _cluster_stats would name idempotency._shared_stats
       -- as that role, and a role granted only the monitoring schema may name nothing in schema
       -- idempotency. Where Citus is installed, every node's (_cluster_stats). The conditions
       -- are evaluated once, before either function runs.
       (SELECT * FROM idempotency._shared_stats()
         WHERE pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NULL
        UNION ALL
        SELECT * FROM idempotency._cluster_stats()
         WHERE pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL) AS s;

-- distribute() checks the application's table (colocate_with) and that every node is reachable
-- before it changes anything.
CREATE OR REPLACE FUNCTION idempotency.distribute(
    tenant_type   regtype,
    shard_count   integer DEFAULT NULL,
    colocate_with regclass DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_changed boolean := false;
    v_rel regclass;
    v_fn regprocedure;
    v_node record;
    v_floor bigint := 0;
    v_type pg_catalog.regtype := tenant_type;
    v_current pg_catalog.regtype;
    v_column text;
    v_app_column name;
    v_app_type pg_catalog.regtype;
    v_app_collation oid;
BEGIN
    IF v_type IS NOT NULL AND v_type OPERATOR(pg_catalog.<>) ALL (ARRAY['text', 'bigint', 'uuid']::pg_catalog.regtype[]) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = pg_catalog.format('tenant_type must be text, bigint or uuid, not %s', v_type),
            HINT = 'distribute by the type of the tenant id the application''s tables are distributed by; text: by scope';
    END IF;
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
    SELECT pg_catalog.column_to_column_name(p.logicalrelid, p.partkey) INTO v_column
      FROM pg_catalog.pg_dist_partition AS p
     WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
       AND p.partmethod OPERATOR(pg_catalog.=) 'h';
    SELECT a.atttypid::pg_catalog.regtype INTO v_current FROM pg_catalog.pg_attribute AS a
     WHERE a.attrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass
       AND a.attname OPERATOR(pg_catalog.=) v_column AND NOT a.attisdropped;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                    WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
        v_type := COALESCE(v_type, 'text'::pg_catalog.regtype);
        IF distribute.colocate_with IS NOT NULL AND distribute.shard_count IS NOT NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'invalid_parameter_value',
                MESSAGE = 'idempotency.distribute takes shard_count or colocate_with, not both',
                HINT = 'the store colocated with a table has that table''s shards';
        END IF;
        -- Checked before anything changes (the tenant columns are added on each node by a
        -- command of its own, which a later failure would not undo): the application's table is
        -- hash-distributed by a column of the store's type (and, for text, collation "C", the
        -- scope's, as Citus requires of colocated columns), and every node is reachable.
        IF distribute.colocate_with IS NOT NULL THEN
            SELECT a.attname, a.atttypid::pg_catalog.regtype, a.attcollation
              INTO v_app_column, v_app_type, v_app_collation
              FROM pg_catalog.pg_dist_partition AS p
              JOIN pg_catalog.pg_attribute AS a
                ON a.attrelid OPERATOR(pg_catalog.=) p.logicalrelid
               AND a.attname OPERATOR(pg_catalog.=) pg_catalog.column_to_column_name(p.logicalrelid, p.partkey)
             WHERE p.logicalrelid OPERATOR(pg_catalog.=) distribute.colocate_with
               AND p.partmethod OPERATOR(pg_catalog.=) 'h';
            IF NOT FOUND THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'invalid_parameter_value',
                    MESSAGE = pg_catalog.format('idempotency.distribute: colocate_with %s is not a hash-distributed Citus table',
                                                distribute.colocate_with),
                    HINT = 'distribute the application''s table by its tenant id first (create_distributed_table), or leave colocate_with out';
            END IF;
            IF v_app_type OPERATOR(pg_catalog.<>) v_type THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'invalid_parameter_value',
                    MESSAGE = pg_catalog.format('idempotency.distribute: colocate_with %s is distributed by %I of type %s, not tenant_type %s',
                                                distribute.colocate_with, v_app_column, v_app_type, v_type),
                    HINT = CASE WHEN v_app_type OPERATOR(pg_catalog.=) ANY (ARRAY['text', 'bigint', 'uuid']::pg_catalog.regtype[])
                                THEN pg_catalog.format('pass tenant_type => %L', v_app_type)
                                ELSE 'the store is distributed by text (its scope), bigint or uuid: colocate it with a table distributed by one of those' END;
            END IF;
            IF v_type OPERATOR(pg_catalog.=) 'text'::pg_catalog.regtype
               AND v_app_collation OPERATOR(pg_catalog.<>) 'pg_catalog."C"'::pg_catalog.regcollation THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'invalid_parameter_value',
                    MESSAGE = pg_catalog.format('idempotency.distribute: colocate_with %s is distributed by %I of collation %s, not "C" (the scope''s)',
                                                distribute.colocate_with, v_app_column, v_app_collation::pg_catalog.regcollation),
                    HINT = 'Citus colocates columns of the same collation: declare the application''s column COLLATE "C"';
            END IF;
        END IF;
        FOR v_node IN
            SELECT r.nodename, r.nodeport, r.success, r.result
              FROM pg_catalog.run_command_on_workers('SELECT 1') AS r
        LOOP
            IF NOT v_node.success THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'connection_exception',
                    MESSAGE = pg_catalog.format('idempotency.distribute: Citus node %s:%s is unreachable, and nothing was changed: %s',
                                                v_node.nodename, v_node.nodeport, v_node.result),
                    HINT = 'call idempotency.distribute() again once every node is reachable';
            END IF;
        END LOOP;
        IF v_type OPERATOR(pg_catalog.<>) 'text'::pg_catalog.regtype THEN
            -- The statements that name the tenant are the library's (claim, complete).
            IF (SELECT l.lanname FROM pg_catalog.pg_proc AS f
                  JOIN pg_catalog.pg_language AS l ON l.oid OPERATOR(pg_catalog.=) f.prolang
                 WHERE f.oid OPERATOR(pg_catalog.=) 'idempotency.claim(text, jsonb, text, interval, interval)'::pg_catalog.regprocedure)
               OPERATOR(pg_catalog.<>) 'c' THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'feature_not_supported',
                    MESSAGE = 'idempotency.distribute: a store distributed by its tenant needs the native edition (the library)',
                    HINT = 'distribute the portable edition''s store by scope: idempotency.distribute()';
            END IF;
            PERFORM idempotency._tenant_columns(v_type);
            FOR v_node IN
                SELECT r.nodename, r.nodeport, r.success, r.result
                  FROM pg_catalog.run_command_on_workers(
                           pg_catalog.format('SELECT idempotency._tenant_columns(%L)', v_type)) AS r
            LOOP
                IF NOT v_node.success THEN
                    RAISE EXCEPTION USING
                        ERRCODE = 'connection_exception',
                        MESSAGE = pg_catalog.format('idempotency.distribute could not add the tenant column on Citus node %s:%s: %s',
                                                    v_node.nodename, v_node.nodeport, v_node.result),
                        HINT = 'call idempotency.distribute() again once every node is reachable';
                END IF;
            END LOOP;
            v_column := 'tenant';
        ELSE
            v_column := 'scope';
        END IF;
        PERFORM pg_catalog.create_distributed_table('idempotency.idempotency_keys', v_column,
                                                    colocate_with => COALESCE(distribute.colocate_with::pg_catalog.text, 'none'),
                                                    shard_count => distribute.shard_count);
        v_changed := true;
    ELSIF v_column IS NULL OR v_column OPERATOR(pg_catalog.<>) ALL (ARRAY['scope', 'tenant']) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = 'idempotency.idempotency_keys is a Citus table, but not hash-distributed by scope or tenant',
            HINT = 'Citus cannot convert the tables of an extension (undistribute_table refuses them): copy the store out, re-create the extension and copy it back (docs/scaling.md, "Undistributing the store"), then call idempotency.distribute()';
    ELSIF v_type IS NOT NULL AND v_type OPERATOR(pg_catalog.<>) v_current THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = pg_catalog.format('idempotency.distribute: the store is distributed by a tenant of type %s already, not %s',
                                        v_current, v_type),
            HINT = 'a distributed store keeps its distribution: copy the store out, re-create the extension and copy it back (docs/scaling.md, "Undistributing the store"), then distribute it again';
    ELSIF distribute.colocate_with IS NOT NULL
          AND (SELECT p.colocationid FROM pg_catalog.pg_dist_partition AS p
                WHERE p.logicalrelid OPERATOR(pg_catalog.=) distribute.colocate_with) IS DISTINCT FROM
              (SELECT p.colocationid FROM pg_catalog.pg_dist_partition AS p
                WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.idempotency_keys'::pg_catalog.regclass) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = pg_catalog.format('idempotency.distribute: the store is distributed already, and not colocated with %s',
                                        distribute.colocate_with),
            HINT = pg_catalog.format('colocate the table with the store: SELECT alter_distributed_table(%L, colocate_with => ''idempotency.idempotency_keys'')',
                                     distribute.colocate_with::pg_catalog.text);
    ELSE
        v_type := v_current;
    END IF;

    IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p
                    WHERE p.logicalrelid OPERATOR(pg_catalog.=) 'idempotency.audit'::pg_catalog.regclass) THEN
        IF v_column OPERATOR(pg_catalog.=) 'scope'
           AND NOT EXISTS (SELECT FROM pg_catalog.pg_constraint AS c
                            WHERE c.conrelid OPERATOR(pg_catalog.=) 'idempotency.audit'::pg_catalog.regclass
                              AND c.conname OPERATOR(pg_catalog.=) 'audit_pkey'
                              AND c.conkey OPERATOR(pg_catalog.=) ARRAY[2, 1]::pg_catalog.int2[]) THEN
            ALTER TABLE idempotency.audit DROP CONSTRAINT audit_pkey,
                ADD CONSTRAINT audit_pkey PRIMARY KEY (scope, id);
        END IF;
        PERFORM pg_catalog.create_distributed_table('idempotency.audit', v_column,
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

    -- A store distributed by scope: the functions by their scope argument; by its tenant: the
    -- overloads of claim and complete whose scope is of the tenant's type (a text argument
    -- cannot be the distribution argument of a function colocated with a bigint or uuid column).
    FOREACH v_fn IN ARRAY CASE WHEN v_type OPERATOR(pg_catalog.=) 'text'::pg_catalog.regtype THEN ARRAY[
        'idempotency.claim(text, jsonb, text, interval, interval)',
        'idempotency.complete(text, jsonb, integer, text, bigint, interval)',
        'idempotency.checkpoint(text, text, text, bigint)',
        'idempotency.release(text, text, bigint)',
        'idempotency.forget(text, text)',
        'idempotency.lookup(text, text)',
        -- A batch has one scope: delegated whole to the worker holding its shard.
        'idempotency.claim_many(text[], jsonb[], text, interval, interval)',
        'idempotency.complete_many(text[], jsonb[], integer[], text, bigint[], interval)']::pg_catalog.regprocedure[]
      ELSE ARRAY[
        pg_catalog.format('idempotency.claim(text, jsonb, %s, interval, interval)', v_type)::pg_catalog.regprocedure,
        pg_catalog.format('idempotency.complete(text, jsonb, integer, %s, bigint, interval)', v_type)::pg_catalog.regprocedure]
      END LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_dist_object AS o
                        WHERE o.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
                          AND o.objid OPERATOR(pg_catalog.=) v_fn::pg_catalog.oid
                          AND o.distribution_argument_index IS NOT NULL) THEN
            PERFORM pg_catalog.create_distributed_function(v_fn, distribution_arg_name => 'scope',
                                                           colocate_with => 'idempotency.idempotency_keys');
            v_changed := true;
        END IF;
    END LOOP;

    -- Citus copies the rows of a table it distributes into the shards, and leaves them in the
    -- coordinator's own (shell) table too, where nothing reads or sweeps them: empty it. Every
    -- call looks, so a store distributed before with its rows left there is emptied as well.
    FOREACH v_rel IN ARRAY ARRAY['idempotency.idempotency_keys', 'idempotency.audit',
                                 'idempotency.config', 'idempotency.signing_secrets']::pg_catalog.regclass[] LOOP
        IF pg_catalog.pg_relation_size(v_rel) OPERATOR(pg_catalog.>) 0 THEN
            PERFORM pg_catalog.truncate_local_data_after_distributing_table(v_rel);
            RAISE NOTICE 'idempotency.distribute: emptied the coordinator''s local table of % (its rows are in the shards)', v_rel;
            v_changed := true;
        END IF;
    END LOOP;

    -- Token classes and audit id ranges, on every node (nodes added later get theirs at the
    -- next call; until then claims there are refused). A node given its class starts above
    -- every token any node handed out so far (its class may hold tokens handed out before
    -- the classes, on a single node or by an older release).
    FOR v_node IN
        SELECT r.nodeid, r.success, r.result FROM pg_catalog.run_command_on_all_nodes(
            $cmd$SELECT t.last_value FROM idempotency.token_seq AS t$cmd$) AS r
    LOOP
        IF NOT v_node.success THEN
            RAISE EXCEPTION USING
                ERRCODE = 'connection_exception',
                MESSAGE = pg_catalog.format('idempotency.distribute could not read the token sequence of Citus node %s: %s',
                                            v_node.nodeid, v_node.result),
                HINT = 'call idempotency.distribute() again once every node is reachable';
        END IF;
        v_floor := GREATEST(v_floor, v_node.result::bigint);
    END LOOP;
    v_floor := GREATEST(v_floor, (SELECT pg_catalog.max(k.token) FROM idempotency.idempotency_keys AS k));
    FOR v_node IN
        SELECT n.nodename, n.nodeport, r.success, r.result
          FROM pg_catalog.run_command_on_all_nodes(
                   pg_catalog.format('SELECT idempotency._node_sequences(%s)', v_floor)) AS r
          LEFT JOIN pg_catalog.pg_dist_node AS n ON n.nodeid OPERATOR(pg_catalog.=) r.nodeid
    LOOP
        IF NOT v_node.success THEN
            RAISE EXCEPTION USING
                ERRCODE = 'connection_exception',
                MESSAGE = pg_catalog.format('idempotency.distribute could not set the token and audit id ranges of Citus node %s:%s: %s',
                                            v_node.nodename, v_node.nodeport, v_node.result),
                HINT = 'call idempotency.distribute() again once every node is reachable';
        END IF;
        IF v_node.result OPERATOR(pg_catalog.<>) '' THEN
            RAISE NOTICE 'idempotency.distribute: node %:% now hands out %', v_node.nodename, v_node.nodeport, v_node.result;
            v_changed := true;
        END IF;
    END LOOP;

    IF NOT v_changed THEN
        RAISE NOTICE 'idempotency.distribute: the store is distributed already; nothing changed';
    END IF;
END
$fn$;
