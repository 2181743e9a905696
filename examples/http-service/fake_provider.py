#!/usr/bin/env python3
"""A fake payment service for the example HTTP service and its tests.

    python3 fake_provider.py --port 8081 --journal /tmp/provider.jsonl

POST /refunds needs an Idempotency-Key header. The first request with a key performs the refund:
it is appended to the journal (flushed and fsynced, so a restarted provider still knows it) and
answered 201 {"id": "re_..."}. A later request with the same key and the same body gets the same
answer again (Idempotent-Replayed: true) and refunds nothing; a different body gets 422.

Test controls:
    POST /_control {"next": ["crash", "hang"]}  what the next new refunds do after they are
        recorded: "crash" kills the whole process before it answers (os._exit), "hang" waits
        (up to 60 s) for {"release": true} before it answers
    POST /_control {"release": true}
    GET  /_charges  {"executions": <refunds performed>, "charges": [{key, id, body, calls}]}
"""

import argparse
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Provider:
    def __init__(self, journal):
        self.journal = journal
        self.lock = threading.Lock()
        self.charges = {}  # key -> {"id", "body", "calls"}
        self.next_modes = []
        self.release = threading.Event()
        if os.path.exists(journal):
            with open(journal) as f:
                for line in f:
                    rec = json.loads(line)
                    self.charges[rec["key"]] = {"id": rec["id"], "body": rec["body"], "calls": 1}

    def record(self, key, body):
        """Returns (record, replayed, mode)."""
        with self.lock:
            rec = self.charges.get(key)
            if rec is not None:
                rec["calls"] += 1
                return rec, True, "ok"
            rec = {"id": f"re_{len(self.charges) + 1:06d}", "body": body, "calls": 1}
            with open(self.journal, "a") as f:
                f.write(json.dumps({"key": key, "id": rec["id"], "body": body}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.charges[key] = rec
            mode = self.next_modes.pop(0) if self.next_modes else "ok"
            return rec, False, mode


def unquote(v):
    if len(v) >= 2 and v[0] == '"' and v[-1] == '"':
        return v[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return v


def make_handler(p):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def send_json(self, status, doc, headers=()):
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in headers:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def read_json(self):
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"null")

        def do_GET(self):
            if self.path != "/_charges":
                return self.send_json(404, {"title": "not found"})
            with p.lock:
                charges = [{"key": k, **v} for k, v in p.charges.items()]
            self.send_json(200, {"executions": len(charges), "charges": charges})

        def do_POST(self):
            try:
                body = self.read_json()
            except ValueError:
                return self.send_json(400, {"title": "body is not JSON"})
            if self.path == "/_control":
                with p.lock:
                    p.next_modes.extend(body.get("next", []))
                    if body.get("release"):
                        p.release.set()
                    else:
                        p.release.clear()
                return self.send_json(200, {"next": p.next_modes})
            if self.path != "/refunds":
                return self.send_json(404, {"title": "not found"})
            key = unquote(self.headers.get("Idempotency-Key", ""))
            if not key:
                return self.send_json(400, {"title": "Idempotency-Key is missing"})
            rec, replayed, mode = p.record(key, body)
            if rec["body"] != body:
                return self.send_json(422, {"title": "Idempotency-Key is already used"})
            if mode == "crash":
                os._exit(1)  # the refund is recorded, the answer is never sent
            if mode == "hang":
                p.release.wait(60)
            answer = {"id": rec["id"], **body}
            try:
                self.send_json(200 if replayed else 201, answer,
                               [("Idempotent-Replayed", "true")] if replayed else [])
            except OSError:
                pass  # the caller is gone

    return Handler


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=8081)
    ap.add_argument("--journal", default="fake_provider.jsonl")
    args = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(Provider(args.journal)))
    server.daemon_threads = True
    print(f"fake payment service on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
