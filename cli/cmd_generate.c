/*
 * cmd_generate: `tandem generate`, one generation. Locally (--model): load the model and
 * tokenizer, prefill the prompt in chunks, decode token by token with the request's
 * sampling parameters, stream text (or print ids) and report timings on stderr. Against a
 * cluster (--server HOST:PORT): the same request as a gRPC call of
 * tandem.v1.Generation/Generate on a libuv loop, the streamed text (or ids) printed as it
 * arrives in the same format, timings (client TTFT and tokens/s, the router's Timings) on
 * stderr, and a gRPC status turned into a message that says what to do.
 */
#include <arpa/inet.h>
#include <inttypes.h>
#include <math.h>
#include <netdb.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_backend.h"
#include "cli_gen.h"
#include "td_cli.h"
#include "td_engine.h"
#include "td_gen_params.h"
#include "td_grpc.h"
#include "td_log.h"
#include "td_model.h"
#include "td_node.h"
#include "td_sampler.h"
#include "td_tokenizer.h"
#include "td_util.h"
#include "health.pb-c.h"
#include "tandem.pb-c.h"

#define GEN_DEFAULT_TIMEOUT_S 600.0f
#define GEN_DEFAULT_CONNECT_TIMEOUT_S 5.0f

/* The flags that need the model on this machine, refused with --server. */
static bool local_only(const char *flag)
{
    static const char *const names[] = {"model", "tokenizer", "threads", "device", "dtype", "quant", "kv-dtype", "kv-mem",
                                        "prefill-chunk", "spec", "draft-model", "draft-tokens"};
    for (size_t i = 0; i < TD_ARRAY_LEN(names); i++)
        if (!strcmp(flag, names[i]))
            return true;
    return false;
}

#define GEN_MAX_OPTS 64

/* What the flag table points at besides o: values converted after parsing, help texts with
 * numbers in them, the sampling flags (TD_SAMPLING_FIELDS). Used in place. */
typedef struct gen_flags {
    cli_gen_sampling_flags_t sampling;
    int64_t kv_mib, draft_tokens;
    td_dtype_t dtype;
    char stop_help[64], timeout_help[96], connect_help[64];
    td_opt_t opts[GEN_MAX_OPTS];
    int n_opts;
} gen_flags_t;

/* The flags of tandem generate, in --help order: the request's, the sampling flags, the
 * rest. Request parameters are parsed for their type only; their ranges are checked by
 * td_gen_params_validate (cli_gen_validate), as the gateway checks them. */
static void gen_flags_init(gen_flags_t *fl, cli_gen_opts_t *o)
{
    *fl = (gen_flags_t){.draft_tokens = o->spec.k_max, .dtype = TD_F32};
    cli_gen_sampling_flags_init(&fl->sampling, o);
    snprintf(fl->stop_help, sizeof fl->stop_help, "stop before this text (repeatable, up to %d)", TD_STOP_MAX_STRINGS);
    snprintf(fl->timeout_help, sizeof fl->timeout_help,
             "deadline of the whole generation, sent as grpc-timeout (default %.0f)", (double)GEN_DEFAULT_TIMEOUT_S);
    snprintf(fl->connect_help, sizeof fl->connect_help, "bound on reaching the server (default %.0f)",
             (double)GEN_DEFAULT_CONNECT_TIMEOUT_S);
    const td_opt_t head[] = {
        {.name = "model", .type = TD_OPT_STR, .ptr = &o->model, .arg = "PATH",
         .help = "GGUF file, llama2.c checkpoint (.bin) or Hugging Face model directory"},
        {.name = "tokenizer", .type = TD_OPT_STR, .ptr = &o->tokenizer, .arg = "PATH",
         .help = "tokenizer.bin / tokenizer.json / directory (default: beside the model)"},
        {.name = "prompt", .type = TD_OPT_STR, .ptr = &o->prompt, .arg = "TEXT",
         .help = "prompt text (BOS first when the tokenizer adds one: GGUF add_bos_token,\n"
                 "tokenizer_config.json add_bos_token, tokenizer.bin always)"},
        {.name = "prompt-ids", .type = TD_OPT_STR, .ptr = &o->prompt_ids, .arg = "IDS",
         .help = "prompt token ids, space-separated, taken as given (no BOS added)"},
        {.name = "chat", .type = TD_OPT_BOOL, .ptr = &o->chat,
         .help = "the prompt is a user message: rendered with the model's chat template\n"
                 "(docs/chat.md); generation also stops at the tokenizer's end-of-turn ids"},
        {.name = "system", .type = TD_OPT_STR, .ptr = &o->system, .arg = "TEXT",
         .help = "with --chat: a system message before the prompt"},
        {.name = "max-tokens", .type = TD_OPT_I64, .ptr = &o->max_tokens, .min = INT64_MIN, .max = INT64_MAX,
         .arg = "N", .help = "most tokens to generate (default: up to the model's length;\n"
                             "with --server: the server's default-max-tokens, and N >= 1)"},
        {.name = "json-schema", .type = TD_OPT_STR, .ptr = &o->json_schema, .arg = "FILE",
         .help = "structured output: the output is JSON valid under this JSON Schema\n"
                 "(the subset in docs/grammar.md; anything else is refused by name)"},
        {.name = "json-object", .type = TD_OPT_BOOL, .ptr = &o->json_object,
         .help = "structured output: the output is one JSON object"},
        {.name = "grammar", .type = TD_OPT_STR, .ptr = &o->grammar, .arg = "FILE",
         .help = "structured output: the output matches this GBNF grammar (llama.cpp's)"},
        {.name = "regex", .type = TD_OPT_STR, .ptr = &o->regex, .arg = "R",
         .help = "structured output: the output matches this regular expression whole"},
        {.name = "choice", .type = TD_OPT_STR, .ptr = &o->choice, .arg = "A,B,...",
         .help = "structured output: the output is exactly one of these strings"},
    };
    const td_opt_t tail[] = {
        {.name = "stop", .type = TD_OPT_FN, .ptr = o, .parse = cli_gen_parse_stop, .arg = "TEXT",
         .help = fl->stop_help},
        {.name = "stop-id", .type = TD_OPT_FN, .ptr = o, .parse = cli_gen_parse_stop_id, .arg = "ID",
         .help = "stop at this token id (repeatable); the model's EOS ids always stop"},
        {.name = "logit-bias", .type = TD_OPT_FN, .ptr = o, .parse = cli_gen_parse_logit_bias, .arg = "ID=B",
         .help = "add B (-100..100) to token ID's logit before sampling (repeatable; OpenAI's\n"
                 "logit_bias: 100 forces the token, -100 bans it)"},
        {.name = "threads", .type = TD_OPT_I64, .ptr = &o->threads, .min = 1, .max = 4096, .arg = "N",
         .help = "compute threads (default: all cores)"},
        {.name = "device", .type = TD_OPT_FN, .ptr = &o->device, .parse = cli_opt_device, .arg = "D",
         .help = "cpu (default), cuda (GPU 0) or cuda:N"},
        {.name = "dtype", .type = TD_OPT_FN, .ptr = &fl->dtype, .parse = cli_opt_dtype, .arg = "T",
         .help = "f32|f16|bf16: weights and KV cache in T (converted at load), and on cuda the\n"
                 "activations too (the CPU's are f32); default: cpu: weights as\n"
                 "stored, KV cache f32; cuda: the model's dtype for all three"},
        {.name = "quant", .type = TD_OPT_FN, .ptr = &o->quant, .parse = cli_opt_quant, .arg = "Q",
         .help = "q8_0|q4_0: quantize the float weight matrices to Q at load"},
        {.name = "kv-dtype", .type = TD_OPT_FN, .ptr = &o->kv_dtype, .parse = cli_opt_kv_dtype, .arg = "T",
         .help = "f32|f16|bf16|q8_0: the KV cache in T (default: as --dtype; q8_0: blocks of 32\n"
                 "with an f16 scale, half of f16's memory, llama.cpp's -ctk/-ctv q8_0)"},
        {.name = "kv-mem", .type = TD_OPT_I64, .ptr = &fl->kv_mib, .min = 1, .max = 1 << 22, .arg = "MIB",
         .help = "KV cache budget (default: what prompt + max tokens need)"},
        {.name = "prefill-chunk", .type = TD_OPT_I64, .ptr = &o->prefill_chunk, .min = 1, .max = 1 << 16,
         .arg = "N", .help = "prompt tokens per prefill step (default: the prompt, at most 512)"},
        {.name = "print-ids", .type = TD_OPT_BOOL, .ptr = &o->print_ids,
         .help = "print the generated ids on one line instead of text"},
        {.name = "logprobs", .type = TD_OPT_I64, .ptr = &o->logprobs, .min = INT32_MIN, .max = INT32_MAX, .arg = "N",
         .help = "after the output, each generated token's log-probability (natural log, of the\n"
                 "model's distribution before temperature and penalties) and its N most likely\n"
                 "alternatives (0..20), one line each: logprob gen I ID LOGPROB ID:LOGPROB..."},
        {.name = "prompt-logprobs", .type = TD_OPT_BOOL, .ptr = &o->prompt_logprobs,
         .help = "with --logprobs: the prompt's tokens too (logprob prompt I ...; the first has\n"
                 "no context: 0), computed without the prefix cache; with --server at most\n"
                 "4096 prompt tokens"},
        {.name = "log-level", .type = TD_OPT_FN, .parse = cli_gen_parse_log_level, .arg = "L",
         .help = "error|warn|info|debug"},
        {.name = "server", .type = TD_OPT_STR, .ptr = &o->server, .arg = "HOST:PORT",
         .help = "generate on a cluster: a gRPC call of tandem.v1.Generation/Generate\n"
                 "to a router's gateway (the `gateway:` line of `tandem local`); HOST\n"
                 "is an IPv4/IPv6 address ([::1]:PORT) or a name. The server holds the\n"
                 "model and tokenizer, so --model, --tokenizer, --threads, --device, --dtype,\n"
                 "--kv-mem and --prefill-chunk are refused with --server (usage error)."},
        {.name = "model-name", .type = TD_OPT_STR, .ptr = &o->model_name, .arg = "NAME",
         .help = "the served model to use (default: the server's only model)"},
        {.name = "request-id", .type = TD_OPT_STR, .ptr = &o->request_id, .arg = "ID",
         .help = "the request id the router logs (default: the router assigns one)"},
        {.name = "tpot-objective-ms", .type = TD_OPT_I64, .ptr = &o->tpot_objective_ms, .min = INT64_MIN,
         .max = INT64_MAX, .arg = "MS",
         .help = "the request's TPOT objective (default 0: the router's --tpot-objective-ms): under\n"
                 "--prefill-policy conditional or follow a decode node prefills a prompt itself only\n"
                 "in chunks that keep its steps within the tightest objective of its streams"},
        {.name = "timeout", .type = TD_OPT_F32, .ptr = &o->timeout_s, .fmin = 0.001f, .fmax = 86400.0f, .arg = "S",
         .help = fl->timeout_help},
        {.name = "connect-timeout", .type = TD_OPT_F32, .ptr = &o->connect_timeout_s, .fmin = 0.001f,
         .fmax = 3600.0f, .arg = "S",
         .help = fl->connect_help},
        CLI_GEN_SPEC_OPTS(o, &fl->draft_tokens),
    };
    fl->n_opts = cli_gen_opts_join(fl->opts, GEN_MAX_OPTS, head, TD_ARRAY_LEN(head), &fl->sampling, tail,
                                   TD_ARRAY_LEN(tail));
}

static void print_help(const gen_flags_t *fl)
{
    printf("usage: tandem generate --model PATH [--tokenizer PATH] (--prompt TEXT | --prompt-ids \"1 2 3\")\n"
           "                       [--chat [--system TEXT]] [--max-tokens N]\n");
    cli_gen_sampling_synopsis(stdout, &fl->sampling, "                       ");
    printf("                       [--stop TEXT]... [--stop-id ID]... [--logit-bias ID=B]...\n"
           "                       [--threads N] [--device cpu|cuda[:N]]\n"
           "                       [--dtype f32|f16|bf16] [--quant q8_0|q4_0] [--kv-dtype T] [--print-ids]\n"
           "                       [--logprobs N [--prompt-logprobs]]\n"
           "                       [--spec off|prompt-lookup|draft-model] [--draft-model PATH] [--draft-tokens K]\n"
           "       tandem generate --server HOST:PORT (--prompt TEXT | --prompt-ids \"1 2 3\")\n"
           "                       [the same sampling, stop and output flags]\n"
           "                       [--model-name NAME] [--request-id ID] [--timeout S] [--connect-timeout S]\n"
           "\n");
    td_opts_usage(stdout, fl->opts, fl->n_opts, false);
    printf("\n"
           "Text (or ids) go to stdout as they are produced; timings (prompt tokens/s, generation\n"
           "tokens/s, time to first token; with --server also the router's queue, prefill,\n"
           "transfer, first-token and per-token times) to stderr. Generation stops at a stop token\n"
           "or string, at --max-tokens, or at the model's maximum length. Exit status: 0 done,\n"
           "1 failed (with --server: the gRPC status is named in the message), 2 usage error.\n"
           "With --server, a router that requires API keys gets the one in TANDEM_API_KEY.\n");
}

/* The flags that conflict or need one another: 2 (a usage error, printed) or -1 (go on). */
static int check_flags(cli_gen_opts_t *o)
{
    if (o->server && o->local_only) {
        fprintf(stderr,
                "tandem generate: --%s applies to local generation only; with --server the server's "
                "nodes hold the model (see --help)\n",
                o->local_only);
        return 2;
    }
    if (!o->server && (o->model_name || o->request_id || o->timeout_s > 0 || o->connect_timeout_s > 0 ||
                       o->tpot_objective_ms != 0)) {
        fprintf(stderr, "tandem generate: --model-name, --request-id, --tpot-objective-ms, --timeout and "
                        "--connect-timeout need --server\n");
        return 2;
    }
    if (!o->model && !o->server) {
        fprintf(stderr, "tandem generate: give --model PATH (local) or --server HOST:PORT (a cluster)\n");
        return 2;
    }
    if (o->server && o->max_tokens == 0) {
        fprintf(stderr, "tandem generate: --max-tokens 0 with --server: the request's 0 means the server's default; "
                        "give N >= 1\n");
        return 2;
    }
    if (o->prompt_logprobs && o->logprobs < 0) {
        fprintf(stderr, "tandem generate: --prompt-logprobs needs --logprobs N\n");
        return 2;
    }
    if (o->system && !o->chat) {
        fprintf(stderr, "tandem generate: --system needs --chat\n");
        return 2;
    }
    if (o->chat && !o->prompt) {
        fprintf(stderr, "tandem generate: --chat needs --prompt TEXT (the user's message)\n");
        return 2;
    }
    if (!o->prompt == !o->prompt_ids) {
        fprintf(stderr, "tandem generate: give exactly one of --prompt and --prompt-ids\n");
        return 2;
    }
    /* --prompt-ids is counted by the engine or the gateway: a flag's text (at most 128 KiB on
     * Linux) holds far fewer than TD_GEN_MAX_PROMPT ids */
    if (!cli_gen_validate("generate", o, o->prompt != NULL, o->prompt ? strlen(o->prompt) : 0))
        return 2;
    return -1;
}

static int parse_opts(int argc, char **argv, cli_gen_opts_t *o)
{
    gen_flags_t fl;
    gen_flags_init(&fl, o);
    int given[GEN_MAX_OPTS] = {0};
    td_opts_t spec = {.prog = "generate", .opts = fl.opts, .n_opts = fl.n_opts};
    td_opts_result_t r = {.given = given};
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return 2;
    if (r.help) {
        print_help(&fl);
        return 0;
    }
    cli_gen_sampling_apply(&fl.sampling, o);
    if (!cli_gen_spec_resolve("generate", o, fl.draft_tokens))
        return 2;
    o->kv_mem = (size_t)fl.kv_mib << 20;
    o->max_tokens_given = td_opts_given(&spec, &r, "max-tokens") != 0;
    if (td_opts_given(&spec, &r, "dtype"))
        o->dtype = (int)fl.dtype;
    int first_local = 0;
    for (int i = 0; i < fl.n_opts; i++)
        if (given[i] && local_only(fl.opts[i].name) && (!first_local || given[i] < first_local)) {
            first_local = given[i];
            o->local_only = fl.opts[i].name;
        }
    int rc = check_flags(o);
    if (rc < 0 && !cli_gen_grammar("generate", o))
        return 2;
    return rc;
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

/* ---- --server: a gRPC client of tandem.v1.Generation/Generate ----------------------- */

typedef struct remote_state {
    uv_loop_t loop;
    td_grpc_channel_t *ch;
    td_grpc_client_call_t *gen;        /* NULL once it ended */
    td_grpc_client_call_t *health;     /* the reachability probe; NULL once it ended */
    uv_signal_t sigint, sigterm;
    const cli_gen_opts_t *o;
    const char *addr;                  /* "HOST:PORT" as given, for messages */
    bool reached;                      /* the server answered something */
    bool unreachable;                  /* the probe timed out before any answer */
    int interrupted;                   /* the signal that cancelled the call, or 0 */
    td_grpc_code_t code;
    char message[512];
    uint64_t t0, t_first, t_last;      /* ns: call start, first and last token */
    uint32_t n_gen;
    bool got_text;
    char request_id[128];              /* as the router named it (first message) */
    bool finished;                     /* the last message (finish_reason) arrived */
    Tandem__V1__FinishReason finish;
    uint32_t prompt_tokens, completion_tokens, cached_tokens;
    bool have_timings;
    double queue_s, prefill_s, transfer_s, first_token_s, per_token_s, total_s;
    bool prefill_local;                /* prefilled on the decode (or unified) node itself */
    bool prefill_peer;                 /* ... on another decode node (--prefill-policy follow) */
    char prefill_node[64], decode_node[64]; /* Timings' node ids ("" from an older router) */
    td_token_logprob_t *lps;           /* [n_lps] with --logprobs: as they came */
    size_t n_lps, cap_lps;
    td_token_logprob_t *prompt_lps;    /* [n_prompt_lps] with --prompt-logprobs */
    size_t n_prompt_lps;
    bool lps_short;                    /* out of memory, or a message without them */
} remote_state_t;

/* "HOST:PORT", "[v6]:PORT" or "name:PORT" → a numeric address (names resolved, IPv4
 * preferred: `tandem local` serves on 127.0.0.1) and the port. */
static td_status_t resolve_server(const char *addr, char *ip, size_t cap, uint16_t *port_p)
{
    char host[256];
    const char *port_s;
    if (addr[0] == '[') {
        const char *end = strchr(addr, ']');
        if (!end || end[1] != ':' || (size_t)(end - addr - 1) >= sizeof host)
            return td_errorf(TD_ERR_INVALID, "--server '%s': expected [IPV6]:PORT", addr);
        snprintf(host, sizeof host, "%.*s", (int)(end - addr - 1), addr + 1);
        port_s = end + 2;
    } else {
        const char *colon = strrchr(addr, ':');
        if (!colon || colon == addr || memchr(addr, ':', (size_t)(colon - addr)) ||
            (size_t)(colon - addr) >= sizeof host)
            return td_errorf(TD_ERR_INVALID, "--server '%s': expected HOST:PORT (IPv6 as [ADDR]:PORT)", addr);
        snprintf(host, sizeof host, "%.*s", (int)(colon - addr), addr);
        port_s = colon + 1;
    }
    int64_t port;
    if (td_parse_i64(port_s, 1, 65535, "--server port", &port) != TD_OK)
        return TD_ERR_INVALID;
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = -1;
    for (int family = AF_INET; rc != 0 && family != -1; family = family == AF_INET ? AF_UNSPEC : -1) {
        hints.ai_family = family;
        rc = getaddrinfo(host, NULL, &hints, &res);
    }
    if (rc != 0)
        return td_errorf(TD_ERR_UNAVAILABLE, "--server '%s': cannot resolve '%s': %s", addr, host, gai_strerror(rc));
    const void *a = res->ai_family == AF_INET6 ? (const void *)&((struct sockaddr_in6 *)res->ai_addr)->sin6_addr
                                               : (const void *)&((struct sockaddr_in *)res->ai_addr)->sin_addr;
    bool ok = inet_ntop(res->ai_family, a, ip, (socklen_t)cap) != NULL;
    freeaddrinfo(res);
    if (!ok)
        return td_errorf(TD_ERR_INVALID, "--server '%s': cannot format the address of '%s'", addr, host);
    *port_p = (uint16_t)port;
    return TD_OK;
}

static void remote_print_ids(remote_state_t *r, const uint32_t *ids, size_t n)
{
    for (size_t i = 0; i < n; i++, r->n_gen++)
        printf(r->n_gen ? " %u" : "%u", ids[i]);
    fflush(stdout);
}

/* A message's log-probabilities, kept to print after the output. */
static void remote_keep_logprobs(remote_state_t *r, const Tandem__V1__GenerateResponse *m)
{
    if (m->n_logprobs != m->n_token_ids)
        r->lps_short = true;
    if (r->n_lps + m->n_logprobs > r->cap_lps) {
        size_t cap = TD_MAX(2 * r->cap_lps, r->n_lps + m->n_logprobs);
        td_token_logprob_t *p = realloc(r->lps, cap * sizeof *p);
        if (!p) {
            r->lps_short = true;
            return;
        }
        r->lps = p;
        r->cap_lps = cap;
    }
    for (size_t i = 0; i < m->n_logprobs; i++)
        td_node_logprob_from_proto(m->logprobs[i], &r->lps[r->n_lps++]);
    if (m->n_prompt_logprobs && !r->prompt_lps) {
        if (!(r->prompt_lps = malloc(m->n_prompt_logprobs * sizeof *r->prompt_lps))) {
            r->lps_short = true;
            return;
        }
        for (size_t i = 0; i < m->n_prompt_logprobs; i++)
            td_node_logprob_from_proto(m->prompt_logprobs[i], &r->prompt_lps[i]);
        r->n_prompt_lps = m->n_prompt_logprobs;
    }
}

static void on_gen_message(td_grpc_client_call_t *call, const ProtobufCMessage *msg, void *data)
{
    remote_state_t *r = data;
    const Tandem__V1__GenerateResponse *m = (const void *)msg;
    r->reached = true;
    if (r->o->logprobs >= 0)
        remote_keep_logprobs(r, m);
    if (!r->request_id[0] && m->request_id && m->request_id[0])
        snprintf(r->request_id, sizeof r->request_id, "%s", m->request_id);
    if (m->n_token_ids) {
        uint64_t now = td_now_ns();
        if (!r->t_first)
            r->t_first = now;
        r->t_last = now;
    }
    if (r->o->print_ids) {
        remote_print_ids(r, m->token_ids, m->n_token_ids);
    } else {
        r->n_gen += (uint32_t)m->n_token_ids;
        if (m->text && m->text[0]) {
            r->got_text = true;
            fputs(m->text, stdout);
            fflush(stdout);
        }
    }
    if (m->finish_reason != TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED) {
        r->finished = true;
        r->finish = m->finish_reason;
    }
    if (m->usage) {
        r->prompt_tokens = m->usage->prompt_tokens;
        r->completion_tokens = m->usage->completion_tokens;
        r->cached_tokens = m->usage->cached_tokens;
    }
    if (m->timings) {
        const Tandem__V1__Timings *t = m->timings;
        r->have_timings = true;
        r->queue_s = t->queue_s;
        r->prefill_s = t->prefill_s;
        r->transfer_s = t->transfer_s;
        r->first_token_s = t->first_token_s;
        r->per_token_s = t->per_token_s;
        r->total_s = t->total_s;
        r->prefill_local = t->prefill_local;
        r->prefill_peer = t->prefill_peer;
        snprintf(r->prefill_node, sizeof r->prefill_node, "%s", t->prefill_node ? t->prefill_node : "");
        snprintf(r->decode_node, sizeof r->decode_node, "%s", t->decode_node ? t->decode_node : "");
    }
}

static void remote_close_handles(remote_state_t *r)
{
    td_grpc_channel_close(r->ch, NULL, NULL); /* ends the probe if it still runs */
    r->ch = NULL;
    if (!uv_is_closing((uv_handle_t *)&r->sigint)) {
        uv_close((uv_handle_t *)&r->sigint, NULL);
        uv_close((uv_handle_t *)&r->sigterm, NULL);
    }
}

static void on_gen_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *message, void *data)
{
    remote_state_t *r = data;
    r->gen = NULL;
    r->code = code;
    /* a status from the server (the connection still up, or not a local "connection to
     * HOST: ..." failure) means it was reached, even if the probe had not answered yet */
    if (code != TD_GRPC_OK && (td_grpc_channel_is_usable(r->ch) || strncmp(message, "connection to ", 14) != 0))
        r->reached = true;
    snprintf(r->message, sizeof r->message, "%s", message);
    remote_close_handles(r);
}

/* The probe answered (any status but a local failure means the server is there), or it
 * ran out of time before the connection came up: then the generation is cancelled. */
static void on_health_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *message, void *data)
{
    remote_state_t *r = data;
    r->health = NULL;
    if (code != TD_GRPC_DEADLINE_EXCEEDED && code != TD_GRPC_UNAVAILABLE && code != TD_GRPC_CANCELLED)
        r->reached = true;
    else if (code == TD_GRPC_DEADLINE_EXCEEDED && !r->reached && r->gen) {
        r->unreachable = true;
        td_grpc_client_call_cancel(r->gen); /* on_gen_done runs now */
    }
}

static void on_remote_signal(uv_signal_t *h, int signum)
{
    remote_state_t *r = h->data;
    r->interrupted = signum;
    if (r->gen)
        td_grpc_client_call_cancel(r->gen); /* RST_STREAM: the router releases the request */
}

/* A message that says what happened and what to do, for a call that did not end OK. */
static void remote_report_error(const remote_state_t *r)
{
    const char *m = r->message[0] ? r->message : "no message";
    const char *name = td_grpc_code_name(r->code);
    if (r->interrupted) {
        td_errorf(TD_ERR_CANCELLED, "interrupted by signal %d; the request was cancelled on the server", r->interrupted);
        return;
    }
    if (r->unreachable) {
        td_errorf(TD_ERR_UNAVAILABLE, "no answer from %s within --connect-timeout %g s: is a router's gateway "
                  "listening there (the `gateway:` line of `tandem local`)?", r->addr, (double)r->o->connect_timeout_s);
        return;
    }
    switch (r->code) {
    case TD_GRPC_UNAVAILABLE:
        if (!r->reached)
            td_errorf(TD_ERR_UNAVAILABLE, "cannot reach the server at %s (UNAVAILABLE: %s): is a router's gateway "
                      "listening there (the `gateway:` line of `tandem local`)?", r->addr, m);
        else
            td_errorf(TD_ERR_UNAVAILABLE, "the cluster could not serve the request (UNAVAILABLE: %s); retry, or check "
                      "that prefill and decode nodes are up", m);
        break;
    case TD_GRPC_DEADLINE_EXCEEDED:
        td_errorf(TD_ERR_TIMEOUT, "the generation did not finish within --timeout %g s (DEADLINE_EXCEEDED: %s)",
                  (double)r->o->timeout_s, m);
        break;
    case TD_GRPC_INVALID_ARGUMENT:
        td_errorf(TD_ERR_INVALID, "the server refused the request (INVALID_ARGUMENT: %s)", m);
        break;
    case TD_GRPC_RESOURCE_EXHAUSTED:
        td_errorf(TD_ERR_EXHAUSTED, "the cluster is full (RESOURCE_EXHAUSTED: %s); retry later or lower --max-tokens", m);
        break;
    case TD_GRPC_NOT_FOUND:
        td_errorf(TD_ERR_NOT_FOUND, "the server does not serve that model (NOT_FOUND: %s); check --model-name", m);
        break;
    case TD_GRPC_UNIMPLEMENTED:
        td_errorf(TD_ERR_INVALID, "%s does not serve tandem.v1.Generation/Generate (UNIMPLEMENTED: %s): give the "
                  "router's gateway port, not its control or a node's port", r->addr, m);
        break;
    default:
        td_errorf(TD_ERR_IO, "the generation failed (%s: %s)", name, m);
        break;
    }
}

static const char *finish_name(Tandem__V1__FinishReason f)
{
    switch (f) {
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_EOS: return "eos";
    default: return "unspecified";
    }
}

/* Client-side timings in the local mode's format, then the router's. */
static void remote_report_timings(const remote_state_t *r)
{
    double ttft_ms = r->t_first ? (double)(r->t_first - r->t0) * 1e-6 : 0.0;
    double gen_s = (double)(r->t_last - r->t_first) * 1e-9;
    double prompt_tps = r->prefill_s > 0 ? (double)r->prompt_tokens / r->prefill_s : 0.0;
    fprintf(stderr,
            "\nprompt: %u tokens, %.1f tokens/s | generation: %u tokens, %.1f tokens/s | time to first token: %.1f ms\n",
            r->prompt_tokens, prompt_tps, r->n_gen, r->n_gen > 1 && gen_s > 0 ? (double)(r->n_gen - 1) / gen_s : 0.0,
            ttft_ms);
    fprintf(stderr,
            "server: request %s, finish %s, %u cached prompt tokens | queue %.2f ms | prefill %.2f ms on %s | transfer %.2f ms | "
            "first token %.2f ms | per token %.2f ms | total %.2f ms | prefill node %s, decode node %s\n",
            r->request_id[0] ? r->request_id : "?", finish_name(r->finish), r->cached_tokens, r->queue_s * 1e3, r->prefill_s * 1e3,
            r->prefill_local ? "the decode node" : r->prefill_peer ? "another decode node" : "a prefill node",
            r->transfer_s * 1e3, r->first_token_s * 1e3, r->per_token_s * 1e3, r->total_s * 1e3,
            r->prefill_node[0] ? r->prefill_node : "?", r->decode_node[0] ? r->decode_node : "?");
}

static int gen_remote(cli_gen_opts_t *o)
{
    if (o->timeout_s <= 0)
        o->timeout_s = GEN_DEFAULT_TIMEOUT_S;
    if (o->connect_timeout_s <= 0)
        o->connect_timeout_s = GEN_DEFAULT_CONNECT_TIMEOUT_S;
    int rc = 1;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    uint32_t *wire_ids = NULL, stop_ids[TD_GEN_MAX_STOP_IDS];
    char ip[INET6_ADDRSTRLEN];
    uint16_t port = 0;
    td_status_t st;
    if ((st = resolve_server(o->server, ip, sizeof ip, &port)) != TD_OK)
        return st == TD_ERR_INVALID ? 2 : 1;
    if (o->prompt_ids) {
        if ((st = parse_ids(o->prompt_ids, &ids, &n_ids)) != TD_OK)
            return st == TD_ERR_INVALID ? 2 : 1;
        if (n_ids == 0) {
            td_errorf(TD_ERR_INVALID, "--prompt-ids: no ids given");
            free(ids);
            return 2;
        }
        if (!(wire_ids = malloc(n_ids * sizeof *wire_ids))) {
            td_errorf(TD_ERR_NOMEM, "out of memory");
            free(ids);
            return 1;
        }
        for (size_t i = 0; i < n_ids; i++)
            wire_ids[i] = (uint32_t)ids[i];
    }
    for (int32_t i = 0; i < o->n_stop_ids; i++)
        stop_ids[i] = (uint32_t)o->stop_ids[i];

    Tandem__V1__SamplingParams sp;
    td_node_sampling_to_proto(&o->sampling, &sp);
    Tandem__V1__GenerateRequest req = TANDEM__V1__GENERATE_REQUEST__INIT;
    /* --chat: the conversation goes as messages; the router renders it with its template */
    Tandem__V1__ChatMessage turns[2], *turn_ptrs[2];
    size_t n_turns = 0;
    if (o->chat) {
        const char *role[2] = {"system", "user"}, *content[2] = {o->system, o->prompt};
        for (int i = o->system ? 0 : 1; i < 2; i++, n_turns++) {
            tandem__v1__chat_message__init(&turns[n_turns]);
            turns[n_turns].role = (char *)role[i];
            turns[n_turns].content = (char *)content[i];
            turn_ptrs[n_turns] = &turns[n_turns];
        }
        req.messages = turn_ptrs;
        req.n_messages = n_turns;
    }
    req.prompt = o->prompt && !o->chat ? (char *)o->prompt : "";
    req.prompt_ids = wire_ids;
    req.n_prompt_ids = n_ids;
    req.max_tokens = o->max_tokens > 0 ? (uint32_t)o->max_tokens : 0;
    req.sampling = &sp;
    req.stop_ids = stop_ids;
    req.n_stop_ids = (size_t)o->n_stop_ids;
    req.stop_strings = (char **)o->stops;
    req.n_stop_strings = (size_t)o->n_stops;
    req.request_id = o->request_id ? (char *)o->request_id : "";
    req.model = o->model_name ? (char *)o->model_name : "";
    req.tpot_objective_ms = (uint32_t)o->tpot_objective_ms; /* in range: cli_gen_validate */
    /* structured output: the flag's own kind and text (checked by the compile in
       cli_gen_grammar); the router compiles it again, as for any gateway client */
    Tandem__V1__Grammar gr = TANDEM__V1__GRAMMAR__INIT;
    if (o->gram) {
        switch (o->gram_kind) {
        case TD_GRAM_GBNF: gr.kind = TANDEM__V1__GRAMMAR__KIND__KIND_GBNF; break;
        case TD_GRAM_REGEX: gr.kind = TANDEM__V1__GRAMMAR__KIND__KIND_REGEX; break;
        case TD_GRAM_CHOICE: gr.kind = TANDEM__V1__GRAMMAR__KIND__KIND_CHOICE; break;
        case TD_GRAM_JSON_OBJECT: gr.kind = TANDEM__V1__GRAMMAR__KIND__KIND_JSON_OBJECT; break;
        case TD_GRAM_JSON_SCHEMA: gr.kind = TANDEM__V1__GRAMMAR__KIND__KIND_JSON_SCHEMA; break;
        }
        gr.source = o->gram_src;
        req.grammar = &gr;
    }
    Tandem__V1__LogprobsRequest lq = TANDEM__V1__LOGPROBS_REQUEST__INIT;
    if (o->logprobs >= 0) {
        lq.top_logprobs = (uint32_t)o->logprobs; /* validated: 0..20 */
        lq.prompt = o->prompt_logprobs;
        req.logprobs = &lq;
    }

    remote_state_t r = {.o = o, .addr = o->server};
    uv_loop_init(&r.loop);
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    if ((st = td_grpc_channel_create(&r.loop, ip, port, &cc, &r.ch)) != TD_OK)
        goto out_loop;
    uv_signal_init(&r.loop, &r.sigint);
    uv_signal_init(&r.loop, &r.sigterm);
    r.sigint.data = r.sigterm.data = &r;
    uv_signal_start(&r.sigint, on_remote_signal, SIGINT);
    uv_signal_start(&r.sigterm, on_remote_signal, SIGTERM);
    td_grpc_call_opts_t co = {.response_desc = &tandem__v1__generate_response__descriptor,
                              .on_message = on_gen_message, .on_done = on_gen_done, .data = &r,
                              .timeout_ms = (uint32_t)TD_MAX(1.0f, o->timeout_s * 1000.0f)};
    /* the gateway's API key comes from the environment, not a flag: argv shows in ps */
    const char *key = getenv("TANDEM_API_KEY");
    char bearer[1024];
    td_grpc_header_t auth = {"authorization", bearer};
    if (key && key[0]) {
        snprintf(bearer, sizeof bearer, "Bearer %s", key);
        co.headers = &auth;
        co.n_headers = 1;
    }
    r.t0 = td_now_ns();
    if ((st = td_grpc_channel_call(r.ch, "/tandem.v1.Generation/Generate", &req.base, &co, &r.gen)) != TD_OK) {
        char why[256];
        snprintf(why, sizeof why, "%s", td_last_error());
        td_errorf(st, "cannot send the request to %s: %s", o->server, why);
        remote_close_handles(&r);
        goto out_run;
    }
    Grpc__Health__V1__HealthCheckRequest hreq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    td_grpc_call_opts_t ho = {.response_desc = &grpc__health__v1__health_check_response__descriptor,
                              .on_done = on_health_done, .data = &r,
                              .timeout_ms = (uint32_t)TD_MAX(1.0f, o->connect_timeout_s * 1000.0f)};
    if (td_grpc_channel_call(r.ch, "/grpc.health.v1.Health/Check", &hreq.base, &ho, &r.health) != TD_OK)
        r.health = NULL; /* the generation's own deadline still bounds the wait */
    uv_run(&r.loop, UV_RUN_DEFAULT);
    if (r.code == TD_GRPC_OK && r.finished) {
        if (o->print_ids)
            printf("\n");
        fflush(stdout);
        if (!o->print_ids && r.n_gen && !r.got_text)
            td_warn("generate: the server sent %u tokens but no text (a router without a tokenizer?): "
                    "add --print-ids to see the ids", r.n_gen);
        if (o->logprobs >= 0) {
            if (!o->print_ids)
                printf("\n");
            cli_gen_print_logprobs("prompt", r.prompt_lps, r.n_prompt_lps);
            cli_gen_print_logprobs("gen", r.lps, r.n_lps);
            if (r.lps_short || (o->prompt_logprobs && !r.n_prompt_lps))
                td_warn("generate: the server sent fewer log-probabilities than asked (%zu for %u tokens%s)", r.n_lps,
                        r.n_gen, o->prompt_logprobs && !r.n_prompt_lps ? ", none for the prompt" : "");
        }
        remote_report_timings(&r);
        rc = 0;
    } else {
        if (o->print_ids && r.n_gen)
            printf("\n");
        fflush(stdout);
        if (r.code == TD_GRPC_OK)
            td_errorf(TD_ERR_PROTOCOL, "the server ended the stream without a finish reason");
        else
            remote_report_error(&r);
    }
    goto out_loop;
out_run:
    uv_run(&r.loop, UV_RUN_DEFAULT);
out_loop:
    uv_run(&r.loop, UV_RUN_DEFAULT); /* close callbacks */
    if (uv_loop_close(&r.loop) != 0)
        td_warn("generate: a libuv handle was left open");
    free(wire_ids);
    free(ids);
    free(r.lps);
    free(r.prompt_lps);
    return rc;
}

int cmd_generate(int argc, char **argv)
{
    cli_gen_opts_t o = cli_gen_opts_default();
    int rc = parse_opts(argc, argv, &o);
    if (rc >= 0)
        return rc;
    if (o.server) {
        rc = gen_remote(&o);
        cli_gen_grammar_free(&o);
        return rc;
    }
    rc = 1;

    cli_gen_t g = {0};
    cli_gen_result_t res = {0};
    int32_t *prompt = NULL;
    size_t n_prompt = 0;
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    td_status_t st;

    if ((st = cli_gen_open(&g, &o, o.prompt || !o.print_ids)) != TD_OK)
        goto out;
    if (o.chat) {
        td_chat_message_t m[2];
        size_t n = 0;
        if (o.system)
            m[n++] = (td_chat_message_t){.role = "system", .content = o.system};
        m[n++] = (td_chat_message_t){.role = "user", .content = o.prompt};
        if ((st = cli_gen_chat_prompt(&g, m, n, &prompt, &n_prompt)) != TD_OK)
            goto out;
    } else if (o.prompt) {
        if ((st = td_tokenizer_encode(g.tok, o.prompt, strlen(o.prompt), g.add_bos ? TD_TOK_ADD_BOS : 0, &prompt,
                                      &n_prompt)) != TD_OK)
            goto out;
    } else if ((st = parse_ids(o.prompt_ids, &prompt, &n_prompt)) != TD_OK) {
        rc = st == TD_ERR_INVALID ? 2 : 1;
        goto out;
    } else if (n_prompt == 0) { /* a usage error, as with --server */
        td_errorf(TD_ERR_INVALID, "--prompt-ids: no ids given");
        rc = 2;
        goto out;
    }
    if ((st = cli_gen_check_prompt(&g, prompt, n_prompt)) != TD_OK)
        goto out;
    int64_t room = g.model->config.max_seq_len - (int64_t)n_prompt;
    int64_t max_new = o.max_tokens < 0 ? room : TD_MIN(o.max_tokens, room);

    /* one sequence, nothing to reuse: no prefix cache; the pool holds prompt + max tokens */
    td_engine_config_t ec = td_engine_config_default();
    ec.max_batch_tokens = (int32_t)(o.prefill_chunk ? o.prefill_chunk : TD_MIN(512, (int64_t)n_prompt));
    ec.max_seqs = 1;
    ec.max_logit_rows = o.prompt_logprobs ? ec.max_batch_tokens : 1; /* every prompt row, chunk by chunk */
    ec.prefix_cache = false;
    if ((st = cli_gen_start_engine(&g, &o, &ec, (int64_t)n_prompt + max_new)) != TD_OK ||
        (st = cli_gen_run(&g, &o, &seq, prompt, n_prompt, max_new, &res)) != TD_OK)
        goto out;
    if (o.logprobs >= 0) {
        if (!o.print_ids)
            printf("\n");
        cli_gen_print_logprobs("prompt", res.prompt_lps, res.prompt_lps ? res.n_prompt : 0);
        cli_gen_print_logprobs("gen", res.lps, (size_t)res.n_gen);
    }
    cli_gen_report(&res, false);
    rc = 0;
out:
    if (rc && !td_last_error()[0])
        fprintf(stderr, "tandem generate: failed\n"); /* every decided error was logged where decided */
    if (g.eng)
        td_engine_seq_end(g.eng, &seq);
    cli_gen_result_free(&res);
    free(prompt);
    cli_gen_close(&g);
    cli_gen_grammar_free(&o);
    return rc;
}
