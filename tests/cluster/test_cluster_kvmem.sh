#!/bin/bash
# test_cluster_kvmem: KV pools sized from memory, and the machine shared by `tandem local`
# (issue 12). A node asked for a pool it cannot have (--kv-mem ten times the machine's
# memory) exits non-zero before it registers, saying the size and the flag to lower; a node
# with default flags prints its pool line (blocks, tokens, bytes and how kv-mem was chosen)
# and serves; `tandem local` prints the compute threads per node (cores / nodes) and the
# one KV budget it split among its nodes, which the nodes' pool lines name as --kv-mem.
# Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init

CL_ROUTER=r0
cl_router --log-level info
big=$(awk '/^MemTotal:/ {print int($2 / 1024) * 10}' /proc/meminfo)
for role in decode prefill; do
    timeout 60 "$CL_BIN" "$role" --model "$CL_M" --router "$CL_CTL" --node-id "big$role" --threads 1 \
        --kv-mem "$big" >"$CL_T/big.out" 2>"$CL_T/big.err"
    rc=$?
    if [ $rc -eq 0 ] || [ $rc -ge 124 ]; then
        cl_fail "$role --kv-mem $big (10x MemTotal) exited $rc, want a non-zero exit of its own"
    elif ! grep -q -- '--kv-mem .* more than .* of memory available: lower --kv-mem' "$CL_T/big.err"; then
        cl_fail "$role --kv-mem $big: no message naming the size and --kv-mem: $(head -c 400 "$CL_T/big.err")"
    else
        echo "refused ($rc): $role --kv-mem $big: $(grep -m1 -- '--kv-mem' "$CL_T/big.err")"
    fi
    grep -q "^$role big$role: control" "$CL_T/big.out" && cl_fail "$role --kv-mem $big printed its banner"
done

cl_node decode d0
cl_node prefill p0
cl_wait_nodes 1 1
grep -q 'node big' "$CL_T/r0.err" && cl_fail "a node without its pool reached the router: $(grep 'node big' "$CL_T/r0.err")"
pool='kv pool [0-9]+ blocks x [0-9]+ tokens = [0-9]+ tokens, [0-9.]+ [KMGT]?i?B \(.*kv-mem [0-9.]+ [KMGT]iB: [0-9]+% of [0-9.]+ [KMGT]iB available\)'
for n in "decode d0" "prefill p0"; do
    line=$(grep -E "^$n: kv pool" "$CL_T/${n#* }.err")
    if [[ $line =~ ^$n:\ $pool$ ]]; then echo "$line"; else cl_fail "$n: no pool line with the default budget: '$line'"; fi
done
cl_concurrent_equal 8 "1 403 407"

# tandem local: threads = cores / nodes (at least 1), one memory budget split among the nodes
cl_local 1 1
cores=$(nproc)
want=$((cores / 2)); [ $want -ge 1 ] || want=1
grep -q "^tandem local: $cores cores, 2 nodes: $want compute threads\? each$" "$CL_T/local.err" ||
    cl_fail "tandem local did not say '$cores cores, 2 nodes: $want compute thread(s) each': $(grep -m3 '^tandem local' "$CL_T/local.err")"
grep -E "^tandem local: kv-mem [0-9.]+ [KMGT]iB \([0-9]+% of [0-9.]+ [KMGT]iB available\) for 1 decode and 1 prefill node: .* per decode node, .* per prefill node" \
    "$CL_T/local.err" || cl_fail "tandem local did not say its KV budget: $(grep -m3 '^tandem local' "$CL_T/local.err")"
for n in "decode decode0" "prefill prefill0"; do
    grep -E "^$n: kv pool .*kv-mem [0-9.]+ [KMGT]iB: --kv-mem\)$" "$CL_T/local.err" ||
        cl_fail "$n of tandem local does not size its pool from the --kv-mem given: $(grep "^$n: kv pool" "$CL_T/local.err")"
done
cl_concurrent_equal 8 "1 403 407"

cl_end "a pool beyond memory is refused before registration; default pools and tandem local's shares are printed and serve"
