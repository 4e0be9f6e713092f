/*
 * td_engine_create: an engine's making and unmaking. The config's defaults and checks, the
 * weights made usable by the backend (in place, converted, quantized or packed, once at
 * creation), the rope frequencies, the step's scratch buffers and host metadata sized by the
 * config's bounds, and the KV pool; td_engine_destroy gives them back in reverse.
 */
#include "td_engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_engine_impl.h"
#include "td_log.h"
#include "td_util.h"

td_engine_config_t td_engine_config_default(void)
{
    return (td_engine_config_t){
        .block_size = 16,
        .n_blocks = 0,
        .kv_mem_bytes = (size_t)1 << 30,
        .kv_dtype = TD_F32,
        .weight_dtype = TD_ENGINE_WEIGHTS_AS_STORED,
        .weight_quant = -1,
        .prefix_cache = true,
        .max_batch_tokens = 2048,
        .max_seqs = 256,
        .max_logit_rows = 256,
        .partition_tokens = 0,
    };
}

void td_engine_config_set_dtype(td_engine_config_t *cfg, int dtype, int quant, int kv_dtype)
{
    if (quant >= 0)
        cfg->weight_quant = quant;
    if (dtype >= 0) {
        cfg->weight_dtype = dtype;
        cfg->kv_dtype = (td_dtype_t)dtype;
    }
    if (kv_dtype >= 0)
        cfg->kv_dtype = (td_dtype_t)kv_dtype;
}

/* ---- weights ---------------------------------------------------------------------- */

static size_t tensor_elems(const td_tensor_t *t)
{
    size_t n = 1;
    for (int i = 0; i < t->n_dims; i++)
        n *= (size_t)t->shape[i];
    return n;
}

/* The dtype a weight is used in on the backend (td_engine_config_t.weight_dtype and
 * .weight_quant say the rules). A block type the backend lacks is said once per type. */
static td_dtype_t weight_want(td_engine_t *eng, const td_tensor_t *t)
{
    td_backend_t *be = eng->be;
    const td_engine_config_t *cfg = &eng->cfg;
    bool has = (be->weight_dtypes >> t->dtype) & 1u;
    if (td_dtype_is_float(t->dtype)) {
        if (cfg->weight_quant >= 0 && t->n_dims == 2) {
            if (t->shape[1] % (int64_t)td_dtype_block_elems((td_dtype_t)cfg->weight_quant) == 0)
                return (td_dtype_t)cfg->weight_quant;
            /* rows that are not whole blocks stay as they are, as llama.cpp's quantize does */
            if (!eng->said_unquantized) {
                eng->said_unquantized = true;
                td_info("engine: --quant %s: matrices whose rows (%lld weights) are not whole blocks of %zu stay %s",
                        td_dtype_name((td_dtype_t)cfg->weight_quant), (long long)t->shape[1],
                        td_dtype_block_elems((td_dtype_t)cfg->weight_quant), td_dtype_name(t->dtype));
            }
        }
        return cfg->weight_dtype != TD_ENGINE_WEIGHTS_AS_STORED ? (td_dtype_t)cfg->weight_dtype
               : has                                            ? t->dtype
                                                                : TD_F32;
    }
    if (has)
        return t->dtype;
    td_dtype_t want = cfg->weight_dtype != TD_ENGINE_WEIGHTS_AS_STORED ? (td_dtype_t)cfg->weight_dtype
                      : be->act_dtype != TD_F32 && ((be->weight_dtypes >> be->act_dtype) & 1u)
                          ? be->act_dtype
                          : TD_F32;
    if (!((eng->said_dequant >> t->dtype) & 1u)) {
        eng->said_dequant |= 1u << t->dtype;
        td_info("engine: the %s backend has no kernels for %s weights: dequantized to %s at load",
                    be->ops->name, td_dtype_name(t->dtype), td_dtype_name(want));
    }
    return want;
}

/* A matrix in the backend's packed form (ops->weight_pack: block types, and float ones
 * where the backend packs those, cpu:q8's bf16), from the host tensor t converted to `want`
 * (--quant) when it is stored otherwise. out->data stays NULL when the backend keeps the
 * matrix as stored. */
static td_status_t pack_tensor(td_engine_t *eng, const td_tensor_t *t, td_dtype_t want, td_dev_tensor_t *out)
{
    td_backend_t *be = eng->be;
    if (!be->ops->weight_pack || t->n_dims != 2)
        return TD_OK;
    size_t n = tensor_elems(t);
    void *tmp = NULL;
    if (want != t->dtype) {
        tmp = malloc(td_dtype_bytes(want, n));
        if (!tmp)
            return td_errorf(TD_ERR_NOMEM, "engine: out of host memory quantizing a weight (%zu bytes)",
                             td_dtype_bytes(want, n));
        td_dtype_convert(tmp, want, t->data, t->dtype, n);
    }
    void *packed = NULL;
    td_status_t st = be->ops->weight_pack(be, tmp ? tmp : t->data, want, (int32_t)t->shape[0],
                                          (int32_t)t->shape[1], &packed);
    free(tmp);
    if (st != TD_OK || !packed)
        return st;
    /* the backend reads its copy only: the file's pages go (a 1B f16 model in cpu:q8 held 4.9 GB
       of RSS for 2.5 GB of weights; a tied output matrix's rows are read again from the file
       as the embedding, faulted in as needed) */
    td_model_release_pages(eng->model, t->data, td_dtype_bytes(t->dtype, n));
    out->data = packed;
    out->dtype = want;
    out->owned = true;
    out->packed = true;
    return TD_OK;
}

/* Makes a host tensor usable by the backend: packed when the backend repacks it, in place
 * when it can, else converted (to the dtype weight_want picks) and uploaded. */
static td_status_t upload_tensor(td_engine_t *eng, const td_tensor_t *t, bool counts,
                                 td_dev_tensor_t *out)
{
    td_backend_t *be = eng->be;
    memset(out, 0, sizeof *out);
    if (!t->data)
        return TD_OK;
    size_t n = tensor_elems(t);
    td_dtype_t want = weight_want(eng, t);
    if (!td_dtype_can_convert(want, t->dtype))
        return td_errorf(TD_ERR_UNSUPPORTED, "engine: a %s weight cannot be converted to %s",
                         td_dtype_name(t->dtype), td_dtype_name(want));
    if (counts)
        eng->weight_bytes += td_dtype_bytes(want, n);
    /* the embedding table (counts false) is read by rows as stored: never packed */
    td_status_t st = counts ? pack_tensor(eng, t, want, out) : TD_OK;
    if (st != TD_OK || out->data)
        return st;
    if (be->host_memory && want == t->dtype) {
        out->data = t->data;
        out->dtype = t->dtype;
        return TD_OK;
    }
    size_t bytes = td_dtype_bytes(want, n);
    void *dev = NULL;
    st = be->ops->alloc(be, bytes, &dev);
    if (st != TD_OK)
        return st;
    if (be->host_memory) {
        td_dtype_convert(dev, want, t->data, t->dtype, n);
    } else {
        void *tmp = want == t->dtype ? NULL : malloc(bytes);
        if (want != t->dtype && !tmp) {
            be->ops->free(be, dev);
            return td_errorf(TD_ERR_NOMEM, "engine: out of host memory converting a weight (%zu bytes)", bytes);
        }
        if (tmp)
            td_dtype_convert(tmp, want, t->data, t->dtype, n);
        st = be->ops->copy_h2d(be, dev, tmp ? tmp : t->data, bytes);
        free(tmp);
        if (st != TD_OK) {
            be->ops->free(be, dev);
            return st;
        }
    }
    out->data = dev;
    out->dtype = want;
    out->owned = true;
    return TD_OK;
}

static void free_tensor(td_engine_t *eng, td_dev_tensor_t *t)
{
    if (t->owned)
        eng->be->ops->free(eng->be, (void *)t->data);
    memset(t, 0, sizeof *t);
}

#define TD_LAYER_TENSORS(X) \
    X(attn_norm) X(wq) X(wk) X(wv) X(bq) X(bk) X(bv) X(q_norm) X(k_norm) X(wo) \
    X(ffn_norm) X(w_gate) X(w_up) X(w_down)

static td_status_t upload_weights(td_engine_t *eng)
{
    const td_model_weights_t *w = &eng->model->weights;
    const td_model_config_t *c = &eng->model->config;
    td_status_t st;
    /* the embedding table is read one row per token, not streamed: it does not count */
    if ((st = upload_tensor(eng, &w->embed, false, &eng->embed)) != TD_OK)
        return st;
    if ((st = upload_tensor(eng, &w->final_norm, true, &eng->final_norm)) != TD_OK)
        return st;
    if (w->lm_head.data == w->embed.data && w->lm_head.dtype == w->embed.dtype) {
        /* tied: the embedding's rows, or a packed copy of them for the matmul (embed reads
         * rows as stored) */
        if ((st = pack_tensor(eng, &w->lm_head, eng->embed.dtype, &eng->lm_head)) != TD_OK)
            return st;
        if (!eng->lm_head.data) {
            eng->lm_head = eng->embed;
            eng->lm_head.owned = false;
        }
        eng->weight_bytes += td_dtype_bytes(eng->embed.dtype, tensor_elems(&w->lm_head));
    } else if ((st = upload_tensor(eng, &w->lm_head, true, &eng->lm_head)) != TD_OK) {
        return st;
    }
    eng->layers = calloc((size_t)c->n_layers, sizeof *eng->layers);
    if (!eng->layers)
        return td_errorf(TD_ERR_NOMEM, "engine: out of memory for %d layers", c->n_layers);
    for (int l = 0; l < c->n_layers; l++) {
        const td_layer_weights_t *lw = &w->layers[l];
        td_layer_dev_t *ld = &eng->layers[l];
#define UP(name)                                                                     \
    if ((st = upload_tensor(eng, &lw->name, true, &ld->name)) != TD_OK)                 \
        return st;
        TD_LAYER_TENSORS(UP)
#undef UP
        if (c->n_experts == 0)
            continue;
        /* the router stays as stored under --quant, as llama.cpp's quantize keeps
           ffn_gate_inp: its logits choose the experts, a near-tie flips on rounding */
        int32_t quant = eng->cfg.weight_quant;
        eng->cfg.weight_quant = -1;
        st = upload_tensor(eng, &lw->router, true, &ld->router);
        eng->cfg.weight_quant = quant;
        if (st != TD_OK)
            return st;
        ld->exp = calloc((size_t)c->n_experts * 3, sizeof *ld->exp);
        if (!ld->exp)
            return td_errorf(TD_ERR_NOMEM, "engine: out of memory for %d experts", c->n_experts);
        size_t before = eng->weight_bytes;
        for (int32_t e = 0; e < c->n_experts; e++) {
            const td_expert_weights_t *ew = &lw->experts[e];
            if ((st = upload_tensor(eng, &ew->w_gate, true, &ld->exp[3 * e])) != TD_OK ||
                (st = upload_tensor(eng, &ew->w_up, true, &ld->exp[3 * e + 1])) != TD_OK ||
                (st = upload_tensor(eng, &ew->w_down, true, &ld->exp[3 * e + 2])) != TD_OK)
                return st;
        }
        eng->expert_bytes += eng->weight_bytes - before;
    }
    return TD_OK;
}

static void free_weights(td_engine_t *eng)
{
    free_tensor(eng, &eng->embed);
    free_tensor(eng, &eng->final_norm);
    free_tensor(eng, &eng->lm_head);
    if (!eng->layers)
        return;
    for (int l = 0; l < eng->model->config.n_layers; l++) {
        td_layer_dev_t *ld = &eng->layers[l];
#define FR(name) free_tensor(eng, &ld->name);
        TD_LAYER_TENSORS(FR)
#undef FR
        free_tensor(eng, &ld->router);
        for (int32_t i = 0; ld->exp && i < 3 * eng->model->config.n_experts; i++)
            free_tensor(eng, &ld->exp[i]);
        free(ld->exp);
    }
    free(eng->layers);
    eng->layers = NULL;
}

/* ---- rope ------------------------------------------------------------------------- */

/* Frequencies of the rotary pairs, with Llama 3's long-context scaling when configured, or
 * divided by the model's per-pair rope_freqs (GGUF's form of the same scaling) when it has
 * them. */
static void rope_inv_freq(const td_model_t *model, float *inv_freq)
{
    const td_model_config_t *c = &model->config;
    const td_tensor_t *ff = &model->weights.rope_freqs;
    TD_ASSERT(!ff->data || (ff->dtype == TD_F32 && ff->shape[0] == c->head_dim / 2));
    int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        double freq = 1.0 / pow((double)c->rope_theta, (2.0 * i) / c->head_dim);
        if (c->rope_llama3) {
            double old_ctx = c->rope_original_max_pos;
            double low_wavelen = old_ctx / c->rope_low_freq_factor;
            double high_wavelen = old_ctx / c->rope_high_freq_factor;
            double wavelen = 2.0 * M_PI / freq;
            if (wavelen > low_wavelen) {
                freq = freq / c->rope_factor;
            } else if (wavelen >= high_wavelen) {
                double smooth = (old_ctx / wavelen - c->rope_low_freq_factor) /
                                (c->rope_high_freq_factor - c->rope_low_freq_factor);
                freq = (1.0 - smooth) * freq / c->rope_factor + smooth * freq;
            }
        }
        if (ff->data)
            freq /= ((const float *)ff->data)[i];
        inv_freq[i] = (float)freq;
    }
}

/* ---- create / destroy ------------------------------------------------------------- */

static td_status_t check_config(const td_engine_config_t *cfg)
{
    if (cfg->block_size <= 0 || cfg->block_size > 1024 || (cfg->block_size & (cfg->block_size - 1)))
        return td_errorf(TD_ERR_INVALID, "engine: block size %d must be a power of two in [1, 1024]",
                         cfg->block_size);
    if (cfg->n_blocks < 0 || cfg->max_batch_tokens <= 0 || cfg->max_seqs <= 0 ||
        cfg->max_logit_rows <= 0 || cfg->partition_tokens < 0)
        return td_errorf(TD_ERR_INVALID, "engine: n_blocks, max_batch_tokens, max_seqs, "
                                         "max_logit_rows and partition_tokens must be positive");
    if (!td_kv_dtype_valid(cfg->kv_dtype) ||
        (cfg->weight_dtype != TD_ENGINE_WEIGHTS_AS_STORED && !td_dtype_is_float(cfg->weight_dtype)))
        return td_errorf(TD_ERR_INVALID, "engine: KV dtype %d / weight dtype %d: the KV a float td_dtype_t or "
                                         "Q8_0, the weights a float one (or TD_ENGINE_WEIGHTS_AS_STORED)",
                         (int)cfg->kv_dtype, (int)cfg->weight_dtype);
    if (cfg->weight_quant != -1 && !(td_dtype_is_block(cfg->weight_quant) &&
                                     td_dtype_can_convert((td_dtype_t)cfg->weight_quant, TD_F32)))
        return td_errorf(TD_ERR_INVALID, "engine: weight quantization %d is not q8_0 or q4_0 (or -1: none)",
                         (int)cfg->weight_quant);
    if (cfg->partition_tokens % cfg->block_size)
        return td_errorf(TD_ERR_INVALID, "engine: partition size %d is not a multiple of the block size %d",
                         cfg->partition_tokens, cfg->block_size);
    return TD_OK;
}

/* The step metadata's block table ([max_seqs + max_logit_rows][max_blocks] int32) is host
 * memory rewritten at every step; 1 GiB is far above any real shape (512 sequences of 1M
 * tokens in blocks of 16 take 128 MiB) and keeps a hostile config from asking for more. */
#define TD_ENGINE_MAX_TABLE_BYTES ((size_t)1 << 30)

static td_status_t alloc_state(td_engine_t *eng)
{
    const td_model_config_t *c = &eng->model->config;
    td_backend_t *be = eng->be;
    size_t act = td_dtype_size(be->act_dtype);
    size_t T = (size_t)eng->cfg.max_batch_tokens;
    size_t R = (size_t)eng->cfg.max_logit_rows;
    size_t qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
    /* a mixture's FFN runs on each row k times (once per expert it is routed to) */
    bool moe = c->n_experts > 0;
    size_t E = moe ? (size_t)c->n_experts : 1, TK = T * (moe ? (size_t)c->n_experts_used : 1);
    size_t ffn = moe ? (size_t)c->expert_hidden_dim : (size_t)c->hidden_dim;
    size_t moe_rows = moe ? TK : 1;
    if (TK > INT32_MAX)
        return td_errorf(TD_ERR_INVALID, "engine: max_batch_tokens %zu x %d experts per token is more rows than a "
                         "step can hold (2^31): lower max_batch_tokens", T, c->n_experts_used);
    /* every size is rows x width x element, each checked: the widths come from a model's
     * config.json, whose numbers may be anything up to INT32_MAX */
    struct {
        void **p;
        const char *what;
        size_t rows, width, elem;
    } bufs[] = {
        {&eng->s.x, "activations (max_batch_tokens x hidden_size)", T, (size_t)c->dim, act},
        {&eng->s.xb, "activations (max_batch_tokens x hidden_size)", T, (size_t)c->dim, act},
        {&eng->s.q, "queries (max_batch_tokens x heads x head_dim)", T, qd, act},
        {&eng->s.k, "keys (max_batch_tokens x kv heads x head_dim)", T, kvd, act},
        {&eng->s.v, "values (max_batch_tokens x kv heads x head_dim)", T, kvd, act},
        {&eng->s.att, "attention output (max_batch_tokens x heads x head_dim)", T, qd, act},
        {&eng->s.gate, "mlp gate (max_batch_tokens [x experts per token] x intermediate_size)", TK, ffn, act},
        {&eng->s.up, "mlp up (max_batch_tokens [x experts per token] x intermediate_size)", TK, ffn, act},
        {(void **)&eng->s.router, "router logits (max_batch_tokens x experts)", moe ? T : 1, E, sizeof(float)},
        {&eng->s.moe_in, "expert inputs (max_batch_tokens x experts per token x hidden_size)", moe_rows,
         (size_t)c->dim, act},
        {&eng->s.moe_out, "expert outputs (max_batch_tokens x experts per token x hidden_size)", moe_rows,
         (size_t)c->dim, act},
        {&eng->s.rows, "logit rows (max_logit_rows x hidden_size)", R, (size_t)c->dim, act},
        {&eng->s.logits, "logits (max_logit_rows x vocab_size)", R, (size_t)c->vocab_size, sizeof(float)},
        {(void **)&eng->s.inv_freq, "rope frequencies (head_dim / 2)", 1, (size_t)c->head_dim / 2, sizeof(float)},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(bufs); i++) {
        size_t bytes;
        if (!td_mul_size(bufs[i].rows, bufs[i].width, &bytes) || !td_mul_size(bytes, bufs[i].elem, &bytes))
            return td_errorf(TD_ERR_INVALID, "engine: the %s buffer, %zu x %zu elements of %zu bytes, is larger "
                             "than memory can address (SIZE_MAX bytes)", bufs[i].what, bufs[i].rows,
                             bufs[i].width, bufs[i].elem);
        td_status_t st = be->ops->alloc(be, bytes, bufs[i].p);
        if (st != TD_OK)
            return st;
    }
    float inv_freq[512];
    rope_inv_freq(eng->model, inv_freq);
    td_status_t st = be->ops->copy_h2d(be, eng->s.inv_freq, inv_freq,
                                       (size_t)c->head_dim / 2 * sizeof(float));
    if (st != TD_OK)
        return st;

    /* A sequence's row of the block table holds the blocks of its longest context, and never
     * more than the pool has. Computed in 64 bits: max_position_embeddings may be INT32_MAX
     * (rounding it up to whole blocks in int32_t overflowed, and the wrapped count became a
     * huge allocation reported as out of memory). */
    int64_t max_blocks = ((int64_t)c->max_seq_len + eng->cfg.block_size - 1) / eng->cfg.block_size;
    max_blocks = TD_MAX(TD_MIN(max_blocks, (int64_t)eng->n_blocks), (int64_t)1);
    size_t table_bytes, meta_seqs = (size_t)eng->cfg.max_seqs + R;
    if (!td_mul_size(meta_seqs, (size_t)max_blocks, &table_bytes) ||
        !td_mul_size(table_bytes, sizeof(int32_t), &table_bytes) || table_bytes > TD_ENGINE_MAX_TABLE_BYTES)
        return td_errorf(TD_ERR_INVALID, "engine: the block table of %d sequences x %lld blocks (a context of "
                         "%d positions from max_position_embeddings, at most the pool's %d blocks of %d tokens) is over "
                         "its limit of %zu MiB: lower max_position_embeddings, the batch size or the KV pool",
                         (int)meta_seqs, (long long)max_blocks, c->max_seq_len, eng->n_blocks, eng->cfg.block_size,
                         TD_ENGINE_MAX_TABLE_BYTES >> 20);
    eng->m.max_blocks = (int32_t)max_blocks;
    eng->m.max_meta_seqs = (int32_t)meta_seqs;
    eng->m.tokens = malloc(T * sizeof(int32_t));
    eng->m.positions = malloc(T * sizeof(int32_t));
    eng->m.slots = malloc(T * sizeof(int32_t));
    eng->m.seq_start = malloc((meta_seqs + 1) * sizeof(int32_t));
    eng->m.seq_len = malloc(meta_seqs * sizeof(int32_t));
    eng->m.block_tables = malloc(table_bytes);
    eng->m.logit_rows = malloc(R * sizeof(int32_t));
    if (!eng->m.tokens || !eng->m.positions || !eng->m.slots || !eng->m.seq_start ||
        !eng->m.seq_len || !eng->m.block_tables || !eng->m.logit_rows)
        return td_errorf(TD_ERR_NOMEM, "engine: out of memory for step metadata");
    if (moe) {
        eng->m.route_logits = malloc(T * E * sizeof(float)); /* T * E: checked above (router) */
        eng->m.route_ids = malloc(TK * sizeof(int32_t));
        eng->m.route_w = malloc(TK * sizeof(float));
        eng->m.group_rows = malloc(TK * sizeof(int32_t));
        eng->m.slot_rows = malloc(TK * sizeof(int32_t));
        eng->m.expert_start = malloc((E + 1) * sizeof(int32_t));
        if (!eng->m.route_logits || !eng->m.route_ids || !eng->m.route_w || !eng->m.group_rows ||
            !eng->m.slot_rows || !eng->m.expert_start)
            return td_errorf(TD_ERR_NOMEM, "engine: out of memory for the routing of %zu rows", T);
    }
    return TD_OK;
}

static void free_state(td_engine_t *eng)
{
    void *bufs[] = {eng->s.x,    eng->s.xb,     eng->s.q,        eng->s.k,      eng->s.v,
                    eng->s.att,  eng->s.gate,   eng->s.up,       eng->s.rows,   eng->s.logits,
                    eng->s.inv_freq, eng->s.router, eng->s.moe_in, eng->s.moe_out};
    for (size_t i = 0; i < TD_ARRAY_LEN(bufs); i++)
        if (bufs[i])
            eng->be->ops->free(eng->be, bufs[i]);
    free(eng->m.tokens);
    free(eng->m.positions);
    free(eng->m.slots);
    free(eng->m.seq_start);
    free(eng->m.seq_len);
    free(eng->m.block_tables);
    free(eng->m.logit_rows);
    free(eng->m.route_logits);
    free(eng->m.route_ids);
    free(eng->m.route_w);
    free(eng->m.group_rows);
    free(eng->m.slot_rows);
    free(eng->m.expert_start);
}

td_status_t td_engine_create(const td_model_t *model, td_backend_t *be,
                             const td_engine_config_t *cfg, td_engine_t **eng_p)
{
    td_status_t st = check_config(cfg);
    if (st != TD_OK)
        return st;
    const td_model_config_t *c = &model->config;
    if (!((be->kv_dtypes >> cfg->kv_dtype) & 1u))
        return td_errorf(TD_ERR_UNSUPPORTED, "engine: the %s backend has no %s KV cache",
                         be->ops->name, td_dtype_name(cfg->kv_dtype));
    if (cfg->weight_dtype != TD_ENGINE_WEIGHTS_AS_STORED && !((be->weight_dtypes >> cfg->weight_dtype) & 1u))
        return td_errorf(TD_ERR_UNSUPPORTED, "engine: the %s backend has no %s weights", be->ops->name,
                         td_dtype_name((td_dtype_t)cfg->weight_dtype));
    if (cfg->weight_quant >= 0 && !((be->weight_dtypes >> cfg->weight_quant) & 1u))
        return td_errorf(TD_ERR_UNSUPPORTED, "engine: the %s backend has no kernels for %s weights: run without "
                                             "--quant, or on the CPU",
                         be->ops->name, td_dtype_name((td_dtype_t)cfg->weight_quant));
    if (c->head_dim > 1024 || c->head_dim % 2)
        return td_errorf(TD_ERR_UNSUPPORTED, "engine: head_dim %d must be even and at most 1024",
                         c->head_dim);
    if (c->head_dim % (int)td_dtype_block_elems(cfg->kv_dtype) != 0)
        return td_errorf(TD_ERR_UNSUPPORTED, "engine: a %s KV cache needs head_dim a multiple of %zu, and this "
                         "model's is %d: use --kv-dtype f16 or bf16", td_dtype_name(cfg->kv_dtype),
                         td_dtype_block_elems(cfg->kv_dtype), c->head_dim);
    if (cfg->kv_pool && (!be->host_memory || cfg->n_blocks <= 0))
        return td_errorf(TD_ERR_INVALID, "engine: a caller-provided KV pool needs a host-memory backend "
                                         "(%s is not) and an explicit n_blocks (%d)",
                         be->ops->name, cfg->n_blocks);

    td_engine_t *eng = calloc(1, sizeof *eng);
    if (!eng)
        return td_errorf(TD_ERR_NOMEM, "engine: out of memory");
    eng->model = model;
    eng->be = be;
    eng->cfg = *cfg;
    eng->kv_window = td_model_kv_window(c);
    td_engine_kv_layout_for(model, cfg, &eng->layout);
    size_t per_block = (size_t)c->n_layers * td_kv_block_bytes(&eng->layout);
    int64_t n_blocks = cfg->n_blocks ? cfg->n_blocks : (int64_t)(cfg->kv_mem_bytes / per_block);
    if (n_blocks > INT32_MAX / 2)
        n_blocks = INT32_MAX / 2;
    if (n_blocks < 1) {
        st = td_errorf(TD_ERR_INVALID,
                       "engine: a KV budget of %zu bytes holds no block (%zu bytes each): raise --kv-mem",
                       cfg->kv_mem_bytes, per_block);
        goto err_eng;
    }
    eng->n_blocks = (int32_t)n_blocks;

    if ((st = upload_weights(eng)) != TD_OK)
        goto err_weights;
    if ((st = alloc_state(eng)) != TD_OK)
        goto err_state;
    if (cfg->kv_pool)
        eng->kv_pool = cfg->kv_pool;
    else if ((st = be->ops->alloc(be, td_kv_pool_bytes(&eng->layout, (uint32_t)eng->n_blocks),
                                  &eng->kv_pool)) != TD_OK)
        goto err_state;
    td_kv_config_t kc = {.n_blocks = eng->n_blocks, .block_size = cfg->block_size,
                         .prefix_cache = cfg->prefix_cache};
    if ((st = td_kv_cache_create(&kc, &eng->kv)) != TD_OK)
        goto err_pool;
    td_debug("engine: %d kv blocks of %d tokens (%zu bytes), %zu weight bytes", eng->n_blocks,
             cfg->block_size, per_block * (size_t)eng->n_blocks, eng->weight_bytes);
    *eng_p = eng;
    return TD_OK;

err_pool:
    if (!cfg->kv_pool)
        be->ops->free(be, eng->kv_pool);
err_state:
    free_state(eng);
err_weights:
    free_weights(eng);
err_eng:
    free(eng);
    return st;
}

void td_engine_destroy(td_engine_t *eng)
{
    if (!eng)
        return;
    td_kv_cache_destroy(eng->kv);
    if (!eng->cfg.kv_pool)
        eng->be->ops->free(eng->be, eng->kv_pool);
    free_state(eng);
    free_weights(eng);
    free(eng);
}
