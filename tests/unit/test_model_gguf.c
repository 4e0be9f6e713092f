/*
 * Tests of td_model_load on GGUF files: small models written here with td_gguf_writer
 * (llama, qwen2, qwen3; f32 and Q8_0 matrices; tied and untied; with rope_freqs) load
 * with the config their metadata says and views onto exactly the bytes written; every
 * inconsistent file (a missing key or tensor, a wrong shape, an unknown tensor, a type
 * tandem has no dtype for, a tokenizer of the wrong size, nonsense values, truncation)
 * fails with a message naming the file and the field; and, when TANDEM_TEST_GGUF names
 * SmolLM2-135M-Instruct.Q4_1.gguf, its weights dequantized equal gguf-py's
 * (tests/fixtures/gguf/smollm2_values.txt).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_gguf.h"
#include "td_gguf_writer.h"
#include "td_model.h"
#include "td_quant.h"
#include "td_test_models.h"
#include "td_util.h"

/* ---- a tiny model, written with knobs to break it ---------------------------------- */

typedef struct tiny {
    const char *arch;          /* "llama" (default), "qwen2", "qwen3" */
    uint32_t mat_type;         /* ggml type of the matrices (default F32) */
    bool untied;               /* write output.weight */
    bool rope_freqs;           /* write rope_freqs.weight */
    const char *skip_key;      /* a metadata key (without "{arch}.") not written */
    const char *skip_tensor;   /* a tensor not written */
    const char *wide_tensor;   /* a matrix written with 32 more columns */
    const char *extra_tensor;  /* an extra [32] f32 tensor */
    const char *q3k_tensor;    /* a matrix written as Q3_K (a type tandem has no dtype for) */
    int n_tokens;              /* length of tokenizer.ggml.tokens (default vocab) */
    int heads_kv;              /* head_count_kv (default 2) */
    int eos;                   /* tokenizer.ggml.eos_token_id (default 2) */
    const char *scaling;       /* rope.scaling.type with factor 4 */
} tiny_t;

enum { T_DIM = 64, T_HIDDEN = 96, T_LAYERS = 2, T_HEADS = 4, T_VOCAB = 40 };

static char path[256];

static void tmp_setup(void)
{
    snprintf(path, sizeof path, "/tmp/td_test_model_gguf_XXXXXX");
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
}

static void tmp_teardown(void)
{
    unlink(path);
}

TestSuite(model_gguf, .init = tmp_setup, .fini = tmp_teardown);

/* The value of element k of the i-th tensor written: small, exact in f32, distinct. */
static float value(int i, size_t k)
{
    return (float)((int)((k * 7 + (size_t)i * 13) % 29) - 14) / 64.0f;
}

typedef struct spec {
    char name[64];
    int64_t d0, d1; /* td order */
    uint32_t type;
} spec_t;

static int list(const tiny_t *o, spec_t *s)
{
    const char *arch = o->arch ? o->arch : "llama";
    int kv = (o->heads_kv ? o->heads_kv : 2) * (T_DIM / T_HEADS), hd = T_DIM / T_HEADS;
    uint32_t mt = o->mat_type;
    int n = 0;
#define ADD(nm, a, b, t) (snprintf(s[n].name, sizeof s[n].name, "%s", nm), s[n].d0 = a, s[n].d1 = b, s[n++].type = t)
    ADD("token_embd.weight", T_VOCAB, T_DIM, mt);
    if (o->rope_freqs)
        ADD("rope_freqs.weight", hd / 2, 0, TD_GGML_F32);
    for (int l = 0; l < T_LAYERS; l++) {
        char nm[64];
#define L(sfx, a, b, t) (snprintf(nm, sizeof nm, "blk.%d.%s", l, sfx), ADD(nm, a, b, t))
        L("attn_norm.weight", T_DIM, 0, TD_GGML_F32);
        L("attn_q.weight", T_DIM, T_DIM, mt);
        L("attn_k.weight", kv, T_DIM, mt);
        L("attn_v.weight", kv, T_DIM, mt);
        if (!strcmp(arch, "qwen2")) {
            L("attn_q.bias", T_DIM, 0, TD_GGML_F32);
            L("attn_k.bias", kv, 0, TD_GGML_F32);
            L("attn_v.bias", kv, 0, TD_GGML_F32);
        }
        if (!strcmp(arch, "qwen3")) {
            L("attn_q_norm.weight", hd, 0, TD_GGML_F32);
            L("attn_k_norm.weight", hd, 0, TD_GGML_F32);
        }
        L("attn_output.weight", T_DIM, T_DIM, mt);
        L("ffn_norm.weight", T_DIM, 0, TD_GGML_F32);
        L("ffn_gate.weight", T_HIDDEN, T_DIM, mt);
        L("ffn_up.weight", T_HIDDEN, T_DIM, mt);
        L("ffn_down.weight", T_DIM, T_HIDDEN, mt);
#undef L
    }
    ADD("output_norm.weight", T_DIM, 0, TD_GGML_F32);
    if (o->untied)
        ADD("output.weight", T_VOCAB, T_DIM, mt);
    if (o->extra_tensor)
        ADD(o->extra_tensor, 32, 0, TD_GGML_F32);
#undef ADD
    return n;
}

static void key_u32(td_gguf_writer_t *w, const tiny_t *o, const char *arch, const char *k, uint32_t v)
{
    if (o->skip_key && !strcmp(o->skip_key, k))
        return;
    char key[96];
    snprintf(key, sizeof key, "%s.%s", arch, k);
    cr_assert_eq(td_gguf_writer_u32(w, key, v), TD_OK);
}

static void write_tiny(const tiny_t *o)
{
    const char *arch = o->arch ? o->arch : "llama";
    td_gguf_writer_t *w;
    cr_assert_eq(td_gguf_writer_create(path, &w), TD_OK);
    cr_assert_eq(td_gguf_writer_str(w, "general.architecture", arch), TD_OK);
    key_u32(w, o, arch, "context_length", 256);
    key_u32(w, o, arch, "embedding_length", T_DIM);
    key_u32(w, o, arch, "feed_forward_length", T_HIDDEN);
    key_u32(w, o, arch, "block_count", T_LAYERS);
    key_u32(w, o, arch, "attention.head_count", T_HEADS);
    key_u32(w, o, arch, "attention.head_count_kv", (uint32_t)(o->heads_kv ? o->heads_kv : 2));
    if (!o->skip_key || strcmp(o->skip_key, "attention.layer_norm_rms_epsilon")) {
        char key[96];
        snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", arch);
        cr_assert_eq(td_gguf_writer_f32(w, key, 1e-6f), TD_OK);
    }
    char key[96];
    snprintf(key, sizeof key, "%s.rope.freq_base", arch);
    cr_assert_eq(td_gguf_writer_f32(w, key, 500000.0f), TD_OK);
    if (o->scaling) {
        snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
        cr_assert_eq(td_gguf_writer_str(w, key, o->scaling), TD_OK);
        snprintf(key, sizeof key, "%s.rope.scaling.factor", arch);
        cr_assert_eq(td_gguf_writer_f32(w, key, 4.0f), TD_OK);
    }
    int n_tok = o->n_tokens ? o->n_tokens : T_VOCAB;
    const char **toks = calloc((size_t)n_tok, sizeof *toks);
    char(*text)[16] = calloc((size_t)n_tok, sizeof *text);
    for (int i = 0; i < n_tok; i++) {
        snprintf(text[i], sizeof text[i], "t%d", i);
        toks[i] = text[i];
    }
    cr_assert_eq(td_gguf_writer_str(w, "tokenizer.ggml.model", "gpt2"), TD_OK);
    cr_assert_eq(td_gguf_writer_arr_str(w, "tokenizer.ggml.tokens", toks, (size_t)n_tok), TD_OK);
    free(toks);
    free(text);
    cr_assert_eq(td_gguf_writer_u32(w, "tokenizer.ggml.bos_token_id", 1), TD_OK);
    cr_assert_eq(td_gguf_writer_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)(o->eos ? o->eos : 2)), TD_OK);
    cr_assert_eq(td_gguf_writer_u32(w, "tokenizer.ggml.eot_token_id", 3), TD_OK);

    spec_t s[64];
    int n = list(o, s);
    for (int i = 0; i < n; i++) {
        if (o->skip_tensor && !strcmp(o->skip_tensor, s[i].name))
            continue;
        bool q3k = o->q3k_tensor && !strcmp(o->q3k_tensor, s[i].name);
        int64_t cols = s[i].d1 > 0 ? s[i].d1 : s[i].d0;
        if (o->wide_tensor && !strcmp(o->wide_tensor, s[i].name))
            cols += 32;
        if (q3k)
            cols = 256;
        int64_t ne[2] = {cols, s[i].d0};
        cr_assert_eq(td_gguf_writer_tensor(w, s[i].name, s[i].d1 > 0 ? 2 : 1, ne, q3k ? TD_GGML_Q3_K : s[i].type),
                     TD_OK, "%s", td_last_error());
    }
    cr_assert_eq(td_gguf_writer_begin(w), TD_OK);
    for (int i = 0; i < n; i++) {
        if (o->skip_tensor && !strcmp(o->skip_tensor, s[i].name))
            continue;
        bool q3k = o->q3k_tensor && !strcmp(o->q3k_tensor, s[i].name);
        int64_t cols = s[i].d1 > 0 ? s[i].d1 : s[i].d0;
        if (o->wide_tensor && !strcmp(o->wide_tensor, s[i].name))
            cols += 32;
        int64_t rows = s[i].d1 > 0 ? s[i].d0 : 1;
        if (q3k) {
            size_t bytes = (size_t)rows * 110; /* one 256-weight Q3_K block per row */
            void *z = calloc(1, bytes);
            cr_assert_eq(td_gguf_writer_write(w, z, bytes), TD_OK);
            free(z);
            continue;
        }
        size_t elems = (size_t)(rows * cols);
        float *v = malloc(elems * sizeof *v);
        for (size_t k = 0; k < elems; k++)
            v[k] = value(i, k);
        td_dtype_t dt = (td_dtype_t)td_dtype_from_ggml(s[i].type);
        void *q = malloc(td_dtype_bytes(dt, elems));
        td_dtype_convert(q, dt, v, TD_F32, elems);
        cr_assert_eq(td_gguf_writer_write(w, q, td_dtype_bytes(dt, elems)), TD_OK);
        free(q);
        free(v);
    }
    cr_assert_eq(td_gguf_writer_finish(w), TD_OK, "%s", td_last_error());
    td_gguf_writer_destroy(w);
}

static td_model_t *load_ok(void)
{
    td_model_t *m = NULL;
    cr_assert_eq(td_model_load(path, &m), TD_OK, "%s", td_last_error());
    return m;
}

/* Loading fails with `want` and a message naming the file and holding `needle`. */
static void expect_error(td_status_t want, const char *needle)
{
    td_clear_error();
    td_model_t *m = NULL;
    td_status_t s = td_model_load(path, &m);
    cr_assert_eq(s, want, "want %s, got %s (%s)", td_status_name(want), td_status_name(s), td_last_error());
    cr_assert_null(m);
    cr_assert(strstr(td_last_error(), needle), "message '%s' should say '%s'", td_last_error(), needle);
    cr_assert(strstr(td_last_error(), path), "message '%s' should name the file", td_last_error());
}

/* Every value of tensor t (td order) equals what write_tiny wrote for tensor i. */
static void check_values(const td_tensor_t *t, int i)
{
    cr_assert_not_null(t->data);
    size_t elems = (size_t)t->shape[0] * (size_t)(t->n_dims == 2 ? t->shape[1] : 1);
    float *got = malloc(elems * sizeof *got);
    td_dtype_convert(got, TD_F32, t->data, t->dtype, elems);
    for (size_t k = 0; k < elems; k++) {
        float want = value(i, k);
        if (td_dtype_is_block(t->dtype)) /* Q8_0 of these values: within half a step */
            cr_assert(fabsf(got[k] - want) <= 14.0f / 64 / 127 + 1e-6f, "tensor %d [%zu]: %g vs %g", i, k,
                      (double)got[k], (double)want);
        else
            cr_assert_eq(got[k], want, "tensor %d [%zu]: %g vs %g", i, k, (double)got[k], (double)want);
    }
    free(got);
}

Test(model_gguf, llama_f32)
{
    tiny_t o = {0};
    write_tiny(&o);
    td_model_t *m = load_ok();
    const td_model_config_t *c = &m->config;
    cr_assert_eq(c->arch, TD_ARCH_LLAMA);
    cr_assert_eq(c->rope_style, TD_ROPE_PAIRS, "llama.cpp permuted q/k for adjacent-pair rope");
    cr_assert(c->dim == T_DIM && c->hidden_dim == T_HIDDEN && c->n_layers == T_LAYERS && c->n_heads == T_HEADS);
    cr_assert(c->n_kv_heads == 2 && c->head_dim == T_DIM / T_HEADS && c->vocab_size == T_VOCAB);
    cr_assert(c->max_seq_len == 256 && c->norm_eps == 1e-6f && c->rope_theta == 500000.0f);
    cr_assert(c->tie_embeddings && !c->qkv_bias && !c->qk_norm && !c->rope_llama3);
    cr_assert_eq(c->bos_id, 1);
    cr_assert(c->n_eos == 2 && c->eos_ids[0] == 2 && c->eos_ids[1] == 3, "eos and eot both stop");
    cr_assert_eq(c->dtype, TD_F32);
    cr_assert_str_eq(m->tokenizer_path, path);
    cr_assert_null(m->weights.rope_freqs.data);
    /* ne = {in, out} is td {out, in} */
    cr_assert(m->weights.layers[1].wk.shape[0] == 32 && m->weights.layers[1].wk.shape[1] == T_DIM);
    cr_assert(m->weights.layers[1].w_down.shape[0] == T_DIM && m->weights.layers[1].w_down.shape[1] == T_HIDDEN);
    cr_assert_eq(m->weights.lm_head.data, m->weights.embed.data);
    check_values(&m->weights.embed, 0);
    check_values(&m->weights.layers[0].attn_norm, 1);
    check_values(&m->weights.layers[0].wq, 2);
    check_values(&m->weights.layers[1].w_down, 9 + 9);
    check_values(&m->weights.final_norm, 1 + 2 * 9);
    cr_assert_eq(m->fingerprint, td_model_fingerprint(c));
    td_model_destroy(m);
}

Test(model_gguf, q8_0_untied_rope_freqs)
{
    tiny_t o = {.mat_type = TD_GGML_Q8_0, .untied = true, .rope_freqs = true};
    write_tiny(&o);
    td_model_t *m = load_ok();
    cr_assert(!m->config.tie_embeddings);
    cr_assert_eq(m->weights.layers[0].wq.dtype, TD_Q8_0);
    cr_assert_eq(m->weights.layers[0].attn_norm.dtype, TD_F32);
    cr_assert_eq(m->config.dtype, TD_F16, "block weights dequantize to f16 where a backend must");
    cr_assert_neq(m->weights.lm_head.data, m->weights.embed.data);
    cr_assert(m->weights.rope_freqs.shape[0] == T_DIM / T_HEADS / 2 && m->weights.rope_freqs.dtype == TD_F32);
    check_values(&m->weights.rope_freqs, 1);
    check_values(&m->weights.embed, 0);
    check_values(&m->weights.layers[0].wq, 3);
    cr_assert_neq(m->config.rope_freqs_hash, 0);
    uint64_t fp = m->fingerprint;
    td_model_destroy(m);

    /* the same model in f32: the fingerprint does not hash the storage type ... */
    o.mat_type = TD_GGML_F32;
    write_tiny(&o);
    m = load_ok();
    cr_assert_eq(m->fingerprint, fp);
    td_model_destroy(m);
    /* ... but does the rope frequencies */
    o.rope_freqs = false;
    write_tiny(&o);
    m = load_ok();
    cr_assert_neq(m->fingerprint, fp);
    td_model_destroy(m);
}

Test(model_gguf, qwen2_and_qwen3)
{
    tiny_t o = {.arch = "qwen2"};
    write_tiny(&o);
    td_model_t *m = load_ok();
    cr_assert(m->config.arch == TD_ARCH_QWEN2 && m->config.qkv_bias && m->config.rope_style == TD_ROPE_HALVES);
    check_values(&m->weights.layers[0].bk, 6);
    td_model_destroy(m);
    o.arch = "qwen3";
    write_tiny(&o);
    m = load_ok();
    cr_assert(m->config.arch == TD_ARCH_QWEN3 && m->config.qk_norm && m->config.rope_style == TD_ROPE_HALVES);
    check_values(&m->weights.layers[0].k_norm, 6);
    td_model_destroy(m);
}

Test(model_gguf, errors_name_the_file_and_field)
{
    static const struct {
        tiny_t o;
        td_status_t want;
        const char *needle;
    } cases[] = {
        {{.skip_key = "feed_forward_length"}, TD_ERR_FORMAT, "missing metadata key llama.feed_forward_length"},
        {{.skip_key = "attention.layer_norm_rms_epsilon"}, TD_ERR_FORMAT, "llama.attention.layer_norm_rms_epsilon"},
        {{.skip_tensor = "blk.1.ffn_up.weight"}, TD_ERR_FORMAT, "missing tensor blk.1.ffn_up.weight"},
        {{.skip_tensor = "token_embd.weight"}, TD_ERR_FORMAT, "missing tensor token_embd.weight"},
        {{.wide_tensor = "blk.0.attn_k.weight"}, TD_ERR_FORMAT, "tensor blk.0.attn_k.weight has ne [96, 32]"},
        {{.extra_tensor = "blk.0.attn_sinks.weight"}, TD_ERR_FORMAT, "tensor blk.0.attn_sinks.weight is not part"},
        {{.extra_tensor = "blk.7.attn_norm.weight"}, TD_ERR_FORMAT, "block_count is 2"},
        {{.extra_tensor = "blk.01.attn_norm.weight"}, TD_ERR_FORMAT, "blk.01.attn_norm.weight is not part"},
        {{.q3k_tensor = "blk.0.ffn_gate.weight"}, TD_ERR_UNSUPPORTED, "blk.0.ffn_gate.weight has ggml type Q3_K"},
        {{.n_tokens = 39}, TD_ERR_FORMAT, "tokenizer.ggml.tokens has 39 tokens"},
        {{.heads_kv = 3}, TD_ERR_FORMAT, "head_count 4 is not a multiple of head_count_kv 3"},
        {{.eos = 40}, TD_ERR_FORMAT, "tokenizer.ggml.eos_token_id = 40 is outside the vocabulary"},
        {{.scaling = "linear"}, TD_ERR_UNSUPPORTED, "llama.rope.scaling.type \"linear\""},
        {{.arch = "gpt2"}, TD_ERR_UNSUPPORTED, "general.architecture \"gpt2\""},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(cases); i++) {
        write_tiny(&cases[i].o);
        expect_error(cases[i].want, cases[i].needle);
    }
}

Test(model_gguf, truncated_and_zero_values)
{
    tiny_t o = {0};
    write_tiny(&o);
    char *bytes;
    size_t len;
    cr_assert_eq(td_file_read_all(path, 1u << 24, &bytes, &len), TD_OK);
    /* cut anywhere: the reader refuses it (format), never a crash */
    for (size_t cut = 0; cut < len; cut += len / 97 + 1) {
        td_test_write_file(path, bytes, cut);
        td_model_t *m = NULL;
        td_clear_error();
        cr_assert_neq(td_model_load(path, &m), TD_OK, "cut at %zu of %zu", cut, len);
        cr_assert_null(m);
        if (cut >= 4) /* shorter is not recognised as GGUF at all */
            cr_assert(strstr(td_last_error(), path), "cut %zu: %s", cut, td_last_error());
    }
    /* block_count 0: the value, not just its presence, is checked */
    static const char key[] = "llama.block_count";
    char *at = memmem(bytes, len, key, sizeof key - 1);
    cr_assert_not_null(at);
    memset(at + sizeof key - 1 + 4, 0, 4); /* the u32 after the value type */
    td_test_write_file(path, bytes, len);
    free(bytes);
    expect_error(TD_ERR_FORMAT, "llama.block_count = 0 is out of range");
}

/* ---- the real file ----------------------------------------------------------------- */

static const td_tensor_t *tensor_by_name(const td_model_t *m, const char *name)
{
    if (!strcmp(name, "token_embd.weight"))
        return &m->weights.embed;
    if (!strcmp(name, "output_norm.weight"))
        return &m->weights.final_norm;
    int l, used = 0;
    char sfx[64];
    cr_assert(sscanf(name, "blk.%d.%63s%n", &l, sfx, &used) == 2, "%s", name);
    const td_layer_weights_t *w = &m->weights.layers[l];
    static const struct { const char *sfx; size_t off; } map[] = {
        {"attn_norm.weight", offsetof(td_layer_weights_t, attn_norm)},
        {"attn_q.weight", offsetof(td_layer_weights_t, wq)},
        {"attn_k.weight", offsetof(td_layer_weights_t, wk)},
        {"attn_v.weight", offsetof(td_layer_weights_t, wv)},
        {"attn_output.weight", offsetof(td_layer_weights_t, wo)},
        {"ffn_norm.weight", offsetof(td_layer_weights_t, ffn_norm)},
        {"ffn_gate.weight", offsetof(td_layer_weights_t, w_gate)},
        {"ffn_up.weight", offsetof(td_layer_weights_t, w_up)},
        {"ffn_down.weight", offsetof(td_layer_weights_t, w_down)},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(map); i++)
        if (!strcmp(sfx, map[i].sfx))
            return (const td_tensor_t *)((const char *)w + map[i].off);
    cr_assert_fail("no tensor %s", name);
    return NULL;
}

Test(model_gguf, smollm2_real_weights)
{
    const char *real = getenv("TANDEM_TEST_GGUF");
    if (!real || !*real || !td_is_file(real))
        cr_skip_test("TANDEM_TEST_GGUF does not name a file (set it to SmolLM2-135M-Instruct.Q4_1.gguf)");
    td_model_t *m;
    cr_assert_eq(td_model_load(real, &m), TD_OK, "%s", td_last_error());
    const td_model_config_t *c = &m->config;
    cr_assert(c->arch == TD_ARCH_LLAMA && c->rope_style == TD_ROPE_PAIRS && c->dim == 576 && c->hidden_dim == 1536);
    cr_assert(c->n_layers == 30 && c->n_heads == 9 && c->n_kv_heads == 3 && c->head_dim == 64);
    cr_assert(c->vocab_size == 49152 && c->max_seq_len == 8192 && c->rope_theta == 100000.0f);
    cr_assert(c->tie_embeddings && c->bos_id == 1 && c->n_eos == 1 && c->eos_ids[0] == 2);
    cr_assert_eq(c->dtype, TD_F16);
    cr_assert_eq(m->weights.embed.dtype, TD_Q8_0);
    cr_assert_eq(m->weights.layers[0].wq.dtype, TD_Q4_1);

    char *text = td_test_fixture_read("gguf/smollm2_values.txt", 1u << 20, NULL);
    int n = 0;
    float *row = NULL;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == '#')
            continue;
        char name[64];
        long i, j;
        unsigned bits;
        cr_assert(sscanf(line, "%63s %ld %ld %x", name, &i, &j, &bits) == 4, "%s", line);
        const td_tensor_t *t = tensor_by_name(m, name);
        int64_t cols = t->n_dims == 2 ? t->shape[1] : t->shape[0];
        row = realloc(row, (size_t)cols * sizeof *row);
        const char *base = t->data;
        td_dtype_convert(row, TD_F32, base + td_dtype_bytes(t->dtype, (size_t)(i * cols)), t->dtype, (size_t)cols);
        float want;
        memcpy(&want, &bits, 4);
        cr_assert_eq(row[j], want, "%s [%ld][%ld]: %g, gguf-py %g", name, i, j, (double)row[j], (double)want);
        n++;
    }
    cr_assert_geq(n, 90);
    free(row);
    free(text);
    td_model_destroy(m);
}

/* ---- td_model_synth_gguf ------------------------------------------------------------ */

/* What synth writes beside the weights: the metadata llama.cpp needs (its tokenizer: one
 * token per embedding row, merges, bos/eos), Llama 3 rope scaling as rope_freqs, and
 * refusals for what cannot be written. */
Test(model_gguf, synth_metadata_and_rope_freqs)
{
    td_synth_params_t p = {.seed = 3, .dtype = TD_F16};
    cr_assert_eq(td_model_preset("tiny", &p.config), TD_OK);
    p.config.rope_theta = 500000.0f;
    p.config.rope_llama3 = true;
    p.config.rope_factor = 32.0f;
    p.config.rope_low_freq_factor = 1.0f;
    p.config.rope_high_freq_factor = 4.0f;
    p.config.rope_original_max_pos = 64;
    cr_assert_eq(td_model_synth_gguf(&p, path), TD_OK, "%s", td_last_error());

    td_gguf_t *g;
    cr_assert_eq(td_gguf_open(path, &g), TD_OK, "%s", td_last_error());
    const td_gguf_kv_t *a;
    cr_assert_eq(td_gguf_get_array(g, "tokenizer.ggml.tokens", TD_GGUF_STRING, &a), TD_OK);
    cr_assert_eq(a->arr_len, 512);
    td_gguf_str_t s = td_gguf_arr_str(a, 'A');
    cr_assert(s.len == 1 && s.data[0] == 'A');
    s = td_gguf_arr_str(a, 256);
    cr_assert(s.len == 3 && !memcmp(s.data, "<s>", 3));
    cr_assert_eq(td_gguf_get_array(g, "tokenizer.ggml.merges", TD_GGUF_STRING, &a), TD_OK);
    cr_assert_eq(td_gguf_get_array(g, "tokenizer.ggml.token_type", TD_GGUF_I32, &a), TD_OK);
    cr_assert(td_gguf_arr_int(a, 0) == 1 && td_gguf_arr_int(a, 257) == 3);
    uint64_t u;
    cr_assert(td_gguf_get_uint(g, "general.file_type", &u) == TD_OK && u == 1);
    td_gguf_close(g);

    td_model_t *m = load_ok();
    cr_assert_eq(m->config.rope_style, TD_ROPE_PAIRS);
    cr_assert(!m->config.rope_llama3, "the scaling is in rope_freqs");
    cr_assert(m->config.bos_id == 256 && m->config.n_eos == 1 && m->config.eos_ids[0] == 257);
    cr_assert_eq(m->config.dtype, TD_F16);
    const float *f = m->weights.rope_freqs.data;
    cr_assert_not_null(f);
    /* pair i: wavelength 2 pi theta^(2i/hd) against 64/4 = 16 and 64/1 = 64 */
    int hd = m->config.head_dim;
    for (int i = 0; i < hd / 2; i++) {
        double wavelen = 2 * M_PI * pow(500000.0, 2.0 * i / hd);
        double want = wavelen < 16 ? 1 : wavelen > 64 ? 32 : 1 / ((1 - (64 / wavelen - 1) / 3) / 32 + (64 / wavelen - 1) / 3);
        cr_assert_float_eq(f[i], want, 1e-4 * want, "pair %d: %g vs %g", i, (double)f[i], want);
    }
    cr_assert(f[0] == 1.0f && f[hd / 2 - 1] == 32.0f, "both ends of the ramp are exercised");
    td_model_destroy(m);

    /* tiny's ffn rows (176) are not whole Q4_0 blocks: refused, and no file left */
    unlink(path);
    p.dtype = TD_Q4_0;
    td_clear_error();
    cr_assert_eq(td_model_synth_gguf(&p, path), TD_ERR_INVALID);
    cr_assert(strstr(td_last_error(), "hidden_dim 176"), "%s", td_last_error());
    cr_assert(!td_is_file(path));
    p.config.hidden_dim = 192;
    cr_assert_eq(td_model_synth_gguf(&p, path), TD_OK, "%s", td_last_error());
    m = load_ok();
    cr_assert(m->weights.layers[3].w_down.dtype == TD_Q4_0 && m->weights.final_norm.dtype == TD_F32);
    td_model_destroy(m);
}

/* ---- td_gguf_writer ---------------------------------------------------------------- */

/* What the writer writes, td_gguf reads back (each value type it offers, two tensors with
 * padding between them); what it cannot write whole, it refuses and leaves no file. */
Test(model_gguf, writer_round_trip_and_refusals)
{
    td_gguf_writer_t *w;
    cr_assert_eq(td_gguf_writer_create(path, &w), TD_OK);
    static const int32_t ints[] = {-7, 0, 2147483647};
    static const float floats[] = {0.5f, -1e30f};
    static const char *const strs[] = {"a", "", "ü"};
    cr_assert_eq(td_gguf_writer_u32(w, "u", 4000000000u), TD_OK);
    cr_assert_eq(td_gguf_writer_i32(w, "i", -5), TD_OK);
    cr_assert_eq(td_gguf_writer_f32(w, "f", 0.25f), TD_OK);
    cr_assert_eq(td_gguf_writer_bool(w, "b", true), TD_OK);
    cr_assert_eq(td_gguf_writer_str(w, "s", "hello"), TD_OK);
    cr_assert_eq(td_gguf_writer_arr_i32(w, "ai", ints, 3), TD_OK);
    cr_assert_eq(td_gguf_writer_arr_f32(w, "af", floats, 2), TD_OK);
    cr_assert_eq(td_gguf_writer_arr_str(w, "as", strs, 3), TD_OK);
    int64_t ne_bad[2] = {33, 2};
    cr_assert_eq(td_gguf_writer_tensor(w, "bad", 2, ne_bad, TD_GGML_Q8_0), TD_ERR_INVALID, "33 is no Q8_0 row");
    int64_t ne_a[1] = {3}, ne_b[2] = {32, 2};
    cr_assert_eq(td_gguf_writer_tensor(w, "a", 1, ne_a, TD_GGML_F32), TD_OK);
    cr_assert_eq(td_gguf_writer_tensor(w, "b", 2, ne_b, TD_GGML_Q8_0), TD_OK);
    cr_assert_eq(td_gguf_writer_begin(w), TD_OK);
    cr_assert_eq(td_gguf_writer_u32(w, "late", 1), TD_ERR_INVALID);
    float a[3] = {1, 2, 3};
    unsigned char b[68];
    for (size_t i = 0; i < sizeof b; i++)
        b[i] = (unsigned char)i;
    cr_assert_eq(td_gguf_writer_write(w, a, 5), TD_OK); /* pieces of any size */
    cr_assert_eq(td_gguf_writer_write(w, (char *)a + 5, 7), TD_OK);
    cr_assert_eq(td_gguf_writer_write(w, b, sizeof b), TD_OK);
    cr_assert_eq(td_gguf_writer_write(w, b, 1), TD_ERR_INVALID, "past the last tensor");
    cr_assert_eq(td_gguf_writer_finish(w), TD_OK);
    td_gguf_writer_destroy(w);

    td_gguf_t *g;
    cr_assert_eq(td_gguf_open(path, &g), TD_OK, "%s", td_last_error());
    uint64_t u;
    int64_t i;
    double f;
    bool bo;
    td_gguf_str_t s;
    const td_gguf_kv_t *kv;
    cr_assert(td_gguf_get_uint(g, "u", &u) == TD_OK && u == 4000000000u);
    cr_assert(td_gguf_get_int(g, "i", &i) == TD_OK && i == -5);
    cr_assert(td_gguf_get_float(g, "f", &f) == TD_OK && f == 0.25);
    cr_assert(td_gguf_get_bool(g, "b", &bo) == TD_OK && bo);
    cr_assert(td_gguf_get_str(g, "s", &s) == TD_OK && s.len == 5 && !memcmp(s.data, "hello", 5));
    cr_assert(td_gguf_get_array(g, "ai", TD_GGUF_I32, &kv) == TD_OK && kv->arr_len == 3);
    cr_assert(td_gguf_arr_int(kv, 0) == -7 && td_gguf_arr_int(kv, 2) == 2147483647);
    cr_assert(td_gguf_get_array(g, "af", TD_GGUF_F32, &kv) == TD_OK && td_gguf_arr_float(kv, 1) == -1e30f);
    cr_assert(td_gguf_get_array(g, "as", TD_GGUF_STRING, &kv) == TD_OK && kv->arr_len == 3);
    s = td_gguf_arr_str(kv, 2);
    cr_assert(s.len == 2 && !memcmp(s.data, "ü", 2));
    cr_assert_eq(td_gguf_kv_count(g), 8);
    const td_gguf_tensor_t *t;
    cr_assert_eq(td_gguf_tensor(g, "a", &t), TD_OK);
    cr_assert(t->nbytes == 12 && !memcmp(t->data, a, 12));
    cr_assert_eq(td_gguf_tensor(g, "b", &t), TD_OK);
    cr_assert(t->offset == 32 && t->nbytes == 68 && !memcmp(t->data, b, 68));
    td_gguf_close(g);

    /* short data: finish refuses, and destroy removes the file */
    cr_assert_eq(td_gguf_writer_create(path, &w), TD_OK);
    cr_assert_eq(td_gguf_writer_tensor(w, "a", 1, ne_a, TD_GGML_F32), TD_OK);
    cr_assert_eq(td_gguf_writer_begin(w), TD_OK);
    cr_assert_eq(td_gguf_writer_write(w, a, 8), TD_OK);
    cr_assert_eq(td_gguf_writer_finish(w), TD_ERR_INVALID);
    td_gguf_writer_destroy(w);
    cr_assert(!td_is_file(path));
}
