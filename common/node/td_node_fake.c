/*
 * td_node_fake: model-less prefill and decode nodes' control API (td_node_fake.h).
 */
#include "td_node_fake.h"

#include <stdlib.h>
#include <string.h>

#include "td_node.h"

typedef struct td_node_fake_sub {
    td_node_fake_t *f;
    int index;
    td_grpc_call_t *call; /* NULL: no subscription */
    bool blocked;         /* the last step was TD_ERR_BUSY */
} td_node_fake_sub_t;

struct td_node_fake {
    td_grpc_server_t *srv;
    td_node_fake_ops_t ops;
    void *data;
    const char *sub_router_ids[TD_NODE_FAKE_MAX_SUBS];
    td_node_fake_sub_t subs[TD_NODE_FAKE_MAX_SUBS];
    uint64_t step;
    Tandem__Control__V1__SeqStep *seq_buf; /* [seq_cap] a StepBatch's entries */
    Tandem__Control__V1__SeqStep **seq_ptrs;
    td_node_logprob_msg_t *lp_buf;         /* [seq_cap] the entries' logprobs */
    size_t seq_cap;
};

td_node_fake_config_t td_node_fake_config_default(void)
{
    return (td_node_fake_config_t){.host = "127.0.0.1", .steps = true};
}

static void on_admit(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    td_node_fake_t *f = data;
    f->ops.admit(f, call, (const Tandem__Control__V1__AdmitRequest *)msg);
}

static void on_release(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    td_node_fake_t *f = data;
    f->ops.release(f, call, (const Tandem__Control__V1__ReleaseRequest *)msg);
}

static void on_prefill(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    td_node_fake_t *f = data;
    f->ops.prefill(f, call, (const Tandem__Control__V1__PrefillRequest *)msg);
}

static void on_steps_writable(td_grpc_call_t *call, void *call_data)
{
    td_node_fake_sub_t *sub = call_data;
    sub->blocked = false;
    if (sub->f->ops.writable)
        sub->f->ops.writable(sub->f, sub->index);
}

static void on_steps_cancel(td_grpc_call_t *call, td_status_t why, void *call_data)
{
    td_node_fake_sub_t *sub = call_data;
    if (sub && sub->call == call) {
        sub->call = NULL;
        sub->blocked = false;
    }
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, NULL);
}

static void on_steps(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    td_node_fake_t *f = data;
    const Tandem__Control__V1__StepsRequest *q = (const void *)msg;
    int i = 0;
    for (int k = 1; k < TD_NODE_FAKE_MAX_SUBS; k++)
        if (f->sub_router_ids[k] && !strcmp(q->router_id, f->sub_router_ids[k]))
            i = k;
    td_node_fake_sub_t *sub = &f->subs[i];
    if (sub->call) { /* a second subscription replaces the first */
        td_grpc_call_t *old = sub->call;
        sub->call = NULL;
        td_grpc_call_set_data(old, NULL);
        td_grpc_call_finish(old, TD_GRPC_ABORTED, "replaced by a new subscription");
    }
    sub->call = call;
    sub->blocked = false;
    td_grpc_call_set_data(call, sub);
    td_grpc_call_on_cancel(call, on_steps_cancel);
    td_grpc_call_on_writable(call, on_steps_writable);
    if (f->ops.subscribed)
        f->ops.subscribed(f, i);
}

td_status_t td_node_fake_create(uv_loop_t *loop, const td_node_fake_config_t *c,
                                const td_node_fake_ops_t *ops, void *data, td_node_fake_t **f_p)
{
    td_node_fake_t *f = calloc(1, sizeof *f);
    if (!f)
        return td_errorf(TD_ERR_NOMEM, "fake node: out of memory");
    f->ops = *ops;
    f->data = data;
    for (int i = 0; i < TD_NODE_FAKE_MAX_SUBS; i++) {
        f->sub_router_ids[i] = c->sub_router_ids[i];
        f->subs[i] = (td_node_fake_sub_t){.f = f, .index = i};
    }
    td_grpc_server_config_t sc = td_grpc_server_config_default();
    sc.host = c->host;
    if (c->max_concurrent_streams)
        sc.max_concurrent_streams = c->max_concurrent_streams;
    td_status_t st = td_grpc_server_create(loop, &sc, &f->srv);
    if (st != TD_OK) {
        free(f);
        return st;
    }
    static const struct {
        const char *path;
        const ProtobufCMessageDescriptor *desc;
        td_grpc_handler_cb cb;
    } methods[] = {
        {"/tandem.control.v1.DecodeNode/Admit", &tandem__control__v1__admit_request__descriptor,
         on_admit},
        {"/tandem.control.v1.DecodeNode/Release", &tandem__control__v1__release_request__descriptor,
         on_release},
        {"/tandem.control.v1.DecodeNode/Steps", &tandem__control__v1__steps_request__descriptor,
         on_steps},
        {"/tandem.control.v1.PrefillNode/Prefill",
         &tandem__control__v1__prefill_request__descriptor, on_prefill},
    };
    const bool served[] = {ops->admit != NULL, ops->release != NULL, c->steps,
                           ops->prefill != NULL};
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
        if (served[i] && (st = td_grpc_server_add_method(f->srv, methods[i].path, methods[i].desc,
                                                         methods[i].cb, f)) != TD_OK) {
            td_node_fake_close(f);
            return st;
        }
    }
    *f_p = f;
    return TD_OK;
}

static void td_node_fake_closed(void *data)
{
    td_node_fake_t *f = data;
    free(f->seq_buf);
    free(f->seq_ptrs);
    free(f->lp_buf);
    free(f);
}

void td_node_fake_close(td_node_fake_t *f)
{
    if (f)
        td_grpc_server_close(f->srv, td_node_fake_closed, f);
}

void *td_node_fake_data(const td_node_fake_t *f)
{
    return f->data;
}

uint16_t td_node_fake_port(const td_node_fake_t *f)
{
    return td_grpc_server_port(f->srv);
}

void td_node_fake_admit_reply(td_grpc_call_t *call, uint64_t lease_id, const uint32_t *blocks,
                              size_t n_blocks)
{
    Tandem__Control__V1__AdmitResponse r = TANDEM__CONTROL__V1__ADMIT_RESPONSE__INIT;
    r.lease_id = lease_id;
    r.block_ids = (uint32_t *)blocks; /* packed during the call, not kept */
    r.n_block_ids = n_blocks;
    td_grpc_call_reply(call, &r.base);
}

td_status_t td_node_fake_prefill_send(td_grpc_call_t *call, uint32_t first_token,
                                      Tandem__Control__V1__PrefillPhase phase)
{
    Tandem__Control__V1__PrefillResponse r = TANDEM__CONTROL__V1__PREFILL_RESPONSE__INIT;
    r.first_token = first_token;
    r.phase = phase;
    return td_grpc_call_send(call, &r.base);
}

td_status_t td_node_fake_prefill_send_logprobs(td_grpc_call_t *call, uint32_t first_token,
                                               const td_token_logprob_t *first,
                                               const td_token_logprob_t *prompt, size_t n_prompt)
{
    Tandem__Control__V1__PrefillResponse r = TANDEM__CONTROL__V1__PREFILL_RESPONSE__INIT;
    r.first_token = first_token;
    r.phase = TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_FIRST_TOKEN;
    td_node_logprob_msg_t m;
    td_node_logprob_to_proto(first, &m);
    r.first_logprob = &m.m;
    void *mem = NULL;
    if (n_prompt) {
        td_status_t st = td_node_logprobs_to_proto_array(prompt, n_prompt, &r.prompt_logprobs, &mem);
        if (st != TD_OK)
            return st;
        r.n_prompt_logprobs = n_prompt;
    }
    td_status_t st = td_grpc_call_send(call, &r.base);
    free(mem);
    return st;
}

void td_node_fake_prefill_reply(td_grpc_call_t *call, uint32_t first_token,
                                Tandem__Control__V1__PrefillPhase phase)
{
    Tandem__Control__V1__PrefillResponse r = TANDEM__CONTROL__V1__PREFILL_RESPONSE__INIT;
    r.first_token = first_token;
    r.phase = phase;
    td_grpc_call_reply(call, &r.base);
}

td_status_t td_node_fake_step(td_node_fake_t *f, int sub, const td_node_fake_entry_t *e, size_t n,
                              uint32_t free_kv_blocks)
{
    td_node_fake_sub_t *s = &f->subs[sub];
    if (!s->call)
        return TD_ERR_UNAVAILABLE;
    if (n > f->seq_cap) {
        size_t cap = n * 2;
        Tandem__Control__V1__SeqStep *b = realloc(f->seq_buf, cap * sizeof *b);
        if (b)
            f->seq_buf = b;
        Tandem__Control__V1__SeqStep **p = realloc(f->seq_ptrs, cap * sizeof *p);
        if (p)
            f->seq_ptrs = p;
        td_node_logprob_msg_t *l = realloc(f->lp_buf, cap * sizeof *l);
        if (l)
            f->lp_buf = l;
        if (!b || !p || !l)
            return TD_ERR_NOMEM;
        f->seq_cap = cap;
    }
    for (size_t i = 0; i < n; i++) {
        Tandem__Control__V1__SeqStep *q = &f->seq_buf[i];
        tandem__control__v1__seq_step__init(q);
        q->lease_id = e[i].lease_id;
        q->token = e[i].token;
        q->event = e[i].event;
        if (e[i].logprob) {
            td_node_logprob_to_proto(e[i].logprob, &f->lp_buf[i]);
            q->logprob = &f->lp_buf[i].m;
        }
        f->seq_ptrs[i] = q;
    }
    Tandem__Control__V1__StepBatch b = TANDEM__CONTROL__V1__STEP_BATCH__INIT;
    b.step = f->step + 1;
    b.seqs = f->seq_ptrs;
    b.n_seqs = n;
    b.free_kv_blocks = free_kv_blocks;
    td_status_t st = td_grpc_call_send(s->call, &b.base);
    if (st == TD_OK)
        f->step++;
    else if (st == TD_ERR_BUSY)
        s->blocked = true;
    return st;
}

bool td_node_fake_subscribed(const td_node_fake_t *f, int sub)
{
    return f->subs[sub].call != NULL;
}

bool td_node_fake_blocked(const td_node_fake_t *f, int sub)
{
    return f->subs[sub].blocked;
}

uint64_t td_node_fake_last_step(const td_node_fake_t *f)
{
    return f->step;
}
