/*
 * td_backend: the one kernel interface of tandem. A backend is a vtable plus a context
 * (ggml style); the engine calls nothing else to compute.
 *
 * Memory. "Device memory" is whatever the backend allocates with ops->alloc; for the CPU
 * backend it is host memory (be->host_memory is true and the engine may hand it mmapped
 * host pointers directly). Weights, activations and the KV pool all live there.
 *
 * Dtypes. Activations are in be->act_dtype (CPU: f32). Weights are in the dtype the
 * caller passes per op (the backend's supported set is be->weight_dtypes, a bit mask of
 * 1u << td_dtype_t). The KV pool is in layout->dtype (td_kv_layout.h gives its shape).
 *
 * Steps. A forward step over a batch of sequences first hands the backend its metadata
 * (ops->set_step); the row-wise ops that need positions, cache slots or block tables read
 * them from there, so a device backend uploads them once per step. Rows of a step are the
 * new tokens of every sequence, sequence after sequence.
 *
 * Errors. Every op returns td_status_t; a backend that fails describes the error itself
 * (td_errorf). Ops validate nothing a correct engine cannot get wrong: shapes are the
 * caller's contract (TD_ASSERT guards the cheap invariants).
 *
 * Threads. A backend context is used by one thread at a time; the CPU backend runs each
 * op on its own worker pool. The one exception is a node's data plane: its loop thread may
 * call the async copy ops below, and copy_h2d into blocks no step reads (a leased transfer's
 * landing copy), while the compute thread runs steps. Both backends allow it: the CPU's are
 * memcpy; the CUDA backend's only queue work on its streams (thread-safe CUDA calls), and
 * copy_h2d runs on its data-plane stream and returns once done, so the loop thread waits for
 * that copy only, and the steps queued after it see the bytes.
 */
#ifndef TD_BACKEND_H
#define TD_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_dtype.h"
#include "td_kv_layout.h"
#include "td_status.h"

typedef struct td_backend td_backend_t;

/* Per-step metadata, host arrays owned by the caller and valid until the next set_step. */
typedef struct td_step_meta {
    int32_t n_tokens;            /* rows in this step, all sequences */
    int32_t n_seqs;
    const int32_t *tokens;       /* [n_tokens] token id of each row */
    const int32_t *positions;    /* [n_tokens] absolute position of each row in its sequence */
    const int32_t *slots;        /* [n_tokens] cache slot of each row: block_id * block_size + offset */
    const int32_t *seq_start;    /* [n_seqs + 1] first row of each sequence; seq_start[n_seqs] = n_tokens */
    const int32_t *seq_len;      /* [n_seqs] context length after this step (cached prefix + new rows) */
    const int32_t *block_tables; /* [n_seqs][max_blocks] block ids of each sequence, in order */
    int32_t max_blocks;          /* row stride of block_tables */
    int32_t max_q_len;           /* most new rows of any sequence (1 = a pure decode step) */
    int32_t max_seq_len;         /* largest seq_len */
} td_step_meta_t;

/* Y[m][n] = X[m][k] . W[n][k]^T (+ bias[n]) (+ Y when accumulate) */
/* most matrices one ops->matmuls call takes */
#define TD_BACKEND_MATMULS_MAX 4

typedef struct td_matmul_params {
    int32_t m, n, k;
    const void *x;        /* [m][k] act_dtype, rows contiguous */
    const void *w;        /* [n][k] w_dtype (a PyTorch Linear weight as stored); a block
                             type: each row k / block_elems blocks (td_dtype_bytes) */
    td_dtype_t w_dtype;
    const void *bias;     /* [n] bias_dtype (a float type), or NULL */
    td_dtype_t bias_dtype;
    bool w_packed;        /* w is ops->weight_pack's form of a [n][k] w_dtype matrix */
    void *y;              /* [m][n] act_dtype, or f32 when y_f32 */
    bool y_f32;           /* output in f32 whatever act_dtype is (logits) */
    bool accumulate;      /* y += result (the residual add) */
} td_matmul_params_t;

typedef enum td_rope_style {
    TD_ROPE_PAIRS = 0,   /* rotate (x[2i], x[2i+1]): llama2.c checkpoints */
    TD_ROPE_HALVES = 1,  /* rotate (x[i], x[i + d/2]): Hugging Face checkpoints */
} td_rope_style_t;

/* Rotary embedding fused with the KV-cache write, one pass over the step's rows: q is
 * rotated in place at each row's position (step meta), k is rotated and written with v into
 * the row's slot of one layer of the pool (rows with a negative slot are padding: their K/V
 * are not written). k's contents afterwards are unspecified (a backend may rotate it in
 * place or leave it). inv_freq NULL: no rotation at all (a model without RoPE, or a caller
 * that only fills the cache); q may then be NULL. */
typedef struct td_rope_kv_params {
    void *q;               /* [n_tokens][n_heads][head_dim] act_dtype, or NULL */
    void *k;               /* [n_tokens][n_kv_heads][head_dim] act_dtype */
    const void *v;         /* [n_tokens][n_kv_heads][head_dim] act_dtype */
    int32_t n_heads;       /* query heads (n_kv_heads and head_dim are the layout's) */
    const float *inv_freq; /* [head_dim / 2] device memory: frequency of pair i (scaling
                              applied), or NULL */
    td_rope_style_t style;
    void *kv_layer;        /* this layer's part of the pool (td_kv_block_offset(.., l, 0)) */
    const td_kv_layout_t *layout;
    int32_t n_blocks;      /* blocks in the pool */
} td_rope_kv_params_t;

/* Attention of the step's rows against one layer's paged KV cache. The new rows' K and V
 * must already be written (rope_kv_write) before either attention op. */
typedef struct td_attn_params {
    const void *q;             /* [n_tokens][n_heads][head_dim] act_dtype */
    void *out;                 /* [n_tokens][n_heads][head_dim] act_dtype */
    const void *kv_layer;      /* this layer's part of the pool: [n_blocks][2][block_size][n_kv_heads][head_dim] */
    const td_kv_layout_t *layout;
    int32_t n_blocks;          /* blocks in the pool */
    int32_t n_heads;           /* query heads; n_heads % layout->n_kv_heads == 0 */
    float scale;               /* softmax scale, usually 1/sqrt(head_dim) */
    int32_t partition_tokens;  /* decode split-KV partition size in tokens (multiple of block
                                  size); 0 = the backend's heuristic */
    int32_t window;            /* sliding window: a row at position p attends to the keys in
                                  (p - window, p] only, and block-table entries of blocks wholly
                                  below its rows' windows are never read (they may be released,
                                  -1); 0 = the whole causal context */
} td_attn_params_t;

typedef struct td_backend_ops {
    const char *name;
    void (*destroy)(td_backend_t *be);

    /* memory */
    td_status_t (*alloc)(td_backend_t *be, size_t bytes, void **ptr_p);
    void (*free)(td_backend_t *be, void *ptr);
    /* copy_h2d returns once the bytes are in dst (src may be reused) and ops queued after it
       see them; it is not ordered after the ops queued before it, so dst must be memory none
       of them still uses. copy_d2h returns once the bytes are in dst; copy_d2d is ordered
       before the ops queued after it. Ranges must not overlap. */
    td_status_t (*copy_h2d)(td_backend_t *be, void *dst, const void *src, size_t bytes);
    td_status_t (*copy_d2h)(td_backend_t *be, void *dst, const void *src, size_t bytes);
    td_status_t (*copy_d2d)(td_backend_t *be, void *dst, const void *src, size_t bytes);
    td_status_t (*sync)(td_backend_t *be);
    /* Asynchronous device-to-host copies for the data plane (td_xfer stages a device KV
       pool through host memory with them, docs/xfer.md): copy_d2h_start queues a copy
       ordered after all work queued so far, on a queue of its own so that it overlaps the
       compute queued later, returns at once naming it *ticket_p, and once it has finished
       (copy_poll says so) calls wake(wake_arg) from a backend thread (thread-safe work only: uv_async_send);
       a copy done before the call returns may skip the wake. Copies finish in the order
       they started. Called from one thread (the node's loop). */
    td_status_t (*copy_d2h_start)(td_backend_t *be, void *dst, const void *src, size_t bytes,
                                  void (*wake)(void *wake_arg), void *wake_arg, uint64_t *ticket_p);
    /* TD_OK: copy `ticket` is done; TD_ERR_BUSY: still running; other: it failed. Never blocks. */
    td_status_t (*copy_poll)(td_backend_t *be, uint64_t ticket);
    /* Returns once no wake of a finished copy is still to come (before the wake target goes). */
    void (*copy_quiesce)(td_backend_t *be);
    /* Page-locks host memory so that async copies reach it directly (CPU: nothing to do);
       host_unpin before the memory is freed. */
    td_status_t (*host_pin)(td_backend_t *be, void *p, size_t bytes);
    void (*host_unpin)(td_backend_t *be, void *p);

    /* step */
    td_status_t (*set_step)(td_backend_t *be, const td_step_meta_t *meta);

    /* ops (rows = the step's n_tokens unless a count is given) */
    /* x[row] = table[tokens[row]] converted to act_dtype; table [vocab][dim] */
    td_status_t (*embed)(td_backend_t *be, void *x, const void *table, td_dtype_t table_dtype,
                         int32_t dim);
    /* out[r] = x[r] / rms(x[r]) * w, for `rows` rows of `dim`; in place when out == x.
       When residual is non-NULL first residual[r] += x[r] and normalise the sum (fused
       residual add): out gets the normalised sum, residual keeps the sum. */
    td_status_t (*rmsnorm)(td_backend_t *be, void *out, void *x, void *residual, const void *w,
                           td_dtype_t w_dtype, int32_t rows, int32_t dim, float eps);
    td_status_t (*matmul)(td_backend_t *be, const td_matmul_params_t *p);
    /* count (1..TD_BACKEND_MATMULS_MAX) matmuls of one input: every ps[i] has the same m, k
       and x (each its own w, n, bias, y; no y may alias x or another's y). The results are
       those of count matmul calls, bit for bit; a backend may run them as one pass (CPU: X
       quantized once per weight type and one fork-join for all, where Q, K and V, or gate
       and up, would be three or two). */
    td_status_t (*matmuls)(td_backend_t *be, const td_matmul_params_t *ps, int32_t count);
    td_status_t (*rope_kv_write)(td_backend_t *be, const td_rope_kv_params_t *p);
    /* FlashAttention-style: query tiles against K/V tiles of the paged cache, online
       softmax, causal (row at position p sees positions <= p, and > p - window when
       p->window is set), any number of new rows per
       sequence attending to the cached prefix plus themselves */
    td_status_t (*attn_prefill)(td_backend_t *be, const td_attn_params_t *p);
    /* FlashDecoding split-KV: exactly one new row per sequence; each sequence's context
       is split into partitions computed in parallel and merged by log-sum-exp */
    td_status_t (*attn_decode)(td_backend_t *be, const td_attn_params_t *p);
    /* out[r][i] = silu(gate[r][i]) * up[r][i]; all [rows][hidden] act_dtype; out may be gate */
    td_status_t (*swiglu)(td_backend_t *be, void *out, const void *gate, const void *up,
                          int32_t rows, int32_t hidden);
    /* dst[i] = src[rows[i]] for n rows of `dim` act_dtype elements (rows: host array) */
    td_status_t (*gather_rows)(td_backend_t *be, void *dst, const void *src, const int32_t *rows,
                               int32_t n, int32_t dim);
    /* The experts' outputs of a mixture summed into the residual stream: for each of n rows,
       x[t] += sum over r = 0..k-1, in that order, of weights[t * k + r] * y[slots[t * k + r]]
       (the sum in f32, then added to x). x [n][dim], y [rows >= max slot + 1][dim], both
       act_dtype; slots and weights are host arrays of n * k. A row's sum is a fixed sequence
       of operations on its own values, so it does not depend on how the engine grouped the
       rows of a step by expert (the engine's batch invariance). */
    td_status_t (*moe_combine)(td_backend_t *be, void *x, const void *y, const int32_t *slots,
                               const float *weights, int32_t n, int32_t k, int32_t dim);
    /* copies whole blocks (all layers, K and V) src[i] -> dst[i] in a pool (copy-on-write) */
    td_status_t (*copy_blocks)(td_backend_t *be, void *pool, const td_kv_layout_t *layout,
                               int32_t n_blocks, const int32_t *src, const int32_t *dst, int32_t n);

    /* weights */
    /* Repacks a weight [n][k] (w, host memory, only read) into a layout of the backend's
       own that its matmul reads faster (CPU: block types 16 rows interleaved for int8 dot
       products, td_cpu_pack.h; float types in cpu:q8 at level avx512bf16 to bf16 16 rows
       interleaved, td_cpu_bgemm.h). *packed_p is the new device buffer, freed with ops->free,
       passed to matmul with w_packed; NULL (TD_OK) when the backend keeps this weight as
       stored. NULL op: the backend never repacks (CUDA). Errors: TD_ERR_NOMEM. */
    td_status_t (*weight_pack)(td_backend_t *be, const void *w, td_dtype_t dtype, int32_t n, int32_t k,
                               void **packed_p);
} td_backend_ops_t;

struct td_backend {
    const td_backend_ops_t *ops;
    td_dtype_t act_dtype;
    uint32_t weight_dtypes; /* bit mask of 1u << td_dtype_t the matmul accepts (a type some
                               backend reads only packed, CPU Q5_K and IQ4_XS, is in it only
                               when ops->weight_pack always packs it) */
    uint32_t kv_dtypes;     /* bit mask of KV pool dtypes the attention ops accept */
    bool host_memory;       /* device memory is host memory (pointers interchangeable) */
};

/* CPU backend (the reference). n_threads <= 0: all online CPUs. */
typedef struct td_cpu_config {
    int32_t n_threads;
    bool device_memory; /* treat its memory as a device's (host_memory false): the engine
                           uploads weights, the nodes stage KV through host buffers and a
                           landing area, as on a GPU; the device paths, tested without one */
    bool exact;         /* block-quantized weights meet f32 activations, the weights
                           dequantized in registers (td_cpu_qf32: exact to f32 rounding),
                           instead of the default: activations quantized per block of 32 to
                           integers for int8 dot products, against weights repacked at load
                           (td_cpu_pack, two bytes a value; td_cpu_quant, llama.cpp's one
                           byte, for the K formats) */
    bool act_one_byte;  /* the packed quantized matmul's activations in one byte a value
                           (llama.cpp's rounding, td_cpu_pack.h) instead of two: about 1.6x
                           the AVX2 prefill rate, llama.cpp's precision; and at level
                           avx512bf16 float weights repacked to bf16 and met by activations
                           rounded to bf16 (td_cpu_bgemm.h); --device cpu:q8 */
    const char *isa;    /* the kernels' instruction set: "scalar", "avx2", "avx512",
                           "avx512vnni", "avx512bf16" or "amx"; NULL or "" for $TANDEM_CPU_ISA, and when that is
                           unset the best this CPU runs. A lower one is for measuring the
                           kernels other machines run; one this CPU lacks is an error */
} td_cpu_config_t;

/* Errors: TD_ERR_INVALID (logged) for an isa (cfg->isa or TANDEM_CPU_ISA) that is not a
 * level or that this CPU does not run; TD_ERR_NOMEM, TD_ERR_INTERNAL (threads). */
td_status_t td_backend_cpu_create(const td_cpu_config_t *cfg, td_backend_t **be_p);

/* The instruction set a CPU backend's kernels run ("avx2", ...), NULL for another backend. */
const char *td_backend_cpu_isa(const td_backend_t *be);

/* The instruction set td_backend_cpu_create would choose for cfg->isa = want (NULL: from
 * TANDEM_CPU_ISA, else the best), and the best this CPU runs, as static strings: what
 * `tandem --version` prints. Errors: td_backend_cpu_create's TD_ERR_INVALID. */
td_status_t td_backend_cpu_isa_choose(const char *want, const char **isa_p, const char **best_p);

/* CUDA backend; TD_ERR_UNSUPPORTED, not logged (a probe's answer), when built without CUDA,
 * when its module (libtandem-cuda.so, loaded on the first call: kernels/cuda/td_cuda_module.h)
 * or the CUDA runtime it links is not installed, or when device cfg->device is not there or
 * not usable; other errors are logged. Thread-safe. */
typedef struct td_cuda_config {
    int32_t device;
    td_dtype_t act_dtype;
} td_cuda_config_t;

td_status_t td_backend_cuda_create(const td_cuda_config_t *cfg, td_backend_t **be_p);

/* True when this build has the CUDA backend compiled in. */
bool td_backend_cuda_compiled(void);

/* Where a process computes: the --device value "cpu", "cuda" (device 0), "cuda:N",
 * "cpu:staged" (the CPU backend with device_memory: the device paths without a GPU),
 * "cpu:exact" (the CPU backend with exact: f32 activations for quantized weights) or
 * "cpu:q8" (with act_one_byte: one-byte activations, llama.cpp's precision). */
typedef struct td_device_spec {
    bool cuda;
    bool staged;     /* cpu:staged */
    bool exact;      /* cpu:exact (td_cpu_config_t.exact) */
    bool q8;         /* cpu:q8 (td_cpu_config_t.act_one_byte) */
    int32_t index;   /* CUDA device ordinal */
} td_device_spec_t;

/* Parses a --device value. TD_ERR_INVALID (logged, naming the value) for anything else. */
td_status_t td_device_parse(const char *s, td_device_spec_t *out);

/* The --dtype a process uses on `dev` when none is asked (-1: weights as stored, f32 KV and
 * activations): on CUDA the model's stored dtype, so that bf16 weights are used in place
 * and the KV cache and activations take the tensor-core kernels; on the CPU -1. */
int td_device_default_dtype(const td_device_spec_t *dev, td_dtype_t model_dtype);

/*
 * Opens the backend `dev` names, the one way the CLI and the nodes get one: the CPU backend
 * with n_threads workers (<= 0: all cores; its activations are always f32), or the CUDA
 * backend with activations in act_dtype. Every failure is logged with what to do, a
 * missing GPU or a build without CUDA included (td_backend_cuda_create alone is quiet so
 * that tests can probe).
 */
td_status_t td_backend_open(const td_device_spec_t *dev, int32_t n_threads, td_dtype_t act_dtype,
                            td_backend_t **be_p);

/* Destroys any backend; NULL is a no-op. */
void td_backend_destroy(td_backend_t *be);

#endif /* TD_BACKEND_H */
