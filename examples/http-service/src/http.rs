//! Building responses: JSON bodies, RFC 9457 problem details, and the idempotency headers that
//! every response of an idempotent route carries.

use std::time::SystemTime;

use axum::body::{Body, Bytes};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::Response;
use serde_json::{json, Map, Value};

use crate::{body, key};

pub const PROBLEM_JSON: &str = "application/problem+json";
const PROBLEM_BASE: &str = "https://developer.example.com/idempotency/";

/// What the idempotency headers of one response say.
#[derive(Default)]
pub struct Echo {
    /// The `Idempotency-Key` header as the client sent it.
    pub key: Option<HeaderValue>,
    /// The claim's `expires_at`: until then a retry with the same key is recognised.
    pub expires: Option<SystemTime>,
    pub replayed: bool,
    pub retry_after: Option<u64>,
}

/// A JSON body (`application/json`, or problem+json for an error status, which is what every
/// error body this service stores is).
pub fn stored(status: StatusCode, body: Option<String>) -> Response {
    let ct = if status.is_client_error() || status.is_server_error() {
        PROBLEM_JSON
    } else {
        "application/json"
    };
    let mut r = Response::new(body.map(Body::from).unwrap_or_default());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(ct));
    r
}

/// An RFC 9457 problem detail; `slug` names the problem type.
pub fn problem(status: StatusCode, slug: &str, title: &str, detail: &str) -> Response {
    problem_body(status, &problem_json(status, slug, title, detail))
}

pub fn problem_json(status: StatusCode, slug: &str, title: &str, detail: &str) -> Value {
    json!({
        "type": format!("{PROBLEM_BASE}{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    })
}

pub fn problem_body(status: StatusCode, doc: &Value) -> Response {
    stored(status, Some(doc.to_string()))
}

/// Adds the idempotency headers: the echoed key, `Idempotency-Expires` (IMF-fixdate, floored to
/// the second so that it never promises more than the store keeps), `Idempotent-Replayed`,
/// `Retry-After`.
pub fn finish(mut r: Response, echo: &Echo) -> Response {
    let h = r.headers_mut();
    if let Some(k) = &echo.key {
        h.insert(key::HEADER, k.clone());
    }
    if let Some(t) = echo.expires {
        if let Ok(v) = HeaderValue::from_str(&httpdate::fmt_http_date(t)) {
            h.insert("idempotency-expires", v);
        }
    }
    if echo.replayed {
        h.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    if let Some(s) = echo.retry_after {
        h.insert(RETRY_AFTER, HeaderValue::from(s));
    }
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// Everything an idempotent route needs from the request, checked.
pub struct Ctx {
    pub client: String,
    pub key: String,
    /// `<client>:<METHOD> <path>`: keys are unique per client and route.
    pub scope: String,
    pub method: &'static str,
    pub path: &'static str,
    /// The query string as a JSON object (a repeated name gives an array), for the fingerprint.
    pub query: String,
    /// The body as received (PostgreSQL parses it: numbers keep their exact value).
    pub body: String,
    /// The members of the body's top-level object, for the routes' checks (`None`: not an
    /// object).
    pub members: body::Members,
    pub echo: Echo,
    pub test_delay: Option<std::time::Duration>,
}

/// Authenticates the client (401), reads the Idempotency-Key (400) and the JSON body (400).
/// Whether jsonb can hold the body is PostgreSQL's call, when the request is claimed.
#[allow(clippy::result_large_err)]
pub fn prelude(
    method: &'static str,
    path: &'static str,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
    test_hooks: bool,
) -> Result<Ctx, Response> {
    let mut echo = Echo {
        key: headers.get(key::HEADER).cloned(),
        ..Echo::default()
    };
    let Some(client) = key::client_id(headers) else {
        let mut r = problem(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "Client is not authenticated",
            "Send Authorization: Bearer <client-id> (or X-Client-Id), 1 to 64 characters of A-Z a-z 0-9 . _ -",
        );
        r.headers_mut()
            .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return Err(finish(r, &echo));
    };
    let (key, raw) = match key::parse(headers) {
        Ok(k) => k,
        Err(e) => {
            let (slug, title) = if e == key::KeyError::Missing {
                ("key-missing", "Idempotency-Key is missing")
            } else {
                ("key-malformed", "Idempotency-Key is malformed")
            };
            let r = problem(StatusCode::BAD_REQUEST, slug, title, &e.detail());
            return Err(finish(r, &echo));
        }
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
    let text = match std::str::from_utf8(body) {
        Ok(t) => t,
        Err(_) => return Err(bad_request("the body is not UTF-8".into(), &echo)),
    };
    let members = match body::parse(text) {
        Ok(m) => m,
        Err(e) => return Err(bad_request(format!("the body is not JSON: {e}"), &echo)),
    };
    let test_delay = if test_hooks {
        headers
            .get("x-test-delay-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map(std::time::Duration::from_millis)
    } else {
        None
    };
    Ok(Ctx {
        scope: format!("{client}:{method} {path}"),
        client,
        key,
        method,
        path,
        query: query.to_string(),
        body: text.to_string(),
        members,
        echo,
        test_delay,
    })
}

/// The query string as a JSON object. A name or value with a NUL (`%00`) is refused: PostgreSQL
/// text cannot hold one.
fn query_json(q: &str) -> Result<Value, String> {
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
