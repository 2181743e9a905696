//! The argument and result types of the typed SQL functions (`#[pg_extern(sql = false)]`) that
//! pgrx's own types cannot stand for: text in the database encoding (pgrx's `&str` and `String`
//! assume UTF-8) and jsonb read in place by `jsonb` (pgrx's `JsonB` builds a serde tree, which
//! rounds numbers). Each argument type holds the call's datum, valid for the call (`'fcx`).

use crate::canonical::Value;
use crate::error::canon_error;
use crate::{encoding, jsonb};
use pgrx::callconv::{Arg, ArgAbi, BoxRet, FcInfo};
use pgrx::{pg_sys, FromDatum};
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
            let array = pgrx::Array::<pg_sys::Datum>::from_datum(self.0, false)?;
            Some(
                array
                    .iter()
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
            let row = super::form_tuple(fcinfo.as_mut_ptr(), self.columns, self.what, &self.fields);
            fcinfo.return_raw_datum(row)
        }
    }
}

pgrx::impl_sql_translatable!(Row, "record");
