#!/bin/bash
# test_hostile_corpus: the hostile-input corpus of issue 21, generated afresh by
# tests/cluster/hostile/gen.py (deterministic, seed 21) from a synthetic tiny model, and replayed by
# tests/cluster/hostile/replay.py while a 1+1 `tandem local` cluster on stories260K serves:
#   1. model files (mutated config.json, model.safetensors, tokenizer.json,
#      tokenizer_config.json, and a GGUF file's header, metadata, tensor infos and tokenizer)
#      through `tandem model info` and `tandem generate`: each ends with
#      output or with an error naming a file of the model, never a signal, a timeout (30 s)
#      or a sanitizer report, and none that cannot be right loads;
#   2. bad values for every numeric flag of `tandem generate`, and unknown flags: exit 2 naming
#      the flag;
#   3. raw bytes on the gateway, every control port and every /metrics port (each connection
#      must be closed by the server once the client half-closes) and unparseable protobuf
#      through a stock gRPC client (an error status with a message).
# After each group the cluster must serve a normal request equal to `tandem generate` and
# every process must be alive; cl_end checks the cluster's sanitizer logs. docs/hostile.md says
# what the corpus covers. Skips without the model or grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
H="$CL_SRC/tests/cluster/hostile"
start=$(date +%s)

"$CL_BIN" model synth --out "$CL_T/base" >"$CL_T/synth.log" 2>&1 ||
    { cl_fail "tandem model synth: $(tail -3 "$CL_T/synth.log")"; cl_end; }
"$CL_BIN" model synth --format gguf --out "$CL_T/base.gguf" >>"$CL_T/synth.log" 2>&1 ||
    { cl_fail "tandem model synth --format gguf: $(tail -3 "$CL_T/synth.log")"; cl_end; }
"$CL_PY" "$H/gen.py" "$CL_T/corpus" --base "$CL_T/base" --gguf "$CL_T/base.gguf" || { cl_fail "gen.py"; cl_end; }

cl_local 1 1 --threads 1
# tandem local prints the nodes' control ports, not the router's: a node's --router has it
ctl=$(sed -n 's/^\(prefill\|decode\) [^ ]*: control \([^ ]*\) metrics .*/\2/p' "$CL_T/local.err" | paste -sd,)
for p in $(pgrep -P "${CL_PID[local]}"); do
    r=$(tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null | sed -n '/^--router$/{n;p;q}')
    [ -n "$r" ] && { ctl="$r,$ctl"; break; }
done
murls=$(for n in "${!CL_MURL[@]}"; do echo "${CL_MURL[$n]}"; done | paste -sd,)
[ -n "$ctl" ] && [ -n "$murls" ] || { cl_fail "no control ports ($ctl) or /metrics URLs ($murls)"; cl_end; }

# after_group WHAT: the cluster still serves a normal request, and every process is alive
after_group() {
    cl_concurrent_equal 8 "1 2 3" "1 400"
    _cl_dead "${CL_PID[local]}" && cl_fail "after $1: tandem local died"
    grep -q 'tandem local: process' "$CL_T/local.err" &&
        cl_fail "after $1: a cluster process died: $(grep 'tandem local: process' "$CL_T/local.err")"
    echo "after $1: the cluster served a normal request ($(($(date +%s) - start)) s so far)"
}

echo "== 1: model files"
"$CL_PY" "$H/replay.py" model "$CL_T/corpus" "$CL_BIN" "$CL_T/san-cases" | tee "$CL_T/g1.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || CL_FAIL=1
after_group "the model files"

echo "== 2: flags of tandem generate"
"$CL_PY" "$H/replay.py" flags "$CL_T/corpus" "$CL_BIN" "$CL_T/san-cases" "$CL_T/base" | tee "$CL_T/g2.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || CL_FAIL=1
after_group "the flags"

echo "== 3: network (gateway $CL_GW, control $ctl, metrics $murls)"
"$CL_PY" "$H/replay.py" net "$CL_T/corpus" "$CL_GW" "$ctl" "$murls" | tee "$CL_T/g3.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || CL_FAIL=1
after_group "the network payloads"

summary=$(grep -h -E '^(model files|flags|network): ' "$CL_T"/g[123].log | paste -sd';' | sed 's/;/; /g')
echo "$summary"
cl_end "hostile corpus in $(($(date +%s) - start)) s: $summary"
