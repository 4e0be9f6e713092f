#!/bin/bash
# test_cluster_fd_limit: a router under a low open-file limit (ulimit -n 900) cuts its gateway
# connection caps to fit it, keeping descriptors for the control plane, and says so; then
# 1,100 idle h2c connections to the gateway (preface and SETTINGS, never a stream) neither
# take its descriptors nor lock anyone out: the idle ones are closed to make room, a new
# client is served, and a prefill and a decode node register and serve a request equal to
# `tandem generate` (issue 35: ~1000 idle connections exhausted the default soft limit of
# 1024, after which clients were dropped silently and restarted nodes could not register).
# Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
CL_ROUTER=router
o="$CL_T/router.out"
cl_spawn router bash -c "ulimit -n 900 && exec \"\$0\" router --log-level warn" "$CL_BIN"
cl_wait_line "$o" '^metrics: ' 30 || { cl_fail "the router did not start"; cl_dump; exit 1; }
CL_GW=$(sed -n 's/^gateway: //p' "$o")
CL_CTL=$(sed -n 's/^control: //p' "$o")
CL_MURL[router]=$(sed -n 's/^metrics: //p' "$o")
CL_ROLE[router]=router
grep -q 'open-file limit 900: gateway connections cut to' "$CL_T/router.err" ||
    cl_fail "no line saying the gateway caps were cut to the open-file limit: $(head -3 "$CL_T/router.err")"

# 1,100 idle h2c connections, held open while nodes register and a client calls
"$CL_PY" - "$CL_GW" 1100 >"$CL_T/idle.log" 2>&1 <<'PY' &
import socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
socks = []
for _ in range(int(sys.argv[2])):
    try:
        s = socket.create_connection((host, int(port)), timeout=2)
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        socks.append(s)
    except OSError as e:
        print("connect:", e)
        break
print("opened", len(socks), flush=True)
time.sleep(30)
PY
IDLE=$!
cl_wait_line "$CL_T/idle.log" '^opened' 60 || cl_fail "the idle connections were not opened: $(cat "$CL_T/idle.log")"
cat "$CL_T/idle.log"
cl_node prefill p0
cl_node decode d0
cl_wait_nodes 1 1
cl_refs short 8 40
"$CL_PY" "$CL_TOOL" run "$CL_GW" 8 "$CL_T/short" || cl_fail "requests failed beside 1,100 idle connections"
fds=$(ls /proc/"${CL_PID[router]}"/fd 2>/dev/null | wc -l)
echo "router descriptors in use: $fds (limit 900)"
[ "$fds" -lt 900 ] || cl_fail "the router holds $fds descriptors, at its limit"
kill "$IDLE" 2>/dev/null
wait "$IDLE" 2>/dev/null
cl_end "a router under ulimit -n 900 cut its caps, kept its descriptors, and served nodes and clients beside 1,100 idle connections"
