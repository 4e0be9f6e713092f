/*
 * td_model: a transformer's hyperparameters (td_model_config_t) and its weights as host
 * tensors (td_model_weights_t), loaded from a llama2.c checkpoint, a Hugging Face model
 * directory or a GGUF file (llama.cpp's format; block-quantized weights stay as stored). Weights stay where the loader found them: memory-mapped files, never copied.
 * Backends take them from here (converting or uploading as they need).
 *
 * Weight matrices are [out][in] (a PyTorch Linear weight), rows contiguous.
 */
#ifndef TD_MODEL_H
#define TD_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "td_backend.h"
#include "td_dtype.h"
#include "td_status.h"

typedef enum td_arch {
    TD_ARCH_LLAMA = 0,   /* LlamaForCausalLM and llama2.c checkpoints */
    TD_ARCH_MISTRAL = 1, /* MistralForCausalLM */
    TD_ARCH_QWEN2 = 2,   /* Qwen2ForCausalLM: q/k/v biases */
    TD_ARCH_QWEN3 = 3,   /* Qwen3ForCausalLM: q/k RMS norms */
    TD_ARCH_MIXTRAL = 4, /* MixtralForCausalLM: Mistral with a mixture-of-experts FFN */
    TD_ARCH_QWEN3_MOE = 5, /* Qwen3MoeForCausalLM: Qwen3 with a mixture-of-experts FFN */
} td_arch_t;

#define TD_MAX_EOS 8
#define TD_MAX_EXPERTS 1024 /* beyond any published mixture (DeepSeek-V3: 256) */

/* Most layers a per-layer sliding-window pattern can describe (td_model_config_t.swa_layers);
 * the deepest published models have 126. */
#define TD_SWA_MAX_LAYERS 256

typedef struct td_model_config {
    td_arch_t arch;
    char arch_name[64];     /* as in config.json "architectures"[0], or "llama2.c" */
    int32_t dim;            /* hidden_size */
    int32_t hidden_dim;     /* intermediate_size (FFN) */
    int32_t n_layers;
    int32_t n_heads;        /* query heads */
    int32_t n_kv_heads;     /* key/value heads (GQA when < n_heads) */
    int32_t head_dim;       /* dim / n_heads unless config.json gives head_dim */
    int32_t vocab_size;
    int32_t max_seq_len;    /* max_position_embeddings / llama2.c seq_len */
    float norm_eps;         /* rms_norm_eps */
    float rope_theta;
    td_rope_style_t rope_style;
    bool rope_llama3;       /* rope_scaling.rope_type == "llama3" */
    float rope_factor;
    float rope_low_freq_factor;
    float rope_high_freq_factor;
    int32_t rope_original_max_pos;
    bool tie_embeddings;    /* lm_head shares the embedding table */
    bool qkv_bias;          /* Qwen2 */
    bool qk_norm;           /* Qwen3 */
    /* Mixture of experts (n_experts > 0): every layer's FFN is n_experts SwiGLU experts of
     * expert_hidden_dim, of which a router picks n_experts_used per token. The router's
     * logits select the top n_experts_used (ties: the lower expert id); their weights are
     * softmax over those logits when moe_norm_topk (Mixtral always; Qwen3-MoE's
     * norm_topk_prob), else each one's share of the softmax over all experts. */
    int32_t n_experts;         /* num_local_experts / num_experts; 0: a dense FFN */
    int32_t n_experts_used;    /* num_experts_per_tok (top-k), 1..n_experts */
    int32_t expert_hidden_dim; /* Mixtral intermediate_size; Qwen3-MoE moe_intermediate_size */
    bool moe_norm_topk;
    uint64_t rope_freqs_hash; /* td_fnv1a64 of the rope_freqs tensor's bytes (GGUF); 0: none */
    td_dtype_t dtype;       /* dtype the weights are stored in; for a GGUF file the float
                               type to dequantize its block types to where a backend has no
                               kernels for them: f16 unless every matrix is bf16 or f32 */
    int32_t bos_id;         /* -1 when none */
    int32_t eos_ids[TD_MAX_EOS]; /* generation stops on any of these */
    int32_t n_eos;
    /* Sliding-window attention (Mistral sliding_window, Qwen2/3 use_sliding_window with
     * max_window_layers, a config's layer_types, GGUF <arch>.attention.sliding_window): in a
     * sliding layer a query at position p attends to the keys in (p - window, p]. An attention
     * mask, not a context limit: max_seq_len stays the model's own. 0: every layer attends
     * to the whole context. td_model_layer_window() is the one reader. */
    int32_t sliding_window;
    uint64_t swa_layers[TD_SWA_MAX_LAYERS / 64]; /* bit l: layer l slides (sliding_window > 0) */
} td_model_config_t;

/* A host tensor: a view into a mapped file (or synthesized buffer) owned by the model. */
typedef struct td_tensor {
    const void *data;       /* NULL when absent (optional tensors) */
    td_dtype_t dtype;
    int32_t n_dims;
    int64_t shape[4];       /* outermost first: a [out][in] matrix is {out, in} */
} td_tensor_t;

typedef struct td_layer_weights {
    td_tensor_t attn_norm;  /* (dim) */
    td_tensor_t wq;         /* (n_heads * head_dim, dim) */
    td_tensor_t wk;         /* (n_kv_heads * head_dim, dim) */
    td_tensor_t wv;         /* (n_kv_heads * head_dim, dim) */
    td_tensor_t bq;         /* (n_heads * head_dim) Qwen2 only */
    td_tensor_t bk;         /* (n_kv_heads * head_dim) Qwen2 only */
    td_tensor_t bv;         /* (n_kv_heads * head_dim) Qwen2 only */
    td_tensor_t q_norm;     /* (head_dim) Qwen3 only */
    td_tensor_t k_norm;     /* (head_dim) Qwen3 only */
    td_tensor_t wo;         /* (dim, n_heads * head_dim) */
    td_tensor_t ffn_norm;   /* (dim) */
    td_tensor_t w_gate;     /* (hidden_dim, dim)  llama2.c w1 */
    td_tensor_t w_up;       /* (hidden_dim, dim)  llama2.c w3 */
    td_tensor_t w_down;     /* (dim, hidden_dim)  llama2.c w2 */
    /* mixture of experts (config n_experts > 0) instead of w_gate/w_up/w_down */
    td_tensor_t router;     /* (n_experts, dim) logits of the experts for a token */
    struct td_expert_weights *experts; /* [n_experts], owned by the model (all layers' are one
                                          allocation); NULL when dense */
} td_layer_weights_t;

/* One expert's SwiGLU FFN (Mixtral w1/w3/w2, Qwen3-MoE gate/up/down_proj; a GGUF file's
 * 3-D ffn_*_exps tensors hold them one after another, these are views of its slices). */
typedef struct td_expert_weights {
    td_tensor_t w_gate;     /* (expert_hidden_dim, dim) */
    td_tensor_t w_up;       /* (expert_hidden_dim, dim) */
    td_tensor_t w_down;     /* (dim, expert_hidden_dim) */
} td_expert_weights_t;

typedef struct td_model_weights {
    td_tensor_t embed;          /* (vocab_size, dim) */
    td_layer_weights_t *layers; /* [n_layers] */
    td_tensor_t final_norm;     /* (dim) */
    td_tensor_t lm_head;        /* (vocab_size, dim); same data as embed when tied */
    /* (head_dim / 2) f32, optional (data NULL when absent): per-pair frequency divisors
     * (ggml's freq_factors): pair i rotates by pos * inv_freq[i] / rope_freqs[i]. Llama 3.x
     * GGUF files carry these instead of rope_scaling metadata. */
    td_tensor_t rope_freqs;
} td_model_weights_t;

typedef struct td_model td_model_t;

struct td_model {
    td_model_config_t config;
    td_model_weights_t weights;
    uint64_t fingerprint;       /* td_model_fingerprint(&config) */
    char path[4096];            /* what was loaded */
    char tokenizer_path[4096];  /* tokenizer found beside the model ("" if none); for a GGUF
                                   file the file itself (its tokenizer.ggml.* metadata) */
    void *priv;                 /* loader-owned storage (maps, buffers) */
};

/*
 * Loads a model. `path` is a GGUF file (recognised by its magic), a llama2.c checkpoint
 * file (.bin) or a Hugging Face model directory (config.json + model.safetensors or
 * model.safetensors.index.json shards). A GGUF file's llama/mistral q and k rows are in
 * the order llama.cpp's converter permuted them to (rope_style TD_ROPE_PAIRS); qwen2/qwen3
 * keep TD_ROPE_HALVES. Errors name the file and the problem: TD_ERR_IO, TD_ERR_FORMAT (bad
 * JSON, truncated file, wrong shape, missing tensor or metadata key), TD_ERR_UNSUPPORTED
 * (architecture, dtype, rope scaling).
 */
td_status_t td_model_load(const char *path, td_model_t **model_p);
/*
 * Makes the model's files resident now (their read-only mappings, MADV_POPULATE_READ on
 * n_threads threads), so that the first forward pass does not fault every weight page in:
 * a node does it at startup, before it registers. Errors: TD_ERR_NOMEM (not enough memory
 * to hold them: the weights still load page by page as used), TD_ERR_UNSUPPORTED (a kernel
 * before 5.14). Any thread.
 */
td_status_t td_model_populate(const td_model_t *model, int n_threads);

/*
 * Gives back this process's resident pages of [data, data + bytes) when the range lies in
 * one of the model's file mappings (the whole pages inside it; MADV_DONTNEED): for a weight
 * the backend has copied into a form of its own (packed at load), whose file pages would
 * otherwise stay resident beside the copy. The view stays valid: a later read faults its
 * pages in again from the file. A range anywhere else (a copy the loader made) is left as
 * it is. Any thread.
 */
void td_model_release_pages(const td_model_t *model, const void *data, size_t bytes);

/* Unmaps the files and frees the model; every td_tensor_t view dies with it. NULL: no-op. */
void td_model_destroy(td_model_t *model);

/*
 * Parses a Hugging Face config.json text (and optional tokenizer_config/generation
 * defaults already merged by the caller) into cfg. `origin` names the file in messages.
 * Used by the loader and by processes that need the shape without the weights.
 */
td_status_t td_model_config_from_json(const char *json, const char *origin, td_model_config_t *cfg);

/* A stable 64-bit hash of everything that shapes the KV cache and the math: arch, dims,
 * heads, layers, vocab, rope settings, norms. Two nodes with equal fingerprints compute
 * interchangeable KV. */
uint64_t td_model_fingerprint(const td_model_config_t *cfg);

/* The attention window of layer `layer`: cfg->sliding_window when that layer slides, 0 when
 * it attends to the whole context. */
int32_t td_model_layer_window(const td_model_config_t *cfg, int32_t layer);

/* The window every layer's attention fits in: the largest layer window, or 0 when some layer
 * attends to the whole context (then no KV block ever falls out of reach). Keys at positions
 * <= p - td_model_kv_window() are read by no query at p or later. */
int32_t td_model_kv_window(const td_model_config_t *cfg);

/* Makes every layer of cfg slide with `window` tokens (0: none). */
void td_model_config_set_window(td_model_config_t *cfg, int32_t window);

/* Named preset shapes for synthesis: "tinyllama-1.1b", "llama-3.2-1b", "llama-3-8b",
 * "qwen2-7b", "mistral-7b" (sliding window 4096), "tiny" (a few MB, for tests), "tiny-swa" (tiny,
 * Mistral-shaped, sliding window 40). Returns TD_ERR_NOT_FOUND for other names. */
td_status_t td_model_preset(const char *name, td_model_config_t *cfg);

typedef struct td_synth_params {
    td_model_config_t config; /* shape and arch to write */
    uint64_t seed;
    td_dtype_t dtype;         /* dtype of the written tensors */
} td_synth_params_t;

/*
 * Writes a random-weight model in the Hugging Face format to directory `out_dir`
 * (created if missing): config.json, model.safetensors, and a tokenizer.json when
 * `tokenizer_src` is non-NULL (copied). Weights ~ N(0, 0.02)-like from the seed, norms 1,
 * so generation is deterministic per seed.
 */
td_status_t td_model_synth(const td_synth_params_t *p, const char *out_dir, const char *tokenizer_src);

/* ---- additions (model loader) ------------------------------------------------------ */

/* Checks that a config describes a model we can run: positive dims, n_heads divisible by
 * n_kv_heads, an even head_dim, eos/bos ids inside the vocabulary. TD_ERR_FORMAT with a
 * message naming `origin` (a file name) and the field. */
td_status_t td_model_config_validate(const td_model_config_t *cfg, const char *origin);

/* Serialises cfg as a Hugging Face config.json for its arch (torch_dtype from `dtype`).
 * *json_p is heap text the caller frees with free(). Errors: TD_ERR_NOMEM, TD_ERR_UNSUPPORTED
 * (a sliding window on a llama config, which has no key for one). */
td_status_t td_model_config_to_json(const td_model_config_t *cfg, td_dtype_t dtype, char **json_p);

/* Number of weights (parameters) the config implies; the embedding counted once when tied. */
uint64_t td_model_param_count(const td_model_config_t *cfg);

/* The weights one token's forward pass reads: td_model_param_count less the experts the
 * router does not pick (n_experts - n_experts_used per layer); the same for a dense model. */
uint64_t td_model_active_param_count(const td_model_config_t *cfg);

/* Bytes of K+V per token over all layers for KV elements of `kv_dtype` (td_kv_bytes: 0 for a
 * dtype a KV cache cannot have). */
uint64_t td_model_kv_bytes_per_token(const td_model_config_t *cfg, td_dtype_t kv_dtype);

/* "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe" (the Hugging Face model_type). */
const char *td_model_arch_name(td_arch_t arch);

/* Parses a model_type ("llama", ...) or an architectures name ("LlamaForCausalLM", ...).
 * Returns -1 for anything else. */
int td_model_arch_parse(const char *s);

/* Makes cfg an `arch` model: sets arch, arch_name, rope style HALVES, qkv_bias (qwen2),
 * qk_norm (qwen3, qwen3_moe) and moe_norm_topk (mixtral). Shapes are left alone. */
void td_model_config_set_arch(td_model_config_t *cfg, td_arch_t arch);

/* Names of the presets td_model_preset() knows, NULL-terminated. */
extern const char *const td_model_preset_names[];

/*
 * td_model_synth() with the weights split over n_shards files (model-0000i-of-0000n
 * .safetensors + model.safetensors.index.json) when n_shards > 1. Errors: TD_ERR_INVALID
 * (bad config, vocab too small for the built-in tokenizer, n_shards < 1), TD_ERR_IO
 * (naming the file), TD_ERR_NOMEM. A failure leaves no half-written weight file behind.
 */
td_status_t td_model_synth_shards(const td_synth_params_t *p, int n_shards, const char *out_dir,
                                  const char *tokenizer_src);

/*
 * Writes the model td_model_synth would (the same weights for the same seed) as one GGUF
 * file at out_path, the way llama.cpp's converter would have written it: llama/mistral as
 * GGUF arch "llama" with q/k rows permuted for adjacent-pair rope (td_model_load gives
 * rope_style TD_ROPE_PAIRS, and the same logits as the safetensors model), qwen2/qwen3
 * unpermuted; Llama 3 rope scaling as a rope_freqs tensor; the built-in byte tokenizer as
 * tokenizer.ggml.* metadata (bos 256, eos 257). p->dtype is the matrices' type: f32, f16,
 * bf16, or q8_0/q4_0 (quantized; rows must be whole blocks of 32); vectors are f32.
 * Errors: TD_ERR_INVALID (dtype, shape, vocab < 258), TD_ERR_IO naming the file,
 * TD_ERR_NOMEM. A failure leaves no file behind.
 */
td_status_t td_model_synth_gguf(const td_synth_params_t *p, const char *out_path);

#endif /* TD_MODEL_H */
