//! Spans and metrics of the SQL API calls, behind cargo features that are off by default:
//!
//! - `tracing`: one [`tracing`] span per claim, complete, release and checkpoint
//!   (`idempotency.claim`, ...), at INFO level, with the attributes as fields
//!   (`idempotency.outcome`, ...; `otel.kind = "client"`, `otel.status_code` and `error.type` on
//!   a failure): with `tracing-opentelemetry` they become OpenTelemetry spans as they are;
//! - `metrics`: the OpenTelemetry instruments `idempotency.claims`,
//!   `idempotency.claim.duration` and `idempotency.completion.retries`, on the meter provider
//!   installed with `opentelemetry::global::set_meter_provider` (before the first request: the
//!   instruments are made once);
//! - `otel`: both.
//!
//! The names are the same in the three client packages (docs/operations.md of the repository,
//! "Client traces and metrics"). No field carries the key or the request: the key appears only as
//! `idempotency.key_hash`, the first 16 hex digits of the SHA-256 of scope, a NUL byte and key.
//! Without the features an [`Op`] is a counter and nothing else.
// With one feature (or none) some fields and arguments are the other's only.
#![cfg_attr(
    not(all(feature = "tracing", feature = "metrics")),
    allow(dead_code, unused_variables)
)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use crate::store::{Claim, Outcome};

/// The first 16 hex digits of SHA-256(scope || NUL || key): the key's stand-in in a span.
#[cfg(feature = "tracing")]
pub(crate) fn key_hash(scope: &str, key: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(scope.as_bytes());
    h.update([0u8]);
    h.update(key.as_bytes());
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What a claim answered, as `idempotency.outcome` says it (the extension's names).
pub(crate) fn outcome_name(o: Outcome) -> &'static str {
    match o {
        Outcome::New => "new",
        Outcome::Replay => "replay",
        Outcome::InProgress => "in_progress",
        Outcome::Mismatch => "mismatch",
    }
}

/// `error.type` of a failed call: the SQLSTATE (IK003, ...), else the client error's type. Never
/// the message: it may name the key.
pub(crate) fn error_type(e: &tokio_postgres::Error) -> String {
    match e.code() {
        Some(c) => c.code().to_owned(),
        None => "tokio_postgres::Error".to_owned(),
    }
}

#[cfg(feature = "tracing")]
macro_rules! op_span {
    ($name:literal, $scope:expr, $hash:expr) => {
        tracing::info_span!(
            $name,
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            idempotency.scope = $scope,
            idempotency.key_hash = $hash,
            idempotency.token = tracing::field::Empty,
            idempotency.outcome = tracing::field::Empty,
            idempotency.replay = tracing::field::Empty,
            idempotency.retry_after = tracing::field::Empty,
            idempotency.resumed = tracing::field::Empty,
            idempotency.waited = tracing::field::Empty,
            idempotency.released = tracing::field::Empty,
            idempotency.retries = tracing::field::Empty,
            "error.type" = tracing::field::Empty,
        )
    };
}

#[cfg(feature = "metrics")]
struct Instruments {
    claims: opentelemetry::metrics::Counter<u64>,
    duration: opentelemetry::metrics::Histogram<f64>,
    retries: opentelemetry::metrics::Counter<u64>,
}

#[cfg(feature = "metrics")]
const DURATION_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

#[cfg(feature = "metrics")]
fn instruments() -> &'static Instruments {
    static I: OnceLock<Instruments> = OnceLock::new();
    I.get_or_init(|| {
        let scope = opentelemetry::InstrumentationScope::builder("idempotency-axum")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        let meter = opentelemetry::global::meter_with_scope(scope);
        Instruments {
            claims: meter
                .u64_counter("idempotency.claims")
                .with_unit("{claim}")
                .with_description("Claims, by the outcome the extension returned")
                .build(),
            duration: meter
                .f64_histogram("idempotency.claim.duration")
                .with_unit("s")
                .with_description("Duration of a claim, reconnects included")
                .with_boundaries(DURATION_BUCKETS.to_vec())
                .build(),
            retries: meter
                .u64_counter("idempotency.completion.retries")
                .with_unit("{retry}")
                .with_description(
                    "complete, checkpoint and release repeated on a new connection after a broken one",
                )
                .build(),
        }
    })
}

/// One call of the SQL API: its span (feature `tracing`) and its share of the metrics (feature
/// `metrics`), both finished when the `Op` is dropped.
pub(crate) struct Op {
    name: &'static str,
    retries: AtomicU32,
    outcome: OnceLock<&'static str>,
    error: OnceLock<String>,
    #[cfg(feature = "metrics")]
    started: std::time::Instant,
    #[cfg(feature = "tracing")]
    span: tracing::Span,
}

impl Op {
    pub(crate) fn claim(scope: &str, key: &str) -> Op {
        Op::new("claim", scope, key, None)
    }

    pub(crate) fn complete(scope: &str, key: &str, token: Option<i64>) -> Op {
        Op::new("complete", scope, key, token)
    }

    pub(crate) fn release(scope: &str, key: &str, token: Option<i64>) -> Op {
        Op::new("release", scope, key, token)
    }

    pub(crate) fn checkpoint(scope: &str, key: &str, token: Option<i64>) -> Op {
        Op::new("checkpoint", scope, key, token)
    }

    fn new(name: &'static str, scope: &str, key: &str, token: Option<i64>) -> Op {
        #[cfg(feature = "tracing")]
        let span = {
            let hash = key_hash(scope, key);
            let (scope, hash) = (scope, hash.as_str());
            let span = match name {
                "claim" => op_span!("idempotency.claim", scope, hash),
                "complete" => op_span!("idempotency.complete", scope, hash),
                "release" => op_span!("idempotency.release", scope, hash),
                _ => op_span!("idempotency.checkpoint", scope, hash),
            };
            if let Some(t) = token {
                span.record("idempotency.token", t);
            }
            span
        };
        Op {
            name,
            retries: AtomicU32::new(0),
            outcome: OnceLock::new(),
            error: OnceLock::new(),
            #[cfg(feature = "metrics")]
            started: std::time::Instant::now(),
            #[cfg(feature = "tracing")]
            span,
        }
    }

    /// A statement of this call is repeated on a new connection after a broken one.
    pub(crate) fn retried(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// The claim's answer: outcome, replay, token, retry_after, a recovery point.
    pub(crate) fn claimed(&self, c: &Claim) {
        let outcome = outcome_name(c.outcome);
        let _ = self.outcome.set(outcome);
        #[cfg(feature = "tracing")]
        {
            let s = &self.span;
            s.record("idempotency.outcome", outcome);
            s.record("idempotency.replay", c.outcome == Outcome::Replay);
            if matches!(c.outcome, Outcome::New | Outcome::Replay) {
                if let Some(t) = c.token {
                    s.record("idempotency.token", t);
                }
            }
            if let Some(r) = c.retry_after {
                s.record("idempotency.retry_after", f64::from(r));
            }
            if c.outcome == Outcome::New {
                s.record("idempotency.resumed", c.recovery_point.is_some());
            }
        }
    }

    /// The layer waited that long for an in-progress key before this answer.
    pub(crate) fn waited(&self, d: Duration) {
        #[cfg(feature = "tracing")]
        self.span.record("idempotency.waited", d.as_secs_f64());
    }

    pub(crate) fn released(&self, released: bool) {
        #[cfg(feature = "tracing")]
        self.span.record("idempotency.released", released);
    }

    pub(crate) fn failed(&self, e: &tokio_postgres::Error) {
        let _ = self.error.set(error_type(e));
    }

    /// Failed without a database error: `kind` says why (no connection could be had).
    pub(crate) fn failed_as(&self, kind: &str) {
        let _ = self.error.set(kind.to_owned());
    }

    /// The result of the call, recorded as a failure when it is one.
    pub(crate) fn result<T>(
        &self,
        r: Result<T, tokio_postgres::Error>,
    ) -> Result<T, tokio_postgres::Error> {
        if let Err(e) = &r {
            self.failed(e);
        }
        r
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        let retries = self.retries.load(Ordering::Relaxed);
        #[cfg(feature = "tracing")]
        {
            let s = &self.span;
            s.record("idempotency.retries", u64::from(retries));
            if let Some(e) = self.error.get() {
                s.record("error.type", e.as_str());
                s.record("otel.status_code", "ERROR");
            }
        }
        #[cfg(feature = "metrics")]
        {
            use opentelemetry::KeyValue;
            let i = instruments();
            let mut attrs = Vec::with_capacity(2);
            if let Some(e) = self.error.get() {
                attrs.push(KeyValue::new("error.type", e.clone()));
            }
            if self.name == "claim" {
                if let Some(o) = self.outcome.get() {
                    attrs.push(KeyValue::new("idempotency.outcome", *o));
                }
                i.claims.add(1, &attrs);
                i.duration
                    .record(self.started.elapsed().as_secs_f64(), &attrs);
            } else if retries > 0 {
                i.retries.add(
                    u64::from(retries),
                    &[KeyValue::new("idempotency.operation", self.name)],
                );
            }
        }
    }
}
