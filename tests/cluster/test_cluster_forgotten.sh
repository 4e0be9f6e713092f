#!/bin/bash
# test_cluster_forgotten: a decode node the router dropped drops what it ran for it (issue 37;
# docs/cluster.md "A node the router dropped"). A router with a 1 s heartbeat timeout, p0 and
# d0; one stream of 4000 tokens (ignore_eos); once it has 8, d0 is stopped (SIGSTOP) for 3 s: the router
# drops d0 (moving or failing its stream) and answers its next heartbeat "reregister". After
# SIGCONT d0 must drop the forgotten sequence: no running or waiting sequence and no KV block
# used within 2 s (before, it ran the stream on to max_tokens with nobody reading it, holding
# blocks and a batch slot the router counted free), say so in its log, and end within 2 s of
# a SIGTERM (before, its drain waited for the orphan: 9.1 s). The client's stream ends OK
# (moved) or with a status that says why. Then the same for a unified node u0 beside p0.
# Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
# the drain test's 20M-parameter random model (300-600 tokens/s on one thread): 4000 tokens
# outlast the pause and the checks (without the fix the orphan ran on for seconds after the
# SIGCONT, and the SIGTERM's drain waited for it)
MAXTOK=4000
HIDDEN=512 INTER=1408 LAYERS=6 HEADS=8
# the sanitizer build runs a model ~20x slower: a ~40x smaller one keeps the stream as long
[ "${TD_SANITIZE:-OFF}" = ON ] && HIDDEN=128 INTER=352 LAYERS=2 HEADS=4
CL_M="$CL_T/model"
cat >"$CL_T/config.json" <<JSON
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": $HIDDEN,
 "intermediate_size": $INTER, "num_hidden_layers": $LAYERS, "num_attention_heads": $HEADS,
 "num_key_value_heads": $HEADS, "vocab_size": 512, "max_position_embeddings": 4096,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
 "bos_token_id": 256, "eos_token_id": 257}
JSON
"$CL_BIN" model synth --arch llama --config "$CL_T/config.json" --seed 3 --out "$CL_M" >/dev/null ||
    { cl_fail "tandem model synth failed"; cl_end; }
cl_router --heartbeat-ms 100 --heartbeat-timeout-ms 1000
cl_node prefill p0
cl_node decode d0 --log-level info # its line saying what it dropped
cl_wait_nodes 1 1

# forgotten NAME ROLE: NAME's stream, its stop, the drop, and NAME's SIGTERM
forgotten() {
    local name=$1 role=$2 f k t0 dt rc pid=${CL_PID[$1]}
    echo "== $name ($role)"
    "$CL_PY" "$CL_TOOL" forgotten "$CL_GW" "$pid" 3 $MAXTOK "${CL_MURL[$name]}" 2 "$CL_T/$name.forgotten" "$role" \
        >"$CL_T/$name.forgotten.log" 2>&1 &
    f=$!
    CL_BG+=($f)
    cl_wait_line "$CL_T/$name.forgotten" '^(dropped|not dropped)' 60 || cl_fail "$name was never stopped"
    cat "$CL_T/$name.forgotten"
    grep -q '^dropped' "$CL_T/$name.forgotten" || cl_fail "$name kept the sequence the router forgot"
    grep -E 'the router (answered|dropped)' "$CL_T/$name.err" | tail -2
    grep -q 'dropping what it ran for it: sequences 1,' "$CL_T/$name.err" || cl_fail "$name did not log what it dropped"
    t0=$(date +%s.%N)
    cl_kill "$name" TERM
    for ((k = 0; k < 100; k++)); do _cl_dead "$pid" && break; sleep 0.05; done
    dt=$(echo "$(date +%s.%N) - $t0" | bc)
    echo "$name: SIGTERM to exit $dt s ($(grep -o 'drained in .*' "$CL_T/$name.err"))"
    if _cl_dead "$pid"; then
        wait "$pid"; rc=$?
        [ $rc -eq 0 ] || cl_fail "$name exited $rc on SIGTERM, want 0"
        (( $(echo "$dt > 2" | bc) )) && cl_fail "$name took $dt s to end after SIGTERM, want 2 s at most"
    else
        cl_fail "$name did not end within 5 s of SIGTERM"
    fi
    CL_PID[$name]= CL_MURL[$name]=
    wait $f || cl_fail "the stream: $(cat "$CL_T/$name.forgotten.log")"
    cat "$CL_T/$name.forgotten.log"
}
forgotten d0 decode
# the same for a unified node (the same code, without a data plane), alone beside p0 now
cl_node unified u0 --log-level info
cl_wait_line "$CL_T/router.out" '^nodes: .* 1 unified' 30 || cl_fail "the router did not see u0"
forgotten u0 unified
cl_end "a decode node and a unified node the router dropped drop their sequences, and end at once on SIGTERM"
