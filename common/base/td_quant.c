/*
 * td_quant: the scalar reference (de)quantizers of the GGML block formats (td_quant.h).
 *
 * Exactness: each weight is computed with the same f32 operations as ggml's reference and
 * gguf-py, and each is the exact value rounded once. The partial products are exact in f32
 * (an f16 scale has 11 significant bits, a quant at most 6, a sub-scale at most 8), so Q8_0,
 * Q4_0, Q5_0 and IQ4_XS (d * (ls - 32) * value: at most 24 bits) do not round at all, Q4_1,
 * Q5_1, Q4_K and Q5_K round only in their final add or subtract, and Q6_K's d * scale * q (up
 * to 25 bits) rounds once whichever product comes first. An FMA would not change a result either, since its product is exact too.
 */
#include "td_quant.h"

#include <math.h>

#include "td_util.h"

void td_quant_dequantize_q8_0(const void *src, float *dst, size_t n)
{
    TD_ASSERT(n % TD_QK == 0);
    const td_block_q8_0_t *b = src;
    for (size_t i = 0; i < n / TD_QK; i++, dst += TD_QK) {
        float d = td_f16_to_f32(b[i].d);
        for (int j = 0; j < TD_QK; j++)
            dst[j] = (float)b[i].qs[j] * d;
    }
}

void td_quant_dequantize_q4_0(const void *src, float *dst, size_t n)
{
    TD_ASSERT(n % TD_QK == 0);
    const td_block_q4_0_t *b = src;
    for (size_t i = 0; i < n / TD_QK; i++, dst += TD_QK) {
        float d = td_f16_to_f32(b[i].d);
        for (int j = 0; j < TD_QK / 2; j++) {
            dst[j] = d * (float)((b[i].qs[j] & 0x0f) - 8);
            dst[j + TD_QK / 2] = d * (float)((b[i].qs[j] >> 4) - 8);
        }
    }
}

void td_quant_dequantize_q4_1(const void *src, float *dst, size_t n)
{
    TD_ASSERT(n % TD_QK == 0);
    const td_block_q4_1_t *b = src;
    for (size_t i = 0; i < n / TD_QK; i++, dst += TD_QK) {
        float d = td_f16_to_f32(b[i].d);
        float m = td_f16_to_f32(b[i].m);
        for (int j = 0; j < TD_QK / 2; j++) {
            dst[j] = d * (float)(b[i].qs[j] & 0x0f) + m;
            dst[j + TD_QK / 2] = d * (float)(b[i].qs[j] >> 4) + m;
        }
    }
}

/* Bit i of a Q5 block's qh word: the fifth bit of weight i, moved to bit 4. */
static int q5_high_bit(const uint8_t qh[4], int i)
{
    return ((qh[i / 8] >> (i % 8)) & 1) << 4;
}

void td_quant_dequantize_q5_0(const void *src, float *dst, size_t n)
{
    TD_ASSERT(n % TD_QK == 0);
    const td_block_q5_0_t *b = src;
    for (size_t i = 0; i < n / TD_QK; i++, dst += TD_QK) {
        float d = td_f16_to_f32(b[i].d);
        for (int j = 0; j < TD_QK / 2; j++) {
            int q0 = (b[i].qs[j] & 0x0f) | q5_high_bit(b[i].qh, j);
            int q1 = (b[i].qs[j] >> 4) | q5_high_bit(b[i].qh, j + TD_QK / 2);
            dst[j] = d * (float)(q0 - 16);
            dst[j + TD_QK / 2] = d * (float)(q1 - 16);
        }
    }
}

void td_quant_dequantize_q5_1(const void *src, float *dst, size_t n)
{
    TD_ASSERT(n % TD_QK == 0);
    const td_block_q5_1_t *b = src;
    for (size_t i = 0; i < n / TD_QK; i++, dst += TD_QK) {
        float d = td_f16_to_f32(b[i].d);
        float m = td_f16_to_f32(b[i].m);
        for (int j = 0; j < TD_QK / 2; j++) {
            int q0 = (b[i].qs[j] & 0x0f) | q5_high_bit(b[i].qh, j);
            int q1 = (b[i].qs[j] >> 4) | q5_high_bit(b[i].qh, j + TD_QK / 2);
            dst[j] = d * (float)q0 + m;
            dst[j + TD_QK / 2] = d * (float)q1 + m;
        }
    }
}

void td_quant_q4_k_scale_min(const uint8_t scales[12], int s, int *sc, int *mn)
{
    if (s < 4) {
        *sc = scales[s] & 63;
        *mn = scales[s + 4] & 63;
    } else {
        *sc = (scales[s + 4] & 0x0f) | ((scales[s - 4] >> 6) << 4);
        *mn = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
    }
}

void td_quant_dequantize_q4_k(const void *src, float *dst, size_t n)
{
    TD_ASSERT(n % TD_QK_K == 0);
    const td_block_q4_k_t *b = src;
    for (size_t i = 0; i < n / TD_QK_K; i++) {
        float d = td_f16_to_f32(b[i].d);
        float dmin = td_f16_to_f32(b[i].dmin);
        for (int c = 0; c < 4; c++) { /* chunk c: sub-blocks 2c (low) and 2c + 1 (high) */
            const uint8_t *q = b[i].qs + 32 * c;
            int sc, mn;
            td_quant_q4_k_scale_min(b[i].scales, 2 * c, &sc, &mn);
            float d_lo = d * (float)sc, m_lo = dmin * (float)mn;
            td_quant_q4_k_scale_min(b[i].scales, 2 * c + 1, &sc, &mn);
            float d_hi = d * (float)sc, m_hi = dmin * (float)mn;
            for (int l = 0; l < 32; l++) {
                dst[l] = d_lo * (float)(q[l] & 0x0f) - m_lo;
                dst[l + 32] = d_hi * (float)(q[l] >> 4) - m_hi;
            }
            dst += 64;
        }
    }
}

void td_quant_q5_k_piece(const td_block_q5_k_t *b, int s, uint8_t q[32])
{
    const uint8_t *qs = b->qs + 32 * (s / 2);
    for (int l = 0; l < 32; l++)
        q[l] = (uint8_t)(((qs[l] >> (4 * (s % 2))) & 15) | ((b->qh[l] >> s) & 1) << 4);
}

void td_quant_dequantize_q5_k(const void *src, float *dst, size_t n)
{
    TD_ASSERT(n % TD_QK_K == 0);
    const td_block_q5_k_t *b = src;
    for (size_t i = 0; i < n / TD_QK_K; i++) {
        float d = td_f16_to_f32(b[i].d);
        float dmin = td_f16_to_f32(b[i].dmin);
        for (int s = 0; s < 8; s++, dst += 32) {
            int sc, mn;
            uint8_t q[32];
            td_quant_q4_k_scale_min(b[i].scales, s, &sc, &mn);
            td_quant_q5_k_piece(&b[i], s, q);
            float dl = d * (float)sc, ml = dmin * (float)mn;
            for (int l = 0; l < 32; l++)
                dst[l] = dl * (float)q[l] - ml;
        }
    }
}

const int8_t td_quant_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};

int td_quant_iq4_xs_scale(const td_block_iq4_xs_t *b, int s)
{
    int ls = ((b->scales_l[s / 2] >> (4 * (s % 2))) & 15) | ((b->scales_h >> (2 * s)) & 3) << 4;
    return ls - 32;
}

void td_quant_dequantize_iq4_xs(const void *src, float *dst, size_t n)
{
    TD_ASSERT(n % TD_QK_K == 0);
    const td_block_iq4_xs_t *b = src;
    for (size_t i = 0; i < n / TD_QK_K; i++) {
        float d = td_f16_to_f32(b[i].d);
        for (int s = 0; s < 8; s++, dst += 32) {
            const uint8_t *qs = b[i].qs + 16 * s;
            float dl = d * (float)td_quant_iq4_xs_scale(&b[i], s);
            for (int j = 0; j < 16; j++) {
                dst[j] = dl * (float)td_quant_iq4nl_values[qs[j] & 15];
                dst[j + 16] = dl * (float)td_quant_iq4nl_values[qs[j] >> 4];
            }
        }
    }
}

void td_quant_q6_k_piece(const td_block_q6_k_t *b, int j, uint8_t q[32])
{
    /* piece j = 4h + c: half h, low nibbles of ql[64h + 32 (c % 2) + l] (c < 2) or high ones,
       bits 2c, 2c + 1 of qh[32h + l] */
    int h = j / 4, c = j % 4;
    const uint8_t *ql = b->ql + 64 * h + 32 * (c % 2), *qh = b->qh + 32 * h;
    for (int l = 0; l < 32; l++)
        q[l] = (uint8_t)(((ql[l] >> (4 * (c / 2))) & 15) | ((qh[l] >> (2 * c)) & 3) << 4);
}

void td_quant_dequantize_q6_k(const void *src, float *dst, size_t n)
{
    TD_ASSERT(n % TD_QK_K == 0);
    const td_block_q6_k_t *b = src;
    for (size_t i = 0; i < n / TD_QK_K; i++) {
        float d = td_f16_to_f32(b[i].d);
        for (int h = 0; h < 2; h++) { /* two halves of 128 weights */
            const uint8_t *ql = b[i].ql + 64 * h;
            const uint8_t *qh = b[i].qh + 32 * h;
            const int8_t *sc = b[i].scales + 8 * h;
            for (int l = 0; l < 32; l++) {
                int q[4] = {
                    (ql[l] & 0x0f) | ((qh[l] >> 0) & 3) << 4,
                    (ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4,
                    (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4,
                    (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4,
                };
                for (int k = 0; k < 4; k++) /* weight l + 32k, scale (l + 32k) / 16 */
                    dst[l + 32 * k] = (d * (float)sc[l / 16 + 2 * k]) * (float)(q[k] - 32);
            }
            dst += 128;
        }
    }
}

void td_quant_quantize_q8_0(const float *src, void *dst, size_t n)
{
    TD_ASSERT(n % TD_QK == 0);
    td_block_q8_0_t *b = dst;
    for (size_t i = 0; i < n / TD_QK; i++, src += TD_QK) {
        float amax = 0.0f;
        for (int j = 0; j < TD_QK; j++)
            amax = fmaxf(amax, fabsf(src[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = td_f32_to_f16(d);
        for (int j = 0; j < TD_QK; j++)
            b[i].qs[j] = (int8_t)roundf(src[j] * id); /* |x * id| <= 127 (+ rounding) */
    }
}

void td_quant_quantize_q4_0(const float *src, void *dst, size_t n)
{
    TD_ASSERT(n % TD_QK == 0);
    td_block_q4_0_t *b = dst;
    for (size_t i = 0; i < n / TD_QK; i++, src += TD_QK) {
        float amax = 0.0f, max = 0.0f; /* max: the signed value of the first largest |x| */
        for (int j = 0; j < TD_QK; j++) {
            if (fabsf(src[j]) > amax) {
                amax = fabsf(src[j]);
                max = src[j];
            }
        }
        float d = max / -8.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = td_f32_to_f16(d);
        for (int j = 0; j < TD_QK / 2; j++) {
            /* x * id is in [-8, 8]: + 8.5 is in [0.5, 16.5], truncation gives 0..16 */
            int q0 = TD_MIN(15, (int)(src[j] * id + 8.5f));
            int q1 = TD_MIN(15, (int)(src[j + TD_QK / 2] * id + 8.5f));
            b[i].qs[j] = (uint8_t)(q0 | q1 << 4);
        }
    }
}

static const td_ggml_type_t ggml_types[] = {
    [TD_GGML_F32] = {"F32", 1, 4, NULL},
    [TD_GGML_F16] = {"F16", 1, 2, NULL},
    [TD_GGML_Q4_0] = {"Q4_0", TD_QK, sizeof(td_block_q4_0_t), td_quant_dequantize_q4_0},
    [TD_GGML_Q4_1] = {"Q4_1", TD_QK, sizeof(td_block_q4_1_t), td_quant_dequantize_q4_1},
    [TD_GGML_Q5_0] = {"Q5_0", TD_QK, sizeof(td_block_q5_0_t), td_quant_dequantize_q5_0},
    [TD_GGML_Q5_1] = {"Q5_1", TD_QK, sizeof(td_block_q5_1_t), td_quant_dequantize_q5_1},
    [TD_GGML_Q8_0] = {"Q8_0", TD_QK, sizeof(td_block_q8_0_t), td_quant_dequantize_q8_0},
    [9] = {"Q8_1", 0, 0, NULL},
    [TD_GGML_Q2_K] = {"Q2_K", TD_QK_K, 84, NULL},
    [TD_GGML_Q3_K] = {"Q3_K", TD_QK_K, 110, NULL},
    [TD_GGML_Q4_K] = {"Q4_K", TD_QK_K, sizeof(td_block_q4_k_t), td_quant_dequantize_q4_k},
    [TD_GGML_Q5_K] = {"Q5_K", TD_QK_K, sizeof(td_block_q5_k_t), td_quant_dequantize_q5_k},
    [TD_GGML_Q6_K] = {"Q6_K", TD_QK_K, sizeof(td_block_q6_k_t), td_quant_dequantize_q6_k},
    [TD_GGML_Q8_K] = {"Q8_K", TD_QK_K, 292, NULL},
    [16] = {"IQ2_XXS", 0, 0, NULL},
    [17] = {"IQ2_XS", 0, 0, NULL},
    [18] = {"IQ3_XXS", 0, 0, NULL},
    [19] = {"IQ1_S", 0, 0, NULL},
    [20] = {"IQ4_NL", 0, 0, NULL},
    [21] = {"IQ3_S", 0, 0, NULL},
    [22] = {"IQ2_S", 0, 0, NULL},
    [TD_GGML_IQ4_XS] = {"IQ4_XS", TD_QK_K, sizeof(td_block_iq4_xs_t), td_quant_dequantize_iq4_xs},
    [24] = {"I8", 0, 0, NULL},
    [25] = {"I16", 0, 0, NULL},
    [26] = {"I32", 0, 0, NULL},
    [27] = {"I64", 0, 0, NULL},
    [28] = {"F64", 0, 0, NULL},
    [29] = {"IQ1_M", 0, 0, NULL},
    [TD_GGML_BF16] = {"BF16", 1, 2, NULL},
    [34] = {"TQ1_0", 0, 0, NULL},
    [35] = {"TQ2_0", 0, 0, NULL},
    [39] = {"MXFP4", 0, 0, NULL},
};

const td_ggml_type_t *td_ggml_type(uint32_t type)
{
    return type < TD_ARRAY_LEN(ggml_types) && ggml_types[type].name ? &ggml_types[type] : NULL;
}
