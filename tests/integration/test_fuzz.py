"""Fuzzing of the canonicalizer (crates/idempotency-core/src/canonical.rs) with the stable-Rust harness in fuzz/.

The harness generates seeded random JSON text (valid, mutated, random bytes, deep nesting, huge
numbers, long strings, escapes and surrogates, duplicate names) and checks no panic, no hang,
the nesting limit, idempotence, RFC 8785 escaping and member order, number layouts, a parser
differential against serde_json, and a differential against tests/oracle/jcs_oracle.py.

It also feeds the jsonb binary reader (crates/idempotency-core/src/jsonb.rs) arbitrary bytes:
jsonb laid out as the server lays it out, the same damaged at random, and random bytes; checked
for no panic, no hang, allocation in proportion to the bytes given, exact read-back, and the two
readers agreeing on canonical JSON.

CI runs a short variant. Environment: FUZZ_EXECS (invariant executions, default 200000),
FUZZ_JSONB_EXECS (jsonb reader, default 2000000: about a minute on one core),
FUZZ_ORACLE_EXECS (oracle differential, default 20000), FUZZ_SEED (default 1), FUZZ_THREADS.
Full run: FUZZ_EXECS=10000000 FUZZ_JSONB_EXECS=50000000 FUZZ_ORACLE_EXECS=1000000 FUZZ_THREADS=2 \
          python3 -m pytest -q -s tests/integration/test_fuzz.py
"""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # builds the fuzz harness with cargo, then hundreds of thousands of executions

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FUZZ = os.path.join(ROOT, "fuzz")
BINARY = os.path.join(FUZZ, "target", "release", "canon-fuzz")


def cargo():
    found = shutil.which("cargo") or os.path.expanduser("~/.cargo/bin/cargo")
    if not os.path.exists(found):
        pytest.fail("cargo not found")
    return found


@pytest.fixture(scope="module")
def harness():
    subprocess.run([cargo(), "build", "--release", "--quiet"], cwd=FUZZ, check=True)
    return BINARY


def run(harness, timeout, **env):
    full = dict(os.environ)
    full.update({k: str(v) for k, v in env.items()})
    full.setdefault("FUZZ_PYTHON", sys.executable)
    return subprocess.run([harness], env=full, capture_output=True, text=True, timeout=timeout)


def check_input(harness, tmp_path, text, strict=False):
    path = tmp_path / "input.json"
    path.write_bytes(text.encode("utf-8"))
    env = {"FUZZ_INPUT_FILE": path}
    if strict:
        env["FUZZ_STRICT"] = "1"
    return run(harness, 120, **env)


def test_fuzz_invariants_and_oracle(harness):
    execs = int(os.environ.get("FUZZ_EXECS", "200000"))
    oracle_execs = int(os.environ.get("FUZZ_ORACLE_EXECS", "20000"))
    jsonb_execs = int(os.environ.get("FUZZ_JSONB_EXECS", "2000000"))
    # ~20k executions/s, ~40k jsonb and ~5k oracle executions/s per core; generous for a
    # shared machine.
    timeout = 600 + execs // 2000 + jsonb_execs // 4000 + oracle_execs // 500
    r = run(harness, timeout, FUZZ_MODE="both", FUZZ_EXECS=execs, FUZZ_ORACLE_EXECS=oracle_execs,
            FUZZ_JSONB_EXECS=jsonb_execs)
    print(r.stdout)
    print(r.stderr[-5000:], file=sys.stderr)
    assert r.returncode == 0, f"fuzzing found failures (exit {r.returncode}):\n{r.stdout}\n{r.stderr[-5000:]}"
    assert f"invariant (seed {os.environ.get('FUZZ_SEED', '1')}): {execs} executions" in r.stdout
    assert f"jsonb (seed {os.environ.get('FUZZ_SEED', '1')}): {jsonb_execs} executions" in r.stdout
    assert f": {oracle_execs} executions" in r.stdout.split("canon-fuzz oracle", 1)[1]
    assert "FAILURE" not in r.stdout


@pytest.mark.parametrize("depth,expect_ok", [(1000, True), (1001, False), (100_000, False)])
def test_nesting_limit_is_an_error_not_a_crash(harness, tmp_path, depth, expect_ok):
    # The harness checks that parse_json refuses exactly the documents deeper than 1000 levels
    # with TooDeep (serde_json, without a depth limit, measures the depth).
    for opener, closer in (("[", "]"), ('{"a":', "}")):
        r = check_input(harness, tmp_path, opener * depth + "1" + closer * depth)
        assert r.returncode == 0 and "invariants hold" in r.stdout, r.stdout + r.stderr


def test_huge_numbers_and_strings(harness, tmp_path):
    cases = [
        "1" * 1_000_000,
        "-0." + "0" * 100_000 + "1e-100000",
        '"' + "\\ud83d\\ude00\\u0000\\\"" * 100_000 + '"',
        "[" + ",".join(["1e400", "-1e-400", "5e-324", "1.7976931348623159e308"] * 10_000) + "]",
    ]
    for text in cases:
        r = check_input(harness, tmp_path, text)
        assert r.returncode == 0 and "invariants hold" in r.stdout, r.stdout + r.stderr


def test_parse_json_refuses_a_sign_in_a_unicode_escape(harness, tmp_path):
    # Found by this fuzzer: u32::from_str_radix takes a sign, so "\u+041" was read as "A".
    for text in ('"\\u+041"', '"\\u-041"', '"\\u 041"', '["\\u+04A"]'):
        r = check_input(harness, tmp_path, text, strict=True)
        assert r.returncode == 0 and "invariants hold" in r.stdout, text + r.stdout + r.stderr


def test_harness_catches_a_panic_and_a_hang(harness):
    # Self-tests: execution 0 panics, or spins forever, instead of running the checks.
    r = run(harness, 120, FUZZ_MODE="invariant", FUZZ_EXECS=50, FUZZ_SELFTEST_PANIC=1)
    assert r.returncode == 1 and "FAILURE panic: 1 inputs" in r.stdout, r.stdout + r.stderr
    r = run(harness, 300, FUZZ_MODE="invariant", FUZZ_EXECS=50, FUZZ_SELFTEST_HANG=1)
    assert r.returncode == 3 and "HANG: seed 1, exec 0" in r.stderr, r.stdout + r.stderr


def test_jsonb_mode_catches_a_panic_and_an_allocation_beyond_the_bytes(harness):
    # Self-tests of the jsonb reader's executions: execution 0 panics; every execution reserves
    # 1 GB as a reader that believed a count from the bytes would.
    r = run(harness, 120, FUZZ_MODE="jsonb", FUZZ_JSONB_EXECS=50, FUZZ_SELFTEST_PANIC=1)
    assert r.returncode == 1 and "FAILURE panic: 1 inputs" in r.stdout, r.stdout + r.stderr
    r = run(harness, 120, FUZZ_MODE="jsonb", FUZZ_JSONB_EXECS=50, FUZZ_SELFTEST_ALLOC=1)
    assert r.returncode == 1 and "FAILURE jsonb-allocation: 50 inputs" in r.stdout, r.stdout + r.stderr
