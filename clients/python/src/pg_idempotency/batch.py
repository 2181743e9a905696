"""`process_batch`: a queue consumer's batch of messages (an SQS receive of 10, a Kafka poll of
hundreds), each processed at most once per key.

One `claim_many` claims the whole batch in one round trip; the handler runs for the messages
that are `new`; one `complete_many` stores their results; a message whose handler raised is
released (its next delivery runs again); the others get their stored result (`replay`) or an
error of their own (Mismatch, InProgress). One message's failure never fails the batch: every
position gets an `Item` in input order, and the caller acks the `ok` ones and hands the rest back
to the queue (SQS `batchItemFailures`, a Kafka retry topic)."""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Generator, List, Optional, Sequence, Union

from ._core import IN_PROGRESS, MISMATCH, NEW, REPLAY, AsyncStore, Fenced, InProgress, Mismatch, Store

__all__ = ["Item", "process_batch", "aprocess_batch"]

# Item.outcome
FAILED = "failed"


@dataclass
class Item:
    """What became of one message of the batch (same position as in the input).

    outcome  "new": the handler ran now and its result is stored; "replay": the key was done
             already (by an earlier delivery, or earlier in this batch), `value` is the stored
             result and the handler did not run; "failed": see `error`.
    value    the handler's return value ("new"), the stored JSON decoded ("replay"), else None.
    error    None when ok; else Mismatch (the key was used for a different request: dead-letter
             it), InProgress (another consumer holds the key: redeliver later, after
             `error.retry_after`), or the exception the handler raised (the key was released)."""

    message: Any
    key: str
    outcome: str
    value: Any = None
    error: Optional[BaseException] = None

    @property
    def ok(self) -> bool:
        """Processed (now or before): ack the message."""
        return self.error is None


def process_batch(messages: Sequence[Any], *, key: Union[str, Callable[[Any], str]],
                  handler: Callable[[Any], Any], request: Optional[Callable[[Any], Any]] = None,
                  scope: str = "", ttl: Optional[dt.timedelta] = None, lease: Optional[dt.timedelta] = None,
                  store: Optional[Store] = None, conninfo: Optional[str] = None,
                  wait: dt.timedelta = dt.timedelta(0), release_on_error: bool = True) -> List[Item]:
    """Runs `handler(message)` at most once per key for a batch of messages; returns one Item per
    message, in input order.

    key      a callable of the message returning its key (the message id, a business id), or a
             string formatted with the message's members (`"order:{order_id}"`, a Mapping).
    handler  the side effect, called with one message; its return value must be JSON-serialisable
             (it is stored and replayed to later deliveries).
    request  a callable of the message giving what the key must always come with (compared by
             hash, a different one is Mismatch), or None (default: no check; a redelivered
             message often differs in delivery metadata such as SQS's receipt handle).
    scope, ttl, lease  as for @idempotent; the lease covers the whole batch's run, so make it
             longer than the batch takes.
    wait     how long to keep claiming the keys that another consumer holds (in_progress)
             before answering InProgress for them. Default 0: the batch does not wait, the queue
             redelivers those messages later.
    release_on_error  True (default): a handler exception releases that message's key, so its
             next delivery runs again; False: the claim stays until its lease ends.

    A key repeated within the batch runs once, at its first position; the later positions get
    its result as a replay (or its error). Lost connections are repeated as for @idempotent. If
    `complete_many` is refused (a position's claim was taken over after its lease ran out, or
    our own complete_many committed before its answer was lost), the positions are completed
    one by one, and those refused are claimed again for the stored answer."""
    steps = _steps(messages, key, request, scope, ttl, lease, wait, release_on_error)
    if store is None:
        store = Store(conninfo)
    reply = None
    while True:
        try:
            op, arg = steps.send(reply)
        except StopIteration as done:
            return done.value
        try:
            if op == "handle":
                value = handler(arg)
            elif op == "sleep":
                value = time.sleep(arg)
            else:
                value = getattr(store, op)(*arg)
            reply = (True, value)
        except Exception as e:
            reply = (False, e)


async def aprocess_batch(messages: Sequence[Any], *, key: Union[str, Callable[[Any], str]],
                         handler: Callable[[Any], Any], request: Optional[Callable[[Any], Any]] = None,
                         scope: str = "", ttl: Optional[dt.timedelta] = None, lease: Optional[dt.timedelta] = None,
                         store: Optional[AsyncStore] = None, conninfo: Optional[str] = None,
                         wait: dt.timedelta = dt.timedelta(0), release_on_error: bool = True) -> List[Item]:
    """process_batch for asyncio (an aiokafka consumer, say): the same steps on an AsyncStore;
    `handler` may be a coroutine function (its messages are still handled one after the other)."""
    steps = _steps(messages, key, request, scope, ttl, lease, wait, release_on_error)
    if store is None:
        store = AsyncStore(conninfo)
    reply = None
    while True:
        try:
            op, arg = steps.send(reply)
        except StopIteration as done:
            return done.value
        try:
            if op == "handle":
                value = handler(arg)
                if inspect.isawaitable(value):
                    value = await value
            elif op == "sleep":
                value = await asyncio.sleep(arg)
            else:
                value = await getattr(store, op)(*arg)
            reply = (True, value)
        except Exception as e:
            reply = (False, e)


def _key_function(key):
    if callable(key):
        return key
    if not isinstance(key, str):
        raise TypeError("process_batch: key must be a string or a callable of the message")

    def key_of(m):
        if "{" not in key:
            raise ValueError("process_batch: a constant key would make every message the same one; pass "
                             "key='prefix:{member}' or a callable of the message")
        if not isinstance(m, Mapping):
            raise TypeError(f"process_batch: key {key!r} is formatted with the message's members, but the "
                            f"message is a {type(m).__name__}; pass a callable")
        return key.format(**m)
    return key_of


def _steps(messages, key, request, scope, ttl, lease, wait, release_on_error) -> Generator:
    """The batch's logic as a generator of steps, (operation, argument): a store call
    ("claim_many", "complete_many", "complete", "release" with their arguments), "handle" (one
    message) or "sleep" (seconds). It is sent back (True, result) or (False, exception); it
    returns the items. process_batch and aprocess_batch run the steps, sync and async."""
    key_of = _key_function(key)
    msgs = list(messages)
    keys = [key_of(m) for m in msgs]
    for i, k in enumerate(keys):
        if not isinstance(k, str):
            raise TypeError(f"process_batch: the key of message {i} is a {type(k).__name__}, not a string")
    requests = None if request is None else [request(m) for m in msgs]

    def call(op, *args):
        ok, value = yield (op, args)
        if not ok:
            raise value
        return value

    items: List[Optional[Item]] = [None] * len(msgs)
    pending = list(range(len(msgs)))       # positions still to claim
    deadline = time.monotonic() + wait.total_seconds()
    pause = 0.05
    while pending:
        claims = yield from call("claim_many", [keys[i] for i in pending],
                                 None if requests is None else [requests[i] for i in pending], scope, ttl, lease)
        first: dict = {}                    # key -> position that claimed it new in this round
        done = []                           # (position, token, result as JSON text)
        waiting, followers = [], []
        for i, c in zip(pending, claims):
            if c.outcome == REPLAY:
                items[i] = Item(msgs[i], keys[i], REPLAY, c.response)
            elif c.outcome == MISMATCH:
                items[i] = Item(msgs[i], keys[i], FAILED, error=Mismatch(keys[i], scope))
            elif c.outcome == IN_PROGRESS:
                if keys[i] in first:
                    followers.append(i)     # the same key earlier in this batch: its result
                else:
                    waiting.append((i, c))
            else:
                assert c.outcome == NEW
                first[keys[i]] = i
                ok, value = yield ("handle", msgs[i])
                error = None if ok else value
                if ok:
                    try:
                        text = json.dumps(value, separators=(",", ":"))
                    except (TypeError, ValueError) as e:
                        error = TypeError(f"process_batch: the handler's result for key {keys[i]!r} is not "
                                          f"JSON-serialisable ({e})")
                if error is not None:       # this message fails, the batch goes on
                    if release_on_error:
                        released, release_error = yield ("release", (keys[i], scope, c.token))
                        if not released:    # the release failed: the lease ends the claim; the
                            error.release_error = release_error   # handler's error matters more
                    items[i] = Item(msgs[i], keys[i], FAILED, error=error)
                    continue
                items[i] = Item(msgs[i], keys[i], NEW, value)
                done.append((i, c.token, text))
        again = []
        if done:
            ok, e = yield ("complete_many", ([keys[i] for i, _, _ in done], [t for _, _, t in done], None, scope,
                                              [tok for _, tok, _ in done], ttl, True))
            if not ok and not isinstance(e, Fenced):
                raise e
            if not ok:                      # refused for one of them: one by one
                for i, tok, text in done:
                    ok, e = yield ("complete", (keys[i], text, 200, scope, tok, ttl, True))
                    if not ok and not isinstance(e, Fenced):
                        raise e
                    if not ok:
                        again.append(i)     # fenced: claim again for the stored answer
                        items[i] = None
        for i in followers:
            j = first[keys[i]]
            if items[j] is None:
                again.append(i)
            elif items[j].ok:
                items[i] = Item(msgs[i], keys[i], REPLAY, items[j].value)
            else:
                items[i] = Item(msgs[i], keys[i], FAILED, error=items[j].error)
        left = deadline - time.monotonic()
        if waiting and left <= 0:
            for i, c in waiting:
                items[i] = Item(msgs[i], keys[i], FAILED, error=InProgress(keys[i], scope, c.retry_after))
            waiting = []
        if waiting and not again:
            shortest = min(c.retry_after.total_seconds() for _, c in waiting)
            yield ("sleep", max(0.0, min(pause, left, shortest)))
            pause = min(pause * 2, 1.0)
        pending = sorted(again + [i for i, _ in waiting])
    return items
