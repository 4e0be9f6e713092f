/*
 * prefill_main: the prefill node process (see prefill_node.h and docs/cluster.md).
 *
 * Threads: the loop thread owns gRPC, /metrics, the router client and td_xfer; the compute
 * thread owns the engine. A Prefill call becomes a job in a bounded queue; the compute
 * thread runs the prompt in chunks (prefix cache on), samples the first token with the
 * request's parameters, copies the request's KV blocks into a staging buffer and hands the
 * job back (uv_async_send); the loop pushes the staged layers through td_xfer into the
 * decode node's leased blocks and answers the call when the decode node adopted them.
 * Staging frees the engine's blocks at once; the price is one copy and no overlap of
 * transfer with compute yet (docs/cluster.md).
 */
#include "prefill_node.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "control.pb-c.h"
#include "router_conf.h"
#include "router_node_client.h"
#include "td_backend.h"
#include "td_engine.h"
#include "td_grpc.h"
#include "td_http.h"
#include "td_log.h"
#include "td_metrics.h"
#include "td_model.h"
#include "td_sampler.h"
#include "td_util.h"
#include "td_xfer.h"

typedef struct prefill_config {
    const char *model;
    const char *model_name;
    const char *router;
    const char *host;
    const char *node_id;
    int64_t port;
    int64_t metrics_port;
    int64_t threads;
    int64_t kv_blocks;
    int64_t chunk;          /* prompt tokens per engine step */
    int64_t max_queue;      /* jobs waiting or running at most */
    const char *log_level;
} prefill_config_t;

typedef struct prefill_job {
    struct prefill_job *next;
    struct prefill_state *s;
    td_grpc_call_t *call;      /* NULL once the caller went away */
    uint64_t key;
    uint64_t lease_id;
    int32_t *tokens;
    int32_t n_tokens;
    int32_t *dst_blocks;
    int32_t n_dst;
    td_sampling_t sampling;
    td_xfer_peer_t *peer;
    /* results (compute thread) */
    td_status_t status;
    int32_t first_token;
    int32_t cached;
    uint8_t *staging;          /* [n_layers][n_blocks][block bytes] */
    int32_t *src_blocks;       /* 0..n_blocks-1 */
    int32_t n_blocks;
    double prefill_s;
    uint64_t t_xfer;
} prefill_job_t;

typedef struct prefill_state {
    prefill_config_t cfg;
    uv_loop_t loop;
    uv_signal_t sigint, sigterm;
    uv_async_t async;
    td_model_t *model;
    td_backend_t *be;
    td_engine_t *eng;
    td_kv_layout_t layout;
    float *logits;
    td_xfer_t *xfer;
    td_grpc_server_t *grpc;
    td_http_server_t *http;
    td_metrics_t *metrics;
    td_metric_t *m_requests, *m_refused, *m_failed, *m_tokens, *m_cached, *m_seconds, *m_queue, *m_xfer_s;
    router_node_client_t *client;
    pthread_t thread;
    bool thread_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    prefill_job_t *in_head, **in_tail;
    prefill_job_t *out_head, **out_tail;
    int32_t n_jobs;            /* loop thread: jobs accepted and not yet answered */
    _Atomic int64_t queued_tokens;
    bool stop;
    bool shutting_down;
    bool handles_up;
} prefill_state_t;

static uint64_t request_key(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* ---- compute thread ---------------------------------------------------------------- */

static void compute_job(prefill_state_t *s, prefill_job_t *j)
{
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    td_sampler_t *sampler = NULL;
    uint64_t t0 = td_now_ns();
    int32_t cached = 0;
    td_status_t st = td_engine_seq_start(s->eng, &seq, j->tokens, j->n_tokens, &cached);
    if (st == TD_OK)
        st = td_sampler_create(&j->sampling, &sampler);
    for (int32_t off = cached; st == TD_OK && off < j->n_tokens;) {
        int32_t n = (int32_t)TD_MIN((int64_t)j->n_tokens - off, s->cfg.chunk);
        td_engine_item_t it = {.seq = &seq, .tokens = j->tokens + off, .n_tokens = n,
                               .n_logits = off + n == j->n_tokens};
        st = td_engine_step(s->eng, &it, 1, s->logits);
        off += n;
    }
    if (st == TD_OK) {
        for (int32_t i = 0; i < j->n_tokens; i++)
            td_sampler_accept(sampler, j->tokens[i]);
        st = td_sampler_sample(sampler, s->logits, s->model->config.vocab_size, &j->first_token);
    }
    if (st == TD_OK) {
        int32_t nb = (int32_t)TD_DIV_CEIL(j->n_tokens, (int32_t)s->layout.block_size);
        size_t bb = td_kv_block_bytes(&s->layout);
        int32_t pool_blocks;
        const uint8_t *pool = td_engine_kv_pool(s->eng, &pool_blocks);
        j->staging = malloc((size_t)s->layout.n_layers * (size_t)nb * bb);
        j->src_blocks = malloc((size_t)nb * sizeof(int32_t));
        if (!j->staging || !j->src_blocks || seq.n_blocks < nb) {
            st = td_errorf(TD_ERR_NOMEM, "prefill: cannot stage %d blocks", nb);
        } else {
            for (uint32_t l = 0; l < s->layout.n_layers; l++)
                for (int32_t b = 0; b < nb; b++)
                    memcpy(j->staging + ((size_t)l * nb + b) * bb,
                           pool + td_kv_block_offset(&s->layout, (uint32_t)pool_blocks, l, (uint32_t)seq.blocks[b]), bb);
            for (int32_t b = 0; b < nb; b++)
                j->src_blocks[b] = b;
            j->n_blocks = nb;
        }
    }
    td_sampler_destroy(sampler);
    td_engine_seq_end(s->eng, &seq);
    j->status = st;
    j->cached = cached;
    j->prefill_s = (double)(td_now_ns() - t0) * 1e-9;
    if (st == TD_OK) {
        td_metric_add(s->m_tokens, j->n_tokens - cached);
        td_metric_add(s->m_cached, cached);
        td_metric_observe(s->m_seconds, j->prefill_s);
    }
}

static void *compute_main(void *arg)
{
    prefill_state_t *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->stop && !s->in_head)
            pthread_cond_wait(&s->cv, &s->mu);
        if (s->stop) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        prefill_job_t *j = s->in_head;
        s->in_head = j->next;
        if (!s->in_head)
            s->in_tail = &s->in_head;
        pthread_mutex_unlock(&s->mu);
        compute_job(s, j);
        atomic_fetch_sub(&s->queued_tokens, j->n_tokens);
        pthread_mutex_lock(&s->mu);
        j->next = NULL;
        *s->out_tail = j;
        s->out_tail = &j->next;
        pthread_mutex_unlock(&s->mu);
        uv_async_send(&s->async);
    }
    return NULL;
}

/* ---- loop thread -------------------------------------------------------------------- */

static void job_free(prefill_job_t *j)
{
    free(j->tokens);
    free(j->dst_blocks);
    free(j->staging);
    free(j->src_blocks);
    free(j);
}

static void job_answer(prefill_job_t *j, td_status_t st, const char *why)
{
    prefill_state_t *s = j->s;
    s->n_jobs--;
    td_metric_set(s->m_queue, s->n_jobs);
    if (j->call) {
        td_grpc_call_set_data(j->call, NULL);
        if (st == TD_OK) {
            Tandem__Control__V1__PrefillResponse r = TANDEM__CONTROL__V1__PREFILL_RESPONSE__INIT;
            r.first_token = (uint32_t)j->first_token;
            r.cached_tokens = (uint32_t)j->cached;
            r.prefill_s = j->prefill_s;
            r.transfer_s = (double)(td_now_ns() - j->t_xfer) * 1e-9;
            td_metric_observe(s->m_xfer_s, r.transfer_s);
            td_grpc_call_reply(j->call, &r.base);
        } else {
            td_metric_inc(s->m_failed);
            td_grpc_call_finish(j->call, td_grpc_code_from_status(st), why);
        }
    }
    job_free(j);
}

static void on_xfer_done(void *arg, uint64_t request_id, td_status_t st)
{
    prefill_job_t *j = arg;
    char why[160];
    snprintf(why, sizeof why, "kv transfer failed: %s", td_strerror(st));
    job_answer(j, st, why);
}

static void start_transfer(prefill_state_t *s, prefill_job_t *j)
{
    if (j->status != TD_OK) {
        job_answer(j, j->status, td_strerror(j->status));
        return;
    }
    j->t_xfer = td_now_ns();
    td_xfer_send_params_t p = {.request_id = j->key, .lease_id = j->lease_id, .dst_blocks = j->dst_blocks,
                               .n_dst_blocks = j->n_dst, .n_tokens = (uint32_t)j->n_tokens,
                               .mem = TD_XFER_MEM_HOST, .done = on_xfer_done, .arg = j};
    td_xfer_send_t *send;
    td_status_t st = td_xfer_send_begin(s->xfer, j->peer, &p, &send);
    if (st != TD_OK) {
        job_answer(j, st, "kv transfer could not start");
        return;
    }
    size_t bb = td_kv_block_bytes(&s->layout);
    for (uint32_t l = 0; l < s->layout.n_layers; l++)
        td_xfer_send_layer(send, l, j->staging + (size_t)l * j->n_blocks * bb, j->src_blocks);
    td_xfer_send_finish(send, j->first_token);
}

static void on_async(uv_async_t *h)
{
    prefill_state_t *s = h->data;
    pthread_mutex_lock(&s->mu);
    prefill_job_t *list = s->out_head;
    s->out_head = NULL;
    s->out_tail = &s->out_head;
    pthread_mutex_unlock(&s->mu);
    while (list) {
        prefill_job_t *j = list;
        list = j->next;
        start_transfer(s, j);
    }
}

static void on_prefill_cancel(td_grpc_call_t *call, td_status_t why, void *call_data)
{
    prefill_job_t *j = call_data;
    if (j)
        j->call = NULL; /* the job runs on (the decode node's lease bounds it); no answer */
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, NULL);
}

static void on_prefill(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    prefill_state_t *s = data;
    const Tandem__Control__V1__PrefillRequest *r = (const void *)msg;
    const td_model_config_t *mc = &s->model->config;
    td_metric_inc(s->m_requests);
    if (s->shutting_down) {
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "prefill node shutting down");
        return;
    }
    if (r->n_tokens == 0 || r->n_tokens >= (size_t)mc->max_seq_len ||
        r->n_block_ids < (size_t)TD_DIV_CEIL((int64_t)r->n_tokens, (int64_t)s->layout.block_size)) {
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT,
                            "prefill: tokens (1 .. model length - 1) and enough block ids are required");
        return;
    }
    if (s->n_jobs >= s->cfg.max_queue) {
        td_metric_inc(s->m_refused);
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, "prefill node: queue full");
        return;
    }
    td_xfer_peer_t *peer;
    if (td_xfer_connect(s->xfer, r->decode_xfer.data, r->decode_xfer.len, &s->layout, &peer) != TD_OK) {
        td_grpc_call_finish(call, TD_GRPC_FAILED_PRECONDITION, td_last_error());
        return;
    }
    prefill_job_t *j = calloc(1, sizeof *j);
    if (!j || !(j->tokens = malloc(r->n_tokens * sizeof(int32_t))) ||
        !(j->dst_blocks = malloc(r->n_block_ids * sizeof(int32_t)))) {
        if (j)
            job_free(j);
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, "prefill node: out of memory");
        return;
    }
    j->s = s;
    for (size_t i = 0; i < r->n_tokens; i++) {
        if (r->tokens[i] >= (uint32_t)mc->vocab_size) {
            job_free(j);
            td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, "prefill: token outside the vocabulary");
            return;
        }
        j->tokens[i] = (int32_t)r->tokens[i];
    }
    j->n_tokens = (int32_t)r->n_tokens;
    for (size_t i = 0; i < r->n_block_ids; i++)
        j->dst_blocks[i] = (int32_t)r->block_ids[i];
    j->n_dst = (int32_t)r->n_block_ids;
    j->sampling = td_sampling_default();
    if (r->sampling) {
        j->sampling.temperature = r->sampling->temperature;
        j->sampling.top_k = (int32_t)r->sampling->top_k;
        j->sampling.top_p = r->sampling->top_p > 0 ? r->sampling->top_p : 1.0f;
        j->sampling.min_p = r->sampling->min_p;
        j->sampling.repetition_penalty = r->sampling->repetition_penalty > 0 ? r->sampling->repetition_penalty : 1.0f;
        j->sampling.seed = r->sampling->seed;
    }
    char why[256];
    if (td_sampling_validate(&j->sampling, why, sizeof why) != TD_OK) {
        job_free(j);
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    j->key = request_key(r->request_id);
    j->lease_id = r->lease_id;
    j->peer = peer;
    j->call = call;
    td_grpc_call_set_data(call, j);
    td_grpc_call_on_cancel(call, on_prefill_cancel);
    s->n_jobs++;
    td_metric_set(s->m_queue, s->n_jobs);
    atomic_fetch_add(&s->queued_tokens, j->n_tokens);
    pthread_mutex_lock(&s->mu);
    *s->in_tail = j;
    s->in_tail = &j->next;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void load_cb(void *data, router_node_load_t *l)
{
    prefill_state_t *s = data;
    l->queued_prefill_tokens = atomic_load(&s->queued_tokens);
    l->free_blocks = td_kv_available(td_engine_kv(s->eng)); /* racy read of one int: a hint */
}

static void shutdown_begin(prefill_state_t *s)
{
    if (s->shutting_down)
        return;
    s->shutting_down = true;
    td_info("prefill: shutting down");
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->thread_started)
        pthread_join(s->thread, NULL);
    s->thread_started = false;
    router_node_client_close(s->client);
    s->client = NULL;
    td_grpc_server_close(s->grpc, NULL, NULL);
    s->grpc = NULL;
    td_http_server_close(s->http, NULL, NULL);
    s->http = NULL;
    td_xfer_destroy(s->xfer); /* running sends end with TD_ERR_CLOSED → jobs answered */
    s->xfer = NULL;
    if (s->handles_up) {
        uv_close((uv_handle_t *)&s->async, NULL);
        uv_close((uv_handle_t *)&s->sigint, NULL);
        uv_close((uv_handle_t *)&s->sigterm, NULL);
    }
}

static void on_signal(uv_signal_t *h, int signum)
{
    shutdown_begin(h->data);
}

int prefill_main(int argc, char **argv)
{
    prefill_state_t st_, *s = &st_;
    memset(s, 0, sizeof *s);
    prefill_config_t *cfg = &s->cfg;
    *cfg = (prefill_config_t){.model_name = "default", .router = "127.0.0.1:7070", .host = "127.0.0.1",
                              .node_id = "prefill0", .kv_blocks = 1024, .chunk = 512, .max_queue = 256};
    const router_conf_key_t keys[] = {
        {"model", ROUTER_CONF_STR, &cfg->model, 0, 0, "model path (required)"},
        {"model-name", ROUTER_CONF_STR, &cfg->model_name, 0, 0, "name the router routes by"},
        {"router", ROUTER_CONF_STR, &cfg->router, 0, 0, "router control address HOST:PORT"},
        {"host", ROUTER_CONF_STR, &cfg->host, 0, 0, "address to serve on"},
        {"node-id", ROUTER_CONF_STR, &cfg->node_id, 0, 0, "unique node name"},
        {"port", ROUTER_CONF_I64, &cfg->port, 0, 65535, "control gRPC port (0 = any)"},
        {"metrics-port", ROUTER_CONF_I64, &cfg->metrics_port, 0, 65535, "/metrics port (0 = any)"},
        {"threads", ROUTER_CONF_I64, &cfg->threads, 0, 4096, "compute threads (0 = all cores)"},
        {"kv-blocks", ROUTER_CONF_I64, &cfg->kv_blocks, 1, 1 << 24, "KV pool blocks (prefix cache)"},
        {"chunk", ROUTER_CONF_I64, &cfg->chunk, 1, 1 << 16, "prompt tokens per engine step"},
        {"max-queue", ROUTER_CONF_I64, &cfg->max_queue, 1, 1 << 20, "prefill jobs waiting at most"},
        {"log-level", ROUTER_CONF_STR, &cfg->log_level, 0, 0, "error|warn|info|debug"},
    };
    int n_keys = (int)(sizeof keys / sizeof keys[0]);
    router_conf_store_t store;
    bool help;
    if (router_conf_parse("prefill", keys, n_keys, argc, argv, &store, &help) != TD_OK) {
        router_conf_free(&store);
        return 2;
    }
    if (help) {
        router_conf_usage("prefill", keys, n_keys);
        router_conf_free(&store);
        return 0;
    }
    char rhost[64];
    uint16_t rport;
    if (!cfg->model || router_conf_split_addr(cfg->router, rhost, sizeof rhost, &rport) != TD_OK ||
        (cfg->log_level && td_log_parse_level(cfg->log_level) < 0)) {
        fprintf(stderr, "tandem prefill: --model PATH and a valid --router HOST:PORT are required\n");
        router_conf_free(&store);
        return 2;
    }
    if (cfg->log_level)
        td_log_set_level((td_log_level_t)td_log_parse_level(cfg->log_level));
    int rc = 1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->in_tail = &s->in_head;
    s->out_tail = &s->out_head;
    uv_loop_init(&s->loop);

    td_status_t st;
    if ((st = td_model_load(cfg->model, &s->model)) != TD_OK)
        goto out;
    td_cpu_config_t cc = {.n_threads = (int32_t)cfg->threads};
    if ((st = td_backend_cpu_create(&cc, &s->be)) != TD_OK)
        goto out;
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = (int32_t)cfg->kv_blocks;
    ec.max_seqs = 1;
    ec.max_logit_rows = 1;
    ec.max_batch_tokens = (int32_t)cfg->chunk;
    if ((st = td_engine_create(s->model, s->be, &ec, &s->eng)) != TD_OK)
        goto out;
    s->layout = *td_engine_kv_layout(s->eng);
    if (!(s->logits = malloc((size_t)s->model->config.vocab_size * sizeof(float)))) {
        td_errorf(TD_ERR_NOMEM, "prefill: out of memory");
        goto out;
    }
    if ((st = td_metrics_create(&s->metrics)) != TD_OK)
        goto out;
    td_metrics_t *m = s->metrics;
    if ((st = td_metrics_counter(m, "tandem_prefill_requests_total", "Prefill calls received", &s->m_requests)) ||
        (st = td_metrics_counter(m, "tandem_prefill_refused_total", "Prefill calls refused (queue full)", &s->m_refused)) ||
        (st = td_metrics_counter(m, "tandem_prefill_failed_total", "Prefill calls that failed", &s->m_failed)) ||
        (st = td_metrics_counter(m, "tandem_prefill_tokens_total", "prompt tokens computed", &s->m_tokens)) ||
        (st = td_metrics_counter(m, "tandem_prefill_cached_tokens_total", "prompt tokens from the prefix cache", &s->m_cached)) ||
        (st = td_metrics_gauge(m, "tandem_prefill_queue_depth", "Prefill calls accepted and not answered", &s->m_queue)) ||
        (st = td_metrics_histogram(m, "tandem_prefill_seconds", "compute time of one prompt", td_metrics_latency_buckets,
                                   td_metrics_latency_n_buckets, &s->m_seconds)) ||
        (st = td_metrics_histogram(m, "tandem_prefill_transfer_seconds", "KV push until the decode node adopted",
                                   td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_xfer_s)))
        goto out;
    td_xfer_config_t xc = td_xfer_config_default();
    xc.name = cfg->node_id;
    xc.listen_ip = NULL;
    if ((st = td_xfer_create(&s->loop, &xc, &s->xfer)) != TD_OK)
        goto out;
    td_grpc_server_config_t gc = td_grpc_server_config_default();
    gc.host = cfg->host;
    gc.port = (uint16_t)cfg->port;
    gc.metrics = s->metrics;
    if ((st = td_grpc_server_create(&s->loop, &gc, &s->grpc)) != TD_OK ||
        (st = td_grpc_server_add_method(s->grpc, "/tandem.control.v1.PrefillNode/Prefill",
                                        &tandem__control__v1__prefill_request__descriptor, on_prefill, s)) != TD_OK)
        goto out;
    td_http_config_t hc = td_http_config_default();
    hc.host = cfg->host;
    hc.port = (uint16_t)cfg->metrics_port;
    hc.handler = td_http_metrics_handler;
    hc.handler_data = s->metrics;
    if ((st = td_http_server_create(&s->loop, &hc, &s->http)) != TD_OK)
        goto out;
    uv_async_init(&s->loop, &s->async, on_async);
    s->async.data = s;
    uv_signal_init(&s->loop, &s->sigint);
    uv_signal_init(&s->loop, &s->sigterm);
    s->sigint.data = s->sigterm.data = s;
    uv_signal_start(&s->sigint, on_signal, SIGINT);
    uv_signal_start(&s->sigterm, on_signal, SIGTERM);
    s->handles_up = true;
    if (pthread_create(&s->thread, NULL, compute_main, s) != 0) {
        td_errorf(TD_ERR_NOMEM, "prefill: cannot start the compute thread");
        goto out;
    }
    s->thread_started = true;
    router_node_client_config_t nc = {.router_host = rhost, .router_port = rport,
                                      .max_seq_len = (uint32_t)s->model->config.max_seq_len,
                                      .max_prefill_tokens = (uint32_t)cfg->chunk};
    snprintf(nc.info.id, sizeof nc.info.id, "%s", cfg->node_id);
    nc.info.role = ROUTER_ROLE_PREFILL;
    snprintf(nc.info.model, sizeof nc.info.model, "%s", cfg->model_name);
    nc.info.layout = s->layout;
    snprintf(nc.info.address, sizeof nc.info.address, "%s:%u", cfg->host, td_grpc_server_port(s->grpc));
    nc.info.capacity_blocks = (int32_t)cfg->kv_blocks;
    nc.info.max_batch = 1;
    if ((st = router_node_client_create(&s->loop, &nc, load_cb, s, &s->client)) != TD_OK)
        goto out;
    printf("prefill %s: control %s metrics http://%s:%u/metrics\n", cfg->node_id, nc.info.address, cfg->host,
           td_http_server_port(s->http));
    fflush(stdout);

    uv_run(&s->loop, UV_RUN_DEFAULT);
    rc = 0;
out:
    if (!s->shutting_down) {
        shutdown_begin(s);
        uv_run(&s->loop, UV_RUN_DEFAULT);
    }
    while (s->in_head) { /* jobs the compute thread never took: their calls were closed */
        prefill_job_t *j = s->in_head;
        s->in_head = j->next;
        job_free(j);
    }
    while (s->out_head) {
        prefill_job_t *j = s->out_head;
        s->out_head = j->next;
        job_free(j);
    }
    if (uv_loop_close(&s->loop) != 0)
        td_warn("prefill: loop closed with handles open");
    free(s->logits);
    td_engine_destroy(s->eng);
    td_backend_destroy(s->be);
    td_model_destroy(s->model);
    td_metrics_destroy(s->metrics);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    router_conf_free(&store);
    return rc;
}
