//! The composite results the library forms itself: `claim`'s `idempotency.claim_result`, the
//! rows of `claim_many` and the row of `_shared_stats`. A datum put into a column of another
//! type than the one it was built for is read as that type (a bigint read as a text pointer:
//! a crash), so each result's columns are checked before a row is formed, as the store's
//! columns are: name, type (typmod, length, by-value, alignment), not dropped. A result that
//! differs is refused with `55000`, naming the attribute. Columns after the checked ones are
//! left NULL.

use crate::encoding;
use crate::error::raise;
use crate::stats::Event;
use crate::store::{ClaimResult, Outcome};
use pgrx::pg_sys;
use pgrx::prelude::*;
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
pub(crate) const SHARED_STATS_RESULT: [ResultColumn; 15] = [
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
    counter(c"takeovers"),
    counter(c"stale_tokens_refused"),
    counter(c"claims_waited"),
    column(c"claim_wait_seconds", pg_sys::FLOAT8OID, "double precision"),
    column(c"last_sweep_error", pg_sys::TEXTOID, "text"),
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

// Forming rows ------------------------------------------------------------------------------

/// Builds the function's composite result (its declared row type or OUT parameters).
///
/// # Safety
/// `fcinfo` is the current call; `fields` are datums of the types of `columns`.
pub(super) unsafe fn form_tuple(
    fcinfo: pg_sys::FunctionCallInfo,
    columns: &[ResultColumn],
    required: usize,
    what: &str,
    fields: &[Option<pg_sys::Datum>],
) -> pg_sys::Datum {
    // SAFETY: the caller's guarantees. The descriptor comes from the call's declared result,
    // checked to be a composite whose first columns are `columns` (so every field goes into a
    // column of its datum's type), and is blessed before the tuple is formed in the call's
    // memory context.
    unsafe {
        let mut tupdesc: pg_sys::TupleDesc = std::ptr::null_mut();
        let class = pg_sys::get_call_result_type(fcinfo, std::ptr::null_mut(), &mut tupdesc);
        if class != pg_sys::TypeFuncClass::TYPEFUNC_COMPOSITE || tupdesc.is_null() {
            raise(
                PgSqlErrorCode::ERRCODE_DATATYPE_MISMATCH,
                "function result type does not match the extension's declaration".into(),
                Some("reinstall the extension"),
            );
        }
        debug_assert!(fields.len() <= columns.len());
        // A declaration of an earlier release ends sooner: its columns get their fields.
        let natts =
            ((*tupdesc).natts.max(0) as usize).clamp(required.min(columns.len()), columns.len());
        check_result(tupdesc, &columns[..natts], what);
        tuple_datum(
            pg_sys::BlessTupleDesc(tupdesc),
            &fields[..natts.min(fields.len())],
        )
    }
}

/// `claim_result`'s row descriptor and the OIDs of the `outcome` labels, checked and looked up
/// once per backend and again whenever the type's descriptor changes: recreated (a new OID) or
/// altered (`ALTER TYPE ... ALTER ATTRIBUTE`, an update of the extension), which gives the
/// type cache's descriptor a new identifier.
#[derive(Clone, Copy)]
pub(super) struct ResultType {
    typid: pg_sys::Oid,
    /// The type cache's `tupDesc_identifier` of the descriptor that was checked.
    identifier: u64,
    tupdesc: pg_sys::TupleDesc,
    /// new, replay, in_progress, mismatch
    outcomes: [pg_sys::Datum; 4],
}

pub(super) static RESULT_TYPE: crate::local::BackendLocal<std::cell::Cell<Option<ResultType>>> =
    crate::local::BackendLocal::new(std::cell::Cell::new(None));

/// # Safety
/// `fcinfo` is the current call of `claim`.
pub(super) unsafe fn result_type(fcinfo: pg_sys::FunctionCallInfo) -> ResultType {
    // SAFETY: the call's flinfo names the declared result type; the type cache entry of an
    // existing type is never freed, and its descriptor is read only when present. The checked
    // descriptor is a copy in the call's context; the cached one a copy of it in
    // TopMemoryContext, so it outlives the call, as the per-backend cache needs (the copy it
    // replaces is freed: no tuple refers to its descriptor). The enum labels' OIDs are plain
    // values. `compat::attribute(tupdesc, 0)` is in range: the check found 7 columns.
    unsafe {
        let typid = pg_sys::get_fn_expr_rettype((*fcinfo).flinfo);
        let entry = if typid == pg_sys::InvalidOid {
            std::ptr::null_mut()
        } else {
            pg_sys::lookup_type_cache(typid, pg_sys::TYPECACHE_TUPDESC as std::ffi::c_int)
        };
        if entry.is_null() || (*entry).tupDesc.is_null() {
            raise(
                PgSqlErrorCode::ERRCODE_DATATYPE_MISMATCH,
                "idempotency.claim must return idempotency.claim_result".into(),
                Some("reinstall the extension"),
            );
        }
        let identifier = (*entry).tupDesc_identifier;
        let cached = RESULT_TYPE.with(|c| c.get());
        if let Some(t) = cached.filter(|t| t.typid == typid && t.identifier == identifier) {
            return t;
        }
        let checked = pg_sys::lookup_rowtype_tupdesc_copy(typid, -1);
        let name = std::ffi::CStr::from_ptr(pg_sys::format_type_be(typid))
            .to_string_lossy()
            .into_owned();
        check_result(checked, &CLAIM_RESULT, &name);
        let outcomes = outcome_labels((*crate::compat::attribute(checked, 0)).atttypid);
        let tupdesc = pgrx::PgMemoryContexts::TopMemoryContext
            .switch_to(|_| pg_sys::BlessTupleDesc(pg_sys::CreateTupleDescCopy(checked)));
        let t = ResultType {
            typid,
            identifier,
            tupdesc,
            outcomes,
        };
        RESULT_TYPE.with(|c| c.set(Some(t)));
        if let Some(old) = cached {
            pg_sys::FreeTupleDesc(old.tupdesc);
        }
        t
    }
}

/// The outcomes in the order of [`ResultType::outcomes`].
pub(super) const OUTCOMES: [Outcome; 4] = [
    Outcome::New,
    Outcome::Replay,
    Outcome::InProgress,
    Outcome::Mismatch,
];

/// An outcome's index in [`OUTCOMES`] (and so in [`ResultType::outcomes`]) and the event it
/// counts as.
pub(super) fn outcome_slot(o: Outcome) -> (usize, Event) {
    match o {
        Outcome::New => (0, Event::ClaimNew),
        Outcome::Replay => (1, Event::ClaimReplay),
        Outcome::InProgress => (2, Event::ClaimInProgress),
        Outcome::Mismatch => (3, Event::ClaimMismatch),
    }
}

/// The datums of the `outcome` enum's labels, in the order of [`OUTCOMES`].
///
/// # Safety
/// `outcome_type` is the OID of `idempotency.outcome`.
pub(super) unsafe fn outcome_labels(outcome_type: pg_sys::Oid) -> [pg_sys::Datum; 4] {
    OUTCOMES.map(|o| {
        let label = std::ffi::CString::new(o.label()).unwrap_or_default();
        pgrx::direct_function_call_as_datum(
            pg_sys::enum_in,
            &[
                Some(pg_sys::Datum::from(label.as_ptr())),
                Some(pg_sys::Datum::from(outcome_type)),
            ],
        )
        .unwrap_or_else(|| {
            raise(
                PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
                "enum_in".into(),
                None,
            )
        })
    })
}

/// # Safety
/// `t` is the result type of the current call of `claim`.
pub(super) unsafe fn claim_tuple(t: &ResultType, r: ClaimResult) -> pg_sys::Datum {
    // SAFETY: the caller's guarantee; every field is a datum of its column's type in the
    // `claim_result` descriptor (checked column by column: `CLAIM_RESULT`), allocated
    // in the call's context.
    unsafe {
        let fields: [Option<pg_sys::Datum>; 7] = [
            Some(t.outcomes[outcome_slot(r.outcome).0]),
            r.token.into_datum(),
            r.response.and_then(|j| j.into_datum()),
            r.response_status.into_datum(),
            r.retry_after.into_datum(),
            r.expires_at.into_datum(),
            r.recovery_point
                .as_deref()
                .map(|p| encoding::text_datum(p, "recovery_point")),
        ];
        tuple_datum(t.tupdesc, &fields)
    }
}

/// A composite datum of `tupdesc` with `fields` (NULL where None or missing).
///
/// # Safety
/// `tupdesc` is a valid, blessed descriptor; `fields` are datums of its column types.
pub(super) unsafe fn tuple_datum(
    tupdesc: pg_sys::TupleDesc,
    fields: &[Option<pg_sys::Datum>],
) -> pg_sys::Datum {
    // SAFETY: the caller's guarantees; the tuple is formed in the current (the call's) context
    // from `natts` values and null flags, as `with_row` gives them.
    unsafe {
        with_row(tupdesc, fields, |values, nulls| {
            let tuple = pg_sys::heap_form_tuple(tupdesc, values, nulls);
            pg_sys::HeapTupleHeaderGetDatum((*tuple).t_data)
        })
    }
}

/// Calls `f` with the values and null flags of a row of `tupdesc` holding `fields` (NULL where
/// None or missing): exactly `natts` of each, as heap_form_tuple and tuplestore_putvalues read.
///
/// # Safety
/// `tupdesc` is a valid descriptor.
pub(super) unsafe fn with_row<R>(
    tupdesc: pg_sys::TupleDesc,
    fields: &[Option<pg_sys::Datum>],
    f: impl FnOnce(*mut pg_sys::Datum, *mut bool) -> R,
) -> R {
    // The result types have a handful of columns: on the stack, unless one was widened a lot.
    const ON_STACK: usize = 16;
    // SAFETY: the caller guarantees the descriptor; `natts` is its column count.
    let natts = unsafe { (*tupdesc).natts } as usize;
    let (mut stack_values, mut stack_nulls) =
        ([pg_sys::Datum::from(0usize); ON_STACK], [true; ON_STACK]);
    let (mut heap_values, mut heap_nulls) = (Vec::new(), Vec::new());
    let (values, nulls): (&mut [pg_sys::Datum], &mut [bool]) = if natts <= ON_STACK {
        (&mut stack_values[..natts], &mut stack_nulls[..natts])
    } else {
        heap_values.resize(natts, pg_sys::Datum::from(0usize));
        heap_nulls.resize(natts, true);
        (&mut heap_values, &mut heap_nulls)
    };
    for (i, field) in fields.iter().enumerate().take(natts) {
        if let Some(d) = field {
            values[i] = *d;
            nulls[i] = false;
        }
    }
    f(values.as_mut_ptr(), nulls.as_mut_ptr())
}
