//! PostgreSQL version differences, in one place: every item here has one body per supported
//! major version (`cfg(feature = "pgNN")`), and nothing outside this module names a version.

use pgrx::pg_sys;
use std::ffi::CStr;

/// The server's record of a setting (a placeholder too, before the library defines it), or
/// null when the session has never heard of it.
///
/// # Safety
/// Call from the backend's main thread; the record lives as long as the backend.
#[cfg(feature = "pg15")]
pub unsafe fn find_setting(name: &CStr) -> *mut pg_sys::config_generic {
    // SAFETY: get_guc_variables and GetNumConfigOptions describe the server's array of
    // settings, valid until a setting is added (not during this loop).
    unsafe {
        let all = pg_sys::get_guc_variables();
        let n = pg_sys::GetNumConfigOptions().max(0) as usize;
        if all.is_null() {
            return std::ptr::null_mut();
        }
        for i in 0..n {
            let record = *all.add(i);
            if !record.is_null()
                && CStr::from_ptr((*record).name)
                    .to_bytes()
                    .eq_ignore_ascii_case(name.to_bytes())
            {
                return record;
            }
        }
        std::ptr::null_mut()
    }
}

/// See the PostgreSQL 15 version: from 16 on the server looks settings up by name itself.
///
/// # Safety
/// Call from the backend's main thread; the record lives as long as the backend.
#[cfg(not(feature = "pg15"))]
pub unsafe fn find_setting(name: &CStr) -> *mut pg_sys::config_generic {
    // SAFETY: find_option with skip_errors never raises; it returns null for an unknown name.
    unsafe { pg_sys::find_option(name.as_ptr(), false, true, pg_sys::DEBUG1 as i32) }
}

/// This backend's 0-based number among the server's processes (for per-backend slots in
/// shared memory), or None outside a backend. 15 and 16 number backends from 1
/// (`MyBackendId`); 17 numbers every process from 0 (`MyProcNumber`).
pub fn backend_index() -> Option<usize> {
    #[cfg(any(feature = "pg15", feature = "pg16"))]
    // SAFETY: reads a backend variable set at backend start.
    let index = usize::try_from(unsafe { pg_sys::MyBackendId })
        .ok()
        .and_then(|id| id.checked_sub(1));
    #[cfg(not(any(feature = "pg15", feature = "pg16")))]
    // SAFETY: as above.
    let index = usize::try_from(unsafe { pg_sys::MyProcNumber }).ok();
    index
}

/// Attribute `i` (0-based) of a tuple descriptor: an array member of `TupleDescData` up to 17,
/// behind `TupleDescAttr` from 18 on (which added the compact attributes).
///
/// # Safety
/// `desc` must be a valid tuple descriptor and `i < natts`.
pub unsafe fn attribute(desc: pg_sys::TupleDesc, i: usize) -> *mut pg_sys::FormData_pg_attribute {
    #[cfg(not(feature = "pg18"))]
    // SAFETY: the caller guarantees `i < natts`, the length of the array.
    unsafe {
        (*desc).attrs.as_mut_ptr().add(i)
    }
    // TupleDescAttr is an inline function of the headers: the attributes follow the compact
    // ones, `natts` of each.
    #[cfg(feature = "pg18")]
    // SAFETY: as above; the layout is the one TupleDescAttr computes.
    unsafe {
        (*desc)
            .compact_attrs
            .as_mut_ptr()
            .add((*desc).natts as usize)
            .cast::<pg_sys::FormData_pg_attribute>()
            .add(i)
    }
}

/// Which indexes an update must add entries to (`table_tuple_update`'s verdict): none (a HOT
/// update), all, or, from 16 on, only the summarizing (BRIN) ones.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum IndexUpdate {
    None,
    All,
    /// Never the verdict on 15, which has no summarizing-only updates.
    #[cfg_attr(feature = "pg15", allow(dead_code))]
    Summarizing,
}

/// `table_tuple_update`, with its index verdict as an [`IndexUpdate`] (a bool up to 15, an enum
/// from 16 on).
///
/// # Safety
/// As `table_tuple_update`: an open relation, a valid TID and a slot of its row type.
#[allow(clippy::too_many_arguments)]
pub unsafe fn table_tuple_update(
    rel: pg_sys::Relation,
    tid: pg_sys::ItemPointer,
    slot: *mut pg_sys::TupleTableSlot,
    cid: pg_sys::CommandId,
    wait: bool,
    tmfd: *mut pg_sys::TM_FailureData,
    lockmode: *mut pg_sys::LockTupleMode::Type,
) -> (pg_sys::TM_Result::Type, IndexUpdate) {
    let null = std::ptr::null_mut();
    #[cfg(feature = "pg15")]
    // SAFETY: the caller's guarantees; the verdict is written by the call.
    unsafe {
        let mut all = false;
        let r = pg_sys::table_tuple_update(
            rel, tid, slot, cid, null, null, wait, tmfd, lockmode, &mut all,
        );
        (
            r,
            if all {
                IndexUpdate::All
            } else {
                IndexUpdate::None
            },
        )
    }
    #[cfg(not(feature = "pg15"))]
    // SAFETY: as above.
    unsafe {
        let mut verdict = pg_sys::TU_UpdateIndexes::TU_None;
        let r = pg_sys::table_tuple_update(
            rel,
            tid,
            slot,
            cid,
            null,
            null,
            wait,
            tmfd,
            lockmode,
            &mut verdict,
        );
        let update = match verdict {
            pg_sys::TU_UpdateIndexes::TU_None => IndexUpdate::None,
            pg_sys::TU_UpdateIndexes::TU_Summarizing => IndexUpdate::Summarizing,
            _ => IndexUpdate::All,
        };
        (r, update)
    }
}

/// `ExecInsertIndexTuples` for a row just written (not an update's bottom-up deletion hint, no
/// arbiter indexes): 16 added `onlySummarizing`, true after a HOT update that changed a column
/// of a summarizing index only. Returns the list of indexes needing a recheck.
///
/// # Safety
/// As `ExecInsertIndexTuples`: a result relation with its indexes open, the row in `slot`.
pub unsafe fn insert_index_tuples(
    rri: *mut pg_sys::ResultRelInfo,
    slot: *mut pg_sys::TupleTableSlot,
    estate: *mut pg_sys::EState,
    only_summarizing: bool,
) -> *mut pg_sys::List {
    let (no_conflict, no_arbiters) = (std::ptr::null_mut(), std::ptr::null_mut());
    #[cfg(feature = "pg15")]
    // SAFETY: the caller's guarantees; 15 has no summarizing-only updates.
    unsafe {
        let _ = only_summarizing;
        pg_sys::ExecInsertIndexTuples(rri, slot, estate, false, false, no_conflict, no_arbiters)
    }
    #[cfg(not(feature = "pg15"))]
    // SAFETY: as above.
    unsafe {
        pg_sys::ExecInsertIndexTuples(
            rri,
            slot,
            estate,
            false,
            false,
            no_conflict,
            no_arbiters,
            only_summarizing,
        )
    }
}

/// Waits on this process's latch until it is set or `ms` milliseconds have passed, then resets
/// it: the one latch wait of the extension (a claim's pause before it looks at a busy key
/// again, the sweeper's naps, the debug builds' pause inside the look-up). It makes no error
/// boundary and checks no interrupts, so it may run inside the look-up's boundary; callers
/// outside one check interrupts themselves. It raises no ERROR: on postmaster death the process
/// exits, as PostgreSQL's own processes do.
pub(crate) fn wait_latch(ms: i64) {
    // SAFETY: this process's own latch, waited on from its main thread; WaitLatch raises no
    // ERROR with these flags (WL_EXIT_ON_PM_DEATH exits the process instead), ResetLatch none.
    unsafe {
        raw::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            ms.clamp(0, i32::MAX as i64) as std::ffi::c_long,
            pg_sys::PG_WAIT_EXTENSION,
        );
        raw::ResetLatch(pg_sys::MyLatch);
    }
}

/// Server functions declared directly, without pgrx's per-call error boundary: those
/// `store/heap` calls inside one boundary of its own, those that only read backend state and
/// cannot raise an error, and the V1 functions `DirectFunctionCall` calls from C. Every
/// declaration is checked by the compiler against pgrx's own binding of the same function for
/// the PostgreSQL version built (`declare!`): a signature that changes in a major release fails
/// the build instead of corrupting memory.
pub mod raw {
    use pgrx::pg_sys;
    use std::ffi::{c_char, c_int, c_long};

    /// Declares server functions and, for each, a compile-time check that pgrx's binding of the
    /// function (generated from the server's headers) has the same argument and result types.
    macro_rules! declare {
        ($( $(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?; )*) => {
            unsafe extern "C-unwind" {
                $( $(#[$meta])* pub(crate) fn $name($($arg: $ty),*) $(-> $ret)?; )*
            }
            $( $(#[$meta])* const _: unsafe fn($($ty),*) $(-> $ret)? = pg_sys::$name; )*
        };
    }

    // Backend state that cannot raise an error: called directly, no boundary needed. The latch
    // calls too (`super::wait_latch`, with flags under which WaitLatch raises none).
    declare! {
        fn GetUserId() -> pg_sys::Oid;
        fn GetOuterUserId() -> pg_sys::Oid;
        fn GetSessionUserId() -> pg_sys::Oid;
        fn GetCurrentTransactionStartTimestamp() -> pg_sys::TimestampTz;
        fn WaitLatch(
            latch: *mut pg_sys::Latch,
            wake_events: c_int,
            timeout: c_long,
            wait_event_info: u32,
        ) -> c_int;
        fn ResetLatch(latch: *mut pg_sys::Latch);
    }

    // The V1 functions themselves, for DirectFunctionCall (which calls them from C): pgrx's
    // `pg_sys` wrappers are Rust functions.
    declare! {
        fn timestamptz_pl_interval(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum;
        fn nextval_oid(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum;
    }

    // The primary-key scan (store/heap/scan.rs), inside its one error boundary.
    declare! {
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
        fn slot_getsomeattrs_int(slot: *mut pg_sys::TupleTableSlot, attnum: c_int);
        fn pg_detoast_datum_copy(datum: *mut pg_sys::varlena) -> *mut pg_sys::varlena;
        fn ExecDropSingleTupleTableSlot(slot: *mut pg_sys::TupleTableSlot);
        fn ExecFetchSlotHeapTuple(
            slot: *mut pg_sys::TupleTableSlot,
            materialize: bool,
            should_free: *mut bool,
        ) -> pg_sys::HeapTuple;
        fn heap_copytuple(tuple: pg_sys::HeapTuple) -> pg_sys::HeapTuple;
        fn index_endscan(scan: pg_sys::IndexScanDesc);
    }

    unsafe extern "C-unwind" {
        #[cfg(not(feature = "pg18"))]
        #[link_name = "index_beginscan"]
        fn index_beginscan_5(
            heap: pg_sys::Relation,
            index: pg_sys::Relation,
            snapshot: pg_sys::Snapshot,
            nkeys: c_int,
            norderbys: c_int,
        ) -> pg_sys::IndexScanDesc;
        #[cfg(feature = "pg18")]
        #[link_name = "index_beginscan"]
        fn index_beginscan_6(
            heap: pg_sys::Relation,
            index: pg_sys::Relation,
            snapshot: pg_sys::Snapshot,
            instrument: *mut pg_sys::IndexScanInstrumentation,
            nkeys: c_int,
            norderbys: c_int,
        ) -> pg_sys::IndexScanDesc;
    }

    // Not in pgrx's bindings, for a test: `void enable_timeout_after(TimeoutId id, int
    // delay_ms)` (utils/timeout.h), unchanged in 15-18, as is LOCK_TIMEOUT's place (third) in
    // that enum.
    #[cfg(any(test, feature = "pg_test"))]
    unsafe extern "C-unwind" {
        pub(crate) fn enable_timeout_after(id: c_int, delay_ms: c_int);
    }
    #[cfg(any(test, feature = "pg_test"))]
    pub(crate) const LOCK_TIMEOUT: c_int = 2;

    // Not in pgrx's bindings, so not checked by the compiler: `Datum datumCopy(Datum value,
    // bool typByVal, int typLen)` (utils/datum.h), unchanged in 15-18.
    unsafe extern "C-unwind" {
        pub(crate) fn datumCopy(
            value: pg_sys::Datum,
            typbyval: bool,
            typlen: c_int,
        ) -> pg_sys::Datum;
    }

    // index_beginscan gained an instrumentation argument in 18; each declaration checked
    // against its own version's binding.
    #[cfg(not(feature = "pg18"))]
    const _: unsafe fn(
        pg_sys::Relation,
        pg_sys::Relation,
        pg_sys::Snapshot,
        c_int,
        c_int,
    ) -> pg_sys::IndexScanDesc = pg_sys::index_beginscan;
    #[cfg(feature = "pg18")]
    const _: unsafe fn(
        pg_sys::Relation,
        pg_sys::Relation,
        pg_sys::Snapshot,
        *mut pg_sys::IndexScanInstrumentation,
        c_int,
        c_int,
    ) -> pg_sys::IndexScanDesc = pg_sys::index_beginscan;

    /// `index_beginscan` without a boundary: call only inside `pg_guard_ffi_boundary`, from
    /// plain old frames (see store/heap).
    ///
    /// # Safety
    /// As `index_beginscan`, and the above.
    #[inline]
    pub unsafe fn index_beginscan(
        heap: pg_sys::Relation,
        index: pg_sys::Relation,
        snapshot: pg_sys::Snapshot,
        nkeys: c_int,
    ) -> pg_sys::IndexScanDesc {
        #[cfg(not(feature = "pg18"))]
        // SAFETY: the caller's guarantees.
        unsafe {
            index_beginscan_5(heap, index, snapshot, nkeys, 0)
        }
        #[cfg(feature = "pg18")]
        // SAFETY: the caller's guarantees; no instrumentation.
        unsafe {
            index_beginscan_6(heap, index, snapshot, std::ptr::null_mut(), nkeys, 0)
        }
    }
}

/// Pins the search path to `pg_catalog` (no temporary schema for tables, which every
/// statement names anyway) until dropped, as a function's `SET search_path` clause would,
/// without its per-call cost where the server allows: 15 and 16 push an override search path;
/// 17 removed that, so there it is a `SET search_path` at a new GUC nesting level, undone on
/// drop (as fmgr does for a SET clause).
pub struct SearchPathPin {
    #[cfg(not(any(feature = "pg15", feature = "pg16")))]
    nest_level: std::ffi::c_int,
}

impl SearchPathPin {
    pub fn pin() -> SearchPathPin {
        #[cfg(any(feature = "pg15", feature = "pg16"))]
        {
            let mut path = pg_sys::OverrideSearchPath {
                schemas: std::ptr::null_mut(),
                addCatalog: true,
                addTemp: false,
                generation: 0,
            };
            // SAFETY: the server copies the override; popped on drop, also while an ERROR
            // unwinds.
            unsafe { pg_sys::PushOverrideSearchPath(&mut path) };
            SearchPathPin {}
        }
        #[cfg(not(any(feature = "pg15", feature = "pg16")))]
        // SAFETY: a new GUC nesting level with search_path saved in it, as fmgr_security_definer
        // does for a function's SET clause; AtEOXact_GUC on drop restores the caller's value.
        unsafe {
            let nest_level = pg_sys::NewGUCNestLevel();
            pg_sys::set_config_option(
                c"search_path".as_ptr(),
                c"pg_catalog, pg_temp".as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_SAVE,
                true,
                0,
                false,
            );
            SearchPathPin { nest_level }
        }
    }
}

impl Drop for SearchPathPin {
    /// Also runs while an ERROR unwinds through the extension.
    fn drop(&mut self) {
        #[cfg(any(feature = "pg15", feature = "pg16"))]
        // SAFETY: pops the override pushed by `pin`.
        unsafe {
            pg_sys::PopOverrideSearchPath()
        };
        #[cfg(not(any(feature = "pg15", feature = "pg16")))]
        // SAFETY: ends the nesting level `pin` opened, restoring the saved search_path.
        unsafe {
            pg_sys::AtEOXact_GUC(true, self.nest_level)
        };
    }
}

/// Whether `role` has USAGE on schema `nsp` (`pg_namespace_aclcheck` before PostgreSQL 16).
///
/// # Safety
/// A catalog look-up: call inside a transaction.
pub unsafe fn has_schema_usage(nsp: pg_sys::Oid, role: pg_sys::Oid) -> bool {
    let mode = pg_sys::ACL_USAGE as pg_sys::AclMode;
    #[cfg(feature = "pg15")]
    // SAFETY: the caller's contract.
    let result = unsafe { pg_sys::pg_namespace_aclcheck(nsp, role, mode) };
    #[cfg(not(feature = "pg15"))]
    // SAFETY: the caller's contract.
    let result = unsafe { pg_sys::object_aclcheck(pg_sys::NamespaceRelationId, nsp, role, mode) };
    result == pg_sys::AclResult::ACLCHECK_OK
}
