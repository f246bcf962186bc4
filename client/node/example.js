'use strict';
// Registers MindSpore's aot leaky_relu kernel (kernels/examples) and runs it
// on a Float32Array. Needs a running opjitd ($OPJIT_SERVER or the default
// socket; $OPJIT_TOKEN and $OPJIT_TLS_CA for one with principals and TLS):
//   node client/node/example.js
const path = require('node:path');
const { Client } = require('./opjit_client');

async function main() {
  const client = new Client();
  try {
    const info = await client.info();
    console.log(`opjitd ${info.version} at ${client.address} (${info.cpu.triple}, ${info.cpu.cpu})`);

    const spec = path.resolve(__dirname, '..', '..', 'kernels', 'examples', 'leaky_relu.json');
    const reg = await client.registerSpecFile(spec);
    console.log(`registered ${reg.record.op.name} version ${reg.record.version}` +
                (reg.created ? '' : ' (already there)'));

    const ops = await client.listOps();
    console.log('ops:', ops.map((r) => `${r.op.namespace}/${r.op.name}@${r.version}`).join(', '));

    const x = Float32Array.of(0.0, -0.1, -0.2, 1.0);
    const [y] = await client.forward('leaky_relu', [{ dtype: 'float32', shape: [2, 2], data: x }]);
    console.log('leaky_relu(x) =', Array.from(y.data), 'shape', y.shape);
    const [y2] = await client.forward('leaky_relu', [x], { alpha: 0.5 });
    console.log('leaky_relu(x, alpha=0.5) =', Array.from(y2.data));

    // Errors carry a machine-readable reason: decide on it, not on the text.
    try {
      await client.forward('no_such_op', [x]);
    } catch (e) {
      if (e.reason !== 'OP_NOT_FOUND') throw e;
      console.log(`no_such_op: ${e.reason} (${e.code})`);
    }
  } finally {
    client.close();
  }
}

main().catch((e) => {
  console.error(e.message);
  process.exit(1);
});
