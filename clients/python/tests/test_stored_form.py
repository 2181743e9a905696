"""The stored form of an HTTP answer (no server): Content-Type and the allow-list only, and the
rows older versions of the three packages wrote are read."""

import json

from pg_idempotency._core import ClaimResult
from pg_idempotency.http import Policy, Response, decode_response, encode_response


def claim(doc, status):
    return ClaimResult("k", "", "replay", 1, json.dumps(doc), status, None, None, None)


def test_only_content_type_and_the_allow_list_are_stored():
    text, status = encode_response(Response(201, [("content-type", "text/plain"), ("location", "/o/1"),
                                                  ("set-cookie", "s=1"), ("date", "x"), ("x-request-id", "r")],
                                            b"hi"))
    assert status == 201
    assert json.loads(text) == {"headers": [["content-type", "text/plain"], ["location", "/o/1"]],
                                "content_type": "text/plain", "body": "hi"}
    doc = json.loads(encode_response(Response(200, [], b"\xff\x00"))[0])
    assert doc["encoding"] == "base64" and doc["body"] == doc["body_base64"] == "/wA="
    custom = Policy(replay_headers=frozenset({"x-request-id"}))
    assert json.loads(encode_response(Response(200, [("x-request-id", "r")], b""), custom)[0])["headers"] == [
        ["x-request-id", "r"]]


def test_rows_of_older_versions_are_read():
    # Python before 0.5.0: every header but a few; a replay keeps only the allow-list.
    r = decode_response(claim({"headers": [["content-type", "text/plain"], ["x-request-id", "r"], ["etag", '"e"']],
                               "body_base64": "aGk="}, 201))
    assert (r.status, r.headers, r.body) == (201, [("content-type", "text/plain"), ("etag", '"e"')], b"hi")
    # Node before 0.5.0: body, encoding, content_type.
    r = decode_response(claim({"body": "aGk=", "encoding": "base64", "content_type": "text/plain"}, 200))
    assert (r.headers, r.body) == ([("content-type", "text/plain")], b"hi")
    # Rust before 0.5.0, or other code: the JSON body itself.
    r = decode_response(claim({"error": "x"}, 400))
    assert (r.headers, json.loads(r.body)) == ([("content-type", "application/problem+json")], {"error": "x"})
