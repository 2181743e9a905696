"""The package behind a connection pooler: no statement prepared on the server, nothing set for
the session, racing duplicates from two app instances, and a completion that a broken connection
interrupted after the side effect ran.

Each test runs on the route IDEMPOTENCY_TEST_POOLER names (direct, or PgBouncer in transaction or
session mode; scripts/clients-python.sh runs the suite on all three)."""

import collections
import datetime as dt
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

import pg_idempotency
from pg_idempotency import Store, idempotent

MODE = os.environ.get("IDEMPOTENCY_TEST_POOLER", "direct") or "direct"


def test_many_calls_from_successive_processes_never_meet_a_prepared_statement(conninfo):
    # psycopg prepares a statement at its 6th execution on a connection; behind a pooler in
    # transaction mode the next client gets that server connection with "_pg3_0" prepared
    # already, or a transaction of the same client runs on another one that lacks it.
    for run in range(3):
        store = Store(conninfo)
        try:
            for _ in range(8):
                assert store.lookup("never-claimed") is None
            assert store.claim(f"prep-{run}", {"n": run}).outcome == "new"
            assert store.lookup(f"prep-{run}").status == "in_progress"
        finally:
            store.close()


@pytest.mark.skipif(MODE == "transaction", reason="a session's prepared statements are seen on a connection of its own")
def test_the_store_prepares_nothing_on_its_server_connection(conninfo):
    store = Store(conninfo)
    try:
        for i in range(10):
            store.claim(f"unprepared-{i}", {"i": i})
            store.lookup(f"unprepared-{i}")
        prepared = store.connection().execute("SELECT count(*) FROM pg_prepared_statements", prepare=False).fetchone()
        assert prepared == (0,)
    finally:
        store.close()


def test_prepared_statements_can_be_asked_for_where_the_route_keeps_them(conninfo):
    if MODE == "transaction":
        pytest.skip("PgBouncer 1.18 in transaction mode keeps no prepared statement per client")
    store = Store(conninfo, prepared_statements=True)
    try:
        for _ in range(8):
            store.lookup("prepared-asked")
        prepared = store.connection().execute("SELECT count(*) FROM pg_prepared_statements", prepare=False).fetchone()
        assert prepared[0] >= 1
    finally:
        store.close()


def test_racing_duplicates_from_two_instances_run_each_side_effect_once(conninfo, db):
    # Two app instances (two stores, each with its own connections), 16 duplicates of each of
    # 50 keys racing across 24 threads.
    keys, duplicates = 50, 16
    effects = collections.Counter()
    lock = threading.Lock()
    instances = [Store(conninfo), Store(conninfo)]

    def make(store):
        @idempotent(key="race:{n}", store=store, lease=dt.timedelta(seconds=30), wait=dt.timedelta(seconds=60))
        def charge(n):
            with lock:
                effects[n] += 1
            time.sleep(0.02)
            return {"charged": n}
        return charge

    charges = [make(s) for s in instances]
    calls = [(charges[i % 2], n) for i in range(duplicates) for n in range(keys)]
    try:
        with ThreadPoolExecutor(24) as pool:
            results = list(pool.map(lambda c: c[0].detailed(c[1]), calls))
    finally:
        for s in instances:
            s.close()
    assert db.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key LIKE 'race:%%' "
                      "AND status = 'completed'").fetchone() == (keys,)
    assert effects == collections.Counter({n: 1 for n in range(keys)})
    assert all(r.value == {"charged": n} for r, (_, n) in zip(results, calls))
    assert sum(not r.replayed for r in results) == keys


def break_connections(route, db):
    """What a failover or a pooler restart does to the package's connections: direct and in
    session mode their server backends are terminated; in transaction mode the package holds no
    server connection between statements, so the pooler drops its client connections (KILL) and
    takes new ones again half a second later (RESUME)."""
    if MODE == "transaction":
        if route is None:
            pytest.skip("IDEMPOTENCY_TEST_CONNINFO: the pooler's admin console is not the tests'")
        route.admin(f"KILL {route.cluster.dbname}")
        threading.Timer(0.5, lambda: route.admin(f"RESUME {route.cluster.dbname}")).start()
    else:
        killed = db.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                            "AND backend_type = 'client backend'").fetchone()[0]
        assert killed >= 1


def test_a_connection_broken_after_the_side_effect_completes_on_a_fresh_one(conninfo, route, db, row):
    # No reconnect patience of its own: only the lease keeps the completion trying, as it must,
    # since a takeover after the lease would run the side effect again.
    store = Store(conninfo, reconnect_timeout=dt.timedelta(0))
    effects = []

    @idempotent(key="broken-after-effect", store=store, lease=dt.timedelta(seconds=30))
    def send_receipt():
        effects.append(1)
        break_connections(route, db)
        return {"sent": True}

    try:
        first = send_receipt.detailed()
        assert first.value == {"sent": True} and effects == [1]
        assert row("broken-after-effect")[:3] == ("completed", {"sent": True}, 200)
        again = send_receipt.detailed()
        assert again.replayed and again.value == {"sent": True} and effects == [1]
    finally:
        store.close()


def test_a_broken_connection_after_the_lease_ran_out_surfaces_the_error(conninfo, route, db, row):
    # Past the lease another attempt may have taken the key over: the completion is not tried
    # again, the error reaches the caller, and the claim stays for a takeover.
    store = Store(conninfo, reconnect_timeout=dt.timedelta(0))

    @idempotent(key="broken-past-lease", store=store, lease=dt.timedelta(seconds=1))
    def slow():
        time.sleep(1.2)
        break_connections(route, db)
        return 1

    try:
        with pytest.raises(psycopg.OperationalError):
            slow()
        assert row("broken-past-lease")[0] == "in_progress"
    finally:
        store.close()
        if route is not None and MODE == "transaction":
            time.sleep(0.6)  # the RESUME timer


class _AnswerLost:
    """A connection whose first `idempotency.complete` commits on the server, then breaks before
    the answer arrives: what a reset between the server's commit and the client's read does."""

    def __init__(self, conn, lost):
        self._conn, self._lost = conn, lost

    def execute(self, sql, params=None, **kw):
        cur = self._conn.execute(sql, params, **kw)
        if "idempotency.complete(" in sql and not self._lost:
            self._lost.append(sql)
            self._conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return cur


class AnswerLostStore(Store):
    lost: list

    def connection(self):
        return _AnswerLost(super().connection(), self.lost)


def test_a_completion_whose_answer_was_lost_returns_the_calls_own_result(conninfo, row):
    store = AnswerLostStore(conninfo)
    store.lost = []
    effects = []

    @idempotent(key="answer-lost", store=store, lease=dt.timedelta(seconds=30))
    def charge():
        effects.append(1)
        return {"charge": "ch_1"}

    try:
        first = charge.detailed()
        assert store.lost, "the first complete's answer was not lost"
        assert (first.replayed, first.outcome, first.value) == (False, "new", {"charge": "ch_1"})
        assert first.expires_at is not None and row("answer-lost")[:3] == ("completed", {"charge": "ch_1"}, 200)
        again = charge.detailed()
        assert again.replayed and again.value == {"charge": "ch_1"} and effects == [1]
    finally:
        store.close()


def test_the_package_sets_nothing_for_the_session():
    # Behind a pooler in transaction mode a session-level SET stays on the server connection and
    # changes the next client's calls: only SET LOCAL / set_config(..., true) / arguments.
    src = os.path.dirname(pg_idempotency.__file__)
    found = []
    for name in sorted(os.listdir(src)):
        if not name.endswith(".py"):
            continue
        text = open(os.path.join(src, name), encoding="utf-8").read()
        # SQL as this package writes it: upper-case keywords.
        for m in re.finditer(r"\b(SET\s+(?!LOCAL\b)(SESSION\s+)?[A-Za-z_][\w.]*\s*(=|\bTO\b)|RESET\s+\w)", text):
            found.append((name, m.group(0)))
        for m in re.finditer(r"set_config\(([^()]|\([^()]*\))*\)", text):
            if not re.search(r",\s*true\s*\)$", m.group(0)):
                found.append((name, m.group(0)))
    assert found == []
