//! Reads jsonb datums: [`write_canonical`] writes the canonical form straight from the binary
//! layout (read in Rust, no server call per value); [`to_value`] builds a tree (for exclusions)
//! with the same bounds-checked reader. Numbers come out as their exact `numeric` text, never through
//! `f64`.

use crate::canonical::{CanonError, Value, MAX_DEPTH};
use pgrx::pg_sys;
use std::borrow::Cow;
use std::ffi::CStr;

/// Converts a (possibly toasted) jsonb datum into a [`Value`], read with the same bounds-checked
/// reader as [`write_canonical`] (not the server's iterator, which trusts the binary layout): a
/// damaged value, whether from a damaged page or made by a superuser's binary cast from bytea,
/// is [`CanonError::Damaged`] (XX001), never a wild read.
///
/// # Safety
/// `datum` must be a non-NULL jsonb datum.
pub unsafe fn to_value(datum: pg_sys::Datum) -> Result<Value, CanonError> {
    // SAFETY: the caller's contract; the detoasted copy lives in the current memory context
    // for the duration of the read, and every read of it goes through the bounded slice.
    unsafe {
        let ptr = pg_sys::pg_detoast_datum(datum.cast_mut_ptr());
        let bytes = std::slice::from_raw_parts(
            pgrx::varlena::vardata_any(ptr).cast::<u8>(),
            pgrx::varlena::varsize_any_exhdr(ptr),
        );
        container_value(Container(bytes), 0, crate::encoding::utf8_database())
    }
}

/// One container as a [`Value`] (the raw-scalar wrapper of a top-level scalar gives the scalar);
/// members in jsonb's stored order, as the server's iterator returns them.
fn container_value(c: Container<'_>, depth: usize, utf8: bool) -> Result<Value, CanonError> {
    let header = c.header()?;
    let count = c.count()?;
    if header & JB_FARRAY != 0 {
        if header & JB_FSCALAR != 0 {
            if count != 1 {
                return Err(damaged());
            }
            return child_value(c.child(0, 1)?, depth, utf8);
        }
        if depth + 1 > MAX_DEPTH {
            return Err(CanonError::TooDeep);
        }
        // The capacity is bounded by the container's length (four bytes per entry).
        let mut items = Vec::with_capacity(count.min(c.0.len() / 4));
        for i in 0..count {
            items.push(child_value(c.child(i, count)?, depth + 1, utf8)?);
        }
        Ok(Value::Array(items))
    } else if header & JB_FOBJECT != 0 {
        if depth + 1 > MAX_DEPTH {
            return Err(CanonError::TooDeep);
        }
        let entries = 2 * count;
        let mut members = Vec::with_capacity(count.min(c.0.len() / 8));
        for i in 0..count {
            let Child::String(name) = c.child(i, entries)? else {
                return Err(damaged());
            };
            let value = child_value(c.child(count + i, entries)?, depth + 1, utf8)?;
            members.push((string_of(name, utf8)?.into_owned(), value));
        }
        Ok(Value::Object(members))
    } else {
        Err(damaged())
    }
}

fn child_value(child: Child<'_>, depth: usize, utf8: bool) -> Result<Value, CanonError> {
    Ok(match child {
        Child::Null => Value::Null,
        Child::Bool(b) => Value::Bool(b),
        Child::String(s) => Value::String(string_of(s, utf8)?.into_owned()),
        Child::Number(n) => Value::Number(number_string(n)?),
        Child::Container(c) => container_value(c, depth, utf8)?,
    })
}

/// A jsonb number's exact value as text (`[-]digits[e[-]digits]`, or the server's normalized
/// form for very long ones), read from an aligned copy, checked to lie within `n`.
fn number_string(n: &[u8]) -> Result<String, CanonError> {
    // Eight-byte words: aligned for the numeric's header and digits.
    let mut copy = vec![0u64; n.len().div_ceil(8).max(1)];
    let p = copy.as_mut_ptr().cast::<u8>();
    // SAFETY: `copy` has room for `n.len()` bytes; the numeric's own header must say it lies
    // within them before anything reads it as a numeric.
    unsafe {
        std::ptr::copy_nonoverlapping(n.as_ptr(), p, n.len());
        if n.is_empty() || pgrx::varlena::varsize_any(p.cast()) > n.len() {
            return Err(damaged());
        }
        let num = p as pg_sys::Numeric;
        let mut text = [0u8; 64];
        if let Some(t) = numeric_text(num, &mut text) {
            return Ok(t.to_owned());
        }
        // Rare (more than 60 digits): the server lays it out.
        let t = pg_sys::numeric_normalize(num);
        let owned = CStr::from_ptr(t).to_string_lossy().into_owned();
        pg_sys::pfree(t.cast());
        Ok(owned)
    }
}

/// Writes the canonical form of a (possibly toasted) jsonb datum straight from its binary form,
/// without building a tree, copying output or calling into the server per value: each
/// object's members are read (nested containers unopened), put into RFC 8785 order, and
/// written one by one, descending into nested containers as they come. Same output as
/// `canonical::write_canonical` on [`to_value`]'s tree (tests compare the two).
///
/// # Safety
/// `datum` must be a non-NULL jsonb datum.
pub unsafe fn write_canonical(
    datum: pg_sys::Datum,
    mode: crate::canonical::NumberMode,
    out: &mut String,
) -> Result<(), CanonError> {
    // SAFETY: `datum` is a non-NULL jsonb (this function's contract): its varlena header is
    // readable, it is read in place only when neither compressed nor external, otherwise
    // detoasted into the current memory context, and the slice covers exactly its payload,
    // which write_container reads with bounds checks.
    unsafe {
        let mut ptr = datum.cast_mut_ptr::<pg_sys::varlena>();
        // Read in place unless compressed or stored out of line.
        let in_place = pgrx::varlena::varatt_is_4b_u(ptr)
            || (pgrx::varlena::varatt_is_1b(ptr) && !pgrx::varlena::varatt_is_1b_e(ptr));
        if !in_place {
            ptr = pg_sys::pg_detoast_datum(ptr);
        }
        let bytes = std::slice::from_raw_parts(
            pgrx::varlena::vardata_any(ptr).cast::<u8>(),
            pgrx::varlena::varsize_any_exhdr(ptr),
        );
        write_container(
            Container(bytes),
            mode,
            out,
            0,
            crate::encoding::utf8_database(),
        )
    }
}

// jsonb's binary layout (src/include/utils/jsonb.h, unchanged since 9.4): a container is a
// 32-bit header (count and kind), one 32-bit JEntry per child (an object's keys first, then its
// values), then the children's data. A JEntry holds the child's type and either its length or,
// every 32nd child, its end offset. Numbers and nested containers start int-aligned.
const JB_CMASK: u32 = 0x0FFF_FFFF;
const JB_FSCALAR: u32 = 0x1000_0000;
const JB_FOBJECT: u32 = 0x2000_0000;
const JB_FARRAY: u32 = 0x4000_0000;
const JENTRY_OFFLENMASK: u32 = 0x0FFF_FFFF;
const JENTRY_TYPEMASK: u32 = 0x7000_0000;
const JENTRY_HAS_OFF: u32 = 0x8000_0000;
const JENTRY_ISSTRING: u32 = 0x0000_0000;
const JENTRY_ISNUMERIC: u32 = 0x1000_0000;
const JENTRY_ISBOOL_FALSE: u32 = 0x2000_0000;
const JENTRY_ISBOOL_TRUE: u32 = 0x3000_0000;
const JENTRY_ISNULL: u32 = 0x4000_0000;
const JENTRY_ISCONTAINER: u32 = 0x5000_0000;

/// One jsonb container's bytes (slices keep every read in bounds: a damaged value gives an
/// error, not a wild read).
#[derive(Clone, Copy)]
struct Container<'a>(&'a [u8]);

/// One child of a container.
#[derive(Clone, Copy)]
enum Child<'a> {
    Null,
    Bool(bool),
    String(&'a [u8]),
    /// A `numeric` varlena, possibly unaligned.
    Number(&'a [u8]),
    Container(Container<'a>),
}

fn damaged() -> CanonError {
    CanonError::Damaged
}

impl<'a> Container<'a> {
    fn word(&self, at: usize) -> Result<u32, CanonError> {
        let b = self.0.get(at..at + 4).ok_or_else(damaged)?;
        Ok(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn header(&self) -> Result<u32, CanonError> {
        self.word(0)
    }

    fn count(&self) -> Result<usize, CanonError> {
        Ok((self.header()? & JB_CMASK) as usize)
    }

    fn entry(&self, i: usize) -> Result<u32, CanonError> {
        self.word(4 + 4 * i)
    }

    /// Where child `i`'s data starts, relative to the data area.
    fn offset(&self, i: usize) -> Result<usize, CanonError> {
        let mut offset = 0usize;
        for j in (0..i).rev() {
            let e = self.entry(j)?;
            offset += (e & JENTRY_OFFLENMASK) as usize;
            if e & JENTRY_HAS_OFF != 0 {
                break;
            }
        }
        Ok(offset)
    }

    /// Child `i` of a container with `entries` JEntries.
    fn child(&self, i: usize, entries: usize) -> Result<Child<'a>, CanonError> {
        let e = self.entry(i)?;
        let start = self.offset(i)?;
        let end = if e & JENTRY_HAS_OFF != 0 {
            (e & JENTRY_OFFLENMASK) as usize
        } else {
            start + (e & JENTRY_OFFLENMASK) as usize
        };
        let base = 4 + 4 * entries;
        let data = |from: usize| {
            (from <= end)
                .then(|| self.0.get(base + from..base + end))
                .flatten()
                .ok_or_else(damaged)
        };
        let aligned = (start + 3) & !3;
        Ok(match e & JENTRY_TYPEMASK {
            JENTRY_ISSTRING => Child::String(data(start)?),
            JENTRY_ISNUMERIC => Child::Number(data(aligned)?),
            JENTRY_ISBOOL_FALSE => Child::Bool(false),
            JENTRY_ISBOOL_TRUE => Child::Bool(true),
            JENTRY_ISNULL => Child::Null,
            JENTRY_ISCONTAINER => Child::Container(Container(data(aligned)?)),
            _ => return Err(damaged()),
        })
    }
}

/// A jsonb string as text. jsonb keeps its strings in the database encoding: valid UTF-8 in a
/// UTF-8 database (PostgreSQL verifies every text it takes in against the database encoding,
/// jsonb's parser included, as pgrx relies on for its own &str conversions), read in place;
/// converted to UTF-8 in any other.
fn string_of(bytes: &[u8], utf8: bool) -> Result<Cow<'_, str>, CanonError> {
    if utf8 {
        // SAFETY: see above.
        Ok(Cow::Borrowed(unsafe {
            std::str::from_utf8_unchecked(bytes)
        }))
    } else {
        crate::encoding::to_utf8(bytes).map_err(CanonError::Untranslatable)
    }
}

fn write_child(
    child: Child<'_>,
    mode: crate::canonical::NumberMode,
    out: &mut String,
    depth: usize,
    utf8: bool,
) -> Result<(), CanonError> {
    use crate::canonical::{write_number, write_string};
    match child {
        Child::Null => out.push_str("null"),
        Child::Bool(b) => out.push_str(if b { "true" } else { "false" }),
        Child::String(s) => write_string(&string_of(s, utf8)?, out),
        // SAFETY: `n` is the bytes of one numeric inside a container whose bounds were checked;
        // they are copied into an aligned buffer at least `n.len()` long (the stack array, or a
        // palloc of that size), the numeric's own varlena length is checked to lie within `n`
        // before anything reads it, and the C string numeric_normalize returns is freed once read.
        Child::Number(n) => unsafe {
            // Read from an aligned copy: a jsonb read in place (a short varlena header) puts
            // its numbers at odd addresses.
            let mut small = [0u64; 16];
            let copy = if n.len() <= std::mem::size_of_val(&small) {
                let p = small.as_mut_ptr().cast::<u8>();
                std::ptr::copy_nonoverlapping(n.as_ptr(), p, n.len());
                p
            } else {
                let p = pg_sys::palloc(n.len()).cast::<u8>();
                std::ptr::copy_nonoverlapping(n.as_ptr(), p, n.len());
                p
            };
            // The numeric's own varlena header tells its length; it must lie within `n`.
            if n.is_empty() || pgrx::varlena::varsize_any(copy.cast()) > n.len() {
                return Err(damaged());
            }
            let num = copy as pg_sys::Numeric;
            let mut text = [0u8; 64];
            match numeric_text(num, &mut text) {
                Some(t) => write_number(t, mode, out)?,
                None => {
                    // Rare (more than 60 digits): the server lays it out.
                    let t = pg_sys::numeric_normalize(num);
                    let r = write_number(&CStr::from_ptr(t).to_string_lossy(), mode, out);
                    pg_sys::pfree(t.cast());
                    r?;
                }
            }
        },
        Child::Container(c) => write_container(c, mode, out, depth, utf8)?,
    }
    Ok(())
}

/// Writes one container (object, array, or the raw-scalar wrapper of a top-level scalar).
fn write_container(
    c: Container<'_>,
    mode: crate::canonical::NumberMode,
    out: &mut String,
    depth: usize,
    utf8: bool,
) -> Result<(), CanonError> {
    use crate::canonical::{utf16_cmp, write_string};
    let header = c.header()?;
    let count = c.count()?;
    if header & JB_FARRAY != 0 {
        if header & JB_FSCALAR != 0 {
            if count != 1 {
                return Err(damaged());
            }
            return write_child(c.child(0, 1)?, mode, out, depth, utf8);
        }
        if depth + 1 > MAX_DEPTH {
            return Err(CanonError::TooDeep);
        }
        out.push('[');
        for i in 0..count {
            if i > 0 {
                out.push(',');
            }
            write_child(c.child(i, count)?, mode, out, depth + 1, utf8)?;
        }
        out.push(']');
    } else if header & JB_FOBJECT != 0 {
        if depth + 1 > MAX_DEPTH {
            return Err(CanonError::TooDeep);
        }
        let entries = 2 * count;
        let mut members: Vec<(Cow<'_, str>, usize)> = Vec::with_capacity(count);
        for i in 0..count {
            let Child::String(name) = c.child(i, entries)? else {
                return Err(damaged());
            };
            members.push((string_of(name, utf8)?, count + i));
        }
        // jsonb keeps keys ordered by length, then bytes; RFC 8785 wants UTF-16 order.
        members.sort_by(|a, b| utf16_cmp(&a.0, &b.0));
        out.push('{');
        for (i, (name, value)) in members.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_string(name, out);
            out.push(':');
            write_child(c.child(*value, entries)?, mode, out, depth + 1, utf8)?;
        }
        out.push('}');
    } else {
        return Err(damaged());
    }
    Ok(())
}

/// The exact value of a `numeric` as `[-]<digits>e<exponent>` text in `buf`, read from its
/// stored form (a varlena of base-10000 digits with a weight: PostgreSQL's on-disk format,
/// fixed since 9.1), without a call into the server per number. None for what this does not
/// read (a special value, which jsonb never holds, or more digits than `buf` has room for):
/// the caller then asks `numeric_normalize`.
///
/// # Safety
/// `num` must point to a valid, detoasted `numeric`.
pub(crate) unsafe fn numeric_text(num: pg_sys::Numeric, buf: &mut [u8; 64]) -> Option<&str> {
    // SAFETY: `num` is a valid, detoasted numeric (this function's contract); every read below
    // is at an offset below `len`, the length of its payload, which is checked first.
    unsafe {
        let ptr = num as *const pg_sys::varlena;
        let len = pgrx::varlena::varsize_any_exhdr(ptr);
        let data = pgrx::varlena::vardata_any(ptr) as *const u8;
        if len < 2 {
            return None;
        }
        let word = |at: usize| u16::from_ne_bytes([*data.add(at), *data.add(at + 1)]);
        let header = word(0);
        let (negative, weight, start) = if header & 0x8000 != 0 {
            if header & 0xC000 == 0xC000 {
                return None; // NaN or an infinity
            }
            // Short form: sign, display scale and a 7-bit weight in the header word.
            let magnitude = (header & 0x003F) as i64;
            let weight = if header & 0x0040 != 0 {
                magnitude - 64
            } else {
                magnitude
            };
            (header & 0x2000 != 0, weight, 2usize)
        } else {
            if len < 4 {
                return None;
            }
            // Long form: sign and display scale, then a 16-bit weight.
            (header & 0xC000 == 0x4000, word(2) as i16 as i64, 4usize)
        };
        let ndigits = (len - start) / 2;
        if ndigits == 0 {
            buf[0] = b'0';
            return std::str::from_utf8(&buf[..1]).ok();
        }
        // Sign, 4 decimal digits per base-10000 digit, 'e', sign and up to 6 exponent digits.
        if 1 + 4 * ndigits + 8 > buf.len() {
            return None;
        }
        let mut n = 0;
        if negative {
            buf[n] = b'-';
            n += 1;
        }
        for i in 0..ndigits {
            let d = word(start + 2 * i);
            if d > 9999 {
                return None;
            }
            for (j, div) in [1000u16, 100, 10, 1].into_iter().enumerate() {
                let digit = (d / div) % 10;
                // The first base-10000 digit without its leading zeros (all but the last).
                if i == 0 && n == usize::from(negative) && digit == 0 && j < 3 {
                    continue;
                }
                buf[n] = b'0' + digit as u8;
                n += 1;
            }
        }
        // value = digits * 10^(4 * (weight - (ndigits - 1)))
        let exponent = 4 * (weight - (ndigits as i64 - 1));
        buf[n] = b'e';
        n += 1;
        if exponent < 0 {
            buf[n] = b'-';
            n += 1;
        }
        // |exponent| < 4 * 2^15: at most six digits, written from the right.
        let mut magnitude = exponent.unsigned_abs();
        let mut digits = [0u8; 8];
        let mut at = digits.len();
        loop {
            at -= 1;
            digits[at] = b'0' + (magnitude % 10) as u8;
            magnitude /= 10;
            if magnitude == 0 {
                break;
            }
        }
        let written = &digits[at..];
        buf[n..n + written.len()].copy_from_slice(written);
        n += written.len();
        std::str::from_utf8(&buf[..n]).ok()
    }
}
