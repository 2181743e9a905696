//! The background sweeper.
//!
//! One static "idempotency launcher" (started by the postmaster when the library is preloaded,
//! restarted if it crashes) connects to no database. Every `idempotency.sweep_interval` it lists
//! the databases that accept connections and, one at a time, starts a short-lived dynamic
//! "idempotency sweeper" in each. The sweeper checks whether the extension is installed there;
//! a database found without it is not visited again until it runs CREATE EXTENSION (which
//! announces itself through shared memory) or an hourly full scan. The sweeper deletes expired
//! rows in batches of `idempotency.sweep_batch_size`, one short transaction per batch, and exits.
//! Because no process stays connected to a database between sweeps, and a sweeper gives way as
//! soon as `DROP DATABASE` asks for its database, the worker never holds up `DROP DATABASE`.

use crate::{guc, stats, store};
use idempotency_core::pacing;
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BackgroundWorkerStatus, SignalWakeFlags,
};
use pgrx::prelude::*;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

pub const LAUNCHER_TYPE: &str = "idempotency launcher";
const SWEEPER_TYPE: &str = "idempotency sweeper";

/// Whether this server runs for pg_upgrade (binary-upgrade mode, `-b`): then no sweeper runs.
/// There the old cluster is dumped and the new one restored, and a sweep would delete keys
/// between the dump and the copy (the upgraded cluster's sweeper sweeps them once it starts,
/// and counts them); PostgreSQL keeps its logical-replication launcher off there too.
pub fn binary_upgrade() -> bool {
    // SAFETY: reads a flag the postmaster sets from its command line before it preloads
    // libraries; every process inherits it.
    unsafe { pg_sys::IsBinaryUpgrade }
}

/// Whether the background sweeper runs in this server: the library was preloaded, and not in a
/// server that pg_upgrade runs.
pub fn sweeper_runs() -> bool {
    stats::enabled() && !binary_upgrade()
}

/// Registers the launcher. Called from `_PG_init` while preloading, except under pg_upgrade.
pub fn register() {
    BackgroundWorkerBuilder::new(LAUNCHER_TYPE)
        .set_type(LAUNCHER_TYPE)
        .set_library("idempotency")
        .set_function("idempotency_launcher_main")
        .enable_shmem_access(None)
        // A connection without a database, to read pg_database; starts once recovery finished.
        .enable_spi_access()
        .set_restart_time(Some(Duration::from_secs(5)))
        .load();
}

fn shutdown_requested() -> bool {
    // SAFETY: a flag of this process that its SIGTERM handler sets; read on the worker's only
    // thread.
    unsafe { pg_sys::ShutdownRequestPending != 0 }
}

fn reload_if_asked() {
    if BackgroundWorker::sighup_received() {
        // SAFETY: re-reads the configuration file, as PostgreSQL's own workers do on SIGHUP,
        // outside any transaction, on the worker's only thread.
        unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    }
}

/// Sleeps up to `d`, waking early for a signal. Returns false once the worker should stop.
fn nap(d: Duration) -> bool {
    crate::compat::wait_latch(d.as_millis().min(i64::MAX as u128) as i64);
    pgrx::check_for_interrupts!();
    !BackgroundWorker::sigterm_received() && !shutdown_requested()
}

struct Database {
    oid: pg_sys::Oid,
    name: String,
}

/// Databases that accept connections, read from the shared catalog pg_database.
fn databases() -> Vec<Database> {
    // SAFETY: inside a transaction (the launcher is connected to no database, and pg_database
    // is a shared catalog). Each tuple heap_getnext returns is a pg_database row, valid until
    // the next call: its fixed-size part (FormData_pg_database, up to datname) is read at
    // t_hoff, and the name copied out before the next row. The scan and the relation are
    // closed before the transaction ends.
    BackgroundWorker::transaction(|| unsafe {
        let rel = pg_sys::table_open(
            pg_sys::DatabaseRelationId,
            pg_sys::AccessShareLock as pg_sys::LOCKMODE,
        );
        let scan = pg_sys::table_beginscan_catalog(rel, 0, std::ptr::null_mut());
        let mut out = Vec::new();
        loop {
            let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
            if tuple.is_null() {
                break;
            }
            let header = (*tuple).t_data;
            let form = (header as *const u8).add((*header).t_hoff as usize)
                as *const pg_sys::FormData_pg_database;
            // datconnlimit -2 marks a database whose DROP was interrupted.
            if (*form).datallowconn && (*form).datconnlimit != -2 {
                let name = std::ffi::CStr::from_ptr((*form).datname.data.as_ptr())
                    .to_string_lossy()
                    .into_owned();
                out.push(Database {
                    oid: (*form).oid,
                    name,
                });
            }
        }
        pg_sys::table_endscan(scan);
        pg_sys::table_close(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        out
    })
}

/// Runs one sweeper in `db` and waits for it, terminating it if the launcher must stop.
/// Returns false once the launcher should stop.
fn sweep_database(db: &Database) -> bool {
    let mut name = format!("{SWEEPER_TYPE} for {}", db.name);
    while name.len() > 95 {
        name.pop(); // bgw_name holds 96 bytes
    }
    let started = BackgroundWorkerBuilder::new(&name)
        .set_type(SWEEPER_TYPE)
        .set_library("idempotency")
        .set_function("idempotency_sweeper_main")
        .set_argument(Some(pg_sys::Datum::from(db.oid)))
        .enable_spi_access()
        .set_restart_time(None)
        // SAFETY: reads a variable of this process, set at its start.
        .set_notify_pid(unsafe { pg_sys::MyProcPid })
        .load_dynamic();
    let Ok(worker) = started else {
        // No free worker slot (max_worker_processes): try again next round.
        log!(
            "idempotency: no background worker slot free to sweep database \"{}\"",
            db.name
        );
        return true;
    };
    loop {
        match worker.pid() {
            Ok(_) | Err(BackgroundWorkerStatus::NotYetStarted) => {}
            Err(_) => return !shutdown_requested(),
        }
        if !nap(Duration::from_millis(100)) {
            let _ = worker.terminate();
            return false;
        }
        reload_if_asked();
    }
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // No database: the launcher reads only the shared catalog pg_database.
    BackgroundWorker::connect_worker_to_spi(None, None);
    log!("idempotency launcher started");
    launcher_loop();
    // Like PostgreSQL's own launchers, exit with status 1 on SIGTERM: the postmaster starts the
    // launcher again after bgw_restart_time (5 s) unless the server is shutting down, so
    // pg_terminate_backend() restarts the sweeper instead of switching it off for good.
    log!("idempotency launcher stopping");
    // SAFETY: ends the process as a background worker ends, outside any transaction; nothing
    // of the launcher's needs dropping (it holds no lock and no buffer).
    unsafe { pg_sys::proc_exit(1) };
}

/// Every this many rounds the launcher visits databases known to lack the extension too (a
/// safety net: CREATE EXTENSION announces itself, and new databases are always visited).
const FULL_SCAN_ROUNDS: u64 = 60;

fn launcher_loop() {
    // Databases whose last visit found no extension: skipped until they announce one.
    let mut without: HashSet<u32> = HashSet::new();
    // Announced databases, with how many visits since found no extension yet: the announcing
    // CREATE EXTENSION may not have committed when the sweeper first looks.
    let mut announced: HashMap<u32, u64> = HashMap::new();
    let mut rounds: u64 = 0;
    loop {
        let round = Instant::now();
        for oid in stats::take_announced() {
            announced.insert(oid, 0);
        }
        let full_scan = rounds.is_multiple_of(FULL_SCAN_ROUNDS);
        rounds += 1;
        for db in databases() {
            let oid = db.oid.to_u32();
            if !full_scan && without.contains(&oid) && !announced.contains_key(&oid) {
                continue;
            }
            if shutdown_requested() || !sweep_database(&db) {
                return;
            }
            if stats::extension_present(oid) == Some(false) {
                without.insert(oid);
                if let Some(misses) = announced.get_mut(&oid) {
                    *misses += 1;
                    if *misses >= FULL_SCAN_ROUNDS {
                        announced.remove(&oid); // that CREATE EXTENSION never committed
                    }
                }
            } else {
                without.remove(&oid);
                announced.remove(&oid);
            }
        }
        let interval = Duration::from_secs(guc::SWEEP_INTERVAL.get().max(1) as u64);
        // Sleep out the interval; a reload (SIGHUP) ends the sleep so new settings apply now.
        loop {
            let left = interval.saturating_sub(round.elapsed());
            if left.is_zero() {
                break;
            }
            if !nap(left) {
                return;
            }
            if BackgroundWorker::sighup_received() {
                // SAFETY: as in `reload_if_asked`.
                unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
                break;
            }
        }
    }
}

/// True while `DROP DATABASE` (or another exclusive operation on this database) waits.
fn database_wanted_exclusively() -> bool {
    // SAFETY: a conditional (dontWait) session lock on this database's object tag in the
    // lowest mode, taken and released at once when granted: it never waits and holds nothing
    // past the call.
    unsafe {
        let tag = pg_sys::LOCKTAG {
            locktag_field1: 0,
            locktag_field2: pg_sys::DatabaseRelationId.to_u32(),
            locktag_field3: pg_sys::MyDatabaseId.to_u32(),
            locktag_field4: 0,
            locktag_type: pg_sys::LockTagType::LOCKTAG_OBJECT as u8,
            locktag_lockmethodid: pg_sys::DEFAULT_LOCKMETHOD as u8,
        };
        let mode = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let got = pg_sys::LockAcquire(&tag, mode, true, true);
        if got == pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL {
            return true;
        }
        pg_sys::LockRelease(&tag, mode, true);
        false
    }
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_sweeper_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let oid = pg_sys::Oid::from(arg.value() as u32);
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(oid), None);
    let installed = BackgroundWorker::transaction(|| {
        Spi::get_one::<bool>(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'idempotency')",
        )
    });
    let present = matches!(installed, Ok(Some(true)));
    stats::set_extension_present(present);
    if !present {
        return;
    }
    // Deleting expired rows needs no durable commit: after a crash the rows come back still
    // expired (claims treat them as absent) and the next sweep deletes them again. Not waiting
    // for WAL flushes keeps the sweeper's commits off the application's commit path.
    set_for_session(c"synchronous_commit", c"off");
    compress_full_page_images();
    lower_priority(guc::SWEEP_NICE.get());
    let total = stats::sweep_recording_error(|| {
        store::sweep_start();
        sweep_in_batches(
            |batch| Some(store::sweep_batch(batch, "")),
            Some(store::expired_since),
        )
    });
    stats::sweep_finished(total);
    sweep_audit();
}

/// Compresses the full-page images this sweeper writes with lz4, when the server leaves
/// `wal_compression` off and was built with lz4. Expired rows lie scattered over the table
/// (new rows fill the space earlier sweeps freed), so a sweep touches many pages for the first
/// time since the last checkpoint, and their images were nearly all of its WAL: several KB per
/// deleted row, flushed by the application's next commits. Only this session changes.
fn compress_full_page_images() {
    let wanted = BackgroundWorker::transaction(|| {
        Spi::get_one::<bool>(
            "SELECT s.setting OPERATOR(pg_catalog.=) 'off' \
                    AND 'lz4' OPERATOR(pg_catalog.=) ANY (s.enumvals) \
               FROM pg_catalog.pg_settings AS s WHERE s.name OPERATOR(pg_catalog.=) 'wal_compression'",
        )
    });
    if matches!(wanted, Ok(Some(true))) {
        set_for_session(c"wal_compression", c"lz4");
    }
}

/// Sets a server setting for this sweeper's session only (it runs as the bootstrap superuser,
/// so superuser-only settings are allowed).
fn set_for_session(name: &std::ffi::CStr, value: &std::ffi::CStr) {
    // SAFETY: NUL-terminated name and value that the server copies; an invalid value raises an
    // ERROR, which ends the sweeper (it is started again next round).
    unsafe {
        pg_sys::SetConfigOption(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_SESSION,
        )
    };
}

/// Runs `delete_batch` (each call in its own transaction) until a batch comes back short, the
/// worker is asked to stop or `delete_batch` returns None; pauses after every full batch (a
/// breather for the application while a backlog is swept, [`pacing::pause`]). Returns the rows
/// deleted.
///
/// The sweeper yields to the application: when other sessions wrote WAL during its last cycle
/// (its batch and pause, less its own WAL), it deletes a hundredth of a batch (never fewer than
/// 100 rows) plus the rows that expired since its last look (`inflow`, so it keeps up with the
/// keys the application creates) at a time, and pauses four times `idempotency.sweep_delay`.
/// Its WAL (with the full page images of every page it touches first after a checkpoint) is
/// flushed by the next commits of the application, and its CPU time is theirs to lose, so under
/// load it sweeps gently; on an idle server it sweeps in full batches (after a first small one)
/// with pauses of a fifth of `sweep_delay`.
fn sweep_in_batches(
    delete_batch: fn(i64) -> Option<i64>,
    inflow: Option<fn(pg_sys::TimestampTz) -> i64>,
) -> i64 {
    // Until the first pause has shown whether others write, assume they do: a full first batch
    // into a busy server is the one the application would notice.
    let busy = std::cell::Cell::new(true);
    // The WAL position before the batch under way (its cycle: the batch and its pause).
    let cycle = std::cell::Cell::new(wal_mark());
    // A sweeper's latch may be set from its start (the signals of its own startup): clear it,
    // or the first pause would end at once. A reload asked meanwhile is still seen, through
    // its own flag, after the first batch.
    // SAFETY: this process's own latch, on its only thread; ResetLatch raises no error.
    unsafe { pg_sys::ResetLatch(pg_sys::MyLatch) };
    // SAFETY: reads the clock; never raises an error.
    let mut since = unsafe { pg_sys::GetCurrentTimestamp() };
    let next_batch = || {
        if shutdown_requested() || database_wanted_exclusively() {
            return None;
        }
        let full = guc::SWEEP_BATCH_SIZE.get().max(1) as i64;
        let batch = if busy.get() {
            // Keep up with what expired since the last look, and take a slice of the backlog.
            let expired = match inflow {
                Some(count) => {
                    // SAFETY: as above.
                    let now = unsafe { pg_sys::GetCurrentTimestamp() };
                    let n = BackgroundWorker::transaction(move || count(since));
                    since = now;
                    n
                }
                None => 0,
            };
            (pacing::yielding_batch(full) + expired).min(full)
        } else {
            // SAFETY: as above.
            since = unsafe { pg_sys::GetCurrentTimestamp() };
            full
        };
        cycle.set(wal_mark());
        Some(batch)
    };
    let after_full_batch = || {
        let delay = Duration::from_millis(guc::SWEEP_DELAY.get().max(0) as u64);
        if !delay.is_zero() {
            let pause = pacing::pause(delay, busy.get());
            let napped = Instant::now();
            if !nap(pause) {
                return false;
            }
            // Whole: at least nine tenths of it (the latch's timeout is counted in whole
            // milliseconds, and may end a little before this clock says).
            busy.set(pacing::busy_after(
                busy.get(),
                pacing::others_wrote(&cycle.get(), &wal_mark()),
                napped.elapsed() >= pause - pause / 10,
            ));
        }
        reload_if_asked();
        true
    };
    store::in_batches(
        next_batch,
        |batch| BackgroundWorker::transaction(move || delete_batch(batch)),
        after_full_batch,
    )
}

/// Where the WAL is and how much of it this process wrote: two of these around a cycle of the
/// sweeper (a batch and its pause) tell whether the rest of the server wrote meanwhile.
fn wal_mark() -> pacing::WalMark {
    // SAFETY: reads the WAL insert position under the server's own spinlock (a connected worker
    // has attached shared memory), and this process's own WAL counters, which only its own
    // thread updates.
    unsafe {
        let usage = std::ptr::addr_of!(pg_sys::pgWalUsage).read();
        pacing::WalMark {
            position: pg_sys::GetXLogInsertRecPtr(),
            own_bytes: usage.wal_bytes,
            own_records: usage.wal_records.max(0) as u64,
        }
    }
}

/// Makes this sweeper process nicer (`idempotency.sweep_nice`): when the CPU is saturated the
/// application's backends get it first; when it is idle the sweeper still runs at full speed.
/// Each round runs in a new process, so a reloaded value applies from the next round on.
fn lower_priority(nice: i32) {
    // SAFETY: setpriority(2) on this process (who = 0) takes no pointers; an error is
    // returned, not raised.
    if nice > 0 && unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) } != 0 {
        pgrx::log!(
            "idempotency sweeper: could not set niceness {nice}: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Deletes audit rows past `idempotency.audit_retention` (kept forever when it is 0), in
/// batches like the keys; skipped in a database whose extension predates the audit table.
fn sweep_audit() {
    let has_audit = BackgroundWorker::transaction(|| {
        Spi::get_one::<bool>("SELECT pg_catalog.to_regclass('idempotency.audit') IS NOT NULL")
    });
    if !matches!(has_audit, Ok(Some(true))) {
        return;
    }
    // The retention is read before every batch: a reload may turn it off (0) in between.
    sweep_in_batches(
        |batch| {
            let retention = guc::AUDIT_RETENTION.get();
            (retention > 0).then(|| store::sweep_audit_batch(retention as f64, batch, ""))
        },
        None,
    );
}
