//! Running the invariant executions on threads, with a watchdog, artifacts and failure reports.

use crate::prelude::*;

// Running, watchdog, artifacts.

pub(crate) fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

pub(crate) fn artifacts_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts")
}

/// What the invariant executions feed: JSON text to `parse_json` and the canonicalizer, or
/// bytes to the jsonb binary reader.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    Text,
    Jsonb,
}

impl Target {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Target::Text => "invariant",
            Target::Jsonb => "jsonb",
        }
    }

    /// Execution `exec`'s input (and, for jsonb laid out from a document, that document).
    pub(crate) fn generate(self, seed: u64, exec: u64) -> (Vec<u8>, Option<Value>) {
        match self {
            Target::Text => (generate(seed, exec, false).into_bytes(), None),
            Target::Jsonb => jsonb_input(seed, exec),
        }
    }

    pub(crate) fn input(self, seed: u64, exec: u64) -> Vec<u8> {
        self.generate(seed, exec).0
    }

    pub(crate) fn check(
        self,
        input: &[u8],
        doc: Option<&Value>,
        stats: &mut Stats,
    ) -> Result<(), Failure> {
        match self {
            // Text inputs are generated as Strings.
            Target::Text => check(std::str::from_utf8(input).unwrap_or_default(), stats),
            Target::Jsonb => check_jsonb(input, doc, stats),
        }
    }

    /// A short look at an input for a report: text as text, bytes in hex.
    pub(crate) fn preview(self, input: &[u8]) -> String {
        match self {
            Target::Text => preview(&String::from_utf8_lossy(input)),
            Target::Jsonb => {
                let hex: String = input.iter().take(80).map(|b| format!("{b:02x}")).collect();
                format!("\\x{hex}{}", if input.len() > 80 { "..." } else { "" })
            }
        }
    }

    fn artifact(self, name: &str) -> String {
        match self {
            Target::Text => format!("{name}.json"),
            Target::Jsonb => format!("jsonb-{name}.bin"),
        }
    }
}

pub(crate) fn save_artifact(name: &str, input: &str) -> String {
    save_artifact_bytes(name, input.as_bytes())
}

pub(crate) fn save_artifact_bytes(name: &str, input: &[u8]) -> String {
    let dir = artifacts_dir();
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(name);
    let _ = std::fs::write(&path, input);
    path.display().to_string()
}

pub(crate) fn preview(input: &str) -> String {
    let p: String = input.chars().take(160).collect();
    format!("{p:?}{}", if input.len() > 160 { "..." } else { "" })
}

/// Budget of one execution: generous, so that only a real hang (or a quadratic blow-up) trips it.
pub(crate) fn budget_ms(len: usize) -> u64 {
    5_000 + len as u64 / 500
}

pub(crate) struct Slot {
    pub(crate) started_ms: AtomicU64, // 0: idle
    pub(crate) exec: AtomicU64,
    pub(crate) budget: AtomicU64,
    pub(crate) tid: AtomicU64, // Linux thread id, 0 if unknown
}

/// The calling thread's Linux thread id, from /proc (no libc needed).
pub(crate) fn current_tid() -> u64 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// CPU time (user + system) a thread of this process has used, in ms (clock ticks of 10 ms).
pub(crate) fn thread_cpu_ms(tid: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    let mut fields = after.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) * 10)
}

/// Wall time after which an execution counts as hung even without using CPU (blocked).
pub(crate) const HARD_LIMIT_MS: u64 = 600_000;

pub(crate) fn now_ms(origin: Instant) -> u64 {
    origin.elapsed().as_millis() as u64 + 1
}

pub(crate) fn report_failure(
    target: Target,
    seed: u64,
    exec: u64,
    input: &[u8],
    f: &Failure,
    printed: &Mutex<BTreeMap<String, u64>>,
) {
    let mut p = printed.lock().unwrap_or_else(|e| e.into_inner());
    let n = p.entry(f.category.clone()).or_default();
    *n += 1;
    if *n <= 3 {
        let name = target.artifact(&format!("{}-{seed}-{exec}", f.category));
        let path = save_artifact_bytes(&name, input);
        eprintln!(
            "FAIL {} (seed {seed}, exec {exec}, {} bytes, saved to {path}): {}\n  input: {}",
            f.category,
            input.len(),
            f.detail,
            target.preview(input)
        );
    }
}

pub(crate) fn run_invariant(
    target: Target,
    seed: u64,
    execs: u64,
    threads: u64,
    origin: Instant,
) -> Stats {
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
                        let input = target.input(seed, exec);
                        let name = target.artifact(&format!("hang-{seed}-{exec}"));
                        let path = save_artifact_bytes(&name, &input);
                        eprintln!(
                            "HANG: seed {seed}, exec {exec} ran {elapsed} ms, over twice its budget \
                             of {budget} ms in CPU time ({} bytes, saved to {path}): {}",
                            input.len(),
                            target.preview(&input)
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
                    let (input, doc) = target.generate(seed, exec);
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
                        target.check(&input, doc.as_ref(), &mut s).map(|_| s)
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
                        report_failure(target, seed, exec, &input, &f, &printed);
                        *stats.failures.entry(f.category).or_default() += 1;
                    }
                    let n = progress.fetch_add(1, AtOrd::Relaxed) + 1;
                    if n % 1_000_000 == 0 {
                        eprintln!(
                            "  {}: {n} executions, {:.0} s",
                            target.name(),
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
