#!/usr/bin/env node
// Sends an order receipt at most once per idempotency key, however often it is run: the
// leased style of the idempotency extension around a side effect outside the database.
// The same program as examples/python/send_receipt.py, with the `pg` package.
//
//   PGHOST=... PGDATABASE=... node send_receipt.js --key order-42 --to a@example.com \
//       --outbox /tmp/outbox.log
//
// The side effect is "send an e-mail", simulated by appending one line to --outbox (a file: it
// does not roll back with any transaction). Every outcome of claim is handled:
//
//   new          send, checkpoint 'sent', complete (on a takeover at 'sent': just complete)
//   replay       already sent: print the stored response, send nothing
//   in_progress  another process is sending: wait retry_after, claim again
//   mismatch     the key was used for another receipt: exit 3, never retry
//   40001        repeat the claim (a concurrent claim changed the row)
//   connection   reconnect and repeat the statement: after the send, the checkpoint and
//                complete still carry our token, so the send is not repeated
//   send fails   release the key (the next run is new) and exit 1
//   IK003/IK002  on checkpoint/complete: another process took over after our lease ran out;
//                claim again to learn the final answer (replay) instead of completing twice
//
// Connection settings come from the PG* environment variables (PGHOST may be a socket
// directory) or --conninfo (a postgres:// URL). Exit codes: 0 done, 1 send failed, 3 mismatch.
'use strict';

const fs = require('node:fs');
const { parseArgs } = require('node:util');
const { Client } = require('pg');

const SCOPE = 'receipts';
const sleep = (s) => new Promise((resolve) => setTimeout(resolve, s * 1000));

class Fenced extends Error {}

// A lost connection (the server restarted, the backend was terminated, the network dropped).
function connectionLost(err) {
  return ['57P01', '57P02', '57P03', 'ECONNRESET', 'ECONNREFUSED', 'ENOENT', 'EPIPE'].includes(err.code) ||
    /Connection terminated|not queryable|Client was closed/.test(err.message);
}

// One connection, re-opened when lost. Each statement is repeated after a lost connection or
// a 40001: all of them are safe to repeat. A repeated claim finds our own claim (in_progress,
// then taken over after the lease); a repeated checkpoint with our token changes nothing; a
// repeated complete that had committed raises IK002 (handled as Fenced: claim again, replay).
class Session {
  constructor(conninfo, patience = 60) {
    this.conninfo = conninfo;
    this.patience = patience;
    this.client = null;
  }

  async query(sql, params) {
    const deadline = Date.now() + this.patience * 1000;
    for (;;) {
      try {
        if (this.client === null) {
          const client = new Client({
            ...(this.conninfo ? { connectionString: this.conninfo } : {}),
            application_name: 'send_receipt',
          });
          client.on('error', () => {}); // a dropped connection surfaces on the next query
          this.client = client;
          await client.connect();
        }
        return (await this.client.query(sql, params)).rows[0];
      } catch (err) {
        if (err.code === '40001') {
          await sleep(0.05); // a concurrent claim changed the row: repeat
        } else if (connectionLost(err) && Date.now() < deadline) {
          console.error(`connection lost (${err.message}); reconnecting`);
          const old = this.client;
          this.client = null;
          if (old !== null) await old.end().catch(() => {});
          await sleep(0.5);
        } else {
          throw err;
        }
      }
    }
  }

  // checkpoint/complete with our token; IK002/IK003: another process owns the key now.
  async fenced(sql, params) {
    try {
      return await this.query(sql, params);
    } catch (err) {
      if (err.code === 'IK002' || err.code === 'IK003') throw new Fenced(err.message);
      throw err;
    }
  }

  async end() {
    if (this.client !== null) await this.client.end().catch(() => {});
  }
}

async function sendEmail(outbox, messageId, request, seconds, fail) {
  await sleep(seconds); // the latency of a real SMTP call
  if (fail) throw new Error('SMTP server refused the message');
  fs.appendFileSync(outbox, JSON.stringify({ message_id: messageId, ...request }) + '\n');
}

async function sendReceipt(db, args) {
  const request = { to: args.to, order: args.key };
  for (;;) {
    try {
      const c = await db.query(
        `SELECT outcome::text, token::text, response, extract(epoch FROM retry_after)::float8 AS retry_after,
                recovery_point
           FROM idempotency.claim($1, $2::jsonb, scope => $3, lease => make_interval(secs => $4))`,
        [args.key, JSON.stringify(request), SCOPE, args.lease]);
      if (c.outcome === 'replay') return { outcome: c.outcome, response: c.response };
      if (c.outcome === 'mismatch') {
        console.error(`key '${args.key}' was used for a different receipt`);
        process.exit(3);
      }
      if (c.outcome === 'in_progress') {
        await sleep(c.retry_after);
        continue;
      }
      // new: a first attempt, or a takeover of a dead process' claim (recovery_point set).
      // The token is a bigint: passed back as text, never through a JavaScript number.
      const token = c.token;
      const { id: messageId } = await db.query("SELECT idempotency.derive_key($1, 'email') AS id", [args.key]);
      if (c.recovery_point !== 'sent') {
        try {
          await sendEmail(args.outbox, messageId, request, args.effectSeconds, args.failSend);
        } catch (err) {
          await db.query('SELECT idempotency.release($1, $2, $3::bigint)', [args.key, SCOPE, token]);
          console.error(`send failed, key released: ${err.message}`);
          process.exit(1);
        }
        if (args.crashAfter === 'send') process.exit(70);
        await db.fenced("SELECT idempotency.checkpoint($1, 'sent', $2, $3::bigint)", [args.key, SCOPE, token]);
        if (args.crashAfter === 'checkpoint') process.exit(70);
      }
      const response = { message_id: messageId, sent_to: args.to };
      await db.fenced('SELECT idempotency.complete($1, $2::jsonb, 200, $3, $4::bigint)',
        [args.key, JSON.stringify(response), SCOPE, token]);
      return { outcome: c.outcome, response };
    } catch (err) {
      if (!(err instanceof Fenced)) throw err;
      console.error(`fenced off (${err.message}); claiming again for the final answer`);
    }
  }
}

async function main() {
  const { values } = parseArgs({
    options: {
      key: { type: 'string' },
      to: { type: 'string' },
      outbox: { type: 'string' },
      conninfo: { type: 'string', default: '' },
      lease: { type: 'string', default: '30' },
      'effect-seconds': { type: 'string', default: '0' },
      'fail-send': { type: 'boolean', default: false },
      'crash-after': { type: 'string' },
    },
  });
  for (const required of ['key', 'to', 'outbox']) {
    if (!values[required]) throw new Error(`--${required} is required`);
  }
  if (values['crash-after'] && !['send', 'checkpoint'].includes(values['crash-after'])) {
    throw new Error('--crash-after must be send or checkpoint');
  }
  const db = new Session(values.conninfo);
  const result = await sendReceipt(db, {
    key: values.key, to: values.to, outbox: values.outbox,
    lease: Number(values.lease), effectSeconds: Number(values['effect-seconds']),
    failSend: values['fail-send'], crashAfter: values['crash-after'],
  });
  await db.end();
  console.log(JSON.stringify(result));
}

main().catch((err) => {
  console.error(err.message);
  process.exit(2);
});
