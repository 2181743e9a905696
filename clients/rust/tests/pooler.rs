//! The layer behind a connection pooler (run the suite with `IDEMPOTENCY_TEST_POOLER=transaction`
//! or `session` to put PgBouncer in front of the cluster; these tests also run direct): racing
//! duplicates on two application instances, a connection that breaks between the handler's side
//! effect and the completion, and the statements the layer leaves on a server connection.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use common::{pay_request, router, send, send_waiting, App, Cluster, Route};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use idempotency_axum::{Claimed, IdempotencyLayer};
use serde_json::json;
use tokio_postgres::NoTls;

const ORDER: &str = r#"{"amount": 59.90}"#;

/// The side effect of the handler: its runs, counted per key.
#[derive(Default)]
struct Effects {
    runs: Mutex<HashMap<String, usize>>,
    seq: AtomicUsize,
}

async fn effect(State(fx): State<Arc<Effects>>, Extension(claim): Extension<Claimed>) -> Response {
    let run = fx.seq.fetch_add(1, Ordering::SeqCst) + 1;
    *fx.runs
        .lock()
        .unwrap()
        .entry(claim.key.clone())
        .or_default() += 1;
    // Long enough for the duplicates to arrive while it runs.
    tokio::time::sleep(Duration::from_millis(100)).await;
    (
        StatusCode::CREATED,
        Json(json!({"key": claim.key, "run": run})),
    )
        .into_response()
}

/// One instance of the application: its own pool, its own layer.
fn instance(pool: Pool, fx: Arc<Effects>) -> Router {
    Router::new()
        .route("/effects", post(effect))
        .route_layer(IdempotencyLayer::new(pool).lease(Duration::from_secs(60)))
        .with_state(fx)
}

fn effect_request(key: usize) -> axum::http::Request<axum::body::Body> {
    axum::http::Request::post("/effects")
        .header("content-type", "application/json")
        .header("idempotency-key", format!("\"k-{key}\""))
        .body(axum::body::Body::from(format!(r#"{{"key": {key}}}"#)))
        .unwrap()
}

const KEYS: usize = 50;
const DUPLICATES: usize = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_duplicates_on_two_instances_run_each_effect_once() {
    let cluster = Cluster::start().await;
    let fx = Arc::new(Effects::default());
    let instances = [
        instance(cluster.pool(), fx.clone()),
        instance(cluster.pool(), fx.clone()),
    ];
    let tasks: Vec<_> = (0..DUPLICATES)
        .flat_map(|dup| (0..KEYS).map(move |key| (key, dup)))
        .map(|(key, dup)| {
            let r = instances[dup % 2].clone();
            tokio::spawn(async move { (key, send(&r, effect_request(key)).await) })
        })
        .collect();
    let mut answers: HashMap<usize, Vec<common::Answer>> = HashMap::new();
    for t in tasks {
        let (key, a) = t.await.unwrap();
        answers.entry(key).or_default().push(a);
    }

    let runs = fx.runs.lock().unwrap().clone();
    assert_eq!(runs.len(), KEYS, "every key ran: {runs:?}");
    for key in 0..KEYS {
        assert_eq!(runs.get(&format!("k-{key}")), Some(&1), "k-{key} ran once");
        let got = &answers[&key];
        assert_eq!(got.len(), DUPLICATES);
        let statuses: Vec<_> = got.iter().map(|a| (a.status, a.body.clone())).collect();
        let fresh: Vec<_> = got
            .iter()
            .filter(|a| a.status == StatusCode::CREATED)
            .filter(|a| a.header("idempotent-replayed").is_none())
            .collect();
        assert_eq!(fresh.len(), 1, "k-{key}: one first answer: {statuses:?}");
        for a in got {
            match a.status {
                StatusCode::CREATED => assert_eq!(a.body, fresh[0].body, "k-{key}: the replay"),
                StatusCode::CONFLICT => {
                    assert_eq!(
                        a.json()["title"],
                        "A request is outstanding for this Idempotency-Key"
                    )
                }
                _ => panic!("k-{key}: a duplicate got neither the replay nor 409: {statuses:?}"),
            }
        }
    }
    let rows = cluster
        .query(
            "SELECT count(*) FILTER (WHERE status = 'completed'), count(*) \
               FROM idempotency.idempotency_keys",
            &[],
        )
        .await;
    assert_eq!(rows[0].get::<_, i64>(0), KEYS as i64, "every key completed");
    assert_eq!(rows[0].get::<_, i64>(1), KEYS as i64);

    // The requests went through the pooler the suite was asked for.
    if let Some(pooler) = &cluster.pooler {
        let config = cluster.config();
        let database = config.get_dbname();
        let pools = pooler.admin("SHOW POOLS").await;
        let mode = match cluster.route() {
            Route::Transaction => "transaction",
            _ => "session",
        };
        assert!(
            pools
                .iter()
                .any(|p| p.get("database") == database && p.get("pool_mode") == Some(mode)),
            "PgBouncer pools the application's database in {mode} mode"
        );
        let stats = pooler.admin("SHOW STATS").await;
        let queries: u64 = stats
            .iter()
            .filter(|s| s.get("database") == database)
            .filter_map(|s| s.get("total_query_count")?.parse::<u64>().ok())
            .sum();
        assert!(
            queries >= (KEYS * DUPLICATES) as u64,
            "{queries} queries through PgBouncer"
        );
    }
}

/// The server connection dies while `complete` waits on it (the handler's side effect is done):
/// the completion is retried on a new connection with the same token, the caller gets the
/// handler's answer, and a retry gets it replayed; the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_is_retried_on_a_new_connection_when_its_connection_is_killed() {
    let cluster = Cluster::start().await;
    let app = Arc::new(App::default());
    let r = router(app.clone(), cluster.pool(), Duration::from_secs(60));
    let first = send_waiting(&r, &app, ORDER).await;

    // Hold the claimed row so that `complete` blocks on it, on a server connection of its own.
    let (holder, conn) = cluster.direct_config().connect(NoTls).await.unwrap();
    tokio::spawn(conn);
    holder.batch_execute("BEGIN").await.unwrap();
    let held = holder
        .query(
            "SELECT status::text FROM idempotency.idempotency_keys FOR UPDATE",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].get::<_, &str>(0), "in_progress");
    app.gate.add_permits(1);

    let mut killed = 0;
    for _ in 0..200 {
        let rows = cluster
            .query(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                  WHERE wait_event_type = 'Lock' AND query LIKE '%idempotency.complete(%'",
                &[],
            )
            .await;
        killed = rows[0].get::<_, i64>(0);
        if killed > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(
        killed, 1,
        "the completion's server connection was terminated"
    );
    holder.batch_execute("COMMIT").await.unwrap();

    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(first.json()["token"], 1);
    assert!(first.header("idempotency-expires").is_some());
    let rows = cluster
        .query(
            "SELECT status::text, token FROM idempotency.idempotency_keys WHERE key = 'k'",
            &[],
        )
        .await;
    assert_eq!(rows[0].get::<_, &str>(0), "completed");
    assert_eq!(rows[0].get::<_, i64>(1), 1);
    let again = send(&r, pay_request(Some("c"), Some("\"k\""), ORDER, "")).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(app.runs(), 1);
}

/// Stores its own answer under the claim's token before answering, as a completion whose commit
/// went through but whose reply was lost with the connection leaves the key.
async fn stored_already(
    Extension(claim): Extension<Claimed>,
    State(pool): State<Pool>,
) -> Response {
    let body = json!({"stored": "by the first try"}).to_string();
    let db = pool.get().await.unwrap();
    idempotency_axum::store::complete(
        &**db,
        &claim.key,
        &claim.scope,
        claim.token,
        201,
        &body,
        None,
    )
    .await
    .unwrap();
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        body,
    )
        .into_response()
}

/// `complete` answers "already completed" (IK002) and the store holds the answer under this
/// claim's token: the completion counts as done and the caller gets the handler's answer, not a
/// replay or an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_already_stored_under_the_claims_token_answers_the_handlers_response() {
    let cluster = Cluster::start().await;
    let pool = cluster.pool();
    let r = Router::new()
        .route("/stored", post(stored_already))
        .route_layer(IdempotencyLayer::new(pool.clone()))
        .with_state(pool);
    let req = || {
        axum::http::Request::post("/stored")
            .header("idempotency-key", "\"s\"")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let first = send(&r, req()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert!(first.header("idempotency-expires").is_some());
    assert_eq!(first.json()["stored"], "by the first try");
    let rows = cluster
        .query(
            "SELECT status::text, token FROM idempotency.idempotency_keys WHERE key = 's'",
            &[],
        )
        .await;
    assert_eq!(rows[0].get::<_, &str>(0), "completed");
    assert_eq!(rows[0].get::<_, i64>(1), 1);
    let again = send(&r, req()).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.json()["stored"], "by the first try");
}

/// How many prepared statements the session of the pool's only connection holds.
async fn prepared_statements_left(pool: &Pool) -> i64 {
    let db = pool.get().await.unwrap();
    // The simple protocol: this count adds no statement of its own.
    let rows = db
        .simple_query("SELECT count(*) FROM pg_prepared_statements")
        .await
        .unwrap();
    rows.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0)?.parse().ok(),
            _ => None,
        })
        .expect("a count")
}

fn one_connection_pool(cluster: &Cluster) -> Pool {
    let mgr = Manager::from_config(
        cluster.config(),
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(mgr).max_size(1).build().unwrap()
}

/// By default the layer leaves no prepared statement on its connection (what a
/// transaction-mode pooler needs); `prepared_statements(true)` keeps them, prepared once per
/// connection. Transaction mode hands the session to another client between transactions, so
/// there the count is not the layer's and the option is not for PgBouncer 1.18: checked direct
/// and in session mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_are_unnamed_unless_prepared_statements_is_on() {
    let cluster = Cluster::start().await;
    if cluster.route() == Route::Transaction {
        eprintln!("skipped in transaction mode: a session is not the layer's there");
        return;
    }
    for (prepared, left) in [(false, 0..=0), (true, 2..=3)] {
        let app = Arc::new(App::default());
        let pool = one_connection_pool(&cluster);
        let r = common::router_with(app.clone(), pool.clone(), Duration::from_secs(60), |l| {
            l.prepared_statements(prepared)
        });
        for _ in 0..2 {
            let key = format!("\"p-{prepared}\"");
            let a = send(&r, pay_request(Some("c"), Some(&key), ORDER, "")).await;
            assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        }
        assert_eq!(app.runs(), 1);
        let n = prepared_statements_left(&pool).await;
        assert!(
            left.contains(&n),
            "prepared_statements({prepared}): {n} left"
        );
    }
}
