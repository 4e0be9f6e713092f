#!/bin/bash
# test_deploy_install: `cmake --install` of the build the test runs from (the directory of
# $TANDEM_BIN) into a temp prefix: the binary runs from there (--version, --check-config on
# the installed systemd example, its CUDA module loads where CUDA is compiled), and the deploy files and docs are where deploy/README.md
# says (share/tandem/deploy/..., share/doc/tandem/...), the Slurm script executable.
set -u
SRC=$(cd "${TD_SOURCE_DIR:-$(dirname "$0")/../..}" && pwd)
BIN="${TANDEM_BIN:?TANDEM_BIN must point at the tandem binary}"
BUILD=$(dirname "$BIN")
[ -f "$BUILD/cmake_install.cmake" ] || { echo "skipped: $BUILD is no CMake build directory"; exit 77; }
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }
cmake --install "$BUILD" --prefix "$T/usr" >"$T/install.log" 2>&1 || { cat "$T/install.log"; echo "FAIL: cmake --install"; exit 1; }
v=$("$T/usr/bin/tandem" --version 2>&1 | head -1) || bad "the installed binary does not run: $v"
echo "installed: $v"
for f in share/tandem/deploy/README.md share/tandem/deploy/Containerfile share/tandem/deploy/k8s/render.py \
    share/tandem/deploy/k8s/base/kustomization.yaml share/tandem/deploy/k8s/overlays/cpu/kustomization.yaml \
    share/tandem/deploy/k8s/overlays/gpu/kustomization.yaml share/tandem/deploy/systemd/tandem-router.service \
    share/tandem/deploy/systemd/tandem-decode@.service share/tandem/deploy/systemd/decode.conf \
    share/tandem/deploy/slurm/tandem.sbatch share/tandem/deploy/grafana/tandem-dashboard.json \
    share/doc/tandem/deploy.md share/doc/tandem/cluster.md share/doc/tandem/README.md; do
    [ -f "$T/usr/$f" ] || bad "$f not installed"
done
[ -x "$T/usr/share/tandem/deploy/slurm/tandem.sbatch" ] || bad "tandem.sbatch installed without its execute bit"
n=$(cd "$SRC/deploy" && find . -type f ! -path '*/__pycache__/*' | wc -l)
m=$(cd "$T/usr/share/tandem/deploy" && find . -type f | wc -l)
[ "$n" = "$m" ] || bad "deploy/ has $n files, $m installed"
# a CUDA build installs the backend's module (LIBDIR/tandem/libtandem-cuda.so) where the
# installed binary looks for it: opening the backend (before the model, which is not there)
# answers from inside the module ("no usable CUDA device" here, nothing on a GPU machine)
if "$T/usr/bin/tandem" --version 2>&1 | grep -q '^backends: .*cuda'; then
    out=$("$T/usr/bin/tandem" plan profile --model "$T/none.gguf" --device cuda --out "$T/p.json" 2>&1)
    case "$out" in *libtandem-cuda.so*) bad "the installed binary does not load its CUDA module: $out" ;; esac
    echo "installed, --device cuda: $(echo "$out" | head -1)"
fi
out=$("$T/usr/bin/tandem" decode --config "$T/usr/share/tandem/deploy/systemd/decode.conf" --check-config 2>&1) ||
    bad "the installed binary refuses the installed decode.conf: $out"
[ $fail -eq 0 ] || exit 1
echo "PASS: cmake --install: binary, $m deploy files and the docs in place; the installed binary accepts the installed config"
