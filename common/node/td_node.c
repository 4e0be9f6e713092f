/*
 * td_node: config, addresses, loop, signals, /metrics, registration and shutdown of a
 * cluster process (see td_node.h).
 */
#include "td_node.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "health.pb-c.h"
#include "td_constrain.h"
#include "td_log.h"
#include "td_progress.h"
#include "td_util.h"

bool td_node_is_wildcard(const char *host)
{
    return !host || !host[0] || !strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !strcmp(host, "[::]");
}

bool td_node_is_loopback(const char *host)
{
    unsigned char a[16];
    if (!host)
        return false;
    if (uv_inet_pton(AF_INET, host, a) == 0)
        return a[0] == 127;
    const char *h = host;
    char buf[64];
    size_t n = strlen(host);
    if (n >= 2 && host[0] == '[' && host[n - 1] == ']' && n - 2 < sizeof buf) {
        memcpy(buf, host + 1, n - 2);
        buf[n - 2] = '\0';
        h = buf;
    }
    static const unsigned char one[16] = {[15] = 1};
    return uv_inet_pton(AF_INET6, h, a) == 0 && !memcmp(a, one, sizeof one);
}

/* The control plane open (no cluster secret) on an address other machines reach: who can
 * connect can register as a node and be sent prompts (router), or call Admit, Prefill and
 * Drain (node). Refused unless --insecure says it is meant (Redis's protected mode). */
static td_status_t check_open_control_plane(const td_node_t *p)
{
    const td_node_config_t *c = &p->cfg;
    if (c->cluster_secret_file || td_node_is_loopback(c->host) || c->insecure)
        return TD_OK;
    return td_errorf(TD_ERR_INVALID,
                     "%s: --host %s is not a loopback address and no --cluster-secret-file is given: anyone who "
                     "reaches it could %s. Give the router and every node the same secret (openssl rand -hex 32 > "
                     "FILE; chmod 600 FILE; --cluster-secret-file FILE), or bind to 127.0.0.1, or pass --insecure "
                     "(config key insecure = true) to run the control plane open on a network you trust",
                     p->spec.prog, c->host,
                     p->spec.kind == TD_NODE_NODE ? "call this node's Admit, Prefill, Steps and Drain"
                                                  : "register as a node and be sent prompts and KV addresses");
}

/* Checks what the table cannot: log level, a node's model and router, the address rule. */
static td_status_t validate(td_node_t *p)
{
    td_node_config_t *c = &p->cfg;
    const char *prog = p->spec.prog;
    if (c->log_level && td_log_parse_level(c->log_level) < 0)
        return td_errorf(TD_ERR_INVALID, "%s: --log-level '%s' is not error|warn|info|debug", prog, c->log_level);
    if (p->spec.kind == TD_NODE_NODE) {
        if (!c->model)
            return td_errorf(TD_ERR_INVALID, "%s: --model PATH is required", prog);
        if (td_node_conf_split_addr(c->router, p->router_host, sizeof p->router_host, &p->router_port) != TD_OK)
            return td_errorf(TD_ERR_INVALID, "%s: --router '%s' is not a valid HOST:PORT", prog, c->router);
        if (td_device_parse(c->device ? c->device : "cpu", &p->device) != TD_OK)
            return TD_ERR_INVALID;
        p->dtype = -1;
        if (c->dtype) {
            td_dtype_t t;
            if (td_dtype_parse_flag(c->dtype, &t) != TD_OK)
                return TD_ERR_INVALID;
            p->dtype = (int)t;
        }
        p->quant = -1;
        if (c->quant) {
            td_dtype_t t;
            if (td_dtype_parse_quant_flag(c->quant, &t) != TD_OK)
                return TD_ERR_INVALID;
            p->quant = (int)t;
        }
        p->kv_dtype = -1;
        if (c->kv_dtype) {
            td_dtype_t t;
            if (td_dtype_parse_kv_flag(c->kv_dtype, &t) != TD_OK)
                return TD_ERR_INVALID;
            p->kv_dtype = (int)t;
        }
    }
    if (td_node_is_wildcard(c->host) && !c->advertise)
        return td_errorf(TD_ERR_INVALID,
                         "%s: --host '%s' listens on every interface, which is no address peers can "
                         "reach: pass --advertise HOST (this machine's address as the other processes see it)",
                         prog, c->host ? c->host : "");
    if (c->advertise && td_node_is_wildcard(c->advertise))
        return td_errorf(TD_ERR_INVALID, "%s: --advertise '%s' is a wildcard; give the address peers reach "
                         "this process at", prog, c->advertise);
    if (!c->advertise)
        c->advertise = c->host;
    return check_open_control_plane(p);
}

bool td_node_configure(td_node_t *p, const td_node_spec_t *spec, const td_opt_t *keys, int n_keys,
                       int argc, char **argv, int *exit_p)
{
    TD_ASSERT(spec->prog && spec->on_shutdown);
    p->spec = *spec;
    td_node_config_t *c = &p->cfg;
    if (!c->host)
        c->host = "127.0.0.1";
    if (!c->model_name)
        c->model_name = "default";
    if (spec->kind == TD_NODE_NODE) {
        if (!c->router)
            c->router = "127.0.0.1:7070";
        if (!c->node_id) {
            snprintf(p->default_id, sizeof p->default_id, "%s0", spec->prog);
            c->node_id = p->default_id;
        }
        if (!c->drain_timeout_ms)
            c->drain_timeout_ms = TD_NODE_DRAIN_TIMEOUT_MS;
        TD_ASSERT(spec->busy);
    }
    bool node = spec->kind == TD_NODE_NODE;
    if (td_node_conf_parse(spec->prog, c, node, keys, n_keys, argc, argv, &p->conf) != TD_OK) {
        *exit_p = 2;
        goto err_conf;
    }
    if (p->conf.help) {
        *exit_p = 0;
        goto err_conf;
    }
    if (validate(p) != TD_OK) {
        *exit_p = 2;
        goto err_conf;
    }
    if (c->check_config) { /* the files it names belong to where it runs: not opened here */
        printf("%s: config ok\n", spec->prog);
        *exit_p = 0;
        goto err_conf;
    }
    if (c->log_level)
        td_log_set_level((td_log_level_t)td_log_parse_level(c->log_level));
    p->fd_limit = td_fd_limit_raise(); /* before any thread or socket: the caps assume it */
    td_info("%s: open-file limit %ld", spec->prog, p->fd_limit);
    if (!c->cluster_secret_file && !td_node_is_loopback(c->host)) /* --insecure: said at every start */
        td_warn("%s: INSECURE: the control plane on %s is open to anyone who reaches it (--insecure, no "
                "--cluster-secret-file): a stranger can %s; give every process --cluster-secret-file FILE",
                spec->prog, c->host,
                node ? "call this node's Admit, Prefill, Steps and Drain" : "register as a node and be sent prompts");
    if (td_node_auth_load(&p->auth, spec->prog, node ? c->node_id : TD_NODE_AUTH_ROUTER, c->api_keys_file,
                          c->cluster_secret_file) != TD_OK) {
        *exit_p = 2;
        goto err_conf;
    }
    uv_loop_init(&p->loop);
    p->loop_up = true;
    return true;
err_conf:
    td_opts_result_free(&p->conf);
    return false;
}

/* SIGINT stops at once; a node's first SIGTERM drains it (what Kubernetes, systemd and
 * Slurm send before their kill), a second one stops it. */
static void on_signal(uv_signal_t *h, int signum)
{
    td_node_t *p = h->data;
    if (signum == SIGTERM && p->spec.kind == TD_NODE_NODE && !p->draining) {
        td_info("%s: SIGTERM: draining (a second SIGTERM or SIGINT stops at once)", p->spec.prog);
        td_node_drain(p, 0);
        return;
    }
    td_node_shutdown(p);
}

static void on_drain_tick(uv_timer_t *t)
{
    td_node_t *p = t->data;
    if (p->shutting_down)
        return;
    int32_t busy = p->spec.busy(p->spec.data);
    uint64_t now = td_now_ns();
    double s = (double)(now - p->drain_start_ns) * 1e-9;
    /* an idle node still waits (TD_NODE_DRAIN_TELL_MS at most) until the router heard it, so
       that it stops choosing the node before its calls would find it gone */
    bool told = td_node_client_drain_told(p->client) || now - p->drain_start_ns > TD_NODE_DRAIN_TELL_MS * 1000000ull;
    if ((busy > 0 || !told) && now < p->drain_end_ns)
        return;
    if (busy > 0)
        td_warn("%s %s: drain timeout (%.1f s) passed with %d requests still running; exiting anyway", p->spec.prog,
                p->cfg.node_id, s, busy);
    else
        td_info("%s %s: drained in %.2f s; exiting", p->spec.prog, p->cfg.node_id, s);
    td_node_shutdown(p);
}

void td_node_drain(td_node_t *p, uint32_t timeout_ms)
{
    TD_ASSERT(p->spec.kind == TD_NODE_NODE);
    if (p->draining || p->shutting_down)
        return;
    p->draining = true;
    uint64_t ms = (uint64_t)p->cfg.drain_timeout_ms;
    if (timeout_ms && timeout_ms < ms)
        ms = timeout_ms;
    p->drain_start_ns = td_now_ns();
    p->drain_end_ns = p->drain_start_ns + ms * 1000000ull;
    td_info("%s %s: draining: no new requests; %d running; exit once they finish or in %.1f s", p->spec.prog,
            p->cfg.node_id, p->spec.busy(p->spec.data), (double)ms * 1e-3);
    td_node_client_drain(p->client); /* the router hears it now, not at the next heartbeat */
    uv_timer_init(&p->loop, &p->drain_timer);
    p->drain_timer.data = p;
    p->drain_timer_up = true;
    uv_timer_start(&p->drain_timer, on_drain_tick, 0, TD_NODE_DRAIN_POLL_MS);
}

bool td_node_draining(const td_node_t *p)
{
    return p->draining;
}

bool td_node_take_or_refuse(const td_node_t *p, td_grpc_call_t *call, td_metric_t *refused, const char *what,
                            int64_t pending, int64_t cap, const char *full)
{
    char why[160];
    if (td_node_draining(p)) {
        td_metric_inc(refused);
        snprintf(why, sizeof why, "%s draining: it takes no new request", what);
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, why);
        return false;
    }
    if (pending >= cap) {
        td_metric_inc(refused);
        snprintf(why, sizeof why, "%s: %s", what, full);
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, why);
        return false;
    }
    return true;
}

static void on_health(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    td_node_t *p = data;
    const Grpc__Health__V1__HealthCheckRequest *q = (const void *)msg;
    const char *svc = q->service ? q->service : "";
    bool ready = !p->shutting_down && !p->draining && td_node_client_registered(p->client);
    if (!strcmp(svc, "liveness")) {
        ready = !p->shutting_down;
    } else if (svc[0] && strcmp(svc, "tandem.control.v1.DecodeNode") && strcmp(svc, "tandem.control.v1.PrefillNode") &&
               strcmp(svc, "tandem.control.v1.Node")) {
        td_grpc_call_finish(call, TD_GRPC_NOT_FOUND,
                            "health: unknown service (\"\" or a node service: ready; \"liveness\": alive)");
        return;
    }
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = ready ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                        : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
    td_grpc_call_reply(call, &resp.base);
}

static void on_drain_call(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    td_node_t *p = data;
    const Tandem__Control__V1__DrainRequest *q = (const void *)msg;
    if (!p->draining)
        td_info("%s %s: Drain called", p->spec.prog, p->cfg.node_id);
    td_node_drain(p, q->timeout_ms);
    Tandem__Control__V1__DrainResponse resp = TANDEM__CONTROL__V1__DRAIN_RESPONSE__INIT;
    resp.requests = (uint32_t)TD_MAX(p->spec.busy(p->spec.data), 0);
    resp.timeout_ms = (uint32_t)((p->drain_end_ns - p->drain_start_ns) / 1000000ull);
    td_grpc_call_reply(call, &resp.base);
}

td_status_t td_node_serve_control(td_node_t *p, td_grpc_server_t *srv)
{
    const td_grpc_method_t methods[] = {
        {TD_NODE_AUTH_HEALTH_CHECK, &grpc__health__v1__health_check_request__descriptor, on_health},
        {"/tandem.control.v1.Node/Drain", &tandem__control__v1__drain_request__descriptor, on_drain_call},
    };
    return td_grpc_server_add_methods(srv, methods, TD_ARRAY_LEN(methods), p);
}

td_status_t td_node_serve(td_node_t *p, td_metrics_t *metrics)
{
    TD_ASSERT(p->loop_up);
    if (!p->signals_up) {
        uv_signal_init(&p->loop, &p->sigint);
        uv_signal_init(&p->loop, &p->sigterm);
        p->sigint.data = p->sigterm.data = p;
        uv_signal_start(&p->sigint, on_signal, SIGINT);
        uv_signal_start(&p->sigterm, on_signal, SIGTERM);
        p->signals_up = true;
    }
    if (!p->loop_metrics) {
        td_status_t st = td_metrics_loop_start(&p->loop, metrics, &p->loop_metrics);
        if (st != TD_OK)
            return st;
    }
    td_status_t st = td_node_auth_serve(&p->auth, &p->loop, metrics);
    if (st != TD_OK)
        return st;
    td_http_config_t hc = td_http_config_default();
    hc.host = p->cfg.host;
    hc.port = (uint16_t)p->cfg.metrics_port;
    hc.handler = td_http_metrics_handler;
    hc.handler_data = metrics;
    hc.metrics = metrics; /* connections it closes, by reason */
    return td_http_server_create(&p->loop, &hc, &p->http);
}

uint16_t td_node_metrics_port(const td_node_t *p)
{
    return p->http ? td_http_server_port(p->http) : 0;
}

td_status_t td_node_register(td_node_t *p, td_node_client_config_t *nc, uint16_t control_port,
                                 td_node_load_cb load_cb, void *data)
{
    TD_ASSERT(p->spec.kind == TD_NODE_NODE);
    const td_node_config_t *c = &p->cfg;
    nc->router_host = p->router_host;
    nc->router_port = p->router_port;
    snprintf(nc->info.id, sizeof nc->info.id, "%s", c->node_id);
    snprintf(nc->info.model, sizeof nc->info.model, "%s", c->model_name);
    /* an IPv6 literal needs brackets before the port */
    bool v6 = strchr(c->advertise, ':') && c->advertise[0] != '[';
    snprintf(nc->info.address, sizeof nc->info.address, v6 ? "[%s]:%u" : "%s:%u", c->advertise, control_port);
    snprintf(p->address, sizeof p->address, "%s", nc->info.address);
    nc->cluster = p->auth.cluster;
    td_status_t st = td_node_client_create(&p->loop, nc, load_cb, data, &p->client);
    if (st != TD_OK)
        return st;
    printf("%s %s: control %s metrics http://%s:%u/metrics\n", p->spec.prog, c->node_id, p->address,
           c->advertise, td_node_metrics_port(p));
    fflush(stdout);
    return TD_OK;
}

td_status_t td_node_load_model(td_node_t *p, td_model_t **model_p, td_backend_t **be_p)
{
    TD_ASSERT(p->spec.kind == TD_NODE_NODE);
    td_model_t *model;
    td_backend_t *be;
    /* phase lines past a second (never rewritten in place: the nodes of `tandem local` share
       its terminal) */
    td_progress_t prog;
    td_progress_init(&prog, p->spec.prog, 0, 1.0);
    prog.tty = false;
    td_status_t st = td_model_load(p->cfg.model, &model);
    if (st != TD_OK)
        return st;
    td_progress_phase(&prog, 1, 3, "model read");
    if (p->cfg.ctx_size > model->config.max_seq_len)
        td_warn("%s: --ctx-size %lld is longer than the model's %d tokens: serving %d", p->spec.prog,
                (long long)p->cfg.ctx_size, model->config.max_seq_len, model->config.max_seq_len);
    else if (p->cfg.ctx_size > 0) /* before anything is sized from it: pools, admission, registration */
        model->config.max_seq_len = (int32_t)p->cfg.ctx_size;
    /* the weights resident before the node registers, not faulted in by its first request */
    uint64_t t0 = td_now_ns();
    if (td_model_populate(model, td_cpu_count()) == TD_OK)
        td_info("%s: model weights resident in %.2f s", p->spec.prog, (double)(td_now_ns() - t0) * 1e-9);
    else
        td_warn("%s: model weights not made resident (%s); they load as first used", p->spec.prog, td_last_error());
    td_progress_phase(&prog, 2, 3, "weights resident");
    if (p->dtype < 0)
        p->dtype = td_device_default_dtype(&p->device, model->config.dtype);
    if ((st = td_backend_open(&p->device, (int32_t)p->cfg.threads, p->dtype < 0 ? TD_F32 : (td_dtype_t)p->dtype,
                              &be)) != TD_OK)
        goto err_model;
    td_progress_phase(&prog, 3, 3, "backend");
    *model_p = model;
    *be_p = be;
    return TD_OK;
err_model:
    td_model_destroy(model);
    return st;
}

td_status_t td_node_plan_kv(const td_node_t *p, const td_model_t *model, const td_engine_config_t *ec,
                                const td_kv_plan_params_t *pp, int64_t *n_blocks_p, size_t *pool_bytes_p)
{
    td_kv_plan_t plan;
    td_status_t st = td_engine_kv_plan(model, ec, pp, &plan);
    if (st != TD_OK)
        return st;
    fprintf(stderr, "%s %s: kv pool %s\n", p->spec.prog, p->cfg.node_id, plan.line);
    *n_blocks_p = plan.n_blocks;
    *pool_bytes_p = plan.pool_bytes;
    return TD_OK;
}

td_engine_config_t td_node_engine_config(const td_node_t *p)
{
    td_engine_config_t ec = td_engine_config_default();
    td_engine_config_set_dtype(&ec, p->dtype, p->quant, p->kv_dtype);
    return ec;
}

/* Where sampling field d lives in a SamplingParams: the proto field of the same name, of the
 * wire type that matches d's (TD_SAMPLING_FIELDS' .wire rows; test_node checks the pairing
 * both ways). */
static size_t wire_offset(const td_sampling_field_desc_t *d)
{
    const ProtobufCFieldDescriptor *pf = protobuf_c_message_descriptor_get_field_by_name(
        &tandem__v1__sampling_params__descriptor, d->name);
    TD_ASSERT(pf && pf->label == PROTOBUF_C_LABEL_NONE);
    TD_ASSERT((d->type == TD_SAMPLING_F32 && pf->type == PROTOBUF_C_TYPE_FLOAT) ||
              (d->type == TD_SAMPLING_I32 && pf->type == PROTOBUF_C_TYPE_UINT32) ||
              (d->type == TD_SAMPLING_U64 && pf->type == PROTOBUF_C_TYPE_UINT64));
    return pf->offset;
}

td_sampling_t td_node_sampling_from_proto(const Tandem__V1__SamplingParams *p)
{
    td_sampling_t s = td_sampling_default();
    if (!p)
        return s;
    for (int f = TD_SAMPLING_FIELD_NONE + 1; f < TD_SAMPLING_FIELD_END; f++) {
        const td_sampling_field_desc_t *d = td_sampling_field_desc((td_sampling_field_t)f);
        if (!d->wire)
            continue;
        const void *w = (const char *)p + wire_offset(d);
        void *v = td_sampling_field_ptr(&s, d);
        switch (d->type) { /* 0 is unset: the default stays */
        case TD_SAMPLING_F32:
            if (*(const float *)w != 0.0f)
                *(float *)v = *(const float *)w;
            break;
        case TD_SAMPLING_I32: /* uint32 on the wire: past INT32_MAX as INT32_MAX */
            if (*(const uint32_t *)w != 0)
                *(int32_t *)v = (int32_t)TD_MIN(*(const uint32_t *)w, (uint32_t)INT32_MAX);
            break;
        case TD_SAMPLING_U64:
            if (*(const uint64_t *)w != 0)
                *(uint64_t *)v = *(const uint64_t *)w;
            break;
        }
    }
    /* the logit bias: refused by td_sampling_check_bias when the lists differ or are too long */
    if (p->n_logit_bias_ids != p->n_logit_bias) {
        s.n_logit_bias = -1;
    } else {
        s.n_logit_bias = (int32_t)TD_MIN(p->n_logit_bias_ids, (size_t)INT32_MAX);
        for (size_t i = 0; i < TD_MIN(p->n_logit_bias_ids, (size_t)TD_SAMPLING_MAX_LOGIT_BIAS); i++) {
            s.logit_bias_ids[i] = (int32_t)TD_MIN(p->logit_bias_ids[i], (uint32_t)INT32_MAX);
            s.logit_bias[i] = p->logit_bias[i];
        }
    }
    return s;
}

void td_node_sampling_to_proto(const td_sampling_t *s, Tandem__V1__SamplingParams *p)
{
    tandem__v1__sampling_params__init(p);
    for (int f = TD_SAMPLING_FIELD_NONE + 1; f < TD_SAMPLING_FIELD_END; f++) {
        const td_sampling_field_desc_t *d = td_sampling_field_desc((td_sampling_field_t)f);
        if (!d->wire)
            continue;
        void *w = (char *)p + wire_offset(d);
        const void *v = (const char *)s + d->offset;
        switch (d->type) {
        case TD_SAMPLING_F32: *(float *)w = *(const float *)v; break;
        case TD_SAMPLING_I32: *(uint32_t *)w = (uint32_t)*(const int32_t *)v; break;
        case TD_SAMPLING_U64: *(uint64_t *)w = *(const uint64_t *)v; break;
        }
    }
    if (s->n_logit_bias > 0) { /* borrowed from s: same width, int32_t ids >= 0 read as uint32 */
        p->n_logit_bias_ids = p->n_logit_bias = (size_t)s->n_logit_bias;
        p->logit_bias_ids = (uint32_t *)s->logit_bias_ids;
        p->logit_bias = (float *)s->logit_bias;
    }
}

td_status_t td_node_logprobs_from_proto(const Tandem__V1__LogprobsRequest *p, td_logprobs_want_t *w,
                                        char *why, size_t why_cap)
{
    *w = (td_logprobs_want_t){0};
    if (!p)
        return TD_OK;
    if (p->top_logprobs > TD_LOGPROBS_MAX_TOP) {
        char msg[96];
        snprintf(msg, sizeof msg, "top_logprobs %u is out of range [0, %d]", p->top_logprobs, TD_LOGPROBS_MAX_TOP);
        if (why && why_cap)
            snprintf(why, why_cap, "%s", msg);
        return td_errorf_quiet(TD_ERR_INVALID, "%s", msg);
    }
    *w = (td_logprobs_want_t){.on = true, .top = (int32_t)p->top_logprobs, .prompt = p->prompt};
    return TD_OK;
}

void td_node_logprobs_to_proto(const td_logprobs_want_t *w, Tandem__V1__LogprobsRequest *p)
{
    tandem__v1__logprobs_request__init(p);
    p->top_logprobs = (uint32_t)TD_MAX(w->top, 0);
    p->prompt = w->prompt;
}

void td_node_logprob_to_proto(const td_token_logprob_t *lp, td_node_logprob_msg_t *out)
{
    tandem__v1__token_logprob__init(&out->m);
    out->m.token_id = (uint32_t)lp->token;
    out->m.logprob = lp->logprob;
    int32_t n = TD_MIN(TD_MAX(lp->n_top, 0), TD_LOGPROBS_MAX_TOP);
    for (int32_t i = 0; i < n; i++) {
        tandem__v1__top_logprob__init(&out->top[i]);
        out->top[i].token_id = (uint32_t)lp->top[i].token;
        out->top[i].logprob = lp->top[i].logprob;
        out->ptrs[i] = &out->top[i];
    }
    out->m.top = n ? out->ptrs : NULL;
    out->m.n_top = (size_t)n;
}

td_status_t td_node_logprobs_to_proto_array(const td_token_logprob_t *lps, size_t n,
                                            Tandem__V1__TokenLogprob ***msgs_p, void **mem_p)
{
    size_t n_top = 0;
    for (size_t i = 0; i < n; i++)
        n_top += (size_t)TD_MIN(TD_MAX(lps[i].n_top, 0), TD_LOGPROBS_MAX_TOP);
    /* pointers first, then the messages: every part stays aligned for its type */
    size_t bytes = n * sizeof(Tandem__V1__TokenLogprob *) + n_top * sizeof(Tandem__V1__TopLogprob *) +
                   n * sizeof(Tandem__V1__TokenLogprob) + n_top * sizeof(Tandem__V1__TopLogprob);
    char *mem = malloc(TD_MAX(bytes, (size_t)1));
    if (!mem)
        return td_errorf_quiet(TD_ERR_NOMEM, "out of memory for %zu log-probabilities", n);
    Tandem__V1__TokenLogprob **msgs = (void *)mem;
    Tandem__V1__TopLogprob **top_ptrs = (void *)(msgs + n);
    Tandem__V1__TokenLogprob *m = (void *)(top_ptrs + n_top);
    Tandem__V1__TopLogprob *tops = (void *)(m + n);
    for (size_t i = 0; i < n; i++) {
        tandem__v1__token_logprob__init(&m[i]);
        m[i].token_id = (uint32_t)lps[i].token;
        m[i].logprob = lps[i].logprob;
        size_t k = (size_t)TD_MIN(TD_MAX(lps[i].n_top, 0), TD_LOGPROBS_MAX_TOP);
        m[i].top = k ? top_ptrs : NULL;
        m[i].n_top = k;
        for (size_t t = 0; t < k; t++) {
            tandem__v1__top_logprob__init(tops);
            tops->token_id = (uint32_t)lps[i].top[t].token;
            tops->logprob = lps[i].top[t].logprob;
            *top_ptrs++ = tops++;
        }
        msgs[i] = &m[i];
    }
    *msgs_p = msgs;
    *mem_p = mem;
    return TD_OK;
}

void td_node_logprob_from_proto(const Tandem__V1__TokenLogprob *m, td_token_logprob_t *lp)
{
    lp->token = (int32_t)TD_MIN(m->token_id, (uint32_t)INT32_MAX);
    lp->logprob = m->logprob;
    lp->n_top = (int32_t)TD_MIN(m->n_top, (size_t)TD_LOGPROBS_MAX_TOP);
    for (int32_t i = 0; i < lp->n_top; i++)
        lp->top[i] = (td_top_logprob_t){.token = (int32_t)TD_MIN(m->top[i]->token_id, (uint32_t)INT32_MAX),
                                        .logprob = m->top[i]->logprob};
}

int td_node_run(td_node_t *p)
{
    uv_run(&p->loop, UV_RUN_DEFAULT);
    return 0;
}

void td_node_shutdown(td_node_t *p)
{
    if (p->shutting_down)
        return;
    p->shutting_down = true;
    td_info("%s: shutting down", p->spec.prog);
    p->spec.on_shutdown(p->spec.data);
    td_node_client_close(p->client);
    p->client = NULL;
    td_http_server_close(p->http, NULL, NULL);
    p->http = NULL;
    td_metrics_loop_stop(p->loop_metrics);
    p->loop_metrics = NULL;
    td_node_auth_close(&p->auth);
    if (p->drain_timer_up) {
        uv_close((uv_handle_t *)&p->drain_timer, NULL);
        p->drain_timer_up = false;
    }
    if (p->signals_up) {
        uv_close((uv_handle_t *)&p->sigint, NULL);
        uv_close((uv_handle_t *)&p->sigterm, NULL);
        p->signals_up = false;
    }
}

void td_node_stop(td_node_t *p)
{
    if (!p->loop_up)
        return;
    if (!p->shutting_down) {
        td_node_shutdown(p); /* partial init: the closers are NULL-safe */
        uv_run(&p->loop, UV_RUN_DEFAULT);
    }
    if (uv_loop_close(&p->loop) != 0)
        td_warn("%s: loop closed with handles open", p->spec.prog);
    p->loop_up = false;
}

void td_node_free(td_node_t *p)
{
    td_node_auth_free(&p->auth);
    td_opts_result_free(&p->conf);
}

td_status_t td_node_gram_open(const td_model_t *model, td_node_gram_t *g)
{
    memset(g, 0, sizeof *g);
    if (!model->tokenizer_path[0])
        return TD_OK;
    const td_model_config_t *mc = &model->config;
    td_status_t st;
    if ((st = td_tokenizer_load(model->tokenizer_path, &g->tok)) != TD_OK) {
        if (st == TD_ERR_NOMEM)
            return st;
        /* the node serves everything else as before: only a constrained request is refused */
        td_warn("%s: structured output is off on this node: %s", model->tokenizer_path, td_last_error());
        return TD_OK;
    }
    if ((st = td_constrain_vocab(g->tok, mc->vocab_size, mc->eos_ids, mc->n_eos, &g->vocab)) != TD_OK ||
        (st = td_gram_cache_create(g->vocab, TD_NODE_GRAM_CACHE, &g->cache)) != TD_OK) {
        td_node_gram_close(g);
        return td_errorf(st, "structured output: out of memory for the grammar vocabulary");
    }
    return TD_OK;
}

void td_node_gram_close(td_node_gram_t *g)
{
    td_gram_cache_destroy(g->cache);
    td_gram_vocab_destroy(g->vocab);
    td_tokenizer_destroy(g->tok);
    memset(g, 0, sizeof *g);
}
