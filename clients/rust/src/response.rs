//! Building responses: JSON bodies, RFC 9457 problem details, and the idempotency headers that
//! every response of an idempotent route carries.

use std::time::SystemTime;

use axum::body::Body;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::{json, Value};

use crate::key;

/// The media type of problem details (RFC 9457).
pub const PROBLEM_JSON: &str = "application/problem+json";
/// Where the problem types live: `<base><slug>`, the names the IETF draft uses in its examples.
pub const PROBLEM_BASE: &str = "https://developer.example.com/idempotency/";

/// The headers of a handler's answer that are stored and replayed besides `Content-Type`, unless
/// configured otherwise ([`crate::IdempotencyLayer::replay_headers`]): those that describe the
/// resource, not the one response.
pub const REPLAY_HEADERS: [&str; 5] = [
    "location",
    "content-location",
    "etag",
    "last-modified",
    "link",
];

/// Never stored nor replayed, whatever the allow-list says: per-response and hop-by-hop headers,
/// cookies, and the idempotency headers themselves.
const NEVER_REPLAYED: [&str; 11] = [
    "content-length",
    "date",
    "server",
    "set-cookie",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "idempotency-expires",
    "idempotency-key",
    "idempotent-replayed",
    "retry-after",
];

fn replayable(name: &str, allowed: &[HeaderName]) -> bool {
    name.eq_ignore_ascii_case("content-type")
        || (allowed
            .iter()
            .any(|a| a.as_str().eq_ignore_ascii_case(name))
            && !NEVER_REPLAYED.iter().any(|n| n.eq_ignore_ascii_case(name)))
}

/// The default allow-list as header names.
pub fn default_replay_headers() -> Vec<HeaderName> {
    REPLAY_HEADERS
        .iter()
        .map(|h| HeaderName::from_static(h))
        .collect()
}

/// The stored form of an answer (the `response` that `complete` stores), the same in the Python,
/// Node and Rust clients: `{"headers": [[name, value], ...], "content_type": ..., "body": text}`,
/// the headers being `Content-Type` and those of `allowed`; the body as text when it is UTF-8
/// without NUL (jsonb cannot hold NUL), else base64 in `body` with `"encoding": "base64"` (and in
/// `body_base64`, which the Python client before 0.5.0 reads).
pub fn envelope(headers: &HeaderMap, body: &[u8], allowed: &[HeaderName]) -> String {
    let mut kept = Vec::new();
    let mut ctype = None;
    for (name, value) in headers {
        let Ok(v) = value.to_str() else { continue };
        if !replayable(name.as_str(), allowed) {
            continue;
        }
        if name == CONTENT_TYPE {
            ctype = Some(v.to_string());
        }
        kept.push(json!([name.as_str(), v]));
    }
    let mut doc = serde_json::Map::new();
    doc.insert("headers".into(), Value::Array(kept));
    if let Some(ct) = ctype {
        doc.insert("content_type".into(), Value::String(ct));
    }
    match std::str::from_utf8(body) {
        Ok(t) if !t.contains('\0') => {
            doc.insert("body".into(), Value::String(t.to_string()));
        }
        _ => {
            use base64::Engine as _;
            let b64 = base64::engine::general_purpose::STANDARD.encode(body);
            doc.insert("body".into(), Value::String(b64.clone()));
            doc.insert("encoding".into(), Value::String("base64".into()));
            doc.insert("body_base64".into(), Value::String(b64));
        }
    }
    Value::Object(doc).to_string()
}

const ENVELOPE: [&str; 5] = ["headers", "content_type", "body", "body_base64", "encoding"];

/// The stored answer as a response: the form of [`envelope`] (also as the Python and Node clients
/// before 0.5.0 wrote it), else a plain JSON value, as this crate before 0.5.0 and other code
/// that completes keys store it (sent as JSON, problem+json for an error status).
pub fn replayed(status: StatusCode, stored_json: Option<&str>, allowed: &[HeaderName]) -> Response {
    let Some(text) = stored_json else {
        let mut r = Response::new(Body::empty());
        *r.status_mut() = status;
        return r;
    };
    let doc: Option<serde_json::Map<String, Value>> = match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m))
            if m.keys().all(|k| ENVELOPE.contains(&k.as_str()))
                && (m.get("body").is_some_and(Value::is_string)
                    || m.get("body_base64").is_some_and(Value::is_string)) =>
        {
            Some(m)
        }
        _ => None,
    };
    let Some(doc) = doc else {
        return stored(status, Some(text.to_string()));
    };
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let body: Vec<u8> = match (doc.get("body_base64"), doc.get("body"), doc.get("encoding")) {
        (Some(Value::String(b)), _, _) => b64.decode(b).unwrap_or_default(),
        (_, Some(Value::String(b)), Some(Value::String(e))) if e == "base64" => {
            b64.decode(b).unwrap_or_default()
        }
        (_, Some(Value::String(b)), _) => b.clone().into_bytes(),
        _ => Vec::new(),
    };
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    let h = r.headers_mut();
    if let Some(Value::Array(pairs)) = doc.get("headers") {
        for p in pairs {
            if let Some([Value::String(k), Value::String(v)]) = p.as_array().map(Vec::as_slice) {
                if !replayable(k, allowed) {
                    continue;
                }
                if let (Ok(n), Ok(v)) = (HeaderName::try_from(k.as_str()), HeaderValue::from_str(v))
                {
                    h.append(n, v);
                }
            }
        }
    }
    if !h.contains_key(CONTENT_TYPE) {
        if let Some(Value::String(ct)) = doc.get("content_type") {
            if let Ok(v) = HeaderValue::from_str(ct) {
                h.insert(CONTENT_TYPE, v);
            }
        }
    }
    r
}

/// What the idempotency headers of one response say.
#[derive(Debug, Clone, Default)]
pub struct Echo {
    /// The `Idempotency-Key` header as the client sent it.
    pub key: Option<HeaderValue>,
    /// The claim's `expires_at`: until then a retry with the same key is recognised.
    pub expires: Option<SystemTime>,
    /// Sets `Idempotent-Replayed: true`.
    pub replayed: bool,
    /// `Retry-After`, in seconds.
    pub retry_after: Option<u64>,
}

/// A JSON body (`application/json`, or problem+json for an error status).
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

/// An RFC 9457 problem detail; `slug` names the problem type under [`PROBLEM_BASE`].
pub fn problem(status: StatusCode, slug: &str, title: &str, detail: &str) -> Response {
    problem_body(status, &problem_json(status, slug, title, detail))
}

/// The JSON document of a problem detail.
pub fn problem_json(status: StatusCode, slug: &str, title: &str, detail: &str) -> Value {
    json!({
        "type": format!("{PROBLEM_BASE}{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    })
}

/// A response carrying a problem document.
pub fn problem_body(status: StatusCode, doc: &Value) -> Response {
    stored(status, Some(doc.to_string()))
}

/// Adds the idempotency headers: the echoed key, `Idempotency-Expires` (IMF-fixdate, floored to
/// the second so that it never promises more than the store keeps), `Idempotent-Replayed`,
/// `Retry-After`, and `Cache-Control: no-store` (unless the response has a `Cache-Control` of its
/// own).
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
    if !h.contains_key(CACHE_CONTROL) {
        h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    r
}

/// 503 with `Retry-After: 1`: the database could not be reached, nothing happened.
pub fn unavailable(echo: &Echo) -> Response {
    let r = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "database",
        "Database unavailable",
        "retry with the same Idempotency-Key",
    );
    finish(
        r,
        &Echo {
            retry_after: Some(1),
            ..echo.clone()
        },
    )
}
