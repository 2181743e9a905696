"""OpenTelemetry spans and metrics of the SQL API calls, when `opentelemetry-api` is installed
(the `otel` extra); without it every call here does nothing and nothing of OpenTelemetry is
imported.

One span per claim, complete, release and checkpoint (`idempotency.claim`, ...), the counter
`idempotency.claims` (by `idempotency.outcome`), the histogram `idempotency.claim.duration` and
the counter `idempotency.completion.retries`: the names and attributes are the same in the three
client packages (docs/operations.md, "Client traces and metrics"). No attribute carries the key
or the request: the key appears only as `idempotency.key_hash`, the first 16 hex digits of the
SHA-256 of scope, a NUL byte and key."""

from __future__ import annotations

import contextvars
import hashlib
import time
from typing import Any, Optional

try:  # the `otel` extra
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError:  # pragma: no cover - exercised by the test without the extra
    _trace = None

ENABLED = _trace is not None
NAME = "pg_idempotency"
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_current: "contextvars.ContextVar[Optional[Op]]" = contextvars.ContextVar("pg_idempotency_op", default=None)
_instruments = None


def key_hash(scope: str, key: str) -> str:
    """The first 16 hex digits of SHA-256(scope || NUL || key), UTF-8: the key's stand-in."""
    data = str(scope).encode("utf-8", "surrogatepass") + b"\0" + str(key).encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:16]


def _version() -> str:
    from . import __version__
    return __version__


def _get_instruments():
    """(tracer, claims counter, claim duration histogram, completion retries counter). The API's
    proxies follow a provider installed later."""
    global _instruments
    if _instruments is None:
        version = _version()
        tracer = _trace.get_tracer(NAME, version)
        meter = _metrics.get_meter(NAME, version)
        claims = meter.create_counter("idempotency.claims", unit="{claim}",
                                      description="Claims, by the outcome the extension returned")
        try:
            duration = meter.create_histogram(
                "idempotency.claim.duration", unit="s", description="Duration of a claim, reconnects included",
                explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS))
        except TypeError:  # opentelemetry-api before 1.23
            duration = meter.create_histogram("idempotency.claim.duration", unit="s",
                                              description="Duration of a claim, reconnects included")
        retries = meter.create_counter(
            "idempotency.completion.retries", unit="{retry}",
            description="complete, checkpoint and release repeated on a new connection after a broken one")
        _instruments = (tracer, claims, duration, retries)
    return _instruments


def retried() -> None:
    """A statement of the current operation is repeated on a new connection."""
    op = _current.get()
    if op is not None:
        op.retries += 1


def _error_type(e: BaseException) -> str:
    """The SQLSTATE of a database error (IK003, ...), else the exception's class name. Never its
    message: a message may name the key."""
    for err in (e, getattr(e, "__cause__", None)):
        state = getattr(err, "sqlstate", None)
        if state:
            return state
    return type(e).__name__


class Op:
    """One call of the SQL API as a span: `with Op("claim", scope, key) as op: ...`."""

    __slots__ = ("name", "span", "retries", "start", "outcome", "error", "_token", "_use")

    def __init__(self, name: str, scope: str, key: str, token: Optional[int] = None,
                 claim_wait: Optional[float] = None):
        self.name, self.retries, self.outcome, self.error, self.span, self._use = name, 0, None, None, None, None
        if not ENABLED:
            return
        attrs = {"idempotency.scope": scope, "idempotency.key_hash": key_hash(scope, key)}
        if token is not None:
            attrs["idempotency.token"] = token
        if claim_wait is not None:
            attrs["idempotency.claim_wait"] = float(claim_wait)
        self.span = _get_instruments()[0].start_span("idempotency." + name, kind=SpanKind.CLIENT, attributes=attrs)
        self.start = time.monotonic()

    def __enter__(self) -> "Op":
        self._token = _current.set(self)
        if self.span is not None:
            # The span is current while the statement runs: a psycopg instrumentation's spans nest in it.
            self._use = _trace.use_span(self.span, end_on_exit=False)
            self._use.__enter__()
        return self

    def claimed(self, result: Any) -> None:
        """The claim's answer: outcome, replay, token, retry_after, a recovery point."""
        self.outcome = result.outcome
        if self.span is None:
            return
        s = self.span
        s.set_attribute("idempotency.outcome", result.outcome)
        s.set_attribute("idempotency.replay", result.outcome == "replay")
        if result.token is not None and result.outcome in ("new", "replay"):
            s.set_attribute("idempotency.token", result.token)
        if result.retry_after is not None:
            s.set_attribute("idempotency.retry_after", result.retry_after.total_seconds())
        if result.outcome == "new":
            s.set_attribute("idempotency.resumed", result.recovery_point is not None)

    def waited(self, seconds: float) -> None:
        """The HTTP middleware waited that long for an in-progress key before this answer."""
        if self.span is not None:
            self.span.set_attribute("idempotency.waited", seconds)

    def failed(self, e: BaseException) -> None:
        """The call failed with `e`, which the caller handles (an answer of its own)."""
        self.error = _error_type(e)

    def released(self, released: bool) -> None:
        if self.span is not None:
            self.span.set_attribute("idempotency.released", bool(released))

    def __exit__(self, exc_type, exc, tb) -> bool:
        _current.reset(self._token)
        if self.span is None:
            return False
        if self._use is not None:
            self._use.__exit__(None, None, None)
        _, claims, duration, retries = _get_instruments()
        s = self.span
        s.set_attribute("idempotency.retries", self.retries)
        metric_attrs = {}
        err = _error_type(exc) if exc is not None else self.error
        if err is not None:
            s.set_attribute("error.type", err)
            s.set_status(Status(StatusCode.ERROR))
            metric_attrs["error.type"] = err
        if self.name == "claim":
            if self.outcome is not None:
                metric_attrs["idempotency.outcome"] = self.outcome
            claims.add(1, metric_attrs)
            duration.record(time.monotonic() - self.start, metric_attrs)
        elif self.retries:
            retries.add(self.retries, {"idempotency.operation": self.name})
        s.end()
        return False
