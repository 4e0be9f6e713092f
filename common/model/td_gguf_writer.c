/*
 * td_gguf_writer: the GGUF v3 writer (td_gguf_writer.h). Metadata and the tensor table are
 * built in memory (their counts go first in the header); the data streams to the file.
 */
#include "td_gguf_writer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_gguf.h"
#include "td_quant.h"
#include "td_util.h"

#define WRITER_ALIGN TD_GGUF_DEFAULT_ALIGNMENT

typedef struct wbuf {
    unsigned char *p;
    size_t len, cap;
    bool oom;
} wbuf_t;

struct td_gguf_writer {
    char *path;
    FILE *f;
    wbuf_t kv, info;
    uint64_t n_kv, n_tensors;
    uint64_t *sizes;        /* [n_tensors] bytes of each tensor */
    uint64_t data_bytes;    /* offset of the next tensor in the data section */
    bool begun, finished;
    uint64_t cur;           /* tensor being written */
    uint64_t cur_done;      /* bytes of it written */
};

static void wb_put(wbuf_t *b, const void *src, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n > b->cap) {
        size_t cap = (b->len + n) * 2 + 256;
        unsigned char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void wb_le(wbuf_t *b, uint64_t v, size_t n)
{
    unsigned char c[8];
    for (size_t i = 0; i < n; i++)
        c[i] = (unsigned char)(v >> (8 * i));
    wb_put(b, c, n);
}

static void wb_str(wbuf_t *b, const char *s)
{
    wb_le(b, strlen(s), 8);
    wb_put(b, s, strlen(s));
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

td_status_t td_gguf_writer_create(const char *path, td_gguf_writer_t **w_p)
{
    td_gguf_writer_t *w = calloc(1, sizeof *w);
    if (!w || !(w->path = strdup(path))) {
        free(w);
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
    }
    if (!(w->f = fopen(path, "wb"))) {
        td_status_t s = td_errorf(TD_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
        free(w->path);
        free(w);
        return s;
    }
    *w_p = w;
    return TD_OK;
}

void td_gguf_writer_destroy(td_gguf_writer_t *w)
{
    if (!w)
        return;
    if (w->f)
        fclose(w->f);
    if (!w->finished)
        unlink(w->path);
    free(w->kv.p);
    free(w->info.p);
    free(w->sizes);
    free(w->path);
    free(w);
}

/* Starts a metadata entry: key and value type. */
static td_status_t kv_begin(td_gguf_writer_t *w, const char *key, td_gguf_type_t type)
{
    if (w->begun)
        return td_errorf(TD_ERR_INVALID, "%s: metadata %s added after the tensor data began", w->path, key);
    wb_str(&w->kv, key);
    wb_le(&w->kv, type, 4);
    w->n_kv++;
    return TD_OK;
}

static td_status_t kv_end(td_gguf_writer_t *w)
{
    return w->kv.oom ? td_errorf(TD_ERR_NOMEM, "%s: out of memory for metadata", w->path) : TD_OK;
}

td_status_t td_gguf_writer_u32(td_gguf_writer_t *w, const char *key, uint32_t v)
{
    td_status_t s = kv_begin(w, key, TD_GGUF_U32);
    if (s != TD_OK)
        return s;
    wb_le(&w->kv, v, 4);
    return kv_end(w);
}

td_status_t td_gguf_writer_i32(td_gguf_writer_t *w, const char *key, int32_t v)
{
    td_status_t s = kv_begin(w, key, TD_GGUF_I32);
    if (s != TD_OK)
        return s;
    wb_le(&w->kv, (uint32_t)v, 4);
    return kv_end(w);
}

td_status_t td_gguf_writer_f32(td_gguf_writer_t *w, const char *key, float v)
{
    td_status_t s = kv_begin(w, key, TD_GGUF_F32);
    if (s != TD_OK)
        return s;
    wb_le(&w->kv, f32_bits(v), 4);
    return kv_end(w);
}

td_status_t td_gguf_writer_bool(td_gguf_writer_t *w, const char *key, bool v)
{
    td_status_t s = kv_begin(w, key, TD_GGUF_BOOL);
    if (s != TD_OK)
        return s;
    wb_le(&w->kv, v ? 1 : 0, 1);
    return kv_end(w);
}

td_status_t td_gguf_writer_str(td_gguf_writer_t *w, const char *key, const char *v)
{
    td_status_t s = kv_begin(w, key, TD_GGUF_STRING);
    if (s != TD_OK)
        return s;
    wb_str(&w->kv, v);
    return kv_end(w);
}

static td_status_t arr_begin(td_gguf_writer_t *w, const char *key, td_gguf_type_t elem, size_t n)
{
    td_status_t s = kv_begin(w, key, TD_GGUF_ARRAY);
    if (s != TD_OK)
        return s;
    wb_le(&w->kv, elem, 4);
    wb_le(&w->kv, n, 8);
    return TD_OK;
}

td_status_t td_gguf_writer_arr_str(td_gguf_writer_t *w, const char *key, const char *const *v, size_t n)
{
    td_status_t s = arr_begin(w, key, TD_GGUF_STRING, n);
    for (size_t i = 0; s == TD_OK && i < n; i++)
        wb_str(&w->kv, v[i]);
    return s != TD_OK ? s : kv_end(w);
}

td_status_t td_gguf_writer_arr_i32(td_gguf_writer_t *w, const char *key, const int32_t *v, size_t n)
{
    td_status_t s = arr_begin(w, key, TD_GGUF_I32, n);
    for (size_t i = 0; s == TD_OK && i < n; i++)
        wb_le(&w->kv, (uint32_t)v[i], 4);
    return s != TD_OK ? s : kv_end(w);
}

td_status_t td_gguf_writer_arr_f32(td_gguf_writer_t *w, const char *key, const float *v, size_t n)
{
    td_status_t s = arr_begin(w, key, TD_GGUF_F32, n);
    for (size_t i = 0; s == TD_OK && i < n; i++)
        wb_le(&w->kv, f32_bits(v[i]), 4);
    return s != TD_OK ? s : kv_end(w);
}

td_status_t td_gguf_writer_tensor(td_gguf_writer_t *w, const char *name, int n_dims, const int64_t *ne,
                                  uint32_t ggml_type)
{
    if (w->begun)
        return td_errorf(TD_ERR_INVALID, "%s: tensor %s added after the tensor data began", w->path, name);
    const td_ggml_type_t *gt = td_ggml_type(ggml_type);
    if (!gt || !gt->block_elems)
        return td_errorf(TD_ERR_INVALID, "%s: tensor %s: ggml type %u has no known layout", w->path, name,
                         ggml_type);
    if (n_dims < 1 || n_dims > TD_GGUF_MAX_DIMS)
        return td_errorf(TD_ERR_INVALID, "%s: tensor %s: %d dimensions (1 to 4)", w->path, name, n_dims);
    size_t elems = 1;
    for (int i = 0; i < n_dims; i++)
        if (ne[i] <= 0 || !td_mul_size(elems, (size_t)ne[i], &elems))
            return td_errorf(TD_ERR_INVALID, "%s: tensor %s: bad size ne[%d] = %lld", w->path, name, i,
                             (long long)ne[i]);
    if (ne[0] % (int64_t)gt->block_elems)
        return td_errorf(TD_ERR_INVALID, "%s: tensor %s: rows of %lld weights are not whole %s blocks of %zu",
                         w->path, name, (long long)ne[0], gt->name, gt->block_elems);
    uint64_t bytes = (uint64_t)(elems / gt->block_elems) * gt->block_bytes;
    uint64_t *sizes = realloc(w->sizes, (w->n_tensors + 1) * sizeof *sizes);
    if (!sizes)
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", w->path);
    w->sizes = sizes;
    w->sizes[w->n_tensors++] = bytes;
    wb_str(&w->info, name);
    wb_le(&w->info, (uint32_t)n_dims, 4);
    for (int i = 0; i < n_dims; i++)
        wb_le(&w->info, (uint64_t)ne[i], 8);
    wb_le(&w->info, ggml_type, 4);
    wb_le(&w->info, w->data_bytes, 8);
    w->data_bytes += (bytes + WRITER_ALIGN - 1) / WRITER_ALIGN * WRITER_ALIGN;
    return w->info.oom ? td_errorf(TD_ERR_NOMEM, "%s: out of memory", w->path) : TD_OK;
}

static td_status_t put_file(td_gguf_writer_t *w, const void *p, size_t n)
{
    if (n && fwrite(p, 1, n, w->f) != n)
        return td_errorf(TD_ERR_IO, "%s: write failed: %s", w->path, strerror(errno));
    return TD_OK;
}

static td_status_t put_zeros(td_gguf_writer_t *w, size_t n)
{
    static const unsigned char zeros[WRITER_ALIGN];
    return put_file(w, zeros, n);
}

td_status_t td_gguf_writer_begin(td_gguf_writer_t *w)
{
    TD_ASSERT(!w->begun);
    wbuf_t h = {0};
    wb_put(&h, "GGUF", 4);
    wb_le(&h, 3, 4);
    wb_le(&h, w->n_tensors, 8);
    wb_le(&h, w->n_kv, 8);
    if (h.oom)
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", w->path);
    td_status_t s = put_file(w, h.p, h.len);
    free(h.p);
    if (s == TD_OK)
        s = put_file(w, w->kv.p, w->kv.len);
    if (s == TD_OK)
        s = put_file(w, w->info.p, w->info.len);
    size_t head = 24 + w->kv.len + w->info.len;
    if (s == TD_OK)
        s = put_zeros(w, (WRITER_ALIGN - head % WRITER_ALIGN) % WRITER_ALIGN);
    w->begun = true;
    return s;
}

td_status_t td_gguf_writer_write(td_gguf_writer_t *w, const void *data, size_t n)
{
    TD_ASSERT(w->begun && !w->finished);
    const unsigned char *p = data;
    while (n) {
        if (w->cur >= w->n_tensors)
            return td_errorf(TD_ERR_INVALID, "%s: %zu bytes of data beyond the last tensor", w->path, n);
        size_t take = (size_t)TD_MIN((uint64_t)n, w->sizes[w->cur] - w->cur_done);
        td_status_t s = put_file(w, p, take);
        if (s != TD_OK)
            return s;
        p += take;
        n -= take;
        w->cur_done += take;
        if (w->cur_done == w->sizes[w->cur]) {
            if ((s = put_zeros(w, (WRITER_ALIGN - w->cur_done % WRITER_ALIGN) % WRITER_ALIGN)) != TD_OK)
                return s;
            w->cur++;
            w->cur_done = 0;
        }
    }
    return TD_OK;
}

td_status_t td_gguf_writer_finish(td_gguf_writer_t *w)
{
    TD_ASSERT(w->begun && !w->finished);
    if (w->cur != w->n_tensors)
        return td_errorf(TD_ERR_INVALID, "%s: tensor %llu of %llu is missing its data", w->path,
                         (unsigned long long)w->cur, (unsigned long long)w->n_tensors);
    int rc = fclose(w->f);
    w->f = NULL;
    if (rc != 0)
        return td_errorf(TD_ERR_IO, "%s: write failed: %s", w->path, strerror(errno));
    w->finished = true;
    return TD_OK;
}
