#!/usr/bin/env bash
# Smoke test of `tandem bench http-server` (so the benchmark cannot rot): a short run with
# --json exits 0 and prints one JSON document with every key of docs/bench.md, the counts
# positive and the SSE stream whole; bad usage exits 2. No timing is asserted (figures from
# a shared machine mean nothing in a test).
source "$(dirname "$0")/bench_lib.sh"
bl_init

if ! timeout 120 "$BIN" bench http-server --seconds 0.3 --connections 4 --pipeline 2 --events 20000 --json \
        >"$tmp/out" 2>"$tmp/err"; then
    bl_bad "bench http-server exited $? (stderr below)"
    cat "$tmp/err" >&2
fi
"$PY" - "$tmp/out" <<'PYEOF' || bl_bad "bench http-server --json output (above)"
import json, math, sys
doc = json.load(open(sys.argv[1]))
keys = {"connections", "pipeline", "requests", "requests_per_s", "requests_per_server_core_s",
        "server_cpu_share", "latency_p50_us", "latency_p99_us", "sse_events", "sse_events_per_s",
        "sse_events_per_server_core_s", "sse_mb_per_s"}
assert set(doc) == keys, set(doc) ^ keys
assert doc["connections"] == 4 and doc["pipeline"] == 2 and doc["sse_events"] == 20000, doc
for k in ("requests", "requests_per_s", "sse_events_per_s", "sse_mb_per_s"):
    assert isinstance(doc[k], (int, float)) and doc[k] > 0 and math.isfinite(doc[k]), (k, doc[k])
assert doc["latency_p99_us"] >= doc["latency_p50_us"] >= 0, doc
print("http-server:", " ".join(f"{k}={v}" for k, v in doc.items()))
PYEOF
[ "$bl_fails" -eq 0 ] || cat "$tmp/out" >&2

"$BIN" bench http-server --pipeline 0 >/dev/null 2>&1
rc=$?
[ $rc -eq 2 ] || bl_bad "--pipeline 0 exited $rc, want 2"
"$BIN" bench http-server --bogus >/dev/null 2>&1
rc=$?
[ $rc -eq 2 ] || bl_bad "--bogus exited $rc, want 2"

bl_end test_bench_http_server
