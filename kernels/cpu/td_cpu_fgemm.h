/*
 * td_cpu_fgemm: float weights (f32, f16, bf16) times f32 activations with AVX-512, the CPU
 * backend's float matmul where the CPU has AVX-512 F/BW/VL (issue 14). The activations stay
 * f32 (llama.cpp rounds them to f16 first); f16 and bf16 weights are widened to f32 in
 * registers (vcvtph2ps, a 16-bit shift), exactly.
 *
 * The order of the sum (the contract; the same as td_cpu_qf32's): an output
 * y = dot(W row j, X row i) over k weights keeps 16 f32 lane accumulators; weight e
 * (0 <= e < k) goes to lane e % 16, in increasing e: acc[e % 16] = fmaf(w_e, x_e,
 * acc[e % 16]), all starting at +0.0 (the last k % 16 weights are a masked chunk whose
 * missing lanes add nothing). The lanes are then added as a tree: s8[l] = acc[l] +
 * acc[l + 8], s4[l] = s8[l] + s8[l + 4], s2[l] = s4[l] + s4[l + 2], y = s2[0] + s2[1].
 * The order depends on nothing but k: not on m, not on which W rows or X rows a call
 * computes. So a row's output is bit-identical whether it is computed alone (decode), in a
 * batch or in a 512-row prefill: the backend stays batch-invariant.
 *
 * Blocking (register tiles of R W rows by M X rows, R * M zmm accumulators):
 *  - m <= 5 (decode): R = 8, 6 or 4 W rows a pass, so each W byte is read once and 8 to 20
 *    independent FMA chains hide the FMA latency; software prefetch two tiles ahead keeps a
 *    thread's stream at the memory bandwidth.
 *  - larger m (prefill): 4 W rows by 6 X rows (24 accumulators), ~94% of the FMA peak
 *    (106 of 113 GFLOP/s on one Zen 4 core). The 6-row X tile runs over all of a call's W
 *    rows (the caller hands 16 a call: 64 KiB of f16 at k = 2048, from L2 after the first
 *    tile, which prefetches the next call's rows); the caller chunks X by
 *    td_cpu_fgemm_x_rows, so W is read from memory once per chunk.
 *
 * Threads: none inside; pure functions. The caller splits W rows over threads.
 */
#ifndef TD_CPU_FGEMM_H
#define TD_CPU_FGEMM_H

#include <stdbool.h>
#include <stddef.h>

#include "td_dtype.h"

/* True when this CPU runs the AVX-512 kernels (F, BW, VL, F16C, FMA; decided with
 * __builtin_cpu_supports; the kernels are compiled with target attributes, so a build
 * without -march=native has them too). */
bool td_cpu_fgemm_available(void);

/*
 * For i in [0, m) and r in [0, n): y[i * ldy + r] = dot(W row r, X row i), summed in the
 * header's order. W (type TD_F32, TD_F16 or TD_BF16; TD_ASSERT) row r at
 * (const char *)w + r * td_dtype_bytes(type, k), X row i at x + i * k (f32).
 * Only where td_cpu_fgemm_available() (TD_ASSERT). Reads past W's last row only by
 * prefetches (which never fault).
 */
void td_cpu_fgemm(td_dtype_t type, const void *w, size_t n, const float *x, size_t m, size_t k,
                  float *y, size_t ldy);

/* X rows per td_cpu_fgemm call for a prefill with this k: a multiple of the tile's 6 rows
 * whose f32 values (rows * k * 4 bytes) fit in 1.5 MiB (L2 and a little of L3: each 6-row
 * tile is re-read from there once per 16 W rows), at least 6. */
size_t td_cpu_fgemm_x_rows(size_t k);

#endif /* TD_CPU_FGEMM_H */
