"""The portable edition (dist/, built by scripts/portable.py from sql/portable/): canonical_json
and canonical_hash in SQL and PL/pgSQL only, installed where no library of ours is loaded, must
give the native edition's bytes, errors and messages on the oracle's generated documents and on
the hard cases (UTF-16 order of supplementary characters against U+E000..U+FFFF, control
characters, -0, 1e21, 5e-324, the exact rounding bounds of doubles, huge exact numbers, nesting
of 1000 and 1001 levels, exclusions applied one after the other, malformed pointers).

Two routes: the plain script, in a database of the test cluster where the extension was never
created; pg_tle, on a copy of the server that has no file of the native extension at all
(scripts/pg-tle.sh), compared with the native edition of the test cluster."""

import importlib.util
import json
import os
import random
import re
import shutil
import subprocess

import psycopg
import pytest

from cluster import PG_BIN, Cluster, pgtle_script
from test_canonical_oracle import CHARS, SEED, dump_string, oracle, rand_doc, rand_string, wide_doc

# Each test compares the portable edition with the native one on a server that has the native
# library: run against the portable edition alone (IDEMPOTENCY_EDITION=portable), its "native"
# database would hold the portable edition too, and the comparisons could not fail.
pytestmark = pytest.mark.native_only("compares the portable edition with the native edition of the server")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PLAIN = os.path.join(ROOT, "dist", "idempotency-portable.sql")
DOCS = int(os.environ.get("PORTABLE_DOCS", "2000"))

# Each call's result, or its error as SQLSTATE, message and hint: both editions must agree on all.
HELPER = r"""
CREATE OR REPLACE FUNCTION pg_temp.call(d text, mode text, excl text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_state text; v_msg text; v_hint text;
BEGIN
    RETURN CASE mode
        WHEN 'hash' THEN encode(idempotency.canonical_hash(d::jsonb,
                             ARRAY(SELECT jsonb_array_elements_text(excl::jsonb))), 'hex')
        ELSE idempotency.canonical_json(d::jsonb, mode) END;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT, v_hint = PG_EXCEPTION_HINT;
    RETURN '!error ' || v_state || ' ' || v_msg || ' / ' || v_hint;
END $$;
"""


def cargo_version():
    """The release being built (Cargo.toml), which the pg_tle script installs."""
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        return re.search(r'^version = "(.*)"$', f.read(), re.M).group(1)


def psql(cluster, dbname, path, user="postgres"):
    return subprocess.run(
        [f"{cluster.bin}/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", cluster.dir, "-p", str(cluster.port),
         "-U", user, "-d", dbname, "-f", path],
        capture_output=True, text=True,
    )


def conninfo(cluster, dbname, user="postgres"):
    return f"host={cluster.dir} port={cluster.port} user={user} dbname={dbname}"


def run(conn, docs, mode, excludes=None):
    conn.execute(HELPER)
    excludes = excludes or ["[]"] * len(docs)
    rows = conn.execute(
        """SELECT pg_temp.call(d, %s, x) FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS t(d, x, i)
            ORDER BY i""",
        (mode, docs, excludes),
    ).fetchall()
    return [r[0] for r in rows]


def differences(docs, expected, got):
    assert len(expected) == len(got) == len(docs)
    return [(d[:200], e if e is None else e[:300], g if g is None else g[:300])
            for d, e, g in zip(docs, expected, got) if e != g]


def no_library(conn):
    """The database has no function of the library and no extension idempotency."""
    c_functions = conn.execute(
        """SELECT count(*) FROM pg_proc
            WHERE probin = '$libdir/idempotency'
               OR pronamespace = 'idempotency'::regnamespace
                  AND prolang = (SELECT oid FROM pg_language WHERE lanname = 'c')"""
    ).fetchone()[0]
    portable = conn.execute(
        """SELECT count(*) FROM pg_proc
            WHERE pronamespace = 'idempotency'::regnamespace
              AND proname IN ('canonical_json', 'canonical_hash')
              AND prolang = (SELECT oid FROM pg_language WHERE lanname = 'plpgsql')"""
    ).fetchone()[0]
    return c_functions, portable


# --- the documents ---------------------------------------------------------------------------

def _bounds():
    import decimal
    ctx = decimal.Context(prec=2000)
    tiny = ctx.divide(decimal.Decimal(1), ctx.power(decimal.Decimal(2), 1075))  # rounds to 0 (tie to even)
    huge = 2 ** 1024 - 2 ** 970  # rounds to infinity (tie to even)
    return format(tiny, "f"), str(huge)


TINY, HUGE = _bounds()

HARD = [
    # UTF-16 order: supplementary characters (surrogates D800..DBFF) before U+E000..U+FFFF.
    json.dumps({"\ue000": 1, "\U0001F600": 2, "\uffff": 3, "\U00010000": 4, "\U0010FFFF": 5, "\ud7ff": 6,
                "a\ue000": 7, "a\U0001F600": 8, "\U0010FFFF\ue000": 9, "\U0010FFFF\U0010FFFF": 10,
                "\ufb33": 11, "\uef00x": 12, "\U0001F600\ue000": 13, "": 14, "\u0080": 15}),
    json.dumps({"\ue000": 1, "\U0001F600": 2}, ensure_ascii=False),
    json.dumps({"\U0001F600" * 3 + "\uffff": 1, "\U0001F600" * 3: 2, "\U0001F600" * 3 + "\U00010000": 3}),
    # Control characters, quotes, backslashes, DEL, C1, line separators, in names and values.
    json.dumps({"".join(chr(c) for c in range(1, 32)): "".join(chr(c) for c in range(1, 32)),
                "\"\\/\x7f\x80\x9f\u2028\u2029": "</script>\"\\"}),
    # Numbers.
    "[-0, 0.0, -0.000, 1e21, 1e-7, 0.000001, 5e-324, -5e-324, 4.9e-324, 1e15, 1e16, 123e-20, 1E+2]",
    "[2.4703282292062327e-324, 2.4703282292062328e-324, -2.4703282292062327e-324, 1e-400, -1e-400]",
    f"[{TINY}]", f"[-{TINY}]", f"[{TINY}1]", f"[{HUGE}]", f"[-{HUGE}]", f"[{int(HUGE) - 1}]",
    "[1.7976931348623157e308, 1.7976931348623158e308, 1.7976931348623159e308]",
    "[9007199254740993, 123456789012345678901234567890, 0.10000000000000001, -12.5e-1, 333333333.33333329]",
    "[1e100000]", "[-1e-16000]", "[1" + "0" * 5000 + ".5]", "1e400", "-0", "5e-324", "1e21",
    # Nesting: 1000 is allowed, 1001 is not, whatever the containers; the first failure in
    # canonical order is the one reported.
    "[" * 1000 + "]" * 1000, "[" * 1001 + "]" * 1001,
    '{"a":' * 1000 + "1" + "}" * 1000, '{"a":' * 1001 + "1" + "}" * 1001,
    '{"z": [1e400], "a": ' + "[" * 1000 + "]" * 1000 + "}",
    '{"a": [1e400], "b": ' + "[" * 1000 + "]" * 1000 + "}",
    '{"b": [1e400], "a": ' + "[" * 1000 + "]" * 1000 + "}",
    "[" * 999 + '{"x": 1e400}' + "]" * 999,
    # Empty and scalar documents.
    "{}", "[]", '""', '{"":""}', "null", "true", "false", '"\\u00e9\\ud83d\\ude00"',
]


def long_string(r, n):
    return "".join(r.choice(CHARS) for _ in range(64)) * (n // 64)


def deep_doc(r, exact, depth):
    """A document nested `depth` levels down one path, arrays and objects at random: beside the
    path, other values (a long string now and then) and members whose names sort before or after
    the path's; at the bottom, a long string."""
    opening, closing = [], []
    for level in range(depth):
        siblings = [dump_string(long_string(r, r.randint(1, 40) * 1024)) if r.random() < 0.02
                    else rand_doc(r, exact, depth=4) for _ in range(r.randint(0, 3))]
        at = r.randint(0, len(siblings))
        if r.random() < 0.5:
            before, after = siblings[:at], siblings[at:]
            opening.append("[" + "".join(v + ", " for v in before))
            closing.append("".join(", " + v for v in after) + "]")
        else:
            names = list(dict.fromkeys(rand_string(r) + str(i) for i in range(len(siblings) + 1)))
            path = names.pop(r.randrange(len(names)))
            members = [f"{dump_string(k)}: {v}" for k, v in zip(names, siblings)]
            opening.append("{" + "".join(m + ", " for m in members[:at]) + dump_string(path) + ": ")
            closing.append("".join(", " + m for m in members[at:]) + "}")
    return "".join(opening) + dump_string(long_string(r, 100 * 1024)) + "".join(reversed(closing))


# Nesting of the deep documents: 1000 levels is allowed, 1001 is not. Past the third, deeper
# than the oracle reads (Python's recursion): compared with the native edition only.
DEEP = (3, 40, 250, 600, 1000, 1001)
DEEP_PAST_ORACLE = 3


def corpus(seed, exact, n):
    r = random.Random(seed)
    random.seed(seed)
    docs = [rand_doc(r, exact=exact) for _ in range(n)]
    docs += [wide_doc(r, m) for m in (31, 33, 200)]
    docs.append('{"items":[' + ",".join(wide_doc(r, 40) for _ in range(30)) + "]}")  # ~100 KB
    # Deep documents with long strings: the same bytes however deep, and 54001 past 1000.
    docs += [deep_doc(r, exact, d) for d in DEEP]
    return docs + HARD


def pointer(tokens):
    return "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in tokens)


def paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, prefix + (str(i),))


def exclusions(r, doc):
    """0 to 5 entries: pointers to existing members and items (some twice, so the second one
    meets what the first left), plain names, non-canonical indices, missing paths, malformed
    pointers now and then."""
    try:
        value = json.loads(doc, parse_float=str, parse_int=str)
        found = [p for p in paths(value) if p]
    except (ValueError, RecursionError):
        return []
    entries = []
    for _ in range(r.randint(0, 5)):
        kind = r.randrange(10)
        if kind <= 4 and found:
            p = pointer(r.choice(found))
            entries += [p, p] if kind == 0 else [p]
        elif kind == 5 and isinstance(value, dict) and value:
            entries.append(r.choice(list(value)))
        elif kind == 6 and found:
            p = list(r.choice(found))
            p[-1] = r.choice(["01", "-1", "1.0", "+1", "99999999999", "", "-"])
            entries.append(pointer(p))
        elif kind == 7:
            entries.append(r.choice(["/", "//", "/missing/deeper", rand_string(r), "/" + rand_string(r)]))
        elif kind == 8 and r.random() < 0.3:
            entries.append(r.choice(["/a~2", "/a~", "~x", "/~/x", "/ok/b~3c"]))
        elif found:
            entries.append(pointer(r.choice(found)[:1]))
    return entries


# --- the plain script --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def editions(cluster):
    """(native, portable): the test cluster's database with the extension, and a database of
    the same cluster where only dist/idempotency-portable.sql was run."""
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        c.execute("DROP DATABASE IF EXISTS portable")
        c.execute("CREATE DATABASE portable")
    result = psql(cluster, "portable", PLAIN)
    assert result.returncode == 0, result.stderr
    native = psycopg.connect(cluster.conninfo(), autocommit=True)
    portable = psycopg.connect(conninfo(cluster, "portable"), autocommit=True)
    yield native, portable
    native.close()
    portable.close()
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        c.execute("DROP DATABASE portable")


def test_dist_is_current():
    """dist/ is what scripts/portable.py writes from the sources (CI fails on a stale dist/)."""
    result = subprocess.run([os.path.join(ROOT, "scripts", "portable.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def copy_of_the_sources(tmp_path):
    """What scripts/portable.py reads and writes, copied under tmp_path (the build runs there)."""
    for part in ("scripts", "sql", "dist", "crates"):
        shutil.copytree(os.path.join(ROOT, part), tmp_path / part, ignore=shutil.ignore_patterns("target"))
    for f in ("Cargo.toml", "idempotency.control"):
        shutil.copy(os.path.join(ROOT, f), tmp_path / f)


@pytest.mark.parametrize("edit, refusal", [
    ("LANGUAGE plpgsql STABLE", "the body of derive_key says 'STABLE'"),
    ("LANGUAGE plpgsql SECURITY DEFINER", "the body of derive_key says 'SECURITY'"),
    ("LANGUAGE plpgsql\nPARALLEL UNSAFE", "the body of derive_key has 'PARALLEL UNSAFE' before AS"),
])
def test_a_portable_body_cannot_change_the_native_declaration(tmp_path, edit, refusal):
    """A portable body carries no declaration: its head and attributes are sql/idempotency.sql's,
    and the generator refuses a body that names volatility, parallel safety, strictness or
    SECURITY DEFINER itself (the one difference by design is listed in the generator)."""
    copy_of_the_sources(tmp_path)
    source = tmp_path / "sql" / "portable" / "derivation.sql"
    text = source.read_text()
    assert "BODY idempotency.derive_key\nLANGUAGE plpgsql\n" in text
    source.write_text(text.replace("BODY idempotency.derive_key\nLANGUAGE plpgsql\n",
                                   f"BODY idempotency.derive_key\n{edit}\n", 1))
    before = (tmp_path / "dist" / "idempotency-portable.sql").read_bytes()
    result = subprocess.run([str(tmp_path / "scripts" / "portable.py")], capture_output=True, text=True)
    assert result.returncode != 0 and refusal in result.stderr, result.stderr
    assert (tmp_path / "dist" / "idempotency-portable.sql").read_bytes() == before


def test_the_portable_sources_write_no_literal_copy_of_a_core_rule():
    """Key and scope length, nesting depth, the defaults of default_ttl, default_lease and
    busy_retry_after and the marks per transaction are the core crate's constants, named @NAME@ in
    sql/portable/ and filled by the generator: none of them is written out there."""
    spec = importlib.util.spec_from_file_location("portable", os.path.join(ROOT, "scripts", "portable.py"))
    portable = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(portable)
    rules = portable.rules()
    assert rules["MAX_KEY_CHARS"] == "255" and rules["MAX_DEPTH"] == "1000"
    patterns = {
        "MAX_KEY_CHARS": r"\b255\b",
        "MAX_DEPTH": r"\{1000 to last\}|deeper than 1000\b|depth integer DEFAULT 1000\b",
        "DEFAULT_TTL_SECS": r"'idempotency\.default_ttl', 86400\b|'86400 seconds'",
        "DEFAULT_LEASE_SECS": r"'idempotency\.default_lease', 300\b|'300 seconds'",
        "DEFAULT_BUSY_RETRY_AFTER_MS": r"'idempotency\.busy_retry_after', 1000\b",
        "PORTABLE_MARKS_PER_TRANSACTION": r"v_count OPERATOR\(pg_catalog\.[<>]=?\) 1000\b",
    }
    used = set()
    for path in portable.SOURCES:
        text = open(path, encoding="utf-8").read()
        for name, pattern in patterns.items():
            found = [text[:m.start()].count("\n") + 1 for m in re.finditer(pattern, text)]
            assert not found, f"{os.path.basename(path)}:{found}: {name} written out; write @{name}@"
        used |= set(re.findall(r"@([A-Z][A-Z0-9_]*)@", text))
    assert set(patterns) <= used, f"rules never used: {set(patterns) - used}"
    # Filled in the built script.
    built = open(PLAIN, encoding="utf-8").read()
    assert "@MAX_KEY_CHARS@" not in built and "must be at most 255 characters" in built


def test_a_portable_source_naming_an_unknown_rule_does_not_build(tmp_path):
    copy_of_the_sources(tmp_path)
    source = tmp_path / "sql" / "portable" / "checks.sql"
    source.write_text(source.read_text().replace("@MAX_KEY_CHARS@", "@MAX_KEY_CHARZ@", 1))
    result = subprocess.run([str(tmp_path / "scripts" / "portable.py")], capture_output=True, text=True)
    assert result.returncode != 0 and "@MAX_KEY_CHARZ@ names no integer constant" in result.stderr, result.stderr


def test_the_portable_database_has_no_library(editions):
    native, portable = editions
    assert no_library(portable) == (0, 2)
    assert portable.execute("SELECT count(*) FROM pg_extension WHERE extname = 'idempotency'").fetchone()[0] == 0
    # The native database does hold the library's functions (what the check above looks for).
    assert native.execute("SELECT count(*) FROM pg_proc WHERE probin = '$libdir/idempotency'").fetchone()[0] > 10


def test_plain_script_refuses_a_database_with_the_extension(cluster):
    """Run where the native extension exists, the script would replace its functions: refused,
    nothing changed."""
    result = psql(cluster, cluster.dbname, PLAIN)
    assert result.returncode != 0 and 'extension "idempotency" is installed in this database' in result.stderr
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        assert c.execute("SELECT count(*) FROM pg_proc WHERE probin = '$libdir/idempotency' "
                         "AND proname = 'canonical_json'").fetchone()[0] == 1


@pytest.mark.parametrize("mode", ["exact", "rfc8785"])
def test_canonical_json_matches_the_native_edition(editions, mode):
    native, portable = editions
    docs = corpus(SEED + (10 if mode == "exact" else 11), mode == "exact", DOCS)
    expected, got = run(native, docs, mode), run(portable, docs, mode)
    # The corpus reaches what it means to: errors of both kinds and long outputs.
    assert sum(e.startswith("!error 54001") for e in expected) >= 3
    assert mode == "exact" or sum(e.startswith("!error 22003") for e in expected) >= 5
    assert mode == "rfc8785" or max(len(e) for e in expected) > 100_000
    diff = differences(docs, expected, got)
    assert not diff, f"{len(diff)} of {len(docs)} differ, first: {diff[:5]!r}"
    if mode == "exact":
        # And both agree with the independent oracle, where it answers: Python's json module
        # cannot read the deepest documents, and the oracle knows no depth limit.
        want = oracle(docs, "--numbers", "exact")
        kept = [i for i, w in enumerate(want) if not w.startswith("!error parse: maximum recursion")
                and not w.startswith("!error other: RecursionError") and not got[i].startswith("!error 54001")]
        assert len(kept) >= len(docs) - 12 - DEEP_PAST_ORACLE
        diff = differences([docs[i] for i in kept], [want[i] for i in kept], [got[i] for i in kept])
        assert not diff, f"{len(diff)} differ from the oracle, first: {diff[:5]!r}"


def test_canonical_hash_with_exclusions_matches_the_native_edition(editions):
    native, portable = editions
    r = random.Random(SEED + 12)
    docs = corpus(SEED + 12, True, DOCS)
    docs += ['{"l":[1,2,3]}'] * 4 + ['{"l":[{"a":1},{"a":2,"b":3}]}', '{"a":{"b":1},"c":2}', "[1,2]", "7"]
    excludes = [exclusions(r, d) for d in docs[:-8]]
    excludes += [["/l/0", "/l/0"], ["/l/1", "/l/1"], ["/l/2", "/l/0"], ["/l/1", "/l/01", "/l/-", "/l/0/x"],
                 ["/l/0", "/l/0/a"], ["/a", "/a/b"], ["0", "/1"], ["/a", "a", "/"]]
    excludes = [json.dumps(x) for x in excludes]
    expected = run(native, docs, "hash", excludes)
    got = run(portable, docs, "hash", excludes)
    assert sum(e.startswith("!error 22P02") for e in expected) >= 10
    assert sum(x != "[]" for x in excludes) >= len(docs) // 3
    diff = differences([d + " minus " + x for d, x in zip(docs, excludes)], expected, got)
    assert not diff, f"{len(diff)} of {len(docs)} differ, first: {diff[:5]!r}"
    # The same documents without exclusions: the hash of the exact form.
    diff = differences(docs, run(native, docs, "hash"), run(portable, docs, "hash"))
    assert not diff, f"{len(diff)} of {len(docs)} differ, first: {diff[:5]!r}"


BAD_CALLS = [
    "idempotency.canonical_json('1', NULL)",
    "idempotency.canonical_json('1', 'fast')",
    "idempotency.canonical_json('1', '')",
    "idempotency.canonical_json('1', E'quote\" back\\\\ tab\\t nl\\n ' || repeat('x', 50))",
    "idempotency.canonical_json(NULL, 'bogus')",
    "idempotency.canonical_json(NULL)",
    "idempotency.canonical_hash(NULL)",
    "idempotency.canonical_hash('1', NULL)",
    "idempotency.canonical_hash(NULL, NULL)",
    "idempotency.canonical_hash('{\"a\":1}', ARRAY['a', NULL])",
    "idempotency.canonical_hash(NULL, ARRAY['/a~2'])",
    "idempotency.canonical_hash('{\"a\":1}', ARRAY['/a~2', NULL])",
    "idempotency.canonical_hash('{\"a\":1}', ARRAY['/' || repeat('y', 100) || '~'])",
    "idempotency.canonical_hash('{\"a\":1}', '{{a,b},{/a,/b}}')",
    "idempotency.canonical_hash(repeat('[', 1001)::text || repeat(']', 1001), ARRAY['/a~2'])",
    "idempotency.canonical_json('[' || repeat('9', 400) || ']', 'rfc8785')",
]


FLAT_EDGES = [
    # Names whose UTF-16 order differs from their UTF-8 byte order (U+E000..U+FFFF against
    # supplementary characters), next to plain ones; jsonb itself orders names by length first.
    '{"\\ue000": 1, "\\ud83d\\ude00": 2, "a": 3, "\\uffff": 4, "bb": 5, "\\ufb01": 6}',
    '{"zz": 1, "a": 2, "\\u00e9": 3, "": 4, "A": 5, "\\u2028": 6, "\\ud800\\udc00x": 7}',
    # Numbers at the edges of "written as they are": -0, 100.0, 1e2, 21 and 22 digits, 15 and 16
    # digits (exact doubles only up to 2^53 in rfc8785 mode), fractions.
    '[0, -0, 100.0, 1e2, -7, 123456789012345678901, 1234567890123456789012, -123456789012345678901]',
    '[123456789012345, 1234567890123456, 9007199254740993, -999999999999999, 0.5, 1.0e-7]',
    '{"n": -0, "m": 100.0, "big": 1234567890123456789012, "d": 9007199254740993}',
    # The same integers without a fraction beside them (a fraction sends the whole document to
    # the general path): 21 digits and more, 15 digits and more.
    '[123456789012345678901, 1234567890123456789012, -10000000000000000000000, -0, 1e2]',
    '{"a": 1234567890123456, "b": 9007199254740993, "c": 123456789012345, "d": -99999999999999999}',
    # Fractions (exact mode writes those from 10^-6 up to 10^21 in magnitude in one statement):
    # trailing zeros, the bounds 10^-6 and 10^21 on either side, 21 integer digits, zero written
    # with a fraction, one below 10^-6 beside them (the whole document: the general path).
    '{"a": 12.50, "b": -0.5, "c": 0.000001, "e": 0.0000010, "f": 999999999999999999999.9, "g": 1.000}',
    '{"h": 0.000, "i": 123.4500, "j": -0.0000015, "k": 0.00001000, "l": 100000000000000000000.5, "m": 2.50}',
    '[12.50, -0.5, 0.000001, 1e-6, 100.0, 0.000, -0.0000015, 1.5e20, 999999999999999999999.999, 0.1]',
    '[0.0000009999, 12.5]', '{"a": 0.00000099, "b": 1.5}', '{"a": -0.000001, "b": 1e21, "c": 1.5}',
    '[1000000000000000000000.5, 2.5]', '{"a": 0.1000000000000000000000000000001, "b": -7.25e3}',
    # Strings with every escape, control characters, DEL, quotes, non-ASCII; true, false, null.
    '{"s": "x\\b\\f\\n\\r\\t\\u0001\\u001f\\u007f\\"\\\\/\\u00e9\\ud83d\\ude00", "t": true, "f": false, "z": null}',
    '["\\u2028\\u2029", "", true, null, false, "\\\\u0041"]',
    # Empty containers, and a container of scalars next to one with a nested container.
    '{}', '[]', '{"a": {}, "b": 1}', '[1, [2], "x"]', '{"a": 1, "b": [null]}',
]


@pytest.mark.parametrize("mode", ["exact", "rfc8785", "hash"])
def test_flat_documents_match_the_native_edition(editions, mode):
    """Objects and arrays of scalars only, which the portable edition writes in one statement:
    the same bytes as the native edition where jsonb's own order or spelling would be wrong
    (names in U+E000..U+FFFF, -0, 100.0, integers past 21 digits or past 2^53 in rfc8785 mode,
    escapes)."""
    native, portable = editions
    docs = FLAT_EDGES
    expected = run(native, docs, mode)
    assert not any(e.startswith("!error") for e in expected if e is not None), expected
    assert differences(docs, expected, run(portable, docs, mode)) == []


# Requests for claim: objects of scalars, whose canonical form claim's one statement writes
# itself (a copy of _canon_text's rules for them), next to the documents it leaves to the general
# path (a name in U+E000..U+FFFF, a fraction, 1e21 and more, a container inside, not an object).
CLAIM_REQUESTS = [
    '{"amount": 100, "currency": "EUR"}',
    '{"\\ud83d\\ude00": 1, "a": 2, "bb": 3, "": 4, "A": 5, "\\u00e9": 6, "\\u2028": 7, "\\ud800\\udc00x": 8}',
    '{"n": -0, "m": 100.0, "e": 1e2, "k": 123456789012345678901, "l": -999999999999999999999, "z": 0}',
    '{"s": "x\\b\\f\\n\\r\\t\\u0001\\u001f\\u007f\\"\\\\/\\u00e9\\ud83d\\ude00", "t": true, "f": false, "u": null}',
    '{"\\ue000": 1, "\\ud83d\\ude00": 2}', '{"\\uffff": "x", "a": 1}',
    '{"big": 1000000000000000000000}', '{"f": 0.5}', '{"f": 1.0e-7, "g": 2}', '{"d": 9007199254740993.0}',
    '{}', '{"a": {}}', '{"a": [1], "b": 2}', '[1, 2]', '"text"', '7', 'null',
    '{"amount": 12.50, "currency": "EUR", "rate": 0.000001, "fee": -0.0000015, "total": 1.000}',
    '{"amount": 999999999999999999999.90, "z": 0.000}',
    '{"s": "\\uff21\\uff22", "a": 1}', '{"\\uefff": 1, "\\ud7ff": 2, "\\ud83d\\ude00": 3, "\\ue000x": 4}',
    '{"s": "\\ud83d\\ude00\\ue000", "\\u00e9": "\\uffff"}',
]

# Pairs of requests for one key: the same request in another spelling (claim answers
# in_progress, then replay) or another request (mismatch both times).
CLAIM_PAIRS = [
    ('{"n": 100}', '{"n": 100.0}', True), ('{"n": 100}', '{"n": 1e2}', True), ('{"n": 0}', '{"n": -0}', True),
    ('{"b": 1, "a": 2}', '{"a": 2, "b": 1}', True), ('{"s": "\\u00e9"}', '{"s": "é"}', True),
    ('{"n": 100}', '{"n": 101}', False), ('{"n": "1"}', '{"n": 1}', False), ('{"a": 1}', '{"a": 1, "b": null}', False),
    ('{"n": 1}', '{"n": 1.5}', False), ('{"n": 1}', '[1]', False), ('{"a": 1, "b": 2}', '{"a": 1, "bb": 2}', False),
    ('{"n": 12.5, "c": "EUR"}', '{"c": "EUR", "n": 12.50}', True), ('{"n": 12.5}', '{"n": 12.05}', False),
    ('{"n": 0.000001}', '{"n": 1e-6}', True), ('{"n": 0.5}', '{"n": 0.50000000000000000001}', False),
    ('{"s": "\\uff21", "n": 1}', '{"n": 1, "s": "\uff21"}', True), ('{"s": "\\uff21"}', '{"s": "\\uff22"}', False),
]


def test_claim_stores_the_native_editions_request_hash(editions):
    """claim's own copy of the canonical form (objects of scalars, written in its one statement)
    and the general path it leaves the rest to: the hash a claim stores is the native edition's,
    for each request, and both editions tell a request in another spelling from another request
    in the same way."""
    tag = f"twin-{os.getpid()}-{random.randrange(10 ** 6)}"
    hashes = {}
    for name, conn in zip(("native", "portable"), editions):
        conn.execute("SET client_min_messages = error")  # the mismatch warnings
        got = []
        for i, doc in enumerate(CLAIM_REQUESTS):
            outcome = conn.execute("SELECT (idempotency.claim(%s, %s::jsonb)).outcome::text",
                                   (f"{tag}-{i}", doc)).fetchone()[0]
            assert outcome == "new", (name, doc, outcome)
            got.append(conn.execute("SELECT encode(request_hash, 'hex') FROM idempotency.idempotency_keys "
                                    "WHERE scope = '' AND key = %s", (f"{tag}-{i}",)).fetchone()[0])
        answers = []
        for i, (first, second, same) in enumerate(CLAIM_PAIRS):
            key = f"{tag}-pair-{i}"
            token = conn.execute("SELECT (c).outcome::text, (c).token FROM idempotency.claim(%s, %s::jsonb) c",
                                 (key, first)).fetchone()
            assert token[0] == "new", (name, first, token)
            before = conn.execute("SELECT (idempotency.claim(%s, %s::jsonb)).outcome::text", (key, second)).fetchone()[0]
            conn.execute("SELECT idempotency.complete(%s, '{\"ok\": true}', 200, '', %s)", (key, token[1]))
            after = conn.execute("SELECT (idempotency.claim(%s, %s::jsonb)).outcome::text", (key, second)).fetchone()[0]
            answers.append((first, second, before, after))
            assert (before, after) == (("in_progress", "replay") if same else ("mismatch", "mismatch")), \
                (name, first, second, before, after)
        conn.execute("RESET client_min_messages")
        hashes[name] = (got, answers)
    native = editions[0]
    expected = [native.execute("SELECT encode(idempotency.canonical_hash(%s::jsonb), 'hex')", (d,)).fetchone()[0]
                for d in CLAIM_REQUESTS]
    assert differences(CLAIM_REQUESTS, expected, hashes["native"][0]) == []
    assert differences(CLAIM_REQUESTS, expected, hashes["portable"][0]) == []
    assert hashes["native"][1] == hashes["portable"][1]


def test_arguments_and_errors_match_the_native_edition(editions):
    native, portable = editions
    for call in BAD_CALLS:
        answers = []
        for conn in (native, portable):
            try:
                value = conn.execute(f"SELECT ({call})::text").fetchone()[0]
                answers.append(("ok", value))
            except psycopg.Error as e:
                answers.append((e.sqlstate, e.diag.message_primary, e.diag.message_hint))
        assert answers[0] == answers[1], call
        assert answers[0][0] != "XX000", call


def test_every_character_is_quoted_in_messages_as_the_native_edition_quotes_it(editions):
    """Every code point (bar NUL and the surrogates), 40 to a message: quoted as Rust's Debug
    writes it (combining marks, format characters, unassigned and private-use code points,
    spaces other than U+0020 as \\u{hex}; the rest as it is)."""
    query = r"""
        CREATE OR REPLACE FUNCTION pg_temp.quoted(v text) RETURNS text LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM idempotency.canonical_json('1', v);
            RETURN 'accepted';
        EXCEPTION WHEN invalid_parameter_value THEN
            RETURN SQLERRM;
        END $$;
        SELECT pg_temp.quoted(string_agg(chr(cp), '' ORDER BY cp))
          FROM generate_series(1, 1114111) AS cp
         WHERE cp NOT BETWEEN 55296 AND 57343
         GROUP BY cp / 40 ORDER BY cp / 40"""
    native, portable = editions
    got = []
    for conn in (native, portable):
        with conn.cursor() as cur:
            cur.execute(query)
            cur.nextset()
            got.append([r[0] for r in cur.fetchall()])
    assert len(got[0]) == len(got[1]) > 27000
    # The native edition escapes some (U+0301, U+200B, U+00A0, U+E000) and not others (U+00E9).
    assert all(m.startswith("numbers must be 'exact' or 'rfc8785' (got \"") for m in got[0][:3])
    assert any("\\u{301}" in m for m in got[0]) and any("\\u{200b}" in m for m in got[0])
    assert any("\\u{a0}" in m for m in got[0]) and any("\\u{e000}" in m for m in got[0])
    assert any("\u00e9" in m for m in got[0])
    diff = [(i * 40, e, g) for i, (e, g) in enumerate(zip(*got)) if e != g]
    assert not diff, f"{len(diff)} of {len(got[0])} messages differ, first: {diff[:3]!r}"


def test_declarations_match_the_native_edition(editions):
    """Every function of the native edition's schema exists in the portable edition with the same
    arguments, defaults, result type, volatility, strictness, parallel safety and SECURITY
    DEFINER (the portable edition's own helpers, idempotency._p_* and _canon_*, aside)."""
    query = """SELECT p.oid::regprocedure::text, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid),
                      p.provolatile, p.proisstrict, p.proparallel, p.prosecdef, p.prokind
                 FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace ORDER BY 1"""
    native, portable = editions
    theirs = {r[0]: r for r in native.execute(query).fetchall()}
    ours = {r[0]: r for r in portable.execute(query).fetchall()}
    assert len(theirs) > 40, "the native edition's schema is not installed"
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"functions the portable edition lacks: {missing}"
    extra = sorted(n for n in set(ours) - set(theirs)
                   if not n.startswith(("idempotency._p_", "idempotency._canon_")))
    assert not extra, f"portable functions that are neither native nor helpers: {extra}"
    # Differences by design, each with its column and why.
    by_design = {
        # Runs as the caller, whose name the audit row records (CURRENT_USER), and inlines into
        # complete; the work runs as the owner in idempotency._p_complete (SECURITY DEFINER).
        "idempotency._complete(text,jsonb,integer,text,bigint,interval)": 6,
    }
    for name, column in by_design.items():
        assert theirs[name][column] != ours[name][column], f"{name} no longer differs: drop it from by_design"
        theirs[name] = theirs[name][:column] + theirs[name][column + 1:]
        ours[name] = ours[name][:column] + ours[name][column + 1:]
    differ = [(theirs[n], ours[n]) for n in sorted(theirs) if theirs[n] != ours[n]]
    assert not differ, f"{len(differ)} of {len(theirs)} declarations differ: {differ}"
    config = portable.execute(
        """SELECT bool_and('search_path=pg_catalog, pg_temp' = ANY (proconfig)), count(*)
             FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace""").fetchone()
    assert config[0] is True and config[1] >= 5


def test_a_latin1_database_hashes_the_utf8_bytes(cluster):
    """In a database whose encoding is not UTF-8, the canonical form comes back in that
    encoding and the hash is of its UTF-8 bytes, as the native edition does."""
    docs = ['{"é": "ü", "a": "ß\\u00ff", "Ça": [1.50, "x\\u0001"], "\\u00a0": 1e21}', '"\\u00e9"', '{"b": 1, "a": 2}']
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        for db in ("latin1_native", "latin1_portable"):
            c.execute(f"DROP DATABASE IF EXISTS {db}")
            c.execute(f"CREATE DATABASE {db} TEMPLATE template0 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C'")
    try:
        with psycopg.connect(conninfo(cluster, "latin1_native") + " client_encoding=UTF8", autocommit=True) as c:
            c.execute("CREATE EXTENSION idempotency")
            expected = [run(c, docs, "exact"), run(c, docs, "hash", ['["a"]'] * 3), run(c, docs, "hash")]
        result = psql(cluster, "latin1_portable", PLAIN)
        assert result.returncode == 0, result.stderr
        with psycopg.connect(conninfo(cluster, "latin1_portable") + " client_encoding=UTF8", autocommit=True) as c:
            got = [run(c, docs, "exact"), run(c, docs, "hash", ['["a"]'] * 3), run(c, docs, "hash")]
        assert got == expected
        assert expected[0][0] == '{"a":"ßÿ","\u00a0":1e+21,"Ça":[1.5,"x\\u0001"],"é":"ü"}'
    finally:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
            c.execute("DROP DATABASE latin1_native")
            c.execute("DROP DATABASE latin1_portable")


def test_plain_script_installed_by_a_role_that_is_not_a_superuser(cluster, editions):
    """As on a managed service: the database's owner (CREATEROLE CREATEDB, no superuser) runs the
    plain script; an application role with only USAGE on the schema calls the functions."""
    native, _ = editions
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        c.execute("DROP DATABASE IF EXISTS portable_owned")
        c.execute("DROP ROLE IF EXISTS portable_owner")
        c.execute("DROP ROLE IF EXISTS portable_app")
        c.execute("CREATE ROLE portable_owner LOGIN CREATEROLE CREATEDB")
        c.execute("CREATE ROLE portable_app LOGIN")
        c.execute("CREATE DATABASE portable_owned OWNER portable_owner")
    try:
        result = psql(cluster, "portable_owned", PLAIN, user="portable_owner")
        assert result.returncode == 0, result.stderr
        with psycopg.connect(conninfo(cluster, "portable_owned", "portable_owner"), autocommit=True) as c:
            assert c.execute("SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'idempotency'"
                             ).fetchone()[0] == "portable_owner"
            c.execute("GRANT USAGE ON SCHEMA idempotency TO portable_app")
        docs = corpus(SEED + 19, True, 100)
        with psycopg.connect(conninfo(cluster, "portable_owned", "portable_app"), autocommit=True) as c:
            assert c.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0] is False
            assert run(c, docs, "exact") == run(native, docs, "exact")
            assert run(c, docs, "hash", ['["a"]'] * len(docs)) == run(native, docs, "hash", ['["a"]'] * len(docs))
            assert c.execute("SELECT idempotency.derive_key('o', 's', '{\"a\": 1}')").fetchone()[0] == \
                native.execute("SELECT idempotency.derive_key('o', 's', '{\"a\": 1}')").fetchone()[0]
    finally:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
            c.execute("DROP DATABASE portable_owned")
            c.execute("DROP ROLE portable_owner")
            c.execute("DROP ROLE portable_app")


def test_plain_script_refuses_sql_ascii(cluster):
    """The native install's encoding check, shared: a SQL_ASCII database is refused, nothing made."""
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        c.execute("DROP DATABASE IF EXISTS portable_ascii")
        c.execute("CREATE DATABASE portable_ascii TEMPLATE template0 ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C'")
    try:
        result = psql(cluster, "portable_ascii", PLAIN)
        assert result.returncode != 0
        assert "idempotency does not support databases with encoding SQL_ASCII" in result.stderr
        with psycopg.connect(conninfo(cluster, "portable_ascii"), autocommit=True) as c:
            assert c.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'").fetchone()[0] == 0
    finally:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
            c.execute("DROP DATABASE portable_ascii")


PLANTED = """
CREATE SCHEMA evil;
CREATE FUNCTION evil.sha256(bytea) RETURNS bytea LANGUAGE sql AS $$ SELECT '\\x00'::pg_catalog.bytea $$;
CREATE FUNCTION evil.convert_to(text, name) RETURNS bytea LANGUAGE sql AS $$ SELECT '\\x00'::pg_catalog.bytea $$;
CREATE FUNCTION evil.jsonb_typeof(jsonb) RETURNS text LANGUAGE sql AS $$ SELECT 'string'::pg_catalog.text $$;
CREATE FUNCTION evil.to_json(text) RETURNS json LANGUAGE sql AS $$ SELECT '"pwned"'::pg_catalog.json $$;
CREATE FUNCTION evil.texteq_always(text, text) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.texteq_always);
CREATE FUNCTION evil.concat_pwned(text, text) RETURNS text LANGUAGE sql AS $$ SELECT 'pwned'::pg_catalog.text $$;
CREATE OPERATOR evil.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.concat_pwned);
CREATE DOMAIN evil.jsonb AS pg_catalog.text;
CREATE DOMAIN evil.text AS pg_catalog.varchar(3);
"""


QUALIFIED_HELPERS = r"""
CREATE FUNCTION pg_temp.qcall(d pg_catalog.text, mode pg_catalog.text) RETURNS pg_catalog.text
LANGUAGE plpgsql AS $$
DECLARE
    v_state pg_catalog.text; v_msg pg_catalog.text; v_hint pg_catalog.text;
BEGIN
    IF mode OPERATOR(pg_catalog.=) 'hash' THEN
        RETURN pg_catalog.encode(idempotency.canonical_hash(d::pg_catalog.jsonb, '{a,/b/0}'::pg_catalog.text[]), 'hex');
    END IF;
    RETURN idempotency.canonical_json(d::pg_catalog.jsonb, mode);
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT, v_hint = PG_EXCEPTION_HINT;
    RETURN pg_catalog.concat('!error ', v_state, ' ', v_msg, ' / ', v_hint);
END $$;
CREATE FUNCTION pg_temp.qtry(q pg_catalog.text) RETURNS pg_catalog.text LANGUAGE plpgsql AS $$
DECLARE
    v pg_catalog.text; v_state pg_catalog.text; v_msg pg_catalog.text; v_hint pg_catalog.text;
BEGIN
    EXECUTE q INTO v;
    RETURN v;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT, v_hint = PG_EXCEPTION_HINT;
    RETURN pg_catalog.concat('!error ', v_state, ' ', v_msg, ' / ', v_hint);
END $$;
"""


def test_planted_objects_change_nothing(cluster, editions):
    """Functions, operators and types planted in a schema that comes before pg_catalog in
    search_path, while the plain script runs and while the functions are called."""
    native, _ = editions
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        c.execute("DROP DATABASE IF EXISTS portable_planted")
        c.execute("CREATE DATABASE portable_planted")
    try:
        with psycopg.connect(conninfo(cluster, "portable_planted"), autocommit=True) as c:
            c.execute(PLANTED)
            c.execute("ALTER DATABASE portable_planted SET search_path = evil, public, pg_catalog")
        result = psql(cluster, "portable_planted", PLAIN)
        assert result.returncode == 0, result.stderr
        docs = corpus(SEED + 17, True, 200)
        with psycopg.connect(conninfo(cluster, "portable_planted"), autocommit=True) as c:
            # The planted objects do take effect for unqualified names in this session...
            assert c.execute("SELECT 'a'::pg_catalog.text = 'b'::pg_catalog.text").fetchone()[0] is True
            # The test's own helpers name everything with its schema, as the functions do.
            c.execute(QUALIFIED_HELPERS)
            got = {m: [r[0] for r in c.execute(
                       """SELECT pg_temp.qcall(d, %s) FROM pg_catalog.unnest(%s::pg_catalog.text[])
                                 WITH ORDINALITY AS t(d, i) ORDER BY i""", (m, docs)).fetchall()]
                   for m in ("exact", "rfc8785", "hash")}
            calls = derivation_calls(SEED + 18, 100)
            qualified = [q.replace("::text", "::pg_catalog.text").replace("::jsonb", "::pg_catalog.jsonb")
                          .replace("::timestamptz", "::pg_catalog.timestamptz")
                          .replace("::interval", "::pg_catalog.interval").replace("encode(", "pg_catalog.encode(")
                         for q in calls]
            got_calls = [r[0] for r in c.execute(
                "SELECT pg_temp.qtry(q) FROM pg_catalog.unnest(%s::pg_catalog.text[]) WITH ORDINALITY AS t(q, i) ORDER BY i",
                (qualified,)).fetchall()]
        want = {"exact": run(native, docs, "exact"), "rfc8785": run(native, docs, "rfc8785"),
                "hash": run(native, docs, "hash", ['["a", "/b/0"]'] * len(docs))}
        assert got == want
        assert got_calls == run_calls(native, calls)
    finally:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
            c.execute("DROP DATABASE portable_planted")


def test_very_deep_documents(editions):
    """Documents nested far deeper than the limit: refused as the native edition refuses them
    (54001, the same message), not with a stack overflow."""
    native, portable = editions
    docs = ["[" * n + "]" * n for n in (2000, 5000)] + ['{"a":' * 3000 + "1" + "}" * 3000]
    for mode in ("exact", "rfc8785"):
        assert run(portable, docs, mode) == run(native, docs, mode)
    excludes = ['["/0"]'] * len(docs)
    assert run(portable, docs, "hash", excludes) == run(native, docs, "hash", excludes)
    assert all(e.startswith("!error 54001 doc: document is nested deeper than 1000 levels")
               for e in run(native, docs, "exact"))


def temp_files(conn):
    """This database's temporary files and bytes so far, this session's included."""
    conn.execute("SELECT pg_stat_force_next_flush()")  # flushed when the session goes idle
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return conn.execute("SELECT temp_files, temp_bytes FROM pg_stat_database "
                        "WHERE datname = current_database()").fetchone()


def test_a_long_string_nested_999_deep_writes_no_temp_files(editions):
    """1 MB of string under 999 arrays, or 999 objects whose members change places: canonical_hash,
    canonical_json and claim write no temporary file (a form built by carrying each value through
    every level wrote gigabytes, and temp_file_limit is unlimited by default), and give the native
    edition's bytes."""
    native, portable = editions
    text = json.dumps(long_string(random.Random(SEED + 30), 1024 * 1024))
    docs = ["[" * 999 + text + "]" * 999, '{"b": 1, "aa": ' * 999 + text + "}" * 999]
    tag = f"deep-{os.getpid()}-{random.randrange(10 ** 6)}"
    portable.execute("SET temp_file_limit = '1MB'")  # and a temporary file over 1 MB is an error
    before = temp_files(portable)
    for i, doc in enumerate(docs):
        for query in ("SELECT encode(idempotency.canonical_hash(%s::jsonb), 'hex')",
                      "SELECT md5(idempotency.canonical_json(%s::jsonb))",
                      "SELECT md5(idempotency.canonical_json(%s::jsonb, 'rfc8785'))"):
            assert portable.execute(query, (doc,)).fetchone()[0] == native.execute(query, (doc,)).fetchone()[0]
        assert portable.execute("SELECT (idempotency.claim(%s, %s::jsonb)).outcome::text",
                                (f"{tag}-{i}", doc)).fetchone()[0] == "new"
        stored = portable.execute("SELECT encode(request_hash, 'hex') FROM idempotency.idempotency_keys "
                                  "WHERE scope = '' AND key = %s", (f"{tag}-{i}",)).fetchone()[0]
        assert stored == native.execute("SELECT encode(idempotency.canonical_hash(%s::jsonb), 'hex')",
                                        (doc,)).fetchone()[0]
    assert temp_files(portable) == before
    portable.execute("RESET temp_file_limit")


def lit(value, cast):
    return "NULL" if value is None else "'" + value.replace("'", "''") + "'::" + cast


TRY = r"""
CREATE OR REPLACE FUNCTION pg_temp.try(q text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v text; v_state text; v_msg text; v_hint text;
BEGIN
    EXECUTE q INTO v;
    RETURN v;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT, v_hint = PG_EXCEPTION_HINT;
    RETURN '!error ' || v_state || ' ' || v_msg || ' / ' || v_hint;
END $$;
"""


def run_calls(conn, calls):
    conn.execute(TRY)
    rows = conn.execute(
        "SELECT pg_temp.try(q) FROM unnest(%s::text[]) WITH ORDINALITY AS t(q, i) ORDER BY i", (calls,)
    ).fetchall()
    return [r[0] for r in rows]


def derivation_calls(seed, n):
    r = random.Random(seed)
    random.seed(seed)
    docs = [None, "{}", '{"b":1.0,"a":[1]}', "[" * 999 + "]" * 999, "[" * 1000 + "]" * 1000,
            "[" * 1001 + "]" * 1001, '"x"', "[1e400]", "5"]
    texts = [None, "", "x" * 255, "y" * 256, "order-1", "a:b", "0123456789abcdef", "0123456789ABCDEF",
             "0123456789abcde", "é" * 200, "\U0001F600"]
    calls = []
    for _ in range(n):
        doc = r.choice(docs) if r.random() < 0.3 else rand_doc(r, exact=True)
        parent = r.choice(texts) if r.random() < 0.3 else rand_string(r) or "p"
        step = r.choice(texts) if r.random() < 0.3 else rand_string(r) or "s"
        calls.append(f"SELECT idempotency.derive_key({lit(parent, 'text')}, {lit(step, 'text')}, {lit(doc, 'jsonb')})")
    stamps = [None, "infinity", "-infinity", "2026-12-01 16:47:12.5+00", "1969-12-31 23:59:59.999999+00",
              "1900-02-28 12:00:00+05", "0001-01-01 00:00:00+00", "9999-12-31 23:59:59.999999+00",
              "2000-01-01 00:00:00+00", "1970-01-01 00:00:00+00", "2024-02-29 23:30:00-08",
              # years of five and six digits, and before 1 AD (-4712 is 4713 BC), up to the last
              # microsecond the native edition counts in 64 bits since 1970 and the first after it
              "12345-06-01 00:00:00+00", "1234-06-01 00:00:00+00", "4713-01-01 00:00:00+00 BC",
              "0001-12-31 23:00:00+00 BC", "0999-06-01 00:00:00+00 BC", "294247-01-10 04:00:54.775807+00",
              "294247-01-10 04:00:54.775808+00", "294276-12-31 23:59:59+00"]
    slots = [None, "1 month", "3 months", "-1 month", "1 month 1 day", "1 month 1 second", "5 minutes", "1 day",
             "2 days 3 hours", "1.5 seconds", "00:00:00.000001", "0", "-1 hour", "7 days", "1 year", "13 months",
             "25 hours", "1 day -1 second", "00:00:00.1234", "100 years", "1000000 years", "123456789 days"]
    for _ in range(n):
        job = r.choice(texts) if r.random() < 0.2 else rand_string(r) or "job"
        stamp = r.choice(stamps) if r.random() < 0.5 else \
            f"{r.randint(1, 4000):04d}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d} " \
            f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}.{r.randint(0, 999999):06d}+00"
        slot = r.choice(slots)
        calls.append(f"SELECT idempotency.cron_key({lit(job, 'text')}, {lit(stamp, 'timestamptz')}, "
                     f"{lit(slot, 'interval')})")
    methods = [None, "post", "GET", "", "bad method", "PÖST", "m-._~!#$%&'*+^`|", "get\n", "Ğet"]
    for _ in range(n):
        method = r.choice(methods) if r.random() < 0.4 else r.choice(["post", "GET", "Put"])
        path = None if r.random() < 0.05 else "/" + rand_string(r)
        query = r.choice(docs) if r.random() < 0.4 else '{"q": ' + rand_doc(r, exact=True) + "}"
        body = r.choice(docs) if r.random() < 0.3 else rand_doc(r, exact=True)
        calls.append(f"SELECT encode(idempotency.request_fingerprint({lit(method, 'text')}, {lit(path, 'text')}, "
                     f"{lit(query, 'jsonb')}, {lit(body, 'jsonb')}), 'hex')")
    return calls


def test_derivations_match_the_native_edition(editions):
    """derive_key, cron_key and request_fingerprint: results, SQLSTATEs and messages."""
    native, portable = editions
    calls = derivation_calls(SEED + 15, DOCS // 2)
    expected, got = run_calls(native, calls), run_calls(portable, calls)
    # The calls reach both results and errors of each function.
    for fn in ("derive_key", "cron_key", "request_fingerprint"):
        mine = [e for c, e in zip(calls, expected) if fn in c]
        assert sum(not e.startswith("!error") for e in mine) >= len(mine) // 3, fn
        assert len({e for e in mine if e.startswith("!error")}) >= 4, fn
    diff = differences(calls, expected, got)
    assert not diff, f"{len(diff)} of {len(calls)} differ, first: {diff[:5]!r}"


# Values of integer settings: what PostgreSQL's parse_int reads for the native library (strtol
# with base 0, strtod where it stops at '.', 'e' or 'E', units, rounding half to even).
SETTING_VALUES = ["5", "+5", "-5", "0x10", "-0x10", "0X1f", "010", "09", "0", "1e3", "1E3", ".5", "2.5", "3.5",
                  "-.5", "+.5", "1.5min", "1.5", "10s", "5 min", "5min ", " 7d", "1min30s", "1e-3", "1e400", "1e",
                  "5e", "0x", "0x1.8p1", "0x1f.", "99999999999", "2147483647", "2147483648", "1.5ms", "1500ms",
                  "2500ms", "1us", "abc", "4MB", "1.5MB", "1TB", "1B", "1500B", "1kB", "1 kB", "1 KB", "10 s",
                  "0.5s", "1.0000001h", "0x7.kB", "002e5", "\t128", "0xffff5min", "v", "5v", "v5", "vv10minv",
                  "09.5", "019.5", "08e1", "010.5", "1e-308", "0x1.p-1100", "2.5000000000000001", "1e0000001",
                  "0e99999999", "1e99999", "1e-99999", "0x1.8p99999", "0.49999999999999997", "1.5e-5min", "\v5"]
SETTING_ATOMS = ["", "+", "-", "0", "00", "0x", "0X", "1", "7", "8", "9", "12", "010", "1f", "ff", ".", "e", "E",
                 "e+", "e-", "3", " ", "\t", "s", "ms", "min", "h", "d", "us", "kB", "MB", "GB", "TB", "B", "KB",
                 "x", "5", "2", "p", "p-", "v", "\v", "09", "019", "e0000", "0x1."]


def test_settings_are_read_as_the_native_edition_reads_them(editions):
    """Without the library a setting is a placeholder the portable edition reads itself: every
    value the native edition takes gives the same number, and every value PostgreSQL refuses as
    malformed is refused (22023). The portable edition refused '1e3', '+5' and '0x10', read
    '010' (octal: 8) as 10 and took '5s' for a setting without a unit. A value out of the
    setting's native range is refused with PostgreSQL's message too (the portable edition
    refused none: 0 for a size limit, 3652 days for a TTL)."""
    native, portable = editions
    native.execute("SELECT idempotency.canonical_json('{}')")  # loads the library: the settings are defined
    r = random.Random(SEED + 16)
    values = SETTING_VALUES + ["".join(r.choice(SETTING_ATOMS) for _ in range(r.randint(1, 5))) for _ in range(600)]
    compared = refused = out_of_range = 0
    for name, unit in (("idempotency.default_ttl", "s"), ("idempotency.busy_retry_after", "ms"),
                       ("idempotency.max_response_size", "kB"), ("idempotency.partitions", "")):
        for value in values:
            if value.strip(" \t\n\r\f\v") == "":
                continue  # unset or empty: the default, in the portable edition
            try:
                native.execute("SELECT set_config(%s, %s, false)", (name, value))
                expected = native.execute("SELECT setting FROM pg_settings WHERE name = %s", (name,)).fetchone()[0]
            except psycopg.Error as e:
                expected = (e.sqlstate, e.diag.message_primary, e.diag.message_hint)
            try:
                got = portable.execute("SELECT idempotency._p_setting_value(%s, %s, 0, %s)::text",
                                       (name, value, unit)).fetchone()[0]
            except psycopg.Error as e:
                got = (e.sqlstate, e.diag.message_primary, e.diag.message_hint)
            assert got == expected, (name, value)
            compared += isinstance(expected, str)
            refused += not isinstance(expected, str)
            out_of_range += "outside the valid range" in str(expected)
        native.execute(f"RESET {name}")
    assert compared >= 250 and refused >= 1000 and out_of_range >= 50, (compared, refused, out_of_range)
    # Through the calls: a TTL of 1e3 seconds.
    for conn in (native, portable):
        conn.execute("SET idempotency.default_ttl = '1e3'")
        out = conn.execute("SELECT outcome::text, round(extract(epoch FROM expires_at - now())) "
                           "FROM idempotency.claim('setting-1e3')").fetchone()
        conn.execute("RESET idempotency.default_ttl")
        conn.execute("SELECT idempotency.forget('setting-1e3')")
        assert out == ("new", 1000), out


def test_an_euc_jp_database_refuses_what_has_no_unicode_character(cluster):
    """EUC_JP byte pairs such as 0xA2AF are valid there but have no Unicode character: 22P05
    naming the argument, the same message as the native edition's; Japanese text hashes as its
    UTF-8 bytes."""
    odd = "pg_catalog.convert_from('\\xa2af'::bytea, 'EUC_JP')"
    calls = [
        f"SELECT idempotency.canonical_hash(pg_catalog.jsonb_build_object('a', {odd}))",
        f"SELECT idempotency.canonical_hash(pg_catalog.jsonb_build_object('a', {odd}), '{{a}}')",
        f"SELECT idempotency.canonical_hash('{{}}', ARRAY[{odd}])",
        f"SELECT idempotency.canonical_json(pg_catalog.jsonb_build_object({odd}, 1))",
        f"SELECT idempotency.canonical_json('1', {odd})",
        f"SELECT idempotency.derive_key({odd}, 'step')",
        f"SELECT idempotency.derive_key('p', {odd})",
        f"SELECT idempotency.derive_key('p', 's', pg_catalog.jsonb_build_array({odd}))",
        f"SELECT idempotency.cron_key({odd}, now(), '1 hour')",
        f"SELECT idempotency.request_fingerprint('GET', {odd})::text",
        f"SELECT idempotency.request_fingerprint({odd}, '/')::text",
        f"SELECT idempotency.request_fingerprint('GET', '/', pg_catalog.jsonb_build_object('q', {odd}))::text",
        f"SELECT idempotency.request_fingerprint('GET', '/', NULL, pg_catalog.jsonb_build_array({odd}))::text",
        "SELECT idempotency.canonical_json('{\"漢字\": \"かな\", \"a\": [\"ｶﾅ\", 1.50]}')",
        "SELECT idempotency.canonical_hash('{\"漢字\": \"かな\", \"a\": [\"ｶﾅ\", 1.50]}')::text",
        "SELECT idempotency.canonical_hash('{\"漢字\": \"かな\", \"a\": [\"ｶﾅ\", 1.50]}', '{/a/0}')::text",
        "SELECT idempotency.derive_key('注文', '請求', '{\"額\": 5}')",
        "SELECT idempotency.request_fingerprint('post', '/注文', '{\"q\": \"漢\"}', '[\"字\"]')::text",
        # Messages quoting text outside ASCII, as the native edition writes them in such a database.
        "SELECT idempotency.canonical_json('1', 'かな')",
        "SELECT idempotency.canonical_json('1', repeat('漢', 50))",
        "SELECT idempotency.canonical_json('1', E'\\t' || repeat('é', 50))",
        "SELECT idempotency.canonical_hash('{}', ARRAY['/漢~2'])::text",
        "SELECT idempotency.canonical_hash('{}', ARRAY['/' || repeat('字', 90) || '~'])::text",
    ]
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        for db in ("eucjp_native", "eucjp_portable"):
            c.execute(f"DROP DATABASE IF EXISTS {db}")
            c.execute(f"CREATE DATABASE {db} TEMPLATE template0 ENCODING 'EUC_JP' LC_COLLATE 'C' LC_CTYPE 'C'")
    try:
        with psycopg.connect(conninfo(cluster, "eucjp_native") + " client_encoding=UTF8", autocommit=True) as c:
            c.execute("CREATE EXTENSION idempotency")
            expected = run_calls(c, calls)
        result = psql(cluster, "eucjp_portable", PLAIN)
        assert result.returncode == 0, result.stderr
        with psycopg.connect(conninfo(cluster, "eucjp_portable") + " client_encoding=UTF8", autocommit=True) as c:
            got = run_calls(c, calls)
        assert sum(e.startswith("!error 22P05") for e in expected) == 13
        diff = differences(calls, expected, got)
        assert not diff, f"{len(diff)} of {len(calls)} differ, first: {diff[:5]!r}"
    finally:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
            c.execute("DROP DATABASE eucjp_native")
            c.execute("DROP DATABASE eucjp_portable")


@pytest.mark.parametrize("encoding", ["LATIN1", "WIN1252"])
def test_messages_in_a_single_byte_database_escape_what_is_outside_ascii_as_the_native_edition(cluster, encoding):
    """In a database whose encoding is not UTF-8 the native edition writes every character of a
    message outside ASCII as \\u{hex} of its code point. The portable edition took a message of
    one byte per character for ASCII and wrote LATIN1's characters as they are (and WIN1252's
    0x80, the euro sign, as U+0080)."""
    euro = " || convert_from('\\x80'::bytea, 'WIN1252')" if encoding == "WIN1252" else ""
    calls = [
        "SELECT idempotency.canonical_json('1', 'é')",
        f"SELECT idempotency.canonical_json('1', 'a' || chr(160) || chr(173) || chr(233){euro})",
        f"SELECT idempotency.canonical_json('1', repeat('ÿ', 30) || chr(128 + 5) || repeat('é', 30){euro})",
        "SELECT idempotency.canonical_hash('{}', ARRAY['/é~'])::text",
        "SET idempotency.scope_prefix = 't'; SELECT idempotency.claim('k', scope => 'é')::text",
        "SELECT idempotency.claim('dup', '{\"a\": 1}', 'sé')::text",
        "SELECT idempotency.claim('dup', '{\"a\": 2}', 'sé')::text",
    ]
    names = {"native": f"{encoding.lower()}_native", "portable": f"{encoding.lower()}_portable"}
    with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
        for db in names.values():
            c.execute(f"DROP DATABASE IF EXISTS {db}")
            c.execute(f"CREATE DATABASE {db} TEMPLATE template0 ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C'")
    try:
        answers = {}
        for edition, db in names.items():
            if edition == "portable":
                result = psql(cluster, db, PLAIN)
                assert result.returncode == 0, result.stderr
            with psycopg.connect(conninfo(cluster, db) + " client_encoding=UTF8", autocommit=True) as c:
                if edition == "native":
                    c.execute("CREATE EXTENSION idempotency")
                warnings = []
                c.add_notice_handler(lambda d: warnings.append(d.message_primary)
                                     if d.severity_nonlocalized == "WARNING" else None)
                answers[edition] = []
                for call in calls:
                    warnings.clear()
                    try:
                        *first, last = call.split("; ")
                        for statement in first:
                            c.execute(statement)
                        value = c.execute(last).fetchone()
                        answers[edition].append(("ok", None if "claim" in call else value, list(warnings)))
                    except psycopg.Error as e:
                        answers[edition].append((e.sqlstate, e.diag.message_primary, list(warnings)))
                    c.execute("RESET idempotency.scope_prefix")
        native, portable = answers["native"], answers["portable"]
        assert [a[0] for a in native] == ["22023", "22023", "22023", "22P02", "42501", "ok", "ok"], native
        assert "\\u{e9}" in native[0][1] and "\\u{a0}\\u{ad}\\u{e9}" in native[1][1], native
        assert native[6][2] and "\\u{e9}" in native[6][2][0], native
        if euro:
            assert "\\u{20ac}" in native[1][1], native
        assert [(c, e, g) for c, e, g in zip(calls, native, portable) if e != g] == []
    finally:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as c:
            for db in names.values():
                c.execute(f"DROP DATABASE IF EXISTS {db}")


# --- pg_tle -----------------------------------------------------------------------------------

def _major():
    out = subprocess.run([f"{PG_BIN}/pg_config", "--version"], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"PostgreSQL (\d+)", out).group(1))


@pytest.fixture(scope="module")
def pgtle_cluster():
    tarballs = os.environ.get("PG_TLE_TARBALL_DIR", os.path.join(ROOT, "..", "shared", "vendor", "pg_tle"))
    if not os.path.exists(os.path.join(tarballs, "SHA256SUMS")):
        pytest.skip(f"no pg_tle source tarball in {tarballs} (set PG_TLE_TARBALL_DIR): the pg_tle route is not tested")
    major = _major()
    result = subprocess.run([os.path.join(ROOT, "scripts", "pg-tle.sh"), str(major)], capture_output=True, text=True)
    if result.returncode == 2:
        pytest.skip(f"pg_tle route not prepared for PostgreSQL {major} here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    bin_dir = os.path.dirname(result.stdout.strip())
    c = Cluster(settings={"shared_preload_libraries": "'pg_tle'"}, dbname="tle", bin=bin_dir).start()
    try:
        yield c
    finally:
        c.destroy()


def test_the_pgtle_route_matches_the_native_edition(editions, pgtle_cluster):
    native, _ = editions
    c = pgtle_cluster
    pkglib = subprocess.run([f"{c.bin}/pg_config", "--pkglibdir"], capture_output=True, text=True,
                            check=True).stdout.strip()
    share = subprocess.run([f"{c.bin}/pg_config", "--sharedir"], capture_output=True, text=True,
                           check=True).stdout.strip()
    # No file of the native extension on this server at all.
    assert not [f for f in os.listdir(pkglib) if f.startswith("idempotency")]
    assert not [f for f in os.listdir(os.path.join(share, "extension")) if f.startswith("idempotency")]
    assert os.path.exists(os.path.join(pkglib, "pg_tle.so"))
    # As on RDS: pg_tle is there; a role that is not a superuser, with CREATEROLE, CREATEDB and
    # pgtle_admin, owning the database, installs the extension; an application role with only
    # USAGE on the schema calls it.
    with psycopg.connect(c.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_tle")
        conn.execute("CREATE ROLE tle_owner LOGIN CREATEROLE CREATEDB")
        conn.execute("GRANT pgtle_admin TO tle_owner")
        conn.execute("ALTER DATABASE tle OWNER TO tle_owner")
        conn.execute("CREATE ROLE tle_app LOGIN")
    result = psql(c, "tle", pgtle_script(), user="tle_owner")
    assert result.returncode == 0, result.stderr
    with psycopg.connect(conninfo(c, "tle", "tle_owner"), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION idempotency")
        conn.execute("GRANT USAGE ON SCHEMA idempotency TO tle_app")
        assert conn.execute("SELECT extowner::regrole::text FROM pg_extension WHERE extname = 'idempotency'"
                            ).fetchone()[0] == "tle_owner"
    with psycopg.connect(conninfo(c, "tle", "tle_app"), autocommit=True) as conn:
        assert conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0] is False
        row = conn.execute("""SELECT extversion, extnamespace::regnamespace::text FROM pg_extension
                               WHERE extname = 'idempotency'""").fetchone()
        assert row == (cargo_version(), "idempotency")
        assert no_library(conn) == (0, 2)
        for mode in ("exact", "rfc8785"):
            docs = corpus(SEED + 13, mode == "exact", DOCS // 2)
            diff = differences(docs, run(native, docs, mode), run(conn, docs, mode))
            assert not diff, f"{mode}: {len(diff)} of {len(docs)} differ, first: {diff[:5]!r}"
        r = random.Random(SEED + 14)
        docs = corpus(SEED + 14, True, DOCS // 2)
        excludes = [json.dumps(exclusions(r, d)) for d in docs]
        diff = differences(docs, run(native, docs, "hash", excludes), run(conn, docs, "hash", excludes))
        assert not diff, f"hash: {len(diff)} of {len(docs)} differ, first: {diff[:5]!r}"
        calls = derivation_calls(SEED + 16, DOCS // 4)
        diff = differences(calls, run_calls(native, calls), run_calls(conn, calls))
        assert not diff, f"derivations: {len(diff)} of {len(calls)} differ, first: {diff[:5]!r}"
    with psycopg.connect(conninfo(c, "tle", "tle_owner"), autocommit=True) as conn:
        # DROP EXTENSION takes everything with it.
        conn.execute("DROP EXTENSION idempotency")
        assert conn.execute("SELECT count(*) FROM pg_proc WHERE proname = 'canonical_json'").fetchone()[0] == 0
