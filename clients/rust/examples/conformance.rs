//! The conformance app (clients/conformance) on the axum layer. Environment: CONNINFO (a libpq
//! keyword string), PORT, WAIT, CONNECT_TIMEOUT, FAIL_OPEN. Routes: see clients/conformance.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use idempotency_axum::IdempotencyLayer;
use serde_json::json;
use tokio_postgres::NoTls;

type Runs = Arc<AtomicUsize>;

fn env_secs(name: &str, default: f64) -> Duration {
    let v = std::env::var(name).ok().and_then(|v| v.parse().ok());
    Duration::from_secs_f64(v.unwrap_or(default))
}

async fn orders(State(runs): State<Runs>, headers: HeaderMap) -> Response {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    let ms = headers
        .get("x-sleep-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    (
        StatusCode::CREATED,
        [
            ("location", format!("/orders/{n}")),
            ("etag", format!("\"v{n}\"")),
            ("set-cookie", format!("s={n}")),
            ("x-request-id", format!("r{n}")),
        ],
        Json(json!({ "run": n })),
    )
        .into_response()
}

async fn text(State(runs): State<Runs>, body: Bytes) -> Response {
    runs.fetch_add(1, Ordering::SeqCst);
    (
        [("content-type", "text/plain; charset=utf-8")],
        format!("got {} bytes", body.len()),
    )
        .into_response()
}

async fn fail(State(runs): State<Runs>) -> Response {
    runs.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(json!({"error": "boom"})),
    )
        .into_response()
}

async fn reject(State(runs): State<Runs>) -> Response {
    runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::BAD_REQUEST, Json(json!({"error": "bad"}))).into_response()
}

async fn throw(State(runs): State<Runs>) -> Response {
    runs.fetch_add(1, Ordering::SeqCst);
    panic!("the handler throws")
}

#[tokio::main]
async fn main() {
    let conninfo = std::env::var("CONNINFO").expect("CONNINFO");
    let pg: tokio_postgres::Config = conninfo.parse().expect("a libpq keyword string");
    let manager = Manager::from_config(
        pg,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager).max_size(16).build().expect("pool");
    let layer = IdempotencyLayer::new(pool)
        .wait(env_secs("WAIT", 0.0))
        .connect_timeout(env_secs("CONNECT_TIMEOUT", 5.0))
        .fail_open(std::env::var("FAIL_OPEN").as_deref() == Ok("1"));
    let runs: Runs = Arc::default();
    let app = Router::new()
        .route("/orders", post(orders).get(|| async { Json(json!([])) }))
        .route("/text", post(text))
        .route("/fail", post(fail))
        .route("/reject", post(reject))
        .route("/throw", post(throw))
        .route_layer(layer)
        .route(
            "/runs",
            get(|State(runs): State<Runs>| async move {
                Json(json!({"runs": runs.load(Ordering::SeqCst)}))
            }),
        )
        .with_state(runs);
    let port: u16 = std::env::var("PORT")
        .expect("PORT")
        .parse()
        .expect("a port");
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind");
    axum::serve(listener, app).await.expect("serve");
}
