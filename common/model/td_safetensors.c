/*
 * td_safetensors: a validating reader over a read-only map, and a streaming writer.
 *
 * The reader trusts nothing in the header: a file is a list of claims (where each tensor
 * is, how big it is) and every claim is checked against the file size and against the
 * other claims before a pointer into the map is handed out.
 */
#include "td_safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_util.h"

#define ST_MAX_HEADER (100u << 20) /* the format's own limit */

struct td_safetensors {
    char *path;
    td_mmap_t map;
    td_st_tensor_t *tensors;
    size_t n_tensors;
};

typedef struct st_dtype_info {
    const char *name;
    size_t size;      /* bytes per element; 0 for sub-byte (not supported here) */
    int td;           /* td_dtype_t, or -1 */
} st_dtype_info_t;

static const st_dtype_info_t st_dtypes[] = {
    {"F32", 4, TD_F32},  {"F16", 2, TD_F16},  {"BF16", 2, TD_BF16}, {"F64", 8, -1},
    {"I64", 8, -1},      {"U64", 8, -1},      {"I32", 4, -1},       {"U32", 4, -1},
    {"I16", 2, -1},      {"U16", 2, -1},      {"I8", 1, -1},        {"U8", 1, -1},
    {"BOOL", 1, -1},     {"F8_E4M3", 1, -1},  {"F8_E5M2", 1, -1},   {"F8_E8M0", 1, -1},
};

const char *td_st_dtype_name(td_dtype_t t)
{
    switch (t) {
    case TD_F32: return "F32";
    case TD_F16: return "F16";
    case TD_BF16: return "BF16";
    default: break; /* safetensors holds no block types */
    }
    return "?";
}

/* A JSON number that is a non-negative integer no larger than 2^53 (exact in a double). */
static bool json_uint(const cJSON *j, uint64_t *out)
{
    if (!cJSON_IsNumber(j))
        return false;
    double d = j->valuedouble;
    if (!(d >= 0.0) || d > 9007199254740992.0 || floor(d) != d)
        return false;
    *out = (uint64_t)d;
    return true;
}

static int cmp_by_offset(const void *a, const void *b)
{
    const td_st_tensor_t *x = *(const td_st_tensor_t *const *)a;
    const td_st_tensor_t *y = *(const td_st_tensor_t *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset ? 1 : 0;
}

/* Parses one header entry into t (name already set). */
static td_status_t parse_entry(const char *path, const cJSON *e, size_t data_start, size_t data_len,
                               td_st_tensor_t *t)
{
    if (!cJSON_IsObject(e))
        return td_errorf(TD_ERR_FORMAT, "%s: header entry %s is not an object", path, t->name);
    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(jd) || !cJSON_IsArray(js) || !cJSON_IsArray(jo))
        return td_errorf(TD_ERR_FORMAT, "%s: tensor %s needs dtype (string), shape and data_offsets (arrays)",
                         path, t->name);
    const st_dtype_info_t *info = NULL;
    for (size_t i = 0; i < TD_ARRAY_LEN(st_dtypes); i++)
        if (!strcmp(jd->valuestring, st_dtypes[i].name))
            info = &st_dtypes[i];
    if (!info)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: tensor %s has unknown dtype %.16s", path, t->name,
                         jd->valuestring);
    snprintf(t->dtype_name, sizeof t->dtype_name, "%s", info->name);
    t->supported = info->td >= 0;
    t->dtype = info->td >= 0 ? (td_dtype_t)info->td : TD_F32;

    int nd = cJSON_GetArraySize(js);
    if (nd > TD_ST_MAX_DIMS)
        return td_errorf(TD_ERR_FORMAT, "%s: tensor %s has %d dimensions (at most %d)", path, t->name, nd,
                         TD_ST_MAX_DIMS);
    t->n_dims = nd;
    size_t nelem = 1;
    for (int i = 0; i < nd; i++) {
        uint64_t d;
        if (!json_uint(cJSON_GetArrayItem(js, i), &d) || !td_mul_size(nelem, (size_t)d, &nelem))
            return td_errorf(TD_ERR_FORMAT, "%s: tensor %s has a bad shape", path, t->name);
        t->shape[i] = (int64_t)d;
    }
    uint64_t b, en;
    if (cJSON_GetArraySize(jo) != 2 || !json_uint(cJSON_GetArrayItem(jo, 0), &b) ||
        !json_uint(cJSON_GetArrayItem(jo, 1), &en) || en < b)
        return td_errorf(TD_ERR_FORMAT, "%s: tensor %s has bad data_offsets", path, t->name);
    if (en > data_len)
        return td_errorf(TD_ERR_FORMAT,
                         "%s: tensor %s data_offsets [%llu, %llu] run past the end of the data (%zu bytes): "
                         "truncated or corrupt file",
                         path, t->name, (unsigned long long)b, (unsigned long long)en, data_len);
    size_t want;
    if (!td_mul_size(nelem, info->size, &want) || want != en - b)
        return td_errorf(TD_ERR_FORMAT, "%s: tensor %s holds %llu bytes, its dtype %s and shape need %zu",
                         path, t->name, (unsigned long long)(en - b), info->name, want);
    t->offset = data_start + (size_t)b;
    t->nbytes = (size_t)(en - b);
    return TD_OK;
}

static void st_free(td_safetensors_t *st)
{
    for (size_t i = 0; i < st->n_tensors; i++)
        free(st->tensors[i].name);
    free(st->tensors);
    td_mmap_free(&st->map);
    free(st->path);
    free(st);
}

td_status_t td_safetensors_open(const char *path, td_safetensors_t **st_p)
{
    td_status_t s;
    td_safetensors_t *st = calloc(1, sizeof *st);
    if (!st)
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
    st->path = strdup(path);
    if (!st->path) {
        free(st);
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
    }
    s = td_mmap_init(&st->map, path);
    if (s != TD_OK)
        goto err_st;
    const unsigned char *base = st->map.data;
    size_t size = st->map.size;
    if (size < 8) {
        s = td_errorf(TD_ERR_FORMAT, "%s: truncated: %zu bytes, not even the 8-byte header length", path, size);
        goto err_st;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | base[i];
    if (hlen > size - 8) {
        s = td_errorf(TD_ERR_FORMAT, "%s: header length %llu runs beyond the file (%zu bytes): truncated or not safetensors",
                      path, (unsigned long long)hlen, size);
        goto err_st;
    }
    if (hlen > ST_MAX_HEADER || hlen < 2) {
        s = td_errorf(TD_ERR_FORMAT, "%s: header length %llu is not plausible", path, (unsigned long long)hlen);
        goto err_st;
    }
    char *text = malloc((size_t)hlen + 1);
    if (!text) {
        s = td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
        goto err_st;
    }
    memcpy(text, base + 8, (size_t)hlen);
    text[hlen] = '\0';
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!cJSON_IsObject(root)) {
        s = td_errorf(TD_ERR_FORMAT, "%s: header is not a JSON object", path);
        goto err_json;
    }
    size_t data_start = 8 + (size_t)hlen, data_len = size - data_start;
    size_t n = 0;
    for (const cJSON *e = root->child; e; e = e->next)
        n++;
    st->tensors = calloc(n ? n : 1, sizeof *st->tensors);
    if (!st->tensors) {
        s = td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
        goto err_json;
    }
    for (const cJSON *e = root->child; e; e = e->next) {
        if (!strcmp(e->string, "__metadata__")) {
            if (!cJSON_IsObject(e)) {
                s = td_errorf(TD_ERR_FORMAT, "%s: __metadata__ is not an object", path);
                goto err_json;
            }
            continue;
        }
        td_st_tensor_t *t = &st->tensors[st->n_tensors];
        t->name = strdup(e->string);
        if (!t->name) {
            s = td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
            goto err_json;
        }
        st->n_tensors++;
        s = parse_entry(path, e, data_start, data_len, t);
        if (s != TD_OK)
            goto err_json;
        t->data = base + t->offset;
    }
    cJSON_Delete(root);
    root = NULL;

    /* No two non-empty tensors may share a byte. */
    if (st->n_tensors > 1) {
        const td_st_tensor_t **order = malloc(st->n_tensors * sizeof *order);
        if (!order) {
            s = td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
            goto err_st;
        }
        for (size_t i = 0; i < st->n_tensors; i++)
            order[i] = &st->tensors[i];
        qsort(order, st->n_tensors, sizeof *order, cmp_by_offset);
        const td_st_tensor_t *prev = NULL;
        for (size_t i = 0; i < st->n_tensors; i++) {
            const td_st_tensor_t *t = order[i];
            if (t->nbytes == 0)
                continue;
            if (prev && prev->offset + prev->nbytes > t->offset) {
                s = td_errorf(TD_ERR_FORMAT, "%s: tensors %s and %s overlap: corrupt header", path, prev->name,
                              t->name);
                free(order);
                goto err_st;
            }
            prev = t;
        }
        free(order);
    }
    *st_p = st;
    return TD_OK;

err_json:
    cJSON_Delete(root);
err_st:
    st_free(st);
    return s;
}

void td_safetensors_close(td_safetensors_t *st)
{
    if (st)
        st_free(st);
}

const td_st_tensor_t *td_safetensors_find(const td_safetensors_t *st, const char *name)
{
    for (size_t i = 0; i < st->n_tensors; i++)
        if (!strcmp(st->tensors[i].name, name))
            return &st->tensors[i];
    return NULL;
}

size_t td_safetensors_count(const td_safetensors_t *st)
{
    return st->n_tensors;
}

const td_st_tensor_t *td_safetensors_at(const td_safetensors_t *st, size_t i)
{
    return i < st->n_tensors ? &st->tensors[i] : NULL;
}

const td_mmap_t *td_safetensors_map(const td_safetensors_t *st)
{
    return &st->map;
}

const char *td_safetensors_path(const td_safetensors_t *st)
{
    return st->path;
}

/* ---- writer ------------------------------------------------------------------------ */

typedef enum { W_DECLARING, W_WRITING, W_DONE, W_FAILED } w_state_t;

struct td_st_writer {
    char *path;
    FILE *f;
    cJSON *header;
    cJSON *meta;        /* owned by header once added */
    size_t data_bytes;  /* declared */
    size_t written;     /* data bytes written so far */
    w_state_t state;
    bool created;       /* the file exists because of us */
};

td_status_t td_st_writer_create(const char *path, td_st_writer_t **w_p)
{
    td_st_writer_t *w = calloc(1, sizeof *w);
    if (!w)
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
    w->path = strdup(path);
    w->header = cJSON_CreateObject();
    if (!w->path || !w->header) {
        td_st_writer_destroy(w);
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
    }
    w->f = fopen(path, "wb");
    if (!w->f) {
        int e = errno;
        td_st_writer_destroy(w);
        return td_errorf(TD_ERR_IO, "%s: cannot create: %s", path, strerror(e));
    }
    w->created = true;
    *w_p = w;
    return TD_OK;
}

td_status_t td_st_writer_add(td_st_writer_t *w, const char *name, td_dtype_t dtype, int32_t n_dims,
                             const int64_t *shape)
{
    if (w->state != W_DECLARING || n_dims < 0 || n_dims > TD_ST_MAX_DIMS)
        return td_errorf(TD_ERR_INVALID, "%s: cannot declare tensor %s now", w->path, name);
    if (cJSON_GetObjectItemCaseSensitive(w->header, name))
        return td_errorf(TD_ERR_INVALID, "%s: tensor %s declared twice", w->path, name);
    size_t nbytes = td_dtype_size(dtype), end;
    for (int i = 0; i < n_dims; i++)
        if (shape[i] < 0 || !td_mul_size(nbytes, (size_t)shape[i], &nbytes))
            return td_errorf(TD_ERR_INVALID, "%s: tensor %s has a bad shape", w->path, name);
    if (!td_add_size(w->data_bytes, nbytes, &end))
        return td_errorf(TD_ERR_INVALID, "%s: tensor %s: file too large", w->path, name);
    cJSON *e = cJSON_CreateObject();
    cJSON *sh = cJSON_CreateArray();
    cJSON *off = cJSON_CreateArray();
    bool ok = e && sh && off;
    for (int i = 0; ok && i < n_dims; i++)
        ok = cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)shape[i]));
    ok = ok && cJSON_AddItemToArray(off, cJSON_CreateNumber((double)w->data_bytes)) &&
         cJSON_AddItemToArray(off, cJSON_CreateNumber((double)end)) &&
         cJSON_AddStringToObject(e, "dtype", td_st_dtype_name(dtype));
    if (ok) {
        cJSON_AddItemToObject(e, "shape", sh);
        sh = NULL;
        cJSON_AddItemToObject(e, "data_offsets", off);
        off = NULL;
        ok = cJSON_AddItemToObject(w->header, name, e);
    }
    if (!ok) {
        cJSON_Delete(sh);
        cJSON_Delete(off);
        cJSON_Delete(e);
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", w->path);
    }
    w->data_bytes = end;
    return TD_OK;
}

td_status_t td_st_writer_meta(td_st_writer_t *w, const char *key, const char *value)
{
    if (w->state != W_DECLARING)
        return td_errorf(TD_ERR_INVALID, "%s: metadata after the header was written", w->path);
    if (!w->meta) {
        w->meta = cJSON_CreateObject();
        if (!w->meta || !cJSON_AddItemToObject(w->header, "__metadata__", w->meta)) {
            cJSON_Delete(w->meta);
            w->meta = NULL;
            return td_errorf(TD_ERR_NOMEM, "%s: out of memory", w->path);
        }
    }
    if (!cJSON_AddStringToObject(w->meta, key, value))
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", w->path);
    return TD_OK;
}

td_status_t td_st_writer_begin(td_st_writer_t *w)
{
    if (w->state != W_DECLARING)
        return td_errorf(TD_ERR_INVALID, "%s: header already written", w->path);
    char *text = cJSON_PrintUnformatted(w->header);
    if (!text) {
        w->state = W_FAILED;
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", w->path);
    }
    /* Pad with spaces so the data starts 8-byte aligned, as the reference writer does:
     * every F32 tensor then maps aligned. */
    size_t len = strlen(text), padded = (len + 7) & ~(size_t)7;
    unsigned char lenb[8];
    for (int i = 0; i < 8; i++)
        lenb[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    bool ok = fwrite(lenb, 1, 8, w->f) == 8 && fwrite(text, 1, len, w->f) == len;
    for (size_t i = len; ok && i < padded; i++)
        ok = fputc(' ', w->f) != EOF;
    free(text);
    if (!ok) {
        w->state = W_FAILED;
        return td_errorf(TD_ERR_IO, "%s: write failed: %s", w->path, strerror(errno));
    }
    w->state = W_WRITING;
    return TD_OK;
}

td_status_t td_st_writer_write(td_st_writer_t *w, const void *bytes, size_t n)
{
    if (w->state != W_WRITING || n > w->data_bytes - w->written) {
        w->state = W_FAILED;
        return td_errorf(TD_ERR_INVALID, "%s: tensor data written out of order or beyond what was declared",
                         w->path);
    }
    if (n && fwrite(bytes, 1, n, w->f) != n) {
        w->state = W_FAILED;
        return td_errorf(TD_ERR_IO, "%s: write failed: %s", w->path, strerror(errno));
    }
    w->written += n;
    return TD_OK;
}

td_status_t td_st_writer_finish(td_st_writer_t *w)
{
    if (w->state != W_WRITING || w->written != w->data_bytes) {
        w->state = W_FAILED;
        return td_errorf(TD_ERR_INVALID, "%s: %zu of %zu declared data bytes written", w->path, w->written,
                         w->data_bytes);
    }
    int rc = fclose(w->f);
    w->f = NULL;
    if (rc != 0) {
        w->state = W_FAILED;
        return td_errorf(TD_ERR_IO, "%s: write failed: %s", w->path, strerror(errno));
    }
    w->state = W_DONE;
    return TD_OK;
}

size_t td_st_writer_data_bytes(const td_st_writer_t *w)
{
    return w->data_bytes;
}

void td_st_writer_destroy(td_st_writer_t *w)
{
    if (!w)
        return;
    if (w->f)
        fclose(w->f);
    if (w->created && w->state != W_DONE)
        unlink(w->path);
    cJSON_Delete(w->header);
    free(w->path);
    free(w);
}
