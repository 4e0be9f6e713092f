/*
 * td_cpu_bgemm: float weights (f32, f16, bf16) repacked at load to bf16, times activations
 * rounded to bf16, with AVX512_BF16's vdpbf16ps (issue 32): the float matmul of
 * --device cpu:q8 (td_cpu_config_t.act_one_byte, the mode that trades precision for
 * llama.cpp's speed) on CPUs with AVX512_BF16 (level avx512bf16, td_cpu_isa.h; at level
 * amx on the tile unit, td_cpu_bgemm_of). The default backend and cpu:exact keep
 * td_cpu_fgemm's f32 sums of the stored values.
 *
 * Why. td_cpu_fgemm widens each weight to f32 and runs 16 FMAs a zmm instruction: at the
 * FMA peak that is half of what one vdpbf16ps does (32 products, summed in pairs into 16
 * f32 lanes). ik_llama.cpp's -rtr 1 repacks f16 and bf16 weights to bf16 (BF16_R16) for
 * that instruction; this is the same idea in our own layout.
 *
 * Rounding: every value to bf16 by round-to-nearest-even of its f32 value (td_f32_to_bf16:
 * a NaN stays a quiet NaN, an overflow becomes inf); an f16 weight is exact in f32 first,
 * so it loses three mantissa bits (f16's range fits in bf16's). The activations are rounded
 * once per matmul (td_cpu_bgemm_act_row), the weights once at load.
 *
 * The packed matrix: rows in groups of 16 (TD_CPU_BGEMM_ROWS; the last group padded with
 * zero rows), group after group, each td_cpu_bgemm_group_bytes(k) = 32 k bytes; in a group,
 * for each pair p of weights (p < k / 2) one 64-byte vector, bf16 element 2 r + j =
 * W[16 g + r][2 p + j]. So one broadcast of an activation pair (x[2p], x[2p + 1]) against
 * one vector gives the pair's partial sum for 16 rows, each in its own f32 lane: no
 * horizontal sums. k must be even (TD_ASSERT; the backend packs only such matrices). The
 * same bytes are the tile unit's operand: 16 consecutive vectors (1 KiB, 32 weights of the
 * group's 16 rows) are the B tile of one TDPBF16PS (K / 2 rows of 16 columns of a pair).
 *
 * The activation row: k bf16 values in order (a pair is one 32-bit word), stride
 * td_cpu_bgemm_act_stride(k) bytes.
 *
 * The sum (the contract; at level amx, td_cpu_bgemm_of says what changes): output
 * y = dot(W row r, X row i) is one f32 lane, starting at +0.0 and updated by one vdpbf16ps
 * per pair, p = 0, 1, ..., k / 2 - 1, in order. No tile splits k, and the lane is the same instruction's in every tile shape, so the bits depend
 * on nothing but the row's values and k: not on m, nor on which rows or groups a call
 * computes, nor on threads. The backend stays batch-invariant in this mode. What one
 * vdpbf16ps does to a lane is the CPU's (Intel documents two f32 additions, each rounded
 * to nearest even, of the two exact bf16 products, with bf16 denormal inputs read as zero
 * and denormal results flushed); per pair at most two roundings of a partial sum, so an
 * output is within k * 2^-24 * sum |w x| (first order) of the exact sum of the bf16 values'
 * products. Denormal activations (|x| < 2^-126) therefore count as zero.
 *
 * Threads: none inside; pure functions. The caller splits the groups.
 */
#ifndef TD_CPU_BGEMM_H
#define TD_CPU_BGEMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_cpu_isa.h"
#include "td_dtype.h"

#define TD_CPU_BGEMM_ROWS 16

/* Bytes of one packed group of 16 rows of k weights (k even): 32 k. */
size_t td_cpu_bgemm_group_bytes(size_t k);

/* Bytes of the packed form of a [n][k] matrix: ceil(n / 16) groups. */
size_t td_cpu_bgemm_pack_bytes(size_t n, size_t k);

/* Writes the packed form of the row-major [n][k] matrix w of `type` (TD_F32, TD_F16 or
 * TD_BF16; k even: TD_ASSERT) to dst (td_cpu_bgemm_pack_bytes of it; 64-byte aligned for
 * the kernels). w is only read. AVX-512 where the CPU has it (16 rows by 32 weights
 * converted in registers and transposed: a 1B f16 model's load in cpu:q8 took 5.3 s with
 * the plain C alone), td_cpu_bgemm_pack_c's bits on every input, NaN, inf and denormals
 * included: the rounding is integer arithmetic on the f32 bits, never vcvtneps2bf16 (which
 * flushes f32 denormals to zero). */
void td_cpu_bgemm_pack(void *dst, const void *w, td_dtype_t type, size_t n, size_t k);

/* td_cpu_bgemm_pack in plain C, element by element through td_f32_to_bf16 (any CPU; the
 * reference its tests compare with). */
void td_cpu_bgemm_pack_c(void *dst, const void *w, td_dtype_t type, size_t n, size_t k);

/* Bytes from one activation row of k values (k even) to the next: 2 k rounded up to 64, and
 * 64 more when that is a multiple of 4 KiB (16 rows 4 KiB apart, one AMX tile load, would
 * all fall in one L1 set; docs/kernels.md "cpu:q8 at level amx"). */
size_t td_cpu_bgemm_act_stride(size_t k);

/* The k f32 values at x rounded to bf16 (td_f32_to_bf16, bit for bit) into the row at a
 * (k even; the stride's padding is left as it was). AVX-512 where the CPU has it. */
void td_cpu_bgemm_act_row(const float *x, uint16_t *a, size_t k);

/*
 * The kernel: for activation rows i in [0, m) and packed groups g in [g0, g1) of the matrix
 * at wp,
 *   y[i * ldy + 16 (g - g0) + r] = dot(weight row 16 g + r, activation row i)
 * summed in the level's order (below); activation row i at (const char *)a + i * lda bytes.
 * A call's first rows read the groups from memory and prefetch ahead in each group's
 * stream, up to group g_pf (>= g1: the end of the caller's share; past it lie other
 * threads'). Pure; no threads inside.
 */
typedef void (*td_cpu_bgemm_fn)(const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k, const void *a,
                                size_t lda, size_t m, float *y, size_t ldy);

/*
 * Level `isa`'s kernel (`isa` runs on this CPU: TD_ASSERT), NULL below avx512bf16:
 * - avx512bf16: the header's order, one vdpbf16ps per pair; tiles of 2 groups by up to 8 rows.
 * - amx (AMX-BF16), k a multiple of 32: the tile unit's TDPBF16PS, one per 32 weights (16
 *   pairs), from +0.0 in the order of k: the C tile's lane for (i, r) is updated by the
 *   k / 32 products in turn, so again the bits depend on the row's values and k only (the
 *   tile unit computes a C row from its A row alone, whatever the tile's row count:
 *   tests/unit/test_cpu_bgemm.c holds every m and split to the same bits). How the unit
 *   sums the 16 pairs of a product inside is the CPU's (Intel documents each pair's two
 *   products added in turn, rounded to nearest even, bf16 denormals read as zero and
 *   denormal results flushed); the same (k + 2) 2^-24 bound holds in the tests. Other k run
 *   the avx512bf16 kernel, for every m (a matrix keeps one order).
 */
td_cpu_bgemm_fn td_cpu_bgemm_of(td_cpu_isa_t isa);

#endif /* TD_CPU_BGEMM_H */
