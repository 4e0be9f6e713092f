#!/bin/bash
# test_cluster_unified_route: two unified nodes, and a prompt long enough that one step of
# its chunks takes a second (SmolLM2-135M, one thread: ~2.5 ms a prompt token; 20x that
# under the sanitizers, so a tenth of the prompt). While that step runs, the node's
# heartbeats must tell the router the prompt tokens it still feeds (the router's
# tandem_router_node_queued_prefill_tokens gauge), and a request arriving then must go to
# the other node, not wait behind the prompt and stall the node's batch for its chunks.
# (Before: a unified node reported no queued tokens and its running count only as of its
# last finished step, so the router saw two idle nodes and the second request often
# landed behind the first: docs/goodput.md, planner validation.) Skips without the GGUF.
source "$(dirname "$0")/cluster_lib.sh"
cl_init_gguf
N=480
[ "${TD_SANITIZE:-OFF}" = ON ] && N=48
cl_local 0 0 --unified 2 --threads 1 --kv-mem 128
[ -n "${CL_MURL[unified0]:-}" ] && [ -n "${CL_MURL[unified1]:-}" ] ||
    { cl_fail "no unified0/unified1 metrics URLs in tandem local's output"; cl_dump; cl_end; }

long=$("$CL_PY" -c "import random; r = random.Random(7); print(' '.join(str(r.randrange(100, 49000)) for _ in range($N)))")
timeout 120 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$long" --max-tokens 2 --print-ids --timeout 100 \
    >"$CL_T/long.out" 2>"$CL_T/long.err" &
LONG=$!

# the node with the long prompt says so in its heartbeats while the step runs: one process
# reads the router's gauge every 20 ms until it does or the long request ends (a python
# start per reading, twice per round, sampled the 1.2 s step too sparsely under CI's load)
read -r busy seen < <("$CL_PY" - "$CL_TOOL" "${CL_MURL[router]}" $((N / 2)) $LONG <<'PY'
import importlib.util, os, sys, time
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # its helper modules
spec = importlib.util.spec_from_file_location("cf", sys.argv[1])
cf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cf)
url, want, pid = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
end = time.monotonic() + 10
while time.monotonic() < end:
    for u in ("unified0", "unified1"):
        try:
            q = cf.fetch_metric(url, "tandem_router_node_queued_prefill_tokens", "node=" + u)
        except (OSError, KeyError):
            q = 0
        if q >= want:
            print(u, int(q))
            sys.exit(0)
    try:
        os.kill(pid, 0)
    except OSError:
        break
    time.sleep(0.02)
print("", 0)
PY
)
[ -n "$busy" ] || { cl_fail "no unified node reported the $N-token prompt as queued while prefilling it"; cl_dump; cl_end; }
other=unified1
[ "$busy" = unified1 ] && other=unified0
echo "$busy reports $seen prompt tokens queued (prompt $N)"
kill -0 $LONG 2>/dev/null || cl_fail "the long prompt ended before the check (its step was too short to test)"

before_o=$(cl_metric "$other" tandem_unified_prefill_tokens_total | cut -d. -f1)
timeout 60 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "1 2 3 4 5 6 7 8" --max-tokens 2 --print-ids --timeout 50 \
    >"$CL_T/short.out" 2>"$CL_T/short.err" || cl_fail "short request: $(tail -1 "$CL_T/short.err")"
wait $LONG || cl_fail "long request: $(tail -1 "$CL_T/long.err")"
after_o=$(cl_metric "$other" tandem_unified_prefill_tokens_total | cut -d. -f1)
echo "prompt tokens prefilled on the idle node $other: $before_o -> $after_o"
[ "$((after_o - before_o))" -ge 8 ] ||
    cl_fail "the short request did not go to the idle node $other (it prefilled $((after_o - before_o)) tokens): it waited behind the long prompt on $busy"
cl_idle
cl_end
