/*
 * td_dtype: names and host-side conversion of element types.
 */
#include "td_dtype.h"

#include <stdint.h>
#include <string.h>
#include <strings.h>

#include "td_quant.h"
#include "td_util.h"

/* The block types in enum order (td_dtype_t - TD_DTYPE_FLOAT_COUNT): name and ggml id. */
static const struct {
    const char *name;
    uint32_t ggml;
} block_types[TD_DTYPE_COUNT - TD_DTYPE_FLOAT_COUNT] = {
    {"q8_0", TD_GGML_Q8_0}, {"q4_0", TD_GGML_Q4_0}, {"q4_1", TD_GGML_Q4_1},
    {"q5_0", TD_GGML_Q5_0}, {"q5_1", TD_GGML_Q5_1}, {"q4_k", TD_GGML_Q4_K},
    {"q6_k", TD_GGML_Q6_K}, {"q5_k", TD_GGML_Q5_K}, {"iq4_xs", TD_GGML_IQ4_XS},
};
static const uint32_t float_ggml[TD_DTYPE_FLOAT_COUNT] = {TD_GGML_F32, TD_GGML_F16, TD_GGML_BF16};

uint32_t td_dtype_to_ggml(td_dtype_t t)
{
    TD_ASSERT((unsigned)t < TD_DTYPE_COUNT);
    return td_dtype_is_float(t) ? float_ggml[t] : block_types[t - TD_DTYPE_FLOAT_COUNT].ggml;
}

int td_dtype_from_ggml(uint32_t ggml_type)
{
    for (int t = 0; t < TD_DTYPE_COUNT; t++)
        if (td_dtype_to_ggml((td_dtype_t)t) == ggml_type)
            return t;
    return -1;
}

size_t td_dtype_block_elems(td_dtype_t t)
{
    return td_dtype_is_float(t) ? 1 : td_ggml_type(td_dtype_to_ggml(t))->block_elems;
}

size_t td_dtype_block_bytes(td_dtype_t t)
{
    return td_dtype_is_float(t) ? td_dtype_size(t) : td_ggml_type(td_dtype_to_ggml(t))->block_bytes;
}

size_t td_dtype_bytes(td_dtype_t t, size_t n)
{
    size_t be = td_dtype_block_elems(t);
    TD_ASSERT(n % be == 0);
    return n / be * td_dtype_block_bytes(t);
}

td_status_t td_dtype_parse_quant_flag(const char *s, td_dtype_t *out)
{
    int t = td_dtype_parse(s ? s : "");
    if (t < 0 || !td_dtype_is_block(t) || !td_dtype_can_convert((td_dtype_t)t, TD_F32))
        return td_errorf(TD_ERR_INVALID, "--quant '%s' is not q8_0 or q4_0", s ? s : "");
    *out = (td_dtype_t)t;
    return TD_OK;
}

td_status_t td_dtype_parse_flag(const char *s, td_dtype_t *out)
{
    int t = td_dtype_parse(s ? s : "");
    if (!td_dtype_is_float(t))
        return td_errorf(TD_ERR_INVALID, "--dtype '%s' is not f32, f16 or bf16", s ? s : "");
    *out = (td_dtype_t)t;
    return TD_OK;
}

td_status_t td_dtype_parse_kv_flag(const char *s, td_dtype_t *out)
{
    int t = td_dtype_parse(s ? s : "");
    if (!td_dtype_is_float(t) && t != TD_Q8_0)
        return td_errorf(TD_ERR_INVALID, "--kv-dtype '%s' is not f32, f16, bf16 or q8_0", s ? s : "");
    *out = (td_dtype_t)t;
    return TD_OK;
}

const char *td_dtype_name(td_dtype_t t)
{
    switch (t) {
    case TD_F32: return "f32";
    case TD_F16: return "f16";
    case TD_BF16: return "bf16";
    default: break;
    }
    return td_dtype_is_block(t) ? block_types[t - TD_DTYPE_FLOAT_COUNT].name : "?";
}

int td_dtype_parse(const char *s)
{
    if (!strcmp(s, "f32") || !strcmp(s, "fp32") || !strcmp(s, "float32"))
        return TD_F32;
    if (!strcmp(s, "f16") || !strcmp(s, "fp16") || !strcmp(s, "float16"))
        return TD_F16;
    if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16"))
        return TD_BF16;
    for (int t = TD_DTYPE_FLOAT_COUNT; t < TD_DTYPE_COUNT; t++)
        if (!strcasecmp(s, block_types[t - TD_DTYPE_FLOAT_COUNT].name))
            return t;
    return -1;
}

static float load(const void *src, td_dtype_t t, size_t i)
{
    switch (t) {
    case TD_F32: return ((const float *)src)[i];
    case TD_F16: return td_f16_to_f32(((const uint16_t *)src)[i]);
    case TD_BF16: return td_bf16_to_f32(((const uint16_t *)src)[i]);
    default: break;
    }
    TD_ASSERT(!"load: not a float type");
    return 0.0f;
}

bool td_dtype_can_convert(td_dtype_t dst_t, td_dtype_t src_t)
{
    if (dst_t == src_t)
        return (unsigned)dst_t < TD_DTYPE_COUNT;
    if (td_dtype_is_float(dst_t) && td_dtype_is_float(src_t))
        return true;
    if (td_dtype_is_float(dst_t) && td_dtype_is_block(src_t))
        return td_ggml_type(td_dtype_to_ggml(src_t))->dequantize != NULL;
    return td_dtype_is_float(src_t) && (dst_t == TD_Q8_0 || dst_t == TD_Q4_0);
}

/* float n elements of src_t -> dst_t, both float types */
static void convert_float(void *dst, td_dtype_t dst_t, const void *src, td_dtype_t src_t, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float f = load(src, src_t, i);
        switch (dst_t) {
        case TD_F32: ((float *)dst)[i] = f; break;
        case TD_F16: ((uint16_t *)dst)[i] = td_f32_to_f16(f); break;
        case TD_BF16: ((uint16_t *)dst)[i] = td_f32_to_bf16(f); break;
        default: TD_ASSERT(!"convert_float: not a float type");
        }
    }
}

void td_dtype_convert(void *dst, td_dtype_t dst_t, const void *src, td_dtype_t src_t, size_t n)
{
    TD_ASSERT(td_dtype_can_convert(dst_t, src_t));
    if (dst_t == src_t) {
        memcpy(dst, src, td_dtype_bytes(src_t, n));
        return;
    }
    if (td_dtype_is_float(dst_t) && td_dtype_is_float(src_t)) {
        convert_float(dst, dst_t, src, src_t, n);
        return;
    }
    /* one side is a block type: a block (at most 256 weights) at a time through f32 */
    td_dtype_t bt = td_dtype_is_block(src_t) ? src_t : dst_t;
    size_t be = td_dtype_block_elems(bt), bb = td_dtype_block_bytes(bt);
    TD_ASSERT(n % be == 0);
    float tmp[TD_QK_K];
    for (size_t b = 0; b < n / be; b++) {
        if (td_dtype_is_block(src_t)) {
            td_ggml_type(td_dtype_to_ggml(src_t))->dequantize((const unsigned char *)src + b * bb, tmp, be);
            convert_float((unsigned char *)dst + b * be * td_dtype_size(dst_t), dst_t, tmp, TD_F32, be);
        } else {
            const void *in = (const unsigned char *)src + b * be * td_dtype_size(src_t);
            if (src_t != TD_F32) {
                convert_float(tmp, TD_F32, in, src_t, be);
                in = tmp;
            }
            if (dst_t == TD_Q8_0)
                td_quant_quantize_q8_0(in, (unsigned char *)dst + b * bb, be);
            else
                td_quant_quantize_q4_0(in, (unsigned char *)dst + b * bb, be);
        }
    }
}
