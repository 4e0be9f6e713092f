/*
 * td_cpu_kernels: the CPU backend's one kernel table. Every op that has more than one
 * implementation (scalar C, AVX2, AVX-512, AVX-512 VNNI) reaches it through the table the
 * backend fills once, at creation, for one ISA level (td_cpu_isa.h): the best this CPU
 * runs, or a lower one named by td_cpu_config_t.isa or TANDEM_CPU_ISA for measurement.
 * The SIMD code is compiled with target attributes, so a portable build (-DTD_NATIVE=OFF)
 * runs the same kernels as a -march=native one.
 *
 * A level's table holds, per family, the best kernels at or below the level: a family
 * without an AVX-512 table (td_cpu_quant's K formats, attention) runs its AVX2 one there.
 * Every table's kernels keep their family's summation contract, so a row's result does not
 * depend on its batch at any level; between levels results differ by rounding only (the
 * float matmul, attention) or not at all (td_cpu_pack, swiglu): tests/unit/test_cpu_isa.c
 * runs each level against the scalar one.
 */
#ifndef TD_CPU_KERNELS_H
#define TD_CPU_KERNELS_H

#include <stddef.h>

#include "td_backend.h"
#include "td_cpu_bgemm.h"
#include "td_cpu_isa.h"
#include "td_cpu_pack.h"
#include "td_cpu_qf32.h"
#include "td_cpu_quant.h"

typedef struct td_cpu td_cpu_t;

/* The float matmul (W f32, f16 or bf16) for the whole call: td_cpu_matmul's contract. */
typedef td_status_t (*td_cpu_fmatmul_fn)(td_cpu_t *cpu, const td_matmul_params_t *p);

/*
 * Attention's inner kernels (td_cpu_attn.c has their callers and the shapes):
 *   tile_scores      S[r][c] = Q[r] . K[c]                 (prefill; S row stride ld_s; AVX-512
 *                    transposes K into its scratch, so 16 keys are one zmm)
 *   tile_accumulate  O[r][d] += sum_c S[r][c] V[c][d]      (prefill)
 *   block_scores     S[g][c] = Qs[g] . K[c]                (decode; K row stride `stride`)
 *   block_pv         acc[g][d] += sum_c S[g][c] V[c][d]   (decode)
 *   max, exp_sum     a score row's max; x = exp(x - m) in place, returning the sum
 *   to_f32           n elements of a KV dtype to f32 (the gathers of f16/bf16 KV)
 */
typedef struct td_cpu_attn_ops {
    void (*tile_scores)(const float *Q, const float *K, float *S, int rows, int cnt, int hd, int ld_s,
                        float *tmp); /* tmp: hd x ceil(cnt / 16) * 16 floats of scratch */
    void (*tile_accumulate)(float *O, const float *S, const float *V, int rows, int cnt, int hd, int ld_s);
    void (*block_scores)(const float *Qs, int G, int hd, const float *K, size_t stride, int cnt,
                         float *S, int ldS);
    void (*block_pv)(float *acc, size_t ld_acc, const float *S, int ldS, int G, int hd,
                     const float *V, size_t stride, int cnt);
    float (*max)(const float *x, int n);
    float (*exp_sum)(float *x, float m, int n);
    void (*to_f32)(float *dst, const void *src, td_dtype_t t, size_t n);
} td_cpu_attn_ops_t;

/* Row-wise ops: rmsnorm's sum of squares, swiglu's elements [i0, i1). */
typedef struct td_cpu_row_ops {
    float (*dot)(const float *a, const float *b, int n);
    void (*swiglu)(float *out, const float *gate, const float *up, size_t i0, size_t i1);
} td_cpu_row_ops_t;

typedef struct td_cpu_kernels {
    td_cpu_isa_t isa;
    td_cpu_fmatmul_fn fmatmul;        /* float W */
    td_cpu_bgemm_fn bgemm;            /* packed bf16 W (avx512bf16, amx; else NULL): cpu:q8 packs float W */
    const td_cpu_pack_ops_t *pack;    /* packed Q8_0/Q4_0/Q4_1 W, two-byte activations */
    const td_cpu_quant_ops_t *quant;  /* block W as stored (Q4_K, Q6_K), int8 activations */
    const td_cpu_qf32_ops_t *qf32;    /* block W, f32 activations (--device cpu:exact) */
    const td_cpu_attn_ops_t *attn;
    const td_cpu_row_ops_t *row;
} td_cpu_kernels_t;

/* Fills *k with level `isa`'s kernels; `isa` must run on this CPU (TD_ASSERT). */
void td_cpu_kernels_fill(td_cpu_isa_t isa, td_cpu_kernels_t *k);

/* Each family's table for level `isa` (its best at or below it; never NULL). */
td_cpu_fmatmul_fn td_cpu_fmatmul_of(td_cpu_isa_t isa);
const td_cpu_attn_ops_t *td_cpu_attn_ops(td_cpu_isa_t isa);
const td_cpu_row_ops_t *td_cpu_row_ops(td_cpu_isa_t isa);

#endif /* TD_CPU_KERNELS_H */
