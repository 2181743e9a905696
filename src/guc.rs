//! The extension's settings (`idempotency.*`): their definitions, their values, and what the
//! server told the library about who set them (the sources of `idempotency.audit`, the roles
//! that set the `idempotency.scope_prefix` placeholder). What binds a role, from these and
//! `idempotency.role_settings`, is decided in `binding`.

use pgrx::prelude::*;
use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::CString;

/// TTL in seconds when a call passes NULL.
pub static DEFAULT_TTL: GucSetting<i32> =
    GucSetting::<i32>::new(idempotency_core::arguments::DEFAULT_TTL_SECS);
/// In-progress lease in seconds when a call passes NULL.
pub static DEFAULT_LEASE: GucSetting<i32> =
    GucSetting::<i32>::new(idempotency_core::arguments::DEFAULT_LEASE_SECS);
/// Milliseconds a claim may wait on another open transaction's claim of the same key.
pub static CLAIM_WAIT: GucSetting<i32> = GucSetting::<i32>::new(0);
/// Seconds between sweeps when nothing is left to delete.
pub static SWEEP_INTERVAL: GucSetting<i32> = GucSetting::<i32>::new(60);
/// Rows deleted per sweep batch.
pub static SWEEP_BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(10_000);
/// Milliseconds the sweeper pauses after each full batch.
pub static SWEEP_DELAY: GucSetting<i32> = GucSetting::<i32>::new(50);

/// OS scheduling niceness of the per-database sweepers.
pub static SWEEP_NICE: GucSetting<i32> = GucSetting::<i32>::new(19);
/// Scopes this session may use must start with this (superuser-set, e.g. per role).
pub static SCOPE_PREFIX: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
/// Whether `complete` appends a row to `idempotency.audit`.
pub static AUDIT: GucSetting<bool> = GucSetting::<bool>::new(false);
/// Seconds audit rows are kept (0: kept until deleted by hand).
pub static AUDIT_RETENTION: GucSetting<i32> = GucSetting::<i32>::new(0);
/// Milliseconds a claim that meets another open transaction's claim tells the caller to wait.
pub static BUSY_RETRY_AFTER: GucSetting<i32> =
    GucSetting::<i32>::new(idempotency_core::arguments::DEFAULT_BUSY_RETRY_AFTER_MS);
/// Hash partitions CREATE EXTENSION gives the store (0: a plain table); read only then.
static PARTITIONS: GucSetting<i32> = GucSetting::<i32>::new(0);
/// Largest response `complete` stores, in kB.
pub static MAX_RESPONSE_SIZE: GucSetting<i32> = GucSetting::<i32>::new(4096);
/// Largest recovery point `checkpoint` stores, in kB.
pub static MAX_RECOVERY_POINT_SIZE: GucSetting<i32> = GucSetting::<i32>::new(64);

use crate::local::BackendLocal;
use pgrx::pg_sys::{GucSource, Oid};
use std::cell::Cell;

/// Roles that set the scope_prefix placeholder in this session before the library was
/// loaded (at most a few: the reset value, the current value and the SET stack).
static PREFIX_SETTERS: BackendLocal<Cell<[Oid; 8]>> =
    BackendLocal::new(Cell::new([pg_sys::InvalidOid; 8]));
/// The role whose startup option set the max_response_size / max_recovery_point_size
/// placeholder before the library was loaded (see `placeholder_reset_setter`).
static LIMIT_SETTERS: BackendLocal<Cell<[[Oid; 8]; 2]>> =
    BackendLocal::new(Cell::new([[pg_sys::InvalidOid; 8]; 2]));
/// The same for the audit placeholder.
static AUDIT_SETTER: BackendLocal<Cell<[Oid; 8]>> =
    BackendLocal::new(Cell::new([pg_sys::InvalidOid; 8]));

/// The audit floor: bit `s` is set while the value last applied from superuser-controlled
/// source `s` is on. Any of them on turns auditing on: a role may write its own
/// `ALTER ROLE ... SET idempotency.audit = off` (the setting is not superuser-only), which must
/// not undo a database-wide "on", so the sources are combined with OR, not by precedence.
static AUDIT_FLOOR: BackendLocal<Cell<u32>> = BackendLocal::new(Cell::new(0));
static LOADED_LATE: BackendLocal<Cell<bool>> = BackendLocal::new(Cell::new(false));

/// A value set from one of these sources was privilege-checked when a superuser wrote it
/// (configuration file, command line, ALTER DATABASE/ROLE ... SET).
fn superuser_source(source: GucSource::Type) -> bool {
    (GucSource::PGC_S_ENV_VAR..=GucSource::PGC_S_DATABASE_USER).contains(&source)
}

use pgrx::pg_sys;

/// Notes the roles that set `name`'s placeholder with their own privileges (startup options,
/// SET), before the library defines it.
fn placeholder_setters(name: &std::ffi::CStr) -> [Oid; 8] {
    let mut roles = [pg_sys::InvalidOid; 8];
    let mut n = 0;
    let mut note = |source: GucSource::Type, role: Oid| {
        if source >= GucSource::PGC_S_CLIENT && role != pg_sys::InvalidOid && n < roles.len() {
            roles[n] = role;
            n += 1;
        }
    };
    // SAFETY: the record and its stack belong to the server's settings, valid for the backend.
    unsafe {
        let record = crate::compat::find_setting(name);
        if record.is_null() {
            return roles;
        }
        let r = &*record;
        note(r.reset_source, r.reset_srole);
        note(r.source, r.srole);
        let mut stack = r.stack;
        while !stack.is_null() {
            note((*stack).source, (*stack).srole);
            note(GucSource::PGC_S_SESSION, (*stack).masked_srole);
            stack = (*stack).prev;
        }
    }
    roles
}

/// The role whose startup option (PGOPTIONS, options) replaced `name`'s placeholder value as the
/// value RESET returns, displacing the administrator's (server, database, role) before the
/// library defines the setting; a SET stacks above that value and displaces nothing.
fn placeholder_reset_setter(name: &std::ffi::CStr) -> [Oid; 8] {
    let mut roles = [pg_sys::InvalidOid; 8];
    // SAFETY: the record belongs to the server's settings, valid for the backend.
    unsafe {
        let record = crate::compat::find_setting(name);
        if !record.is_null() {
            let r = &*record;
            if r.reset_source >= GucSource::PGC_S_CLIENT && r.reset_srole != pg_sys::InvalidOid {
                roles[0] = r.reset_srole;
            }
        }
    }
    roles
}

/// Records the audit floor from the values applied from superuser-controlled sources.
#[pg_guard]
unsafe extern "C-unwind" fn audit_check(
    newval: *mut bool,
    _extra: *mut *mut std::ffi::c_void,
    source: GucSource::Type,
) -> bool {
    // SAFETY: the server passes a valid pointer to the proposed value.
    let value = unsafe { *newval };
    let bit = |s: GucSource::Type| 1u32 << s;
    AUDIT_FLOOR.with(|c| {
        if superuser_source(source) {
            c.set(if value {
                c.get() | bit(source)
            } else {
                c.get() & !bit(source)
            });
        } else if source == GucSource::PGC_S_DEFAULT {
            // Removed from the configuration file and reloaded.
            c.set(c.get() & !bit(GucSource::PGC_S_FILE));
        }
    });
    true
}

/// Whether a superuser-controlled source (configuration file, ALTER DATABASE/ROLE ... SET)
/// turned `idempotency.audit` on for this session, as the check hook saw the values applied.
pub fn audit_floor() -> bool {
    AUDIT_FLOOR.with(Cell::get) != 0
}

/// Whether the library was loaded after login (not preloaded): then the audit floor was not
/// seen by the check hook and must be read from the catalog.
pub fn loaded_late() -> bool {
    LOADED_LATE.with(Cell::get)
}

/// The roles that set the scope_prefix placeholder in this session before the library was
/// loaded (InvalidOid: none).
pub fn prefix_setters() -> [Oid; 8] {
    PREFIX_SETTERS.with(Cell::get)
}

/// The role whose startup option set the max_response_size (`response`) or
/// max_recovery_point_size placeholder before the library was loaded (InvalidOid: none).
pub fn limit_setters(response: bool) -> [Oid; 8] {
    LIMIT_SETTERS.with(Cell::get)[usize::from(!response)]
}

/// The role whose startup option set the audit placeholder before the library was loaded.
pub fn audit_setter() -> [Oid; 8] {
    AUDIT_SETTER.with(Cell::get)
}

/// An integer setting's current value, read in place (`GucSetting::get` checks the calling
/// thread first, on every read; the extension only ever runs on the backend's thread).
pub fn int(setting: &'static GucSetting<i32>) -> i32 {
    // SAFETY: the GUC machinery keeps the variable valid for the backend's lifetime.
    unsafe { *setting.as_ptr() }
}

/// Longest TTL or lease a setting accepts: 3651 days, in seconds. A claim refuses a duration
/// that ends more than ten calendar years after now, and ten calendar years are at least 3651
/// days (every ten years hold a 29 February, 2100 holds none): a larger setting would be
/// accepted here and then fail every claim that relies on it.
const MAX_SECONDS: i32 = 3651 * 86_400;

pub fn init() {
    GucRegistry::define_int_guc(
        c"idempotency.default_ttl",
        c"How long a key is kept when claim or complete passes ttl => NULL.",
        c"Must cover the caller's whole retry window.",
        &DEFAULT_TTL,
        1,
        MAX_SECONDS,
        GucContext::Userset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"idempotency.default_lease",
        c"How long an in-progress claim is protected when claim passes lease => NULL.",
        c"After the lease runs out another claim may take the key over with a larger token.",
        &DEFAULT_LEASE,
        1,
        MAX_SECONDS,
        GucContext::Userset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"idempotency.claim_wait",
        c"How long claim may wait on another open transaction's claim of the same key.",
        c"0 answers in_progress at once.",
        &CLAIM_WAIT,
        0,
        3_600_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"idempotency.sweep_interval",
        c"Pause between sweeps of expired keys when nothing is left to delete.",
        c"",
        &SWEEP_INTERVAL,
        1,
        86_400,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"idempotency.sweep_batch_size",
        c"Expired keys deleted per sweep batch (one short transaction each in the worker).",
        c"",
        &SWEEP_BATCH_SIZE,
        1,
        1_000_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"idempotency.sweep_delay",
        c"Pause of the background sweeper after each full batch.",
        c"Leaves CPU and WAL bandwidth to the application while a large backlog is swept: four times it while others write, a fifth of it on an idle server; 0 sweeps flat out.",
        &SWEEP_DELAY,
        0,
        10_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"idempotency.sweep_nice",
        c"Scheduling niceness (0-19) of the background sweeper processes.",
        c"Above 0 the sweeper yields the CPU to the application's backends when the CPU is busy \
          and sweeps at full speed when it is not; 0 competes on equal terms.",
        &SWEEP_NICE,
        0,
        19,
        GucContext::Sighup,
        GucFlags::default(),
    );
    // SAFETY: _PG_init runs on the backend's (or postmaster's) main thread.
    LOADED_LATE.with(|c| c.set(unsafe { !pg_sys::process_shared_preload_libraries_in_progress }));
    PREFIX_SETTERS.with(|c| c.set(placeholder_setters(c"idempotency.scope_prefix")));
    AUDIT_SETTER.with(|c| c.set(placeholder_reset_setter(c"idempotency.audit")));
    LIMIT_SETTERS.with(|c| {
        c.set([
            placeholder_reset_setter(c"idempotency.max_response_size"),
            placeholder_reset_setter(c"idempotency.max_recovery_point_size"),
        ])
    });
    GucRegistry::define_string_guc(
        c"idempotency.scope_prefix",
        c"Every scope this session passes to the extension must start with this prefix.",
        c"Keeps tenants apart. What binds a role is its row in idempotency.role_settings, which replaces \
          this setting; set per role (ALTER ROLE) it is a default. Only superusers can set it. Empty: every scope.",
        &SCOPE_PREFIX,
        GucContext::Suset,
        GucFlags::default(),
    );
    // SAFETY: registers the setting with the server, as GucRegistry does, plus a check hook;
    // the variable is a static that lives as long as the library.
    unsafe {
        pg_sys::DefineCustomBoolVariable(
            c"idempotency.audit".as_ptr(),
            c"Whether complete also appends a row to idempotency.audit, in the same transaction.".as_ptr(),
            c"Turn it on where an audit trail is needed, e.g. SET LOCAL in a payment procedure; \
              on set by a superuser (postgresql.conf, ALTER ROLE/DATABASE ... SET) cannot be SET off; \
              audit in a role's row of idempotency.role_settings binds."
                .as_ptr(),
            AUDIT.as_ptr(),
            false,
            pg_sys::GucContext::PGC_USERSET,
            0,
            Some(audit_check),
            None,
            None,
        );
    }
    GucRegistry::define_int_guc(
        c"idempotency.audit_retention",
        c"How long the background sweeper keeps audit rows; 0 keeps them.",
        c"",
        &AUDIT_RETENTION,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"idempotency.busy_retry_after",
        c"retry_after of a claim that meets another open transaction's claim of the same key.",
        c"That transaction usually commits or rolls back within milliseconds, so a retry soon \
          gets the real answer; the lease says nothing about it.",
        &BUSY_RETRY_AFTER,
        1,
        3_600_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"idempotency.max_response_size",
        c"Largest response complete stores.",
        c"A larger response is refused (54000) before anything is written; a lower max_response_size \
          in the role's row of idempotency.role_settings applies instead.",
        &MAX_RESPONSE_SIZE,
        1,
        1024 * 1024,
        GucContext::Suset,
        GucFlags::UNIT_KB,
    );
    GucRegistry::define_int_guc(
        c"idempotency.max_recovery_point_size",
        c"Largest recovery point checkpoint stores.",
        c"A larger recovery point is refused (54000) before anything is written; a lower \
          max_recovery_point_size in the role's row of idempotency.role_settings applies instead.",
        &MAX_RECOVERY_POINT_SIZE,
        1,
        1024 * 1024,
        GucContext::Suset,
        GucFlags::UNIT_KB,
    );
    GucRegistry::define_bool_guc(
        c"idempotency.force_sql_path",
        c"Claims and completions write through their INSERT and UPDATE statements.",
        c"For diagnosis: turns off the direct heap and index writes, as a trigger on the table \
          does; the answers are the same either way.",
        &FORCE_SQL_PATH,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"idempotency.partitions",
        c"Hash partitions (by scope) of the store that CREATE EXTENSION creates; 0: a plain table.",
        c"Read only by CREATE EXTENSION idempotency (and a restore that runs it): an existing \
          store is not changed. See docs/scaling.md.",
        &PARTITIONS,
        0,
        1024,
        GucContext::Suset,
        GucFlags::default(),
    );
    // SAFETY: a NUL-terminated literal, called from _PG_init after the settings are defined,
    // as PostgreSQL's own modules do.
    unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"idempotency".as_ptr()) };

    // Test hooks, debug builds only (`cargo pgrx install`/`test` build the dev profile; release
    // builds do not have the setting at all).
    #[cfg(debug_assertions)]
    GucRegistry::define_int_guc(
        c"idempotency.debug_probe_pause",
        c"Debug builds only: pause between the index scan and the heap fetch of a key look-up.",
        c"For tests that commit a concurrent update inside that window.",
        &DEBUG_PROBE_PAUSE,
        0,
        60_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
}

/// `idempotency.force_sql_path`: only turns an optimisation off, so any role may set it.
pub static FORCE_SQL_PATH: GucSetting<bool> = GucSetting::<bool>::new(false);

/// Debug builds only: milliseconds the key look-ups pause between index and heap.
#[cfg(debug_assertions)]
static DEBUG_PROBE_PAUSE: GucSetting<i32> = GucSetting::<i32>::new(0);

/// `idempotency.debug_probe_pause` in a debug build; 0 (no pause, no read) in a release build.
#[inline(always)]
pub fn debug_probe_pause() -> i32 {
    #[cfg(debug_assertions)]
    {
        int(&DEBUG_PROBE_PAUSE)
    }
    #[cfg(not(debug_assertions))]
    {
        0
    }
}
