"""The layering docs/architecture.md describes ("calls only go down") holds in the code: each
module of src/ names only modules of the layers below it, so there is no cycle between modules
and no upward call (the background sweeper through the SQL functions' module, the settings
through the store, errors through the encoding module and back); inside the store, the
statements (`sql`) and the writes below SQL (`heap`) do not reach each other, and the catalog
reaches neither. Reads the sources; needs no server."""

import os
import re

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
SRC = os.path.join(ROOT, "src")

# Top to bottom; a module may name modules of lower layers only (not its own layer's).
LAYERS = [
    ["api"],
    ["worker", "binding", "delegation"],
    ["store"],
    ["jsonb"],
    ["stats", "guc", "encoding"],
    ["error"],
    ["compat", "local"],
]
LAYER = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def code(path):
    """The file's text without comments (a doc comment may name any module)."""
    with open(path, encoding="utf-8") as f:
        return re.sub(r"//[^\n]*", "", f.read())


def named_modules(text, modules):
    """The crate's top-level modules the code names: `crate::m` and `use crate::{m, ...}`."""
    names = set(re.findall(r"\bcrate::(\w+)", text))
    for group in re.findall(r"\buse crate::\{([^}]*)\}", text):
        names |= set(re.findall(r"\b(\w+)\b", group))
    return names & modules


def top_level_uses():
    """{module: {modules it names}} for each top-level module of src/ (its file or folder)."""
    uses = {}
    for dirpath, _, files in os.walk(SRC):
        for name in files:
            if not name.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), SRC)
            top = rel.split(os.sep)[0].removesuffix(".rs")
            if top in ("lib", "tests", "bin"):
                continue
            found = named_modules(code(os.path.join(dirpath, name)), set(LAYER)) - {top}
            uses.setdefault(top, set()).update(found)
    return uses


def test_every_module_has_a_layer():
    uses = top_level_uses()
    assert "store" in uses and "api" in uses, "the setup read src/"
    assert set(uses) <= set(LAYER), f"modules without a layer in this test: {set(uses) - set(LAYER)}"


def test_calls_only_go_down():
    upward = [f"{m} -> {n}" for m, names in sorted(top_level_uses().items()) for n in sorted(names)
              if LAYER[n] <= LAYER[m]]
    assert not upward, "a module names one of its own layer or above:\n" + "\n".join(upward)


def test_inside_the_store_sql_and_heap_stay_apart_and_the_catalog_is_below_both():
    store = os.path.join(SRC, "store")
    sql_files = sorted(os.listdir(os.path.join(store, "sql")))
    assert "mod.rs" in sql_files, "the statements are the folder store/sql/"
    for name in sql_files:
        sql = code(os.path.join(store, "sql", name))
        assert "fn " in sql
        assert not re.search(r"\bheap::", sql), f"store/sql/{name} reaches the writes below SQL"
    for name in os.listdir(os.path.join(store, "heap")):
        text = code(os.path.join(store, "heap", name))
        assert not re.search(r"\bsql::", text), f"store/heap/{name} reaches the statements"
    for name in os.listdir(os.path.join(store, "catalog")):
        text = code(os.path.join(store, "catalog", name))
        hit = re.search(r"\b(sql|heap|claim|complete|sweep)::", text)
        assert not hit, f"store/catalog/{name} reaches {hit.group(1)}, above it"


def test_the_checker_sees_an_upward_call():
    assert named_modules("fn f() { crate::api::sweep_batch(1, \"\") }", set(LAYER)) == {"api"}
    assert named_modules("use crate::{encoding, guc};\n", set(LAYER)) == {"encoding", "guc"}
    assert named_modules("// crate::api in a comment\n".split("//")[0], set(LAYER)) == set()


def test_the_crate_keeps_its_modules_private():
    """Nothing depends on the library crate, so its modules are private: then the compiler's
    dead-code lint sees every item that nothing calls (a `pub mod` hides them all). Only pgrx's
    `pg_test` module, which its test framework calls, is public."""
    lib = code(os.path.join(SRC, "lib.rs"))
    assert "pgrx::pg_module_magic!" in lib
    public = re.findall(r"^\s*pub(?:\([^)]*\))?\s+(?:mod|use)\s+(\w+)", lib, re.M)
    assert public == ["pg_test"], f"public modules or re-exports at the crate root: {public}"
