//! Random-input fuzz harness for the canonicalizer (`crates/idempotency-core/src/canonical.rs`),
//! on stable Rust.
//!
//! Every execution generates one JSON text from a seeded RNG (valid documents, mutated ones,
//! random bytes, deep nesting, huge numbers, long strings, escapes and surrogates, duplicate
//! names), runs it through `parse_json` and both number layouts, and checks:
//!
//! * no panic (`catch_unwind`) and no hang (a watchdog aborts an execution over its time budget);
//! * the parser agrees with an independent one (`serde_json`) on what is JSON and on the tree,
//!   and refuses nesting deeper than 1000 levels with `TooDeep`, never a crash;
//! * the canonical output is JSON, escapes exactly what RFC 8785 escapes, sorts members by UTF-16
//!   code units, and re-canonicalizes to itself (idempotence) in both modes;
//! * exact-mode numbers keep their value; rfc8785-mode numbers are the ECMAScript spelling of the
//!   nearest double (checked against Rust's own shortest float formatting, not `ryu-js`), and only
//!   numbers outside the double range are refused;
//! * `exclude` with random JSON Pointers never panics and refuses exactly the malformed ones;
//! * in oracle mode, the output equals `tests/oracle/jcs_oracle.py` (the `rfc8785` Python
//!   package) line by line, in `exact` and in `rfc8785` mode.
//!
//! The jsonb mode feeds bytes to the jsonb binary reader (`idempotency_core::jsonb`): the
//! generator's documents laid out as the server lays them out, the same with random damage, and
//! random bytes; it checks no panic, no hang, allocation in proportion to the bytes, that laid-out
//! documents read back exactly, and that both readers agree and give canonical JSON (`jsonb.rs`).
//!
//! Execution `i` of seed `s` is generated from (s, i) alone, so any report can be replayed with
//! `FUZZ_REPLAY=i` (and the same `FUZZ_SEED`); the input is written to `fuzz/artifacts/`.
//!
//! Environment: `FUZZ_MODE` (`invariant` | `jsonb` | `oracle` | `both`, default `both`: all three),
//! `FUZZ_EXECS` (invariant executions, default 200000), `FUZZ_JSONB_EXECS` (default 1000000), `FUZZ_ORACLE_EXECS` (default 5000), `FUZZ_SEED`
//! (default 1), `FUZZ_THREADS` (default 1), `FUZZ_REPLAY`, `FUZZ_PYTHON` (default `python3`).

mod checks;
mod generate;
mod jsonb;
mod oracle;
mod rng;
mod runner;

/// What every module of the harness uses.
mod prelude {
    pub(crate) use crate::checks::*;
    pub(crate) use crate::generate::*;
    pub(crate) use crate::jsonb::*;
    pub(crate) use crate::oracle::*;
    pub(crate) use crate::rng::*;
    pub(crate) use crate::runner::*;
    pub(crate) use idempotency_core::canonical;
    pub(crate) use idempotency_core::canonical::{
        canonicalize, exclude, CanonError, NumberMode, Value,
    };
    pub(crate) use idempotency_core::json_text::parse_json;
    pub(crate) use serde::Deserialize;
    pub(crate) use std::cmp::Ordering;
    pub(crate) use std::collections::BTreeMap;
    pub(crate) use std::io::{BufRead, BufReader, Write};
    pub(crate) use std::panic::{catch_unwind, AssertUnwindSafe};
    pub(crate) use std::process::{Command, Stdio};
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtOrd};
    pub(crate) use std::sync::{Arc, Mutex};
    pub(crate) use std::time::{Duration, Instant};
}

use prelude::*;

/// Counts each thread's allocations (the jsonb reader's bound), then allocates as usual.
#[global_allocator]
static ALLOCATOR: Counting = Counting;

pub(crate) fn print_stats(label: &str, s: &Stats, secs: f64) {
    println!(
        "canon-fuzz {label}: {} executions in {secs:.1} s ({:.0}/s), {} MB, largest {} bytes; \
         accepted {}, refused as not JSON {}, refused as too deep {}, rfc8785 out of range {}; \
         failures {}",
        s.execs,
        s.execs as f64 / secs.max(1e-9),
        s.bytes / 1_000_000,
        s.max_len,
        s.accepted,
        s.rejected_parse,
        s.rejected_deep,
        s.rfc_out_of_range,
        s.failures.values().sum::<u64>(),
    );
    for (k, v) in &s.known {
        println!("canon-fuzz {label}: known issue ({v} inputs): {k}");
    }
    for (k, v) in &s.failures {
        println!("canon-fuzz {label}: FAILURE {k}: {v} inputs");
    }
}

pub(crate) fn main() {
    // serde_json recurses without limit (documents nest up to 100,000 levels): run everything
    // on a thread with a large stack.
    let code = std::thread::Builder::new()
        .stack_size(1 << 30)
        .spawn(real_main)
        .map(|h| h.join().unwrap_or(2))
        .unwrap_or(2);
    std::process::exit(code);
}

pub(crate) fn real_main() -> i32 {
    let seed = env_u64("FUZZ_SEED", 1);
    let mode = std::env::var("FUZZ_MODE").unwrap_or_else(|_| "both".into());
    let origin = Instant::now();

    if let Some(path) = std::env::var_os("FUZZ_INPUT_FILE") {
        // Checks one given input (a saved artifact, or a hand-written case).
        let input = match std::fs::read(&path) {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(e) => {
                println!("cannot read {}: {e}", path.to_string_lossy());
                return 2;
            }
        };
        let mut stats = Stats::default();
        let code = match catch_unwind(AssertUnwindSafe(|| check(&input, &mut stats))) {
            Ok(Ok(())) if stats.known.is_empty() => {
                println!("invariants hold");
                0
            }
            Ok(Ok(())) => {
                println!("known issue: {:?}", stats.known.keys().collect::<Vec<_>>());
                0
            }
            Ok(Err(f)) => {
                println!("FAIL {}: {}", f.category, f.detail);
                1
            }
            Err(_) => {
                println!("FAIL panic");
                1
            }
        };
        return code;
    }

    if let Ok(r) = std::env::var("FUZZ_REPLAY") {
        let oracle = r.starts_with('o');
        let exec: u64 = r.trim_start_matches('o').parse().unwrap_or(0);
        let (s, input) = if oracle {
            let s = seed ^ 0x5EED_0F0C_1E00_0000;
            (s, generate(s, exec, true))
        } else {
            (seed, generate(seed, exec, false))
        };
        let path = save_artifact(&format!("replay-{s}-{exec}.json"), &input);
        println!(
            "input ({} bytes, saved to {path}): {}",
            input.len(),
            preview(&input)
        );
        let mut stats = Stats::default();
        match catch_unwind(AssertUnwindSafe(|| check(&input, &mut stats))) {
            Ok(Ok(())) => println!("invariants hold"),
            Ok(Err(f)) => println!("FAIL {}: {}", f.category, f.detail),
            Err(_) => println!("FAIL panic"),
        }
        return 0;
    }

    let mut failed = false;
    if mode == "invariant" || mode == "both" {
        let execs = env_u64("FUZZ_EXECS", 200_000);
        let threads = env_u64("FUZZ_THREADS", 1).max(1);
        let t = Instant::now();
        let stats = run_invariant(Target::Text, seed, execs, threads, origin);
        print_stats(
            &format!("invariant (seed {seed})"),
            &stats,
            t.elapsed().as_secs_f64(),
        );
        failed |= !stats.failures.is_empty() || stats.execs != execs;
    }
    if mode == "jsonb" || mode == "both" {
        let execs = env_u64("FUZZ_JSONB_EXECS", 1_000_000);
        let threads = env_u64("FUZZ_THREADS", 1).max(1);
        let t = Instant::now();
        let stats = run_invariant(Target::Jsonb, seed, execs, threads, origin);
        print_stats(
            &format!("jsonb (seed {seed})"),
            &stats,
            t.elapsed().as_secs_f64(),
        );
        failed |= !stats.failures.is_empty() || stats.execs != execs;
    }
    if mode == "oracle" || mode == "both" {
        let execs = env_u64("FUZZ_ORACLE_EXECS", 5_000);
        let t = Instant::now();
        match run_oracle_diff(seed, execs, origin) {
            Ok(stats) => {
                print_stats(
                    &format!("oracle (seed {seed})"),
                    &stats,
                    t.elapsed().as_secs_f64(),
                );
                failed |= !stats.failures.is_empty();
            }
            Err(e) => {
                println!("canon-fuzz oracle: cannot run the oracle: {e}");
                failed = true;
            }
        }
    }
    if failed {
        1
    } else {
        0
    }
}
