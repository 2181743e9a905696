//! The audit table's statements: the row each completion appends (`idempotency.audit = on`),
//! with the role that completed, and the sweep of old audit rows; prepared on first use.

use super::sweep::delete_skip_locked;
use super::{args_with_tenant, tenant_arg, tenant_column, tenant_value, TenantParam};
use crate::encoding;
use crate::error::raise;
use crate::store::catalog::{keys_hashed, relation_oid, tenant_type};
use crate::store::spi_failed;
use crate::store::{CompleteRequest, Completed};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient};
use pgrx::PgOid;
use pgrx::PgSqlErrorCode;
use std::cell::Cell;

/// One audit row per completion (`idempotency.audit = on`), in the completing transaction.
fn audit_sql(tenant: TenantParam) -> String {
    format!(
        "INSERT INTO idempotency.audit \
           (scope, key, key_is_hash, request_hash, token, response_status, completed_at, \
            completed_by{}) \
         VALUES ($1, $2, $3, $4, $5, $6, pg_catalog.now(), $7{})",
        tenant_column(tenant),
        tenant_value(tenant)
    )
}

/// The audit table, as statements name it.
pub(crate) const AUDIT: &str = "idempotency.audit";

/// Deletes up to $2 audit rows of `table` (the audit table, or one part of it) older than $1
/// seconds whose scope starts with $3 ('' for all), skipping rows other transactions hold.
pub(crate) fn audit_sweep_sql(table: &str) -> String {
    delete_skip_locked(
        table,
        "s.completed_at OPERATOR(pg_catalog.<) (pg_catalog.now() \
           OPERATOR(pg_catalog.-) pg_catalog.make_interval(secs => $1)) \
         AND pg_catalog.starts_with(s.scope, $3)",
        "",
        "$2",
        "",
    )
}

/// The audit statements, prepared on first use (a store created by release 0.1.0 and not yet
/// updated has no audit table).
pub(crate) struct AuditPlans {
    pub(crate) insert: OwnedPreparedStatement,
    pub(crate) sweep: OwnedPreparedStatement,
}

pub(crate) static AUDIT_PLANS: crate::local::BackendLocal<Cell<Option<&'static AuditPlans>>> =
    crate::local::BackendLocal::new(Cell::new(None));

static AUDIT_PLANS_TENANT: crate::local::BackendLocal<Cell<pg_sys::Oid>> =
    crate::local::BackendLocal::new(Cell::new(pg_sys::InvalidOid));

pub(crate) fn audit_plans(client: &SpiClient<'_>) -> Result<&'static AuditPlans, pgrx::spi::Error> {
    let tenant = tenant_type();
    if AUDIT_PLANS_TENANT.with(Cell::get) != tenant {
        // Prepared for another store (see [`PLANS_TENANT`]).
        AUDIT_PLANS.with(|c| c.set(None));
        AUDIT_PLANS_TENANT.with(|c| c.set(tenant));
    }
    if let Some(p) = AUDIT_PLANS.with(Cell::get) {
        return Ok(p);
    }
    let exists = relation_oid(c"audit") != pg_sys::InvalidOid;
    if !exists {
        raise(
            PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
            "idempotency.audit does not exist".into(),
            Some("update the extension: ALTER EXTENSION idempotency UPDATE"),
        );
    }
    let oid = |o| PgOid::from(o);
    let p: &'static AuditPlans = Box::leak(Box::new(AuditPlans {
        insert: client
            .prepare_mut(
                audit_sql((tenant != pg_sys::InvalidOid).then_some(8)).as_str(),
                &args_with_tenant(
                    &[
                        oid(pg_sys::TEXTOID),
                        oid(pg_sys::TEXTOID),
                        oid(pg_sys::BOOLOID),
                        oid(pg_sys::BYTEAOID),
                        oid(pg_sys::INT8OID),
                        oid(pg_sys::INT4OID),
                        oid(pg_sys::TEXTOID),
                    ],
                    tenant,
                ),
            )?
            .keep(),
        sweep: client
            .prepare_mut(
                audit_sweep_sql(AUDIT).as_str(),
                &[
                    oid(pg_sys::FLOAT8OID),
                    oid(pg_sys::INT8OID),
                    oid(pg_sys::TEXTOID),
                ],
            )?
            .keep(),
    }));
    AUDIT_PLANS.with(|c| c.set(Some(p)));
    Ok(p)
}

/// The role that completes: the session's current role (SET ROLE), not the owner of the
/// SECURITY DEFINER function that runs the statement. Its name's bytes as the catalog holds
/// them, not through a UTF-8 string (as `current_user` gives it, in any database encoding).
fn completing_role<'a>() -> pgrx::datum::DatumWithOid<'a> {
    // SAFETY: GetUserNameFromId returns a palloc'd, NUL-terminated name (it raises an ERROR
    // for a role that does not exist); the text datum is a copy of its bytes.
    unsafe {
        let name = pg_sys::GetUserNameFromId(pg_sys::GetOuterUserId(), false);
        let len = std::ffi::CStr::from_ptr(name).to_bytes().len();
        let text = pg_sys::cstring_to_text_with_len(name, len as i32);
        pgrx::datum::DatumWithOid::new(pg_sys::Datum::from(text), pg_sys::TEXTOID)
    }
}

/// Appends the audit row of a completion, in the completing transaction.
pub(crate) fn audit(req: &CompleteRequest<'_>, done: &Completed) {
    Spi::connect_mut(|client| {
        let audit = audit_plans(client)?;
        let mut args = vec![
            encoding::spi_text(req.scope, "scope"),
            encoding::spi_text(req.key, "key"),
            keys_hashed().into(),
            done.request_hash.clone().into(),
            done.token.into(),
            req.response_status.into(),
            completing_role(),
        ];
        args.extend(tenant_arg(req.scope));
        client.update(&audit.insert, None, &args)?;
        Ok(())
    })
    .unwrap_or_else(|e| spi_failed("complete", e))
}
