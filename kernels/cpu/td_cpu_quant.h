/*
 * td_cpu_quant: the CPU dot-product kernels a block-quantized matmul is built on (issue 14).
 *
 * llama.cpp's scheme: the activation row is quantized per block of 32 to int8 with one scale
 * (td_cpu_q8a_block_t), and a weight row in Q8_0, Q4_0 or Q4_1 is dotted with it block by
 * block in integers; the block's int32 partial sums are scaled by d_w * d_a in f32. Q4_1's
 * offset m needs the activation block's sum: sum_i (d q_i + m) a_i = d_w d_a sum q_i qa_i +
 * m * (d_a sum qa_i), so the activation block carries s = d_a * sum qa_i (llama.cpp's Q8_1).
 *
 * Q4_K and Q6_K (llama.cpp's "k-quants", 256-weight super-blocks) are dotted against the
 * same activation blocks (ggml uses a 256-wide Q8_K there; one activation format for all
 * weight types keeps the matmul's quantize step one step).
 *
 * Three implementations of every dot, in td_cpu_quant_ops_t tables: the scalar reference,
 * AVX2 (_mm256_maddubs_epi16 / _mm256_madd_epi16) and AVX-512 VNNI (256-bit vpdpbusd). All
 * sum in the same order (below), so they give bit-identical results. The SIMD ones are
 * compiled with target attributes; the CPU backend takes the table of its ISA level
 * (td_cpu_quant_ops(isa), td_cpu_kernels.h), so a TD_NATIVE=OFF binary runs the best one
 * the machine has and TANDEM_CPU_ISA can force a lower one.
 *
 * The order of the f32 sum (the contract of every implementation): for a row of k weights
 * (nb = k / 32 blocks), the 32 products of a block are summed exactly in int32 in 8 lanes
 * of 4 consecutive weights, p[b][l] = sum_{i=4l..4l+3} qw_i qa_i; each lane keeps an f32
 * accumulator, acc[l] = fmaf(d_b, (float)p[b][l], acc[l]) for b = 0..nb-1 with
 * d_b = f32(d_w) * d_a; the row's dot is ((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) +
 * (acc3+acc7)) and, for Q4_1, + M where M = fmaf(f32(m_b), s_b, M) over the blocks in order.
 * The K formats use the same 32-wide activation blocks: a 256-weight super-block meets 8
 * of them, its 32-weight pieces in weight order. Q4_K: piece s has a 6-bit scale sc_s and
 * min mn_s; d_b = (f32(d) * sc_s) * d_a and M = fmaf(-(f32(dmin) * mn_s), s_b, M), after
 * the lanes of the same block. Q6_K: piece j holds the 16-weight sub-blocks 2j (lanes 0-3)
 * and 2j + 1 (lanes 4-7) with int8 scales, folded in exactly: p[b][l] = sc * (lane sum),
 * d_b = f32(d) * d_a, no M.
 *
 * Range contract (why the int16 pair sums of maddubs never saturate): activation quants
 * are in [-127, 127] (td_cpu_quant_act_row makes them so; never -128), weight quants are
 * int8 (Q8_0, -128 allowed) or 4-bit. Thread safety: every function is pure; callers may
 * run them on disjoint rows at once.
 */
#ifndef TD_CPU_QUANT_H
#define TD_CPU_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "td_cpu_isa.h"
#include "td_quant.h"

/* One block of 32 quantized activations: a_i ~= d * qs[i]. Scales in f32 (not f16 as in
 * ggml's Q8_1): activations are made per step, never stored, and f32 keeps them exact. */
typedef struct td_cpu_q8a_block {
    float d;          /* scale: amax / 127 (0 for a block of zeros) */
    float s;          /* d * sum(qs), for the offset of Q4_1 weights */
    int8_t qs[TD_QK]; /* round-half-away(x / d), in [-127, 127] */
} td_cpu_q8a_block_t;

/*
 * Quantizes k floats (a multiple of 32; TD_ASSERT) to k / 32 activation blocks, as ggml's
 * quantize_row_q8_1_ref does (d = amax / 127, q = roundf(x / d) computed as x * (1 / d)),
 * with f32 scales. Scalar: it reads each activation once per matmul, next to n rows of
 * weights. Defined for every input: a block holding NaN gets d = NaN, one holding an
 * infinity d = inf, so the dots it meets come out NaN or inf, as an f32
 * matmul's would; no float-to-int conversion ever sees a value out of range.
 */
void td_cpu_quant_act_row(const float *x, td_cpu_q8a_block_t *a, size_t k);

/* A weight row of k weights (k / 32 blocks of its format at w) dotted with k / 32
 * activation blocks, summed in the order of the header comment. */
typedef float (*td_cpu_quant_dot_fn)(const void *w, const td_cpu_q8a_block_t *a, size_t k);


/* A table's blocked GEMM tile of one type (td_cpu_quant_gemm's contract, k % 32 == 0) */
typedef void (*td_cpu_quant_gemm_fn)(const void *w, size_t row_bytes, size_t n_rows,
                                     const td_cpu_q8a_block_t *a, size_t m, size_t k, float *y,
                                     size_t ldy);

typedef struct td_cpu_quant_ops {
    const char *name;           /* "scalar", "avx2", "avx512vnni" */
    /* td_cpu_quant_act_row's quantizer (every table writes the same bytes) */
    void (*act_row)(const float *x, td_cpu_q8a_block_t *a, size_t k);
    td_cpu_quant_dot_fn q8_0;   /* Q8_0 weights */
    td_cpu_quant_dot_fn q4_0;   /* Q4_0 weights */
    td_cpu_quant_dot_fn q4_1;   /* Q4_1 weights */
    td_cpu_quant_dot_fn q4_k;   /* Q4_K weights (k a multiple of 256) */
    td_cpu_quant_dot_fn q6_k;   /* Q6_K weights (k a multiple of 256) */
    /* register-blocked tiles (NULL: td_cpu_quant_gemm calls the dot per output) */
    td_cpu_quant_gemm_fn gemm_q8_0, gemm_q4_0, gemm_q4_1, gemm_q4_k, gemm_q6_k;
} td_cpu_quant_ops_t;

/* The kernels this family runs at level `isa` (td_cpu_isa.h): its best table at or below
 * it, never NULL. `isa` must run on this CPU (TD_ASSERT). */
const td_cpu_quant_ops_t *td_cpu_quant_ops(td_cpu_isa_t isa);

/* The dot of ggml type `type` in `ops` (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), or NULL for
 * another type. */
td_cpu_quant_dot_fn td_cpu_quant_dot_of(const td_cpu_quant_ops_t *ops, uint32_t type);

/*
 * GEMV: y[r] = dot(row r of W, a) for r in [r0, r1), row r at w + r * row_bytes
 * (row_bytes = k / 32 * block_bytes for a dense matrix). `type` is a ggml type id with a
 * dot in `ops` (TD_ASSERT). Rows are independent: threads may take disjoint [r0, r1).
 */
void td_cpu_quant_gemv(const td_cpu_quant_ops_t *ops, uint32_t type, const void *w,
                       size_t row_bytes, size_t r0, size_t r1, const td_cpu_q8a_block_t *a,
                       size_t k, float *y);

/*
 * GEMM tile: y[i * ldy + r] = dot(row r of W, activation row i) for r in [0, n_rows) and
 * i in [0, m); W row r at w + r * row_bytes, activation row i at a + i * (k / 32). Every
 * output is summed exactly as its single dot is (the header's order), whatever n_rows and
 * m are: a row's result does not depend on the batch it is computed in. Tables may block
 * several W rows by several activation rows so each weight block is unpacked once per
 * several activation rows. `type` has a dot in `ops` (TD_ASSERT).
 */
void td_cpu_quant_gemm(const td_cpu_quant_ops_t *ops, uint32_t type, const void *w,
                       size_t row_bytes, size_t n_rows, const td_cpu_q8a_block_t *a, size_t m,
                       size_t k, float *y, size_t ldy);

#endif /* TD_CPU_QUANT_H */
