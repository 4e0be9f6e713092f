#!/bin/bash
# test_cluster_drain: draining (docs/cluster.md "Draining"). A router, prefill nodes p0 and
# p1, decode nodes d0 and d1 started one by one.
# 1. 8 long streams (300 tokens) run across d0 and d1; once each has a token, d0 gets
#    SIGTERM: it answers readiness NOT_SERVING and liveness SERVING (grpc.health.v1) while
#    its streams run, 8 new requests all go to d1 (none to d0), every long stream ends OK
#    with all its tokens equal to `tandem generate`, the router's gauge says d0 drains
#    while it does, d0 exits 0 on its own, and the router then drops d0's series.
# 2. p0 is drained by `tandem drain` (the Node/Drain control RPC, signed with the cluster
#    secret): it exits 0, new requests go to p1. An unsigned Drain is refused.
# 3. 8 long streams on d1, drained by `tandem drain --timeout-ms 300`: d1 exits 0 anyway,
#    logging the timeout, and the streams it could not finish end UNAVAILABLE.
# The cluster runs with a cluster secret; the health checks go through without one.
# Before that, a registered node answers readiness SERVING, and an unknown health service
# NOT_FOUND. d1 is given its router by a name (--router LOCALHOST:PORT), resolved by the node.
# Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
# A 20M-parameter random model (~300 tokens/s on one thread), so that a stream of 300 tokens
# outlasts the checks made while its node drains; every long stream has the same prompt, so
# one `tandem generate` is its reference.
MAXTOK=300
HIDDEN=512 INTER=1408 LAYERS=6 HEADS=8
# the sanitizer build runs a model ~20x slower: a ~40x smaller one keeps the streams as long
[ "${TD_SANITIZE:-OFF}" = ON ] && HIDDEN=128 INTER=352 LAYERS=2 HEADS=4
CL_M="$CL_T/drainmodel"
cat >"$CL_T/config.json" <<EOF
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": $HIDDEN,
 "intermediate_size": $INTER, "num_hidden_layers": $LAYERS, "num_attention_heads": $HEADS,
 "num_key_value_heads": $HEADS, "vocab_size": 512, "max_position_embeddings": 1024,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
 "bos_token_id": 256, "eos_token_id": 257}
EOF
"$CL_BIN" model synth --arch llama --config "$CL_T/config.json" --seed 3 --out "$CL_M" >/dev/null ||
    { cl_fail "tandem model synth failed"; cl_end; }
(umask 077; openssl rand -hex 32 >"$CL_T/secret")
S=(--cluster-secret-file "$CL_T/secret")
cl_router --heartbeat-ms 100 --heartbeat-timeout-ms 1000 "${S[@]}"
cl_node prefill p0 "${S[@]}"
cl_node prefill p1 "${S[@]}"
cl_node decode d0 --max-batch 2 "${S[@]}" # its 4 streams in two rounds: they outlast the checks
# d1 finds its router by name (looked up like a Kubernetes Service's; LOCALHOST is not the
# literal 'localhost' that the client maps without a lookup)
CL_CTL="LOCALHOST:${CL_CTL##*:}" cl_node decode d1 "${S[@]}"
cl_wait_nodes 2 2
ctl() { sed -n "s/^$1 $2: control \([^ ]*\) metrics .*/\1/p" "$CL_T/$2.out"; }
D0=$(ctl decode d0) D1=$(ctl decode d1) P0=$(ctl prefill p0)
ref=$(cl_ref $MAXTOK "1 41")
for k in $(seq 8); do echo "1 41|$ref"; done >"$CL_T/long"
cl_refs short 32 60 77

# exited NAME SECONDS: waits for the process to exit by itself; fails unless it exits 0
exited() {
    local pid=${CL_PID[$1]} k rc
    for ((k = 0; k < $2 * 10; k++)); do _cl_dead "$pid" && break; sleep 0.1; done
    if ! _cl_dead "$pid"; then cl_fail "$1 did not exit within $2 s of its drain"; return; fi
    wait "$pid"; rc=$?
    CL_PID[$1]= CL_KILLED[$1]=1 # gone: cl_stop skips it, cl_idle does not read it
    echo "$1 exited $rc after its drain"
    [ $rc -eq 0 ] || cl_fail "$1 exited $rc after its drain, want 0"
}

echo "== health before any drain"
cl_py health "$D0" "" SERVING
cl_py health "$D0" liveness SERVING
"$CL_PY" "$CL_TOOL" health "$D0" no.such.Service NOT_FOUND || cl_fail "an unknown health service is not NOT_FOUND"

echo "== SIGTERM d0 while its streams run"
# the router's gauge says d0 drains while it does (watched from the start: once d0 has left,
# its series go with it)
(for _ in $(seq 300); do
    [ "$(cl_metric router tandem_router_node_draining node=d0 2>/dev/null)" = 1 ] && { : >"$CL_T/d0.drain_seen"; break; }
    sleep 0.05
done) &
watch=$!
t0=$(date +%s.%N)
cl_py drain "$CL_GW" "TERM:${CL_PID[d0]}" "$D0" tandem_decode_admits_total "${CL_MURL[d0]}" "${CL_MURL[d1]}" \
    "$CL_T/long" $MAXTOK "$CL_T/short" 32
exited d0 10
echo "d0: drain to exit $(echo "$(date +%s.%N) - $t0" | bc) s (streams included)"
wait $watch
[ -e "$CL_T/d0.drain_seen" ] || cl_fail "the router's tandem_router_node_draining{node=d0} never read 1 during the drain"
for _ in $(seq 100); do # gone: the router drops d0's series once it has left
    cl_metric router tandem_router_node_draining node=d0 >/dev/null 2>&1 || break
    sleep 0.1
done
cl_metric router tandem_router_node_draining node=d0 >/dev/null 2>&1 &&
    cl_fail "d0 left 10 s ago and the router still exports its tandem_router_node_draining series"
grep -q "drain timeout" "$CL_T/d0.err" && cl_fail "d0 hit its drain timeout: $(grep 'drain timeout' "$CL_T/d0.err")"

echo "== an unsigned Drain is refused"
if out=$("$CL_BIN" drain --node "$P0" --node-id p0 2>&1); then cl_fail "an unsigned Drain was accepted: $out"; fi
echo "$out"
echo "$out" | grep -q "refused the call" || cl_fail "tandem drain without the secret does not say it was refused: $out"

echo "== tandem drain p0 (idle)"
cl_py drain "$CL_GW" "exec:$CL_BIN drain --node $P0 --node-id p0 --cluster-secret-file $CL_T/secret" "$P0" \
    tandem_prefill_requests_total "${CL_MURL[p0]}" "${CL_MURL[p1]}" - 0 "$CL_T/short" 32
exited p0 10

echo "== tandem drain d1 with a 300 ms timeout while 8 long streams run there"
cl_py drain "$CL_GW" "exec:$CL_BIN drain --node $D1 --node-id d1 --cluster-secret-file $CL_T/secret --timeout-ms 300" \
    "$D1" tandem_decode_admits_total "${CL_MURL[d1]}" "${CL_MURL[d1]}" "$CL_T/long" $MAXTOK - 0 300
exited d1 10
grep -q "drain timeout" "$CL_T/d1.err" || cl_fail "d1 exited without its drain timeout line"
grep "drain timeout" "$CL_T/d1.err"
cl_end "a drained decode node finished its streams exactly while new requests went elsewhere, turned NOT_SERVING and exited 0; tandem drain (signed Node/Drain) on a prefill node, unsigned refused; the drain timeout bounds the wait"
