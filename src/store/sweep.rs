//! The sweep: expired rows (and old audit rows) deleted in batches, through the statements.

use super::catalog::sql_only;
use super::catalog::PinnedSearchPath;
use super::spi_failed;
use super::sql::{audit_plans, plan, sweep_local_shards, Plan, AUDIT_SWEEP_SQL, SWEEP_SQL};
use crate::encoding;
use pgrx::pg_sys;
use pgrx::prelude::*;

/// How many rows still in the table expired after `since` (and by now()): the inflow the
/// sweeper must keep up with while it yields to the application. An index range scan over the
/// newest expiries only.
pub fn expired_since(since: pg_sys::TimestampTz) -> i64 {
    let _path = PinnedSearchPath::pin();
    // SAFETY: a timestamptz is passed by value, declared as timestamptz.
    let since = unsafe {
        pgrx::datum::DatumWithOid::new(pg_sys::Datum::from(since), pg_sys::TIMESTAMPTZOID)
    };
    Spi::get_one_with_args::<i64>(
        "SELECT pg_catalog.count(*) FROM idempotency.idempotency_keys AS k \
          WHERE k.expires_at OPERATOR(pg_catalog.>) $1 \
            AND k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()",
        &[since],
    )
    .ok()
    .flatten()
    .unwrap_or(0)
}

/// Deletes up to `batch` expired rows whose scope starts with `prefix` ("": every row),
/// skipping rows other transactions hold; returns how many.
pub fn sweep_batch(batch: i64, prefix: &str) -> i64 {
    let _path = PinnedSearchPath::pin();
    if sql_only() {
        return sweep_local_shards("idempotency.idempotency_keys", SWEEP_SQL, batch, |left| {
            vec![
                left.into(),
                encoding::spi_text(prefix, "idempotency.scope_prefix"),
            ]
        })
        .unwrap_or_else(|e| spi_failed("sweep", e));
    }
    Spi::connect_mut(|client| {
        client
            .update(
                plan(client, Plan::Sweep)?,
                None,
                &[
                    batch.into(),
                    encoding::spi_text(prefix, "idempotency.scope_prefix"),
                ],
            )
            .map(|t| t.len() as i64)
    })
    .unwrap_or_else(|e| spi_failed("sweep", e))
}

/// Deletes up to `batch` audit rows older than `retention_secs` whose scope starts with
/// `prefix` ("": every row); returns how many.
pub fn sweep_audit_batch(retention_secs: f64, batch: i64, prefix: &str) -> i64 {
    let _path = PinnedSearchPath::pin();
    if sql_only() {
        // idempotency.distribute() distributes the audit table with the store; with a
        // partitioned store, the plain audit table is its own only part.
        return sweep_local_shards("idempotency.audit", AUDIT_SWEEP_SQL, batch, |left| {
            vec![
                retention_secs.into(),
                left.into(),
                encoding::spi_text(prefix, "idempotency.scope_prefix"),
            ]
        })
        .unwrap_or_else(|e| spi_failed("sweep_audit", e));
    }
    Spi::connect_mut(|client| {
        let p = audit_plans(client)?;
        client
            .update(
                &p.sweep,
                None,
                &[
                    retention_secs.into(),
                    batch.into(),
                    encoding::spi_text(prefix, "idempotency.scope_prefix"),
                ],
            )
            .map(|t| t.len() as i64)
    })
    .unwrap_or_else(|e| spi_failed("sweep_audit", e))
}
