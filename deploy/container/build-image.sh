#!/usr/bin/env bash
# Builds opjit's container images from Debian 12 packages only: mmdebstrap
# makes each base root file system (no image registry needed), podman
# imports it, and the Containerfile adds opjit on top.
#
#   build-image.sh fast       localhost/opjit:latest from the host's build tree
#                             (cmake --install of ./build: no compile; CI)
#   build-image.sh full       localhost/opjit:latest compiled in the build stage
#   build-image.sh services   localhost/opjit-services:latest (PostgreSQL 15 and
#                             Redis, one image, on the runtime base; see NOTES.md)
#   build-image.sh ci         fast and services
#   build-image.sh bases      only the mmdebstrap bases
#
# Environment:
#   OPJIT_BUILD_DIR     the build tree for fast (default: <repo>/build)
#   OPJIT_IMAGE_CACHE   mmdebstrap tarballs and the staged tree
#                       (default: $OPJIT_BUILD_DIR/container)
#   OPJIT_IMAGE, OPJIT_SERVICES_IMAGE   tags (default localhost/opjit:latest,
#                       localhost/opjit-services:latest)
#   WITH_NVRTC          0 (default) or debian: see the Containerfile
#   OPJIT_DEBIAN_MIRROR a Debian mirror for mmdebstrap (default: its own)
#   OPJIT_SERVICES_BASE runtime (default: the services image is the runtime
#                       base + apt) or own (a slim mmdebstrap base of its own)
#   CONTAINERS_CONF     default: deploy/container/containers.conf (runc, ulimits)
#
# Caching: a base is named by the hash of its package list and of how it is
# made (localhost/opjit-<name>-base:<hash>); one already in podman's storage
# is reused as it is, else its tarball under $OPJIT_IMAGE_CACHE is imported,
# else mmdebstrap makes it. Every step prints its wall time.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${OPJIT_BUILD_DIR:-$ROOT/build}
CACHE=${OPJIT_IMAGE_CACHE:-$BUILD/container}
IMAGE=${OPJIT_IMAGE:-localhost/opjit:latest}
SERVICES_IMAGE=${OPJIT_SERVICES_IMAGE:-localhost/opjit-services:latest}
# The staged install tree, imported for the fast build and removed after it:
# one tag per run, so two builds side by side never take each other's tree.
TREE_IMAGE=localhost/opjit-tree-$$:latest
WITH_NVRTC=${WITH_NVRTC:-0}
SUITE=bookworm
export CONTAINERS_CONF=${CONTAINERS_CONF:-$HERE/containers.conf}
PATH_ENV='PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
# Bump when the way bases are made changes (it is part of their hash).
RECIPE=1

log() { echo "build-image: $*" >&2; }
timed() {  # timed LABEL CMD...: runs CMD, prints its wall time
  local label=$1 t0 rc=0
  shift
  t0=$(date +%s.%N)
  "$@" || rc=$?
  log "$label: $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')s$([ $rc = 0 ] || echo " (failed, status $rc)")"
  return $rc
}

for tool in mmdebstrap podman; do
  command -v $tool >/dev/null || { log "$tool is missing (deploy/install-deps.sh installs it)"; exit 1; }
done
mkdir -p "$CACHE"

logged() {  # logged FILE CMD...: CMD's output goes to FILE
  local file=$1
  shift
  "$@" > "$file" 2>&1
}

packages() { sed -e 's/#.*//' "$@" | tr -s ' \n' '\n' | awk NF | paste -sd, -; }

# Hooks of each base (their text is part of the base's hash).
hooks_runtime() {
  MM_ARGS+=(--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*')
}
hooks_services() {
  hooks_runtime
  # No default cluster: services-entrypoint runs initdb into $PGDATA.
  MM_ARGS+=(--customize-hook='rm -rf "$1"/var/lib/postgresql/15/main "$1"/etc/postgresql/15/main')
}
hooks_build() { :; }

# base NAME PKGFILE...: makes localhost/opjit-NAME-base:<hash> (and :latest)
# and prints its name.
base() {
  local name=$1
  shift
  local hash img tar pkgs
  hash=$( { echo "$RECIPE $SUITE ${OPJIT_DEBIAN_MIRROR:-}"; cat "$@"; declare -f "hooks_$name" hooks_runtime; } |
          sha256sum | cut -c1-16)
  img=localhost/opjit-$name-base:$hash
  tar=$CACHE/$name-base-$hash.tar
  if podman image exists "$img"; then
    log "$name base: $img (in podman's storage)"
  else
    if [ ! -s "$tar" ]; then
      pkgs=$(packages "$@")
      MM_ARGS=(--variant=apt --format=tar --include="$pkgs" --quiet)
      # The root is built in a temporary directory: in RAM when there is room
      # (~15% faster here; the work is mostly decompressing and dpkg).
      local tmpdir=${TMPDIR:-/tmp}
      [ "$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)" -gt 4000000 ] 2>/dev/null && tmpdir=/dev/shm
      "hooks_$name"
      log "$name base: mmdebstrap $SUITE (+$(echo "$pkgs" | tr , ' ' | wc -w) packages)"
      if ! TMPDIR=$tmpdir timed "$name base: mmdebstrap" logged "$CACHE/$name-base.log" mmdebstrap "${MM_ARGS[@]}" \
             "$SUITE" "$tar.tmp" ${OPJIT_DEBIAN_MIRROR:+"$OPJIT_DEBIAN_MIRROR"}; then
        tail -30 "$CACHE/$name-base.log" >&2
        rm -f "$tar.tmp"
        exit 1
      fi
      mv "$tar.tmp" "$tar"
      # Older tarballs of this base are stale.
      find "$CACHE" -maxdepth 1 -name "$name-base-*.tar" ! -name "$(basename "$tar")" -delete
    fi
    timed "$name base: podman import" podman import --quiet --change "ENV $PATH_ENV" "$tar" "$img" >/dev/null
  fi
  podman tag "$img" "localhost/opjit-$name-base:latest"
  echo "$img"
}

# The host's build installed under /usr, as an image holding it in /out.
stage_tree() {
  local stage=$CACHE/tree
  [ -x "$BUILD/bin/opjitd" ] || { log "no $BUILD/bin/opjitd: build first (cmake --build build)"; exit 1; }
  rm -rf "$stage"
  DESTDIR=$stage/out cmake --install "$BUILD" --prefix /usr --strip >/dev/null
  install -D -m 0755 "$HERE/opjit-health" "$stage/out/usr/local/bin/opjit-health"
  install -D -m 0644 "$HERE/opjitd.toml" "$stage/out/etc/opjit/opjitd.toml"
  local need
  for need in usr/bin/opjitd usr/bin/opjit; do
    [ -x "$stage/out/$need" ] || { log "cmake --install did not install /$need"; exit 1; }
  done
  for need in opjit-compile-worker opjit-exec-worker; do
    find "$stage/out/usr" -name "$need" -perm -u+x | grep -q . ||
      { log "cmake --install did not install $need"; exit 1; }
  done
  tar -C "$stage" --owner=0 --group=0 -cf "$stage.tar" out
  podman import --quiet "$stage.tar" "$TREE_IMAGE" >/dev/null
}

# drop_previous TAG OLD_ID: removes the image TAG pointed at before a
# rebuild, unless TAG still does or a container uses it.
drop_previous() {
  local now
  now=$(podman image inspect --format '{{.Id}}' "$1" 2>/dev/null || true)
  [ -n "$2" ] && [ "$2" != "$now" ] && podman rmi "$2" >/dev/null 2>&1 || true
}

image_fast() {
  local rt=$1 old
  old=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
  timed "fast: cmake --install + import of the tree" stage_tree
  timed "fast: podman build (TREE=host build)" podman build --quiet --format docker --network host \
    -f "$HERE/Containerfile" --build-arg RUNTIME_BASE="$rt" \
    --build-arg TREE="$TREE_IMAGE" --build-arg WITH_NVRTC="$WITH_NVRTC" \
    -t "$IMAGE" "$ROOT" >/dev/null
  podman rmi --force "$TREE_IMAGE" >/dev/null 2>&1 || true
  drop_previous "$IMAGE" "$old"
  log "built $IMAGE"
}

image_full() {
  local rt=$1 bb=$2
  timed "full: podman build (compiles)" podman build --format docker --network host \
    -f "$HERE/Containerfile" --build-arg BUILD_BASE="$bb" --build-arg RUNTIME_BASE="$rt" \
    --build-arg WITH_NVRTC="$WITH_NVRTC" -t "$IMAGE" "$ROOT" >&2
  log "built $IMAGE"
}

image_services() {
  local sb old
  if [ "${OPJIT_SERVICES_BASE:-runtime}" = own ]; then
    sb=$(base services "$HERE/packages-services.txt")
  else
    sb=$(base runtime "$HERE/packages-runtime.txt")
  fi
  old=$(podman image inspect --format '{{.Id}}' "$SERVICES_IMAGE" 2>/dev/null || true)
  timed "services: podman build" podman build --quiet --format docker --network host \
    -f "$HERE/Containerfile.services" --build-arg SERVICES_BASE="$sb" -t "$SERVICES_IMAGE" "$ROOT" >/dev/null
  drop_previous "$SERVICES_IMAGE" "$old"
  log "built $SERVICES_IMAGE"
}

# The whole file is read before anything runs (an edit of this script
# during a build does not change the running one).
main() {
  local T0
  T0=$(date +%s)
  case "${1:-fast}" in
    fast) image_fast "$(base runtime "$HERE/packages-runtime.txt")" ;;
    full)
      rt=$(base runtime "$HERE/packages-runtime.txt")
      image_full "$rt" "$(base build "$HERE/packages-build.txt")" ;;
    services) image_services ;;
    ci)
      rt=$(base runtime "$HERE/packages-runtime.txt")
      image_fast "$rt"
      image_services ;;
    bases)
      base runtime "$HERE/packages-runtime.txt" >/dev/null
      [ "${OPJIT_SERVICES_BASE:-runtime}" != own ] || base services "$HERE/packages-services.txt" >/dev/null ;;
    *) sed -n '2,30p' "$0"; exit 2 ;;
  esac
  log "total: $(( $(date +%s) - T0 ))s"
}
main "$@"
exit
