"""Real sessions racing on one key: at most one `new` per token, and every later claim replays
the single stored response. Claims never wait on another open transaction's claim: these races, each
interleaving stepped deterministically, are isolation specs (tests/isolation/specs: claim-claim,
claim_many-claim, sweep-claim, takeover-stale-complete); here the randomized many-session races."""

import threading
import time

import psycopg
import pytest
from psycopg.types.json import Jsonb

from helpers import claim, race


def check_invariant(results, final_response, conn, key, request):
    news = [r for r in results if r[0] == "new"]
    tokens = [r[1] for r in news]
    assert len(tokens) == len(set(tokens)), f"two sessions got new with one token: {tokens}"
    for r in results:
        assert r[0] in ("new", "in_progress", "replay"), r
        if r[0] == "replay":
            assert r[2] == final_response
    # Every later claim replays the single stored response.
    for _ in range(3):
        again = claim(conn, key, request)
        assert again[0] == "replay" and again[2] == final_response, again


def test_one_transaction_style_race(cluster, db):
    request = {"amount": 100, "currency": "EUR"}

    elapsed = {}

    def worker(conn, i):
        with conn.transaction():
            started = time.monotonic()
            r = claim(conn, "race-1tx", request)
            elapsed[i] = time.monotonic() - started
            if r[0] == "new":
                time.sleep(0.5)  # the side effect, inside the transaction
                conn.execute("SELECT idempotency.complete('race-1tx', %s)", (Jsonb({"winner": i}),))
        return r

    results = race(cluster, worker)
    news = [i for i, r in enumerate(results) if r[0] == "new"]
    assert len(news) == 1, results
    check_invariant(results, {"winner": news[0]}, db, "race-1tx", request)
    # Nobody waited for the winner's transaction: every other claim answered at once.
    slow = {i: round(t, 3) for i, t in elapsed.items() if i != news[0] and t >= 0.4}
    assert not slow, f"claims waited on the open transaction: {slow}"
    assert all(r[0] == "in_progress" for i, r in enumerate(results) if i != news[0]), results


def test_leased_style_race(cluster, db):
    request = {"order": 42}

    def worker(conn, i):
        r = claim(conn, "race-leased", request, lease="30 seconds")
        if r[0] == "new":
            time.sleep(0.3)  # side effect outside any transaction
            conn.execute("SELECT idempotency.complete('race-leased', %s, token => %s)", (Jsonb({"winner": i}), r[1]))
        return r

    results = race(cluster, worker)
    news = [i for i, r in enumerate(results) if r[0] == "new"]
    assert len(news) == 1, results
    check_invariant(results, {"winner": news[0]}, db, "race-leased", request)


def test_expired_lease_takeover_race(cluster, db):
    request = {"job": "resize"}
    first = claim(db, "race-takeover", request, lease="1 second")
    assert first[0] == "new"
    db.execute("SELECT idempotency.checkpoint('race-takeover', 'step-2', token => %s)", (first[1],))
    time.sleep(1.2)

    def worker(conn, i):
        r = claim(conn, "race-takeover", request, lease="30 seconds")
        if r[0] == "new":
            assert r[5] == "step-2", "takeover returns the recovery point"
            time.sleep(0.2)
            conn.execute("SELECT idempotency.complete('race-takeover', %s, token => %s)", (Jsonb({"winner": i}), r[1]))
        return r

    results = race(cluster, worker)
    news = [(i, r) for i, r in enumerate(results) if r[0] == "new"]
    assert len(news) == 1, results
    assert news[0][1][1] > first[1], "takeover token is strictly larger"
    check_invariant(results, {"winner": news[0][0]}, db, "race-takeover", request)
    # The original holder is fenced off.
    try:
        db.execute("SELECT idempotency.complete('race-takeover', '{}', token => %s)", (first[1],))
        raise AssertionError("stale token accepted")
    except psycopg.Error as e:
        assert e.sqlstate == "IK002"  # completed by the new holder


def test_many_keys_many_rounds(cluster, db):
    keys = [f"multi-{k}" for k in range(8)]

    def worker(conn, i):
        out = []
        for key in keys:
            with conn.transaction():
                r = claim(conn, key, {"k": key})
                if r[0] == "new":
                    conn.execute("SELECT idempotency.complete(%s, %s)", (key, Jsonb({"by": i})))
            out.append((key, r))
        return out

    results = race(cluster, worker, n=20)
    for key in keys:
        per_key = [r for session in results for (k, r) in session if k == key]
        assert sum(1 for r in per_key if r[0] == "new") == 1, per_key
        stored = db.execute("SELECT response FROM idempotency.idempotency_keys WHERE key = %s", (key,)).fetchone()[0]
        for r in per_key:
            if r[0] == "replay":
                assert r[2] == stored


def test_claim_wait_waits_for_the_holder(connect):
    holder, other = connect(), connect()
    other.execute("SET idempotency.claim_wait = '3s'")
    result = {}

    def late_claim():
        started = time.monotonic()
        result["r"] = claim(other, "waited", {"a": 1})
        result["elapsed"] = time.monotonic() - started

    with holder.transaction():
        claim(holder, "waited", {"a": 1})
        t = threading.Thread(target=late_claim)
        t.start()
        time.sleep(0.5)
        holder.execute("SELECT idempotency.complete('waited', '{\"ok\": 1}')")
    t.join(10)
    assert result["r"][0] == "replay", result
    assert 0.4 < result["elapsed"] < 3.0
    # With a short wait, the answer is in_progress after about that long.
    other.execute("SET idempotency.claim_wait = '300ms'")
    with holder.transaction():
        claim(holder, "waited-2")
        started = time.monotonic()
        assert claim(other, "waited-2")[0] == "in_progress"
        assert 0.25 < time.monotonic() - started < 2.0


def test_backfill_of_many_keys_in_one_statement(db):
    n = db.execute(
        "SELECT count(*) FROM generate_series(1, 100000) i WHERE (idempotency.claim('bf-' || i, ttl => '1 hour')).outcome = 'new'"
    ).fetchone()[0]
    assert n == 100000


@pytest.mark.parametrize("trial", range(3))
@pytest.mark.parametrize("keys", ["shared_past_own_1000", "all_1500_in_opposite_orders"])
def test_two_large_transactions_sharing_keys_answer_in_progress_and_never_deadlock(connect, keys, trial):
    """Two open transactions claim the same keys in opposite orders, past their first 1,000:
    after 1,000 keys of their own, 500 shared ones; or the same 1,500 keys, one from the first,
    the other from the last. Each shared key answers new in one of them and in_progress in the
    other, and no deadlock (40P01). The portable edition marks only a transaction's first 1,000
    keys (the lock table is shared); past them its inserts used to wait for each other's
    uncommitted rows, a deadlock. Now a claim past its transaction's first 1,000 keys waits for
    no one, and where both are past them (the shared keys after 1,000 of their own), both stay
    open until both answered: nothing waits, as natively. A claim within its transaction's
    first 1,000 keys still waits for the other's unmarked keys until that commits
    (docs/managed.md), so in the other case each commits once it answered."""
    a, b = connect(), connect()
    if keys == "shared_past_own_1000":
        own, shared = 1000, [f"dl{trial}-s{i}" for i in range(500)]
    else:
        own, shared = 0, [f"dl{trial}-s{i}" for i in range(1500)]
    barrier = threading.Barrier(2)
    answers = {}

    def run(name, conn, order):
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '17s'")
            for i in range(own):
                assert claim(conn, f"dl{trial}-{name}{i}", ttl="1 hour")[0] == "new"
            barrier.wait(60)
            answers[name] = {k: claim(conn, k, ttl="1 hour")[0] for k in order}
            # The claims left the session's own lock_timeout as it was.
            answers[name + "-lock_timeout"] = conn.execute("SHOW lock_timeout").fetchone()[0]
            if own:
                barrier.wait(60)  # both open until both answered every shared key

    errors = []

    def thread(*args):
        try:
            run(*args)
        except Exception as e:  # surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=thread, args=("a", a, shared)),
               threading.Thread(target=thread, args=("b", b, shared[::-1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not [e for e in errors if not isinstance(e, threading.BrokenBarrierError)], errors
    assert not errors, errors
    assert answers["a-lock_timeout"] == answers["b-lock_timeout"] == "17s", answers
    for k in shared:
        assert sorted((answers["a"][k], answers["b"][k])) == ["in_progress", "new"], (k, answers["a"][k], answers["b"][k])
    stored = a.execute("SELECT count(*) FROM idempotency.idempotency_keys WHERE key LIKE %s",
                       (f"dl{trial}-%",)).fetchone()[0]
    assert stored == 2 * own + len(shared), stored


def test_mismatch_logs_one_warning_with_hash_prefixes(db):
    notices = []
    db.add_notice_handler(lambda d: notices.append((d.severity_nonlocalized, d.message_primary)))
    assert claim(db, "mm", {"a": 1})[0] == "new"
    assert claim(db, "mm", {"a": 2})[0] == "mismatch"
    warnings = [m for s, m in notices if s == "WARNING"]
    assert len(warnings) == 1, notices
    stored = db.execute("SELECT encode(request_hash, 'hex') FROM idempotency.idempotency_keys WHERE key = 'mm'").fetchone()[0]
    given = db.execute("SELECT encode(idempotency.canonical_hash('{\"a\": 2}'), 'hex')").fetchone()[0]
    w = warnings[0]
    assert 'key="mm"' in w and 'scope=""' in w
    assert f"stored_hash={stored[:12]}" in w and f"request_hash={given[:12]}" in w, w


def test_repeatable_read_claims_read_their_snapshot(connect):
    a, b = connect(), connect()
    claim(b, "rr-old", {"a": 1})
    b.execute("SELECT idempotency.complete('rr-old', '{\"v\": 1}')")
    a.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert claim(a, "rr-old", {"a": 1})[0] == "replay"
    assert claim(a, "rr-new", {"a": 1})[0] == "new"
    # A key another session claims and commits after our snapshot cannot be claimed here:
    # the claim fails with a serialization failure instead of answering from a stale view.
    assert claim(b, "rr-race")[0] == "new"
    try:
        claim(a, "rr-race")
        raise AssertionError("expected a serialization failure")
    except psycopg.errors.SerializationFailure:
        pass
    a.execute("ROLLBACK")
    assert claim(b, "rr-new", {"a": 1})[0] == "new", "the rolled-back claim left nothing"


def test_a_lock_on_a_keys_number_held_elsewhere_makes_no_write_wait(connect):
    """The portable edition marks a key being written with a transaction-scoped advisory lock on
    a 64-bit hash of its scope and key, a number any role can compute and lock itself (an
    application's own pg_advisory_lock may also take it). While another session holds it,
    complete, checkpoint, release, forget and sweep of the key write at once, as natively: only
    the row's own lock orders writes (before, each waited for that session, a hostile role's
    included, until statement_timeout)."""
    db, other = connect(), connect()
    keys = ("lk-complete", "lk-checkpoint", "lk-release", "lk-forget", "lk-swept")
    tokens = {}
    for k in keys:
        outcome, tokens[k] = claim(db, k, ttl="1 second" if k == "lk-swept" else "1 hour",
                                   lease="1 second" if k == "lk-swept" else "1 minute")[:2]
        assert outcome == "new", (k, outcome)
    for k in keys:
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 5432))", (f"0:{k}",))
    assert other.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
                         ).fetchone()[0] == len(keys)
    time.sleep(1.1)  # lk-swept expires
    db.execute("SET statement_timeout = '10s'")
    assert db.execute("SELECT idempotency.complete('lk-complete', '{\"ok\": 1}', token => %s) IS NOT NULL",
                      (tokens["lk-complete"],)).fetchone()[0] is True
    db.execute("SELECT idempotency.checkpoint('lk-checkpoint', 'step-2', token => %s)", (tokens["lk-checkpoint"],))
    assert db.execute("SELECT idempotency.release('lk-release', token => %s)", (tokens["lk-release"],)).fetchone()[0]
    assert db.execute("SELECT idempotency.forget('lk-forget')").fetchone()[0] is True
    assert db.execute("SELECT idempotency.sweep()").fetchone()[0] == 1
    rows = dict(db.execute("SELECT key, status::text || coalesce(':' || recovery_point, '') "
                           "FROM idempotency.idempotency_keys WHERE key LIKE 'lk-%'").fetchall())
    assert rows == {"lk-complete": "completed", "lk-checkpoint": "in_progress:step-2"}, rows
    other.execute("SELECT pg_advisory_unlock_all()")


def test_a_write_marks_its_key_once_a_claims_check_lets_go(connect):
    """A claim checks whether another open transaction marked a key by taking the key's lock
    number shared for an instant. A write that tries to mark the key in that instant (complete,
    forget) tries again instead of writing unmarked: unmarked, a claim during the write's open
    transaction answered from the last committed row (a replay of the response being forgotten,
    an in_progress with the lease's retry_after) where natively, and marked, it answers
    in_progress with idempotency.busy_retry_after (1 s). The check's instant is held open here
    by a third session's shared lock, let go once the write is trying again."""
    import datetime

    db, writer, checker, other = connect(), connect(), connect(), connect()
    tokens = {k: claim(db, k, lease="5 minutes")[1] for k in ("tk-complete", "tk-forget")}
    db.execute("SELECT idempotency.complete('tk-forget', '{\"done\": 1}', token => %s)", (tokens["tk-forget"],))
    writer_pid = writer.execute("SELECT pg_backend_pid()").fetchone()[0]
    for key, write, args in (("tk-complete", "SELECT idempotency.complete('tk-complete', '{}', token => %s)",
                              (tokens["tk-complete"],)),
                             ("tk-forget", "SELECT idempotency.forget('tk-forget')", ())):
        number = f"0:{key}"
        checker.execute("SELECT pg_advisory_lock_shared(hashtextextended(%s, 5432))", (number,))
        writer.execute("BEGIN")
        done = threading.Event()
        thread = threading.Thread(target=lambda: (writer.execute(write, args), done.set()))
        thread.start()
        deadline = time.monotonic() + 10
        while not done.is_set() and time.monotonic() < deadline:  # natively nothing waits
            if other.execute("SELECT wait_event FROM pg_stat_activity WHERE pid = %s",
                             (writer_pid,)).fetchone()[0] == "PgSleep":
                break  # trying again
            time.sleep(0.001)
        checker.execute("SELECT pg_advisory_unlock_shared(hashtextextended(%s, 5432))", (number,))
        thread.join(10)
        assert done.is_set(), key
        outcome = claim(other, key)
        writer.execute("ROLLBACK")
        assert (outcome[0], outcome[4]) == ("in_progress", datetime.timedelta(seconds=1)), (key, outcome)



def test_a_completion_waits_for_a_takeover_or_forget_in_flight_and_answers_from_what_it_left(connect):
    """A complete whose key another open transaction is taking over (its claim had expired) or
    forgetting waits for that transaction, then answers from the row it left: it completes the
    new claim (no token), refuses the old token as stale (IK003), finds a forgotten key gone
    (IK001). Answered from the rows before the other transaction, it said IK001, IK001, IK002."""
    db, other, worker, watcher = connect(), connect(), connect(), connect()
    worker_pid = worker.execute("SELECT pg_backend_pid()").fetchone()[0]

    def expired(key):
        token = claim(db, key, lease="1 minute")[1]
        db.execute("UPDATE idempotency.idempotency_keys SET locked_until = now() - interval '2 s', "
                   "expires_at = now() - interval '1 s' WHERE key = %s", (key,))
        return token, "in_progress"

    def completed(key):
        token = claim(db, key)[1]
        db.execute("SELECT idempotency.complete(%s, '{\"first\": 1}', token => %s)", (key, token))
        return token, "completed"

    cases = [
        # (key, its setup, the other transaction's call, the worker's call, its answer)
        ("wt-new", expired, "SELECT idempotency.claim('wt-new')", "SELECT idempotency.complete('wt-new', '{}')", "ok"),
        ("wt-old", expired, "SELECT idempotency.claim('wt-old')",
         "SELECT idempotency.complete('wt-old', '{}', token => {token})", "IK003"),
        ("wt-gone", completed, "SELECT idempotency.forget('wt-gone')", "SELECT idempotency.complete('wt-gone', '{}')", "IK001"),
    ]
    for key, setup, theirs, mine, expected in cases:
        token, status = setup(key)
        assert db.execute("SELECT status::text, token FROM idempotency.idempotency_keys WHERE key = %s",
                          (key,)).fetchone() == (status, token)
        answer = {}

        def call():
            try:
                worker.execute(mine.replace("{token}", str(token)))
                answer["r"] = "ok"
            except psycopg.Error as e:
                answer["r"] = e.sqlstate

        with other.transaction():
            assert other.execute(theirs).fetchone()[0] is not None
            thread = threading.Thread(target=call)
            thread.start()
            waited = False
            deadline = time.monotonic() + 10
            while thread.is_alive() and time.monotonic() < deadline:
                if watcher.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                   (worker_pid,)).fetchone()[0] == "Lock":
                    waited = True
                    break
                time.sleep(0.005)
            assert waited and "r" not in answer, (key, answer)
        thread.join(10)
        assert answer.get("r") == expected, (key, answer)
        row = db.execute("SELECT status::text, token > %s FROM idempotency.idempotency_keys WHERE key = %s",
                         (token, key)).fetchone()
        assert row == {"ok": ("completed", True), "IK003": ("in_progress", True), "IK001": None}[expected], (key, row)


def test_a_completion_does_not_wait_for_a_row_lock_alone_nor_in_repeatable_read(connect):
    """A completion waits only for a transaction writing its key's row, in READ COMMITTED: one
    that only locks the row (FOR SHARE) is not waited for (IK002 at once for a completed key),
    and in REPEATABLE READ a takeover committed after the snapshot gives IK001 (no live claim
    in the snapshot), not 40001, as natively."""
    db, other, worker = connect(), connect(), connect(autocommit=False)
    worker.execute("SET lock_timeout = '3s'")
    worker.commit()
    token = claim(db, "lk-done")[1]
    db.execute("SELECT idempotency.complete('lk-done', '{}', token => %s)", (token,))
    with other.transaction():
        assert other.execute("SELECT token FROM idempotency.idempotency_keys WHERE key = 'lk-done' FOR SHARE"
                             ).fetchall() == [(token,)]
        started = time.monotonic()
        with pytest.raises(psycopg.Error) as exc:
            worker.execute("SELECT idempotency.complete('lk-done', '{}', token => %s)", (token,))
        worker.rollback()
        assert exc.value.sqlstate == "IK002" and time.monotonic() - started < 1.5, exc.value
    for key, with_token in (("rr-any", False), ("rr-old", True)):
        old = claim(db, key, lease="1 minute")[1]
        db.execute("UPDATE idempotency.idempotency_keys SET locked_until = now() - interval '2 s', "
                   "expires_at = now() - interval '1 s' WHERE key = %s", (key,))
        worker.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        assert worker.execute("SELECT token FROM idempotency.idempotency_keys WHERE key = %s", (key,)).fetchone() == (old,)
        new = claim(other, key)  # a takeover, committed after the worker's snapshot
        assert new[0] == "new" and new[1] > old, new
        with pytest.raises(psycopg.Error) as exc:
            worker.execute("SELECT idempotency.complete(%s, '{}', token => %s)", (key, old if with_token else None))
        assert exc.value.sqlstate == "IK001", (key, exc.value.sqlstate, str(exc.value))
        worker.rollback()


def test_a_refused_completion_leaves_the_key_to_other_claims(connect):
    """A complete that is refused changes no row, so it must not make other sessions' claims of
    its key answer in_progress while it runs: a completed key replays its stored response (IK002),
    an absent or expired key is claimed anew (IK001), and a claim whose lease ran out is taken
    over (IK003 for a token never issued), at once, as natively. The refusing call is held open
    here between finding nothing to complete and raising (complete's own error ends its
    transaction's locks): _complete, the part of complete that answers NULL where complete
    raises, in an open transaction. In the portable edition the refusal had marked the key
    first, and every such claim answered in_progress until the refusing transaction ended."""
    db, refuser, claimer = connect(), connect(), connect()
    claimer.execute("SET lock_timeout = '3s'")
    request = {"pay": 7}

    def completed(key):
        token = claim(db, key, request)[1]
        db.execute("SELECT idempotency.complete(%s, '{\"paid\": 7}', token => %s)", (key, token))
        return token, ("completed", token)

    def absent(key):
        return None, None

    def expired(key):
        token = claim(db, key, request, lease="1 minute")[1]
        db.execute("UPDATE idempotency.idempotency_keys SET locked_until = now() - interval '2 s', "
                   "expires_at = now() - interval '1 s' WHERE key = %s", (key,))
        return token, ("in_progress", token)

    def lease_ran_out(key):
        token = claim(db, key, request, lease="1 minute")[1]
        db.execute("UPDATE idempotency.idempotency_keys SET locked_until = now() - interval '1 s' WHERE key = %s",
                   (key,))
        return token + 1000, ("in_progress", token)

    cases = [
        # (key, its setup, complete's refusal, the other session's answer)
        ("rf-completed", completed, "IK002", ("replay", {"paid": 7}, 200)),
        ("rf-absent", absent, "IK001", ("new", None, None)),
        ("rf-expired", expired, "IK001", ("new", None, None)),
        ("rf-lease-ran-out", lease_ran_out, "IK003", ("new", None, None)),
    ]
    for key, setup, refusal, expected in cases:
        token, row = setup(key)
        assert db.execute("SELECT status::text, token FROM idempotency.idempotency_keys WHERE key = %s",
                          (key,)).fetchone() == row, key
        with pytest.raises(psycopg.Error) as exc:
            db.execute("SELECT idempotency.complete(%s, '{\"again\": 1}', token => %s)", (key, token))
        assert exc.value.sqlstate == refusal, (key, exc.value.sqlstate, str(exc.value))
        refuser.execute("BEGIN")
        assert refuser.execute("SELECT idempotency._complete(%s, '{\"again\": 1}', 200, '', %s, NULL)",
                               (key, token)).fetchone() == (None,), key
        started = time.monotonic()
        answer = claim(claimer, key, request)
        elapsed = time.monotonic() - started
        refuser.execute("ROLLBACK")
        assert (answer[0], answer[2], answer[3]) == expected, (key, answer)
        assert elapsed < 1.0, (key, elapsed)


def test_replays_of_a_completed_key_answer_while_completions_of_it_are_refused(connect):
    """A loop of refused completions of a completed key (IK002) beside a loop of its replays:
    every replay answers the stored response. In the portable edition about one in five
    answered in_progress, each refusal having marked the key while it ran."""
    db, refuser, replayer = connect(), connect(), connect()
    token = claim(db, "rf-loop", {"n": 1})[1]
    db.execute("SELECT idempotency.complete('rf-loop', '{\"done\": 1}', token => %s)", (token,))
    assert db.execute("SELECT status::text FROM idempotency.idempotency_keys WHERE key = 'rf-loop'"
                      ).fetchone() == ("completed",)
    stop = threading.Event()
    refusals = []

    def refuse():
        while not stop.is_set():
            try:
                refuser.execute("SELECT idempotency.complete('rf-loop', '{}', token => %s)", (token,))
                refusals.append("ok")
            except psycopg.Error as e:
                refusals.append(e.sqlstate)

    thread = threading.Thread(target=refuse)
    thread.start()
    answers = []
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            answers.append(claim(replayer, "rf-loop", {"n": 1})[:3])
    finally:
        stop.set()
        thread.join(10)
    assert refusals and set(refusals) == {"IK002"}, set(refusals)
    others = [a for a in answers if a != ("replay", token, {"done": 1})]
    assert answers and not others, (len(others), len(answers), others[:3])
