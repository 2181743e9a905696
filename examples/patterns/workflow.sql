-- Pattern: a multi-step workflow (reserve stock, charge, ship), leased style with recovery points.
--
-- Key:   'order:' || order id for the workflow; every step's call to another system carries its
--        own key, idempotency.derive_key(workflow key, step, params): a resumed run re-sends
--        exactly the same keys, so a provider that honours idempotency keys (as payment
--        providers do) does a re-sent step once.
-- Scope: 'workflow:fulfil'.
-- TTL:   72 hours: a crashed or stuck workflow can still be resumed after a weekend (brandur's
--        reaper keeps keys 72 h so that a Friday bug can be fixed on Monday).
-- Lease: longer than the whole run: idempotency.checkpoint does not extend it. A worker that
--        dies mid-run blocks its workflow for at most the lease; the next run after it takes
--        over with a larger token and resumes at the last checkpoint. The old worker's token is
--        then stale: its checkpoint/complete are refused (IK003) and it stops.
--
-- Each step: call the other system (that commits on its side, whatever happens to us), then
-- record the checkpoint. A crash between the two re-sends the step with the same derived key,
-- which the other system answers from its own idempotency store. Steps already checkpointed
-- are never sent again. Safe to load again. Tested by tests/integration/test_patterns.py.

CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE SCHEMA IF NOT EXISTS workflow;

-- Stand-ins for the other systems: every request they receive (duplicates included) ...
CREATE TABLE IF NOT EXISTS workflow.external_calls (
    id              bigserial PRIMARY KEY,
    system          text NOT NULL,
    idempotency_key text NOT NULL,
    payload         jsonb,
    called_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- ... and what they did: one effect per idempotency key, as a provider with keys guarantees.
CREATE TABLE IF NOT EXISTS workflow.external_effects (
    system          text NOT NULL,
    idempotency_key text NOT NULL,
    result          jsonb NOT NULL,
    PRIMARY KEY (system, idempotency_key)
);
-- Fault injection for the tests, between a step's call to the other system and its
-- checkpoint: 'hang' (sleep `seconds`: a stuck worker, or one to be killed) or 'error'.
CREATE TABLE IF NOT EXISTS workflow.faults (
    step    text PRIMARY KEY,
    action  text NOT NULL CHECK (action IN ('hang', 'error')),
    seconds float8 NOT NULL DEFAULT 3600
);

CREATE OR REPLACE FUNCTION workflow.call_external(system text, idempotency_key text, payload jsonb)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    r jsonb;
BEGIN
    INSERT INTO workflow.external_calls (system, idempotency_key, payload)
    VALUES (call_external.system, call_external.idempotency_key, payload);
    INSERT INTO workflow.external_effects AS e (system, idempotency_key, result)
    VALUES (call_external.system, call_external.idempotency_key,
            jsonb_build_object('id', call_external.system || '-' || substr(md5(call_external.idempotency_key), 1, 8)))
    ON CONFLICT (system, idempotency_key) DO UPDATE SET result = e.result  -- replay the first result
    RETURNING e.result INTO r;
    RETURN r;
END
$$;

CREATE OR REPLACE FUNCTION workflow._fault(step text)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    f workflow.faults;
BEGIN
    SELECT * INTO f FROM workflow.faults AS x WHERE x.step = _fault.step;
    IF f.action = 'hang' THEN
        PERFORM pg_sleep(f.seconds);
    ELSIF f.action = 'error' THEN
        RAISE EXCEPTION 'injected fault in step %', step;
    END IF;
END
$$;

-- checkpoint and complete that answer false instead of raising when this worker was fenced off
-- (IK003), its key is gone (IK001) or already completed by the worker that took over (IK002):
-- this keeps exception blocks, inside which COMMIT is not allowed, out of the procedure.
CREATE OR REPLACE FUNCTION workflow._checkpoint(key text, recovery_point text, token bigint)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idempotency.checkpoint(key, recovery_point, scope => 'workflow:fulfil', token => token);
    RETURN true;
EXCEPTION WHEN SQLSTATE 'IK003' OR SQLSTATE 'IK002' OR SQLSTATE 'IK001' THEN
    RETURN false;
END
$$;

CREATE OR REPLACE FUNCTION workflow._complete(key text, response jsonb, token bigint)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idempotency.complete(key, response, 200, scope => 'workflow:fulfil', token => token);
    RETURN true;
EXCEPTION WHEN SQLSTATE 'IK003' OR SQLSTATE 'IK002' OR SQLSTATE 'IK001' THEN
    RETURN false;
END
$$;

-- CALL workflow.fulfil_order('o-1', '{"items": [...], "amount": 30, "address": "..."}', NULL);
-- result: the stored response once done; {"status": "running", "retry_after_s": n} while
-- another worker holds the lease; {"status": "fenced"} if this worker lost its lease midway;
-- {"status": "mismatch"} if the order id was started with other parameters.
-- Must be called outside a transaction block (it commits after each step).
CREATE OR REPLACE PROCEDURE workflow.fulfil_order(order_id text, params jsonb,
                                                  INOUT result jsonb DEFAULT NULL,
                                                  lease interval DEFAULT '10 minutes')
LANGUAGE plpgsql
AS $$
DECLARE
    k  text := 'order:' || order_id;
    c  idempotency.claim_result;
    rp text;
    r  jsonb;
    charge jsonb;
BEGIN
    c := idempotency.claim(k, params, scope => 'workflow:fulfil', ttl => '72 hours', lease => lease);
    CASE c.outcome
        WHEN 'replay' THEN
            result := c.response;
            RETURN;
        WHEN 'in_progress' THEN
            result := jsonb_build_object('status', 'running',
                                         'retry_after_s', ceil(extract(epoch FROM c.retry_after)));
            RETURN;
        WHEN 'mismatch' THEN
            result := jsonb_build_object('status', 'mismatch');
            RETURN;
        ELSE
            NULL;  -- new: a first run (recovery_point NULL) or a takeover (the last checkpoint)
    END CASE;
    rp := coalesce(c.recovery_point, 'started');
    COMMIT;  -- the claim is now visible to every other worker: leased style

    IF rp = 'started' THEN
        PERFORM workflow.call_external('inventory',
                    idempotency.derive_key(k, 'reserve', params -> 'items'), params -> 'items');
        COMMIT;  -- the other system has done it, whatever happens to this worker now
        PERFORM workflow._fault('reserve');
        IF NOT workflow._checkpoint(k, 'reserved', c.token) THEN
            result := '{"status": "fenced"}'; RETURN;
        END IF;
        COMMIT;
        rp := 'reserved';
    END IF;

    IF rp = 'reserved' THEN
        PERFORM workflow.call_external('payments',
                    idempotency.derive_key(k, 'charge', jsonb_build_object('amount', params -> 'amount')),
                    jsonb_build_object('amount', params -> 'amount'));
        COMMIT;
        PERFORM workflow._fault('charge');
        IF NOT workflow._checkpoint(k, 'charged', c.token) THEN
            result := '{"status": "fenced"}'; RETURN;
        END IF;
        COMMIT;
        rp := 'charged';
    END IF;

    -- rp = 'charged': the last step, then the stored result
    PERFORM workflow.call_external('shipping',
                idempotency.derive_key(k, 'ship', jsonb_build_object('address', params -> 'address')),
                jsonb_build_object('address', params -> 'address'));
    COMMIT;
    PERFORM workflow._fault('ship');
    charge := (SELECT e.result FROM workflow.external_effects e
                WHERE e.system = 'payments'
                  AND e.idempotency_key = idempotency.derive_key(k, 'charge',
                                              jsonb_build_object('amount', params -> 'amount')));
    r := jsonb_build_object('status', 'fulfilled', 'order_id', order_id, 'charge', charge -> 'id');
    IF NOT workflow._complete(k, r, c.token) THEN
        result := '{"status": "fenced"}'; RETURN;
    END IF;
    result := r;
END
$$;
