//! RFC 8785 (JSON Canonicalization Scheme) over an in-memory JSON tree.
//!
//! Pure Rust, no pgrx: the SQL layer converts a jsonb value into [`Value`] (see `jsonb.rs`) and
//! this module sorts, escapes and lays out numbers. Numbers are carried as their exact decimal
//! text, never as `f64`, so the default `exact` mode can write every value without rounding.

use std::cmp::Ordering;
use std::fmt;

pub use crate::exclusion::{exclude, exclude_all};

/// Deepest nesting of arrays and objects accepted, counting the outermost container as 1.
pub const MAX_DEPTH: usize = 1000;

/// A JSON value whose numbers keep their exact decimal spelling.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    /// Exact decimal text: `-?digits(.digits)?([eE][+-]?digits)?`.
    Number(String),
    String(String),
    Array(Vec<Value>),
    /// Members in any order; names are unique (jsonb keeps the last duplicate).
    Object(Vec<(String, Value)>),
}

/// How numbers are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumberMode {
    /// Exact decimal value in the ECMAScript layout: never rounds, never rejects.
    Exact,
    /// Strict RFC 8785: round to the nearest IEEE-754 double, reject values outside its range.
    Rfc8785,
}

impl NumberMode {
    /// Parses the `numbers` argument of `canonical_json`.
    pub fn parse(mode: &str) -> Option<NumberMode> {
        match mode {
            "exact" => Some(NumberMode::Exact),
            "rfc8785" => Some(NumberMode::Rfc8785),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CanonError {
    /// Arrays and objects nested deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A number that is not a finite IEEE-754 double (only in `rfc8785` mode).
    NumberOutOfRange(String),
    /// An `exclude` entry that is not a valid RFC 6901 JSON Pointer.
    InvalidPointer(String),
    /// Text that is not JSON (only from `json_text::parse_json`).
    Parse(String),
    /// A jsonb value whose binary form does not hold together (only from reading jsonb).
    Damaged,
    /// A jsonb string with a character that has no Unicode equivalent (only from reading jsonb
    /// in a database whose encoding is not UTF-8).
    Untranslatable(String),
}

impl fmt::Display for CanonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CanonError::TooDeep => {
                write!(f, "document is nested deeper than {MAX_DEPTH} levels")
            }
            // The number as canonical JSON writes it in exact mode (`1e+309`), not as it
            // happened to be carried (`10e308` from jsonb's digits).
            CanonError::NumberOutOfRange(n) => write!(
                f,
                "number {} is outside the IEEE-754 double range",
                abbreviate(&es_layout(n), 40)
            ),
            CanonError::InvalidPointer(p) => write!(
                f,
                "\"{}\" is not a member name or an RFC 6901 JSON Pointer",
                abbreviate(p, 80)
            ),
            CanonError::Parse(m) => write!(f, "invalid JSON: {m}"),
            CanonError::Damaged => write!(f, "the jsonb value's binary form is damaged"),
            CanonError::Untranslatable(m) => write!(f, "{m}"),
        }
    }
}

fn abbreviate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_string(),
    }
}

/// Writes the canonical form of `value` into `out`.
pub fn write_canonical(
    value: &Value,
    mode: NumberMode,
    out: &mut String,
) -> Result<(), CanonError> {
    write_canonical_checked(value, mode, out, &mut || {})
}

/// [`write_canonical`], calling `check` once per array item and object member (the extension
/// checks for a query cancel there: a document's size is the caller's).
pub fn write_canonical_checked(
    value: &Value,
    mode: NumberMode,
    out: &mut String,
    check: &mut impl FnMut(),
) -> Result<(), CanonError> {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(text) => write_number(text, mode, out)?,
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                check();
                if i > 0 {
                    out.push(',');
                }
                write_canonical_checked(item, mode, out, check)?;
            }
            out.push(']');
        }
        Value::Object(members) => {
            let mut sorted: Vec<&(String, Value)> = members.iter().collect();
            sorted.sort_by(|a, b| utf16_cmp(&a.0, &b.0));
            out.push('{');
            for (i, (name, item)) in sorted.into_iter().enumerate() {
                check();
                if i > 0 {
                    out.push(',');
                }
                write_string(name, out);
                out.push(':');
                write_canonical_checked(item, mode, out, check)?;
            }
            out.push('}');
        }
    }
    Ok(())
}

/// The canonical form of `value` as a string.
pub fn canonicalize(value: &Value, mode: NumberMode) -> Result<String, CanonError> {
    let mut out = String::new();
    write_canonical(value, mode, &mut out)?;
    Ok(out)
}

/// Compares two member names as sequences of UTF-16 code units (RFC 8785 section 3.2.3).
pub fn utf16_cmp(a: &str, b: &str) -> Ordering {
    // UTF-8 byte order equals code point order, which equals UTF-16 order unless a
    // supplementary character meets one in U+E000..U+FFFF: only then walk the code units.
    let (ab, bb) = (a.as_bytes(), b.as_bytes());
    let common = ab.iter().zip(bb).take_while(|(x, y)| x == y).count();
    let (ra, rb) = (&ab[common..], &bb[common..]);
    match (ra.first(), rb.first()) {
        (Some(&x), Some(&y)) if x >= 0xEE && y >= 0xEE => a.encode_utf16().cmp(b.encode_utf16()),
        _ => ab.cmp(bb),
    }
}

/// Writes `s` as a JSON string with RFC 8785 escaping.
pub fn write_string(s: &str, out: &mut String) {
    out.push('"');
    let bytes = s.as_bytes();
    let mut start = 0;
    // Only ASCII bytes are ever escaped, and they never occur inside a multi-byte character,
    // so a byte scan finds every split point at a character boundary.
    for (i, &b) in bytes.iter().enumerate() {
        let escape = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            0x08 => "\\b",
            b'\t' => "\\t",
            b'\n' => "\\n",
            0x0c => "\\f",
            b'\r' => "\\r",
            0x00..=0x1f => "",
            _ => continue,
        };
        out.push_str(&s[start..i]);
        if escape.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.push_str("\\u00");
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 0xf) as usize] as char);
        } else {
            out.push_str(escape);
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

/// Splits exact decimal text into (negative, integer digits, fraction digits, exponent).
fn split_number(text: &str) -> (bool, &str, &str, i64) {
    let (neg, rest) = match text.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, text),
    };
    let (mantissa, exp) = match rest.find(['e', 'E']) {
        Some(at) => {
            let e = &rest[at + 1..];
            let e = e.strip_prefix('+').unwrap_or(e);
            // Exponents beyond i64 cannot come from jsonb (numeric is bounded); saturate.
            let parsed = e.parse::<i64>().unwrap_or(if e.starts_with('-') {
                i64::MIN / 4
            } else {
                i64::MAX / 4
            });
            (&rest[..at], parsed.clamp(i64::MIN / 4, i64::MAX / 4))
        }
        None => (rest, 0),
    };
    match mantissa.find('.') {
        Some(dot) => (neg, &mantissa[..dot], &mantissa[dot + 1..], exp),
        None => (neg, mantissa, "", exp),
    }
}

/// Lays out an exact decimal number in the ECMAScript Number::toString form, in pure decimal
/// arithmetic. For the shortest spelling of any double this equals RFC 8785's output.
pub fn es_layout(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    es_layout_into(text, &mut out);
    out
}

/// [`es_layout`], appended to `out` (no allocation for numbers of up to 64 digits).
pub fn es_layout_into(text: &str, out: &mut String) {
    let (neg, int, frac, exp) = split_number(text);
    let mut buf = [0u8; 64];
    let mut heap = Vec::new();
    let all: &[u8] = if int.len() + frac.len() <= buf.len() {
        buf[..int.len()].copy_from_slice(int.as_bytes());
        buf[int.len()..int.len() + frac.len()].copy_from_slice(frac.as_bytes());
        &buf[..int.len() + frac.len()]
    } else {
        heap.extend_from_slice(int.as_bytes());
        heap.extend_from_slice(frac.as_bytes());
        &heap
    };
    let lead = all.iter().take_while(|&&b| b == b'0').count();
    let digits = &all[lead..];
    if digits.is_empty() {
        out.push('0');
        return;
    }
    let trail = digits.iter().rev().take_while(|&&b| b == b'0').count();
    // ASCII digits only: the slices below are valid UTF-8.
    let s = std::str::from_utf8(&digits[..digits.len() - trail]).unwrap_or("0");
    let k = s.len() as i64;
    // value = 0.s * 10^n
    let n = exp - frac.len() as i64 + digits.len() as i64;
    if neg {
        out.push('-');
    }
    // At most 20 zeros are ever written in a row (the two ranges below).
    const ZEROS: &str = "00000000000000000000";
    if k <= n && n <= 21 {
        out.push_str(s);
        out.push_str(&ZEROS[..(n - k) as usize]);
    } else if 0 < n && n <= 21 {
        out.push_str(&s[..n as usize]);
        out.push('.');
        out.push_str(&s[n as usize..]);
    } else if -6 < n && n <= 0 {
        out.push_str("0.");
        out.push_str(&ZEROS[..(-n) as usize]);
        out.push_str(s);
    } else {
        out.push_str(&s[..1]);
        if k > 1 {
            out.push('.');
            out.push_str(&s[1..]);
        }
        out.push('e');
        out.push(if n > 0 { '+' } else { '-' });
        out.push_str(&(n - 1).abs().to_string());
    }
}

/// Writes a number from its exact decimal text in `mode`.
pub fn write_number(text: &str, mode: NumberMode, out: &mut String) -> Result<(), CanonError> {
    match mode {
        NumberMode::Exact => es_layout_into(text, out),
        NumberMode::Rfc8785 => out.push_str(&rfc8785_number(text)?),
    }
    Ok(())
}

/// Rounds exact decimal text to the nearest double and writes it as RFC 8785 does.
pub fn rfc8785_number(text: &str) -> Result<String, CanonError> {
    // Rust's float parser is correctly rounded for inputs of any length; values beyond the
    // range give infinity, which RFC 8785 forbids.
    let value: f64 = text
        .parse()
        .map_err(|_| CanonError::NumberOutOfRange(text.to_string()))?;
    if !value.is_finite() {
        return Err(CanonError::NumberOutOfRange(text.to_string()));
    }
    Ok(format_double(value))
}

/// ECMAScript Number::toString of a finite double (`-0` gives `0`).
pub fn format_double(value: f64) -> String {
    if value == 0.0 {
        return "0".to_string();
    }
    let mut buf = ryu_js::Buffer::new();
    buf.format_finite(value).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json_text::parse_json;

    fn canon(text: &str) -> String {
        canonicalize(&parse_json(text).unwrap(), NumberMode::Rfc8785).unwrap()
    }

    fn exact(text: &str) -> String {
        canonicalize(&parse_json(text).unwrap(), NumberMode::Exact).unwrap()
    }

    #[test]
    fn rfc_section_3_2_2_sample() {
        let input = r#"{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001], "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/", "literals": [null, true, false]}"#;
        let expected = "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\"string\":\"\u{20ac}$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}";
        assert_eq!(canon(input), expected);
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(canon(input).as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "2d5e01a318d0f0879ab568c4be289c8b1f64ef8921a53c6277d5e069978baacb"
        );
        // In exact mode only the non-shortest 333333333.33333329 differs.
        assert!(exact(input).contains("[333333333.33333329,1e+30,4.5,0.002,1e-27]"));
    }

    #[test]
    fn rfc_section_3_2_3_sort_order() {
        let input = r#"{"\u20ac": "Euro Sign", "\r": "Carriage Return", "\ufb33": "Hebrew Letter Dalet With Dagesh", "1": "One", "\ud83d\ude00": "Emoji: Grinning Face", "\u0080": "Control", "\u00f6": "Latin Small Letter O With Diaeresis"}"#;
        let out = canon(input);
        let order = [
            "Carriage Return",
            "One",
            "Control",
            "Latin Small Letter O With Diaeresis",
            "Euro Sign",
            "Emoji: Grinning Face",
            "Hebrew Letter Dalet With Dagesh",
        ];
        let positions: Vec<usize> = order.iter().map(|v| out.find(v).unwrap()).collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{out}");
    }

    #[test]
    fn appendix_b_doubles() {
        let cases: [(u64, &str); 24] = [
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ];
        for (bits, expected) in cases {
            let d = f64::from_bits(bits);
            assert_eq!(format_double(d), expected, "{bits:016x}");
            // The %.17g spelling, rounded in rfc8785 mode, gives the same text...
            assert_eq!(rfc8785_number(&format!("{d:.17e}")).unwrap(), expected);
            // ...and the shortest spelling, laid out exactly, too.
            assert_eq!(es_layout(expected), expected, "{bits:016x}");
        }
        // NaN and Infinity have no JSON spelling; out-of-range text is refused.
        assert!(matches!(
            rfc8785_number("1e400"),
            Err(CanonError::NumberOutOfRange(_))
        ));
        assert!(matches!(
            rfc8785_number("-1e400"),
            Err(CanonError::NumberOutOfRange(_))
        ));
        assert_eq!(rfc8785_number("1e-400").unwrap(), "0");
        // The message spells the value canonically, whatever digits carried it.
        let e = rfc8785_number("10e308").unwrap_err();
        assert_eq!(
            e.to_string(),
            "number 1e+309 is outside the IEEE-754 double range"
        );
    }

    #[test]
    fn exact_numbers_never_collide_or_round() {
        for same in ["1", "1.0", "1.00", "1e0", "100e-2", "0.1e1", "10E-1"] {
            assert_eq!(es_layout(same), "1");
        }
        assert_eq!(es_layout("9007199254740993"), "9007199254740993");
        assert_eq!(es_layout("1e400"), "1e+400");
        assert_eq!(es_layout("1e-400"), "1e-400");
        assert_eq!(es_layout("-0"), "0");
        assert_eq!(es_layout("-0.000"), "0");
        assert_eq!(es_layout("0.10000000000000001"), "0.10000000000000001");
        assert_eq!(
            es_layout("123456789012345678901234567890"),
            "1.2345678901234567890123456789e+29"
        );
        assert_eq!(es_layout("1e21"), "1e+21");
        assert_eq!(es_layout("999999999999999999999"), "999999999999999999999");
        assert_eq!(es_layout("0.000001"), "0.000001");
        assert_eq!(es_layout("0.0000001"), "1e-7");
        assert_eq!(es_layout("-12.5e-1"), "-1.25");
    }

    #[test]
    fn cyberphone_vectors() {
        assert_eq!(
            canon(r#"[56, {"d": true, "10": null, "1": [ ]}]"#),
            r#"[56,{"1":[],"10":null,"d":true}]"#
        );
        assert_eq!(
            canon(
                r#"{"1": {"f": {"f": "hi","F": 5} ,"\n": 56.0}, "10": { }, "": "empty", "a": { }, "111": [ {"e": "yes","E": "no" } ], "A": { }}"#
            ),
            r#"{"":"empty","1":{"\n":56,"f":{"F":5,"f":"hi"}},"10":{},"111":[{"E":"no","e":"yes"}],"A":{},"a":{}}"#
        );
        // French: no locale, code units only.
        assert_eq!(
            canon(
                r#"{"peach": "This sorting order", "péché": "is wrong according to French", "pêche": "but canonicalization MUST", "sin": "ignore locale"}"#
            ),
            r#"{"peach":"This sorting order","péché":"is wrong according to French","pêche":"but canonicalization MUST","sin":"ignore locale"}"#
        );
        // No Unicode normalization.
        assert_eq!(
            canon(r#"{"Unnormalized Unicode":"A\u030a"}"#),
            "{\"Unnormalized Unicode\":\"A\u{30a}\"}"
        );
        // Weird: controls, </script>, DEL and C1 raw, surrogate pair before U+FB33.
        assert_eq!(
            canon(
                r#"{"\u20ac": "Euro Sign", "\r": "Carriage Return", "\u000a": "Newline", "1": "One", "\u0080": "Control\u007f", "\ud83d\ude02": "Smiley", "\u00f6": "Latin Small Letter O With Diaeresis", "\ufb33": "Hebrew Letter Dalet With Dagesh", "</script>": "Browser Challenge"}"#
            ),
            "{\"\\n\":\"Newline\",\"\\r\":\"Carriage Return\",\"1\":\"One\",\"</script>\":\"Browser Challenge\",\"\u{80}\":\"Control\u{7f}\",\"ö\":\"Latin Small Letter O With Diaeresis\",\"€\":\"Euro Sign\",\"😂\":\"Smiley\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
        );
    }

    #[test]
    fn string_escaping() {
        let mut out = String::new();
        write_string("\u{0}\u{1f}\u{7f}/\u{2028}\"\\\u{8}\u{c}", &mut out);
        assert_eq!(out, "\"\\u0000\\u001f\u{7f}/\u{2028}\\\"\\\\\\b\\f\"");
    }

    #[test]
    fn utf16_order_differs_from_code_points_only_where_it_should() {
        assert_eq!(utf16_cmp("\u{1F600}", "\u{FB33}"), Ordering::Less);
        assert_eq!(utf16_cmp("\u{FB33}", "\u{1F600}"), Ordering::Greater);
        assert_eq!(utf16_cmp("", "a"), Ordering::Less);
        assert_eq!(utf16_cmp("a", "aa"), Ordering::Less);
        assert_eq!(utf16_cmp("aa", "ab"), Ordering::Less);
        assert_eq!(utf16_cmp("\u{E000}", "\u{D7FF}"), Ordering::Greater);
        assert_eq!(utf16_cmp("x", "x"), Ordering::Equal);
    }

    #[test]
    fn exclusion_by_name_and_pointer() {
        let mut v =
            parse_json(r#"{"a":1,"ts":2,"n":{"ts":3,"a/b":4,"m~n":5,"l":[{"x":1,"y":2},7]}}"#)
                .unwrap();
        exclude(&mut v, "ts").unwrap();
        exclude(&mut v, "/n/ts").unwrap();
        exclude(&mut v, "/n/a~1b").unwrap();
        exclude(&mut v, "/n/m~0n").unwrap();
        exclude(&mut v, "/n/l/0/y").unwrap();
        exclude(&mut v, "/n/l/1").unwrap();
        exclude(&mut v, "/missing/deeper").unwrap();
        exclude(&mut v, "/n/l/01").unwrap();
        assert_eq!(
            canonicalize(&v, NumberMode::Exact).unwrap(),
            r#"{"a":1,"n":{"l":[{"x":1}]}}"#
        );
        assert!(matches!(
            exclude(&mut v, "/a~2"),
            Err(CanonError::InvalidPointer(_))
        ));
        assert!(matches!(
            exclude(&mut v, "/a~"),
            Err(CanonError::InvalidPointer(_))
        ));
    }

    #[test]
    fn nesting_limit() {
        let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(parse_json(&ok).is_ok());
        let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
        assert_eq!(parse_json(&deep), Err(CanonError::TooDeep));
        let very = "{\"a\":".repeat(10_000) + "1" + &"}".repeat(10_000);
        assert_eq!(parse_json(&very), Err(CanonError::TooDeep));
    }

    #[test]
    fn parser_rejects_non_json() {
        for bad in [
            "",
            "01",
            "1.",
            "-",
            "[1,]",
            "{\"a\"}",
            "\"\\ud800\"",
            "nul",
            "[1] x",
            "\"\u{1}\"",
            // a sign inside a \u escape (found by the fuzzer: from_str_radix accepts it)
            "\"\\u+041\"",
            "\"\\u-041\"",
            "\"\\u 041\"",
        ] {
            assert!(parse_json(bad).is_err(), "{bad:?}");
        }
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(20_000))]

            /// For every double, the exact layout of its shortest spelling is RFC 8785's output.
            #[test]
            fn exact_layout_agrees_with_rfc8785_on_doubles(bits in any::<u64>()) {
                let d = f64::from_bits(bits);
                prop_assume!(d.is_finite());
                let shortest = format_double(d);
                prop_assert_eq!(es_layout(&shortest), shortest.clone());
                prop_assert_eq!(rfc8785_number(&shortest).unwrap(), shortest);
            }

            /// Equal values spelt differently canonicalize alike in exact mode.
            #[test]
            fn exact_layout_is_spelling_independent(
                neg in any::<bool>(), digits in "[1-9][0-9]{0,30}", point in 0usize..32,
                exp in -400i64..400, pad in 0usize..4,
            ) {
                let point = point.min(digits.len());
                let sign = if neg { "-" } else { "" };
                let a = format!("{sign}{}e{}", digits, exp);
                let (i, f) = digits.split_at(digits.len() - point);
                let int = if i.is_empty() { "0" } else { i };
                let b = format!("{sign}{int}.{f}{}e{}", "0".repeat(pad), exp + point as i64);
                let b = if f.is_empty() && pad == 0 { format!("{sign}{int}e{}", exp) } else { b };
                prop_assert_eq!(es_layout(&a), es_layout(&b));
            }
        }
    }
}
