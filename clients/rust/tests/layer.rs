//! The layer against a real cluster: every outcome, a race of identical requests, a crashed
//! request taken over after its lease, a database restart mid-request.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::{pay_request, router, send, send_waiting, App, Cluster};

const ORDER: &str = r#"{"amount": 59.90, "items": [{"sku": "A1", "qty": 2}]}"#;
const ORDER_REORDERED: &str = r#"{"items":[{"qty":2,"sku":"A1"}],"amount":59.90}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome() {
    let cluster = Cluster::start().await;
    let app = Arc::new(App::default());
    let r = router(app.clone(), cluster.pool(), Duration::from_secs(60));

    // new: the handler runs, its answer is stored and sent with the idempotency headers.
    let first = send(&r, pay_request(Some("c1"), Some("\"k-1\""), ORDER, "")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert_eq!(first.header("idempotency-key"), Some("\"k-1\""));
    assert_eq!(first.header("cache-control"), Some("no-store"));
    assert_eq!(first.header("content-type"), Some("application/json"));
    assert!(first.header("idempotency-expires").is_some());
    assert_eq!(first.header("idempotent-replayed"), None);
    assert!(first.body.contains(r#""amount": 59.90"#), "{}", first.body);
    assert_eq!(first.json()["scope"], "c1:POST /pay");
    assert_eq!(app.runs(), 1);

    // replay: the same bytes, flagged; the body's member order and spacing do not matter.
    for body in [ORDER, ORDER_REORDERED] {
        let again = send(&r, pay_request(Some("c1"), Some("\"k-1\";p=1"), body, "")).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert_eq!(again.body, first.body);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(again.header("idempotency-key"), Some("\"k-1\";p=1"));
        assert_eq!(
            again.header("idempotency-expires"),
            first.header("idempotency-expires")
        );
    }
    assert_eq!(app.runs(), 1);

    // mismatch: another body with the same key.
    let other = send(
        &r,
        pay_request(Some("c1"), Some("\"k-1\""), r#"{"amount": 5}"#, ""),
    )
    .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        other.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(other.json()["title"], "Idempotency-Key is already used");
    assert_eq!(
        other.header("idempotency-expires"),
        first.header("idempotency-expires")
    );
    assert_eq!(app.runs(), 1);

    // The scope is per client: another client's same key is another key.
    let c2 = send(&r, pay_request(Some("c2"), Some("\"k-1\""), ORDER, "")).await;
    assert_eq!(c2.status, StatusCode::CREATED);
    assert_eq!(c2.header("idempotent-replayed"), None);
    assert_eq!(app.runs(), 2);

    // 400: missing, malformed (not a String), too long; 401 from the scope function; nothing
    // runs, nothing is stored.
    let missing = send(&r, pay_request(Some("c1"), None, ORDER, "")).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.json()["title"], "Idempotency-Key is missing");
    for bad in ["k-2", "1", "?1", "\"unterminated"] {
        let a = send(&r, pay_request(Some("c1"), Some(bad), ORDER, "")).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(a.json()["title"], "Idempotency-Key is malformed");
        assert_eq!(a.header("idempotency-key"), Some(bad));
    }
    let long = format!("\"{}\"", "x".repeat(256));
    let a = send(&r, pay_request(Some("c1"), Some(&long), ORDER, "")).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let a = send(&r, pay_request(None, Some("\"k-2\""), ORDER, "")).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(a.header("idempotency-key"), Some("\"k-2\""));
    let a = send(
        &r,
        pay_request(Some("c1"), Some("\"k-2\""), "{not json", ""),
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let a = send(
        &r,
        pay_request(Some("c1"), Some("\"k-2\""), &"1".repeat(5000), ""),
    )
    .await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    // JSON that jsonb refuses: 422, nothing claimed.
    let a = send(
        &r,
        pay_request(Some("c1"), Some("\"k-2\""), r#"{"a": "\u0000"}"#, ""),
    )
    .await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.body);
    // A request the check refuses: 422, nothing claimed.
    let a = send(
        &r,
        pay_request(Some("c1"), Some("\"k-2\""), r#"{"invalid": 1}"#, ""),
    )
    .await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.body);
    assert_eq!(a.json()["title"], "Invalid payment");
    assert_eq!(a.header("idempotency-key"), Some("\"k-2\""));
    assert_eq!(app.runs(), 2);
    let rows = cluster
        .query(
            "SELECT count(*) FROM idempotency.idempotency_keys WHERE key = 'k-2'",
            &[],
        )
        .await;
    assert_eq!(rows[0].get::<_, i64>(0), 0);

    // A method that is not made idempotent passes through, key or not.
    let get = send(&r, Request::get("/pay").body(Body::empty()).unwrap()).await;
    assert_eq!(get.status, StatusCode::OK);
    assert_eq!(get.body, "not idempotent");

    // A 5xx releases the key: the retry runs again. A panic too.
    for behave in ["fail", "panic"] {
        let key = format!("\"{behave}\"");
        let a = send(&r, pay_request(Some("c1"), Some(&key), ORDER, behave)).await;
        assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(a.header("idempotency-expires"), None);
        let before = app.runs();
        let b = send(&r, pay_request(Some("c1"), Some(&key), ORDER, "")).await;
        assert_eq!(b.status, StatusCode::CREATED);
        assert_eq!(app.runs(), before + 1);
    }

    // A stored 4xx is replayed like a success.
    let a = send(
        &r,
        pay_request(Some("c1"), Some("\"refuse\""), ORDER, "refuse"),
    )
    .await;
    assert_eq!(a.status, StatusCode::PAYMENT_REQUIRED);
    let b = send(&r, pay_request(Some("c1"), Some("\"refuse\""), ORDER, "")).await;
    assert_eq!(b.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(b.body, a.body);
    assert_eq!(b.header("idempotent-replayed"), Some("true"));

    // An answer that is not JSON goes out and is replayed as it is, with its content type.
    let a = send(&r, pay_request(Some("c1"), Some("\"text\""), ORDER, "text")).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(a.body, "plain text");
    assert_eq!(a.header("content-type"), Some("text/plain; charset=utf-8"));
    let b = send(&r, pay_request(Some("c1"), Some("\"text\""), ORDER, "")).await;
    assert_eq!(b.body, a.body);
    assert_eq!(b.header("content-type"), a.header("content-type"));

    // Disposition::Keep leaves the claim in progress: 409 with Retry-After until the lease ends.
    let a = send(&r, pay_request(Some("c1"), Some("\"keep\""), ORDER, "keep")).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert!(a.header("idempotency-expires").is_some());
    let b = send(&r, pay_request(Some("c1"), Some("\"keep\""), ORDER, "")).await;
    assert_eq!(b.status, StatusCode::CONFLICT);
    assert_eq!(
        b.json()["title"],
        "A request is outstanding for this Idempotency-Key"
    );
    let retry_after: u64 = b.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
}

/// Header leak and loss: the first answer is the handler's (its Location, its content type, its
/// own JSON 400 not turned into problem+json); a replay carries the stored status, body, content
/// type and the allow-listed headers, never the first caller's Set-Cookie or request id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_headers_live_and_allow_listed_on_replay() {
    let cluster = Cluster::start().await;
    let app = Arc::new(App::default());
    let r = router(app.clone(), cluster.pool(), Duration::from_secs(60));
    let first = send(&r, pay_request(Some("c"), Some("\"h\""), ORDER, "headers")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, "got 7 bytes");
    assert_eq!(
        first.header("content-type"),
        Some("text/plain; charset=utf-8")
    );
    assert_eq!(first.header("location"), Some("/orders/7"));
    assert_eq!(first.header("set-cookie"), Some("session=first-caller"));
    assert_eq!(first.header("x-request-id"), Some("req-1"));
    assert_eq!(first.header("idempotency-key"), Some("\"h\""));
    let again = send(&r, pay_request(Some("c"), Some("\"h\""), ORDER, "")).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.body, "got 7 bytes");
    assert_eq!(
        again.header("content-type"),
        Some("text/plain; charset=utf-8")
    );
    assert_eq!(again.header("location"), Some("/orders/7"));
    assert_eq!(again.header("etag"), Some("\"v1\""));
    assert_eq!(again.header("set-cookie"), None);
    assert_eq!(again.header("x-request-id"), None);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.runs(), 1);

    let own = send(&r, pay_request(Some("c"), Some("\"o\""), ORDER, "own400")).await;
    assert_eq!(own.status, StatusCode::BAD_REQUEST);
    assert_eq!(own.header("content-type"), Some("application/json"));
    assert_eq!(own.json()["error"], "bad order");
    let again = send(&r, pay_request(Some("c"), Some("\"o\""), ORDER, "")).await;
    assert_eq!(again.status, StatusCode::BAD_REQUEST);
    assert_eq!(again.header("content-type"), Some("application/json"));
    assert_eq!(again.body, own.body);
}

/// A duplicate during the first request answered 409 at once: with `wait` it waits for the first
/// request's answer and replays it (the handler runs once); without, 409 as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_makes_a_duplicate_replay_the_first_answer() {
    let cluster = Cluster::start().await;
    let app = Arc::new(App::default());
    let r = common::router_with(app.clone(), cluster.pool(), Duration::from_secs(60), |l| {
        l.wait(Duration::from_secs(10))
    });
    let first = {
        let r = r.clone();
        tokio::spawn(async move {
            send(
                &r,
                pay_request(Some("c"), Some("\"w\""), ORDER, "sleep:1500"),
            )
            .await
        })
    };
    app.wait_runs(1).await;
    let started = std::time::Instant::now();
    let dup = send(&r, pay_request(Some("c"), Some("\"w\""), ORDER, "")).await;
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(dup.status, StatusCode::CREATED, "{}", dup.body);
    assert_eq!(dup.header("idempotent-replayed"), Some("true"));
    assert_eq!(dup.body, first.body);
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(app.runs(), 1);

    // The bound: a first request that outlasts it leaves the duplicate with 409.
    let r = common::router_with(app.clone(), cluster.pool(), Duration::from_secs(60), |l| {
        l.wait(Duration::from_millis(300))
    });
    let slow = {
        let r = r.clone();
        tokio::spawn(async move {
            send(
                &r,
                pay_request(Some("c"), Some("\"w2\""), ORDER, "sleep:2000"),
            )
            .await
        })
    };
    app.wait_runs(2).await;
    let started = std::time::Instant::now();
    let dup = send(&r, pay_request(Some("c"), Some("\"w2\""), ORDER, "")).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_then_replay() {
    let cluster = Cluster::start().await;
    let app = Arc::new(App::default());
    let r = router(app.clone(), cluster.pool(), Duration::from_secs(60));
    let first = send_waiting(&r, &app, ORDER).await;
    let busy = send(&r, pay_request(Some("c"), Some("\"k\""), ORDER, "")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert!(busy.header("retry-after").is_some());
    assert!(busy.header("idempotency-expires").is_some());
    app.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(&r, pay_request(Some("c"), Some("\"k\""), ORDER, "")).await;
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_of_identical_requests_runs_once() {
    let cluster = Cluster::start().await;
    let app = Arc::new(App::default());
    let r = router(app.clone(), cluster.pool(), Duration::from_secs(60));
    let tasks: Vec<_> = (0..25)
        .map(|_| {
            let r = r.clone();
            tokio::spawn(async move {
                send(
                    &r,
                    pay_request(Some("c"), Some("\"storm\""), ORDER, "sleep:500"),
                )
                .await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    assert_eq!(app.runs(), 1);
    let created: Vec<_> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED)
        .collect();
    let fresh = created
        .iter()
        .filter(|a| a.header("idempotent-replayed").is_none())
        .count();
    assert_eq!(fresh, 1);
    // The others were told to come back (or, arriving late, got the replay).
    assert!(answers
        .iter()
        .all(|a| a.status == StatusCode::CREATED || a.status == StatusCode::CONFLICT));
    let last = send(&r, pay_request(Some("c"), Some("\"storm\""), ORDER, "")).await;
    assert_eq!(last.body, created[0].body);
    assert_eq!(app.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_request_is_taken_over_after_the_lease() {
    let cluster = Arc::new(Cluster::start().await);
    let app = Arc::new(App::default());
    let lease = Duration::from_secs(3); // long enough for the 409 check on a loaded machine

    // A "process" of its own (runtime, pool) that claims and dies while the handler runs.
    {
        let (cluster, app) = (cluster.clone(), app.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let r = router(app.clone(), cluster.pool(), lease);
                tokio::spawn(async move {
                    send(&r, pay_request(Some("c"), Some("\"crash\""), ORDER, "wait")).await
                });
                app.wait_runs(1).await;
            });
            rt.shutdown_background(); // kill -9: no release, no complete
        })
        .join()
        .unwrap();
    }

    let r = router(app.clone(), cluster.pool(), lease);
    // The claim is still held: 409 until the lease runs out.
    let busy = send(&r, pay_request(Some("c"), Some("\"crash\""), ORDER, "")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    // Taken over: runs with a larger token; the retry's answer is stored once.
    let taken = send(&r, pay_request(Some("c"), Some("\"crash\""), ORDER, "")).await;
    assert_eq!(taken.status, StatusCode::CREATED, "{}", taken.body);
    assert_eq!(taken.json()["token"], 2);
    assert_eq!(app.runs(), 2);
    let again = send(&r, pay_request(Some("c"), Some("\"crash\""), ORDER, "")).await;
    assert_eq!(again.body, taken.body);
    assert_eq!(app.runs(), 2);
    let rows = cluster
        .query(
            "SELECT status::text, token FROM idempotency.idempotency_keys WHERE key = 'crash'",
            &[],
        )
        .await;
    assert_eq!(rows[0].get::<_, &str>(0), "completed");
    assert_eq!(rows[0].get::<_, i64>(1), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_restart_mid_request() {
    let cluster = Arc::new(Cluster::start().await);
    if !cluster.can_restart() {
        eprintln!("skipped: the server is not the tests' own to restart");
        return;
    }
    let app = Arc::new(App::default());
    let r = router(app.clone(), cluster.pool(), Duration::from_secs(60));
    // Warm the pool: its connections die with the restart.
    let warm = send(&r, pay_request(Some("c"), Some("\"warm\""), ORDER, "")).await;
    assert_eq!(warm.status, StatusCode::CREATED);

    let first = {
        let r = r.clone();
        tokio::spawn(
            async move { send(&r, pay_request(Some("c"), Some("\"k\""), ORDER, "wait")).await },
        )
    };
    app.wait_runs(2).await;
    // The claim is committed; the database goes down and comes back while the handler runs.
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.restart())
        .await
        .unwrap();
    app.gate.add_permits(1);
    // The answer is stored on a new connection: the request ran once and its answer is kept.
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    let again = send(&r, pay_request(Some("c"), Some("\"k\""), ORDER, "")).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_down_while_the_handler_runs() {
    // The database is away when the answer is to be stored and comes back later: the layer
    // keeps trying (until the claim's lease ends) and stores it then.
    let cluster = Arc::new(Cluster::start().await);
    if !cluster.can_restart() {
        eprintln!("skipped: the server is not the tests' own to restart");
        return;
    }
    let app = Arc::new(App::default());
    let r = router(app.clone(), cluster.pool(), Duration::from_secs(60));
    let first = send_waiting(&r, &app, ORDER).await;
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.stop()).await.unwrap();
    app.gate.add_permits(1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!first.is_finished());
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.start_again())
        .await
        .unwrap();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    let again = send(&r, pay_request(Some("c"), Some("\"k\""), ORDER, "")).await;
    assert_eq!(again.body, first.body);
    assert_eq!(app.runs(), 1);
}

/// The database stays away after the handler answered: storing the answer is retried until the
/// claim's lease ends (a retry may take the key over after that), then the caller gets 503 and
/// the request, retried after the lease, runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_is_retried_until_the_lease_ends() {
    let cluster = Arc::new(Cluster::start().await);
    if !cluster.can_restart() {
        eprintln!("skipped: the server is not the tests' own to stop");
        return;
    }
    let app = Arc::new(App::default());
    let lease = Duration::from_secs(3);
    let r = common::router_with(app.clone(), cluster.pool(), lease, |l| {
        l.connect_timeout(Duration::from_secs(1))
    });
    let sent = std::time::Instant::now();
    let first = send_waiting(&r, &app, ORDER).await;
    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.stop()).await.unwrap();
    app.gate.add_permits(1);
    let first = first.await.unwrap();
    let took = sent.elapsed();
    assert_eq!(
        first.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        first.body
    );
    assert!(
        took >= lease,
        "gave up after {took:?}, before the lease ended"
    );
    assert!(took < lease + Duration::from_secs(5), "{took:?}");

    let c = cluster.clone();
    tokio::task::spawn_blocking(move || c.start_again())
        .await
        .unwrap();
    let mut again = send(&r, pay_request(Some("c"), Some("\"k\""), ORDER, "")).await;
    for _ in 0..50 {
        if again.status != StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        // A pooler in front may take a moment to reach the server again.
        tokio::time::sleep(Duration::from_millis(200)).await;
        again = send(&r, pay_request(Some("c"), Some("\"k\""), ORDER, "")).await;
    }
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.body);
    if again.header("idempotent-replayed").is_some() {
        // A try given up on was still queued (in a pooler, waiting for the server) and stored
        // the answer when the server came back: the retry gets it, the handler ran once.
        assert_ne!(cluster.route(), common::Route::Direct);
        assert_eq!(again.json()["token"], 1);
        assert_eq!(app.runs(), 1);
    } else {
        // The request runs again: taken over after the lease (token 2), or released by a
        // queued try when the server came back (token 1 of a new claim).
        if cluster.route() == common::Route::Direct {
            assert_eq!(again.json()["token"], 2, "taken over after the lease");
        }
        assert_eq!(app.runs(), 2);
    }
}

fn raw_request(key: &str, content_type: Option<&str>, body: &'static [u8]) -> Request<Body> {
    let mut b = Request::post("/pay")
        .header("x-client-id", "c")
        .header("idempotency-key", key)
        .header("x-behave", "text");
    if let Some(ct) = content_type {
        b = b.header("content-type", ct);
    }
    b.body(Body::from(body)).unwrap()
}

/// Bodies that are not JSON were refused with 400 (an empty `POST /orders/{id}/cancel`, a form,
/// `text/plain`): now any body is accepted and fingerprinted as the Python and Node clients do
/// (a JSON type as jsonb, any other body by its SHA-256, an empty body as none), so that the
/// same request has the same fingerprint in all three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_body_is_accepted_and_fingerprinted_as_the_other_clients_do() {
    let cluster = Cluster::start().await;
    let app = Arc::new(App::default());
    let r = router(app.clone(), cluster.pool(), Duration::from_secs(60));
    let cases: [(&str, Option<&str>, &'static [u8]); 4] = [
        ("\"empty\"", None, b""),
        (
            "\"form\"",
            Some("application/x-www-form-urlencoded"),
            b"a=1&b=2",
        ),
        ("\"text\"", Some("text/plain"), b"hello"),
        ("\"untyped\"", None, b"{\"a\": 1}"),
    ];
    for (key, ct, body) in cases {
        let a = send(&r, raw_request(key, ct, body)).await;
        assert_eq!(a.status, StatusCode::CREATED, "{key}: {}", a.body);
        let b = send(&r, raw_request(key, ct, body)).await;
        assert_eq!(b.header("idempotent-replayed"), Some("true"), "{key}");
        // The reference fingerprint, the one the Python and Node clients' tests check as well.
        let k = key.trim_matches('"');
        let body_sql = if body.is_empty() {
            "NULL::jsonb".to_string()
        } else {
            "jsonb_build_object('sha256', encode(sha256($3::bytea), 'hex'))".to_string()
        };
        // $3 is always bound (to the body's bytes) so that the statement has one shape.
        let reference = format!(
            "SELECT (idempotency.claim($1, request => to_jsonb(encode(
                 idempotency.request_fingerprint('POST', '/pay', '{{}}'::jsonb, {body_sql}), 'hex')),
                 scope => $2)).outcome::text WHERE $3::bytea IS NOT NULL"
        );
        cluster
            .query(&reference, &[&k, &"reference", &body.to_vec()])
            .await;
        let rows = cluster
            .query(
                "SELECT a.request_hash = b.request_hash FROM idempotency.idempotency_keys a
                   JOIN idempotency.idempotency_keys b ON b.key = a.key AND b.scope = 'reference'
                  WHERE a.key = $1 AND a.scope = 'c:POST /pay'",
                &[&k],
            )
            .await;
        assert_eq!(rows.len(), 1, "{key}");
        assert!(
            rows[0].get::<_, bool>(0),
            "{key}: the reference fingerprint"
        );
    }
    // Another text body with the same key is another request.
    let other = send(&r, raw_request("\"text\"", Some("text/plain"), b"hellO")).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(app.runs(), 4);
}

/// A database that does not answer (accepts TCP connections, never replies): 503 problem+json
/// with `Retry-After` within the connect timeout, the handler not run; `fail_open` runs it
/// without the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_down_is_503_within_the_connect_timeout_or_fails_open() {
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut pg = tokio_postgres::Config::new();
    pg.host("127.0.0.1")
        .port(hole.local_addr().unwrap().port())
        .user("app")
        .dbname("shop");
    let pool = deadpool_postgres::Pool::builder(deadpool_postgres::Manager::new(
        pg,
        tokio_postgres::NoTls,
    ))
    .build()
    .unwrap();
    for fail_open in [false, true] {
        let app = Arc::new(App::default());
        let r = common::router_with(app.clone(), pool.clone(), Duration::from_secs(60), |l| {
            l.connect_timeout(Duration::from_secs(1))
                .fail_open(fail_open)
        });
        let started = std::time::Instant::now();
        let a = send(&r, pay_request(Some("c"), Some("\"down\""), ORDER, "")).await;
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{:?}",
            started.elapsed()
        );
        if fail_open {
            assert_eq!(a.status, StatusCode::CREATED);
            assert_eq!(a.body, "ran without the store");
            assert_eq!(app.runs(), 1);
        } else {
            assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(a.header("content-type"), Some("application/problem+json"));
            assert_eq!(a.header("retry-after"), Some("1"));
            assert_eq!(app.runs(), 0);
        }
    }
    drop(hole);
}

/// Stripe-style callers send the key unquoted: refused by default (the draft), accepted with
/// `lenient_keys`, as the same key as its quoted form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lenient_keys_accept_a_bare_key() {
    let cluster = Cluster::start().await;
    let app = Arc::new(App::default());
    let bare = "ab8e03978e-40d5-43e8-bc93-6894a57f9324";
    let strict = router(app.clone(), cluster.pool(), Duration::from_secs(60));
    let a = send(&strict, pay_request(Some("c"), Some(bare), ORDER, "")).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.json()["detail"].as_str().unwrap().starts_with(
        "Idempotency-Key is a bare Token, not a String: the key must be a structured-field String (RFC 9651) in double quotes"
    ));
    let r = common::router_with(app.clone(), cluster.pool(), Duration::from_secs(60), |l| {
        l.lenient_keys(true)
    });
    let a = send(&r, pay_request(Some("c"), Some(bare), ORDER, "")).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(a.header("idempotency-key"), Some(bare));
    let quoted = format!("\"{bare}\"");
    let b = send(&r, pay_request(Some("c"), Some(&quoted), ORDER, "")).await;
    assert_eq!(b.header("idempotent-replayed"), Some("true"));
    let spaced = send(&r, pay_request(Some("c"), Some("a b"), ORDER, "")).await;
    assert_eq!(spaced.status, StatusCode::BAD_REQUEST);
    assert_eq!(app.runs(), 1);
}
