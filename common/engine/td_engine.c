/*
 * td_engine: the forward pass (llama2.c's layer loop, batched and paged).
 *
 *   x      = embed(tokens)                                  [T][dim]
 *   for each layer:
 *     xb   = rmsnorm(x) * attn_norm
 *     q,k,v = xb . Wq, Wk, Wv (+ biases)                    [T][heads][head_dim]
 *     q,k  = rmsnorm per head (Qwen3 only)
 *     q,k  = rope(q, k) at each row's position, and in the same pass (one op)
 *     cache[layer][slot(row)] = k, v
 *     att  = attention(q, cache)   prefill (tiles, causal) or decode (split-KV); a
 *                                  sliding layer sees only its last `window` positions
 *     x   += att . Wo                                       (residual fused in the GEMM)
 *     xb   = rmsnorm(x) * ffn_norm
 *     x   += (silu(xb . Wgate) * (xb . Wup)) . Wdown
 *          or, a mixture of experts: the router picks k experts e_r of a row with weights g_r
 *          (td_engine_moe_route), and for each row
 *     x   += sum over r = 0..k-1 of g_r * (silu(xb . Wgate_e_r) * (xb . Wup_e_r)) . Wdown_e_r
 *          computed as one matmul per expert over the rows routed to it (grouped), summed
 *          back per row in the order of r (forward_moe)
 *   logits = rmsnorm(x[rows asked]) * final_norm . Wlm      f32 to the host
 *
 * T is the step's rows: every sequence's new tokens, one sequence after another.
 */
#include "td_engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_util.h"

/* A weight as the backend sees it. */
typedef struct td_dev_tensor {
    const void *data;   /* backend memory (or the model's host memory when usable in place) */
    td_dtype_t dtype;
    bool owned;         /* allocated by the engine on the backend */
    bool packed;        /* ops->weight_pack's form of a [rows][cols] matrix (owned) */
} td_dev_tensor_t;

typedef struct td_layer_dev {
    td_dev_tensor_t attn_norm, wq, wk, wv, bq, bk, bv, q_norm, k_norm, wo;
    td_dev_tensor_t ffn_norm, w_gate, w_up, w_down;
    td_dev_tensor_t router;  /* mixture of experts: (n_experts, dim) */
    td_dev_tensor_t *exp;    /* [n_experts][3]: expert e's gate, up, down at 3e..3e+2; NULL: dense */
} td_layer_dev_t;

/* Per-step scratch on the backend, sized by the config's bounds. */
typedef struct td_engine_state {
    void *x;        /* [max_tokens][dim] residual stream */
    void *xb;       /* [max_tokens][dim] normalised input of a sub-layer */
    void *q;        /* [max_tokens][n_heads * head_dim] */
    void *k;        /* [max_tokens][n_kv_heads * head_dim] */
    void *v;        /* [max_tokens][n_kv_heads * head_dim] */
    void *att;      /* [max_tokens][n_heads * head_dim] attention output */
    void *gate;     /* [max_tokens][hidden_dim]; a mixture: [max_tokens * k][expert_hidden_dim] */
    void *up;       /* as gate */
    float *router;  /* mixture of experts: [max_tokens][n_experts] f32 router logits */
    void *moe_in;   /* [max_tokens * k][dim] xb's rows grouped by expert */
    void *moe_out;  /* [max_tokens * k][dim] each grouped row's expert output */
    void *rows;     /* [max_logit_rows][dim] hidden rows whose logits are wanted */
    void *logits;   /* [max_logit_rows][vocab] f32 */
    float *inv_freq; /* [head_dim / 2] rope frequencies (backend memory) */
} td_engine_state_t;

/* Host-side step metadata, sized by the config's bounds. */
typedef struct td_engine_meta {
    int32_t *tokens;       /* [max_tokens] */
    int32_t *positions;    /* [max_tokens] */
    int32_t *slots;        /* [max_tokens] */
    int32_t *seq_start;    /* [max_meta_seqs + 1] */
    int32_t *seq_len;      /* [max_meta_seqs] */
    int32_t *block_tables; /* [max_meta_seqs][max_blocks] */
    int32_t *logit_rows;   /* [max_logit_rows] */
    int32_t max_blocks;
    int32_t max_meta_seqs; /* max_seqs + max_logit_rows: a verify item's rows are each a
                              sequence of their own to the backend (build_meta) */
    /* mixture of experts, host: the routing of a step's rows (k = n_experts_used) */
    float *route_logits;   /* [max_tokens][n_experts] */
    int32_t *route_ids;    /* [max_tokens][k] expert of each row's rank r */
    float *route_w;        /* [max_tokens][k] its weight */
    int32_t *group_rows;   /* [max_tokens * k] the row of each grouped row (by expert, rows in order) */
    int32_t *slot_rows;    /* [max_tokens][k] the grouped row of (row, rank) */
    int32_t *expert_start; /* [n_experts + 1] first grouped row of each expert */
} td_engine_meta_t;

struct td_engine {
    const td_model_t *model;
    td_backend_t *be;
    td_engine_config_t cfg;
    td_kv_layout_t layout;
    td_kv_cache_t *kv;
    void *kv_pool;          /* backend memory, td_kv_pool_bytes(layout, n_blocks) */
    int32_t n_blocks;
    td_dev_tensor_t embed, final_norm, lm_head;
    td_layer_dev_t *layers; /* [n_layers] */
    td_engine_state_t s;
    td_engine_meta_t m;
    size_t weight_bytes;
    size_t expert_bytes;    /* of weight_bytes, the experts' (all of them) */
    uint32_t said_dequant;  /* bit t: the log said block type t is dequantized at load */
    bool said_unquantized;  /* the log said some matrices cannot take --quant */
    int32_t kv_window;      /* td_model_kv_window: 0 when some layer reads the whole context */
    td_engine_layer_cb layer_cb; /* td_engine_set_layer_hook; NULL: none */
    void *layer_arg;
};

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

/* A block-typed matrix in the backend's packed form (ops->weight_pack), from the host
 * tensor t converted to `want` (--quant) when it is stored otherwise. out->data stays NULL
 * when the backend keeps the matrix as stored. */
static td_status_t pack_tensor(td_engine_t *eng, const td_tensor_t *t, td_dtype_t want, td_dev_tensor_t *out)
{
    td_backend_t *be = eng->be;
    if (!be->ops->weight_pack || t->n_dims != 2 || !td_dtype_is_block(want))
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

/* ---- sequences -------------------------------------------------------------------- */

td_status_t td_engine_seq_start(td_engine_t *eng, td_kv_seq_t *seq, const int32_t *tokens,
                                int32_t n, int32_t *n_cached_p)
{
    int32_t cached = 0;
    /* never leave one row to compute (the header says why): a prompt of 17 tokens with its
       first block cached is computed whole, one of 33 from token 16 on */
    if (eng->cfg.prefix_cache && n > 2) {
        td_status_t st = td_kv_seq_match_prefix(eng->kv, seq, tokens, n, n - 2, &cached);
        if (st != TD_OK)
            return st;
    }
    *n_cached_p = cached;
    return TD_OK;
}

int32_t td_engine_seq_release_window(td_engine_t *eng, td_kv_seq_t *seq)
{
    if (eng->kv_window == 0)
        return 0;
    /* the next query sits at n_tokens and reads keys from n_tokens - window + 1 on */
    return td_kv_seq_release_before(eng->kv, seq, seq->n_tokens - eng->kv_window + 1);
}

void td_engine_seq_rollback(td_engine_t *eng, td_kv_seq_t *seq, int32_t n_keep)
{
    td_kv_seq_truncate(eng->kv, seq, n_keep);
}

void td_engine_seq_end(td_engine_t *eng, td_kv_seq_t *seq)
{
    td_kv_seq_free(eng->kv, seq);
}

/* ---- the step --------------------------------------------------------------------- */

/* Checks a step's items; *decode_p: every item is one row or a verify item, so the step runs
 * the decode attention kernel (td_engine_item_t.verify). */
static td_status_t check_items(const td_engine_t *eng, const td_engine_item_t *items, int32_t n_items,
                               int32_t *n_tokens_p, int32_t *n_logits_p, int32_t *max_q_p, bool *decode_p)
{
    const td_model_config_t *c = &eng->model->config;
    if (n_items <= 0 || n_items > eng->cfg.max_seqs)
        return td_errorf(TD_ERR_RANGE, "engine: %d sequences in a step (limit %d)", n_items,
                         eng->cfg.max_seqs);
    int64_t total = 0, logits = 0, meta_seqs = 0;
    int32_t max_q = 0, n_verify = 0, n_prefill = 0;
    for (int32_t i = 0; i < n_items; i++) {
        const td_engine_item_t *it = &items[i];
        if (it->n_tokens <= 0 || it->n_logits < 0 || it->n_logits > it->n_tokens)
            return td_errorf(TD_ERR_INVALID, "engine: item %d has %d tokens and asks %d logits", i,
                             it->n_tokens, it->n_logits);
        if (it->verify && it->n_logits != it->n_tokens)
            return td_errorf(TD_ERR_INVALID, "engine: verify item %d asks %d logits of its %d rows: a verify "
                             "item asks every row's", i, it->n_logits, it->n_tokens);
        n_verify += it->verify;
        n_prefill += !it->verify && it->n_tokens > 1;
        meta_seqs += it->verify ? it->n_tokens : 1;
        if ((int64_t)it->seq->n_tokens + it->n_tokens > c->max_seq_len)
            return td_errorf(TD_ERR_RANGE,
                             "engine: sequence would reach %d tokens, the model's limit is %d",
                             it->seq->n_tokens + it->n_tokens, c->max_seq_len);
        /* the kernels never read a released block: the step's first row must not need one */
        if (it->seq->n_released > 0 &&
            (eng->kv_window == 0 ||
             (int64_t)it->seq->n_released * eng->cfg.block_size > it->seq->n_tokens - eng->kv_window + 1))
            return td_errorf(TD_ERR_INVALID,
                             "engine: item %d gave back %d blocks that a query at position %d still reads "
                             "(window %d): release only with td_engine_seq_release_window", i,
                             it->seq->n_released, it->seq->n_tokens, eng->kv_window);
        for (int32_t j = 0; j < it->n_tokens; j++)
            if (it->tokens[j] < 0 || it->tokens[j] >= c->vocab_size)
                return td_errorf(TD_ERR_RANGE, "engine: token id %d outside the vocabulary [0, %d)",
                                 it->tokens[j], c->vocab_size);
        total += it->n_tokens;
        logits += it->n_logits;
        max_q = TD_MAX(max_q, it->n_tokens);
    }
    if (total > eng->cfg.max_batch_tokens)
        return td_errorf(TD_ERR_RANGE, "engine: %lld tokens in a step (limit %d)", (long long)total,
                         eng->cfg.max_batch_tokens);
    if (logits > eng->cfg.max_logit_rows)
        return td_errorf(TD_ERR_RANGE, "engine: %lld logit rows in a step (limit %d)",
                         (long long)logits, eng->cfg.max_logit_rows);
    if (n_verify > 0 && n_prefill > 0)
        return td_errorf(TD_ERR_INVALID, "engine: %d verify items share a step with %d prefill pieces: the "
                         "prefill kernel would run their rows; step them apart", n_verify, n_prefill);
    TD_ASSERT(meta_seqs <= eng->m.max_meta_seqs);
    *decode_p = n_prefill == 0;
    *n_tokens_p = (int32_t)total;
    *n_logits_p = (int32_t)logits;
    *max_q_p = max_q;
    return TD_OK;
}

/* Reserves cache room for every item and applies copy-on-write copies. */
static td_status_t reserve_items(td_engine_t *eng, const td_engine_item_t *items, int32_t n_items)
{
    for (int32_t i = 0; i < n_items; i++) {
        td_kv_cow_t cow = {0};
        td_kv_seq_t *seq = items[i].seq;
        td_status_t st = td_kv_seq_reserve(eng->kv, seq, seq->n_tokens + items[i].n_tokens, &cow);
        if (st != TD_OK)
            return st;
        if (cow.n > 0) {
            st = eng->be->ops->copy_blocks(eng->be, eng->kv_pool, &eng->layout, eng->n_blocks,
                                           cow.src, cow.dst, cow.n);
            if (st != TD_OK)
                return st;
        }
    }
    return TD_OK;
}

/* The backend's view of the step. A verify item's row at position p is given to the backend
 * as a sequence of its own, one row long, of context p + 1 over the same block table: the
 * decode kernel then computes it exactly as the one-row step at p would (same partitions,
 * same merge), and never reads the K/V of the later rows written in this step. */
static void build_meta(td_engine_t *eng, const td_engine_item_t *items, int32_t n_items,
                       int32_t n_tokens, int32_t max_q, td_step_meta_t *meta)
{
    td_engine_meta_t *m = &eng->m;
    int32_t bs = eng->cfg.block_size, row = 0, lrow = 0, max_len = 0, ms = 0;
    for (int32_t i = 0; i < n_items; i++) {
        const td_engine_item_t *it = &items[i];
        const td_kv_seq_t *seq = it->seq;
        for (int32_t j = 0; j < it->n_tokens; j++, row++) {
            int32_t pos = seq->n_tokens + j;
            if (j == 0 || it->verify) {
                m->seq_start[ms] = row;
                m->seq_len[ms] = it->verify ? pos + 1 : seq->n_tokens + it->n_tokens;
                max_len = TD_MAX(max_len, m->seq_len[ms]);
                int32_t *bt = m->block_tables + (size_t)ms * m->max_blocks;
                memcpy(bt, seq->blocks, (size_t)seq->n_blocks * sizeof(int32_t));
                ms++;
            }
            m->tokens[row] = it->tokens[j];
            m->positions[row] = pos;
            m->slots[row] = seq->blocks[pos / bs] * bs + pos % bs;
            if (j >= it->n_tokens - it->n_logits)
                m->logit_rows[lrow++] = row;
        }
    }
    m->seq_start[ms] = row;
    *meta = (td_step_meta_t){
        .n_tokens = n_tokens,
        .n_seqs = ms,
        .tokens = m->tokens,
        .positions = m->positions,
        .slots = m->slots,
        .seq_start = m->seq_start,
        .seq_len = m->seq_len,
        .block_tables = m->block_tables,
        .max_blocks = m->max_blocks,
        .max_q_len = max_q,
        .max_seq_len = max_len,
    };
}

static td_status_t mm(td_backend_t *be, int32_t m, const td_dev_tensor_t *w, int32_t n, int32_t k,
                      const void *x, const td_dev_tensor_t *bias, void *y, bool accumulate)
{
    td_matmul_params_t p = {
        .m = m, .n = n, .k = k, .x = x, .w = w->data, .w_dtype = w->dtype, .w_packed = w->packed,
        .bias = bias ? bias->data : NULL, .bias_dtype = bias ? bias->dtype : TD_F32, .y = y, .accumulate = accumulate,
    };
    return be->ops->matmul(be, &p);
}

void td_engine_moe_route(const float *logits, int32_t n_experts, int32_t k, bool norm_topk, int32_t *ids,
                         float *weights)
{
    /* one pass, keeping the best k so far in order: expert e goes in before the first kept
       one whose logit it strictly exceeds, so among equal logits the lower id stays first */
    int32_t n = 0;
    for (int32_t e = 0; e < n_experts; e++) {
        int32_t at = n;
        while (at > 0 && logits[e] > logits[ids[at - 1]])
            at--;
        if (at >= k)
            continue;
        for (int32_t q = TD_MIN(n, k - 1); q > at; q--)
            ids[q] = ids[q - 1];
        ids[at] = e;
        n = TD_MIN(n + 1, k);
    }
    /* softmax in double: exp of (logit - the top one), over the k picked or over all */
    double top = logits[ids[0]], sum = 0.0;
    if (norm_topk)
        for (int32_t r = 0; r < k; r++)
            sum += exp((double)logits[ids[r]] - top);
    else
        for (int32_t e = 0; e < n_experts; e++)
            sum += exp((double)logits[e] - top);
    for (int32_t r = 0; r < k; r++)
        weights[r] = (float)(exp((double)logits[ids[r]] - top) / sum);
}

/*
 * The FFN of a mixture of experts over the step's T rows of xb, added to x. The router's
 * logits come to the host, which routes each row (td_engine_moe_route) and groups the rows
 * by expert (a counting sort: expert by expert, rows in step order); one gather makes the
 * grouped input, each expert's three matmuls run on its group alone (the backend's own
 * matmul on a slice: m = the rows routed to it), one swiglu covers every group, and
 * moe_combine sums each row's k outputs into x in rank order. A row's result depends only
 * on its own values: the matmul is batch-invariant (docs/kernels.md) and the sum's order is
 * the row's ranks, whatever else the step routed where.
 */
static td_status_t forward_moe(td_engine_t *eng, const td_layer_dev_t *w, int32_t T)
{
    const td_model_config_t *c = &eng->model->config;
    td_backend_t *be = eng->be;
    td_engine_state_t *s = &eng->s;
    td_engine_meta_t *m = &eng->m;
    int32_t E = c->n_experts, K = c->n_experts_used, D = c->dim, F = c->expert_hidden_dim;
    size_t act = td_dtype_size(be->act_dtype);
    td_status_t st;
    td_matmul_params_t rp = {
        .m = T, .n = E, .k = D, .x = s->xb, .w = w->router.data, .w_dtype = w->router.dtype,
        .w_packed = w->router.packed, .y = s->router, .y_f32 = true,
    };
    if ((st = be->ops->matmul(be, &rp)) != TD_OK ||
        (st = be->ops->copy_d2h(be, m->route_logits, s->router, (size_t)T * E * sizeof(float))) != TD_OK)
        return st;

    int32_t *start = m->expert_start;
    memset(start, 0, ((size_t)E + 1) * sizeof *start);
    for (int32_t t = 0; t < T; t++) {
        td_engine_moe_route(m->route_logits + (size_t)t * E, E, K, c->moe_norm_topk, m->route_ids + (size_t)t * K,
                            m->route_w + (size_t)t * K);
        for (int32_t r = 0; r < K; r++)
            start[m->route_ids[(size_t)t * K + r] + 1]++;
    }
    for (int32_t e = 0; e < E; e++)
        start[e + 1] += start[e];
    /* fill: start[e] walks through expert e's group, then is restored */
    for (int32_t t = 0; t < T; t++)
        for (int32_t r = 0; r < K; r++) {
            int32_t g = start[m->route_ids[(size_t)t * K + r]]++;
            m->group_rows[g] = t;
            m->slot_rows[(size_t)t * K + r] = g;
        }
    for (int32_t e = E; e > 0; e--)
        start[e] = start[e - 1];
    start[0] = 0;

    if ((st = be->ops->gather_rows(be, s->moe_in, s->xb, m->group_rows, T * K, D)) != TD_OK)
        return st;
    for (int32_t e = 0; e < E; e++) {
        int32_t n = start[e + 1] - start[e];
        if (n == 0)
            continue;
        const void *x = (const char *)s->moe_in + (size_t)start[e] * D * act;
        void *g = (char *)s->gate + (size_t)start[e] * F * act, *u = (char *)s->up + (size_t)start[e] * F * act;
        if ((st = mm(be, n, &w->exp[3 * e], F, D, x, NULL, g, false)) != TD_OK ||
            (st = mm(be, n, &w->exp[3 * e + 1], F, D, x, NULL, u, false)) != TD_OK)
            return st;
    }
    if ((st = be->ops->swiglu(be, s->gate, s->gate, s->up, T * K, F)) != TD_OK)
        return st;
    for (int32_t e = 0; e < E; e++) {
        int32_t n = start[e + 1] - start[e];
        if (n == 0)
            continue;
        const void *g = (const char *)s->gate + (size_t)start[e] * F * act;
        void *y = (char *)s->moe_out + (size_t)start[e] * D * act;
        if ((st = mm(be, n, &w->exp[3 * e + 2], D, F, g, NULL, y, false)) != TD_OK)
            return st;
    }
    return be->ops->moe_combine(be, s->x, s->moe_out, m->slot_rows, m->route_w, T, K, D);
}

static td_status_t forward_layer(td_engine_t *eng, int32_t l, int32_t T, bool decode)
{
    const td_model_config_t *c = &eng->model->config;
    const td_layer_dev_t *w = &eng->layers[l];
    td_backend_t *be = eng->be;
    const td_backend_ops_t *ops = be->ops;
    td_engine_state_t *s = &eng->s;
    int32_t qd = c->n_heads * c->head_dim, kvd = c->n_kv_heads * c->head_dim;
    td_status_t st;

#define TRY(call)                   \
    if ((st = (call)) != TD_OK)     \
        return st;
    /* attention sub-layer */
    TRY(ops->rmsnorm(be, s->xb, s->x, NULL, w->attn_norm.data, w->attn_norm.dtype, T, c->dim,
                     c->norm_eps));
    TRY(mm(be, T, &w->wq, qd, c->dim, s->xb, w->bq.data ? &w->bq : NULL, s->q, false));
    TRY(mm(be, T, &w->wk, kvd, c->dim, s->xb, w->bk.data ? &w->bk : NULL, s->k, false));
    TRY(mm(be, T, &w->wv, kvd, c->dim, s->xb, w->bv.data ? &w->bv : NULL, s->v, false));
    if (c->qk_norm) {
        TRY(ops->rmsnorm(be, s->q, s->q, NULL, w->q_norm.data, w->q_norm.dtype, T * c->n_heads,
                         c->head_dim, c->norm_eps));
        TRY(ops->rmsnorm(be, s->k, s->k, NULL, w->k_norm.data, w->k_norm.dtype,
                         T * c->n_kv_heads, c->head_dim, c->norm_eps));
    }
    void *kv_layer = (char *)eng->kv_pool + td_kv_block_offset(&eng->layout, (uint32_t)eng->n_blocks,
                                                                (uint32_t)l, 0);
    td_rope_kv_params_t rp = {.q = s->q, .k = s->k, .v = s->v, .n_heads = c->n_heads,
                              .inv_freq = s->inv_freq, .style = c->rope_style,
                              .kv_layer = kv_layer, .layout = &eng->layout,
                              .n_blocks = eng->n_blocks};
    TRY(ops->rope_kv_write(be, &rp));
    td_attn_params_t ap = {
        .q = s->q, .out = s->att, .kv_layer = kv_layer, .layout = &eng->layout,
        .n_blocks = eng->n_blocks, .n_heads = c->n_heads,
        .scale = 1.0f / sqrtf((float)c->head_dim), .partition_tokens = eng->cfg.partition_tokens,
        .window = td_model_layer_window(c, l),
    };
    TRY(decode ? ops->attn_decode(be, &ap) : ops->attn_prefill(be, &ap));
    TRY(mm(be, T, &w->wo, c->dim, qd, s->att, NULL, s->x, true));

    /* feed-forward sub-layer */
    TRY(ops->rmsnorm(be, s->xb, s->x, NULL, w->ffn_norm.data, w->ffn_norm.dtype, T, c->dim,
                     c->norm_eps));
    if (w->exp)
        return forward_moe(eng, w, T);
    TRY(mm(be, T, &w->w_gate, c->hidden_dim, c->dim, s->xb, NULL, s->gate, false));
    TRY(mm(be, T, &w->w_up, c->hidden_dim, c->dim, s->xb, NULL, s->up, false));
    TRY(ops->swiglu(be, s->gate, s->gate, s->up, T, c->hidden_dim));
    TRY(mm(be, T, &w->w_down, c->dim, c->hidden_dim, s->gate, NULL, s->x, true));
#undef TRY
    return TD_OK;
}

td_status_t td_engine_step(td_engine_t *eng, const td_engine_item_t *items, int32_t n_items,
                           float *logits)
{
    const td_model_config_t *c = &eng->model->config;
    td_backend_t *be = eng->be;
    int32_t T = 0, n_logits = 0, max_q = 0;
    bool decode = false;
    td_status_t st = check_items(eng, items, n_items, &T, &n_logits, &max_q, &decode);
    if (st != TD_OK)
        return st;
    if (n_logits > 0 && !logits)
        return td_errorf(TD_ERR_INVALID, "engine: logits asked but no output buffer given");
    if ((st = reserve_items(eng, items, n_items)) != TD_OK)
        return st;

    td_step_meta_t meta;
    build_meta(eng, items, n_items, T, decode ? 1 : max_q, &meta);
    if ((st = be->ops->set_step(be, &meta)) != TD_OK)
        return st;
    if ((st = be->ops->embed(be, eng->s.x, eng->embed.data, eng->embed.dtype, c->dim)) != TD_OK)
        return st;
    for (int32_t l = 0; l < c->n_layers; l++) {
        if ((st = forward_layer(eng, l, T, decode)) != TD_OK)
            return st;
        if (eng->layer_cb) {
            /* the hook's reader (a transfer) may read the pool right away */
            if ((st = be->ops->sync(be)) != TD_OK)
                return st;
            eng->layer_cb(eng->layer_arg, (uint32_t)l);
        }
    }

    if (n_logits > 0) {
        st = be->ops->gather_rows(be, eng->s.rows, eng->s.x, eng->m.logit_rows, n_logits, c->dim);
        if (st == TD_OK)
            st = be->ops->rmsnorm(be, eng->s.rows, eng->s.rows, NULL, eng->final_norm.data,
                                  eng->final_norm.dtype, n_logits, c->dim, c->norm_eps);
        if (st == TD_OK) {
            td_matmul_params_t p = {
                .m = n_logits, .n = c->vocab_size, .k = c->dim, .x = eng->s.rows,
                .w = eng->lm_head.data, .w_dtype = eng->lm_head.dtype, .w_packed = eng->lm_head.packed,
                .y = eng->s.logits,
                .y_f32 = true,
            };
            st = be->ops->matmul(be, &p);
        }
        if (st == TD_OK)
            st = be->ops->copy_d2h(be, logits, eng->s.logits,
                                   (size_t)n_logits * c->vocab_size * sizeof(float));
        if (st != TD_OK)
            return st;
    } else if ((st = be->ops->sync(be)) != TD_OK) {
        return st;
    }

    for (int32_t i = 0; i < n_items; i++)
        if ((st = td_kv_seq_commit(eng->kv, items[i].seq, items[i].tokens, items[i].n_tokens)) != TD_OK)
            return st;
    return TD_OK;
}

/* ---- accessors -------------------------------------------------------------------- */

const td_model_config_t *td_engine_model_config(const td_engine_t *eng)
{
    return &eng->model->config;
}

const td_engine_config_t *td_engine_config(const td_engine_t *eng)
{
    return &eng->cfg;
}

const td_kv_layout_t *td_engine_kv_layout(const td_engine_t *eng)
{
    return &eng->layout;
}

td_kv_cache_t *td_engine_kv(td_engine_t *eng)
{
    return eng->kv;
}

void *td_engine_kv_pool(td_engine_t *eng, int32_t *n_blocks_p)
{
    if (n_blocks_p)
        *n_blocks_p = eng->n_blocks;
    return eng->kv_pool;
}

td_backend_t *td_engine_backend(td_engine_t *eng)
{
    return eng->be;
}

void td_engine_set_layer_hook(td_engine_t *eng, td_engine_layer_cb cb, void *arg)
{
    eng->layer_cb = cb;
    eng->layer_arg = cb ? arg : NULL;
}

size_t td_engine_weight_bytes(const td_engine_t *eng)
{
    return eng->weight_bytes;
}

size_t td_engine_active_weight_bytes(const td_engine_t *eng)
{
    const td_model_config_t *c = &eng->model->config;
    if (c->n_experts == 0)
        return eng->weight_bytes;
    /* every expert of a layer has the same shape (and, in every file we load, the same type) */
    size_t idle = (size_t)((double)eng->expert_bytes * (c->n_experts - c->n_experts_used) / c->n_experts);
    return eng->weight_bytes - idle;
}

void td_engine_kv_layout_for(const td_model_t *model, const td_engine_config_t *cfg,
                             td_kv_layout_t *layout)
{
    const td_model_config_t *c = &model->config;
    *layout = (td_kv_layout_t){
        .model_fingerprint = model->fingerprint,
        .dtype = (uint32_t)cfg->kv_dtype,
        .block_size = (uint32_t)cfg->block_size,
        .n_layers = (uint32_t)c->n_layers,
        .n_kv_heads = (uint32_t)c->n_kv_heads,
        .head_dim = (uint32_t)c->head_dim,
        .version = TD_KV_LAYOUT_VERSION,
    };
}

size_t td_engine_kv_block_bytes(const td_model_t *model, const td_engine_config_t *cfg)
{
    td_kv_layout_t ly;
    td_engine_kv_layout_for(model, cfg, &ly);
    return (size_t)ly.n_layers * td_kv_block_bytes(&ly);
}

/* ---- KV pool sizing (td_engine.h) ------------------------------------------------------ */

/* The budget for avail bytes available (measured false: unknown, the fallback). */
static td_kv_budget_t kv_budget_of(bool measured, size_t avail, int32_t percent, size_t cap, size_t fallback)
{
    td_kv_budget_t b = {.bytes = fallback, .percent = percent};
    if (!measured)
        return b;
    b.measured = true;
    b.available = avail;
    b.bytes = (size_t)((double)avail * percent / 100.0);
    if (b.bytes > cap) {
        b.bytes = cap;
        b.capped = true;
    }
    return b;
}

td_kv_budget_t td_engine_kv_budget(int32_t percent, size_t cap, size_t fallback)
{
    size_t avail = 0;
    bool measured = td_mem_available(&avail) == TD_OK; /* an error is logged there */
    return kv_budget_of(measured, avail, percent, cap, fallback);
}

const char *td_engine_kv_budget_describe(const td_kv_budget_t *b, char *buf, size_t cap)
{
    char a[32], c[32];
    if (!b->measured)
        snprintf(buf, cap, "a fixed default (available memory unknown)");
    else if (b->capped)
        snprintf(buf, cap, "the %s cap (%d%% of %s available is more)", td_format_bytes(b->bytes, c, sizeof c),
                 b->percent, td_format_bytes(b->available, a, sizeof a));
    else
        snprintf(buf, cap, "%d%% of %s available", b->percent, td_format_bytes(b->available, a, sizeof a));
    return buf;
}

td_status_t td_engine_kv_plan(const td_model_t *model, const td_engine_config_t *cfg,
                              const td_kv_plan_params_t *p, td_kv_plan_t *plan_p)
{
    size_t bb = td_engine_kv_block_bytes(model, cfg);
    int32_t bs = cfg->block_size;
    char why[160], use[128] = "", s1[32], s2[32];
    td_kv_budget_t b = {0};
    bool host = !p->device;
    size_t avail = 0;
    bool have_avail = host && td_mem_available(&avail) == TD_OK;
    int64_t n;
    if (p->n_blocks > 0) {
        n = p->n_blocks;
        snprintf(why, sizeof why, "--kv-blocks");
    } else {
        if (p->kv_mem) {
            b.bytes = p->kv_mem;
            if (have_avail && p->kv_mem > avail)
                return td_errorf(TD_ERR_NOMEM, "--kv-mem %s is more than the %s of memory available: lower "
                                 "--kv-mem (or leave it out: the default is a share of what is available)",
                                 td_format_bytes(p->kv_mem, s1, sizeof s1), td_format_bytes(avail, s2, sizeof s2));
            snprintf(why, sizeof why, "kv-mem %s: --kv-mem", td_format_bytes(b.bytes, s1, sizeof s1));
        } else {
            b = host ? kv_budget_of(have_avail, avail, p->percent, p->cap, p->device_default)
                     : (td_kv_budget_t){.bytes = p->device_default};
            char d[96];
            if (host)
                td_engine_kv_budget_describe(&b, d, sizeof d);
            else
                snprintf(d, sizeof d, "the fixed default for device memory");
            snprintf(why, sizeof why, "kv-mem %s: %s", td_format_bytes(b.bytes, s1, sizeof s1), d);
        }
        n = (int64_t)(b.bytes / bb);
        if (n < 1)
            return td_errorf(TD_ERR_INVALID, "a KV budget of %s holds no block (%s each): raise --kv-mem or set "
                             "--kv-blocks", td_format_bytes(b.bytes, s1, sizeof s1), td_format_bytes(bb, s2, sizeof s2));
        int64_t useful = p->useful_tokens > 0 ? TD_DIV_CEIL(p->useful_tokens, (int64_t)bs) : 0;
        if (useful > 0 && useful < n) {
            snprintf(use, sizeof use, "what %s can use; ", p->useful_what ? p->useful_what : "the node");
            n = useful;
        }
    }
    if (n > (1 << 24)) /* the kv-blocks key's bound, and td_kv's metadata stays small */
        n = 1 << 24;
    size_t bytes = (size_t)n * bb;
    if (have_avail && bytes > avail)
        return td_errorf(TD_ERR_NOMEM, "a KV pool of %lld blocks (%s) is more than the %s of memory available: "
                         "lower %s", (long long)n, td_format_bytes(bytes, s1, sizeof s1),
                         td_format_bytes(avail, s2, sizeof s2), p->n_blocks > 0 ? "--kv-blocks" : "--kv-mem");
    plan_p->n_blocks = (int32_t)n;
    plan_p->pool_bytes = bytes;
    snprintf(plan_p->line, sizeof plan_p->line, "%lld blocks x %d tokens = %lld tokens, %s (%s%s)", (long long)n,
             bs, (long long)n * bs, td_format_bytes(bytes, s1, sizeof s1), use, why);
    return TD_OK;
}
