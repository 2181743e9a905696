"""Differential test: the SQL functions against an independent RFC 8785 implementation
(tests/oracle/jcs_oracle.py, built on the `rfc8785` package) on generated documents."""

import json
import os
import random
import subprocess
import sys

ORACLE = os.path.join(os.path.dirname(__file__), "..", "oracle", "jcs_oracle.py")
DOCS = int(os.environ.get("ORACLE_DOCS", "4000"))
SEED = int(os.environ.get("ORACLE_SEED", "8785"))

CHARS = (
    [chr(c) for c in range(0x20, 0x7F)] * 3
    + [chr(c) for c in range(0x01, 0x20)]
    + ['"', "\\", "/", "\x7f", "\x80", "\x9f", "\u00e9", "\u00f6", "\u20ac", "\u2028", "\u2029",
       "\ue000", "\ufb33", "\uffff", "\U0001F600", "\U0001F602", "\U00010000", "\U0010FFFF", "A\u030a"]
)


def rand_string(r):
    return "".join(r.choice(CHARS) for _ in range(r.randint(0, 8)))


def rand_number(r, exact):
    kind = r.randrange(9)
    if kind == 0:
        return str(r.randint(-1000, 1000))
    if kind == 1:
        return str(r.randint(-(2**70), 2**70))  # beyond 2^53
    if kind == 2:
        return repr(r.uniform(-1e6, 1e6))  # shortest spelling of a double
    if kind == 3:
        return repr(r.choice([5e-324, 1.7976931348623157e308, 1e21, 1e-7, 0.000001, 999999999999999900000.0, 1e23]))
    if kind == 4:
        return "%.17g" % r.uniform(-1e30, 1e30)  # non-shortest spelling
    if kind == 5:
        d = str(r.randint(0, 10**r.randint(1, 25)))
        return f"{r.choice(['', '-'])}{d}.{r.randint(0, 10**r.randint(1, 20))}"
    if kind == 6:
        lim = 600 if exact else 300
        return f"{r.choice(['', '-'])}{r.randint(1, 99999)}{r.choice(['e', 'E'])}{r.choice(['', '+', '-'])}{r.randint(0, lim)}"
    if kind == 7:
        return r.choice(["0", "-0", "0.0", "-0.000", "1.0", "1.00", "100e-2", "10E-1"])
    return repr(r.random() * 10 ** r.randint(-30, 30))


def dump_string(s):
    return json.dumps(s, ensure_ascii=bool(random.getrandbits(1)))


def rand_doc(r, exact, depth=0):
    kind = r.randrange(10 if depth < 4 else 5)
    if kind == 0:
        return r.choice(["null", "true", "false"])
    if kind in (1, 2):
        return rand_number(r, exact)
    if kind in (3, 4):
        return dump_string(rand_string(r))
    if kind in (5, 6, 7):
        members = []
        names = [rand_string(r) for _ in range(r.randint(0, 6))]
        if names and r.random() < 0.2:
            names.append(r.choice(names))  # duplicate name: jsonb keeps the last
        for name in names:
            members.append(f"{dump_string(name)}{r.choice([':', ' : '])}{rand_doc(r, exact, depth + 1)}")
        return "{" + ",".join(members) + "}"
    return "[" + ", ".join(rand_doc(r, exact, depth + 1) for _ in range(r.randint(0, 5))) + "]"


def oracle(docs, *flags):
    out = subprocess.run(
        [sys.executable, ORACLE, "--duplicates", "last", *flags],
        input="".join(d + "\n" for d in docs).encode("utf-8"),
        capture_output=True,
        check=True,
    ).stdout.decode("utf-8")
    lines = out.split("\n")
    assert lines[-1] == ""
    return lines[:-1]


def ours(db, docs, expr):
    db.execute(
        """CREATE OR REPLACE FUNCTION pg_temp.canon_or_error(d text, mode text) RETURNS text
           LANGUAGE plpgsql AS $$
           BEGIN
             RETURN CASE mode
               WHEN 'hash' THEN encode(idempotency.canonical_hash(d::jsonb), 'hex')
               ELSE idempotency.canonical_json(d::jsonb, mode) END;
           EXCEPTION WHEN OTHERS THEN RETURN '!error ' || SQLSTATE;
           END $$"""
    )
    rows = db.execute(
        "SELECT pg_temp.canon_or_error(d, %s) FROM unnest(%s::text[]) WITH ORDINALITY AS t(d, i) ORDER BY i",
        (expr, docs),
    ).fetchall()
    return [r[0] for r in rows]


def compare(docs, expected, got):
    mismatches = [(d, e, g) for d, e, g in zip(docs, expected, got) if e != g]
    assert not mismatches, f"{len(mismatches)} of {len(docs)} differ, first: {mismatches[0]!r}"


def test_exact_mode_matches_the_oracle(db):
    r = random.Random(SEED)
    random.seed(SEED)
    docs = [rand_doc(r, exact=True) for _ in range(DOCS)]
    compare(docs, oracle(docs, "--numbers", "exact"), ours(db, docs, "exact"))


def test_canonical_hash_matches_the_oracle(db):
    r = random.Random(SEED + 1)
    random.seed(SEED + 1)
    docs = [rand_doc(r, exact=True) for _ in range(DOCS // 2)]
    compare(docs, oracle(docs, "--numbers", "exact", "--sha256"), ours(db, docs, "hash"))


def test_rfc8785_mode_matches_the_oracle(db):
    r = random.Random(SEED + 2)
    random.seed(SEED + 2)
    docs = [rand_doc(r, exact=False) for _ in range(DOCS)]
    # Add out-of-range numbers: both sides must refuse them.
    docs += ["[1e400]", '{"a": -1E309}', "[1e-400]", "1.7976931348623159e308"]
    expected = [
        "!error 22003" if e.startswith("!error non-finite") else e
        for e in oracle(docs, "--numbers", "js")
    ]
    compare(docs, expected, ours(db, docs, "rfc8785"))
    assert expected[-4:-2] == ["!error 22003", "!error 22003"]


def test_streaming_and_tree_paths_agree(db):
    """canonical_hash without exclusions writes straight from jsonb; with exclusions it edits a
    tree first. An exclusion that matches nothing must give the same hash."""
    r = random.Random(SEED + 3)
    random.seed(SEED + 3)
    docs = [rand_doc(r, exact=True) for _ in range(DOCS // 2)]
    rows = db.execute(
        """SELECT count(*) FILTER (WHERE idempotency.canonical_hash(d::jsonb)
                                       = idempotency.canonical_hash(d::jsonb, '{/no such member/x}')),
                  count(*)
             FROM unnest(%s::text[]) AS t(d)""",
        (docs,),
    ).fetchone()
    assert rows[0] == rows[1] == len(docs)


def wide_doc(r, members):
    """An object and arrays with more children than jsonb's offset stride (32), so that some
    children are found through stored end offsets rather than lengths."""
    names = [f"{rand_string(r)}{i}" for i in range(members)]
    obj = ",".join(f"{dump_string(n)}:{rand_doc(r, exact=True, depth=2)}" for n in names)
    arr = ",".join(rand_doc(r, exact=True, depth=3) for _ in range(members + 7))
    return f'{{{obj},"wide array":[{arr}],"numbers":[{",".join(rand_number(r, True) for _ in range(70))}]}}'


def test_documents_read_from_a_table_in_every_storage_form(db):
    """canonical_json and canonical_hash read jsonb in place: a small value from a table has a
    one-byte header (and its numbers lie unaligned), a big one is compressed or stored out of
    line. Every form must give the oracle's answer, and the hash must equal the tree path's."""
    r = random.Random(SEED + 4)
    random.seed(SEED + 4)
    small = [rand_doc(r, exact=True) for _ in range(300)]
    wide = [wide_doc(r, m) for m in (31, 32, 33, 64, 65, 200)]
    # ~100 KB of repetitive members compresses inline or out of line; random ones do not.
    big = ['{"items":[' + ",".join(wide_doc(r, 40) for _ in range(30)) + "]}"]
    docs = small + wide + big
    expected = oracle(docs, "--numbers", "exact")
    db.execute("CREATE TEMP TABLE stored (i int, d jsonb)")
    db.execute("CREATE TEMP TABLE stored_external (i int, d jsonb)")
    db.execute("ALTER TABLE stored_external ALTER d SET STORAGE EXTERNAL")  # out of line, uncompressed
    for table in ("stored", "stored_external"):
        db.execute(f"INSERT INTO {table} SELECT i, d::jsonb FROM unnest(%s::text[]) WITH ORDINALITY AS t(d, i)",
                   (docs,))
        rows = db.execute(
            f"""SELECT idempotency.canonical_json(d),
                       idempotency.canonical_hash(d) = idempotency.canonical_hash(d, '{{/no such member/x}}'),
                       pg_column_size(d) < octet_length(d::text)
                  FROM {table} ORDER BY i"""
        ).fetchall()
        compare(docs, expected, [row[0] for row in rows])
        assert all(row[1] for row in rows), table
    # The forms the test means to cover did occur.
    forms = db.execute(
        """SELECT bool_or(pg_column_size(d) < 127), bool_or(pg_column_size(d) > 2000)
             FROM stored"""
    ).fetchone()
    assert forms == (True, True)
