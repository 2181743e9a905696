//! The SQL-callable functions written in Rust. Their SQL declarations (names, argument names,
//! defaults, volatility, pinned search_path) are hand-written in `sql/idempotency.sql`, which
//! names each by the C symbol this library exports for it.
//!
//! `claim` and `complete`, the calls on every request's path, are raw fmgr functions that read
//! their arguments by position from the call and build their results themselves (`claim`
//! caches its result type's descriptor and outcome labels per backend). Every other function
//! is written with typed arguments (`functions`, `#[pg_extern(sql = false)]`), exported under
//! the name the SQL declarations give it ([`export_as`]).
//!
//! The counters (`stats`) of the calls' outcomes are counted here, each event once the store
//! has done it; the rows a sweep deletes are counted by the store's sweep, which the background
//! sweeper calls too.

mod args;
mod functions;
mod result;

use args::{Jsonb, Text};

use crate::arguments;
use crate::arguments::ArgError;
use crate::canonical::NumberMode;
use crate::error::{arg_error, canon_error, check, raise};
use crate::stats::{self, Event};
use crate::store::{self, ClaimRequest, ClaimResult, Outcome};
use crate::{encoding, guc, jsonb};
use pgrx::datum::Interval;
use pgrx::fcinfo::{pg_getarg, pg_return_null};
use pgrx::prelude::*;
use pgrx::{pg_sys, PgSqlErrorCode};
use sha2::{Digest, Sha256};

/// Declares the V1 calling-convention record PostgreSQL looks up for `$name`.
macro_rules! v1 {
    ($finfo:ident) => {
        #[unsafe(no_mangle)]
        #[doc(hidden)]
        pub extern "C" fn $finfo() -> &'static pg_sys::Pg_finfo_record {
            const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
            &V1
        }
    };
}

/// Exports a typed function under `$symbol`, the name `sql/idempotency.sql` and every released
/// script (`sql/releases/`, the upgrade scripts) declare it with: a V1 function that hands the
/// call to pgrx's wrapper of the typed function (`<function>_wrapper`, which pgrx exports too),
/// so installs made by any release keep working with this library.
macro_rules! export_as {
    ($symbol:ident, $finfo:ident, $wrapper:path) => {
        v1!($finfo);
        #[unsafe(no_mangle)]
        #[doc(hidden)]
        pub unsafe extern "C-unwind" fn $symbol(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
            // SAFETY: the server calls the symbol as the SQL declaration says, with the
            // arguments the typed function takes (the same in every release); the wrapper
            // guards the call like any pgrx function.
            unsafe { $wrapper(fcinfo) }
        }
    };
}

export_as!(
    idempotency_check_args,
    pg_finfo_idempotency_check_args,
    functions::idempotency_check_args_wrapper
);
export_as!(
    idempotency_canonical_json,
    pg_finfo_idempotency_canonical_json,
    functions::idempotency_canonical_json_wrapper
);
export_as!(
    idempotency_canonical_hash,
    pg_finfo_idempotency_canonical_hash,
    functions::idempotency_canonical_hash_wrapper
);
export_as!(
    idempotency_derive_key,
    pg_finfo_idempotency_derive_key,
    functions::idempotency_derive_key_wrapper
);
export_as!(
    idempotency_cron_key,
    pg_finfo_idempotency_cron_key,
    functions::idempotency_cron_key_wrapper
);
export_as!(
    idempotency_request_fingerprint,
    pg_finfo_idempotency_request_fingerprint,
    functions::idempotency_request_fingerprint_wrapper
);
export_as!(
    idempotency_sweep,
    pg_finfo_idempotency_sweep,
    functions::idempotency_sweep_wrapper
);
export_as!(
    idempotency_count,
    pg_finfo_idempotency_count,
    functions::idempotency_count_wrapper
);
export_as!(
    idempotency_sweeper_preloaded,
    pg_finfo_idempotency_sweeper_preloaded,
    functions::idempotency_sweeper_preloaded_wrapper
);
export_as!(
    idempotency_announce,
    pg_finfo_idempotency_announce,
    functions::idempotency_announce_wrapper
);
export_as!(
    idempotency_key,
    pg_finfo_idempotency_key,
    functions::idempotency_key_wrapper
);
export_as!(
    idempotency_store_changed,
    pg_finfo_idempotency_store_changed,
    functions::idempotency_store_changed_wrapper
);
export_as!(
    idempotency_sign,
    pg_finfo_idempotency_sign,
    functions::idempotency_sign_wrapper
);
export_as!(
    idempotency_signed_kid,
    pg_finfo_idempotency_signed_kid,
    functions::idempotency_signed_kid_wrapper
);
export_as!(
    idempotency_verify,
    pg_finfo_idempotency_verify,
    functions::idempotency_verify_wrapper
);
export_as!(
    idempotency_random_secret,
    pg_finfo_idempotency_random_secret,
    functions::idempotency_random_secret_wrapper
);
export_as!(
    idempotency_sweep_audit,
    pg_finfo_idempotency_sweep_audit,
    functions::idempotency_sweep_audit_wrapper
);
export_as!(
    idempotency_rekey,
    pg_finfo_idempotency_rekey,
    functions::idempotency_rekey_wrapper
);
export_as!(
    idempotency_shared_stats,
    pg_finfo_idempotency_shared_stats,
    functions::idempotency_shared_stats_wrapper
);
export_as!(
    idempotency_check_recovery_point,
    pg_finfo_idempotency_check_recovery_point,
    functions::idempotency_check_recovery_point_wrapper
);

fn interval_parts(i: &Interval) -> (i32, i32, i64) {
    (i.months(), i.days(), i.micros())
}

fn seconds_interval(seconds: i32) -> Interval {
    Interval::new(0, 0, seconds as i64 * 1_000_000).unwrap_or_else(|e| {
        raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("bad setting: {e}"),
            None,
        )
    })
}

/// A TTL or lease: the argument, or the setting's default when NULL, and its name for errors.
struct Duration {
    value: Interval,
    /// "ttl", "lease", or the setting that supplied the value.
    name: &'static str,
    /// `now() + value`, as the store computes it (calendar months and days, session time zone).
    ends: pg_sys::TimestampTz,
}

/// Checks a duration on its own (positive, at most ten years) and on the clock: `now() +` it
/// must lie after now and at most ten calendar years ahead. ('1 month -29 days' is positive
/// counted in 30-day months but ends before now in February; '122 months' is 3660 days but
/// over ten years.)
fn duration(name: &'static str, value: Interval) -> Duration {
    let (m, d, us) = interval_parts(&value);
    check(arguments::check_duration(name, m, d, us));
    let ends = store::now_plus(&value);
    let now = crate::store::transaction_start();
    if ends <= now {
        arg_error(ArgError::invalid(format!(
            "{name} must end in the future: now() + {name} is not after now() ({})",
            interval_text(&value)
        )));
    }
    let ten_years = Interval::new(120, 0, 0).unwrap_or_else(|_| unreachable!("a valid interval"));
    if ends > store::now_plus(&ten_years) {
        arg_error(ArgError::invalid(format!(
            "{name} must be at most 10 years (got {})",
            interval_text(&value)
        )));
    }
    Duration { value, name, ends }
}

/// An interval as PostgreSQL prints it.
fn interval_text(i: &Interval) -> String {
    arguments::abbreviate(&i.to_string())
}

/// The TTL and lease of a claim: each argument, or its setting when NULL. With no lease given
/// the lease is `least(idempotency.default_lease, ttl)`, so `claim(key, ttl => '1 second')`
/// works; a lease that would outlive the key is refused, naming what set each.
fn ttl_and_lease(ttl: Option<Interval>, lease: Option<Interval>) -> (Duration, Duration) {
    let ttl = match ttl {
        Some(t) => duration("ttl", t),
        None => duration(
            "idempotency.default_ttl",
            seconds_interval(guc::int(&guc::DEFAULT_TTL)),
        ),
    };
    let lease = match lease {
        Some(l) => duration("lease", l),
        None => {
            let default = duration(
                "idempotency.default_lease",
                seconds_interval(guc::int(&guc::DEFAULT_LEASE)),
            );
            if default.ends > ttl.ends {
                Duration {
                    value: ttl.value,
                    name: "lease",
                    ends: ttl.ends,
                }
            } else {
                default
            }
        }
    };
    if lease.ends > ttl.ends {
        arg_error(ArgError::invalid(format!(
            "{} ({}) must not be longer than {} ({}): the lease would outlive the key",
            lease.name,
            interval_text(&lease.value),
            ttl.name,
            interval_text(&ttl.value)
        )));
    }
    (ttl, lease)
}

/// SHA-256 of the exact canonical form of a jsonb argument, written straight from the jsonb.
///
/// # Safety
/// `datum` is a non-NULL jsonb datum of the current call.
unsafe fn hash_arg(datum: pg_sys::Datum, arg: &str) -> [u8; 32] {
    with_scratch(|text| {
        // SAFETY: the caller's guarantee; the writer only reads the datum.
        unsafe { jsonb::write_canonical(datum, NumberMode::Exact, text) }
            .unwrap_or_else(|e| canon_error(arg, e));
        Sha256::digest(text.as_bytes()).into()
    })
}

/// The buffer canonical forms are written into before they are hashed, kept between calls
/// so hashing a document does not grow a fresh string (copies, new pages) every time.
static SCRATCH: crate::local::BackendLocal<std::cell::RefCell<String>> =
    crate::local::BackendLocal::new(std::cell::RefCell::new(String::new()));

/// Runs `f` on the emptied scratch buffer; a buffer grown past 1 MB is given back afterwards.
fn with_scratch<R>(f: impl FnOnce(&mut String) -> R) -> R {
    SCRATCH.with(|cell| {
        // An ERROR raised inside `f` unwinds and releases the borrow; a nested call (none
        // today) gets a buffer of its own instead of a panic.
        let Ok(mut text) = cell.try_borrow_mut() else {
            return f(&mut String::new());
        };
        text.clear();
        let result = f(&mut text);
        if text.capacity() > 1 << 20 {
            *text = String::new();
        }
        result
    })
}

/// The `key` and `scope` arguments, checked by the shared rules and against the session's
/// `idempotency.scope_prefix`.
fn checked_key_and_scope(key: Option<Text<'_>>, scope: Option<Text<'_>>) -> (String, String) {
    let key = key.map(|t| t.utf8("key"));
    let scope = scope.map(|t| t.utf8("scope"));
    check(arguments::check_key("key", key.as_deref(), false));
    check(arguments::check_key("scope", scope.as_deref(), true));
    // Both were checked to be non-NULL above.
    let (key, scope) = (key.unwrap_or_default(), scope.unwrap_or_default());
    check(crate::binding::with_scope_prefix(|prefix| {
        arguments::check_scope_allowed(&scope, prefix)
    }));
    (key.into_owned(), scope.into_owned())
}

/// Like `checked_key_and_scope`, with the key in the form the store keeps it (hashed when the
/// store keeps keys hashed).
fn key_and_scope(key: Option<Text<'_>>, scope: Option<Text<'_>>) -> (String, String) {
    let (key, scope) = checked_key_and_scope(key, scope);
    (store::stored_key(key), scope)
}

/// An optional `ttl` argument (NULL: the caller's default applies), checked when given.
fn optional_ttl(ttl: Option<Interval>) -> Option<Interval> {
    ttl.map(|t| duration("ttl", t).value)
}

v1!(pg_finfo_idempotency_claim);
/// `idempotency.claim(key, request, scope, ttl, lease) RETURNS idempotency.claim_result`
///
/// A raw fmgr function: it is on every request's path, and builds its row from a descriptor and
/// outcome labels cached per backend ([`result_type`]) instead of looking them up per call.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_claim(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: `fcinfo` is the server's call of the function as `sql/idempotency.sql` declares
    // it (in every release): five arguments, of types text, jsonb, text, interval, interval,
    // any of them NULL (the function is not STRICT: each is read as an Option). Their datums
    // and the result are used within the call, in its memory context.
    unsafe {
        let (key, scope) = key_and_scope(Text::arg(fcinfo, 0), Text::arg(fcinfo, 2));
        let (ttl, lease) = ttl_and_lease(pg_getarg(fcinfo, 3), pg_getarg(fcinfo, 4));
        let (ttl, lease) = (ttl.value, lease.value);
        let hash = Jsonb::arg(fcinfo, 1).map(|d| hash_arg(d.datum(), "request"));
        store::refuse_read_only("claim");
        // Checked before anything is written or counted.
        let result_type = result_type(fcinfo);
        let result = store::claim(&ClaimRequest {
            scope: &scope,
            key: &key,
            hash,
            ttl,
            lease,
        });
        stats::count(outcome_slot(result.outcome).1, 1);
        claim_tuple(&result_type, result)
    }
}

/// Builds the function's composite result (its declared row type or OUT parameters).
///
/// # Safety
/// `fcinfo` is the current call; `fields` are datums of the types of `columns`.
unsafe fn form_tuple(
    fcinfo: pg_sys::FunctionCallInfo,
    columns: &[result::ResultColumn],
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
        result::check_result(tupdesc, columns, what);
        tuple_datum(pg_sys::BlessTupleDesc(tupdesc), fields)
    }
}

/// `claim_result`'s row descriptor and the OIDs of the `outcome` labels, checked and looked up
/// once per backend and again whenever the type's descriptor changes: recreated (a new OID) or
/// altered (`ALTER TYPE ... ALTER ATTRIBUTE`, an update of the extension), which gives the
/// type cache's descriptor a new identifier.
#[derive(Clone, Copy)]
struct ResultType {
    typid: pg_sys::Oid,
    /// The type cache's `tupDesc_identifier` of the descriptor that was checked.
    identifier: u64,
    tupdesc: pg_sys::TupleDesc,
    /// new, replay, in_progress, mismatch
    outcomes: [pg_sys::Datum; 4],
}

static RESULT_TYPE: crate::local::BackendLocal<std::cell::Cell<Option<ResultType>>> =
    crate::local::BackendLocal::new(std::cell::Cell::new(None));

/// # Safety
/// `fcinfo` is the current call of `claim`.
unsafe fn result_type(fcinfo: pg_sys::FunctionCallInfo) -> ResultType {
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
        result::check_result(checked, &result::CLAIM_RESULT, &name);
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
const OUTCOMES: [Outcome; 4] = [
    Outcome::New,
    Outcome::Replay,
    Outcome::InProgress,
    Outcome::Mismatch,
];

/// An outcome's index in [`OUTCOMES`] (and so in [`ResultType::outcomes`]) and the event it
/// counts as.
fn outcome_slot(o: Outcome) -> (usize, Event) {
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
unsafe fn outcome_labels(outcome_type: pg_sys::Oid) -> [pg_sys::Datum; 4] {
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
unsafe fn claim_tuple(t: &ResultType, r: ClaimResult) -> pg_sys::Datum {
    // SAFETY: the caller's guarantee; every field is a datum of its column's type in the
    // `claim_result` descriptor (checked column by column: `result::CLAIM_RESULT`), allocated
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
unsafe fn tuple_datum(
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
unsafe fn with_row<R>(
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

v1!(pg_finfo_idempotency_complete);
/// `idempotency._complete(key, response, response_status, scope, token, ttl)`: the work of
/// `idempotency.complete`; NULL when there is no live claim to complete, which the SQL wrapper
/// turns into the IK001..IK003 error that says why.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_complete(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: `fcinfo` is the server's call of `_complete` as every release declares it: six
    // arguments (text, jsonb, integer, text, bigint, interval), any of them NULL (not STRICT:
    // each is read as an Option). The response datum is used within the call (the store copies
    // it into the row it writes).
    unsafe {
        let (key, scope) = key_and_scope(Text::arg(fcinfo, 0), Text::arg(fcinfo, 3));
        let response_status = check(arguments::check_status(pg_getarg::<i32>(fcinfo, 2)));
        let ttl = optional_ttl(pg_getarg(fcinfo, 5));
        let response = Jsonb::arg(fcinfo, 1).map(Jsonb::datum);
        if let Some(response) = response {
            check_size("response", response, crate::binding::max_response_size());
        }
        store::refuse_read_only("complete");
        let request = store::CompleteRequest {
            scope: &scope,
            key: &key,
            response,
            response_status,
            token: pg_getarg::<i64>(fcinfo, 4),
            ttl,
            audit: crate::binding::audit(),
        };
        match store::complete(&request) {
            Some(expires_at) => {
                stats::count(Event::Completion, 1);
                pg_sys::Datum::from(pg_sys::TimestampTz::from(expires_at))
            }
            None => pg_return_null(fcinfo),
        }
    }
}

/// Refuses a variable-length argument larger than a size setting (in kB), before anything is
/// written or copied: its size is read from the header, without detoasting.
///
/// # Safety
/// `value` is a non-NULL varlena argument of the current call.
unsafe fn check_size(arg: &str, value: pg_sys::Datum, (limit, setting): (i32, &str)) {
    // SAFETY: `value` is a varlena argument of the call; toast_raw_datum_size reads its header.
    let size = unsafe { pg_sys::toast_raw_datum_size(value) } as i64;
    let max = limit as i64 * 1024;
    if size > max {
        raise(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!("{arg} is too large: {size} bytes, {setting} allows {max}"),
            Some("store a reference to large results (a row id, an object store key) instead, or raise the limit"),
        );
    }
}

/// The elements of array argument `n` (None: the array is NULL; an element None: NULL),
/// refusing an array of more than one dimension (2202E, naming `arg`). The element datums
/// point into the detoasted array, which lives in the call's memory context.
///
/// # Safety
/// `fcinfo` is the current call, whose argument `n` is an array.
unsafe fn array_arg(
    fcinfo: pg_sys::FunctionCallInfo,
    n: usize,
    arg: &str,
) -> Option<Vec<Option<pg_sys::Datum>>> {
    // SAFETY: the caller's guarantees: a non-NULL argument `n` is an array datum; it is
    // detoasted into the call's context, and deconstruct_array reads it with its element
    // type's length, by-value flag and alignment, returning `count` datums and null flags.
    unsafe {
        if pgrx::fcinfo::pg_arg_is_null(fcinfo, n) {
            return None;
        }
        let raw = pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, n);
        let array = pg_sys::pg_detoast_datum(raw.cast_mut_ptr()) as *mut pg_sys::ArrayType;
        let ndim = (*array).ndim;
        if ndim > 1 {
            raise(
                PgSqlErrorCode::ERRCODE_ARRAY_ELEMENT_ERROR,
                format!("{arg} must be a one-dimensional array (got {ndim} dimensions)"),
                None,
            );
        }
        let elemtype = (*array).elemtype;
        let (mut len, mut byval, mut align) = (0i16, false, 0 as std::ffi::c_char);
        pg_sys::get_typlenbyvalalign(elemtype, &mut len, &mut byval, &mut align);
        let mut elems: *mut pg_sys::Datum = std::ptr::null_mut();
        let mut nulls: *mut bool = std::ptr::null_mut();
        let mut count: i32 = 0;
        pg_sys::deconstruct_array(
            array, elemtype, len as i32, byval, align, &mut elems, &mut nulls, &mut count,
        );
        Some(
            (0..count.max(0) as usize)
                .map(|i| (!*nulls.add(i)).then(|| *elems.add(i)))
                .collect(),
        )
    }
}

/// Refuses a companion array whose length differs from `keys` (22023, naming both).
fn same_length<T>(arg: &str, array: Option<&Vec<T>>, keys: usize) {
    if let Some(a) = array {
        if a.len() != keys {
            arg_error(ArgError::invalid(format!(
                "{arg} must have one element per key: it has {}, keys has {keys}",
                a.len()
            )));
        }
    }
}

v1!(pg_finfo_idempotency_claim_many);
/// `idempotency.claim_many(keys, requests, scope, ttl, lease) RETURNS SETOF (ord, key,
/// claim_result's columns)`: one row per position of `keys`, in order, each `claim`'s answer.
///
/// Every argument is checked first (nothing is written on bad input). The keys that are absent
/// are then inserted set-based, one statement per chunk ([`store::claim_fresh_batch`]); every
/// other position (a key that exists or is busy, a key repeated within the call, or every
/// position where the set-based insert does not apply) is claimed by [`store::claim`], in
/// input order, so each answer is exactly `claim`'s.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_claim_many(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: `fcinfo` is the server's call of the function as `sql/idempotency.sql` declares
    // it: text[], jsonb[], text, interval, interval, any of them NULL (not STRICT), returning a
    // set of rows (ord int, key text, then claim_result's columns) in materialize mode. The
    // element datums are used within the call; the tuplestore copies every row it is given.
    unsafe {
        let Some(keys) = array_arg(fcinfo, 0, "keys") else {
            arg_error(ArgError::null("keys"))
        };
        let requests = array_arg(fcinfo, 1, "requests");
        same_length("requests", requests.as_ref(), keys.len());
        let scope = Text::arg(fcinfo, 2).map(|t| t.utf8("scope"));
        let scope = check(arguments::check_key("scope", scope.as_deref(), true)).to_string();
        check(crate::binding::with_scope_prefix(|prefix| {
            arguments::check_scope_allowed(&scope, prefix)
        }));
        let mut stored = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            let key = k.map(|d| encoding::text_of(d, "keys"));
            // The position is named only when the key is refused.
            let key = match arguments::check_key("keys", key.as_deref(), false) {
                Ok(key) => key.to_string(),
                Err(_) => check(arguments::check_key(
                    &format!("keys[{}]", i + 1),
                    key.as_deref(),
                    false,
                ))
                .to_string(),
            };
            stored.push(store::stored_key(key));
        }
        let (ttl, lease) = ttl_and_lease(pg_getarg(fcinfo, 3), pg_getarg(fcinfo, 4));
        let (ttl, lease) = (ttl.value, lease.value);
        let hashes: Vec<Option<[u8; 32]>> = match &requests {
            Some(r) => r
                .iter()
                .map(|d| d.map(|d| hash_arg(d, "requests")))
                .collect(),
            None => vec![None; keys.len()],
        };
        store::refuse_read_only("claim_many");

        pg_sys::InitMaterializedSRF(fcinfo, 0);
        let rsinfo = (*fcinfo).resultinfo as *mut pg_sys::ReturnSetInfo;
        let (store_, tupdesc) = ((*rsinfo).setResult, (*rsinfo).setDesc);
        // Every row below is formed from this descriptor: each field a datum of its column.
        result::check_result(
            tupdesc,
            &result::CLAIM_MANY_RESULT,
            "the result of idempotency.claim_many",
        );
        let outcomes = outcome_labels((*crate::compat::attribute(tupdesc, 2)).atttypid);

        let mut counts = [0u64; 4];
        store::claim_many(&scope, &stored, &hashes, ttl, lease, |i, result| {
            let o = outcome_slot(result.outcome).0;
            counts[o] += 1;
            let fields: [Option<pg_sys::Datum>; 9] = [
                (i as i32 + 1).into_datum(),
                keys[i],
                Some(outcomes[o]),
                result.token.into_datum(),
                result.response.and_then(|j| j.into_datum()),
                result.response_status.into_datum(),
                result.retry_after.into_datum(),
                result.expires_at.into_datum(),
                result
                    .recovery_point
                    .as_deref()
                    .map(|p| encoding::text_datum(p, "recovery_point")),
            ];
            with_row(tupdesc, &fields, |values, nulls| {
                pg_sys::tuplestore_putvalues(store_, tupdesc, values, nulls)
            });
        });
        for (outcome, n) in OUTCOMES.into_iter().zip(counts) {
            if n > 0 {
                stats::count(outcome_slot(outcome).1, n);
            }
        }
        pg_sys::Datum::from(0usize)
    }
}

v1!(pg_finfo_idempotency_role_settings_changed);
/// `idempotency._role_settings_changed()`: the statement-level trigger of
/// `idempotency.role_settings`. Invalidates the table's relation cache entry, which makes every
/// backend read its row again once the changing transaction commits (this backend at its next
/// command); see `store::catalog::role_settings`.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_role_settings_changed(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    // SAFETY: `fcinfo` is the server's call; its context is a TriggerData node exactly when the
    // function is called as a trigger (checked by its tag before the cast), whose relation is
    // open for the trigger's statement. A trigger function cannot be called any other way from
    // SQL, but the check keeps a hand-made call from reading a wrong node.
    unsafe {
        let context = (*fcinfo).context;
        if context.is_null() || (*context).type_ != pg_sys::NodeTag::T_TriggerData {
            raise(
                PgSqlErrorCode::ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED,
                "idempotency._role_settings_changed() must be called as a trigger".into(),
                None,
            );
        }
        let trigger = context.cast::<pg_sys::TriggerData>();
        pg_sys::CacheInvalidateRelcache((*trigger).tg_relation);
        // A statement-level AFTER trigger's result is ignored, but must not be SQL NULL: a
        // null pointer, as C triggers return.
        pg_sys::Datum::from(0usize)
    }
}
