/*
 * td_engine: the forward pass of a decoder-only transformer over a batch of sequences,
 * on any backend, with a paged KV cache. Every role runs this engine; a role is a
 * scheduler around it (chunked prefill on a prefill node, continuous batching on a
 * decode node, a single sequence in `tandem generate`).
 *
 * One step takes a batch of sequences, each bringing new tokens (a prefill chunk of any
 * length or one decode token), appends their K/V to the cache, and returns f32 logits for
 * the last n_logits new tokens of each sequence that asks. Sequences are td_kv_seq_t owned
 * by the caller; the engine owns the KV pool (bytes on the backend) and its block manager.
 *
 * Threads: an engine is used by one thread at a time (the backend's pool does the
 * parallel work). Errors: TD_ERR_EXHAUSTED (not logged) when the pool cannot hold the
 * step's new tokens — the scheduler preempts or waits; TD_ERR_RANGE/TD_ERR_INVALID for a
 * step that breaks the configured limits or the model's (logged).
 */
#ifndef TD_ENGINE_H
#define TD_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_backend.h"
#include "td_kv.h"
#include "td_kv_layout.h"
#include "td_model.h"
#include "td_status.h"

typedef struct td_engine td_engine_t;

/* td_engine_config_t.weight_dtype: use the weights in the dtype the model file has. */
#define TD_ENGINE_WEIGHTS_AS_STORED (-1)

typedef struct td_engine_config {
    int32_t block_size;       /* tokens per KV block (16) */
    int32_t n_blocks;         /* KV pool blocks; 0 = as many as kv_mem_bytes holds */
    size_t kv_mem_bytes;      /* KV pool budget when n_blocks == 0 (1 GiB) */
    td_dtype_t kv_dtype;      /* KV element type (the backend must accept it) */
    int32_t weight_dtype;     /* a float td_dtype_t every float-stored weight is converted to
                                 once at load (the backend must accept it), or
                                 TD_ENGINE_WEIGHTS_AS_STORED: each keeps the file's dtype, f32
                                 where the backend lacks it. Block-quantized weights (GGUF) stay
                                 as stored where the backend has kernels for their type, else
                                 are dequantized at load (said once in the log) to weight_dtype,
                                 or the backend's 16-bit activation type, or f32. */
    int32_t weight_quant;     /* TD_Q8_0 or TD_Q4_0: every float-stored weight matrix (2-D:
                                 projections, embedding, output) is quantized to it at load
                                 (the backend must have kernels for it); -1: none (default) */
    bool prefix_cache;        /* keep full blocks for reuse across sequences (true) */
    int32_t max_batch_tokens; /* most new tokens in one step, all sequences (2048) */
    int32_t max_seqs;         /* most sequences in one step (256) */
    int32_t max_logit_rows;   /* most logit rows one step returns (256) */
    int32_t partition_tokens; /* decode split-KV partition size; 0 = backend heuristic */
    void *kv_pool;            /* NULL: the engine allocates its KV pool on the backend. Else
                                 caller-owned pool memory, td_kv_pool_bytes(layout, n_blocks)
                                 bytes (layout from td_engine_kv_layout_for), outliving the
                                 engine; host-memory backends only, n_blocks must be set. The
                                 decode node passes the pool td_xfer had UCX allocate, so KV
                                 lands where the engine reads it. */
} td_engine_config_t;

td_engine_config_t td_engine_config_default(void);

/* A process's --dtype (a td_dtype_t, or -1: leave the defaults) applied to the weights and
 * the KV cache, its --quant (a block td_dtype_t, or -1: none) to the weight matrices, and
 * its --kv-dtype (a float td_dtype_t or Q8_0, or -1: as --dtype) to the KV cache: the one
 * place they are applied (tandem generate, perplexity, the nodes, bench engine). */
void td_engine_config_set_dtype(td_engine_config_t *cfg, int dtype, int quant, int kv_dtype);

/*
 * Builds an engine: makes the model's weights available on the backend (uploading or
 * converting only what the backend cannot use in place; the model must outlive the
 * engine), allocates the KV pool and scratch. Errors: TD_ERR_INVALID (config), TD_ERR_NOMEM
 * (pool or scratch does not fit: the message says how much was asked), TD_ERR_UNSUPPORTED
 * (a dtype the backend lacks).
 */
td_status_t td_engine_create(const td_model_t *model, td_backend_t *be,
                             const td_engine_config_t *cfg, td_engine_t **eng_p);
void td_engine_destroy(td_engine_t *eng);

/* One sequence's part of a step. */
typedef struct td_engine_item {
    td_kv_seq_t *seq;       /* its cache state; seq->n_tokens advances by n_tokens */
    const int32_t *tokens;  /* [n_tokens] new tokens */
    int32_t n_tokens;       /* >= 1 */
    int32_t n_logits;       /* logits wanted for the last n_logits new tokens (0..n_tokens) */
    bool verify;            /* speculative verification: the rows are decode tokens (the last
                               sampled token, then drafts), each attending as a one-row decode
                               step at its own position would (the decode kernel, causal), so
                               row i's logits are bit-identical to those of the i-th of n_tokens
                               one-row steps. Needs n_logits == n_tokens; cannot share a step
                               with a multi-row item that is not a verify item (that step runs
                               the prefill kernel). Rejected rows: td_engine_seq_rollback. */
} td_engine_item_t;

/*
 * Runs one forward step. logits receives, item after item, n_logits rows of vocab_size
 * f32 each (sum of n_logits <= max_logit_rows); may be NULL when no item asks. On
 * TD_ERR_EXHAUSTED no sequence advanced (blocks reserved for earlier items stay with
 * them and are reused by their next step).
 */
td_status_t td_engine_step(td_engine_t *eng, const td_engine_item_t *items, int32_t n_items,
                           float *logits);

/*
 * Prepares a new (empty) sequence for a prompt: attaches the cached prefix blocks that
 * match tokens[0..n) (at most n - 2 tokens, so that at least two are computed: a piece of
 * one row would run the decode kernel, whose floats differ in the last bits from the same
 * row computed in a longer piece, and the prompt's KV would then depend on what was
 * cached). Returns the number of prompt tokens now cached in *n_cached_p.
 */
td_status_t td_engine_seq_start(td_engine_t *eng, td_kv_seq_t *seq, const int32_t *tokens,
                                int32_t n, int32_t *n_cached_p);

/*
 * Sliding window: gives back the sequence's leading KV blocks that no query at position
 * seq->n_tokens or later reads in any layer (td_model_kv_window; nothing when some layer
 * attends to the whole context) and returns how many. Their table entries become
 * TD_KV_RELEASED and the step refuses (TD_ERR_INVALID) a sequence whose first new row
 * would need one, so call it only where the sequence moves forward from n_tokens: after
 * a step, not before truncating it. A decode node and `tandem generate` call it after
 * every step; a prefill node never does (its transfer reads every block of the prompt
 * after the step). Shared and prefix-cached blocks follow td_kv_seq_release_before.
 */
int32_t td_engine_seq_release_window(td_engine_t *eng, td_kv_seq_t *seq);

/*
 * Rolls a sequence back to its first n_keep tokens (speculative decoding: the draft tokens
 * a verify step wrote that were rejected). Blocks past n_keep go back to the pool (a full
 * one registered in the prefix cache stays cached: its K/V are those of its tokens); a
 * registered block cut in the middle leaves the prefix cache first (td_kv_seq_truncate).
 * n_keep >= seq->n_tokens changes nothing.
 */
void td_engine_seq_rollback(td_engine_t *eng, td_kv_seq_t *seq, int32_t n_keep);

/* Releases everything a sequence holds (its blocks go back, full ones stay cached). */
void td_engine_seq_end(td_engine_t *eng, td_kv_seq_t *seq);

const td_model_config_t *td_engine_model_config(const td_engine_t *eng);
const td_engine_config_t *td_engine_config(const td_engine_t *eng);
const td_kv_layout_t *td_engine_kv_layout(const td_engine_t *eng);
td_kv_cache_t *td_engine_kv(td_engine_t *eng);
/* The KV pool bytes on the backend (layer-major, td_kv_layout.h) and its block count. */
void *td_engine_kv_pool(td_engine_t *eng, int32_t *n_blocks_p);
td_backend_t *td_engine_backend(td_engine_t *eng);

/*
 * Per-layer hook: when set, td_engine_step calls cb(arg, layer) on the stepping thread
 * right after layer `layer` of the step has run, for layers 0 .. n_layers-1 in order,
 * once each per step. By then that layer's K/V of every item is in the pool (the backend
 * is synchronised first, so a device backend's writes are complete), and every item's
 * block table (seq->blocks) already covers its new tokens; seq->n_tokens advances only
 * after the last layer. A step that fails before its first layer (TD_ERR_EXHAUSTED,
 * bad items) calls nothing; one that fails later stops calling at the failing layer.
 * A prefill node uses it to push a layer's KV while the next layers compute. cb NULL
 * removes the hook. The callback must not call back into the engine.
 */
typedef void (*td_engine_layer_cb)(void *arg, uint32_t layer);
void td_engine_set_layer_hook(td_engine_t *eng, td_engine_layer_cb cb, void *arg);

/* Bytes of weights one forward step streams (all matrices and norms once), for
 * bandwidth ratios in benchmarks. */
size_t td_engine_weight_bytes(const td_engine_t *eng);

/* Bytes of weights one token's forward pass reads: td_engine_weight_bytes less, in a
 * mixture of experts, the experts the router does not pick for it (n_experts -
 * n_experts_used of each layer's); equal to td_engine_weight_bytes for a dense model. What
 * batch-1 decode streams per token, for its bandwidth bound. */
size_t td_engine_active_weight_bytes(const td_engine_t *eng);

/*
 * The router of a mixture of experts for one token: the k experts of the highest logits
 * (ties: the lower expert id first), in descending order of logit, into ids[0..k), and
 * their weights: softmax over those k logits when norm_topk, else their probabilities in
 * the softmax over all n_experts. Pure; any thread.
 */
void td_engine_moe_route(const float *logits, int32_t n_experts, int32_t k, bool norm_topk, int32_t *ids,
                         float *weights);

/* The KV layout an engine created with (model, cfg) has, before creating it (to size and
 * register a caller-provided pool). Pure; cfg need not be validated. */
void td_engine_kv_layout_for(const td_model_t *model, const td_engine_config_t *cfg,
                             td_kv_layout_t *layout);

/* Bytes one KV block of (model, cfg) takes in the pool, all layers together. Pure. */
size_t td_engine_kv_block_bytes(const td_model_t *model, const td_engine_config_t *cfg);

/* ---- KV pool sizing ------------------------------------------------------------------
 *
 * A node's pool is `kv-blocks` blocks when that is set; otherwise as many as its `kv-mem`
 * budget holds, and no more than the node is configured to serve (a decode node: kv-seqs,
 * TD_KV_DECODE_SEQS by default, sequences of the model's full length, as llama-server sizes
 * its cache from -c and --parallel; a prefill node: 8 steps' worth of prompt tokens), so a
 * small model does not take half the machine, and a decode node, whose pool is made
 * resident before it registers, is ready in seconds. kv-mem defaults to a fraction of the
 * host memory available at startup (MemAvailable: free memory plus reclaimable page
 * cache, which already counts what this and every other process holds), capped:
 *
 *   decode  50 %, at most 64 GiB: its pool holds every running sequence and every lease;
 *   prefill 15 %, at most 16 GiB: only prompts in flight and the prefix cache;
 *   the rest stays for weights (a converted --dtype copy is private memory), activations
 *   and the page cache. 64 GiB is about 10 s of page touching at startup.
 *
 * A device pool (--device cuda) has a fixed default (decode 4 GiB, prefill 1 GiB): the
 * backend does not report free device memory. `tandem local` measures once for the whole
 * machine (TD_KV_LOCAL_PERCENT) and passes each node its share as --kv-mem, decode nodes
 * weighing TD_KV_LOCAL_DECODE_SHARE times a prefill node.
 */
#define TD_KV_DECODE_SEQS 4
#define TD_KV_DECODE_PERCENT 50
#define TD_KV_PREFILL_PERCENT 15
#define TD_KV_DECODE_CAP ((size_t)64 << 30)
#define TD_KV_PREFILL_CAP ((size_t)16 << 30)
#define TD_KV_DECODE_DEVICE_DEFAULT ((size_t)4 << 30)
#define TD_KV_PREFILL_DEVICE_DEFAULT ((size_t)1 << 30)
#define TD_KV_LOCAL_PERCENT 50
#define TD_KV_LOCAL_DECODE_SHARE 4

/* A memory budget: percent % of the host memory available when measured, at most a cap. */
typedef struct td_kv_budget {
    size_t bytes;       /* the budget */
    size_t available;   /* host memory available when measured (measured only) */
    int32_t percent;    /* bytes = percent % of available ... */
    bool capped;        /* ... or the cap, when that was less */
    bool measured;      /* false: memory could not be measured; bytes is the fallback */
} td_kv_budget_t;

/* Measures host memory available now (td_mem_available) and takes percent % of it, at most
 * cap bytes; fallback bytes (measured false) when it cannot be measured. Never fails. */
td_kv_budget_t td_engine_kv_budget(int32_t percent, size_t cap, size_t fallback);

/* How b was chosen, for a startup line: "50% of 6.0 GiB available", "the 64.0 GiB cap (50%
 * of 200.0 GiB available is more)", "a fixed default (available memory unknown)". */
const char *td_engine_kv_budget_describe(const td_kv_budget_t *b, char *buf, size_t cap);

typedef struct td_kv_plan_params {
    int64_t n_blocks;        /* --kv-blocks: > 0 is exactly that many blocks */
    size_t kv_mem;           /* --kv-mem in bytes: > 0 replaces the default budget */
    int32_t percent;         /* default budget: percent % of host memory available ... */
    size_t cap;              /* ... at most cap bytes */
    bool device;             /* the pool is device memory: the default budget is device_default */
    size_t device_default;
    int64_t useful_tokens;   /* the most tokens the node can hold at once (0: no bound) */
    const char *useful_what; /* useful_tokens in words, for the line: "64 sequences of 512 tokens" */
} td_kv_plan_params_t;

typedef struct td_kv_plan {
    int32_t n_blocks;
    size_t pool_bytes;       /* n_blocks * td_engine_kv_block_bytes */
    char line[400];          /* "1536 blocks x 16 tokens = 24576 tokens, 3.0 GiB (kv-mem 3.0 GiB: 50%
                                of 6.0 GiB available)" */
} td_kv_plan_t;

/*
 * Sizes a node's KV pool for (model, cfg) from p (the rule above), before anything is
 * allocated. Errors (logged, naming the sizes and the flag to lower): TD_ERR_NOMEM when the
 * pool, or an explicit --kv-mem, is more than the host memory available; TD_ERR_INVALID
 * when the budget holds no block. *plan_p is written only on success.
 */
td_status_t td_engine_kv_plan(const td_model_t *model, const td_engine_config_t *cfg,
                              const td_kv_plan_params_t *p, td_kv_plan_t *plan_p);

#endif /* TD_ENGINE_H */
