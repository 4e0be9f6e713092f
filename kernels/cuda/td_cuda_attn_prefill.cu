/*
 * td_cuda_attn_prefill: causal attention of a step's new rows against the paged KV cache
 * (cached prefix plus the rows themselves, already written by rope_kv_write).
 *
 * Tensor-core path (td_prefill_mma_kernel; q and KV both f16 or both bf16, head_dim 64 or
 * 128), in the FlashAttention-2 manner:
 *   - grid [query tiles][heads]; a tile is TD_CUDA_PREFILL_BM = 64 rows of one sequence
 *     (set_step lists the tiles); 4 warps, each owning 16 query rows, Q kept in registers
 *     as mma A fragments after one ldmatrix pass;
 *   - K/V tiles of 64 tokens are copied straight from the paged cache (block table lookup
 *     per row, no gather copy) into shared memory with cp.async, two stages: tile t+1 is in
 *     flight while tile t is computed; rows are XOR-swizzled in 16-byte chunks so ldmatrix
 *     is free of bank conflicts;
 *   - S = Q K^T and O += P V with mma.sync m16n8k16 (fp32 accumulators), P re-packed from
 *     the S accumulators into A fragments without touching shared memory; online softmax in
 *     the exp2 domain, row max / sum kept in registers (sums reduced across the quad once at
 *     the end);
 *   - causal: the KV loop stops at the tile holding the tile's last position (fully masked
 *     tiles are never loaded), a warp skips the compute of tiles fully masked for its own
 *     16 rows (and a warp of padding rows computes nothing), and only tiles that cross the
 *     diagonal or the context's end pay for the mask; chunked prefill falls out of it: a
 *     row at position p sees keys 0..min(p, seq_len - 1) of the cache;
 *   - sliding window (p->window = W): keys <= p - W are masked too; a tile's KV loop starts
 *     at the tile holding its first row's window start (keys below it are never loaded:
 *     their blocks may be released) and a warp skips tiles wholly below its own window;
 *   - heavy tiles first: set_step lists the tiles of all sequences by their last row's
 *     position, largest first, and block x takes tile x.
 * Generic path (td_prefill_generic_kernel; fp32, mixed dtypes, other head dims up to 256, and
 * the 16-bit cases whose q/out/KV pointers are not 16-byte aligned or whose device cannot
 * give the tensor-core kernel its shared memory):
 *   one block per (row, head), keys in chunks of 128 with an online softmax. Correct and
 *   simple, not fast: the GPU's fast path is the one above.
 */
#include "td_cuda_impl.h"

struct td_pf_args {
    const void *q;
    void *out;
    const void *kv;
    const int32_t *positions, *seq_start, *seq_len, *block_tables, *qtile_seq, *qtile_row;
    int32_t n_seqs, n_qtiles, max_blocks, block_size, n_kv_heads, n_heads, head_dim, group;
    int32_t window; /* sliding window (td_attn_params_t.window); 0: none */
    float scale_log2;
};

/* ---- PTX helpers -------------------------------------------------------------------------- */

__device__ __forceinline__ void td_cp_async16(void *smem, const void *gmem, bool valid)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int sz = valid ? 16 : 0; /* 0: zero-fill, nothing read */
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(sz)
                 : "memory");
}
/* "memory": the compiler must not move shared-memory accesses across the copy's issue,
   commit or wait (the barrier after the wait orders the other threads' copies) */
__device__ __forceinline__ void td_cp_commit()
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void td_cp_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void td_ldsm_x4(uint32_t *r, const void *smem)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void td_ldsm_x4_t(uint32_t *r, const void *smem)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

template <typename T> struct td_mma;
template <> struct td_mma<__nv_bfloat16> {
    __device__ static void run(float *c, const uint32_t *a, uint32_t b0, uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    __device__ static uint32_t pack(float lo, float hi)
    {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};
template <> struct td_mma<__half> {
    __device__ static void run(float *c, const uint32_t *a, uint32_t b0, uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    __device__ static uint32_t pack(float lo, float hi)
    {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};

/* ---- tensor-core kernel ------------------------------------------------------------------- */

#define TD_PF_BN 64
#define TD_PF_THREADS 128

/* element offset of 16-byte chunk `ch` of row `r` in a swizzled [rows][D] tile */
template <int D> __device__ __forceinline__ int td_swz(int r, int ch)
{
    return r * D + ((ch ^ (r & 7)) << 3);
}

template <typename T, int D>
__global__ void __launch_bounds__(TD_PF_THREADS)
td_prefill_mma_kernel(td_pf_args a)
{
    const int BM = TD_CUDA_PREFILL_BM, BN = TD_PF_BN, CH = D / 8;
    extern __shared__ __align__(128) unsigned char td_pf_smem[];
    T *Qs = reinterpret_cast<T *>(td_pf_smem);
    T *Ks = Qs + BM * D; /* [2][BN][D] */
    T *Vs = Ks + 2 * BN * D;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int gid = lane >> 2, tig = lane & 3;
    const int32_t tile = blockIdx.x; /* set_step lists the heavy (late) tiles first */
    const int32_t h = blockIdx.y, kvh = h / a.group;
    const int32_t seq = a.qtile_seq[tile], row0 = a.qtile_row[tile];
    const int32_t nrows = min(BM, a.seq_start[seq + 1] - row0);
    const int32_t L = a.seq_len[seq];
    const int32_t min_pos = a.positions[row0];
    const int32_t max_pos = a.positions[row0 + nrows - 1];
    const int32_t kv_len = min(L, max_pos + 1);
    const int32_t n_tiles = (kv_len + BN - 1) / BN;
    /* sliding window: keys below the first row's window are masked for every row of the tile
       (and their blocks may be released): never loaded, and tiles wholly below it skipped */
    const int32_t kv_lo = a.window > 0 ? max(0, min_pos - a.window + 1) : 0;
    const int32_t t_first = kv_lo / BN;
    const size_t block_elems = (size_t)a.block_size * a.n_kv_heads * D;
    const int32_t *bt = a.block_tables + (size_t)seq * a.max_blocks;
    const T *kv = (const T *)a.kv;

    /* Q tile (rows past the sequence are zero-filled and never written back) */
    for (int i = tid; i < BM * CH; i += TD_PF_THREADS) {
        int r = i / CH, ch = i % CH;
        bool ok = r < nrows;
        const T *src = (const T *)a.q + ((size_t)(row0 + (ok ? r : 0)) * a.n_heads + h) * D + ch * 8;
        td_cp_async16(Qs + td_swz<D>(r, ch), src, ok);
    }
    auto load_kv = [&](int32_t t, int stage) {
        T *ks = Ks + stage * BN * D, *vs = Vs + stage * BN * D;
        for (int i = tid; i < BN * CH; i += TD_PF_THREADS) {
            int r = i / CH, ch = i % CH;
            int32_t j = t * BN + r;
            bool ok = j < kv_len && j >= kv_lo;
            const T *src = kv;
            if (ok) {
                int32_t b = bt[j / a.block_size], off = j % a.block_size;
                src = kv + (size_t)b * 2 * block_elems + ((size_t)off * a.n_kv_heads + kvh) * D + ch * 8;
            }
            td_cp_async16(ks + td_swz<D>(r, ch), src, ok);
            td_cp_async16(vs + td_swz<D>(r, ch), ok ? src + block_elems : src, ok);
        }
    };
    load_kv(t_first, t_first & 1);
    td_cp_commit();

    /* row positions of this thread's two rows (gid and gid + 8 of the warp's 16) */
    const int rA = warp * 16 + gid, rB = rA + 8;
    const int32_t posA = a.positions[row0 + min(rA, nrows - 1)];
    const int32_t posB = a.positions[row0 + min(rB, nrows - 1)];
    /* A warp whose 16 rows are all padding computes nothing, and a warp skips the KV tiles
       that start past its last row's position (positions grow along a sequence's rows):
       such a tile is fully masked for it, so skipping leaves its m, l and O exactly as they
       are. Both tests are warp-uniform and skip only the warp's ldmatrix/mma/softmax work:
       every thread still issues the copies and reaches every barrier. With a sliding window
       a warp likewise skips the tiles wholly below its first row's window. A warp with rows
       always computes tile warp_first, so it loads its Q fragments there. */
    const int32_t warp_tiles = /* KV tiles this warp computes: warp_first .. warp_tiles - 1 */
        warp * 16 < nrows ? a.positions[row0 + min(warp * 16 + 15, nrows - 1)] / BN + 1 : 0;
    const int32_t warp_first =
        a.window > 0 && warp * 16 < nrows ? max(0, a.positions[row0 + warp * 16] - a.window + 1) / BN : 0;

    uint32_t qf[D / 16][4];
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float mA = -INFINITY, mB = -INFINITY, lA = 0.0f, lB = 0.0f;

    for (int32_t t = t_first; t < n_tiles; t++) {
        if (t + 1 < n_tiles) {
            load_kv(t + 1, (t + 1) & 1);
            td_cp_commit();
            td_cp_wait<1>();
        } else {
            td_cp_wait<0>();
        }
        __syncthreads();
        if (t >= warp_first && t < warp_tiles) { /* warp-uniform: see above */
            if (t == warp_first) {
#pragma unroll
                for (int kk = 0; kk < D / 16; kk++)
                    td_ldsm_x4(qf[kk], Qs + td_swz<D>(warp * 16 + (lane % 16), kk * 2 + lane / 16));
            }
            const T *ks = Ks + (t & 1) * BN * D, *vs = Vs + (t & 1) * BN * D;

            /* S = Q K^T: 16 rows x 64 keys per warp */
            float s[BN / 8][4];
#pragma unroll
            for (int j = 0; j < BN / 8; j++)
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
                for (int j2 = 0; j2 < BN / 16; j2++) {
                    uint32_t b[4];
                    int mi = lane / 8;
                    td_ldsm_x4(b, ks + td_swz<D>(j2 * 16 + (mi / 2) * 8 + lane % 8,
                                                 kk * 2 + (mi % 2)));
                    td_mma<T>::run(s[2 * j2], qf[kk], b[0], b[1]);
                    td_mma<T>::run(s[2 * j2 + 1], qf[kk], b[2], b[3]);
                }
            }

            /* scale, mask on tiles that cross the diagonal or the context's end, online
               softmax; keys >= kv_len (zero-filled) are masked too, so even a row whose
               position is past seq_len sees only the context */
            const bool need_mask = (t + 1) * BN - 1 > min_pos || (t + 1) * BN > kv_len ||
                                   (a.window > 0 && t * BN <= max_pos - a.window);
            float tmA = -INFINITY, tmB = -INFINITY;
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float v = s[j][e] * a.scale_log2;
                    if (need_mask) {
                        int32_t key = t * BN + j * 8 + tig * 2 + (e & 1);
                        int32_t pos = e < 2 ? posA : posB;
                        if (key > pos || key >= kv_len || (a.window > 0 && key <= pos - a.window))
                            v = -INFINITY;
                    }
                    s[j][e] = v;
                }
                tmA = fmaxf(tmA, fmaxf(s[j][0], s[j][1]));
                tmB = fmaxf(tmB, fmaxf(s[j][2], s[j][3]));
            }
#pragma unroll
            for (int off = 1; off < 4; off <<= 1) {
                tmA = fmaxf(tmA, __shfl_xor_sync(0xffffffffu, tmA, off));
                tmB = fmaxf(tmB, __shfl_xor_sync(0xffffffffu, tmB, off));
            }
            /* without a window key 0 is visible to every row, so after tile 0 the maxima are
               finite; with one a row may see nothing yet in its warp's first tiles, and then
               subtracts 0 instead of -inf (exp2f(-inf - -inf) would be NaN) */
            float nmA = fmaxf(mA, tmA), nmB = fmaxf(mB, tmB);
            float bA = nmA == -INFINITY ? 0.0f : nmA, bB = nmB == -INFINITY ? 0.0f : nmB;
            float cA = exp2f(mA - bA), cB = exp2f(mB - bB);
            mA = nmA;
            mB = nmB;
            float sumA = 0.0f, sumB = 0.0f;
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                s[j][0] = exp2f(s[j][0] - bA);
                s[j][1] = exp2f(s[j][1] - bA);
                s[j][2] = exp2f(s[j][2] - bB);
                s[j][3] = exp2f(s[j][3] - bB);
                sumA += s[j][0] + s[j][1];
                sumB += s[j][2] + s[j][3];
            }
            lA = lA * cA + sumA;
            lB = lB * cB + sumB;
#pragma unroll
            for (int i = 0; i < D / 8; i++) {
                o[i][0] *= cA;
                o[i][1] *= cA;
                o[i][2] *= cB;
                o[i][3] *= cB;
            }

            /* O += P V */
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                uint32_t pa[4];
                pa[0] = td_mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
                pa[1] = td_mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
                pa[2] = td_mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[3] = td_mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int n2 = 0; n2 < D / 16; n2++) {
                    uint32_t b[4];
                    int mi = lane / 8;
                    td_ldsm_x4_t(b, vs + td_swz<D>(kk * 16 + (mi % 2) * 8 + lane % 8,
                                                   n2 * 2 + mi / 2));
                    td_mma<T>::run(o[2 * n2], pa, b[0], b[1]);
                    td_mma<T>::run(o[2 * n2 + 1], pa, b[2], b[3]);
                }
            }
        }
        __syncthreads(); /* the next iteration's copy overwrites this stage */
    }
    if (warp_tiles == 0) /* all padding: no barrier follows, nothing to store */
        return;

#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        lA += __shfl_xor_sync(0xffffffffu, lA, off);
        lB += __shfl_xor_sync(0xffffffffu, lB, off);
    }
    float iA = 1.0f / lA, iB = 1.0f / lB;
    T *out = (T *)a.out;
#pragma unroll
    for (int i = 0; i < D / 8; i++) {
        int col = i * 8 + tig * 2;
        if (rA < nrows)
            *reinterpret_cast<uint32_t *>(out + ((size_t)(row0 + rA) * a.n_heads + h) * D + col) =
                td_mma<T>::pack(o[i][0] * iA, o[i][1] * iA);
        if (rB < nrows)
            *reinterpret_cast<uint32_t *>(out + ((size_t)(row0 + rB) * a.n_heads + h) * D + col) =
                td_mma<T>::pack(o[i][2] * iB, o[i][3] * iB);
    }
}

/* ---- generic kernel ---------------------------------------------------------------------- */

#define TD_PFG_THREADS 128

__device__ __forceinline__ float td_block_reduce(float v, float *red, bool is_max)
{
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < TD_PFG_THREADS / 32; w++)
        v = is_max ? fmaxf(v, red[w]) : v + red[w];
    __syncthreads();
    return v;
}

template <typename TQ, typename TK>
__global__ void __launch_bounds__(TD_PFG_THREADS)
td_prefill_generic_kernel(td_pf_args a)
{
    __shared__ float qs[256];
    __shared__ float ps[TD_PFG_THREADS];
    __shared__ float red[TD_PFG_THREADS / 32];
    const int32_t row = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int32_t hd = a.head_dim, kvh = h / a.group;
    int32_t lo = 0, hi = a.n_seqs - 1; /* the sequence of this row */
    while (lo < hi) {
        int32_t mid = (lo + hi + 1) / 2;
        if (a.seq_start[mid] <= row)
            lo = mid;
        else
            hi = mid - 1;
    }
    const int32_t seq = lo;
    const int32_t kv_len = min(a.seq_len[seq], a.positions[row] + 1);
    const int32_t kv_lo = a.window > 0 ? max(0, a.positions[row] - a.window + 1) : 0; /* window */
    const size_t block_elems = (size_t)a.block_size * a.n_kv_heads * hd;
    const int32_t *bt = a.block_tables + (size_t)seq * a.max_blocks;
    const TK *kv = (const TK *)a.kv;
    const TQ *q = (const TQ *)a.q + ((size_t)row * a.n_heads + h) * hd;
    for (int i = tid; i < hd; i += TD_PFG_THREADS)
        qs[i] = td_ld(q + i) * a.scale_log2;
    __syncthreads();

    float m = -INFINITY, l = 0.0f, acc0 = 0.0f, acc1 = 0.0f;
    for (int32_t c0 = kv_lo; c0 < kv_len; c0 += TD_PFG_THREADS) {
        int32_t j = c0 + tid;
        float s = -INFINITY;
        if (j < kv_len) {
            const TK *k = kv + (size_t)bt[j / a.block_size] * 2 * block_elems +
                          ((size_t)(j % a.block_size) * a.n_kv_heads + kvh) * hd;
            s = 0.0f;
            for (int d = 0; d < hd; d++)
                s += qs[d] * td_ld(k + d);
        }
        float cm = td_block_reduce(s, red, true);
        float nm = fmaxf(m, cm);
        float corr = exp2f(m - nm);
        float p = j < kv_len ? exp2f(s - nm) : 0.0f;
        ps[tid] = p;
        l = l * corr + td_block_reduce(p, red, false); /* the reduce's barrier publishes ps */
        m = nm;
        acc0 *= corr;
        acc1 *= corr;
        int32_t n = min(TD_PFG_THREADS, kv_len - c0);
        for (int32_t jj = 0; jj < n; jj++) {
            int32_t jk = c0 + jj;
            const TK *v = kv + (size_t)bt[jk / a.block_size] * 2 * block_elems + block_elems +
                          ((size_t)(jk % a.block_size) * a.n_kv_heads + kvh) * hd;
            if (tid < hd)
                acc0 += ps[jj] * td_ld(v + tid);
            if (tid + TD_PFG_THREADS < hd)
                acc1 += ps[jj] * td_ld(v + tid + TD_PFG_THREADS);
        }
        __syncthreads(); /* ps is rewritten by the next chunk */
    }
    TQ *out = (TQ *)a.out + ((size_t)row * a.n_heads + h) * hd;
    if (tid < hd)
        td_st(out + tid, acc0 / l);
    if (tid + TD_PFG_THREADS < hd)
        td_st(out + tid + TD_PFG_THREADS, acc1 / l);
}

/* ---- launcher ----------------------------------------------------------------------------- */

/* dynamic shared memory of td_prefill_mma_kernel: the Q tile and two stages of K and V */
static size_t td_prefill_mma_smem(size_t elt_bytes, int32_t head_dim)
{
    return elt_bytes * (size_t)(TD_CUDA_PREFILL_BM + 4 * TD_PF_BN) * head_dim;
}

/* `bit`: this instantiation's bit in c->prefill_smem_set */
template <typename T, int D>
static td_status_t td_prefill_mma_launch(td_cuda_backend_t *c, const td_pf_args &a, unsigned bit)
{
    size_t smem = td_prefill_mma_smem(sizeof(T), D);
    if (!(c->prefill_smem_set & bit)) { /* a kernel's attribute on this device: set it once */
        TD_CUDA_TRY(cudaFuncSetAttribute(td_prefill_mma_kernel<T, D>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        c->prefill_smem_set |= bit;
    }
    td_prefill_mma_kernel<T, D><<<dim3(a.n_qtiles, a.n_heads), TD_PF_THREADS, smem, c->stream>>>(a);
    TD_CUDA_LAUNCHED("attn_prefill (mma)");
    return TD_OK;
}

td_status_t td_cuda_attn_prefill(td_cuda_backend_t *c, const td_attn_params_t *p)
{
    const td_kv_layout_t *ly = p->layout;
    const td_cuda_step_t *st = &c->step;
    if (st->n_tokens == 0)
        return TD_OK;
    td_dtype_t qt = c->base.act_dtype, kt = (td_dtype_t)ly->dtype;
    int32_t hd = (int32_t)ly->head_dim;
    if (hd > 256)
        return td_errorf(TD_ERR_UNSUPPORTED, "cuda: prefill attention supports head_dim up to 256 "
                         "(got %d)", hd);
    td_pf_args a;
    a.q = p->q;
    a.out = p->out;
    a.kv = p->kv_layer;
    a.positions = st->positions;
    a.seq_start = st->seq_start;
    a.seq_len = st->seq_len;
    a.block_tables = st->block_tables;
    a.qtile_seq = st->qtile_seq;
    a.qtile_row = st->qtile_row;
    a.n_seqs = st->n_seqs;
    a.n_qtiles = st->n_qtiles;
    a.max_blocks = st->max_blocks;
    a.block_size = (int32_t)ly->block_size;
    a.n_kv_heads = (int32_t)ly->n_kv_heads;
    a.n_heads = p->n_heads;
    a.head_dim = hd;
    a.group = p->n_heads / a.n_kv_heads;
    a.window = p->window;
    a.scale_log2 = p->scale * 1.4426950408889634f;

    /* the tensor-core path copies Q and K/V rows with 16-byte cp.async and stores pairs of
       outputs as 32-bit words, so its base pointers must be 16-byte aligned, and its shared
       memory must fit the device's opt-in limit; a call that misses either runs the generic
       kernel (slower, not less accurate) instead of failing */
    bool aligned = (((uintptr_t)p->q | (uintptr_t)p->out | (uintptr_t)p->kv_layer) & 15) == 0;
    bool mma = qt == kt && (qt == TD_BF16 || qt == TD_F16) && (hd == 64 || hd == 128) &&
               aligned && td_prefill_mma_smem(td_dtype_size(qt), hd) <= c->smem_optin;
    if (mma && qt == TD_BF16 && hd == 128)
        return td_prefill_mma_launch<__nv_bfloat16, 128>(c, a, 1u << 0);
    if (mma && qt == TD_BF16 && hd == 64)
        return td_prefill_mma_launch<__nv_bfloat16, 64>(c, a, 1u << 1);
    if (mma && qt == TD_F16 && hd == 128)
        return td_prefill_mma_launch<__half, 128>(c, a, 1u << 2);
    if (mma && qt == TD_F16 && hd == 64)
        return td_prefill_mma_launch<__half, 64>(c, a, 1u << 3);

    TD_CUDA_DISPATCH(qt, TQ, TD_CUDA_DISPATCH(kt, TK,
        td_prefill_generic_kernel<TQ, TK><<<dim3(st->n_tokens, p->n_heads), TD_PFG_THREADS, 0,
                                            c->stream>>>(a)));
    TD_CUDA_LAUNCHED("attn_prefill (generic)");
    return TD_OK;
}
