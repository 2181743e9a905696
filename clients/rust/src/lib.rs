//! Idempotency-Key for axum, with PostgreSQL's `idempotency` extension as the store.
//!
//! [`IdempotencyLayer`] is a tower [`Layer`](tower_layer::Layer) that follows the IETF
//! Idempotency-Key header draft: it parses the key as an RFC 9651 String, scopes it per client
//! and route, claims it with the request's fingerprint before the inner service runs, and stores
//! the answer (or releases the key) after. Retries get the stored answer with
//! `Idempotent-Replayed: true`, 409 while the first request runs, 422 for a different request
//! with the same key, 400 for a missing or malformed key; errors are RFC 9457 problem+json.
//!
//! It is a thin layer over the extension's SQL API (`idempotency.claim`, `complete`, `release`,
//! `request_fingerprint`): hashing, expiry and fencing are the extension's. The building blocks
//! ([`key`], [`request`], [`response`], [`store`]) are public, for handlers that need another
//! shape (one transaction for the claim and the handler's writes, checkpoints, a batch of event
//! ids claimed at once with [`store::claim_many`]).
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use axum::http::StatusCode;
//! use axum::routing::post;
//! use axum::{Extension, Json, Router};
//! use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
//! use idempotency_axum::{Claimed, IdempotencyLayer};
//! use serde_json::{json, Value};
//! use tokio_postgres::NoTls;
//!
//! /// Runs once per key: a retry gets this answer back from the store.
//! async fn create_payment(
//!     Extension(claim): Extension<Claimed>,
//!     Json(payment): Json<Value>,
//! ) -> (StatusCode, Json<Value>) {
//!     (StatusCode::CREATED, Json(json!({"paid": payment["amount"], "token": claim.token})))
//! }
//!
//! # async fn app() {
//! let pg: tokio_postgres::Config = "host=/var/run/postgresql dbname=shop user=app".parse().unwrap();
//! let manager = Manager::from_config(
//!     pg,
//!     NoTls,
//!     ManagerConfig { recycling_method: RecyclingMethod::Fast },
//! );
//! let pool = Pool::builder(manager).max_size(16).build().unwrap();
//! let app: Router = Router::new()
//!     .route("/payments", post(create_payment))
//!     .route_layer(
//!         IdempotencyLayer::new(pool)
//!             .ttl(Duration::from_secs(24 * 3600))
//!             .lease(Duration::from_secs(30)),
//!     );
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await.unwrap();
//! axum::serve(listener, app).await.unwrap();
//! # }
//! ```
//!
//! README.md has the quickstart, the configuration and what a handler can do.

pub mod body;
pub mod key;
mod layer;
mod otel;
pub mod request;
pub mod response;
pub mod store;

pub use layer::{
    route_scope, CheckFn, Claimed, Disposition, Idempotency, IdempotencyLayer, ScopeFn,
};
pub use request::IdemRequest;

/// The README's Rust blocks, compiled as doctests: the quickstart's `main.rs` as written
/// (`no_run`); the fragments are marked `ignore`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
pub use store::{Claim, Outcome};
