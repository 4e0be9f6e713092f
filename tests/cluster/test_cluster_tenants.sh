#!/bin/bash
# test_cluster_tenants: key B learns nothing from key A's prefixes (issue 35, docs/security.md
# "Tenants"). Keys: A and A2 (tenant=team-a), B (a tenant of its own). A router on a fixed
# control port with a cluster secret, prefill p0 and decode d0. One long prompt P, through the
# gRPC gateway, usage.cached_tokens read from the last message:
# - A sends P twice: the second time its prefix is cached; B then sends P and hits nothing
#   (unsalted, B would see A's blocks); A2, A's tenant, hits; B again hits its own;
# - the router is restarted with the same secret: A's P still hits (the salts come from the
#   secret, so the nodes' caches stay useful) and a new key C, its own tenant, misses;
# - restarted with --share-prefix-cache: A sends a new prompt Q, B sends Q and hits.
# Skips without stories260K or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
KA=tenant-a-0123456789abcdef0123456789abcdef
KA2=tenant-a2-0123456789abcdef0123456789abcdef
KB=tenant-b-0123456789abcdef0123456789abcdef
KC=tenant-c-0123456789abcdef0123456789abcdef
printf '%s tenant=team-a\n%s tenant=team-a\n%s\n%s\n' "$KA" "$KA2" "$KB" "$KC" >"$CL_T/keys"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$CL_T/secret"
chmod 600 "$CL_T/keys" "$CL_T/secret"
PORT=$("$CL_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
ROUTER_FLAGS=(--control-port "$PORT" --heartbeat-ms 100 --heartbeat-timeout-ms 1000
              --cluster-secret-file "$CL_T/secret" --api-keys-file "$CL_T/keys")
cl_router "${ROUTER_FLAGS[@]}"
cl_node prefill p0 --cluster-secret-file "$CL_T/secret"
cl_node decode d0 --cluster-secret-file "$CL_T/secret"
cl_wait_nodes 1 1

# cached NAME KEY PROMPT WANT: one request of KEY with prompt P or Q; WANT "0" or "hit"
# (cached_tokens > 0): prints "NAME: cached_tokens N" and fails the test otherwise
cached() {
    local out
    out=$("$CL_PY" - "$CL_SRC" "$CL_GW" "$2" "$3" <<'EOF'
import sys
sys.path.insert(0, sys.argv[1] + "/tests/cluster")
import cluster_wire as w
gw, key, which = sys.argv[2:5]
seed = 37 if which == "P" else 53
ids = [1] + [2 + (i * seed) % 480 for i in range(199)]  # 200 tokens: 12 whole blocks of 16
usage = None
for m in w.generate_stub(w.channel(gw))(w.request(ids, 4), metadata=(("authorization", "Bearer " + key),),
                                        timeout=60):
    for f, v in w.fields(m):
        if f == 4:
            usage = dict(w.fields(v))
print(usage.get(3, 0) if usage is not None else "no usage")
EOF
    )
    echo "$1: cached_tokens $out"
    case $4 in
    0) [ "$out" = 0 ] || cl_fail "$1: cached_tokens $out, want 0" ;;
    hit) [[ $out =~ ^[0-9]+$ ]] && [ "$out" -gt 0 ] || cl_fail "$1: cached_tokens $out, want a hit" ;;
    esac
}

echo "== tenants kept apart"
cached "A first" "$KA" P 0
cached "A again" "$KA" P hit
cached "B, after A" "$KB" P 0
cached "A2, A's tenant" "$KA2" P hit
cached "B again" "$KB" P hit
[ $CL_FAIL -eq 0 ] || cl_end

# restart_router NAME FLAGS...: SIGKILL the router, start NAME on the same port, wait for p0, d0
restart_router() {
    local name=$1 i; shift
    CL_KILLED[$CL_ROUTER]=1
    kill -KILL "${CL_PID[$CL_ROUTER]}"
    for i in $(seq 300); do ss -tln | grep -q "127.0.0.1:$PORT " || break; sleep 0.1; done
    CL_ROUTER=$name
    cl_router "$@"
    CL_WAIT_NODES_S=15 cl_wait_nodes 1 1
}

echo "== a restarted router with the same secret: the same salts"
restart_router router2 "${ROUTER_FLAGS[@]}"
cached "A after the restart" "$KA" P hit
cached "C, a new tenant" "$KC" P 0

echo "== --share-prefix-cache: one cache for every key"
restart_router router3 "${ROUTER_FLAGS[@]}" --share-prefix-cache
cached "A, Q" "$KA" Q 0
cached "B, Q after A" "$KB" Q hit
cl_end "a key saw no hit on another tenant's prefix and a hit on its own tenant's, the salts held across a router restart, --share-prefix-cache shared the cache"
