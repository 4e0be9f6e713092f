/*
 * Tests of td_model: the llama2.c loader against the real stories260K checkpoint (read
 * independently with fread), synth -> load round trips for every arch and dtype, sharded
 * models, determinism, the built-in tokenizer, config parsing, presets, the fingerprint,
 * and every malformed input we know of (each must fail with the right status and a
 * message naming the file, never crash or leak).
 */
#include <criterion/criterion.h>
#include <cjson/cJSON.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_model.h"
#include "td_safetensors.h"
#include "td_test_models.h"
#include "td_tokenizer.h"
#include "td_util.h"

/* ---- helpers ----------------------------------------------------------------------- */

static char tmp_root[256];

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void tmp_setup(void)
{
    snprintf(tmp_root, sizeof tmp_root, "/tmp/td_test_model_XXXXXX");
    cr_assert_not_null(mkdtemp(tmp_root));
}

static void tmp_teardown(void)
{
    if (tmp_root[0])
        nftw(tmp_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static const char *tmp_path(char *buf, size_t cap, const char *name)
{
    snprintf(buf, cap, "%s/%s", tmp_root, name);
    return buf;
}

static void write_str(const char *path, const char *s)
{
    td_test_write_file(path, s, strlen(s));
}

/* Prepends a UTF-8 byte-order mark to the file at path. */
static void prepend_bom(const char *path)
{
    char *text;
    cr_assert_eq(td_file_read_all(path, 64 << 20, &text, NULL), TD_OK, "%s", td_last_error());
    size_t n = strlen(text) + 4;
    char *bom = malloc(n);
    snprintf(bom, n, "\xef\xbb\xbf%s", text);
    write_str(path, bom);
    free(bom);
    free(text);
}


/* A safetensors file from a header text and `data_len` bytes of zeros. */
static void write_st_raw(const char *path, const char *header, size_t data_len)
{
    size_t hl = strlen(header);
    unsigned char *buf = calloc(1, 8 + hl + data_len);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, header, hl);
    td_test_write_file(path, buf, 8 + hl + data_len);
    free(buf);
}

static void expect_error(td_status_t got, td_status_t want, const char *needle1, const char *needle2)
{
    cr_assert_eq(got, want, "status %s, expected %s (last error: %s)", td_status_name(got), td_status_name(want),
                 td_last_error());
    if (needle1)
        cr_assert_not_null(strstr(td_last_error(), needle1), "error \"%s\" does not mention \"%s\"",
                           td_last_error(), needle1);
    if (needle2)
        cr_assert_not_null(strstr(td_last_error(), needle2), "error \"%s\" does not mention \"%s\"",
                           td_last_error(), needle2);
}

static td_status_t load_expect_fail(const char *path)
{
    td_model_t *m = NULL;
    td_clear_error();
    td_status_t s = td_model_load(path, &m);
    cr_assert_neq(s, TD_OK, "loading %s should fail", path);
    cr_assert_null(m);
    return s;
}

static float elem(const td_tensor_t *t, size_t i)
{
    switch (t->dtype) {
    case TD_F32: return ((const float *)t->data)[i];
    case TD_F16: return td_f16_to_f32(((const uint16_t *)t->data)[i]);
    case TD_BF16: return td_bf16_to_f32(((const uint16_t *)t->data)[i]);
    default: break; /* these tests load float models only */
    }
    return NAN;
}

static size_t nelem(const td_tensor_t *t)
{
    size_t n = 1;
    for (int i = 0; i < t->n_dims; i++)
        n *= (size_t)t->shape[i];
    return n;
}

static void synth(const char *dir, const char *preset, int arch, td_dtype_t dt, uint64_t seed, int shards)
{
    td_synth_params_t p;
    memset(&p, 0, sizeof p);
    cr_assert_eq(td_model_preset(preset, &p.config), TD_OK);
    if (arch >= 0)
        td_model_config_set_arch(&p.config, (td_arch_t)arch);
    p.dtype = dt;
    p.seed = seed;
    td_status_t s = td_model_synth_shards(&p, shards, dir, NULL);
    cr_assert_eq(s, TD_OK, "synth failed: %s", td_last_error());
}

/* A minimal 1-layer llama config for hand-built safetensors. */
static const char *micro_config =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 8, \"intermediate_size\": 16,"
    " \"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_key_value_heads\": 1,"
    " \"vocab_size\": 32, \"max_position_embeddings\": 64, \"tie_word_embeddings\": true}";

/* Writes a micro model: every tensor zero, optionally one left out, one with a wrong
 * shape, or one in another dtype. */
static void write_micro_ex(const char *dir, const char *skip, const char *bad_shape, const char *i8_tensor,
                           bool misalign)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_str(p, micro_config);
    const struct {
        const char *name;
        int64_t d0, d1;
    } t[] = {
        {"model.embed_tokens.weight", 32, 8},
        {"model.layers.0.input_layernorm.weight", 8, 0},
        {"model.layers.0.self_attn.q_proj.weight", 8, 8},
        {"model.layers.0.self_attn.k_proj.weight", 4, 8},
        {"model.layers.0.self_attn.v_proj.weight", 4, 8},
        {"model.layers.0.self_attn.o_proj.weight", 8, 8},
        {"model.layers.0.post_attention_layernorm.weight", 8, 0},
        {"model.layers.0.mlp.gate_proj.weight", 16, 8},
        {"model.layers.0.mlp.up_proj.weight", 16, 8},
        {"model.layers.0.mlp.down_proj.weight", 8, 16},
        {"model.norm.weight", 8, 0},
    };
    cJSON *h = cJSON_CreateObject();
    size_t off = 0;
    if (misalign) {
        /* a tensor the engine ignores (with a warning) stands in for the unpadded header */
        cJSON_AddItemToObject(h, "model.layers.0.self_attn.rotary_emb.inv_freq",
                              cJSON_Parse("{\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]}"));
        off = 1;
    }
    for (size_t i = 0; i < TD_ARRAY_LEN(t); i++) {
        if (skip && !strcmp(skip, t[i].name))
            continue;
        int64_t d0 = t[i].d0, d1 = t[i].d1;
        if (bad_shape && !strcmp(bad_shape, t[i].name))
            d0 *= 2;
        bool i8 = i8_tensor && !strcmp(i8_tensor, t[i].name);
        size_t n = (size_t)d0 * (size_t)(d1 ? d1 : 1) * (i8 ? 1 : 4);
        cJSON *e = cJSON_AddObjectToObject(h, t[i].name);
        cJSON_AddStringToObject(e, "dtype", i8 ? "I8" : "F32");
        cJSON *sh = cJSON_AddArrayToObject(e, "shape");
        cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)d0));
        if (d1)
            cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)d1));
        cJSON *o = cJSON_AddArrayToObject(e, "data_offsets");
        cJSON_AddItemToArray(o, cJSON_CreateNumber((double)off));
        cJSON_AddItemToArray(o, cJSON_CreateNumber((double)(off + n)));
        off += n;
    }
    char *text = cJSON_PrintUnformatted(h);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    write_st_raw(p, text, off);
    free(text);
    cJSON_Delete(h);
}

static void write_micro(const char *dir, const char *skip, const char *bad_shape, const char *i8_tensor)
{
    write_micro_ex(dir, skip, bad_shape, i8_tensor, false);
}

static void make_dir(char *out, size_t cap, const char *name)
{
    tmp_path(out, cap, name);
    cr_assert_eq(mkdir(out, 0777), 0, "mkdir %s", out);
}

/* The shape of a config, as one expectation per model. */
typedef struct dims {
    int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size, max_seq_len;
} dims_t;

static void expect_dims(const td_model_config_t *c, dims_t w)
{
    cr_expect_eq(c->dim, w.dim, "dim %d, want %d", c->dim, w.dim);
    cr_expect_eq(c->hidden_dim, w.hidden_dim, "hidden_dim %d, want %d", c->hidden_dim, w.hidden_dim);
    cr_expect_eq(c->n_layers, w.n_layers, "n_layers %d, want %d", c->n_layers, w.n_layers);
    cr_expect_eq(c->n_heads, w.n_heads, "n_heads %d, want %d", c->n_heads, w.n_heads);
    cr_expect_eq(c->n_kv_heads, w.n_kv_heads, "n_kv_heads %d, want %d", c->n_kv_heads, w.n_kv_heads);
    cr_expect_eq(c->head_dim, w.head_dim, "head_dim %d, want %d", c->head_dim, w.head_dim);
    cr_expect_eq(c->vocab_size, w.vocab_size, "vocab_size %d, want %d", c->vocab_size, w.vocab_size);
    cr_expect_eq(c->max_seq_len, w.max_seq_len, "max_seq_len %d, want %d", c->max_seq_len, w.max_seq_len);
}

/* ---- llama2.c ---------------------------------------------------------------------- */

Test(model_llama2c, stories260k_config_and_views, .timeout = 30)
{
    char path[1024];
    td_test_model_file("stories260K/stories260K.bin", path, sizeof path);
    td_model_t *m;
    cr_assert_eq(td_model_load(path, &m), TD_OK, "%s", td_last_error());
    const td_model_config_t *c = &m->config;
    cr_expect_eq(c->arch, TD_ARCH_LLAMA);
    cr_expect_str_eq(c->arch_name, "llama2.c");
    expect_dims(c, (dims_t){.dim = 64, .hidden_dim = 172, .n_layers = 5, .n_heads = 8, .n_kv_heads = 4,
                            .head_dim = 8, .vocab_size = 512, .max_seq_len = 512});
    cr_expect_eq(c->rope_style, TD_ROPE_PAIRS);
    cr_expect_float_eq(c->rope_theta, 10000.0f, 1e-3);
    cr_expect_float_eq(c->norm_eps, 1e-5f, 1e-12);
    cr_expect(c->tie_embeddings);
    cr_expect_eq(c->dtype, TD_F32);
    cr_expect_eq(c->bos_id, 1);
    cr_expect_eq(c->n_eos, 1);
    cr_expect_eq(c->eos_ids[0], 1);
    cr_expect_eq(m->fingerprint, td_model_fingerprint(c));
    cr_expect_eq(m->weights.lm_head.data, m->weights.embed.data);
    cr_expect_eq(m->weights.layers[4].wk.shape[0], 32);
    cr_expect_eq(m->weights.layers[4].wk.shape[1], 64);
    cr_expect_eq(m->weights.layers[0].w_down.shape[0], 64);
    cr_expect_eq(m->weights.layers[0].w_down.shape[1], 172);
    cr_expect_null(m->weights.layers[0].bq.data);
    cr_expect_null(m->weights.layers[0].q_norm.data);

    /* Offsets computed here from run.c's layout, read with plain fread. */
    const size_t L = 5, D = 64, F = 172, V = 512, KV = 32;
    const size_t o_embed = 0, o_att = o_embed + V * D, o_wq = o_att + L * D, o_wk = o_wq + L * D * D;
    const size_t o_wv = o_wk + L * KV * D, o_wo = o_wv + L * KV * D, o_ffn = o_wo + L * D * D;
    const size_t o_w1 = o_ffn + L * D, o_w2 = o_w1 + L * F * D, o_w3 = o_w2 + L * D * F, o_fin = o_w3 + L * F * D;
    const struct {
        const td_tensor_t *t;
        size_t file_float; /* float index after the header of the first element of the view */
    } checks[] = {
        {&m->weights.embed, o_embed},
        {&m->weights.layers[0].attn_norm, o_att},
        {&m->weights.layers[3].wq, o_wq + 3 * D * D},
        {&m->weights.layers[2].wk, o_wk + 2 * KV * D},
        {&m->weights.layers[4].wv, o_wv + 4 * KV * D},
        {&m->weights.layers[1].wo, o_wo + 1 * D * D},
        {&m->weights.layers[4].ffn_norm, o_ffn + 4 * D},
        {&m->weights.layers[2].w_gate, o_w1 + 2 * F * D},
        {&m->weights.layers[4].w_down, o_w2 + 4 * D * F},
        {&m->weights.layers[3].w_up, o_w3 + 3 * F * D},
        {&m->weights.final_norm, o_fin},
    };
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f);
    for (size_t i = 0; i < TD_ARRAY_LEN(checks); i++) {
        const td_tensor_t *t = checks[i].t;
        size_t n = nelem(t);
        float *buf = malloc(n * sizeof *buf);
        cr_assert_eq(fseek(f, (long)(28 + checks[i].file_float * 4), SEEK_SET), 0);
        cr_assert_eq(fread(buf, sizeof *buf, n, f), n);
        cr_expect_eq(memcmp(buf, t->data, n * sizeof *buf), 0, "check %zu: view differs from the file", i);
        free(buf);
    }
    fclose(f);
    /* RMSNorm weights of a trained model are O(1), embeddings small: a sanity check that
     * the views are not shifted into each other. */
    cr_expect(fabsf(elem(&m->weights.final_norm, 0)) > 0.05f);
    td_model_destroy(m);
}

Test(model_llama2c, unshared_classifier, .init = tmp_setup, .fini = tmp_teardown)
{
    /* dim 8, hidden 16, 1 layer, 2 heads, 1 kv head, vocab -16 (own classifier), seq 4 */
    const int32_t hdr[7] = {8, 16, 1, 2, 1, -16, 4};
    size_t nf = 16 * 8 + 8 + 8 * 8 + 4 * 8 * 2 + 8 * 8 + 8 + 16 * 8 * 3 + 8 + 4 * 2 * 2 + 16 * 8;
    float *w = malloc(nf * sizeof *w);
    for (size_t i = 0; i < nf; i++)
        w[i] = (float)i;
    char p[512];
    tmp_path(p, sizeof p, "m.bin");
    FILE *f = fopen(p, "wb");
    fwrite(hdr, sizeof hdr, 1, f);
    fwrite(w, sizeof *w, nf, f);
    fclose(f);
    td_model_t *m;
    cr_assert_eq(td_model_load(p, &m), TD_OK, "%s", td_last_error());
    cr_expect_not(m->config.tie_embeddings);
    cr_expect_eq(m->config.vocab_size, 16);
    cr_expect_neq(m->weights.lm_head.data, m->weights.embed.data);
    cr_expect_float_eq(elem(&m->weights.lm_head, 0), (float)(nf - 16 * 8), 0);
    cr_expect_float_eq(elem(&m->weights.lm_head, 16 * 8 - 1), (float)(nf - 1), 0);
    cr_expect_float_eq(elem(&m->weights.final_norm, 0), (float)(nf - 16 * 8 - 4 * 2 * 2 - 8), 0);
    cr_expect_str_eq(m->tokenizer_path, "");
    td_model_destroy(m);

    /* A tokenizer.bin beside the checkpoint is found. */
    tmp_path(p, sizeof p, "tokenizer.bin");
    write_str(p, "x");
    tmp_path(p, sizeof p, "m.bin");
    cr_assert_eq(td_model_load(p, &m), TD_OK);
    cr_expect_not_null(strstr(m->tokenizer_path, "/tokenizer.bin"));
    td_model_destroy(m);

    /* One float short: truncated. */
    f = fopen(p, "wb");
    fwrite(hdr, sizeof hdr, 1, f);
    fwrite(w, sizeof *w, nf - 1, f);
    fclose(f);
    expect_error(load_expect_fail(p), TD_ERR_FORMAT, "m.bin", "truncated");
    free(w);
}

Test(model_llama2c, malformed_headers, .init = tmp_setup, .fini = tmp_teardown)
{
    char p[512];
    tmp_path(p, sizeof p, "bad.bin");
    write_str(p, "short");
    expect_error(load_expect_fail(p), TD_ERR_FORMAT, "bad.bin", "header");

    const int32_t zero_heads[7] = {64, 172, 5, 0, 4, 512, 512};
    td_test_write_file(p, zero_heads, sizeof zero_heads);
    expect_error(load_expect_fail(p), TD_ERR_FORMAT, "bad.bin", "n_heads");

    const int32_t not_div[7] = {64, 172, 5, 8, 3, 512, 512};
    td_test_write_file(p, not_div, sizeof not_div);
    expect_error(load_expect_fail(p), TD_ERR_FORMAT, "bad.bin", "divisible");

    const int32_t neg[7] = {64, -172, 5, 8, 4, 512, 512};
    td_test_write_file(p, neg, sizeof neg);
    expect_error(load_expect_fail(p), TD_ERR_FORMAT, "bad.bin", "is out of range [1, 16777216]");

    const int32_t huge[7] = {1 << 24, 1 << 24, 1 << 20, 1 << 16, 1 << 16, 1 << 24, 1 << 30};
    td_test_write_file(p, huge, sizeof huge);
    expect_error(load_expect_fail(p), TD_ERR_FORMAT, "bad.bin", NULL);

    tmp_path(p, sizeof p, "absent.bin");
    expect_error(load_expect_fail(p), TD_ERR_IO, "absent.bin", NULL);
}

/* ---- synth -> load ----------------------------------------------------------------- */

static void check_roundtrip(int arch, td_dtype_t dt, bool tie)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s-%s-%d", tmp_root, td_model_arch_name((td_arch_t)arch), td_dtype_name(dt), tie);
    td_synth_params_t p;
    memset(&p, 0, sizeof p);
    cr_assert_eq(td_model_preset("tiny", &p.config), TD_OK);
    td_model_config_set_arch(&p.config, (td_arch_t)arch);
    p.config.tie_embeddings = tie;
    p.dtype = dt;
    p.seed = 7;
    cr_assert_eq(td_model_synth(&p, dir, NULL), TD_OK, "%s", td_last_error());

    td_model_t *m;
    cr_assert_eq(td_model_load(dir, &m), TD_OK, "%s", td_last_error());
    const td_model_config_t *c = &m->config;
    cr_expect_eq(c->arch, arch);
    expect_dims(c, (dims_t){.dim = 64, .hidden_dim = 176, .n_layers = 4, .n_heads = 8, .n_kv_heads = 4,
                            .head_dim = 8, .vocab_size = 512, .max_seq_len = 2048});
    cr_expect_eq(c->rope_style, TD_ROPE_HALVES);
    cr_expect_eq(c->norm_eps, 1e-5f);
    cr_expect_eq(c->dtype, dt);
    cr_expect_eq(c->tie_embeddings, tie);
    cr_expect_eq(c->qkv_bias, arch == TD_ARCH_QWEN2);
    cr_expect_eq(c->qk_norm, arch == TD_ARCH_QWEN3);
    cr_expect_eq(c->bos_id, 256);
    cr_expect_eq(c->n_eos, 1);
    cr_expect_eq(c->eos_ids[0], 257);
    cr_expect_eq(m->fingerprint, td_model_fingerprint(&p.config), "fingerprint changed through the files");
    cr_expect_not_null(strstr(m->tokenizer_path, "/tokenizer.json"));
    for (int l = 0; l < 4; l++) {
        const td_layer_weights_t *w = &m->weights.layers[l];
        cr_expect_eq(w->bq.data != NULL, arch == TD_ARCH_QWEN2);
        cr_expect_eq(w->bv.data != NULL, arch == TD_ARCH_QWEN2);
        cr_expect_eq(w->q_norm.data != NULL, arch == TD_ARCH_QWEN3);
        cr_expect_eq(w->k_norm.data != NULL, arch == TD_ARCH_QWEN3);
        if (arch == TD_ARCH_QWEN2)
            cr_expect_eq(w->bk.shape[0], 32);
        if (arch == TD_ARCH_QWEN3)
            cr_expect_eq(w->k_norm.shape[0], 8);
        cr_expect_eq(w->w_down.shape[0], 64);
        cr_expect_eq(w->w_down.shape[1], 176);
        cr_expect_eq(w->wq.dtype, dt);
        cr_expect_float_eq(elem(&w->attn_norm, 5), 1.0f, 0);
        cr_expect_float_eq(elem(&w->ffn_norm, 63), 1.0f, 0);
    }
    cr_expect_eq(m->weights.lm_head.data == m->weights.embed.data, tie);
    /* Weights look like N(0, 0.02). */
    const td_tensor_t *e = &m->weights.embed;
    double sum = 0, sq = 0;
    size_t n = nelem(e);
    for (size_t i = 0; i < n; i++) {
        double v = elem(e, i);
        sum += v;
        sq += v * v;
    }
    double mean = sum / (double)n, sd = sqrt(sq / (double)n - mean * mean);
    cr_expect(fabs(mean) < 0.001, "mean %g", mean);
    cr_expect(fabs(sd - 0.02) < 0.001, "std %g", sd);
    td_model_destroy(m);
}

Test(model_synth, roundtrip_every_arch_and_dtype, .init = tmp_setup, .fini = tmp_teardown, .timeout = 60)
{
    const int archs[] = {TD_ARCH_LLAMA, TD_ARCH_MISTRAL, TD_ARCH_QWEN2, TD_ARCH_QWEN3};
    for (size_t a = 0; a < TD_ARRAY_LEN(archs); a++)
        for (int dt = 0; dt < TD_DTYPE_FLOAT_COUNT; dt++)
            check_roundtrip(archs[a], (td_dtype_t)dt, (a + (size_t)dt) % 2 == 0);
    check_roundtrip(TD_ARCH_QWEN2, TD_BF16, true);
    check_roundtrip(TD_ARCH_QWEN2, TD_BF16, false);
}

Test(model_synth, deterministic_bytes_and_dtype_independent_values, .init = tmp_setup, .fini = tmp_teardown,
     .timeout = 60)
{
    char a[512], b[512], c[512], d[512], fa[600], fb[600], fc[600];
    tmp_path(a, sizeof a, "a");
    tmp_path(b, sizeof b, "b");
    tmp_path(c, sizeof c, "c");
    tmp_path(d, sizeof d, "d");
    synth(a, "tiny", -1, TD_BF16, 42, 1);
    synth(b, "tiny", -1, TD_BF16, 42, 1);
    synth(c, "tiny", -1, TD_BF16, 43, 1);
    synth(d, "tiny", -1, TD_F32, 42, 1);
    snprintf(fa, sizeof fa, "%s/model.safetensors", a);
    snprintf(fb, sizeof fb, "%s/model.safetensors", b);
    snprintf(fc, sizeof fc, "%s/model.safetensors", c);
    char *da, *db, *dc;
    size_t la, lb, lc;
    cr_assert_eq(td_file_read_all(fa, 1 << 26, &da, &la), TD_OK);
    cr_assert_eq(td_file_read_all(fb, 1 << 26, &db, &lb), TD_OK);
    cr_assert_eq(td_file_read_all(fc, 1 << 26, &dc, &lc), TD_OK);
    cr_expect_eq(la, lb);
    cr_expect_eq(memcmp(da, db, la), 0, "same seed, different bytes");
    cr_expect_eq(la, lc);
    cr_expect_neq(memcmp(da, dc, la), 0, "different seeds, same bytes");
    free(da);
    free(db);
    free(dc);

    /* The same seed in f32 and bf16: the bf16 values are the f32 values rounded. */
    td_model_t *m16, *m32;
    cr_assert_eq(td_model_load(a, &m16), TD_OK);
    cr_assert_eq(td_model_load(d, &m32), TD_OK);
    const td_tensor_t *t16 = &m16->weights.layers[2].w_up, *t32 = &m32->weights.layers[2].w_up;
    size_t n = nelem(t16), bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += ((const uint16_t *)t16->data)[i] != td_f32_to_bf16(((const float *)t32->data)[i]);
    cr_expect_eq(bad, 0, "%zu of %zu bf16 values are not the rounded f32 values", bad, n);
    td_model_destroy(m16);
    td_model_destroy(m32);
}

/* config.json is written last: a synth that fails while writing weights leaves none, even
   over a whole model an earlier run wrote there, so no half-written model looks complete */
Test(model_synth, failed_write_leaves_no_config, .init = tmp_setup, .fini = tmp_teardown, .timeout = 60)
{
    char dir[512], p[600];
    tmp_path(dir, sizeof dir, "m");
    synth(dir, "tiny", TD_ARCH_LLAMA, TD_F32, 1, 1);
    snprintf(p, sizeof p, "%s/config.json", dir);
    cr_assert(td_is_file(p));
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    cr_assert_eq(unlink(p), 0);
    cr_assert_eq(mkdir(p, 0755), 0); /* the weights cannot be written */
    td_synth_params_t sp = {.seed = 1, .dtype = TD_F32};
    cr_assert_eq(td_model_preset("tiny", &sp.config), TD_OK);
    cr_assert_neq(td_model_synth(&sp, dir, NULL), TD_OK);
    snprintf(p, sizeof p, "%s/config.json", dir);
    cr_expect_not(td_is_file(p), "a failed synth left config.json");
    td_model_t *m = NULL;
    cr_expect_neq(td_model_load(dir, &m), TD_OK);
}

Test(model_synth, sharded_matches_single_file, .init = tmp_setup, .fini = tmp_teardown, .timeout = 60)
{
    char one[512], three[512], p[600];
    tmp_path(one, sizeof one, "one");
    tmp_path(three, sizeof three, "three");
    synth(one, "tiny", TD_ARCH_QWEN2, TD_F16, 5, 1);
    synth(three, "tiny", TD_ARCH_QWEN2, TD_F16, 5, 3);
    snprintf(p, sizeof p, "%s/model.safetensors", three);
    cr_expect_not(td_is_file(p));
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", three);
    cr_expect(td_is_file(p));
    for (int i = 1; i <= 3; i++) {
        snprintf(p, sizeof p, "%s/model-%05d-of-00003.safetensors", three, i);
        cr_expect(td_is_file(p), "%s missing", p);
    }
    td_model_t *a, *b;
    cr_assert_eq(td_model_load(one, &a), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_model_load(three, &b), TD_OK, "%s", td_last_error());
    cr_expect_eq(a->fingerprint, b->fingerprint);
    for (int l = 0; l < 4; l++) {
        const td_tensor_t *ta[] = {&a->weights.layers[l].wq, &a->weights.layers[l].bk, &a->weights.layers[l].w_down};
        const td_tensor_t *tb[] = {&b->weights.layers[l].wq, &b->weights.layers[l].bk, &b->weights.layers[l].w_down};
        for (int k = 0; k < 3; k++)
            cr_expect_eq(memcmp(ta[k]->data, tb[k]->data, nelem(ta[k]) * 2), 0, "layer %d tensor %d differs", l, k);
    }
    cr_expect_eq(memcmp(a->weights.lm_head.data, b->weights.lm_head.data, nelem(&a->weights.lm_head) * 2), 0);
    td_model_destroy(a);
    td_model_destroy(b);

    /* Re-synthesizing unsharded into the same directory leaves no index to shadow it. */
    synth(three, "tiny", TD_ARCH_QWEN2, TD_F16, 6, 1);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", three);
    cr_expect_not(td_is_file(p));
    cr_assert_eq(td_model_load(three, &b), TD_OK, "%s", td_last_error());
    td_model_destroy(b);
}

Test(model_synth, builtin_tokenizer_files, .init = tmp_setup, .fini = tmp_teardown)
{
    char dir[512], p[600];
    tmp_path(dir, sizeof dir, "tok");
    synth(dir, "tiny", -1, TD_F32, 1, 1);
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    char *text;
    cr_assert_eq(td_file_read_all(p, 1 << 20, &text, NULL), TD_OK);
    cJSON *root = cJSON_Parse(text);
    free(text);
    cr_assert_not_null(root);
    cJSON *model = cJSON_GetObjectItem(root, "model");
    cr_expect_str_eq(cJSON_GetObjectItem(model, "type")->valuestring, "BPE");
    cJSON *vocab = cJSON_GetObjectItem(model, "vocab");
    cr_expect_eq(cJSON_GetArraySize(vocab), 256);
    cr_expect_eq(cJSON_GetObjectItemCaseSensitive(vocab, "a")->valueint, 'a');
    cr_expect_eq(cJSON_GetObjectItemCaseSensitive(vocab, "\xc4\xa0")->valueint, ' '); /* U+0120 is the space byte */
    cr_expect_eq(cJSON_GetObjectItemCaseSensitive(vocab, "\xc4\x80")->valueint, 0);   /* U+0100 is byte 0 */
    cr_expect_eq(cJSON_GetArraySize(cJSON_GetObjectItem(model, "merges")), 0);
    cJSON *added = cJSON_GetObjectItem(root, "added_tokens");
    cr_expect_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(added, 0), "id")->valueint, 256);
    cr_expect_str_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(added, 1), "content")->valuestring, "</s>");
    cJSON *pre = cJSON_GetObjectItem(root, "pre_tokenizer");
    cr_expect_str_eq(cJSON_GetObjectItem(pre, "type")->valuestring, "ByteLevel");
    cr_expect(cJSON_IsFalse(cJSON_GetObjectItem(pre, "add_prefix_space")));
    cJSON_Delete(root);
    snprintf(p, sizeof p, "%s/tokenizer_config.json", dir);
    cr_assert_eq(td_file_read_all(p, 1 << 20, &text, NULL), TD_OK);
    root = cJSON_Parse(text);
    free(text);
    cr_expect_str_eq(cJSON_GetObjectItem(root, "bos_token")->valuestring, "<s>");
    cr_expect_str_eq(cJSON_GetObjectItem(root, "eos_token")->valuestring, "</s>");
    cJSON_Delete(root);

    /* A vocabulary too small for it is refused up front, writing nothing. */
    td_synth_params_t sp;
    memset(&sp, 0, sizeof sp);
    td_model_preset("tiny", &sp.config);
    sp.config.vocab_size = 200;
    tmp_path(dir, sizeof dir, "small-vocab");
    td_clear_error();
    expect_error(td_model_synth(&sp, dir, NULL), TD_ERR_INVALID, "258", NULL);
    cr_expect_not(td_is_dir(dir));

    /* A given tokenizer is copied instead. */
    tmp_path(p, sizeof p, "tokenizer.json");
    write_str(p, "{\"model\": {}}");
    sp.config.vocab_size = 512;
    cr_assert_eq(td_model_synth(&sp, dir, p), TD_OK, "%s", td_last_error());
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    cr_assert_eq(td_file_read_all(p, 1 << 20, &text, NULL), TD_OK);
    cr_expect_str_eq(text, "{\"model\": {}}");
    free(text);
}

Test(model_synth, builtin_tokenizer_loads_in_the_tokenizer_module, .init = tmp_setup, .fini = tmp_teardown)
{
    char dir[512];
    tmp_path(dir, sizeof dir, "tokmod");
    synth(dir, "tiny", -1, TD_F32, 1, 1);
    td_model_t *m;
    cr_assert_eq(td_model_load(dir, &m), TD_OK, "%s", td_last_error());
    td_tokenizer_t *tok;
    cr_assert_eq(td_tokenizer_load(m->tokenizer_path, &tok), TD_OK, "%s", td_last_error());
    cr_expect_eq(td_tokenizer_bos_id(tok), m->config.bos_id);
    cr_expect(td_tokenizer_is_eos(tok, m->config.eos_ids[0]));
    cr_expect_leq(td_tokenizer_vocab_size(tok), m->config.vocab_size);
    const char *text = "h\xc3\xa9llo \n";
    int32_t *ids;
    size_t n;
    cr_assert_eq(td_tokenizer_encode(tok, text, strlen(text), TD_TOK_ADD_BOS, &ids, &n), TD_OK, "%s",
                 td_last_error());
    const int32_t want[] = {256, 'h', 0xc3, 0xa9, 'l', 'l', 'o', ' ', '\n'};
    cr_assert_eq(n, TD_ARRAY_LEN(want));
    for (size_t i = 0; i < n; i++)
        cr_expect_eq(ids[i], want[i], "id %zu: %d, expected %d", i, ids[i], want[i]);
    char *back;
    cr_assert_eq(td_tokenizer_decode(tok, ids, n, &back, NULL), TD_OK);
    cr_expect_str_eq(back, text);
    free(back);
    free(ids);
    td_tokenizer_destroy(tok);
    td_model_destroy(m);
}

/* ---- config, presets, fingerprint -------------------------------------------------- */

Test(model_config, parses_llama3_qwen3_and_generation_config, .init = tmp_setup, .fini = tmp_teardown)
{
    td_model_config_t c;
    const char *llama3 =
        "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 2048, \"intermediate_size\": 8192,"
        " \"num_hidden_layers\": 16, \"num_attention_heads\": 32, \"num_key_value_heads\": 8,"
        " \"vocab_size\": 128256, \"max_position_embeddings\": 131072, \"rms_norm_eps\": 1e-05,"
        " \"rope_theta\": 500000.0, \"rope_scaling\": {\"factor\": 32.0, \"high_freq_factor\": 4.0,"
        " \"low_freq_factor\": 1.0, \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"},"
        " \"tie_word_embeddings\": true, \"bos_token_id\": 128000, \"eos_token_id\": [128001, 128008, 128009],"
        " \"torch_dtype\": \"bfloat16\", \"hidden_act\": \"silu\"}";
    cr_assert_eq(td_model_config_from_json(llama3, "config.json", &c), TD_OK, "%s", td_last_error());
    td_model_config_t preset;
    cr_assert_eq(td_model_preset("llama-3.2-1b", &preset), TD_OK);
    cr_expect(c.rope_llama3);
    cr_expect_eq(c.rope_factor, 32.0f);
    cr_expect_eq(c.rope_original_max_pos, 8192);
    cr_expect_eq(c.head_dim, 64);
    cr_expect_eq(c.n_eos, 3);
    cr_expect_eq(c.eos_ids[2], 128009);
    cr_expect_eq(c.dtype, TD_BF16);
    cr_expect_eq(td_model_fingerprint(&c), td_model_fingerprint(&preset), "preset differs from its config.json");

    const char *qwen3 =
        "{\"architectures\": [\"Qwen3ForCausalLM\"], \"hidden_size\": 1024, \"intermediate_size\": 3072,"
        " \"num_hidden_layers\": 28, \"num_attention_heads\": 16, \"num_key_value_heads\": 8, \"head_dim\": 128,"
        " \"vocab_size\": 151936, \"max_position_embeddings\": 40960, \"rms_norm_eps\": 1e-06,"
        " \"rope_theta\": 1000000, \"rope_scaling\": null, \"tie_word_embeddings\": true,"
        " \"sliding_window\": null, \"use_sliding_window\": false, \"attention_bias\": false,"
        " \"bos_token_id\": 151643, \"eos_token_id\": 151645}";
    cr_assert_eq(td_model_config_from_json(qwen3, "config.json", &c), TD_OK, "%s", td_last_error());
    cr_expect_eq(c.head_dim, 128);
    cr_expect(c.qk_norm);
    cr_expect_not(c.qkv_bias);
    cr_assert_eq(td_model_preset("qwen3-0.6b", &preset), TD_OK);
    cr_expect_eq(td_model_fingerprint(&c), td_model_fingerprint(&preset));

    /* Mistral's sliding window is an attention mask on every layer, not a context limit */
    const char *mistral =
        "{\"architectures\": [\"MistralForCausalLM\"], \"hidden_size\": 4096, \"intermediate_size\": 14336,"
        " \"num_hidden_layers\": 32, \"num_attention_heads\": 32, \"num_key_value_heads\": 8,"
        " \"vocab_size\": 32000, \"max_position_embeddings\": 32768, \"sliding_window\": 4096,"
        " \"rms_norm_eps\": 1e-05, \"rope_theta\": 10000.0}";
    cr_assert_eq(td_model_config_from_json(mistral, "config.json", &c), TD_OK, "%s", td_last_error());
    cr_expect_eq(c.max_seq_len, 32768);
    cr_expect_eq(c.sliding_window, 4096);
    cr_expect_eq(td_model_layer_window(&c, 0), 4096);
    cr_expect_eq(td_model_layer_window(&c, 31), 4096);
    cr_expect_eq(td_model_kv_window(&c), 4096);
    cr_assert_eq(td_model_preset("mistral-7b", &preset), TD_OK);
    cr_expect_eq(td_model_fingerprint(&c), td_model_fingerprint(&preset), "mistral-7b differs from its config.json");
    cr_expect_eq(c.bos_id, -1);
    cr_expect_eq(c.n_eos, 0);

    /* generation_config.json adds eos ids and supplies bos when config.json has none. */
    char dir[512], p[600];
    tmp_path(dir, sizeof dir, "gen");
    synth(dir, "tiny", -1, TD_F32, 1, 1);
    snprintf(p, sizeof p, "%s/generation_config.json", dir);
    write_str(p, "{\"bos_token_id\": 3, \"eos_token_id\": [257, 9, 10]}");
    td_model_t *m;
    cr_assert_eq(td_model_load(dir, &m), TD_OK, "%s", td_last_error());
    cr_expect_eq(m->config.bos_id, 256);
    cr_expect_eq(m->config.n_eos, 3);
    cr_expect_eq(m->config.eos_ids[1], 9);
    cr_expect_eq(m->config.eos_ids[2], 10);
    td_model_destroy(m);
    write_str(p, "{\"eos_token_id\": 100000}");
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "generation_config.json", NULL);
}

/* A valid llama config.json; config_errors breaks it one patch at a time. */
static const char *micro_llama =
    "{\"model_type\": \"llama\", \"hidden_size\": 8, \"intermediate_size\": 16, \"num_hidden_layers\": 1,"
    " \"num_attention_heads\": 2, \"vocab_size\": 32, \"max_position_embeddings\": 8}";

/* base with the keys of patch set (a null value removes the key); the caller frees. */
static char *json_patched(const char *base, const char *patch)
{
    cJSON *b = cJSON_Parse(base), *p = cJSON_Parse(patch);
    cr_assert(b && cJSON_IsObject(p), "test JSON does not parse: %s", patch);
    for (cJSON *it = p->child; it; it = it->next) {
        cJSON_DeleteItemFromObjectCaseSensitive(b, it->string);
        if (!cJSON_IsNull(it))
            cJSON_AddItemToObject(b, it->string, cJSON_Duplicate(it, true));
    }
    char *out = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    cJSON_Delete(p);
    cr_assert_not_null(out);
    return out;
}

Test(model_config, config_errors)
{
    td_model_config_t c;
    cr_assert_eq(td_model_config_from_json(micro_llama, "config.json", &c), TD_OK, "the unpatched base: %s",
                 td_last_error());
    static const struct {
        const char *json;  /* the whole config.json, or NULL: micro_llama with patch */
        const char *patch;
        td_status_t want;
        const char *needle;
    } cases[] = {
        {"{not json", NULL, TD_ERR_FORMAT, "JSON"},
        {"[]", NULL, TD_ERR_FORMAT, "JSON"},
        {"{\"architectures\": [\"GPT2LMHeadModel\"]}", NULL, TD_ERR_UNSUPPORTED, "GPT2LMHeadModel"},
        {"{\"hidden_size\": 8}", NULL, TD_ERR_FORMAT, "architectures"},
        {NULL, "{\"hidden_size\": null}", TD_ERR_FORMAT, "hidden_size"},
        {NULL, "{\"intermediate_size\": 0}", TD_ERR_FORMAT, "intermediate_size 0 is out of range: an integer in [1, "},
        /* numbers beyond their type, by name with the range */
        {NULL, "{\"rope_theta\": 1e39}", TD_ERR_FORMAT, "rope_theta 1e+39 is out of range (0, 3.4e+38]"},
        {NULL, "{\"rope_theta\": -5}", TD_ERR_FORMAT, "rope_theta -5 is out of range (0, 3.4e+38]"},
        {NULL, "{\"rms_norm_eps\": 1e-50}", TD_ERR_FORMAT, "rms_norm_eps 1e-50 is out of range (0, 3.4e+38]"},
        {NULL, "{\"hidden_size\": 4294967304}", TD_ERR_FORMAT,
         "hidden_size 4294967304 is out of range: an integer in [1, 16777216]"},
        {NULL, "{\"num_hidden_layers\": -1}", TD_ERR_FORMAT,
         "num_hidden_layers -1 is out of range: an integer in [1, "},
        {NULL, "{\"vocab_size\": 2.5}", TD_ERR_FORMAT, "vocab_size 2.5 is out of range"},
        {NULL, "{\"max_position_embeddings\": 2147483647}", TD_ERR_FORMAT,
         "max_position_embeddings 2147483647 is out of range: an integer in [1, 16777216]"},
        {NULL, "{\"bos_token_id\": 3e10}", TD_ERR_FORMAT,
         "bos_token_id 30000000000 is out of range: an integer in [-1, 2147483647]"},
        {NULL, "{\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 1e40, \"low_freq_factor\": 1, "
               "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 8}}", TD_ERR_FORMAT,
         "factor 1e+40 is out of range (0, 3.4e+38]"},
        {"", NULL, TD_ERR_FORMAT, "empty file"},
        {NULL, "{\"num_attention_heads\": 4, \"num_key_value_heads\": 3}", TD_ERR_FORMAT, "divisible"},
        {NULL, "{\"hidden_size\": 9}", TD_ERR_FORMAT, "divisible"},
        {NULL, "{\"hidden_size\": \"8\"}", TD_ERR_FORMAT, "hidden_size"},
        {NULL, "{\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4}}", TD_ERR_UNSUPPORTED, "yarn"},
        {NULL, "{\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 4}}", TD_ERR_FORMAT, "low_freq_factor"},
        {NULL, "{\"eos_token_id\": 32}", TD_ERR_FORMAT, "eos_token_id"},
        {NULL, "{\"hidden_act\": \"gelu\"}", TD_ERR_UNSUPPORTED, "hidden_act"},
        {NULL, "{\"hidden_size\": 12, \"num_attention_heads\": 4}", TD_ERR_FORMAT, "even"},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(cases); i++) {
        char *patched = cases[i].json ? NULL : json_patched(micro_llama, cases[i].patch);
        const char *json = cases[i].json ? cases[i].json : patched;
        td_clear_error();
        memset(&c, 0x5a, sizeof c);
        td_model_config_t before = c;
        td_status_t s = td_model_config_from_json(json, "cfg-origin.json", &c);
        cr_expect_eq(s, cases[i].want, "case %zu (%s): %s, expected %s (%s)", i, json, td_status_name(s),
                     td_status_name(cases[i].want), td_last_error());
        cr_expect_not_null(strstr(td_last_error(), "cfg-origin.json"), "case %zu: %s", i, td_last_error());
        cr_expect_not_null(strstr(td_last_error(), cases[i].needle), "case %zu: \"%s\" lacks \"%s\"", i,
                           td_last_error(), cases[i].needle);
        cr_expect_eq(memcmp(&c, &before, sizeof c), 0, "case %zu: output written on failure", i);
        cJSON_free(patched);
    }
}

Test(model_config, presets_have_their_real_sizes)
{
    static const struct {
        const char *name;
        uint64_t params;
    } known[] = {
        /* parameter counts published with each model */
        {"tinyllama-1.1b", 1100048384ull},
        {"llama-3.2-1b", 1235814400ull},
        {"llama-3-8b", 8030261248ull},
        {"qwen2-7b", 7615616512ull},
        {"qwen3-0.6b", 596049920ull},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(known); i++) {
        td_model_config_t c;
        cr_assert_eq(td_model_preset(known[i].name, &c), TD_OK);
        cr_expect_eq(td_model_config_validate(&c, known[i].name), TD_OK);
        cr_expect_eq(td_model_param_count(&c), known[i].params, "%s: %llu parameters", known[i].name,
                     (unsigned long long)td_model_param_count(&c));
    }
    for (int i = 0; td_model_preset_names[i]; i++) {
        td_model_config_t c;
        cr_expect_eq(td_model_preset(td_model_preset_names[i], &c), TD_OK);
        cr_expect_eq(td_model_config_validate(&c, "preset"), TD_OK, "%s", td_last_error());
    }
    td_model_config_t c;
    cr_expect_eq(td_model_preset("gpt-5", &c), TD_ERR_NOT_FOUND);
    cr_assert_eq(td_model_preset("llama-3-8b", &c), TD_OK);
    /* 32 layers x 8 kv heads x 128 x K,V x 2 bytes */
    cr_expect_eq(td_model_kv_bytes_per_token(&c, TD_BF16), 131072u);
}

Test(model_config, fingerprint_tracks_shape_not_storage)
{
    td_model_config_t base, c;
    cr_assert_eq(td_model_preset("tiny", &base), TD_OK);
    uint64_t fp = td_model_fingerprint(&base);
    /* Pinned: nodes of different builds must agree. Change only with the tag in the hash. */
    cr_expect_eq(fp, 0x496c1d899c816671ull, "tiny fingerprint %016llx", (unsigned long long)fp);
    cr_assert_eq(td_model_preset("llama-3-8b", &c), TD_OK);
    cr_expect_eq(td_model_fingerprint(&c), 0x685fd902fdb5b517ull);

#define DIFFERS(field, value)                                                                         \
    do {                                                                                              \
        c = base;                                                                                     \
        c.field = value;                                                                              \
        cr_expect_neq(td_model_fingerprint(&c), fp, "changing " #field " kept the fingerprint");      \
    } while (0)
#define SAME(field, value)                                                                            \
    do {                                                                                              \
        c = base;                                                                                     \
        c.field = value;                                                                              \
        cr_expect_eq(td_model_fingerprint(&c), fp, "changing " #field " changed the fingerprint");     \
    } while (0)
    DIFFERS(dim, 128);
    DIFFERS(hidden_dim, 177);
    DIFFERS(n_layers, 5);
    DIFFERS(n_heads, 16);
    DIFFERS(n_kv_heads, 2);
    DIFFERS(head_dim, 16);
    DIFFERS(vocab_size, 513);
    DIFFERS(norm_eps, 1e-6f);
    DIFFERS(rope_theta, 500000.0f);
    DIFFERS(rope_style, TD_ROPE_PAIRS);
    DIFFERS(rope_llama3, true);
    DIFFERS(arch, TD_ARCH_QWEN2);
    DIFFERS(qk_norm, true);
    DIFFERS(tie_embeddings, true);
    SAME(dtype, TD_F16);
    SAME(max_seq_len, 4096);
    SAME(bos_id, 1);
    SAME(eos_ids[0], 2);
    c = base;
    snprintf(c.arch_name, sizeof c.arch_name, "llama2.c");
    cr_expect_eq(td_model_fingerprint(&c), fp);
#undef DIFFERS
#undef SAME
}

/* A micro Mistral/Qwen config.json of 4 layers with `extra` keys spliced in. */
static td_status_t window_config(const char *arch, const char *extra, td_model_config_t *c)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"architectures\": [\"%s\"], \"hidden_size\": 8, \"intermediate_size\": 16,"
             " \"num_hidden_layers\": 4, \"num_attention_heads\": 2, \"vocab_size\": 32,"
             " \"max_position_embeddings\": 4096%s%s}", arch, *extra ? ", " : "", extra);
    return td_model_config_from_json(json, "cfg-origin.json", c);
}

/* The sliding window by each arch's rules (Mistral: every layer; Qwen: use_sliding_window
   and max_window_layers; layer_types wins), the context limit left alone, bad values named,
   and config.json / GGUF written back with the same windows. */
Test(model_config, sliding_window_per_layer, .init = tmp_setup, .fini = tmp_teardown)
{
    static const struct {
        const char *arch, *extra;
        int32_t window;
        unsigned layers; /* bit l: layer l slides */
    } ok[] = {
        {"MistralForCausalLM", "\"sliding_window\": 100", 100, 0xf},
        {"MistralForCausalLM", "\"sliding_window\": null", 0, 0},
        {"MistralForCausalLM", "", 0, 0},
        {"Qwen2ForCausalLM", "\"use_sliding_window\": true, \"sliding_window\": 64, \"max_window_layers\": 1", 64, 0xe},
        {"Qwen2ForCausalLM", "\"use_sliding_window\": false, \"sliding_window\": 64, \"max_window_layers\": 1", 0, 0},
        /* HF's default max_window_layers (28) is past these 4 layers: no layer slides */
        {"Qwen2ForCausalLM", "\"use_sliding_window\": true, \"sliding_window\": 64", 0, 0},
        {"Qwen3ForCausalLM", "\"use_sliding_window\": true, \"sliding_window\": 8, \"max_window_layers\": 0, "
         "\"layer_types\": [\"full_attention\", \"sliding_attention\", \"full_attention\", \"sliding_attention\"]",
         8, 0xa},
        {"MistralForCausalLM", "\"sliding_window\": 16, \"layer_types\": [\"sliding_attention\", "
         "\"sliding_attention\", \"sliding_attention\", \"full_attention\"]", 16, 0x7},
        /* Llama has no window: the key is ignored, as transformers ignores it */
        {"LlamaForCausalLM", "\"sliding_window\": 100", 0, 0},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(ok); i++) {
        td_model_config_t c;
        cr_assert_eq(window_config(ok[i].arch, ok[i].extra, &c), TD_OK, "case %zu: %s", i, td_last_error());
        cr_expect_eq(c.max_seq_len, 4096, "case %zu: the window changed the context limit", i);
        cr_expect_eq(c.sliding_window, ok[i].window, "case %zu", i);
        for (int32_t l = 0; l < 4; l++)
            cr_expect_eq(td_model_layer_window(&c, l), (ok[i].layers >> l) & 1 ? ok[i].window : 0,
                         "case %zu layer %d", i, l);
        cr_expect_eq(td_model_kv_window(&c), ok[i].layers == 0xf ? ok[i].window : 0, "case %zu", i);
        /* written back and read again: the same windows, the same fingerprint */
        char *json = NULL;
        cr_assert_eq(td_model_config_to_json(&c, TD_BF16, &json), TD_OK, "case %zu: %s", i, td_last_error());
        td_model_config_t back;
        cr_assert_eq(td_model_config_from_json(json, "written", &back), TD_OK, "case %zu: %s\n%s", i,
                     td_last_error(), json);
        cr_expect_eq(back.sliding_window, c.sliding_window, "case %zu: %s", i, json);
        cr_expect_eq(memcmp(back.swa_layers, c.swa_layers, sizeof c.swa_layers), 0, "case %zu: %s", i, json);
        cr_expect_eq(td_model_fingerprint(&back), td_model_fingerprint(&c), "case %zu", i);
        free(json);
    }

    static const struct {
        const char *arch, *extra;
        td_status_t want;
        const char *needle;
    } bad[] = {
        {"MistralForCausalLM", "\"sliding_window\": 0", TD_ERR_FORMAT, "sliding_window 0 is out of range"},
        {"MistralForCausalLM", "\"sliding_window\": -4096", TD_ERR_FORMAT, "sliding_window -4096 is out of range"},
        {"MistralForCausalLM", "\"sliding_window\": 1e12", TD_ERR_FORMAT, "sliding_window 1000000000000 is out of range"},
        {"MistralForCausalLM", "\"sliding_window\": 40.5", TD_ERR_FORMAT, "sliding_window 40.5"},
        {"MistralForCausalLM", "\"sliding_window\": \"4096\"", TD_ERR_FORMAT, "\"sliding_window\" must be an integer"},
        {"Qwen2ForCausalLM", "\"use_sliding_window\": 1, \"sliding_window\": 64", TD_ERR_FORMAT, "use_sliding_window"},
        {"Qwen2ForCausalLM", "\"use_sliding_window\": true, \"sliding_window\": 64, \"max_window_layers\": -1",
         TD_ERR_FORMAT, "max_window_layers -1 is out of range"},
        {"MistralForCausalLM", "\"sliding_window\": 16, \"layer_types\": [\"sliding_attention\"]", TD_ERR_FORMAT,
         "layer_types must list num_hidden_layers (4)"},
        {"MistralForCausalLM", "\"sliding_window\": 16, \"layer_types\": [\"sliding_attention\", \"chunked_attention\", "
         "\"full_attention\", \"full_attention\"]", TD_ERR_UNSUPPORTED, "layer_types[1]"},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(bad); i++) {
        td_model_config_t c;
        memset(&c, 0x5a, sizeof c);
        td_model_config_t before = c;
        td_clear_error();
        td_status_t s = window_config(bad[i].arch, bad[i].extra, &c);
        cr_expect_eq(s, bad[i].want, "bad case %zu: %s (%s)", i, td_status_name(s), td_last_error());
        cr_expect_not_null(strstr(td_last_error(), "cfg-origin.json"), "bad case %zu: %s", i, td_last_error());
        cr_expect_not_null(strstr(td_last_error(), bad[i].needle), "bad case %zu: \"%s\" lacks \"%s\"", i,
                           td_last_error(), bad[i].needle);
        cr_expect_eq(memcmp(&c, &before, sizeof c), 0, "bad case %zu: output written on failure", i);
    }

    /* the window is part of the math: it changes the fingerprint; tiny-swa is tiny with one */
    td_model_config_t tiny, swa;
    cr_assert_eq(td_model_preset("tiny", &tiny), TD_OK);
    cr_assert_eq(td_model_preset("tiny-swa", &swa), TD_OK);
    cr_expect_eq(swa.sliding_window, 40);
    cr_expect_eq(td_model_kv_window(&swa), 40);
    cr_expect_neq(td_model_fingerprint(&swa), td_model_fingerprint(&tiny));
    td_model_config_t other = swa;
    td_model_config_set_window(&other, 41);
    cr_expect_neq(td_model_fingerprint(&other), td_model_fingerprint(&swa));
    other = swa;
    other.swa_layers[0] &= ~1ull;
    cr_expect_neq(td_model_fingerprint(&other), td_model_fingerprint(&swa));
    cr_expect_eq(td_model_kv_window(&other), 0);

    /* a GGUF file carries it as mistral... llama.attention.sliding_window */
    char path[512];
    tmp_path(path, sizeof path, "swa.gguf");
    td_synth_params_t p;
    memset(&p, 0, sizeof p);
    p.config = swa;
    p.dtype = TD_F32;
    cr_assert_eq(td_model_synth_gguf(&p, path), TD_OK, "%s", td_last_error());
    td_model_t *m;
    cr_assert_eq(td_model_load(path, &m), TD_OK, "%s", td_last_error());
    cr_expect_eq(m->config.sliding_window, 40);
    cr_expect_eq(td_model_kv_window(&m->config), 40);
    cr_expect_eq(m->config.max_seq_len, swa.max_seq_len);
    td_model_destroy(m);
    /* a per-layer pattern has no GGUF key: refused, not dropped */
    p.config = other;
    p.config.sliding_window = 40;
    tmp_path(path, sizeof path, "swa2.gguf");
    cr_expect_eq(td_model_synth_gguf(&p, path), TD_ERR_UNSUPPORTED);
}

/* ---- malformed Hugging Face directories -------------------------------------------- */

Test(model_hf, micro_model_loads, .init = tmp_setup, .fini = tmp_teardown)
{
    char dir[512];
    make_dir(dir, sizeof dir, "micro");
    write_micro(dir, NULL, NULL, NULL);
    td_model_t *m;
    cr_assert_eq(td_model_load(dir, &m), TD_OK, "%s", td_last_error());
    cr_expect_eq(m->config.n_kv_heads, 1);
    cr_expect_eq(m->weights.lm_head.data, m->weights.embed.data);
    cr_expect_str_eq(m->tokenizer_path, "");
    td_model_destroy(m);
    /* Tensors at odd offsets (an unpadded header) come out aligned. */
    make_dir(dir, sizeof dir, "misaligned");
    write_micro_ex(dir, NULL, NULL, NULL, true);
    cr_assert_eq(td_model_load(dir, &m), TD_OK, "%s", td_last_error());
    cr_expect_eq((uintptr_t)m->weights.layers[0].wq.data % 4, 0);
    cr_expect_eq((uintptr_t)m->weights.embed.data % 4, 0);
    cr_expect_float_eq(elem(&m->weights.final_norm, 7), 0.0f, 0);
    td_model_destroy(m);
    /* A file of the directory stands for it. */
    char p[600];
    snprintf(p, sizeof p, "%s/config.json", dir);
    cr_assert_eq(td_model_load(p, &m), TD_OK, "%s", td_last_error());
    td_model_destroy(m);
}

Test(model_hf, tensor_errors, .init = tmp_setup, .fini = tmp_teardown)
{
    char dir[512];
    make_dir(dir, sizeof dir, "missing");
    write_micro(dir, "model.layers.0.mlp.up_proj.weight", NULL, NULL);
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "model.safetensors", "model.layers.0.mlp.up_proj.weight");

    make_dir(dir, sizeof dir, "shape");
    write_micro(dir, NULL, "model.layers.0.mlp.up_proj.weight", NULL);
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT,
                 "model.safetensors: tensor model.layers.0.mlp.up_proj.weight has shape [32, 8], config.json says "
                 "[16, 8]",
                 NULL);

    make_dir(dir, sizeof dir, "dtype");
    write_micro(dir, NULL, NULL, "model.layers.0.self_attn.k_proj.weight");
    expect_error(load_expect_fail(dir), TD_ERR_UNSUPPORTED, "model.safetensors", "k_proj.weight has dtype I8");

    make_dir(dir, sizeof dir, "untied");
    write_micro(dir, NULL, NULL, NULL);
    char p[600], cfg[1024];
    snprintf(p, sizeof p, "%s/config.json", dir);
    snprintf(cfg, sizeof cfg, "%.*s0}", (int)(strstr(micro_config, "true") - micro_config), micro_config);
    write_str(p, cfg); /* tie_word_embeddings: 0 is not a bool */
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "config.json", "tie_word_embeddings");
    snprintf(cfg, sizeof cfg, "%.*sfalse}", (int)(strstr(micro_config, "true") - micro_config), micro_config);
    write_str(p, cfg);
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "model.safetensors", "lm_head.weight");

    make_dir(dir, sizeof dir, "noweights");
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_str(p, micro_config);
    expect_error(load_expect_fail(dir), TD_ERR_NOT_FOUND, "noweights", "model.safetensors");

    make_dir(dir, sizeof dir, "noconfig");
    expect_error(load_expect_fail(dir), TD_ERR_NOT_FOUND, "noconfig", "config.json");

    make_dir(dir, sizeof dir, "badjson");
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_str(p, "{\"architectures\": [\"LlamaForCausalLM\"");
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "badjson/config.json", NULL);
}

/* Rewrites dir/config.json with the keys of patch set (json_patched's rules). */
static void patch_config(const char *dir, const char *patch)
{
    char p[600], *text;
    snprintf(p, sizeof p, "%s/config.json", dir);
    cr_assert_eq(td_file_read_all(p, 1 << 20, &text, NULL), TD_OK);
    char *patched = json_patched(text, patch);
    write_str(p, patched);
    cJSON_free(patched);
    free(text);
}

/* The files and config.json must describe the same model, checked both ways: every tensor
 * the config implies is there (tensor_errors), and nothing is there that it does not. */
Test(model_hf, config_and_tensors_agree_both_ways, .init = tmp_setup, .fini = tmp_teardown, .timeout = 60)
{
    char dir[512];
    td_model_t *m;
    /* tiny has 4 layers: a config saying 3 is not the model on disk */
    make_dir(dir, sizeof dir, "layers");
    synth(dir, "tiny", -1, TD_F32, 1, 1);
    patch_config(dir, "{\"num_hidden_layers\": 3}");
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT,
                 "layers/model.safetensors: tensor model.layers.3.", "is for layer 3, but config.json says "
                 "num_hidden_layers 3");
    /* the same in a sharded model names the shard that holds the layer */
    make_dir(dir, sizeof dir, "layers_sharded");
    synth(dir, "tiny", -1, TD_F32, 1, 2);
    patch_config(dir, "{\"num_hidden_layers\": 2}");
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "-of-00002.safetensors: tensor model.layers.", 
                 "but config.json says num_hidden_layers 2");
    /* Qwen2 weights (q/k/v biases) or Qwen3 weights (q/k norms) under a Llama config */
    make_dir(dir, sizeof dir, "qwen2_as_llama");
    synth(dir, "tiny", TD_ARCH_QWEN2, TD_F32, 1, 1);
    patch_config(dir, "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\"}");
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "model.safetensors: tensor model.layers.0.self_attn.",
                 "_proj.bias is not part of a LlamaForCausalLM model with this config.json");
    make_dir(dir, sizeof dir, "qwen3_as_llama");
    synth(dir, "tiny", TD_ARCH_QWEN3, TD_F32, 1, 1);
    patch_config(dir, "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\"}");
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "model.safetensors: tensor model.layers.0.self_attn.",
                 "_norm.weight is not part of a LlamaForCausalLM model");
    /* an untied lm_head under a config that ties it is redundant: loads, warned once */
    make_dir(dir, sizeof dir, "tied");
    synth(dir, "tiny", -1, TD_F32, 1, 1);
    patch_config(dir, "{\"tie_word_embeddings\": true}");
    cr_assert_eq(td_model_load(dir, &m), TD_OK, "%s", td_last_error());
    cr_expect_eq(m->weights.lm_head.data, m->weights.embed.data);
    td_model_destroy(m);
    /* a context length that would overflow the engine's sizes, refused with the limit */
    patch_config(dir, "{\"max_position_embeddings\": 2147483647}");
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "tied/config.json: max_position_embeddings 2147483647 is "
                 "out of range: an integer in [1, 16777216]", NULL);
    patch_config(dir, "{\"max_position_embeddings\": 2048, \"rope_theta\": 1e39}");
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "tied/config.json: rope_theta 1e+39 is out of range (0, "
                 "3.4e+38]", NULL);
    /* a config.json with a UTF-8 byte-order mark loads; an empty one says it is empty */
    char p[600];
    snprintf(p, sizeof p, "%s/config.json", dir);
    patch_config(dir, "{\"rope_theta\": 10000}");
    prepend_bom(p);
    cr_assert_eq(td_model_load(dir, &m), TD_OK, "%s", td_last_error());
    td_model_destroy(m);
    write_str(p, "");
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "tied/config.json: empty file", NULL);
}

/* Every JSON file of a model skips a byte-order mark (td_utf8_bom_len), not only config.json
 * and the tokenizer's: generation_config.json and a sharded model's index too. */
Test(model_hf, every_json_file_takes_a_byte_order_mark, .init = tmp_setup, .fini = tmp_teardown)
{
    char dir[512], p[600];
    tmp_path(dir, sizeof dir, "bom");
    synth(dir, "tiny", -1, TD_F32, 1, 2);
    snprintf(p, sizeof p, "%s/generation_config.json", dir);
    write_str(p, "{\"eos_token_id\": [257, 9]}");
    prepend_bom(p);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    prepend_bom(p);
    snprintf(p, sizeof p, "%s/config.json", dir);
    prepend_bom(p);
    td_model_t *m;
    cr_assert_eq(td_model_load(dir, &m), TD_OK, "%s", td_last_error());
    cr_expect_eq(m->config.n_eos, 2);
    cr_expect_eq(m->config.eos_ids[1], 9);
    td_model_destroy(m);
}

Test(model_hf, safetensors_file_errors, .init = tmp_setup, .fini = tmp_teardown)
{
    char dir[512], p[600];
    static const struct {
        const char *header;    /* NULL: a 5-byte file */
        size_t data;
        td_status_t want;
        const char *needle;
    } cases[] = {
        {NULL, 0, TD_ERR_FORMAT, "truncated"},
        {"{\"a\": ", 0, TD_ERR_FORMAT, "JSON"},
        {"[1, 2]", 0, TD_ERR_FORMAT, "JSON"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", 8, TD_ERR_FORMAT, "past the end"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 12]}}", 16, TD_ERR_FORMAT, "need 16"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [16, 0]}}", 16, TD_ERR_FORMAT,
         "data_offsets"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]},"
         " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 16]}}",
         16, TD_ERR_FORMAT, "overlap"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [-4], \"data_offsets\": [0, 16]}}", 16, TD_ERR_FORMAT, "shape"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0.5, 16]}}", 16, TD_ERR_FORMAT,
         "data_offsets"},
        {"{\"a\": {\"dtype\": \"Q4_K\", \"shape\": [4], \"data_offsets\": [0, 16]}}", 16, TD_ERR_UNSUPPORTED, "Q4_K"},
        {"{\"a\": {\"shape\": [4], \"data_offsets\": [0, 16]}}", 16, TD_ERR_FORMAT, "dtype"},
        {"{\"a\": 5}", 0, TD_ERR_FORMAT, "not an object"},
        {"{\"__metadata__\": 3}", 0, TD_ERR_FORMAT, "__metadata__"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 4]}}", 4,
         TD_ERR_FORMAT, "dimensions"},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(cases); i++) {
        char name[32];
        snprintf(name, sizeof name, "st%zu", i);
        make_dir(dir, sizeof dir, name);
        snprintf(p, sizeof p, "%s/config.json", dir);
        write_str(p, micro_config);
        snprintf(p, sizeof p, "%s/model.safetensors", dir);
        if (cases[i].header)
            write_st_raw(p, cases[i].header, cases[i].data);
        else
            write_str(p, "short");
        td_status_t s = load_expect_fail(dir);
        cr_expect_eq(s, cases[i].want, "case %zu: %s (%s)", i, td_status_name(s), td_last_error());
        cr_expect_not_null(strstr(td_last_error(), "model.safetensors"), "case %zu: %s", i, td_last_error());
        cr_expect_not_null(strstr(td_last_error(), cases[i].needle), "case %zu: \"%s\" lacks \"%s\"", i,
                           td_last_error(), cases[i].needle);
        /* The reader alone says the same. */
        td_safetensors_t *st = NULL;
        cr_expect_eq(td_safetensors_open(p, &st), cases[i].want, "case %zu", i);
        cr_expect_null(st);
    }

    /* Header length beyond the file. */
    make_dir(dir, sizeof dir, "hlen");
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_str(p, micro_config);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    unsigned char b[16] = {0xff, 0xff, 0, 0, 0, 0, 0, 0, '{', '}'};
    td_test_write_file(p, b, sizeof b);
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "model.safetensors", "beyond");

    /* A real model cut in half. */
    tmp_path(dir, sizeof dir, "cut");
    synth(dir, "tiny", -1, TD_F32, 3, 1);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    char *data;
    size_t len;
    cr_assert_eq(td_file_read_all(p, 1 << 26, &data, &len), TD_OK);
    td_test_write_file(p, data, len / 2);
    free(data);
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "model.safetensors", "truncated");
}

Test(model_hf, sharded_index_errors, .init = tmp_setup, .fini = tmp_teardown, .timeout = 30)
{
    char dir[512], p[600];
    tmp_path(dir, sizeof dir, "sh");
    synth(dir, "tiny", -1, TD_BF16, 3, 2);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    char *index;
    cr_assert_eq(td_file_read_all(p, 1 << 20, &index, NULL), TD_OK);

    write_str(p, "{\"weight_map\": ");
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "model.safetensors.index.json", NULL);

    write_str(p, "{\"weight_map\": {\"model.embed_tokens.weight\": \"../../etc/passwd\"}}");
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "model.safetensors.index.json", "model.embed_tokens.weight");

    write_str(p, "{\"weight_map\": {\"model.embed_tokens.weight\": \"model-00009-of-00009.safetensors\"}}");
    expect_error(load_expect_fail(dir), TD_ERR_IO, "model-00009-of-00009.safetensors", NULL);

    /* Listed in the map, but the shard does not hold it. */
    cJSON *root = cJSON_Parse(index);
    cJSON *wm = cJSON_GetObjectItem(root, "weight_map");
    cJSON_ReplaceItemInObject(wm, "model.norm.weight", cJSON_CreateString("model-00001-of-00002.safetensors"));
    char *text = cJSON_Print(root);
    write_str(p, text);
    free(text);
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "model-00001-of-00002.safetensors", "model.norm.weight");

    /* Not in the map at all. */
    cJSON_DeleteItemFromObject(wm, "model.norm.weight");
    text = cJSON_Print(root);
    write_str(p, text);
    free(text);
    cJSON_Delete(root);
    expect_error(load_expect_fail(dir), TD_ERR_FORMAT, "model.safetensors.index.json", "model.norm.weight");

    write_str(p, index);
    free(index);
    td_model_t *m;
    cr_assert_eq(td_model_load(dir, &m), TD_OK, "%s", td_last_error());
    td_model_destroy(m);
}

/* ---- the writer -------------------------------------------------------------------- */

Test(model_safetensors, writer_contract, .init = tmp_setup, .fini = tmp_teardown)
{
    char p[512];
    tmp_path(p, sizeof p, "w.safetensors");
    td_st_writer_t *w;
    cr_assert_eq(td_st_writer_create(p, &w), TD_OK);
    const int64_t shape[2] = {2, 3};
    cr_assert_eq(td_st_writer_add(w, "x", TD_F32, 2, shape), TD_OK);
    cr_expect_eq(td_st_writer_add(w, "x", TD_F32, 2, shape), TD_ERR_INVALID);
    cr_assert_eq(td_st_writer_add(w, "y", TD_BF16, 1, shape), TD_OK);
    cr_assert_eq(td_st_writer_begin(w), TD_OK);
    const float xs[6] = {1, 2, 3, 4, 5, 6};
    const uint16_t ys[2] = {td_f32_to_bf16(7), td_f32_to_bf16(8)};
    cr_assert_eq(td_st_writer_write(w, xs, 10), TD_OK);
    cr_assert_eq(td_st_writer_write(w, (const char *)xs + 10, 14), TD_OK);
    cr_assert_eq(td_st_writer_write(w, ys, 4), TD_OK);
    cr_assert_eq(td_st_writer_finish(w), TD_OK);
    td_st_writer_destroy(w);
    td_safetensors_t *st;
    cr_assert_eq(td_safetensors_open(p, &st), TD_OK, "%s", td_last_error());
    cr_expect_eq(td_safetensors_count(st), 2);
    const td_st_tensor_t *x = td_safetensors_find(st, "x"), *y = td_safetensors_find(st, "y");
    cr_assert(x && y);
    cr_expect_eq(x->offset % 8, 0, "data not 8-byte aligned");
    cr_expect_eq(memcmp(x->data, xs, sizeof xs), 0);
    cr_expect_eq(memcmp(y->data, ys, sizeof ys), 0);
    cr_expect_eq(y->dtype, TD_BF16);
    cr_expect_null(td_safetensors_find(st, "z"));
    td_safetensors_close(st);

    /* An unfinished file does not survive. */
    cr_assert_eq(td_st_writer_create(p, &w), TD_OK);
    cr_assert_eq(td_st_writer_add(w, "x", TD_F32, 2, shape), TD_OK);
    cr_assert_eq(td_st_writer_begin(w), TD_OK);
    cr_expect_eq(td_st_writer_write(w, xs, 100), TD_ERR_INVALID);
    cr_expect_eq(td_st_writer_finish(w), TD_ERR_INVALID);
    td_st_writer_destroy(w);
    cr_expect_not(td_is_file(p));
}
