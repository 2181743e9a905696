-- Pattern: a scheduled job that must run once per slot, however many schedulers fire it
-- (two replicas of a scheduler, a cron on every app server, a catch-up run after a restart).
--
-- Key:   idempotency.cron_key(job, scheduled_at, slot): every firing anywhere in the same slot
--        derives the same key (e.g. 'daily-totals:2026-11-30T00:00:00Z/P1D'); the next slot
--        derives a new one, so the job runs again.
-- Scope: 'cron'.
-- TTL:   the slot plus the latest a late or catch-up firing can still come: two slots here. A
--        key cannot be derived again after its slot, so a longer TTL only costs rows.
--
-- One-transaction style: if the job fails, the claim rolls back with its work, and the next
-- firing in the same slot (another scheduler, or a retry) runs it. A firing that overlaps a
-- running one gets in_progress and skips. Safe to load again.
-- Tested by tests/integration/test_patterns.py.

CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE SCHEMA IF NOT EXISTS cronjobs;

CREATE TABLE IF NOT EXISTS cronjobs.sales (
    id      bigserial PRIMARY KEY,
    sold_at timestamptz NOT NULL,
    amount  numeric NOT NULL
);

-- The job's output: one row per run (no unique constraint on purpose: the extension, not this
-- table, keeps a slot from running twice).
CREATE TABLE IF NOT EXISTS cronjobs.daily_totals (
    id          bigserial PRIMARY KEY,
    slot_key    text NOT NULL,
    day         date NOT NULL,
    sales       bigint NOT NULL,
    total       numeric NOT NULL,
    computed_by text,
    computed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Fired by each scheduler with its firing time; totals the UTC day before the slot's start.
-- Returns 'ran', 'skipped: done in this slot' or 'skipped: running elsewhere'.
CREATE OR REPLACE FUNCTION cronjobs.daily_totals_job(scheduled_at timestamptz DEFAULT now(),
                                                    scheduler text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    k        text := idempotency.cron_key('daily-totals', scheduled_at, '1 day');
    c        idempotency.claim_result;
    v_day    date := (date_trunc('day', scheduled_at AT TIME ZONE 'UTC') - interval '1 day')::date;
    n        bigint;
    s        numeric;
BEGIN
    c := idempotency.claim(k, scope => 'cron', ttl => '2 days', lease => '1 hour');
    IF c.outcome = 'replay' THEN
        RETURN 'skipped: done in this slot';
    ELSIF c.outcome = 'in_progress' THEN
        RETURN 'skipped: running elsewhere';
    END IF;

    SELECT count(*), coalesce(sum(amount), 0) INTO n, s
      FROM cronjobs.sales
     WHERE sold_at >= v_day::timestamp AT TIME ZONE 'UTC'
       AND sold_at < (v_day + 1)::timestamp AT TIME ZONE 'UTC';
    INSERT INTO cronjobs.daily_totals (slot_key, day, sales, total, computed_by)
    VALUES (k, v_day, n, s, scheduler);

    PERFORM idempotency.complete(k, jsonb_build_object('day', v_day, 'sales', n, 'total', s), scope => 'cron');
    RETURN 'ran';
END
$$;
