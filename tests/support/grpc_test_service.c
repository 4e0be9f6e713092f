/*
 * grpc_test_service: the gRPC tests' Generation + Health server on its own thread
 * (grpc_test_service.h).
 */
#include "grpc_test_service.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "health.pb-c.h"
#include "tandem.pb-c.h"

typedef struct bp_state {
    test_server_t *ts;
    td_grpc_call_t *call;
    int next;
} bp_state_t;

static void slow_cancel(td_grpc_call_t *call, td_status_t why, void *data)
{
    test_server_t *ts = data;
    atomic_store(&ts->cancel_reason, why);
    atomic_fetch_add(&ts->cancels, 1);
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, "gone");
}

static void bp_pump(td_grpc_call_t *call, void *data)
{
    bp_state_t *bp = data;
    Tandem__V1__GenerateResponse r = TANDEM__V1__GENERATE_RESPONSE__INIT;
    char text[96];
    uint32_t id;
    memset(text, 'x', sizeof text - 1);
    text[sizeof text - 1] = '\0';
    r.n_token_ids = 1;
    r.token_ids = &id;
    r.text = text;
    while (bp->next < BP_MESSAGES) {
        id = (uint32_t)bp->next;
        td_status_t st = td_grpc_call_send(call, &r.base);
        size_t q = td_grpc_call_queued_bytes(call);
        if (q > atomic_load(&bp->ts->bp_max_queued))
            atomic_store(&bp->ts->bp_max_queued, q);
        if (st == TD_ERR_BUSY) {
            atomic_fetch_add(&bp->ts->bp_busy, 1);
            return; /* the writable callback resumes */
        }
        if (st != TD_OK) {
            td_grpc_call_finish(call, TD_GRPC_INTERNAL, "send failed");
            free(bp);
            return;
        }
        bp->next++;
        atomic_store(&bp->ts->bp_sent, bp->next);
    }
    td_grpc_call_finish(call, TD_GRPC_OK, NULL);
    free(bp);
}

static void bp_cancel(td_grpc_call_t *call, td_status_t why, void *data)
{
    free(data);
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, NULL);
}

static void handle_generate(td_grpc_call_t *call, const ProtobufCMessage *request, void *data)
{
    test_server_t *ts = data;
    const Tandem__V1__GenerateRequest *req = (const Tandem__V1__GenerateRequest *)request;
    atomic_fetch_add(&ts->handled, 1);
    if (strcmp(req->prompt, "slow") == 0) {
        td_grpc_call_set_data(call, ts);
        td_grpc_call_on_cancel(call, slow_cancel);
        return;
    }
    if (strncmp(req->prompt, "echo:", 5) == 0) {
        Tandem__V1__GenerateResponse r = TANDEM__V1__GENERATE_RESPONSE__INIT;
        r.text = req->prompt;
        td_grpc_call_reply(call, &r.base);
        return;
    }
    if (strcmp(req->prompt, "overflow") == 0) {
        Tandem__V1__GenerateResponse r = TANDEM__V1__GENERATE_RESPONSE__INIT;
        uint32_t id = 7;
        r.n_token_ids = 1;
        r.token_ids = &id;
        r.text = "overflowing";
        for (int i = 0; i < BP_MESSAGES && td_grpc_call_send(call, &r.base) == TD_OK; i++)
            ;
        atomic_store(&ts->ov_queued, td_grpc_call_queued_bytes(call));
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, "client too slow");
        return;
    }
    if (strcmp(req->prompt, "stats") == 0) {
        Tandem__V1__GenerateResponse r = TANDEM__V1__GENERATE_RESPONSE__INIT;
        td_grpc_server_stats_t st = td_grpc_server_stats(ts->srv);
        char text[64];
        snprintf(text, sizeof text, "calls %u queued %zu", st.open_calls, st.queued_bytes);
        r.text = text;
        td_grpc_call_reply(call, &r.base);
        return;
    }
    if (strcmp(req->prompt, "backpressure") == 0) {
        bp_state_t *bp = calloc(1, sizeof *bp);
        bp->ts = ts;
        bp->call = call;
        td_grpc_call_set_data(call, bp);
        td_grpc_call_on_cancel(call, bp_cancel);
        td_grpc_call_on_writable(call, bp_pump);
        bp_pump(call, bp);
        return;
    }
    for (uint32_t i = 0; i < req->max_tokens; i++) {
        Tandem__V1__GenerateResponse r = TANDEM__V1__GENERATE_RESPONSE__INIT;
        Tandem__V1__Usage usage = TANDEM__V1__USAGE__INIT;
        uint32_t id = 1000 + i;
        char text[32];
        snprintf(text, sizeof text, "t%u ", i);
        r.n_token_ids = 1;
        r.token_ids = &id;
        r.text = text;
        if (i + 1 == req->max_tokens) {
            r.finish_reason = TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH;
            usage.prompt_tokens = (uint32_t)req->n_prompt_ids;
            usage.completion_tokens = req->max_tokens;
            r.usage = &usage;
            r.request_id = req->request_id;
        }
        if (td_grpc_call_send(call, &r.base) != TD_OK) {
            td_grpc_call_finish(call, TD_GRPC_INTERNAL, "send failed");
            return;
        }
    }
    td_grpc_call_finish(call, TD_GRPC_OK, NULL);
}

static void handle_list_models(td_grpc_call_t *call, const ProtobufCMessage *request, void *data)
{
    test_server_t *ts = data;
    atomic_fetch_add(&ts->handled, 1);
    Tandem__V1__ListModelsResponse r = TANDEM__V1__LIST_MODELS_RESPONSE__INIT;
    Tandem__V1__ModelInfo m = TANDEM__V1__MODEL_INFO__INIT;
    Tandem__V1__ModelInfo *models[1] = {&m};
    m.name = "stories-test";
    m.vocab_size = 512;
    r.n_models = 1;
    r.models = models;
    td_grpc_call_reply(call, &r.base);
}

static void handle_health(td_grpc_call_t *call, const ProtobufCMessage *request, void *data)
{
    const Grpc__Health__V1__HealthCheckRequest *req =
        (const Grpc__Health__V1__HealthCheckRequest *)request;
    if (req->service[0] && strcmp(req->service, "tandem.v1.Generation") != 0) {
        td_grpc_call_finish(call, TD_GRPC_NOT_FOUND, "unknown service");
        return;
    }
    Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    r.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    td_grpc_call_reply(call, &r.base);
}

static void ts_closed(void *data)
{
    (void)data;
}

static td_status_t ts_open(uv_loop_t *loop, void *data)
{
    test_server_t *ts = data;
    td_status_t st = td_grpc_server_create(loop, &ts->cfg, &ts->srv);
    if (st != TD_OK)
        return st;
    ts->port = td_grpc_server_port(ts->srv);
    td_grpc_server_add_method(ts->srv, "/tandem.v1.Generation/Generate", &tandem__v1__generate_request__descriptor,
                              handle_generate, ts);
    td_grpc_server_add_method(ts->srv, "/tandem.v1.Generation/ListModels",
                              &tandem__v1__list_models_request__descriptor, handle_list_models, ts);
    td_grpc_server_add_method(ts->srv, "/grpc.health.v1.Health/Check",
                              &grpc__health__v1__health_check_request__descriptor, handle_health, ts);
    return TD_OK;
}

static void ts_close(void *data)
{
    test_server_t *ts = data;
    td_grpc_server_close(ts->srv, ts_closed, ts);
}

uint16_t ts_start(test_server_t *ts, const td_grpc_server_config_t *cfg)
{
    memset(ts, 0, sizeof *ts);
    ts->cfg = *cfg;
    return td_test_loop_start(&ts->l, ts_open, ts_close, ts) == TD_OK ? ts->port : 0;
}

int ts_stop(test_server_t *ts)
{
    return td_test_loop_stop(&ts->l);
}
