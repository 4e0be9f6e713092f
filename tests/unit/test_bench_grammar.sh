#!/usr/bin/env bash
# tandem bench grammar on the real binary (docs/bench.md): with --model (a tiny random-weight
# model with the built-in byte tokenizer) every grammar gets its mask figures and end-to-end
# tokens/s at batch 1 and 32 with and without it; --dump writes one vocab.tsv line per token
# (its bytes as the grammar sees them) and each grammar's source, which parses as JSON; a
# model that cannot load is exit 1 naming it.
set -u
bin=${TANDEM_BIN:?TANDEM_BIN must point to the tandem binary}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }

"$bin" model synth --out "$tmp/m" --config tiny >/dev/null 2>&1 || bad "model synth"
if "$bin" bench grammar --model "$tmp/m" --tokens 50 --gen-tokens 4 --reps 1 --json --dump "$tmp/d" >"$tmp/out.json" 2>"$tmp/err"; then
    ok
else
    bad "bench grammar --model: $(tail -2 "$tmp/err")"
fi
/usr/bin/python3 - "$tmp/out.json" "$tmp/d" <<'PY' && ok || bad "bench grammar's JSON or dump (above)"
import json, os, sys
j = json.load(open(sys.argv[1]))
d = sys.argv[2]
assert j["bench"] == "grammar" and j["gen_tokens"] == 4, j
names = [g["name"] for g in j["grammars"]]
assert names == ["json_object", "schema-flat", "schema-nested"], names
for g in j["grammars"]:
    assert g["warm_us_per_token"] > 0 and g["compile_ms"] >= 0, g
    assert [e["batch"] for e in g["e2e"]] == [1, 32], g
    for e in g["e2e"]:
        for k in ("free_tps", "cold_tps", "warm_tps", "cold_mask_us_per_token", "warm_mask_us_per_token"):
            assert e[k] > 0, (g["name"], k, e)
        assert abs(e["cold_ratio"] - e["cold_tps"] / e["free_tps"]) < 0.01, e
    json.loads(open(os.path.join(d, g["name"] + ".json")).read())
lines = open(os.path.join(d, "vocab.tsv")).read().splitlines()
assert len(lines) == j["vocab"], (len(lines), j["vocab"])
rows = [l.split("\t") for l in lines]
assert all(int(r[0]) == i for i, r in enumerate(rows))
assert rows[ord("{")][1:] == ["text", "7b"], rows[ord("{")]  # the byte tokenizer: id b is byte b
assert sum(r[1] == "eos" for r in rows) >= 1
PY
"$bin" bench grammar --model "$tmp/none" >/dev/null 2>"$tmp/err"
rc=$?
[ "$rc" -eq 1 ] && grep -q "$tmp/none" "$tmp/err" && ok || bad "missing model: exit $rc, '$(head -c 300 "$tmp/err")'"
echo "passed $pass, failed $fail"
[ "$fail" -eq 0 ]
