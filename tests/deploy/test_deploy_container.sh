#!/bin/bash
# test_deploy_container: builds deploy/Containerfile with the first container engine that
# works here (podman, docker) and runs `tandem --version` and `--check-config` of
# the image's own deploy/systemd/decode.conf in it. The build compiles tandem inside the
# image (minutes); without a working engine the test skips, saying which it tried, after
# checking that the runtime stage installs the package of every library the binary links.
set -u
SRC=$(cd "${TD_SOURCE_DIR:-$(dirname "$0")/../..}" && pwd)
BIN="${TANDEM_BIN:?TANDEM_BIN must point at the tandem binary}"
# Without an engine too: every library the binary needs directly (its NEEDED entries) must
# come from a package the image's runtime stage installs (the C runtime aside, and CUDA's,
# which the image is built without).
runtime=$(awk '/^FROM/{n++} n==2' "$SRC/deploy/Containerfile" | tr ' \\' '\n\n' | grep -E '^lib|^ca-')
missing=()
for so in $(readelf -d "$BIN" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    path=$(ldd "$BIN" | awk -v l="$so" '$1 == l {print $3}')
    [ -n "$path" ] || continue
    pkg=$(dpkg -S "$(readlink -f "$path")" 2>/dev/null | cut -d: -f1)
    # not packaged (CUDA), always there, or the sanitizer build's runtimes (never shipped)
    case $pkg in ""|libc6|libgcc-s1|libstdc++6|libasan*|libubsan*|liblsan*|libtsan*) continue ;; esac
    grep -qx "$pkg" <<<"$runtime" || missing+=("$so ($pkg)")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "FAIL: deploy/Containerfile's runtime stage lacks the packages of: ${missing[*]}"; exit 1
fi
echo "runtime stage: every library tandem links is installed ($(echo $runtime | wc -w) packages)"
engine=
why=()
for e in podman docker; do
    if ! command -v $e >/dev/null; then why+=("$e: not installed"); continue; fi
    if out=$(timeout 20 $e info 2>&1 >/dev/null); then engine=$e; break; fi
    why+=("$e: $(echo "$out" | grep -m1 -iE 'error|cannot' || echo 'info failed')")
done
[ -n "$engine" ] || { echo "skipped: no container engine works here (${why[*]})"; exit 77; }
tag="localhost/tandem-test:$$"
echo "engine: $engine"
if ! timeout 1800 $engine build -f "$SRC/deploy/Containerfile" -t "$tag" "$SRC" >/tmp/tandem-container-build.$$.log 2>&1; then
    tail -n 30 /tmp/tandem-container-build.$$.log; rm -f /tmp/tandem-container-build.$$.log
    echo "FAIL: $engine build -f deploy/Containerfile"; exit 1
fi
rm -f /tmp/tandem-container-build.$$.log
fail=0
v=$($engine run --rm "$tag" --version 2>&1) || { echo "FAIL: the image does not run tandem --version: $v"; fail=1; }
echo "image: $v"
c=$($engine run --rm "$tag" decode --config /usr/share/tandem/deploy/systemd/decode.conf --check-config 2>&1) ||
    { echo "FAIL: the image's tandem refuses its own decode.conf: $c"; fail=1; }
u=$($engine run --rm --entrypoint /usr/bin/id "$tag" -u 2>&1)
[ "$u" = 10001 ] || { echo "FAIL: the image runs as uid '$u', deploy/k8s expects 10001"; fail=1; }
$engine rmi "$tag" >/dev/null 2>&1
[ $fail -eq 0 ] || exit 1
echo "PASS: deploy/Containerfile builds with $engine; the image runs tandem as uid 10001"
