// Type declarations of pg-idempotency (the package is plain CommonJS; these are checked by
// `npm run typecheck` against tests/types/usage.ts).

import type { IncomingHttpHeaders, IncomingMessage, ServerResponse } from 'node:http';
import type { ClientBase, Pool } from 'pg';

/** A number of seconds, or a PostgreSQL interval string such as '5 minutes'. */
export type Interval = number | string;

/** Where the statements go. Without `pool` and `connectionString`: the PG* environment variables. */
export interface ConnectionOptions {
  /** A pg Pool of yours (give it an 'error' listener: a restart drops its idle connections). */
  pool?: Pool;
  /** A postgres:// URL or libpq keyword string for a pool of the package's own. */
  connectionString?: string;
  /** Size of the package's own pool (default 10). */
  poolSize?: number;
  /** application_name of the package's own pool (default 'pg-idempotency'). */
  applicationName?: string;
  /**
   * How long (ms) a statement is repeated on new connections after lost ones (default 30000). The
   * statements that finish a claim (complete, checkpoint, release) are repeated for as long as the
   * claim's lease lasts, if that is longer.
   */
  reconnectTimeout?: number;
  /** Told of every lost connection: a statement about to be repeated, an idle connection of the package's own pool dropped. */
  onConnectionLost?: (err: Error) => void;
}

export interface IdempotentOptions<A extends unknown[]> extends ConnectionOptions {
  /** The idempotency key: a string, or a function of the call's arguments. */
  key: string | ((...args: A) => string);
  /** Keys are unique per scope (default ''). */
  scope?: string;
  /** How long the result is remembered (default: the server's idempotency.default_ttl). */
  ttl?: Interval | null;
  /** How long a call may run before another may take the key over (default: the server's). */
  lease?: Interval | null;
  /** What is compared on a retry (hashed by the extension): default the arguments; null: nothing. */
  request?: ((...args: A) => unknown) | null;
  /** Seconds to wait while another call holds the key before throwing InProgressError (default 10). */
  wait?: number;
  /** Release the key when the function throws (default true): the next call runs again. */
  releaseOnError?: boolean | ((err: unknown) => boolean);
  /** response_status stored with the result (default 200). */
  status?: number;
  /**
   * The result's JSON text (default JSON.stringify). A result that cannot be serialized completes
   * the key with that error: the function never runs again for it, and this call and every retry
   * throw an IdempotencyError with code 'IDEMPOTENCY_UNSTORABLE'.
   */
  serialize?: (value: any) => string;
}

/**
 * What JSON.parse(JSON.stringify(value)) gives back for a value of type T: what a replay returns,
 * since the result is stored as jsonb. A Date becomes a string (its toJSON), a Map or Set an
 * empty object, members that are functions or undefined disappear, a bigint cannot be stored.
 */
export type Jsonified<T> =
  T extends { toJSON(...args: never[]): infer J } ? Jsonified<J>
  : T extends string | number | boolean | null ? T
  : T extends undefined | symbol | bigint | ((...args: never[]) => unknown) ? never
  : T extends ReadonlyArray<infer E> ? Array<Jsonified<E> extends never ? null : Jsonified<E>>
  : T extends ReadonlyMap<unknown, unknown> | ReadonlySet<unknown> ? Record<string, never>
  : T extends object ? { [K in keyof T as K extends symbol ? never : Jsonified<T[K]> extends never ? never : K]: Jsonified<T[K]> }
  : never;

interface CallResultBase {
  /** The fencing token of the claim (a bigint, as a string). */
  token: string;
  /** Until when a retry with the same key is recognised. */
  expiresAt: Date;
}

/** The function ran in this call: its own return value. */
export interface NewCallResult<T> extends CallResultBase {
  value: T;
  outcome: 'new';
  replayed: false;
}

/** A replay: the stored JSON form of the first call's result (or what `deserialize` made of it). */
export interface ReplayCallResult<T, D = Jsonified<T>> extends CallResultBase {
  value: D;
  outcome: 'replay';
  replayed: true;
}

/** Narrow on `replayed` (or `outcome`) to know which form `value` has. */
export type CallResult<T, D = Jsonified<T>> = NewCallResult<T> | ReplayCallResult<T, D>;

export interface IdempotentFunction<A extends unknown[], R, D = Jsonified<R>> {
  /** The function's own result when it ran, its stored JSON form on a replay (see Jsonified). */
  (...args: A): Promise<R | D>;
  /** The same call, with its outcome. */
  detailed(...args: A): Promise<CallResult<R, D>>;
  /** Ends the pool the wrapper made itself (from connectionString or the environment). */
  close(): Promise<void>;
}

/** Leased style: claim, run fn, complete with its result (or release when it throws). */
export function idempotent<A extends unknown[], R>(
  fn: (...args: A) => R | Promise<R>,
  options: IdempotentOptions<A> & { deserialize?: undefined },
): IdempotentFunction<A, Awaited<R>>;
/** With `deserialize`: a replay's value is what it makes of the stored JSON. */
export function idempotent<A extends unknown[], R, D>(
  fn: (...args: A) => R | Promise<R>,
  options: IdempotentOptions<A> & { deserialize: (json: any) => D },
): IdempotentFunction<A, Awaited<R>, D>;

/** The claim of the running idempotent function. */
export interface Claim {
  readonly key: string;
  readonly scope: string;
  readonly token: string;
  /** The last checkpoint: set when this call took the key over from one that died. */
  readonly recoveryPoint: string | null;
  readonly expiresAt: Date;
  /** Records progress; throws FencedError when another call has taken the key over. */
  checkpoint(point: string): Promise<void>;
  /** idempotency.derive_key(key, step, params): the key of one downstream side effect; repeated on a new connection if the connection is lost. */
  deriveKey(step: string, params?: unknown): Promise<string>;
}

/** Inside a function wrapped by idempotent(): its claim; elsewhere undefined. */
export function currentClaim(): Claim | undefined;

export interface TransactionOptions {
  key: string;
  /** The request to compare on retries (any JSON value); null/undefined: nothing compared. */
  request?: unknown;
  scope?: string;
  ttl?: Interval | null;
  lease?: Interval | null;
  /** response_status stored with the result (default 200; ctx.status may change it). */
  status?: number;
  /** How long the claim may wait for another open transaction's claim of the key. */
  claimWait?: number | string;
  /** true (default): BEGIN/COMMIT/ROLLBACK here; false: inside the caller's open transaction. */
  begin?: boolean;
}

export interface TransactionContext {
  readonly key: string;
  readonly scope: string;
  readonly token: string;
  readonly expiresAt: Date;
  readonly client: ClientBase;
  status: number;
}

export interface TransactionResult<T> {
  value: T;
  status: number;
  outcome: 'new' | 'replay';
  replayed: boolean;
  expiresAt: Date;
}

/** One-transaction style on your client: claim, fn, complete, commit; a throw rolls it all back. */
export function idempotentTransaction<T>(
  client: ClientBase,
  options: TransactionOptions,
  fn: (client: ClientBase, ctx: TransactionContext) => T | Promise<T>,
): Promise<TransactionResult<Awaited<T>>>;

/** Options of idempotentBatch: those of idempotent(), for one message. */
export interface BatchOptions<M> extends ConnectionOptions {
  /** The key of a message: its id, or a business id from its body. */
  key: (message: M) => string;
  /** Keys are unique per scope (default ''). */
  scope?: string;
  /** How long results are remembered (default: the server's idempotency.default_ttl). */
  ttl?: Interval | null;
  /** How long the batch owns its keys (default: the server's); make it longer than the batch takes. */
  lease?: Interval | null;
  /** What a key must come with (hashed by the extension); default: nothing compared (redeliveries differ in their metadata). */
  request?: ((message: M) => unknown) | null;
  /** Seconds to keep claiming keys that another consumer holds before they fail with InProgressError (default 0). */
  wait?: number;
  /** Release a message's key when its handler throws (default true): its next delivery runs again. */
  releaseOnError?: boolean | ((err: unknown) => boolean);
  /** response_status stored with each result (default 200). */
  status?: number;
  /** How many handlers run at once (default 1: one after the other, in input order). */
  concurrency?: number;
}

/** What became of one message of a batch; items come in the order of the messages. */
export type BatchItem<M, R> =
  | { message: M; key: string; outcome: 'new' | 'replay'; value: R; error: undefined; ok: true }
  | { message: M; key: string; outcome: 'failed'; value: undefined; error: unknown; ok: false };

export interface BatchFunction<M, R> {
  (messages: Iterable<M>): Promise<BatchItem<M, R>[]>;
  /** Ends the pool the function made itself (from connectionString or the environment). */
  close(): Promise<void>;
}

/** A queue consumer's batch: one claim_many, the handler for the new messages, one complete_many. */
export function idempotentBatch<M, R>(
  handler: (message: M) => R | Promise<R>,
  options: BatchOptions<M>,
): BatchFunction<M, Awaited<R>>;

/** One row of idempotency.claim_many. */
export interface ClaimManyResult {
  key: string;
  scope: string;
  outcome: 'new' | 'replay' | 'in_progress' | 'mismatch';
  /** The fencing token (a bigint, as a string); null for mismatch. */
  token: string | null;
  /** The stored response (replay). */
  response: unknown;
  responseStatus: number | null;
  /** Seconds (at least 1) until the holder's lease ends (in_progress). */
  retryAfter: number | null;
  expiresAt: Date | null;
  recoveryPoint: string | null;
}

export interface ClaimManyOptions {
  /** One request per key (any JSON value; null/undefined: none for that key). */
  requests?: unknown[] | null;
  scope?: string;
  ttl?: Interval | null;
  lease?: Interval | null;
}

/** idempotency.claim_many on your pool or client: one result per key, in input order. */
export function claimMany(q: Pool | ClientBase, keys: string[], options?: ClaimManyOptions): Promise<ClaimManyResult[]>;

export interface CompleteManyOptions {
  /** One response_status per key (default 200 each). */
  statuses?: number[] | null;
  scope?: string;
  /** One fencing token per key (from claimMany). */
  tokens?: (string | null)[] | null;
  ttl?: Interval | null;
  /** The responses are JSON texts already. */
  responsesAreJson?: boolean;
}

/** idempotency.complete_many: all or nothing (FencedError naming the refused key); each new expires_at. */
export function completeMany(
  q: Pool | ClientBase, keys: string[], responses: unknown[] | null, options?: CompleteManyOptions,
): Promise<Date[]>;

export interface HttpOptions<Req> extends ConnectionOptions {
  /** How long answers are remembered (default 86400 s). */
  ttl?: Interval;
  /** How long a request may run before a retry may take it over (default 60 s). */
  lease?: Interval;
  /** Seconds a duplicate waits for the first request to finish before answering 409 (default 0). */
  wait?: number;
  /** Methods that need a key (default ['POST', 'PATCH']). */
  methods?: string[];
  /** A request without a key is 400 (default true); false lets it through unprotected. */
  required?: boolean;
  /** The authenticated client, part of the scope; a falsy answer is 401. Without it the scope is the route. */
  client?: (req: Req) => string | null | undefined | Promise<string | null | undefined>;
  /** Prefix of the problem types (default 'https://developer.example.com/idempotency/'). */
  problemBase?: string;
  /** Which answers are stored (default status < 500); for the others the key is released. */
  storeResponse?: (status: number) => boolean;
  /** The headers a replay carries besides Content-Type (default Location, Content-Location, ETag, Last-Modified, Link). */
  replayHeaders?: string[];
  /** Seconds the claim tries to reach the database before answering 503 with Retry-After (default 5). */
  connectTimeout?: number;
  /** Run the handler without the store when the database is unreachable (default false; see the README for the risk). */
  failOpen?: boolean;
  /** Accept a bare (unquoted, Stripe-style) key as well as the draft's String (default false). */
  lenientKeys?: boolean;
  /** Errors that do not reach the client (default console.error). */
  onError?: (err: unknown) => void;
}

export interface ExpressOptions extends HttpOptions<IncomingMessage & { [name: string]: any }> {
  /** Largest body the middleware reads itself (default 1 MiB). */
  bodyLimit?: number;
}

export interface ExpressIdempotency {
  (req: IncomingMessage, res: ServerResponse, next: (err?: any) => void): void;
  close(): Promise<void>;
}

/** Express middleware: app.post('/orders', expressIdempotency({ pool }), handler). */
export function expressIdempotency(options?: ExpressOptions): ExpressIdempotency;

/** The parts of a Fastify request the `client` option may read. */
export interface FastifyRequestLike {
  headers: IncomingHttpHeaders;
  raw: IncomingMessage;
  [name: string]: any;
}

export type FastifyIdempotencyOptions = HttpOptions<FastifyRequestLike>;

/** Fastify plugin: await app.register(fastifyIdempotency, { pool }) before the routes. */
export function fastifyIdempotency(
  instance: any,
  options: FastifyIdempotencyOptions,
  done: (err?: Error) => void,
): void;

/** Parses an Idempotency-Key field value (RFC 9651 sf-string; lenient: a bare key too); throws with the problem detail. */
export function parseIdempotencyKey(value: string, lenient?: boolean): string;

/** Writes a key as an RFC 9651 sf-string, for an Idempotency-Key header sent to another service. */
export function sfString(key: string): string;

export class IdempotencyError extends Error {
  readonly code: string;
  readonly key?: string;
  readonly scope?: string;
}

export class InProgressError extends IdempotencyError {
  readonly code: 'IDEMPOTENCY_IN_PROGRESS';
  /** Seconds until the holder's lease ends (at least 1). */
  readonly retryAfter: number;
  readonly expiresAt: Date | null;
}

export class MismatchError extends IdempotencyError {
  readonly code: 'IDEMPOTENCY_MISMATCH';
}

export class FencedError extends IdempotencyError {
  readonly code: 'IDEMPOTENCY_FENCED';
}
