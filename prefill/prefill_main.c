/*
 * prefill_main: the prefill node process (see prefill_node.h and docs/cluster.md).
 *
 * Threads: the loop thread owns gRPC, /metrics, the router client and td_xfer; the compute
 * thread (td_node_worker) owns the engine and its prefill_sched. They talk through two
 * bounded rings under one mutex: loop → compute messages (submit, cancel, release: at most three per live job,
 * and live jobs are bounded by max-queue, so that ring never fills) and compute → loop
 * events (the compute thread waits, bounded, while that ring is full; the loop never
 * blocks), woken by a condition variable one way and uv_async_send the other.
 *
 * A Prefill call becomes a job. prefill_sched batches waiting prompts into engine steps
 * under a token budget (long prompts chunked, prefix cache on). In the step that runs a
 * prompt's last chunk, the engine's per-layer hook hands each finished layer to the loop
 * (one event per layer for all of the step's finishing prompts, with their block tables);
 * the loop calls td_xfer_send_layer() on the engine pool's layer slab, so UCX reads the
 * KV straight from the engine's blocks while later layers compute: no staging copy. The
 * sampled first token goes to the router at once (FIRST_TOKEN), kv-ready follows
 * (td_xfer_send_finish), and the decode node's verdict ends the call (KV_DELIVERED + OK,
 * or UNAVAILABLE naming the cause). The prompt keeps its blocks until the transfer's done
 * callback; only then the loop asks the compute thread to release them, exactly once.
 */
#include "prefill_node.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "control.pb-c.h"
#include "prefill_admit.h"
#include "prefill_sched.h"
#include "td_node_conf.h"
#include "td_node_client.h"
#include "td_node.h"
#include "td_node_worker.h"
#include "td_node_copier.h"
#include "td_node_xfer_metrics.h"
#include "td_backend.h"
#include "td_engine.h"
#include "td_grpc.h"
#include "td_list.h"
#include "td_log.h"
#include "td_metrics.h"
#include "td_model.h"
#include "td_sampler.h"
#include "td_util.h"
#include "td_xfer.h"

/* The prefill node's own keys; the common ones (model, router, host, advertise, node id,
 * ports, threads, log level) are td_node's. */
typedef struct prefill_config {
    int64_t kv_blocks;         /* the engine's pool (0: from kv_mem) */
    int64_t kv_mem;            /* MiB the pool may take when kv_blocks is 0 (0: a share of memory) */
    int64_t max_batch_tokens;  /* prompt tokens in one engine step */
    int64_t max_batch;         /* prompts in one engine step */
    int64_t max_queue;         /* Prefill calls accepted and not finished */
    int64_t max_queued_tokens; /* their prompt tokens still to compute */
    int64_t event_queue;       /* compute → loop events waiting at most */
    int64_t idle_wait_ms;      /* compute thread's bound on one idle wait */
    int64_t send_timeout_ms;   /* td_xfer: send begin → the decode node's verdict */
    int64_t xfer_checksum;     /* 1: transfers carry block checksums the decode node verifies */
} prefill_config_t;

typedef struct prefill_job {
    td_list_t link;            /* loop: in prefill_state_t.jobs */
    struct prefill_state *s;
    td_grpc_call_t *call;      /* NULL once the call ended (answered or cancelled) */
    uint64_t key;              /* td_xfer request id: FNV-1a of the request id string */
    uint64_t lease_id;
    td_xfer_token_t token;     /* the lease's data-plane token (PrefillRequest.xfer_token) */
    prefill_admit_t in;        /* the request, checked (its prompt read by the compute thread
                                  at submit; dst_blocks: the decode node's leased blocks) */
    int64_t deadline_ns;       /* td_now_ns clock; 0 = none */
    td_xfer_peer_t *peer;
    uint64_t t_accept;
    /* loop thread only, after submit */
    td_xfer_send_t *send;      /* the transfer, from its layer 0 until its done callback */
    td_status_t xfer_st;       /* first failure starting or feeding the transfer */
    uint64_t t_xfer;
    uint64_t t_first;          /* the first token's event reached the loop */
    bool pushed;               /* layer 0 of its last step arrived */
    bool computed;             /* the compute thread's verdict (EV_DONE) arrived */
    bool held;                 /* ... and the prompt still holds blocks there */
    bool cancel_posted, release_posted;
} prefill_job_t;

/* One engine step's finishing prompts, shared by that step's layer events. */
typedef struct prefill_push {
    int32_t n;
    prefill_job_t **jobs;      /* [n] */
    int32_t **blocks;          /* [n] block tables (copies) */
    int32_t *n_tokens;         /* [n] */
} prefill_push_t;

typedef enum { MSG_SUBMIT, MSG_CANCEL, MSG_RELEASE } prefill_msg_kind_t;

typedef struct prefill_msg { /* loop → compute */
    prefill_msg_kind_t kind;
    prefill_job_t *job;        /* the job's address is its prefill_sched id */
} prefill_msg_t;

typedef enum {
    EV_LAYER,    /* push's layer `layer` is in the pool */
    EV_PUSH_END, /* no more events refer to push: free it */
    EV_DONE,     /* the prompt's first token, or its failure */
    EV_GONE,     /* the scheduler let go of job (cancelled or released): free it */
} prefill_ev_kind_t;

typedef struct prefill_event { /* compute → loop */
    prefill_ev_kind_t kind;
    uint32_t layer;
    prefill_push_t *push;
    prefill_job_t *job;
    td_status_t status;
    int32_t first_token;
    int32_t cached;
    bool held;
    td_token_logprob_t *logprobs; /* EV_DONE, asked: prefill_output_t's (the loop frees it) */
    int32_t n_logprobs;
} prefill_event_t;

typedef struct prefill_state {
    td_node_t proc;        /* loop, signals, /metrics, router client, common config */
    prefill_config_t cfg;
    td_node_worker_t worker;    /* the compute thread, its message and event rings */
    td_model_t *model;
    td_backend_t *be;
    td_engine_t *eng;
    prefill_sched_t *sched;    /* compute thread once it runs */
    td_node_gram_t gram;       /* structured output (empty when the model has no tokenizer) */
    td_kv_layout_t layout;
    const uint8_t *pool;       /* the engine's KV pool: host memory read by UCX, or device
                                  memory staged through td_xfer's pinned ring with d2h */
    td_xfer_copier_t d2h;      /* the backend's async device-to-host copies (device pool) */
    int32_t pool_blocks;
    size_t pool_bytes;         /* the KV pool (td_engine_kv_plan) */
    td_xfer_t *xfer;
    td_grpc_server_t *grpc;
    td_metrics_t *metrics;
    td_node_xfer_metrics_t xfer_metrics; /* td_xfer's statistics on /metrics */
    td_metric_t *m_requests, *m_refused, *m_failed, *m_tokens, *m_cached, *m_seconds, *m_queue,
        *m_xfer_s, *m_steps, *m_step_s, *m_batch_tokens, *m_batch_size, *m_blocks_used;
    /* loop thread */
    td_list_t jobs;            /* live prefill_job_t, newest first */
    int32_t n_jobs;
    bool shutting_down;
    /* compute thread */
    prefill_push_t *cur_push;  /* the running step's, once its layer 0 is done */
    _Atomic int64_t unsubmitted_tokens; /* accepted, not yet taken by the compute thread */
    _Atomic int64_t sched_tokens;       /* prefill_sched_queued_tokens after the last step */
    _Atomic int64_t step_ns;            /* recent step time (moving mean), for heartbeats */
    _Atomic int64_t milli_tok_s;        /* recent prompt tokens per second x 1000 (moving mean) */
} prefill_state_t;

static uint64_t job_id(const prefill_job_t *j)
{
    return (uint64_t)(uintptr_t)j;
}

/* ---- compute thread ---------------------------------------------------------------- */

static void push_free(prefill_push_t *p)
{
    free(p);
}

/* Engine layer hook (through prefill_sched): layer `layer` of fin[0..n_fin) is in the pool. */
static void on_layer(void *arg, uint32_t layer, const prefill_finishing_t *fin, int32_t n_fin)
{
    prefill_state_t *s = arg;
    if (layer == 0) {
        size_t nb = 0;
        for (int32_t i = 0; i < n_fin; i++)
            nb += (size_t)fin[i].n_blocks;
        prefill_push_t *p = malloc(sizeof *p + (size_t)n_fin * (sizeof *p->jobs + sizeof *p->blocks +
                                                                 sizeof *p->n_tokens) + nb * sizeof(int32_t));
        s->cur_push = p;
        if (!p) { /* the loop sees these jobs done without a push and fails them */
            td_errorf(TD_ERR_NOMEM, "prefill: out of memory for a push of %d prompts", n_fin);
            return;
        }
        p->n = n_fin;
        p->jobs = (prefill_job_t **)(p + 1);
        p->blocks = (int32_t **)(p->jobs + n_fin);
        p->n_tokens = (int32_t *)(p->blocks + n_fin);
        int32_t *b = p->n_tokens + n_fin;
        for (int32_t i = 0; i < n_fin; i++) {
            p->jobs[i] = (prefill_job_t *)(uintptr_t)fin[i].id;
            p->blocks[i] = b;
            p->n_tokens[i] = fin[i].n_prompt;
            memcpy(b, fin[i].blocks, (size_t)fin[i].n_blocks * sizeof *b);
            b += fin[i].n_blocks;
        }
    }
    if (s->cur_push)
        td_node_worker_emit(&s->worker, &(prefill_event_t){.kind = EV_LAYER, .layer = layer, .push = s->cur_push});
}

static void handle_msg(prefill_state_t *s, const prefill_msg_t *m)
{
    prefill_job_t *j = m->job;
    uint64_t id = job_id(j);
    switch (m->kind) {
    case MSG_SUBMIT: {
        prefill_request_t rq = {.id = id, .prompt = j->in.tokens, .n_prompt = j->in.n_tokens,
                                .sampling = j->in.sampling, .deadline_ns = j->deadline_ns,
                                .logprobs = j->in.logprobs, .cache_salt = j->in.cache_salt,
                                .grammar = j->in.grammar};
        td_status_t st = prefill_sched_submit(s->sched, &rq);
        atomic_fetch_sub(&s->unsubmitted_tokens, j->in.n_tokens);
        if (st != TD_OK)
            td_node_worker_emit(&s->worker,
                               &(prefill_event_t){.kind = EV_DONE, .job = j, .status = st, .first_token = -1});
        break;
    }
    case MSG_CANCEL:
        /* Only a prompt no transfer has seen; a done one is released after its transfer. */
        if (prefill_sched_pending(s->sched, id)) {
            prefill_sched_cancel(s->sched, id);
            td_node_worker_emit(&s->worker, &(prefill_event_t){.kind = EV_GONE, .job = j});
        }
        break;
    case MSG_RELEASE:
        if (prefill_sched_release(s->sched, id) != TD_OK)
            td_warn("prefill: release of a prompt the scheduler does not hold (job %p)", (void *)j);
        td_node_worker_emit(&s->worker, &(prefill_event_t){.kind = EV_GONE, .job = j});
        break;
    }
}

static void update_blocks_used(prefill_state_t *s)
{
    td_kv_stats_t ks;
    td_kv_get_stats(td_engine_kv(s->eng), &ks);
    td_metric_set(s->m_blocks_used, ks.used);
}

/* One scheduler step; false when it made no progress (nothing to run, or the pool is
 * held by prompts whose transfers are still running). */
static bool run_step(prefill_state_t *s)
{
    prefill_step_result_t r;
    uint64_t t0 = td_now_ns();
    s->cur_push = NULL;
    td_status_t st = prefill_sched_step(s->sched, (int64_t)t0, &r);
    double step_s = (double)(td_now_ns() - t0) * 1e-9;
    if (s->cur_push &&
        !td_node_worker_emit(&s->worker, &(prefill_event_t){.kind = EV_PUSH_END, .push = s->cur_push}))
        push_free(s->cur_push); /* stopping: teardown ignores the layer events */
    s->cur_push = NULL;
    atomic_store(&s->sched_tokens, prefill_sched_queued_tokens(s->sched));
    update_blocks_used(s);
    if (st != TD_OK)
        return false; /* out of memory: logged by the scheduler; try again after a wait */
    if (r.n_seqs > 0) {
        td_metric_inc(s->m_steps);
        td_metric_observe(s->m_step_s, step_s);
        td_metric_observe(s->m_batch_tokens, r.n_tokens);
        td_metric_observe(s->m_batch_size, r.n_seqs);
        td_metric_add(s->m_tokens, r.n_tokens);
        int64_t prev = atomic_load(&s->step_ns), now = (int64_t)(step_s * 1e9);
        atomic_store(&s->step_ns, prev ? (prev * 7 + now) / 8 : now);
        /* the router sizes what it sends here by this rate (router_policy: prefill wait) */
        int64_t tps = (int64_t)((double)r.n_tokens / TD_MAX(step_s, 1e-6) * 1e3), prev_tps = atomic_load(&s->milli_tok_s);
        atomic_store(&s->milli_tok_s, prev_tps ? (prev_tps * 7 + tps) / 8 : tps);
    }
    for (int32_t i = 0; i < r.n_outputs; i++) {
        const prefill_output_t *o = &r.outputs[i];
        if (o->status == TD_OK)
            td_metric_add(s->m_cached, o->n_cached);
        if (!td_node_worker_emit(&s->worker, &(prefill_event_t){.kind = EV_DONE, .job = (prefill_job_t *)(uintptr_t)o->id,
                                                          .status = o->status, .first_token = o->first_token,
                                                          .cached = o->n_cached,
                                                          .held = o->held || o->status == TD_OK,
                                                          .logprobs = o->logprobs, .n_logprobs = o->n_logprobs}))
            free(o->logprobs); /* stopping: nobody will answer */
    }
    return r.n_seqs > 0 || r.n_outputs > 0;
}

static void compute_main(void *arg)
{
    prefill_state_t *s = arg;
    bool progressed = false;
    for (;;) {
        bool work = prefill_sched_queued(s->sched) > 0 && progressed;
        void *taken;
        int32_t n = td_node_worker_take(&s->worker, !work, &taken);
        if (n < 0)
            break;
        const prefill_msg_t *msgs = taken;
        for (int32_t i = 0; i < n; i++)
            handle_msg(s, &msgs[i]);
        /* before the step: the prompts just taken left unsubmitted_tokens, and a step of a long
           one runs for seconds, through heartbeats that must still count it (the router's
           prefill wait; before, they said 0 queued until the step ended) */
        if (n > 0)
            atomic_store(&s->sched_tokens, prefill_sched_queued_tokens(s->sched));
        progressed = prefill_sched_queued(s->sched) > 0 && run_step(s);
        if (n > 0) {
            atomic_store(&s->sched_tokens, prefill_sched_queued_tokens(s->sched));
            update_blocks_used(s);
        }
    }
}

/* ---- loop thread -------------------------------------------------------------------- */

/* Loop → compute. A job posts each of submit, cancel and release at most once, and only
 * a cancel can outlive its job (posted after the compute thread failed the prompt, freed
 * at that EV_DONE, dropped unread at the next drain): at most max_queue live jobs' three
 * plus max_queue stale cancels, so a ring of 4 * max_queue + 16 cannot be full. */
static int32_t msg_ring_size(const prefill_config_t *cfg)
{
    return (int32_t)(4 * cfg->max_queue + 16);
}

static void post(prefill_state_t *s, prefill_msg_kind_t kind, prefill_job_t *j)
{
    bool queued = td_node_worker_post(&s->worker, &(prefill_msg_t){.kind = kind, .job = j});
    TD_ASSERT(queued);
}

static void job_free(prefill_job_t *j)
{
    if (!j)
        return;
    prefill_admit_free(&j->in);
    free(j);
}

/* The job leaves the node: nothing refers to it any more. */
static void job_drop(prefill_job_t *j)
{
    prefill_state_t *s = j->s;
    if (j->call) { /* every path answers before; never leave a call open */
        td_grpc_call_set_data(j->call, NULL);
        td_grpc_call_finish(j->call, TD_GRPC_INTERNAL, "prefill: request dropped");
    }
    td_list_remove(&j->link);
    s->n_jobs--;
    td_metric_set(s->m_queue, s->n_jobs);
    job_free(j);
}

/* Ends the call (if it is still there) with `code`; counts failures. */
static void job_finish(prefill_job_t *j, td_grpc_code_t code, const char *why)
{
    if (code != TD_GRPC_OK)
        td_metric_inc(j->s->m_failed);
    if (!j->call)
        return;
    td_grpc_call_set_data(j->call, NULL);
    td_grpc_call_finish(j->call, code, why);
    j->call = NULL;
}

/* Blocks go back once the verdict is in and no transfer can read them any more. */
static void job_maybe_release(prefill_job_t *j)
{
    if (j->computed && j->held && !j->send && !j->release_posted) {
        j->release_posted = true;
        post(j->s, MSG_RELEASE, j);
    }
}

static void on_xfer_done(void *arg, uint64_t request_id, td_status_t st)
{
    prefill_job_t *j = arg;
    prefill_state_t *s = j->s;
    j->send = NULL;
    double transfer_s = (double)(td_now_ns() - j->t_xfer) * 1e-9;
    if (st == TD_OK && j->xfer_st == TD_OK) {
        td_metric_observe(s->m_xfer_s, transfer_s);
        td_debug("prefill: request %016llx: %d tokens, first token %.6f s after accept, kv delivered %.6f s "
                 "after layer 0, %.6f s after the first token", (unsigned long long)j->key, j->in.n_tokens,
                 (double)(j->t_first - j->t_accept) * 1e-9, transfer_s, (double)(td_now_ns() - j->t_first) * 1e-9);
        if (j->call) {
            Tandem__Control__V1__PrefillResponse r = TANDEM__CONTROL__V1__PREFILL_RESPONSE__INIT;
            r.phase = TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_KV_DELIVERED;
            r.transfer_s = transfer_s;
            td_grpc_call_send(j->call, &r.base); /* CANCELLED: the cancel callback runs */
            job_finish(j, TD_GRPC_OK, NULL);
        }
    } else {
        if (j->xfer_st == TD_OK)
            j->xfer_st = st;
        if (j->call) {
            char why[200];
            snprintf(why, sizeof why, "prefill: kv transfer to the decode node failed: %s",
                     td_strerror(j->xfer_st));
            td_info("prefill: request %016llx: %s", (unsigned long long)j->key, why);
            job_finish(j, TD_GRPC_UNAVAILABLE, why);
        }
    }
    job_maybe_release(j);
}

static void job_abort_send(prefill_job_t *j, td_status_t why)
{
    if (j->xfer_st == TD_OK)
        j->xfer_st = why;
    if (j->send)
        td_xfer_send_abort(j->send, why); /* the done callback follows from the loop */
}

/* Layer 0 of the job's last step is in: start its transfer. */
static void job_begin_send(prefill_job_t *j, int32_t n_tokens)
{
    prefill_state_t *s = j->s;
    j->pushed = true;
    j->t_xfer = td_now_ns();
    if (!j->call) {
        j->xfer_st = TD_ERR_CANCELLED;
        return;
    }
    td_xfer_send_params_t p = {.request_id = j->key, .lease_id = j->lease_id, .token = j->token,
                               .dst_blocks = j->in.dst_blocks, .n_dst_blocks = j->in.n_dst,
                               .n_tokens = (uint32_t)n_tokens, .checksum = s->cfg.xfer_checksum != 0,
                               .mem = s->be->host_memory ? TD_XFER_MEM_HOST : TD_XFER_MEM_CUDA,
                               .done = on_xfer_done, .arg = j};
    td_status_t st = td_xfer_send_begin(s->xfer, j->peer, &p, &j->send);
    if (st != TD_OK) {
        j->send = NULL;
        j->xfer_st = st;
    }
}

static void on_ev_layer(prefill_state_t *s, uint32_t layer, prefill_push_t *p)
{
    const uint8_t *slab = s->pool + td_kv_block_offset(&s->layout, (uint32_t)s->pool_blocks, layer, 0);
    for (int32_t i = 0; i < p->n; i++) {
        prefill_job_t *j = p->jobs[i];
        if (layer == 0)
            job_begin_send(j, p->n_tokens[i]);
        if (!j->send || j->xfer_st != TD_OK)
            continue;
        td_status_t st = td_xfer_send_layer(j->send, layer, slab, p->blocks[i]);
        if (st != TD_OK)
            job_abort_send(j, st);
    }
}

static void on_ev_done(prefill_state_t *s, const prefill_event_t *ev)
{
    prefill_job_t *j = ev->job;
    j->computed = true;
    j->held = ev->held;
    if (ev->status != TD_OK) {
        job_abort_send(j, ev->status);
        char why[200];
        snprintf(why, sizeof why, "prefill failed: %s", td_strerror(ev->status));
        job_finish(j, td_grpc_code_from_status(ev->status), why);
        if (!j->held)
            job_drop(j); /* the scheduler no longer knows it */
        else
            job_maybe_release(j);
        return;
    }
    j->t_first = td_now_ns();
    double prefill_s = (double)(j->t_first - j->t_accept) * 1e-9;
    td_metric_observe(s->m_seconds, prefill_s);
    if (!j->pushed && j->xfer_st == TD_OK)
        j->xfer_st = TD_ERR_NOMEM; /* the push could not be recorded (logged) */
    if (j->xfer_st != TD_OK || !j->call) {
        job_abort_send(j, j->xfer_st != TD_OK ? j->xfer_st : TD_ERR_CANCELLED);
        if (j->call) {
            char why[200];
            snprintf(why, sizeof why, "prefill: kv transfer to the decode node could not start: %s",
                     td_strerror(j->xfer_st));
            job_finish(j, TD_GRPC_UNAVAILABLE, why);
        }
        job_maybe_release(j);
        return;
    }
    Tandem__Control__V1__PrefillResponse r = TANDEM__CONTROL__V1__PREFILL_RESPONSE__INIT;
    r.phase = TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_FIRST_TOKEN;
    r.first_token = (uint32_t)ev->first_token;
    r.cached_tokens = (uint32_t)ev->cached;
    r.prefill_s = prefill_s;
    td_node_logprob_msg_t first;
    Tandem__V1__TokenLogprob **prompt_msgs = NULL;
    void *prompt_mem = NULL;
    if (ev->n_logprobs > 0) {
        /* the prompt's positions (when asked), then the first token's */
        td_node_logprob_to_proto(&ev->logprobs[ev->n_logprobs - 1], &first);
        r.first_logprob = &first.m;
        if (ev->n_logprobs > 1 &&
            td_node_logprobs_to_proto_array(ev->logprobs, (size_t)ev->n_logprobs - 1, &prompt_msgs, &prompt_mem) == TD_OK) {
            r.prompt_logprobs = prompt_msgs;
            r.n_prompt_logprobs = (size_t)ev->n_logprobs - 1;
        } else if (ev->n_logprobs > 1) {
            td_warn("prefill: request %llu: out of memory for %d prompt log-probabilities; sent without them",
                    (unsigned long long)j->key, ev->n_logprobs - 1);
        }
    }
    td_grpc_call_send(j->call, &r.base); /* CANCELLED: the cancel callback aborts the send */
    free(prompt_mem);
    td_xfer_send_finish(j->send, ev->first_token);
}

static void on_events(void *data, void *events, int32_t n)
{
    prefill_state_t *s = data;
    const prefill_event_t *evs = events;
    for (int32_t i = 0; i < n; i++) {
        const prefill_event_t *ev = &evs[i];
        switch (ev->kind) {
        case EV_LAYER: on_ev_layer(s, ev->layer, ev->push); break;
        case EV_PUSH_END: push_free(ev->push); break;
        case EV_DONE:
            on_ev_done(s, ev);
            free(ev->logprobs);
            break;
        case EV_GONE: job_drop(ev->job); break;
        }
    }
}

static void on_prefill_cancel(td_grpc_call_t *call, td_status_t why, void *call_data)
{
    prefill_job_t *j = call_data;
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, NULL);
    if (!j)
        return;
    j->call = NULL;
    td_debug("prefill: request %016llx cancelled (%s) %s", (unsigned long long)j->key, td_strerror(why),
             j->send ? "during its transfer" : j->computed ? "after its transfer" : "before its last step");
    if (j->send) {
        job_abort_send(j, TD_ERR_CANCELLED); /* done callback → release */
    } else if (!j->computed && !j->cancel_posted) {
        j->cancel_posted = true; /* still queued: the scheduler drops it (EV_GONE); if it is
                                    already past that, EV_DONE follows and sees no call */
        post(j->s, MSG_CANCEL, j);
    }
}

static void on_prefill(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    prefill_state_t *s = data;
    const Tandem__Control__V1__PrefillRequest *r = (const void *)msg;
    td_metric_inc(s->m_requests);
    if (s->shutting_down) {
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "prefill node shutting down");
        return;
    }
    if (!td_node_take_or_refuse(&s->proc, call, s->m_refused, "prefill node", s->n_jobs, s->cfg.max_queue,
                                "queue full"))
        return;
    prefill_job_t *j = calloc(1, sizeof *j);
    if (!j) {
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, "prefill node: out of memory");
        return;
    }
    td_list_init(&j->link);
    char why[256];
    td_grpc_code_t code = prefill_admit_read(r, &s->model->config, s->layout.block_size, &j->in, why, sizeof why);
    if (code == TD_GRPC_OK && j->in.grammar && !s->gram.cache) {
        code = TD_GRPC_INVALID_ARGUMENT;
        snprintf(why, sizeof why, "prefill: a grammar (structured output) needs the model's tokenizer on this node, "
                 "and none is beside its model file");
    }
    if (code != TD_GRPC_OK) {
        job_free(j);
        td_grpc_call_finish(call, code, why);
        return;
    }
    if (r->xfer_token.len != sizeof j->token.b) {
        /* the decode node takes no KV for the lease without it (docs/security.md) */
        snprintf(why, sizeof why, "prefill: the call carries a kv transfer token of %zu bytes, not %zu (a router or "
                 "decode node older than this node?)", r->xfer_token.len, sizeof j->token.b);
        job_free(j);
        td_grpc_call_finish(call, TD_GRPC_FAILED_PRECONDITION, why);
        return;
    }
    memcpy(j->token.b, r->xfer_token.data, sizeof j->token.b);
    if (td_xfer_connect(s->xfer, r->decode_xfer.data, r->decode_xfer.len, &s->layout, &j->peer) != TD_OK) {
        job_free(j);
        td_grpc_call_finish(call, TD_GRPC_FAILED_PRECONDITION, td_last_error());
        return;
    }
    j->s = s;
    j->key = td_xfer_request_key(r->request_id);
    j->lease_id = r->lease_id;
    j->t_accept = td_now_ns();
    uint64_t dl_ms = td_grpc_call_deadline(call);
    if (dl_ms) {
        uint64_t now_ms = uv_now(&s->proc.loop);
        j->deadline_ns = (int64_t)(j->t_accept + (dl_ms > now_ms ? dl_ms - now_ms : 0) * 1000000ull);
        if (j->deadline_ns == 0)
            j->deadline_ns = 1;
    }
    j->call = call;
    td_grpc_call_set_data(call, j);
    td_grpc_call_on_cancel(call, on_prefill_cancel);
    td_list_push_front(&s->jobs, &j->link);
    s->n_jobs++;
    td_metric_set(s->m_queue, s->n_jobs);
    atomic_fetch_add(&s->unsubmitted_tokens, j->in.n_tokens);
    post(s, MSG_SUBMIT, j);
}

static void load_cb(void *data, td_node_load_t *l)
{
    prefill_state_t *s = data;
    l->queued_prefill_tokens = atomic_load(&s->unsubmitted_tokens) + atomic_load(&s->sched_tokens);
    l->free_blocks = td_kv_available(td_engine_kv(s->eng)); /* td_kv serializes: a hint */
    l->step_ms = (double)atomic_load(&s->step_ns) * 1e-6;
    l->prefill_tok_s = (double)atomic_load(&s->milli_tok_s) * 1e-3;
}

/* Draining's count: jobs on the node (queued, computing, their KV in transfer, or their
 * answer not yet written: +1 while the control server holds unwritten bytes). */
static int32_t prefill_busy(void *data)
{
    prefill_state_t *s = data;
    if (s->n_jobs)
        return s->n_jobs;
    return s->grpc && td_grpc_server_stats(s->grpc).queued_bytes > 0;
}

/* The prefill node's part of shutdown (td_node_shutdown closes the rest). */
static void on_shutdown(void *data)
{
    prefill_state_t *s = data;
    s->shutting_down = true;
    td_node_worker_stop(&s->worker); /* joins the compute thread, closes its async handle */
    td_grpc_server_close(s->grpc, NULL, NULL); /* open calls: cancel callbacks */
    s->grpc = NULL;
    td_xfer_destroy(s->xfer); /* finished sends: done callbacks with TD_ERR_CLOSED */
    s->xfer = NULL;
    TD_LIST_FOREACH(n, &s->jobs)
        TD_CONTAINER_OF(n, prefill_job_t, link)->send = NULL; /* unfinished sends end without a callback (freed later, from the loop) */
}

/* Sizes the KV pool (td_engine_kv_plan: kv-blocks, else what kv-mem holds and the node
 * can use) into cfg->kv_blocks before anything is allocated, and says so on stderr
 * whatever the log level. The pool holds the prompts of a step (a chunked one its whole
 * prefix), those whose KV is still in transfer, and the prefix cache: 8 steps' worth of
 * the larger of max-batch-tokens and the model's length is more than it can fill. */
static td_status_t size_pool(prefill_state_t *s, const td_engine_config_t *ec)
{
    int64_t step = TD_MAX(s->cfg.max_batch_tokens, (int64_t)s->model->config.max_seq_len);
    char what[96];
    snprintf(what, sizeof what, "8 steps of %lld tokens", (long long)step);
    td_kv_plan_params_t pp = {.n_blocks = s->cfg.kv_blocks, .kv_mem = (size_t)s->cfg.kv_mem << 20,
                              .percent = TD_KV_PREFILL_PERCENT, .cap = TD_KV_PREFILL_CAP,
                              .device = s->proc.device.cuda, .device_default = TD_KV_PREFILL_DEVICE_DEFAULT,
                              .useful_tokens = 8 * step, .useful_what = what};
    return td_node_plan_kv(&s->proc, s->model, ec, &pp, &s->cfg.kv_blocks, &s->pool_bytes);
}

static const double batch_token_buckets[] = {1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};
static const double batch_size_buckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};

static td_status_t metrics_init(prefill_state_t *s)
{
    td_status_t st = td_metrics_create(&s->metrics);
    if (st != TD_OK)
        return st;
    const td_metric_def_t defs[] = {
        TD_METRIC_DEF_COUNTER("tandem_prefill_requests_total", "Prefill calls received", &s->m_requests),
        TD_METRIC_DEF_COUNTER("tandem_prefill_refused_total", "Prefill calls refused (queue full)", &s->m_refused),
        TD_METRIC_DEF_COUNTER("tandem_prefill_failed_total", "Prefill calls that failed", &s->m_failed),
        TD_METRIC_DEF_COUNTER("tandem_prefill_tokens_total", "prompt tokens computed", &s->m_tokens),
        TD_METRIC_DEF_COUNTER("tandem_prefill_cached_tokens_total", "prompt tokens from the prefix cache", &s->m_cached),
        TD_METRIC_DEF_GAUGE("tandem_prefill_queue_depth", "Prefill calls accepted and not finished", &s->m_queue),
        TD_METRIC_DEF_HISTOGRAM("tandem_prefill_seconds", "Prefill call accepted until its first token",
                                td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_seconds),
        TD_METRIC_DEF_HISTOGRAM("tandem_prefill_transfer_seconds",
                                "KV push from the first layer until the decode node adopted",
                                td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_xfer_s),
        TD_METRIC_DEF_COUNTER("tandem_prefill_steps_total", "engine steps run", &s->m_steps),
        TD_METRIC_DEF_HISTOGRAM("tandem_prefill_step_seconds", "duration of one engine step",
                                td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_step_s),
        TD_METRIC_DEF_HISTOGRAM("tandem_prefill_batch_tokens", "prompt tokens in one engine step",
                                batch_token_buckets, TD_ARRAY_LEN(batch_token_buckets), &s->m_batch_tokens),
        TD_METRIC_DEF_HISTOGRAM("tandem_prefill_batch_size", "prompts in one engine step", batch_size_buckets,
                                TD_ARRAY_LEN(batch_size_buckets), &s->m_batch_size),
        TD_METRIC_DEF_GAUGE("tandem_prefill_kv_blocks_used",
                            "engine KV blocks referenced (prompts in progress or in transfer)", &s->m_blocks_used),
    };
    return td_metrics_register_all(s->metrics, defs, TD_ARRAY_LEN(defs));
}

int prefill_main(int argc, char **argv)
{
    prefill_state_t st_, *s = &st_;
    memset(s, 0, sizeof *s);
    td_list_init(&s->jobs);
    prefill_config_t *cfg = &s->cfg;
    const td_node_config_t *pc = &s->proc.cfg;
    prefill_sched_config_t dsc = prefill_sched_config_default();
    *cfg = (prefill_config_t){.kv_blocks = 0, .max_batch_tokens = dsc.max_batch_tokens,
                              .max_batch = dsc.max_batch, .max_queue = dsc.max_queue,
                              .max_queued_tokens = dsc.max_queued_tokens, .event_queue = 1024,
                              .idle_wait_ms = 50, .send_timeout_ms = 30000, .xfer_checksum = 0};
    const td_opt_t keys[] = {
        TD_OPT_INT("kv-blocks", &cfg->kv_blocks, 0, 1 << 24,
                   "KV pool blocks (prompts in flight + prefix cache; 0 = as many as kv-mem holds)"),
        TD_OPT_INT("kv-mem", &cfg->kv_mem, 0, 1 << 30,
                   "KV pool budget in MiB when kv-blocks is 0 (0 = 15% of the memory available, at most 16 GiB; "
                   "never more than 8 steps of max(max-batch-tokens, the model's length) tokens)"),
        TD_OPT_INT("max-batch-tokens", &cfg->max_batch_tokens, 1, 1 << 16,
                   "prompt tokens in one engine step (longer prompts are chunked)"),
        TD_OPT_INT("max-batch", &cfg->max_batch, 1, 4096, "prompts in one engine step"),
        TD_OPT_INT("max-queue", &cfg->max_queue, 1, 1 << 20,
                   "Prefill calls accepted and not finished (beyond: RESOURCE_EXHAUSTED)"),
        TD_OPT_INT("max-queued-tokens", &cfg->max_queued_tokens, 1, (int64_t)1 << 40,
                   "prompt tokens waiting or in progress (beyond: RESOURCE_EXHAUSTED)"),
        TD_OPT_INT("event-queue", &cfg->event_queue, 2, 1 << 20,
                   "compute-to-loop events waiting at most (the compute thread waits beyond)"),
        TD_OPT_INT("idle-wait-ms", &cfg->idle_wait_ms, 1, 10000,
                   "compute thread: longest single wait for work or room"),
        TD_OPT_INT("send-timeout-ms", &cfg->send_timeout_ms, 1, 3600000,
                   "KV transfer: first layer until the decode node's verdict"),
        TD_OPT_INT("xfer-checksum", &cfg->xfer_checksum, 0, 1,
                   "KV transfer: 1 = every block carries a checksum the decode node verifies before it adopts "
                   "the KV (costs half the TCP and 80% of the shared-memory transfer rate, docs/xfer.md), "
                   "0 = none (default)"),
    };
    const td_node_spec_t spec = {.prog = "prefill", .kind = TD_NODE_NODE, .on_shutdown = on_shutdown,
                                 .busy = prefill_busy, .data = s};
    int rc;
    if (!td_node_configure(&s->proc, &spec, keys, (int)TD_ARRAY_LEN(keys), argc, argv, &rc))
        return rc;
    rc = 1;

    td_status_t st;
    const td_node_worker_config_t wc = {.name = "prefill", .msg_size = sizeof(prefill_msg_t),
                                       .msg_cap = msg_ring_size(cfg), .event_size = sizeof(prefill_event_t),
                                       .event_cap = (int32_t)cfg->event_queue, .wait_ms = cfg->idle_wait_ms,
                                       .run = compute_main, .on_events = on_events, .data = s};
    if ((st = td_node_worker_init(&s->worker, &s->proc.loop, &wc)) != TD_OK)
        goto out;
    if ((st = td_node_load_model(&s->proc, &s->model, &s->be)) != TD_OK)
        goto out;
    td_engine_config_t ec = td_node_engine_config(&s->proc);
    ec.max_seqs = (int32_t)cfg->max_batch;
    ec.max_logit_rows = (int32_t)cfg->max_batch;
    ec.max_batch_tokens = (int32_t)cfg->max_batch_tokens;
    if ((st = size_pool(s, &ec)) != TD_OK) /* before anything is allocated or registered */
        goto out;
    ec.n_blocks = (int32_t)cfg->kv_blocks;
    if ((st = td_engine_create(s->model, s->be, &ec, &s->eng)) != TD_OK) {
        char b[32];
        td_log(TD_LOG_ERROR, "prefill %s: cannot allocate its KV pool of %lld blocks (%s): lower --kv-mem or "
               "--kv-blocks", pc->node_id, (long long)cfg->kv_blocks, td_format_bytes(s->pool_bytes, b, sizeof b));
        goto out;
    }
    s->layout = *td_engine_kv_layout(s->eng);
    s->pool = td_engine_kv_pool(s->eng, &s->pool_blocks);
    prefill_sched_config_t sc = {.max_queue = (int32_t)cfg->max_queue, .max_queued_tokens = cfg->max_queued_tokens,
                                 .max_batch_tokens = (int32_t)cfg->max_batch_tokens,
                                 .max_batch = (int32_t)cfg->max_batch};
    if ((st = td_node_gram_open(s->model, &s->gram)) != TD_OK)
        goto out;
    sc.gram_cache = s->gram.cache;
    if ((st = prefill_sched_create(s->eng, &sc, &s->sched)) != TD_OK)
        goto out;
    prefill_sched_set_layer_hook(s->sched, on_layer, s);
    if ((st = metrics_init(s)) != TD_OK)
        goto out;
    td_xfer_config_t xc = td_xfer_config_default();
    xc.name = pc->node_id;
    xc.listen_ip = NULL;
    xc.send_timeout_ms = (uint32_t)cfg->send_timeout_ms;
    if (!s->be->host_memory) {
        s->d2h = td_node_copier(s->be);
        xc.d2h = &s->d2h;
    }
    if ((st = td_xfer_create(&s->proc.loop, &xc, &s->xfer)) != TD_OK ||
        (st = td_node_xfer_metrics_init(&s->xfer_metrics, s->metrics, s->xfer)) != TD_OK)
        goto out;
    td_grpc_server_config_t gc = td_grpc_server_config_default();
    gc.host = pc->host;
    gc.port = (uint16_t)pc->port;
    gc.metrics = s->metrics;
    td_node_auth_guard_control(&s->proc.auth, &gc);
    if ((st = td_grpc_server_create(&s->proc.loop, &gc, &s->grpc)) != TD_OK ||
        (st = td_grpc_server_add_method(s->grpc, "/tandem.control.v1.PrefillNode/Prefill",
                                        &tandem__control__v1__prefill_request__descriptor, on_prefill, s)) != TD_OK ||
        (st = td_node_serve_control(&s->proc, s->grpc)) != TD_OK)
        goto out;
    if ((st = td_node_serve(&s->proc, s->metrics)) != TD_OK)
        goto out;
    if ((st = td_node_worker_start(&s->worker)) != TD_OK)
        goto out;
    td_node_client_config_t nc = {.max_seq_len = (uint32_t)s->model->config.max_seq_len,
                                      .max_prefill_tokens = (uint32_t)cfg->max_batch_tokens};
    nc.info.role = TD_NODE_ROLE_PREFILL;
    nc.info.layout = s->layout;
    nc.info.capacity_blocks = (int32_t)cfg->kv_blocks;
    nc.info.vocab_size = s->model->config.vocab_size; /* the router checks prompt ids against it */
    nc.info.n_eos = TD_MIN(s->model->config.n_eos, TD_NODE_MAX_EOS); /* the router withholds them */
    for (int32_t i = 0; i < nc.info.n_eos; i++)
        nc.info.eos_ids[i] = s->model->config.eos_ids[i];
    nc.info.max_batch = (int32_t)cfg->max_batch;
    if ((st = td_node_register(&s->proc, &nc, td_grpc_server_port(s->grpc), load_cb, s)) != TD_OK)
        goto out;

    rc = td_node_run(&s->proc);
out:
    td_node_stop(&s->proc);
    /* What the loop did not get to: pushes are freed once (their EV_PUSH_END), jobs from
     * the live list; the scheduler releases what it holds. */
    prefill_event_t ev;
    while (td_node_worker_pop_out(&s->worker, &ev))
        if (ev.kind == EV_PUSH_END)
            push_free(ev.push);
    TD_LIST_FOREACH_SAFE(n, &s->jobs) {
        prefill_job_t *j = TD_CONTAINER_OF(n, prefill_job_t, link);
        td_list_remove(&j->link);
        job_free(j);
    }
    prefill_sched_destroy(s->sched);
    td_node_gram_close(&s->gram);
    td_engine_destroy(s->eng);
    td_backend_destroy(s->be);
    td_model_destroy(s->model);
    td_metrics_destroy(s->metrics);
    td_node_worker_free(&s->worker);
    td_node_free(&s->proc);
    return rc;
}
