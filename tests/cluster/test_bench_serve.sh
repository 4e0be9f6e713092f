#!/usr/bin/env bash
# test_bench_serve: `tandem bench serve` (issue 16) against `tandem local` on stories260K,
# briefly, through both front doors:
# - OpenAI API (streamed /v1/completions of prompt ids; the router gets Llama 2's tokenizer
#   only so that it can answer in text: stories260K's own is not shipped), driven by a
#   `vllm bench serve` command line (--backend --base-url --endpoint --dataset-name
#   --random-*-len --goodput ttft:MS tpot:MS --percentile-metrics --metric-percentiles
#   --save-result --result-dir --result-filename): 40 prompts at rate 20; every summary line
#   vLLM prints and every JSON key documented in docs/bench.md is there, per-request records
#   with --save-detailed, and the figures agree with the router's own /metrics over the same
#   run (requests ok = Successful requests, relayed tokens = Total generated tokens, no
#   failures); --percentile-metrics narrows the summary, the progress line goes to stderr;
# - --backend openai-chat posts /v1/chat/completions (text messages from --tokenizer; the
#   router, with no chat template for stories260K, refuses them by name);
# - gRPC gateway with a warm-up: the warm-up is left out of the figures, not of the
#   router's counters; a --sweep of two rates names the best rate;
# - a trace file replays its rows; a target where nothing listens, and one that never
#   answers (--request-timeout-s): every request failed, exit 1;
# - 2000 requests against no-op nodes behind a real router (`bench router --http --hold`);
# - bad flags: one line naming the flag, exit 2.
# No timing is asserted (a shared machine).
source "$(dirname "$0")/cluster_lib.sh"
TOK="${TANDEM_TEST_MODELS:-$CL_SRC/../shared/models}/llama2-tokenizer/tokenizer.bin"
[ -f "$TOK" ] || { echo "SKIP: $TOK absent"; exit 77; }
cl_init
cl_local 1 1 --threads 1 --tokenizer "$TOK"
OA=$(sed -n 's/^openai: //p' "$CL_T/local.out")
[ -n "$OA" ] || { cl_fail "no 'openai:' line in tandem local's output"; cl_dump; cl_end; }
metric() { cl_metric router "$@" 2>/dev/null || echo 0; }
N=40
[ "${TD_SANITIZE:-OFF}" = ON ] && N=20

# ---- OpenAI API: summary lines, JSON keys, agreement with the router's counters ----
ok0=$(metric tandem_router_requests_total outcome=ok)
tok0=$(metric tandem_router_relayed_tokens_total)
# a vLLM command line (--vocab-size: stories260K's 512 ids; vLLM draws from its tokenizer)
if ! timeout 60 "$CL_BIN" bench serve --backend openai --base-url "${OA%/v1}" --endpoint /v1/completions \
        --model default --dataset-name random --num-prompts $N --request-rate 20 --random-input-len 24 \
        --random-output-len 12 --random-range-ratio 0.5 --vocab-size 512 --seed 3 --goodput ttft:2000 tpot:500 \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir "$CL_T" \
        --result-filename r.json --save-detailed >"$CL_T/sum.txt" 2>"$CL_T/bs.err"; then
    cl_fail "bench serve --base-url exited non-zero: $(tail -3 "$CL_T/bs.err")"
fi
ok1=$(metric tandem_router_requests_total outcome=ok)
tok1=$(metric tandem_router_relayed_tokens_total)
for line in "Successful requests:" "Failed requests:" "Request rate configured (RPS):" "Benchmark duration (s):" \
        "Total input tokens:" "Total generated tokens:" "Request throughput (req/s):" "Request goodput (req/s):" \
        "SLO attainment (%):" "Output token throughput (tok/s):" "Total Token throughput (tok/s):"; do
    grep -qF "$line" "$CL_T/sum.txt" || cl_fail "summary line '$line' missing"
done
for m in TTFT TPOT ITL E2EL; do
    for w in Mean Std Median P50 P90 P99; do
        grep -qE "^$w $m \(ms\): +[0-9.]+ *$" "$CL_T/sum.txt" || cl_fail "summary line '$w $m (ms):' missing or not a number"
    done
done
"$CL_PY" - "$CL_T/r.json" "$N" "$((ok1 - ok0))" "$((tok1 - tok0))" "$CL_T/sum.txt" <<'EOF' || cl_fail "the JSON result (above)"
import json, sys
d = json.load(open(sys.argv[1]))
n, ok, tok = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
keys = ["bench", "backend", "target", "dataset", "num_prompts", "warmup_prompts", "burstiness", "max_concurrency",
        "seed", "goodput_config", "request_rate", "duration", "completed", "failed", "total_input_tokens",
        "total_output_tokens", "request_throughput", "request_goodput", "slo_attainment", "output_throughput",
        "total_token_throughput", "max_concurrency_seen", "bench_cpu_s", "bench_cpu_us_per_request", "first_error",
        "requests", "model_id", "date"]
keys += [f"{w}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for w in ("mean", "std", "median", "p50", "p90", "p99")]
missing = [k for k in keys if k not in d]
assert not missing, missing
assert d["completed"] == n and d["failed"] == 0, (d["completed"], d["failed"], d["first_error"])
assert d["completed"] == ok, f"Successful requests {d['completed']} != router's ok requests {ok}"
assert d["total_output_tokens"] == tok, f"Total generated tokens {d['total_output_tokens']} != router's relayed {tok}"
assert d["goodput_config"] == {"ttft": 2000, "tpot": 500}, d["goodput_config"]
assert len(d["requests"]) == n and all(r["ok"] for r in d["requests"])
assert sum(r["output_tokens"] for r in d["requests"]) == tok
# ignore_eos (on by default for --dataset random): every request generates what it asked
assert d["ignore_eos"] is True, d["ignore_eos"]
want = sum(r["requested_output_tokens"] for r in d["requests"])
assert d["total_output_tokens"] == want, f"Total generated tokens {d['total_output_tokens']} != requested {want}"
assert sum(r["input_tokens"] for r in d["requests"]) == d["total_input_tokens"]
assert all(12 <= r["input_tokens"] <= 36 for r in d["requests"]), "range ratio 0.5 around 24"
for k in ("mean_ttft_ms", "mean_e2el_ms", "request_throughput", "output_throughput"):
    assert d[k] > 0, (k, d[k])
assert d["mean_ttft_ms"] <= d["mean_e2el_ms"]
assert abs(d["request_goodput"] - d["slo_attainment"] * n / d["duration"]) < 0.01 * n / d["duration"] + 0.01
summary = open(sys.argv[5]).read()
assert f"Successful requests:                     {n} " in summary
assert f"Total generated tokens:                  {tok} " in summary
print(f"openai: {n} ok (router {ok}), {tok} tokens (router relayed {tok}), p99 TTFT {d['p99_ttft_ms']} ms")
EOF
grep -q "bench serve: result in $CL_T/r.json" "$CL_T/bs.err" || cl_fail "no 'result in' line: $(tail -3 "$CL_T/bs.err")"

# --percentile-metrics / --metric-percentiles narrow the report as vLLM's do; --save-result's
# default name is vLLM's; the progress line (a pipe: one every 10 s and the last) on stderr only
( cd "$CL_T" && timeout 60 "$CL_BIN" bench serve --base-url "${OA%/v1}" --model default --num-prompts 4 \
        --random-input-len 8 --random-output-len 4 --vocab-size 512 --percentile-metrics ttft,e2el \
        --metric-percentiles 99.9 --max-concurrency 2 --request-rate 10 --save-result >pm.txt 2>pm.err ) ||
    cl_fail "bench serve --percentile-metrics exited non-zero: $(tail -3 "$CL_T/pm.err")"
grep -qE '^P99\.9 TTFT \(ms\): +[0-9.]+ *$' "$CL_T/pm.txt" && grep -qE '^Mean E2EL \(ms\):' "$CL_T/pm.txt" ||
    cl_fail "--percentile-metrics ttft,e2el --metric-percentiles 99.9: $(cat "$CL_T/pm.txt")"
grep -qE 'TPOT|ITL|P99 ' "$CL_T/pm.txt" && cl_fail "--percentile-metrics ttft,e2el still reports others: $(cat "$CL_T/pm.txt")"
ls "$CL_T"/openai-10.0qps-concurrency2-default-2*.json >/dev/null 2>&1 ||
    cl_fail "--save-result: no openai-10.0qps-concurrency2-default-DATE.json in $CL_T: $(ls "$CL_T")"
"$CL_PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); assert "p99.9_ttft_ms" in d and "mean_tpot_ms" not in d and d["model_id"] == "default", d' \
    "$(ls "$CL_T"/openai-10.0qps-*.json | head -1)" || cl_fail "--save-result JSON keys"

# --backend openai-chat: chat completions of text messages (the ids decoded with --tokenizer);
# Llama 2's tokenizer.bin has no chat template, so the router's chat route refuses each by name
timeout 60 "$CL_BIN" bench serve --backend openai-chat --base-url "${OA%/v1}" --endpoint /v1/chat/completions \
    --tokenizer "$TOK" --num-prompts 3 --random-input-len 8 --random-output-len 4 --vocab-size 512 --json \
    >"$CL_T/c.json" 2>"$CL_T/c.err"
"$CL_PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["backend"] == "openai-chat" and d["failed"] == 3 and "chat template" in d["first_error"], d' \
    "$CL_T/c.json" || cl_fail "openai-chat run: $(head -c 400 "$CL_T/c.json") $(tail -3 "$CL_T/c.err")"

# ---- gRPC gateway: the warm-up counted by the router, not by the figures; a sweep ----
ok0=$(metric tandem_router_requests_total outcome=ok)
cached0=$(cl_metric prefill0 tandem_prefill_cached_tokens_total 2>/dev/null | cut -d. -f1)
# 32-token prompts (two whole KV blocks): were a rate to resend an earlier rate's prompts, the
# prefill node's prefix cache would serve them
if ! timeout 60 "$CL_BIN" bench serve --gateway "$CL_GW" --num-prompts 10 --warmup-prompts 3 --input-len 32 \
        --output-len 6 --vocab-size 512 --seed 11 --max-concurrency 4 --sweep 20,40 --goodput e2el:5000 \
        --json >"$CL_T/g.json" 2>"$CL_T/bs.err"; then
    cl_fail "bench serve --gateway exited non-zero: $(tail -3 "$CL_T/bs.err")"
fi
ok1=$(metric tandem_router_requests_total outcome=ok)
cached1=$(cl_metric prefill0 tandem_prefill_cached_tokens_total 2>/dev/null | cut -d. -f1)
[ "${cached1:-x}" = "${cached0:-y}" ] ||
    cl_fail "the sweep's rates shared prompts: the prefix cache served $cached0 -> $cached1 tokens"
"$CL_PY" - "$CL_T/g.json" "$((ok1 - ok0))" <<'EOF' || cl_fail "the gRPC sweep's JSON (above)"
import json, sys
d = json.load(open(sys.argv[1]))
ok = int(sys.argv[2])
assert d["backend"] == "grpc" and len(d["runs"]) == 2, d
assert [r["request_rate"] for r in d["runs"]] == [20, 40]
assert all(r["completed"] == 10 and r["failed"] == 0 for r in d["runs"]), [r["first_error"] for r in d["runs"]]
assert ok == 3 + 20, f"router ok {ok}, want 3 warm-up + 2 x 10"
assert all(r["max_concurrency_seen"] <= 4 for r in d["runs"])
assert d["sweep_attainment"] == 0.9 and d["sweep_best_rate"] in (20, 40, None), d["sweep_best_rate"]
print(f"grpc sweep: best rate {d['sweep_best_rate']}, attainment", [r["slo_attainment"] for r in d["runs"]])
EOF

# ---- a trace replays its rows; nothing listening: all failed, exit 1 ----
printf 'arrival_s,input_len,output_len\n0,8,4\n0.05,16,3\n0.1,4,2\n' >"$CL_T/trace.csv"
timeout 30 "$CL_BIN" bench serve --openai "$OA" --dataset trace --dataset-path "$CL_T/trace.csv" --vocab-size 512 \
    --json >"$CL_T/t.json" 2>"$CL_T/bs.err" || cl_fail "bench serve --dataset trace exited non-zero"
"$CL_PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["completed"] == 3 and d["total_input_tokens"] == 28 and d["total_output_tokens"] == 9 and d["ignore_eos"], d' \
    "$CL_T/t.json" || cl_fail "trace run: $(head -c 400 "$CL_T/t.json")"
timeout 30 "$CL_BIN" bench serve --openai http://127.0.0.1:1/v1 --num-prompts 3 --input-len 4 --output-len 2 --json \
    >"$CL_T/f.json" 2>/dev/null
rc=$?
[ $rc -eq 1 ] || cl_fail "nothing listening: exit $rc, want 1"
"$CL_PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["failed"] == 3 and d["completed"] == 0 and "connect" in d["first_error"], d' \
    "$CL_T/f.json" || cl_fail "nothing listening: $(head -c 300 "$CL_T/f.json")"

# a server that accepts and never answers: every request fails at --request-timeout-s
"$CL_PY" -c '
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(64); s.settimeout(0.2)
print(s.getsockname()[1], flush=True)
held, end = [], time.time() + 10
while time.time() < end:
    try: held.append(s.accept())
    except OSError: pass
' >"$CL_T/silent.port" &
SILENT=$!
CL_BG+=("$SILENT")
cl_wait_line "$CL_T/silent.port" '^[0-9]+$' 5 || cl_fail "the silent server did not start"
timeout 30 "$CL_BIN" bench serve --openai "http://127.0.0.1:$(cat "$CL_T/silent.port")/v1" --num-prompts 4 \
    --input-len 4 --output-len 2 --request-timeout-s 0.5 --json >"$CL_T/s.json" 2>/dev/null
rc=$?
[ $rc -eq 1 ] || cl_fail "silent server: exit $rc, want 1"
"$CL_PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["failed"] == 4 and "request-timeout-s" in d["first_error"] and d["duration"] < 5, d' \
    "$CL_T/s.json" || cl_fail "silent server: $(head -c 300 "$CL_T/s.json")"
kill "$SILENT" 2>/dev/null

# ---- the load generator's own ceiling: no-op nodes behind a real router (bench router --hold) ----
"$CL_BIN" bench router --http --hold 30 >"$CL_T/noop.out" 2>"$CL_T/noop.err" &
NOOP=$!
CL_BG+=("$NOOP")
if cl_wait_line "$CL_T/noop.out" '^openai: ' 20; then
    NOOP_OA=$(sed -n 's/^openai: //p' "$CL_T/noop.out")
    timeout 60 "$CL_BIN" bench serve --openai "$NOOP_OA" --num-prompts 2000 --input-len 16 --output-len 2 \
        --max-concurrency 64 --json >"$CL_T/n.json" 2>"$CL_T/bs.err" || cl_fail "bench serve against no-op nodes failed"
    "$CL_PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["completed"] == 2000 and d["total_output_tokens"] == 4000, d
print("no-op nodes: %.0f requests/s, load generator %s us CPU per request" % (d["request_throughput"], d["bench_cpu_us_per_request"]))' \
        "$CL_T/n.json" || cl_fail "no-op run: $(head -c 300 "$CL_T/n.json")"
else
    cl_fail "bench router --hold printed no openai: line: $(tail -3 "$CL_T/noop.err")"
fi
kill -TERM "$NOOP" 2>/dev/null
wait "$NOOP" 2>/dev/null

# ---- bad flags: one line naming the flag, exit 2 ----
bad() { # FLAG ARGS...: exits 2 with one stderr line naming FLAG
    local flag=$1 rc; shift
    "$CL_BIN" bench serve "$@" >/dev/null 2>"$CL_T/bad.err"
    rc=$?
    [ $rc -eq 2 ] || cl_fail "bench serve $*: exit $rc, want 2"
    [ "$(wc -l <"$CL_T/bad.err")" -eq 1 ] && grep -q -- "$flag" "$CL_T/bad.err" ||
        cl_fail "bench serve $*: want one line naming $flag, got: $(cat "$CL_T/bad.err")"
}
bad --request-rate --openai "$OA" --request-rate -1
bad --goodput --openai "$OA" --goodput ttft:abc
bad --goodput --openai "$OA" --goodput latency:5
bad --dataset --openai "$OA" --dataset bogus
bad --dataset-name --openai "$OA" --dataset-name sonnet
bad --backend --openai "$OA" --backend tgi
bad --endpoint --base-url "${OA%/v1}" --endpoint /v1/chat/completions
bad --endpoint --base-url "${OA%/v1}" --backend openai-chat --tokenizer "$TOK" --endpoint /v1/completions
bad --percentile-metrics --openai "$OA" --percentile-metrics ttft,latency
bad --metric-percentiles --openai "$OA" --metric-percentiles 50,101
bad --tokenizer --openai "$OA" --backend openai-chat
bad --goodput --openai "$OA" --goodput ttft:100 e2e:5
bad --sweep --openai "$OA" --sweep 5:1:1
bad --num-prompts --openai "$OA" --num-prompts 0
bad --bogus --openai "$OA" --bogus 1
bad --openai --num-prompts 3
bad --openai --openai https://example.com/v1
bad --dataset-path --openai "$OA" --dataset trace

cl_end "bench serve: OpenAI and gRPC runs agree with the router's counters; trace, sweep, failures, bad flags"
