/*
 * td_plan: the discrete-event simulator of td_plan.h. One heap of events ordered by time
 * (ties by the order they were made, so a run is deterministic): an arrival, a prefill,
 * decode or unified node's step ending, a KV transfer landing. A node that is idle starts its
 * next step the moment work reaches it; a step's length is the profile's for the batch it
 * took when it began (work arriving meanwhile waits for the next step, as on the nodes).
 */
#include "td_plan.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_lsq.h"
#include "td_place.h"
#include "td_rng.h"
#include "td_sched_defaults.h"
#include "td_stats.h"
#include "td_stepcost.h"
#include "td_util.h"

double td_plan_prefill_step_s(const td_plan_profile_t *p, int64_t tokens, double attn)
{
    return TD_MAX(p->prefill_a_s + p->prefill_b_s * (double)tokens + p->prefill_c_s * attn, 1e-6);
}

double td_plan_decode_step_s(const td_plan_profile_t *p, int64_t batch, int64_t context_tokens)
{
    return TD_MAX(p->decode_a_s + p->decode_b_s * (double)batch + p->decode_c_s * (double)context_tokens, 1e-6);
}

double td_plan_mixed_step_s(const td_plan_profile_t *p, int64_t prompt_tokens, double attn, int64_t batch,
                            int64_t context_tokens)
{
    double s = td_plan_prefill_step_s(p, prompt_tokens, attn);
    return batch > 0 ? s + td_plan_decode_step_s(p, batch, context_tokens) : s;
}

double td_plan_speed(const td_plan_profile_t *p, uint32_t replica, int32_t node, double t)
{
    if (p->n_speed <= 0 || !(p->speed_window_s > 0) || !(t >= 0))
        return 1;
    uint64_t x = ((uint64_t)replica << 52) ^ ((uint64_t)(uint32_t)node << 32) ^ (uint64_t)floor(t / p->speed_window_s);
    return p->speed_f[td_splitmix64(&x) % (uint64_t)p->n_speed];
}

td_plan_cluster_t td_plan_cluster_default(void)
{
    return (td_plan_cluster_t){.n_prefill = 1, .n_decode = 1,
                               .prefill_max_batch_tokens = TD_PREFILL_MAX_BATCH_TOKENS,
                               .prefill_max_batch = TD_PREFILL_MAX_BATCH, .decode_max_batch = TD_DECODE_MAX_BATCH,
                               .unified_chunk = TD_DECODE_PREFILL_CHUNK,
                               .unified_max_batch_tokens = TD_DECODE_MAX_BATCH_TOKENS,
                               .tpot_objective_s = TD_PLACE_TPOT_OBJECTIVE_S};
}

td_plan_search_t td_plan_search_default(void)
{
    return (td_plan_search_t){.n_requests = 1000, .seed = 1, .min_attainment = 0.9};
}

/* ---- events -------------------------------------------------------------------------------- */

typedef enum ev_kind { EV_ARRIVE, EV_PREFILL, EV_XFER, EV_DECODE, EV_UNIFIED } ev_kind_t;

typedef struct ev {
    double t;
    uint64_t order; /* ties: first made, first run */
    int32_t kind, idx; /* idx: the request (ARRIVE, XFER) or the node */
} ev_t;

typedef struct heap {
    ev_t *e;
    size_t n, cap;
    uint64_t next_order;
} heap_t;

static bool ev_before(const ev_t *a, const ev_t *b)
{
    return a->t < b->t || (a->t == b->t && a->order < b->order);
}

static td_status_t heap_push(heap_t *h, double t, int32_t kind, int32_t idx)
{
    if (h->n == h->cap) {
        size_t cap = h->cap ? 2 * h->cap : 256;
        ev_t *e = realloc(h->e, cap * sizeof *e);
        if (!e)
            return td_errorf(TD_ERR_NOMEM, "plan: out of memory for events");
        h->e = e, h->cap = cap;
    }
    size_t i = h->n++;
    h->e[i] = (ev_t){.t = t, .order = h->next_order++, .kind = kind, .idx = idx};
    while (i > 0 && ev_before(&h->e[i], &h->e[(i - 1) / 2])) {
        ev_t tmp = h->e[i];
        h->e[i] = h->e[(i - 1) / 2];
        h->e[(i - 1) / 2] = tmp;
        i = (i - 1) / 2;
    }
    return TD_OK;
}

static ev_t heap_pop(heap_t *h)
{
    ev_t top = h->e[0];
    h->e[0] = h->e[--h->n];
    for (size_t i = 0;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < h->n && ev_before(&h->e[l], &h->e[m]))
            m = l;
        if (r < h->n && ev_before(&h->e[r], &h->e[m]))
            m = r;
        if (m == i)
            break;
        ev_t tmp = h->e[i];
        h->e[i] = h->e[m];
        h->e[m] = tmp;
        i = m;
    }
    return top;
}

/* ---- state ----------------------------------------------------------------------------------- */

typedef struct sreq {
    int32_t input, output;
    int32_t prefilled;  /* prompt tokens computed */
    int32_t generated;  /* output tokens produced (the first by the prefill) */
    int32_t node;       /* prefill or unified node; -1: prefilled on its decode node */
    double tpot_s;      /* the TPOT objective its decode node (and a peer) holds it to (a conditional
                           or follow cluster's decode node: the router's; 0: none) */
    int32_t dnode;      /* decode node */
    int32_t peer;       /* follow: the other decode node that prefills it for dnode (-1: none) */
    double t_first, t_done;
} sreq_t;

/* A FIFO of request indices: every request enters a node's queue once, so n slots suffice. */
typedef struct fifo {
    int32_t *v;
    size_t head, tail;
} fifo_t;

typedef struct node {
    fifo_t q;           /* prefill/unified: prompts not yet fully computed; decode: adopted, waiting */
    int32_t *run;       /* decode/unified: running sequences [max_batch] */
    int32_t n_run;
    int32_t *step;      /* the requests in the step under way (and their chunk) */
    int32_t *step_tok;
    int32_t n_step;
    bool busy;
    int64_t queued_tokens; /* prefill: prompt tokens not yet computed */
    int32_t assigned;      /* decode: sequences placed here and not ended */
    int64_t kv_tokens;     /* decode: tokens reserved by them */
    double busy_s;
    double step_dt;        /* the step under way: its length */
    int64_t step_prompt, step_decodes; /* ... its prompt tokens and its one-token decodes */
    /* its pace as its heartbeats report it (moving means over about eight steps, as the nodes
       keep them: prefill_main.c, decode_compute.c pace_note): what the router prices with */
    double tok_s;          /* prefill: prompt tokens per second of its steps */
    double pace_s;         /* decode, unified: a step without prompt tokens */
    td_stepcost_t cost;    /* decode, unified: its steps' times against what they carried, */
    td_stepcost_fit_t fit; /* and their fit, as decode_sched keeps them: the local prefill rate it
                              reports and the chunks a TPOT objective allows */
    int64_t step_ctx;      /* the step under way: the context its sequences held (the fit's C) */
} node_t;

typedef struct sim {
    const td_plan_profile_t *p;
    const td_plan_cluster_t *c;
    const td_plan_request_t *reqs;
    size_t n;
    sreq_t *r;
    node_t *pn, *dn; /* prefill (or unified) nodes, decode nodes */
    int32_t n_pn, n_dn;
    fifo_t router_q; /* requests no decode node had room for */
    heap_t h;
    size_t ended;
    uint32_t replica; /* which draws of the nodes' speed (td_plan_speed) */
} sim_t;

static td_status_t node_init(node_t *nd, size_t n, int32_t max_batch, int32_t max_step)
{
    memset(nd, 0, sizeof *nd);
    nd->q.v = malloc(TD_MAX(n, (size_t)1) * sizeof(int32_t));
    nd->run = malloc((size_t)TD_MAX(max_batch, 1) * sizeof(int32_t));
    nd->step = malloc((size_t)TD_MAX(max_step, 1) * sizeof(int32_t));
    nd->step_tok = malloc((size_t)TD_MAX(max_step, 1) * sizeof(int32_t));
    if (!nd->q.v || !nd->run || !nd->step || !nd->step_tok)
        return td_errorf(TD_ERR_NOMEM, "plan: out of memory for nodes");
    return TD_OK;
}

static void node_free(node_t *nd)
{
    free(nd->q.v), free(nd->run), free(nd->step), free(nd->step_tok);
}

static size_t fifo_len(const fifo_t *f)
{
    return f->tail - f->head;
}

/* Whether the cluster's decode nodes prefill prompts themselves (conditional, follow): they step
 * as unified nodes do and keep a step-cost fit. */
static bool dn_mixed(const td_plan_cluster_t *c)
{
    return c->conditional || c->follow;
}

/* ---- a node's step ----------------------------------------------------------------------------- */

/* Adds `take` prompt tokens of request id to the node's step (budget, tokens and the attention
 * term follow). */
static void step_take_prompt(sim_t *s, node_t *nd, int32_t id, int32_t take, int64_t *budget, int64_t *tokens,
                             double *attn)
{
    const sreq_t *r = &s->r[id];
    nd->step[nd->n_step] = id;
    nd->step_tok[nd->n_step++] = take;
    *budget -= take;
    *tokens += take;
    *attn += (double)take * (r->prefilled + take);
}

/* Windows a step is walked through one by one; a longer one takes the factors' mean. */
#define SPEED_WALK_MAX 64

/* How long node `node` takes from `now` for work the fits time at dt seconds: window by window
 * at each window's speed (a step that spans windows averages their factors, as a long prefill
 * step on a machine whose speed varies does); past SPEED_WALK_MAX windows, at the factors' mean. */
double td_plan_step_elapsed(const td_plan_profile_t *p, uint32_t replica, int32_t node, double now, double dt)
{
    if (p->n_speed <= 0 || !(p->speed_window_s > 0))
        return dt;
    double w = p->speed_window_s, t = now, work = dt;
    for (int k = 0; k < SPEED_WALK_MAX; k++) {
        double f = td_plan_speed(p, replica, node, t), end = (floor(t / w) + 1) * w;
        if (work * f <= end - t)
            return t + work * f - now;
        work -= (end - t) / f;
        t = end;
    }
    double mean = 0;
    for (int32_t j = 0; j < p->n_speed; j++)
        mean += p->speed_f[j] / p->n_speed;
    return t + work * mean - now;
}

/* The node computes a step the fits time at dt seconds, at the node's speed from now on (decode
 * nodes numbered after the prefill or unified ones): busy until its event of `kind`. */
static td_status_t step_run(sim_t *s, node_t *nd, double dt, double now, int32_t kind, int32_t i)
{
    dt = td_plan_step_elapsed(s->p, s->replica, kind == EV_DECODE ? s->n_pn + i : i, now, dt);
    nd->busy = true;
    nd->busy_s += dt;
    nd->step_dt = dt;
    return heap_push(&s->h, now + dt, kind, i);
}

/* ---- prefill nodes --------------------------------------------------------------------------- */

/* prefill_sched's packing: the queue's head first, each prompt taking what the token budget
 * leaves, at most prefill_max_batch prompts. */
static td_status_t prefill_start(sim_t *s, int32_t i, double now)
{
    node_t *nd = &s->pn[i];
    if (nd->busy || !fifo_len(&nd->q))
        return TD_OK;
    int64_t budget = s->c->prefill_max_batch_tokens, tokens = 0;
    double attn = 0;
    nd->n_step = 0;
    for (size_t k = nd->q.head; k < nd->q.tail && budget > 0 && nd->n_step < s->c->prefill_max_batch; k++) {
        const sreq_t *r = &s->r[nd->q.v[k]];
        step_take_prompt(s, nd, nd->q.v[k], (int32_t)TD_MIN((int64_t)(r->input - r->prefilled), budget), &budget,
                         &tokens, &attn);
    }
    return step_run(s, nd, td_plan_prefill_step_s(s->p, tokens, attn), now, EV_PREFILL, i);
}

static td_status_t prefill_done(sim_t *s, int32_t i, double now)
{
    node_t *nd = &s->pn[i];
    nd->busy = false;
    int64_t step_tokens = 0;
    for (int32_t k = 0; k < nd->n_step; k++)
        step_tokens += nd->step_tok[k];
    double tps = (double)step_tokens / TD_MAX(nd->step_dt, 1e-6);
    nd->tok_s = nd->tok_s > 0 ? (nd->tok_s * 7 + tps) / 8 : tps;
    for (int32_t k = 0; k < nd->n_step; k++) {
        sreq_t *r = &s->r[nd->step[k]];
        r->prefilled += nd->step_tok[k];
        nd->queued_tokens -= nd->step_tok[k];
        if (r->prefilled < r->input)
            continue;
        TD_ASSERT(nd->q.v[nd->q.head] == nd->step[k]); /* finished prompts are the queue's head */
        nd->q.head++;
        r->generated = 1;
        r->t_first = now + s->p->overhead_s;
        double xfer = s->p->xfer_a_s + s->p->xfer_b_s * r->input;
        td_status_t st = heap_push(&s->h, now + TD_MAX(xfer, 0.0), EV_XFER, nd->step[k]);
        if (st != TD_OK)
            return st;
    }
    return prefill_start(s, i, now);
}

/* ---- decode nodes ---------------------------------------------------------------------------- */

static void req_end(sim_t *s, int32_t id, double now)
{
    sreq_t *r = &s->r[id];
    r->t_done = now + s->p->overhead_s;
    s->ended++;
    if (s->c->n_unified == 0) {
        node_t *d = &s->dn[r->dnode];
        d->assigned--;
        d->kv_tokens -= r->input + r->output;
    }
}

/* decode_sched: waiting sequences join the running batch while it is below max_batch; one
 * token for every running sequence per step. */
static td_status_t decode_start(sim_t *s, int32_t i, double now)
{
    node_t *nd = &s->dn[i];
    if (nd->busy)
        return TD_OK;
    while (nd->n_run < s->c->decode_max_batch && fifo_len(&nd->q))
        nd->run[nd->n_run++] = nd->q.v[nd->q.head++];
    if (!nd->n_run)
        return TD_OK;
    int64_t ctx = 0;
    for (int32_t k = 0; k < nd->n_run; k++)
        ctx += s->r[nd->run[k]].input + s->r[nd->run[k]].generated;
    return step_run(s, nd, td_plan_decode_step_s(s->p, nd->n_run, ctx), now, EV_DECODE, i);
}

static td_status_t place_pending(sim_t *s, double now);
static td_status_t mixed_start(sim_t *s, node_t *nd, int32_t kind, int32_t i, double now);

/* A decode node's next step: a conditional or follow cluster's decode nodes step as unified ones
 * do (their own prompts' chunks, and a peer's, beside the streams), others decode only. */
static td_status_t dnode_start(sim_t *s, int32_t i, double now)
{
    return dn_mixed(s->c) ? mixed_start(s, &s->dn[i], EV_DECODE, i, now) : decode_start(s, i, now);
}

static td_status_t decode_done(sim_t *s, int32_t i, double now)
{
    node_t *nd = &s->dn[i];
    nd->busy = false;
    bool freed = false;
    for (int32_t k = 0; k < nd->n_run;) {
        sreq_t *r = &s->r[nd->run[k]];
        if (++r->generated < r->output) {
            k++;
            continue;
        }
        req_end(s, nd->run[k], now);
        nd->run[k] = nd->run[--nd->n_run];
        freed = true;
    }
    td_status_t st = decode_start(s, i, now);
    if (st == TD_OK && freed && s->c->decode_kv_tokens > 0)
        st = place_pending(s, now);
    return st;
}

static td_status_t xfer_done(sim_t *s, int32_t id, double now)
{
    sreq_t *r = &s->r[id];
    if (r->generated >= r->output) { /* a one-token request ends with its first token */
        req_end(s, id, now);
        return s->c->decode_kv_tokens > 0 ? place_pending(s, now) : TD_OK;
    }
    node_t *nd = &s->dn[r->dnode];
    nd->q.v[nd->q.tail++] = id;
    return dnode_start(s, r->dnode, now);
}

/* ---- the router ------------------------------------------------------------------------------ */

/* What decode node k would report to the router for a local prefill of request r (router_policy.c,
 * local_figures): its queued prompt tokens, running and waiting sequences, pace, local rate (its
 * step-cost fit's, else td_place_local_rate's stand-in from prefill node p's rate, -1: none) and
 * spread; chunks within the router's objective (every simulated sequence holds the same one, so
 * the router's tightest_tpot is it). */
static td_place_local_t local_figures(const sim_t *s, const sreq_t *r, int32_t k, int32_t p)
{
    const node_t *dn = &s->dn[k], *pn = p >= 0 ? &s->pn[p] : NULL;
    return (td_place_local_t){
        .queued_tokens = dn->queued_tokens,
        .new_tokens = r->input,
        .max_step_tokens = s->c->unified_max_batch_tokens,
        .running = dn->n_run + (int32_t)fifo_len(&dn->q),
        .step_s = dn->pace_s,
        .prefill_tok_s = td_place_local_rate(dn->fit.valid ? 1 / dn->fit.per_prefill_s : 0, pn ? pn->tok_s : 0,
                                             TD_PLACE_ASSUMED_TOK_S),
        .tpot_objective_s = s->c->tpot_objective_s,
        .spread_s = dn->fit.valid ? dn->fit.spread_s : 0,
    };
}

/* Where a prompt is prefilled: its decode node, its prefill partner, or (>= 0) a peer decode node. */
enum { PLACE_REMOTE = -2, PLACE_LOCAL = -1 };

/* Conditional disaggregation and follow: where decode node d's request id is prefilled, by
 * td_place on what the router would know of the nodes now (router_policy.c: place_conditional,
 * rule 5, then best_peer and td_place_peer_wins, rule 6). p: the prefill partner (-1: the cluster
 * has none). The transfer in the remote and peer estimates is the profile's (the router's is its
 * xfer-* configuration, which should say the same). */
static int32_t place(sim_t *s, int32_t id, int32_t d, int32_t p)
{
    const sreq_t *r = &s->r[id];
    double xfer = TD_MAX(s->p->xfer_a_s + s->p->xfer_b_s * r->input, 0.0), remote = -1;
    if (p >= 0) {
        const node_t *pn = &s->pn[p];
        double wait = (double)TD_MAX(pn->queued_tokens + r->input, 1) /
                      (pn->tok_s > 0 ? pn->tok_s : TD_PLACE_ASSUMED_TOK_S);
        remote = td_place_remote_estimate(wait, 0, xfer, 1);
    }
    td_place_local_t l = local_figures(s, r, d, p);
    td_place_estimate_t e;
    td_place_fit_t fit = td_place_local_estimate(&l, &e);
    if (fit == TD_PLACE_NO_TPOT_ROOM && p < 0) { /* no prefill node at all: local whatever the TPOT,
                                                    at the token a step the node then feeds */
        l.floor_tokens = TD_DECODE_PAST_OBJECTIVE_CHUNK;
        fit = td_place_local_estimate(&l, &e);
    }
    int32_t where = PLACE_REMOTE;
    double chosen = remote;
    if (fit == TD_PLACE_FITS && (p < 0 || td_place_local_wins(e.local_s, remote, s->c->ttft_objective_s)))
        where = PLACE_LOCAL, chosen = e.local_s;
    else if (p < 0)
        chosen = -1; /* neither: the router would try its next decode node (below) */
    if (!s->c->follow)
        return where;
    int32_t best = -1; /* rule 6: the soonest peer that can */
    double best_s = -1;
    for (int32_t k = 0; k < s->n_dn; k++) {
        if (k == d || (s->c->decode_kv_tokens > 0 && s->dn[k].kv_tokens + r->input > s->c->decode_kv_tokens))
            continue; /* the router's peer needs free blocks for the prompt */
        td_place_local_t pl = local_figures(s, r, k, p);
        double wait, ps = td_place_peer_estimate(&pl, 0, xfer, 1, &wait);
        if (ps >= 0 && (best < 0 || ps < best_s))
            best = k, best_s = ps;
    }
    if (td_place_peer_wins(best_s, chosen, where == PLACE_REMOTE && p >= 0, s->c->ttft_objective_s))
        return best;
    /* neither local, remote nor a peer: the router would try the next decode node; with the limits
       check() allows that takes a queue past the step budget, and the simulation queues it locally */
    return p < 0 ? PLACE_LOCAL : where;
}

/* router_policy: the decode node with room and the fewest prompt tokens of its own to prefill,
 * then the fewest sequences (lowest index on ties), then the prefill node with the fewest queued
 * prompt tokens; conditionally, the decode node itself if td_place says so. false: no decode
 * node has room. */
static bool route(sim_t *s, int32_t id, double now, td_status_t *st_p)
{
    sreq_t *r = &s->r[id];
    int64_t need = r->input + r->output;
    int32_t d = -1;
    for (int32_t k = 0; k < s->n_dn; k++) {
        node_t *nd = &s->dn[k];
        if (s->c->decode_kv_tokens > 0 && nd->kv_tokens + need > s->c->decode_kv_tokens &&
            !(nd->assigned == 0)) /* an empty node takes anything, as decode_sched's head */
            continue;
        if (d < 0 || nd->queued_tokens < s->dn[d].queued_tokens ||
            (nd->queued_tokens == s->dn[d].queued_tokens && nd->assigned < s->dn[d].assigned))
            d = k;
    }
    if (d < 0)
        return false;
    int32_t p = s->n_pn > 0 ? 0 : -1;
    for (int32_t k = 1; k < s->n_pn; k++)
        if (s->pn[k].queued_tokens < s->pn[p].queued_tokens)
            p = k;
    r->dnode = d;
    r->tpot_s = dn_mixed(s->c) ? s->c->tpot_objective_s : 0; /* its Admit's (router_policy) */
    s->dn[d].assigned++;
    s->dn[d].kv_tokens += need;
    int32_t where = dn_mixed(s->c) ? place(s, id, d, p) : PLACE_REMOTE;
    if (where != PLACE_REMOTE) { /* prefilled by d itself or by peer `where`, in its steps */
        int32_t k = where == PLACE_LOCAL ? d : where;
        node_t *kn = &s->dn[k];
        r->node = -1;
        r->peer = where == PLACE_LOCAL ? -1 : where;
        if (r->peer >= 0)
            kn->kv_tokens += r->input; /* the peer holds the prompt's blocks until they are sent */
        kn->q.v[kn->q.tail++] = id;
        kn->queued_tokens += r->input;
        *st_p = mixed_start(s, kn, EV_DECODE, k, now);
        return true;
    }
    r->node = p;
    s->pn[p].q.v[s->pn[p].q.tail++] = id;
    s->pn[p].queued_tokens += r->input;
    *st_p = prefill_start(s, p, now);
    return true;
}

/* Requests the router held back, in arrival order, while the head finds room. */
static td_status_t place_pending(sim_t *s, double now)
{
    td_status_t st = TD_OK;
    while (st == TD_OK && fifo_len(&s->router_q) && route(s, s->router_q.v[s->router_q.head], now, &st))
        s->router_q.head++;
    return st;
}

/* ---- unified nodes --------------------------------------------------------------------------- */

/* A colocated node (decode_sched with local prefill): a unified node, or a conditional cluster's
 * decode node (whose transferred sequences arrive prefilled). Waiting sequences join the running
 * set while it is below max_batch; a step is one token for every generating sequence, then prompt
 * chunks (<= unified_chunk each) in arrival order until the token budget. A step with prompt
 * tokens costs a prefill step of its prompt tokens plus a decode step of its decoding rows
 * (td_plan_mixed_step_s). */
static td_status_t mixed_start(sim_t *s, node_t *nd, int32_t kind, int32_t i, double now)
{
    if (nd->busy)
        return TD_OK;
    while (nd->n_run < s->c->decode_max_batch && fifo_len(&nd->q))
        nd->run[nd->n_run++] = nd->q.v[nd->q.head++];
    if (!nd->n_run)
        return TD_OK;
    int64_t budget = s->c->unified_max_batch_tokens, n_dec = 0, n_pre = 0, ctx = 0;
    double attn = 0;
    nd->n_step = 0;
    for (int32_t k = 0; k < nd->n_run; k++) { /* generating ones first */
        sreq_t *r = &s->r[nd->run[k]];
        if (r->prefilled < r->input)
            continue;
        nd->step[nd->n_step] = nd->run[k];
        nd->step_tok[nd->n_step++] = 1;
        n_dec++;
        ctx += r->input + r->generated;
    }
    budget -= n_dec;
    /* the step's prompt tokens in all within the tightest TPOT objective of its sequences, by the
       node's step-cost fit, at least TD_DECODE_PAST_OBJECTIVE_CHUNK; the probe without a fit
       (decode_sched's prefill_cap) */
    double objective = 0;
    int64_t held = 0;
    for (int32_t k = 0; k < nd->n_run; k++) {
        const sreq_t *r = &s->r[nd->run[k]];
        held += r->prefilled < r->input ? r->prefilled : r->input + r->generated;
        if (r->tpot_s > 0 && (objective <= 0 || r->tpot_s < objective))
            objective = r->tpot_s;
    }
    int64_t cap = objective > 0 ? td_stepcost_chunk(&nd->fit, (int32_t)n_dec, held, objective) : INT64_MAX;
    if (objective > 0)
        cap = cap < 0 ? td_stepcost_probe(&nd->cost, TD_DECODE_PROBE_CHUNK) : TD_MAX(cap, TD_DECODE_PAST_OBJECTIVE_CHUNK);
    for (int32_t k = 0; k < nd->n_run && budget > 0; k++) {
        sreq_t *r = &s->r[nd->run[k]];
        if (r->prefilled >= r->input)
            continue;
        int64_t take = TD_MIN(TD_MIN(TD_MIN((int64_t)(r->input - r->prefilled), (int64_t)s->c->unified_chunk), budget),
                              cap - n_pre);
        if (take > 0)
            step_take_prompt(s, nd, nd->run[k], (int32_t)take, &budget, &n_pre, &attn);
    }
    if (!nd->n_step) /* budget exhausted by decode tokens alone cannot happen: max_batch <= budget */
        return TD_OK;
    double dt = n_pre ? td_plan_mixed_step_s(s->p, n_pre, attn, n_dec, ctx) : td_plan_decode_step_s(s->p, n_dec, ctx);
    nd->step_prompt = n_pre;
    nd->step_decodes = n_dec;
    nd->step_ctx = held;
    return step_run(s, nd, dt, now, kind, i);
}

/* The node's figures, as decode_compute.c's pace_note keeps them: every step into the step-cost
 * fit (read only by a conditional or follow cluster's router and decode nodes: not kept otherwise,
 * it costs a fit a step), the steps without prompt tokens into the pace. */
static void mixed_pace(const sim_t *s, node_t *nd)
{
    if (dn_mixed(s->c)) {
        td_stepcost_note(&nd->cost, (int32_t)nd->step_decodes, nd->step_ctx, (int32_t)nd->step_prompt,
                         nd->step_dt);
        nd->fit = td_stepcost_fit(&nd->cost);
    }
    if (nd->step_prompt == 0)
        nd->pace_s = nd->pace_s > 0 ? (nd->pace_s * 7 + nd->step_dt) / 8 : nd->step_dt;
}

static td_status_t mixed_done(sim_t *s, node_t *nd, int32_t kind, int32_t i, double now)
{
    nd->busy = false;
    mixed_pace(s, nd);
    bool freed = false;
    for (int32_t k = 0; k < nd->n_step; k++) {
        sreq_t *r = &s->r[nd->step[k]];
        if (r->prefilled < r->input) {
            r->prefilled += nd->step_tok[k];
            nd->queued_tokens -= nd->step_tok[k];
            if (r->prefilled == r->input && kind == EV_DECODE && r->peer == i) {
                /* a peer's prompt (decode_sched kv_out): its first token leaves once the KV is sent
                   (decode_main answers FIRST_TOKEN after the layers), and its decode node adopts it */
                double xfer = TD_MAX(s->p->xfer_a_s + s->p->xfer_b_s * r->input, 0.0);
                r->generated = 1;
                r->t_first = now + xfer + s->p->overhead_s;
                td_status_t st = heap_push(&s->h, now + xfer, EV_XFER, nd->step[k]);
                if (st != TD_OK)
                    return st;
            } else if (r->prefilled == r->input) {
                r->generated = 1;
                r->t_first = now + s->p->overhead_s;
            }
        } else {
            r->generated++;
        }
    }
    for (int32_t k = 0; k < nd->n_run;) { /* ended ones leave; the order of the rest is kept */
        sreq_t *r = &s->r[nd->run[k]];
        if (kind == EV_DECODE && r->peer == i && r->prefilled >= r->input) { /* sent: its blocks freed */
            nd->kv_tokens -= r->input;
            memmove(&nd->run[k], &nd->run[k + 1], (size_t)(nd->n_run - k - 1) * sizeof *nd->run);
            nd->n_run--;
            freed = true;
        } else if (r->generated >= r->output && r->prefilled >= r->input) {
            req_end(s, nd->run[k], now);
            memmove(&nd->run[k], &nd->run[k + 1], (size_t)(nd->n_run - k - 1) * sizeof *nd->run);
            nd->n_run--;
            freed = true;
        } else {
            k++;
        }
    }
    td_status_t st = mixed_start(s, nd, kind, i, now);
    if (st == TD_OK && freed && kind == EV_DECODE && s->c->decode_kv_tokens > 0)
        st = place_pending(s, now);
    return st;
}

static td_status_t arrive(sim_t *s, int32_t id, double now)
{
    if (s->c->n_unified > 0) { /* the unified node with the fewest queued prompt tokens, then sequences */
        int32_t u = 0;
        for (int32_t k = 1; k < s->n_pn; k++) {
            const node_t *a = &s->pn[k], *b = &s->pn[u];
            if (a->queued_tokens < b->queued_tokens ||
                (a->queued_tokens == b->queued_tokens &&
                 a->n_run + fifo_len(&a->q) < b->n_run + fifo_len(&b->q)))
                u = k;
        }
        s->r[id].node = u;
        s->pn[u].q.v[s->pn[u].q.tail++] = id;
        s->pn[u].queued_tokens += s->r[id].input;
        return mixed_start(s, &s->pn[u], EV_UNIFIED, u, now);
    }
    td_status_t st = TD_OK;
    if (fifo_len(&s->router_q) || !route(s, id, now, &st)) /* FIFO: none overtakes a waiting one */
        s->router_q.v[s->router_q.tail++] = id;
    return st;
}

/* ---- results --------------------------------------------------------------------------------- */

/* What the replicas of a run measured, pooled (summarize adds one replica, pool_result reads). */
typedef struct pool {
    double *ttft, *tpot; /* [replicas x n] */
    size_t n, n_tpot, good, placed_local, placed_peer;
    double duration_s, ttft_sum, prefill_busy_s, decode_busy_s;
    int32_t n_pn, n_dn;
} pool_t;

static void summarize(const sim_t *s, const td_plan_slo_t *slo, pool_t *pl)
{
    double t0 = s->n ? s->reqs[0].arrival_s : 0, t_end = t0;
    for (size_t i = 0; i < s->n; i++) {
        const sreq_t *r = &s->r[i];
        double a = s->reqs[i].arrival_s, tt = r->t_first - a;
        double tp = r->output > 1 ? (r->t_done - r->t_first) / (double)(r->output - 1) : 0;
        pl->ttft[pl->n++] = tt;
        if (r->peer >= 0)
            pl->placed_peer++;
        else if (r->node < 0)
            pl->placed_local++;
        pl->ttft_sum += tt;
        if (r->output > 1)
            pl->tpot[pl->n_tpot++] = tp;
        t_end = TD_MAX(t_end, r->t_done);
        if ((slo->ttft_s <= 0 || tt <= slo->ttft_s) && (slo->tpot_s <= 0 || tp <= slo->tpot_s))
            pl->good++;
    }
    pl->duration_s += t_end - t0;
    for (int32_t k = 0; k < s->n_pn; k++)
        pl->prefill_busy_s += s->pn[k].busy_s;
    for (int32_t k = 0; k < s->n_dn; k++)
        pl->decode_busy_s += s->dn[k].busy_s;
    pl->n_pn = s->n_pn, pl->n_dn = s->n_dn;
}

/* The replicas as one run of all their requests over all their durations. */
static void pool_result(pool_t *pl, td_plan_result_t *res)
{
    memset(res, 0, sizeof *res);
    td_stats_sort(pl->ttft, pl->n);
    td_stats_sort(pl->tpot, pl->n_tpot);
    res->n = pl->n;
    res->good = pl->good;
    res->placed_local = pl->placed_local;
    res->placed_peer = pl->placed_peer;
    res->duration_s = pl->duration_s;
    res->throughput = pl->duration_s > 0 ? (double)pl->n / pl->duration_s : 0;
    res->goodput = pl->duration_s > 0 ? (double)pl->good / pl->duration_s : 0;
    res->attainment = pl->n ? (double)pl->good / (double)pl->n : 0;
    res->ttft_mean_s = pl->n ? pl->ttft_sum / (double)pl->n : 0;
    res->ttft_p50_s = td_stats_percentile(pl->ttft, pl->n, 50);
    res->ttft_p90_s = td_stats_percentile(pl->ttft, pl->n, 90);
    res->ttft_p99_s = td_stats_percentile(pl->ttft, pl->n, 99);
    res->tpot_p50_s = td_stats_percentile(pl->tpot, pl->n_tpot, 50);
    res->tpot_p90_s = td_stats_percentile(pl->tpot, pl->n_tpot, 90);
    res->tpot_p99_s = td_stats_percentile(pl->tpot, pl->n_tpot, 99);
    if (pl->duration_s > 0) {
        res->prefill_busy = pl->n_pn ? pl->prefill_busy_s / pl->n_pn / pl->duration_s : 0;
        res->decode_busy = pl->n_dn ? pl->decode_busy_s / pl->n_dn / pl->duration_s : res->prefill_busy;
    }
}

/* ---- the run --------------------------------------------------------------------------------- */

static td_status_t check(const td_plan_cluster_t *c, const td_plan_request_t *reqs, size_t n)
{
    bool unified = c->n_unified > 0;
    if (unified ? (c->n_prefill || c->n_decode) : (c->n_prefill < (c->follow ? 0 : 1) || c->n_decode < 1))
        return td_errorf(TD_ERR_INVALID, "plan: a cluster is prefill >= 1 (follow: >= 0) and decode >= 1 nodes, or "
                                         "unified >= 1 nodes (got %d prefill, %d decode, %d unified)",
                         c->n_prefill, c->n_decode, c->n_unified);
    if (unified && dn_mixed(c))
        return td_errorf(TD_ERR_INVALID, "plan: conditional disaggregation and follow need decode nodes (and "
                                         "prefill nodes for conditional), not unified ones");
    if (c->prefill_max_batch_tokens < 1 || c->prefill_max_batch < 1 || c->decode_max_batch < 1 ||
        c->decode_kv_tokens < 0 ||
        ((unified || dn_mixed(c)) && (c->unified_chunk < 1 || c->unified_max_batch_tokens <= c->decode_max_batch)))
        return td_errorf(TD_ERR_INVALID, "plan: batch limits must be >= 1 (a unified node's token budget above "
                                         "its batch)");
    for (size_t i = 0; i < n; i++)
        if (reqs[i].input_len < 1 || reqs[i].output_len < 1 || !isfinite(reqs[i].arrival_s) ||
            (i && reqs[i].arrival_s < reqs[i - 1].arrival_s))
            return td_errorf(TD_ERR_INVALID, "plan: request %zu: lengths must be >= 1 and arrivals in order", i);
    return TD_OK;
}

/* The nodes as the measured ones start a run (bench serve's warm-up prompts, and a sweep's earlier
 * rates, before its requests): each prefill node's rate, and each decode node of a conditional or
 * follow cluster its step-cost fit and pace, from prompts of `input` tokens fed in chunks beside a
 * stream and from decode-only steps, timed by the profile (no speed factors). A cold node that
 * met a queue before its first decode-only step would never fit its steps (each carries the probe
 * chunk), and the router would price its prompts at the stand-in rate (td_place_local_rate): the
 * simulated follow cluster turned disaggregated past capacity, which the measured one did not
 * (docs/goodput.md, issue 37). */
static void nodes_warm(sim_t *s, int64_t input)
{
    const td_plan_profile_t *p = s->p;
    input = TD_MAX(input, 1);
    for (int32_t k = 0; k < s->n_pn && !s->c->n_unified; k++)
        s->pn[k].tok_s = (double)input / td_plan_prefill_step_s(p, input, (double)input * (double)input);
    if (!dn_mixed(s->c))
        return;
    for (int32_t k = 0; k < s->n_dn; k++) {
        node_t *nd = &s->dn[k];
        for (int32_t j = 0; j < 2 * TD_STEPCOST_MIN_PREFILL; j++) { /* chunks of 16, 32, 64, 128 */
            int64_t chunk = TD_MIN((int64_t)TD_DECODE_PROBE_CHUNK << (j % 4), input);
            td_stepcost_note(&nd->cost, 1, input, (int32_t)chunk,
                             td_plan_mixed_step_s(p, chunk, (double)chunk * (double)chunk, 1, input));
        }
        for (int32_t b = 1; b <= 4; b++)
            td_stepcost_note(&nd->cost, b, b * input, 0, td_plan_decode_step_s(p, b, b * input));
        nd->fit = td_stepcost_fit(&nd->cost);
        nd->pace_s = td_plan_decode_step_s(p, 1, input);
    }
}

/* One replica: the requests through the cluster, the nodes' speed drawn as `replica`'s. */
static td_status_t simulate_once(const td_plan_profile_t *p, const td_plan_cluster_t *c,
                                 const td_plan_request_t *reqs, size_t n, uint32_t replica,
                                 const td_plan_slo_t *slo, pool_t *pl)
{
    sim_t s = {.p = p, .c = c, .reqs = reqs, .n = n, .replica = replica};
    bool unified = c->n_unified > 0;
    s.n_pn = unified ? c->n_unified : c->n_prefill;
    s.n_dn = unified ? 0 : c->n_decode;
    int32_t max_step = unified ? c->decode_max_batch : c->prefill_max_batch;
    td_status_t st = TD_OK;
    s.r = calloc(TD_MAX(n, (size_t)1), sizeof *s.r);
    s.pn = calloc((size_t)TD_MAX(s.n_pn, 1), sizeof *s.pn); /* follow may have no prefill node */
    s.dn = calloc((size_t)TD_MAX(s.n_dn, 1), sizeof *s.dn);
    s.router_q.v = malloc(TD_MAX(n, (size_t)1) * sizeof(int32_t));
    if (!s.r || !s.pn || !s.dn || !s.router_q.v) {
        st = td_errorf(TD_ERR_NOMEM, "plan: out of memory for %zu requests", n);
        goto out;
    }
    for (int32_t k = 0; k < s.n_pn && st == TD_OK; k++)
        st = node_init(&s.pn[k], n, c->decode_max_batch, max_step);
    for (int32_t k = 0; k < s.n_dn && st == TD_OK; k++)
        st = node_init(&s.dn[k], n, c->decode_max_batch, dn_mixed(c) ? c->decode_max_batch : 1);
    if (st == TD_OK && n)
        nodes_warm(&s, reqs[0].input_len);
    for (size_t i = 0; i < n && st == TD_OK; i++) {
        s.r[i] = (sreq_t){.input = reqs[i].input_len, .output = reqs[i].output_len, .node = -1, .dnode = -1,
                          .peer = -1};
        st = heap_push(&s.h, reqs[i].arrival_s, EV_ARRIVE, (int32_t)i);
    }
    while (st == TD_OK && s.h.n) {
        ev_t e = heap_pop(&s.h);
        switch (e.kind) {
        case EV_ARRIVE: st = arrive(&s, e.idx, e.t); break;
        case EV_PREFILL: st = prefill_done(&s, e.idx, e.t); break;
        case EV_XFER: st = xfer_done(&s, e.idx, e.t); break;
        case EV_DECODE:
            st = dn_mixed(c) ? mixed_done(&s, &s.dn[e.idx], EV_DECODE, e.idx, e.t) : decode_done(&s, e.idx, e.t);
            break;
        case EV_UNIFIED: st = mixed_done(&s, &s.pn[e.idx], EV_UNIFIED, e.idx, e.t); break;
        default: TD_ASSERT(!"unknown event");
        }
    }
    if (st == TD_OK) {
        TD_ASSERT(s.ended == n); /* every request ends: nothing waits for room that never comes */
        summarize(&s, slo, pl);
    }
out:
    for (int32_t k = 0; s.pn && k < s.n_pn; k++)
        node_free(&s.pn[k]);
    for (int32_t k = 0; s.dn && k < s.n_dn; k++)
        node_free(&s.dn[k]);
    free(s.pn), free(s.dn), free(s.r), free(s.router_q.v), free(s.h.e);
    return st;
}

td_status_t td_plan_simulate(const td_plan_profile_t *p, const td_plan_cluster_t *c, const td_plan_request_t *reqs,
                             size_t n, const td_plan_slo_t *slo, td_plan_result_t *res_p)
{
    td_status_t st = check(c, reqs, n);
    if (st != TD_OK)
        return st;
    /* with speed factors, one run of a few requests would read its percentiles off a few draws */
    size_t replicas = p->n_speed > 0 ? TD_MIN(TD_MAX((size_t)TD_PLAN_SPEED_REQUESTS / TD_MAX(n, (size_t)1), (size_t)1),
                                              (size_t)TD_PLAN_SPEED_REPLICAS)
                                     : 1;
    pool_t pl = {.ttft = malloc(TD_MAX(n * replicas, (size_t)1) * sizeof(double)),
                 .tpot = malloc(TD_MAX(n * replicas, (size_t)1) * sizeof(double))};
    if (!pl.ttft || !pl.tpot)
        st = td_errorf(TD_ERR_NOMEM, "plan: out of memory for the results of %zu requests", n * replicas);
    for (size_t k = 0; k < replicas && st == TD_OK; k++)
        st = simulate_once(p, c, reqs, n, (uint32_t)k, slo, &pl);
    if (st == TD_OK)
        pool_result(&pl, res_p);
    free(pl.ttft), free(pl.tpot);
    return st;
}

/* ---- workloads and searches ------------------------------------------------------------------ */

void td_plan_arrivals(uint64_t seed, double rate, size_t n, const td_plan_lengths_t *L, td_plan_request_t *reqs)
{
    uint64_t x = seed;
    double t = 0;
    for (size_t i = 0; i < n; i++) {
        double u = ((double)(td_splitmix64(&x) >> 11) + 0.5) * 0x1.0p-53; /* (0, 1) */
        if (i)
            t += -log(u) / rate;
        reqs[i] = (td_plan_request_t){.arrival_s = t, .input_len = L->input_len[i % L->n],
                                      .output_len = L->output_len[i % L->n]};
    }
}

td_status_t td_plan_at_rate(const td_plan_profile_t *p, const td_plan_cluster_t *c, const td_plan_lengths_t *L,
                            const td_plan_search_t *s, double rate, td_plan_result_t *res_p)
{
    if (!(rate > 0) || !L->n || !s->n_requests)
        return td_errorf(TD_ERR_INVALID, "plan: a rate > 0 and a workload of at least one request are needed");
    td_plan_request_t *reqs = malloc(s->n_requests * sizeof *reqs);
    if (!reqs)
        return td_errorf(TD_ERR_NOMEM, "plan: out of memory for %zu requests", s->n_requests);
    td_plan_arrivals(s->seed, rate, s->n_requests, L, reqs);
    td_status_t st = td_plan_simulate(p, c, reqs, s->n_requests, &s->slo, res_p);
    free(reqs);
    return st;
}

td_status_t td_plan_max_rate(const td_plan_profile_t *p, const td_plan_cluster_t *c, const td_plan_lengths_t *L,
                             const td_plan_search_t *s, double *rate_p, td_plan_result_t *res_p)
{
    td_plan_result_t r, best = {0};
    double lo = 0, hi = 0.01;
    td_status_t st;
    /* grow until a rate is not sustained, then halve the bracket down to 1% */
    for (;;) {
        if ((st = td_plan_at_rate(p, c, L, s, hi, &r)) != TD_OK)
            return st;
        if (r.attainment < s->min_attainment)
            break;
        lo = hi, best = r;
        if ((hi *= 2) > 1e7)
            break;
    }
    if (lo == 0) { /* not even 0.01 requests/s: the objectives are below the unloaded latency */
        *rate_p = 0;
        if (res_p)
            *res_p = r;
        return TD_OK;
    }
    while (hi - lo > 0.01 * hi) {
        double mid = 0.5 * (lo + hi);
        if ((st = td_plan_at_rate(p, c, L, s, mid, &r)) != TD_OK)
            return st;
        if (r.attainment >= s->min_attainment)
            lo = mid, best = r;
        else
            hi = mid;
    }
    *rate_p = lo;
    if (res_p)
        *res_p = best;
    return TD_OK;
}

td_status_t td_plan_fit(const double *x, const double *y, size_t n, int k, double *coef)
{
    if (k < 1 || k > 4 || n < (size_t)k)
        return td_errorf(TD_ERR_INVALID, "plan: a fit of %d coefficients needs at least that many points (%zu)", k, n);
    if (!td_lsq_fit(x, y, n, k, coef))
        return td_errorf(TD_ERR_INVALID, "plan: the fit's points do not determine %d coefficients", k);
    return TD_OK;
}

/* ---- a decode point measured through a cluster ---- */

td_status_t td_plan_decode_window(const td_plan_stream_t *streams, size_t n, int64_t prompt,
                                  td_plan_decode_point_t *point_p)
{
    double w0 = -INFINITY, w1 = INFINITY;
    for (size_t i = 0; i < n; i++) {
        double last = streams[i].first_s;
        for (uint32_t k = 0; k < streams[i].n_gaps; k++)
            last += streams[i].gaps_s[k];
        w0 = TD_MAX(w0, streams[i].first_s), w1 = TD_MIN(w1, last);
    }
    double *step = malloc((n ? n : 1) * sizeof *step), *ctx = malloc((n ? n : 1) * sizeof *ctx);
    if (!step || !ctx) {
        free(step), free(ctx);
        return td_errorf(TD_ERR_NOMEM, "plan: out of memory for %zu streams", n);
    }
    double gaps = 0, tpm = 0;
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        const td_plan_stream_t *s = &streams[i];
        double f = (double)s->tokens / (double)(s->n_gaps + 1), t = s->first_s, ta = NAN, tb = 0;
        uint32_t ka = 0, kb = 0;
        tpm += f / (double)n;
        for (uint32_t k = 0; k <= s->n_gaps; k++) { /* message k arrives at t */
            if (t >= w0 && t <= w1) {
                if (isnan(ta))
                    ta = t, ka = k;
                tb = t, kb = k;
            }
            if (k < s->n_gaps)
                t += s->gaps_s[k];
        }
        if (isnan(ta) || kb == ka)
            continue;
        gaps += kb - ka;
        step[m] = (tb - ta) / ((double)(kb - ka) * f);
        ctx[m++] = (double)prompt + 0.5 * (double)(ka + kb) * f + 1; /* the step that made the middle token */
    }
    *point_p = (td_plan_decode_point_t){.step_s = NAN, .context = NAN, .gaps_per_stream = n ? gaps / (double)n : 0,
                                        .tokens_per_message = tpm};
    if (m) {
        td_stats_sort(step, m);
        td_stats_sort(ctx, m);
        point_p->step_s = td_stats_percentile(step, m, 50);
        point_p->context = td_stats_percentile(ctx, m, 50);
    }
    free(step), free(ctx);
    return TD_OK;
}
