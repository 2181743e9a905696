-- A worked stored procedure: placing an order that charges a card through a derived key.
-- Loaded and exercised by tests/integration/test_examples.py; shown in the README.
--
-- One-transaction style: the claim, the order row, the charge request and the stored response
-- commit together or not at all, so a failed attempt never poisons the key. The charge itself
-- leaves through an outbox: a sender process calls the payment provider with the outbox row's
-- key as *its* Idempotency-Key, so a resend after a crash cannot charge twice either.

CREATE SCHEMA shop;

CREATE TABLE shop.orders (
    id         bigserial PRIMARY KEY,
    client_id  text NOT NULL,
    items      jsonb NOT NULL,
    amount     numeric NOT NULL,
    currency   text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE shop.payment_outbox (
    idempotency_key text PRIMARY KEY,      -- derived from the order's key: one per side effect
    order_id        bigint NOT NULL REFERENCES shop.orders,
    amount          numeric NOT NULL,
    currency        text NOT NULL,
    sent_at         timestamptz
);

-- Returns an HTTP-like answer: {"status": ..., "body": ..., "headers": {...}}.
CREATE FUNCTION shop.place_order(client_id text, idempotency_key text, request jsonb)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c          idempotency.claim_result;
    order_id   bigint;
    charge_key text;
    body       jsonb;
BEGIN
    IF idempotency_key IS NULL THEN
        RETURN jsonb_build_object('status', 400, 'body',
            jsonb_build_object('title', 'Idempotency-Key is missing'));
    END IF;

    c := idempotency.claim(idempotency_key, request, scope => 'POST /orders ' || client_id);
    CASE c.outcome
        WHEN 'replay' THEN
            RETURN jsonb_build_object('status', c.response_status, 'body', c.response,
                                      'headers', jsonb_build_object('Idempotent-Replayed', 'true'));
        WHEN 'in_progress' THEN
            RETURN jsonb_build_object('status', 409, 'headers', jsonb_build_object(
                'Retry-After', ceil(extract(epoch FROM c.retry_after))::int::text));
        WHEN 'mismatch' THEN
            RETURN jsonb_build_object('status', 422, 'body',
                jsonb_build_object('title', 'Idempotency-Key is already used with a different request'));
        ELSE
            NULL;  -- new: do the work below, in this same transaction
    END CASE;

    INSERT INTO shop.orders (client_id, items, amount, currency)
    VALUES (place_order.client_id, request -> 'items', (request ->> 'amount')::numeric, request ->> 'currency')
    RETURNING id INTO order_id;

    -- The charge gets its own key, derived from the request's: stable across retries, distinct
    -- from every other side effect of this order (an e-mail would use step 'confirmation').
    charge_key := idempotency.derive_key(client_id || '/' || idempotency_key, 'charge',
                                         jsonb_build_object('amount', request -> 'amount',
                                                            'currency', request -> 'currency'));
    INSERT INTO shop.payment_outbox (idempotency_key, order_id, amount, currency)
    VALUES (charge_key, order_id, (request ->> 'amount')::numeric, request ->> 'currency')
    ON CONFLICT ON CONSTRAINT payment_outbox_pkey DO NOTHING;

    body := jsonb_build_object('order_id', order_id, 'charge_key', charge_key, 'status', 'accepted');
    PERFORM idempotency.complete(idempotency_key, body, 201, scope => 'POST /orders ' || client_id);
    RETURN jsonb_build_object('status', 201, 'body', body);
END
$$;
