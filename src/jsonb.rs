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
