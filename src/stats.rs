//! Counters since server start, per database, in shared memory (only when the library is in
//! `shared_preload_libraries`; otherwise every counter reads NULL).

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgLwLock};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Databases tracked at once; further databases work but are not counted.
pub const SLOTS: usize = 64;

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
}

pub const EVENTS: usize = 7;

#[derive(Clone, Copy, Default)]
pub struct Slot {
    pub database: u32,
    /// What the last sweeper visit found: 0 not visited, 1 extension installed, 2 not installed.
    pub extension: u8,
    pub counters: [u64; EVENTS],
    /// Microseconds since 2000-01-01 of the last finished sweep of this database, or 0.
    pub last_sweep_at: i64,
    pub last_sweep_rows: i64,
}

/// Databases that ran CREATE EXTENSION since the launcher last looked.
pub const ANNOUNCED: usize = 32;

#[derive(Clone, Copy)]
pub struct Table {
    pub slots: [Slot; SLOTS],
    pub announced: [u32; ANNOUNCED],
}

impl Default for Table {
    fn default() -> Self {
        Table {
            slots: [Slot::default(); SLOTS],
            announced: [0; ANNOUNCED],
        }
    }
}

unsafe impl PGRXSharedMemory for Table {}

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

/// This backend's slot (a backend stays in one database): counting needs no lock.
static MY_SLOT: crate::local::BackendLocal<std::cell::Cell<*mut Slot>> =
    crate::local::BackendLocal::new(std::cell::Cell::new(std::ptr::null_mut()));

fn my_slot() -> Option<*mut Slot> {
    let cached = MY_SLOT.with(|c| c.get());
    if !cached.is_null() {
        return Some(cached);
    }
    let ptr = with_slot(current_database(), |s| s as *mut Slot)?;
    MY_SLOT.with(|c| c.set(ptr));
    Some(ptr)
}

fn with_slot<R>(database: u32, f: impl FnOnce(&mut Slot) -> R) -> Option<R> {
    if !enabled() || database == 0 {
        return None;
    }
    let mut table = TABLE.exclusive();
    let index = table
        .slots
        .iter()
        .position(|s| s.database == database)
        .or_else(|| table.slots.iter().position(|s| s.database == 0))?;
    let slot = &mut table.slots[index];
    slot.database = database;
    Some(f(slot))
}

fn current_database() -> u32 {
    unsafe { pg_sys::MyDatabaseId }.to_u32()
}

/// Counts `n` events of `kind` for the current database.
pub fn count(kind: Event, n: u64) {
    if !enabled() {
        return;
    }
    if let Some(slot) = my_slot() {
        // SAFETY: the slot lives in shared memory for the server's lifetime and is never
        // reassigned; every access to a counter is atomic.
        let counter = unsafe { AtomicU64::from_ptr(&raw mut (*slot).counters[kind as usize]) };
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Records a finished sweep of the current database.
pub fn sweep_finished(rows: i64) {
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    with_slot(current_database(), |s| {
        s.last_sweep_at = now;
        s.last_sweep_rows = rows;
    });
}

/// Records whether the current database has the extension (called by its sweeper).
pub fn set_extension_present(present: bool) {
    with_slot(current_database(), |s| {
        s.extension = if present { 1 } else { 2 }
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
        1 => Some(true),
        2 => Some(false),
        _ => None,
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
    };
    for (i, c) in copy.counters.iter_mut().enumerate() {
        // SAFETY: as in count(): counters are only ever accessed atomically.
        let counter = unsafe { AtomicU64::from_ptr(&slot.counters[i] as *const u64 as *mut u64) };
        *c = counter.load(Ordering::Relaxed);
    }
    Some(copy)
}
