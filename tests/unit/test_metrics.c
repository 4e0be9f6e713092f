/*
 * test_metrics: the Prometheus registry (golden rendering, escaping, labels, histogram
 * buckets, registration rules, concurrent updates) and GET /metrics over td_http with a
 * raw socket (200, 404, 400 on garbage, 431 on an oversized request, keep-alive), and the
 * event-loop series of td_metrics_loop (a blocking callback shows as lag and as the longest run).
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#include <uv.h>

#include "td_http.h"
#include "td_metrics.h"
#include "td_metrics_loop.h"
#include "td_test_loop.h"
#include "td_test_net.h"
#include "td_util.h"

static const char golden[] =
    "# HELP tandem_requests_total Requests finished, by outcome.\n"
    "# TYPE tandem_requests_total counter\n"
    "tandem_requests_total{outcome=\"ok\"} 3\n"
    "tandem_requests_total{outcome=\"say \\\"hi\\\"\\\\\\n\"} 1\n"
    "# HELP tandem_kv_blocks_free Free KV blocks \\\\ with a\\nnewline.\n"
    "# TYPE tandem_kv_blocks_free gauge\n"
    "tandem_kv_blocks_free 12.5\n"
    "# HELP tandem_ttft_seconds Time to first token.\n"
    "# TYPE tandem_ttft_seconds histogram\n"
    "tandem_ttft_seconds_bucket{role=\"router\",le=\"0.1\"} 1\n"
    "tandem_ttft_seconds_bucket{role=\"router\",le=\"0.5\"} 2\n"
    "tandem_ttft_seconds_bucket{role=\"router\",le=\"1\"} 3\n"
    "tandem_ttft_seconds_bucket{role=\"router\",le=\"+Inf\"} 4\n"
    "tandem_ttft_seconds_sum{role=\"router\"} 3.35\n"
    "tandem_ttft_seconds_count{role=\"router\"} 4\n"
    "# HELP tandem_unused_total Never touched.\n"
    "# TYPE tandem_unused_total counter\n";

static td_metrics_t *golden_registry(void)
{
    td_metrics_t *reg;
    td_metric_family_t *req, *ttft;
    td_metric_t *ok, *odd, *free_blocks, *router;
    const char *outcome[] = {"outcome"}, *role[] = {"role"};
    const double buckets[] = {0.1, 0.5, 1};
    cr_assert_eq(td_metrics_create(&reg), TD_OK);
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_COUNTER, "tandem_requests_total",
                                     "Requests finished, by outcome.", outcome, 1, NULL, 0, &req), TD_OK);
    cr_assert_eq(td_metric_family_get(req, (const char *[]){"ok"}, &ok), TD_OK);
    cr_assert_eq(td_metric_family_get(req, (const char *[]){"say \"hi\"\\\n"}, &odd), TD_OK);
    const td_metric_def_t gauge[] = {
        TD_METRIC_DEF_GAUGE("tandem_kv_blocks_free", "Free KV blocks \\ with a\nnewline.", &free_blocks)};
    cr_assert_eq(td_metrics_register_all(reg, gauge, 1), TD_OK);
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_HISTOGRAM, "tandem_ttft_seconds", "Time to first token.",
                                     role, 1, buckets, 3, &ttft), TD_OK);
    cr_assert_eq(td_metric_family_get(ttft, (const char *[]){"router"}, &router), TD_OK);
    td_metric_t *unused;
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_COUNTER, "tandem_unused_total", "Never touched.", outcome, 1,
                                     NULL, 0, (td_metric_family_t **)&unused), TD_OK);
    td_metric_inc(ok);
    td_metric_add(ok, 2);
    td_metric_add(ok, -5); /* ignored: counters only go up */
    td_metric_inc(odd);
    td_metric_set(free_blocks, 12.5);
    td_metric_observe(router, 0.05);
    td_metric_observe(router, 0.5); /* le is inclusive */
    td_metric_observe(router, 0.8);
    td_metric_observe(router, 2.0);
    return reg;
}

Test(metrics, golden_rendering)
{
    td_metrics_t *reg = golden_registry();
    char *text;
    size_t len;
    cr_assert_eq(td_metrics_render(reg, &text, &len), TD_OK);
    cr_assert_str_eq(text, golden);
    cr_assert_eq(len, strlen(golden));
    free(text);
    td_metrics_destroy(reg);
}

/* What td_metrics_render writes reads back: an unlabelled series' value, an absent one NAN,
 * a labelled one not taken for it, and an unlabelled histogram's buckets (+Inf last) */
Test(metrics, text_reads_back)
{
    td_metrics_t *reg = golden_registry();
    td_metric_family_t *lens;
    td_metric_t *len1;
    const double buckets[] = {16, 64, 256};
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_HISTOGRAM, "tandem_prompt_tokens", "Prompt lengths.", NULL, 0,
                                     buckets, 3, &lens), TD_OK);
    cr_assert_eq(td_metric_family_get(lens, NULL, &len1), TD_OK);
    td_metric_observe(len1, 10);
    td_metric_observe(len1, 100);
    td_metric_observe(len1, 100);
    td_metric_observe(len1, 1000);
    char *text;
    size_t len;
    cr_assert_eq(td_metrics_render(reg, &text, &len), TD_OK);
    cr_assert_eq(td_metrics_text_value(text, "tandem_kv_blocks_free"), 12.5);
    cr_assert(isnan(td_metrics_text_value(text, "tandem_kv_blocks")), "a prefix is not the series");
    cr_assert(isnan(td_metrics_text_value(text, "tandem_requests_total")), "a labelled series has no bare value");
    cr_assert_eq(td_metrics_text_value(text, "tandem_prompt_tokens_count"), 4);
    double le[8], cum[8];
    int n = td_metrics_text_buckets(text, "tandem_prompt_tokens", le, cum, 8);
    cr_assert_eq(n, 4);
    const double want_le[] = {16, 64, 256, INFINITY}, want_cum[] = {1, 1, 3, 4};
    for (int i = 0; i < n; i++)
        cr_assert(le[i] == want_le[i] && cum[i] == want_cum[i], "bucket %d: le %g cum %g", i, le[i], cum[i]);
    cr_assert_eq(td_metrics_text_buckets(text, "tandem_prompt_tokens", le, cum, 2), 2, "at most cap");
    cr_assert_eq(td_metrics_text_buckets(text, "tandem_none", le, cum, 8), 0);
    free(text);
    td_metrics_destroy(reg);
}

Test(metrics, registration_rules)
{
    td_metrics_t *reg;
    td_metric_family_t *f, *g;
    td_metric_t *m, *m2;
    const double b[] = {1, 2}, bad_b[] = {2, 1};
    cr_assert_eq(td_metrics_create(&reg), TD_OK);
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_COUNTER, "9bad", "", NULL, 0, NULL, 0, &f), TD_ERR_INVALID);
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_COUNTER, "a-b", "", NULL, 0, NULL, 0, &f), TD_ERR_INVALID);
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_COUNTER, "ok", "", (const char *[]){"__x"}, 1, NULL, 0, &f),
                 TD_ERR_INVALID);
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_HISTOGRAM, "h", "", (const char *[]){"le"}, 1, b, 2, &f),
                 TD_ERR_INVALID);
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_HISTOGRAM, "h", "", NULL, 0, bad_b, 2, &f), TD_ERR_INVALID);
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_HISTOGRAM, "h", "", NULL, 0, NULL, 0, &f), TD_ERR_INVALID);
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_GAUGE, "g", "", (const char *[]){"a", "a"}, 2, NULL, 0, &f),
                 TD_ERR_INVALID);
    /* same shape again: the same family; another shape: refused */
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_GAUGE, "g", "x", (const char *[]){"a"}, 1, NULL, 0, &f), TD_OK);
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_GAUGE, "g", "x", (const char *[]){"a"}, 1, NULL, 0, &g), TD_OK);
    cr_assert_eq(f, g);
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_COUNTER, "g", "x", (const char *[]){"a"}, 1, NULL, 0, &g),
                 TD_ERR_INVALID);
    cr_assert_eq(td_metric_family_get(f, (const char *[]){"v"}, &m), TD_OK);
    cr_assert_eq(td_metric_family_get(f, (const char *[]){"v"}, &m2), TD_OK);
    cr_assert_eq(m, m2);
    cr_assert_eq(td_metric_family_get(f, (const char *[]){NULL}, &m2), TD_ERR_INVALID);
    td_metric_set(m, -3);
    td_metric_add(m, 1);
    cr_assert_float_eq(td_metric_value(m), -2.0, 0);
    td_metrics_destroy(reg);
    td_metrics_destroy(NULL);
}

typedef struct hammer {
    td_metric_t *c, *h;
} hammer_t;

static void *hammer_thread(void *arg)
{
    hammer_t *hm = arg;
    for (int i = 0; i < 100000; i++) {
        td_metric_inc(hm->c);
        td_metric_observe(hm->h, 0.001);
    }
    return NULL;
}

Test(metrics, concurrent_updates, .timeout = 30)
{
    td_metrics_t *reg;
    hammer_t hm;
    cr_assert_eq(td_metrics_create(&reg), TD_OK);
    const td_metric_def_t defs[] = {
        TD_METRIC_DEF_COUNTER("c_total", "c", &hm.c),
        TD_METRIC_DEF_HISTOGRAM("h_seconds", "h", td_metrics_latency_buckets, td_metrics_latency_n_buckets, &hm.h),
    };
    cr_assert_eq(td_metrics_register_all(reg, defs, TD_ARRAY_LEN(defs)), TD_OK);
    pthread_t t[4];
    for (int i = 0; i < 4; i++)
        pthread_create(&t[i], NULL, hammer_thread, &hm);
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    cr_assert_float_eq(td_metric_value(hm.c), 400000.0, 0);
    unsigned long long n;
    double sum;
    td_metric_histogram_read(hm.h, &n, &sum);
    cr_assert_eq(n, 400000ull);
    td_metrics_destroy(reg);
}

/* ---- /metrics over HTTP ------------------------------------------------------------- */

/* A /metrics server of `reg` on its own loop thread. */
typedef struct http_srv {
    td_test_http_t h;
    td_metrics_t *reg;
} http_srv_t;

/* Starts the server with cfg, its handler the /metrics one of h->reg. */
static void http_start(http_srv_t *h, const td_http_config_t *cfg)
{
    td_http_config_t c = *cfg;
    c.handler = td_http_metrics_handler;
    c.handler_data = h->reg;
    td_test_http_start(&h->h, &c);
}

/* Stops the server, checks that its loop closed every handle, and destroys its registry. */
static void http_stop(http_srv_t *h)
{
    int loop_close_rc = td_test_http_stop(&h->h);
    cr_assert_eq(loop_close_rc, 0, "http server left handles open");
    td_metrics_destroy(h->reg);
}

/* Reads one response with Content-Length; returns its total length. */
static size_t read_response(int fd, char *buf, size_t cap)
{
    size_t len = 0;
    for (;;) {
        buf[len] = '\0';
        char *end = strstr(buf, "\r\n\r\n");
        if (end) {
            char *cl = strstr(buf, "Content-Length: ");
            cr_assert(cl);
            size_t body = strtoul(cl + 16, NULL, 10);
            if (len >= (size_t)(end + 4 - buf) + body)
                return len;
        }
        ssize_t n = recv(fd, buf + len, cap - 1 - len, 0);
        cr_assert_gt(n, 0, "connection closed or timed out mid-response");
        len += (size_t)n;
    }
}

Test(metrics, http_metrics_endpoint, .timeout = 30)
{
    signal(SIGPIPE, SIG_IGN);
    http_srv_t h = {.reg = golden_registry()};
    td_http_config_t cfg = td_http_config_default();
    cfg.max_request_bytes = 1024;
    http_start(&h, &cfg);
    static char buf[65536];

    /* two requests on one keep-alive connection */
    int fd = td_test_connect(h.h.port);
    const char *get = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    for (int i = 0; i < 2; i++) {
        send(fd, get, strlen(get), 0);
        read_response(fd, buf, sizeof buf);
        cr_assert(strncmp(buf, "HTTP/1.1 200 OK\r\n", 17) == 0, "got: %s", buf);
        cr_assert(strstr(buf, "Content-Type: text/plain; version=0.0.4"));
        cr_assert(strstr(buf, golden), "body differs: %s", buf);
    }
    send(fd, "GET /nope HTTP/1.1\r\n\r\n", 22, 0);
    read_response(fd, buf, sizeof buf);
    cr_assert(strncmp(buf, "HTTP/1.1 404", 12) == 0, "got: %s", buf);
    send(fd, "POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi", 47, 0);
    read_response(fd, buf, sizeof buf);
    cr_assert(strncmp(buf, "HTTP/1.1 405", 12) == 0, "got: %s", buf);
    close(fd);

    /* garbage: 400 and close */
    fd = td_test_connect(h.h.port);
    send(fd, "\x01\x02 garbage\r\n\r\n", 14, 0);
    read_response(fd, buf, sizeof buf);
    cr_assert(strncmp(buf, "HTTP/1.1 400", 12) == 0, "got: %s", buf);
    cr_assert_eq(recv(fd, buf, sizeof buf, 0), 0, "not closed after 400");
    close(fd);

    /* a request over the bound (1 KiB): 431 and close */
    fd = td_test_connect(h.h.port);
    char big[2048];
    memset(big, 'a', sizeof big);
    memcpy(big, "GET /metrics HTTP/1.1\r\nX: ", 26);
    send(fd, big, sizeof big, 0);
    read_response(fd, buf, sizeof buf);
    cr_assert(strncmp(buf, "HTTP/1.1 431", 12) == 0, "got: %s", buf);
    close(fd);

    /* still serving, and HTTP/1.0 closes after the answer */
    fd = td_test_connect(h.h.port);
    send(fd, "GET /metrics HTTP/1.0\r\n\r\n", 25, 0);
    read_response(fd, buf, sizeof buf);
    cr_assert(strncmp(buf, "HTTP/1.1 200", 12) == 0);
    cr_assert(strstr(buf, "Connection: close"));
    close(fd);

    http_stop(&h);
}

/* ---- td_metrics_loop ----------------------------------------------------------------- */

typedef struct loop_case {
    td_metrics_loop_t *w;
    uv_timer_t stall, end;
    int fired;
} loop_case_t;

/* Blocks the loop for 150 ms once, as a callback doing work proportional to a model would. */
static void on_stall(uv_timer_t *h)
{
    loop_case_t *c = h->data;
    if (c->fired++ == 0)
        usleep(150000);
}

static void on_end(uv_timer_t *h)
{
    loop_case_t *c = h->data;
    td_metrics_loop_stop(c->w);
    uv_close((uv_handle_t *)&c->stall, NULL);
    uv_close((uv_handle_t *)&c->end, NULL);
}

/* Only lower bounds are checked (a loaded machine adds lag, never removes it): the blocked
 * 150 ms must appear as one lag sample of at least 100 ms and as a run of at least 150 ms,
 * and the lag timer must have sampled while the loop was otherwise idle. */
Test(metrics, loop_lag_and_longest_run, .timeout = 30)
{
    uv_loop_t loop;
    cr_assert_eq(uv_loop_init(&loop), 0);
    td_metrics_t *m;
    cr_assert_eq(td_metrics_create(&m), TD_OK);
    loop_case_t c = {0};
    cr_assert_eq(td_metrics_loop_start(&loop, m, &c.w), TD_OK);
    uv_timer_init(&loop, &c.stall);
    uv_timer_init(&loop, &c.end);
    c.stall.data = c.end.data = &c;
    uv_timer_start(&c.stall, on_stall, 200, 0);
    uv_timer_start(&c.end, on_end, 600, 0);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&loop), 0, "every handle of the watcher closed");

    char *text;
    size_t len;
    cr_assert_eq(td_metrics_render(m, &text, &len), TD_OK);
    unsigned long long n = 0, under_100ms = 0;
    double longest = -1;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (sscanf(line, "tandem_event_loop_lag_seconds_bucket{le=\"0.1\"} %llu", &under_100ms) == 1)
            continue;
        if (sscanf(line, "tandem_event_loop_lag_seconds_count %llu", &n) == 1)
            continue;
        sscanf(line, "tandem_event_loop_longest_run_seconds %lf", &longest);
    }
    free(text);
    td_metrics_destroy(m);
    cr_assert_geq(n, 10, "the 10 ms lag timer sampled over 600 ms (%llu samples)", n);
    cr_assert_lt(under_100ms, n, "one lag sample is over 100 ms (%llu of %llu under)", under_100ms, n);
    cr_assert_geq(longest, 0.15, "the 150 ms callback is the longest run (%g s)", longest);
}

/* ---- idle, slow and half-open connections ------------------------------------------ */

/* A /metrics server with `cfg` that counts its closed connections in its own registry. */
static void hostile_start(http_srv_t *hs, const td_http_config_t *cfg)
{
    signal(SIGPIPE, SIG_IGN);
    memset(hs, 0, sizeof *hs);
    cr_assert_eq(td_metrics_create(&hs->reg), TD_OK);
    td_http_config_t c = *cfg;
    c.metrics = hs->reg;
    http_start(hs, &c);
}

/* One scrape on a new connection: 200 with the closed-connection counter, whose value for
 * `reason` is returned. */
static double scrape_closed(uint16_t port, const char *reason)
{
    static char buf[65536];
    char key[128];
    int fd = td_test_connect(port);
    const char *get = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    cr_assert_eq(send(fd, get, strlen(get), MSG_NOSIGNAL), (ssize_t)strlen(get));
    read_response(fd, buf, sizeof buf);
    close(fd);
    cr_assert(strncmp(buf, "HTTP/1.1 200 OK\r\n", 17) == 0, "got: %s", buf);
    snprintf(key, sizeof key, "tandem_http_server_connections_closed_total{reason=\"%s\"} ", reason);
    const char *p = strstr(buf, key);
    cr_assert(p, "no %s in: %s", key, buf);
    return strtod(p + strlen(key), NULL);
}

/* A request head trickled a byte per 100 ms is closed at the request deadline (500 ms
 * from its first byte), although every gap is far below the idle timeout (30 s). */
Test(metrics, trickled_request_is_closed_at_its_deadline, .timeout = 30)
{
    http_srv_t hs;
    td_http_config_t cfg = td_http_config_default();
    cfg.request_timeout_ms = 500;
    hostile_start(&hs, &cfg);

    static char head[200] = "GET /metrics HTTP/1.1\r\nX-Slow: ";
    memset(head + strlen(head), 'a', sizeof head - 1 - strlen(head));
    td_test_trickle_t t = {0};
    td_test_trickle_start(&t, hs.h.port, 1, head); /* 20 s if never closed */
    char b;
    cr_assert_eq(recv(t.fds[0], &b, 1, 0), 0, "the trickled request was not closed (or was answered)");
    td_test_trickle_stop(&t);

    cr_assert_geq(scrape_closed(hs.h.port, "request_timeout"), 1);
    http_stop(&hs);
}

/* The lock-out: 2,000 connections that sent half a request line and 200 that
 * trickle theirs, at the default limit of 64. The oldest never-served connections make
 * room, so a scraper gets every answer, on new connections and on a kept-alive one. */
Test(metrics, half_open_flood_does_not_lock_scrapers_out, .timeout = 120)
{
    enum { N_HALF = 2000, N_SLOW = 200 };
    if (!td_test_raise_nofile(N_HALF + N_SLOW + 256))
        cr_skip_test("RLIMIT_NOFILE cannot be raised to %d (hard limit too low)", N_HALF + N_SLOW + 256);
    http_srv_t hs;
    td_http_config_t cfg = td_http_config_default();
    hostile_start(&hs, &cfg);
    static char buf[65536];

    int keep = td_test_connect(hs.h.port);
    const char *get = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    send(keep, get, strlen(get), MSG_NOSIGNAL);
    read_response(keep, buf, sizeof buf);

    int *half = calloc(N_HALF, sizeof *half);
    cr_assert(half);
    td_test_half_open(hs.h.port, half, N_HALF, "GET /met", 8);
    td_test_trickle_t slow = {0};
    td_test_trickle_start(&slow, hs.h.port, N_SLOW, "GET /metrics HTTP/1.1\r\nHost: a-slow-client.example\r\n\r\n");

    for (int i = 0; i < 20; i++)
        scrape_closed(hs.h.port, "evicted");
    cr_assert_eq(send(keep, get, strlen(get), MSG_NOSIGNAL), (ssize_t)strlen(get));
    read_response(keep, buf, sizeof buf);
    cr_assert(strncmp(buf, "HTTP/1.1 200 OK\r\n", 17) == 0, "the kept-alive scraper lost its connection: %s", buf);
    /* a loaded machine may take past the 10 s request deadline: those count there */
    double made_room = scrape_closed(hs.h.port, "evicted") + scrape_closed(hs.h.port, "request_timeout");
    cr_assert_geq(made_room, N_HALF + N_SLOW - 64, "connections were refused, not evicted");
    cr_assert_eq(scrape_closed(hs.h.port, "refused"), 0);
    close(keep);

    td_test_trickle_stop(&slow);
    for (int i = 0; i < N_HALF; i++)
        close(half[i]);
    free(half);
    http_stop(&hs);
}

Test(metrics, register_all_registers_in_order_and_stops_at_the_first_error)
{
    td_metrics_t *reg;
    td_metric_t *a = NULL, *b = NULL, *c = NULL;
    cr_assert_eq(td_metrics_create(&reg), TD_OK);
    const td_metric_def_t defs[] = {
        TD_METRIC_DEF_COUNTER("a_total", "a", &a),
        TD_METRIC_DEF_GAUGE("not a name", "b", &b),
        TD_METRIC_DEF_GAUGE("c", "c", &c),
    };
    cr_assert_eq(td_metrics_register_all(reg, defs, TD_ARRAY_LEN(defs)), TD_ERR_INVALID);
    cr_assert(strstr(td_last_error(), "not a name"), "%s", td_last_error());
    cr_assert(a != NULL, "the entries before the bad one are registered");
    cr_assert(b == NULL && c == NULL, "nothing after the bad one");
    td_metric_inc(a);
    cr_assert_float_eq(td_metric_value(a), 1.0, 0);
    td_metrics_destroy(reg);
}

/* A series can be removed (a node that left: its gauges go with it) and a family stops at
 * TD_METRICS_MAX_SERIES series, so labels whose values peers choose cannot grow /metrics
 * without bound (issue 35). */
Test(metrics, series_are_removed_and_capped)
{
    td_metrics_t *reg;
    cr_assert_eq(td_metrics_create(&reg), TD_OK);
    const char *names[] = {"node"};
    td_metric_family_t *fam;
    cr_assert_eq(td_metrics_register(reg, TD_METRIC_GAUGE, "t_node_gauge", "per node", names, 1, NULL, 0, &fam),
                 TD_OK);
    td_metric_t *m;
    const char *a[] = {"a"}, *b[] = {"b"};
    cr_assert_eq(td_metric_family_get(fam, a, &m), TD_OK);
    td_metric_set(m, 1);
    cr_assert_eq(td_metric_family_get(fam, b, &m), TD_OK);
    td_metric_set(m, 2);
    td_metric_family_remove(fam, a);
    td_metric_family_remove(fam, a); /* gone already: nothing */
    char *text;
    size_t len;
    cr_assert_eq(td_metrics_render(reg, &text, &len), TD_OK);
    cr_assert_null(strstr(text, "node=\"a\""), "%s", text);
    cr_assert_not_null(strstr(text, "t_node_gauge{node=\"b\"} 2"), "%s", text);
    free(text);
    char id[32];
    const char *v[] = {id};
    for (int i = 1; i < TD_METRICS_MAX_SERIES; i++) { /* b is the first */
        snprintf(id, sizeof id, "n%d", i);
        cr_assert_eq(td_metric_family_get(fam, v, &m), TD_OK, "series %d", i);
    }
    snprintf(id, sizeof id, "one-too-many");
    cr_assert_eq(td_metric_family_get(fam, v, &m), TD_ERR_EXHAUSTED);
    cr_assert_eq(td_metric_family_get(fam, b, &m), TD_OK, "an existing series is still found at the cap");
    td_metric_family_remove(fam, b);
    cr_assert_eq(td_metric_family_get(fam, v, &m), TD_OK, "a removed series makes room");
    td_metrics_destroy(reg);
}
