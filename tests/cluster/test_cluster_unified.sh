#!/bin/bash
# test_cluster_unified: the colocated baseline. `tandem local --unified 2` (two unified nodes:
# prefill and decode in one engine, chunked prefill inside the decode steps, no KV transfer;
# the router pairs each with itself) on stories260K:
# - 8 concurrent greedy requests equal `tandem generate` token for token;
# - seeded temperature > 0 requests equal `tandem generate --seed` (a unified node samples
#   every token with one sampler: no split of the random stream);
# - ignore_eos through the gRPC gateway: a prompt that ends at EOS after 223 tokens runs to
#   max_tokens, its first 223 tokens those of the EOS-ended run;
# - cancels at the first message and after 8 tokens give every KV block back;
# - a mixed cluster (1 prefill + 1 decode + 1 unified under one router) serves concurrent
#   requests on both kinds, each equal to `tandem generate`;
# and the final idle check (cl_idle: no running, waiting or used blocks on the unified nodes).
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_local 0 0 --unified 2 --threads 1
[ -n "${CL_MURL[unified0]:-}" ] && [ -n "${CL_MURL[unified1]:-}" ] ||
    { cl_fail "no unified0/unified1 metrics URLs in tandem local's output"; cl_dump; cl_end; }

echo "== greedy, concurrent"
PROMPTS=("1" "1 403 407" "1 200 300 400" "5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21" "1 100" "1 250 251" "1 42" "1 480 2 3")
cl_concurrent_equal 24 "${PROMPTS[@]}"
t0=$(cl_metric unified0 tandem_unified_tokens_total | cut -d. -f1)
t1=$(cl_metric unified1 tandem_unified_tokens_total | cut -d. -f1)
p0=$(cl_metric unified0 tandem_unified_prefill_tokens_total | cut -d. -f1)
echo "tokens: unified0 $t0, unified1 $t1; unified0 prefill tokens $p0"
[ "$t0" -gt 0 ] && [ "$t1" -gt 0 ] || cl_fail "the router did not use both unified nodes ($t0, $t1 tokens)"
[ "$p0" -gt 0 ] || cl_fail "unified0 counted no prefill tokens"

echo "== seeded"
n=0
for sp in "--temperature 0.8 --seed 42" "--temperature 1.0 --seed 7 --top-k 40"; do
    for p in "1 300 301 302" "1 77"; do
        # shellcheck disable=SC2086
        got=$(timeout 60 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$p" --max-tokens 30 --print-ids $sp 2>"$CL_T/gen.err")
        # shellcheck disable=SC2086
        want=$("$CL_BIN" generate --model "$CL_M" --prompt-ids "$p" --max-tokens 30 --print-ids --threads 1 $sp 2>/dev/null)
        [ -n "$want" ] && [ "$want" = "$got" ] || cl_fail "$sp, prompt '$p': want '$want' got '$got' ($(tail -1 "$CL_T/gen.err"))"
        n=$((n + 1))
    done
done
echo "$n seeded generations compared"

echo "== ignore_eos"
eos_run=$(cl_ref 300 "1 100")
[ "$(wc -w <<<"$eos_run")" -lt 300 ] || cl_fail "prompt '1 100' no longer ends at EOS within 300 tokens: pick another"
"$CL_PY" - "$CL_SRC/tests/cluster" "$CL_GW" "$eos_run" <<'PY' || cl_fail "ignore_eos (above)"
import sys
sys.path.insert(0, sys.argv[1])
from cluster_wire import channel, generate_stub, parse_ids, pb_varint, request
stub = generate_stub(channel(sys.argv[2]))
want = [int(x) for x in sys.argv[3].split()]
got = []
for m in stub(request([1, 100], 300) + pb_varint(12, 1), timeout=60):  # GenerateRequest.ignore_eos
    got += parse_ids(m)
assert len(got) == 300, "ignore_eos: %d tokens, want 300 (max_tokens)" % len(got)
assert got[:len(want)] == want, "the tokens before EOS differ from the EOS-ended run"
print("ignore_eos: 300 tokens where the model ends at EOS after %d; the first %d equal" % (len(want), len(want)))
PY

echo "== cancels give every KV block back"
"$CL_PY" "$CL_TOOL" cancel "$CL_GW" 8 480 0 >"$CL_T/c0.log" || { cat "$CL_T/c0.log"; CL_FAIL=1; }
"$CL_PY" "$CL_TOOL" cancel "$CL_GW" 8 480 8 >"$CL_T/c8.log" || { cat "$CL_T/c8.log"; CL_FAIL=1; }
grep -c CANCELLED "$CL_T/c8.log" | sed 's/^/streams cancelled after 8 tokens: /'
for u in unified0 unified1; do
    for m in kv_blocks_used running_sequences waiting_sequences; do
        v=$("$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[$u]}" "tandem_unified_$m" == 0 10) ||
            cl_fail "$u: tandem_unified_$m did not return to 0 after the cancels: $v"
    done
done
echo "kv blocks: back to 0 on both unified nodes"
cl_stop
CL_NAMES=() CL_PID=()

echo "== mixed: 1 prefill + 1 decode + 1 unified"
cl_local 1 1 --unified 1 --threads 1
cl_concurrent_equal 24 "${PROMPTS[@]}" "1 11" "1 12" "1 13" "1 14"
td=$(cl_metric decode0 tandem_decode_tokens_total | cut -d. -f1)
tu=$(cl_metric unified0 tandem_unified_tokens_total | cut -d. -f1)
echo "tokens: decode0 $td, unified0 $tu"
[ "$td" -gt 0 ] && [ "$tu" -gt 0 ] || cl_fail "the mixed cluster did not serve on both kinds (decode $td, unified $tu tokens)"
cl_end "unified nodes: greedy, seeded and ignore_eos equal tandem generate; cancels return blocks; mixed cluster"
