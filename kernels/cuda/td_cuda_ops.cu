/*
 * td_cuda_ops: the row-wise ops of the CUDA backend: embedding lookup, RMSNorm fused with
 * the residual add, RoPE fused with the KV-cache write, SwiGLU, row gather, the experts' weighted
 * sum of a mixture (moe_combine), dtype conversion and bias.
 * All are memory-bound: one pass over their inputs, fp32 arithmetic, the step's positions
 * and slots read from the metadata set_step uploaded (nothing copied per op).
 *
 * Each kernel is templated on the element types it touches; the launcher dispatches on the
 * run-time dtypes (at most 3 x 3 instantiations per kernel, all small).
 */
#include "td_cuda_impl.h"

/* ---- embedding ------------------------------------------------------------------------- */

template <typename TA, typename TW>
__global__ void td_embed_kernel(TA *x, const TW *table, const int32_t *tokens, int32_t dim)
{
    int32_t row = blockIdx.x;
    const TW *src = table + (size_t)tokens[row] * dim;
    TA *dst = x + (size_t)row * dim;
    for (int32_t i = threadIdx.x; i < dim; i += blockDim.x)
        td_st(dst + i, td_ld(src + i));
}

td_status_t td_cuda_embed(td_cuda_backend_t *c, void *x, const void *table, td_dtype_t table_dtype,
                          int32_t dim)
{
    if (c->step.n_tokens == 0)
        return TD_OK;
    TD_CUDA_DISPATCH(c->base.act_dtype, TA, TD_CUDA_DISPATCH(table_dtype, TW,
        td_embed_kernel<TA, TW><<<c->step.n_tokens, 256, 0, c->stream>>>(
            (TA *)x, (const TW *)table, c->step.tokens, dim)));
    TD_CUDA_LAUNCHED("embed");
    return TD_OK;
}

/* ---- RMSNorm (+ residual) ------------------------------------------------------------- */

__device__ __forceinline__ float td_block_sum(float v, float *red)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    int nw = blockDim.x / 32;
    v = lane < nw ? red[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* red may be reused by the caller */
    return v;
}

/* One block per row. With a residual: residual += x, then normalise the sum. The sum is
   re-read from memory in the second pass (a row is at most a few KiB: it stays in L1/L2). */
template <typename TA, typename TW>
__global__ void td_rmsnorm_kernel(TA *out, const TA *x, TA *residual, const TW *w, int32_t dim,
                                  float eps)
{
    __shared__ float red[32];
    size_t base = (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    if (residual) {
        for (int32_t i = threadIdx.x; i < dim; i += blockDim.x) {
            float s = td_ld(residual + base + i) + td_ld(x + base + i);
            td_st(residual + base + i, s);
            s = td_ld(residual + base + i); /* normalise what was stored, as the CPU does */
            ss += s * s;
        }
    } else {
        for (int32_t i = threadIdx.x; i < dim; i += blockDim.x) {
            float s = td_ld(x + base + i);
            ss += s * s;
        }
    }
    ss = td_block_sum(ss, red);
    float inv = (float)(1.0 / sqrt((double)ss / dim + (double)eps)); /* as the CPU: rsqrtf is approximate */
    const TA *src = residual ? residual : x;
    for (int32_t i = threadIdx.x; i < dim; i += blockDim.x)
        td_st(out + base + i, td_ld(src + base + i) * inv * td_ld(w + i));
}

td_status_t td_cuda_rmsnorm(td_cuda_backend_t *c, void *out, void *x, void *residual,
                            const void *w, td_dtype_t w_dtype, int32_t rows, int32_t dim, float eps)
{
    if (rows == 0)
        return TD_OK;
    int threads = dim >= 1024 ? 512 : dim >= 256 ? 256 : 128;
    TD_CUDA_DISPATCH(c->base.act_dtype, TA, TD_CUDA_DISPATCH(w_dtype, TW,
        td_rmsnorm_kernel<TA, TW><<<rows, threads, 0, c->stream>>>(
            (TA *)out, (const TA *)x, (TA *)residual, (const TW *)w, dim, eps)));
    TD_CUDA_LAUNCHED("rmsnorm");
    return TD_OK;
}

/* ---- RoPE fused with the KV write ------------------------------------------------------- */

/* One block per row. The row's angles are computed once (double, like the CPU backend: at
   position 32k a float product is off by ~1e-3 rad) into shared memory; then q pairs are
   rotated in place and k pairs are rotated on their way into the row's cache slot
   (slot % block_size of block slot / block_size: [n_kv_heads][head_dim], contiguous), v is
   copied next to it. k itself is left as it was. */
#define TD_ROPE_MAX_HALF 512 /* head_dim <= 1024 (td_kv_layout_validate) */

template <typename TA, typename TK>
__global__ void td_rope_kv_kernel(TA *q, const TA *k, const TA *v, TK *kv, const int32_t *positions,
                                  const int32_t *slots, const float *inv_freq, int32_t n_heads,
                                  int32_t n_kv_heads, int32_t head_dim, int halves,
                                  int32_t block_size)
{
    __shared__ float cs[TD_ROPE_MAX_HALF], sn[TD_ROPE_MAX_HALF];
    const int32_t row = blockIdx.x, half = head_dim / 2;
    const bool rot = inv_freq != NULL;
    if (rot) {
        double pos = (double)positions[row];
        for (int32_t i = threadIdx.x; i < half; i += blockDim.x) {
            double s, c;
            sincos(pos * (double)inv_freq[i], &s, &c);
            cs[i] = (float)c;
            sn[i] = (float)s;
        }
    }
    __syncthreads(); /* uniform: rot is the same for the whole grid */
    if (rot && q) {
        for (int32_t t = threadIdx.x; t < n_heads * half; t += blockDim.x) {
            int32_t h = t / half, i = t % half;
            TA *base = q + ((size_t)row * n_heads + h) * head_dim;
            int32_t i0 = halves ? i : 2 * i, i1 = halves ? i + half : 2 * i + 1;
            float x0 = td_ld(base + i0), x1 = td_ld(base + i1);
            td_st(base + i0, x0 * cs[i] - x1 * sn[i]);
            td_st(base + i1, x0 * sn[i] + x1 * cs[i]);
        }
    }
    const int32_t slot = slots[row];
    if (slot < 0)
        return; /* a padding row the engine does not cache (after the last barrier) */
    const int32_t row_elems = n_kv_heads * head_dim;
    const size_t block_elems = (size_t)block_size * row_elems;
    TK *kd = kv + (size_t)(slot / block_size) * 2 * block_elems + (size_t)(slot % block_size) * row_elems;
    TK *vd = kd + block_elems;
    const TA *ks = k + (size_t)row * row_elems, *vs = v + (size_t)row * row_elems;
    for (int32_t t = threadIdx.x; t < n_kv_heads * half; t += blockDim.x) {
        int32_t h = t / half, i = t % half;
        int32_t i0 = halves ? i : 2 * i, i1 = halves ? i + half : 2 * i + 1;
        float x0 = td_ld(ks + h * head_dim + i0), x1 = td_ld(ks + h * head_dim + i1);
        if (rot) {
            float r0 = x0 * cs[i] - x1 * sn[i], r1 = x0 * sn[i] + x1 * cs[i];
            x0 = r0;
            x1 = r1;
        }
        td_st(kd + h * head_dim + i0, x0);
        td_st(kd + h * head_dim + i1, x1);
    }
    for (int32_t i = threadIdx.x; i < row_elems; i += blockDim.x)
        td_st(vd + i, td_ld(vs + i));
}

td_status_t td_cuda_rope_kv_write(td_cuda_backend_t *c, const td_rope_kv_params_t *p)
{
    const td_kv_layout_t *ly = p->layout;
    int32_t hd = (int32_t)ly->head_dim;
    if (hd % 2 != 0 || hd / 2 > TD_ROPE_MAX_HALF)
        return td_errorf(TD_ERR_INVALID, "cuda: rope_kv_write needs an even head_dim of at most "
                         "%d (got %d)", 2 * TD_ROPE_MAX_HALF, hd);
    if (c->step.n_tokens == 0)
        return TD_OK;
    TD_CUDA_DISPATCH(c->base.act_dtype, TA, TD_CUDA_DISPATCH((td_dtype_t)ly->dtype, TK,
        td_rope_kv_kernel<TA, TK><<<c->step.n_tokens, 128, 0, c->stream>>>(
            (TA *)p->q, (const TA *)p->k, (const TA *)p->v, (TK *)p->kv_layer, c->step.positions,
            c->step.slots, p->inv_freq, p->n_heads, (int32_t)ly->n_kv_heads, hd,
            p->style == TD_ROPE_HALVES, (int32_t)ly->block_size)));
    TD_CUDA_LAUNCHED("rope_kv_write");
    return TD_OK;
}

/* ---- SwiGLU ------------------------------------------------------------------------------- */

template <typename TA>
__global__ void td_swiglu_kernel(TA *out, const TA *gate, const TA *up, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = td_ld(gate + i);
        td_st(out + i, g / (1.0f + __expf(-g)) * td_ld(up + i));
    }
}

static unsigned td_grid_for(size_t n, int threads)
{
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b > 65535 * 8 ? 65535 * 8 : b ? b : 1);
}

td_status_t td_cuda_swiglu(td_cuda_backend_t *c, void *out, const void *gate, const void *up,
                           int32_t rows, int32_t hidden)
{
    size_t n = (size_t)rows * hidden;
    if (n == 0)
        return TD_OK;
    TD_CUDA_DISPATCH(c->base.act_dtype, TA,
        td_swiglu_kernel<TA><<<td_grid_for(n, 256), 256, 0, c->stream>>>(
            (TA *)out, (const TA *)gate, (const TA *)up, n));
    TD_CUDA_LAUNCHED("swiglu");
    return TD_OK;
}

/* ---- gather rows ------------------------------------------------------------------------ */

template <typename TA>
__global__ void td_gather_kernel(TA *dst, const TA *src, const int32_t *rows, int32_t dim)
{
    const TA *s = src + (size_t)rows[blockIdx.x] * dim;
    TA *d = dst + (size_t)blockIdx.x * dim;
    for (int32_t i = threadIdx.x; i < dim; i += blockDim.x)
        d[i] = s[i];
}

td_status_t td_cuda_gather_rows(td_cuda_backend_t *c, void *dst, const void *src,
                                const int32_t *rows, int32_t n, int32_t dim)
{
    if (n == 0)
        return TD_OK;
    /* rows_dev is sized by set_step for a step's rows; only an unusual caller grows it */
    td_status_t st = td_cuda_reserve(c, (void **)&c->rows_dev, &c->rows_cap,
                                     (size_t)n * sizeof(int32_t), "gather_rows list");
    if (st != TD_OK)
        return st;
    TD_CUDA_TRY(cudaMemcpyAsync(c->rows_dev, rows, (size_t)n * sizeof(int32_t),
                                cudaMemcpyHostToDevice, c->stream));
    TD_CUDA_DISPATCH(c->base.act_dtype, TA,
        td_gather_kernel<TA><<<n, 256, 0, c->stream>>>((TA *)dst, (const TA *)src, c->rows_dev, dim));
    TD_CUDA_LAUNCHED("gather_rows");
    return TD_OK;
}

/* ---- moe_combine ------------------------------------------------------------------------ */

/* One block per row t: x[t][i] += sum over r in order of w[t][r] * y[slot[t][r]][i], in f32.
   The order of r is fixed per row (the CPU's, so the two backends sum alike). */
template <typename TA>
__global__ void td_moe_combine_kernel(TA *x, const TA *y, const int32_t *slots, const float *weights, int32_t k,
                                      int32_t dim)
{
    const int32_t *slot = slots + (size_t)blockIdx.x * k;
    const float *w = weights + (size_t)blockIdx.x * k;
    TA *xr = x + (size_t)blockIdx.x * dim;
    for (int32_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float acc = 0.0f;
        for (int32_t r = 0; r < k; r++)
            acc = fmaf(w[r], td_ld(y + (size_t)slot[r] * dim + i), acc);
        td_st(xr + i, td_ld(xr + i) + acc);
    }
}

td_status_t td_cuda_moe_combine(td_cuda_backend_t *c, void *x, const void *y, const int32_t *slots,
                                const float *weights, int32_t n, int32_t k, int32_t dim)
{
    if (n == 0)
        return TD_OK;
    size_t half = (size_t)n * k * sizeof(int32_t); /* slots, then as many f32 weights */
    td_status_t st = td_cuda_reserve(c, &c->moe_dev, &c->moe_cap, 2 * half, "moe_combine lists");
    if (st != TD_OK)
        return st;
    TD_CUDA_TRY(cudaMemcpyAsync(c->moe_dev, slots, half, cudaMemcpyHostToDevice, c->stream));
    TD_CUDA_TRY(cudaMemcpyAsync((char *)c->moe_dev + half, weights, half, cudaMemcpyHostToDevice, c->stream));
    TD_CUDA_DISPATCH(c->base.act_dtype, TA,
        td_moe_combine_kernel<TA><<<n, 256, 0, c->stream>>>((TA *)x, (const TA *)y, (const int32_t *)c->moe_dev,
                                                            (const float *)((char *)c->moe_dev + half), k, dim));
    TD_CUDA_LAUNCHED("moe_combine");
    return TD_OK;
}

/* ---- conversion and bias (GEMM helpers) ------------------------------------------------- */

template <typename TD, typename TS>
__global__ void td_convert_kernel(TD *dst, const TS *src, size_t n, int accumulate)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = td_ld(src + i);
        if (accumulate)
            v += td_ld(dst + i);
        td_st(dst + i, v);
    }
}

td_status_t td_cuda_convert(td_cuda_backend_t *c, void *dst, td_dtype_t dst_t, const void *src,
                            td_dtype_t src_t, size_t n, bool accumulate)
{
    if (n == 0)
        return TD_OK;
    TD_CUDA_DISPATCH(dst_t, TD, TD_CUDA_DISPATCH(src_t, TS,
        td_convert_kernel<TD, TS><<<td_grid_for(n, 256), 256, 0, c->stream>>>(
            (TD *)dst, (const TS *)src, n, accumulate)));
    TD_CUDA_LAUNCHED("convert");
    return TD_OK;
}

template <typename TY, typename TB>
__global__ void td_bias_kernel(TY *y, const TB *bias, size_t total, int32_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        td_st(y + i, td_ld(y + i) + td_ld(bias + i % n));
}

td_status_t td_cuda_add_bias(td_cuda_backend_t *c, void *y, td_dtype_t y_t, const void *bias,
                             td_dtype_t b_t, int32_t rows, int32_t n)
{
    size_t total = (size_t)rows * n;
    if (total == 0)
        return TD_OK;
    TD_CUDA_DISPATCH(y_t, TY, TD_CUDA_DISPATCH(b_t, TB,
        td_bias_kernel<TY, TB><<<td_grid_for(total, 256), 256, 0, c->stream>>>(
            (TY *)y, (const TB *)bias, total, n)));
    TD_CUDA_LAUNCHED("add_bias");
    return TD_OK;
}
