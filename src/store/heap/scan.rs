//! The one dirty-snapshot scan of a key through the primary key ([`scan_key`]), for the
//! claim's look-up ([`look_up`], [`probe`]) and the completion's newest version
//! ([`newest_version`]), each one call into PostgreSQL.
//!
//! pgrx wraps every `pg_sys` function in its own error boundary (a `sigsetjmp` and a thread
//! check per call). A claim that replays makes some twenty such calls to open the table, scan
//! the index and read the row, and on a 2-core machine the boundaries alone were a visible part
//! of its cost. Here the same calls are declared directly and made inside a single
//! [`pg_sys::ffi::pg_guard_ffi_boundary`]: an ERROR raised by any of them (an I/O error, a
//! cancel, out of memory) still becomes a Rust panic at that boundary and an ERROR of the
//! calling function, as with the wrapped calls.
//!
//! What makes that sound: everything between the boundary and the C functions is a plain old
//! frame. [`look_up`], [`newest_version`] and their callees hold raw pointers and `Copy` values only, nothing with a
//! destructor, and never panic, so a `longjmp` out of a C call skips nothing that had to run.
//! The compiler holds the module to that: no `panic!`, `unwrap`, `expect` or unchecked indexing.
#![deny(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use super::super::catalog::{layout, looked_up_index, Column, LOOKED_UP_COUNT};
use super::super::{OwnedJsonb, Row};
use super::transaction_start;
use crate::{encoding, guc};
use pgrx::datum::TimestampWithTimeZone;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::ffi::c_int;

use crate::compat::raw::{
    cstring_to_text_with_len, datumCopy, heap_copytuple, index_close, index_endscan,
    index_fetch_heap, index_getnext_slot, index_getnext_tid, index_open, index_rescan,
    pg_detoast_datum_copy, slot_getsomeattrs_int, table_close, table_open, table_slot_create,
    ExecDropSingleTupleTableSlot, ExecFetchSlotHeapTuple, GetLatestSnapshot, RegisterSnapshot,
    ScanKeyInit, UnregisterSnapshot,
};

/// The columns the look-up reads, in the order of `catalog::LOOKED_UP`.
const N: usize = LOOKED_UP_COUNT;

/// What the dirty-snapshot look found: the first version of the key it sees.
#[derive(Clone, Copy)]
pub(crate) struct Version {
    /// False: no version of the key exists, committed or not.
    pub(crate) exists: bool,
    /// The dirty look found nothing, but a fresh MVCC snapshot taken after it sees the key: a
    /// transaction updated an indexed column of the row and committed while the look was
    /// between the index and the heap (see [`scan_key`]). Look again.
    pub(crate) raced: bool,
    /// The open transaction that inserted the version, or is changing, deleting or locking it
    /// for an update (invalid when none).
    pub(crate) xmin: pg_sys::TransactionId,
    pub(crate) xmax: pg_sys::TransactionId,
    /// The columns of `catalog::LOOKED_UP`, by value; variable-length ones are detoasted copies in
    /// the caller's memory context, as they must outlive the scan.
    values: [pg_sys::Datum; N],
    nulls: [bool; N],
}

impl Version {
    /// Column `c` (one of `catalog::LOOKED_UP`), None when NULL.
    pub(crate) fn get(&self, c: Column) -> Option<pg_sys::Datum> {
        let i = looked_up_index(c);
        match (self.nulls.get(i), self.values.get(i)) {
            (Some(false), Some(&value)) => Some(value),
            _ => None,
        }
    }
}

/// Looks (scope, key) (text in the database encoding) up through the primary key `index` of
/// `heap` with a dirty snapshot ([`scan_key`]) and reads the columns `att` (the attribute
/// numbers of `catalog::LOOKED_UP`) of the first version seen.
///
/// A dirty snapshot sees at most one version of a key that no open transaction is changing:
/// the unique index admits no second live one. So the first version answers: either it is
/// committed and untouched, or an open transaction is on it.
///
/// # Safety
/// Call from the backend's main thread with valid OIDs of a table and its (scope, key) btree
/// index whose key columns are `text COLLATE "C"`, and `att` positive attribute numbers of
/// that table.
pub(crate) unsafe fn look_up(
    heap: pg_sys::Oid,
    index: pg_sys::Oid,
    scope: &[u8],
    key: &[u8],
    att: &[i32; N],
    confirm_miss: bool,
    pause_ms: i32,
) -> Version {
    // SAFETY: the closure and everything it calls hold raw pointers and `Copy` values only and
    // never panic (see the module comment), so an ERROR's longjmp out of a C call skips no
    // destructor; the OIDs and attribute numbers are valid (the caller's contract).
    unsafe {
        pg_sys::ffi::pg_guard_ffi_boundary(|| {
            let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
            let heap = table_open(heap, lock);
            let index = index_open(index, lock);
            let mut found = Version {
                exists: false,
                raced: false,
                xmin: pg_sys::InvalidTransactionId,
                xmax: pg_sys::InvalidTransactionId,
                values: [pg_sys::Datum::from(0usize); N],
                nulls: [true; N],
            };
            found.raced = scan_key(
                heap,
                index,
                scope,
                key,
                confirm_miss,
                pause_ms,
                |slot, xmin, xmax| {
                    found.exists = true;
                    found.xmin = xmin;
                    found.xmax = xmax;
                    copy_columns(slot, att, &mut found);
                    true
                },
            );
            index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
            table_close(heap, pg_sys::NoLock as pg_sys::LOCKMODE);
            found
        })
    }
}

/// Copies the columns `att` of the version in `slot` into `found`.
///
/// # Safety
/// `slot` holds a version of the table whose attribute numbers `att` are; called inside the
/// boundary.
unsafe fn copy_columns(slot: *mut pg_sys::TupleTableSlot, att: &[i32; N], found: &mut Version) {
    // SAFETY: the caller's contract: `slot` is a filled slot of the table, `att` are positive
    // attribute numbers; an attribute past the tuple descriptor is skipped, not read.
    unsafe {
        let last = att.iter().copied().max().unwrap_or(0);
        if ((*slot).tts_nvalid as i32) < last {
            slot_getsomeattrs_int(slot, last);
        }
        let desc = (*slot).tts_tupleDescriptor;
        let natts = (*desc).natts as usize;
        let slots = found.nulls.iter_mut().zip(found.values.iter_mut());
        for (&n, (found_null, found_value)) in att.iter().zip(slots) {
            let at = (n - 1) as usize;
            if at >= natts {
                continue;
            }
            let column = &*crate::compat::attribute(desc, at);
            let null = *(*slot).tts_isnull.add(at);
            let value = *(*slot).tts_values.add(at);
            *found_null = null;
            *found_value = if null || column.attbyval {
                value
            } else if column.attlen == -1 {
                pg_sys::Datum::from(pg_detoast_datum_copy(value.cast_mut_ptr()))
            } else {
                datumCopy(value, false, column.attlen as c_int)
            };
        }
    }
}

/// Waits `ms` milliseconds (debug builds only: the test hook between index and heap).
#[cfg(debug_assertions)]
fn pause(ms: i32) {
    if ms > 0 {
        // Makes no error boundary and raises no error: fit for inside the scan's boundary.
        crate::compat::wait_latch(ms as i64);
    }
}

/// Release builds: nothing.
#[cfg(not(debug_assertions))]
#[inline(always)]
fn pause(_ms: i32) {}

/// The next version the index scan finds, as `index_getnext_slot` does it (which is these
/// two calls), with the test pause between the index and the heap.
///
/// # Safety
/// `scan` is an open index scan over the table of `slot`; called inside the boundary.
unsafe fn next_version(
    scan: pg_sys::IndexScanDesc,
    slot: *mut pg_sys::TupleTableSlot,
    pause_ms: i32,
) -> bool {
    // SAFETY: see the function's contract; the calls are index_getnext_slot's own body.
    unsafe {
        loop {
            // A non-MVCC snapshot may see more than one member of a HOT chain: the heap fetch
            // then continues on the same index entry.
            if !(*scan).xs_heap_continue {
                if index_getnext_tid(scan, pg_sys::ScanDirection::ForwardScanDirection).is_null() {
                    return false;
                }
                pause(pause_ms);
            }
            if index_fetch_heap(scan, slot) {
                return true;
            }
        }
    }
}

/// The one dirty-snapshot scan of a key: walks the versions of (scope, key) (text in the
/// database encoding) that a dirty snapshot sees through the primary key `index` of `heap`, as
/// PostgreSQL's own unique checks do, until `visit` returns true. `visit` gets each version's
/// slot and the dirty snapshot's verdict on it: the open transaction that inserted it (xmin)
/// or is changing, deleting or locking it for an update (xmax), each invalid when there is
/// none. The slot is dropped when the scan ends: `visit` copies what it keeps.
///
/// A miss is not proof of absence: the btree scan collects the key's index entries first and
/// reads the heap after, so an UPDATE of an indexed column (`created_at` or `ttl`, which the
/// sweep index reads: a restart, a completion with another TTL) that commits in
/// between leaves the scan with only the dead old version, the new version's index entry
/// unseen. With `confirm_miss`, a miss (no version seen at all) is checked with an MVCC
/// snapshot taken after it (`GetLatestSnapshot`): such an updater inserted its new index entry
/// before it committed, so that scan cannot miss the row; if it finds the key, the scan
/// returns true (raced: the caller looks again). Without it a miss is returned as it is (for
/// callers that look again anyway).
///
/// `pause_ms` (debug builds only, `idempotency.debug_probe_pause`) waits that long between
/// the index scan and each heap fetch of the dirty look, so that tests can commit an update
/// in that window.
///
/// # Safety
/// Inside a [`pg_sys::ffi::pg_guard_ffi_boundary`], from plain old frames (`visit` included:
/// it must not panic nor own anything with a destructor); `heap` and `index` open, the index
/// on (scope, key) with `text COLLATE "C"` key columns.
unsafe fn scan_key(
    heap: pg_sys::Relation,
    index: pg_sys::Relation,
    scope: &[u8],
    key: &[u8],
    confirm_miss: bool,
    pause_ms: i32,
    mut visit: impl FnMut(
        *mut pg_sys::TupleTableSlot,
        pg_sys::TransactionId,
        pg_sys::TransactionId,
    ) -> bool,
) -> bool {
    // SAFETY: the caller's contract; every pointer used is one the server returned, the dirty
    // snapshot lives on this frame for the scan's duration and the fresh one is registered
    // for its scan's.
    unsafe {
        let mut snapshot: pg_sys::SnapshotData = std::mem::zeroed();
        snapshot.snapshot_type = pg_sys::SnapshotType::SNAPSHOT_DIRTY;
        let mut keys: [pg_sys::ScanKeyData; 2] = std::mem::zeroed();
        // The key columns are COLLATE "C", which is what ScanKeyInit assumes.
        for ((i, part), entry) in [scope, key].iter().enumerate().zip(keys.iter_mut()) {
            ScanKeyInit(
                entry,
                (i + 1) as pg_sys::AttrNumber,
                pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
                pg_sys::Oid::from(pg_sys::F_TEXTEQ),
                pg_sys::Datum::from(cstring_to_text_with_len(
                    part.as_ptr().cast(),
                    part.len() as c_int,
                )),
            );
        }
        let scan = crate::compat::raw::index_beginscan(heap, index, &mut snapshot, 2);
        index_rescan(scan, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
        let slot = table_slot_create(heap, std::ptr::null_mut());
        let mut found_any = false;
        while next_version(scan, slot, pause_ms) {
            found_any = true;
            // The dirty snapshot's visibility check of this version set xmin and xmax.
            if visit(slot, snapshot.xmin, snapshot.xmax) {
                break;
            }
        }
        let raced = !found_any && confirm_miss && {
            // A snapshot taken now sees every version committed before now through its own
            // index entry. Registered for the scan's duration.
            let fresh = RegisterSnapshot(GetLatestSnapshot());
            let confirm = crate::compat::raw::index_beginscan(heap, index, fresh, 2);
            // index_rescan copies the keys: the same array serves both scans.
            index_rescan(confirm, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
            let seen =
                index_getnext_slot(confirm, pg_sys::ScanDirection::ForwardScanDirection, slot);
            index_endscan(confirm);
            UnregisterSnapshot(fresh);
            seen
        };
        ExecDropSingleTupleTableSlot(slot);
        index_endscan(scan);
        raced
    }
}

/// What a dirty-snapshot look at the primary key found.
pub(crate) enum Probe {
    /// No version of the row exists, committed or not.
    Absent,
    /// Another open transaction is inserting, updating or deleting the row.
    Busy,
    /// The committed version has expired, and the open transaction `xid` is locking, changing
    /// or deleting it: a sweep, or a claimer restarting the key (see
    /// [`super::holder`]).
    ExpiredHeld(pg_sys::TransactionId),
    /// The newest committed version (or our own transaction's).
    Committed(Row),
    /// The row changed between the index scan and the heap fetch (an update of an indexed
    /// column committed in between, see [`scan_key`]): look again.
    Changed,
}

/// The row as [`look_up`] read it: the columns of `catalog::LOOKED_UP`, variable-length ones
/// already copied out of the table, judged at `now()`.
pub(crate) fn row_from_version(v: &Version) -> Row {
    let hash = v.get(Column::RequestHash);
    let token = v.get(Column::Token);
    let response = v.get(Column::Response);
    let status = v.get(Column::ResponseStatus);
    let recovery = v.get(Column::RecoveryPoint);
    let expires = v.get(Column::ExpiresAt);
    let locked = v.get(Column::LockedUntil);
    let now = transaction_start();
    let expires_at = expires.map_or(0, |d| d.value() as i64);
    let locked_until = locked.map(|d| d.value() as i64);
    // SAFETY: the datums are the look-up's copies of columns the layout checked to be of the
    // types read here (bytea and text: detoasted varlenas in this memory context; jsonb: a
    // detoasted copy; timestamptz by value), alive until the function's context is reset.
    unsafe {
        Row {
            // The table's CHECK constraint ties "completed" to locked_until IS NULL.
            completed: locked_until.is_none(),
            request_hash: hash.map(|d| {
                let p = d.cast_mut_ptr::<pg_sys::varlena>();
                std::slice::from_raw_parts(
                    pgrx::varlena::vardata_any(p).cast::<u8>(),
                    pgrx::varlena::varsize_any_exhdr(p),
                )
                .to_vec()
            }),
            token: token.map(|d| d.value() as i64),
            // Copies in the function's memory context already: no second copy.
            response: response.map(OwnedJsonb),
            response_status: status.map(|d| d.value() as i32),
            recovery_point: recovery.map(|d| encoding::text_of(d, "recovery_point").into_owned()),
            expires_at: expires.and_then(|d| TimestampWithTimeZone::from_datum(d, false)),
            expired: expires_at <= now,
            lease_over: locked_until.is_some_and(|l| l <= now),
            retry_after: Some(super::seconds_left(locked_until)),
        }
    }
}

/// Looks the key up in the primary key with a dirty snapshot, as PostgreSQL's own unique
/// checks do: it sees committed rows and learns, without waiting, whether another open
/// transaction is inserting, changing or deleting the key.
///
/// `confirm_miss`: a miss is confirmed with a fresh MVCC snapshot and answered `Changed` when
/// that sees the key (a concurrent update raced the look). Callers that act on `Absent` (by
/// inserting) confirm; callers that only look again on `Absent` need not.
pub(crate) fn probe(scope: &str, key: &str, confirm_miss: bool) -> Probe {
    let l = layout();
    let (scope, key) = (
        encoding::server_bytes(scope, "scope"),
        encoding::server_bytes(key, "key"),
    );
    // SAFETY: `layout` checked the OIDs, the key columns (text COLLATE "C") and the types and
    // positive attribute numbers of `att` against the catalog (`check_layout` refuses a table
    // that differs before any probe).
    let v = unsafe {
        look_up(
            l.relid,
            l.idxid,
            &scope,
            &key,
            &l.att,
            confirm_miss,
            guc::debug_probe_pause(),
        )
    };
    if v.raced {
        Probe::Changed
    } else if !v.exists {
        Probe::Absent
    } else if v.xmin == pg_sys::InvalidTransactionId
        && v.xmax != pg_sys::InvalidTransactionId
        && v.get(Column::ExpiresAt)
            .is_some_and(|d| d.value() as i64 <= transaction_start())
    {
        Probe::ExpiredHeld(v.xmax)
    } else if v.xmin != pg_sys::InvalidTransactionId || v.xmax != pg_sys::InvalidTransactionId {
        Probe::Busy
    } else {
        Probe::Committed(row_from_version(&v))
    }
}

/// The newest version of a key's row, as a completion must see it.
pub(crate) enum Newest {
    /// No row, or only one that another open transaction is inserting (an UPDATE statement
    /// would not see it either).
    Absent,
    /// Another open transaction is changing, deleting or locking the row: wait for it.
    Wait(pg_sys::TransactionId),
    /// The newest committed version (or this transaction's own), copied.
    Row(pg_sys::HeapTuple),
    /// The scan raced an update of the row (see [`scan_key`]): look again.
    Changed,
}

/// The newest version of (scope, key) (text in the database encoding) through the dirty scan.
///
/// # Safety
/// `rel` and `index` are the open store table and its primary key, checked by the layout.
pub(crate) unsafe fn newest_version(
    rel: pg_sys::Relation,
    index: pg_sys::Relation,
    scope: &[u8],
    key: &[u8],
) -> Newest {
    let pause_ms = guc::debug_probe_pause();
    // SAFETY: the caller's contract; the closure holds `Copy` values and raw pointers only and
    // never panics (the tuple copy is two plain C calls), so an ERROR's longjmp skips nothing.
    unsafe {
        pg_sys::ffi::pg_guard_ffi_boundary(|| {
            let mut found = Newest::Absent;
            let raced = scan_key(
                rel,
                index,
                scope,
                key,
                true,
                pause_ms,
                |slot, xmin, xmax| {
                    if xmax != pg_sys::InvalidTransactionId {
                        found = Newest::Wait(xmax);
                        return true;
                    }
                    if xmin != pg_sys::InvalidTransactionId {
                        return false; // another transaction's uncommitted insert (or new version)
                    }
                    // ExecCopySlotHeapTuple, which is a static inline function: the slot's
                    // tuple (a copy already when the slot had to form one), copied.
                    let mut should_free = false;
                    let tuple = ExecFetchSlotHeapTuple(slot, false, &mut should_free);
                    found = Newest::Row(if should_free {
                        tuple
                    } else {
                        heap_copytuple(tuple)
                    });
                    true
                },
            );
            if raced {
                Newest::Changed
            } else {
                found
            }
        })
    }
}
