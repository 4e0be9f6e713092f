#!/bin/bash
# test_cluster_garbage: garbage on the router's gateway port of a 1+1 `tandem local` cluster,
# each on its own connection or call: random bytes, an HTTP/2 frame cut short after the
# preface (while it waits, other connections are served), HTTP/1.1 requests, and valid gRPC
# calls whose protobuf body does not parse or whose gRPC framing is broken (curl). The garbage
# connections must be closed, the bad calls must end INVALID_ARGUMENT or INTERNAL (broken
# framing: also RESOURCE_EXHAUSTED/UNIMPLEMENTED), a normal request must succeed after each,
# and the router (and the whole cluster) must still be alive. Requests that can never succeed
# (empty prompt, an id outside the vocabulary, longer than the model, top_p -0.5 or NaN,
# repetition_penalty -2 or NaN, max_tokens 2^32-1, a 300-byte stop string, too many stop ids
# or strings, stop strings or a text prompt without a tokenizer) must end INVALID_ARGUMENT,
# each with its own message naming the field. Skips without the model or grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_local 1 1
"$CL_PY" "$CL_TOOL" garbage "$CL_GW" | tee "$CL_T/garbage.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || CL_FAIL=1
_cl_dead "${CL_PID[local]}" && cl_fail "tandem local (and so the router) died"
grep -q 'tandem local: process' "$CL_T/local.err" && cl_fail "a cluster process died: $(grep 'tandem local: process' "$CL_T/local.err")"
want=$(cl_ref 16 "1 2 3")
echo "1 2 3|$want" >"$CL_T/refs"
"$CL_PY" "$CL_TOOL" run "$CL_GW" 16 "$CL_T/refs" || CL_FAIL=1
cl_end "garbage, a truncated frame, HTTP/1.1 and bad protobufs each failed alone; the router serves on"
