//! Calls that Citus would delegate to a worker, kept on this node while the session has set a
//! setting that changes what the call means.
//!
//! Citus delegates a top-level `SELECT idempotency.claim(...)` (and likewise the other
//! functions `distribute()` distributes) to the worker holding the scope's shard, where it runs
//! in a connection of Citus's own: the settings this session changed (`SET`, or options given
//! at connection start) are not there, so the call would run with the worker's (a claim's
//! default TTL, audit off). Where one of [`SETTINGS`] was set so, this planner hook adds a
//! condition that is always true ([`always_true`]) to such a statement, which Citus then does
//! not delegate: the call runs on this node, with this session's settings, and reaches the
//! shard through SQL (as calls inside a transaction do). Settings from `postgresql.conf`,
//! `ALTER SYSTEM` and `ALTER DATABASE ... SET` are each node's own (set them on every node);
//! `ALTER ROLE ... SET`, which Citus propagates, reaches every node.

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::ffi::CStr;

/// The settings that change what a delegated call means (its answer, what it stores or writes,
/// or which scopes it may reach). The sweeper's settings do not matter to a call.
pub const SETTINGS: [&CStr; 8] = [
    c"idempotency.default_ttl",
    c"idempotency.default_lease",
    c"idempotency.claim_wait",
    c"idempotency.busy_retry_after",
    c"idempotency.scope_prefix",
    c"idempotency.audit",
    c"idempotency.max_response_size",
    c"idempotency.max_recovery_point_size",
];

static PREV_PLANNER: crate::local::BackendLocal<std::cell::Cell<pg_sys::planner_hook_type>> =
    crate::local::BackendLocal::new(std::cell::Cell::new(None));

/// Installs the hook (from `_PG_init`, once per process).
pub fn install() {
    // SAFETY: reads and sets the server's planner hook on the process's only thread, while the
    // library loads; the previous hook is called from ours.
    unsafe {
        PREV_PLANNER.with(|p| p.set(pg_sys::planner_hook));
        pg_sys::planner_hook = Some(planner);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn planner(
    parse: *mut pg_sys::Query,
    query_string: *const std::ffi::c_char,
    cursor_options: std::ffi::c_int,
    bound_params: pg_sys::ParamListInfo,
) -> *mut pg_sys::PlannedStmt {
    // SAFETY: `parse` is the query being planned, owned by the caller and ours to change
    // before planning (as any planner hook may); the previous hook or the standard planner
    // plans it.
    unsafe {
        if citus_in_process() {
            if let Some(quals) = delegable_call_quals(parse) {
                if citus_loaded() && session_setting_set() {
                    *quals = always_true();
                }
            }
        }
        match PREV_PLANNER.with(std::cell::Cell::get) {
            Some(prev) => prev(parse, query_string, cursor_options, bound_params),
            None => pg_sys::standard_planner(parse, query_string, cursor_options, bound_params),
        }
    }
}

/// The place of the WHERE clause of a statement of the form Citus delegates, a `SELECT` of one
/// call of a function in schema idempotency (in its target list or its FROM list) and no
/// WHERE clause; None for any other statement.
///
/// # Safety
/// `parse` is a valid Query.
unsafe fn delegable_call_quals(parse: *mut pg_sys::Query) -> Option<*mut *mut pg_sys::Node> {
    // SAFETY: fields of a valid Query and of the nodes it points to, each checked for null and
    // for its node tag before it is read as that node.
    unsafe {
        if parse.is_null()
            || (*parse).commandType != pg_sys::CmdType::CMD_SELECT
            || (*parse).jointree.is_null()
            || !(*(*parse).jointree).quals.is_null()
        {
            return None;
        }
        let from = (*(*parse).jointree).fromlist;
        let call = if from.is_null() {
            let targets = (*parse).targetList;
            if targets.is_null() || (*targets).length != 1 {
                return None;
            }
            let entry = pg_sys::list_nth(targets, 0) as *mut pg_sys::TargetEntry;
            (*entry).expr as *mut pg_sys::Node
        } else {
            if (*from).length != 1 {
                return None;
            }
            let item = pg_sys::list_nth(from, 0) as *mut pg_sys::Node;
            if item.is_null() || (*item).type_ != pg_sys::NodeTag::T_RangeTblRef {
                return None;
            }
            let index = (*(item as *mut pg_sys::RangeTblRef)).rtindex;
            let rte = pg_sys::list_nth((*parse).rtable, index - 1) as *mut pg_sys::RangeTblEntry;
            if rte.is_null()
                || (*rte).rtekind != pg_sys::RTEKind::RTE_FUNCTION
                || (*rte).functions.is_null()
                || (*(*rte).functions).length != 1
            {
                return None;
            }
            let f = pg_sys::list_nth((*rte).functions, 0) as *mut pg_sys::RangeTblFunction;
            (*f).funcexpr
        };
        if call.is_null() || (*call).type_ != pg_sys::NodeTag::T_FuncExpr {
            return None;
        }
        let funcid = (*(call as *mut pg_sys::FuncExpr)).funcid;
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), true);
        if nsp == pg_sys::InvalidOid || pg_sys::get_func_namespace(funcid) != nsp {
            return None;
        }
        Some(&raw mut (*(*parse).jointree).quals)
    }
}

/// `pg_catalog.pg_backend_pid() IS NOT NULL`: true, and not folded away by the planner (the
/// function is STABLE), which Citus looks at after PostgreSQL's planner ran (`WHERE true`
/// would be gone by then). Evaluated once per execution, as a one-time filter.
///
/// # Safety
/// In a memory context that lives as long as the query.
unsafe fn always_true() -> *mut pg_sys::Node {
    // SAFETY: makeFuncExpr and palloc0 allocate in the current (planning) context; the NullTest
    // is filled in as makeNode would (tag set, the rest zeroed).
    unsafe {
        let pid = pg_sys::makeFuncExpr(
            pg_sys::Oid::from(pg_sys::F_PG_BACKEND_PID),
            pg_sys::INT4OID,
            std::ptr::null_mut(),
            pg_sys::InvalidOid,
            pg_sys::InvalidOid,
            pg_sys::CoercionForm::COERCE_EXPLICIT_CALL,
        );
        let test =
            pg_sys::palloc0(std::mem::size_of::<pg_sys::NullTest>()) as *mut pg_sys::NullTest;
        (*test).xpr.type_ = pg_sys::NodeTag::T_NullTest;
        (*test).arg = pid as *mut pg_sys::Expr;
        (*test).nulltesttype = pg_sys::NullTestType::IS_NOT_NULL;
        (*test).argisrow = false;
        (*test).location = -1;
        test as *mut pg_sys::Node
    }
}

/// Whether the Citus library is loaded in this process (it must be preloaded to work, so this
/// is settled at the first look): without it every statement goes straight to the planner,
/// with no catalog look-up of its own (the hook runs for every statement planned).
fn citus_in_process() -> bool {
    static LOADED: crate::local::BackendLocal<std::cell::Cell<Option<bool>>> =
        crate::local::BackendLocal::new(std::cell::Cell::new(None));
    LOADED.with(|l| match l.get() {
        Some(loaded) => loaded,
        None => {
            // SAFETY: a look-up of a setting by name; null when no library defined it.
            let loaded = unsafe { !crate::compat::find_setting(c"citus.node_conninfo").is_null() };
            l.set(Some(loaded));
            loaded
        }
    })
}

/// Whether Citus is installed in this database (its catalog exists).
fn citus_loaded() -> bool {
    // SAFETY: a syscache look-up by name in pg_catalog.
    unsafe {
        pg_sys::get_relname_relid(
            c"pg_dist_partition".as_ptr(),
            pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE),
        ) != pg_sys::InvalidOid
    }
}

/// Whether this session set one of [`SETTINGS`] itself: with `SET` (or `SET LOCAL`, or a
/// function's SET clause) or in its connection's options; a worker's connection from Citus has
/// neither.
fn session_setting_set() -> bool {
    SETTINGS.iter().any(|name| {
        // SAFETY: the record lives as long as the backend; only its source is read.
        unsafe {
            let record = crate::compat::find_setting(name);
            !record.is_null()
                && matches!(
                    (*record).source,
                    pg_sys::GucSource::PGC_S_SESSION | pg_sys::GucSource::PGC_S_CLIENT
                )
        }
    })
}
