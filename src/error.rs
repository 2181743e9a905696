//! Raising errors with a precise SQLSTATE.
//!
//! Errors raised from Rust carry standard SQLSTATEs (pgrx cannot raise custom ones); the
//! extension's own `IKxxx` codes are raised by the SQL functions in `sql/idempotency.sql`.

use crate::arguments::{ArgError, ArgErrorKind};
use crate::canonical::CanonError;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

/// Raises an ERROR; never returns.
pub fn raise(code: PgSqlErrorCode, message: String, hint: Option<&str>) -> ! {
    let message = for_message(message);
    let mut report = ErrorReport::new(code, message, "idempotency");
    if let Some(h) = hint {
        report = report.set_hint(for_message(h.to_string()));
    }
    report.report(PgLogLevel::ERROR);
    unreachable!("ERROR returned")
}

pub fn arg_error(e: ArgError) -> ! {
    let code = match e.kind {
        ArgErrorKind::Null => PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
        ArgErrorKind::Invalid => PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
        ArgErrorKind::Forbidden => PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
    };
    raise(code, e.message, None)
}

/// Unwraps an argument check or raises its error.
pub fn check<T>(r: Result<T, ArgError>) -> T {
    r.unwrap_or_else(|e| arg_error(e))
}

/// Raises a canonicalization error; `arg` names the argument that held the document.
pub fn canon_error(arg: &str, e: CanonError) -> ! {
    let code = match e {
        CanonError::TooDeep => PgSqlErrorCode::ERRCODE_STATEMENT_TOO_COMPLEX,
        CanonError::NumberOutOfRange(_) => PgSqlErrorCode::ERRCODE_NUMERIC_VALUE_OUT_OF_RANGE,
        CanonError::InvalidPointer(_) | CanonError::Parse(_) => {
            PgSqlErrorCode::ERRCODE_INVALID_TEXT_REPRESENTATION
        }
        CanonError::Damaged => PgSqlErrorCode::ERRCODE_DATA_CORRUPTED,
        CanonError::Untranslatable(_) => PgSqlErrorCode::ERRCODE_UNTRANSLATABLE_CHARACTER,
    };
    let hint = match e {
        CanonError::NumberOutOfRange(_) => {
            Some("RFC 8785 allows only IEEE-754 doubles: send such numbers as JSON strings, or use numbers => 'exact'")
        }
        CanonError::InvalidPointer(_) => Some("use ~0 for '~' and ~1 for '/' inside a pointer token"),
        _ => None,
    };
    raise(code, format!("{arg}: {e}"), hint)
}

/// A message for the server log and the client: unchanged in a UTF-8 database; in any other,
/// each non-ASCII character written as `\u{…}` (PostgreSQL sends a message's bytes as text in
/// the database encoding, and a Rust message is UTF-8).
pub fn for_message(message: String) -> String {
    // SAFETY: reads a backend variable set at connection start; never raises an error.
    let encoding = unsafe { pgrx::pg_sys::GetDatabaseEncoding() };
    if message.is_ascii() || encoding == pgrx::pg_sys::pg_enc::PG_UTF8 as i32 {
        return message;
    }
    let mut out = String::with_capacity(message.len() + 16);
    for c in message.chars() {
        if c.is_ascii() {
            out.push(c);
        } else if c == '\u{2026}' {
            out.push_str("...");
        } else {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        }
    }
    out
}
