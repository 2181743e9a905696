"""Crash in the middle of load, several rounds on one cluster, two ways: `pg_ctl stop -m immediate`
and SIGKILL of the postmaster (its orphaned backends may still commit what they are running,
then die; postmaster.pid is left stale). After each restart, against the ledger of what every
client was told (faultload.py): every acknowledged completion replays the same response, every
one-transaction claim that did not commit is gone (`new`), and every acknowledged leased claim
that was not completed is `in_progress` with its token until the lease runs out, then taken over
with a larger token and its checkpoint.

    CRASH_ROUNDS=10 python3 -m pytest tests/integration/test_crash_postmaster.py -s
"""

import os
import random
import time

import psycopg
import pytest

from cluster import Cluster
from faultload import Load, verify

pytestmark = pytest.mark.slow  # rounds of crashes under load

ROUNDS = int(os.environ.get("CRASH_ROUNDS", "3"))
SEED = int(os.environ.get("CRASH_SEED", "5"))


@pytest.mark.parametrize("mode", ["immediate", "sigkill"])
def test_crash_under_load_keeps_every_acknowledged_answer(mode):
    rng = random.Random(SEED)
    c = Cluster(settings={"fsync": "on"}).start()
    totals, orphans = {}, []
    try:
        with psycopg.connect(c.conninfo(), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION idempotency")
        for rnd in range(ROUNDS):
            load = Load(c.conninfo(), prefix=f"{mode}-r{rnd}", seed=rnd).start()
            time.sleep(rng.uniform(1.0, 3.0))
            if mode == "immediate":
                c.stop("immediate")
            else:
                orphans.append(c.kill_postmaster())
            load.stop()
            assert not load.unexpected, load.unexpected
            c.restart()
            c.wait_ready()
            counts = verify(c.conninfo(), load)
            assert counts["acked"] > 50, counts  # the load ran
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
            totals["ledger"] = totals.get("ledger", 0) + len(load.records)
        assert totals["leased_in_progress"] > 0 and totals["taken_over"] == totals["leased_in_progress"], totals
        assert totals["in_progress_while_leased"] > totals["leased_in_progress"] // 2, totals
        print(f"\ncrash[{mode}]: {ROUNDS} crashes survived; {totals}"
              + (f"; orphans at kill / SIGKILLed after 5 s per round: {orphans}" if orphans else ""))
    finally:
        c.destroy()
