'use strict';
// The README's code blocks: every ```js block parses (node --check), and the quickstart
// (receipt.js) runs as written against a throwaway cluster, printing what the README says.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { spawnSync } = require('node:child_process');
const { startCluster } = require('./cluster');

const README = fs.readFileSync(path.join(__dirname, '..', 'README.md'), 'utf8');
const blocks = [...README.matchAll(/^```js\n([\s\S]*?)^```/gm)].map((m) => m[1]);
let cluster;
let dir;

before(async () => {
  cluster = await startCluster();
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pg-idempotency-readme-'));
  fs.mkdirSync(path.join(dir, 'node_modules'));
  fs.symlinkSync(path.join(__dirname, '..'), path.join(dir, 'node_modules', 'pg-idempotency'));
});

after(() => {
  cluster.destroy();
  fs.rmSync(dir, { recursive: true, force: true });
});

test('every js block of the README parses', () => {
  assert.ok(blocks.length >= 5);
  blocks.forEach((code, i) => {
    const f = path.join(dir, `block-${i + 1}.mjs`);
    fs.writeFileSync(f, code);
    const r = spawnSync(process.execPath, ['--check', f], { encoding: 'utf8' });
    assert.equal(r.status, 0, `README js block ${i + 1}: ${r.stderr}`);
  });
});

test('the quickstart (receipt.js) runs as written: new, then replays', () => {
  const receipt = blocks.find((b) => b.includes('sendReceipt.detailed(42'));
  fs.writeFileSync(path.join(dir, 'receipt.js'), receipt);
  const run = () => spawnSync(process.execPath, ['receipt.js'], { cwd: dir, env: cluster.env(), encoding: 'utf8', timeout: 60000 });
  const first = run();
  assert.equal(first.status, 0, first.stderr);
  assert.match(first.stdout, /^sending the receipt of order 42 to alice@example.com$/m);
  assert.deepEqual([...first.stdout.matchAll(/outcome: '(\w+)'/g)].map((m) => m[1]), ['new', 'replay']);
  const second = run();
  assert.equal(second.status, 0, second.stderr);
  assert.doesNotMatch(second.stdout, /sending/);
  assert.deepEqual([...second.stdout.matchAll(/outcome: '(\w+)'/g)].map((m) => m[1]), ['replay', 'replay']);
});
