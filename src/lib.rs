//! `idempotency`: retry-safe state-changing operations inside PostgreSQL.
//!
//! Module map:
//! - `canonical`, `arguments`, `derivation`, `decision`, `signing`: the pure logic (RFC 8785,
//!   argument rules, key derivation, the claim decision table, signed and hashed keys), from
//!   the crate `idempotency-core` (crates/idempotency-core), which has no pgrx: `cargo test -p
//!   idempotency-core` runs its tests without PostgreSQL;
//! - `jsonb`: finds a jsonb datum's bytes for the core's bounds-checked reader (strings in the
//!   database encoding, interrupts);
//! - `store`: everything that reads or writes the extension's table (claim, completion, sweep),
//!   in layers (see its module comment);
//! - `api`: the SQL-callable functions, declared in `sql/idempotency.sql`;
//! - `worker`: the background sweeper (launcher and per-database sweepers);
//! - `stats`: counters in shared memory;
//! - `encoding`: text between the database encoding and UTF-8;
//! - `binding`: what binds a role (scope prefix, audit, size limits), from the settings and
//!   its row in `idempotency.role_settings`;
//! - `guc`, `error`: settings and error reporting;
//! - `local`: per-backend state in plain statics.

mod api;
mod binding;
use idempotency_core::{arguments, canonical, decision, derivation, signing};
mod compat;
mod delegation;
mod encoding;
mod error;
mod guc;
mod jsonb;
mod local;
mod stats;
mod store;
mod worker;

#[cfg(any(test, feature = "pg_test"))]
mod tests;

use pgrx::prelude::*;

pgrx::pg_module_magic!();

pgrx::extension_sql_file!(
    "../sql/idempotency.sql",
    name = "idempotency_schema",
    bootstrap
);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // pgrx puts a Rust backtrace in the DETAIL of an ERROR raised inside a server call when
    // backtraces are enabled (RUST_BACKTRACE in the server's environment): DETAIL goes to the
    // client, and a client must never see one. Rust reads RUST_LIB_BACKTRACE before
    // RUST_BACKTRACE for captured backtraces, once, so this turns them off for the process.
    // (_PG_init runs on the process's only thread, before any backtrace was captured.)
    std::env::set_var("RUST_LIB_BACKTRACE", "0");
    guc::init();
    delegation::install();
    // Shared memory and the background sweeper exist only when the library is preloaded
    // (shared_preload_libraries); loaded later, every SQL function still works.
    // SAFETY: a flag of the server, read on the process's only thread while it loads us.
    if unsafe { !pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    stats::init_shmem();
    if !worker::binary_upgrade() {
        worker::register();
    }
}

/// Hooks for `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
