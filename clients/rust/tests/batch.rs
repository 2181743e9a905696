//! `store::claim_many` and `store::complete_many` against a real cluster: every outcome of a
//! batch in input order, a duplicate key within it, all-or-nothing completion.

mod common;

use common::Cluster;
use idempotency_axum::store::{self, Outcome};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_many_answers_each_position_in_input_order_and_complete_many_stores_them() {
    let cluster = Cluster::start().await;
    let pool = cluster.pool();
    let db = pool.get().await.unwrap();

    // Before the batch: "done" completed, "held" claimed by another worker.
    let done = store::claim_many(
        &**db,
        &["done"],
        Some(&[Some(r#"{"n":1}"#)]),
        "ev",
        None,
        None,
    )
    .await
    .unwrap();
    assert_eq!(done[0].outcome, Outcome::New);
    store::complete_many(
        &**db,
        &["done"],
        &[Some(r#"{"ok":1}"#)],
        None,
        "ev",
        Some(&[done[0].token]),
        None,
    )
    .await
    .unwrap();
    store::claim_many(&**db, &["held"], None, "ev", None, Some(300.0))
        .await
        .unwrap();

    let keys = ["z-new", "done", "held", "done", "a-new", "z-new", "z-new"];
    let requests = [
        Some(r#"{"n":9}"#),
        Some(r#"{"n":1}"#),
        None,
        Some(r#"{"n":2}"#),
        None,
        Some(r#"{"n":9}"#),
        Some(r#"{"n":8}"#),
    ];
    let cs = store::claim_many(
        &**db,
        &keys,
        Some(&requests),
        "ev",
        Some(3600.0),
        Some(60.0),
    )
    .await
    .unwrap();
    let outcomes: Vec<Outcome> = cs.iter().map(|c| c.outcome).collect();
    assert_eq!(
        outcomes,
        [
            Outcome::New,
            Outcome::Replay,
            Outcome::InProgress,
            Outcome::Mismatch,
            Outcome::New,
            Outcome::InProgress,
            Outcome::Mismatch
        ]
    );
    assert_eq!(cs[1].response.as_deref(), Some(r#"{"ok": 1}"#));
    assert!(cs[2].retry_after.unwrap() > 240);
    assert!(cs[0].token.is_some() && cs[4].token.is_some());

    let expires = store::complete_many(
        &**db,
        &["z-new", "a-new"],
        &[Some(r#"{"r":"z"}"#), None],
        Some(&[201, 204]),
        "ev",
        Some(&[cs[0].token, cs[4].token]),
        None,
    )
    .await
    .unwrap();
    assert_eq!(expires.len(), 2);
    let again = store::claim_many(&**db, &["a-new", "z-new"], None, "ev", None, None)
        .await
        .unwrap();
    assert_eq!(
        again
            .iter()
            .map(|c| (c.outcome, c.response.clone(), c.response_status))
            .collect::<Vec<_>>(),
        [
            (Outcome::Replay, None, Some(204)),
            (
                Outcome::Replay,
                Some(r#"{"r": "z"}"#.to_string()),
                Some(201)
            )
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_many_is_all_or_nothing_and_names_the_fenced_key() {
    let cluster = Cluster::start().await;
    let pool = cluster.pool();
    let db = pool.get().await.unwrap();
    let cs = store::claim_many(&**db, &["a", "b"], None, "ev", None, None)
        .await
        .unwrap();
    store::complete(&**db, "b", "ev", cs[1].token, 200, r#""other""#, None)
        .await
        .unwrap();
    let err = store::complete_many(
        &**db,
        &["a", "b"],
        &[Some(r#""ra""#), Some(r#""rb""#)],
        None,
        "ev",
        Some(&[cs[0].token, cs[1].token]),
        None,
    )
    .await
    .unwrap_err();
    assert!(store::is_fenced_off(&err), "{}", store::describe(&err));
    assert!(
        store::describe(&err).contains("key 'b'"),
        "{}",
        store::describe(&err)
    );
    let rows = cluster
        .query(
            "SELECT status::text FROM idempotency.lookup('a', 'ev')",
            &[],
        )
        .await;
    assert_eq!(rows[0].get::<_, &str>(0), "in_progress"); // nothing written
}
