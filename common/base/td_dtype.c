/*
 * td_dtype: names and host-side conversion of element types.
 */
#include "td_dtype.h"

#include <stdint.h>
#include <string.h>

#include "td_util.h"

td_status_t td_dtype_parse_flag(const char *s, td_dtype_t *out)
{
    int t = td_dtype_parse(s);
    if (t < 0)
        return td_errorf(TD_ERR_INVALID, "--dtype '%s' is not f32, f16 or bf16", s ? s : "");
    *out = (td_dtype_t)t;
    return TD_OK;
}

const char *td_dtype_name(td_dtype_t t)
{
    switch (t) {
    case TD_F32: return "f32";
    case TD_F16: return "f16";
    case TD_BF16: return "bf16";
    }
    return "?";
}

int td_dtype_parse(const char *s)
{
    if (!strcmp(s, "f32") || !strcmp(s, "fp32") || !strcmp(s, "float32"))
        return TD_F32;
    if (!strcmp(s, "f16") || !strcmp(s, "fp16") || !strcmp(s, "float16"))
        return TD_F16;
    if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16"))
        return TD_BF16;
    return -1;
}

static float load(const void *src, td_dtype_t t, size_t i)
{
    switch (t) {
    case TD_F32: return ((const float *)src)[i];
    case TD_F16: return td_f16_to_f32(((const uint16_t *)src)[i]);
    case TD_BF16: return td_bf16_to_f32(((const uint16_t *)src)[i]);
    }
    return 0.0f;
}

void td_dtype_convert(void *dst, td_dtype_t dst_t, const void *src, td_dtype_t src_t, size_t n)
{
    if (dst_t == src_t) {
        memcpy(dst, src, n * td_dtype_size(src_t));
        return;
    }
    for (size_t i = 0; i < n; i++) {
        float f = load(src, src_t, i);
        switch (dst_t) {
        case TD_F32: ((float *)dst)[i] = f; break;
        case TD_F16: ((uint16_t *)dst)[i] = td_f32_to_f16(f); break;
        case TD_BF16: ((uint16_t *)dst)[i] = td_f32_to_bf16(f); break;
        }
    }
}
