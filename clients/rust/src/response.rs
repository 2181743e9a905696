//! Building responses: JSON bodies, RFC 9457 problem details, and the idempotency headers that
//! every response of an idempotent route carries.

use std::time::SystemTime;

use axum::body::Body;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::{json, Value};

use crate::key;

/// The media type of problem details (RFC 9457).
pub const PROBLEM_JSON: &str = "application/problem+json";
/// Where the problem types live: `<base><slug>`, the names the IETF draft uses in its examples.
pub const PROBLEM_BASE: &str = "https://developer.example.com/idempotency/";

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
/// `Retry-After`, and `Cache-Control: no-store`.
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
