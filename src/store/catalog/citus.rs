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

/// Tokens on Citus: node `g` (its group id, the coordinator 0) hands out only tokens `t` with
/// `t % TOKEN_STRIDE == g`: its `token_seq` counts up by the stride from a value of its class
/// (`idempotency.distribute()` sets this up on every node). Tokens are then unique across the
/// cluster, and a node can always find a token of its own above a key's current one, whatever
/// node gave that (a takeover, see `sql::claim::next_token_above`). Group ids of 65,536 and more
/// are refused.
const TOKEN_STRIDE: i64 = 1 << 16;

/// Audit ids on Citus: node `g`'s `audit_id_seq` counts from `g << 48` (the coordinator's from
/// 1): audit ids are unique across the cluster, as the audit table's key `(scope, id)` needs
/// wherever completions of one scope run on several nodes.
const AUDIT_ID_SHIFT: u32 = 48;

/// Whether this backend found its node's sequences set up (once found, kept: a node's group
/// id does not change while it is in the cluster).
static NODE_READY: crate::local::BackendLocal<std::cell::Cell<bool>> =
    crate::local::BackendLocal::new(std::cell::Cell::new(false));

/// Refuses a claim or an audited completion on a Citus node whose token and audit id sequences
/// have not been given this node's class and range (a node added after `distribute()`, or a
/// store distributed by an older release): its tokens would repeat another node's, and a stale
/// holder's `complete` could be accepted. 55000, naming the fix.
pub(super) fn check_node_sequences() {
    if NODE_READY.with(std::cell::Cell::get) {
        return;
    }
    let _path = super::PinnedSearchPath::pin();
    let found = Spi::get_three_with_args::<i32, i64, i64>(
        "SELECT g.groupid, s.seqincrement, t.last_value \
           FROM pg_catalog.pg_dist_local_group AS g, pg_catalog.pg_sequence AS s, \
                idempotency.token_seq AS t \
          WHERE s.seqrelid OPERATOR(pg_catalog.=) 'idempotency.token_seq'::pg_catalog.regclass",
        &[],
    );
    let audit = Spi::get_one::<i64>("SELECT a.last_value FROM idempotency.audit_id_seq AS a");
    let (group, increment, last) = match found {
        Ok((Some(g), Some(i), Some(l))) => (i64::from(g), i, l),
        _ => (-1, 0, 0),
    };
    let audit_ok = match audit {
        // The coordinator (group 0) keeps ids below 1 << 48 from the start.
        Ok(Some(a)) => group == 0 || a >> AUDIT_ID_SHIFT == group,
        // No audit sequence (an old schema): nothing to check for it.
        _ => true,
    };
    if (0..TOKEN_STRIDE).contains(&group)
        && increment == TOKEN_STRIDE
        && last.rem_euclid(TOKEN_STRIDE) == group
        && audit_ok
    {
        NODE_READY.with(|c| c.set(true));
        return;
    }
    crate::error::raise(
        pgrx::PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
        format!(
            "idempotency: this Citus node (group {group}) has no token and audit id range of its own yet: \
             its tokens could repeat another node's"
        ),
        Some(
            "run SELECT idempotency.distribute() on the coordinator: it gives every node added since \
             (or distributed by an older release) its own ranges; see docs/scaling.md",
        ),
    );
}
