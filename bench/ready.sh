#!/usr/bin/env bash
# ready.sh: time to ready and memory at idle, tandem beside llama-server on the same model
# in the same run (issue 34, docs/bench.md "Time to ready"). For each server, ROUNDS times
# warm (the model file in the page cache) and, with --cold, ROUNDS times cold (the page
# cache dropped first: needs root): starts it, and measures the time from the start until a
# first one-token completion (POST /v1/completions) is answered, then the memory its
# processes hold at idle, once it stops growing (the sum of their PSS, so pages the nodes
# share, such as the mapped model, count once). Prints one line per run and a table of medians.
# Usage:
#   bench/ready.sh [--cold] [--rounds N] TANDEM MODEL [LLAMA_SERVER]
# Servers: `tandem local --prefill 1 --decode 1`, `tandem local --unified 1`, and
# llama-server (`-m MODEL`, its defaults) when given.
# Extra flags for tandem local go in TANDEM_LOCAL_FLAGS (e.g. "--ctx-size 4096").
set -u
COLD=0 ROUNDS=3
while [ $# -gt 0 ]; do
    case $1 in
    --cold) COLD=1; shift ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) break ;;
    esac
done
[ $# -ge 2 ] || { sed -n '2,14p' "$0" >&2; exit 2; }
BIN=$1 M=$2 LS=${3:-}
[ -f "$M" ] || { echo "ready.sh: no model file $M" >&2; exit 2; }
if [ $COLD = 1 ] && ! [ -w /proc/sys/vm/drop_caches ]; then
    echo "ready.sh: --cold drops the page cache, which needs root" >&2
    exit 2
fi
T=$(mktemp -d)
PG=
trap '[ -n "$PG" ] && kill -TERM -- -$PG 2>/dev/null; rm -rf "$T"' EXIT

now_ms() { echo $(($(date +%s%N) / 1000000)); }

# pss_mib PGID: the PSS of every process in the group, MiB
pss_mib() {
    local kb=0 p v
    for p in $(pgrep -g "$1"); do
        v=$(awk '/^Pss:/{print $2}' /proc/$p/smaps_rollup 2>/dev/null)
        kb=$((kb + ${v:-0}))
    done
    echo $((kb / 1024))
}

# first_answer URL DEADLINE_MS: retries a one-token completion until answered (0) or past
first_answer() {
    local url=$1 end=$2
    while [ "$(now_ms)" -lt "$end" ]; do
        curl -sf -m 5 "$url/completions" -H 'Content-Type: application/json' \
            -d '{"model":"default","prompt":"Hello","max_tokens":1,"temperature":0}' >/dev/null 2>&1 && return 0
        sleep 0.02
    done
    return 1
}

# run NAME COLD: one start of server NAME; prints "NAME warm|cold ms pss_mib"
run() {
    local name=$1 cold=$2 url= t0 port
    [ "$cold" = 1 ] && { sync; echo 3 >/proc/sys/vm/drop_caches; }
    t0=$(now_ms)
    case $name in
    tandem-1p1d | tandem-unified)
        local shape="--prefill 1 --decode 1"
        [ $name = tandem-unified ] && shape="--unified 1"
        # shellcheck disable=SC2086
        setsid "$BIN" local --model "$M" $shape ${TANDEM_LOCAL_FLAGS:-} >"$T/out" 2>"$T/err" &
        PG=$!
        while [ "$(now_ms)" -lt $((t0 + 120000)) ]; do
            url=$(sed -n 's/^openai: //p' "$T/out")
            [ -n "$url" ] && break
            kill -0 $PG 2>/dev/null || break
            sleep 0.01
        done
        ;;
    llama-server)
        port=$((20000 + RANDOM % 20000))
        setsid "$LS" -m "$M" --port "$port" >"$T/out" 2>"$T/err" &
        PG=$!
        url=http://127.0.0.1:$port/v1
        ;;
    esac
    local ok=1
    [ -n "$url" ] && first_answer "$url" $((t0 + 120000)) && ok=0
    local ms=$(($(now_ms) - t0))
    if [ $ok != 0 ]; then
        echo "ready.sh: $name did not answer within 120 s: $(tail -2 "$T/err")" >&2
        ms=-1
    fi
    # at idle: once what the processes hold stops growing (a decode node warms its pool in
    # the background after it registers), at most 60 s
    local mem prev=-1 k
    for k in $(seq 60); do
        sleep 1
        mem=$(pss_mib $PG)
        [ $((mem - prev)) -le $((mem / 100)) ] && break
        prev=$mem
    done
    kill -TERM -- -$PG 2>/dev/null
    for _ in $(seq 100); do kill -0 $PG 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- -$PG 2>/dev/null
    wait $PG 2>/dev/null
    PG=
    echo "$name $([ "$cold" = 1 ] && echo cold || echo warm) $ms $mem"
}

servers="tandem-1p1d tandem-unified"
[ -n "$LS" ] && servers="$servers llama-server"
cat "$M" >/dev/null # warm: the file in the page cache
: >"$T/runs"
for r in $(seq "$ROUNDS"); do
    for s in $servers; do
        run "$s" 0 | tee -a "$T/runs"
        [ $COLD = 1 ] && run "$s" 1 | tee -a "$T/runs"
    done
done
echo
echo "| server | start | time to ready, ms (median of $ROUNDS) | memory at idle, MiB PSS |"
echo "|---|---|---|---|"
for s in $servers; do
    for c in warm cold; do
        awk -v s="$s" -v c="$c" '$1 == s && $2 == c {print $3, $4}' "$T/runs" | sort -n >"$T/sel"
        n=$(wc -l <"$T/sel")
        [ "$n" -gt 0 ] || continue
        med=$(sed -n "$(((n + 1) / 2))p" "$T/sel")
        echo "| $s | $c | ${med% *} | ${med#* } |"
    done
done
