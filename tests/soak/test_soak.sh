#!/bin/bash
# test_soak: a short chaos soak (tests/soak/soak.py, issue 17) in scripts/test: a router, 2
# prefill and 2 decode nodes on a synthetic GGUF model (its tokenizer gives the router the
# model's EOS ids), 4 greedy streams back to back for TD_SOAK_SECONDS (default 20; 12 in the
# sanitizer build) while nodes are killed, stopped, restarted and added and the router is
# restarted once; every invariant of soak.py must hold. A long soak: soak.py --seconds 1800
# (docs/reliability.md). Skips without Debian's python3-grpcio.
set -u
SRC=${TD_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BIN=${TANDEM_BIN:?TANDEM_BIN must name the tandem binary}
PY=/usr/bin/python3
"$PY" -c 'import grpc' 2>/dev/null || { echo "SKIP: $PY lacks grpc (python3-grpcio)"; exit 77; }
secs=${TD_SOAK_SECONDS:-20} slack=32
# the sanitizer build: ASan's quarantine holds up to 256 MB of freed memory per process, which
# the RSS bound must allow
[ "${TD_SANITIZE:-OFF}" = ON ] && secs=${TD_SOAK_SECONDS:-12} slack=320
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$BIN" model synth --format gguf --seed 7 --out "$tmp/m.gguf" >/dev/null || { echo "FAIL: model synth"; exit 1; }
export UCX_TCP_CM_REUSEADDR=y UCX_WARN_UNUSED_ENV_VARS=n
"$PY" "$SRC/tests/soak/soak.py" --bin "$BIN" --model "$tmp/m.gguf" --seconds "$secs" --seed "${TD_SOAK_SEED:-1}" \
    --rss-slack-mb "$slack"
