#!/usr/bin/env python3
"""Builds the portable edition (SQL and PL/pgSQL only, for servers that load no library of ours,
docs/managed.md): the native install script sql/idempotency.sql with each of its LANGUAGE c
functions given the body of the same name in sql/portable/*.sql, which carries only the
language, SET clauses and body: the declaration stays sql/idempotency.sql's (the build fails when
a C function has no portable body, or a body names an attribute of its own; see
sql/portable/README.md).

    scripts/portable.py              writes dist/: the plain install script and the plain update
                                     script from the previous release
    scripts/portable.py --check      writes nothing; fails when dist/ is not what it would write
    scripts/portable.py plain        the plain install script, to stdout
    scripts/portable.py update       the plain update script (previous release -> this one)
    scripts/portable.py pgtle [FILE]         the pg_tle install script (pgtle.install_extension),
                                             made from the plain script FILE (default
                                             dist/idempotency-portable.sql)
    scripts/portable.py pgtle-update [FILE]  the pg_tle update script (pgtle.install_update_path),
                                             made from the plain update script FILE (default
                                             the one in dist/)
    scripts/portable.py build plain|pgtle NATIVE SOURCE...   the edition's objects alone, from
                                             the given native install script and portable sources

Only the plain scripts are committed (dist/); the pg_tle scripts are made from them on demand,
mechanically: the lines between the plain script's two marker lines, with the lines only an
extension runs (pg_extension_config_dump, commented out in the plain script with the prefix
"--pgtle: ") put back, wrapped in pgtle.install_extension or pgtle.install_update_path.

The update from the previous release (its plain script frozen in
sql/releases/portable/idempotency-portable--A.sql) is made of the native upgrade script
(sql/idempotency--A--B.sql, its C functions replaced as in the install), then CREATE OR REPLACE
FUNCTION of every function whose definition differs from the previous release's (new ones
created, ones a fresh install no longer has dropped), then the install script's function grants
and revokes again when a function was created. The plain route records its release in the
comment of schema idempotency (0.5.0 recorded none: it is recognised by its functions)."""

import functools
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
NATIVE = os.path.join(ROOT, "sql", "idempotency.sql")
# In this order (sql/portable/README.md): the helpers of each file may use those of the files before.
SOURCES = [os.path.join(ROOT, "sql", "portable", f + ".sql")
           for f in ("messages", "numbers", "canonical", "exclusion", "derivation", "settings", "checks", "signing",
                     "marks", "claim", "complete", "sweep", "stats", "privileges")]
RELEASES = os.path.join(ROOT, "sql", "releases", "portable")
DIST = os.path.join(ROOT, "dist")
PLAIN_NAME = "idempotency-portable.sql"

BEGIN_MARK = "-- ==== the edition's objects: scripts/portable.py pgtle wraps the lines from here ===="
END_MARK = "-- ==== to here ===="
PGTLE_ONLY = "--pgtle: "


def fail(msg):
    sys.stderr.write(f"portable.py: {msg}\n")
    sys.exit(1)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def version():
    m = re.search(r'^version = "(.*)"$', read(os.path.join(ROOT, "Cargo.toml")), re.M)
    if not m:
        fail("no version in Cargo.toml")
    return m.group(1)


def description():
    m = re.search(r"^comment = '(.*)'$", read(os.path.join(ROOT, "idempotency.control")), re.M)
    if not m:
        fail("no comment in idempotency.control")
    return m.group(1)


def vkey(v):
    return tuple(int(x) for x in v.split("."))


def schema_comment(v):
    """What the plain route records in the comment of schema idempotency."""
    return f"idempotency {v}, portable edition (plain script)"


# --- the chunks of a script -----------------------------------------------------------------

def chunks(text, path):
    """(name, text) for each function (with the comment lines before it, up to its line
    "$fn$;"), (None, text) for each other statement."""
    lines = text.split("\n")
    out, pending, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        m = (re.match(r"^CREATE (?:OR REPLACE )?FUNCTION idempotency\.(\w+)\(", line)
             or re.match(r"^BODY idempotency\.(\w+)$", line))
        if m:
            chunk = pending + [line]
            i += 1
            while i < len(lines) and lines[i] != "$fn$;":
                chunk.append(lines[i])
                i += 1
            if i == len(lines):
                fail(f"{path}: function {m.group(1)} does not end with a line $fn$;")
            chunk.append(lines[i])
            out.append((m.group(1), "\n".join(chunk) + "\n"))
            pending = []
        elif line.startswith("--") or line.strip() == "" or line.startswith("\\"):
            pending.append(line)
        elif re.match(r"^DO (\$\w*\$)$", line):
            end = line[3:] + ";"
            chunk = pending + [line]
            while lines[i] != end:
                i += 1
                if i == len(lines):
                    fail(f"{path}: a DO block does not end with a line {end}")
                chunk.append(lines[i])
            out.append((None, "\n".join(chunk) + "\n"))
            pending = []
        else:
            chunk = pending + [line]
            while not lines[i].rstrip().endswith(";"):
                i += 1
                if i == len(lines):
                    fail(f"{path}: a statement does not end with ;")
                chunk.append(lines[i])
            out.append((None, "\n".join(chunk) + "\n"))
            pending = []
        i += 1
    return out


def strip_comments(chunk):
    """A chunk without the comment and blank lines before its statement."""
    lines = chunk.split("\n")
    while lines and (lines[0].startswith("--") or not lines[0].strip()):
        lines.pop(0)
    return "\n".join(lines).strip() + "\n"


def arguments(fn):
    """The text between the parentheses of a function's declaration, and where it ends."""
    start = fn.index("(")
    depth, quoted = 0, False
    for j in range(start, len(fn)):
        c = fn[j]
        if c == "'":
            quoted = not quoted
        elif not quoted and c == "(":
            depth += 1
        elif not quoted and c == ")":
            depth -= 1
            if depth == 0:
                return fn[start + 1:j], j + 1
    fail(f"unbalanced declaration: {fn[:200]}")


def signature(fn):
    """name(arguments as declared), whitespace folded: what tells functions apart here."""
    name = re.match(r"CREATE (?:OR REPLACE )?FUNCTION (idempotency\.\w+)\(", fn).group(1)
    args, _ = arguments(fn)
    return name + "(" + re.sub(r"\s+", " ", args).strip() + ")"


def result(fn):
    """The declaration's result (RETURNS ..., or the OUT arguments): what CREATE OR REPLACE
    cannot change."""
    _, end = arguments(fn)
    m = re.match(r"\s*(RETURNS\s.*?)\s*\n(?:LANGUAGE|AS|SET|STRICT|IMMUTABLE|STABLE|VOLATILE|SECURITY)\b",
                 fn[end:], re.S)
    return re.sub(r"\s+", " ", m.group(1)) if m else ""


def split_arguments(args):
    """The arguments, split at the commas outside parentheses and quotes."""
    out, depth, quoted, cur = [], 0, False, ""
    for c in args:
        if c == "'":
            quoted = not quoted
        elif not quoted and c == "(":
            depth += 1
        elif not quoted and c == ")":
            depth -= 1
        if c == "," and depth == 0 and not quoted:
            out.append(cur)
            cur = ""
        else:
            cur += c
    if cur.strip():
        out.append(cur)
    return [re.sub(r"\s+", " ", a).strip() for a in out]


def drop_statement(fn):
    """DROP FUNCTION of a function of the previous release (arguments without their defaults;
    OUT arguments are ignored by DROP)."""
    name = re.match(r"CREATE (?:OR REPLACE )?FUNCTION (idempotency\.\w+)\(", fn).group(1)
    args, _ = arguments(fn)
    kept = [re.split(r"\s+(?:DEFAULT\b|=)", a, 1)[0] for a in split_arguments(args)]
    return f"DROP FUNCTION {name}({', '.join(kept)});\n"


def functions(text, path):
    """{signature: (name, chunk)} of a script, and its other statements in order."""
    fns, others = {}, []
    for name, chunk in chunks(text, path):
        if name is None:
            others.append(chunk)
            continue
        sig = signature(strip_comments(chunk))
        if sig in fns:
            fail(f"{path}: function {sig} is defined twice")
        fns[sig] = (name, chunk)
    return fns, others


# --- the install ----------------------------------------------------------------------------

NOTICE = """DO $notice$
BEGIN
    -- CREATE EXTENSION runs its script with client_min_messages = warning; let this through.
    PERFORM pg_catalog.set_config('client_min_messages', 'notice', true);
    RAISE NOTICE 'idempotency (portable edition): no background sweeper runs in this edition'
        USING HINT = 'Schedule SELECT idempotency.sweep(); (with pg_cron: SELECT idempotency.schedule_sweep();). '
                     'Expired keys count as absent either way.';
END
$notice$;
"""

# A portable body of a LANGUAGE c function carries no declaration (sql/portable/README.md):
#     BODY idempotency.name
#     LANGUAGE plpgsql
#     SET search_path = pg_catalog, pg_temp
#     AS $fn$ ... $fn$;
# The head (name, arguments, defaults, result) and the attributes (volatility, parallel safety,
# strictness, SECURITY DEFINER, cost, rows) are sql/idempotency.sql's; only the language, the SET
# clauses and the body are the edition's. A body that names an attribute itself is refused,
# except the differences by design listed here with the attribute they drop and why.
BY_DESIGN = {
    # Runs as the caller, whose name the audit row records (CURRENT_USER), and inlines into
    # complete; the work runs as the store's owner in idempotency._p_complete.
    "_complete": "SECURITY DEFINER",
}
ATTRIBUTE = re.compile(r"\b(VOLATILE|STABLE|IMMUTABLE|PARALLEL|STRICT|CALLED|RETURNS NULL|SECURITY|LEAKPROOF|COST|ROWS|WINDOW)\b")


def compose(name, declaration, body, path):
    """The function `name` as the portable edition declares it: the native `declaration` (its
    LANGUAGE c form) with the language, SET clauses and body of the portable `body` chunk."""
    head, sep, tail = declaration.partition("\nLANGUAGE c")
    if not sep:
        fail(f"sql/idempotency.sql: {name}'s declaration has no line LANGUAGE c")
    attributes = re.sub(r"\s+", " ", tail.split("\nAS 'MODULE_PATHNAME'")[0]).strip()
    drop = BY_DESIGN.get(name)
    if drop:
        if drop not in attributes:
            fail(f"{name} no longer has {drop} natively: drop it from BY_DESIGN in scripts/portable.py")
        attributes = re.sub(r"\s+", " ", attributes.replace(drop, "")).strip()
    lines = body.split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("BODY idempotency."))
    language = lines[at + 1]
    m = re.match(r"^LANGUAGE (plpgsql|sql)$", language)
    if not m:
        bad = ATTRIBUTE.search(language)
        fail(f"{path}: the body of {name} says {bad.group(0) if bad else language!r}: its attributes are "
             "sql/idempotency.sql's (the line after BODY is LANGUAGE plpgsql or LANGUAGE sql alone)")
    for line in lines[at + 2:]:
        if line.startswith("AS "):
            break
        if not line.startswith(("SET ", "--")):
            fail(f"{path}: the body of {name} has {line!r} before AS: only SET clauses (and comments) may come there")
    return "\n".join(lines[:at] + [head + "\n" + f"LANGUAGE {m.group(1)} {attributes}".rstrip()] + lines[at + 2:])


C_FUNCTION = re.compile(
    r"^CREATE (?:OR REPLACE )?FUNCTION idempotency\.(\w+)\((?:(?!^CREATE |^\$fn\$;$).)*?"
    r"^AS 'MODULE_PATHNAME', '\w+';\n", re.M | re.S)


# The rules the native edition shares with the pure core (crates/idempotency-core): the portable
# sources name them @NAME@, filled from the crate's `pub const NAME: type = value;` (integer
# expressions), so a rule is written once.
CORE = os.path.join(ROOT, "crates", "idempotency-core", "src")
RULE = re.compile(r"@([A-Z][A-Z0-9_]*)@")


@functools.lru_cache(maxsize=None)
def rules():
    """{NAME: value} of the core crate's integer constants (read once per run)."""
    found = {}
    if not os.path.isdir(CORE):
        fail(f"no {CORE}: the rules of the portable sources are that crate's constants")
    for name in sorted(os.listdir(CORE)):
        if name.endswith(".rs"):
            for m in re.finditer(r"^pub const ([A-Z][A-Z0-9_]*): [iu](?:\d+|size) = ([0-9_ *+()-]+);$",
                                 read(os.path.join(CORE, name)), re.M):
                expr = m.group(2).replace("_", "")
                # Digits and + - * ( ) only (the pattern above): nothing else can run.
                found[m.group(1)] = str(eval(expr, {"__builtins__": {}}, {}))
    return found


def fill_rules(text, path):
    known = rules()

    def value(m):
        if m.group(1) not in known:
            fail(f"{path}: @{m.group(1)}@ names no integer constant of crates/idempotency-core/src")
        return known[m.group(1)]
    return RULE.sub(value, text)


def portable_functions(sources):
    pool, fns = [], {}
    for path in sources:
        for name, text in chunks(fill_rules(read(path), path), path):
            if name is not None:
                if name in fns:
                    fail(f"{path}: function {name} is defined twice in sql/portable/")
                fns[name] = text
            pool.append((name, text))
    return pool, fns


def extension_lines(text, what):
    """The plain scripts keep the lines only an extension runs, commented out with PGTLE_ONLY."""
    kept = []
    for line in text.split("\n"):
        if PGTLE_ONLY.strip() in line:
            fail(f"{what}: a line holds {PGTLE_ONLY.strip()!r}, which marks the lines only pg_tle runs")
        if "pg_extension_config_dump" in line:
            m = re.match(r"^(\s*)((SELECT|PERFORM) pg_catalog\.pg_extension_config_dump\(.*\);)$", line)
            if not m:
                fail(f"{what}: a pg_extension_config_dump call that is not a statement of its own line")
            line = m.group(1) + PGTLE_ONLY + m.group(2)
        kept.append(line)
    return "\n".join(kept)


def build(native_path, sources):
    """The edition's objects: the native install script with its C functions replaced (the
    extension-only lines commented out, as in the plain script)."""
    pool, fns = portable_functions(sources)
    text = read(native_path)
    replaced = [m.group(1) for m in C_FUNCTION.finditer(text)]
    missing = [n for n in replaced if n not in fns]
    if missing:
        fail("no portable body for the LANGUAGE c function(s) " + ", ".join(missing)
             + " of sql/idempotency.sql: write one in sql/portable/")
    for name in re.findall(r"^CREATE FUNCTION idempotency\.(\w+)\(", text, re.M):
        if name not in replaced and name in fns:
            fail(f"sql/portable/ defines {name}, which sql/idempotency.sql defines in SQL or PL/pgSQL already")

    state = {"first": True}

    def replace(m):
        out = ""
        if state["first"]:
            state["first"] = False
            out += "-- The portable edition's helpers (sql/portable/*.sql) ------------------------------------\n\n"
            for name, chunk in pool:
                if name is None or name not in replaced:
                    out += chunk.lstrip("\n") + "\n"
            out += "-- End of the portable edition's helpers ----------------------------------------------------\n\n"
        body = fns[m.group(1)]
        if re.search(r"^BODY idempotency\.", body, re.M):
            body = compose(m.group(1), m.group(0), body, "sql/portable/")
        return out + body.lstrip("\n")

    text = C_FUNCTION.sub(replace, text)
    notice = re.compile(r"^DO \$notice\$\n.*?^\$notice\$;\n", re.M | re.S)
    if len(notice.findall(text)) != 1:
        fail("sql/idempotency.sql: expected one DO $notice$ block (the library's notice) to replace")
    text = notice.sub(lambda _: NOTICE, text)
    text = extension_lines(text, "the edition's objects")
    left = re.search(r"MODULE_PATHNAME|^LANGUAGE c\b|\$libdir", text, re.M)
    if left:
        fail(f"the portable script still holds {left.group(0)!r}: a C function of sql/idempotency.sql is not replaced")
    return text


def header(v, what, extra=""):
    return f"""-- idempotency {v}, portable edition: {what}
--
-- Generated by scripts/portable.py from sql/portable/*.sql and sql/idempotency.sql: do not
-- edit; change the sources and run scripts/portable.py.
--
-- The portable edition is written only in SQL and PL/pgSQL, for managed PostgreSQL services
-- where no shared library can be loaded (docs/managed.md): the native edition's install script
-- (sql/idempotency.sql) with each LANGUAGE c function replaced by a PL/pgSQL body of the same
-- declaration.{extra}
"""


PLAIN_PROLOGUE = """
BEGIN;

-- Names in this script resolve in pg_catalog first, whatever the session's search_path.
SET LOCAL search_path = pg_catalog, pg_temp;
"""

# The plain script refuses a database where the native extension exists (its functions would
# be replaced by the script's), before anything is created (the encoding check follows, in the
# same transaction).
REFUSE_EXTENSION = """
DO $portable$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'idempotency') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'duplicate_object',
            MESSAGE = 'extension "idempotency" is installed in this database',
            HINT = 'the portable plain script is for databases without the extension';
    END IF;
END
$portable$;

CREATE SCHEMA idempotency;
"""


def plain(v, body):
    return (header(v, f"plain script (psql -v ON_ERROR_STOP=1 -f {PLAIN_NAME})")
            + PLAIN_PROLOGUE + REFUSE_EXTENSION
            + f"COMMENT ON SCHEMA idempotency IS '{schema_comment(v)}';\n"
            + "\n" + BEGIN_MARK + "\n" + body.rstrip("\n") + "\n" + END_MARK + "\n"
            + "\nCOMMIT;\n")


# --- pg_tle, from a plain script ------------------------------------------------------------

def objects_of(plain_text, what):
    """The lines between the marker lines of a plain script, with the extension-only lines put
    back."""
    lines = plain_text.split("\n")
    if lines.count(BEGIN_MARK) != 1 or lines.count(END_MARK) != 1:
        fail(f"{what}: not a plain script of this generator (no marker lines)")
    body = lines[lines.index(BEGIN_MARK) + 1:lines.index(END_MARK)]
    body = [re.sub(r"^(\s*)" + re.escape(PGTLE_ONLY), r"\1", line) for line in body]
    text = "\n".join(body) + "\n"
    if "$_pgtle_$" in text:
        fail(f"{what}: the script contains $_pgtle_$, which quotes it for pg_tle")
    return text


def plain_version(plain_text, what):
    m = re.match(r"-- idempotency (\d+\.\d+\.\d+)(?: -> (\d+\.\d+\.\d+))?, portable edition", plain_text)
    if not m:
        fail(f"{what}: no version in its first line")
    return m.groups()


def pgtle(plain_text, what):
    v, to = plain_version(plain_text, what)
    if to:
        fail(f"{what}: an update script; use pgtle-update")
    return (header(v, "pg_tle (run this, then CREATE EXTENSION idempotency)",
                   f"\n--\n-- Made by scripts/portable.py pgtle from the plain script {PLAIN_NAME} of the same release.")
            + f"""
SELECT pgtle.install_extension(
    'idempotency',
    '{v}',
    '{description()}',
$_pgtle_$
""" + objects_of(plain_text, what) + """$_pgtle_$,
    NULL,
    'idempotency'
);
""")


def pgtle_update(plain_text, what):
    old, new = plain_version(plain_text, what)
    if not new:
        fail(f"{what}: an install script; use pgtle")
    return (header(f"{old} -> {new}",
                   "pg_tle update (run this, then ALTER EXTENSION idempotency UPDATE)",
                   f"\n--\n-- Made by scripts/portable.py pgtle-update from the plain update script of the same\n"
                   f"-- releases. It registers the update path {old} -> {new} and makes {new} the version\n"
                   f"-- CREATE EXTENSION and ALTER EXTENSION ... UPDATE go to; the store is changed by\n"
                   f"-- ALTER EXTENSION idempotency UPDATE, in each database that has the extension.")
            + f"""
SELECT pgtle.install_update_path(
    'idempotency',
    '{old}',
    '{new}',
$_pgtle_$
""" + objects_of(plain_text, what) + f"""$_pgtle_$
);

SELECT pgtle.set_default_version('idempotency', '{new}');
""")


# --- the update -----------------------------------------------------------------------------

def previous_release(v):
    found = []
    for f in os.listdir(RELEASES):
        m = re.match(r"^idempotency-portable--(\d+\.\d+\.\d+)\.sql$", f)
        if m and vkey(m.group(1)) < vkey(v):
            found.append(m.group(1))
    if not found:
        fail(f"no earlier release in {RELEASES}")
    return max(found, key=vkey)


def acl_statement(chunk):
    """A statement of the install that sets the privileges of functions (run again when the
    update creates a function)."""
    s = strip_comments(chunk)
    if re.match(r"^(GRANT|REVOKE) ", s) and " ON FUNCTION " in re.sub(r"\s+", " ", s):
        return True
    if s.startswith("DO $") and re.search(r"\b(REVOKE|GRANT) EXECUTE ON FUNCTION\b", s) \
            and not re.search(r"\b(CREATE|ALTER|DROP|INSERT|UPDATE|DELETE|TRUNCATE|COMMENT)\b", s):
        return True
    return False


def update_body(old_plain, old_path, new_body, native_upgrade, native_upgrade_path, sources):
    """The statements that take a store of the previous release to this one."""
    old_fns, old_others = functions(old_plain, old_path)
    new_fns, new_others = functions(new_body, "the new install")
    _, portable = portable_functions(sources)

    # Statements of the portable sources (not functions) cannot be changed by the native upgrade
    # script: a change of one, but for grants and comments on functions, is refused here.
    portable_statements = {strip_comments(c) for p in sources for n, c in chunks(read(p), p) if n is None}
    old_statements = {strip_comments(c) for c in old_others}
    for c in new_others:
        s = strip_comments(c)
        if s in portable_statements and s not in old_statements and not acl_statement(c) \
                and not s.startswith("COMMENT ON FUNCTION"):
            fail("a statement of sql/portable/ changed since the previous release, which the update "
                 f"cannot make from the sources: {s[:200]}")

    out = []
    # 1. Functions a fresh install no longer has, or whose result changed: dropped (here,
    # unless the native upgrade script drops them itself, in its own order: after pointing a
    # view that uses one elsewhere, say).
    dropped = set()
    for sig, (name, chunk) in old_fns.items():
        if sig not in new_fns or result(strip_comments(chunk)) != result(strip_comments(new_fns[sig][1])):
            if not re.search(rf"^DROP FUNCTION idempotency\.{name}\(", native_upgrade, re.M):
                out.append(drop_statement(strip_comments(chunk)))
            dropped.add(sig)
    if out:
        out.insert(0, "-- Functions of the previous release that this one does not have (or declares otherwise).\n")
        out.append("\n")

    # 2. The native upgrade script, its C functions replaced by the portable bodies.
    text = native_upgrade
    text = re.sub(r"^\\echo .*\n", "", text, flags=re.M)

    def replace(m):
        if m.group(1) not in portable:
            fail(f"{native_upgrade_path}: no portable body for the LANGUAGE c function {m.group(1)}")
        # The function as the portable install declares it: the native declaration, the body.
        fn = next((c for n, c in new_fns.values() if n == m.group(1)), portable[m.group(1)])
        fn = strip_comments(fn)
        return re.sub(r"^CREATE FUNCTION ", "CREATE OR REPLACE FUNCTION ", fn)

    text = C_FUNCTION.sub(replace, text)
    text = extension_lines(text, native_upgrade_path)
    statements = [c for _, c in chunks(text, native_upgrade_path) if strip_comments(c).strip()]
    if statements:
        out.append(f"-- The native upgrade script ({os.path.relpath(native_upgrade_path, ROOT)}).\n\n")
        out.extend(c.strip("\n") + "\n" for c in statements)
        out.append("\n")

    # 3. Every function whose definition differs from the previous release's, as a fresh
    # install defines it, in the install's order.
    created = False
    changed = []
    for sig, (name, chunk) in new_fns.items():
        body = strip_comments(chunk)
        if sig in old_fns and sig not in dropped and strip_comments(old_fns[sig][1]) == body:
            continue
        if sig not in old_fns or sig in dropped:
            created = True
        changed.append(re.sub(r"^CREATE FUNCTION ", "CREATE OR REPLACE FUNCTION ", body, flags=re.M, count=1))
    if changed:
        out.append("-- The functions whose definition changed, or that are new, as a fresh install creates them.\n\n")
        out.extend(c + "\n" for c in changed)

    # 4. A function created afresh gets the install's privileges: its grants and revokes again
    # (each leaves the functions it names as a fresh install does), and its comments.
    if created:
        acl = [strip_comments(c) for c in new_others if acl_statement(c)]
        comments = [strip_comments(c) for c in new_others
                    if strip_comments(c).startswith("COMMENT ON FUNCTION") and strip_comments(c) not in old_statements]
        if acl or comments:
            out.append("-- The install's privileges of functions, again, for the functions created above.\n\n")
            out.extend(s for s in acl + comments)
    return "".join(out)


def recognise(old, new, old_plain, old_path):
    """The plain update refuses a database that does not hold the portable plain install of the
    previous release, before it changes anything."""
    old_fns, _ = functions(old_plain, old_path)
    names = sorted({name for name, _ in old_fns.values()})
    recorded = re.search(r"^COMMENT ON SCHEMA idempotency IS '(.*)';$", old_plain, re.M)
    recorded = recorded.group(1) if recorded else None
    expect_comment = ("pg_catalog.obj_description('idempotency'::pg_catalog.regnamespace, 'pg_namespace') IS NULL"
                      if recorded is None else
                      "pg_catalog.obj_description('idempotency'::pg_catalog.regnamespace, 'pg_namespace') "
                      f"OPERATOR(pg_catalog.=) '{recorded}'")
    name_list = ", ".join(f"'{n}'" for n in names)
    return f"""
DO $portable$
DECLARE
    v_recorded text;
    v_names    text[];
    v_count    integer;
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'idempotency') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = 'extension "idempotency" is installed in this database',
            HINT = 'this script updates the portable plain script; update an extension with ALTER EXTENSION idempotency UPDATE';
    END IF;
    IF pg_catalog.to_regnamespace('idempotency') IS NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = 'schema "idempotency" does not exist',
            HINT = 'install the edition with {PLAIN_NAME}';
    END IF;
    v_recorded := pg_catalog.obj_description('idempotency'::pg_catalog.regnamespace, 'pg_namespace');
    IF v_recorded OPERATOR(pg_catalog.=) '{schema_comment(new)}' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = 'the portable edition in this database is {new} already';
    END IF;
    SELECT pg_catalog.array_agg(DISTINCT p.proname::text ORDER BY p.proname::text), pg_catalog.count(*)
      INTO v_names, v_count
      FROM pg_catalog.pg_proc AS p
     WHERE p.pronamespace OPERATOR(pg_catalog.=) 'idempotency'::pg_catalog.regnamespace
       AND p.prolang OPERATOR(pg_catalog.=) ANY (SELECT l.oid FROM pg_catalog.pg_language AS l
                                                  WHERE l.lanname OPERATOR(pg_catalog.=) ANY ('{{sql,plpgsql}}'));
    IF NOT ({expect_comment})
       OR v_names IS NULL
       OR NOT (v_names OPERATOR(pg_catalog.=) ARRAY[{name_list}]::text[])
       OR v_count OPERATOR(pg_catalog.<>) {len(old_fns)}
       OR EXISTS (SELECT FROM pg_catalog.pg_proc AS p
                   WHERE p.pronamespace OPERATOR(pg_catalog.=) 'idempotency'::pg_catalog.regnamespace
                     AND p.prolang OPERATOR(pg_catalog.<>) ALL (SELECT l.oid FROM pg_catalog.pg_language AS l
                                                                 WHERE l.lanname OPERATOR(pg_catalog.=) ANY ('{{sql,plpgsql}}'))) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = 'schema "idempotency" does not hold the portable edition {old}',
            DETAIL = pg_catalog.format('recorded release: %s; functions: %s', coalesce(v_recorded, 'none'), v_count),
            HINT = 'this script updates the portable plain script of release {old} only';
    END IF;
END
$portable$;
"""


def update(old, new, old_plain, old_path, new_body):
    native_path = os.path.join(ROOT, "sql", f"idempotency--{old}--{new}.sql")
    if not os.path.exists(native_path):
        fail(f"no native upgrade script {os.path.relpath(native_path, ROOT)}")
    body = update_body(old_plain, old_path, new_body, read(native_path), native_path, SOURCES)
    name = f"idempotency-portable--{old}--{new}.sql"
    return (header(f"{old} -> {new}", f"plain update script (psql -v ON_ERROR_STOP=1 -f {name})",
                   f"\n--\n-- Takes a database where {PLAIN_NAME} of release {old} was run to release {new},\n"
                   "-- with its keys, in one transaction; refuses any other database before it changes\n"
                   "-- anything. It replaces functions (no lock on the store's tables: a call in flight\n"
                   "-- finishes with the function it began with, the next runs the new one).")
            + PLAIN_PROLOGUE
            + "-- Waits for no lock longer than this: a store kept busy by DDL of its own is left as it was.\n"
            + "SET LOCAL lock_timeout = '10s';\n"
            + recognise(old, new, old_plain, old_path)
            + "\n" + BEGIN_MARK + "\n" + body.rstrip("\n") + "\n" + END_MARK + "\n"
            + f"\nCOMMENT ON SCHEMA idempotency IS '{schema_comment(new)}';\n"
            + "\nCOMMIT;\n")


# --- main -----------------------------------------------------------------------------------

def outputs():
    """{file name in dist/: text}."""
    v = version()
    body = build(NATIVE, SOURCES)
    files = {PLAIN_NAME: plain(v, body)}
    old = previous_release(v)
    old_path = os.path.join(RELEASES, f"idempotency-portable--{old}.sql")
    files[f"idempotency-portable--{old}--{v}.sql"] = update(old, v, read(old_path), old_path, body)
    for name, text in files.items():
        try:
            text.encode("ascii")
        except UnicodeEncodeError as e:
            fail(f"{name} would not be ASCII: {e}")
    return files


def update_name():
    v = version()
    return f"idempotency-portable--{previous_release(v)}--{v}.sql"


def main(argv):
    cmd = argv[0] if argv else ""
    if cmd in ("", "--check"):
        files = outputs()
        present = {f for f in os.listdir(DIST) if f.endswith(".sql")} if os.path.isdir(DIST) else set()
        if cmd == "--check":
            stale = False
            for name, text in files.items():
                path = os.path.join(DIST, name)
                if not os.path.exists(path) or read(path) != text:
                    sys.stderr.write(f"portable.py: dist/{name} is not current: run scripts/portable.py and commit dist/\n")
                    stale = True
            for name in sorted(present - set(files)):
                sys.stderr.write(f"portable.py: dist/{name} is not made by scripts/portable.py: remove it\n")
                stale = True
            return 1 if stale else 0
        os.makedirs(DIST, exist_ok=True)
        for name in sorted(present - set(files)):
            os.remove(os.path.join(DIST, name))
        for name, text in files.items():
            with open(os.path.join(DIST, name), "w", encoding="utf-8") as f:
                f.write(text)
        print(f"portable.py: wrote {', '.join('dist/' + n for n in files)} ({version()})")
        return 0
    if cmd == "plain" and len(argv) == 1:
        sys.stdout.write(outputs()[PLAIN_NAME])
    elif cmd == "update" and len(argv) == 1:
        sys.stdout.write(outputs()[update_name()])
    elif cmd == "pgtle" and len(argv) <= 2:
        path = argv[1] if len(argv) == 2 else os.path.join(DIST, PLAIN_NAME)
        sys.stdout.write(pgtle(read(path), path))
    elif cmd == "pgtle-update" and len(argv) <= 2:
        path = argv[1] if len(argv) == 2 else os.path.join(DIST, update_name())
        sys.stdout.write(pgtle_update(read(path), path))
    elif cmd == "build" and len(argv) >= 3 and argv[1] in ("plain", "pgtle"):
        text = build(argv[2], argv[3:])
        if argv[1] == "pgtle":
            text = "\n".join(re.sub(r"^(\s*)" + re.escape(PGTLE_ONLY), r"\1", l) for l in text.split("\n"))
        sys.stdout.write(text)
    elif cmd in ("-h", "--help") and len(argv) == 1:
        sys.stdout.write(__doc__)
    else:
        sys.stderr.write(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
