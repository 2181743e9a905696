//! The replay path's look at the primary key, as one call into PostgreSQL.
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
//! frame. [`look_up`] and its callees hold raw pointers and `Copy` values only, nothing with a
//! destructor, and never panic, so a `longjmp` out of a C call skips nothing that had to run.

use super::super::catalog::layout;
use super::super::{OwnedJsonb, Row};
use super::transaction_start;
use crate::{encoding, guc};
use pgrx::datum::TimestampWithTimeZone;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::ffi::{c_char, c_int};

unsafe extern "C-unwind" {
    fn table_open(relation_id: pg_sys::Oid, lockmode: pg_sys::LOCKMODE) -> pg_sys::Relation;
    fn index_open(relation_id: pg_sys::Oid, lockmode: pg_sys::LOCKMODE) -> pg_sys::Relation;
    fn table_close(relation: pg_sys::Relation, lockmode: pg_sys::LOCKMODE);
    fn index_close(relation: pg_sys::Relation, lockmode: pg_sys::LOCKMODE);
    fn cstring_to_text_with_len(s: *const c_char, len: c_int) -> *mut pg_sys::text;
    fn ScanKeyInit(
        entry: pg_sys::ScanKey,
        attribute_number: pg_sys::AttrNumber,
        strategy: pg_sys::StrategyNumber,
        procedure: pg_sys::RegProcedure,
        argument: pg_sys::Datum,
    );
    fn index_rescan(
        scan: pg_sys::IndexScanDesc,
        keys: pg_sys::ScanKey,
        nkeys: c_int,
        orderbys: pg_sys::ScanKey,
        norderbys: c_int,
    );
    fn table_slot_create(
        rel: pg_sys::Relation,
        reglist: *mut *mut pg_sys::List,
    ) -> *mut pg_sys::TupleTableSlot;
    fn index_getnext_slot(
        scan: pg_sys::IndexScanDesc,
        direction: pg_sys::ScanDirection::Type,
        slot: *mut pg_sys::TupleTableSlot,
    ) -> bool;
    fn index_getnext_tid(
        scan: pg_sys::IndexScanDesc,
        direction: pg_sys::ScanDirection::Type,
    ) -> pg_sys::ItemPointer;
    fn index_fetch_heap(scan: pg_sys::IndexScanDesc, slot: *mut pg_sys::TupleTableSlot) -> bool;
    fn GetLatestSnapshot() -> pg_sys::Snapshot;
    fn RegisterSnapshot(snapshot: pg_sys::Snapshot) -> pg_sys::Snapshot;
    fn UnregisterSnapshot(snapshot: pg_sys::Snapshot);
    #[cfg(debug_assertions)]
    fn WaitLatch(
        latch: *mut pg_sys::Latch,
        wake_events: c_int,
        timeout: std::ffi::c_long,
        wait_event_info: u32,
    ) -> c_int;
    #[cfg(debug_assertions)]
    fn ResetLatch(latch: *mut pg_sys::Latch);
    fn slot_getsomeattrs_int(slot: *mut pg_sys::TupleTableSlot, attnum: c_int);
    fn pg_detoast_datum_copy(datum: *mut pg_sys::varlena) -> *mut pg_sys::varlena;
    fn datumCopy(value: pg_sys::Datum, typbyval: bool, typlen: c_int) -> pg_sys::Datum;
    fn ExecDropSingleTupleTableSlot(slot: *mut pg_sys::TupleTableSlot);
    fn index_endscan(scan: pg_sys::IndexScanDesc);
}

/// Columns read from the row, in the order of `store::Layout::att`.
pub const COLUMNS: usize = 7;

/// What the dirty-snapshot look found: the first version of the key it sees.
#[derive(Clone, Copy)]
pub struct Version {
    /// False: no version of the key exists, committed or not.
    pub exists: bool,
    /// The dirty look found nothing, but a fresh MVCC snapshot taken after it sees the key: a
    /// transaction updated an indexed column of the row and committed while the look was
    /// between the index and the heap (see [`look_up`]). Look again.
    pub raced: bool,
    /// The open transaction that inserted the version, or is changing, deleting or locking it
    /// for an update (invalid when none).
    pub xmin: pg_sys::TransactionId,
    pub xmax: pg_sys::TransactionId,
    /// The columns of `att` (1-based attribute numbers, all positive), by value; variable-length
    /// ones are detoasted copies in the caller's memory context, as they must outlive the scan.
    pub values: [pg_sys::Datum; COLUMNS],
    pub nulls: [bool; COLUMNS],
}

impl Version {
    /// Column `i` of `att`, None when NULL.
    pub fn get(&self, i: usize) -> Option<pg_sys::Datum> {
        (!self.nulls[i]).then_some(self.values[i])
    }
}

/// Looks (scope, key) (text in the database encoding) up through the primary key `index` of `heap` with a dirty snapshot, as
/// PostgreSQL's own unique checks do, and reads the columns `att` of the first version seen.
///
/// A dirty snapshot sees at most one version of a key that no open transaction is changing:
/// the unique index admits no second live one. So the first version answers: either it is
/// committed and untouched, or an open transaction is on it.
///
/// A miss is not proof of absence: the btree scan collects the key's index entries first and
/// reads the heap after, so an UPDATE of an indexed column (`expires_at`) that commits in
/// between leaves the scan with only the dead old version, the new version's index entry
/// unseen. With `confirm_miss`, a miss is checked with an MVCC snapshot taken after it
/// (`GetLatestSnapshot`): such an updater inserted its new index entry before it committed,
/// so that scan cannot miss the row; if it finds the key, the answer is `raced` (the caller
/// looks again). Without it a miss is returned as it is (for callers that look again anyway).
///
/// `pause_ms` (debug builds only, `idempotency.debug_probe_pause`) waits that long between
/// the index scan and each heap fetch of the dirty look, so that tests can commit an update
/// in that window.
///
/// # Safety
/// Call from the backend's main thread with valid OIDs of a table and its (scope, key) btree
/// index whose key columns are `text COLLATE "C"`, and `att` positive attribute numbers of
/// that table.
pub unsafe fn look_up(
    heap: pg_sys::Oid,
    index: pg_sys::Oid,
    scope: &[u8],
    key: &[u8],
    att: &[i32; COLUMNS],
    confirm_miss: bool,
    pause_ms: i32,
) -> Version {
    // SAFETY: `scan` has only plain old frames (see the module comment).
    unsafe {
        pg_sys::ffi::pg_guard_ffi_boundary(|| {
            scan(heap, index, scope, key, att, confirm_miss, pause_ms)
        })
    }
}

/// Waits `ms` milliseconds (debug builds only: the test hook between index and heap).
#[cfg(debug_assertions)]
unsafe fn pause(ms: i32) {
    if ms > 0 {
        // SAFETY: called on the backend's main thread; WaitLatch raises no error with these
        // flags (it exits the process on postmaster death).
        unsafe {
            WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                ms as std::ffi::c_long,
                pg_sys::PG_WAIT_EXTENSION,
            );
            ResetLatch(pg_sys::MyLatch);
        }
    }
}

#[cfg(not(debug_assertions))]
#[inline(always)]
unsafe fn pause(_ms: i32) {}

/// The next version the index scan finds, as `index_getnext_slot` does it (which is these
/// two calls), with the test pause between the index and the heap. (store.rs has the same
/// loop with pgrx's guarded calls, for its scans outside this module's boundary.)
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

unsafe fn scan(
    heap_oid: pg_sys::Oid,
    index_oid: pg_sys::Oid,
    scope: &[u8],
    key: &[u8],
    att: &[i32; COLUMNS],
    confirm_miss: bool,
    pause_ms: i32,
) -> Version {
    // SAFETY: the caller's contract (`look_up`): valid OIDs of the table and its (scope, key)
    // index and positive attribute numbers; every pointer used is one the server returned.
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let heap = table_open(heap_oid, lock);
        let index = index_open(index_oid, lock);
        let mut snapshot: pg_sys::SnapshotData = std::mem::zeroed();
        snapshot.snapshot_type = pg_sys::SnapshotType::SNAPSHOT_DIRTY;
        let mut keys: [pg_sys::ScanKeyData; 2] = std::mem::zeroed();
        // The key columns are COLLATE "C", which is what ScanKeyInit assumes.
        for (i, part) in [scope, key].iter().enumerate() {
            ScanKeyInit(
                &mut keys[i],
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
        let mut found = Version {
            exists: false,
            raced: false,
            xmin: pg_sys::InvalidTransactionId,
            xmax: pg_sys::InvalidTransactionId,
            values: [pg_sys::Datum::from(0usize); COLUMNS],
            nulls: [true; COLUMNS],
        };
        if next_version(scan, slot, pause_ms) {
            found.exists = true;
            found.xmin = snapshot.xmin;
            found.xmax = snapshot.xmax;
            let last = att.iter().copied().max().unwrap_or(0);
            if ((*slot).tts_nvalid as i32) < last {
                slot_getsomeattrs_int(slot, last);
            }
            let desc = (*slot).tts_tupleDescriptor;
            let natts = (*desc).natts as usize;
            for (i, &n) in att.iter().enumerate() {
                let at = (n - 1) as usize;
                if at >= natts {
                    continue;
                }
                let column = &*crate::compat::attribute(desc, at);
                let null = *(*slot).tts_isnull.add(at);
                let value = *(*slot).tts_values.add(at);
                found.nulls[i] = null;
                found.values[i] = if null || column.attbyval {
                    value
                } else if column.attlen == -1 {
                    pg_sys::Datum::from(pg_detoast_datum_copy(value.cast_mut_ptr()))
                } else {
                    datumCopy(value, false, column.attlen as c_int)
                };
            }
        } else if confirm_miss {
            // A snapshot taken now sees every version committed before now through its own
            // index entry (see `look_up`). Registered for the scan's duration.
            let fresh = RegisterSnapshot(GetLatestSnapshot());
            let confirm = crate::compat::raw::index_beginscan(heap, index, fresh, 2);
            // index_rescan copies the keys: the same array serves both scans.
            index_rescan(confirm, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
            found.raced =
                index_getnext_slot(confirm, pg_sys::ScanDirection::ForwardScanDirection, slot);
            index_endscan(confirm);
            UnregisterSnapshot(fresh);
        }
        ExecDropSingleTupleTableSlot(slot);
        index_endscan(scan);
        index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        table_close(heap, pg_sys::NoLock as pg_sys::LOCKMODE);
        found
    }
}

/// What a dirty-snapshot look at the primary key found.
pub(crate) enum Probe {
    /// No version of the row exists, committed or not.
    Absent,
    /// Another open transaction is inserting, updating or deleting the row.
    Busy,
    /// The newest committed version (or our own transaction's).
    Committed(Row),
    /// The row changed between the index scan and the heap fetch (an update of an indexed
    /// column committed in between, see [`look_up`]): look again.
    Changed,
}

/// The row as [`look_up`] read it: the columns of `Layout::att`, variable-length ones
/// already copied out of the table, judged at `now()`.
pub(crate) fn row_from_version(v: &Version) -> Row {
    let [hash, token, response, status, recovery, expires, locked] =
        std::array::from_fn(|i| v.get(i));
    let now = transaction_start();
    let expires_at = expires.map_or(0, |d| d.value() as i64);
    let locked_until = locked.map(|d| d.value() as i64);
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
    } else if v.xmin != pg_sys::InvalidTransactionId || v.xmax != pg_sys::InvalidTransactionId {
        Probe::Busy
    } else {
        Probe::Committed(row_from_version(&v))
    }
}

/// Walks the versions of (scope, key) that a dirty snapshot sees through the primary key, as
/// PostgreSQL's own unique checks do, until `visit` returns true. `visit` gets each version's
/// slot and the dirty snapshot's verdict on it: the open transaction that inserted it (xmin) or
/// is changing, deleting or locking it for an update (xmax), each invalid when there is none.
///
/// Returns false when the dirty scan saw no version at all but an MVCC snapshot taken after it
/// sees the key: an update of an indexed column committed between the index scan and the heap
/// fetch (see [`look_up`]), so the caller must look again.
pub(crate) unsafe fn scan_key_dirty(
    heap: pg_sys::Relation,
    index: pg_sys::Relation,
    scope: &str,
    key: &str,
    mut visit: impl FnMut(
        *mut pg_sys::TupleTableSlot,
        pg_sys::TransactionId,
        pg_sys::TransactionId,
    ) -> bool,
) -> bool {
    // SAFETY: `heap` and `index` are open (the caller's contract); the snapshots live on this
    // frame (dirty) or are registered (fresh) for as long as the scans that use them.
    unsafe {
        let mut snapshot: pg_sys::SnapshotData = std::mem::zeroed();
        snapshot.snapshot_type = pg_sys::SnapshotType::SNAPSHOT_DIRTY;
        let mut keys: [pg_sys::ScanKeyData; 2] = std::mem::zeroed();
        // The key columns are COLLATE "C", which is what ScanKeyInit assumes.
        let scope_text = encoding::text_datum(scope, "scope");
        let key_text = encoding::text_datum(key, "key");
        for (i, d) in [scope_text, key_text].into_iter().enumerate() {
            pg_sys::ScanKeyInit(
                &mut keys[i],
                (i + 1) as pg_sys::AttrNumber,
                pg_sys::BTEqualStrategyNumber as u16,
                pg_sys::Oid::from(pg_sys::F_TEXTEQ),
                d,
            );
        }
        let scan = crate::compat::index_beginscan(heap, index, &mut snapshot, 2);
        pg_sys::index_rescan(scan, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(heap, std::ptr::null_mut());
        let pause = guc::debug_probe_pause();
        let mut found_any = false;
        while next_version_guarded(scan, slot, pause) {
            found_any = true;
            if visit(slot, snapshot.xmin, snapshot.xmax) {
                break;
            }
        }
        // A miss may be a race with an update of an indexed column (see `look_up`):
        // confirm it with a snapshot taken now, which cannot miss a committed version.
        let raced = !found_any && {
            let fresh = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
            let confirm = crate::compat::index_beginscan(heap, index, fresh, 2);
            // index_rescan copies the keys: the same array serves both scans.
            pg_sys::index_rescan(confirm, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
            let seen = pg_sys::index_getnext_slot(
                confirm,
                pg_sys::ScanDirection::ForwardScanDirection,
                slot,
            );
            pg_sys::index_endscan(confirm);
            pg_sys::UnregisterSnapshot(fresh);
            seen
        };
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_endscan(scan);
        !raced
    }
}

/// `index_getnext_slot`, which is these two calls, with the test pause of
/// `idempotency.debug_probe_pause` (debug builds only) between the index and the heap.
///
/// # Safety
/// `scan` is an open index scan over the table of `slot`.
pub(crate) unsafe fn next_version_guarded(
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
                if pg_sys::index_getnext_tid(scan, pg_sys::ScanDirection::ForwardScanDirection)
                    .is_null()
                {
                    return false;
                }
                if cfg!(debug_assertions) && pause_ms > 0 {
                    pg_sys::WaitLatch(
                        pg_sys::MyLatch,
                        (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH)
                            as i32,
                        pause_ms as std::ffi::c_long,
                        pg_sys::PG_WAIT_EXTENSION,
                    );
                    pg_sys::ResetLatch(pg_sys::MyLatch);
                }
            }
            if pg_sys::index_fetch_heap(scan, slot) {
                return true;
            }
        }
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
    /// The scan raced an update of the row (see [`scan_key_dirty`]): look again.
    Changed,
}

pub(crate) unsafe fn newest_version(
    rel: pg_sys::Relation,
    index: pg_sys::Relation,
    scope: &str,
    key: &str,
) -> Newest {
    let mut found = Newest::Absent;
    // SAFETY: `rel` and `index` are the open table and its primary key (the caller's contract).
    let whole = unsafe {
        scan_key_dirty(rel, index, scope, key, |slot, xmin, xmax| {
            if xmax != pg_sys::InvalidTransactionId {
                found = Newest::Wait(xmax);
                return true;
            }
            if xmin != pg_sys::InvalidTransactionId {
                return false; // another transaction's uncommitted insert (or new version)
            }
            found = Newest::Row(pg_sys::ExecCopySlotHeapTuple(slot));
            true
        })
    };
    if whole {
        found
    } else {
        Newest::Changed
    }
}
