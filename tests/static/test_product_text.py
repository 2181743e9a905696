"""The docs, the CHANGELOG, the SQL scripts and the code speak of the product only: a newcomer
reading them meets no issue numbers ("issue 12", "#12", "item 3 of"), no branch or worktree
names and no roles of the people who wrote it (lead developer, reviewer, helper sessions),
which mean nothing outside the team and go stale. Needs no server.

Every tracked file under docs/, sql/ (the released install scripts too: comments only may be
reworded there, never a statement), src/, crates/, clients/, examples/, bench/, scripts/,
tests/ and fuzz/ is read, and README.md, CHANGELOG.md, META.json and the manifests."""

import os
import re
import subprocess

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCANNED = re.compile(
    r"(docs|sql|src|crates|clients|examples|bench|scripts|tests|fuzz)/"
    r"|(README\.md|CHANGELOG\.md|META\.json|Cargo\.toml|idempotency\.control)$"
)
BINARY = (".png", ".jpg", ".whl", ".gz", ".lock")
THIS_FILE = os.path.relpath(__file__, ROOT)

# (what it is, the pattern). Written to leave alone what the product itself says: `#[pg_test]`,
# `$1`, `&#123;`, colours, a UTF-8 lead byte, a CASE expression's second branch.
PATTERNS = [
    ("an issue number", re.compile(r"\bissues?\s*(?:no\.?\s*)?#?\d+\b", re.I)),
    ("an issue number", re.compile(r"(?<![\w&/#'\"])#\d{1,5}\b(?![\w-])")),
    ("an issue's item", re.compile(r"\bitems? \d+(?: and \d+)?(?:,| of the issue)", re.I)),
    ("a branch or worktree", re.compile(
        r"\b(?:git )?branch(?:es)?\s+`[\w./-]+`|\bon (?:the |this )?branch\b|\bworktrees?\b"
        r"|\bbranch (?:main|master)\b", re.I)),
    ("a role in the team", re.compile(
        r"\blead developer\b|\b(?:the|a|our) lead\b(?! byte)|\breviewers?\b"
        r"|\bhelper (?:session|agent)s?\b|\bsub-?agents?\b|\bthe team\b|\bteam members?\b", re.I)),
]


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [f for f in out.decode().split("\0") if f]
    return [f for f in files if SCANNED.match(f) and not f.endswith(BINARY) and f != THIS_FILE]


def findings(text):
    """(line number, what, the words) for each line that speaks of the team, not the product."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in PATTERNS:
            m = pattern.search(line)
            if m:
                found.append((n, what, m.group(0)))
    return found


def test_no_issue_numbers_branches_or_team_roles_in_docs_sql_or_code():
    files = tracked_files()
    # The setup read what it must: the docs, the scripts and the code are all among the files.
    for must in ("README.md", "CHANGELOG.md", "docs/architecture.md", "sql/idempotency.sql",
                 "sql/releases/idempotency--0.1.0.sql", "src/lib.rs", "crates/idempotency-core/src/lib.rs"):
        assert must in files, must
    hits = []
    for f in files:
        try:
            with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
                text = fh.read()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        hits += [f"{f}:{n}: {what}: {words!r}" for n, what, words in findings(text)]
    assert not hits, "speak of the product, not of the team's work:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", [
    "-- Encodings (issue 13, item 2; branch `encodings`): the same check",
    "Fixed in #12.",
    "see issues 4 and 5",
    "Issue #7: the sweep",
    "as asked in item 3 of the issue",
    "### Proposed spec text (owned by the lead)",
    "the lead developer decides",
    "checked by a reviewer",
    "made in a helper session",
    "work on the branch before merging",
    "in the worktree of arch",
])
def test_the_checker_finds_what_speaks_of_the_team(line):
    assert findings(line), line


@pytest.mark.parametrize("line", [
    "#[pg_test]",
    "#![deny(unsafe_op_in_unsafe_fn)]",
    "VALUES ($1, $2, $3)",
    "a UTF-8 lead byte followed by 'b'",
    "the wrapper's second branch (`_raise_not_claimed`) raises",
    "IK003 tells a token never issued for the key from a stale one",
    "color: #fff; see #section-2",
    "keys[2] must not be empty",
    "Shared helpers live in tests/integration/helpers.py",
])
def test_the_checker_leaves_the_product_alone(line):
    assert not findings(line), line
