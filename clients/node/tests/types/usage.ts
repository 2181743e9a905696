// Compiled by `npm run typecheck` (tsc --noEmit): the declarations in index.d.ts fit the ways the
// README uses the package, and with express's and fastify's own types. Never run.

import express from 'express';
import Fastify from 'fastify';
import { Pool } from 'pg';
import {
  idempotent, currentClaim, idempotentTransaction, expressIdempotency, fastifyIdempotency,
  InProgressError, MismatchError, FencedError, IdempotencyError, parseIdempotencyKey, sfString,
  idempotentBatch, claimMany, completeMany,
  type CallResult, type BatchItem,
} from 'pg-idempotency';

const pool = new Pool();

const sendReceipt = idempotent(async (orderId: number, to: string) => {
  const claim = currentClaim();
  if (claim && claim.recoveryPoint !== 'sent') await claim.checkpoint('sent');
  const messageId: string | undefined = claim ? await claim.deriveKey('email', { n: 1 }) : undefined;
  void messageId;
  return { messageId: `m-${orderId}`, to };
}, { key: (orderId) => `order-${orderId}`, scope: 'receipts', ttl: '7 days', lease: 30, pool, wait: 5 });

async function useIt(): Promise<void> {
  const r: { messageId: string; to: string } = await sendReceipt(42, 'a@example.com');
  const d: CallResult<{ messageId: string; to: string }> = await sendReceipt.detailed(42, 'a@example.com');
  const replayed: boolean = d.replayed;
  // A replay is the JSON form of the result: a Date comes back as a string.
  void expressIdempotency({ pool, connectTimeout: 2, failOpen: false, lenientKeys: true, replayHeaders: ['location'] });
  const stamped = idempotent(async () => ({ at: new Date() }), { key: 'stamp', pool });
  const s = await stamped.detailed();
  if (s.replayed) {
    const at: string = s.value.at;
    void at;
  } else {
    const at: Date = s.value.at;
    void at;
  }
  // deserialize: a replay's value is what it returns
  const rebuilt = idempotent(async () => ({ at: new Date() }), { key: 'stamp2', pool, deserialize: (j: { at: string }) => ({ at: new Date(j.at) }) });
  const atAgain: Date = (await rebuilt()).at;
  void atAgain;
  // @ts-expect-error a replay's `at` is a string, not a Date
  const notADate: Date = (await stamped()).at;
  void notADate;
  // @ts-expect-error the arguments are checked
  await sendReceipt('42', 'a@example.com');
  try {
    await sendReceipt(43, 'b@example.com');
  } catch (err) {
    if (err instanceof InProgressError) {
      const secs: number = err.retryAfter;
      void secs;
    } else if (err instanceof MismatchError || err instanceof FencedError) {
      const code: string = err.code;
      void code;
    } else if (err instanceof IdempotencyError) {
      void err.key;
    }
  }
  await sendReceipt.close();
  const client = await pool.connect();
  const t = await idempotentTransaction(client, { key: 'k', request: { amount: 1 }, scope: 'payments' }, async (c, ctx) => {
    ctx.status = 201;
    const { rows } = await c.query<{ id: string }>('SELECT 1::text AS id');
    return { id: rows[0].id };
  });
  const id: string = t.value.id;
  const status: number = t.status;
  client.release();
  void r; void replayed; void id; void status;
}

const app = express();
const idem = expressIdempotency({ pool, client: (req) => req.headers['x-client-id'] as string | undefined, wait: 2 });
app.post('/orders', idem, express.json(), (req, res) => { res.status(201).json({ ok: true }); });
app.use(expressIdempotency({ connectionString: 'postgres://localhost/shop', methods: ['POST'] }));

async function fastifyApp(): Promise<void> {
  const f = Fastify();
  await f.register(fastifyIdempotency, { pool, client: (request) => request.headers['x-client-id'] as string | undefined });
  f.post('/orders', { config: { idempotency: true } }, async () => ({ ok: true }));
}

const key: string = parseIdempotencyKey('"abc"');
const header: string = sfString(key);
void useIt; void fastifyApp; void header;

interface SqsRecord { messageId: string; body: string }

const creditPoints = idempotentBatch(async (r: SqsRecord) => ({ credited: JSON.parse(r.body).points as number }),
  { key: (r) => r.messageId, scope: 'points', ttl: '4 days', lease: 120, pool, concurrency: 4 });

async function useBatch(records: SqsRecord[]): Promise<{ batchItemFailures: { itemIdentifier: string }[] }> {
  const items: BatchItem<SqsRecord, { credited: number }>[] = await creditPoints(records);
  for (const it of items) {
    if (it.ok) {
      const n: number = it.value.credited;
      void n;
    } else if (it.error instanceof MismatchError) {
      const k: string = it.key;
      void k;
    }
  }
  // @ts-expect-error the messages are checked
  await creditPoints([1, 2]);
  const cs = await claimMany(pool, ['a', 'b'], { requests: [{ n: 1 }, null], scope: 's', lease: 60 });
  const tokens: (string | null)[] = cs.map((c) => c.token);
  const expires: Date[] = await completeMany(pool, ['a', 'b'], [1, 2], { scope: 's', tokens, statuses: [200, 201] });
  void expires;
  await creditPoints.close();
  return { batchItemFailures: items.filter((it) => !it.ok).map((it) => ({ itemIdentifier: it.message.messageId })) };
}
void useBatch;

// The README's currentClaim() example, as written there (tsc --strict).
declare const payments: { charge(order: { id: number }, o: { idempotencyKey: string }): Promise<void> };
declare const shipping: { ship(order: { id: number }, o: { idempotencyKey: string }): Promise<void> };
export const fulfil = idempotent(async (order: { id: number }) => {
  const claim = currentClaim(); // undefined outside an idempotent() function
  if (!claim) throw new Error('fulfil runs inside idempotent() only');
  if (claim.recoveryPoint !== 'charged') {
    await payments.charge(order, { idempotencyKey: `${claim.key}:charge` });
    await claim.checkpoint('charged');
  }
  await shipping.ship(order, { idempotencyKey: `${claim.key}:ship` });
  return { shipped: order.id };
}, { key: (order) => `order-${order.id}`, scope: 'fulfilment', lease: '2 minutes' });
