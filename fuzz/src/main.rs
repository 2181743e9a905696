//! Random-input fuzz harness for the canonicalizer (`src/canonical.rs`), on stable Rust.
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
//! Execution `i` of seed `s` is generated from (s, i) alone, so any report can be replayed with
//! `FUZZ_REPLAY=i` (and the same `FUZZ_SEED`); the input is written to `fuzz/artifacts/`.
//!
//! Environment: `FUZZ_MODE` (`invariant` | `oracle` | `both`, default `both`), `FUZZ_EXECS`
//! (invariant executions, default 200000), `FUZZ_ORACLE_EXECS` (default 5000), `FUZZ_SEED`
//! (default 1), `FUZZ_THREADS` (default 1), `FUZZ_REPLAY`, `FUZZ_PYTHON` (default `python3`).

#[allow(dead_code)]
#[path = "../../src/canonical.rs"]
mod canonical;

use canonical::{canonicalize, exclude, parse_json, CanonError, NumberMode, Value};
use serde::Deserialize;
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtOrd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// RNG: SplitMix64 (seeding) and xoshiro256**.

struct Rng([u64; 4]);

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    fn new(seed: u64, stream: u64) -> Rng {
        let mut x = seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
        Rng([
            splitmix(&mut x),
            splitmix(&mut x),
            splitmix(&mut x),
            splitmix(&mut x),
        ])
    }
    fn next(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }
    /// Uniform in 0..n (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (((self.next() >> 32) * n as u64) >> 32) as usize
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
    /// Small sizes mostly, occasionally larger: 0..=max with a geometric-ish tail.
    fn size(&mut self, max: usize) -> usize {
        let cap = match self.below(10) {
            0..=5 => 4,
            6..=8 => 16,
            _ => max,
        };
        self.below(cap.min(max) + 1)
    }
}

// ---------------------------------------------------------------------------------------------
// Generation.

#[derive(Clone, Copy)]
struct GenCfg {
    /// Emit invalid pieces (bad escapes, lone surrogates, bad numbers) now and then.
    invalid: bool,
    /// Oracle mode: no raw newlines (the oracle reads lines), bounded size and depth.
    oracle: bool,
}

const SHORT_ESCAPES: [&str; 8] = ["\\\"", "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t"];
const BAD_ESCAPES: [&str; 14] = [
    "\\ud800",
    "\\udbff",
    "\\udc00",
    "\\udfff",
    "\\ud800\\u0041",
    "\\ud800\\ud800",
    "\\x41",
    "\\u12",
    "\\u12G4",
    "\\u+041",
    "\\u-041",
    "\\u 041",
    "\\U0041",
    "\\",
];

fn random_char(rng: &mut Rng) -> char {
    let cp = match rng.below(12) {
        0..=4 => 0x20 + rng.below(0x5f) as u32,
        5 => 0x80 + rng.below(0x780) as u32,
        6 => 0x800 + rng.below(0xD000) as u32,
        7 => 0xE000 + rng.below(0x2000) as u32,
        8 => 0x10000 + rng.below(0x100000) as u32,
        9 => rng.pick(&[
            0x7f, 0x2028, 0x2029, 0xfeff, 0xfffd, 0xffff, 0xfb33, 0x1f600, 0x10ffff,
        ]),
        10 => rng.pick(&[0x20ac, 0xe9, 0xf6, 0x30a, 0x41]),
        _ => 0x61 + rng.below(3) as u32,
    };
    char::from_u32(cp).unwrap_or('?')
}

fn push_u_escape(rng: &mut Rng, cp: u32, out: &mut String) {
    let hex = if rng.chance(50) {
        format!("{cp:04x}")
    } else {
        format!("{cp:04X}")
    };
    out.push_str("\\u");
    out.push_str(&hex);
}

/// The inside of a JSON string (without quotes), `len` pieces long.
fn gen_string_body(rng: &mut Rng, cfg: GenCfg, len: usize, out: &mut String) {
    for _ in 0..len {
        match rng.below(20) {
            0..=9 => out.push(random_char(rng)),
            10 | 11 => out.push_str(rng.pick(&SHORT_ESCAPES)),
            12 => {
                let cp = rng.below(0x20) as u32;
                push_u_escape(rng, cp, out);
            }
            13 | 14 => {
                // Any BMP scalar value, escaped.
                let mut cp = rng.below(0x10000) as u32;
                if (0xD800..0xE000).contains(&cp) {
                    cp -= 0x800;
                }
                push_u_escape(rng, cp, out);
            }
            15 => {
                // A supplementary character as an escaped surrogate pair.
                let cp = 0x10000 + rng.below(0x100000) as u32;
                let v = cp - 0x10000;
                push_u_escape(rng, 0xD800 + (v >> 10), out);
                push_u_escape(rng, 0xDC00 + (v & 0x3ff), out);
            }
            16 if cfg.invalid && rng.chance(15) => out.push_str(rng.pick(&BAD_ESCAPES)),
            17 if cfg.invalid && rng.chance(15) => {
                out.push(char::from_u32(rng.below(0x20) as u32).unwrap_or('\u{1}'))
            }
            _ => out.push_str(rng.pick(&["a", "b", "A", " ", "'", "<", "\u{7f}", "\u{80}"])),
        }
    }
}

fn gen_string(rng: &mut Rng, cfg: GenCfg, out: &mut String) {
    out.push('"');
    let len = rng.size(40);
    gen_string_body(rng, cfg, len, out);
    out.push('"');
}

fn digits(rng: &mut Rng, n: usize, out: &mut String) {
    for _ in 0..n {
        out.push((b'0' + rng.below(10) as u8) as char);
    }
}

const SPECIAL_NUMBERS: [&str; 28] = [
    "0",
    "-0",
    "0.0",
    "-0.000",
    "0e0",
    "0E-7",
    "1E+2",
    "100e-2",
    "5e-324",
    "-5e-324",
    "2.4703282292062327e-324",
    "2.4703282292062328e-324",
    "1.7976931348623157e308",
    "1.7976931348623158e308",
    "1.7976931348623159e308",
    "1e308",
    "1e309",
    "-1e400",
    "1e-400",
    "9007199254740993",
    "9007199254740992",
    "0.10000000000000001",
    "333333333.33333329",
    "1e21",
    "999999999999999999999",
    "0.000001",
    "0.0000001",
    "1e99999999999999999999",
];

fn gen_number(rng: &mut Rng, cfg: GenCfg, out: &mut String) {
    if cfg.invalid && rng.chance(3) {
        out.push_str(rng.pick(&[
            "01",
            "1.",
            ".5",
            "-",
            "+1",
            "1e",
            "1e+",
            "--1",
            "NaN",
            "Infinity",
            "-Infinity",
            "0x10",
            "1.e5",
            "1_000",
            "١",
        ]));
        return;
    }
    match rng.below(10) {
        0 => out.push_str(&(rng.below(2001) as i64 - 1000).to_string()),
        1 => out.push_str(&(rng.next() as i64).to_string()),
        2 => {
            // Shortest spelling of a random double, as JavaScript and friends emit it.
            let d = f64::from_bits(rng.next());
            if d.is_finite() {
                out.push_str(&format!("{d:e}"));
            } else {
                out.push('1');
            }
        }
        3 => {
            // A %.17g-like spelling: not the shortest one.
            let d = f64::from_bits(rng.next());
            if d.is_finite() {
                out.push_str(&format!("{d:.16e}"));
            } else {
                out.push('2');
            }
        }
        4 => {
            let d = (rng.next() >> 11) as f64 / (1u64 << 53) as f64
                * 10f64.powi(rng.below(60) as i32 - 30);
            out.push_str(&format!("{d}"));
        }
        5 => out.push_str(rng.pick(&SPECIAL_NUMBERS)),
        _ => {
            // Arbitrary decimal: sign, integer digits, fraction, exponent.
            if rng.chance(30) {
                out.push('-');
            }
            if rng.chance(30) {
                out.push('0');
            } else {
                out.push((b'1' + rng.below(9) as u8) as char);
                let n = rng.size(40);
                digits(rng, n, out);
            }
            if rng.chance(50) {
                out.push('.');
                let n = 1 + rng.size(40);
                digits(rng, n, out);
            }
            if rng.chance(50) {
                out.push_str(rng.pick(&["e", "E", "e+", "e-", "E+", "E-"]));
                let n = 1 + rng.size(if cfg.oracle { 4 } else { 25 });
                digits(rng, n, out);
            }
        }
    }
}

fn ws(rng: &mut Rng, cfg: GenCfg, out: &mut String) {
    if rng.chance(80) {
        return;
    }
    let opts: &[&str] = if cfg.oracle {
        &[" ", "  ", "\t", "\r", " \t"]
    } else {
        &[" ", "  ", "\t", "\r", "\n", "\r\n"]
    };
    out.push_str(rng.pick(opts));
}

fn gen_value(rng: &mut Rng, cfg: GenCfg, depth: usize, max_depth: usize, out: &mut String) {
    let kinds = if depth >= max_depth { 5 } else { 9 };
    match rng.below(kinds) {
        0 => out.push_str(rng.pick(&["null", "true", "false"])),
        1 | 2 => gen_number(rng, cfg, out),
        3 | 4 => gen_string(rng, cfg, out),
        5 | 6 => {
            out.push('{');
            ws(rng, cfg, out);
            let n = rng.size(12);
            let mut names: Vec<String> = Vec::new();
            for i in 0..n {
                if i > 0 {
                    out.push(',');
                    ws(rng, cfg, out);
                }
                let name = if !names.is_empty() && rng.chance(15) {
                    // A duplicate name (jsonb and parse_json keep the last value).
                    names[rng.below(names.len())].clone()
                } else {
                    let mut s = String::from("\"");
                    let len = rng.size(6);
                    gen_string_body(rng, cfg, len, &mut s);
                    s.push('"');
                    names.push(s.clone());
                    s
                };
                out.push_str(&name);
                ws(rng, cfg, out);
                out.push(':');
                ws(rng, cfg, out);
                gen_value(rng, cfg, depth + 1, max_depth, out);
                ws(rng, cfg, out);
            }
            out.push('}');
        }
        _ => {
            out.push('[');
            ws(rng, cfg, out);
            let n = rng.size(12);
            for i in 0..n {
                if i > 0 {
                    out.push(',');
                    ws(rng, cfg, out);
                }
                gen_value(rng, cfg, depth + 1, max_depth, out);
                ws(rng, cfg, out);
            }
            out.push(']');
        }
    }
}

fn gen_valid(rng: &mut Rng, cfg: GenCfg) -> String {
    let mut out = String::new();
    ws(rng, cfg, &mut out);
    let max_depth = 1 + rng.size(8);
    gen_value(rng, cfg, 0, max_depth, &mut out);
    ws(rng, cfg, &mut out);
    out
}

const TOKENS: [&str; 30] = [
    "\"",
    "\\",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "-",
    "+",
    "e",
    "E",
    ".",
    "0",
    "1",
    "9",
    "u",
    "\\u",
    "\\ud800",
    "\\udc00",
    "null",
    "true",
    "fals",
    " ",
    "\t",
    "\u{0}",
    "\u{1f}",
    "\u{e9}",
    "\u{1F600}",
    "\u{FFFF}",
];

/// 1..4 byte-level mutations of a document, repaired to UTF-8 (the parser takes `&str`).
fn mutate(rng: &mut Rng, doc: String) -> String {
    let mut b = doc.into_bytes();
    for _ in 0..1 + rng.below(4) {
        let len = b.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                b[i] = TOKENS[rng.below(TOKENS.len())].as_bytes()[0];
            }
            1 => {
                let i = rng.below(len + 1);
                let t = rng.pick(&TOKENS).as_bytes();
                b.splice(i..i, t.iter().copied());
            }
            2 if len > 0 => {
                let i = rng.below(len);
                let j = (i + 1 + rng.below(8)).min(len);
                b.drain(i..j);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let j = (i + 1 + rng.below(32)).min(len);
                let piece: Vec<u8> = b[i..j].to_vec();
                let at = rng.below(len + 1);
                b.splice(at..at, piece);
            }
            4 if len > 0 => b.truncate(rng.below(len)),
            5 if len > 0 => {
                let i = rng.below(len);
                b[i] = rng.next() as u8;
            }
            _ => b.push(rng.next() as u8),
        }
    }
    match String::from_utf8(b) {
        Ok(s) => s,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    }
}

fn random_text(rng: &mut Rng) -> String {
    let n = rng.size(64);
    if rng.chance(50) {
        let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    } else {
        (0..n).map(|_| rng.pick(&TOKENS)).collect()
    }
}

/// Large and adversarial documents: deep nesting around and far beyond the limit, long strings,
/// many members, huge numbers.
fn gen_large(rng: &mut Rng, cfg: GenCfg, kind: usize) -> String {
    let mut out = String::new();
    match kind % 8 {
        0 | 1 => {
            let depth = rng.pick(&[998, 999, 1000, 1001, 1002, 2000, 10_000, 100_000]);
            let object = rng.chance(50);
            for _ in 0..depth {
                out.push_str(if object { "{\"k\":" } else { "[" });
            }
            if rng.chance(80) {
                gen_value(rng, cfg, 0, 1, &mut out);
                for _ in 0..depth {
                    out.push(if object { '}' } else { ']' });
                }
            }
        }
        2 => {
            out.push('"');
            let n = 100_000 + rng.below(1_000_000);
            gen_string_body(rng, cfg, n, &mut out);
            out.push('"');
        }
        3 => {
            out.push('[');
            for i in 0..50_000 + rng.below(150_000) {
                if i > 0 {
                    out.push(',');
                }
                gen_value(rng, cfg, 0, 0, &mut out);
            }
            out.push(']');
        }
        4 => {
            // Many members; names shared between objects so some are duplicates.
            out.push('{');
            for i in 0..1_000 + rng.below(9_000) {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&format!("\"m{}\":", rng.below(20_000)));
                gen_value(rng, cfg, 0, 0, &mut out);
            }
            out.push('}');
        }
        5 => {
            if rng.chance(50) {
                out.push('-');
            }
            out.push('1');
            let n = 10_000 + rng.below(1_000_000);
            digits(rng, n, &mut out);
            if rng.chance(50) {
                out.push('.');
                let n = 1 + rng.below(100_000);
                digits(rng, n, &mut out);
            }
            if rng.chance(50) {
                out.push_str(&format!("e{}", rng.below(800) as i64 - 400));
            }
        }
        6 => {
            // Exponents of every size, up to far beyond i64.
            out.push('[');
            for i in 0..1000 {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&format!("{}e", 1 + rng.below(9)));
                if rng.chance(50) {
                    out.push('-');
                }
                let n = 1 + rng.below(40);
                digits(rng, n, &mut out);
            }
            out.push(']');
        }
        _ => {
            // A valid big document, mutated.
            let mut doc = String::from("[");
            for i in 0..2_000 {
                if i > 0 {
                    doc.push(',');
                }
                gen_value(rng, cfg, 0, 4, &mut doc);
            }
            doc.push(']');
            out = mutate(rng, doc);
        }
    }
    out
}

/// Every LARGE_EVERY-th execution is a large one (and every HUGE_EVERY-th a 10 MB one).
const LARGE_EVERY: u64 = 20_000;
const HUGE_EVERY: u64 = 2_000_000;

fn generate(seed: u64, exec: u64, oracle: bool) -> String {
    let mut rng = Rng::new(seed, exec);
    let cfg = GenCfg {
        invalid: rng.chance(40),
        oracle,
    };
    let mut doc = if !oracle && exec % HUGE_EVERY == HUGE_EVERY - 1 {
        // ~10 MB: a long array of long strings and numbers.
        let mut s = String::from("[");
        while s.len() < 10_000_000 {
            if s.len() > 1 {
                s.push(',');
            }
            gen_value(&mut rng, cfg, 0, 2, &mut s);
            s.push_str(",\"");
            gen_string_body(&mut rng, cfg, 2000, &mut s);
            s.push('"');
        }
        s.push(']');
        s
    } else if !oracle && exec % LARGE_EVERY == LARGE_EVERY - 1 {
        gen_large(&mut rng, cfg, (exec / LARGE_EVERY) as usize)
    } else {
        match rng.below(20) {
            0..=8 => gen_valid(&mut rng, cfg),
            9..=15 => {
                let doc = gen_valid(&mut rng, cfg);
                mutate(&mut rng, doc)
            }
            16 | 17 => random_text(&mut rng),
            18 => {
                // Scalars alone.
                let mut s = String::new();
                if rng.chance(50) {
                    gen_number(&mut rng, cfg, &mut s);
                } else {
                    gen_string(&mut rng, cfg, &mut s);
                }
                s
            }
            _ => {
                // Nesting of moderate depth (the oracle's Python parser recurses).
                let depth = 1 + rng.below(if oracle { 150 } else { 1100 });
                gen_nested(&mut rng, cfg, depth)
            }
        }
    };
    if oracle {
        // The oracle reads one document per line.
        doc = doc.replace('\n', " ");
    }
    doc
}

/// `depth` openers (arrays and objects mixed), a value, the matching closers.
fn gen_nested(rng: &mut Rng, cfg: GenCfg, depth: usize) -> String {
    let mut s = String::new();
    let mut closers = Vec::with_capacity(depth);
    for _ in 0..depth {
        if rng.chance(50) {
            s.push('[');
            closers.push(']');
        } else {
            s.push_str("{\"\":");
            closers.push('}');
        }
    }
    gen_value(rng, cfg, 0, 1, &mut s);
    s.extend(closers.iter().rev());
    s
}

// ---------------------------------------------------------------------------------------------
// Checks.

struct Failure {
    category: String,
    detail: String,
}

fn fail<T>(category: &str, detail: impl Into<String>) -> Result<T, Failure> {
    Err(Failure {
        category: category.to_string(),
        detail: detail.into(),
    })
}

#[derive(Default, Clone)]
struct Stats {
    execs: u64,
    bytes: u64,
    max_len: usize,
    accepted: u64,
    rejected_parse: u64,
    rejected_deep: u64,
    rfc_out_of_range: u64,
    known: BTreeMap<String, u64>,
    failures: BTreeMap<String, u64>,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.execs += o.execs;
        self.bytes += o.bytes;
        self.max_len = self.max_len.max(o.max_len);
        self.accepted += o.accepted;
        self.rejected_parse += o.rejected_parse;
        self.rejected_deep += o.rejected_deep;
        self.rfc_out_of_range += o.rfc_out_of_range;
        for (k, v) in &o.known {
            *self.known.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &o.failures {
            *self.failures.entry(k.clone()).or_default() += v;
        }
    }
}

/// Known, reported defects of `parse_json`, so that a long run still shows new ones: none at
/// present. (`"\u+041"` was one, read as `"A"`: u32::from_str_radix takes a sign. Fixed.)
/// `FUZZ_STRICT=1` counts every one as a failure.
fn known_bug(_input: &str) -> Option<&'static str> {
    None
}

fn serde_parse(text: &str) -> Result<serde_json::Value, String> {
    let mut de = serde_json::Deserializer::from_str(text);
    de.disable_recursion_limit();
    let v = serde_json::Value::deserialize(&mut de).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    Ok(v)
}

fn depth_of(v: &serde_json::Value) -> usize {
    // Iterative: documents may be nested 100,000 levels deep.
    let mut max = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, d)) = stack.pop() {
        match v {
            serde_json::Value::Array(items) => {
                max = max.max(d + 1);
                stack.extend(items.iter().map(|i| (i, d + 1)));
            }
            serde_json::Value::Object(m) => {
                max = max.max(d + 1);
                stack.extend(m.values().map(|i| (i, d + 1)));
            }
            _ => {}
        }
    }
    max
}

fn same_tree(ours: &Value, theirs: &serde_json::Value) -> bool {
    match (ours, theirs) {
        (Value::Null, serde_json::Value::Null) => true,
        (Value::Bool(a), serde_json::Value::Bool(b)) => a == b,
        (Value::Number(a), serde_json::Value::Number(b)) => {
            serde_number_spelling(a) == b.to_string()
        }
        (Value::String(a), serde_json::Value::String(b)) => a == b,
        (Value::Array(a), serde_json::Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_tree(x, y))
        }
        (Value::Object(a), serde_json::Value::Object(b)) => {
            // serde_json's map keeps the last duplicate too.
            a.len() == b.len()
                && a.iter()
                    .all(|(k, v)| b.get(k).is_some_and(|w| same_tree(v, w)))
        }
        _ => false,
    }
}

/// serde_json (arbitrary_precision) keeps a number's text but writes its exponent as `e+N`/`e-N`.
fn serde_number_spelling(text: &str) -> String {
    match text.find(['e', 'E']) {
        Some(at) => {
            let exp = &text[at + 1..];
            let sign = if exp.starts_with(['+', '-']) { "" } else { "+" };
            format!("{}e{sign}{exp}", &text[..at])
        }
        None => text.to_string(),
    }
}

fn naive_utf16_cmp(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// Checks the text written by the canonicalizer: RFC 8785 escaping only (no whitespace outside
/// strings is covered by idempotence against the parser plus this scan of every string).
fn check_escaping(out: &str) -> Result<(), Failure> {
    let b = out.as_bytes();
    let mut i = 0;
    let mut in_string = false;
    while i < b.len() {
        let c = b[i];
        if in_string {
            match c {
                b'"' => in_string = false,
                b'\\' => {
                    let e = b.get(i + 1).copied().unwrap_or(0);
                    match e {
                        b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't' => i += 1,
                        b'u' => {
                            let hex = out.get(i + 2..i + 6).unwrap_or("");
                            let v = u32::from_str_radix(hex, 16).unwrap_or(0xffff);
                            let short = matches!(v, 0x08 | 0x09 | 0x0a | 0x0c | 0x0d);
                            if !hex.starts_with("00")
                                || v >= 0x20
                                || short
                                || hex != hex.to_lowercase()
                            {
                                return fail(
                                    "output-escaping",
                                    format!("needless or wrong escape \\u{hex}"),
                                );
                            }
                            i += 5;
                        }
                        _ => return fail("output-escaping", format!("escape \\{}", e as char)),
                    }
                }
                0..=0x1f => return fail("output-escaping", format!("raw control byte {c:#x}")),
                _ => {}
            }
        } else {
            match c {
                b'"' => in_string = true,
                b' ' | b'\t' | b'\n' | b'\r' => {
                    return fail("output-whitespace", "whitespace outside strings")
                }
                _ => {}
            }
        }
        i += 1;
    }
    Ok(())
}

/// Walks `orig` and its canonical re-parse `out` together (objects of `orig` sorted naively),
/// checking member order in `out` and handing each pair of numbers to `f`.
fn walk_pairs(
    orig: &Value,
    out: &Value,
    f: &mut dyn FnMut(&str, &str) -> Result<(), Failure>,
) -> Result<(), Failure> {
    match (orig, out) {
        (Value::Number(a), Value::Number(b)) => f(a, b),
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (x, y) in a.iter().zip(b) {
                walk_pairs(x, y, f)?;
            }
            Ok(())
        }
        (Value::Object(a), Value::Object(b)) if a.len() == b.len() => {
            if b.windows(2)
                .any(|w| naive_utf16_cmp(&w[0].0, &w[1].0) != Ordering::Less)
            {
                return fail(
                    "member-order",
                    "members not in strictly increasing UTF-16 order",
                );
            }
            let mut sorted: Vec<&(String, Value)> = a.iter().collect();
            sorted.sort_by(|x, y| naive_utf16_cmp(&x.0, &y.0));
            for (x, y) in sorted.into_iter().zip(b) {
                if x.0 != y.0 {
                    return fail("member-names", format!("{:?} became {:?}", x.0, y.0));
                }
                walk_pairs(&x.1, &y.1, f)?;
            }
            Ok(())
        }
        (Value::Null, Value::Null) => Ok(()),
        (Value::Bool(a), Value::Bool(b)) if a == b => Ok(()),
        (Value::String(a), Value::String(b)) if a == b => Ok(()),
        _ => fail(
            "tree-changed",
            "canonical output re-parses to a different tree",
        ),
    }
}

/// An independent decimal normal form: (negative, significant digits, exponent of the first
/// digit). `None` for zero. Exponents are read as i128 (saturated far beyond what matters).
fn decimal_normal(text: &str) -> Option<(bool, String, i128)> {
    let (neg, rest) = match text.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, text),
    };
    let (mant, exp) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i128>().unwrap_or(0)),
        None => (rest, 0),
    };
    let (int, frac) = mant.split_once('.').unwrap_or((mant, ""));
    let all: String = format!("{int}{frac}");
    let lead = all.len() - all.trim_start_matches('0').len();
    let sig = all
        .trim_start_matches('0')
        .trim_end_matches('0')
        .to_string();
    if sig.is_empty() {
        return None;
    }
    Some((neg, sig, exp + int.len() as i128 - lead as i128))
}

/// Rust's own shortest round-trip formatting of a double, laid out as ECMAScript does.
fn std_es_double(d: f64) -> String {
    if d == 0.0 {
        return "0".into();
    }
    let sci = format!("{d:e}"); // e.g. "-1.2345e-7", shortest digits
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i64 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let k = digits.len() as i64;
    let n = exp + 1;
    let body = if k <= n && n <= 21 {
        format!("{digits}{}", "0".repeat((n - k) as usize))
    } else if 0 < n && n <= 21 {
        format!("{}.{}", &digits[..n as usize], &digits[n as usize..])
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat((-n) as usize))
    } else {
        let m = if k == 1 {
            digits.clone()
        } else {
            format!("{}.{}", &digits[..1], &digits[1..])
        };
        format!("{m}e{}{}", if n > 0 { "+" } else { "-" }, (n - 1).abs())
    };
    if neg {
        format!("-{body}")
    } else {
        body
    }
}

/// Rust's shortest formatting rounds a tie between two shortest candidates up; ECMAScript
/// (Number::toString, step 5) and ryu-js take the even one. Accepts `written` when it is such a
/// candidate: it round-trips, has as many significant digits as Rust's, differs from it by one
/// unit in the last digit, and ends in an even digit.
fn ecmascript_tie(d: f64, written: &str) -> bool {
    let std = std_es_double(d);
    if written.parse::<f64>().ok() != Some(d) {
        return false;
    }
    let (Some((n1, s1, e1)), Some((n2, s2, e2))) = (decimal_normal(written), decimal_normal(&std))
    else {
        return false;
    };
    if n1 != n2 || e1 != e2 || s1.len() != s2.len() {
        return false;
    }
    let last = |s: &str| i32::from(s.as_bytes()[s.len() - 1] - b'0');
    let (a, b) = (last(&s1), last(&s2));
    s1[..s1.len() - 1] == s2[..s2.len() - 1] && (a - b).abs() == 1 && a % 2 == 0
}

/// Exponents this large saturate in `split_number` (documented: jsonb's numeric cannot carry
/// them), so exact-value checks skip such numbers.
fn exponent_saturates(text: &str) -> bool {
    match text.find(['e', 'E']) {
        Some(at) => text[at + 1..].trim_start_matches(['+', '-']).len() > 15,
        None => false,
    }
}

const SATURATION: &str = "exact layout saturates exponents beyond +-2^61 (1e99999999999999999999 \
     equals 1e99999999999999999998; 48927e+06744328334041581160605315 is not idempotent); \
     jsonb numerics never get there";

fn has_saturating_exponent(v: &Value) -> bool {
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::Number(n) if exponent_saturates(n) => return true,
            Value::Array(items) => stack.extend(items),
            Value::Object(m) => stack.extend(m.iter().map(|(_, v)| v)),
            _ => {}
        }
    }
    false
}

const MODES: [NumberMode; 2] = [NumberMode::Exact, NumberMode::Rfc8785];

fn check(input: &str, stats: &mut Stats) -> Result<(), Failure> {
    let ours = parse_json(input);
    let theirs = serde_parse(input);
    let known = known_bug(input);
    let v = match (ours, theirs) {
        (Ok(v), Ok(t)) => {
            if !same_tree(&v, &t) {
                return fail(
                    "parse-tree-differs",
                    "parse_json and serde_json read different trees",
                );
            }
            if depth_of(&t) > canonical::MAX_DEPTH {
                return fail(
                    "depth-not-refused",
                    format!("depth {} accepted", depth_of(&t)),
                );
            }
            v
        }
        (Ok(v), Err(e)) => match known {
            Some(k) => {
                *stats.known.entry(k.to_string()).or_default() += 1;
                v
            }
            None => return fail("accepts-invalid", format!("serde_json: {e}")),
        },
        (Err(CanonError::TooDeep), Ok(t)) => {
            let d = depth_of(&t);
            if d <= canonical::MAX_DEPTH {
                return fail("too-deep-wrongly", format!("depth {d} refused as too deep"));
            }
            stats.rejected_deep += 1;
            return Ok(());
        }
        (Err(CanonError::TooDeep), Err(_)) => {
            stats.rejected_deep += 1;
            return Ok(());
        }
        (Err(CanonError::Parse(m)), Ok(_)) => {
            return fail("rejects-valid", format!("parse_json: {m}"));
        }
        (Err(CanonError::Parse(m)), Err(_)) => {
            let at: Option<usize> = m.rsplit_once("at byte ").and_then(|(_, n)| n.parse().ok());
            if at.is_none_or(|n| n > input.len()) {
                return fail("error-position", format!("message {m:?}"));
            }
            stats.rejected_parse += 1;
            return Ok(());
        }
        (Err(e), _) => return fail("unexpected-error", format!("{e:?}")),
    };
    stats.accepted += 1;

    for mode in MODES {
        let out = match canonicalize(&v, mode) {
            Ok(out) => out,
            Err(CanonError::NumberOutOfRange(n)) if mode == NumberMode::Rfc8785 => {
                let d: f64 = n.parse().unwrap_or(0.0);
                if d.is_finite() {
                    return fail("range-wrongly", format!("{n} refused as out of range"));
                }
                stats.rfc_out_of_range += 1;
                continue;
            }
            Err(e) => return fail("canonicalize-error", format!("{mode:?}: {e:?}")),
        };
        check_escaping(&out)?;
        if let Err(e) = serde_parse(&out) {
            return fail("output-not-json", format!("{mode:?}: {e}"));
        }
        let reparsed = match parse_json(&out) {
            Ok(r) => r,
            Err(e) => return fail("output-not-reparsable", format!("{mode:?}: {e}")),
        };
        for again_mode in MODES {
            if mode == NumberMode::Exact && again_mode == NumberMode::Rfc8785 {
                continue; // exact output may hold numbers beyond the double range
            }
            match canonicalize(&reparsed, again_mode) {
                Ok(again) if again == out => {}
                Ok(_) if mode == NumberMode::Exact && has_saturating_exponent(&v) => {
                    *stats.known.entry(SATURATION.to_string()).or_default() += 1;
                }
                Ok(_) => return fail("not-idempotent", format!("{mode:?} then {again_mode:?}")),
                Err(e) => {
                    return fail(
                        "not-idempotent",
                        format!("{mode:?} then {again_mode:?}: {e}"),
                    )
                }
            }
        }
        walk_pairs(&v, &reparsed, &mut |orig, written| {
            let od: f64 = orig.parse().unwrap_or(f64::NAN);
            let wd: f64 = written.parse().unwrap_or(f64::NAN);
            match mode {
                NumberMode::Exact => {
                    if !exponent_saturates(orig) && decimal_normal(orig) != decimal_normal(written)
                    {
                        // -0 and 0 are equal: decimal_normal gives None for both.
                        return fail("exact-value-changed", format!("{orig} -> {written}"));
                    }
                    if od != wd && !(od.is_nan() && wd.is_nan()) {
                        return fail(
                            "exact-value-changed",
                            format!("{orig} -> {written} (as doubles)"),
                        );
                    }
                }
                NumberMode::Rfc8785 => {
                    if std_es_double(od) != written && !ecmascript_tie(od, written) {
                        return fail(
                            "rfc8785-number",
                            format!("{orig} -> {written}, expected {}", std_es_double(od)),
                        );
                    }
                }
            }
            Ok(())
        })?;
    }

    // exclude(): pointers along real paths, and random ones.
    if input.len() <= 4096 {
        let mut rng = Rng::new(input.len() as u64, input.bytes().map(u64::from).sum());
        for _ in 0..3 {
            let pointer = random_pointer(&mut rng, &v);
            let malformed = pointer.starts_with('/')
                && pointer
                    .split('~')
                    .skip(1)
                    .any(|t| !t.starts_with(['0', '1']));
            let mut w = v.clone();
            match exclude(&mut w, &pointer) {
                Ok(()) if !malformed => {}
                Err(CanonError::InvalidPointer(_)) if malformed => {}
                r => return fail("exclude", format!("{pointer:?}: {r:?}")),
            }
            if let Err(e) = canonicalize(&w, NumberMode::Exact) {
                return fail("exclude", format!("after {pointer:?}: {e:?}"));
            }
        }
    }
    Ok(())
}

fn escape_token(t: &str) -> String {
    t.replace('~', "~0").replace('/', "~1")
}

fn random_pointer(rng: &mut Rng, v: &Value) -> String {
    if rng.chance(20) {
        return (0..rng.size(12))
            .map(|_| rng.pick(&["/", "~", "~0", "~1", "~2", "a", "0", "01", "-", ""]))
            .collect();
    }
    let mut p = String::new();
    let mut node = v;
    loop {
        match node {
            Value::Object(m) if !m.is_empty() && rng.chance(70) => {
                let (k, child) = &m[rng.below(m.len())];
                p.push('/');
                p.push_str(&escape_token(k));
                node = child;
            }
            Value::Array(a) if !a.is_empty() && rng.chance(70) => {
                let i = rng.below(a.len());
                p.push('/');
                p.push_str(&i.to_string());
                node = &a[i];
            }
            _ => break,
        }
    }
    if p.is_empty() {
        p.push('/');
    }
    p
}

// ---------------------------------------------------------------------------------------------
// Running, watchdog, artifacts.

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

fn artifacts_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts")
}

fn save_artifact(name: &str, input: &str) -> String {
    let dir = artifacts_dir();
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(name);
    let _ = std::fs::write(&path, input);
    path.display().to_string()
}

fn preview(input: &str) -> String {
    let p: String = input.chars().take(160).collect();
    format!("{p:?}{}", if input.len() > 160 { "..." } else { "" })
}

/// Budget of one execution: generous, so that only a real hang (or a quadratic blow-up) trips it.
fn budget_ms(len: usize) -> u64 {
    5_000 + len as u64 / 500
}

struct Slot {
    started_ms: AtomicU64, // 0: idle
    exec: AtomicU64,
    budget: AtomicU64,
    tid: AtomicU64, // Linux thread id, 0 if unknown
}

/// The calling thread's Linux thread id, from /proc (no libc needed).
fn current_tid() -> u64 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// CPU time (user + system) a thread of this process has used, in ms (clock ticks of 10 ms).
fn thread_cpu_ms(tid: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    let mut fields = after.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) * 10)
}

/// Wall time after which an execution counts as hung even without using CPU (blocked).
const HARD_LIMIT_MS: u64 = 600_000;

fn now_ms(origin: Instant) -> u64 {
    origin.elapsed().as_millis() as u64 + 1
}

fn report_failure(
    seed: u64,
    exec: u64,
    input: &str,
    f: &Failure,
    printed: &Mutex<BTreeMap<String, u64>>,
) {
    let mut p = printed.lock().unwrap_or_else(|e| e.into_inner());
    let n = p.entry(f.category.clone()).or_default();
    *n += 1;
    if *n <= 3 {
        let path = save_artifact(&format!("{}-{seed}-{exec}.json", f.category), input);
        eprintln!(
            "FAIL {} (seed {seed}, exec {exec}, {} bytes, saved to {path}): {}\n  input: {}",
            f.category,
            input.len(),
            f.detail,
            preview(input)
        );
    }
}

fn run_invariant(seed: u64, execs: u64, threads: u64, origin: Instant) -> Stats {
    let slots: Arc<Vec<Slot>> = Arc::new(
        (0..threads)
            .map(|_| Slot {
                started_ms: AtomicU64::new(0),
                exec: AtomicU64::new(0),
                budget: AtomicU64::new(0),
                tid: AtomicU64::new(0),
            })
            .collect(),
    );
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (slots, done) = (slots.clone(), done.clone());
        std::thread::spawn(move || {
            // Per slot: (start of the execution being timed, its thread's CPU ms at that point).
            // The budget is first measured in wall time; once it has passed, the execution
            // must use another budget's worth of CPU time before it counts as a hang, so a
            // starved process on a busy machine is not taken for a hung one.
            let mut base: Vec<(u64, Option<u64>)> = vec![(0, None); slots.len()];
            while !done.load(AtOrd::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                for (i, s) in slots.iter().enumerate() {
                    let started = s.started_ms.load(AtOrd::Relaxed);
                    let budget = s.budget.load(AtOrd::Relaxed);
                    if started == 0 || now_ms(origin).saturating_sub(started) <= budget {
                        continue;
                    }
                    let cpu = thread_cpu_ms(s.tid.load(AtOrd::Relaxed));
                    if base[i].0 != started {
                        base[i] = (started, cpu);
                        continue;
                    }
                    let elapsed = now_ms(origin).saturating_sub(started);
                    let hung = match (base[i].1, cpu) {
                        (Some(b), Some(c)) => c.saturating_sub(b) > budget,
                        _ => elapsed > 10 * budget,
                    } || elapsed > HARD_LIMIT_MS;
                    if hung {
                        let exec = s.exec.load(AtOrd::Relaxed);
                        let input = generate(seed, exec, false);
                        let path = save_artifact(&format!("hang-{seed}-{exec}.json"), &input);
                        eprintln!(
                            "HANG: seed {seed}, exec {exec} ran {elapsed} ms, over twice its budget \
                             of {budget} ms in CPU time ({} bytes, saved to {path}): {}",
                            input.len(),
                            preview(&input)
                        );
                        std::process::exit(3);
                    }
                }
            }
        })
    };
    let printed = Arc::new(Mutex::new(BTreeMap::new()));
    let total = Arc::new(Mutex::new(Stats::default()));
    let progress = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for t in 0..threads {
        let (slots, printed, total, progress) = (
            slots.clone(),
            printed.clone(),
            total.clone(),
            progress.clone(),
        );
        let h = std::thread::Builder::new()
            // serde_json recurses without limit (documents nest up to 100,000 levels).
            .stack_size(1 << 30)
            .spawn(move || {
                let mut stats = Stats::default();
                let slot = &slots[t as usize];
                slot.tid.store(current_tid(), AtOrd::Relaxed);
                let mut exec = t;
                while exec < execs {
                    let input = generate(seed, exec, false);
                    slot.exec.store(exec, AtOrd::Relaxed);
                    slot.budget.store(budget_ms(input.len()), AtOrd::Relaxed);
                    slot.started_ms.store(now_ms(origin), AtOrd::Relaxed);
                    let result = catch_unwind(AssertUnwindSafe(|| {
                        if exec == 0 && std::env::var_os("FUZZ_SELFTEST_HANG").is_some() {
                            // Self-test of the watchdog: spin as a hung canonicalizer would.
                            let mut x = 0u64;
                            loop {
                                x = std::hint::black_box(x.wrapping_add(1));
                            }
                        }
                        if exec == 0 && std::env::var_os("FUZZ_SELFTEST_PANIC").is_some() {
                            panic!("self-test of the panic catcher");
                        }
                        let mut s = Stats::default();
                        check(&input, &mut s).map(|_| s)
                    }));
                    slot.started_ms.store(0, AtOrd::Relaxed);
                    stats.execs += 1;
                    stats.bytes += input.len() as u64;
                    stats.max_len = stats.max_len.max(input.len());
                    let failure = match result {
                        Ok(Ok(s)) => {
                            stats.add(&Stats {
                                execs: 0,
                                bytes: 0,
                                max_len: 0,
                                ..s
                            });
                            None
                        }
                        Ok(Err(f)) => Some(f),
                        Err(p) => {
                            let msg = p
                                .downcast_ref::<String>()
                                .cloned()
                                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                                .unwrap_or_default();
                            Some(Failure {
                                category: "panic".into(),
                                detail: msg,
                            })
                        }
                    };
                    if let Some(f) = failure {
                        report_failure(seed, exec, &input, &f, &printed);
                        *stats.failures.entry(f.category).or_default() += 1;
                    }
                    let n = progress.fetch_add(1, AtOrd::Relaxed) + 1;
                    if n % 1_000_000 == 0 {
                        eprintln!(
                            "  invariant: {n} executions, {:.0} s",
                            origin.elapsed().as_secs_f64()
                        );
                    }
                    exec += threads;
                }
                total.lock().unwrap_or_else(|e| e.into_inner()).add(&stats);
            });
        match h {
            Ok(h) => handles.push(h),
            Err(e) => {
                eprintln!("cannot start a fuzz thread: {e}");
                std::process::exit(2);
            }
        }
    }
    for h in handles {
        let _ = h.join();
    }
    done.store(true, AtOrd::Relaxed);
    let _ = watchdog.join();
    let stats = total.lock().unwrap_or_else(|e| e.into_inner()).clone();
    stats
}

// Oracle differential.

fn oracle_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/oracle/jcs_oracle.py")
}

/// Runs the oracle over `docs` (one process per batch: it reads to end of input).
fn run_oracle(docs: &[String], numbers: &str) -> Result<Vec<Vec<u8>>, String> {
    let python = std::env::var("FUZZ_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut child = Command::new(python)
        .arg(oracle_path())
        .args(["--duplicates", "last", "--numbers", numbers])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the oracle: {e}"))?;
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let input: Vec<u8> = docs.iter().flat_map(|d| d.bytes().chain([b'\n'])).collect();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut lines = Vec::with_capacity(docs.len());
    for line in BufReader::new(stdout).split(b'\n') {
        lines.push(line.map_err(|e| e.to_string())?);
    }
    let _ = writer.join();
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() || lines.len() != docs.len() {
        return Err(format!(
            "oracle exited {status} after {} of {} lines",
            lines.len(),
            docs.len()
        ));
    }
    Ok(lines)
}

fn ours_line(doc: &str, mode: NumberMode) -> Result<String, CanonError> {
    parse_json(doc).and_then(|v| canonicalize(&v, mode))
}

fn agree(ours: &Result<String, CanonError>, oracle: &[u8]) -> Result<(), String> {
    let o = String::from_utf8_lossy(oracle);
    let ok = match ours {
        Ok(text) => o == *text,
        Err(CanonError::Parse(_)) | Err(CanonError::TooDeep) => {
            o.starts_with("!error parse") || o.starts_with("!error unicode")
        }
        Err(CanonError::NumberOutOfRange(_)) => o.starts_with("!error non-finite"),
        // Neither comes from parsing JSON text: pointers are not used here, damaged jsonb and
        // untranslatable characters exist only inside the server.
        Err(CanonError::InvalidPointer(_))
        | Err(CanonError::Damaged)
        | Err(CanonError::Untranslatable(_)) => false,
    };
    if ok {
        Ok(())
    } else {
        let p: String = o.chars().take(200).collect();
        Err(format!("ours {ours:?}, oracle {p:?}"))
    }
}

fn run_oracle_diff(seed: u64, execs: u64, origin: Instant) -> Result<Stats, String> {
    let mut stats = Stats::default();
    let printed = Mutex::new(BTreeMap::new());
    const BATCH: u64 = 5_000;
    // Oracle executions use their own stream of inputs (a distinct seed space).
    let oseed = seed ^ 0x5EED_0F0C_1E00_0000;
    let mut start = 0;
    while start < execs {
        let end = (start + BATCH).min(execs);
        let docs: Vec<String> = (start..end).map(|i| generate(oseed, i, true)).collect();
        let (exact, js) = std::thread::scope(|s| {
            let a = s.spawn(|| run_oracle(&docs, "exact"));
            let b = s.spawn(|| run_oracle(&docs, "js"));
            (
                a.join()
                    .unwrap_or_else(|_| Err("oracle thread panicked".into())),
                b.join()
                    .unwrap_or_else(|_| Err("oracle thread panicked".into())),
            )
        });
        let (exact, js) = (exact?, js?);
        for (i, doc) in docs.iter().enumerate() {
            let exec = start + i as u64;
            stats.execs += 1;
            stats.bytes += doc.len() as u64;
            stats.max_len = stats.max_len.max(doc.len());
            let result = catch_unwind(AssertUnwindSafe(|| {
                let e = ours_line(doc, NumberMode::Exact);
                let r = ours_line(doc, NumberMode::Rfc8785);
                // The oracle converts numbers before it checks strings, so for a document with
                // both a lone surrogate and an out-of-range number its js mode reports the
                // number. Exact mode (no range errors) has already checked the refusal.
                let both_refuse = matches!(r, Err(CanonError::Parse(_)))
                    && js[i].starts_with(b"!error non-finite")
                    && exact[i].starts_with(b"!error ");
                let verdict = agree(&e, &exact[i])
                    .map_err(|m| ("oracle-exact", m))
                    .and_then(|_| {
                        if both_refuse {
                            Ok(())
                        } else {
                            agree(&r, &js[i]).map_err(|m| ("oracle-rfc8785", m))
                        }
                    });
                let saturating = parse_json(doc).is_ok_and(|v| has_saturating_exponent(&v));
                (
                    e.is_ok(),
                    matches!(r, Err(CanonError::NumberOutOfRange(_))),
                    verdict,
                    saturating,
                )
            }));
            let failure = match result {
                Ok((accepted, out_of_range, verdict, saturating)) => {
                    if accepted {
                        stats.accepted += 1;
                    } else {
                        stats.rejected_parse += 1;
                    }
                    if out_of_range {
                        stats.rfc_out_of_range += 1;
                    }
                    match verdict {
                        Ok(()) => None,
                        Err((cat, detail)) => {
                            match known_bug(doc) {
                                Some(k) => {
                                    *stats.known.entry(k.to_string()).or_default() += 1;
                                    None
                                }
                                None if saturating && cat == "oracle-exact" => {
                                    *stats.known.entry(SATURATION.to_string()).or_default() += 1;
                                    None
                                }
                                // The oracle drops a lone surrogate inside a discarded duplicate
                                // member; parse_json (like jsonb) refuses any lone surrogate.
                                None if detail.contains("lone surrogate")
                                    && !detail.contains("oracle \"!error") =>
                                {
                                    *stats
                                    .known
                                    .entry("lone surrogate in a discarded duplicate (oracle accepts)".into())
                                    .or_default() += 1;
                                    None
                                }
                                None => Some(Failure {
                                    category: cat.into(),
                                    detail,
                                }),
                            }
                        }
                    }
                }
                Err(_) => Some(Failure {
                    category: "panic".into(),
                    detail: "panic in the oracle run".into(),
                }),
            };
            if let Some(f) = failure {
                report_failure(oseed, exec, doc, &f, &printed);
                *stats.failures.entry(f.category).or_default() += 1;
            }
        }
        start = end;
        if start % 100_000 == 0 {
            eprintln!(
                "  oracle: {start} executions, {:.0} s",
                origin.elapsed().as_secs_f64()
            );
        }
    }
    Ok(stats)
}

fn print_stats(label: &str, s: &Stats, secs: f64) {
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

fn main() {
    // serde_json recurses without limit (documents nest up to 100,000 levels): run everything
    // on a thread with a large stack.
    let code = std::thread::Builder::new()
        .stack_size(1 << 30)
        .spawn(real_main)
        .map(|h| h.join().unwrap_or(2))
        .unwrap_or(2);
    std::process::exit(code);
}

fn real_main() -> i32 {
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
        let stats = run_invariant(seed, execs, threads, origin);
        print_stats(
            &format!("invariant (seed {seed})"),
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
