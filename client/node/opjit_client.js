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

const PROTO_DIR = process.env.OPJIT_PROTO_DIR || path.resolve(__dirname, '..', '..', 'proto');
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

// The daemon's address: $OPJIT_SERVER, else unix:$OPJIT_STATE_DIR/opjitd.sock,
// else unix:~/.opjit/opjitd.sock. Bare paths get "unix:".
function defaultAddress() {
  if (process.env.OPJIT_SERVER) return normalizeAddress(process.env.OPJIT_SERVER);
  const state = process.env.OPJIT_STATE_DIR || path.join(os.homedir(), '.opjit');
  return 'unix:' + path.join(state, 'opjitd.sock');
}

function normalizeAddress(addr) {
  if (/^(unix|unix-abstract|dns|ipv4|ipv6):/.test(addr)) return addr;
  if (addr.startsWith('/') || addr.startsWith('.') || addr.endsWith('.sock')) return 'unix:' + addr;
  return addr;
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
  const out = { reason: '', metadata: {}, diagnostics: [] };
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
      }
    }
  } catch (e) {
    return { reason: '', metadata: {}, diagnostics: [] }; // not ours
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
  }
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

// Reads a JSON spec (protobuf's JSON mapping of OpDef) and loads each
// implementation's source_file (relative to the spec) into source.
function loadSpecFile(specPath) {
  const spec = camelToSnake(JSON.parse(fs.readFileSync(specPath, 'utf8')));
  const base = path.dirname(path.resolve(specPath));
  for (const impl of spec.implementations || []) {
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

class Client {
  // address: "unix:/path.sock", a bare socket path, or "host:port". Default:
  //   $OPJIT_SERVER, else unix:$OPJIT_STATE_DIR/opjitd.sock, else
  //   unix:~/.opjit/opjitd.sock.
  // Options:
  //   timeoutMs  deadline of each call. Default: 120000 (a cold compile can take seconds).
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
  constructor(address, {
    timeoutMs = 120000, namespace = '', token, tls,
    onWarning = (text) => process.emitWarning(text, 'OpjitWarning'),
  } = {}) {
    this.address = address ? normalizeAddress(address) : defaultAddress();
    this.timeoutMs = timeoutMs;
    this.namespace = namespace;
    this.onWarning = onWarning;
    if (token === undefined) token = process.env.OPJIT_TOKEN || '';
    if (tls === undefined && process.env.OPJIT_TLS_CA) tls = { ca: process.env.OPJIT_TLS_CA };
    this.metadata = new grpc.Metadata();
    if (token) this.metadata.set('authorization', `Bearer ${token}`);
    const pkg = loadPackage();
    const { creds, opts: tlsOpts } = channelCredentials(this.address, tls);
    const opts = { 'grpc.max_receive_message_length': 256 << 20,
      'grpc.max_send_message_length': 256 << 20, ...tlsOpts };
    this.server = new pkg.Server(this.address, creds, opts);
    this.registry = new pkg.Registry(this.address, creds, opts);
    this.compiler = new pkg.Compiler(this.address, creds, opts);
    this.executor = new pkg.Executor(this.address, creds, opts);
  }

  call(stub, method, request) {
    return new Promise((resolve, reject) => {
      const deadline = new Date(Date.now() + this.timeoutMs);
      stub[method](request, this.metadata.clone(), { deadline },
        (err, resp) => (err ? reject(new OpjitError(err)) : resolve(resp)));
    });
  }

  info() { return this.call(this.server, 'GetServerInfo', {}); }

  async listOps({ namespace = this.namespace, allVersions = false } = {}) {
    const r = await this.call(this.registry, 'ListOps', { namespace, all_versions: allVersions });
    return r.ops;
  }

  // The OpRecord; its .warnings lists problems found when it is served
  // (e.g. a backward.op not registered yet).
  describe(name, version = 0, namespace = this.namespace) {
    return this.call(this.registry, 'GetOp', { namespace, name, version });
  }

  deleteOp(name, version = 0, namespace = this.namespace) {
    return this.call(this.registry, 'DeleteOp', { namespace, name, version });
  }

  // Registers an OpDef (the client's namespace when it names none). Resolves
  // to the RegisterOpResponse: { record, created, compiled, warnings };
  // each warning (a problem that did not stop the registration) also goes to
  // onWarning.
  async registerOp(opDef) {
    const op = camelToSnake(opDef);
    if (this.namespace && !op.namespace) op.namespace = this.namespace;
    const resp = await this.call(this.registry, 'RegisterOp', { op });
    if (this.onWarning) {
      for (const w of resp.warnings) this.onWarning(`register ${resp.record.op.namespace}/${resp.record.op.name}: ${w}`, resp);
    }
    return resp;
  }

  registerSpecFile(specPath) { return this.registerOp(loadSpecFile(specPath)); }

  // A compile error rejects with reason COMPILE_FAILED and .diagnostics.
  compile(source, { entry = '', language = 'c++', options = [], fileName = '', namespace = this.namespace } = {}) {
    return this.call(this.compiler, 'Compile',
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
    const resp = await this.call(this.executor, 'Forward', req);
    return resp.outputs.map(fromTensor);
  }

  close() {
    for (const s of [this.server, this.registry, this.compiler, this.executor]) s.close();
  }
}

module.exports = { Client, OpjitError, defaultAddress, loadSpecFile, toTensor, fromTensor, PROTO_DIR };
