-- Pattern: a webhook inbox (POST /webhooks/<provider>), one-transaction style.
--
-- Key:   the provider's event id (it stays the same on every redelivery).
-- Scope: the provider ('stripe', 'github', ...): event ids are only unique per provider.
-- TTL:   7 days: providers redeliver for days (with back-off) until they get a 2xx.
--
-- A duplicate delivery of a processed event is answered 200 and changes nothing. A delivery
-- that arrives while another copy is still being processed gets 409 with Retry-After: that
-- copy may still roll back, so the provider must not be told "done" yet. The fingerprint
-- leaves out the members a provider changes between deliveries (here "delivery_attempt"), so
-- a redelivery is a replay and not a mismatch. Safe to load again.
-- Tested by tests/integration/test_patterns.py.

CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE SCHEMA IF NOT EXISTS webhooks;

CREATE TABLE IF NOT EXISTS webhooks.invoices (
    id          text PRIMARY KEY,
    amount_due  numeric NOT NULL,
    amount_paid numeric NOT NULL DEFAULT 0,
    status      text NOT NULL DEFAULT 'open'
);

-- What the handler did, one row per processed event (no unique constraint on purpose: the
-- extension, not this table, keeps a redelivery from being processed twice).
CREATE TABLE IF NOT EXISTS webhooks.event_log (
    id           bigserial PRIMARY KEY,
    provider     text NOT NULL,
    event_id     text NOT NULL,
    type         text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now()
);

-- payload: {"id": "evt_1", "type": "invoice.paid", "data": {"invoice": "in_1", "amount": 10},
--           "delivery_attempt": 3}. Returns {"status": ..., "body": ..., "headers": {...}}.
CREATE OR REPLACE FUNCTION webhooks.receive(provider text, payload jsonb)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_event_id text := payload ->> 'id';
    c          idempotency.claim_result;
BEGIN
    IF provider IS NULL OR provider = '' OR v_event_id IS NULL OR length(v_event_id) NOT BETWEEN 1 AND 255 THEN
        RETURN jsonb_build_object('status', 400, 'body', jsonb_build_object('title', 'event id missing'));
    END IF;

    c := idempotency.claim(v_event_id, request => payload - 'delivery_attempt',
                           scope => provider, ttl => '7 days');
    CASE c.outcome
        WHEN 'replay' THEN          -- already processed: acknowledge, do nothing
            RETURN jsonb_build_object('status', 200, 'body', c.response,
                                      'headers', jsonb_build_object('Idempotent-Replayed', 'true'));
        WHEN 'in_progress' THEN     -- another copy is being processed right now
            RETURN jsonb_build_object('status', 409, 'headers', jsonb_build_object(
                'Retry-After', ceil(extract(epoch FROM c.retry_after))::int::text));
        WHEN 'mismatch' THEN        -- same event id, different content: refuse and look into it
            RETURN jsonb_build_object('status', 422, 'body', jsonb_build_object(
                'title', 'event id already received with different content'));
        ELSE
            NULL;
    END CASE;

    CASE payload ->> 'type'
        WHEN 'invoice.paid' THEN
            UPDATE webhooks.invoices
               SET amount_paid = amount_paid + (payload #>> '{data,amount}')::numeric,
                   status = CASE WHEN amount_paid + (payload #>> '{data,amount}')::numeric >= amount_due
                                 THEN 'paid' ELSE 'partially_paid' END
             WHERE id = payload #>> '{data,invoice}';
        WHEN 'invoice.voided' THEN
            UPDATE webhooks.invoices SET status = 'void' WHERE id = payload #>> '{data,invoice}';
        ELSE
            NULL;  -- event types this inbox does not handle are acknowledged and ignored
    END CASE;
    INSERT INTO webhooks.event_log (provider, event_id, type)
    VALUES (receive.provider, v_event_id, coalesce(payload ->> 'type', ''));

    PERFORM idempotency.complete(v_event_id, jsonb_build_object('received', true), 200, scope => provider);
    RETURN jsonb_build_object('status', 200, 'body', jsonb_build_object('received', true));
END
$$;
