#!/bin/bash
# The package's postrm (deploy/debian/postrm) on a temp root (DPKG_ROOT, as
# `dpkg --root` runs it): purge keeps the registry and says where it is and
# how to remove it; OPJIT_PURGE_STATE=1 removes the state; remove touches
# nothing. Milliseconds; no build needed.
set -euo pipefail
SRC=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
POSTRM="$SRC/deploy/debian/postrm"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

populate() {
  rm -rf "$WORK/root"
  mkdir -p "$WORK/root/var/lib/opjit/cache/pch" "$WORK/root/etc/opjit"
  echo db >"$WORK/root/var/lib/opjit/registry.db"
  echo wal >"$WORK/root/var/lib/opjit/registry.db-wal"
  echo obj >"$WORK/root/var/lib/opjit/cache/pch/x.pch"
  : >"$WORK/root/var/lib/opjit/endpoints"
  : >"$WORK/root/var/lib/opjit/opjitd.lock"
}
S="$WORK/root/var/lib/opjit"

populate
env -u OPJIT_PURGE_STATE DPKG_ROOT="$WORK/root" sh "$POSTRM" remove 2>"$WORK/err"
[ -f "$S/registry.db" ] && [ -d "$S/cache" ] || fail "remove touched the state"

populate
env -u OPJIT_PURGE_STATE DPKG_ROOT="$WORK/root" sh "$POSTRM" purge 2>"$WORK/err"
[ "$(cat "$S/registry.db")" = db ] && [ -f "$S/registry.db-wal" ] || fail "purge lost the registry"
[ ! -e "$S/cache" ] && [ ! -e "$S/endpoints" ] && [ ! -e "$S/opjitd.lock" ] ||
  fail "purge left the cache or runtime files: $(ls -A "$S")"
grep -qF "kept the registry and state in $S" "$WORK/err" || fail "purge did not say: $(cat "$WORK/err")"
grep -qF "sudo rm -rf $S" "$WORK/err" && grep -qF OPJIT_PURGE_STATE=1 "$WORK/err" ||
  fail "purge did not say how to remove it: $(cat "$WORK/err")"
[ ! -e "$WORK/root/etc/opjit" ] || fail "/etc/opjit left (empty)"
echo "purge: $(tr '\n' ' ' <"$WORK/err")"

populate
OPJIT_PURGE_STATE=1 DPKG_ROOT="$WORK/root" sh "$POSTRM" purge 2>"$WORK/err"
[ ! -e "$S" ] || fail "OPJIT_PURGE_STATE=1 purge left $S"
[ ! -s "$WORK/err" ] || fail "OPJIT_PURGE_STATE=1 purge said: $(cat "$WORK/err")"

# Nothing but the cache: purge leaves nothing and says nothing.
populate
rm "$S/registry.db" "$S/registry.db-wal"
env -u OPJIT_PURGE_STATE DPKG_ROOT="$WORK/root" sh "$POSTRM" purge 2>"$WORK/err"
[ ! -e "$S" ] && [ ! -s "$WORK/err" ] || fail "purge of a cache-only state: $(ls -A "$S" 2>&1; cat "$WORK/err")"
echo "postrm_test: ok"
