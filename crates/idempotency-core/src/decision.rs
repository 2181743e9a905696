//! The claim state machine of the SQL API contract, as a pure function of one stored row.

/// What `claim` does with the row it found for (scope, key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Completed, same request: return the stored response.
    Replay,
    /// In progress and its lease is still running.
    InProgress,
    /// A live row for a different request.
    Mismatch,
    /// The row expired: it counts as absent, so it is rewritten as a fresh claim.
    Restart,
    /// In progress but the lease ran out: take it over with a larger token.
    TakeOver,
}

/// An expired key counts as absent even while a sweep is deleting it: the transaction of every
/// sweep holds the advisory lock (`SWEEP_LOCK_CLASS`, its transaction id's low 32 bits as an
/// int4) in share mode before it locks a row, so that a claim which finds an expired row held
/// by another transaction can tell a sweep (wait for it to end, then claim the key anew) from
/// another claimer (in progress). "idem" in ASCII.
pub const SWEEP_LOCK_CLASS: i32 = 1_768_187_245;

/// What `claim` answers: the four outcomes of the SQL API contract (`claim_result.outcome`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    New,
    Replay,
    InProgress,
    Mismatch,
}

impl Outcome {
    /// The outcome's name in SQL.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::New => "new",
            Outcome::Replay => "replay",
            Outcome::InProgress => "in_progress",
            Outcome::Mismatch => "mismatch",
        }
    }
}

/// The stored row, as `claim` reads it (times compared by the database at `now()`).
#[derive(Debug, Clone, Copy)]
pub struct Stored<'a> {
    pub completed: bool,
    pub request_hash: Option<&'a [u8]>,
    pub expired: bool,
    pub lease_over: bool,
}

/// A NULL on either side skips the comparison.
pub fn hashes_match(stored: Option<&[u8]>, given: Option<&[u8]>) -> bool {
    match (stored, given) {
        (Some(s), Some(g)) => s == g,
        _ => true,
    }
}

/// Applies the outcome table: expiry first (an expired row is absent), then the request hash,
/// then the status and the lease.
pub fn decide(row: Stored<'_>, given_hash: Option<&[u8]>) -> Decision {
    if row.expired {
        Decision::Restart
    } else if !hashes_match(row.request_hash, given_hash) {
        Decision::Mismatch
    } else if row.completed {
        Decision::Replay
    } else if row.lease_over {
        Decision::TakeOver
    } else {
        Decision::InProgress
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(completed: bool, hash: Option<&[u8]>, expired: bool, lease_over: bool) -> Stored<'_> {
        Stored {
            completed,
            request_hash: hash,
            expired,
            lease_over,
        }
    }

    #[test]
    fn outcome_table() {
        let (a, b): (&[u8], &[u8]) = (b"a", b"b");
        assert_eq!(
            decide(row(true, Some(a), false, false), Some(a)),
            Decision::Replay
        );
        assert_eq!(
            decide(row(true, Some(a), false, false), Some(b)),
            Decision::Mismatch
        );
        assert_eq!(
            decide(row(false, Some(a), false, false), Some(a)),
            Decision::InProgress
        );
        assert_eq!(
            decide(row(false, Some(a), false, false), Some(b)),
            Decision::Mismatch
        );
        assert_eq!(
            decide(row(false, Some(a), false, true), Some(a)),
            Decision::TakeOver
        );
        assert_eq!(
            decide(row(false, Some(a), false, true), Some(b)),
            Decision::Mismatch
        );
        // Expired rows are absent whatever they hold.
        assert_eq!(
            decide(row(true, Some(a), true, false), Some(b)),
            Decision::Restart
        );
        assert_eq!(
            decide(row(false, Some(a), true, true), Some(a)),
            Decision::Restart
        );
        // NULL on either side matches anything.
        assert_eq!(
            decide(row(true, None, false, false), Some(b)),
            Decision::Replay
        );
        assert_eq!(
            decide(row(true, Some(a), false, false), None),
            Decision::Replay
        );
    }
}
