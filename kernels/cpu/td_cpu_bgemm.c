/*
 * td_cpu_bgemm: bf16 weights packed 16 rows a group times bf16 activations with
 * vdpbf16ps (td_cpu_bgemm.h has the layout and the order contract).
 *
 * A tile is R = 2 groups (32 rows) by M <= 8 activation rows in 2 M zmm accumulators; per
 * pair of weights each group's vector is loaded once and each row's pair broadcast once,
 * then 2 M vdpbf16ps (at M = 8: 2 vector loads and 8 broadcasts per 16 instructions, as
 * ik_llama.cpp's BF16_R16 tile). Decode (m <= 4) runs the same tile with M = m: two group
 * streams a thread read faster than four (m = 1, 2 threads, 2^16 x 2048 f16: 53-82 GB/s
 * against 37-52 with 4-group tiles, 23-36 with 8). The caller hands a block of groups whose
 * packed bytes stay in L2 while every row tile of the call sweeps them; the first row tile
 * reads them from memory and prefetches BG_AHEAD bytes ahead in each group's stream (into
 * L2, as td_cpu_fgemm).
 */
#include "td_cpu_bgemm.h"

#include <string.h>

#include "td_cpu_amx.h"
#include "td_cpu_isa.h"
#include "td_util.h"

#if TD_CPU_X86
#include <immintrin.h>
#define TD_BF __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))
#define TD_INLINE static inline __attribute__((always_inline))
#define BG_MAX_R 2
#define BG_MAX_M 8
#ifndef BG_AHEAD
#define BG_AHEAD 2048 /* bytes ahead in each group's stream a tile prefetches (1024 to 4096
                         measured alike, 512 and none slower) */
#endif
#endif

size_t td_cpu_bgemm_group_bytes(size_t k)
{
    return (size_t)TD_CPU_BGEMM_ROWS * k * sizeof(uint16_t);
}

size_t td_cpu_bgemm_pack_bytes(size_t n, size_t k)
{
    return (n + TD_CPU_BGEMM_ROWS - 1) / TD_CPU_BGEMM_ROWS * td_cpu_bgemm_group_bytes(k);
}

size_t td_cpu_bgemm_act_stride(size_t k)
{
    size_t s = (k * sizeof(uint16_t) + 63) & ~(size_t)63;
    return s % 4096 == 0 ? s + 64 : s;
}

static uint16_t to_bf16(const void *w, td_dtype_t type, size_t i)
{
    switch (type) {
    case TD_F32: return td_f32_to_bf16(((const float *)w)[i]);
    case TD_F16: return td_f32_to_bf16(td_f16_to_f32(((const uint16_t *)w)[i]));
    case TD_BF16: return ((const uint16_t *)w)[i];
    default: break;
    }
    TD_ASSERT(!"td_cpu_bgemm_pack: W must be f32, f16 or bf16");
    return 0;
}

/* The packing in plain C, element by element (any CPU; the AVX-512 one's reference). */
static void pack_c(void *dst, const void *w, td_dtype_t type, size_t n, size_t k)
{
    uint16_t *d = dst;
    size_t groups = (n + TD_CPU_BGEMM_ROWS - 1) / TD_CPU_BGEMM_ROWS;
    for (size_t g = 0; g < groups; g++)
        for (size_t p = 0; p < k / 2; p++)
            for (size_t r = 0; r < TD_CPU_BGEMM_ROWS; r++) {
                size_t row = g * TD_CPU_BGEMM_ROWS + r;
                for (size_t j = 0; j < 2; j++)
                    *d++ = row < n ? to_bf16(w, type, row * k + 2 * p + j) : 0;
            }
}

#if TD_CPU_X86
/* td_f32_to_bf16 on 16 lanes of f32 bits, in integer arithmetic (so a denormal rounds as
 * any other value, unlike vcvtneps2bf16, which flushes it): round to nearest even, a NaN
 * kept and made quiet. */
TD_BF static inline __m256i round_bf16x16(__m512i u)
{
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i quiet = _mm512_set1_epi32(0x400000);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    r = _mm512_mask_or_epi32(r, nan, u, quiet);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* 32 weights of a row from e on as bf16 pairs: 16 words, word p = elements e + 2p, e + 2p + 1.
 * f16 widens exactly to f32 (vcvtph2ps: a subnormal f16 is a normal f32), then rounds. */
TD_BF static inline __m512i load_pairs32(const void *w, td_dtype_t type, size_t e)
{
    switch (type) {
    case TD_F32: {
        const float *f = (const float *)w + e;
        __m256i lo = round_bf16x16(_mm512_castps_si512(_mm512_loadu_ps(f)));
        __m256i hi = round_bf16x16(_mm512_castps_si512(_mm512_loadu_ps(f + 16)));
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    case TD_F16: {
        const uint16_t *h = (const uint16_t *)w + e;
        __m256i lo = round_bf16x16(_mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)h))));
        __m256i hi =
            round_bf16x16(_mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(h + 16)))));
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    default: return _mm512_loadu_si512((const void *)((const uint16_t *)w + e));
    }
}

/* pack_c's bits, 16 rows by 32 weights at a time: each row's 16 pairs converted in
 * registers, then the 16 x 16 block of pairs transposed into the 16 vectors of its
 * pairs (row r's pair at word r); the columns past the last multiple of 32, by pack_c's
 * element rule. Rows past n are zeros. */
TD_BF static void pack_avx512(void *dst, const void *w, td_dtype_t type, size_t n, size_t k)
{
    uint32_t *d = dst;
    size_t row_bytes = td_dtype_bytes(type, k), pairs = k / 2, k32 = k / 32 * 32;
    size_t groups = (n + TD_CPU_BGEMM_ROWS - 1) / TD_CPU_BGEMM_ROWS;
    uint32_t blk[TD_CPU_BGEMM_ROWS][16];
    for (size_t g = 0; g < groups; g++, d += pairs * TD_CPU_BGEMM_ROWS) {
        size_t rows = TD_MIN(n - g * TD_CPU_BGEMM_ROWS, (size_t)TD_CPU_BGEMM_ROWS);
        const unsigned char *wg = (const unsigned char *)w + g * TD_CPU_BGEMM_ROWS * row_bytes;
        for (size_t e = 0; e < k32; e += 32) {
            for (size_t r = 0; r < TD_CPU_BGEMM_ROWS; r++) {
                __m512i v = r < rows ? load_pairs32(wg + r * row_bytes, type, e) : _mm512_setzero_si512();
                _mm512_storeu_si512((void *)blk[r], v);
            }
            uint32_t *dv = d + e / 2 * TD_CPU_BGEMM_ROWS;
            for (size_t p = 0; p < 16; p++)
                for (size_t r = 0; r < TD_CPU_BGEMM_ROWS; r++)
                    dv[p * TD_CPU_BGEMM_ROWS + r] = blk[r][p];
        }
        uint16_t *dt = (uint16_t *)(void *)(d + k32 / 2 * TD_CPU_BGEMM_ROWS);
        for (size_t p = k32 / 2; p < pairs; p++)
            for (size_t r = 0; r < TD_CPU_BGEMM_ROWS; r++)
                for (size_t j = 0; j < 2; j++)
                    *dt++ = r < rows ? to_bf16(wg + r * row_bytes, type, 2 * p + j) : 0;
    }
}
#endif

void td_cpu_bgemm_pack(void *dst, const void *w, td_dtype_t type, size_t n, size_t k)
{
    TD_ASSERT(k % 2 == 0 && td_dtype_is_float(type));
#if TD_CPU_X86
    if (td_cpu_isa_runs(TD_CPU_ISA_AVX512)) {
        pack_avx512(dst, w, type, n, k);
        return;
    }
#endif
    pack_c(dst, w, type, n, k);
}

void td_cpu_bgemm_pack_c(void *dst, const void *w, td_dtype_t type, size_t n, size_t k)
{
    TD_ASSERT(k % 2 == 0 && td_dtype_is_float(type));
    pack_c(dst, w, type, n, k);
}

#if TD_CPU_X86
/* td_f32_to_bf16 on 16 lanes at a time */
TD_BF static void act_row_avx512(const float *x, uint16_t *a, size_t k)
{
    size_t e = 0;
    for (; e + 16 <= k; e += 16)
        _mm256_storeu_si256((__m256i *)(void *)(a + e), round_bf16x16(_mm512_loadu_si512((const void *)(x + e))));
    for (; e < k; e++)
        a[e] = td_f32_to_bf16(x[e]);
}
#endif

void td_cpu_bgemm_act_row(const float *x, uint16_t *a, size_t k)
{
    TD_ASSERT(k % 2 == 0);
#if TD_CPU_X86
    if (td_cpu_isa_runs(TD_CPU_ISA_AVX512)) {
        act_row_avx512(x, a, k);
        return;
    }
#endif
    for (size_t e = 0; e < k; e++)
        a[e] = td_f32_to_bf16(x[e]);
}

#if TD_CPU_X86
/* R groups from w (group stride gb bytes) by M activation rows from a (stride lda): the
 * whole of k, one vdpbf16ps per pair per accumulator, in pair order; y[i * ldy + 16 r + l].
 * pf: when not 0, each group's line pf bytes ahead of the step's is prefetched. */
TD_INLINE TD_BF void bg_tile(int R, int M, const unsigned char *w, size_t gb, const unsigned char *a, size_t lda,
                             size_t k, float *y, size_t ldy, size_t pf)
{
    __m512 acc[BG_MAX_R][BG_MAX_M];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            acc[r][i] = _mm512_setzero_ps();
    const size_t pairs = k / 2;
    for (size_t p = 0; p < pairs; p++) {
        __m512bh wv[BG_MAX_R];
        for (int r = 0; r < R; r++) {
            const unsigned char *at = w + (size_t)r * gb + p * 64;
            if (pf)
                _mm_prefetch((const char *)at + pf, _MM_HINT_T1);
            wv[r] = (__m512bh)_mm512_loadu_si512((const void *)at);
        }
        for (int i = 0; i < M; i++) {
            uint32_t pair;
            memcpy(&pair, a + (size_t)i * lda + p * 4, 4);
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int r = 0; r < R; r++)
                acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv[r], xv);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            _mm512_storeu_ps(y + (size_t)i * ldy + (size_t)r * TD_CPU_BGEMM_ROWS, acc[r][i]);
}

/* Groups [g0, g1) by M rows: R groups a tile, then one at a time; the tiles of the first
 * row tile (first) prefetch BG_AHEAD bytes ahead in each group's stream (the last group's
 * runs into the next tile's first) unless that is past group g_pf. */
TD_INLINE TD_BF void bg_groups(int R, int M, const unsigned char *wp, size_t gb, size_t g0, size_t g1, size_t g_pf,
                               const unsigned char *a, size_t lda, size_t k, float *y, size_t ldy, bool first)
{
    size_t g = g0;
    for (; g + (size_t)R <= g1; g += (size_t)R) {
        size_t pf = first && g + (size_t)R < g_pf ? (size_t)BG_AHEAD : 0;
        bg_tile(R, M, wp + g * gb, gb, a, lda, k, y + (g - g0) * TD_CPU_BGEMM_ROWS, ldy, pf);
    }
    for (; g < g1; g++)
        bg_tile(1, M, wp + g * gb, gb, a, lda, k, y + (g - g0) * TD_CPU_BGEMM_ROWS, ldy, 0);
}

/* Rows [0, m): M = 8 at a time, the m % 8 left (a decode's m <= 4 among them) with as
 * many, all in tiles of R = 2 groups. */
TD_INLINE TD_BF void bg_rows(const unsigned char *wp, size_t gb, size_t g0, size_t g1, size_t g_pf,
                                const unsigned char *a, size_t lda, size_t m, size_t k, float *y, size_t ldy)
{
    for (size_t i = 0; i < m; i += BG_MAX_M) {
        const unsigned char *ai = a + i * lda;
        float *yi = y + i * ldy;
        bool first = i == 0;
        switch (TD_MIN(m - i, (size_t)BG_MAX_M)) {
        case 1: bg_groups(2, 1, wp, gb, g0, g1, g_pf, ai, lda, k, yi, ldy, first); break;
        case 2: bg_groups(2, 2, wp, gb, g0, g1, g_pf, ai, lda, k, yi, ldy, first); break;
        case 3: bg_groups(2, 3, wp, gb, g0, g1, g_pf, ai, lda, k, yi, ldy, first); break;
        case 4: bg_groups(2, 4, wp, gb, g0, g1, g_pf, ai, lda, k, yi, ldy, first); break;
        case 5: bg_groups(2, 5, wp, gb, g0, g1, g_pf, ai, lda, k, yi, ldy, first); break;
        case 6: bg_groups(2, 6, wp, gb, g0, g1, g_pf, ai, lda, k, yi, ldy, first); break;
        case 7: bg_groups(2, 7, wp, gb, g0, g1, g_pf, ai, lda, k, yi, ldy, first); break;
        default: bg_groups(2, BG_MAX_M, wp, gb, g0, g1, g_pf, ai, lda, k, yi, ldy, first); break;
        }
    }
}

static TD_BF void bgemm_avx512bf16(const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k, const void *a,
                                   size_t lda, size_t m, float *y, size_t ldy)
{
    TD_ASSERT(k % 2 == 0 && g0 <= g1 && g1 <= g_pf);
    bg_rows(wp, td_cpu_bgemm_group_bytes(k), g0, g1, g_pf, a, lda, m, k, y, ldy);
}

/* ---- AMX-BF16 ------------------------------------------------------------------------------ */

/*
 * The tile unit (level amx): a step is 32 weights, one TDPBF16PS of an A tile (up to 16
 * activation rows of 64 bytes, the rows' stride apart) by a B tile (the group's 1 KiB of
 * those weights, as packed) into a C tile (the rows by the group's 16 outputs, f32). A tile
 * is up to 2 chunks of 16 rows by 2 groups: 4 C tiles held over the whole of k, per step 2 A
 * and 2 B loads for 4 products (tiles: C 0-3, A 4-5, B 6-7), then the C tiles stored
 * straight into y (a C row is an output row's 16 lanes). Rows past the last 16 run after a
 * configuration of their count; decode's m <= 4 is such a call. The first chunk of a call
 * reads its groups from memory and prefetches BA_AHEAD bytes ahead in each group's stream
 * (into L2, as the vdpbf16ps tile; decode m = 1 of a 256 MiB matrix, two threads: 20-21
 * GB/s without, 23-31 at 2 KiB, 23-26 at 4 KiB, 23-33 at 8 KiB); the later chunks find the
 * call's block in L2.
 */
#define BA_K 32                                    /* weights a step */
#define BA_B_BYTES (TD_CPU_BGEMM_ROWS * BA_K * 2)  /* a step's B tile: 1 KiB */
#define BA_AHEAD 2048 /* bytes ahead in each group's stream the first chunk prefetches */

static TD_BF void ba_configure(int rows)
{
    td_cpu_amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)(t < 6 ? rows : BA_K / 2); /* C 0-3, A 4-5: the chunk's rows; B 6-7: 16 pairs */
        c.colsb[t] = 64;                                /* 16 f32, 32 bf16, 16 pairs of bf16 */
    }
    AMX_CONFIGURE(&c);
}

/* C chunks (of the configured rows, 16 lda apart) by R groups (gb apart) over the whole of
 * k; C and R are 1 or 2, constants after inlining (the tile numbers are literal). */
TD_INLINE TD_BF void ba_tile(int C, int R, const unsigned char *w, size_t gb, const unsigned char *a, size_t lda,
                             size_t k, float *y, size_t ldy, size_t pf)
{
    const unsigned char *a1 = a + (size_t)16 * lda;
    const long ys = (long)(ldy * sizeof(float));
    AMX_ZERO(0);
    if (R == 2)
        AMX_ZERO(1);
    if (C == 2) {
        AMX_ZERO(2);
        if (R == 2)
            AMX_ZERO(3);
    }
    for (size_t e = 0; e < k; e += BA_K) {
        const unsigned char *b0 = w + e / BA_K * BA_B_BYTES, *b1 = b0 + gb;
        if (pf)
            for (size_t l = 0; l < BA_B_BYTES; l += 64) {
                _mm_prefetch((const char *)b0 + pf + l, _MM_HINT_T1);
                if (R == 2)
                    _mm_prefetch((const char *)b1 + pf + l, _MM_HINT_T1);
            }
        AMX_LOAD(6, b0, 64);
        if (R == 2)
            AMX_LOAD(7, b1, 64);
        AMX_LOAD(4, a + 2 * e, lda);
        AMX_DPBF16PS(0, 4, 6);
        if (R == 2)
            AMX_DPBF16PS(1, 4, 7);
        if (C == 2) {
            AMX_LOAD(5, a1 + 2 * e, lda);
            AMX_DPBF16PS(2, 5, 6);
            if (R == 2)
                AMX_DPBF16PS(3, 5, 7);
        }
    }
    AMX_STORE(0, y, ys);
    if (R == 2)
        AMX_STORE(1, y + TD_CPU_BGEMM_ROWS, ys);
    if (C == 2) {
        float *y1 = y + (size_t)16 * ldy;
        AMX_STORE(2, y1, ys);
        if (R == 2)
            AMX_STORE(3, y1 + TD_CPU_BGEMM_ROWS, ys);
    }
}

/* Groups [g0, g1) by C chunks (1 or 2, a constant after inlining, as ba_tile's): 2 groups
 * a tile, the odd one alone; the first chunk's tiles (first) prefetch BA_AHEAD bytes ahead
 * in each group's stream unless that is past group g_pf (the last group's runs into the
 * next tile's first) */
TD_INLINE TD_BF void ba_groups(int C, const unsigned char *wp, size_t gb, size_t g0, size_t g1, size_t g_pf,
                               const unsigned char *a, size_t lda, size_t k, float *y, size_t ldy, bool first)
{
    size_t g = g0;
    for (; g + 2 <= g1; g += 2) {
        size_t pf = first && g + 2 < g_pf ? (size_t)BA_AHEAD : 0;
        ba_tile(C, 2, wp + g * gb, gb, a, lda, k, y + (g - g0) * TD_CPU_BGEMM_ROWS, ldy, pf);
    }
    if (g < g1)
        ba_tile(C, 1, wp + g * gb, gb, a, lda, k, y + (g - g0) * TD_CPU_BGEMM_ROWS, ldy, 0);
}

static TD_BF void bgemm_amx(const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k, const void *av,
                            size_t lda, size_t m, float *y, size_t ldy)
{
    if (k % BA_K != 0) {
        bgemm_avx512bf16(wp, g0, g1, g_pf, k, av, lda, m, y, ldy);
        return;
    }
    TD_ASSERT(g0 <= g1 && g1 <= g_pf);
    const unsigned char *a = av;
    size_t gb = td_cpu_bgemm_group_bytes(k), m16 = m / 16 * 16;
    if (m16) {
        ba_configure(16);
        for (size_t i = 0; i < m16; i += 32) {
            if (i + 32 <= m16)
                ba_groups(2, wp, gb, g0, g1, g_pf, a + i * lda, lda, k, y + i * ldy, ldy, i == 0);
            else
                ba_groups(1, wp, gb, g0, g1, g_pf, a + i * lda, lda, k, y + i * ldy, ldy, i == 0);
        }
    }
    if (m16 < m) {
        ba_configure((int)(m - m16));
        ba_groups(1, wp, gb, g0, g1, g_pf, a + m16 * lda, lda, k, y + m16 * ldy, ldy, m16 == 0);
    }
    AMX_RELEASE();
}
#endif /* TD_CPU_X86 */

td_cpu_bgemm_fn td_cpu_bgemm_of(td_cpu_isa_t isa)
{
    TD_ASSERT(td_cpu_isa_runs(isa));
#if TD_CPU_X86
    if (isa >= TD_CPU_ISA_AMX)
        return bgemm_amx;
    if (isa >= TD_CPU_ISA_AVX512_BF16)
        return bgemm_avx512bf16;
#endif
    return NULL;
}
