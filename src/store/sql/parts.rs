//! The parts of a table this node holds (on Citus its shards placed here, else its leaf
//! partitions), and a sweep run part by part over them.

use crate::store::catalog::{citus_table, PinnedSearchPath};
use pgrx::prelude::*;

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

/// The leaf partitions of `table` (a plain table is its own only leaf), under their
/// schema-qualified names (the search path is pinned to pg_catalog).
const PARTITIONS_SQL: &str = "SELECT t.relid::pg_catalog.regclass::pg_catalog.text \
       FROM pg_catalog.pg_partition_tree($1::pg_catalog.regclass) AS t \
      WHERE t.isleaf ORDER BY t.relid";

/// The parts of `table` this node holds, schema-qualified: on Citus its shards placed on this
/// node (read from this node's own metadata: no other node is asked), else its leaf partitions.
pub(crate) fn local_parts(
    client: &pgrx::spi::SpiClient<'_>,
    table: &str,
) -> Result<Vec<String>, pgrx::spi::Error> {
    Ok(client
        .select(
            if citus_table() {
                LOCAL_SHARDS_SQL
            } else {
                PARTITIONS_SQL
            },
            None,
            &[table.into()],
        )?
        .filter_map(|r| r.get::<String>(1).ok().flatten())
        .collect())
}

/// A sweep on Citus or of a partitioned store: runs the DELETE `statement(part)` on each of this
/// node's parts of `table` (schema-qualified), until `batch` rows are deleted; `args(left)`
/// gives the statement's arguments for at most `left` more rows. Each node sweeps the shards
/// it holds (its background sweeper runs this): a DELETE of the distributed table with a
/// row-locking subquery is no statement Citus runs across shards. Without Citus the parts are
/// the table's partitions: the statement matches rows by ctid, which is unique in one
/// partition only.
pub(crate) fn sweep_local_shards<'a>(
    table: &str,
    statement: impl Fn(&str) -> String,
    batch: i64,
    args: impl Fn(i64) -> Vec<pgrx::datum::DatumWithOid<'a>>,
) -> Result<i64, pgrx::spi::Error> {
    let _path = PinnedSearchPath::pin();
    Spi::connect_mut(|client| {
        let shards = local_parts(client, table)?;
        let mut deleted = 0;
        for shard in shards {
            if deleted >= batch {
                break;
            }
            deleted += client
                .update(statement(&shard).as_str(), None, &args(batch - deleted))?
                .len() as i64;
        }
        Ok(deleted)
    })
}
