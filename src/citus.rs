//! Citus: whether the store is a distributed table.
//!
//! On Citus a distributed table's own relation, on the coordinator and on every worker, is an
//! empty shell: its rows live in shard relations that Citus routes SQL to. Whatever reads or
//! writes the table below SQL (the primary-key probe, the direct insert and update) would
//! read an empty table and write rows that no query sees, so the store goes through SQL
//! wherever [`citus_distributed`] says so (see docs/scaling.md).

use std::cell::Cell;

use pgrx::prelude::*;

/// The answer for one relation, until the relation cache is invalidated: Citus invalidates
/// the table's relcache entry when it distributes or undistributes it (pg_dist_partition).
static CACHED: crate::local::BackendLocal<Cell<Option<(pg_sys::Oid, bool)>>> =
    crate::local::BackendLocal::new(Cell::new(None));

static CALLBACK_REGISTERED: crate::local::BackendLocal<Cell<bool>> =
    crate::local::BackendLocal::new(Cell::new(false));

#[pg_guard]
unsafe extern "C-unwind" fn forget(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    CACHED.with(|c| {
        if c.get()
            .is_some_and(|(r, _)| relid == pg_sys::InvalidOid || r == relid)
        {
            c.set(None);
        }
    });
}

/// Whether `relid` is a Citus table (distributed, reference or managed by Citus in any way):
/// false without a catalog query where Citus is not installed (no `pg_dist_partition`).
pub fn citus_distributed(relid: pg_sys::Oid) -> bool {
    if let Some((r, d)) = CACHED.with(Cell::get) {
        if r == relid {
            return d;
        }
    }
    if !CALLBACK_REGISTERED.with(Cell::get) {
        // SAFETY: registers a callback that only clears a backend-local cache; once per backend.
        unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(forget), pg_sys::Datum::from(0usize)) };
        CALLBACK_REGISTERED.with(|c| c.set(true));
    }
    // SAFETY: a syscache look-up by name in pg_catalog.
    let catalog = unsafe {
        pg_sys::get_relname_relid(
            c"pg_dist_partition".as_ptr(),
            pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE),
        )
    };
    let distributed = catalog != pg_sys::InvalidOid && {
        let _path = crate::store::PinnedSearchPath::pin();
        Spi::get_one_with_args::<bool>(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p \
              WHERE p.logicalrelid OPERATOR(pg_catalog.=) $1::pg_catalog.regclass)",
            &[relid.into()],
        )
        // An SPI failure counts as distributed: the SQL path is right for every table.
        .map_or(true, |d| d.unwrap_or(false))
    };
    CACHED.with(|c| c.set(Some((relid, distributed))));
    distributed
}
