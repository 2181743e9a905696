//! The SQL-callable functions written in Rust. Their SQL declarations (names, argument names,
//! defaults, volatility, pinned search_path) are hand-written in `sql/idempotency.sql`, which
//! names each by the C symbol this library exports for it.
//!
//! `claim` and `complete`, the calls on every request's path, are raw fmgr functions that read
//! their arguments by position from the call and build their results themselves (`claim`
//! caches its result type's descriptor and outcome labels per backend). Every other function
//! is written with typed arguments (`functions`, `#[pg_extern(sql = false)]`), exported under
//! the name the SQL declarations give it ([`export_as`]).
//!
//! By role: `fmgr` holds the raw entry points (PostgreSQL's version-1 calling convention),
//! `exports` the symbols every release's scripts declare for the typed functions (`functions`),
//! `args` reading and checking arguments, `result` forming the rows the library returns.
//!
//! The counters (`stats`) of the calls' outcomes are counted here, each event once the store
//! has done it; the rows a sweep deletes are counted by the store's sweep, which the background
//! sweeper calls too.

/// Declares the V1 calling-convention record PostgreSQL looks up for `$name`.
macro_rules! v1 {
    ($finfo:ident) => {
        #[unsafe(no_mangle)]
        #[doc(hidden)]
        pub extern "C" fn $finfo() -> &'static pg_sys::Pg_finfo_record {
            const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
            &V1
        }
    };
}

/// Exports a typed function under `$symbol`, the name `sql/idempotency.sql` and every released
/// script (`sql/releases/`, the upgrade scripts) declare it with: a V1 function that hands the
/// call to pgrx's wrapper of the typed function (`<function>_wrapper`, which pgrx exports too),
/// so installs made by any release keep working with this library.
macro_rules! export_as {
    ($symbol:ident, $finfo:ident, $wrapper:path) => {
        v1!($finfo);
        #[unsafe(no_mangle)]
        #[doc(hidden)]
        pub unsafe extern "C-unwind" fn $symbol(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
            // SAFETY: the server calls the symbol as the SQL declaration says, with the
            // arguments the typed function takes (the same in every release); the wrapper
            // guards the call like any pgrx function.
            unsafe { $wrapper(fcinfo) }
        }
    };
}

mod args;
mod exports;
mod fmgr;
mod functions;
mod result;
