#!/usr/bin/env python3
"""Sends an order receipt at most once per idempotency key, however often it is run: the
`@idempotent` decorator of pg-idempotency around a side effect outside the database. The same
command line and exit codes as the Node package's examples/send_receipt.js.

    pip install pg-idempotency   # or the wheel built from clients/python
    PGHOST=... PGDATABASE=... python3 send_receipt.py --key order-42 --to a@example.com \
        --outbox /tmp/outbox.log

The side effect is "send an e-mail", simulated by appending one line to --outbox. What the
decorator does for each outcome of claim:

  new          runs send_receipt (on a takeover at checkpoint 'sent': just completes)
  replay       returns the stored response; nothing is sent
  in_progress  another process is sending: polls until it is done (or its lease ends: takeover)
  mismatch     the key was used for another receipt: Mismatch (exit 3 here)
  send fails   the exception releases the key (the next run is new): exit 1 here
  connection   the statement is repeated on a new connection; checkpoint and complete carry
               this attempt's token, so nothing is sent twice
  fenced       another process took over after our lease ran out: claim again, return its answer

Exit codes: 0 done (new or replay), 1 send failed (released), 3 mismatch.
"""

import argparse
import datetime as dt
import json
import logging
import os
import sys
import time

from pg_idempotency import Mismatch, Store, current_attempt, idempotent

SCOPE = "receipts"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--key", required=True, help="idempotency key: the same on every retry")
    p.add_argument("--to", required=True)
    p.add_argument("--outbox", required=True, help="file the simulated e-mails are appended to")
    p.add_argument("--conninfo", default="", help="libpq connection string (default: PG* variables)")
    p.add_argument("--lease", type=float, default=30, help="seconds another process waits before taking over")
    p.add_argument("--effect-seconds", type=float, default=0, help="how long sending takes")
    p.add_argument("--fail-send", action="store_true", help="simulate a failed send")
    p.add_argument("--crash-after", choices=["send", "checkpoint"], help="simulate a crash")
    args = p.parse_args()
    logging.basicConfig(stream=sys.stderr, format="%(message)s")   # "connection lost ...; reconnecting"

    store = Store(args.conninfo, application_name="send_receipt")
    ran = []

    @idempotent(key=lambda to: args.key, scope=SCOPE, request=lambda to: {"to": to, "order": args.key},
                lease=dt.timedelta(seconds=args.lease), wait=dt.timedelta(hours=1), store=store)
    def send_receipt(to):
        ran.append(True)
        attempt = current_attempt()
        message_id = store.derive_key(args.key, "email")
        if attempt.recovery_point != "sent":              # a takeover at 'sent' does not send again
            time.sleep(args.effect_seconds)              # the latency of a real SMTP call
            if args.fail_send:
                raise RuntimeError("SMTP server refused the message")
            with open(args.outbox, "a") as f:
                f.write(json.dumps({"message_id": message_id, "to": to, "order": args.key}) + "\n")
            if args.crash_after == "send":
                os._exit(70)
            attempt.checkpoint("sent")
            if args.crash_after == "checkpoint":
                os._exit(70)
        return {"message_id": message_id, "sent_to": to}

    try:
        response = send_receipt(args.to)
    except Mismatch:
        print(f"key {args.key!r} was used for a different receipt", file=sys.stderr)
        sys.exit(3)
    except RuntimeError as e:
        print(f"send failed, key released: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps({"outcome": "new" if ran else "replay", "response": response}))


if __name__ == "__main__":
    main()
