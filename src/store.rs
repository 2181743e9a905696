//! Everything that reads or writes `idempotency.idempotency_keys` from Rust: the claim
//! algorithm and the sweep. Every statement is schema-qualified and parameterized.

use crate::error::raise;
use crate::state::{self, Decision, Stored};
use crate::{guc, stats};
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient};
use pgrx::PgOid;
use pgrx::PgSqlErrorCode;
use std::cell::Cell;
use std::time::{Duration, Instant};

/// A jsonb value copied out of an SPI result into the caller's memory context.
pub struct OwnedJsonb(pub pg_sys::Datum);

impl FromDatum for OwnedJsonb {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _: pg_sys::Oid,
    ) -> Option<Self> {
        if is_null {
            None
        } else {
            // pgrx calls this inside the parent memory context: the copy outlives SPI.
            let copy = unsafe { pg_sys::pg_detoast_datum_copy(datum.cast_mut_ptr()) };
            Some(OwnedJsonb(pg_sys::Datum::from(copy)))
        }
    }
}

impl IntoDatum for OwnedJsonb {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(self.0)
    }
    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    New,
    Replay,
    InProgress,
    Mismatch,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::New => "new",
            Outcome::Replay => "replay",
            Outcome::InProgress => "in_progress",
            Outcome::Mismatch => "mismatch",
        }
    }
}

/// What `claim` returns (the fields of `idempotency.claim_result`).
pub struct ClaimResult {
    pub outcome: Outcome,
    pub token: Option<i64>,
    pub response: Option<OwnedJsonb>,
    pub response_status: Option<i32>,
    pub retry_after: Option<Interval>,
    pub expires_at: Option<TimestampWithTimeZone>,
    pub recovery_point: Option<String>,
}

impl ClaimResult {
    fn new(outcome: Outcome) -> ClaimResult {
        ClaimResult {
            outcome,
            token: None,
            response: None,
            response_status: None,
            retry_after: None,
            expires_at: None,
            recovery_point: None,
        }
    }
}

pub struct ClaimRequest<'a> {
    pub scope: &'a str,
    pub key: &'a str,
    pub hash: Option<[u8; 32]>,
    pub ttl: Interval,
    pub lease: Interval,
}

const ROW_COLUMNS: &str = "k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status, \
     k.request_hash, k.token, k.response, k.response_status, k.recovery_point, k.expires_at, \
     k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now(), \
     k.locked_until OPERATOR(pg_catalog.<=) pg_catalog.now(), \
     GREATEST(k.locked_until OPERATOR(pg_catalog.-) pg_catalog.now(), '1 second'::pg_catalog.interval)";

fn select_sql(lock: bool) -> String {
    format!(
        "SELECT {ROW_COLUMNS} FROM idempotency.idempotency_keys k \
         WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2{}",
        if lock { " FOR UPDATE SKIP LOCKED" } else { "" }
    )
}

const INSERT_SQL: &str = "INSERT INTO idempotency.idempotency_keys AS k \
       (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl) \
     VALUES ($1, $2, $3, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(), \
       pg_catalog.now() OPERATOR(pg_catalog.+) $4, pg_catalog.now() OPERATOR(pg_catalog.+) $5, $5) \
     ON CONFLICT (scope, key) DO NOTHING \
     RETURNING k.token, k.expires_at";

/// Rewrites an expired row as a fresh claim (it counted as absent).
const RESTART_SQL: &str = "UPDATE idempotency.idempotency_keys AS k SET \
       request_hash = $3, status = 'in_progress', token = pg_catalog.nextval('idempotency.token_seq'), \
       response = NULL, response_status = NULL, recovery_point = NULL, \
       created_at = pg_catalog.now(), completed_at = NULL, \
       locked_until = pg_catalog.now() OPERATOR(pg_catalog.+) $4, \
       expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) $5, ttl = $5 \
     WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2 \
     RETURNING k.token, k.expires_at, k.recovery_point";

/// Takes over an in-progress row whose lease ran out; keeps its recovery point.
const TAKEOVER_SQL: &str = "UPDATE idempotency.idempotency_keys AS k SET \
       request_hash = COALESCE(k.request_hash, $3), token = pg_catalog.nextval('idempotency.token_seq'), \
       locked_until = pg_catalog.now() OPERATOR(pg_catalog.+) $4, \
       expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) $5, ttl = $5 \
     WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2 \
     RETURNING k.token, k.expires_at, k.recovery_point";

fn stored(r: &Row) -> Stored<'_> {
    Stored {
        completed: r.completed,
        request_hash: r.request_hash.as_deref(),
        expired: r.expired,
        lease_over: r.lease_over,
    }
}

/// The statements claim and sweep run, prepared once per backend (SPI_keepplan) so a claim
/// pays for execution only. PostgreSQL's plan cache re-plans them after DDL on the table,
/// re-resolving names, so they survive even DROP and CREATE EXTENSION in one session.
struct Plans {
    select: OwnedPreparedStatement,
    select_locked: OwnedPreparedStatement,
    insert: OwnedPreparedStatement,
    restart: OwnedPreparedStatement,
    takeover: OwnedPreparedStatement,
    sweep: OwnedPreparedStatement,
}

thread_local! {
    static PLANS: Cell<Option<&'static Plans>> = const { Cell::new(None) };
}

fn plans(client: &SpiClient<'_>) -> Result<&'static Plans, pgrx::spi::Error> {
    if let Some(p) = PLANS.with(Cell::get) {
        return Ok(p);
    }
    let text = PgOid::from(pg_sys::TEXTOID);
    let key_args = [text, text];
    let claim_args = [
        text,
        text,
        PgOid::from(pg_sys::BYTEAOID),
        PgOid::from(pg_sys::INTERVALOID),
        PgOid::from(pg_sys::INTERVALOID),
    ];
    let p: &'static Plans = Box::leak(Box::new(Plans {
        select: client
            .prepare(select_sql(false).as_str(), &key_args)?
            .keep(),
        select_locked: client
            .prepare_mut(select_sql(true).as_str(), &key_args)?
            .keep(),
        insert: client.prepare_mut(INSERT_SQL, &claim_args)?.keep(),
        restart: client.prepare_mut(RESTART_SQL, &claim_args)?.keep(),
        takeover: client.prepare_mut(TAKEOVER_SQL, &claim_args)?.keep(),
        sweep: client
            .prepare_mut(SWEEP_SQL, &[PgOid::from(pg_sys::INT8OID)])?
            .keep(),
    }));
    PLANS.with(|c| c.set(Some(p)));
    Ok(p)
}

/// One row as claim reads it.
struct Row {
    completed: bool,
    request_hash: Option<Vec<u8>>,
    token: Option<i64>,
    response: Option<OwnedJsonb>,
    response_status: Option<i32>,
    recovery_point: Option<String>,
    expires_at: Option<TimestampWithTimeZone>,
    expired: bool,
    lease_over: bool,
    retry_after: Option<Interval>,
}

fn read_row(
    client: &mut SpiClient<'_>,
    lock: bool,
    req: &ClaimRequest<'_>,
) -> Result<Option<Row>, pgrx::spi::Error> {
    let args = [req.scope.into(), req.key.into()];
    let p = plans(client)?;
    let table = if lock {
        // Row locks need a read-write SPI call.
        client.update(&p.select_locked, Some(1), &args)?
    } else {
        client.select(&p.select, Some(1), &args)?
    };
    if table.is_empty() {
        return Ok(None);
    }
    let t = table.first();
    Ok(Some(Row {
        completed: t.get::<bool>(1)?.unwrap_or(false),
        request_hash: t.get::<Vec<u8>>(2)?,
        token: t.get::<i64>(3)?,
        response: t.get::<OwnedJsonb>(4)?,
        response_status: t.get::<i32>(5)?,
        recovery_point: t.get::<String>(6)?,
        expires_at: t.get::<TimestampWithTimeZone>(7)?,
        expired: t.get::<bool>(8)?.unwrap_or(true),
        lease_over: t.get::<bool>(9)?.unwrap_or(false),
        retry_after: t.get::<Interval>(10)?,
    }))
}

#[derive(Clone, Copy)]
enum Write {
    Insert,
    Restart,
    TakeOver,
}

fn write_claim(
    client: &mut SpiClient<'_>,
    write: Write,
    req: &ClaimRequest<'_>,
) -> Result<Option<ClaimResult>, pgrx::spi::Error> {
    let hash = req.hash.map(|h| h.to_vec());
    let p = plans(client)?;
    let stmt = match write {
        Write::Insert => &p.insert,
        Write::Restart => &p.restart,
        Write::TakeOver => &p.takeover,
    };
    let table = client.update(
        stmt,
        None,
        &[
            req.scope.into(),
            req.key.into(),
            hash.into(),
            req.lease.into(),
            req.ttl.into(),
        ],
    )?;
    if table.is_empty() {
        return Ok(None);
    }
    let t = table.first();
    let mut result = ClaimResult::new(Outcome::New);
    result.token = t.get::<i64>(1)?;
    result.expires_at = t.get::<TimestampWithTimeZone>(2)?;
    if t.columns()? >= 3 {
        result.recovery_point = t.get::<String>(3)?;
    }
    Ok(Some(result))
}

/// What a dirty-snapshot look at the primary key found.
enum Probe {
    /// No version of the row exists, committed or not.
    Absent,
    /// Another open transaction is inserting, updating or deleting the row.
    Busy {
        locked_until: Option<pg_sys::TimestampTz>,
    },
    /// A committed row our snapshot may not show yet.
    Committed,
}

/// Looks the key up in the primary key with a dirty snapshot, as PostgreSQL's own unique
/// checks do, to learn without waiting whether another open transaction holds the key.
fn probe(scope: &str, key: &str) -> Probe {
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), false);
        let relid = pg_sys::get_relname_relid(c"idempotency_keys".as_ptr(), nsp);
        let idxid = pg_sys::get_relname_relid(c"idempotency_keys_pkey".as_ptr(), nsp);
        if relid == pg_sys::InvalidOid || idxid == pg_sys::InvalidOid {
            raise(
                PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
                "idempotency.idempotency_keys or its primary key is missing".to_string(),
                Some("reinstall the extension: DROP EXTENSION idempotency; CREATE EXTENSION idempotency;"),
            );
        }
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let heap = pg_sys::table_open(relid, lock);
        let index = pg_sys::index_open(idxid, lock);
        let mut snapshot: pg_sys::SnapshotData = std::mem::zeroed();
        snapshot.snapshot_type = pg_sys::SnapshotType::SNAPSHOT_DIRTY;
        let mut keys: [pg_sys::ScanKeyData; 2] = std::mem::zeroed();
        // The key columns are COLLATE "C", which is what ScanKeyInit assumes.
        let scope_text =
            pg_sys::cstring_to_text_with_len(scope.as_ptr().cast(), scope.len() as i32);
        let key_text = pg_sys::cstring_to_text_with_len(key.as_ptr().cast(), key.len() as i32);
        pg_sys::ScanKeyInit(
            &mut keys[0],
            1,
            pg_sys::BTEqualStrategyNumber as u16,
            pg_sys::Oid::from(pg_sys::F_TEXTEQ),
            pg_sys::Datum::from(scope_text),
        );
        pg_sys::ScanKeyInit(
            &mut keys[1],
            2,
            pg_sys::BTEqualStrategyNumber as u16,
            pg_sys::Oid::from(pg_sys::F_TEXTEQ),
            pg_sys::Datum::from(key_text),
        );
        let scan = pg_sys::index_beginscan(heap, index, &mut snapshot, 2, 0);
        pg_sys::index_rescan(scan, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(heap, std::ptr::null_mut());
        let mut found = Probe::Absent;
        while pg_sys::index_getnext_slot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot) {
            let other_xact = snapshot.xmin != pg_sys::InvalidTransactionId
                || snapshot.xmax != pg_sys::InvalidTransactionId;
            if other_xact {
                let attnum = pg_sys::get_attnum(relid, c"locked_until".as_ptr());
                let mut isnull = false;
                let d = pg_sys::slot_getattr(slot, attnum as i32, &mut isnull);
                let locked_until = if isnull { None } else { Some(d.value() as i64) };
                found = Probe::Busy { locked_until };
                break;
            }
            found = Probe::Committed;
        }
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_endscan(scan);
        pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        pg_sys::table_close(heap, pg_sys::NoLock as pg_sys::LOCKMODE);
        found
    }
}

/// `locktag_field4` of the extension's advisory locks; the SQL advisory lock functions use 1
/// and 2, so these never collide with an application's own advisory locks.
const LOCK_CLASS: u16 = 0x1de7;

/// A session-level lock on hash(scope, key), held only while one claim probes and inserts the
/// key: microseconds, never until commit, so a transaction can claim any number of keys.
struct KeyInsertLock(pg_sys::LOCKTAG);

impl KeyInsertLock {
    fn acquire(scope: &str, key: &str) -> KeyInsertLock {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (scope, key).hash(&mut h);
        let hash = h.finish();
        let tag = pg_sys::LOCKTAG {
            locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
            locktag_field2: (hash >> 32) as u32,
            locktag_field3: hash as u32,
            locktag_field4: LOCK_CLASS,
            locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
            locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
        };
        unsafe {
            pg_sys::LockAcquire(&tag, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, true, false)
        };
        KeyInsertLock(tag)
    }
}

impl Drop for KeyInsertLock {
    /// Runs on success and while an ERROR unwinds through claim alike.
    fn drop(&mut self) {
        unsafe { pg_sys::LockRelease(&self.0, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, true) };
    }
}

fn seconds_left(locked_until: Option<pg_sys::TimestampTz>) -> Interval {
    let now = unsafe { pg_sys::GetCurrentTransactionStartTimestamp() };
    let left = locked_until.map(|t| t.saturating_sub(now)).unwrap_or(0);
    Interval::new(0, 0, left.max(1_000_000))
        .unwrap_or_else(|_| Interval::new(0, 0, 1_000_000).unwrap())
}

fn busy_result(locked_until: Option<pg_sys::TimestampTz>) -> ClaimResult {
    let mut r = ClaimResult::new(Outcome::InProgress);
    r.retry_after = Some(seconds_left(locked_until));
    r
}

fn sleep_a_little() {
    unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            5,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
    }
    pgrx::check_for_interrupts!();
}

fn log_mismatch(req: &ClaimRequest<'_>, stored: Option<&[u8]>) {
    let prefix = |h: Option<&[u8]>| {
        h.map(|h| crate::keys::hex(&h[..h.len().min(6)]))
            .unwrap_or_default()
    };
    pgrx::warning!(
        "idempotency: key reused with a different request: scope={:?} key={:?} stored_hash={} request_hash={}",
        req.scope,
        req.key,
        prefix(stored),
        prefix(req.hash.as_ref().map(|h| &h[..]))
    );
}

/// How many times claim re-reads a row that changed under it before giving up.
const MAX_ROUNDS: usize = 50;

/// The claim algorithm. Never waits on another transaction's claim of the same key beyond
/// `idempotency.claim_wait`: uncommitted inserts are seen through a dirty-snapshot probe and
/// locked rows are skipped, both answered `in_progress`.
pub fn claim(req: &ClaimRequest<'_>) -> ClaimResult {
    let wait = Duration::from_millis(guc::CLAIM_WAIT.get().max(0) as u64);
    let started = Instant::now();
    let given = req.hash.as_ref().map(|h| &h[..]);
    let mut rounds = 0;
    while rounds < MAX_ROUNDS {
        let step = Spi::connect_mut(|client| -> Result<Step, pgrx::spi::Error> {
            let row = read_row(client, false, req)?;
            let Some(row) = row else {
                // Serialize probe+insert of this key across backends for a moment, so an
                // insert never meets another claimer's half-finished insert of the same key
                // (ON CONFLICT would then wait for that transaction to end).
                let _insert_lock = KeyInsertLock::acquire(req.scope, req.key);
                return match probe(req.scope, req.key) {
                    Probe::Busy { locked_until } => Ok(Step::Busy(locked_until)),
                    Probe::Absent | Probe::Committed => {
                        match write_claim(client, Write::Insert, req)? {
                            Some(r) => Ok(Step::Done(r)),
                            None => Ok(Step::Again),
                        }
                    }
                };
            };
            match state::decide(stored(&row), given) {
                Decision::Replay => Ok(Step::Done(replay(row))),
                Decision::Mismatch => {
                    log_mismatch(req, row.request_hash.as_deref());
                    Ok(Step::Done(ClaimResult::new(Outcome::Mismatch)))
                }
                Decision::InProgress => Ok(Step::Done(in_progress(row))),
                Decision::Restart | Decision::TakeOver => {
                    // Lock the newest version without waiting, then decide again on it.
                    let Some(locked) = read_row(client, true, req)? else {
                        return Ok(match probe(req.scope, req.key) {
                            Probe::Busy { locked_until } => Step::Busy(locked_until),
                            _ => Step::Again,
                        });
                    };
                    match state::decide(stored(&locked), given) {
                        Decision::Restart => Ok(write_claim(client, Write::Restart, req)?
                            .map_or(Step::Again, Step::Done)),
                        Decision::TakeOver => Ok(write_claim(client, Write::TakeOver, req)?
                            .map_or(Step::Again, Step::Done)),
                        Decision::Replay => Ok(Step::Done(replay(locked))),
                        Decision::InProgress => Ok(Step::Done(in_progress(locked))),
                        Decision::Mismatch => {
                            log_mismatch(req, locked.request_hash.as_deref());
                            Ok(Step::Done(ClaimResult::new(Outcome::Mismatch)))
                        }
                    }
                }
            }
        });
        match step {
            Ok(Step::Done(result)) => return result,
            Ok(Step::Busy(locked_until)) => {
                if started.elapsed() >= wait {
                    return busy_result(locked_until);
                }
                sleep_a_little();
            }
            // Only rounds where the row changed under us count; waiting does not.
            Ok(Step::Again) => rounds += 1,
            Err(e) => raise(
                PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
                format!("idempotency.claim: {e}"),
                None,
            ),
        }
    }
    raise(
        PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
        format!(
            "idempotency.claim: key {:?} kept changing under concurrent claims",
            req.key
        ),
        Some("retry the transaction"),
    )
}

enum Step {
    Done(ClaimResult),
    Busy(Option<pg_sys::TimestampTz>),
    Again,
}

fn replay(row: Row) -> ClaimResult {
    let mut r = ClaimResult::new(Outcome::Replay);
    r.token = row.token;
    r.response = row.response;
    r.response_status = row.response_status;
    r.expires_at = row.expires_at;
    r
}

fn in_progress(row: Row) -> ClaimResult {
    let mut r = ClaimResult::new(Outcome::InProgress);
    r.retry_after = row.retry_after;
    r.expires_at = row.expires_at;
    r.recovery_point = row.recovery_point;
    r
}

const SWEEP_SQL: &str = "DELETE FROM idempotency.idempotency_keys AS k \
     WHERE k.ctid OPERATOR(pg_catalog.=) ANY (ARRAY( \
       SELECT s.ctid FROM idempotency.idempotency_keys AS s \
        WHERE s.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now() \
        LIMIT $1 FOR UPDATE SKIP LOCKED))";

/// Deletes up to `batch` expired rows, skipping rows other transactions hold; returns how many.
pub fn sweep_batch(batch: i64) -> i64 {
    let deleted = Spi::connect_mut(|client| {
        client
            .update(&plans(client)?.sweep, None, &[batch.into()])
            .map(|t| t.len() as i64)
    })
    .unwrap_or_else(|e| {
        raise(
            PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
            format!("idempotency.sweep: {e}"),
            None,
        )
    });
    stats::count(stats::Event::Swept, deleted as u64);
    deleted
}
