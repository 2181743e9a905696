//! What an idempotent request is made of, read and checked from the HTTP request.

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::Response;
use serde_json::{Map, Value};

use crate::response::{finish, problem, Echo};
use crate::{body, key};

/// Everything a claim needs from the request, checked.
#[derive(Debug, Clone)]
pub struct IdemRequest {
    /// The key, parsed from the `Idempotency-Key` header.
    pub key: String,
    /// Who owns the key, e.g. `<client>:POST /orders`: keys are unique per scope.
    pub scope: String,
    pub method: String,
    pub path: String,
    /// The query string as a JSON object (a repeated name gives an array), for the fingerprint.
    pub query: String,
    /// A JSON body (`Content-Type` `application/json` or `*+json`) as received: PostgreSQL parses
    /// it, numbers keep their exact value, member order and spacing do not matter. Empty for any
    /// other body.
    pub body: String,
    /// Any other body (a form, `text/plain`, bytes, a JSON body sent without a JSON content
    /// type): the fingerprint holds its SHA-256, as in the Python and Node clients. `None` for a
    /// JSON body and for an empty one (an empty POST: the fingerprint has no body).
    pub body_bytes: Option<Vec<u8>>,
    /// The headers every response to it carries (the key as sent, at first).
    pub echo: Echo,
}

/// Reads the `Idempotency-Key` (400 when missing or malformed), the query string and the body:
/// a JSON body (by its content type) must be JSON (400), any other body is taken as bytes. Whether jsonb can hold the body is PostgreSQL's call, when the
/// request is claimed. The error response carries the idempotency headers.
#[allow(clippy::result_large_err)]
pub fn read(
    method: &str,
    path: &str,
    scope: String,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<IdemRequest, Response> {
    read_with(method, path, scope, uri, headers, body, false)
}

/// [`read`]; `lenient`: a bare (unquoted, Stripe-style) key is accepted too
/// ([`key::parse_lenient`]).
#[allow(clippy::result_large_err)]
pub fn read_with(
    method: &str,
    path: &str,
    scope: String,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
    lenient: bool,
) -> Result<IdemRequest, Response> {
    let mut echo = Echo {
        key: headers.get(key::HEADER).cloned(),
        ..Echo::default()
    };
    let (key, raw) = match key::parse_with(headers, lenient) {
        Ok(k) => k,
        Err(e) => return Err(key_error(&e, &echo)),
    };
    echo.key = Some(raw);
    let bad_request = |detail: String, echo: &Echo| {
        finish(
            problem(
                StatusCode::BAD_REQUEST,
                "bad-request",
                "Bad request",
                &detail,
            ),
            echo,
        )
    };
    let query = match query_json(uri.query().unwrap_or("")) {
        Ok(q) => q,
        Err(e) => return Err(bad_request(format!("query string: {e}"), &echo)),
    };
    let (text, bytes) = if body.is_empty() {
        (String::new(), None)
    } else if is_json(headers) {
        let text = match std::str::from_utf8(body) {
            Ok(t) => t,
            Err(_) => return Err(bad_request("the JSON body is not UTF-8".into(), &echo)),
        };
        if let Err(e) = body::parse(text) {
            return Err(bad_request(format!("the body is not JSON: {e}"), &echo));
        }
        (text.to_string(), None)
    } else {
        (String::new(), Some(body.to_vec()))
    };
    Ok(IdemRequest {
        key,
        scope,
        method: method.to_string(),
        path: path.to_string(),
        query: query.to_string(),
        body: text,
        body_bytes: bytes,
        echo,
    })
}

/// Whether the request says its body is JSON: `application/json` or a `+json` type.
pub fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|ct| {
            let essence = ct.split(';').next().unwrap_or("").trim();
            essence.eq_ignore_ascii_case("application/json")
                || essence.to_ascii_lowercase().ends_with("+json")
        })
        .unwrap_or(false)
}

/// The 400 for a missing or malformed key.
pub fn key_error(e: &key::KeyError, echo: &Echo) -> Response {
    let (slug, title) = if *e == key::KeyError::Missing {
        ("key-missing", "Idempotency-Key is missing")
    } else {
        ("key-malformed", "Idempotency-Key is malformed")
    };
    finish(
        problem(StatusCode::BAD_REQUEST, slug, title, &e.detail()),
        echo,
    )
}

/// The query string as a JSON object. A name or value with a NUL (`%00`) is refused: PostgreSQL
/// text cannot hold one.
pub fn query_json(q: &str) -> Result<Value, String> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(q).map_err(|e| e.to_string())?;
    let mut m = Map::new();
    for (k, v) in pairs {
        if k.contains('\0') || v.contains('\0') {
            return Err(
                "a name or value holds a NUL character (%00), which PostgreSQL text cannot hold"
                    .into(),
            );
        }
        match m.get_mut(&k) {
            None => {
                m.insert(k, Value::String(v));
            }
            Some(Value::Array(a)) => a.push(Value::String(v)),
            Some(first) => {
                let prev = first.take();
                *first = Value::Array(vec![prev, Value::String(v)]);
            }
        }
    }
    Ok(Value::Object(m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn repeated_query_names_become_arrays() {
        assert_eq!(
            query_json("a=1&b=x%20y&a=2&a=3").unwrap(),
            json!({"a": ["1", "2", "3"], "b": "x y"})
        );
        assert_eq!(query_json("").unwrap(), json!({}));
        assert!(query_json("a=x%00y").unwrap_err().contains("NUL"));
        assert!(query_json("a%00=1").unwrap_err().contains("NUL"));
    }
}
