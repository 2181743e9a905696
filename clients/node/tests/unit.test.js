'use strict';
// The pure parts, no database: the Idempotency-Key parser (RFC 9651), the stored form of HTTP
// answers, the query object, the HTTP date.

const { test } = require('node:test');
const assert = require('node:assert/strict');
const { parseIdempotencyKey, sfString } = require('..');
const { parseHeader } = require('../lib/key');
const { pack, unpack, queryObject, imfFixdate } = require('../lib/http');

test('quoted keys, escapes, surrounding spaces, the 255-character limit', () => {
  assert.equal(parseIdempotencyKey('"abc-1"'), 'abc-1');
  assert.equal(parseIdempotencyKey('"a b\\"c\\\\"'), 'a b"c\\');
  assert.equal(parseIdempotencyKey('"a,b"'), 'a,b');
  assert.equal(parseIdempotencyKey('  "abc"  '), 'abc');
  assert.equal(parseIdempotencyKey(`"${'x'.repeat(255)}"`).length, 255);
  assert.throws(() => parseIdempotencyKey(`"${'x'.repeat(256)}"`), /too long: 256 characters/);
  assert.equal(sfString('a"b\\c'), '"a\\"b\\\\c"');
  assert.equal(parseIdempotencyKey(sfString('a"b\\c')), 'a"b\\c');
});

test('parameters after the String are checked and ignored', () => {
  for (const v of ['"abc";p=1', '"abc";p', '"abc"; p=1;q=?0', '"abc";p=1 ',
    '"abc";a=-1.5;b="x;y\\"";c=tok/en:1;d=:aGk=:;e=@1700000000;f=%"caf%c3%a9";*g.h_i-j=*']) {
    assert.equal(parseIdempotencyKey(v), 'abc', v);
  }
});

test('Items of other types and malformed fields are refused, saying what is wrong and where', () => {
  for (const [v, message] of [
    ['abc', /is a bare Token, not a String/], ['8e03978e-40d5', /an Integer or Decimal/], ['1', /an Integer or Decimal/],
    ['?1', /a Boolean/], [':YQ==:', /a Byte Sequence/], ['@1', /a Date/], ['%"a"', /a Display String/],
    ['("a")', /an Inner List/], ['', /empty/], ['""', /empty/], ['"abc', /no closing quote/],
    ['"a\\b"', /bad escape at position 3/], ['"a\u00e9"', /bad character at position 3 \(byte 0xe9\)/],
    ['"abc" x', /after the closing quote at position 7/], ['"abc",', /after the closing quote/],
    ['"abc";P=1', /malformed parameter at position 7: a parameter name/],
    ['"abc";p=', /malformed parameter at position 9: a value follows/],
    ['"abc";p=1.2345', /position 9: a Decimal has 1 to 3 digits/],
    ['"abc";p=1234567890123456', /an Integer has at most 15 digits/],
    ['"abc";p=?2', /a Boolean is \?0 or \?1/], ['"abc";p=@1.5', /a Date is an Integer/],
    ['"abc";p=%"%C3"', /two lower-case hex digits/], ['"abc";p=%"%ff"', /decodes to UTF-8/],
    ['"abc";p=:YQ==', /a Byte Sequence holds base64/], ['"abc";p="x', /a String value/],
  ]) {
    assert.throws(() => parseIdempotencyKey(v), message, v);
  }
  assert.throws(() => parseHeader(undefined), (err) => err.kind === 'missing');
  assert.throws(() => parseHeader(['"a"', '"a"']), /more than once/);
});

test('stored answers keep the exact bytes: text, or base64 when not UTF-8 or holding NUL', () => {
  for (const [body, encoding] of [['{"b": 1, "a": 2.50}', undefined], [Buffer.from([0xff, 0x41]), 'base64'],
    ['a\u0000b', 'base64'], ['', undefined]]) {
    const stored = JSON.parse(JSON.stringify(pack({ headers: { 'content-type': 'application/json' }, body })));
    assert.equal(stored.encoding, encoding);
    const back = unpack(stored, 201);
    assert.ok(back.body.equals(Buffer.from(body)));
    assert.deepEqual([back.status, back.headers], [201, { 'content-type': 'application/json' }]);
  }
  // a response completed by other code (plain JSON) replays as JSON
  assert.deepEqual(unpack({ ok: true }, null), { status: 200, headers: { 'content-type': 'application/json' }, body: Buffer.from('{"ok":true}') });
});

test('the stored form: Content-Type and the allow-list only; rows of older clients are read', () => {
  const stored = pack({
    headers: { 'content-type': 'text/plain', location: '/o/1', 'set-cookie': ['s=1'], date: 'x', 'x-request-id': 'r' },
    body: 'hi',
  });
  assert.deepEqual(stored, { headers: [['content-type', 'text/plain'], ['location', '/o/1']], content_type: 'text/plain', body: 'hi' });
  // Node before 0.5.0: body, encoding, content_type
  assert.deepEqual(unpack({ body: 'aGk=', encoding: 'base64', content_type: 'text/plain' }, 200),
    { status: 200, headers: { 'content-type': 'text/plain' }, body: Buffer.from('hi') });
  // Python before 0.5.0: every header but a few; a replay keeps only the allow-list
  assert.deepEqual(unpack({ headers: [['content-type', 'text/plain'], ['x-request-id', 'r'], ['etag', '"e"']], body_base64: 'aGk=' }, 201),
    { status: 201, headers: { 'content-type': 'text/plain', etag: '"e"' }, body: Buffer.from('hi') });
  // Rust before 0.5.0: the JSON body itself
  assert.deepEqual(unpack({ error: 'x' }, 400), { status: 400, headers: { 'content-type': 'application/problem+json' }, body: Buffer.from('{"error":"x"}') });
});

test('the query object and the HTTP date', () => {
  assert.deepEqual(queryObject('?a=1&b=x%20y&a=2&a=3'), { a: ['1', '2', '3'], b: 'x y' });
  assert.deepEqual(queryObject(''), {});
  assert.equal(imfFixdate(new Date('2026-12-01T04:43:01.999Z')), 'Tue, 01 Dec 2026 04:43:01 GMT');
});

test('a broken connection is told from a refusal: class 08 (PgBouncer too), 57P01-57P03, socket errors; never IK001-IK003', () => {
  const { connectionLost } = require('../lib/db');
  const err = (code, message = 'x') => Object.assign(new Error(message), { code });
  for (const e of [
    err('08P01', 'server conn crashed?'), err('08P01', 'pgbouncer cannot connect to server'), err('08006'),
    err('08003'), err('57P01', 'terminating connection due to administrator command'), err('57P02'), err('57P03'),
    err('ECONNRESET'), err('EPIPE'), new Error('Connection terminated unexpectedly'),
    new Error('Client has encountered a connection error and is not queryable'),
    err('XX000', 'server closed the connection unexpectedly'),
  ]) assert.equal(connectionLost(e), true, `${e.code} ${e.message}`);
  for (const e of [err('IK001'), err('IK002'), err('IK003'), err('40001'), err('22023'), err('42501'), err(undefined, 'boom'), null]) {
    assert.equal(connectionLost(e), false, String(e && e.code));
  }
});
