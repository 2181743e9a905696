//! The SQL-callable functions written in Rust. Their SQL declarations (names, argument names,
//! defaults, volatility, pinned search_path) are hand-written in `sql/idempotency.sql`; each
//! function here reads its arguments by position from the call.

use crate::canonical::{self, NumberMode, Value};
use crate::error::{arg_error, canon_error, check, raise};
use crate::keys::{self, ArgError};
use crate::stats::{self, Event};
use crate::store::{self, ClaimRequest, ClaimResult, Outcome};
use crate::{encoding, guc, jsonb};
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::fcinfo::{pg_arg_is_null, pg_getarg, pg_getarg_datum_raw, pg_return_null};
use pgrx::prelude::*;
use pgrx::{pg_sys, PgSqlErrorCode};
use sha2::{Digest, Sha256};
use std::borrow::Cow;

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

unsafe fn jsonb_arg(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> Option<pg_sys::Datum> {
    unsafe {
        if pg_arg_is_null(fcinfo, n) {
            None
        } else {
            Some(pg_getarg_datum_raw(fcinfo, n))
        }
    }
}

/// A text argument as UTF-8; every text argument is read through here. Read in place when it
/// is neither compressed nor out of line (a key or a scope always is) and the database is UTF-8
/// (PostgreSQL has verified the text); converted from the database encoding in any other
/// (`encoding`), raising 22P05 naming `arg` for a character without a Unicode equivalent.
unsafe fn text_arg<'a>(
    fcinfo: pg_sys::FunctionCallInfo,
    n: usize,
    arg: &str,
) -> Option<Cow<'a, str>> {
    unsafe {
        if pg_arg_is_null(fcinfo, n) {
            return None;
        }
        Some(encoding::text_of(pg_getarg_datum_raw(fcinfo, n), arg))
    }
}

/// A `text[]` argument's elements as UTF-8 (NULL elements as None).
unsafe fn text_array_arg(
    fcinfo: pg_sys::FunctionCallInfo,
    n: usize,
    arg: &str,
) -> Option<Vec<Option<String>>> {
    unsafe {
        if pg_arg_is_null(fcinfo, n) {
            return None;
        }
        let array = pg_getarg::<pgrx::Array<'_, pg_sys::Datum>>(fcinfo, n)?;
        Some(
            array
                .iter()
                .map(|d| d.map(|d| encoding::text_of(d, arg).into_owned()))
                .collect(),
        )
    }
}

/// Reads a jsonb argument into a canonical tree, raising a clear error naming `arg`.
unsafe fn value_arg(fcinfo: pg_sys::FunctionCallInfo, n: usize, arg: &str) -> Option<Value> {
    unsafe {
        jsonb_arg(fcinfo, n).map(|d| jsonb::to_value(d).unwrap_or_else(|e| canon_error(arg, e)))
    }
}

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
    check(keys::check_duration(name, m, d, us));
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
    keys::abbreviate(&i.to_string())
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
unsafe fn hash_arg(datum: pg_sys::Datum, arg: &str) -> [u8; 32] {
    with_scratch(|text| {
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

/// A text result in the database encoding; `what` names it in a 22P05 error.
fn text_datum(s: &str, what: &str) -> pg_sys::Datum {
    encoding::text_datum(s, what)
}

fn bytea_datum(b: &[u8]) -> pg_sys::Datum {
    b.into_datum().unwrap_or_else(|| {
        raise(
            PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
            "bytea conversion".into(),
            None,
        )
    })
}

/// The `key` and `scope` arguments at positions `k` and `s`, checked by the shared rules and
/// against the session's `idempotency.scope_prefix`.
unsafe fn checked_key_and_scope(
    fcinfo: pg_sys::FunctionCallInfo,
    k: usize,
    s: usize,
) -> (String, String) {
    unsafe {
        let key = text_arg(fcinfo, k, "key");
        let scope = text_arg(fcinfo, s, "scope");
        check(keys::check_key("key", key.as_deref(), false));
        check(keys::check_key("scope", scope.as_deref(), true));
        // Both were checked to be non-NULL above.
        let (key, scope) = (key.unwrap_or_default(), scope.unwrap_or_default());
        check(guc::with_scope_prefix(|prefix| {
            keys::check_scope_allowed(&scope, prefix)
        }));
        (key.into_owned(), scope.into_owned())
    }
}

/// Like `checked_key_and_scope`, with the key in the form the store keeps it (hashed when the
/// store keeps keys hashed).
unsafe fn key_and_scope(fcinfo: pg_sys::FunctionCallInfo, k: usize, s: usize) -> (String, String) {
    let (key, scope) = unsafe { checked_key_and_scope(fcinfo, k, s) };
    (store::stored_key(key), scope)
}

/// An optional `ttl` argument (NULL: the caller's default applies), checked when given.
unsafe fn optional_ttl(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> Option<Interval> {
    unsafe { pg_getarg::<Interval>(fcinfo, n) }.map(|t| duration("ttl", t).value)
}

v1!(pg_finfo_idempotency_claim);
/// `idempotency.claim(key, request, scope, ttl, lease) RETURNS idempotency.claim_result`
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_claim(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        let (key, scope) = key_and_scope(fcinfo, 0, 2);
        let (ttl, lease) = ttl_and_lease(pg_getarg(fcinfo, 3), pg_getarg(fcinfo, 4));
        let (ttl, lease) = (ttl.value, lease.value);
        let hash = jsonb_arg(fcinfo, 1).map(|d| hash_arg(d, "request"));
        store::refuse_read_only("claim");
        let result = store::claim(&ClaimRequest {
            scope: &scope,
            key: &key,
            hash,
            ttl,
            lease,
        });
        let event = match result.outcome {
            Outcome::New => Event::ClaimNew,
            Outcome::Replay => Event::ClaimReplay,
            Outcome::InProgress => Event::ClaimInProgress,
            Outcome::Mismatch => Event::ClaimMismatch,
        };
        stats::count(event, 1);
        claim_tuple(fcinfo, result)
    }
}

/// Builds the function's composite result (its declared row type or OUT parameters).
unsafe fn form_tuple(
    fcinfo: pg_sys::FunctionCallInfo,
    fields: &[Option<pg_sys::Datum>],
) -> pg_sys::Datum {
    unsafe {
        let mut tupdesc: pg_sys::TupleDesc = std::ptr::null_mut();
        let class = pg_sys::get_call_result_type(fcinfo, std::ptr::null_mut(), &mut tupdesc);
        if class != pg_sys::TypeFuncClass::TYPEFUNC_COMPOSITE
            || tupdesc.is_null()
            || ((*tupdesc).natts as usize) < fields.len()
        {
            raise(
                PgSqlErrorCode::ERRCODE_DATATYPE_MISMATCH,
                "function result type does not match the extension's declaration".into(),
                Some("reinstall the extension"),
            );
        }
        tuple_datum(pg_sys::BlessTupleDesc(tupdesc), fields)
    }
}

/// `claim_result`'s row descriptor and the OIDs of the `outcome` labels, looked up once per
/// backend (and again if the type is recreated, which gives it a new OID).
#[derive(Clone, Copy)]
struct ResultType {
    typid: pg_sys::Oid,
    tupdesc: pg_sys::TupleDesc,
    /// new, replay, in_progress, mismatch
    outcomes: [pg_sys::Datum; 4],
}

static RESULT_TYPE: crate::local::BackendLocal<std::cell::Cell<Option<ResultType>>> =
    crate::local::BackendLocal::new(std::cell::Cell::new(None));

unsafe fn result_type(fcinfo: pg_sys::FunctionCallInfo) -> ResultType {
    unsafe {
        let typid = pg_sys::get_fn_expr_rettype((*fcinfo).flinfo);
        if let Some(t) = RESULT_TYPE
            .with(|c| c.get())
            .filter(|t| t.typid == typid && typid != pg_sys::InvalidOid)
        {
            return t;
        }
        let tupdesc = pgrx::PgMemoryContexts::TopMemoryContext
            .switch_to(|_| pg_sys::BlessTupleDesc(pg_sys::lookup_rowtype_tupdesc_copy(typid, -1)));
        if (*tupdesc).natts < 7 {
            raise(
                PgSqlErrorCode::ERRCODE_DATATYPE_MISMATCH,
                "idempotency.claim must return idempotency.claim_result".into(),
                Some("reinstall the extension"),
            );
        }
        let outcome_type = (*crate::compat::attribute(tupdesc, 0)).atttypid;
        let mut outcomes = [pg_sys::Datum::from(0usize); 4];
        for (i, o) in [
            Outcome::New,
            Outcome::Replay,
            Outcome::InProgress,
            Outcome::Mismatch,
        ]
        .iter()
        .enumerate()
        {
            let label = std::ffi::CString::new(o.label()).unwrap_or_default();
            outcomes[i] = pgrx::direct_function_call_as_datum(
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
            });
        }
        let t = ResultType {
            typid,
            tupdesc,
            outcomes,
        };
        RESULT_TYPE.with(|c| c.set(Some(t)));
        t
    }
}

unsafe fn claim_tuple(fcinfo: pg_sys::FunctionCallInfo, r: ClaimResult) -> pg_sys::Datum {
    unsafe {
        let t = result_type(fcinfo);
        let outcome = match r.outcome {
            Outcome::New => t.outcomes[0],
            Outcome::Replay => t.outcomes[1],
            Outcome::InProgress => t.outcomes[2],
            Outcome::Mismatch => t.outcomes[3],
        };
        let fields: [Option<pg_sys::Datum>; 7] = [
            Some(outcome),
            r.token.into_datum(),
            r.response.and_then(|j| j.into_datum()),
            r.response_status.into_datum(),
            r.retry_after.into_datum(),
            r.expires_at.into_datum(),
            r.recovery_point
                .as_deref()
                .map(|p| text_datum(p, "recovery_point")),
        ];
        tuple_datum(t.tupdesc, &fields)
    }
}

/// A composite datum of `tupdesc` with `fields` (NULL where None or missing).
unsafe fn tuple_datum(
    tupdesc: pg_sys::TupleDesc,
    fields: &[Option<pg_sys::Datum>],
) -> pg_sys::Datum {
    // The result types have a handful of columns: on the stack, unless one was widened a lot.
    const ON_STACK: usize = 16;
    unsafe {
        let natts = (*tupdesc).natts as usize;
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
        for (i, f) in fields.iter().enumerate().take(natts) {
            if let Some(d) = f {
                values[i] = *d;
                nulls[i] = false;
            }
        }
        let tuple = pg_sys::heap_form_tuple(tupdesc, values.as_mut_ptr(), nulls.as_mut_ptr());
        pg_sys::HeapTupleHeaderGetDatum((*tuple).t_data)
    }
}

v1!(pg_finfo_idempotency_check_args);
/// `idempotency._check_args(key, scope, ttl)`: the argument rules the SQL-language functions
/// of release 0.1.0 share with `claim` (0.2.0 uses `_key`); kept so a 0.1.0 schema keeps
/// working with this library until `ALTER EXTENSION idempotency UPDATE`.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_check_args(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        checked_key_and_scope(fcinfo, 0, 1);
        optional_ttl(fcinfo, 2);
        pgrx::fcinfo::pg_return_void()
    }
}

v1!(pg_finfo_idempotency_canonical_json);
/// `idempotency.canonical_json(doc jsonb, numbers text DEFAULT 'exact') RETURNS text`
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_canonical_json(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    unsafe {
        let mode = text_arg(fcinfo, 1, "numbers");
        let mode = match mode.as_deref() {
            None => arg_error(ArgError::null("numbers")),
            Some(m) => NumberMode::parse(m).unwrap_or_else(|| {
                raise(
                    PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                    format!(
                        "numbers must be 'exact' or 'rfc8785' (got {})",
                        keys::abbreviate(m)
                    ),
                    None,
                )
            }),
        };
        let Some(doc) = jsonb_arg(fcinfo, 0) else {
            return pg_return_null(fcinfo);
        };
        let mut text = String::new();
        jsonb::write_canonical(doc, mode, &mut text).unwrap_or_else(|e| canon_error("doc", e));
        text_datum(&text, "canonical_json result")
    }
}

v1!(pg_finfo_idempotency_canonical_hash);
/// `idempotency.canonical_hash(doc jsonb, exclude text[] DEFAULT '{}') RETURNS bytea`
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_canonical_hash(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    unsafe {
        let exclude = text_array_arg(fcinfo, 1, "exclude");
        let Some(exclude) = exclude else {
            arg_error(ArgError::null("exclude"));
        };
        let Some(datum) = jsonb_arg(fcinfo, 0) else {
            return pg_return_null(fcinfo);
        };
        if exclude.is_empty() {
            return bytea_datum(&hash_arg(datum, "doc"));
        }
        // Exclusions edit a tree of the document, then hash that.
        let mut doc = jsonb::to_value(datum).unwrap_or_else(|e| canon_error("doc", e));
        for entry in &exclude {
            let Some(entry) = entry else {
                arg_error(ArgError::null("exclude element"));
            };
            canonical::exclude(&mut doc, entry).unwrap_or_else(|e| canon_error("exclude", e));
        }
        let mut text = String::new();
        canonical::write_canonical(&doc, NumberMode::Exact, &mut text)
            .unwrap_or_else(|e| canon_error("doc", e));
        bytea_datum(&Sha256::digest(text.as_bytes()))
    }
}

v1!(pg_finfo_idempotency_derive_key);
/// `idempotency.derive_key(parent text, step text, params jsonb DEFAULT NULL) RETURNS text`
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_derive_key(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        let parent = text_arg(fcinfo, 0, "parent");
        let step = text_arg(fcinfo, 1, "step");
        let params = value_arg(fcinfo, 2, "params");
        let key = check(keys::derive_key(
            parent.as_deref(),
            step.as_deref(),
            params.as_ref(),
        ));
        text_datum(&key, "derived key")
    }
}

v1!(pg_finfo_idempotency_cron_key);
/// `idempotency.cron_key(job text, scheduled_at timestamptz, slot interval) RETURNS text`
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_cron_key(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        let job = text_arg(fcinfo, 0, "job");
        let at: Option<TimestampWithTimeZone> = pg_getarg(fcinfo, 1);
        let slot: Option<Interval> = pg_getarg(fcinfo, 2);
        let at = at.map(pg_sys::TimestampTz::from);
        let key = check(keys::cron_key(
            job.as_deref(),
            at,
            slot.as_ref().map(interval_parts),
        ));
        text_datum(&key, "cron key")
    }
}

v1!(pg_finfo_idempotency_request_fingerprint);
/// `idempotency.request_fingerprint(method, path, query jsonb, body jsonb) RETURNS bytea`
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_request_fingerprint(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    unsafe {
        let method = text_arg(fcinfo, 0, "method");
        let path = text_arg(fcinfo, 1, "path");
        let query = value_arg(fcinfo, 2, "query");
        if let Some(q) = &query {
            if !matches!(q, Value::Object(_)) {
                raise(
                    PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                    "query must be a JSON object of parameter names to values".into(),
                    None,
                );
            }
        }
        let body = value_arg(fcinfo, 3, "body");
        let doc = check(keys::fingerprint_document(
            method.as_deref(),
            path.as_deref(),
            query,
            body,
        ));
        let digest = keys::hash_value(&doc).unwrap_or_else(|e| canon_error("body", e));
        bytea_datum(&digest)
    }
}

v1!(pg_finfo_idempotency_sweep);
/// `idempotency.sweep(batch_size int DEFAULT NULL) RETURNS bigint`: deletes expired rows in
/// batches until a batch comes back short, skipping rows that other transactions hold.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_sweep(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    let batch = unsafe { batch_size_arg(fcinfo) };
    store::refuse_read_only("sweep");
    let prefix = sweep_prefix("sweep");
    let total = in_batches(batch, |b| store::sweep_batch(b, &prefix));
    stats::sweep_finished(total);
    pg_sys::Datum::from(total)
}

/// Which rows a sweep may touch: every row for the extension's owner and superusers (and
/// members of the owner's role); for a session with a scope prefix, the rows under its prefix;
/// otherwise none: a tenant must neither delete another tenant's rows nor, inside an open
/// transaction, hold their row locks (which makes their claims answer in_progress).
fn sweep_prefix(function: &str) -> String {
    // SAFETY: reads backend state. The caller is the session's current role: inside these
    // SECURITY DEFINER functions GetUserId() is the owner.
    let caller = unsafe { pg_sys::GetOuterUserId() };
    // SAFETY: catalog look-ups in the calling transaction.
    if unsafe {
        pg_sys::superuser_arg(caller) || pg_sys::has_privs_of_role(caller, extension_owner())
    } {
        return String::new();
    }
    let prefix = guc::with_scope_prefix(str::to_owned);
    if prefix.is_empty() {
        raise(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            format!("idempotency.{function} of the whole store is for the extension's owner and superusers"),
            Some("run it as the owner (the background sweeper or pg_cron do), or give this role a scope prefix (ALTER ROLE ... SET idempotency.scope_prefix) to sweep only its own scopes"),
        );
    }
    prefix
}

/// The owner of the extension.
fn extension_owner() -> pg_sys::Oid {
    Spi::get_one::<pg_sys::Oid>(
        "SELECT e.extowner FROM pg_catalog.pg_extension AS e \
          WHERE e.extname OPERATOR(pg_catalog.=) 'idempotency'",
    )
    .ok()
    .flatten()
    .unwrap_or(pg_sys::InvalidOid)
}

/// The `batch_size` argument of the sweep functions (NULL: `idempotency.sweep_batch_size`).
unsafe fn batch_size_arg(fcinfo: pg_sys::FunctionCallInfo) -> i64 {
    let batch =
        unsafe { pg_getarg::<i32>(fcinfo, 0) }.unwrap_or_else(|| guc::SWEEP_BATCH_SIZE.get());
    if batch < 1 {
        raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("batch_size must be positive (got {batch})"),
            None,
        );
    }
    batch as i64
}

/// Runs `delete_batch` until a batch comes back short; returns the rows deleted in all.
fn in_batches(batch: i64, mut delete_batch: impl FnMut(i64) -> i64) -> i64 {
    let mut total = 0;
    loop {
        let n = delete_batch(batch);
        total += n;
        if n < batch {
            return total;
        }
        pgrx::check_for_interrupts!();
    }
}

v1!(pg_finfo_idempotency_count);
/// `idempotency._count(event text)`: counts an event of a PL/pgSQL function (`release`;
/// the C functions count their own).
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_count(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        match text_arg(fcinfo, 0, "event").as_deref() {
            Some("release") => stats::count(Event::Release, 1),
            other => raise(
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                format!(
                    "event must be 'release' (got {})",
                    keys::abbreviate(other.unwrap_or("NULL"))
                ),
                None,
            ),
        }
        pgrx::fcinfo::pg_return_void()
    }
}

v1!(pg_finfo_idempotency_sweeper_preloaded);
/// `idempotency._sweeper_preloaded()`: whether the library was loaded at server start, so the
/// background sweeper runs and counters are kept.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_sweeper_preloaded(
    _fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    pg_sys::Datum::from(stats::enabled())
}

v1!(pg_finfo_idempotency_shared_stats);
/// `idempotency._shared_stats()`: this database's counters since server start (NULL when the
/// library is not preloaded).
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_shared_stats(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    unsafe {
        refuse_stats_to_tenants();
        let slot = stats::snapshot();
        let counter = |e: Event| slot.map(|s| s.counters[e as usize] as i64).into_datum();
        let last_at = slot
            .filter(|s| s.last_sweep_at != 0)
            .map(|s| pg_sys::Datum::from(s.last_sweep_at));
        let last_rows = slot
            .filter(|s| s.last_sweep_at != 0)
            .map(|s| s.last_sweep_rows)
            .into_datum();
        form_tuple(
            fcinfo,
            &[
                Some(pg_sys::Datum::from(stats::enabled())),
                counter(Event::ClaimNew),
                counter(Event::ClaimReplay),
                counter(Event::ClaimInProgress),
                counter(Event::ClaimMismatch),
                counter(Event::Completion),
                counter(Event::Release),
                counter(Event::Swept),
                last_at,
                last_rows,
            ],
        )
    }
}

/// The counters are the whole database's: only for roles that may read `idempotency.stats`
/// (its owner, superusers, roles granted SELECT on it, e.g. a monitoring role), not for
/// every tenant that has USAGE on the schema.
fn refuse_stats_to_tenants() {
    // SAFETY: catalog look-ups inside the calling transaction; `_shared_stats` is not SECURITY
    // DEFINER (it is also called from the view), so GetUserId() is the role asking.
    let allowed = unsafe {
        let role = pg_sys::GetUserId();
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), false);
        let view = pg_sys::get_relname_relid(c"stats".as_ptr(), nsp);
        pg_sys::superuser_arg(role)
            || (view != pg_sys::InvalidOid
                && pg_sys::pg_class_aclcheck(view, role, pg_sys::ACL_SELECT as pg_sys::AclMode)
                    == pg_sys::AclResult::ACLCHECK_OK)
    };
    if !allowed {
        raise(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "idempotency._shared_stats: the database-wide counters are for roles that may read idempotency.stats".into(),
            Some("GRANT SELECT ON idempotency.stats TO <role>; (see the README's Privileges and tenants)"),
        );
    }
}

v1!(pg_finfo_idempotency_complete);
/// `idempotency._complete(key, response, response_status, scope, token, ttl)`: the work of
/// `idempotency.complete`; NULL when there is no live claim to complete, which the SQL wrapper
/// turns into the IK001..IK003 error that says why.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_complete(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        let (key, scope) = key_and_scope(fcinfo, 0, 3);
        let response_status = check(keys::check_status(pg_getarg::<i32>(fcinfo, 2)));
        let ttl = optional_ttl(fcinfo, 5);
        if let Some(response) = jsonb_arg(fcinfo, 1) {
            check_size(
                "response",
                response,
                "idempotency.max_response_size",
                &guc::MAX_RESPONSE_SIZE,
            );
        }
        store::refuse_read_only("complete");
        let request = store::CompleteRequest {
            scope: &scope,
            key: &key,
            response: jsonb_arg(fcinfo, 1),
            response_status,
            token: pg_getarg::<i64>(fcinfo, 4),
            ttl,
        };
        match store::complete(&request) {
            Some(expires_at) => pg_sys::Datum::from(pg_sys::TimestampTz::from(expires_at)),
            None => pg_return_null(fcinfo),
        }
    }
}

v1!(pg_finfo_idempotency_announce);
/// `idempotency._announce()`: tells the background sweeper that this database now has the
/// extension (run by CREATE EXTENSION), so it is swept from the next round on.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_announce(_fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    stats::announce();
    pgrx::fcinfo::pg_return_void()
}

v1!(pg_finfo_idempotency_key);
/// `idempotency._key(key, scope) RETURNS text`: checks key and scope like every function does
/// and returns the key in the form the store keeps it; used by the PL/pgSQL functions.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_key(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        let (key, _scope) = key_and_scope(fcinfo, 0, 1);
        text_datum(&key, "key")
    }
}

v1!(pg_finfo_idempotency_store_changed);
/// `idempotency._store_changed()`: makes every backend re-read how the store keeps keys once
/// this transaction commits (run by `set_key_storage`).
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_store_changed(
    _fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), false);
        let relid = pg_sys::get_relname_relid(c"idempotency_keys".as_ptr(), nsp);
        if relid != pg_sys::InvalidOid {
            pg_sys::CacheInvalidateRelcacheByRelid(relid);
        }
        pgrx::fcinfo::pg_return_void()
    }
}

/// A secret argument: 16 bytes at least.
unsafe fn secret_arg(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> Vec<u8> {
    let secret: Option<Vec<u8>> = unsafe { pg_getarg(fcinfo, n) };
    match secret {
        Some(s) if s.len() >= 16 => s,
        Some(_) => raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            "secret must be at least 16 bytes".into(),
            None,
        ),
        None => arg_error(ArgError::null("secret")),
    }
}

v1!(pg_finfo_idempotency_sign);
/// `idempotency._sign(key text, kid int, secret bytea) RETURNS text`: the work of `sign_key`.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_sign(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        let key = text_arg(fcinfo, 0, "key");
        let key = check(keys::check_key("key", key.as_deref(), false)).to_string();
        let Some(kid) = pg_getarg::<i32>(fcinfo, 1).filter(|k| *k > 0) else {
            arg_error(ArgError::invalid("kid must be a positive integer".into()));
        };
        let secret = secret_arg(fcinfo, 2);
        let signed =
            guc::with_scope_prefix(|prefix| crate::signing::sign(&key, kid, &secret, prefix));
        text_datum(&signed, "signed key")
    }
}

v1!(pg_finfo_idempotency_signed_kid);
/// `idempotency._signed_kid(signed text) RETURNS int`: the secret id a signed key names, NULL
/// when the text is not shaped like a signed key.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_signed_kid(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        let signed = text_arg(fcinfo, 0, "signed");
        match signed.as_deref().and_then(crate::signing::parse) {
            Some((_, kid, _)) => pg_sys::Datum::from(kid),
            None => pg_return_null(fcinfo),
        }
    }
}

v1!(pg_finfo_idempotency_verify);
/// `idempotency._verify(signed text, secret bytea) RETURNS text`: the bare key when the
/// signature is right, NULL otherwise.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_verify(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        let signed = text_arg(fcinfo, 0, "signed");
        let secret = secret_arg(fcinfo, 1);
        match signed.as_deref().and_then(crate::signing::parse) {
            Some((key, kid, sig))
                if guc::with_scope_prefix(|prefix| {
                    crate::signing::verify(key, kid, &sig, &secret, prefix)
                }) =>
            {
                text_datum(key, "key")
            }
            _ => pg_return_null(fcinfo),
        }
    }
}

v1!(pg_finfo_idempotency_random_secret);
/// `idempotency._random_secret() RETURNS bytea`: 32 bytes from the server's strong random
/// source, so a new signing secret never appears in any SQL text or log.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_random_secret(
    _fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let mut buf = [0u8; 32];
    if !unsafe { pg_sys::pg_strong_random(buf.as_mut_ptr().cast(), buf.len()) } {
        raise(
            PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
            "could not generate a random secret".into(),
            None,
        );
    }
    bytea_datum(&buf)
}

v1!(pg_finfo_idempotency_sweep_audit);
/// `idempotency.sweep_audit(batch_size int DEFAULT NULL) RETURNS bigint`: deletes audit rows
/// older than `idempotency.audit_retention` (none when it is 0) in batches.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_sweep_audit(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let batch = unsafe { batch_size_arg(fcinfo) };
    store::refuse_read_only("sweep_audit");
    let prefix = sweep_prefix("sweep_audit");
    let retention = guc::AUDIT_RETENTION.get();
    if retention <= 0 {
        return pg_sys::Datum::from(0i64);
    }
    pg_sys::Datum::from(in_batches(batch, |b| {
        store::sweep_audit_batch(retention as f64, b, &prefix)
    }))
}

v1!(pg_finfo_idempotency_rekey);
/// `idempotency._rekey(digest bytea, secret bytea) RETURNS text`: the stored form of a key
/// whose SHA-256 is `digest` when the store keeps keys hashed under `secret` (used by
/// `set_key_storage` and the upgrade from 0.2.0, whose stored form was the hex SHA-256).
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_rekey(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        let digest: Option<Vec<u8>> = pg_getarg(fcinfo, 0);
        let Some(digest) = digest.filter(|d| d.len() == 32) else {
            arg_error(ArgError::invalid("digest must be a 32-byte SHA-256".into()));
        };
        let secret = secret_arg(fcinfo, 1);
        text_datum(&crate::signing::rekeyed(&digest, &secret), "key")
    }
}

v1!(pg_finfo_idempotency_check_recovery_point);
/// `idempotency._check_recovery_point(recovery_point text)`: refuses a recovery point larger
/// than `idempotency.max_recovery_point_size` (used by `checkpoint`).
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_check_recovery_point(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    unsafe {
        if !pg_arg_is_null(fcinfo, 0) {
            check_size(
                "recovery_point",
                pg_getarg_datum_raw(fcinfo, 0),
                "idempotency.max_recovery_point_size",
                &guc::MAX_RECOVERY_POINT_SIZE,
            );
        }
        pgrx::fcinfo::pg_return_void()
    }
}

/// Refuses a variable-length argument larger than a size setting (in kB), before anything is
/// written or copied: its size is read from the header, without detoasting.
unsafe fn check_size(
    arg: &str,
    value: pg_sys::Datum,
    setting: &str,
    limit: &'static pgrx::GucSetting<i32>,
) {
    // SAFETY: `value` is a varlena argument of the call; toast_raw_datum_size reads its header.
    let size = unsafe { pg_sys::toast_raw_datum_size(value) } as i64;
    let max = guc::int(limit) as i64 * 1024;
    if size > max {
        raise(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!("{arg} is too large: {size} bytes, {setting} allows {max}"),
            Some("store a reference to large results (a row id, an object store key) instead, or raise the setting"),
        );
    }
}
