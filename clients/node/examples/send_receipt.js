#!/usr/bin/env node
// Sends an order receipt at most once per idempotency key, however often it is run: the leased
// style around a side effect outside the database, with pg-idempotency's idempotent(). The same
// command line, output and exit codes as the Python package's examples/send_receipt.py
// (tests/integration/test_clients.py runs both).
//
//   PGHOST=... PGDATABASE=... node send_receipt.js --key order-42 --to a@example.com \
//       --outbox /tmp/outbox.log
//
// The side effect is "send an e-mail", simulated by appending one line to --outbox. Outcomes:
// new: send, checkpoint 'sent', complete (a takeover at 'sent' only completes); replay: print
// the stored response; in_progress: wait (up to 60 s); mismatch: exit 3; the send fails: the key
// is released, exit 1; a lost connection: the package repeats the statement on a new one.
// --conninfo (a postgres:// URL) or the PG* variables. Exit codes: 0 done, 1 send failed,
// 3 mismatch, 70 a simulated crash (--crash-after send|checkpoint).
'use strict';

const fs = require('node:fs');
const { parseArgs } = require('node:util');
const { Pool } = require('pg');
const { idempotent, currentClaim, MismatchError } = require('pg-idempotency');

const sleep = (s) => new Promise((resolve) => setTimeout(resolve, s * 1000));

async function main() {
  const { values: a } = parseArgs({
    options: {
      key: { type: 'string' }, to: { type: 'string' }, outbox: { type: 'string' },
      conninfo: { type: 'string', default: '' }, lease: { type: 'string', default: '30' },
      'effect-seconds': { type: 'string', default: '0' }, 'fail-send': { type: 'boolean', default: false },
      'crash-after': { type: 'string' },
    },
  });
  for (const required of ['key', 'to', 'outbox']) {
    if (!a[required]) throw new Error(`--${required} is required`);
  }
  const pool = new Pool({ ...(a.conninfo ? { connectionString: a.conninfo } : {}), application_name: 'send_receipt' });
  const lost = (err) => console.error(`connection lost (${err.message}); reconnecting`);
  pool.on('error', lost);

  const send = idempotent(async (order, to) => {
    const claim = currentClaim();
    // On the claim's connection: a connection lost here is repeated, not a failed send.
    const messageId = await claim.deriveKey('email');
    if (claim.recoveryPoint !== 'sent') {
      await sleep(Number(a['effect-seconds'])); // the latency of a real SMTP call
      if (a['fail-send']) throw new Error('SMTP server refused the message');
      fs.appendFileSync(a.outbox, `${JSON.stringify({ message_id: messageId, to, order })}\n`);
      if (a['crash-after'] === 'send') process.exit(70);
      await claim.checkpoint('sent');
      if (a['crash-after'] === 'checkpoint') process.exit(70);
    }
    return { message_id: messageId, sent_to: to };
  }, {
    key: (order) => order, scope: 'receipts', lease: Number(a.lease), wait: 60,
    request: (order, to) => ({ to, order }), pool, onConnectionLost: lost,
  });

  try {
    const r = await send.detailed(a.key, a.to);
    console.log(JSON.stringify({ outcome: r.outcome, response: r.value }));
  } catch (err) {
    if (err instanceof MismatchError) {
      console.error(`key '${a.key}' was used for a different receipt`);
      process.exit(3);
    }
    console.error(`send failed, key released: ${err.message}`);
    process.exit(1);
  } finally {
    await pool.end();
  }
}

main().catch((err) => {
  console.error(err.message);
  process.exit(2);
});
