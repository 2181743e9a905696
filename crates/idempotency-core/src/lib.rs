//! The pure logic of the `idempotency` PostgreSQL extension: no pgrx, no server calls, so its
//! tests run with plain `cargo test -p idempotency-core`, and the compiler keeps it that way.
//!
//! - [`canonical`]: RFC 8785 canonical JSON over an in-memory tree (exact or ECMAScript numbers);
//! - [`keys`]: argument rules (keys, scopes, durations, statuses) and key derivation
//!   (`derive_key`, `cron_key`, fingerprints);
//! - [`state`]: the claim decision table and its four outcomes;
//! - [`signing`]: signed keys (HMAC-SHA256, base64url) and hashed keys;
//! - `json_text` (tests and the `json-text` feature): JSON text to the canonical tree.

pub mod canonical;
#[cfg(any(test, feature = "json-text"))]
pub mod json_text;
pub mod keys;
pub mod signing;
pub mod state;
