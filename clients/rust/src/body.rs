//! The JSON request body, read the way PostgreSQL's jsonb reads it.
//!
//! The body goes to PostgreSQL as text and `$n::text::jsonb` is the judge of what it holds: the
//! service never builds a tree of it. Here it is only checked to be JSON, and the members of its
//! top-level object are cut out as JSON text, for the routes' checks of the few fields they read.
//! The check walks the text without recursion and without converting numbers, so it accepts
//! everything jsonb accepts: numbers beyond the range of a double (`1e400`, a 30-digit integer),
//! nesting of any depth. What PostgreSQL refuses although it is JSON (`\u0000`, a number beyond
//! `numeric`, nesting deeper than the 1000 levels that the fingerprint's canonical hashing takes)
//! is refused when the request is claimed, and answered 422 (see [`crate::store::db_error`]).

use std::collections::BTreeMap;

use serde_json::value::RawValue;

/// The members of a top-level object, each as its JSON text; `None` for a body that is JSON but
/// not an object.
pub type Members = Option<BTreeMap<String, Box<RawValue>>>;

/// Checks that `text` is one JSON value and cuts out the members of a top-level object (a name
/// given twice keeps its last value, as in jsonb).
pub fn parse(text: &str) -> Result<Members, serde_json::Error> {
    // Deserializing into a RawValue only scans the value: iteratively, so with no depth limit,
    // and with numbers left as text.
    serde_json::from_str::<&RawValue>(text)?;
    if text
        .trim_start_matches([' ', '\t', '\n', '\r'])
        .starts_with('{')
    {
        // One level of objects, the values as RawValue again: a member name is the only thing
        // read into a Rust value.
        return serde_json::from_str(text).map(Some);
    }
    Ok(None)
}

/// A JSON number greater than zero, of any size or precision.
pub fn is_positive_number(v: &RawValue) -> bool {
    let t = v.get();
    // The text is a JSON number when it starts with a digit or '-' (it passed the JSON scan);
    // it is positive when it has no '-' and a digit other than 0 before its exponent.
    let mantissa = t.split(['e', 'E']).next().unwrap_or("");
    t.starts_with(|c: char| c.is_ascii_digit())
        && mantissa.bytes().any(|b| (b'1'..=b'9').contains(&b))
}

/// A JSON array with at least one element (of any depth).
pub fn is_non_empty_array(v: &RawValue) -> bool {
    serde_json::from_str::<Vec<&RawValue>>(v.get()).is_ok_and(|a| !a.is_empty())
}

/// A JSON string's value.
pub fn string(v: &RawValue) -> Option<String> {
    serde_json::from_str(v.get()).ok()
}

/// A JSON integer that fits an `i64` (`5`, not `5.0` or `5e0`).
pub fn integer(v: &RawValue) -> Option<i64> {
    serde_json::from_str(v.get()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(text: &str, name: &str) -> Box<RawValue> {
        parse(text).unwrap().unwrap().remove(name).unwrap()
    }

    #[test]
    fn accepts_what_jsonb_accepts() {
        let thirty = "1".repeat(30);
        let four_hundred = "9".repeat(400);
        for text in [
            format!("{{\"a\": 1e400, \"b\": {thirty}, \"c\": -{four_hundred}.5e-9999}}"),
            format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)),
            format!(
                "{{\"a\": {}1{}}}",
                "{\"b\": [".repeat(5000),
                "]}".repeat(5000)
            ),
            // jsonb refuses this one, PostgreSQL says so when the request is claimed.
            "{\"a\": \"x\\u0000y\"}".to_string(),
            " \t\n\"just a string\"\r\n".to_string(),
        ] {
            assert!(parse(&text).is_ok(), "{}", &text[..text.len().min(60)]);
        }
        let deep = format!(
            "{{\"items\": {}{}}}",
            "[".repeat(10_000),
            "]".repeat(10_000)
        );
        assert!(is_non_empty_array(&member(&deep, "items")));
    }

    #[test]
    fn refuses_what_is_not_json() {
        for text in [
            "",
            "{not json",
            "{\"a\": 1,}",
            "[1] [2]",
            "{\"a\": 01}",
            "{\"a\": .5}",
            "{\"a\": \"\u{1}\"}",
            "{\"a\": \"\\x\"}",
            "[[[[",
            "{\"\\ud800\": 1}",
        ] {
            assert!(parse(text).is_err(), "{text}");
        }
    }

    #[test]
    fn members_of_an_object_only() {
        let m = parse("{\"a\": 1, \"b\": {\"c\": [2]}, \"a\": 3}")
            .unwrap()
            .unwrap();
        assert_eq!(m["a"].get(), "3"); // the last one, as jsonb keeps it
        assert_eq!(m["b"].get(), "{\"c\": [2]}");
        assert!(parse("[1, 2]").unwrap().is_none());
        assert!(parse("\"{\"").unwrap().is_none());
    }

    #[test]
    fn field_checks() {
        let f = |text: &str| member(&format!("{{\"v\": {text}}}"), "v");
        for yes in [
            "1",
            "0.5",
            "59.90",
            "1e400",
            "1e-400",
            "0.000001",
            "12345678901234567890123456789",
        ] {
            assert!(is_positive_number(&f(yes)), "{yes}");
        }
        for no in [
            "0", "-1", "0.0", "0e5", "-1e400", "\"5\"", "true", "[1]", "null",
        ] {
            assert!(!is_positive_number(&f(no)), "{no}");
        }
        assert!(is_non_empty_array(&f("[{\"sku\": \"A1\"}]")));
        assert!(!is_non_empty_array(&f("[]")));
        assert!(!is_non_empty_array(&f("{\"0\": 1}")));
        assert_eq!(string(&f("\"E\\u0055R\"")).as_deref(), Some("EUR"));
        assert_eq!(string(&f("1")), None);
        assert_eq!(integer(&f("42")), Some(42));
        for no in ["4.0", "4e1", "99999999999999999999", "\"4\""] {
            assert_eq!(integer(&f(no)), None, "{no}");
        }
    }
}
