//! The settings that bind the session's role (`idempotency.role_settings`, kept by the
//! extension's owner), read once and cached per backend until the table changes.
//!
//! Which row binds: that of the role the session switched to with `SET ROLE` (also `SET LOCAL
//! ROLE`, `set_config('role', ...)`, a function's `SET role` clause or a `role` startup option:
//! PostgreSQL's outer user, which a SECURITY DEFINER function does not change) when that role
//! has a row, else the login role's (the session user, which `SET SESSION AUTHORIZATION`
//! changes). A pooler or a service role (PgBouncer's `user=`, PostgREST's authenticator) logs
//! every client in as one role and switches to each client's role per transaction: the switched
//! role's row binds it. A switch to a role without a row keeps the login role's row, so a role
//! never leaves its binding by switching.
//!
//! The table's statement-level trigger (`_role_settings_changed`) invalidates the table's
//! relation cache entry; the invalidation reaches every backend when the changing transaction
//! commits (and this backend at once), and [`forget`] drops the cached rows. A row is read
//! with a fresh snapshot (the catalog snapshot, as the server's own caches read the catalog),
//! not the transaction's: a REPEATABLE READ transaction that started before the change would
//! otherwise cache the old row after the invalidation came in, for the rest of the session.

use super::{attribute, column_is, relation_oid};
use crate::error::raise;
use pgrx::pg_sys;
use pgrx::PgSqlErrorCode;
use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// The row that binds the session (all None/false: no row, nothing bound).
#[derive(Default, Debug)]
pub struct RoleSettings {
    /// In UTF-8 (converted from the database encoding).
    pub scope_prefix: Option<String>,
    pub audit: bool,
    /// kB.
    pub max_response_size: Option<i32>,
    /// kB.
    pub max_recovery_point_size: Option<i32>,
}

/// The settings found for one pair of the role set by `SET ROLE` (the outer user) and the
/// login role (the session user).
struct Cached {
    outer: pg_sys::Oid,
    session: pg_sys::Oid,
    settings: Rc<RoleSettings>,
}

/// How many pairs are kept: a pooled session switches among a few roles, one per transaction;
/// beyond this many the oldest pair is read again when it comes back.
const CACHED_PAIRS: usize = 8;

static CACHED: crate::local::BackendLocal<RefCell<Vec<Cached>>> =
    crate::local::BackendLocal::new(RefCell::new(Vec::new()));
/// The table's OID as last looked up (InvalidOid: not yet, or the table does not exist).
static RELID: crate::local::BackendLocal<Cell<pg_sys::Oid>> =
    crate::local::BackendLocal::new(Cell::new(pg_sys::InvalidOid));
/// Counts the invalidations of the table: a row read while one came in is used, not cached.
static GENERATION: crate::local::BackendLocal<Cell<u64>> =
    crate::local::BackendLocal::new(Cell::new(0));

/// Called for every relation cache invalidation (see `catalog::forget`): drops the cached rows
/// when the table's entry, or every entry, is invalidated. Calls no server function.
pub(super) fn forget(relid: pg_sys::Oid) {
    if relid == pg_sys::InvalidOid || relid == RELID.with(Cell::get) {
        GENERATION.with(|g| g.set(g.get().wrapping_add(1)));
        // Never borrowed across a server call, so never borrowed here.
        CACHED.with(|c| {
            if let Ok(mut c) = c.try_borrow_mut() {
                c.clear();
            }
        });
    }
}

// Read backend state and cannot raise an error: called directly, without pgrx's per-call error
// boundary (this runs on every claim).
use crate::compat::raw::{GetOuterUserId, GetSessionUserId};

/// The settings that bind the session, from `idempotency.role_settings`: the row of the role
/// set by `SET ROLE` when it has one, else the login role's (see the module's comment).
pub fn role_settings() -> Rc<RoleSettings> {
    // SAFETY: read backend variables (set at login, by SET ROLE and by SET SESSION
    // AUTHORIZATION); never raise an error.
    let (outer, session) = unsafe { (GetOuterUserId(), GetSessionUserId()) };
    if let Some(s) = CACHED.with(|c| {
        c.borrow()
            .iter()
            .find(|c| c.outer == outer && c.session == session)
            .map(|c| c.settings.clone())
    }) {
        return s;
    }
    super::register_callback();
    let relid = relation_oid(c"role_settings");
    RELID.with(|r| r.set(relid));
    if relid == pg_sys::InvalidOid {
        // An install not yet updated to 0.5.0: nothing binds. Not cached (the update creates
        // the table, whose OID is not known here), so looked up again at the next call.
        return Rc::new(RoleSettings::default());
    }
    let generation = GENERATION.with(Cell::get);
    let switched = if outer != session {
        read(relid, outer)
    } else {
        None
    };
    let settings = Rc::new(
        switched
            .or_else(|| read(relid, session))
            .unwrap_or_default(),
    );
    if GENERATION.with(Cell::get) == generation {
        CACHED.with(|c| {
            let mut c = c.borrow_mut();
            if c.len() >= CACHED_PAIRS {
                c.remove(0);
            }
            c.push(Cached {
                outer,
                session,
                settings: settings.clone(),
            });
        });
    }
    settings
}

/// A table or column that is not as the extension made it: refused (55000), never misread.
fn refuse(what: &str, expected: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
        format!("idempotency: {what} is missing or altered, but the extension needs {expected}"),
        Some("it was altered by hand: alter it back, or reinstall the extension"),
    )
}

/// Reads `role`'s row of the table `relid` (None: the role has no row).
fn read(relid: pg_sys::Oid, role: pg_sys::Oid) -> Option<RoleSettings> {
    const COLUMNS: [(&std::ffi::CStr, pg_sys::Oid, &str); 5] = [
        (c"role", pg_sys::REGROLEOID, "regrole"),
        (c"scope_prefix", pg_sys::TEXTOID, "text"),
        (c"audit", pg_sys::BOOLOID, "boolean"),
        (c"max_response_size", pg_sys::INT4OID, "integer"),
        (c"max_recovery_point_size", pg_sys::INT4OID, "integer"),
    ];
    let mut settings = None;
    // SAFETY: opens the table by the OID the catalog just gave (AccessShareLock, held to the end
    // of the transaction as every reader's; a table dropped meanwhile is a clean ERROR), checks
    // that it is a heap table whose columns are of the types read below, and scans it with a
    // registered snapshot taken now (systable_beginscan with no snapshot), with a key on the
    // `role` column (an oid, compared by oideq). Each tuple is deformed with the relation's own
    // descriptor into arrays of its length; the text is copied out before the scan ends.
    unsafe {
        let rel = pg_sys::table_open(relid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        if (*(*rel).rd_rel).relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char
            || (*rel).rd_tableam.is_null()
        {
            pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
            refuse("idempotency.role_settings", "a table");
        }
        let mut att = [0usize; 5];
        for (i, (name, typid, type_name)) in COLUMNS.iter().enumerate() {
            match attribute(rel, name) {
                Some(a) if column_is(a, *typid) => att[i] = a.attnum as usize,
                _ => {
                    pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
                    let column = name.to_str().unwrap_or("?");
                    refuse(&format!("idempotency.role_settings.{column}"), type_name);
                }
            }
        }
        let desc = (*rel).rd_att;
        let natts = (*desc).natts as usize;
        let mut key = pg_sys::ScanKeyData::default();
        pg_sys::ScanKeyInit(
            &mut key,
            att[0] as pg_sys::AttrNumber,
            pg_sys::BTEqualStrategyNumber as pg_sys::StrategyNumber,
            pg_sys::Oid::from(pg_sys::F_OIDEQ),
            pg_sys::Datum::from(role),
        );
        let scan = pg_sys::systable_beginscan(
            rel,
            pg_sys::InvalidOid,
            false,
            std::ptr::null_mut(),
            1,
            &mut key,
        );
        let mut values = vec![pg_sys::Datum::from(0usize); natts];
        let mut nulls = vec![true; natts];
        let tuple = pg_sys::systable_getnext(scan);
        if !tuple.is_null() {
            pg_sys::heap_deform_tuple(tuple, desc, values.as_mut_ptr(), nulls.as_mut_ptr());
            let get = |i: usize| {
                let n = att[i] - 1;
                (!nulls[n]).then_some(values[n])
            };
            settings = Some(RoleSettings {
                scope_prefix: get(1).map(|d| prefix_text(crate::encoding::text_bytes(d))),
                audit: get(2).is_some_and(|d| d.value() != 0),
                max_response_size: get(3).map(|d| d.value() as i32),
                max_recovery_point_size: get(4).map(|d| d.value() as i32),
            });
        }
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
    }
    settings
}

/// The row's scope prefix as UTF-8 (text taken in by PostgreSQL is valid in the database
/// encoding; checked anyway, as for the setting).
fn prefix_text(bytes: &[u8]) -> String {
    crate::encoding::checked_setting_text("idempotency.role_settings.scope_prefix", bytes)
        .into_owned()
}
