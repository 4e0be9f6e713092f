/*
 * td_spec: drafters and the draft-size controller of speculative decoding (td_spec.h).
 */
#include "td_spec.h"

#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_util.h"

td_spec_config_t td_spec_config_default(void)
{
    return (td_spec_config_t){.mode = TD_SPEC_OFF, .k_max = 8, .ngram_max = 3, .ngram_min = 1, .adaptive = true};
}

static const char *const mode_names[] = {"off", "prompt-lookup", "draft-model"};

td_status_t td_spec_parse_mode(const char *s, td_spec_mode_t *mode_p)
{
    for (size_t i = 0; i < TD_ARRAY_LEN(mode_names); i++)
        if (!strcmp(s, mode_names[i])) {
            *mode_p = (td_spec_mode_t)i;
            return TD_OK;
        }
    return td_errorf_quiet(TD_ERR_INVALID, "--spec: '%s' is not off|prompt-lookup|draft-model", s);
}

const char *td_spec_mode_name(td_spec_mode_t mode)
{
    return (size_t)mode < TD_ARRAY_LEN(mode_names) ? mode_names[mode] : "?";
}

td_status_t td_spec_resolve_mode(td_spec_mode_t *mode, bool have_draft_model)
{
    if (have_draft_model && *mode == TD_SPEC_OFF)
        *mode = TD_SPEC_DRAFT_MODEL;
    if (*mode == TD_SPEC_DRAFT_MODEL && !have_draft_model)
        return td_errorf_quiet(TD_ERR_INVALID, "--spec draft-model needs --draft-model PATH (a small model sharing "
                               "the model's vocabulary)");
    if (have_draft_model && *mode != TD_SPEC_DRAFT_MODEL)
        return td_errorf_quiet(TD_ERR_INVALID, "--draft-model drafts for --spec draft-model, not --spec %s",
                               td_spec_mode_name(*mode));
    return TD_OK;
}

td_status_t td_spec_config_validate(const td_spec_config_t *cfg)
{
    if ((size_t)cfg->mode >= TD_ARRAY_LEN(mode_names))
        return td_errorf_quiet(TD_ERR_INVALID, "speculation mode %d is not off|prompt-lookup|draft-model", (int)cfg->mode);
    if (cfg->k_max < 1 || cfg->k_max > TD_SPEC_MAX_DRAFT)
        return td_errorf_quiet(TD_ERR_INVALID, "--draft-tokens %d is outside [1, %d]", cfg->k_max, TD_SPEC_MAX_DRAFT);
    if (cfg->ngram_min < 1 || cfg->ngram_max < cfg->ngram_min || cfg->ngram_max > 16)
        return td_errorf_quiet(TD_ERR_INVALID, "prompt lookup n-grams %d..%d: want 1 <= min <= max <= 16",
                            cfg->ngram_min, cfg->ngram_max);
    return TD_OK;
}

/* ---- prompt lookup ------------------------------------------------------------------- */

int32_t td_spec_lookup(const int32_t *ctx, int32_t n_ctx, int32_t ngram_min, int32_t ngram_max, int32_t k,
                       int32_t *draft)
{
    for (int32_t n = TD_MIN(ngram_max, n_ctx - 1); n >= ngram_min; n--) {
        const int32_t *tail = ctx + n_ctx - n;
        /* latest occurrence first: the nearest repetition predicts best */
        for (int32_t i = n_ctx - n - 1; i >= 0; i--) {
            if (ctx[i] != tail[0] || memcmp(ctx + i, tail, (size_t)n * sizeof *ctx))
                continue;
            int32_t m = TD_MIN(k, n_ctx - (i + n));
            memcpy(draft, ctx + i + n, (size_t)m * sizeof *ctx);
            return m;
        }
    }
    return 0;
}

/* ---- the controller ------------------------------------------------------------------ */

#define TD_SPEC_MAX_BACKOFF 64

void td_spec_adapt_init(td_spec_adapt_t *a, const td_spec_config_t *cfg)
{
    *a = (td_spec_adapt_t){.k = cfg->k_max};
}

int32_t td_spec_adapt_want(td_spec_adapt_t *a, const td_spec_config_t *cfg)
{
    if (!cfg->adaptive)
        return cfg->k_max;
    if (a->backoff > 0) {
        a->backoff--;
        return 0;
    }
    return a->k;
}

void td_spec_adapt_update(td_spec_adapt_t *a, const td_spec_config_t *cfg, int32_t proposed, int32_t accepted)
{
    if (!cfg->adaptive || proposed <= 0)
        return;
    if (accepted == 0) {
        a->misses++;
        a->backoff = 1 << TD_MIN(2 * a->misses, 6); /* 4, 16, then 64 steps */
        TD_ASSERT(a->backoff <= TD_SPEC_MAX_BACKOFF);
        a->k = TD_MAX(1, a->k / 2);
        return;
    }
    a->misses = 0;
    a->k = accepted == proposed ? TD_MIN(cfg->k_max, 2 * a->k) : TD_MIN(cfg->k_max, accepted + 1);
}

double td_spec_acceptance(const td_spec_stats_t *s)
{
    return s->drafted ? (double)s->accepted / (double)s->drafted : 0.0;
}

/* ---- the draft model ----------------------------------------------------------------- */

td_status_t td_spec_draft_check(const td_model_t *target, const td_tokenizer_t *tok, const td_model_t *draft,
                                const char *draft_path)
{
    int32_t nv = target->config.vocab_size, dv = draft->config.vocab_size;
    if (nv != dv)
        return td_errorf(TD_ERR_INVALID, "--draft-model %s: its vocabulary has %d tokens, the model's %d: a "
                         "draft model must share the model's vocabulary (the same tokenizer)", draft_path, dv, nv);
    if (!draft->tokenizer_path[0] || (!tok && !target->tokenizer_path[0]))
        return TD_OK; /* no pieces to compare */
    td_tokenizer_t *own = NULL, *dt = NULL;
    td_status_t st = TD_OK;
    if (!tok && (st = td_tokenizer_load(target->tokenizer_path, &own)) != TD_OK)
        return st;
    if (!tok)
        tok = own;
    if ((st = td_tokenizer_load(draft->tokenizer_path, &dt)) != TD_OK)
        goto out;
    int32_t n = td_tokenizer_vocab_size(tok);
    if (td_tokenizer_vocab_size(dt) != n)
        st = td_errorf(TD_ERR_INVALID, "--draft-model %s: its tokenizer has %d tokens, the model's %d: a draft "
                       "model must share the model's tokenizer", draft_path, td_tokenizer_vocab_size(dt), n);
    for (int32_t id = 0; st == TD_OK && id < n; id++) {
        size_t la, lb;
        const char *a = td_tokenizer_id_to_piece(tok, id, &la), *b = td_tokenizer_id_to_piece(dt, id, &lb);
        if (la != lb || memcmp(a, b, la))
            st = td_errorf(TD_ERR_INVALID, "--draft-model %s: token %d is '%.*s' in its tokenizer, '%.*s' in "
                           "the model's: a draft model must share the model's tokenizer", draft_path, id, (int)lb,
                           b, (int)la, a);
    }
out:
    td_tokenizer_destroy(dt);
    td_tokenizer_destroy(own);
    return st;
}

struct td_spec_draft {
    td_engine_t *eng;
    int32_t vocab;
    float *logits; /* [vocab] */
};

td_status_t td_spec_draft_create(td_engine_t *eng, int32_t target_vocab, td_spec_draft_t **d_p)
{
    const td_model_config_t *c = td_engine_model_config(eng);
    if (c->vocab_size != target_vocab)
        return td_errorf(TD_ERR_INVALID, "--draft-model: its vocabulary has %d tokens, the model's %d: a draft model "
                         "must share the model's vocabulary (the same tokenizer)", c->vocab_size, target_vocab);
    td_spec_draft_t *d = calloc(1, sizeof *d);
    float *logits = malloc((size_t)c->vocab_size * sizeof(float));
    if (!d || !logits) {
        free(d);
        free(logits);
        return td_errorf(TD_ERR_NOMEM, "out of memory for the draft model's logits");
    }
    d->eng = eng;
    d->vocab = c->vocab_size;
    d->logits = logits;
    *d_p = d;
    return TD_OK;
}

void td_spec_draft_destroy(td_spec_draft_t *d)
{
    if (!d)
        return;
    free(d->logits);
    free(d);
}

void td_spec_draft_seq_end(td_spec_draft_t *d, td_kv_seq_t *seq)
{
    td_engine_seq_end(d->eng, seq);
}

int32_t td_spec_argmax(const float *v, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

td_status_t td_spec_draft_run(td_spec_draft_t *d, td_kv_seq_t *seq, const int32_t *ctx, int32_t n_ctx, int32_t k,
                              int32_t *draft, int32_t *n_p)
{
    const td_engine_config_t *ec = td_engine_config(d->eng);
    const td_model_config_t *c = td_engine_model_config(d->eng);
    *n_p = 0;
    k = TD_MIN(k, c->max_seq_len - n_ctx);
    if (k <= 0 || n_ctx <= 0)
        return TD_OK;
    /* keep what still matches the context, and at least its last token to feed */
    int32_t keep = 0, lim = TD_MIN(seq->n_tokens, n_ctx - 1);
    while (keep < lim && seq->tokens[keep] == ctx[keep])
        keep++;
    td_engine_seq_rollback(d->eng, seq, keep);
    td_status_t st = TD_OK;
    for (int32_t off = keep; off < n_ctx && st == TD_OK;) {
        int32_t n = TD_MIN(ec->max_batch_tokens, n_ctx - off);
        td_engine_item_t it = {.seq = seq, .tokens = ctx + off, .n_tokens = n, .n_logits = off + n == n_ctx};
        st = td_engine_step(d->eng, &it, 1, d->logits);
        off += n;
    }
    int32_t m = 0;
    while (st == TD_OK) {
        draft[m++] = td_spec_argmax(d->logits, d->vocab);
        if (m == k)
            break;
        td_engine_item_t it = {.seq = seq, .tokens = &draft[m - 1], .n_tokens = 1, .n_logits = 1};
        st = td_engine_step(d->eng, &it, 1, d->logits);
    }
    if (st == TD_ERR_EXHAUSTED) { /* the draft pool is full: give its blocks back, draft less */
        td_engine_seq_end(d->eng, seq);
        st = TD_OK;
    }
    if (st != TD_OK)
        return st;
    *n_p = m;
    return TD_OK;
}
