/*
 * cmd_generate: `tandem generate`, one generation on this machine: load the model and
 * tokenizer, prefill the prompt in chunks, decode token by token with the request's
 * sampling parameters, stream text (or print ids) and report timings on stderr.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_backend.h"
#include "td_cli.h"
#include "td_engine.h"
#include "td_log.h"
#include "td_model.h"
#include "td_sampler.h"
#include "td_tokenizer.h"
#include "td_util.h"

#define GEN_MAX_STOP_IDS 32

typedef struct gen_opts {
    const char *model;
    const char *tokenizer;
    const char *prompt;
    const char *prompt_ids;
    const char *device;
    int64_t max_tokens;        /* -1: up to the model's length */
    int64_t threads;
    int64_t prefill_chunk;
    size_t kv_mem;
    bool print_ids;
    td_sampling_t sampling;
    const char *stops[TD_STOP_MAX_STRINGS];
    int32_t n_stops;
    int32_t stop_ids[GEN_MAX_STOP_IDS];
    int32_t n_stop_ids;
} gen_opts_t;

static void usage(FILE *f)
{
    fprintf(f,
        "usage: tandem generate --model PATH [--tokenizer PATH] (--prompt TEXT | --prompt-ids \"1 2 3\")\n"
        "                       [--max-tokens N] [--temperature T] [--top-k K] [--top-p P]\n"
        "                       [--min-p P] [--repetition-penalty R] [--seed S] [--stop TEXT]...\n"
        "                       [--stop-id ID]... [--threads N] [--device cpu] [--print-ids]\n"
        "\n"
        "  --model PATH        llama2.c checkpoint (.bin) or Hugging Face model directory\n"
        "  --tokenizer PATH    tokenizer.bin / tokenizer.json / directory (default: beside the model)\n"
        "  --prompt TEXT       prompt text (BOS is added when the model has one)\n"
        "  --prompt-ids IDS    prompt token ids, space-separated, taken as given (no BOS added)\n"
        "  --max-tokens N      most tokens to generate (default: up to the model's length)\n"
        "  --temperature T     0 = greedy (default 0)\n"
        "  --top-k K --top-p P --min-p P --repetition-penalty R --seed S   sampling\n"
        "  --stop TEXT         stop before this text (repeatable, up to %d)\n"
        "  --stop-id ID        stop at this token id (repeatable); the model's EOS ids always stop\n"
        "  --threads N         compute threads (default: all cores)\n"
        "  --kv-mem MIB        KV cache budget (default: what prompt + max tokens need)\n"
        "  --print-ids         print the generated ids on one line instead of text\n"
        "\n"
        "Text (or ids) go to stdout; timings (prompt tokens/s, generation tokens/s, time to\n"
        "first token) to stderr. Generation stops at a stop token or string, at --max-tokens,\n"
        "or at the model's maximum length.\n",
        TD_STOP_MAX_STRINGS);
}

enum {
    OPT_MODEL = 256, OPT_TOKENIZER, OPT_PROMPT, OPT_PROMPT_IDS, OPT_MAX_TOKENS, OPT_TEMP,
    OPT_TOP_K, OPT_TOP_P, OPT_MIN_P, OPT_REP, OPT_SEED, OPT_STOP, OPT_STOP_ID, OPT_THREADS,
    OPT_DEVICE, OPT_PRINT_IDS, OPT_KV_MEM, OPT_CHUNK, OPT_LOG, OPT_HELP,
};

static int parse_opts(int argc, char **argv, gen_opts_t *o)
{
    static const struct option longopts[] = {
        {"model", required_argument, 0, OPT_MODEL},
        {"tokenizer", required_argument, 0, OPT_TOKENIZER},
        {"prompt", required_argument, 0, OPT_PROMPT},
        {"prompt-ids", required_argument, 0, OPT_PROMPT_IDS},
        {"max-tokens", required_argument, 0, OPT_MAX_TOKENS},
        {"temperature", required_argument, 0, OPT_TEMP},
        {"top-k", required_argument, 0, OPT_TOP_K},
        {"top-p", required_argument, 0, OPT_TOP_P},
        {"min-p", required_argument, 0, OPT_MIN_P},
        {"repetition-penalty", required_argument, 0, OPT_REP},
        {"seed", required_argument, 0, OPT_SEED},
        {"stop", required_argument, 0, OPT_STOP},
        {"stop-id", required_argument, 0, OPT_STOP_ID},
        {"threads", required_argument, 0, OPT_THREADS},
        {"device", required_argument, 0, OPT_DEVICE},
        {"print-ids", no_argument, 0, OPT_PRINT_IDS},
        {"kv-mem", required_argument, 0, OPT_KV_MEM},
        {"prefill-chunk", required_argument, 0, OPT_CHUNK},
        {"log-level", required_argument, 0, OPT_LOG},
        {"help", no_argument, 0, OPT_HELP},
        {0, 0, 0, 0},
    };
    int64_t v;
    float f;
    optind = 1;
    opterr = 1;
    for (int ch; (ch = getopt_long(argc, argv, "", longopts, NULL)) != -1;) {
        td_status_t st = TD_OK;
        switch (ch) {
        case OPT_MODEL: o->model = optarg; break;
        case OPT_TOKENIZER: o->tokenizer = optarg; break;
        case OPT_PROMPT: o->prompt = optarg; break;
        case OPT_PROMPT_IDS: o->prompt_ids = optarg; break;
        case OPT_MAX_TOKENS: st = td_parse_i64(optarg, 0, INT32_MAX, "--max-tokens", &o->max_tokens); break;
        case OPT_TEMP:
            st = td_parse_f32(optarg, 0, TD_SAMPLING_MAX_TEMPERATURE, "--temperature", &o->sampling.temperature);
            break;
        case OPT_TOP_K:
            if ((st = td_parse_i64(optarg, 0, INT32_MAX, "--top-k", &v)) == TD_OK)
                o->sampling.top_k = (int32_t)v;
            break;
        case OPT_TOP_P: st = td_parse_f32(optarg, 0, 1, "--top-p", &o->sampling.top_p); break;
        case OPT_MIN_P: st = td_parse_f32(optarg, 0, 1, "--min-p", &o->sampling.min_p); break;
        case OPT_REP:
            st = td_parse_f32(optarg, 0, TD_SAMPLING_MAX_PENALTY, "--repetition-penalty", &f);
            o->sampling.repetition_penalty = f;
            break;
        case OPT_SEED:
            if ((st = td_parse_i64(optarg, 0, INT64_MAX, "--seed", &v)) == TD_OK)
                o->sampling.seed = (uint64_t)v;
            break;
        case OPT_STOP:
            if (o->n_stops == TD_STOP_MAX_STRINGS)
                st = td_errorf(TD_ERR_INVALID, "--stop: at most %d stop strings", TD_STOP_MAX_STRINGS);
            else
                o->stops[o->n_stops++] = optarg;
            break;
        case OPT_STOP_ID:
            if (o->n_stop_ids == GEN_MAX_STOP_IDS)
                st = td_errorf(TD_ERR_INVALID, "--stop-id: at most %d stop ids", GEN_MAX_STOP_IDS);
            else if ((st = td_parse_i64(optarg, 0, INT32_MAX, "--stop-id", &v)) == TD_OK)
                o->stop_ids[o->n_stop_ids++] = (int32_t)v;
            break;
        case OPT_THREADS: st = td_parse_i64(optarg, 1, 4096, "--threads", &o->threads); break;
        case OPT_DEVICE: o->device = optarg; break;
        case OPT_PRINT_IDS: o->print_ids = true; break;
        case OPT_KV_MEM:
            if ((st = td_parse_i64(optarg, 1, 1 << 22, "--kv-mem", &v)) == TD_OK)
                o->kv_mem = (size_t)v << 20;
            break;
        case OPT_CHUNK: st = td_parse_i64(optarg, 1, 1 << 16, "--prefill-chunk", &o->prefill_chunk); break;
        case OPT_LOG:
            if (td_log_parse_level(optarg) < 0)
                st = td_errorf(TD_ERR_INVALID, "--log-level: '%s' is not error|warn|info|debug", optarg);
            else
                td_log_set_level((td_log_level_t)td_log_parse_level(optarg));
            break;
        case OPT_HELP: usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
        if (st != TD_OK)
            return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "tandem generate: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (!o->model) {
        fprintf(stderr, "tandem generate: --model is required\n");
        return 2;
    }
    if (!o->prompt == !o->prompt_ids) {
        fprintf(stderr, "tandem generate: give exactly one of --prompt and --prompt-ids\n");
        return 2;
    }
    if (o->device && strcmp(o->device, "cpu") && strcmp(o->device, "cuda")) {
        fprintf(stderr, "tandem generate: --device must be cpu or cuda\n");
        return 2;
    }
    char why[256];
    if (td_sampling_validate(&o->sampling, why, sizeof why) != TD_OK) {
        fprintf(stderr, "tandem generate: %s\n", why);
        return 2;
    }
    return -1;
}

/* "1 2 3" -> ids. Errors name the offending word. */
static td_status_t parse_ids(const char *s, int32_t **ids_p, size_t *n_p)
{
    size_t cap = 16, n = 0;
    int32_t *ids = malloc(cap * sizeof(int32_t));
    if (!ids)
        return td_errorf(TD_ERR_NOMEM, "out of memory");
    const char *p = s;
    for (;;) {
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == ',')
            p++;
        if (!*p)
            break;
        char word[32];
        size_t len = strcspn(p, " \t\n,");
        if (len >= sizeof word) {
            free(ids);
            return td_errorf(TD_ERR_INVALID, "--prompt-ids: '%.*s...' is not a token id", 16, p);
        }
        memcpy(word, p, len);
        word[len] = '\0';
        int64_t v;
        if (td_parse_i64(word, 0, INT32_MAX, "--prompt-ids", &v) != TD_OK) {
            free(ids);
            return TD_ERR_INVALID;
        }
        if (n == cap) {
            int32_t *nids = realloc(ids, 2 * cap * sizeof(int32_t));
            if (!nids) {
                free(ids);
                return td_errorf(TD_ERR_NOMEM, "out of memory");
            }
            ids = nids;
            cap *= 2;
        }
        ids[n++] = (int32_t)v;
        p += len;
    }
    *ids_p = ids;
    *n_p = n;
    return TD_OK;
}

static bool is_stop_id(const td_model_config_t *c, const gen_opts_t *o, int32_t id)
{
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] == id)
            return true;
    for (int i = 0; i < o->n_stop_ids; i++)
        if (o->stop_ids[i] == id)
            return true;
    return false;
}

/* Streams `id`'s text through the detokenizer and the stop matcher; *stopped_p when a
 * stop string completed. */
static td_status_t emit_text(td_detok_t *dt, td_stop_t *stop, int32_t id, bool *stopped_p)
{
    /* a model's vocabulary may be padded past its tokenizer's: such ids have no text */
    if (id >= td_tokenizer_vocab_size(dt->tok))
        return TD_OK;
    const char *text;
    size_t len;
    td_status_t st = td_detok_push(dt, id, &text, &len);
    if (st != TD_OK)
        return st;
    td_stop_result_t r;
    if ((st = td_stop_feed(stop, text, len, &r)) != TD_OK)
        return st;
    fwrite(r.emit, 1, r.emit_len, stdout);
    fflush(stdout);
    *stopped_p = r.matched;
    return TD_OK;
}

int cmd_generate(int argc, char **argv)
{
    gen_opts_t o = {.max_tokens = -1, .sampling = td_sampling_default()};
    int rc = parse_opts(argc, argv, &o);
    if (rc >= 0)
        return rc;
    rc = 1;

    td_model_t *model = NULL;
    td_tokenizer_t *tok = NULL;
    td_backend_t *be = NULL;
    td_engine_t *eng = NULL;
    td_sampler_t *sampler = NULL;
    td_stop_t *stop = NULL;
    int32_t *prompt = NULL, *out_ids = NULL;
    float *logits = NULL;
    size_t n_prompt = 0;
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    td_detok_t dt = {0};
    td_status_t st;

    if ((st = td_model_load(o.model, &model)) != TD_OK)
        goto out;
    const td_model_config_t *c = &model->config;
    const char *tok_path = o.tokenizer ? o.tokenizer : (model->tokenizer_path[0] ? model->tokenizer_path : NULL);
    if (tok_path) {
        if ((st = td_tokenizer_load(tok_path, &tok)) != TD_OK)
            goto out;
    } else if (o.prompt || !o.print_ids) {
        td_errorf(TD_ERR_INVALID, "%s has no tokenizer beside it: pass --tokenizer PATH%s", o.model,
                  o.prompt ? "" : ", or --print-ids to print token ids");
        goto out;
    }

    if (o.prompt) {
        unsigned flags = c->bos_id >= 0 ? TD_TOK_ADD_BOS : 0;
        if ((st = td_tokenizer_encode(tok, o.prompt, strlen(o.prompt), flags, &prompt, &n_prompt)) != TD_OK)
            goto out;
    } else if ((st = parse_ids(o.prompt_ids, &prompt, &n_prompt)) != TD_OK) {
        rc = st == TD_ERR_INVALID ? 2 : 1;
        goto out;
    }
    if (n_prompt == 0) {
        td_errorf(TD_ERR_INVALID, "the prompt is empty (and the model has no BOS token to start from)");
        goto out;
    }
    for (size_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= c->vocab_size) {
            td_errorf(TD_ERR_RANGE, "prompt token %d is outside the model's vocabulary [0, %d)", prompt[i],
                      c->vocab_size);
            goto out;
        }
    if ((int64_t)n_prompt >= c->max_seq_len) {
        td_errorf(TD_ERR_RANGE, "the prompt has %zu tokens; the model's maximum length is %d", n_prompt,
                  c->max_seq_len);
        goto out;
    }
    int64_t room = c->max_seq_len - (int64_t)n_prompt;
    int64_t max_new = o.max_tokens < 0 ? room : TD_MIN(o.max_tokens, room);

    if (o.device && !strcmp(o.device, "cuda")) {
        td_cuda_config_t cc = {.device = 0, .act_dtype = TD_F32};
        st = td_backend_cuda_create(&cc, &be);
    } else {
        td_cpu_config_t cc = {.n_threads = (int32_t)o.threads};
        st = td_backend_cpu_create(&cc, &be);
    }
    if (st != TD_OK)
        goto out;
    td_engine_config_t ec = td_engine_config_default();
    ec.max_batch_tokens = (int32_t)(o.prefill_chunk ? o.prefill_chunk : TD_MIN(512, (int64_t)n_prompt));
    ec.max_seqs = 1;
    ec.max_logit_rows = 1;
    ec.prefix_cache = false;
    /* the pool holds what prompt + max tokens need, within the KV budget */
    if (o.kv_mem)
        ec.kv_mem_bytes = o.kv_mem;
    uint64_t block_bytes = td_model_kv_bytes_per_token(c, ec.kv_dtype) * (uint64_t)ec.block_size;
    int64_t need = TD_DIV_CEIL((int64_t)n_prompt + max_new + 1, ec.block_size);
    int64_t fits = (int64_t)(ec.kv_mem_bytes / block_bytes);
    ec.n_blocks = (int32_t)TD_MAX(1, TD_MIN(need, fits));
    if ((st = td_engine_create(model, be, &ec, &eng)) != TD_OK)
        goto out;
    if ((st = td_sampler_create(&o.sampling, &sampler)) != TD_OK ||
        (st = td_stop_create(o.stops, o.n_stops, &stop)) != TD_OK)
        goto out;
    logits = malloc((size_t)c->vocab_size * sizeof(float));
    out_ids = malloc((size_t)(max_new + 1) * sizeof(int32_t));
    if (!logits || !out_ids) {
        td_errorf(TD_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (tok)
        td_detok_init(&dt, tok);
    for (size_t i = 0; i < n_prompt; i++)
        td_sampler_accept(sampler, prompt[i]);

    /* prefill in chunks; the last chunk's last row gives the first token's logits */
    uint64_t t0 = td_now_ns();
    for (size_t off = 0; off < n_prompt;) {
        int32_t n = (int32_t)TD_MIN((size_t)ec.max_batch_tokens, n_prompt - off);
        td_engine_item_t it = {.seq = &seq, .tokens = prompt + off, .n_tokens = n,
                               .n_logits = off + (size_t)n == n_prompt};
        if ((st = td_engine_step(eng, &it, 1, logits)) != TD_OK) {
            if (st == TD_ERR_EXHAUSTED)
                td_errorf(st, "the KV cache cannot hold the prompt: raise --kv-mem");
            goto out;
        }
        off += (size_t)n;
    }
    uint64_t t_first = 0, t_prefill = td_now_ns() - t0;
    int64_t n_gen = 0;
    bool stopped = false;
    while (n_gen < max_new && !stopped) {
        int32_t next;
        if ((st = td_sampler_sample(sampler, logits, c->vocab_size, &next)) != TD_OK)
            goto out;
        if (n_gen == 0)
            t_first = td_now_ns() - t0;
        if (is_stop_id(c, &o, next))
            break;
        td_sampler_accept(sampler, next);
        out_ids[n_gen++] = next;
        if (!o.print_ids && (st = emit_text(&dt, stop, next, &stopped)) != TD_OK)
            goto out;
        if (stopped || n_gen == max_new)
            break;
        td_engine_item_t it = {.seq = &seq, .tokens = &next, .n_tokens = 1, .n_logits = 1};
        if ((st = td_engine_step(eng, &it, 1, logits)) == TD_ERR_EXHAUSTED) {
            td_warn("generate: the KV cache is full at %d tokens; stopping (raise --kv-mem for longer)",
                    seq.n_tokens);
            break;
        }
        if (st != TD_OK)
            goto out;
    }
    uint64_t t_total = td_now_ns() - t0;
    if (o.print_ids) {
        for (int64_t i = 0; i < n_gen; i++)
            printf(i ? " %d" : "%d", out_ids[i]);
        printf("\n");
    } else if (!stopped) {
        const char *text;
        size_t len;
        if ((st = td_detok_flush(&dt, &text, &len)) != TD_OK)
            goto out;
        td_stop_result_t r;
        if ((st = td_stop_feed(stop, text, len, &r)) != TD_OK)
            goto out;
        fwrite(r.emit, 1, r.emit_len, stdout);
        if (!r.matched) {
            td_stop_flush(stop, &text, &len);
            fwrite(text, 1, len, stdout);
        }
        fflush(stdout);
    }
    double gen_s = (double)(t_total - t_first) * 1e-9;
    fprintf(stderr,
            "\nprompt: %zu tokens, %.1f tokens/s | generation: %" PRId64
            " tokens, %.1f tokens/s | time to first token: %.1f ms\n",
            n_prompt, (double)n_prompt / ((double)t_prefill * 1e-9), n_gen,
            n_gen > 1 ? (double)(n_gen - 1) / gen_s : 0.0, (double)t_first * 1e-6);
    rc = 0;
out:
    if (rc && !td_last_error()[0])
        fprintf(stderr, "tandem generate: failed\n"); /* every decided error was logged where decided */
    td_detok_free(&dt);
    if (eng)
        td_engine_seq_end(eng, &seq);
    free(logits);
    free(out_ids);
    free(prompt);
    td_stop_destroy(stop);
    td_sampler_destroy(sampler);
    td_engine_destroy(eng);
    td_backend_destroy(be);
    td_tokenizer_destroy(tok);
    td_model_destroy(model);
    return rc;
}
