/*
 * td_dtype: element types of weights, activations and the KV cache.
 */
#ifndef TD_DTYPE_H
#define TD_DTYPE_H

#include <stddef.h>

#include "td_status.h"

typedef enum td_dtype {
    TD_F32 = 0,
    TD_F16 = 1,
    TD_BF16 = 2,
} td_dtype_t;

#define TD_DTYPE_COUNT 3

static inline size_t td_dtype_size(td_dtype_t t)
{
    return t == TD_F32 ? 4 : 2;
}

/* "f32", "f16", "bf16"; "?" for an unknown value. */
const char *td_dtype_name(td_dtype_t t);

/* Parses "f32|fp32|float32", "f16|fp16|float16", "bf16|bfloat16"; -1 otherwise. */
int td_dtype_parse(const char *s);

/* td_dtype_parse for a --dtype value: *out set on success; else TD_ERR_INVALID, logged
 * naming the value, and *out untouched. */
td_status_t td_dtype_parse_flag(const char *s, td_dtype_t *out);

/* Converts n elements between dtypes on the host (any pair, including identity). */
void td_dtype_convert(void *dst, td_dtype_t dst_t, const void *src, td_dtype_t src_t, size_t n);

#endif /* TD_DTYPE_H */
