//! `POST /refunds`: the leased style, for a side effect outside the database.
//!
//! 1. claim with a lease, committed at once: `idempotency_axum::IdempotencyLayer` around the
//!    route does it (and the client's scope, the checks before the claim, the answers for replay,
//!    in_progress and mismatch); the handler gets the claim's token;
//! 2. checkpoint "provider-call:<derived key>" and call the payment service with
//!    `idempotency.derive_key(<scope>/<key>, 'refund', params)` as its Idempotency-Key;
//! 3. in a second transaction insert the refund row and `complete` with the token.
//!
//! If this process dies anywhere in between, the claim stays `in_progress` (retries get 409)
//! until its lease runs out; the next retry then takes the key over (a larger token, the
//! recovery point returned) and calls the payment service again with the same derived key, which
//! the payment service deduplicates: the refund happens once. A stale worker that wakes up late
//! is refused by `complete` (IK003) and answers with what the store holds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::Response;
use axum::Extension;
use deadpool_postgres::Pool;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::http::{
    client_id, finish, problem, problem_json, stored, test_delay, unauthenticated, Ctx, Echo,
};
use crate::provider::CallError;
use crate::{App, Config};
use idempotency_axum::body::{self, Members};
use idempotency_axum::store::{self as idem, Outcome};
use idempotency_axum::{Claimed, Disposition, IdempotencyLayer};

/// The order (it must be the client's), whether the amount fits, the provider's key and body.
const PREPARE: &str = "
WITH r AS (SELECT $2::text::jsonb AS b),
p AS (SELECT CASE WHEN length($3) <= 200 THEN $3
                  ELSE 'sha256:' || encode(sha256(convert_to($3, 'UTF8')), 'hex') END AS parent),
q AS (
    SELECT o.id, o.currency, o.amount AS order_amount, (r.b ->> 'amount')::numeric AS amount
      FROM r, http_example.orders o
     WHERE o.id = (r.b ->> 'order_id')::bigint AND o.client_id = $1
)
SELECT q.amount <= q.order_amount,
       idempotency.derive_key(p.parent, 'refund',
           jsonb_build_object('order_id', q.id, 'amount', q.amount, 'currency', q.currency)),
       jsonb_build_object('order_id', q.id, 'amount', q.amount, 'currency', q.currency)::text,
       q.currency
  FROM q, p";

const INSERT_AND_COMPLETE: &str = "
WITH r AS (SELECT $2::text::jsonb AS b),
ins AS (
    INSERT INTO http_example.refunds
           (order_id, client_id, amount, currency, provider_key, provider_refund_id)
    SELECT (r.b ->> 'order_id')::bigint, $1, (r.b ->> 'amount')::numeric, $3, $4, $5 FROM r
    RETURNING id, order_id, amount, currency, provider_refund_id, created_at
),
body AS (
    SELECT jsonb_build_object('refund_id', id, 'order_id', order_id, 'amount', amount,
                              'currency', currency, 'provider_refund_id', provider_refund_id,
                              'created_at', created_at) AS b
      FROM ins
)
SELECT body.b::text, idempotency.complete($6, body.b, 201, scope => $7, token => $8)
  FROM body";

const COMPLETE: &str = "SELECT $1::text::jsonb::text, \
     idempotency.complete($2, $1::text::jsonb, $3, scope => $4, token => $5)";

/// The layer around `POST /refunds`: the client's scope (401 without a client), the refund's
/// checks before the claim (422, nothing stored), the claim with the refund lease, the answers
/// for replay, in_progress and mismatch, and a task of its own for the handler, which runs to
/// the end even if the client hangs up (a cancelled worker would leave the claim to wait for its
/// lease).
#[allow(clippy::result_large_err)] // the refusals are axum Responses
pub fn layer(pool: Pool, cfg: &Config) -> IdempotencyLayer {
    IdempotencyLayer::new(pool)
        .ttl(Duration::from_secs_f64(cfg.ttl_secs))
        .lease(Duration::from_secs_f64(cfg.refund_lease_secs))
        .methods([Method::POST])
        // axum's default limit for a body read by an extractor, as for POST /orders.
        .body_limit(2 * 1024 * 1024)
        .scope(|parts| match client_id(&parts.headers) {
            Some(client) => Ok(format!("{client}:POST /refunds")),
            None => Err(unauthenticated()),
        })
        .check(|req| {
            validate(&body::parse(&req.body).unwrap_or(None)).map_err(|detail| {
                problem(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "invalid-refund",
                    "Invalid refund",
                    &detail,
                )
            })
        })
}

/// Runs once the layer has claimed the key (`new`). Every answer says what becomes of the
/// claim: this handler completes the key itself (the refund row and the stored answer in one
/// transaction) or leaves it for a retry to take over, so the layer keeps it as it is, except
/// where nothing has happened yet and the key is given back.
pub async fn create(
    State(app): State<Arc<App>>,
    Extension(claimed): Extension<Claimed>,
    headers: HeaderMap,
) -> Response {
    let ctx = Ctx {
        members: body::parse(&claimed.request.body).unwrap_or(None),
        client: client_id(&headers).unwrap_or_default(),
        req: claimed.request.clone(),
        test_delay: test_delay(&headers, app.cfg.test_hooks),
    };
    let mut client = match app.pool.get().await {
        Ok(c) => c,
        // Nothing happened yet: the key is given back.
        Err(e) => return with(crate::pool_error(&e, &ctx.echo), Disposition::Release),
    };
    // Every other answer leaves the claim as this handler left it: completed, released, or in
    // progress for a retry to take over.
    let r = match run(&app, &ctx, &claimed, &mut client).await {
        Ok(r) => r,
        Err(e) => idem::db_error(&e, &ctx.echo),
    };
    if r.extensions().get::<Disposition>().is_some() {
        return r;
    }
    with(r, Disposition::Keep)
}

fn with(mut r: Response, d: Disposition) -> Response {
    r.extensions_mut().insert(d);
    r
}

/// A database error before the payment service was called: the layer gives the key back.
fn released(e: &tokio_postgres::Error, ctx: &Ctx) -> Response {
    with(idem::db_error(e, &ctx.echo), Disposition::Release)
}

async fn run(
    app: &App,
    ctx: &Ctx,
    c: &Claimed,
    client: &mut deadpool_postgres::Object,
) -> Result<Response, tokio_postgres::Error> {
    // 1. The layer claimed with a lease, autocommitted: every retry sees the claim at once.
    let lease = app.cfg.refund_lease_secs;
    let started = Instant::now();
    let token = c.token;
    if let Some(rp) = &c.recovery_point {
        eprintln!(
            "taking over {} {:?} (token {:?}) from recovery point {rp:?}",
            ctx.scope, ctx.key, token
        );
    }
    let echo = Echo {
        key: ctx.echo.key.clone(),
        expires: c.expires_at,
        ..Echo::default()
    };

    // 2. The order, the provider's key and request.
    let parent = format!("{}/{}", ctx.scope, ctx.key);
    let prepared = client
        .query_opt(PREPARE, &[&ctx.client, &ctx.body, &parent])
        .await;
    let row = match prepared {
        Ok(r) => r,
        Err(e) => return Ok(released(&e, ctx)),
    };
    let Some(row) = row else {
        let doc = problem_json(
            StatusCode::NOT_FOUND,
            "order-not-found",
            "Order not found",
            "no order with this order_id belongs to this client",
        );
        return store_final(client, ctx, c, StatusCode::NOT_FOUND, &doc).await;
    };
    let within: bool = row.get(0);
    let provider_key: String = row.get(1);
    let provider_body: String = row.get(2);
    let currency: String = row.get(3);
    if !within {
        let doc = problem_json(
            StatusCode::UNPROCESSABLE_ENTITY,
            "amount-too-large",
            "Refund exceeds the order",
            "amount is larger than the order's amount",
        );
        return store_final(client, ctx, c, StatusCode::UNPROCESSABLE_ENTITY, &doc).await;
    }
    let rp = format!("provider-call:{provider_key}");
    if let Err(e) = client
        .execute(
            "SELECT idempotency.checkpoint($1, $2, scope => $3, token => $4)",
            &[&ctx.key, &rp, &ctx.scope, &token],
        )
        .await
    {
        if !matches!(idem::sqlstate(&e), Some("IK002" | "IK003")) {
            return Ok(released(&e, ctx)); // the provider was not called yet
        }
        return fenced_off(client, app, ctx, e).await;
    }

    // 3. The side effect, deduplicated by the provider through the derived key.
    if let Some(d) = ctx.test_delay {
        tokio::time::sleep(d).await; // test hook: a slow worker, lease held, nothing done yet
    }
    match app.provider.refund(&provider_key, provider_body).await {
        Ok((status, answer)) if status.is_success() => {
            let refund_id = serde_json::from_slice::<Value>(&answer)
                .ok()
                .and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_string));
            let Some(refund_id) = refund_id else {
                return Ok(ambiguous(
                    ctx,
                    &echo,
                    started,
                    lease,
                    "the payment service's answer has no id",
                ));
            };
            // 4. The refund row and the stored response commit together, fenced by the token.
            let tx = client.transaction().await?;
            let done = tx
                .query_one(
                    INSERT_AND_COMPLETE,
                    &[
                        &ctx.client,
                        &ctx.body,
                        &currency,
                        &provider_key,
                        &refund_id,
                        &ctx.key,
                        &ctx.scope,
                        &token,
                    ],
                )
                .await;
            let row = match done {
                Ok(row) => row,
                Err(e) => {
                    drop(tx); // rolls back
                    return fenced_off(client, app, ctx, e).await;
                }
            };
            tx.commit().await?;
            let echo = Echo {
                expires: Some(row.get(1)),
                ..echo
            };
            Ok(finish(stored(StatusCode::CREATED, Some(row.get(0))), &echo))
        }
        Ok((status, answer)) if status.is_client_error() => {
            // A definitive refusal: stored, so every retry gets the same answer.
            let doc = problem_json(
                StatusCode::PAYMENT_REQUIRED,
                "refund-refused",
                "The payment service refused the refund",
                &format!(
                    "payment service answered {}: {}",
                    status.as_u16(),
                    String::from_utf8_lossy(&answer[..answer.len().min(300)])
                ),
            );
            store_final(client, ctx, c, StatusCode::PAYMENT_REQUIRED, &doc).await
        }
        Ok((status, _)) => Ok(ambiguous(
            ctx,
            &echo,
            started,
            lease,
            &format!("the payment service answered {}", status.as_u16()),
        )),
        Err(CallError::Ambiguous(why)) => Ok(ambiguous(ctx, &echo, started, lease, &why)),
        Err(CallError::Unreachable(why)) => {
            // Nothing was sent: give the key back, the next retry starts afresh.
            eprintln!("payment service unreachable: {why}");
            let r = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "provider-unreachable",
                "The payment service is unreachable",
                "nothing was refunded; retry with the same Idempotency-Key",
            );
            let r = finish(
                r,
                &Echo {
                    key: ctx.echo.key.clone(),
                    retry_after: Some(1),
                    ..Echo::default()
                },
            );
            Ok(with(r, Disposition::Release))
        }
    }
}

/// The payment service may or may not have refunded. The claim stays in progress with its
/// recovery point; once the lease runs out the client's retry takes it over and asks the
/// payment service again with the same key.
fn ambiguous(ctx: &Ctx, echo: &Echo, started: Instant, lease: f64, why: &str) -> Response {
    eprintln!(
        "payment call for {} {:?} is in doubt: {why}",
        ctx.scope, ctx.key
    );
    let left = Duration::from_secs_f64(lease).saturating_sub(started.elapsed());
    let secs = left.as_secs() + u64::from(left.subsec_nanos() > 0);
    let r = problem(
        StatusCode::BAD_GATEWAY,
        "provider-in-doubt",
        "The payment service did not confirm the refund",
        &format!(
            "the refund may or may not have been made; retry with the same Idempotency-Key after {} s: \
             the retry resumes with the same payment key and never refunds twice",
            secs.max(1)
        ),
    );
    finish(
        r,
        &Echo {
            key: echo.key.clone(),
            expires: echo.expires,
            retry_after: Some(secs.max(1)),
            replayed: false,
        },
    )
}

/// Completes the key with a final (error) answer and sends it.
async fn store_final(
    client: &tokio_postgres::Client,
    ctx: &Ctx,
    c: &Claimed,
    status: StatusCode,
    doc: &Value,
) -> Result<Response, tokio_postgres::Error> {
    let status_i = i32::from(status.as_u16());
    let row = client
        .query_one(
            COMPLETE,
            &[&doc.to_string(), &ctx.key, &status_i, &ctx.scope, &c.token],
        )
        .await?;
    let echo = Echo {
        key: ctx.echo.key.clone(),
        expires: Some(row.get(1)),
        ..Echo::default()
    };
    Ok(finish(stored(status, Some(row.get(0))), &echo))
}

/// `complete` or `checkpoint` refused us: another worker took the key over (IK003) or finished
/// it (IK002, or its refund row is there: 23505). Answer with what the store says now.
async fn fenced_off(
    client: &tokio_postgres::Client,
    app: &App,
    ctx: &Ctx,
    e: tokio_postgres::Error,
) -> Result<Response, tokio_postgres::Error> {
    if !matches!(idem::sqlstate(&e), Some("IK002" | "IK003" | "23505")) {
        return Err(e);
    }
    eprintln!(
        "{} {:?}: fenced off ({}), answering from the store",
        ctx.scope,
        ctx.key,
        idem::describe(&e)
    );
    let c = idem::claim(client, ctx, app.cfg.ttl_secs, app.cfg.refund_lease_secs).await?;
    if c.outcome == Outcome::New {
        // The other worker released it meanwhile; do not start over inside this request.
        release(client, ctx, c.token).await;
        let r = problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "retry",
            "Retry",
            "another worker gave this key up; retry with the same Idempotency-Key",
        );
        let r = finish(
            r,
            &Echo {
                key: ctx.echo.key.clone(),
                retry_after: Some(1),
                ..Echo::default()
            },
        );
        // Released above with the new token; the layer's release with ours does nothing, and
        // it sends no Idempotency-Expires for a key that is free.
        return Ok(with(r, Disposition::Release));
    }
    Ok(idem::answer(client, ctx, &c).await)
}

async fn release(client: &tokio_postgres::Client, ctx: &Ctx, token: Option<i64>) {
    if let Err(e) = client
        .execute(
            "SELECT idempotency.release($1, scope => $2, token => $3)",
            &[&ctx.key, &ctx.scope, &token],
        )
        .await
    {
        eprintln!("release of {} {:?} failed: {e}", ctx.scope, ctx.key);
    }
}

/// `{"order_id": <integer > 0>, "amount": <number > 0>}`.
fn validate(m: &Members) -> Result<(), String> {
    let o = m.as_ref().ok_or("the body must be a JSON object")?;
    match o.get("order_id").and_then(|v| body::integer(v)) {
        Some(id) if id > 0 => {}
        _ => return Err("order_id must be a positive integer".into()),
    }
    if !o.get("amount").is_some_and(|v| body::is_positive_number(v)) {
        return Err("amount must be a number greater than 0".into());
    }
    Ok(())
}

/// Three upper-case ASCII letters (ISO 4217 style).
pub fn check_currency(v: Option<&RawValue>) -> Result<(), String> {
    match v.and_then(body::string) {
        Some(c) if c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()) => Ok(()),
        _ => Err("currency must be three upper-case letters, e.g. \"EUR\"".into()),
    }
}
