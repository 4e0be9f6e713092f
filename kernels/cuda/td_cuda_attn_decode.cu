/*
 * td_cuda_attn_decode: FlashDecoding-style split-KV attention of one new row per sequence
 * against the paged KV cache.
 *
 * Pass 1 (td_decode_part_kernel), grid [partitions][kv heads x head chunks][sequences],
 * 128 threads: a block owns one partition of one sequence's context for one KV head and
 * up to G query heads of its GQA group (G, a template parameter: the group rounded up to
 * a power of two, at most TD_DEC_GMAX), so each K and V element is read from memory once
 * per group. Rows of K (then V) are read with 16-byte loads, TPR threads per row
 * (head_dim / elements-per-16-bytes, rounded up to a power of two), software pipelined:
 * a thread's next TD_DEC_UNROLL rows are loaded while it computes the ones it has, and
 * V's first rows while the block computes the softmax (docs/cuda.md: 0.774 -> 0.535 ms
 * on an H200 at batch 64, context 4k). Each thread keeps its chunk of q for every head in registers; the
 * threads of a row combine their per-head partial dots by a reduce-scatter across heads
 * (gp - 1 + log2(TPR/gp) shuffles, not gc log2 TPR). Scores go to shared memory
 * ([g][partition]); one warp per query head turns them into exp2 weights and their sum;
 * the V pass accumulates weighted rows in registers and reduces them across threads
 * through shared memory. A sequence whose context is one partition writes its output
 * directly; otherwise the block writes its normalised partial output and (max, sum) to a
 * workspace.
 *
 * Pass 2 (td_decode_merge_kernel), grid [n_heads][sequences]: merges a sequence's
 * partitions by log-sum-exp. Sequences of one partition are skipped.
 *
 * Sliding window (params->window = W): only the keys in [L - W, L) are read; the partitions
 * keep their places (multiples of the partition size from position 0), the first one cut
 * at the window's start, and blockIdx.x counts from the first partition the window touches,
 * so the grid is ceil(W / P) + 1 partitions wide however long the sequence.
 *
 * Split (td_decode_partition): params->partition_tokens, else a constant TD_DEC_PART tokens
 * (not a heuristic on batch or SM count, so a sequence's result does not depend on the rest
 * of the batch), rounded up to a multiple of the KV block size, at most TD_DEC_PMAX tokens
 * (the score buffer in shared memory). The workspace grows only when a larger
 * batch x context is first seen.
 */
#include "td_cuda_impl.h"

#define TD_DEC_THREADS 128
#define TD_DEC_WARPS (TD_DEC_THREADS / 32)
#define TD_DEC_GMAX 8    /* most query heads per block */
#define TD_DEC_UNROLL 2  /* K/V rows a thread loads at once (twice that in flight) */
#define TD_DEC_PMAX 1024 /* most tokens per partition */
#define TD_DEC_PART 256  /* tokens per partition unless the caller asks (td_cpu_attn.c: the same) */
#define TD_DEC_MINB 4    /* blocks per SM: caps registers at 128 (G = 8 uses 125) */

/* 16 bytes of TK elements to fp32 */
template <typename TK> struct td_vec;
template <> struct td_vec<float> {
    static const int n = 4;
    __device__ static void load(const uint4 &u, float *f)
    {
        f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
        f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
    }
};
template <> struct td_vec<__half> {
    static const int n = 8;
    __device__ static void load(const uint4 &u, float *f)
    {
        const __half2 *h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 v = __half22float2(h[i]);
            f[2 * i] = v.x;
            f[2 * i + 1] = v.y;
        }
    }
};
template <> struct td_vec<__nv_bfloat16> {
    static const int n = 8;
    __device__ static void load(const uint4 &u, float *f)
    {
        const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 v = __bfloat1622float2(h[i]);
            f[2 * i] = v.x;
            f[2 * i + 1] = v.y;
        }
    }
};

struct td_dec_args {
    const void *q;
    void *out;
    const void *kv;
    float *ws_o;          /* [n_seqs][n_heads][max_parts][head_dim] */
    float *ws_ml;         /* [n_seqs][n_heads][max_parts][2] (max, sum), log2 domain */
    const int32_t *seq_start, *seq_len, *block_tables;
    int32_t max_blocks, block_size, n_kv_heads, n_heads, head_dim, group, n_hchunks;
    int32_t part_tokens, max_parts, tpr;
    int32_t window;       /* sliding window (td_attn_params_t.window); 0: none */
    float scale_log2;
};

/* The first key the new row at position L - 1 reads: the sliding window's start (0 without
   one). Partitions stay at multiples of part_tokens from position 0 and those wholly below
   it are skipped, so a sequence's partitions still depend on nothing but its length. */
__device__ __forceinline__ int32_t td_dec_lo(const td_dec_args &a, int32_t L)
{
    return a.window > 0 ? max(0, L - a.window) : 0;
}

template <typename TQ, typename TK, int G>
__global__ void __launch_bounds__(TD_DEC_THREADS, TD_DEC_MINB)
td_decode_part_kernel(td_dec_args a)
{
    const int EPV = td_vec<TK>::n;
    extern __shared__ float smem[];
    const int32_t seq = blockIdx.z;
    const int32_t kvh = blockIdx.y / a.n_hchunks, hchunk = blockIdx.y % a.n_hchunks;
    const int32_t L = a.seq_len[seq];
    const int32_t lo = td_dec_lo(a, L), p_first = lo / a.part_tokens;
    const int32_t part = p_first + blockIdx.x; /* absolute: its workspace slot */
    if (part * a.part_tokens >= L)
        return;
    const int32_t t0 = max(part * a.part_tokens, lo); /* keys below the window: never read */
    const int32_t n = min(L, (part + 1) * a.part_tokens) - t0;
    const int32_t n_parts = (L + a.part_tokens - 1) / a.part_tokens - p_first; /* computed ones */
    const int32_t h0 = kvh * a.group + hchunk * G;
    const int32_t gc = min(G, a.group - hchunk * G);
    const int32_t hd = a.head_dim, nch = hd / EPV;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

    float *sc = smem;                               /* [G][part_tokens] */
    float *red = sc + G * a.part_tokens;  /* [WARPS][G][hd] */
    __shared__ float s_m[G], s_l[G];

    const int tpr = a.tpr, rpi = TD_DEC_THREADS / tpr; /* rows per iteration */
    const int lr = tid % tpr, r0 = tid / tpr;
    const bool active = lr < nch;

    /* this thread's chunk of q (pre-scaled, log2 domain) for each head of the block, in
       registers for the whole K loop: reading it from shared memory per row was a 4-way bank
       conflict at EPV = 8. Zero past gc and on idle chunks (lr >= nch). */
    const int32_t row = a.seq_start[seq];
    const TQ *q = (const TQ *)a.q + ((size_t)row * a.n_heads + h0) * hd + lr * EPV;
    float qr[G][EPV];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int e = 0; e < EPV; e++)
            qr[g][e] = g < gc && active ? td_ld(q + g * hd + e) * a.scale_log2 : 0.0f;

    const size_t block_elems = (size_t)a.block_size * a.n_kv_heads * hd;
    const int32_t *bt = a.block_tables + (size_t)seq * a.max_blocks;
    const TK *kv = (const TK *)a.kv;
    /* the address of row t (0-based in the partition) for this thread's chunk, K part */
    auto row_ptr = [&](int32_t t) -> const uint4 * {
        int32_t j = t0 + t;
        int32_t b = bt[j / a.block_size], off = j % a.block_size;
        return reinterpret_cast<const uint4 *>(kv + (size_t)b * 2 * block_elems +
                                               ((size_t)off * a.n_kv_heads + kvh) * hd + lr * EPV);
    };

    /* ---- scores: sc[g][t] = q_g . k_t (log2 domain) ----
       The loop bound is the same for every thread (tb0), not per row (r0 + ...): the
       full-mask shuffles below need every lane of the warp, and lanes of one warp own
       different rows, some of which may already be past n. The shuffle levels depend only
       on gp and tpr (the same for the whole block), never on lr or t.
       The tpr lanes of a row reduce their gc partial dot products by reduce-scatter: with
       gp = gc rounded up to a power of two (heads gc..gp-1 are zeros), at offset tpr/2 a
       lane sends half its head sums to its partner and adds the partner's for the half it
       keeps (lower lane the lower heads), then at tpr/4 half of that, ... After
       min(log2 gp, log2 tpr) levels lane lr holds heads [lr*gp/tpr, +nh); the remaining
       levels (tpr > gp) are plain butterflies on its one head. gp - 1 + log2(tpr/gp)
       shuffles per row (gp - gp/tpr when tpr < gp) instead of gc * log2(tpr). */
    int gp = 1;
    while (gp < gc)
        gp <<= 1;
    const int hb = lr * gp / tpr, nh = gp > tpr ? gp / tpr : 1;
    const bool owner = lr * gp % tpr == 0; /* the first of the lanes that share hb writes */
    const int U = TD_DEC_UNROLL;
    /* rows tb + u * rpi (u < U) of K (v = 0) or V (v = 1) into r, zeros past n */
    auto load_rows = [&](uint4 *r, int32_t tb, int v) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int32_t t = tb + u * rpi;
            r[u] = make_uint4(0, 0, 0, 0);
            if (t < n && active)
                r[u] = __ldg(reinterpret_cast<const uint4 *>(reinterpret_cast<const TK *>(row_ptr(t)) +
                                                             v * block_elems));
        }
    };
    /* software pipelined: the next batch's rows are in flight while this one is computed */
    uint4 nxt[U];
    load_rows(nxt, r0, 0);
    for (int32_t tb0 = 0; tb0 < n; tb0 += rpi * U) {
        const int32_t tb = tb0 + r0;
        uint4 raw[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            raw[u] = nxt[u];
        if (tb0 + rpi * U < n)
            load_rows(nxt, tb + rpi * U, 0);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int32_t t = tb + u * rpi;
            float k[EPV];
            td_vec<TK>::load(raw[u], k);
            float d[G];
#pragma unroll
            for (int g = 0; g < G; g++) {
                d[g] = 0.0f;
                if (g < gc)
#pragma unroll
                    for (int e = 0; e < EPV; e++)
                        d[g] += qr[g][e] * k[e];
            }
            int o = tpr / 2;
#pragma unroll
            for (int m = G; m > 1; m /= 2) {
                if (m > gp || o == 0)
                    continue;
                const bool up = (lr & o) != 0;
#pragma unroll
                for (int i = 0; i < m / 2; i++) {
                    float give = up ? d[i] : d[i + m / 2];
                    float keep = up ? d[i + m / 2] : d[i];
                    d[i] = keep + __shfl_xor_sync(0xffffffffu, give, o);
                }
                o /= 2;
            }
            for (; o > 0; o /= 2)
                d[0] += __shfl_xor_sync(0xffffffffu, d[0], o);
            if (owner && t < n) {
#pragma unroll
                for (int i = 0; i < G; i++)
                    if (i < nh && hb + i < gc)
                        sc[(hb + i) * a.part_tokens + t] = d[i];
            }
        }
    }
    load_rows(nxt, r0, 1); /* V's first rows are in flight during the softmax */
    __syncthreads();

    /* ---- softmax weights: one warp per query head ---- */
    for (int g = warp; g < gc; g += TD_DEC_WARPS) {
        float *s = sc + g * a.part_tokens;
        float m = -INFINITY;
        for (int32_t t = lane; t < n; t += 32)
            m = fmaxf(m, s[t]);
        for (int o = 16; o > 0; o >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float l = 0.0f;
        for (int32_t t = lane; t < n; t += 32) {
            float p = exp2f(s[t] - m);
            s[t] = p;
            l += p;
        }
        for (int o = 16; o > 0; o >>= 1)
            l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane == 0) {
            s_m[g] = m;
            s_l[g] = l;
        }
    }
    __syncthreads();

    /* ---- weighted V: acc[g][e] over this thread's rows ---- */
    float acc[G][EPV];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int e = 0; e < EPV; e++)
            acc[g][e] = 0.0f;
    for (int32_t tb = r0; tb < n; tb += rpi * U) {
        uint4 raw[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            raw[u] = nxt[u];
        if (tb + rpi * U < n)
            load_rows(nxt, tb + rpi * U, 1);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int32_t t = tb + u * rpi;
            if (t >= n)
                break;
            float v[EPV];
            td_vec<TK>::load(raw[u], v);
#pragma unroll
            for (int g = 0; g < G; g++) {
                if (g >= gc)
                    break;
                float p = sc[g * a.part_tokens + t];
#pragma unroll
                for (int e = 0; e < EPV; e++)
                    acc[g][e] += p * v[e];
            }
        }
    }
    /* reduce over the threads of a warp that share a chunk, then over warps */
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int e = 0; e < EPV; e++)
            for (int o = tpr; o < 32; o <<= 1)
                acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
    if (lane < tpr && active) {
#pragma unroll
        for (int g = 0; g < G; g++) {
            if (g >= gc)
                break;
#pragma unroll
            for (int e = 0; e < EPV; e++)
                red[(warp * G + g) * hd + lr * EPV + e] = acc[g][e];
        }
    }
    __syncthreads();

    for (int i = tid; i < gc * hd; i += TD_DEC_THREADS) {
        int g = i / hd, d = i % hd;
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < TD_DEC_WARPS; w++)
            o += red[(w * G + g) * hd + d];
        o /= s_l[g];
        int32_t h = h0 + g;
        if (n_parts == 1) {
            td_st((TQ *)a.out + ((size_t)row * a.n_heads + h) * hd + d, o);
        } else {
            size_t pi = ((size_t)seq * a.n_heads + h) * a.max_parts + part;
            a.ws_o[pi * hd + d] = o;
            if (d == 0) {
                a.ws_ml[2 * pi] = s_m[g];
                a.ws_ml[2 * pi + 1] = s_l[g];
            }
        }
    }
}

template <typename TQ>
__global__ void td_decode_merge_kernel(td_dec_args a)
{
    const int32_t h = blockIdx.x, seq = blockIdx.y;
    const int32_t L = a.seq_len[seq];
    const int32_t p_first = td_dec_lo(a, L) / a.part_tokens;
    const int32_t n_parts = (L + a.part_tokens - 1) / a.part_tokens;
    if (n_parts - p_first <= 1)
        return;
    const size_t base = ((size_t)seq * a.n_heads + h) * a.max_parts;
    float m = -INFINITY;
    for (int32_t p = p_first; p < n_parts; p++)
        m = fmaxf(m, a.ws_ml[2 * (base + p)]);
    float wsum = 0.0f;
    for (int32_t p = p_first; p < n_parts; p++)
        wsum += a.ws_ml[2 * (base + p) + 1] * exp2f(a.ws_ml[2 * (base + p)] - m);
    const int32_t row = a.seq_start[seq];
    TQ *out = (TQ *)a.out + ((size_t)row * a.n_heads + h) * a.head_dim;
    for (int32_t d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int32_t p = p_first; p < n_parts; p++) {
            float w = a.ws_ml[2 * (base + p) + 1] * exp2f(a.ws_ml[2 * (base + p)] - m);
            o += w * a.ws_o[(base + p) * a.head_dim + d];
        }
        td_st(out + d, o / wsum);
    }
}

/* Tokens per partition: the request, else TD_DEC_PART (the CPU backend's constant: a
   sequence's partitions, hence its floats, do not depend on the rest of the batch, and a 4k
   context already gives 16 partitions per KV head at batch 1); a multiple of the block
   size, at most TD_DEC_PMAX (rounded down to a block multiple, never below one block). */
static int32_t td_decode_partition(int32_t requested, int32_t bs)
{
    int32_t pmax = TD_DEC_PMAX / bs * bs;
    if (pmax < bs)
        pmax = bs;
    int32_t P = requested > 0 ? requested : TD_DEC_PART;
    P = (P + bs - 1) / bs * bs;
    if (P > pmax)
        P = pmax;
    if (P < bs)
        P = bs;
    return P;
}

td_status_t td_cuda_attn_decode(td_cuda_backend_t *c, const td_attn_params_t *p)
{
    const td_kv_layout_t *ly = p->layout;
    const td_cuda_step_t *st = &c->step;
    if (st->n_seqs == 0)
        return TD_OK;
    td_dtype_t kt = (td_dtype_t)ly->dtype;
    int32_t hd = (int32_t)ly->head_dim, n_kv = (int32_t)ly->n_kv_heads;
    int32_t epv = 16 / (int32_t)td_dtype_size(kt);
    int32_t nch = hd / epv;
    if (hd % epv != 0 || nch > 32)
        return td_errorf(TD_ERR_UNSUPPORTED, "cuda: decode attention needs head_dim a multiple of "
                         "%d and at most %d for %s KV (got %d)", epv, 32 * epv,
                         td_dtype_name(kt), hd);
    /* K/V rows are read with 16-byte loads from the layer's base */
    if (((uintptr_t)p->kv_layer & 15) != 0)
        return td_errorf(TD_ERR_INVALID, "cuda: decode attention needs the KV layer 16-byte "
                         "aligned (got %p)", p->kv_layer);
    if (st->max_q_len != 1)
        return td_errorf(TD_ERR_INVALID, "cuda: decode attention takes one new row per sequence (a "
                         "sequence of this step has %d)", st->max_q_len);
    if (st->n_seqs > 65535)
        return td_errorf(TD_ERR_INVALID, "cuda: decode attention takes at most 65535 sequences "
                         "per step (got %d)", st->n_seqs);
    int32_t tpr = 1;
    while (tpr < nch)
        tpr <<= 1;

    td_dec_args a;
    a.q = p->q;
    a.out = p->out;
    a.kv = p->kv_layer;
    a.seq_start = st->seq_start;
    a.seq_len = st->seq_len;
    a.block_tables = st->block_tables;
    a.max_blocks = st->max_blocks;
    a.block_size = (int32_t)ly->block_size;
    a.n_kv_heads = n_kv;
    a.n_heads = p->n_heads;
    a.head_dim = hd;
    a.group = p->n_heads / n_kv;
    /* heads per block: the group rounded up to a power of two, at most TD_DEC_GMAX (q and the
       V sums for G heads live in registers: G = 8 for a group of 4 held twice what it used) */
    int32_t G = 1;
    while (G < a.group && G < TD_DEC_GMAX)
        G <<= 1;
    a.n_hchunks = (a.group + G - 1) / G;
    a.tpr = tpr;
    a.scale_log2 = p->scale * 1.4426950408889634f;
    a.part_tokens = td_decode_partition(p->partition_tokens, a.block_size);
    a.window = p->window;
    a.max_parts = (st->max_seq_len + a.part_tokens - 1) / a.part_tokens;
    if (a.max_parts < 1)
        a.max_parts = 1;

    size_t n_part_rows = (size_t)st->n_seqs * a.n_heads * a.max_parts;
    td_status_t s = TD_OK;
    if (a.max_parts > 1)
        s = td_cuda_reserve(c, (void **)&c->dec_ws, &c->dec_ws_cap,
                            n_part_rows * (hd + 2) * sizeof(float), "decode attention partials");
    if (s != TD_OK)
        return s;
    a.ws_o = c->dec_ws;
    a.ws_ml = c->dec_ws ? c->dec_ws + n_part_rows * hd : NULL;

    size_t smem = sizeof(float) * ((size_t)G * a.part_tokens + (size_t)TD_DEC_WARPS * G * hd);
    /* the opt-in limit covers dynamic plus static shared memory (s_m, s_l) */
    size_t smem_static = 16 * (((size_t)G * 2 * sizeof(float) + 15) / 16); /* s_m, s_l as ptxas pads them */
    if (smem + smem_static > c->smem_optin)
        return td_errorf(TD_ERR_UNSUPPORTED, "cuda: decode attention needs %zu bytes of shared "
                         "memory, the device allows %zu", smem + smem_static, c->smem_optin);
    /* a window of W keys touches at most ceil(W / P) + 1 partitions of each sequence */
    int32_t grid_parts = a.max_parts;
    if (a.window > 0 && (a.window + a.part_tokens - 1) / a.part_tokens + 1 < grid_parts)
        grid_parts = (a.window + a.part_tokens - 1) / a.part_tokens + 1;
    dim3 grid(grid_parts, n_kv * a.n_hchunks, st->n_seqs);
    int gi = G == 1 ? 0 : G == 2 ? 1 : G == 4 ? 2 : 3;
    TD_CUDA_DISPATCH(c->base.act_dtype, TQ, TD_CUDA_DISPATCH(kt, TK, {
        /* once per instantiation and context: the most any launch may use (smem varies with
           head_dim and the partition) */
        uint64_t bit = 1ull << (4 * (3 * td_cuda_type_of<TQ>::value + td_cuda_type_of<TK>::value) + gi);
        auto launch = [&](void (*k)(td_dec_args)) -> td_status_t {
            if (!(c->decode_smem_set & bit)) {
                /* the kernel's own static size: ptxas pads s_m and s_l (16 bytes at G = 1) */
                cudaFuncAttributes fa;
                TD_CUDA_TRY(cudaFuncGetAttributes(&fa, k));
                TD_CUDA_TRY(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)(c->smem_optin - fa.sharedSizeBytes)));
                c->decode_smem_set |= bit;
            }
            k<<<grid, TD_DEC_THREADS, smem, c->stream>>>(a);
            return TD_OK;
        };
        td_status_t ls = G == 1   ? launch(td_decode_part_kernel<TQ, TK, 1>)
                 : G == 2 ? launch(td_decode_part_kernel<TQ, TK, 2>)
                 : G == 4 ? launch(td_decode_part_kernel<TQ, TK, 4>)
                          : launch(td_decode_part_kernel<TQ, TK, 8>);
        if (ls != TD_OK)
            return ls;
    }));
    TD_CUDA_LAUNCHED("attn_decode (partitions)");
    if (a.max_parts > 1) {
        TD_CUDA_DISPATCH(c->base.act_dtype, TQ,
            td_decode_merge_kernel<TQ><<<dim3(a.n_heads, st->n_seqs), 128, 0, c->stream>>>(a));
        TD_CUDA_LAUNCHED("attn_decode (merge)");
    }
    return TD_OK;
}
