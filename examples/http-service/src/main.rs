//! An HTTP service that follows the IETF Idempotency-Key draft, backed by the `idempotency`
//! PostgreSQL extension. See README.md beside this file.
//!
//! Configuration (environment):
//!   DATABASE_URL          libpq-style conninfo or postgres:// URL (required), as the
//!                         application role created by setup.sql
//!   LISTEN                address to listen on (default 127.0.0.1:8080)
//!   PAYMENT_URL           base URL of the payment service (default http://127.0.0.1:8081)
//!   POOL_SIZE             database connections (default 16)
//!   IDEMPOTENCY_TTL_SECS  how long a key is remembered (default 86400)
//!   ORDER_LEASE_SECS      lease of an order claim (default 10)
//!   CLAIM_WAIT_MS         how long a duplicate order waits for the first one's transaction
//!                         before it answers 409 (default 2000)
//!   REFUND_LEASE_SECS     lease of a refund claim; a crashed worker's refund is resumed after it
//!                         (default 60)
//!   PROVIDER_TIMEOUT_MS   timeout of a payment call, below the refund lease (default 10000)
//!   TEST_HOOKS=1          honour X-Test-Delay-Ms (tests only)

mod http;
mod orders;
mod provider;
mod refunds;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;

pub struct Config {
    pub ttl_secs: f64,
    pub order_lease_secs: f64,
    pub refund_lease_secs: f64,
    pub claim_wait_ms: u64,
    pub test_hooks: bool,
}

pub struct App {
    pub pool: Pool,
    pub provider: provider::Provider,
    pub cfg: Config,
}

fn env_num<T: FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| format!("{name}={v:?} is not a valid number")),
        Err(_) => Ok(default),
    }
}

fn build() -> Result<(App, String), String> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set".to_string())?;
    let pg = tokio_postgres::Config::from_str(&url).map_err(|e| format!("DATABASE_URL: {e}"))?;
    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let payment = std::env::var("PAYMENT_URL").unwrap_or_else(|_| "http://127.0.0.1:8081".into());
    let pool_size: usize = env_num("POOL_SIZE", 16)?;
    let cfg = Config {
        ttl_secs: env_num("IDEMPOTENCY_TTL_SECS", 86_400.0)?,
        order_lease_secs: env_num("ORDER_LEASE_SECS", 10.0)?,
        refund_lease_secs: env_num("REFUND_LEASE_SECS", 60.0)?,
        claim_wait_ms: env_num("CLAIM_WAIT_MS", 2000)?,
        test_hooks: std::env::var("TEST_HOOKS").is_ok_and(|v| v == "1"),
    };
    let timeout_ms: u64 = env_num("PROVIDER_TIMEOUT_MS", 10_000)?;
    if timeout_ms as f64 / 1000.0 >= cfg.refund_lease_secs {
        return Err(
            "PROVIDER_TIMEOUT_MS must be shorter than REFUND_LEASE_SECS: a call still \
                    running when its lease ends could be taken over while it is in flight"
                .into(),
        );
    }
    for (name, v) in [
        ("IDEMPOTENCY_TTL_SECS", cfg.ttl_secs),
        ("ORDER_LEASE_SECS", cfg.order_lease_secs),
        ("REFUND_LEASE_SECS", cfg.refund_lease_secs),
    ] {
        if !(v > 0.0 && v <= cfg.ttl_secs) {
            return Err(format!(
                "{name} must be positive and at most IDEMPOTENCY_TTL_SECS"
            ));
        }
    }
    let mgr = Manager::from_config(
        pg,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(mgr)
        .max_size(pool_size)
        .build()
        .map_err(|e| format!("pool: {e}"))?;
    let provider = provider::Provider::new(&payment, Duration::from_millis(timeout_ms));
    Ok((
        App {
            pool,
            provider,
            cfg,
        },
        listen,
    ))
}

pub fn pool_error(e: &deadpool_postgres::PoolError, echo: &http::Echo) -> Response {
    eprintln!("database pool: {e}");
    let mut r = http::problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "database",
        "Database unavailable",
        "retry with the same Idempotency-Key",
    );
    r.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        axum::http::HeaderValue::from(1),
    );
    http::finish(r, echo)
}

/// Runs a handler's work in a task of its own, so that it is not cancelled when the client
/// disconnects.
pub async fn detached<F, Fut>(ctx: http::Ctx, work: F) -> Response
where
    F: FnOnce(http::Ctx) -> Fut,
    Fut: std::future::Future<Output = Response> + Send + 'static,
{
    let echo = http::Echo {
        key: ctx.echo.key.clone(),
        ..http::Echo::default()
    };
    match tokio::spawn(work(ctx)).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("handler task failed: {e}");
            let r = http::problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal error",
                "retry with the same Idempotency-Key",
            );
            http::finish(r, &echo)
        }
    }
}

/// Ready when the database answers.
async fn health(State(app): State<Arc<App>>) -> Response {
    match app.pool.get().await {
        Ok(c) => match c.query_one("SELECT 1", &[]).await {
            Ok(_) => (StatusCode::OK, "ok\n").into_response(),
            Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response(),
        },
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response(),
    }
}

async fn not_found() -> Response {
    http::problem(
        StatusCode::NOT_FOUND,
        "not-found",
        "Not found",
        "POST /orders and POST /refunds are the routes of this service",
    )
}

#[tokio::main]
async fn main() {
    let (app, listen) = match build() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("http-service: {e}");
            std::process::exit(2);
        }
    };
    let refunds = post(refunds::create).route_layer(refunds::layer(app.pool.clone(), &app.cfg));
    let router = Router::new()
        .route("/orders", post(orders::create))
        .route("/refunds", refunds)
        .route("/health", get(health))
        .fallback(not_found)
        .with_state(Arc::new(app));
    let listener = match tokio::net::TcpListener::bind(&listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("http-service: cannot listen on {listen}: {e}");
            std::process::exit(2);
        }
    };
    eprintln!("http-service: listening on {listen}");
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    if let Err(e) = axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
    {
        eprintln!("http-service: {e}");
        std::process::exit(1);
    }
}
