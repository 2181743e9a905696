//! Counters since server start, per database, in shared memory (only when the library is in
//! `shared_preload_libraries`; otherwise every counter reads NULL).

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgLwLock};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Databases tracked at once; further databases work but are not counted.
const SLOTS: usize = 64;

/// What is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    ClaimNew = 0,
    ClaimReplay = 1,
    ClaimInProgress = 2,
    ClaimMismatch = 3,
    Completion = 4,
    Release = 5,
    Swept = 6,
    /// A claim that took over an in-progress key whose lease had run out.
    Takeover = 7,
    /// An IK003 answer: a completion or checkpoint with a stale (or foreign) token.
    StaleTokenRefused = 8,
    /// A claim that waited for a busy key under `idempotency.claim_wait`.
    ClaimWaited = 9,
    /// The microseconds those claims waited, in all.
    ClaimWaitMicros = 10,
}

pub const EVENTS: usize = 11;

/// The bytes of a failed sweep's message kept (cut at a character boundary).
pub const SWEEP_ERROR_BYTES: usize = 240;

/// What the last sweeper visit to a database found.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ExtensionSeen {
    /// No sweeper has visited the database yet.
    #[default]
    NotVisited,
    /// The extension is installed there.
    Installed,
    /// It is not installed there.
    Absent,
}

#[derive(Clone, Copy)]
pub struct Slot {
    pub database: u32,
    /// What the last sweeper visit found.
    pub extension: ExtensionSeen,
    pub counters: [u64; EVENTS],
    /// Microseconds since 2000-01-01 of the last finished sweep of this database, or 0.
    pub last_sweep_at: i64,
    pub last_sweep_rows: i64,
    /// The message of the last sweep of this database that failed, if no sweep finished since:
    /// its first `last_sweep_error_len` bytes (UTF-8).
    pub last_sweep_error: [u8; SWEEP_ERROR_BYTES],
    pub last_sweep_error_len: u16,
}

impl Default for Slot {
    fn default() -> Self {
        Slot {
            database: 0,
            extension: ExtensionSeen::default(),
            counters: [0; EVENTS],
            last_sweep_at: 0,
            last_sweep_rows: 0,
            last_sweep_error: [0; SWEEP_ERROR_BYTES],
            last_sweep_error_len: 0,
        }
    }
}

impl Slot {
    /// The message of the last failed sweep, while no sweep has finished since.
    pub fn sweep_error(&self) -> Option<&str> {
        let len = usize::from(self.last_sweep_error_len).min(SWEEP_ERROR_BYTES);
        (len > 0).then(|| std::str::from_utf8(&self.last_sweep_error[..len]).unwrap_or("?"))
    }
}

/// Databases that ran CREATE EXTENSION since the launcher last looked.
const ANNOUNCED: usize = 32;

/// Backends that count in a slot of their own; one beyond this counts in its database's slot.
const BACKEND_SLOTS: usize = 1024;

/// One backend's counts since it started (or since its slot was last folded in), in a cache
/// line of its own: an increment is then an uncontended write, where every backend adding to
/// its database's counters bounced one cache line between all cores (the dearest instruction
/// of a replayed claim at 16 clients). A backend folds its counts into its database's slot as
/// it exits; readers add the live backends' counts to their database's.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct BackendSlot {
    /// 0: free.
    pub database: u32,
    pub counters: [u64; EVENTS],
}

#[derive(Clone, Copy)]
pub struct Table {
    pub slots: [Slot; SLOTS],
    pub announced: [u32; ANNOUNCED],
    pub backends: [BackendSlot; BACKEND_SLOTS],
}

impl Default for Table {
    fn default() -> Self {
        Table {
            slots: [Slot::default(); SLOTS],
            announced: [0; ANNOUNCED],
            backends: [BackendSlot::default(); BACKEND_SLOTS],
        }
    }
}

// SAFETY: plain integers and arrays of them (Copy, no pointers), valid at any address in
// shared memory and in every process.
unsafe impl PGRXSharedMemory for Table {}

// SAFETY: the lock's name is unique to the extension; `init_shmem` (pg_shmem_init!) sets the
// lock up while the library is preloaded, and nothing touches TABLE unless `enabled()`.
static TABLE: PgLwLock<Table> = unsafe { PgLwLock::new(c"idempotency_stats") };

/// Set in the postmaster by `_PG_init` while preloading; inherited by every backend.
static READY: AtomicBool = AtomicBool::new(false);

/// Reserves the shared memory. Only valid while `shared_preload_libraries` is processed.
pub fn init_shmem() {
    pg_shmem_init!(TABLE);
    READY.store(true, Ordering::Relaxed);
}

pub fn enabled() -> bool {
    READY.load(Ordering::Relaxed)
}

/// The counters this backend adds to: its own backend slot's, or its database's (a backend
/// stays in one database). Counting needs no lock.
static MY_COUNTERS: crate::local::BackendLocal<std::cell::Cell<*mut [u64; EVENTS]>> =
    crate::local::BackendLocal::new(std::cell::Cell::new(std::ptr::null_mut()));

fn my_counters() -> Option<*mut [u64; EVENTS]> {
    let cached = MY_COUNTERS.with(|c| c.get());
    if !cached.is_null() {
        return Some(cached);
    }
    let db = current_database();
    if !enabled() || db == 0 {
        return None;
    }
    let index = crate::compat::backend_index();
    let ptr = {
        let mut table = TABLE.exclusive();
        // The database's slot exists (readers find the database) before counting starts.
        let database_slot = slot_index(&mut table, db)?;
        match index.filter(|i| *i < BACKEND_SLOTS) {
            Some(i) => {
                // Normally free: its last holder folded it as it exited (a crash resets all of
                // shared memory). Fold whatever is there rather than count it twice or lose it.
                fold(&mut table, i);
                let mine = &mut table.backends[i];
                mine.database = db;
                // SAFETY: registers a callback (run once, at this backend's exit) with a plain
                // index as its argument; registered once per backend (MY_COUNTERS is set).
                unsafe { pg_sys::before_shmem_exit(Some(fold_at_exit), pg_sys::Datum::from(i)) };
                &raw mut mine.counters
            }
            None => &raw mut table.slots[database_slot].counters,
        }
    };
    MY_COUNTERS.with(|c| c.set(ptr));
    Some(ptr)
}

/// Moves backend slot `i`'s counts into its database's slot and frees it.
fn fold(table: &mut Table, i: usize) {
    let BackendSlot { database, counters } = table.backends[i];
    if database == 0 {
        return;
    }
    if let Some(d) = slot_index(table, database) {
        for (total, n) in table.slots[d].counters.iter_mut().zip(counters) {
            // Atomic: a backend without a slot of its own adds to these without the lock.
            // SAFETY: `total` points into shared memory (valid for the server's lifetime) and
            // is aligned for u64; every access to it is atomic or under the exclusive lock.
            unsafe { AtomicU64::from_ptr(total) }.fetch_add(n, Ordering::Relaxed);
        }
    }
    table.backends[i] = BackendSlot::default();
}

#[pg_guard]
unsafe extern "C-unwind" fn fold_at_exit(_code: std::ffi::c_int, arg: pg_sys::Datum) {
    let mut table = TABLE.exclusive();
    let database = table.backends[arg.value()].database;
    fold(&mut table, arg.value());
    // Anything still counted on the way out goes to the database's slot.
    let ptr = match slot_index(&mut table, database) {
        Some(d) if database != 0 => &raw mut table.slots[d].counters,
        _ => std::ptr::null_mut(),
    };
    MY_COUNTERS.with(|c| c.set(ptr));
}

/// The index of `database`'s slot, taking a free one for a database not seen yet.
fn slot_index(table: &mut Table, database: u32) -> Option<usize> {
    let index = table
        .slots
        .iter()
        .position(|s| s.database == database)
        .or_else(|| table.slots.iter().position(|s| s.database == 0))?;
    table.slots[index].database = database;
    Some(index)
}

fn with_slot<R>(database: u32, f: impl FnOnce(&mut Slot) -> R) -> Option<R> {
    if !enabled() || database == 0 {
        return None;
    }
    let mut table = TABLE.exclusive();
    let index = slot_index(&mut table, database)?;
    Some(f(&mut table.slots[index]))
}

fn current_database() -> u32 {
    // SAFETY: reads a backend variable, set once the backend connected.
    unsafe { pg_sys::MyDatabaseId }.to_u32()
}

/// Counts `n` events of `kind` for the current database. Events are counted in one layer, the
/// SQL-facing one (`api`), once the store has done them; the store counts nothing.
pub fn count(kind: Event, n: u64) {
    if !enabled() {
        return;
    }
    if let Some(counters) = my_counters() {
        // SAFETY: the counters live in shared memory for the server's lifetime; they change
        // hands only under the exclusive lock, at this backend's exit; every other access to a
        // counter is atomic.
        let counter = unsafe { AtomicU64::from_ptr(&raw mut (*counters)[kind as usize]) };
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Records a finished sweep of the current database.
pub fn sweep_finished(rows: i64) {
    // SAFETY: reads the clock; never raises an error.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    with_slot(current_database(), |s| {
        s.last_sweep_at = now;
        s.last_sweep_rows = rows;
        s.last_sweep_error_len = 0;
    });
}

/// Records a sweep of the current database that failed with `message` (kept until a sweep
/// finishes).
pub fn sweep_failed(message: &str) {
    let mut end = message.len().min(SWEEP_ERROR_BYTES);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    with_slot(current_database(), |s| {
        s.last_sweep_error[..end].copy_from_slice(&message.as_bytes()[..end]);
        s.last_sweep_error_len = end as u16;
    });
}

/// Runs a sweep (`f`), recording its error, if it raises one, as the database's last sweep
/// error (then raised as it was). Only the counters are touched on the way: nothing else runs
/// before the error goes on up.
pub fn sweep_recording_error<R>(f: impl FnOnce() -> R) -> R {
    if !enabled() {
        return f();
    }
    pgrx::pg_sys::PgTryBuilder::new(std::panic::AssertUnwindSafe(f))
        .catch_others(|e| {
            match &e {
                pgrx::pg_sys::panic::CaughtError::PostgresError(r)
                | pgrx::pg_sys::panic::CaughtError::ErrorReport(r)
                | pgrx::pg_sys::panic::CaughtError::RustPanic { ereport: r, .. } => sweep_failed(
                    &format!("{}: {}", sqlstate(r.sql_error_code()), r.message()),
                ),
            }
            e.rethrow()
        })
        .execute()
}

/// The five characters of an error code (as the server's unpack_sql_state).
fn sqlstate(code: pgrx::PgSqlErrorCode) -> String {
    let code = code as i32;
    (0..5)
        .map(|i| char::from((((code >> (6 * i)) & 0x3F) as u8) + b'0'))
        .collect()
}

/// Records whether the current database has the extension (called by its sweeper).
pub fn set_extension_present(present: bool) {
    with_slot(current_database(), |s| {
        s.extension = if present {
            ExtensionSeen::Installed
        } else {
            ExtensionSeen::Absent
        }
    });
}

/// Whether the last sweeper visit to `database` found the extension; None if unknown.
pub fn extension_present(database: u32) -> Option<bool> {
    if !enabled() {
        return None;
    }
    let table = TABLE.share();
    let slot = table.slots.iter().find(|s| s.database == database)?;
    match slot.extension {
        ExtensionSeen::Installed => Some(true),
        ExtensionSeen::Absent => Some(false),
        ExtensionSeen::NotVisited => None,
    }
}

/// Asks the launcher to visit the current database at its next round (CREATE EXTENSION).
pub fn announce() {
    if !enabled() {
        return;
    }
    let db = current_database();
    let mut table = TABLE.exclusive();
    if table.announced.contains(&db) {
        return;
    }
    if let Some(free) = table.announced.iter_mut().find(|d| **d == 0) {
        *free = db;
    } else {
        // Full: the launcher then visits every database anyway at its next full scan.
        table.announced[ANNOUNCED - 1] = db;
    }
}

/// The databases announced since the last call (the launcher's).
pub fn take_announced() -> Vec<u32> {
    if !enabled() {
        return Vec::new();
    }
    let mut table = TABLE.exclusive();
    let out = table
        .announced
        .iter()
        .copied()
        .filter(|&d| d != 0)
        .collect();
    table.announced = [0; ANNOUNCED];
    out
}

/// The current database's slot, or None when not preloaded (or not tracked).
pub fn snapshot() -> Option<Slot> {
    if !enabled() {
        return None;
    }
    let db = current_database();
    let table = TABLE.share();
    let Some(slot) = table.slots.iter().find(|s| s.database == db) else {
        return Some(Slot {
            database: db,
            ..Slot::default()
        });
    };
    let mut copy = Slot {
        database: db,
        extension: slot.extension,
        counters: [0; EVENTS],
        last_sweep_at: slot.last_sweep_at,
        last_sweep_rows: slot.last_sweep_rows,
        last_sweep_error: slot.last_sweep_error,
        last_sweep_error_len: slot.last_sweep_error_len,
    };
    let load = |c: &u64| {
        // SAFETY: as in count(): counters are only ever accessed atomically (or under the
        // exclusive lock, which this shared one excludes).
        unsafe { AtomicU64::from_ptr(c as *const u64 as *mut u64) }.load(Ordering::Relaxed)
    };
    for (i, c) in copy.counters.iter_mut().enumerate() {
        *c = load(&slot.counters[i])
            + table
                .backends
                .iter()
                .filter(|b| b.database == db)
                .map(|b| load(&b.counters[i]))
                .sum::<u64>();
    }
    Some(copy)
}
