//! The background sweeper's pacing: how many rows a batch deletes and how long the sweeper
//! pauses after it, depending on whether the rest of the server wrote WAL meanwhile (its sign
//! that the application is busy). The worker reads the WAL positions; the arithmetic is here.

use std::time::Duration;

/// The slice of a backlog the sweeper deletes per batch while the application is writing: a
/// hundredth of a full batch (100 rows with the defaults), never fewer than 100 rows. Small
/// slices, often: each transaction of the sweeper holds its pages' buffer locks briefly and
/// leaves little WAL (and few full-page images) for the application's next commit to flush
/// behind it, which is what a claim's p99 feels.
/// (How the slice was chosen, measured: docs/benchmarks.md, "How the optimisations were
/// measured".)
pub fn yielding_batch(full: i64) -> i64 {
    (full / 100).max(100).min(full)
}

/// The pause after a full batch, for `sweep_delay = delay`: four times it while the application
/// writes, a fifth of it on an idle server (nobody to leave the CPU or the WAL to; the pause
/// only keeps a look at the WAL between two batches). A zero delay sweeps flat out either way.
/// (How the pauses were chosen, measured: docs/benchmarks.md, "How the optimisations were
/// measured".)
pub fn pause(delay: Duration, busy: bool) -> Duration {
    if busy {
        delay * 4
    } else {
        delay / 5
    }
}

/// Whether the server counts as busy after one of the sweeper's cycles (a batch and its
/// pause): it does when the others wrote during it ([`others_wrote`]); it stops counting as busy
/// only after a whole pause in which they did not. A pause cut short (a reload or another signal
/// woke the sweeper a moment after its batch) saw too little WAL to call a busy server idle,
/// and an idle verdict sends a full batch into the application's transactions: the verdict
/// stays as it was. (Seen in the benchmark, whose switches are reloads: a full batch of 10,000
/// rows in about half of the 20 s runs under load.)
pub fn busy_after(was_busy: bool, others_wrote: bool, whole_pause: bool) -> bool {
    others_wrote || (was_busy && !whole_pause)
}

/// WAL the rest of the server must write during one of the sweeper's cycles (a batch and the
/// pause after it) before it counts as busy: a page, more than the odd checkpoint or
/// running-transactions record of an idle server.
pub const BUSY_WAL_BYTES: u64 = 8192;

/// A look at the WAL from the sweeper: the server's insert position, and the bytes and records
/// this process has written so far (PostgreSQL's `pgWalUsage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WalMark {
    pub position: u64,
    pub own_bytes: u64,
    pub own_records: u64,
}

/// WAL page size, and the longest page header (the first page of a segment has the long one).
const WAL_PAGE: u64 = 8192;
const PAGE_HEADER_MAX: u64 = 40;
/// Each record starts 8-byte aligned: at most 7 bytes of padding after each of ours.
const RECORD_PADDING_MAX: u64 = 7;

/// Whether the rest of the server wrote at least [`BUSY_WAL_BYTES`] of WAL between two marks:
/// the insert position's advance less what this process wrote, with the most padding and
/// page headers its records can have taken. So a cycle's own deletions (megabytes for a full
/// batch after a checkpoint) never count as the application's, and what is left is a lower
/// bound of the others' WAL.
pub fn others_wrote(before: &WalMark, after: &WalMark) -> bool {
    let advance = after.position.saturating_sub(before.position);
    let records = after.own_records.saturating_sub(before.own_records);
    let own = after.own_bytes.saturating_sub(before.own_bytes)
        + records.saturating_mul(RECORD_PADDING_MAX)
        + (advance / WAL_PAGE + 1) * PAGE_HEADER_MAX;
    advance.saturating_sub(own) >= BUSY_WAL_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(position: u64, own_bytes: u64, own_records: u64) -> WalMark {
        WalMark {
            position,
            own_bytes,
            own_records,
        }
    }

    #[test]
    fn a_busy_server_gets_small_batches_of_at_least_a_hundred_rows() {
        assert_eq!(yielding_batch(10_000), 100);
        assert_eq!(yielding_batch(50_000), 500);
        assert_eq!(yielding_batch(2_000), 100);
        assert_eq!(yielding_batch(50), 50);
    }

    #[test]
    fn the_pause_is_four_times_the_delay_under_load_and_a_fifth_of_it_idle() {
        let delay = Duration::from_millis(50);
        assert_eq!(pause(delay, true), Duration::from_millis(200));
        assert_eq!(pause(delay, false), Duration::from_millis(10));
        assert_eq!(pause(Duration::ZERO, true), Duration::ZERO);
        assert_eq!(pause(Duration::ZERO, false), Duration::ZERO);
    }

    #[test]
    fn only_a_whole_quiet_pause_makes_a_busy_server_idle() {
        // Others wrote: busy, however the pause ended.
        assert!(busy_after(false, true, true));
        assert!(busy_after(false, true, false));
        assert!(busy_after(true, true, false));
        // Nobody wrote during a whole pause: idle.
        assert!(!busy_after(true, false, true));
        assert!(!busy_after(false, false, true));
        // A pause cut short keeps the verdict.
        assert!(busy_after(true, false, false));
        assert!(!busy_after(false, false, false));
    }

    #[test]
    fn the_sweepers_own_wal_does_not_make_the_server_busy() {
        // A full batch after a checkpoint: 20,000 records, 3 MB with full-page images, each
        // record padded to 8 bytes and a 24-byte header on each WAL page.
        let (records, bytes) = (20_000u64, 3_000_000u64);
        let padded = bytes + records * 7;
        let advance = padded + (padded / 8192 + 1) * 24;
        let before = mark(1 << 30, 5_000, 10);
        let after = mark((1 << 30) + advance, 5_000 + bytes, 10 + records);
        assert!(!others_wrote(&before, &after));
    }

    #[test]
    fn a_page_of_wal_from_others_makes_the_server_busy() {
        let before = mark(1 << 30, 0, 0);
        let own = mark((1 << 30) + 10_000, 9_000, 100);
        let with_others = mark(own.position + 2 * 8192, own.own_bytes, own.own_records);
        assert!(!others_wrote(&before, &own));
        assert!(others_wrote(&before, &with_others));
        // During a pause alone (nothing of ours), a page is enough; less is not.
        let quiet = mark(1 << 30, 0, 0);
        assert!(others_wrote(&quiet, &mark((1 << 30) + 8192 + 80, 0, 0)));
        assert!(!others_wrote(&quiet, &mark((1 << 30) + 4096, 0, 0)));
    }
}
