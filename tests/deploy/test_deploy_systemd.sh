#!/bin/bash
# test_deploy_systemd: the systemd units of deploy/systemd as shipped. `systemd-analyze
# verify` must accept every unit without a word (an unknown key or a bad value is only a
# warning there, so any output fails), with the build's binary in place of
# /usr/local/bin/tandem; every example config must pass `tandem ROLE --config FILE
# --check-config` (the units' ExecStartPre); a node unit's TimeoutStopSec must exceed its
# example's drain-timeout-ms; tandem.env must be KEY=VALUE lines. Prints each unit's
# `systemd-analyze security` exposure. Skips visibly without systemd-analyze.
set -u
SRC="${TD_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}"
BIN="${TANDEM_BIN:?TANDEM_BIN must point at the tandem binary}"
D="$SRC/deploy/systemd"
command -v systemd-analyze >/dev/null || { echo "skipped: systemd-analyze not found (Debian package systemd)"; exit 77; }
fail=0
bad() { echo "FAIL: $*"; fail=1; }
t=$(mktemp -d); trap 'rm -rf "$t"' EXIT
for u in "$D"/*.service; do
    n=$(basename "$u")
    grep -q '/usr/local/bin/tandem' "$u" || bad "$n does not run /usr/local/bin/tandem (where cmake --install puts it)"
    sed "s|/usr/local/bin/tandem|$BIN|g" "$u" >"$t/$n"
    out=$(cd "$t" && timeout 60 systemd-analyze verify --man=no "./$n" 2>&1); rc=$?
    if [ $rc -ne 0 ] || [ -n "$out" ]; then bad "systemd-analyze verify $n (rc $rc): $out"; else echo "$n: verified"; fi
    sec=$(cd "$t" && timeout 60 systemd-analyze security --offline=yes "./$n" 2>/dev/null | grep 'Overall exposure')
    [ -n "$sec" ] && echo "  ${sec#* }"
done
for role in router prefill decode; do
    out=$("$BIN" $role --config "$D/$role.conf" --check-config 2>&1) || bad "$role.conf: $out"
    echo "$role.conf: $out"
done
for role in prefill decode; do
    stop=$(sed -n 's/^TimeoutStopSec=//p' "$D/tandem-$role@.service")
    drain=$(sed -n 's/^drain-timeout-ms *= *\([0-9]*\).*/\1/p' "$D/$role.conf")
    [ -n "$stop" ] && [ -n "$drain" ] && [ $((stop * 1000)) -gt "$drain" ] ||
        bad "tandem-$role@.service: TimeoutStopSec ${stop:-?} s does not exceed $role.conf's drain-timeout-ms ${drain:-?}"
done
grep -vE '^\s*(#|$)' "$D/tandem.env" | grep -vE '^[A-Z_][A-Z0-9_]*=' && bad "tandem.env has lines that are not KEY=VALUE"
[ $fail -eq 0 ] || exit 1
echo "PASS: deploy/systemd units verified, example configs accepted by the binary, stop timeouts above the drain timeouts"
