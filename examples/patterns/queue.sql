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
-- Safe to load again. Tested by tests/integration/test_patterns.py.

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
