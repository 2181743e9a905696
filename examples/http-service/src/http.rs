//! The request as the routes see it: the client's identity, then what the idempotency crate
//! reads (key, query, JSON body). Responses and their idempotency headers are the crate's.

use std::ops::Deref;

use axum::body::Bytes;
use axum::http::header::WWW_AUTHENTICATE;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::Response;
use idempotency_axum::body::{self, Members};
use idempotency_axum::request::{read, IdemRequest};
pub use idempotency_axum::response::{finish, problem, problem_json, stored, Echo};

pub const MAX_CLIENT_CHARS: usize = 64;

/// Everything an idempotent route needs from the request, checked.
pub struct Ctx {
    /// Key, scope (`<client>:<METHOD> <path>`: keys are unique per client and route), method,
    /// path, query, body and the echoed headers.
    pub req: IdemRequest,
    pub client: String,
    /// The members of the body's top-level object, for the routes' checks (`None`: not an
    /// object).
    pub members: Members,
    pub test_delay: Option<std::time::Duration>,
}

impl Deref for Ctx {
    type Target = IdemRequest;

    fn deref(&self) -> &IdemRequest {
        &self.req
    }
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
    let Some(client) = client_id(headers) else {
        let echo = Echo {
            key: headers.get(idempotency_axum::key::HEADER).cloned(),
            ..Echo::default()
        };
        return Err(finish(unauthenticated(), &echo));
    };
    let scope = format!("{client}:{method} {path}");
    let req = read(method, path, scope, uri, headers, body)?;
    // read() checked that the body is UTF-8 JSON.
    let members = body::parse(&req.body).unwrap_or(None);
    let test_delay = test_delay(headers, test_hooks);
    Ok(Ctx {
        req,
        client,
        members,
        test_delay,
    })
}

/// 401: no client identity.
pub fn unauthenticated() -> Response {
    let mut r = problem(
        StatusCode::UNAUTHORIZED,
        "unauthenticated",
        "Client is not authenticated",
        "Send Authorization: Bearer <client-id> (or X-Client-Id), 1 to 64 characters of A-Z a-z 0-9 . _ -",
    );
    r.headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

/// The test hook: `X-Test-Delay-Ms` makes a handler sleep after its claim (TEST_HOOKS=1 only).
pub fn test_delay(headers: &HeaderMap, test_hooks: bool) -> Option<std::time::Duration> {
    if !test_hooks {
        return None;
    }
    headers
        .get("x-test-delay-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(std::time::Duration::from_millis)
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
