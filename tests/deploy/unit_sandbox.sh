#!/bin/bash
# Runs a command under what a systemd unit's hardening amounts to, as far as
# that can be had without systemd as PID 1 (tests/deploy/package_test.sh).
#   unit_sandbox.sh UNIT STATE_DIR REPORT_FILE -- COMMAND [ARGS...]
# STATE_DIR stands for the unit's StateDirectory= (the only writable place
# besides /dev/shm); it is chowned to the unprivileged user. REPORT_FILE gets
# one line per option emulated, and per option that is not.
#
#   User=/Group=             setpriv --reuid/--regid nobody:nogroup, no groups
#   NoNewPrivileges=yes      setpriv --no-new-privs
#   CapabilityBoundingSet=   setpriv --bounding-set=-all --inh-caps=-all
#   ProtectSystem=strict     a private mount namespace (unshare -m) with every
#                            mount read-only but /dev, /proc, STATE_DIR
#   ProtectKernelTunables=,  /proc/sys and /sys (with /sys/fs/cgroup)
#   ProtectControlGroups=    read-only
#   ProtectHome=yes          empty, inaccessible /home, /root, /run/user
#   PrivateTmp=yes           fresh tmpfs on /tmp and /var/tmp
#   the syscall options      tests/deploy/unit_seccomp.py
# $OPJIT_SANDBOX_HIDE: directories (space-separated) made empty and
# inaccessible as well, e.g. the build and source trees, so that an installed
# program is shown not to fall back on them.
# The process keeps its pid through each step (exec), so the caller's $! is the
# command itself.
set -euo pipefail
UNIT=$1 STATE=$2 REPORT=$3
shift 3
[ "${1:-}" = "--" ] && shift
HERE=$(cd "$(dirname "$0")" && pwd)
: >"$REPORT"
note() { echo "$*" >>"$REPORT"; }
opt() { sed -n "s/^$1=//p" "$UNIT" | tail -1; }

if [ "$(id -u)" != 0 ] || ! command -v unshare >/dev/null || ! command -v setpriv >/dev/null; then
  note "not emulated: not root or no unshare/setpriv; the command runs unconfined"
  exec "$@"
fi

user=nobody group=nogroup
getent group nogroup >/dev/null || group=nobody
chown -R "$user:$group" "$STATE"

# The mount part runs inside the new mount namespace.
inner=$(cat <<'EOS'
set -euo pipefail
UNIT=$1 STATE=$2 REPORT=$3 HERE=$4 user=$5 group=$6
shift 6
# The report stays writable on fd 3 once everything is read-only.
exec 3>>"$REPORT"
note() { echo "$*" >&3; }
opt() { sed -n "s/^$1=//p" "$UNIT" | tail -1; }
mount --make-rprivate /
if [ "$(opt ProtectSystem)" = strict ]; then
  # Deepest first does not matter for remount; /dev (shm), /proc stay as they are.
  n=0
  while read -r mp; do
    mp=$(printf '%b' "${mp//\\/\\0}")  # mountinfo's \040 octal escapes
    case "$mp" in /dev|/dev/*|/proc|/proc/*|/sys|/sys/*) continue ;; esac
    mount -o remount,bind,ro "$mp" 2>/dev/null && n=$((n + 1))
  done < <(awk '{print $5}' /proc/self/mountinfo)
  mount --bind "$STATE" "$STATE"
  mount -o remount,bind,rw "$STATE"
  note "ProtectSystem=strict: $n mounts read-only; writable: $STATE (StateDirectory), /dev/shm"
fi
if [ "$(opt ProtectKernelTunables)" = yes ] || [ "$(opt ProtectControlGroups)" = yes ]; then
  mount --bind /proc/sys /proc/sys
  mount -o remount,bind,ro /proc/sys
  while read -r mp; do
    case "$mp" in /sys|/sys/*) mount -o remount,bind,ro "$mp" 2>/dev/null || true ;; esac
  done < <(awk '{print $5}' /proc/self/mountinfo)
  note "ProtectKernelTunables=yes, ProtectControlGroups=yes: /proc/sys, /sys, /sys/fs/cgroup read-only"
fi
if [ "$(opt ProtectHome)" = yes ]; then
  hidden=""
  for d in /home /root /run/user; do
    [ -d "$d" ] || continue
    case "$STATE/" in "$d"/*) note "ProtectHome=yes: not emulated for $d (the test's files are there)"; continue ;; esac
    mount -t tmpfs -o ro,mode=000,size=4k tmpfs "$d" && hidden="$hidden $d"
  done
  note "ProtectHome=yes: inaccessible:$hidden"
fi
if [ "$(opt PrivateTmp)" = yes ]; then
  # The test's own files (a checkout under /tmp, say) stay where they are:
  # the top directory under /tmp or /var/tmp of each is bound back into the
  # fresh tmpfs, through an fd opened before it hides them.
  keep=() tops=" " fd=10
  for p in "$STATE" "$UNIT" "$HERE" "$REPORT" "$1"; do
    for t in /tmp /var/tmp; do
      case "$p" in "$t"/*)
        top="$t/$(echo "${p#"$t"/}" | cut -d/ -f1)"
        case "$tops" in *" $top "*) ;; *)
          eval "exec $fd<\"\$top\""
          keep+=("$fd:$top") tops="$tops$top " fd=$((fd + 1)) ;;
        esac ;;
      esac
    done
  done
  mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
  [ -d /var/tmp ] && mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /var/tmp
  for k in "${keep[@]:-}"; do
    [ -n "$k" ] || continue
    top=${k#*:}
    mkdir -p "$top"
    mount --no-canonicalize --bind "/proc/self/fd/${k%%:*}" "$top"
    eval "exec ${k%%:*}<&-"
    # A new bind is writable: as read-only as ProtectSystem made it, but the state dir.
    if [ "$(opt ProtectSystem)" = strict ]; then
      mount -o remount,bind,ro "$top"
      case "$STATE/" in "$top"/*)
        mount --bind "$STATE" "$STATE"
        mount -o remount,bind,rw "$STATE" ;;
      esac
    fi
    note "PrivateTmp=yes: $top kept (the test's files)"
  done
  note "PrivateTmp=yes: fresh /tmp and /var/tmp"
fi
for d in ${OPJIT_SANDBOX_HIDE:-}; do
  [ -d "$d" ] && mount -t tmpfs -o ro,mode=000,size=4k tmpfs "$d" && note "hidden (test): $d"
done
setpriv_args=(--reuid="$user" --regid="$group" --clear-groups)
note "User=$(opt User): runs as $user:$group instead"
if [ "$(opt NoNewPrivileges)" = yes ]; then
  setpriv_args+=(--no-new-privs)
  note "NoNewPrivileges=yes: setpriv --no-new-privs"
fi
if grep -q '^CapabilityBoundingSet=$' "$UNIT"; then
  setpriv_args+=(--bounding-set=-all --inh-caps=-all)
  note "CapabilityBoundingSet=: bounding and inheritable sets empty"
fi
if command -v systemd-analyze >/dev/null && [ "$(uname -m)" = x86_64 ]; then
  OPJIT_SECCOMP_REPORT_FD=3 exec /usr/bin/python3 "$HERE/unit_seccomp.py" "$UNIT" -- \
    setpriv "${setpriv_args[@]}" -- "$@"
fi
note "syscall options: not emulated (no systemd-analyze, or not x86-64)"
exec 3>&-
exec setpriv "${setpriv_args[@]}" -- "$@"
EOS
)
exec unshare -m -- /bin/bash -c "$inner" inner "$UNIT" "$STATE" "$REPORT" "$HERE" "$user" "$group" "$@"
