/*
 * bench_http_server: `tandem bench http-server [--json] [--seconds S] [--connections N]
 * [--pipeline P] [--events N]`: the HTTP/1.1 server (common/rpc/td_http) alone, with
 * handlers that answer at once, so the figures are the server's own cost:
 *
 *   1. requests/s of a tiny answer (GET, a 64-byte body: a small /metrics page or an error)
 *      over N keep-alive connections with P requests in flight on each, and the latency of
 *      each from the client's send to the last byte of its answer (p50, p99);
 *   2. SSE events/s on one stream: N events of 64 bytes (an OpenAI chunk with one token's
 *      delta is about that size), each its own td_http_stream_write, to a client that reads
 *      as fast as it can (the write-queue bound and on_writable pace the handler).
 *
 * The server runs on its own thread and loop (one core, as the router's loop is); the
 * client is this thread's loop. With both on one machine the client's cost is in the wall
 * figures, so the server's CPU time (its thread's clock) is measured too and each rate is
 * also given per server-core-second: what one core of the router's loop could serve.
 * The OpenAI path through the router is `tandem bench router`'s.
 */
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "td_bench.h"
#include "td_http.h"
#include "td_opts.h"
#include "td_util.h"

enum { HB_BODY = 64, HB_MAX_PIPE = 64, HB_MAX_LAT = 1 << 22 };

static const char hb_body[HB_BODY + 1] = "{\"object\":\"tiny\",\"data\":\"0123456789012345678901234567890123\"}\n";
static const char hb_event[HB_BODY + 1] = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" tok\"}}]}\n\n\n";

/* ---- the server: its own thread and loop --------------------------------------------- */

typedef struct hb_server {
    uv_thread_t thread;
    uv_loop_t loop;
    uv_async_t stop;
    uv_sem_t ready;
    td_http_server_t *http;
    uint16_t port;
    td_status_t st;
} hb_server_t;

typedef struct hb_stream {
    long left;
} hb_stream_t;

static void hb_pump(td_http_req_t *req, void *data)
{
    hb_stream_t *s = data;
    while (s->left > 0) {
        td_status_t st = td_http_stream_write(req, hb_event, HB_BODY);
        if (st == TD_ERR_BUSY)
            return; /* on_writable calls again */
        if (st != TD_OK)
            break;
        s->left--;
    }
    td_http_stream_end(req);
    free(s);
}

static void hb_abort(td_http_req_t *req, void *data)
{
    free(data);
}

static void hb_handler(void *data, td_http_req_t *req)
{
    const char *path = td_http_req_path(req);
    if (strcmp(path, "/sse") != 0) {
        td_http_respond(req, 200, "application/json", hb_body, HB_BODY);
        return;
    }
    hb_stream_t *s = malloc(sizeof *s);
    if (!s) {
        td_http_respond(req, 503, NULL, "out of memory\n", 14);
        return;
    }
    s->left = strtol(td_http_req_query(req), NULL, 10);
    td_http_req_set_data(req, s);
    td_http_req_on_abort(req, hb_abort);
    td_http_req_on_writable(req, hb_pump);
    if (td_http_stream_begin(req, 200, "text/event-stream") != TD_OK) {
        td_http_req_set_data(req, NULL); /* on_abort follows */
        free(s);
        return;
    }
    hb_pump(req, s);
}

static void hb_on_stop(uv_async_t *a)
{
    hb_server_t *s = a->data;
    td_http_server_close(s->http, NULL, NULL);
    uv_close((uv_handle_t *)&s->stop, NULL);
}

static void hb_server_main(void *arg)
{
    hb_server_t *s = arg;
    uv_loop_init(&s->loop);
    uv_async_init(&s->loop, &s->stop, hb_on_stop);
    s->stop.data = s;
    td_http_config_t cfg = td_http_config_default();
    cfg.name = "bench http";
    cfg.max_connections = 4096;
    cfg.handler = hb_handler;
    s->st = td_http_server_create(&s->loop, &cfg, &s->http);
    if (s->st == TD_OK)
        s->port = td_http_server_port(s->http);
    uv_sem_post(&s->ready);
    if (s->st != TD_OK) {
        uv_close((uv_handle_t *)&s->stop, NULL);
        uv_run(&s->loop, UV_RUN_DEFAULT);
        uv_loop_close(&s->loop);
        return;
    }
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
}

/* The server thread's CPU seconds so far (read from this thread). */
static double hb_server_cpu_s(hb_server_t *s)
{
    clockid_t cid;
    struct timespec ts;
    if (pthread_getcpuclockid(s->thread, &cid) != 0 || clock_gettime(cid, &ts) != 0)
        return 0;
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- the client: this thread's loop -------------------------------------------------- */

typedef struct hb_client hb_client_t;

typedef struct hb_conn {
    uv_tcp_t tcp;
    uv_connect_t connect;
    hb_client_t *cl;
    size_t got;                       /* bytes of the answer being read */
    uint64_t sent_ns[HB_MAX_PIPE];    /* ring of the send times in flight */
    int head, inflight;
    char tail[5];                     /* the stream's last bytes: its end is "0\r\n\r\n" */
    size_t stream_bytes;
    bool stream_done;
} hb_conn_t;

struct hb_client {
    uv_loop_t *loop;
    uint16_t port;
    size_t answer_len;                /* bytes of one tiny answer, measured by a probe */
    int pipeline;                     /* 0: the stream */
    long events;                      /* the stream's */
    bool running, counting;
    int open;
    uint64_t done;                    /* answers while counting */
    uint32_t *lat_us;                 /* [HB_MAX_LAT] */
    size_t n_lat;
    uint64_t t0_ns, t1_ns;
    double cpu0, cpu1;
    hb_server_t *srv;
    char rbuf[1 << 16];
    uv_timer_t warm, end;
    const char *fail;
};

static const char hb_request[] = "GET /tiny HTTP/1.1\r\nHost: bench\r\n\r\n";

static void hb_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    hb_conn_t *c = h->data;
    *buf = uv_buf_init(c->cl->rbuf, sizeof c->cl->rbuf);
}

static void hb_closed(uv_handle_t *h)
{
    hb_conn_t *c = h->data;
    c->cl->open--;
}

static void hb_send(hb_conn_t *c, int n)
{
    static char reqs[sizeof hb_request * HB_MAX_PIPE];
    size_t one = sizeof hb_request - 1;
    if (!reqs[0])
        for (int i = 0; i < HB_MAX_PIPE; i++)
            memcpy(reqs + i * one, hb_request, one);
    uv_buf_t b = uv_buf_init(reqs, (unsigned)(one * (size_t)n));
    if (uv_try_write((uv_stream_t *)&c->tcp, &b, 1) != (int)b.len) {
        c->cl->fail = "a request did not fit the socket at once";
        return;
    }
    uint64_t now = td_now_ns();
    for (int i = 0; i < n; i++)
        c->sent_ns[(c->head + c->inflight++) % HB_MAX_PIPE] = now;
}

static void hb_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    hb_conn_t *c = s->data;
    hb_client_t *cl = c->cl;
    if (nread < 0) {
        if (!uv_is_closing((uv_handle_t *)s))
            uv_close((uv_handle_t *)s, hb_closed);
        if (cl->running)
            cl->fail = "the server closed a connection";
        return;
    }
    if (cl->pipeline == 0) { /* the stream */
        c->stream_bytes += (size_t)nread;
        size_t keep = nread >= 5 ? 5 : (size_t)nread;
        memmove(c->tail, c->tail + keep, 5 - keep);
        memcpy(c->tail + 5 - keep, buf->base + nread - (ssize_t)keep, keep);
        if (memcmp(c->tail, "0\r\n\r\n", 5) == 0) {
            c->stream_done = true;
            uv_close((uv_handle_t *)s, hb_closed);
        }
        return;
    }
    c->got += (size_t)nread;
    int answered = 0;
    uint64_t now = td_now_ns();
    while (c->got >= cl->answer_len && c->inflight > 0) {
        c->got -= cl->answer_len;
        if (cl->counting) {
            cl->done++;
            if (cl->n_lat < HB_MAX_LAT)
                cl->lat_us[cl->n_lat++] = (uint32_t)((now - c->sent_ns[c->head]) / 1000);
        }
        c->head = (c->head + 1) % HB_MAX_PIPE;
        c->inflight--;
        answered++;
    }
    if (cl->running && answered)
        hb_send(c, answered);
    else if (!cl->running && c->inflight == 0)
        uv_close((uv_handle_t *)s, hb_closed);
}

static void hb_connected(uv_connect_t *req, int status)
{
    hb_conn_t *c = req->data;
    if (status < 0) {
        c->cl->fail = "connect failed";
        uv_close((uv_handle_t *)&c->tcp, hb_closed);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    uv_read_start((uv_stream_t *)&c->tcp, hb_alloc, hb_read);
    if (c->cl->pipeline == 0) {
        char get[64];
        int n = snprintf(get, sizeof get, "GET /sse?%ld HTTP/1.1\r\n\r\n", c->cl->events);
        uv_buf_t b = uv_buf_init(get, (unsigned)n);
        if (uv_try_write((uv_stream_t *)&c->tcp, &b, 1) != n)
            c->cl->fail = "the stream's request did not fit the socket";
        c->cl->t0_ns = td_now_ns();
        c->cl->cpu0 = hb_server_cpu_s(c->cl->srv);
        return;
    }
    hb_send(c, c->cl->pipeline);
}

static void hb_on_warm(uv_timer_t *t)
{
    hb_client_t *cl = t->data;
    cl->counting = true;
    cl->t0_ns = td_now_ns();
    cl->cpu0 = hb_server_cpu_s(cl->srv);
}

static void hb_on_end(uv_timer_t *t)
{
    hb_client_t *cl = t->data;
    cl->t1_ns = td_now_ns();
    cl->cpu1 = hb_server_cpu_s(cl->srv);
    cl->counting = false;
    cl->running = false;
    uv_close((uv_handle_t *)&cl->warm, NULL);
    uv_close((uv_handle_t *)&cl->end, NULL);
}

static hb_conn_t *hb_connect(hb_client_t *cl)
{
    hb_conn_t *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->cl = cl;
    uv_tcp_init(cl->loop, &c->tcp);
    c->tcp.data = c;
    c->connect.data = c;
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", cl->port, &a);
    cl->open++;
    if (uv_tcp_connect(&c->connect, &c->tcp, (const struct sockaddr *)&a, hb_connected) < 0) {
        cl->fail = "connect failed";
        uv_close((uv_handle_t *)&c->tcp, hb_closed);
    }
    return c;
}

/* One blocking request: the length of the answer the pipelined clients count by. */
static size_t hb_probe(uint16_t port)
{
    size_t len = 0;
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", port, &a);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return 0;
    const char *req = "GET /tiny HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n";
    if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0 && write(fd, req, strlen(req)) == (ssize_t)strlen(req)) {
        char b[4096];
        ssize_t n;
        while ((n = read(fd, b, sizeof b)) > 0)
            len += (size_t)n;
    }
    close(fd);
    /* the keep-alive answers say "keep-alive" where the probe's said "close" */
    return len ? len + strlen("keep-alive") - strlen("close") : 0;
}

static int hb_cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

int bench_http_server(int argc, char **argv)
{
    bool json = false;
    int64_t connections = 16, pipeline = 1, events = 1000000;
    float seconds = 3.0f;
    const td_opt_t opts[] = {
        {.name = "json", .type = TD_OPT_BOOL, .ptr = &json, .help = "one JSON document on stdout (docs/bench.md)"},
        {.name = "seconds", .type = TD_OPT_F32, .ptr = &seconds, .fmin = 0.1f, .fmax = 600.0f, .arg = "S",
         .help = "how long the request phase runs, after 0.3 s of warm-up (default 3)"},
        {.name = "connections", .type = TD_OPT_I64, .ptr = &connections, .min = 1, .max = 1024, .arg = "N",
         .help = "keep-alive connections (default 16)"},
        {.name = "pipeline", .type = TD_OPT_I64, .ptr = &pipeline, .min = 1, .max = HB_MAX_PIPE, .arg = "P",
         .help = "requests in flight on each (default 1: send, wait for the answer, send)"},
        {.name = "events", .type = TD_OPT_I64, .ptr = &events, .min = 1, .max = 1000000000, .arg = "N",
         .help = "SSE events on the stream (default 1000000)"},
    };
    td_opts_t spec = {.prog = "bench http-server", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r_opts = {0};
    if (td_opts_parse(&spec, argc, argv, &r_opts) != TD_OK)
        return 2;
    if (r_opts.help) {
        printf("usage: tandem bench http-server [--json] [--seconds S] [--connections N] [--pipeline P] "
               "[--events N]\n\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        return 0;
    }

    hb_server_t srv = {0};
    uv_sem_init(&srv.ready, 0);
    if (uv_thread_create(&srv.thread, hb_server_main, &srv) != 0) {
        fprintf(stderr, "bench http-server: cannot start the server thread\n");
        return 1;
    }
    uv_sem_wait(&srv.ready);
    uv_sem_destroy(&srv.ready);
    if (srv.st != TD_OK) {
        uv_thread_join(&srv.thread);
        fprintf(stderr, "bench http-server: %s\n", td_last_error());
        return 1;
    }
    int rc = 1;
    uv_loop_t loop;
    uv_loop_init(&loop);
    hb_client_t *cl = calloc(1, sizeof *cl);
    uint32_t *lat = malloc(sizeof *lat * HB_MAX_LAT);
    hb_conn_t **conns = calloc((size_t)connections, sizeof *conns);
    if (!cl || !lat || !conns) {
        fprintf(stderr, "bench http-server: out of memory\n");
        goto out;
    }
    cl->loop = &loop;
    cl->port = srv.port;
    cl->srv = &srv;
    cl->lat_us = lat;
    cl->answer_len = hb_probe(srv.port);
    if (!cl->answer_len) {
        fprintf(stderr, "bench http-server: the probe request got no answer\n");
        goto out;
    }

    /* 1. tiny answers */
    cl->pipeline = (int)pipeline;
    cl->running = true;
    uv_timer_init(&loop, &cl->warm);
    uv_timer_init(&loop, &cl->end);
    cl->warm.data = cl->end.data = cl;
    uv_timer_start(&cl->warm, hb_on_warm, 300, 0);
    uv_timer_start(&cl->end, hb_on_end, 300 + (uint64_t)(seconds * 1000), 0);
    for (int64_t i = 0; i < connections; i++)
        conns[i] = hb_connect(cl);
    uv_run(&loop, UV_RUN_DEFAULT);
    for (int64_t i = 0; i < connections; i++)
        free(conns[i]);
    if (cl->fail) {
        fprintf(stderr, "bench http-server: %s\n", cl->fail);
        goto out;
    }
    double wall = (double)(cl->t1_ns - cl->t0_ns) / 1e9, cpu = cl->cpu1 - cl->cpu0;
    double rps = (double)cl->done / wall, rps_core = cpu > 0 ? (double)cl->done / cpu : 0;
    qsort(cl->lat_us, cl->n_lat, sizeof *cl->lat_us, hb_cmp_u32);
    double p50 = cl->n_lat ? cl->lat_us[cl->n_lat / 2] : 0, p99 = cl->n_lat ? cl->lat_us[cl->n_lat * 99 / 100] : 0;

    /* 2. one SSE stream */
    cl->pipeline = 0;
    cl->running = true;
    cl->fail = NULL;
    hb_conn_t *sc = calloc(1, sizeof *sc);
    if (!sc) {
        fprintf(stderr, "bench http-server: out of memory\n");
        goto out;
    }
    sc->cl = cl;
    cl->events = (long)events;
    uv_tcp_init(&loop, &sc->tcp);
    sc->tcp.data = sc;
    sc->connect.data = sc;
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", srv.port, &a);
    cl->open++;
    uv_tcp_connect(&sc->connect, &sc->tcp, (const struct sockaddr *)&a, hb_connected);
    uv_run(&loop, UV_RUN_DEFAULT);
    double s_wall = (double)(td_now_ns() - cl->t0_ns) / 1e9, s_cpu = hb_server_cpu_s(&srv) - cl->cpu0;
    bool s_ok = sc->stream_done && !cl->fail;
    size_t s_bytes = sc->stream_bytes;
    free(sc);
    if (!s_ok) {
        fprintf(stderr, "bench http-server: the stream did not end well (%zu bytes)\n", s_bytes);
        goto out;
    }
    double eps = (double)events / s_wall, eps_core = s_cpu > 0 ? (double)events / s_cpu : 0;

    if (json) {
        cJSON *j = cJSON_CreateObject();
        bench_json_number(j, "connections", (double)connections, 0);
        bench_json_number(j, "pipeline", (double)pipeline, 0);
        bench_json_number(j, "requests", (double)cl->done, 0);
        bench_json_number(j, "requests_per_s", rps, 0);
        bench_json_number(j, "requests_per_server_core_s", rps_core, 0);
        bench_json_number(j, "server_cpu_share", cpu / wall, 3);
        bench_json_number(j, "latency_p50_us", p50, 0);
        bench_json_number(j, "latency_p99_us", p99, 0);
        bench_json_number(j, "sse_events", (double)events, 0);
        bench_json_number(j, "sse_events_per_s", eps, 0);
        bench_json_number(j, "sse_events_per_server_core_s", eps_core, 0);
        bench_json_number(j, "sse_mb_per_s", (double)s_bytes / s_wall / 1e6, 1);
        rc = bench_json_print(stdout, j);
    } else {
        printf("td_http, %lld keep-alive connections x %lld in flight, %.1f s (server on one thread, client on "
               "another):\n",
               (long long)connections, (long long)pipeline, wall);
        printf("  tiny answers (%zu bytes): %.0f requests/s; %.0f per server-core-second (server busy %.0f%%)\n",
               cl->answer_len, rps, rps_core, 100 * cpu / wall);
        printf("  latency send -> answer: p50 %.0f us, p99 %.0f us\n", p50, p99);
        printf("  SSE: %lld events of %d bytes on one stream in %.2f s: %.0f events/s, %.0f per server-core-second, "
               "%.0f MB/s\n",
               (long long)events, HB_BODY, s_wall, eps, eps_core, (double)s_bytes / s_wall / 1e6);
        rc = 0;
    }

out:
    uv_loop_close(&loop);
    free(conns);
    free(lat);
    free(cl);
    uv_async_send(&srv.stop);
    uv_thread_join(&srv.thread);
    return rc;
}
