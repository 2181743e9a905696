//! The tower [`Layer`]: claim before the inner service runs, complete or release after it.

// A scope function refuses a request with the response to send: an axum Response is what it is.
#![allow(clippy::result_large_err)]

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::MatchedPath;
use axum::http::request::Parts;
use axum::http::{HeaderName, Method, Request, StatusCode};
use axum::response::Response;
use deadpool_postgres::Pool;
use tower_layer::Layer;
use tower_service::Service;

use crate::otel::Op;
use crate::request::{read_with, IdemRequest};
use crate::response::{default_replay_headers, envelope, finish, problem, unavailable, Echo};
use crate::store::{self, Outcome};

/// Decides the scope of a request (who owns its key), or refuses it with a response (e.g. 401
/// when the client is not authenticated).
pub type ScopeFn = Arc<dyn Fn(&Parts) -> Result<String, Response> + Send + Sync>;

/// Checks a request before its key is claimed; an `Err` response is sent as it is and the key
/// stays free (a request that fails validation is not stored).
pub type CheckFn = Arc<dyn Fn(&IdemRequest) -> Result<(), Response> + Send + Sync>;

/// The default scope: `METHOD route`, the route as axum matched it (`/orders/{id}`) when the
/// layer is applied with `route_layer`, the path otherwise.
pub fn route_scope(parts: &Parts) -> String {
    let route = parts
        .extensions
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| parts.uri.path().to_string());
    format!("{} {route}", parts.method)
}

/// Put into the request's extensions for the inner service once its key is claimed (`new`):
/// extract it with `axum::Extension<Claimed>` to checkpoint, derive keys for downstream calls,
/// or complete the key yourself in your own transaction (then answer with [`Disposition::Keep`]).
#[derive(Debug, Clone)]
pub struct Claimed {
    pub key: String,
    pub scope: String,
    /// The fencing token: pass it to `complete`, `checkpoint` and `release`.
    pub token: Option<i64>,
    /// The last checkpoint of a crashed attempt this claim took over, if any.
    pub recovery_point: Option<String>,
    pub expires_at: Option<SystemTime>,
    /// The request as it was claimed (what its fingerprint was made of), for calling the
    /// [`store`] functions yourself.
    pub request: IdemRequest,
}

/// What the layer does with the claim after the inner service answered. Put it into the
/// response's extensions to choose; without it a 5xx answer is [`Release`](Disposition::Release)d
/// and any other is [`Complete`](Disposition::Complete)d.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Store the status and body with `complete`: every retry gets them back.
    Complete,
    /// `release` the key: the next retry runs as new (nothing happened, or it may run again).
    Release,
    /// Leave the claim as it is: the handler completed it itself, or the outcome of its side
    /// effect is unknown and a retry must take it over after the lease (and resume).
    Keep,
}

struct Config {
    pool: Pool,
    ttl: Duration,
    lease: Duration,
    methods: Vec<Method>,
    body_limit: usize,
    require_key: bool,
    reconnect_for: Option<Duration>,
    prepared: bool,
    scope: ScopeFn,
    check: Option<CheckFn>,
    replay_headers: Vec<HeaderName>,
    wait: Duration,
    connect_timeout: Duration,
    fail_open: bool,
    lenient_keys: bool,
}

/// Makes the routes it wraps idempotent under the IETF Idempotency-Key draft, with the
/// `idempotency` extension as the store (the leased style: the claim commits before the inner
/// service runs, so a crashed request is taken over after its lease).
#[derive(Clone)]
pub struct IdempotencyLayer {
    cfg: Arc<Config>,
}

impl IdempotencyLayer {
    /// Defaults: TTL 24 hours, lease 5 minutes, methods POST and PATCH, bodies up to 1 MiB, the key
    /// required, scope [`route_scope`], completion retried on new connections until the claim's
    /// lease ends, unnamed statements (safe behind a transaction-mode pooler).
    pub fn new(pool: Pool) -> IdempotencyLayer {
        IdempotencyLayer {
            cfg: Arc::new(Config {
                pool,
                ttl: Duration::from_secs(86_400),
                lease: Duration::from_secs(300),
                methods: vec![Method::POST, Method::PATCH],
                body_limit: 1 << 20,
                require_key: true,
                reconnect_for: None,
                prepared: false,
                scope: Arc::new(|p: &Parts| Ok(route_scope(p))),
                check: None,
                replay_headers: default_replay_headers(),
                wait: Duration::ZERO,
                connect_timeout: Duration::from_secs(5),
                fail_open: false,
                lenient_keys: false,
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Config)) -> IdempotencyLayer {
        let mut cfg = Config {
            pool: self.cfg.pool.clone(),
            ttl: self.cfg.ttl,
            lease: self.cfg.lease,
            methods: self.cfg.methods.clone(),
            body_limit: self.cfg.body_limit,
            require_key: self.cfg.require_key,
            reconnect_for: self.cfg.reconnect_for,
            prepared: self.cfg.prepared,
            scope: self.cfg.scope.clone(),
            check: self.cfg.check.clone(),
            replay_headers: self.cfg.replay_headers.clone(),
            wait: self.cfg.wait,
            connect_timeout: self.cfg.connect_timeout,
            fail_open: self.cfg.fail_open,
            lenient_keys: self.cfg.lenient_keys,
        };
        f(&mut cfg);
        self.cfg = Arc::new(cfg);
        self
    }

    /// How long a key is remembered after its request completed (the claim's and complete's
    /// `ttl`). Panics when zero.
    pub fn ttl(self, ttl: Duration) -> IdempotencyLayer {
        assert!(!ttl.is_zero(), "the ttl must be positive");
        self.with(|c| c.ttl = ttl)
    }

    /// How long a claimed request may run before a retry takes it over (the claim's `lease`; at
    /// most the ttl). Panics when zero.
    pub fn lease(self, lease: Duration) -> IdempotencyLayer {
        assert!(!lease.is_zero(), "the lease must be positive");
        self.with(|c| c.lease = lease)
    }

    /// The methods that are made idempotent; requests with other methods pass through.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> IdempotencyLayer {
        let m = methods.into_iter().collect();
        self.with(|c| c.methods = m)
    }

    /// The largest request body read (413 above it).
    pub fn body_limit(self, bytes: usize) -> IdempotencyLayer {
        self.with(|c| c.body_limit = bytes)
    }

    /// Whether a request without `Idempotency-Key` is refused with 400 (the default) or passes
    /// through without idempotency.
    pub fn require_key(self, required: bool) -> IdempotencyLayer {
        self.with(|c| c.require_key = required)
    }

    /// How long the layer keeps trying, on new connections, to store an answer (or release the
    /// key) after the connection broke or the database went away while the inner service ran,
    /// counted from the inner service's answer. By default it tries until the claim's lease ends:
    /// after that a retry of the request may take the key over and run it again.
    pub fn reconnect_for(self, d: Duration) -> IdempotencyLayer {
        self.with(|c| c.reconnect_for = Some(d))
    }

    /// Use prepared statements, prepared once per pooled connection and cached (off by
    /// default). Off, every statement is unnamed and sent with its parameters in one round trip,
    /// which works through any pooler, PgBouncer in transaction mode included, and on a
    /// connection that the pooler gives another client between transactions. Turn it on for a
    /// direct connection, a session-mode pooler, or one that tracks prepared statements per
    /// client (PgBouncer 1.21+ with `max_prepared_statements`): it saves the server parsing
    /// and planning the layer's statements anew for each request.
    pub fn prepared_statements(self, on: bool) -> IdempotencyLayer {
        self.with(|c| c.prepared = on)
    }

    /// How long a duplicate waits for the first request's answer (polling the store) before it
    /// answers 409: zero (the default) answers 409 at once; with a bound, a duplicate that
    /// arrives while the first request runs gets its answer as a replay once it is stored (or
    /// runs itself if the first released the key). Same semantics as the Python and Node
    /// adapters' `wait`.
    pub fn wait(self, wait: Duration) -> IdempotencyLayer {
        self.with(|c| c.wait = wait)
    }

    /// How long the claim waits for a connection from the pool (a new one included: a database
    /// that does not answer) before the request is answered 503 problem+json with
    /// `Retry-After: 1` and nothing claimed. Default 5 seconds.
    pub fn connect_timeout(self, d: Duration) -> IdempotencyLayer {
        self.with(|c| c.connect_timeout = d)
    }

    /// Fail open (off by default): when the database cannot be reached for the claim, the inner
    /// service runs without the store, so a retry of a request that did run runs again. For a
    /// service that prefers availability to exactly-once (README, "Database down").
    pub fn fail_open(self, on: bool) -> IdempotencyLayer {
        self.with(|c| c.fail_open = on)
    }

    /// Accept a bare (unquoted, Stripe-style) key, `Idempotency-Key: 8e03978e-...`, as well as
    /// the draft's String (off by default: the draft refuses it). `abc` and `"abc"` are one key.
    pub fn lenient_keys(self, on: bool) -> IdempotencyLayer {
        self.with(|c| c.lenient_keys = on)
    }

    /// The headers of the handler's answer that are stored and replayed besides `Content-Type`
    /// (default [`crate::response::REPLAY_HEADERS`]: `Location`, `Content-Location`, `ETag`,
    /// `Last-Modified`, `Link`). `Set-Cookie`, `Date`, `Content-Length` and the idempotency
    /// headers are never stored, whatever the list says. The first answer always goes out with
    /// all of the handler's headers.
    pub fn replay_headers(self, names: impl IntoIterator<Item = HeaderName>) -> IdempotencyLayer {
        let n = names.into_iter().collect();
        self.with(|c| c.replay_headers = n)
    }

    /// Who owns a key: e.g. `format!("{client}:{}", route_scope(parts))` so that two clients
    /// never share one. An `Err` response is sent as it is (with the idempotency headers).
    pub fn scope<F>(self, f: F) -> IdempotencyLayer
    where
        F: Fn(&Parts) -> Result<String, Response> + Send + Sync + 'static,
    {
        self.with(|c| c.scope = Arc::new(f))
    }

    /// Validates the request (its key, query and JSON body are read already) before the key is
    /// claimed: an `Err` response (say, 422 for a body that is not an order) is sent with the
    /// idempotency headers, nothing is stored, and the key stays free for the corrected request.
    pub fn check<F>(self, f: F) -> IdempotencyLayer
    where
        F: Fn(&IdemRequest) -> Result<(), Response> + Send + Sync + 'static,
    {
        self.with(|c| c.check = Some(Arc::new(f)))
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Idempotency<S> {
        Idempotency {
            inner,
            cfg: self.cfg.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around the inner one.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    cfg: Arc<Config>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S> Service<Request<Body>> for Idempotency<S>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The inner service is made ready right before it is called.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        let cfg = self.cfg.clone();
        Box::pin(async move { Ok(handle(cfg, inner, req).await) })
    }
}

async fn call_inner<S>(mut inner: S, req: Request<Body>) -> Response
where
    S: Service<Request<Body>, Response = Response, Error = Infallible>,
{
    let ready = std::future::poll_fn(|cx| inner.poll_ready(cx)).await;
    match ready {
        Ok(()) => match inner.call(req).await {
            Ok(r) => r,
            Err(e) => match e {},
        },
        Err(e) => match e {},
    }
}

fn internal(echo: &Echo, detail: &str) -> Response {
    finish(
        problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            detail,
        ),
        echo,
    )
}

async fn handle<S>(cfg: Arc<Config>, inner: S, req: Request<Body>) -> Response
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    if !cfg.methods.contains(req.method())
        || (!cfg.require_key && !req.headers().contains_key(crate::key::HEADER))
    {
        return call_inner(inner, req).await;
    }
    let (parts, body) = req.into_parts();
    let echo = Echo {
        key: parts.headers.get(crate::key::HEADER).cloned(),
        ..Echo::default()
    };
    let scope = match (cfg.scope)(&parts) {
        Ok(s) => s,
        Err(r) => return finish(r, &echo),
    };
    let bytes = match axum::body::to_bytes(body, cfg.body_limit).await {
        Ok(b) => b,
        Err(_) => {
            let r = problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "The body is too large",
                &format!("the body may have at most {} bytes", cfg.body_limit),
            );
            return finish(r, &echo);
        }
    };
    let path = parts.uri.path().to_string();
    let ir = match read_with(
        parts.method.as_str(),
        &path,
        scope,
        &parts.uri,
        &parts.headers,
        &bytes,
        cfg.lenient_keys,
    ) {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Some(check) = &cfg.check {
        if let Err(r) = check(&ir) {
            return finish(r, &ir.echo);
        }
    }
    let echo = ir.echo.clone();
    // The rest runs in a task of its own, to the end, even if the client hangs up: a cancelled
    // request would leave its claim to wait for the lease.
    match tokio::spawn(run(cfg, inner, parts, bytes, ir)).await {
        Ok(r) => r,
        Err(_) => internal(&echo, "retry with the same Idempotency-Key"),
    }
}

async fn run<S>(
    cfg: Arc<Config>,
    inner: S,
    mut parts: Parts,
    bytes: Bytes,
    ir: IdemRequest,
) -> Response
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let ttl = cfg.ttl.as_secs_f64();
    let lease = cfg.lease.min(cfg.ttl).as_secs_f64();
    let started = Instant::now();
    let deadline = started + cfg.wait;
    let mut pause = Duration::from_millis(50);
    // The claim's span: the claim and the waits for an in-progress key, not the handler.
    let op = Op::claim(&ir.scope, &ir.key);
    let mut polled = false;
    let (c, lease_ends) = loop {
        let client = match tokio::time::timeout(cfg.connect_timeout, cfg.pool.get()).await {
            Ok(Ok(c)) => c,
            _ => {
                op.failed_as("connection");
                drop(op);
                return down(&cfg, inner, parts, bytes, &ir).await;
            }
        };
        let db = pooled(&cfg, &client);
        // The server starts the lease when it runs the claim, which is after this instant: the
        // end computed from it is never later than the server's.
        let claimed_at = Instant::now();
        let c = match store::claim_via(&db, &ir, ttl, lease).await {
            Ok(c) => c,
            Err(e) => {
                op.failed(&e);
                drop(op);
                if store::is_transient(&e) {
                    return down(&cfg, inner, parts, bytes, &ir).await;
                }
                return store::db_error(&e, &ir.echo);
            }
        };
        let now = Instant::now();
        if c.outcome == Outcome::InProgress && now < deadline {
            // A duplicate waits for the first request's answer, off the connection.
            drop(client);
            polled = true;
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(500));
            continue;
        }
        op.claimed(&c);
        if polled {
            op.waited(now - started);
        }
        if c.outcome != Outcome::New {
            drop(op);
            return store::answer_via(&db, &ir, &c, &cfg.replay_headers).await;
        }
        break (c, claimed_at + Duration::from_secs_f64(lease));
    }; // the connection goes back to the pool while the inner service runs
    drop(op);
    parts.extensions.insert(Claimed {
        key: ir.key.clone(),
        scope: ir.scope.clone(),
        token: c.token,
        recovery_point: c.recovery_point.clone(),
        expires_at: c.expires_at,
        request: ir.clone(),
    });
    let req = Request::from_parts(parts, Body::from(bytes));
    // A panic in the inner service is a 500 that releases the key.
    let resp = match tokio::spawn(call_inner(inner, req)).await {
        Ok(r) => r,
        Err(_) => {
            let mut r = internal(&Echo::default(), "retry with the same Idempotency-Key");
            r.extensions_mut().insert(Disposition::Release);
            r
        }
    };
    let disposition = resp.extensions().get::<Disposition>().copied().unwrap_or(
        if resp.status().is_server_error() {
            Disposition::Release
        } else {
            Disposition::Complete
        },
    );
    let echo = Echo {
        expires: c.expires_at,
        ..ir.echo.clone()
    };
    let retry_until = match cfg.reconnect_for {
        Some(d) => Instant::now() + d,
        None => lease_ends,
    };
    match disposition {
        Disposition::Keep => finish_missing(resp, echo),
        Disposition::Release => {
            release(&cfg, retry_until, &ir, c.token).await;
            finish_missing(
                resp,
                Echo {
                    expires: None,
                    ..echo
                },
            )
        }
        Disposition::Complete => complete(&cfg, &ir, &c, resp, ttl, retry_until).await,
    }
}

/// A pooled connection as the layer sends statements on it.
fn pooled<'c>(cfg: &Config, client: &'c deadpool_postgres::Object) -> store::Pooled<'c> {
    store::Pooled {
        client,
        prepared: cfg.prepared,
    }
}

/// The database could not be reached for the claim: 503 with `Retry-After`, nothing claimed; or,
/// failing open, the inner service runs without the store.
async fn down<S>(cfg: &Config, inner: S, parts: Parts, bytes: Bytes, ir: &IdemRequest) -> Response
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    if !cfg.fail_open {
        return unavailable(&ir.echo);
    }
    eprintln!("idempotency: the database is unreachable; running the handler without the store");
    let resp = call_inner(inner, Request::from_parts(parts, Body::from(bytes))).await;
    finish_missing(resp, ir.echo.clone())
}

/// Adds the idempotency headers that the handler's response does not have already.
fn finish_missing(resp: Response, mut echo: Echo) -> Response {
    let h = resp.headers();
    if h.contains_key(crate::key::HEADER) {
        echo.key = None;
    }
    if h.contains_key("idempotency-expires") {
        echo.expires = None;
    }
    if h.contains_key(axum::http::header::RETRY_AFTER) {
        echo.retry_after = None;
    }
    finish(resp, &echo)
}

async fn complete(
    cfg: &Config,
    ir: &IdemRequest,
    c: &store::Claim,
    resp: Response,
    ttl: f64,
    retry_until: Instant,
) -> Response {
    let status = resp.status();
    let (rparts, rbody) = resp.into_parts();
    let body = match axum::body::to_bytes(rbody, usize::MAX).await {
        Ok(b) => b,
        Err(_) => Bytes::new(),
    };
    let text = envelope(&rparts.headers, &body, &cfg.replay_headers);
    let status_i = i32::from(status.as_u16());
    let (key, scope, token) = (ir.key.as_str(), ir.scope.as_str(), c.token);
    let text = text.as_str();
    let op = Op::complete(scope, key, token);
    let mut done = retrying(cfg, retry_until, Some(&op), |db| async move {
        let r = store::complete_via(
            &pooled(cfg, &db),
            key,
            scope,
            token,
            status_i,
            text,
            Some(ttl),
        )
        .await
        .map(|(_, exp)| exp);
        (db, r)
    })
    .await;
    if matches!(&done, Err(Some(e)) if store::sqlstate(e) == Some("IK002")) {
        // Already completed: by this very completion if an earlier try committed and only its
        // answer was lost with the connection. The token tells: nobody else holds it.
        let ours = retrying(cfg, retry_until, None, |db| async move {
            let r = store::completed_with(&pooled(cfg, &db), key, scope, token).await;
            (db, r)
        })
        .await;
        if let Ok(Some(expires)) = ours {
            done = Ok(expires);
        }
    }
    match &done {
        Ok(_) => {}
        Err(Some(e)) => op.failed(e),
        Err(None) => op.failed_as("connection"),
    }
    drop(op);
    match done {
        Ok(expires) => {
            // The live answer is the handler's, untouched but for the idempotency headers.
            let echo = Echo {
                expires: Some(expires),
                ..ir.echo.clone()
            };
            finish_missing(Response::from_parts(rparts, Body::from(body)), echo)
        }
        Err(Some(e)) if store::is_fenced_off(&e) || store::sqlstate(&e) == Some("IK001") => {
            fenced_off(cfg, ir).await
        }
        Err(e) => {
            // The answer cannot be stored (the database stayed away, or refused it): give the key back if we still can.
            release(cfg, Instant::now(), ir, c.token).await;
            match e {
                None => unavailable(&ir.echo),
                Some(e) if store::is_transient(&e) => unavailable(&ir.echo),
                Some(e) => internal(
                    &ir.echo,
                    &format!(
                        "the answer could not be stored ({}); retry with the same Idempotency-Key",
                        store::describe(&e)
                    ),
                ),
            }
        }
    }
}

/// `complete` was refused: another worker took the key over or finished it, or the claim is
/// gone. Answer with what the store says now.
async fn fenced_off(cfg: &Config, ir: &IdemRequest) -> Response {
    let Ok(client) = cfg.pool.get().await else {
        return unavailable(&ir.echo);
    };
    let db = pooled(cfg, &client);
    let op = Op::claim(&ir.scope, &ir.key);
    let c = match store::claim_via(
        &db,
        ir,
        cfg.ttl.as_secs_f64(),
        cfg.lease.min(cfg.ttl).as_secs_f64(),
    )
    .await
    {
        Ok(c) => c,
        Err(e) => {
            op.failed(&e);
            return store::db_error(&e, &ir.echo);
        }
    };
    op.claimed(&c);
    drop(op);
    if c.outcome == Outcome::New {
        // Do not start over inside this request.
        let op = Op::release(&ir.scope, &ir.key, c.token);
        if let Ok(released) = op.result(store::release_via(&db, &ir.key, &ir.scope, c.token).await)
        {
            op.released(released);
        }
        let mut echo = ir.echo.clone();
        echo.retry_after = Some(1);
        return finish(
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "retry",
                "Retry",
                "the claim of this key was lost; retry with the same Idempotency-Key",
            ),
            &echo,
        );
    }
    store::answer_via(&db, ir, &c, &cfg.replay_headers).await
}

/// `release`, retried on new connections until `deadline`.
async fn release(cfg: &Config, deadline: Instant, ir: &IdemRequest, token: Option<i64>) {
    let (key, scope) = (ir.key.as_str(), ir.scope.as_str());
    let op = Op::release(scope, key, token);
    match retrying(cfg, deadline, Some(&op), |db| async move {
        let r = store::release_via(&pooled(cfg, &db), key, scope, token).await;
        (db, r)
    })
    .await
    {
        Ok(released) => op.released(released),
        Err(Some(e)) => op.failed(&e),
        Err(None) => op.failed_as("connection"),
    }
}

/// Runs `f` on a pooled connection; after a transient error (connection lost, server restarting,
/// the pooler's own failure) again on a new one, with backoff, until `deadline` (at least once).
/// `Err(None)`: no connection could be had. `op` counts the tries after the first.
///
/// `f` gets the connection and hands it back with its result (a closure that borrowed it would
/// make the future not `Send`).
async fn retrying<T, F, Fut>(
    cfg: &Config,
    deadline: Instant,
    op: Option<&Op>,
    mut f: F,
) -> Result<T, Option<tokio_postgres::Error>>
where
    F: FnMut(deadpool_postgres::Object) -> Fut,
    Fut: Future<Output = (deadpool_postgres::Object, Result<T, tokio_postgres::Error>)>,
{
    let mut pause = Duration::from_millis(50);
    loop {
        // A try may wait past the deadline by the connect timeout at most: a pooler queues a
        // statement while it cannot reach the server (PgBouncer for up to query_wait_timeout).
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .max(cfg.connect_timeout);
        let last = match pool_get(cfg).await {
            Some(client) => match tokio::time::timeout(wait, f(client)).await {
                Ok((_, Ok(v))) => return Ok(v),
                Ok((_, Err(e))) if !store::is_transient(&e) => return Err(Some(e)),
                Ok((client, Err(e))) => {
                    // Not back into the pool: a connection that failed this way may look open
                    // (the pooler's error left it up) and would fail the next try the same way.
                    drop(deadpool_postgres::Object::take(client));
                    Some(e)
                }
                // Given up on; if it commits still, the next try finds the key completed with
                // this token.
                Err(_) => None,
            },
            None => None,
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(last);
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(Duration::from_secs(1));
        if let Some(op) = op {
            op.retried();
        }
    }
}

/// A connection from the pool, waiting for one at most the connect timeout: a database that does
/// not answer is tried again (until the deadline), a pool that is busy is waited for.
async fn pool_get(cfg: &Config) -> Option<deadpool_postgres::Object> {
    match tokio::time::timeout(cfg.connect_timeout, cfg.pool.get()).await {
        Ok(Ok(c)) => Some(c),
        _ => None,
    }
}
