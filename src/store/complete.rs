//! Completion: the response stored on the live in-progress claim, directly in the heap under
//! READ COMMITTED on a table as the extension made it, through the UPDATE statement otherwise.

use super::catalog::{
    check_access, check_citus_node, check_layout, direct_layout_for_write, layout, PinnedSearchPath,
};
use super::{heap, sql, CompleteRequest};
use pgrx::datum::TimestampWithTimeZone;
use pgrx::pg_sys;

/// Completes a claim (`req.key` in its stored form); None when there is no live in-progress
/// claim with that token (the SQL wrapper then explains why, with its own SQLSTATE).
///
/// Under READ COMMITTED the row is updated directly ([`heap::complete_direct`]); under REPEATABLE
/// READ and SERIALIZABLE (whose snapshot and predicate-lock rules the executor applies) and on
/// a table that is not as the extension made it (`catalog::direct_layout`: changed by hand,
/// with rules, or published), through the UPDATE statement.
pub fn complete(req: &CompleteRequest<'_>) -> Option<TimestampWithTimeZone> {
    let _path = PinnedSearchPath::pin();
    // Both paths read the completed row's columns as the extension's types.
    check_layout(&layout());
    // SAFETY: reads a backend variable, set for the transaction.
    let read_committed = unsafe { pg_sys::XactIsoLevel } < pg_sys::XACT_REPEATABLE_READ as i32;
    let direct = if read_committed {
        direct_layout_for_write()
    } else {
        None
    };
    let done = match direct {
        Some(d) => {
            check_access();
            heap::complete_direct(&d, req)
        }
        None => sql::complete_sql(req),
    };
    let done = done?;
    if req.audit {
        // On Citus: this node's audit ids must be of its own range.
        check_citus_node();
        sql::audit(req, &done);
    }
    done.expires_at
}
