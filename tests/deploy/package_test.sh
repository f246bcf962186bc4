#!/bin/bash
# The Debian package, end to end (ctest label "deploy"):
#   1. cpack builds opjit_<version>_<arch>.deb from the build tree (timed);
#   2. its control data: name, version, dependencies, conffiles, maintainer
#      scripts; its documentation (copyright, changelog, a man page for every
#      program in /usr/bin and /usr/sbin); lintian finds no error and no
#      warning (deliberate exceptions: deploy/debian/lintian-overrides);
#      systemd-analyze verifies the unit and scores its hardening;
#   3. dpkg installs it into a temp root (chrootless: the postinst runs with
#      $DPKG_ROOT set and must not create users on this host);
#   4. the installed opjitd (its helpers from <root>/usr/libexec/opjit, its
#      headers from <root>/usr/share/opjit/include, the shipped config) serves
#      the installed opjit CLI and Python package: an op is registered, run, and
#      its output numbers checked. The daemon runs under what the unit's
#      hardening amounts to (unit_sandbox.sh: non-root, no_new_privs, no
#      capabilities, read-only system, private /tmp, the unit's syscall,
#      address-family and namespace filters), so the unit's options are shown
#      not to break it;
#   5. the postinst, run twice on copies of /etc and /var/lib in a private
#      mount namespace, creates the opjit user, group and directories once;
#   6. the start without systemd, as deploy/README.md gives it (the same
#      commands, checked to be there verbatim): adduser, the state and runtime
#      directories, runuser; in a private mount namespace over copies of /etc,
#      /var/lib and /run, with the package's /usr overlaid on the host's.
# usage: package_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail

BUILD=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)

for tool in cpack dpkg dpkg-deb lintian; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIP: $tool is not installed"
    exit 77
  fi
done
if [ ! -x "$BUILD/bin/opjitd" ] || [ ! -d "$BUILD/python/opjit/v1" ]; then
  echo "FAIL: build the tree first (bin/opjitd, python/opjit)"
  exit 1
fi

# Under the build dir, not /tmp: the hardened daemon gets a private /tmp.
WORK=$(mktemp -d "$BUILD/deploy-test.XXXXXX")
chmod 0755 "$WORK"
. "$(dirname "$0")/lib.sh"

# ---- 1. cpack ------------------------------------------------------------------
t0=$(date +%s.%N)
cpack --config "$BUILD/CPackConfig.cmake" -G DEB -B "$WORK/pkg" >"$WORK/cpack.log" 2>&1 ||
  { cat "$WORK/cpack.log"; fail "cpack"; }
t1=$(date +%s.%N)
DEB=$(ls "$WORK"/pkg/opjit_*.deb)
printf 'cpack: %s in %.1f s, %s KiB\n' "$(basename "$DEB")" "$(echo "$t1 - $t0" | bc)" \
  "$(( $(stat -c %s "$DEB") / 1024 ))"

# ---- 2. control data, unit -----------------------------------------------------------
VERSION=$(sed -n 's/^project(opjit VERSION \([0-9.]*\).*/\1/p' "$SRC/CMakeLists.txt")
[ "$(dpkg-deb -f "$DEB" Package)" = opjit ] || fail "package name"
[ "$(dpkg-deb -f "$DEB" Version)" = "$VERSION" ] || fail "version is not project()'s $VERSION"
DEPENDS=$(dpkg-deb -f "$DEB" Depends)
echo "Depends: $DEPENDS"
for dep in libc6 libstdc++6 libclang-cpp16 libllvm16 libgrpc++1.51 libc6-dev libstdc++-12-dev \
           libclang-common-16-dev python3-grpcio python3-protobuf python3-numpy; do
  echo "$DEPENDS" | tr ',|' '\n\n' | sed 's/^ *//; s/ .*//' | grep -qxF "$dep" ||
    fail "Depends lacks $dep"
done
dpkg-deb -e "$DEB" "$WORK/control"
for f in postinst prerm postrm conffiles; do [ -f "$WORK/control/$f" ] || fail "no $f"; done
grep -qx /etc/opjit/opjitd.toml "$WORK/control/conffiles" || fail "opjitd.toml is not a conffile"
# Stripped: no debug sections in the big binaries.
dpkg-deb -x "$DEB" "$WORK/x"
for b in usr/bin/opjitd usr/libexec/opjit/opjit-compile-worker; do
  if readelf -S "$WORK/x/$b" | grep -q '\.debug_info'; then fail "$b is not stripped"; fi
done
if dpkg-deb -c "$DEB" | grep -Eq '_test$|_bench$|/tests?/'; then fail "tests or benches packaged"; fi

# Documentation: Debian's copyright and changelog (a native package's
# changelog.gz, whose latest entry is this version), a man page for every
# program on the PATH, and the lintian overrides.
dpkg-deb -c "$DEB" | awk '{print $NF}' | sed 's|^\./|/|' >"$WORK/contents.txt"
for f in /usr/share/doc/opjit/copyright /usr/share/doc/opjit/changelog.gz \
         /usr/share/lintian/overrides/opjit; do
  grep -qxF "$f" "$WORK/contents.txt" || fail "$f not in the package"
done
clog=$(gzip -dc "$WORK/x/usr/share/doc/opjit/changelog.gz" | dpkg-parsechangelog -l- -S Version)
[ "$clog" = "$VERSION" ] || fail "changelog's latest entry is $clog, not $VERSION"
progs=$(grep -E '^/usr/s?bin/[^/]+$' "$WORK/contents.txt" | xargs -n1 basename)
for p in $progs; do
  grep -Eqx "/usr/share/man/man[18]/$p\.[18]\.gz" "$WORK/contents.txt" || fail "no man page for $p"
done
echo "docs: copyright, changelog $clog, man pages for" $progs

# lintian: no error and no warning (info tags and overrides are printed, not
# fatal). As root it says "running with root privileges is not recommended".
lintian --fail-on error,warning --display-info --show-overrides "$DEB" >"$WORK/lintian.log" 2>&1 ||
  { cat "$WORK/lintian.log"; fail "lintian"; }
echo "lintian $(lintian --version | awk '{print $2}'): no errors, no warnings;" \
     "$(grep -c '^I: ' "$WORK/lintian.log" || true) info tags, $(grep -c '^O: ' "$WORK/lintian.log" || true) overridden"
grep -E '^[IO]: ' "$WORK/lintian.log" | sed 's/^/  /' || true

if command -v systemd-analyze >/dev/null; then
  # The unit as installed, with ExecStart= pointing into the unpacked package
  # (verify checks that the binary exists; --root= would need a whole system).
  sed "s|=/usr/bin/opjitd |=$WORK/x/usr/bin/opjitd |" "$WORK/x/usr/lib/systemd/system/opjitd.service" \
    >"$WORK/opjitd.service"
  grep -q "^ExecStart=$WORK/x/usr/bin/opjitd " "$WORK/opjitd.service" || fail "ExecStart= is not /usr/bin/opjitd"
  systemd-analyze verify --man=no "$WORK/opjitd.service" >"$WORK/verify.log" 2>&1 ||
    { cat "$WORK/verify.log"; fail "systemd-analyze verify"; }
  grep -v "^$" "$WORK/verify.log" || true
  echo "systemd-analyze verify: ok"
  if systemd-analyze security --offline=yes "$WORK/opjitd.service" \
       >"$WORK/security.log" 2>&1; then
    score=$(grep -o 'Overall exposure level for opjitd.service: [0-9.]*' "$WORK/security.log" |
            grep -o '[0-9.]*$')
    echo "systemd-analyze security: exposure $score (0 best, 10 worst)"
    awk -v s="$score" 'BEGIN { exit !(s <= 2.5) }' || { cat "$WORK/security.log"; fail "exposure $score > 2.5"; }
  fi
else
  echo "note: no systemd-analyze; unit not verified"
fi

# ---- 3. dpkg into a temp root ------------------------------------------------------
ROOT="$WORK/root"
mkdir -p "$ROOT/var/lib/dpkg/info" "$ROOT/var/lib/dpkg/updates" "$ROOT/var/log"
touch "$ROOT/var/lib/dpkg/status"
passwd_before=$(md5sum /etc/passwd /etc/group)
dpkg --root="$ROOT" --force-script-chrootless --force-depends --force-not-root \
  -i "$DEB" >"$WORK/dpkg.log" 2>&1 || { cat "$WORK/dpkg.log"; fail "dpkg -i"; }
[ "$(dpkg --root="$ROOT" -s opjit | sed -n 's/^Status: //p')" = "install ok installed" ] ||
  fail "package not configured"
[ "$passwd_before" = "$(md5sum /etc/passwd /etc/group)" ] || fail "postinst changed this host's users"
for f in usr/bin/opjitd usr/bin/opjit \
         usr/libexec/opjit/opjit-compile-worker usr/libexec/opjit/opjit-exec-worker \
         usr/libexec/opjit/opjit-gpu-sandbox \
         usr/share/opjit/include/opjit/kernel.h usr/share/opjit/include/custom_aot_extra.h \
         etc/opjit/opjitd.toml \
         usr/lib/systemd/system/opjitd.service usr/lib/sysusers.d/opjit.conf \
         usr/lib/tmpfiles.d/opjit.conf \
         usr/lib/python3/dist-packages/opjit/__init__.py \
         usr/lib/python3/dist-packages/opjit/v1/exec_pb2_grpc.py \
         var/lib/opjit; do
  [ -e "$ROOT/$f" ] || fail "missing /$f"
done
[ -x "$ROOT/usr/bin/opjitd" ] || fail "opjitd not executable"
echo "dpkg --root: installed, $(find "$ROOT/usr" -type f | wc -l) files"

# ---- 4. the installed daemon, CLI and Python package ---------------------------------
STATE="$WORK/state"
mkdir -p "$STATE"
SOCK="unix:$STATE/s.sock"
# The source tree's kernel headers and the build tree's binaries are hidden
# from it: the installed tree must stand alone.
OPJIT_SANDBOX_HIDE="$SRC/kernels $BUILD/bin" \
  "$HERE/unit_sandbox.sh" "$ROOT/usr/lib/systemd/system/opjitd.service" "$STATE" "$WORK/sandbox.txt" -- \
  "$ROOT/usr/bin/opjitd" --config "$ROOT/etc/opjit/opjitd.toml" --state-dir "$STATE" \
  --listen "$SOCK" >"$WORK/opjitd.log" 2>&1 &
DAEMON_PID=$!
CLI="$ROOT/usr/bin/opjit"
for _ in $(seq 300); do
  "$CLI" --server "$SOCK" info >/dev/null 2>&1 && break
  kill -0 "$DAEMON_PID" 2>/dev/null || fail "opjitd exited"
  sleep 0.1
done
"$CLI" --server "$SOCK" info >"$WORK/info.txt" 2>&1 || fail "opjitd did not answer"
cat "$WORK/sandbox.txt"

cp "$SRC/kernels/examples/leaky_relu.json" "$SRC/kernels/examples/leaky_relu.cc" "$WORK/"
"$CLI" --server "$SOCK" register "$WORK/leaky_relu.json" || fail "register"
/usr/bin/python3 -c "import numpy as np; np.save('$WORK/x.npy', np.array([-2, -1, 0, 3], np.float32))"
"$CLI" --server "$SOCK" run leaky_relu --in "$WORK/x.npy" --attr alpha=0.5 --out "$WORK/y.npy" ||
  fail "run"
/usr/bin/python3 - "$WORK/y.npy" <<'EOF' || fail "wrong output"
import sys
import numpy as np
y = np.load(sys.argv[1])
print("leaky_relu([-2, -1, 0, 3], alpha=0.5) =", y.tolist())
assert y.dtype == np.float32 and y.tolist() == [-1.0, -0.5, 0.0, 3.0], y
EOF

# The compile and executor workers that ran are the installed ones.
helpers=$(for p in $(pgrep -P "$DAEMON_PID"); do
            readlink "/proc/$p/exe" || true; done | sort -u)
echo "daemon's helper processes: ${helpers:-none alive}"
echo "$helpers" | grep -q "^$ROOT/usr/libexec/opjit/opjit-exec-worker$" ||
  fail "the executor is not the installed one"
# Compile workers may be gone by now; the daemon names the one it uses.
grep -q "worker $ROOT/usr/libexec/opjit/opjit-compile-worker," "$WORK/opjitd.log" ||
  fail "the compile worker is not the installed one"

# The installed Python package (Debian's dist-packages layout) talks to it.
env -u PYTHONPATH PYTHONPATH="$ROOT/usr/lib/python3/dist-packages" PYTHONDONTWRITEBYTECODE=1 \
  /usr/bin/python3 - "$SOCK" "$ROOT" <<'EOF' || fail "installed Python package"
import sys
import numpy as np
import opjit
assert opjit.__file__.startswith(sys.argv[2]), opjit.__file__
with opjit.Client(sys.argv[1]) as c:
    y = np.asarray(c.op("leaky_relu")(np.array([-4.0, 2.0], np.float32), alpha=0.25))
    print("python client: leaky_relu([-4, 2], alpha=0.25) =", y.tolist())
    assert y.tolist() == [-1.0, 2.0], y
EOF

kill -TERM "$DAEMON_PID"
wait "$DAEMON_PID" || fail "opjitd exited with $? on SIGTERM"
DAEMON_PID=""
grep -q "bye" "$WORK/opjitd.log" || fail "no clean shutdown"

# ---- 5. the postinst on a real root -------------------------------------------------
# In a private mount namespace over copies of /etc, /var/lib and the
# sysusers.d/tmpfiles.d dirs (this host is left alone): run twice, it creates
# the opjit user and group once and the directories; with systemd-sysusers
# (the package's sysusers.d file present) and with adduser (absent).
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
  for how in sysusers adduser; do
    unshare -m -- /bin/bash -s "$WORK" "$how" "$WORK/x" <<'EOS' || fail "postinst ($how)"
set -euo pipefail
WORK=$1 HOW=$2 PKG=$3
mount --make-rprivate /
T="$WORK/postinst-$HOW"
mkdir -p "$T"
mount -t tmpfs tmpfs "$T"
mkdir -p "$T/var-lib" "$T/sysusers.d" "$T/tmpfiles.d"
cp -a /etc "$T/etc"
cp -a /usr/lib/tmpfiles.d/. "$T/tmpfiles.d/"
cp -a /usr/lib/sysusers.d/. "$T/sysusers.d/"
cp "$PKG/usr/lib/tmpfiles.d/opjit.conf" "$T/tmpfiles.d/"
[ "$HOW" = sysusers ] && cp "$PKG/usr/lib/sysusers.d/opjit.conf" "$T/sysusers.d/"
mount --bind "$T/etc" /etc
mount --bind "$T/var-lib" /var/lib
mount --bind "$T/sysusers.d" /usr/lib/sysusers.d
mount --bind "$T/tmpfiles.d" /usr/lib/tmpfiles.d
mkdir -p "$T/run"
mount --bind "$T/run" /run  # tmpfiles.d makes /run/opjit-uids: not on this host's /run
! getent passwd opjit >/dev/null || { echo "opjit exists before the postinst"; exit 1; }
env -u DPKG_ROOT sh "$PKG/../control/postinst" configure ""
env -u DPKG_ROOT sh "$PKG/../control/postinst" configure 0.1.0  # again: idempotent
[ "$(getent passwd opjit | wc -l)" = 1 ] && [ "$(getent group opjit | wc -l)" = 1 ] ||
  { echo "user/group opjit not created exactly once"; exit 1; }
[ "$(stat -c '%U:%G %a' /var/lib/opjit)" = "opjit:opjit 750" ] ||
  { echo "/var/lib/opjit: $(stat -c '%U:%G %a' /var/lib/opjit)"; exit 1; }
[ -d /etc/opjit ] || { echo "no /etc/opjit"; exit 1; }
[ "$(stat -c '%U:%G %a' /run/opjit-uids)" = "opjit:opjit 700" ] ||
  { echo "/run/opjit-uids: $(stat -c '%U:%G %a' /run/opjit-uids 2>&1)"; exit 1; }
for f in subuid subgid; do
  [ "$(grep -c '^opjit:1879048192:65536$' /etc/$f)" = 1 ] ||
    { echo "/etc/$f: $(grep '^opjit:' /etc/$f | tr '\n' ' ')"; exit 1; }
done
shell=$(getent passwd opjit | cut -d: -f7)
echo "postinst via $HOW: $(getent passwd opjit | cut -d: -f1,3,4,6) shell $shell," \
     "/var/lib/opjit $(stat -c '%U:%G %a' /var/lib/opjit); second run: no change"
EOS
  done
else
  echo "note: postinst on a real root not run (needs root and unshare -m)"
fi

# ---- 6. the start without systemd, as deploy/README.md gives it ------------------
# The commands, each also a line of deploy/README.md ("sudo " + command), so the
# documentation and this test cannot drift apart.
NOSYSTEMD=(
  'adduser --system --group --home /var/lib/opjit --shell /usr/sbin/nologin opjit'
  'install -d -o opjit -g opjit -m 0750 /var/lib/opjit'
  'install -d -o opjit -g opjit -m 0755 /run/opjit'
  'install -d -o opjit -g opjit -m 0700 /run/opjit-uids'
  "runuser -u opjit -- sh -c 'umask 0027 && exec /usr/bin/opjitd --config /etc/opjit/opjitd.toml --state-dir /var/lib/opjit --listen unix:/run/opjit/opjitd.sock'"
)
for c in "${NOSYSTEMD[@]}"; do
  grep -qxF "sudo $c" "$SRC/deploy/README.md" || fail "deploy/README.md lacks the line: sudo $c"
done
# Run in a private mount namespace: copies of /etc (the package's config
# added), empty /var/lib and /run, and the package's /usr overlaid on the
# host's (so /usr/bin/opjitd is the packaged one); this host is left alone.
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
  unshare -m -- /bin/bash -s "$WORK" "$WORK/x" "${NOSYSTEMD[@]}" <<'EOS' || fail "start without systemd"
set -euo pipefail
WORK=$1 PKG=$2
shift 2
mount --make-rprivate /
T="$WORK/nosystemd"
mkdir -p "$T"
mount -t tmpfs tmpfs "$T"
mkdir -p "$T/var-lib" "$T/run"
cp -a /etc "$T/etc"
cp -a "$PKG/etc/opjit" "$T/etc/"
if ! mount -t overlay overlay -o "lowerdir=$PKG/usr:/usr" /usr 2>"$T/overlay.err"; then
  echo "note: start without systemd not run (no overlayfs: $(cat "$T/overlay.err"))"
  exit 0
fi
mount --bind "$T/etc" /etc
mount --bind "$T/var-lib" /var/lib
mount --bind "$T/run" /run
! getent passwd opjit >/dev/null || { echo "opjit exists before adduser"; exit 1; }
for c in "${@:1:$#-1}"; do sh -c "$c"; done
bash -c "exec ${!#}" >"$T/opjitd.log" 2>&1 &
RUNUSER=$!  # runuser itself (exec), which passes SIGTERM on to its child
stop() {
  kill -0 "$RUNUSER" 2>/dev/null || return 0
  kill -TERM "$RUNUSER" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$RUNUSER" 2>/dev/null || break; sleep 0.1; done
  pkill -KILL -P "$RUNUSER" 2>/dev/null || true
  kill -KILL "$RUNUSER" 2>/dev/null || true
}
trap stop EXIT
SOCK=unix:/run/opjit/opjitd.sock
for _ in $(seq 300); do
  /usr/bin/opjit --server "$SOCK" info >/dev/null 2>&1 && break
  kill -0 "$RUNUSER" 2>/dev/null || { echo "opjitd exited:"; tail -20 "$T/opjitd.log"; exit 1; }
  sleep 0.1
done
/usr/bin/opjit --server "$SOCK" info >/dev/null || { tail -20 "$T/opjitd.log"; exit 1; }
# runuser forks: the daemon is a descendant of the background job.
descendant() {
  local c
  for c in $(pgrep -P "$1"); do
    if [ "$(cat "/proc/$c/comm" 2>/dev/null)" = "$2" ]; then echo "$c"; return 0; fi
    descendant "$c" "$2" && return 0
  done
  return 1
}
DAEMON=$(descendant "$RUNUSER" opjitd) || { echo "no opjitd under runuser"; exit 1; }
[ "$(stat -c %U "/proc/$DAEMON")" = opjit ] || { echo "opjitd does not run as opjit"; exit 1; }
[ "$(readlink "/proc/$DAEMON/exe")" = /usr/bin/opjitd ] || { echo "not /usr/bin/opjitd"; exit 1; }
sock=$(stat -c '%U:%G %a' /run/opjit/opjitd.sock)
[ "$sock" = "opjit:opjit 660" ] || { echo "socket: $sock"; exit 1; }
[ "$(stat -c %U /var/lib/opjit/registry.db)" = opjit ] || { echo "state not owned by opjit"; exit 1; }
# Who may use it: a member of group opjit (usermod -aG, as the README says)
# reaches the socket, not others; under the packaged config the member is no
# admin, and nobody at all until a [[principal]] names their uid.
adduser --system --quiet --no-create-home opjit-member
usermod -aG opjit opjit-member
if runuser -u opjit-member -- /usr/bin/opjit --server "$SOCK" cache clear >"$T/member.txt" 2>&1; then
  echo "an unlisted member of group opjit cleared the cache"; exit 1
fi
grep -q UNAUTHENTICATED "$T/member.txt" ||
  { echo "a member of group opjit cannot use the socket: $(cat "$T/member.txt")"; exit 1; }
if runuser -u nobody -- /usr/bin/opjit --server "$SOCK" info >"$T/nobody.txt" 2>&1; then
  echo "nobody could use the socket"; exit 1
fi
kill -TERM "$DAEMON"
wait "$RUNUSER" || { echo "runuser/opjitd exited with $? on SIGTERM"; tail -20 "$T/opjitd.log"; exit 1; }
[ ! -e /run/opjit/opjitd.sock ] || { echo "socket left behind"; exit 1; }
echo "start without systemd: opjitd as $(getent passwd opjit | cut -d: -f1,3,4)," \
     "socket $sock; a group member is served, nobody is refused" \
     "($(head -1 "$T/nobody.txt")); SIGTERM: clean exit, socket removed"
EOS
else
  echo "note: start without systemd not run (needs root and unshare -m)"
fi
echo "PASS"
