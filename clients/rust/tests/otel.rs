//! Spans and metrics (feature `otel`) against a real cluster: the spans through a
//! `tracing_subscriber` layer that captures their fields, the metrics through the OpenTelemetry
//! SDK's in-memory exporter. new, replay, mismatch and in_progress through the layer; a
//! checkpoint, a takeover, a fenced complete and a release through the store functions; a
//! completion repeated on a new connection. No field carries the key or the request.
//!
//! Direct mode only (the spans do not depend on the route): `cargo test --features otel --test
//! otel`, as scripts/clients-rust.sh runs it.
#![cfg(feature = "otel")]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::http::StatusCode;
use common::{pay_request, router, send, App, Cluster, Route};
use idempotency_axum::response::Echo;
use idempotency_axum::store::{self, Outcome};
use idempotency_axum::IdemRequest;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use serde_json::{json, Map, Value};
use tokio_postgres::NoTls;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

const SECRET_KEY: &str = "order-7f3a-SECRETKEY";
const SECRET_BODY: &str = r#"{"card": "4111-SECRETREQUEST", "amount": 42}"#;

/// A span's fields as JSON values.
#[derive(Default)]
struct Fields(Map<String, Value>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().into(), json!(format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), json!(value));
    }
}

type Closed = Arc<Mutex<Vec<(String, Map<String, Value>)>>>;

/// Keeps every closed span: its name and fields.
struct Capture(Closed);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut f = Fields::default();
        attrs.record(&mut f);
        ctx.span(id).unwrap().extensions_mut().insert(f);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        let mut ext = span.extensions_mut();
        values.record(ext.get_mut::<Fields>().unwrap());
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let span = ctx.span(&id).unwrap();
        let f = span.extensions_mut().remove::<Fields>().unwrap();
        self.0.lock().unwrap().push((span.name().to_string(), f.0));
    }
}

struct Telemetry {
    spans: Closed,
    exporter: InMemoryMetricExporter,
    provider: SdkMeterProvider,
}

impl Telemetry {
    /// The spans closed since the last call whose scope is `scope`.
    fn take(&self, scope: &str) -> Vec<(String, Map<String, Value>)> {
        let mut all = self.spans.lock().unwrap();
        let (mine, rest): (Vec<_>, Vec<_>) = all
            .drain(..)
            .partition(|(_, f)| f.get("idempotency.scope") == Some(&json!(scope)));
        *all = rest;
        mine
    }

    /// A metric's data points as (attributes, value): a sum's value, a histogram's count and
    /// bounds.
    fn points(&self, name: &str) -> Vec<(HashMap<String, String>, u64, Vec<f64>)> {
        self.provider.force_flush().unwrap();
        let exported = self.exporter.get_finished_metrics().unwrap();
        let mut out = Vec::new();
        let Some(last) = exported.last() else {
            return out;
        };
        for sm in last.scope_metrics() {
            for m in sm.metrics() {
                if m.name() != name {
                    continue;
                }
                let attrs = |kvs: &mut dyn Iterator<Item = &opentelemetry::KeyValue>| {
                    kvs.map(|kv| (kv.key.to_string(), kv.value.to_string()))
                        .collect::<HashMap<_, _>>()
                };
                match m.data() {
                    AggregatedMetrics::U64(MetricData::Sum(s)) => {
                        for p in s.data_points() {
                            out.push((attrs(&mut p.attributes()), p.value(), vec![]));
                        }
                    }
                    AggregatedMetrics::F64(MetricData::Histogram(h)) => {
                        for p in h.data_points() {
                            out.push((attrs(&mut p.attributes()), p.count(), p.bounds().collect()));
                        }
                    }
                    other => panic!("{name}: unexpected data {other:?}"),
                }
            }
        }
        out
    }
}

/// The tests one at a time: the counters are the process'.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn telemetry() -> &'static Telemetry {
    static T: OnceLock<Telemetry> = OnceLock::new();
    T.get_or_init(|| {
        let spans = Closed::default();
        let subscriber = tracing_subscriber::registry().with(Capture(spans.clone()));
        tracing::subscriber::set_global_default(subscriber).unwrap();
        let exporter = InMemoryMetricExporter::default();
        let provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(exporter.clone()).build())
            .build();
        opentelemetry::global::set_meter_provider(provider.clone());
        Telemetry {
            spans,
            exporter,
            provider,
        }
    })
}

fn value_of(points: &[(HashMap<String, String>, u64, Vec<f64>)], attr: &str, v: &str) -> u64 {
    points
        .iter()
        .filter(|(a, _, _)| a.get(attr).map(String::as_str) == Some(v))
        .map(|(_, n, _)| *n)
        .sum()
}

fn assert_no_secret(spans: &[(String, Map<String, Value>)]) {
    for (name, fields) in spans {
        for (field, value) in fields {
            let text = value.to_string();
            for secret in [SECRET_KEY, "SECRETKEY", "SECRETREQUEST"] {
                assert!(
                    !text.contains(secret),
                    "{name} {field} carries the key or the request: {text}"
                );
            }
        }
    }
}

fn request(scope: &str, key: &str, body: &str) -> IdemRequest {
    IdemRequest {
        key: key.into(),
        scope: scope.into(),
        method: "POST".into(),
        path: "/pay".into(),
        query: "{}".into(),
        body: body.into(),
        body_bytes: None,
        echo: Echo::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_and_metrics_of_every_outcome() {
    if Route::from_env() != Route::Direct {
        eprintln!("the OpenTelemetry tests run in the direct mode only");
        return;
    }
    let _serial = SERIAL.lock().await;
    let t = telemetry();
    let cluster = Cluster::start().await;
    let pool = cluster.pool();
    let claims0 = t.points("idempotency.claims");

    // Through the layer: new, replay, mismatch, in_progress.
    let app = Arc::new(App::default());
    let r = router(app.clone(), pool.clone(), Duration::from_secs(60));
    let key = format!("\"{SECRET_KEY}\"");
    let first = send(&r, pay_request(Some("c1"), Some(&key), SECRET_BODY, "")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    let again = send(&r, pay_request(Some("c1"), Some(&key), SECRET_BODY, "")).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let other = r#"{"card": "other-SECRETREQUEST"}"#;
    let wrong = send(&r, pay_request(Some("c1"), Some(&key), other, "")).await;
    assert_eq!(wrong.status, StatusCode::UNPROCESSABLE_ENTITY);
    // A request held in its handler, and a second one with its key meanwhile.
    let k3 = format!("\"held-{SECRET_KEY}\"");
    let r3 = r.clone();
    let k3c = k3.clone();
    let holding = tokio::spawn(async move {
        send(
            &r3,
            pay_request(Some("c1"), Some(&k3c), SECRET_BODY, "wait"),
        )
        .await
    });
    app.wait_runs(2).await; // the first request's run, and this one's
    let busy = send(&r, pay_request(Some("c1"), Some(&k3), SECRET_BODY, "")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    app.gate.add_permits(1);
    assert_eq!(holding.await.unwrap().status, StatusCode::CREATED);

    let spans = t.take("c1:POST /pay");
    let names: Vec<&str> = spans.iter().map(|(n, _)| n.as_str()).collect();
    let outcomes: Vec<Option<&str>> = spans
        .iter()
        .map(|(_, f)| f.get("idempotency.outcome").and_then(Value::as_str))
        .collect();
    assert_eq!(
        names,
        [
            "idempotency.claim",
            "idempotency.complete",
            "idempotency.claim",
            "idempotency.claim",
            "idempotency.claim",
            "idempotency.claim",
            "idempotency.complete"
        ],
        "{spans:?}"
    );
    assert_eq!(
        outcomes,
        [
            Some("new"),
            None,
            Some("replay"),
            Some("mismatch"),
            Some("new"),
            Some("in_progress"),
            None
        ]
    );
    assert_ne!(
        spans[4].1["idempotency.key_hash"],
        spans[0].1["idempotency.key_hash"]
    );
    let new = &spans[0].1;
    let hash = new["idempotency.key_hash"].as_str().unwrap();
    assert_eq!(hash.len(), 16);
    assert!(hash.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(new["idempotency.replay"], json!(false));
    assert_eq!(new["idempotency.resumed"], json!(false));
    assert_eq!(new["idempotency.retries"], json!(0));
    assert_eq!(new["otel.kind"], json!("client"));
    let token = new["idempotency.token"].as_i64().unwrap();
    assert_eq!(spans[1].1["idempotency.token"], json!(token));
    assert_eq!(spans[2].1["idempotency.replay"], json!(true));
    assert_eq!(spans[2].1["idempotency.token"], json!(token));
    assert_eq!(spans[2].1["idempotency.key_hash"], json!(hash));
    assert!(spans[3].1.get("idempotency.token").is_none());
    let busy_span = spans
        .iter()
        .find(|(_, f)| f.get("idempotency.outcome") == Some(&json!("in_progress")))
        .unwrap();
    assert!(busy_span.1["idempotency.retry_after"].as_f64().unwrap() >= 1.0);
    assert!(busy_span.1.get("idempotency.token").is_none());
    assert_no_secret(&spans);

    // Through the store functions: checkpoint, takeover, a fenced complete, release.
    let db = pool.get().await.unwrap();
    let ir = request("tenant-1", SECRET_KEY, SECRET_BODY);
    let c1 = store::claim(&**db, &ir, 3600.0, 0.5).await.unwrap();
    assert_eq!(c1.outcome, Outcome::New);
    store::checkpoint(&**db, SECRET_KEY, "tenant-1", c1.token, "charged")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let c2 = store::claim(&**db, &ir, 3600.0, 30.0).await.unwrap();
    assert_eq!(c2.outcome, Outcome::New);
    assert!(c2.token > c1.token);
    assert_eq!(c2.recovery_point.as_deref(), Some("charged"));
    let stale = store::complete(&**db, SECRET_KEY, "tenant-1", c1.token, 200, "{}", None).await;
    assert_eq!(store::sqlstate(&stale.unwrap_err()), Some("IK003"));
    store::complete(&**db, SECRET_KEY, "tenant-1", c2.token, 200, "{}", None)
        .await
        .unwrap();
    let rel = request("tenant-1", "release-me-SECRETKEY", "");
    let c3 = store::claim(&**db, &rel, 3600.0, 30.0).await.unwrap();
    assert!(
        store::release(&**db, "release-me-SECRETKEY", "tenant-1", c3.token)
            .await
            .unwrap()
    );
    let spans = t.take("tenant-1");
    let names: Vec<&str> = spans.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "idempotency.claim",
            "idempotency.checkpoint",
            "idempotency.claim",
            "idempotency.complete",
            "idempotency.complete",
            "idempotency.claim",
            "idempotency.release"
        ]
    );
    let f: Vec<&Map<String, Value>> = spans.iter().map(|(_, f)| f).collect();
    assert_eq!(f[1]["idempotency.token"], json!(c1.token.unwrap()));
    assert!(f[1].get("error.type").is_none());
    assert_eq!(f[2]["idempotency.outcome"], json!("new"));
    assert_eq!(f[2]["idempotency.token"], json!(c2.token.unwrap()));
    assert_eq!(f[2]["idempotency.resumed"], json!(true));
    assert_eq!(f[3]["error.type"], json!("IK003"));
    assert_eq!(f[3]["otel.status_code"], json!("ERROR"));
    assert_eq!(f[3]["idempotency.token"], json!(c1.token.unwrap()));
    assert!(f[4].get("error.type").is_none());
    assert_eq!(f[6]["idempotency.released"], json!(true));
    // SHA-256 of scope NUL key: the same in the Python and Node packages.
    assert_eq!(f[0]["idempotency.key_hash"], json!("c8e6b9416ff4a7bd"));
    assert_eq!(f[0]["idempotency.key_hash"], f[2]["idempotency.key_hash"]);
    assert_no_secret(&spans);

    // The metrics: the claims by outcome; the duration histogram in seconds.
    let claims = t.points("idempotency.claims");
    let grew = |o: &str| {
        value_of(&claims, "idempotency.outcome", o) - value_of(&claims0, "idempotency.outcome", o)
    };
    assert_eq!(
        (
            grew("new"),
            grew("replay"),
            grew("mismatch"),
            grew("in_progress")
        ),
        (5, 1, 1, 1)
    );
    let durations = t.points("idempotency.claim.duration");
    for o in ["new", "replay", "mismatch", "in_progress"] {
        assert_eq!(
            value_of(&durations, "idempotency.outcome", o),
            value_of(&claims, "idempotency.outcome", o)
        );
    }
    assert_eq!(&durations[0].2[..3], &[0.001, 0.0025, 0.005]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_repeated_on_a_new_connection_is_counted() {
    if Route::from_env() != Route::Direct {
        return;
    }
    let _serial = SERIAL.lock().await;
    let t = telemetry();
    let cluster = Cluster::start().await;
    let app = Arc::new(App::default());
    let r = router(app.clone(), cluster.pool(), Duration::from_secs(60));
    let retries0 = value_of(
        &t.points("idempotency.completion.retries"),
        "idempotency.operation",
        "complete",
    );
    let r2 = r.clone();
    let request = tokio::spawn(async move {
        send(
            &r2,
            pay_request(Some("c-retry"), Some("\"r-1\""), "{}", "wait"),
        )
        .await
    });
    app.wait_runs(1).await;
    // The completion waits for a row lock held here; its connection is ended while it waits.
    let (locker, conn) = cluster.direct_config().connect(NoTls).await.unwrap();
    tokio::spawn(conn);
    locker.batch_execute("BEGIN").await.unwrap();
    locker
        .execute(
            "SELECT 1 FROM idempotency.idempotency_keys WHERE key = 'r-1' FOR UPDATE",
            &[],
        )
        .await
        .unwrap();
    app.gate.add_permits(1);
    let mut ended = false;
    for _ in 0..400 {
        let rows = cluster
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                  WHERE wait_event_type = 'Lock' AND query LIKE '%idempotency.complete%'",
                &[],
            )
            .await;
        if !rows.is_empty() {
            ended = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(ended, "the completion never waited for the lock");
    tokio::time::sleep(Duration::from_millis(150)).await;
    locker.batch_execute("COMMIT").await.unwrap();
    assert_eq!(request.await.unwrap().status, StatusCode::CREATED);
    let spans = t.take("c-retry:POST /pay");
    let complete: Vec<_> = spans
        .iter()
        .filter(|(n, _)| n == "idempotency.complete")
        .collect();
    assert_eq!(complete.len(), 1);
    let n = complete[0].1["idempotency.retries"].as_u64().unwrap();
    assert!(n >= 1, "{complete:?}");
    let retries = value_of(
        &t.points("idempotency.completion.retries"),
        "idempotency.operation",
        "complete",
    );
    assert_eq!(retries - retries0, n);
}
