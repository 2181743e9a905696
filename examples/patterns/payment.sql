-- Pattern: a payment endpoint (POST /payments), one-transaction style.
--
-- Key:   the client's Idempotency-Key header, the same on every retry of one payment.
-- Scope: 'POST /payments ' || client id, so two clients' keys never meet.
-- TTL:   24 hours: clients retry for hours (Stripe keeps keys at least 24 h, IdempotentAPI 24 h).
--
-- The claim, the balance update, the payment row and the stored response commit together or
-- not at all: a failed attempt rolls its claim back and the retry starts afresh. Deterministic
-- business answers (402 insufficient funds, 404 unknown account) are stored and replayed like a
-- 201, so a retry never gets a different answer; a request that fails validation is refused
-- with 400 before anything is claimed. Safe to load again (IF NOT EXISTS, OR REPLACE).
-- Tested by tests/integration/test_patterns.py.

CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE SCHEMA IF NOT EXISTS payments;

CREATE TABLE IF NOT EXISTS payments.accounts (
    id       text PRIMARY KEY,
    currency text NOT NULL,
    balance  numeric NOT NULL CHECK (balance >= 0)
);

CREATE TABLE IF NOT EXISTS payments.payments (
    id              bigserial PRIMARY KEY,
    client_id       text NOT NULL,
    idempotency_key text NOT NULL,
    account_id      text NOT NULL REFERENCES payments.accounts,
    amount          numeric NOT NULL CHECK (amount > 0),
    currency        text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- request: {"account": "acc-1", "amount": 25.00, "currency": "EUR"}.
-- Returns an HTTP-like answer: {"status": ..., "body": ..., "headers": {...}}.
CREATE OR REPLACE FUNCTION payments.create_payment(client_id text, idempotency_key text, request jsonb)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_scope  text := 'POST /payments ' || client_id;
    c        idempotency.claim_result;
    v_amount numeric;
    acct     payments.accounts;
    pay_id   bigint;
    status   int;
    body     jsonb;
BEGIN
    IF idempotency_key IS NULL OR length(idempotency_key) NOT BETWEEN 1 AND 255 THEN
        RETURN jsonb_build_object('status', 400, 'body', jsonb_build_object(
            'title', 'Idempotency-Key is missing or not 1 to 255 characters'));
    END IF;
    -- Validate before claiming: a malformed request is not a payment attempt and stores nothing.
    IF jsonb_typeof(request -> 'amount') IS DISTINCT FROM 'number'
       OR jsonb_typeof(request -> 'account') IS DISTINCT FROM 'string'
       OR jsonb_typeof(request -> 'currency') IS DISTINCT FROM 'string' THEN
        RETURN jsonb_build_object('status', 400, 'body', jsonb_build_object(
            'title', 'account (string), amount (positive number) and currency (string) are required'));
    END IF;
    v_amount := (request ->> 'amount')::numeric;
    IF v_amount <= 0 THEN
        RETURN jsonb_build_object('status', 400, 'body', jsonb_build_object('title', 'amount must be positive'));
    END IF;

    c := idempotency.claim(idempotency_key, request, scope => v_scope, ttl => '24 hours');
    CASE c.outcome
        WHEN 'replay' THEN
            RETURN jsonb_build_object('status', c.response_status, 'body', c.response,
                                      'headers', jsonb_build_object('Idempotent-Replayed', 'true'));
        WHEN 'in_progress' THEN
            RETURN jsonb_build_object('status', 409, 'headers', jsonb_build_object(
                'Retry-After', ceil(extract(epoch FROM c.retry_after))::int::text));
        WHEN 'mismatch' THEN
            RETURN jsonb_build_object('status', 422, 'body', jsonb_build_object(
                'title', 'Idempotency-Key is already used with a different request'));
        ELSE
            NULL;  -- new: the payment runs below, in this transaction
    END CASE;

    SELECT * INTO acct FROM payments.accounts WHERE id = request ->> 'account' FOR UPDATE;
    IF NOT FOUND THEN
        status := 404;
        body := jsonb_build_object('title', 'unknown account');
    ELSIF acct.currency <> request ->> 'currency' THEN
        status := 422;
        body := jsonb_build_object('title', 'the account is kept in ' || acct.currency);
    ELSIF acct.balance < v_amount THEN
        status := 402;
        body := jsonb_build_object('title', 'insufficient funds');
    ELSE
        UPDATE payments.accounts SET balance = balance - v_amount WHERE id = acct.id;
        INSERT INTO payments.payments (client_id, idempotency_key, account_id, amount, currency)
        VALUES (create_payment.client_id, idempotency_key, acct.id, v_amount, acct.currency)
        RETURNING id INTO pay_id;
        status := 201;
        body := jsonb_build_object('payment_id', pay_id, 'amount', v_amount, 'currency', acct.currency);
    END IF;
    -- The answer is stored with the work: a retry of this key gets exactly this, for 24 hours.
    PERFORM idempotency.complete(idempotency_key, body, status, scope => v_scope);
    RETURN jsonb_build_object('status', status, 'body', body);
END
$$;
