# Shared by the benchmark smoke tests (tests/test_bench_*.sh), sourced: the binary, a
# Python, a scratch folder removed at exit, and failure counting.
#   bl_init           sets BIN, PY, tmp
#   bl_bad MESSAGE    counts a failure and prints it
#   bl_end NAME       exits 0 with "NAME: ok", or 1 with the failure count
set -u
bl_init() {
    BIN=${TANDEM_BIN:?TANDEM_BIN must name the tandem binary}
    PY=$(command -v python3 || echo /usr/bin/python3)
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    bl_fails=0
}
bl_bad() { bl_fails=$((bl_fails + 1)); echo "FAIL: $*" >&2; }
bl_end() {
    [ "$bl_fails" -eq 0 ] && echo "$1: ok" && exit 0
    echo "$1: $bl_fails failure(s)" >&2
    exit 1
}
