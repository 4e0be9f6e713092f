#!/bin/bash
# test_cluster_conditional: conditional disaggregation (docs/scheduling.md "Conditional
# disaggregation") and roles that follow the load ("Roles that follow the load"). A router with
# --prefill-policy follow (conditional, plus decode nodes prefilling for each other: with one
# decode node in 1. and 2. there is no peer, so those are conditional's placements exactly) and
# a 500 ms TPOT objective, one prefill node p0 and one decode node d0 of SmolLM2, one thread
# each. Where each prompt was prefilled is read from the router's
# tandem_router_prefill_placement_total{where}.
#   1. While a stream runs on d0, long prompts (800 tokens: a chunk step of the decode node's
#      512-token budget takes ~1 s, past the objective) are prefilled on p0.
#   2. While p0 computes a 1500-token prompt (with prompt logprobs: only a prefill node
#      computes them, so it goes there whatever the policy), short prompts arriving
#      behind it are prefilled on d0 itself, in chunks beside the running stream.
#      One more short prompt with a TPOT objective of its own (1 ms, tighter than d0's steps)
#      goes to p0 instead, reason tpot.
#   3. A second decode node d1 joins and p0 drains away: with no prefill node, a stream is
#      prefilled on its decode node, which is SIGKILLed after 30 tokens: the stream moves,
#      prefilled again on the other, and ends with exactly the ids and logprobs of an
#      untouched run (cluster_faults.py migrate). A stream may be prefilled by the other decode
#      node (peer) instead of its own where that is sooner: counted with the local ones.
#   4. Roles that follow the load: the decode node left runs a stream; a fresh decode node d2
#      joins and is picked for a 200-token prompt (it runs nothing), but it has measured no
#      prefill rate yet while the busy one has: the busy one prefills it beside its stream
#      (a Prefill call for d2's lease, KV over td_xfer: placement peer, its
#      tandem_decode_peer_prefills_total), and d2 decodes it.
# Every output equals `tandem generate`'s (greedy). Under the sanitizers (about 20x slower)
# the prompts, outputs and objective are scaled so that the same chunk steps stay on the same
# side of it. Skips without the GGUF or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init_gguf
# HB_TIMEOUT (the router's default, 1.5 s) is shorter than the $BUSY-token prompt's one step
# on p0 (2-15 s on a loaded 2-core machine): a heartbeat that waited for the step would drop
# p0 (checked in 2.)
LONG=800 BUSY=1500 TPOT=500 STREAM_TOK=300 MAXTOK=120 AFTER=30 HB_TIMEOUT=1500
if [ "${TD_SANITIZE:-OFF}" = ON ]; then
    # a 400-token prompt is one step of ~35 s on a loaded machine, and p0's heartbeats once
    # lapsed past 5 s during it: heartbeats run on the node's loop thread, not its compute
    # thread, so that was the loaded machine's (an -O0 loop thread on 2 shared cores), not the
    # step's; the bound here is for such a machine
    LONG=400 BUSY=400 TPOT=5000 STREAM_TOK=40 MAXTOK=30 AFTER=8 HB_TIMEOUT=20000
fi
# a killed node is seen at once (its connections close); the heartbeat bound only has to
# survive a loaded machine (a sanitizer build's steps of a second and more)
cl_cluster 1 --prefill-policy follow --tpot-objective-ms $TPOT --heartbeat-ms 100 --heartbeat-timeout-ms $HB_TIMEOUT \
    --max-migrations 2 --log-level debug # debug: each pick's estimates, shown when a check fails

# placed WHERE: prompts prefilled there so far (local: on the decode node, remote: on p0)
placed() {
    local v
    v=$(cl_metric router tandem_router_prefill_placement_total "where=$1" 2>/dev/null) || v=0
    echo "${v%.*}"
}
# ids N SEED: N pseudo-random prompt ids
ids() {
    "$CL_PY" -c "import random; r = random.Random($2); print(' '.join(str(r.randrange(100, 49000)) for _ in range($1)))"
}
# gen NAME MAX_TOKENS IDS [FLAGS...]: `tandem generate` through the router, in the background
# (its pid in $GEN_PID); check NAME compares its ids with `tandem generate --model`'s
gen() {
    local name=$1 max=$2 p=$3; shift 3
    echo "$p" >"$CL_T/$name.prompt"
    timeout 300 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$p" --max-tokens "$max" --print-ids --timeout 280 \
        "$@" >"$CL_T/$name.ids" 2>"$CL_T/$name.gerr" &
    GEN_PID=$!
    CL_BG+=("$GEN_PID")
}
check() {
    local name=$1 max=$2 want got
    got=$(head -1 "$CL_T/$name.ids")
    want=$(cl_ref "$max" "$(cat "$CL_T/$name.prompt")")
    [ -n "$got" ] && [ "$got" = "$want" ] ||
        cl_fail "$name: the router's ids differ from tandem generate's: want '$want' got '$got' ($(tail -1 "$CL_T/$name.gerr"))"
}
STREAM="1 30 31 32 33 34 35 36 37 38 39 40" # greedy: no EOS within 300 tokens
# stream NAME: a long greedy stream through the router, running on a decode node on return
stream() {
    gen "$1" $STREAM_TOK "$STREAM"
    STREAM_PID=$GEN_PID
    "$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[d0]}" tandem_decode_running_sequences ">=" 1 60 >/dev/null ||
        cl_fail "the stream $1 did not start running on d0"
}

echo "== 1. long prompts while a stream runs on d0: prefilled on p0"
stream s1
l0=$(placed local) r0=$(placed remote)
for k in 1 2; do
    gen long$k 4 "$(ids $LONG $k)"
    wait $GEN_PID || cl_fail "long$k: $(tail -1 "$CL_T/long$k.gerr")"
    check long$k 4
    grep -q 'prefill [0-9.]* ms on a prefill node' "$CL_T/long$k.gerr" ||
        cl_fail "long$k: the timing line does not say a prefill node: $(grep '^server:' "$CL_T/long$k.gerr")"
done
l1=$(placed local) r1=$(placed remote)
echo "long prompts ($LONG tokens): local $((l1 - l0)), remote $((r1 - r0))"
[ $((r1 - r0)) = 2 ] && [ $((l1 - l0)) = 0 ] || {
    cl_fail "the $LONG-token prompts were not both prefilled on p0; the router's picks:"
    grep 'prompt tokens prefilled' "$CL_T/router.err" | tail -3
}
wait $STREAM_PID || cl_fail "s1: $(tail -1 "$CL_T/s1.gerr")"
check s1 $STREAM_TOK

echo "== 2. short prompts behind a $BUSY-token prompt on p0: prefilled on d0"
stream s2
r0=$(placed remote) l0=$(placed local)
gen busy 2 "$(ids $BUSY 7)" --logprobs 0 --prompt-logprobs
BUSY_PID=$GEN_PID
"$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[router]}" tandem_router_prefill_placement_total ">=" $((r0 + l0 + 1)) 30 \
    >/dev/null || cl_fail "the $BUSY-token prompt was not placed"
pids=()
for k in 1 2 3 4; do
    gen short$k 8 "$(ids $((3 + k)) $((20 + k)))"
    pids+=("$GEN_PID")
done
# then a request with a TPOT objective of its own (GenerateRequest.tpot_objective_ms) tighter
# than d0's steps: no chunk fits beside its streams, so it waits for p0 (reason tpot) whatever
# the router's objective
"$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[router]}" tandem_router_prefill_placement_total ">=" $((r0 + l0 + 5)) 30 \
    >/dev/null || cl_fail "the 4 short prompts were not placed"
tight0=$(cl_metric router tandem_router_prefill_placement_total "where=remote,reason=tpot" 2>/dev/null) || tight0=0
gen tight 8 "$(ids 5 40)" --tpot-objective-ms 1
TIGHT_PID=$GEN_PID
for k in 1 2 3 4; do
    wait "${pids[$((k - 1))]}" || cl_fail "short$k: $(tail -1 "$CL_T/short$k.gerr")"
    check short$k 8
done
l1=$(placed local) r1=$(placed remote)
tight1=$(cl_metric router tandem_router_prefill_placement_total "where=remote,reason=tpot" 2>/dev/null) || tight1=0
r1=$((r1 - ${tight1%.*} + ${tight0%.*})) # the tight one, if p0 took it already
echo "the $BUSY-token prompt and 4 short ones: local $((l1 - l0)), remote $((r1 - r0))"
[ $((l1 - l0)) = 4 ] && [ $((r1 - r0)) = 1 ] || {
    cl_fail "want the 4 short prompts prefilled on d0 and the $BUSY-token one on p0; the router's picks:"
    grep 'prompt tokens prefilled' "$CL_T/router.err" | tail -5
}
grep -q 'prefill [0-9.]* ms on the decode node' "$CL_T/short1.gerr" ||
    cl_fail "short1: the timing line does not say the decode node: $(grep '^server:' "$CL_T/short1.gerr")"
p=$(cl_metric d0 tandem_decode_prefill_tokens_total | cut -d. -f1)
[ "$p" -ge 4 ] || cl_fail "d0 counts $p prompt tokens prefilled itself"
wait $BUSY_PID || cl_fail "busy: $(tail -1 "$CL_T/busy.gerr")"
check busy 2
wait $TIGHT_PID || cl_fail "tight: $(tail -1 "$CL_T/tight.gerr")"
check tight 8
tight1=$(cl_metric router tandem_router_prefill_placement_total "where=remote,reason=tpot" 2>/dev/null) || tight1=0
[ $((${tight1%.*} - ${tight0%.*})) = 1 ] || {
    cl_fail "the short prompt with a 1 ms TPOT objective was not sent to p0 for its objective; the router's picks:"
    grep 'prompt tokens prefilled' "$CL_T/router.err" | tail -3
}
# heartbeats do not wait for compute: p0 kept its place through the prompt's one long step
busy_ms=$(sed -n 's/.*| prefill \([0-9]*\)\.[0-9]* ms on a prefill node.*/\1/p' "$CL_T/busy.gerr")
echo "the $BUSY-token prompt: one step of ${busy_ms:-?} ms on p0 (heartbeat bound $HB_TIMEOUT ms)"
! grep -q 'node p0 missed heartbeats' "$CL_T/router.err" || cl_fail "the router dropped p0 during its ${busy_ms:-?} ms step"
[ "$(cl_metric router tandem_router_prefill_nodes_up | cut -d. -f1)" = 1 ] || cl_fail "the router lost p0 during its step"
wait $STREAM_PID || cl_fail "s2: $(tail -1 "$CL_T/s2.gerr")"
check s2 $STREAM_TOK

echo "== 3. no prefill node left: streams prefilled on their decode node, one's node SIGKILLed after $AFTER tokens: it moves"
cl_node decode d1
cl_wait_nodes 1 2
echo "$STREAM|$(cl_ref $MAXTOK "$STREAM")" >"$CL_T/mig"
[ "$(cut -d'|' -f2 "$CL_T/mig" | wc -w)" -gt $((AFTER + 10)) ] || cl_fail "the stream's reference is too short"
cl_kill p0 TERM # it drains (routed nothing new at its next heartbeat) and exits
"$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[router]}" tandem_router_prefill_nodes_up == 0 $((HB_TIMEOUT / 1000 + 30)) >/dev/null ||
    cl_fail "the router still counts p0 after its SIGTERM"
l0=$(( $(placed local) + $(placed peer) )) r0=$(placed remote)
live="d0=${CL_PID[d0]}=${CL_MURL[d0]},d1=${CL_PID[d1]}=${CL_MURL[d1]}"
"$CL_PY" "$CL_TOOL" migrate "$CL_GW" $MAXTOK "$CL_T/mig" greedy $AFTER serving "$live" moved >"$CL_T/mig.log" 2>&1 ||
    CL_FAIL=1
cat "$CL_T/mig.log"
for name in $(sed -n 's/^killed //p' "$CL_T/mig.log"); do CL_KILLED[$name]=1; done
l1=$(( $(placed local) + $(placed peer) )) r1=$(placed remote)
echo "the stream untouched, then killed and moved: local or peer $((l1 - l0)), remote $((r1 - r0))"
[ $((l1 - l0)) = 3 ] && [ $((r1 - r0)) = 0 ] || {
    cl_fail "want the untouched stream, the killed one and its move prefilled on their decode nodes; the router's picks:"
    grep 'prompt tokens prefilled' "$CL_T/router.err" | tail -5
}
m=$(cl_metric router tandem_router_migrations_total)
[ "${m%.*}" = 1 ] || cl_fail "tandem_router_migrations_total is $m, want 1"

echo "== 4. a fresh decode node's prompt prefilled by the busy one (peer), beside its stream"
busy=d0
[ "${CL_KILLED[d0]:-0}" = 1 ] && busy=d1
# a prompt of its own first, so that it has measured its prefill rate (the fit's chunks)
gen warm 2 "$(ids 100 50)"
wait $GEN_PID || cl_fail "warm: $(tail -1 "$CL_T/warm.gerr")"
check warm 2
gen s4 $STREAM_TOK "$STREAM"
STREAM_PID=$GEN_PID
"$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[$busy]}" tandem_decode_running_sequences ">=" 1 60 >/dev/null ||
    cl_fail "the stream s4 did not start running on $busy"
cl_node decode d2
cl_wait_nodes 0 2
p0=$(placed peer) k0=$(cl_metric $busy tandem_decode_peer_prefills_total | cut -d. -f1)
gen peer 4 "$(ids 200 60)"
wait $GEN_PID || cl_fail "peer: $(tail -1 "$CL_T/peer.gerr")"
check peer 4
p1=$(placed peer) k1=$(cl_metric $busy tandem_decode_peer_prefills_total | cut -d. -f1)
echo "the 200-token prompt: placed peer $((p1 - p0)), prefilled by $busy for another node's lease $((k1 - k0)): $(sed -n 's/^server:.*| \(prefill [0-9.]* ms on [^|]*\)|.*/\1/p' "$CL_T/peer.gerr")"
[ $((p1 - p0)) = 1 ] && [ $((k1 - k0)) = 1 ] || {
    cl_fail "want the 200-token prompt of d2 prefilled on $busy; the router's picks:"
    grep 'prompt tokens prefilled' "$CL_T/router.err" | tail -3
}
grep -q "prefill [0-9.]* ms on another decode node .* prefill node $busy, decode node d2" "$CL_T/peer.gerr" ||
    cl_fail "peer: the timing line does not say $busy prefilled it for d2: $(grep '^server:' "$CL_T/peer.gerr")"
wait $STREAM_PID || cl_fail "s4: $(tail -1 "$CL_T/s4.gerr")"
check s4 $STREAM_TOK
cl_end "conditional: long prompts prefilled on the prefill node, short ones behind a busy prefill node on the decode node, without a prefill node a locally prefilled stream moved when its node was killed; follow: a busy decode node prefilled a fresh one's prompt beside its stream; every output equal to tandem generate"
