//! `POST /orders`: the one-transaction style. The claim, the order row and the stored response
//! commit together or not at all: if anything fails (or the process dies) before the commit, the
//! claim vanishes with the transaction and the client's retry runs as new.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::Response;

use crate::http::{finish, prelude, problem, stored, Ctx, Echo};
use crate::App;
use idempotency_axum::body::{self, Members};
use idempotency_axum::store::{self as idem, Outcome};

/// Inserts the order and completes the key in one statement; the body is built by PostgreSQL so
/// that the first answer and every replay are the same bytes (`jsonb::text`).
const INSERT_AND_COMPLETE: &str = "
WITH r AS (SELECT $2::text::jsonb AS b),
o AS (
    INSERT INTO http_example.orders (client_id, items, amount, currency)
    SELECT $1, r.b -> 'items', (r.b ->> 'amount')::numeric, r.b ->> 'currency' FROM r
    RETURNING id, items, amount, currency, created_at
),
body AS (
    SELECT jsonb_build_object('order_id', id, 'items', items, 'amount', amount,
                              'currency', currency, 'created_at', created_at) AS b
      FROM o
)
SELECT body.b::text, idempotency.complete($3, body.b, 201, scope => $4, token => $5)
  FROM body";

pub async fn create(
    State(app): State<Arc<App>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let ctx = match prelude("POST", "/orders", &uri, &headers, &body, app.cfg.test_hooks) {
        Ok(c) => c,
        Err(r) => return r,
    };
    if let Err(detail) = validate(&ctx.members) {
        let r = problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-order",
            "Invalid order",
            &detail,
        );
        return finish(r, &ctx.echo);
    }
    // The work runs in its own task, to the end, even if the client hangs up: its retry then
    // finds the answer stored instead of a transaction cancelled half-way.
    crate::detached(ctx, move |ctx| async move {
        // A serialization failure (40001) under a storm of claims is retried, with the same key.
        let mut attempt = 0;
        loop {
            attempt += 1;
            match run(&app, &ctx).await {
                Err(e) if idem::sqlstate(&e) == Some("40001") && attempt < 5 => continue,
                Err(e) => return idem::db_error(&e, &ctx.echo),
                Ok(r) => return r,
            }
        }
    })
    .await
}

async fn run(app: &App, ctx: &Ctx) -> Result<Response, tokio_postgres::Error> {
    let mut client = match app.pool.get().await {
        Ok(c) => c,
        Err(e) => return Ok(crate::pool_error(&e, &ctx.echo)),
    };
    let tx = client.transaction().await?;
    // Duplicates that arrive while the first request's transaction is open wait for it (up to
    // claim_wait) and then replay its answer instead of getting 409.
    tx.batch_execute(&format!(
        "SET LOCAL idempotency.claim_wait = '{}ms'",
        app.cfg.claim_wait_ms
    ))
    .await?;
    let c = idem::claim(&*tx, ctx, app.cfg.ttl_secs, app.cfg.order_lease_secs).await?;
    if c.outcome != Outcome::New {
        let r = idem::answer(&*tx, ctx, &c).await;
        tx.commit().await?;
        return Ok(r);
    }
    if let Some(d) = ctx.test_delay {
        tokio::time::sleep(d).await; // test hook: a slow handler, inside the open transaction
    }
    let row = tx
        .query_one(
            INSERT_AND_COMPLETE,
            &[&ctx.client, &ctx.body, &ctx.key, &ctx.scope, &c.token],
        )
        .await?;
    let body: String = row.get(0);
    let expires = row.get(1);
    tx.commit().await?;
    let echo = Echo {
        key: ctx.echo.key.clone(),
        expires: Some(expires),
        ..Echo::default()
    };
    Ok(finish(stored(StatusCode::CREATED, Some(body)), &echo))
}

/// `{"items": [...], "amount": <number > 0>, "currency": "EUR"}`.
fn validate(m: &Members) -> Result<(), String> {
    let o = m.as_ref().ok_or("the body must be a JSON object")?;
    if !o.get("items").is_some_and(|v| body::is_non_empty_array(v)) {
        return Err("items must be a non-empty array".into());
    }
    if !o.get("amount").is_some_and(|v| body::is_positive_number(v)) {
        return Err("amount must be a number greater than 0".into());
    }
    crate::refunds::check_currency(o.get("currency").map(|v| &**v))
}
