//! The statements the store runs, each prepared once per backend, and the calls that run them
//! through SPI.
//!
//! Shared here: the statements' tenant parameter, the kept plans and the one function that
//! prepares them ([`plan`]), and the SPI connection with the search path pinned. The
//! statements and their calls, by algorithm:
//!
//! - [`claim`]: reading the key's row, writing a claim (insert, restart, takeover, and the
//!   token above the old one that the last two need), the batch insert of `claim_many`;
//! - [`complete`]: storing the response;
//! - [`audit`]: the audit row of a completion, and the audit table's sweep statement;
//! - [`sweep`]: the deletes of expired rows and the count of rows expired since a time;
//! - [`parts`]: the parts of a table this node holds (Citus shards or partitions), and a sweep
//!   run part by part.

use super::catalog::{tenant_type, PinnedSearchPath};
use crate::error::raise;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient};
use pgrx::PgOid;
use pgrx::PgSqlErrorCode;
use std::cell::Cell;

mod audit;
mod claim;
mod complete;
mod parts;
mod sweep;

pub(crate) use audit::{audit, audit_plans, audit_sweep_sql, AUDIT};
pub(crate) use claim::{insert_batch, read_row, write_claim, Write};
use claim::{insert_sql, restart_sql, select_sql, takeover_sql, InsertRows, NEXT_TOKEN_SQL};
pub(crate) use complete::complete_sql;
use complete::complete_statement;
pub(crate) use parts::{local_parts, sweep_local_shards};
use sweep::sweep_by_expires_at_sql;
pub(crate) use sweep::{expired_since_sql, sweep_sql};

/// The parameter that carries the key's tenant in a statement that names a key, on a store
/// distributed by its tenant (`distribute(tenant_type => ...)`, `catalog::tenant_type`): its
/// number, the statement's last; None on every other store. Each such statement also names the
/// tenant, so that Citus routes it to the tenant's shard: the row's match ([`key_match`]), the
/// inserts' `tenant` column and `ON CONFLICT (scope, key, tenant)`, the primary key there.
type TenantParam = Option<usize>;

/// How a statement finds the key's row: `k.scope = $1 AND k.key = $2`, and the tenant.
fn key_match(tenant: TenantParam) -> String {
    let mut m =
        String::from("k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2");
    if let Some(n) = tenant {
        m.push_str(&format!(" AND k.tenant OPERATOR(pg_catalog.=) ${n}"));
    }
    m
}

/// `", tenant"` (or `", $n"`) where a statement lists the tenant column (or its value).
fn tenant_column(tenant: TenantParam) -> &'static str {
    if tenant.is_some() {
        ", tenant"
    } else {
        ""
    }
}

fn tenant_value(tenant: TenantParam) -> String {
    tenant.map(|n| format!(", ${n}")).unwrap_or_default()
}

/// The statements claim and sweep run, each prepared once per backend (SPI_keepplan) when it
/// is first needed, so a claim pays for execution only. PostgreSQL's plan cache re-plans them
/// after DDL on the table, re-resolving names, so they survive even DROP and CREATE EXTENSION
/// in one session. Prepared one by one, not all at once: a statement that cannot be planned
/// on the table as it is (an INSERT ... ON CONFLICT on a table with rules, which PostgreSQL
/// refuses) fails only where it is used, not every statement with it.
#[derive(Clone, Copy)]
pub(crate) enum Plan {
    Select,
    SelectLocked,
    Insert,
    InsertFresh,
    Restart,
    TakeOver,
    Complete,
    Sweep,
    SweepByExpiresAt,
    NextToken,
    InsertBatch,
    InsertBatchOnConflict,
}

pub(crate) const PLAN_COUNT: usize = Plan::InsertBatchOnConflict as usize + 1;

pub(crate) static PLANS: crate::local::BackendLocal<
    [Cell<Option<&'static OwnedPreparedStatement>>; PLAN_COUNT],
> = crate::local::BackendLocal::new([const { Cell::new(None) }; PLAN_COUNT]);

/// The argument types of a statement, with the tenant's type appended on a store distributed
/// by its tenant ([`TenantParam`]).
fn args_with_tenant(args: &[PgOid], tenant: pg_sys::Oid) -> Vec<PgOid> {
    let mut v = args.to_vec();
    if tenant != pg_sys::InvalidOid {
        v.push(PgOid::from(tenant));
    }
    v
}

/// The tenant type the kept statements were prepared for (see [`TenantParam`]): when the
/// store's changes (`distribute(tenant_type => ...)` in this session), they are prepared again.
static PLANS_TENANT: crate::local::BackendLocal<Cell<pg_sys::Oid>> =
    crate::local::BackendLocal::new(Cell::new(pg_sys::InvalidOid));

/// The key's tenant as an argument of the statements ([`TenantParam`]) on a store distributed
/// by its tenant, None on any other store. The scope is the tenant id's text form, exactly as
/// the type writes it (`'42'`, `'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'`), so that one tenant
/// has one scope (a CHECK constraint of the table holds the same rule); any other scope is
/// refused (22P02, naming it) before anything is read or written.
pub(crate) fn tenant_arg(scope: &str) -> Option<pgrx::datum::DatumWithOid<'static>> {
    let tenant = tenant_type();
    if tenant == pg_sys::InvalidOid {
        return None;
    }
    if tenant == pg_sys::INT8OID {
        if let Ok(id) = scope.parse::<i64>() {
            if id.to_string() == scope {
                return Some(id.into());
            }
        }
        bad_tenant(scope, "a bigint written as PostgreSQL writes it, e.g. '42'");
    }
    let bytes = scope.as_bytes();
    let canonical = bytes.len() == 36
        && bytes.iter().enumerate().all(|(i, &b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        });
    if canonical {
        let hex: String = scope.chars().filter(|&c| c != '-').collect();
        let mut uuid = [0u8; 16];
        for (i, byte) in uuid.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0);
        }
        return Some(pgrx::datum::Uuid::from_bytes(uuid).into());
    }
    bad_tenant(
        scope,
        "a uuid written as PostgreSQL writes it, lower case with hyphens, e.g. 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'",
    )
}

fn bad_tenant(scope: &str, form: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_INVALID_TEXT_REPRESENTATION,
        format!("scope must be a tenant id of this store, {form}: got {scope:?}"),
        Some(
            "the store is distributed by its tenant (idempotency.distribute(tenant_type => ...)): \
             pass the tenant id as the scope, e.g. idempotency.claim(key, request, 42)",
        ),
    )
}

pub(crate) fn plan(
    client: &SpiClient<'_>,
    which: Plan,
) -> Result<&'static OwnedPreparedStatement, pgrx::spi::Error> {
    // The sweep's statements and the token's name no key: the same on every store.
    let keyed = !matches!(
        which,
        Plan::Sweep | Plan::SweepByExpiresAt | Plan::NextToken
    );
    let tenant = if keyed {
        tenant_type()
    } else {
        pg_sys::InvalidOid
    };
    if keyed && PLANS_TENANT.with(Cell::get) != tenant {
        // Prepared for another store: leave them (kept plans are not freed) and start again.
        PLANS.with(|c| c.iter().for_each(|p| p.set(None)));
        PLANS_TENANT.with(|c| c.set(tenant));
    }
    if let Some(p) = PLANS.with(|c| c[which as usize].get()) {
        return Ok(p);
    }
    let text = PgOid::from(pg_sys::TEXTOID);
    // The tenant's parameter number in a statement of n parameters without it.
    let at = |n: usize| (tenant != pg_sys::InvalidOid).then_some(n);
    let key_args = args_with_tenant(&[text, text], tenant);
    let claim_args = args_with_tenant(
        &[
            text,
            text,
            PgOid::from(pg_sys::BYTEAOID),
            PgOid::from(pg_sys::INTERVALOID),
            PgOid::from(pg_sys::INTERVALOID),
        ],
        tenant,
    );
    let token_args = args_with_tenant(
        &[
            text,
            text,
            PgOid::from(pg_sys::BYTEAOID),
            PgOid::from(pg_sys::INTERVALOID),
            PgOid::from(pg_sys::INTERVALOID),
            PgOid::from(pg_sys::INT8OID),
        ],
        tenant,
    );
    let prepared = match which {
        Plan::Select => client
            .prepare(select_sql(false, at(3)).as_str(), &key_args)?
            .keep(),
        Plan::SelectLocked => client
            .prepare_mut(select_sql(true, at(3)).as_str(), &key_args)?
            .keep(),
        Plan::Insert | Plan::InsertFresh => client
            .prepare_mut(
                insert_sql(InsertRows::One, matches!(which, Plan::Insert), at(6)).as_str(),
                &claim_args,
            )?
            .keep(),
        Plan::Restart => client
            .prepare_mut(restart_sql(at(7)).as_str(), &token_args)?
            .keep(),
        Plan::TakeOver => client
            .prepare_mut(takeover_sql(at(7)).as_str(), &token_args)?
            .keep(),
        Plan::NextToken => client.prepare_mut(NEXT_TOKEN_SQL, &[])?.keep(),
        Plan::InsertBatch | Plan::InsertBatchOnConflict => client
            .prepare_mut(
                insert_sql(
                    InsertRows::Batch,
                    matches!(which, Plan::InsertBatchOnConflict),
                    at(6),
                )
                .as_str(),
                &args_with_tenant(
                    &[
                        text,
                        PgOid::from(pg_sys::TEXTARRAYOID),
                        PgOid::from(pg_sys::BYTEAARRAYOID),
                        PgOid::from(pg_sys::INTERVALOID),
                        PgOid::from(pg_sys::INTERVALOID),
                    ],
                    tenant,
                ),
            )?
            .keep(),
        Plan::Complete => client
            .prepare_mut(
                complete_statement(at(7)).as_str(),
                &args_with_tenant(
                    &[
                        text,
                        text,
                        PgOid::from(pg_sys::JSONBOID),
                        PgOid::from(pg_sys::INT4OID),
                        PgOid::from(pg_sys::INT8OID),
                        PgOid::from(pg_sys::INTERVALOID),
                    ],
                    tenant,
                ),
            )?
            .keep(),
        Plan::SweepByExpiresAt => client
            .prepare_mut(
                sweep_by_expires_at_sql().as_str(),
                &[PgOid::from(pg_sys::INT8OID), text],
            )?
            .keep(),
        Plan::Sweep => client
            .prepare_mut(
                sweep_sql(STORE).as_str(),
                &[
                    PgOid::from(pg_sys::INT8OID),
                    text,
                    PgOid::from(pg_sys::TIMESTAMPOID),
                ],
            )?
            .keep(),
    };
    let p: &'static OwnedPreparedStatement = Box::leak(Box::new(prepared));
    PLANS.with(|c| c[which as usize].set(Some(p)));
    Ok(p)
}

/// Runs statements through SPI with the search path pinned (see [`PinnedSearchPath`]). Only
/// the paths that run SQL pin it: the look-up and the direct writes resolve no names.
pub(crate) fn with_spi<R>(f: impl FnOnce(&mut SpiClient<'_>) -> R) -> R {
    let _path = PinnedSearchPath::pin();
    Spi::connect_mut(f)
}

/// The store table, as statements name it.
pub(crate) const STORE: &str = "idempotency.idempotency_keys";
