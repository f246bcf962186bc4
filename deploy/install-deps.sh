#!/usr/bin/env bash
# Installs the Debian packages opjit needs to build, run and test.
# Idempotent: packages already present are skipped, and apt is not touched at
# all when nothing is missing. Debian packages only.
#
#   deploy/install-deps.sh           build, run and test
#   deploy/install-deps.sh --bench   also the plots of bench/ (matplotlib)
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev libsqlite3-dev nlohmann-json3-dev libtomlplusplus-dev libssl-dev
  llvm-16-dev libclang-16-dev libclang-cpp16-dev clang-16 libclang-rt-16-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-grpcio python3-numpy python3-pytest python3-protobuf
  openssl prometheus python3-prometheus-client
  # ATen kernels (kernels/examples/aten, tests/python/test_aten.py): libtorch's
  # headers and libraries, pybind11 and Python's headers for <torch/extension.h>
  libtorch-dev pybind11-dev python3-dev
  # Scale-out (issue 17): the PostgreSQL registry store (libpq; the server for
  # the throwaway databases of the tests), the Redis cache tier (hiredis; the
  # server for the tests), sd_notify, the Debian package and the pip install
  # (dpkg-dev, python3-venv, python3-pip, python3-grpc-tools), the container
  # image and its pod (mmdebstrap, podman with runc, buildah) and the manifest
  # check (kubectl from kubernetes-client).
  libpq-dev postgresql-15 libhiredis-dev redis-server libsystemd-dev
  dpkg-dev python3-venv python3-pip python3-setuptools python3-grpc-tools
  mmdebstrap podman buildah runc uidmap slirp4netns fuse-overlayfs containernetworking-plugins
  kubernetes-client python3-yaml
  # podman only *recommends* catatonit, its pause binary for `podman kube
  # play`, and --no-install-recommends below leaves recommendations out: every
  # package a test uses is named here, never left to a recommendation.
  catatonit
  # Issue 25: the CLI's parser (CLI11, header-only), the Node.js client and its
  # test (node, npm for `npm ci`), the package check (lintian), the newcomer
  # check in a fresh root (bubblewrap).
  libcli11-dev nodejs npm lintian bubblewrap
  # Issue 26: /metrics on libmicrohttpd (a thread pool, connection limits and
  # timeouts instead of a hand-written server).
  libmicrohttpd-dev
  # Issue 32: opjit.torch, its tests and the training example
  # (client/python/examples/torch_mlp.py), and bench/'s PyTorch peers.
  python3-torch
)
if [ "${1:-}" = "--bench" ]; then
  # torch.utils.cpp_extension.load_inline needs libtorch's headers, pybind11
  # and ninja (python3-torch, above); plots need matplotlib.
  PKGS+=(python3-matplotlib)
fi

missing=()
for p in "${PKGS[@]}"; do
  # Some images carry kubectl from another package (Google's "kubectl"), which
  # conflicts with Debian's kubernetes-client on /usr/bin/kubectl: either serves.
  if [ "$p" = kubernetes-client ] && command -v kubectl >/dev/null; then continue; fi
  # Likewise a Node.js that came with its own npm (NodeSource's build, as on
  # these machines) serves; Debian's npm would conflict with it.
  if { [ "$p" = nodejs ] || [ "$p" = npm ]; } && command -v node >/dev/null \
     && command -v npm >/dev/null; then continue; fi
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
