#!/usr/bin/env bash
# Smoke test of `tandem bench router` (so the benchmark cannot rot): a short run with
# --json exits 0 and prints one JSON document whose rows carry name/value/unit/goal/ratio,
# with the three figures of issue 5 present and positive, the same with --http (issue 15: through
# the OpenAI HTTP API); bad usage exits 2. No timing is
# asserted (figures from a shared machine mean nothing in a test).
source "$(dirname "$0")/bench_lib.sh"
bl_init

if ! timeout 120 "$BIN" bench router --duration 0.5 --concurrency 32 --streams 8 --stream-tokens 256 --json \
        >"$tmp/out" 2>"$tmp/err"; then
    bl_bad "bench router exited $? (stderr below)"
    cat "$tmp/err" >&2
fi
"$PY" - "$tmp/out" <<'PYEOF' || bl_bad "bench router --json output (above)"
import json, math, sys
doc = json.load(open(sys.argv[1]))
rows = {r["name"]: r for r in doc["rows"]}
for r in doc["rows"]:
    assert set(r) == {"name", "value", "unit", "goal", "ratio"}, r
for name in ("routed_requests_per_s", "added_latency_p99_us", "relayed_tokens_per_s",
             "latency_router_p50_us", "latency_direct_p50_us"):
    assert name in rows, name
for name in ("routed_requests_per_s", "relayed_tokens_per_s", "latency_router_p50_us",
             "latency_direct_p50_us", "latency_samples"):
    v = rows[name]["value"]
    assert isinstance(v, (int, float)) and v > 0 and math.isfinite(v), (name, v)
for name, goal in (("routed_requests_per_s", 20000), ("relayed_tokens_per_s", 1e6),
                   ("added_latency_p99_us", 200)):
    assert rows[name]["goal"] == goal, name
assert doc["errors"] == 0, doc["errors"]
print("rows:", " ".join(f"{k}={v['value']:.4g}" for k, v in rows.items()))
PYEOF
[ "$bl_fails" -eq 0 ] || cat "$tmp/out" >&2

# the same phases through the OpenAI HTTP API (streamed /v1/chat/completions): each counts
if ! timeout 120 "$BIN" bench router --http --duration 0.5 --concurrency 16 --streams 4 --stream-tokens 256 --json \
        >"$tmp/http" 2>"$tmp/err"; then
    bl_bad "bench router --http exited $? (stderr below)"
    cat "$tmp/err" >&2
fi
"$PY" - "$tmp/http" <<'PYEOF' || bl_bad "bench router --http --json output (above)"
import json, sys
doc = json.load(open(sys.argv[1]))
rows = {r["name"]: r for r in doc["rows"]}
assert doc["http"] is True and doc["errors"] == 0, doc
for name in ("routed_requests_per_s", "relayed_tokens_per_s", "latency_router_p50_us", "latency_samples"):
    assert rows[name]["value"] > 0, (name, rows[name])
assert rows["added_latency_p99_us"]["goal"] == 300
print("http rows:", " ".join(f"{k}={v['value']:.4g}" for k, v in rows.items()))
PYEOF

"$BIN" bench router --duration nope >/dev/null 2>&1
rc=$?
[ $rc -eq 2 ] || bl_bad "--duration nope exited $rc, want 2"
"$BIN" bench router --phases xyz >/dev/null 2>&1
rc=$?
[ $rc -eq 2 ] || bl_bad "--phases xyz exited $rc, want 2"

bl_end test_bench_router
