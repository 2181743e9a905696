//! Everything that reads or writes `idempotency.idempotency_keys` (and its audit table) from
//! Rust, in layers:
//!
//! - the algorithms: [`claim`] (the claim decision applied to the row), [`complete`] (storing
//!   the response) and [`sweep`] (deleting expired rows);
//! - the two ways to the table: [`sql`], the statement texts and their prepared plans, every
//!   statement schema-qualified and parameterized; and [`heap`], the access below SQL (the
//!   dirty-snapshot look-up through the primary key, the direct heap and index writes, the
//!   per-key insert lock), made only where [`catalog`] says the table is as the extension
//!   made it;
//! - [`catalog`]: facts about the table read from the catalog and cached per backend (its
//!   columns and their positions, the access checks, the key storage mode, whether direct
//!   writes are allowed), the session's row of `idempotency.role_settings` (the settings that
//!   bind it: the `SET ROLE` role's row, else the login role's; read by `binding`) and the
//!   search-path pin.
//!
//! Calls flow one way: algorithm -> SQL or heap -> catalog, never back up. The catalog calls
//! neither `sql` nor `heap` (it reads the catalog with queries of its own), `sql` and `heap`
//! call no algorithm and not each other. The types shared across the layers (requests,
//! results, the row as claim reads it) and the error helpers are defined here.

use crate::error::raise;
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;

mod catalog;
mod claim;
mod complete;
mod heap;
mod path;
mod sql;
mod sweep;

pub(crate) use catalog::column_is;
pub use catalog::{role_settings, stored_form};
#[cfg(any(test, feature = "pg_test"))]
pub(crate) use claim::without_waiting;
pub use claim::{claim, claim_many};
pub use complete::complete;
pub use heap::{now_plus, transaction_start};
pub use sweep::{expired_since, in_batches, sweep_audit_batch, sweep_batch, sweep_start};

/// Whether the store is distributed by a typed tenant column (`distribute(tenant_type => ...)`).
pub(crate) fn tenant_store() -> bool {
    catalog::tenant_type() != pgrx::pg_sys::InvalidOid
}

/// A jsonb value copied out of an SPI result into the caller's memory context.
pub struct OwnedJsonb(pub pg_sys::Datum);

impl FromDatum for OwnedJsonb {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _: pg_sys::Oid,
    ) -> Option<Self> {
        if is_null {
            None
        } else {
            // pgrx calls this inside the parent memory context: the copy outlives SPI.
            // SAFETY: `datum` is a non-null jsonb (a varlena) of the SPI row being read.
            let copy = unsafe { pg_sys::pg_detoast_datum_copy(datum.cast_mut_ptr()) };
            Some(OwnedJsonb(pg_sys::Datum::from(copy)))
        }
    }
}

impl IntoDatum for OwnedJsonb {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(self.0)
    }
    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

pub use crate::decision::Outcome;

/// What `claim` returns (the fields of `idempotency.claim_result`).
pub struct ClaimResult {
    pub outcome: Outcome,
    pub token: Option<i64>,
    pub response: Option<OwnedJsonb>,
    pub response_status: Option<i32>,
    pub retry_after: Option<Interval>,
    pub expires_at: Option<TimestampWithTimeZone>,
    pub recovery_point: Option<String>,
    /// The claim took over an in-progress key whose lease had run out.
    pub took_over: bool,
    /// How long the claim waited for a busy key (`idempotency.claim_wait`), if it waited.
    pub waited: Option<std::time::Duration>,
}

impl ClaimResult {
    fn new(outcome: Outcome) -> ClaimResult {
        ClaimResult {
            outcome,
            token: None,
            response: None,
            response_status: None,
            retry_after: None,
            expires_at: None,
            recovery_point: None,
            took_over: false,
            waited: None,
        }
    }
}

pub struct ClaimRequest<'a> {
    pub scope: &'a str,
    pub key: &'a str,
    pub hash: Option<[u8; 32]>,
    pub ttl: Interval,
    pub lease: Interval,
}

/// One row as claim reads it.
pub(crate) struct Row {
    pub(crate) completed: bool,
    pub(crate) request_hash: Option<Vec<u8>>,
    pub(crate) token: Option<i64>,
    pub(crate) response: Option<OwnedJsonb>,
    pub(crate) response_status: Option<i32>,
    pub(crate) recovery_point: Option<String>,
    pub(crate) expires_at: Option<TimestampWithTimeZone>,
    pub(crate) expired: bool,
    pub(crate) lease_over: bool,
    pub(crate) retry_after: Option<Interval>,
}

/// Claims, completions and sweeps write: refuse them at once, clearly, on a standby or in a
/// read-only transaction (a replay could otherwise be answered from the index alone).
pub fn refuse_read_only(function: &str) {
    // SAFETY: reads a backend variable, set for the transaction.
    if unsafe { pg_sys::XactReadOnly } {
        // SAFETY: reads shared memory state; raises no ERROR.
        let standby = unsafe { pg_sys::RecoveryInProgress() };
        raise(
            PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION,
            format!(
                "idempotency.{function} cannot run in a read-only transaction{}",
                if standby {
                    " (this server is a standby)"
                } else {
                    ""
                }
            ),
            Some("claim, complete and sweep on the primary; idempotency.lookup works on a standby"),
        );
    }
}

/// A statement run for the SQL function `function` failed in SPI: XX000, naming the function.
pub(crate) fn spi_failed(function: &str, e: pgrx::spi::Error) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        format!("idempotency.{function}: {e}"),
        None,
    )
}

/// An error the caller cannot act on (XX000), as `idempotency: {what}`.
pub(crate) fn internal(what: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        format!("idempotency: {what}"),
        None,
    )
}

/// The table was altered while a claim or completion had already chosen how to write to it.
pub(crate) fn table_changed(what: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
        format!("idempotency: the table changed during a {what}"),
        Some("retry the transaction"),
    )
}

/// How many times claim re-reads a row that changed under it before giving up.
pub(crate) const MAX_ROUNDS: usize = 50;

pub struct CompleteRequest<'a> {
    pub scope: &'a str,
    pub key: &'a str,
    pub response: Option<pg_sys::Datum>,
    pub response_status: i32,
    pub token: Option<i64>,
    pub ttl: Option<Interval>,
    /// Whether the completion writes an audit row (`binding::audit`, decided by the caller).
    pub audit: bool,
}

/// What a completion changed: the new expiry, and the claim's request hash and token (for the
/// audit row).
pub(crate) struct Completed {
    pub(crate) expires_at: Option<TimestampWithTimeZone>,
    pub(crate) request_hash: Option<Vec<u8>>,
    pub(crate) token: Option<i64>,
}
