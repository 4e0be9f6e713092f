/*
 * td_model: loading a model's weights as views into memory-mapped files.
 *
 * Two formats here (GGUF files in td_model_gguf.c): llama2.c checkpoints (one fp32 blob after a 7-int header, laid out as
 * run.c's memory_map_weights) and Hugging Face directories (config.json + safetensors,
 * single file or sharded with an index). Either way the loader's whole job is to prove
 * that every tensor the engine will read exists, has the shape the config implies and
 * lies inside its file, and then to hand out pointers; no weight byte is copied.
 */
#include "td_model.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "td_log.h"
#include "td_model_store.h"
#include "td_safetensors.h"
#include "td_util.h"

#define CONFIG_MAX_BYTES (16u << 20)

td_status_t td_model_store_copy(td_model_store_t *s, const void *src, size_t n, void **copy_p)
{
    void **grown = realloc(s->copies, (s->n_copies + 1) * sizeof *grown);
    if (!grown)
        return TD_ERR_NOMEM;
    s->copies = grown;
    void *c = malloc(n ? n : 1); /* malloc alignment suits every element type */
    if (!c)
        return TD_ERR_NOMEM;
    memcpy(c, src, n);
    s->copies[s->n_copies++] = c;
    *copy_p = c;
    return TD_OK;
}

static void store_free(td_model_store_t *s)
{
    if (!s)
        return;
    td_mmap_free(&s->bin);
    td_gguf_close(s->gguf);
    for (size_t i = 0; i < s->n_shards; i++)
        td_safetensors_close(s->shards[i]);
    free(s->shards);
    for (size_t i = 0; i < s->n_copies; i++)
        free(s->copies[i]);
    free(s->copies);
    free(s);
}

td_status_t td_model_populate(const td_model_t *model, int n_threads)
{
    const td_model_store_t *s = model->priv;
    if (!s)
        return TD_OK;
    td_status_t st = TD_OK;
    if (s->bin.data)
        st = td_mem_populate(s->bin.data, s->bin.size, n_threads, false);
    for (size_t i = 0; st == TD_OK && i < s->n_shards; i++) {
        const td_mmap_t *m = td_safetensors_map(s->shards[i]);
        if (m->data)
            st = td_mem_populate(m->data, m->size, n_threads, false);
    }
    if (st == TD_OK && s->gguf)
        st = td_mem_populate(td_gguf_map(s->gguf)->data, td_gguf_map(s->gguf)->size, n_threads, false);
    return st;
}

/* madvise(MADV_DONTNEED) of the whole pages of [p, p + n) when m maps all of it */
static bool release_in_map(const td_mmap_t *m, const unsigned char *p, size_t n)
{
    const unsigned char *base = m->data;
    if (!base || p < base || n > m->size || (size_t)(p - base) > m->size - n)
        return false;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)p + page - 1) / page * page, hi = ((uintptr_t)p + n) / page * page;
    if (hi > lo)
        (void)madvise((void *)lo, hi - lo, MADV_DONTNEED); /* advice: a failure keeps the pages */
    return true;
}

void td_model_release_pages(const td_model_t *model, const void *data, size_t bytes)
{
    const td_model_store_t *s = model->priv;
    if (!s || !data || !bytes)
        return;
    if (release_in_map(&s->bin, data, bytes))
        return;
    for (size_t i = 0; i < s->n_shards; i++)
        if (release_in_map(td_safetensors_map(s->shards[i]), data, bytes))
            return;
    if (s->gguf)
        (void)release_in_map(td_gguf_map(s->gguf), data, bytes);
}

void td_model_destroy(td_model_t *m)
{
    if (!m)
        return;
    if (m->weights.layers && m->config.n_layers > 0)
        free(m->weights.layers[0].experts); /* every layer's experts: one allocation */
    free(m->weights.layers);
    store_free(m->priv);
    free(m);
}

void td_model_set_view(td_tensor_t *t, const void *data, td_dtype_t dt, int64_t d0, int64_t d1)
{
    t->data = data;
    t->dtype = dt;
    t->n_dims = d1 > 0 ? 2 : 1;
    t->shape[0] = d0;
    t->shape[1] = d1 > 0 ? d1 : 0;
    t->shape[2] = t->shape[3] = 0;
}

td_status_t td_model_alloc(const char *path, td_model_t **m_p)
{
    td_model_t *m = calloc(1, sizeof *m);
    td_model_store_t *s = calloc(1, sizeof *s);
    if (!m || !s) {
        free(m);
        free(s);
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
    }
    m->priv = s;
    if (strlen(path) >= sizeof m->path) {
        td_model_destroy(m);
        return td_errorf(TD_ERR_RANGE, "%s: path too long", path);
    }
    snprintf(m->path, sizeof m->path, "%s", path);
    *m_p = m;
    return TD_OK;
}

/* The directory part of `path` ("." when there is none), into out. */
static void dir_of(const char *path, char *out, size_t cap)
{
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(out, cap, ".");
    else if (slash == path)
        snprintf(out, cap, "/");
    else
        snprintf(out, cap, "%.*s", (int)(slash - path), path);
}

/* ---- llama2.c checkpoints ---------------------------------------------------------- */

/* Running byte offset through the checkpoint, with overflow checks. */
typedef struct cursor {
    size_t off;
    bool overflow;
} cursor_t;

/* Reserves n0*n1*n2 floats and returns their offset. */
static size_t take(cursor_t *c, size_t n0, size_t n1, size_t n2)
{
    size_t n, bytes, at = c->off;
    if (!td_mul_size(n0, n1, &n) || !td_mul_size(n, n2, &n) || !td_mul_size(n, 4, &bytes) ||
        !td_add_size(c->off, bytes, &c->off))
        c->overflow = true;
    return at;
}

static td_status_t load_llama2c(const char *path, td_model_t **m_p)
{
    td_model_t *m;
    td_status_t s = td_model_alloc(path, &m);
    if (s != TD_OK)
        return s;
    td_model_store_t *st = m->priv;
    if ((s = td_mmap_init(&st->bin, path)) != TD_OK)
        goto err_model;
    const unsigned char *base = st->bin.data;
    if (st->bin.size < 7 * sizeof(int32_t)) {
        s = td_errorf(TD_ERR_FORMAT, "%s: truncated: %zu bytes, shorter than the 28-byte llama2.c header", path,
                      st->bin.size);
        goto err_model;
    }
    int32_t h[7];
    memcpy(h, base, sizeof h);
    td_model_config_t *c = &m->config;
    td_model_config_set_arch(c, TD_ARCH_LLAMA);
    snprintf(c->arch_name, sizeof c->arch_name, "llama2.c");
    c->rope_style = TD_ROPE_PAIRS;
    c->dim = h[0];
    c->hidden_dim = h[1];
    c->n_layers = h[2];
    c->n_heads = h[3];
    c->n_kv_heads = h[4];
    /* A negative vocab_size marks a classifier of its own after the other weights. */
    c->tie_embeddings = h[5] > 0;
    c->vocab_size = h[5] == INT32_MIN ? 0 : (h[5] < 0 ? -h[5] : h[5]);
    c->max_seq_len = h[6];
    c->norm_eps = 1e-5f;
    c->rope_theta = 10000.0f;
    c->dtype = TD_F32;
    /* run.c stops when it samples BOS, so BOS is the end token too. */
    c->bos_id = 1;
    c->eos_ids[0] = 1;
    c->n_eos = 1;
    if (c->n_heads <= 0 || c->dim <= 0 || c->dim % c->n_heads != 0) {
        s = td_errorf(TD_ERR_FORMAT, "%s: dim %d is not a positive multiple of n_heads %d: not a llama2.c checkpoint",
                      path, c->dim, c->n_heads);
        goto err_model;
    }
    c->head_dim = c->dim / c->n_heads;
    if ((s = td_model_config_validate(c, path)) != TD_OK)
        goto err_model;

    size_t L = (size_t)c->n_layers, D = (size_t)c->dim, F = (size_t)c->hidden_dim, V = (size_t)c->vocab_size;
    size_t hd = (size_t)c->head_dim, q = (size_t)c->n_heads * hd, kv = (size_t)c->n_kv_heads * hd;
    cursor_t cur = {7 * sizeof(int32_t), false};
    size_t o_embed = take(&cur, V, D, 1);
    size_t o_att_norm = take(&cur, L, D, 1);
    size_t o_wq = take(&cur, L, q, D);
    size_t o_wk = take(&cur, L, kv, D);
    size_t o_wv = take(&cur, L, kv, D);
    size_t o_wo = take(&cur, L, D, q);
    size_t o_ffn_norm = take(&cur, L, D, 1);
    size_t o_w1 = take(&cur, L, F, D);
    size_t o_w2 = take(&cur, L, D, F);
    size_t o_w3 = take(&cur, L, F, D);
    size_t o_final = take(&cur, D, 1, 1);
    take(&cur, (size_t)c->max_seq_len, hd / 2, 2); /* freq_cis_real, freq_cis_imag: unused */
    size_t o_cls = c->tie_embeddings ? o_embed : take(&cur, V, D, 1);
    if (cur.overflow || cur.off != st->bin.size) {
        char implied[48] = "more than fits in memory";
        if (!cur.overflow)
            snprintf(implied, sizeof implied, "%zu", cur.off);
        s = td_errorf(TD_ERR_FORMAT,
                      "%s: %zu bytes, but its header (dim %d, hidden_dim %d, n_layers %d, n_heads %d, n_kv_heads %d, "
                      "vocab_size %d, seq_len %d) implies %s: truncated or not a llama2.c checkpoint",
                      path, st->bin.size, h[0], h[1], h[2], h[3], h[4], h[5], h[6], implied);
        goto err_model;
    }

    m->weights.layers = calloc(L, sizeof *m->weights.layers);
    if (!m->weights.layers) {
        s = td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
        goto err_model;
    }
    const float *f32 = (const float *)base; /* offsets are multiples of 4 from a page */
#define AT(off) (f32 + (off) / 4)
    td_model_set_view(&m->weights.embed, AT(o_embed), TD_F32, (int64_t)V, (int64_t)D);
    for (size_t l = 0; l < L; l++) {
        td_layer_weights_t *w = &m->weights.layers[l];
        td_model_set_view(&w->attn_norm, AT(o_att_norm) + l * D, TD_F32, (int64_t)D, 0);
        td_model_set_view(&w->wq, AT(o_wq) + l * q * D, TD_F32, (int64_t)q, (int64_t)D);
        td_model_set_view(&w->wk, AT(o_wk) + l * kv * D, TD_F32, (int64_t)kv, (int64_t)D);
        td_model_set_view(&w->wv, AT(o_wv) + l * kv * D, TD_F32, (int64_t)kv, (int64_t)D);
        td_model_set_view(&w->wo, AT(o_wo) + l * D * q, TD_F32, (int64_t)D, (int64_t)q);
        td_model_set_view(&w->ffn_norm, AT(o_ffn_norm) + l * D, TD_F32, (int64_t)D, 0);
        td_model_set_view(&w->w_gate, AT(o_w1) + l * F * D, TD_F32, (int64_t)F, (int64_t)D);
        td_model_set_view(&w->w_down, AT(o_w2) + l * D * F, TD_F32, (int64_t)D, (int64_t)F);
        td_model_set_view(&w->w_up, AT(o_w3) + l * F * D, TD_F32, (int64_t)F, (int64_t)D);
    }
    td_model_set_view(&m->weights.final_norm, AT(o_final), TD_F32, (int64_t)D, 0);
    td_model_set_view(&m->weights.lm_head, AT(o_cls), TD_F32, (int64_t)V, (int64_t)D);
#undef AT

    char dir[4096], tok[4096 + 16];
    dir_of(path, dir, sizeof dir);
    snprintf(tok, sizeof tok, "%s/tokenizer.bin", dir);
    if (td_is_file(tok) && strlen(tok) < sizeof m->tokenizer_path)
        memcpy(m->tokenizer_path, tok, strlen(tok) + 1);
    m->fingerprint = td_model_fingerprint(c);
    *m_p = m;
    return TD_OK;

err_model:
    td_model_destroy(m);
    return s;
}

/* ---- Hugging Face directories ------------------------------------------------------ */

typedef struct hf_ctx {
    const char *dir;
    td_model_t *m;
    td_model_store_t *st;
    cJSON *weight_map;      /* sharded: name -> file; NULL for a single file */
    char index_path[4200];
    td_dtype_t dtype;       /* of the first tensor bound: all must agree */
    bool have_dtype;
} hf_ctx_t;

/* generation_config.json: bos when config.json has none, eos ids added to the list. */
static td_status_t merge_generation_config(const char *path, td_model_config_t *c)
{
    char *text;
    td_status_t s = td_file_read_all(path, CONFIG_MAX_BYTES, &text, NULL);
    if (s != TD_OK)
        return s;
    cJSON *root = cJSON_Parse(text + td_utf8_bom_len(text, strlen(text)));
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return td_errorf(TD_ERR_FORMAT, "%s: not a JSON object", path);
    }
    const cJSON *bos = cJSON_GetObjectItemCaseSensitive(root, "bos_token_id");
    if (c->bos_id < 0 && cJSON_IsNumber(bos) && bos->valuedouble >= 0 && bos->valuedouble < c->vocab_size)
        c->bos_id = (int32_t)bos->valuedouble;
    const cJSON *eos = cJSON_GetObjectItemCaseSensitive(root, "eos_token_id");
    const cJSON *it = cJSON_IsArray(eos) ? eos->child : eos;
    for (; it; it = cJSON_IsArray(eos) ? it->next : NULL) {
        if (!cJSON_IsNumber(it) || it->valuedouble < 0 || it->valuedouble >= c->vocab_size) {
            s = td_errorf(TD_ERR_FORMAT, "%s: eos_token_id must be token ids inside the vocabulary (%d)", path,
                          c->vocab_size);
            break;
        }
        int32_t id = (int32_t)it->valuedouble;
        bool dup = false;
        for (int k = 0; k < c->n_eos; k++)
            dup |= c->eos_ids[k] == id;
        if (!dup && c->n_eos < TD_MAX_EOS)
            c->eos_ids[c->n_eos++] = id;
    }
    cJSON_Delete(root);
    return s;
}

/* A shard file name from the index must stay inside the model directory. */
static bool safe_file_name(const char *n)
{
    return n[0] && n[0] != '.' && !strchr(n, '/') && strlen(n) < 256;
}

static td_status_t open_index(hf_ctx_t *h, cJSON **root_p)
{
    char *text;
    td_status_t s = td_file_read_all(h->index_path, 64u << 20, &text, NULL);
    if (s != TD_OK)
        return s;
    cJSON *root = cJSON_Parse(text + td_utf8_bom_len(text, strlen(text)));
    free(text);
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(root) || !cJSON_IsObject(wm)) {
        cJSON_Delete(root);
        return td_errorf(TD_ERR_FORMAT, "%s: not a JSON object with a \"weight_map\" object", h->index_path);
    }
    size_t n = 0;
    for (const cJSON *e = wm->child; e; e = e->next)
        n++;
    h->st->shards = calloc(n ? n : 1, sizeof *h->st->shards);
    const char **names = calloc(n ? n : 1, sizeof *names);
    if (!h->st->shards || !names) {
        free(names);
        cJSON_Delete(root);
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", h->index_path);
    }
    for (const cJSON *e = wm->child; e && s == TD_OK; e = e->next) {
        if (!cJSON_IsString(e) || !safe_file_name(e->valuestring)) {
            s = td_errorf(TD_ERR_FORMAT, "%s: weight_map entry %s must name a file in the model directory",
                          h->index_path, e->string);
            break;
        }
        bool seen = false;
        for (size_t i = 0; i < h->st->n_shards; i++)
            seen |= !strcmp(names[i], e->valuestring);
        if (seen)
            continue;
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", h->dir, e->valuestring);
        s = td_safetensors_open(p, &h->st->shards[h->st->n_shards]);
        if (s == TD_OK)
            names[h->st->n_shards++] = e->valuestring;
    }
    free(names);
    if (s != TD_OK) {
        cJSON_Delete(root);
        return s;
    }
    h->weight_map = (cJSON *)wm;
    *root_p = root;
    return TD_OK;
}

static const char *base_name(const char *p)
{
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

/*
 * Finds tensor `name`, checks its dtype and shape ({d0} or {d0, d1}) and points t at it.
 * Optional tensors that are absent leave t zeroed and return TD_OK.
 */
static td_status_t bind(hf_ctx_t *h, td_tensor_t *t, const char *name, bool optional, int64_t d0, int64_t d1)
{
    const td_st_tensor_t *x = NULL;
    const char *file = NULL;
    if (h->weight_map) {
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(h->weight_map, name);
        if (!e) {
            if (optional)
                return TD_OK;
            return td_errorf(TD_ERR_FORMAT, "%s: missing tensor %s (not in weight_map)", h->index_path, name);
        }
        for (size_t i = 0; i < h->st->n_shards; i++)
            if (!strcmp(base_name(td_safetensors_path(h->st->shards[i])), e->valuestring)) {
                x = td_safetensors_find(h->st->shards[i], name);
                file = td_safetensors_path(h->st->shards[i]);
            }
        TD_ASSERT(file);
        if (!x)
            return td_errorf(TD_ERR_FORMAT, "%s: missing tensor %s, which %s places in this file", file, name,
                             h->index_path);
    } else {
        file = td_safetensors_path(h->st->shards[0]);
        x = td_safetensors_find(h->st->shards[0], name);
        if (!x) {
            if (optional)
                return TD_OK;
            return td_errorf(TD_ERR_FORMAT, "%s: missing tensor %s", file, name);
        }
    }
    if (!x->supported)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: tensor %s has dtype %s; only F32, F16 and BF16 are supported",
                         file, name, x->dtype_name);
    int nd = d1 > 0 ? 2 : 1;
    if (x->n_dims != nd || x->shape[0] != d0 || (nd == 2 && x->shape[1] != d1)) {
        char got[160] = "", want[64];
        size_t n = 0;
        for (int i = 0; i < x->n_dims && n < sizeof got - 24; i++)
            n += (size_t)snprintf(got + n, sizeof got - n, "%s%lld", i ? ", " : "", (long long)x->shape[i]);
        if (nd == 2)
            snprintf(want, sizeof want, "%lld, %lld", (long long)d0, (long long)d1);
        else
            snprintf(want, sizeof want, "%lld", (long long)d0);
        return td_errorf(TD_ERR_FORMAT, "%s: tensor %s has shape [%s], config.json says [%s]", file, name, got,
                         want);
    }
    if (!h->have_dtype) {
        h->dtype = x->dtype;
        h->have_dtype = true;
    } else if (x->dtype != h->dtype) {
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: tensor %s is %s but earlier tensors are %s; mixed-dtype "
                         "checkpoints are not supported", file, name, x->dtype_name, td_st_dtype_name(h->dtype));
    }
    /* The engine reads elements through typed pointers. A tensor at an odd offset (legal
     * in the format; files from writers that did not pad the header) is copied to aligned
     * memory rather than handed out misaligned. */
    const void *data = x->data;
    if ((uintptr_t)data % td_dtype_size(x->dtype) != 0) {
        void *copy;
        td_status_t s = td_model_store_copy(h->st, x->data, x->nbytes, &copy);
        if (s != TD_OK)
            return td_errorf(s, "%s: out of memory copying misaligned tensor %s", file, name);
        data = copy;
    }
    td_model_set_view(t, data, x->dtype, d0, nd == 2 ? d1 : 0);
    return TD_OK;
}

void td_model_layer_specs(const td_model_config_t *c, td_layer_weights_t *w, td_layer_spec_t out[TD_LAYER_SPECS])
{
    int64_t D = c->dim, F = c->hidden_dim, hd = c->head_dim, E = c->n_experts;
    bool dense = c->n_experts == 0;
    int64_t q = (int64_t)c->n_heads * hd, kv = (int64_t)c->n_kv_heads * hd;
    const td_layer_spec_t spec[TD_LAYER_SPECS] = {
        {&w->attn_norm, "input_layernorm.weight", "attn_norm.weight", true, D, 0},
        {&w->wq, "self_attn.q_proj.weight", "attn_q.weight", true, q, D},
        {&w->wk, "self_attn.k_proj.weight", "attn_k.weight", true, kv, D},
        {&w->wv, "self_attn.v_proj.weight", "attn_v.weight", true, kv, D},
        {&w->bq, "self_attn.q_proj.bias", "attn_q.bias", c->qkv_bias, q, 0},
        {&w->bk, "self_attn.k_proj.bias", "attn_k.bias", c->qkv_bias, kv, 0},
        {&w->bv, "self_attn.v_proj.bias", "attn_v.bias", c->qkv_bias, kv, 0},
        {&w->q_norm, "self_attn.q_norm.weight", "attn_q_norm.weight", c->qk_norm, hd, 0},
        {&w->k_norm, "self_attn.k_norm.weight", "attn_k_norm.weight", c->qk_norm, hd, 0},
        {&w->wo, "self_attn.o_proj.weight", "attn_output.weight", true, D, q},
        {&w->ffn_norm, "post_attention_layernorm.weight", "ffn_norm.weight", true, D, 0},
        {&w->w_gate, "mlp.gate_proj.weight", "ffn_gate.weight", dense, F, D},
        {&w->w_up, "mlp.up_proj.weight", "ffn_up.weight", dense, F, D},
        {&w->w_down, "mlp.down_proj.weight", "ffn_down.weight", dense, D, F},
        {&w->router, c->arch == TD_ARCH_MIXTRAL ? "block_sparse_moe.gate.weight" : "mlp.gate.weight",
         "ffn_gate_inp.weight", !dense, E, D},
    };
    memcpy(out, spec, sizeof spec);
}

void td_model_expert_specs(const td_model_config_t *c, td_expert_spec_t out[TD_EXPERT_SPECS])
{
    int64_t D = c->dim, F = c->expert_hidden_dim;
    bool mixtral = c->arch == TD_ARCH_MIXTRAL;
    const td_expert_spec_t spec[TD_EXPERT_SPECS] = {
        {mixtral ? "block_sparse_moe.experts.%d.w1.weight" : "mlp.experts.%d.gate_proj.weight",
         "ffn_gate_exps.weight", F, D, offsetof(td_expert_weights_t, w_gate)},
        {mixtral ? "block_sparse_moe.experts.%d.w3.weight" : "mlp.experts.%d.up_proj.weight",
         "ffn_up_exps.weight", F, D, offsetof(td_expert_weights_t, w_up)},
        {mixtral ? "block_sparse_moe.experts.%d.w2.weight" : "mlp.experts.%d.down_proj.weight",
         "ffn_down_exps.weight", D, F, offsetof(td_expert_weights_t, w_down)},
    };
    memcpy(out, spec, sizeof spec);
}

td_status_t td_model_alloc_experts(td_model_t *m, const char *origin, size_t n_tensors, size_t per_layer)
{
    const td_model_config_t *c = &m->config;
    if (c->n_experts == 0)
        return TD_OK;
    size_t want;
    if (!td_mul_size((size_t)c->n_layers, per_layer, &want) || want > n_tensors)
        return td_errorf(TD_ERR_FORMAT, "%s: %d layers of %d experts need %zu tensors a layer, and the file%s %zu in "
                         "all: the config does not describe these weights", origin, c->n_layers, c->n_experts,
                         per_layer, m->path[0] && td_is_dir(m->path) ? "s hold" : " holds", n_tensors);
    size_t n = (size_t)c->n_layers * (size_t)c->n_experts; /* <= want: no overflow */
    td_expert_weights_t *all = calloc(n, sizeof *all);
    if (!all)
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory for %d layers of %d experts", m->path, c->n_layers,
                         c->n_experts);
    for (int32_t l = 0; l < c->n_layers; l++)
        m->weights.layers[l].experts = all + (size_t)l * (size_t)c->n_experts;
    return TD_OK;
}

bool td_model_is_expert_name(const td_model_config_t *c, const char *suffix)
{
    if (c->n_experts == 0)
        return false;
    td_expert_spec_t spec[TD_EXPERT_SPECS];
    td_model_expert_specs(c, spec);
    for (size_t i = 0; i < TD_EXPERT_SPECS; i++) {
        /* the name printed back from the number read must be the whole suffix: "07" or
           " 7" would not be the tensor bound as expert 7 */
        const char *pct = strstr(spec[i].hf, "%d");
        size_t pre = (size_t)(pct - spec[i].hf);
        if (strncmp(suffix, spec[i].hf, pre) != 0 || suffix[pre] < '0' || suffix[pre] > '9')
            continue;
        char *end;
        errno = 0;
        long e = strtol(suffix + pre, &end, 10);
        if (errno || e >= c->n_experts || end - (suffix + pre) > 7)
            continue;
        char name[128];
        snprintf(name, sizeof name, spec[i].hf, (int)e);
        if (!strcmp(name, suffix))
            return true;
    }
    return false;
}

static td_status_t bind_all(hf_ctx_t *h)
{
    td_model_t *m = h->m;
    const td_model_config_t *c = &m->config;
    int64_t D = c->dim, V = c->vocab_size;
    td_status_t s;
    if ((s = bind(h, &m->weights.embed, "model.embed_tokens.weight", false, V, D)) != TD_OK)
        return s;
    for (int32_t l = 0; l < c->n_layers; l++) {
        td_layer_spec_t spec[TD_LAYER_SPECS];
        td_model_layer_specs(c, &m->weights.layers[l], spec);
        for (size_t i = 0; i < TD_LAYER_SPECS; i++) {
            if (!spec[i].use)
                continue;
            char name[128];
            snprintf(name, sizeof name, "model.layers.%d.%s", l, spec[i].hf);
            if ((s = bind(h, spec[i].t, name, false, spec[i].d0, spec[i].d1)) != TD_OK)
                return s;
        }
        td_expert_spec_t es[TD_EXPERT_SPECS];
        td_model_expert_specs(c, es);
        for (int32_t e = 0; e < c->n_experts; e++) {
            for (size_t i = 0; i < TD_EXPERT_SPECS; i++) {
                char suffix[96], name[128];
                snprintf(suffix, sizeof suffix, es[i].hf, (int)e);
                snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix);
                td_tensor_t *t = (td_tensor_t *)((char *)&m->weights.layers[l].experts[e] + es[i].offset);
                if ((s = bind(h, t, name, false, es[i].d0, es[i].d1)) != TD_OK)
                    return s;
            }
        }
    }
    if ((s = bind(h, &m->weights.final_norm, "model.norm.weight", false, D, 0)) != TD_OK)
        return s;
    if (c->tie_embeddings) {
        m->weights.lm_head = m->weights.embed;
        return TD_OK;
    }
    return bind(h, &m->weights.lm_head, "lm_head.weight", false, V, D);
}

/* What a tensor name in the files is to the model of config c. */
typedef enum tensor_role {
    TENSOR_USED,    /* bound by bind_all */
    TENSOR_IGNORED, /* known to carry nothing the engine needs: warned about */
    TENSOR_UNKNOWN, /* refused: a model that has it computes something we would not */
} tensor_role_t;

static tensor_role_t tensor_role(const td_model_config_t *c, const char *name, long *layer_p)
{
    *layer_p = -1;
    if (!strcmp(name, "model.embed_tokens.weight") || !strcmp(name, "model.norm.weight"))
        return TENSOR_USED;
    if (!strcmp(name, "lm_head.weight")) /* some writers keep it beside tied embeddings */
        return c->tie_embeddings ? TENSOR_IGNORED : TENSOR_USED;
    static const char prefix[] = "model.layers.";
    if (strncmp(name, prefix, sizeof prefix - 1) != 0)
        return TENSOR_UNKNOWN;
    const char *digits = name + sizeof prefix - 1;
    char *end;
    errno = 0;
    long l = strtol(digits, &end, 10);
    if (end == digits || *end != '.' || *digits == '-' || *digits == '+' || errno ||
        (*digits == '0' && end != digits + 1)) /* "03" would not be the tensor bound as 3 */
        return TENSOR_UNKNOWN;
    *layer_p = l;
    const char *suffix = end + 1;
    /* old Llama checkpoints store the rotary frequencies; the engine computes its own */
    if (!strcmp(suffix, "self_attn.rotary_emb.inv_freq"))
        return TENSOR_IGNORED;
    td_layer_weights_t w;
    td_layer_spec_t spec[TD_LAYER_SPECS];
    td_model_layer_specs(c, &w, spec);
    for (size_t i = 0; i < TD_LAYER_SPECS; i++)
        if (spec[i].use && !strcmp(suffix, spec[i].hf))
            return TENSOR_USED;
    return td_model_is_expert_name(c, suffix) ? TENSOR_USED : TENSOR_UNKNOWN;
}

/*
 * The other direction of bind_all: every tensor in the files must be one the config
 * implies. A layer beyond num_hidden_layers means the config is not the model on disk;
 * an unknown name (a bias, a norm, another architecture's tensor) means the model
 * computes something the engine would silently skip. Both are refused with the name.
 * Tensors known to be redundant (rotary inv_freq, lm_head beside tied embeddings) load
 * with one warning.
 */
static td_status_t check_extra(hf_ctx_t *h)
{
    const td_model_config_t *c = &h->m->config;
    size_t n_ignored = 0;
    const char *first_ignored = NULL, *first_file = NULL;
    for (size_t f = 0; f < h->st->n_shards; f++) {
        const td_safetensors_t *st = h->st->shards[f];
        for (size_t i = 0; i < td_safetensors_count(st); i++) {
            const char *name = td_safetensors_at(st, i)->name;
            long layer;
            tensor_role_t role = tensor_role(c, name, &layer);
            if (layer >= c->n_layers)
                return td_errorf(TD_ERR_FORMAT, "%s: tensor %s is for layer %ld, but config.json says "
                                 "num_hidden_layers %d: the config does not describe these weights",
                                 td_safetensors_path(st), name, layer, c->n_layers);
            if (role == TENSOR_UNKNOWN)
                return td_errorf(TD_ERR_FORMAT, "%s: tensor %s is not part of a %s model with this config.json; "
                                 "refusing rather than computing without it", td_safetensors_path(st), name,
                                 c->arch_name);
            if (role == TENSOR_IGNORED && n_ignored++ == 0) {
                first_ignored = name;
                first_file = td_safetensors_path(st);
            }
        }
    }
    if (n_ignored)
        td_warn("%s: ignoring %zu tensor%s the engine does not need (%s%s)", first_file, n_ignored,
                n_ignored == 1 ? "" : "s", n_ignored == 1 ? "" : "first: ", first_ignored);
    return TD_OK;
}

static td_status_t load_hf(const char *path, const char *dir, td_model_t **m_p)
{
    td_model_t *m;
    td_status_t s = td_model_alloc(path, &m);
    if (s != TD_OK)
        return s;
    hf_ctx_t h = {.dir = dir, .m = m, .st = m->priv};
    cJSON *index_root = NULL;
    char p[4200], *text = NULL;

    snprintf(p, sizeof p, "%s/config.json", dir);
    if (!td_is_file(p)) {
        s = td_errorf(TD_ERR_NOT_FOUND, "%s: no config.json: not a Hugging Face model directory", dir);
        goto err_model;
    }
    size_t text_len = 0;
    if ((s = td_file_read_all(p, CONFIG_MAX_BYTES, &text, &text_len)) != TD_OK)
        goto err_model;
    /* the parser reads a C string: a NUL would end the text early ("empty file" for a binary
     * file that starts with one), so it is refused here with where it is */
    const char *nul = memchr(text, '\0', text_len);
    if (nul)
        s = td_errorf(TD_ERR_FORMAT, "%s: a NUL byte at offset %zu: not a JSON text (a binary or corrupt file?)", p,
                      (size_t)(nul - text));
    else
        s = td_model_config_from_json(text, p, &m->config);
    free(text);
    if (s != TD_OK)
        goto err_model;
    snprintf(p, sizeof p, "%s/generation_config.json", dir);
    if (td_is_file(p) && ((s = merge_generation_config(p, &m->config)) != TD_OK))
        goto err_model;

    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    snprintf(h.index_path, sizeof h.index_path, "%s/model.safetensors.index.json", dir);
    if (td_is_file(p)) {
        h.st->shards = calloc(1, sizeof *h.st->shards);
        if (!h.st->shards) {
            s = td_errorf(TD_ERR_NOMEM, "%s: out of memory", p);
            goto err_model;
        }
        if ((s = td_safetensors_open(p, &h.st->shards[0])) != TD_OK)
            goto err_model;
        h.st->n_shards = 1;
    } else if (td_is_file(h.index_path)) {
        if ((s = open_index(&h, &index_root)) != TD_OK)
            goto err_model;
    } else {
        s = td_errorf(TD_ERR_NOT_FOUND, "%s: neither model.safetensors nor model.safetensors.index.json", dir);
        goto err_model;
    }

    m->weights.layers = calloc((size_t)m->config.n_layers, sizeof *m->weights.layers);
    if (!m->weights.layers) {
        s = td_errorf(TD_ERR_NOMEM, "%s: out of memory", dir);
        goto err_index;
    }
    size_t n_tensors = 0;
    for (size_t i = 0; i < h.st->n_shards; i++)
        n_tensors += td_safetensors_count(h.st->shards[i]);
    /* per layer: every expert's three matrices */
    if ((s = td_model_alloc_experts(m, dir, n_tensors, 3 * (size_t)m->config.n_experts)) != TD_OK ||
        (s = bind_all(&h)) != TD_OK || (s = check_extra(&h)) != TD_OK)
        goto err_index;
    cJSON_Delete(index_root);
    m->config.dtype = h.dtype;

    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    if (td_is_file(p) && strlen(p) < sizeof m->tokenizer_path)
        memcpy(m->tokenizer_path, p, strlen(p) + 1);
    m->fingerprint = td_model_fingerprint(&m->config);
    *m_p = m;
    return TD_OK;

err_index:
    cJSON_Delete(index_root);
err_model:
    td_model_destroy(m);
    return s;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

td_status_t td_model_load(const char *path, td_model_t **model_p)
{
    if (td_is_dir(path))
        return load_hf(path, path, model_p);
    if (!td_is_file(path))
        return td_errorf(TD_ERR_IO, "%s: no such model file or directory", path);
    if (td_gguf_is_gguf(path))
        return td_model_load_gguf(path, model_p);
    /* A file of a Hugging Face directory stands for the directory. */
    if (!strcmp(base_name(path), "config.json") || ends_with(path, ".safetensors") ||
        ends_with(path, ".safetensors.index.json")) {
        char dir[4096];
        dir_of(path, dir, sizeof dir);
        return load_hf(path, dir, model_p);
    }
    return load_llama2c(path, model_p);
}
