#!/bin/bash
# test_cluster_overload: ten times the cluster's capacity (issue 17). A router with a small
# admission bound (--max-active 8 --max-queue 16) and 1 prefill + 1 decode node on
# stories260K; `tandem bench serve` measures, in order:
#   1. capacity: 16 streams at a time (under the 24 the router admits: a slot frees a moment
#      after its client saw the end), rate unbounded;
#   2. overload: arrivals at 10x that rate for ~3 s. Requests past the queue must be refused
#      at once with RESOURCE_EXHAUSTED (p99 under 100 ms from send) and nothing else may fail;
#      the admitted ones keep their latency within a bound of the capacity run's (TTFT p90
#      within 3x + 0.5 s: they waited in a queue of 16 behind 8; TPOT p90 within 3x + 5 ms);
#      the router's memory stays bounded (RSS grows less than 64 MB);
#   3. recovery, right after: half the capacity for ~2 s, every request served, TTFT p90
#      within 3x + 0.2 s of the capacity run's.
# Bounds are loose on purpose: the client, the router and the nodes share the machine.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_cluster 1 --max-active 8 --max-queue 16
SERVE=("$CL_BIN" bench serve --gateway "$CL_GW" --input-len 32 --output-len 32 --vocab-size 500 --connections 4)
rss() { awk '/^VmRSS:/ {print $2}' "/proc/${CL_PID[$CL_ROUTER]}/status"; }
"${SERVE[@]}" --num-prompts 96 --max-concurrency 16 --json >"$CL_T/cap.json" 2>"$CL_T/cap.err" ||
    { cl_fail "capacity run: $(tail -3 "$CL_T/cap.err")"; cl_end; }
rss0=$(rss)
rate=$("$CL_PY" -c "import json; print(round(json.load(open('$CL_T/cap.json'))['request_throughput'], 1))")
read -r n_over over_rate n_rec rec_rate < <("$CL_PY" -c \
    "r = $rate; print(max(200, int(r * 10 * 3)), round(r * 10, 1), max(20, int(r * 0.5 * 2)), round(r * 0.5, 1))")
echo "capacity: $rate requests/s (16 at a time); overload: $n_over requests at $over_rate/s"
"${SERVE[@]}" --num-prompts "$n_over" --request-rate "$over_rate" --save-detailed \
    --result-file "$CL_T/over.json" --seed 1 >"$CL_T/over.out" 2>"$CL_T/over.err" ||
    { cl_fail "overload run: $(tail -3 "$CL_T/over.err")"; cl_end; }
rss1=$(rss)
"${SERVE[@]}" --num-prompts "$n_rec" --request-rate "$rec_rate" --json --seed 2 \
    >"$CL_T/rec.json" 2>"$CL_T/rec.err" || { cl_fail "recovery run: $(tail -3 "$CL_T/rec.err")"; cl_end; }
"$CL_PY" - "$CL_T/cap.json" "$CL_T/over.json" "$CL_T/rec.json" "$rss0" "$rss1" <<'PY' || CL_FAIL=1
import collections, json, sys
cap, over, rec = (json.load(open(p)) for p in sys.argv[1:4])
rss0, rss1 = int(sys.argv[4]), int(sys.argv[5])
bad = []
def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))] if v else float("nan")
reqs = over["requests"]
ok = [r for r in reqs if r["ok"]]
failed = [r for r in reqs if not r["ok"]]
kinds = collections.Counter((r["error"] or "").split(":")[0] for r in failed)
print("capacity: %d ok, TTFT p90 %.1f ms, TPOT p90 %.2f ms" % (cap["completed"], cap["p90_ttft_ms"], cap["p90_tpot_ms"]))
print("overload: %d requests, %d admitted and served, %d refused %s; refusal p50/p99 %.2f/%.2f ms after send; "
      "admitted TTFT p90 %.1f ms, TPOT p90 %.2f ms; router RSS %d -> %d kB" % (
      len(reqs), len(ok), len(failed), dict(kinds), q([r["end_ms"] for r in failed], .5),
      q([r["end_ms"] for r in failed], .99), q([r["ttft_ms"] for r in ok], .9), q([r["tpot_ms"] for r in ok], .9),
      rss0, rss1))
print("recovery: %d of %d served, TTFT p90 %.1f ms, TPOT p90 %.2f ms" % (
      rec["completed"], rec["completed"] + rec["failed"], rec["p90_ttft_ms"], rec["p90_tpot_ms"]))
if cap["failed"]:
    bad.append("the capacity run had %d failures" % cap["failed"])
if not failed:
    bad.append("nothing was refused at 10x capacity")
if set(kinds) - {"RESOURCE_EXHAUSTED"}:
    bad.append("failures other than RESOURCE_EXHAUSTED: %s (first: %s)" % (dict(kinds), over["first_error"]))
if failed and q([r["end_ms"] for r in failed], .99) > 100:
    bad.append("refusals were not immediate: p99 %.1f ms" % q([r["end_ms"] for r in failed], .99))
if len(ok) < 24:
    bad.append("only %d requests were admitted and served" % len(ok))
if q([r["ttft_ms"] for r in ok], .9) > 3 * cap["p90_ttft_ms"] + 500:
    bad.append("admitted TTFT p90 past 3x + 500 ms of the capacity run's")
if q([r["tpot_ms"] for r in ok], .9) > 3 * cap["p90_tpot_ms"] + 5:
    bad.append("admitted TPOT p90 past 3x + 5 ms of the capacity run's")
if rss1 - rss0 > 64 * 1024:
    bad.append("the router's RSS grew by %d kB" % (rss1 - rss0))
if rec["failed"]:
    bad.append("%d requests failed after the overload: %s" % (rec["failed"], rec["first_error"]))
if rec["p90_ttft_ms"] > 3 * cap["p90_ttft_ms"] + 200:
    bad.append("recovery TTFT p90 past 3x + 200 ms of the capacity run's")
for b in bad:
    print("FAIL: " + b)
sys.exit(1 if bad else 0)
PY
v=$(cl_metric "$CL_ROUTER" tandem_router_requests_total 'outcome=exhausted')
echo "router: tandem_router_requests_total{outcome=exhausted} $v"
[ "${v%.*}" -gt 0 ] 2>/dev/null || cl_fail "the router did not count its refusals (outcome=exhausted: '$v')"
cl_end "10x capacity: refused at once with RESOURCE_EXHAUSTED past the queue, admitted requests within their bounds, router memory bounded, full service right after"
