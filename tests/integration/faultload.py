"""Claim/complete load for the fault tests (test_crash_postmaster.py, test_failover.py): sessions
of both usage styles on fresh keys, with a ledger of what each client was told, and the check of
the ledger against a server after a crash or a failover.

Ledger states, per key (`sent`: the statement went out, no answer came back):
  one transaction: open (claimed inside BEGIN, COMMIT not sent) -> commit-sent -> acked
  leased:          claim-sent -> claimed -> checkpoint-sent -> checkpointed -> complete-sent -> acked
                   (every fourth leased claim is abandoned at `claimed`: a worker that died)
"""

import random
import threading
import time

import psycopg
from psycopg.types.json import Jsonb

from helpers import claim


class Record:
    __slots__ = ("key", "style", "state", "request", "response", "token")

    def __init__(self, key, style, state, request, response):
        self.key, self.style, self.state = key, style, state
        self.request, self.response, self.token = request, response, None


class Load:
    """Runs `tx_sessions` one-transaction and `lease_sessions` leased workers against `conninfo`
    until stop() or until their server goes away (a worker ends at its first lost connection and
    never reconnects, so nothing it does reaches a later server)."""

    def __init__(self, conninfo, prefix, tx_sessions=4, lease_sessions=4, lease="10 seconds", seed=0):
        self.conninfo, self.prefix, self.lease = conninfo, prefix, lease
        self.records = []
        self.unexpected = []  # (worker, exception or wrong answer) while the server was up
        self.lost = []  # (worker, error text) when the connection went away
        self._stop = threading.Event()
        self._rng = random.Random(seed)
        self._threads = [threading.Thread(target=self._tx_worker, args=(n,), daemon=True)
                         for n in range(tx_sessions)]
        self._threads += [threading.Thread(target=self._lease_worker, args=(n,), daemon=True)
                          for n in range(lease_sessions)]

    def start(self):
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout=30):
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self._threads), "a load worker hangs"

    def _add(self, key, style, state, request, response):
        r = Record(key, style, state, request, response)
        self.records.append(r)  # list.append is atomic under the GIL
        return r

    def _run(self, name, body):
        try:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                body(conn)
        except psycopg.OperationalError as e:  # server gone (shutdown, crash, killed backend)
            self.lost.append((name, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__))
        except Exception as e:  # noqa: BLE001 - surfaced by the test
            self.unexpected.append((name, repr(e)))

    def _tx_worker(self, n):
        def body(conn):
            pause = random.Random(n).random
            i = 0
            while not self._stop.is_set():
                key = f"{self.prefix}-t{n}-{i}"
                req, resp = {"w": n, "i": i}, {"key": key, "i": i}
                rec = self._add(key, "tx", "open", req, resp)
                conn.execute("BEGIN")
                r = claim(conn, key, req)
                if r[0] != "new":
                    raise AssertionError(f"fresh key {key}: {r}")
                if pause() < 0.3:
                    conn.execute("SELECT pg_sleep(0.005)")  # the work inside the transaction
                conn.execute("SELECT idempotency.complete(%s, %s, 201)", (key, Jsonb(resp)))
                rec.state = "commit-sent"
                conn.execute("COMMIT")
                rec.state = "acked"
                i += 1

        self._run(f"tx{n}", body)

    def _lease_worker(self, n):
        def body(conn):
            i = 0
            while not self._stop.is_set():
                key = f"{self.prefix}-l{n}-{i}"
                req, resp = {"w": n, "i": i, "leased": True}, {"key": key, "charge": i}
                rec = self._add(key, "lease", "claim-sent", req, resp)
                r = claim(conn, key, req, lease=self.lease)
                if r[0] != "new":
                    raise AssertionError(f"fresh key {key}: {r}")
                rec.token, rec.state = r[1], "claimed"
                i += 1
                if i % 4 == 0:
                    continue  # this worker "dies": the claim stays until its lease runs out
                rec.state = "checkpoint-sent"
                conn.execute("SELECT idempotency.checkpoint(%s, 'charged', token => %s)", (key, rec.token))
                rec.state = "checkpointed"
                rec.state = "complete-sent"
                conn.execute("SELECT idempotency.complete(%s, %s, 200, token => %s)", (key, Jsonb(resp), rec.token))
                rec.state = "acked"

        self._run(f"lease{n}", body)


def _lookup(conn, key):
    return conn.execute(
        "SELECT status::text, token, response, response_status, recovery_point, "
        "       locked_until > now() AS lease_running, locked_until "
        "  FROM idempotency.lookup(%s) WHERE key IS NOT NULL", (key,)).fetchone()


def verify(conninfo, load, takeover=True):
    """Checks every ledger entry against the server at `conninfo` and returns counts:
    - acked (either style): the completion is there and claim replays the same response;
    - one transaction, COMMIT not sent: the key is absent, claim says `new` (rolled back here);
      COMMIT sent but unanswered: absent or completed with the response, never in progress;
    - leased, claim acknowledged and not completed: `in_progress` with the acknowledged token
      (and the checkpoint if acknowledged); claim answers `in_progress` while the lease runs,
      then (takeover=True) `new` with a larger token and the recovery point."""
    counts = {"acked": 0, "uncommitted_gone": 0, "unanswered_commit_kept": 0, "unanswered_commit_gone": 0,
              "leased_in_progress": 0, "in_progress_while_leased": 0, "taken_over": 0}
    held = []  # (record, token, recovery point) of leased claims to take over
    # Leased claims not known to be completed first, while their leases still run.
    records = sorted(load.records, key=lambda r: (r.style != "lease" or r.state == "acked"))
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for rec in records:
            row = _lookup(conn, rec.key)
            where = f"{rec.key} ({rec.style}, {rec.state}): {row}"
            if rec.state == "acked":
                assert row is not None and row[0] == "completed" and row[2] == rec.response, where
                r = claim(conn, rec.key, rec.request)
                status = 201 if rec.style == "tx" else 200
                assert r[0] == "replay" and r[2] == rec.response and r[3] == status, (where, r)
                counts["acked"] += 1
            elif rec.style == "tx" and rec.state == "open":
                assert row is None, where
                conn.execute("BEGIN")
                r = claim(conn, rec.key, rec.request)
                conn.execute("ROLLBACK")  # leave the key as it was
                assert r[0] == "new", (where, r)
                counts["uncommitted_gone"] += 1
            elif rec.style == "tx":  # commit-sent: committed or not, but all or nothing
                assert row is None or (row[0] == "completed" and row[2] == rec.response), where
                counts["unanswered_commit_kept" if row else "unanswered_commit_gone"] += 1
            else:
                if rec.state == "claim-sent" and row is None:
                    continue  # the claim never committed
                if rec.state == "complete-sent" and row is not None and row[0] == "completed":
                    assert row[2] == rec.response, where
                    counts["unanswered_commit_kept"] += 1
                    continue
                assert row is not None and row[0] == "in_progress", where
                if rec.state == "claim-sent":
                    rec.token = row[1]  # committed, but the client never learnt its token
                assert row[1] == rec.token, where
                checkpoint = {"claimed": None, "claim-sent": None, "checkpointed": "charged",
                              "complete-sent": "charged"}.get(rec.state, row[4])
                assert row[4] == checkpoint, where
                counts["leased_in_progress"] += 1
                if row[5]:  # the lease still runs: nobody may take the key over yet
                    r = claim(conn, rec.key, rec.request)
                    assert r[0] == "in_progress" and r[4].total_seconds() >= 1, (where, r)
                    counts["in_progress_while_leased"] += 1
                held.append((rec, row[1], row[4], row[6]))
        # No one-transaction claim is left half-done.
        prefix = load.prefix + "-t%"
        stuck = conn.execute("SELECT count(*) FROM idempotency.idempotency_keys "
                             "WHERE key LIKE %s AND status = 'in_progress'", (prefix,)).fetchone()[0]
        assert stuck == 0, f"{stuck} one-transaction claims survived in progress"
        if takeover and held:
            last = max(h[3] for h in held)
            wait = conn.execute("SELECT extract(epoch FROM %s - now())", (last,)).fetchone()[0]
            time.sleep(max(0.0, float(wait)) + 0.1)
            for rec, token, recovery_point, _ in held:
                r = claim(conn, rec.key, rec.request, lease=load.lease)
                assert r[0] == "new" and r[1] > token and r[5] == recovery_point, (rec.key, token, r)
                try:
                    conn.execute("SELECT idempotency.complete(%s, %s, token => %s)", (rec.key, Jsonb({}), token))
                    stale = None
                except psycopg.Error as e:
                    stale = e.sqlstate
                assert stale == "IK003", f"{rec.key}: complete with the stale token {token} after a takeover: {stale}"
                conn.execute("SELECT idempotency.complete(%s, %s, 200, token => %s)",
                             (rec.key, Jsonb(rec.response), r[1]))
                counts["taken_over"] += 1
    return counts
