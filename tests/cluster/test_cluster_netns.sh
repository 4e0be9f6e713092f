#!/bin/bash
# test_cluster_netns: the cluster across network namespaces. The router, the prefill node
# and the decode node each run in their own namespace (`ip netns exec`), each joined by a
# veth pair to a bridge in a fourth namespace, where the client runs; nothing shares a
# loopback, so gRPC (client → router, router ↔ nodes) and the UCX KV transfer (prefill →
# decode, UCX_TLS=tcp: two namespaces on one host are one node to UCX, and only tcp
# crosses a veth) all go over the veths. Each process runs from the example config that
# deploy/systemd ships (`--config`: router.conf, prefill.conf, decode.conf; what is shipped
# is what runs multi-host), with only this test's addresses, model, files and sizes
# substituted: it listens on 0.0.0.0 with the shipped ports and advertises its veth address,
# the control plane is signed with a cluster secret and the gateway wants an API key. The
# same generations as `tandem generate --model` on this machine
# (greedy prompts and a seeded sampled one) must come out, and every process must exit 0
# on SIGTERM (the nodes drain first). Creates and removes every namespace and link; skips visibly without root,
# `ip netns` or stories260K.
set -u
MODELS="${TANDEM_TEST_MODELS:-$(dirname "$0")/../../../shared/models}"
M="$MODELS/stories260K/stories260K.bin"
BIN="${TANDEM_BIN:?TANDEM_BIN must point at the tandem binary}"
if [ ! -f "$M" ]; then echo "SKIP: $M absent (set TANDEM_TEST_MODELS)"; exit 77; fi
if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null; then
    echo "SKIP: needs root and iproute2 (ip netns) to create network namespaces"; exit 77
fi
NS=tdc$$
NSR=${NS}r NSP=${NS}p NSD=${NS}d NSB=${NS}b   # router, prefill, decode, bridge (+ client)
if ! ip netns add "$NSB" 2>/dev/null; then
    echo "SKIP: cannot create a network namespace (ip netns add failed: no privilege here)"; exit 77
fi
T=$(mktemp -d)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    for p in "${PIDS[@]}"; do
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null
        wait "$p" 2>/dev/null
    done
    for n in "$NSR" "$NSP" "$NSD" "$NSB"; do ip netns del "$n" 2>/dev/null; done
    rm -rf "$T"
}
trap cleanup EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }

# a bridge in $NSB; per node: a veth named tdc0 in its namespace, its peer on the bridge
NET=10.79.0
ip -n "$NSB" link add br0 type bridge && ip -n "$NSB" link set br0 up && ip -n "$NSB" link set lo up &&
    ip -n "$NSB" addr add "$NET.254/24" dev br0 || { bad "cannot create the bridge"; exit 1; }
i=1
for n in "$NSR" "$NSP" "$NSD"; do
    ip netns add "$n" &&
        ip link add tdc0 netns "$n" type veth peer name "v$i" netns "$NSB" &&
        ip -n "$NSB" link set "v$i" master br0 && ip -n "$NSB" link set "v$i" up &&
        ip -n "$n" addr add "$NET.$i/24" dev tdc0 && ip -n "$n" link set tdc0 up &&
        ip -n "$n" link set lo up || { bad "cannot set up namespace $n"; exit 1; }
    i=$((i + 1))
done

# UCX: tcp only, on the veth (named alike in every namespace)
export UCX_TLS=tcp UCX_NET_DEVICES=tdc0 UCX_SOCKADDR_TLS_PRIORITY=tcp UCX_TCP_CM_REUSEADDR=y \
    UCX_WARN_UNUSED_ENV_VARS=n UCX_HANDLE_ERRORS=none

# the shipped example configs with this test's values (a key the test does not know stays
# as shipped; a line that no longer matches fails below: the file changed under the test)
D="$(dirname "$0")/../../deploy/systemd"
(umask 077; openssl rand -hex 32 >"$T/secret"; openssl rand -hex 24 >"$T/keys")
conf() { # conf ROLE ADVERTISE: deploy/systemd/ROLE.conf for this test, into $T/ROLE.conf
    sed -e "s|^advertise = [^ ]*|advertise = $2|" -e "s|^xfer-host = [^ ]*|xfer-host = $2|" \
        -e "s|^router = [^ ]*|router = $NET.1:7070|" \
        -e "s|^model = [^ ]*|model = $M|" -e "s|^tokenizer = .*||" -e "s|^threads = [^ ]*|threads = 1|" \
        -e "s|^kv-mem = [^ ]*|kv-mem = 256|" -e "s|^log-level = [^ ]*|log-level = warn|" \
        -e "s|/etc/tandem/cluster-secret|$T/secret|" -e "s|/etc/tandem/api-keys|$T/keys|" "$D/$1.conf" >"$T/$1.conf"
    grep -q "^advertise = $2" "$T/$1.conf" && ! sed 's/#.*//' "$T/$1.conf" | grep -q '/etc/tandem\|/var/lib/tandem' ||
        { bad "deploy/systemd/$1.conf no longer has the lines this test fills in: $(cat "$T/$1.conf")"; exit 1; }
}
conf router "$NET.1"
conf prefill "$NET.2"
conf decode "$NET.3"
export TANDEM_API_KEY=$(cat "$T/keys")
ip netns exec "$NSR" "$BIN" router --config "$T/router.conf" >"$T/router.out" 2>"$T/router.err" &
RPID=$!
PIDS+=("$RPID")
for _ in $(seq 100); do grep -q '^metrics: ' "$T/router.out" && break; sleep 0.1; done
G=$(sed -n 's/^gateway: //p' "$T/router.out")
C=$(sed -n 's/^control: //p' "$T/router.out")
if [ -z "$G" ] || [ -z "$C" ]; then bad "the router did not start: $(cat "$T/router.err")"; exit 1; fi
[ "$C" = "$NET.1:7070" ] || bad "the router's control address is $C, router.conf says 7070"
ip netns exec "$NSP" "$BIN" prefill --config "$T/prefill.conf" --node-id prefill0 >"$T/prefill.out" 2>"$T/prefill.err" &
PPID_=$!
PIDS+=("$PPID_")
ip netns exec "$NSD" "$BIN" decode --config "$T/decode.conf" --node-id decode0 >"$T/decode.out" 2>"$T/decode.err" &
DPID=$!
PIDS+=("$DPID")
ready=0
for _ in $(seq 150); do
    grep -q 'nodes: 1 prefill, 1 decode' "$T/router.out" && { ready=1; break; }
    sleep 0.1
done
[ $ready -eq 1 ] || { bad "the nodes did not register within 15 s: $(cat "$T/router.err" "$T/prefill.err" "$T/decode.err")"; exit 1; }
grep -q "control $NET.2:" "$T/prefill.out" || bad "the prefill node does not advertise $NET.2: $(cat "$T/prefill.out")"
grep -q "control $NET.3:" "$T/decode.out" || bad "the decode node does not advertise $NET.3: $(cat "$T/decode.out")"
# the KV data plane (UCX) is not on every interface: decode.conf's xfer-host is its veth
# address, and the only wildcard listeners are its control and metrics ports (issue 35)
if command -v ss >/dev/null; then
    grep -q "^xfer-host = $NET.3" "$T/decode.conf" || bad "deploy/systemd/decode.conf has no xfer-host line"
    ip netns exec "$NSD" ss -Hltn | awk '{print $4}' | grep -q "^$NET.3:" ||
        bad "the decode node has no listener on $NET.3: $(ip netns exec "$NSD" ss -Hltn)"
    wild=$(ip netns exec "$NSD" ss -Hltn | awk '{print $4}' | grep -c '^0\.0\.0\.0:\|^\*:\|^\[::\]:')
    [ "$wild" -le 2 ] || bad "the decode node listens on 0.0.0.0 beyond control and metrics: $(ip netns exec "$NSD" ss -Hltn)"
fi

# gen IDS ARGS...: from the bridge namespace through the router; equal to local generate
gen() {
    local ids="$1"; shift
    local want got
    want=$("$BIN" generate --model "$M" --prompt-ids "$ids" --print-ids --threads 1 "$@" 2>/dev/null)
    got=$(ip netns exec "$NSB" "$BIN" generate --server "$G" --prompt-ids "$ids" --print-ids --timeout 20 "$@" \
        2>"$T/gen.err") || { bad "generate --server '$ids' $*: $(cat "$T/gen.err")"; return; }
    [ -n "$want" ] || { bad "local generate printed nothing for '$ids'"; return; }
    [ "$want" == "$got" ] || bad "prompt '$ids' $*: local '$want', across namespaces '$got'"
}
gen "1" --max-tokens 32
gen "1 403 407" --max-tokens 24
gen "1 $(seq -s ' ' 300 399)" --max-tokens 16
gen "1 200 300" --max-tokens 24 --temperature 0.8 --seed 11
grep -q 'transfer' "$T/gen.err" || bad "no timings from the router: $(cat "$T/gen.err")"
# the decode node, alone in its namespace, admitted every request: the KV it decoded from
# came over the veth from the prefill node
DM=$(sed -n 's/^decode decode0: .* metrics \(http[^ ]*\).*/\1/p' "$T/decode.out")
admits=$(ip netns exec "$NSB" /usr/bin/python3 -c '
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy inside the namespace
for line in opener.open(sys.argv[1], timeout=5).read().decode().splitlines():
    if line.startswith("tandem_decode_admits_total"):
        print(int(float(line.split()[-1])))' "$DM" 2>&1)
[ "$admits" == "4" ] || bad "decode node metrics at $DM: tandem_decode_admits_total '$admits', expected 4"

for p in "$PPID_" "$DPID" "$RPID"; do
    kill -TERM "$p"; wait "$p"; rc=$?
    [ $rc -eq 0 ] || bad "process $p exited $rc on SIGTERM"
done
PIDS=()
[ $fail -eq 0 ] && echo "PASS: router, prefill and decode in three network namespaces (veth + bridge, UCX over tcp), started from deploy/systemd's example configs, generate what local generate does"
exit $fail
