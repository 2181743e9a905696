//! `#[pg_test]` tests: each runs in one transaction that is rolled back, side by side with the
//! others (cargo's default test threads). Each test claims keys of its own, prefixed with a tag
//! of the test: a claim meeting another session's uncommitted claim of the same key answers
//! in_progress at once.

mod api;
