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
