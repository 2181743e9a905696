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

/// This node's shards of `table`: the placements in its group whose relation exists here (a
/// shard being moved away stays until Citus drops it; one being moved here appears when the
/// move completes).
const LOCAL_SHARDS_SQL: &str = "SELECT pg_catalog.shard_name(s.logicalrelid, s.shardid) \
       FROM pg_catalog.pg_dist_shard AS s \
       JOIN pg_catalog.pg_dist_placement AS p ON p.shardid OPERATOR(pg_catalog.=) s.shardid \
      WHERE s.logicalrelid OPERATOR(pg_catalog.=) $1::pg_catalog.regclass \
        AND p.groupid OPERATOR(pg_catalog.=) (SELECT g.groupid FROM pg_catalog.pg_dist_local_group AS g) \
        AND pg_catalog.to_regclass(pg_catalog.shard_name(s.logicalrelid, s.shardid)) IS NOT NULL \
      ORDER BY s.shardid";

/// A sweep on Citus: runs `statement`, a DELETE that names `table` (schema-qualified, as in
/// the statement), on each of this node's shards of `table` in its place, until `batch` rows
/// are deleted; `args(left)` gives the statement's arguments for at most `left` more rows.
/// Each node sweeps the shards it holds (its background sweeper runs this): a DELETE of the
/// distributed table with a row-locking subquery is no statement Citus runs across shards.
pub fn sweep_local_shards<'a>(
    table: &str,
    statement: &str,
    batch: i64,
    args: impl Fn(i64) -> Vec<pgrx::datum::DatumWithOid<'a>>,
) -> Result<i64, pgrx::spi::Error> {
    let _path = crate::store::PinnedSearchPath::pin();
    Spi::connect_mut(|client| {
        let shards: Vec<String> = client
            .select(LOCAL_SHARDS_SQL, None, &[table.into()])?
            .filter_map(|r| r.get::<String>(1).ok().flatten())
            .collect();
        let mut deleted = 0;
        for shard in shards {
            if deleted >= batch {
                break;
            }
            let sql = statement.replace(table, &shard);
            deleted += client
                .update(sql.as_str(), None, &args(batch - deleted))?
                .len() as i64;
        }
        Ok(deleted)
    })
}
