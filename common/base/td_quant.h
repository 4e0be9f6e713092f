/*
 * td_quant: the GGML block-quantized weight formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
 * Q5_K, Q6_K, IQ4_XS) as byte-exact structs, with the scalar reference dequantizer of each and the
 * reference quantizer of Q8_0 and Q4_0.
 *
 * Why in base (level 0) and not in kernels/cpu: the layouts are a storage format, like the
 * f16/bf16 of td_dtype. The GGUF loader (model, level 2) needs the block and byte sizes to
 * check tensor extents, the CPU kernels (level 1) read the blocks, and the CUDA half of the
 * kernels (kernels/cuda, which links only td_base) dequantizes them at load. Base is the one
 * module all three reach; a copy in kernels/cpu would be invisible to kernels/cuda.
 *
 * This is the reference the fast (AVX2/AVX-512) kernels are checked against, so it is
 * written for exactness, not speed: every function computes what ggml's
 * dequantize_row_* / quantize_row_*_ref compute, in the same f32 operation order, and
 * tests/unit/test_quant.c checks it bit for bit against gguf-py (the fixtures and the
 * command that made them are in tests/fixtures/quant/).
 *
 * A block holds QK = 32 (Q*_0/Q*_1) or QK_K = 256 (K-quants) consecutive weights of one
 * row; a row of k weights is k / block_elems blocks, stored back to back with no padding.
 * Scales are IEEE half floats stored as their bits (little-endian, as in the file).
 * Thread safety: every function is pure; callers may run them on disjoint ranges at once.
 */
#ifndef TD_QUANT_H
#define TD_QUANT_H

#include <stddef.h>
#include <stdint.h>

#define TD_QK 32    /* weights per block of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 */
#define TD_QK_K 256 /* weights per block (super-block) of Q4_K, Q5_K, Q6_K, IQ4_XS */

/* Q8_0: x[i] = d * qs[i]. */
typedef struct td_block_q8_0 {
    uint16_t d;       /* f16 scale */
    int8_t qs[TD_QK]; /* weights 0..31 */
} td_block_q8_0_t;

/* Q4_0: x[i] = d * (q[i] - 8), q in 0..15. Byte j holds weight j in its low nibble and
 * weight j + 16 in its high nibble. */
typedef struct td_block_q4_0 {
    uint16_t d;            /* f16 scale */
    uint8_t qs[TD_QK / 2]; /* nibbles, as above */
} td_block_q4_0_t;

/* Q4_1: x[i] = d * q[i] + m, q in 0..15, nibbles packed as in Q4_0. */
typedef struct td_block_q4_1 {
    uint16_t d; /* f16 scale */
    uint16_t m; /* f16 offset (the block's minimum) */
    uint8_t qs[TD_QK / 2];
} td_block_q4_1_t;

/* Q5_0: x[i] = d * (q[i] - 16), q in 0..31: the low 4 bits packed as in Q4_0, bit 4 of
 * weight i is bit i of qh (a little-endian 32-bit word). */
typedef struct td_block_q5_0 {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[TD_QK / 2];
} td_block_q5_0_t;

/* Q5_1: x[i] = d * q[i] + m, q in 0..31, packed as in Q5_0. */
typedef struct td_block_q5_1 {
    uint16_t d;
    uint16_t m;
    uint8_t qh[4];
    uint8_t qs[TD_QK / 2];
} td_block_q5_1_t;

/*
 * Q4_K: 8 sub-blocks of 32 weights; sub-block s has a 6-bit scale sc[s] and a 6-bit min
 * mn[s]: x = (d * sc[s]) * q - (dmin * mn[s]), q in 0..15.
 * scales (12 bytes): for s < 4, sc[s] = scales[s] & 63 and mn[s] = scales[s + 4] & 63; for
 * s >= 4, sc[s] = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4 and
 * mn[s] = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4.
 * qs: 4 chunks of 32 bytes; chunk c holds sub-block 2c in the low nibbles and sub-block
 * 2c + 1 in the high nibbles (weight j of each at byte j).
 */
typedef struct td_block_q4_k {
    uint16_t d;              /* f16 super-scale of the scales */
    uint16_t dmin;           /* f16 super-scale of the mins */
    uint8_t scales[12];      /* 8 x (6-bit scale, 6-bit min), as above */
    uint8_t qs[TD_QK_K / 2]; /* 4-bit weights, as above */
} td_block_q4_k_t;

/*
 * Q5_K: Q4_K with a fifth bit: x = (d * sc[s]) * q - (dmin * mn[s]), q in 0..31. scales as
 * Q4_K's; the low 4 bits of q in qs as Q4_K's nibbles, bit 4 of weight l of sub-block s
 * (l in 0..31) is bit s of qh[l].
 */
typedef struct td_block_q5_k {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[12];
    uint8_t qh[TD_QK_K / 8];
    uint8_t qs[TD_QK_K / 2];
} td_block_q5_k_t;

/*
 * IQ4_XS: 8 sub-blocks of 32 weights, x = (d * (ls[s] - 32)) * td_quant_iq4nl_values[q], q a
 * 4-bit index into a fixed non-linear table. ls[s] is 6 bits: the low 4 in nibble s % 2 of
 * scales_l[s / 2], the high 2 in bits 2s, 2s + 1 of scales_h. qs: 16 bytes a sub-block,
 * byte j holding weight j in its low nibble and weight j + 16 in its high one (as Q4_0).
 */
typedef struct td_block_iq4_xs {
    uint16_t d;
    uint16_t scales_h;
    uint8_t scales_l[TD_QK_K / 64];
    uint8_t qs[TD_QK_K / 2];
} td_block_iq4_xs_t;

/* IQ4_NL / IQ4_XS's 16 values (ggml's kvalues_iq4nl) */
extern const int8_t td_quant_iq4nl_values[16];

/*
 * Q6_K: 16 sub-blocks of 16 weights, signed 8-bit scale each: x = (d * scales[s]) * (q - 32),
 * q in 0..63 (4 low bits in ql, 2 high bits in qh). Two halves of 128 weights; in half h,
 * for l in 0..31, weights l, l + 32, l + 64, l + 96 take the low nibble of ql[64h + l], the
 * low nibble of ql[64h + l + 32], the high nibble of ql[64h + l], the high nibble of
 * ql[64h + l + 32], and bits 0-1, 2-3, 4-5, 6-7 of qh[32h + l]. Weight w's scale is
 * scales[w / 16].
 */
typedef struct td_block_q6_k {
    uint8_t ql[TD_QK_K / 2];     /* low 4 bits */
    uint8_t qh[TD_QK_K / 4];     /* high 2 bits */
    int8_t scales[TD_QK_K / 16]; /* per 16 weights */
    uint16_t d;                  /* f16 super-scale */
} td_block_q6_k_t;

_Static_assert(sizeof(td_block_q8_0_t) == 34, "Q8_0 block: 2 + 32 bytes");
_Static_assert(sizeof(td_block_q4_0_t) == 18, "Q4_0 block: 2 + 16 bytes");
_Static_assert(sizeof(td_block_q4_1_t) == 20, "Q4_1 block: 2 + 2 + 16 bytes");
_Static_assert(sizeof(td_block_q5_0_t) == 22, "Q5_0 block: 2 + 4 + 16 bytes");
_Static_assert(sizeof(td_block_q5_1_t) == 24, "Q5_1 block: 2 + 2 + 4 + 16 bytes");
_Static_assert(sizeof(td_block_q4_k_t) == 144, "Q4_K block: 2 + 2 + 12 + 128 bytes");
_Static_assert(sizeof(td_block_q5_k_t) == 176, "Q5_K block: 2 + 2 + 12 + 32 + 128 bytes");
_Static_assert(sizeof(td_block_q6_k_t) == 210, "Q6_K block: 128 + 64 + 16 + 2 bytes");
_Static_assert(sizeof(td_block_iq4_xs_t) == 136, "IQ4_XS block: 2 + 2 + 4 + 128 bytes");

/* ggml's tensor type ids (ggml.h; gguf-py's GGMLQuantizationType): the type id of a GGUF
 * tensor info. Named here: the ids whose block layout is known (td_ggml_type). */
typedef enum td_ggml_type_id {
    TD_GGML_F32 = 0,
    TD_GGML_F16 = 1,
    TD_GGML_Q4_0 = 2,
    TD_GGML_Q4_1 = 3,
    TD_GGML_Q5_0 = 6,
    TD_GGML_Q5_1 = 7,
    TD_GGML_Q8_0 = 8,
    TD_GGML_Q2_K = 10,
    TD_GGML_Q3_K = 11,
    TD_GGML_Q4_K = 12,
    TD_GGML_Q5_K = 13,
    TD_GGML_Q6_K = 14,
    TD_GGML_Q8_K = 15,
    TD_GGML_IQ4_XS = 23,
    TD_GGML_BF16 = 30,
} td_ggml_type_id_t;

/* What a reader of a tensor needs to know about its ggml type: the one table of them. */
typedef struct td_ggml_type {
    const char *name;   /* as gguf-py spells it: "F32", "Q4_K", "IQ2_XXS" */
    size_t block_elems; /* weights per block (1 for F32/F16/BF16; 32 or 256); 0: the
                           layout is not known here (the type is named, not readable) */
    size_t block_bytes; /* bytes per block */
    /* A block format tandem dequantizes: n weights (a multiple of block_elems) from src to
     * dst. NULL for the plain float types and for formats not read yet. */
    void (*dequantize)(const void *src, float *dst, size_t n);
} td_ggml_type_t;

/* The entry of ggml type id `type`, or NULL for an id ggml does not define. */
const td_ggml_type_t *td_ggml_type(uint32_t type);

/*
 * Reference dequantizers: n weights (a multiple of the block's weight count; TD_ASSERT)
 * from n / block_elems blocks at src to n floats at dst. Bit-identical to ggml's
 * dequantize_row_* and gguf-py's dequantize for every input, NaN and inf scales included.
 */
void td_quant_dequantize_q8_0(const void *src, float *dst, size_t n);
void td_quant_dequantize_q4_0(const void *src, float *dst, size_t n);
void td_quant_dequantize_q4_1(const void *src, float *dst, size_t n);
void td_quant_dequantize_q5_0(const void *src, float *dst, size_t n);
void td_quant_dequantize_q5_1(const void *src, float *dst, size_t n);
void td_quant_dequantize_q4_k(const void *src, float *dst, size_t n);
void td_quant_dequantize_q5_k(const void *src, float *dst, size_t n);
void td_quant_dequantize_q6_k(const void *src, float *dst, size_t n);
void td_quant_dequantize_iq4_xs(const void *src, float *dst, size_t n);

/* Q4_K sub-block s's (0..7) 6-bit scale and min from a block's 12 packed scale bytes (the
 * layout above): what every reader of Q4_K blocks (dequantizer, dots, packing) calls. */
void td_quant_q4_k_scale_min(const uint8_t scales[12], int s, int *sc, int *mn);

/* The quants q (0..31) of Q5_K sub-block s (0..7) of block b: low 4 bits and the qh bit. */
void td_quant_q5_k_piece(const td_block_q5_k_t *b, int s, uint8_t q[32]);

/* IQ4_XS sub-block s's (0..7) scale ls - 32 (-32..31) of block b (the layout above). */
int td_quant_iq4_xs_scale(const td_block_iq4_xs_t *b, int s);

/* The unsigned quants q (0..63, the value is d * scale * (q - 32)) of Q6_K weights
 * 32 j .. 32 j + 31 (j in 0..7) of block b, from its ql/qh planes (the layout above). */
void td_quant_q6_k_piece(const td_block_q6_k_t *b, int j, uint8_t q[32]);

/*
 * Reference quantizers, byte-identical to ggml's quantize_row_q8_0_ref / q4_0_ref (and
 * gguf-py's quantize): n floats (a multiple of 32; TD_ASSERT) to n / 32 blocks at dst.
 * Q8_0: d = amax / 127, q = round-half-away(x / d). Q4_0: d = -max / 8 where max is the
 * signed value of largest magnitude (the first such), q = min(15, trunc(x / d + 8.5)); a
 * block of zeros gets d = 0 / -8 = -0.0, as in ggml (gguf-py stores +0.0 instead when the
 * block's first zero is -0.0: the one input on which the two references differ).
 * The scale is stored as f16 (round to nearest even), so a block's largest magnitude must
 * stay below 127 * 65520 (Q8_0) or 8 * 65520 (Q4_0) for it to be finite; model weights are
 * far below. The input must be finite.
 */
void td_quant_quantize_q8_0(const float *src, void *dst, size_t n);
void td_quant_quantize_q4_0(const float *src, void *dst, size_t n);

#endif /* TD_QUANT_H */
