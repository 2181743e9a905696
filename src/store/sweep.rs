//! The sweep: expired rows (and old audit rows) deleted in batches, through the statements.

use super::catalog::relation_oid;
use super::catalog::PinnedSearchPath;
use super::catalog::{check_no_inheritance_children, layout};
use super::catalog::{citus_table, sql_only};
use super::spi_failed;
use super::sql::{
    audit_plans, audit_sweep_sql, expired_since_sql, local_parts, plan, sweep_local_shards,
    sweep_sql, Plan, AUDIT, STORE,
};
use crate::encoding;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::Cell;

/// How many rows still in the table expired after `since` (and by now()): the inflow the
/// sweeper must keep up with while it yields to the application. An index range scan over the
/// newest sweep keys only ([`expired_since_sql`]): a row whose key was already at or before
/// `since` but whose later `expires_at` passed since (completed late) is not counted; the
/// estimate only sizes the next batch.
pub fn expired_since(since: pg_sys::TimestampTz) -> i64 {
    let _path = PinnedSearchPath::pin();
    let sweep_index = sweep_index_exists();
    // As a timestamp, `since` is the same instant in UTC (both count microseconds since
    // 2000-01-01 00:00 UTC), which the sweep key is.
    let type_oid = if sweep_index {
        pg_sys::TIMESTAMPOID
    } else {
        pg_sys::TIMESTAMPTZOID
    };
    let since = || {
        // SAFETY: a timestamptz (or the same value as a timestamp, see above) is passed by
        // value.
        unsafe { pgrx::datum::DatumWithOid::new(pg_sys::Datum::from(since), type_oid) }
    };
    if citus_table() {
        // Each node counts the shards it holds, as it sweeps them: a count of the distributed
        // table would reach every node, and fail (and stop this node's sweep) while one is down.
        return Spi::connect(|client| {
            let mut total = 0i64;
            for shard in local_parts(client, STORE)? {
                let n = client
                    .select(
                        expired_since_sql(&shard, sweep_index).as_str(),
                        None,
                        &[since()],
                    )?
                    .first()
                    .get_one::<i64>()?;
                total += n.unwrap_or(0);
            }
            Ok::<_, pgrx::spi::Error>(total)
        })
        .unwrap_or(0);
    }
    Spi::get_one_with_args::<i64>(&expired_since_sql(STORE, sweep_index), &[since()])
        .ok()
        .flatten()
        .unwrap_or(0)
}

/// Where the current sweep has got to in the sweep index: the greatest key a batch of this
/// sweep deleted (-infinity before the first). Each batch starts there, so the rows whose key
/// passed but whose `expires_at` did not are read once per sweep, not once per batch.
static CURSOR: crate::local::BackendLocal<Cell<pg_sys::Timestamp>> =
    crate::local::BackendLocal::new(Cell::new(DT_NOBEGIN));

/// `-infinity` as a timestamp.
const DT_NOBEGIN: pg_sys::Timestamp = i64::MIN;

/// Whether the store has the sweep index (0.4.0 on): a store not yet updated has its index on
/// `expires_at` instead (swept by the 0.3.0 statement, `sql::sweep::sweep_by_expires_at_sql`),
/// which the update drops.
fn sweep_index_exists() -> bool {
    relation_oid(c"idempotency_keys_expires_at_idx") == pg_sys::InvalidOid
}

/// Starts a sweep: its first batch begins at the start of the sweep index.
pub fn sweep_start() {
    CURSOR.with(|c| c.set(DT_NOBEGIN));
}

/// Runs batches until one comes back short: `next_batch()` gives the size of the next batch
/// (None: stop before it), `delete(size)` deletes up to that many rows and says how many (None:
/// stop), `after_full_batch()` runs after each full one (false: stop). Returns the rows
/// deleted in all. `idempotency.sweep`, `idempotency.sweep_audit` and the background sweeper
/// (keys and audit rows) all sweep through this one loop.
pub fn in_batches(
    mut next_batch: impl FnMut() -> Option<i64>,
    mut delete: impl FnMut(i64) -> Option<i64>,
    mut after_full_batch: impl FnMut() -> bool,
) -> i64 {
    let mut total = 0;
    while let Some(batch) = next_batch() {
        let Some(deleted) = delete(batch) else {
            break;
        };
        total += deleted;
        if deleted < batch || !after_full_batch() {
            break;
        }
    }
    total
}

/// Deletes up to `batch` expired rows whose scope starts with `prefix` ("": every row),
/// skipping rows other transactions hold, in sweep-key order from where the last batch of this
/// sweep ([`sweep_start`]) ended; counts them (`rows_swept`) and returns how many.
/// `idempotency.sweep` and the background sweeper sweep through here.
pub fn sweep_batch(batch: i64, prefix: &str) -> i64 {
    let deleted = delete_expired(batch, prefix);
    crate::stats::count(crate::stats::Event::Swept, deleted as u64);
    deleted
}

fn delete_expired(batch: i64, prefix: &str) -> i64 {
    let _path = PinnedSearchPath::pin();
    // Before any row is locked: a claim of a key this batch holds waits for it to end.
    super::heap::announce_sweep();
    // The statement matches rows by ctid, which a table inheriting from the store shares.
    check_no_inheritance_children(&layout());
    let from = |at: pg_sys::Timestamp| {
        // SAFETY: a timestamp is passed by value, declared as timestamp.
        unsafe { pgrx::datum::DatumWithOid::new(pg_sys::Datum::from(at), pg_sys::TIMESTAMPOID) }
    };
    if sql_only() {
        // Shard by shard (Citus) or partition by partition: one cursor cannot span them, so
        // each batch starts at the start of each part's sweep index.
        return sweep_local_shards(STORE, sweep_sql, batch, |left| {
            vec![
                left.into(),
                encoding::spi_text(prefix, "idempotency.scope_prefix"),
                from(DT_NOBEGIN),
            ]
        })
        .unwrap_or_else(|e| spi_failed("sweep", e));
    }
    if !sweep_index_exists() {
        return Spi::connect_mut(|client| {
            client
                .update(
                    plan(client, Plan::SweepByExpiresAt)?,
                    None,
                    &[
                        batch.into(),
                        encoding::spi_text(prefix, "idempotency.scope_prefix"),
                    ],
                )
                .map(|t| t.len() as i64)
        })
        .unwrap_or_else(|e| spi_failed("sweep", e));
    }
    let start = CURSOR.with(Cell::get);
    let (deleted, reached) = Spi::connect_mut(|client| {
        let mut table = client.update(
            plan(client, Plan::Sweep)?,
            None,
            &[
                batch.into(),
                encoding::spi_text(prefix, "idempotency.scope_prefix"),
                from(start),
            ],
        )?;
        let deleted = table.len() as i64;
        let mut reached = start;
        // Each row's sweep key, read at the table's position (`next` moves it).
        while table.next().is_some() {
            if let Some(at) = table.get_datum_by_ordinal(1)? {
                reached = reached.max(at.value() as pg_sys::Timestamp);
            }
        }
        Ok::<_, pgrx::spi::Error>((deleted, reached))
    })
    .unwrap_or_else(|e| spi_failed("sweep", e));
    CURSOR.with(|c| c.set(reached));
    deleted
}

/// Deletes up to `batch` audit rows older than `retention_secs` whose scope starts with
/// `prefix` ("": every row); returns how many.
pub fn sweep_audit_batch(retention_secs: f64, batch: i64, prefix: &str) -> i64 {
    let _path = PinnedSearchPath::pin();
    if sql_only() {
        // idempotency.distribute() distributes the audit table with the store; with a
        // partitioned store, the plain audit table is its own only part.
        return sweep_local_shards(AUDIT, audit_sweep_sql, batch, |left| {
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
