#!/bin/bash
# bench/vs_peers.sh [--batched] MODEL LEVEL THREADS: tandem's engine against llama.cpp and
# ik_llama.cpp on one GGUF file, in one run, at one CPU level (issue 32; docs/bench.md
# "Against llama.cpp and ik_llama.cpp"). LEVEL is what TANDEM_CPU_ISA forces (avx2,
# avx512vnni, avx512bf16, amx); the peers' avx2 builds serve the avx2 rows, their native builds
# the others (bench/peers_build.sh makes both under $PEERS). Prints one line:
#   FILE LEVEL tT | tandem pp tg | tandem cpu:q8 pp tg | llama.cpp pp tg | ik pp tg
# pp512 and tg64 tokens/s (`tandem bench engine --prompt-tokens 512 --gen-tokens 64`;
# `llama-bench -p 512 -n 64 -r 2`, the better of flash attention off and on, ik with -rtr 1).
# REPS=N (default 1): the four runs N times in turn, a line each, then one line of the medians
# and the cpu:q8 ratios to llama.cpp and to ik as min/median/max over the repetitions (this
# VM's memory bandwidth and clock move by 5-10% from minute to minute: a row near a goal is
# read from the spread, not one draw).
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
REPS=${REPS:-1}
[[ $REPS =~ ^[1-9][0-9]*$ ]] || { echo "vs_peers: REPS must be a positive count, not '$REPS'" >&2; exit 2; }
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
  lines=()
  for ((r = 0; r < REPS; r++)); do
    a=$(engine --prompt-tokens 512 --gen-tokens 64); b=$(engine --prompt-tokens 512 --gen-tokens 64 --device cpu:q8)
    c=$(bench "$PEERS/lc-$P/bin/llama-bench"); d=$(bench "$PEERS/ik-$P/bin/llama-bench" -rtr 1)
    lines+=("$a | $b | $c | $d")
    echo "$(basename "$M") $L t$T | $a | $b | $c | $d"
  done
  if [ "$REPS" -gt 1 ]; then "$PY" -c '
import statistics, sys
reps = []
for line in sys.argv[2:]:
    try:
        reps.append([list(map(float, part.split())) for part in line.split("|")])
    except ValueError: # a run that printed no figures
        print("vs_peers: a repetition gave no figures: %s" % line, file=sys.stderr)
reps = [r for r in reps if len(r) == 4 and all(len(x) == 2 for x in r)]
if not reps:
    sys.exit("vs_peers: no repetition gave figures")
med = lambda xs: statistics.median(xs)
cols = [[med(r[i][j] for r in reps) for j in (0, 1)] for i in range(4)]
def ratios(i, j): # cpu:q8 over peer i, figure j, every repetition
    xs = sorted(r[1][j] / r[i][j] for r in reps if r[i][j] > 0)
    return "%.2f/%.2f/%.2f" % (xs[0], med(xs), xs[-1]) if xs else "-"
print("%s median of %d | %s | pp cpu:q8/llama.cpp %s /ik %s | tg cpu:q8/llama.cpp %s /ik %s" % (
    sys.argv[1], len(reps), " | ".join("%.1f %.1f" % tuple(c) for c in cols),
    ratios(2, 0), ratios(3, 0), ratios(2, 1), ratios(3, 1)))' "$(basename "$M") $L t$T" "${lines[@]}"
  fi
fi
