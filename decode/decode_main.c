/*
 * decode_main: the decode node process (see decode_node.h and docs/cluster.md).
 *
 * One KV pool: td_xfer has UCX allocate it (a shared-memory segment when sm transports
 * are on, so a prefill node on this host puts with a memcpy into its mapping), the engine
 * is built on that memory (td_engine_config_t.kv_pool), and td_xfer's leases reserve
 * blocks of the engine's own block manager, which td_kv serializes with a mutex. The KV
 * lands where the engine reads it: no copy.
 *
 * Threads: the loop thread owns gRPC, /metrics, the router client and td_xfer (leases:
 * alloc and release of engine blocks). The compute thread (td_node_worker) owns the engine
 * and decode_sched. On kv-ready the loop hands the lease's blocks (one reference each) to
 * the compute thread (bounded command ring), which adopts them into the request's sequence
 * and hands every step's events back (bounded result ring + uv_async_send); the loop
 * streams one StepBatch per step.
 *
 * The unified role (`tandem unified`, unified_main) is this process with prefill at home: no
 * td_xfer and no transfer; the engine allocates its own pool. Admit only records the request
 * (a lease id of its own, no block ids); the router's Prefill call for that lease hands it to
 * the compute thread as a local-prefill admission (decode_sched prefills it in chunks inside
 * the decode steps, within max-batch-tokens: chunked prefill with continuous batching), and
 * is answered FIRST_TOKEN when the sequence's first token is streamed on Steps. So the router
 * drives a unified node with the same request path as a (prefill, decode) pair.
 *
 * A decode node serves a request the same way when the router asks it to prefill the prompt
 * itself (AdmitRequest.local_prefill: conditional disaggregation, docs/scheduling.md): that
 * admission is local (decode_admit_t.local) and goes the unified way, one code path, beside
 * its leases of transferred KV. Its lease ids have DECODE_LOCAL_LEASE_BIT set, so they never
 * meet td_xfer's, which count up from 1.
 */
#include "decode_node.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "control.pb-c.h"
#include "decode_admit.h"
#include "decode_sched.h"
#include "decode_state.h"
#include "td_node_addr.h"
#include "td_node_client.h"
#include "td_node_conf.h"
#include "td_node.h"
#include "td_node_worker.h"
#include "td_node_xfer_metrics.h"
#include "td_backend.h"
#include "td_engine.h"
#include "td_grpc.h"
#include "td_list.h"
#include "td_log.h"
#include "td_metrics.h"
#include "td_model.h"
#include "td_util.h"
#include "td_xfer.h"


/* ---- loop thread ----------------------------------------------------------------------- */

/* Sizes the KV pool (td_engine_kv_plan: kv-blocks, else kv-seqs sequences of the model's
 * length, at most what kv-mem holds) into cfg->kv_blocks before anything is allocated, and
 * says so on stderr whatever the log level: it is the node's biggest allocation, and it is
 * made resident before the node registers (issue 12), so its size is the node's start-up
 * time. Sized from what the node serves, as llama-server sizes from -c and --parallel: a
 * few full-length sequences, not max-batch of them (64 x 8192 tokens of SmolLM2-135M's f32
 * KV are 22.5 GiB, seconds of page zeroing); shorter sequences share the pool's blocks, so max-batch
 * of them still run at once. */
static td_status_t size_pool(decode_state_t *s, const td_engine_config_t *ec)
{
    const td_model_config_t *mc = &s->model->config;
    int64_t seqs = TD_MIN(s->cfg.kv_seqs, s->cfg.max_batch);
    char what[128];
    snprintf(what, sizeof what, "%lld sequence%s (--kv-seqs) of %d tokens (--ctx-size)", (long long)seqs, seqs == 1 ? "" : "s",
             mc->max_seq_len);
    td_kv_plan_params_t pp = {.n_blocks = s->cfg.kv_blocks, .kv_mem = (size_t)s->cfg.kv_mem << 20,
                              .percent = TD_KV_DECODE_PERCENT, .cap = TD_KV_DECODE_CAP,
                              .device = s->proc.device.cuda, .device_default = TD_KV_DECODE_DEVICE_DEFAULT,
                              .useful_tokens = seqs * mc->max_seq_len, .useful_what = what};
    return td_node_plan_kv(&s->proc, s->model, ec, &pp, &s->cfg.kv_blocks, &s->pool_bytes);
}

/* --draft-model: the draft model, refused unless it speaks the model's tokens; before the KV
 * pool is sized and allocated, so a refusal costs nothing. */
static td_status_t load_draft(decode_state_t *s)
{
    td_status_t st = td_model_load(s->cfg.draft_model, &s->draft_model);
    if (st != TD_OK)
        return st;
    return td_spec_draft_check(s->model, NULL, s->draft_model, s->cfg.draft_model);
}

/* --draft-model: on the model's backend and threads, an engine for the draft model (loaded
 * by load_draft) with a KV pool of its own, and the drafter. Each running
 * sequence keeps its context in the draft pool too, so the pool holds as many tokens as the
 * model's plus every sequence's drafts (at most max-batch sequences of the draft model's
 * length); prefix blocks shared in the model's pool are not shared there, so with shared
 * prefixes a sequence may find it full and skip drafting (decode_sched.h). Says what it
 * loaded on stderr whatever the log level, like the model's pool (size_pool). */
static td_status_t open_draft(decode_state_t *s, const td_engine_config_t *ec)
{
    const char *path = s->cfg.draft_model;
    td_status_t st;
    const td_model_config_t *dm = &s->draft_model->config;
    td_engine_config_t dc = *ec;
    dc.kv_pool = NULL;       /* nothing is transferred into it: the engine allocates it */
    dc.prefix_cache = false; /* td_spec_draft_run feeds its sequences, never matches prefixes */
    dc.max_seqs = 1;         /* one sequence a run */
    dc.max_logit_rows = 1;
    int64_t bs = dc.block_size, mb = s->cfg.max_batch;
    int64_t n = s->cfg.kv_blocks + mb * (1 + TD_DIV_CEIL(s->cfg.draft_tokens, bs));
    n = TD_MIN(TD_MIN(n, mb * TD_DIV_CEIL((int64_t)dm->max_seq_len, bs)), (int64_t)1 << 24);
    dc.n_blocks = (int32_t)n;
    size_t bytes = (size_t)n * td_engine_kv_block_bytes(s->draft_model, &dc), avail;
    char b1[32], b2[32];
    if (s->be->host_memory && td_mem_available(&avail) == TD_OK && bytes > avail)
        return td_errorf(TD_ERR_NOMEM, "--draft-model %s: its KV pool of %lld blocks (%s: the model's pool's tokens "
                         "and every sequence's drafts) is more than the %s of memory available: lower --kv-mem or "
                         "--kv-blocks", path, (long long)n, td_format_bytes(bytes, b1, sizeof b1),
                         td_format_bytes(avail, b2, sizeof b2));
    if ((st = td_engine_create(s->draft_model, s->be, &dc, &s->draft_eng)) != TD_OK ||
        (st = td_spec_draft_create(s->draft_eng, s->model->config.vocab_size, &s->draft)) != TD_OK)
        return st;
    fprintf(stderr, "%s %s: draft model %s (%d layers, %d tokens of vocabulary), %lld draft tokens at most; its kv "
            "pool %lld blocks x %lld tokens = %lld tokens, %s\n", s->proc.spec.prog, s->proc.cfg.node_id, path,
            dm->n_layers, dm->vocab_size, (long long)s->cfg.draft_tokens, (long long)n, (long long)bs,
            (long long)(n * bs), td_format_bytes(bytes, b1, sizeof b1));
    return TD_OK;
}

/* st of the call that allocates the pool; a failure is said with the size and the flag
 * to lower (the callee logged its cause), before the node registers. */
static td_status_t pool_result(decode_state_t *s, td_status_t st)
{
    char b[32];
    if (st != TD_OK)
        td_log(TD_LOG_ERROR, "decode %s: cannot allocate its KV pool of %lld blocks (%s): lower --kv-mem or --kv-blocks",
                 s->proc.cfg.node_id, (long long)s->cfg.kv_blocks, td_format_bytes(s->pool_bytes, b, sizeof b));
    return st;
}

/* A command nobody took: its admission and its blocks' references go. */
static void cmd_discard(decode_state_t *s, decode_cmd_t *c)
{
    decode_admit_free(c->admit);
    td_kv_unref_blocks_for(s->kv, TD_KV_HOLDER_LANDED, c->blocks, c->n_blocks);
    free(c->blocks);
}

static void send_batch(decode_state_t *s, Tandem__Control__V1__StepBatch *b)
{
    for (int i = 0; i < s->n_subs; i++) {
        td_status_t st = td_grpc_call_send(s->subs[i], &b->base);
        if (st != TD_OK && st != TD_ERR_CANCELLED)
            td_warn("decode: step %llu not sent to a subscriber: %s", (unsigned long long)b->step, td_strerror(st));
    }
}

/* Room for n entries in the StepBatch scratch, grown once to a step's size and kept;
 * returns the room there is (the startup size at least, when memory is short). */
static int32_t batch_reserve(decode_state_t *s, int32_t n)
{
    if (n <= s->batch_cap)
        return s->batch_cap;
    int32_t cap = TD_MAX(n, 2 * s->batch_cap);
    Tandem__Control__V1__SeqStep *q = realloc(s->batch_seqs, (size_t)cap * sizeof *q);
    if (!q)
        return s->batch_cap;
    s->batch_seqs = q;
    Tandem__Control__V1__SeqStep **p = realloc(s->batch_ptrs, (size_t)cap * sizeof *p);
    if (!p)
        return s->batch_cap;
    s->batch_ptrs = p;
    td_node_logprob_msg_t *l = realloc(s->batch_lps, (size_t)cap * sizeof *l);
    if (!l)
        return s->batch_cap;
    s->batch_lps = l;
    s->batch_cap = cap;
    return cap;
}

/* The edge: a step's C entries become SeqSteps and go out as a StepBatch (as several, each
 * with the step's numbers, only if memory for the scratch ran short). */
static void send_seqs(decode_state_t *s, uint64_t step, double step_s, uint32_t free_blocks,
                      const decode_out_seq_t *seqs, int32_t n)
{
    static const Tandem__Control__V1__SeqEvent event[] = {
        [DECODE_OUT_TOKEN] = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN,
        [DECODE_OUT_LENGTH] = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_LENGTH,
        [DECODE_OUT_STOP] = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_STOP,
        [DECODE_OUT_FAILED] = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FAILED,
    };
    int32_t cap = batch_reserve(s, n);
    for (int32_t off = 0; off < n; off += cap) {
        int32_t m = TD_MIN(cap, n - off);
        for (int32_t i = 0; i < m; i++) {
            const decode_out_seq_t *e = &seqs[off + i];
            Tandem__Control__V1__SeqStep *q = &s->batch_seqs[i];
            tandem__control__v1__seq_step__init(q);
            q->lease_id = e->lease_id;
            q->token = e->token >= 0 ? (uint32_t)e->token : 0;
            q->event = event[e->kind];
            if (e->has_logprob) {
                td_node_logprob_to_proto(&e->logprob, &s->batch_lps[i]);
                q->logprob = &s->batch_lps[i].m;
            }
            s->batch_ptrs[i] = q;
            if (e->kind == DECODE_OUT_TOKEN)
                td_metric_inc(s->m_tokens);
        }
        Tandem__Control__V1__StepBatch b = TANDEM__CONTROL__V1__STEP_BATCH__INIT;
        b.step = step;
        b.step_s = step_s;
        b.seqs = s->batch_ptrs;
        b.n_seqs = (size_t)m;
        b.free_kv_blocks = free_blocks;
        send_batch(s, &b);
    }
}

static decode_prefill_t *prefill_find(decode_state_t *s, uint64_t lease_id)
{
    TD_LIST_FOREACH(n, &s->prefills) {
        decode_prefill_t *w = TD_CONTAINER_OF(n, decode_prefill_t, link);
        if (w->lease_id == lease_id)
            return w;
    }
    return NULL;
}

static void prefill_end(decode_state_t *s, decode_prefill_t *w, td_grpc_code_t code, const char *why)
{
    td_list_remove(&w->link);
    s->n_prefills--;
    td_grpc_call_finish(w->call, code, why);
    free(w);
}

/* A local prefill's Prefill call is answered by its lease's first entry on Steps (sent just
 * before): a token is the first token (FIRST_TOKEN, then OK: the router moves the request
 * to RUNNING); a finish before any token (EOS first, or length) is OK too, the Steps entry
 * having ended the request; a failure is UNAVAILABLE. */
static void prefill_answer(decode_state_t *s, const decode_out_seq_t *e)
{
    decode_prefill_t *w = prefill_find(s, e->lease_id);
    if (!w)
        return;
    if (e->kind == DECODE_OUT_FAILED) {
        prefill_end(s, w, TD_GRPC_UNAVAILABLE, s->unified ? "unified node: the sequence failed before its first token"
                                                          : "decode node: the locally prefilled sequence failed before its "
                                                            "first token");
        return;
    }
    if (e->kind == DECODE_OUT_TOKEN) {
        Tandem__Control__V1__PrefillResponse r = TANDEM__CONTROL__V1__PREFILL_RESPONSE__INIT;
        td_node_logprob_msg_t lp;
        r.phase = TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_FIRST_TOKEN;
        r.first_token = (uint32_t)e->token;
        r.prefill_s = (double)(td_now_ns() - w->t0) * 1e-9;
        if (e->has_logprob) {
            td_node_logprob_to_proto(&e->logprob, &lp);
            r.first_logprob = &lp.m;
        }
        td_grpc_call_send(w->call, &r.base); /* CANCELLED: the router is gone, finish anyway */
    }
    prefill_end(s, w, TD_GRPC_OK, NULL);
}

static void kv_out_event(decode_state_t *s, decode_out_seq_t *e);

static void on_outs(void *data, void *events, int32_t n)
{
    decode_state_t *s = data;
    decode_out_t **outs = events;
    for (int32_t k = 0; k < n; k++) {
        decode_out_t *o = outs[k];
        /* prompts prefilled for other nodes' leases are this node's business, not the router's
           Steps: handled here, and the rest of the entries close up */
        int32_t kept = 0;
        for (int32_t i = 0; i < o->n_seqs; i++) {
            decode_out_seq_t *e = &o->seqs[i];
            if (e->lease_id & DECODE_KV_OUT_ID_BIT) {
                kv_out_event(s, e);
                free(e->kv_blocks);
                e->kv_blocks = NULL;
            } else {
                o->seqs[kept++] = *e;
            }
        }
        o->n_seqs = kept;
        send_seqs(s, o->step, o->step_s, o->free_blocks, o->seqs, o->n_seqs);
        for (int32_t i = 0; s->n_prefills && i < o->n_seqs; i++)
            prefill_answer(s, &o->seqs[i]);
        decode_out_free(o);
        atomic_fetch_sub(&s->outs_unsent, 1);
    }
}

/* A request the compute thread never got (its kv-ready could not be handed over): the
 * router hears FAILED now instead of at its deadline. */
static void report_failed(decode_state_t *s, uint64_t lease_id)
{
    const decode_out_seq_t e = {.lease_id = lease_id, .token = -1, .kind = DECODE_OUT_FAILED};
    send_seqs(s, 0, 0, (uint32_t)atomic_load(&s->load_free), &e, 1);
}

/* The pool's occupancy as the loop sees it. Leases take and return blocks on this thread
 * (Admit, Release, expiry in td_xfer's tick), between the compute thread's steps, which
 * refresh the same gauges; without this the gauges and the heartbeat's free count stayed
 * stale until the next step. */
static void refresh_kv_load(decode_state_t *s)
{
    td_kv_stats_t ks;
    td_kv_get_stats(s->kv, &ks);
    td_metric_set(s->m_used, ks.used);
    td_metric_set(s->m_free, ks.free + ks.cached);
    atomic_store(&s->load_free, ks.free + ks.cached);
}

static void admit_unlink(decode_state_t *s, decode_admit_t *a)
{
    td_list_remove(&a->link);
    s->n_admits--;
}

static decode_admit_t *admit_find(decode_state_t *s, uint64_t lease_id)
{
    TD_LIST_FOREACH(n, &s->admits) {
        decode_admit_t *a = TD_CONTAINER_OF(n, decode_admit_t, link);
        if (a->lease_id == lease_id)
            return a;
    }
    return NULL;
}

static decode_admit_t *admit_take(decode_state_t *s, uint64_t lease_id)
{
    decode_admit_t *a = admit_find(s, lease_id);
    if (a)
        admit_unlink(s, a);
    return a;
}

/* td_xfer's copy of landed blocks into the device pool, on the loop thread while the
   compute thread runs steps: the blocks are leased, so no step uses them, and the copy is
   done when it returns, so every later step sees it (td_backend.h "Threads"). One run of
   blocks per call, a bounded number of bytes per loop iteration (td_xfer adopts a lease
   over many iterations, docs/xfer.md) */
static td_status_t copy_landed(void *arg, void *dst, const void *src, size_t bytes)
{
    td_backend_t *be = arg;
    return be->ops->copy_h2d(be, dst, src, bytes);
}

static void on_kv_ready(void *arg, const td_xfer_ready_t *r)
{
    decode_state_t *s = arg;
    decode_admit_t *a = admit_take(s, r->lease_id);
    int32_t *blocks = malloc((size_t)r->n_blocks * sizeof *blocks);
    bool posted = false;
    char why[160];
    bool fits = a && decode_admit_ready_check(a, r, &s->model->config, why, sizeof why);
    if (fits && blocks) {
        memcpy(blocks, r->blocks, (size_t)r->n_blocks * sizeof *blocks);
        decode_cmd_t c = {.admit = a, .lease_id = r->lease_id, .blocks = blocks, .n_blocks = r->n_blocks,
                          .first_token = r->first_token};
        atomic_fetch_add(&s->admits_posted, 1); /* before the compute thread can take it */
        posted = td_node_worker_post(&s->worker, &c);
        if (!posted) {
            atomic_fetch_sub(&s->admits_posted, 1);
            td_warn("decode: lease %llu: kv-ready dropped, the command ring (%d) is full",
                    (unsigned long long)r->lease_id, decode_cmd_ring_size(&s->cfg));
        }
    } else if (a && !fits) {
        td_warn("decode: lease %llu: %s", (unsigned long long)r->lease_id, why);
    }
    if (!posted) {
        td_kv_unref_blocks_for(s->kv, TD_KV_HOLDER_LANDED, r->blocks, r->n_blocks);
        if (a) {
            if (!blocks)
                td_warn("decode: lease %llu: kv-ready dropped, out of memory", (unsigned long long)r->lease_id);
            report_failed(s, r->lease_id);
        }
        decode_admit_free(a);
        free(blocks);
        refresh_kv_load(s);
    }
}

/* AdmitRequest: checked and read (decode_admit.c) around the node's gate, then a lease of the
 * prompt's blocks (a local prefill, every one of a unified node's: a lease id only) and the
 * reply naming them. */
static void on_admit(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    decode_state_t *s = data;
    const Tandem__Control__V1__AdmitRequest *r = (const void *)msg;
    char why[256];
    decode_admit_t *a = NULL;
    if (!decode_admit_check(r, &s->model->config, why, sizeof why)) {
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    if (r->grammar && r->grammar[0] && !s->gram.cache) {
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT,
                            "admit: a grammar (structured output) needs the model's tokenizer on this node, and "
                            "none is beside its model file");
        return;
    }
    if (s->forget_pending) { /* what the router forgot still runs: new work would be dropped with it */
        td_metric_inc(s->m_refused);
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "decode node: still dropping what a router that forgot it "
                                                       "gave it (its command ring is full); retry");
        return;
    }
    if (!td_node_take_or_refuse(&s->proc, call, s->m_refused, "decode node", s->n_admits, s->cfg.max_requests,
                                "too many pending admissions"))
        return;
    td_grpc_code_t code = decode_admit_read(r, &s->model->config, s->unified, &a, why, sizeof why);
    if (code != TD_GRPC_OK) {
        td_grpc_call_finish(call, code, why);
        return;
    }
    int32_t n_blocks = (int32_t)TD_DIV_CEIL(a->n_prompt, (int32_t)s->layout.block_size);
    int32_t *blocks = malloc((size_t)n_blocks * sizeof *blocks);
    uint32_t ttl = (uint32_t)TD_MIN((int64_t)(r->lease_ms ? r->lease_ms : 10000), s->cfg.max_lease_ms);
    td_status_t st;
    td_xfer_token_t token = {{0}};
    if (a->local) { /* no transfer: the lease only names the request until its Prefill call */
        a->lease_id = ++s->next_lease | (s->unified ? 0 : DECODE_LOCAL_LEASE_BIT);
        n_blocks = 0;
        st = blocks ? TD_OK : TD_ERR_NOMEM;
    } else {
        st = blocks ? td_xfer_lease_create(s->xfer, td_xfer_request_key(r->request_id), n_blocks, ttl, blocks,
                                           &a->lease_id, &token)
                    : TD_ERR_NOMEM;
    }
    if (st != TD_OK) {
        td_metric_inc(s->m_refused);
        free(blocks);
        decode_admit_free(a);
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, "decode node: no free KV blocks");
        return;
    }
    a->deadline_ns = td_now_ns() + (uint64_t)ttl * 1000000ull + 1000000000ull;
    td_list_push_front(&s->admits, &a->link);
    s->n_admits++;
    td_metric_inc(s->m_admits);
    Tandem__Control__V1__AdmitResponse resp = TANDEM__CONTROL__V1__ADMIT_RESPONSE__INIT;
    resp.lease_id = a->lease_id;
    resp.block_ids = (uint32_t *)blocks; /* int32 ids >= 0 */
    resp.n_block_ids = (size_t)n_blocks;
    resp.deadline_unix_ms = 0;
    if (!a->local) { /* the router hands it to the prefill node with the Prefill call */
        resp.xfer_token.data = token.b;
        resp.xfer_token.len = sizeof token.b;
    }
    td_grpc_call_reply(call, &resp.base);
    free(blocks);
    refresh_kv_load(s);
}

static void on_release(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    decode_state_t *s = data;
    const Tandem__Control__V1__ReleaseRequest *r = (const void *)msg;
    Tandem__Control__V1__ReleaseResponse resp = TANDEM__CONTROL__V1__RELEASE_RESPONSE__INIT;
    td_metric_inc(s->m_releases);
    decode_admit_t *a = admit_take(s, r->lease_id);
    if (a) { /* KV not here yet: the lease goes, and with it its blocks */
        if (!a->local)
            td_xfer_lease_cancel(s->xfer, r->lease_id);
        decode_admit_free(a);
        resp.released = true;
        refresh_kv_load(s);
    } else {
        resp.released = td_node_worker_post(&s->worker, &(decode_cmd_t){.lease_id = r->lease_id});
        if (!resp.released)
            td_warn("decode: lease %llu: release dropped, the command ring (%d) is full",
                    (unsigned long long)r->lease_id, decode_cmd_ring_size(&s->cfg));
    }
    td_grpc_call_reply(call, &resp.base);
}

/* The router gave up a local prefill's Prefill call (its request ended or moved on): the call
 * ends here; the sequence itself goes with the router's Release. */
static void on_prefill_cancel(td_grpc_call_t *call, td_status_t why, void *call_data)
{
    (void)why;
    decode_state_t *s = call_data;
    TD_LIST_FOREACH(n, &s->prefills) {
        decode_prefill_t *w = TD_CONTAINER_OF(n, decode_prefill_t, link);
        if (w->call == call) {
            prefill_end(s, w, TD_GRPC_CANCELLED, NULL);
            return;
        }
    }
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, NULL);
}

/* ---- prefill for another decode node's lease (kv_out) --------------------------------------

   The router may hand a decode node the Prefill call of another decode node's lease
   (conditional disaggregation's `peer` placement, docs/scheduling.md "Roles that follow the
   load"). The node serves it as a prefill node does: the prompt goes to its scheduler as a
   kv_out admission (chunked beside its own streams, within their TPOT objectives); when its KV
   is complete (DECODE_OUT_KV_OUT) the call hears FIRST_TOKEN, the blocks go over td_xfer into
   the lease from this node's pool, and the transfer's verdict ends the call (KV_DELIVERED + OK,
   or UNAVAILABLE). Then, and only then, a release command lets the blocks go: no block is
   reused while a transfer may still read it. A call cancelled before the KV is complete posts
   a cancel (the CANCELLED event ends the job); one cancelled during the transfer aborts it
   (its done callback releases). */

static decode_kv_out_t *kv_out_find(decode_state_t *s, uint64_t id)
{
    TD_LIST_FOREACH(n, &s->kv_outs) {
        decode_kv_out_t *k = TD_CONTAINER_OF(n, decode_kv_out_t, link);
        if (k->id == id)
            return k;
    }
    return NULL;
}

/* Ends the call (if still there: a call answered or cancelled before is not counted again)
 * with code; counts a failure. */
static void kv_out_answer(decode_state_t *s, decode_kv_out_t *k, td_grpc_code_t code, const char *why)
{
    if (!k->call)
        return;
    if (code != TD_GRPC_OK)
        td_metric_inc(s->m_kv_out_failed);
    td_grpc_call_set_data(k->call, NULL);
    td_grpc_call_finish(k->call, code, why);
    k->call = NULL;
}

/* The job leaves the node; its blocks are released (or were never held) already. */
static void kv_out_drop(decode_state_t *s, decode_kv_out_t *k)
{
    kv_out_answer(s, k, TD_GRPC_INTERNAL, "decode node: prefill for another node dropped"); /* never left open */
    td_list_remove(&k->link);
    s->n_kv_outs--;
    free(k->dst_blocks);
    free(k);
}

/* The KV is read no more: the compute thread lets the blocks go, and the job ends. */
static void kv_out_release(decode_state_t *s, decode_kv_out_t *k)
{
    if (!s->shutting_down && !td_node_worker_post(&s->worker, &(decode_cmd_t){.lease_id = k->id, .release = true}))
        td_warn("decode: kv_out %016llx: release dropped, the command ring (%d) is full; its blocks stay until the "
                "node stops", (unsigned long long)k->key, decode_cmd_ring_size(&s->cfg));
    kv_out_drop(s, k);
}

/* The transfer's verdict (td_xfer, loop thread): the call ends as a prefill node's would, and
 * the blocks go. */
static void kv_out_on_done(void *arg, uint64_t request_id, td_status_t st)
{
    (void)request_id;
    decode_kv_out_t *k = arg;
    decode_state_t *s = k->s;
    k->send = NULL;
    double transfer_s = (double)(td_now_ns() - k->t_first) * 1e-9;
    if (st == TD_OK) {
        td_metric_inc(s->m_kv_out);
        td_debug("decode: kv_out %016llx: %d tokens for lease %llu, first token %.6f s after the call, kv "
                 "delivered %.6f s later", (unsigned long long)k->key, k->n_tokens, (unsigned long long)k->lease_id,
                 (double)(k->t_first - k->t0) * 1e-9, transfer_s);
        if (k->call) {
            Tandem__Control__V1__PrefillResponse r = TANDEM__CONTROL__V1__PREFILL_RESPONSE__INIT;
            r.phase = TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_KV_DELIVERED;
            r.transfer_s = transfer_s;
            td_grpc_call_send(k->call, &r.base); /* CANCELLED: the cancel callback ran */
            kv_out_answer(s, k, TD_GRPC_OK, NULL);
        }
    } else {
        char why[200];
        snprintf(why, sizeof why, "decode node: kv transfer to the lease's decode node failed: %s", td_strerror(st));
        if (k->call)
            td_info("decode: kv_out %016llx: %s", (unsigned long long)k->key, why);
        kv_out_answer(s, k, TD_GRPC_UNAVAILABLE, why);
    }
    kv_out_release(s, k);
}

/* The prompt's KV is complete in blocks e->kv_blocks of this node's pool: every layer goes into
 * the lease, then kv-ready with the first token; the call hears FIRST_TOKEN once the send is
 * under way (a cancel then aborts the send, whose done callback releases the blocks: never a
 * cancel that frees them under it). */
static void kv_out_send(decode_state_t *s, decode_kv_out_t *k, const decode_out_seq_t *e)
{
    k->t_first = td_now_ns();
    td_xfer_send_params_t p = {.request_id = k->key, .lease_id = k->lease_id, .token = k->token,
                               .dst_blocks = k->dst_blocks, .n_dst_blocks = k->n_dst,
                               .n_tokens = (uint32_t)k->n_tokens, .mem = TD_XFER_MEM_HOST,
                               .done = kv_out_on_done, .arg = k};
    td_status_t st = TD_ERR_INVALID;
    if (e->n_kv_blocks >= (int32_t)TD_DIV_CEIL(k->n_tokens, (int32_t)s->layout.block_size))
        st = td_xfer_send_begin(s->xfer, k->peer, &p, &k->send);
    if (st != TD_OK) {
        k->send = NULL;
        char why[200];
        snprintf(why, sizeof why, "decode node: kv transfer to the lease's decode node could not start: %s",
                 td_strerror(st));
        kv_out_answer(s, k, TD_GRPC_UNAVAILABLE, why);
        kv_out_release(s, k);
        return;
    }
    const uint8_t *pool = td_xfer_pool_base(s->xfer);
    td_xfer_send_t *snd = k->send; /* the done callback clears k->send (and frees k) only from the loop */
    for (uint32_t l = 0; l < s->layout.n_layers && st == TD_OK; l++) {
        const uint8_t *slab = pool + td_kv_block_offset(&s->layout, (uint32_t)s->cfg.kv_blocks, l, 0);
        if ((st = td_xfer_send_layer(snd, l, slab, e->kv_blocks)) != TD_OK)
            td_xfer_send_abort(snd, st); /* its done callback answers and releases */
    }
    if (st == TD_OK)
        td_xfer_send_finish(snd, e->token);
    Tandem__Control__V1__PrefillResponse r = TANDEM__CONTROL__V1__PREFILL_RESPONSE__INIT;
    td_node_logprob_msg_t lp;
    r.phase = TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_FIRST_TOKEN;
    r.first_token = (uint32_t)e->token;
    r.prefill_s = (double)(k->t_first - k->t0) * 1e-9;
    if (e->has_logprob) {
        td_node_logprob_to_proto(&e->logprob, &lp);
        r.first_logprob = &lp.m;
    }
    td_grpc_call_send(k->call, &r.base); /* CANCELLED: the cancel callback aborts the send */
}

/* A compute-thread entry of a kv_out prompt (on_outs). */
static void kv_out_event(decode_state_t *s, decode_out_seq_t *e)
{
    decode_kv_out_t *k = kv_out_find(s, e->lease_id);
    if (e->kind == DECODE_OUT_KV_OUT) {
        if (k && k->call && !k->cancel_posted) {
            kv_out_send(s, k, e);
        } else if (k && k->cancel_posted) {
            /* the cancel is on its way to the compute thread: it frees the blocks and says CANCELLED */
        } else { /* nobody wants the KV (cannot happen without a job: release it anyway) */
            if (k)
                kv_out_release(s, k);
            else
                td_node_worker_post(&s->worker, &(decode_cmd_t){.lease_id = e->lease_id, .release = true});
        }
        return;
    }
    if (!k)
        return;
    /* FAILED (the prompt did not fit, the engine failed, its deadline) or the cancel's end */
    kv_out_answer(s, k, TD_GRPC_UNAVAILABLE, "decode node: the prompt prefilled for another node failed");
    kv_out_drop(s, k);
}

/* The router gave up the call: before the KV is complete the compute thread drops the prompt
 * (its CANCELLED ends the job); during the transfer the send is aborted (its done callback
 * releases the blocks). */
static void kv_out_stop(decode_kv_out_t *k)
{
    k->call = NULL;
    if (k->send) {
        td_xfer_send_abort(k->send, TD_ERR_CANCELLED);
    } else if (!k->cancel_posted) {
        k->cancel_posted = td_node_worker_post(&k->s->worker, &(decode_cmd_t){.lease_id = k->id});
        if (!k->cancel_posted) /* the ring is full: the prompt runs on and its KV_OUT releases it */
            td_warn("decode: kv_out %016llx: cancel dropped, the command ring is full", (unsigned long long)k->key);
    }
}

static void kv_out_cancel(td_grpc_call_t *call, td_status_t why, void *call_data)
{
    (void)why;
    decode_kv_out_t *k = call_data;
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, NULL);
    if (k)
        kv_out_stop(k);
}

/* A Prefill call for another decode node's lease (on_prefill): checked, then handed to the
 * compute thread as a kv_out admission. */
static void kv_out_start(decode_state_t *s, td_grpc_call_t *call, const Tandem__Control__V1__PrefillRequest *q)
{
    char why[256];
    if (s->unified || !s->be->host_memory) {
        snprintf(why, sizeof why, "prefill: this %s prefills only for its own leases (%s); send the call to a "
                 "prefill node or to the lease's decode node", s->unified ? "unified node" : "decode node",
                 s->unified ? "it has no kv transfer" : "its KV pool is in device memory, which it does not send");
        td_grpc_call_finish(call, TD_GRPC_FAILED_PRECONDITION, why);
        return;
    }
    if (!td_node_take_or_refuse(&s->proc, call, s->m_refused, "decode node", s->n_kv_outs, s->cfg.max_requests,
                                "too many prompts prefilled for other nodes"))
        return;
    decode_admit_t *a = NULL;
    int32_t *dst = NULL, n_dst = 0;
    td_grpc_code_t code = decode_admit_read_kv_out(q, &s->model->config, s->layout.block_size, &a, &dst, &n_dst,
                                                   why, sizeof why);
    if (code == TD_GRPC_OK && a->grammar && !s->gram.cache) {
        code = TD_GRPC_INVALID_ARGUMENT;
        snprintf(why, sizeof why, "prefill: a grammar (structured output) needs the model's tokenizer on this node, "
                 "and none is beside its model file");
    }
    if (code != TD_GRPC_OK) {
        decode_admit_free(a);
        free(dst);
        td_grpc_call_finish(call, code, why);
        return;
    }
    td_xfer_peer_t *peer;
    decode_kv_out_t *k = calloc(1, sizeof *k);
    if (!k || td_xfer_connect(s->xfer, q->decode_xfer.data, q->decode_xfer.len, &s->layout, &peer) != TD_OK) {
        td_grpc_call_finish(call, k ? TD_GRPC_FAILED_PRECONDITION : TD_GRPC_RESOURCE_EXHAUSTED,
                            k ? td_last_error() : "decode node: out of memory");
        decode_admit_free(a);
        free(dst);
        free(k);
        return;
    }
    *k = (decode_kv_out_t){.s = s, .id = ++s->next_kv_out | DECODE_KV_OUT_ID_BIT,
                           .key = td_xfer_request_key(q->request_id), .lease_id = q->lease_id,
                           .dst_blocks = dst, .n_dst = n_dst, .n_tokens = a->n_prompt, .peer = peer,
                           .call = call, .t0 = td_now_ns()};
    memcpy(k->token.b, q->xfer_token.data, sizeof k->token.b);
    uint64_t dl_ms = td_grpc_call_deadline(call);
    if (dl_ms) { /* the prompt is not computed past the call's deadline */
        uint64_t now_ms = uv_now(&s->proc.loop);
        a->deadline_ns = k->t0 + (dl_ms > now_ms ? dl_ms - now_ms : 0) * 1000000ull;
    }
    int32_t n_prompt = a->n_prompt;
    atomic_fetch_add(&s->admits_posted, 1);
    atomic_fetch_add(&s->prompt_posted, n_prompt);
    if (!td_node_worker_post(&s->worker, &(decode_cmd_t){.admit = a, .lease_id = k->id, .prompt_posted = n_prompt})) {
        atomic_fetch_sub(&s->admits_posted, 1);
        atomic_fetch_sub(&s->prompt_posted, n_prompt);
        decode_admit_free(a);
        free(dst);
        free(k);
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "decode node: the command ring is full; retry");
        return;
    }
    td_list_push_front(&s->kv_outs, &k->link);
    s->n_kv_outs++;
    td_grpc_call_set_data(call, k);
    td_grpc_call_on_cancel(call, kv_out_cancel);
}

/* The router's Prefill for a lease this node admitted to prefill itself (every lease of a
 * unified node; a decode node's admitted with local_prefill), or for another decode node's
 * lease (decode_node_id names that node: kv_out_start). The request goes to the
 * compute thread as a local-prefill admission; the call waits for the first token
 * (prefill_answer). A lease waiting for a transfer is not this call's: it is refused and
 * stays. */
static void on_prefill(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    decode_state_t *s = data;
    const Tandem__Control__V1__PrefillRequest *q = (const void *)msg;
    const char *node = s->unified ? "unified node" : "decode node";
    char why[192];
    if (s->shutting_down) {
        snprintf(why, sizeof why, "%s shutting down", node);
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, why);
        return;
    }
    if (q->logprobs && q->logprobs->prompt) {
        snprintf(why, sizeof why, "prefill: prompt logprobs are not served by a %s (it prefills in chunks inside "
                 "decode steps)", node);
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    if (q->decode_node_id && q->decode_node_id[0] && strcmp(q->decode_node_id, s->proc.cfg.node_id) != 0) {
        kv_out_start(s, call, q); /* another decode node's lease: prefilled here, sent there */
        return;
    }
    decode_admit_t *a = admit_find(s, q->lease_id);
    if (!a) {
        snprintf(why, sizeof why, "prefill: lease %llu is not admitted here (expired or released): admit it first",
                 (unsigned long long)q->lease_id);
        td_grpc_call_finish(call, TD_GRPC_NOT_FOUND, why);
        return;
    }
    if (!a->local) {
        snprintf(why, sizeof why, "prefill: lease %llu waits for its KV from a prefill node (it was admitted "
                 "without local_prefill): send its Prefill call there", (unsigned long long)q->lease_id);
        td_grpc_call_finish(call, TD_GRPC_FAILED_PRECONDITION, why);
        return;
    }
    admit_unlink(s, a);
    decode_prefill_t *w = s->n_prefills < s->cfg.max_requests ? calloc(1, sizeof *w) : NULL;
    if (!w) {
        decode_admit_free(a);
        snprintf(why, sizeof why, "%s: too many prompts waiting for a first token", node);
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, why);
        return;
    }
    uint64_t lease_id = a->lease_id;
    int32_t n_prompt = a->n_prompt;
    atomic_fetch_add(&s->admits_posted, 1);
    atomic_fetch_add(&s->prompt_posted, n_prompt);
    if (!td_node_worker_post(&s->worker, &(decode_cmd_t){.admit = a, .lease_id = lease_id, .prompt_posted = n_prompt})) {
        atomic_fetch_sub(&s->admits_posted, 1);
        atomic_fetch_sub(&s->prompt_posted, n_prompt);
        decode_admit_free(a);
        free(w);
        snprintf(why, sizeof why, "%s: the command ring is full; retry", node);
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, why);
        return;
    }
    *w = (decode_prefill_t){.lease_id = lease_id, .call = call, .t0 = td_now_ns()};
    td_list_push_front(&s->prefills, &w->link);
    s->n_prefills++;
    td_grpc_call_set_data(call, s);
    td_grpc_call_on_cancel(call, on_prefill_cancel);
}

static void on_steps_cancel(td_grpc_call_t *call, td_status_t why, void *call_data)
{
    decode_state_t *s = call_data;
    for (int i = 0; i < s->n_subs; i++)
        if (s->subs[i] == call) {
            s->subs[i] = s->subs[--s->n_subs];
            break;
        }
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, NULL);
}

/* Resolves --router (startup, before the loop runs) into the addresses a Steps subscriber
 * must come from. A name that does not resolve is not fatal: the node registers when the
 * router appears, and no one may subscribe meanwhile. */
static void resolve_router(decode_state_t *s, const char *router)
{
    char host[256];
    uint16_t port;
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
    if (td_node_conf_split_addr(router, host, sizeof host, &port) != TD_OK ||
        getaddrinfo(host, NULL, &hints, &res) != 0) {
        td_warn("decode: router %s does not resolve: no Steps subscriber is accepted until it does", router);
        return;
    }
    for (struct addrinfo *a = res; a && s->n_router_addrs < DECODE_MAX_ROUTER_ADDRS; a = a->ai_next) {
        struct in6_addr ip;
        if (!td_node_ip_of(a->ai_addr, &ip))
            continue;
        memcpy(&s->router_addrs[s->n_router_addrs++], a->ai_addr, a->ai_addrlen);
        s->router_local = s->router_local || td_node_ip_is_local(&ip);
    }
    freeaddrinfo(res);
}

/* Whether the call comes from the router this node registered with: a peer at one of its
 * addresses (at startup, or the node client's latest lookup of its name), or (a router on
 * this host) any peer on this host. NULL: yes; else why not. */
static const char *steps_peer_refusal(const decode_state_t *s, td_grpc_call_t *call, char *why, size_t cap)
{
    struct sockaddr_storage peer;
    struct in6_addr ip, r;
    char txt[INET6_ADDRSTRLEN] = "?";
    if (td_grpc_call_peer(call, &peer) != TD_OK || !td_node_ip_of((const struct sockaddr *)&peer, &ip))
        return "decode node: the Steps subscriber's address is unknown";
    for (int i = 0; i < s->n_router_addrs; i++)
        if (td_node_ip_of((const struct sockaddr *)&s->router_addrs[i], &r) && !memcmp(&r, &ip, sizeof ip))
            return NULL;
    /* a --router name looked up again since startup (a router back at a new address: a
       Kubernetes pod behind a headless Service) */
    struct sockaddr_storage now;
    if (td_node_client_router_ip(s->proc.client, &now) && td_node_ip_of((const struct sockaddr *)&now, &r) &&
        !memcmp(&r, &ip, sizeof ip))
        return NULL;
    if (s->router_local && td_node_ip_is_local(&ip))
        return NULL;
    inet_ntop(AF_INET6, &ip, txt, sizeof txt);
    snprintf(why, cap, "decode node: Steps is served only to the router this node registers with (%s); "
                       "subscriber %s refused", s->proc.cfg.router, txt);
    return why;
}

/* Steps carries every running sequence's tokens, so it goes to one subscriber: the router
 * this node registered with. A second subscriber while one is active is refused
 * (FAILED_PRECONDITION), never allowed to take the stream over: a router that lost its stream
 * sees it end and subscribes again after the node re-registers. */
static void on_steps(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    decode_state_t *s = data;
    char why[384];
    const char *refusal;
    if (s->shutting_down) {
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "decode node shutting down");
        return;
    }
    if ((refusal = steps_peer_refusal(s, call, why, sizeof why))) {
        td_warn("%s", refusal);
        td_grpc_call_finish(call, TD_GRPC_PERMISSION_DENIED, refusal);
        return;
    }
    if (s->n_subs == DECODE_MAX_SUBSCRIBERS) {
        td_warn("decode: a second Steps subscriber refused (one is active)");
        td_grpc_call_finish(call, TD_GRPC_FAILED_PRECONDITION,
                            "decode node: a Steps subscriber is already active (one at a time: the router "
                            "this node registered with)");
        return;
    }
    td_grpc_call_set_data(call, s);
    td_grpc_call_on_cancel(call, on_steps_cancel);
    s->subs[s->n_subs++] = call;
}

/* The compute thread drops every sequence the router gave this node (decode_sched_cancel_all;
 * kv_out prompts are cancelled one by one). False: the ring is full, and the sweep tries
 * again (s->forget_pending, Admit refused meanwhile, so nothing new is dropped with them). */
static bool post_forget(decode_state_t *s)
{
    s->forget_pending = !td_node_worker_post(&s->worker, &(decode_cmd_t){.forget = true});
    return !s->forget_pending;
}

/* The router dropped this node (td_node_client's forgotten; issue 37): it failed or moved every
 * request it gave the node, and reads none of their tokens. Left alone they ran to max_tokens,
 * holding KV blocks and batch slots the router counts as free, and a drain waited for them. So
 * everything goes now: leases waiting for their KV or Prefill call (cancelled in td_xfer, whose
 * blocks go back), local prefills' calls (UNAVAILABLE), prompts prefilled for other nodes (their
 * calls UNAVAILABLE, each stopped as when its caller cancels: a transfer in flight aborted, its
 * blocks released by its done callback), and every sequence of the scheduler (the forget
 * command, in the ring behind every admission posted before it). */
static void on_forgotten(void *data, const char *why)
{
    decode_state_t *s = data;
    if (s->shutting_down)
        return;
    int32_t n_seqs = atomic_load(&s->load_running) + atomic_load(&s->admits_posted);
    int32_t n_leases = 0, n_calls = s->n_prefills, n_kv_outs = s->n_kv_outs;
    TD_LIST_FOREACH_SAFE(n, &s->admits) {
        decode_admit_t *a = TD_CONTAINER_OF(n, decode_admit_t, link);
        admit_unlink(s, a);
        if (!a->local)
            td_xfer_lease_cancel(s->xfer, a->lease_id);
        decode_admit_free(a);
        n_leases++;
    }
    const char *gone = s->unified ? "unified node: the router dropped this node"
                                  : "decode node: the router dropped this node";
    while (s->n_prefills)
        prefill_end(s, TD_CONTAINER_OF(s->prefills.next, decode_prefill_t, link), TD_GRPC_UNAVAILABLE, gone);
    TD_LIST_FOREACH_SAFE(n, &s->kv_outs) {
        decode_kv_out_t *k = TD_CONTAINER_OF(n, decode_kv_out_t, link);
        if (!k->call) /* stopped already: its transfer's or the cancel's end drops it */
            continue;
        kv_out_answer(s, k, TD_GRPC_UNAVAILABLE, gone);
        kv_out_stop(k);
    }
    bool posted = post_forget(s);
    refresh_kv_load(s);
    td_info("%s %s: %s; dropping what it ran for it: sequences %d, leases %d, local prefill calls %d, prefills for "
            "other nodes %d%s",
            s->proc.spec.prog, s->proc.cfg.node_id, why, n_seqs, n_leases, n_calls, n_kv_outs,
            posted ? "" : " (the command ring is full: the sequences go once it has room, Admit refused meanwhile)");
}

/* Admissions whose KV never came: td_xfer freed the lease's blocks; forget them. */
static void on_sweep(uv_timer_t *t)
{
    decode_state_t *s = t->data;
    if (s->forget_pending && post_forget(s))
        td_info("%s %s: the router's forgotten sequences are dropped now", s->proc.spec.prog, s->proc.cfg.node_id);
    refresh_kv_load(s); /* expiries and quarantine ends happen in td_xfer's tick */
    uint64_t now = td_now_ns();
    TD_LIST_FOREACH_SAFE(n, &s->admits) {
        decode_admit_t *a = TD_CONTAINER_OF(n, decode_admit_t, link);
        if (a->deadline_ns < now) {
            admit_unlink(s, a);
            td_info("decode: lease %llu expired before %s", (unsigned long long)a->lease_id,
                    a->local ? "its Prefill call" : "kv-ready");
            decode_admit_free(a);
        }
    }
}

static void load_cb(void *data, td_node_load_t *l)
{
    decode_state_t *s = data;
    l->running_seqs = atomic_load(&s->load_running);
    int64_t posted = atomic_load(&s->prompt_posted); /* first: see load_context's comment */
    l->queued_prefill_tokens = posted + atomic_load(&s->load_context);
    l->free_blocks = atomic_load(&s->load_free);
    l->step_ms = (double)atomic_load(&s->step_ns) * 1e-6;
    l->prefill_tok_s = (double)atomic_load(&s->milli_tok_s) * 1e-3;
    l->tpot_objective_s = (double)atomic_load(&s->tpot_us) * 1e-6;
    l->step_spread_s = (double)atomic_load(&s->spread_ns) * 1e-9;
}

/* Draining's count of the requests still here: admitted and waiting for their KV (or, for a
 * local prefill, for its Prefill call), handed to the compute thread, running or waiting
 * there, their last step results not yet queued on Steps, or queued there but not yet
 * written (+1: the router must read every token before the node goes). */
static int32_t decode_busy(void *data)
{
    decode_state_t *s = data;
    int32_t n = s->n_admits + s->n_prefills + s->n_kv_outs;
    n += atomic_load(&s->admits_posted); /* the compute thread's order is the reverse */
    n += atomic_load(&s->load_running);
    n += atomic_load(&s->outs_unsent);
    if (n == 0 && s->grpc && td_grpc_server_stats(s->grpc).queued_bytes > 0)
        n = 1;
    return n;
}

/* The decode node's part of shutdown (td_node_shutdown closes the rest). */
static void on_shutdown(void *data)
{
    decode_state_t *s = data;
    s->shutting_down = true;
    decode_warm_stop(s); /* it populates s->xfer's pool */
    td_node_worker_stop(&s->worker); /* joins the compute thread, closes its async handle */
    while (s->n_prefills)
        prefill_end(s, TD_CONTAINER_OF(s->prefills.next, decode_prefill_t, link), TD_GRPC_UNAVAILABLE,
                    s->unified ? "unified node shutting down" : "decode node shutting down");
    TD_LIST_FOREACH_SAFE(n, &s->kv_outs) { /* a send in flight ends in td_xfer_destroy's callback */
        decode_kv_out_t *k = TD_CONTAINER_OF(n, decode_kv_out_t, link);
        kv_out_answer(s, k, TD_GRPC_UNAVAILABLE, "decode node shutting down");
        if (!k->send)
            kv_out_drop(s, k);
    }
    while (s->n_subs) {
        td_grpc_call_t *c = s->subs[--s->n_subs];
        td_grpc_call_finish(c, TD_GRPC_UNAVAILABLE, "decode node shutting down");
    }
    td_grpc_server_close(s->grpc, NULL, NULL);
    s->grpc = NULL;
    td_xfer_destroy(s->xfer);
    s->xfer = NULL;
    if (s->handles_up)
        uv_close((uv_handle_t *)&s->sweep, NULL);
}

/* Speculative decoding's series, registered only when it is on (tandem_<role>_spec_*). */
static td_status_t init_spec_metrics(decode_state_t *s)
{
    static const char *const suffix[] = {"spec_verify_steps_total", "spec_draft_tokens_total",
                                         "spec_accepted_tokens_total", "spec_acceptance_ratio",
                                         "spec_tokens_per_step"};
    char name[TD_ARRAY_LEN(suffix)][64];
    for (size_t i = 0; i < TD_ARRAY_LEN(suffix); i++)
        snprintf(name[i], sizeof name[i], "tandem_%s_%s", s->unified ? "unified" : "decode", suffix[i]);
    const td_metric_def_t defs[] = {
        TD_METRIC_DEF_COUNTER(name[0], "sequence-steps that verified drafts", &s->m_spec_verify),
        TD_METRIC_DEF_COUNTER(name[1], "draft tokens proposed", &s->m_spec_drafted),
        TD_METRIC_DEF_COUNTER(name[2], "draft tokens accepted", &s->m_spec_accepted),
        TD_METRIC_DEF_GAUGE(name[3], "accepted / proposed draft tokens since startup", &s->m_spec_acceptance),
        TD_METRIC_DEF_GAUGE(name[4], "tokens per sequence-step since startup (1 without speculation)",
                            &s->m_spec_tokens_per_step),
    };
    return td_metrics_register_all(s->metrics, defs, TD_ARRAY_LEN(defs));
}

/* The role's metrics: tandem_decode_* on a decode node, tandem_unified_* on a unified one
 * (the same series, so dashboards and tests read either by prefix). */
static td_status_t init_metrics(decode_state_t *s)
{
    static const double batch_buckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};
    static const char *const suffix[] = {"kv_blocks_used", "kv_blocks_free", "running_sequences", "waiting_sequences",
                                         "tokens_total", "steps_total", "step_seconds", "batch_size", "admits_total",
                                         "admits_refused_total", "releases_total", "prefill_tokens_total",
                                         "kv_blocks_window_released_total", "prefill_token_cost_seconds",
                                         "tpot_objective_seconds", "peer_prefills_total", "peer_prefills_failed_total"};
    char name[TD_ARRAY_LEN(suffix)][64];
    for (size_t i = 0; i < TD_ARRAY_LEN(suffix); i++)
        snprintf(name[i], sizeof name[i], "tandem_%s_%s", s->unified ? "unified" : "decode", suffix[i]);
    const td_metric_def_t defs[] = {
        TD_METRIC_DEF_GAUGE(name[0], "KV blocks held by sequences", &s->m_used),
        TD_METRIC_DEF_GAUGE(name[1], "KV blocks an allocation could get", &s->m_free),
        TD_METRIC_DEF_GAUGE(name[2], "sequences in the running batch", &s->m_running),
        TD_METRIC_DEF_GAUGE(name[3], "admitted sequences not yet running", &s->m_waiting),
        TD_METRIC_DEF_COUNTER(name[4], "tokens generated and streamed", &s->m_tokens),
        TD_METRIC_DEF_COUNTER(name[5], "engine steps run", &s->m_steps),
        TD_METRIC_DEF_HISTOGRAM(name[6], "duration of one decode step",
                                td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_step_s),
        TD_METRIC_DEF_HISTOGRAM(name[7], "sequences per decode step", batch_buckets,
                                TD_ARRAY_LEN(batch_buckets), &s->m_batch),
        TD_METRIC_DEF_COUNTER(name[8], "Admit calls granted", &s->m_admits),
        TD_METRIC_DEF_COUNTER(name[9], "Admit calls refused", &s->m_refused),
        TD_METRIC_DEF_COUNTER(name[10], "Release calls", &s->m_releases),
        TD_METRIC_DEF_COUNTER(name[11], "context tokens computed here in prompt chunks (local prefill, "
                                        "recompute after preemption)", &s->m_prefill_tokens),
        TD_METRIC_DEF_COUNTER(name[12], "KV blocks sequences gave back early: behind every layer's "
                                        "sliding window", &s->m_window_released),
        TD_METRIC_DEF_GAUGE(name[13], "what a prompt token adds to a step, by the step-cost fit that sizes "
                                      "prompt chunks under a TPOT objective (0: no fit yet)", &s->m_token_cost),
        TD_METRIC_DEF_GAUGE(name[14], "the tightest TPOT objective of the running and waiting sequences "
                                      "(0: none has one)", &s->m_tpot),
        TD_METRIC_DEF_COUNTER(name[15], "prompts prefilled here for another decode node's lease and delivered "
                                        "there (Prefill calls of the peer placement)", &s->m_kv_out),
        TD_METRIC_DEF_COUNTER(name[16], "Prefill calls for another decode node's lease answered with an error "
                                        "(computing, transfer, shutdown)", &s->m_kv_out_failed),
    };
    return td_metrics_register_all(s->metrics, defs, TD_ARRAY_LEN(defs));
}

/* Where the KV data plane listens: xfer-host, else --host unless that is a wildcard, then
 * --advertise (the address prefill nodes are told anyway). UCX authenticates no peer, so the
 * listener is kept off every interface unless xfer-host asks for it (docs/security.md). */
static const char *xfer_listen_ip(const decode_state_t *s)
{
    const td_node_config_t *pc = &s->proc.cfg;
    if (s->cfg.xfer_host)
        return s->cfg.xfer_host;
    return td_node_is_wildcard(pc->host) && pc->advertise ? pc->advertise : pc->host;
}

/* The whole life of a decode node or (unified) a unified node: the same loop, compute
 * thread and scheduler; a unified node has no data plane and serves Prefill itself. */
/* The engine on its KV pool: a unified node's own (no data plane: the engine allocates its
 * pool and is its only writer); a decode node's through td_xfer, whose descriptor (for the
 * router to hand to prefill nodes) goes to desc. */
static td_status_t open_pool(decode_state_t *s, td_engine_config_t *ec, uint8_t *desc, size_t cap, size_t *desc_len)
{
    const decode_config_t *cfg = &s->cfg;
    const td_node_config_t *pc = &s->proc.cfg;
    td_status_t st;
    *desc_len = 0;
    if (s->unified) {
        if ((st = pool_result(s, td_engine_create(s->model, s->be, ec, &s->eng))) != TD_OK)
            return st;
        s->kv = td_engine_kv(s->eng);
        return TD_OK;
    }
    td_xfer_config_t xc = td_xfer_config_default();
    xc.name = pc->node_id;
    xc.listen_ip = xfer_listen_ip(s);
    xc.advertise_ip = pc->advertise; /* the descriptor the router hands to prefill nodes */
    if ((st = td_xfer_create(&s->proc.loop, &xc, &s->xfer)) != TD_OK ||
        (st = td_node_xfer_metrics_init(&s->xfer_metrics, s->metrics, s->xfer)) != TD_OK)
        return st;
    td_xfer_pool_t xp = {.layout = s->layout, .base = NULL, .n_blocks = (uint32_t)cfg->kv_blocks,
                         .resident_blocks = decode_warm_resident(&s->layout, (uint32_t)cfg->kv_blocks),
                         .mem = TD_XFER_MEM_HOST, .kv = NULL};
    if (s->be->host_memory) {
        /* UCX allocates the pool (shared memory for senders on this host); the engine
           computes on it */
        if ((st = pool_result(s, td_xfer_register_pool(s->xfer, &xp, on_kv_ready, s))) != TD_OK)
            return st;
        ec->kv_pool = td_xfer_pool_base(s->xfer);
        if ((st = td_engine_create(s->model, s->be, ec, &s->eng)) != TD_OK)
            return st;
        s->kv = td_engine_kv(s->eng);
        if ((st = td_xfer_pool_set_kv(s->xfer, s->kv)) != TD_OK ||
            (st = decode_warm_start(s, xp.resident_blocks, xp.n_blocks)) != TD_OK)
            return st;
    } else {
        /* a device pool (the engine's): senders write a host landing area and kv-ready
           copies the landed blocks in (docs/xfer.md "Memory types") */
        if ((st = pool_result(s, td_engine_create(s->model, s->be, ec, &s->eng))) != TD_OK)
            return st;
        s->kv = td_engine_kv(s->eng);
        xp.base = td_engine_kv_pool(s->eng, NULL);
        xp.mem = TD_XFER_MEM_CUDA;
        xp.kv = s->kv;
        xp.landing_blocks = (uint32_t)(cfg->landing_blocks ? cfg->landing_blocks : TD_MAX(1, cfg->kv_blocks / 4));
        xp.copy_h2d = copy_landed;
        xp.copy_arg = s->be;
        if ((st = td_xfer_register_pool(s->xfer, &xp, on_kv_ready, s)) != TD_OK)
            return st;
    }
    return td_xfer_describe(s->xfer, desc, cap, desc_len);
}

/* The control server (it also answers Prefill, for the leases it prefills itself), /metrics,
 * the sweep timer and the compute thread. */
static td_status_t serve(decode_state_t *s)
{
    const td_node_config_t *pc = &s->proc.cfg;
    td_grpc_server_config_t gc = td_grpc_server_config_default();
    gc.host = pc->host;
    gc.port = (uint16_t)pc->port;
    gc.metrics = s->metrics;
    td_node_auth_guard_control(&s->proc.auth, &gc);
    static const td_grpc_method_t methods[] = {
        {"/tandem.control.v1.DecodeNode/Admit", &tandem__control__v1__admit_request__descriptor, on_admit},
        {"/tandem.control.v1.DecodeNode/Release", &tandem__control__v1__release_request__descriptor, on_release},
        {"/tandem.control.v1.DecodeNode/Steps", &tandem__control__v1__steps_request__descriptor, on_steps},
        {"/tandem.control.v1.PrefillNode/Prefill", &tandem__control__v1__prefill_request__descriptor, on_prefill},
    };
    td_status_t st;
    if ((st = td_grpc_server_create(&s->proc.loop, &gc, &s->grpc)) != TD_OK ||
        (st = td_grpc_server_add_methods(s->grpc, methods, TD_ARRAY_LEN(methods), s)) != TD_OK ||
        (st = td_node_serve_control(&s->proc, s->grpc)) != TD_OK)
        return st;
    if ((st = td_node_serve(&s->proc, s->metrics)) != TD_OK)
        return st;
    uv_timer_init(&s->proc.loop, &s->sweep);
    s->sweep.data = s;
    uv_timer_start(&s->sweep, on_sweep, 100, 100);
    s->handles_up = true;
    return td_node_worker_start(&s->worker);
}

/* Registers with the router: role, layout, capacity, the vocabulary and EOS ids it checks
 * prompts against, and the data plane's descriptor (NULL for a unified node). */
static td_status_t register_node(decode_state_t *s, const uint8_t *desc, size_t desc_len)
{
    const decode_config_t *cfg = &s->cfg;
    td_node_client_config_t nc = {.xfer_desc = desc_len ? desc : NULL, .xfer_desc_len = desc_len,
                                      .max_seq_len = (uint32_t)s->model->config.max_seq_len};
    nc.info.role = s->unified ? TD_NODE_ROLE_UNIFIED : TD_NODE_ROLE_DECODE;
    nc.max_prefill_tokens = (uint32_t)cfg->max_batch_tokens;
    nc.info.layout = s->layout;
    nc.info.capacity_blocks = (int32_t)cfg->kv_blocks;
    nc.info.vocab_size = s->model->config.vocab_size; /* the router checks prompt ids against it */
    nc.info.n_eos = TD_MIN(s->model->config.n_eos, TD_NODE_MAX_EOS); /* the router withholds them */
    for (int32_t i = 0; i < nc.info.n_eos; i++)
        nc.info.eos_ids[i] = s->model->config.eos_ids[i];
    nc.info.max_batch = (int32_t)cfg->max_batch;
    nc.forgotten = on_forgotten;
    atomic_store(&s->load_free, (int32_t)cfg->kv_blocks);
    return td_node_register(&s->proc, &nc, td_grpc_server_port(s->grpc), load_cb, s);
}

/* Everything node_main made, in reverse, whatever got made (NULL-safe closers). */
static void free_state(decode_state_t *s)
{
    decode_warm_stop(s); /* an init that failed after it started */
    td_node_stop(&s->proc); /* partial init: closes what exists (NULL-safe closers) */
    TD_LIST_FOREACH_SAFE(n, &s->admits) {
        decode_admit_t *a = TD_CONTAINER_OF(n, decode_admit_t, link);
        admit_unlink(s, a);
        decode_admit_free(a);
    }
    if (s->kv_outs.next) /* initialised (node_main) */
        TD_LIST_FOREACH_SAFE(n, &s->kv_outs)
            kv_out_drop(s, TD_CONTAINER_OF(n, decode_kv_out_t, link));
    decode_cmd_t c;
    while (td_node_worker_pop_in(&s->worker, &c))
        cmd_discard(s, &c);
    decode_out_t *o;
    while (td_node_worker_pop_out(&s->worker, &o))
        decode_out_free(o);
    decode_sched_destroy(s->sched);
    td_node_gram_close(&s->gram);
    td_spec_draft_destroy(s->draft);
    td_engine_destroy(s->draft_eng);
    td_model_destroy(s->draft_model);
    td_engine_destroy(s->eng);
    td_backend_destroy(s->be);
    td_model_destroy(s->model);
    td_metrics_destroy(s->metrics);
    td_node_worker_free(&s->worker);
    free(s->failed);
    free(s->batch_seqs);
    free(s->batch_ptrs);
    free(s->batch_lps);
    td_node_free(&s->proc);
}

static int node_main(int argc, char **argv, bool unified)
{
    decode_state_t st_, *s = &st_;
    memset(s, 0, sizeof *s);
    s->unified = unified;
    td_list_init(&s->admits);
    td_list_init(&s->prefills);
    td_list_init(&s->kv_outs);
    decode_config_t *cfg = &s->cfg;
    const td_node_config_t *pc = &s->proc.cfg;
    const decode_sched_config_t sched_default = decode_sched_config_default();
    *cfg = (decode_config_t){.kv_blocks = 0, .kv_seqs = TD_KV_DECODE_SEQS, .max_batch = 64,
                             .max_lease_ms = 600000, .max_requests = 256,
                             .result_queue = 64, .idle_wait_ms = 50,
                             .max_batch_tokens = sched_default.max_batch_tokens,
                             .prefill_chunk = sched_default.prefill_chunk, .spec = "off",
                             .draft_tokens = sched_default.spec.k_max};
    const td_opt_t keys[] = {
        TD_OPT_INT("kv-blocks", &cfg->kv_blocks, 0, 1 << 24,
                   "KV pool blocks (sequences and leases; 0 = as many as kv-mem holds)"),
        TD_OPT_INT("kv-mem", &cfg->kv_mem, 0, 1 << 30,
                   "KV pool budget in MiB when kv-blocks is 0 (0 = 50% of the memory available, at most 64 GiB; "
                   "never more than kv-seqs sequences of the model's length)"),
        TD_OPT_INT("kv-seqs", &cfg->kv_seqs, 1, 4096,
                   "when kv-blocks is 0, the pool holds this many sequences of the model's length (default 4, "
                   "at most max-batch; shorter sequences share it, up to max-batch at once)"),
        TD_OPT_INT("landing-blocks", &cfg->landing_blocks, 0, 1 << 24,
                   "--device cuda: host blocks transfers land in before their copy to the GPU (0 = kv-blocks / 4)"),
        TD_OPT_INT("max-batch", &cfg->max_batch, 1, 4096, "running sequences at most"),
        TD_OPT_INT("max-lease-ms", &cfg->max_lease_ms, 1, 600000, "longest lease granted"),
        TD_OPT_INT("max-requests", &cfg->max_requests, 1, 1 << 20, "pending admissions at most"),
        TD_OPT_INT("result-queue", &cfg->result_queue, 1, 1 << 20, "step results waiting for the loop"),
        TD_OPT_INT("idle-wait-ms", &cfg->idle_wait_ms, 1, 10000,
                   "compute thread: longest single wait for work or room"),
        TD_OPT_INT("max-batch-tokens", &cfg->max_batch_tokens, 1, 1 << 20,
                   "tokens one step feeds: one per running sequence, then prompt chunks"),
        TD_OPT_INT("prefill-chunk", &cfg->prefill_chunk, 1, 1 << 20,
                   "prompt tokens one sequence feeds in one step"),
        TD_OPT_STRING("spec", &cfg->spec,
                      "speculative decoding: off (default) | prompt-lookup (drafts copied from earlier in the "
                      "prompt and output, verified in one step; the same tokens as off) | draft-model (drafts "
                      "from draft-model)"),
        TD_OPT_STRING("draft-model", &cfg->draft_model,
                      "a small model sharing the model's vocabulary that drafts, on its own KV pool (implies "
                      "spec draft-model)"),
        TD_OPT_INT("draft-tokens", &cfg->draft_tokens, 1, TD_SPEC_MAX_DRAFT,
                   "with spec: most draft tokens per sequence and step (adaptive below it)"),
        TD_OPT_STRING("xfer-host", &cfg->xfer_host,
                      "IPv4 address the KV data plane (UCX) listens on: the cluster network's (default: --host, "
                      "or --advertise when --host is a wildcard; UCX authenticates no peer, docs/security.md)"),
    };
    const td_node_spec_t spec = {.prog = unified ? "unified" : "decode", .kind = TD_NODE_NODE,
                                 .on_shutdown = on_shutdown, .busy = decode_busy, .data = s};
    int rc;
    if (!td_node_configure(&s->proc, &spec, keys, (int)TD_ARRAY_LEN(keys), argc, argv, &rc))
        return rc;
    decode_sched_config_t dc = sched_default;
    rc = 2; /* a usage error; through `out`, which frees what td_node_configure made (its loop) */
    if (td_spec_parse_mode(cfg->spec, &dc.spec.mode) != TD_OK ||
        td_spec_resolve_mode(&dc.spec.mode, cfg->draft_model != NULL) != TD_OK) {
        fprintf(stderr, "tandem %s: %s\n", spec.prog, td_last_error());
        goto out;
    }
    dc.spec.k_max = (int32_t)cfg->draft_tokens;
    rc = 1;

    /* subsystems: compute thread's rings, model, xfer with the KV pool it allocates,
       engine on that pool, scheduler, servers, router client */
    td_status_t st;
    if ((st = td_node_load_model(&s->proc, &s->model, &s->be)) != TD_OK ||
        (cfg->draft_model && (st = load_draft(s)) != TD_OK))
        goto out;
    td_engine_config_t ec = td_node_engine_config(&s->proc);
    ec.max_seqs = (int32_t)cfg->max_batch;
    ec.max_logit_rows = (int32_t)cfg->max_batch;
    if (dc.spec.mode != TD_SPEC_OFF) /* verify items: a row per draft token too */
        ec.max_logit_rows = (int32_t)TD_MIN(cfg->max_batch * (cfg->draft_tokens + 1), (int64_t)4096);
    ec.max_batch_tokens = TD_MAX((int32_t)cfg->max_batch_tokens, (int32_t)cfg->max_batch);
    if ((st = size_pool(s, &ec)) != TD_OK) /* before anything is allocated or registered */
        goto out;
    ec.n_blocks = (int32_t)cfg->kv_blocks;
    td_engine_kv_layout_for(s->model, &ec, &s->layout);
    /* the command ring's bound depends on the pool (cmd_ring_size) */
    const td_node_worker_config_t wc = {.name = "decode", .msg_size = sizeof(decode_cmd_t),
                                       .msg_cap = decode_cmd_ring_size(cfg), .event_size = sizeof(decode_out_t *),
                                       .event_cap = (int32_t)cfg->result_queue, .wait_ms = cfg->idle_wait_ms,
                                       .run = decode_compute_main, .on_events = on_outs, .data = s};
    if ((st = td_node_worker_init(&s->worker, &s->proc.loop, &wc)) != TD_OK)
        goto out;
    if (!(s->failed = malloc((size_t)decode_cmd_ring_size(cfg) * sizeof *s->failed)) ||
        batch_reserve(s, (int32_t)cfg->max_batch * 2 + 1) == 0) {
        st = td_errorf(TD_ERR_NOMEM, "decode: out of memory at startup");
        goto out;
    }
    if ((st = td_metrics_create(&s->metrics)) != TD_OK || (st = init_metrics(s)) != TD_OK ||
        (dc.spec.mode != TD_SPEC_OFF && (st = init_spec_metrics(s)) != TD_OK))
        goto out;
    uint8_t desc[TD_XFER_DESC_MAX];
    size_t desc_len = 0;
    if ((st = open_pool(s, &ec, desc, sizeof desc, &desc_len)) != TD_OK)
        goto out;
    dc.max_batch = (int32_t)cfg->max_batch;
    dc.max_waiting = (int32_t)cfg->max_requests;
    dc.max_batch_tokens = (int32_t)cfg->max_batch_tokens;
    dc.prefill_chunk = (int32_t)cfg->prefill_chunk;
    if (cfg->draft_model && (st = open_draft(s, &ec)) != TD_OK)
        goto out;
    dc.draft = s->draft;
    if ((st = td_node_gram_open(s->model, &s->gram)) != TD_OK)
        goto out;
    dc.gram_cache = s->gram.cache;
    dc.gram_vocab = s->gram.vocab;
    if ((st = decode_sched_create(s->eng, NULL, &dc, &s->sched)) != TD_OK)
        goto out;
    if (pc->router)
        resolve_router(s, pc->router);
    if ((st = serve(s)) != TD_OK || (st = register_node(s, desc, desc_len)) != TD_OK)
        goto out;

    rc = td_node_run(&s->proc);
out:
    free_state(s);
    return rc;
}

int decode_main(int argc, char **argv)
{
    return node_main(argc, argv, false);
}

int unified_main(int argc, char **argv)
{
    return node_main(argc, argv, true);
}
