#!/usr/bin/env python3
"""The body of the portable edition's scripts (run by scripts/portable.sh, written to stdout):

    scripts/portable-build.py MODE sql/idempotency.sql sql/portable/*.sql     MODE: pgtle | plain

sql/idempotency.sql, the native install script, with each LANGUAGE c function replaced by the
function of the same name in the portable sources (their other functions and statements, the
helpers, go just before the first replaced function) and the library's notice replaced by this
edition's. Fails when a C function has no portable body, when a portable function would replace
one that is not C, or when anything of the library is left. In the plain script (not run by
CREATE EXTENSION) the pg_extension_config_dump calls are left out."""

import re
import sys


def fail(msg):
    sys.stderr.write(f"portable.sh: {msg}\n")
    sys.exit(1)


def chunks(path):
    """(name, text) for each function (with the comment lines before it, up to its line
    "$fn$;"), (None, text) for each other statement."""
    lines = open(path, encoding="utf-8").read().split("\n")
    out, pending, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^CREATE FUNCTION idempotency\.(\w+)\(", line)
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
        elif line.startswith("--") or line.strip() == "":
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


def main():
    mode, native, sources = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode not in ("pgtle", "plain"):
        fail(f"unknown mode {mode}")
    pool = []
    functions = {}
    for path in sources:
        for name, text in chunks(path):
            if name is not None:
                if name in functions:
                    fail(f"{path}: function {name} is defined twice in sql/portable/")
                functions[name] = text
            pool.append((name, text))

    text = open(native, encoding="utf-8").read()
    c_function = re.compile(
        r"^CREATE FUNCTION idempotency\.(\w+)\((?:(?!^CREATE |^\$fn\$;$).)*?"
        r"^AS 'MODULE_PATHNAME', '\w+';\n", re.M | re.S)
    replaced = [m.group(1) for m in c_function.finditer(text)]
    missing = [n for n in replaced if n not in functions]
    if missing:
        fail("no portable body for the LANGUAGE c function(s) " + ", ".join(missing)
             + " of sql/idempotency.sql: write one in sql/portable/")
    for name in re.findall(r"^CREATE FUNCTION idempotency\.(\w+)\(", text, re.M):
        if name not in replaced and name in functions:
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
        return out + functions[m.group(1)].lstrip("\n")

    text = c_function.sub(replace, text)

    notice = re.compile(r"^DO \$notice\$\n.*?^\$notice\$;\n", re.M | re.S)
    if len(notice.findall(text)) != 1:
        fail("sql/idempotency.sql: expected one DO $notice$ block (the library's notice) to replace")
    text = notice.sub(lambda _: NOTICE, text)

    if mode == "plain":
        kept = []
        for line in text.split("\n"):
            if "pg_extension_config_dump" in line:
                if not re.match(r"^\s*(SELECT|PERFORM) pg_catalog\.pg_extension_config_dump\(.*\);$", line):
                    fail("sql/idempotency.sql: a pg_extension_config_dump call that is not a statement of its own line")
                continue
            kept.append(line)
        text = "\n".join(kept)

    left = re.search(r"MODULE_PATHNAME|^LANGUAGE c\b|\$libdir", text, re.M)
    if left:
        fail(f"the portable script still holds {left.group(0)!r}: a C function of sql/idempotency.sql is not replaced")
    sys.stdout.write(text)


main()
