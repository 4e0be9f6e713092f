#!/bin/bash
# bench/vs_peers.sh [--batched] MODEL LEVEL THREADS: tandem's engine against llama.cpp and
# ik_llama.cpp on one GGUF file, in one run, at one CPU level (issue 32; docs/bench.md
# "Against llama.cpp and ik_llama.cpp"). LEVEL is what TANDEM_CPU_ISA forces (avx2,
# avx512vnni, avx512bf16); the peers' avx2 builds serve the avx2 rows, their native builds
# the others (bench/peers_build.sh makes both under $PEERS). Prints one line:
#   FILE LEVEL tT | tandem pp tg | tandem cpu:q8 pp tg | llama.cpp pp tg | ik pp tg
# pp512 and tg64 tokens/s (`tandem bench engine --prompt-tokens 512 --gen-tokens 64`;
# `llama-bench -p 512 -n 64 -r 2`, the better of flash attention off and on, ik with -rtr 1).
# --batched: aggregate decode tokens/s at b = 1, 8, 32, 64 instead (8-token prompts, 8 steps:
# tandem's batched_decode_tokens_per_s; `llama-batched-bench -npp 8 -ntg 8`, S_TG; llama.cpp
# the better of flash attention off and on, ik off: its flash attention asserts (S > 0) at
# these shapes).
# Run it alone on the machine (`flock` a lock other benchmarks take too): two benchmarks at
# once measure each other. TANDEM: the binary (default build-portable/tandem, a
# -DTD_NATIVE=OFF build, which picks its kernels at run time).
set -uo pipefail
batched=0
[ "${1:-}" = --batched ] && { batched=1; shift; }
[ $# -eq 3 ] || { echo "usage: bench/vs_peers.sh [--batched] MODEL LEVEL THREADS" >&2; exit 2; }
M=$1 L=$2 T=$3
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TANDEM=${TANDEM:-$ROOT/build-portable/tandem}
PEERS=${PEERS:-$HOME/.cache/tandem/peers}
PY=${PY:-/usr/bin/python3}
case $L in avx2) P=avx2 ;; *) P=native ;; esac
# absolute paths: the run goes on in a folder of its own
for v in M TANDEM PEERS; do [ -e "${!v}" ] && printf -v "$v" %s "$(realpath "${!v}")"; done
[ $batched = 1 ] && B=llama-batched-bench || B=llama-bench
# the peers write llama.log where they run: a folder of this run's, removed at the end
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK" || exit 2
for f in "$M" "$TANDEM" "$PEERS/lc-$P/bin/$B" "$PEERS/ik-$P/bin/$B"; do
  [ -e "$f" ] || { echo "vs_peers: $f is missing (bench/peers_build.sh builds the peers; TANDEM, PEERS)" >&2; exit 2; }
done
engine() { # tandem bench engine's JSON, then the figures of this mode
  TANDEM_CPU_ISA=$L "$TANDEM" bench engine --model "$M" --threads "$T" --json "$@" 2>/dev/null | "$PY" -c '
import json, sys
d = json.load(sys.stdin)
if sys.argv[1] == "1":
    b = d["batched_decode_tokens_per_s"]
    print(" ".join("%.1f" % b[k] for k in ("1", "8", "32", "64")))
else:
    print("%.1f %.1f" % (d["prefill_tokens_per_s"], d["decode_b1_tokens_per_s"]))' "$batched"
}
bench() { # llama-bench, the better of its rows
  "$@" -m "$M" -p 512 -n 64 -t "$T" -fa 0,1 -r 2 -o json 2>/dev/null | grep -v '^WARNING' | "$PY" -c '
import json, sys
d = json.load(sys.stdin)
best = lambda key: max([r["avg_ts"] for r in d if r[key] > 0] + [0])
print("%.1f %.1f" % (best("n_prompt"), best("n_gen")))'
}
batched_bench() { # llama-batched-bench, S_TG per batch (the table goes to stderr in ik's)
  "$@" -m "$M" -c 1024 -b 2048 -ub 512 -npp 8 -ntg 8 -npl 1,8,32,64 -t "$T" 2>&1 | awk -F'|' '$2 ~ /^ *8 *$/ {printf "%s ", $9}'
}
best_of() { "$PY" -c '
import sys
runs = [list(map(float, r.split())) for r in sys.argv[1:] if r.strip()]
print(" ".join("%.1f" % max(c) for c in zip(*runs)) if runs else "-")' "$@"; }
if [ $batched = 1 ]; then
  a=$(engine --prompt-tokens 64 --gen-tokens 8); b=$(engine --prompt-tokens 64 --gen-tokens 8 --device cpu:q8)
  c=$(best_of "$(batched_bench "$PEERS/lc-$P/bin/llama-batched-bench" -fa 0)" "$(batched_bench "$PEERS/lc-$P/bin/llama-batched-bench" -fa 1)")
  d=$(best_of "$(batched_bench "$PEERS/ik-$P/bin/llama-batched-bench" -fa 0 --run-time-repack)" \
    "$(batched_bench "$PEERS/ik-$P/bin/llama-batched-bench" -fa 0 --run-time-repack)")
  echo "$(basename "$M") $L t$T b=1,8,32,64 | $a | $b | $c | $d"
else
  a=$(engine --prompt-tokens 512 --gen-tokens 64); b=$(engine --prompt-tokens 512 --gen-tokens 64 --device cpu:q8)
  c=$(bench "$PEERS/lc-$P/bin/llama-bench"); d=$(bench "$PEERS/ik-$P/bin/llama-bench" -rtr 1)
  echo "$(basename "$M") $L t$T | $a | $b | $c | $d"
fi
