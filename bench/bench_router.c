/*
 * bench_router: `tandem bench router [--json] [--duration S] [--concurrency N]
 * [--connections N] [--streams N] [--stream-tokens N] [--prompt-tokens N]
 * [--router-cpu N] [--bench-cpu N] [--tandem PATH] [--http] [--hold S]`.
 *
 * What one router costs when the nodes cost nothing (issue 5, "Speed"). A real router
 * process (`tandem router`, this binary re-executed, pinned to one core) serves a load
 * generator in this process; the prefill and decode nodes are no-op nodes in a forked
 * child (both pinned to another core), speaking the real control protocol over the real
 * gRPC stack: RegisterNode + Heartbeat through td_node_client, Admit (an instant lease with
 * fake block ids), Release, Prefill (FIRST_TOKEN then KV_DELIVERED at once, status OK) and
 * Steps (one StepBatch per loop turn carrying one token for every live lease, then the
 * finish entries, as fast as the router drains the stream). No model, no tokenizer: the
 * load generator sends prompt_ids.
 *
 * Three phases, each --duration seconds (after a short warm-up):
 *  (a) requests/s: --concurrency Generate calls with max_tokens 1 kept in flight over
 *      --connections gRPC connections;
 *  (b) added latency: one call at a time, alternating a Generate through the router with
 *      the same no-op work called directly (Admit on the decode node, Prefill on the prefill
 *      node, the lease's step read from a second Steps subscription); added = router
 *      percentile - direct percentile;
 *  (c) token relay: --streams Generate calls of --stream-tokens tokens each (replaced as
 *      they finish, cancelled at the end); relayed tokens/s counted at the client.
 * With --http the same three phases go through the router's OpenAI HTTP API (issue 15):
 * streamed POST /v1/chat/completions requests, one per keep-alive connection at a time
 * (HTTP/1.1 has no multiplexing: phase a opens --concurrency connections), the router given
 * a byte-level tokenizer with a one-line chat template (written by td_model_synth into a
 * temporary directory) so that every request is rendered and encoded and every token is one
 * letter of text; tokens are counted as letters of the SSE chunks' content at the client.
 * With --hold S there are no phases: the router's addresses are printed and the no-op cluster
 * serves for S seconds, so that `tandem bench serve` can measure its own ceiling against it.
 * Router CPU time (from /proc/PID/stat) per phase says whether the router or the load
 * generator was the limit. Rows: name, value, unit, goal, ratio (>= 1 meets the goal; for
 * latencies ratio = goal / value). Keys in docs/bench.md.
 */
#include "bench_router.h"

/* ---- small helpers ----------------------------------------------------------------------- */

static bool rb_samples_add(rb_samples_t *x, double v)
{
    if (x->n == x->cap) {
        size_t cap = x->cap ? 2 * x->cap : 4096;
        double *p = realloc(x->v, cap * sizeof *p);
        if (!p)
            return false;
        x->v = p;
        x->cap = cap;
    }
    x->v[x->n++] = v;
    return true;
}

/* Nearest-rank percentile of sorted samples; NAN when there are none. */
static double rb_pct(const rb_samples_t *x, double q)
{
    if (!x->n)
        return NAN;
    size_t i = (size_t)ceil(q * (double)x->n);
    return x->v[i ? i - 1 : 0];
}

/* CPU seconds the router process has used (user + system), or -1. */
static double rb_proc_cpu_s(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    unsigned long long ut = 0, st = 0;
    /* after ")": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime */
    if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static double rb_self_cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec * 1e-6;
}

/* This process (load generator) and the no-op nodes' process. */
static double rb_bench_cpu_s(const rb_state_t *s)
{
    double nodes = s->nodes.pid > 0 ? rb_proc_cpu_s(s->nodes.pid) : 0;
    return rb_self_cpu_s() + (nodes > 0 ? nodes : 0);
}

static void rb_note_error(rb_state_t *s, td_grpc_code_t code, const char *msg)
{
    s->errors++;
    if (!s->first_error[0])
        snprintf(s->first_error, sizeof s->first_error, "%s: %s", td_grpc_code_name(code), msg);
}

static bool rb_pin(pid_t pid, int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return sched_setaffinity(pid, sizeof set, &set) == 0;
}

/* ---- router process ------------------------------------------------------------------------ */

static void rb_alloc(uv_handle_t *h, size_t size, uv_buf_t *buf)
{
    rb_state_t *s = h->data; /* the router's stdout after its address lines: read and dropped */
    *buf = uv_buf_init(s->sink, sizeof s->sink);
}

static void rb_on_router_out(uv_stream_t *st, ssize_t n, const uv_buf_t *buf)
{
    rb_state_t *s = st->data;
    if (n >= 0)
        return;
    uv_read_stop(st);
    if (!s->stopping) { /* its stdout closed: the router died under the load */
        td_errorf(TD_ERR_IO, "bench router: the router process exited during the run (see its stderr)");
        s->failed = true;
    }
}

/* Starts `tandem router` (pinned to o->router_cpu when pin; it ends with this process) and
 * reads its gateway and control addresses from its stdout. */
static td_status_t rb_router_start(rb_state_t *s, bool pin)
{
    char *argv[40] = {"tandem", "router", "--host", "127.0.0.1", "--port", "0", "--control-port", "0",
                      "--metrics-port", "0", "--model-name", RB_MODEL, "--max-active", "1000000",
                      "--heartbeat-ms", "100", "--heartbeat-timeout-ms", "10000", "--lease-ms", "60000",
                      "--rpc-timeout-ms", "10000", "--log-level", (char *)s->o.router_log};
    if (s->o.http) { /* every request rendered and encoded: no bound on that in the way */
        char *more[] = {"--http-port", "0", "--tokenizer", s->tok_dir, "--max-tokenizing", "4096",
                        "--http-max-connections", "100000"};
        int n = 0;
        while (argv[n])
            n++;
        memcpy(argv + n, more, sizeof more);
    }
    td_child_config_t cc = td_child_config_default();
    cc.file = s->o.tandem;
    cc.argv = argv;
    cc.out = TD_CHILD_OUT_PIPE;
    cc.die_with_parent = true;
    cc.cpu = pin ? s->o.router_cpu : -1;
    td_status_t st = td_child_spawn(&cc, &s->router);
    if (st != TD_OK)
        return st;
    double deadline = td_now_s() + 10;
    while (!(s->gw_port && s->ctl_port)) {
        char line[256];
        int ms = (int)((deadline - td_now_s()) * 1e3);
        st = ms > 0 ? td_child_read_line(&s->router, ms, line, sizeof line) : TD_ERR_TIMEOUT;
        if (st == TD_ERR_CANCELLED)
            continue;
        if (st == TD_ERR_TIMEOUT)
            return td_errorf(TD_ERR_TIMEOUT, "bench router: the router printed no addresses within 10 s");
        if (st != TD_OK)
            return td_errorf(TD_ERR_IO, "bench router: the router exited before serving (see its stderr)");
        unsigned port;
        char host[64];
        if (sscanf(line, "gateway: %63[^:]:%u", host, &port) == 2) {
            snprintf(s->host, sizeof s->host, "%s", host);
            s->gw_port = (uint16_t)port;
        } else if (sscanf(line, "openai: http://%63[^:]:%u", host, &port) == 2) {
            s->http_port = (uint16_t)port;
        } else if (sscanf(line, "control: %63[^:]:%u", host, &port) == 2) {
            s->ctl_port = (uint16_t)port;
        }
    }
    if (s->o.http && !s->http_port)
        return td_errorf(TD_ERR_IO, "bench router: the router printed no openai: line");
    return TD_OK;
}

/* Watches a child's stdout pipe on the loop (after uv_loop_init, which must follow the
 * forks). */
static td_status_t rb_watch(rb_state_t *s, uv_pipe_t *p, int *fd, bool *open_flag, uv_read_cb cb)
{
    uv_pipe_init(&s->loop, p, 0);
    p->data = s;
    if (uv_pipe_open(p, *fd) != 0) {
        close(*fd);
        *fd = -1;
        uv_close((uv_handle_t *)p, NULL);
        return td_errorf(TD_ERR_IO, "bench router: cannot watch a child's output");
    }
    *fd = -1;
    *open_flag = true;
    uv_read_start((uv_stream_t *)p, rb_alloc, cb);
    return TD_OK;
}

/* ---- load generator ------------------------------------------------------------------------ */

static void rb_run_until(rb_state_t *s, bool (*done)(rb_state_t *), double deadline_s)
{
    while (!s->failed && !done(s) && td_now_s() < deadline_s)
        uv_run(&s->loop, UV_RUN_ONCE);
}

static bool rb_never(rb_state_t *s)
{
    return false;
}

static bool rb_term_seen(rb_state_t *s)
{
    return s->term_seen;
}

static void on_hold_signal(uv_signal_t *h, int sig)
{
    rb_state_t *s = h->data;
    s->term_seen = true;
}

static bool rb_drained(rb_state_t *s)
{
    return s->outstanding == 0 && !s->lat_busy;
}

/* Child: registered with the router and both Steps subscriptions (router's, ours) up. */
bool rb_nodes_up(rb_state_t *s)
{
    return td_node_client_registered(s->prefill_cli) && td_node_client_registered(s->decode_cli) &&
           td_node_fake_subscribed(s->decode_node, RB_SUB_ROUTER) &&
           td_node_fake_subscribed(s->decode_node, RB_SUB_DIRECT);
}

static bool rb_ready(rb_state_t *s)
{
    return s->nodes_ready;
}

static bool rb_have_ports(rb_state_t *s)
{
    return s->prefill_port && s->decode_port;
}

static void on_wake(uv_timer_t *t)
{
}

static void rb_issue(rb_state_t *s, rb_slot_t *slot, uint32_t max_tokens);

static void on_gen_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    rb_slot_t *slot = data;
    const Tandem__V1__GenerateResponse *r = (const void *)msg;
    slot->tokens += (uint32_t)r->n_token_ids;
    slot->s->tokens += r->n_token_ids;
}

static void rb_lat_next(rb_state_t *s);

static void on_gen_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    rb_slot_t *slot = data;
    rb_state_t *s = slot->s;
    slot->call = NULL;
    s->outstanding--;
    bool full = code == TD_GRPC_OK || (s->phase == PH_RELAY && code == TD_GRPC_CANCELLED && !s->issuing);
    if (code == TD_GRPC_OK)
        s->ok++;
    else if (!full)
        rb_note_error(s, code, msg);
    if (s->phase == PH_LAT) {
        if (code == TD_GRPC_OK)
            rb_samples_add(&s->lat_router, (double)(td_now_ns() - slot->t_start) * 1e-3);
        s->lat_busy = false;
        rb_lat_next(s);
        return;
    }
    if (s->issuing)
        rb_issue(s, slot, s->phase == PH_RELAY ? (uint32_t)s->o.stream_tokens : 1);
}

static void rb_http_issue(rb_state_t *s, rb_slot_t *slot, uint32_t max_tokens);

static void rb_issue(rb_state_t *s, rb_slot_t *slot, uint32_t max_tokens)
{
    if (s->o.http) {
        rb_http_issue(s, slot, max_tokens);
        return;
    }
    int i = (int)(slot - s->slots);
    td_grpc_channel_t *ch = s->gw[i % s->o.connections];
    Tandem__V1__GenerateRequest q = TANDEM__V1__GENERATE_REQUEST__INIT;
    q.prompt_ids = s->prompt;
    q.n_prompt_ids = (size_t)s->o.prompt_tokens;
    q.max_tokens = max_tokens;
    td_grpc_call_opts_t o = {.response_desc = &tandem__v1__generate_response__descriptor,
                             .on_message = on_gen_msg, .on_done = on_gen_done, .data = slot,
                             .timeout_ms = s->call_timeout_ms};
    slot->tokens = 0;
    slot->t_start = td_now_ns();
    if (td_grpc_channel_call(ch, "/tandem.v1.Generation/Generate", &q.base, &o, &slot->call) != TD_OK) {
        slot->call = NULL;
        rb_note_error(s, TD_GRPC_UNAVAILABLE, td_last_error());
        s->failed = true;
        return;
    }
    s->issued++;
    s->outstanding++;
}

/* ---- --http: the load through the OpenAI HTTP API --------------------------------------- */

/* A slot's keep-alive connection (bench_http_client), one streamed request on it at a time.
 * Its end (the answer complete, or the connection gone) ends the slot's call as on_gen_done
 * does. */
static void rb_http_end(rb_slot_t *slot, bool ok)
{
    rb_state_t *s = slot->s;
    slot->call = NULL;
    s->outstanding--;
    bool full = ok || (s->phase == PH_RELAY && !s->issuing); /* cancelled at the phase's end */
    if (ok)
        s->ok++;
    else if (!full)
        rb_note_error(s, TD_GRPC_UNAVAILABLE, "HTTP request failed");
    if (s->phase == PH_LAT) {
        if (ok)
            rb_samples_add(&s->lat_router, (double)(td_now_ns() - slot->t_start) * 1e-3);
        s->lat_busy = false;
        rb_lat_next(s);
        return;
    }
    if (s->issuing)
        rb_issue(s, slot, s->phase == PH_RELAY ? (uint32_t)s->o.stream_tokens : 1);
}

/* The letters of an SSE event's "content" (each token is one letter). */
static void rb_http_on_event(td_http_client_t *h, const char *ev, size_t len, uint64_t now)
{
    static const char key[] = "\"content\":\"";
    rb_slot_t *slot = td_http_client_data(h);
    const char *p = strstr(ev, key);
    if (!p)
        return;
    size_t n = strcspn(p + sizeof key - 1, "\"");
    slot->tokens += (uint32_t)n;
    slot->s->tokens += n;
}

static void rb_http_on_done(td_http_client_t *h, unsigned status, const char *body, size_t len, bool keep_alive)
{
    rb_slot_t *slot = td_http_client_data(h);
    if (!keep_alive)
        slot->http = NULL; /* it closes after this: the slot's next call opens another */
    rb_http_end(slot, status == 200);
}

static void rb_http_on_close(td_http_client_t *h)
{
    rb_slot_t *slot = td_http_client_data(h);
    if (slot->http == h)
        slot->http = NULL;
}

static const td_http_client_ops_t rb_http_ops = {.on_event = rb_http_on_event, .on_done = rb_http_on_done,
                                             .on_close = rb_http_on_close};

static void rb_http_issue(rb_state_t *s, rb_slot_t *slot, uint32_t max_tokens)
{
    int which = max_tokens == 1 ? 0 : 1;
    if (!slot->http) {
        struct sockaddr_in a;
        if (uv_ip4_addr(s->host, s->http_port, &a) != 0 ||
            td_http_client_open(&s->loop, (const struct sockaddr *)&a, &rb_http_ops, slot, &slot->http) != TD_OK) {
            slot->http = NULL;
            rb_note_error(s, TD_GRPC_UNAVAILABLE, "connect failed");
            s->failed = true;
            return;
        }
    }
    slot->tokens = 0;
    slot->t_start = td_now_ns();
    s->issued++;
    s->outstanding++;
    td_http_client_send(slot->http, s->http_req[which], s->http_req_len[which]);
}

/* The two requests' bytes (streamed chat of a prompt_tokens-letter message) and the
 * router's tokenizer: td_model_synth's byte-level tokenizer (a token per byte) in a
 * temporary directory, with a chat template that is the messages' text. */
static td_status_t rb_http_prepare(rb_state_t *s)
{
    char content[RB_MAX_PROMPT + 1]; /* prompt_tokens letters: the template adds nothing, BOS aside */
    memset(content, 'a', (size_t)s->o.prompt_tokens);
    content[s->o.prompt_tokens] = '\0';
    for (int i = 0; i < 2; i++) {
        char body[RB_MAX_PROMPT + 256];
        int n = snprintf(body, sizeof body, "{\"model\":\"%s\",\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],"
                         "\"max_tokens\":%d,\"temperature\":0,\"stream\":true}", RB_MODEL, content,
                         i ? s->o.stream_tokens : 1);
        size_t cap = (size_t)n + 256;
        if (!(s->http_req[i] = malloc(cap)))
            return td_errorf(TD_ERR_NOMEM, "bench router: out of memory");
        s->http_req_len[i] = (size_t)snprintf(s->http_req[i], cap,
                                              "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\n"
                                              "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
                                              s->host[0] ? s->host : "127.0.0.1", n, body);
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(s->tok_dir, sizeof s->tok_dir, "%s/tandem-bench-http-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    if (!mkdtemp(s->tok_dir)) {
        s->tok_dir[0] = '\0';
        return td_errorf(TD_ERR_IO, "bench router: cannot make a temporary directory: %s", strerror(errno));
    }
    td_synth_params_t sp = {.seed = 1, .dtype = TD_F32};
    td_status_t st = td_model_preset("tiny", &sp.config);
    if (st == TD_OK)
        st = td_model_synth(&sp, s->tok_dir, NULL);
    if (st != TD_OK)
        return st;
    char path[512];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", s->tok_dir);
    char *text = NULL;
    size_t len;
    if ((st = td_file_read_all(path, 1 << 20, &text, &len)) != TD_OK)
        return st;
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    char *out = NULL;
    if (!j || !cJSON_AddStringToObject(j, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}") ||
        !(out = cJSON_PrintUnformatted(j))) {
        cJSON_Delete(j);
        return td_errorf(TD_ERR_NOMEM, "bench router: cannot write %s", path);
    }
    cJSON_Delete(j);
    FILE *f = fopen(path, "w");
    bool ok = f && fputs(out, f) >= 0;
    if (f && fclose(f) != 0)
        ok = false;
    free(out);
    return ok ? TD_OK : td_errorf(TD_ERR_IO, "bench router: cannot write %s", path);
}

/* Removes the tokenizer directory rb_http_prepare made. */
static void rb_http_cleanup(rb_state_t *s)
{
    for (int i = 0; i < 2; i++)
        free(s->http_req[i]);
    if (!s->tok_dir[0])
        return;
    DIR *d = opendir(s->tok_dir);
    struct dirent *e;
    char path[600];
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "%s/%s", s->tok_dir, e->d_name);
        unlink(path);
    }
    if (d)
        closedir(d);
    rmdir(s->tok_dir);
}

/* Phase b: the direct path, Admit → Prefill → the lease's step on our own subscription. */
static void on_d_prefill_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    rb_state_t *s = data;
    if (code != TD_GRPC_OK) {
        rb_note_error(s, code, msg);
        s->lat_busy = false;
        rb_lat_next(s);
    }
    /* else the sample ends when the finish entry reaches on_d_steps_msg */
}

static void on_d_admit_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    rb_state_t *s = data;
    s->lat_lease = ((const Tandem__Control__V1__AdmitResponse *)msg)->lease_id;
}

static void on_d_admit_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    rb_state_t *s = data;
    if (code != TD_GRPC_OK || !s->lat_lease) {
        rb_note_error(s, code, msg);
        s->lat_busy = false;
        rb_lat_next(s);
        return;
    }
    Tandem__Control__V1__PrefillRequest q = TANDEM__CONTROL__V1__PREFILL_REQUEST__INIT;
    char id[48];
    snprintf(id, sizeof id, RB_DIRECT_PREFIX "%llu", (unsigned long long)s->lat_seq);
    q.request_id = id;
    q.tokens = s->prompt;
    q.n_tokens = (size_t)s->o.prompt_tokens;
    q.decode_node_id = "noop-decode";
    q.lease_id = s->lat_lease;
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__prefill_response__descriptor,
                             .on_done = on_d_prefill_done, .data = s, .timeout_ms = 30000};
    if (td_grpc_channel_call(s->d_prefill, "/tandem.control.v1.PrefillNode/Prefill", &q.base, &o, NULL) != TD_OK) {
        rb_note_error(s, TD_GRPC_UNAVAILABLE, td_last_error());
        s->failed = true;
    }
}

static void on_d_steps_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    rb_state_t *s = data;
    const Tandem__Control__V1__StepBatch *b = (const void *)msg;
    for (size_t i = 0; i < b->n_seqs; i++) {
        if (b->seqs[i]->lease_id != s->lat_lease || b->seqs[i]->event == TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN)
            continue;
        if (s->lat_busy) {
            rb_samples_add(&s->lat_direct, (double)(td_now_ns() - s->lat_t0) * 1e-3);
            s->ok++;
            s->lat_busy = false;
            s->lat_lease = 0;
            rb_lat_next(s);
        }
        return;
    }
}

static void on_d_steps_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    rb_state_t *s = data;
    s->d_steps = NULL;
}

/* Starts the next latency sample (router and direct alternate) unless the phase ended. */
static void rb_lat_next(rb_state_t *s)
{
    if (!s->issuing || s->failed)
        return;
    s->lat_busy = true;
    bool direct = s->lat_direct_next;
    s->lat_direct_next = !direct;
    if (!direct) {
        rb_issue(s, &s->slots[0], 1);
        return;
    }
    s->lat_seq++;
    s->lat_lease = 0;
    s->lat_t0 = td_now_ns();
    Tandem__Control__V1__AdmitRequest q = TANDEM__CONTROL__V1__ADMIT_REQUEST__INIT;
    char id[48];
    snprintf(id, sizeof id, RB_DIRECT_PREFIX "%llu", (unsigned long long)s->lat_seq);
    q.request_id = id;
    q.prompt_tokens = (uint32_t)s->o.prompt_tokens;
    q.max_tokens = 1;
    q.lease_ms = 60000;
    q.prompt_ids = s->prompt;
    q.n_prompt_ids = (size_t)s->o.prompt_tokens;
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__admit_response__descriptor,
                             .on_message = on_d_admit_msg, .on_done = on_d_admit_done, .data = s,
                             .timeout_ms = 30000};
    if (td_grpc_channel_call(s->d_decode, "/tandem.control.v1.DecodeNode/Admit", &q.base, &o, NULL) != TD_OK) {
        rb_note_error(s, TD_GRPC_UNAVAILABLE, td_last_error());
        s->failed = true;
        s->lat_busy = false;
    }
}

/* ---- phases ---------------------------------------------------------------------------------- */

typedef struct rb_phase_result {
    double rate;              /* completions or tokens per second in the window */
    double router_cpu;        /* router CPU seconds per window second (cores busy) */
    double bench_cpu;
    uint64_t count;           /* completions or tokens counted */
} rb_phase_result_t;

/* Keeps `n` slots busy for warm-up + duration, counting (*counter) over the window. */
static void rb_run_phase(rb_state_t *s, rb_phase_t ph, int n, uint32_t max_tokens, uint64_t *counter,
                         rb_phase_result_t *res)
{
    s->phase = ph;
    s->issuing = true;
    for (int i = 0; i < n && !s->failed; i++)
        rb_issue(s, &s->slots[i], max_tokens);
    rb_run_until(s, rb_never, td_now_s() + s->o.warmup_s);
    uint64_t c0 = *counter;
    double t0 = td_now_s(), r0 = rb_proc_cpu_s(s->router.pid), b0 = rb_bench_cpu_s(s);
    rb_run_until(s, rb_never, t0 + s->o.duration_s);
    uint64_t c1 = *counter;
    double t1 = td_now_s(), r1 = rb_proc_cpu_s(s->router.pid), b1 = rb_bench_cpu_s(s);
    s->issuing = false;
    for (int i = 0; i < n; i++) {
        if (s->slots[i].call && ph == PH_RELAY)
            td_grpc_client_call_cancel(s->slots[i].call);
        if (s->slots[i].http && td_http_client_busy(s->slots[i].http) && ph == PH_RELAY)
            td_http_client_close(s->slots[i].http); /* a disconnect: the router cancels the request */
    }
    rb_run_until(s, rb_drained, td_now_s() + 10);
    res->count = c1 - c0;
    res->rate = (double)(c1 - c0) / (t1 - t0);
    res->router_cpu = r0 >= 0 && r1 >= 0 ? (r1 - r0) / (t1 - t0) : NAN;
    res->bench_cpu = (b1 - b0) / (t1 - t0);
}

static void rb_run_latency(rb_state_t *s, rb_phase_result_t *res)
{
    s->phase = PH_LAT;
    s->issuing = true;
    s->lat_direct_next = false;
    rb_lat_next(s);
    rb_run_until(s, rb_never, td_now_s() + s->o.warmup_s);
    s->lat_router.n = s->lat_direct.n = 0;
    double t0 = td_now_s(), r0 = rb_proc_cpu_s(s->router.pid), b0 = rb_bench_cpu_s(s);
    rb_run_until(s, rb_never, t0 + s->o.duration_s);
    double t1 = td_now_s(), r1 = rb_proc_cpu_s(s->router.pid), b1 = rb_bench_cpu_s(s);
    s->issuing = false;
    rb_run_until(s, rb_drained, td_now_s() + 10);
    td_stats_sort(s->lat_router.v, s->lat_router.n);
    td_stats_sort(s->lat_direct.v, s->lat_direct.n);
    res->count = s->lat_router.n;
    res->rate = (double)s->lat_router.n / (t1 - t0);
    res->router_cpu = r0 >= 0 && r1 >= 0 ? (r1 - r0) / (t1 - t0) : NAN;
    res->bench_cpu = (b1 - b0) / (t1 - t0);
}

/* ---- output ---------------------------------------------------------------------------------- */

typedef struct rb_row {
    const char *name;
    double value;
    const char *unit;
    double goal;              /* NAN: none */
    bool lower_is_better;
} rb_row_t;

static double rb_ratio(const rb_row_t *r)
{
    if (isnan(r->goal) || isnan(r->value))
        return NAN;
    if (r->lower_is_better)
        return r->value > 0 ? r->goal / r->value : INFINITY;
    return r->value / r->goal;
}

/* key: v to 6 significant digits (as the text output), null when not a number */
static void rb_json_num(cJSON *obj, const char *key, double v)
{
    char text[32];
    snprintf(text, sizeof text, "%.6g", v);
    if (isfinite(v))
        cJSON_AddNumberToObject(obj, key, strtod(text, NULL));
    else
        cJSON_AddNullToObject(obj, key);
}

static int rb_print(const rb_state_t *s, const rb_row_t *rows, int n, bool pinned)
{
    if (s->o.json) {
        cJSON *j = cJSON_CreateObject(), *jrows = cJSON_CreateArray();
        cJSON_AddStringToObject(j, "bench", "router");
        cJSON_AddBoolToObject(j, "http", s->o.http);
        cJSON_AddBoolToObject(j, "pinned", pinned);
        cJSON_AddNumberToObject(j, "router_cpu", s->o.router_cpu);
        cJSON_AddNumberToObject(j, "bench_cpu", s->o.bench_cpu);
        cJSON_AddNumberToObject(j, "cpus", td_cpu_count());
        rb_json_num(j, "duration_s", s->o.duration_s);
        cJSON_AddNumberToObject(j, "concurrency", s->o.concurrency);
        cJSON_AddNumberToObject(j, "connections", s->o.connections);
        cJSON_AddNumberToObject(j, "streams", s->o.streams);
        cJSON_AddNumberToObject(j, "stream_tokens", s->o.stream_tokens);
        cJSON_AddNumberToObject(j, "prompt_tokens", s->o.prompt_tokens);
        cJSON_AddNumberToObject(j, "errors", (double)s->errors);
        for (int i = 0; i < n; i++) {
            cJSON *row = cJSON_CreateObject();
            cJSON_AddStringToObject(row, "name", rows[i].name);
            rb_json_num(row, "value", rows[i].value);
            cJSON_AddStringToObject(row, "unit", rows[i].unit);
            rb_json_num(row, "goal", rows[i].goal);
            rb_json_num(row, "ratio", rb_ratio(&rows[i]));
            if (!cJSON_AddItemToArray(jrows, row))
                cJSON_Delete(row);
        }
        if (!cJSON_AddItemToObject(j, "rows", jrows))
            cJSON_Delete(jrows);
        return bench_json_print(stdout, j);
    }
    printf("router bench%s: router %s, load generator and no-op nodes %s (%d CPUs)\n",
           s->o.http ? " (OpenAI HTTP API, streamed /v1/chat/completions)" : "",
           pinned ? "pinned to one core" : "not pinned", pinned ? "on another" : "anywhere", td_cpu_count());
    printf("%-34s %14s %-10s %12s %8s\n", "figure", "value", "unit", "goal", "ratio");
    for (int i = 0; i < n; i++) {
        const rb_row_t *r = &rows[i];
        char goal[32] = "-", ratio[32] = "-";
        if (!isnan(r->goal)) {
            snprintf(goal, sizeof goal, "%s%.6g", r->lower_is_better ? "<= " : ">= ", r->goal);
            snprintf(ratio, sizeof ratio, "%.2f", rb_ratio(r));
        }
        printf("%-34s %14.6g %-10s %12s %8s\n", r->name, r->value, r->unit, goal, ratio);
    }
    if (s->errors)
        printf("errors: %llu (first: %s)\n", (unsigned long long)s->errors, s->first_error);
    return 0;
}

/* ---- main ------------------------------------------------------------------------------------ */

static void rb_close_all(rb_state_t *s)
{
    if (s->d_steps)
        td_grpc_client_call_cancel(s->d_steps);
    for (int i = 0; s->gw && i < s->o.connections; i++)
        td_grpc_channel_close(s->gw[i], NULL, NULL);
    for (int i = 0; s->slots && i < s->n_slots; i++)
        if (s->slots[i].http)
            td_http_client_close(s->slots[i].http);
    td_grpc_channel_close(s->d_decode, NULL, NULL);
    td_grpc_channel_close(s->d_prefill, NULL, NULL);
    s->stopping = true;
    td_child_stop_all(&s->router, 1, SIGTERM, 5000, NULL);
    td_child_stop_all(&s->nodes, 1, SIGTERM, 5000, NULL);
    td_child_close(&s->router);
    td_child_close(&s->nodes);
    if (!s->loop_up)
        return;
    if (s->wake_up)
        uv_close((uv_handle_t *)&s->wake, NULL);
    for (int i = 0; s->term_up && i < 2; i++)
        uv_close((uv_handle_t *)&s->term[i], NULL);
    if (s->router_out_open)
        uv_close((uv_handle_t *)&s->router_out, NULL);
    if (s->nodes_out_open)
        uv_close((uv_handle_t *)&s->nodes_out, NULL);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&s->loop) != 0)
        td_warn("bench router: loop closed with handles open");
}

static td_status_t rb_parse_phases(const td_opt_t *opt, const char *value)
{
    if (!value[0] || strspn(value, "abc") != strlen(value))
        return td_errorf(TD_ERR_INVALID, "bench router: --phases takes letters of \"abc\", not '%s'", value);
    *(const char **)opt->ptr = value;
    return TD_OK;
}

int bench_router(int argc, char **argv)
{
    rb_state_t *s = calloc(1, sizeof *s);
    if (!s) {
        fprintf(stderr, "tandem bench router: out of memory\n");
        return 1;
    }
    s->o = (rb_opts_t){.duration_s = 5, .warmup_s = 0.5, .concurrency = 256, .connections = 8, .streams = 64,
                       .stream_tokens = 4096, .prompt_tokens = 16, .router_cpu = 0, .bench_cpu = 1,
                       .tandem = "/proc/self/exe", .router_log = "error", .phases = "abc"};
    int64_t concurrency = s->o.concurrency, connections = s->o.connections, streams = s->o.streams,
            stream_tokens = s->o.stream_tokens, prompt_tokens = s->o.prompt_tokens, router_cpu = s->o.router_cpu,
            bench_cpu = s->o.bench_cpu;
    float duration = (float)s->o.duration_s, hold = 0;
    const td_opt_t opts[] = {
        {.name = "json", .type = TD_OPT_BOOL, .ptr = &s->o.json, .help = "one JSON document on stdout (docs/bench.md)"},
        {.name = "duration", .type = TD_OPT_F32, .ptr = &duration, .fmin = 0.05f, .fmax = 3600, .arg = "S",
         .help = "seconds per phase (default 5)"},
        {.name = "concurrency", .type = TD_OPT_I64, .ptr = &concurrency, .min = 1, .max = 100000, .arg = "N",
         .help = "calls in flight in phase a (default 256)"},
        {.name = "connections", .type = TD_OPT_I64, .ptr = &connections, .min = 1, .max = 1024, .arg = "N",
         .help = "gateway connections (default 8)"},
        {.name = "streams", .type = TD_OPT_I64, .ptr = &streams, .min = 1, .max = 100000, .arg = "N",
         .help = "streams of phase c (default 64)"},
        {.name = "stream-tokens", .type = TD_OPT_I64, .ptr = &stream_tokens, .min = 1, .max = 1 << 30, .arg = "N",
         .help = "max_tokens of a phase c stream (default 4096)"},
        {.name = "prompt-tokens", .type = TD_OPT_I64, .ptr = &prompt_tokens, .min = 1, .max = RB_MAX_PROMPT,
         .arg = "N", .help = "prompt ids per request (default 16)"},
        {.name = "router-cpu", .type = TD_OPT_I64, .ptr = &router_cpu, .min = 0, .max = CPU_SETSIZE - 1,
         .arg = "N", .help = "the core the router is pinned to (default 0)"},
        {.name = "bench-cpu", .type = TD_OPT_I64, .ptr = &bench_cpu, .min = 0, .max = CPU_SETSIZE - 1, .arg = "N",
         .help = "the core of the load generator and the no-op nodes (default 1)"},
        {.name = "phases", .type = TD_OPT_FN, .ptr = &s->o.phases, .parse = rb_parse_phases, .arg = "abc",
         .help = "which phases run (default abc)"},
        {.name = "tandem", .type = TD_OPT_STR, .ptr = &s->o.tandem, .arg = "PATH",
         .help = "the binary the router runs from (default: this one)"},
        {.name = "router-log", .type = TD_OPT_STR, .ptr = &s->o.router_log, .arg = "LEVEL",
         .help = "the router's --log-level (default error)"},
        {.name = "http", .type = TD_OPT_BOOL, .ptr = &s->o.http,
         .help = "the load through the OpenAI HTTP API (streamed /v1/chat/completions; docs/openai.md)"},
        {.name = "hold", .type = TD_OPT_F32, .ptr = &hold, .fmin = 0, .fmax = 86400, .arg = "S",
         .help = "no phases: print the router's gateway: (and with --http openai:) line and serve the\n"
                 "no-op nodes for S seconds, a target for `tandem bench serve`"},
    };
    td_opts_t spec = {.prog = "bench router", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r_opts = {0};
    if (td_opts_parse(&spec, argc, argv, &r_opts) != TD_OK) {
        free(s);
        return 2;
    }
    if (r_opts.help) {
        printf("usage: tandem bench router [--json] [--duration S] [--concurrency N] [--connections N]\n"
               "                           [--streams N] [--stream-tokens N] [--prompt-tokens N]\n"
               "                           [--router-cpu N] [--bench-cpu N] [--phases abc] [--tandem PATH]\n"
               "                           [--router-log LEVEL] [--http] [--hold S]\n"
               "\n"
               "A real `tandem router` (pinned to --router-cpu, default 0) with no-op prefill and decode\n"
               "nodes and a gRPC load generator in this process (pinned to --bench-cpu, default 1).\n"
               "Phases of --duration seconds each (default 5): (a) routed requests/s at --concurrency\n"
               "(256) max_tokens=1 calls over --connections (8); (b) added latency p50/p99 at\n"
               "concurrency 1 vs the same no-op node calls made directly; (c) relayed tokens/s over\n"
               "--streams (64) streams of --stream-tokens (4096). Goals (issue 5): >= 20000\n"
               "requests/s, >= 1000000 tokens/s, added p99 < 200 us. Keys in docs/bench.md.\n"
               "--http: the same phases as streamed POST /v1/chat/completions on keep-alive HTTP/1.1\n"
               "connections (one per call in flight), the router with a byte-level tokenizer and chat\n"
               "template; goals (issue 15) >= 20000 requests/s, added p99 < 300 us, >= 1000000\n"
               "SSE tokens/s.\n\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        free(s);
        return 0;
    }
    s->o.duration_s = duration;
    s->o.hold_s = hold;
    s->o.warmup_s = TD_MIN(0.5, duration / 5);
    s->o.concurrency = (int)concurrency;
    s->o.connections = (int)connections;
    s->o.streams = (int)streams;
    s->o.stream_tokens = (int)stream_tokens;
    s->o.prompt_tokens = (int)prompt_tokens;
    s->o.router_cpu = (int)router_cpu;
    s->o.bench_cpu = (int)bench_cpu;
    int rc = 1;
    int n_slots = TD_MAX(TD_MAX(s->o.concurrency, s->o.streams), 1);
    s->slots = calloc((size_t)n_slots, sizeof *s->slots);
    s->prompt = malloc((size_t)s->o.prompt_tokens * sizeof *s->prompt);
    s->gw = calloc((size_t)s->o.connections, sizeof *s->gw);
    if (!s->slots || !s->prompt || !s->gw) {
        fprintf(stderr, "tandem bench router: out of memory\n");
        free(s->slots);
        free(s->prompt);
        free(s->gw);
        free(s);
        return 1;
    }
    s->n_slots = n_slots;
    s->call_timeout_ms = (uint32_t)TD_MIN((s->o.duration_s + s->o.warmup_s) * 1e3 + 30000, 3.6e6);
    for (int i = 0; i < n_slots; i++)
        s->slots[i].s = s;
    for (int i = 0; i < s->o.prompt_tokens; i++)
        s->prompt[i] = (uint32_t)(1 + i % 255);
    s->free_head = UINT32_MAX;
    s->router.out_fd = s->nodes.out_fd = s->nodes_fd = -1;
    signal(SIGPIPE, SIG_IGN);

    /* "one core" for the router is true only if nothing else runs there: the router on
     * router_cpu, this process (load generator) and the no-op nodes' child on bench_cpu */
    int cpus = td_cpu_count();
    bool pin = cpus >= 2 && s->o.router_cpu != s->o.bench_cpu && s->o.router_cpu < cpus && s->o.bench_cpu < cpus;
    if (pin && !rb_pin(0, s->o.bench_cpu))
        pin = false;
    if (!pin)
        fprintf(stderr, "bench router: %d CPU(s); router and load generator not pinned apart\n", cpus);

    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    if (s->o.http && rb_http_prepare(s) != TD_OK)
        goto out;
    /* both children are forked before this process starts its loop */
    if (rb_router_start(s, pin) != TD_OK || rb_nodes_fork(s) != TD_OK)
        goto out;
    uv_loop_init(&s->loop);
    s->loop_up = true;
    uv_timer_init(&s->loop, &s->wake);
    s->wake_up = true;
    uv_timer_start(&s->wake, on_wake, 5, 5); /* bounds each UV_RUN_ONCE while waiting */
    if (rb_watch(s, &s->router_out, &s->router.out_fd, &s->router_out_open, rb_on_router_out) != TD_OK ||
        rb_watch(s, &s->nodes_out, &s->nodes.out_fd, &s->nodes_out_open, rb_on_nodes_out) != TD_OK)
        goto out;
    rb_run_until(s, rb_have_ports, td_now_s() + 10);
    if (!rb_have_ports(s)) {
        if (!s->failed)
            td_errorf(TD_ERR_TIMEOUT, "bench router: the no-op nodes did not start within 10 s");
        goto out;
    }
    for (int i = 0; i < s->o.connections; i++)
        if (td_grpc_channel_create(&s->loop, s->host, s->gw_port, &cc, &s->gw[i]) != TD_OK)
            goto out;
    if (td_grpc_channel_create(&s->loop, "127.0.0.1", s->decode_port, &cc, &s->d_decode) != TD_OK ||
        td_grpc_channel_create(&s->loop, "127.0.0.1", s->prefill_port, &cc, &s->d_prefill) != TD_OK)
        goto out;
    Tandem__Control__V1__StepsRequest sr = TANDEM__CONTROL__V1__STEPS_REQUEST__INIT;
    sr.router_id = "bench-direct";
    td_grpc_call_opts_t so = {.response_desc = &tandem__control__v1__step_batch__descriptor,
                              .on_message = on_d_steps_msg, .on_done = on_d_steps_done, .data = s};
    if (td_grpc_channel_call(s->d_decode, "/tandem.control.v1.DecodeNode/Steps", &sr.base, &so, &s->d_steps) != TD_OK)
        goto out;
    rb_run_until(s, rb_ready, td_now_s() + 10);
    if (!rb_ready(s)) {
        td_errorf(TD_ERR_TIMEOUT, "bench router: the no-op nodes did not register with the router within 10 s");
        goto out;
    }
    /* the router counts a decode node once its Steps stream is up; give its registry a turn */
    rb_run_until(s, rb_never, td_now_s() + 0.2);
    if (s->o.hold_s > 0) { /* a no-op cluster for `tandem bench serve` (docs/bench.md) */
        printf("gateway: %s:%u\n", s->host, s->gw_port);
        if (s->o.http)
            printf("openai: http://%s:%u/v1\n", s->host, s->http_port);
        fflush(stdout);
        /* a signal ends the hold the way its end does: children stopped, files removed */
        static const int sigs[2] = {SIGTERM, SIGINT};
        for (int i = 0; i < 2; i++) {
            uv_signal_init(&s->loop, &s->term[i]);
            s->term[i].data = s;
            uv_signal_start(&s->term[i], on_hold_signal, sigs[i]);
        }
        s->term_up = true;
        double r0 = rb_proc_cpu_s(s->router.pid), t0 = td_now_s();
        rb_run_until(s, rb_term_seen, t0 + s->o.hold_s);
        fprintf(stderr, "bench router: held %.1f s, router cpu %.2f s\n", td_now_s() - t0,
                rb_proc_cpu_s(s->router.pid) - r0);
        rc = s->failed ? 1 : 0;
        goto out;
    }

    rb_phase_result_t a = {.rate = NAN, .router_cpu = NAN, .bench_cpu = NAN}, b = a, cr = a;
    bool run_a = strchr(s->o.phases, 'a'), run_b = strchr(s->o.phases, 'b'), run_c = strchr(s->o.phases, 'c');
    if (!s->o.json)
        fprintf(stderr, "bench router: router pid %d\n", (int)s->router.pid);
    if (run_a) {
        if (!s->o.json)
            fprintf(stderr, "bench router: (a) requests/s, %d in flight, %.1f s\n", s->o.concurrency, s->o.duration_s);
        rb_run_phase(s, PH_RPS, s->o.concurrency, 1, &s->ok, &a);
    }
    if (run_b) {
        if (!s->o.json)
            fprintf(stderr, "bench router: (b) latency, 1 in flight, %.1f s\n", s->o.duration_s);
        rb_run_latency(s, &b);
    }
    if (run_c) {
        if (!s->o.json)
            fprintf(stderr, "bench router: (c) token relay, %d streams, %.1f s\n", s->o.streams, s->o.duration_s);
        rb_run_phase(s, PH_RELAY, s->o.streams, (uint32_t)s->o.stream_tokens, &s->tokens, &cr);
    }
    if (s->failed) {
        td_errorf(TD_ERR_INTERNAL, "bench router: the run failed (%s)", s->first_error);
        goto out;
    }
    double r50 = rb_pct(&s->lat_router, 0.50), r99 = rb_pct(&s->lat_router, 0.99);
    double d50 = rb_pct(&s->lat_direct, 0.50), d99 = rb_pct(&s->lat_direct, 0.99);
    rb_row_t rows[] = {
        {"routed_requests_per_s", a.rate, "req/s", 20000, false},
        {"rps_router_cpu_busy", a.router_cpu, "cores", NAN, false},
        {"rps_router_cpu_us_per_request", a.rate > 0 ? a.router_cpu / a.rate * 1e6 : NAN, "us", NAN, true},
        {"rps_bench_cpu_busy", a.bench_cpu, "cores", NAN, false},
        {"latency_router_p50_us", r50, "us", NAN, true},
        {"latency_router_p99_us", r99, "us", NAN, true},
        {"latency_direct_p50_us", d50, "us", NAN, true},
        {"latency_direct_p99_us", d99, "us", NAN, true},
        {"added_latency_p50_us", r50 - d50, "us", NAN, true},
        {"added_latency_p99_us", r99 - d99, "us", s->o.http ? 300 : 200, true},
        {"latency_samples", run_b ? (double)b.count : NAN, "calls", NAN, false},
        {"relayed_tokens_per_s", cr.rate, "tokens/s", 1e6, false},
        {"relay_router_cpu_busy", cr.router_cpu, "cores", NAN, false},
        {"relay_router_cpu_ns_per_token", cr.rate > 0 ? cr.router_cpu / cr.rate * 1e9 : NAN, "ns", NAN, true},
        {"relay_bench_cpu_busy", cr.bench_cpu, "cores", NAN, false},
    };
    if (rb_print(s, rows, (int)TD_ARRAY_LEN(rows), pin) != 0)
        goto out;
    rc = (!run_a || a.count) && (!run_b || b.count) && (!run_c || cr.count) ? 0 : 1;
    if (rc)
        fprintf(stderr, "tandem bench router: a phase completed nothing (errors %llu, first: %s)\n",
                (unsigned long long)s->errors, s->first_error);
out: /* failures were logged where they were decided (td_errorf) */
    rb_close_all(s);
    rb_http_cleanup(s);
    free(s->lat_router.v);
    free(s->lat_direct.v);
    free(s->subs[0].live);
    free(s->subs[1].live);
    free(s->leases);
    free(s->step_buf);
    free(s->slots);
    free(s->prompt);
    free(s->gw);
    free(s);
    return rc;
}
