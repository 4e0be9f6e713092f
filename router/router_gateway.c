/*
 * router_gateway: the gateway API (tandem.v1.Generation, grpc.health.v1.Health). Generate
 * checks a request at the edge (td_gen_params), builds its n choices' router requests
 * (router_choices, shared with the OpenAI door) and hands them to the lifecycle
 * (router_request.c); ListModels and ClusterStatus answer from the registry.
 */
#include "router_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "health.pb-c.h"
#include "router_admit.h"
#include "router_choices.h"
#include "router_openai.h"
#include "td_gram.h"
#include "td_log.h"
#include "td_util.h"

/* ---- gateway API: the Generate call as a request's sink --------------------------------- */

static const char *const gw_none = "";

/* One choice of a Generate call with tools: its output through the tool-call parser, and
 * what the parser gave since the last message went out. */
typedef struct gw_tools {
    td_tools_parser_t *parser;
    td_tools_format_t fmt;
    const char *req_id;             /* choice 0's request id, for the calls' ids */
    uint32_t choice;                /* the choice's index, for the calls' ids */
    router_oai_buf_t content;       /* content text given, not yet sent */
    router_oai_buf_t strs;          /* the pending calls' ids, names and arguments, NUL-separated */
    Tandem__V1__ToolCall *calls;    /* [n_calls] pending calls (string fields set at send) */
    size_t n_calls, cap_calls;
    size_t (*offs)[3];              /* [n_calls] each call's id, name, arguments offset in strs */
    uint32_t total;                 /* calls given so far */
    size_t fed;                     /* bytes of r->out.text fed to the parser (a send was BUSY) */
} gw_tools_t;

static void gw_tools_free(gw_tools_t *g)
{
    if (!g)
        return;
    td_tools_parser_destroy(g->parser);
    router_oai_buf_free(&g->content);
    router_oai_buf_free(&g->strs);
    free(g->calls);
    free(g->offs);
    free(g);
}

/* One Generate call and its n choices (GenerateRequest.n): freed in the group's close
 * callback (gw_choices_closed), once the call is answered or gone and no choice runs. */
typedef struct gw_call {
    router_choices_t g;
    td_grpc_call_t *call;                   /* NULL once answered or gone */
    gw_tools_t *tools[ROUTER_CHOICES_MAX];  /* each choice's parse, with tools; else NULL */
} gw_call_t;

/* r's call and choice (r is one of its group's requests). */
static gw_call_t *gw_of(const router_req_t *r, int32_t *index_p)
{
    const router_choice_t *c = r->client;
    *index_p = c->index;
    return c->g->owner;
}

static td_status_t gw_tool_event(void *ctx, const td_tools_event_t *ev)
{
    gw_tools_t *g = ctx;
    if (ev->kind == TD_TOOLS_CONTENT) {
        router_oai_buf_put(&g->content, ev->text, ev->len);
        return g->content.oom ? TD_ERR_NOMEM : TD_OK;
    }
    if (g->n_calls == g->cap_calls) {
        size_t cap = g->cap_calls ? 2 * g->cap_calls : 4;
        Tandem__V1__ToolCall *c = realloc(g->calls, cap * sizeof *c);
        if (c)
            g->calls = c;
        size_t (*o)[3] = c ? realloc(g->offs, cap * sizeof *o) : NULL;
        if (!o)
            return TD_ERR_NOMEM;
        g->offs = o;
        g->cap_calls = cap;
    }
    char id[40];
    router_oai_tool_call_id(g->req_id, g->fmt, g->choice, ev->index, id);
    size_t *off = g->offs[g->n_calls];
    off[0] = g->strs.n;
    router_oai_buf_put(&g->strs, id, strlen(id) + 1);
    off[1] = g->strs.n;
    router_oai_buf_put(&g->strs, ev->name, strlen(ev->name) + 1);
    off[2] = g->strs.n;
    router_oai_buf_put(&g->strs, ev->arguments, ev->arguments_len);
    router_oai_buf_put(&g->strs, "", 1);
    if (g->strs.oom)
        return TD_ERR_NOMEM;
    Tandem__V1__ToolCall *c = &g->calls[g->n_calls++];
    tandem__v1__tool_call__init(c);
    c->index = ev->index;
    g->total++;
    return TD_OK;
}

/* r->out's text not yet fed through r's tool-call parser (the last message: and the
 * parser's held text), into m's text and tool_calls; *ptrs_p the calls' array (free it once
 * sent). What the parser gave stays pending until gw_tools_sent: a send refused as BUSY is
 * made again from the same r->out, which is not fed twice. */
static td_status_t gw_tools_message(gw_tools_t *g, router_req_t *r, Tandem__V1__GenerateResponse *m, bool last,
                                    void **ptrs_p)
{
    *ptrs_p = NULL;
    td_status_t st = router_oai_tools_feed(g->parser, &g->fed, r->out.text, r->out.n_text, last, gw_tool_event, g);
    router_oai_buf_put(&g->content, "", 1); /* the NUL protobuf-c wants, not counted */
    if (!g->content.oom)
        g->content.n--;
    if (st == TD_OK && g->content.oom)
        st = TD_ERR_NOMEM;
    m->text = st == TD_OK ? g->content.p : (char *)gw_none;
    Tandem__V1__ToolCall **ptrs = st == TD_OK && g->n_calls ? malloc(g->n_calls * sizeof *ptrs) : NULL;
    for (size_t i = 0; ptrs && i < g->n_calls; i++) {
        g->calls[i].id = g->strs.p + g->offs[i][0];
        g->calls[i].name = g->strs.p + g->offs[i][1];
        g->calls[i].arguments_json = g->strs.p + g->offs[i][2];
        ptrs[i] = &g->calls[i];
    }
    if (ptrs) {
        m->tool_calls = ptrs;
        m->n_tool_calls = g->n_calls;
    } else if (st == TD_OK && g->n_calls) {
        st = TD_ERR_NOMEM;
    }
    *ptrs_p = ptrs;
    return st;
}

/* The message went out (the relay clears r->out): nothing of it is pending any more. */
static void gw_tools_sent(gw_tools_t *g)
{
    g->content.n = 0;
    g->strs.n = 0;
    g->n_calls = 0;
    g->fed = 0;
}

/* r's pending output as m (choice i of gc); mem: what to free once m is sent. */
static td_status_t gw_message(gw_call_t *gc, int32_t i, router_req_t *r, Tandem__V1__GenerateResponse *m,
                              void *mem[2])
{
    td_status_t st = TD_OK;
    mem[0] = mem[1] = NULL;
    m->token_ids = r->out.ids;
    m->n_token_ids = r->out.n;
    m->text = r->out.text ? r->out.text : (char *)gw_none;
    m->choice_index = (uint32_t)i;
    if (!r->sent_msg) /* every choice's first message: the call's id (choice 0's request's) */
        m->request_id = gc->g.id;
    if (r->out.lps && r->out.n) {
        st = td_node_logprobs_to_proto_array(r->out.lps, r->out.n, &m->logprobs, &mem[0]);
        m->n_logprobs = st == TD_OK ? r->out.n : 0;
    }
    if (r->out.n_prompt_lps && st == TD_OK) {
        st = td_node_logprobs_to_proto_array(r->out.prompt_lps, r->out.n_prompt_lps, &m->prompt_logprobs, &mem[1]);
        m->n_prompt_logprobs = st == TD_OK ? r->out.n_prompt_lps : 0;
    }
    return st;
}

static td_status_t gw_send(router_req_t *r)
{
    int32_t i;
    gw_call_t *gc = gw_of(r, &i);
    gw_tools_t *gt = gc->tools[i];
    if (gc->g.failed || !gc->call)
        return TD_OK; /* another choice failed and answered: this one ends from the idle handle */
    Tandem__V1__GenerateResponse m = TANDEM__V1__GENERATE_RESPONSE__INIT;
    void *mem[2], *calls = NULL;
    if (gw_message(gc, i, r, &m, mem) != TD_OK)
        td_warn("request %s: out of memory for %u log-probabilities; sent without them", r->id, r->out.n);
    if (gt && gw_tools_message(gt, r, &m, false, &calls) != TD_OK) {
        free(mem[0]);
        free(mem[1]);
        return TD_ERR_NOMEM; /* the client goes: a call half-read cannot be sent right */
    }
    td_status_t st = td_grpc_call_send(gc->call, &m.base);
    if (st == TD_OK && gt)
        gw_tools_sent(gt);
    free(calls);
    free(mem[0]);
    free(mem[1]);
    return st;
}

/* The call is answered: nothing more is written to it. */
static void gw_answered(gw_call_t *gc)
{
    gc->call = NULL;
    router_choices_answered(&gc->g);
}

/* A choice ends well: its last message with its finish reason; the last choice's also
 * carries the usage of them all (the prompt once) and choice 0's timings, and ends the call. */
static void gw_finish(router_req_t *r, const router_summary_t *sum)
{
    static const Tandem__V1__FinishReason reasons[] = {
        [ROUTER_FINISH_LENGTH] = TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH,
        [ROUTER_FINISH_STOP] = TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP,
        [ROUTER_FINISH_EOS] = TANDEM__V1__FINISH_REASON__FINISH_REASON_EOS,
    };
    int32_t i;
    gw_call_t *gc = gw_of(r, &i);
    gw_tools_t *gt = gc->tools[i];
    if (!router_choices_finished(r->client, r, sum)) /* answered already */
        return;
    void *calls = NULL;
    Tandem__V1__GenerateResponse m = TANDEM__V1__GENERATE_RESPONSE__INIT;
    Tandem__V1__Usage u = TANDEM__V1__USAGE__INIT;
    Tandem__V1__Timings t = TANDEM__V1__TIMINGS__INIT;
    void *mem[2];
    if (gw_message(gc, i, r, &m, mem) != TD_OK)
        td_warn("request %s: out of memory for the log-probabilities of the last message; sent without them", r->id);
    m.request_id = gc->g.id;
    m.finish_reason = reasons[sum->reason];
    if (gt) {
        if (gw_tools_message(gt, r, &m, true, &calls) != TD_OK)
            td_warn("request %s: out of memory for the tool calls of the last message; sent without them", r->id);
        /* as OpenAI's "tool_calls": the output ended with calls, not cut by max_tokens */
        if (gt->total && sum->reason != ROUTER_FINISH_LENGTH)
            m.finish_reason = TANDEM__V1__FINISH_REASON__FINISH_REASON_TOOL_CALLS;
    }
    if (!router_choices_all_ended(&gc->g)) {
        /* past the send bound: this choice's end cannot wait, and there are at most n */
        td_status_t st = td_grpc_call_send_last(gc->call, &m.base);
        if (st != TD_OK && st != TD_ERR_CANCELLED) { /* cancelled: on_generate_cancel follows */
            td_warn("request %s: cannot send choice %d's last message: %s", r->id, (int)i, td_strerror(st));
            td_grpc_call_set_data(gc->call, NULL);
            td_grpc_call_finish(gc->call, TD_GRPC_RESOURCE_EXHAUSTED, "router: cannot send a choice's last message");
            gw_answered(gc); /* the other choices end from the group's idle handle */
        }
    } else {
        const router_summary_t *s0 = &gc->g.sum0;
        u.prompt_tokens = s0->prompt_tokens;
        u.completion_tokens = gc->g.completion_tokens;
        u.cached_tokens = s0->cached_tokens;
        u.migrations = gc->g.migrations;
        m.usage = &u;
        t.queue_s = s0->queue_s;
        t.prefill_s = s0->prefill_s;
        t.transfer_s = s0->transfer_s;
        t.first_token_s = s0->first_token_s;
        t.per_token_s = s0->per_token_s;
        t.total_s = s0->total_s;
        t.prefill_local = s0->prefill_local;
        t.prefill_peer = s0->prefill_peer;
        t.prefill_node = (char *)s0->prefill_node;
        t.decode_node = (char *)s0->decode_node;
        m.timings = &t;
        td_grpc_call_set_data(gc->call, NULL);
        td_grpc_call_reply(gc->call, &m.base);
        gw_answered(gc);
    }
    free(calls);
    free(mem[0]);
    free(mem[1]);
}

static void gw_fail(router_req_t *r, td_grpc_code_t code, const char *msg)
{
    router_choices_fail(r->client, code, msg);
}

static const router_sink_ops_t gw_sink = {.send = gw_send, .finish = gw_finish, .fail = gw_fail,
                                          .prefilled = router_choices_prefilled};

/* The group's first failure (router_choices_ops_t.failed): the call ends with it. */
static void gw_choices_failed(router_choices_t *g, int32_t i, td_grpc_code_t code, const char *msg)
{
    gw_call_t *gc = g->owner;
    (void)i;
    td_grpc_call_set_data(gc->call, NULL);
    td_grpc_call_finish(gc->call, code, msg);
    gw_answered(gc);
}

static void gw_call_free(gw_call_t *gc)
{
    for (int32_t i = 0; i < ROUTER_CHOICES_MAX; i++)
        gw_tools_free(gc->tools[i]);
    free(gc);
}

static void gw_choices_closed(router_choices_t *g)
{
    gw_call_free(g->owner);
}

static const router_choices_ops_t gw_choices_ops = {.failed = gw_choices_failed, .closed = gw_choices_closed};

static void on_generate_cancel(td_grpc_call_t *call, td_status_t why, void *call_data)
{
    gw_call_t *gc = call_data;
    if (gc) {
        gc->call = NULL;
        router_choices_gone(&gc->g, why == TD_ERR_TIMEOUT);
    }
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, NULL);
}

/* The gateway stream drained below its bound: the pending output goes out now. */
static void on_generate_writable(td_grpc_call_t *call, void *call_data)
{
    gw_call_t *gc = call_data;
    (void)call;
    if (gc)
        router_choices_writable(&gc->g);
}

/* The edge: a GenerateRequest's parameters as our own struct, for the one validation every
 * front door runs (td_gen_params.h; on_generate). Handed over as received but for what proto3 cannot
 * tell from unset: top_p and repetition_penalty 0 mean "off" (proto/tandem.proto); negative,
 * NaN and infinite values reach the check and are refused. The strings stay q's. */
static td_gen_params_t gen_params_from_proto(const Tandem__V1__GenerateRequest *q)
{
    td_gen_params_t gp = td_gen_params_default();
    gp.max_tokens = q->max_tokens;
    gp.prompt_is_text = q->n_prompt_ids == 0;
    gp.prompt_len = q->n_prompt_ids ? q->n_prompt_ids : strlen(q->prompt);
    for (size_t i = 0; i < q->n_messages; i++) /* a conversation: its text counts as the prompt */
        gp.prompt_len += strlen(q->messages[i]->role) + strlen(q->messages[i]->content) + TD_GEN_MESSAGE_BYTES +
                         strlen(q->messages[i]->tool_calls_json) + strlen(q->messages[i]->tool_call_id) +
                         strlen(q->messages[i]->name);
    if (q->n_messages) /* the tools are rendered by the template too */
        gp.prompt_len += strlen(q->tools_json);
    gp.n_stop_ids = q->n_stop_ids;
    gp.n_stop_strings = q->n_stop_strings;
    gp.stop_strings = (const char *const *)q->stop_strings;
    gp.sampling = td_node_sampling_from_proto(q->sampling);
    gp.ignore_eos = q->ignore_eos;
    gp.tpot_objective_ms = q->tpot_objective_ms;
    if (q->logprobs) /* as received: td_gen_params_validate refuses top_logprobs past 20 by name */
        gp.logprobs = (td_logprobs_want_t){.on = true, .top = (int32_t)TD_MIN(q->logprobs->top_logprobs, (uint32_t)INT32_MAX),
                                           .prompt = q->logprobs->prompt};
    return gp;
}

/* The bound on a gateway grammar's source: it is compiled here, on the loop, as the OpenAI
 * path compiles bodies up to the same size inline (ROUTER_HTTP_PARSE_INLINE_BYTES). */
#define GATEWAY_GRAMMAR_MAX (64 << 10)

/* GenerateRequest.grammar checked and translated to GBNF into *gbnf_p (malloc'ed). false
 * with the reason in why: refused (*gbnf_p NULL), or out of memory. */
static bool gateway_grammar(const Tandem__V1__Grammar *g, char **gbnf_p, char *why, size_t cap)
{
    static const td_gram_kind_t kinds[] = {
        [TANDEM__V1__GRAMMAR__KIND__KIND_GBNF] = TD_GRAM_GBNF,
        [TANDEM__V1__GRAMMAR__KIND__KIND_REGEX] = TD_GRAM_REGEX,
        [TANDEM__V1__GRAMMAR__KIND__KIND_CHOICE] = TD_GRAM_CHOICE,
        [TANDEM__V1__GRAMMAR__KIND__KIND_JSON_OBJECT] = TD_GRAM_JSON_OBJECT,
        [TANDEM__V1__GRAMMAR__KIND__KIND_JSON_SCHEMA] = TD_GRAM_JSON_SCHEMA,
    };
    *gbnf_p = NULL;
    size_t len = strlen(g->source);
    if ((unsigned)g->kind >= TD_ARRAY_LEN(kinds)) {
        snprintf(why, cap, "grammar.kind %d is not a Grammar.Kind", (int)g->kind);
        return false;
    }
    if (len > GATEWAY_GRAMMAR_MAX) {
        snprintf(why, cap, "grammar.source of %zu bytes: at most %d through the gateway", len, GATEWAY_GRAMMAR_MAX);
        return false;
    }
    td_status_t st = td_gram_to_gbnf(kinds[g->kind], g->source, len, gbnf_p);
    if (st != TD_OK) {
        snprintf(why, cap, "grammar: %s", st == TD_ERR_NOMEM ? "router: out of memory" : td_last_error());
        return false;
    }
    return true;
}

/* GenerateRequest's tools_json, tool_choice and single_tool_call read and checked by the
 * OpenAI path's own functions (router_oai_tools_read, router_oai_tools_prepare) into *tq
 * (free it with router_oai_req_free); *gbnf_p, the request's grammar, becomes the forced
 * call's grammar for tool_choice required or a name. *parse_p: the output is read for
 * calls. false with the reason in why and *code_p: refused (INVALID_ARGUMENT) or out of
 * memory. */
static bool gateway_tools(const router_state_t *s, const Tandem__V1__GenerateRequest *q, router_oai_req_t *tq,
                          char **gbnf_p, bool *parse_p, td_grpc_code_t *code_p, char *why, size_t cap)
{
    *tq = (router_oai_req_t){.kind = ROUTER_OAI_CHAT, .n = 1, .parallel_tool_calls = !q->single_tool_call};
    *parse_p = false;
    *code_p = TD_GRPC_INVALID_ARGUMENT;
    if (!q->tools_json[0] && !q->tool_choice[0])
        return true;
    size_t len = strlen(q->tools_json);
    if (len > GATEWAY_GRAMMAR_MAX) {
        snprintf(why, cap, "tools_json of %zu bytes: at most %d through the gateway", len, GATEWAY_GRAMMAR_MAX);
        return false;
    }
    if (len && !(tq->doc = cJSON_ParseWithLength(q->tools_json, len))) {
        snprintf(why, cap, "tools_json: not JSON (near byte %zu); send OpenAI's tools array as text",
                 (size_t)(cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - q->tools_json : 0));
        return false;
    }
    const char *choice = q->tool_choice[0] ? q->tool_choice : NULL, *name = NULL;
    if (choice && strcmp(choice, "none") && strcmp(choice, "auto") && strcmp(choice, "required")) {
        name = choice;
        choice = NULL;
    }
    router_oai_error_t err = {0};
    td_status_t st = router_oai_tools_read(tq, tq->doc, choice, name, "tool_choice", &err);
    if (st == TD_OK && tq->n_tools && !q->n_messages) {
        snprintf(why, cap, "tools_json needs messages: the tools are given to the model by its chat template");
        return false;
    }
    char *gbnf = *gbnf_p;
    *parse_p = tq->tool_choice != ROUTER_OAI_TOOLS_NONE && (tq->tool_choice != ROUTER_OAI_TOOLS_AUTO || !gbnf);
    tq->grammar = gbnf; /* for the check that a forced call has no other constraint */
    snprintf(tq->grammar_param, sizeof tq->grammar_param, "grammar");
    if (st == TD_OK)
        st = router_oai_tools_prepare(tq, s->tool_format, &err);
    if (tq->grammar != gbnf)
        *gbnf_p = tq->grammar; /* the forced call's (gbnf was NULL) */
    tq->grammar = NULL;
    if (st != TD_OK) {
        if (st == TD_ERR_NOMEM)
            *code_p = TD_GRPC_RESOURCE_EXHAUSTED;
        /* the OpenAI names: tools[i]... are tools_json's items */
        snprintf(why, cap, "%s%.320s", err.param[0] && !strncmp(err.param, "tools", 5) ? "tools_json: " : "", err.message);
        return false;
    }
    return true;
}

/* The messages' tool_calls_json: each a JSON array of calls with a function name, as the
 * OpenAI path requires of messages[i].tool_calls (the template reads them). */
static bool gateway_message_tools(const Tandem__V1__GenerateRequest *q, char *why, size_t cap)
{
    for (size_t i = 0; i < q->n_messages; i++) {
        const char *text = q->messages[i]->tool_calls_json;
        if (!text[0])
            continue;
        cJSON *a = cJSON_Parse(text);
        bool ok = cJSON_IsArray(a);
        for (const cJSON *c = ok ? a->child : NULL; c; c = c->next) {
            const cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
            ok = ok && cJSON_IsString(cJSON_GetObjectItemCaseSensitive(fn, "name"));
        }
        cJSON_Delete(a);
        if (!ok) {
            snprintf(why, cap, "messages[%zu].tool_calls_json: not a JSON array of calls {\"id\", \"type\": "
                     "\"function\", \"function\": {\"name\", \"arguments\"}}", i);
            return false;
        }
    }
    return true;
}

void on_generate(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    const Tandem__V1__GenerateRequest *q = (const void *)msg;
    if (s->shutting_down) {
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "router shutting down");
        return;
    }
    if (q->model[0] && strcmp(q->model, s->proc.cfg.model_name)) {
        td_grpc_call_finish(call, TD_GRPC_NOT_FOUND, "unknown model (see ListModels)");
        return;
    }
    td_gen_params_t gp = gen_params_from_proto(q);
    char why[384];
    if (td_gen_params_validate(&gp, why, sizeof why) != TD_OK) { /* the router's one check of them */
        router_count_outcome(s, "invalid");
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    if (q->n > ROUTER_CHOICES_MAX) { /* as the OpenAI door's n */
        router_count_outcome(s, "invalid");
        snprintf(why, sizeof why, "n %u is out of range [1, %d]: choices per request", q->n, ROUTER_CHOICES_MAX);
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    char *gbnf = NULL;
    if (q->grammar && !gateway_grammar(q->grammar, &gbnf, why, sizeof why)) {
        router_count_outcome(s, "invalid");
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    router_oai_req_t tq;
    bool parse_tools;
    td_grpc_code_t code;
    if (!gateway_tools(s, q, &tq, &gbnf, &parse_tools, &code, why, sizeof why) ||
        !gateway_message_tools(q, why, sizeof why)) {
        if (code == TD_GRPC_INVALID_ARGUMENT)
            router_count_outcome(s, "invalid");
        router_oai_req_free(&tq);
        free(gbnf);
        td_grpc_call_finish(call, code, why);
        return;
    }
    /* the choices: as many parsers with tools, and the call's state (no messages copy: they
     * are choice 0's, borrowed for router_choices_start) */
    int32_t n = q->n ? (int32_t)q->n : 1; /* at most ROUTER_CHOICES_MAX, checked above */
    gw_call_t *gc = calloc(1, sizeof *gc);
    router_key_terms_t kt;
    td_chat_message_t *messages = NULL;
    bool ok = gc && router_key_terms(s, td_grpc_call_header(call, "authorization"),
                                     q->priority ? q->priority->value : 0, &kt) == TD_OK &&
              (!q->n_messages || (messages = malloc(q->n_messages * sizeof *messages)));
    for (int32_t i = 0; ok && parse_tools && i < n; i++) {
        gw_tools_t *gt = calloc(1, sizeof *gt);
        if (gt && td_tools_parser_create(s->tool_format, tq.parallel_tool_calls ? 0 : 1, (size_t)1 << 20,
                                         &gt->parser) == TD_OK) {
            *gt = (gw_tools_t){.parser = gt->parser, .fmt = s->tool_format, .req_id = gc->g.id, .choice = (uint32_t)i};
            gc->tools[i] = gt;
        } else {
            free(gt);
            ok = false;
        }
    }
    for (size_t i = 0; messages && i < q->n_messages; i++) {
        const Tandem__V1__ChatMessage *cm = q->messages[i];
        messages[i] = (td_chat_message_t){.role = cm->role, .content = cm->content,
                                          .tool_calls = cm->tool_calls_json[0] ? cm->tool_calls_json : NULL,
                                          .tool_call_id = cm->tool_call_id[0] ? cm->tool_call_id : NULL,
                                          .name = cm->name[0] ? cm->name : NULL};
    }
    /* the client's grpc-timeout (the gRPC layer also ends the stream then), else the
     * configured default */
    uint64_t dl_ms = td_grpc_call_deadline(call), now_ms = uv_now(&s->proc.loop);
    router_req_spec_t spec = {.gp = gp, .request_id = q->request_id,
                              .prompt_ids = q->prompt_ids, .prompt = q->prompt, .prompt_text_len = strlen(q->prompt),
                              .messages = messages, .n_messages = messages ? q->n_messages : 0,
                              .stop_ids = q->stop_ids,
                              .priority = ok ? kt.priority : 0, .cache_salt = ok ? kt.cache_salt : 0,
                              .timeout_ms = dl_ms ? (int64_t)TD_MAX(dl_ms > now_ms ? dl_ms - now_ms : 0, 1) : 0,
                              .grammar = gbnf, .tools_json = tq.tools_json};
    if (!ok || router_choices_init(&gc->g, s, n, &spec, &gw_sink, &gw_choices_ops, gc) != TD_OK) {
        if (gc)
            gw_call_free(gc);
        router_oai_req_free(&tq);
        free(gbnf);
        free(messages);
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, "router: out of memory");
        return;
    }
    gc->call = call;
    td_grpc_call_set_data(call, gc);
    td_grpc_call_on_cancel(call, on_generate_cancel);
    td_grpc_call_on_writable(call, on_generate_writable);
    router_choices_start(&gc->g, &spec); /* may end the call (refused) */
    free(gbnf); /* copied by router_req_open and the group */
    router_oai_req_free(&tq);
    free(messages);
}

td_status_t router_key_terms(router_state_t *s, const char *authorization, int32_t asked, router_key_terms_t *terms_p)
{
    td_auth_key_props_t kp;
    if (!s->proc.auth.keys || td_auth_keys_check_bearer_props(s->proc.auth.keys, authorization, &kp) != TD_AUTH_OK) {
        *terms_p = (router_key_terms_t){.priority = asked}; /* no keys: one tenant, as before */
        return TD_OK;
    }
    uint64_t salt = 0;
    if (!s->cfg.share_prefix_cache) {
        td_status_t st = td_auth_tenant_salt(s->cache_salt_key, kp.tenant, &salt);
        if (st != TD_OK)
            return st;
    }
    *terms_p = (router_key_terms_t){.priority = kp.has_priority_cap ? TD_MIN(asked, kp.max_priority) : asked,
                                    .cache_salt = salt};
    return TD_OK;
}

void on_list_models(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    Tandem__V1__ModelInfo mi = TANDEM__V1__MODEL_INFO__INIT;
    mi.name = (char *)s->proc.cfg.model_name;
    router_model_facts_t mf;
    router_admit_model_facts(s->reg, s->proc.cfg.model_name, (int64_t)td_now_ns(), &mf);
    /* the model's own vocabulary where its nodes told it, else the tokenizer's */
    mi.vocab_size = mf.vocab_size ? (uint32_t)mf.vocab_size
                                  : s->tok ? (uint32_t)td_tokenizer_vocab_size(s->tok) : 0;
    mi.max_seq_len = (uint32_t)mf.max_seq_len;
    for (int32_t i = 0; i < router_registry_slots(s->reg); i++) {
        const router_node_t *n = router_registry_node_const(s->reg, i);
        if (n)
            mi.fingerprint = n->info.layout.model_fingerprint;
    }
    Tandem__V1__ModelInfo *list[] = {&mi};
    Tandem__V1__ListModelsResponse resp = TANDEM__V1__LIST_MODELS_RESPONSE__INIT;
    resp.models = list;
    resp.n_models = 1;
    td_grpc_call_reply(call, &resp.base);
}

void on_cluster_status(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    int32_t slots = router_registry_slots(s->reg), n = 0;
    Tandem__V1__NodeStatus *st = calloc((size_t)slots + 1, sizeof *st);
    Tandem__V1__NodeStatus **ptrs = calloc((size_t)slots + 1, sizeof *ptrs);
    int64_t now = (int64_t)td_now_ns();
    for (int32_t i = 0; st && ptrs && i < slots; i++) {
        const router_node_t *nd = router_registry_node_const(s->reg, i);
        if (!nd)
            continue;
        Tandem__V1__NodeStatus *x = &st[n];
        tandem__v1__node_status__init(x);
        x->node_id = (char *)nd->info.id;
        x->role = nd->info.role == TD_NODE_ROLE_DECODE    ? TANDEM__V1__NODE_ROLE__NODE_ROLE_DECODE
                  : nd->info.role == TD_NODE_ROLE_UNIFIED ? TANDEM__V1__NODE_ROLE__NODE_ROLE_UNIFIED
                                                          : TANDEM__V1__NODE_ROLE__NODE_ROLE_PREFILL;
        x->state = !router_registry_is_live(s->reg, i, now) ? TANDEM__V1__NODE_STATE__NODE_STATE_DOWN
                   : nd->load.draining                      ? TANDEM__V1__NODE_STATE__NODE_STATE_DRAINING
                                                            : TANDEM__V1__NODE_STATE__NODE_STATE_UP;
        x->model = (char *)nd->info.model;
        x->address = (char *)nd->info.address;
        x->queued_prefill_tokens = (uint64_t)TD_MAX(nd->load.queued_prefill_tokens, 0);
        x->running_sequences = (uint32_t)TD_MAX(nd->load.running_seqs, 0);
        x->free_kv_blocks = (uint32_t)TD_MAX(nd->load.free_blocks, 0);
        x->total_kv_blocks = (uint32_t)nd->info.capacity_blocks;
        x->kv_occupancy = nd->info.capacity_blocks
                              ? 1.0 - (double)x->free_kv_blocks / (double)nd->info.capacity_blocks : 0;
        x->last_heartbeat_age_s = (double)(now - nd->last_heartbeat_ns) * 1e-9;
        ptrs[n] = x;
        n++;
    }
    Tandem__V1__ClusterStatusResponse resp = TANDEM__V1__CLUSTER_STATUS_RESPONSE__INIT;
    resp.nodes = ptrs;
    resp.n_nodes = (size_t)n;
    resp.active_requests = (uint32_t)s->n_active;
    resp.queued_requests = (uint32_t)router_queue_len(&s->queue);
    td_grpc_call_reply(call, &resp.base);
    free(ptrs);
    free(st);
}

void on_health(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = s->shutting_down ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING
                                   : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    td_grpc_call_reply(call, &resp.base);
}

