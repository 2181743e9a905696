//! Binding settings: what holds for this session's role whatever the role runs. The scope
//! prefix, the audit switch and the size limits are read from the settings (`guc`) and the
//! session's row in `idempotency.role_settings` (`store::role_settings`: the row of the role set
//! by `SET ROLE` when it has one, else the login role's), trusting a setting only as far as who
//! set it allows.
//!
//! What binds a role is its row in `idempotency.role_settings` (`store::role_settings`): a table
//! only the extension's owner writes. PostgreSQL lets a role ALTER ROLE itself for any setting
//! it may SET (and the owner of a database ALTER DATABASE it), so a value in pg_db_role_setting
//! is only a default. The row's prefix replaces the setting, its audit adds to it, its size
//! limits lower the settings'.
//!
//! Without a row, `idempotency.scope_prefix` and `idempotency.audit` are still guarded as far as
//! the settings allow: a superuser's choice for a role (ALTER ROLE / ALTER DATABASE ... SET,
//! postgresql.conf) that the session must not undo.
//!
//! scope_prefix is superuser-only, so PostgreSQL refuses a role's own SET once the library is
//! loaded. Before that (no shared_preload_libraries) the setting is a placeholder, which takes
//! any role's value: a startup option (PGOPTIONS) even shadows the value the superuser set for
//! the role, and when the library then defines the setting PostgreSQL drops the role's value
//! with a WARNING and leaves the empty default, i.e. no prefix at all. So `guc::init` notes which
//! roles had set the placeholder, and the first use checks whether each of them may set it
//! (superuser, or GRANT SET ON PARAMETER): if one may not, the value in force is not the
//! superuser's, and every function that takes a scope refuses the session.
//!
//! audit is settable by every role (a procedure turns it on with SET LOCAL), so a superuser's
//! "on" is binding as a floor: complete audits when the session's value or the superuser's is
//! on. The floor comes from the values PostgreSQL applies from superuser-controlled sources
//! (configuration file, ALTER SYSTEM, ALTER DATABASE/ROLE ... SET), seen by a check hook, which
//! sees them all when the library is preloaded: at login the role's settings are applied after
//! the startup options, and a lower-priority value still passes the check hook. Loaded later,
//! the placeholder kept only the winning value, so the floor is read from pg_db_role_setting
//! once per session instead; where a role's startup option displaced the configuration file's
//! value (which only a superuser may read again), the session is audited.
//!
//! The size limits are superuser-only like the prefix, and floors: a row lowers them. A role's
//! startup option read before the library loaded displaces an administrator's value the same
//! way, so such a session's responses and recovery points are refused (42501).

use crate::guc::{int, AUDIT, MAX_RECOVERY_POINT_SIZE, MAX_RESPONSE_SIZE, SCOPE_PREFIX};
use crate::local::BackendLocal;
use pgrx::pg_sys;
use std::cell::Cell;

/// Some(verdict) once the setters were checked.
static PREFIX_VERDICT: BackendLocal<Cell<Option<bool>>> = BackendLocal::new(Cell::new(None));
/// Some(verdict) once the setters of max_response_size and max_recovery_point_size were checked.
static LIMIT_VERDICT: BackendLocal<Cell<[Option<bool>; 2]>> =
    BackendLocal::new(Cell::new([None; 2]));
/// Loaded after login: the floor is read from pg_db_role_setting (Some once read).
static AUDIT_FROM_CATALOG: BackendLocal<Cell<Option<bool>>> = BackendLocal::new(Cell::new(None));

/// Refuses (42501) a `scope` outside the session's bound scopes: those starting with its scope
/// prefix ([`with_scope_prefix`]); on a store distributed by its tenant
/// (`distribute(tenant_type => ...)`), the one tenant whose id the prefix is.
pub fn check_scope(scope: &str) {
    crate::error::check(with_scope_prefix(|prefix| {
        if !prefix.is_empty() && crate::store::tenant_store() {
            crate::arguments::check_tenant_allowed(scope, prefix)
        } else {
            crate::arguments::check_scope_allowed(scope, prefix)
        }
    }));
}

/// Calls `f` with the session's scope prefix ("" when none): the one `idempotency.role_settings`
/// binds the session to (the `SET ROLE` role's row, else the login role's), else
/// `idempotency.scope_prefix`, read in place (the setting's memory stays valid until it is
/// changed, which cannot happen during `f`). Refuses (42501) a session whose setting may not be
/// the one a superuser set (see [`prefix_untrusted`]), and (22021) a setting that is not valid
/// text in the database encoding.
pub fn with_scope_prefix<R>(f: impl FnOnce(&str) -> R) -> R {
    let bound = crate::store::role_settings();
    if let Some(prefix) = bound.scope_prefix.as_deref() {
        return f(prefix);
    }
    if prefix_untrusted() {
        crate::error::raise(
            pgrx::PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "idempotency.scope_prefix of this session was set by a role that may not set it, \
             so the prefix a superuser set for the role is not in force"
                .into(),
            Some(
                "connect without setting idempotency.scope_prefix (PGOPTIONS, startup options, SET \
                 before the extension was first used); preloading the library \
                 (shared_preload_libraries) refuses such settings at connection time",
            ),
        );
    }
    // SAFETY: the GUC machinery keeps a valid C string (or NULL) in the setting's variable.
    let raw = unsafe { *SCOPE_PREFIX.as_ptr() };
    if raw.is_null() {
        return f("");
    }
    // SAFETY: non-NULL, so a NUL-terminated string the GUC machinery owns; it is not changed
    // while `f` runs (no SET can run inside these functions' argument checks).
    let raw = unsafe { std::ffi::CStr::from_ptr(raw) };
    f(&crate::encoding::checked_setting_text(
        "idempotency.scope_prefix",
        raw.to_bytes(),
    ))
}

/// The largest response `complete` stores, in kB, and what sets it: the lower of
/// `idempotency.max_response_size` and the limit of the session's row in
/// `idempotency.role_settings`.
pub fn max_response_size() -> (i32, &'static str) {
    refuse_untrusted_limit(true, c"idempotency.max_response_size");
    lower_limit(
        int(&MAX_RESPONSE_SIZE),
        "idempotency.max_response_size",
        crate::store::role_settings().max_response_size,
        "idempotency.role_settings.max_response_size",
    )
}

/// As [`max_response_size`], for the recovery points `checkpoint` stores.
pub fn max_recovery_point_size() -> (i32, &'static str) {
    refuse_untrusted_limit(false, c"idempotency.max_recovery_point_size");
    lower_limit(
        int(&MAX_RECOVERY_POINT_SIZE),
        "idempotency.max_recovery_point_size",
        crate::store::role_settings().max_recovery_point_size,
        "idempotency.role_settings.max_recovery_point_size",
    )
}

/// A session may lower a limit the extension's owner bound its role to, never raise it.
fn lower_limit(
    setting: i32,
    setting_name: &'static str,
    bound: Option<i32>,
    bound_name: &'static str,
) -> (i32, &'static str) {
    match bound {
        Some(b) if b < setting => (b, bound_name),
        _ => (setting, setting_name),
    }
}

/// Whether the scope prefix in force may not be the one a superuser set (see above).
fn prefix_untrusted() -> bool {
    if let Some(v) = PREFIX_VERDICT.with(Cell::get) {
        return v;
    }
    let untrusted = set_by_untrusted(crate::guc::prefix_setters(), c"idempotency.scope_prefix");
    PREFIX_VERDICT.with(|c| c.set(Some(untrusted)));
    untrusted
}

/// Refuses (42501) a session whose size limit was set, before the library was loaded, by a role
/// that may not set it: as for the scope prefix, the value an administrator set (server,
/// database, role) was displaced by the role's and then dropped, so the limit in force would be
/// the default, which may be higher than the administrator's.
fn refuse_untrusted_limit(response: bool, name: &'static std::ffi::CStr) {
    let i = usize::from(!response);
    let mut verdicts = LIMIT_VERDICT.with(Cell::get);
    let untrusted = *verdicts[i]
        .get_or_insert_with(|| set_by_untrusted(crate::guc::limit_setters(response), name));
    LIMIT_VERDICT.with(|c| c.set(verdicts));
    if untrusted {
        let name = name.to_string_lossy();
        crate::error::raise(
            pgrx::PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            format!(
                "{name} of this session was set by a role that may not set it, so the limit an \
                 administrator set is not in force"
            ),
            Some(
                "connect without setting the limit (PGOPTIONS, startup options, SET before the \
                 extension was first used); preloading the library (shared_preload_libraries) \
                 refuses such settings at connection time",
            ),
        );
    }
}

/// Whether one of `setters` (roles that set `name`'s placeholder) may not set `name`: neither
/// superuser nor granted SET on it.
fn set_by_untrusted(setters: [pg_sys::Oid; 8], name: &std::ffi::CStr) -> bool {
    setters
        .iter()
        .filter(|r| **r != pg_sys::InvalidOid)
        .any(|&role| {
            // SAFETY: catalog look-ups inside the calling function's transaction.
            unsafe {
                !pg_sys::superuser_arg(role)
                    && pg_sys::pg_parameter_aclcheck(
                        name.as_ptr(),
                        role,
                        pg_sys::ACL_SET as pg_sys::AclMode,
                    ) != pg_sys::AclResult::ACLCHECK_OK
            }
        })
}

/// Whether `complete` writes an audit row: the session's `idempotency.audit`, a superuser's
/// choice for the session's login role and database, or the `audit` of the session's row in
/// `idempotency.role_settings` (the only one of them the role cannot undo).
pub fn audit() -> bool {
    // SAFETY: the GUC machinery keeps the variable valid for the backend's lifetime.
    if unsafe { *AUDIT.as_ptr() } || crate::guc::audit_floor() {
        return true;
    }
    if crate::store::role_settings().audit {
        return true;
    }
    if !crate::guc::loaded_late() {
        return false;
    }
    if let Some(v) = AUDIT_FROM_CATALOG.with(Cell::get) {
        return v;
    }
    // A role's startup option displaced the server configuration's value before the library
    // loaded, and only a superuser may read that file again: the floor is unknown, so the session
    // is audited (an extra audit row costs less than a missing one).
    let v =
        set_by_untrusted(crate::guc::audit_setter(), c"idempotency.audit") || audit_from_catalog();
    AUDIT_FROM_CATALOG.with(|c| c.set(Some(v)));
    v
}

/// Whether ALTER DATABASE/ROLE ... SET turned `idempotency.audit` on for this session's login
/// role and database (any of the four levels, combined with OR as above).
fn audit_from_catalog() -> bool {
    let _path = crate::compat::SearchPathPin::pin();
    // SAFETY: reads backend variables.
    let (database, role) = unsafe { (pg_sys::MyDatabaseId, pg_sys::GetSessionUserId()) };
    // Judged in SQL, so no entry's text (any database's encoding) crosses into Rust; the
    // spellings are those parse_bool accepts for true.
    pgrx::Spi::get_one_with_args::<bool>(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_db_role_setting AS s, \
                                    pg_catalog.unnest(s.setconfig) AS c(entry) \
              WHERE s.setdatabase OPERATOR(pg_catalog.=) ANY (ARRAY[$1, 0]::pg_catalog.oid[]) \
                AND s.setrole OPERATOR(pg_catalog.=) ANY (ARRAY[$2, 0]::pg_catalog.oid[]) \
                AND pg_catalog.lower(pg_catalog.split_part(c.entry, '=', 1)) \
                    OPERATOR(pg_catalog.=) 'idempotency.audit' \
                AND pg_catalog.lower(pg_catalog.btrim(pg_catalog.substr(c.entry, \
                      pg_catalog.strpos(c.entry, '=') OPERATOR(pg_catalog.+) 1))) \
                    OPERATOR(pg_catalog.=) ANY (ARRAY['on', 'true', 'tru', 'tr', 't', 'yes', 'ye', 'y', '1']))",
        &[database.into(), role.into()],
    )
    .unwrap_or_else(|e| {
        crate::error::raise(
            pgrx::PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
            format!("idempotency: reading pg_db_role_setting: {e}"),
            None,
        )
    })
    .unwrap_or(false)
}
