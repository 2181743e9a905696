"""The conformance app on the Django middleware, served by wsgiref (threaded). Environment:
CONNINFO, PORT, WAIT, CONNECT_TIMEOUT, FAIL_OPEN (see ../README.md for the routes)."""

import datetime as dt
import json
import os
import sys
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import django
from django.conf import settings
from django.http import HttpResponse, JsonResponse
from django.urls import path

RUNS = {"n": 0}
LOCK = threading.Lock()


def run() -> int:
    with LOCK:
        RUNS["n"] += 1
        return RUNS["n"]


def orders(request):
    if request.method == "GET":
        return JsonResponse([], safe=False)
    n = run()
    time.sleep(int(request.headers.get("X-Sleep-Ms", "0")) / 1000)
    r = JsonResponse({"run": n}, status=201)
    r["Location"], r["ETag"], r["X-Request-Id"] = f"/orders/{n}", f'"v{n}"', f"r{n}"
    r.set_cookie("s", str(n))
    return r


def text(request):
    run()
    return HttpResponse(f"got {len(request.body)} bytes", content_type="text/plain; charset=utf-8")


def fail(request):
    run()
    return JsonResponse({"error": "boom"}, status=500)


def reject(request):
    run()
    return JsonResponse({"error": "bad"}, status=400)


def throw(request):
    run()
    raise RuntimeError("the handler throws")


def runs(request):
    return JsonResponse({"runs": RUNS["n"]})


urlpatterns = [path("orders", orders), path("text", text), path("fail", fail), path("reject", reject),
               path("throw", throw), path("runs", runs)]

settings.configure(
    DEBUG=False, ALLOWED_HOSTS=["*"], ROOT_URLCONF=__name__, SECRET_KEY="conformance", USE_TZ=True,
    MIDDLEWARE=["pg_idempotency.django.IdempotencyMiddleware"], DATABASES={},
    IDEMPOTENCY={"CONNINFO": os.environ["CONNINFO"], "WAIT": dt.timedelta(seconds=float(os.environ.get("WAIT", "0"))),
                 "CONNECT_TIMEOUT": float(os.environ.get("CONNECT_TIMEOUT", "5")),
                 "FAIL_OPEN": os.environ.get("FAIL_OPEN") == "1"},
    LOGGING_CONFIG=None,
)
django.setup()


class Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    # socketserver's listen backlog is 5: a burst of concurrent requests (the racing duplicates)
    # would be reset by the kernel before a thread accepts them.
    request_queue_size = 128


class Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass


if __name__ == "__main__":
    from django.core.wsgi import get_wsgi_application
    make_server("127.0.0.1", int(os.environ["PORT"]), get_wsgi_application(), server_class=Server,
                handler_class=Quiet).serve_forever()
