/*
 * cmd_model: `tandem model`, tools around model files: `synth` writes a random-weight
 * model of a real shape (for benchmarks and tests, nothing to download), `info` shows
 * what a model is and what it costs (parameters, KV bytes per token, fingerprint), or for
 * a GGUF file what the file holds (header, metadata, tensor table).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "td_cli.h"
#include "td_gguf.h"
#include "td_model.h"
#include "td_util.h"

static void usage_main(FILE *f)
{
    fprintf(f, "usage: tandem model <synth|info> [options]\n"
               "\n"
               "  synth   write a random-weight model: a Hugging Face directory or a GGUF file\n"
               "  info    describe a model (llama2.c .bin, Hugging Face directory, GGUF file or preset name)\n"
               "\n'tandem model <sub> --help' describes each.\n");
}

static void usage_info(FILE *f)
{
    fprintf(f, "usage: tandem model info PATH|PRESET\n"
               "\n"
               "Prints arch, shapes, parameter count, dtype, fingerprint and KV bytes per token of a\n"
               "llama2.c checkpoint, a Hugging Face model directory, or a preset (shape only).\n"
               "For a GGUF file, prints its header, metadata (arrays: type, length, first values)\n"
               "and tensor table, then the model td_model_load makes of it.\n");
}

/* The shape to synthesize: a preset name or a config.json. */
static td_status_t load_shape(const char *what, td_model_config_t *cfg)
{
    if (td_model_preset(what, cfg) == TD_OK)
        return TD_OK;
    if (!td_is_file(what))
        return td_errorf(TD_ERR_NOT_FOUND, "%s: neither a preset nor a config.json file", what);
    char *text;
    td_status_t s = td_file_read_all(what, 16u << 20, &text, NULL);
    if (s != TD_OK)
        return s;
    s = td_model_config_from_json(text, what, cfg);
    free(text);
    return s;
}

static int cmd_synth(int argc, char **argv)
{
    const char *out = NULL, *config = "tiny", *arch = NULL, *tok = NULL, *format = "dir";
    int64_t seed = 0, shards = 1, window = -1;
    td_dtype_t dtype = TD_BF16;
    int quant = -1;
    const td_opt_t opts[] = {
        {.name = "out", .type = TD_OPT_STR, .ptr = &out, .arg = "PATH",
         .help = "directory to write (created if missing); with --format gguf the file"},
        {.name = "format", .type = TD_OPT_STR, .ptr = &format, .arg = "F",
         .help = "dir (Hugging Face: config.json, safetensors, tokenizer; default) or\n"
                 "gguf (one file llama.cpp runs, q/k permuted as its converter does)"},
        {.name = "config", .type = TD_OPT_STR, .ptr = &config, .arg = "NAME",
         .help = "a preset (default tiny) or a config.json to copy the shape from"},
        {.name = "arch", .type = TD_OPT_STR, .ptr = &arch, .arg = "ARCH",
         .help = "llama|mistral|qwen2|qwen3|mixtral|qwen3_moe (default: the config's;\n"
                 "mixtral and qwen3_moe need a shape with experts: tiny-mixtral, ...)"},
        {.name = "sliding-window", .type = TD_OPT_I64, .ptr = &window, .min = 0, .max = 1 << 24, .arg = "W",
         .help = "every layer attends to its last W positions (a Mistral-style sliding\n"
                 "window; 0: none; default: the config's)"},
        {.name = "seed", .type = TD_OPT_I64, .ptr = &seed, .min = 0, .max = INT64_MAX, .arg = "S",
         .help = "weights are a function of the seed (default 0)"},
        {.name = "dtype", .type = TD_OPT_FN, .ptr = &dtype, .parse = cli_opt_dtype, .arg = "T",
         .help = "stored dtype: f32|f16|bf16 (default bf16)"},
        {.name = "tokenizer", .type = TD_OPT_STR, .ptr = &tok, .arg = "PATH",
         .help = "tokenizer.json (or a directory holding one) to copy; default: a\n"
                 "built-in 258-token byte-level tokenizer (<s> 256, </s> 257)"},
        {.name = "shards", .type = TD_OPT_I64, .ptr = &shards, .min = 1, .max = 1000, .arg = "N",
         .help = "split the weights over N files with an index (default 1)"},
        {.name = "quant", .type = TD_OPT_FN, .ptr = &quant, .parse = cli_opt_quant, .arg = "Q",
         .help = "with --format gguf: matrices quantized to q8_0|q4_0 (default: --dtype)"},
    };
    td_opts_t spec = {.prog = "model synth", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r = {0};
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return 2; /* logged where decided */
    if (r.help) {
        printf("usage: tandem model synth --out DIR [--config NAME|config.json] [--arch ARCH] [--seed S]\n"
               "                          [--dtype f32|f16|bf16] [--tokenizer PATH] [--shards N]\n"
               "                          [--sliding-window W]\n"
               "       tandem model synth --format gguf --out FILE.gguf [--config ...] [--arch ARCH] [--seed S]\n"
               "                          [--dtype f32|f16|bf16] [--quant q8_0|q4_0]\n\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        printf("\npresets:");
        for (int i = 0; td_model_preset_names[i]; i++)
            printf(" %s", td_model_preset_names[i]);
        printf("\n");
        return 0;
    }
    if (!out) {
        fprintf(stderr, "tandem model synth: --out PATH is required (see --help)\n");
        return 2;
    }
    bool gguf = !strcmp(format, "gguf");
    if (!gguf && strcmp(format, "dir")) {
        fprintf(stderr, "tandem model synth: --format must be dir or gguf, not '%s'\n", format);
        return 2;
    }
    if (!gguf && (quant >= 0)) {
        fprintf(stderr, "tandem model synth: --quant needs --format gguf (safetensors hold float weights)\n");
        return 2;
    }
    if (gguf && (tok || shards != 1)) {
        fprintf(stderr, "tandem model synth: --format gguf writes one file with the built-in byte tokenizer: "
                        "--tokenizer and --shards are for --format dir\n");
        return 2;
    }
    td_synth_params_t p;
    memset(&p, 0, sizeof p);
    if (load_shape(config, &p.config) != TD_OK)
        return 2; /* every error below was logged where it was decided */
    if (arch) {
        int a = td_model_arch_parse(arch);
        if (a < 0) {
            fprintf(stderr, "tandem model synth: --arch must be llama, mistral, qwen2, qwen3, mixtral or qwen3_moe\n");
            return 2;
        }
        td_model_config_set_arch(&p.config, (td_arch_t)a);
    }
    if (window >= 0)
        td_model_config_set_window(&p.config, (int32_t)window);
    p.seed = (uint64_t)seed;
    p.dtype = quant >= 0 ? (td_dtype_t)quant : dtype;
    double t0 = td_now_s();
    if ((gguf ? td_model_synth_gguf(&p, out) : td_model_synth_shards(&p, (int)shards, out, tok)) != TD_OK)
        return 1;
    uint64_t params = td_model_param_count(&p.config);
    struct stat sb;
    double bytes = gguf ? (stat(out, &sb) == 0 ? (double)sb.st_size : 0.0) : (double)params * (double)td_dtype_size(p.dtype);
    fprintf(stderr, "wrote %s: %s %s, %.1fM parameters, %.1f MB, %.1f s\n", out,
            td_model_arch_name(p.config.arch), td_dtype_name(p.dtype), (double)params / 1e6, bytes / 1e6,
            td_now_s() - t0);
    return 0;
}

static void print_config(const td_model_config_t *c)
{
    printf("arch            %s (%s)\n", td_model_arch_name(c->arch), c->arch_name);
    printf("dim             %d\n", c->dim);
    printf("hidden_dim      %d\n", c->hidden_dim);
    printf("n_layers        %d\n", c->n_layers);
    printf("n_heads         %d\n", c->n_heads);
    printf("n_kv_heads      %d\n", c->n_kv_heads);
    printf("head_dim        %d\n", c->head_dim);
    printf("vocab_size      %d\n", c->vocab_size);
    printf("max_seq_len     %d\n", c->max_seq_len);
    printf("norm_eps        %g\n", (double)c->norm_eps);
    printf("rope            %s, theta %g", c->rope_style == TD_ROPE_PAIRS ? "pairs" : "halves", (double)c->rope_theta);
    if (c->rope_llama3)
        printf(", llama3 scaling (factor %g, low %g, high %g, original %d)", (double)c->rope_factor,
               (double)c->rope_low_freq_factor, (double)c->rope_high_freq_factor, c->rope_original_max_pos);
    printf("\n");
    printf("tied embeddings %s\n", c->tie_embeddings ? "yes" : "no");
    printf("qkv bias        %s\n", c->qkv_bias ? "yes" : "no");
    printf("qk norm         %s\n", c->qk_norm ? "yes" : "no");
    if (c->sliding_window > 0) {
        printf("sliding window  %d tokens, ", c->sliding_window);
        if (td_model_kv_window(c) > 0) {
            printf("every layer\n");
        } else {
            printf("layers");
            for (int32_t l = 0; l < c->n_layers; l++)
                if (td_model_layer_window(c, l) > 0)
                    printf(" %d", l);
            printf("\n");
        }
    } else {
        printf("sliding window  none\n");
    }
    if (c->n_experts > 0)
        printf("experts         %d, %d per token, hidden_dim %d, top-k weights %s\n", c->n_experts,
               c->n_experts_used, c->expert_hidden_dim,
               c->moe_norm_topk ? "renormalised (softmax over the top k)" : "as in the softmax over all");
    printf("bos             %d\n", c->bos_id);
    printf("eos            ");
    for (int i = 0; i < c->n_eos; i++)
        printf(" %d", c->eos_ids[i]);
    printf("%s\n", c->n_eos ? "" : " none");
    uint64_t params = td_model_param_count(c);
    printf("dtype           %s\n", td_dtype_name(c->dtype));
    printf("parameters      %" PRIu64 " (%.2fB), %.1f MB as %s\n", params, (double)params / 1e9,
           (double)params * (double)td_dtype_size(c->dtype) / 1e6, td_dtype_name(c->dtype));
    if (c->n_experts > 0) {
        uint64_t active = td_model_active_param_count(c);
        printf("active params   %" PRIu64 " (%.2fB) per token\n", active, (double)active / 1e9);
    }
    printf("fingerprint     %016" PRIx64 "\n", td_model_fingerprint(c));
    printf("kv bytes/token  %" PRIu64 " (f16/bf16), %" PRIu64 " (f32)\n", td_model_kv_bytes_per_token(c, TD_BF16),
           td_model_kv_bytes_per_token(c, TD_F32));
}

/* A string from the file, printable on one line: quoted, control bytes escaped, cut at
 * max bytes. */
static void print_gguf_str(td_gguf_str_t s, size_t max)
{
    putchar('"');
    for (size_t i = 0; i < s.len && i < max; i++) {
        unsigned char c = (unsigned char)s.data[i];
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            printf("\\x%02x", c);
        else
            putchar(c);
    }
    printf("\"%s", s.len > max ? "..." : "");
}

static void print_gguf_value(const td_gguf_kv_t *kv)
{
    switch (kv->type) {
    case TD_GGUF_STRING: print_gguf_str(kv->v.str, 60); break;
    case TD_GGUF_BOOL: printf("%s", kv->v.u64 ? "true" : "false"); break;
    case TD_GGUF_F32: case TD_GGUF_F64: printf("%g", kv->v.f64); break;
    case TD_GGUF_I8: case TD_GGUF_I16: case TD_GGUF_I32: case TD_GGUF_I64:
        printf("%" PRId64, kv->v.i64);
        break;
    case TD_GGUF_ARRAY: {
        printf("[%s; %zu]", td_gguf_type_name(kv->arr_type), kv->arr_len);
        size_t n = TD_MIN(kv->arr_len, (size_t)4);
        for (size_t i = 0; i < n; i++) {
            printf(i ? ", " : " ");
            switch (kv->arr_type) {
            case TD_GGUF_STRING: print_gguf_str(td_gguf_arr_str(kv, i), 24); break;
            case TD_GGUF_BOOL: printf("%s", td_gguf_arr_bool(kv, i) ? "true" : "false"); break;
            case TD_GGUF_F32: case TD_GGUF_F64: printf("%g", td_gguf_arr_float(kv, i)); break;
            case TD_GGUF_U64: printf("%" PRIu64, (uint64_t)td_gguf_arr_int(kv, i)); break;
            default: printf("%" PRId64, td_gguf_arr_int(kv, i)); break;
            }
        }
        printf("%s", kv->arr_len > n ? ", ..." : "");
        break;
    }
    default: printf("%" PRIu64, kv->v.u64); break;
    }
}

static int info_gguf(const char *path)
{
    td_gguf_t *g;
    if (td_gguf_open(path, &g) != TD_OK)
        return 1; /* logged where decided */
    char sz[32];
    size_t n_kv = td_gguf_kv_count(g), n_t = td_gguf_tensor_count(g);
    printf("path            %s\n", path);
    printf("format          GGUF v%u, %s\n", td_gguf_version(g), td_format_bytes(td_gguf_map(g)->size, sz, sizeof sz));
    printf("metadata        %zu keys\n", n_kv);
    printf("tensors         %zu\n", n_t);
    printf("alignment       %zu\n", td_gguf_alignment(g));
    printf("data            at byte %zu\n", td_gguf_data_offset(g));
    printf("\nmetadata:\n");
    for (size_t i = 0; i < n_kv; i++) {
        const td_gguf_kv_t *kv = td_gguf_kv_at(g, i);
        printf("  %-40s %-7s ", kv->key, td_gguf_type_name(kv->type));
        print_gguf_value(kv);
        printf("\n");
    }
    printf("\ntensors:\n  %-32s %-8s %-24s %12s %12s\n", "name", "type", "shape (ne[0] first)", "offset", "bytes");
    for (size_t i = 0; i < n_t; i++) {
        const td_gguf_tensor_t *t = td_gguf_tensor_at(g, i);
        char shape[64], ty[16];
        int o = snprintf(shape, sizeof shape, "[");
        for (int d = 0; d < t->n_dims && o < (int)sizeof shape; d++)
            o += snprintf(shape + o, sizeof shape - (size_t)o, "%s%" PRId64, d ? ", " : "", t->ne[d]);
        if (o < (int)sizeof shape)
            snprintf(shape + o, sizeof shape - (size_t)o, "]");
        const td_ggml_type_t *gt = td_ggml_type(t->type);
        if (gt)
            snprintf(ty, sizeof ty, "%s", gt->name);
        else
            snprintf(ty, sizeof ty, "type %u", t->type);
        if (t->known)
            printf("  %-32s %-8s %-24s %12zu %12zu\n", t->name, ty, shape, t->file_offset, t->nbytes);
        else
            printf("  %-32s %-8s %-24s %12zu %12s\n", t->name, ty, shape, t->file_offset, "?");
    }
    td_gguf_close(g);
    td_model_t *m;
    if (td_model_load(path, &m) != TD_OK)
        return 1; /* logged where decided */
    printf("\nmodel:\n");
    print_config(&m->config);
    td_model_destroy(m);
    return 0;
}

static int cmd_info(int argc, char **argv)
{
    char *args[1];
    td_opts_t spec = {.prog = "model info", .max_args = 1};
    td_opts_result_t r = {.args = args};
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return 2;
    if (r.help || r.n_args != 1) {
        usage_info(r.help ? stdout : stderr);
        return r.help ? 0 : 2;
    }
    const char *path = args[0];
    td_model_config_t cfg;
    if (!td_is_file(path) && !td_is_dir(path) && td_model_preset(path, &cfg) == TD_OK) {
        printf("preset          %s\n", path);
        print_config(&cfg);
        return 0;
    }
    if (td_is_file(path) && td_gguf_is_gguf(path))
        return info_gguf(path);
    td_model_t *m;
    if (td_model_load(path, &m) != TD_OK)
        return 1; /* logged where decided */
    printf("path            %s\n", m->path);
    print_config(&m->config);
    printf("tokenizer       %s\n", m->tokenizer_path[0] ? m->tokenizer_path : "(none beside the model)");
    td_model_destroy(m);
    return 0;
}

int cmd_model(int argc, char **argv)
{
    if (argc < 2) {
        usage_main(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage_main(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "synth"))
        return cmd_synth(argc - 1, argv + 1);
    if (!strcmp(argv[1], "info"))
        return cmd_info(argc - 1, argv + 1);
    fprintf(stderr, "tandem model: unknown subcommand '%s'\n\n", argv[1]);
    usage_main(stderr);
    return 2;
}
