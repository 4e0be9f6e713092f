/*
 * td_model_config: the model's hyperparameters as data: parsing a Hugging Face
 * config.json, validating, writing one back, the fingerprint, and the named presets.
 *
 * Nothing here touches weights, so routers and tools can learn a model's shape (and its
 * KV footprint) from config.json alone.
 */
#include "td_model.h"

#include <cjson/cJSON.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_hash.h"
#include "td_kv_layout.h"
#include "td_util.h"

#define CFG_MAX_DIM (1 << 24) /* beyond any real model; keeps products inside int64 */
/* Positions: 16 Mi, beyond the longest published context (Llama 4 Scout, 10 Mi). Positions,
 * slots and block counts are int32 in the engine and the wire, and per-sequence tables
 * scale with it (max_seqs x max_seq_len / block_size block ids): this keeps every one of
 * them far from overflowing, where INT32_MAX overflowed them. */
#define CFG_MAX_SEQ (1 << 24)

static const struct {
    td_arch_t arch;
    const char *model_type;
    const char *hf_name;
} arch_table[] = {
    {TD_ARCH_LLAMA, "llama", "LlamaForCausalLM"},
    {TD_ARCH_MISTRAL, "mistral", "MistralForCausalLM"},
    {TD_ARCH_QWEN2, "qwen2", "Qwen2ForCausalLM"},
    {TD_ARCH_QWEN3, "qwen3", "Qwen3ForCausalLM"},
    {TD_ARCH_MIXTRAL, "mixtral", "MixtralForCausalLM"},
    {TD_ARCH_QWEN3_MOE, "qwen3_moe", "Qwen3MoeForCausalLM"},
};

const char *td_model_arch_name(td_arch_t arch)
{
    for (size_t i = 0; i < TD_ARRAY_LEN(arch_table); i++)
        if (arch_table[i].arch == arch)
            return arch_table[i].model_type;
    return "?";
}

int td_model_arch_parse(const char *s)
{
    for (size_t i = 0; i < TD_ARRAY_LEN(arch_table); i++)
        if (!strcmp(s, arch_table[i].model_type) || !strcmp(s, arch_table[i].hf_name))
            return (int)arch_table[i].arch;
    return -1;
}

static const char *arch_hf_name(td_arch_t arch)
{
    for (size_t i = 0; i < TD_ARRAY_LEN(arch_table); i++)
        if (arch_table[i].arch == arch)
            return arch_table[i].hf_name;
    return "?";
}

void td_model_config_set_arch(td_model_config_t *cfg, td_arch_t arch)
{
    cfg->arch = arch;
    snprintf(cfg->arch_name, sizeof cfg->arch_name, "%s", arch_hf_name(arch));
    cfg->rope_style = TD_ROPE_HALVES;
    cfg->qkv_bias = arch == TD_ARCH_QWEN2;
    cfg->qk_norm = arch == TD_ARCH_QWEN3 || arch == TD_ARCH_QWEN3_MOE;
    cfg->moe_norm_topk = arch == TD_ARCH_MIXTRAL;
}

static bool arch_is_moe(td_arch_t arch)
{
    return arch == TD_ARCH_MIXTRAL || arch == TD_ARCH_QWEN3_MOE;
}

/* ---- parsing ----------------------------------------------------------------------- */

/* An integer field in [min, max]. Missing: *out = dflt, or an error when required. */
static td_status_t get_int(const cJSON *root, const char *origin, const char *key, bool required, int64_t dflt,
                           int64_t min, int64_t max, int64_t *out)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!j || cJSON_IsNull(j)) {
        if (required)
            return td_errorf(TD_ERR_FORMAT, "%s: missing field \"%s\"", origin, key);
        *out = dflt;
        return TD_OK;
    }
    double d = j->valuedouble;
    if (!cJSON_IsNumber(j))
        return td_errorf(TD_ERR_FORMAT, "%s: field \"%s\" must be an integer in [%lld, %lld], not %s", origin, key,
                         (long long)min, (long long)max, cJSON_IsString(j) ? "a string" : "a non-number");
    if (floor(d) != d || d < (double)min || d > (double)max)
        return td_errorf(TD_ERR_FORMAT, "%s: %s %.17g is out of range: an integer in [%lld, %lld]", origin, key, d,
                         (long long)min, (long long)max);
    *out = (int64_t)d;
    return TD_OK;
}

static td_status_t get_num(const cJSON *root, const char *origin, const char *key, bool required, double dflt,
                           double *out)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!j || cJSON_IsNull(j)) {
        if (required)
            return td_errorf(TD_ERR_FORMAT, "%s: missing field \"%s\"", origin, key);
        *out = dflt;
        return TD_OK;
    }
    if (!cJSON_IsNumber(j) || !isfinite(j->valuedouble))
        return td_errorf(TD_ERR_FORMAT, "%s: field \"%s\" must be a number", origin, key);
    *out = j->valuedouble;
    return TD_OK;
}

/* A positive number stored as a float: (0, FLT_MAX], and not so small that it rounds to
 * zero. JSON's doubles go further both ways, and 1e39 would become inf. */
static td_status_t get_pos_float(const cJSON *root, const char *origin, const char *key, bool required, double dflt,
                                 double *out)
{
    td_status_t s = get_num(root, origin, key, required, dflt, out);
    if (s == TD_OK && !(*out > 0 && *out <= FLT_MAX && (float)*out > 0.0f))
        return td_errorf(TD_ERR_FORMAT, "%s: %s %g is out of range (0, %.2g]", origin, key, *out, (double)FLT_MAX);
    return s;
}

static td_status_t get_bool(const cJSON *root, const char *origin, const char *key, bool dflt, bool *out)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!j || cJSON_IsNull(j)) {
        *out = dflt;
        return TD_OK;
    }
    if (!cJSON_IsBool(j))
        return td_errorf(TD_ERR_FORMAT, "%s: field \"%s\" must be true or false", origin, key);
    *out = cJSON_IsTrue(j);
    return TD_OK;
}

/*
 * The sliding window (td_model_config_t.sliding_window) by Hugging Face's rules. Mistral and
 * Mixtral: sliding_window (null: none) on every layer. Qwen2/Qwen3/Qwen3-MoE: only with use_sliding_window, on
 * the layers from max_window_layers (default 28) on. layer_types ("sliding_attention" or
 * "full_attention" per layer), where a config has it, decides each layer's kind instead.
 * Llama has no window. A window that no layer uses is no window (sliding_window 0).
 */
static td_status_t parse_sliding_window(const cJSON *root, const char *origin, td_model_config_t *cfg)
{
    td_status_t s;
    bool use = cfg->arch == TD_ARCH_MISTRAL || cfg->arch == TD_ARCH_MIXTRAL;
    bool qwen = cfg->arch == TD_ARCH_QWEN2 || cfg->arch == TD_ARCH_QWEN3 || cfg->arch == TD_ARCH_QWEN3_MOE;
    if (qwen && (s = get_bool(root, origin, "use_sliding_window", false, &use)) != TD_OK)
        return s;
    int64_t window = 0, first = 0;
    if (use && (s = get_int(root, origin, "sliding_window", false, 0, 1, CFG_MAX_SEQ, &window)) != TD_OK)
        return s;
    if (window == 0)
        return TD_OK;
    if (qwen && (s = get_int(root, origin, "max_window_layers", false, 28, 0, CFG_MAX_DIM, &first)) != TD_OK)
        return s;
    const cJSON *types = cJSON_GetObjectItemCaseSensitive(root, "layer_types");
    if (types && !cJSON_IsNull(types) &&
        (!cJSON_IsArray(types) || cJSON_GetArraySize(types) != cfg->n_layers))
        return td_errorf(TD_ERR_FORMAT, "%s: layer_types must list num_hidden_layers (%d) layer kinds", origin,
                         cfg->n_layers);
    memset(cfg->swa_layers, 0, sizeof cfg->swa_layers);
    bool any = false;
    const cJSON *t = cJSON_IsArray(types) ? types->child : NULL; /* walked, not indexed: O(n) */
    for (int32_t l = 0; l < cfg->n_layers; l++, t = t ? t->next : NULL) {
        bool slides = l >= first;
        if (cJSON_IsArray(types)) {
            const char *k = cJSON_IsString(t) ? t->valuestring : "";
            slides = !strcmp(k, "sliding_attention");
            if (!slides && strcmp(k, "full_attention"))
                return td_errorf(TD_ERR_UNSUPPORTED, "%s: layer_types[%d] must be \"sliding_attention\" or "
                                 "\"full_attention\", not \"%.40s\"", origin, l, k);
        }
        if (!slides)
            continue;
        if (l >= TD_SWA_MAX_LAYERS)
            return td_errorf(TD_ERR_UNSUPPORTED, "%s: layer %d slides; per-layer windows are supported for the "
                             "first %d layers", origin, l, TD_SWA_MAX_LAYERS);
        cfg->swa_layers[l / 64] |= 1ull << (l % 64);
        any = true;
    }
    cfg->sliding_window = any ? (int32_t)window : 0;
    return TD_OK;
}

int32_t td_model_layer_window(const td_model_config_t *c, int32_t layer)
{
    if (c->sliding_window <= 0 || layer < 0 || layer >= TD_SWA_MAX_LAYERS)
        return 0;
    return (c->swa_layers[layer / 64] >> (layer % 64)) & 1 ? c->sliding_window : 0;
}

int32_t td_model_kv_window(const td_model_config_t *c)
{
    int32_t w = 0;
    for (int32_t l = 0; l < c->n_layers; l++) {
        int32_t lw = td_model_layer_window(c, l);
        if (lw == 0)
            return 0;
        w = TD_MAX(w, lw);
    }
    return w;
}

void td_model_config_set_window(td_model_config_t *c, int32_t window)
{
    memset(c->swa_layers, 0, sizeof c->swa_layers);
    c->sliding_window = window > 0 ? window : 0;
    for (int32_t l = 0; window > 0 && l < TD_MIN(c->n_layers, TD_SWA_MAX_LAYERS); l++)
        c->swa_layers[l / 64] |= 1ull << (l % 64);
}

/* eos_token_id: an int, a list of ints, or null. Appends to cfg's list without duplicates. */
static td_status_t get_eos(const cJSON *root, const char *origin, td_model_config_t *cfg)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(root, "eos_token_id");
    if (!j || cJSON_IsNull(j))
        return TD_OK;
    const cJSON *items = j;
    int n = 1;
    if (cJSON_IsArray(j)) {
        n = cJSON_GetArraySize(j);
        items = j->child;
    }
    for (int i = 0; i < n; i++, items = items->next) {
        double d = items->valuedouble;
        if (!cJSON_IsNumber(items) || floor(d) != d || d < 0 || d > INT32_MAX)
            return td_errorf(TD_ERR_FORMAT, "%s: eos_token_id must be a token id or a list of them", origin);
        int32_t id = (int32_t)d;
        bool dup = false;
        for (int k = 0; k < cfg->n_eos; k++)
            dup |= cfg->eos_ids[k] == id;
        if (dup)
            continue;
        if (cfg->n_eos == TD_MAX_EOS)
            return td_errorf(TD_ERR_UNSUPPORTED, "%s: more than %d eos_token_id values", origin, TD_MAX_EOS);
        cfg->eos_ids[cfg->n_eos++] = id;
    }
    return TD_OK;
}

static td_status_t parse_rope_scaling(const cJSON *root, const char *origin, td_model_config_t *cfg)
{
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    if (!rs || cJSON_IsNull(rs))
        return TD_OK;
    if (!cJSON_IsObject(rs))
        return td_errorf(TD_ERR_FORMAT, "%s: rope_scaling must be an object or null", origin);
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(rs, "rope_type");
    if (!ty)
        ty = cJSON_GetObjectItemCaseSensitive(rs, "type");
    if (!cJSON_IsString(ty))
        return td_errorf(TD_ERR_FORMAT, "%s: rope_scaling needs a \"rope_type\"", origin);
    if (!strcmp(ty->valuestring, "default"))
        return TD_OK;
    if (strcmp(ty->valuestring, "llama3") != 0)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: rope_scaling type \"%.32s\" is not supported (only llama3)", origin,
                         ty->valuestring);
    double f = 0, lo = 0, hi = 0;
    int64_t orig = 0;
    td_status_t s;
    if ((s = get_pos_float(rs, origin, "factor", true, 0, &f)) != TD_OK ||
        (s = get_pos_float(rs, origin, "low_freq_factor", true, 0, &lo)) != TD_OK ||
        (s = get_pos_float(rs, origin, "high_freq_factor", true, 0, &hi)) != TD_OK ||
        (s = get_int(rs, origin, "original_max_position_embeddings", true, 0, 1, INT32_MAX, &orig)) != TD_OK)
        return s;
    cfg->rope_llama3 = true;
    cfg->rope_factor = (float)f;
    cfg->rope_low_freq_factor = (float)lo;
    cfg->rope_high_freq_factor = (float)hi;
    cfg->rope_original_max_pos = (int32_t)orig;
    return TD_OK;
}

/* The experts of a Mixtral (num_local_experts, intermediate_size per expert) or Qwen3-MoE
 * (num_experts, moe_intermediate_size, norm_topk_prob) config.json. Qwen3-MoE configs that
 * keep some layers dense (mlp_only_layers, decoder_sparse_step > 1) are refused: no
 * published checkpoint has them and the engine has one FFN kind per model. */
static td_status_t parse_moe(const cJSON *root, const char *origin, td_model_config_t *cfg)
{
    bool mixtral = cfg->arch == TD_ARCH_MIXTRAL;
    int64_t e = 0, k = 0, fe = cfg->hidden_dim, step = 1;
    td_status_t s;
    if ((s = get_int(root, origin, mixtral ? "num_local_experts" : "num_experts", true, 0, 1, CFG_MAX_DIM, &e)) !=
            TD_OK ||
        (s = get_int(root, origin, "num_experts_per_tok", true, 0, 1, CFG_MAX_DIM, &k)) != TD_OK ||
        (!mixtral &&
         (s = get_int(root, origin, "moe_intermediate_size", true, 0, 1, CFG_MAX_DIM, &fe)) != TD_OK) ||
        (!mixtral && (s = get_bool(root, origin, "norm_topk_prob", false, &cfg->moe_norm_topk)) != TD_OK) ||
        (!mixtral && (s = get_int(root, origin, "decoder_sparse_step", false, 1, 1, CFG_MAX_DIM, &step)) != TD_OK))
        return s;
    const cJSON *dense = cJSON_GetObjectItemCaseSensitive(root, "mlp_only_layers");
    if (step != 1 || (cJSON_IsArray(dense) && cJSON_GetArraySize(dense) > 0))
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: decoder_sparse_step %lld / mlp_only_layers: dense layers "
                         "between the expert layers are not supported (every layer must be sparse)", origin,
                         (long long)step);
    cfg->n_experts = (int32_t)e;
    cfg->n_experts_used = (int32_t)k;
    cfg->expert_hidden_dim = (int32_t)fe;
    return TD_OK;
}

td_status_t td_model_config_from_json(const char *json, const char *origin, td_model_config_t *cfg_out)
{
    td_status_t s = TD_OK;
    td_model_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    json += td_utf8_bom_len(json, strlen(json));
    if (json[strspn(json, " \t\r\n")] == 0) {
        s = td_errorf(TD_ERR_FORMAT, "%s: empty file: expected a JSON object", origin);
        return s;
    }
    cJSON *root = cJSON_Parse(json);
    if (!cJSON_IsObject(root)) {
        const char *at = root ? NULL : cJSON_GetErrorPtr();
        if (at && at >= json && at <= json + strlen(json))
            s = td_errorf(TD_ERR_FORMAT, "%s: bad JSON at byte %zu", origin, (size_t)(at - json));
        else
            s = td_errorf(TD_ERR_FORMAT, "%s: not a JSON object", origin);
        goto out;
    }

    /* Architecture: "architectures"[0], else "model_type". */
    const char *an = NULL;
    const cJSON *archs = cJSON_GetObjectItemCaseSensitive(root, "architectures");
    if (cJSON_IsArray(archs) && cJSON_IsString(cJSON_GetArrayItem(archs, 0)))
        an = cJSON_GetArrayItem(archs, 0)->valuestring;
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!an && cJSON_IsString(mt))
        an = mt->valuestring;
    if (!an) {
        s = td_errorf(TD_ERR_FORMAT, "%s: missing field \"architectures\" (or \"model_type\")", origin);
        goto out;
    }
    int arch = td_model_arch_parse(an);
    if (arch < 0) {
        s = td_errorf(TD_ERR_UNSUPPORTED,
                      "%s: architecture %.64s is not supported (LlamaForCausalLM, MistralForCausalLM, "
                      "Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM are)",
                      origin, an);
        goto out;
    }
    td_model_config_set_arch(&cfg, (td_arch_t)arch);
    snprintf(cfg.arch_name, sizeof cfg.arch_name, "%s", an);

    int64_t dim = 0, hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0, max_pos = 0, bos = -1;
    double eps = 0, theta = 0;
    if ((s = get_int(root, origin, "hidden_size", true, 0, 1, CFG_MAX_DIM, &dim)) != TD_OK ||
        (s = get_int(root, origin, "intermediate_size", true, 0, 1, CFG_MAX_DIM, &hidden)) != TD_OK ||
        (s = get_int(root, origin, "num_hidden_layers", true, 0, 1, CFG_MAX_DIM, &layers)) != TD_OK ||
        (s = get_int(root, origin, "num_attention_heads", true, 0, 1, CFG_MAX_DIM, &heads)) != TD_OK ||
        (s = get_int(root, origin, "num_key_value_heads", false, heads, 1, CFG_MAX_DIM, &kv_heads)) != TD_OK ||
        (s = get_int(root, origin, "vocab_size", true, 0, 1, CFG_MAX_DIM, &vocab)) != TD_OK ||
        (s = get_int(root, origin, "max_position_embeddings", true, 0, 1, CFG_MAX_SEQ, &max_pos)) != TD_OK ||
        (s = get_int(root, origin, "bos_token_id", false, -1, -1, INT32_MAX, &bos)) != TD_OK ||
        (s = get_pos_float(root, origin, "rms_norm_eps", false, 1e-6, &eps)) != TD_OK ||
        (s = get_pos_float(root, origin, "rope_theta", false, 10000.0, &theta)) != TD_OK ||
        (s = get_bool(root, origin, "tie_word_embeddings", false, &cfg.tie_embeddings)) != TD_OK)
        goto out;
    if (heads <= 0) {
        s = td_errorf(TD_ERR_FORMAT, "%s: num_attention_heads must be positive, got %lld", origin, (long long)heads);
        goto out;
    }
    const cJSON *hd = cJSON_GetObjectItemCaseSensitive(root, "head_dim");
    if (hd && !cJSON_IsNull(hd)) {
        if ((s = get_int(root, origin, "head_dim", true, 0, 1, CFG_MAX_DIM, &head_dim)) != TD_OK)
            goto out;
    } else {
        if (dim % heads != 0) {
            s = td_errorf(TD_ERR_FORMAT, "%s: hidden_size %lld is not divisible by num_attention_heads %lld "
                          "and no head_dim is given", origin, (long long)dim, (long long)heads);
            goto out;
        }
        head_dim = dim / heads;
    }
    cfg.dim = (int32_t)dim;
    cfg.hidden_dim = (int32_t)hidden;
    cfg.n_layers = (int32_t)layers;
    cfg.n_heads = (int32_t)heads;
    cfg.n_kv_heads = (int32_t)kv_heads;
    cfg.head_dim = (int32_t)head_dim;
    cfg.vocab_size = (int32_t)vocab;
    cfg.max_seq_len = (int32_t)max_pos;
    cfg.bos_id = (int32_t)bos;
    cfg.norm_eps = (float)eps;
    cfg.rope_theta = (float)theta;
    if ((s = get_eos(root, origin, &cfg)) != TD_OK || (s = parse_rope_scaling(root, origin, &cfg)) != TD_OK)
        goto out;

    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, "hidden_act");
    if (act && !(cJSON_IsString(act) && !strcmp(act->valuestring, "silu"))) {
        s = td_errorf(TD_ERR_UNSUPPORTED, "%s: hidden_act must be \"silu\"", origin);
        goto out;
    }
    bool attn_bias, mlp_bias;
    if ((s = get_bool(root, origin, "attention_bias", false, &attn_bias)) != TD_OK ||
        (s = get_bool(root, origin, "mlp_bias", false, &mlp_bias)) != TD_OK)
        goto out;
    if ((attn_bias && cfg.arch != TD_ARCH_QWEN2) || mlp_bias) {
        s = td_errorf(TD_ERR_UNSUPPORTED, "%s: %s is not supported (no o_proj/mlp bias in the engine)", origin,
                      mlp_bias ? "mlp_bias" : "attention_bias");
        goto out;
    }

    if ((s = parse_sliding_window(root, origin, &cfg)) != TD_OK)
        goto out;

    if (arch_is_moe(cfg.arch) && (s = parse_moe(root, origin, &cfg)) != TD_OK)
        goto out;

    const cJSON *tdt = cJSON_GetObjectItemCaseSensitive(root, "torch_dtype");
    if (!tdt)
        tdt = cJSON_GetObjectItemCaseSensitive(root, "dtype");
    int dt = cJSON_IsString(tdt) ? td_dtype_parse(tdt->valuestring) : -1;
    cfg.dtype = dt >= 0 ? (td_dtype_t)dt : TD_F32;

    if ((s = td_model_config_validate(&cfg, origin)) != TD_OK)
        goto out;
    *cfg_out = cfg;
out:
    cJSON_Delete(root);
    return s;
}

/* ---- validation -------------------------------------------------------------------- */

td_status_t td_model_config_validate(const td_model_config_t *c, const char *origin)
{
    const struct {
        const char *name;
        int32_t v;
    } dims[] = {
        {"hidden_size (dim)", c->dim},           {"intermediate_size (hidden_dim)", c->hidden_dim},
        {"num_hidden_layers", c->n_layers},       {"num_attention_heads", c->n_heads},
        {"num_key_value_heads", c->n_kv_heads},   {"head_dim", c->head_dim},
        {"vocab_size", c->vocab_size},            {"max_position_embeddings (seq_len)", c->max_seq_len},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(dims); i++) {
        int32_t max = i == 7 ? CFG_MAX_SEQ : CFG_MAX_DIM;
        if (dims[i].v <= 0 || dims[i].v > max)
            return td_errorf(TD_ERR_FORMAT, "%s: %s %d is out of range [1, %d]", origin, dims[i].name, dims[i].v,
                             max);
    }
    if (c->n_heads % c->n_kv_heads != 0)
        return td_errorf(TD_ERR_FORMAT, "%s: num_attention_heads %d is not divisible by num_key_value_heads %d",
                         origin, c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2 != 0)
        return td_errorf(TD_ERR_FORMAT, "%s: head_dim %d must be even for rotary embeddings", origin, c->head_dim);
    if ((int64_t)c->n_heads * c->head_dim > CFG_MAX_DIM)
        return td_errorf(TD_ERR_FORMAT, "%s: num_attention_heads x head_dim is implausibly large", origin);
    if (!(c->norm_eps > 0.0f) || !isfinite(c->norm_eps))
        return td_errorf(TD_ERR_FORMAT, "%s: rms_norm_eps %g is out of range (0, %.2g]", origin, (double)c->norm_eps,
                         (double)FLT_MAX);
    if (!(c->rope_theta > 0.0f) || !isfinite(c->rope_theta))
        return td_errorf(TD_ERR_FORMAT, "%s: rope_theta %g is out of range (0, %.2g]", origin, (double)c->rope_theta,
                         (double)FLT_MAX);
    if (c->rope_llama3 &&
        (!(c->rope_factor > 0.0f) || !(c->rope_low_freq_factor > 0.0f) ||
         !(c->rope_high_freq_factor > c->rope_low_freq_factor) || c->rope_original_max_pos <= 0))
        return td_errorf(TD_ERR_FORMAT, "%s: rope_scaling llama3 needs factor > 0, 0 < low_freq_factor < "
                         "high_freq_factor and original_max_position_embeddings > 0", origin);
    if (c->sliding_window < 0 || c->sliding_window > CFG_MAX_SEQ)
        return td_errorf(TD_ERR_FORMAT, "%s: sliding_window %d is out of range [1, %d] (0: none)", origin,
                         c->sliding_window, CFG_MAX_SEQ);
    if (c->sliding_window > 0 && c->n_layers > TD_SWA_MAX_LAYERS)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: a sliding window on a model of %d layers (at most %d)", origin,
                         c->n_layers, TD_SWA_MAX_LAYERS);
    if (arch_is_moe(c->arch) != (c->n_experts > 0))
        return td_errorf(TD_ERR_FORMAT, "%s: a %s model needs %s (num_local_experts / num_experts / "
                         "expert_count), got %d", origin, td_model_arch_name(c->arch),
                         arch_is_moe(c->arch) ? "experts" : "no experts", c->n_experts);
    if (c->n_experts > 0) {
        if (c->n_experts > TD_MAX_EXPERTS)
            return td_errorf(TD_ERR_FORMAT, "%s: num_experts (expert_count) %d is out of range [1, %d]", origin,
                             c->n_experts, TD_MAX_EXPERTS);
        if (c->n_experts_used < 1 || c->n_experts_used > c->n_experts)
            return td_errorf(TD_ERR_FORMAT, "%s: num_experts_per_tok (expert_used_count) %d is out of range "
                             "[1, %d]: a token cannot use more experts than the %d there are", origin,
                             c->n_experts_used, c->n_experts, c->n_experts);
        if (c->expert_hidden_dim < 1 || c->expert_hidden_dim > CFG_MAX_DIM)
            return td_errorf(TD_ERR_FORMAT, "%s: the experts' intermediate size (moe_intermediate_size / "
                             "expert_feed_forward_length) %d is out of range [1, %d]", origin,
                             c->expert_hidden_dim, CFG_MAX_DIM);
    }
    if (c->bos_id < -1 || c->bos_id >= c->vocab_size)
        return td_errorf(TD_ERR_FORMAT, "%s: bos_token_id %d is outside the vocabulary (%d)", origin, c->bos_id,
                         c->vocab_size);
    if (c->n_eos < 0 || c->n_eos > TD_MAX_EOS)
        return td_errorf(TD_ERR_FORMAT, "%s: %d eos ids (at most %d)", origin, c->n_eos, TD_MAX_EOS);
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] < 0 || c->eos_ids[i] >= c->vocab_size)
            return td_errorf(TD_ERR_FORMAT, "%s: eos_token_id %d is outside the vocabulary (%d)", origin,
                             c->eos_ids[i], c->vocab_size);
    return TD_OK;
}

/* ---- derived numbers --------------------------------------------------------------- */

uint64_t td_model_param_count(const td_model_config_t *c)
{
    uint64_t d = (uint64_t)c->dim, f = (uint64_t)c->hidden_dim, hd = (uint64_t)c->head_dim;
    uint64_t q = (uint64_t)c->n_heads * hd, kv = (uint64_t)c->n_kv_heads * hd;
    uint64_t layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * f;
    if (c->n_experts > 0) /* the router, and the experts instead of the dense FFN */
        layer += (uint64_t)c->n_experts * (d + 3 * d * (uint64_t)c->expert_hidden_dim) - 3 * d * f;
    if (c->qkv_bias)
        layer += q + 2 * kv;
    if (c->qk_norm)
        layer += 2 * hd;
    uint64_t embed = (uint64_t)c->vocab_size * d;
    return embed * (c->tie_embeddings ? 1 : 2) + d + layer * (uint64_t)c->n_layers;
}

uint64_t td_model_active_param_count(const td_model_config_t *c)
{
    uint64_t idle = (uint64_t)(c->n_experts - c->n_experts_used) * 3 * (uint64_t)c->dim *
                    (uint64_t)c->expert_hidden_dim * (uint64_t)c->n_layers;
    return td_model_param_count(c) - (c->n_experts > 0 ? idle : 0);
}

uint64_t td_model_kv_bytes_per_token(const td_model_config_t *c, td_dtype_t kv_dtype)
{
    return 2ull * (uint64_t)c->n_layers * td_kv_bytes(kv_dtype, (size_t)c->n_kv_heads * (size_t)c->head_dim);
}

/* ---- fingerprint ------------------------------------------------------------------- */

typedef struct fnv {
    uint64_t h;
} fnv_t;

/* Little-endian whatever the host, so the hash is the same on every node. */
static void fnv_u32(fnv_t *f, uint32_t v)
{
    unsigned char b[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                          (unsigned char)(v >> 24)};
    f->h = td_fnv1a64(f->h, b, 4);
}

static void fnv_f32(fnv_t *f, float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    fnv_u32(f, u);
}

uint64_t td_model_fingerprint(const td_model_config_t *c)
{
    /* Everything the forward pass and the KV cache depend on, and nothing else: not the
     * weights' storage dtype, not the context limit, not bos/eos, not the path. Bump the
     * tag when the set of fields changes. */
    fnv_t f = {td_fnv1a64(TD_FNV1A64_INIT, "tandem-fp-1", 11)};
    fnv_u32(&f, (uint32_t)c->arch);
    fnv_u32(&f, (uint32_t)c->dim);
    fnv_u32(&f, (uint32_t)c->hidden_dim);
    fnv_u32(&f, (uint32_t)c->n_layers);
    fnv_u32(&f, (uint32_t)c->n_heads);
    fnv_u32(&f, (uint32_t)c->n_kv_heads);
    fnv_u32(&f, (uint32_t)c->head_dim);
    fnv_u32(&f, (uint32_t)c->vocab_size);
    fnv_f32(&f, c->norm_eps);
    fnv_f32(&f, c->rope_theta);
    fnv_u32(&f, (uint32_t)c->rope_style);
    fnv_u32(&f, c->rope_llama3);
    if (c->rope_llama3) {
        fnv_f32(&f, c->rope_factor);
        fnv_f32(&f, c->rope_low_freq_factor);
        fnv_f32(&f, c->rope_high_freq_factor);
        fnv_u32(&f, (uint32_t)c->rope_original_max_pos);
    }
    fnv_u32(&f, c->tie_embeddings);
    fnv_u32(&f, c->qkv_bias);
    fnv_u32(&f, c->qk_norm);
    /* only when present, so models without them keep the fingerprints they had */
    if (c->n_experts > 0) {
        fnv_u32(&f, (uint32_t)c->n_experts);
        fnv_u32(&f, (uint32_t)c->n_experts_used);
        fnv_u32(&f, (uint32_t)c->expert_hidden_dim);
        fnv_u32(&f, c->moe_norm_topk);
    }
    if (c->rope_freqs_hash) {
        fnv_u32(&f, (uint32_t)c->rope_freqs_hash);
        fnv_u32(&f, (uint32_t)(c->rope_freqs_hash >> 32));
    }
    if (c->sliding_window > 0) {
        fnv_u32(&f, (uint32_t)c->sliding_window);
        for (int32_t l = 0; l < c->n_layers; l++)
            fnv_u32(&f, td_model_layer_window(c, l) > 0);
    }
    return f.h;
}

/* ---- presets ----------------------------------------------------------------------- */

const char *const td_model_preset_names[] = {
    "tiny", "small", "tinyllama-1.1b", "llama-3.2-1b", "llama-3-8b", "qwen2-7b", "qwen3-0.6b", "tiny-swa",
    "mistral-7b", "tiny-mixtral", "tiny-qwen3moe", "mixtral-8x7b", "qwen3-30b-a3b", NULL,
};

typedef struct preset {
    const char *name;
    td_arch_t arch;
    int32_t dim, hidden, layers, heads, kv_heads, head_dim, vocab, max_pos;
    float eps, theta;
    bool tie;
    int32_t bos, eos;
    float r3_factor, r3_low, r3_high; /* llama3 rope scaling when r3_factor > 0 */
    int32_t r3_orig;
    int32_t experts, experts_used, expert_hidden; /* a mixture of experts when experts > 0 */
    bool norm_topk;
} preset_t;

/* Values from each model's published config.json (base models). */
static const preset_t presets[] = {
    /* name            arch           dim   ffn    L   H   KV  hd   vocab   maxpos  eps    theta     tie */
    {"tiny", TD_ARCH_LLAMA, 64, 176, 4, 8, 4, 8, 512, 2048, 1e-5f, 10000.0f, false, 256, 257, 0, 0, 0, 0, 0, 0, 0, false},
    {"small", TD_ARCH_LLAMA, 768, 2048, 12, 12, 4, 64, 32000, 2048, 1e-5f, 10000.0f, true, 1, 2, 0, 0, 0, 0, 0, 0, 0, false},
    {"tinyllama-1.1b", TD_ARCH_LLAMA, 2048, 5632, 22, 32, 4, 64, 32000, 2048, 1e-5f, 10000.0f, false, 1, 2, 0, 0,
     0, 0, 0, 0, 0, false},
    {"llama-3.2-1b", TD_ARCH_LLAMA, 2048, 8192, 16, 32, 8, 64, 128256, 131072, 1e-5f, 500000.0f, true, 128000,
     128001, 32.0f, 1.0f, 4.0f, 8192, 0, 0, 0, false},
    {"llama-3-8b", TD_ARCH_LLAMA, 4096, 14336, 32, 32, 8, 128, 128256, 8192, 1e-5f, 500000.0f, false, 128000,
     128001, 0, 0, 0, 0, 0, 0, 0, false},
    {"qwen2-7b", TD_ARCH_QWEN2, 3584, 18944, 28, 28, 4, 128, 152064, 131072, 1e-6f, 1000000.0f, false, 151643,
     151643, 0, 0, 0, 0, 0, 0, 0, false},
    {"qwen3-0.6b", TD_ARCH_QWEN3, 1024, 3072, 28, 16, 8, 128, 151936, 40960, 1e-6f, 1000000.0f, true, 151643,
     151645, 0, 0, 0, 0, 0, 0, 0, false},
    /* mixtures of experts: two tiny ones for tests (rows whole q8_0/q4_0 blocks), and the
       layouts of Mixtral-8x7B and Qwen3-30B-A3B (experts, top-k, expert FFN width) */
    {"tiny-mixtral", TD_ARCH_MIXTRAL, 64, 96, 3, 8, 4, 8, 512, 2048, 1e-5f, 1000000.0f, false, 256, 257, 0, 0, 0,
     0, 4, 2, 96, true},
    {"tiny-qwen3moe", TD_ARCH_QWEN3_MOE, 64, 192, 3, 4, 2, 16, 512, 2048, 1e-6f, 1000000.0f, false, 256, 257, 0, 0,
     0, 0, 8, 3, 32, true},
    {"mixtral-8x7b", TD_ARCH_MIXTRAL, 4096, 14336, 32, 32, 8, 128, 32000, 32768, 1e-5f, 1000000.0f, false, 1, 2,
     0, 0, 0, 0, 8, 2, 14336, true},
    {"qwen3-30b-a3b", TD_ARCH_QWEN3_MOE, 2048, 6144, 48, 32, 4, 128, 151936, 40960, 1e-6f, 1000000.0f, false,
     151643, 151645, 0, 0, 0, 0, 128, 8, 768, true},
    {"tiny-swa", TD_ARCH_MISTRAL, 64, 176, 4, 8, 4, 8, 512, 2048, 1e-5f, 10000.0f, false, 256, 257, 0, 0, 0, 0,
     0, 0, 0, false},
    {"mistral-7b", TD_ARCH_MISTRAL, 4096, 14336, 32, 32, 8, 128, 32000, 32768, 1e-5f, 10000.0f, false, 1, 2, 0,
     0, 0, 0, 0, 0, 0, false},
};

/* Presets whose every layer slides (Mistral's sliding_window). tiny-swa: tiny with a window
   of 40 tokens (2.5 blocks of 16: a window need not be whole blocks), for tests that run
   past the window. */
static const struct {
    const char *name;
    int32_t window;
} preset_windows[] = {
    {"tiny-swa", 40},
    {"mistral-7b", 4096},
};

td_status_t td_model_preset(const char *name, td_model_config_t *cfg)
{
    for (size_t i = 0; i < TD_ARRAY_LEN(presets); i++) {
        const preset_t *p = &presets[i];
        if (strcmp(name, p->name) != 0)
            continue;
        td_model_config_t c;
        memset(&c, 0, sizeof c);
        td_model_config_set_arch(&c, p->arch);
        c.dim = p->dim;
        c.hidden_dim = p->hidden;
        c.n_layers = p->layers;
        c.n_heads = p->heads;
        c.n_kv_heads = p->kv_heads;
        c.head_dim = p->head_dim;
        c.vocab_size = p->vocab;
        c.max_seq_len = p->max_pos;
        c.norm_eps = p->eps;
        c.rope_theta = p->theta;
        c.tie_embeddings = p->tie;
        c.dtype = TD_BF16;
        c.bos_id = p->bos;
        c.eos_ids[0] = p->eos;
        c.n_eos = 1;
        if (p->r3_factor > 0) {
            c.rope_llama3 = true;
            c.rope_factor = p->r3_factor;
            c.rope_low_freq_factor = p->r3_low;
            c.rope_high_freq_factor = p->r3_high;
            c.rope_original_max_pos = p->r3_orig;
        }
        for (size_t k = 0; k < TD_ARRAY_LEN(preset_windows); k++)
            if (!strcmp(name, preset_windows[k].name))
                td_model_config_set_window(&c, preset_windows[k].window);
        c.n_experts = p->experts;
        c.n_experts_used = p->experts_used;
        c.expert_hidden_dim = p->expert_hidden;
        c.moe_norm_topk = p->norm_topk;
        *cfg = c;
        return TD_OK;
    }
    return td_errorf_quiet(TD_ERR_NOT_FOUND, "no model preset named \"%s\"", name);
}

/* ---- writing config.json ----------------------------------------------------------- */

/* The shortest decimal that reads back as the same float, so 1e-5f is written "1e-05"
 * and not "9.99999974737875e-06". */
static double float_to_nice_double(float f)
{
    char buf[32];
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, (double)f);
        double d = strtod(buf, NULL);
        if ((float)d == f)
            return d;
    }
    return (double)f;
}

/* The window the way the arch's config.json says it: sliding_window (Qwen: with
 * use_sliding_window and max_window_layers 0, so every layer slides), and layer_types when
 * only some layers slide (newer transformers configs' per-layer list, which
 * parse_sliding_window reads for every arch). */
static td_status_t add_sliding_window(cJSON *r, const td_model_config_t *c)
{
    bool qwen = c->arch == TD_ARCH_QWEN2 || c->arch == TD_ARCH_QWEN3 || c->arch == TD_ARCH_QWEN3_MOE;
    if (c->arch == TD_ARCH_LLAMA && c->sliding_window > 0)
        return td_errorf(TD_ERR_UNSUPPORTED, "config.json: a llama config has no sliding window (arch mistral, "
                         "qwen2 or qwen3 has)");
    if (c->sliding_window <= 0) {
        if (qwen)
            cJSON_AddBoolToObject(r, "use_sliding_window", false);
        cJSON_AddNullToObject(r, "sliding_window");
        return TD_OK;
    }
    bool all = true;
    for (int32_t l = 0; l < c->n_layers; l++)
        all = all && td_model_layer_window(c, l) > 0;
    if (qwen)
        cJSON_AddBoolToObject(r, "use_sliding_window", true);
    cJSON_AddNumberToObject(r, "sliding_window", c->sliding_window);
    if (qwen)
        cJSON_AddNumberToObject(r, "max_window_layers", 0);
    if (!all) {
        cJSON *t = cJSON_AddArrayToObject(r, "layer_types");
        if (!t)
            return td_errorf(TD_ERR_NOMEM, "config.json: out of memory");
        for (int32_t l = 0; l < c->n_layers; l++)
            cJSON_AddItemToArray(t, cJSON_CreateString(td_model_layer_window(c, l) > 0 ? "sliding_attention"
                                                                                         : "full_attention"));
    }
    return TD_OK;
}

td_status_t td_model_config_to_json(const td_model_config_t *c, td_dtype_t dtype, char **json_p)
{
    td_status_t s;
    static const char *const torch_dtypes[] = {"float32", "float16", "bfloat16"};
    cJSON *r = cJSON_CreateObject();
    if (!r)
        return td_errorf(TD_ERR_NOMEM, "config.json: out of memory");
    cJSON *archs = cJSON_AddArrayToObject(r, "architectures");
    if (archs)
        cJSON_AddItemToArray(archs, cJSON_CreateString(arch_hf_name(c->arch)));
    cJSON_AddStringToObject(r, "model_type", td_model_arch_name(c->arch));
    cJSON_AddNumberToObject(r, "hidden_size", c->dim);
    cJSON_AddNumberToObject(r, "intermediate_size", c->hidden_dim);
    cJSON_AddNumberToObject(r, "num_hidden_layers", c->n_layers);
    cJSON_AddNumberToObject(r, "num_attention_heads", c->n_heads);
    cJSON_AddNumberToObject(r, "num_key_value_heads", c->n_kv_heads);
    cJSON_AddNumberToObject(r, "head_dim", c->head_dim);
    cJSON_AddNumberToObject(r, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(r, "max_position_embeddings", c->max_seq_len);
    cJSON_AddNumberToObject(r, "rms_norm_eps", float_to_nice_double(c->norm_eps));
    cJSON_AddNumberToObject(r, "rope_theta", float_to_nice_double(c->rope_theta));
    if (c->rope_llama3) {
        cJSON *rs = cJSON_AddObjectToObject(r, "rope_scaling");
        if (rs) {
            cJSON_AddStringToObject(rs, "rope_type", "llama3");
            cJSON_AddNumberToObject(rs, "factor", float_to_nice_double(c->rope_factor));
            cJSON_AddNumberToObject(rs, "low_freq_factor", float_to_nice_double(c->rope_low_freq_factor));
            cJSON_AddNumberToObject(rs, "high_freq_factor", float_to_nice_double(c->rope_high_freq_factor));
            cJSON_AddNumberToObject(rs, "original_max_position_embeddings", c->rope_original_max_pos);
        }
    } else {
        cJSON_AddNullToObject(r, "rope_scaling");
    }
    cJSON_AddBoolToObject(r, "tie_word_embeddings", c->tie_embeddings);
    cJSON_AddStringToObject(r, "hidden_act", "silu");
    if (c->arch != TD_ARCH_QWEN2)
        cJSON_AddBoolToObject(r, "attention_bias", false);
    if ((c->arch != TD_ARCH_LLAMA || c->sliding_window > 0) && (s = add_sliding_window(r, c)) != TD_OK) {
        cJSON_Delete(r);
        return s;
    }
    if (c->arch == TD_ARCH_MIXTRAL) {
        cJSON_AddNumberToObject(r, "num_local_experts", c->n_experts);
        cJSON_AddNumberToObject(r, "num_experts_per_tok", c->n_experts_used);
    } else if (c->arch == TD_ARCH_QWEN3_MOE) {
        cJSON_AddNumberToObject(r, "num_experts", c->n_experts);
        cJSON_AddNumberToObject(r, "num_experts_per_tok", c->n_experts_used);
        cJSON_AddNumberToObject(r, "moe_intermediate_size", c->expert_hidden_dim);
        cJSON_AddBoolToObject(r, "norm_topk_prob", c->moe_norm_topk);
        cJSON_AddNumberToObject(r, "decoder_sparse_step", 1);
        cJSON_AddArrayToObject(r, "mlp_only_layers");
    }
    if (c->bos_id >= 0)
        cJSON_AddNumberToObject(r, "bos_token_id", c->bos_id);
    else
        cJSON_AddNullToObject(r, "bos_token_id");
    if (c->n_eos == 1) {
        cJSON_AddNumberToObject(r, "eos_token_id", c->eos_ids[0]);
    } else if (c->n_eos > 1) {
        cJSON *e = cJSON_AddArrayToObject(r, "eos_token_id");
        for (int i = 0; e && i < c->n_eos; i++)
            cJSON_AddItemToArray(e, cJSON_CreateNumber(c->eos_ids[i]));
    } else {
        cJSON_AddNullToObject(r, "eos_token_id");
    }
    cJSON_AddNumberToObject(r, "initializer_range", 0.02);
    cJSON_AddStringToObject(r, "torch_dtype", torch_dtypes[dtype]);
    char *text = cJSON_Print(r);
    cJSON_Delete(r);
    if (!text)
        return td_errorf(TD_ERR_NOMEM, "config.json: out of memory");
    /* cJSON allocates with malloc (no hooks installed), so the caller may free(). */
    *json_p = text;
    return TD_OK;
}
