/*
 * cmd_chat: `tandem chat`, a conversation with a model on this machine. Each line read
 * from stdin is the user's next message; the whole conversation (an optional system
 * message, then the turns so far) is rendered with the model's chat template and
 * generated after, the reply streaming to stdout. The engine keeps the previous turns' KV
 * in its prefix cache, so a turn computes only what the last one did not: the new message
 * (and the re-tokenized end of the last reply). Timings on stderr say how many prompt
 * tokens were cached. /reset starts a new conversation, /exit (or end of input) ends it.
 * Works the same when stdin is a pipe: one message per line.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_gen.h"
#include "td_chat_template.h"
#include "td_cli.h"
#include "td_log.h"
#include "td_util.h"

/* A conversation: messages with owned strings (roles are literals). */
typedef struct chat_conv {
    td_chat_message_t *m;
    size_t n, cap;
    size_t n_fixed; /* the system message, kept by /reset */
} chat_conv_t;

static td_status_t conv_add(chat_conv_t *c, const char *role, const char *content, size_t len)
{
    if (c->n == c->cap) {
        size_t ncap = c->cap ? 2 * c->cap : 8;
        td_chat_message_t *m = realloc(c->m, ncap * sizeof *m);
        if (!m)
            return td_errorf(TD_ERR_NOMEM, "out of memory");
        c->m = m;
        c->cap = ncap;
    }
    char *s = malloc(len + 1);
    if (!s)
        return td_errorf(TD_ERR_NOMEM, "out of memory");
    memcpy(s, content, len);
    s[len] = '\0';
    c->m[c->n++] = (td_chat_message_t){.role = role, .content = s};
    return TD_OK;
}

/* Drops the messages after the first n. */
static void conv_truncate(chat_conv_t *c, size_t n)
{
    while (c->n > n)
        free((char *)c->m[--c->n].content);
}

#define CHAT_MAX_OPTS 48

static int parse_opts(int argc, char **argv, cli_gen_opts_t *o)
{
    int64_t kv_mib = 0, draft_tokens = o->spec.k_max;
    td_dtype_t dtype = TD_F32;
    char stop_help[64];
    snprintf(stop_help, sizeof stop_help, "stop a reply before this text (repeatable, up to %d)",
             TD_STOP_MAX_STRINGS);
    cli_gen_sampling_flags_t sampling; /* TD_SAMPLING_FIELDS' flags, after max-tokens */
    cli_gen_sampling_flags_init(&sampling, o);
    const td_opt_t head[] = {
        {.name = "model", .type = TD_OPT_STR, .ptr = &o->model, .arg = "PATH",
         .help = "GGUF file or Hugging Face model directory with a chat template"},
        {.name = "tokenizer", .type = TD_OPT_STR, .ptr = &o->tokenizer, .arg = "PATH",
         .help = "tokenizer.json / directory (default: the model's)"},
        {.name = "system", .type = TD_OPT_STR, .ptr = &o->system, .arg = "TEXT",
         .help = "a system message opening the conversation"},
        {.name = "max-tokens", .type = TD_OPT_I64, .ptr = &o->max_tokens, .min = INT64_MIN, .max = INT64_MAX,
         .arg = "N", .help = "most tokens of one reply (default: up to the model's length)"},
    };
    const td_opt_t tail[] = {
        {.name = "stop", .type = TD_OPT_FN, .ptr = o, .parse = cli_gen_parse_stop, .arg = "TEXT",
         .help = stop_help},
        {.name = "threads", .type = TD_OPT_I64, .ptr = &o->threads, .min = 1, .max = 4096, .arg = "N",
         .help = "compute threads (default: all cores)"},
        {.name = "device", .type = TD_OPT_FN, .ptr = &o->device, .parse = cli_opt_device, .arg = "D",
         .help = "cpu (default), cuda (GPU 0) or cuda:N"},
        {.name = "dtype", .type = TD_OPT_FN, .ptr = &dtype, .parse = cli_opt_dtype, .arg = "T",
         .help = "f32|f16|bf16: weights and KV cache in T (as generate --dtype)"},
        {.name = "quant", .type = TD_OPT_FN, .ptr = &o->quant, .parse = cli_opt_quant, .arg = "Q",
         .help = "q8_0|q4_0: quantize the float weight matrices to Q at load"},
        {.name = "kv-dtype", .type = TD_OPT_FN, .ptr = &o->kv_dtype, .parse = cli_opt_kv_dtype, .arg = "T",
         .help = "f32|f16|bf16|q8_0: the KV cache in T (default: as --dtype; q8_0: blocks of 32\n"
                 "with an f16 scale, half of f16's memory, llama.cpp's -ctk/-ctv q8_0)"},
        {.name = "kv-mem", .type = TD_OPT_I64, .ptr = &kv_mib, .min = 1, .max = 1 << 22, .arg = "MIB",
         .help = "KV cache budget (default: the model's length, and the cached turns)"},
        {.name = "prefill-chunk", .type = TD_OPT_I64, .ptr = &o->prefill_chunk, .min = 1, .max = 1 << 16,
         .arg = "N", .help = "prompt tokens per prefill step (default 512)"},
        {.name = "log-level", .type = TD_OPT_FN, .parse = cli_gen_parse_log_level, .arg = "L",
         .help = "error|warn|info|debug (debug shows each rendered prompt)"},
        CLI_GEN_SPEC_OPTS(o, &draft_tokens),
    };
    td_opt_t opts[CHAT_MAX_OPTS];
    int n_opts = cli_gen_opts_join(opts, CHAT_MAX_OPTS, head, TD_ARRAY_LEN(head), &sampling, tail, TD_ARRAY_LEN(tail));
    int given[CHAT_MAX_OPTS] = {0};
    td_opts_t spec = {.prog = "chat", .opts = opts, .n_opts = n_opts};
    td_opts_result_t r = {.given = given};
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return 2;
    if (r.help) {
        printf("usage: tandem chat --model PATH [--system TEXT] [--max-tokens N]\n");
        cli_gen_sampling_synopsis(stdout, &sampling, "                   ");
        printf("                   [--stop TEXT]... [--threads N] [--device cpu|cuda[:N]] [--dtype T]\n"
               "                   [--quant q8_0|q4_0] [--kv-dtype T] [--spec off|prompt-lookup|draft-model]\n"
               "                   [--draft-model PATH] [--draft-tokens K]\n\n");
        td_opts_usage(stdout, opts, n_opts, false);
        printf("\n"
               "Reads the user's messages from stdin, one a line, and streams each reply to stdout (a\n"
               "line of its own); timings, with the prompt tokens the prefix cache held, go to stderr.\n"
               "The conversation is rendered with the model's chat template (docs/chat.md). Lines\n"
               "/reset (start over, keeping --system) and /exit; end of input exits too. Exit status:\n"
               "0 done, 1 failed, 2 usage error.\n");
        return 0;
    }
    cli_gen_sampling_apply(&sampling, o);
    if (!cli_gen_spec_resolve("chat", o, draft_tokens))
        return 2;
    o->kv_mem = (size_t)kv_mib << 20;
    o->max_tokens_given = td_opts_given(&spec, &r, "max-tokens") != 0;
    if (td_opts_given(&spec, &r, "dtype"))
        o->dtype = (int)dtype;
    if (!o->model) {
        fprintf(stderr, "tandem chat: give --model PATH\n");
        return 2;
    }
    if (!cli_gen_validate("chat", o, true, 0))
        return 2;
    return -1;
}

/* One turn: the conversation (ending with the user's message) rendered, generated after,
 * the reply appended. A conversation too long for the model is said, and the message
 * dropped, without ending the chat. */
static td_status_t chat_turn(cli_gen_t *g, const cli_gen_opts_t *o, chat_conv_t *conv)
{
    int32_t *prompt = NULL;
    size_t n_prompt = 0;
    cli_gen_result_t res = {0};
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    int32_t max_len = g->model->config.max_seq_len;
    td_status_t st = cli_gen_chat_prompt(g, conv->m, conv->n, &prompt, &n_prompt);
    if (st != TD_OK)
        goto out;
    if ((int64_t)n_prompt >= max_len) {
        fprintf(stderr, "tandem chat: the conversation is %zu tokens, the model's length is %d: "
                        "/reset to start over\n", n_prompt, max_len);
        conv_truncate(conv, conv->n - 1);
        goto out;
    }
    if ((st = cli_gen_check_prompt(g, prompt, n_prompt)) != TD_OK)
        goto out;
    int64_t room = max_len - (int64_t)n_prompt;
    int64_t max_new = o->max_tokens < 0 ? room : TD_MIN(o->max_tokens, room);
    if ((st = cli_gen_run(g, o, &seq, prompt, n_prompt, max_new, &res)) != TD_OK)
        goto out;
    printf("\n");
    fflush(stdout);
    cli_gen_report(&res, true);
    st = conv_add(conv, "assistant", res.text, res.text_len);
out:
    /* the sequence's full blocks stay in the engine's prefix cache for the next turn */
    td_engine_seq_end(g->eng, &seq);
    cli_gen_result_free(&res);
    free(prompt);
    return st;
}

int cmd_chat(int argc, char **argv)
{
    cli_gen_opts_t o = cli_gen_opts_default();
    int rc = parse_opts(argc, argv, &o);
    if (rc >= 0)
        return rc;
    o.chat = true;
    rc = 1;
    cli_gen_t g = {0};
    chat_conv_t conv = {0};
    char *line = NULL;
    size_t line_cap = 0;
    bool interactive = isatty(STDIN_FILENO);
    td_status_t st;

    if ((st = cli_gen_open(&g, &o, true)) != TD_OK)
        goto out;
    /* one sequence at a time, each up to the model's length; the previous turns' full blocks
     * stay cached (evicted oldest first when the pool needs them) */
    td_engine_config_t ec = td_engine_config_default();
    ec.max_batch_tokens = (int32_t)(o.prefill_chunk ? o.prefill_chunk : 512);
    ec.max_seqs = 1;
    ec.max_logit_rows = 1;
    ec.prefix_cache = true;
    if ((st = cli_gen_start_engine(&g, &o, &ec, g.model->config.max_seq_len)) != TD_OK)
        goto out;
    if (o.system && (st = conv_add(&conv, "system", o.system, strlen(o.system))) != TD_OK)
        goto out;
    conv.n_fixed = conv.n;
    for (;;) {
        if (interactive) {
            fprintf(stderr, "> ");
            fflush(stderr);
        }
        ssize_t len = getline(&line, &line_cap, stdin);
        if (len < 0)
            break;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
            line[--len] = '\0';
        if (!strcmp(line, "/exit"))
            break;
        if (!strcmp(line, "/reset")) {
            conv_truncate(&conv, conv.n_fixed);
            fprintf(stderr, "(new conversation)\n");
            continue;
        }
        if (len == 0)
            continue;
        if ((st = conv_add(&conv, "user", line, (size_t)len)) != TD_OK || (st = chat_turn(&g, &o, &conv)) != TD_OK)
            goto out;
    }
    rc = 0;
out:
    if (rc && !td_last_error()[0])
        fprintf(stderr, "tandem chat: failed\n");
    free(line);
    conv_truncate(&conv, 0);
    free(conv.m);
    cli_gen_close(&g);
    return rc;
}
