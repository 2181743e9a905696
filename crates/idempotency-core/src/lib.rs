//! The pure logic of the `idempotency` PostgreSQL extension: no pgrx, no server calls, so its
//! tests run with plain `cargo test -p idempotency-core`, and the compiler keeps it that way.
//!
//! - [`canonical`]: RFC 8785 canonical JSON over an in-memory tree (exact or ECMAScript numbers);
//! - [`jsonb`]: a bounds-checked reader of jsonb's binary form (canonical form or tree);
//! - [`exclusion`]: `canonical_hash`'s exclusions (member names, JSON Pointers), near-linear;
//! - [`arguments`]: argument rules (keys, scopes, scope prefixes, durations, statuses);
//! - [`derivation`]: key derivation (`derive_key`, `cron_key`, request fingerprints);
//! - [`decision`]: the claim decision table and its four outcomes;
//! - [`signing`]: signed keys (HMAC-SHA256, base64url) and hashed keys;
//! - [`pacing`]: the background sweeper's batch sizes and pauses, and its look at the WAL;
//! - `json_text` (tests and the `json-text` feature): JSON text to the canonical tree.

pub mod arguments;
pub mod canonical;
pub mod decision;
pub mod derivation;
pub mod exclusion;
#[cfg(any(test, feature = "json-text"))]
pub mod json_text;
pub mod jsonb;
pub mod pacing;
pub mod signing;
