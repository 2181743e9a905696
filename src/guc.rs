//! The extension's settings (`idempotency.*`).

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::CString;

/// TTL in seconds when a call passes NULL.
pub static DEFAULT_TTL: GucSetting<i32> = GucSetting::<i32>::new(24 * 3600);
/// In-progress lease in seconds when a call passes NULL.
pub static DEFAULT_LEASE: GucSetting<i32> = GucSetting::<i32>::new(5 * 60);
/// Milliseconds a claim may wait on another open transaction's claim of the same key.
pub static CLAIM_WAIT: GucSetting<i32> = GucSetting::<i32>::new(0);
/// Seconds between sweeps when nothing is left to delete.
pub static SWEEP_INTERVAL: GucSetting<i32> = GucSetting::<i32>::new(60);
/// Rows deleted per sweep batch.
pub static SWEEP_BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(10_000);
/// Milliseconds the sweeper pauses after each full batch.
pub static SWEEP_DELAY: GucSetting<i32> = GucSetting::<i32>::new(50);

/// OS scheduling niceness of the per-database sweepers.
pub static SWEEP_NICE: GucSetting<i32> = GucSetting::<i32>::new(10);
/// Scopes this session may use must start with this (superuser-set, e.g. per role).
pub static SCOPE_PREFIX: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
/// Whether `complete` appends a row to `idempotency.audit`.
pub static AUDIT: GucSetting<bool> = GucSetting::<bool>::new(false);
/// Seconds audit rows are kept (0: kept until deleted by hand).
pub static AUDIT_RETENTION: GucSetting<i32> = GucSetting::<i32>::new(0);

/// Calls `f` with the session's scope prefix ("" when unset), read in place: the setting's
/// memory stays valid until it is changed, which cannot happen during `f`.
pub fn with_scope_prefix<R>(f: impl FnOnce(&str) -> R) -> R {
    // SAFETY: the GUC machinery keeps a valid C string (or NULL) in the setting's variable.
    let raw = unsafe { *SCOPE_PREFIX.as_ptr() };
    if raw.is_null() {
        return f("");
    }
    f(&unsafe { std::ffi::CStr::from_ptr(raw) }.to_string_lossy())
}

/// An integer setting's current value, read in place (`GucSetting::get` checks the calling
/// thread first, on every read; the extension only ever runs on the backend's thread).
pub fn int(setting: &'static GucSetting<i32>) -> i32 {
    // SAFETY: the GUC machinery keeps the variable valid for the backend's lifetime.
    unsafe { *setting.as_ptr() }
}

/// Longest TTL or lease a setting accepts: ten years in seconds.
const MAX_SECONDS: i32 = 10 * 366 * 86_400;

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
        c"Leaves CPU and WAL bandwidth to the application while a large backlog is swept; 0 sweeps flat out.",
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
    GucRegistry::define_string_guc(
        c"idempotency.scope_prefix",
        c"Every scope this session passes to the extension must start with this prefix.",
        c"Set per application role by a superuser (ALTER ROLE app SET idempotency.scope_prefix = 'tenant_a:') \
          to keep tenants apart; the role itself cannot change it. Empty: every scope.",
        &SCOPE_PREFIX,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"idempotency.audit",
        c"Whether complete also appends a row to idempotency.audit, in the same transaction.",
        c"Turn it on where an audit trail is needed, e.g. SET LOCAL in a payment procedure.",
        &AUDIT,
        GucContext::Userset,
        GucFlags::default(),
    );
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
    unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"idempotency".as_ptr()) };
}
