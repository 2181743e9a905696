//! The statement of a completion (the UPDATE that stores the response on the live in-progress
//! claim) and its call.

use super::{key_match, plan, tenant_arg, Plan, TenantParam};
use crate::encoding;
use crate::store::spi_failed;
use crate::store::{CompleteRequest, Completed};
use pgrx::datum::TimestampWithTimeZone;
use pgrx::pg_sys;
use pgrx::prelude::*;

/// Stores the response on the live in-progress claim (with the right token, when given).
pub(super) fn complete_statement(tenant: TenantParam) -> String {
    format!(
        "UPDATE idempotency.idempotency_keys AS k SET \
           status = 'completed'::idempotency.key_status, response = $3, response_status = $4, \
           completed_at = pg_catalog.now(), locked_until = NULL, \
           expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) COALESCE($6, k.ttl), \
           ttl = COALESCE($6, k.ttl) \
         WHERE {} \
           AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status \
           AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() \
           AND ($5 IS NULL OR k.token OPERATOR(pg_catalog.=) $5) \
         RETURNING k.expires_at, k.request_hash, k.token",
        key_match(tenant)
    )
}

pub(crate) fn complete_sql(req: &CompleteRequest<'_>) -> Option<Completed> {
    let response = req
        .response
        // SAFETY: the response is a jsonb datum (the SQL function's argument, checked by it).
        .map(|d| unsafe { pgrx::datum::DatumWithOid::new(d, pg_sys::JSONBOID) });
    Spi::connect_mut(|client| {
        let complete = plan(client, Plan::Complete)?;
        let response = match response {
            Some(d) => d,
            None => pgrx::datum::DatumWithOid::null_oid(pg_sys::JSONBOID),
        };
        let mut args = vec![
            encoding::spi_text(req.scope, "scope"),
            encoding::spi_text(req.key, "key"),
            response,
            req.response_status.into(),
            req.token.into(),
            req.ttl.into(),
        ];
        args.extend(tenant_arg(req.scope));
        let table = client.update(complete, None, &args)?;
        if table.is_empty() {
            return Ok(None);
        }
        let row = table.first();
        Ok(Some(Completed {
            expires_at: row.get::<TimestampWithTimeZone>(1)?,
            request_hash: row.get::<Vec<u8>>(2)?,
            token: row.get::<i64>(3)?,
        }))
    })
    .unwrap_or_else(|e| spi_failed("complete", e))
}
