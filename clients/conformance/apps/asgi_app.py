"""The conformance app on the ASGI middleware (Starlette, served by uvicorn). Environment:
CONNINFO, PORT, WAIT, CONNECT_TIMEOUT, FAIL_OPEN (see ../README.md for the routes)."""

import asyncio
import datetime as dt
import json
import os

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from pg_idempotency.asgi import IdempotencyMiddleware

RUNS = {"n": 0}


def run() -> int:
    RUNS["n"] += 1
    return RUNS["n"]


async def orders(request):
    await request.body()
    n = run()
    await asyncio.sleep(int(request.headers.get("x-sleep-ms", "0")) / 1000)
    return JSONResponse({"run": n}, status_code=201,
                        headers={"location": f"/orders/{n}", "etag": f'"v{n}"', "set-cookie": f"s={n}",
                                 "x-request-id": f"r{n}"})


async def text(request):
    body = await request.body()
    run()
    return PlainTextResponse(f"got {len(body)} bytes")


async def fail(request):
    run()
    return JSONResponse({"error": "boom"}, status_code=500)


async def reject(request):
    run()
    return JSONResponse({"error": "bad"}, status_code=400)


async def throw(request):
    run()
    raise RuntimeError("the handler throws")


async def listing(request):
    return JSONResponse([])


async def runs(request):
    return JSONResponse({"runs": RUNS["n"]})


app = Starlette(routes=[
    Route("/orders", orders, methods=["POST"]), Route("/orders", listing, methods=["GET"]),
    Route("/text", text, methods=["POST"]), Route("/fail", fail, methods=["POST"]),
    Route("/reject", reject, methods=["POST"]), Route("/throw", throw, methods=["POST"]),
    Route("/runs", runs, methods=["GET"]),
])
app.add_middleware(IdempotencyMiddleware, conninfo=os.environ["CONNINFO"],
                   wait=dt.timedelta(seconds=float(os.environ.get("WAIT", "0"))),
                   connect_timeout=float(os.environ.get("CONNECT_TIMEOUT", "5")),
                   fail_open=os.environ.get("FAIL_OPEN") == "1")

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(os.environ["PORT"]), log_level="error")
