/*
 * router_relay: tokens from the nodes to the client. The pending output of a request (ids
 * and detokenized text, stop strings matched here) goes out as one message per StepBatch
 * through the request's front door (its sink: gRPC or HTTP), held in a bounded backlog
 * while the client's stream is full; token 0 arrives
 * twice (the Prefill stream and the lease's first step entry) and is sent once; a decode
 * node's Steps stream (its StepBatches, and its end) is read here; the last message
 * carries the finish reason, usage and timings (req_finish). Log-probabilities, when asked,
 * travel beside the ids (out.lps): token 0's from the Prefill stream (the decode node did
 * not compute its logits), the rest from the step entries; the prompt's from the Prefill
 * stream with the first message.
 */
#include "router_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_util.h"

#define ROUTER_LOGPROBS_MAX_BACKLOG 8192 /* pending tokens with logprobs (router_backlog_over) */

/* ---- output: pending tokens, one message per flush ------------------------------------- */

/* Room for one more id (and its logprob, with_lps) and text_len more bytes (plus the NUL)
 * in the pending output. The buffers are kept across flushes, so a running request stops
 * allocating after its first few tokens. */
static bool out_reserve(router_out_t *o, size_t text_len, bool with_lps)
{
    if (with_lps && !o->lps && o->cap) {
        if (!(o->lps = malloc(o->cap * sizeof *o->lps)))
            return false;
    }
    if (o->n == o->cap) {
        uint32_t cap = o->cap ? o->cap * 2 : 8;
        uint32_t *p = realloc(o->ids, cap * sizeof *p);
        if (!p)
            return false;
        o->ids = p;
        if (with_lps) {
            td_token_logprob_t *l = realloc(o->lps, cap * sizeof *l);
            if (!l)
                return false; /* ids grew, cap not yet: the next call grows again */
            o->lps = l;
        }
        o->cap = cap;
    }
    if (o->n_text + text_len + 1 > o->cap_text) {
        size_t cap = TD_MAX(TD_MAX(o->cap_text * 2, o->n_text + text_len + 1), (size_t)64);
        char *p = realloc(o->text, cap);
        if (!p)
            return false;
        o->text = p;
        o->cap_text = cap;
    }
    return true;
}

/* text may be NULL when len is 0 (an empty stop matcher's emit). */
static void out_append_text(router_out_t *o, const char *text, size_t len)
{
    if (len)
        memcpy(o->text + o->n_text, text, len);
    o->n_text += len;
    o->text[o->n_text] = '\0';
}

/* The pending output was queued on the stream at `now`: TTFT/TPOT and token counts. */
static void out_account(router_req_t *r, uint64_t now)
{
    router_state_t *s = r->s;
    uint32_t n = r->out.n;
    if (n && r->t_lost) { /* the first token since its pair was lost: the migration's gap */
        td_metric_observe(s->m_migration_s, (double)(now - r->t_lost) * 1e-9);
        r->t_lost = 0;
    }
    if (n && !r->t_first) {
        r->t_first = now;
        td_metric_observe(s->m_ttft, (double)(now - r->t_arrival) * 1e-9);
    } else if (n && r->t_last) {
        td_metric_observe(s->m_tpot, (double)(now - r->t_last) * 1e-9 / (double)n);
    }
    if (n)
        r->t_last = now;
    td_metric_add(s->m_tokens, (double)n);
    r->sent_msg = true;
}

static void out_clear(router_out_t *o)
{
    o->n = 0;
    o->n_text = 0;
    if (o->text)
        o->text[0] = '\0';
    free(o->prompt_lps);
    o->prompt_lps = NULL;
    o->n_prompt_lps = 0;
}

/* Sends the pending output as one message through the request's front door, unless its
 * stream is over its send bound: then it stays pending until the front door says writable
 * (router_req_writable). */
void router_out_flush(router_req_t *r, uint64_t now)
{
    if (r->blocked || !r->client || r->first_lp_wait || (!r->out.n && !r->out.n_text && !r->out.n_prompt_lps))
        return;
    td_status_t st = r->sink->send(r);
    if (st == TD_ERR_BUSY) {
        r->blocked = true;
        r->blocked_turn = r->s->turn;
        return;
    }
    if (st != TD_OK) {
        if (st != TD_ERR_CANCELLED) /* the cancel callback ends it otherwise */
            td_warn("request %s: %u tokens not queued to the client's stream: %s", r->id, r->out.n, td_strerror(st));
        return;
    }
    out_account(r, now);
    out_clear(&r->out);
}

/* The last message (pending output, finish reason, usage, timings), queued past the send
 * bound (the backlog is bounded by max-backlog-tokens), and the stream ends OK. Ends r. */
void router_req_finish(router_req_t *r, router_finish_t reason)
{
    router_state_t *s = r->s;
    router_peer_t *dp = &s->peers[r->pick.pair.decode];
    if (dp->generation == r->decode_gen)
        dp->admit_refused = false; /* its blocks and request slot are free again */
    if (r->first_lp_wait) {
        td_warn("request %s: finished before the prefill node's first-token log-probability came; token 0 goes "
                "out with logprob 0", r->id);
        r->first_lp_wait = false;
    }
    if (r->stop && s->tok && reason != ROUTER_FINISH_STOP) {
        const char *a;
        size_t alen;
        td_stop_result_t sr = {0};
        if (td_detok_flush(&r->detok, &a, &alen) == TD_OK && td_stop_feed(r->stop, a, alen, &sr) == TD_OK) {
            const char *b = NULL;
            size_t blen = 0;
            if (!sr.matched)
                td_stop_flush(r->stop, &b, &blen);
            if (out_reserve(&r->out, sr.emit_len + blen, r->logprobs.on)) {
                out_append_text(&r->out, sr.emit, sr.emit_len);
                if (blen)
                    out_append_text(&r->out, b, blen);
            }
        }
    }
    router_lease_forget(r); /* the decode node freed it with the finish (or was told to) */
    uint64_t now = td_now_ns();
    bool had_first = r->t_first != 0;
    router_summary_t sum = {.reason = reason, .prompt_tokens = (uint32_t)r->n_prompt,
                            .completion_tokens = r->completion, .cached_tokens = r->cached,
                            .migrations = (uint32_t)r->n_migrations};
    out_account(r, now);
    sum.queue_s = (double)(r->t_picked - r->t_arrival) * 1e-9;
    sum.prefill_s = r->prefill_s;
    sum.transfer_s = r->transfer_s;
    sum.first_token_s = r->t_first ? (double)(r->t_first - r->t_arrival) * 1e-9 : 0;
    sum.per_token_s = r->completion > 1 && had_first ? (double)(r->t_last - r->t_first) * 1e-9 / (r->completion - 1) : 0;
    sum.total_s = (double)(now - r->t_arrival) * 1e-9;
    sum.prefill_local = r->pick.pair.prefill == r->pick.pair.decode;
    sum.prefill_peer = r->pick.peer;
    const router_node_t *pn = router_registry_node_const(s->reg, r->pick.pair.prefill),
                        *dn = router_registry_node_const(s->reg, r->pick.pair.decode);
    snprintf(sum.prefill_node, sizeof sum.prefill_node, "%s", pn ? pn->info.id : "");
    snprintf(sum.decode_node, sizeof sum.decode_node, "%s", dn ? dn->info.id : "");
    if (r->client) {
        r->sink->finish(r, &sum);
        r->client = NULL;
    }
    router_count_outcome(s, "ok");
    td_metric_observe(s->m_output_tokens, (double)r->completion);
    router_req_end(r);
}

/* A stop id of the request, or an EOS id of the model (unless ignore_eos): the ids the
 * request's decode node registered, the very ids it stops later tokens at, so that the first
 * token (from the prefill node) ends a request exactly as a later one would, with or without
 * a tokenizer on the router. */
static bool is_stop_id(const router_req_t *r, uint32_t token)
{
    for (size_t i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == token)
            return true;
    if (r->ignore_eos)
        return false;
    const router_node_t *d = router_registry_node(r->s->reg, r->pick.pair.decode);
    for (int32_t i = 0; d && i < d->info.n_eos; i++)
        if (d->info.eos_ids[i] == (int32_t)token)
            return true;
    return false;
}

/* The client has not drained its stream for ROUTER_BACKLOG_GRACE_TURNS loop turns and its
 * backlog is past the bound. */
bool router_backlog_over(const router_req_t *r)
{
    /* with logprobs a pending token is up to ~240 bytes of the message (a TokenLogprob of 20
     * alternatives): 8192 of them stay inside the gateway's 4 MiB message bound, beside a
     * first message's 4096 prompt logprobs, whatever max-backlog-tokens says */
    int64_t bound = r->s->cfg.max_backlog_tokens;
    if (r->logprobs.on)
        bound = TD_MIN(bound, (int64_t)ROUTER_LOGPROBS_MAX_BACKLOG);
    return r->blocked && (int64_t)r->out.n > bound && r->s->turn - r->blocked_turn >= ROUTER_BACKLOG_GRACE_TURNS;
}

void router_req_fail_slow(router_req_t *r)
{
    char msg[160];
    snprintf(msg, sizeof msg, "request %s: the client is not reading its stream (%u tokens pending)", r->id, r->out.n);
    td_warn("%s", msg);
    router_req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, msg, "slow_client");
}

/* Keeps token as output index r->completion in r->gen (what a migration replays): grows by
 * doubling, so a request allocates O(log n) times. False: out of memory. */
static bool gen_push(router_req_t *r, uint32_t token)
{
    if (r->completion == r->cap_gen) {
        uint32_t cap = r->cap_gen ? r->cap_gen * 2 : 16;
        uint32_t *g = realloc(r->gen, cap * sizeof *g);
        if (!g)
            return false;
        r->gen = g;
        r->cap_gen = cap;
    }
    r->gen[r->completion] = token;
    return true;
}

/* One new token of a request, appended to its pending output (the caller flushes), with
 * its log-probability when the request asked (lp; NULL: not known yet, a placeholder that
 * router_first_from_prefill fills). Returns false when the request ended here (stop
 * string, backlog bound, no memory). */
static bool out_token(router_req_t *r, uint32_t token, const td_token_logprob_t *lp)
{
    router_state_t *s = r->s;
    const char *text = "";
    size_t len = 0;
    bool matched = false;
    if (s->tok && !td_tokenizer_id_to_piece(s->tok, (int32_t)token, NULL)) {
        /* a model's vocabulary may be padded past its tokenizer's: the id goes out without
         * text, counted and logged once per request (when it ends), the stream left as it was */
        if (!r->n_no_text++)
            r->first_no_text = token;
    } else if (r->stop && s->tok) {
        const char *piece;
        size_t plen;
        td_stop_result_t sr;
        if (td_detok_push(&r->detok, (int32_t)token, &piece, &plen) == TD_OK &&
            td_stop_feed(r->stop, piece, plen, &sr) == TD_OK) {
            text = sr.emit;
            len = sr.emit_len;
            matched = sr.matched;
        }
    }
    if (!out_reserve(&r->out, len, r->logprobs.on) || !gen_push(r, token)) {
        router_req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, "router: out of memory", "exhausted");
        return false;
    }
    r->completion++;
    if (r->logprobs.on)
        r->out.lps[r->out.n] = lp ? *lp : (td_token_logprob_t){.token = (int32_t)token};
    r->out.ids[r->out.n++] = token;
    out_append_text(&r->out, text, len);
    if (matched) {
        router_lease_release(r, TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_CANCELLED);
        router_req_finish(r, ROUTER_FINISH_STOP);
        return false;
    }
    if (router_backlog_over(r)) {
        router_req_fail_slow(r);
        return false;
    }
    r->dirty = true;
    return true;
}

static void first_mismatch(router_req_t *r, const char *sent_by, uint32_t sent, uint32_t other)
{
    td_warn("request %s: first token %u came from the %s, the other source says %u; the client got %u", r->id, sent,
            sent_by, other, sent);
    td_metric_inc(r->s->m_first_mismatch);
}

/* The Prefill stream's log-probabilities, when the request asked: the prompt's go to the
 * pending output (sent with the next message: the first, or the finish if token 0 is a stop
 * id), the first token's into *first_p (true when there is one). */
static bool prefill_logprobs(router_req_t *r, const Tandem__Control__V1__PrefillResponse *p, td_token_logprob_t *first_p)
{
    if (!r->logprobs.on)
        return false;
    if (r->logprobs.prompt && p->n_prompt_logprobs) {
        td_token_logprob_t *lps = malloc(p->n_prompt_logprobs * sizeof *lps);
        if (lps) {
            for (size_t i = 0; i < p->n_prompt_logprobs; i++)
                td_node_logprob_from_proto(p->prompt_logprobs[i], &lps[i]);
            free(r->out.prompt_lps); /* an earlier pair's, never sent */
            r->out.prompt_lps = lps;
            r->out.n_prompt_lps = (uint32_t)p->n_prompt_logprobs;
        } else {
            td_warn("request %s: out of memory for %zu prompt log-probabilities; sent without them", r->id,
                    p->n_prompt_logprobs);
        }
    }
    if (!p->first_logprob) {
        td_warn("request %s: the prefill node sent no log-probability for the first token", r->id);
        return false;
    }
    td_node_logprob_from_proto(p->first_logprob, first_p);
    return true;
}

/* Token index 0 from the Prefill stream: sent at once unless the lease's first step entry
 * already sent it (then it is only compared, and gives its logprob to the held output), or
 * it is a stop id (the decode node's finish entry will end the request). May end r. */
void router_first_from_prefill(router_req_t *r, const Tandem__Control__V1__PrefillResponse *p)
{
    uint32_t token = p->first_token;
    td_token_logprob_t lp;
    bool have_lp = prefill_logprobs(r, p, &lp);
    switch (r->first_src) {
    case FIRST_NONE:
        r->first_token = token;
        if (is_stop_id(r, token)) {
            r->first_src = FIRST_WITHHELD;
            return;
        }
        r->first_src = FIRST_FROM_PREFILL;
        if (out_token(r, token, have_lp ? &lp : NULL)) {
            r->dirty = false;
            router_out_flush(r, td_now_ns());
        }
        return;
    case FIRST_FROM_DECODE:
        if (token != r->first_token)
            first_mismatch(r, "decode node", r->first_token, token);
        if (r->first_lp_wait) {
            r->first_lp_wait = false;
            if (have_lp && token == r->first_token && r->out.lps)
                r->out.lps[0] = lp; /* token 0 is still the held output's first */
            if (r->finish_deferred)
                router_req_finish(r, r->deferred_reason);
            else
                router_out_flush(r, td_now_ns());
        }
        return;
    default: return;
    }
}

/* The lease's first SEQ_EVENT_TOKEN entry (has_lp: with its logprob, as when the decode node
 * prefilled the prompt itself): true when it is to be relayed (it came first). */
static bool first_from_decode(router_req_t *r, uint32_t token, bool has_lp)
{
    switch (r->first_src) {
    case FIRST_FROM_PREFILL:
        if (token != r->first_token)
            first_mismatch(r, "prefill node", r->first_token, token);
        return false;
    case FIRST_WITHHELD: first_mismatch(r, "decode node", token, r->first_token); /* fall through */
    default:
        r->first_src = FIRST_FROM_DECODE;
        r->first_token = token;
        /* without its logprob, that comes with the Prefill stream: hold the output until then */
        r->first_lp_wait = r->logprobs.on && !has_lp && r->completion == 0;
        return true;
    }
}

/* ---- decode node step streams ---------------------------------------------------------- */

/* The decode node finished the sequence: the last message now, or, while token 0's logprob
 * is still due from the Prefill stream, once it comes (router_first_from_prefill). */
static void finish_entry(router_req_t *r, router_finish_t reason)
{
    if (r->first_lp_wait) {
        r->finish_deferred = true;
        r->deferred_reason = reason;
        return;
    }
    router_req_finish(r, reason);
}

void router_on_steps_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    router_peer_t *p = data;
    router_state_t *s = p->s;
    int32_t d = (int32_t)(p - s->peers);
    const Tandem__Control__V1__StepBatch *b = (const void *)msg;
    bool any = false;
    for (size_t i = 0; i < b->n_seqs; i++) {
        const Tandem__Control__V1__SeqStep *q = b->seqs[i];
        router_req_t *r = router_lease_find(s, d, p->generation, q->lease_id);
        if (!r || !r->client)
            continue;
        switch (q->event) {
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN: {
            /* a moved stream's entries are all new tokens (token 0 is the client's already) */
            if (r->decode_tokens++ == 0 && !r->resumed && !first_from_decode(r, q->token, q->logprob != NULL))
                break; /* token 0 already sent from the Prefill stream */
            td_token_logprob_t lp;
            if (q->logprob)
                td_node_logprob_from_proto(q->logprob, &lp);
            any |= out_token(r, q->token, q->logprob ? &lp : NULL);
            break;
        }
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_LENGTH:
            finish_entry(r, ROUTER_FINISH_LENGTH);
            break;
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_STOP:
            finish_entry(r, ROUTER_FINISH_STOP);
            break;
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_EOS:
            finish_entry(r, ROUTER_FINISH_EOS);
            break;
        default:
            router_req_lost(r, "the decode node dropped the sequence");
            break;
        }
    }
    /* after the entries: a finish among them lifts an Admit refusal */
    router_node_t *node = router_registry_node(s->reg, d);
    if (node && !p->admit_refused)
        node->load.free_blocks = (int32_t)TD_MIN(b->free_kv_blocks, (uint32_t)INT32_MAX);
    /* one message per request per step, whatever the entries were; one clock reading for
     * the step's messages (a reading per message was 7% of the relay's CPU) */
    uint64_t now = any ? td_now_ns() : 0;
    for (size_t i = 0; any && i < b->n_seqs; i++) {
        router_req_t *r = router_lease_find(s, d, p->generation, b->seqs[i]->lease_id);
        if (r && r->dirty) {
            r->dirty = false;
            router_out_flush(r, now);
        }
    }
    router_want_pump(s);
}

void router_on_steps_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    router_peer_t *p = data;
    router_state_t *s = p->s;
    if (p->steps != c)
        return;
    p->steps = NULL;
    int32_t d = (int32_t)(p - s->peers);
    const router_node_t *n = router_registry_node_const(s->reg, d);
    td_warn("router: decode node %s lost (%s: %s)", n ? n->info.id : "?", td_grpc_code_name(code), msg);
    router_node_gone(s, d, "decode node lost", true);
}

