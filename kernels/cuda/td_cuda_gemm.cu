/*
 * td_cuda_gemm: Y[m][n] = X[m][k] . W[n][k]^T (+ bias) (+ Y) through cublasGemmEx with fp32
 * accumulation (CUBLAS_COMPUTE_32F, no TF32: the fp32 path must match the CPU token for
 * token).
 *
 * Row-major Y is column-major Y^T [n x m], so we ask cuBLAS for Y^T = W . X^T with W read
 * transposed (op T on the column-major [k x n] view of W) and X^T as is ([k x m], ld k).
 *
 * cuBLAS multiplies A and B of one dtype. When the weight dtype differs from the activation
 * dtype, X is converted to the weight dtype in a scratch buffer; when cuBLAS cannot write
 * the wanted output dtype directly (fp32 operands into 16-bit Y, or f16 x f16 into bf16),
 * the product lands in an fp32 scratch and one conversion pass writes (or adds to) Y.
 * The common case, weights in the activation dtype, is a single cuBLAS call.
 */
#include "td_cuda_impl.h"

static cudaDataType_t td_cuda_dt(td_dtype_t t)
{
    return t == TD_F32 ? CUDA_R_32F : t == TD_F16 ? CUDA_R_16F : CUDA_R_16BF;
}

td_status_t td_cuda_matmul(td_cuda_backend_t *c, const td_matmul_params_t *p)
{
    td_dtype_t act = c->base.act_dtype;
    td_dtype_t wt = p->w_dtype;
    td_dtype_t yt = p->y_f32 ? TD_F32 : act;
    td_status_t st;
    if (p->m == 0 || p->n == 0)
        return TD_OK;

    const void *x = p->x;
    if (wt != act) {
        st = td_cuda_reserve(c, &c->scratch[0], &c->scratch_cap[0],
                             (size_t)p->m * p->k * td_dtype_size(wt), "matmul input conversion");
        if (st != TD_OK)
            return st;
        st = td_cuda_convert(c, c->scratch[0], wt, p->x, act, (size_t)p->m * p->k, false);
        if (st != TD_OK)
            return st;
        x = c->scratch[0];
    }
    /* cuBLAS writes C in the operand dtype or fp32 */
    bool direct = yt == wt || yt == TD_F32;
    void *y = p->y;
    td_dtype_t ct = yt;
    if (!direct) {
        st = td_cuda_reserve(c, &c->scratch[1], &c->scratch_cap[1],
                             (size_t)p->m * p->n * sizeof(float), "matmul output conversion");
        if (st != TD_OK)
            return st;
        y = c->scratch[1];
        ct = TD_F32;
    }

    float alpha = 1.0f, beta = (direct && p->accumulate) ? 1.0f : 0.0f;
    cublasStatus_t cs = cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, p->n, p->m, p->k, &alpha,
                                     p->w, td_cuda_dt(wt), p->k, x, td_cuda_dt(wt), p->k, &beta,
                                     y, td_cuda_dt(ct), p->n, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT);
    if (cs != CUBLAS_STATUS_SUCCESS)
        return td_errorf(TD_ERR_CUDA, "cuda: cublasGemmEx (m %d, n %d, k %d, w %s, y %s) failed: %s",
                         p->m, p->n, p->k, td_dtype_name(wt), td_dtype_name(yt),
                         cublasGetStatusString(cs));
    if (!direct) {
        st = td_cuda_convert(c, p->y, yt, y, TD_F32, (size_t)p->m * p->n, p->accumulate);
        if (st != TD_OK)
            return st;
    }
    if (p->bias)
        return td_cuda_add_bias(c, p->y, yt, p->bias, wt, p->m, p->n);
    return TD_OK;
}
