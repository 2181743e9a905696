//! The jsonb binary reader (`idempotency_core::jsonb`) fed arbitrary bytes: jsonb laid out as
//! the server lays it out (from the generator's documents, in every layout the server reads),
//! the same with random damage (bit flips, overwritten words with counts, offsets and kinds that
//! lie, truncation, spliced bytes), and plain random bytes. Each execution checks:
//!
//! * no panic and no hang (the runner's watchdog), whatever the bytes;
//! * allocation in proportion to the bytes given: the most the reader holds at once is at
//!   most [`ALLOC_PER_BYTE`] times the input's length, plus [`ALLOC_SLACK`];
//! * a value laid out by the writer reads back as the document it came from, in both number
//!   modes, through both readers (canonical form and tree);
//! * for any bytes, the two readers agree on whether the value holds together and on its
//!   canonical form; what they accept is JSON, and canonical (it re-canonicalizes to itself).

use crate::prelude::*;
use idempotency_core::jsonb::writer::{encode, Layout};
use idempotency_core::jsonb::{to_value, write_canonical, Utf8};
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;

/// The most the reader may hold at once per input byte (a member costs its name's text and two
/// 16-byte children for 8 bytes of JEntries; output is at most ~6 bytes per input byte).
pub(crate) const ALLOC_PER_BYTE: usize = 64;
pub(crate) const ALLOC_SLACK: usize = 1 << 16;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, counting each thread's live bytes and their peak.
pub(crate) struct Counting;

// SAFETY: every call is passed to the system allocator unchanged; the counting touches only
// const-initialized thread-locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}

fn grew(n: usize) {
    let _ = LIVE.try_with(|l| {
        let now = l.get() + n;
        l.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

fn shrank(n: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get().saturating_sub(n)));
}

/// Runs `f`, returning what it returned and the most it held at once beyond what was live.
fn peak_of<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    (r, PEAK.with(Cell::get).saturating_sub(base))
}

/// Execution `exec`'s bytes and, when they are the writer's layout of a document, that
/// document's canonical forms (exact, rfc8785).
pub(crate) fn jsonb_input(seed: u64, exec: u64) -> (Vec<u8>, Option<Value>) {
    let mut rng = Rng::new(seed ^ 0x0B1A_4B00_0000_0000, exec);
    let kind = rng.below(20);
    if kind >= 18 {
        // Random bytes, often behind a plausible header.
        let len = rng.size(4096);
        let mut b: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if kind == 18 && b.len() >= 4 {
            let header =
                rng.pick(&[0x4000_0000u32, 0x2000_0000, 0x5000_0001]) | rng.size(64) as u32;
            b[..4].copy_from_slice(&header.to_ne_bytes());
        }
        return (b, None);
    }
    // A document the text generator makes (valid ones mostly), laid out as jsonb.
    let text = generate(seed, exec, false);
    let Ok(doc) = parse_json(&text) else {
        return (rng_bytes(&mut rng), None);
    };
    let layout = Layout {
        short_numerics: rng.chance(80),
        one_byte_headers: rng.chance(20),
        stride: rng.pick(&[32, 32, 32, 1, 2, 7, 1 << 28]),
    };
    let Some(mut bytes) = encode(&doc, layout) else {
        return (rng_bytes(&mut rng), None);
    };
    if kind < 8 || bytes.is_empty() {
        return (bytes, Some(doc));
    }
    damage(&mut rng, &mut bytes);
    (bytes, None)
}

fn rng_bytes(rng: &mut Rng) -> Vec<u8> {
    (0..rng.size(256)).map(|_| rng.next() as u8).collect()
}

/// Words a damaged value's headers, JEntries and numerics may hold.
const LIES: [u32; 14] = [
    0,
    1,
    0x0FFF_FFFF,
    0x8FFF_FFFF,
    0xFFFF_FFFF,
    0x2FFF_FFFF,
    0x4FFF_FFFF,
    0x5FFF_FFFF,
    0x1000_0000,
    0x5000_0001,
    0x7000_0000,
    0x9000_0008,
    0x0000_8000,
    0x0000_FFFF,
];

fn damage(rng: &mut Rng, b: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        if b.is_empty() {
            return;
        }
        let at = rng.below(b.len());
        match rng.below(8) {
            0 => b[at] ^= 1 << rng.below(8),
            1 => b[at] = rng.pick(&[0x00, 0x01, 0x03, 0x05, 0x7F, 0x80, 0xC3, 0xFF]),
            2 | 3 => {
                // A word that lies, at a word boundary (headers and JEntries are aligned).
                let at = at & !3;
                if at + 4 <= b.len() {
                    let w = if rng.chance(50) {
                        rng.pick(&LIES)
                    } else {
                        let old = u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                        old ^ (1 << rng.below(32))
                    };
                    b[at..at + 4].copy_from_slice(&w.to_ne_bytes());
                }
            }
            4 => b.truncate(at),
            5 => {
                let n = rng.size(64).min(b.len() - at);
                let piece: Vec<u8> = b[at..at + n].to_vec();
                let to = rng.below(b.len());
                b.splice(to..to, piece);
            }
            6 => {
                // A base-10000 digit above 9999, or an odd byte in a string.
                let at = at & !1;
                if at + 2 <= b.len() {
                    b[at..at + 2].copy_from_slice(&rng.pick(&[10_000u16, 0xFFFF]).to_ne_bytes());
                }
            }
            _ => {
                let n = rng.size(16).min(b.len() - at);
                b.drain(at..at + n);
            }
        }
    }
}

fn read(bytes: &[u8], mode: NumberMode) -> Result<String, CanonError> {
    let mut out = String::new();
    write_canonical(bytes, mode, &mut out, &mut Utf8).map(|_| out)
}

pub(crate) fn check_jsonb(
    bytes: &[u8],
    doc: Option<&Value>,
    stats: &mut Stats,
) -> Result<(), Failure> {
    for mode in MODES {
        let selftest = std::env::var_os("FUZZ_SELFTEST_ALLOC").is_some();
        let (streamed, peak) = peak_of(|| {
            if selftest {
                // Self-test of the bound: what the reader did when it believed a count.
                std::hint::black_box(Vec::<u8>::with_capacity(1 << 30));
            }
            read(bytes, mode)
        });
        let bound = ALLOC_PER_BYTE * bytes.len() + ALLOC_SLACK;
        if peak > bound {
            return fail(
                "jsonb-allocation",
                format!("{peak} bytes held at once for {} input bytes", bytes.len()),
            );
        }
        let (tree, peak) = peak_of(|| to_value(bytes, &mut Utf8));
        if peak > bound {
            return fail(
                "jsonb-allocation-tree",
                format!("{peak} bytes held at once for {} input bytes", bytes.len()),
            );
        }
        let from_tree = tree.and_then(|v| canonicalize(&v, mode));
        match (&streamed, &from_tree) {
            (Ok(a), Ok(b)) if a != b => {
                return fail("jsonb-readers-differ", format!("{a:.200} vs {b:.200}"))
            }
            (Ok(_), Err(e)) | (Err(e), Ok(_)) => {
                return fail("jsonb-readers-disagree", format!("one reader: {e}"))
            }
            _ => {}
        }
        if let Some(doc) = doc {
            // Errors alike in kind (a number out of range is spelt as each side carried it).
            let expected = canonicalize(doc, mode);
            let same = match (&streamed, &expected) {
                (Ok(a), Ok(b)) => a == b,
                (Err(a), Err(b)) => std::mem::discriminant(a) == std::mem::discriminant(b),
                _ => false,
            };
            if !same {
                return fail(
                    "jsonb-roundtrip",
                    format!("{streamed:.200?} read back, {expected:.200?} written"),
                );
            }
        }
        match streamed {
            Ok(out) => {
                stats.accepted += 1;
                // JSON, and canonical: it re-canonicalizes to itself.
                match parse_json(&out).and_then(|v| canonicalize(&v, mode)) {
                    Ok(again) if again == out => {}
                    Ok(_) => return fail("jsonb-not-canonical", format!("{out:.200}")),
                    Err(e) => return fail("jsonb-not-json", format!("{e}: {out:.200}")),
                }
            }
            Err(CanonError::TooDeep) => stats.rejected_deep += 1,
            Err(CanonError::NumberOutOfRange(_)) => stats.rfc_out_of_range += 1,
            Err(_) => stats.rejected_parse += 1,
        }
    }
    Ok(())
}
