/*
 * td_node_info: what a node tells the router about itself (td_node_info_t, at registration)
 * and about its load (td_node_load_t, in every heartbeat): the vocabulary of the registry
 * protocol, shared by the nodes' client (td_node_client) and the router's table
 * (router_registry), which converts them to and from control.proto at its edge.
 */
#ifndef TD_NODE_INFO_H
#define TD_NODE_INFO_H

#include <stdbool.h>
#include <stdint.h>

#include "td_kv_layout.h"

#define TD_NODE_ID_MAX 64
#define TD_NODE_MODEL_MAX 128
#define TD_NODE_ADDRESS_MAX 256
typedef enum td_node_role {
    TD_NODE_ROLE_PREFILL = 1,
    TD_NODE_ROLE_DECODE = 2,
    TD_NODE_ROLE_UNIFIED = 3, /* prefill and decode in one engine: the router pairs it with itself */
} td_node_role_t;

/* "prefill", "decode" or "unified". */
static inline const char *td_node_role_name(td_node_role_t r)
{
    return r == TD_NODE_ROLE_DECODE ? "decode" : r == TD_NODE_ROLE_UNIFIED ? "unified" : "prefill";
}

/* Roles that hold sequences and stream their tokens (DecodeNode: Admit, Release, Steps). */
static inline bool td_node_role_decodes(td_node_role_t r)
{
    return r == TD_NODE_ROLE_DECODE || r == TD_NODE_ROLE_UNIFIED;
}

#define TD_NODE_MAX_EOS 8 /* the model config's TD_MAX_EOS */

/* What a node says about itself when it registers. */
typedef struct td_node_info {
    char id[TD_NODE_ID_MAX];       /* unique, non-empty */
    td_node_role_t role;
    char model[TD_NODE_MODEL_MAX];      /* the model it serves */
    td_kv_layout_t layout;             /* its KV layout (block_size > 0) */
    char address[TD_NODE_ADDRESS_MAX];  /* control address, host:port */
    int32_t capacity_blocks;           /* KV blocks in its pool */
    int32_t max_batch;                 /* most running sequences (decode) or batch (prefill) */
    int32_t vocab_size;                /* the model's vocabulary (ids 0..vocab_size-1); 0 = unknown
                                        * (a node from before Capacity.vocab_size) */
    int32_t max_seq_len;               /* the model's length (prompt + output); 0 = unknown */
    int32_t max_step_tokens;           /* tokens one step feeds (Capacity.max_prefill_tokens): a
                                        * prefill node's batch budget, a decode or unified node's
                                        * max-batch-tokens (one per running sequence, then prompt
                                        * chunks); 0 = unknown */
    int32_t eos_ids[TD_NODE_MAX_EOS];  /* the model's end-of-sequence ids, [n_eos] */
    int32_t n_eos;
} td_node_info_t;

/* What a heartbeat carries. */
typedef struct td_node_load {
    int64_t queued_prefill_tokens;  /* prompt tokens waiting or in progress (prefill; a decode
                                       or unified node: prompt and recompute tokens it still
                                       feeds itself) */
    int32_t running_seqs;           /* sequences in the running batch (decode) */
    int32_t free_blocks;            /* KV blocks an allocation could get now */
    double step_ms;                 /* recent mean step time (a decode or unified node: of its
                                       steps without prompt chunks, its streams' pace) */
    double prefill_tok_s;           /* recent prompt tokens per second of step time (a decode or
                                       unified node: of its steps with prompt chunks, its local
                                       prefill rate: its step-cost fit's); 0 = unknown */
    double tpot_objective_s;        /* a decode or unified node: the tightest TPOT objective of its
                                       sequences (seconds; 0 = none has one) */
    double step_spread_s;           /* a decode or unified node: its step-cost fit's spread, kept
                                       back from the objective when it sizes a chunk (0: none) */
    bool draining;                  /* the node takes no new request (td_node_drain) */
} td_node_load_t;

#endif
