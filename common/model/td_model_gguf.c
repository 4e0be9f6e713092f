/*
 * td_model_gguf: loading a model from a GGUF file (llama.cpp's format).
 *
 * The hyperparameters are the `{arch}.*` metadata keys (llama.embedding_length, ...), the
 * vocabulary size the rows of token_embd.weight, bos/eos the tokenizer.ggml.*_token_id
 * keys. Tensors keep llama.cpp's names (blk.N.attn_q.weight) and their stored type: the
 * views point into the td_gguf map, block-quantized or not, and backends convert what
 * they cannot compute with. GGUF lists a tensor's sizes fastest-first, so a matrix with
 * ne = {in, out} is the td_tensor_t {out, in}: the same bytes, row-major.
 *
 * RoPE: llama.cpp's converter permutes the rows of a llama/mistral q and k projection
 * (within each head, rows i and i + head_dim/2 become rows 2i and 2i + 1) so that ggml's
 * "normal" rope, which rotates adjacent pairs, computes what Hugging Face's rotate_half
 * does on the original rows. Such a model is TD_ROPE_PAIRS here; qwen2/qwen3 GGUFs are not
 * permuted and use NeoX rope, TD_ROPE_HALVES. Its KV cache differs from the safetensors
 * model's (the head dimensions are in another order), and so does the fingerprint.
 *
 * Like the other loaders this one proves every claim before handing out a pointer: each
 * key the shape needs exists with a sane value, each tensor the config implies exists with
 * that shape and a type tandem computes with, and no tensor in the file is one the engine
 * would silently skip. Errors name the file and the key or tensor.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_gguf.h"
#include "td_hash.h"
#include "td_model_store.h"
#include "td_quant.h"
#include "td_util.h"

#define GGUF_MAX_DIM (1 << 24) /* as td_model_config_validate: beyond any real model */

typedef struct gguf_ctx {
    const char *path;
    td_gguf_t *g;
    td_model_t *m;
    char arch[32];          /* general.architecture */
    bool matrices_bf16_f32; /* every matrix so far is bf16 or f32 */
    bool any_bf16;
} gguf_ctx_t;

/* ---- metadata ---------------------------------------------------------------------- */

/* {arch}.<suffix> as a positive integer <= max into *out; dflt (when >= 0) if absent. */
static td_status_t key_int(gguf_ctx_t *c, const char *suffix, int64_t dflt, int64_t max, int32_t *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", c->arch, suffix);
    if (!td_gguf_find(c->g, key)) {
        if (dflt < 0)
            return td_errorf(TD_ERR_FORMAT, "%s: missing metadata key %s, which the model's shape needs", c->path,
                             key);
        *out = (int32_t)dflt;
        return TD_OK;
    }
    uint64_t v;
    td_status_t s = td_gguf_get_uint(c->g, key, &v); /* a type mismatch is logged there */
    if (s != TD_OK)
        return s == TD_ERR_NOT_FOUND ? TD_ERR_FORMAT : s;
    if (v < 1 || v > (uint64_t)max)
        return td_errorf(TD_ERR_FORMAT, "%s: metadata %s = %llu is out of range [1, %lld]", c->path, key,
                         (unsigned long long)v, (long long)max);
    *out = (int32_t)v;
    return TD_OK;
}

/* {arch}.<suffix> as a positive finite float; dflt (when > 0) if absent. */
static td_status_t key_float(gguf_ctx_t *c, const char *suffix, double dflt, float *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", c->arch, suffix);
    if (!td_gguf_find(c->g, key)) {
        if (!(dflt > 0))
            return td_errorf(TD_ERR_FORMAT, "%s: missing metadata key %s, which the model needs", c->path, key);
        *out = (float)dflt;
        return TD_OK;
    }
    double v;
    td_status_t s = td_gguf_get_float(c->g, key, &v);
    if (s != TD_OK)
        return s == TD_ERR_NOT_FOUND ? TD_ERR_FORMAT : s;
    if (!(v > 0) || !isfinite((float)v))
        return td_errorf(TD_ERR_FORMAT, "%s: metadata %s = %g must be a positive finite number", c->path, key, v);
    *out = (float)v;
    return TD_OK;
}

/* tokenizer.ggml.<what>_token_id, when present, into *id (-1 when absent). */
static td_status_t token_id(gguf_ctx_t *c, const char *what, int32_t *id)
{
    char key[96];
    snprintf(key, sizeof key, "tokenizer.ggml.%s_token_id", what);
    *id = -1;
    if (!td_gguf_find(c->g, key))
        return TD_OK;
    uint64_t v;
    td_status_t s = td_gguf_get_uint(c->g, key, &v);
    if (s != TD_OK)
        return s == TD_ERR_NOT_FOUND ? TD_ERR_FORMAT : s;
    if (v >= (uint64_t)c->m->config.vocab_size)
        return td_errorf(TD_ERR_FORMAT, "%s: metadata %s = %llu is outside the vocabulary (%d tokens)", c->path, key,
                         (unsigned long long)v, c->m->config.vocab_size);
    *id = (int32_t)v;
    return TD_OK;
}

static void add_eos(td_model_config_t *cfg, int32_t id)
{
    if (id < 0)
        return;
    for (int k = 0; k < cfg->n_eos; k++)
        if (cfg->eos_ids[k] == id)
            return;
    if (cfg->n_eos < TD_MAX_EOS)
        cfg->eos_ids[cfg->n_eos++] = id;
}

/* Refuses rope scaling the engine does not compute (linear, yarn, ...): a model that has
 * it would give wrong answers past its original context, silently. */
static td_status_t check_rope_scaling(gguf_ctx_t *c)
{
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", c->arch);
    td_gguf_str_t type = {"none", 4};
    if (td_gguf_find(c->g, key) && td_gguf_get_str(c->g, key, &type) != TD_OK)
        return TD_ERR_FORMAT;
    float factor = 1.0f;
    snprintf(key, sizeof key, "%s.rope.scaling.factor", c->arch);
    const char *factor_key = "rope.scaling.factor";
    if (!td_gguf_find(c->g, key))
        factor_key = "rope.scale_linear"; /* the older spelling of a linear factor */
    td_status_t s = key_float(c, factor_key, 1.0, &factor);
    if (s != TD_OK)
        return s;
    bool none = type.len == 4 && !memcmp(type.data, "none", 4);
    if (!none && factor != 1.0f)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: %s.rope.scaling.type \"%.*s\" (factor %g) is not supported; "
                         "tandem computes plain RoPE and Llama 3's rope_freqs", c->path, c->arch,
                         (int)TD_MIN(type.len, (size_t)32), type.data, (double)factor);
    if (none && factor != 1.0f)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: %s.%s %g (linear RoPE scaling) is not supported", c->path,
                         c->arch, factor_key, (double)factor);
    return TD_OK;
}

/* ---- tensors ----------------------------------------------------------------------- */

static void fmt_ne(char *out, size_t cap, int n, const int64_t *ne)
{
    size_t o = 0;
    out[0] = 0;
    for (int i = 0; i < n && o + 24 < cap; i++)
        o += (size_t)snprintf(out + o, cap - o, "%s%lld", i ? ", " : "", (long long)ne[i]);
}

/*
 * Finds tensor `name` and checks it: a type tandem computes with, n_dims `nd` with ne
 * `want` (GGUF order, fastest first), rows of whole blocks, vectors in a float type. Its
 * bytes (an aligned copy when the file's are not) into *data_p, its dtype into *dt_p. An
 * absent optional tensor leaves *data_p NULL.
 */
static td_status_t find_tensor(gguf_ctx_t *c, const char *name, bool optional, int nd, const int64_t *want,
                               const void **data_p, td_dtype_t *dt_p)
{
    *data_p = NULL;
    const td_gguf_tensor_t *x = td_gguf_find_tensor(c->g, name);
    if (!x) {
        if (optional)
            return TD_OK;
        return td_errorf(TD_ERR_FORMAT, "%s: missing tensor %s", c->path, name);
    }
    int dt = td_dtype_from_ggml(x->type);
    if (dt < 0 || !x->known) {
        const td_ggml_type_t *gt = td_ggml_type(x->type);
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: tensor %s has ggml type %s (%u), which tandem cannot compute "
                         "with (it reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_XS): requantize "
                         "the model with llama-quantize", c->path, name, gt ? gt->name : "unknown", x->type);
    }
    bool same = x->n_dims == nd;
    for (int i = 0; same && i < nd; i++)
        same = x->ne[i] == want[i];
    if (!same) {
        char got[128], exp[96];
        fmt_ne(got, sizeof got, x->n_dims, x->ne);
        fmt_ne(exp, sizeof exp, nd, want);
        return td_errorf(TD_ERR_FORMAT, "%s: tensor %s has ne [%s] (GGUF order, fastest first), but the %s.* "
                         "metadata implies [%s]", c->path, name, got, c->arch, exp);
    }
    if (x->ne[0] % (int64_t)td_dtype_block_elems((td_dtype_t)dt) != 0)
        return td_errorf(TD_ERR_FORMAT, "%s: tensor %s: rows of %lld weights are not a whole number of %s blocks",
                         c->path, name, (long long)x->ne[0], td_dtype_name((td_dtype_t)dt));
    if (nd == 1 && !td_dtype_is_float(dt))
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: tensor %s is a vector stored as %s; vectors must be F32, F16 or "
                         "BF16", c->path, name, td_dtype_name((td_dtype_t)dt));
    if (nd >= 2) {
        c->matrices_bf16_f32 &= dt == TD_BF16 || dt == TD_F32;
        c->any_bf16 |= dt == TD_BF16;
    }
    /* Elements are read through typed pointers (blocks through their f16 scales); a file
     * with an alignment below that is legal, and gets an aligned copy. */
    const void *data = x->data;
    size_t align = dt == TD_F32 ? 4 : 2;
    if ((uintptr_t)data % align != 0) {
        void *copy;
        if (td_model_store_copy(c->m->priv, x->data, x->nbytes, &copy) != TD_OK)
            return td_errorf(TD_ERR_NOMEM, "%s: out of memory copying misaligned tensor %s", c->path, name);
        data = copy;
    }
    *data_p = data;
    *dt_p = (td_dtype_t)dt;
    return TD_OK;
}

/* Points t at tensor `name` of shape {d0} or {d0, d1} (td order; GGUF's ne is {d1, d0}). An
 * absent optional tensor leaves t zeroed. */
static td_status_t bind(gguf_ctx_t *c, td_tensor_t *t, const char *name, bool optional, int64_t d0, int64_t d1)
{
    int nd = d1 > 0 ? 2 : 1;
    int64_t want[2] = {nd == 2 ? d1 : d0, d0};
    const void *data;
    td_dtype_t dt;
    td_status_t s = find_tensor(c, name, optional, nd, want, &data, &dt);
    if (s == TD_OK && data)
        td_model_set_view(t, data, dt, d0, nd == 2 ? d1 : 0);
    return s;
}

/* A layer's experts from one 3-D tensor `name` (ne {d1, d0, n_experts}: the experts' [d0][d1]
 * matrices one after another): each expert's view (at `offset` in td_expert_weights_t) is
 * its slice, whole rows, so as aligned as the tensor (block sizes are even). */
static td_status_t bind_experts(gguf_ctx_t *c, td_expert_weights_t *experts, size_t offset, const char *name,
                                int64_t d0, int64_t d1)
{
    int32_t n = c->m->config.n_experts;
    const int64_t want[3] = {d1, d0, n};
    const void *data;
    td_dtype_t dt;
    td_status_t s = find_tensor(c, name, false, 3, want, &data, &dt);
    if (s != TD_OK)
        return s;
    size_t per = td_dtype_bytes(dt, (size_t)d0 * (size_t)d1);
    for (int32_t e = 0; e < n; e++)
        td_model_set_view((td_tensor_t *)((char *)&experts[e] + offset), (const char *)data + (size_t)e * per, dt,
                          d0, d1);
    return TD_OK;
}

static td_status_t bind_all(gguf_ctx_t *c)
{
    td_model_t *m = c->m;
    const td_model_config_t *cfg = &m->config;
    int64_t D = cfg->dim, V = cfg->vocab_size;
    td_status_t s;
    if ((s = bind(c, &m->weights.embed, "token_embd.weight", false, V, D)) != TD_OK)
        return s;
    for (int32_t l = 0; l < cfg->n_layers; l++) {
        td_layer_spec_t spec[TD_LAYER_SPECS];
        td_model_layer_specs(cfg, &m->weights.layers[l], spec);
        for (size_t i = 0; i < TD_LAYER_SPECS; i++) {
            char name[96];
            snprintf(name, sizeof name, "blk.%d.%s", l, spec[i].gguf);
            if (spec[i].use && (s = bind(c, spec[i].t, name, false, spec[i].d0, spec[i].d1)) != TD_OK)
                return s;
        }
        td_expert_spec_t es[TD_EXPERT_SPECS];
        td_model_expert_specs(cfg, es);
        for (size_t i = 0; cfg->n_experts > 0 && i < TD_EXPERT_SPECS; i++) {
            char name[96];
            snprintf(name, sizeof name, "blk.%d.%s", l, es[i].gguf);
            if ((s = bind_experts(c, m->weights.layers[l].experts, es[i].offset, name, es[i].d0, es[i].d1)) != TD_OK)
                return s;
        }
    }
    if ((s = bind(c, &m->weights.final_norm, "output_norm.weight", false, D, 0)) != TD_OK)
        return s;
    if (cfg->tie_embeddings)
        m->weights.lm_head = m->weights.embed;
    else if ((s = bind(c, &m->weights.lm_head, "output.weight", false, V, D)) != TD_OK)
        return s;
    td_tensor_t *rf = &m->weights.rope_freqs;
    if ((s = bind(c, rf, "rope_freqs.weight", true, cfg->head_dim / 2, 0)) != TD_OK)
        return s;
    if (rf->data && rf->dtype != TD_F32)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: tensor rope_freqs.weight is %s; llama.cpp writes it as F32",
                         c->path, td_dtype_name(rf->dtype));
    if (rf->data) {
        uint64_t h = td_fnv1a64(TD_FNV1A64_INIT, rf->data, (size_t)rf->shape[0] * 4);
        m->config.rope_freqs_hash = h ? h : 1;
    }
    return TD_OK;
}

/* The other direction of bind_all: every tensor in the file must be one the config
 * implies, or the engine would compute without it. */
static td_status_t check_extra(gguf_ctx_t *c)
{
    const td_model_config_t *cfg = &c->m->config;
    td_layer_weights_t w;
    td_layer_spec_t spec[TD_LAYER_SPECS];
    td_model_layer_specs(cfg, &w, spec);
    td_expert_spec_t es[TD_EXPERT_SPECS];
    td_model_expert_specs(cfg, es);
    for (size_t i = 0; i < td_gguf_tensor_count(c->g); i++) {
        const char *name = td_gguf_tensor_at(c->g, i)->name;
        if (!strcmp(name, "token_embd.weight") || !strcmp(name, "output_norm.weight") ||
            !strcmp(name, "output.weight") || !strcmp(name, "rope_freqs.weight"))
            continue;
        bool known = false;
        long l = -1;
        const char *digits = name + 4, *suffix = NULL;
        if (!strncmp(name, "blk.", 4) && *digits >= '0' && *digits <= '9') {
            char *end;
            l = strtol(digits, &end, 10);
            /* "blk.03" would not be the tensor bound as block 3 */
            if (*end == '.' && (*digits != '0' || end == digits + 1) && end - digits < 9)
                suffix = end + 1;
        }
        for (size_t k = 0; suffix && k < TD_LAYER_SPECS; k++)
            known |= spec[k].use && !strcmp(suffix, spec[k].gguf);
        for (size_t k = 0; suffix && cfg->n_experts > 0 && k < TD_EXPERT_SPECS; k++)
            known |= !strcmp(suffix, es[k].gguf);
        if (known && l >= cfg->n_layers)
            return td_errorf(TD_ERR_FORMAT, "%s: tensor %s is for block %ld, but %s.block_count is %d", c->path,
                             name, l, c->arch, cfg->n_layers);
        if (!known)
            return td_errorf(TD_ERR_FORMAT, "%s: tensor %s is not part of a %s model as its metadata describes "
                             "it; refusing rather than computing without it", c->path, name, c->arch);
    }
    return TD_OK;
}

/* ---- the config -------------------------------------------------------------------- */

/* A mixture of experts' keys: {arch}.expert_count, expert_used_count, and for qwen3moe
 * expert_feed_forward_length (Mixtral's experts are feed_forward_length wide). Both
 * renormalise the top-k weights in llama.cpp (its qwen3moe graph always does); a file may
 * say otherwise with {arch}.expert_weights_norm. */
static td_status_t read_experts(gguf_ctx_t *c)
{
    td_model_config_t *cfg = &c->m->config;
    if (cfg->arch != TD_ARCH_MIXTRAL && cfg->arch != TD_ARCH_QWEN3_MOE)
        return TD_OK;
    td_status_t s;
    if ((s = key_int(c, "expert_count", -1, TD_MAX_EXPERTS, &cfg->n_experts)) != TD_OK ||
        (s = key_int(c, "expert_used_count", -1, GGUF_MAX_DIM, &cfg->n_experts_used)) != TD_OK ||
        (s = key_int(c, "expert_feed_forward_length", cfg->arch == TD_ARCH_MIXTRAL ? cfg->hidden_dim : -1,
                     GGUF_MAX_DIM, &cfg->expert_hidden_dim)) != TD_OK)
        return s;
    if (cfg->n_experts_used > cfg->n_experts)
        return td_errorf(TD_ERR_FORMAT, "%s: %s.expert_used_count %d is more than %s.expert_count %d", c->path,
                         c->arch, cfg->n_experts_used, c->arch, cfg->n_experts);
    char key[128];
    snprintf(key, sizeof key, "%s.expert_weights_norm", c->arch);
    cfg->moe_norm_topk = true;
    if (td_gguf_find(c->g, key) && td_gguf_get_bool(c->g, key, &cfg->moe_norm_topk) != TD_OK)
        return TD_ERR_FORMAT;
    /* shared experts and other gating functions (DeepSeek, Qwen2-MoE) are other models */
    snprintf(key, sizeof key, "%s.expert_shared_count", c->arch);
    if (td_gguf_find(c->g, key))
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: %s: shared experts are not supported", c->path, key);
    return TD_OK;
}

static td_status_t read_config(gguf_ctx_t *c)
{
    td_model_config_t *cfg = &c->m->config;
    td_gguf_str_t a;
    if (!td_gguf_find(c->g, "general.architecture"))
        return td_errorf(TD_ERR_FORMAT, "%s: missing metadata key general.architecture", c->path);
    if (td_gguf_get_str(c->g, "general.architecture", &a) != TD_OK)
        return TD_ERR_FORMAT;
    snprintf(c->arch, sizeof c->arch, "%.*s", (int)TD_MIN(a.len, sizeof c->arch - 1), a.data);
    td_arch_t arch;
    if (!strcmp(c->arch, "llama") && a.len == 5)
        arch = TD_ARCH_LLAMA; /* Mistral 7B's GGUFs are "llama" too */
    else if (!strcmp(c->arch, "qwen2") && a.len == 5)
        arch = TD_ARCH_QWEN2;
    else if (!strcmp(c->arch, "qwen3") && a.len == 5)
        arch = TD_ARCH_QWEN3;
    else if (!strcmp(c->arch, "qwen3moe") && a.len == 8)
        arch = TD_ARCH_QWEN3_MOE;
    else
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: general.architecture \"%.*s\" is not supported (llama, qwen2, "
                         "qwen3, qwen3moe)", c->path, (int)TD_MIN(a.len, (size_t)64), a.data);
    /* Mixtral's GGUFs are "llama" with experts, as llama.cpp's converter writes them */
    char key[128];
    snprintf(key, sizeof key, "%s.expert_count", c->arch);
    if (arch == TD_ARCH_LLAMA && td_gguf_find(c->g, key))
        arch = TD_ARCH_MIXTRAL;
    td_model_config_set_arch(cfg, arch);
    snprintf(cfg->arch_name, sizeof cfg->arch_name, "gguf %s", c->arch);
    cfg->rope_style = arch == TD_ARCH_LLAMA || arch == TD_ARCH_MIXTRAL ? TD_ROPE_PAIRS : TD_ROPE_HALVES;

    td_status_t s;
    if ((s = key_int(c, "embedding_length", -1, GGUF_MAX_DIM, &cfg->dim)) != TD_OK ||
        (s = key_int(c, "feed_forward_length", -1, GGUF_MAX_DIM, &cfg->hidden_dim)) != TD_OK ||
        (s = key_int(c, "block_count", -1, GGUF_MAX_DIM, &cfg->n_layers)) != TD_OK ||
        (s = key_int(c, "attention.head_count", -1, GGUF_MAX_DIM, &cfg->n_heads)) != TD_OK ||
        (s = key_int(c, "attention.head_count_kv", cfg->n_heads, GGUF_MAX_DIM, &cfg->n_kv_heads)) != TD_OK ||
        (s = key_int(c, "context_length", -1, GGUF_MAX_DIM, &cfg->max_seq_len)) != TD_OK ||
        (s = key_float(c, "attention.layer_norm_rms_epsilon", 0, &cfg->norm_eps)) != TD_OK ||
        (s = key_float(c, "rope.freq_base", 10000.0, &cfg->rope_theta)) != TD_OK)
        return s;
    if (cfg->n_heads % cfg->n_kv_heads != 0)
        return td_errorf(TD_ERR_FORMAT, "%s: %s.attention.head_count %d is not a multiple of head_count_kv %d",
                         c->path, c->arch, cfg->n_heads, cfg->n_kv_heads);
    int32_t dflt_hd = cfg->dim % cfg->n_heads == 0 ? cfg->dim / cfg->n_heads : -1;
    if ((s = key_int(c, "attention.key_length", dflt_hd, GGUF_MAX_DIM, &cfg->head_dim)) != TD_OK)
        return s;
    int32_t v_len, rope_dim;
    if ((s = key_int(c, "attention.value_length", cfg->head_dim, GGUF_MAX_DIM, &v_len)) != TD_OK ||
        (s = key_int(c, "rope.dimension_count", cfg->head_dim, GGUF_MAX_DIM, &rope_dim)) != TD_OK)
        return s;
    if (cfg->head_dim % 2 != 0)
        return td_errorf(TD_ERR_FORMAT, "%s: %s.attention.key_length %d must be even for rotary embeddings",
                         c->path, c->arch, cfg->head_dim);
    if (v_len != cfg->head_dim)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: %s.attention.value_length %d differs from key_length %d", c->path,
                         c->arch, v_len, cfg->head_dim);
    if (rope_dim != cfg->head_dim)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: %s.rope.dimension_count %d: partial rotary embeddings (of fewer "
                         "than key_length %d dimensions) are not supported", c->path, c->arch, rope_dim,
                         cfg->head_dim);
    if ((s = check_rope_scaling(c)) != TD_OK || (s = read_experts(c)) != TD_OK)
        return s;
    /* llama.cpp's key for a window on every layer (it writes a per-layer pattern only for
       architectures we do not load) */
    int32_t window;
    if ((s = key_int(c, "attention.sliding_window", 0, GGUF_MAX_DIM, &window)) != TD_OK)
        return s;
    td_model_config_set_window(cfg, window);

    /* the vocabulary is what the embedding holds; the tokenizer and the key must agree */
    const td_gguf_tensor_t *e = td_gguf_find_tensor(c->g, "token_embd.weight");
    if (!e)
        return td_errorf(TD_ERR_FORMAT, "%s: missing tensor token_embd.weight", c->path);
    if (e->n_dims != 2 || e->ne[1] < 1 || e->ne[1] > GGUF_MAX_DIM)
        return td_errorf(TD_ERR_FORMAT, "%s: tensor token_embd.weight must be a matrix of [%d, n_vocab] (n_vocab "
                         "in [1, %d])", c->path, cfg->dim, GGUF_MAX_DIM);
    cfg->vocab_size = (int32_t)e->ne[1];
    const td_gguf_kv_t *toks = td_gguf_find(c->g, "tokenizer.ggml.tokens");
    if (toks && (toks->type != TD_GGUF_ARRAY || toks->arr_len != (size_t)cfg->vocab_size))
        return td_errorf(TD_ERR_FORMAT, "%s: tokenizer.ggml.tokens has %zu tokens but token_embd.weight has %d rows",
                         c->path, toks->type == TD_GGUF_ARRAY ? toks->arr_len : 0, cfg->vocab_size);
    int32_t n_vocab_key;
    if ((s = key_int(c, "vocab_size", cfg->vocab_size, GGUF_MAX_DIM, &n_vocab_key)) != TD_OK)
        return s;
    if (n_vocab_key != cfg->vocab_size)
        return td_errorf(TD_ERR_FORMAT, "%s: %s.vocab_size %d but token_embd.weight has %d rows", c->path, c->arch,
                         n_vocab_key, cfg->vocab_size);

    cfg->tie_embeddings = !td_gguf_find_tensor(c->g, "output.weight");
    /* a llama with attention biases (attention_bias: true) carries them too */
    cfg->qkv_bias |= td_gguf_find_tensor(c->g, "blk.0.attn_q.bias") != NULL;

    int32_t id;
    if ((s = token_id(c, "bos", &cfg->bos_id)) != TD_OK)
        return s;
    cfg->n_eos = 0;
    /* llama.cpp stops on eos, eot (end of turn) and eom (end of message, Llama 3.1 tools) */
    static const char *const stops[] = {"eos", "eot", "eom"};
    for (size_t i = 0; i < TD_ARRAY_LEN(stops); i++) {
        if ((s = token_id(c, stops[i], &id)) != TD_OK)
            return s;
        add_eos(cfg, id);
    }
    return td_model_config_validate(cfg, c->path);
}

td_status_t td_model_load_gguf(const char *path, td_model_t **m_p)
{
    td_model_t *m;
    td_status_t s = td_model_alloc(path, &m);
    if (s != TD_OK)
        return s;
    td_model_store_t *st = m->priv;
    if ((s = td_gguf_open(path, &st->gguf)) != TD_OK)
        goto err_model;
    gguf_ctx_t c = {.path = path, .g = st->gguf, .m = m, .matrices_bf16_f32 = true};
    if ((s = read_config(&c)) != TD_OK)
        goto err_model;
    m->weights.layers = calloc((size_t)m->config.n_layers, sizeof *m->weights.layers);
    if (!m->weights.layers) {
        s = td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
        goto err_model;
    }
    /* per layer: the three 3-D tensors of the experts */
    if ((s = td_model_alloc_experts(m, path, td_gguf_tensor_count(c.g), 3)) != TD_OK ||
        (s = bind_all(&c)) != TD_OK || (s = check_extra(&c)) != TD_OK)
        goto err_model;
    m->config.dtype = !c.matrices_bf16_f32 ? TD_F16 : c.any_bf16 ? TD_BF16 : TD_F32;
    snprintf(m->tokenizer_path, sizeof m->tokenizer_path, "%s", path); /* fits: m->path holds it */
    m->fingerprint = td_model_fingerprint(&m->config);
    *m_p = m;
    return TD_OK;

err_model:
    td_model_destroy(m);
    return s;
}
