#!/usr/bin/env bash
# tandem bench kernels --packed on the real binary (docs/bench.md): on a tiny matrix every
# packed type gets one result per activation width and row count, with sane figures (GMAC/s
# consistent with ms and the shape, GB/s only at m = 1), the table the CPU backend runs is
# named (TANDEM_CPU_ISA honoured: scalar's is "scalar"), and bad options are exit 2 naming them.
set -u
bin=${TANDEM_BIN:?TANDEM_BIN must point to the tandem binary}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }

if "$bin" bench kernels --packed --k 512 --n 40 --rows 1 5 --rounds 1 --json >"$tmp/all.json" 2>"$tmp/err"; then
    ok
else
    bad "bench kernels --packed: $(tail -2 "$tmp/err")"
fi
if TANDEM_CPU_ISA=scalar "$bin" bench kernels --packed --quant q4_k --act-bytes 1 --k 256 --n 16 --rows 3 --rounds 1 --json \
    >"$tmp/scalar.json" 2>"$tmp/err"; then
    ok
else
    bad "bench kernels --packed at scalar: $(tail -2 "$tmp/err")"
fi
/usr/bin/python3 - "$tmp/all.json" "$tmp/scalar.json" <<'PY' && ok || bad "bench kernels --packed's JSON (above)"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["bench"] == "kernels_packed" and j["threads"] == 1 and (j["k"], j["n"]) == (512, 40), j
assert j["cpu_isa"] in ("scalar", "avx2", "avx512", "avx512vnni", "avx512bf16", "amx") and j["table"] in ("scalar", "avx2", "avx512vnni", "amx"), j
got = [(r["type"], r["act_bytes"], r["m"]) for r in j["results"]]
want = [(t, b, m) for t in ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "iq4_xs") for b in (2, 1) for m in (1, 5)]
assert got == want, got
for r in j["results"]:
    assert r["ms"] > 0 and r["gmac_per_s"] > 0, r
    # GMAC/s is m n k over the time (ms rounded to 4 places: compare loosely)
    if r["ms"] >= 0.01:
        assert abs(r["gmac_per_s"] - r["m"] * 40 * 512 / (r["ms"] * 1e-3) / 1e9) <= 0.02 * r["gmac_per_s"], r
    assert ("weight_gbps" in r) == (r["m"] == 1), r
    if r["m"] == 1:
        assert r["weight_gbps"] > 0, r
s = json.load(open(sys.argv[2]))
assert s["cpu_isa"] == "scalar" and s["table"] == "scalar", s
assert [(r["type"], r["act_bytes"], r["m"]) for r in s["results"]] == [("q4_k", 1, 3)], s
PY
"$bin" bench kernels --packed --k 256 --n 16 --rows 1 --rounds 1 --quant q4_k >"$tmp/text" 2>"$tmp/err" &&
    grep -q "^packed kernels, cpu_isa " "$tmp/text" && grep -Eq "^q4_k +1 +1 +[0-9.]+ +[0-9.]+ +[0-9.]+$" "$tmp/text" &&
    ok || bad "text output: '$(head -c 400 "$tmp/text")' $(tail -2 "$tmp/err")"
for args in "--quant q2_k" "--k 300" "--rows 0" "--act-bytes 3"; do
    "$bin" bench kernels --packed $args >/dev/null 2>"$tmp/err"
    rc=$?
    opt=${args%% *}
    [ "$rc" -eq 2 ] && grep -q -- "$opt" "$tmp/err" && ok || bad "$args: exit $rc, '$(head -c 300 "$tmp/err")'"
done
echo "passed $pass, failed $fail"
[ "$fail" -eq 0 ]
