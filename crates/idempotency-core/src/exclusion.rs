//! `canonical_hash(doc, exclude)`'s exclusions, applied in near-linear time.
//!
//! The entries are applied as if one after the other (a plain name removes a top-level member;
//! an entry starting with `/` is an RFC 6901 JSON Pointer; each entry sees the document as the
//! entries before it left it: `/l/0` twice removes the first two items of `l`), which is what
//! stored request hashes were computed with. Done naively that is members x entries work; here
//! the document is left untouched while the entries are resolved against marks: per object an
//! index of its member names (built when an entry first reaches it), per array a Fenwick tree of
//! the items still present (so "the i-th item now" is found in O(log n)). Then one pass removes
//! what was marked. `check` is called once per entry and per member indexed or removed: the
//! extension checks for a query cancel there.

use crate::canonical::{CanonError, Value};
use std::collections::HashMap;

/// Removes what `entries` name from `value` (see the module comment); a path that does not
/// exist removes nothing; a malformed pointer is [`CanonError::InvalidPointer`] (the first one
/// in order) and leaves `value` as it was.
pub fn exclude_all(
    value: &mut Value,
    entries: &[&str],
    check: &mut impl FnMut(),
) -> Result<(), CanonError> {
    let mut root = Marks::default();
    for entry in entries {
        check();
        if let Some(pointer) = entry.strip_prefix('/') {
            let tokens = pointer
                .split('/')
                .map(|raw| {
                    unescape_pointer_token(raw)
                        .ok_or_else(|| CanonError::InvalidPointer(entry.to_string()))
                })
                .collect::<Result<Vec<String>, CanonError>>()?;
            root.remove(value, &tokens, check);
        } else if let Value::Object(_) = value {
            // A plain name: a top-level member only.
            root.remove(value, std::slice::from_ref(&entry.to_string()), check);
        }
    }
    root.apply(value, check);
    Ok(())
}

/// Removes the member (or item) that one entry names; see [`exclude_all`].
pub fn exclude(value: &mut Value, entry: &str) -> Result<(), CanonError> {
    exclude_all(value, &[entry], &mut || {})
}

/// What the entries so far removed from one container and from containers below it, by the
/// children's original positions.
#[derive(Default)]
struct Marks {
    /// Set on the first entry that reaches the container.
    removed: Vec<bool>,
    /// An object's member names -> their positions (all of them, should a name repeat).
    names: HashMap<String, Vec<usize>>,
    /// An array's items still present.
    present: Fenwick,
    below: HashMap<usize, Marks>,
    ready: bool,
}

impl Marks {
    fn prepare(&mut self, value: &Value, check: &mut impl FnMut()) {
        if self.ready {
            return;
        }
        self.ready = true;
        match value {
            Value::Object(members) => {
                self.removed = vec![false; members.len()];
                for (i, (name, _)) in members.iter().enumerate() {
                    check();
                    self.names.entry(name.clone()).or_default().push(i);
                }
            }
            Value::Array(items) => {
                self.removed = vec![false; items.len()];
                self.present = Fenwick::full(items.len());
            }
            _ => {}
        }
    }

    /// The position of the child `token` names in `value` as the entries so far left it.
    fn find(&self, value: &Value, token: &str) -> Option<usize> {
        match value {
            Value::Object(_) => self
                .names
                .get(token)?
                .iter()
                .copied()
                .find(|&i| !self.removed[i]),
            Value::Array(_) => self.present.nth(array_index(token)?),
            _ => None,
        }
    }

    fn remove(&mut self, value: &Value, tokens: &[String], check: &mut impl FnMut()) {
        let Some((token, rest)) = tokens.split_first() else {
            return;
        };
        self.prepare(value, check);
        let Some(at) = self.find(value, token) else {
            return;
        };
        if !rest.is_empty() {
            let child = match value {
                Value::Object(members) => &members[at].1,
                Value::Array(items) => &items[at],
                _ => return,
            };
            self.below.entry(at).or_default().remove(child, rest, check);
            return;
        }
        match value {
            // Every member of that name goes (a plain name is removed wherever it repeats).
            Value::Object(_) => {
                for &i in self.names.get(token).map(Vec::as_slice).unwrap_or(&[]) {
                    self.removed[i] = true;
                }
            }
            Value::Array(_) => {
                self.removed[at] = true;
                self.present.take(at);
            }
            _ => {}
        }
    }

    /// Removes what was marked, the children first (their positions hold until then).
    fn apply(self, value: &mut Value, check: &mut impl FnMut()) {
        if !self.ready {
            return;
        }
        let Marks { removed, below, .. } = self;
        for (at, marks) in below {
            let child = match value {
                Value::Object(members) => members.get_mut(at).map(|m| &mut m.1),
                Value::Array(items) => items.get_mut(at),
                _ => None,
            };
            if let Some(child) = child {
                marks.apply(child, check);
            }
        }
        let mut keep = removed.iter().map(|r| !r);
        match value {
            Value::Object(members) => members.retain(|_| {
                check();
                keep.next().unwrap_or(true)
            }),
            Value::Array(items) => items.retain(|_| {
                check();
                keep.next().unwrap_or(true)
            }),
            _ => {}
        }
    }
}

/// Counts of present items over a fixed number of positions: take one out, or find the n-th
/// still present, each in O(log n).
#[derive(Default)]
struct Fenwick {
    tree: Vec<usize>,
}

impl Fenwick {
    fn full(n: usize) -> Fenwick {
        // Node i (1-based) covers positions (i - lowbit(i), i]: all present.
        let tree = (0..=n).map(|i| i & i.wrapping_neg()).collect();
        Fenwick { tree }
    }

    fn take(&mut self, at: usize) {
        let mut i = at + 1;
        while i < self.tree.len() {
            self.tree[i] -= 1;
            i += i & i.wrapping_neg();
        }
    }

    /// The position of the n-th (0-based) present item.
    fn nth(&self, n: usize) -> Option<usize> {
        let len = self.tree.len().checked_sub(1)?;
        let mut remaining = n + 1;
        let mut at = 0;
        let mut step = len.checked_next_power_of_two()?;
        while step > 0 {
            let next = at + step;
            if next <= len && self.tree[next] < remaining {
                at = next;
                remaining -= self.tree[next];
            }
            step /= 2;
        }
        // The first `at` positions hold fewer than n + 1 present items, the first `at + 1`
        // n + 1 of them (when there are that many): position `at` is the n-th present one.
        (at < len).then_some(at)
    }
}

fn unescape_pointer_token(raw: &str) -> Option<String> {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c == '~' {
            match chars.next() {
                Some('0') => out.push('~'),
                Some('1') => out.push('/'),
                _ => return None,
            }
        } else {
            out.push(c);
        }
    }
    Some(out)
}

fn array_index(token: &str) -> Option<usize> {
    let canonical = token == "0" || (!token.starts_with('0') && !token.is_empty());
    if canonical && token.bytes().all(|b| b.is_ascii_digit()) {
        token.parse().ok()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::{canonicalize, NumberMode};
    use crate::json_text::parse_json;

    fn excluded(doc: &str, entries: &[&str]) -> String {
        let mut v = parse_json(doc).unwrap();
        exclude_all(&mut v, entries, &mut || {}).unwrap();
        canonicalize(&v, NumberMode::Exact).unwrap()
    }

    #[test]
    fn entries_apply_as_if_one_after_the_other() {
        // The second /l/0 removes what was the second item.
        assert_eq!(
            excluded(r#"{"l":[1,2,3]}"#, &["/l/0", "/l/0"]),
            r#"{"l":[3]}"#
        );
        assert_eq!(
            excluded(r#"{"l":[1,2,3]}"#, &["/l/1", "/l/1"]),
            r#"{"l":[1]}"#
        );
        assert_eq!(
            excluded(r#"{"l":[1,2,3]}"#, &["/l/2", "/l/0"]),
            r#"{"l":[2]}"#
        );
        // A path through a removed item follows the items as they are now.
        assert_eq!(
            excluded(r#"{"l":[{"a":1},{"a":2,"b":3}]}"#, &["/l/0", "/l/0/a"]),
            r#"{"l":[{"b":3}]}"#
        );
        // Through a removed member: nothing.
        assert_eq!(
            excluded(r#"{"a":{"b":1},"c":2}"#, &["/a", "/a/b"]),
            r#"{"c":2}"#
        );
        assert_eq!(
            excluded(r#"{"a":{"b":1,"d":4},"c":2}"#, &["/a/b", "c"]),
            r#"{"a":{"d":4}}"#
        );
        // Out of range, non-canonical indices, scalars: nothing.
        assert_eq!(
            excluded(r#"{"l":[1]}"#, &["/l/1", "/l/01", "/l/-", "/l/0/x"]),
            r#"{"l":[1]}"#
        );
        assert_eq!(excluded("[1,2]", &["0", "/1"]), "[1]");
        assert_eq!(excluded("7", &["/a", "a"]), "7");
        assert_eq!(excluded(r#"{"":1,"a":2}"#, &["/"]), r#"{"a":2}"#);
    }

    #[test]
    fn a_malformed_pointer_is_refused_and_changes_nothing() {
        let mut v = parse_json(r#"{"a":1,"b":2}"#).unwrap();
        let e = exclude_all(&mut v, &["a", "/b~2"], &mut || {});
        assert_eq!(e, Err(CanonError::InvalidPointer("/b~2".into())));
        assert_eq!(
            canonicalize(&v, NumberMode::Exact).unwrap(),
            r#"{"a":1,"b":2}"#
        );
    }

    #[test]
    fn many_members_and_many_entries_take_near_linear_work() {
        // 80,000 members x 80,000 entries: each entry an index look-up, each member indexed once.
        let n = 80_000;
        let members = (0..n)
            .map(|i| (format!("m{i}"), Value::Null))
            .collect::<Vec<_>>();
        let mut v = Value::Object(members);
        let names: Vec<String> = (0..n).map(|i| format!("/m{}", 2 * i)).collect();
        let entries: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut calls = 0usize;
        exclude_all(&mut v, &entries, &mut || calls += 1).unwrap();
        let Value::Object(left) = &v else { panic!() };
        assert_eq!(left.len(), n / 2);
        // Checked per entry and per member indexed and kept or removed: linear, not n x n.
        assert!(calls >= 2 * n && calls <= 4 * n, "{calls}");
    }

    #[test]
    fn fenwick_finds_the_nth_present_item() {
        let mut f = Fenwick::full(10);
        for at in [0, 3, 4, 9] {
            f.take(at);
        }
        let present: Vec<usize> = (0..7).filter_map(|n| f.nth(n)).collect();
        assert_eq!(present, vec![1, 2, 5, 6, 7, 8]);
        assert_eq!(f.nth(6), None);
        assert_eq!(Fenwick::full(0).nth(0), None);
    }
}
