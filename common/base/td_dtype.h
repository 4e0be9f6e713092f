/*
 * td_dtype: element types of weights, activations and the KV cache.
 *
 * Two kinds. The float types (f32, f16, bf16) are element types: activations, the KV cache
 * and any weight. The block-quantized types (Q8_0 ... IQ4_XS, td_quant.h) are weight
 * storage only: a row of n weights is n / td_dtype_block_elems(t) blocks of
 * td_dtype_block_bytes(t) bytes, and has no per-element size (td_dtype_size is for float
 * types; td_dtype_bytes gives the bytes of n weights of either kind).
 */
#ifndef TD_DTYPE_H
#define TD_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

typedef enum td_dtype {
    TD_F32 = 0,
    TD_F16 = 1,
    TD_BF16 = 2,
    /* block-quantized weights (td_quant.h), weights only */
    TD_Q8_0 = 3,
    TD_Q4_0 = 4,
    TD_Q4_1 = 5,
    TD_Q5_0 = 6,
    TD_Q5_1 = 7,
    TD_Q4_K = 8,
    TD_Q6_K = 9,
    TD_Q5_K = 10,
    TD_IQ4_XS = 11,
} td_dtype_t;

#define TD_DTYPE_FLOAT_COUNT 3 /* f32, f16, bf16: [0, 3) */
#define TD_DTYPE_COUNT 12      /* every td_dtype_t: [0, 12) */

/* True for f32, f16, bf16 (element types); false for block types and out-of-range values. */
static inline bool td_dtype_is_float(int t)
{
    return t >= 0 && t < TD_DTYPE_FLOAT_COUNT;
}

/* True for a block-quantized type. */
static inline bool td_dtype_is_block(int t)
{
    return t >= TD_DTYPE_FLOAT_COUNT && t < TD_DTYPE_COUNT;
}

/* Bytes of one element of a float type; 0 for a block type (use td_dtype_bytes). */
static inline size_t td_dtype_size(td_dtype_t t)
{
    return t == TD_F32 ? 4 : td_dtype_is_float(t) ? 2 : 0;
}

/* Weights per block: 1 for a float type, 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or 256 (Q4_K,
 * Q6_K, Q5_K, IQ4_XS). */
size_t td_dtype_block_elems(td_dtype_t t);
/* Bytes per block (td_dtype_size for a float type). */
size_t td_dtype_block_bytes(td_dtype_t t);
/* Bytes of n weights of type t; n must be a multiple of td_dtype_block_elems(t) (TD_ASSERT). */
size_t td_dtype_bytes(td_dtype_t t, size_t n);

/* The ggml type id of t (td_quant.h td_ggml_type_id_t), and back: the td_dtype_t of a ggml
 * type id, or -1 when tandem has no dtype for it. */
uint32_t td_dtype_to_ggml(td_dtype_t t);
int td_dtype_from_ggml(uint32_t ggml_type);

/* "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k", "q5_k",
 * "iq4_xs"; "?" for an unknown value. */
const char *td_dtype_name(td_dtype_t t);

/* Parses "f32|fp32|float32", "f16|fp16|float16", "bf16|bfloat16" and the block names of
 * td_dtype_name (any case); -1 otherwise. */
int td_dtype_parse(const char *s);

/* td_dtype_parse for a --dtype value, a float type only: *out set on success; else
 * TD_ERR_INVALID, logged naming the value, and *out untouched. */
td_status_t td_dtype_parse_flag(const char *s, td_dtype_t *out);

/* td_dtype_parse for a --kv-dtype value: f32, f16, bf16 or q8_0 (td_kv_layout.h). Errors as
 * td_dtype_parse_flag. */
td_status_t td_dtype_parse_kv_flag(const char *s, td_dtype_t *out);

/* td_dtype_parse for a --quant value: a block type with a quantizer (td_dtype_can_convert
 * from f32): q8_0 or q4_0. Errors as td_dtype_parse_flag. */
td_status_t td_dtype_parse_quant_flag(const char *s, td_dtype_t *out);

/* Whether td_dtype_convert converts src_t to dst_t: any pair of float types; a block type
 * with a dequantizer (all but none today) to a float type; a float type to Q8_0 or Q4_0
 * (quantized); identity. */
bool td_dtype_can_convert(td_dtype_t dst_t, td_dtype_t src_t);

/* Converts n weights between dtypes on the host; the pair must be one td_dtype_can_convert
 * accepts and n a multiple of both block sizes (TD_ASSERT). Block types (de)quantize with
 * td_quant's reference functions. Allocates nothing. */
void td_dtype_convert(void *dst, td_dtype_t dst_t, const void *src, td_dtype_t src_t, size_t n);

#endif /* TD_DTYPE_H */
