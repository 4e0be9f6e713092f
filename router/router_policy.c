/*
 * router_policy: pair selection over the registry (see router_policy.h for the rules).
 * Decode candidates (decode and unified nodes) are ranked once per pick; for each in turn
 * the best compatible, not-excluded prefill node is sought, except that a unified node is
 * its own prefill node (the pair {d, d}: admitted, prefilled and decoded there, no KV
 * transfer); prompt block hashes are computed once per block size met. Under the conditional
 * policy the chosen decode node's placement (place_conditional) compares the two estimates
 * of rule 5 for it only: the decode node is chosen as before, then where its prompt goes.
 */
#include "router_policy.h"

#include <stdlib.h>
#include <string.h>

#include "router_admit.h"
#include "td_kv.h"
#include "td_place.h"
#include "td_sched_defaults.h"
#include "td_util.h"

router_policy_config_t router_policy_config_default(void)
{
    return (router_policy_config_t){
        .prefix_weight = 1.0f,
        .prefill_policy = ROUTER_PREFILL_DISAGGREGATED,
        .tpot_objective_s = TD_PLACE_TPOT_OBJECTIVE_S,
        .xfer_fixed_s = 0.002,
        .xfer_bytes_per_s = 1e9,
        .max_hash_blocks = 4096,
        .max_prefill_wait_s = 5.0,
        .assumed_tok_s = TD_PLACE_ASSUMED_TOK_S,
    };
}

td_status_t router_prefill_policy_parse(const char *name, router_prefill_policy_t *p_p)
{
    if (name && !strcmp(name, "disaggregated"))
        *p_p = ROUTER_PREFILL_DISAGGREGATED;
    else if (name && !strcmp(name, "conditional"))
        *p_p = ROUTER_PREFILL_CONDITIONAL;
    else if (name && !strcmp(name, "follow"))
        *p_p = ROUTER_PREFILL_FOLLOW;
    else
        return td_errorf_quiet(TD_ERR_INVALID, "prefill-policy %s: use disaggregated (every prompt of a decode "
                               "node on a prefill node), conditional (each where it is ready sooner: its decode "
                               "node or a prefill node) or follow (conditional, or another decode node when that "
                               "is sooner)", name ? name : "(none)");
    return TD_OK;
}

const char *router_place_reason_name(router_place_reason_t r)
{
    static const char *const names[ROUTER_PLACE_REASONS] = {
        [ROUTER_PLACE_POLICY] = "policy",           [ROUTER_PLACE_UNIFIED] = "unified",
        [ROUTER_PLACE_FASTER] = "faster",           [ROUTER_PLACE_TPOT] = "tpot",
        [ROUTER_PLACE_STEP_BUDGET] = "step_budget", [ROUTER_PLACE_PROMPT_LOGPROBS] = "prompt_logprobs",
        [ROUTER_PLACE_NO_PREFILL] = "no_prefill",   [ROUTER_PLACE_PREFILL_BUSY] = "prefill_busy",
    };
    return (unsigned)r < ROUTER_PLACE_REASONS ? names[r] : "?";
}

typedef struct decode_rank {
    int32_t index;
    int64_t queued;  /* prompt tokens it still prefills itself (a unified node's queue) */
    int32_t running;
    double step_ms;
    int32_t free_blocks;
} decode_rank_t;

static int cmp_rank(const void *a, const void *b)
{
    const decode_rank_t *x = a, *y = b;
    if (x->queued != y->queued)
        return x->queued < y->queued ? -1 : 1;
    if (x->running != y->running)
        return x->running < y->running ? -1 : 1;
    if (x->step_ms != y->step_ms)
        return x->step_ms < y->step_ms ? -1 : 1;
    if (x->free_blocks != y->free_blocks)
        return x->free_blocks > y->free_blocks ? -1 : 1;
    return x->index < y->index ? -1 : 1;
}

static bool excluded(const router_pick_request_t *req, int32_t prefill, int32_t decode)
{
    for (int32_t i = 0; i < req->n_exclude; i++)
        if (req->exclude[i].prefill == prefill && req->exclude[i].decode == decode)
            return true;
    return false;
}

/* A draining node (its heartbeat says so) serves no new request: its running ones finish. */
static bool serves(const router_node_t *n, const char *model, td_node_role_t role)
{
    return n && n->info.role == role && !n->load.draining && !strcmp(n->info.model, model);
}

/* Prompt block hashes for one block size, recomputed only when the size changes. */
typedef struct hash_cache {
    uint64_t *hashes;
    int32_t n, block_size, cap;
} hash_cache_t;

static const uint64_t *hashes_for(hash_cache_t *hc, const router_pick_request_t *req,
                                  int32_t block_size, int32_t *n_p)
{
    if (hc->block_size != block_size) {
        int32_t n_tokens = (int32_t)TD_MIN((int64_t)req->n_prompt, (int64_t)hc->cap * block_size);
        hc->n = td_kv_chain_hashes(req->cache_salt, req->prompt, n_tokens, block_size, hc->hashes);
        hc->block_size = block_size;
    }
    *n_p = hc->n;
    return hc->hashes;
}

/* Best prefill partner of decode node d, or -1 (*n_busy_p counts the compatible ones that
 * were too busy). */
static int32_t best_prefill(const router_registry_t *reg, const router_policy_config_t *cfg,
                            const router_pick_request_t *req, int32_t d, hash_cache_t *hc,
                            int32_t *prefix_blocks_p, double *wait_s_p, int32_t *n_busy_p)
{
    const router_node_t *dn = router_registry_node_const(reg, d);
    int32_t best = -1, best_prefix = 0;
    double best_work = 0, best_wait = 0;
    for (int32_t p = 0; p < router_registry_slots(reg); p++) {
        const router_node_t *pn = router_registry_node_const(reg, p);
        if (!serves(pn, req->model, TD_NODE_ROLE_PREFILL) ||
            !router_registry_is_live(reg, p, req->now_ns) || excluded(req, p, d) ||
            td_kv_layout_compare(&dn->info.layout, &pn->info.layout, NULL, 0) != TD_OK)
            continue;
        int32_t bs = (int32_t)pn->info.layout.block_size, n_hashes;
        const uint64_t *h = hashes_for(hc, req, bs, &n_hashes);
        int32_t matched = router_registry_prefix_match(reg, p, h, n_hashes);
        double work = (double)pn->load.queued_prefill_tokens + req->n_prompt -
                      (double)cfg->prefix_weight * matched * bs;
        double rate = pn->load.prefill_tok_s;
        double wait = TD_MAX(work, 1.0) / (rate > 0 ? rate : TD_MAX(cfg->assumed_tok_s, 1e-3));
        if (pn->load.queued_prefill_tokens > 0 && cfg->max_prefill_wait_s > 0 &&
            (rate <= 0 || wait > cfg->max_prefill_wait_s)) {
            (*n_busy_p)++;
            continue;
        }
        if (best < 0 || work < best_work) {
            best = p;
            best_work = work;
            best_prefix = matched;
            best_wait = wait;
        }
    }
    *prefix_blocks_p = best_prefix;
    *wait_s_p = best_wait;
    return best;
}

/* What decode node d reports for a local prefill of the prompt (rule 5), its chunks' steps within
 * tpot_s (0: unbounded). */
static td_place_local_t local_figures(const router_registry_t *reg, const router_policy_config_t *cfg,
                                      const router_pick_request_t *req, int32_t d, int32_t p, hash_cache_t *hc,
                                      double tpot_s)
{
    const router_node_t *dn = router_registry_node_const(reg, d);
    int32_t bs = (int32_t)dn->info.layout.block_size, n_hashes;
    const uint64_t *h = hashes_for(hc, req, bs, &n_hashes);
    int64_t cached = (int64_t)router_registry_prefix_match(reg, d, h, n_hashes) * bs;
    const router_node_t *pn = p >= 0 ? router_registry_node_const(reg, p) : NULL;
    td_place_local_t l = {
        .queued_tokens = dn->load.queued_prefill_tokens,
        .new_tokens = TD_MAX((int64_t)req->n_prompt - cached, 1),
        .max_step_tokens = dn->info.max_step_tokens,
        .running = dn->load.running_seqs,
        .step_s = dn->load.step_ms * 1e-3,
        .prefill_tok_s = td_place_local_rate(dn->load.prefill_tok_s, pn ? pn->load.prefill_tok_s : 0,
                                             cfg->assumed_tok_s),
        .tpot_objective_s = tpot_s,
        .spread_s = dn->load.step_spread_s,
    };
    return l;
}

/* The TPOT objective a local prefill on decode node d keeps its steps within: the tightest of
 * the request's (or the policy's) and the one d reports for the sequences it runs. */
static double tightest_tpot(const router_registry_t *reg, const router_policy_config_t *cfg,
                            const router_pick_request_t *req, int32_t d)
{
    double own = req->tpot_objective_s > 0 ? req->tpot_objective_s : cfg->tpot_objective_s;
    double node = router_registry_node_const(reg, d)->load.tpot_objective_s;
    return node > 0 && (own <= 0 || node < own) ? node : own;
}

/* The prompt's KV bytes in decode node d's layout: what a transfer to d moves. */
static double prompt_kv_bytes(const router_registry_t *reg, const router_pick_request_t *req, int32_t d)
{
    const td_kv_layout_t *l = &router_registry_node_const(reg, d)->info.layout;
    return (double)TD_DIV_CEIL((int64_t)req->n_prompt, (int64_t)l->block_size) * l->n_layers *
           (double)td_kv_block_bytes(l);
}

/* Remote: the prefill partner's wait and the prompt's KV transfer (rule 5). */
static double remote_estimate(const router_registry_t *reg, const router_policy_config_t *cfg,
                              const router_pick_request_t *req, int32_t d, double wait_s)
{
    return td_place_remote_estimate(wait_s, prompt_kv_bytes(reg, req, d), cfg->xfer_fixed_s, cfg->xfer_bytes_per_s);
}

/*
 * Conditional placement of the prompt for decode node d, its best prefill partner p (-1: none
 * pairs; busy: because each was busy past max_prefill_wait_s) and that partner's wait (rule
 * 5). Writes *pick_p's local, reason and estimates; false when neither side can take the
 * request now (the next decode node is tried).
 */
static bool place_conditional(const router_registry_t *reg, const router_policy_config_t *cfg,
                              const router_pick_request_t *req, int32_t d, int32_t p, bool busy, double wait_s,
                              hash_cache_t *hc, router_pick_t *pick_p)
{
    double remote_s = p >= 0 ? remote_estimate(reg, cfg, req, d, wait_s) : -1;
    td_place_estimate_t e = {.local_s = -1};
    td_place_fit_t fit = TD_PLACE_NO_STEP_ROOM;
    router_place_reason_t no_local = ROUTER_PLACE_FASTER;
    if (req->prompt_logprobs)
        no_local = ROUTER_PLACE_PROMPT_LOGPROBS;
    else if (excluded(req, d, d)) /* tried locally already: a retry goes to a partner */
        no_local = ROUTER_PLACE_FASTER;
    else {
        td_place_local_t l = local_figures(reg, cfg, req, d, p, hc, tightest_tpot(reg, cfg, req, d));
        fit = td_place_local_estimate(&l, &e);
        if (fit == TD_PLACE_NO_STEP_ROOM)
            no_local = ROUTER_PLACE_STEP_BUDGET;
        else if (fit == TD_PLACE_NO_TPOT_ROOM) {
            no_local = ROUTER_PLACE_TPOT;
            if (p < 0 && !busy) { /* no prefill node at all: local whatever the TPOT, at the token a step
                                     the node then feeds (its prefill_cap), not in chunks it would not run */
                l.floor_tokens = TD_DECODE_PAST_OBJECTIVE_CHUNK;
                fit = td_place_local_estimate(&l, &e);
            }
        }
    }
    pick_p->local_s = fit == TD_PLACE_FITS ? e.local_s : -1;
    pick_p->remote_s = remote_s;
    if (fit != TD_PLACE_FITS) {
        pick_p->local = false;
        pick_p->reason = no_local;
        return p >= 0;
    }
    pick_p->local_chunk = (int32_t)TD_MIN(e.chunk, (int64_t)INT32_MAX);
    if (p < 0) { /* local or nothing */
        pick_p->local = true;
        pick_p->reason = busy ? ROUTER_PLACE_PREFILL_BUSY : ROUTER_PLACE_NO_PREFILL;
        return true;
    }
    pick_p->local = td_place_local_wins(e.local_s, remote_s, cfg->ttft_objective_s);
    pick_p->reason = ROUTER_PLACE_FASTER;
    return true;
}

/*
 * Rule 6 (follow): the soonest peer of decode node d (another live decode node that can prefill
 * the prompt within its TPOT objective and send it to d), or -1; its estimate into *peer_s_p and
 * *wait_s_p (its local estimate alone, which sizes the lease). p: d's prefill partner (-1: none),
 * whose rate stands in for a peer that measured none (td_place_local_rate).
 */
static int32_t best_peer(const router_registry_t *reg, const router_policy_config_t *cfg,
                         const router_pick_request_t *req, int32_t d, int32_t p, hash_cache_t *hc, double *peer_s_p,
                         double *wait_s_p)
{
    const router_node_t *dn = router_registry_node_const(reg, d);
    int32_t best = -1;
    double best_s = 0, best_wait = 0;
    if (req->prompt_logprobs)
        return -1; /* only a prefill node computes them */
    for (int32_t e = 0; e < router_registry_slots(reg); e++) {
        const router_node_t *en = router_registry_node_const(reg, e);
        if (e == d || !serves(en, req->model, TD_NODE_ROLE_DECODE) || !router_registry_is_live(reg, e, req->now_ns) ||
            excluded(req, e, d) || td_kv_layout_compare(&dn->info.layout, &en->info.layout, NULL, 0) != TD_OK ||
            TD_DIV_CEIL((int64_t)req->n_prompt, (int64_t)en->info.layout.block_size) > en->load.free_blocks)
            continue;
        td_place_local_t l = local_figures(reg, cfg, req, e, p, hc, tightest_tpot(reg, cfg, req, e));
        double wait = 0, s = td_place_peer_estimate(&l, prompt_kv_bytes(reg, req, d), cfg->xfer_fixed_s,
                                                    cfg->xfer_bytes_per_s, &wait);
        if (s < 0)
            continue; /* its running batch fills its steps, or its pace passes the objective already */
        if (best < 0 || s < best_s) {
            best = e;
            best_s = s;
            best_wait = wait;
        }
    }
    *peer_s_p = best_s;
    *wait_s_p = best_wait;
    return best;
}

/* Why no ranked decode node found a prefill partner: none live, or every live one's KV
 * layout differs (naming the first difference), or every pair was tried. */
static td_status_t no_pair_error(const router_registry_t *reg, const router_pick_request_t *req,
                                 const decode_rank_t *ranks, int32_t n_rank)
{
    char why[160] = "";
    int32_t n_prefill = 0, n_same = 0;
    for (int32_t p = 0; p < router_registry_slots(reg); p++) {
        const router_node_t *pn = router_registry_node_const(reg, p);
        if (!serves(pn, req->model, TD_NODE_ROLE_PREFILL) || !router_registry_is_live(reg, p, req->now_ns))
            continue;
        n_prefill++;
        for (int32_t r = 0; r < n_rank; r++) {
            const router_node_t *dn = router_registry_node_const(reg, ranks[r].index);
            if (td_kv_layout_compare(&dn->info.layout, &pn->info.layout, why[0] ? NULL : why,
                                     why[0] ? 0 : sizeof why) == TD_OK) {
                n_same++;
                break;
            }
        }
    }
    if (n_prefill == 0)
        return td_errorf_quiet(TD_ERR_UNAVAILABLE, "no live prefill node serves model %s", req->model);
    if (n_same == 0)
        return td_errorf_quiet(TD_ERR_UNAVAILABLE,
                               "the KV layouts of model %s's live prefill nodes and its decode nodes "
                               "with room differ (%s): start them with the same --dtype",
                               req->model, why);
    return td_errorf_quiet(TD_ERR_UNAVAILABLE,
                           "every prefill/decode pair of model %s with room was already tried", req->model);
}

td_status_t router_policy_pick(const router_registry_t *reg, const router_policy_config_t *cfg,
                               const router_pick_request_t *req, router_pick_t *pick_p)
{
    if (!req->model || req->n_prompt <= 0 || !req->prompt || req->max_tokens <= 0 ||
        (req->n_exclude > 0 && !req->exclude))
        return td_errorf_quiet(TD_ERR_INVALID, "router policy: a request needs a model, a "
                                               "non-empty prompt and max_tokens >= 1");
    int32_t slots = router_registry_slots(reg);
    decode_rank_t *ranks = malloc((size_t)TD_MAX(slots, 1) * sizeof *ranks);
    hash_cache_t hc = {.cap = TD_MAX(cfg->max_hash_blocks, 0)};
    hc.hashes = malloc((size_t)TD_MAX(hc.cap, 1) * sizeof *hc.hashes);
    if (!ranks || !hc.hashes) {
        free(ranks), free(hc.hashes);
        return td_errorf(TD_ERR_NOMEM, "router policy: out of memory");
    }

    int32_t n_live = 0, n_fit_ever = 0, n_rank = 0;
    for (int32_t d = 0; d < slots; d++) {
        const router_node_t *dn = router_registry_node_const(reg, d);
        if (!(serves(dn, req->model, TD_NODE_ROLE_DECODE) || serves(dn, req->model, TD_NODE_ROLE_UNIFIED)) ||
            !router_registry_is_live(reg, d, req->now_ns))
            continue;
        n_live++;
        int64_t need = router_admit_kv_blocks(req->n_prompt, req->max_tokens, &dn->info);
        if (need < 0 || need > dn->info.capacity_blocks)
            continue; /* the prompt is too long for the model, or the pool too small */
        n_fit_ever++;
        if (need > dn->load.free_blocks)
            continue;
        ranks[n_rank++] = (decode_rank_t){.index = d, .queued = dn->load.queued_prefill_tokens,
                                          .running = dn->load.running_seqs,
                                          .step_ms = dn->load.step_ms,
                                          .free_blocks = dn->load.free_blocks};
    }
    qsort(ranks, (size_t)n_rank, sizeof *ranks, cmp_rank);

    td_status_t st;
    int32_t n_busy = 0;
    for (int32_t r = 0; r < n_rank; r++) {
        int32_t d = ranks[r].index, prefix = 0;
        double wait = 0;
        const router_node_t *dn = router_registry_node_const(reg, d);
        int32_t p;
        router_pick_t pk = {.local_s = -1, .remote_s = -1, .peer_s = -1};
        if (dn->info.role == TD_NODE_ROLE_UNIFIED) {
            if (excluded(req, d, d))
                continue;
            p = d; /* its own prefill node: the prompt waits in its batch, not in a queue */
            pk.local = true;
            pk.reason = ROUTER_PLACE_UNIFIED;
        } else {
            int32_t busy_before = n_busy;
            p = best_prefill(reg, cfg, req, d, &hc, &prefix, &wait, &n_busy);
            if (cfg->prefill_policy == ROUTER_PREFILL_FOLLOW) {
                bool any = place_conditional(reg, cfg, req, d, p, n_busy > busy_before, wait, &hc, &pk);
                double peer_wait = 0, chosen = !any ? -1 : pk.local ? pk.local_s : pk.remote_s;
                int32_t e = best_peer(reg, cfg, req, d, p, &hc, &pk.peer_s, &peer_wait);
                if (e < 0)
                    pk.peer_s = -1;
                if (td_place_peer_wins(pk.peer_s, chosen, any && !pk.local, cfg->ttft_objective_s)) {
                    pk.peer = true;
                    pk.local = false;
                    pk.reason = ROUTER_PLACE_FASTER;
                    p = e;
                    prefix = 0;
                    wait = peer_wait;
                } else if (!any) {
                    continue;
                }
            } else if (cfg->prefill_policy == ROUTER_PREFILL_CONDITIONAL) {
                if (!place_conditional(reg, cfg, req, d, p, n_busy > busy_before, wait, &hc, &pk))
                    continue;
            } else if (p < 0) {
                continue;
            } else {
                pk.reason = ROUTER_PLACE_POLICY;
            }
            if (pk.local) {
                p = d;
                prefix = 0;
                wait = pk.local_s;
            }
        }
        pk.pair = (router_pair_t){.prefill = p, .decode = d};
        pk.blocks_needed = (int32_t)router_admit_kv_blocks(req->n_prompt, req->max_tokens, &dn->info);
        pk.prefix_blocks = prefix;
        pk.prefill_wait_s = dn->info.role == TD_NODE_ROLE_UNIFIED ? 0 : wait;
        pk.tpot_objective_s = req->tpot_objective_s > 0 ? req->tpot_objective_s
                              : cfg->prefill_policy != ROUTER_PREFILL_DISAGGREGATED && dn->info.role == TD_NODE_ROLE_DECODE
                                  ? cfg->tpot_objective_s : 0;
        *pick_p = pk;
        st = TD_OK;
        goto out;
    }
    if (n_live == 0)
        st = td_errorf_quiet(TD_ERR_UNAVAILABLE, "no live decode or unified node serves model %s", req->model);
    else if (n_fit_ever == 0) {
        char why[384];
        router_admit_check_size(reg, req->model, req->n_prompt, req->max_tokens, req->now_ns, why, sizeof why);
        st = td_errorf_quiet(TD_ERR_RANGE, "%s", why);
    }
    else if (n_rank == 0)
        st = td_errorf_quiet(TD_ERR_EXHAUSTED,
                             "no decode node of model %s has room for %d tokens now; retry later",
                             req->model, req->n_prompt + req->max_tokens);
    else if (n_busy > 0)
        st = td_errorf_quiet(TD_ERR_EXHAUSTED,
                             "the prefill nodes of model %s that pair with a decode node with room are busy "
                             "(each would take more than %.1f s to reach this prompt); retry later",
                             req->model, cfg->max_prefill_wait_s);
    else
        st = no_pair_error(reg, req, ranks, n_rank);
out:
    free(ranks);
    free(hc.hashes);
    return st;
}

void router_policy_commit(router_registry_t *reg, const router_pick_request_t *req,
                          const router_pick_t *pick)
{
    router_node_t *dn = router_registry_node(reg, pick->pair.decode);
    if (dn) {
        dn->load.free_blocks = TD_MAX(0, dn->load.free_blocks - pick->blocks_needed);
        dn->load.running_seqs++;
    }
    router_node_t *pn = router_registry_node(reg, pick->pair.prefill);
    if (!pn)
        return;
    pn->load.queued_prefill_tokens += req->n_prompt;
    int32_t bs = (int32_t)pn->info.layout.block_size;
    int32_t cap = router_registry_config(reg)->prefix_hashes;
    int32_t n_tokens = (int32_t)TD_MIN((int64_t)req->n_prompt, (int64_t)cap * bs);
    uint64_t *h = malloc((size_t)TD_MAX(n_tokens / bs, 1) * sizeof *h);
    if (!h)
        return; /* only a scoring hint is lost */
    int32_t n = td_kv_chain_hashes(req->cache_salt, req->prompt, n_tokens, bs, h);
    router_registry_note_prefix(reg, pick->pair.prefill, h, n);
    free(h);
}
