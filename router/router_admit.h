/*
 * router_admit: what the router refuses at admission, before a request waits for a node,
 * because no node of its model could ever serve it. Pure functions over the registry (time
 * passed in, no I/O); each refusal comes with a message for the client that names the
 * numbers (INVALID_ARGUMENT at the gateway).
 *
 * 1. Token ids: every prompt id must be below the MODEL's vocabulary size, as its live nodes
 *    registered it (Capacity.vocab_size), not the router tokenizer's: a model's vocabulary
 *    is often padded past its tokenizer's. Nodes that registered 0 (older nodes) leave it
 *    unknown, and then the ids are not checked here (the decode node still checks them).
 * 2. Size: prompt + max_tokens must fit the largest live decode node's KV pool, counted as
 *    the decode node counts it (decode/decode_sched.c): it generates
 *    max_new = min(max_tokens, max_seq_len - n_prompt) tokens and holds the KV of every
 *    token it feeds, i.e. all but the last generated one: n_prompt + max_new - 1 positions
 *    in ceil(... / block_size) blocks of its own pool. A lone sequence that fits is served
 *    (others are preempted around it), so a request that fits one decode node alone is
 *    never refused. A prompt not shorter than the model's length is refused as such.
 *    Without a live decode node of the model nothing is known and nothing is refused (the
 *    request waits, as before).
 *
 * Threads: the router's loop thread, with its registry.
 */
#ifndef ROUTER_ADMIT_H
#define ROUTER_ADMIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "router_registry.h"
#include "td_status.h"
#include "td_tokenizer.h"

/* What the live nodes of one model say about it. */
typedef struct router_model_facts {
    int32_t vocab_size;   /* ids 0..vocab_size-1; 0 = unknown (no live node told) */
    int32_t max_seq_len;  /* the smallest a live node registered; 0 = unknown */
    int32_t n_decode;     /* live decode nodes of the model */
} router_model_facts_t;

/* The facts of `model` from its live nodes at now_ns (prefill and decode alike). Never fails. */
void router_admit_model_facts(const router_registry_t *reg, const char *model, int64_t now_ns,
                              router_model_facts_t *facts);

/*
 * Checks ids[0..n) against a vocabulary of `vocab` ids (0 = unknown: TD_OK). A negative id
 * (a uint32 above INT32_MAX on the wire) is out of range too. On TD_ERR_INVALID, `why`
 * names the first bad position, its id and the vocabulary: for ids the client sent
 * ("prompt_ids[3] = 40000 is outside the vocabulary of model default (32000 ids)"), or for
 * ids the router's tokenizer made from a text prompt (from_text: the tokenizer does not
 * belong to the model). Quiet: the caller answers the client.
 */
td_status_t router_admit_check_ids(const int32_t *ids, int32_t n, int32_t vocab, const char *model,
                                   bool from_text, char *why, size_t why_len);

/*
 * KV blocks a decode node whose registered info is `decode` holds at most for a request of
 * n_prompt (>= 1) prompt tokens and max_tokens (>= 1) new ones (see the file comment); -1
 * when the prompt is not shorter than the node's max_seq_len (it refuses such a prompt).
 * max_seq_len 0 (unknown): max_tokens is not capped.
 */
int64_t router_admit_kv_blocks(int32_t n_prompt, int32_t max_tokens, const td_node_info_t *decode);

/*
 * TD_OK when some live decode node of `model` could hold the request on its own, or when
 * none is live (unknown). TD_ERR_RANGE when none could: `why` says so with the numbers
 * ("prompt 600 + max_tokens 2000 = 2600 tokens need 163 KV blocks of 16; the largest
 * decode pool of model default holds 64 blocks (1024 tokens)"), or that the prompt is not
 * shorter than the model's length. Quiet.
 */
td_status_t router_admit_check_size(const router_registry_t *reg, const char *model, int32_t n_prompt,
                                    int32_t max_tokens, int64_t now_ns, char *why, size_t why_len);

/*
 * The size check of a text prompt before it is encoded: its text_bytes make at least
 * td_tokenizer_min_tokens(tok, text_bytes) ids (one more with the model's BOS), and when that
 * many already cannot fit (as router_admit_check_size judges them) the prompt is refused
 * without the cost of encoding it (a 4 MiB prompt of one pre-token is seconds of BPE).
 * TD_OK when it may fit, when nothing is known, or when the tokenizer gives no sound bound
 * (it can shrink text: then the check after encoding decides). TD_ERR_RANGE with `why` as
 * router_admit_check_size writes it, the count given as "at least N". Quiet.
 */
td_status_t router_admit_check_text_size(const router_registry_t *reg, const char *model, const td_tokenizer_t *tok,
                                         size_t text_bytes, int32_t max_tokens, int64_t now_ns, char *why,
                                         size_t why_len);

#endif /* ROUTER_ADMIT_H */
