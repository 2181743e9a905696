//! Whether the store is a Citus table.
//!
//! On Citus a distributed table's own relation, on the coordinator and on every worker, is an
//! empty shell: its rows live in shard relations that Citus routes SQL to. Whatever reads or
//! writes the table below SQL (the primary-key probe, the direct insert and update) would
//! read an empty table and write rows that no query sees, so the store goes through SQL
//! wherever this says so (see docs/scaling.md). Cached with the rest of the table's facts
//! ([`super::citus_table`]); Citus invalidates the table's relcache entry when it distributes
//! or undistributes it.

use pgrx::prelude::*;

/// Whether `relid` is a Citus table (distributed, reference or managed by Citus in any way):
/// false without a catalog query where Citus is not installed (no `pg_dist_partition`).
pub(super) fn is_citus_table(relid: pg_sys::Oid) -> bool {
    // SAFETY: a syscache look-up by name in pg_catalog.
    let catalog = unsafe {
        pg_sys::get_relname_relid(
            c"pg_dist_partition".as_ptr(),
            pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE),
        )
    };
    catalog != pg_sys::InvalidOid && {
        let _path = super::PinnedSearchPath::pin();
        Spi::get_one_with_args::<bool>(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p \
              WHERE p.logicalrelid OPERATOR(pg_catalog.=) $1::pg_catalog.regclass)",
            &[relid.into()],
        )
        // An SPI failure counts as distributed: the SQL path is right for every table.
        .map_or(true, |d| d.unwrap_or(false))
    }
}
