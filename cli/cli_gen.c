/*
 * cli_gen: local generation shared by `tandem generate` and `tandem chat` (cli_gen.h).
 */
#include "cli_gen.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "td_chat_source.h"
#include "td_constrain.h"
#include "td_dtype.h"
#include "td_log.h"
#include "td_util.h"

cli_gen_opts_t cli_gen_opts_default(void)
{
    return (cli_gen_opts_t){.max_tokens = -1, .dtype = -1, .quant = -1, .kv_dtype = -1, .logprobs = -1,
                            .sampling = td_sampling_default(), .spec = td_spec_config_default()};
}

void cli_gen_sampling_flags_init(cli_gen_sampling_flags_t *f, cli_gen_opts_t *o)
{
    memset(f, 0, sizeof *f);
    for (int id = TD_SAMPLING_FIELD_NONE + 1; id < TD_SAMPLING_FIELD_END; id++) {
        const td_sampling_field_desc_t *d = td_sampling_field_desc((td_sampling_field_t)id);
        void *v = td_sampling_field_ptr(&o->sampling, d);
        if (!d->flag)
            continue;
        td_opt_t opt = {.name = d->flag + 2, .arg = d->arg, .help = d->help}; /* "--top-k": "top-k" */
        switch (d->type) {
        case TD_SAMPLING_F32: /* any number: the range is td_gen_params_validate's */
            opt.type = TD_OPT_F32;
            opt.ptr = v;
            break;
        case TD_SAMPLING_I32:
            f->ints[id] = *(int32_t *)v;
            opt.type = TD_OPT_I64;
            opt.ptr = &f->ints[id];
            opt.min = INT32_MIN;
            opt.max = INT32_MAX;
            break;
        case TD_SAMPLING_U64: /* what a flag can spell: a non-negative int64 */
            f->ints[id] = (int64_t)TD_MIN(*(uint64_t *)v, (uint64_t)INT64_MAX);
            opt.type = TD_OPT_I64;
            opt.ptr = &f->ints[id];
            opt.min = 0;
            opt.max = INT64_MAX;
            break;
        }
        f->opts[f->n_opts++] = opt;
    }
}

void cli_gen_sampling_apply(const cli_gen_sampling_flags_t *f, cli_gen_opts_t *o)
{
    for (int id = TD_SAMPLING_FIELD_NONE + 1; id < TD_SAMPLING_FIELD_END; id++) {
        const td_sampling_field_desc_t *d = td_sampling_field_desc((td_sampling_field_t)id);
        void *v = td_sampling_field_ptr(&o->sampling, d);
        if (!d->flag)
            continue;
        if (d->type == TD_SAMPLING_I32)
            *(int32_t *)v = (int32_t)f->ints[id]; /* parsed within int32 */
        else if (d->type == TD_SAMPLING_U64)
            *(uint64_t *)v = (uint64_t)f->ints[id]; /* parsed >= 0 */
    }
}

int cli_gen_opts_join(td_opt_t *opts, int cap, const td_opt_t *head, int n_head, const cli_gen_sampling_flags_t *f,
                      const td_opt_t *tail, int n_tail)
{
    TD_ASSERT(n_head + f->n_opts + n_tail <= cap);
    memcpy(opts, head, (size_t)n_head * sizeof *opts);
    memcpy(opts + n_head, f->opts, (size_t)f->n_opts * sizeof *opts);
    memcpy(opts + n_head + f->n_opts, tail, (size_t)n_tail * sizeof *opts);
    return n_head + f->n_opts + n_tail;
}

void cli_gen_sampling_synopsis(FILE *out, const cli_gen_sampling_flags_t *f, const char *indent)
{
    int col = fprintf(out, "%s", indent);
    for (int i = 0; i < f->n_opts; i++) {
        char item[64];
        int w = snprintf(item, sizeof item, "[--%s %s]", f->opts[i].name, f->opts[i].arg);
        if (i > 0 && col + 1 + w > 100)
            col = fprintf(out, "\n%s", indent) - 1;
        else if (i > 0)
            col += fprintf(out, " ");
        col += fprintf(out, "%s", item);
    }
    fprintf(out, "\n");
}

td_status_t cli_gen_parse_stop(const td_opt_t *opt, const char *v)
{
    cli_gen_opts_t *o = opt->ptr;
    if (o->n_stops < TD_STOP_MAX_STRINGS)
        o->stops[o->n_stops] = v;
    o->n_stops++;
    return TD_OK;
}

td_status_t cli_gen_parse_stop_id(const td_opt_t *opt, const char *v)
{
    cli_gen_opts_t *o = opt->ptr;
    int64_t id;
    td_status_t st = td_parse_i64(v, 0, INT32_MAX, "--stop-id", &id);
    if (st != TD_OK)
        return st;
    if (o->n_stop_ids < TD_GEN_MAX_STOP_IDS)
        o->stop_ids[o->n_stop_ids] = (int32_t)id;
    o->n_stop_ids++;
    return TD_OK;
}

td_status_t cli_gen_parse_logit_bias(const td_opt_t *opt, const char *v)
{
    cli_gen_opts_t *o = opt->ptr;
    td_sampling_t *sp = &o->sampling;
    const char *eq = strchr(v, '=');
    char id_text[24];
    int64_t id;
    float bias;
    if (!eq || (size_t)(eq - v) >= sizeof id_text)
        return td_errorf(TD_ERR_INVALID, "--logit-bias: '%s' is not ID=BIAS (e.g. 1234=-100)", v);
    memcpy(id_text, v, (size_t)(eq - v));
    id_text[eq - v] = 0;
    td_status_t st = td_parse_i64(id_text, 0, INT32_MAX, "--logit-bias token id", &id);
    if (st == TD_OK)
        st = td_parse_f32(eq + 1, -TD_SAMPLING_MAX_BIAS, TD_SAMPLING_MAX_BIAS, "--logit-bias bias", &bias);
    if (st != TD_OK)
        return st;
    if (sp->n_logit_bias < TD_SAMPLING_MAX_LOGIT_BIAS) { /* more are counted: the check refuses them */
        sp->logit_bias_ids[sp->n_logit_bias] = (int32_t)id;
        sp->logit_bias[sp->n_logit_bias] = bias;
    }
    sp->n_logit_bias++;
    return TD_OK;
}

td_status_t cli_gen_parse_log_level(const td_opt_t *opt, const char *v)
{
    (void)opt;
    if (td_log_parse_level(v) < 0)
        return td_errorf(TD_ERR_INVALID, "--log-level: '%s' is not error|warn|info|debug", v);
    td_log_set_level((td_log_level_t)td_log_parse_level(v));
    return TD_OK;
}

bool cli_gen_spec_resolve(const char *cmd, cli_gen_opts_t *o, int64_t k)
{
    o->spec.k_max = (int32_t)k;
    if (td_spec_resolve_mode(&o->spec.mode, o->draft_model != NULL) == TD_OK)
        return true;
    fprintf(stderr, "tandem %s: %s\n", cmd, td_last_error());
    return false;
}

bool cli_gen_validate(const char *cmd, const cli_gen_opts_t *o, bool prompt_is_text, size_t prompt_len)
{
    td_gen_params_t gp = td_gen_params_default();
    gp.max_tokens = o->max_tokens_given ? o->max_tokens : 0;
    gp.sampling = o->sampling;
    gp.prompt_is_text = prompt_is_text;
    gp.prompt_len = prompt_len;
    gp.n_stop_ids = (size_t)o->n_stop_ids;
    gp.n_stop_strings = (size_t)o->n_stops;
    gp.stop_strings = o->stops;
    gp.tpot_objective_ms = o->tpot_objective_ms;
    if (o->logprobs >= 0)
        gp.logprobs = (td_logprobs_want_t){.on = true, .top = (int32_t)TD_MIN(o->logprobs, (int64_t)INT32_MAX),
                                           .prompt = o->prompt_logprobs};
    char why[256];
    td_gen_field_t bad = td_gen_params_check(&gp, why, sizeof why);
    if (bad != TD_GEN_FIELD_NONE) { /* the flag the user typed, then the gateway's words */
        const char *flag = td_gen_field_names(bad).flag;
        fprintf(stderr, "tandem %s: %s%s%s\n", cmd, flag, *flag ? ": " : "", why);
        return false;
    }
    return true;
}

td_status_t cli_gen_open(cli_gen_t *g, const cli_gen_opts_t *o, bool need_tok)
{
    td_status_t st;
    td_progress_init(&g->load, "model load", 0, 1.0);
    if ((st = td_model_load(o->model, &g->model)) != TD_OK)
        return st;
    td_progress_phase(&g->load, 1, 4, "model read");
    const td_model_config_t *c = &g->model->config;
    const char *tok_path = o->tokenizer ? o->tokenizer : (g->model->tokenizer_path[0] ? g->model->tokenizer_path : NULL);
    if (tok_path) {
        if ((st = td_tokenizer_load(tok_path, &g->tok)) != TD_OK)
            return st;
    } else if (need_tok) {
        return td_errorf(TD_ERR_INVALID, "%s has no tokenizer beside it: pass --tokenizer PATH%s", o->model,
                         o->prompt_ids || o->chat || o->prompt ? "" : ", or --print-ids to print token ids");
    }
    if (o->chat && (st = td_chat_template_for_model(o->model, tok_path, &g->chat)) != TD_OK) {
        if (st == TD_ERR_NOT_FOUND) /* not logged there: a server without a template still serves */
            td_log(TD_LOG_ERROR, "%s", td_last_error());
        return st;
    }
    td_progress_phase(&g->load, 2, 4, "tokenizer");
    /* the tokenizer says whether the model's prompts start with BOS (GGUF add_bos_token,
     * tokenizer_config.json's); ids given without one are taken as given */
    g->add_bos = g->tok && td_tokenizer_add_bos(g->tok);
    g->stop_at_tok_eos = o->chat;
    int dtype = o->dtype < 0 ? td_device_default_dtype(&o->device, c->dtype) : o->dtype;
    st = td_backend_open(&o->device, (int32_t)o->threads, dtype < 0 ? TD_F32 : (td_dtype_t)dtype, &g->be);
    if (st == TD_OK)
        td_progress_phase(&g->load, 3, 4, "backend");
    return st;
}

/* --spec draft-model: the draft model on the same backend, an engine like the model's. */
static td_status_t open_draft(cli_gen_t *g, const cli_gen_opts_t *o, const td_engine_config_t *ec, int64_t kv_tokens)
{
    if (!o->draft_model)
        return td_errorf(TD_ERR_INVALID, "--spec draft-model needs --draft-model PATH (a small model sharing the "
                         "vocabulary)");
    td_status_t st = td_model_load(o->draft_model, &g->draft_model);
    if (st != TD_OK || (st = td_spec_draft_check(g->model, g->tok, g->draft_model, o->draft_model)) != TD_OK)
        return st;
    td_engine_config_t dc = *ec;
    dc.max_logit_rows = 1;
    dc.max_batch_tokens = TD_MAX(ec->max_batch_tokens, 1);
    int64_t need = TD_DIV_CEIL(kv_tokens + TD_SPEC_MAX_DRAFT + 1, dc.block_size);
    int64_t fits = (int64_t)(dc.kv_mem_bytes / td_engine_kv_block_bytes(g->draft_model, &dc));
    dc.n_blocks = (int32_t)TD_MAX(1, TD_MIN(need, fits));
    if ((st = td_engine_create(g->draft_model, g->be, &dc, &g->draft_eng)) != TD_OK)
        return st;
    return td_spec_draft_create(g->draft_eng, g->model->config.vocab_size, &g->draft);
}

td_status_t cli_gen_start_engine(cli_gen_t *g, const cli_gen_opts_t *o, td_engine_config_t *ec,
                                 int64_t kv_tokens)
{
    const td_model_config_t *c = &g->model->config;
    int dtype = o->dtype < 0 ? td_device_default_dtype(&o->device, c->dtype) : o->dtype;
    td_engine_config_set_dtype(ec, dtype, o->quant, o->kv_dtype);
    if (o->kv_mem)
        ec->kv_mem_bytes = o->kv_mem;
    /* the pool holds what kv_tokens need, within the KV budget */
    uint64_t block_bytes = td_engine_kv_block_bytes(g->model, ec);
    int64_t need = TD_DIV_CEIL(kv_tokens + 1, ec->block_size);
    int64_t fits = (int64_t)(ec->kv_mem_bytes / block_bytes);
    ec->n_blocks = (int32_t)TD_MAX(1, TD_MIN(need, fits));
    if (o->spec.mode != TD_SPEC_OFF) { /* a verify step: the last token and k drafts */
        ec->max_batch_tokens = TD_MAX(ec->max_batch_tokens, o->spec.k_max + 1);
        ec->max_logit_rows = TD_MAX(ec->max_logit_rows, o->spec.k_max + 1);
    }
    td_status_t st = td_engine_create(g->model, g->be, ec, &g->eng);
    if (st == TD_OK)
        td_progress_phase(&g->load, 4, 4, "engine (weights prepared, KV pool)");
    if (st != TD_OK || o->spec.mode != TD_SPEC_DRAFT_MODEL)
        return st;
    return open_draft(g, o, ec, kv_tokens);
}

void cli_gen_close(cli_gen_t *g)
{
    td_spec_draft_destroy(g->draft);
    td_engine_destroy(g->draft_eng);
    td_model_destroy(g->draft_model);
    td_engine_destroy(g->eng);
    td_backend_destroy(g->be);
    td_chat_template_destroy(g->chat);
    td_tokenizer_destroy(g->tok);
    td_model_destroy(g->model);
    memset(g, 0, sizeof *g);
}

td_status_t cli_gen_chat_prompt(cli_gen_t *g, const td_chat_message_t *messages, size_t n,
                                int32_t **ids_p, size_t *n_p)
{
    char *text;
    size_t len;
    td_status_t st = td_chat_render_messages(g->chat, g->tok, messages, n, NULL, &text, &len);
    if (st != TD_OK)
        return st;
    td_debug("chat prompt: %s", text);
    st = td_chat_encode(g->tok, text, len, g->add_bos, ids_p, n_p);
    free(text);
    return st;
}

td_status_t cli_gen_check_prompt(const cli_gen_t *g, const int32_t *ids, size_t n)
{
    const td_model_config_t *c = &g->model->config;
    if (n == 0)
        return td_errorf(TD_ERR_INVALID, "the prompt text encodes to no token ids (and the model has no BOS "
                                         "token to start from)");
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab_size)
            return td_errorf(TD_ERR_RANGE, "prompt token %d is outside the model's vocabulary [0, %d)", ids[i],
                             c->vocab_size);
    if ((int64_t)n >= c->max_seq_len)
        return td_errorf(TD_ERR_RANGE, "the prompt has %zu tokens; the model's maximum length is %d", n,
                         c->max_seq_len);
    return TD_OK;
}

void cli_gen_result_free(cli_gen_result_t *r)
{
    free(r->ids);
    free(r->text);
    free(r->lps);
    free(r->prompt_lps);
    memset(r, 0, sizeof *r);
}

void cli_gen_print_logprobs(const char *what, const td_token_logprob_t *lps, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        printf("logprob %s %zu %d %.6f", what, i, lps[i].token, (double)lps[i].logprob);
        for (int32_t k = 0; k < lps[i].n_top; k++)
            printf(" %d:%.6f", lps[i].top[k].token, (double)lps[i].top[k].logprob);
        printf("\n");
    }
    fflush(stdout);
}

static bool is_stop_id(const cli_gen_t *g, const cli_gen_opts_t *o, int32_t id)
{
    const td_model_config_t *c = &g->model->config;
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] == id)
            return true;
    for (int i = 0; i < o->n_stop_ids && i < TD_GEN_MAX_STOP_IDS; i++)
        if (o->stop_ids[i] == id)
            return true;
    return g->stop_at_tok_eos && g->tok && td_tokenizer_is_eos(g->tok, id);
}

/* Writes text to stdout and appends it to the result's text. */
static td_status_t put_text(cli_gen_result_t *r, size_t *cap, const char *text, size_t len)
{
    if (!len)
        return TD_OK;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    if (r->text_len + len + 1 > *cap) {
        size_t ncap = TD_MAX(2 * *cap, r->text_len + len + 1);
        char *t = realloc(r->text, ncap);
        if (!t)
            return td_errorf(TD_ERR_NOMEM, "out of memory");
        r->text = t;
        *cap = ncap;
    }
    memcpy(r->text + r->text_len, text, len);
    r->text_len += len;
    r->text[r->text_len] = '\0';
    return TD_OK;
}

/* Streams `id`'s text through the detokenizer and the stop matcher; *stopped_p when a
 * stop string completed. */
static td_status_t emit_text(td_detok_t *dt, td_stop_t *stop, int32_t id, cli_gen_result_t *r, size_t *cap,
                             bool *stopped_p)
{
    /* a model's vocabulary may be padded past its tokenizer's: such ids have no text */
    if (id >= td_tokenizer_vocab_size(dt->tok))
        return TD_OK;
    const char *text;
    size_t len;
    td_status_t st = td_detok_push(dt, id, &text, &len);
    if (st != TD_OK)
        return st;
    td_stop_result_t sr;
    if ((st = td_stop_feed(stop, text, len, &sr)) != TD_OK)
        return st;
    *stopped_p = sr.matched;
    return put_text(r, cap, sr.emit, sr.emit_len);
}

/* One generation's decode state: what taking a token touches. */
typedef struct gen_state {
    cli_gen_t *g;
    const cli_gen_opts_t *o;
    td_sampler_t *sampler;
    td_stop_t *stop;
    td_detok_t *dt;
    cli_gen_result_t *r;
    size_t *text_cap;
    int32_t *ctx;       /* [n_prompt + max_new] prompt, then the tokens taken */
    int32_t n_ctx;
    int64_t max_new;
    bool want_lp;
    int32_t top;
    uint64_t t0;
    td_gram_matcher_t *gm; /* structured output: the grammar over the model's vocabulary */
    td_gram_state_t *gst;  /* where the output stands in it */
    uint32_t *mask;        /* [td_gram_mask_words(vocab)] the tokens it allows next */
    bool done;          /* a stop id, a stop string or max_new: take no more */
    bool stopped;       /* a stop string matched */
} gen_state_t;

/* Samples the token after the row `logits` and takes it as sequential decoding does: a stop
 * id ends the generation (not output), else its logprobs, the sampler's record, the output
 * and its text (a stop string or max_new then end it). The one path of every token, with or
 * without speculation, so both give the same tokens, text and random stream. */
static td_status_t take_token(gen_state_t *s, const float *logits, int32_t *next_p)
{
    const td_model_config_t *c = &s->g->model->config;
    cli_gen_result_t *r = s->r;
    int32_t next;
    td_status_t st;
    if (s->gst && (st = td_gram_fill_mask(s->gm, s->gst, s->mask)) != TD_OK)
        return td_errorf(st, "grammar: out of memory for a token mask");
    if ((st = td_sampler_sample_masked(s->sampler, logits, c->vocab_size, s->gst ? s->mask : NULL, &next)) != TD_OK)
        return st;
    if (s->gst && td_gram_accept_token(s->gm, s->gst, next) != TD_OK) /* the mask allowed it */
        return td_errorf(TD_ERR_INTERNAL, "grammar: token %d was in the mask but the grammar refused it", next);
    if (r->n_gen == 0)
        r->t_first_ns = td_now_ns() - s->t0;
    *next_p = next;
    if (is_stop_id(s->g, s->o, next) || (s->gst && td_tokenizer_is_eos(s->g->tok, next))) {
        s->done = true;
        return TD_OK;
    }
    if (s->want_lp && (st = td_sampler_logprobs(logits, c->vocab_size, next, s->top, &r->lps[r->n_gen])) != TD_OK)
        return st;
    if ((st = td_sampler_accept(s->sampler, next)) != TD_OK)
        return st;
    r->ids[r->n_gen++] = next;
    s->ctx[s->n_ctx++] = next;
    if (!s->o->print_ids && (st = emit_text(s->dt, s->stop, next, r, s->text_cap, &s->stopped)) != TD_OK)
        return st;
    s->done = s->stopped || r->n_gen == s->max_new;
    return TD_OK;
}

/* The prompt after the engine's cached prefix, in chunks of `chunk` tokens (the engine
 * attaches the cached prefix, a previous turn's KV, unless every prompt position's logits
 * are wanted). The last chunk's last row, the first token's logits, ends in logits[0..vocab);
 * with o->prompt_logprobs each prompt token's logprob goes into r->prompt_lps. */
static td_status_t prefill_prompt(cli_gen_t *g, const cli_gen_opts_t *o, td_kv_seq_t *seq, const int32_t *prompt,
                                  size_t n_prompt, int32_t chunk, int32_t top, float *logits, cli_gen_result_t *r)
{
    const bool want_plp = o->logprobs >= 0 && o->prompt_logprobs;
    const size_t vocab = (size_t)g->model->config.vocab_size;
    td_status_t st;
    if (!want_plp && (st = td_engine_seq_start(g->eng, seq, prompt, (int32_t)n_prompt, &r->n_cached)) != TD_OK)
        return st;
    if (want_plp && n_prompt)
        r->prompt_lps[0] = (td_token_logprob_t){.token = prompt[0]}; /* no context: logprob 0 */
    for (size_t off = (size_t)r->n_cached; off < n_prompt;) {
        int32_t n = (int32_t)TD_MIN((size_t)chunk, n_prompt - off);
        bool last = off + (size_t)n == n_prompt;
        td_engine_item_t it = {.seq = seq, .tokens = prompt + off, .n_tokens = n, .n_logits = want_plp ? n : last};
        if ((st = td_engine_step(g->eng, &it, 1, logits)) != TD_OK) {
            if (st == TD_ERR_EXHAUSTED)
                td_errorf(st, "the KV cache cannot hold the prompt: raise --kv-mem");
            return st;
        }
        /* row k follows prompt[off + k]: it scores prompt[off + k + 1] */
        for (int32_t k = 0; want_plp && k < n && off + (size_t)k + 1 < n_prompt; k++)
            if ((st = td_sampler_logprobs(logits + (size_t)k * vocab, (int32_t)vocab, prompt[off + (size_t)k + 1], top,
                                          &r->prompt_lps[off + (size_t)k + 1])) != TD_OK)
                return st;
        if (want_plp && last && n > 1)
            memmove(logits, logits + (size_t)(n - 1) * vocab, vocab * sizeof *logits);
        off += (size_t)n;
    }
    return TD_OK;
}

/* One verify step of drafts after *next: rows next, draft[0..m); row i's token is taken while
 * it equals draft[i], the rest of the step rolled back. *verified_p false: the pool cannot
 * hold the drafts, nothing was taken. */
static td_status_t verify_drafts(gen_state_t *s, td_kv_seq_t *seq, int32_t *next, const int32_t *draft, int32_t m,
                                 float *vlogits, td_spec_adapt_t *adapt, bool *verified_p)
{
    const size_t vocab = (size_t)s->g->model->config.vocab_size;
    int32_t feed[TD_SPEC_MAX_DRAFT + 1], n_before = seq->n_tokens, taken = 0, acc = 0;
    feed[0] = *next;
    memcpy(feed + 1, draft, (size_t)m * sizeof *draft);
    td_engine_item_t it = {.seq = seq, .tokens = feed, .n_tokens = m + 1, .n_logits = m + 1, .verify = true};
    td_status_t st = td_engine_step(s->g->eng, &it, 1, vlogits);
    *verified_p = st == TD_OK;
    if (st != TD_OK)
        return st == TD_ERR_EXHAUSTED ? TD_OK : st;
    for (int32_t i = 0; i <= m && !s->done; i++) {
        if ((st = take_token(s, vlogits + (size_t)i * vocab, next)) != TD_OK)
            return st;
        taken++;
        if (i == m || *next != draft[i])
            break;
        acc++;
    }
    td_engine_seq_rollback(s->g->eng, seq, n_before + taken);
    td_engine_seq_release_window(s->g->eng, seq); /* after the rollback: the tokens kept */
    td_spec_adapt_update(adapt, &s->o->spec, m, acc);
    td_spec_stats_t *sp = &s->r->spec;
    sp->verify_steps++;
    sp->drafted += (uint64_t)m;
    sp->accepted += (uint64_t)acc;
    sp->tokens += (uint64_t)taken;
    return TD_OK;
}

/* Decodes after the first token `next` until a stop, max_new or a full KV cache (warned):
 * with o->spec, drafts verified several a step where the pool holds them, else one token a
 * step. */
static td_status_t decode_tokens(gen_state_t *s, td_kv_seq_t *seq, td_kv_seq_t *dseq, int32_t next, float *logits,
                                 float *vlogits)
{
    const cli_gen_opts_t *o = s->o;
    const bool spec = o->spec.mode != TD_SPEC_OFF;
    td_spec_adapt_t adapt;
    td_spec_adapt_init(&adapt, &o->spec);
    int32_t draft[TD_SPEC_MAX_DRAFT];
    td_status_t st;
    while (!s->done) {
        /* drafts, at most as many as may still be output after `next` */
        int32_t k = spec ? (int32_t)TD_MIN((int64_t)td_spec_adapt_want(&adapt, &o->spec), s->max_new - s->r->n_gen - 1)
                         : 0;
        int32_t m = 0;
        if (k > 0 && o->spec.mode == TD_SPEC_PROMPT_LOOKUP)
            m = td_spec_lookup(s->ctx, s->n_ctx, o->spec.ngram_min, o->spec.ngram_max, k, draft);
        else if (k > 0 && (st = td_spec_draft_run(s->g->draft, dseq, s->ctx, s->n_ctx, k, draft, &m)) != TD_OK)
            return st;
        bool verified = false; /* else a plain step: no drafts, or the pool cannot hold them */
        if (m > 0 && (st = verify_drafts(s, seq, &next, draft, m, vlogits, &adapt, &verified)) != TD_OK)
            return st;
        if (verified)
            continue;
        if (spec)
            s->r->spec.plain_steps++;
        td_engine_item_t it = {.seq = seq, .tokens = &next, .n_tokens = 1, .n_logits = 1};
        if ((st = td_engine_step(s->g->eng, &it, 1, logits)) == TD_ERR_EXHAUSTED) {
            td_warn("generate: the KV cache is full at %d tokens; stopping (raise --kv-mem for longer)",
                    seq->n_tokens);
            return TD_OK;
        }
        if (st != TD_OK || (st = take_token(s, logits, &next)) != TD_OK)
            return st;
        td_engine_seq_release_window(s->g->eng, seq); /* blocks behind a sliding window */
    }
    return TD_OK;
}

/* The end of the output: the ids on one line with o->print_ids, else the text the
 * detokenizer and the stop matcher still hold (unless a stop string ended it). */
static td_status_t finish_output(gen_state_t *s)
{
    cli_gen_result_t *r = s->r;
    td_status_t st = TD_OK;
    if (s->o->print_ids) {
        for (int64_t i = 0; i < r->n_gen; i++)
            printf(i ? " %d" : "%d", r->ids[i]);
        printf("\n");
    } else if (!s->stopped) {
        const char *text;
        size_t len;
        if ((st = td_detok_flush(s->dt, &text, &len)) != TD_OK)
            return st;
        td_stop_result_t sr;
        if ((st = td_stop_feed(s->stop, text, len, &sr)) != TD_OK ||
            (st = put_text(r, s->text_cap, sr.emit, sr.emit_len)) != TD_OK)
            return st;
        if (!sr.matched) {
            td_stop_flush(s->stop, &text, &len);
            st = put_text(r, s->text_cap, text, len);
        }
    }
    fflush(stdout);
    return st;
}

td_status_t cli_gen_run(cli_gen_t *g, const cli_gen_opts_t *o, td_kv_seq_t *seq, const int32_t *prompt,
                        size_t n_prompt, int64_t max_new, cli_gen_result_t *res)
{
    const td_engine_config_t *ec = td_engine_config(g->eng);
    td_sampler_t *sampler = NULL;
    td_stop_t *stop = NULL;
    float *logits = NULL, *vlogits = NULL;
    int32_t *ctx = NULL;
    td_kv_seq_t dseq; /* the draft model's sequence (--spec draft-model) */
    td_kv_seq_init(&dseq);
    td_detok_t dt = {0};
    td_gram_vocab_t *gvocab = NULL;
    td_gram_matcher_t *gm = NULL;
    td_gram_state_t *gst = NULL;
    uint32_t *mask = NULL;
    cli_gen_result_t r = {.n_prompt = n_prompt};
    size_t text_cap = 0;
    td_status_t st;

    const bool want_lp = o->logprobs >= 0, want_plp = want_lp && o->prompt_logprobs;
    const int32_t top = (int32_t)TD_MIN(TD_MAX(o->logprobs, (int64_t)0), (int64_t)TD_LOGPROBS_MAX_TOP);
    /* prompt logprobs: every row of a chunk (chunks of at most max_logit_rows tokens) */
    const int32_t chunk = want_plp ? TD_MIN(ec->max_batch_tokens, ec->max_logit_rows) : ec->max_batch_tokens;
    const size_t vocab = (size_t)g->model->config.vocab_size;
    char why[160];
    if (!td_sampling_check_bias(&o->sampling, (int32_t)vocab, why, sizeof why)) { /* the ids: this model's */
        st = td_errorf(TD_ERR_INVALID, "--logit-bias: %s", why);
        goto out;
    }
    if ((st = td_sampler_create(&o->sampling, &sampler)) != TD_OK ||
        (st = td_stop_create(o->stops, TD_MIN(o->n_stops, TD_STOP_MAX_STRINGS), &stop)) != TD_OK)
        goto out;
    logits = malloc((size_t)(want_plp ? chunk : 1) * vocab * sizeof(float));
    vlogits = malloc((size_t)(o->spec.mode != TD_SPEC_OFF ? o->spec.k_max + 1 : 1) * vocab * sizeof(float));
    ctx = malloc((n_prompt + (size_t)max_new + 1) * sizeof *ctx);
    r.ids = malloc((size_t)(max_new + 1) * sizeof(int32_t));
    if (want_lp)
        r.lps = malloc((size_t)(max_new + 1) * sizeof *r.lps);
    if (want_plp)
        r.prompt_lps = malloc(n_prompt * sizeof *r.prompt_lps);
    if (!logits || !vlogits || !ctx || !r.ids || (want_lp && !r.lps) || (want_plp && !r.prompt_lps)) {
        st = td_errorf(TD_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (g->tok)
        td_detok_init(&dt, g->tok);
    if (o->gram) {
        const td_model_config_t *mc = &g->model->config;
        if (!g->tok) {
            st = td_errorf(TD_ERR_INVALID, "structured output needs the model's tokenizer: give --tokenizer PATH");
            goto out;
        }
        if ((st = td_constrain_vocab(g->tok, mc->vocab_size, mc->eos_ids, mc->n_eos, &gvocab)) != TD_OK)
            goto out;
        if ((st = td_gram_matcher_create(o->gram, gvocab, &gm)) != TD_OK ||
            (st = td_gram_state_create(o->gram, &gst)) != TD_OK) {
            st = td_errorf(st, "grammar: out of memory");
            goto out;
        }
        if (!(mask = malloc(td_gram_mask_words(mc->vocab_size) * sizeof *mask))) {
            st = td_errorf(TD_ERR_NOMEM, "out of memory");
            goto out;
        }
    }
    for (size_t i = 0; i < n_prompt; i++)
        td_sampler_accept_prompt(sampler, prompt[i]);

    uint64_t t0 = td_now_ns();
    if ((st = prefill_prompt(g, o, seq, prompt, n_prompt, chunk, top, logits, &r)) != TD_OK)
        goto out;
    r.t_prefill_ns = td_now_ns() - t0;
    /* the context the drafters read: the prompt, then each token as it is taken */
    memcpy(ctx, prompt, n_prompt * sizeof *ctx);
    gen_state_t gs = {.g = g, .o = o, .sampler = sampler, .stop = stop, .dt = &dt, .r = &r, .text_cap = &text_cap,
                      .ctx = ctx, .n_ctx = (int32_t)n_prompt, .max_new = max_new, .want_lp = want_lp, .top = top,
                      .t0 = t0, .gm = gm, .gst = gst, .mask = mask};
    int32_t next;
    if (max_new > 0 && ((st = take_token(&gs, logits, &next)) != TD_OK ||
                        (st = decode_tokens(&gs, seq, &dseq, next, logits, vlogits)) != TD_OK))
        goto out;
    r.t_total_ns = td_now_ns() - t0;
    if ((st = finish_output(&gs)) != TD_OK)
        goto out;
    if (!r.text && !(r.text = calloc(1, 1))) {
        st = td_errorf(TD_ERR_NOMEM, "out of memory");
        goto out;
    }
    *res = r;
    r = (cli_gen_result_t){0};
out:
    if (g->draft)
        td_spec_draft_seq_end(g->draft, &dseq);
    cli_gen_result_free(&r);
    td_detok_free(&dt);
    free(ctx);
    free(vlogits);
    free(logits);
    td_stop_destroy(stop);
    td_sampler_destroy(sampler);
    free(mask);
    td_gram_state_destroy(gst);
    td_gram_matcher_destroy(gm);
    td_gram_vocab_destroy(gvocab);
    return st;
}

bool cli_gen_grammar(const char *cmd, cli_gen_opts_t *o)
{
    const char *flag = NULL, *text = NULL;
    td_gram_kind_t kind = TD_GRAM_GBNF;
    int n = 0;
    if (o->json_schema)
        n++, flag = "--json-schema", kind = TD_GRAM_JSON_SCHEMA, text = o->json_schema;
    if (o->grammar)
        n++, flag = "--grammar", kind = TD_GRAM_GBNF, text = o->grammar;
    if (o->regex)
        n++, flag = "--regex", kind = TD_GRAM_REGEX, text = o->regex;
    if (o->choice)
        n++, flag = "--choice", kind = TD_GRAM_CHOICE, text = o->choice;
    if (o->json_object)
        n++, flag = "--json-object", kind = TD_GRAM_JSON_OBJECT, text = "";
    if (n == 0)
        return true;
    if (n > 1) {
        fprintf(stderr, "tandem %s: give at most one of --json-schema, --grammar, --regex, --choice and --json-object\n",
                cmd);
        return false;
    }
    char *src = NULL;
    size_t len = 0;
    td_status_t st = TD_OK;
    if (kind == TD_GRAM_JSON_SCHEMA || kind == TD_GRAM_GBNF) {
        st = td_file_read_all(text, TD_GRAM_MAX_SOURCE, &src, &len);
    } else if (kind == TD_GRAM_CHOICE) { /* A,B,C -> ["A","B","C"] */
        cJSON *a = cJSON_CreateArray();
        for (const char *p = text; a;) {
            const char *e = strchr(p, ',');
            size_t l = e ? (size_t)(e - p) : strlen(p);
            char *item = strndup(p, l);
            if (!item || !cJSON_AddItemToArray(a, cJSON_CreateString(item))) {
                free(item);
                cJSON_Delete(a);
                a = NULL;
                break;
            }
            free(item);
            if (!e)
                break;
            p = e + 1;
        }
        src = a ? cJSON_PrintUnformatted(a) : NULL;
        cJSON_Delete(a);
        if (!src)
            st = td_errorf_quiet(TD_ERR_NOMEM, "out of memory");
        len = src ? strlen(src) : 0;
    } else {
        src = strdup(text);
        len = strlen(text);
        if (!src)
            st = td_errorf_quiet(TD_ERR_NOMEM, "out of memory");
    }
    if (st == TD_OK)
        st = td_gram_compile(kind, src, len, &o->gram);
    if (st == TD_OK && kind == TD_GRAM_CHOICE) { /* cJSON's allocation: one the caller frees with free() */
        char *copy = malloc(len + 1);
        if (copy)
            memcpy(copy, src, len + 1);
        else
            st = td_errorf_quiet(TD_ERR_NOMEM, "out of memory");
        cJSON_free(src);
        src = copy;
    } else if (kind == TD_GRAM_CHOICE) {
        cJSON_free(src);
        src = NULL;
    }
    if (st == TD_OK) {
        o->gram_kind = kind;
        o->gram_src = src;
        o->gram_len = len;
    } else {
        free(src);
        td_gram_unref(o->gram);
        o->gram = NULL;
    }
    if (st != TD_OK) {
        fprintf(stderr, "tandem %s: %s: %s\n", cmd, flag, td_last_error());
        return false;
    }
    return true;
}

void cli_gen_grammar_free(cli_gen_opts_t *o)
{
    td_gram_unref(o->gram);
    free(o->gram_src);
    o->gram = NULL;
    o->gram_src = NULL;
    o->gram_len = 0;
}

void cli_gen_report(const cli_gen_result_t *r, bool show_cached)
{
    char cached[48] = "";
    if (show_cached)
        snprintf(cached, sizeof cached, " (%d cached)", r->n_cached);
    size_t computed = r->n_prompt - (size_t)r->n_cached;
    double gen_s = (double)(r->t_total_ns - r->t_first_ns) * 1e-9;
    fprintf(stderr,
            "\nprompt: %zu tokens%s, %.1f tokens/s | generation: %" PRId64
            " tokens, %.1f tokens/s | time to first token: %.1f ms\n",
            r->n_prompt, cached, (double)computed / ((double)r->t_prefill_ns * 1e-9), r->n_gen,
            r->n_gen > 1 ? (double)(r->n_gen - 1) / gen_s : 0.0, (double)r->t_first_ns * 1e-6);
    const td_spec_stats_t *sp = &r->spec;
    if (sp->verify_steps + sp->plain_steps > 0)
        fprintf(stderr,
                "speculation: %" PRIu64 " verify steps, %" PRIu64 " plain | drafted %" PRIu64 ", accepted %" PRIu64
                " (%.1f%%) | %.2f tokens per verify step\n",
                sp->verify_steps, sp->plain_steps, sp->drafted, sp->accepted, 100.0 * td_spec_acceptance(sp),
                sp->verify_steps ? (double)sp->tokens / (double)sp->verify_steps : 0.0);
}
