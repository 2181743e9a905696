//! The `Idempotency-Key` request header and the client identity that scopes it.
//!
//! The IETF draft declares the header a Structured Field Item whose value is a String
//! (RFC 9651 `sf-string`: `"..."`, printable ASCII, `\"` and `\\` escapes). The value is parsed
//! as RFC 9651 parses an Item: a String, optionally followed by parameters (`"abc";p=1`), which
//! are checked and ignored. An Item of another type (a bare token `abc`, an integer `1`, a
//! boolean `?1`, ...) does not match the declared type, which RFC 9651 makes a malformed field:
//! it is refused with 400, not taken as a key, so that `abc` and `"abc"` are never two spellings
//! of one key. The key itself then follows the extension's rule: 1 to 255 characters.

use axum::http::{HeaderMap, HeaderValue};

pub const HEADER: &str = "idempotency-key";
/// The extension's limit for keys and scopes (1 to 255 characters).
pub const MAX_KEY_CHARS: usize = 255;

/// Why an `Idempotency-Key` header was refused (400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    Missing,
    Repeated,
    Empty,
    TooLong(usize),
    /// An Item of another type than String; names the type it looks like.
    NotString(&'static str),
    BadChar {
        pos: usize,
        byte: u8,
    },
    BadEscape {
        pos: usize,
    },
    Unterminated,
    AfterString {
        pos: usize,
    },
    /// A malformed parameter after the String: where, and what was expected there.
    BadParam {
        pos: usize,
        why: &'static str,
    },
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
            KeyError::NotString(what) => format!(
                "Idempotency-Key is {what}, not a String: the key must be a structured-field String \
                 (RFC 9651) in double quotes, e.g. Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\""
            ),
            KeyError::BadChar { pos, byte } => format!(
                "Idempotency-Key has a bad character at position {pos} (byte 0x{byte:02x}): a String \
                 may hold printable ASCII only"
            ),
            KeyError::BadEscape { pos } => format!(
                "Idempotency-Key has a bad escape at position {pos}: only \\\" and \\\\ may follow a backslash"
            ),
            KeyError::Unterminated => "Idempotency-Key starts with '\"' but has no closing quote".into(),
            KeyError::AfterString { pos } => format!(
                "Idempotency-Key has characters after the closing quote at position {pos}: only \
                 parameters (;name or ;name=value) may follow the String"
            ),
            KeyError::BadParam { pos, why } => format!(
                "Idempotency-Key has a malformed parameter at position {pos}: {why}"
            ),
        }
    }
}

/// Reads the key from the request headers. Returns the key and the header as received (echoed
/// on every response).
pub fn parse(headers: &HeaderMap) -> Result<(String, HeaderValue), KeyError> {
    parse_with(headers, false)
}

/// [`parse`]; `lenient`: a bare key (`Idempotency-Key: 8e03978e-...`, as Stripe-style clients
/// send it) is accepted as the key too, see [`parse_lenient`].
pub fn parse_with(headers: &HeaderMap, lenient: bool) -> Result<(String, HeaderValue), KeyError> {
    let mut values = headers.get_all(HEADER).iter();
    let raw = values.next().ok_or(KeyError::Missing)?;
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    let key = if lenient {
        parse_lenient(raw.as_bytes())?
    } else {
        parse_value(raw.as_bytes())?
    };
    Ok((key, raw.clone()))
}

/// [`parse_value`], and a bare key besides: 1 to 255 printable ASCII characters without space,
/// `"`, `,` or `\\` (the same rule as the Python and Node packages' lenient mode). The bare key
/// `abc` and the String `"abc"` are the same key.
pub fn parse_lenient(v: &[u8]) -> Result<String, KeyError> {
    let t = v
        .iter()
        .position(|b| *b != b' ' && *b != b'\t')
        .map(|start| {
            let end = v
                .iter()
                .rposition(|b| *b != b' ' && *b != b'\t')
                .unwrap_or(start);
            &v[start..=end]
        })
        .unwrap_or(&[]);
    let bare = |b: &u8| (0x21..=0x7e).contains(b) && !matches!(b, b'"' | b',' | b'\\');
    if !t.is_empty() && t[0] != b'"' && t.iter().all(bare) {
        if t.len() > MAX_KEY_CHARS {
            return Err(KeyError::TooLong(t.len()));
        }
        return Ok(String::from_utf8_lossy(t).into_owned());
    }
    parse_value(v)
}

/// Parses the field value as an RFC 9651 Item that must be a String; its parameters are checked
/// and ignored. Positions in messages are 1-based byte offsets into the header value.
pub fn parse_value(v: &[u8]) -> Result<String, KeyError> {
    let mut p = Parser { v, i: 0 };
    p.skip_sp();
    let key = match p.peek() {
        None => return Err(KeyError::Empty),
        Some(b'"') => p.string()?,
        Some(b) => return Err(KeyError::NotString(item_kind(b))),
    };
    p.parameters()?;
    p.skip_sp();
    if p.i != v.len() {
        return Err(KeyError::AfterString { pos: p.i + 1 });
    }
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    let n = key.chars().count();
    if n > MAX_KEY_CHARS {
        return Err(KeyError::TooLong(n));
    }
    Ok(key)
}

/// What an Item that starts with `b` is (RFC 9651 section 4.2.3.1), for the message.
fn item_kind(b: u8) -> &'static str {
    match b {
        b'-' | b'0'..=b'9' => "an Integer or Decimal",
        b'*' | b'A'..=b'Z' | b'a'..=b'z' => "a bare Token",
        b':' => "a Byte Sequence",
        b'?' => "a Boolean",
        b'@' => "a Date",
        b'%' => "a Display String",
        b'(' => "an Inner List",
        _ => "not a structured-field Item",
    }
}

/// `tchar` of RFC 9110, which tokens are made of (with `:` and `/`).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

struct Parser<'a> {
    v: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.v.get(self.i).copied()
    }

    fn skip_sp(&mut self) {
        while self.peek() == Some(b' ') {
            self.i += 1;
        }
    }

    fn bad_param(&self, why: &'static str) -> KeyError {
        KeyError::BadParam {
            pos: self.i + 1,
            why,
        }
    }

    /// RFC 9651 4.2.5; the opening quote is at `self.i`.
    fn string(&mut self) -> Result<String, KeyError> {
        let mut out = String::new();
        self.i += 1;
        while let Some(b) = self.peek() {
            match b {
                b'\\' => {
                    match self.v.get(self.i + 1) {
                        Some(&e @ (b'"' | b'\\')) => out.push(e as char),
                        _ => return Err(KeyError::BadEscape { pos: self.i + 1 }),
                    }
                    self.i += 2;
                }
                b'"' => {
                    self.i += 1;
                    return Ok(out);
                }
                0x20..=0x7e => {
                    out.push(b as char);
                    self.i += 1;
                }
                _ => {
                    return Err(KeyError::BadChar {
                        pos: self.i + 1,
                        byte: b,
                    })
                }
            }
        }
        Err(KeyError::Unterminated)
    }

    /// RFC 9651 4.2.3.2: `*( ";" *SP key [ "=" bare-item ] )`.
    fn parameters(&mut self) -> Result<(), KeyError> {
        while self.peek() == Some(b';') {
            self.i += 1;
            self.skip_sp();
            match self.peek() {
                Some(b'a'..=b'z' | b'*') => self.i += 1,
                _ => {
                    return Err(
                        self.bad_param("a parameter name starts with a lower-case letter or '*'")
                    )
                }
            }
            while let Some(b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*') = self.peek() {
                self.i += 1;
            }
            if self.peek() == Some(b'=') {
                self.i += 1;
                self.bare_item()?;
            }
        }
        Ok(())
    }

    /// A parameter's value: any bare item of RFC 9651 4.2.3.1, checked and dropped. An error
    /// names the position where the value starts.
    fn bare_item(&mut self) -> Result<(), KeyError> {
        let start = self.i;
        self.bare_item_at().map_err(|e| match e {
            KeyError::BadParam { why, .. } => KeyError::BadParam {
                pos: start + 1,
                why,
            },
            e => e,
        })
    }

    fn bare_item_at(&mut self) -> Result<(), KeyError> {
        match self.peek() {
            Some(b'-' | b'0'..=b'9') => self.number(false),
            Some(b'"') => match self.string() {
                Ok(_) => Ok(()),
                Err(_) => Err(self.bad_param("a String value is printable ASCII in double quotes")),
            },
            Some(b'*' | b'A'..=b'Z' | b'a'..=b'z') => {
                self.i += 1;
                while matches!(self.peek(), Some(b) if is_tchar(b) || b == b':' || b == b'/') {
                    self.i += 1;
                }
                Ok(())
            }
            Some(b':') => {
                self.i += 1;
                while matches!(self.peek(), Some(b) if b.is_ascii_alphanumeric() || b"+/=".contains(&b))
                {
                    self.i += 1;
                }
                if self.peek() != Some(b':') {
                    return Err(self.bad_param("a Byte Sequence holds base64 and ends with ':'"));
                }
                self.i += 1;
                Ok(())
            }
            Some(b'?') => match self.v.get(self.i + 1) {
                Some(b'0' | b'1') => {
                    self.i += 2;
                    Ok(())
                }
                _ => Err(self.bad_param("a Boolean is ?0 or ?1")),
            },
            Some(b'@') => {
                self.i += 1;
                self.number(true)
            }
            Some(b'%') => self.display_string(),
            _ => Err(self.bad_param("a value follows '='")),
        }
    }

    /// RFC 9651 4.2.4: an Integer (at most 15 digits) or a Decimal (at most 12 digits, '.',
    /// 1 to 3 digits); a Date takes an Integer only.
    fn number(&mut self, integer_only: bool) -> Result<(), KeyError> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        let start = self.i;
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
        let int_digits = self.i - start;
        if int_digits == 0 {
            return Err(self.bad_param("a number has a digit here"));
        }
        if self.peek() == Some(b'.') && integer_only {
            return Err(self.bad_param("a Date is an Integer, with no '.'"));
        }
        if self.peek() != Some(b'.') {
            if int_digits > 15 {
                return Err(self.bad_param("an Integer has at most 15 digits"));
            }
            return Ok(());
        }
        if int_digits > 12 {
            return Err(self.bad_param("a Decimal has at most 12 digits before the '.'"));
        }
        self.i += 1;
        let frac = self.i;
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
        if !(1..=3).contains(&(self.i - frac)) {
            return Err(self.bad_param("a Decimal has 1 to 3 digits after the '.'"));
        }
        Ok(())
    }

    /// RFC 9651 4.2.10: `%"..."`, printable ASCII and `%xx` (lower-case hex) escapes of UTF-8.
    fn display_string(&mut self) -> Result<(), KeyError> {
        self.i += 1;
        if self.peek() != Some(b'"') {
            return Err(self.bad_param("a Display String starts with %\""));
        }
        self.i += 1;
        let mut bytes = Vec::new();
        while let Some(b) = self.peek() {
            match b {
                b'%' => {
                    let hex = |o: usize| match self.v.get(self.i + o) {
                        Some(&h @ (b'0'..=b'9' | b'a'..=b'f')) => Some((h as char).to_digit(16)?),
                        _ => None,
                    };
                    let (Some(hi), Some(lo)) = (hex(1), hex(2)) else {
                        return Err(self
                            .bad_param("'%' in a Display String takes two lower-case hex digits"));
                    };
                    bytes.push((hi * 16 + lo) as u8);
                    self.i += 3;
                }
                b'"' => {
                    if std::str::from_utf8(&bytes).is_err() {
                        return Err(self.bad_param("a Display String decodes to UTF-8"));
                    }
                    self.i += 1;
                    return Ok(());
                }
                0x20..=0x7e => {
                    bytes.push(b);
                    self.i += 1;
                }
                _ => return Err(self.bad_param("a Display String holds printable ASCII")),
            }
        }
        Err(self.bad_param("a Display String ends with '\"'"))
    }
}

/// Writes `s` as an RFC 9651 sf-string (for a key sent on to another service).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lenient_takes_a_bare_key() {
        assert_eq!(
            parse_lenient(b" 8e03978e-40d5-43e8-bc93-6894a57f9324 ").unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert_eq!(parse_lenient(b"\"abc\";p=1").unwrap(), "abc");
        assert!(parse_lenient(b"a b").is_err());
        assert!(parse_lenient(b"a,b").is_err());
        assert_eq!(
            parse_lenient("k".repeat(256).as_bytes()),
            Err(KeyError::TooLong(256))
        );
        assert!(matches!(
            parse_value(b"8e03978e"),
            Err(KeyError::NotString(_))
        ));
    }

    #[test]
    fn quoted_keys() {
        assert_eq!(parse_value(b"\"abc-1\"").unwrap(), "abc-1");
        assert_eq!(parse_value(b"\"a b\\\"c\\\\\"").unwrap(), "a b\"c\\");
        assert_eq!(parse_value(b"\"a,b\"").unwrap(), "a,b");
        let mut longest = vec![b'"'];
        longest.extend([b'x'; 255]);
        longest.push(b'"');
        assert_eq!(parse_value(&longest).unwrap().len(), 255);
        // Leading and trailing spaces are discarded (RFC 9651 4.2).
        assert_eq!(parse_value(b"  \"abc\"  ").unwrap(), "abc");
    }

    #[test]
    fn parameters_after_the_string_are_ignored() {
        for v in [
            &b"\"abc\";p=1"[..],
            b"\"abc\";p",
            b"\"abc\"; p=1;q=?0",
            b"\"abc\";a=-1.5;b=\"x;y\\\"\";c=tok/en:1;d=:aGk=:;e=@1700000000;f=%\"caf%c3%a9\";*g.h_i-j=*",
            b"\"abc\";p=1 ",
        ] {
            assert_eq!(
                parse_value(v),
                Ok("abc".to_string()),
                "{}",
                String::from_utf8_lossy(v)
            );
        }
    }

    #[test]
    fn items_that_are_not_strings_are_refused() {
        for (v, kind) in [
            (&b"abc"[..], "a bare Token"),
            (b"abc-1", "a bare Token"),
            (
                b"8e03978e-40d5-43e8-bc93-6894a57f9324",
                "an Integer or Decimal",
            ),
            (b"1", "an Integer or Decimal"),
            (b"-1.5", "an Integer or Decimal"),
            (b"?1", "a Boolean"),
            (b":aGk=:", "a Byte Sequence"),
            (b"@1700000000", "a Date"),
            (b"%\"abc\"", "a Display String"),
            (b"(\"a\" \"b\")", "an Inner List"),
            (b"k\xc3\xa9", "a bare Token"),
            (b"a b", "a bare Token"),
            (b",\"a\"", "not a structured-field Item"),
        ] {
            assert_eq!(
                parse_value(v),
                Err(KeyError::NotString(kind)),
                "{}",
                String::from_utf8_lossy(v)
            );
        }
        assert!(KeyError::NotString("a Boolean")
            .detail()
            .contains("is a Boolean, not a String"));
    }

    #[test]
    fn malformed_keys_say_why() {
        assert_eq!(parse_value(b""), Err(KeyError::Empty));
        assert_eq!(parse_value(b"  "), Err(KeyError::Empty));
        assert_eq!(parse_value(b"\"\""), Err(KeyError::Empty));
        assert_eq!(parse_value(b"\"\";p=1"), Err(KeyError::Empty));
        let mut long = vec![b'"'];
        long.extend([b'x'; 256]);
        long.push(b'"');
        assert_eq!(parse_value(&long), Err(KeyError::TooLong(256)));
        assert_eq!(parse_value(b"\"abc"), Err(KeyError::Unterminated));
        assert_eq!(
            parse_value(b"\"a\\nb\""),
            Err(KeyError::BadEscape { pos: 3 })
        );
        assert_eq!(
            parse_value(b"\"a\tb\""),
            Err(KeyError::BadChar {
                pos: 3,
                byte: b'\t'
            })
        );
        assert_eq!(
            parse_value(b"\"k\xc3\xa9\""),
            Err(KeyError::BadChar { pos: 3, byte: 0xc3 })
        );
        // Not parameters: a second item, a list, text after the string.
        assert_eq!(
            parse_value(b"\"ab\" x"),
            Err(KeyError::AfterString { pos: 6 })
        );
        assert_eq!(
            parse_value(b"\"ab\", \"cd\""),
            Err(KeyError::AfterString { pos: 5 })
        );
        assert_eq!(
            parse_value(b"\"ab\"x"),
            Err(KeyError::AfterString { pos: 5 })
        );
    }

    #[test]
    fn malformed_parameters_say_where() {
        // The position is where the parameter's name, or its value, starts.
        for (v, pos) in [
            (&b"\"ab\";"[..], 6),              // no name
            (b"\"ab\";X=1", 6),                // upper-case name
            (b"\"ab\";1=1", 6),                // name starts with a digit
            (b"\"ab\"; ;p", 7),                // empty name
            (b"\"ab\";p=", 8),                 // no value
            (b"\"ab\";p=?2", 8),               // not a boolean
            (b"\"ab\";p=\"x", 8),              // unterminated string
            (b"\"ab\";p=\"\\n\"", 8),          // bad escape in a string
            (b"\"ab\";p=1234567890123456", 8), // 16-digit integer
            (b"\"ab\";p=1234567890123.5", 8),  // 13 digits before the '.'
            (b"\"ab\";p=1.2345", 8),           // 4 fraction digits
            (b"\"ab\";p=1.", 8),               // '.' without digits
            (b"\"ab\";p=-", 8),                // '-' without digits
            (b"\"ab\";p=:aGk=", 8),            // byte sequence not closed
            (b"\"ab\";p=@1.5", 8),             // a date is an integer
            (b"\"ab\";p=%abc", 8),             // display string without its quote
            (b"\"ab\";p=%\"%C3%A9\"", 8),      // upper-case hex
            (b"\"ab\";p=%\"%ff\"", 8),         // not UTF-8
            (b"\"ab\";p=%\"abc", 8),           // display string not closed
        ] {
            match parse_value(v) {
                Err(KeyError::BadParam { pos: p, .. }) => {
                    assert_eq!(p, pos, "{}", String::from_utf8_lossy(v))
                }
                other => panic!("{}: {other:?}", String::from_utf8_lossy(v)),
            }
        }
        assert!(KeyError::BadParam {
            pos: 8,
            why: "a value follows '='"
        }
        .detail()
        .contains("malformed parameter at position 8: a value follows '='"));
    }

    #[test]
    fn sf_string_round_trips() {
        for k in ["plain", "with \"quote\"", "back\\slash"] {
            assert_eq!(parse_value(sf_string(k).as_bytes()).unwrap(), k);
        }
    }
}
