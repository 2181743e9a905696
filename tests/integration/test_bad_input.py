"""Bad input against every function of schema idempotency.

The functions are read from pg_catalog.pg_proc, so functions added later are swept too. Each
argument of each function (internal `_` ones included) is given, one at a time and with the
others at sane values, every value of a list for its type: NULL, empty, huge (1 MB and 10 MB),
quotes, backslashes, control characters, non-ASCII and emoji, JSON with escapes, surrogates,
deep nesting and huge numbers, extreme intervals, timestamps and integers, and text of the
wrong shape cast to the argument's type. Every call runs in its own transaction and must either
succeed with a sane result or fail with a documented SQLSTATE (class 22, 54001, IK00x;
22004/22023 messages name the argument), never crash the backend (the connection answers after
every call, the server log has no "terminated by signal"), and a failed call must leave the
table and the shared-memory counters exactly as they were.

BAD_INPUT_HUGE=1 adds 100 MB values (a few calls, a few GB of memory in the server).
"""

import json
import os
import re
from collections import Counter, defaultdict

import psycopg
import pytest

from cluster import EDITION, Cluster
from helpers import claim

HUGE = os.environ.get("BAD_INPUT_HUGE") == "1"
ERRORS_DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "errors.md")


def documented_sqlstates():
    """The SQLSTATEs of the table in docs/errors.md, plus class 22 (data exceptions) and 54001."""
    codes = {"54001"}
    with open(ERRORS_DOC, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^\| `([0-9A-Z]{5})` \|", line)
            if m:
                codes.add(m.group(1))
    assert {"IK001", "IK002", "IK003", "IK004", "42501", "55000"} <= codes, f"no SQLSTATE table in {ERRORS_DOC}"
    return codes


DOCUMENTED = documented_sqlstates()


def allowed(state):
    return state.startswith("22") or state in DOCUMENTED or re.fullmatch(r"IK00[0-9]", state)
COUNTERS = ("claims_new", "claims_replay", "claims_in_progress", "claims_mismatch",
            "completions", "releases", "rows_swept")

# Baseline (valid) values by argument name, then by type.
BASE_BY_NAME = {
    "key": "'bk'", "p_key": "'bk'", "scope": "'bs'", "p_scope": "'bs'",
    "method": "'POST'", "path": "'/orders'", "numbers": "'exact'", "job": "'nightly'",
    "parent": "'order-1'", "step": "'charge'", "recovery_point": "'rp'", "event": "'release'",
    "p_action": "'complete'", "slot": "'1 day'", "lease": "'1 minute'", "ttl": "'1 hour'",
    "response_status": "201", "batch_size": "10", "token": "NULL", "p_token": "NULL",
    "mode": "'plain'", "kid": "1",
    "keys": "'{bk}'", "requests": "NULL", "responses": "ARRAY['{\"a\": 1}'::jsonb]",
    "response_statuses": "'{201}'", "tokens": "NULL",
    "signed": "idempotency.sign_key('bk')",
    "secret": "(SELECT secret FROM idempotency.signing_secrets ORDER BY id DESC LIMIT 1)",
}
BASE_BY_TYPE = {
    "text": "'x'", "jsonb": "'{\"a\": 1}'", "interval": "'1 hour'", "integer": "1",
    "bigint": "NULL", "timestamp with time zone": "'2026-11-30 12:34:56+00'",
    "text[]": "'{}'", "boolean": "true", "bytea": "'\\x0102'",
}

MB = 1 << 20
WRONG_SHAPE = [  # text that does not fit the type: PostgreSQL's input function refuses it
    ("wrong shape 'abc'", "'abc'"), ("wrong shape '1.5.2'", "'1.5.2'"), ("wrong shape '{'", "'{'"),
]
TEXT = [
    ("NULL", "NULL"), ("empty", "''"), ("space", "' '"), ("255 chars", "repeat('k', 255)"),
    ("256 chars", "repeat('k', 256)"), ("1 MB", f"repeat('x', {MB})"), ("10 MB", f"repeat('x', {10 * MB})"),
    ("quotes", "$q$it's \"dq\" ''$q$"), ("backslashes", "E'back\\\\slash \\\\u0000 \\\\x00'"),
    ("control chars", "E'a\\x01b\\x1fc\\td\\ne\\rf\\x7f'"), ("non-ASCII", "'ünïcødé € ß'"),
    ("emoji", "'😀🏳️‍🌈👍🏽'"), ("colon", "'a:b'"), ("slash", "'/'"), ("tilde pointer", "'~'"),
    ("JSON text", "'{\"a\": [1, 2]}'"), ("lone surrogate escape", "'\\ud800'"),
    ("percent format", "'%s %L %I'"), ("SQL injection", "$q$'; DROP TABLE idempotency.idempotency_keys; --$q$"),
    ("method lower", "'get'"), ("method with space", "'P OST'"), ("mode upper", "'EXACT'"),
    ("mode rfc8785", "'rfc8785'"), ("chr(0)", "chr(0)"), ("E'\\\\x00' escape", "E'\\x00'"),
    ("invalid UTF-8 bytes", "convert_from('\\xc3'::bytea, 'UTF8')"),
]
JSONB = [
    ("NULL", "NULL"), ("empty object", "'{}'"), ("empty array", "'[]'"), ("null", "'null'"),
    ("string", "'\"s\"'"), ("number", "'1'"), ("negative zero", "'-0'"),
    ("escapes", "$j${\"q\": \"it's \\\"dq\\\" \\\\ \\/ \\b\\f\\n\\r\\t \\u0001\\u001f\"}$j$"),
    ("non-ASCII and emoji", "'{\"ü€\": \"😀\", \"\\ud83d\\ude00\": \"\\ufb33\"}'"),
    ("escaped NUL", "'\"\\u0000\"'"), ("lone high surrogate", "'\"\\ud800\"'"),
    ("lone low surrogate", "'\"\\udc00\"'"),
    ("huge numbers", "'[1e400, -1e-400, 123456789012345678901234567890.123456789, 1e131071]'"),
    ("double edges", "'[5e-324, 1.7976931348623157e308, 1.7976931348623159e308, 9007199254740993]'"),
    ("1000 levels", "(repeat('[', 1000) || '1' || repeat(']', 1000))"),
    ("1001 levels", "(repeat('[', 1001) || '1' || repeat(']', 1001))"),
    ("5000 levels", "(repeat('{\"a\":', 5000) || '1' || repeat('}', 5000))"),
    ("100000 levels", "(repeat('[', 100000) || repeat(']', 100000))"),
    ("1 MB string", f"jsonb_build_object('s', repeat('x', {MB}))"),
    ("10 MB string", f"jsonb_build_object('s', repeat('é', {5 * MB}))"),
    ("100k members", "(SELECT jsonb_object_agg('k' || i, i) FROM generate_series(1, 100000) i)"),
    ("100k elements", "(SELECT jsonb_agg(i * 1.5) FROM generate_series(1, 100000) i)"),
    ("duplicate names", "'{\"a\": 1, \"a\": 2}'"), ("array query", "'[1]'"),
    ("invalid JSON", "'{\"a\":'"), ("trailing garbage", "'{} x'"),
]
INTERVAL = [
    ("NULL", "NULL"), ("zero", "'0'"), ("negative", "'-1 second'"), ("1 microsecond", "'1 microsecond'"),
    ("1 second", "'1 second'"), ("1 month", "'1 month'"), ("3 months", "'3 months'"),
    ("month and day", "'1 month 1 day'"), ("1 mon -30 days", "'1 mon -30 days'"),
    ("1 day -86400 s", "'1 day -86400 seconds'"), ("10 years", "'10 years'"),
    ("10 years 1 second", "'10 years 1 second'"), ("178000000 years", "'178000000 years'"),
    ("-178000000 years", "'-178000000 years'"), ("max days", "'2147483647 days'"),
    ("min months", "'-2147483648 months'"), ("max microseconds", "'2562047788:00:54.775807'"),
    ("'infinity'", "'infinity'"),
]
TIMESTAMPTZ = [
    ("NULL", "NULL"), ("now", "now()"), ("infinity", "'infinity'"), ("-infinity", "'-infinity'"),
    ("294276-12-31", "'294276-12-31 23:59:59.999999+00'"), ("294277", "'294277-01-01 00:00:00+00'"),
    ("4713 BC", "'4713-01-01 00:00:00+00 BC'"), ("epoch", "'epoch'"),
    ("+14:00 zone", "'2000-02-29 12:00:00+14'"), ("leap second", "'2016-12-31 23:59:60+00'"),
]
INTEGER = [("NULL", "NULL")] + [(str(v), str(v)) for v in
                                (0, -1, 1, 99, 100, 599, 600, 2147483647, -2147483648)] + [
    ("2^31", "2147483648")]
BIGINT = [("NULL", "NULL")] + [(str(v), str(v)) for v in
                               (0, -1, 1, 9223372036854775807, -9223372036854775808)] + [
    ("2^63", "9223372036854775808")]
TEXT_ARRAY = [
    ("NULL", "NULL"), ("empty", "'{}'"), ("NULL element", "'{NULL}'"), ("empty element", "'{\"\"}'"),
    ("root pointer", "'{/}'"), ("name", "'{a}'"), ("bad tilde", "'{/a~2}'"), ("trailing tilde", "'{/a~}'"),
    ("escaped pointer", "'{/a~1b/0,/a~0b}'"), ("array index 01", "'{/01}'"),
    ("10000 entries", "(SELECT array_agg('/k' || i) FROM generate_series(1, 10000) i)"),
    ("1 MB entry", f"ARRAY[repeat('x', {MB})]"), ("2-D array", "'{{a},{b}}'"),
    ("non-ASCII", "'{/ü€/😀}'"),
]
BOOLEAN = [("NULL", "NULL"), ("true", "true"), ("false", "false")]
JSONB_ARRAY = [
    ("NULL", "NULL"), ("empty", "'{}'"), ("NULL element", "'{NULL}'"),
    ("one", "ARRAY['{\"a\": 1}'::jsonb]"), ("two", "ARRAY['{}'::jsonb, '[]']"),
    ("2-D array", "ARRAY[ARRAY['{}'::jsonb]]"),
    ("1001 levels deep", "ARRAY[(repeat('[', 1001) || repeat(']', 1001))::jsonb]"),
]
INTEGER_ARRAY = [
    ("NULL", "NULL"), ("empty", "'{}'"), ("NULL element", "'{NULL}'"), ("one", "'{200}'"),
    ("out of range", "'{99}'"), ("two", "'{200,201}'"), ("2-D array", "'{{200}}'"),
]
BIGINT_ARRAY = [
    ("NULL", "NULL"), ("empty", "'{}'"), ("NULL element", "'{NULL}'"), ("one", "'{1}'"),
    ("two", "'{1,2}'"), ("2-D array", "'{{1}}'"),
]
BYTEA = [
    ("NULL", "NULL"), ("empty", "'\\x'"), ("one zero byte", "'\\x00'"), ("32 bytes", "decode(repeat('ab', 32), 'hex')"),
    ("1 MB", f"decode(repeat('00', {MB}), 'hex')"), ("10 MB", f"decode(repeat('ff', {10 * MB}), 'hex')"),
    ("invalid UTF-8", "'\\xc328'"),
]
VALUES = {
    "text": TEXT, "jsonb": JSONB, "interval": INTERVAL, "timestamp with time zone": TIMESTAMPTZ,
    "integer": INTEGER, "bigint": BIGINT, "text[]": TEXT_ARRAY, "boolean": BOOLEAN, "bytea": BYTEA,
    "jsonb[]": JSONB_ARRAY, "integer[]": INTEGER_ARRAY, "bigint[]": BIGINT_ARRAY,
}
if HUGE:
    TEXT.append(("100 MB", f"repeat('x', {100 * MB})"))
    JSONB.append(("100 MB string", f"jsonb_build_object('s', repeat('x', {100 * MB}))"))

# Functions whose arguments are checked by other functions that name them differently.
INTERNAL_PREFIX = "_"


@pytest.fixture(scope="module")
def swept_cluster():
    c = Cluster(settings={
        "shared_preload_libraries": "'idempotency'",
        "idempotency.sweep_interval": "'1h'",  # the sweeper must not delete rows mid-check
        "log_min_messages": "warning",
    }).start()
    with psycopg.connect(c.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION idempotency")
    yield c
    c.destroy()


def functions(conn):
    rows = conn.execute(
        """SELECT p.proname, p.oid::regprocedure::text,
                  coalesce(p.proargnames, '{}'), coalesce(p.proargmodes::text[], '{}'),
                  ARRAY(SELECT format_type(t, NULL) FROM unnest(p.proargtypes) AS t),
                  p.proretset
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
            WHERE n.nspname = 'idempotency' AND p.prokind = 'f'
            ORDER BY p.proname, p.oid"""
    ).fetchall()
    out = []
    for name, signature, argnames, argmodes, types, retset in rows:
        if EDITION == "portable" and name.startswith("_p_"):
            # The portable edition's helpers: executable by no caller (only by the functions
            # above them, which run as the owner and check every argument first).
            continue
        if argmodes:
            in_names = [n for n, m in zip(argnames, argmodes) if m in ("i", "b", "v")]
        else:
            in_names = list(argnames[:len(types)])
        in_names += [f"${i + 1}" for i in range(len(in_names), len(types))]
        out.append((name, signature, in_names, types, retset))
    return out


def snapshot(conn):
    """The table's rows and the counters, to compare around a failed call."""
    rows = conn.execute(
        "SELECT count(*), md5(coalesce(string_agg(k::text, E'\\n' ORDER BY scope, key), ''))"
        " FROM idempotency.idempotency_keys k").fetchone()
    counters = conn.execute(f"SELECT {', '.join(COUNTERS)} FROM idempotency.stats").fetchone()
    return rows, counters


def reset(conn):
    conn.execute("DELETE FROM idempotency.idempotency_keys")
    conn.execute("SELECT idempotency.claim('bk', scope => 'bs', ttl => '1 hour', lease => '1 hour')")


def sane(name, result, args):
    """A plausibility check of a successful call's result (text form). Returns a complaint or None."""
    if name == "canonical_json" and result is not None:
        try:
            json.loads(result)
        except RecursionError:
            pass  # deeper than Python's json module goes (the 1000-level document)
        except ValueError as exc:
            return f"canonical_json returned invalid JSON: {exc}"
    if name in ("canonical_hash", "request_fingerprint") and result is not None:
        if not re.fullmatch(r"\\x[0-9a-f]{64}", result):
            return f"{name} returned {result[:80]!r}, not a SHA-256"
    if name in ("derive_key", "cron_key") and result is not None and len(result) > 255:
        return f"{name} returned {len(result)} characters"
    if name == "claim" and result is not None:
        if not re.match(r"^\((new|replay|in_progress|mismatch),", result):
            return f"claim returned {result[:120]!r}"
    return None


def call_sql(name, types, exprs):
    args = ", ".join(f"({e})::{t}" for e, t in zip(exprs, types))
    return f"SELECT (idempotency.{name}({args}))::text"


class Sweep:
    def __init__(self, cluster):
        self.cluster = cluster
        self.conn = None
        self.outcomes = Counter()
        self.by_function = defaultdict(Counter)
        self.problems = []
        self.calls = 0
        self.input_errors = {}
        self.long_messages = []
        self.connect()

    def connect(self):
        self.conn = psycopg.connect(self.cluster.conninfo(), autocommit=True)
        self.conn.execute("SET statement_timeout = '120s'")
        self.conn.execute("SET client_min_messages = error")

    def alive(self):
        try:
            return self.conn.execute("SELECT 1").fetchone() == (1,)
        except psycopg.Error:
            return False

    def input_error(self, expr, type_):
        """The SQLSTATE with which PostgreSQL refuses the value itself (before any call), or None."""
        key = (expr, type_)
        if key not in self.input_errors:
            try:
                self.conn.execute(f"SELECT (({expr})::{type_}) IS NULL")
                self.input_errors[key] = None
            except psycopg.Error as exc:
                self.input_errors[key] = exc.sqlstate or "?"
        return self.input_errors[key]

    def call(self, fn, label, exprs, checked_arg):
        name, signature, argnames, types, _ = fn
        what = f"{signature} with {argnames[checked_arg] if checked_arg is not None else 'no argument'} = {label}"
        if checked_arg is not None:
            refused = self.input_error(exprs[checked_arg], types[checked_arg])
            if refused:
                self.outcomes[f"value refused by PostgreSQL ({refused})"] += 1
                self.by_function[name]["value refused by PostgreSQL"] += 1
                return
        reset(self.conn)
        before = snapshot(self.conn)
        self.calls += 1
        try:
            with self.conn.transaction():
                # set-returning functions (claim_many, complete_many) may return no row
                row = self.conn.execute(call_sql(name, types, exprs)).fetchone()
                result = row[0] if row else None
        except psycopg.Error as exc:
            state = exc.sqlstate or "?"
            message = exc.diag.message_primary or str(exc)
            self.outcomes[f"error {state}"] += 1
            self.by_function[name][f"error {state}"] += 1
            if len(message) > 4096:
                self.long_messages.append(f"{what}: {state}, {len(message)} characters")
                if not name.startswith(INTERNAL_PREFIX):
                    self.problems.append(f"message of {len(message)} characters from {what}")
            if exc.sqlstate is None or not self.alive():
                self.outcomes["connection lost"] += 1
                self.problems.append(f"CRASH: connection dead after {what}: {state} {message[:200]}")
                self.cluster.wait_ready(60)
                self.connect()
                return
            if state == "57014":
                self.problems.append(f"HANG: {what} ran over the statement timeout")
            elif not allowed(state):
                self.problems.append(f"undocumented SQLSTATE {state} from {what}: {message[:300]}")
            elif (state in ("22004", "22023") and checked_arg is not None
                  and not name.startswith(INTERNAL_PREFIX)):
                arg = argnames[checked_arg]
                if not re.search(rf"\b{re.escape(arg)}\b", message):
                    self.problems.append(f"message does not name {arg!r}: {what}: {state} {message[:300]}")
            after = snapshot(self.conn)
            if after != before:
                self.problems.append(f"WRITE ON FAILURE: {what}: {state}; before {before}, after {after}")
            return
        if not self.alive():
            self.problems.append(f"CRASH: connection dead after successful {what}")
            self.cluster.wait_ready(60)
            self.connect()
            return
        self.outcomes["success"] += 1
        self.by_function[name]["success"] += 1
        complaint = sane(name, result, exprs)
        if complaint:
            self.problems.append(f"insane result of {what}: {complaint}")


def test_every_function_every_argument(swept_cluster):
    sweep = Sweep(swept_cluster)
    fns = functions(sweep.conn)
    names = {f[0] for f in fns}
    # The sweep must see the public API (a broken catalog query would sweep nothing).
    assert {"claim", "complete", "checkpoint", "release", "forget", "lookup", "sweep",
            "canonical_json", "canonical_hash", "derive_key", "cron_key",
            "request_fingerprint"} <= names, names
    if "rotate_signing_secret" in names:
        sweep.conn.execute("SELECT idempotency.rotate_signing_secret()")  # sign_key needs one
    uncovered = []
    for fn in fns:
        name, signature, argnames, types, _ = fn
        base = [BASE_BY_NAME.get(a, BASE_BY_TYPE.get(t, "NULL")) for a, t in zip(argnames, types)]
        sweep.call(fn, "baseline", base, None)
        for i, t in enumerate(types):
            values = VALUES.get(t)
            if values is None:
                uncovered.append(f"{signature}: {argnames[i]} {t}")
                values = [("NULL", "NULL")]
            values = values + ([] if t == "text" else WRONG_SHAPE)
            for label, expr in values:
                exprs = list(base)
                exprs[i] = expr
                sweep.call(fn, label, exprs, i)
    log = swept_cluster.server_log()
    for marker in ("terminated by signal", "was terminated by", "PANIC:"):
        if marker in log:
            sweep.problems.append(f"server log has {marker!r}")
    print(f"\nbad-input sweep: {len(fns)} functions, {sweep.calls} calls made")
    for outcome, n in sorted(sweep.outcomes.items()):
        print(f"  {outcome}: {n}")
    for name in sorted(sweep.by_function):
        print(f"  {name}: {dict(sorted(sweep.by_function[name].items()))}")
    if uncovered:
        print("  argument types without a value list (called with NULL only):", uncovered)
    if sweep.long_messages:
        print(f"  error messages over 4 kB ({len(sweep.long_messages)}):")
        for m in sweep.long_messages:
            print(f"    {m}")
    assert sweep.alive()
    assert not sweep.problems, f"{len(sweep.problems)} problems:\n" + "\n".join(sweep.problems[:60])


ROUND_TRIP = [
    "it's", 'dq"x"', "back\\slash", "\\\\", "\\x00", "\\u0000", "tab\tnl\ncr\r", "\x01\x1f\x7f",
    "ünïcødé", "€", "😀", "🏳️‍🌈", "👍🏽", "\u200b", "\ufeff", "\u2028", "\ufb33", "A\u030a", "Å",
    " lead", "trail ", "%s %L", "'; DROP TABLE idempotency.idempotency_keys; --", "k" * 255,
    "é" * 255, "😀" * 255, "a:b:c", "{\"json\": 1}",
]


def test_keys_and_scopes_round_trip_byte_exact(connect):
    db = connect()
    for i, text in enumerate(ROUND_TRIP):
        for key, scope in ((text, f"s{i}"), (f"k{i}", text), (text, text)):
            with db.transaction():
                outcome, token = db.execute(
                    "SELECT outcome::text, token FROM idempotency.claim(%s, '{\"v\": 1}', scope => %s)",
                    (key, scope)).fetchone()
                assert outcome == "new", (key, scope)
                db.execute("SELECT idempotency.complete(%s, %s::jsonb, 201, scope => %s, token => %s)",
                           (key, json.dumps({"echo": text}), scope, token))
            row = db.execute(
                "SELECT key, scope, convert_to(key, 'UTF8'), convert_to(scope, 'UTF8'), response"
                "  FROM idempotency.lookup(%s, %s)", (key, scope)).fetchone()
            assert row is not None, (key, scope)
            assert row[0] == key and row[1] == scope
            assert bytes(row[2]) == key.encode() and bytes(row[3]) == scope.encode()
            assert row[4] == {"echo": text}
            replay = db.execute(
                "SELECT outcome::text, response FROM idempotency.claim(%s, '{\"v\": 1}', scope => %s)",
                (key, scope)).fetchone()
            assert replay == ("replay", {"echo": text})
            # A near miss is a different key: no normalization, no case folding, no trimming.
            near = key + " " if len(key) < 255 else key[:-1]
            other = db.execute("SELECT idempotency.lookup(%s, %s) IS NULL", (near, scope)).fetchone()
            assert other == (True,)
    n = db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone()[0]
    assert n == 3 * len(ROUND_TRIP)


def test_nul_in_keys_is_refused_without_a_trace(connect):
    db = connect()
    for sql, params in (
        ("SELECT idempotency.claim(chr(0))", None),
        ("SELECT idempotency.claim('a' || chr(0) || 'b', scope => 's')", None),
        ("SELECT idempotency.claim(E'\\x00')", None),
        ("SELECT idempotency.claim('k', scope => chr(0))", None),
        ("SELECT idempotency.claim('k', '\"\\u0000\"'::jsonb)", None),
    ):
        with pytest.raises(psycopg.Error) as exc:
            db.execute(sql, params)
        # 54000 (chr: null character not permitted), 22021 (invalid byte sequence), 22P05
        # (unsupported Unicode escape \u0000 in jsonb): PostgreSQL refuses the value itself.
        assert exc.value.sqlstate in ("54000", "22021", "22P05", "22P02"), (sql, exc.value.sqlstate)
        assert db.execute("SELECT 1").fetchone() == (1,)
    # psycopg refuses NUL in a text parameter before sending it.
    with pytest.raises(psycopg.DataError):
        db.execute("SELECT idempotency.claim(%s)", ("a\x00b",))
    assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys").fetchone() == (0,)


@pytest.mark.parametrize("call", [
    "idempotency.canonical_json('{}', repeat('x', 1048576))",
    "idempotency.set_key_storage(repeat('x', 1048576))",
    "idempotency._count(repeat('x', 1048576))",
])
def test_error_messages_quote_bad_values_abbreviated(connect, call):
    # Found by the sweep: these quoted a bad value whole (10 MB in, a 10 MB message and log line).
    db = connect()
    exists = db.execute("SELECT to_regproc(%s) IS NOT NULL",
                        (call.split("(")[0],)).fetchone()[0]
    if not exists:
        pytest.skip(f"{call.split('(')[0]} does not exist in this build")
    with pytest.raises(psycopg.Error) as exc:
        db.execute(f"SELECT {call}")
    assert exc.value.sqlstate == "22023"
    message = exc.value.diag.message_primary or ""
    assert len(message) < 4096, f"{len(message)} characters"


def refusal_of_a_setting(db, setting, value):
    """Sets `setting` to `value` and calls what reads it (a completion of a claimed key for the
    size limit, a claim of a new key otherwise): the error (natively the SET's, without the
    library the call's), after checking that nothing was written; the setting is reset."""
    db.execute("SELECT idempotency.canonical_json('{}')")  # loads the library: the setting is defined
    token = claim(db, "range-done", lease="1 minute")[1]
    with pytest.raises(psycopg.Error) as exc:
        db.execute(f"SET {setting} = '{value}'")
        if setting == "idempotency.max_response_size":
            db.execute("SELECT idempotency.complete('range-done', '{}', token => %s)", (token,))
        else:
            db.execute("SELECT idempotency.claim('range-new')")
    db.execute(f"RESET {setting}")
    assert db.execute("SELECT key, status::text FROM idempotency.idempotency_keys ORDER BY key").fetchall() == \
        [("range-done", "in_progress")]
    return exc.value


@pytest.mark.parametrize("setting,value", [("idempotency.default_ttl", "99999999999"),
                                           ("idempotency.default_lease", "99999999999d"),
                                           ("idempotency.max_response_size", "9999999999kB")])
def test_an_integer_setting_beyond_its_range_is_refused_naming_it(connect, setting, value):
    """Natively the SET is refused; without the library (a placeholder) the call that reads the
    setting is, naming it, with 22023 (not a bare 22003 "integer out of range"), and changes
    nothing."""
    error = refusal_of_a_setting(connect(), setting, value)
    assert error.sqlstate == "22023", (error.sqlstate, str(error))
    assert setting in str(error), str(error)


@pytest.mark.parametrize("setting,value,number,unit,low,high", [
    ("idempotency.default_ttl", "3652d", 315532800, "s", 1, 315446400),
    ("idempotency.default_lease", "-1", -1, "s", 1, 315446400),
    ("idempotency.max_response_size", "0", 0, "kB", 1, 1048576),
    ("idempotency.max_response_size", "2GB", 2097152, "kB", 1, 1048576),
])
def test_a_setting_outside_its_native_range_is_refused_with_postgresqls_message(
        connect, setting, value, number, unit, low, high):
    """A value within an integer's range but outside the setting's: natively the SET is refused;
    in the portable edition the call that reads it is, with the same message (the portable
    edition took such values: a size limit of 0 or 2 GB, a TTL of 3652 days), and changes
    nothing."""
    db = connect()
    error = refusal_of_a_setting(db, setting, value)
    # PostgreSQL writes the range with its unit from 17 on.
    u = f" {unit}" if db.info.server_version >= 170000 else ""
    assert (error.sqlstate, error.diag.message_primary) == \
        ("22023", f'{number} {unit} is outside the valid range for parameter "{setting}" ({low}{u} .. {high}{u})')


def test_idempotency_audit_is_read_as_postgresql_reads_a_boolean(connect):
    """Spellings PostgreSQL takes for a Boolean turn auditing on or off; anything else is refused
    (natively by the SET, in the portable edition by the completion that reads it) and changes
    nothing. The portable edition took 'abc' as off and completed without an audit row."""
    db = connect()
    db.execute("SELECT idempotency.canonical_json('{}')")  # loads the library: the setting is defined
    for value, audited in (("ON", True), ("ye", True), ("1", True), ("of", False), ("n", False), ("0", False),
                           ("on", True), ("off", False), ("OFF", False)):
        key = f"audit-{value}"
        token = claim(db, key)[1]
        db.execute(f"SET idempotency.audit = '{value}'")
        db.execute("SELECT idempotency.complete(%s, '{}', token => %s)", (key, token))
        db.execute("RESET idempotency.audit")
        assert db.execute("SELECT count(*) FROM idempotency.audit WHERE key = %s", (key,)).fetchone()[0] == audited, value
    # (Not '': natively refused too, but a placeholder the portable edition reads is '' once a
    # SET LOCAL of it has ended, so there it means unset.)
    for value in ("abc", "o", " on", "2", "truee"):
        key = "audit-bad"
        token = claim(db, key)[1]
        with pytest.raises(psycopg.Error) as exc:
            db.execute("SELECT set_config('idempotency.audit', %s, false)", (value,))
            db.execute("SELECT idempotency.complete(%s, '{}', token => %s)", (key, token))
        assert (exc.value.sqlstate, exc.value.diag.message_primary) == \
            ("22023", 'parameter "idempotency.audit" requires a Boolean value'), value
        db.execute("RESET idempotency.audit")
        assert db.execute("SELECT status::text FROM idempotency.idempotency_keys WHERE key = %s",
                          (key,)).fetchone() == ("in_progress",), value
        assert db.execute("SELECT count(*) FROM idempotency.audit WHERE key = %s", (key,)).fetchone()[0] == 0
        db.execute("SELECT idempotency.release(%s, token => %s)", (key, token))


@pytest.mark.native_only("a setting is checked when it is set only where the library defines it; "
                         "the portable edition checks it when a claim uses it")
@pytest.mark.parametrize("setting", ["idempotency.default_ttl", "idempotency.default_lease"])
def test_default_durations_every_claim_would_refuse_are_refused_when_set(connect, setting):
    """0.4.0 accepted idempotency.default_ttl (and default_lease) up to 3660 days, with which
    every claim that relied on the setting failed "must be at most 10 years". The setting now
    refuses what a claim would: more than 3651 days (the shortest ten calendar years)."""
    db = connect()
    db.execute("SELECT idempotency.canonical_json('{}')")  # loads the library: the setting is defined
    for value in ("3660d", "3652d", "315446401"):
        for sql in (f"SET {setting} = '{value}'", f"SELECT set_config('{setting}', '{value}', false)"):
            with pytest.raises(psycopg.Error) as exc:
                db.execute(sql)
            assert exc.value.sqlstate == "22023", (sql, exc.value.sqlstate, str(exc.value))
            assert setting in str(exc.value), str(exc.value)
    # Refused for a role or database too (ALTER ROLE ... SET checks the value when it is set).
    with pytest.raises(psycopg.Error) as exc:
        db.execute(f"ALTER ROLE postgres IN DATABASE idem SET {setting} = '3660d'")
    assert exc.value.sqlstate == "22023" and setting in str(exc.value)
    assert db.execute(f"SHOW {setting}").fetchone()[0] in ("1d", "5min")
    # The largest value the setting takes is one every claim takes.
    db.execute(f"SET {setting} = '3651d'")
    db.execute("SET idempotency.default_ttl = '3651d'")
    out = db.execute("SELECT outcome::text, expires_at > now() + interval '3650 days' "
                     "FROM idempotency.claim('ttl-max')").fetchone()
    assert out == ("new", True)


@pytest.mark.parametrize("setting,value,message", [
    ("idempotency.audit", "abc", 'parameter "idempotency.audit" requires a Boolean value'),
    ("idempotency.max_response_size", "0", "0 kB is outside the valid range for parameter "
                                           '"idempotency.max_response_size" (1{u} .. 1048576{u})'),
    ("idempotency.default_ttl", "3652d", "315532800 s is outside the valid range for parameter "
                                         '"idempotency.default_ttl" (1{u} .. 315446400{u})'),
])
def test_a_bad_value_an_administrator_set_warns_and_the_default_applies(connect, setting, value, message):
    """ALTER ROLE ... SET takes any value for a setting no library defines (the portable edition,
    or the native one before its library is loaded); where the native library is loaded it
    refuses the value. A session of that role then gets a warning and the setting's default, as
    natively where the library loads (the portable edition refused every call)."""
    admin = connect()
    database = admin.execute("SELECT current_database()").fetchone()[0]
    unit = {"idempotency.max_response_size": " kB", "idempotency.default_ttl": " s"}.get(setting, "")
    message = message.format(u=unit if admin.info.server_version >= 170000 else "")
    try:
        admin.execute(f"ALTER ROLE postgres IN DATABASE {database} SET {setting} = '{value}'")
    except psycopg.Error as e:
        # The library is loaded here (preloaded): the value is refused when it is set.
        assert (e.sqlstate, e.diag.message_primary) == ("22023", message)
        return
    try:
        session = connect()
        warnings = []
        session.add_notice_handler(lambda d: warnings.append(d.message_primary)
                                   if d.severity_nonlocalized == "WARNING" else None)
        row = session.execute("SELECT outcome::text, token, expires_at < now() + interval '2 days' "
                              "FROM idempotency.claim('admin-bad')").fetchone()
        assert row[0] == "new" and row[2] is True, row  # the default TTL: one day
        session.execute("SELECT idempotency.complete('admin-bad', jsonb_build_object('r', repeat('x', 5000)), "
                        "token => %s)", (row[1],))
        assert message in warnings, warnings
        assert session.execute("SELECT status::text FROM idempotency.idempotency_keys WHERE key = 'admin-bad'"
                               ).fetchone() == ("completed",)
        assert session.execute("SELECT count(*) FROM idempotency.audit WHERE key = 'admin-bad'").fetchone()[0] == 0
        # A bad value the session sets itself is refused (natively by the SET, without the
        # library by the call that reads it).
        token = claim(session, "admin-bad-2")[1]
        with pytest.raises(psycopg.Error) as exc:
            session.execute(f"SET {setting} = '{value}0'")
            session.execute("SELECT idempotency.claim('admin-bad-3')")
            session.execute("SELECT idempotency.complete('admin-bad-2', '{}', token => %s)", (token,))
        assert exc.value.sqlstate == "22023" and setting in exc.value.diag.message_primary, exc.value
    finally:
        admin.execute(f"ALTER ROLE postgres IN DATABASE {database} RESET {setting}")
