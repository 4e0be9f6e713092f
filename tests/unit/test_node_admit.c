/*
 * Tests of the nodes' edges: what arrives over the wire (an AdmitRequest and its kv-ready at
 * a decode node, a PrefillRequest at a prefill node) is checked once, there
 * (decode_admit.c, prefill_admit.c), and the schedulers behind take it as valid. So the
 * refusals of malformed requests are asserted here: each ends as INVALID_ARGUMENT (or false)
 * with a message naming what is wrong, and nothing is left allocated. No model: the checks
 * need only the model's length and vocabulary.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decode_admit.h"
#include "prefill_admit.h"

#define VOCAB 512
#define MAX_SEQ 256

static const td_model_config_t mc = {.vocab_size = VOCAB, .max_seq_len = MAX_SEQ};
/* a model long enough that a prompt can be longer than TD_LOGPROBS_MAX_PROMPT */
static const td_model_config_t mc_long = {.vocab_size = VOCAB, .max_seq_len = TD_LOGPROBS_MAX_PROMPT + 64};

/* ---- the decode node: AdmitRequest ------------------------------------------------------ */

static uint32_t ids[TD_LOGPROBS_MAX_PROMPT + 8];

/* A well-formed AdmitRequest of n prompt ids, max_tokens 8. */
static Tandem__Control__V1__AdmitRequest admit_of(size_t n)
{
    Tandem__Control__V1__AdmitRequest r = TANDEM__CONTROL__V1__ADMIT_REQUEST__INIT;
    for (size_t i = 0; i < n; i++)
        ids[i] = (uint32_t)(3 + i % 500);
    r.request_id = "r1";
    r.prompt_ids = ids;
    r.n_prompt_ids = n;
    r.prompt_tokens = (uint32_t)n;
    r.max_tokens = 8;
    return r;
}

/* r is refused by decode_admit_check or decode_admit_read with a message containing `says`. */
static void admit_refused(const Tandem__Control__V1__AdmitRequest *r, bool unified, const char *says)
{
    char why[256] = "";
    decode_admit_t *a = NULL;
    if (decode_admit_check(r, &mc, why, sizeof why)) {
        cr_assert_eq(decode_admit_read(r, &mc, unified, &a, why, sizeof why), TD_GRPC_INVALID_ARGUMENT,
                     "accepted, want a refusal naming '%s'", says);
        cr_assert_null(a);
    }
    cr_assert(strstr(why, says), "'%s' does not say '%s'", why, says);
}

Test(node_admit, decode_reads_a_good_admit)
{
    Tandem__Control__V1__AdmitRequest r = admit_of(5);
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    Tandem__V1__LogprobsRequest lp = TANDEM__V1__LOGPROBS_REQUEST__INIT;
    uint32_t stop[2] = {7, 9}, replay[2] = {11, 12};
    sp.temperature = 0.7f;
    sp.seed = 42;
    lp.top_logprobs = TD_LOGPROBS_MAX_TOP;
    r.sampling = &sp;
    r.logprobs = &lp;
    r.stop_ids = stop;
    r.n_stop_ids = 2;
    r.replay_ids = replay;
    r.n_replay_ids = 2;
    char why[256] = "";
    decode_admit_t *a = NULL;
    cr_assert(decode_admit_check(&r, &mc, why, sizeof why), "%s", why);
    cr_assert_eq(decode_admit_read(&r, &mc, false, &a, why, sizeof why), TD_GRPC_OK, "%s", why);
    cr_assert(a->n_prompt == 5 && a->prompt[4] == 7 && a->max_tokens == 8);
    cr_assert(a->sampling.temperature == 0.7f && a->sampling.seed == 42 && a->sampling.top_p == 1.0f);
    cr_assert(a->logprobs.on && a->logprobs.top == TD_LOGPROBS_MAX_TOP && !a->logprobs.prompt);
    cr_assert(a->n_stop_ids == 2 && a->stop_ids[1] == 9 && a->n_replay == 2 && a->replay[1] == 12);
    cr_assert_not(a->local, "a decode node's admission waits for a transfer unless asked otherwise");
    decode_admit_free(a);
    /* local_prefill: the decode node prefills it (a unified node always does) */
    r.local_prefill = true;
    cr_assert_eq(decode_admit_read(&r, &mc, false, &a, why, sizeof why), TD_GRPC_OK, "%s", why);
    cr_assert(a->local);
    decode_admit_free(a);
    r.local_prefill = false;
    cr_assert_eq(decode_admit_read(&r, &mc, true, &a, why, sizeof why), TD_GRPC_OK, "%s", why);
    cr_assert(a->local);
    decode_admit_free(a);
    cr_assert_eq(decode_admit_read(&r, &mc, false, &a, why, sizeof why), TD_GRPC_OK, "%s", why);
    cr_assert_null(a->grammar, "no grammar sent, none read");
    decode_admit_free(a);
    /* the grammar is copied (the message is freed after the call); empty means none */
    char gbnf[] = "root ::= \"a\"+";
    r.grammar = gbnf;
    cr_assert_eq(decode_admit_read(&r, &mc, false, &a, why, sizeof why), TD_GRPC_OK, "%s", why);
    gbnf[0] = 'X';
    cr_assert_str_eq(a->grammar, "root ::= \"a\"+");
    decode_admit_free(a);
    r.grammar = "";
    cr_assert_eq(decode_admit_read(&r, &mc, false, &a, why, sizeof why), TD_GRPC_OK, "%s", why);
    cr_assert_null(a->grammar);
    decode_admit_free(a);
}

/* What decode_sched_admit refused before it took its requests as valid, refused here. */
Test(node_admit, decode_refuses_malformed_admits)
{
    Tandem__Control__V1__AdmitRequest r = admit_of(5);
    r.max_tokens = 0;
    admit_refused(&r, false, "max_tokens 0");
    r = admit_of(MAX_SEQ); /* a prompt of the model's length */
    admit_refused(&r, false, "prompt_ids holds 256 ids");
    r = admit_of(0);
    admit_refused(&r, false, "prompt_ids holds 0 ids");
    r = admit_of(5);
    r.prompt_tokens = 6;
    admit_refused(&r, false, "prompt_tokens 6");
    r = admit_of(5);
    ids[2] = VOCAB; /* an id outside the vocabulary */
    admit_refused(&r, false, "prompt_ids[2] = 512");
    r = admit_of(5);
    uint32_t replay[3] = {1, 2, VOCAB + 7};
    r.replay_ids = replay;
    r.n_replay_ids = 3;
    admit_refused(&r, false, "replay_ids[2] = 519");
    r.max_tokens = 3; /* a replay that leaves nothing to generate */
    admit_refused(&r, false, "3 replay_ids, fewer than max_tokens 3");
    r = admit_of(5);
    uint32_t stop[DECODE_MAX_STOP_IDS + 1] = {0};
    r.stop_ids = stop;
    r.n_stop_ids = DECODE_MAX_STOP_IDS + 1;
    admit_refused(&r, false, "33 stop_ids");
    r = admit_of(5);
    Tandem__V1__LogprobsRequest lp = TANDEM__V1__LOGPROBS_REQUEST__INIT;
    lp.top_logprobs = TD_LOGPROBS_MAX_TOP + 1;
    r.logprobs = &lp;
    admit_refused(&r, false, "top_logprobs 21");
    lp.top_logprobs = 2;
    lp.prompt = true;
    admit_refused(&r, true, "unified node");
    r.local_prefill = true; /* a decode node asked to prefill it itself computes no prompt rows either */
    admit_refused(&r, false, "local_prefill");
    r = admit_of(5);
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    r.sampling = &sp;
    sp.temperature = NAN;
    admit_refused(&r, false, "temperature");
    sp.temperature = 0;
    sp.top_p = -0.5f;
    admit_refused(&r, false, "top_p -0.5");
    sp.top_p = 0;
    sp.presence_penalty = 3;
    admit_refused(&r, false, "presence_penalty 3");
    sp.presence_penalty = 0;
    uint32_t bias_ids[2] = {5, VOCAB}; /* a logit bias past this node's vocabulary */
    float bias[2] = {1, -100};
    sp.logit_bias_ids = bias_ids;
    sp.n_logit_bias_ids = 2;
    sp.logit_bias = bias;
    sp.n_logit_bias = 2;
    admit_refused(&r, false, "logit_bias token 512 is outside the vocabulary (512 ids)");
    sp.n_logit_bias = 1; /* one bias short */
    admit_refused(&r, false, "differ in length");
}

/* The kv-ready that brings an admission's KV comes from the prefill node over the data plane:
 * its token count and its first token are checked before the scheduler sees them. */
Test(node_admit, decode_checks_kv_ready)
{
    decode_admit_t a = {.n_prompt = 5};
    int32_t blocks[1] = {0};
    td_xfer_ready_t r = {.lease_id = 1, .blocks = blocks, .n_blocks = 1, .n_tokens = 5, .first_token = 9};
    char why[160] = "";
    cr_assert(decode_admit_ready_check(&a, &r, &mc, why, sizeof why), "%s", why);
    r.first_token = VOCAB;
    cr_assert_not(decode_admit_ready_check(&a, &r, &mc, why, sizeof why));
    cr_assert(strstr(why, "first token 512 is outside the vocabulary"), "%s", why);
    r.first_token = -1;
    cr_assert_not(decode_admit_ready_check(&a, &r, &mc, why, sizeof why));
    r.first_token = 9;
    r.n_tokens = 4;
    cr_assert_not(decode_admit_ready_check(&a, &r, &mc, why, sizeof why));
    cr_assert(strstr(why, "kv-ready with 4 tokens, prompt has 5"), "%s", why);
}

/* ---- the prefill node: PrefillRequest --------------------------------------------------- */

static uint32_t blocks_of[TD_LOGPROBS_MAX_PROMPT / 16 + 8];

/* A well-formed PrefillRequest of n tokens and the blocks they need (16 a block). */
static Tandem__Control__V1__PrefillRequest prefill_of(size_t n)
{
    Tandem__Control__V1__PrefillRequest r = TANDEM__CONTROL__V1__PREFILL_REQUEST__INIT;
    for (size_t i = 0; i < n; i++)
        ids[i] = (uint32_t)(3 + i % 500);
    r.request_id = "p1";
    r.tokens = ids;
    r.n_tokens = n;
    r.block_ids = blocks_of;
    r.n_block_ids = (n + 15) / 16;
    return r;
}

static void prefill_refused(const Tandem__Control__V1__PrefillRequest *r, const td_model_config_t *m,
                            const char *says)
{
    char why[256] = "";
    prefill_admit_t a;
    cr_assert_eq(prefill_admit_read(r, m, 16, &a, why, sizeof why), TD_GRPC_INVALID_ARGUMENT,
                 "accepted, want a refusal naming '%s'", says);
    cr_assert(!a.tokens && !a.dst_blocks, "a refused request left its arrays");
    cr_assert(strstr(why, says), "'%s' does not say '%s'", why, says);
}

Test(node_admit, prefill_reads_a_good_request)
{
    Tandem__Control__V1__PrefillRequest r = prefill_of(20);
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    Tandem__V1__LogprobsRequest lp = TANDEM__V1__LOGPROBS_REQUEST__INIT;
    sp.top_k = 5;
    lp.top_logprobs = 3;
    lp.prompt = true;
    r.sampling = &sp;
    r.logprobs = &lp;
    blocks_of[1] = 77;
    char why[256] = "";
    prefill_admit_t a;
    cr_assert_eq(prefill_admit_read(&r, &mc, 16, &a, why, sizeof why), TD_GRPC_OK, "%s", why);
    cr_assert(a.n_tokens == 20 && a.tokens[19] == 22 && a.n_dst == 2 && a.dst_blocks[1] == 77);
    cr_assert(a.sampling.top_k == 5 && a.logprobs.on && a.logprobs.top == 3 && a.logprobs.prompt);
    cr_assert_null(a.grammar);
    prefill_admit_free(&a);
    char gbnf[] = "root ::= [0-9]+"; /* copied: the message is freed after the call */
    r.grammar = gbnf;
    cr_assert_eq(prefill_admit_read(&r, &mc, 16, &a, why, sizeof why), TD_GRPC_OK, "%s", why);
    gbnf[0] = 'X';
    cr_assert_str_eq(a.grammar, "root ::= [0-9]+");
    prefill_admit_free(&a);
    cr_assert_null(a.tokens);
    cr_assert_null(a.grammar);
    prefill_admit_free(&a); /* twice, and NULL: no-ops */
    prefill_admit_free(NULL);
}

/* What prefill_sched_submit refused before it took its requests as valid, refused here. */
Test(node_admit, prefill_refuses_malformed_requests)
{
    Tandem__Control__V1__PrefillRequest r = prefill_of(0);
    prefill_refused(&r, &mc, "0 tokens (1 .. 255)");
    r = prefill_of(MAX_SEQ); /* a prompt of the model's length */
    prefill_refused(&r, &mc, "256 tokens (1 .. 255)");
    r = prefill_of(40);
    r.n_block_ids = 2; /* 40 tokens need 3 blocks of 16 */
    prefill_refused(&r, &mc, "ceil(tokens / 16)");
    r = prefill_of(40);
    ids[39] = VOCAB + 100;
    prefill_refused(&r, &mc, "token 612 at 39 is outside the vocabulary");
    r = prefill_of(3);
    Tandem__V1__LogprobsRequest lp = TANDEM__V1__LOGPROBS_REQUEST__INIT;
    lp.top_logprobs = TD_LOGPROBS_MAX_TOP + 1;
    r.logprobs = &lp;
    prefill_refused(&r, &mc, "top_logprobs 21");
    r = prefill_of(TD_LOGPROBS_MAX_PROMPT + 1); /* too long a prompt for its logprobs */
    lp.top_logprobs = 0;
    lp.prompt = true;
    r.logprobs = &lp;
    prefill_refused(&r, &mc_long, "prompt logprobs of 4097 tokens");
    r = prefill_of(3);
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    sp.repetition_penalty = -1;
    r.sampling = &sp;
    prefill_refused(&r, &mc, "repetition_penalty -1");
    sp.repetition_penalty = 0;
    uint32_t bias_ids[1] = {VOCAB + 1};
    float bias[1] = {100};
    sp.logit_bias_ids = bias_ids;
    sp.n_logit_bias_ids = 1;
    sp.logit_bias = bias;
    sp.n_logit_bias = 1;
    prefill_refused(&r, &mc, "logit_bias token 513 is outside the vocabulary");
    bias_ids[0] = VOCAB - 1; /* inside: read */
    char why[256] = "";
    prefill_admit_t a;
    cr_assert_eq(prefill_admit_read(&r, &mc, 16, &a, why, sizeof why), TD_GRPC_OK, "%s", why);
    cr_assert(a.sampling.n_logit_bias == 1 && a.sampling.logit_bias_ids[0] == VOCAB - 1 && a.sampling.logit_bias[0] == 100);
    prefill_admit_free(&a);
}

/* ---- the decode node: a Prefill call for another decode node's lease (kv_out) ----------- */

static void kv_out_refused(const Tandem__Control__V1__PrefillRequest *r, const char *says)
{
    char why[256] = "";
    decode_admit_t *a = NULL;
    int32_t *dst = NULL, n_dst = -1;
    cr_assert_eq(decode_admit_read_kv_out(r, &mc, 16, &a, &dst, &n_dst, why, sizeof why), TD_GRPC_INVALID_ARGUMENT,
                 "accepted, want a refusal naming '%s'", says);
    cr_assert(!a && !dst && n_dst == -1, "a refused call wrote its outputs");
    cr_assert(strstr(why, says), "'%s' does not say '%s'", why, says);
}

/* The decode node checks a peer's Prefill call as a prefill node does, and refuses what it does
 * not serve (prompt logprobs: it computes prompts in chunks inside its decode steps). */
Test(node_admit, decode_reads_a_prefill_for_another_lease)
{
    uint8_t token[sizeof(td_xfer_token_t)] = {1, 2, 3};
    Tandem__Control__V1__PrefillRequest r = prefill_of(20);
    r.xfer_token.data = token;
    r.xfer_token.len = sizeof token;
    r.cache_salt = 99;
    blocks_of[1] = 77;
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    sp.seed = 5;
    r.sampling = &sp;
    char why[256] = "";
    decode_admit_t *a = NULL;
    int32_t *dst = NULL, n_dst = 0;
    cr_assert_eq(decode_admit_read_kv_out(&r, &mc, 16, &a, &dst, &n_dst, why, sizeof why), TD_GRPC_OK, "%s", why);
    cr_assert(a->kv_out && !a->local && a->n_prompt == 20 && a->prompt[19] == 22 && a->max_tokens == 1);
    cr_assert(a->cache_salt == 99 && a->sampling.seed == 5 && n_dst == 2 && dst[1] == 77);
    decode_admit_free(a);
    free(dst);

    r = prefill_of(0);
    r.xfer_token.data = token, r.xfer_token.len = sizeof token;
    kv_out_refused(&r, "0 tokens (1 .. 255)");
    r = prefill_of(40);
    r.xfer_token.data = token, r.xfer_token.len = sizeof token;
    r.n_block_ids = 2;
    kv_out_refused(&r, "ceil(tokens / 16)");
    r = prefill_of(40);
    r.xfer_token.data = token, r.xfer_token.len = sizeof token;
    ids[39] = VOCAB + 100;
    kv_out_refused(&r, "tokens[39] = 612 is outside the vocabulary");
    r = prefill_of(3);
    kv_out_refused(&r, "kv transfer token of 0 bytes");
    r.xfer_token.data = token, r.xfer_token.len = sizeof token;
    Tandem__V1__LogprobsRequest lp = TANDEM__V1__LOGPROBS_REQUEST__INIT;
    lp.prompt = true;
    r.logprobs = &lp;
    kv_out_refused(&r, "prompt logprobs are not served by a decode node");
}
