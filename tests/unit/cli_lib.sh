# cli_lib.sh: the pass/fail bookkeeping shared by tests/unit's command-line tests (sourced;
# not a test itself: the test glob is test_*.sh). Gives pass, fail, skip; ok and bad (bad
# prints "FAIL: ..."); a scratch $dir removed on exit with $out and $err in it; expect_rc
# WANT DESCRIPTION CMD... (runs CMD, stdin /dev/null, stdout to $out, stderr to $err, and
# counts whether it exited WANT); says TEXT DESCRIPTION (whether $err holds TEXT).
pass=0 fail=0 skip=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }
dir=$(mktemp -d)
out=$dir/out err=$dir/err
trap 'rm -rf "$dir"' EXIT
expect_rc() { # expect_rc WANT DESCRIPTION CMD...
    local want=$1 what=$2; shift 2
    "$@" >"$out" 2>"$err" </dev/null
    local rc=$?
    if [ "$rc" -eq "$want" ]; then ok; else bad "$what: exit $rc, want $want: $(head -c 300 "$err")"; fi
}
says() { grep -qF -- "$1" "$err" && ok || bad "$2: '$(head -c 300 "$err")' does not say '$1'"; }
