/*
 * test_grpc_auth: the front door and the control plane as td_node_auth guards them, over
 * real td_grpc on 127.0.0.1 (the server on its own thread, grpc_test_service.h): request
 * metadata reaches the server's gate (td_grpc_call_header); API keys right / wrong /
 * absent, the health check open, counters by outcome; control calls signed with the
 * cluster secret (the channel's sign hook) pass, unsigned ones, another secret's and a
 * replayed signature are refused before any handler runs.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "grpc_test_service.h"
#include "health.pb-c.h"
#include "tandem.pb-c.h"
#include "td_node_auth.h"

#define KEY "k3y-0123456789abcdef0123456789"
#define SECRET "0123456789abcdef0123456789abcdef0123456789abcdef"

typedef struct result {
    int done;
    td_grpc_code_t code;
    char message[256];
} result_t;

static void on_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *message, void *data)
{
    result_t *r = data;
    r->done++;
    r->code = code;
    snprintf(r->message, sizeof r->message, "%s", message);
}

static void run_until_done(uv_loop_t *loop, result_t *r)
{
    for (int i = 0; i < 1000 && !r->done; i++)
        uv_run(loop, UV_RUN_ONCE);
    cr_assert(r->done, "call did not finish");
}

/* One ListModels on ch with headers; returns how it ended. */
static result_t list_models(uv_loop_t *loop, td_grpc_channel_t *ch, const td_grpc_header_t *h, size_t n)
{
    Tandem__V1__ListModelsRequest req = TANDEM__V1__LIST_MODELS_REQUEST__INIT;
    result_t r = {0};
    td_grpc_call_opts_t o = {.response_desc = &tandem__v1__list_models_response__descriptor, .on_done = on_done,
                             .data = &r, .timeout_ms = 5000, .headers = h, .n_headers = n};
    cr_assert_eq(td_grpc_channel_call(ch, "/tandem.v1.Generation/ListModels", &req.base, &o, NULL), TD_OK);
    run_until_done(loop, &r);
    return r;
}

static td_grpc_channel_t *channel(uv_loop_t *loop, uint16_t port, td_auth_cluster_t *signer_secret)
{
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    cr_assert_eq(td_node_auth_sign_channel(signer_secret, "test", &cc), TD_OK);
    td_grpc_channel_t *ch = NULL;
    cr_assert_eq(td_grpc_channel_create(loop, "127.0.0.1", port, &cc, &ch), TD_OK);
    return ch;
}

static void close_all(uv_loop_t *loop, td_grpc_channel_t *ch, test_server_t *ts)
{
    td_grpc_channel_close(ch, NULL, NULL);
    uv_run(loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(loop), 0, "client loop has handles left");
    cr_assert_eq(ts_stop(ts), 0, "server loop has handles left");
}

Test(grpc_auth, api_keys_on_the_gateway, .timeout = 30)
{
    signal(SIGPIPE, SIG_IGN);
    char path[] = "/tmp/td_keys_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, "# test\n" KEY "\n", strlen("# test\n" KEY "\n")), (ssize_t)strlen("# test\n" KEY "\n"));
    close(fd);
    td_node_auth_t a = {0};
    cr_assert_eq(td_node_auth_load(&a, "test", TD_NODE_AUTH_ROUTER, path, NULL), TD_OK);
    unlink(path);
    uv_loop_t loop;
    cr_assert_eq(uv_loop_init(&loop), 0);
    td_metrics_t *m;
    cr_assert_eq(td_metrics_create(&m), TD_OK);
    cr_assert_eq(td_node_auth_serve(&a, &loop, m), TD_OK);
    td_grpc_server_config_t sc = td_grpc_server_config_default();
    td_node_auth_guard_gateway(&a, &sc);
    td_rpc_budget_t budget = {.limit = 1 << 20}; /* request bytes in flight on the server */
    sc.body_budget = &budget;
    test_server_t ts;
    uint16_t port = ts_start(&ts, &sc);
    cr_assert_neq(port, 0);
    td_grpc_channel_t *ch = channel(&loop, port, NULL);

    td_grpc_header_t right[] = {{"x-other", "1"}, {"authorization", "Bearer " KEY}};
    td_grpc_header_t wrong[] = {{"authorization", "Bearer " KEY "x"}};
    td_grpc_header_t basic[] = {{"authorization", "Basic " KEY}};
    result_t r = list_models(&loop, ch, right, 2);
    cr_assert_eq(r.code, TD_GRPC_OK, "%s", r.message);
    r = list_models(&loop, ch, wrong, 1);
    cr_assert_eq(r.code, TD_GRPC_UNAUTHENTICATED, "%d %s", r.code, r.message);
    cr_assert_str_eq(r.message, "the API key is not valid");
    r = list_models(&loop, ch, basic, 1);
    cr_assert_eq(r.code, TD_GRPC_UNAUTHENTICATED);
    r = list_models(&loop, ch, NULL, 0);
    cr_assert_eq(r.code, TD_GRPC_UNAUTHENTICATED);
    cr_assert(strstr(r.message, "authorization: Bearer KEY"), "%s", r.message);
    cr_assert_eq(atomic_load(&ts.handled), 1, "refused calls never reach the handler");

    /* the key is checked on the headers, before the request is buffered: a 3 MiB request
     * without a key is UNAUTHENTICATED, never weighed against the 1 MiB budget of bytes in
     * flight; with the key the same request is RESOURCE_EXHAUSTED by that budget */
    static char big[3 << 20];
    result_t rb = {0};
    td_grpc_call_opts_t ob = {.response_desc = &tandem__v1__list_models_response__descriptor, .on_done = on_done,
                              .data = &rb, .timeout_ms = 5000, .raw_request = big, .raw_request_len = sizeof big};
    cr_assert_eq(td_grpc_channel_call(ch, "/tandem.v1.Generation/ListModels", NULL, &ob, NULL), TD_OK);
    run_until_done(&loop, &rb);
    cr_assert_eq(rb.code, TD_GRPC_UNAUTHENTICATED, "%d %s", rb.code, rb.message);
    rb = (result_t){0};
    ob.headers = right;
    ob.n_headers = 2;
    cr_assert_eq(td_grpc_channel_call(ch, "/tandem.v1.Generation/ListModels", NULL, &ob, NULL), TD_OK);
    run_until_done(&loop, &rb);
    cr_assert_eq(rb.code, TD_GRPC_RESOURCE_EXHAUSTED, "%d %s", rb.code, rb.message);
    cr_assert(strstr(rb.message, "in flight"), "%s", rb.message);
    r = list_models(&loop, ch, right, 2); /* the budget was given back */
    cr_assert_eq(r.code, TD_GRPC_OK, "%s", r.message);
    atomic_fetch_sub(&ts.handled, 1);

    /* the health check stays open for load balancers */
    Grpc__Health__V1__HealthCheckRequest hreq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    result_t h = {0};
    td_grpc_call_opts_t o = {.response_desc = &grpc__health__v1__health_check_response__descriptor,
                             .on_done = on_done, .data = &h};
    cr_assert_eq(td_grpc_channel_call(ch, "/grpc.health.v1.Health/Check", &hreq.base, &o, NULL), TD_OK);
    run_until_done(&loop, &h);
    cr_assert_eq(h.code, TD_GRPC_OK, "%s", h.message);

    cr_assert_eq(td_metric_value(a.key_outcomes[TD_AUTH_OK]), 3);
    cr_assert_eq(td_metric_value(a.key_outcomes[TD_AUTH_WRONG]), 2);
    cr_assert_eq(td_metric_value(a.key_outcomes[TD_AUTH_MISSING]), 2);
    char *text;
    size_t len;
    cr_assert_eq(td_metrics_render(m, &text, &len), TD_OK);
    cr_assert(strstr(text, "tandem_auth_api_key_total{outcome=\"wrong\"} 2"), "%s", text);
    cr_assert_null(strstr(text, KEY), "never the key");
    free(text);
    td_node_auth_close(&a);
    close_all(&loop, ch, &ts);
    cr_assert_eq(budget.used, 0, "%zu bytes never given back", budget.used);
    td_node_auth_free(&a);
    td_metrics_destroy(m);
}

/* A sign hook that replays the first value it was given (what a recorder of the wire sends). */
typedef struct replayer {
    td_auth_signer_t s;
    char first[TD_AUTH_HEADER_CHARS];
} replayer_t;

static td_status_t replay_sign(void *data, const char *method, const void *req, size_t len, char *value, size_t cap)
{
    replayer_t *r = data;
    if (!r->first[0]) {
        td_status_t st = td_auth_sign(&r->s, td_auth_now_ms(), method, req, len, r->first, sizeof r->first);
        if (st != TD_OK)
            return st;
    }
    snprintf(value, cap, "%s", r->first);
    return TD_OK;
}

static int freed;
static void count_free(void *p)
{
    freed++;
}

Test(grpc_auth, cluster_secret_on_a_control_server, .timeout = 30)
{
    signal(SIGPIPE, SIG_IGN);
    td_node_auth_t a = {0};
    td_auth_cluster_config_t ccfg = td_auth_cluster_config_default();
    cr_assert_eq(td_auth_cluster_create(SECRET, strlen(SECRET), &ccfg, &a.cluster), TD_OK);
    a.prog = "test";
    strcpy(a.audience, "test"); /* the node id calls to this server are signed for */
    td_auth_cluster_t *member, *rogue;
    cr_assert_eq(td_auth_cluster_create(SECRET, strlen(SECRET), &ccfg, &member), TD_OK);
    cr_assert_eq(td_auth_cluster_create(SECRET "!", strlen(SECRET) + 1, &ccfg, &rogue), TD_OK);
    uv_loop_t loop;
    cr_assert_eq(uv_loop_init(&loop), 0);
    td_grpc_server_config_t sc = td_grpc_server_config_default();
    td_node_auth_guard_control(&a, &sc);
    test_server_t ts;
    uint16_t port = ts_start(&ts, &sc);
    cr_assert_neq(port, 0);

    td_grpc_channel_t *ok = channel(&loop, port, member);
    for (int i = 0; i < 3; i++) {
        result_t r = list_models(&loop, ok, NULL, 0);
        cr_assert_eq(r.code, TD_GRPC_OK, "call %d: %s", i, r.message);
    }
    td_grpc_channel_t *bad = channel(&loop, port, rogue);
    result_t r = list_models(&loop, bad, NULL, 0);
    cr_assert_eq(r.code, TD_GRPC_UNAUTHENTICATED);
    cr_assert(strstr(r.message, "cluster secret differs"), "%s", r.message);
    td_grpc_channel_close(bad, NULL, NULL);
    /* a member's call signed for another node */
    td_grpc_channel_config_t oc = td_grpc_channel_config_default();
    cr_assert_eq(td_node_auth_sign_channel(member, "other", &oc), TD_OK);
    td_grpc_channel_t *other;
    cr_assert_eq(td_grpc_channel_create(&loop, "127.0.0.1", port, &oc, &other), TD_OK);
    r = list_models(&loop, other, NULL, 0);
    cr_assert_eq(r.code, TD_GRPC_UNAUTHENTICATED);
    cr_assert(strstr(r.message, "another receiver than test"), "%s", r.message);
    td_grpc_channel_close(other, NULL, NULL);
    td_grpc_channel_t *open = channel(&loop, port, NULL);
    r = list_models(&loop, open, NULL, 0);
    cr_assert_eq(r.code, TD_GRPC_UNAUTHENTICATED);
    cr_assert(strstr(r.message, "no tandem-cluster-auth header"), "%s", r.message);
    td_grpc_channel_close(open, NULL, NULL);

    /* a captured signature sent again: the first passes, the copy is a replay */
    replayer_t rp = {0};
    cr_assert_eq(td_auth_signer_init(&rp.s, member, "test"), TD_OK);
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    cc.sign_header = TD_AUTH_HEADER;
    cc.sign = replay_sign;
    cc.sign_data = &rp;
    cc.sign_free = count_free;
    td_grpc_channel_t *rec;
    cr_assert_eq(td_grpc_channel_create(&loop, "127.0.0.1", port, &cc, &rec), TD_OK);
    r = list_models(&loop, rec, NULL, 0);
    cr_assert_eq(r.code, TD_GRPC_OK, "%s", r.message);
    r = list_models(&loop, rec, NULL, 0);
    cr_assert_eq(r.code, TD_GRPC_UNAUTHENTICATED);
    cr_assert(strstr(r.message, "replayed"), "%s", r.message);
    td_grpc_channel_close(rec, NULL, NULL);
    cr_assert_eq(atomic_load(&ts.handled), 4, "only the signed calls reached the handler");

    /* the channel owns sign_data, also when it cannot be created */
    cr_assert_eq(td_grpc_channel_create(&loop, "no-such-host", port, &cc, &rec), TD_ERR_INVALID);
    cr_assert_eq(freed, 1);
    close_all(&loop, ok, &ts);
    cr_assert_eq(freed, 2, "sign_free ran when the channel was freed");
    td_auth_cluster_destroy(member);
    td_auth_cluster_destroy(rogue);
    td_node_auth_free(&a);
}
