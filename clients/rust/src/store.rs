//! Calls into the extension's SQL API: claim with the request fingerprint, complete, release,
//! and the HTTP answer for each outcome other than `new`. No hashing, expiry or fencing here:
//! all of that is the extension's.

use std::time::SystemTime;

use axum::http::StatusCode;
use axum::response::Response;
use tokio_postgres::GenericClient;

use crate::request::IdemRequest;
use crate::response::{finish, problem, stored, Echo};

/// `idempotency.outcome`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    New,
    Replay,
    InProgress,
    Mismatch,
}

/// `idempotency.claim_result`, with `retry_after` in whole seconds (rounded up).
#[derive(Debug, Clone)]
pub struct Claim {
    pub outcome: Outcome,
    pub token: Option<i64>,
    pub response: Option<String>,
    pub response_status: Option<i32>,
    pub retry_after: Option<i32>,
    pub expires_at: Option<SystemTime>,
    pub recovery_point: Option<String>,
}

/// The request is identified by `idempotency.request_fingerprint(method, path, query, body)`;
/// `claim` hashes the jsonb it is given, so it gets the fingerprint as a hex string.
const CLAIM: &str = "
SELECT c.outcome::text, c.token, c.response::text, c.response_status,
       ceil(extract(epoch FROM c.retry_after))::int, c.expires_at, c.recovery_point
  FROM idempotency.claim(
           $1,
           request => to_jsonb(encode(idempotency.request_fingerprint(
                          $2, $3, $4::text::jsonb, $5::text::jsonb), 'hex')),
           scope   => $6,
           ttl     => make_interval(secs => $7::float8),
           lease   => make_interval(secs => $8::float8)) c";

/// `idempotency.claim(key, request => fingerprint, scope, ttl, lease)`.
pub async fn claim<C: GenericClient + Sync>(
    db: &C,
    ctx: &IdemRequest,
    ttl_secs: f64,
    lease_secs: f64,
) -> Result<Claim, tokio_postgres::Error> {
    let row = db
        .query_one(
            CLAIM,
            &[
                &ctx.key,
                &ctx.method,
                &ctx.path,
                &ctx.query,
                &ctx.body,
                &ctx.scope,
                &ttl_secs,
                &lease_secs,
            ],
        )
        .await?;
    let outcome = match row.get::<_, &str>(0) {
        "new" => Outcome::New,
        "replay" => Outcome::Replay,
        "in_progress" => Outcome::InProgress,
        _ => Outcome::Mismatch,
    };
    Ok(Claim {
        outcome,
        token: row.get(1),
        response: row.get(2),
        response_status: row.get(3),
        retry_after: row.get(4),
        expires_at: row.get(5),
        recovery_point: row.get(6),
    })
}

/// The HTTP answer for `replay`, `in_progress` and `mismatch` (never called for `new`).
pub async fn answer<C: GenericClient + Sync>(db: &C, ctx: &IdemRequest, c: &Claim) -> Response {
    let mut echo = Echo {
        key: ctx.echo.key.clone(),
        expires: c.expires_at,
        ..Echo::default()
    };
    match c.outcome {
        Outcome::Replay => {
            echo.replayed = true;
            let status = c
                .response_status
                .and_then(|s| u16::try_from(s).ok())
                .and_then(|s| StatusCode::from_u16(s).ok())
                .unwrap_or(StatusCode::OK);
            finish(stored(status, c.response.clone()), &echo)
        }
        Outcome::InProgress => {
            let secs = c.retry_after.unwrap_or(1).max(1);
            echo.retry_after = Some(secs as u64);
            let r = problem(
                StatusCode::CONFLICT,
                "request-outstanding",
                "A request is outstanding for this Idempotency-Key",
                &format!(
                    "The first request with this key is still being processed; retry in {secs} s"
                ),
            );
            finish(r, &echo)
        }
        Outcome::Mismatch => {
            // claim does not return expires_at for a mismatch: the stored row tells how long the
            // key stays taken.
            echo.expires = lookup_expires(db, ctx).await.ok().flatten();
            let r = problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "key-reused",
                "Idempotency-Key is already used",
                "This key was used for a different request (method, path, query or body); use a new key for a new request",
            );
            finish(r, &echo)
        }
        Outcome::New => finish(
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal error",
                "unexpected outcome",
            ),
            &echo,
        ),
    }
}

async fn lookup_expires<C: GenericClient + Sync>(
    db: &C,
    ctx: &IdemRequest,
) -> Result<Option<SystemTime>, tokio_postgres::Error> {
    let row = db
        .query_one(
            "SELECT (idempotency.lookup($1, $2)).expires_at",
            &[&ctx.key, &ctx.scope],
        )
        .await?;
    Ok(row.get(0))
}

/// Stores the response: `idempotency.complete(key, body::jsonb, status, scope, token, ttl)`.
/// `body` is JSON text; the answer is the stored form (`jsonb::text`, what every replay sends)
/// and the record's new `expires_at`.
const COMPLETE: &str = "SELECT $1::text::jsonb::text, \
     idempotency.complete($2, $1::text::jsonb, $3, scope => $4, token => $5, \
                          ttl => make_interval(secs => $6::float8))";

/// `idempotency.complete`; `ttl_secs` `None` is the extension's default TTL.
pub async fn complete<C: GenericClient + Sync>(
    db: &C,
    key: &str,
    scope: &str,
    token: Option<i64>,
    status: i32,
    body: &str,
    ttl_secs: Option<f64>,
) -> Result<(String, SystemTime), tokio_postgres::Error> {
    let row = db
        .query_one(COMPLETE, &[&body, &key, &status, &scope, &token, &ttl_secs])
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// `idempotency.release(key, scope, token)`: false when there was nothing to release or the
/// token is stale.
pub async fn release<C: GenericClient + Sync>(
    db: &C,
    key: &str,
    scope: &str,
    token: Option<i64>,
) -> Result<bool, tokio_postgres::Error> {
    let row = db
        .query_one(
            "SELECT idempotency.release($1, scope => $2, token => $3)",
            &[&key, &scope, &token],
        )
        .await?;
    Ok(row.get(0))
}

/// `idempotency.checkpoint(key, recovery_point, scope, token)`.
pub async fn checkpoint<C: GenericClient + Sync>(
    db: &C,
    key: &str,
    scope: &str,
    token: Option<i64>,
    recovery_point: &str,
) -> Result<(), tokio_postgres::Error> {
    db.execute(
        "SELECT idempotency.checkpoint($1, $2, scope => $3, token => $4)",
        &[&key, &recovery_point, &scope, &token],
    )
    .await?;
    Ok(())
}

/// An error after which the same statement may succeed on a new connection: the connection was
/// lost (no SQLSTATE), the server is shutting down or starting (class 57P), a connection
/// exception (class 08).
pub fn is_transient(e: &tokio_postgres::Error) -> bool {
    match sqlstate(e) {
        None => true,
        Some(c) => c.starts_with("57P") || c.starts_with("08"),
    }
}

/// `complete` or `checkpoint` was refused because another worker took the key over (IK003) or
/// finished it (IK002): the store holds the answer, this worker was fenced off.
pub fn is_fenced_off(e: &tokio_postgres::Error) -> bool {
    matches!(sqlstate(e), Some("IK002" | "IK003"))
}

/// A database error for the log: SQLSTATE and message.
pub fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{} {}", d.code().code(), d.message()),
        None => e.to_string(),
    }
}

/// SQLSTATE of a database error, if it is one.
pub fn sqlstate(e: &tokio_postgres::Error) -> Option<&str> {
    e.code().map(|c| c.code())
}

/// The message of a database error with its DETAIL, if any.
fn message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => match d.detail() {
            Some(detail) => format!("{}: {detail}", d.message()),
            None => d.message().to_string(),
        },
        None => e.to_string(),
    }
}

/// Maps a database error to a problem response: the extension's argument errors (22023) are the
/// client's fault, so is a body that jsonb refuses, conflicts (40001) are retryable, anything
/// else is ours.
///
/// The request body is the only text of the client's that a statement turns into jsonb (first
/// in the claim, so nothing is stored for such a request), and its checked fields are cast only
/// after that: so a failed jsonb input is the body's. 22P02 is text that is not JSON to
/// PostgreSQL (a lone surrogate `\ud800`); the others are JSON that it cannot take: 22P05
/// `\u0000`, 22003 a number beyond `numeric`, 54001 nesting deeper than the fingerprint's
/// canonical hashing (1000 levels) or the server's stack takes, 54000 a value over a jsonb size
/// limit. Retrying cannot help: 400 or 422, never 503.
pub fn db_error(e: &tokio_postgres::Error, echo: &Echo) -> Response {
    let r = match sqlstate(e) {
        Some("22P02") => problem(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "Bad request",
            &format!(
                "the body is not JSON that PostgreSQL accepts: {}",
                message(e)
            ),
        ),
        Some("22P05" | "22003" | "54001" | "54000") => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "body-unstorable",
            "The body cannot be stored",
            &format!(
                "the body is JSON, but PostgreSQL cannot take it: {}",
                message(e)
            ),
        ),
        Some("22023") | Some("22004") => problem(
            StatusCode::BAD_REQUEST,
            "key-malformed",
            "Idempotency-Key is malformed",
            e.as_db_error()
                .map(|d| d.message())
                .unwrap_or("invalid key"),
        ),
        Some("40001") | Some("40P01") => {
            let mut r = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "conflict-retry",
                "Concurrent update, retry",
                "the request conflicted with a concurrent one; retry with the same key",
            );
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(1),
            );
            r
        }
        _ => {
            eprintln!("database error: {}", describe(e));
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "database",
                "Database unavailable",
                "retry with the same Idempotency-Key",
            )
        }
    };
    finish(r, echo)
}
