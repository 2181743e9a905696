//! The argument and result types of the typed SQL functions (`#[pg_extern(sql = false)]`) that
//! pgrx's own types cannot stand for: text in the database encoding (pgrx's `&str` and `String`
//! assume UTF-8) and jsonb read in place by `jsonb` (pgrx's `JsonB` builds a serde tree, which
//! rounds numbers). Each argument type holds the call's datum, valid for the call (`'fcx`).

use crate::arguments;
use crate::arguments::ArgError;
use crate::canonical::NumberMode;
use crate::canonical::Value;
use crate::error::canon_error;
use crate::error::{arg_error, check, raise};
use crate::guc;
use crate::store;
use crate::{encoding, jsonb};
use pgrx::callconv::{Arg, ArgAbi, BoxRet, FcInfo};
use pgrx::datum::Interval;
use pgrx::PgSqlErrorCode;
use pgrx::{pg_sys, FromDatum};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::marker::PhantomData;

/// Declares an argument type holding the call's non-NULL datum of one SQL type.
macro_rules! datum_argument {
    ($(#[$doc:meta])* $name:ident, $sql:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy)]
        pub struct $name<'fcx>(pg_sys::Datum, PhantomData<&'fcx ()>);

        impl FromDatum for $name<'_> {
            unsafe fn from_polymorphic_datum(
                datum: pg_sys::Datum,
                is_null: bool,
                _: pg_sys::Oid,
            ) -> Option<Self> {
                (!is_null).then_some($name(datum, PhantomData))
            }
        }

        // SAFETY: only the datum is kept, not read: the SQL declaration gives the argument
        // this type, and the function reads it only while the call lasts ('fcx).
        unsafe impl<'fcx> ArgAbi<'fcx> for $name<'fcx> {
            unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
                let index = arg.index();
                // SAFETY: the caller's (pgrx's wrapper's) guarantees; FromDatum above only
                // copies the datum.
                unsafe { arg.unbox_arg_using_from_datum() }
                    .unwrap_or_else(|| panic!("argument {index} must not be null"))
            }
        }

        pgrx::impl_sql_translatable!($name<'_>, $sql);
    };
}

datum_argument!(
    /// A text argument, in the database encoding.
    Text,
    "text"
);

datum_argument!(
    /// A jsonb argument, read in place by `jsonb`.
    Jsonb,
    "jsonb"
);

datum_argument!(
    /// A `text[]` argument.
    TextArray,
    "text[]"
);

/// The raw fmgr functions' access to an argument type (`claim`, `complete`, `claim_many` read
/// their arguments by position).
macro_rules! raw_argument {
    ($name:ident) => {
        impl<'fcx> $name<'fcx> {
            /// The datum as the call passed it (possibly toasted).
            pub fn datum(self) -> pg_sys::Datum {
                self.0
            }

            /// Argument `n` of a raw fmgr call, None when NULL.
            ///
            /// # Safety
            /// `fcinfo` is the current call, whose SQL declaration gives argument `n` this
            /// type; the value is used only while the call lasts.
            pub unsafe fn arg(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> Option<Self> {
                // SAFETY: the caller's guarantees.
                unsafe {
                    if pgrx::fcinfo::pg_arg_is_null(fcinfo, n) {
                        None
                    } else {
                        Some($name(
                            pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, n),
                            PhantomData,
                        ))
                    }
                }
            }
        }
    };
}

raw_argument!(Text);
raw_argument!(Jsonb);

impl<'fcx> Text<'fcx> {
    /// The text as UTF-8: read in place when it is neither compressed nor out of line (a key
    /// or a scope always is) and the database is UTF-8 (PostgreSQL has verified the text);
    /// converted from the database encoding in any other (`encoding`), raising 22P05 naming
    /// `arg` for a character without a Unicode equivalent.
    pub fn utf8(self, arg: &str) -> Cow<'fcx, str> {
        // SAFETY: a non-NULL text datum of the call, which outlives 'fcx.
        unsafe { encoding::text_of(self.0, arg) }
    }
}

impl Jsonb<'_> {
    /// The document as a canonical tree, raising a clear error naming `arg`.
    pub fn value(self, arg: &str) -> Value {
        // SAFETY: a non-NULL jsonb datum of the call.
        unsafe { jsonb::to_value(self.0) }.unwrap_or_else(|e| canon_error(arg, e))
    }
}

impl TextArray<'_> {
    /// The elements as UTF-8 (NULL elements as None); an untranslatable character raises
    /// 22P05 naming `arg`.
    pub fn elements(self, arg: &str) -> Option<Vec<Option<String>>> {
        // SAFETY: a non-NULL text[] datum of the call; its elements are text datums that live
        // as long as the detoasted array, inside this call.
        unsafe {
            let (_, elements) = array_elements(self.0);
            Some(
                elements
                    .into_iter()
                    .map(|d| d.map(|d| encoding::text_of(d, arg).into_owned()))
                    .collect(),
            )
        }
    }
}

/// A text result in the database encoding; a character it cannot represent raises 22P05
/// naming what the text is.
pub struct DbText(pg_sys::Datum);

impl DbText {
    pub fn new(text: &str, what: &str) -> DbText {
        DbText(encoding::text_datum(text, what))
    }
}

// SAFETY: the datum is a text allocated in the call's memory context by `encoding::text_datum`,
// returned as the call's result.
unsafe impl BoxRet for DbText {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> pgrx::datum::Datum<'fcx> {
        // SAFETY: as above.
        unsafe { fcinfo.return_raw_datum(self.0) }
    }
}

pgrx::impl_sql_translatable!(DbText, "text");

/// A row of the call's declared result type (its OUT parameters), formed as it is returned:
/// each field a datum of its column's type (`columns`, checked against the declared type;
/// `what` names the result in the error), NULL where None or missing.
pub struct Row {
    pub(crate) columns: &'static [super::result::ResultColumn],
    /// The columns every release declares: a result of fewer is refused; one of at least these
    /// (a store not yet updated) gets the fields of its columns.
    pub(crate) required: usize,
    pub(crate) what: &'static str,
    pub(crate) fields: Vec<Option<pg_sys::Datum>>,
}

// SAFETY: the row is formed from the current call's declared result type by `form_tuple`,
// which checks that it is a composite whose first columns are `columns` (names and types of
// the fields' datums), in the call's memory context, and returned as the call's result.
unsafe impl BoxRet for Row {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> pgrx::datum::Datum<'fcx> {
        // SAFETY: as above; `fcinfo` is the current call.
        unsafe {
            let row = super::result::form_tuple(
                fcinfo.as_mut_ptr(),
                self.columns,
                self.required,
                self.what,
                &self.fields,
            );
            fcinfo.return_raw_datum(row)
        }
    }
}

pgrx::impl_sql_translatable!(Row, "record");

// Shared argument reading and checking ---------------------------------------------------

pub(super) fn interval_parts(i: &Interval) -> (i32, i32, i64) {
    (i.months(), i.days(), i.micros())
}

pub(super) fn seconds_interval(seconds: i32) -> Interval {
    Interval::new(0, 0, seconds as i64 * 1_000_000).unwrap_or_else(|e| {
        raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("bad setting: {e}"),
            None,
        )
    })
}

/// A TTL or lease: the argument, or the setting's default when NULL, and its name for errors.
pub(super) struct Duration {
    pub(super) value: Interval,
    /// "ttl", "lease", or the setting that supplied the value.
    pub(super) name: &'static str,
    /// `now() + value`, as the store computes it (calendar months and days, session time zone).
    pub(super) ends: pg_sys::TimestampTz,
}

/// Checks a duration on its own (positive, at most ten years) and on the clock: `now() +` it
/// must lie after now and at most ten calendar years ahead. ('1 month -29 days' is positive
/// counted in 30-day months but ends before now in February; '122 months' is 3660 days but
/// over ten years.)
pub(super) fn duration(name: &'static str, value: Interval) -> Duration {
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
pub(super) fn interval_text(i: &Interval) -> String {
    arguments::abbreviate(&i.to_string())
}

/// The TTL and lease of a claim: each argument, or its setting when NULL. With no lease given
/// the lease is `least(idempotency.default_lease, ttl)`, so `claim(key, ttl => '1 second')`
/// works; a lease that would outlive the key is refused, naming what set each.
pub(super) fn ttl_and_lease(
    ttl: Option<Interval>,
    lease: Option<Interval>,
) -> (Duration, Duration) {
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
pub(super) unsafe fn hash_arg(datum: pg_sys::Datum, arg: &str) -> [u8; 32] {
    with_scratch(|text| {
        // SAFETY: the caller's guarantee; the writer only reads the datum.
        unsafe { jsonb::write_canonical(datum, NumberMode::Exact, text) }
            .unwrap_or_else(|e| canon_error(arg, e));
        Sha256::digest(text.as_bytes()).into()
    })
}

/// The buffer canonical forms are written into before they are hashed, kept between calls
/// so hashing a document does not grow a fresh string (copies, new pages) every time.
pub(super) static SCRATCH: crate::local::BackendLocal<std::cell::RefCell<String>> =
    crate::local::BackendLocal::new(std::cell::RefCell::new(String::new()));

/// Runs `f` on the emptied scratch buffer; a buffer grown past 1 MB is given back afterwards.
pub(super) fn with_scratch<R>(f: impl FnOnce(&mut String) -> R) -> R {
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
pub(super) fn checked_key_and_scope(
    key: Option<Text<'_>>,
    scope: Option<Text<'_>>,
) -> (String, String) {
    let key = key.map(|t| t.utf8("key"));
    let scope = scope.map(|t| t.utf8("scope"));
    check(arguments::check_key("key", key.as_deref(), false));
    check(arguments::check_key("scope", scope.as_deref(), true));
    // Both were checked to be non-NULL above.
    let (key, scope) = (key.unwrap_or_default(), scope.unwrap_or_default());
    crate::binding::check_scope(&scope);
    (key.into_owned(), scope.into_owned())
}

/// Like `checked_key_and_scope`, with the key in the form the store keeps it (hashed when the
/// store keeps keys hashed).
pub(super) fn key_and_scope(key: Option<Text<'_>>, scope: Option<Text<'_>>) -> (String, String) {
    let (key, scope) = checked_key_and_scope(key, scope);
    (store::stored_form(key), scope)
}

/// An optional `ttl` argument (NULL: the caller's default applies), checked when given.
pub(super) fn optional_ttl(ttl: Option<Interval>) -> Option<Interval> {
    ttl.map(|t| duration("ttl", t).value)
}

/// Refuses a variable-length argument larger than a size setting (in kB), before anything is
/// written or copied: its size is read from the header, without detoasting.
///
/// # Safety
/// `value` is a non-NULL varlena argument of the current call.
pub(super) unsafe fn check_size(arg: &str, value: pg_sys::Datum, (limit, setting): (i32, &str)) {
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
pub(super) unsafe fn array_arg(
    fcinfo: pg_sys::FunctionCallInfo,
    n: usize,
    arg: &str,
) -> Option<Vec<Option<pg_sys::Datum>>> {
    // SAFETY: the caller's guarantees: a non-NULL argument `n` is an array datum.
    let (ndim, elements) = unsafe {
        if pgrx::fcinfo::pg_arg_is_null(fcinfo, n) {
            return None;
        }
        array_elements(pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, n))
    };
    if ndim > 1 {
        raise(
            PgSqlErrorCode::ERRCODE_ARRAY_ELEMENT_ERROR,
            format!("{arg} must be a one-dimensional array (got {ndim} dimensions)"),
            None,
        );
    }
    Some(elements)
}

/// The one reader of array arguments: the elements of an array datum in storage order (an
/// element None: NULL), with the array's number of dimensions. The element datums point into
/// the detoasted array, which lives in the current memory context.
///
/// # Safety
/// `datum` is a non-NULL array datum that lives as long as the current memory context.
unsafe fn array_elements(datum: pg_sys::Datum) -> (i32, Vec<Option<pg_sys::Datum>>) {
    // SAFETY: the caller's guarantees: the array is detoasted into the current context, and
    // deconstruct_array reads it with its element type's length, by-value flag and alignment,
    // returning `count` datums and null flags.
    unsafe {
        let array = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()) as *mut pg_sys::ArrayType;
        let ndim = (*array).ndim;
        let elemtype = (*array).elemtype;
        let (mut len, mut byval, mut align) = (0i16, false, 0 as std::ffi::c_char);
        pg_sys::get_typlenbyvalalign(elemtype, &mut len, &mut byval, &mut align);
        let mut elems: *mut pg_sys::Datum = std::ptr::null_mut();
        let mut nulls: *mut bool = std::ptr::null_mut();
        let mut count: i32 = 0;
        pg_sys::deconstruct_array(
            array, elemtype, len as i32, byval, align, &mut elems, &mut nulls, &mut count,
        );
        let elements = (0..count.max(0) as usize)
            .map(|i| (!*nulls.add(i)).then(|| *elems.add(i)))
            .collect();
        (ndim, elements)
    }
}

/// Refuses a companion array whose length differs from `keys` (22023, naming both).
pub(super) fn same_length<T>(arg: &str, array: Option<&Vec<T>>, keys: usize) {
    if let Some(a) = array {
        if a.len() != keys {
            arg_error(ArgError::invalid(format!(
                "{arg} must have one element per key: it has {}, keys has {keys}",
                a.len()
            )));
        }
    }
}
