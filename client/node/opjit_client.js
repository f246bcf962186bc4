'use strict';
// A small Node.js client for opjitd. It loads proto/opjit/v1/*.proto at run
// time with @grpc/proto-loader (nothing generated is committed) and sends
// tensors inline (bytes in the message), which works against any daemon,
// local or remote.
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

// An error from the daemon: .code is the gRPC status name ("NOT_FOUND"),
// .grpcCode its number, .message the server's text.
class OpjitError extends Error {
  constructor(grpcError) {
    const name = Object.keys(grpc.status).find((k) => grpc.status[k] === grpcError.code) || 'UNKNOWN';
    super(`${name}: ${grpcError.details || grpcError.message}`);
    this.name = 'OpjitError';
    this.code = name;
    this.grpcCode = grpcError.code;
    this.details = grpcError.details || grpcError.message;
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

class Client {
  constructor(address, { timeoutMs = 120000 } = {}) {
    this.address = address ? normalizeAddress(address) : defaultAddress();
    this.timeoutMs = timeoutMs;
    const pkg = loadPackage();
    const creds = grpc.credentials.createInsecure();
    const opts = { 'grpc.max_receive_message_length': 256 << 20,
      'grpc.max_send_message_length': 256 << 20 };
    this.server = new pkg.Server(this.address, creds, opts);
    this.registry = new pkg.Registry(this.address, creds, opts);
    this.compiler = new pkg.Compiler(this.address, creds, opts);
    this.executor = new pkg.Executor(this.address, creds, opts);
  }

  call(stub, method, request) {
    return new Promise((resolve, reject) => {
      const deadline = new Date(Date.now() + this.timeoutMs);
      stub[method](request, { deadline }, (err, resp) => (err ? reject(new OpjitError(err)) : resolve(resp)));
    });
  }

  info() { return this.call(this.server, 'GetServerInfo', {}); }

  async listOps({ namespace = '', allVersions = false } = {}) {
    const r = await this.call(this.registry, 'ListOps', { namespace, all_versions: allVersions });
    return r.ops;
  }

  describe(name, version = 0, namespace = '') {
    return this.call(this.registry, 'GetOp', { namespace, name, version });
  }

  deleteOp(name, version = 0, namespace = '') {
    return this.call(this.registry, 'DeleteOp', { namespace, name, version });
  }

  registerOp(opDef) { return this.call(this.registry, 'RegisterOp', { op: camelToSnake(opDef) }); }

  registerSpecFile(specPath) { return this.registerOp(loadSpecFile(specPath)); }

  compile(source, { entry = '', language = 'c++', options = [] } = {}) {
    return this.call(this.compiler, 'Compile', { source, entry, language, compile_options: options });
  }

  // Runs an op. inputs: one entry per declared input: a tensor (TypedArray or
  // { dtype, shape, data }), an array of tensors for a dynamic input, or null
  // for an absent optional one. Returns the outputs as { dtype, shape, data }.
  async forward(op, inputs, attrs = {}, { namespace = '', version = 0 } = {}) {
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
