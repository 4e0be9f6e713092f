#!/usr/bin/env bash
# The experiment of issue 16 (docs/goodput.md): goodput of the same two cores serving one model
# disaggregated (1 prefill + 1 decode node, one core each), colocated (2 unified nodes, one
# core each; 1 unified node on both cores) and conditionally disaggregated (1 prefill + 1 decode
# node, the router placing each prompt on either: issue 37), under one router, measured by
# `tandem bench serve` sweeping the request rate of each workload mix.
#
#   bench/goodput_sweep.sh [OUT_DIR]            the whole experiment (default OUT_DIR bench/goodput-out)
#   bench/goodput_sweep.sh --probe [OUT_DIR]    unloaded TTFT / TPOT only (one request at a time),
#                                               what the objectives are scaled from
#
# `tandem local` has no per-node CPU pinning: it is started on cores CORES (taskset), then each
# node process (all of its threads: taskset -a) is pinned to its core once the cluster is up;
# the router and the load generator stay on both cores (they are shared by every configuration).
# Every configuration x mix gets a fresh cluster. Environment (defaults in brackets):
#   TANDEM [build/tandem]  MODEL [scripts/fetch-model smollm2]  CORES [0,1]  CONFIGS [disagg unified2 unified1]
#     (a unified configuration may name its prompt chunk: unified2@64 runs --prefill-chunk 64;
#     `conditional` is disagg with --prefill-policy conditional and --tpot-objective-ms the mix's
#     TPOT objective, conditional@MS another objective; conditional+ttft also gives the router
#     the mix's TTFT objective, --ttft-objective-ms: local only where the prefill node would pass it;
#     `follow` is 2 decode nodes with --prefill-policy follow (roles that follow the load: each
#     prompt prefilled by its decode node or the other one), the objective as conditional's)
#   MIXES [prefill decode]  NUM_PROMPTS [30]  SEED [1]  WARMUP [4]
#   PREFILL_MIX ["256 16 0.25"]  DECODE_MIX ["64 128 0.25"]   (input-len output-len range-ratio)
#   PREFILL_SLO ["ttft:MS tpot:MS"]  DECODE_SLO [...]  PREFILL_RATES  DECODE_RATES  (see below)
#   DETAILED [0]  1: the result files carry every request (--save-detailed), so that
#     bench/goodput_plot.py can score the same runs against other objectives (its SLO scale)
#   MAX_CONCURRENCY [unset]  N: at most N requests in flight (bench serve --max-concurrency); with
#     a rate far above capacity (PREFILL_RATES=100) a closed loop, as aiperf's --concurrency
#   AIPERF [unset]  a path to NVIDIA aiperf (e.g. a venv's bin/aiperf) and HF_TOKENIZER (a
#     Hugging Face tokenizer directory of the model; not AIPERF_*: aiperf reads those itself): aiperf profile instead of bench serve, a closed
#     loop of MAX_CONCURRENCY [8] streamed chat requests, NUM_PROMPTS of them after WARMUP, each of
#     the mix's input and output lengths exactly (range ratio ignored; ignore_eos), the served
#     token counts; its artifacts (profile_export_aiperf.json, .csv) under OUT_DIR/aiperf-CONFIG-MIX
set -euo pipefail
cd "$(dirname "$0")/.."
probe=0
if [ "${1:-}" = "--probe" ]; then probe=1; shift; fi
out=${1:-bench/goodput-out}
mkdir -p "$out"
TANDEM=${TANDEM:-build/tandem}
MODEL=${MODEL:-$(scripts/fetch-model smollm2)}
CORES=${CORES:-0,1}
c0=${CORES%%,*} c1=${CORES##*,}
CONFIGS=${CONFIGS:-disagg unified2 unified1}
MIXES=${MIXES:-prefill decode}
NUM_PROMPTS=${NUM_PROMPTS:-30}
SEED=${SEED:-1}
WARMUP=${WARMUP:-4}
PREFILL_MIX=${PREFILL_MIX:-256 16 0.25}
DECODE_MIX=${DECODE_MIX:-64 128 0.25}
# objectives and rates: see docs/goodput.md "Objectives" for how they were chosen
PREFILL_SLO=${PREFILL_SLO:-ttft:3000 tpot:50}
DECODE_SLO=${DECODE_SLO:-ttft:1000 tpot:60}
PREFILL_RATES=${PREFILL_RATES:-0.5,1,1.5,2,3}
DECODE_RATES=${DECODE_RATES:-0.5,1,2,3,4}

log=$out/sweep.log
echo "# $(date -u +%FT%TZ) $(uname -n) nproc=$(nproc) $(uptime)" >>"$log"

lpid=""
stop_cluster() {
  if [ -n "$lpid" ]; then
    kill -TERM "$lpid" 2>/dev/null || true
    wait "$lpid" 2>/dev/null || true
    lpid=""
  fi
}
trap stop_cluster EXIT

# start_cluster CONFIG: sets $url (the OpenAI base URL) and pins the nodes
start_cluster() {
  local cfg=$1 tpot_ms=$2 ttft_ms=$3 args
  case "${cfg%@*}" in
    disagg) args=(--prefill 1 --decode 1 --threads 1) ;;
    conditional) args=(--prefill 1 --decode 1 --threads 1 --prefill-policy conditional) ;;
    conditional+ttft) args=(--prefill 1 --decode 1 --threads 1 --prefill-policy conditional --ttft-objective-ms "$ttft_ms") ;;
    follow) args=(--prefill 0 --decode 2 --threads 1 --prefill-policy follow) ;;
    unified2) args=(--unified 2 --threads 1) ;;
    unified1) args=(--unified 1 --threads 2) ;;
    *) echo "goodput_sweep: unknown configuration $cfg" >&2; exit 2 ;;
  esac
  # CONFIG@N: unified nodes feed prompts in chunks of N tokens (--prefill-chunk; default 256);
  # conditional@MS: the router's TPOT objective (else the mix's)
  case "$cfg" in
    conditional*@* | follow@*) args+=(--tpot-objective-ms "${cfg#*@}") ;;
    conditional* | follow) args+=(--tpot-objective-ms "$tpot_ms") ;;
    *@*) args+=(--prefill-chunk "${cfg#*@}") ;;
  esac
  local fifo=$out/.local.$cfg.out
  : >"$fifo" # exists before the background start opens it
  taskset -c "$CORES" "$TANDEM" local --model "$MODEL" "${args[@]}" >"$fifo" 2>"$out/local.$cfg.err" &
  lpid=$!
  url=""
  for _ in $(seq 1 600); do
    url=$(sed -n 's/^openai: //p' "$fifo" | head -1)
    [ -n "$url" ] && break
    kill -0 "$lpid" 2>/dev/null || { echo "goodput_sweep: tandem local died" >&2; cat "$out/local.$cfg.err" >&2; exit 1; }
    sleep 0.1
  done
  [ -n "$url" ] || { echo "goodput_sweep: no openai: line from tandem local" >&2; exit 1; }
  case "$url" in */v1) ;; *) url=${url%/}/v1 ;; esac
  # pin each node process, every thread, to its core(s); the router (the first child) floats
  local kid role pins=""
  for kid in $(pgrep -P "$lpid"); do
    role=$(tr '\0' ' ' <"/proc/$kid/cmdline" | awk '{print $2, $8}')
    case "$role" in
      "prefill prefill0"|"unified unified0"|"decode decode1") core=$c0 ;;
      "decode decode0"|"unified unified1") core=$c1 ;;
      *) continue ;;
    esac
    [ "${cfg%@*}" = unified1 ] && core=$CORES
    taskset -a -p -c "$core" "$kid" >/dev/null
    pins="$pins ${role#* }->cpu$core"
  done
  echo "$cfg: $url pinned:$pins" | tee -a "$log"
}

mix_args() { # mix -> input-len output-len range-ratio
  case "$1" in
    prefill) echo "$PREFILL_MIX" ;;
    decode) echo "$DECODE_MIX" ;;
    *) echo "goodput_sweep: unknown mix $1" >&2; exit 2 ;;
  esac
}

for cfg in $CONFIGS; do
  for mix in $MIXES; do
    read -r il ol rr <<<"$(mix_args "$mix")"
    if [ "$mix" = prefill ]; then slo=$PREFILL_SLO rates=$PREFILL_RATES; else slo=$DECODE_SLO rates=$DECODE_RATES; fi
    tpot_ms=$(sed -n 's/.*tpot:\([0-9.]*\).*/\1/p' <<<"$slo")
    ttft_ms=$(sed -n 's/.*ttft:\([0-9.]*\).*/\1/p' <<<"$slo")
    start_cluster "$cfg" "${tpot_ms%.*}" "${ttft_ms%.*}"
    common=(--openai "$url" --dataset random --input-len "$il" --output-len "$ol" --range-ratio "$rr"
            --ignore-eos --vocab-size 49152 --seed "$SEED")
    if [ "$probe" = 1 ]; then
      # unloaded: one request at a time
      echo "load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$log"
      "$TANDEM" bench serve "${common[@]}" --num-prompts 8 --warmup-prompts 2 --max-concurrency 1 \
        --result-file "$out/probe-$cfg-$mix.json" | grep -E "TTFT|TPOT|throughput" | tee -a "$log"
    else
      echo "$cfg/$mix: $il in / $ol out (r $rr), objectives '$slo', rates $rates, $NUM_PROMPTS prompts; load before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$log"
      t0=$(date +%s)
      detailed=()
      [ "${DETAILED:-0}" = 1 ] && detailed=(--save-detailed)
      [ -n "${MAX_CONCURRENCY:-}" ] && detailed+=(--max-concurrency "$MAX_CONCURRENCY")
      if [ -n "${AIPERF:-}" ]; then
        model=$(curl -s "$url/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
        "$AIPERF" profile --model "$model" --url "${url%/v1}" --endpoint-type chat --streaming --ui none \
          --concurrency "${MAX_CONCURRENCY:-8}" --request-count "$NUM_PROMPTS" --warmup-request-count "$WARMUP" \
          --synthetic-input-tokens-mean "$il" --synthetic-input-tokens-stddev 0 --output-tokens-mean "$ol" \
          --output-tokens-stddev 0 --extra-inputs ignore_eos:true --use-server-token-count \
          --tokenizer "$HF_TOKENIZER" --random-seed "$SEED" --artifact-dir "$out/aiperf-$cfg-$mix" 2>&1 |
          tail -40 | tee -a "$log"
        # where the prompts were prefilled (the router's placement counts)
        murl=$(sed -n 's/^metrics: //p' "$out/.local.$cfg.out" | head -1)
        curl -s "$murl" | grep '^tandem_router_prefill_placement_total' | sed "s/^/$cfg: /" | tee -a "$log" || true
        echo "$cfg/$mix: $(( $(date +%s) - t0 )) s; load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$log"
        stop_cluster
        continue
      fi
      "$TANDEM" bench serve "${common[@]}" --num-prompts "$NUM_PROMPTS" --warmup-prompts "$WARMUP" \
        --goodput "$slo" --sweep "$rates" --result-file "$out/$cfg-$mix.json" "${detailed[@]}" 2>&1 |
        sed -n '/^rate /,$p' | tee -a "$log"
      echo "$cfg/$mix: $(( $(date +%s) - t0 )) s; load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$log"
      cut -d' ' -f1-3 /proc/loadavg >"$out/$cfg-$mix.load"
      # where the sweep's prompts were prefilled, all its rates together (the router's placement counts)
      murl=$(sed -n 's/^metrics: //p' "$out/.local.$cfg.out" | head -1)
      curl -s "$murl" | grep '^tandem_router_prefill_placement_total' | sed "s/^/$cfg: /" | tee -a "$log" || true
      # and each node's own figures (steps, step time, prompt tokens, peer prefills, the step-cost
      # fit's token cost): why a configuration holds or falls over (docs/goodput.md)
      sed -n 's/^\(decode\|prefill\|unified\) \([a-z0-9]*\): control .* metrics \(http[^ ]*\).*/\2 \3/p' \
        "$out/local.$cfg.err" | while read -r node nurl; do
        curl -s "$nurl" | grep -v '^#' | sed "s/^/$node /"
      done >"$out/nodes-$cfg-$mix.prom" || true
    fi
    stop_cluster
  done
done
