//! The `Idempotency-Key` request header and the client identity that scopes it.
//!
//! The IETF draft makes the header a Structured Field Item whose value is a String
//! (RFC 8941 `sf-string`: `"..."`, printable ASCII, `\"` and `\\` escapes). Many clients send the
//! bare value (`Idempotency-Key: 8e03978e-...`), so a bare value of visible ASCII without `"`,
//! `\` and `,` is accepted too. The key itself then follows the extension's rule (src/keys.rs):
//! 1 to 255 characters.

use axum::http::{HeaderMap, HeaderValue};

pub const HEADER: &str = "idempotency-key";
/// The extension's limit for keys and scopes (`MAX_KEY_CHARS` in src/keys.rs).
pub const MAX_KEY_CHARS: usize = 255;
pub const MAX_CLIENT_CHARS: usize = 64;

#[derive(Debug, PartialEq, Eq)]
pub enum KeyError {
    Missing,
    Repeated,
    Empty,
    TooLong(usize),
    BadChar { pos: usize, byte: u8 },
    BadEscape { pos: usize },
    Unterminated,
    AfterString { pos: usize },
}

impl KeyError {
    /// The problem detail: says exactly what is wrong with the header.
    pub fn detail(&self) -> String {
        match self {
            KeyError::Missing => {
                "This operation requires an Idempotency-Key header, e.g. Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\"".into()
            }
            KeyError::Repeated => "Idempotency-Key was sent more than once; send exactly one".into(),
            KeyError::Empty => "Idempotency-Key is empty; it must have 1 to 255 characters".into(),
            KeyError::TooLong(n) => {
                format!("Idempotency-Key is too long: {n} characters, at most {MAX_KEY_CHARS} are allowed")
            }
            KeyError::BadChar { pos, byte } => format!(
                "Idempotency-Key has a bad character at position {pos} (byte 0x{byte:02x}): a quoted key \
                 may hold printable ASCII, a bare key visible ASCII other than '\"', '\\' and ','"
            ),
            KeyError::BadEscape { pos } => format!(
                "Idempotency-Key has a bad escape at position {pos}: only \\\" and \\\\ may follow a backslash"
            ),
            KeyError::Unterminated => "Idempotency-Key starts with '\"' but has no closing quote".into(),
            KeyError::AfterString { pos } => format!(
                "Idempotency-Key has characters after the closing quote at position {pos}"
            ),
        }
    }
}

/// Reads the key from the request headers. Returns the key and the header as received (echoed
/// on every response).
pub fn parse(headers: &HeaderMap) -> Result<(String, HeaderValue), KeyError> {
    let mut values = headers.get_all(HEADER).iter();
    let raw = values.next().ok_or(KeyError::Missing)?;
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    let key = parse_value(raw.as_bytes())?;
    Ok((key, raw.clone()))
}

/// Positions in messages are 1-based byte offsets into the header value.
pub fn parse_value(v: &[u8]) -> Result<String, KeyError> {
    let key = if v.first() == Some(&b'"') {
        parse_sf_string(v)?
    } else {
        for (i, &b) in v.iter().enumerate() {
            if !(0x21..=0x7e).contains(&b) || b == b'"' || b == b'\\' || b == b',' {
                return Err(KeyError::BadChar {
                    pos: i + 1,
                    byte: b,
                });
            }
        }
        // Only ASCII passed the loop above.
        String::from_utf8_lossy(v).into_owned()
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    let n = key.chars().count();
    if n > MAX_KEY_CHARS {
        return Err(KeyError::TooLong(n));
    }
    Ok(key)
}

fn parse_sf_string(v: &[u8]) -> Result<String, KeyError> {
    let mut out = String::new();
    let mut i = 1;
    while i < v.len() {
        let b = v[i];
        match b {
            b'\\' => {
                match v.get(i + 1) {
                    Some(&e @ (b'"' | b'\\')) => out.push(e as char),
                    _ => return Err(KeyError::BadEscape { pos: i + 1 }),
                }
                i += 2;
            }
            b'"' => {
                if i + 1 != v.len() {
                    return Err(KeyError::AfterString { pos: i + 2 });
                }
                return Ok(out);
            }
            0x20..=0x7e => {
                out.push(b as char);
                i += 1;
            }
            _ => {
                return Err(KeyError::BadChar {
                    pos: i + 1,
                    byte: b,
                })
            }
        }
    }
    Err(KeyError::Unterminated)
}

/// Writes `s` as an RFC 8941 sf-string (for the key sent to the payment service).
pub fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// The authenticated client: `Authorization: Bearer <client-id>` or `X-Client-Id: <client-id>`
/// (a stand-in for real authentication). 1 to 64 characters of `A-Z a-z 0-9 . _ -`.
pub fn client_id(headers: &HeaderMap) -> Option<String> {
    let from_bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let id = from_bearer.or_else(|| headers.get("x-client-id").and_then(|v| v.to_str().ok()))?;
    let ok = !id.is_empty()
        && id.len() <= MAX_CLIENT_CHARS
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    ok.then(|| id.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_and_bare_keys() {
        assert_eq!(parse_value(b"\"abc-1\"").unwrap(), "abc-1");
        assert_eq!(parse_value(b"abc-1").unwrap(), "abc-1");
        assert_eq!(parse_value(b"\"a b\\\"c\\\\\"").unwrap(), "a b\"c\\");
        assert_eq!(parse_value(&[b'x'; 255]).unwrap().len(), 255);
    }

    #[test]
    fn malformed_keys_say_why() {
        assert_eq!(parse_value(b""), Err(KeyError::Empty));
        assert_eq!(parse_value(b"\"\""), Err(KeyError::Empty));
        assert_eq!(parse_value(&[b'x'; 256]), Err(KeyError::TooLong(256)));
        assert_eq!(
            parse_value(b"a b"),
            Err(KeyError::BadChar { pos: 2, byte: b' ' })
        );
        assert_eq!(
            parse_value(b"k\xc3\xa9"),
            Err(KeyError::BadChar { pos: 2, byte: 0xc3 })
        );
        assert_eq!(
            parse_value(b"a,b").unwrap_err(),
            KeyError::BadChar { pos: 2, byte: b',' }
        );
        assert_eq!(parse_value(b"\"abc"), Err(KeyError::Unterminated));
        assert_eq!(
            parse_value(b"\"a\\nb\""),
            Err(KeyError::BadEscape { pos: 3 })
        );
        assert_eq!(
            parse_value(b"\"ab\";x=1"),
            Err(KeyError::AfterString { pos: 5 })
        );
        assert_eq!(
            parse_value(b"\"a\tb\""),
            Err(KeyError::BadChar {
                pos: 3,
                byte: b'\t'
            })
        );
    }

    #[test]
    fn sf_string_round_trips() {
        for k in ["plain", "with \"quote\"", "back\\slash"] {
            assert_eq!(parse_value(sf_string(k).as_bytes()).unwrap(), k);
        }
    }
}
