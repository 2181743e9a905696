//! `#[pg_test]` tests: each runs in one transaction that is rolled back.

mod api;
