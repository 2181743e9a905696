"""Model-based test: a seeded random schedule of claim / complete / release / checkpoint /
forget / lookup, lease expiry, key expiry and transaction commits and rollbacks across many
sessions and keys, checked after every step against a small in-memory model of the contract's
state machine. A divergence fails with the seed and the step, so it can be replayed:

    MODEL_SEED=123 MODEL_STEPS=5000 python3 -m pytest tests/integration/test_model.py
"""

import copy
import os
import random

import psycopg
from psycopg.types.json import Jsonb

SEED = int(os.environ.get("MODEL_SEED", "20261130"))
STEPS = int(os.environ.get("MODEL_STEPS", "1500"))
SESSIONS = int(os.environ.get("MODEL_SESSIONS", "16"))
KEYS = int(os.environ.get("MODEL_KEYS", "40"))


class Row:
    def __init__(self, request, token):
        self.status = "in_progress"
        self.request = request  # None: no hash stored
        self.token = token
        self.response = None
        self.recovery_point = None
        self.lease_over = False
        self.expired = False

    def live(self):
        return not self.expired


class Model:
    def __init__(self):
        self.committed = {}  # key -> Row (absent: missing)
        self.overlay = {}  # session -> {key: Row or None}, for open transactions
        self.max_token = {}

    def view(self, s, key):
        ov = self.overlay.get(s)
        if ov is not None and key in ov:
            return ov[key]
        return self.committed.get(key)

    def touched_by_other(self, s, key):
        return any(t != s and key in ov for t, ov in self.overlay.items())

    def write(self, s, key, row):
        if s in self.overlay:
            self.overlay[s][key] = row
        elif row is None:
            self.committed.pop(key, None)
        else:
            self.committed[key] = row

    def new_row_view(self, s, key):
        """A private copy to modify (never alias committed rows from an open transaction)."""
        r = self.view(s, key)
        return copy.copy(r) if r is not None else None


def hashes_match(stored, given):
    return stored is None or given is None or stored == given


def run_schedule(cluster, seed, n_keys=KEYS, steps=STEPS, hot=None):
    """`hot`: how many keys take 80% of the steps (None: every key alike)."""
    rng = random.Random(seed)
    model = Model()
    conns = [psycopg.connect(cluster.conninfo(), autocommit=True) for _ in range(SESSIONS)]
    checker = psycopg.connect(cluster.conninfo(), autocommit=True)
    keys = [f"m{seed}-{i}" for i in range(n_keys)]
    requests = [None, {"a": 1}, {"a": 2}]
    log = []

    def fail(msg):
        key = log[-1][3] if log else None
        history = [entry for entry in log if entry[3] == key or entry[2] == "end"][-40:]
        raise AssertionError(f"seed {seed}, step {len(log)}: {msg}\nlast steps: {log[-8:]}\n"
                             f"steps on {key} (and transaction ends): {history}")

    try:
        for step in range(steps):
            s = rng.randrange(SESSIONS)
            c = conns[s]
            key = rng.choice(keys[:hot] if hot and rng.random() < 0.8 else keys)
            in_tx = s in model.overlay
            op = rng.choices(
                ["claim", "complete", "release", "checkpoint", "forget", "lookup", "begin", "end",
                 "lease_over", "expire"],
                weights=[30, 14, 5, 5, 3, 5, 6 if not in_tx else 0, 8 if in_tx else 0, 3, 2],
            )[0]
            view = model.view(s, key)
            blocked = model.touched_by_other(s, key)
            log.append((step, s, op, key))

            if op == "begin":
                c.execute("BEGIN")
                model.overlay[s] = {}
            elif op == "end":
                if rng.random() < 0.5:
                    c.execute("COMMIT")
                    for k, r in model.overlay.pop(s).items():
                        if r is None:
                            model.committed.pop(k, None)
                        else:
                            model.committed[k] = r
                    log[-1] = log[-1] + ("commit",)
                else:
                    c.execute("ROLLBACK")
                    model.overlay.pop(s)
                    log[-1] = log[-1] + ("rollback",)
            elif op == "claim":
                req = rng.choice(requests)
                got = c.execute(
                    "SELECT outcome::text, token, response, recovery_point FROM idempotency.claim(%s, %s, lease => '1 hour')",
                    (key, Jsonb(req) if req is not None else None),
                ).fetchone()
                if blocked:
                    expected = "in_progress"
                elif view is None or view.expired:
                    expected = "new"
                elif not hashes_match(view.request, req):
                    expected = "mismatch"
                elif view.status == "completed":
                    expected = "replay"
                elif view.lease_over:
                    expected = "new"
                else:
                    expected = "in_progress"
                if got[0] != expected:
                    fail(f"claim {key} {req}: expected {expected}, got {got}")
                if expected == "new":
                    if got[1] <= model.max_token.get(key, 0):
                        fail(f"token {got[1]} not above {model.max_token.get(key)}")
                    model.max_token[key] = got[1]
                    takeover = view is not None and not view.expired
                    row = Row(req if not takeover else (view.request if view.request is not None else req), got[1])
                    if takeover:
                        row.recovery_point = view.recovery_point
                        if got[3] != view.recovery_point:
                            fail(f"takeover recovery point {got[3]!r}, expected {view.recovery_point!r}")
                    model.write(s, key, row)
                elif expected == "replay":
                    if got[2] != view.response or got[1] != view.token:
                        fail(f"replay of {key}: {got}, expected {view.response} / {view.token}")
            elif op in ("complete", "checkpoint", "release", "forget"):
                if blocked:
                    continue  # would wait for the other transaction: not a non-blocking call
                use_token = rng.random() < 0.6
                token = None
                if use_token:
                    token = view.token if (view is not None and rng.random() < 0.8) else rng.randrange(1, 10**6) + 10**9
                live_ip = view is not None and view.live() and view.status == "in_progress"
                token_ok = token is None or (view is not None and token == view.token)
                if op == "forget":
                    got = c.execute("SELECT idempotency.forget(%s)", (key,)).fetchone()[0]
                    expected = view is not None and view.live()
                    if got != expected:
                        fail(f"forget {key}: {got}, expected {expected}")
                    if view is not None:  # an expired row is deleted too
                        model.write(s, key, None)
                    continue
                if op == "release":
                    got = c.execute("SELECT idempotency.release(%s, token => %s)", (key, token)).fetchone()[0]
                    expected = live_ip and token_ok
                    if got != expected:
                        fail(f"release {key} token {token}: {got}, expected {expected}")
                    if got:
                        model.write(s, key, None)
                    continue
                if view is None or not view.live():
                    code = "IK001"
                elif view.status == "completed":
                    code = "IK002"
                elif not token_ok:
                    code = "IK003"
                else:
                    code = None
                response = {"step": step}
                try:
                    if in_tx:
                        c.execute("SAVEPOINT s")
                    if op == "complete":
                        c.execute("SELECT idempotency.complete(%s, %s, token => %s)", (key, Jsonb(response), token))
                    else:
                        c.execute("SELECT idempotency.checkpoint(%s, %s, token => %s)", (key, f"rp-{step}", token))
                    if in_tx:
                        c.execute("RELEASE SAVEPOINT s")
                    got_code = None
                except psycopg.Error as e:
                    got_code = e.sqlstate
                    if in_tx:
                        c.execute("ROLLBACK TO SAVEPOINT s")
                if got_code != code:
                    fail(f"{op} {key} token {token}: SQLSTATE {got_code}, expected {code}")
                if code is None:
                    row = model.new_row_view(s, key)
                    if op == "complete":
                        row.status, row.response, row.lease_over = "completed", response, False
                    else:
                        row.recovery_point = f"rp-{step}"
                    model.write(s, key, row)
            elif op == "lookup":
                got = c.execute("SELECT (l).status::text, (l).token FROM idempotency.lookup(%s) l", (key,)).fetchone()
                # lookup reads through this session's snapshot: its own changes, others' commits.
                v = view if (view is None or not view.expired) else None
                expected = (v.status, v.token) if v is not None else (None, None)
                if tuple(got) != expected:
                    fail(f"lookup {key}: {got}, expected {expected}")
            elif op in ("lease_over", "expire"):
                # An operator's clock jump, done outside every session; only on settled keys.
                # A day back: sessions judge expiry at their transaction's start, and a
                # transaction of this schedule can stay open for seconds.
                if any(key in ov for ov in model.overlay.values()) or key not in model.committed:
                    continue
                column = "locked_until" if op == "lease_over" else "expires_at"
                checker.execute(
                    f"UPDATE idempotency.idempotency_keys SET {column} = now() - interval '1 day' "
                    f"WHERE key = %s AND {column} IS NOT NULL",
                    (key,),
                )
                row = copy.copy(model.committed[key])
                if op == "lease_over":
                    row.lease_over = row.status == "in_progress"
                else:
                    row.expired = True
                model.committed[key] = row

            # After every step the committed table equals the model's committed state.
            rows = {
                k: (st, tok, resp, rp)
                for k, st, tok, resp, rp in checker.execute(
                    "SELECT key, status::text, token, response, recovery_point FROM idempotency.idempotency_keys "
                    "WHERE key LIKE %s",
                    (f"m{seed}-%",),
                ).fetchall()
            }
            want = {k: (r.status, r.token, r.response, r.recovery_point) for k, r in model.committed.items()}
            if rows != want:
                diff = {k: (rows.get(k), want.get(k)) for k in set(rows) | set(want) if rows.get(k) != want.get(k)}
                fail(f"table differs from the model: {diff}")
    finally:
        for conn in conns + [checker]:
            conn.close()
    return len(log)


def test_random_schedules_match_the_model(cluster):
    checked = run_schedule(cluster, SEED)
    assert checked == STEPS


def test_a_few_hundred_keys_with_hot_ones_match_the_model(cluster):
    """300 keys, 20 of them taking 80% of the steps: contention on the hot ones, long-lived
    rows (expiring, taken over, forgotten) on the rest."""
    keys = int(os.environ.get("MODEL_MANY_KEYS", "300"))
    checked = run_schedule(cluster, SEED + 1, n_keys=keys, steps=STEPS * 2, hot=20)
    assert checked == STEPS * 2
