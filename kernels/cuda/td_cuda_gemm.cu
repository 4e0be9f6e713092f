/*
 * td_cuda_gemm: Y[m][n] = X[m][k] . W[n][k]^T (+ bias) (+ Y) through cublasGemmEx with fp32
 * accumulation (CUBLAS_COMPUTE_32F, no TF32: the fp32 path must match the CPU token for
 * token).
 *
 * Row-major Y is column-major Y^T [n x m], so we ask cuBLAS for Y^T = W . X^T with W read
 * transposed (op T on the column-major [k x n] view of W) and X^T as is ([k x m], ld k).
 *
 * cuBLAS multiplies A and B of one dtype. When the weights are in the activation dtype (the
 * engine's case: weight_dtypes admits only that and f32) that is the operand dtype and the
 * product is one cuBLAS call. Otherwise both operands are widened to f32 in scratch buffers
 * (exact, as the CPU does; narrowing X to 16 bits would round it). When cuBLAS cannot write
 * the wanted output directly (a 16-bit Y from f32 operands, or a 16-bit Y with a bias) the
 * product lands in an f32 scratch, the bias is added there, and one pass converts it into
 * (or adds it to) Y, so Y is rounded once, as on the CPU.
 */
#include "td_cuda_impl.h"

static cudaDataType_t td_cuda_dt(td_dtype_t t)
{
    return t == TD_F32 ? CUDA_R_32F : t == TD_F16 ? CUDA_R_16F : CUDA_R_16BF;
}

/* n elements of `t` at src widened into f32 scratch slot `slot`; *out_p points at them */
static td_status_t td_cuda_widen(td_cuda_backend_t *c, int slot, const void *src, td_dtype_t t, size_t n,
                                 const char *what, const void **out_p)
{
    td_status_t st = td_cuda_reserve(c, &c->scratch[slot], &c->scratch_cap[slot], n * sizeof(float), what);
    if (st != TD_OK)
        return st;
    if ((st = td_cuda_convert(c, c->scratch[slot], TD_F32, src, t, n, false)) != TD_OK)
        return st;
    *out_p = c->scratch[slot];
    return TD_OK;
}

td_status_t td_cuda_matmul(td_cuda_backend_t *c, const td_matmul_params_t *p)
{
    td_dtype_t act = c->base.act_dtype;
    td_dtype_t wt = p->w_dtype;
    td_dtype_t yt = p->y_f32 ? TD_F32 : act;
    td_dtype_t ot = wt == act ? wt : TD_F32; /* the operands' dtype */
    td_status_t st;
    if (p->m == 0 || p->n == 0)
        return TD_OK;

    const void *x = p->x, *w = p->w;
    if (act != ot && (st = td_cuda_widen(c, 0, p->x, act, (size_t)p->m * p->k, "matmul input widening", &x)) != TD_OK)
        return st;
    if (wt != ot && (st = td_cuda_widen(c, 2, p->w, wt, (size_t)p->n * p->k, "matmul weight widening", &w)) != TD_OK)
        return st;
    /* cuBLAS writes C in the operand dtype or f32 */
    bool direct = yt == TD_F32 || (yt == ot && !p->bias);
    void *y = p->y;
    if (!direct) {
        st = td_cuda_reserve(c, &c->scratch[1], &c->scratch_cap[1],
                             (size_t)p->m * p->n * sizeof(float), "matmul output conversion");
        if (st != TD_OK)
            return st;
        y = c->scratch[1];
    }

    float alpha = 1.0f, beta = (direct && p->accumulate) ? 1.0f : 0.0f;
    int32_t ld = p->k > 0 ? p->k : 1; /* cuBLAS refuses a leading dimension of 0 */
    cublasStatus_t cs = cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, p->n, p->m, p->k, &alpha,
                                     w, td_cuda_dt(ot), ld, x, td_cuda_dt(ot), ld, &beta,
                                     y, td_cuda_dt(direct ? yt : TD_F32), p->n, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT);
    if (cs != CUBLAS_STATUS_SUCCESS)
        return td_errorf(TD_ERR_CUDA, "cuda: cublasGemmEx (m %d, n %d, k %d, w %s, y %s) failed: %s",
                         p->m, p->n, p->k, td_dtype_name(wt), td_dtype_name(yt),
                         cublasGetStatusString(cs));
    if (direct)
        return p->bias ? td_cuda_add_bias(c, p->y, yt, p->bias, p->bias_dtype, p->m, p->n) : TD_OK;
    if (p->bias && (st = td_cuda_add_bias(c, y, TD_F32, p->bias, p->bias_dtype, p->m, p->n)) != TD_OK)
        return st;
    return td_cuda_convert(c, p->y, yt, y, TD_F32, (size_t)p->m * p->n, p->accumulate);
}
