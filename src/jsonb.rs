//! Reads a jsonb datum into a [`Value`] by walking its binary form with PostgreSQL's own
//! iterator: numbers come out as their exact `numeric` text, never through `f64`.

use crate::canonical::{CanonError, Value, MAX_DEPTH};
use pgrx::pg_sys;
use pgrx::pg_sys::JsonbIteratorToken as Tok;
use std::ffi::CStr;

enum Frame {
    Array(Vec<Value>),
    Object(Vec<(String, Value)>, Option<String>),
    /// jsonb stores a top-level scalar as a one-element "raw scalar" array.
    RawScalar(Option<Value>),
}

unsafe fn scalar(v: &pg_sys::JsonbValue) -> Value {
    unsafe {
        match v.type_ {
            pg_sys::jbvType::jbvNull => Value::Null,
            pg_sys::jbvType::jbvBool => Value::Bool(v.val.boolean),
            pg_sys::jbvType::jbvString => Value::String(string(v)),
            pg_sys::jbvType::jbvNumeric => {
                let text = pg_sys::numeric_normalize(v.val.numeric);
                let owned = CStr::from_ptr(text).to_string_lossy().into_owned();
                pg_sys::pfree(text.cast());
                Value::Number(owned)
            }
            other => panic!("unexpected jsonb scalar type {other}"),
        }
    }
}

unsafe fn string(v: &pg_sys::JsonbValue) -> String {
    unsafe {
        let s = v.val.string;
        let bytes = std::slice::from_raw_parts(s.val as *const u8, s.len as usize);
        // jsonb text is valid UTF-8 in a UTF-8 database; other encodings are converted lossily.
        String::from_utf8_lossy(bytes).into_owned()
    }
}

fn push(stack: &mut [Frame], result: &mut Option<Value>, value: Value) {
    match stack.last_mut() {
        Some(Frame::Array(items)) => items.push(value),
        Some(Frame::Object(members, pending)) => {
            let name = pending.take().unwrap_or_default();
            members.push((name, value));
        }
        Some(Frame::RawScalar(slot)) => *slot = Some(value),
        None => *result = Some(value),
    }
}

/// Converts a (possibly toasted) jsonb datum into a [`Value`].
///
/// # Safety
/// `datum` must be a non-NULL jsonb datum.
pub unsafe fn to_value(datum: pg_sys::Datum) -> Result<Value, CanonError> {
    unsafe {
        let jb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()) as *mut pg_sys::Jsonb;
        let mut it = pg_sys::JsonbIteratorInit(&mut (*jb).root);
        let mut v: pg_sys::JsonbValue = std::mem::zeroed();
        let mut stack: Vec<Frame> = Vec::new();
        let mut depth = 0usize;
        let mut result = None;
        loop {
            match pg_sys::JsonbIteratorNext(&mut it, &mut v, false) {
                Tok::WJB_DONE => break,
                Tok::WJB_BEGIN_ARRAY if v.val.array.rawScalar => stack.push(Frame::RawScalar(None)),
                Tok::WJB_BEGIN_ARRAY | Tok::WJB_BEGIN_OBJECT => {
                    depth += 1;
                    if depth > MAX_DEPTH {
                        return Err(CanonError::TooDeep);
                    }
                    if v.type_ == pg_sys::jbvType::jbvArray {
                        stack.push(Frame::Array(Vec::with_capacity(
                            v.val.array.nElems.max(0) as usize
                        )));
                    } else {
                        stack.push(Frame::Object(
                            Vec::with_capacity(v.val.object.nPairs.max(0) as usize),
                            None,
                        ));
                    }
                }
                Tok::WJB_KEY => {
                    if let Some(Frame::Object(_, pending)) = stack.last_mut() {
                        *pending = Some(string(&v));
                    }
                }
                Tok::WJB_VALUE | Tok::WJB_ELEM => push(&mut stack, &mut result, scalar(&v)),
                Tok::WJB_END_ARRAY | Tok::WJB_END_OBJECT => {
                    let value = match stack.pop() {
                        Some(Frame::Array(items)) => {
                            depth -= 1;
                            Value::Array(items)
                        }
                        Some(Frame::Object(members, _)) => {
                            depth -= 1;
                            Value::Object(members)
                        }
                        Some(Frame::RawScalar(inner)) => inner.unwrap_or(Value::Null),
                        None => panic!("unbalanced jsonb iterator"),
                    };
                    push(&mut stack, &mut result, value);
                }
                other => panic!("unexpected jsonb iterator token {other}"),
            }
        }
        Ok(result.unwrap_or(Value::Null))
    }
}

/// Writes the canonical form of a (possibly toasted) jsonb datum straight from its binary form,
/// without building a tree or copying output: each object's members are read (nested
/// containers unopened), put into RFC 8785 order, and written one by one, descending into
/// nested containers as they come. Same output as `canonical::write_canonical` on
/// [`to_value`]'s tree (a test compares the two).
///
/// # Safety
/// `datum` must be a non-NULL jsonb datum.
pub unsafe fn write_canonical(
    datum: pg_sys::Datum,
    mode: crate::canonical::NumberMode,
    out: &mut String,
) -> Result<(), CanonError> {
    unsafe {
        let jb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()) as *mut pg_sys::Jsonb;
        write_container(&mut (*jb).root, mode, out, 0)
    }
}

/// A string of the jsonb (valid as long as the jsonb is).
unsafe fn text<'a>(v: &pg_sys::JsonbValue) -> &'a str {
    unsafe {
        let s = v.val.string;
        let bytes = std::slice::from_raw_parts(s.val as *const u8, s.len as usize);
        if utf8_database() {
            // PostgreSQL verifies every text it takes in against a UTF-8 database's encoding
            // (jsonb's parser included), as pgrx relies on for its own &str conversions.
            std::str::from_utf8_unchecked(bytes)
        } else {
            std::str::from_utf8(bytes).unwrap_or("\u{fffd}")
        }
    }
}

thread_local! {
    static UTF8_DATABASE: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Whether the database's encoding is UTF-8 (a backend stays in one database).
fn utf8_database() -> bool {
    UTF8_DATABASE.with(|c| {
        if let Some(known) = c.get() {
            return known;
        }
        let utf8 = unsafe { pg_sys::GetDatabaseEncoding() } == pg_sys::pg_enc::PG_UTF8 as i32;
        c.set(Some(utf8));
        utf8
    })
}

unsafe fn write_value(
    v: &pg_sys::JsonbValue,
    mode: crate::canonical::NumberMode,
    out: &mut String,
    depth: usize,
) -> Result<(), CanonError> {
    use crate::canonical::{write_number, write_string};
    unsafe {
        match v.type_ {
            pg_sys::jbvType::jbvNull => out.push_str("null"),
            pg_sys::jbvType::jbvBool => out.push_str(if v.val.boolean { "true" } else { "false" }),
            pg_sys::jbvType::jbvString => write_string(text(v), out),
            pg_sys::jbvType::jbvNumeric => {
                let mut text = [0u8; 64];
                match numeric_text(v.val.numeric, &mut text) {
                    Some(t) => write_number(t, mode, out)?,
                    None => {
                        let t = pg_sys::numeric_normalize(v.val.numeric);
                        let r = write_number(&CStr::from_ptr(t).to_string_lossy(), mode, out);
                        pg_sys::pfree(t.cast());
                        r?;
                    }
                }
            }
            pg_sys::jbvType::jbvBinary => write_container(v.val.binary.data, mode, out, depth)?,
            other => panic!("unexpected jsonb value type {other}"),
        }
    }
    Ok(())
}

/// Writes one container (object, array, or the raw-scalar wrapper of a top-level scalar).
unsafe fn write_container(
    container: *mut pg_sys::JsonbContainer,
    mode: crate::canonical::NumberMode,
    out: &mut String,
    depth: usize,
) -> Result<(), CanonError> {
    use crate::canonical::{utf16_cmp, write_string};
    unsafe {
        let mut it = pg_sys::JsonbIteratorInit(container);
        let mut v: pg_sys::JsonbValue = std::mem::zeroed();
        match pg_sys::JsonbIteratorNext(&mut it, &mut v, true) {
            Tok::WJB_BEGIN_ARRAY if v.val.array.rawScalar => {
                pg_sys::JsonbIteratorNext(&mut it, &mut v, true);
                write_value(&v, mode, out, depth)?;
            }
            Tok::WJB_BEGIN_ARRAY => {
                if depth + 1 > MAX_DEPTH {
                    return Err(CanonError::TooDeep);
                }
                out.push('[');
                let mut first = true;
                while pg_sys::JsonbIteratorNext(&mut it, &mut v, true) == Tok::WJB_ELEM {
                    if !first {
                        out.push(',');
                    }
                    first = false;
                    write_value(&v, mode, out, depth + 1)?;
                }
                out.push(']');
            }
            Tok::WJB_BEGIN_OBJECT => {
                if depth + 1 > MAX_DEPTH {
                    return Err(CanonError::TooDeep);
                }
                let mut members: Vec<(&str, pg_sys::JsonbValue)> =
                    Vec::with_capacity(v.val.object.nPairs.max(0) as usize);
                let mut key = "";
                loop {
                    match pg_sys::JsonbIteratorNext(&mut it, &mut v, true) {
                        Tok::WJB_KEY => key = text(&v),
                        Tok::WJB_VALUE => members.push((key, v)),
                        _ => break,
                    }
                }
                members.sort_by(|a, b| utf16_cmp(a.0, b.0));
                out.push('{');
                for (i, (k, value)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_string(k, out);
                    out.push(':');
                    write_value(value, mode, out, depth + 1)?;
                }
                out.push('}');
            }
            other => panic!("unexpected jsonb iterator token {other}"),
        }
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
        let e = exponent.to_string();
        buf[n..n + e.len()].copy_from_slice(e.as_bytes());
        n += e.len();
        std::str::from_utf8(&buf[..n]).ok()
    }
}
