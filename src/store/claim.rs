//! The claim algorithm: the outcome table ([`crate::decision`]) applied to the key's row, read
//! below SQL where it can be ([`heap`]) and through the statements ([`sql`]) where it must.

use super::catalog::{check_access, check_citus_node, key_label};
use super::heap::{self, probe, KeyInsertLock, Probe};
use super::path::Path;
use super::sql::{insert_batch, read_row, with_spi, write_claim, Write};
use super::{spi_failed, ClaimRequest, ClaimResult, Outcome, Row, MAX_ROUNDS};
use crate::decision::{self, Decision, Stored};
use crate::error::raise;
use crate::guc;
use pgrx::datum::Interval;
use pgrx::pg_sys;
use pgrx::spi::SpiClient;
use pgrx::PgSqlErrorCode;
use std::time::{Duration, Instant};

pub(crate) fn stored(r: &Row) -> Stored<'_> {
    Stored {
        completed: r.completed,
        request_hash: r.request_hash.as_deref(),
        expired: r.expired,
        lease_over: r.lease_over,
    }
}

/// The answer to a claim that meets another open transaction's claim (or change) of the key:
/// in progress, come back after `idempotency.busy_retry_after` (that transaction usually ends
/// in milliseconds: its lease says nothing about when). `expires_at` stays NULL: the row is not
/// committed and may never be.
fn busy_result() -> ClaimResult {
    let mut r = ClaimResult::new(Outcome::InProgress);
    r.retry_after = Interval::new(0, 0, guc::int(&guc::BUSY_RETRY_AFTER).max(1) as i64 * 1000).ok();
    r
}

/// The pause before a busy key is looked at again: 5 ms, or less should the latch be set.
fn sleep_a_little() {
    crate::compat::wait_latch(5);
    pgrx::check_for_interrupts!();
}

pub(crate) fn log_mismatch(req: &ClaimRequest<'_>, stored: Option<&[u8]>) {
    let prefix = |h: Option<&[u8]>| {
        h.map(|h| crate::derivation::hex(&h[..h.len().min(6)]))
            .unwrap_or_default()
    };
    let message = format!(
        "idempotency: key reused with a different request: scope={:?} key={} stored_hash={} request_hash={}",
        req.scope,
        key_label(req.key),
        prefix(stored),
        prefix(req.hash.as_ref().map(|h| &h[..]))
    );
    pgrx::warning!("{}", crate::error::for_message(message));
}

/// The claim algorithm. Never waits on another transaction's claim of the same key beyond
/// `idempotency.claim_wait`: uncommitted inserts and changes are seen through a dirty-snapshot
/// probe and locked rows are skipped, both answered `in_progress`.
///
/// The [`Path`] is chosen once per call. Under READ COMMITTED (where every statement sees the
/// newest committed data anyway) the probe's row is the answer: replays, mismatches and
/// in-progress answers touch no SQL at all. Under REPEATABLE READ and SERIALIZABLE the row is
/// read through the transaction's snapshot; on a partitioned or Citus store through SQL alone.
pub fn claim(req: &ClaimRequest<'_>) -> ClaimResult {
    check_access();
    let wait = Duration::from_millis(guc::int(&guc::CLAIM_WAIT).max(0) as u64);
    // Only a wait for a busy key needs the clock.
    let mut started = None;
    // Whether the claim paused for a busy key at least once (with claim_wait = 0 it never does).
    let mut slept = false;
    let path = Path::choose("claim");
    if path == Path::SqlOnly {
        // On Citus: this node must hand out tokens of its own range.
        check_citus_node();
    }
    let mut rounds = 0;
    while rounds < MAX_ROUNDS {
        let step = match path {
            Path::SqlOnly => with_spi(|client| claim_sql(client, req)),
            Path::Snapshot => with_spi(|client| match read_row(client, false, req)? {
                Some(row) => decide(client, req, row, path),
                None => match probe_or_insert(req, false, || insert(client, req)) {
                    Looked::Inserted(step) => step,
                    Looked::Found(Probe::Busy) => Ok(Step::Busy),
                    Looked::Found(Probe::ExpiredHeld(xid)) => Ok(expired_held(xid)),
                    // Committed, but not in this REPEATABLE READ snapshot: the insert fails with
                    // a serialization error, as it should.
                    Looked::Found(Probe::Committed(_)) => insert(client, req),
                    Looked::Found(Probe::Absent | Probe::Changed) => Ok(Step::Again),
                },
            }),
            Path::Direct | Path::SqlWrites | Path::ForcedSqlWrites => {
                claim_read_committed(req, path)
            }
        };
        match step {
            Ok(Step::Done(mut result)) => {
                result.waited = waited(started, slept);
                return result;
            }
            Ok(Step::Busy) => {
                if started.get_or_insert_with(Instant::now).elapsed() >= wait {
                    let mut result = busy_result();
                    result.waited = waited(started, slept);
                    return result;
                }
                sleep_a_little();
                slept = true;
            }
            // Only rounds where the row changed under us count; waiting does not.
            Ok(Step::Again) => rounds += 1,
            Err(e) => spi_failed("claim", e),
        }
    }
    raise(
        PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
        format!(
            "idempotency.claim: key {} kept changing under concurrent claims",
            key_label(req.key)
        ),
        Some("retry the transaction"),
    )
}

/// An expired row that the open transaction `xid` holds. A sweep deleting it is waited for, at
/// most `idempotency.busy_retry_after` (the sweeper's batches take milliseconds), and the key
/// looked at again: an expired key counts as absent whatever a sweep is doing. Any other holder
/// is a claimer restarting the key (or a `forget`): busy, as a key being changed is.
fn expired_held(xid: pg_sys::TransactionId) -> Step {
    match heap::holder(xid) {
        heap::Holder::Ended => Step::Again,
        heap::Holder::Other => Step::Busy,
        heap::Holder::Sweep => {
            let limit = guc::int(&guc::BUSY_RETRY_AFTER).max(1);
            match within_lock_timeout(limit, || heap::wait_for_sweep(xid)) {
                Some(()) => Step::Again,
                None => Step::Busy,
            }
        }
    }
}

/// How long a claim that paused for a busy key waited in all (None if it never paused).
fn waited(started: Option<Instant>, slept: bool) -> Option<Duration> {
    started.filter(|_| slept).map(|s| s.elapsed())
}

/// One round of a claim under READ COMMITTED, the look-up below SQL: first a look without the
/// insert lock, since a key that exists (the replay, mismatch and in-progress answers) needs no
/// lock at all. Only an absent key is looked at again under the lock, confirmed, and inserted:
/// below SQL on the direct path (the table confirmed under its write lock), else by the
/// statement.
fn claim_read_committed(req: &ClaimRequest<'_>, path: Path) -> Result<Step, pgrx::spi::Error> {
    let found = match probe(req.scope, req.key, false) {
        Probe::Absent => probe_or_insert(req, true, || match path.write_layout("claim") {
            Some(d) => Ok(Step::Done(heap::insert_direct(&d, req))),
            None => with_spi(|client| {
                Ok(write_claim(client, Write::InsertFresh, req)?.map_or(Step::Again, Step::Done))
            }),
        }),
        found => Looked::Found(found),
    };
    match found {
        Looked::Inserted(step) => step,
        Looked::Found(Probe::Busy) => Ok(Step::Busy),
        Looked::Found(Probe::ExpiredHeld(xid)) => Ok(expired_held(xid)),
        Looked::Found(Probe::Committed(row)) => {
            match decision::decide(stored(&row), request_hash(req)) {
                d @ (Decision::Replay | Decision::Mismatch | Decision::InProgress) => {
                    Ok(Step::Done(answer(req, d, row)))
                }
                Decision::Restart | Decision::TakeOver => {
                    with_spi(|client| decide(client, req, row, path))
                }
            }
        }
        Looked::Found(Probe::Absent | Probe::Changed) => Ok(Step::Again),
    }
}

/// The claim through SQL alone, for a table whose rows the probe cannot see (a Citus
/// distributed table, whose own relation is an empty shell, or a partitioned store): the insert
/// first, with ON CONFLICT DO NOTHING, so that a new key (most claims) costs one statement,
/// which on Citus is one round trip to the key's worker; only a key that is there is read and
/// decided. The insert waits for another transaction that is inserting or changing the same
/// key's row (as a unique check does), then does nothing if the row is still there.
fn claim_sql(client: &mut SpiClient<'_>, req: &ClaimRequest<'_>) -> Result<Step, pgrx::spi::Error> {
    if let Some(result) = write_claim(client, Write::Insert, req)? {
        return Ok(Step::Done(result));
    }
    match read_row(client, false, req)? {
        Some(row) => decide(client, req, row, Path::SqlOnly),
        // Deleted (swept, forgotten) since the insert met it: try again.
        None => Ok(Step::Again),
    }
}

pub(crate) enum Looked {
    Inserted(Result<Step, pgrx::spi::Error>),
    Found(Probe),
}

/// One look at the key under its insert lock: an absent key is inserted at once (by `insert`);
/// anything else is returned after the lock is released. `confirm_miss` under READ COMMITTED
/// (see below). The lock serializes probe+insert of
/// a key across backends for a moment, so an insert never meets another claimer's
/// half-finished insert of the same key (which would wait for that transaction to end). Under
/// READ COMMITTED a key that exists was already answered by a look without the lock.
fn probe_or_insert(
    req: &ClaimRequest<'_>,
    confirm_miss: bool,
    insert: impl FnOnce() -> Result<Step, pgrx::spi::Error>,
) -> Looked {
    let _insert_lock = KeyInsertLock::acquire(req.scope, req.key);
    // Under READ COMMITTED an absent key is inserted without ON CONFLICT: a miss that raced a
    // concurrent update must not pass for absence (it would be a unique violation, where the
    // row should have been answered). Under REPEATABLE READ the insert's ON CONFLICT DO
    // NOTHING handles that race (the executor re-checks), and a fresh snapshot outside the
    // transaction's own would only confuse SERIALIZABLE's conflict checks.
    match probe(req.scope, req.key, confirm_miss) {
        Probe::Absent => Looked::Inserted(insert()),
        found => Looked::Found(found),
    }
}

/// The request hash the caller gave (None: the caller gave no request, so none is compared).
pub(crate) fn request_hash<'a>(req: &'a ClaimRequest<'_>) -> Option<&'a [u8]> {
    req.hash.as_ref().map(|h| &h[..])
}

/// Inserts the claim; `Again` when another claimer's row got there first.
pub(crate) fn insert(
    client: &mut SpiClient<'_>,
    req: &ClaimRequest<'_>,
) -> Result<Step, pgrx::spi::Error> {
    Ok(write_claim(client, Write::Insert, req)?.map_or(Step::Again, Step::Done))
}

/// The answers that write nothing: replay, mismatch and in_progress.
pub(crate) fn answer(req: &ClaimRequest<'_>, decision: Decision, row: Row) -> ClaimResult {
    match decision {
        Decision::Replay => replay(row),
        Decision::Mismatch => {
            log_mismatch(req, row.request_hash.as_deref());
            let mut r = ClaimResult::new(Outcome::Mismatch);
            r.expires_at = row.expires_at;
            r
        }
        _ => in_progress(row),
    }
}

/// Applies the outcome table to a row that exists, found on `path`.
fn decide(
    client: &mut SpiClient<'_>,
    req: &ClaimRequest<'_>,
    row: Row,
    path: Path,
) -> Result<Step, pgrx::spi::Error> {
    match decision::decide(stored(&row), request_hash(req)) {
        d @ (Decision::Replay | Decision::Mismatch | Decision::InProgress) => {
            Ok(Step::Done(answer(req, d, row)))
        }
        Decision::Restart | Decision::TakeOver => {
            // Lock the newest version without waiting, then decide again on it.
            let Some(locked) = read_row(client, true, req)? else {
                if path == Path::SqlOnly {
                    // Through SQL: still there, so another claimer holds its row lock.
                    return Ok(match read_row(client, false, req)? {
                        Some(_) => Step::Busy,
                        None => Step::Again,
                    });
                }
                return Ok(match probe(req.scope, req.key, false) {
                    Probe::Busy => Step::Busy,
                    Probe::ExpiredHeld(xid) => expired_held(xid),
                    // Still there, so another claimer holds its row lock while it decides on a
                    // takeover: the key is busy (spinning here would only burn rounds).
                    Probe::Committed(_) => Step::Busy,
                    Probe::Absent | Probe::Changed => Step::Again,
                });
            };
            match decision::decide(stored(&locked), request_hash(req)) {
                Decision::Restart => {
                    Ok(
                        write_claim(client, Write::Restart(locked.token.unwrap_or(0)), req)?
                            .map_or(Step::Again, Step::Done),
                    )
                }
                Decision::TakeOver => {
                    Ok(
                        write_claim(client, Write::TakeOver(locked.token.unwrap_or(0)), req)?
                            .map_or(Step::Again, |mut result| {
                                result.took_over = true;
                                Step::Done(result)
                            }),
                    )
                }
                d => Ok(Step::Done(answer(req, d, locked))),
            }
        }
    }
}

pub(crate) enum Step {
    Done(ClaimResult),
    Busy,
    Again,
}

pub(crate) fn replay(row: Row) -> ClaimResult {
    let mut r = ClaimResult::new(Outcome::Replay);
    r.token = row.token;
    r.response = row.response;
    r.response_status = row.response_status;
    r.expires_at = row.expires_at;
    r
}

pub(crate) fn in_progress(row: Row) -> ClaimResult {
    let mut r = ClaimResult::new(Outcome::InProgress);
    r.retry_after = row.retry_after;
    r.expires_at = row.expires_at;
    r.recovery_point = row.recovery_point;
    r
}

/// Keys of a `claim_many` call take at most this many keys' insert locks at once (the server's
/// lock table is shared and sized by max_locks_per_transaction): a larger batch is inserted in
/// several chunks.
const BATCH_CHUNK: usize = 128;

/// `claim_many`'s claims of `keys` (stored forms) with `hashes`, chunk by chunk: the fresh keys
/// of each chunk inserted together ([`claim_fresh_batch`]), every other position claimed by
/// [`claim`], in input order. Each position's answer goes to `answer(position, result)` as soon
/// as its chunk is done.
pub fn claim_many(
    scope: &str,
    keys: &[String],
    hashes: &[Option<[u8; 32]>],
    ttl: Interval,
    lease: Interval,
    mut answer: impl FnMut(usize, ClaimResult),
) {
    let mut start = 0;
    while start < keys.len() {
        let end = (start + BATCH_CHUNK).min(keys.len());
        let refs: Vec<&str> = keys[start..end].iter().map(String::as_str).collect();
        let fresh = claim_fresh_batch(scope, &refs, &hashes[start..end], ttl, lease);
        for (j, done) in fresh.into_iter().enumerate() {
            let i = start + j;
            let result = done.unwrap_or_else(|| {
                claim(&ClaimRequest {
                    scope,
                    key: &keys[i],
                    hash: hashes[i],
                    ttl,
                    lease,
                })
            });
            answer(i, result);
        }
        start = end;
    }
}

/// The set-based part of `claim_many`: the keys of a batch (stored form, with their request
/// hashes) that are absent are inserted in one statement, and answered `new` here; every other
/// position is None, for the caller to claim one by one with [`claim`] (so a key that exists,
/// is busy, or repeats an earlier position of the batch gets exactly `claim`'s answer).
///
/// Only on a path that looks keys up below SQL ([`Path::looks_up_below_sql`]: READ COMMITTED,
/// the store neither partitioned nor a Citus table). The insert lock of each
/// distinct key is taken first, in the order of the locks' hash (so two batches never wait for
/// each other in a cycle), and held until the insert has run, so no other claimer inserts any
/// of the keys meanwhile, as for one key in [`probe_or_insert`]. Then, on a table the direct
/// writes apply to, each key is looked at with the dirty probe alone and the absent ones are
/// written below SQL at once ([`heap::insert_direct_batch`]); elsewhere one `INSERT ... ON
/// CONFLICT DO NOTHING` inserts every key that is absent, without looking at them first (on a
/// table with rules, which refuses ON CONFLICT, the keys are probed and inserted as below).
/// Neither may wait ([`without_waiting`]): a key another open transaction is inserting or
/// changing would make it wait for that transaction, where `claim` answers `in_progress` at
/// once. If it would wait (or, below SQL, the unique index finds a key the probe missed), it
/// is rolled back; the SQL insert then probes each key (still under its lock, with a confirmed
/// miss) and inserts only the absent ones, and below SQL those keys go to `claim`.
fn claim_fresh_batch(
    scope: &str,
    keys: &[&str],
    hashes: &[Option<[u8; 32]>],
    ttl: Interval,
    lease: Interval,
) -> Vec<Option<ClaimResult>> {
    let mut out: Vec<Option<ClaimResult>> = keys.iter().map(|_| None).collect();
    if keys.is_empty() {
        return out;
    }
    let path = Path::choose("claim_many");
    if !path.looks_up_below_sql() {
        return out;
    }
    check_access();
    let mut seen = std::collections::HashSet::with_capacity(keys.len());
    let firsts: Vec<usize> = (0..keys.len()).filter(|&i| seen.insert(keys[i])).collect();
    let mut lock_order: Vec<(u64, usize)> = firsts
        .iter()
        .map(|&i| (KeyInsertLock::hash(scope, keys[i]), i))
        .collect();
    lock_order.sort_unstable();
    let locks: Vec<KeyInsertLock> = lock_order
        .iter()
        .map(|&(hash, _)| KeyInsertLock::acquire_hashed(hash))
        .collect();
    let insert = |positions: &[usize], on_conflict: bool| {
        let k: Vec<&str> = positions.iter().map(|&i| keys[i]).collect();
        let h: Vec<Option<[u8; 32]>> = positions.iter().map(|&i| hashes[i]).collect();
        let rows = with_spi(|client| insert_batch(client, scope, &k, &h, lease, ttl, on_conflict))
            .unwrap_or_else(|e| spi_failed("claim_many", e));
        // Back from indexes into `positions` to positions of the batch.
        rows.into_iter()
            .map(|(j, token, expires_at)| (positions[j], token, expires_at))
            .collect::<Vec<_>>()
    };
    let inserted = match path.write_layout("claim_many") {
        // Below SQL: each key looked at with the dirty probe alone (no confirmation), the absent
        // ones inserted at once. The unique index still checks each of them: a key the probe
        // missed (an update racing its scan, see `probe`) is a unique violation or a wait for
        // the writer's transaction; then the whole insert is undone and those keys go to
        // `claim` one by one, as every key the probe found does.
        Some(d) => {
            let fresh: Vec<usize> = firsts
                .iter()
                .copied()
                .filter(|&i| matches!(probe(scope, keys[i], false), Probe::Absent))
                .collect();
            let rows: Vec<(&str, Option<[u8; 32]>)> =
                fresh.iter().map(|&i| (keys[i], hashes[i])).collect();
            if rows.is_empty() {
                return out;
            }
            without_waiting(|| heap::insert_direct_batch(&d, scope, &rows, ttl, lease))
                .map(|results| {
                    fresh
                        .iter()
                        .zip(results)
                        .map(|(&i, r)| (i, r.token, r.expires_at))
                        .collect()
                })
                .unwrap_or_default()
        }
        // One INSERT ... ON CONFLICT DO NOTHING, which PostgreSQL refuses on a table with
        // rules: there each key is probed (under its lock, a confirmed miss) and the absent ones
        // inserted without ON CONFLICT, as `claim` inserts a key it found absent.
        None => match (!store_has_rules())
            .then(|| without_waiting(|| insert(&firsts, true)))
            .flatten()
        {
            Some(rows) => rows,
            None => {
                let fresh: Vec<usize> = firsts
                    .iter()
                    .copied()
                    .filter(|&i| matches!(probe(scope, keys[i], true), Probe::Absent))
                    .collect();
                if fresh.is_empty() {
                    Vec::new()
                } else {
                    insert(&fresh, false)
                }
            }
        },
    };
    drop(locks);
    for (i, token, expires_at) in inserted {
        let mut r = ClaimResult::new(Outcome::New);
        r.token = token;
        r.expires_at = expires_at;
        out[i] = Some(r);
    }
    out
}

/// Whether the store has rewrite rules (an owner's change): `INSERT ... ON CONFLICT` is refused
/// on a table with INSERT or UPDATE rules.
fn store_has_rules() -> bool {
    let relid = super::catalog::layout().relid;
    // SAFETY: opens the relation cache entry of the store (which exists: the layout just found
    // it, and the caller holds its write lock) and closes it again after reading one field.
    unsafe {
        let rel = pg_sys::RelationIdGetRelation(relid);
        if rel.is_null() {
            return false;
        }
        // The rules themselves (relhasrules stays true after the last one is dropped).
        let rules = !(*rel).rd_rules.is_null();
        pg_sys::RelationClose(rel);
        rules
    }
}

/// Runs `f` (writes) in a subtransaction in which a lock wait ends after 1 ms with `55P03`:
/// then, or on a unique violation (`23505`), the subtransaction is rolled back (its writes
/// undone) and None returned. Any other error rolls the subtransaction back and is raised as
/// it was.
///
/// The lock timeout is a timer that, when it fires, asks for a cancel (an interrupt) that is
/// raised at the next interrupt check. If it fires as the lock is granted, the wait ends well
/// and `f` may return before any check: the `55P03` would then be raised later, in the
/// caller's statement, outside this handling. So pending interrupts are processed here, before
/// the subtransaction ends: such a late timeout is answered as a wait (None).
pub(crate) fn without_waiting<R>(f: impl FnOnce() -> R) -> Option<R> {
    within_lock_timeout(1, f)
}

/// [`without_waiting`] with a lock wait ended after `ms` milliseconds.
fn within_lock_timeout<R>(ms: i32, f: impl FnOnce() -> R) -> Option<R> {
    use pgrx::pg_sys::PgTryBuilder;
    use std::panic::AssertUnwindSafe;
    // SAFETY: the subtransaction is begun and ended here, on every path: released after `f`
    // returns, rolled back when it raised (before the error goes on up, so an enclosing
    // handler finds its own subtransaction current); the memory context and resource owner are
    // restored after each, as PL/pgSQL's exception blocks do. LockTimeout is a backend global
    // read when a lock wait starts; it is restored before anything else can run.
    unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        let timeout = pg_sys::LockTimeout;
        let restore = move || {
            pg_sys::LockTimeout = timeout;
            pg_sys::MemoryContextSwitchTo(context);
            pg_sys::CurrentResourceOwner = owner;
        };
        // The answer to a wait or a unique violation: the subtransaction's writes undone.
        let undone = move || {
            pg_sys::LockTimeout = timeout;
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
            restore();
            None
        };
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::LockTimeout = ms;
        PgTryBuilder::new(AssertUnwindSafe(|| {
            let r = f();
            pgrx::check_for_interrupts!();
            pg_sys::LockTimeout = timeout;
            pg_sys::ReleaseCurrentSubTransaction();
            restore();
            Some(r)
        }))
        .catch_when(PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, move |_| {
            undone()
        })
        .catch_when(PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION, move |_| undone())
        .catch_others(move |e| {
            pg_sys::LockTimeout = timeout;
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
            restore();
            e.rethrow()
        })
        .execute()
    }
}
