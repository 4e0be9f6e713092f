/*
 * td_cuda_backend: the CUDA implementation of td_backend.h: device selection, memory,
 * copies on the backend's own stream, the per-step metadata upload and the vtable. The
 * ops themselves live one family per file (td_cuda_ops.cu, td_cuda_gemm.cu,
 * td_cuda_attn_prefill.cu, td_cuda_attn_decode.cu).
 *
 * The metadata of a step is packed into one pinned host buffer and uploaded with one
 * asynchronous copy into one preallocated device buffer; both grow only when a step is
 * larger than any before, so a steady decode loop allocates nothing (and could be captured
 * as a CUDA graph once warmed up with its largest shapes).
 */
#include "td_cuda_impl.h"

extern "C" {
#include "td_cuda_module.h"
}

#include <stdlib.h>
#include <string.h>

td_status_t td_cuda_error(cudaError_t e, const char *what, const char *file, int line)
{
    (void)cudaGetLastError(); /* clear a non-sticky error so the next call starts clean */
    if (e == cudaErrorMemoryAllocation)
        return td_errorf(TD_ERR_NOMEM, "cuda: out of device memory in %s (%s:%d): free memory "
                         "on the GPU or use a smaller model / KV pool", what, file, line);
    return td_errorf(TD_ERR_CUDA, "cuda: %s failed (%s:%d): %s (%s)", what, file, line,
                     cudaGetErrorName(e), cudaGetErrorString(e));
}

td_status_t td_cuda_reserve(td_cuda_backend_t *c, void **buf, size_t *cap_bytes, size_t bytes,
                            const char *what)
{
    if (*cap_bytes >= bytes)
        return TD_OK;
    size_t want = bytes + bytes / 2; /* geometric growth: a growing workload settles fast */
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, want);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return td_errorf(TD_ERR_NOMEM, "cuda: cannot allocate %zu bytes of device memory for %s: "
                         "%s", want, what, cudaGetErrorString(e));
    }
    if (*buf) {
        /* the old buffer may still be read by queued work: free after the stream drains */
        cudaError_t se = cudaStreamSynchronize(c->stream);
        cudaFree(*buf);
        if (se != cudaSuccess) {
            cudaFree(p);
            *buf = NULL;
            *cap_bytes = 0;
            return td_cuda_error(se, "cudaStreamSynchronize", __FILE__, __LINE__);
        }
    }
    *buf = p;
    *cap_bytes = want;
    return TD_OK;
}

static td_cuda_backend_t *td_cuda_ctx(td_backend_t *be)
{
    return (td_cuda_backend_t *)be;
}

/* ---- memory ---------------------------------------------------------------------------- */

static void td_cuda_destroy(td_backend_t *be)
{
    td_cuda_backend_t *c = td_cuda_ctx(be);
    if (!c)
        return;
    cudaSetDevice(c->device);
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    if (c->xfer_stream) {
        cudaStreamSynchronize(c->xfer_stream);
        cudaStreamDestroy(c->xfer_stream);
    }
    if (c->xfer_order)
        cudaEventDestroy(c->xfer_order);
    for (int i = 0; i < TD_CUDA_XFER_SLOTS; i++) {
        if (c->xfer_done[i])
            cudaEventDestroy(c->xfer_done[i]);
        if (c->xfer_woken[i])
            cudaEventDestroy(c->xfer_woken[i]);
    }
    if (c->cublas)
        cublasDestroy(c->cublas);
    cudaFree(c->cublas_ws);
    cudaFree(c->meta_dev);
    cudaFreeHost(c->meta_host);
    if (c->meta_done)
        cudaEventDestroy(c->meta_done);
    cudaFree(c->rows_dev);
    cudaFree(c->moe_dev);
    for (int i = 0; i < 3; i++)
        cudaFree(c->scratch[i]);
    cudaFree(c->dec_ws);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    free(c);
}

static td_status_t td_cuda_alloc(td_backend_t *be, size_t bytes, void **ptr_p)
{
    void *p = NULL;
    /* every op that may be a thread's first call selects the device: a node creates the
       backend on one thread and computes on another, whose current device is 0 */
    TD_CUDA_TRY(cudaSetDevice(td_cuda_ctx(be)->device));
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        if (e == cudaErrorMemoryAllocation)
            return td_errorf(TD_ERR_NOMEM, "cuda: out of device memory allocating %.1f MiB "
                             "(%.1f MiB free of %.1f MiB): use a smaller model, dtype or KV pool",
                             bytes / 1048576.0, free_b / 1048576.0, total_b / 1048576.0);
        return td_cuda_error(e, "cudaMalloc", __FILE__, __LINE__);
    }
    *ptr_p = p;
    return TD_OK;
}

static void td_cuda_free(td_backend_t *be, void *ptr)
{
    td_cuda_backend_t *c = td_cuda_ctx(be);
    if (!ptr)
        return;
    cudaSetDevice(c->device);
    cudaStreamSynchronize(c->stream);
    cudaFree(ptr);
}

static td_status_t td_cuda_copy_h2d(td_backend_t *be, void *dst, const void *src, size_t bytes)
{
    /* on the data-plane stream, so that a node's loop thread landing a transfer waits for
       its copy only, not for the compute queued on `stream` (td_backend.h: dst is no memory
       a queued op still uses); synchronous: the caller may reuse src once we return (from
       page-locked memory cudaMemcpyAsync returns before reading it), and ops queued later
       see the bytes */
    td_cuda_backend_t *c = td_cuda_ctx(be);
    TD_CUDA_TRY(cudaSetDevice(c->device));
    TD_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->xfer_stream));
    TD_CUDA_TRY(cudaStreamSynchronize(c->xfer_stream));
    return TD_OK;
}

static td_status_t td_cuda_copy_d2h(td_backend_t *be, void *dst, const void *src, size_t bytes)
{
    /* the caller reads dst as soon as we return: wait for it */
    td_cuda_backend_t *c = td_cuda_ctx(be);
    TD_CUDA_TRY(cudaSetDevice(c->device));
    TD_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    TD_CUDA_TRY(cudaStreamSynchronize(c->stream));
    return TD_OK;
}

static td_status_t td_cuda_copy_d2d(td_backend_t *be, void *dst, const void *src, size_t bytes)
{
    td_cuda_backend_t *c = td_cuda_ctx(be);
    TD_CUDA_TRY(cudaSetDevice(c->device));
    TD_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream));
    return TD_OK;
}

static td_status_t td_cuda_sync(td_backend_t *be)
{
    td_cuda_backend_t *c = td_cuda_ctx(be);
    TD_CUDA_TRY(cudaSetDevice(c->device));
    TD_CUDA_TRY(cudaStreamSynchronize(c->stream));
    return TD_OK;
}

/* ---- data-plane copies (td_xfer staging) ---------------------------------------------- */

static void CUDART_CB td_cuda_xfer_wake(void *arg)
{
    const td_cuda_wake_t *w = (const td_cuda_wake_t *)arg;
    if (w->fn)
        w->fn(w->arg);
}

/* On the xfer stream: wait for the compute queued so far (the layer whose KV is copied
 * was computed before the caller got here), copy, mark the ticket done (what poll reads),
 * wake the caller (who then sees it done), mark the wake run (the slot's wake record may
 * be reused only then). */
static td_status_t td_cuda_copy_d2h_start(td_backend_t *be, void *dst, const void *src, size_t bytes,
                                          void (*wake)(void *wake_arg), void *wake_arg, uint64_t *ticket_p)
{
    td_cuda_backend_t *c = td_cuda_ctx(be);
    if (c->xfer_next - c->xfer_done_upto >= TD_CUDA_XFER_SLOTS)
        return td_errorf(TD_ERR_EXHAUSTED, "cuda: %d device-to-host copies in flight; poll them before starting "
                         "more", TD_CUDA_XFER_SLOTS);
    uint64_t t = c->xfer_next;
    int slot = (int)(t % TD_CUDA_XFER_SLOTS);
    td_cuda_wake_t *w = &c->xfer_wake[slot];
    TD_CUDA_TRY(cudaSetDevice(c->device)); /* the caller's thread (a node's loop) */
    if (t >= TD_CUDA_XFER_SLOTS) {
        /* the slot's previous copy was polled done; its wake is due within microseconds */
        cudaError_t e = cudaEventQuery(c->xfer_woken[slot]);
        if (e == cudaErrorNotReady) {
            (void)cudaGetLastError();
            e = cudaEventSynchronize(c->xfer_woken[slot]);
        }
        if (e != cudaSuccess)
            return td_cuda_error(e, "cudaEventQuery (copy wake)", __FILE__, __LINE__);
    }
    TD_CUDA_TRY(cudaEventRecord(c->xfer_order, c->stream));
    TD_CUDA_TRY(cudaStreamWaitEvent(c->xfer_stream, c->xfer_order, 0));
    TD_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->xfer_stream));
    TD_CUDA_TRY(cudaEventRecord(c->xfer_done[slot], c->xfer_stream));
    w->fn = wake;
    w->arg = wake_arg;
    TD_CUDA_TRY(cudaLaunchHostFunc(c->xfer_stream, td_cuda_xfer_wake, w));
    c->xfer_next = t + 1; /* the slot is taken from here on, whatever fails next */
    *ticket_p = t;
    TD_CUDA_TRY(cudaEventRecord(c->xfer_woken[slot], c->xfer_stream));
    return TD_OK;
}

static td_status_t td_cuda_copy_poll(td_backend_t *be, uint64_t ticket)
{
    td_cuda_backend_t *c = td_cuda_ctx(be);
    if (ticket < c->xfer_done_upto)
        return TD_OK;
    if (ticket >= c->xfer_next)
        return td_errorf(TD_ERR_INVALID, "cuda: no device-to-host copy %llu was started",
                         (unsigned long long)ticket);
    TD_CUDA_TRY(cudaSetDevice(c->device));
    cudaError_t e = cudaEventQuery(c->xfer_done[ticket % TD_CUDA_XFER_SLOTS]);
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError(); /* not an error: leave nothing behind for the next check */
        return TD_ERR_BUSY;
    }
    if (e != cudaSuccess)
        return td_cuda_error(e, "cudaEventQuery (device-to-host copy)", __FILE__, __LINE__);
    c->xfer_done_upto = ticket + 1; /* one stream: every earlier copy is done too */
    return TD_OK;
}

static void td_cuda_copy_quiesce(td_backend_t *be)
{
    td_cuda_backend_t *c = td_cuda_ctx(be);
    cudaSetDevice(c->device);
    cudaStreamSynchronize(c->xfer_stream); /* every wake queued there has run */
}

static td_status_t td_cuda_host_pin(td_backend_t *be, void *p, size_t bytes)
{
    TD_CUDA_TRY(cudaSetDevice(td_cuda_ctx(be)->device));
    cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return td_errorf(TD_ERR_NOMEM, "cuda: cannot page-lock %.1f MiB of host memory (%s): raise the memlock "
                         "limit or stage through less", bytes / 1048576.0, cudaGetErrorString(e));
    }
    return TD_OK;
}

static void td_cuda_host_unpin(td_backend_t *be, void *p)
{
    cudaSetDevice(td_cuda_ctx(be)->device);
    cudaHostUnregister(p);
}

/* ---- step metadata ----------------------------------------------------------------------- */

/* Position of the last row of the prefill tile that starts at row r of sequence s: the
   causal work of the tile grows with it. */
static int32_t td_qtile_last_pos(const td_step_meta_t *m, int32_t s, int32_t r)
{
    int32_t end = m->seq_start[s + 1];
    return m->positions[(r + TD_CUDA_PREFILL_BM < end ? r + TD_CUDA_PREFILL_BM : end) - 1];
}

/* Whether tile i of the list runs after tile j: heaviest first (later last position), ties
   in step order. Rows are unique, so this is a total order: any sort gives the one result a
   stable sort of the step-ordered list would, the same for the same step. */
static bool td_qtile_after(const td_step_meta_t *m, const int32_t *seq, const int32_t *row,
                           int32_t i, int32_t j)
{
    int32_t pi = td_qtile_last_pos(m, seq[i], row[i]), pj = td_qtile_last_pos(m, seq[j], row[j]);
    return pi < pj || (pi == pj && row[i] > row[j]);
}

static void td_qtile_swap(int32_t *seq, int32_t *row, int32_t i, int32_t j)
{
    int32_t s = seq[i], r = row[i];
    seq[i] = seq[j];
    row[i] = row[j];
    seq[j] = s;
    row[j] = r;
}

/* Sifts tile i down the heap [0, n) whose root is the tile that runs last. */
static void td_qtile_sift(const td_step_meta_t *m, int32_t *seq, int32_t *row, int32_t i,
                          int32_t n)
{
    for (int32_t c = 2 * i + 1; c < n; i = c, c = 2 * i + 1) {
        if (c + 1 < n && td_qtile_after(m, seq, row, c + 1, c))
            c++;
        if (!td_qtile_after(m, seq, row, c, i))
            return;
        td_qtile_swap(seq, row, i, c);
    }
}

/* Heapsort of the tile list (seq[n], row[n], in the pinned staging buffer) into launch
   order, in place: nothing allocated in a steady loop, O(n log n) for a long prefill. */
static void td_qtile_sort(const td_step_meta_t *m, int32_t *seq, int32_t *row, int32_t n)
{
    for (int32_t i = n / 2 - 1; i >= 0; i--)
        td_qtile_sift(m, seq, row, i, n);
    for (int32_t end = n - 1; end > 0; end--) {
        td_qtile_swap(seq, row, 0, end); /* the last to run of [0, end] goes to its place */
        td_qtile_sift(m, seq, row, 0, end);
    }
}

static td_status_t td_cuda_set_step(td_backend_t *be, const td_step_meta_t *m)
{
    td_cuda_backend_t *c = td_cuda_ctx(be);
    TD_CUDA_TRY(cudaSetDevice(c->device));
    int32_t n_qtiles = 0;
    for (int32_t s = 0; s < m->n_seqs; s++) {
        int32_t q_len = m->seq_start[s + 1] - m->seq_start[s];
        n_qtiles += (q_len + TD_CUDA_PREFILL_BM - 1) / TD_CUDA_PREFILL_BM;
    }
    size_t nt = (size_t)m->n_tokens, ns = (size_t)m->n_seqs;
    size_t need = 3 * nt + (ns + 1) + ns + ns * (size_t)m->max_blocks + 2 * (size_t)n_qtiles;

    /* the previous upload may still be reading meta_host */
    TD_CUDA_TRY(cudaEventSynchronize(c->meta_done));
    if (need > c->meta_cap) {
        size_t cap = need + need / 2 + 256;
        int32_t *h = NULL, *d = NULL;
        TD_CUDA_TRY(cudaStreamSynchronize(c->stream)); /* queued kernels may read meta_dev */
        cudaError_t e = cudaMallocHost((void **)&h, cap * sizeof(int32_t));
        if (e != cudaSuccess)
            return td_cuda_error(e, "cudaMallocHost (step metadata)", __FILE__, __LINE__);
        e = cudaMalloc((void **)&d, cap * sizeof(int32_t));
        if (e != cudaSuccess) {
            cudaFreeHost(h);
            return td_cuda_error(e, "cudaMalloc (step metadata)", __FILE__, __LINE__);
        }
        cudaFreeHost(c->meta_host);
        cudaFree(c->meta_dev);
        c->meta_host = h;
        c->meta_dev = d;
        c->meta_cap = cap;
    }

    int32_t *h = c->meta_host;
    const int32_t *d = c->meta_dev;
    size_t off = 0;
    td_cuda_step_t *st = &c->step;
#define TD_PACK(field, src, n)                                                               \
    do {                                                                                     \
        if ((n) > 0)                                                                         \
            memcpy(h + off, (src), (n) * sizeof(int32_t));                                  \
        st->field = d + off;                                                                 \
        off += (n);                                                                          \
    } while (0)
    TD_PACK(tokens, m->tokens, nt);
    TD_PACK(positions, m->positions, nt);
    TD_PACK(slots, m->slots, nt);
    TD_PACK(seq_start, m->seq_start, ns + 1);
    TD_PACK(seq_len, m->seq_len, ns);
    TD_PACK(block_tables, m->block_tables, ns * (size_t)m->max_blocks);
#undef TD_PACK
    st->qtile_seq = d + off;
    st->qtile_row = d + off + n_qtiles;
    int32_t t = 0;
    for (int32_t s = 0; s < m->n_seqs; s++) {
        for (int32_t r = m->seq_start[s]; r < m->seq_start[s + 1]; r += TD_CUDA_PREFILL_BM) {
            h[off + t] = s;
            h[off + n_qtiles + t] = r;
            t++;
        }
    }
    /* heaviest first across all sequences, so the long tiles do not start last and leave a
       tail of idle SMs; the kernel takes block x's tile as listed */
    td_qtile_sort(m, h + off, h + off + n_qtiles, n_qtiles);
    off += 2 * (size_t)n_qtiles;

    st->n_tokens = m->n_tokens;
    st->n_seqs = m->n_seqs;
    st->max_blocks = m->max_blocks;
    /* the maxima from the arrays, not the caller's summary: decode launches by them */
    st->max_seq_len = 0;
    st->max_q_len = 0;
    for (int32_t s = 0; s < m->n_seqs; s++) {
        if (m->seq_len[s] > st->max_seq_len)
            st->max_seq_len = m->seq_len[s];
        if (m->seq_start[s + 1] - m->seq_start[s] > st->max_q_len)
            st->max_q_len = m->seq_start[s + 1] - m->seq_start[s];
    }
    st->n_qtiles = n_qtiles;

    TD_CUDA_TRY(cudaMemcpyAsync(c->meta_dev, h, off * sizeof(int32_t), cudaMemcpyHostToDevice,
                                c->stream));
    TD_CUDA_TRY(cudaEventRecord(c->meta_done, c->stream));

    /* gather_rows gets its row list from the host: keep room for a step's worth of rows */
    return td_cuda_reserve(c, (void **)&c->rows_dev, &c->rows_cap,
                           ((size_t)m->n_tokens + 1) * sizeof(int32_t), "gather_rows list");
}

/* ---- ops ----------------------------------------------------------------------------------- */

static td_status_t td_cuda_op_embed(td_backend_t *be, void *x, const void *table,
                                    td_dtype_t table_dtype, int32_t dim)
{
    return td_cuda_embed(td_cuda_ctx(be), x, table, table_dtype, dim);
}

static td_status_t td_cuda_op_rmsnorm(td_backend_t *be, void *out, void *x, void *residual,
                                      const void *w, td_dtype_t w_dtype, int32_t rows, int32_t dim,
                                      float eps)
{
    return td_cuda_rmsnorm(td_cuda_ctx(be), out, x, residual, w, w_dtype, rows, dim, eps);
}

static td_status_t td_cuda_op_matmul(td_backend_t *be, const td_matmul_params_t *p)
{
    return td_cuda_matmul(td_cuda_ctx(be), p);
}

/* one stream in order: the same as count matmul calls (no fused path on the GPU yet) */
static td_status_t td_cuda_op_matmuls(td_backend_t *be, const td_matmul_params_t *ps, int32_t count)
{
    for (int32_t i = 0; i < count; i++) {
        td_status_t st = td_cuda_matmul(td_cuda_ctx(be), &ps[i]);
        if (st != TD_OK)
            return st;
    }
    return TD_OK;
}

static td_status_t td_cuda_op_rope_kv_write(td_backend_t *be, const td_rope_kv_params_t *p)
{
    return td_cuda_rope_kv_write(td_cuda_ctx(be), p);
}

static td_status_t td_cuda_op_attn_prefill(td_backend_t *be, const td_attn_params_t *p)
{
    return td_cuda_attn_prefill(td_cuda_ctx(be), p);
}

static td_status_t td_cuda_op_attn_decode(td_backend_t *be, const td_attn_params_t *p)
{
    return td_cuda_attn_decode(td_cuda_ctx(be), p);
}

static td_status_t td_cuda_op_swiglu(td_backend_t *be, void *out, const void *gate,
                                     const void *up, int32_t rows, int32_t hidden)
{
    return td_cuda_swiglu(td_cuda_ctx(be), out, gate, up, rows, hidden);
}

static td_status_t td_cuda_op_gather_rows(td_backend_t *be, void *dst, const void *src,
                                          const int32_t *rows, int32_t n, int32_t dim)
{
    return td_cuda_gather_rows(td_cuda_ctx(be), dst, src, rows, n, dim);
}

static td_status_t td_cuda_op_moe_combine(td_backend_t *be, void *x, const void *y, const int32_t *slots,
                                          const float *weights, int32_t n, int32_t k, int32_t dim)
{
    return td_cuda_moe_combine(td_cuda_ctx(be), x, y, slots, weights, n, k, dim);
}

static td_status_t td_cuda_op_copy_blocks(td_backend_t *be, void *pool,
                                          const td_kv_layout_t *layout, int32_t n_blocks,
                                          const int32_t *src, const int32_t *dst, int32_t n)
{
    /* K and V of a block are adjacent in each layer: one copy per (pair, layer) */
    td_cuda_backend_t *c = td_cuda_ctx(be);
    TD_CUDA_TRY(cudaSetDevice(c->device));
    size_t bb = td_kv_block_bytes(layout);
    for (int32_t i = 0; i < n; i++) {
        if (src[i] == dst[i])
            continue;
        for (uint32_t l = 0; l < layout->n_layers; l++) {
            char *base = (char *)pool;
            TD_CUDA_TRY(cudaMemcpyAsync(base + td_kv_block_offset(layout, n_blocks, l, dst[i]),
                                        base + td_kv_block_offset(layout, n_blocks, l, src[i]),
                                        bb, cudaMemcpyDeviceToDevice, c->stream));
        }
    }
    return TD_OK;
}

static const td_backend_ops_t td_cuda_ops = {
    /* .name = */ "cuda",
    /* .destroy = */ td_cuda_destroy,
    /* .alloc = */ td_cuda_alloc,
    /* .free = */ td_cuda_free,
    /* .copy_h2d = */ td_cuda_copy_h2d,
    /* .copy_d2h = */ td_cuda_copy_d2h,
    /* .copy_d2d = */ td_cuda_copy_d2d,
    /* .sync = */ td_cuda_sync,
    /* .copy_d2h_start = */ td_cuda_copy_d2h_start,
    /* .copy_poll = */ td_cuda_copy_poll,
    /* .copy_quiesce = */ td_cuda_copy_quiesce,
    /* .host_pin = */ td_cuda_host_pin,
    /* .host_unpin = */ td_cuda_host_unpin,
    /* .set_step = */ td_cuda_set_step,
    /* .embed = */ td_cuda_op_embed,
    /* .rmsnorm = */ td_cuda_op_rmsnorm,
    /* .matmul = */ td_cuda_op_matmul,
    /* .matmuls = */ td_cuda_op_matmuls,
    /* .rope_kv_write = */ td_cuda_op_rope_kv_write,
    /* .attn_prefill = */ td_cuda_op_attn_prefill,
    /* .attn_decode = */ td_cuda_op_attn_decode,
    /* .swiglu = */ td_cuda_op_swiglu,
    /* .gather_rows = */ td_cuda_op_gather_rows,
    /* .moe_combine = */ td_cuda_op_moe_combine,
    /* .copy_blocks = */ td_cuda_op_copy_blocks,
    /* .weight_pack = */ NULL, /* weights stay as uploaded: no repacked layouts on the GPU yet */
};

/* ---- creation ------------------------------------------------------------------------------ */

/*
 * Creates a CUDA backend on cfg->device with activations in cfg->act_dtype.
 * Errors: TD_ERR_UNSUPPORTED, not logged (callers probe), when no device is usable (no
 * driver, no GPU, bad index, older than sm_80),
 * TD_ERR_NOMEM / TD_ERR_CUDA when the stream, handles or workspace cannot be made.
 */
extern "C" td_status_t td_cuda_backend_create(const td_cuda_config_t *cfg, td_backend_t **be_p)
{
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || n_dev == 0) {
        (void)cudaGetLastError();
        /* quiet: callers probe for a GPU; td_backend_open logs it */
        return td_errorf_quiet(TD_ERR_UNSUPPORTED, "cuda: no usable CUDA device (%s): run on a machine "
                         "with an NVIDIA GPU and driver, or use --device cpu",
                         e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    int dev = cfg ? cfg->device : 0;
    td_dtype_t act = cfg ? cfg->act_dtype : TD_BF16;
    if (dev < 0 || dev >= n_dev)
        return td_errorf_quiet(TD_ERR_UNSUPPORTED, "cuda: device %d does not exist (%d device%s present)",
                         dev, n_dev, n_dev == 1 ? "" : "s");
    if (act != TD_F32 && act != TD_F16 && act != TD_BF16)
        return td_errorf(TD_ERR_INVALID, "cuda: unknown activation dtype %d", (int)act);

    td_status_t st = TD_OK;
    cublasStatus_t cs;
    cudaDeviceProp prop;
    td_cuda_backend_t *c = (td_cuda_backend_t *)calloc(1, sizeof(*c));
    if (!c)
        return td_errorf(TD_ERR_NOMEM, "cuda: cannot allocate the backend context");
    c->device = dev;
    if ((e = cudaSetDevice(dev)) != cudaSuccess || (e = cudaGetDeviceProperties(&prop, dev)) != cudaSuccess) {
        st = td_cuda_error(e, "cudaSetDevice", __FILE__, __LINE__);
        goto err_ctx;
    }
    if (prop.major < 8) {
        st = td_errorf_quiet(TD_ERR_UNSUPPORTED, "cuda: device %d (%s) is sm_%d%d; tandem needs sm_80 or "
                       "newer (Ampere, Hopper)", dev, prop.name, prop.major, prop.minor);
        goto err_ctx;
    }
    c->n_sms = prop.multiProcessorCount;
    c->smem_optin = prop.sharedMemPerBlockOptin;
    if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&c->meta_done, cudaEventDisableTiming)) != cudaSuccess) {
        st = td_cuda_error(e, "cudaStreamCreate", __FILE__, __LINE__);
        goto err_ctx;
    }
    if ((e = cudaStreamCreateWithFlags(&c->xfer_stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&c->xfer_order, cudaEventDisableTiming)) != cudaSuccess) {
        st = td_cuda_error(e, "cudaStreamCreate (data-plane copies)", __FILE__, __LINE__);
        goto err_ctx;
    }
    for (int i = 0; i < TD_CUDA_XFER_SLOTS; i++)
        if ((e = cudaEventCreateWithFlags(&c->xfer_done[i], cudaEventDisableTiming)) != cudaSuccess ||
            (e = cudaEventCreateWithFlags(&c->xfer_woken[i], cudaEventDisableTiming)) != cudaSuccess) {
            st = td_cuda_error(e, "cudaEventCreate (data-plane copies)", __FILE__, __LINE__);
            goto err_ctx;
        }
    if ((cs = cublasCreate(&c->cublas)) != CUBLAS_STATUS_SUCCESS) {
        st = td_errorf(cs == CUBLAS_STATUS_ALLOC_FAILED ? TD_ERR_NOMEM : TD_ERR_CUDA,
                       "cuda: cublasCreate failed: %s", cublasGetStatusString(cs));
        goto err_ctx;
    }
    c->cublas_ws_bytes = 32u << 20;
    if ((e = cudaMalloc(&c->cublas_ws, c->cublas_ws_bytes)) != cudaSuccess) {
        st = td_cuda_error(e, "cudaMalloc (cuBLAS workspace)", __FILE__, __LINE__);
        goto err_ctx;
    }
    if ((cs = cublasSetStream(c->cublas, c->stream)) != CUBLAS_STATUS_SUCCESS ||
        (cs = cublasSetWorkspace(c->cublas, c->cublas_ws, c->cublas_ws_bytes)) != CUBLAS_STATUS_SUCCESS ||
        (cs = cublasSetMathMode(c->cublas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS) {
        st = td_errorf(TD_ERR_CUDA, "cuda: cuBLAS setup failed: %s", cublasGetStatusString(cs));
        goto err_ctx;
    }

    c->base.ops = &td_cuda_ops;
    c->base.act_dtype = act;
    /* weights in the activations' dtype or f32 are one cuBLAS call. Under f32 activations
       16-bit weights are taken too: each matmul widens them in scratch (exact, the CPU's
       numbers: bf16 weights beside f32 activations, as the CPU computes them); the CLI and
       nodes never ask for that (their activations follow the weights' dtype). Under 16-bit
       activations the engine converts other weight dtypes once rather than widen per call. */
    c->base.weight_dtypes = act == TD_F32 ? (1u << TD_F32) | (1u << TD_F16) | (1u << TD_BF16)
                                          : (1u << act) | (1u << TD_F32);
    c->base.kv_dtypes = (1u << TD_F32) | (1u << TD_F16) | (1u << TD_BF16);
    c->base.host_memory = false;
    td_info("cuda: device %d %s sm_%d%d, %d SMs, %.1f GiB, act %s", dev, prop.name, prop.major,
            prop.minor, c->n_sms, prop.totalGlobalMem / 1073741824.0, td_dtype_name(act));
    *be_p = &c->base;
    return TD_OK;

err_ctx:
    td_cuda_destroy(&c->base);
    return st;
}
