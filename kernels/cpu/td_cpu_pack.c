/*
 * td_cpu_pack: the packed layout, activation rows for it, and its int8 kernels: scalar (the
 * reference, here), AVX2 (maddubs, td_cpu_pack_avx2.c) and AVX-512 VNNI (vpdpbusd,
 * td_cpu_pack_avx512.c), bit-identical (the header's sum order). The SIMD tables are compiled
 * with target attributes and chosen at run time.
 *
 * Shapes of the kernels: a call walks its groups one by one; per group the activation rows
 * go in tiles (VNNI: 8 rows; AVX2 two-byte prefill: int16 tiles of 8 rows per half group of
 * 8 weight rows, or 4 rows by the whole group; AVX2 one-byte: 4 rows per half), and for each
 * block the group's weight vectors are loaded and unpacked once, then dotted with every
 * row of the tile. Tiles keep one f32 accumulator vector per activation row for the whole
 * of k, so no partial sums leave registers; at decode (m = 1..4) this is one pass over the
 * group's bytes, which is what bounds batch-1 speed.
 */
#include "td_cpu_pack_impl.h"

bool td_cpu_pack_supports(td_dtype_t type)
{
    return type == TD_Q8_0 || type == TD_Q4_0 || type == TD_Q4_1 || type == TD_Q4_K || type == TD_Q5_K ||
           type == TD_Q6_K || type == TD_IQ4_XS;
}

size_t td_cpu_pack_group_bytes(td_dtype_t type, size_t k)
{
    TD_ASSERT(td_cpu_pack_supports(type) && k % td_dtype_block_elems(type) == 0);
    size_t b = k / TD_QK * (quant_bytes(type) + scale_bytes(type));
    return (b + 63) & ~(size_t)63;
}

size_t td_cpu_pack_bytes(td_dtype_t type, size_t n, size_t k)
{
    return (n + ROWS - 1) / ROWS * td_cpu_pack_group_bytes(type, k);
}

/* Row j's place in a packed matrix: its group's start (blocks and scales at block_at and
 * chunk_scales_at from there) and its row within the group */
TD_INLINE unsigned char *group_of(void *dst, td_dtype_t t, size_t k, size_t j, size_t *r_p)
{
    *r_p = j % ROWS;
    return (unsigned char *)dst + j / ROWS * td_cpu_pack_group_bytes(t, k);
}

/* A 4-bit block's 16 stored bytes (byte e: weight e low, weight e + 16 high) into row r of
 * its 4 quant vectors (the header's Q4 layout) */
TD_INLINE void place_q4(unsigned char *q, size_t r, const uint8_t qs[TD_QK / 2])
{
    for (int e = 0; e < TD_QK / 2; e++)
        q[64 * (e / 4) + 4 * r + e % 4] = qs[e];
}

/* Q4_K and Q5_K: sub-block s of a super-block becomes a 32-weight block of the Q4 layout of
 * its low 4 bits (byte e: weight e low, weight e + 16 high), and for Q5_K a fifth vector of its
 * fifth bits: byte 4r + i holds those of weights i, 4 + i, 8 + i, 12 + i at bits 0..3 and of
 * weights 16 + i, ... at bits 4..7 (the header's layout); d, dmin and the 6-bit sc, mn kept as
 * stored */
static void pack_k4(void *dst, const void *w, td_dtype_t t, size_t n, size_t k)
{
    size_t nb = k / TD_QK, row_bytes = td_dtype_bytes(t, k);
    for (size_t j = 0; j < n; j++) {
        size_t r;
        unsigned char *gq = group_of(dst, t, k, j, &r);
        const unsigned char *row = (const unsigned char *)w + j * row_bytes;
        for (size_t sb = 0; sb < k / TD_QK_K; sb++) {
            const td_block_q4_k_t *b4 = t == TD_Q4_K ? (const td_block_q4_k_t *)row + sb : NULL;
            const td_block_q5_k_t *b5 = t == TD_Q5_K ? (const td_block_q5_k_t *)row + sb : NULL;
            unsigned char *ks = gq + chunk_scales_at(t, nb, sb * 8);
            memcpy(ks + K_D + 2 * r, b4 ? &b4->d : &b5->d, 2);
            memcpy(ks + K_DMIN + 2 * r, b4 ? &b4->dmin : &b5->dmin, 2);
            for (int sub = 0; sub < 8; sub++) {
                uint8_t u[TD_QK], qs[TD_QK / 2];
                int sc, mn;
                if (b5) {
                    td_quant_q5_k_piece(b5, sub, u);
                } else { /* chunk sub / 2: sub-block 2c in the low nibbles, 2c + 1 in the high ones */
                    for (int e = 0; e < TD_QK; e++)
                        u[e] = (uint8_t)((b4->qs[32 * (sub / 2) + e] >> (4 * (sub % 2))) & 15);
                }
                unsigned char *q = gq + block_at(t, sb * 8 + (size_t)sub);
                for (int i = 0; i < 16; i++) {
                    qs[i] = (uint8_t)((u[i] & 15) | (u[16 + i] & 15) << 4);
                    if (b5)
                        q[256 + 4 * r + i % 4] |=
                            (unsigned char)((u[i] >> 4) << (i / 4) | (u[16 + i] >> 4) << (4 + i / 4));
                }
                place_q4(q, r, qs);
                td_quant_q4_k_scale_min(b4 ? b4->scales : b5->scales, sub, &sc, &mn);
                ks[K_SC(sub) + r] = (unsigned char)sc;
                ks[K_MN(sub) + r] = (unsigned char)mn;
            }
        }
    }
}

/* IQ4_XS: each 32-weight sub-block's 4-bit indices in the Q4 layout (as stored: byte j holds
 * weights j and j + 16), f16 d and the int8 ls - 32 of each sub-block kept */
static void pack_iq4_xs(void *dst, const void *w, size_t n, size_t k)
{
    size_t nb = k / TD_QK;
    for (size_t j = 0; j < n; j++) {
        size_t r;
        unsigned char *gq = group_of(dst, TD_IQ4_XS, k, j, &r);
        const td_block_iq4_xs_t *row =
            (const td_block_iq4_xs_t *)((const unsigned char *)w + j * td_dtype_bytes(TD_IQ4_XS, k));
        for (size_t sb = 0; sb < k / TD_QK_K; sb++) {
            const td_block_iq4_xs_t *blk = &row[sb];
            unsigned char *ks = gq + chunk_scales_at(TD_IQ4_XS, nb, sb * 8);
            memcpy(ks + 2 * r, &blk->d, 2);
            for (int sub = 0; sub < 8; sub++) {
                place_q4(gq + block_at(TD_IQ4_XS, sb * 8 + (size_t)sub), r, blk->qs + 16 * sub);
                ks[XS_SC(sub) + r] = (unsigned char)(int8_t)td_quant_iq4_xs_scale(blk, sub);
            }
        }
    }
}

/* Q6_K: block j of a super-block (32 weights, two 16-weight scales) becomes the Q4 layout of
 * its low 4 bits (4 vectors) and two vectors of its high 2 bits: vector 4 byte 4r + i holds
 * weights i, 4 + i, 8 + i, 12 + i at bits 0-1, 2-3, 4-5, 6-7, vector 5 the same for weights
 * 16 + ... (the header's layout); d and the scales kept as stored */
static void pack_q6_k(void *dst, const void *w, size_t n, size_t k)
{
    size_t nb = k / TD_QK;
    for (size_t jr = 0; jr < n; jr++) {
        size_t r;
        unsigned char *gq = group_of(dst, TD_Q6_K, k, jr, &r);
        const td_block_q6_k_t *row = (const td_block_q6_k_t *)((const unsigned char *)w + jr * td_dtype_bytes(TD_Q6_K, k));
        for (size_t sb = 0; sb < k / TD_QK_K; sb++) {
            const td_block_q6_k_t *blk = &row[sb];
            unsigned char *ks = gq + chunk_scales_at(TD_Q6_K, nb, sb * 8);
            memcpy(ks + 2 * r, &blk->d, 2);
            for (int j = 0; j < 8; j++) {
                uint8_t u[TD_QK], qs[TD_QK / 2];
                td_quant_q6_k_piece(blk, j, u);
                unsigned char *q = gq + block_at(TD_Q6_K, sb * 8 + (size_t)j);
                for (int i = 0; i < 16; i++) {
                    int v = i / 4, e = i % 4; /* weights i and 16 + i: vector v, byte 4r + e */
                    qs[i] = (uint8_t)((u[i] & 15) | (u[16 + i] & 15) << 4);
                    q[256 + 4 * r + e] |= (unsigned char)((u[i] >> 4) << (2 * v));
                    q[320 + 4 * r + e] |= (unsigned char)((u[16 + i] >> 4) << (2 * v));
                }
                place_q4(q, r, qs);
                ks[K6_SC(j, 0) + r] = (unsigned char)blk->scales[2 * j];
                ks[K6_SC(j, 1) + r] = (unsigned char)blk->scales[2 * j + 1];
            }
        }
    }
}

void td_cpu_pack_weights(void *dst, const void *w, td_dtype_t type, size_t n, size_t k, bool one_byte)
{
    size_t nb = k / TD_QK, row_bytes = td_dtype_bytes(type, k);
    /* zero padding rows: quants 0 and scales +0.0 give outputs nobody stores */
    memset(dst, 0, td_cpu_pack_bytes(type, n, k));
    if (k_scales(type)) {
        pack_k4(dst, w, type, n, k);
        return;
    }
    if (type == TD_Q6_K) {
        pack_q6_k(dst, w, n, k);
        return;
    }
    if (type == TD_IQ4_XS) {
        pack_iq4_xs(dst, w, n, k);
        return;
    }
    for (size_t j = 0; j < n; j++) {
        size_t r;
        unsigned char *gq = group_of(dst, type, k, j, &r);
        const unsigned char *row = (const unsigned char *)w + j * row_bytes;
        for (size_t b = 0; b < nb; b++) {
            uint16_t d, m = 0;
            unsigned char *q = gq + block_at(type, b), *s = gq + block_scales_at(type, nb, b);
            if (type == TD_Q8_0) {
                const td_block_q8_0_t *blk = (const td_block_q8_0_t *)row + b;
                d = blk->d;
                for (int e = 0; e < TD_QK; e++)
                    q[64 * (e / 4) + 4 * r + e % 4] = (unsigned char)(one_byte ? blk->qs[e] : blk->qs[e] + 128);
            } else {
                const uint8_t *qs;
                if (type == TD_Q4_0) {
                    const td_block_q4_0_t *blk = (const td_block_q4_0_t *)row + b;
                    d = blk->d;
                    qs = blk->qs;
                } else {
                    const td_block_q4_1_t *blk = (const td_block_q4_1_t *)row + b;
                    d = blk->d;
                    m = blk->m;
                    qs = blk->qs;
                }
                place_q4(q, r, qs);
            }
            /* f16 bits, stored byte-wise (s is not 2-aligned for every caller's dst) */
            memcpy(s + 2 * r, &d, 2);
            if (type == TD_Q4_1)
                memcpy(s + 2 * (ROWS + r), &m, 2);
        }
    }
}

size_t td_cpu_pack_act_stride(size_t k)
{
    return act_q16_at(k) + 2 * k; /* k % 32 == 0: a multiple of 64 */
}
/* The scalar quantizer of one block (the reference the SIMD one equals bit for bit):
 * d = amax / 127 (amax ignores NaN), v = x * (1 / d) clamped to [-127, 127] (NaN to -127),
 * hi = roundf(v), lo = roundf((v - hi) * 254) (v - hi is exact). Returns sum Q, and the sum
 * of the first 16 in *first_p. amax_in >= 0: a super-block's amax sets d instead (act_super). */
TD_INLINE int32_t act_block_scalar(const float *x, int8_t *hi, int8_t *lo, float *e_p, int32_t *first_p, bool one,
                                   float amax_in)
{
    bool nan;
    float amax = act_amax(x, TD_QK, &nan);
    float d = (amax_in >= 0.0f ? amax_in : amax) / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < TD_QK; i++) {
        float v = x[i] * id;
        v = v >= -127.0f ? v : -127.0f;
        v = v <= 127.0f ? v : 127.0f;
        float h = roundf(v);
        float l = one ? 0.0f : roundf((v - h) * (float)WIDE);
        hi[i] = (int8_t)h;
        lo[i] = (int8_t)l;
        sum += WIDE * (int32_t)h + (int32_t)l;
        if (i == TD_QK / 2 - 1)
            *first_p = sum;
    }
    *e_p = nan ? NAN : d / (float)WIDE;
    return sum;
}

static void act_row_scalar(const float *x, void *av, td_dtype_t type, size_t k, bool one_byte)
{
    act_row_blocks(act_block_scalar, x, av, type, k, one_byte, true); /* the reference: every part */
}

void td_cpu_pack_act_row(const td_cpu_pack_ops_t *ops, const float *x, void *a, td_dtype_t type, size_t k,
                         bool one_byte)
{
    TD_ASSERT(k % TD_QK == 0 && td_cpu_pack_supports(type));
    ops->act_row(x, a, type, k, one_byte);
}

/* ---- scalar reference ------------------------------------------------------------------ */

/* u of (row r, weight e) in a block's quants (Q8_0's as the layout of one-byte or two-byte
 * rows stores them: q or u) */
TD_INLINE int unsigned_quant(td_dtype_t t, bool one, const unsigned char *q, size_t r, int e)
{
    if (t == TD_Q8_0)
        return one ? (int8_t)q[64 * (e / 4) + 4 * r + e % 4] + 128 : q[64 * (e / 4) + 4 * r + e % 4];
    if (t == TD_Q6_K) {
        int i = e % 16, lo = q[64 * (i / 4) + 4 * r + i % 4] >> (e < 16 ? 0 : 4) & 15;
        int hi = q[(e < 16 ? 256 : 320) + 4 * r + i % 4] >> (2 * (i / 4)) & 3;
        return lo | hi << 4;
    }
    unsigned char byte = q[64 * ((e % 16) / 4) + 4 * r + e % 4];
    int nibble = e < 16 ? byte & 15 : byte >> 4;
    if (t == TD_Q5_K)
        return nibble | (q[256 + 4 * r + e % 4] >> ((e % 16) / 4 + (e < 16 ? 0 : 4)) & 1) << 4;
    if (t == TD_IQ4_XS)
        return td_quant_iq4nl_values[nibble] + 128;
    return nibble;
}

TD_INLINE float half_at(const unsigned char *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return td_f16_to_f32(h);
}

/* A block's weight scale d_w and offset m of row r (Q4_K, Q5_K: d * sc and -(dmin * mn),
 * IQ4_XS: d * (ls - 32), exact in f32; Q4_0, Q8_0, IQ4_XS: m unused) */
TD_INLINE void row_scales(td_dtype_t t, const unsigned char *gq, size_t nb, size_t b, size_t r, float *d_p,
                          float *m_p)
{
    if (t == TD_IQ4_XS) {
        const unsigned char *ks = gq + chunk_scales_at(t, nb, b);
        *d_p = half_at(ks + 2 * r) * (float)(int8_t)ks[XS_SC(b % 8) + r];
        *m_p = 0.0f;
        return;
    }
    if (k_scales(t)) {
        const unsigned char *ks = gq + chunk_scales_at(t, nb, b);
        size_t sub = b % 8;
        *d_p = half_at(ks + K_D + 2 * r) * (float)ks[K_SC(sub) + r];
        *m_p = -(half_at(ks + K_DMIN + 2 * r) * (float)ks[K_MN(sub) + r]);
        return;
    }
    const unsigned char *s = gq + block_scales_at(t, nb, b);
    *d_p = half_at(s + 2 * r);
    *m_p = t == TD_Q4_1 ? half_at(s + 2 * (ROWS + r)) : 0.0f;
}

/* Q6_K's block: two exact integer halves, each with its own scale (the header's contract) */
TD_INLINE float q6_k_block_scalar(const unsigned char *gq, size_t nb, size_t b, size_t r,
                                  const int8_t *hi, const int8_t *lo, float ea, int32_t c, int32_t c2, float acc)
{
    const unsigned char *ks = gq + chunk_scales_at(TD_Q6_K, nb, b);
    float d = half_at(ks + 2 * r);
    int32_t p[2] = {c, c2};
    for (int e = 0; e < TD_QK; e++)
        p[e / 16] += unsigned_quant(TD_Q6_K, false, gq + block_at(TD_Q6_K, b), r, e) *
                     (WIDE * hi[b * TD_QK + e] + lo[b * TD_QK + e]);
    for (int h = 0; h < 2; h++)
        acc = fmaf((float)p[h], d * (float)(int8_t)ks[K6_SC(b % 8, h) + r] * ea, acc);
    return acc;
}

/* A super-block row's super-block s (act_super: one-byte IQ4_XS, Q4_K and Q6_K rows) of weight
 * row r: the exact integer P = sum over its blocks of sc_b (c_b + sum u hi) (IQ4_XS: sc = ls -
 * 32, c_b = -128 S_b, so P = sum sc_b sum value hi; Q4_K: the 6-bit sc, no c; Q6_K: per half h
 * of a block its int8 sc_bh (c_bh + sum over the half of u hi), c_b0 = c, c_b1 = c2 = -32
 * times the half's sum of hi, so P = sum sc_bh sum (u - 32) hi), then one
 * acc = fmaf((float)P, d * E, acc), E the super-block's step; Q4_K's offset terms stay a block
 * each, m_b = -(dmin * mn_b) times c_b = E S_b, into macc (the header's contract) */
TD_INLINE float super_block_scalar(td_dtype_t t, const unsigned char *gq, size_t nb, size_t s, size_t r,
                                   const int8_t *hi, const unsigned char *ev, const unsigned char *c, float acc,
                                   float *macc_p)
{
    const unsigned char *ks = gq + chunk_scales_at(t, nb, PACK_CHUNK * s);
    int32_t big = 0;
    for (size_t b = PACK_CHUNK * s; b < PACK_CHUNK * (s + 1); b++) {
        if (t == TD_Q6_K) { /* c2 (act_c2) follows c's nb words */
            for (int h = 0; h < 2; h++) {
                int32_t p;
                memcpy(&p, c + 4 * (h * nb + b), 4);
                for (int e = 16 * h; e < 16 * h + 16; e++)
                    p += unsigned_quant(t, true, gq + block_at(t, b), r, e) * hi[b * TD_QK + e];
                big += p * (int32_t)(int8_t)ks[K6_SC(b % 8, h) + r];
            }
            continue;
        }
        int32_t p = 0;
        if (t == TD_IQ4_XS)
            memcpy(&p, c + 4 * b, 4);
        for (int e = 0; e < TD_QK; e++)
            p += unsigned_quant(t, true, gq + block_at(t, b), r, e) * hi[b * TD_QK + e];
        big += p * (t == TD_IQ4_XS ? (int32_t)(int8_t)ks[XS_SC(b % 8) + r] : (int32_t)ks[K_SC(b % 8) + r]);
        if (t == TD_Q4_K) {
            float dw, mw, cf;
            row_scales(t, gq, nb, b, r, &dw, &mw);
            memcpy(&cf, c + 4 * b, 4);
            *macc_p = fmaf(mw, cf, *macc_p);
        }
    }
    float e;
    memcpy(&e, ev + 4 * PACK_CHUNK * s, 4);
    return fmaf((float)big, half_at(ks + (t == TD_Q4_K ? K_D : 0) + 2 * r) * e, acc);
}

TD_INLINE void kernel_scalar(td_dtype_t t, bool one, const void *wp, size_t g0, size_t g1, size_t k,
                             const void *av, size_t m, float *y, size_t ldy)
{
    size_t nb = k / TD_QK, gb = td_cpu_pack_group_bytes(t, k);
    size_t stride = td_cpu_pack_act_stride(k);
    for (size_t g = g0; g < g1; g++) {
        const unsigned char *gq = (const unsigned char *)wp + g * gb;
        for (size_t i = 0; i < m; i++) {
            const unsigned char *a = (const unsigned char *)av + i * stride;
            const int8_t *hi = act_hi(a), *lo = act_lo(a, k);
            const unsigned char *ev = act_e(a, k), *c = act_c(a, k);
            for (size_t r = 0; r < ROWS; r++) {
                float acc = 0.0f, macc = 0.0f;
                for (size_t b = 0; b < nb && act_super(t, one); b += PACK_CHUNK)
                    acc = super_block_scalar(t, gq, nb, b / PACK_CHUNK, r, hi, ev, c, acc, &macc);
                for (size_t b = 0; b < nb && !act_super(t, one); b++) {
                    if (t == TD_Q6_K) {
                        float ea;
                        int32_t cb, c2;
                        memcpy(&ea, ev + 4 * b, 4);
                        memcpy(&cb, c + 4 * b, 4);
                        memcpy(&c2, act_c2(a, k) + 4 * b, 4);
                        acc = q6_k_block_scalar(gq, nb, b, r, hi, lo, ea, cb, c2, acc);
                        continue;
                    }
                    int32_t p = 0;
                    if (!has_min(t))
                        memcpy(&p, c + 4 * b, 4);
                    for (int e = 0; e < TD_QK; e++)
                        p += unsigned_quant(t, one, gq + block_at(t, b), r, e) * (WIDE * hi[b * TD_QK + e] + lo[b * TD_QK + e]);
                    float ea, dw, mw;
                    memcpy(&ea, ev + 4 * b, 4);
                    row_scales(t, gq, nb, b, r, &dw, &mw);
                    acc = fmaf((float)p, dw * ea, acc);
                    if (has_min(t)) {
                        float cf;
                        memcpy(&cf, c + 4 * b, 4);
                        macc = fmaf(mw, cf, macc);
                    }
                }
                y[i * ldy + (g - g0) * ROWS + r] = has_min(t) ? acc + macc : acc;
            }
        }
    }
}

/* the scalar kernel reads lo as it is (a one-byte row's zeros add nothing); one-byte rows of
 * IQ4_XS, Q4_K and Q6_K are super-block rows (act_super), summed their own way */
TD_INLINE void kernel_scalar_any(td_dtype_t t, bool one_byte, const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k,
                                 const void *av, size_t m, float *y, size_t ldy)
{
    (void)g_pf;
    kernel_scalar(t, one_byte, wp, g0, g1, k, av, m, y, ldy);
}
PACK_FNS(scalar2, , kernel_scalar_any, false)
PACK_FNS(scalar1, , kernel_scalar_any, true)

static const td_cpu_pack_ops_t ops_scalar = {
    .name = "scalar", .act_row = act_row_scalar, .act_q16 = true, .two_byte = PACK_TABLE(scalar2),
    .one_byte = PACK_TABLE(scalar1)};

/* ---- tables ------------------------------------------------------------------------------- */

const td_cpu_pack_ops_t *td_cpu_pack_ops(td_cpu_isa_t isa)
{
    TD_ASSERT(td_cpu_isa_runs(isa));
#ifdef TD_CPU_PACK_X86
    if (isa >= TD_CPU_ISA_AMX)
        return &td_cpu_pack_ops_amx;
    if (isa >= TD_CPU_ISA_AVX512_VNNI)
        return &td_cpu_pack_ops_vnni;
    if (isa >= TD_CPU_ISA_AVX2)
        return &td_cpu_pack_ops_avx2;
#endif
    return &ops_scalar;
}

td_cpu_pack_fn td_cpu_pack_fn_of(const td_cpu_pack_ops_t *ops, td_dtype_t type, bool one_byte)
{
    const td_cpu_pack_fns_t *f = one_byte ? &ops->one_byte : &ops->two_byte;
    switch (type) {
    case TD_Q8_0: return f->q8_0;
    case TD_Q4_0: return f->q4_0;
    case TD_Q4_1: return f->q4_1;
    case TD_Q4_K: return f->q4_k;
    case TD_Q6_K: return f->q6_k;
    case TD_Q5_K: return f->q5_k;
    case TD_IQ4_XS: return f->iq4_xs;
    default: break;
    }
    TD_ASSERT(!"td_cpu_pack_fn_of: a type without a packed layout");
    return NULL;
}
