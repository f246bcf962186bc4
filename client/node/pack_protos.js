'use strict';
// npm pack's prepack/postpack step: copies the repository's
// proto/opjit/v1/*.proto into this package (proto/opjit/v1/), so that the
// packed client carries the protos it loads, and removes the copy after
// packing (in a checkout the client reads ../../proto, never a stale copy).
//
//   node pack_protos.js copy | clean
const fs = require('node:fs');
const path = require('node:path');

const SRC = path.resolve(__dirname, '..', '..', 'proto', 'opjit', 'v1');
const OWN = path.join(__dirname, 'proto');
const DST = path.join(OWN, 'opjit', 'v1');

const what = process.argv[2];
if (what === 'copy') {
  if (!fs.existsSync(path.join(SRC, 'server.proto'))) {
    console.error(`pack_protos: no protos at ${SRC}: pack from a checkout of opjit`);
    process.exit(1);
  }
  fs.rmSync(OWN, { recursive: true, force: true });
  fs.mkdirSync(DST, { recursive: true });
  for (const f of fs.readdirSync(SRC).filter((n) => n.endsWith('.proto'))) {
    fs.copyFileSync(path.join(SRC, f), path.join(DST, f));
  }
} else if (what === 'clean') {
  fs.rmSync(OWN, { recursive: true, force: true });
} else {
  console.error('usage: node pack_protos.js copy | clean');
  process.exit(2);
}
