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
        std::str::from_utf8(bytes).unwrap_or("\u{fffd}")
    }
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
                let t = pg_sys::numeric_normalize(v.val.numeric);
                let r = write_number(&CStr::from_ptr(t).to_string_lossy(), mode, out);
                pg_sys::pfree(t.cast());
                r?;
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
