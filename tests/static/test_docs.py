"""The documentation's relative links resolve: every `[text](target)` in README.md and docs/*.md
(and the other guides beside the code) names a file or directory that exists, and an anchor
(`file.md#section`, `#section`) names a heading of that file. Needs no server."""

import glob
import os
import re

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = sorted(
    ["README.md", "CHANGELOG.md", "examples/http-service/README.md", "bench/RESULTS.md"]
    + [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    + [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "clients", "*", "README.md"))]
)
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip())
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def outside_fences(path):
    """(line number, line) for the lines outside fenced code blocks."""
    fence = None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            stripped = line.lstrip()
            m = re.match(r"(`{3,}|~{3,})", stripped)
            if m:
                if fence is None:
                    fence = m.group(1)
                elif stripped.startswith(fence):
                    fence = None
                continue
            if fence is None:
                yield n, line


def anchors(path):
    """The anchors of a Markdown file: its headings' slugs (repeats get -1, -2, ...), <a id>s."""
    found, seen = set(), {}
    for _, line in outside_fences(path):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    with open(path, encoding="utf-8") as f:
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", f.read()))
    return found


def links(doc, root=ROOT):
    for n, line in outside_fences(os.path.join(root, doc)):
        for m in LINK.finditer(re.sub(r"`[^`]*`", "``", line)):  # not inside code spans
            yield n, m.group(1)


def dead_links(doc, root=ROOT):
    here = os.path.dirname(os.path.join(root, doc))
    dead = []
    for n, target in links(doc, root):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # https:, mailto: ...
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(here, path)) if path else os.path.join(root, doc)
        if not full.startswith(root):
            dead.append(f"{doc}:{n}: {target} leaves the repository")
        elif not os.path.exists(full):
            dead.append(f"{doc}:{n}: {target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            dead.append(f"{doc}:{n}: {target}: no heading with that anchor")
    return dead


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    assert os.path.isfile(os.path.join(ROOT, doc)), f"{doc} is gone: update DOCS"
    dead = dead_links(doc)
    assert not dead, "\n".join(dead)


def test_the_checker_sees_links_and_anchors():
    # README links to its own sections and to docs/; a broken target would be reported.
    assert any(t.startswith("#") for _, t in links("README.md"))
    assert any(t.startswith("docs/") for _, t in links("README.md"))
    assert "quickstart" in anchors(os.path.join(ROOT, "README.md"))
    assert slug("`claim(key text, scope text = '') → claim_result`") == "claimkey-text-scope-text----claim_result"


def test_the_checker_reports_dead_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# There\n\n## A `code` heading\n")
    (tmp_path / "README.md").write_text(
        "# Top\n\n[ok](docs/there.md) [ok](docs/there.md#a-code-heading) [ok](#top) [ok](docs/)\n"
        "[web](https://example.org/x) `[in code](missing.md)`\n\n```\n[in a fence](missing.md)\n```\n"
        "[gone](docs/missing.md) [bad anchor](docs/there.md#nowhere) [bad self](#nowhere)\n"
    )
    dead = dead_links("README.md", str(tmp_path))
    assert [d.split(": ")[1] for d in dead] == ["docs/missing.md", "docs/there.md#nowhere", "#nowhere"], dead
