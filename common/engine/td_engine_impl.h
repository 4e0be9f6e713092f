/*
 * td_engine_impl: the inside of an engine, shared by the files that make up td_engine
 * (td_engine.c: the step and the accessors; td_engine_create.c: the config, the weights on
 * the backend, the step's buffers, create and destroy; td_engine_kv.c: sequences, the KV
 * layout and the sizing of a KV pool). Not for use outside the module.
 */
#ifndef TD_ENGINE_IMPL_H
#define TD_ENGINE_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_engine.h"

/* A weight as the backend sees it. */
typedef struct td_dev_tensor {
    const void *data;   /* backend memory (or the model's host memory when usable in place) */
    td_dtype_t dtype;
    bool owned;         /* allocated by the engine on the backend */
    bool packed;        /* ops->weight_pack's form of a [rows][cols] matrix (owned) */
} td_dev_tensor_t;

typedef struct td_layer_dev {
    td_dev_tensor_t attn_norm, wq, wk, wv, bq, bk, bv, q_norm, k_norm, wo;
    td_dev_tensor_t ffn_norm, w_gate, w_up, w_down;
    td_dev_tensor_t router;  /* mixture of experts: (n_experts, dim) */
    td_dev_tensor_t *exp;    /* [n_experts][3]: expert e's gate, up, down at 3e..3e+2; NULL: dense */
} td_layer_dev_t;

/* Per-step scratch on the backend, sized by the config's bounds. */
typedef struct td_engine_state {
    void *x;        /* [max_tokens][dim] residual stream */
    void *xb;       /* [max_tokens][dim] normalised input of a sub-layer */
    void *q;        /* [max_tokens][n_heads * head_dim] */
    void *k;        /* [max_tokens][n_kv_heads * head_dim] */
    void *v;        /* [max_tokens][n_kv_heads * head_dim] */
    void *att;      /* [max_tokens][n_heads * head_dim] attention output */
    void *gate;     /* [max_tokens][hidden_dim]; a mixture: [max_tokens * k][expert_hidden_dim] */
    void *up;       /* as gate */
    float *router;  /* mixture of experts: [max_tokens][n_experts] f32 router logits */
    void *moe_in;   /* [max_tokens * k][dim] xb's rows grouped by expert */
    void *moe_out;  /* [max_tokens * k][dim] each grouped row's expert output */
    void *rows;     /* [max_logit_rows][dim] hidden rows whose logits are wanted */
    void *logits;   /* [max_logit_rows][vocab] f32 */
    float *inv_freq; /* [head_dim / 2] rope frequencies (backend memory) */
} td_engine_state_t;

/* Host-side step metadata, sized by the config's bounds. */
typedef struct td_engine_meta {
    int32_t *tokens;       /* [max_tokens] */
    int32_t *positions;    /* [max_tokens] */
    int32_t *slots;        /* [max_tokens] */
    int32_t *seq_start;    /* [max_meta_seqs + 1] */
    int32_t *seq_len;      /* [max_meta_seqs] */
    int32_t *block_tables; /* [max_meta_seqs][max_blocks] */
    int32_t *logit_rows;   /* [max_logit_rows] */
    int32_t max_blocks;
    int32_t max_meta_seqs; /* max_seqs + max_logit_rows: a verify item's rows are each a
                              sequence of their own to the backend (build_meta) */
    /* mixture of experts, host: the routing of a step's rows (k = n_experts_used) */
    float *route_logits;   /* [max_tokens][n_experts] */
    int32_t *route_ids;    /* [max_tokens][k] expert of each row's rank r */
    float *route_w;        /* [max_tokens][k] its weight */
    int32_t *group_rows;   /* [max_tokens * k] the row of each grouped row (by expert, rows in order) */
    int32_t *slot_rows;    /* [max_tokens][k] the grouped row of (row, rank) */
    int32_t *expert_start; /* [n_experts + 1] first grouped row of each expert */
} td_engine_meta_t;

struct td_engine {
    const td_model_t *model;
    td_backend_t *be;
    td_engine_config_t cfg;
    td_kv_layout_t layout;
    td_kv_cache_t *kv;
    void *kv_pool;          /* backend memory, td_kv_pool_bytes(layout, n_blocks) */
    int32_t n_blocks;
    td_dev_tensor_t embed, final_norm, lm_head;
    td_layer_dev_t *layers; /* [n_layers] */
    td_engine_state_t s;
    td_engine_meta_t m;
    size_t weight_bytes;
    size_t expert_bytes;    /* of weight_bytes, the experts' (all of them) */
    uint32_t said_dequant;  /* bit t: the log said block type t is dequantized at load */
    bool said_unquantized;  /* the log said some matrices cannot take --quant */
    int32_t kv_window;      /* td_model_kv_window: 0 when some layer reads the whole context */
    td_engine_layer_cb layer_cb; /* td_engine_set_layer_hook; NULL: none */
    void *layer_arg;
};

#endif
