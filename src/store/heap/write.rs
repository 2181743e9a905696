//! The direct writes: a fresh claim's insert and a completion's update, straight into the heap
//! and its indexes, as the INSERT and UPDATE statements would make them.

use super::super::catalog::{key_label, Column, DirectLayout};
use super::super::{
    internal, table_changed, ClaimRequest, ClaimResult, CompleteRequest, Completed, Outcome,
    MAX_ROUNDS,
};
use super::{newest_version, nextval_oid, timestamptz_pl_interval, transaction_start, Newest};
use crate::encoding;
use crate::error::raise;
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;

/// Inserts a fresh claim (absent key, under its insert lock, READ COMMITTED) straight into the
/// heap and its indexes, as `insert_sql` (without `ON CONFLICT`) would, without planning or executing a
/// statement: the row is built here, so the table's CHECK constraints hold by construction,
/// and [`direct_layout`] sends anything else (triggers, extra columns or constraints)
/// through SQL. The primary key is still checked by the index (a row inserted some other way
/// meanwhile is a unique violation, as with the INSERT).
pub(crate) fn insert_direct(d: &DirectLayout, req: &ClaimRequest<'_>) -> ClaimResult {
    let fresh = insert_direct_batch(d, req.scope, &[(req.key, req.hash)], req.ttl, req.lease);
    fresh
        .into_iter()
        .next()
        .unwrap_or_else(|| internal("a fresh claim was not inserted"))
}

/// [`insert_direct`] for the fresh keys of a `claim_many` chunk (each absent, under its insert
/// lock, READ COMMITTED): one `table_multi_insert` for all the rows, as COPY writes them (one
/// WAL record per heap page rather than one per row), then each row's index entries; one
/// answer per key, in order. The unique index checks every key, so a key that is not absent
/// after all is a unique violation (or a wait for the transaction writing it), for the caller
/// to catch.
/// As fast as a bare multi-row `INSERT` of the same keys, where one `INSERT ... SELECT FROM
/// unnest(...)` through SPI is a quarter slower (docs/benchmarks.md, "How the optimisations
/// were measured").
pub(crate) fn insert_direct_batch(
    d: &DirectLayout,
    scope: &str,
    keys: &[(&str, Option<[u8; 32]>)],
    ttl: Interval,
    lease: Interval,
) -> Vec<ClaimResult> {
    use pgrx::IntoDatum;
    if keys.is_empty() {
        return Vec::new();
    }
    // SAFETY: `d` is the layout of the table as the catalog describes it under the write lock
    // (`direct_layout_for_write`), and the open relation is checked against it (attribute
    // count, no trigger) before anything is written: every position is a column of the type
    // whose datum is built for it, so `heap_form_tuple` gets a row matching the descriptor.
    // Every call goes through pgrx's boundary; the relation is closed (lock kept) on each path.
    // The slots are created here, hold tuples allocated in the current memory context, and are
    // dropped after their index entries are made.
    unsafe {
        let rel = pg_sys::table_open(d.relid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE);
        let desc = (*rel).rd_att;
        if (*desc).natts as usize != d.natts || !(*rel).trigdesc.is_null() {
            // Changed since the layout was read (its invalidation comes with the lock): this
            // transaction retries and the next claim reads the table afresh.
            pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
            table_changed("claim");
        }
        let now = pg_sys::Datum::from(transaction_start());
        let plus = |interval: pg_sys::Datum| {
            pg_sys::DirectFunctionCall2Coll(
                Some(timestamptz_pl_interval),
                pg_sys::InvalidOid,
                now,
                interval,
            )
        };
        let (Some(lease), Some(ttl)) = (lease.into_datum(), ttl.into_datum()) else {
            pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
            internal("a claim argument could not be converted");
        };
        // The same for every row of the call: the transaction's start, so one instant.
        let scope = encoding::text_datum(scope, "scope");
        let expires_at = plus(ttl);
        let locked_until = plus(lease);
        let mut slots = Vec::with_capacity(keys.len());
        let mut results = Vec::with_capacity(keys.len());
        for &(key, hash) in keys {
            let mut values = vec![pg_sys::Datum::from(0usize); d.natts];
            let mut nulls = vec![true; d.natts];
            let mut set = |i: usize, v: pg_sys::Datum| {
                values[i] = v;
                nulls[i] = false;
            };
            let token = pg_sys::DirectFunctionCall1Coll(
                Some(nextval_oid),
                pg_sys::InvalidOid,
                pg_sys::Datum::from(d.token_seq),
            );
            set(d[Column::Scope], scope);
            set(d[Column::Key], encoding::text_datum(key, "key"));
            if let Some(hash) = hash.and_then(|h| h.to_vec().into_datum()) {
                set(d[Column::RequestHash], hash);
            }
            set(d[Column::Status], d.in_progress);
            set(d[Column::Token], token);
            set(d[Column::CreatedAt], now);
            set(d[Column::LockedUntil], locked_until);
            set(d[Column::ExpiresAt], expires_at);
            set(d[Column::Ttl], ttl);
            let tuple = pg_sys::heap_form_tuple(desc, values.as_mut_ptr(), nulls.as_mut_ptr());
            let slot = pg_sys::MakeSingleTupleTableSlot(desc, &pg_sys::TTSOpsHeapTuple);
            pg_sys::ExecStoreHeapTuple(tuple, slot, false);
            slots.push(slot);
            let mut result = ClaimResult::new(Outcome::New);
            result.token = Some(token.value() as i64);
            result.expires_at = TimestampWithTimeZone::from_datum(expires_at, false);
            results.push(result);
        }
        let command = pg_sys::GetCurrentCommandId(true);
        if let [slot] = slots[..] {
            pg_sys::table_tuple_insert(rel, slot, command, 0, std::ptr::null_mut());
        } else {
            pg_sys::table_multi_insert(
                rel,
                slots.as_mut_ptr(),
                slots.len() as i32,
                command,
                0,
                std::ptr::null_mut(),
            );
        }
        insert_index_entries(rel, &slots, false);
        for slot in slots {
            pg_sys::ExecDropSingleTupleTableSlot(slot);
        }
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        // What later statements of this transaction (complete, a second claim) must see.
        pg_sys::CommandCounterIncrement();
        results
    }
}

/// [`complete_sql`]'s UPDATE, done directly on the row (READ COMMITTED, table as the extension
/// made it): finds the newest version through the primary key, waits for a transaction that
/// is changing it and looks again (as the UPDATE re-checks a concurrently updated row), checks
/// that it is a live in-progress claim with the given token, and updates it in place
/// (heap_update, HOT when no indexed column changes), adding index entries only when it was
/// not HOT.
pub(crate) fn complete_direct(d: &DirectLayout, req: &CompleteRequest<'_>) -> Option<Completed> {
    use pgrx::IntoDatum;
    let (scope, key) = (
        encoding::server_bytes(req.scope, "scope"),
        encoding::server_bytes(req.key, "key"),
    );
    // SAFETY: as in `insert_direct`: the layout matches the open, write-locked relation
    // (checked again here), so the deformed old row and the formed new one have its columns
    // and types. The old tuple is a palloc'd copy; the update is on its TID, and a concurrent
    // change of that version is reported by `table_tuple_update`, not assumed away.
    unsafe {
        // What this transaction's earlier statements (the claim) wrote must be visible.
        pg_sys::CommandCounterIncrement();
        let lock = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;
        let rel = pg_sys::table_open(d.relid, lock);
        let index = pg_sys::index_open(d.idxid, lock);
        let desc = (*rel).rd_att;
        let close = || {
            pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
            pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        };
        if (*desc).natts as usize != d.natts || !(*rel).trigdesc.is_null() {
            close();
            table_changed("completion");
        }
        let now = transaction_start();
        for _ in 0..MAX_ROUNDS {
            let old = match newest_version(rel, index, &scope, &key) {
                Newest::Absent => {
                    close();
                    return None;
                }
                Newest::Wait(xid) => {
                    pg_sys::XactLockTableWait(
                        xid,
                        rel,
                        std::ptr::null_mut(),
                        pg_sys::XLTW_Oper::XLTW_None,
                    );
                    continue;
                }
                // Counts as a round, like a row that changed under the update.
                Newest::Changed => continue,
                Newest::Row(tuple) => tuple,
            };
            let mut values = vec![pg_sys::Datum::from(0usize); d.natts];
            let mut nulls = vec![true; d.natts];
            pg_sys::heap_deform_tuple(old, desc, values.as_mut_ptr(), nulls.as_mut_ptr());
            let live_claim = !nulls[d[Column::Status]]
                && values[d[Column::Status]] == d.in_progress
                && !nulls[d[Column::ExpiresAt]]
                && (values[d[Column::ExpiresAt]].value() as i64) > now
                && req.token.is_none_or(|t| {
                    !nulls[d[Column::Token]] && values[d[Column::Token]].value() as i64 == t
                });
            if !live_claim {
                close();
                return None;
            }
            let request_hash = Vec::<u8>::from_datum(
                values[d[Column::RequestHash]],
                nulls[d[Column::RequestHash]],
            );
            let token = values[d[Column::Token]].value() as i64;
            let ttl = match req.ttl.and_then(|t| t.into_datum()) {
                Some(t) => t,
                None => values[d[Column::Ttl]],
            };
            let expires_at = pg_sys::DirectFunctionCall2Coll(
                Some(timestamptz_pl_interval),
                pg_sys::InvalidOid,
                pg_sys::Datum::from(now),
                ttl,
            );
            let mut set = |i: usize, v: Option<pg_sys::Datum>| {
                nulls[i] = v.is_none();
                values[i] = v.unwrap_or(pg_sys::Datum::from(0usize));
            };
            set(d[Column::Status], Some(d.completed));
            set(d[Column::Response], req.response);
            set(
                d[Column::ResponseStatus],
                Some(pg_sys::Datum::from(req.response_status)),
            );
            set(d[Column::CompletedAt], Some(pg_sys::Datum::from(now)));
            set(d[Column::LockedUntil], None);
            set(d[Column::ExpiresAt], Some(expires_at));
            set(d[Column::Ttl], Some(ttl));
            let new = pg_sys::heap_form_tuple(desc, values.as_mut_ptr(), nulls.as_mut_ptr());
            let slot = pg_sys::MakeSingleTupleTableSlot(desc, &pg_sys::TTSOpsHeapTuple);
            pg_sys::ExecStoreHeapTuple(new, slot, false);
            let mut tid = (*old).t_self;
            let mut tmfd: pg_sys::TM_FailureData = std::mem::zeroed();
            let mut lockmode: pg_sys::LockTupleMode::Type = 0;
            let (result, index_update) = crate::compat::table_tuple_update(
                rel,
                &mut tid,
                slot,
                pg_sys::GetCurrentCommandId(true),
                true,
                &mut tmfd,
                &mut lockmode,
            );
            match result {
                pg_sys::TM_Result::TM_Ok => {
                    // As the executor: a HOT update adds no index entries, except (16 on) to
                    // summarizing indexes whose column changed.
                    match index_update {
                        crate::compat::IndexUpdate::None => {}
                        crate::compat::IndexUpdate::All => {
                            insert_index_entries(rel, &[slot], false)
                        }
                        crate::compat::IndexUpdate::Summarizing => {
                            insert_index_entries(rel, &[slot], true)
                        }
                    }
                    pg_sys::ExecDropSingleTupleTableSlot(slot);
                    close();
                    return Some(Completed {
                        expires_at: TimestampWithTimeZone::from_datum(expires_at, false),
                        request_hash,
                        token: Some(token),
                    });
                }
                // Changed or deleted since we read it (its transaction committed while we
                // waited in heap_update): read the newest version again.
                pg_sys::TM_Result::TM_Updated | pg_sys::TM_Result::TM_Deleted => {
                    pg_sys::ExecDropSingleTupleTableSlot(slot);
                }
                other => {
                    pg_sys::ExecDropSingleTupleTableSlot(slot);
                    close();
                    internal(&format!("unexpected result {other} updating the row"));
                }
            }
        }
        close();
        raise(
            PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
            format!(
                "idempotency.complete: key {} kept changing under concurrent completions",
                key_label(req.key)
            ),
            Some("retry the transaction"),
        )
    }
}

/// Adds the index entries of rows just written to the heap (each in a slot, with its TID): what
/// the executor does after an insert or a non-HOT update (or, `only_summarizing`, after a HOT
/// update that changed a summarizing index's column).
///
/// # Safety
/// `rel` is the store, open and locked for writing (RowExclusiveLock) in this transaction; each
/// slot holds a tuple of `rel` just written to the heap by this command, with its TID set.
unsafe fn insert_index_entries(
    rel: pg_sys::Relation,
    slots: &[*mut pg_sys::TupleTableSlot],
    only_summarizing: bool,
) {
    // SAFETY: the caller's contract (`rel` open and write-locked, each slot holding a row just
    // written with its TID); the executor state and result relation are built and freed here,
    // as `ExecInsertIndexTuples` expects them.
    unsafe {
        let estate = pg_sys::CreateExecutorState();
        let rri = pg_sys::palloc0(std::mem::size_of::<pg_sys::ResultRelInfo>())
            as *mut pg_sys::ResultRelInfo;
        (*rri).type_ = pg_sys::NodeTag::T_ResultRelInfo;
        // No range table entry: this is not a planned statement.
        pg_sys::InitResultRelInfo(rri, rel, 0, std::ptr::null_mut(), 0);
        pg_sys::ExecOpenIndices(rri, false);
        for &slot in slots {
            // update = false (inside compat): it only feeds a hint to btree's bottom-up
            // deletion, which would look the changed columns up in a range table this write
            // does not have.
            let recheck = crate::compat::insert_index_tuples(rri, slot, estate, only_summarizing);
            pg_sys::list_free(recheck);
        }
        pg_sys::ExecCloseIndices(rri);
        pg_sys::FreeExecutorState(estate);
    }
}
