//! A throwaway PostgreSQL cluster for the tests, and a small axum app behind the layer.
//!
//! The cluster is made with the server's own `initdb` and `pg_ctl` (from `PG_BIN`, default
//! `/usr/lib/postgresql/15/bin`) in a fresh directory under the system's temp dir, listening on
//! a Unix socket only; run as root, they run as the `postgres` OS user (initdb refuses root).
//! The `idempotency` extension must be installed into that server.
//!
//! `IDEMPOTENCY_TEST_POOLER` (`direct`, the default, `transaction` or `session`) puts PgBouncer
//! (`PGBOUNCER`, default `/usr/sbin/pgbouncer`) in that pool mode between the layer and the
//! cluster, as tests/integration/pooler.py does for the other clients: [`Cluster::config`] and
//! [`Cluster::pool`] are then the pooler's address, while [`Cluster::query`], which the tests
//! use to look into the store, stays a direct connection.
//!
//! `IDEMPOTENCY_TEST_CONNINFO` (a libpq keyword string or URL, a role that may create databases)
//! targets an existing server with the extension installed instead: each test gets a database of
//! its own there (`CREATE DATABASE`, dropped after it), and the tests that stop or restart the
//! server are skipped.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use idempotency_axum::{route_scope, Claimed, Disposition, IdempotencyLayer};
use tokio::sync::Semaphore;
use tokio_postgres::NoTls;
use tower::ServiceExt;

pub struct Cluster {
    pub dir: PathBuf,
    pub port: u16,
    bin: PathBuf,
    /// The pooler the layer's connections go through, if `IDEMPOTENCY_TEST_POOLER` asks for one.
    pub pooler: Option<PgBouncer>,
    /// `IDEMPOTENCY_TEST_CONNINFO`'s server (as given, and with this test's database): no
    /// cluster of our own.
    existing: Option<(tokio_postgres::Config, tokio_postgres::Config)>,
}

/// How the tests' applications reach the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Direct,
    Transaction,
    Session,
}

impl Route {
    /// `IDEMPOTENCY_TEST_POOLER`: `direct` (or unset), `transaction` or `session`.
    pub fn from_env() -> Route {
        match std::env::var("IDEMPOTENCY_TEST_POOLER").as_deref() {
            Err(_) | Ok("") | Ok("direct") => Route::Direct,
            Ok("transaction") => Route::Transaction,
            Ok("session") => Route::Session,
            Ok(other) => panic!(
                "IDEMPOTENCY_TEST_POOLER must be direct, transaction or session, not {other:?}"
            ),
        }
    }
}

/// PgBouncer in front of a cluster, on a port of its own, with an ini and a user list of its
/// own in a directory of its own, run as the `postgres` OS user (it refuses to run as root).
/// Clients are let in without a password (`auth_type = trust`).
pub struct PgBouncer {
    pub port: u16,
    pub mode: Route,
    dir: PathBuf,
    child: std::process::Child,
    user: String,
    dbname: String,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl PgBouncer {
    /// Starts PgBouncer in `mode` (transaction or session) in front of `cluster` and waits until
    /// it answers.
    pub async fn start(cluster: &Cluster, mode: Route) -> PgBouncer {
        let pool_mode = match mode {
            Route::Transaction => "transaction",
            Route::Session => "session",
            Route::Direct => panic!("a pooler needs a pool mode"),
        };
        let dir = cluster.dir.join("pgbouncer");
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        let server = cluster.direct_config();
        let user = server.get_user().unwrap_or("postgres").to_string();
        let dbname = server.get_dbname().unwrap_or("postgres").to_string();
        // The password, if any, is the one PgBouncer logs in to the server with.
        let password = String::from_utf8_lossy(server.get_password().unwrap_or(b"")).to_string();
        let (host, server_port) = match (server.get_hosts().first(), server.get_ports().first()) {
            (Some(tokio_postgres::config::Host::Tcp(h)), p) => (h.clone(), *p.unwrap_or(&5432)),
            (Some(tokio_postgres::config::Host::Unix(d)), p) => {
                (d.display().to_string(), *p.unwrap_or(&5432))
            }
            (None, _) => panic!("the server has no host"),
        };
        std::fs::write(
            dir.join("userlist.txt"),
            format!("\"{user}\" \"{}\"\n", password.replace('"', "\"\"")),
        )
        .unwrap();
        // default_pool_size: session mode holds a server connection per client connection, and
        // the tests open up to two pools of 8 at once. server_login_retry: after the cluster was
        // stopped, try it again within a second rather than PgBouncer's 15.
        let ini = format!(
            "[databases]\n* = host={host} port={server_port}\n\n[pgbouncer]\n\
             listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir = {dir}\n\
             auth_type = trust\nauth_file = {dir}/userlist.txt\nadmin_users = {user}\n\
             pool_mode = {pool_mode}\ndefault_pool_size = 40\nmax_client_conn = 400\n\
             logfile = {dir}/pgbouncer.log\npidfile = {dir}/pgbouncer.pid\n\
             ignore_startup_parameters = extra_float_digits\n\
             server_reset_query = DISCARD ALL\nserver_check_delay = 0\nserver_login_retry = 1\n",
            dir = dir.display(),
        );
        std::fs::write(dir.join("pgbouncer.ini"), ini).unwrap();
        chmod(&dir, "-R");
        let program = PathBuf::from(
            std::env::var("PGBOUNCER").unwrap_or_else(|_| "/usr/sbin/pgbouncer".into()),
        );
        let child = as_postgres(&program)
            .arg(dir.join("pgbouncer.ini"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("cannot start pgbouncer");
        let mut bouncer = PgBouncer {
            port,
            mode,
            dir,
            child,
            user,
            dbname,
        };
        for _ in 0..150 {
            if let Ok((db, conn)) = bouncer.config().connect(NoTls).await {
                tokio::spawn(conn);
                if db.simple_query("SELECT 1").await.is_ok() {
                    return bouncer;
                }
            }
            if let Ok(Some(status)) = bouncer.child.try_wait() {
                panic!("pgbouncer exited ({status}): {}", bouncer.log());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("pgbouncer did not answer: {}", bouncer.log());
    }

    pub fn config(&self) -> tokio_postgres::Config {
        let mut c = tokio_postgres::Config::new();
        c.host("127.0.0.1")
            .port(self.port)
            .user(&self.user)
            .dbname(&self.dbname);
        c
    }

    /// A command on PgBouncer's admin console (`SHOW POOLS`, ...): its rows.
    pub async fn admin(&self, command: &str) -> Vec<tokio_postgres::SimpleQueryRow> {
        let (db, conn) = self
            .config()
            .dbname("pgbouncer")
            .connect(NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        db.simple_query(command)
            .await
            .unwrap()
            .into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
                _ => None,
            })
            .collect()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // SIGINT is PgBouncer's immediate shutdown; sent to PgBouncer itself (its pid file),
        // not to runuser.
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pgbouncer.pid")) {
            let _ = Command::new("kill").args(["-INT", pid.trim()]).output();
        }
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn chmod(path: &std::path::Path, flag: &str) {
    run({
        let mut c = Command::new("chmod");
        if !flag.is_empty() {
            c.arg(flag);
        }
        c.arg("777").arg(path);
        c
    });
}

fn as_postgres(program: &PathBuf) -> Command {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.trim_ascii() == b"0")
        .unwrap_or(false);
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn run(mut c: Command) {
    let out = c.output().expect("cannot run a PostgreSQL program");
    assert!(
        out.status.success(),
        "{c:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

static SEQ: AtomicUsize = AtomicUsize::new(0);

impl Cluster {
    /// initdb, start, `CREATE EXTENSION idempotency` in the `postgres` database (or a database
    /// of its own on `IDEMPOTENCY_TEST_CONNINFO`'s server); then the pooler, if asked for.
    pub async fn start() -> Cluster {
        let mut cluster = match std::env::var("IDEMPOTENCY_TEST_CONNINFO") {
            Ok(conninfo) if !conninfo.is_empty() => Cluster::on_existing(&conninfo).await,
            _ => Cluster::initdb().await,
        };
        let route = Route::from_env();
        if route != Route::Direct {
            cluster.pooler = Some(PgBouncer::start(&cluster, route).await);
        }
        cluster
    }

    fn temp_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "idempotency-axum-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        chmod(&dir, "");
        dir
    }

    async fn on_existing(conninfo: &str) -> Cluster {
        let base: tokio_postgres::Config = conninfo
            .parse()
            .expect("IDEMPOTENCY_TEST_CONNINFO: a libpq keyword string or URL");
        let dir = Cluster::temp_dir();
        let name = dir
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a temp dir name")
            .replace('-', "_");
        let (db, conn) = base.connect(NoTls).await.unwrap();
        tokio::spawn(conn);
        db.batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let mut own = base.clone();
        own.dbname(&name);
        let (db, conn) = own.connect(NoTls).await.unwrap();
        tokio::spawn(conn);
        db.batch_execute("CREATE EXTENSION idempotency")
            .await
            .unwrap();
        Cluster {
            dir,
            port: base.get_ports().first().copied().unwrap_or(5432),
            bin: PathBuf::new(),
            pooler: None,
            existing: Some((base, own)),
        }
    }

    /// Whether the tests may stop and start the server: only a cluster of their own.
    pub fn can_restart(&self) -> bool {
        self.existing.is_none()
    }

    async fn initdb() -> Cluster {
        let bin = PathBuf::from(
            std::env::var("PG_BIN").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin".into()),
        );
        let dir = Cluster::temp_dir();
        let port = free_port();
        let data = dir.join("data");
        let mut c = as_postgres(&bin.join("initdb"));
        c.arg("-D").arg(&data).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
        ]);
        run(c);
        let conf = format!(
            "listen_addresses = ''\nunix_socket_directories = '{}'\nport = {port}\nfsync = off\n\
             max_connections = 50\nlog_min_messages = warning\n",
            dir.display()
        );
        let auto = data.join("postgresql.auto.conf");
        let mut text = std::fs::read_to_string(&auto).unwrap_or_default();
        text.push_str(&conf);
        std::fs::write(&auto, text).unwrap();
        let cluster = Cluster {
            dir,
            port,
            bin,
            pooler: None,
            existing: None,
        };
        cluster.pg_ctl(&["start", "-w", "-t", "60"]);
        let (db, conn) = cluster.direct_config().connect(NoTls).await.unwrap();
        tokio::spawn(conn);
        db.batch_execute("CREATE EXTENSION idempotency")
            .await
            .unwrap();
        cluster
    }

    /// How the layer's connections reach the cluster.
    pub fn route(&self) -> Route {
        self.pooler.as_ref().map_or(Route::Direct, |p| p.mode)
    }

    fn pg_ctl(&self, args: &[&str]) {
        assert!(self.can_restart(), "not a cluster of the tests' own");
        let mut c = as_postgres(&self.bin.join("pg_ctl"));
        c.arg("-D")
            .arg(self.dir.join("data"))
            .arg("-l")
            .arg(self.dir.join("server.log"))
            .args(args);
        run(c);
    }

    /// Stops the server (fast: open connections are terminated).
    pub fn stop(&self) {
        self.pg_ctl(&["stop", "-m", "fast", "-w", "-t", "60"]);
    }

    /// Starts the server after [`Cluster::stop`].
    pub fn start_again(&self) {
        self.pg_ctl(&["start", "-w", "-t", "60"]);
    }

    /// Stops the server (fast: open connections are terminated) and starts it again.
    pub fn restart(&self) {
        self.pg_ctl(&["restart", "-m", "fast", "-w", "-t", "60"]);
    }

    /// The application's route to the cluster: the pooler's address if there is one.
    pub fn config(&self) -> tokio_postgres::Config {
        match &self.pooler {
            Some(p) => p.config(),
            None => self.direct_config(),
        }
    }

    /// The cluster itself, on its Unix socket (or the existing server's test database).
    pub fn direct_config(&self) -> tokio_postgres::Config {
        if let Some((_, own)) = &self.existing {
            return own.clone();
        }
        let mut c = tokio_postgres::Config::new();
        c.host_path(&self.dir)
            .port(self.port)
            .user("postgres")
            .dbname("postgres");
        c
    }

    pub fn pool(&self) -> Pool {
        let mgr = Manager::from_config(
            self.config(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        Pool::builder(mgr).max_size(8).build().unwrap()
    }

    /// One query's rows, on a direct connection of its own.
    pub async fn query(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Vec<tokio_postgres::Row> {
        let (db, conn) = self.direct_config().connect(NoTls).await.unwrap();
        tokio::spawn(conn);
        db.query(sql, params).await.unwrap()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // The pooler first: it would keep trying the stopped cluster.
        drop(self.pooler.take());
        if let Some((base, own)) = self.existing.take() {
            // Drop is not async: the database is dropped from a runtime of its own.
            let _ = std::thread::spawn(move || drop_database(base, own)).join();
            let _ = std::fs::remove_dir_all(&self.dir);
            return;
        }
        let mut c = as_postgres(&self.bin.join("pg_ctl"));
        c.arg("-D")
            .arg(self.dir.join("data"))
            .args(["stop", "-m", "immediate", "-w"]);
        let _ = c.output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn drop_database(base: tokio_postgres::Config, own: tokio_postgres::Config) {
    let Some(name) = own.get_dbname().map(str::to_string) else {
        return;
    };
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    rt.block_on(async move {
        if let Ok((db, conn)) = base.connect(NoTls).await {
            tokio::spawn(conn);
            let _ = db
                .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .await;
        }
    });
}

/// The application behind the layer: counts the runs of its handler and does what the request's
/// `X-Behave` header says.
pub struct App {
    pub runs: AtomicUsize,
    /// `X-Behave: wait` blocks until a permit is added.
    pub gate: Semaphore,
}

impl Default for App {
    fn default() -> App {
        App {
            runs: AtomicUsize::new(0),
            gate: Semaphore::new(0),
        }
    }
}

impl App {
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// Waits until the handler has started `n` times.
    pub async fn wait_runs(&self, n: usize) {
        for _ in 0..500 {
            if self.runs() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the handler did not start {n} times");
    }
}

async fn pay(
    State(app): State<Arc<App>>,
    claimed: Option<Extension<Claimed>>,
    headers: HeaderMap,
    body: String,
) -> Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    // Without a claim only when the layer fails open.
    let Some(Extension(claimed)) = claimed else {
        return (StatusCode::CREATED, "ran without the store").into_response();
    };
    let behave = headers
        .get("x-behave")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if let Some(ms) = behave.strip_prefix("sleep:") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
    }
    match behave {
        "wait" => app.gate.acquire().await.unwrap().forget(),
        "fail" => return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response(),
        "panic" => panic!("the handler panicked"),
        "keep" => {
            let mut r = (StatusCode::BAD_GATEWAY, "in doubt").into_response();
            r.extensions_mut().insert(Disposition::Keep);
            return r;
        }
        "text" => return (StatusCode::CREATED, "plain text").into_response(),
        "headers" => {
            return (
                StatusCode::CREATED,
                [
                    ("location", "/orders/7"),
                    ("etag", "\"v1\""),
                    ("set-cookie", "session=first-caller"),
                    ("x-request-id", "req-1"),
                    ("content-type", "text/plain; charset=utf-8"),
                ],
                "got 7 bytes",
            )
                .into_response()
        }
        "own400" => {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(serde_json::json!({"error": "bad order"})),
            )
                .into_response()
        }
        "refuse" => {
            return (
                StatusCode::PAYMENT_REQUIRED,
                axum::Json(serde_json::json!({"refused": true})),
            )
                .into_response()
        }
        _ => {}
    }
    // The body as sent: the stored answer keeps its numbers exact.
    let doc = format!(
        r#"{{"paid": {body}, "token": {}, "recovery_point": {}, "scope": {}}}"#,
        serde_json::json!(claimed.token),
        serde_json::json!(claimed.recovery_point),
        serde_json::json!(claimed.scope),
    );
    let mut r = (StatusCode::CREATED, doc).into_response();
    r.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/json"),
    );
    r
}

// The scope function refuses with an axum Response, which clippy finds large.
#[allow(clippy::result_large_err)]
/// `POST /pay` behind the layer, scoped per client (`X-Client-Id`, 401 without it);
/// `GET /pay` is not idempotent and passes through.
pub fn router(app: Arc<App>, pool: Pool, lease: Duration) -> Router {
    router_with(app, pool, lease, |l| l)
}

/// [`router`] with more settings of the layer.
#[allow(dead_code, clippy::result_large_err)]
pub fn router_with(
    app: Arc<App>,
    pool: Pool,
    lease: Duration,
    more: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Router {
    let layer = more(IdempotencyLayer::new(pool))
        .ttl(Duration::from_secs(3600))
        .lease(lease)
        .body_limit(4096)
        .check(|req| {
            if req.body.contains("\"invalid\"") {
                return Err(idempotency_axum::response::problem(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "invalid",
                    "Invalid payment",
                    "the body says it is invalid",
                ));
            }
            Ok(())
        })
        .scope(|parts| {
            match parts
                .headers
                .get("x-client-id")
                .and_then(|v| v.to_str().ok())
            {
                Some(c) if !c.is_empty() => Ok(format!("{c}:{}", route_scope(parts))),
                _ => Err(idempotency_axum::response::problem(
                    StatusCode::UNAUTHORIZED,
                    "unauthenticated",
                    "Client is not authenticated",
                    "send X-Client-Id",
                )),
            }
        });
    Router::new()
        .route("/pay", post(pay).get(|| async { "not idempotent" }))
        .route_layer(layer)
        .with_state(app)
}

/// A request to `POST /pay`.
pub fn pay_request(
    client: Option<&str>,
    key: Option<&str>,
    body: &str,
    behave: &str,
) -> Request<Body> {
    let mut b = Request::post("/pay").header("content-type", "application/json");
    if let Some(c) = client {
        b = b.header("x-client-id", c);
    }
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    if !behave.is_empty() {
        b = b.header("x-behave", behave);
    }
    b.body(Body::from(body.to_string())).unwrap()
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap()
    }
}

/// Sends `body` under key "k" for client "c" to the handler that waits at `app.gate`, and
/// returns once that handler runs: the request in flight, for a test to act on meanwhile.
pub async fn send_waiting(
    router: &Router,
    app: &App,
    body: &'static str,
) -> tokio::task::JoinHandle<Answer> {
    let r = router.clone();
    let first =
        tokio::spawn(
            async move { send(&r, pay_request(Some("c"), Some("\"k\""), body, "wait")).await },
        );
    app.wait_runs(1).await;
    first
}

pub async fn send(router: &Router, req: Request<Body>) -> Answer {
    let r = router.clone().oneshot(req).await.unwrap();
    let status = r.status();
    let headers = r.headers().clone();
    let body = axum::body::to_bytes(r.into_body(), usize::MAX)
        .await
        .unwrap();
    Answer {
        status,
        headers,
        body: String::from_utf8(body.to_vec()).unwrap(),
    }
}
