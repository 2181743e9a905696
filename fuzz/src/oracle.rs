//! The differential against `tests/oracle/jcs_oracle.py` (the `rfc8785` Python package).

use crate::prelude::*;

// Oracle differential.

pub(crate) fn oracle_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/oracle/jcs_oracle.py")
}

/// Runs the oracle over `docs` (one process per batch: it reads to end of input).
pub(crate) fn run_oracle(docs: &[String], numbers: &str) -> Result<Vec<Vec<u8>>, String> {
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

pub(crate) fn ours_line(doc: &str, mode: NumberMode) -> Result<String, CanonError> {
    parse_json(doc).and_then(|v| canonicalize(&v, mode))
}

pub(crate) fn agree(ours: &Result<String, CanonError>, oracle: &[u8]) -> Result<(), String> {
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

pub(crate) fn run_oracle_diff(seed: u64, execs: u64, origin: Instant) -> Result<Stats, String> {
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
                report_failure(Target::Text, oseed, exec, doc.as_bytes(), &f, &printed);
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
