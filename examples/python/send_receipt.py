#!/usr/bin/env python3
"""Sends an order receipt at most once per idempotency key, however often it is run: the
leased style of the idempotency extension around a side effect outside the database.

    PGHOST=... PGDATABASE=... python3 send_receipt.py --key order-42 --to a@example.com \
        --outbox /tmp/outbox.log

The side effect is "send an e-mail", simulated by appending one line to --outbox (a file: it
does not roll back with any transaction). Every outcome of claim is handled:

  new          send, checkpoint 'sent', complete (on a takeover at 'sent': just complete)
  replay       already sent: print the stored response, send nothing
  in_progress  another process is sending: wait retry_after, claim again
  mismatch     the key was used for another receipt: exit 3, never retry
  40001        repeat the claim (a concurrent claim changed the row)
  connection   reconnect and repeat the statement: after the send, the checkpoint and
               complete still carry our token, so the send is not repeated
  send fails   release the key (the next run is new) and exit 1
  IK003/IK002  on checkpoint/complete: another process took over after our lease ran out;
               claim again to learn the final answer (replay) instead of completing twice

Crash windows: a crash after the checkpoint resumes without sending again; a crash between
sending and the checkpoint sends again on takeover (pass the derived message id to a provider
that deduplicates on it to close that window too). --crash-after simulates both.
Exit codes: 0 done (new or replay), 1 send failed (released), 3 mismatch.
"""

import argparse
import json
import os
import sys
import time

import psycopg
from psycopg.types.json import Jsonb

SCOPE = "receipts"


class Fenced(Exception):
    pass


class Session:
    """One connection, re-opened when lost. Each statement is repeated after a lost connection:
    all of them are safe to repeat. A repeated claim finds our own claim (in_progress, then
    taken over after the lease); a repeated checkpoint with our token changes nothing; a
    repeated complete that had committed raises IK002 (handled as Fenced: claim again, replay)."""

    def __init__(self, conninfo, patience=60):
        self.conninfo, self.patience, self.conn = conninfo, patience, None

    def execute(self, sql, params):
        deadline = time.monotonic() + self.patience
        while True:
            try:
                if self.conn is None or self.conn.closed:
                    self.conn = psycopg.connect(self.conninfo, autocommit=True, application_name="send_receipt")
                return self.conn.execute(sql, params).fetchone()
            except psycopg.errors.SerializationFailure:
                time.sleep(0.05)             # 40001: a concurrent claim changed the row; repeat
            except psycopg.OperationalError as e:
                if time.monotonic() > deadline:
                    raise
                print(f"connection lost ({str(e).strip()}); reconnecting", file=sys.stderr)
                self.conn = None
                time.sleep(0.5)

    def fenced(self, sql, params):
        """checkpoint/complete with our token; IK002/IK003: another process owns the key now."""
        try:
            return self.execute(sql, params)
        except psycopg.Error as e:
            if e.sqlstate in ("IK002", "IK003"):
                raise Fenced(e.diag.message_primary) from e
            raise


def send_email(outbox, message_id, request, seconds, fail):
    time.sleep(seconds)                      # the latency of a real SMTP call
    if fail:
        raise RuntimeError("SMTP server refused the message")
    with open(outbox, "a") as f:
        f.write(json.dumps({"message_id": message_id, **request}) + "\n")


def send_receipt(db, args):
    request = {"to": args.to, "order": args.key}
    while True:
        try:
            outcome, token, response, retry_after, recovery_point = db.execute(
                "SELECT outcome::text, token, response, extract(epoch FROM retry_after)::float8, recovery_point"
                "  FROM idempotency.claim(%s, %s, scope => %s, lease => make_interval(secs => %s))",
                (args.key, Jsonb(request), SCOPE, args.lease))
            if outcome == "replay":
                return outcome, response
            if outcome == "mismatch":
                print(f"key {args.key!r} was used for a different receipt", file=sys.stderr)
                sys.exit(3)
            if outcome == "in_progress":
                time.sleep(retry_after)
                continue
            # new: a first attempt, or a takeover of a dead process' claim (recovery_point set)
            (message_id,) = db.execute("SELECT idempotency.derive_key(%s, 'email')", (args.key,))
            if recovery_point != "sent":
                try:
                    send_email(args.outbox, message_id, request, args.effect_seconds, args.fail_send)
                except Exception as e:
                    db.execute("SELECT idempotency.release(%s, %s, %s)", (args.key, SCOPE, token))
                    print(f"send failed, key released: {e}", file=sys.stderr)
                    sys.exit(1)
                if args.crash_after == "send":
                    os._exit(70)
                db.fenced("SELECT idempotency.checkpoint(%s, 'sent', %s, %s)", (args.key, SCOPE, token))
                if args.crash_after == "checkpoint":
                    os._exit(70)
            response = {"message_id": message_id, "sent_to": args.to}
            db.fenced("SELECT idempotency.complete(%s, %s, 200, %s, %s)", (args.key, Jsonb(response), SCOPE, token))
            return outcome, response
        except Fenced as e:
            print(f"fenced off ({e}); claiming again for the final answer", file=sys.stderr)


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
    outcome, response = send_receipt(Session(args.conninfo), args)
    print(json.dumps({"outcome": outcome, "response": response}))


if __name__ == "__main__":
    main()
