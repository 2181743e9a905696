//! The invariants every execution is checked against (parser differential with serde_json,
//! escaping, member order, idempotence, number values and spellings, `exclude`).

use crate::prelude::*;

// Checks.

pub(crate) struct Failure {
    pub(crate) category: String,
    pub(crate) detail: String,
}

pub(crate) fn fail<T>(category: &str, detail: impl Into<String>) -> Result<T, Failure> {
    Err(Failure {
        category: category.to_string(),
        detail: detail.into(),
    })
}

#[derive(Default, Clone)]
pub(crate) struct Stats {
    pub(crate) execs: u64,
    pub(crate) bytes: u64,
    pub(crate) max_len: usize,
    pub(crate) accepted: u64,
    pub(crate) rejected_parse: u64,
    pub(crate) rejected_deep: u64,
    pub(crate) rfc_out_of_range: u64,
    pub(crate) known: BTreeMap<String, u64>,
    pub(crate) failures: BTreeMap<String, u64>,
}

impl Stats {
    pub(crate) fn add(&mut self, o: &Stats) {
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
pub(crate) fn known_bug(_input: &str) -> Option<&'static str> {
    None
}

pub(crate) fn serde_parse(text: &str) -> Result<serde_json::Value, String> {
    let mut de = serde_json::Deserializer::from_str(text);
    de.disable_recursion_limit();
    let v = serde_json::Value::deserialize(&mut de).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    Ok(v)
}

pub(crate) fn depth_of(v: &serde_json::Value) -> usize {
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

pub(crate) fn same_tree(ours: &Value, theirs: &serde_json::Value) -> bool {
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
pub(crate) fn serde_number_spelling(text: &str) -> String {
    match text.find(['e', 'E']) {
        Some(at) => {
            let exp = &text[at + 1..];
            let sign = if exp.starts_with(['+', '-']) { "" } else { "+" };
            format!("{}e{sign}{exp}", &text[..at])
        }
        None => text.to_string(),
    }
}

pub(crate) fn naive_utf16_cmp(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// Checks the text written by the canonicalizer: RFC 8785 escaping only (no whitespace outside
/// strings is covered by idempotence against the parser plus this scan of every string).
pub(crate) fn check_escaping(out: &str) -> Result<(), Failure> {
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
pub(crate) fn walk_pairs(
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
pub(crate) fn decimal_normal(text: &str) -> Option<(bool, String, i128)> {
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
pub(crate) fn std_es_double(d: f64) -> String {
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
pub(crate) fn ecmascript_tie(d: f64, written: &str) -> bool {
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
pub(crate) fn exponent_saturates(text: &str) -> bool {
    match text.find(['e', 'E']) {
        Some(at) => text[at + 1..].trim_start_matches(['+', '-']).len() > 15,
        None => false,
    }
}

pub(crate) const SATURATION: &str =
    "exact layout saturates exponents beyond +-2^61 (1e99999999999999999999 \
     equals 1e99999999999999999998; 48927e+06744328334041581160605315 is not idempotent); \
     jsonb numerics never get there";

pub(crate) fn has_saturating_exponent(v: &Value) -> bool {
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

pub(crate) const MODES: [NumberMode; 2] = [NumberMode::Exact, NumberMode::Rfc8785];

pub(crate) fn check(input: &str, stats: &mut Stats) -> Result<(), Failure> {
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

pub(crate) fn escape_token(t: &str) -> String {
    t.replace('~', "~0").replace('/', "~1")
}

pub(crate) fn random_pointer(rng: &mut Rng, v: &Value) -> String {
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
