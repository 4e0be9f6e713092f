/*
 * test_router_admit: what the router refuses at admission (router_admit) on constructed
 * registries: prompt ids against the MODEL's vocabulary as its live nodes registered it,
 * the KV blocks a request holds on a decode node counted exactly as decode_sched counts
 * them (a request that fits is never refused, at the block boundary too), the refusal
 * messages with their numbers, and the registry refusing a node whose vocabulary differs
 * from its model's live nodes.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "router_admit.h"
#include "router_policy.h"
#include "router_registry.h"
#include "td_kv.h"
#include "td_test_models.h"

#define SEC 1000000000ll

typedef struct node_spec {
    const char *id;
    td_node_role_t role;
    const char *model;
    int32_t capacity;   /* KV blocks */
    int32_t vocab;      /* 0 = an older node that does not tell */
    int32_t max_seq_len;
} node_spec_t;

static td_node_info_t info_of(const node_spec_t *n)
{
    td_node_info_t info = {.role = n->role, .capacity_blocks = n->capacity, .max_batch = 64,
                               .vocab_size = n->vocab, .max_seq_len = n->max_seq_len};
    info.layout = (td_kv_layout_t){.model_fingerprint = 0x1234, .dtype = TD_F32, .block_size = 16,
                                   .n_layers = 4, .n_kv_heads = 4, .head_dim = 8,
                                   .version = TD_KV_LAYOUT_VERSION};
    snprintf(info.id, sizeof info.id, "%s", n->id);
    snprintf(info.model, sizeof info.model, "%s", n->model ? n->model : "default");
    snprintf(info.address, sizeof info.address, "127.0.0.1:1");
    return info;
}

static td_status_t join_at(router_registry_t *reg, const node_spec_t *n, int64_t now)
{
    td_node_info_t info = info_of(n);
    return router_registry_join(reg, &info, now, NULL);
}

static void join(router_registry_t *reg, const node_spec_t *n)
{
    cr_assert_eq(join_at(reg, n, 0), TD_OK, "%s: %s", n->id, td_last_error());
}

static router_registry_t *mkreg(void)
{
    router_registry_t *reg;
    router_registry_config_t c = router_registry_config_default();
    c.heartbeat_timeout_ns = 3 * SEC;
    cr_assert_eq(router_registry_create(&c, &reg), TD_OK);
    return reg;
}

Test(router_admit, ids_are_checked_against_the_models_vocabulary_with_the_position_named)
{
    int32_t ids[] = {1, 300, 31999, 40000, 5};
    char why[256] = "";
    cr_assert_eq(router_admit_check_ids(ids, 3, 32000, "default", false, why, sizeof why), TD_OK,
                 "ids below the model's vocabulary pass, whatever the tokenizer's size");
    cr_assert_eq(router_admit_check_ids(ids, 5, 32000, "default", false, why, sizeof why), TD_ERR_INVALID);
    cr_assert_str_eq(why, "prompt_ids[3] = 40000 is outside the vocabulary of model default (32000 ids)");
    int32_t edge[] = {511, 512};
    cr_assert_eq(router_admit_check_ids(edge, 1, 512, "m", false, why, sizeof why), TD_OK);
    cr_assert_eq(router_admit_check_ids(edge, 2, 512, "m", false, why, sizeof why), TD_ERR_INVALID,
                 "the vocabulary size itself is outside");
    cr_assert_str_eq(why, "prompt_ids[1] = 512 is outside the vocabulary of model m (512 ids)");
    int32_t neg[] = {(int32_t)3000000000u};
    cr_assert_eq(router_admit_check_ids(neg, 1, 512, "m", false, why, sizeof why), TD_ERR_INVALID);
    cr_assert(strstr(why, "prompt_ids[0] = 3000000000 "), "a wire id above INT32_MAX is named as sent: %s", why);
    cr_assert_eq(router_admit_check_ids(ids, 5, 0, "default", false, why, sizeof why), TD_OK,
                 "an unknown vocabulary (older nodes, none live) checks nothing");
}

Test(router_admit, ids_made_by_the_tokenizer_are_a_different_fault)
{
    int32_t ids[] = {1, 600};
    char why[256] = "";
    cr_assert_eq(router_admit_check_ids(ids, 2, 512, "default", true, why, sizeof why), TD_ERR_INVALID);
    cr_assert(strstr(why, "tokenizer") && strstr(why, "id 600 at position 1") && strstr(why, "(512 ids)"),
              "the message blames the router's tokenizer: %s", why);
    cr_assert_null(strstr(why, "prompt_ids"), "not the client's ids: %s", why);
}

Test(router_admit, model_facts_come_from_live_nodes_of_the_model_only)
{
    router_registry_t *reg = mkreg();
    router_model_facts_t f;
    router_admit_model_facts(reg, "default", 0, &f);
    cr_assert_eq(f.vocab_size, 0);
    cr_assert_eq(f.n_decode, 0);
    join(reg, &(node_spec_t){"old", TD_NODE_ROLE_PREFILL, NULL, 100, 0, 0});
    router_admit_model_facts(reg, "default", 0, &f);
    cr_assert_eq(f.vocab_size, 0, "a node that registered vocab 0 leaves it unknown");
    join(reg, &(node_spec_t){"d0", TD_NODE_ROLE_DECODE, NULL, 100, 32000, 2048});
    join(reg, &(node_spec_t){"p0", TD_NODE_ROLE_PREFILL, NULL, 100, 32000, 1024});
    join(reg, &(node_spec_t){"x", TD_NODE_ROLE_DECODE, "other", 100, 512, 64});
    router_admit_model_facts(reg, "default", SEC, &f);
    cr_assert_eq(f.vocab_size, 32000);
    cr_assert_eq(f.max_seq_len, 1024, "the shortest length a live node registered");
    cr_assert_eq(f.n_decode, 1);
    router_admit_model_facts(reg, "default", 10 * SEC, &f);
    cr_assert_eq(f.vocab_size, 0, "nodes silent past the timeout say nothing");
    router_registry_destroy(reg);
}

Test(router_admit, a_node_whose_vocabulary_differs_from_its_models_live_nodes_is_refused)
{
    router_registry_t *reg = mkreg();
    join(reg, &(node_spec_t){"d0", TD_NODE_ROLE_DECODE, NULL, 100, 32000, 0});
    join(reg, &(node_spec_t){"p0", TD_NODE_ROLE_PREFILL, NULL, 100, 32000, 0});
    cr_assert_eq(join_at(reg, &(node_spec_t){"p1", TD_NODE_ROLE_PREFILL, NULL, 100, 512, 0}, 0), TD_ERR_INVALID);
    const char *msg = td_last_error();
    cr_assert(strstr(msg, "p1") && strstr(msg, "512") && strstr(msg, "32000") && strstr(msg, "model default"),
              "the message names the node, both sizes and the model: %s", msg);
    cr_assert_eq(router_registry_find(reg, "p1"), -1);
    join(reg, &(node_spec_t){"q0", TD_NODE_ROLE_PREFILL, "other", 100, 512, 0});     /* another model */
    join(reg, &(node_spec_t){"old", TD_NODE_ROLE_PREFILL, NULL, 100, 0, 0});         /* unknown */
    cr_assert_eq(join_at(reg, &(node_spec_t){"d0", TD_NODE_ROLE_DECODE, NULL, 100, 32000, 0}, 0), TD_ERR_BUSY,
                 "a live node's id is its own");
    /* once the others went silent, a node of the new size is the model's */
    cr_assert_eq(join_at(reg, &(node_spec_t){"p1", TD_NODE_ROLE_PREFILL, NULL, 100, 512, 0}, 10 * SEC), TD_OK,
                 "%s", td_last_error());
    router_registry_destroy(reg);
}

Test(router_admit, kv_blocks_count_what_the_decode_node_holds)
{
    td_node_info_t d = info_of(&(node_spec_t){"d0", TD_NODE_ROLE_DECODE, NULL, 64, 512, 0});
    /* prompt and every generated token but the last are fed, and keep their KV */
    cr_assert_eq(router_admit_kv_blocks(100, 60, &d), 10);  /* 159 positions */
    cr_assert_eq(router_admit_kv_blocks(1, 1024, &d), 64);  /* 1024 positions: 64 blocks, not 65 */
    cr_assert_eq(router_admit_kv_blocks(16, 1, &d), 1);     /* the prompt's lease only */
    cr_assert_eq(router_admit_kv_blocks(1, 2147483647, &d), 134217728);
    d.max_seq_len = 256; /* the decode node stops at the model's length */
    cr_assert_eq(router_admit_kv_blocks(100, 2000, &d), 16); /* 100 + 156 - 1 = 255 positions */
    cr_assert_eq(router_admit_kv_blocks(255, 9, &d), 16);
    cr_assert_eq(router_admit_kv_blocks(256, 1, &d), -1, "a prompt as long as the model is refused there");
}

Test(router_admit, a_request_no_decode_pool_can_hold_is_refused_with_its_numbers)
{
    router_registry_t *reg = mkreg();
    char why[384] = "";
    cr_assert_eq(router_admit_check_size(reg, "default", 600, 2000, 0, why, sizeof why), TD_OK,
                 "no live decode node: nothing known, nothing refused (the request waits)");
    join(reg, &(node_spec_t){"p0", TD_NODE_ROLE_PREFILL, NULL, 4096, 512, 0});
    join(reg, &(node_spec_t){"small", TD_NODE_ROLE_DECODE, NULL, 16, 512, 0});
    join(reg, &(node_spec_t){"d0", TD_NODE_ROLE_DECODE, NULL, 64, 512, 0});
    join(reg, &(node_spec_t){"x", TD_NODE_ROLE_DECODE, "other", 4096, 512, 0});
    cr_assert_eq(router_admit_check_size(reg, "default", 600, 2000, 0, why, sizeof why), TD_ERR_RANGE);
    cr_assert_str_eq(why, "prompt 600 + max_tokens 2000 = 2600 tokens need 163 KV blocks of 16; the largest "
                          "decode pool of model default holds 64 blocks (1024 tokens)");
    /* the boundary: 1024 positions fit 64 blocks; one more does not */
    cr_assert_eq(router_admit_check_size(reg, "default", 600, 425, 0, why, sizeof why), TD_OK);
    cr_assert_eq(router_admit_check_size(reg, "default", 1, 1024, 0, why, sizeof why), TD_OK,
                 "1025 tokens hold 1024 positions: it fits and must not be refused");
    cr_assert_eq(router_admit_check_size(reg, "default", 600, 426, 0, why, sizeof why), TD_ERR_RANGE);
    cr_assert_eq(router_admit_check_size(reg, "default", 2, 1024, 0, why, sizeof why), TD_ERR_RANGE);
    cr_assert(strstr(why, "= 1026 tokens need 65 KV blocks of 16; "), "%s", why);
    cr_assert_eq(router_admit_check_size(reg, "default", 17, 1024, 0, why, sizeof why), TD_ERR_RANGE);
    cr_assert(strstr(why, "= 1041 tokens need 65 KV blocks of 16 (the last token's KV is never stored)"),
              "1040 positions, 65 blocks, where 1041 / 16 would say 66: %s", why);
    /* the policy says the same: it never picks what admission refuses, nor refuses what it admits */
    router_policy_config_t pc = router_policy_config_default();
    static int32_t prompt[600];
    for (int i = 0; i < 600; i++)
        prompt[i] = 1 + i % 500;
    router_pick_request_t rq = {.model = "default", .prompt = prompt, .n_prompt = 600, .max_tokens = 2000};
    router_pick_t pk;
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_RANGE);
    cr_assert(strstr(td_last_error(), "need 163 KV blocks of 16"), "%s", td_last_error());
    rq.max_tokens = 425;
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_OK, "%s", td_last_error());
    cr_assert_eq(pk.blocks_needed, 64);
    router_registry_destroy(reg);
}

Test(router_admit, max_tokens_is_capped_by_the_models_length_as_the_decode_node_caps_it)
{
    router_registry_t *reg = mkreg();
    char why[384] = "";
    join(reg, &(node_spec_t){"d0", TD_NODE_ROLE_DECODE, NULL, 10, 512, 256});
    cr_assert_eq(router_admit_check_size(reg, "default", 100, 2000, 0, why, sizeof why), TD_ERR_RANGE);
    cr_assert_str_eq(why, "prompt 100 + max_tokens 2000 (capped at 156 by the model's length 256) = 256 tokens "
                          "need 16 KV blocks of 16; the largest decode pool of model default holds 10 blocks "
                          "(160 tokens)");
    join(reg, &(node_spec_t){"d1", TD_NODE_ROLE_DECODE, NULL, 16, 512, 256});
    cr_assert_eq(router_admit_check_size(reg, "default", 100, 2000, 0, why, sizeof why), TD_OK,
                 "a pool of the model's whole length takes any max_tokens");
    cr_assert_eq(router_admit_check_size(reg, "default", 256, 1, 0, why, sizeof why), TD_ERR_RANGE);
    cr_assert_str_eq(why, "the prompt has 256 tokens; model default takes at most 255 (its length is 256 tokens, "
                          "prompt and output together)");
    router_registry_destroy(reg);
}

/* A text prompt whose bytes already make more tokens than the model takes is refused before
 * it is encoded, with the message the check after encoding gives, the count "at least" the
 * bound; one that may fit passes, and a tokenizer that can shrink text (no bound) refuses
 * nothing here, however long the text. */
Test(router_admit, a_text_prompt_too_long_for_any_node_is_refused_before_encoding)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/tokenizer/bytelevel", TD_SOURCE_DIR);
    td_tokenizer_t *tok;
    cr_assert_eq(td_tokenizer_load(path, &tok), TD_OK, "%s", td_last_error());
    size_t L = td_tokenizer_max_token_bytes(tok);
    cr_assert_gt(L, 0);
    int32_t bos = td_tokenizer_add_bos(tok) && td_tokenizer_bos_id(tok) >= 0;
    router_registry_t *reg = mkreg();
    char why[384] = "";
    cr_assert_eq(router_admit_check_text_size(reg, "default", tok, 1u << 30, 16, 0, why, sizeof why), TD_OK,
                 "no live decode node: nothing known, nothing refused");
    join(reg, &(node_spec_t){"d0", TD_NODE_ROLE_DECODE, NULL, 4096, 258, 256});
    /* 255 tokens at least (with the BOS): may fit a model of 256 */
    size_t fits = (255 - (size_t)bos) * L;
    cr_assert_eq(router_admit_check_text_size(reg, "default", tok, fits, 1, 0, why, sizeof why), TD_OK, "%s", why);
    cr_assert_eq(router_admit_check_text_size(reg, "default", tok, fits + 1, 1, 0, why, sizeof why), TD_ERR_RANGE);
    char want[384];
    snprintf(want, sizeof want, "the prompt has at least 256 tokens; model default takes at most 255 (its length is "
             "256 tokens, prompt and output together)");
    cr_assert_str_eq(why, want);
    cr_assert_eq(router_admit_check_text_size(reg, "default", tok, 0, 1, 0, why, sizeof why), TD_OK);
    td_tokenizer_destroy(tok);
    /* Qwen3 (NFC) gives no bound: a 1 GiB prompt is left to the check after encoding */
    snprintf(path, sizeof path, "%s/tokenizers/qwen3/tokenizer.json", td_test_models_dir());
    if (td_tokenizer_load(path, &tok) == TD_OK) {
        cr_assert_eq(router_admit_check_text_size(reg, "default", tok, 1u << 30, 1, 0, why, sizeof why), TD_OK);
        td_tokenizer_destroy(tok);
    }
    router_registry_destroy(reg);
}
