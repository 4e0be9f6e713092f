/*
 * loadgen_client: the load generator's client of a running cluster (contract in
 * loadgen_client.h), from `tandem bench serve` (issue 16) in the spirit of `vllm bench serve`.
 *
 * Each request is a streamed generation: through the OpenAI API a POST /v1/completions with
 * the prompt's token ids (or its text) and stream_options.include_usage (or, vLLM's
 * openai-chat backend, /v1/chat/completions with the text as a user message); through the gRPC
 * gateway a tandem.v1.Generation/Generate stream. Per request the client clock gives the
 * time to first token (TTFT), every gap between token-carrying chunks (ITL), the end-to-end
 * latency (E2EL) and TPOT = (E2EL - TTFT) / (output tokens - 1); the token counts are the
 * server's usage.
 *
 * One thread, one libuv loop, non-blocking: an arrival timer, keep-alive HTTP/1.1
 * connections (td_http_client, one request in flight on each) or gRPC channels, and a 50 ms
 * tick that fails requests past the request timeout and reports progress. The waiting queue holds at most the
 * run's requests.
 */
#include "loadgen_client.h"

#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <uv.h>

#include <cjson/cJSON.h>

#include "tandem.pb-c.h"
#include "td_grpc.h"
#include "td_http_client.h"
#include "td_list.h"
#include "td_log.h"
#include "td_stats.h"
#include "td_util.h"

#define LG_TICK_MS 50

typedef struct loadgen_client lg_state_t;
typedef struct lg_conn lg_conn_t;

typedef enum { LG_REQ_WAITING, LG_REQ_RUNNING, LG_REQ_DONE } lg_req_state_t;

/* One request of a run, from its arrival to its verdict. */
typedef struct lg_req {
    lg_state_t *s;
    const loadgen_item_t *item;
    double arrival_s;         /* planned, from the run's start */
    lg_req_state_t state;
    uint64_t t_send, t_first, t_last, t_end, deadline; /* ns (td_now_ns) */
    uint32_t chunks;          /* token-carrying chunks / messages */
    uint32_t usage_in, usage_out;
    bool have_usage, done_marker;
    double *itl;              /* [n_itl] ms between token-carrying chunks */
    uint32_t n_itl, cap_itl;
    char *error;              /* why it failed (malloc'd) */
    lg_conn_t *conn;          /* HTTP: the connection it runs on */
    td_grpc_client_call_t *call; /* gRPC */
    td_list_t link;           /* the waiting queue or the running list */
    loadgen_outcome_t out;
} lg_req_t;

/* A keep-alive connection to the OpenAI API and the request it carries. */
struct lg_conn {
    td_http_client_t *h;
    lg_state_t *s;
    lg_req_t *req;            /* in flight, or NULL (then linked in the idle list) */
    td_list_t link;           /* idle list */
    char *wbuf;               /* the request's bytes, alive until its verdict */
    size_t wlen, wcap;
};

struct loadgen_client {
    loadgen_config_t cfg;
    uv_loop_t loop;
    uv_timer_t arrive, tick;
    /* target */
    char host[256], path[512]; /* path: the request's, "/v1/completions" */
    uint16_t port;
    struct sockaddr_storage addr;
    td_grpc_channel_t **gw;
    int n_gw, next_gw;
    /* the run in progress */
    lg_req_t *reqs;
    size_t n_reqs, next_arrival, n_done, n_failed;
    const loadgen_run_opts_t *run_opts;
    int64_t running, limit, max_running;
    td_list_t waiting, active, idle_conns;
    int64_t n_conns;
    uint64_t t0;
    bool in_run, dispatching;
    char *model_json;         /* cfg.model as a JSON string (escaped), or NULL */
};

/* ---- small helpers ----------------------------------------------------------------------- */

static void lg_req_fail(lg_req_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void lg_req_end(lg_req_t *r, bool ok);

static double lg_cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec * 1e-6;
}

static void lg_req_token(lg_req_t *r, uint64_t now)
{
    if (!r->t_first) {
        r->t_first = now;
    } else {
        if (r->n_itl == r->cap_itl) {
            uint32_t cap = r->cap_itl ? 2 * r->cap_itl : 16;
            double *p = realloc(r->itl, cap * sizeof *p);
            if (!p)
                return; /* a gap not kept: statistics of the others still hold */
            r->itl = p;
            r->cap_itl = cap;
        }
        r->itl[r->n_itl++] = (double)(now - r->t_last) * 1e-6;
    }
    r->t_last = now;
    r->chunks++;
}

static void lg_req_fail(lg_req_t *r, const char *fmt, ...)
{
    if (!r->error) {
        char buf[512];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(buf, sizeof buf, fmt, ap);
        va_end(ap);
        r->error = strdup(buf);
    }
}

/* Appends printf output to a growable buffer; false when out of memory. */
static bool lg_buf_printf(char **buf, size_t *len, size_t *cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static bool lg_buf_printf(char **buf, size_t *len, size_t *cap, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(*buf ? *buf + *len : NULL, *buf ? *cap - *len : 0, fmt, ap);
        va_end(ap);
        if (n < 0)
            return false;
        if (*buf && *len + (size_t)n < *cap) {
            *len += (size_t)n;
            return true;
        }
        size_t c = TD_MAX(*cap * 2, *len + (size_t)n + 4096);
        char *p = realloc(*buf, c);
        if (!p)
            return false;
        *buf = p;
        *cap = c;
    }
}

/* ---- the OpenAI API over HTTP/1.1 (td_http_client) ------------------------------------- */

static void lg_dispatch(lg_state_t *s);

/* One SSE event of a streamed completion: a token chunk, the usage chunk, an error, [DONE]. */
static void lg_sse_event(lg_req_t *r, const char *d, uint64_t now)
{
    if (strncmp(d, "data: ", 6))
        return; /* a comment or another field */
    d += 6;
    if (!strncmp(d, "[DONE]", 6)) {
        r->done_marker = true;
        return;
    }
    if (!strncmp(d, "{\"error\"", 8)) {
        lg_req_fail(r, "error event: %.300s", d);
        return;
    }
    const char *u = strstr(d, "\"usage\":{");
    if (u) {
        const char *p = strstr(u, "\"prompt_tokens\":"), *q = strstr(u, "\"completion_tokens\":");
        if (p && q) {
            r->usage_in = (uint32_t)strtoul(p + 16, NULL, 10);
            r->usage_out = (uint32_t)strtoul(q + 20, NULL, 10);
            r->have_usage = true;
        }
    }
    if (strstr(d, "\"choices\":[]"))
        return; /* the usage chunk */
    if (strstr(d, "\"text\":\"\"") || strstr(d, "\"delta\":{}"))
        return; /* the finish chunk without text */
    lg_req_token(r, now);
}

static void lg_http_on_event(td_http_client_t *h, const char *ev, size_t len, uint64_t now)
{
    lg_conn_t *c = td_http_client_data(h);
    if (c->req)
        lg_sse_event(c->req, ev, now);
}

static void lg_http_on_done(td_http_client_t *h, unsigned status, const char *body, size_t len, bool keep_alive)
{
    lg_conn_t *c = td_http_client_data(h);
    lg_req_t *r = c->req;
    c->req = NULL;
    if (!r)
        return;
    r->conn = NULL;
    if (status == 0)
        lg_req_fail(r, "%s", body);
    else if (status != 200)
        lg_req_fail(r, "HTTP %u: %.300s", status, body);
    else if (!r->done_marker)
        lg_req_fail(r, "the stream ended without data: [DONE]");
    if (keep_alive)
        td_list_push_back(&c->s->idle_conns, &c->link);
    lg_req_end(r, status == 200 && r->done_marker && !r->error);
}

static void lg_http_on_close(td_http_client_t *h)
{
    lg_conn_t *c = td_http_client_data(h);
    td_list_remove(&c->link);
    c->s->n_conns--;
    free(c->wbuf);
    free(c);
}

static const td_http_client_ops_t lg_http_ops = {.on_event = lg_http_on_event, .on_done = lg_http_on_done,
                                             .on_close = lg_http_on_close};

/* The request's bytes into c->wbuf: POST /v1/completions, streamed, with usage. */
static bool lg_http_build(lg_conn_t *c, const lg_req_t *r)
{
    lg_state_t *s = c->s;
    char *body = NULL;
    size_t len = 0, cap = 0;
    const loadgen_item_t *it = r->item;
    bool ok = lg_buf_printf(&body, &len, &cap, "{");
    if (ok && s->model_json)
        ok = lg_buf_printf(&body, &len, &cap, "\"model\":%s,", s->model_json);
    if (ok && it->text) {
        char *js = NULL;
        cJSON *str = cJSON_CreateString(it->text);
        if (str)
            js = cJSON_PrintUnformatted(str);
        cJSON_Delete(str);
        ok = js && lg_buf_printf(&body, &len, &cap,
                                 s->cfg.chat ? "\"messages\":[{\"role\":\"user\",\"content\":%s}]" : "\"prompt\":%s",
                                 js);
        cJSON_free(js);
    } else if (ok && s->cfg.chat) {
        ok = false; /* bench serve gives chat text prompts; a caller that did not is told here */
    } else if (ok) {
        ok = lg_buf_printf(&body, &len, &cap, "\"prompt\":[");
        for (uint32_t i = 0; ok && i < it->input_len; i++)
            ok = lg_buf_printf(&body, &len, &cap, i ? ",%u" : "%u", loadgen_prompt_id(it, i, s->cfg.vocab));
        ok = ok && lg_buf_printf(&body, &len, &cap, "]");
    }
    ok = ok && lg_buf_printf(&body, &len, &cap,
                             ",\"max_tokens\":%u,\"temperature\":0,\"stream\":true,%s"
                             "\"stream_options\":{\"include_usage\":true}}", it->output_len,
                             s->cfg.ignore_eos ? "\"ignore_eos\":true," : "");
    c->wlen = 0;
    ok = ok && lg_buf_printf(&c->wbuf, &c->wlen, &c->wcap,
                             "POST %s HTTP/1.1\r\nHost: %s:%u\r\nContent-Type: application/json\r\n"
                             "Accept: text/event-stream\r\nContent-Length: %zu\r\n%s%s%s\r\n%s",
                             s->path, s->host, s->port, len, s->cfg.api_key ? "Authorization: Bearer " : "",
                             s->cfg.api_key ? s->cfg.api_key : "", s->cfg.api_key ? "\r\n" : "", body);
    free(body);
    return ok;
}

static void lg_http_start(lg_state_t *s, lg_req_t *r)
{
    lg_conn_t *c = NULL;
    r->t_send = td_now_ns(); /* a new connection's connect time counts in TTFT, as a client sees it */
    if (!td_list_empty(&s->idle_conns)) {
        c = TD_CONTAINER_OF(s->idle_conns.next, lg_conn_t, link);
        td_list_remove(&c->link);
    } else {
        if (!(c = calloc(1, sizeof *c))) {
            lg_req_fail(r, "out of memory for a connection");
            lg_req_end(r, false);
            return;
        }
        c->s = s;
        td_list_init(&c->link);
        if (td_http_client_open(&s->loop, (const struct sockaddr *)&s->addr, &lg_http_ops, c, &c->h) != TD_OK) {
            free(c);
            lg_req_fail(r, "%s:%u: %s", s->host, s->port, td_last_error());
            lg_req_end(r, false);
            return;
        }
        s->n_conns++;
    }
    if (!lg_http_build(c, r)) {
        td_list_push_back(&s->idle_conns, &c->link);
        lg_req_fail(r, s->cfg.chat && !r->item->text ? "a chat request needs a text prompt"
                                                      : "out of memory building the request");
        lg_req_end(r, false);
        return;
    }
    c->req = r;
    r->conn = c;
    td_http_client_send(c->h, c->wbuf, c->wlen);
}

/* ---- the gRPC gateway ----------------------------------------------------------------------- */

static void lg_grpc_on_msg(td_grpc_client_call_t *call, const ProtobufCMessage *msg, void *data)
{
    lg_req_t *r = data;
    const Tandem__V1__GenerateResponse *m = (const void *)msg;
    if (m->n_token_ids)
        lg_req_token(r, td_now_ns());
    if (m->usage) {
        r->usage_in = m->usage->prompt_tokens;
        r->usage_out = m->usage->completion_tokens;
        r->have_usage = true;
    }
}

static void lg_grpc_on_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *msg, void *data)
{
    lg_req_t *r = data;
    r->call = NULL;
    if (code != TD_GRPC_OK)
        lg_req_fail(r, "%s: %.300s", td_grpc_code_name(code), msg);
    lg_req_end(r, code == TD_GRPC_OK);
}

static void lg_grpc_start(lg_state_t *s, lg_req_t *r)
{
    const loadgen_item_t *it = r->item;
    Tandem__V1__GenerateRequest q = TANDEM__V1__GENERATE_REQUEST__INIT;
    uint32_t *ids = NULL;
    if (it->text) {
        q.prompt = it->text;
    } else {
        if (!(ids = malloc((it->input_len ? it->input_len : 1) * sizeof *ids))) {
            r->t_send = td_now_ns();
            lg_req_fail(r, "out of memory for the prompt");
            lg_req_end(r, false);
            return;
        }
        for (uint32_t i = 0; i < it->input_len; i++)
            ids[i] = loadgen_prompt_id(it, i, s->cfg.vocab);
        q.prompt_ids = ids;
        q.n_prompt_ids = it->input_len;
    }
    q.max_tokens = it->output_len;
    q.ignore_eos = s->cfg.ignore_eos;
    if (s->cfg.model)
        q.model = (char *)s->cfg.model;
    char auth[300];
    td_grpc_header_t hdr = {.name = "authorization", .value = auth};
    if (s->cfg.api_key)
        snprintf(auth, sizeof auth, "Bearer %s", s->cfg.api_key);
    td_grpc_call_opts_t o = {.response_desc = &tandem__v1__generate_response__descriptor,
                             .on_message = lg_grpc_on_msg, .on_done = lg_grpc_on_done, .data = r,
                             .timeout_ms = (uint32_t)(s->cfg.request_timeout_s * 1e3),
                             .headers = s->cfg.api_key ? &hdr : NULL, .n_headers = s->cfg.api_key ? 1 : 0};
    td_grpc_channel_t *ch = s->gw[s->next_gw++ % s->n_gw];
    r->t_send = td_now_ns();
    td_status_t st = td_grpc_channel_call(ch, "/tandem.v1.Generation/Generate", &q.base, &o, &r->call);
    free(ids);
    if (st != TD_OK) {
        r->call = NULL;
        lg_req_fail(r, "Generate: %s", td_last_error());
        lg_req_end(r, false);
    }
}

/* ---- arrivals, dispatch, verdicts ------------------------------------------------------------ */

static void lg_req_start(lg_state_t *s, lg_req_t *r)
{
    r->state = LG_REQ_RUNNING;
    s->running++;
    s->max_running = TD_MAX(s->max_running, s->running);
    td_list_push_back(&s->active, &r->link);
    r->deadline = td_now_ns() + (uint64_t)(s->cfg.request_timeout_s * 1e9);
    if (s->cfg.openai)
        lg_http_start(s, r);
    else
        lg_grpc_start(s, r);
}

/* The verdict of a request (exactly once): its outcome, then the next waiting one. */
static void lg_req_end(lg_req_t *r, bool ok)
{
    lg_state_t *s = r->s;
    if (r->state != LG_REQ_RUNNING)
        return;
    r->state = LG_REQ_DONE;
    r->t_end = td_now_ns();
    td_list_remove(&r->link);
    s->running--;
    s->n_done++;
    s->n_failed += !ok;
    uint32_t out = r->have_usage ? r->usage_out : r->chunks;
    r->out = (loadgen_outcome_t){.ok = ok, .input_tokens = r->have_usage ? r->usage_in : r->item->input_len,
                            .output_tokens = out};
    if (ok) { /* no token chunk at all (an EOS first, text-less tokens): the first token is the end */
        r->out.ttft_ms = (double)((r->t_first ? r->t_first : r->t_end) - r->t_send) * 1e-6;
        r->out.e2el_ms = (double)(r->t_end - r->t_send) * 1e-6;
        r->out.tpot_ms = out > 1 ? (r->out.e2el_ms - r->out.ttft_ms) / (double)(out - 1) : 0;
    }
    if (s->in_run && !s->dispatching)
        lg_dispatch(s);
}

static void lg_on_arrive(uv_timer_t *t);

/* Moves the requests that have arrived to the waiting queue, starts what the concurrency
 * limit allows, and sets the timer for the next arrival. */
static void lg_dispatch(lg_state_t *s)
{
    s->dispatching = true; /* a verdict given while starting (a failed connect) does not recurse */
    double now_s = (double)(td_now_ns() - s->t0) * 1e-9;
    while (s->next_arrival < s->n_reqs && s->reqs[s->next_arrival].arrival_s <= now_s) {
        td_list_push_back(&s->waiting, &s->reqs[s->next_arrival].link);
        s->next_arrival++;
    }
    while (!td_list_empty(&s->waiting) && s->running < s->limit) {
        lg_req_t *r = TD_CONTAINER_OF(s->waiting.next, lg_req_t, link);
        td_list_remove(&r->link);
        lg_req_start(s, r);
    }
    if (s->next_arrival < s->n_reqs) {
        double wait_ms = (s->reqs[s->next_arrival].arrival_s - now_s) * 1e3;
        uv_timer_start(&s->arrive, lg_on_arrive, wait_ms > 0 ? (uint64_t)ceil(wait_ms) : 0, 0);
    }
    s->dispatching = false;
}

/* A duration as people read it: "42s", "3m07s", "1h05m". */
static void lg_duration(double sec, char *buf, size_t size)
{
    long t = (long)(sec + 0.5);
    if (t >= 3600)
        snprintf(buf, size, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else if (t >= 60)
        snprintf(buf, size, "%ldm%02lds", t / 60, t % 60);
    else
        snprintf(buf, size, "%lds", t);
}

void loadgen_progress_show(td_progress_t *prog, const loadgen_progress_t *p, bool last)
{
    double rate = p->elapsed_s > 0 ? (double)p->n_done / p->elapsed_s : 0;
    char eta[32] = "?";
    if (last)
        snprintf(eta, sizeof eta, "0s");
    else if (rate > 0)
        lg_duration((double)(p->n > p->n_done ? p->n - p->n_done : 0) / rate, eta, sizeof eta);
    td_progress_update(prog, last, "%zu/%zu requests (%.0f%%), %.2f req/s, %zu errors, ETA %s", p->n_done, p->n,
                       p->n ? 100.0 * (double)p->n_done / (double)p->n : 100.0, rate, p->n_failed, eta);
}

/* The run's progress to its callback, if it has one. */
static void lg_progress(const lg_state_t *s)
{
    const loadgen_run_opts_t *o = s->run_opts;
    if (!s->in_run || !o || !o->progress_cb)
        return;
    loadgen_progress_t p = {.n = s->n_reqs, .n_done = s->n_done, .n_failed = s->n_failed,
                            .elapsed_s = (double)(td_now_ns() - s->t0) * 1e-9};
    o->progress_cb(o->progress_arg, &p);
}

static void lg_on_arrive(uv_timer_t *t)
{
    lg_dispatch(t->data);
}

/* Fails the requests past their deadline (every wait has one). The expired ones are moved
 * to a list of their own first: ending one starts others, which join the running list. */
static void lg_on_tick(uv_timer_t *t)
{
    lg_state_t *s = t->data;
    uint64_t now = td_now_ns();
    td_list_t expired;
    td_list_init(&expired);
    for (td_list_t *n = s->active.next, *next; n != &s->active; n = next) {
        next = n->next;
        if (TD_CONTAINER_OF(n, lg_req_t, link)->deadline <= now) {
            td_list_remove(n);
            td_list_push_back(&expired, n);
        }
    }
    while (!td_list_empty(&expired)) {
        lg_req_t *r = TD_CONTAINER_OF(expired.next, lg_req_t, link);
        lg_req_fail(r, "no answer within --request-timeout-s %g", s->cfg.request_timeout_s);
        if (r->call)
            td_grpc_client_call_cancel(r->call); /* its on_done ends it */
        else if (r->conn)
            td_http_client_close(r->conn->h); /* likewise */
        lg_req_end(r, false);
        td_list_remove(&r->link);
    }
    lg_progress(s);
}

/* The figures of a finished run from its requests (ok ones; TPOT of those with two tokens or
 * more, as vLLM's), and each request's reply. */
static void lg_stat(double *v, size_t n, const loadgen_run_opts_t *o, loadgen_stat_t *st)
{
    loadgen_stat_of(v, n, st); /* sorts v */
    for (size_t i = 0; i < o->n_percentiles && i < LOADGEN_MAX_PERCENTILES; i++)
        st->pct[i] = td_stats_percentile(v, n, o->percentiles[i]);
}

static td_status_t lg_run_figures(const lg_state_t *s, lg_req_t *reqs, size_t n, const loadgen_run_opts_t *ro,
                                  loadgen_run_t *run)
{
    loadgen_outcome_t *o = malloc(n * sizeof *o + 1);
    double *v = malloc(n * sizeof *v + 1);
    size_t n_itl = 0;
    for (size_t i = 0; i < n; i++)
        n_itl += reqs[i].out.ok ? reqs[i].n_itl : 0;
    double *itl = malloc(n_itl * sizeof *itl + 1);
    if (!o || !v || !itl || !run->r) {
        free(o), free(v), free(itl);
        return td_errorf(TD_ERR_NOMEM, "loadgen: out of memory for the figures of %zu requests", n);
    }
    uint64_t t_last = s->t0;
    for (size_t i = 0; i < n; i++) {
        const lg_req_t *q = &reqs[i];
        t_last = TD_MAX(t_last, q->t_end);
        o[i] = q->out;
        run->r[i] = (loadgen_reply_t){
            .ok = q->out.ok, .error = q->error, .input_tokens = q->out.input_tokens,
            .output_tokens = q->out.output_tokens, .requested_tokens = q->item ? q->item->output_len : 0,
            .arrival_s = q->arrival_s, .start_ms = q->t_send ? (double)(q->t_send - s->t0) * 1e-6 : NAN,
            .end_ms = q->t_send && q->t_end ? (double)(q->t_end - q->t_send) * 1e-6 : NAN,
            .ttft_ms = q->out.ttft_ms, .tpot_ms = q->out.tpot_ms, .e2el_ms = q->out.e2el_ms, .itl_ms = q->itl,
            .n_itl = q->n_itl};
    }
    loadgen_summarize(o, n, (double)(t_last - s->t0) * 1e-9, &ro->slo, &run->sum);
    size_t k = 0, kt = 0;
    for (size_t i = 0; i < n; i++)
        if (o[i].ok)
            v[k++] = o[i].ttft_ms;
    lg_stat(v, k, ro, &run->ttft);
    k = 0;
    for (size_t i = 0; i < n; i++)
        if (o[i].ok)
            v[k++] = o[i].e2el_ms;
    lg_stat(v, k, ro, &run->e2el);
    for (size_t i = 0; i < n; i++)
        if (o[i].ok && o[i].output_tokens > 1) /* one token has no TPOT (vLLM leaves it out too) */
            v[kt++] = o[i].tpot_ms;
    lg_stat(v, kt, ro, &run->tpot);
    k = 0;
    for (size_t i = 0; i < n; i++)
        if (reqs[i].out.ok)
            for (uint32_t j = 0; j < reqs[i].n_itl; j++)
                itl[k++] = reqs[i].itl[j];
    lg_stat(itl, k, ro, &run->itl);
    free(o), free(v), free(itl);
    return TD_OK;
}

td_status_t loadgen_client_run(loadgen_client_t *s, const loadgen_dataset_t *d, size_t first, size_t n,
                               const loadgen_run_opts_t *o, loadgen_rng_t *rng, loadgen_run_t *run_p)
{
    lg_req_t *reqs = calloc(n ? n : 1, sizeof *reqs);
    double *at = malloc((n ? n : 1) * sizeof *at);
    if (!reqs || !at) {
        free(reqs), free(at);
        return td_errorf(TD_ERR_NOMEM, "loadgen: out of memory for %zu requests", n);
    }
    if (o->timed)
        for (size_t i = 0; i < n; i++)
            at[i] = d->items[(first + i) % d->n].arrival_s;
    else
        loadgen_arrivals(rng, o->rate, o->burstiness, n, at);
    for (size_t i = 0; i < n; i++) {
        reqs[i] = (lg_req_t){.s = s, .item = &d->items[(first + i) % d->n], .arrival_s = at[i]};
        td_list_init(&reqs[i].link);
    }
    free(at);
    s->reqs = reqs;
    s->n_reqs = n;
    s->next_arrival = s->n_done = s->n_failed = 0;
    s->run_opts = o;
    s->running = s->max_running = 0;
    s->limit = TD_MAX(o->max_concurrency, 1);
    s->in_run = true;
    double cpu0 = lg_cpu_s();
    s->t0 = td_now_ns();
    lg_dispatch(s);
    while (s->n_done < n) /* the 50 ms tick bounds each wait */
        uv_run(&s->loop, UV_RUN_ONCE);
    lg_progress(s); /* the last: n_done == n */
    s->in_run = false;
    s->run_opts = NULL;
    uv_timer_stop(&s->arrive);
    s->reqs = NULL;
    s->n_reqs = 0;
    loadgen_run_t run = {.rate = o->rate, .max_concurrency_seen = s->max_running, .cpu_s = lg_cpu_s() - cpu0,
                         .r = calloc(n ? n : 1, sizeof *run.r), .n = n, .reqs = reqs};
    td_status_t st = lg_run_figures(s, reqs, n, o, &run);
    if (st != TD_OK) {
        loadgen_run_free(&run);
        return st;
    }
    *run_p = run;
    return TD_OK;
}

void loadgen_run_free(loadgen_run_t *run)
{
    if (!run)
        return;
    lg_req_t *reqs = run->reqs;
    for (size_t i = 0; reqs && i < run->n; i++) {
        free(reqs[i].itl);
        free(reqs[i].error);
    }
    free(reqs);
    free(run->r);
    *run = (loadgen_run_t){0};
}

/* --openai's "http://HOST:PORT[/PATH]" into host, port, path ("/v1" when none, no trailing '/')
 * and the resolved address. */
static td_status_t lg_target_openai(lg_state_t *s)
{
    td_http_url_t u;
    td_status_t st = td_http_url_parse(s->cfg.openai, "--openai", &u);
    if (st != TD_OK)
        return st;
    snprintf(s->host, sizeof s->host, "%s", u.host);
    s->port = u.port;
    size_t pl = strlen(u.path);
    while (pl && u.path[pl - 1] == '/')
        pl--;
    if (s->cfg.endpoint)
        snprintf(s->path, sizeof s->path, "%.*s%s", (int)pl, u.path, s->cfg.endpoint);
    else
        snprintf(s->path, sizeof s->path, "%.*s%s", (int)pl, pl ? u.path : "/v1",
                 s->cfg.chat ? "/chat/completions" : "/completions");
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    char ps[8];
    snprintf(ps, sizeof ps, "%u", u.port);
    int rc = getaddrinfo(s->host, ps, &hints, &ai);
    if (rc || !ai)
        return td_errorf(TD_ERR_INVALID, "--openai: cannot resolve '%s': %s", s->host, gai_strerror(rc));
    memcpy(&s->addr, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    return TD_OK;
}

static void lg_close_all(lg_state_t *s)
{
    while (!td_list_empty(&s->idle_conns)) {
        lg_conn_t *c = TD_CONTAINER_OF(s->idle_conns.next, lg_conn_t, link);
        td_list_remove(&c->link);
        td_http_client_close(c->h);
    }
    for (int i = 0; i < s->n_gw; i++)
        td_grpc_channel_close(s->gw[i], NULL, NULL);
    uv_close((uv_handle_t *)&s->arrive, NULL);
    uv_close((uv_handle_t *)&s->tick, NULL);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&s->loop) != 0)
        td_warn("loadgen: loop closed with handles open");
    free(s->gw);
    s->gw = NULL;
    s->n_gw = 0;
}

/* --openai or --gateway (exactly one) into the target's host, port, path and address; `prog`
 * names the command in the message. */
static td_status_t lg_target_parse(lg_state_t *s, const char *prog)
{
    const loadgen_config_t *o = &s->cfg;
    if (!o->openai == !o->gateway)
        return td_errorf(TD_ERR_INVALID, "%s: give one of --openai URL or --gateway HOST:PORT", prog);
    if (o->openai)
        return lg_target_openai(s);
    if (sscanf(o->gateway, "%255[^:]:%hu", s->host, &s->port) != 2 || !s->port)
        return td_errorf(TD_ERR_INVALID, "--gateway: '%s' is not HOST:PORT", o->gateway);
    return TD_OK;
}

/* The loop, its arrival timer and deadline tick, and the gRPC channels of --gateway. On an
 * error what was made is still closed by lg_close_all. */
static td_status_t lg_open(lg_state_t *s)
{
    uv_loop_init(&s->loop);
    td_list_init(&s->waiting);
    td_list_init(&s->active);
    td_list_init(&s->idle_conns);
    uv_timer_init(&s->loop, &s->arrive);
    uv_timer_init(&s->loop, &s->tick);
    s->arrive.data = s->tick.data = s;
    uv_timer_start(&s->tick, lg_on_tick, LG_TICK_MS, LG_TICK_MS);
    if (!s->cfg.gateway)
        return TD_OK;
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    if (!(s->gw = calloc((size_t)s->cfg.connections, sizeof *s->gw)))
        return td_errorf(TD_ERR_NOMEM, "loadgen: out of memory for %lld channels", (long long)s->cfg.connections);
    for (; s->n_gw < s->cfg.connections; s->n_gw++) {
        td_status_t st = td_grpc_channel_create(&s->loop, s->host, s->port, &cc, &s->gw[s->n_gw]);
        if (st != TD_OK)
            return st;
    }
    return TD_OK;
}

loadgen_config_t loadgen_config_default(void)
{
    return (loadgen_config_t){.vocab = 256, .ignore_eos = true, .request_timeout_s = 300, .connections = 4};
}

td_status_t loadgen_client_create(const loadgen_config_t *cfg, const char *prog, loadgen_client_t **c_p)
{
    loadgen_client_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", prog);
    s->cfg = *cfg;
    s->cfg.connections = TD_MAX(cfg->connections, 1);
    s->cfg.vocab = TD_MAX(cfg->vocab, 2u);
    td_status_t st = lg_target_parse(s, prog);
    if (st == TD_OK && cfg->model) {
        cJSON *m = cJSON_CreateString(cfg->model);
        s->model_json = m ? cJSON_PrintUnformatted(m) : NULL;
        cJSON_Delete(m);
        if (!s->model_json)
            st = td_errorf(TD_ERR_NOMEM, "%s: out of memory", prog);
    }
    if (st != TD_OK) {
        cJSON_free(s->model_json);
        free(s);
        return st;
    }
    if ((st = lg_open(s)) != TD_OK) {
        loadgen_client_destroy(s);
        return st;
    }
    *c_p = s;
    return TD_OK;
}

void loadgen_client_destroy(loadgen_client_t *s)
{
    if (!s)
        return;
    lg_close_all(s);
    cJSON_free(s->model_json);
    free(s);
}
