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
//! shape (one transaction for the claim and the handler's writes, checkpoints).
//!
//! See README.md for a quickstart.

pub mod body;
pub mod key;
mod layer;
pub mod request;
pub mod response;
pub mod store;

pub use layer::{
    route_scope, CheckFn, Claimed, Disposition, Idempotency, IdempotencyLayer, ScopeFn,
};
pub use request::IdemRequest;
pub use store::{Claim, Outcome};
