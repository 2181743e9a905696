//! Generation of one JSON text per execution: valid documents, mutations, random bytes, deep
//! nesting, huge numbers, long strings, escapes and surrogates, duplicate names.

use crate::prelude::*;

// Generation.

#[derive(Clone, Copy)]
pub(crate) struct GenCfg {
    /// Emit invalid pieces (bad escapes, lone surrogates, bad numbers) now and then.
    pub(crate) invalid: bool,
    /// Oracle mode: no raw newlines (the oracle reads lines), bounded size and depth.
    pub(crate) oracle: bool,
}

pub(crate) const SHORT_ESCAPES: [&str; 8] =
    ["\\\"", "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t"];
pub(crate) const BAD_ESCAPES: [&str; 14] = [
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

pub(crate) fn random_char(rng: &mut Rng) -> char {
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

pub(crate) fn push_u_escape(rng: &mut Rng, cp: u32, out: &mut String) {
    let hex = if rng.chance(50) {
        format!("{cp:04x}")
    } else {
        format!("{cp:04X}")
    };
    out.push_str("\\u");
    out.push_str(&hex);
}

/// The inside of a JSON string (without quotes), `len` pieces long.
pub(crate) fn gen_string_body(rng: &mut Rng, cfg: GenCfg, len: usize, out: &mut String) {
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

pub(crate) fn gen_string(rng: &mut Rng, cfg: GenCfg, out: &mut String) {
    out.push('"');
    let len = rng.size(40);
    gen_string_body(rng, cfg, len, out);
    out.push('"');
}

pub(crate) fn digits(rng: &mut Rng, n: usize, out: &mut String) {
    for _ in 0..n {
        out.push((b'0' + rng.below(10) as u8) as char);
    }
}

pub(crate) const SPECIAL_NUMBERS: [&str; 28] = [
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

pub(crate) fn gen_number(rng: &mut Rng, cfg: GenCfg, out: &mut String) {
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

pub(crate) fn ws(rng: &mut Rng, cfg: GenCfg, out: &mut String) {
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

pub(crate) fn gen_value(
    rng: &mut Rng,
    cfg: GenCfg,
    depth: usize,
    max_depth: usize,
    out: &mut String,
) {
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

pub(crate) fn gen_valid(rng: &mut Rng, cfg: GenCfg) -> String {
    let mut out = String::new();
    ws(rng, cfg, &mut out);
    let max_depth = 1 + rng.size(8);
    gen_value(rng, cfg, 0, max_depth, &mut out);
    ws(rng, cfg, &mut out);
    out
}

pub(crate) const TOKENS: [&str; 30] = [
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
pub(crate) fn mutate(rng: &mut Rng, doc: String) -> String {
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

pub(crate) fn random_text(rng: &mut Rng) -> String {
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
pub(crate) fn gen_large(rng: &mut Rng, cfg: GenCfg, kind: usize) -> String {
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
pub(crate) const LARGE_EVERY: u64 = 20_000;
pub(crate) const HUGE_EVERY: u64 = 2_000_000;

pub(crate) fn generate(seed: u64, exec: u64, oracle: bool) -> String {
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
pub(crate) fn gen_nested(rng: &mut Rng, cfg: GenCfg, depth: usize) -> String {
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
