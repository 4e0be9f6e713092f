#!/bin/bash
# test_cluster_advertise: --host is where a process listens, --advertise where its peers reach
# it. A router, a prefill and a decode node all listening on 0.0.0.0 with --advertise 127.0.0.1
# serve generations equal to `tandem generate`; the nodes register 127.0.0.1:PORT (router log),
# the prefill node pushes KV to the decode node's UCX listener at 127.0.0.1 (its transfer
# descriptor carries the advertised address, not 0.0.0.0), and every banner names 127.0.0.1.
# A wildcard --host without --advertise is refused at startup (exit 2) with a message naming
# --advertise, for each of the three; a non-loopback --host without --cluster-secret-file is
# refused (exit 2, naming the secret and --insecure) unless --insecure, which then warns at
# start (the processes here run so). Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init

# refused: a wildcard host and no --advertise, or a wildcard --advertise
for args in "router --host 0.0.0.0" "prefill --model $CL_M --host 0.0.0.0" "decode --model $CL_M --host 0.0.0.0" \
    "decode --model $CL_M --host :: " "decode --model $CL_M --host 0.0.0.0 --advertise 0.0.0.0"; do
    # shellcheck disable=SC2086
    timeout 20 "$CL_BIN" $args >"$CL_T/refuse.out" 2>"$CL_T/refuse.err"
    rc=$?
    if [ $rc -ne 2 ]; then
        cl_fail "'tandem $args' exited $rc, want 2 (refused)"
    elif ! grep -q -- '--advertise' "$CL_T/refuse.err"; then
        cl_fail "'tandem $args' was refused without naming --advertise: $(head -c 300 "$CL_T/refuse.err")"
    else
        echo "refused: tandem $args: $(head -n 1 "$CL_T/refuse.err")"
    fi
done

# refused: a non-loopback --host without a cluster secret, unless --insecure (the control
# plane would be open to anyone who reaches the address)
for args in "router --host 0.0.0.0 --advertise 127.0.0.1" "decode --model $CL_M --host 0.0.0.0 --advertise 127.0.0.1" \
    "prefill --model $CL_M --host 0.0.0.0 --advertise 127.0.0.1 --check-config"; do
    # shellcheck disable=SC2086
    timeout 20 "$CL_BIN" $args >"$CL_T/refuse.out" 2>"$CL_T/refuse.err"
    rc=$?
    if [ $rc -ne 2 ]; then
        cl_fail "'tandem $args' (no secret) exited $rc, want 2 (refused)"
    elif ! grep -q -- '--cluster-secret-file' "$CL_T/refuse.err" || ! grep -q -- '--insecure' "$CL_T/refuse.err"; then
        cl_fail "'tandem $args' was refused without naming --cluster-secret-file and --insecure: $(head -c 400 "$CL_T/refuse.err")"
    else
        echo "refused: tandem $args: $(head -n 1 "$CL_T/refuse.err")"
    fi
done

# --insecure: they start, each warning that its control plane is open
cl_router --host 0.0.0.0 --advertise 127.0.0.1 --log-level info --insecure
case $CL_GW in 127.0.0.1:*) ;; *) cl_fail "the router's banner names gateway '$CL_GW', want 127.0.0.1:PORT" ;; esac
cl_node prefill prefill0 --host 0.0.0.0 --advertise 127.0.0.1 --log-level info --insecure
cl_node decode decode0 --host 0.0.0.0 --advertise 127.0.0.1 --insecure
cl_wait_nodes 1 1
for n in router prefill0 decode0; do
    grep -q 'INSECURE: the control plane on 0.0.0.0 is open' "$CL_T/$n.err" ||
        cl_fail "$n started with --insecure and no secret without warning: $(head -c 300 "$CL_T/$n.err")"
done
for n in prefill0 decode0; do
    case ${CL_MURL[$n]} in http://127.0.0.1:*) ;; *) cl_fail "$n's banner names /metrics '${CL_MURL[$n]}'" ;; esac
done

for p in "1" "1 403 407" "5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21"; do echo "$p|$(cl_ref 24 "$p")"; done >"$CL_T/refs"
cl_py run "$CL_GW" 24 "$CL_T/refs"

for n in prefill0 decode0; do
    grep -q "node $n ([a-z]*) registered at 127\.0\.0\.1:[0-9]" "$CL_T/router.err" ||
        cl_fail "the router's log has no 'node $n ... registered at 127.0.0.1:PORT': $(grep -h 'registered at' "$CL_T/router.err" | head -3)"
done
grep -q 'registered at 0\.0\.0\.0' "$CL_T/router.err" && cl_fail "a node registered a wildcard address"
grep -q 'xfer peer 127\.0\.0\.1:[0-9]*: kv by' "$CL_T/prefill0.err" ||
    cl_fail "the prefill node did not reach the decode node's UCX listener at 127.0.0.1: $(grep -h 'xfer peer' "$CL_T/prefill0.err" | head -3)"
grep -q 'xfer peer 0\.0\.0\.0' "$CL_T/prefill0.err" && cl_fail "the decode node published a wildcard UCX address"

cl_end "nodes listening on 0.0.0.0 advertise 127.0.0.1 and serve 3 generations equal to local generate; wildcard without --advertise refused; no secret off loopback refused unless --insecure, warned"
