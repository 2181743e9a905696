-- Pattern: a queue consumer, with a tiny queue table standing in for SQS, RabbitMQ or Kafka.
--
-- Key:   the producer's message id: the same on every redelivery and on a duplicate publish.
-- Scope: 'queue:' || topic.
-- TTL:   visibility timeout x maximum deliveries: the whole window in which the queue can hand
--        the same message out again (here 30 s x 5). A producer that may publish the same
--        message twice, minutes apart, needs its own retry window added.
-- Lease: the visibility timeout: how long one delivery may take before the message reappears.
--
-- The handler runs in one transaction: claim, credit the points, store the outcome, ack.
--   new         -> do the work, complete, ack (delete the message)
--   replay      -> already done by another delivery: ack, nothing else
--   in_progress -> another consumer holds this message id right now: requeue with a delay
--                  (retry_after), do not ack - that consumer may still roll back
--   mismatch    -> the id was reused for a different body: dead-letter it
-- queue.receive_batch / queue.handle_batch below do the same for a batch of messages with
-- claim_many and complete_many.
-- Safe to load again. Tested by tests/integration/test_patterns.py and test_batch.py.

CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE SCHEMA IF NOT EXISTS queue;

CREATE TABLE IF NOT EXISTS queue.messages (
    id         bigserial PRIMARY KEY,
    message_id text NOT NULL,                 -- the producer's id; duplicates share it
    topic      text NOT NULL DEFAULT 'points',
    body       jsonb NOT NULL,
    visible_at timestamptz NOT NULL DEFAULT now(),
    deliveries int NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS messages_visible_at ON queue.messages (visible_at);

CREATE TABLE IF NOT EXISTS queue.dead_letters (
    id         bigint PRIMARY KEY,
    message_id text NOT NULL,
    topic      text NOT NULL,
    body       jsonb NOT NULL,
    deliveries int NOT NULL,
    reason     text NOT NULL,
    failed_at  timestamptz NOT NULL DEFAULT now()
);

-- The side effect: a loyalty-points ledger (processing a message twice would credit twice).
CREATE TABLE IF NOT EXISTS queue.points_ledger (
    id          bigserial PRIMARY KEY,
    message_id  text NOT NULL,
    customer_id text NOT NULL,
    points      int NOT NULL,
    consumer    text,
    credited_at timestamptz NOT NULL DEFAULT now()
);

CREATE OR REPLACE FUNCTION queue.publish(message_id text, body jsonb, topic text DEFAULT 'points')
RETURNS bigint
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO queue.messages (message_id, topic, body) VALUES ($1, $3, $2) RETURNING id
$$;

-- Hands out the oldest visible message and hides it for the visibility timeout (at-least-once:
-- a consumer that dies without acking gets the message redelivered). NULL when none is visible.
CREATE OR REPLACE FUNCTION queue.receive(visibility interval DEFAULT '30 seconds')
RETURNS queue.messages
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE queue.messages AS m
       SET visible_at = now() + visibility, deliveries = m.deliveries + 1
     WHERE m.id = (SELECT id FROM queue.messages
                    WHERE visible_at <= now()
                    ORDER BY visible_at, id
                    LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING m.*
$$;

-- Handles one delivery; returns what it did: 'processed', 'acked_duplicate', 'requeued' or
-- 'dead_lettered' (NULL for the empty row queue.receive returns when nothing is visible). Run it in its own transaction (the consumer loop below commits after it).
CREATE OR REPLACE FUNCTION queue.handle(m queue.messages, consumer text DEFAULT NULL,
                                        visibility interval DEFAULT '30 seconds',
                                        max_deliveries int DEFAULT 5)
RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c       idempotency.claim_result;
    v_scope text := 'queue:' || m.topic;
BEGIN
    IF m.id IS NULL THEN
        RETURN NULL;                                                      -- nothing was received
    END IF;
    IF m.deliveries > max_deliveries THEN
        INSERT INTO queue.dead_letters (id, message_id, topic, body, deliveries, reason)
        VALUES (m.id, m.message_id, m.topic, m.body, m.deliveries, 'too many deliveries');
        DELETE FROM queue.messages WHERE id = m.id;
        RETURN 'dead_lettered';
    END IF;

    c := idempotency.claim(m.message_id, request => m.body, scope => v_scope,
                           ttl => visibility * max_deliveries, lease => visibility);
    CASE c.outcome
        WHEN 'replay' THEN
            DELETE FROM queue.messages WHERE id = m.id;                   -- ack
            RETURN 'acked_duplicate';
        WHEN 'in_progress' THEN
            UPDATE queue.messages SET visible_at = now() + c.retry_after  -- requeue with a delay
             WHERE id = m.id;
            RETURN 'requeued';
        WHEN 'mismatch' THEN
            INSERT INTO queue.dead_letters (id, message_id, topic, body, deliveries, reason)
            VALUES (m.id, m.message_id, m.topic, m.body, m.deliveries, 'message id reused for another body');
            DELETE FROM queue.messages WHERE id = m.id;
            RETURN 'dead_lettered';
        ELSE
            NULL;
    END CASE;

    -- new: the work. "work_ms" stands in for the latency of real work (tests use it to make
    -- two deliveries of one message overlap).
    IF m.body ? 'work_ms' THEN
        PERFORM pg_sleep((m.body ->> 'work_ms')::numeric / 1000);
    END IF;
    INSERT INTO queue.points_ledger (message_id, customer_id, points, consumer)
    VALUES (m.message_id, m.body ->> 'customer', (m.body ->> 'points')::int, handle.consumer);

    PERFORM idempotency.complete(m.message_id, jsonb_build_object('credited', (m.body ->> 'points')::int),
                                 scope => v_scope);
    DELETE FROM queue.messages WHERE id = m.id;                           -- ack
    RETURN 'processed';
END
$$;

-- Batches: a consumer that takes up to n messages at a time (SQS hands out 10, Kafka hundreds)
-- claims them all with one idempotency.claim_many call instead of one claim per message, and
-- completes the processed ones with one complete_many. Each message gets the answer claim
-- would give it alone (the table above); a message id that appears twice in one batch (the
-- producer published it twice) is new at its first position and in_progress at the second,
-- which is requeued and acked as a replay on its next delivery.
CREATE OR REPLACE FUNCTION queue.receive_batch(n int DEFAULT 10, visibility interval DEFAULT '30 seconds')
RETURNS SETOF queue.messages
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE queue.messages AS m
       SET visible_at = now() + visibility, deliveries = m.deliveries + 1
     WHERE m.id IN (SELECT id FROM queue.messages
                     WHERE visible_at <= now()
                     ORDER BY visible_at, id
                     LIMIT n FOR UPDATE SKIP LOCKED)
    RETURNING m.*
$$;

-- Handles one received batch in one transaction; returns how often each outcome happened
-- ('processed', 'acked_duplicate', 'requeued', 'dead_lettered'), as queue.handle names them.
CREATE OR REPLACE FUNCTION queue.handle_batch(ms queue.messages[], consumer text DEFAULT NULL,
                                              visibility interval DEFAULT '30 seconds',
                                              max_deliveries int DEFAULT 5)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    counts   jsonb := '{}';
    v_topic  text;
    v_batch  queue.messages[];
    m        queue.messages;
    c        record;
    v_done   bigint[];
    v_keys   text[];
    v_resps  jsonb[];
    v_tokens bigint[];
    v_what   text;
BEGIN
    FOR v_topic IN SELECT DISTINCT b.topic FROM unnest(ms) AS b LOOP
        v_batch := ARRAY(SELECT ms[i] FROM generate_subscripts(ms, 1) AS i
                          WHERE (ms[i]).topic = v_topic ORDER BY i);
        v_done := '{}'; v_keys := '{}'; v_resps := '{}'; v_tokens := '{}';
        -- One call claims the whole batch; ord is the message's position in v_batch.
        FOR c IN SELECT * FROM idempotency.claim_many(
                     ARRAY(SELECT (v_batch[i]).message_id FROM generate_subscripts(v_batch, 1) AS i ORDER BY i),
                     ARRAY(SELECT (v_batch[i]).body FROM generate_subscripts(v_batch, 1) AS i ORDER BY i),
                     scope => 'queue:' || v_topic,
                     ttl => visibility * max_deliveries, lease => visibility) LOOP
            m := v_batch[c.ord];
            IF m.deliveries > max_deliveries AND c.outcome <> 'replay' THEN
                v_what := 'dead_lettered';
                INSERT INTO queue.dead_letters (id, message_id, topic, body, deliveries, reason)
                VALUES (m.id, m.message_id, m.topic, m.body, m.deliveries, 'too many deliveries');
                DELETE FROM queue.messages WHERE id = m.id;
                IF c.outcome = 'new' THEN
                    -- give the id back: a later publish of it is a new message
                    PERFORM idempotency.release(m.message_id, 'queue:' || v_topic, c.token);
                END IF;
            ELSIF c.outcome = 'replay' THEN
                v_what := 'acked_duplicate';
                DELETE FROM queue.messages WHERE id = m.id;                   -- ack
            ELSIF c.outcome = 'in_progress' THEN
                v_what := 'requeued';
                UPDATE queue.messages SET visible_at = now() + c.retry_after  -- requeue with a delay
                 WHERE id = m.id;
            ELSIF c.outcome = 'mismatch' THEN
                v_what := 'dead_lettered';
                INSERT INTO queue.dead_letters (id, message_id, topic, body, deliveries, reason)
                VALUES (m.id, m.message_id, m.topic, m.body, m.deliveries, 'message id reused for another body');
                DELETE FROM queue.messages WHERE id = m.id;
            ELSE
                v_what := 'processed';                                        -- new: the work
                INSERT INTO queue.points_ledger (message_id, customer_id, points, consumer)
                VALUES (m.message_id, m.body ->> 'customer', (m.body ->> 'points')::int, handle_batch.consumer);
                v_done := v_done || m.id;
                v_keys := v_keys || m.message_id;
                v_resps := v_resps || jsonb_build_object('credited', (m.body ->> 'points')::int);
                v_tokens := v_tokens || c.token;
            END IF;
            counts := counts || jsonb_build_object(v_what, coalesce((counts ->> v_what)::int, 0) + 1);
        END LOOP;
        -- One call completes every processed message (with its token); then ack them.
        PERFORM FROM idempotency.complete_many(v_keys, v_resps, scope => 'queue:' || v_topic,
                                                tokens => v_tokens);
        DELETE FROM queue.messages WHERE id = ANY (v_done);
    END LOOP;
    RETURN counts;
END
$$;

-- A consumer loop: receive (commit, so the message is hidden from the others), handle (commit).
-- Runs until the queue is empty or `run_for` has passed, sleeping `poll` when nothing is
-- visible; `counts` returns how often each outcome happened. Call it outside a transaction
-- block: CALL queue.consume('worker-1');  (a procedure with a SET clause may not commit, so
-- this one has none and qualifies every table and function name instead).
CREATE OR REPLACE PROCEDURE queue.consume(consumer text,
                                          INOUT counts jsonb DEFAULT '{}',
                                          visibility interval DEFAULT '30 seconds',
                                          max_deliveries int DEFAULT 5,
                                          run_for interval DEFAULT '1 minute',
                                          poll interval DEFAULT '100 milliseconds')
LANGUAGE plpgsql
AS $$
DECLARE
    m        queue.messages;
    outcome  text;
    deadline timestamptz := pg_catalog.clock_timestamp() + run_for;
BEGIN
    counts := coalesce(counts, '{}');
    WHILE pg_catalog.clock_timestamp() < deadline LOOP
        m := queue.receive(visibility);
        COMMIT;
        IF m.id IS NULL THEN
            EXIT WHEN NOT EXISTS (SELECT FROM queue.messages);
            PERFORM pg_catalog.pg_sleep_for(poll);
            CONTINUE;
        END IF;
        outcome := queue.handle(m, consumer, visibility, max_deliveries);
        COMMIT;
        counts := counts || pg_catalog.jsonb_build_object(outcome, coalesce((counts ->> outcome)::int, 0) + 1);
    END LOOP;
END
$$;
