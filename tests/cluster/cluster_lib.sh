# cluster_lib.sh: helpers shared by the tests/test_cluster_*.sh scripts (sourced; not a test
# itself). Starts `tandem local` or a router and nodes one by one on 127.0.0.1, reads their
# banners (addresses, /metrics URLs), keeps every pid, and on exit stops them all (SIGTERM,
# then SIGKILL after a bound) whatever happened. Sanitizer reports of any child process go to
# $CL_T/san.* (ASAN/UBSAN/LSAN log_path) and fail the test, as does a process that exits
# non-zero on SIGTERM or dies without the test killing it.
#
# Use: source it, call cl_init (skips without the model or grpcio), start processes (cl_local,
# or cl_router + cl_node + cl_wait_nodes, or cl_cluster for a router, p0 and decode nodes),
# call cl_fail for each failed check, end with cl_end "PASS line", which first checks the cluster is idle (cl_idle), stops every
# process, checks exits and sanitizer logs, and exits 0 or 1.
set -u
CL_M="${TANDEM_TEST_MODELS:-$(dirname "$0")/../../../shared/models}/stories260K/stories260K.bin"
CL_BIN="${TANDEM_BIN:?TANDEM_BIN must point at the tandem binary}"
CL_SRC="${TD_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}"
CL_PY=/usr/bin/python3
CL_TOOL="$CL_SRC/tests/cluster/cluster_faults.py"
CL_FAIL=0
CL_ROUTER=router     # the process name of the current router (set another before a restart)
CL_NAMES=()          # process names in start order
CL_BG=()             # background client pids (killed on exit)
declare -A CL_PID    # name → pid
declare -A CL_MURL   # name → /metrics URL
declare -A CL_ROLE   # name → router, prefill, decode or unified
declare -A CL_KILLED # name → 1 once the test killed it on purpose

# cl_need_gguf: exits 77 (skip) unless $TANDEM_TEST_GGUF is a file (SmolLM2, which
# scripts/test fetches); cl_init_gguf: that, cl_init, and CL_M set to it
cl_need_gguf() {
    if [ -z "${TANDEM_TEST_GGUF:-}" ] || [ ! -f "$TANDEM_TEST_GGUF" ]; then
        echo "SKIP: TANDEM_TEST_GGUF is not a file (scripts/fetch-model smollm2 fetches SmolLM2)"
        exit 77
    fi
}
cl_init_gguf() {
    cl_need_gguf
    cl_init
    CL_M="$TANDEM_TEST_GGUF"
}

cl_init() {
    if [ ! -f "$CL_M" ]; then echo "SKIP: $CL_M absent (set TANDEM_TEST_MODELS)"; exit 77; fi
    if ! "$CL_PY" -c 'import grpc' 2>/dev/null; then echo "SKIP: $CL_PY lacks grpc (python3-grpcio)"; exit 77; fi
    CL_T=$(mktemp -d)
    mkdir -p "$CL_T/ref"
    # children write sanitizer reports to files we check at the end (no-op in release builds)
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}log_path=$CL_T/san"
    export UBSAN_OPTIONS="${UBSAN_OPTIONS:+$UBSAN_OPTIONS:}print_stacktrace=1:log_path=$CL_T/san"
    export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$CL_SRC/tests/support/lsan.supp:print_suppressions=0}"
    export UCX_TCP_CM_REUSEADDR=y UCX_WARN_UNUSED_ENV_VARS=n
    trap cl_cleanup EXIT
}

cl_fail() {
    echo "FAIL: $*"
    CL_FAIL=1
}

# _cl_dead PID: true when the process is gone or a zombie
_cl_dead() {
    local s
    s=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) || return 0
    [ -z "$s" ] || [ "$s" = Z ]
}

# cl_spawn NAME CMD...: runs CMD in the background, stdout/stderr to $CL_T/NAME.out/.err
cl_spawn() {
    local name=$1; shift
    # truncate here, not in the child: a waiter must never read a previous run's banner
    : >"$CL_T/$name.out"
    : >"$CL_T/$name.err"
    "$@" >>"$CL_T/$name.out" 2>>"$CL_T/$name.err" &
    CL_PID[$name]=$!
    CL_NAMES+=("$name")
}

# cl_wait_line FILE REGEX SECONDS: waits until a line of FILE matches
cl_wait_line() {
    local i
    for ((i = 0; i < $3 * 10; i++)); do
        grep -qE "$2" "$1" 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}

# cl_router [FLAGS...]: starts a router named $CL_ROUTER; sets CL_GW, CL_CTL and
# CL_MURL[$CL_ROUTER]
cl_router() {
    local o="$CL_T/$CL_ROUTER.out"
    cl_spawn "$CL_ROUTER" "$CL_BIN" router --log-level warn "$@"
    cl_wait_line "$o" '^metrics: ' 30 || { cl_fail "the router did not start"; cl_dump; exit 1; }
    CL_GW=$(sed -n 's/^gateway: //p' "$o")
    CL_CTL=$(sed -n 's/^control: //p' "$o")
    [ -n "$CL_GW" ] && [ -n "$CL_CTL" ] || { cl_fail "no gateway/control address in the router's output"; cl_dump; exit 1; }
    CL_MURL[$CL_ROUTER]=$(sed -n 's/^metrics: //p' "$o")
    CL_ROLE[$CL_ROUTER]=router
}

# cl_node ROLE ID [FLAGS...]: starts a prefill/decode node registered with the router; the
# process is named ID, or $CL_NAME when set (a restart of a node under the same ID)
cl_node() {
    local role=$1 id=$2 name=${CL_NAME:-$2}; shift 2
    cl_spawn "$name" "$CL_BIN" "$role" --model "$CL_M" --router "$CL_CTL" --node-id "$id" --threads 1 \
        --log-level warn "$@"
    cl_wait_line "$CL_T/$name.out" "^$role $id: .* metrics " 60 || { cl_fail "node $id did not start"; cl_dump; exit 1; }
    CL_MURL[$name]=$(sed -n "s/^$role $id: .* metrics //p" "$CL_T/$name.out")
    CL_ROLE[$name]=$role
}

# cl_wait_nodes NP ND: waits until the router counts at least NP prefill and ND decode nodes
cl_wait_nodes() {
    local i line np nd
    for ((i = 0; i < ${CL_WAIT_NODES_S:-30} * 10; i++)); do
        line=$(grep '^nodes: ' "$CL_T/$CL_ROUTER.out" | tail -1)
        if [[ $line =~ ^nodes:\ ([0-9]+)\ prefill,\ ([0-9]+)\ decode ]]; then
            np=${BASH_REMATCH[1]}; nd=${BASH_REMATCH[2]}
            [ "$np" -ge "$1" ] && [ "$nd" -ge "$2" ] && return 0
        fi
        sleep 0.1
    done
    cl_fail "the router did not see $1 prefill + $2 decode nodes: ${line:-no nodes line}"
    cl_dump
    exit 1
}

# cl_local NP ND [FLAGS...]: `tandem local` (NP = ND = 0 with --unified U); sets CL_GW, CL_MURL[router] and CL_MURL[<node id>]
# from the node banners it passes to its stderr
cl_local() {
    local np=$1 nd=$2; shift 2
    cl_spawn local "$CL_BIN" local --model "$CL_M" --prefill "$np" --decode "$nd" "$@"
    cl_wait_line "$CL_T/local.out" '^metrics: ' 60 || { cl_fail "tandem local did not start"; cl_dump; exit 1; }
    CL_GW=$(sed -n 's/^gateway: //p' "$CL_T/local.out")
    [ -n "$CL_GW" ] || { cl_fail "no gateway address in tandem local's output"; cl_dump; exit 1; }
    CL_MURL[router]=$(sed -n 's/^metrics: //p' "$CL_T/local.out")
    CL_ROLE[router]=router
    local role id rest
    while read -r role id rest; do
        CL_MURL[${id%:}]=${rest##* }
        CL_ROLE[${id%:}]=$role
    done < <(grep -E '^(prefill|decode|unified) [^ ]+: control [^ ]+ metrics ' "$CL_T/local.err")
}

# cl_py SUBCOMMAND ARGS...: runs cluster_faults.py and shows its output (also in $CL_T/py.log);
# a non-zero exit fails the test
cl_py() {
    local rc
    "$CL_PY" "$CL_TOOL" "$@" >"$CL_T/py.log" 2>&1
    rc=$?
    cat "$CL_T/py.log"
    [ $rc -eq 0 ] || CL_FAIL=1
    return $rc
}

# cl_metric NAME_OF_PROCESS METRIC [LABEL=VALUE]: prints the value (sum of matching series)
cl_metric() {
    "$CL_PY" "$CL_TOOL" metric "${CL_MURL[$1]}" "$2" "${3:-}"
}

# cl_ref MAX_TOKENS "IDS": the ids `tandem generate` gives (computed once, cached in $CL_T/ref)
cl_ref() {
    local key
    key=$(printf '%s|%s' "$1" "$2" | md5sum | cut -c1-16)
    if [ ! -f "$CL_T/ref/$key" ]; then
        "$CL_BIN" generate --model "$CL_M" --prompt-ids "$2" --max-tokens "$1" --print-ids --threads 1 \
            >"$CL_T/ref/$key.tmp" 2>"$CL_T/ref/$key.err" || { echo "ERROR generate failed"; return; }
        mv "$CL_T/ref/$key.tmp" "$CL_T/ref/$key"
    fi
    cat "$CL_T/ref/$key"
}

# cl_concurrent_equal MAX_TOKENS "IDS"...: the prompts as concurrent greedy requests through a
# stock grpcio client (tests/cluster/cluster_client.py); each answer must equal cl_ref
cl_concurrent_equal() {
    local max=$1 i want got
    shift
    "$CL_PY" "$CL_SRC/tests/cluster/cluster_client.py" "$CL_GW" "$max" "$@" >"$CL_T/got" || cl_fail "client"
    local prompts=("$@")
    for i in "${!prompts[@]}"; do
        want=$(cl_ref "$max" "${prompts[$i]}")
        got=$(sed -n "$((i + 1))p" "$CL_T/got")
        [ "$want" = "$got" ] || cl_fail "prompt '${prompts[$i]}': want '$want' got '$got'"
    done
}

# cl_kv_bytes_equal: every KV byte the prefill nodes sent, the decode nodes received, and
# some were (td_xfer's counters on /metrics); and no data-plane message of theirs was
# rejected (each carried its lease's token, from the lease's owner: issue 35)
cl_kv_bytes_equal() {
    local name sent=0 recv=0 rej=0
    for name in "${!CL_ROLE[@]}"; do
        case ${CL_ROLE[$name]} in
        prefill) sent=$((sent + $(cl_metric "$name" tandem_kvxfer_sent_bytes_total | cut -d. -f1))) ;;
        decode) recv=$((recv + $(cl_metric "$name" tandem_kvxfer_received_bytes_total | cut -d. -f1)))
            rej=$((rej + $(cl_metric "$name" tandem_kvxfer_rejected_total | cut -d. -f1))) ;;
        esac
    done
    echo "kv bytes: prefill sent $sent, decode received $recv"
    [ "$sent" != 0 ] && [ "$sent" = "$recv" ] || cl_fail "KV bytes sent ($sent) and received ($recv) differ or are zero"
    [ "$rej" = 0 ] || cl_fail "the decode nodes rejected $rej data-plane messages of an honest cluster"
}

# cl_blocks_back NODE BASE WHAT [SECONDS]: the decode node's tandem_decode_kv_blocks_used
# returns to BASE within SECONDS (10) with no other request run meanwhile (the gauge follows
# every free: lease expiry and release too, not only decode steps)
cl_blocks_back() {
    local node=$1 base=$2 what=$3 v
    if v=$("$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[$node]}" tandem_decode_kv_blocks_used == "$base" "${4:-10}"); then
        echo "$node kv blocks used: back to $base after $what"
    else
        cl_fail "$node's used KV blocks did not return to $base after $what: $v"
    fi
}

# cl_cluster ND [ROUTER_FLAGS...]: a router with ROUTER_FLAGS, prefill node p0 and decode
# nodes d0..d<ND-1>, started one by one; returns once the router counts them all
cl_cluster() {
    local nd=$1 k; shift
    cl_router "$@"
    cl_node prefill p0
    for ((k = 0; k < nd; k++)); do cl_node decode "d$k"; done
    cl_wait_nodes 1 "$nd"
}

# cl_refs FILE MAX_TOKENS FIRST [TAIL]: writes 8 lines 'ids|ref ids' to $CL_T/FILE, prompt k
# (1..8) being '1 FIRST+k TAIL' and its reference `tandem generate` of MAX_TOKENS
cl_refs() {
    local k p
    for k in $(seq 8); do
        p="1 $(($3 + k))${4:+ $4}"
        echo "$p|$(cl_ref "$2" "$p")"
    done >"$CL_T/$1"
}

# cl_refs_of MAX_TOKENS: for every prompt line of $CL_T/prompts, 'ids|ref ids' into
# $CL_T/refs (cl_ref, two at a time: each runs one thread); a failed `tandem generate` ends
# the test
cl_refs_of() {
    local i=0 p
    while read -r p; do
        cl_ref "$1" "$p" >/dev/null &
        (( ++i % 2 == 0 )) && wait
    done <"$CL_T/prompts"
    wait
    while read -r p; do echo "$p|$(cl_ref "$1" "$p")"; done <"$CL_T/prompts" >"$CL_T/refs"
    if grep -q '|ERROR' "$CL_T/refs"; then cl_fail "tandem generate failed: $(cat "$CL_T"/ref/*.err | head -5)"; cl_end; fi
}

# cl_kill NAME SIGNAL: signals one process on purpose (its death is then not a failure)
cl_kill() {
    CL_KILLED[$1]=1
    kill "-$2" "${CL_PID[$1]}" 2>/dev/null
}

# cl_live_decodes: the decode nodes not killed, as NAME=PID=METRICS_URL,... (cluster_faults.py
# migrate and migratehttp take it)
cl_live_decodes() {
    local name out=()
    for name in "${!CL_ROLE[@]}"; do
        [ "${CL_ROLE[$name]}" = decode ] && [ -z "${CL_KILLED[$name]:-}" ] || continue
        out+=("$name=${CL_PID[$name]}=${CL_MURL[$name]}")
    done
    (IFS=,; echo "${out[*]}")
}

cl_dump() {
    local f
    for f in "$CL_T"/*.err; do
        [ -s "$f" ] || continue
        echo "--- $(basename "$f") (tail)"
        tail -n 15 "$f"
    done
}

# cl_idle: once no request runs, the router has none in flight, no live decode node runs or
# waits on a sequence or holds a transfer lease, and no live prefill node has a transfer in
# flight (within 10 s each): nothing leaked a request, a sequence, a lease or a transfer
cl_idle() {
    local name v
    for name in "${!CL_ROLE[@]}"; do
        [ -z "${CL_KILLED[$name]:-}" ] && [ -n "${CL_MURL[$name]:-}" ] || continue
        case ${CL_ROLE[$name]} in
        router)
            v=$("$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[$name]}" tandem_router_active_requests == 0 10) ||
                cl_fail "the router still has requests in flight when idle: $v" ;;
        decode)
            v=$("$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[$name]}" tandem_decode_running_sequences == 0 10) ||
                cl_fail "$name still runs sequences when idle: $v"
            v=$("$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[$name]}" tandem_decode_waiting_sequences == 0 10) ||
                cl_fail "$name still has waiting sequences when idle: $v"
            v=$("$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[$name]}" tandem_kvxfer_leases_live == 0 10) ||
                cl_fail "$name still holds KV transfer leases when idle: $v" ;;
        unified)
            for v in running_sequences waiting_sequences kv_blocks_used; do
                "$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[$name]}" "tandem_unified_$v" == 0 10 >/dev/null ||
                    cl_fail "$name: tandem_unified_$v is not 0 when idle"
            done ;;
        prefill)
            v=$("$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[$name]}" tandem_kvxfer_transfers_inflight == 0 10) ||
                cl_fail "$name still has KV transfers in flight when idle: $v" ;;
        esac
    done
}

# cl_stop: cl_idle, then SIGTERM to every process still running, newest first (nodes before the router);
# SIGKILL past 15 s; a non-zero exit of a process the test did not kill is a failure
cl_stop() {
    local i name pid rc k
    cl_idle
    CL_MURL=() CL_ROLE=()
    for ((i = ${#CL_NAMES[@]} - 1; i >= 0; i--)); do
        name=${CL_NAMES[$i]}; pid=${CL_PID[$name]}
        [ -n "$pid" ] || continue
        kill -TERM "$pid" 2>/dev/null
        for ((k = 0; k < 150; k++)); do _cl_dead "$pid" && break; sleep 0.1; done
        if ! _cl_dead "$pid"; then
            kill -KILL "$pid" 2>/dev/null
            [ -n "${CL_KILLED[$name]:-}" ] || cl_fail "$name (pid $pid) ignored SIGTERM for 15 s"
        fi
        wait "$pid" 2>/dev/null; rc=$?
        if [ -z "${CL_KILLED[$name]:-}" ] && [ $rc -ne 0 ]; then cl_fail "$name (pid $pid) exited $rc"; fi
        CL_PID[$name]=
    done
    if grep -q 'tandem local: process .* exited' "$CL_T/local.err" 2>/dev/null; then
        cl_fail "a node of tandem local died: $(grep 'tandem local: process' "$CL_T/local.err" | head -3)"
    fi
    local san
    san=$(ls "$CL_T"/san.* 2>/dev/null)
    if [ -n "$san" ] || grep -lE 'ERROR: (Address|Leak)Sanitizer|runtime error:' "$CL_T"/*.err >/dev/null 2>&1; then
        cl_fail "sanitizer reports from child processes:"
        for f in $san; do echo "--- $f"; head -n 40 "$f"; done
        grep -hE -A20 'ERROR: (Address|Leak)Sanitizer|runtime error:' "$CL_T"/*.err 2>/dev/null | head -n 60
    fi
}

cl_cleanup() {
    local name pid
    for pid in "${CL_BG[@]}"; do kill -KILL "$pid" 2>/dev/null; done
    for name in "${CL_NAMES[@]}"; do
        pid=${CL_PID[$name]}
        [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    done
    [ -n "${CL_T:-}" ] && rm -rf "$CL_T"
}

# cl_end "PASS message": stops everything, checks, prints PASS or exits 1
cl_end() {
    cl_stop
    if [ $CL_FAIL -ne 0 ]; then
        cl_dump
        exit 1
    fi
    echo "PASS: $*"
    exit 0
}
