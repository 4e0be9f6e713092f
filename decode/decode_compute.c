/*
 * decode_compute: the decode node's compute thread (decode_state.h): admissions whose KV
 * landed become sequences, cancels end them, and each step's events go back to the loop as
 * one decode_out_t through the worker's bounded result ring.
 */
#include "decode_state.h"

#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_util.h"

/* Speculative decoding's series from the scheduler's counters (compute thread): counters by
 * their growth since the last step, the acceptance (accepted / drafted) and the tokens per
 * sequence-step (1 without speculation; the speed-up in steps) since startup. */
static void spec_metrics(decode_state_t *s, const td_spec_stats_t *now)
{
    td_spec_stats_t *was = &s->spec_seen;
    td_metric_add(s->m_spec_verify, (double)(now->verify_steps - was->verify_steps));
    td_metric_add(s->m_spec_drafted, (double)(now->drafted - was->drafted));
    td_metric_add(s->m_spec_accepted, (double)(now->accepted - was->accepted));
    uint64_t seq_steps = now->verify_steps + now->plain_steps;
    td_metric_set(s->m_spec_acceptance, td_spec_acceptance(now));
    if (seq_steps)
        td_metric_set(s->m_spec_tokens_per_step, (double)(now->tokens + now->plain_steps) / (double)seq_steps);
    *was = *now;
}

/* A step's time into the heartbeat's figures (decode_state_t: step_ns, milli_tok_s, tpot_us):
 * the step-cost fit gets every step (decode_sched_note_step_time), and its per-token prompt
 * cost is the local prefill rate the router prices a local prefill with (td_place, conditional
 * disaggregation); the pace is a moving mean over the last eight or so steps without prompt
 * chunks (the running streams' pace, which also ranks the node). */
static void pace_note(decode_state_t *s, double dt, int32_t n_prefill_tokens)
{
    decode_sched_note_step_time(s->sched, dt);
    td_stepcost_fit_t f = decode_sched_step_cost(s->sched);
    atomic_store(&s->milli_tok_s, f.valid ? (int64_t)(1e3 / f.per_prefill_s) : 0);
    td_metric_set(s->m_token_cost, f.valid ? f.per_prefill_s : 0);
    atomic_store(&s->spread_ns, f.valid ? (int64_t)(f.spread_s * 1e9) : 0);
    if (n_prefill_tokens > 0)
        return;
    int64_t prev = atomic_load(&s->step_ns), now = (int64_t)(dt * 1e9);
    atomic_store(&s->step_ns, prev ? (prev * 7 + now) / 8 : now);
}

/* The command ring's bound: a kv-ready command holds at least one block, so at most
 * kv-blocks of them wait; Release commands come one per request the router ends, and
 * 4 * max-requests + 16 is their margin. A full ring is refused, not waited on: kv-ready's
 * blocks go back to the pool, Release answers released = false. */
int32_t decode_cmd_ring_size(const decode_config_t *cfg)
{
    return (int32_t)(cfg->kv_blocks + 4 * cfg->max_requests + 16);
}

/* One allocation for a whole step result. NULL: out of memory. */
static decode_out_t *out_new(int32_t cap)
{
    decode_out_t *o = calloc(1, sizeof *o + (size_t)cap * sizeof *o->seqs);
    if (o)
        o->seqs = (decode_out_seq_t *)(o + 1);
    return o;
}

void decode_out_free(decode_out_t *o)
{
    if (!o)
        return;
    for (int32_t i = 0; i < o->n_seqs; i++)
        free(o->seqs[i].kv_blocks);
    free(o);
}

static void add_seq(decode_out_t *o, uint64_t id, int32_t token, decode_out_kind_t kind)
{
    o->seqs[o->n_seqs++] = (decode_out_seq_t){.lease_id = id, .token = token, .kind = kind};
}

/* A kv_out prompt's KV is complete (DECODE_FINISH_KV_OUT): its first token and a copy of its
 * block table go to the loop, which sends the blocks and then asks for their release. Without
 * memory for the copy the prompt fails here and its blocks go back at once. */
static void add_kv_out(decode_state_t *s, decode_out_t *o, const decode_event_t *e)
{
    int32_t *b = malloc((size_t)TD_MAX(e->n_kv_blocks, 1) * sizeof *b);
    if (!b) {
        td_warn("decode: kv_out %llu: out of memory for its block table; it fails", (unsigned long long)e->id);
        decode_sched_release(s->sched, e->id);
        add_seq(o, e->id, -1, DECODE_OUT_FAILED);
        return;
    }
    memcpy(b, e->kv_blocks, (size_t)e->n_kv_blocks * sizeof *b);
    add_seq(o, e->id, e->token, DECODE_OUT_KV_OUT);
    decode_out_seq_t *q = &o->seqs[o->n_seqs - 1];
    q->kv_blocks = b;
    q->n_kv_blocks = e->n_kv_blocks;
    q->has_logprob = e->has_logprob;
    q->logprob = e->logprob;
}

/* Admits a request whose KV landed in its lease's blocks: the sequence adopts them (the
 * command's references pass to it), or they go back to the pool. */
static void compute_admit(decode_state_t *s, decode_cmd_t *c, decode_out_t *fail_out)
{
    decode_admit_t *a = c->admit;
    decode_request_t r = {.id = c->lease_id, .prompt = a->prompt, .n_prompt = a->n_prompt,
                          .kv_blocks = c->blocks, .n_kv_blocks = c->n_blocks, .first_token = c->first_token,
                          .sampling = a->sampling, .max_tokens = a->max_tokens,
                          .stop_ids = a->stop_ids, .n_stop_ids = a->n_stop_ids,
                          .logprobs = a->logprobs.on, .top_logprobs = a->logprobs.top,
                          .ignore_eos = a->ignore_eos, .replay = a->replay, .n_replay = a->n_replay,
                          .cache_salt = a->cache_salt,
                          .grammar = a->grammar, .tpot_objective_s = a->tpot_objective_s,
                          .kv_out = a->kv_out,
                          .deadline_ns = a->kv_out ? (int64_t)a->deadline_ns : 0}; /* the call's */
    if (decode_sched_admit(s->sched, &r) != TD_OK) {
        td_warn("decode: lease %llu not admitted: %s", (unsigned long long)c->lease_id, td_last_error());
        td_kv_unref_blocks_for(s->kv, TD_KV_HOLDER_LANDED, c->blocks, c->n_blocks);
        add_seq(fail_out, c->lease_id, -1, DECODE_OUT_FAILED);
    }
    c->n_blocks = 0; /* the references went to the sequence or back to the pool */
}

/* No memory for a step result. Nothing here may stop the node: the admissions taken fail
 * (their blocks go back to the pool, their lease ids are reported FAILED with the next
 * result), cancels apply, and no step runs: the running sequences lose nothing and step
 * again after an idle wait (s->backoff), when memory may be back. */
static void compute_no_memory(decode_state_t *s, decode_cmd_t *cmds, int32_t n_cmds)
{
    td_warn("decode: out of memory for a step result: %d commands taken, the running sequences wait", n_cmds);
    for (int32_t i = 0; i < n_cmds; i++) {
        decode_cmd_t *c = &cmds[i];
        if (c->admit) {
            td_kv_unref_blocks_for(s->kv, TD_KV_HOLDER_LANDED, c->blocks, c->n_blocks);
            if (s->n_failed < decode_cmd_ring_size(&s->cfg))
                s->failed[s->n_failed++] = c->lease_id;
            else /* the report is lost too: the router's deadline ends the request */
                td_warn("decode: lease %llu failed unreported (out of memory)", (unsigned long long)c->lease_id);
        } else if (c->release) {
            decode_sched_release(s->sched, c->lease_id);
        } else if (c->forget) {
            decode_sched_cancel_all(s->sched);
        } else {
            decode_sched_cancel(s->sched, c->lease_id);
        }
        if (c->admit)
            atomic_fetch_sub(&s->admits_posted, 1);
        atomic_fetch_sub(&s->prompt_posted, c->prompt_posted);
        decode_admit_free(c->admit);
        free(c->blocks);
    }
    s->backoff = true;
}

void decode_compute_main(void *arg)
{
    decode_state_t *s = arg;
    for (;;) {
        void *taken;
        int32_t n_cmds = td_node_worker_take(&s->worker, !decode_sched_busy(s->sched) || s->backoff, &taken);
        if (n_cmds < 0)
            break;
        s->backoff = false;
        if (n_cmds == 0 && !decode_sched_busy(s->sched) && !s->n_failed)
            continue; /* an idle wait ran out */
        decode_cmd_t *cmds = taken;
        /* two entries a sequence at most: admitted ones and kv_out ones, max_requests each */
        int32_t cap = (int32_t)s->cfg.max_requests * 4 + n_cmds + s->n_failed + 1;
        decode_out_t *o = out_new(cap);
        if (!o) {
            compute_no_memory(s, cmds, n_cmds);
            continue;
        }
        for (int32_t i = 0; i < s->n_failed; i++)
            add_seq(o, s->failed[i], -1, DECODE_OUT_FAILED);
        s->n_failed = 0;
        int64_t taken_prompt = 0;
        for (int32_t i = 0; i < n_cmds; i++) {
            decode_cmd_t *c = &cmds[i];
            if (c->admit)
                compute_admit(s, c, o);
            else if (c->release) /* its transfer is over: the blocks go (NOT_FOUND: cancelled already) */
                decode_sched_release(s->sched, c->lease_id);
            else if (c->forget) /* the router dropped this node: nobody reads these any more */
                decode_sched_cancel_all(s->sched);
            else
                decode_sched_cancel(s->sched, c->lease_id);
            taken_prompt += c->prompt_posted;
            decode_admit_free(c->admit);
            free(c->blocks);
        }
        if (taken_prompt) { /* a step of these chunks may run for a second: say so now */
            decode_sched_stats_t ss;
            decode_sched_stats(s->sched, &ss);
            atomic_store(&s->load_context, ss.context_tokens);
            atomic_fetch_sub(&s->prompt_posted, taken_prompt);
        }
        decode_step_result_t res = {0};
        uint64_t t0 = td_now_ns();
        bool stepped = false;
        if (decode_sched_busy(s->sched)) {
            stepped = decode_sched_step(s->sched, (int64_t)t0, &res) == TD_OK;
            /* out of memory (logged there), or the pool is held by leases still landing:
               wait for a command (an admission brings their blocks) or idle-wait-ms, do not spin */
            s->backoff = !stepped || res.stalled;
        }
        if (stepped) {
            double dt = (double)(td_now_ns() - t0) * 1e-9;
            o->step_s = dt;
            for (int32_t i = 0; i < res.n_events && o->n_seqs + 2 <= cap; i++) {
                const decode_event_t *e = &res.events[i];
                if (e->finish == DECODE_FINISH_KV_OUT) {
                    add_kv_out(s, o, e);
                    continue;
                }
                if (e->token >= 0) {
                    add_seq(o, e->id, e->token, DECODE_OUT_TOKEN);
                    if (e->has_logprob) {
                        o->seqs[o->n_seqs - 1].has_logprob = true;
                        o->seqs[o->n_seqs - 1].logprob = e->logprob;
                    }
                }
                decode_out_kind_t kind;
                switch (e->finish) {
                case DECODE_FINISH_NONE: continue;
                case DECODE_FINISH_LENGTH: kind = DECODE_OUT_LENGTH; break;
                case DECODE_FINISH_STOP: kind = DECODE_OUT_STOP; break;
                default: kind = DECODE_OUT_FAILED; break;
                }
                add_seq(o, e->id, -1, kind);
            }
            if (res.n_prefill_tokens)
                td_metric_add(s->m_prefill_tokens, res.n_prefill_tokens);
            if (res.n_seqs) {
                td_metric_inc(s->m_steps);
                td_metric_observe(s->m_step_s, dt);
                td_metric_observe(s->m_batch, res.n_seqs);
                pace_note(s, dt, res.n_prefill_tokens);
            }
        }
        decode_sched_stats_t ss;
        decode_sched_stats(s->sched, &ss);
        td_metric_set(s->m_used, ss.used_blocks);
        td_metric_set(s->m_free, ss.free_blocks);
        td_metric_set(s->m_running, ss.running);
        td_metric_set(s->m_waiting, ss.waiting);
        td_metric_add(s->m_window_released, (double)(ss.window_released - s->window_released));
        s->window_released = ss.window_released;
        if (s->m_spec_verify)
            spec_metrics(s, &ss.spec);
        /* outs_unsent, load_running, admits_posted in this order (decode_busy reads them in
           the reverse one): a request is counted somewhere at every instant */
        if (o->n_seqs)
            atomic_fetch_add(&s->outs_unsent, 1);
        atomic_store(&s->load_running, ss.running + ss.waiting);
        atomic_store(&s->load_free, ss.free_blocks);
        atomic_store(&s->load_context, ss.context_tokens);
        atomic_store(&s->tpot_us, (int64_t)(ss.tpot_objective_s * 1e6));
        td_metric_set(s->m_tpot, ss.tpot_objective_s);
        o->free_blocks = (uint32_t)ss.free_blocks;
        o->step = ss.steps;
        if (!o->n_seqs || !td_node_worker_emit(&s->worker, &o)) {
            if (o->n_seqs)
                atomic_fetch_sub(&s->outs_unsent, 1);
            decode_out_free(o); /* nothing to send, or stopping */
        }
        int32_t n_admits = 0;
        for (int32_t i = 0; i < n_cmds; i++)
            n_admits += cmds[i].admit != NULL;
        if (n_admits)
            atomic_fetch_sub(&s->admits_posted, n_admits);
    }
}

