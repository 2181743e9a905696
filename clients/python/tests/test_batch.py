"""Batches against a real cluster: Store.claim_many / complete_many, and process_batch for a queue
consumer's batch (every per-position outcome in one batch, a failing handler, a retried batch,
input order, fencing, a lost connection)."""

import datetime as dt
import threading

import psycopg
import pytest

from pg_idempotency import Fenced, InProgress, Item, Mismatch, Store, process_batch

SEC = dt.timedelta(seconds=1)


def test_store_claim_many_answers_each_position_in_input_order(conninfo, row):
    store = Store(conninfo)
    store.claim("done", {"n": 1}, "q")
    store.complete("done", {"ok": 1}, 200, "q")
    store.claim("held", None, "q", lease=dt.timedelta(minutes=5))
    keys = ["z-new", "done", "held", "done", "a-new", "z-new", "z-new"]
    requests = [{"n": 9}, {"n": 1}, None, {"n": 2}, None, {"n": 9}, {"n": 8}]
    cs = store.claim_many(keys, requests, scope="q", lease=dt.timedelta(minutes=1))
    assert [c.key for c in cs] == keys
    assert [c.outcome for c in cs] == ["new", "replay", "in_progress", "mismatch", "new", "in_progress", "mismatch"]
    assert cs[1].response == {"ok": 1} and cs[1].response_status == 200
    assert cs[2].retry_after > dt.timedelta(minutes=4)
    assert cs[0].token is not None and cs[4].token is not None
    assert row("z-new", "q")[0] == "in_progress" and row("a-new", "q")[0] == "in_progress"

    expires = store.complete_many(["z-new", "a-new"], [{"r": "z"}, [1, 2]], [201, 200], "q",
                                  [cs[0].token, cs[4].token], ttl=dt.timedelta(hours=1))
    assert len(expires) == 2 and all(isinstance(e, dt.datetime) for e in expires)
    assert row("z-new", "q")[:3] == ("completed", {"r": "z"}, 201)
    assert row("a-new", "q")[:3] == ("completed", [1, 2], 200)
    again = store.claim_many(["a-new", "z-new"], None, "q")
    assert [(c.outcome, c.response) for c in again] == [("replay", [1, 2]), ("replay", {"r": "z"})]
    assert store.claim_many([], None, "q") == []


def test_store_complete_many_is_all_or_nothing_and_raises_fenced(conninfo, row):
    store = Store(conninfo)
    a, b = store.claim_many(["a", "b"], scope="s")
    store.complete("b", "other", 200, "s")                     # b finished elsewhere
    with pytest.raises(Fenced) as e:
        store.complete_many(["a", "b"], ["ra", "rb"], scope="s", tokens=[a.token, b.token])
    assert e.value.sqlstate == "IK002" and "key 'b'" in str(e.value)
    assert row("a", "s")[0] == "in_progress"                  # nothing written
    with pytest.raises(ValueError, match="responses has 1 elements, keys 2"):
        store.complete_many(["a", "b"], ["ra"], scope="s")
    with pytest.raises(ValueError, match="requests has 3 elements, keys 1"):
        store.claim_many(["a"], [1, 2, 3], scope="s")


def test_async_store_claim_many_and_complete_many(conninfo, row):
    import asyncio

    from pg_idempotency import AsyncStore

    async def main():
        store = AsyncStore(conninfo)
        cs = await store.claim_many(["x", "y"], [1, 2], "as")
        await store.complete_many(["x", "y"], ["rx", "ry"], None, "as", [c.token for c in cs])
        again = await store.claim_many(["y", "x"], [2, 1], "as")
        await store.close()
        return cs, again

    cs, again = asyncio.run(main())
    assert [c.outcome for c in cs] == ["new", "new"]
    assert [(c.outcome, c.response) for c in again] == [("replay", "ry"), ("replay", "rx")]


def msg(mid, **body):
    return {"id": mid, "receipt": f"r-{mid}", **body}


def test_process_batch_every_outcome_in_one_batch_kept_in_input_order(conninfo, row):
    store = Store(conninfo)
    # Before the batch: m-done was processed by an earlier delivery, m-held is being processed by
    # another consumer, m-used was processed for another body.
    process_batch([msg("m-done", n=1)], key=lambda m: m["id"], handler=lambda m: {"n": m["n"]},
                  request=lambda m: {"n": m["n"]}, scope="q", store=store)
    process_batch([msg("m-used", n=1)], key=lambda m: m["id"], handler=lambda m: "first",
                  request=lambda m: {"n": m["n"]}, scope="q", store=store)
    store.claim("m-held", {"n": 3}, "q", lease=dt.timedelta(minutes=5))
    calls = []

    def handler(m):
        calls.append(m["id"])
        return {"handled": m["id"], "n": m["n"]}

    batch = [msg("m-new", n=4), msg("m-done", n=1), msg("m-held", n=3), msg("m-used", n=2),
             msg("m-new", n=4), msg("m-last", n=5)]
    items = process_batch(batch, key=lambda m: m["id"], handler=handler, request=lambda m: {"n": m["n"]},
                          scope="q", store=store)
    assert [it.message for it in items] == batch and [it.key for it in items] == [m["id"] for m in batch]
    assert [it.outcome for it in items] == ["new", "replay", "failed", "failed", "replay", "new"]
    assert calls == ["m-new", "m-last"]                        # the duplicate within the batch ran once
    assert items[0].value == {"handled": "m-new", "n": 4} and items[0].ok
    assert items[1].value == {"n": 1} and items[1].ok
    assert isinstance(items[2].error, InProgress) and items[2].error.retry_after > dt.timedelta(minutes=4)
    assert isinstance(items[3].error, Mismatch) and items[3].error.key == "m-used"
    assert items[4].value == items[0].value and items[4].ok   # the same message twice in the batch
    assert [it.ok for it in items] == [True, True, False, False, True, True]
    assert row("m-new", "q")[:3] == ("completed", {"handled": "m-new", "n": 4}, 200)
    assert row("m-last", "q")[0] == "completed" and row("m-held", "q")[0] == "in_progress"


def test_process_batch_a_failing_handler_releases_only_its_key_and_a_retry_runs_only_it(conninfo, row):
    runs = []
    broken = {"m2"}

    def handler(m):
        runs.append(m["id"])
        if m["id"] in broken:
            raise ConnectionError(f"downstream refused {m['id']}")
        return {"sent": m["id"], "to": m["to"]}

    batch = [msg(f"m{i}", to=f"u{i}@example.com") for i in range(1, 5)]
    first = process_batch(batch, key="msg:{id}", handler=handler, scope="mail", conninfo=conninfo)
    assert [it.outcome for it in first] == ["new", "failed", "new", "new"]
    assert isinstance(first[1].error, ConnectionError) and first[1].key == "msg:m2"
    assert row("msg:m2", "mail") is None                       # released: the next delivery runs it
    assert [row(f"msg:m{i}", "mail")[0] for i in (1, 3, 4)] == ["completed"] * 3
    failures = [it.message["receipt"] for it in first if not it.ok]   # what SQS would redeliver
    assert failures == ["r-m2"]

    broken.clear()
    runs.clear()
    retry = process_batch(batch, key="msg:{id}", handler=handler, scope="mail", conninfo=conninfo)
    assert runs == ["m2"]                                      # only the released one runs again
    assert [it.outcome for it in retry] == ["replay", "new", "replay", "replay"]
    assert [it.value for it in retry] == [{"sent": f"m{i}", "to": f"u{i}@example.com"} for i in range(1, 5)]
    assert all(it.ok for it in retry)


def test_process_batch_a_result_that_is_not_json_fails_that_message_only(conninfo, row):
    items = process_batch([{"id": "a"}, {"id": "b"}], key="k:{id}", conninfo=conninfo,
                          handler=lambda m: object() if m["id"] == "a" else "fine")
    assert items[0].outcome == "failed" and isinstance(items[0].error, TypeError)
    assert "not JSON-serialisable" in str(items[0].error)
    assert items[1].outcome == "new" and items[1].value == "fine"
    assert row("k:a") is None and row("k:b")[0] == "completed"


def test_process_batch_release_on_error_false_keeps_the_claim(conninfo, row):
    def handler(m):
        raise RuntimeError("boom")

    items = process_batch([{"id": "a"}], key="k:{id}", handler=handler, release_on_error=False,
                          lease=dt.timedelta(minutes=1), conninfo=conninfo)
    assert isinstance(items[0].error, RuntimeError)
    assert row("k:a")[0] == "in_progress"


def test_process_batch_waits_for_a_key_another_consumer_finishes(conninfo):
    store = Store(conninfo)
    held = store.claim("w", None, "q", lease=dt.timedelta(minutes=1))
    threading.Timer(0.3, lambda: Store(conninfo).complete("w", {"by": "other"}, 200, "q", held.token)).start()
    calls = []
    items = process_batch([{"id": "w"}, {"id": "v"}], key="{id}", handler=lambda m: calls.append(m) or "mine",
                          scope="q", store=store, wait=dt.timedelta(seconds=5))
    assert [(it.outcome, it.value) for it in items] == [("replay", {"by": "other"}), ("new", "mine")]
    assert calls == [{"id": "v"}]


def test_process_batch_takes_over_after_the_lease_and_a_fenced_complete_gets_the_stored_answer(conninfo, row):
    store = Store(conninfo)
    late = []

    def slow_then_overtaken(m):
        # While this consumer runs, its lease ends and another consumer takes m over and finishes.
        if not late:
            late.append(1)
            import time
            time.sleep(1.2)
            c = Store(conninfo).claim(m["id"], None, "f", lease=SEC)
            assert c.outcome == "new" and c.token is not None
            Store(conninfo).complete(m["id"], {"by": "other"}, 200, "f", c.token)
        return {"by": "me", "id": m["id"]}

    items = process_batch([{"id": "p"}, {"id": "q"}], key="{id}", handler=slow_then_overtaken, scope="f",
                          lease=SEC, store=store)
    # complete_many was refused for p (IK003/IK002): q is completed one by one, p replays the other's.
    assert [(it.outcome, it.value) for it in items] == [("replay", {"by": "other"}), ("new", {"by": "me", "id": "q"})]
    assert row("p", "f")[1] == {"by": "other"} and row("q", "f")[1] == {"by": "me", "id": "q"}


def test_process_batch_repeats_statements_after_a_lost_connection(conninfo, db, row):
    store = Store(conninfo)
    store.claim("warm")                                       # opens the store's connection
    pid = store.connection().info.backend_pid

    def handler(m):
        if m["id"] == "b":                                    # the backend dies mid-batch
            db.execute("SELECT pg_terminate_backend(%s)", (pid,))
        return m["id"]

    items = process_batch([{"id": "a"}, {"id": "b"}], key="{id}", handler=handler, scope="lost", store=store)
    assert [(it.outcome, it.value) for it in items] == [("new", "a"), ("new", "b")]
    assert row("a", "lost")[0] == "completed" and row("b", "lost")[0] == "completed"


def test_process_batch_rejects_a_constant_or_unusable_key(conninfo):
    with pytest.raises(ValueError, match="constant key"):
        process_batch([{"id": 1}], key="same", handler=lambda m: 1, conninfo=conninfo)
    with pytest.raises(TypeError, match="pass a callable"):
        process_batch(["text"], key="k:{id}", handler=lambda m: 1, conninfo=conninfo)
    with pytest.raises(TypeError, match="not a string"):
        process_batch([{"id": 1}], key=lambda m: m["id"], handler=lambda m: 1, conninfo=conninfo)
    assert process_batch([], key="k:{id}", handler=lambda m: 1, conninfo=conninfo) == []
    assert Item("m", "k", "new").ok


def test_aprocess_batch_runs_coroutine_handlers_with_the_same_outcomes(conninfo, row):
    import asyncio

    from pg_idempotency import AsyncStore, aprocess_batch

    calls = []

    async def handler(m):
        calls.append(m["id"])
        await asyncio.sleep(0)
        if m["id"] == "bad":
            raise RuntimeError("refused")
        return {"ok": m["id"]}

    async def main():
        store = AsyncStore(conninfo)
        await store.claim("held", None, "aq", lease=dt.timedelta(minutes=5))
        batch = [{"id": "a"}, {"id": "bad"}, {"id": "held"}, {"id": "a"}]
        first = await aprocess_batch(batch, key="{id}", handler=handler, scope="aq", store=store)
        again = await aprocess_batch(batch, key="{id}", handler=handler, scope="aq", store=store)
        await store.close()
        return first, again

    first, again = asyncio.run(main())
    assert [it.outcome for it in first] == ["new", "failed", "failed", "replay"]
    assert isinstance(first[1].error, RuntimeError) and isinstance(first[2].error, InProgress)
    assert first[3].value == {"ok": "a"}
    assert [it.outcome for it in again] == ["replay", "failed", "failed", "replay"]
    assert calls == ["a", "bad", "bad"]                       # a ran once; bad was released and ran again
    assert row("a", "aq")[0] == "completed" and row("bad", "aq") is None
