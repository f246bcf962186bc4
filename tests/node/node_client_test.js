'use strict';
// Integration test of the Node.js client (client/node) against a real opjitd.
//
// Run by ctest (node_client) or by hand: node tests/node/node_client_test.js
// $OPJITD names the daemon (default <repo>/build/bin/opjitd). When
// client/node/node_modules is missing it runs `npm ci` there first; if npm
// cannot fetch the packages, it prints why and exits 77 (ctest: skipped).

const { execFileSync, spawn } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const REPO = process.env.OPJIT_SOURCE_DIR || path.resolve(__dirname, '..', '..');
const NODE_DIR = path.join(REPO, 'client', 'node');
const SKIP = 77;

function ensureModules() {
  if (fs.existsSync(path.join(NODE_DIR, 'node_modules', '@grpc', 'grpc-js')) &&
      fs.existsSync(path.join(NODE_DIR, 'node_modules', '@grpc', 'proto-loader'))) {
    return;
  }
  console.log(`node_modules missing in ${NODE_DIR}: running npm ci`);
  try {
    execFileSync('npm', ['ci', '--no-audit', '--no-fund'], {
      cwd: NODE_DIR, stdio: ['ignore', 'pipe', 'pipe'], timeout: 300000,
    });
  } catch (e) {
    const why = e.code === 'ENOENT' ? 'npm is not installed'
      : `npm ci failed (registry unreachable?): ${String(e.stderr || e.message).trim().split('\n').slice(-3).join(' | ')}`;
    console.log(`SKIP: cannot install @grpc/grpc-js and @grpc/proto-loader: ${why}`);
    process.exit(SKIP);
  }
}

ensureModules();

const test = require('node:test');
const assert = require('node:assert/strict');
const { Client } = require(path.join(NODE_DIR, 'opjit_client.js'));

const OPJITD = process.env.OPJITD || path.join(REPO, 'build', 'bin', 'opjitd');
const EXAMPLES = path.join(REPO, 'kernels', 'examples');

let daemon;
let stateDir;
let client;

async function startDaemon() {
  stateDir = fs.mkdtempSync(path.join(os.tmpdir(), 'opjit-node-'));
  const sock = path.join(stateDir, 'opjitd.sock');
  const log = fs.openSync(path.join(stateDir, 'opjitd.log'), 'w');
  daemon = spawn(OPJITD, ['--state-dir', stateDir, '--listen', `unix:${sock}`],
    { stdio: ['ignore', log, log] });
  let exited = null;
  daemon.on('exit', (code, signal) => { exited = { code, signal }; });
  client = new Client(`unix:${sock}`, { timeoutMs: 120000 });
  const deadline = Date.now() + 60000;
  let last;
  while (Date.now() < deadline) {
    if (exited) break;
    if (fs.existsSync(path.join(stateDir, 'endpoints'))) {
      try {
        await client.info();
        return;
      } catch (e) {
        last = e;
      }
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  const text = fs.readFileSync(path.join(stateDir, 'opjitd.log'), 'utf8');
  throw new Error(`opjitd did not start (${exited ? JSON.stringify(exited) : last}):\n${text}`);
}

async function stopDaemon() {
  if (client) client.close();
  if (daemon && daemon.exitCode === null) {
    const done = new Promise((r) => daemon.once('exit', r));
    daemon.kill('SIGTERM');
    await done;
  }
  if (stateDir) fs.rmSync(stateDir, { recursive: true, force: true });
}

test.before(startDaemon);
test.after(stopDaemon);

test('info answers', async () => {
  const info = await client.info();
  assert.ok(info.version);
  assert.equal(info.state_dir, stateDir);
});

test('register leaky_relu, list ops, forward with inline Float32Array bytes', async () => {
  assert.deepEqual(await client.listOps(), []);
  const reg = await client.registerSpecFile(path.join(EXAMPLES, 'leaky_relu.json'));
  assert.equal(reg.record.op.name, 'leaky_relu');
  assert.equal(reg.created, true);
  const again = await client.registerSpecFile(path.join(EXAMPLES, 'leaky_relu.json'));
  assert.equal(again.created, false);

  const ops = await client.listOps();
  assert.deepEqual(ops.map((r) => r.op.name), ['leaky_relu']);

  const x = Float32Array.of(0.0, -0.1, -0.2, 1.0, -3.0, 2.5);
  const [y] = await client.forward('leaky_relu', [{ dtype: 'float32', shape: [2, 3], data: x }]);
  assert.equal(y.dtype, 'float32');
  assert.deepEqual(y.shape, [2, 3]);
  const want = Array.from(x, (v) => (v > 0 ? v : Math.fround(0.01) * v));
  y.data.forEach((v, i) => assert.ok(Math.abs(v - want[i]) < 1e-6, `y[${i}] = ${v}, want ${want[i]}`));

  const [y2] = await client.forward('leaky_relu', [x], { alpha: 0.5 });
  y2.data.forEach((v, i) => assert.ok(Math.abs(v - (x[i] > 0 ? x[i] : 0.5 * x[i])) < 1e-6));
});

test('multi-output op', async () => {
  await client.registerSpecFile(path.join(EXAMPLES, 'arith3.json'));
  const a = Float32Array.of(1, 2, 3);
  const b = Float32Array.of(4, 5, 6);
  const [s, p, q] = await client.forward('arith3', [a, b]);
  assert.deepEqual(Array.from(s.data), [5, 7, 9]);
  assert.deepEqual(Array.from(p.data), [4, 10, 18]);
  q.data.forEach((v, i) => assert.ok(Math.abs(v - a[i] / b[i]) < 1e-6));
});

test('errors carry the status code and the server message', async () => {
  await assert.rejects(client.describe('no_such_op'), (e) => {
    assert.equal(e.code, 'NOT_FOUND');
    assert.match(e.details, /no_such_op/);
    return true;
  });
  await assert.rejects(client.forward('leaky_relu', [Int32Array.of(1, 2)]), (e) => {
    assert.equal(e.code, 'INVALID_ARGUMENT');
    assert.match(e.details, /int32/);
    return true;
  });
});
