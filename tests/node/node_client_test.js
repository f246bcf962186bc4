'use strict';
// Integration test of the Node.js client (client/node) against a real opjitd.
//
// Run by ctest (node_client) or by hand: node tests/node/node_client_test.js
// $OPJITD names the daemon (default <repo>/build/bin/opjitd). When
// client/node/node_modules is missing it runs `npm ci` there first; if npm
// cannot fetch the packages, it prints why and exits 77 (ctest: skipped).
//
// Daemons, each in its own temp dir: one without principals (unix socket),
// one with principals on plaintext loopback TCP (bearer tokens, namespaces,
// roles), one with principals and [tls] (a CA made here with openssl;
// without openssl that suite is skipped and says why), and four more for
// address lists (failover, affinity; two of them are killed on purpose).

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

// The clients below name their token and TLS settings; the caller's own must
// not leak in (the tests that check these defaults set them themselves).
delete process.env.OPJIT_TOKEN;
delete process.env.OPJIT_TLS_CA;

const crypto = require('node:crypto');
const test = require('node:test');
const assert = require('node:assert/strict');
const net = require('node:net');
const {
  Client, normalizeAddress, splitAddresses, rendezvousOrder,
} = require(path.join(NODE_DIR, 'opjit_client.js'));

const OPJITD = process.env.OPJITD || path.join(REPO, 'build', 'bin', 'opjitd');
const EXAMPLES = path.join(REPO, 'kernels', 'examples');

// A started opjitd in its own temp dir: { dir, state, unix, tcp, log, close() }.
// `config` (TOML text) goes to --config; `tcp` adds --listen 127.0.0.1:0 and
// reads the bound address back from <state>/endpoints.
async function startDaemon({ config = null, tcp = false } = {}) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'opjit-node-'));
  const state = path.join(dir, 'state');
  const unix = `unix:${path.join(dir, 'opjitd.sock')}`;
  const logPath = path.join(dir, 'opjitd.log');
  const args = ['--state-dir', state, '--listen', unix];
  if (tcp) args.push('--listen', '127.0.0.1:0');
  if (config !== null) {
    fs.writeFileSync(path.join(dir, 'opjitd.toml'), config);
    args.push('--config', path.join(dir, 'opjitd.toml'));
  }
  const log = fs.openSync(logPath, 'w');
  const proc = spawn(OPJITD, args, { stdio: ['ignore', log, log] });
  fs.closeSync(log);
  let exited = null;
  proc.on('exit', (code, signal) => { exited = { code, signal }; });
  const d = {
    dir, state, unix, tcp: null, logPath, proc,
    // The unix-socket caller is this process's uid: the daemon's own, an admin.
    admin: new Client(unix, { timeoutMs: 120000, token: '', tls: false }),
    async close() {
      d.admin.close();
      if (proc.exitCode === null && proc.signalCode === null) {
        const done = new Promise((r) => proc.once('exit', r));
        proc.kill('SIGTERM');
        await done;
      }
      fs.rmSync(dir, { recursive: true, force: true });
    },
  };
  const endpoints = path.join(state, 'endpoints');
  const deadline = Date.now() + 60000;
  let last;
  while (Date.now() < deadline && !exited) {
    if (fs.existsSync(endpoints)) {
      try {
        await d.admin.info();
        const addrs = fs.readFileSync(endpoints, 'utf8').split(/\s+/).filter(Boolean);
        d.tcp = addrs.find((a) => !a.startsWith('unix:')) || null;
        if (!tcp || d.tcp) return d;
      } catch (e) {
        last = e;
      }
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  const text = fs.readFileSync(logPath, 'utf8');
  await d.close();
  throw new Error(`opjitd did not start (${exited ? JSON.stringify(exited) : last}):\n${text}`);
}

let plain; // the daemon without principals (every local caller is admin)
let stateDir;
let client;

test.before(async () => {
  plain = await startDaemon();
  stateDir = plain.state;
  client = plain.admin;
});
test.after(async () => { if (plain) await plain.close(); });

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

// What `npm install <the packed client>` gives: the tarball's files, with its
// dependencies beside it (here the checkout's own node_modules, linked, so
// no registry is needed), used from a directory far from this checkout.
test('the packed npm package carries its protos and calls the daemon from elsewhere', async () => {
  await client.registerSpecFile(path.join(EXAMPLES, 'leaky_relu.json'));
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'opjit-node-pack-'));
  try {
    // prepack copies proto/opjit/v1 into the package; postpack removes it.
    execFileSync('npm', ['pack', '--pack-destination', tmp], {
      cwd: NODE_DIR, stdio: ['ignore', 'pipe', 'pipe'], timeout: 120000,
    });
    assert.ok(!fs.existsSync(path.join(NODE_DIR, 'proto')), 'postpack left the copy behind');
    const [tgz] = fs.readdirSync(tmp).filter((n) => n.endsWith('.tgz'));
    const pkg = path.join(tmp, 'node_modules', 'opjit-node-client');
    fs.mkdirSync(pkg, { recursive: true });
    execFileSync('tar', ['-xzf', path.join(tmp, tgz), '-C', pkg, '--strip-components=1']);
    for (const f of fs.readdirSync(path.join(REPO, 'proto', 'opjit', 'v1'))) {
      assert.ok(fs.existsSync(path.join(pkg, 'proto', 'opjit', 'v1', f)), `${f} is not in the package`);
    }
    fs.symlinkSync(path.join(NODE_DIR, 'node_modules', '@grpc'), path.join(tmp, 'node_modules', '@grpc'));
    const script = `
      const { Client, PROTO_DIR } = require('opjit-node-client');
      const c = new Client(${JSON.stringify(plain.unix)}, { token: '', tls: false });
      c.forward('leaky_relu', [Float32Array.of(-2, 3)], { alpha: 0.5 }).then(([y]) => {
        console.log(JSON.stringify({ PROTO_DIR, y: Array.from(y.data) }));
        c.close();
      }, (e) => { console.error(String(e)); process.exit(1); });`;
    const env = { ...process.env };
    delete env.OPJIT_PROTO_DIR;
    delete env.OPJIT_SOURCE_DIR;
    const out = JSON.parse(execFileSync(process.execPath, ['-e', script], {
      cwd: tmp, env, encoding: 'utf8', timeout: 60000,
    }).trim().split('\n').pop());
    assert.equal(fs.realpathSync(out.PROTO_DIR), fs.realpathSync(path.join(pkg, 'proto')));
    assert.deepEqual(out.y, [-1, 3]);
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
});

test('multi-file kernel: files read by path beside the spec', async () => {
  // kernels/examples/multi_file/poly.json: "files": ["poly_coeffs.h",
  // {"path": "detail/eval.h"}, "poly_eval.cc"] (headers and a second unit).
  const reg = await client.registerSpecFile(path.join(EXAMPLES, 'multi_file', 'poly.json'));
  assert.deepEqual(reg.record.op.implementations[0].files.map((f) => f.name),
    ['poly_coeffs.h', 'detail/eval.h', 'poly_eval.cc']);
  const x = Float32Array.of(-2, 0, 0.5, 3);
  const [y] = await client.forward('poly', [x]);
  y.data.forEach((v, i) => assert.ok(Math.abs(v - (x[i] * x[i] + 2 * x[i] + 3)) < 1e-5));
  const { defaultFileName } = require(path.join(NODE_DIR, 'opjit_client.js'));
  assert.equal(defaultFileName('./detail//x.h'), 'detail/x.h');
  assert.equal(defaultFileName('../common/x.h'), 'x.h');
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

// ---- structured errors: decide on .reason ---------------------------------------------------

// y = x <body>, float32 -> float32 (the kernel ABI of kernels/examples).
const COPY = `#include <cstdint>
extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  int64_t k = 1;
  for (int i = 0; i < nd[0]; ++i) k *= s[0][i];
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  for (int64_t i = 0; i < k; ++i) y[i] = x[i] BODY;
  return 0;
}
`;

function spec(name, body, namespace = '', extra = {}) {
  return {
    name, namespace,
    inputs: [{ index: 0, name: 'x' }],
    outputs: [{ index: 0, name: 'y' }],
    dtype_formats: [{ dtypes: ['float32', 'float32'] }],
    implementations: [{ target: 'CPU', source: COPY.replace('BODY', body), entry: 'K' }],
    ...extra,
  };
}

// Rejects with an OpjitError; runs check(e) on it.
async function rejectsWith(promise, check) {
  await assert.rejects(promise, (e) => {
    assert.equal(e.name, 'OpjitError', String(e));
    check(e);
    return true;
  });
}

// The syntax error ("int y = ;") is on line 3.
const BROKEN = 'extern "C" int K() {\n  int x = 1;\n  int y = ;\n  return x;\n}\n';

test('a compile error has reason COMPILE_FAILED and diagnostics with the right line', async () => {
  await rejectsWith(client.compile(BROKEN, { entry: 'K', fileName: 'broken.cc' }), (e) => {
    assert.equal(e.code, 'INVALID_ARGUMENT');
    assert.equal(e.grpcCode, 3);
    assert.equal(e.reason, 'COMPILE_FAILED');
    assert.ok(e.diagnostics.length >= 1, `no diagnostics in ${JSON.stringify(e.diagnostics)}`);
    const err = e.diagnostics.find((d) => d.severity === 'error');
    assert.ok(err, JSON.stringify(e.diagnostics));
    assert.equal(err.file, 'broken.cc');
    assert.equal(err.line, 3);
    assert.ok(err.column > 0);
    assert.ok(err.text.length > 0);
  });
  // The same through RegisterOp, whose implementations compile at registration.
  const bad = spec('broken_op', '* 2.0f');
  bad.implementations[0].source = BROKEN;
  bad.implementations[0].source_file = 'broken_op.cc';
  await rejectsWith(client.registerOp(bad), (e) => {
    assert.equal(e.code, 'INVALID_ARGUMENT');
    assert.equal(e.reason, 'COMPILE_FAILED');
    assert.ok(e.diagnostics.some((d) => d.line === 3 && d.severity === 'error'),
      JSON.stringify(e.diagnostics));
  });
});

test('forward on an unknown op has reason OP_NOT_FOUND', async () => {
  await rejectsWith(client.forward('no_such_op', [Float32Array.of(1)]), (e) => {
    assert.equal(e.code, 'NOT_FOUND');
    assert.equal(e.reason, 'OP_NOT_FOUND');
    assert.deepEqual(e.diagnostics, []);
  });
});

test('an error made by gRPC itself (no daemon) has the code name as its reason', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'opjit-node-none-'));
  const c = new Client(`unix:${path.join(dir, 'absent.sock')}`, { timeoutMs: 2000 });
  try {
    await rejectsWith(c.info(), (e) => {
      assert.ok(['UNAVAILABLE', 'DEADLINE_EXCEEDED'].includes(e.code), e.code);
      assert.equal(e.reason, e.code);
      assert.deepEqual(e.metadata, {});
    });
  } finally {
    c.close();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

test('registration warnings are returned and passed to onWarning', async () => {
  const seen = [];
  const c = new Client(plain.unix, { onWarning: (text) => seen.push(text) });
  try {
    const r = await c.registerOp(spec('dangling', '* 2.0f', '', {
      backward: { op: 'no_such_grad_op' }, output_rules: [{ kind: 'same_as' }],
    }));
    assert.equal(r.warnings.length, 1, JSON.stringify(r.warnings));
    assert.match(r.warnings[0], /backward\.op/);
    assert.deepEqual(seen, [`register default/dangling: ${r.warnings[0]}`]);
    const rec = await c.describe('dangling');
    assert.deepEqual(rec.warnings, r.warnings);
    const clean = await c.registerOp(spec('clean', '* 2.0f', '', { output_rules: [{ kind: 'same_as' }] }));
    assert.deepEqual(clean.warnings, []);
    assert.equal(seen.length, 1);
  } finally {
    c.close();
  }
});

// ---- principals and bearer tokens ------------------------------------------------------------

const TOKENS = { alice: 'tok-alice-0123456789', bob: 'tok-bob-0123456789', carol: 'tok-carol-0123456789' };
const sha256 = (t) => crypto.createHash('sha256').update(t).digest('hex');
const PRINCIPALS = [
  ['alice', 'user', 'alice'], ['bob', 'user', 'bob'], ['carol', 'reader', 'alice'],
].map(([name, role, ns]) => `[[principal]]\nname = "${name}"\nrole = "${role}"\n` +
  `namespaces = ["${ns}"]\ntoken_sha256 = ["${sha256(TOKENS[name])}"]\n`).join('');

test.describe('a daemon with principals, plaintext loopback TCP', () => {
  let d;
  const clients = [];
  const as = (who, namespace = '') => {
    const c = new Client(d.tcp, { token: who ? TOKENS[who] : '', namespace, tls: false, timeoutMs: 120000 });
    clients.push(c);
    return c;
  };
  test.before(async () => { d = await startDaemon({ config: PRINCIPALS, tcp: true }); });
  test.after(async () => {
    for (const c of clients) c.close();
    if (d) await d.close();
  });

  test('no token over TCP is UNAUTHENTICATED', async () => {
    await rejectsWith(as(null).listOps({ namespace: 'alice' }), (e) => {
      assert.equal(e.code, 'UNAUTHENTICATED');
      assert.equal(e.reason, 'UNAUTHENTICATED');
    });
    const wrong = new Client(d.tcp, { token: 'not-a-token', tls: false });
    clients.push(wrong);
    await rejectsWith(wrong.info(), (e) => assert.equal(e.reason, 'UNAUTHENTICATED'));
  });

  test('$OPJIT_TOKEN is the default token', async () => {
    const saved = process.env.OPJIT_TOKEN;
    process.env.OPJIT_TOKEN = TOKENS.alice;
    try {
      const c = new Client(d.tcp, { tls: false });
      clients.push(c);
      const info = await c.info();
      assert.equal(info.principal, 'alice');
    } finally {
      if (saved === undefined) delete process.env.OPJIT_TOKEN;
      else process.env.OPJIT_TOKEN = saved;
    }
  });

  test('a user registers and calls in its namespace', async () => {
    const alice = as('alice', 'alice');
    const info = await alice.info();
    assert.equal(info.principal, 'alice');
    assert.equal(info.role, 'user');
    const r = await alice.registerOp(spec('scale', '* 2.0f'));
    assert.equal(r.record.op.namespace, 'alice');
    const [y] = await alice.forward('scale', [Float32Array.of(1, -2, 3)]);
    assert.deepEqual(Array.from(y.data), [2, -4, 6]);
  });

  test('another namespace is NOT_FOUND', async () => {
    const bob = as('bob', 'alice');
    await rejectsWith(bob.forward('scale', [Float32Array.of(1)]), (e) => {
      assert.equal(e.code, 'NOT_FOUND');
      assert.equal(e.reason, 'NAMESPACE_NOT_FOUND');
    });
    await rejectsWith(bob.registerOp(spec('scale', '* -1.0f')), (e) => {
      assert.equal(e.code, 'NOT_FOUND');
      assert.equal(e.reason, 'NAMESPACE_NOT_FOUND');
    });
    // Alice's op is intact.
    const [y] = await as('alice', 'alice').forward('scale', [Float32Array.of(4)]);
    assert.deepEqual(Array.from(y.data), [8]);
  });

  test('a reader calls but cannot register: PERMISSION_DENIED', async () => {
    const carol = as('carol', 'alice');
    const [y] = await carol.forward('scale', [Float32Array.of(5)]);
    assert.deepEqual(Array.from(y.data), [10]);
    await rejectsWith(carol.registerOp(spec('scale', '* -1.0f')), (e) => {
      assert.equal(e.code, 'PERMISSION_DENIED');
      assert.equal(e.reason, 'PERMISSION_DENIED');
      assert.deepEqual(e.metadata, { role: 'reader', action: 'write' });
    });
  });
});

// ---- TLS ---------------------------------------------------------------------------------------

// A CA and a server certificate for localhost/127.0.0.1 in `dir`; null
// when openssl is not there.
function makePki(dir) {
  const run = (...args) => execFileSync('openssl', args, { cwd: dir, stdio: 'pipe' });
  try {
    run('version');
  } catch (e) {
    return null;
  }
  run('req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-days', '2', '-subj', '/CN=opjit-node-test-ca',
    '-keyout', 'ca.key', '-out', 'ca.pem');
  fs.writeFileSync(path.join(dir, 'san.ext'), 'subjectAltName=DNS:localhost,IP:127.0.0.1\n');
  for (const name of ['server', 'client']) {
    run('req', '-newkey', 'rsa:2048', '-nodes', '-subj', `/CN=${name === 'server' ? 'localhost' : 'alice'}`,
      '-keyout', `${name}.key`, '-out', `${name}.csr`);
    run('x509', '-req', '-in', `${name}.csr`, '-CA', 'ca.pem', '-CAkey', 'ca.key', '-CAcreateserial',
      '-days', '2', '-extfile', 'san.ext', '-out', `${name}.pem`);
  }
  return Object.fromEntries(['ca.pem', 'server.pem', 'server.key', 'client.pem', 'client.key']
    .map((f) => [f, path.join(dir, f)]));
}

const pkiDir = fs.mkdtempSync(path.join(os.tmpdir(), 'opjit-node-pki-'));
process.on('exit', () => fs.rmSync(pkiDir, { recursive: true, force: true }));
const pki = makePki(pkiDir);
const noTls = pki ? false : 'openssl is not installed: cannot make certificates for the TLS tests';
if (noTls) console.log(`SKIP (TLS tests): ${noTls}`);

test.describe('a daemon with principals and TLS', { skip: noTls }, () => {
  let d;
  let port;
  const clients = [];
  const open = (opts) => {
    const c = new Client(`localhost:${port}`, { timeoutMs: 30000, ...opts });
    clients.push(c);
    return c;
  };
  test.before(async () => {
    d = await startDaemon({
      tcp: true,
      config: `${PRINCIPALS}[tls]\ncert = "${pki['server.pem']}"\nkey = "${pki['server.key']}"\n` +
        `client_ca = "${pki['ca.pem']}"\nrequire_client_cert = false\n`,
    });
    port = d.tcp.split(':').pop();
  });
  test.after(async () => {
    for (const c of clients) c.close();
    if (d) await d.close();
  });

  test('with the CA (file or Buffer) and a token, calls go over TLS', async () => {
    const alice = open({ token: TOKENS.alice, namespace: 'alice', tls: { ca: pki['ca.pem'] } });
    const info = await alice.info();
    assert.equal(info.principal, 'alice');
    assert.ok(info.authenticated);
    await alice.registerOp(spec('tls_scale', '* 3.0f'));
    const [y] = await alice.forward('tls_scale', [Float32Array.of(2)]);
    assert.deepEqual(Array.from(y.data), [6]);
    // A Buffer CA, a client certificate, and the server name given explicitly.
    const withCert = open({
      token: TOKENS.carol,
      tls: { ca: fs.readFileSync(pki['ca.pem']), cert: pki['client.pem'], key: pki['client.key'], serverName: 'localhost' },
    });
    assert.equal((await withCert.info()).principal, 'carol');
  });

  test('$OPJIT_TLS_CA is the default CA', async () => {
    const saved = process.env.OPJIT_TLS_CA;
    process.env.OPJIT_TLS_CA = pki['ca.pem'];
    try {
      assert.equal((await open({ token: TOKENS.bob }).info()).principal, 'bob');
    } finally {
      if (saved === undefined) delete process.env.OPJIT_TLS_CA;
      else process.env.OPJIT_TLS_CA = saved;
    }
  });

  test('without the CA, or without TLS, the client cannot connect: UNAVAILABLE', async () => {
    await rejectsWith(open({ token: TOKENS.alice, tls: true }).info(), (e) => {
      assert.equal(e.code, 'UNAVAILABLE');
      assert.equal(e.reason, 'UNAVAILABLE');
    });
    await rejectsWith(open({ token: TOKENS.alice, tls: false }).info(), (e) => {
      assert.equal(e.code, 'UNAVAILABLE');
    });
    // serverName is what the certificate is checked against.
    await rejectsWith(open({ token: TOKENS.alice, tls: { ca: pki['ca.pem'], serverName: 'not-localhost' } }).info(),
      (e) => assert.equal(e.code, 'UNAVAILABLE'));
  });

  test('TLS without a token is still UNAUTHENTICATED', async () => {
    await rejectsWith(open({ token: '', tls: { ca: pki['ca.pem'] } }).listOps({ namespace: 'alice' }), (e) => {
      assert.equal(e.code, 'UNAUTHENTICATED');
      assert.equal(e.reason, 'UNAUTHENTICATED');
    });
  });
});

// ---- several addresses: failover and affinity ------------------------------------------------

// A loopback TCP port nothing listens on (bound, then closed), as host:port.
async function closedPort() {
  const srv = net.createServer();
  await new Promise((r) => srv.listen(0, '127.0.0.1', r));
  const { port } = srv.address();
  await new Promise((r) => srv.close(r));
  return `127.0.0.1:${port}`;
}

// Registers y = x * factor as `name` on a daemon (through its admin client),
// so the answer of a forward tells which daemon ran it.
async function registerScale(d, name, factor) {
  await d.admin.registerOp(spec(name, `* ${factor.toFixed(1)}f`));
}

// y = x * FACTOR, after sleeping a second.
const SLOW = `#include <cstdint>
#include <unistd.h>
extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  usleep(1000000);
  int64_t k = 1;
  for (int i = 0; i < nd[0]; ++i) k *= s[0][i];
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  for (int64_t i = 0; i < k; ++i) y[i] = x[i] * FACTOR;
  return 0;
}
`;

const forwardOne = async (c, op, v) => (await c.forward(op, [Float32Array.of(v)]))[0].data[0];

test('addresses: comma lists, bare socket paths and ~ are normalized as in Python', () => {
  assert.deepEqual(splitAddresses(' a:1 , ,unix:/b.sock,'), ['a:1', 'unix:/b.sock']);
  assert.deepEqual(splitAddresses(['a:1,b:2', 'c:3']), ['a:1', 'b:2', 'c:3']);
  assert.equal(normalizeAddress('/run/x.sock'), 'unix:/run/x.sock');
  assert.equal(normalizeAddress('./x'), 'unix:./x');
  assert.equal(normalizeAddress('rel.sock'), 'unix:rel.sock');
  assert.equal(normalizeAddress('~/s.sock'), `unix:${path.join(os.homedir(), 's.sock')}`);
  assert.equal(normalizeAddress('unix:/a'), 'unix:/a');
  assert.equal(normalizeAddress('gpu1.lab:7878'), 'gpu1.lab:7878');
  const c = new Client('/tmp/none-a.sock, 127.0.0.1:9,unix:/tmp/none-b.sock');
  assert.deepEqual(c.addresses, ['unix:/tmp/none-a.sock', '127.0.0.1:9', 'unix:/tmp/none-b.sock']);
  assert.equal(c.address, 'unix:/tmp/none-a.sock');
  c.close();
  assert.throws(() => new Client(' , '), (e) => e.code === 'INVALID_ARGUMENT' && /no server address/.test(e.message));
  assert.throws(() => new Client('a:1', { routing: 'random' }), (e) => e.code === 'INVALID_ARGUMENT');
});

test('rendezvous ranking is the Python and C++ clients\' (same daemon for the same op)', () => {
  // Computed by client/python/opjit/_routing.py.rendezvous_order.
  const addrs = ['unix:/x/a.sock', '127.0.0.1:7001', '127.0.0.1:7002', 'gpu1.lab:7878'];
  assert.deepEqual(rendezvousOrder('', 'leaky_relu', addrs),
    ['127.0.0.1:7001', 'unix:/x/a.sock', '127.0.0.1:7002', 'gpu1.lab:7878']);
  assert.deepEqual(rendezvousOrder('alice', 'scale', addrs),
    ['gpu1.lab:7878', '127.0.0.1:7002', 'unix:/x/a.sock', '127.0.0.1:7001']);
  assert.deepEqual(rendezvousOrder('default', 'arith3', addrs),
    ['unix:/x/a.sock', 'gpu1.lab:7878', '127.0.0.1:7002', '127.0.0.1:7001']);
  assert.deepEqual(rendezvousOrder('', 'scale', ['a:1', 'b:2', 'c:3']), ['a:1', 'c:3', 'b:2']);
});

// Plaintext clients without a token, for the daemons of the address-list
// suites; closeAll() closes every one opened.
function plainClientPool() {
  const clients = [];
  const open = (addr, opts = {}) => {
    const c = new Client(addr, { token: '', tls: false, timeoutMs: 120000, ...opts });
    clients.push(c);
    return c;
  };
  return { open, closeAll: () => { for (const c of clients) c.close(); } };
}

test.describe('several addresses (two live daemons, dead addresses)', () => {
  let a;
  let b;
  let tmp;
  let deadSock; // a socket path nothing listens on (bare, as a user writes it)
  let deadTcp;
  const { open, closeAll } = plainClientPool();
  test.before(async () => {
    [a, b] = await Promise.all([startDaemon({ tcp: true }), startDaemon({ tcp: true })]);
    await registerScale(a, 'scale', 2);
    await registerScale(b, 'scale', 3);
    tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'opjit-node-dead-'));
    deadSock = path.join(tmp, 'dead.sock');
    deadTcp = await closedPort();
  });
  test.after(async () => {
    closeAll();
    await Promise.all([a, b].filter(Boolean).map((d) => d.close()));
    if (tmp) fs.rmSync(tmp, { recursive: true, force: true });
  });

  test('OPJIT_SERVER=dead,live: every call goes to the live daemon, and sticks to it', async () => {
    const saved = process.env.OPJIT_SERVER;
    process.env.OPJIT_SERVER = `${deadSock},${a.tcp}`;
    let c;
    try {
      c = open(undefined);
    } finally {
      if (saved === undefined) delete process.env.OPJIT_SERVER;
      else process.env.OPJIT_SERVER = saved;
    }
    assert.deepEqual(c.addresses, [`unix:${deadSock}`, a.tcp]);
    assert.equal((await c.info()).state_dir, a.state);
    assert.equal(c.address, a.tcp);
    assert.equal(await forwardOne(c, 'scale', 5), 10);
    // A registration (never repeated elsewhere) goes to the live one too.
    const r = await c.registerOp(spec('via_list', '* 4.0f'));
    assert.equal(r.created, true);
    assert.equal((await a.admin.describe('via_list')).op.name, 'via_list');
    await rejectsWith(b.admin.describe('via_list'), (e) => assert.equal(e.reason, 'OP_NOT_FOUND'));
    assert.deepEqual((await c.listOps()).map((o) => o.op.name).sort(), ['scale', 'via_list']);
    assert.equal((await c.deleteOp('via_list')).deleted, 1);
    // The dead address is no longer tried first: calls stay on the live one.
    for (let i = 0; i < 5; ++i) assert.equal(await forwardOne(c, 'scale', i), 2 * i);
    assert.equal(c.address, a.tcp);
  });

  test('the constructor takes the same list as an array or a string, unix and TCP alike', async () => {
    const arr = open([deadTcp, `unix:${deadSock}`, b.unix]);
    assert.equal((await arr.info()).state_dir, b.state);
    assert.equal(arr.address, b.unix);
    const str = open(`${deadTcp}, ${b.tcp}, ${a.tcp}`);
    assert.equal(await forwardOne(str, 'scale', 1), 3); // b answers first
    assert.equal(str.address, b.tcp);
    const both = open(`${a.unix},${b.unix}`);
    await both.waitReady(10000);
    assert.equal(both.address, a.unix);
    assert.equal(await forwardOne(both, 'scale', 1), 2);
  });

  test('only dead addresses: UNAVAILABLE naming every address', async () => {
    const c = open(`${deadSock},${deadTcp}`, { healthTimeoutMs: 2000 });
    const named = (e) => {
      assert.equal(e.code, 'UNAVAILABLE');
      assert.equal(e.reason, 'UNAVAILABLE');
      assert.match(e.message, /no opjitd answered at any of /);
      assert.ok(e.message.includes(`unix:${deadSock}, ${deadTcp}`), e.message);
    };
    await rejectsWith(c.info(), named);
    await rejectsWith(c.forward('scale', [Float32Array.of(1)]), named);
    await rejectsWith(c.registerOp(spec('nowhere', '* 1.0f')), named);
    await rejectsWith(c.waitReady(300), (e) => {
      assert.equal(e.code, 'UNAVAILABLE');
      assert.ok(e.message.includes(`unix:${deadSock}, ${deadTcp}`), e.message);
    });
  });

  test('a daemon\'s own error is returned as is, never retried elsewhere', async () => {
    const c = open([a.unix, b.unix]);
    await rejectsWith(c.forward('no_such_op', [Float32Array.of(1)]), (e) => assert.equal(e.reason, 'OP_NOT_FOUND'));
    assert.equal(c.address, a.unix);
  });

  test('routing affinity: a forward goes to the daemon that ranks first for its op', async () => {
    const c = open([a.unix, b.unix], { routing: 'affinity' });
    const ranked = c.preferredAddresses('scale');
    assert.deepEqual(ranked, rendezvousOrder('', 'scale', [a.unix, b.unix]));
    const want = ranked[0] === a.unix ? 2 : 3;
    for (let i = 1; i <= 3; ++i) assert.equal(await forwardOne(c, 'scale', i), want * i);
    // Other calls route as under failover (the first that answers).
    assert.equal((await c.info()).state_dir, a.state);
  });

  test('registration warnings come back through an address list and are emitted as OpjitWarning', async () => {
    const c = open(`${deadSock},${a.unix}`, { onWarning: undefined });
    const emitted = new Promise((resolve) => {
      const on = (w) => {
        if (w.name !== 'OpjitWarning') return;
        process.off('warning', on);
        resolve(w);
      };
      process.on('warning', on);
    });
    const r = await c.registerOp(spec('dangling_list', '* 2.0f', '', {
      backward: { op: 'no_such_grad_op' }, output_rules: [{ kind: 'same_as' }],
    }));
    assert.equal(r.warnings.length, 1, JSON.stringify(r.warnings));
    assert.match(r.warnings[0], /backward\.op/);
    const w = await emitted;
    assert.equal(w.message, `register default/dangling_list: ${r.warnings[0]}`);
    assert.deepEqual((await a.admin.describe('dangling_list')).warnings, r.warnings);
  });
});

test.describe('several addresses: a daemon killed mid-run', () => {
  let c1;
  let c2;
  const { open, closeAll } = plainClientPool();
  test.before(async () => {
    [c1, c2] = await Promise.all([startDaemon(), startDaemon({ tcp: true })]);
    await registerScale(c1, 'scale', 2);
    await registerScale(c2, 'scale', 3);
    for (const [d, f] of [[c1, 2], [c2, 3]]) {
      await d.admin.registerOp({ ...spec('slow', ''), implementations: [{ target: 'CPU', source: SLOW.replace('FACTOR', `${f}.0f`), entry: 'K' }] });
    }
  });
  test.after(async () => {
    closeAll();
    await Promise.all([c1, c2].filter(Boolean).map((d) => d.close()));
  });

  test('safe calls move on to the next daemon; a state-changing call already sent is not repeated', async () => {
    const c = open([c1.unix, c2.tcp]);
    // A second client that was talking to the first daemon before it died.
    const writer = open(`${c1.unix},${c2.tcp}`);
    assert.equal((await writer.info()).state_dir, c1.state);
    for (let i = 1; i <= 5; ++i) assert.equal(await forwardOne(c, 'scale', i), 2 * i);
    assert.equal(c.address, c1.unix);

    // A forward in flight (its kernel sleeps 1 s) when the first daemon is
    // killed: the connection drops (UNAVAILABLE from the transport) and the
    // forward, safe to repeat, runs again on the second daemon.
    const exited = new Promise((r) => c1.proc.once('exit', r));
    const slow = forwardOne(c, 'slow', 7);
    setTimeout(() => c1.proc.kill('SIGKILL'), 100);
    assert.equal(await slow, 21);
    await exited;
    // The client stays on the daemon that answered.
    assert.equal(c.address, c2.tcp);
    for (let i = 1; i <= 10; ++i) assert.equal(await forwardOne(c, 'scale', i), 3 * i);
    assert.equal((await c.info()).state_dir, c2.state);

    // The writer's daemon is gone: its registration fails (UNAVAILABLE from
    // the transport, no daemon reason) and is not sent to the second daemon.
    await rejectsWith(writer.registerOp(spec('once', '* 5.0f')), (e) => {
      assert.equal(e.code, 'UNAVAILABLE');
      assert.equal(e.reason, 'UNAVAILABLE');
    });
    await rejectsWith(c2.admin.describe('once'), (e) => assert.equal(e.reason, 'OP_NOT_FOUND'));
    // The dead daemon is now marked down: the next registration goes to the
    // one that answers a health check.
    const r = await writer.registerOp(spec('once', '* 5.0f'));
    assert.equal(r.created, true);
    assert.equal(writer.address, c2.tcp);
    assert.equal((await c2.admin.describe('once')).op.name, 'once');
    // A new client given the dead address first never sends anything there.
    const fresh = open([c1.unix, c2.tcp]);
    assert.equal((await fresh.deleteOp('once')).deleted, 1);
    assert.equal(fresh.address, c2.tcp);
  });
});
