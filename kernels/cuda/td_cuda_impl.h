/*
 * td_cuda_impl: what the CUDA backend's translation units share and nobody else sees:
 * the backend context (stream, cuBLAS handles, the step metadata on the device, scratch
 * buffers), the error-translation macro, device-side dtype conversion and the launchers
 * each op file exports to td_cuda_backend.cu. C++ (nvcc) only.
 *
 * Threads: a context is used by one host thread at a time (td_backend.h). Every launcher
 * queues work on ctx->stream and returns without synchronising.
 */
#ifndef TD_CUDA_IMPL_H
#define TD_CUDA_IMPL_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "td_backend.h"
#include "td_log.h"
#include "td_status.h"
}

/* Rows of queries one prefill tile owns; set_step builds the tile list with it. */
#define TD_CUDA_PREFILL_BM 64

/* The step metadata in device memory; every pointer is into one allocation (meta_dev). */
typedef struct td_cuda_step {
    int32_t n_tokens, n_seqs, max_blocks, max_q_len, max_seq_len;
    int32_t n_qtiles;              /* prefill query tiles of TD_CUDA_PREFILL_BM rows */
    const int32_t *tokens;         /* [n_tokens] */
    const int32_t *positions;      /* [n_tokens] */
    const int32_t *slots;          /* [n_tokens] */
    const int32_t *seq_start;      /* [n_seqs + 1] */
    const int32_t *seq_len;        /* [n_seqs] */
    const int32_t *block_tables;   /* [n_seqs][max_blocks] */
    const int32_t *qtile_seq;      /* [n_qtiles] sequence of each prefill tile */
    const int32_t *qtile_row;      /* [n_qtiles] first row (step-global) of each tile */
} td_cuda_step_t;

/* Copies in flight at once per backend (copy_d2h_start refuses more: poll them). */
#define TD_CUDA_XFER_SLOTS 256

/* What a finished data-plane copy calls, from CUDA's host-function thread. */
typedef struct td_cuda_wake {
    void (*fn)(void *arg);
    void *arg;
} td_cuda_wake_t;

typedef struct td_cuda_backend {
    td_backend_t base; /* first: the engine sees a td_backend_t */
    int device;
    int n_sms;
    size_t smem_optin;        /* largest dynamic shared memory a block may opt into */
    unsigned prefill_smem_set; /* td_cuda_attn_prefill.cu: bit per tensor-core kernel whose
                                  shared-memory attribute is set (once per context) */
    uint64_t decode_smem_set;  /* td_cuda_attn_decode.cu: likewise, bit 4 * (3 * q dtype + KV dtype) + log2 heads a block */
    cudaStream_t stream;
    cublasHandle_t cublas;
    void *cublas_ws;          /* cuBLAS workspace (fixed, so graph capture is possible) */
    size_t cublas_ws_bytes;

    /* step metadata: host staging (pinned) and device copy, grown when a step needs more */
    int32_t *meta_host;
    int32_t *meta_dev;
    size_t meta_cap;          /* int32 elements of both */
    cudaEvent_t meta_done;    /* the last upload from meta_host has finished reading it */
    td_cuda_step_t step;

    /* scratch: host row lists for gather_rows, GEMM dtype conversion, decode partials */
    int32_t *rows_dev;
    size_t rows_cap;          /* int32 elements */
    void *moe_dev;            /* moe_combine: the host's slots then weights, uploaded */
    size_t moe_cap;           /* bytes */
    void *scratch[3];         /* matmul: X widened, product in f32, W widened */
    size_t scratch_cap[3];    /* bytes */
    float *dec_ws;            /* decode partial outputs and (max, sum) pairs */
    size_t dec_ws_cap;        /* floats */

    /* data-plane copies (copy_d2h_start): their own stream, so D2H overlaps compute; ticket
       t uses slot t % TD_CUDA_XFER_SLOTS until it is polled done */
    cudaStream_t xfer_stream;
    cudaEvent_t xfer_order;   /* recorded on `stream`: a copy waits for the work queued before it */
    cudaEvent_t xfer_done[TD_CUDA_XFER_SLOTS];  /* recorded after the copy: poll reads it */
    cudaEvent_t xfer_woken[TD_CUDA_XFER_SLOTS]; /* recorded after its wake: the slot is free */
    td_cuda_wake_t xfer_wake[TD_CUDA_XFER_SLOTS];
    uint64_t xfer_next;       /* tickets handed out */
    uint64_t xfer_done_upto;  /* tickets below this are known done */
} td_cuda_backend_t;

/* Checks a CUDA runtime call; on failure describes it and returns TD_ERR_CUDA (or NOMEM). */
#define TD_CUDA_TRY(call)                                                                    \
    do {                                                                                     \
        cudaError_t td_e_ = (call);                                                          \
        if (td_e_ != cudaSuccess)                                                            \
            return td_cuda_error(td_e_, #call, __FILE__, __LINE__);                          \
    } while (0)

/* Checks the last kernel launch of `what`. */
#define TD_CUDA_LAUNCHED(what)                                                               \
    do {                                                                                     \
        cudaError_t td_e_ = cudaGetLastError();                                              \
        if (td_e_ != cudaSuccess)                                                            \
            return td_cuda_error(td_e_, what, __FILE__, __LINE__);                           \
    } while (0)

/* Describes a CUDA error (td_errorf) and maps it: out of memory -> TD_ERR_NOMEM, else
   TD_ERR_CUDA. Clears the sticky-free last error so a later call is not blamed. */
td_status_t td_cuda_error(cudaError_t e, const char *what, const char *file, int line);

/* Grows a device buffer to at least `bytes` (contents lost); TD_ERR_NOMEM when it cannot. */
td_status_t td_cuda_reserve(td_cuda_backend_t *c, void **buf, size_t *cap_bytes, size_t bytes,
                            const char *what);

/* ---- device-side element access, fp32 in registers ----------------------------------- */
__device__ __forceinline__ float td_ld(const float *p) { return *p; }
__device__ __forceinline__ float td_ld(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ float td_ld(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void td_st(float *p, float v) { *p = v; }
__device__ __forceinline__ void td_st(__half *p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void td_st(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }

template <typename T> struct td_cuda_type_of;
template <> struct td_cuda_type_of<float> { static const td_dtype_t value = TD_F32; };
template <> struct td_cuda_type_of<__half> { static const td_dtype_t value = TD_F16; };
template <> struct td_cuda_type_of<__nv_bfloat16> { static const td_dtype_t value = TD_BF16; };

/* Calls f.template operator()<T>() with T the C++ type of dtype `t`. */
#define TD_CUDA_DISPATCH(t, T, ...)                                                          \
    do {                                                                                     \
        switch (t) {                                                                         \
        case TD_F32: { typedef float T; __VA_ARGS__; } break;                                \
        case TD_F16: { typedef __half T; __VA_ARGS__; } break;                               \
        case TD_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; } break;                       \
        default: break; /* block types: the engine dequantizes them for this backend */      \
        }                                                                                    \
    } while (0)

/* ---- launchers (td_cuda_ops.cu, td_cuda_attn_*.cu, td_cuda_gemm.cu) ------------------ */
td_status_t td_cuda_embed(td_cuda_backend_t *c, void *x, const void *table, td_dtype_t table_dtype,
                          int32_t dim);
td_status_t td_cuda_rmsnorm(td_cuda_backend_t *c, void *out, void *x, void *residual,
                            const void *w, td_dtype_t w_dtype, int32_t rows, int32_t dim,
                            float eps);
td_status_t td_cuda_rope_kv_write(td_cuda_backend_t *c, const td_rope_kv_params_t *p);
td_status_t td_cuda_swiglu(td_cuda_backend_t *c, void *out, const void *gate, const void *up,
                           int32_t rows, int32_t hidden);
td_status_t td_cuda_gather_rows(td_cuda_backend_t *c, void *dst, const void *src,
                                const int32_t *rows, int32_t n, int32_t dim);
td_status_t td_cuda_moe_combine(td_cuda_backend_t *c, void *x, const void *y, const int32_t *slots,
                                const float *weights, int32_t n, int32_t k, int32_t dim);
/* elementwise dst = convert(src) (+ dst when accumulate), n elements */
td_status_t td_cuda_convert(td_cuda_backend_t *c, void *dst, td_dtype_t dst_t, const void *src,
                            td_dtype_t src_t, size_t n, bool accumulate);
/* y[r][i] += bias[i] for rows x n */
td_status_t td_cuda_add_bias(td_cuda_backend_t *c, void *y, td_dtype_t y_t, const void *bias,
                             td_dtype_t b_t, int32_t rows, int32_t n);
td_status_t td_cuda_matmul(td_cuda_backend_t *c, const td_matmul_params_t *p);
td_status_t td_cuda_attn_prefill(td_cuda_backend_t *c, const td_attn_params_t *p);
td_status_t td_cuda_attn_decode(td_cuda_backend_t *c, const td_attn_params_t *p);

#endif /* TD_CUDA_IMPL_H */
