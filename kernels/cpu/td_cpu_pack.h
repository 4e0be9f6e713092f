/*
 * td_cpu_pack: block-quantized weights repacked at load for int8 activation dot products
 * (issue 14), the CPU backend's default quantized matmul.
 *
 * Why a second layout. A row-major Q4_0 matrix makes every block's dot end in a horizontal
 * sum of one row's lanes (td_cpu_quant). Repacked, one 64-byte vector holds the same four
 * weights of 16 rows, so VNNI's vpdpbusd (u8 x s8, four products summed into each int32
 * lane) gives 16 rows' partial sums at once against one broadcast of four activation bytes:
 * no horizontal work, the 16 row scales are one vector, and in a prefill tile each unpacked
 * weight vector serves several activation rows.
 *
 * The packed matrix: rows in groups of TD_CPU_PACK_ROWS (16; the last group padded with
 * zero rows of scale 0), group after group, each group_bytes (td_cpu_pack_group_bytes)
 * long, 64-byte multiples; a group's nb = k / 32 blocks go in chunks of 8 (the last one
 * short when nb % 8 != 0), each chunk its blocks' quants, then their scales:
 *   [8 blocks of quants][8 blocks of scales][8 blocks of quants][8 blocks of scales]...
 * so a decode reads a group front to back as one stream (docs/kernels.md: the scales in a
 * second stream after all the quants cost a third of the read speed).
 * Quants of one block, "u" the unsigned quant (Q4_0, Q4_1: the nibble 0..15; Q8_0: q + 128):
 *   Q4_0, Q4_1: 4 vectors of 64 bytes; vector v byte 4r + j = u(row r, weight 4v + j) |
 *               u(row r, weight 16 + 4v + j) << 4 (the stored qs byte 4v + j of row r:
 *               the low nibbles are weights 4v..4v+3, the high ones 16+4v..16+4v+3)
 *   Q8_0:       8 vectors of 64 bytes; vector v byte 4r + j = u(row r, weight 4v + j) for
 *               two-byte rows, q(row r, weight 4v + j) (the int8 as stored) for one-byte
 *               ones: the layout follows the rows' mode (td_cpu_pack_weights' one_byte), as
 *               each mode's fastest kernels want it (AVX2's int16 tile zero-extends u; its
 *               one-byte tile takes q's sign and |q| as they are, where u cost it an xor a
 *               weight vector, 2.8% of its time; VNNI's vpdpbusd wants u and pays the xor
 *               once a weight vector for several rows, which read no slower). Every other
 *               type's layout is the same in both modes.
 * Scales of one block: Q4_0, Q8_0: 16 f16 d (row order); Q4_1: 16 f16 d then 16 f16 m.
 * Q4_K: each 32-weight sub-block is a block of the Q4_1 layout (u = q, 0..15), and the scales
 * go per super-block of 8 blocks (a chunk), 320 bytes: 16 f16 d, 16 f16 dmin (row order, as stored),
 * then for sub-blocks 0..7 the 16 rows' 6-bit sc bytes, then their mn bytes. A block's
 * d_w = d * sc and m = -(dmin * mn), both exact in f32; from there Q4_K is Q4_1.
 * Q5_K: as Q4_K (u = q, 0..31) with a fifth vector of the fifth bits: byte 4r + j holds those
 * of weights j, 4 + j, 8 + j, 12 + j at bits 0..3 and of weights 16 + j, ... at bits 4..7.
 * IQ4_XS: each 32-weight block is the Q4 layout of its 4-bit indices; u = value + 128 (the
 * value from td_quant_iq4nl_values, offset 128 as Q8_0's); scales per super-block, 160 bytes:
 * 16 f16 d, then per block the 16 rows' int8 ls - 32. A block's d_w = d * (ls - 32), exact.
 * Q6_K: each 32-weight block is 6 vectors: the Q4 layout of the low 4 bits of u = q (0..63,
 * offset 32), then two vectors of the high 2 bits: vector 4 byte 4r + j holds those of
 * weights j, 4 + j, 8 + j, 12 + j at bits 0-1, 2-3, 4-5, 6-7, vector 5 the same for weights
 * 16 + .... Scales per super-block, 288 bytes: 16 f16 d, then per block the 16 rows' int8
 * scale of weights 0..15, then of 16..31. A block's two halves each have d_w = d * sc
 * (exact) and their own integer sum (below).
 *
 * Activations: each value in two int8 parts. llama.cpp rounds an activation block to one
 * byte (q = round(x / d), d = amax / 127); on SmolLM2 that alone moves greedy answers off
 * the exact model's after a few tokens (docs/correctness.md). Here the remainder gets a
 * second byte: v = x * (1 / d) clamped to [-127, 127], hi = roundf(v), lo = roundf((v - hi) *
 * 254), so x ~= e * Q with Q = 254 hi + lo and e = d / 254, off by at most e / 2 (1/508 of
 * llama.cpp's step). Each weight vector then meets two broadcasts (two vpdpbusd) per block,
 * which prefill has the compute for and batch-1 decode, bound by reading the weights, does
 * not notice. Rows laid out for broadcasts (td_cpu_pack_act_row):
 *   [k int8 hi][k int8 lo][nb f32 e][nb 32-bit c][nb int32 c2][pad to 64][k int16 Q]
 *   stride td_cpu_pack_act_stride(k); Q = 254 hi + lo again, as one int16 (|Q| <= 32385), for
 *   AVX2's two-byte prefill tiles, whose vpmaddwd takes int16 pairs. Only tables with
 *   act_q16 write the Q part (scalar, avx2), and only of two-byte rows; avx512vnni's kernels
 *   never read it and its quantizer leaves it as it was (writing it cost 1-2% of a prefill
 *   there), as every quantizer does in a one-byte row, which only one-byte kernels read.
 *   A one-byte row for Q6_K weights, whose Q no kernel reads, holds there instead per block b,
 *   at 8 b bytes in, four int16: -32 times the sums of hi over the block's weights {0, 1, 4,
 *   5, 8, 9, 12, 13} and {2, 3, 6, 7, 10, 11, 14, 15}, then over 16 + those (|.| <= 32512),
 *   and 0 after the last block's: AVX2's one-byte Q6_K tile starts its int16 sums there
 * Super-block rows (one-byte rows for IQ4_XS, Q4_K and Q6_K weights, `--device cpu:q8`; issue
 * 32, h32q; Q6_K h32r): one step E = amax / 127 per 256 values (amax over the super-block, NaN
 * ignored), hi = round(x / E) clamped to [-127, 127], as llama.cpp's Q8_K; each of the
 * super-block's 8 blocks holds e = E (NaN if a value of the super-block is NaN), lo 0, and c
 * from S_b, the block's sum of hi: IQ4_XS c = -128 S_b (int32), Q4_K c = E * S_b (f32), Q6_K c
 * and c2 = -32 times the sums of hi of its halves (int32); the Q part not written (Q6_K: the
 * offsets above, from hi).
 * c folds the weights' offset into the integer sum: Q4_0 c = -8 * sum Q, Q8_0 and IQ4_XS c =
 * -128 * sum Q (int32), so that c + sum u * Q = sum (u - offset) * Q exactly; Q6_K c = -32 * the sum of
 * the block's first 16 Q and c2 = -32 * that of its last 16 (0 for other types); Q4_1, Q4_K and Q5_K c = e * sum Q
 * (f32), the activation side of the offset term m * sum x. A block holding NaN gets e =
 * NaN, one holding an infinity e = inf (its outputs NaN or inf, as an f32 matmul's).
 *
 * The sum (the contract of every implementation, so all tables give the same bits): for
 * output (activation row i, weight row r), over blocks b in order:
 *   p_b = exact integer sum over the block of (u - offset) Q   (an int32: 254 p_hi + p_lo)
 *   acc = fmaf((float)p_b, d_w(r, b) * e(i, b), acc)            acc starts at +0.0
 *   Q4_1, Q4_K, Q5_K only: M = fmaf(m(r, b), c(i, b), M)        (offset 0; M starts at +0.0)
 *   Q6_K instead: for half h = 0, 1: p_h = c_h + sum over the half of u Q (c_0 = c, c_1 = c2),
 *   acc = fmaf((float)p_h, d_w(r, b, h) * e(i, b), acc)          (|p_h| < 2^24: exact in f32)
 *   Super-block rows instead: per super-block s (blocks 8 s .. 8 s + 7), with sc_b the block's
 *   integer scale (IQ4_XS ls - 32, Q4_K the 6-bit sc) and d the super-block's f16 d:
 *   P = exact integer sum over its blocks of sc_b (c_b + sum u hi) (IQ4_XS; Q4_K: sc_b sum u hi;
 *   |P| <= 8 * 32 * 32 * 127 * 127 < 2^28; Q6_K: over its blocks and their halves h of the
 *   int8 sc_bh (c_h + sum over the half of u hi) = sc_bh sum (u - 32) hi, |.| <= 128 * 16 * 32
 *   * 127 a half, 16 halves: |P| <= 133,169,152 < 2^31), acc = fmaf((float)P, d(r, s) * E(i,
 *   s), acc) once a super-block; Q4_K's M as above, a block at a time (its c is E S_b)
 * y = acc (Q4_1, Q4_K, Q5_K: acc + M). Nothing depends on m, on which rows a call computes or on the
 * ISA: a row's output is the same alone, in a decode batch or in a 512-row prefill, so the
 * backend stays batch-invariant (docs/kernels.md).
 *
 * Range: hi and lo in [-127, 127], u <= 255, so VNNI's products fit and AVX2's maddubs
 * pairs never saturate (Q8_0 and IQ4_XS go through the sign trick there: |w| * sign(q, w)); |p_b| <=
 * 32 * 255 * 32512 + 128 * 32 * 32512 < 2^31. Q6_K: u <= 63, AVX2's pairs 2 * 63 * 127 fit in
 * int16, and a half's |p_h| <= 16 * 32 * 32512 < 2^24; a super-block row's half, u - 32 in
 * -32..31 against |hi| <= 127: AVX2's int16 lanes of 8 products started at act_o6's -32 S
 * end at |sum (u - 32) hi| <= 32512 (exact though vpaddw wraps on the way), a madd lane by sc
 * (int16 pairs) <= 2 * 32512 * 128 < 2^23, P as above < 2^31.
 *
 * Threads: none inside; every function is pure, callers split the groups.
 */
#ifndef TD_CPU_PACK_H
#define TD_CPU_PACK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_cpu_isa.h"
#include "td_dtype.h"

#define TD_CPU_PACK_ROWS 16

/* Whether `type` has a packed layout (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, IQ4_XS). */
bool td_cpu_pack_supports(td_dtype_t type);

/* Bytes of one packed group of 16 rows of k weights (k a multiple of the type's block). */
size_t td_cpu_pack_group_bytes(td_dtype_t type, size_t k);

/* Bytes of the packed form of a [n][k] matrix: ceil(n / 16) groups. */
size_t td_cpu_pack_bytes(td_dtype_t type, size_t n, size_t k);

/* Writes the packed form of the row-major [n][k] matrix w (as stored in GGUF) to dst
 * (td_cpu_pack_bytes of it, any alignment; 64 for the kernels' sake), for the kernels of
 * one-byte rows (one_byte) or of two-byte ones (Q8_0's layout differs, above). `type`
 * supported, k a multiple of its block (TD_ASSERT). w is only read. */
void td_cpu_pack_weights(void *dst, const void *w, td_dtype_t type, size_t n, size_t k, bool one_byte);

/* Bytes of one quantized activation row of k floats (a multiple of 64). */
size_t td_cpu_pack_act_stride(size_t k);

/* A table's quantizer: the k floats at x (k % 32 == 0) into the activation row at a for
 * weights of `type` (which sets c); every table writes the same bytes (the Q part only with
 * act_q16, and not in one-byte rows but for Q6_K's offsets). one_byte: lo all 0
 * (Q = 254 hi, llama.cpp's one-byte rounding; c from those Q); for IQ4_XS, Q4_K and Q6_K a
 * super-block row (one step a 256 values, above; k % 256 == 0). */
typedef void (*td_cpu_pack_act_fn)(const float *x, void *a, td_dtype_t type, size_t k, bool one_byte);

/*
 * One table's kernel of one weight type: for activation rows i in [0, m) and packed groups
 * g in [g0, g1) of the matrix at wp (k weights a row),
 *   y[i * ldy + 16 (g - g0) + r] = dot(weight row 16 g + r, activation row i)
 * summed in the header's order, activation row i at a + i * td_cpu_pack_act_stride(k).
 * Register-blocked: each group's weight block is unpacked once for up to 8 activation
 * rows (AVX-512 VNNI; AVX2: 8 rows by half a group or 4 by all of it, in int16, for m >= 2
 * two-byte rows, 8 by half a group for one-byte ones, 16 for Q6_K's) while the weights stay
 * in registers; super-block rows carry a block's integer scale in the integer sum and take one
 * float step a super-block). Each group's first sweep over
 * its weights prefetches ahead of its loads, up to group g_pf (>= g1): the end of the
 * caller's share when it makes several calls over it (past it lie other threads' groups).
 */
typedef void (*td_cpu_pack_fn)(const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k, const void *a,
                               size_t m, float *y, size_t ldy);


typedef struct td_cpu_pack_fns {
    td_cpu_pack_fn q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, iq4_xs;
} td_cpu_pack_fns_t;

typedef struct td_cpu_pack_ops {
    const char *name; /* "scalar", "avx2", "avx512vnni" */
    td_cpu_pack_act_fn act_row;
    bool act_q16; /* act_row writes a two-byte row's int16 Q part (the layout above). A row
                     feeds the kernels of the table that made it, or of any table when made by
                     one with act_q16: only avx2's two-byte kernels read Q (and its one-byte
                     Q6_K tile the offsets there, which act_q16 tables write), and the scalar
                     reference writes every part, so its rows feed every table (the tests') */
    td_cpu_pack_fns_t two_byte; /* the header's sum */
    td_cpu_pack_fns_t one_byte; /* the same sum on rows whose lo parts are all 0 (act_row's
                                   one_byte), which these skip: equal bits, half the integer
                                   work; IQ4_XS, Q4_K, Q6_K: the super-block rows' sum (above) */
} td_cpu_pack_ops_t;

/* ops->act_row after checking k and type (TD_ASSERT). */
void td_cpu_pack_act_row(const td_cpu_pack_ops_t *ops, const float *x, void *a, td_dtype_t type, size_t k,
                         bool one_byte);

/* The kernels this family runs at level `isa` (td_cpu_isa.h): its best table at or below
 * it, never NULL. `isa` must run on this CPU (TD_ASSERT). */
const td_cpu_pack_ops_t *td_cpu_pack_ops(td_cpu_isa_t isa);

/* The kernel of `type` in `ops` for two-byte rows, or with one_byte for rows act_row made
 * with one_byte (on any other row they would drop the lo parts); `type` supported (TD_ASSERT). */
td_cpu_pack_fn td_cpu_pack_fn_of(const td_cpu_pack_ops_t *ops, td_dtype_t type, bool one_byte);

#endif /* TD_CPU_PACK_H */
