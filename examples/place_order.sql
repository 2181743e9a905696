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
--
-- The client id and the key are checked before anything is written, and a refusal is a 400
-- answer saying what is wrong: a client id of 1 to 64 characters, a key of 1 to 200 (the
-- extension takes 255, but the charge key derived from it adds ':charge:' and 16 hex digits).
CREATE FUNCTION shop.place_order(client_id text, idempotency_key text, request jsonb)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c           idempotency.claim_result;
    order_scope text;
    order_id    bigint;
    charge_key  text;
    body        jsonb;
    title       text;
    detail      text;
BEGIN
    IF client_id IS NULL OR client_id = '' THEN
        title := 'Client id is missing';
        detail := 'the client id must have 1 to 64 characters';
    ELSIF length(client_id) > 64 THEN
        title := 'Client id is too long';
        detail := format('the client id has %s characters, at most 64 are allowed', length(client_id));
    ELSIF idempotency_key IS NULL THEN
        title := 'Idempotency-Key is missing';
        detail := 'this operation requires an Idempotency-Key of 1 to 200 characters';
    ELSIF idempotency_key = '' THEN
        title := 'Idempotency-Key is malformed';
        detail := 'the Idempotency-Key is empty; it must have 1 to 200 characters';
    ELSIF length(idempotency_key) > 200 THEN
        title := 'Idempotency-Key is malformed';
        detail := format('the Idempotency-Key is too long: %s characters, at most 200 are allowed',
                         length(idempotency_key));
    END IF;
    IF title IS NOT NULL THEN
        RETURN jsonb_build_object('status', 400, 'body',
            jsonb_build_object('title', title, 'detail', detail));
    END IF;

    -- The charge gets its own key, derived from the request's: stable across retries, distinct
    -- from every other side effect of this order (an e-mail would use step 'confirmation'). The
    -- client id goes into params, which derive_key hashes canonically, not into the parent text:
    -- a parent of client_id || '/' || key would give ('a/b', 'c') and ('a', 'b/c') one charge
    -- key, and the outbox would silently drop the second order's charge. Derived before
    -- anything is written: a key that derive_key refuses is a 400 as well.
    BEGIN
        charge_key := idempotency.derive_key(idempotency_key, 'charge',
                          jsonb_build_object('client_id', client_id,
                                             'amount', request -> 'amount',
                                             'currency', request -> 'currency'));
    EXCEPTION WHEN invalid_parameter_value THEN
        RETURN jsonb_build_object('status', 400, 'body',
            jsonb_build_object('title', 'Idempotency-Key is malformed', 'detail', SQLERRM));
    END;

    order_scope := 'POST /orders ' || client_id;
    c := idempotency.claim(idempotency_key, request, scope => order_scope);
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

    INSERT INTO shop.payment_outbox (idempotency_key, order_id, amount, currency)
    VALUES (charge_key, order_id, (request ->> 'amount')::numeric, request ->> 'currency')
    ON CONFLICT ON CONSTRAINT payment_outbox_pkey DO NOTHING;

    body := jsonb_build_object('order_id', order_id, 'charge_key', charge_key, 'status', 'accepted');
    PERFORM idempotency.complete(idempotency_key, body, 201, scope => order_scope);
    RETURN jsonb_build_object('status', 201, 'body', body);
END
$$;
