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
#include "router_choices.h"
#include "router_openai.h"
#include "td_hash.h"
#include "td_log.h"
#include "td_util.h"

typedef struct http_client http_client_t;

/* One choice of a request (OpenAI's choices[i]; n > 1 makes several): its part of the
 * answer (its router request is hc->g.ch[i]'s). */
typedef struct http_choice {
    http_client_t *hc;
    router_oai_resp_t rs;       /* hc's, with this choice's index */
    bool first;                 /* no chunk with text went out yet */
    bool echo_pending;          /* completions with echo: the prompt's text not yet sent */
    bool lp_first_null;         /* the first entry is the prompt's first token (echo) */
    size_t lp_offset;           /* completions' text_offset of the next token */
    td_token_logprob_t *lps;    /* a whole answer: every entry so far [n_lps] */
    size_t n_lps, cap_lps;
    router_oai_buf_t text;      /* a whole answer: the text so far */
    const char *reason;         /* finish_reason once it ended well */
    /* tool calls: this choice's output read by its own parser (tools with tool_choice not
     * none), or NULL: the output is text */
    td_tools_parser_t *tools;
    size_t fed;                 /* a stream: bytes of r->out's text already fed to the parser (a
                                 * refused send keeps r->out and comes again with more) */
    router_oai_buf_t calls;     /* a whole answer with tools: message.tool_calls' items */
    router_oai_buf_t content;   /* a whole answer with tools: the content */
} http_choice_t;

/*
 * One HTTP generation request and its n choices, started, failed and cancelled together by
 * router_choices (docs/openai.md "Several choices"). hc is freed only in the group's close
 * callback (http_choices_closed), once the answer is done and no choice runs, so a loop over
 * its choices never outlives it.
 */
struct http_client {
    router_choices_t g;         /* the choices' router requests */
    router_state_t *s;
    td_http_req_t *req;         /* NULL once answered (or the connection went) */
    char id[80];
    bool stream, include_usage;
    bool began;                 /* the SSE answer began */
    bool closing;               /* out holds the answer's last bytes: the stream ends once written */
    bool logprobs;              /* the client asked for log-probabilities */
    char *echo;                 /* completions with echo: the prompt's text, sent first */
    size_t echo_len;
    router_oai_buf_t out;       /* stream bytes the connection has not taken yet */
    int32_t n;
    http_choice_t ch[ROUTER_OAI_MAX_N];
    /* tool calls (each choice's parser: http_choice_t.tools) */
    bool tools;                 /* the choices' outputs are read for calls */
    td_tools_format_t tool_format;
    router_oai_buf_t pend;      /* a stream with tools: SSE events of any choice, whole, in the
                                 * order made, not yet written */
};

/* Frees hc and what it holds but its group (closed, or never set up). */
static void client_free(http_client_t *hc)
{
    for (int32_t i = 0; i < hc->n; i++) {
        free(hc->ch[i].lps);
        router_oai_buf_free(&hc->ch[i].text);
        router_oai_buf_free(&hc->ch[i].calls);
        router_oai_buf_free(&hc->ch[i].content);
        td_tools_parser_destroy(hc->ch[i].tools);
    }
    router_oai_buf_free(&hc->out);
    router_oai_buf_free(&hc->pend);
    free(hc->echo);
    free(hc);
}

static void http_choices_closed(router_choices_t *g)
{
    client_free(g->owner);
}

/* The HTTP request is answered (or gone): nothing more is written to it. */
static void client_answered(http_client_t *hc)
{
    hc->req = NULL;
    router_choices_answered(&hc->g);
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


/* Writes hc->out; once it is written and the answer's last bytes were in it, ends the
 * stream. TD_OK (all written), TD_ERR_BUSY (on_writable comes back), TD_ERR_CLOSED
 * (on_abort follows). */
static td_status_t out_flush(http_client_t *hc)
{
    if (hc->out.n) {
        td_status_t st = td_http_stream_write(hc->req, hc->out.p, hc->out.n);
        if (st == TD_ERR_BUSY || st == TD_ERR_CLOSED)
            return st;
        hc->out.n = 0; /* sent, or out of memory for it: dropped either way */
    }
    if (hc->closing) {
        td_http_stream_end(hc->req);
        client_answered(hc);
    }
    return TD_OK;
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
static const char *message_text(http_choice_t *ch, router_req_t *r, size_t *len_p, router_oai_buf_t *tmp)
{
    if (!ch->echo_pending) {
        *len_p = r->out.n_text;
        return r->out.text ? r->out.text : "";
    }
    router_oai_buf_put(tmp, ch->hc->echo, ch->hc->echo_len);
    router_oai_buf_put(tmp, r->out.text ? r->out.text : "", r->out.n_text);
    *len_p = tmp->n;
    return tmp->oom ? "" : tmp->p;
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
 * the generated tokens'), appended to ch->lps. TD_ERR_NOMEM. */
static td_status_t lps_append(http_choice_t *ch, const router_req_t *r)
{
    size_t np = r->out.n_prompt_lps, ng = r->out.lps ? r->out.n : 0;
    if (ch->n_lps + np + ng > ch->cap_lps) {
        size_t cap = TD_MAX(ch->cap_lps * 2, ch->n_lps + np + ng);
        td_token_logprob_t *p = realloc(ch->lps, cap * sizeof *p);
        if (!p)
            return TD_ERR_NOMEM;
        ch->lps = p;
        ch->cap_lps = cap;
    }
    if (np && !ch->n_lps)
        ch->lp_first_null = true; /* the prompt's first token: no context */
    if (np)
        memcpy(ch->lps + ch->n_lps, r->out.prompt_lps, np * sizeof *ch->lps);
    if (ng)
        memcpy(ch->lps + ch->n_lps + np, r->out.lps, ng * sizeof *ch->lps);
    ch->n_lps += np + ng;
    return TD_OK;
}

/* choices[i].logprobs of ch->lps[from..n_lps) into *b; NULL when the client asked none (or
 * out of memory: sent without them). */
static const char *lps_json(http_choice_t *ch, size_t from, router_oai_buf_t *b)
{
    if (!ch->hc->logprobs)
        return NULL;
    ch->lp_offset = router_oai_logprobs(b, ch->rs.kind, ch->lps + from, ch->n_lps - from,
                                        ch->lp_first_null && from == 0, ch->lp_offset, token_text, ch->hc->s);
    return b->oom ? NULL : b->p;
}

/* One chunk of ch (its pending text and log-probabilities; the finish reason on its last)
 * appended to *b. */
static void choice_chunk(http_choice_t *ch, router_req_t *r, const char *reason, router_oai_buf_t *b)
{
    router_oai_buf_t tmp = {0}, lpb = {0};
    size_t len;
    const char *text = message_text(ch, r, &len, &tmp);
    router_oai_chunk(b, &ch->rs, ch->first, text, len, ch->n_lps ? lps_json(ch, 0, &lpb) : NULL, reason,
                     ch->hc->include_usage);
    router_oai_buf_free(&tmp);
    router_oai_buf_free(&lpb);
}

/* ---- tool calls ---- */

/* Parser events of a stream (ctx: the choice): SSE chunks appended to hc->pend. */
static td_status_t stream_tool_event(void *ctx, const td_tools_event_t *ev)
{
    http_choice_t *ch = ctx;
    http_client_t *hc = ch->hc;
    if (ev->kind == TD_TOOLS_CONTENT) {
        router_oai_chunk(&hc->pend, &ch->rs, ch->first, ev->text, ev->len, NULL, NULL, hc->include_usage);
    } else { /* a whole call; a streamed one's head (no arguments) or its next piece (no name) */
        char id[40];
        router_oai_tool_call_id(hc->id, hc->tool_format, (uint32_t)ch->rs.index, ev->index, id);
        router_oai_tool_call_chunk(&hc->pend, &ch->rs, ch->first, ev->index, id,
                                   ev->kind == TD_TOOLS_CALL_ARGS ? NULL : ev->name,
                                   ev->kind == TD_TOOLS_CALL_BEGIN ? NULL : ev->arguments, ev->arguments_len,
                                   hc->include_usage);
    }
    ch->first = false;
    return hc->pend.oom ? TD_ERR_NOMEM : TD_OK;
}

/* Parser events of a whole answer (ctx: the choice): its content and tool_calls items. */
static td_status_t whole_tool_event(void *ctx, const td_tools_event_t *ev)
{
    http_choice_t *ch = ctx;
    if (ev->kind == TD_TOOLS_CONTENT) {
        router_oai_buf_put(&ch->content, ev->text, ev->len);
    } else if (ch->rs.legacy_functions) { /* the older message.function_call: one call */
        router_oai_function_call_json(&ch->calls, ev->name, ev->arguments, ev->arguments_len);
    } else {
        char id[40];
        router_oai_tool_call_id(ch->hc->id, ch->hc->tool_format, (uint32_t)ch->rs.index, ev->index, id);
        router_oai_tool_call_json(&ch->calls, ev->index, id, ev->name, ev->arguments, ev->arguments_len);
    }
    return ch->content.oom || ch->calls.oom ? TD_ERR_NOMEM : TD_OK;
}

/* A stream with tools: r's new text through ch's parser into hc->pend, then written (with
 * any other choice's events still waiting there, before them). */
static td_status_t tools_send(http_choice_t *ch, router_req_t *r)
{
    http_client_t *hc = ch->hc;
    td_status_t st = router_oai_tools_feed(ch->tools, &ch->fed, r->out.text, r->out.n_text, false, stream_tool_event, ch);
    if (st == TD_OK && hc->pend.n && (st = stream_begin(hc)) == TD_OK &&
        (st = td_http_stream_write(hc->req, hc->pend.p, hc->pend.n)) == TD_OK)
        hc->pend.n = 0;
    if (st == TD_OK)
        ch->fed = 0; /* r->out is emptied on TD_OK; the parser holds what may be a call */
    return st == TD_ERR_CLOSED ? TD_ERR_CANCELLED : st;
}

/* The choice of r (a router request of hc's group). */
static http_choice_t *choice_of(const router_req_t *r)
{
    router_choice_t *c = r->client;
    return &((http_client_t *)c->g->owner)->ch[c->index];
}

static td_status_t http_send(router_req_t *r)
{
    http_choice_t *ch = choice_of(r);
    http_client_t *hc = ch->hc;
    if (hc->g.failed || !hc->req || hc->closing)
        return TD_OK; /* another choice failed and answered: this one ends from the idle handle */
    if (hc->tools && hc->stream)
        return tools_send(ch, r);
    if (hc->logprobs && lps_append(ch, r) != TD_OK)
        return TD_ERR_NOMEM;
    if (!hc->stream) {
        router_oai_buf_put(&ch->text, r->out.text ? r->out.text : "", r->out.n_text);
        return ch->text.oom ? TD_ERR_NOMEM : TD_OK;
    }
    if (!r->out.n_text && !ch->echo_pending && !ch->n_lps)
        return TD_OK; /* ids whose text is held back (a stop string may begin there) */
    if (hc->out.n) { /* another choice's bytes wait for the connection: this waits behind them */
        ch->n_lps = 0; /* r->out keeps them */
        return TD_ERR_BUSY;
    }
    td_status_t st = stream_begin(hc);
    if (st != TD_OK) {
        ch->n_lps = 0;
        return st == TD_ERR_CLOSED ? TD_ERR_CANCELLED : st; /* closing: on_abort ends r */
    }
    size_t lp_offset = ch->lp_offset;
    choice_chunk(ch, r, NULL, &hc->out);
    if (hc->out.oom) {
        hc->out.n = 0;
        hc->out.oom = false;
        return TD_ERR_NOMEM;
    }
    st = td_http_stream_write(hc->req, hc->out.p, hc->out.n);
    hc->out.n = 0;
    if (st == TD_OK) {
        ch->first = false;
        ch->lp_first_null = false;
        ch->echo_pending = false;
    } else {
        ch->lp_offset = lp_offset; /* the same entries go again with the retry */
    }
    ch->n_lps = 0; /* r->out keeps them when the send did not go */
    return st == TD_ERR_CLOSED ? TD_ERR_CANCELLED : st;
}

static const char *reason_name(router_finish_t reason)
{
    return reason == ROUTER_FINISH_LENGTH ? "length" : "stop";
}

/* OpenAI's finish_reason "tool_calls" ("function_call" for `functions`) when ch's output
 * ended with calls. */
static const char *finish_name(const http_choice_t *ch, router_finish_t reason)
{
    if (ch->tools && td_tools_parser_calls(ch->tools) && reason != ROUTER_FINISH_LENGTH)
        return ch->rs.legacy_functions ? "function_call" : "tool_calls";
    return reason_name(reason);
}

/* A whole answer with tools: choice ch's text through its parser into ch->content and
 * ch->calls (out of memory: marked on calls, answered as a 500). */
static void tools_whole(http_choice_t *ch, router_finish_t reason)
{
    td_status_t st = ch->text.oom ? TD_ERR_NOMEM
                                  : td_tools_parser_feed(ch->tools, ch->text.p ? ch->text.p : "", ch->text.n,
                                                         whole_tool_event, ch);
    if (st == TD_OK)
        st = td_tools_parser_finish(ch->tools, whole_tool_event, ch);
    router_oai_buf_put(&ch->calls, "", 0);
    if (st != TD_OK)
        ch->calls.oom = true;
    ch->reason = finish_name(ch, reason);
}

/* A stream with tools ends: the last text through the parser and what it held into *b, then
 * an empty last chunk with the finish reason. */
static void tools_last(http_choice_t *ch, router_req_t *r, router_finish_t reason, router_oai_buf_t *b)
{
    http_client_t *hc = ch->hc;
    td_status_t st = router_oai_tools_feed(ch->tools, &ch->fed, r->out.text, r->out.n_text, true, stream_tool_event, ch);
    router_oai_buf_put(b, hc->pend.p ? hc->pend.p : "", hc->pend.n);
    hc->pend.n = 0;
    if (st != TD_OK)
        b->oom = true;
    ch->reason = finish_name(ch, reason);
    router_oai_chunk(b, &ch->rs, ch->first, "", 0, NULL, ch->reason, hc->include_usage);
}

/* Every choice ended well: the whole answer, or the stream's usage and [DONE]. */
static void answer_done(http_client_t *hc)
{
    router_oai_usage_t usage = {.prompt_tokens = hc->g.sum0.prompt_tokens, .cached_tokens = hc->g.sum0.cached_tokens,
                                .completion_tokens = hc->g.completion_tokens, .migrations = hc->g.migrations};
    if (!hc->stream) {
        router_oai_buf_t b = {0};
        router_oai_response_begin(&b, &hc->ch[0].rs);
        for (int32_t i = 0; i < hc->n; i++) {
            http_choice_t *ch = &hc->ch[i];
            router_oai_buf_t full = {0}, lpb = {0};
            if (hc->echo) {
                router_oai_buf_put(&full, hc->echo, hc->echo_len);
                router_oai_buf_put(&full, ch->text.p ? ch->text.p : "", ch->text.n);
            }
            router_oai_buf_t *t = hc->echo ? &full : &ch->text;
            if (hc->tools) { /* chat: the choice's content and calls as its parser read them */
                router_oai_response_choice(&b, &ch->rs, i, ch->content.p ? ch->content.p : "", ch->content.n,
                                           ch->calls.n ? ch->calls.p : NULL, NULL, ch->reason);
                b.oom |= ch->calls.oom || ch->content.oom;
            } else {
                router_oai_response_choice(&b, &ch->rs, i, t->p ? t->p : "", t->n, NULL, lps_json(ch, 0, &lpb),
                                           ch->reason);
            }
            router_oai_buf_free(&full);
            router_oai_buf_free(&lpb);
        }
        router_oai_response_end(&b, &usage);
        respond_json(hc->req, 200, &b);
        router_oai_buf_free(&b);
        client_answered(hc);
        return;
    }
    if (hc->include_usage)
        router_oai_usage_chunk(&hc->out, &hc->ch[0].rs, &usage);
    router_oai_done(&hc->out);
    hc->closing = true;
    if (hc->out.oom) {
        hc->out.n = 0;
        hc->out.oom = false;
    }
    out_flush(hc);
}

static void http_finish(router_req_t *r, const router_summary_t *sum)
{
    http_choice_t *ch = choice_of(r);
    http_client_t *hc = ch->hc;
    ch->reason = reason_name(sum->reason);
    if (hc->logprobs && lps_append(ch, r) != TD_OK)
        hc->logprobs = false; /* out of memory: the answer goes without them */
    if (!router_choices_finished(r->client, r, sum)) /* answered already: only hc's end is left */
        return;
    if (!hc->stream) {
        router_oai_buf_put(&ch->text, r->out.text ? r->out.text : "", r->out.n_text);
        if (hc->tools)
            tools_whole(ch, sum->reason);
    } else if (stream_begin(hc) == TD_OK) {
        if (hc->tools)
            tools_last(ch, r, sum->reason, &hc->out);
        else
            choice_chunk(ch, r, ch->reason, &hc->out); /* after any bytes still waiting */
        ch->first = false;
        ch->echo_pending = false;
        ch->n_lps = 0;
    } else {
        return; /* the connection is closing: on_abort follows and frees hc */
    }
    if (router_choices_all_ended(&hc->g))
        answer_done(hc);
    else if (hc->stream)
        out_flush(hc); /* BUSY: on_writable writes the rest */
}

/* The group's first failure (router_choices_ops_t.failed): the client gets it, as a status
 * before the stream began, else as an SSE error event. */
static void http_choices_failed(router_choices_t *g, int32_t i, td_grpc_code_t code, const char *msg)
{
    http_client_t *hc = g->owner;
    (void)i;
    router_oai_error_t err;
    router_oai_error_from_code((int)code, msg, &err);
    if (!hc->began) {
        respond_error(hc->req, &err);
        client_answered(hc);
        return;
    }
    /* mid-stream: an SSE event with the error, as OpenAI's servers send one */
    router_oai_buf_puts(&hc->out, "data: ");
    router_oai_error_json(&hc->out, &err);
    router_oai_buf_puts(&hc->out, "\n\n");
    router_oai_done(&hc->out);
    hc->closing = true;
    if (hc->out.oom) {
        hc->out.n = 0;
        hc->out.oom = false;
    }
    out_flush(hc);
}

static void http_fail(router_req_t *r, td_grpc_code_t code, const char *msg)
{
    router_choices_fail(r->client, code, msg);
}

static const router_sink_ops_t http_sink = {.send = http_send, .finish = http_finish, .fail = http_fail,
                                            .prefilled = router_choices_prefilled};

static void http_on_abort(td_http_req_t *req, void *data)
{
    http_client_t *hc = data;
    (void)req;
    hc->req = NULL;
    router_choices_gone(&hc->g, false);
}

static void http_on_writable(td_http_req_t *req, void *data)
{
    http_client_t *hc = data;
    (void)req;
    if (out_flush(hc) != TD_OK || !hc->req)
        return;
    router_choices_writable(&hc->g); /* the choices that waited behind out */
}

/* Choice 0's request is open: the answer's id is its id (router_choices_ops_t.opened). */
static void http_choices_opened(router_choices_t *g, int32_t i, router_req_t *r)
{
    http_client_t *hc = g->owner;
    (void)r;
    if (i == 0)
        snprintf(hc->id, sizeof hc->id, "%s%s", hc->ch[0].rs.kind == ROUTER_OAI_CHAT ? "chatcmpl-" : "cmpl-", g->id);
}

static const router_choices_ops_t http_choices_ops = {.opened = http_choices_opened, .failed = http_choices_failed,
                                                      .closed = http_choices_closed};

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
    hc->s = s;
    hc->req = req;
    hc->n = q.n;
    hc->stream = q.stream;
    hc->include_usage = q.stream && q.include_usage;
    /* tool calls are read from the output unless tool_choice is none, or a response_format
     * constrains it (then it is that format's text) */
    hc->tools = q.tool_choice != ROUTER_OAI_TOOLS_NONE && (q.tool_choice != ROUTER_OAI_TOOLS_AUTO || !q.grammar);
    hc->tool_format = s->tool_format;
    hc->logprobs = q.logprobs >= 0 && !hc->tools; /* with tools, the answer is calls: no logprobs */
    for (int32_t i = 0; i < hc->n; i++)
        hc->ch[i] = (http_choice_t){.hc = hc, .first = true, .echo_pending = hc->echo != NULL,
                                    .rs = {.kind = kind, .id = hc->id, .model = s->proc.cfg.model_name,
                                           .created = (int64_t)time(NULL), .index = i,
                                           .legacy_functions = q.legacy_functions}};
    for (int32_t i = 0; hc->tools && i < hc->n; i++)
        if (td_tools_parser_create(s->tool_format, q.parallel_tool_calls ? 0 : 1, (size_t)1 << 20, &hc->ch[i].tools) ==
            TD_OK) {
            td_tools_parser_stream_args(hc->ch[i].tools, hc->stream); /* a stream's calls in pieces */
        } else {
            router_oai_error_set(&err, 500, "server_error", NULL, NULL, "router: out of memory");
            router_count_outcome(s, "exhausted");
            goto err_respond;
        }
    router_req_spec_t spec = {.gp = q.gp, .prompt_ids = q.prompt_ids, .prompt = q.prompt,
                              .prompt_text_len = q.prompt_len, .messages = q.messages, .n_messages = q.n_messages,
                              .priority = kt.priority, .cache_salt = kt.cache_salt,
                              .grammar = q.grammar, .tools_json = q.tools_json};
    if (router_choices_init(&hc->g, s, hc->n, &spec, &http_sink, &http_choices_ops, hc) != TD_OK) {
        router_oai_error_set(&err, 500, "server_error", NULL, NULL, "router: out of memory");
        router_count_outcome(s, "exhausted");
        goto err_respond;
    }
    td_http_req_set_data(req, hc);
    td_http_req_on_abort(req, http_on_abort);
    td_http_req_on_writable(req, http_on_writable);
    router_choices_start(&hc->g, &spec); /* may answer req (refused) */
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
