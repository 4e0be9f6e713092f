#!/bin/bash
# test_deploy_k8s: the Kubernetes manifests of deploy/k8s as shipped. Renders the base and
# every overlay (deploy/k8s/render.py: kustomize is no Debian package), validates every
# object against the Kubernetes schema with kubernetes-validate (PyPI, strict: an unknown
# field fails), and runs the tandem binary on every container's flags and config file with
# --check-config, so the files cannot drift from the binary (tests/deploy/k8s_check.py).
# kubernetes-validate lives in a venv of its own ($TANDEM_CACHE or ~/.cache/tandem,
# venv-deploy), made here once; offline, the test says so and skips.
set -u
SRC="${TD_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}"
BIN="${TANDEM_BIN:?TANDEM_BIN must point at the tandem binary}"
K8S_VERSION=1.30.0 # the oldest release these files target (preStop sleep, gRPC probes)
VENV="${TANDEM_CACHE:-$HOME/.cache/tandem}/venv-deploy"
PY="$VENV/bin/python3"
if ! "$PY" -c 'import kubernetes_validate, yaml' 2>/dev/null; then
    rm -rf "$VENV"
    /usr/bin/python3 -m venv --system-site-packages "$VENV" >/dev/null 2>&1 ||
        { echo "skipped: python3 -m venv failed (install python3-venv: scripts/install-deps)"; exit 77; }
    if ! timeout 120 "$VENV/bin/pip" install -q --disable-pip-version-check 'kubernetes-validate==1.37.0' \
        >"$VENV.log" 2>&1; then
        echo "skipped: kubernetes-validate could not be installed from PyPI (offline?): $(tail -1 "$VENV.log")"
        rm -rf "$VENV"
        exit 77
    fi
fi
"$PY" -c 'import yaml' 2>/dev/null || { echo "skipped: PyYAML missing (python3-yaml: scripts/install-deps)"; exit 77; }
dirs=("$SRC/deploy/k8s/base")
for d in "$SRC"/deploy/k8s/overlays/*/; do dirs+=("${d%/}"); done
"$PY" "$SRC/tests/deploy/k8s_check.py" "$BIN" "$K8S_VERSION" "${dirs[@]}" || { echo "FAIL: deploy/k8s"; exit 1; }
# the renderer refuses what it does not implement rather than ignore it
t=$(mktemp -d); trap 'rm -rf "$t"' EXIT
printf 'resources: []\nconfigMapGenerator: []\n' >"$t/kustomization.yaml"
if "$PY" "$SRC/deploy/k8s/render.py" "$t" >/dev/null 2>"$t/err"; then
    echo "FAIL: render.py accepted a kustomization key it does not implement"; exit 1
fi
grep -q "configMapGenerator" "$t/err" || { echo "FAIL: render.py's refusal does not name the key: $(cat "$t/err")"; exit 1; }
echo "PASS: deploy/k8s: ${#dirs[@]} kustomizations (base and overlays) rendered, valid for Kubernetes $K8S_VERSION, every tandem flag and config key accepted by the binary"
