#!/usr/bin/env bash
# The newcomer check: the README's set-up, run literally on a fresh Debian 12
# (bookworm) root, from a clean clone of this repository.
#
#   deploy/fresh-check.sh                  unit and integration suites
#   deploy/fresh-check.sh --labels REGEX   ctest -L REGEX -LE variant instead
#   deploy/fresh-check.sh --all            make test (every suite, then the
#                                          sanitizer pass and the fuzzers)
#   deploy/fresh-check.sh --keep           keep the root (its path is printed)
#   deploy/fresh-check.sh --rebuild-root   fetch a new base root even if
#                                          today's is cached
#   deploy/fresh-check.sh --jobs N         build and test jobs (default 2)
#   deploy/fresh-check.sh --clone-dir DIR  where the clone goes in the root
#                                          (default /opt/opjit)
#   deploy/fresh-check.sh --stop-after P   stop after phase P (root, clone,
#                                          deps, configure, build)
#
# Phases, each timed:
#   1. root      mmdebstrap --variant=minbase bookworm (+ ca-certificates), from
#                the host's own Debian apt sources; the tarball is cached per
#                day in ${XDG_CACHE_HOME:-~/.cache}/opjit/
#   2. clone     git clone of HEAD into /opt/opjit inside the root:
#                UNCOMMITTED CHANGES ARE NOT INCLUDED, commit first.
#                Not under /root: some tests run a daemon or a client as
#                nobody (setpriv), which must read the build tree, and
#                /root is mode 0700 (--clone-dir /root/opjit shows it)
#   3. deps      bash deploy/install-deps.sh (the root has no make yet: it
#                comes with build-essential)
#   4. configure make configure (install-deps again, which must find nothing
#                missing, then cmake)
#   5. build     make build
#   6. test      ctest -L 'unit|integration' -LE variant (or --labels, --all)
#
# The root runs in its own mount and PID namespaces (pivot_root, like a
# container): fresh /proc, /sys of the host, a private /dev with its own
# /dev/shm and /dev/pts, the host's network (apt needs it; tests use
# loopback). The CUDA toolkit is not a Debian package: the machines this
# project runs on come with it preinstalled in /usr/local/cuda, so it is
# bind-mounted read-only into the root at the same path (with the same
# /usr/local/cuda symlink and its /etc/ld.so.conf.d entry, as NVIDIA's
# installer leaves them; NVRTC loads libnvrtc-builtins through ld.so). The
# build needs its headers; GPU tests skip without a GPU. The host's local CA
# certificates (/usr/local/share/ca-certificates, e.g. an egress proxy's) are
# copied in likewise, for npm's HTTPS. Services that packages install
# (PostgreSQL, Redis) are not started in the root: a policy-rc.d refuses,
# and the tests start their own servers. Downloaded .debs are kept in
# ${XDG_CACHE_HOME:-~/.cache}/opjit/fresh-apt-archives so a re-run does not
# download them again; everything else starts from scratch each run.
#
# Needs root (mounts, pivot_root), mmdebstrap, git, and about 8 GB in
# ${TMPDIR:-/tmp}. Exits non-zero if any phase fails.
set -euo pipefail

SUITE=bookworm
LABELS='unit|integration'
ALL=0
KEEP=0
REBUILD_ROOT=0
JOBS=2
STOP_AFTER=""
SRC=/opt/opjit

usage() { awk 'NR > 1 && /^# Phases/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --labels) LABELS="${2:?--labels needs a regex}"; shift 2 ;;
    --labels=*) LABELS="${1#--labels=}"; shift ;;
    --all) ALL=1; shift ;;
    --keep) KEEP=1; shift ;;
    --rebuild-root) REBUILD_ROOT=1; shift ;;
    --jobs) JOBS="${2:?--jobs needs a number}"; shift 2 ;;
    --jobs=*) JOBS="${1#--jobs=}"; shift ;;
    --stop-after) STOP_AFTER="${2:?--stop-after needs a phase}"; shift 2 ;;
    --stop-after=*) STOP_AFTER="${1#--stop-after=}"; shift ;;
    --clone-dir) SRC="${2:?--clone-dir needs a path}"; shift 2 ;;
    --clone-dir=*) SRC="${1#--clone-dir=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "fresh-check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "fresh-check: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "needs root (mounts and pivot_root); run it with sudo"
for tool in mmdebstrap git unshare pivot_root; do
  command -v "$tool" >/dev/null || die "$tool is missing (apt-get install mmdebstrap git util-linux)"
done

CUDA_REAL=""
if [ -d /usr/local/cuda/include ]; then CUDA_REAL="$(readlink -f /usr/local/cuda)"; fi
case "$SRC" in /*) ;; *) die "--clone-dir must be an absolute path" ;; esac
REPO="$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)"
REV="$(git -C "$REPO" rev-parse --short HEAD)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/opjit"
mkdir -p "$CACHE/fresh-apt-archives/partial"
TEST_LOG="$CACHE/fresh-check-test.log"   # the test phase's output, kept
: > "$TEST_LOG"

# ---- phase bookkeeping -------------------------------------------------------
PHASES=()
T_START=$(date +%s)
summary() {
  local rc=$1
  echo
  echo "fresh-check summary (clean clone of $REV, started $(date -u -d "@$T_START" '+%F %T') UTC)"
  local p
  for p in "${PHASES[@]}"; do echo "  $p"; done
  if [ -s "$TEST_LOG" ]; then
    grep -E '^[0-9]+% tests passed|^Total Test time' "$TEST_LOG" | sed 's/^/  ctest: /' || true
    sed -n '/^The following tests FAILED/,/^[^[:space:]]/p' "$TEST_LOG" | grep -E '^[[:space:]]+[0-9]+ - ' \
      | sed 's/^[[:space:]]*/  failed: /' || true
    echo "  test log: $TEST_LOG"
  fi
  echo "  total      $(( $(date +%s) - T_START )) s"
  if [ "$rc" -eq 0 ]; then echo "fresh-check: PASS"; else echo "fresh-check: FAIL (exit $rc)"; fi
}
# phase NAME CMD...: runs CMD, records its time and exit status; stops on failure.
phase() {
  local name="$1"; shift
  local t0 rc=0
  t0=$(date +%s)
  echo
  echo "==== fresh-check: $name ($(date -u '+%T') UTC)"
  # A subshell, so that set -e holds inside the phase's functions.
  set +e; ( set -e; "$@" ); rc=$?; set -e
  local dt=$(( $(date +%s) - t0 ))
  PHASES+=("$(printf '%-10s %6d s  %s' "$name" "$dt" "$([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)")")")
  [ $rc -eq 0 ] || exit $rc
  if [ "$name" = "$STOP_AFTER" ]; then echo "fresh-check: stopping after $name"; exit 0; fi
}

# ---- the root ----------------------------------------------------------------
ROOT=""
cleanup() {
  local rc=$?
  if [ -n "$ROOT" ] && [ -d "$ROOT" ]; then
    # Mounts live only in the check's own mount namespace, which is gone once
    # its processes are; refuse to delete anything still mounted all the same.
    if grep -q " $ROOT/" /proc/self/mountinfo; then
      grep " $ROOT/" /proc/self/mountinfo | awk '{print $5}' | sort -r | xargs -r -n1 umount -l || true
    fi
    if grep -q " $ROOT/" /proc/self/mountinfo; then
      echo "fresh-check: mounts remain under $ROOT; not deleting it" >&2
    elif [ "$KEEP" -eq 1 ]; then
      echo "fresh-check: root kept in $ROOT"
    else
      rm -rf --one-file-system "$ROOT"
    fi
  fi
  summary "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
ROOT="$(mktemp -d "${TMPDIR:-/tmp}/opjit-fresh.XXXXXX")"
chmod 755 "$ROOT"

# The host's Debian apt sources as one-line entries (only Debian mirrors:
# nothing else is assumed reachable, and a fresh machine has nothing else).
host_sources() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    grep -E '^[[:space:]]*deb[[:space:]]' "$f" | grep -i 'debian' || true
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk '
      function flush() {
        if (uris != "" && uris ~ /debian/ && types ~ /(^| )deb( |$)/ && enabled != "no") {
          n = split(uris, u, " "); m = split(suites, s, " ")
          for (i = 1; i <= n; i++) for (j = 1; j <= m; j++)
            printf "deb %s%s %s %s\n", (signed != "" ? "[signed-by=" signed "] " : ""), u[i], s[j], comps
        }
        types = uris = suites = comps = signed = enabled = ""
      }
      /^[[:space:]]*#/ { next }
      /^[[:space:]]*$/ { flush(); next }
      {
        key = tolower($1); sub(/:$/, "", key); $1 = ""; sub(/^ +/, "")
        if (key == "types") types = $0
        else if (key == "uris") uris = $0
        else if (key == "suites") suites = $0
        else if (key == "components") comps = $0
        else if (key == "signed-by") signed = $0
        else if (key == "enabled") enabled = tolower($0)
      }
      END { flush() }' "$f"
  done
}

make_base() {
  local tar
  tar="$CACHE/fresh-root-$SUITE-$(date -u +%Y%m%d).tar"
  if [ -s "$tar" ] && [ "$REBUILD_ROOT" -eq 0 ]; then
    echo "base root: cached $tar"
  else
    local sources="$CACHE/fresh-sources.list"
    host_sources | sort -u > "$sources"
    [ -s "$sources" ] || die "no Debian apt source found in /etc/apt/sources.list*"
    echo "base root from:"; sed 's/^/  /' "$sources"
    # The host's apt options that a dated mirror snapshot needs.
    local opts=()
    local o
    for o in Acquire::Check-Valid-Until Acquire::Check-Date; do
      if apt-config dump | grep -q "^$o \"false\";"; then opts+=(--aptopt="$o \"false\""); fi
    done
    rm -f "$CACHE"/fresh-root-"$SUITE"-*.tar
    mmdebstrap --variant=minbase --format=tar --include=ca-certificates "${opts[@]}" \
      "$SUITE" "$tar.part" "$sources"
    mv "$tar.part" "$tar"
  fi
  tar -C "$ROOT" --numeric-owner -xpf "$tar"
  # What a fresh machine has that a bare root does not.
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' > "$ROOT/etc/hosts"
  echo "opjit-fresh" > "$ROOT/etc/hostname"
  # No services start inside the root (there is no init); tests run their own.
  printf '#!/bin/sh\nexit 101\n' > "$ROOT/usr/sbin/policy-rc.d"
  chmod 755 "$ROOT/usr/sbin/policy-rc.d"
  mkdir -p "$ROOT/.oldroot"
  # The CUDA toolkit as installed on the host (see the top of this file).
  if [ -n "$CUDA_REAL" ]; then
    mkdir -p "$ROOT$CUDA_REAL"
    if [ -L /usr/local/cuda ]; then ln -sfn "$(readlink /usr/local/cuda)" "$ROOT/usr/local/cuda"; fi
    local conf
    for conf in /etc/ld.so.conf.d/*; do
      if grep -qs "^$CUDA_REAL\|^/usr/local/cuda" "$conf"; then cp "$conf" "$ROOT/etc/ld.so.conf.d/"; fi
    done
    in_root "ldconfig"
    echo "CUDA toolkit: $CUDA_REAL (read-only)"
  fi
  # The machine's own trust store: where egress goes through a TLS proxy, its
  # CA is installed on every machine of this kind (under
  # /usr/local/share/ca-certificates), and HTTPS clients (npm ci for the Node
  # test) need it; apt uses plain HTTP and does not.
  local crt n=0
  for crt in /usr/local/share/ca-certificates/*.crt; do
    [ -f "$crt" ] || continue
    mkdir -p "$ROOT/usr/local/share/ca-certificates"
    cp "$crt" "$ROOT/usr/local/share/ca-certificates/"
    n=$((n + 1))
  done
  if [ "$n" -gt 0 ]; then
    in_root "update-ca-certificates >/dev/null"
    echo "local CA certificates: $n (as on the host)"
  fi
  echo "root: $ROOT"
}

clone_repo() {
  if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]; then
    echo "note: the working tree has uncommitted changes; they are NOT in the check (HEAD $REV only)"
  fi
  mkdir -p "$(dirname "$ROOT$SRC")"
  git clone --quiet --no-hardlinks "$REPO" "$ROOT$SRC"
  git -C "$ROOT$SRC" log -1 --format="clone: %h %s (in $SRC)"
}

# in_root CMD: runs the shell command CMD in / inside the root, as
# root, with a clean environment, in new mount and PID namespaces; every
# process it leaves is killed when it returns.
in_root() {
  unshare --mount --propagation private --pid --fork --kill-child -- \
    /bin/bash -euc '
      R="$1"; CMD="$2"
      mount --bind "$R" "$R"
      mount -t proc proc "$R/proc"
      mount --rbind /sys "$R/sys"
      mount -t tmpfs -o mode=755,nosuid dev "$R/dev"
      for n in null zero full random urandom tty; do
        touch "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n"
      done
      mkdir -p "$R/dev/shm" "$R/dev/pts" "$R/dev/mqueue"
      mount -t tmpfs -o mode=1777,nosuid,nodev shm "$R/dev/shm"
      mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$R/dev/pts"
      mount -t mqueue mqueue "$R/dev/mqueue"
      ln -s pts/ptmx "$R/dev/ptmx"; ln -s /proc/self/fd "$R/dev/fd"
      ln -s /proc/self/fd/0 "$R/dev/stdin"; ln -s /proc/self/fd/1 "$R/dev/stdout"
      ln -s /proc/self/fd/2 "$R/dev/stderr"
      if [ -n "$4" ]; then mount -o bind,ro "$4" "$R$4"; fi
      mount --bind "$3" "$R/var/cache/apt/archives"
      cd "$R"
      pivot_root . .oldroot
      cd /
      umount -l /.oldroot
      exec /usr/bin/env -i HOME=/root USER=root LOGNAME=root SHELL=/bin/bash \
        LANG=C.UTF-8 TERM="${TERM:-dumb}" \
        NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        /bin/bash -euc "$CMD"
    ' fresh-root "$ROOT" "$1" "$CACHE/fresh-apt-archives" "$CUDA_REAL"
}

run_tests() { in_root "cd $SRC && $TEST_CMD" 2>&1 | tee "$TEST_LOG"; }

if [ "$ALL" -eq 1 ]; then
  TEST_CMD="make test JOBS=$JOBS"
  TEST_NAME="test (make test)"
else
  TEST_CMD="ctest --test-dir build --output-on-failure --timeout 600 -j$JOBS -L '$LABELS' -LE variant"
  TEST_NAME="test"
fi

echo "fresh-check: $REPO at $REV, Debian $SUITE, tests: $([ "$ALL" -eq 1 ] && echo 'make test' || echo "-L '$LABELS' -LE variant")"
phase root make_base
phase clone clone_repo
REV="$(git -C "$ROOT$SRC" rev-parse --short HEAD)"
phase deps in_root "cd $SRC && bash deploy/install-deps.sh"
phase configure in_root "cd $SRC && make configure"
phase build in_root "cd $SRC && make build JOBS=$JOBS"
phase "$TEST_NAME" run_tests
