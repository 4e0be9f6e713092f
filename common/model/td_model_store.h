/*
 * td_model_store: what the loaders of td_model share (internal to common/model): the
 * storage a loaded model keeps alive, and the helpers that make a model and its views.
 * td_model.c loads llama2.c checkpoints and Hugging Face directories; td_model_gguf.c
 * loads GGUF files.
 */
#ifndef TD_MODEL_STORE_H
#define TD_MODEL_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_gguf.h"
#include "td_model.h"
#include "td_safetensors.h"
#include "td_util.h"

/* What a loaded model keeps alive (td_model_t.priv): the file(s) its views point into. */
typedef struct td_model_store {
    td_mmap_t bin;                  /* llama2.c checkpoint */
    td_safetensors_t **shards;      /* Hugging Face: one per file */
    size_t n_shards;
    td_gguf_t *gguf;                /* a GGUF file */
    void **copies;                  /* aligned copies of misaligned tensors (rare) */
    size_t n_copies;
} td_model_store_t;

/* A zeroed model with an empty store and m->path = path. Errors: TD_ERR_NOMEM,
 * TD_ERR_RANGE (path too long), logged. Free with td_model_destroy. */
td_status_t td_model_alloc(const char *path, td_model_t **m_p);

/* Keeps an aligned (malloc) copy of n bytes at src alive as long as the store.
 * Errors: TD_ERR_NOMEM, not logged. */
td_status_t td_model_store_copy(td_model_store_t *s, const void *src, size_t n, void **copy_p);

/* Points t at data: a {d0} vector when d1 <= 0, else a {d0, d1} matrix. */
void td_model_set_view(td_tensor_t *t, const void *data, td_dtype_t dt, int64_t d0, int64_t d1);

/* One tensor of a layer: its name in each format (Hugging Face: model.layers.N.<hf>; GGUF:
 * blk.N.<gguf>), where it binds, whether the config uses it, and its shape ({d0} or
 * {d0, d1}). */
typedef struct td_layer_spec {
    td_tensor_t *t;
    const char *hf;
    const char *gguf;
    bool use;
    int64_t d0, d1;
} td_layer_spec_t;

#define TD_LAYER_SPECS 15

/* The tensors of a layer of config c, bound into w: the one list both loaders bind from and
 * recognise file names by. A mixture of experts has the router here and its experts in
 * td_model_expert_specs; a dense model the FFN here. */
void td_model_layer_specs(const td_model_config_t *c, td_layer_weights_t *w, td_layer_spec_t out[TD_LAYER_SPECS]);

/* One matrix of every expert of a layer: its Hugging Face name with the expert's number as
 * %d (model.layers.N.<hf>: one tensor per expert), its GGUF name (blk.N.<gguf>: one 3-D
 * tensor, ne {d1, d0, n_experts}), its shape per expert, and where expert e's view goes. */
typedef struct td_expert_spec {
    const char *hf;
    const char *gguf;
    int64_t d0, d1;
    size_t offset;  /* of the td_tensor_t in td_expert_weights_t */
} td_expert_spec_t;

#define TD_EXPERT_SPECS 3

void td_model_expert_specs(const td_model_config_t *c, td_expert_spec_t out[TD_EXPERT_SPECS]);

/* Allocates every layer's experts array (config n_experts > 0; nothing for a dense model):
 * slices of one allocation, layers[0].experts, that td_model_destroy frees. m->weights.layers
 * must exist. `n_tensors` is how many tensors the file(s) hold and `per_layer` how many of
 * them a layer's experts take: a config that implies more is refused first, so a hostile
 * layer or expert count allocates nothing. Errors: TD_ERR_FORMAT (naming `origin`),
 * TD_ERR_NOMEM, logged. */
td_status_t td_model_alloc_experts(td_model_t *m, const char *origin, size_t n_tensors, size_t per_layer);

/* Whether `suffix` (a tensor name after model.layers.N.) is one of the experts' Hugging Face
 * tensors of config c, expert number below n_experts. */
bool td_model_is_expert_name(const td_model_config_t *c, const char *suffix);

/* Loads a GGUF file (td_model_gguf.c); td_model_load's contract. */
td_status_t td_model_load_gguf(const char *path, td_model_t **m_p);

#endif /* TD_MODEL_STORE_H */
