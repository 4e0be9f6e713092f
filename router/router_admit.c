/*
 * router_admit: admission checks by vocabulary and by size (see router_admit.h).
 */
#include "router_admit.h"

#include <stdio.h>
#include <string.h>

#include "td_util.h"

void router_admit_model_facts(const router_registry_t *reg, const char *model, int64_t now_ns,
                              router_model_facts_t *facts)
{
    *facts = (router_model_facts_t){0};
    for (int32_t i = 0; i < router_registry_slots(reg); i++) {
        const router_node_t *n = router_registry_node_const(reg, i);
        if (!n || strcmp(n->info.model, model) || !router_registry_is_live(reg, i, now_ns))
            continue;
        if (td_node_role_decodes(n->info.role))
            facts->n_decode++;
        /* the registry refuses a live node whose vocabulary differs, so any known one is it */
        if (n->info.vocab_size > 0)
            facts->vocab_size = n->info.vocab_size;
        if (n->info.max_seq_len > 0 &&
            (facts->max_seq_len == 0 || n->info.max_seq_len < facts->max_seq_len))
            facts->max_seq_len = n->info.max_seq_len;
    }
}

td_status_t router_admit_check_ids(const int32_t *ids, int32_t n, int32_t vocab, const char *model,
                                   bool from_text, char *why, size_t why_len)
{
    if (vocab <= 0)
        return TD_OK;
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] >= 0 && ids[i] < vocab)
            continue;
        if (from_text)
            snprintf(why, why_len,
                     "the router's tokenizer turned the prompt into id %u at position %d, outside the "
                     "vocabulary of model %s (%d ids): the router's --tokenizer does not belong to the model",
                     (uint32_t)ids[i], i, model, vocab);
        else
            snprintf(why, why_len, "prompt_ids[%d] = %u is outside the vocabulary of model %s (%d ids)", i,
                     (uint32_t)ids[i], model, vocab);
        return td_errorf_quiet(TD_ERR_INVALID, "%s", why);
    }
    return TD_OK;
}

/* Tokens the request may end with on a node of max_seq_len msl (0 = unknown): the prompt
 * and the new tokens, capped by the model's length as decode_sched caps them. */
static int64_t max_new_tokens(int32_t n_prompt, int32_t max_tokens, int32_t msl)
{
    return msl > 0 ? TD_MIN((int64_t)max_tokens, (int64_t)msl - n_prompt) : max_tokens;
}

int64_t router_admit_kv_blocks(int32_t n_prompt, int32_t max_tokens, const td_node_info_t *decode)
{
    int32_t msl = decode->max_seq_len;
    if (msl > 0 && n_prompt >= msl)
        return -1;
    /* every token fed keeps its KV: the prompt and all generated tokens but the last */
    int64_t kv_tokens = (int64_t)n_prompt + max_new_tokens(n_prompt, max_tokens, msl) - 1;
    return TD_DIV_CEIL(kv_tokens, (int64_t)decode->layout.block_size);
}

/* router_admit_check_size, with n_prompt a lower bound when at_least (the messages say so). */
static td_status_t check_size(const router_registry_t *reg, const char *model, int32_t n_prompt, int32_t max_tokens,
                              int64_t now_ns, bool at_least, char *why, size_t why_len)
{
    const char *al = at_least ? "at least " : "";
    if (n_prompt < 1 || max_tokens < 1)
        return TD_OK; /* not a request the size can judge; its own checks refuse it */
    const td_node_info_t *largest = NULL; /* of the nodes the prompt is short enough for */
    int32_t n_live = 0, shortest_len = 0;
    for (int32_t i = 0; i < router_registry_slots(reg); i++) {
        const router_node_t *n = router_registry_node_const(reg, i);
        if (!n || !td_node_role_decodes(n->info.role) || strcmp(n->info.model, model) ||
            !router_registry_is_live(reg, i, now_ns))
            continue;
        n_live++;
        int64_t blocks = router_admit_kv_blocks(n_prompt, max_tokens, &n->info);
        if (blocks >= 0 && blocks <= n->info.capacity_blocks)
            return TD_OK;
        if (blocks < 0) {
            if (!shortest_len || n->info.max_seq_len < shortest_len)
                shortest_len = n->info.max_seq_len;
            continue;
        }
        if (!largest || (int64_t)n->info.capacity_blocks * n->info.layout.block_size >
                            (int64_t)largest->capacity_blocks * largest->layout.block_size)
            largest = &n->info;
    }
    if (n_live == 0)
        return TD_OK;
    if (!largest) {
        snprintf(why, why_len,
                 "the prompt has %s%d tokens; model %s takes at most %d (its length is %d tokens, prompt "
                 "and output together)",
                 al, n_prompt, model, shortest_len - 1, shortest_len);
        return td_errorf_quiet(TD_ERR_RANGE, "%s", why);
    }
    int32_t bs = (int32_t)largest->layout.block_size;
    int64_t max_new = max_new_tokens(n_prompt, max_tokens, largest->max_seq_len);
    int64_t total = (int64_t)n_prompt + max_new;
    int64_t blocks = router_admit_kv_blocks(n_prompt, max_tokens, largest);
    char capped[96] = "", last[48] = "";
    if (max_new < max_tokens)
        snprintf(capped, sizeof capped, " (capped at %lld by the model's length %d)", (long long)max_new,
                 largest->max_seq_len);
    if (TD_DIV_CEIL(total, (int64_t)bs) != blocks)
        snprintf(last, sizeof last, " (the last token's KV is never stored)");
    snprintf(why, why_len,
             "prompt %s%d + max_tokens %d%s = %lld tokens need %lld KV blocks of %d%s; the largest decode "
             "pool of model %s holds %d blocks (%lld tokens)",
             al, n_prompt, max_tokens, capped, (long long)total, (long long)blocks, bs, last, model,
             largest->capacity_blocks, (long long)largest->capacity_blocks * bs);
    return td_errorf_quiet(TD_ERR_RANGE, "%s", why);
}

td_status_t router_admit_check_size(const router_registry_t *reg, const char *model, int32_t n_prompt,
                                    int32_t max_tokens, int64_t now_ns, char *why, size_t why_len)
{
    return check_size(reg, model, n_prompt, max_tokens, now_ns, false, why, why_len);
}

td_status_t router_admit_check_text_size(const router_registry_t *reg, const char *model, const td_tokenizer_t *tok,
                                         size_t text_bytes, int32_t max_tokens, int64_t now_ns, char *why,
                                         size_t why_len)
{
    size_t min = td_tokenizer_min_tokens(tok, text_bytes);
    if (!min)
        return TD_OK; /* no sound bound (a normalizer that can shrink text), or no text */
    if (td_tokenizer_add_bos(tok) && td_tokenizer_bos_id(tok) >= 0)
        min++;
    return check_size(reg, model, (int32_t)TD_MIN(min, (size_t)INT32_MAX), max_tokens, now_ns, true, why, why_len);
}
