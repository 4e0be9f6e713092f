/*
 * router_http: the router's OpenAI-compatible HTTP front door (--http-port), on td_http.
 * POST /v1/completions and /v1/chat/completions become router requests through the same
 * router_req_open / router_req_submit as gRPC's Generate, with this file's sink (an HTTP
 * request) instead of a gRPC call; GET /v1/models and /health answer at once (and /metrics
 * with --http-metrics; by default it is only on the metrics port). The route, the method
 * and the API key are checked on the head (router_http_head), before the body is read.
 * The JSON is router_openai's. docs/openai.md.
 *
 * A streamed request (stream: true) begins its SSE answer with its first text, so a
 * request refused before it (a full queue, no pair up, a prompt too long for the model)
 * still gets its HTTP status; a whole answer is sent when the request finishes. The relay's
 * backpressure is td_http's: a chunk refused (BUSY) stays in the request's pending output
 * until the connection drains. A connection that goes (the client closed it, a timeout)
 * ends its request as a cancel: the lease is released and the decode node frees its blocks.
 * The answer's last bytes (the finish chunk, usage, [DONE]) may wait for the connection to
 * drain after the request itself has ended: the HTTP request's state (http_client_t)
 * outlives the router request then, and is freed when the stream ends or aborts.
 */
#include "router_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "router_admit.h"
#include "router_openai.h"
#include "td_hash.h"
#include "td_log.h"
#include "td_util.h"

typedef struct http_client {
    router_state_t *s;
    td_http_req_t *req;
    router_req_t *r;            /* NULL once the router request ended */
    router_oai_resp_t rs;
    char id[80];
    bool stream, include_usage;
    bool began;                 /* the SSE answer began */
    bool first;                 /* no chunk with text went out yet */
    char *echo;                 /* completions with echo: the prompt's text, sent first */
    size_t echo_len;
    bool logprobs;              /* the client asked for log-probabilities */
    bool lp_first_null;         /* the first entry is the prompt's first token (echo) */
    size_t lp_offset;           /* completions' text_offset of the next token */
    td_token_logprob_t *lps;    /* a whole answer: every entry so far [n_lps] */
    size_t n_lps, cap_lps;
    router_oai_buf_t text;      /* a whole answer: the text so far */
    td_tools_parser_t *tools;   /* tool calls read from the output (tools with tool_choice not
                                 * none), or NULL: the output is text */
    td_tools_format_t tool_format;
    size_t fed;                 /* a stream: bytes of r->out's text already fed to the parser (a
                                 * refused send keeps r->out and comes again with more) */
    router_oai_buf_t pend;      /* a stream with tools: SSE events made, not yet written */
    router_oai_buf_t calls;     /* a whole answer with tools: message.tool_calls' items */
    router_oai_buf_t content;   /* a whole answer with tools: the content */
    router_oai_buf_t out;       /* the bytes being written (after the request ended: the
                                 * answer's last bytes, until the connection takes them) */
} http_client_t;

static void client_free(http_client_t *hc)
{
    free(hc->lps);
    router_oai_buf_free(&hc->text);
    router_oai_buf_free(&hc->out);
    router_oai_buf_free(&hc->pend);
    router_oai_buf_free(&hc->calls);
    router_oai_buf_free(&hc->content);
    td_tools_parser_destroy(hc->tools);
    free(hc->echo);
    free(hc);
}

/* ---- answers at once ------------------------------------------------------------------- */

static void respond_json(td_http_req_t *req, int status, const router_oai_buf_t *b)
{
    if (b->oom) {
        td_http_respond(req, 500, "application/json", "{\"error\":{\"message\":\"router: out of memory\","
                        "\"type\":\"server_error\",\"param\":null,\"code\":null}}", 87);
        return;
    }
    td_http_respond(req, status, "application/json", b->p, b->n);
}

static void respond_error(td_http_req_t *req, const router_oai_error_t *err)
{
    router_oai_buf_t b = {0};
    router_oai_error_json(&b, err);
    respond_json(req, err->status, &b);
    router_oai_buf_free(&b);
}

/* Live prefill and decode nodes of the router's model (a decode node counts once its
 * Steps stream is up), as router_print_nodes counts them. */
static void nodes_up(const router_state_t *s, int *prefill_p, int *decode_p)
{
    int np = 0, nd = 0;
    int64_t now = (int64_t)td_now_ns();
    for (int32_t i = 0; i < router_registry_slots(s->reg); i++) {
        const router_node_t *n = router_registry_node_const(s->reg, i);
        if (!n || !router_registry_is_live(s->reg, i, now) || strcmp(n->info.model, s->proc.cfg.model_name))
            continue;
        if (n->info.role == TD_NODE_ROLE_DECODE)
            nd += s->peers[i].steps != NULL;
        else if (n->info.role == TD_NODE_ROLE_UNIFIED) /* both ends of a pair */
            np += s->peers[i].steps != NULL, nd += s->peers[i].steps != NULL;
        else
            np++;
    }
    *prefill_p = np;
    *decode_p = nd;
}

static void http_health(router_state_t *s, td_http_req_t *req)
{
    int np, nd;
    nodes_up(s, &np, &nd);
    bool ok = np > 0 && nd > 0 && !s->shutting_down;
    char body[160];
    int n = snprintf(body, sizeof body, "{\"status\":\"%s\",\"prefill_nodes\":%d,\"decode_nodes\":%d}",
                     ok ? "ok" : "unavailable", np, nd);
    td_http_respond(req, ok ? 200 : 503, "application/json", body, (size_t)n);
}

static void http_models(router_state_t *s, td_http_req_t *req)
{
    router_oai_buf_t b = {0};
    router_oai_models(&b, s->proc.cfg.model_name, s->started_unix);
    respond_json(req, 200, &b);
    router_oai_buf_free(&b);
}

/* ---- the sink: a router request's output as OpenAI's answer ---------------------------- */


/* Writes hc->out, the answer's last bytes, after the request ended, then ends the stream
 * and frees hc; on BUSY waits for on_writable. */
static void tail_drain(http_client_t *hc)
{
    td_status_t st = td_http_stream_write(hc->req, hc->out.p, hc->out.n);
    if (st == TD_ERR_BUSY || st == TD_ERR_CLOSED)
        return; /* on_writable comes back here; or on_abort follows and frees hc */
    td_http_stream_end(hc->req); /* sent, or out of memory for it: the stream ends either way */
    client_free(hc);
}

static td_status_t stream_begin(http_client_t *hc)
{
    if (hc->began)
        return TD_OK;
    td_status_t st = td_http_stream_begin(hc->req, 200, "text/event-stream");
    if (st == TD_OK)
        hc->began = true;
    return st;
}

/* The text of this message: r's pending text (a pointer into r->out), or with an echo not
 * yet sent the echo and that text, copied into *tmp. */
static const char *message_text(http_client_t *hc, router_req_t *r, size_t *len_p, router_oai_buf_t *tmp)
{
    if (!hc->echo) {
        *len_p = r->out.n_text;
        return r->out.text ? r->out.text : "";
    }
    router_oai_buf_put(tmp, hc->echo, hc->echo_len);
    router_oai_buf_put(tmp, r->out.text ? r->out.text : "", r->out.n_text);
    *len_p = tmp->n;
    return tmp->oom ? "" : tmp->p;
}

static void echo_sent(http_client_t *hc)
{
    free(hc->echo);
    hc->echo = NULL;
}

/* A token's text for its log-probability entry (router_oai_token_text_cb; ctx is the
 * router): the id decoded alone. */
static size_t token_text(void *ctx, int32_t id, char *buf, size_t cap)
{
    const router_state_t *s = ctx;
    char *t = NULL;
    size_t len = 0;
    if (td_tokenizer_decode(s->tok, &id, 1, &t, &len) != TD_OK)
        return 0;
    len = TD_MIN(len, cap);
    memcpy(buf, t, len);
    free(t);
    return len;
}

/* r's pending log-probabilities in order (the prompt's, sent with the first message, then
 * the generated tokens'), appended to hc->lps. TD_ERR_NOMEM. */
static td_status_t lps_append(http_client_t *hc, const router_req_t *r)
{
    size_t np = r->out.n_prompt_lps, ng = r->out.lps ? r->out.n : 0;
    if (hc->n_lps + np + ng > hc->cap_lps) {
        size_t cap = TD_MAX(hc->cap_lps * 2, hc->n_lps + np + ng);
        td_token_logprob_t *p = realloc(hc->lps, cap * sizeof *p);
        if (!p)
            return TD_ERR_NOMEM;
        hc->lps = p;
        hc->cap_lps = cap;
    }
    if (np && !hc->n_lps)
        hc->lp_first_null = true; /* the prompt's first token: no context */
    if (np)
        memcpy(hc->lps + hc->n_lps, r->out.prompt_lps, np * sizeof *hc->lps);
    if (ng)
        memcpy(hc->lps + hc->n_lps + np, r->out.lps, ng * sizeof *hc->lps);
    hc->n_lps += np + ng;
    return TD_OK;
}

/* choices[0].logprobs of hc->lps[from..n_lps) into *b; NULL when the client asked none (or
 * out of memory: sent without them). */
static const char *lps_json(http_client_t *hc, size_t from, router_oai_buf_t *b)
{
    if (!hc->logprobs)
        return NULL;
    hc->lp_offset = router_oai_logprobs(b, hc->rs.kind, hc->lps + from, hc->n_lps - from,
                                        hc->lp_first_null && from == 0, hc->lp_offset, token_text, hc->s);
    return b->oom ? NULL : b->p;
}

/* ---- tool calls ---- */

/* A call's id: OpenAI's "call_" and 24 letters and digits, or for Mistral's template, which
 * checks them, 9; made from the request's id and the call's index, so each is unique. */
static void tool_call_id(const http_client_t *hc, uint32_t index, char id[40])
{
    static const char ALNUM[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    bool mistral = hc->tool_format == TD_TOOLS_MISTRAL;
    size_t n = mistral ? 9 : 24, k = 0;
    if (!mistral)
        k = (size_t)snprintf(id, 40, "call_");
    uint64_t h = td_fnv1a64(TD_FNV1A64_INIT, hc->id, strlen(hc->id));
    h = td_fnv1a64(h, &index, sizeof index);
    for (size_t i = 0; i < n; i++) {
        if (i % 10 == 9)
            h = td_fnv1a64(h, &i, sizeof i);
        id[k++] = ALNUM[h % 62];
        h /= 62;
    }
    id[k] = '\0';
}

/* Parser events of a stream: SSE chunks appended to hc->pend. */
static td_status_t stream_tool_event(void *ctx, const td_tools_event_t *ev)
{
    http_client_t *hc = ctx;
    if (ev->kind == TD_TOOLS_CONTENT) {
        router_oai_chunk(&hc->pend, &hc->rs, hc->first, ev->text, ev->len, NULL, NULL, hc->include_usage);
    } else {
        char id[40];
        tool_call_id(hc, ev->index, id);
        router_oai_tool_call_chunk(&hc->pend, &hc->rs, hc->first, ev->index, id, ev->name, ev->arguments,
                                   ev->arguments_len, hc->include_usage);
    }
    hc->first = false;
    return hc->pend.oom ? TD_ERR_NOMEM : TD_OK;
}

/* Parser events of a whole answer: the content and the tool_calls items. */
static td_status_t whole_tool_event(void *ctx, const td_tools_event_t *ev)
{
    http_client_t *hc = ctx;
    if (ev->kind == TD_TOOLS_CONTENT) {
        router_oai_buf_put(&hc->content, ev->text, ev->len);
    } else {
        char id[40];
        tool_call_id(hc, ev->index, id);
        router_oai_tool_call_json(&hc->calls, ev->index, id, ev->name, ev->arguments, ev->arguments_len);
    }
    return hc->content.oom || hc->calls.oom ? TD_ERR_NOMEM : TD_OK;
}

/* A stream with tools: r's new text through the parser into hc->pend, then written. */
static td_status_t tools_send(http_client_t *hc, router_req_t *r)
{
    size_t n = r->out.n_text;
    td_status_t st = TD_OK;
    if (n > hc->fed)
        st = td_tools_parser_feed(hc->tools, r->out.text + hc->fed, n - hc->fed, stream_tool_event, hc);
    hc->fed = n;
    if (st == TD_OK && hc->pend.n && (st = stream_begin(hc)) == TD_OK &&
        (st = td_http_stream_write(hc->req, hc->pend.p, hc->pend.n)) == TD_OK)
        hc->pend.n = 0;
    if (st == TD_OK)
        hc->fed = 0; /* r->out is emptied on TD_OK; the parser holds what may be a call */
    return st == TD_ERR_CLOSED ? TD_ERR_CANCELLED : st;
}

static td_status_t http_send(router_req_t *r)
{
    http_client_t *hc = r->client;
    if (hc->tools && hc->stream)
        return tools_send(hc, r);
    if (hc->logprobs && lps_append(hc, r) != TD_OK)
        return TD_ERR_NOMEM;
    if (!hc->stream) {
        router_oai_buf_put(&hc->text, r->out.text ? r->out.text : "", r->out.n_text);
        return hc->text.oom ? TD_ERR_NOMEM : TD_OK;
    }
    bool any_lp = hc->n_lps > 0;
    if (!r->out.n_text && !hc->echo && !any_lp)
        return TD_OK; /* ids whose text is held back (a stop string may begin there) */
    td_status_t st = stream_begin(hc);
    if (st != TD_OK) {
        hc->n_lps = 0;
        return st == TD_ERR_CLOSED ? TD_ERR_CANCELLED : st; /* closing: on_abort ends r */
    }
    router_oai_buf_t tmp = {0}, lpb = {0};
    size_t len, lp_offset = hc->lp_offset;
    const char *text = message_text(hc, r, &len, &tmp);
    hc->out.n = 0;
    router_oai_chunk(&hc->out, &hc->rs, hc->first, text, len, any_lp ? lps_json(hc, 0, &lpb) : NULL, NULL,
                     hc->include_usage);
    router_oai_buf_free(&tmp);
    router_oai_buf_free(&lpb);
    if (hc->out.oom)
        return TD_ERR_NOMEM;
    st = td_http_stream_write(hc->req, hc->out.p, hc->out.n);
    if (st == TD_OK) {
        hc->first = false;
        hc->lp_first_null = false;
        echo_sent(hc);
    } else {
        hc->lp_offset = lp_offset; /* the same entries go again with the retry */
    }
    hc->n_lps = 0; /* r->out keeps them when the send did not go */
    return st == TD_ERR_CLOSED ? TD_ERR_CANCELLED : st;
}

static const char *reason_name(router_finish_t reason)
{
    return reason == ROUTER_FINISH_LENGTH ? "length" : "stop";
}

/* OpenAI's finish_reason "tool_calls" when the output ended with calls. */
static const char *finish_name(const http_client_t *hc, router_finish_t reason)
{
    if (hc->tools && td_tools_parser_calls(hc->tools) && reason != ROUTER_FINISH_LENGTH)
        return "tool_calls";
    return reason_name(reason);
}

static void http_finish(router_req_t *r, const router_summary_t *sum)
{
    http_client_t *hc = r->client;
    hc->r = NULL;
    router_oai_usage_t u = {.prompt_tokens = sum->prompt_tokens, .completion_tokens = sum->completion_tokens,
                            .cached_tokens = sum->cached_tokens, .migrations = sum->migrations};
    if (hc->logprobs && lps_append(hc, r) != TD_OK)
        hc->logprobs = false; /* out of memory: the answer goes without them */
    if (!hc->stream && hc->tools) {
        router_oai_buf_put(&hc->text, r->out.text ? r->out.text : "", r->out.n_text);
        td_status_t st = hc->text.oom ? TD_ERR_NOMEM
                                      : td_tools_parser_feed(hc->tools, hc->text.p ? hc->text.p : "", hc->text.n,
                                                             whole_tool_event, hc);
        if (st == TD_OK)
            st = td_tools_parser_finish(hc->tools, whole_tool_event, hc);
        hc->out.n = 0;
        router_oai_buf_put(&hc->calls, "", 0);
        router_oai_response_tools(&hc->out, &hc->rs, hc->content.p ? hc->content.p : "", hc->content.n,
                                  hc->calls.n ? hc->calls.p : NULL, NULL, finish_name(hc, sum->reason), &u);
        if (st != TD_OK)
            hc->out.oom = true;
        respond_json(hc->req, 200, &hc->out);
        client_free(hc);
        return;
    }
    if (!hc->stream) {
        router_oai_buf_put(&hc->text, r->out.text ? r->out.text : "", r->out.n_text);
        router_oai_buf_t b = {0}, lpb = {0};
        if (hc->echo) {
            router_oai_buf_put(&b, hc->echo, hc->echo_len);
            router_oai_buf_put(&b, hc->text.p ? hc->text.p : "", hc->text.n);
        }
        router_oai_buf_t *t = hc->echo ? &b : &hc->text;
        hc->out.n = 0;
        router_oai_response(&hc->out, &hc->rs, t->p ? t->p : "", t->n, lps_json(hc, 0, &lpb),
                            reason_name(sum->reason), &u);
        router_oai_buf_free(&b);
        router_oai_buf_free(&lpb);
        respond_json(hc->req, 200, &hc->out);
        client_free(hc);
        return;
    }
    if (stream_begin(hc) != TD_OK)
        return; /* the connection is closing: on_abort follows and frees hc */
    router_oai_buf_t tmp = {0}, lpb = {0};
    size_t len;
    const char *text = message_text(hc, r, &len, &tmp);
    hc->out.n = 0;
    if (hc->tools) { /* the last text through the parser, what it held, then an empty last chunk */
        td_status_t st = TD_OK;
        if (r->out.n_text > hc->fed)
            st = td_tools_parser_feed(hc->tools, r->out.text + hc->fed, r->out.n_text - hc->fed, stream_tool_event,
                                      hc);
        if (st == TD_OK)
            st = td_tools_parser_finish(hc->tools, stream_tool_event, hc);
        router_oai_buf_put(&hc->out, hc->pend.p ? hc->pend.p : "", hc->pend.n);
        hc->pend.n = 0;
        if (st != TD_OK)
            hc->out.oom = true;
        text = "", len = 0;
    }
    router_oai_chunk(&hc->out, &hc->rs, hc->first, text, len, hc->n_lps ? lps_json(hc, 0, &lpb) : NULL,
                     finish_name(hc, sum->reason), hc->include_usage);
    router_oai_buf_free(&tmp);
    router_oai_buf_free(&lpb);
    if (hc->include_usage)
        router_oai_usage_chunk(&hc->out, &hc->rs, &u);
    router_oai_done(&hc->out);
    if (hc->out.oom) {
        td_http_stream_end(hc->req);
        client_free(hc);
        return;
    }
    tail_drain(hc);
}

static void http_fail(router_req_t *r, td_grpc_code_t code, const char *msg)
{
    http_client_t *hc = r->client;
    hc->r = NULL;
    router_oai_error_t err;
    router_oai_error_from_code((int)code, msg, &err);
    if (!hc->began) {
        respond_error(hc->req, &err);
        client_free(hc);
        return;
    }
    /* mid-stream: an SSE event with the error, as OpenAI's servers send one */
    hc->out.n = 0;
    router_oai_buf_puts(&hc->out, "data: ");
    router_oai_error_json(&hc->out, &err);
    router_oai_buf_puts(&hc->out, "\n\n");
    router_oai_done(&hc->out);
    if (hc->out.oom) {
        td_http_stream_end(hc->req);
        client_free(hc);
        return;
    }
    tail_drain(hc);
}

static const router_sink_ops_t http_sink = {.send = http_send, .finish = http_finish, .fail = http_fail};

static void http_on_abort(td_http_req_t *req, void *data)
{
    http_client_t *hc = data;
    router_req_t *r = hc->r;
    if (r) {
        hc->r = NULL;
        r->client = NULL;
        router_req_client_gone(r, false);
    }
    client_free(hc);
}

static void http_on_writable(td_http_req_t *req, void *data)
{
    http_client_t *hc = data;
    if (hc->r)
        router_req_writable(hc->r);
    else
        tail_drain(hc);
}

/* ---- generation requests --------------------------------------------------------------- */

/* The prompt as text for echo: the text sent, or the ids decoded (*text_p malloc'ed).
 * Errors: TD_ERR_RANGE (an id outside the tokenizer's vocabulary), TD_ERR_NOMEM. */
static td_status_t echo_text(const router_state_t *s, const router_oai_req_t *q, char **text_p, size_t *len_p)
{
    if (!q->prompt)
        return td_tokenizer_decode(s->tok, (const int32_t *)q->prompt_ids, q->gp.prompt_len, text_p, len_p);
    char *t = malloc(q->prompt_len + 1);
    if (!t)
        return TD_ERR_NOMEM;
    memcpy(t, q->prompt, q->prompt_len + 1);
    *text_p = t;
    *len_p = q->prompt_len;
    return TD_OK;
}

/* A parsed request becomes a router request answering req; q stays the caller's (nothing
 * of it is kept). */
static void http_generate_parsed(router_state_t *s, td_http_req_t *req, router_oai_kind_t kind,
                                 const router_oai_req_t *qp)
{
    router_oai_req_t q = *qp;
    router_oai_error_t err;
    char why[384];
    http_client_t *hc = NULL;
    if (!s->tok) { /* OpenAI's answers are text */
        router_oai_error_set(&err, 400, "invalid_request_error", NULL, NULL,
                             "this router has no tokenizer (--tokenizer): it cannot answer in text; use the "
                             "gRPC gateway with prompt_ids");
        router_count_outcome(s, "invalid");
        goto err_respond;
    }
    if (q.model && strcmp(q.model, s->proc.cfg.model_name)) {
        router_oai_error_set(&err, 400, "invalid_request_error", "model", "model_not_found",
                             "the model '%s' is not served here (see GET /v1/models): this router serves '%s'",
                             q.model, s->proc.cfg.model_name);
        router_count_outcome(s, "invalid");
        goto err_respond;
    }
    if (q.logprobs >= 0) /* echo with logprobs: the prompt's too, as evaluation harnesses use */
        q.gp.logprobs = (td_logprobs_want_t){.on = true, .top = q.logprobs, .prompt = q.echo};
    /* the router's one check of the parameters, at this front door: td_gen_params_check
     * names the field, which becomes OpenAI's `param` (router_req_open takes them as valid) */
    td_gen_field_t bad = td_gen_params_check(&q.gp, why, sizeof why);
    if (bad != TD_GEN_FIELD_NONE) {
        td_gen_field_names_t names = td_gen_field_names(bad);
        router_oai_error_set(&err, 400, "invalid_request_error", NULL, NULL, "%s", why);
        snprintf(err.param, sizeof err.param, "%s", kind == ROUTER_OAI_CHAT ? names.openai_chat : names.openai);
        router_count_outcome(s, "invalid");
        goto err_respond;
    }
    td_status_t st = (hc = calloc(1, sizeof *hc)) ? TD_OK : TD_ERR_NOMEM;
    if (st == TD_OK && q.echo)
        st = echo_text(s, &q, &hc->echo, &hc->echo_len);
    if (st != TD_OK) {
        if (st == TD_ERR_NOMEM)
            router_oai_error_set(&err, 500, "server_error", NULL, NULL, "router: out of memory");
        else
            router_oai_error_set(&err, 400, "invalid_request_error", "prompt", NULL,
                                 "'prompt' has a token id outside the vocabulary (%d ids)",
                                 td_tokenizer_vocab_size(s->tok));
        router_count_outcome(s, st == TD_ERR_NOMEM ? "exhausted" : "invalid");
        goto err_respond;
    }
    router_key_terms_t kt;
    if (router_key_terms(s, td_http_req_header(req, "authorization"), 0, &kt) != TD_OK) {
        router_oai_error_set(&err, 500, "server_error", NULL, NULL, "router: out of memory");
        router_count_outcome(s, "exhausted");
        goto err_respond;
    }
    router_req_spec_t spec = {.gp = q.gp, .prompt_ids = q.prompt_ids, .prompt = q.prompt,
                              .prompt_text_len = q.prompt_len, .messages = q.messages, .n_messages = q.n_messages,
                              .priority = kt.priority, .cache_salt = kt.cache_salt,
                              .grammar = q.grammar, .tools_json = q.tools_json};
    /* tool calls are read from the output unless tool_choice is none, or a response_format
     * constrains it (then it is that format's text) */
    bool parse_tools = q.tool_choice != ROUTER_OAI_TOOLS_NONE &&
                       (q.tool_choice != ROUTER_OAI_TOOLS_AUTO || !q.grammar);
    if (parse_tools && td_tools_parser_create(s->tool_format, q.parallel_tool_calls ? 0 : 1, (size_t)1 << 20,
                                              &hc->tools) != TD_OK) {
        router_oai_error_set(&err, 500, "server_error", NULL, NULL, "router: out of memory");
        router_count_outcome(s, "exhausted");
        goto err_respond;
    }
    hc->tool_format = s->tool_format;
    router_req_t *r;
    td_grpc_code_t code;
    if (router_req_open(s, &spec, &code, why, sizeof why, &r) != TD_OK) {
        router_oai_error_from_code((int)code, why, &err);
        goto err_respond;
    }
    hc->s = s;
    hc->req = req;
    hc->r = r;
    hc->stream = q.stream;
    hc->include_usage = q.stream && q.include_usage;
    hc->first = true;
    hc->logprobs = q.logprobs >= 0 && !hc->tools; /* with tools, the answer is calls: no logprobs */
    snprintf(hc->id, sizeof hc->id, "%s%s", kind == ROUTER_OAI_CHAT ? "chatcmpl-" : "cmpl-", r->id);
    hc->rs = (router_oai_resp_t){.kind = kind, .id = hc->id, .model = s->proc.cfg.model_name,
                                 .created = (int64_t)time(NULL)};
    r->sink = &http_sink;
    r->client = hc;
    td_http_req_set_data(req, hc);
    td_http_req_on_abort(req, http_on_abort);
    td_http_req_on_writable(req, http_on_writable);
    router_req_submit(r, &spec); /* may end r, answering req */
    return;
err_respond:
    if (hc)
        client_free(hc);
    respond_error(req, &err);
}

/* ---- request bodies, parsed off the loop (long ones) ----------------------------------- */

/* A JSON body is parsed on libuv's thread pool when it is longer than this; shorter ones on
 * the loop. cJSON's worst case is a body of small values (an id array: ~110 ns a byte on the
 * 2-core VM, one node per value), so 64 KiB costs the loop at most ~7 ms, while the round
 * trip to the pool would cost a short request more than its parse. An 8 MiB id array was
 * 0.9 s on the loop, which carries every node's heartbeat (issue 35). */
#define ROUTER_HTTP_PARSE_INLINE_BYTES (64 << 10)

/* One long body being parsed: the job owns the body (taken from td_http) and the result.
 * It runs twice on the pool: the parse, then, once the loop has made its router request
 * of it, the freeing of the parsed document (cJSON_Delete of an 8 MiB id array's 1.2M
 * nodes is ~40 ms, and slower still against the pool's own mallocs). It holds the body's
 * bytes of the body budget and its place in max-tokenizing, the router's one bound of
 * request work on the pool, until the end of both. The HTTP request points at it (its
 * data, its on_abort) while it parses; a connection that goes meanwhile orphans it (req
 * NULL): the job runs to its end and frees itself. router_oai_parse touches nothing but its
 * arguments, so it is safe on another thread. */
typedef struct parse_job {
    uv_work_t work;           /* first: the job is its work request */
    router_state_t *s;
    td_http_req_t *req;       /* NULL once orphaned */
    router_oai_kind_t kind;
    char *body;               /* [len], taken from the request */
    size_t len, charged;      /* charged: bytes of s->body_budget the body holds */
    router_oai_req_t q;       /* the result, when st is TD_OK */
    router_oai_error_t err;   /* else the answer */
    td_status_t st;
} parse_job_t;

static void parse_work(uv_work_t *w)
{
    parse_job_t *j = (parse_job_t *)w;
    j->st = router_oai_parse(j->kind, j->body, j->len, &j->q, &j->err);
    if (j->st == TD_OK && (j->st = router_oai_tools_prepare(&j->q, j->s->tool_format, &j->err)) != TD_OK)
        router_oai_req_free(&j->q);
    free(j->body);
    j->body = NULL;
}

static void parse_free_work(uv_work_t *w)
{
    router_oai_req_free(&((parse_job_t *)w)->q);
}

static void parse_end(uv_work_t *w, int status)
{
    (void)status; /* never cancelled: uv_cancel is not used */
    parse_job_t *j = (parse_job_t *)w;
    j->s->n_tokenizing--;
    td_rpc_budget_give(&j->s->body_budget, j->charged);
    free(j);
}

static void parse_on_abort(td_http_req_t *req, void *data)
{
    (void)req;
    ((parse_job_t *)data)->req = NULL;
}

static void parse_done(uv_work_t *w, int status)
{
    (void)status;
    parse_job_t *j = (parse_job_t *)w;
    router_state_t *s = j->s;
    td_http_req_t *req = j->req;
    if (req) {
        td_http_req_set_data(req, NULL);
        td_http_req_on_abort(req, NULL);
        router_oai_error_t err = j->err;
        if (j->st != TD_OK) {
            router_count_outcome(s, j->st == TD_ERR_NOMEM ? "exhausted" : "invalid");
            respond_error(req, &err);
        } else if (s->shutting_down) {
            router_oai_error_set(&err, 503, "service_unavailable", NULL, NULL, "router shutting down");
            respond_error(req, &err);
        } else {
            http_generate_parsed(s, req, j->kind, &j->q);
        }
    }
    if (j->st == TD_OK && uv_queue_work(&s->proc.loop, &j->work, parse_free_work, parse_end) == 0)
        return;
    if (j->st == TD_OK)
        router_oai_req_free(&j->q); /* the pool refused: freed here, once */
    parse_end(w, 0);
}

static void http_generate(router_state_t *s, td_http_req_t *req, router_oai_kind_t kind)
{
    router_oai_error_t err;
    router_oai_req_t q;
    size_t len;
    const char *body = td_http_req_body(req, &len);
    if (len <= ROUTER_HTTP_PARSE_INLINE_BYTES) {
        td_status_t st = router_oai_parse(kind, body, len, &q, &err);
        if (st == TD_OK && (st = router_oai_tools_prepare(&q, s->tool_format, &err)) != TD_OK)
            router_oai_req_free(&q);
        if (st != TD_OK) {
            router_count_outcome(s, err.status == 500 ? "exhausted" : "invalid");
            respond_error(req, &err);
            return;
        }
        http_generate_parsed(s, req, kind, &q);
        router_oai_req_free(&q);
        return;
    }
    if (s->n_tokenizing >= s->cfg.max_tokenizing) {
        router_oai_error_set(&err, 429, "rate_limit_error", NULL, NULL,
                             "router: %d long prompts or request bodies are being processed (max-tokenizing); "
                             "retry later", s->n_tokenizing);
        td_http_resp_header(req, "Retry-After", "1");
        router_count_outcome(s, "exhausted");
        respond_error(req, &err);
        return;
    }
    parse_job_t *j = calloc(1, sizeof *j);
    if (!j) {
        router_oai_error_set(&err, 500, "server_error", NULL, NULL, "router: out of memory");
        router_count_outcome(s, "exhausted");
        respond_error(req, &err);
        return;
    }
    *j = (parse_job_t){.s = s, .req = req, .kind = kind};
    j->body = td_http_req_take_body(req, &j->len, &j->charged);
    if (uv_queue_work(&s->proc.loop, &j->work, parse_work, parse_done) != 0) {
        td_rpc_budget_give(&s->body_budget, j->charged);
        free(j->body);
        free(j);
        router_oai_error_set(&err, 500, "server_error", NULL, NULL, "router: cannot queue the body's parse");
        router_count_outcome(s, "exhausted");
        respond_error(req, &err);
        return;
    }
    s->n_tokenizing++;
    td_http_req_set_data(req, j);
    td_http_req_on_abort(req, parse_on_abort);
}

/* ---- the server's one handler ---------------------------------------------------------- */

static void method_not_allowed(td_http_req_t *req, const char *allow)
{
    router_oai_error_t err;
    router_oai_error_set(&err, 405, "invalid_request_error", NULL, "method_not_allowed", "%s %s: use %s",
                         td_http_req_method(req), td_http_req_path(req), allow);
    td_http_resp_header(req, "Allow", allow);
    respond_error(req, &err);
}

/* The answers td_http decides itself (413 body too large, 431, garbage: 400, ...) in
 * OpenAI's error shape (td_http_config_t.error_body). */
size_t router_http_error_body(void *data, int status, const char *message, char *out, size_t cap,
                              const char **content_type)
{
    (void)data;
    router_oai_error_t err;
    router_oai_error_set(&err, status, "invalid_request_error", NULL, NULL, "%s", message);
    router_oai_buf_t b = {0};
    router_oai_error_json(&b, &err);
    size_t n = !b.oom && b.n <= cap ? b.n : 0;
    if (n)
        memcpy(out, b.p, n);
    router_oai_buf_free(&b);
    *content_type = "application/json";
    return n;
}

/* Every request's head (td_http_head_cb), before any of its body is read: the route, the
 * method and the API key are checked here, so a request without a valid key is refused
 * with 401 having cost its headers only (a body it declared is never read: td_http closes
 * the connection after the answer). What passes reaches router_http_handler. */
void router_http_head(void *data, td_http_req_t *req)
{
    router_state_t *s = data;
    const char *path = td_http_req_path(req), *method = td_http_req_method(req);
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    router_oai_error_t err;
    bool metrics = s->cfg.http_metrics && !strcmp(path, "/metrics");
    if (metrics) { /* asked for (--http-metrics): open, as on the metrics port */
        if (!get)
            method_not_allowed(req, "GET");
        return;
    }
    bool gen_chat = !strcmp(path, "/v1/chat/completions"), gen_cmpl = !strcmp(path, "/v1/completions");
    bool models = !strcmp(path, "/v1/models"), health = !strcmp(path, "/health");
    if (!gen_chat && !gen_cmpl && !models && !health) {
        if (!strcmp(path, "/metrics"))
            router_oai_error_set(&err, 404, "invalid_request_error", NULL, "not_found",
                                 "%s %s: /metrics is served on the metrics port (--metrics-port), not on the API "
                                 "port (--http-metrics serves it here too)", method, path);
        else
            router_oai_error_set(&err, 404, "invalid_request_error", NULL, "not_found",
                                 "%s %s: no such endpoint (POST /v1/completions, POST /v1/chat/completions, "
                                 "GET /v1/models, GET /health)", method, path);
        respond_error(req, &err);
        return;
    }
    if ((gen_chat || gen_cmpl) && !post) {
        method_not_allowed(req, "POST");
        return;
    }
    if ((models || health) && !get) {
        method_not_allowed(req, "GET");
        return;
    }
    if (health) /* probes carry no key */
        return;
    td_auth_key_props_t kp;
    td_auth_outcome_t ao = td_node_auth_check_key_props(&s->proc.auth, td_http_req_header(req, "authorization"), &kp);
    if (ao != TD_AUTH_OK) {
        router_oai_error_set(&err, 401, "invalid_request_error", NULL, "invalid_api_key",
                             ao == TD_AUTH_MISSING ? "no API key: send the header 'Authorization: Bearer KEY'"
                                                   : "the API key is not valid");
        td_http_resp_header(req, "WWW-Authenticate", "Bearer");
        respond_error(req, &err);
        return;
    }
    int64_t retry_ms;
    if (!td_node_auth_take_rate(&s->proc.auth, &kp, &retry_ms)) { /* before the body is read, as a 401 */
        char after[24];
        snprintf(after, sizeof after, "%lld", (long long)((retry_ms + 999) / 1000));
        router_oai_error_set(&err, 429, "rate_limit_error", NULL, "rate_limit_exceeded",
                             "the API key's rate limit (%g requests a second) is reached: retry in %lld ms",
                             kp.rate, (long long)retry_ms);
        td_http_resp_header(req, "Retry-After", after); /* counted by td_node_auth */
        respond_error(req, &err);
        return;
    }
}

/* Every request that passed router_http_head, its body read (td_http_handler_cb); data is
 * the router's state. */
void router_http_handler(void *data, td_http_req_t *req)
{
    router_state_t *s = data;
    const char *path = td_http_req_path(req);
    router_oai_error_t err;
    if (!strcmp(path, "/metrics")) {
        td_http_metrics_handler(s->metrics, req);
        return;
    }
    if (!strcmp(path, "/health")) {
        http_health(s, req);
        return;
    }
    if (s->shutting_down) {
        router_oai_error_set(&err, 503, "service_unavailable", NULL, NULL, "router shutting down");
        respond_error(req, &err);
        return;
    }
    if (!strcmp(path, "/v1/models"))
        http_models(s, req);
    else
        http_generate(s, req, !strcmp(path, "/v1/chat/completions") ? ROUTER_OAI_CHAT : ROUTER_OAI_COMPLETIONS);
}
