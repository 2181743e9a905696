//! Calls into the extension's SQL API: claim with the request fingerprint, complete, release,
//! and the HTTP answer for each outcome other than `new`. No hashing, expiry or fencing here:
//! all of that is the extension's.
//!
//! Every statement is sent as an unnamed statement, parsed, bound and run in one round trip
//! (`query_typed`): nothing named outlives it on the server, so the functions work on any
//! connection, one that a transaction-mode pooler (PgBouncer) hands to another client between
//! transactions included. The layer can use cached prepared statements instead
//! ([`crate::IdempotencyLayer::prepared_statements`]).

use std::future::Future;
use std::time::SystemTime;

use axum::http::StatusCode;
use axum::response::Response;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{GenericClient, Row};

use crate::otel::Op;
use crate::request::IdemRequest;
use crate::response::{default_replay_headers, finish, problem, replayed, Echo};

/// A statement's parameters, each with the type the server is told it has.
pub(crate) type Params<'a> = [(&'a (dyn ToSql + Sync), Type)];

/// How a statement reaches the server.
pub(crate) trait Exec: Sync {
    fn rows<'a>(
        &'a self,
        sql: &'a str,
        params: &'a Params<'a>,
    ) -> impl Future<Output = Result<Vec<Row>, tokio_postgres::Error>> + Send + 'a;

    fn one<'a>(
        &'a self,
        sql: &'a str,
        params: &'a Params<'a>,
    ) -> impl Future<Output = Result<Row, tokio_postgres::Error>> + Send + 'a;
}

/// Unnamed statements in one round trip: Parse, Bind, Execute and Sync go out together, so a
/// transaction-mode pooler cannot hand the Bind to another server connection than the Parse,
/// and no statement name is left behind on the server connection.
pub(crate) struct Unnamed<'c, C>(pub &'c C);

impl<C: GenericClient + Sync> Exec for Unnamed<'_, C> {
    async fn rows<'a>(
        &'a self,
        sql: &'a str,
        params: &'a Params<'a>,
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        self.0.query_typed(sql, params).await
    }

    async fn one<'a>(
        &'a self,
        sql: &'a str,
        params: &'a Params<'a>,
    ) -> Result<Row, tokio_postgres::Error> {
        self.0.query_typed_one(sql, params).await
    }
}

/// A pooled connection of the layer's: unnamed statements, or (`prepared`) statements prepared
/// once per connection and cached by deadpool, for a direct connection or a pooler that keeps
/// prepared statements per client (PgBouncer 1.21+ with `max_prepared_statements`, session mode).
pub(crate) struct Pooled<'c> {
    pub client: &'c deadpool_postgres::ClientWrapper,
    pub prepared: bool,
}

impl Exec for Pooled<'_> {
    async fn rows<'a>(
        &'a self,
        sql: &'a str,
        params: &'a Params<'a>,
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        if self.prepared {
            let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
            let stmt = self.client.prepare_typed_cached(sql, &types).await?;
            let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
            self.client.query(&stmt, &values).await
        } else {
            Unnamed(&**self.client).rows(sql, params).await
        }
    }

    async fn one<'a>(
        &'a self,
        sql: &'a str,
        params: &'a Params<'a>,
    ) -> Result<Row, tokio_postgres::Error> {
        if self.prepared {
            let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
            let stmt = self.client.prepare_typed_cached(sql, &types).await?;
            let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
            self.client.query_one(&stmt, &values).await
        } else {
            Unnamed(&**self.client).one(sql, params).await
        }
    }
}

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
/// `claim` hashes the jsonb it is given, so it gets the fingerprint as a hex string. The body is
/// a JSON body as jsonb, any other as `{"sha256": "<hex of its bytes>"}`, an empty one NULL: the
/// same fingerprint as the Python and Node clients give the same request.
const CLAIM: &str = "
SELECT c.outcome::text, c.token, c.response::text, c.response_status,
       ceil(extract(epoch FROM c.retry_after))::int, c.expires_at, c.recovery_point
  FROM idempotency.claim(
           $1,
           request => to_jsonb(encode(idempotency.request_fingerprint(
                          $2, $3, $4::text::jsonb,
                          CASE WHEN $9::bytea IS NOT NULL
                               THEN jsonb_build_object('sha256', encode(sha256($9::bytea), 'hex'))
                               ELSE NULLIF($5::text, '')::jsonb END), 'hex')),
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
    let op = Op::claim(&ctx.scope, &ctx.key);
    let c = op.result(claim_via(&Unnamed(db), ctx, ttl_secs, lease_secs).await)?;
    op.claimed(&c);
    Ok(c)
}

pub(crate) async fn claim_via(
    db: &impl Exec,
    ctx: &IdemRequest,
    ttl_secs: f64,
    lease_secs: f64,
) -> Result<Claim, tokio_postgres::Error> {
    let row = db
        .one(
            CLAIM,
            &[
                (&ctx.key, Type::TEXT),
                (&ctx.method, Type::TEXT),
                (&ctx.path, Type::TEXT),
                (&ctx.query, Type::TEXT),
                (&ctx.body, Type::TEXT),
                (&ctx.scope, Type::TEXT),
                (&ttl_secs, Type::FLOAT8),
                (&lease_secs, Type::FLOAT8),
                (&ctx.body_bytes, Type::BYTEA),
            ],
        )
        .await?;
    Ok(claim_of(&row))
}

fn claim_of(row: &tokio_postgres::Row) -> Claim {
    let outcome = match row.get::<_, &str>(0) {
        "new" => Outcome::New,
        "replay" => Outcome::Replay,
        "in_progress" => Outcome::InProgress,
        _ => Outcome::Mismatch,
    };
    Claim {
        outcome,
        token: row.get(1),
        response: row.get(2),
        response_status: row.get(3),
        retry_after: row.get(4),
        expires_at: row.get(5),
        recovery_point: row.get(6),
    }
}

const CLAIM_MANY: &str = "
SELECT c.outcome::text, c.token, c.response::text, c.response_status,
       ceil(extract(epoch FROM c.retry_after))::int, c.expires_at, c.recovery_point
  FROM idempotency.claim_many(
           $1::text[],
           requests => $2::text[]::jsonb[],
           scope    => $3,
           ttl      => make_interval(secs => $4::float8),
           lease    => make_interval(secs => $5::float8)) c
 ORDER BY c.ord";

/// `idempotency.claim_many(keys, requests, scope, ttl, lease)`: a batch of keys claimed in one
/// statement, for a handler that receives many items at once (a webhook delivery carrying a
/// batch of events, each with its own id). One [`Claim`] per key, in the order of `keys`, each
/// what `claim` would answer for that key alone; a key repeated within the batch is
/// `InProgress` at its later positions (`Mismatch` with a different request). `requests` are
/// JSON texts (`None`: no request check for any key; a `None` element: none for that key);
/// `ttl_secs`/`lease_secs` `None` are the extension's defaults.
pub async fn claim_many<C: GenericClient + Sync>(
    db: &C,
    keys: &[&str],
    requests: Option<&[Option<&str>]>,
    scope: &str,
    ttl_secs: Option<f64>,
    lease_secs: Option<f64>,
) -> Result<Vec<Claim>, tokio_postgres::Error> {
    let rows = Unnamed(db)
        .rows(
            CLAIM_MANY,
            &[
                (&keys, Type::TEXT_ARRAY),
                (&requests, Type::TEXT_ARRAY),
                (&scope, Type::TEXT),
                (&ttl_secs, Type::FLOAT8),
                (&lease_secs, Type::FLOAT8),
            ],
        )
        .await?;
    Ok(rows.iter().map(claim_of).collect())
}

const COMPLETE_MANY: &str = "
SELECT t.e
  FROM idempotency.complete_many(
           $1::text[], $2::text[]::jsonb[],
           response_statuses => $3::int[],
           scope  => $4,
           tokens => $5::bigint[],
           ttl    => make_interval(secs => $6::float8)) WITH ORDINALITY AS t(e, i)
 ORDER BY t.i";

/// `idempotency.complete_many(keys, bodies, statuses, scope, tokens, ttl)`: stores each key's
/// JSON body and status in one statement; returns each new `expires_at` in the order of `keys`.
/// All or nothing: if one key's claim is gone, completed or taken over, the error is that key's
/// (`IK001`..`IK003`, [`is_fenced_off`] for the last two) and nothing is stored. `statuses`
/// `None`: 200 each; `tokens` `None` (or a `None` element): no token check.
pub async fn complete_many<C: GenericClient + Sync>(
    db: &C,
    keys: &[&str],
    bodies: &[Option<&str>],
    statuses: Option<&[i32]>,
    scope: &str,
    tokens: Option<&[Option<i64>]>,
    ttl_secs: Option<f64>,
) -> Result<Vec<SystemTime>, tokio_postgres::Error> {
    let rows = Unnamed(db)
        .rows(
            COMPLETE_MANY,
            &[
                (&keys, Type::TEXT_ARRAY),
                (&bodies, Type::TEXT_ARRAY),
                (&statuses, Type::INT4_ARRAY),
                (&scope, Type::TEXT),
                (&tokens, Type::INT8_ARRAY),
                (&ttl_secs, Type::FLOAT8),
            ],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The HTTP answer for `replay`, `in_progress` and `mismatch` (never called for `new`); a replay
/// carries the default allow-list of headers ([`crate::response::REPLAY_HEADERS`]).
pub async fn answer<C: GenericClient + Sync>(db: &C, ctx: &IdemRequest, c: &Claim) -> Response {
    answer_with(db, ctx, c, &default_replay_headers()).await
}

/// [`answer`], a replay carrying `Content-Type` and the headers of `replay_headers`.
pub async fn answer_with<C: GenericClient + Sync>(
    db: &C,
    ctx: &IdemRequest,
    c: &Claim,
    replay_headers: &[axum::http::HeaderName],
) -> Response {
    answer_via(&Unnamed(db), ctx, c, replay_headers).await
}

pub(crate) async fn answer_via(
    db: &impl Exec,
    ctx: &IdemRequest,
    c: &Claim,
    replay_headers: &[axum::http::HeaderName],
) -> Response {
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
            finish(
                replayed(status, c.response.as_deref(), replay_headers),
                &echo,
            )
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

async fn lookup_expires(
    db: &impl Exec,
    ctx: &IdemRequest,
) -> Result<Option<SystemTime>, tokio_postgres::Error> {
    let row = db
        .one(
            "SELECT (idempotency.lookup($1, $2)).expires_at",
            &[(&ctx.key, Type::TEXT), (&ctx.scope, Type::TEXT)],
        )
        .await?;
    Ok(row.get(0))
}

/// The live record's expiry if it is completed under `token`: a `complete` with this token
/// committed (a takeover would have issued a larger one). For a completion retried after its
/// connection broke, whose first try may have committed before the answer was lost.
pub(crate) async fn completed_with(
    db: &impl Exec,
    key: &str,
    scope: &str,
    token: Option<i64>,
) -> Result<Option<SystemTime>, tokio_postgres::Error> {
    let rows = db
        .rows(
            "SELECT k.expires_at FROM idempotency.lookup($1, $2) k \
              WHERE k.status = 'completed' AND k.token IS NOT DISTINCT FROM $3",
            &[
                (&key, Type::TEXT),
                (&scope, Type::TEXT),
                (&token, Type::INT8),
            ],
        )
        .await?;
    Ok(rows.first().map(|r| r.get(0)))
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
    let op = Op::complete(scope, key, token);
    op.result(complete_via(&Unnamed(db), key, scope, token, status, body, ttl_secs).await)
}

pub(crate) async fn complete_via(
    db: &impl Exec,
    key: &str,
    scope: &str,
    token: Option<i64>,
    status: i32,
    body: &str,
    ttl_secs: Option<f64>,
) -> Result<(String, SystemTime), tokio_postgres::Error> {
    let row = db
        .one(
            COMPLETE,
            &[
                (&body, Type::TEXT),
                (&key, Type::TEXT),
                (&status, Type::INT4),
                (&scope, Type::TEXT),
                (&token, Type::INT8),
                (&ttl_secs, Type::FLOAT8),
            ],
        )
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
    let op = Op::release(scope, key, token);
    let released = op.result(release_via(&Unnamed(db), key, scope, token).await)?;
    op.released(released);
    Ok(released)
}

pub(crate) async fn release_via(
    db: &impl Exec,
    key: &str,
    scope: &str,
    token: Option<i64>,
) -> Result<bool, tokio_postgres::Error> {
    let row = db
        .one(
            "SELECT idempotency.release($1, scope => $2, token => $3)",
            &[
                (&key, Type::TEXT),
                (&scope, Type::TEXT),
                (&token, Type::INT8),
            ],
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
    let op = Op::checkpoint(scope, key, token);
    op.result(
        Unnamed(db)
            .rows(
                "SELECT idempotency.checkpoint($1, $2, scope => $3, token => $4)",
                &[
                    (&key, Type::TEXT),
                    (&recovery_point, Type::TEXT),
                    (&scope, Type::TEXT),
                    (&token, Type::INT8),
                ],
            )
            .await,
    )?;
    Ok(())
}

/// An error after which the same statement may succeed on a new connection: the connection was
/// lost (no SQLSTATE: closed, reset, an io error), the server is shutting down or starting or
/// the session was ended (57P01..57P03, 57P05), a connection exception (class 08, which is also
/// what PgBouncer sends for its own failures: `server conn crashed?`, `client_idle_timeout`,
/// `query_wait_timeout`, ...), or too many connections (53300).
pub fn is_transient(e: &tokio_postgres::Error) -> bool {
    match sqlstate(e) {
        None => true,
        Some(c) => {
            c.starts_with("08") || matches!(c, "57P01" | "57P02" | "57P03" | "57P05" | "53300")
        }
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
