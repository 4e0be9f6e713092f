/*
 * td_gguf: the GGUF reader. A cursor walks the header with one bounds check per read;
 * every error names the file, what was being read and where, so a bad file is a message
 * a user can act on ("truncated", "count beyond the file"), never a crash. Keys and tensor
 * names go into a td_hash each (FNV-1a of the name -> index) for uniqueness and lookup.
 */
#include "td_gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_hash.h"

#define GGUF_MAGIC "GGUF"
#define GGUF_MAX_KEY 65535u            /* the format's own limit on a key */
#define GGUF_MAX_NAME 1024u            /* ggml's is 64; room for other writers */
#define GGUF_MAX_ALIGNMENT (1u << 24)

struct td_gguf {
    char *path;
    td_mmap_t map;
    uint32_t version;
    size_t alignment;
    size_t data_offset;      /* file offset of the data section */
    td_gguf_kv_t *kvs;
    size_t n_kvs;
    td_gguf_tensor_t *tensors;
    size_t n_tensors;
    td_hash_t kv_index;      /* fnv1a(key) -> index into kvs */
    td_hash_t tensor_index;  /* fnv1a(name) -> index into tensors */
};


/* Bytes of one scalar of a fixed-size value type; 0 for string and array. */
static size_t scalar_size(uint32_t t)
{
    switch (t) {
    case TD_GGUF_U8: case TD_GGUF_I8: case TD_GGUF_BOOL: return 1;
    case TD_GGUF_U16: case TD_GGUF_I16: return 2;
    case TD_GGUF_U32: case TD_GGUF_I32: case TD_GGUF_F32: return 4;
    case TD_GGUF_U64: case TD_GGUF_I64: case TD_GGUF_F64: return 8;
    }
    return 0;
}

const char *td_gguf_type_name(td_gguf_type_t t)
{
    static const char *const names[] = {"u8",  "i8",   "u16",    "i16",   "u32", "i32", "f32",
                                        "bool", "string", "array", "u64", "i64", "f64"};
    return (unsigned)t < TD_ARRAY_LEN(names) ? names[t] : "?";
}

static bool is_int_type(td_gguf_type_t t)
{
    return t == TD_GGUF_U8 || t == TD_GGUF_I8 || t == TD_GGUF_U16 || t == TD_GGUF_I16 || t == TD_GGUF_U32 ||
           t == TD_GGUF_I32 || t == TD_GGUF_U64 || t == TD_GGUF_I64;
}

static bool is_signed_type(td_gguf_type_t t)
{
    return t == TD_GGUF_I8 || t == TD_GGUF_I16 || t == TD_GGUF_I32 || t == TD_GGUF_I64;
}

/* Little-endian loads from unaligned bytes. */
static uint64_t load_le(const unsigned char *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* A scalar of type t at p, widened as td_gguf_kv_t.v holds it. */
static void load_scalar(td_gguf_kv_t *kv, uint32_t t, const unsigned char *p)
{
    uint64_t raw = load_le(p, scalar_size(t));
    switch (t) {
    case TD_GGUF_I8: kv->v.i64 = (int8_t)raw; break;
    case TD_GGUF_I16: kv->v.i64 = (int16_t)raw; break;
    case TD_GGUF_I32: kv->v.i64 = (int32_t)raw; break;
    case TD_GGUF_I64: kv->v.i64 = (int64_t)raw; break;
    case TD_GGUF_F32: {
        uint32_t b = (uint32_t)raw;
        float f;
        memcpy(&f, &b, 4);
        kv->v.f64 = f;
        break;
    }
    case TD_GGUF_F64: memcpy(&kv->v.f64, &raw, 8); break;
    default: kv->v.u64 = raw; break;
    }
}

/* ---- the cursor ---------------------------------------------------------------------- */

typedef struct rd {
    const char *path;
    const unsigned char *base;
    size_t size;
    size_t pos;
    char ctx[160];   /* what is being read: "kv 3 (general.name)", "tensor 7 (blk.0.attn_q.weight)" */
} rd_t;

static td_status_t truncated(const rd_t *r, const char *field, size_t need)
{
    return td_errorf(TD_ERR_FORMAT,
                     "%s: %s%s%s at byte %zu needs %zu bytes, the file ends at byte %zu: truncated or corrupt file",
                     r->path, r->ctx, r->ctx[0] ? ": " : "", field, r->pos, need, r->size);
}

/* The next n bytes, or a truncation error naming field. */
static td_status_t rd_take(rd_t *r, size_t n, const char *field, const unsigned char **p_p)
{
    if (n > r->size - r->pos)
        return truncated(r, field, n);
    *p_p = r->base + r->pos;
    r->pos += n;
    return TD_OK;
}

static td_status_t rd_u32(rd_t *r, const char *field, uint32_t *out)
{
    const unsigned char *p = NULL;
    td_status_t s = rd_take(r, 4, field, &p);
    if (s == TD_OK)
        *out = (uint32_t)load_le(p, 4);
    return s;
}

static td_status_t rd_u64(rd_t *r, const char *field, uint64_t *out)
{
    const unsigned char *p = NULL;
    td_status_t s = rd_take(r, 8, field, &p);
    if (s == TD_OK)
        *out = load_le(p, 8);
    return s;
}

/* A string of at most max bytes (bounded by the file before anything else). */
static td_status_t rd_str(rd_t *r, const char *field, uint64_t max, td_gguf_str_t *out)
{
    size_t at = r->pos;
    uint64_t len = 0;
    td_status_t s = rd_u64(r, field, &len);
    if (s != TD_OK)
        return s;
    if (len > r->size - r->pos)
        return td_errorf(TD_ERR_FORMAT,
                         "%s: %s%s%s at byte %zu has length %llu, past the end of the file (%zu bytes left): "
                         "truncated or corrupt file",
                         r->path, r->ctx, r->ctx[0] ? ": " : "", field, at, (unsigned long long)len,
                         r->size - r->pos);
    if (len > max)
        return td_errorf(TD_ERR_FORMAT, "%s: %s%s%s at byte %zu has length %llu, more than the %llu allowed",
                         r->path, r->ctx, r->ctx[0] ? ": " : "", field, at, (unsigned long long)len,
                         (unsigned long long)max);
    out->data = (const char *)r->base + r->pos;
    out->len = (size_t)len;
    r->pos += (size_t)len;
    return TD_OK;
}

static char *str_dup(td_gguf_str_t s)
{
    char *c = malloc(s.len + 1);
    if (c) {
        memcpy(c, s.data, s.len);
        c[s.len] = '\0';
    }
    return c;
}

/* A count of items each at least min_bytes long: no more than what the rest of the file
 * could hold, so a hostile count fails here instead of in an allocation. */
static td_status_t check_count(const rd_t *r, const char *field, size_t at, uint64_t n, size_t min_bytes)
{
    if (n > (r->size - r->pos) / min_bytes)
        return td_errorf(TD_ERR_FORMAT,
                         "%s: %s%s%s at byte %zu is %llu, more than the %zu bytes left in the file can hold: "
                         "truncated or corrupt file",
                         r->path, r->ctx, r->ctx[0] ? ": " : "", field, at, (unsigned long long)n,
                         r->size - r->pos);
    return TD_OK;
}

/* ---- metadata ------------------------------------------------------------------------ */

static td_status_t rd_value_type(rd_t *r, const char *field, bool in_array, uint32_t *t_p)
{
    size_t at = r->pos;
    uint32_t t = 0;
    td_status_t s = rd_u32(r, field, &t);
    if (s != TD_OK)
        return s;
    if (t > TD_GGUF_F64)
        return td_errorf(TD_ERR_FORMAT, "%s: %s: %s at byte %zu is %u, not a GGUF value type (0..12)", r->path,
                         r->ctx, field, at, t);
    if (in_array && t == TD_GGUF_ARRAY)
        return td_errorf(TD_ERR_FORMAT, "%s: %s: %s at byte %zu is array: nested arrays are not supported",
                         r->path, r->ctx, field, at);
    *t_p = t;
    return TD_OK;
}

static td_status_t check_bool(const rd_t *r, const char *field, size_t at, uint64_t v)
{
    if (v > 1)
        return td_errorf(TD_ERR_FORMAT, "%s: %s: %s at byte %zu is %llu, a bool must be 0 or 1", r->path, r->ctx,
                         field, at, (unsigned long long)v);
    return TD_OK;
}

static td_status_t rd_array(rd_t *r, td_gguf_kv_t *kv)
{
    uint32_t et = 0;
    td_status_t s = rd_value_type(r, "array element type", true, &et);
    if (s != TD_OK)
        return s;
    size_t at = r->pos;
    uint64_t n = 0;
    if ((s = rd_u64(r, "array length", &n)) != TD_OK)
        return s;
    kv->arr_type = (td_gguf_type_t)et;
    if (et == TD_GGUF_STRING) {
        if ((s = check_count(r, "array length", at, n, 8)) != TD_OK)
            return s;
        kv->arr_strs = n ? malloc((size_t)n * sizeof *kv->arr_strs) : NULL;
        if (n && !kv->arr_strs)
            return td_errorf(TD_ERR_NOMEM, "%s: %s: out of memory for %llu strings", r->path, r->ctx,
                             (unsigned long long)n);
        kv->arr_len = (size_t)n;
        for (size_t i = 0; i < kv->arr_len; i++) {
            char field[48];
            snprintf(field, sizeof field, "element %zu", i);
            if ((s = rd_str(r, field, UINT64_MAX, &kv->arr_strs[i])) != TD_OK)
                return s;
        }
        return TD_OK;
    }
    size_t es = scalar_size(et);
    const unsigned char *p = NULL;
    if ((s = check_count(r, "array length", at, n, es)) != TD_OK ||
        (s = rd_take(r, (size_t)n * es, "array elements", &p)) != TD_OK)
        return s;
    kv->arr_len = (size_t)n;
    kv->arr_data = p;
    if (et == TD_GGUF_BOOL)
        for (size_t i = 0; i < kv->arr_len; i++)
            if ((s = check_bool(r, "array element", (size_t)(p - r->base) + i, p[i])) != TD_OK)
                return s;
    return TD_OK;
}

static td_status_t rd_kv(rd_t *r, size_t i, td_gguf_kv_t *kv)
{
    snprintf(r->ctx, sizeof r->ctx, "metadata entry %zu", i);
    kv->offset = r->pos;
    td_gguf_str_t key;
    td_status_t s = rd_str(r, "key", GGUF_MAX_KEY, &key);
    if (s != TD_OK)
        return s;
    if (!(kv->key = str_dup(key)))
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", r->path);
    snprintf(r->ctx, sizeof r->ctx, "metadata entry %zu (%.100s)", i, kv->key);
    uint32_t t = 0;
    if ((s = rd_value_type(r, "value type", false, &t)) != TD_OK)
        return s;
    kv->type = (td_gguf_type_t)t;
    if (t == TD_GGUF_ARRAY)
        return rd_array(r, kv);
    if (t == TD_GGUF_STRING)
        return rd_str(r, "value", UINT64_MAX, &kv->v.str);
    size_t at = r->pos;
    const unsigned char *p = NULL;
    if ((s = rd_take(r, scalar_size(t), "value", &p)) != TD_OK)
        return s;
    load_scalar(kv, t, p);
    return t == TD_GGUF_BOOL ? check_bool(r, "value", at, kv->v.u64) : TD_OK;
}

/* ---- tensor infos -------------------------------------------------------------------- */

static td_status_t rd_tensor_info(rd_t *r, size_t i, td_gguf_tensor_t *t)
{
    snprintf(r->ctx, sizeof r->ctx, "tensor %zu", i);
    td_gguf_str_t name;
    td_status_t s = rd_str(r, "name", GGUF_MAX_NAME, &name);
    if (s != TD_OK)
        return s;
    if (!(t->name = str_dup(name)))
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", r->path);
    snprintf(r->ctx, sizeof r->ctx, "tensor %zu (%.100s)", i, t->name);
    size_t at = r->pos;
    uint32_t nd = 0;
    if ((s = rd_u32(r, "n_dims", &nd)) != TD_OK)
        return s;
    if (nd > TD_GGUF_MAX_DIMS)
        return td_errorf(TD_ERR_FORMAT, "%s: %s: n_dims at byte %zu is %u, at most %d are supported", r->path,
                         r->ctx, at, nd, TD_GGUF_MAX_DIMS);
    t->n_dims = (int32_t)nd;
    size_t nelem = 1;
    for (int d = 0; d < TD_GGUF_MAX_DIMS; d++)
        t->ne[d] = 1;
    for (uint32_t d = 0; d < nd; d++) {
        at = r->pos;
        uint64_t ne = 0;
        if ((s = rd_u64(r, "dimension", &ne)) != TD_OK)
            return s;
        if (ne > INT64_MAX || !td_mul_size(nelem, (size_t)ne, &nelem) || nelem > INT64_MAX)
            return td_errorf(TD_ERR_FORMAT, "%s: %s: dimension %u at byte %zu is %llu: the element count overflows",
                             r->path, r->ctx, d, at, (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
    }
    if ((s = rd_u32(r, "type", &t->type)) != TD_OK)
        return s;
    at = r->pos;
    if ((s = rd_u64(r, "offset", &t->offset)) != TD_OK)
        return s;
    const td_ggml_type_t *gt = td_ggml_type(t->type);
    t->known = gt && gt->block_elems;
    if (!t->known)
        return TD_OK;
    size_t be = gt->block_elems, bb = gt->block_bytes;
    /* nbytes = rows x (row length / block) x block bytes: the row must be whole blocks */
    if (t->ne[0] % (int64_t)be)
        return td_errorf(TD_ERR_FORMAT, "%s: %s: type %s needs rows of a multiple of %zu elements, ne[0] is %lld",
                         r->path, r->ctx, gt->name, be, (long long)t->ne[0]);
    size_t nb = (size_t)t->ne[0] / be * bb;
    for (int d = 1; d < TD_GGUF_MAX_DIMS; d++)
        if (!td_mul_size(nb, (size_t)t->ne[d], &nb))
            return td_errorf(TD_ERR_FORMAT, "%s: %s: its size in bytes overflows", r->path, r->ctx);
    t->nbytes = nb;
    return TD_OK;
}

static int cmp_by_offset(const void *a, const void *b)
{
    const td_gguf_tensor_t *x = *(const td_gguf_tensor_t *const *)a;
    const td_gguf_tensor_t *y = *(const td_gguf_tensor_t *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset ? 1 : 0;
}

/* Places every tensor in the data section: aligned, inside the file, no overlaps. */
static td_status_t place_tensors(td_gguf_t *g)
{
    size_t data_len = g->map.size - g->data_offset;
    size_t n_known = 0;
    for (size_t i = 0; i < g->n_tensors; i++) {
        td_gguf_tensor_t *t = &g->tensors[i];
        if (t->offset % g->alignment)
            return td_errorf(TD_ERR_FORMAT, "%s: tensor %s: offset %llu is not a multiple of the alignment %zu",
                             g->path, t->name, (unsigned long long)t->offset, g->alignment);
        if (t->offset > data_len || t->nbytes > data_len - t->offset)
            return td_errorf(TD_ERR_FORMAT,
                             "%s: tensor %s: bytes [%llu, +%zu) of the data section run past its end (%zu bytes at "
                             "byte %zu): truncated or corrupt file",
                             g->path, t->name, (unsigned long long)t->offset, t->nbytes, data_len,
                             g->data_offset);
        t->file_offset = g->data_offset + (size_t)t->offset;
        if (t->known) {
            t->data = (const unsigned char *)g->map.data + t->file_offset;
            n_known++;
        }
    }
    if (n_known < 2)
        return TD_OK;
    const td_gguf_tensor_t **by = malloc(n_known * sizeof *by);
    if (!by)
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", g->path);
    size_t k = 0;
    for (size_t i = 0; i < g->n_tensors; i++)
        if (g->tensors[i].known)
            by[k++] = &g->tensors[i];
    qsort(by, n_known, sizeof *by, cmp_by_offset);
    td_status_t s = TD_OK;
    for (size_t i = 1; i < n_known && s == TD_OK; i++)
        if (by[i - 1]->offset + by[i - 1]->nbytes > by[i]->offset)
            s = td_errorf(TD_ERR_FORMAT, "%s: tensors %s and %s overlap in the data section", g->path,
                          by[i - 1]->name, by[i]->name);
    free(by);
    return s;
}

/* ---- indexes ------------------------------------------------------------------------- */

static uint64_t name_hash(const char *s)
{
    return td_fnv1a64(TD_FNV1A64_INIT, s, strlen(s));
}

/* Index of the kv with key `key` in g, or SIZE_MAX. */
static size_t kv_lookup(const td_gguf_t *g, const char *key)
{
    for (const td_hash_slot_t *sl = td_hash_find(&g->kv_index, name_hash(key)); sl;
         sl = td_hash_find_next(&g->kv_index, sl))
        if (!strcmp(g->kvs[sl->value].key, key))
            return (size_t)sl->value;
    return SIZE_MAX;
}

static size_t tensor_lookup(const td_gguf_t *g, const char *name)
{
    for (const td_hash_slot_t *sl = td_hash_find(&g->tensor_index, name_hash(name)); sl;
         sl = td_hash_find_next(&g->tensor_index, sl))
        if (!strcmp(g->tensors[sl->value].name, name))
            return (size_t)sl->value;
    return SIZE_MAX;
}

/* ---- open / close -------------------------------------------------------------------- */

static void gguf_free(td_gguf_t *g)
{
    for (size_t i = 0; i < g->n_kvs; i++) {
        free(g->kvs[i].key);
        free(g->kvs[i].arr_strs);
    }
    free(g->kvs);
    for (size_t i = 0; i < g->n_tensors; i++)
        free(g->tensors[i].name);
    free(g->tensors);
    td_hash_free(&g->kv_index);
    td_hash_free(&g->tensor_index);
    td_mmap_free(&g->map);
    free(g->path);
    free(g);
}

/* general.alignment, when present: a u32 power of two. */
static td_status_t read_alignment(td_gguf_t *g)
{
    g->alignment = TD_GGUF_DEFAULT_ALIGNMENT;
    size_t i = kv_lookup(g, "general.alignment");
    if (i == SIZE_MAX)
        return TD_OK;
    const td_gguf_kv_t *kv = &g->kvs[i];
    if (kv->type != TD_GGUF_U32)
        return td_errorf(TD_ERR_FORMAT, "%s: general.alignment (byte %zu) is %s, the format says u32", g->path,
                         kv->offset, td_gguf_type_name(kv->type));
    uint64_t a = kv->v.u64;
    if (a == 0 || (a & (a - 1)) || a > GGUF_MAX_ALIGNMENT)
        return td_errorf(TD_ERR_FORMAT, "%s: general.alignment (byte %zu) is %llu, not a power of two up to %u",
                         g->path, kv->offset, (unsigned long long)a, GGUF_MAX_ALIGNMENT);
    g->alignment = (size_t)a;
    return TD_OK;
}

static td_status_t parse(td_gguf_t *g)
{
    rd_t r = {.path = g->path, .base = g->map.data, .size = g->map.size};
    const unsigned char *p = NULL;
    td_status_t s = rd_take(&r, 4, "magic", &p);
    if (s != TD_OK)
        return s;
    if (memcmp(p, GGUF_MAGIC, 4))
        return td_errorf(TD_ERR_FORMAT, "%s: not a GGUF file (the first 4 bytes are not \"GGUF\")", g->path);
    if ((s = rd_u32(&r, "version", &g->version)) != TD_OK)
        return s;
    if (g->version != 2 && g->version != 3) {
        if ((g->version & 0xffff) == 0)
            return td_errorf(TD_ERR_UNSUPPORTED, "%s: version at byte 4 reads 0x%08x: a big-endian GGUF file, "
                             "only little-endian ones are supported", g->path, g->version);
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: GGUF version %u, only versions 2 and 3 are supported%s", g->path,
                         g->version, g->version == 1 ? " (convert it with a newer llama.cpp)" : "");
    }
    uint64_t n_tensors = 0, n_kvs = 0;
    size_t at_t = r.pos;
    if ((s = rd_u64(&r, "tensor count", &n_tensors)) != TD_OK)
        return s;
    size_t at_kv = r.pos;
    if ((s = rd_u64(&r, "metadata count", &n_kvs)) != TD_OK)
        return s;
    /* smallest entries: a kv is key length + 1 byte key + type + 1 byte value; a tensor
     * info is name length + 1 byte + n_dims + type + offset */
    if ((s = check_count(&r, "metadata count", at_kv, n_kvs, 8 + 1 + 4 + 1)) != TD_OK ||
        (s = check_count(&r, "tensor count", at_t, n_tensors, 8 + 1 + 4 + 4 + 8)) != TD_OK)
        return s;
    if ((n_kvs && !(g->kvs = calloc((size_t)n_kvs, sizeof *g->kvs))) ||
        (n_tensors && !(g->tensors = calloc((size_t)n_tensors, sizeof *g->tensors))))
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", g->path);
    if ((s = td_hash_init(&g->kv_index, (size_t)n_kvs)) != TD_OK ||
        (s = td_hash_init(&g->tensor_index, (size_t)n_tensors)) != TD_OK)
        return td_errorf(s, "%s: out of memory", g->path);

    for (size_t i = 0; i < n_kvs; i++) {
        td_gguf_kv_t *kv = &g->kvs[i];
        g->n_kvs = i + 1; /* owned from here, even half-read */
        if ((s = rd_kv(&r, i, kv)) != TD_OK)
            return s;
        size_t prev = kv_lookup(g, kv->key);
        if (prev != SIZE_MAX)
            return td_errorf(TD_ERR_FORMAT, "%s: metadata key %s at byte %zu repeats the one at byte %zu", g->path,
                             kv->key, kv->offset, g->kvs[prev].offset);
        if ((s = td_hash_put(&g->kv_index, name_hash(kv->key), i)) != TD_OK)
            return td_errorf(s, "%s: out of memory", g->path);
    }
    if ((s = read_alignment(g)) != TD_OK)
        return s;
    for (size_t i = 0; i < n_tensors; i++) {
        td_gguf_tensor_t *t = &g->tensors[i];
        g->n_tensors = i + 1;
        size_t at = r.pos;
        if ((s = rd_tensor_info(&r, i, t)) != TD_OK)
            return s;
        size_t prev = tensor_lookup(g, t->name);
        if (prev != SIZE_MAX)
            return td_errorf(TD_ERR_FORMAT, "%s: tensor %zu at byte %zu is named %s, like tensor %zu", g->path, i, at,
                             t->name, prev);
        if ((s = td_hash_put(&g->tensor_index, name_hash(t->name), i)) != TD_OK)
            return td_errorf(s, "%s: out of memory", g->path);
    }
    /* the data section starts at the next multiple of the alignment (a file with no
     * tensors may end before it) */
    size_t pad = (g->alignment - r.pos % g->alignment) % g->alignment;
    if (n_tensors && pad > r.size - r.pos)
        return td_errorf(TD_ERR_FORMAT,
                         "%s: the data section should start at byte %zu (aligned to %zu), the file ends at byte %zu: "
                         "truncated file",
                         g->path, r.pos + pad, g->alignment, r.size);
    g->data_offset = TD_MIN(r.pos + pad, r.size);
    return place_tensors(g);
}

td_status_t td_gguf_open(const char *path, td_gguf_t **g_p)
{
    td_gguf_t *g = calloc(1, sizeof *g);
    if (!g)
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
    g->path = strdup(path);
    if (!g->path) {
        free(g);
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
    }
    td_status_t s = td_mmap_init(&g->map, path);
    if (s == TD_OK)
        s = parse(g);
    if (s != TD_OK) {
        gguf_free(g);
        return s;
    }
    *g_p = g;
    return TD_OK;
}

void td_gguf_close(td_gguf_t *g)
{
    if (g)
        gguf_free(g);
}

bool td_gguf_is_gguf(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return false;
    char magic[4];
    bool yes = fread(magic, 1, 4, f) == 4 && !memcmp(magic, GGUF_MAGIC, 4);
    fclose(f);
    return yes;
}

const char *td_gguf_path(const td_gguf_t *g) { return g->path; }
uint32_t td_gguf_version(const td_gguf_t *g) { return g->version; }
size_t td_gguf_alignment(const td_gguf_t *g) { return g->alignment; }
size_t td_gguf_data_offset(const td_gguf_t *g) { return g->data_offset; }
const td_mmap_t *td_gguf_map(const td_gguf_t *g) { return &g->map; }

/* ---- metadata access ----------------------------------------------------------------- */

size_t td_gguf_kv_count(const td_gguf_t *g)
{
    return g->n_kvs;
}

const td_gguf_kv_t *td_gguf_kv_at(const td_gguf_t *g, size_t i)
{
    return i < g->n_kvs ? &g->kvs[i] : NULL;
}

const td_gguf_kv_t *td_gguf_find(const td_gguf_t *g, const char *key)
{
    size_t i = kv_lookup(g, key);
    return i == SIZE_MAX ? NULL : &g->kvs[i];
}

/* The entry for key, or an error naming the key; when want is not NULL a type mismatch is
 * an error saying what was wanted. */
static td_status_t get_kv(const td_gguf_t *g, const char *key, bool ok_type, const td_gguf_kv_t *kv,
                          const char *want)
{
    if (!kv)
        return td_errorf(TD_ERR_NOT_FOUND, "%s: no metadata key %s", g->path, key);
    if (!ok_type)
        return td_errorf(TD_ERR_FORMAT, "%s: metadata %s (byte %zu) is %s%s, want %s", g->path, key, kv->offset,
                         kv->type == TD_GGUF_ARRAY ? "an array of " : "",
                         td_gguf_type_name(kv->type == TD_GGUF_ARRAY ? kv->arr_type : kv->type), want);
    return TD_OK;
}

td_status_t td_gguf_get_uint(const td_gguf_t *g, const char *key, uint64_t *out)
{
    const td_gguf_kv_t *kv = td_gguf_find(g, key);
    td_status_t s = get_kv(g, key, kv && is_int_type(kv->type), kv, "an unsigned integer");
    if (s != TD_OK)
        return s;
    if (is_signed_type(kv->type) && kv->v.i64 < 0)
        return td_errorf(TD_ERR_FORMAT, "%s: metadata %s (byte %zu) is %lld, want a value >= 0", g->path, key,
                         kv->offset, (long long)kv->v.i64);
    *out = kv->v.u64;
    return TD_OK;
}

td_status_t td_gguf_get_int(const td_gguf_t *g, const char *key, int64_t *out)
{
    const td_gguf_kv_t *kv = td_gguf_find(g, key);
    td_status_t s = get_kv(g, key, kv && is_int_type(kv->type), kv, "an integer");
    if (s != TD_OK)
        return s;
    if (kv->type == TD_GGUF_U64 && kv->v.u64 > INT64_MAX)
        return td_errorf(TD_ERR_FORMAT, "%s: metadata %s (byte %zu) is %llu, more than an int64 holds", g->path, key,
                         kv->offset, (unsigned long long)kv->v.u64);
    *out = kv->v.i64;
    return TD_OK;
}

td_status_t td_gguf_get_float(const td_gguf_t *g, const char *key, double *out)
{
    const td_gguf_kv_t *kv = td_gguf_find(g, key);
    td_status_t s =
        get_kv(g, key, kv && (kv->type == TD_GGUF_F32 || kv->type == TD_GGUF_F64), kv, "a floating-point number");
    if (s == TD_OK)
        *out = kv->v.f64;
    return s;
}

td_status_t td_gguf_get_bool(const td_gguf_t *g, const char *key, bool *out)
{
    const td_gguf_kv_t *kv = td_gguf_find(g, key);
    td_status_t s = get_kv(g, key, kv && kv->type == TD_GGUF_BOOL, kv, "a bool");
    if (s == TD_OK)
        *out = kv->v.u64 != 0;
    return s;
}

td_status_t td_gguf_get_str(const td_gguf_t *g, const char *key, td_gguf_str_t *out)
{
    const td_gguf_kv_t *kv = td_gguf_find(g, key);
    td_status_t s = get_kv(g, key, kv && kv->type == TD_GGUF_STRING, kv, "a string");
    if (s == TD_OK)
        *out = kv->v.str;
    return s;
}

td_status_t td_gguf_get_array(const td_gguf_t *g, const char *key, td_gguf_type_t elem, const td_gguf_kv_t **kv_p)
{
    const td_gguf_kv_t *kv = td_gguf_find(g, key);
    char want[40];
    snprintf(want, sizeof want, "an array of %s", elem == TD_GGUF_ARRAY ? "anything" : td_gguf_type_name(elem));
    td_status_t s = get_kv(g, key, kv && kv->type == TD_GGUF_ARRAY && (elem == TD_GGUF_ARRAY || kv->arr_type == elem),
                           kv, want);
    if (s == TD_OK)
        *kv_p = kv;
    return s;
}

int64_t td_gguf_arr_int(const td_gguf_kv_t *kv, size_t i)
{
    TD_ASSERT(kv->type == TD_GGUF_ARRAY && is_int_type(kv->arr_type) && i < kv->arr_len);
    td_gguf_kv_t one;
    size_t es = scalar_size(kv->arr_type);
    load_scalar(&one, kv->arr_type, (const unsigned char *)kv->arr_data + i * es);
    return one.v.i64;
}

double td_gguf_arr_float(const td_gguf_kv_t *kv, size_t i)
{
    TD_ASSERT(kv->type == TD_GGUF_ARRAY && (kv->arr_type == TD_GGUF_F32 || kv->arr_type == TD_GGUF_F64) &&
              i < kv->arr_len);
    td_gguf_kv_t one;
    load_scalar(&one, kv->arr_type, (const unsigned char *)kv->arr_data + i * scalar_size(kv->arr_type));
    return one.v.f64;
}

bool td_gguf_arr_bool(const td_gguf_kv_t *kv, size_t i)
{
    TD_ASSERT(kv->type == TD_GGUF_ARRAY && kv->arr_type == TD_GGUF_BOOL && i < kv->arr_len);
    return ((const unsigned char *)kv->arr_data)[i] != 0;
}

td_gguf_str_t td_gguf_arr_str(const td_gguf_kv_t *kv, size_t i)
{
    TD_ASSERT(kv->type == TD_GGUF_ARRAY && kv->arr_type == TD_GGUF_STRING && i < kv->arr_len);
    return kv->arr_strs[i];
}

/* ---- tensor access ------------------------------------------------------------------- */

size_t td_gguf_tensor_count(const td_gguf_t *g)
{
    return g->n_tensors;
}

const td_gguf_tensor_t *td_gguf_tensor_at(const td_gguf_t *g, size_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const td_gguf_tensor_t *td_gguf_find_tensor(const td_gguf_t *g, const char *name)
{
    size_t i = tensor_lookup(g, name);
    return i == SIZE_MAX ? NULL : &g->tensors[i];
}

td_status_t td_gguf_tensor(const td_gguf_t *g, const char *name, const td_gguf_tensor_t **t_p)
{
    const td_gguf_tensor_t *t = td_gguf_find_tensor(g, name);
    if (!t)
        return td_errorf(TD_ERR_NOT_FOUND, "%s: no tensor %s", g->path, name);
    if (!t->known) {
        const td_ggml_type_t *gt = td_ggml_type(t->type);
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: tensor %s has ggml type %u (%s), whose layout is not supported",
                         g->path, name, t->type, gt ? gt->name : "unknown to ggml too");
    }
    *t_p = t;
    return TD_OK;
}
