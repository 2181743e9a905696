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
//   40001        claim again (a concurrent claim changed the row)
//   connection   reconnect, claim again (a claim that committed is found in_progress, then
//                taken over when its lease runs out)
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

// Errors after which claiming again is the right thing: 40001 and a lost connection.
function retryable(err) {
  return err.code === '40001' || err.code === '57P01' || err.code === 'ECONNRESET' ||
    err.code === 'ECONNREFUSED' || err.code === 'ENOENT' || /Connection terminated/.test(err.message);
}

async function fencedCall(client, sql, params) {
  try {
    await client.query(sql, params);
  } catch (err) {
    if (err.code === 'IK002' || err.code === 'IK003') throw new Fenced(err.message);
    throw err;
  }
}

async function sendEmail(outbox, messageId, request, seconds, fail) {
  await sleep(seconds); // the latency of a real SMTP call
  if (fail) throw new Error('SMTP server refused the message');
  fs.appendFileSync(outbox, JSON.stringify({ message_id: messageId, ...request }) + '\n');
}

async function sendReceipt(args) {
  const state = { client: null };
  try {
    return await attempts(args, state);
  } finally {
    if (state.client !== null) await state.client.end().catch(() => {});
  }
}

async function attempts(args, state) {
  const request = { to: args.to, order: args.key };
  let client = null;
  for (;;) {
    try {
      if (client === null) {
        client = new Client(args.conninfo ? { connectionString: args.conninfo } : {});
        client.on('error', () => {}); // a dropped connection surfaces on the next query
        state.client = client;
        await client.connect();
      }
      const { rows: [c] } = await client.query(
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
      const { rows: [d] } = await client.query("SELECT idempotency.derive_key($1, 'email') AS id", [args.key]);
      if (c.recovery_point !== 'sent') {
        try {
          await sendEmail(args.outbox, d.id, request, args.effectSeconds, args.failSend);
        } catch (err) {
          await client.query('SELECT idempotency.release($1, $2, $3::bigint)', [args.key, SCOPE, token]);
          console.error(`send failed, key released: ${err.message}`);
          process.exit(1);
        }
        if (args.crashAfter === 'send') process.exit(70);
        await fencedCall(client, "SELECT idempotency.checkpoint($1, 'sent', $2, $3::bigint)", [args.key, SCOPE, token]);
        if (args.crashAfter === 'checkpoint') process.exit(70);
      }
      const response = { message_id: d.id, sent_to: args.to };
      await fencedCall(client, 'SELECT idempotency.complete($1, $2::jsonb, 200, $3, $4::bigint)',
        [args.key, JSON.stringify(response), SCOPE, token]);
      return { outcome: c.outcome, response };
    } catch (err) {
      if (err instanceof Fenced) {
        console.error(`fenced off (${err.message}); claiming again for the final answer`);
      } else if (retryable(err)) {
        console.error(`${err.message}; claiming again`);
        if (err.code !== '40001') {
          await client.end().catch(() => {});
          client = state.client = null;
          await sleep(0.5);
        } else {
          await sleep(0.05);
        }
      } else {
        throw err;
      }
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
  const result = await sendReceipt({
    key: values.key, to: values.to, outbox: values.outbox, conninfo: values.conninfo,
    lease: Number(values.lease), effectSeconds: Number(values['effect-seconds']),
    failSend: values['fail-send'], crashAfter: values['crash-after'],
  });
  console.log(JSON.stringify(result));
}

main().catch((err) => {
  console.error(err.message);
  process.exit(2);
});
