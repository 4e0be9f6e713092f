/*
 * cmd_local: `tandem local --model PATH --prefill N --decode M [--unified U]`: a whole
 * cluster on 127.0.0.1 as separate processes of this same binary (router, N prefill, M
 * decode and U unified nodes; `--unified U` alone: the colocated baseline). Prints `gateway: HOST:PORT`, `openai: URL` (the router's OpenAI HTTP API, unless
 * --http-port -1) and `metrics: URL` once every node registered, then
 * waits; SIGINT/SIGTERM (or the router's death) stops every process it started
 * (SIGINT, so that nodes stop at once rather than drain; SIGKILL after a bound). Each cluster gets a cluster secret of its own
 * (docs/security.md), written 0600 into a run directory that is removed at the end.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "td_auth.h"
#include "td_backend.h"
#include "td_child.h"
#include "td_cli.h"
#include "td_engine.h"
#include "td_log.h"
#include "td_model.h"
#include "td_spec.h"
#include "td_util.h"

#define LOCAL_MAX_CHILDREN 66

typedef struct local_state {
    td_child_t kids[LOCAL_MAX_CHILDREN]; /* [0] the router, its stdout piped to us */
    int n;
} local_state_t;

static volatile sig_atomic_t local_stop;

static void on_sig(int sig)
{
    local_stop = sig;
}

/* Starts this binary again with argv: the router with its stdout piped to us (out_pipe),
 * a node with its stdout on our stderr (its banners are not our output). */
static td_status_t spawn(local_state_t *l, const char *self, char *const argv[], bool out_pipe)
{
    td_child_config_t cc = td_child_config_default();
    cc.file = self;
    cc.argv = argv;
    cc.out = out_pipe ? TD_CHILD_OUT_PIPE : TD_CHILD_OUT_STDERR;
    td_status_t st = td_child_spawn(&cc, &l->kids[l->n]);
    if (st == TD_OK)
        l->n++;
    return st;
}

/* Reads one line of the router's stdout within timeout_ms; NULL on timeout, EOF or a
 * stop signal. */
static const char *read_line(local_state_t *l, int timeout_ms, char *line, size_t cap)
{
    uint64_t end = td_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        uint64_t now = td_now_ns();
        if (now >= end || local_stop)
            return NULL;
        td_status_t st = td_child_read_line(&l->kids[0], (int)((end - now) / 1000000ull) + 1, line, cap);
        if (st == TD_OK)
            return line;
        if (st != TD_ERR_CANCELLED) /* a signal: look at local_stop, then wait on */
            return NULL;
    }
}

/* What every node of one machine gets: compute threads and the KV flag, per role. */
typedef struct local_plan {
    char threads[24];
    const char *kv_flag;       /* "--kv-blocks", "--kv-mem", or NULL: the nodes' own defaults */
    char kv_decode[24], kv_prefill[24];
} local_plan_t;

/* Shares one machine among its nodes, and says how on stderr: threads = cores (the
 * affinity mask) / nodes, so that the nodes' pools do not oversubscribe the cores; the KV
 * pools one budget measured once (td_engine_kv_budget), split TD_KV_LOCAL_DECODE_SHARE : 1
 * between a decode and a prefill node, so N nodes started together do not each take their
 * standalone share. Flags given win. */
static void local_plan(int64_t n_prefill, int64_t n_decode, int64_t threads, int64_t kv_blocks, int64_t kv_mem,
                       bool device, local_plan_t *p)
{
    int64_t nodes = n_prefill + n_decode;
    if (threads == 0) {
        int cores = td_cpu_count();
        threads = TD_MAX(1, cores / nodes);
        fprintf(stderr, "tandem local: %d cores, %lld nodes: %lld compute thread%s each\n", cores, (long long)nodes,
                (long long)threads, threads == 1 ? "" : "s");
    }
    snprintf(p->threads, sizeof p->threads, "%lld", (long long)threads);
    p->kv_flag = NULL;
    if (kv_blocks || kv_mem) {
        p->kv_flag = kv_blocks ? "--kv-blocks" : "--kv-mem";
        snprintf(p->kv_decode, sizeof p->kv_decode, "%lld", (long long)(kv_blocks ? kv_blocks : kv_mem));
        snprintf(p->kv_prefill, sizeof p->kv_prefill, "%s", p->kv_decode);
        return;
    }
    if (device) {
        fprintf(stderr, "tandem local: KV pools in device memory: each node's fixed default (decode %zu MiB, "
                "prefill %zu MiB)\n", TD_KV_DECODE_DEVICE_DEFAULT >> 20, TD_KV_PREFILL_DEVICE_DEFAULT >> 20);
        return;
    }
    td_kv_budget_t b = td_engine_kv_budget(TD_KV_LOCAL_PERCENT, (size_t)n_decode * TD_KV_DECODE_CAP +
                                           (size_t)n_prefill * TD_KV_PREFILL_CAP, 0);
    if (!b.measured) {
        fprintf(stderr, "tandem local: available memory unknown: each node's own kv-mem default\n");
        return;
    }
    size_t unit = b.bytes / (size_t)(TD_KV_LOCAL_DECODE_SHARE * n_decode + n_prefill);
    size_t dec = TD_MIN(unit * TD_KV_LOCAL_DECODE_SHARE, TD_KV_DECODE_CAP), pre = TD_MIN(unit, TD_KV_PREFILL_CAP);
    p->kv_flag = "--kv-mem";
    snprintf(p->kv_decode, sizeof p->kv_decode, "%zu", TD_MAX(dec >> 20, (size_t)1));
    snprintf(p->kv_prefill, sizeof p->kv_prefill, "%zu", TD_MAX(pre >> 20, (size_t)1));
    char bs[32], how[128], ds[32], ps[32];
    fprintf(stderr, "tandem local: kv-mem %s (%s) for %lld decode and %lld prefill node%s: at most %s per decode "
            "node, at most %s per prefill node; each takes what it serves (its kv pool line)\n", td_format_bytes(b.bytes, bs, sizeof bs),
            td_engine_kv_budget_describe(&b, how, sizeof how), (long long)n_decode, (long long)n_prefill,
            n_prefill == 1 ? "" : "s", td_format_bytes(dec, ds, sizeof ds), td_format_bytes(pre, ps, sizeof ps));
}

/* tandem local's flags (-1: not given) */
typedef struct local_opts {
    const char *model, *tokenizer, *log_level, *host, *advertise, *device, *dtype, *kv_dtype, *api_keys, *spec_mode,
        *draft_model, *prefill_policy;
    int64_t n_prefill, n_decode, n_unified, threads, kv_blocks, kv_mem, kv_seqs, ctx_size, http_port, prefill_chunk,
        draft_tokens, tpot_objective_ms, ttft_objective_ms;
    td_spec_mode_t mode; /* spec_mode resolved */
} local_opts_t;

/* The router's addresses, from its first lines */
typedef struct local_router {
    char gateway[512], control[512], metrics[512], openai[512];
} local_router_t;

/* Starts the router (the first child, its stdout piped) and reads its addresses. */
static td_status_t start_router(local_state_t *l, const local_opts_t *o, const char *self, const char *secret,
                                local_router_t *rt)
{
    char http_port_s[24], tpot_s[24], ttft_s[24], line[512];
    snprintf(http_port_s, sizeof http_port_s, "%lld", (long long)o->http_port);
    snprintf(tpot_s, sizeof tpot_s, "%lld", (long long)o->tpot_objective_ms);
    snprintf(ttft_s, sizeof ttft_s, "%lld", (long long)o->ttft_objective_ms);
    char *rargv[24] = {"tandem", "router", "--log-level", (char *)o->log_level, "--host", (char *)o->host,
                       "--cluster-secret-file", (char *)secret};
    int rn = 8;
    if (o->api_keys) {
        rargv[rn++] = "--api-keys-file";
        rargv[rn++] = (char *)o->api_keys;
    }
    if (o->advertise) { /* none: the child's default (--host) */
        rargv[rn++] = "--advertise";
        rargv[rn++] = (char *)o->advertise;
    }
    rargv[rn++] = "--http-port";
    rargv[rn++] = http_port_s;
    if (o->tokenizer) {
        rargv[rn++] = "--tokenizer";
        rargv[rn++] = (char *)o->tokenizer;
    }
    if (o->prefill_policy) { /* checked by the router, which says what it takes */
        rargv[rn++] = "--prefill-policy";
        rargv[rn++] = (char *)o->prefill_policy;
    }
    if (o->tpot_objective_ms > 0) {
        rargv[rn++] = "--tpot-objective-ms";
        rargv[rn++] = tpot_s;
    }
    if (o->ttft_objective_ms > 0) {
        rargv[rn++] = "--ttft-objective-ms";
        rargv[rn++] = ttft_s;
    }
    td_status_t st = spawn(l, self, rargv, true);
    if (st != TD_OK)
        return st;
    while ((!rt->gateway[0] || !rt->control[0] || !rt->metrics[0]) && read_line(l, 10000, line, sizeof line)) {
        if (!strncmp(line, "gateway: ", 9))
            snprintf(rt->gateway, sizeof rt->gateway, "%s", line + 9);
        else if (!strncmp(line, "control: ", 9))
            snprintf(rt->control, sizeof rt->control, "%s", line + 9);
        else if (!strncmp(line, "metrics: ", 9))
            snprintf(rt->metrics, sizeof rt->metrics, "%s", line + 9);
        else if (!strncmp(line, "openai: ", 8)) /* before metrics: */
            snprintf(rt->openai, sizeof rt->openai, "%s", line + 8);
    }
    if (!rt->metrics[0]) {
        fprintf(stderr, "tandem local: the router did not start\n");
        return TD_ERR_UNAVAILABLE;
    }
    return TD_OK;
}

/* Starts node i: the prefill nodes first, then the decode nodes, then the unified ones. */
static td_status_t start_node(local_state_t *l, const local_opts_t *o, const local_plan_t *plan, const char *self,
                              const char *control, const char *secret, int64_t i)
{
    bool dec = i >= o->n_prefill; /* decode or unified: a decode-sized pool */
    const char *role = i >= o->n_prefill + o->n_decode ? "unified" : dec ? "decode" : "prefill";
    int64_t k_role = i >= o->n_prefill + o->n_decode ? i - o->n_prefill - o->n_decode : dec ? i - o->n_prefill : i;
    char id[32];
    snprintf(id, sizeof id, "%s%lld", role, (long long)k_role);
    char *nargv[] = {"tandem", (char *)role, "--model", (char *)o->model, "--router", (char *)control,
                     "--node-id", id, "--threads", (char *)plan->threads, "--log-level", (char *)o->log_level,
                     "--host", (char *)o->host, "--device", (char *)o->device, "--cluster-secret-file", (char *)secret,
                     NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                     NULL, NULL, NULL, NULL, NULL};
    int k = 0;
    while (nargv[k]) /* the optional flags go after the fixed ones */
        k++;
    if (plan->kv_flag) {
        nargv[k++] = (char *)plan->kv_flag;
        nargv[k++] = (char *)(dec ? plan->kv_decode : plan->kv_prefill);
    }
    char seqs[24];
    if (dec && o->kv_seqs) {
        snprintf(seqs, sizeof seqs, "%lld", (long long)o->kv_seqs);
        nargv[k++] = "--kv-seqs";
        nargv[k++] = seqs;
    }
    char ctx[24];
    if (o->ctx_size) {
        snprintf(ctx, sizeof ctx, "%lld", (long long)o->ctx_size);
        nargv[k++] = "--ctx-size";
        nargv[k++] = ctx;
    }
    if (o->dtype) {
        nargv[k++] = "--dtype";
        nargv[k++] = (char *)o->dtype;
    }
    if (o->kv_dtype) {
        nargv[k++] = "--kv-dtype";
        nargv[k++] = (char *)o->kv_dtype;
    }
    if (o->advertise) {
        nargv[k++] = "--advertise";
        nargv[k++] = (char *)o->advertise;
    }
    char chunk[24];
    if (o->prefill_chunk > 0 && !strcmp(role, "unified")) {
        snprintf(chunk, sizeof chunk, "%lld", (long long)o->prefill_chunk);
        nargv[k++] = "--prefill-chunk";
        nargv[k++] = chunk;
    }
    char ks[24];
    if (dec && o->mode != TD_SPEC_OFF) {
        nargv[k++] = "--spec";
        nargv[k++] = (char *)td_spec_mode_name(o->mode);
    }
    if (dec && o->draft_model) {
        nargv[k++] = "--draft-model";
        nargv[k++] = (char *)o->draft_model;
    }
    if (dec && o->draft_tokens > 0) {
        snprintf(ks, sizeof ks, "%lld", (long long)o->draft_tokens);
        nargv[k++] = "--draft-tokens";
        nargv[k++] = ks;
    }
    TD_ASSERT((size_t)k < TD_ARRAY_LEN(nargv));
    return spawn(l, self, nargv, false);
}

/* Serves until a signal (0) or the router's death (1); a node may die (the router fails over). */
static int serve_until_stopped(local_state_t *l)
{
    char line[512];
    while (!local_stop) {
        read_line(l, 200, line, sizeof line); /* keep draining the router's stdout */
        bool died = false;
        for (int i = 0; i < l->n; i++) {
            pid_t pid = l->kids[i].pid;
            if (pid > 0 && td_child_exited(&l->kids[i], NULL)) {
                fprintf(stderr, "tandem local: process %d exited%s\n", (int)pid,
                        i == 0 ? "; stopping the cluster" : "");
                died = died || i == 0;
            }
        }
        if (died)
            return 1;
    }
    return 0;
}

int cmd_local(int argc, char **argv)
{
    uint64_t t_start = td_now_ns(); /* the startup line says how long the cluster took to be ready */
    local_opts_t o = {.log_level = "warn", .host = "127.0.0.1", .device = "cpu", .spec_mode = "off",
                      .n_prefill = -1, .n_decode = -1}; /* -1: 1 each, or 0 each with --unified */
    const td_opt_t opts[] = {
        TD_OPT_STRING("model", &o.model, "model path (required)"),
        TD_OPT_STRING("tokenizer", &o.tokenizer, "tokenizer path (default: beside the model)"),
        TD_OPT_INT("prefill", &o.n_prefill, 0, 32, "prefill nodes (default 1; 0 with --unified)"),
        TD_OPT_INT("decode", &o.n_decode, 0, 32, "decode nodes (default 1; 0 with --unified)"),
        TD_OPT_INT("unified", &o.n_unified, 0, 32,
                   "unified nodes: prefill and decode in one engine, the colocated baseline (default 0)"),
        TD_OPT_INT("prefill-chunk", &o.prefill_chunk, 0, 1 << 20,
                   "prompt tokens a unified node feeds a sequence in one step (default 0: the node's own, 256)"),
        TD_OPT_INT("threads", &o.threads, 0, 4096, "compute threads per node (default 0: this process's cores / (N + M))"),
        TD_OPT_INT("kv-blocks", &o.kv_blocks, 1, 1 << 24, "KV blocks per node (default: from the shared budget)"),
        TD_OPT_INT("kv-mem", &o.kv_mem, 1, 1 << 30, "KV budget per node in MiB (default: from the shared budget)"),
        TD_OPT_INT("ctx-size", &o.ctx_size, 2, 1 << 26, "the longest sequence (prompt + output) every node "
                   "serves, at most the model's length (default: the model's); the pools are sized from it"),
        TD_OPT_INT("kv-seqs", &o.kv_seqs, 1, 4096, "sequences of the model's length a decode or unified node's "
                   "pool holds, within its budget (default: the node's own, 4)"),
        TD_OPT_STRING("log-level", &o.log_level, "error|warn|info|debug, for every process (default warn)"),
        TD_OPT_STRING("host", &o.host, "address every process listens on (default 127.0.0.1)"),
        TD_OPT_STRING("advertise", &o.advertise, "address peers reach them at (default: --host)"),
        TD_OPT_STRING("device", &o.device, "cpu (default), cuda or cuda:N, for every node"),
        TD_OPT_STRING("dtype", &o.dtype, "f32|f16|bf16, for every node"),
        TD_OPT_STRING("kv-dtype", &o.kv_dtype, "f32|f16|bf16|q8_0: every node's KV cache (default: as --dtype)"),
        TD_OPT_INT("http-port", &o.http_port, -1, 65535, "the router's OpenAI HTTP API port (default 0: any; -1: off)"),
        TD_OPT_STRING("prefill-policy", &o.prefill_policy, "the router's: disaggregated (default) | conditional "
                      "(each prompt of a decode node prefilled on the decode node when that is sooner; "
                      "docs/scheduling.md \"Conditional disaggregation\") | follow (conditional, or on another "
                      "decode node when that is sooner: --decode 2 needs no prefill node)"),
        TD_OPT_INT("tpot-objective-ms", &o.tpot_objective_ms, 0, 600000,
                   "the router's TPOT objective for conditional placement (default 0: the router's, 100)"),
        TD_OPT_INT("ttft-objective-ms", &o.ttft_objective_ms, 0, 600000,
                   "the router's TTFT objective for conditional placement (default 0: none, local whenever sooner)"),
        TD_OPT_STRING("api-keys-file", &o.api_keys, "API keys the router's front doors require (docs/security.md)"),
        TD_OPT_STRING("spec", &o.spec_mode, "speculative decoding on the decode and unified nodes: off (default) | "
                      "prompt-lookup | draft-model"),
        TD_OPT_STRING("draft-model", &o.draft_model, "the draft model of those nodes (implies --spec draft-model; its "
                      "KV pool comes on top of the shared budget)"),
        TD_OPT_INT("draft-tokens", &o.draft_tokens, 0, TD_SPEC_MAX_DRAFT,
                   "with --spec: most draft tokens per sequence and step (default 0: the node's own, 8)"),
    };
    td_opts_t spec = {.prog = "local", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r = {0};
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return 2;
    if (r.help) {
        printf("usage: tandem local --model PATH [--tokenizer PATH] [--prefill N] [--decode M] [--unified U]\n"
               "                    [--threads T] [--kv-blocks B | --kv-mem MIB] [--kv-seqs S]\n"
               "                    [--ctx-size C] [--log-level L]\n"
               "                    [--host H] [--advertise A] [--device D] [--dtype T] [--kv-dtype T]\n"
               "                    [--api-keys-file FILE] [--prefill-chunk N]\n"
               "                    [--spec off|prompt-lookup|draft-model] [--draft-model PATH] [--draft-tokens K]\n\n"
               "Starts a router, N prefill and M decode nodes (separate processes) listening on\n"
               "--host (default 127.0.0.1) and reached at --advertise (default --host; required\n"
               "with a wildcard host), prints 'gateway: HOST:PORT', 'openai: URL' (the OpenAI HTTP\n"
               "API, docs/openai.md; --http-port -1: none) and 'metrics: URL' once all\n"
               "registered, and stops them all on SIGINT/SIGTERM. --unified U starts U unified nodes\n"
               "(prefill and decode in one engine, no KV transfer) instead of, or beside, the pairs:\n"
               "`--unified 2` alone is the colocated baseline of `--prefill 1 --decode 1`.\n"
               "--threads is per node (default:\n"
               "this process's cores / (N + M + U), at least 1). The KV pools share one budget, %d%% of\n"
               "the memory available, split %d:1 between a decode and a prefill node and passed as\n"
               "--kv-mem; --kv-mem MIB (per node) or --kv-blocks B (per node) replace it. Within it, a\n"
               "decode or unified node takes what --kv-seqs sequences of --ctx-size tokens (default\n"
               "the model's length) need (default 4), a prefill node 8 steps of prompt tokens.\n"
               "--device (cpu, cuda, cuda:N), --dtype (f32, f16, bf16) and --kv-dtype go to every node,\n"
               "--prefill-chunk to the unified ones, --spec, --draft-model and --draft-tokens to the\n"
               "decode and unified ones.\n"
               "A cluster secret of its own is made for each run (docs/security.md).\n\n",
               TD_KV_LOCAL_PERCENT, TD_KV_LOCAL_DECODE_SHARE);
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        return 0;
    }
    if (!o.model) {
        fprintf(stderr, "tandem local: --model PATH is required\n");
        return 2;
    }
    if (td_spec_parse_mode(o.spec_mode, &o.mode) != TD_OK ||
        td_spec_resolve_mode(&o.mode, o.draft_model != NULL) != TD_OK) {
        fprintf(stderr, "tandem local: %s\n", td_last_error());
        return 2;
    }
    /* under conditional or follow a decode node prefills its prompts itself (or a peer's) when
       no prefill node pairs with it: decode nodes alone serve (follow's default) */
    bool self_prefill = o.prefill_policy && (!strcmp(o.prefill_policy, "conditional") ||
                                             !strcmp(o.prefill_policy, "follow"));
    bool follow = o.prefill_policy && !strcmp(o.prefill_policy, "follow");
    if (o.n_prefill < 0)
        o.n_prefill = o.n_unified || follow ? 0 : 1;
    if (o.n_decode < 0)
        o.n_decode = o.n_unified ? 0 : 1;
    if ((o.n_prefill > 0 && o.n_decode == 0) || (o.n_prefill == 0 && o.n_decode > 0 && !self_prefill) ||
        o.n_prefill + o.n_decode + o.n_unified == 0) {
        fprintf(stderr, "tandem local: --prefill %lld --decode %lld --unified %lld: prefill and decode nodes come "
                "together (a pair; decode nodes alone under --prefill-policy conditional or follow), and some node "
                "must serve; e.g. --prefill 1 --decode 1, --decode 2 --prefill-policy follow, or --unified 2\n",
                (long long)o.n_prefill, (long long)o.n_decode, (long long)o.n_unified);
        return 2;
    }
    char tok_path[4096];
    if (!o.tokenizer) {
        td_model_t *m;
        if (td_model_load(o.model, &m) != TD_OK)
            return 1;
        snprintf(tok_path, sizeof tok_path, "%s", m->tokenizer_path);
        td_model_destroy(m);
        o.tokenizer = tok_path[0] ? tok_path : NULL; /* none: the cluster takes token ids only */
    }
    char self[4096];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sl <= 0)
        return 1;
    self[sl] = '\0';

    td_device_spec_t dev;
    if (td_device_parse(o.device, &dev) != TD_OK)
        return 2;
    local_plan_t plan;
    /* a unified node holds sequences as a decode node does: its pool is sized like one */
    local_plan(o.n_prefill, o.n_decode + o.n_unified, o.threads, o.kv_blocks, o.kv_mem, dev.cuda, &plan);
    /* OpenBLAS (pthreads) starts cores - 1 threads in every process at load, each spinning
       a while before it sleeps; the CPU backend never uses them (it runs OpenBLAS on one
       thread inside its own pool), so the children start none */
    setenv("OPENBLAS_NUM_THREADS", "1", 1);

    local_state_t l = {0};
    struct sigaction sa = {.sa_handler = on_sig};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    int rc = 1;
    char line[512];
    local_router_t rt = {0};
    /* the cluster's own secret: only these processes can join its control plane */
    const char *tmp = getenv("TMPDIR");
    char run_dir[4096], secret[4200];
    snprintf(run_dir, sizeof run_dir, "%s/tandem-local-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    if (!mkdtemp(run_dir)) {
        fprintf(stderr, "tandem local: cannot create a run directory %s: %s\n", run_dir, strerror(errno));
        return 1;
    }
    snprintf(secret, sizeof secret, "%s/cluster.secret", run_dir);
    if (td_auth_secret_generate(secret) != TD_OK || start_router(&l, &o, self, secret, &rt) != TD_OK)
        goto out;
    for (int64_t i = 0; i < o.n_prefill + o.n_decode + o.n_unified; i++)
        if (start_node(&l, &o, &plan, self, rt.control, secret, i) != TD_OK)
            goto out;
    bool ready = false;
    while (!ready && read_line(&l, 30000, line, sizeof line)) {
        int np, nd, nu = 0;
        if (sscanf(line, "nodes: %d prefill, %d decode, %d unified", &np, &nd, &nu) >= 2 && np >= o.n_prefill &&
            nd >= o.n_decode && nu >= o.n_unified)
            ready = true;
    }
    if (!ready) {
        fprintf(stderr, "tandem local: the nodes did not all register within 30 s\n");
        goto out;
    }
    fprintf(stderr, "tandem local: ready in %.2f s (router, %lld prefill, %lld decode, %lld unified node%s registered)\n",
            (double)(td_now_ns() - t_start) * 1e-9, (long long)o.n_prefill, (long long)o.n_decode,
            (long long)o.n_unified, o.n_prefill + o.n_decode + o.n_unified == 1 ? "" : "s");
    printf("gateway: %s\n", rt.gateway);
    if (rt.openai[0])
        printf("openai: %s\n", rt.openai);
    printf("metrics: %s\n", rt.metrics);
    fflush(stdout);
    rc = serve_until_stopped(&l);
out:
    td_child_stop_all(l.kids, l.n, SIGINT, 5000, NULL); /* at once: no drain */
    if (l.n > 0)
        td_child_close(&l.kids[0]);
    unlink(secret);
    rmdir(run_dir);
    return rc;
}
