//! Completion: the response stored on the live in-progress claim, directly in the heap under
//! READ COMMITTED on a table as the extension made it, through the UPDATE statement otherwise.

use super::catalog::{check_access, check_citus_node, check_layout, layout, PinnedSearchPath};
use super::path::Path;
use super::{heap, sql, CompleteRequest};
use pgrx::datum::TimestampWithTimeZone;

/// Completes a claim (`req.key` in its stored form); None when there is no live in-progress
/// claim with that token (the SQL wrapper then explains why, with its own SQLSTATE).
///
/// On the direct [`Path`] (READ COMMITTED, the table as the extension made it) the row is
/// updated below SQL ([`heap::complete_direct`]); on every other path (REPEATABLE READ and
/// SERIALIZABLE, whose snapshot and predicate-lock rules the executor applies; a table changed
/// by hand, with rules, or published; `idempotency.force_sql_path`; a partitioned or Citus
/// store) through the UPDATE statement.
pub fn complete(req: &CompleteRequest<'_>) -> Option<TimestampWithTimeZone> {
    let _search_path = PinnedSearchPath::pin();
    // Both paths read the completed row's columns as the extension's types.
    check_layout(&layout());
    let done = match Path::choose("complete").write_layout("complete") {
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
