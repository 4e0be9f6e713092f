#!/usr/bin/env bash
# Mixtures of experts end to end on the real binary, against an independent float64 numpy
# forward pass (tests/ref/hf_ref.py, written from transformers' Mixtral and Qwen3-MoE blocks):
# synthetic tiny-mixtral and tiny-qwen3moe models (`tandem model synth`), safetensors and GGUF
# (llama.cpp's 3-D ffn_*_exps tensors), Qwen3-MoE with norm_topk_prob both ways. For each,
# tandem's greedy tokens equal the reference's and every printed log-probability (the
# prompt's and the generated tokens', with the top alternatives: a function of all the
# logits) is within 2e-5 of it. Then bad input: a config or GGUF whose experts disagree with
# the weights is refused with a message naming the field or tensor, never a crash.
set -u
bin=${TANDEM_BIN:?TANDEM_BIN must point to the tandem binary}
src=${TD_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
py=/usr/bin/python3
source "$(dirname "$0")/cli_lib.sh" # pass/fail counters, $dir, $out, $err, expect_rc, says

prompt="256 84 104 101 32 109 105 120 116 117 114 101 32 111 102 32 101 120 112 101 114 116 115"
n=20

# compare WHAT REF_OUT TANDEM_OUT: the same ids line and log-probability lines (ids equal,
# numbers within 2e-5)
compare() {
    "$py" - "$2" "$3" <<'PY' && ok || bad "$1: tandem differs from the float64 reference (above)"
import sys
ref, got = [open(p).read().split("\n") for p in sys.argv[1:3]]
ref = [l for l in ref if l]
got = [l for l in got if l.startswith("logprob") or (l and l[0].isdigit())]
if len(ref) != len(got) or ref[0] != got[0]:
    print("ids: reference", ref[0], "| tandem", got[0] if got else "(none)")
    sys.exit(1)
worst = 0.0
for r, g in zip(ref[1:], got[1:]):
    rf, gf = r.split(), g.split()
    if rf[:4] != gf[:4] or len(rf) != len(gf):
        print("line: reference", r, "| tandem", g)
        sys.exit(1)
    for a, b in zip(rf[4:], gf[4:]):
        (ia, va), (ib, vb) = (a.split(":") if ":" in a else ("", a)), (b.split(":") if ":" in b else ("", b))
        worst = max(worst, abs(float(va) - float(vb)))
        if ia != ib:
            # an alternative may swap places with its neighbour only on a near-tie
            print("alternative: reference", r, "| tandem", g)
            sys.exit(1)
print(f"{len(ref) - 1} log-probability lines, largest difference {worst:.2e}")
sys.exit(0 if worst <= 2e-5 else 1)
PY
}

if ! "$py" -c "import numpy" 2>/dev/null; then
    echo "skipped: /usr/bin/python3 has no numpy: the reference comparisons"
    skip=$((skip + 1))
else
    for preset in tiny-mixtral tiny-qwen3moe; do
        m=$dir/$preset
        expect_rc 0 "synth $preset" "$bin" model synth --config "$preset" --dtype f32 --seed 11 --out "$m"
        expect_rc 0 "synth $preset gguf" "$bin" model synth --config "$preset" --dtype f32 --seed 11 --format gguf \
            --out "$m.gguf"
        "$py" "$src/tests/ref/hf_ref.py" "$m" --ids "$prompt" --n $n --logprobs 3 >"$dir/ref" 2>"$err" ||
            bad "$preset: hf_ref.py failed: $(head -c 300 "$err")"
        for model in "$m" "$m.gguf"; do
            "$bin" generate --model "$model" --prompt-ids "$prompt" --max-tokens $n --print-ids --logprobs 3 \
                --prompt-logprobs >"$dir/got" 2>"$err" || bad "$model: generate failed: $(head -c 300 "$err")"
            compare "$(basename "$model")" "$dir/ref" "$dir/got"
        done
        # the prompt prefilled in chunks of 5 (other rows beside each row in its experts' groups),
        # and on 1 thread: the same
        "$bin" generate --model "$m" --prompt-ids "$prompt" --max-tokens $n --print-ids --logprobs 3 \
            --prompt-logprobs --prefill-chunk 5 --threads 1 >"$dir/got" 2>"$err" ||
            bad "$preset --prefill-chunk 5: $(head -c 300 "$err")"
        compare "$preset --prefill-chunk 5" "$dir/ref" "$dir/got"
    done
    # Qwen3-MoE without renormalisation: the top-k weights as the softmax over all gave them
    m=$dir/tiny-qwen3moe
    sed -i 's/"norm_topk_prob":[[:space:]]*true/"norm_topk_prob": false/' "$m/config.json"
    grep -q '"norm_topk_prob": false' "$m/config.json" && ok || bad "could not set norm_topk_prob false"
    "$py" "$src/tests/ref/hf_ref.py" "$m" --ids "$prompt" --n $n --logprobs 3 >"$dir/ref2"
    "$bin" generate --model "$m" --prompt-ids "$prompt" --max-tokens $n --print-ids --logprobs 3 \
        --prompt-logprobs >"$dir/got" 2>"$err" || bad "norm_topk_prob false: generate failed"
    compare "tiny-qwen3moe norm_topk_prob false" "$dir/ref2" "$dir/got"
    cmp -s "$dir/ref" "$dir/ref2" && bad "norm_topk_prob false computed the same as true: the test sees nothing" || ok
fi

# ---- bad input ---------------------------------------------------------------------------
m=$dir/bad
expect_rc 0 "synth tiny-mixtral" "$bin" model synth --config tiny-mixtral --dtype f32 --out "$m"
cp "$m/config.json" "$dir/config.orig"
edit() { "$py" - "$m/config.json" "$1" "$2" <<'PY'
import json, sys
p, k, v = sys.argv[1:4]
c = json.load(open(p)); c[k] = json.loads(v); json.dump(c, open(p, "w"))
PY
}
edit num_experts_per_tok 5
expect_rc 1 "top-k above the experts" "$bin" generate --model "$m" --prompt-ids "256" --max-tokens 1
says "num_experts_per_tok (expert_used_count) 5 is out of range [1, 4]" "top-k above the experts"
cp "$dir/config.orig" "$m/config.json"; edit num_local_experts 5
expect_rc 1 "more experts than the files hold" "$bin" generate --model "$m" --prompt-ids "256" --max-tokens 1
says "block_sparse_moe.gate.weight has shape [4, 64], config.json says [5, 64]" "more experts than the files hold"
cp "$dir/config.orig" "$m/config.json"; edit num_local_experts 0
expect_rc 1 "zero experts" "$bin" generate --model "$m" --prompt-ids "256" --max-tokens 1
says "num_local_experts 0 is out of range" "zero experts"
cp "$dir/config.orig" "$m/config.json"; edit intermediate_size 64
expect_rc 1 "wrong expert width" "$bin" generate --model "$m" --prompt-ids "256" --max-tokens 1
says "experts.0.w1.weight has shape [96, 64], config.json says [64, 64]" "wrong expert width"
cp "$dir/config.orig" "$m/config.json"
"$py" - "$m/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); del c["num_experts_per_tok"]; json.dump(c, open(sys.argv[1], "w"))
PY
expect_rc 1 "no top-k" "$bin" generate --model "$m" --prompt-ids "256" --max-tokens 1
says 'missing field "num_experts_per_tok"' "no top-k"

cp "$dir/config.orig" "$m/config.json"
# an expert's tensor renamed in the safetensors header (same length): missing, by name
"$py" - "$m/model.safetensors" <<'PY'
import sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
o = b"layers.2.block_sparse_moe.experts.3.w2.weight"
i = b.find(o)
assert i > 0
b[i:i + len(o)] = o.replace(b".w2.", b".w9.")
open(p, "wb").write(b)
PY
expect_rc 1 "missing expert tensor" "$bin" generate --model "$m" --prompt-ids "256" --max-tokens 1
says "missing tensor model.layers.2.block_sparse_moe.experts.3.w2.weight" "missing expert tensor"

# GGUF: metadata and tensor names patched in place (same lengths)
g=$dir/bad.gguf
expect_rc 0 "synth tiny-mixtral gguf" "$bin" model synth --config tiny-mixtral --dtype f32 --format gguf --out "$g"
patch_gguf() { "$py" - "$g" "$dir/p.gguf" "$1" "$2" <<'PY'
import struct, sys
src, dst, what, arg = sys.argv[1:5]
b = bytearray(open(src, "rb").read())
if what == "u32":  # key=value: the u32 after the key's name and its type tag
    k, v = arg.split("=")
    i = b.find(k.encode()) + len(k)
    assert struct.unpack_from("<I", b, i)[0] == 4, "not a u32"
    struct.pack_into("<I", b, i + 4, int(v))
else:  # rename: old=new, same length
    o, n = arg.split("=")
    assert len(o) == len(n) and b.find(o.encode()) > 0
    i = b.find(o.encode()); b[i:i + len(o)] = n.encode()
open(dst, "wb").write(b)
PY
}
patch_gguf u32 llama.expert_used_count=9
expect_rc 1 "gguf: expert_used_count above expert_count" "$bin" generate --model "$dir/p.gguf" --prompt-ids "256" --max-tokens 1
says "llama.expert_used_count 9 is more than llama.expert_count 4" "gguf: expert_used_count above expert_count"
patch_gguf u32 llama.expert_count=3
expect_rc 1 "gguf: expert_count disagrees" "$bin" generate --model "$dir/p.gguf" --prompt-ids "256" --max-tokens 1
says "blk.0.ffn_gate_inp.weight has ne [64, 4]" "gguf: expert_count disagrees"
patch_gguf rename blk.1.ffn_up_exps.weight=blk.1.ffn_up_exps.weighx
expect_rc 1 "gguf: missing expert tensor" "$bin" generate --model "$dir/p.gguf" --prompt-ids "256" --max-tokens 1
says "missing tensor blk.1.ffn_up_exps.weight" "gguf: missing expert tensor"
patch_gguf u32 llama.expert_count=0
expect_rc 1 "gguf: zero experts" "$bin" generate --model "$dir/p.gguf" --prompt-ids "256" --max-tokens 1
says "llama.expert_count = 0 is out of range" "gguf: zero experts"

echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
