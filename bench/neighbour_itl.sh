#!/usr/bin/env bash
# neighbour_itl.sh: how much a busy neighbouring core slows a decode node on the same host
# (docs/goodput.md, validation H). Starts `tandem local` 1 prefill + 1 decode, one thread each,
# each node pinned to a core (0 and 1), and measures the decode node's inter-token gaps at
# batch 1 (bench serve: 6 requests of 16 + 128 tokens, one at a time) with core 0 idle, then
# with a prompt loop pinned on core 0 (`tandem plan profile --model` over and over, the same
# kernels a prefill node runs), twice each. Usage:
#   bench/neighbour_itl.sh TANDEM MODEL [VOCAB]
set -u
BIN=$1 M=$2 VOCAB=${3:-256}
T=$(mktemp -d)
setsid "$BIN" local --model "$M" --prefill 1 --decode 1 --threads 1 >"$T/out" 2>"$T/err" &
LP=$!
trap 'kill -TERM -- -$LP 2>/dev/null; wait $LP 2>/dev/null; rm -rf "$T"' EXIT
for _ in $(seq 150); do grep -q '^gateway:' "$T/out" && break; sleep 0.2; done
GW=$(sed -n 's/^gateway: //p' "$T/out")
[ -n "$GW" ] || { echo "neighbour_itl: the cluster did not start: $(tail -3 "$T/err")" >&2; exit 1; }
i=0
for kid in $(pgrep -P $LP); do
    case "$(tr '\0' ' ' </proc/$kid/cmdline | awk '{print $2}')" in
    prefill|decode) taskset -a -p -c $i "$kid" >/dev/null; i=$((i + 1)) ;;
    esac
done
serve() {
    "$BIN" bench serve --gateway "$GW" --input-len 16 --output-len 128 --num-prompts 6 --max-concurrency 1 \
        --request-rate inf --vocab-size "$VOCAB" --result-file "$1" >/dev/null 2>"$T/serve.err" ||
        { echo "neighbour_itl: bench serve failed: $(tail -2 "$T/serve.err")" >&2; exit 1; }
}
for round in 1 2; do
    serve "$T/idle$round.json"
    setsid bash -c "while :; do taskset -c 0 '$BIN' plan profile --model '$M' --threads 1 --max-tokens 512 \
        --max-batch 1 --out '$T/x.json' >/dev/null 2>&1; done" &
    NB=$!
    sleep 3
    serve "$T/busy$round.json"
    kill -TERM -- -$NB 2>/dev/null
    wait $NB 2>/dev/null
done
for f in idle1 busy1 idle2 busy2; do
    python3 -c "import json; d = json.load(open('$T/$f.json')); \
print('%-6s ITL mean %.2f  median %.2f  p90 %.2f ms' % ('$f', d['mean_itl_ms'], d['median_itl_ms'], d['p90_itl_ms']))"
done
