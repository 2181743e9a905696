//! The composite results the library forms itself: `claim`'s `idempotency.claim_result`, the
//! rows of `claim_many` and the row of `_shared_stats`. A datum put into a column of another
//! type than the one it was built for is read as that type (a bigint read as a text pointer:
//! a crash), so each result's columns are checked before a row is formed, as the store's
//! columns are: name, type (typmod, length, by-value, alignment), not dropped. A result that
//! differs is refused with `55000`, naming the attribute. Columns after the checked ones are
//! left NULL.

use crate::error::raise;
use pgrx::pg_sys;
use pgrx::PgSqlErrorCode;
use std::ffi::CStr;

/// One column of a result the library forms.
pub(crate) struct ResultColumn {
    name: &'static CStr,
    /// The column's type (InvalidOid: the enum `idempotency.outcome`, whose OID is the
    /// installation's).
    typid: pg_sys::Oid,
    /// The type as messages name it.
    type_name: &'static str,
}

const fn column(name: &'static CStr, typid: pg_sys::Oid, type_name: &'static str) -> ResultColumn {
    ResultColumn {
        name,
        typid,
        type_name,
    }
}

const OUTCOME: ResultColumn = column(c"outcome", pg_sys::InvalidOid, "idempotency.outcome");
const TOKEN: ResultColumn = column(c"token", pg_sys::INT8OID, "bigint");
const RESPONSE: ResultColumn = column(c"response", pg_sys::JSONBOID, "jsonb");
const RESPONSE_STATUS: ResultColumn = column(c"response_status", pg_sys::INT4OID, "integer");
const RETRY_AFTER: ResultColumn = column(c"retry_after", pg_sys::INTERVALOID, "interval");
const TIMESTAMPTZ: &str = "timestamp with time zone";
const EXPIRES_AT: ResultColumn = column(c"expires_at", pg_sys::TIMESTAMPTZOID, TIMESTAMPTZ);
const RECOVERY_POINT: ResultColumn = column(c"recovery_point", pg_sys::TEXTOID, "text");

/// `idempotency.claim_result`, in the order `claim` fills it.
pub(crate) const CLAIM_RESULT: [ResultColumn; 7] = [
    OUTCOME,
    TOKEN,
    RESPONSE,
    RESPONSE_STATUS,
    RETRY_AFTER,
    EXPIRES_AT,
    RECOVERY_POINT,
];

/// The rows of `claim_many`: its position and key, then `claim_result`'s columns.
pub(crate) const CLAIM_MANY_RESULT: [ResultColumn; 9] = [
    column(c"ord", pg_sys::INT4OID, "integer"),
    column(c"key", pg_sys::TEXTOID, "text"),
    OUTCOME,
    TOKEN,
    RESPONSE,
    RESPONSE_STATUS,
    RETRY_AFTER,
    EXPIRES_AT,
    RECOVERY_POINT,
];

const fn counter(name: &'static CStr) -> ResultColumn {
    column(name, pg_sys::INT8OID, "bigint")
}

/// The OUT parameters of `_shared_stats`.
pub(crate) const SHARED_STATS_RESULT: [ResultColumn; 10] = [
    column(c"preloaded", pg_sys::BOOLOID, "boolean"),
    counter(c"claims_new"),
    counter(c"claims_replay"),
    counter(c"claims_in_progress"),
    counter(c"claims_mismatch"),
    counter(c"completions"),
    counter(c"releases"),
    counter(c"rows_swept"),
    column(c"last_sweep_at", pg_sys::TIMESTAMPTZOID, TIMESTAMPTZ),
    counter(c"last_sweep_rows"),
];

/// The OID of the enum `idempotency.outcome` (InvalidOid when there is none).
pub(crate) fn outcome_type() -> pg_sys::Oid {
    // SAFETY: catalog look-ups by name (NUL-terminated) in the calling transaction; a missing
    // schema or type is InvalidOid (missing_ok), never an ERROR.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return pg_sys::InvalidOid;
        }
        pg_sys::GetSysCacheOid(
            pg_sys::SysCacheIdentifier::TYPENAMENSP as std::ffi::c_int,
            pg_sys::Anum_pg_type_oid as pg_sys::AttrNumber,
            pg_sys::Datum::from(c"outcome".as_ptr()),
            pg_sys::Datum::from(nsp),
            pg_sys::Datum::from(0usize),
            pg_sys::Datum::from(0usize),
        )
    }
}

/// Refuses (`55000`, naming the attribute) a result descriptor whose first columns are not
/// `columns`: each present, live, of its name and of exactly its type. `what` names the result
/// in the message.
///
/// # Safety
/// `tupdesc` is a valid tuple descriptor.
pub(crate) unsafe fn check_result(
    tupdesc: pg_sys::TupleDesc,
    columns: &[ResultColumn],
    what: &str,
) {
    let outcome = if columns.iter().any(|c| c.typid == pg_sys::InvalidOid) {
        outcome_type()
    } else {
        pg_sys::InvalidOid
    };
    // SAFETY: the caller's contract; attributes are read below `natts` only.
    let natts = unsafe { (*tupdesc).natts }.max(0) as usize;
    for (i, c) in columns.iter().enumerate() {
        let expected = if c.typid == pg_sys::InvalidOid {
            outcome
        } else {
            c.typid
        };
        // SAFETY: `i < natts`.
        let a = (i < natts).then(|| unsafe { &*crate::compat::attribute(tupdesc, i) });
        let found = match a {
            None => "missing".to_string(),
            Some(a) if a.attisdropped => "dropped".to_string(),
            Some(a) => {
                // SAFETY: the attribute's own NUL-terminated name.
                let name = unsafe { CStr::from_ptr(a.attname.data.as_ptr()) };
                if name == c.name
                    && expected != pg_sys::InvalidOid
                    && crate::store::column_is(a, expected)
                {
                    continue;
                }
                // SAFETY: formats the attribute's existing type (palloc'd in the current
                // context).
                let type_name = unsafe {
                    CStr::from_ptr(pg_sys::format_type_with_typemod(a.atttypid, a.atttypmod))
                };
                format!("{} {}", name.to_string_lossy(), type_name.to_string_lossy())
            }
        };
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!(
                "idempotency: attribute {} of {what} is {found}, but the extension needs {} {}",
                i + 1,
                c.name.to_string_lossy(),
                c.type_name
            ),
            Some(
                "it was altered by hand: alter it back, or reinstall the extension \
                 (DROP EXTENSION idempotency; CREATE EXTENSION idempotency;)",
            ),
        );
    }
}
