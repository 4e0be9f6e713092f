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
 *
 * Here: the step and the accessors. The engine's making (weights, buffers, the pool) is in
 * td_engine_create.c, its sequences and the KV sizing in td_engine_kv.c.
 */
#include "td_engine.h"

#include <math.h>
#include <string.h>

#include "td_engine_impl.h"
#include "td_util.h"

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

static td_matmul_params_t mm_params(int32_t m, const td_dev_tensor_t *w, int32_t n, int32_t k, const void *x,
                                     const td_dev_tensor_t *bias, void *y, bool accumulate)
{
    return (td_matmul_params_t){
        .m = m, .n = n, .k = k, .x = x, .w = w->data, .w_dtype = w->dtype, .w_packed = w->packed,
        .bias = bias && bias->data ? bias->data : NULL, .bias_dtype = bias && bias->data ? bias->dtype : TD_F32,
        .y = y, .accumulate = accumulate,
    };
}

static td_status_t mm(td_backend_t *be, int32_t m, const td_dev_tensor_t *w, int32_t n, int32_t k,
                      const void *x, const td_dev_tensor_t *bias, void *y, bool accumulate)
{
    td_matmul_params_t p = mm_params(m, w, n, k, x, bias, y, accumulate);
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
        const td_matmul_params_t gate_up[2] = {mm_params(n, &w->exp[3 * e], F, D, x, NULL, g, false),
                                               mm_params(n, &w->exp[3 * e + 1], F, D, x, NULL, u, false)};
        if ((st = be->ops->matmuls(be, gate_up, 2)) != TD_OK)
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
    const td_matmul_params_t qkv[3] = {mm_params(T, &w->wq, qd, c->dim, s->xb, &w->bq, s->q, false),
                                       mm_params(T, &w->wk, kvd, c->dim, s->xb, &w->bk, s->k, false),
                                       mm_params(T, &w->wv, kvd, c->dim, s->xb, &w->bv, s->v, false)};
    TRY(ops->matmuls(be, qkv, 3));
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
    const td_matmul_params_t gate_up[2] = {mm_params(T, &w->w_gate, c->hidden_dim, c->dim, s->xb, NULL, s->gate, false),
                                           mm_params(T, &w->w_up, c->hidden_dim, c->dim, s->xb, NULL, s->up, false)};
    TRY(ops->matmuls(be, gate_up, 2));
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
