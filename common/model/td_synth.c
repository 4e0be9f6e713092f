/*
 * td_synth: random-weight models in the Hugging Face format.
 *
 * Benchmarks and tests need models of real shapes (Llama-3-8B is 16 GB in bf16) that
 * nobody has to download; a model's speed does not depend on what its weights mean. This
 * writes a complete model directory (config.json, safetensors, a tokenizer) that
 * td_model_load and the tokenizer module load like any other.
 *
 * Determinism: each tensor draws from its own generator seeded by (seed, tensor name), so
 * the same seed gives the same values whatever the dtype, sharding or tensor order, and
 * the same bytes for the same (seed, config, dtype, shards). Values are approximately
 * N(0, 0.02) (the initializer_range of the reference implementations; an Irwin-Hall sum of
 * four uniforms, cheap enough to write 8B of them at disk speed), norms are 1.
 *
 * td_model_synth_gguf writes the same model (the same values for the same seed) as one
 * GGUF file that llama.cpp runs: llama.cpp's tensor names, q/k rows permuted as its
 * converter does, the byte tokenizer as tokenizer.ggml.* metadata, and for Llama 3 rope
 * scaling the rope_freqs tensor its converter computes.
 */
#include "td_model.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "td_gguf_writer.h"
#include "td_model_store.h"
#include "td_hash.h"
#include "td_rng.h"
#include "td_safetensors.h"
#include "td_util.h"

#define SYNTH_STD 0.02f
#define SYNTH_CHUNK (1u << 16) /* elements generated per write */
#define TOK_BOS 256
#define TOK_EOS 257

typedef enum { K_MATRIX, K_NORM, K_BIAS } kind_t;

typedef struct synth_tensor {
    char name[96];
    int32_t n_dims;
    int64_t shape[2];
    kind_t kind;
    size_t nbytes;
    int shard;
    int32_t expert;          /* an expert's matrix: its number; -1 otherwise */
    bool f32;                /* GGUF: stored f32 whatever the matrices' type (the router) */
    const char *gguf_experts; /* GGUF: the 3-D tensor of all experts it is a slice of */
} synth_tensor_t;

/* ---- random numbers ---------------------------------------------------------------- */

/* Approximately standard normal: the centred sum of four 16-bit uniforms, scaled to
 * unit variance (bounded at +-3.46). */
static float approx_normal(uint64_t *s)
{
    uint64_t r = td_splitmix64(s);
    uint32_t sum = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) + (uint32_t)((r >> 32) & 0xffff) +
                   (uint32_t)(r >> 48);
    return ((float)sum * (1.0f / 65535.0f) - 2.0f) * 1.7320508f;
}

/* ---- small file helpers ------------------------------------------------------------ */

static td_status_t write_text(const char *dir, const char *name, const char *text, size_t len)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    if (!f)
        return td_errorf(TD_ERR_IO, "%s: cannot create: %s", p, strerror(errno));
    bool ok = fwrite(text, 1, len, f) == len;
    int e = errno;
    if (fclose(f) != 0 && ok) {
        ok = false;
        e = errno;
    }
    if (!ok) {
        unlink(p);
        return td_errorf(TD_ERR_IO, "%s: write failed: %s", p, strerror(e));
    }
    return TD_OK;
}

static td_status_t write_json(const char *dir, const char *name, cJSON *root)
{
    char *text = root ? cJSON_Print(root) : NULL;
    if (!text)
        return td_errorf(TD_ERR_NOMEM, "%s/%s: out of memory", dir, name);
    td_status_t s = write_text(dir, name, text, strlen(text));
    free(text);
    return s;
}

static td_status_t copy_file(const char *src, const char *dir, const char *name)
{
    char *data;
    size_t len;
    td_status_t s = td_file_read_all(src, 1u << 30, &data, &len);
    if (s != TD_OK)
        return s;
    s = write_text(dir, name, data, len);
    free(data);
    return s;
}

/* ---- the built-in tokenizer -------------------------------------------------------- */

/* GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the
 * others are shifted to U+0100 and up, so every byte is one visible character. */
static uint32_t byte_char(unsigned b)
{
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))
        return b;
    uint32_t n = 0;
    for (unsigned x = 0; x < b; x++)
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255)))
            n++;
    return 256 + n;
}

static void utf8(uint32_t cp, char out[5])
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        /* every byte_char() value is below U+0800: two bytes */
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        out[2] = 0;
    }
}

static cJSON *added_token(int id, const char *content)
{
    cJSON *t = cJSON_CreateObject();
    if (!t)
        return NULL;
    if (id >= 0)
        cJSON_AddNumberToObject(t, "id", id);
    cJSON_AddStringToObject(t, "content", content);
    cJSON_AddBoolToObject(t, "single_word", false);
    cJSON_AddBoolToObject(t, "lstrip", false);
    cJSON_AddBoolToObject(t, "rstrip", false);
    cJSON_AddBoolToObject(t, "normalized", false);
    cJSON_AddBoolToObject(t, "special", true);
    return t;
}

static cJSON *byte_level(bool add_prefix_space)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    cJSON_AddStringToObject(o, "type", "ByteLevel");
    cJSON_AddBoolToObject(o, "add_prefix_space", add_prefix_space);
    cJSON_AddBoolToObject(o, "trim_offsets", true);
    cJSON_AddBoolToObject(o, "use_regex", true);
    return o;
}

/* tokenizer.json: byte-level BPE whose vocabulary is the 256 byte characters (id = byte
 * value) and no merges, plus <s> (256) and </s> (257); tokenizer_config.json naming them. */
static td_status_t write_byte_tokenizer(const char *dir, int32_t max_len)
{
    td_status_t s;
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return td_errorf(TD_ERR_NOMEM, "%s/tokenizer.json: out of memory", dir);
    cJSON_AddStringToObject(root, "version", "1.0");
    cJSON_AddNullToObject(root, "truncation");
    cJSON_AddNullToObject(root, "padding");
    cJSON *added = cJSON_AddArrayToObject(root, "added_tokens");
    if (added) {
        cJSON_AddItemToArray(added, added_token(TOK_BOS, "<s>"));
        cJSON_AddItemToArray(added, added_token(TOK_EOS, "</s>"));
    }
    cJSON_AddNullToObject(root, "normalizer");
    cJSON_AddItemToObject(root, "pre_tokenizer", byte_level(false));
    cJSON_AddNullToObject(root, "post_processor");
    cJSON_AddItemToObject(root, "decoder", byte_level(true));
    cJSON *model = cJSON_AddObjectToObject(root, "model");
    if (model) {
        cJSON_AddStringToObject(model, "type", "BPE");
        cJSON_AddNullToObject(model, "dropout");
        cJSON_AddNullToObject(model, "unk_token");
        cJSON_AddNullToObject(model, "continuing_subword_prefix");
        cJSON_AddNullToObject(model, "end_of_word_suffix");
        cJSON_AddBoolToObject(model, "fuse_unk", false);
        cJSON_AddBoolToObject(model, "byte_fallback", false);
        cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
        for (unsigned b = 0; vocab && b < 256; b++) {
            char ch[5];
            utf8(byte_char(b), ch);
            cJSON_AddNumberToObject(vocab, ch, b);
        }
        cJSON_AddArrayToObject(model, "merges");
    }
    s = write_json(dir, "tokenizer.json", root);
    cJSON_Delete(root);
    if (s != TD_OK)
        return s;

    root = cJSON_CreateObject();
    if (!root)
        return td_errorf(TD_ERR_NOMEM, "%s/tokenizer_config.json: out of memory", dir);
    cJSON_AddBoolToObject(root, "add_bos_token", true);
    cJSON_AddBoolToObject(root, "add_eos_token", false);
    cJSON *dec = cJSON_AddObjectToObject(root, "added_tokens_decoder");
    if (dec) {
        cJSON_AddItemToObject(dec, "256", added_token(-1, "<s>"));
        cJSON_AddItemToObject(dec, "257", added_token(-1, "</s>"));
    }
    cJSON_AddStringToObject(root, "bos_token", "<s>");
    cJSON_AddStringToObject(root, "eos_token", "</s>");
    cJSON_AddBoolToObject(root, "clean_up_tokenization_spaces", false);
    cJSON_AddNumberToObject(root, "model_max_length", max_len);
    cJSON_AddStringToObject(root, "tokenizer_class", "PreTrainedTokenizerFast");
    s = write_json(dir, "tokenizer_config.json", root);
    cJSON_Delete(root);
    return s;
}

static td_status_t copy_tokenizer(const char *src, const char *dir)
{
    char p[4400];
    td_status_t s;
    if (td_is_dir(src)) {
        snprintf(p, sizeof p, "%s/tokenizer.json", src);
        if (!td_is_file(p))
            return td_errorf(TD_ERR_NOT_FOUND, "%s: no tokenizer.json to copy", src);
        if ((s = copy_file(p, dir, "tokenizer.json")) != TD_OK)
            return s;
        snprintf(p, sizeof p, "%s/tokenizer_config.json", src);
        return td_is_file(p) ? copy_file(p, dir, "tokenizer_config.json") : TD_OK;
    }
    if (!td_is_file(src))
        return td_errorf(TD_ERR_NOT_FOUND, "%s: no such tokenizer file or directory", src);
    /* A lone file keeps its name (tokenizer.json, tokenizer.model, tokenizer.bin); a
     * tokenizer_config.json beside a tokenizer.json comes along. */
    const char *slash = strrchr(src, '/');
    const char *base = slash ? slash + 1 : src;
    if ((s = copy_file(src, dir, base)) != TD_OK)
        return s;
    if (!strcmp(base, "tokenizer.json")) {
        snprintf(p, sizeof p, "%.*stokenizer_config.json", (int)(base - src), src);
        if (td_is_file(p))
            return copy_file(p, dir, "tokenizer_config.json");
    }
    return TD_OK;
}

/* ---- the weights ------------------------------------------------------------------- */

static void add_tensor(synth_tensor_t *t, size_t *n, td_dtype_t dt, const char *name, kind_t kind, int64_t d0,
                       int64_t d1)
{
    synth_tensor_t *x = &t[(*n)++];
    snprintf(x->name, sizeof x->name, "%s", name);
    x->kind = kind;
    x->n_dims = d1 > 0 ? 2 : 1;
    x->shape[0] = d0;
    x->shape[1] = d1;
    x->nbytes = (size_t)d0 * (size_t)(d1 > 0 ? d1 : 1) * td_dtype_size(dt);
    x->expert = -1;
    x->gguf_experts = NULL;
    x->f32 = false;
}

/* Tensors a model of config c has: 3 + per layer 14, or 15 + 3 per expert. */
static size_t max_tensors(const td_model_config_t *c)
{
    return 3 + (15 + 3 * (size_t)c->n_experts) * (size_t)c->n_layers;
}

/* Every tensor of the model in Hugging Face order (a mixture's experts matrix by matrix,
 * expert by expert within each, as GGUF's 3-D tensors hold them). t has room for
 * max_tensors(c). */
static size_t list_tensors(const td_model_config_t *c, td_dtype_t dt, synth_tensor_t *t)
{
    size_t n = 0;
    int64_t D = c->dim, F = c->hidden_dim, V = c->vocab_size, hd = c->head_dim;
    int64_t q = (int64_t)c->n_heads * hd, kv = (int64_t)c->n_kv_heads * hd;
    char name[96];
    add_tensor(t, &n, dt, "model.embed_tokens.weight", K_MATRIX, V, D);
    for (int32_t l = 0; l < c->n_layers; l++) {
#define ADD(suffix, kind, d0, d1)                                               \
    do {                                                                        \
        snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix);           \
        add_tensor(t, &n, dt, name, kind, d0, d1);                              \
    } while (0)
        ADD("input_layernorm.weight", K_NORM, D, 0);
        ADD("self_attn.q_proj.weight", K_MATRIX, q, D);
        ADD("self_attn.k_proj.weight", K_MATRIX, kv, D);
        ADD("self_attn.v_proj.weight", K_MATRIX, kv, D);
        if (c->qkv_bias) {
            ADD("self_attn.q_proj.bias", K_BIAS, q, 0);
            ADD("self_attn.k_proj.bias", K_BIAS, kv, 0);
            ADD("self_attn.v_proj.bias", K_BIAS, kv, 0);
        }
        if (c->qk_norm) {
            ADD("self_attn.q_norm.weight", K_NORM, hd, 0);
            ADD("self_attn.k_norm.weight", K_NORM, hd, 0);
        }
        ADD("self_attn.o_proj.weight", K_MATRIX, D, q);
        ADD("post_attention_layernorm.weight", K_NORM, D, 0);
        if (c->n_experts == 0) {
            ADD("mlp.gate_proj.weight", K_MATRIX, F, D);
            ADD("mlp.up_proj.weight", K_MATRIX, F, D);
            ADD("mlp.down_proj.weight", K_MATRIX, D, F);
            continue;
        }
        ADD(c->arch == TD_ARCH_MIXTRAL ? "block_sparse_moe.gate.weight" : "mlp.gate.weight", K_MATRIX,
            c->n_experts, D);
        t[n - 1].f32 = true; /* llama.cpp's converter keeps ffn_gate_inp F32 */
        td_expert_spec_t es[TD_EXPERT_SPECS];
        td_model_expert_specs(c, es);
        for (size_t i = 0; i < TD_EXPERT_SPECS; i++) {
            for (int32_t e = 0; e < c->n_experts; e++) {
                char suffix[48]; /* "block_sparse_moe.experts.1023.w1.weight" at most */
                snprintf(suffix, sizeof suffix, es[i].hf, (int)e);
                ADD(suffix, K_MATRIX, es[i].d0, es[i].d1);
                t[n - 1].expert = e;
                t[n - 1].gguf_experts = es[i].gguf;
            }
        }
#undef ADD
    }
    add_tensor(t, &n, dt, "model.norm.weight", K_NORM, D, 0);
    if (!c->tie_embeddings)
        add_tensor(t, &n, dt, "lm_head.weight", K_MATRIX, V, D);
    return n;
}

/* Streams one tensor's values in `dt` through the writer. */
static td_status_t write_values(td_st_writer_t *w, const synth_tensor_t *t, uint64_t seed, td_dtype_t dt,
                                float *vals, void *conv)
{
    uint64_t state = seed ^ td_fnv1a64(TD_FNV1A64_INIT, t->name, strlen(t->name));
    size_t total = t->nbytes / td_dtype_size(dt);
    for (size_t done = 0; done < total;) {
        size_t n = TD_MIN((size_t)SYNTH_CHUNK, total - done);
        for (size_t i = 0; i < n; i++)
            vals[i] = t->kind == K_NORM ? 1.0f : SYNTH_STD * approx_normal(&state);
        td_dtype_convert(conv, dt, vals, TD_F32, n);
        td_status_t s = td_st_writer_write(w, conv, n * td_dtype_size(dt));
        if (s != TD_OK)
            return s;
        done += n;
    }
    return TD_OK;
}

static void shard_name(char *out, size_t cap, int i, int n)
{
    if (n == 1)
        snprintf(out, cap, "model.safetensors");
    else
        snprintf(out, cap, "model-%05d-of-%05d.safetensors", i + 1, n);
}

static td_status_t write_shard(const char *dir, int shard, int n_shards, const synth_tensor_t *t, size_t n,
                               uint64_t seed, td_dtype_t dt, float *vals, void *conv)
{
    char name[64], p[4400];
    shard_name(name, sizeof name, shard, n_shards);
    snprintf(p, sizeof p, "%s/%s", dir, name);
    td_st_writer_t *w;
    td_status_t s = td_st_writer_create(p, &w);
    if (s != TD_OK)
        return s;
    if ((s = td_st_writer_meta(w, "format", "pt")) != TD_OK)
        goto out;
    for (size_t i = 0; i < n; i++)
        if (t[i].shard == shard && (s = td_st_writer_add(w, t[i].name, dt, t[i].n_dims, t[i].shape)) != TD_OK)
            goto out;
    if ((s = td_st_writer_begin(w)) != TD_OK)
        goto out;
    for (size_t i = 0; i < n; i++)
        if (t[i].shard == shard && (s = write_values(w, &t[i], seed, dt, vals, conv)) != TD_OK)
            goto out;
    s = td_st_writer_finish(w);
out:
    td_st_writer_destroy(w); /* removes the file unless finished */
    return s;
}

static td_status_t write_index(const char *dir, const synth_tensor_t *t, size_t n, int n_shards)
{
    cJSON *root = cJSON_CreateObject();
    cJSON *meta = root ? cJSON_AddObjectToObject(root, "metadata") : NULL;
    cJSON *map = root ? cJSON_AddObjectToObject(root, "weight_map") : NULL;
    size_t total = 0;
    for (size_t i = 0; map && i < n; i++) {
        char name[64];
        shard_name(name, sizeof name, t[i].shard, n_shards);
        cJSON_AddStringToObject(map, t[i].name, name);
        total += t[i].nbytes;
    }
    if (meta)
        cJSON_AddNumberToObject(meta, "total_size", (double)total);
    td_status_t s = meta && map ? write_json(dir, "model.safetensors.index.json", root)
                                : td_errorf(TD_ERR_NOMEM, "%s: out of memory", dir);
    cJSON_Delete(root);
    return s;
}

static void remove_shards(const char *dir, int upto, int n_shards)
{
    for (int i = 0; i < upto; i++) {
        char name[64], p[4400];
        shard_name(name, sizeof name, i, n_shards);
        snprintf(p, sizeof p, "%s/%s", dir, name);
        unlink(p);
    }
}

td_status_t td_model_synth_shards(const td_synth_params_t *p, int n_shards, const char *out_dir,
                                  const char *tokenizer_src)
{
    td_status_t s;
    td_model_config_t c = p->config;
    if (!td_dtype_is_float(p->dtype))
        return td_errorf(TD_ERR_INVALID, "synth: unknown dtype %d", (int)p->dtype);
    if (!tokenizer_src) {
        if (c.vocab_size < TOK_EOS + 1)
            return td_errorf(TD_ERR_INVALID, "synth: vocab_size %d is too small for the built-in byte tokenizer "
                             "(needs 258); pass a tokenizer", c.vocab_size);
        c.bos_id = TOK_BOS;
        c.eos_ids[0] = TOK_EOS;
        c.n_eos = 1;
    }
    c.dtype = p->dtype;
    if ((s = td_model_config_validate(&c, "synth config")) != TD_OK)
        return s;
    size_t cap = max_tensors(&c);
    if (n_shards < 1 || (size_t)n_shards > cap)
        return td_errorf(TD_ERR_INVALID, "synth: %d shards for a model of at most %zu tensors", n_shards, cap);
    if ((s = td_mkdir_p(out_dir)) != TD_OK)
        return s;

    synth_tensor_t *t = calloc(cap, sizeof *t);
    float *vals = malloc(SYNTH_CHUNK * sizeof *vals);
    void *conv = malloc(SYNTH_CHUNK * sizeof(float));
    if (!t || !vals || !conv) {
        s = td_errorf(TD_ERR_NOMEM, "synth: out of memory");
        goto out;
    }
    size_t n = list_tensors(&c, p->dtype, t);
    if ((size_t)n_shards > n) {
        s = td_errorf(TD_ERR_INVALID, "synth: %d shards for %zu tensors", n_shards, n);
        goto out;
    }

    /* Shards of about equal bytes, in tensor order, none empty. */
    uint64_t total = 0, acc = 0;
    for (size_t i = 0; i < n; i++)
        total += t[i].nbytes;
    int shard = 0;
    for (size_t i = 0; i < n; i++) {
        int left = n_shards - 1 - shard; /* shards after this one */
        if (shard < n_shards - 1 && i > 0 && t[i - 1].shard == shard &&
            (acc >= total * (uint64_t)(shard + 1) / (uint64_t)n_shards || n - i <= (size_t)left))
            shard++;
        t[i].shard = shard;
        acc += t[i].nbytes;
    }

    /* config.json goes last: a directory with one holds a whole model, so a run killed while
       writing (16 GB for llama-3-8b) never leaves one that looks complete */
    char stale[4400];
    snprintf(stale, sizeof stale, "%s/config.json", out_dir);
    unlink(stale);
    s = tokenizer_src ? copy_tokenizer(tokenizer_src, out_dir) : write_byte_tokenizer(out_dir, c.max_seq_len);
    if (s != TD_OK)
        goto out;
    /* A weight file of the other layout left from an earlier run would shadow this one. */
    snprintf(stale, sizeof stale, "%s/%s", out_dir, n_shards > 1 ? "model.safetensors" : "model.safetensors.index.json");
    unlink(stale);
    for (int i = 0; i < n_shards; i++) {
        if ((s = write_shard(out_dir, i, n_shards, t, n, p->seed, p->dtype, vals, conv)) != TD_OK) {
            remove_shards(out_dir, i, n_shards);
            goto out;
        }
    }
    if (n_shards > 1 && (s = write_index(out_dir, t, n, n_shards)) != TD_OK) {
        remove_shards(out_dir, n_shards, n_shards);
        goto out;
    }
    char *cfg_text;
    if ((s = td_model_config_to_json(&c, p->dtype, &cfg_text)) != TD_OK)
        goto out;
    s = write_text(out_dir, "config.json", cfg_text, strlen(cfg_text));
    free(cfg_text);
out:
    free(conv);
    free(vals);
    free(t);
    return s;
}

td_status_t td_model_synth(const td_synth_params_t *p, const char *out_dir, const char *tokenizer_src)
{
    return td_model_synth_shards(p, 1, out_dir, tokenizer_src);
}

/* ---- GGUF -------------------------------------------------------------------------- */

/* llama.cpp's name of a Hugging Face tensor name (the ones list_tensors makes). */
static void gguf_name(const char *hf, char *out, size_t cap)
{
    static const char *const map[][2] = {
        {"input_layernorm.weight", "attn_norm.weight"},
        {"self_attn.q_proj.weight", "attn_q.weight"},
        {"self_attn.k_proj.weight", "attn_k.weight"},
        {"self_attn.v_proj.weight", "attn_v.weight"},
        {"self_attn.q_proj.bias", "attn_q.bias"},
        {"self_attn.k_proj.bias", "attn_k.bias"},
        {"self_attn.v_proj.bias", "attn_v.bias"},
        {"self_attn.q_norm.weight", "attn_q_norm.weight"},
        {"self_attn.k_norm.weight", "attn_k_norm.weight"},
        {"self_attn.o_proj.weight", "attn_output.weight"},
        {"post_attention_layernorm.weight", "ffn_norm.weight"},
        {"mlp.gate_proj.weight", "ffn_gate.weight"},
        {"mlp.up_proj.weight", "ffn_up.weight"},
        {"mlp.down_proj.weight", "ffn_down.weight"},
        {"block_sparse_moe.gate.weight", "ffn_gate_inp.weight"},
        {"mlp.gate.weight", "ffn_gate_inp.weight"},
    };
    int layer, used = 0;
    if (!strcmp(hf, "model.embed_tokens.weight"))
        snprintf(out, cap, "token_embd.weight");
    else if (!strcmp(hf, "model.norm.weight"))
        snprintf(out, cap, "output_norm.weight");
    else if (!strcmp(hf, "lm_head.weight"))
        snprintf(out, cap, "output.weight");
    else {
        TD_ASSERT(sscanf(hf, "model.layers.%d.%n", &layer, &used) == 1 && used > 0);
        for (size_t i = 0; i < TD_ARRAY_LEN(map); i++)
            if (!strcmp(hf + used, map[i][0])) {
                snprintf(out, cap, "blk.%d.%s", layer, map[i][1]);
                return;
            }
        TD_ASSERT(!"a tensor list_tensors does not make");
    }
}

/* ggml's file type of a model whose matrices are `dt` (llama_ftype: ALL_F32 0, MOSTLY_F16
 * 1, MOSTLY_Q4_0 2, MOSTLY_Q8_0 7, MOSTLY_BF16 32). */
static uint32_t gguf_file_type(td_dtype_t dt)
{
    switch (dt) {
    case TD_F32: return 0;
    case TD_F16: return 1;
    case TD_Q4_0: return 2;
    case TD_Q8_0: return 7;
    default: return 32; /* bf16: the only other dtype synth accepts */
    }
}

/* Llama 3's rope_scaling as the per-pair divisors llama.cpp's converter writes
 * (rope_freqs.weight), in its float32 arithmetic. */
static void llama3_rope_freqs(const td_model_config_t *c, float *out)
{
    int half = c->head_dim / 2;
    double old_ctx = c->rope_original_max_pos;
    double low_wavelen = old_ctx / c->rope_low_freq_factor, high_wavelen = old_ctx / c->rope_high_freq_factor;
    for (int i = 0; i < half; i++) {
        float freq = 1.0f / powf(c->rope_theta, (float)(2 * i) / (float)c->head_dim);
        double wavelen = 2.0 * M_PI / freq;
        if (wavelen < high_wavelen)
            out[i] = 1.0f;
        else if (wavelen > low_wavelen)
            out[i] = c->rope_factor;
        else {
            double smooth = (old_ctx / wavelen - c->rope_low_freq_factor) /
                            (c->rope_high_freq_factor - c->rope_low_freq_factor);
            out[i] = (float)(1.0 / ((1.0 - smooth) / c->rope_factor + smooth));
        }
    }
}

/*
 * The tokenizer metadata llama.cpp needs, for the built-in byte tokenizer: a "gpt2" (byte
 * level BPE) vocabulary whose first 256 tokens are the byte characters, no merges, <s> 256
 * and </s> 257, and unused control tokens up to vocab_size (llama.cpp wants one token per
 * embedding row).
 */
static td_status_t gguf_tokenizer(td_gguf_writer_t *w, const td_model_config_t *c)
{
    size_t n = (size_t)c->vocab_size;
    char(*text)[32] = calloc(n, sizeof *text);
    const char **toks = calloc(n, sizeof *toks);
    int32_t *types = calloc(n, sizeof *types);
    td_status_t s = TD_OK;
    if (!text || !toks || !types) {
        s = td_errorf(TD_ERR_NOMEM, "synth: out of memory for the tokenizer");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        if (i < 256)
            utf8(byte_char((unsigned)i), text[i]);
        else if (i == TOK_BOS)
            snprintf(text[i], sizeof text[i], "<s>");
        else if (i == TOK_EOS)
            snprintf(text[i], sizeof text[i], "</s>");
        else
            snprintf(text[i], sizeof text[i], "<unused%zu>", i);
        toks[i] = text[i];
        types[i] = i < 256 ? 1 /* normal */ : i <= TOK_EOS ? 3 /* control */ : 5 /* unused */;
    }
    if ((s = td_gguf_writer_str(w, "tokenizer.ggml.model", "gpt2")) != TD_OK ||
        (s = td_gguf_writer_str(w, "tokenizer.ggml.pre", "default")) != TD_OK ||
        (s = td_gguf_writer_arr_str(w, "tokenizer.ggml.tokens", toks, n)) != TD_OK ||
        (s = td_gguf_writer_arr_i32(w, "tokenizer.ggml.token_type", types, n)) != TD_OK ||
        (s = td_gguf_writer_arr_str(w, "tokenizer.ggml.merges", NULL, 0)) != TD_OK ||
        (s = td_gguf_writer_u32(w, "tokenizer.ggml.bos_token_id", TOK_BOS)) != TD_OK ||
        (s = td_gguf_writer_u32(w, "tokenizer.ggml.eos_token_id", TOK_EOS)) != TD_OK ||
        (s = td_gguf_writer_bool(w, "tokenizer.ggml.add_bos_token", true)) != TD_OK)
        goto out;
out:
    free(types);
    free(toks);
    free(text);
    return s;
}

static td_status_t gguf_metadata(td_gguf_writer_t *w, const td_model_config_t *c, const char *arch, td_dtype_t dt)
{
    td_status_t s;
    char name[96], key[96];
    snprintf(name, sizeof name, "tandem synth %s", c->arch_name);
    if ((s = td_gguf_writer_str(w, "general.architecture", arch)) != TD_OK ||
        (s = td_gguf_writer_str(w, "general.name", name)) != TD_OK ||
        (s = td_gguf_writer_u32(w, "general.file_type", gguf_file_type(dt))) != TD_OK ||
        (td_dtype_is_block(dt) && (s = td_gguf_writer_u32(w, "general.quantization_version", 2)) != TD_OK))
        return s;
    const struct {
        const char *k;
        int32_t v;
    } ints[] = {
        {"context_length", c->max_seq_len},      {"embedding_length", c->dim},
        {"feed_forward_length", c->hidden_dim},  {"block_count", c->n_layers},
        {"attention.head_count", c->n_heads},    {"attention.head_count_kv", c->n_kv_heads},
        {"attention.key_length", c->head_dim},   {"attention.value_length", c->head_dim},
        {"rope.dimension_count", c->head_dim},   {"vocab_size", c->vocab_size},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(ints); i++) {
        snprintf(key, sizeof key, "%s.%s", arch, ints[i].k);
        if ((s = td_gguf_writer_u32(w, key, (uint32_t)ints[i].v)) != TD_OK)
            return s;
    }
    if (c->n_experts > 0) {
        const struct {
            const char *k;
            int32_t v;
        } moe[] = {
            {"expert_count", c->n_experts},
            {"expert_used_count", c->n_experts_used},
            {"expert_feed_forward_length", c->expert_hidden_dim},
        };
        /* llama.cpp's llama arch takes the experts' width from feed_forward_length */
        for (size_t i = 0; i < TD_ARRAY_LEN(moe) - (c->arch == TD_ARCH_MIXTRAL); i++) {
            snprintf(key, sizeof key, "%s.%s", arch, moe[i].k);
            if ((s = td_gguf_writer_u32(w, key, (uint32_t)moe[i].v)) != TD_OK)
                return s;
        }
    }
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", arch);
    if ((s = td_gguf_writer_f32(w, key, c->norm_eps)) != TD_OK)
        return s;
    snprintf(key, sizeof key, "%s.rope.freq_base", arch);
    if ((s = td_gguf_writer_f32(w, key, c->rope_theta)) != TD_OK)
        return s;
    if (c->sliding_window > 0) {
        /* GGUF has one window for every layer (tandem reads it; llama.cpp's llama and qwen2
           graphs ignore it and attend to the whole context) */
        if (td_model_kv_window(c) != c->sliding_window)
            return td_errorf(TD_ERR_UNSUPPORTED, "gguf: a sliding window on some layers only has no GGUF key");
        snprintf(key, sizeof key, "%s.attention.sliding_window", arch);
        if ((s = td_gguf_writer_u32(w, key, (uint32_t)c->sliding_window)) != TD_OK)
            return s;
    }
    return gguf_tokenizer(w, c);
}

/* llama.cpp's converter's permutation of a q or k projection's rows (n_head heads of hd
 * rows): within each head, row i and row i + hd/2 become rows 2i and 2i + 1, so that
 * adjacent-pair rope on the result is rotate_half rope on the original. */
static void permute_rows(float *dst, const float *src, int64_t n_head, int64_t hd, int64_t cols)
{
    for (int64_t h = 0; h < n_head; h++)
        for (int64_t i = 0; i < hd / 2; i++)
            for (int64_t j = 0; j < 2; j++)
                memcpy(dst + (h * hd + 2 * i + j) * cols, src + (h * hd + j * (hd / 2) + i) * cols,
                       (size_t)cols * sizeof *dst);
}

/* Streams one tensor's values (as write_values draws them) through the GGUF writer. */
static td_status_t gguf_values(td_gguf_writer_t *w, const synth_tensor_t *t, uint64_t seed, td_dtype_t dt,
                               const td_model_config_t *c, float *vals, void *conv)
{
    uint64_t state = seed ^ td_fnv1a64(TD_FNV1A64_INIT, t->name, strlen(t->name));
    size_t total = (size_t)t->shape[0] * (size_t)(t->n_dims == 2 ? t->shape[1] : 1);
    bool is_q = strstr(t->name, "q_proj.weight") != NULL, is_k = strstr(t->name, "k_proj.weight") != NULL;
    if ((is_q || is_k) && c->rope_style == TD_ROPE_PAIRS) {
        /* the whole matrix, to permute its rows (at most tens of MB for the presets) */
        float *orig = malloc(total * sizeof *orig), *perm = malloc(total * sizeof *perm);
        td_status_t s = TD_OK;
        if (!orig || !perm)
            s = td_errorf(TD_ERR_NOMEM, "synth: out of memory for %s", t->name);
        for (size_t i = 0; s == TD_OK && i < total; i++)
            orig[i] = SYNTH_STD * approx_normal(&state);
        if (s == TD_OK)
            permute_rows(perm, orig, is_q ? c->n_heads : c->n_kv_heads, c->head_dim, t->shape[1]);
        for (size_t done = 0; s == TD_OK && done < total;) {
            size_t n = TD_MIN((size_t)SYNTH_CHUNK, total - done);
            td_dtype_convert(conv, dt, perm + done, TD_F32, n);
            s = td_gguf_writer_write(w, conv, td_dtype_bytes(dt, n));
            done += n;
        }
        free(perm);
        free(orig);
        return s;
    }
    for (size_t done = 0; done < total;) {
        size_t n = TD_MIN((size_t)SYNTH_CHUNK, total - done);
        for (size_t i = 0; i < n; i++)
            vals[i] = t->kind == K_NORM ? 1.0f : SYNTH_STD * approx_normal(&state);
        td_dtype_convert(conv, dt, vals, TD_F32, n);
        td_status_t s = td_gguf_writer_write(w, conv, td_dtype_bytes(dt, n));
        if (s != TD_OK)
            return s;
        done += n;
    }
    return TD_OK;
}

td_status_t td_model_synth_gguf(const td_synth_params_t *p, const char *out_path)
{
    td_status_t s;
    td_model_config_t c = p->config;
    td_dtype_t dt = p->dtype;
    if (!td_dtype_is_float(dt) && dt != TD_Q8_0 && dt != TD_Q4_0)
        return td_errorf(TD_ERR_INVALID, "synth: GGUF matrices are f32, f16, bf16, q8_0 or q4_0, not %s",
                         td_dtype_name(dt));
    if (c.vocab_size < TOK_EOS + 1)
        return td_errorf(TD_ERR_INVALID, "synth: vocab_size %d is too small for the built-in byte tokenizer (needs "
                         "258)", c.vocab_size);
    c.bos_id = TOK_BOS;
    c.eos_ids[0] = TOK_EOS;
    c.n_eos = 1;
    /* llama.cpp's converter permutes llama/mistral q and k for adjacent-pair rope; qwen
     * models keep NeoX rope and their rows as they are */
    const char *arch = c.arch == TD_ARCH_QWEN3_MOE ? "qwen3moe" : td_model_arch_name(c.arch);
    if (c.arch == TD_ARCH_LLAMA || c.arch == TD_ARCH_MISTRAL || c.arch == TD_ARCH_MIXTRAL) {
        arch = "llama";
        c.rope_style = TD_ROPE_PAIRS;
    }
    if ((s = td_model_config_validate(&c, "synth config")) != TD_OK)
        return s;
    size_t blk = td_dtype_block_elems(dt);
    if (c.dim % (int32_t)blk || c.hidden_dim % (int32_t)blk || ((int64_t)c.n_heads * c.head_dim) % (int64_t)blk)
        return td_errorf(TD_ERR_INVALID, "synth: %s needs rows that are whole blocks of %zu weights; dim %d, "
                         "hidden_dim %d, n_heads x head_dim %d are not", td_dtype_name(dt), blk, c.dim,
                         c.hidden_dim, c.n_heads * c.head_dim);

    if (c.n_experts > 0 && !c.moe_norm_topk)
        return td_errorf(TD_ERR_INVALID, "synth: a GGUF mixture of experts renormalises its top-k weights "
                         "(llama.cpp's qwen3moe graph always does): norm_topk_prob false has no GGUF form");
    if (c.n_experts > 0 && c.expert_hidden_dim % (int32_t)blk)
        return td_errorf(TD_ERR_INVALID, "synth: %s needs rows that are whole blocks of %zu weights; the experts' "
                         "hidden_dim %d is not", td_dtype_name(dt), blk, c.expert_hidden_dim);
    size_t cap = max_tensors(&c);
    synth_tensor_t *t = calloc(cap, sizeof *t);
    float *vals = malloc(SYNTH_CHUNK * sizeof *vals);
    void *conv = malloc(SYNTH_CHUNK * sizeof(float));
    float *freqs = malloc((size_t)c.head_dim / 2 * sizeof *freqs);
    td_gguf_writer_t *w = NULL;
    if (!t || !vals || !conv || !freqs) {
        s = td_errorf(TD_ERR_NOMEM, "synth: out of memory");
        goto out;
    }
    size_t n = list_tensors(&c, TD_F32, t);
    if ((s = td_gguf_writer_create(out_path, &w)) != TD_OK || (s = gguf_metadata(w, &c, arch, dt)) != TD_OK)
        goto out;
    bool with_freqs = c.rope_llama3 && c.rope_style == TD_ROPE_PAIRS;
    for (size_t i = 0; i < n; i++) {
        char name[96];
        int64_t ne[3] = {t[i].n_dims == 2 ? t[i].shape[1] : t[i].shape[0], t[i].shape[0], c.n_experts};
        int n_dims = t[i].n_dims;
        /* vectors stay f32, as llama.cpp keeps them */
        td_dtype_t tdt = t[i].kind == K_MATRIX && !t[i].f32 ? dt : TD_F32;
        if (t[i].expert > 0)
            continue; /* inside the 3-D tensor expert 0 opens; its values follow in order */
        if (t[i].expert == 0) {
            int layer = 0;
            TD_ASSERT(sscanf(t[i].name, "model.layers.%d.", &layer) == 1);
            snprintf(name, sizeof name, "blk.%d.%s", layer, t[i].gguf_experts);
            n_dims = 3;
        } else {
            gguf_name(t[i].name, name, sizeof name);
        }
        if ((s = td_gguf_writer_tensor(w, name, n_dims, ne, td_dtype_to_ggml(tdt))) != TD_OK)
            goto out;
        if (i == 0 && with_freqs) {
            int64_t fne[1] = {c.head_dim / 2};
            if ((s = td_gguf_writer_tensor(w, "rope_freqs.weight", 1, fne, td_dtype_to_ggml(TD_F32))) != TD_OK)
                goto out;
        }
    }
    if ((s = td_gguf_writer_begin(w)) != TD_OK)
        goto out;
    for (size_t i = 0; i < n; i++) {
        td_dtype_t tdt = t[i].kind == K_MATRIX && !t[i].f32 ? dt : TD_F32;
        if ((s = gguf_values(w, &t[i], p->seed, tdt, &c, vals, conv)) != TD_OK)
            goto out;
        if (i == 0 && with_freqs) {
            llama3_rope_freqs(&c, freqs);
            if ((s = td_gguf_writer_write(w, freqs, (size_t)c.head_dim / 2 * sizeof *freqs)) != TD_OK)
                goto out;
        }
    }
    s = td_gguf_writer_finish(w);
out:
    td_gguf_writer_destroy(w); /* removes the file unless finished */
    free(freqs);
    free(conv);
    free(vals);
    free(t);
    return s;
}
