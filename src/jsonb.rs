//! Reads jsonb datums with the pure core's bounds-checked reader (`idempotency_core::jsonb`):
//! this module only finds the datum's bytes and gives the reader the database's side of it
//! (strings' encoding, interrupts). [`write_canonical`] writes the canonical form straight from
//! the binary layout (no tree, no server call per value); [`to_value`] builds a tree (for
//! exclusions and key derivation). Numbers come out as their exact `numeric` text, never
//! through `f64`. A damaged value, whether from a damaged page or made by a superuser's binary
//! cast from bytea, is [`CanonError::Damaged`] (XX001), never a wild read.

use crate::canonical::{CanonError, NumberMode, Value};
use idempotency_core::jsonb::{self as reader, Host};
use pgrx::pg_sys;
use std::borrow::Cow;

/// The database's side of reading a jsonb value.
struct Server {
    utf8: bool,
}

impl Server {
    fn new() -> Server {
        Server {
            utf8: crate::encoding::utf8_database(),
        }
    }
}

impl Host for Server {
    fn text<'a>(&mut self, bytes: &'a [u8]) -> Result<Cow<'a, str>, CanonError> {
        if self.utf8 {
            // Checked, not assumed: the bytes may come from a damaged page or a binary cast.
            return std::str::from_utf8(bytes)
                .map(Cow::Borrowed)
                .map_err(|_| CanonError::Damaged);
        }
        if !crate::encoding::valid_in_database(bytes) {
            return Err(CanonError::Damaged);
        }
        crate::encoding::to_utf8(bytes).map_err(CanonError::Untranslatable)
    }

    fn check_interrupts(&mut self) {
        pgrx::check_for_interrupts!();
    }
}

/// The payload of a (possibly toasted) jsonb datum, detoasted into the current memory context
/// when compressed or stored out of line, and passed to `f` as a slice.
///
/// # Safety
/// `datum` must be a non-NULL jsonb datum.
unsafe fn with_bytes<R>(datum: pg_sys::Datum, f: impl FnOnce(&[u8]) -> R) -> R {
    // SAFETY: `datum` is a non-NULL varlena (this function's contract): its header is
    // readable; it is read in place only when neither compressed nor external (a short or a
    // plain 4-byte header, whose length PostgreSQL's own accessors trust), otherwise
    // pg_detoast_datum gives a plain copy; the slice covers exactly the payload, and the
    // reader checks everything inside it.
    unsafe {
        let mut ptr = datum.cast_mut_ptr::<pg_sys::varlena>();
        let in_place = pgrx::varlena::varatt_is_4b_u(ptr)
            || (pgrx::varlena::varatt_is_1b(ptr) && !pgrx::varlena::varatt_is_1b_e(ptr));
        if !in_place {
            ptr = pg_sys::pg_detoast_datum(ptr);
        }
        f(std::slice::from_raw_parts(
            pgrx::varlena::vardata_any(ptr).cast::<u8>(),
            pgrx::varlena::varsize_any_exhdr(ptr),
        ))
    }
}

/// Converts a (possibly toasted) jsonb datum into a [`Value`], members in stored order.
///
/// # Safety
/// `datum` must be a non-NULL jsonb datum.
pub unsafe fn to_value(datum: pg_sys::Datum) -> Result<Value, CanonError> {
    // SAFETY: the caller's contract.
    unsafe { with_bytes(datum, |bytes| reader::to_value(bytes, &mut Server::new())) }
}

/// Writes the canonical form of a (possibly toasted) jsonb datum straight from its binary
/// form. Same output as `canonical::write_canonical` on [`to_value`]'s tree (tests compare
/// the two).
///
/// # Safety
/// `datum` must be a non-NULL jsonb datum.
pub unsafe fn write_canonical(
    datum: pg_sys::Datum,
    mode: NumberMode,
    out: &mut String,
) -> Result<(), CanonError> {
    // SAFETY: the caller's contract.
    unsafe {
        with_bytes(datum, |bytes| {
            reader::write_canonical(bytes, mode, out, &mut Server::new())
        })
    }
}
