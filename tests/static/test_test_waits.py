"""The integration tests wait for events, not for time: a test that needs something to have
happened (a sweeper round, a session blocked on a lock, a node back up) polls for it with a
deadline through helpers.wait_until; a literal time.sleep( stays only where time itself is the
subject (a lease or TTL running out in real time, a pause in a load). This counts the literal
calls under tests/ (this directory aside) and fails above the limit, a ratchet: lower it as
sleeps become waits for events (the aim is 25), never raise it. Reads files only."""

import os
import re

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
TESTS = os.path.join(ROOT, "tests")
HERE = os.path.dirname(os.path.abspath(__file__))
LIMIT = 65
SLEEP = re.compile(r"\btime\.sleep\(")


def sleeps_per_file():
    counts = {}
    for top, dirs, files in os.walk(TESTS):
        if os.path.abspath(top).startswith(HERE):
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(top, name)
            with open(path, encoding="utf-8") as f:
                n = len(SLEEP.findall(f.read()))
            if n:
                counts[os.path.relpath(path, ROOT)] = n
    return counts


def test_literal_sleeps_stay_under_the_limit():
    counts = sleeps_per_file()
    total = sum(counts.values())
    listing = "\n".join(f"{n:4d}  {p}" for p, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    print(f"literal time.sleep( calls in tests/: {total}\n{listing}")
    assert total <= LIMIT, (f"{total} literal time.sleep( calls in tests/ (limit {LIMIT}): wait for the event "
                            f"with helpers.wait_until instead\n{listing}")
