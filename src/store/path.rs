//! Which path a call takes to the table: the table "Which path a call takes" of
//! docs/architecture.md in code, one variant a row. [`Path::choose`] decides it once per
//! `claim` call, per chunk of a `claim_many` and per completion, and is the only place that
//! reads the isolation level, whether the store is partitioned or distributed
//! ([`sql_only`]) and whether the table is as the extension made it; the algorithms match on
//! the value. With `client_min_messages` (or `log_min_messages`) at `debug1` each choice is
//! reported: `idempotency: claim takes the direct path`.

use super::catalog::{direct_layout, direct_layout_for_write, sql_only, DirectLayout};
use crate::guc;
use pgrx::pg_sys;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Path {
    /// READ COMMITTED, the table as the extension made it: the look-up below SQL; new keys
    /// (`claim`'s insert, `claim_many`'s multi-insert) and completions written below SQL, each
    /// write after [`Path::write_layout`] confirmed the table under its write lock; restart and
    /// takeover through SQL.
    Direct,
    /// READ COMMITTED, the table changed (a trigger, rule, extra column, changed default,
    /// identity or generated column, constraint, row-level security, in a publication, a
    /// partition of another table or an inheritance child): the look-up below SQL, every write
    /// through SQL, so what was added takes effect.
    SqlWrites,
    /// READ COMMITTED, `idempotency.force_sql_path` on: the look-up below SQL, every write
    /// through SQL, as on a changed table.
    ForcedSqlWrites,
    /// The store hash-partitioned by the extension (`idempotency.partitions`) or distributed by
    /// Citus, at any isolation level: the table's own relation, which the look-up below SQL
    /// scans, holds no rows, so the look-up and every write go through SQL: the insert first
    /// (`ON CONFLICT DO NOTHING`, which waits for another transaction inserting or changing
    /// the key's row), the look-up only when the key is there.
    SqlOnly,
    /// REPEATABLE READ and SERIALIZABLE: the row read through the transaction's snapshot by
    /// the `SELECT`, every write through SQL (an absent key inserted under its insert lock with
    /// `ON CONFLICT DO NOTHING`, which turns a row committed after the snapshot into a
    /// serialization failure), so the executor applies its snapshot and predicate-lock rules.
    Snapshot,
}

impl Path {
    /// The path `call` (`claim`, `claim_many` or `complete`) takes now. Reads no more than the
    /// per-backend caches: it takes no lock on the table (a replay writes nothing and must not
    /// wait for one); a write below SQL confirms the table first ([`Path::write_layout`]).
    pub(crate) fn choose(call: &str) -> Path {
        let path = if sql_only() {
            Path::SqlOnly
        } else if !read_committed() {
            Path::Snapshot
        } else if guc::FORCE_SQL_PATH.get() {
            Path::ForcedSqlWrites
        } else if direct_layout().is_some() {
            Path::Direct
        } else {
            Path::SqlWrites
        };
        path.report(call);
        path
    }

    /// Whether the key is looked up below SQL (with the dirty snapshot) on this path.
    pub(crate) fn looks_up_below_sql(self) -> bool {
        matches!(self, Path::Direct | Path::SqlWrites | Path::ForcedSqlWrites)
    }

    /// Before a write: on the direct path, the table locked for writing (which applies the
    /// invalidations of DDL committed since [`Path::choose`] read the catalog, as the
    /// executor's lock at the start of a statement does) and its layout read again, for the
    /// write below SQL; None on every other path, and when the table changed meanwhile (then
    /// the write goes through SQL, reported as the `sql_writes` path of `call`).
    pub(crate) fn write_layout(self, call: &str) -> Option<DirectLayout> {
        if self != Path::Direct {
            return None;
        }
        let layout = direct_layout_for_write();
        if layout.is_none() {
            Path::SqlWrites.report(call);
        }
        layout
    }

    fn name(self) -> &'static str {
        match self {
            Path::Direct => "direct",
            Path::SqlWrites => "sql_writes",
            Path::ForcedSqlWrites => "forced_sql_writes",
            Path::SqlOnly => "sql_only",
            Path::Snapshot => "snapshot",
        }
    }

    /// The DEBUG1 line of the choice, formatted only when someone will see it.
    fn report(self, call: &str) {
        // SAFETY: reads the logging settings of this backend; raises no ERROR.
        if unsafe { pg_sys::message_level_is_interesting(pg_sys::DEBUG1 as i32) } {
            pgrx::debug1!("idempotency: {call} takes the {} path", self.name());
        }
    }
}

/// Whether the transaction runs at READ COMMITTED (or READ UNCOMMITTED, which PostgreSQL runs
/// as READ COMMITTED): every statement sees the newest committed rows.
fn read_committed() -> bool {
    // SAFETY: reads a backend variable, set for the transaction.
    unsafe { pg_sys::XactIsoLevel < pg_sys::XACT_REPEATABLE_READ as i32 }
}
