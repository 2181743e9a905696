use pgrx::prelude::*;

#[pg_schema]
mod tests {
    use pgrx::prelude::*;

    /// Runs `sql` in a subtransaction: "ok", or "SQLSTATE: message" of the error it raised.
    fn try_sql(sql: &str) -> String {
        Spi::run(
            "CREATE OR REPLACE FUNCTION pg_temp.try_sql(q text) RETURNS text LANGUAGE plpgsql AS $$
             BEGIN EXECUTE q; RETURN 'ok';
             EXCEPTION WHEN OTHERS THEN RETURN SQLSTATE || ': ' || SQLERRM; END $$",
        )
        .unwrap();
        Spi::get_one_with_args::<String>("SELECT pg_temp.try_sql($1)", &[sql.into()])
            .unwrap()
            .unwrap()
    }

    /// A lock timeout that fires as the lock is granted leaves only a pending interrupt, raised
    /// at the next interrupt check: the no-wait block of claim_many answers it as a wait (its
    /// writes undone), and nothing is left to fail the caller's statement later with 55P03.
    #[pg_test]
    fn a_lock_timeout_firing_as_the_wait_ends_is_answered_as_a_wait_not_raised_later() {
        let count =
            "SELECT count(*) FROM idempotency.idempotency_keys WHERE key = 'late-timeout-k'";
        let answered = crate::store::without_waiting(|| {
            // The block's write, done (and checked) before the timer: any statement after it
            // would check for interrupts itself.
            Spi::run("SELECT idempotency.claim('late-timeout-k')").unwrap();
            assert_eq!(one::<i64>(count), Some(1));
            // SAFETY: arms the lock timeout as a lock wait does (the id is LOCK_TIMEOUT), then
            // spins without an interrupt check until its handler has marked the interrupt
            // pending: the state a wait leaves when the timer fires as the lock is granted.
            unsafe {
                crate::compat::raw::enable_timeout_after(crate::compat::raw::LOCK_TIMEOUT, 1);
                let start = std::time::Instant::now();
                while std::ptr::read_volatile(std::ptr::addr_of!(pg_sys::InterruptPending)) == 0
                    && start.elapsed() < std::time::Duration::from_secs(5)
                {
                    std::hint::spin_loop();
                }
                assert_ne!(
                    std::ptr::read_volatile(std::ptr::addr_of!(pg_sys::InterruptPending)),
                    0
                );
            }
            42
        });
        assert_eq!(answered, None);
        // Nothing pending: a check now raises nothing (before, 55P03 here).
        pgrx::check_for_interrupts!();
        assert_eq!(one::<i64>(count), Some(0));
    }

    fn one<T: FromDatum + IntoDatum>(sql: &str) -> Option<T> {
        Spi::get_one::<T>(sql).unwrap()
    }

    fn text(sql: &str) -> String {
        one::<String>(sql).unwrap_or_else(|| "<NULL>".to_string())
    }

    fn rows() -> i64 {
        one::<i64>("SELECT count(*) FROM idempotency.idempotency_keys").unwrap()
    }

    /// The claim's fields as text, for compact assertions.
    fn claim(args: &str) -> (String, Option<i64>) {
        let outcome = text(&format!("SELECT (idempotency.claim({args})).outcome::text"));
        (outcome, None)
    }

    fn claim_row(args: &str) -> (String, Option<i64>, String, String, String) {
        Spi::connect(|c| {
            let t = c
                .select(
                    &format!(
                        "SELECT outcome::text, token, coalesce(response::text, '<NULL>'),
                                coalesce(response_status::text, '<NULL>'),
                                coalesce(recovery_point, '<NULL>')
                           FROM idempotency.claim({args})"
                    ),
                    None,
                    &[],
                )
                .unwrap();
            let r = t.first();
            (
                r.get::<String>(1).unwrap().unwrap(),
                r.get::<i64>(2).unwrap(),
                r.get::<String>(3).unwrap().unwrap(),
                r.get::<String>(4).unwrap().unwrap(),
                r.get::<String>(5).unwrap().unwrap(),
            )
        })
    }

    fn expire_lease(key: &str) {
        Spi::run(&format!(
            "UPDATE idempotency.idempotency_keys SET locked_until = now() - interval '1 second' WHERE key = '{key}'"
        ))
        .unwrap();
    }

    fn expire_row(key: &str) {
        Spi::run(&format!(
            "UPDATE idempotency.idempotency_keys SET created_at = now() - ttl - interval '1 second', expires_at = now() - interval '1 second' WHERE key = '{key}'"
        ))
        .unwrap();
    }

    #[pg_test]
    fn absent_key_is_new_then_completed_key_replays() {
        let (o, token, resp, _, _) = claim_row("'replays-order-1', '{\"amount\": 100}'");
        assert_eq!(o, "new");
        assert!(token.is_some());
        assert_eq!(resp, "<NULL>");
        assert_eq!(
            text("SELECT status::text || ' ' || (locked_until = now() + interval '5 minutes')::text || ' ' || (expires_at = now() + interval '24 hours')::text FROM idempotency.idempotency_keys WHERE key = 'replays-order-1'"),
            "in_progress true true"
        );
        let exp = text(
            "SELECT idempotency.complete('replays-order-1', '{\"id\": 7, \"price\": 1.50}', 201)::text",
        );
        assert_eq!(exp, text("SELECT (now() + interval '24 hours')::text"));
        // Same request spelt differently: replay of the stored response, untouched.
        let (o2, token2, resp2, status2, _) = claim_row("'replays-order-1', '{\"amount\": 100.0}'");
        assert_eq!(o2, "replay");
        assert_eq!(token2, token);
        assert_eq!(resp2, "{\"id\": 7, \"price\": 1.50}");
        assert_eq!(status2, "201");
        assert_eq!(
            text("SELECT status::text || ' ' || (locked_until IS NULL)::text FROM idempotency.idempotency_keys WHERE key = 'replays-order-1'"),
            "completed true"
        );
    }

    #[pg_test]
    fn different_request_is_a_mismatch_and_writes_nothing() {
        assert_eq!(claim("'mismatch-k', '{\"a\": 1}'").0, "new");
        let before = text("SELECT row(k.*)::text FROM idempotency.idempotency_keys k");
        // in progress, different request
        assert_eq!(claim("'mismatch-k', '{\"a\": 2}'").0, "mismatch");
        Spi::run("SELECT idempotency.complete('mismatch-k', '{}')").unwrap();
        assert_eq!(claim("'mismatch-k', '{\"a\": 2}'").0, "mismatch");
        assert_eq!(claim("'mismatch-k', '{\"a\": 1}'").0, "replay");
        let after = text("SELECT token::text FROM idempotency.idempotency_keys");
        assert!(before.contains(&after), "token unchanged");
        assert_eq!(rows(), 1);
    }

    #[pg_test]
    fn null_request_skips_the_comparison() {
        assert_eq!(claim("'null-request-k'").0, "new");
        assert_eq!(
            text("SELECT coalesce(request_hash::text, 'none') FROM idempotency.idempotency_keys"),
            "none"
        );
        Spi::run("SELECT idempotency.complete('null-request-k', '{\"ok\": true}')").unwrap();
        // A row stored without a hash matches any request...
        assert_eq!(claim("'null-request-k', '{\"x\": 1}'").0, "replay");
        // ...and a claim without a request matches any row.
        assert_eq!(claim("'null-request-k2', '{\"x\": 1}'").0, "new");
        Spi::run("SELECT idempotency.complete('null-request-k2', '{}')").unwrap();
        assert_eq!(claim("'null-request-k2'").0, "replay");
    }

    #[pg_test]
    fn running_lease_answers_in_progress_with_retry_after() {
        assert_eq!(claim("'lease-k', lease => '30 seconds'").0, "new");
        assert_eq!(
            text("SELECT outcome::text || ' ' || retry_after::text || ' ' || (token IS NULL)::text FROM idempotency.claim('lease-k')"),
            "in_progress 00:00:30 true"
        );
        // A lease of under a second still asks for at least one second.
        assert_eq!(claim("'lease-short', lease => '10 milliseconds'").0, "new");
        Spi::run("UPDATE idempotency.idempotency_keys SET locked_until = now() + interval '1 millisecond' WHERE key = 'lease-short'").unwrap();
        assert_eq!(
            text("SELECT retry_after::text FROM idempotency.claim('lease-short')"),
            "00:00:01"
        );
    }

    #[pg_test]
    fn lease_takeover_has_a_larger_token_and_returns_the_recovery_point() {
        let (o, t1, _, _, _) = claim_row("'takeover-wf', '{\"step\": 1}', lease => '1 minute'");
        assert_eq!(o, "new");
        Spi::run(&format!(
            "SELECT idempotency.checkpoint('takeover-wf', 'charged', token => {})",
            t1.unwrap()
        ))
        .unwrap();
        expire_lease("takeover-wf");
        let (o2, t2, _, _, rp) = claim_row("'takeover-wf', '{\"step\": 1}', lease => '2 minutes'");
        assert_eq!(o2, "new");
        assert!(t2.unwrap() > t1.unwrap());
        assert_eq!(rp, "charged");
        assert_eq!(
            text("SELECT (locked_until = now() + interval '2 minutes')::text FROM idempotency.idempotency_keys"),
            "true"
        );
        // The fenced-off worker can no longer complete, checkpoint or release.
        let stale = t1.unwrap();
        assert!(try_sql(&format!(
            "SELECT idempotency.complete('takeover-wf', '{{}}', token => {stale})"
        ))
        .starts_with("IK003"));
        assert!(try_sql(&format!(
            "SELECT idempotency.checkpoint('takeover-wf', 'x', token => {stale})"
        ))
        .starts_with("IK003"));
        assert_eq!(
            text(&format!(
                "SELECT idempotency.release('takeover-wf', token => {stale})::text"
            )),
            "false"
        );
        assert_eq!(rows(), 1);
        // The new holder can.
        assert_eq!(
            text(&format!("SELECT (idempotency.complete('takeover-wf', '{{\"done\": true}}', token => {}) IS NOT NULL)::text", t2.unwrap())),
            "true"
        );
    }

    #[pg_test]
    fn takeover_with_a_different_request_is_a_mismatch() {
        assert_eq!(claim("'takeover-mismatch-wf', '{\"a\": 1}'").0, "new");
        expire_lease("takeover-mismatch-wf");
        assert_eq!(claim("'takeover-mismatch-wf', '{\"a\": 2}'").0, "mismatch");
    }

    #[pg_test]
    fn expired_rows_count_as_absent_even_unswept() {
        let (_, t1, _, _, _) = claim_row("'expired-k', '{\"a\": 1}', ttl => '1 hour'");
        Spi::run("SELECT idempotency.complete('expired-k', '{\"v\": 1}')").unwrap();
        assert_eq!(text("SELECT (expires_at = now() + interval '1 hour')::text FROM idempotency.idempotency_keys"), "true");
        expire_row("expired-k");
        assert_eq!(
            text("SELECT coalesce(idempotency.lookup('expired-k')::text, 'NULL')"),
            "NULL"
        );
        // A different request is not a mismatch: the old key is gone.
        let (o, t2, resp, _, rp) = claim_row("'expired-k', '{\"a\": 2}'");
        assert_eq!(
            (o.as_str(), resp.as_str(), rp.as_str()),
            ("new", "<NULL>", "<NULL>")
        );
        assert!(t2.unwrap() > t1.unwrap());
        assert_eq!(rows(), 1);
        // An expired in-progress claim can be neither completed nor checkpointed.
        expire_row("expired-k");
        assert!(try_sql("SELECT idempotency.complete('expired-k', '{}')").starts_with("IK001"));
        assert!(try_sql("SELECT idempotency.checkpoint('expired-k', 'x')").starts_with("IK001"));
        assert_eq!(
            text("SELECT idempotency.release('expired-k')::text"),
            "false"
        );
    }

    #[pg_test]
    fn complete_and_checkpoint_errors_have_their_own_sqlstates() {
        let e = try_sql("SELECT idempotency.complete('errors-nope', '{}')");
        assert!(e.starts_with("IK001") && e.contains("no live claim"), "{e}");
        assert!(try_sql("SELECT idempotency.checkpoint('errors-nope', 'x')").starts_with("IK001"));
        claim("'errors-k'");
        Spi::run("SELECT idempotency.complete('errors-k', '{}')").unwrap();
        let e = try_sql("SELECT idempotency.complete('errors-k', '{}')");
        assert!(
            e.starts_with("IK002") && e.contains("already completed"),
            "{e}"
        );
        assert!(try_sql("SELECT idempotency.checkpoint('errors-k', 'x')").starts_with("IK002"));
        claim("'errors-j'");
        let e = try_sql("SELECT idempotency.complete('errors-j', '{}', token => -5)");
        assert!(e.starts_with("IK003") && e.contains("stale"), "{e}");
        assert_eq!(
            text("SELECT status::text FROM idempotency.idempotency_keys WHERE key = 'errors-j'"),
            "in_progress"
        );
    }

    #[pg_test]
    fn complete_keeps_the_claim_ttl_or_takes_a_new_one() {
        claim("'complete-ttl-a', ttl => '2 hours'");
        assert_eq!(
            text("SELECT (idempotency.complete('complete-ttl-a', '{}') = now() + interval '2 hours')::text"),
            "true"
        );
        claim("'complete-ttl-b', ttl => '2 hours'");
        assert_eq!(
            text("SELECT (idempotency.complete('complete-ttl-b', '{}', ttl => '7 days') = now() + interval '7 days')::text"),
            "true"
        );
        assert_eq!(
            text("SELECT (response IS NULL)::text FROM idempotency.claim('complete-ttl-c')"),
            "true"
        );
        Spi::run("SELECT idempotency.complete('complete-ttl-c', NULL, 204)").unwrap();
        assert_eq!(
            text("SELECT outcome::text || ' ' || response_status FROM idempotency.claim('complete-ttl-c')"),
            "replay 204"
        );
    }

    #[pg_test]
    fn release_frees_an_in_progress_key_but_never_a_completed_one() {
        let (_, t1, _, _, _) = claim_row("'release-k'");
        assert_eq!(
            text("SELECT idempotency.release('release-k', token => 0)::text"),
            "false"
        );
        assert_eq!(
            text(&format!(
                "SELECT idempotency.release('release-k', token => {})::text",
                t1.unwrap()
            )),
            "true"
        );
        assert_eq!(rows(), 0);
        let (o, t2, _, _, _) = claim_row("'release-k'");
        assert_eq!(o, "new");
        assert!(t2.unwrap() > t1.unwrap(), "tokens are never reused");
        Spi::run("SELECT idempotency.complete('release-k', '{}')").unwrap();
        assert_eq!(
            text("SELECT idempotency.release('release-k')::text"),
            "false"
        );
        assert_eq!(rows(), 1);
        assert_eq!(
            text("SELECT idempotency.release('release-absent')::text"),
            "false"
        );
    }

    #[pg_test]
    fn forget_deletes_whatever_the_state() {
        claim("'forget-a'");
        claim("'forget-b'");
        Spi::run("SELECT idempotency.complete('forget-b', '{}')").unwrap();
        assert_eq!(text("SELECT idempotency.forget('forget-a')::text"), "true");
        assert_eq!(text("SELECT idempotency.forget('forget-b')::text"), "true");
        assert_eq!(text("SELECT idempotency.forget('forget-b')::text"), "false");
        assert_eq!(rows(), 0);
        assert_eq!(claim("'forget-b'").0, "new");
    }

    #[pg_test]
    fn lookup_returns_the_live_row_of_its_scope() {
        claim("'lookup-k', '{\"a\": 1}', scope => 'tenant-1'");
        assert_eq!(
            text("SELECT (l).status::text || ' ' || (l).scope || ' ' || length((l).request_hash) FROM idempotency.lookup('lookup-k', 'tenant-1') l"),
            "in_progress tenant-1 32"
        );
        assert_eq!(
            text("SELECT coalesce(idempotency.lookup('lookup-k')::text, 'NULL')"),
            "NULL"
        );
        assert_eq!(
            text("SELECT coalesce(idempotency.lookup('lookup-k', 'tenant-2')::text, 'NULL')"),
            "NULL"
        );
    }

    #[pg_test]
    fn scopes_keep_keys_apart() {
        assert_eq!(claim("'scopes-k', '{\"a\": 1}', scope => 'A'").0, "new");
        assert_eq!(claim("'scopes-k', '{\"a\": 2}', scope => 'B'").0, "new");
        assert_eq!(claim("'scopes-k', '{\"a\": 3}'").0, "new");
        assert_eq!(rows(), 3);
    }

    #[pg_test]
    fn one_transaction_can_claim_many_keys() {
        assert_eq!(
            text("SELECT count(*) FILTER (WHERE (idempotency.claim('bulk-' || i)).outcome = 'new')::text FROM generate_series(1, 5000) i"),
            "5000"
        );
        assert_eq!(rows(), 5000);
    }

    #[pg_test]
    fn settings_give_the_defaults() {
        assert_eq!(text("SHOW idempotency.default_ttl"), "1d");
        assert_eq!(text("SHOW idempotency.default_lease"), "5min");
        assert_eq!(text("SHOW idempotency.claim_wait"), "0");
        assert_eq!(text("SHOW idempotency.sweep_interval"), "1min");
        assert_eq!(text("SHOW idempotency.sweep_batch_size"), "10000");
        Spi::run("SET LOCAL idempotency.default_ttl = '1h'").unwrap();
        Spi::run("SET LOCAL idempotency.default_lease = '10s'").unwrap();
        claim("'settings-k'");
        assert_eq!(
            text("SELECT (expires_at = now() + interval '1 hour' AND locked_until = now() + interval '10 seconds')::text FROM idempotency.idempotency_keys"),
            "true"
        );
    }

    #[pg_test]
    fn sweep_deletes_expired_rows_only() {
        Spi::run("SELECT idempotency.claim('sweep-live-' || i) FROM generate_series(1, 10) i")
            .unwrap();
        Spi::run("SELECT idempotency.claim('sweep-old-' || i) FROM generate_series(1, 25) i")
            .unwrap();
        // Claimed a TTL and a minute ago: the sweep index is on created_at + ttl.
        Spi::run("UPDATE idempotency.idempotency_keys SET created_at = now() - ttl - interval '1 minute', expires_at = now() - interval '1 minute' WHERE key LIKE 'sweep-old-%'").unwrap();
        assert_eq!(
            one::<i64>("SELECT idempotency.sweep(batch_size => 7)"),
            Some(25)
        );
        assert_eq!(rows(), 10);
        assert_eq!(one::<i64>("SELECT idempotency.sweep()"), Some(0));
        assert!(try_sql("SELECT idempotency.sweep(0)").starts_with("22023"));
    }

    #[pg_test]
    fn bad_arguments_name_the_argument_and_write_nothing() {
        let cases = [
            (
                "SELECT idempotency.claim(NULL)",
                "22004: key must not be NULL",
            ),
            (
                "SELECT idempotency.claim('')",
                "22023: key must not be empty",
            ),
            (
                "SELECT idempotency.claim(repeat('x', 256))",
                "22023: key must be at most 255 characters",
            ),
            (
                "SELECT idempotency.claim('bad-args-k', scope => NULL)",
                "22004: scope must not be NULL",
            ),
            (
                "SELECT idempotency.claim('bad-args-k', scope => repeat('s', 256))",
                "22023: scope must be at most 255",
            ),
            (
                "SELECT idempotency.claim('bad-args-k', ttl => '0 seconds')",
                "22023: ttl must be a positive interval",
            ),
            (
                "SELECT idempotency.claim('bad-args-k', ttl => '-1 hour')",
                "22023: ttl must be a positive interval",
            ),
            (
                "SELECT idempotency.claim('bad-args-k', ttl => '11 years')",
                "22023: ttl must be at most 10 years",
            ),
            (
                "SELECT idempotency.claim('bad-args-k', lease => '0')",
                "22023: lease must be a positive interval",
            ),
            (
                "SELECT idempotency.claim('bad-args-k', lease => '-5 minutes')",
                "22023: lease must be a positive interval",
            ),
            (
                "SELECT idempotency.claim('bad-args-k', ttl => '1 minute', lease => '2 minutes')",
                "22023: lease (\"00:02:00\") must not be longer than ttl (\"00:01:00\"): the lease would outlive the key",
            ),
            (
                "SELECT idempotency.complete(NULL, '{}')",
                "22004: key must not be NULL",
            ),
            (
                "SELECT idempotency.complete('bad-args-k', '{}', 99)",
                "22023: response_status must be between 100 and 599",
            ),
            (
                "SELECT idempotency.complete('bad-args-k', '{}', 600)",
                "22023: response_status must be between 100 and 599",
            ),
            (
                "SELECT idempotency.complete('bad-args-k', '{}', NULL)",
                "22004: response_status must not be NULL",
            ),
            (
                "SELECT idempotency.complete('bad-args-k', '{}', ttl => '-1 day')",
                "22023: ttl must be a positive interval",
            ),
            (
                "SELECT idempotency.release('')",
                "22023: key must not be empty",
            ),
            (
                "SELECT idempotency.forget(NULL)",
                "22004: key must not be NULL",
            ),
            (
                "SELECT idempotency.lookup(repeat('x', 300))",
                "22023: key must be at most 255",
            ),
            (
                "SELECT idempotency.checkpoint(NULL, 'x')",
                "22004: key must not be NULL",
            ),
            (
                "SELECT idempotency.canonical_json('1', 'fast')",
                "22023: numbers must be 'exact' or 'rfc8785'",
            ),
            (
                "SELECT idempotency.canonical_json('1', NULL)",
                "22004: numbers must not be NULL",
            ),
            (
                "SELECT idempotency.canonical_json('[1e400]', 'rfc8785')",
                "22003: doc: number 1",
            ),
            (
                "SELECT idempotency.canonical_hash('{}', NULL)",
                "22004: exclude must not be NULL",
            ),
            (
                "SELECT idempotency.canonical_hash('{}', '{/a~2}')",
                "22P02: exclude:",
            ),
            (
                "SELECT idempotency.derive_key('p', 'a:b')",
                "22023: step must not contain ':'",
            ),
            (
                "SELECT idempotency.cron_key('j', now(), '0')",
                "22023: slot must be a positive interval",
            ),
            (
                "SELECT idempotency.cron_key('j', 'infinity', '1 hour')",
                "22023: scheduled_at must be finite",
            ),
            (
                "SELECT idempotency.request_fingerprint('', '/')",
                "22023: method must be",
            ),
            (
                "SELECT idempotency.request_fingerprint('GET', '/', '[1]')",
                "22023: query must be a JSON object",
            ),
        ];
        for (sql, expected) in cases {
            let got = try_sql(sql);
            assert!(
                got.starts_with(expected),
                "{sql}: got {got:?}, expected {expected:?}"
            );
        }
        assert_eq!(rows(), 0);
    }

    #[pg_test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let ok = format!(
            "SELECT length(idempotency.canonical_json('{}{}'))",
            "[".repeat(1000),
            "]".repeat(1000)
        );
        assert_eq!(one::<i32>(&ok), Some(2000));
        let deep = format!(
            "SELECT idempotency.canonical_json('{}{}')",
            "[".repeat(2000),
            "]".repeat(2000)
        );
        assert!(
            try_sql(&deep).starts_with("54001: doc: document is nested deeper than 1000 levels")
        );
        let deep_claim = format!(
            "SELECT idempotency.claim('deep-k', '{}1{}')",
            "{\"a\":".repeat(1500),
            "}".repeat(1500)
        );
        assert!(try_sql(&deep_claim).starts_with("54001: request:"));
        // 10,000 levels: PostgreSQL's own parser or ours refuses it; the backend survives.
        let very = format!(
            "SELECT idempotency.canonical_hash('{}{}')",
            "[".repeat(10_000),
            "]".repeat(10_000)
        );
        assert!(try_sql(&very).starts_with("54001"));
        assert_eq!(rows(), 0);
    }

    #[pg_test]
    fn canonical_json_follows_rfc8785() {
        assert_eq!(
            text(r#"SELECT idempotency.canonical_json('{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001], "string": "\u20ac$\u000F\u000aA''\u0042\u0022\u005c\\\"\/", "literals": [null, true, false]}', 'rfc8785')"#),
            "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\"string\":\"€$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}"
        );
        assert_eq!(
            text(
                r#"SELECT encode(sha256(convert_to(idempotency.canonical_json('{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001], "string": "\u20ac$\u000F\u000aA''\u0042\u0022\u005c\\\"\/", "literals": [null, true, false]}', 'rfc8785'), 'UTF8')), 'hex')"#
            ),
            "2d5e01a318d0f0879ab568c4be289c8b1f64ef8921a53c6277d5e069978baacb"
        );
        // Exact mode keeps what doubles cannot hold.
        assert_eq!(
            text("SELECT idempotency.canonical_json('[9007199254740993, 1e400, 1e-400, -0, 1.0, 100e-2, 0.10000000000000001]')"),
            "[9007199254740993,1e+400,1e-400,0,1,1,0.10000000000000001]"
        );
        assert_eq!(
            text("SELECT idempotency.canonical_json('[9007199254740993, 1e-400]', 'rfc8785')"),
            "[9007199254740992,0]"
        );
        // UTF-16 order: a supplementary character sorts before U+FB33.
        assert_eq!(
            text(
                r#"SELECT idempotency.canonical_json('{"\ufb33": 1, "\ud83d\ude00": 2, "\r": 3}')"#
            ),
            "{\"\\r\":3,\"😀\":2,\"\u{fb33}\":1}"
        );
        assert_eq!(text("SELECT idempotency.canonical_json('\"x\"')"), "\"x\"");
        assert_eq!(text("SELECT idempotency.canonical_json('12.50')"), "12.5");
        assert_eq!(
            text("SELECT coalesce(idempotency.canonical_json(NULL), 'NULL')"),
            "NULL"
        );
    }

    #[pg_test]
    fn canonical_hash_is_sha256_of_the_exact_form_minus_exclusions() {
        assert_eq!(
            text("SELECT (idempotency.canonical_hash('{\"b\": 1.0, \"a\": [true]}') = sha256(convert_to('{\"a\":[true],\"b\":1}', 'UTF8')))::text"),
            "true"
        );
        assert_eq!(
            text("SELECT (idempotency.canonical_hash('{\"a\": 1, \"ts\": 5, \"n\": {\"ts\": 6, \"x\": 1}}', '{ts,/n/ts}') = idempotency.canonical_hash('{\"a\": 1, \"n\": {\"x\": 1}}'))::text"),
            "true"
        );
        assert_eq!(
            text("SELECT length(idempotency.canonical_hash('[]'))::text"),
            "32"
        );
        // claim hashes request with canonical_hash.
        claim("'hash-k', '{\"z\": 1, \"a\": 2}'");
        assert_eq!(
            text("SELECT (request_hash = idempotency.canonical_hash('{\"a\":2,\"z\":1.00}'))::text FROM idempotency.idempotency_keys"),
            "true"
        );
    }

    #[pg_test]
    fn derived_and_cron_keys_are_stable() {
        let k = text("SELECT idempotency.derive_key('order-42', 'charge', '{\"amount\": 100, \"currency\": \"EUR\"}')");
        assert!(
            k.starts_with("order-42:charge:") && k.len() == "order-42:charge:".len() + 16,
            "{k}"
        );
        assert_eq!(
            k,
            text("SELECT idempotency.derive_key(parent => 'order-42', step => 'charge', params => '{\"currency\": \"EUR\", \"amount\": 100.0}')")
        );
        assert_eq!(
            text("SELECT idempotency.derive_key('order-42', 'email')"),
            "order-42:email"
        );
        assert_eq!(
            text("SELECT idempotency.cron_key('nightly', '2026-11-30 01:59:30+02', '1 hour')"),
            "nightly:2026-11-29T23:00:00Z/PT3600S"
        );
        assert_eq!(
            text("SELECT idempotency.cron_key('nightly', '2026-11-29 23:00:00+00', '1 hour')"),
            text("SELECT idempotency.cron_key('nightly', '2026-11-29 23:59:59.999+00', '1 hour')")
        );
        assert_eq!(
            text("SELECT idempotency.cron_key('m', '2026-11-30 12:00+00', '1 month')"),
            "m:2026-11-01T00:00:00Z/P1M"
        );
    }

    #[pg_test]
    fn request_fingerprint_is_canonical() {
        assert_eq!(
            text("SELECT (idempotency.request_fingerprint('post', '/orders', '{\"b\": \"2\", \"a\": \"1\"}', '{\"x\": 1.0}') = idempotency.request_fingerprint('POST', '/orders', '{\"a\": \"1\", \"b\": \"2\"}', '{\"x\": 1}'))::text"),
            "true"
        );
        assert_eq!(
            text("SELECT (idempotency.request_fingerprint('POST', '/orders') = idempotency.canonical_hash('{\"method\": \"POST\", \"path\": \"/orders\", \"query\": {}, \"body\": null}'))::text"),
            "true"
        );
        assert_eq!(
            text("SELECT (idempotency.request_fingerprint('POST', '/orders') = idempotency.request_fingerprint('POST', '/refunds'))::text"),
            "false"
        );
    }

    #[pg_test]
    fn dump_keeps_the_rows() {
        // The keys, their token sequence, the key storage mode, the audit trail and the
        // settings that bind roles are dumped; the signing secrets deliberately are not.
        assert_eq!(
            text("SELECT string_agg(c::regclass::text, ' ' ORDER BY c::regclass::text) FROM pg_extension e, unnest(e.extconfig) c WHERE e.extname = 'idempotency'"),
            "idempotency.audit idempotency.audit_id_seq idempotency.config idempotency.idempotency_keys idempotency.role_settings idempotency.token_seq"
        );
    }

    #[pg_test]
    fn numbers_read_from_the_stored_numeric_match_numeric_out() {
        // canonical_json reads each number from jsonb's stored numeric (base-10000 digits); the
        // expected text is PostgreSQL's own numeric output laid out by es_layout. Random values
        // over 80 orders of magnitude and both signs, and the edges of the digit grouping.
        Spi::run("CREATE TEMP TABLE nums (i serial, n numeric)").unwrap();
        Spi::run(
            "INSERT INTO nums (n) SELECT round(((random() - 0.5) * 10 ^ (random() * 80 - 40))::numeric, (random() * 60)::int)
               FROM generate_series(1, 4000)",
        )
        .unwrap();
        Spi::run(
            "INSERT INTO nums (n) VALUES (0), (0.000), (-0.0), (1), (-1), (9999), (10000), (10001), (99990000),
               (100000000), (0.0001), (0.00010), (0.001), (1e-20), (-1e20), (1e100), (1.5e-100),
               (123456789012345678901234567890.123456789), (0.1), (1.10), (12345.6789), (-0.00001234),
               (1e1000), (1e-1000), (99999999999999999999999999999999999999999999999999999999999)",
        )
        .unwrap();
        let got = text("SELECT idempotency.canonical_json(jsonb_agg(n ORDER BY i)) FROM nums");
        let got: Vec<&str> = got
            .trim_start_matches('[')
            .trim_end_matches(']')
            .split(',')
            .collect();
        let want: Vec<String> = Spi::connect(|c| {
            c.select("SELECT n::text FROM nums ORDER BY i", None, &[])
                .unwrap()
                .map(|r| crate::canonical::es_layout(&r.get::<String>(1).unwrap().unwrap()))
                .collect()
        });
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g, w);
        }
        assert!(want.iter().any(|w| w.contains("e-")) && want.iter().any(|w| w.contains("e+")));
    }
}
