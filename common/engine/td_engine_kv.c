/*
 * td_engine_kv: an engine's sequences over its KV cache (prefix matches, the sliding
 * window's release, rollback, end), the KV layout a model and a config give, and the sizing
 * of a KV pool from flags and the memory available (td_engine.h "KV pool sizing").
 */
#include "td_engine.h"

#include <stdio.h>

#include "td_engine_impl.h"
#include "td_util.h"

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

/* ---- the KV layout ------------------------------------------------------------------ */

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
