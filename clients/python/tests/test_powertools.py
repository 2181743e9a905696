"""PostgresPersistenceLayer under the real aws-lambda-powertools decorators (no AWS involved)."""

import datetime as dt
import json
import threading
import time

import pytest

pytest.importorskip("aws_lambda_powertools")

from aws_lambda_powertools.utilities.idempotency import (IdempotencyConfig, idempotent,  # noqa: E402
                                                         idempotent_function)
from aws_lambda_powertools.utilities.idempotency.exceptions import (  # noqa: E402
    IdempotencyAlreadyInProgressError, IdempotencyValidationError)

from pg_idempotency.powertools import PostgresPersistenceLayer  # noqa: E402


class Killed(BaseException):
    """A process killed mid-function: Powertools' cleanup (delete the record) does not run."""


class Context:
    """The part of a LambdaContext that Powertools reads."""

    function_name = "orders"
    memory_limit_in_mb = 128
    invoked_function_arn = "arn:aws:lambda:eu-west-1:123456789012:function:orders"
    aws_request_id = "req-1"

    def __init__(self, remaining_ms=30_000):
        self.remaining_ms = remaining_ms

    def get_remaining_time_in_millis(self):
        return self.remaining_ms


def keys(db):
    return db.execute("SELECT key, status::text, response, response_status FROM idempotency.idempotency_keys "
                      "WHERE scope = 'powertools' ORDER BY key").fetchall()


def test_the_readme_snippet_finds_the_key_of_an_api_gateway_event(conninfo, db):
    """The README's config: an API Gateway event's body is a JSON string, so `body.order_id`
    found no key (and the handler ran twice); `powertools_json(body).order_id` does."""
    layer = PostgresPersistenceLayer(conninfo)
    calls = []
    config = IdempotencyConfig(event_key_jmespath="powertools_json(body).order_id", expires_after_seconds=3600)

    @idempotent(persistence_store=layer, config=config)
    def handler(event, context):
        calls.append(event)
        return {"statusCode": 201}

    event = {"body": json.dumps({"order_id": "o-9", "amount": 10}), "headers": {}}
    handler(event, Context())
    handler(event, Context())
    assert len(calls) == 1


def test_handler_runs_once_and_replays(conninfo, db):
    layer = PostgresPersistenceLayer(conninfo)
    calls = []

    @idempotent(persistence_store=layer, config=IdempotencyConfig(event_key_jmespath="body.order_id"))
    def handler(event, context):
        calls.append(event)
        return {"statusCode": 201, "order": event["body"]["order_id"]}

    event = {"body": {"order_id": "o-1", "amount": 10}}
    assert handler(event, Context()) == {"statusCode": 201, "order": "o-1"}
    assert handler(event, Context()) == {"statusCode": 201, "order": "o-1"}
    assert len(calls) == 1
    [(key, status, response, status_code)] = keys(db)
    assert key.endswith("handler#" + layer._generate_hash("o-1"))
    assert (status, response, status_code) == ("completed", {"statusCode": 201, "order": "o-1"}, 200)


def test_idempotent_function_and_payload_validation(conninfo):
    layer = PostgresPersistenceLayer(conninfo)
    config = IdempotencyConfig(event_key_jmespath="order_id", payload_validation_jmespath="amount",
                               expires_after_seconds=600)
    calls = []

    @idempotent_function(data_keyword_argument="order", persistence_store=layer, config=config)
    def charge(order):
        calls.append(order)
        return {"charged": order["amount"]}

    assert charge(order={"order_id": "o-2", "amount": 5}) == {"charged": 5}
    assert charge(order={"order_id": "o-2", "amount": 5}) == {"charged": 5}
    with pytest.raises(IdempotencyValidationError):          # the extension's mismatch
        charge(order={"order_id": "o-2", "amount": 6})
    assert len(calls) == 1


def test_exception_deletes_the_in_progress_record(conninfo, db):
    layer = PostgresPersistenceLayer(conninfo)
    calls = []

    @idempotent_function(data_keyword_argument="job", persistence_store=layer, config=IdempotencyConfig())
    def job(job):
        calls.append(job)
        if len(calls) == 1:
            raise RuntimeError("downstream failed")
        return "done"

    with pytest.raises(RuntimeError):
        job(job={"id": 1})
    assert keys(db) == []                                       # released
    assert job(job={"id": 1}) == "done" and job(job={"id": 1}) == "done" and len(calls) == 2


def test_in_progress_then_taken_over_after_the_lambda_timeout(conninfo, db):
    layer = PostgresPersistenceLayer(conninfo)
    calls = []

    @idempotent(persistence_store=layer, config=IdempotencyConfig(event_key_jmespath="id"))
    def handler(event, context):
        calls.append(event)
        if event.get("crash") and len(calls) == 1:
            raise Killed("the runtime is killed mid-invocation")   # no cleanup runs
        return {"ok": len(calls)}

    with pytest.raises(Killed):
        handler({"id": "e-1", "crash": True}, Context(remaining_ms=2500))      # the lease: 2.5 s
    assert keys(db)[0][1] == "in_progress"
    with pytest.raises(IdempotencyAlreadyInProgressError):
        handler({"id": "e-1", "crash": True}, Context())
    time.sleep(2.6)
    assert handler({"id": "e-1", "crash": True}, Context()) == {"ok": 2}        # taken over
    assert handler({"id": "e-1", "crash": True}, Context()) == {"ok": 2}
    assert len(calls) == 2


def test_a_stuck_record_without_a_context_is_taken_over_after_the_layer_lease(conninfo):
    layer = PostgresPersistenceLayer(conninfo, lease=dt.timedelta(seconds=2))
    calls = []

    @idempotent_function(data_keyword_argument="msg", persistence_store=layer, config=IdempotencyConfig())
    def consume(msg):
        calls.append(msg)
        if len(calls) == 1:
            raise Killed("worker killed")
        return "consumed"

    with pytest.raises(Killed):
        consume(msg={"id": 3})
    with pytest.raises(IdempotencyAlreadyInProgressError):
        consume(msg={"id": 3})
    time.sleep(2.1)
    assert consume(msg={"id": 3}) == "consumed" and len(calls) == 2


def test_race_runs_once(conninfo):
    layer = PostgresPersistenceLayer(conninfo)
    calls = []

    @idempotent_function(data_keyword_argument="order", persistence_store=layer, config=IdempotencyConfig())
    def place(order):
        calls.append(order)
        time.sleep(0.5)
        return {"placed": order["id"]}

    outcomes = []
    barrier = threading.Barrier(8)

    def run():
        barrier.wait()
        try:
            outcomes.append(place(order={"id": 9}))
        except IdempotencyAlreadyInProgressError:
            outcomes.append("in progress")

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(map(str, outcomes)) == sorted(["{'placed': 9}"] + ["in progress"] * 7)
    assert place(order={"id": 9}) == {"placed": 9}


def test_get_record_reads_the_store(conninfo):
    layer = PostgresPersistenceLayer(conninfo)

    @idempotent_function(data_keyword_argument="x", persistence_store=layer, config=IdempotencyConfig())
    def f(x):
        return {"x": x}

    f(x=1)
    record = layer.get_record(1)
    assert record.status == "COMPLETED" and record.response_json_as_dict() == {"x": 1}
