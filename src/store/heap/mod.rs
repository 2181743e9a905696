//! The access below SQL: the primary-key look-up with a dirty snapshot ([`scan`]), the direct
//! heap and index writes ([`write`]), the per-key insert lock, and server functions called
//! directly.

use pgrx::datum::Interval;
use pgrx::pg_sys;

mod scan;
mod write;

pub(crate) use scan::{newest_version, probe, Newest, Probe};
pub(crate) use write::{complete_direct, insert_direct, insert_direct_batch};

use crate::compat::raw::GetCurrentTransactionStartTimestamp;
pub(crate) use crate::compat::raw::{nextval_oid, timestamptz_pl_interval};

/// The start of the current transaction (what `now()` returns).
pub fn transaction_start() -> pg_sys::TimestampTz {
    // SAFETY: reads a backend variable; never raises an error.
    unsafe { GetCurrentTransactionStartTimestamp() }
}

/// `locktag_field4` of the extension's advisory locks; the SQL advisory lock functions use 1
/// and 2, so these never collide with an application's own advisory locks.
const LOCK_CLASS: u16 = 0x1de7;

/// A session-level lock on hash(scope, key), held only while one claim probes and inserts the
/// key: microseconds, never until commit, so a transaction can claim any number of keys.
pub(crate) struct KeyInsertLock(pg_sys::LOCKTAG);

impl KeyInsertLock {
    /// The lock's hash of (scope, key). A caller that holds several insert locks at once
    /// (`claim_many`) takes them in the order of this hash, so two such callers never wait
    /// for each other in a cycle.
    pub(crate) fn hash(scope: &str, key: &str) -> u64 {
        // FNV-1a: stable across builds, so backends running different builds of the library
        // (during an upgrade) still agree on the lock of a key.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for b in scope.bytes().chain([0xff]).chain(key.bytes()) {
            hash = (hash ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        hash
    }

    pub(crate) fn acquire(scope: &str, key: &str) -> KeyInsertLock {
        Self::acquire_hashed(Self::hash(scope, key))
    }

    /// The lock whose [`hash`](Self::hash) is `hash`.
    pub(crate) fn acquire_hashed(hash: u64) -> KeyInsertLock {
        // SAFETY: reads a backend variable, set at connection.
        let database = unsafe { pg_sys::MyDatabaseId };
        let tag = pg_sys::LOCKTAG {
            locktag_field1: database.to_u32(),
            locktag_field2: (hash >> 32) as u32,
            locktag_field3: hash as u32,
            locktag_field4: LOCK_CLASS,
            locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
            locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
        };
        // SAFETY: a session-level advisory lock on a tag built here (the lock manager copies
        // it); waits for the holder, interruptibly. Released by `drop`, which runs on success
        // and while an ERROR unwinds alike.
        unsafe {
            pg_sys::LockAcquire(&tag, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, true, false)
        };
        KeyInsertLock(tag)
    }
}

impl Drop for KeyInsertLock {
    /// Runs on success and while an ERROR unwinds through claim alike.
    fn drop(&mut self) {
        // SAFETY: releases the session lock `acquire` took, with the same tag and mode (a lock
        // not held would be a WARNING, not an ERROR).
        unsafe { pg_sys::LockRelease(&self.0, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, true) };
    }
}

/// The advisory lock of a sweep's (sub)transaction `xid`: the lock
/// `pg_advisory_xact_lock_shared(SWEEP_LOCK_CLASS, xid)` takes (two int4 keys, `locktag_field4`
/// 2), so that the portable edition's sweeps and claims use the same one.
fn sweep_mark(xid: pg_sys::TransactionId) -> pg_sys::LOCKTAG {
    // SAFETY: reads a backend variable, set at connection.
    let database = unsafe { pg_sys::MyDatabaseId };
    pg_sys::LOCKTAG {
        locktag_field1: database.to_u32(),
        locktag_field2: crate::decision::SWEEP_LOCK_CLASS as u32,
        locktag_field3: xid.into_inner(),
        locktag_field4: 2,
        locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    }
}

/// Marks the current (sub)transaction, whose statements are about to lock and delete expired
/// rows, as a sweep's ([`crate::decision::SWEEP_LOCK_CLASS`]): its mark, held in
/// share mode until the transaction ends.
pub(crate) fn announce_sweep() {
    // SAFETY: assigns the transaction id the sweep's row locks will carry (it writes anyway),
    // then takes a transaction-level advisory lock in share mode on a tag built here (the lock
    // manager copies it); share locks never wait for each other, and no one holds the
    // exclusive mode but for an instant ([`holder`]).
    unsafe {
        let xid = pg_sys::GetCurrentTransactionId();
        pg_sys::LockAcquire(
            &sweep_mark(xid),
            pg_sys::ShareLock as pg_sys::LOCKMODE,
            false,
            false,
        );
    }
}

/// Waits for the sweep (sub)transaction `xid` to end: a wait for its mark in exclusive mode,
/// released at once (a lock wait, which `lock_timeout` ends with 55P03 and which PostgreSQL's
/// deadlock detection sees).
pub(crate) fn wait_for_sweep(xid: pg_sys::TransactionId) {
    let tag = sweep_mark(xid);
    let exclusive = pg_sys::ExclusiveLock as pg_sys::LOCKMODE;
    // SAFETY: a session-level lock on a tag built here, waited for interruptibly; released at
    // once with the same tag and mode. An ERROR while waiting (a timeout) leaves it not taken.
    unsafe {
        pg_sys::LockAcquire(&tag, exclusive, true, false);
        pg_sys::LockRelease(&tag, exclusive, true);
    }
}

/// Who holds a row that transaction `xid` has locked or is deleting.
pub(crate) enum Holder {
    /// A sweep, still running.
    Sweep,
    /// Another transaction, still running.
    Other,
    /// No one any more: `xid` has ended.
    Ended,
}

/// Whether `xid` is a running sweep's (sub)transaction: its mark is held (a try for the mark in
/// exclusive mode fails; the try, when it succeeds, is released at once).
pub(crate) fn holder(xid: pg_sys::TransactionId) -> Holder {
    let tag = sweep_mark(xid);
    let exclusive = pg_sys::ExclusiveLock as pg_sys::LOCKMODE;
    // SAFETY: a session-level try on a tag built here, never waiting; released with the same
    // tag and mode when taken. TransactionIdIsInProgress reads the shared proc array.
    unsafe {
        if pg_sys::LockAcquire(&tag, exclusive, true, true)
            == pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
        {
            return Holder::Sweep;
        }
        pg_sys::LockRelease(&tag, exclusive, true);
        if pg_sys::TransactionIdIsInProgress(xid) {
            Holder::Other
        } else {
            Holder::Ended
        }
    }
}

pub(crate) fn seconds_left(locked_until: Option<pg_sys::TimestampTz>) -> Interval {
    let now = transaction_start();
    let left = locked_until.map(|t| t.saturating_sub(now)).unwrap_or(0);
    Interval::new(0, 0, left.max(1_000_000))
        .unwrap_or_else(|_| Interval::new(0, 0, 1_000_000).unwrap())
}

/// `now()` plus an interval, with PostgreSQL's calendar arithmetic in the session's time zone
/// (what `pg_catalog.now() + interval` gives the statements).
pub fn now_plus(interval: &Interval) -> pg_sys::TimestampTz {
    use pgrx::IntoDatum;
    let now = pg_sys::Datum::from(transaction_start());
    let Some(i) = interval.into_datum() else {
        super::internal("an interval could not be converted");
    };
    // SAFETY: timestamptz_pl_interval takes a timestamptz and an interval datum; it raises a
    // clear error (22008) when the result is out of range.
    unsafe {
        pg_sys::DirectFunctionCall2Coll(Some(timestamptz_pl_interval), pg_sys::InvalidOid, now, i)
    }
    .value() as pg_sys::TimestampTz
}
