/*
 * test_xfer_metrics: td_metrics collectors, and a node's td_xfer statistics on /metrics
 * (td_node_xfer_metrics): after leases are created, cancelled and expired on a real
 * receiver, the rendered text carries the same counts as td_xfer_get_stats, rendering
 * twice does not count twice, and gauges follow the lease count down.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "td_node_xfer_metrics.h"
#include "td_kv.h"
#include "td_metrics.h"
#include "td_util.h"
#include "td_xfer.h"
#include "td_xfer_testkit.h"

static const td_kv_layout_t LAYOUT = {.model_fingerprint = 0x77u,
                                      .dtype = TD_F16,
                                      .block_size = 4,
                                      .n_layers = 2,
                                      .n_kv_heads = 1,
                                      .head_dim = 8,
                                      .version = TD_KV_LAYOUT_VERSION};

static char *render(td_metrics_t *reg)
{
    char *text;
    size_t len;
    cr_assert_eq(td_metrics_render(reg, &text, &len), TD_OK);
    return text;
}

/* The value of the series whose line starts with `series` + " " (-1 if absent). */
static double series_value(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (!strncmp(p, series, n) && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return -1;
}

static void count_calls(void *arg)
{
    int *n = arg;
    (*n)++;
}

Test(metrics_collector, runs_before_every_render_and_is_bounded)
{
    td_metrics_t *reg;
    cr_assert_eq(td_metrics_create(&reg), TD_OK);
    int calls = 0;
    cr_assert_eq(td_metrics_add_collector(reg, count_calls, &calls), TD_OK);
    free(render(reg));
    free(render(reg));
    cr_expect_eq(calls, 2);
    cr_expect_eq(td_metrics_add_collector(reg, NULL, NULL), TD_ERR_INVALID);
    for (int i = 1; i < TD_METRICS_MAX_COLLECTORS; i++)
        cr_assert_eq(td_metrics_add_collector(reg, count_calls, &calls), TD_OK);
    cr_expect_eq(td_metrics_add_collector(reg, count_calls, &calls), TD_ERR_RANGE);
    calls = 0;
    free(render(reg));
    cr_expect_eq(calls, TD_METRICS_MAX_COLLECTORS);
    td_metrics_destroy(reg);
}

Test(xfer_metrics, leases_and_counters_on_metrics, .timeout = 30)
{
    td_xfer_testkit_env("tcp");
    uv_loop_t loop;
    uv_loop_init(&loop);
    td_kv_config_t kc = {.n_blocks = 32, .block_size = (int32_t)LAYOUT.block_size};
    td_kv_cache_t *kv;
    cr_assert_eq(td_kv_cache_create(&kc, &kv), TD_OK);
    td_xfer_config_t cfg = td_xfer_config_default();
    td_xfer_t *x;
    cr_assert_eq(td_xfer_create(&loop, &cfg, &x), TD_OK, "%s", td_last_error());
    td_xfer_pool_t pool = {.layout = LAYOUT, .n_blocks = 32, .kv = kv};
    cr_assert_eq(td_xfer_register_pool(x, &pool, NULL, NULL), TD_OK, "%s", td_last_error());
    td_metrics_t *reg;
    cr_assert_eq(td_metrics_create(&reg), TD_OK);
    td_node_xfer_metrics_t m;
    cr_assert_eq(td_node_xfer_metrics_init(&m, reg, x), TD_OK, "%s", td_last_error());

    int32_t blocks[8];
    uint64_t a, b, c;
    td_xfer_token_t tok;
    cr_assert_eq(td_xfer_lease_create(x, 1, 4, 60000, blocks, &a, &tok), TD_OK);
    cr_assert_eq(td_xfer_lease_create(x, 2, 4, 60000, blocks, &b, &tok), TD_OK);
    cr_assert_eq(td_xfer_lease_create(x, 3, 2, 1, blocks, &c, &tok), TD_OK);
    cr_assert_eq(td_xfer_lease_cancel(x, a), TD_OK);
    double end = td_now_s() + 5;
    td_xfer_stats_t st;
    do {
        uv_run(&loop, UV_RUN_NOWAIT);
        td_xfer_get_stats(x, &st);
    } while (st.leases_expired == 0 && td_now_s() < end);
    cr_assert_eq(st.leases_expired, 1);

    for (int round = 0; round < 2; round++) { /* a second render must not add again */
        char *t = render(reg);
        cr_expect_eq(series_value(t, "tandem_kvxfer_leases_live"), 1, "%s", t);
        cr_expect_eq(series_value(t, "tandem_kvxfer_leases_total{outcome=\"created\"}"), 3, "%s", t);
        cr_expect_eq(series_value(t, "tandem_kvxfer_leases_total{outcome=\"cancelled\"}"), 1);
        cr_expect_eq(series_value(t, "tandem_kvxfer_leases_total{outcome=\"expired\"}"), 1);
        cr_expect_eq(series_value(t, "tandem_kvxfer_leases_total{outcome=\"adopted\"}"), 0);
        cr_expect_eq(series_value(t, "tandem_kvxfer_failures_total{cause=\"peer_lost\"}"), 0);
        cr_expect_eq(series_value(t, "tandem_kvxfer_sent_bytes_total"), 0);
        cr_expect(strstr(t, "# TYPE tandem_kvxfer_leases_total counter") != NULL);
        cr_expect(strstr(t, "# TYPE tandem_kvxfer_leases_live gauge") != NULL);
        free(t);
    }
    cr_assert_eq(td_xfer_lease_cancel(x, b), TD_OK);
    char *t = render(reg);
    cr_expect_eq(series_value(t, "tandem_kvxfer_leases_live"), 0, "a gauge follows the count down");
    cr_expect_eq(series_value(t, "tandem_kvxfer_leases_total{outcome=\"cancelled\"}"), 2);
    free(t);

    td_metrics_destroy(reg);
    td_xfer_destroy(x);
    uv_run(&loop, UV_RUN_DEFAULT); /* td_xfer's shutdown runs on the loop until its handles close */
    uv_loop_close(&loop);
    td_kv_cache_destroy(kv);
}
