#!/bin/bash
# bench/peers_build.sh: builds the engine's peers for bench/vs_peers.sh from their PyPI sdists
# (for benchmarks only, never vendored or shipped): llama.cpp from llama-cpp-python 0.3.36's
# vendor/llama.cpp and ik_llama.cpp from ik-llama-cpp-python 0.1.5's, each twice: an AVX2-only
# build (-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF; ik's FANCY_SIMD follows AVX-512,
# so it is off too) for the avx2 rows, and a native one for the AVX-512 rows. Targets:
# llama-bench and llama-batched-bench (llama.cpp also llama-quantize). About 20 minutes on 2
# cores. Folder: $PEERS (default ~/.cache/tandem/peers), laid out as vs_peers.sh reads it:
# PEERS/{lc,ik}-{avx2,native}/bin. Needs cmake, g++ and pip (any Python's).
set -euo pipefail
PEERS=${PEERS:-$HOME/.cache/tandem/peers}
PIP=${PIP:-pip}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$PEERS/src"
cd "$PEERS/src"
for p in llama-cpp-python==0.3.36 ik-llama-cpp-python==0.1.5; do
  d=$(echo "${p%%==*}" | tr - _)-${p##*==}
  if [ ! -d "$d" ]; then
    "$PIP" download --no-deps --no-binary :all: -d . "$p" >/dev/null
    tar xzf "$d.tar.gz"
  fi
done
LC=$PEERS/src/llama_cpp_python-0.3.36/vendor/llama.cpp
IK=$PEERS/src/ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp
# ik's sdist lacks common/cmake/build-info-gen-cpp.cmake, which writes common/build-info.cpp
# from its .in: write it once by hand so that its build does not try to
[ -f "$IK/common/build-info.cpp" ] ||
  printf 'int LLAMA_BUILD_NUMBER = 0;\nchar const *LLAMA_COMMIT = "sdist";\nchar const *LLAMA_COMPILER = "gcc";\nchar const *LLAMA_BUILD_TARGET = "x86_64";\n' \
    > "$IK/common/build-info.cpp"
common=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF)
avx2=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX=ON)
build() { # SRC DIR TARGETS... (after --) cmake flags
  local src=$1 dir=$2; shift 2
  local targets=()
  while [ "$1" != -- ]; do targets+=(--target "$1"); shift; done
  shift
  echo "peers_build: $dir" >&2
  cmake -S "$src" -B "$PEERS/$dir" "${common[@]}" "$@" >/dev/null
  cmake --build "$PEERS/$dir" -j"$JOBS" "${targets[@]}" >/dev/null
}
build "$LC" lc-avx2 llama-bench llama-batched-bench llama-quantize -- "${avx2[@]}"
build "$IK" ik-avx2 llama-bench llama-batched-bench -- "${avx2[@]}" -DGGML_IQK_FA_ALL_QUANTS=OFF
# On a CPU with AMX, llama.cpp's native build (GCC 12) dies in its AMX kernel: GCC 12's
# _tile_loadconfig declares an 8-byte read of the 64-byte configuration, so the stores of the
# rest are not ordered before it (a general protection fault at ldtilecfg). There the "native"
# llama.cpp is every AVX-512 extension but AMX (docs/bench.md, the AMX Xeon's rows).
lc_native=(-DGGML_NATIVE=ON)
grep -qw amx_int8 /proc/cpuinfo &&
  lc_native=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
    -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON)
build "$LC" lc-native llama-bench llama-batched-bench llama-quantize -- "${lc_native[@]}"
build "$IK" ik-native llama-bench llama-batched-bench -- -DGGML_NATIVE=ON -DGGML_IQK_FA_ALL_QUANTS=OFF
echo "peers_build: done: $PEERS/{lc,ik}-{avx2,native}/bin" >&2
