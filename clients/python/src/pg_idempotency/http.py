"""The HTTP behaviour shared by the ASGI and Django middlewares, after the IETF draft
"The Idempotency-Key HTTP Header Field" (draft-ietf-httpapi-idempotency-key-header):

- `Idempotency-Key` is a Structured Field String (RFC 9651): `"..."`, parameters allowed and
  ignored; missing or malformed: 400 problem+json.
- the scope is `<client>:<METHOD> <path>`, so two clients or two routes never share a key;
- the request fingerprint is `idempotency.request_fingerprint(method, path, query, body)`,
  computed by the server (a JSON body as jsonb, any other body by its SHA-256);
- new: the handler runs and its answer goes out untouched but for the idempotency headers; what
  is stored is its status, body, content type and the headers of an allow-list (`Location`,
  `Content-Location`, `ETag`, `Last-Modified`, `Link` by default: never `Set-Cookie`, `Date` or a
  per-request id); replay: that stored answer with `Idempotent-Replayed: true`; in_progress: 409
  with Retry-After; mismatch: 422;
- every answer about a claimed key carries `Idempotency-Expires` (the key's expires_at as an
  HTTP date, rounded down) and echoes `Idempotency-Key`.
"""

from __future__ import annotations

import base64
import datetime as dt
import email.utils
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple
from urllib.parse import parse_qsl

from ._core import IN_PROGRESS, LEASE_COLUMN, MISMATCH, NEW, REPLAY, ClaimResult

HEADER = "idempotency-key"
MAX_KEY = 255

CLAIM_HTTP_SQL = """
SELECT c.outcome::text, c.token, c.response::text, c.response_status,
       extract(epoch FROM c.retry_after)::float8, c.expires_at, c.recovery_point,""" + LEASE_COLUMN + """
  FROM idempotency.claim(
           %(key)s,
           request => to_jsonb(encode(idempotency.request_fingerprint(
               %(method)s, %(path)s, %(query)s::text::jsonb,
               CASE WHEN %(body_json)s::text IS NOT NULL THEN %(body_json)s::text::jsonb
                    WHEN %(body_bytes)s::bytea IS NOT NULL
                    THEN jsonb_build_object('sha256', encode(sha256(%(body_bytes)s::bytea), 'hex'))
               END), 'hex')),
           scope => %(scope)s, ttl => %(ttl)s::interval, lease => %(lease)s::interval) c"""

EXPIRES_SQL = "SELECT l.expires_at FROM idempotency.lookup(%(key)s, scope => %(scope)s) l WHERE l.key IS NOT NULL"

# The headers of a handler's answer that are stored and replayed (besides Content-Type), unless
# configured otherwise: those that describe the resource, not the one response. Set-Cookie, Date,
# per-request ids and hop-by-hop headers are never in it.
REPLAY_HEADERS = ("location", "content-location", "etag", "last-modified", "link")
# Never replayed, whatever the allow-list says.
NEVER_REPLAYED = {"content-length", "date", "server", "set-cookie", "transfer-encoding", "connection", "keep-alive",
                  "idempotency-expires", "idempotency-key", "idempotent-replayed", "retry-after"}


class KeyError400(Exception):
    """A missing or malformed Idempotency-Key; the message is the problem's detail."""


# --- RFC 9651 -------------------------------------------------------------------------------

_LCALPHA = set("abcdefghijklmnopqrstuvwxyz")
_DIGITS = set("0123456789")
_ALPHA = _LCALPHA | set("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_TCHAR = _ALPHA | _DIGITS | set("!#$%&'*+-.^_`|~")
_B64 = _ALPHA | _DIGITS | set("+/=")


class _Parser:
    def __init__(self, text: str):
        self.s, self.i = text, 0

    def peek(self):
        return self.s[self.i] if self.i < len(self.s) else ""

    def fail(self, what: str):
        raise KeyError400(f"Idempotency-Key has a malformed parameter at position {self.i + 1}: {what}")

    def string(self) -> str:
        self.i += 1  # the opening quote
        out = []
        while True:
            c = self.peek()
            if c == "":
                raise KeyError400("Idempotency-Key starts with '\"' but has no closing quote")
            self.i += 1
            if c == "\\":
                n = self.peek()
                if n not in ('"', "\\"):
                    raise KeyError400(f"Idempotency-Key has a bad escape at position {self.i}: "
                                      "only \\\" and \\\\ may follow a backslash")
                self.i += 1
                out.append(n)
            elif c == '"':
                return "".join(out)
            elif not (0x20 <= ord(c) <= 0x7E):
                raise KeyError400(f"Idempotency-Key has a bad character at position {self.i} "
                                  f"(byte 0x{c.encode('utf-8')[0]:02x}): "
                                  "a String may hold printable ASCII only")
            else:
                out.append(c)

    def bare_item_type(self) -> str:
        """Skips one bare item (a parameter's value) and returns its type's name."""
        c = self.peek()
        if c == '"':
            self.string()
            return "a String"
        if c in _DIGITS or c == "-":
            self.i += 1
            while self.peek() in _DIGITS or (self.peek() == "." and self.peek() != ""):
                self.i += 1
            return "a number"
        if c == "?":
            self.i += 1
            if self.peek() not in ("0", "1") or self.peek() == "":
                self.fail("a malformed Boolean")
            self.i += 1
            return "a Boolean"
        if c == ":":
            self.i += 1
            while self.peek() in _B64 and self.peek() != "":
                self.i += 1
            if self.peek() != ":":
                self.fail("a malformed Byte Sequence")
            self.i += 1
            return "a Byte Sequence"
        if c == "@":
            self.i += 1
            if self.peek() not in _DIGITS and self.peek() != "-":
                self.fail("a malformed Date")
            self.bare_item_type()
            return "a Date"
        if c == "%":
            self.i += 1
            if self.peek() != '"':
                self.fail("a malformed Display String")
            self.string()
            return "a Display String"
        if c != "" and (c in _ALPHA or c == "*"):
            self.i += 1
            while self.peek() != "" and (self.peek() in _TCHAR or self.peek() in ":/"):
                self.i += 1
            return "a Token"
        self.fail("an unexpected character" if c else "a missing value")

    def parameters(self):
        while self.peek() == ";":
            self.i += 1
            while self.peek() == " ":
                self.i += 1
            c = self.peek()
            if c == "" or not (c in _LCALPHA or c == "*"):
                self.fail("a malformed parameter")
            while self.peek() != "" and (self.peek() in _LCALPHA or self.peek() in _DIGITS or self.peek() in "_-.*"):
                self.i += 1
            if self.peek() == "=":
                self.i += 1
                self.bare_item_type()


EXAMPLE = 'Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"'
# A bare (unquoted, Stripe-style) key, accepted in lenient mode: printable ASCII without space,
# double quote, comma or backslash.
_BARE = set(chr(c) for c in range(0x21, 0x7F)) - set('",\\')


def _item_kind(c: str) -> str:
    if c == "-" or c in _DIGITS:
        return "an Integer or Decimal"
    if c == "*" or c in _ALPHA:
        return "a bare Token"
    return {":": "a Byte Sequence", "?": "a Boolean", "@": "a Date", "%": "a Display String",
            "(": "an Inner List"}.get(c, "not a structured-field Item")


def _check_length(key: str) -> str:
    if not key:
        raise KeyError400("Idempotency-Key is empty; it must have 1 to 255 characters")
    if len(key) > MAX_KEY:
        raise KeyError400(f"Idempotency-Key is too long: {len(key)} characters, at most {MAX_KEY} are allowed")
    return key


def parse_key(values: List[str], lenient: bool = False) -> str:
    """The key from the Idempotency-Key field lines; raises KeyError400 with the detail (the same
    wording as the Node and Rust packages). `lenient`: a bare key (`Idempotency-Key: 8e03978e-...`,
    as Stripe-style clients send it) is accepted as the key, besides the String of the draft."""
    if not values:
        raise KeyError400(f"This operation requires an Idempotency-Key header, e.g. {EXAMPLE}")
    if len(values) > 1:
        raise KeyError400("Idempotency-Key was sent more than once; send exactly one")
    p = _Parser(values[0].strip(" \t"))
    if p.peek() == "":
        raise KeyError400("Idempotency-Key is empty; it must have 1 to 255 characters")
    if p.peek() != '"':
        if lenient and all(ch in _BARE for ch in p.s):
            return _check_length(p.s)
        raise KeyError400(f"Idempotency-Key is {_item_kind(p.peek())}, not a String: the key must be a "
                          f"structured-field String (RFC 9651) in double quotes, e.g. {EXAMPLE}")
    key = p.string()
    p.parameters()
    if p.s[p.i:].lstrip(" \t").startswith(","):
        # Two field lines, as a server that combines them (RFC 9110 5.3) passes them on.
        raise KeyError400("Idempotency-Key was sent more than once; send exactly one")
    if p.i != len(p.s):
        raise KeyError400(f"Idempotency-Key has characters after the closing quote at position {p.i + 1}: "
                          "only parameters (;name or ;name=value) may follow the String")
    return _check_length(key)


# --- requests and responses -------------------------------------------------------------------

@dataclass
class Request:
    method: str
    path: str
    query_string: str
    headers: List[Tuple[str, str]]  # names lower-case
    body: bytes
    client: str = ""

    def header_values(self, name: str) -> List[str]:
        return [v for k, v in self.headers if k == name]


@dataclass
class Response:
    status: int
    headers: List[Tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


@dataclass
class Policy:
    """ttl/lease as for claim; wait: how long a duplicate polls for the first request before it
    answers 409; methods: the methods handled (others pass through); required: whether a request
    of those methods without the header is refused (400) or passes through untouched."""

    ttl: Optional[dt.timedelta] = None
    lease: Optional[dt.timedelta] = None
    wait: dt.timedelta = dt.timedelta(0)
    methods: frozenset = frozenset({"POST", "PATCH"})
    required: bool = True
    store_server_errors: bool = False
    lenient_keys: bool = False
    problem_base: str = "https://developer.example.com/idempotency/"
    replay_headers: frozenset = frozenset(REPLAY_HEADERS)
    connect_timeout: float = 5.0
    fail_open: bool = False


def problem(policy: Policy, status: int, slug: str, title: str, detail: str) -> Response:
    body = json.dumps({"type": policy.problem_base + slug, "title": title, "status": status, "detail": detail})
    return Response(status, [("content-type", "application/problem+json")], body.encode())


def unavailable(policy: Policy) -> Response:
    """503 with Retry-After: the database could not be reached in time, nothing was claimed."""
    r = problem(policy, 503, "database", "Database unavailable", "retry with the same Idempotency-Key")
    r.headers.append(("retry-after", "1"))
    return r


def http_date(t: dt.datetime) -> str:
    return email.utils.format_datetime(t.astimezone(dt.timezone.utc).replace(microsecond=0), usegmt=True)


def scope_of(req: Request) -> str:
    s = f"{req.client}:{req.method} {req.path}"
    if len(s) > 255:
        s = "sha256:" + hashlib.sha256(s.encode()).hexdigest()
    return s


def _is_json(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def claim_params(req: Request, key: str, policy: Policy):
    """The CLAIM_HTTP_SQL parameters, or a 400 Response for a query string the server cannot take."""
    if "\x00" in req.query_string or "%00" in req.query_string:
        return problem(policy, 400, "bad-request", "Bad request", "the query string contains a NUL character")
    query = {}
    for name, value in parse_qsl(req.query_string, keep_blank_values=True):
        if name in query:
            prev = query[name]
            query[name] = prev + [value] if isinstance(prev, list) else [prev, value]
        else:
            query[name] = value
    body_json = body_bytes = None
    if req.body:
        ctype = (req.header_values("content-type") or [""])[0]
        if _is_json(ctype):
            try:
                body_json = req.body.decode("utf-8")
            except UnicodeDecodeError:
                return problem(policy, 400, "bad-request", "Bad request", "the JSON body is not UTF-8")
        else:
            body_bytes = req.body
    return {"key": key, "method": req.method, "path": req.path, "query": json.dumps(query),
            "body_json": body_json, "body_bytes": body_bytes, "scope": scope_of(req),
            "ttl": policy.ttl, "lease": policy.lease}


def claim_error(policy: Policy, e: Exception) -> Optional[Response]:
    """A database error of the claim that is the request's fault, as a problem response."""
    # Django wraps the driver's error (DataError from psycopg's): the diagnostics are the cause's.
    cause = e if getattr(e, "diag", None) is not None else getattr(e, "__cause__", None)
    state = getattr(e, "sqlstate", None) or getattr(cause, "sqlstate", None)
    primary = getattr(getattr(cause, "diag", None), "message_primary", None)
    lines = str(e).strip().splitlines()
    detail = str(primary or (lines[0] if lines else type(e).__name__)).strip()
    if state in ("22P02", "22P05", "22003", "54001", "54000", "22021", "22025"):
        return problem(policy, 400 if state in ("22P02", "22021", "22025") else 422, "bad-body",
                       "The request body is not acceptable", detail)
    if state in ("22023", "22004"):
        return problem(policy, 400, "bad-request", "Bad request", detail)
    return None


def replayable(policy: Policy, headers) -> List[Tuple[str, str]]:
    """The headers of an answer that a replay carries: Content-Type and the allow-list."""
    allowed = {h.lower() for h in policy.replay_headers} - NEVER_REPLAYED
    return [(k.lower(), v) for k, v in headers if k.lower() == "content-type" or k.lower() in allowed]


def encode_response(resp: Response, policy: Optional[Policy] = None):
    """(JSON text, status) stored by complete. The stored form, the same in the Python, Node and
    Rust clients: {"headers": [[name, value], ...] (Content-Type and the allow-list, names
    lower-case), "content_type": ..., "body": text} with the body as text when it is UTF-8 without
    NUL (jsonb cannot hold NUL), else base64 in "body_base64" and in "body" with
    "encoding": "base64" (so that clients before 0.5.0 read it as well)."""
    headers = replayable(policy or Policy(), resp.headers)
    doc = {"headers": [[k, v] for k, v in headers]}
    ctype = next((v for k, v in headers if k == "content-type"), None)
    if ctype is not None:
        doc["content_type"] = ctype
    try:
        text = resp.body.decode("utf-8")
        if "\x00" in text:
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "NUL")
        doc["body"] = text
    except UnicodeDecodeError:
        b64 = base64.b64encode(resp.body).decode()
        doc.update(body=b64, encoding="base64", body_base64=b64)
    return json.dumps(doc, separators=(",", ":")), resp.status


_ENVELOPE = {"headers", "content_type", "body", "body_base64", "encoding"}


def decode_response(c: ClaimResult, policy: Optional[Policy] = None) -> Response:
    """The stored answer: the form above (also as clients before 0.5.0 wrote it), or a plain JSON
    value that other code completed the key with (sent as application/json)."""
    doc = c.response
    status = c.response_status or 200
    if doc is None:
        return Response(status, [], b"")
    if not (isinstance(doc, dict) and set(doc) <= _ENVELOPE
            and (isinstance(doc.get("body"), str) or isinstance(doc.get("body_base64"), str))):
        ctype = "application/problem+json" if status >= 400 else "application/json"
        return Response(status, [("content-type", ctype)], json.dumps(doc).encode())
    if isinstance(doc.get("body_base64"), str):
        body = base64.b64decode(doc["body_base64"])
    elif doc.get("encoding") == "base64":
        body = base64.b64decode(doc["body"])
    else:
        body = doc["body"].encode()
    headers = [(str(k), str(v)) for k, v in (doc.get("headers") or []) if isinstance(k, str)]
    if doc.get("content_type") and not any(k.lower() == "content-type" for k, _ in headers):
        headers.insert(0, ("content-type", str(doc["content_type"])))
    return Response(status, replayable(policy or Policy(), headers), body)


def finish(resp: Response, key_header: Optional[str], expires: Optional[dt.datetime] = None,
           replayed: bool = False, retry_after: Optional[int] = None) -> Response:
    h = [(k, v) for k, v in resp.headers if k.lower() not in ("idempotency-key", "idempotency-expires")]
    if key_header is not None and all(0x20 <= ord(ch) <= 0x7E for ch in key_header):
        h.append(("idempotency-key", key_header))           # echoed as sent (printable ASCII only)
    if expires is not None:
        h.append(("idempotency-expires", http_date(expires)))
    if replayed:
        h.append(("idempotent-replayed", "true"))
    if retry_after is not None:
        h.append(("retry-after", str(retry_after)))
    if not any(k.lower() == "cache-control" for k, _ in h):
        h.append(("cache-control", "no-store"))
    resp.headers = h
    return resp


def outcome_response(policy: Policy, c: ClaimResult, key_header: str, mismatch_expires=None) -> Response:
    """The answer for replay, in_progress and mismatch."""
    if c.outcome == REPLAY:
        return finish(decode_response(c, policy), key_header, c.expires_at, replayed=True)
    if c.outcome == IN_PROGRESS:
        secs = max(1, math.ceil(c.retry_after.total_seconds())) if c.retry_after else 1
        r = problem(policy, 409, "request-outstanding", "A request is outstanding for this Idempotency-Key",
                    f"The first request with this key is still being processed; retry in {secs} s")
        return finish(r, key_header, c.expires_at, retry_after=secs)
    assert c.outcome == MISMATCH
    r = problem(policy, 422, "key-reused", "Idempotency-Key is already used",
                "This key was used for a different request (method, path, query or body); "
                "use a new key for a new request")
    return finish(r, key_header, mismatch_expires)


def should_store(policy: Policy, resp: Response) -> bool:
    return resp.status < 500 or policy.store_server_errors


__all__ = ["parse_key", "KeyError400", "Request", "Response", "Policy", "NEW", "REPLAY", "IN_PROGRESS", "MISMATCH"]
