"""No Rust source file grows past a size one reader can hold: every `.rs` file under src/ and
crates/ has at most 900 lines. A file that outgrows it is split by concept into a module folder
(as src/store/sql/ is), not trimmed. Reads the sources; needs no server."""

import os

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
MAX_LINES = 900


def rust_files():
    """Every `.rs` file under src/ and crates/, relative to the repository (build output and
    fuzzing corpora excluded)."""
    found = []
    for top in ("src", "crates"):
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d not in ("target", "corpus", "artifacts")]
            found += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files if f.endswith(".rs")]
    return sorted(found)


def line_count(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return sum(1 for _ in f)


def over_budget(counts):
    """The files of `counts` ({path: lines}) over the budget, as `path: n lines`."""
    return [f"{path}: {n} lines" for path, n in sorted(counts.items()) if n > MAX_LINES]


def test_the_setup_sees_the_sources():
    files = rust_files()
    assert os.path.join("src", "lib.rs") in files
    assert os.path.join("src", "store", "sql", "mod.rs") in files
    assert any(f.startswith("crates" + os.sep) for f in files)


def test_no_rust_file_is_over_the_line_budget():
    over = over_budget({path: line_count(path) for path in rust_files()})
    assert not over, (f"Rust source files over {MAX_LINES} lines (split them by concept):\n"
                      + "\n".join(over))


def test_the_checker_names_a_file_over_the_budget():
    assert over_budget({"src/a.rs": MAX_LINES, "src/b.rs": MAX_LINES + 1}) == ["src/b.rs: 901 lines"]
