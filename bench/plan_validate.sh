#!/usr/bin/env bash
# plan_validate.sh: predicted (tandem plan) against measured (tandem bench serve on tandem
# local) for one model, one P:D split, one workload, several rates (docs/goodput.md
# "Capacity planning"). Usage:
#   bench/plan_validate.sh TANDEM MODEL PROFILE P D IN:OUT:RANGE TTFT_MS TPOT_MS N_PROMPTS RATE...
# Prints one line per rate: rate, then measured and predicted goodput, TTFT p90, TPOT p90, and
# the 1-minute load average (a shared machine: the neighbours' load is in every figure).
# PROFILE `auto`: `tandem plan profile --threads 1` of MODEL again just before each rate, so
# that the profile and the run see the same neighbours. PROFILE `calib:FILE`: FILE for the
# first rate, then for each later rate FILE calibrated (`tandem plan calibrate`) by the step
# histograms the nodes kept over the rates before it: predicted from the past, compared with
# the next run. The cluster is started once with
# --threads 1 per node and stopped at the end. P `u` and D N: N unified nodes (the colocated
# configuration; `plan --unified N`) instead of P prefill and D decode nodes.
# TRACE=1: each rate's N requests are one trace (Poisson arrivals, lengths as --dataset
# random draws them) that bench serve replays and plan simulates: the prediction is for the
# very arrivals measured. Else plan simulates 4000 requests of the same distribution.
# PIN=CORES (e.g. PIN=0,1): each node process, all its threads, pinned to one of CORES in turn
# once the cluster is up (router and load generator float), as bench/goodput_sweep.sh does.
# KEEP=DIR: each rate's bench serve result (with --save-detailed: per-request TTFT, TPOT,
# inter-token gaps), the plan's JSON and the trace are kept in DIR as RATE.{serve,plan}.json;
# bench/plan_keep_stats.py reads them (the machine's speed against the profile's, and the
# measured p90s' sampling intervals).
# POLICY=conditional (P:D only): the router's --prefill-policy conditional with
# --tpot-objective-ms TPOT_OBJ (default TPOT_MS), and plan's the same (issue 37).
set -u
BIN=$1 MODEL=$2 PROF=$3 P=$4 D=$5 WL=$6 TTFT=$7 TPOT=$8 N=$9
shift 9
IFS=: read -r IN OUT RR <<<"$WL"
VOCAB=${VOCAB:-256}
T=$(mktemp -d)
if [ "$P" = u ]; then
    NODES=(--unified "$D") SPLIT=(--unified "$D")
else
    NODES=(--prefill "$P" --decode "$D") SPLIT=(--split "$P:$D")
fi
if [ -n "${POLICY:-}" ]; then
    NODES+=(--prefill-policy "$POLICY" --tpot-objective-ms "${TPOT_OBJ:-$TPOT}")
    SPLIT+=(--prefill-policy "$POLICY" --tpot-objective-ms "${TPOT_OBJ:-$TPOT}")
fi
setsid "$BIN" local --model "$MODEL" "${NODES[@]}" --threads 1 >"$T/local.out" 2>"$T/local.err" &
LP=$!
trap 'kill -TERM -- -$LP 2>/dev/null; wait $LP 2>/dev/null; rm -rf "$T"' EXIT
for _ in $(seq 100); do grep -q '^gateway:' "$T/local.out" && break; sleep 0.2; done
if [ -n "${PIN:-}" ]; then
    IFS=, read -r -a CORES <<<"$PIN"
    i=0
    for kid in $(pgrep -P "$LP"); do
        case "$(tr '\0' ' ' <"/proc/$kid/cmdline" | awk '{print $2}')" in
            prefill|decode|unified) taskset -a -p -c "${CORES[$((i % ${#CORES[@]}))]}" "$kid" >/dev/null; i=$((i + 1)) ;;
        esac
    done
fi
GW=$(sed -n 's/^gateway: //p' "$T/local.out")
PM=$(sed -n 's/^prefill [^ ]*: control [^ ]* metrics //p' "$T/local.err" | head -1)
DM=$(sed -n 's/^decode [^ ]*: control [^ ]* metrics //p' "$T/local.err" | head -1)
[ -n "$GW" ] || { echo "tandem local did not start: $(tail -3 "$T/local.err")" >&2; exit 1; }
printf '%-6s | %-10s %-10s | %-11s %-11s | %-11s %-11s | %s\n' rate good_meas good_pred ttft90_meas ttft90_pred \
    tpot90_meas tpot90_pred load
SEED=0
for R in "$@"; do
    SEED=$((SEED + 1)) # new prompts each rate: the prefill node's prefix cache would serve repeated ones
    PF=$PROF
    if [ "${PROF#calib:}" != "$PROF" ]; then
        PF=${PROF#calib:}
        if [ "$SEED" -gt 1 ]; then
            "$BIN" plan calibrate --profile "$PF" --prefill-metrics "$PM" --decode-metrics "$DM" \
                --context $((IN + OUT / 2)) --out "$T/cal.json" >"$T/cal.out" 2>&1 || { cat "$T/cal.out" >&2; exit 1; }
            PF=$T/cal.json
        fi
    elif [ "$PROF" = auto ]; then
        PF=$T/prof.json
        "$BIN" plan profile --model "$MODEL" --threads 1 --out "$PF" >/dev/null 2>&1 || { echo "profile failed" >&2; exit 1; }
    fi
    if [ -n "${TRACE:-}" ]; then
        # one trace for both: N Poisson arrivals at R and lengths drawn as --dataset random
        # draws them, replayed by bench serve and simulated by plan (the same arrivals, not a
        # 4000-request stationary run against an N-request sample)
        python3 - "$T/trace.csv" "$N" "$R" "$IN" "$OUT" "$RR" "$SEED" <<'PY'
import random, sys
path, n, rate, i, o, rr, seed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])
g = random.Random(seed)
t = 0.0
with open(path, "w") as f:
    for _ in range(n):
        t += g.expovariate(rate)
        f.write(f"{t:.6f},{g.randint(max(1, int(i * (1 - rr))), int(i * (1 + rr)))},"
                f"{g.randint(max(1, int(o * (1 - rr))), int(o * (1 + rr)))}\n")
PY
        DATA=(--dataset trace --dataset-path "$T/trace.csv") WL=(--workload "trace:$T/trace.csv")
    else
        DATA=(--request-rate "$R" --input-len "$IN" --output-len "$OUT" --range-ratio "$RR")
        WL=(--workload "random:$IN:$OUT:$RR" --rate "$R" --requests 4000)
    fi
    "$BIN" bench serve --gateway "$GW" --num-prompts "$N" "${DATA[@]}" \
        --vocab-size "$VOCAB" --seed $SEED --goodput "ttft:$TTFT tpot:$TPOT" --result-file "$T/m.json" \
        ${KEEP:+--save-detailed} \
        >/dev/null 2>"$T/bs.err" || { echo "bench serve failed at rate $R: $(tail -2 "$T/bs.err")" >&2; exit 1; }
    LOAD=$(cut -d' ' -f1 /proc/loadavg)
    "$BIN" plan --profile "$PF" "${WL[@]}" --ttft "$TTFT" --tpot "$TPOT" \
        "${SPLIT[@]}" --seed $SEED --json >"$T/p.json" || exit 1
    if [ -n "${KEEP:-}" ]; then
        mkdir -p "$KEEP" && cp "$T/m.json" "$KEEP/$R.serve.json" && cp "$T/p.json" "$KEEP/$R.plan.json"
        [ -f "$T/trace.csv" ] && cp "$T/trace.csv" "$KEEP/$R.trace.csv"
    fi
    python3 - "$T/m.json" "$T/p.json" "$R" "$LOAD" <<'PY'
import json, sys
m, p, r = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))["simulated"], sys.argv[3]
print(f"{r:<6} | {m['request_goodput']:<10.3f} {p['goodput']:<10.3f} | {m['p90_ttft_ms']:<11.1f} "
      f"{p['ttft_p90_ms']:<11.1f} | {m['p90_tpot_ms']:<11.2f} {p['tpot_p90_ms']:<11.2f} | {sys.argv[4]}")
PY
done
