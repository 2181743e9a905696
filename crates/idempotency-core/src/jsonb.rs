//! A reader of jsonb's binary form that trusts nothing it has not checked.
//!
//! The bytes come from storage (a damaged page gives any bytes) or from a superuser's binary
//! cast, so every header kind, count, offset, length, numeric header, digit and string is
//! checked against the slice it was given before it is used: a value that does not hold
//! together is [`CanonError::Damaged`] (XX001 in the extension), never a wild read, a panic or
//! output that is not JSON. Allocations follow the bytes actually given (a count is believed
//! only once its entries fit in the slice), every loop whose length the bytes decide calls
//! [`Host::check_interrupts`], and offsets are computed in one forward pass, so the work is
//! linear in the size of the value (sorting an object's members aside).
//!
//! Layout (PostgreSQL's src/include/utils/jsonb.h, unchanged since 9.4): a container is a 32-bit
//! header (count and kind), one 32-bit JEntry per child (an object's keys first, then its
//! values, in the same order), then the children's data. A JEntry holds the child's type and
//! either its length or, every 32nd child, its end offset. Numbers and nested containers start
//! int-aligned within the data area; a number is a `numeric` varlena (base-10000 digits and a
//! weight). All words are in the machine's byte order, as PostgreSQL stores them.

use crate::canonical::MAX_DEPTH;
use crate::canonical::{utf16_cmp, write_number, write_string, CanonError, NumberMode, Value};
use std::borrow::Cow;

/// What the reader needs from its caller: the text of a string, and a place to stop.
pub trait Host {
    /// A jsonb string's bytes as UTF-8 text. jsonb keeps strings in the database encoding;
    /// [`Utf8`] is the host for a UTF-8 database. Bytes that are not valid in the encoding
    /// must be an error, never decoded lossily. The bytes never contain a NUL (checked first).
    fn text<'a>(&mut self, bytes: &'a [u8]) -> Result<Cow<'a, str>, CanonError>;

    /// Called once per child of every container and per block of a number's digits: the
    /// extension checks for a query cancel or a terminate here.
    fn check_interrupts(&mut self);
}

/// The host of a UTF-8 database (and of tests): strings must be valid UTF-8; nothing to check
/// for interrupts.
pub struct Utf8;

impl Host for Utf8 {
    fn text<'a>(&mut self, bytes: &'a [u8]) -> Result<Cow<'a, str>, CanonError> {
        std::str::from_utf8(bytes)
            .map(Cow::Borrowed)
            .map_err(|_| CanonError::Damaged)
    }

    fn check_interrupts(&mut self) {}
}

/// Writes the canonical form (RFC 8785 order, `mode` numbers) of the jsonb value whose varlena
/// payload (the bytes after the varlena header) is `jsonb`, straight from its binary form:
/// each object's member names are read and sorted, and its values written in that order.
/// Equals `canonical::write_canonical` of [`to_value`]'s tree.
pub fn write_canonical(
    jsonb: &[u8],
    mode: NumberMode,
    out: &mut String,
    host: &mut impl Host,
) -> Result<(), CanonError> {
    let root = Container::open(jsonb, true)?;
    Writer {
        out,
        mode,
        host,
        number: String::new(),
    }
    .container(&root, 0)
}

/// The jsonb value whose varlena payload is `jsonb` as a tree, members in stored order.
pub fn to_value(jsonb: &[u8], host: &mut impl Host) -> Result<Value, CanonError> {
    let root = Container::open(jsonb, true)?;
    container_value(&root, 0, host)
}

const JB_CMASK: u32 = 0x0FFF_FFFF;
const JB_FSCALAR: u32 = 0x1000_0000;
const JB_FOBJECT: u32 = 0x2000_0000;
const JB_FARRAY: u32 = 0x4000_0000;
const JB_KIND: u32 = JB_FSCALAR | JB_FOBJECT | JB_FARRAY | 0x8000_0000;
const JENTRY_OFFLENMASK: u32 = 0x0FFF_FFFF;
const JENTRY_TYPEMASK: u32 = 0x7000_0000;
const JENTRY_HAS_OFF: u32 = 0x8000_0000;
const JENTRY_ISSTRING: u32 = 0x0000_0000;
const JENTRY_ISNUMERIC: u32 = 0x1000_0000;
const JENTRY_ISBOOL_FALSE: u32 = 0x2000_0000;
const JENTRY_ISBOOL_TRUE: u32 = 0x3000_0000;
const JENTRY_ISNULL: u32 = 0x4000_0000;
const JENTRY_ISCONTAINER: u32 = 0x5000_0000;

fn damaged<T>() -> Result<T, CanonError> {
    Err(CanonError::Damaged)
}

fn u32_at(bytes: &[u8], at: usize) -> Result<u32, CanonError> {
    match bytes.get(at..at.checked_add(4).ok_or(CanonError::Damaged)?) {
        Some(&[a, b, c, d]) => Ok(u32::from_ne_bytes([a, b, c, d])),
        _ => damaged(),
    }
}

fn u16_at(bytes: &[u8], at: usize) -> Result<u16, CanonError> {
    match bytes.get(at..at.checked_add(2).ok_or(CanonError::Damaged)?) {
        Some(&[a, b]) => Ok(u16::from_ne_bytes([a, b])),
        _ => damaged(),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The one-element array that wraps a top-level scalar.
    Scalar,
    Array,
    Object,
}

/// One container whose header and JEntries were checked to lie within its bytes.
struct Container<'a> {
    kind: Kind,
    /// Children (an object's members, not its keys and values).
    count: usize,
    /// The JEntries: 4 bytes each, `count` (array) or `2 * count` (object) of them.
    entries: &'a [u8],
    /// The data area the JEntries' offsets are relative to.
    data: &'a [u8],
}

/// One child, its bytes within its container's data area.
#[derive(Clone, Copy)]
enum Child<'a> {
    Null,
    Bool(bool),
    String(&'a [u8]),
    /// A `numeric` varlena (header included), after the alignment padding.
    Number(&'a [u8]),
    Container(&'a [u8]),
}

impl<'a> Container<'a> {
    fn open(bytes: &'a [u8], root: bool) -> Result<Self, CanonError> {
        let header = u32_at(bytes, 0)?;
        let count = (header & JB_CMASK) as usize;
        let kind = match header & JB_KIND {
            k if k == JB_FARRAY | JB_FSCALAR && root && count == 1 => Kind::Scalar,
            JB_FARRAY => Kind::Array,
            JB_FOBJECT => Kind::Object,
            _ => return damaged(),
        };
        let entries = if kind == Kind::Object {
            count * 2
        } else {
            count
        };
        // The count is believed only once its JEntries fit in the bytes given: nothing is
        // reserved for children that are not there.
        let end = entries
            .checked_mul(4)
            .and_then(|n| n.checked_add(4))
            .filter(|&end| end <= bytes.len())
            .ok_or(CanonError::Damaged)?;
        Ok(Container {
            kind,
            count,
            entries: &bytes[4..end],
            data: &bytes[end..],
        })
    }

    /// The children in stored order, each with its bytes, offsets summed in one pass.
    fn children(&self) -> Children<'a> {
        Children {
            entries: self.entries.chunks_exact(4),
            data: self.data,
            offset: 0,
        }
    }
}

struct Children<'a> {
    entries: std::slice::ChunksExact<'a, u8>,
    data: &'a [u8],
    /// Where the next child starts: the end of the one before.
    offset: usize,
}

impl<'a> Iterator for Children<'a> {
    type Item = Result<Child<'a>, CanonError>;

    fn next(&mut self) -> Option<Self::Item> {
        let e = self.entries.next()?;
        let e = u32::from_ne_bytes([e[0], e[1], e[2], e[3]]);
        Some(self.child(e))
    }
}

impl<'a> Children<'a> {
    fn child(&mut self, e: u32) -> Result<Child<'a>, CanonError> {
        let start = self.offset;
        let field = (e & JENTRY_OFFLENMASK) as usize;
        let end = if e & JENTRY_HAS_OFF != 0 {
            field
        } else {
            start + field // both below 2^28 + 2^28: no overflow
        };
        if end < start || end > self.data.len() {
            return damaged();
        }
        self.offset = end;
        // Numbers and containers start at the next int-aligned offset.
        let aligned = || {
            let at = (start + 3) & !3;
            self.data.get(at..end).ok_or(CanonError::Damaged)
        };
        Ok(match e & JENTRY_TYPEMASK {
            JENTRY_ISSTRING => Child::String(&self.data[start..end]),
            JENTRY_ISNUMERIC => Child::Number(aligned()?),
            JENTRY_ISBOOL_FALSE => Child::Bool(false),
            JENTRY_ISBOOL_TRUE => Child::Bool(true),
            JENTRY_ISNULL => Child::Null,
            JENTRY_ISCONTAINER => Child::Container(aligned()?),
            _ => return damaged(),
        })
    }
}

/// A string's text: no NUL (PostgreSQL's text never holds one), then the host's decoding.
fn text<'a>(bytes: &'a [u8], host: &mut impl Host) -> Result<Cow<'a, str>, CanonError> {
    if bytes.contains(&0) {
        return damaged();
    }
    host.text(bytes)
}

/// jsonb keeps an object's keys unique and ordered by length, then bytes; anything else
/// is damage (the server's own look-ups rely on that order).
fn keys_in_jsonb_order(a: &[u8], b: &[u8]) -> bool {
    (a.len(), a) < (b.len(), b)
}

/// Reads an object's keys (checked to be strings in jsonb's order) and pairs each with its
/// value's child, in stored order.
fn members<'a, H: Host>(
    c: &Container<'a>,
    host: &mut H,
) -> Result<Vec<(Cow<'a, str>, Child<'a>)>, CanonError> {
    let mut children = c.children();
    // Bounded by the JEntries present in the bytes (Container::open).
    let mut keys: Vec<&'a [u8]> = Vec::with_capacity(c.count);
    for _ in 0..c.count {
        host.check_interrupts();
        match children.next() {
            Some(Ok(Child::String(k))) => {
                if let Some(&last) = keys.last() {
                    if !keys_in_jsonb_order(last, k) {
                        return damaged();
                    }
                }
                keys.push(k);
            }
            Some(Err(e)) => return Err(e),
            _ => return damaged(),
        }
    }
    let mut out = Vec::with_capacity(c.count);
    for k in keys {
        host.check_interrupts();
        let value = match children.next() {
            Some(v) => v?,
            None => return damaged(),
        };
        out.push((text(k, host)?, value));
    }
    Ok(out)
}

fn nested(depth: usize) -> Result<usize, CanonError> {
    if depth + 1 > MAX_DEPTH {
        Err(CanonError::TooDeep)
    } else {
        Ok(depth + 1)
    }
}

/// Writes canonical forms: the output, the number mode, the host, and a buffer each number's
/// text is read into before it is laid out (one allocation per value, not per number).
struct Writer<'o, 'h, H: Host> {
    out: &'o mut String,
    mode: NumberMode,
    host: &'h mut H,
    number: String,
}

impl<H: Host> Writer<'_, '_, H> {
    fn container(&mut self, c: &Container<'_>, depth: usize) -> Result<(), CanonError> {
        match c.kind {
            Kind::Scalar => match c.children().next() {
                Some(child) => self.child(child?, depth),
                None => damaged(),
            },
            Kind::Array => {
                let depth = nested(depth)?;
                self.out.push('[');
                for (i, child) in c.children().enumerate() {
                    self.host.check_interrupts();
                    if i > 0 {
                        self.out.push(',');
                    }
                    self.child(child?, depth)?;
                }
                self.out.push(']');
                Ok(())
            }
            Kind::Object => {
                let depth = nested(depth)?;
                let mut members = members(c, self.host)?;
                // jsonb's order is by length, then bytes; RFC 8785 wants UTF-16 code units.
                members.sort_by(|a, b| utf16_cmp(&a.0, &b.0));
                self.out.push('{');
                for (i, (name, value)) in members.into_iter().enumerate() {
                    self.host.check_interrupts();
                    if i > 0 {
                        self.out.push(',');
                    }
                    write_string(&name, self.out);
                    self.out.push(':');
                    self.child(value, depth)?;
                }
                self.out.push('}');
                Ok(())
            }
        }
    }

    fn child(&mut self, child: Child<'_>, depth: usize) -> Result<(), CanonError> {
        match child {
            Child::Null => self.out.push_str("null"),
            Child::Bool(b) => self.out.push_str(if b { "true" } else { "false" }),
            Child::String(s) => write_string(&text(s, self.host)?, self.out),
            Child::Number(n) => {
                self.number.clear();
                number_text(n, self.host, &mut self.number)?;
                write_number(&self.number, self.mode, self.out)?
            }
            Child::Container(bytes) => self.container(&Container::open(bytes, false)?, depth)?,
        }
        Ok(())
    }
}

fn container_value(
    c: &Container<'_>,
    depth: usize,
    host: &mut impl Host,
) -> Result<Value, CanonError> {
    match c.kind {
        Kind::Scalar => match c.children().next() {
            Some(child) => child_value(child?, depth, host),
            None => damaged(),
        },
        Kind::Array => {
            let depth = nested(depth)?;
            let mut items = Vec::with_capacity(c.count);
            for child in c.children() {
                host.check_interrupts();
                items.push(child_value(child?, depth, host)?);
            }
            Ok(Value::Array(items))
        }
        Kind::Object => {
            let depth = nested(depth)?;
            let members = members(c, host)?;
            let mut out = Vec::with_capacity(members.len());
            for (name, value) in members {
                host.check_interrupts();
                out.push((name.into_owned(), child_value(value, depth, host)?));
            }
            Ok(Value::Object(out))
        }
    }
}

fn child_value(child: Child<'_>, depth: usize, host: &mut impl Host) -> Result<Value, CanonError> {
    Ok(match child {
        Child::Null => Value::Null,
        Child::Bool(b) => Value::Bool(b),
        Child::String(s) => Value::String(text(s, host)?.into_owned()),
        Child::Number(n) => {
            let mut text = String::new();
            number_text(n, host, &mut text)?;
            Value::Number(text)
        }
        Child::Container(bytes) => container_value(&Container::open(bytes, false)?, depth, host)?,
    })
}

/// The payload of a `numeric` varlena that must fill `n` exactly (jsonb stores the numeric's
/// own bytes and nothing after them), with either header length PostgreSQL reads in place: a
/// 4-byte header (what jsonb writes) or a 1-byte one. Compressed or external headers cannot
/// occur inside a jsonb value.
fn numeric_payload(n: &[u8]) -> Result<&[u8], CanonError> {
    let first = *n.first().ok_or(CanonError::Damaged)?;
    let (header, size) = if cfg!(target_endian = "little") {
        if first & 0x01 == 0x01 {
            // 1-byte header; 0x01 alone marks an external (TOAST pointer) datum.
            if first == 0x01 {
                return damaged();
            }
            (1, (first >> 1) as usize)
        } else if first & 0x03 == 0x00 {
            (4, (u32_at(n, 0)? >> 2) as usize)
        } else {
            return damaged(); // compressed
        }
    } else if first & 0x80 == 0x80 {
        if first == 0x80 {
            return damaged();
        }
        (1, (first & 0x7F) as usize)
    } else if first & 0xC0 == 0x00 {
        (4, (u32_at(n, 0)? & 0x3FFF_FFFF) as usize)
    } else {
        return damaged();
    };
    if size < header || size != n.len() {
        return damaged();
    }
    Ok(&n[header..])
}

/// A jsonb number's exact value as `[-]digits[e[-]digits]` text, read from the numeric's
/// stored form: a header word (the short form: sign and a 7-bit weight; the long form: sign,
/// then a 16-bit weight word), then base-10000 digits, each checked to be below 10000.
/// NaN and the infinities (which jsonb never holds) are damage. Written into `out`, empty.
fn number_text(n: &[u8], host: &mut impl Host, out: &mut String) -> Result<(), CanonError> {
    let p = numeric_payload(n)?;
    let header = u16_at(p, 0)?;
    let (negative, weight, digits) = match header & 0xC000 {
        0x8000 => {
            // Short form: sign, display scale and a 7-bit two's-complement weight.
            let magnitude = i64::from(header & 0x003F);
            let weight = if header & 0x0040 != 0 {
                magnitude - 64
            } else {
                magnitude
            };
            (header & 0x2000 != 0, weight, &p[2..])
        }
        0xC000 => return damaged(), // NaN or an infinity
        sign => (sign == 0x4000, i64::from(u16_at(p, 2)? as i16), &p[4..]),
    };
    if digits.len() % 2 != 0 {
        return damaged();
    }
    let ndigits = digits.len() / 2;
    // Sign, 4 decimal digits per base-10000 digit, 'e', sign and up to 20 exponent digits.
    out.reserve(4 * ndigits + 24);
    if negative {
        out.push('-');
    }
    let mut significant = false;
    for (i, pair) in digits.chunks_exact(2).enumerate() {
        if i % 4096 == 4095 {
            host.check_interrupts();
        }
        let d = u16::from_ne_bytes([pair[0], pair[1]]);
        if d > 9999 {
            return damaged();
        }
        for div in [1000u16, 100, 10, 1] {
            let digit = (d / div) % 10;
            // Leading zeros are left out.
            if digit != 0 || significant {
                significant = true;
                out.push(char::from(b'0' + digit as u8));
            }
        }
    }
    if !significant {
        out.clear();
        out.push('0');
        return Ok(());
    }
    // value = digits * 10^(4 * (weight - (ndigits - 1))); ndigits < 2^31, so no overflow.
    let exponent = 4 * (weight - (ndigits as i64 - 1));
    if exponent != 0 {
        use std::fmt::Write;
        let _ = write!(out, "e{exponent}");
    }
    Ok(())
}

/// A jsonb writer for tests and the fuzz harness (the extension never writes jsonb): the
/// server's layout, with a choice of numeric headers and of how often a JEntry holds an offset.
#[cfg(any(test, feature = "json-text"))]
pub mod writer {
    use super::*;

    /// Choices the server's writer makes one way and a reader must take either way.
    #[derive(Clone, Copy)]
    pub struct Layout {
        /// Numerics in the short form where it fits (the server's choice), else the long form.
        pub short_numerics: bool,
        /// A 1-byte varlena header on numerics of at most 127 bytes (a 4-byte one otherwise,
        /// the server's choice).
        pub one_byte_headers: bool,
        /// Every how many children a JEntry holds an end offset instead of a length (32 in the
        /// server; 1 and very large values are valid too).
        pub stride: usize,
    }

    impl Default for Layout {
        fn default() -> Layout {
            Layout {
                short_numerics: true,
                one_byte_headers: false,
                stride: 32,
            }
        }
    }

    /// The varlena payload of `v` as jsonb, or None for what jsonb cannot hold (a NUL in a
    /// string, a number outside `numeric`'s range).
    pub fn encode(v: &Value, layout: Layout) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        match v {
            Value::Array(_) | Value::Object(_) => container(v, &mut out, layout)?,
            scalar => {
                out.extend_from_slice(&(JB_FARRAY | JB_FSCALAR | 1).to_ne_bytes());
                let at = out.len();
                out.extend_from_slice(&[0; 4]);
                let base = out.len();
                let ty = child(scalar, &mut out, base, layout)?;
                let len = (out.len() - base) as u32;
                out[at..at + 4].copy_from_slice(&(ty | JENTRY_HAS_OFF | len).to_ne_bytes());
            }
        }
        Some(out)
    }

    fn container(v: &Value, out: &mut Vec<u8>, layout: Layout) -> Option<()> {
        let keys: Vec<Value>;
        let children: Vec<&Value>;
        let header = match v {
            Value::Array(items) => {
                children = items.iter().collect();
                JB_FARRAY | u32::try_from(items.len()).ok()?
            }
            Value::Object(members) => {
                // Keys ordered by length, then bytes; the last of a repeated name wins.
                let mut sorted: Vec<&(String, Value)> = members.iter().rev().collect();
                sorted.sort_by(|a, b| (a.0.len(), &a.0).cmp(&(b.0.len(), &b.0)));
                sorted.dedup_by(|a, b| a.0 == b.0);
                keys = sorted.iter().map(|m| Value::String(m.0.clone())).collect();
                let mut c: Vec<&Value> = keys.iter().collect();
                c.extend(sorted.iter().map(|m| &m.1));
                children = c;
                JB_FOBJECT | u32::try_from(sorted.len()).ok()?
            }
            _ => return None,
        };
        if header & JB_CMASK != header & !(JB_FARRAY | JB_FOBJECT) {
            return None;
        }
        out.extend_from_slice(&header.to_ne_bytes());
        let entries_at = out.len();
        out.extend(std::iter::repeat_n(0u8, 4 * children.len()));
        let base = out.len();
        let mut prev_end = 0usize;
        for (i, c) in children.iter().enumerate() {
            let ty = child(c, out, base, layout)?;
            let end = out.len() - base;
            if end > JENTRY_OFFLENMASK as usize {
                return None;
            }
            let e = if i % layout.stride.max(1) == 0 {
                ty | JENTRY_HAS_OFF | end as u32
            } else {
                ty | (end - prev_end) as u32
            };
            prev_end = end;
            let at = entries_at + 4 * i;
            out[at..at + 4].copy_from_slice(&e.to_ne_bytes());
        }
        Some(())
    }

    fn pad(out: &mut Vec<u8>, base: usize) {
        while !(out.len() - base).is_multiple_of(4) {
            out.push(0);
        }
    }

    fn child(v: &Value, out: &mut Vec<u8>, base: usize, layout: Layout) -> Option<u32> {
        Some(match v {
            Value::Null => JENTRY_ISNULL,
            Value::Bool(false) => JENTRY_ISBOOL_FALSE,
            Value::Bool(true) => JENTRY_ISBOOL_TRUE,
            Value::String(s) => {
                if s.contains('\0') {
                    return None;
                }
                out.extend_from_slice(s.as_bytes());
                JENTRY_ISSTRING
            }
            Value::Number(text) => {
                pad(out, base);
                out.extend_from_slice(&numeric(text, layout)?);
                JENTRY_ISNUMERIC
            }
            _ => {
                pad(out, base);
                container(v, out, layout)?;
                JENTRY_ISCONTAINER
            }
        })
    }

    /// A number's `numeric` varlena: its decimal digits and exponent regrouped into base-10000
    /// digits with a weight.
    pub fn numeric(text: &str, layout: Layout) -> Option<Vec<u8>> {
        let (neg, rest) = match text.strip_prefix('-') {
            Some(r) => (true, r),
            None => (false, text),
        };
        let (mantissa, exp) = match rest.find(['e', 'E']) {
            Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().ok()?),
            None => (rest, 0),
        };
        let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let all = format!("{int}{frac}");
        let exp = exp - frac.len() as i64;
        let digits = all.trim_start_matches('0');
        let digits = digits.trim_end_matches('0');
        let exp = exp + (all.trim_start_matches('0').len() - digits.len()) as i64;
        let mut groups: Vec<u16> = Vec::new();
        let mut weight = 0i64;
        if !digits.is_empty() {
            // value = digits * 10^exp, exp made a multiple of 4 by appending zeros.
            let r = exp.rem_euclid(4);
            let widened = format!("{digits}{}", "0".repeat(r as usize));
            let exp4 = (exp - r) / 4;
            let lead = (4 - widened.len() % 4) % 4;
            let padded = format!("{}{widened}", "0".repeat(lead));
            for c in padded.as_bytes().chunks(4) {
                groups.push(std::str::from_utf8(c).ok()?.parse().ok()?);
            }
            weight = groups.len() as i64 - 1 + exp4;
        }
        let weight = i16::try_from(weight).ok()?;
        let mut p = Vec::new();
        let short = layout.short_numerics && (-64..64).contains(&weight);
        if short {
            let w = (weight as u16) & 0x7F;
            let h = 0x8000 | if neg { 0x2000 } else { 0 } | w;
            p.extend_from_slice(&h.to_ne_bytes());
        } else {
            p.extend_from_slice(&(if neg { 0x4000u16 } else { 0 }).to_ne_bytes());
            p.extend_from_slice(&weight.to_ne_bytes());
        }
        for g in groups {
            p.extend_from_slice(&g.to_ne_bytes());
        }
        let mut n = Vec::with_capacity(4 + p.len());
        if layout.one_byte_headers && p.len() < 127 {
            let size = 1 + p.len() as u8;
            n.push(if cfg!(target_endian = "little") {
                (size << 1) | 1
            } else {
                0x80 | size
            });
        } else {
            let size = 4 + p.len() as u32;
            let h = if cfg!(target_endian = "little") {
                size << 2
            } else {
                size
            };
            n.extend_from_slice(&h.to_ne_bytes());
        }
        n.extend(p);
        Some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::writer::{encode as write, Layout};
    use super::*;
    use crate::canonical::canonicalize;

    fn encode(v: &Value) -> Vec<u8> {
        write(v, Layout::default()).unwrap()
    }

    fn canon(bytes: &[u8]) -> Result<String, CanonError> {
        let mut out = String::new();
        write_canonical(bytes, NumberMode::Exact, &mut out, &mut Utf8)?;
        let tree = to_value(bytes, &mut Utf8)?;
        assert_eq!(canonicalize(&tree, NumberMode::Exact)?, out);
        Ok(out)
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn reads_what_the_writer_lays_out() {
        let members: Vec<(String, Value)> = (0..70)
            .map(|i| (format!("k{i}"), Value::Number(format!("{}", i * 12345))))
            .collect();
        let v = Value::Array(vec![
            Value::Object(members),
            Value::String("x\u{e9}\"".into()),
            Value::Null,
            Value::Bool(true),
            Value::Number("-100000000".into()),
            Value::Array(vec![]),
        ]);
        let expected = canonicalize(&v, NumberMode::Exact).unwrap();
        assert_eq!(canon(&encode(&v)).unwrap(), expected);
        assert_eq!(canon(&encode(&Value::Number("0".into()))).unwrap(), "0");
        assert_eq!(canon(&encode(&Value::String("a".into()))).unwrap(), "\"a\"");
    }

    #[test]
    fn every_layout_the_server_reads_is_read_alike() {
        let doc = crate::json_text::parse_json(
            r#"{"a":[1.5,-0.000120,1e300,-7e-300,0,100000,12345678901234567890.5],"bb":"x","c":{}}"#,
        )
        .unwrap();
        let expected = canonicalize(&doc, NumberMode::Exact).unwrap();
        for short_numerics in [true, false] {
            for one_byte_headers in [true, false] {
                for stride in [1, 2, 32, 1 << 20] {
                    let layout = Layout {
                        short_numerics,
                        one_byte_headers,
                        stride,
                    };
                    assert_eq!(canon(&write(&doc, layout).unwrap()).unwrap(), expected);
                }
            }
        }
    }

    #[test]
    fn a_numeric_with_a_one_byte_header_and_no_digits_is_damaged() {
        // A raw scalar whose numeric is 0x05 0x00: a 1-byte varlena header of 2 bytes, so a
        // payload of one byte, too short for a numeric header (the server read it as a 4-byte
        // header numeric, 72 KB past the value).
        let bytes = hex("0100005008000090050000400000ff7f");
        assert_eq!(canon(&bytes), Err(CanonError::Damaged));
    }

    #[test]
    fn a_count_larger_than_the_bytes_reserves_nothing_and_is_damaged() {
        // An object header claiming 268M members, with no JEntries behind it.
        assert_eq!(canon(&hex("ffffff2f")), Err(CanonError::Damaged));
        assert_eq!(canon(&hex("ffffff4f")), Err(CanonError::Damaged));
        assert_eq!(canon(&[]), Err(CanonError::Damaged));
    }

    #[test]
    fn an_array_without_stored_offsets_is_read_in_linear_time() {
        // 160,000 nulls, no JEntry with an offset: each offset is the running sum.
        let n = 160_000u32;
        let mut bytes = (JB_FARRAY | n).to_ne_bytes().to_vec();
        for _ in 0..n {
            bytes.extend_from_slice(&JENTRY_ISNULL.to_ne_bytes());
        }
        let mut checks = Counter(0);
        let mut out = String::new();
        write_canonical(&bytes, NumberMode::Exact, &mut out, &mut checks).unwrap();
        assert_eq!(out.len(), 1 + 5 * n as usize);
        assert!(checks.0 >= n as usize, "interrupts checked per child");
    }

    struct Counter(usize);

    impl Host for Counter {
        fn text<'a>(&mut self, bytes: &'a [u8]) -> Result<Cow<'a, str>, CanonError> {
            Utf8.text(bytes)
        }
        fn check_interrupts(&mut self) {
            self.0 += 1;
        }
    }

    #[test]
    fn invalid_utf8_a_nul_and_a_digit_above_9999_are_damaged() {
        let mut bad = encode(&Value::String("ab".into()));
        let at = bad.len() - 2;
        bad[at] = 0xC3; // a lead byte followed by 'b'
        assert_eq!(canon(&bad), Err(CanonError::Damaged));
        bad[at] = 0;
        assert_eq!(canon(&bad), Err(CanonError::Damaged));
        let mut big = encode(&Value::Number("9999".into()));
        let at = big.len() - 2;
        big[at..].copy_from_slice(&10000u16.to_ne_bytes());
        assert_eq!(canon(&big), Err(CanonError::Damaged));
    }

    #[test]
    fn keys_out_of_jsonb_order_or_repeated_are_damaged() {
        let v = Value::Object(vec![("a".into(), Value::Null), ("b".into(), Value::Null)]);
        let mut bytes = encode(&v);
        assert_eq!(canon(&bytes).unwrap(), r#"{"a":null,"b":null}"#);
        // Data area: "ab"; make the second key "a" as well (JEntry lengths unchanged).
        let at = bytes.len() - 1;
        bytes[at] = b'a';
        assert_eq!(canon(&bytes), Err(CanonError::Damaged));
    }

    #[test]
    fn numbers_of_any_length_are_exact() {
        let long = format!("{}{}", "9".repeat(200), "0".repeat(8));
        let v = Value::Number(long.clone());
        assert_eq!(
            canon(&encode(&v)).unwrap(),
            crate::canonical::es_layout(&long)
        );
        let neg = Value::Number("-120000".into());
        assert_eq!(canon(&encode(&neg)).unwrap(), "-120000");
    }

    #[test]
    fn nesting_is_limited_before_the_stack_is() {
        // Debug builds' frames are large: a stack like a backend's (8 MB).
        std::thread::Builder::new()
            .stack_size(8 << 20)
            .spawn(nesting)
            .unwrap()
            .join()
            .unwrap();
    }

    fn nesting() {
        let mut v = Value::Null;
        for _ in 0..MAX_DEPTH {
            v = Value::Array(vec![v]);
        }
        assert!(canon(&encode(&v)).is_ok());
        let v = Value::Array(vec![v]);
        assert_eq!(canon(&encode(&v)), Err(CanonError::TooDeep));
    }
}
