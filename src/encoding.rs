//! Text between the database encoding and UTF-8.
//!
//! Canonical JSON, hashes, keys, scopes and derivations are defined over Unicode: every text the
//! extension reads (arguments, jsonb strings, stored recovery points, the scope prefix) is
//! converted from the database encoding to UTF-8, and every text it hands back (canonical JSON,
//! derived keys, stored keys) from UTF-8 to the database encoding. In a UTF-8 database nothing
//! is converted: PostgreSQL has verified every text it took in, so the bytes are read in place
//! as `&str`. In any other database, ASCII-only text needs no conversion either (every server
//! encoding is a superset of ASCII); anything else goes through PostgreSQL's conversion
//! functions. SQL_ASCII is refused: its bytes have no defined characters, so no conversion to
//! Unicode exists; so is MULE_INTERNAL, between which and UTF-8 PostgreSQL has no conversion
//! (README, "Encodings").

use crate::error::raise;
use pgrx::{pg_sys, PgSqlErrorCode};
use std::borrow::Cow;
use std::cell::Cell;

/// The database's encoding and the conversion functions to and from UTF-8, looked up once per
/// backend (a backend stays in one database).
#[derive(Clone, Copy)]
struct Encoding {
    id: i32,
    /// Conversion functions (database encoding to UTF-8, UTF-8 to database encoding), looked up
    /// the first time text is converted.
    procs: Option<(pg_sys::Oid, pg_sys::Oid)>,
}

static ENCODING: crate::local::BackendLocal<Cell<Option<Encoding>>> =
    crate::local::BackendLocal::new(Cell::new(None));

fn encoding() -> Encoding {
    ENCODING.with(|c| {
        if let Some(e) = c.get() {
            return e;
        }
        // SAFETY: reads a backend variable set at connection start; never raises an error.
        let id = unsafe { pg_sys::GetDatabaseEncoding() };
        let e = Encoding { id, procs: None };
        c.set(Some(e));
        e
    })
}

/// Whether the database's encoding is UTF-8: then text is used as it is stored.
#[inline]
pub fn utf8_database() -> bool {
    encoding().id == pg_sys::pg_enc::PG_UTF8 as i32
}

/// The database encoding's name, e.g. `LATIN1`.
fn encoding_name() -> String {
    // SAFETY: returns a pointer to a static, NUL-terminated name; never raises an error.
    unsafe { std::ffi::CStr::from_ptr(pg_sys::GetDatabaseEncodingName()) }
        .to_string_lossy()
        .into_owned()
}

/// Raises the refusal of a database whose text cannot be converted to Unicode (also raised by
/// `CREATE EXTENSION` and the update): SQL_ASCII, whose bytes have no defined characters, or an
/// encoding between which and UTF-8 PostgreSQL has no conversion (MULE_INTERNAL).
fn refuse_encoding() -> ! {
    let hint = Some("create the database with ENCODING 'UTF8' and install the extension there");
    if encoding().id == pg_sys::pg_enc::PG_SQL_ASCII as i32 {
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            "idempotency does not support databases with encoding SQL_ASCII: their text has no \
             defined characters, so it cannot be hashed as Unicode"
                .into(),
            hint,
        )
    }
    raise(
        PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
        format!(
            "idempotency does not support databases with encoding {}: PostgreSQL has no \
             conversion between it and UTF-8, so its text cannot be hashed as Unicode",
            encoding_name()
        ),
        hint,
    )
}

/// The conversion functions of a database that is not UTF-8; refuses one without them.
fn procs() -> (pg_sys::Oid, pg_sys::Oid) {
    let e = encoding();
    if e.id == pg_sys::pg_enc::PG_SQL_ASCII as i32
        || e.id == pg_sys::pg_enc::PG_MULE_INTERNAL as i32
    {
        refuse_encoding();
    }
    if let Some(p) = e.procs {
        return p;
    }
    let utf8 = pg_sys::pg_enc::PG_UTF8 as i32;
    // SAFETY: catalog look-ups inside the calling function's transaction; an ERROR they raise
    // becomes an ERROR of the calling function.
    let p = unsafe {
        (
            pg_sys::FindDefaultConversionProc(e.id, utf8),
            pg_sys::FindDefaultConversionProc(utf8, e.id),
        )
    };
    if p.0 == pg_sys::InvalidOid || p.1 == pg_sys::InvalidOid {
        refuse_encoding();
    }
    ENCODING.with(|c| {
        c.set(Some(Encoding {
            id: e.id,
            procs: Some(p),
        }))
    });
    p
}

/// Converts `src` with the conversion function `proc` (`from` to `to`); on a character that has
/// no equivalent, Err with the offset of that character in `src`.
fn convert(src: &[u8], proc: pg_sys::Oid, from: i32, to: i32) -> Result<Vec<u8>, usize> {
    let too_long = || {
        raise(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            "text is too long to convert between encodings".into(),
            None,
        )
    };
    // pg_do_encoding_conversion_buf converts at most (dstlen - 1) / 4 bytes of the source.
    let capacity = src
        .len()
        .checked_mul(pg_sys::MAX_CONVERSION_GROWTH as usize)
        .and_then(|n| n.checked_add(pg_sys::MAX_CONVERSION_GROWTH as usize + 1))
        .filter(|n| *n <= i32::MAX as usize)
        .unwrap_or_else(too_long);
    let mut dest = vec![0u8; capacity];
    // SAFETY: `src` is `src.len()` readable bytes (the conversion functions only read it),
    // `dest` `capacity` writable ones, and both lengths fit in an int (checked above). With
    // noError the function stops at a character it cannot convert and returns how many source
    // bytes it converted; other ERRORs (out of memory) become an ERROR of the caller.
    let converted = unsafe {
        pg_sys::pg_do_encoding_conversion_buf(
            proc,
            from,
            to,
            src.as_ptr().cast_mut(),
            src.len() as i32,
            dest.as_mut_ptr(),
            capacity as i32,
            true,
        )
    };
    let converted = usize::try_from(converted).unwrap_or(0);
    if converted < src.len() {
        return Err(converted);
    }
    // The result is NUL-terminated (text never holds a NUL byte).
    let end = dest.iter().position(|b| *b == 0).unwrap_or(dest.len());
    dest.truncate(end);
    Ok(dest)
}

/// Text stored in the database encoding (a text datum's or jsonb string's bytes, which
/// PostgreSQL verified against that encoding) as UTF-8. Err: a message saying which character
/// has no Unicode equivalent.
pub fn to_utf8(bytes: &[u8]) -> Result<Cow<'_, str>, String> {
    if utf8_database() {
        // Checked, not assumed: PostgreSQL verifies the text it takes in, but a damaged page or
        // a superuser's binary cast gives any bytes (the check costs little beside hashing).
        return std::str::from_utf8(bytes).map(Cow::Borrowed).map_err(|e| {
            format!(
                "invalid byte sequence for encoding \"UTF8\" at byte {}",
                e.valid_up_to()
            )
        });
    }
    let (to_unicode, _) = procs();
    if bytes.is_ascii() {
        if let Ok(ascii) = std::str::from_utf8(bytes) {
            return Ok(Cow::Borrowed(ascii));
        }
    }
    let utf8 = pg_sys::pg_enc::PG_UTF8 as i32;
    let id = encoding().id;
    match convert(bytes, to_unicode, id, utf8) {
        Ok(converted) => String::from_utf8(converted)
            .map(Cow::Owned)
            .map_err(|_| "conversion to UTF-8 gave invalid UTF-8".to_string()),
        Err(at) => {
            let rest = &bytes[at.min(bytes.len())..];
            let len = if rest.is_empty() {
                0
            } else {
                // SAFETY: `rest` is non-empty text in the database encoding (the conversion
                // stopped inside it), so its first character can be measured.
                unsafe { pg_sys::pg_encoding_mblen(id, rest.as_ptr().cast()) }.max(1) as usize
            };
            let shown: Vec<String> = rest
                .iter()
                .take(len.min(rest.len()))
                .map(|b| format!("0x{b:02x}"))
                .collect();
            Err(format!(
                "character with byte sequence {} in encoding \"{}\" has no equivalent in Unicode",
                shown.join(" "),
                encoding_name()
            ))
        }
    }
}

/// Whether `bytes` are valid text in the database encoding (PostgreSQL's own check, without
/// raising an error).
pub fn valid_in_database(bytes: &[u8]) -> bool {
    let Ok(len) = i32::try_from(bytes.len()) else {
        return false;
    };
    // SAFETY: reads `len` bytes from `bytes` and nothing else; with noError it returns false
    // instead of raising.
    unsafe { pg_sys::pg_verify_mbstr(encoding().id, bytes.as_ptr().cast(), len, true) }
}

/// UTF-8 text as the database encoding's bytes. Err: a message naming the first character the
/// database encoding cannot represent.
fn to_server(text: &str) -> Result<Cow<'_, [u8]>, String> {
    if utf8_database() {
        return Ok(Cow::Borrowed(text.as_bytes()));
    }
    let (_, from_unicode) = procs();
    if text.is_ascii() {
        return Ok(Cow::Borrowed(text.as_bytes()));
    }
    let utf8 = pg_sys::pg_enc::PG_UTF8 as i32;
    match convert(text.as_bytes(), from_unicode, utf8, encoding().id) {
        Ok(converted) => Ok(Cow::Owned(converted)),
        Err(at) => {
            let c = text
                .get(at..)
                .and_then(|rest| rest.chars().next())
                .unwrap_or('\u{fffd}');
            Err(format!(
                "character U+{:04X} cannot be represented in the database encoding \"{}\"",
                c as u32,
                encoding_name()
            ))
        }
    }
}

/// Raises 22P05 untranslatable_character for argument (or value) `arg`.
pub fn untranslatable(arg: &str, message: String) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_UNTRANSLATABLE_CHARACTER,
        format!("{arg}: {message}"),
        None,
    )
}

/// The bytes of a (possibly short-header, compressed or out-of-line) text datum, detoasted
/// into the current memory context when needed.
///
/// # Safety
/// `datum` must be a non-NULL text (or varchar) datum that outlives `'a`.
pub unsafe fn text_bytes<'a>(datum: pg_sys::Datum) -> &'a [u8] {
    // SAFETY: the caller's guarantees. A 4-byte-header or short inline varlena is read in
    // place; anything else (compressed, external) is detoasted into the current memory context,
    // which lives at least as long as the call that passed the datum.
    unsafe {
        let mut ptr = datum.cast_mut_ptr::<pg_sys::varlena>();
        let in_place = pgrx::varlena::varatt_is_4b_u(ptr)
            || (pgrx::varlena::varatt_is_1b(ptr) && !pgrx::varlena::varatt_is_1b_e(ptr));
        if !in_place {
            ptr = pg_sys::pg_detoast_datum_packed(ptr);
        }
        std::slice::from_raw_parts(
            pgrx::varlena::vardata_any(ptr).cast::<u8>(),
            pgrx::varlena::varsize_any_exhdr(ptr),
        )
    }
}

/// A text datum as UTF-8; an untranslatable character raises 22P05 naming `arg`.
///
/// # Safety
/// As for [`text_bytes`].
pub unsafe fn text_of<'a>(datum: pg_sys::Datum, arg: &str) -> Cow<'a, str> {
    // SAFETY: the caller's guarantees.
    let bytes = unsafe { text_bytes(datum) };
    to_utf8(bytes).unwrap_or_else(|m| untranslatable(arg, m))
}

/// A new text datum (in the current memory context) holding `text` in the database encoding;
/// a character the encoding cannot represent raises 22P05 naming `arg`.
pub fn text_datum(text: &str, arg: &str) -> pg_sys::Datum {
    let bytes = server_bytes(text, arg);
    let len = i32::try_from(bytes.len()).unwrap_or_else(|_| {
        raise(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            format!("{arg}: text is too long"),
            None,
        )
    });
    // SAFETY: copies `len` readable bytes into a new palloc'd text.
    pg_sys::Datum::from(unsafe { pg_sys::cstring_to_text_with_len(bytes.as_ptr().cast(), len) })
}

/// `text` as the database encoding's bytes; a character the encoding cannot represent raises
/// 22P05 naming `what`.
pub fn server_bytes<'a>(text: &'a str, what: &str) -> Cow<'a, [u8]> {
    to_server(text).unwrap_or_else(|m| untranslatable(what, m))
}

/// A text query argument for SPI, in the database encoding.
pub fn spi_text<'a>(text: &str, what: &str) -> pgrx::datum::DatumWithOid<'a> {
    if utf8_database() {
        return text.into();
    }
    // SAFETY: a text datum, declared as text.
    unsafe { pgrx::datum::DatumWithOid::new(text_datum(text, what), pg_sys::TEXTOID) }
}

/// A setting's text (`what` names it in errors) as UTF-8. Unlike text the session sent, a
/// setting's bytes were never checked against the database encoding: `pg_db_role_setting` is
/// shared by every database (a value written from a LATIN1 database is LATIN1 bytes here),
/// and neither the configuration file nor a startup option is checked. Bytes that are not
/// valid in the database encoding are refused (22021 character_not_in_repertoire), never
/// decoded lossily (two different prefixes must never become the same one).
pub fn checked_setting_text<'a>(what: &str, bytes: &'a [u8]) -> Cow<'a, str> {
    if !valid_in_database(bytes) {
        raise(
            PgSqlErrorCode::ERRCODE_CHARACTER_NOT_IN_REPERTOIRE,
            format!(
                "{what} is not valid text in the database encoding \"{}\"",
                encoding_name()
            ),
            Some(
                "a value written from a database of another encoding (ALTER ROLE ... SET applies to \
                 every database), in the configuration file or as a startup option is not converted: \
                 set it from a session of this database (ALTER ROLE ... IN DATABASE ... SET), or bind \
                 the role's prefix in idempotency.role_settings",
            ),
        )
    }
    to_utf8(bytes).unwrap_or_else(|m| untranslatable(what, m))
}
