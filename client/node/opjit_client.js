'use strict';
// A small Node.js client for opjitd. It loads proto/opjit/v1/*.proto at run
// time with @grpc/proto-loader (nothing generated is committed) and sends
// tensors inline (bytes in the message), which works against any daemon,
// local or remote: a unix socket, loopback TCP, or TCP over TLS with a bearer
// token. Failed calls reject with an OpjitError whose .reason is the
// daemon's machine-readable reason (decide on it, never on the text).
//
//   const { Client } = require('./opjit_client');
//   const c = new Client();                       // $OPJIT_SERVER or the default socket
//   const c2 = new Client('gpu1.lab:7878,gpu2.lab:7878');  // several: failover
//   await c.registerSpecFile('kernels/examples/leaky_relu.json');
//   const [y] = await c.forward('leaky_relu', [Float32Array.of(-1, 2)], { alpha: 0.1 });

const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
// protobufjs decodes the status details (proto-loader gives descriptors, not
// codecs). It is proto-loader's own dependency, so resolve it from there.
const protobuf = require(require.resolve('protobufjs',
  { paths: [path.dirname(require.resolve('@grpc/proto-loader/package.json'))] }));

// Where proto/opjit/v1/*.proto are: $OPJIT_PROTO_DIR, else the first of the
// package's own proto/ (npm pack puts them there: an installed package needs
// nothing else), the source tree's proto/ (client/node/../../proto: a
// checkout) and the installed opjit's share/opjit/proto (/usr, /usr/local).
const PROTO_CANDIDATES = [
  path.resolve(__dirname, 'proto'),
  path.resolve(__dirname, '..', '..', 'proto'),
  '/usr/share/opjit/proto',
  '/usr/local/share/opjit/proto',
];
const PROTO_DIR = process.env.OPJIT_PROTO_DIR ||
  PROTO_CANDIDATES.find((d) => fs.existsSync(path.join(d, 'opjit', 'v1', 'server.proto'))) ||
  PROTO_CANDIDATES[0];
const PROTO_FILES = ['server', 'op', 'registry', 'compile', 'memory', 'exec'].map(
  (n) => `opjit/v1/${n}.proto`);

let cachedPackage = null;
function loadPackage() {
  if (!cachedPackage) {
    const def = protoLoader.loadSync(PROTO_FILES, {
      includeDirs: [PROTO_DIR],
      keepCase: true, // snake_case field names, as in the .proto files and JSON specs
      longs: Number,
      enums: String,
      defaults: true,
      oneofs: true,
    });
    cachedPackage = grpc.loadPackageDefinition(def).opjit.v1;
  }
  return cachedPackage;
}

// Where the packaged systemd unit's opjitd listens.
const SYSTEM_SOCKET = '/run/opjit/opjitd.sock';

// The daemon's address, as opjitd, the CLI and the other clients pick it:
// $OPJIT_SERVER (which may name several servers, comma-separated; each is
// normalized), else unix:$OPJIT_STATE_DIR/opjitd.sock, else
// unix:~/.opjit/opjitd.sock, or the system daemon's socket when the user
// runs none of their own.
function defaultAddress() {
  if (process.env.OPJIT_SERVER) {
    return splitAddresses(process.env.OPJIT_SERVER).map(normalizeAddress).join(',');
  }
  const state = process.env.OPJIT_STATE_DIR || path.join(os.homedir(), '.opjit');
  const own = path.join(state, 'opjitd.sock');
  if (!fs.existsSync(own) && !process.env.OPJIT_STATE_DIR && fs.existsSync(SYSTEM_SOCKET)) {
    return 'unix:' + SYSTEM_SOCKET;
  }
  return 'unix:' + own;
}

// Bare paths ("/x.sock", "./x", "../x", "~/x", anything ending in ".sock")
// become unix: addresses; host:port and unix:/dns:/ipv4:/ipv6: stay as they are.
function normalizeAddress(addr) {
  addr = String(addr);
  if (/^(unix|unix-abstract|dns|ipv4|ipv6):/.test(addr)) return addr;
  if (/^(\/|\.\/|\.\.\/|~)/.test(addr) || addr.endsWith('.sock')) {
    if (addr === '~' || addr.startsWith('~/')) addr = path.join(os.homedir(), addr.slice(1));
    return 'unix:' + addr;
  }
  return addr;
}

// A list of addresses from an array or a comma-separated string (items
// trimmed, empty ones dropped), not yet normalized.
function splitAddresses(addr) {
  if (Array.isArray(addr)) return addr.flatMap(splitAddresses);
  return String(addr).split(',').map((a) => a.trim()).filter(Boolean);
}

// ---- several addresses: failover and affinity ----------------------------------------------
//
// The rules of the Python (opjit/_routing.py) and C++ clients:
//  - routing 'failover' (the default): calls go to the current endpoint, at
//    first the first that answers a grpc.health.v1 check within
//    healthTimeoutMs. An endpoint is used only once it has passed a health
//    check (and until it fails one, or a call to it fails from the
//    transport).
//  - a call that fails with UNAVAILABLE from the transport (no daemon
//    answered; a daemon's own UNAVAILABLE carries a reason and is returned
//    as is) marks its endpoint down for DOWN_FOR_MS (it is tried last
//    meanwhile) and moves on to the next endpoint when the call is safe to
//    repeat: info, listOps, describe, compile, forward (a kernel's outputs
//    are a function of its inputs). Calls that change server state
//    (registerOp, deleteOp) are sent only to an endpoint that just passed a
//    health check and are never repeated elsewhere once sent: their
//    transport error is returned as it came.
//  - the endpoint that answered becomes the current one (calls stick to it).
//  - routing 'affinity': forward goes to the endpoint that ranks highest for
//    its (namespace, op) by rendezvous hashing, falling through that
//    ranking when it is down; other calls route as under failover.
//  - every attempt gets its own deadline (timeoutMs); when no endpoint took
//    the call it rejects with UNAVAILABLE naming every address.
// With one address none of this applies: calls go straight to it.

const ROUTING_MODES = ['failover', 'affinity'];
const DOWN_FOR_MS = 2000; // an endpoint that failed is skipped this long (unless all are down)

const U64 = (1n << 64n) - 1n;

// The affinity score of `address` for (namespace, op), higher wins: FNV-1a 64
// of "namespace\0op\0address" (namespace '' counts as "default") through
// splitmix64's finalizer, as the Python and C++ clients compute it, so all
// three route an op to the same daemon.
function rendezvousScore(namespace, op, address) {
  let h = 0xcbf29ce484222325n;
  for (const b of Buffer.from(`${namespace || 'default'}\0${op}\0${address}`, 'utf8')) {
    h = ((h ^ BigInt(b)) * 0x100000001b3n) & U64;
  }
  h = ((h ^ (h >> 30n)) * 0xbf58476d1ce4e5b9n) & U64;
  h = ((h ^ (h >> 27n)) * 0x94d049bb133111ebn) & U64;
  return h ^ (h >> 31n);
}

// `addresses` ranked for (namespace, op), best first.
function rendezvousOrder(namespace, op, addresses) {
  const scored = addresses.map((a, i) => ({ a, i, s: rendezvousScore(namespace, op, a) }));
  scored.sort((x, y) => (x.s === y.s ? x.i - y.i : (x.s > y.s ? -1 : 1)));
  return scored.map((x) => x.a);
}

// The rich status the daemon sends in the "grpc-status-details-bin" trailer
// (error.proto: opjit.v1.Status, wire-compatible with google.rpc.Status).
const ERROR_INFO_TYPE = 'type.googleapis.com/google.rpc.ErrorInfo';
const DIAGNOSTICS_TYPE = 'type.googleapis.com/opjit.v1.CompileDiagnostics';

let cachedErrorTypes = null;
function errorTypes() {
  if (!cachedErrorTypes) {
    const root = new protobuf.Root();
    // google/protobuf/any.proto comes bundled with protobufjs.
    root.resolvePath = (origin, target) => (path.isAbsolute(target) ? target : path.join(PROTO_DIR, target));
    root.loadSync('opjit/v1/error.proto', { keepCase: true });
    cachedErrorTypes = {
      Status: root.lookupType('opjit.v1.Status'),
      ErrorInfo: root.lookupType('opjit.v1.ErrorInfo'),
      CompileDiagnostics: root.lookupType('opjit.v1.CompileDiagnostics'),
    };
  }
  return cachedErrorTypes;
}

// { reason, metadata, diagnostics } from a grpc-js error's trailers; reason
// is '' when the daemon sent no ErrorInfo (an older daemon, or an error made
// by the client library itself, such as an unreachable server).
function richDetails(grpcError) {
  const out = { reason: '', metadata: {}, diagnostics: [], omittedDiagnostics: 0 };
  const blobs = grpcError.metadata instanceof grpc.Metadata
    ? grpcError.metadata.get('grpc-status-details-bin') : [];
  if (!blobs.length) return out;
  const t = errorTypes();
  const plain = { defaults: true, longs: Number };
  try {
    for (const any of t.Status.decode(blobs[blobs.length - 1]).details) {
      if (any.type_url === ERROR_INFO_TYPE) {
        const info = t.ErrorInfo.toObject(t.ErrorInfo.decode(any.value), plain);
        out.reason = info.reason;
        out.metadata = { ...info.metadata };
      } else if (any.type_url === DIAGNOSTICS_TYPE) {
        const d = t.CompileDiagnostics.toObject(t.CompileDiagnostics.decode(any.value), plain);
        out.diagnostics = d.diagnostics.map(({ file, line, column, severity, text }) =>
          ({ file, line, column, severity, text }));
        out.omittedDiagnostics = d.omitted_diagnostics || 0;
      }
    }
  } catch (e) {
    return { reason: '', metadata: {}, diagnostics: [], omittedDiagnostics: 0 }; // not ours
  }
  return out;
}

const CODE_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

// An error from the daemon (or from gRPC under it):
//   .code         the gRPC status name ("NOT_FOUND"); .grpcCode its number
//   .details      the server's text (for people: do not parse it)
//   .reason       ErrorInfo.reason ("OP_NOT_FOUND", "COMPILE_FAILED",
//                 "UNAUTHENTICATED", ... see proto/opjit/v1/error.proto),
//                 else the status code's name. Decide on this.
//   .metadata     the reason's metadata, e.g. { quota, limit, namespace }
//   .diagnostics  for COMPILE_FAILED: [{ file, line, column, severity, text }]
const FROM_DAEMON = Symbol('fromDaemon');

class OpjitError extends Error {
  constructor(grpcError) {
    const name = CODE_NAMES[grpcError.code] || 'UNKNOWN';
    const details = grpcError.details || grpcError.message;
    super(`${name}: ${details}`);
    const rich = richDetails(grpcError);
    this.name = 'OpjitError';
    this.code = name;
    this.grpcCode = grpcError.code;
    this.details = details;
    this.reason = rich.reason || name;
    this.metadata = rich.metadata;
    this.diagnostics = rich.diagnostics;
    // Diagnostics the server left out to keep the error small (issue 26).
    this.omittedDiagnostics = rich.omittedDiagnostics;
    // Every daemon error carries a reason; gRPC's own (no daemon answered) none.
    Object.defineProperty(this, FROM_DAEMON, { value: Boolean(rich.reason) });
  }
}


// An error made here, not by the daemon: { code, details } as gRPC's.
function clientError(code, details, cause) {
  const e = new OpjitError({ code: grpc.status[code], details });
  if (cause) e.cause = cause;
  return e;
}

// UNAVAILABLE that no daemon sent (a daemon's own carries a reason).
function isTransportUnavailable(e) {
  return e instanceof OpjitError && e.code === 'UNAVAILABLE' && !e[FROM_DAEMON];
}

// opjit dtype name -> TypedArray constructor (float16 travels as raw Uint16 bits).
const DTYPES = {
  float16: Uint16Array, float32: Float32Array, float64: Float64Array,
  int8: Int8Array, int16: Int16Array, int32: Int32Array, int64: BigInt64Array,
  uint8: Uint8Array, uint16: Uint16Array, uint32: Uint32Array, uint64: BigUint64Array,
  bool: Uint8Array,
};
const ARRAY_DTYPE = new Map([
  [Float32Array, 'float32'], [Float64Array, 'float64'], [Int8Array, 'int8'],
  [Int16Array, 'int16'], [Int32Array, 'int32'], [BigInt64Array, 'int64'],
  [Uint8Array, 'uint8'], [Uint16Array, 'uint16'], [Uint32Array, 'uint32'],
  [BigUint64Array, 'uint64'],
]);

// A tensor for a request: a TypedArray (1-D, dtype from its type) or
// { dtype, shape, data: TypedArray }.
function toTensor(t) {
  let dtype;
  let shape;
  let data;
  if (ArrayBuffer.isView(t)) {
    dtype = ARRAY_DTYPE.get(t.constructor);
    shape = [t.length];
    data = t;
  } else {
    ({ dtype, shape, data } = t);
    dtype = dtype || ARRAY_DTYPE.get(data.constructor);
    shape = shape || [data.length];
  }
  if (!dtype) throw new TypeError('cannot tell the dtype of this tensor; pass { dtype, shape, data }');
  return {
    dtype,
    shape,
    inline_data: Buffer.from(data.buffer, data.byteOffset, data.byteLength),
  };
}

// A response tensor as { dtype, shape, data: TypedArray } (a copy, aligned).
function fromTensor(t) {
  const Ctor = DTYPES[t.dtype];
  if (!Ctor) throw new TypeError(`unknown dtype ${t.dtype}`);
  if (t.data !== 'inline_data') throw new TypeError('expected an inline tensor');
  const buf = t.inline_data;
  const copy = new ArrayBuffer(buf.length);
  new Uint8Array(copy).set(buf);
  return { dtype: t.dtype, shape: t.shape.map(Number), data: new Ctor(copy) };
}

// Plain attribute values travel as text, which the daemon parses by the
// attr's declared value_type (as it parses defaults): 0.1, 3, true, [1, 2].
// An object with one AttrValue field ({ f: 0.1 }) is sent as it is.
function toAttr(v) {
  if (v !== null && typeof v === 'object' && !Array.isArray(v)) return v;
  if (typeof v === 'string') return { text: v };
  return { text: typeof v === 'boolean' ? String(v) : JSON.stringify(v) };
}

function camelToSnake(obj) {
  if (Array.isArray(obj)) return obj.map(camelToSnake);
  if (obj === null || typeof obj !== 'object') return obj;
  const out = {};
  for (const [k, v] of Object.entries(obj)) {
    out[k.replace(/[A-Z]/g, (c) => '_' + c.toLowerCase())] = camelToSnake(v);
  }
  return out;
}

// The name an extra file read from `p` (as the spec wrote it) goes by: the
// path made plain ("./a//b.h" -> "a/b.h"), or its base name when it is
// absolute or climbs out of the spec's directory with "..".
function defaultFileName(p) {
  const norm = path.posix.normalize(String(p).split(path.sep).join('/'));
  if (path.posix.isAbsolute(norm) || norm === '..' || norm.startsWith('../')) {
    return path.posix.basename(norm);
  }
  return norm;
}

// Reads a JSON spec (protobuf's JSON mapping of OpDef) and loads each
// implementation's source_file (relative to the spec) into source, and each
// of its extra files given by path ("files": ["helper.h"] or
// [{"path": "helper.h", "name": ...}]) into content.
function loadSpecFile(specPath) {
  const spec = camelToSnake(JSON.parse(fs.readFileSync(specPath, 'utf8')));
  const base = path.dirname(path.resolve(specPath));
  for (const impl of spec.implementations || []) {
    if (Array.isArray(impl.files)) {
      impl.files = impl.files.map((f) => {
        const file = typeof f === 'string' ? { path: f } : { ...f };
        if (file.path) {
          if (!file.name) file.name = defaultFileName(file.path);
          if (!file.content) file.content = fs.readFileSync(path.resolve(base, file.path), 'utf8');
          delete file.path;  // the server never opens a path
        }
        return file;
      });
    }
    // With source given, source_file only names it (for diagnostics).
    if (impl.source_file && !impl.source) {
      impl.source = fs.readFileSync(path.resolve(base, impl.source_file), 'utf8');
      // The base name stays: the server's diagnostics call the source by it.
      impl.source_file = path.basename(impl.source_file);
    }
  }
  return spec;
}

// A PEM given as a file path or as its bytes (Buffer); null when absent.
function readPem(v) {
  if (v == null || v === '') return null;
  return Buffer.isBuffer(v) ? v : fs.readFileSync(v.startsWith('~/') ? path.join(os.homedir(), v.slice(2)) : v);
}

// Channel credentials: TLS for TCP when `tls` asks for it, else plaintext.
// tls: true (system roots) or { ca, cert, key, serverName }; unix sockets
// stay plaintext whatever it says, as in the Python and C++ clients.
function channelCredentials(address, tls) {
  if (!tls || /^unix(-abstract)?:/.test(address)) return { creds: grpc.credentials.createInsecure(), opts: {} };
  const t = tls === true ? {} : tls;
  const opts = {};
  if (t.serverName) opts['grpc.ssl_target_name_override'] = t.serverName;
  return { creds: grpc.credentials.createSsl(readPem(t.ca), readPem(t.key), readPem(t.cert)), opts };
}

// One address: its channel and stubs, and whether it answers.
class Endpoint {
  constructor(address, pkg, tls, metadata) {
    this.address = address;
    const { creds, opts: tlsOpts } = channelCredentials(address, tls);
    const opts = { 'grpc.max_receive_message_length': 256 << 20,
      'grpc.max_send_message_length': 256 << 20, ...tlsOpts };
    // One channel per address, shared by the stubs.
    this.base = new grpc.Client(address, creds, opts);
    const shared = { channelOverride: this.base.getChannel() };
    this.stubs = {
      server: new pkg.Server(address, creds, shared),
      registry: new pkg.Registry(address, creds, shared),
      compiler: new pkg.Compiler(address, creds, shared),
      executor: new pkg.Executor(address, creds, shared),
    };
    this.metadata = metadata;
    this.healthy = false; // passed a health check since it last failed
    this.downUntil = 0;   // Date.now() before which it is tried last
  }

  // grpc.health.v1.Health/Check (service ""): true when it answers SERVING
  // within timeoutMs. Marks the endpoint up or down.
  check(timeoutMs) {
    return new Promise((resolve) => {
      const raw = (b) => b;
      // HealthCheckRequest{} is the empty message; SERVING is field 1 = 1.
      this.base.makeUnaryRequest('/grpc.health.v1.Health/Check', raw, raw, Buffer.alloc(0),
        this.metadata.clone(), { deadline: new Date(Date.now() + timeoutMs) }, (err, resp) => {
          const ok = !err && Buffer.isBuffer(resp) && resp.equals(Buffer.from([0x08, 0x01]));
          if (ok) this.markUp();
          else this.markDown();
          resolve(ok);
        });
    });
  }

  markDown() {
    this.healthy = false;
    this.downUntil = Date.now() + DOWN_FOR_MS;
  }

  markUp() {
    this.healthy = true;
    this.downUntil = 0;
  }

  close() { this.base.close(); }
}

class Client {
  // address: "unix:/path.sock", a bare socket path, or "host:port"; or
  //   several of them, as an array or a comma-separated string (see
  //   `routing`). Default: $OPJIT_SERVER (which may be such a list), else
  //   unix:$OPJIT_STATE_DIR/opjitd.sock, else unix:~/.opjit/opjitd.sock.
  // Options:
  //   timeoutMs  deadline of each call (of each attempt, with several
  //              addresses). Default: 120000 (a cold compile can take seconds).
  //   namespace  the namespace of ops and compiles when a call names none.
  //              Default: '' (the server's "default").
  //   token      bearer token sent as "authorization: Bearer <token>" on
  //              every call (plaintext or TLS). Default: $OPJIT_TOKEN (none
  //              when unset); '' sends none.
  //   tls        TLS for TCP addresses: true (the system's roots) or
  //              { ca, cert, key, serverName } (PEM file paths or Buffers;
  //              cert/key: a client certificate, for servers that ask for
  //              one; serverName: the name to check the certificate against,
  //              default the address's host). Default: { ca: $OPJIT_TLS_CA }
  //              when that is set, else plaintext; false forces plaintext.
  //   onWarning  called with (text, response) for each warning a RegisterOp
  //              response carries. Default: process.emitWarning(text,
  //              'OpjitWarning'); null ignores them (they stay in the response).
  //   routing    with several addresses: 'failover' (the default: calls go
  //              to the first daemon that answers a health check and move on
  //              to the next when it stops answering, for calls safe to
  //              repeat) or 'affinity' (forward goes to the daemon that ranks
  //              first for its namespace and op by rendezvous hashing, as in
  //              the Python and C++ clients). See "several addresses" above.
  //   healthTimeoutMs  how long a health check may take before its daemon
  //              counts as down (several addresses only). Default: 1000.
  constructor(address, {
    timeoutMs = 120000, namespace = '', token, tls,
    onWarning = (text) => process.emitWarning(text, 'OpjitWarning'),
    routing = 'failover', healthTimeoutMs = 1000,
  } = {}) {
    if (!ROUTING_MODES.includes(routing)) {
      throw clientError('INVALID_ARGUMENT', `routing must be "failover" or "affinity"; got ${JSON.stringify(routing)}`);
    }
    this.addresses = splitAddresses(address || defaultAddress()).map(normalizeAddress);
    if (!this.addresses.length) throw clientError('INVALID_ARGUMENT', 'no server address given');
    this.routing = routing;
    this.healthTimeoutMs = healthTimeoutMs;
    this.timeoutMs = timeoutMs;
    this.namespace = namespace;
    this.onWarning = onWarning;
    if (token === undefined) token = process.env.OPJIT_TOKEN || '';
    if (tls === undefined && process.env.OPJIT_TLS_CA) tls = { ca: process.env.OPJIT_TLS_CA };
    this.metadata = new grpc.Metadata();
    if (token) this.metadata.set('authorization', `Bearer ${token}`);
    const pkg = loadPackage();
    this.endpoints = this.addresses.map((a) => new Endpoint(a, pkg, tls, this.metadata));
    this.current = 0; // index of the endpoint calls go to first
  }

  // The address calls go to now (the first, until another one answered instead).
  get address() { return this.endpoints[this.current].address; }

  // The addresses in the order a forward of `op` tries them under routing
  // 'affinity' (its rendezvous ranking), best first.
  preferredAddresses(op, namespace = this.namespace) {
    return rendezvousOrder(namespace, op, this.addresses);
  }

  // The endpoints in the order a call tries them: the op's rendezvous ranking
  // (affinity, with a key), else from the current one on; those marked down last.
  order(key) {
    let eps;
    if (key && this.routing === 'affinity') {
      eps = rendezvousOrder(key[0], key[1], this.addresses)
        .map((a) => this.endpoints.find((e) => e.address === a));
    } else {
      eps = [...this.endpoints.slice(this.current), ...this.endpoints.slice(0, this.current)];
    }
    const now = Date.now();
    return [...eps.filter((e) => e.downUntil <= now), ...eps.filter((e) => e.downUntil > now)];
  }

  // One attempt of stub.method(request) on endpoint `ep`.
  attempt(ep, stub, method, request) {
    return new Promise((resolve, reject) => {
      const deadline = new Date(Date.now() + this.timeoutMs);
      ep.stubs[stub][method](request, this.metadata.clone(), { deadline },
        (err, resp) => (err ? reject(new OpjitError(err)) : resolve(resp)));
    });
  }

  // stub.method(request), routed as "several addresses" above says.
  // idempotent: safe to repeat on another daemon. key: [namespace, op] of an
  // op call (affinity routing).
  async call(stub, method, request, { idempotent = true, key = null } = {}) {
    if (this.endpoints.length === 1) return this.attempt(this.endpoints[0], stub, method, request);
    let last = null;
    for (const ep of this.order(key)) {
      if (!ep.healthy && !(await ep.check(this.healthTimeoutMs))) {
        last = clientError('UNAVAILABLE', `no opjitd answered a health check at ${ep.address}`);
        continue;
      }
      let resp;
      try {
        resp = await this.attempt(ep, stub, method, request);
      } catch (e) {
        if (!isTransportUnavailable(e)) throw e;
        ep.markDown();
        if (!idempotent) throw e; // it may have reached the daemon: never sent twice
        last = e;
        continue;
      }
      if (!key || this.routing !== 'affinity') this.current = this.endpoints.indexOf(ep);
      return resp;
    }
    throw clientError('UNAVAILABLE', `no opjitd answered at any of ${this.addresses.join(', ')}` +
      ` (last: ${last ? last.details : 'no address'})`, last);
  }

  // Resolves once the server answers (rejects UNAVAILABLE after timeoutMs).
  // With several addresses: once one of them answers a health check (it
  // becomes the current one).
  async waitReady(timeoutMs = 10000) {
    const deadline = Date.now() + timeoutMs;
    if (this.endpoints.length === 1) {
      const ep = this.endpoints[0];
      await new Promise((resolve, reject) => ep.base.waitForReady(new Date(deadline), (err) => (err
        ? reject(clientError('UNAVAILABLE', `no opjitd answered on ${ep.address} within ${timeoutMs / 1000} s`))
        : resolve())));
      return this;
    }
    for (;;) {
      for (const ep of this.order(null)) {
        if (await ep.check(Math.min(this.healthTimeoutMs, Math.max(deadline - Date.now(), 50)))) {
          this.current = this.endpoints.indexOf(ep);
          return this;
        }
      }
      if (Date.now() >= deadline) {
        throw clientError('UNAVAILABLE', `no opjitd answered on any of ${this.addresses.join(', ')}` +
          ` within ${timeoutMs / 1000} s`);
      }
      await new Promise((r) => setTimeout(r, 50));
    }
  }

  info() { return this.call('server', 'GetServerInfo', {}); }

  async listOps({ namespace = this.namespace, allVersions = false } = {}) {
    const r = await this.call('registry', 'ListOps', { namespace, all_versions: allVersions });
    return r.ops;
  }

  // The OpRecord; its .warnings lists problems found when it is served
  // (e.g. a backward.op not registered yet).
  describe(name, version = 0, namespace = this.namespace) {
    return this.call('registry', 'GetOp', { namespace, name, version });
  }

  // Changes server state: never repeated on another daemon once sent.
  deleteOp(name, version = 0, namespace = this.namespace) {
    return this.call('registry', 'DeleteOp', { namespace, name, version }, { idempotent: false });
  }

  // Registers an OpDef (the client's namespace when it names none). Resolves
  // to the RegisterOpResponse: { record, created, compiled, warnings };
  // each warning (a problem that did not stop the registration) also goes to
  // onWarning. Changes server state: never repeated on another daemon once sent.
  async registerOp(opDef) {
    const op = camelToSnake(opDef);
    if (this.namespace && !op.namespace) op.namespace = this.namespace;
    const resp = await this.call('registry', 'RegisterOp', { op }, { idempotent: false });
    if (this.onWarning) {
      for (const w of resp.warnings) this.onWarning(`register ${resp.record.op.namespace}/${resp.record.op.name}: ${w}`, resp);
    }
    return resp;
  }

  registerSpecFile(specPath) { return this.registerOp(loadSpecFile(specPath)); }

  // A compile error rejects with reason COMPILE_FAILED and .diagnostics.
  compile(source, { entry = '', language = 'c++', options = [], fileName = '', namespace = this.namespace } = {}) {
    return this.call('compiler', 'Compile',
      { source, entry, language, compile_options: options, file_name: fileName, namespace });
  }

  // Runs an op. inputs: one entry per declared input: a tensor (TypedArray or
  // { dtype, shape, data }), an array of tensors for a dynamic input, or null
  // for an absent optional one. Returns the outputs as { dtype, shape, data }.
  async forward(op, inputs, attrs = {}, { namespace = this.namespace, version = 0 } = {}) {
    const req = {
      namespace,
      op,
      version,
      inputs: inputs.map((x) => ({
        tensors: x == null ? [] : (Array.isArray(x) ? x : [x]).map(toTensor),
      })),
      attrs: Object.fromEntries(Object.entries(attrs).map(([k, v]) => [k, toAttr(v)])),
    };
    const resp = await this.call('executor', 'Forward', req, { key: [namespace, op] });
    return resp.outputs.map(fromTensor);
  }

  close() {
    for (const ep of this.endpoints) ep.close();
  }
}

module.exports = {
  Client, OpjitError, defaultAddress, normalizeAddress, splitAddresses, rendezvousScore,
  rendezvousOrder, loadSpecFile, defaultFileName, toTensor, fromTensor, PROTO_DIR, DOWN_FOR_MS,
};
