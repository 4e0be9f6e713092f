/*
 * td_cpu_qf32: block-quantized weights times f32 activations, the accurate quantized matmul
 * of the CPU backend (issue 14).
 *
 * td_cpu_quant (llama.cpp's scheme) quantizes the activations to int8 per block of 32; that
 * loses enough that SmolLM2-135M Q4_1 answers a different first token than the exact model.
 * Here the activations stay f32: each weight is dequantized in registers to exactly the f32
 * value td_quant_dequantize_* (and gguf-py) gives, and multiplied into the f32 activation by
 * FMA. The only error left is f32 rounding of the sum, as in an f32 matmul of the
 * dequantized weights.
 *
 * The order of the sum (the contract of every implementation): an output y = dot(W row j,
 * X row i) over k weights keeps 16 f32 lane accumulators; weight e (0 <= e < k) goes to lane
 * e % 16, in increasing e: acc[e % 16] = fmaf(w_e, x_e, acc[e % 16]), all starting at +0.0.
 * The lanes are then added as a tree: s8[l] = acc[l] + acc[l + 8] (l < 8), s4[l] = s8[l] +
 * s8[l + 4], s2[l] = s4[l] + s4[l + 2], y = s2[0] + s2[1]. The order depends on nothing
 * but k: not on m, not on which W rows or X rows a call computes, not on the ISA. So a row's
 * output is bit-identical whether it is computed alone, in a decode batch or in a 512-row
 * prefill, and whichever W rows a thread takes: the engine stays batch-invariant. AVX-512
 * holds the 16 lanes in one zmm, AVX2 in two ymm (lanes 0-7 and 8-15); the scalar table
 * computes the lanes one by one and is the reference.
 *
 * Weights: Q8_0, Q4_0, Q4_1 (k a multiple of 32), Q4_K, Q6_K (k a multiple of 256). A scale
 * that is NaN gives NaN outputs (the payload is not specified); every finite input gives the
 * same bits in every table.
 *
 * Threads: none inside. Every function is pure; the caller splits W rows [n0, n1) over
 * threads (disjoint ranges write disjoint outputs).
 */
#ifndef TD_CPU_QF32_H
#define TD_CPU_QF32_H

#include <stdbool.h>
#include <stddef.h>

#include "td_cpu_isa.h"
#include "td_dtype.h"

/*
 * One table's matmul of one weight type: for i in [0, m) and j in [n0, n1),
 *   y[i * ldy + j] = dot(W row j, X row i)   (summed in the header's order)
 * W row j at (const char *)w + j * row_bytes (row_bytes >= td_dtype_bytes(type, k); the
 * dense matrix has row_bytes == td_dtype_bytes(type, k)), X row i at x + i * k (f32, k
 * floats). The blocks' f16 scales are read as uint16_t: w and row_bytes must be even (as
 * every block size is). Register-blocked: m <= 4 streams each W block once and FMAs it into all m rows
 * (decode); larger m tiles X rows (8 per tile with AVX-512) so a dequantized W block serves
 * the whole tile (prefill).
 */
typedef void (*td_cpu_qf32_fn)(const void *w, size_t row_bytes, size_t n0, size_t n1,
                               const float *x, size_t m, size_t k, float *y, size_t ldy);


typedef struct td_cpu_qf32_ops {
    const char *name; /* "scalar", "avx2", "avx512" */
    td_cpu_qf32_fn q8_0, q4_0, q4_1, q4_k, q6_k;
} td_cpu_qf32_ops_t;

/* The kernels this family runs at level `isa` (td_cpu_isa.h): its best table at or below
 * it, never NULL. `isa` must run on this CPU (TD_ASSERT). */
const td_cpu_qf32_ops_t *td_cpu_qf32_ops(td_cpu_isa_t isa);

/* The kernel of `type` in `ops`, or NULL for a type this family does not handle (float
 * types, Q5_0, Q5_1). */
td_cpu_qf32_fn td_cpu_qf32_fn_of(const td_cpu_qf32_ops_t *ops, td_dtype_t type);

/*
 * The matmul of the td_cpu_qf32_fn contract with `type` (one td_cpu_qf32_fn_of gives
 * non-NULL for: TD_ASSERT) and k a multiple of its block (TD_ASSERT). What the CPU backend
 * calls per thread: td_cpu_qf32_matmul(cpu->k.qf32, type, w, row_bytes, n0, n1,
 * x, m, k, y, n) for that thread's [n0, n1).
 */
void td_cpu_qf32_matmul(const td_cpu_qf32_ops_t *ops, td_dtype_t type, const void *w,
                        size_t row_bytes, size_t n0, size_t n1, const float *x, size_t m,
                        size_t k, float *y, size_t ldy);

#endif /* TD_CPU_QF32_H */
