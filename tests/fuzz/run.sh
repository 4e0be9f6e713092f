#!/usr/bin/env bash
# run.sh HARNESS SECONDS [libFuzzer flags...]: one harness of tests/fuzz as scripts/test
# runs it. First every committed input of tests/fuzz/regressions/NAME once (the crashes
# found before: each must now pass), then SECONDS of fuzzing from the seeds of
# tests/fuzz/corpus/NAME (new inputs go to a temporary folder, never into the source tree).
# A crash, a leak, a sanitizer report or a hang (-timeout) fails it; the input is kept
# under $FUZZ_ARTIFACTS (default: the temporary folder, printed) to commit as a regression.
set -u
bin=$1 secs=$2
shift 2
name=$(basename "$bin")
short=${name#fuzz_}
src=${TD_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
export FUZZ_MODEL_DIR=${FUZZ_MODEL_DIR:-$src/tests/fuzz/model}
work=$(mktemp -d "/tmp/$name.XXXXXX")
art=${FUZZ_ARTIFACTS:-$work/artifacts}
mkdir -p "$work/new" "$art"
trap 'rm -rf "$work/new"' EXIT
# leaks: ASan's leak check runs at exit of each run
common=(-timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 -artifact_prefix="$art/")
reg=$src/tests/fuzz/regressions/$short
if [ -d "$reg" ] && [ -n "$(ls -A "$reg")" ]; then
    if ! "$bin" "${common[@]}" "$reg"/* >"$work/reg.log" 2>&1; then
        tail -40 "$work/reg.log"
        echo "FAIL: $name: a regression input of tests/fuzz/regressions/$short crashes again"
        exit 1
    fi
    echo "$name: $(ls "$reg" | wc -l) regression inputs pass"
fi
"$bin" "${common[@]}" -max_total_time="$secs" -print_final_stats=1 "$@" "$work/new" "$src/tests/fuzz/corpus/$short" \
    >"$work/fuzz.log" 2>&1
rc=$?
stats=$(grep -E '^stat::(number_of_executed_units|peak_rss_mb|new_units_added)' "$work/fuzz.log" | sed 's/^stat:://' | paste -sd' ')
cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$work/fuzz.log" | tail -1)
if [ $rc -ne 0 ]; then
    grep -vE '^#[0-9]+' "$work/fuzz.log" | tail -60
    echo "FAIL: $name: exit $rc after ${secs}s ($stats); the input is in $art (commit it under tests/fuzz/regressions/$short)"
    exit 1
fi
echo "PASS: $name: ${secs}s, $stats, $cov"
rm -rf "$work" # its logs and (empty) artifacts folder are kept for a failure only
