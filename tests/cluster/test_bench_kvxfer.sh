#!/usr/bin/env bash
# Smoke test of `tandem bench kvxfer` (so the benchmark cannot rot): one small transfer size
# over tcp and over shared memory with --json exits 0 and prints JSON alone on stdout (UCX's
# warnings go to stderr), one row each carrying the keys of issue 4 and the comparators,
# figures positive; bad usage exits 2. No timing is asserted (figures from a shared machine
# mean nothing in a test).
source "$(dirname "$0")/bench_lib.sh"
bl_init

if ! command -v ucx_perftest >/dev/null; then
    echo "skipped: ucx_perftest not installed (scripts/install-deps installs ucx-utils)"
    exit 77
fi
for tr in tcp sm; do
    timeout 180 "$BIN" bench kvxfer --transport "$tr" --tokens 16 --iters 2 --rounds 1 --window 2 --json \
        >"$tmp/$tr" 2>"$tmp/$tr.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        bl_bad "bench kvxfer --transport $tr exited $rc (stderr below)"
        cat "$tmp/$tr.err" >&2
        continue
    fi
    "$PY" - "$tmp/$tr" "$tr" <<'PYEOF' || { bl_bad "bench kvxfer --transport $tr --json output:"; cat "$tmp/$tr" >&2; }
import json, math, sys
rows = json.load(open(sys.argv[1]))
assert len(rows) == 1, rows
r = rows[0]
for k in ("transport", "tokens", "bytes", "gbytes_per_s", "perftest_gbytes_per_s", "p50_us", "p99_us",
          "ratio", "ratio_min", "ratio_max", "rounds", "copy_gbytes_per_s"):
    assert k in r, k
assert r["transport"] == sys.argv[2] and r["tokens"] == 16 and r["rounds"] == 1, r
assert r["bytes"] == 32 * 16 * 8 * 128 * 2 * 2, r["bytes"]  # 32 layers x 16 tokens x K,V of 8x128 bf16
assert r["primitive"] == ("am" if sys.argv[2] == "tcp" else "put"), r["primitive"]
for k in ("gbytes_per_s", "p50_us", "p99_us", "copy_gbytes_per_s"):
    assert isinstance(r[k], (int, float)) and r[k] > 0 and math.isfinite(r[k]), (k, r[k])
assert r["p99_us"] >= r["p50_us"], r
print(sys.argv[2], "GB/s", r["gbytes_per_s"], "perftest", r["perftest_gbytes_per_s"], "p50 us", r["p50_us"])
PYEOF
done

"$BIN" bench kvxfer --tokens 0 >/dev/null 2>&1
[ $? -eq 2 ] || bl_bad "--tokens 0 should exit 2"
"$BIN" bench kvxfer --transport carrier-pigeon >/dev/null 2>&1
[ $? -eq 2 ] || bl_bad "an unknown transport should exit 2"
"$BIN" bench kvxfer --rounds 0 >/dev/null 2>&1
[ $? -eq 2 ] || bl_bad "--rounds 0 should exit 2"

bl_end test_bench_kvxfer
