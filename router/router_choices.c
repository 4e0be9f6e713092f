/*
 * router_choices: the n choices of one client request, shared by the OpenAI HTTP door and
 * the gRPC gateway (router_choices.h). Choice 0 is the client's request as it came; the
 * others are started from the idle handle once choice 0's prompt is on a pair, with its
 * token ids, and a failure or a departed client ends them all from there too: the
 * lifecycle calls the sinks from inside its own loops over requests, where starting or
 * ending another request is not safe.
 */
#include "router_choices.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_rng.h"
#include "td_util.h"

/* The group's copies (its handle is the caller's to close). */
static void choices_release(router_choices_t *g)
{
    for (size_t i = 0; i < TD_STOP_MAX_STRINGS; i++)
        free(g->stops[i]);
    free(g->stop_ids);
    free(g->grammar);
    free(g->ids);
}

static void choices_on_closed(uv_handle_t *h)
{
    router_choices_t *g = h->data;
    choices_release(g);
    g->ops->closed(g); /* frees g */
}

/* Closes g (the idle handle's close callback ends it) once the client is answered and no
 * choice runs. */
static void choices_maybe_close(router_choices_t *g)
{
    if (!g->answered || g->n_running > 0 || g->closed)
        return;
    g->closed = true;
    uv_close((uv_handle_t *)&g->idle, choices_on_closed);
}

static void choices_on_idle(uv_idle_t *h);

static void choices_defer(router_choices_t *g)
{
    if (!g->closed)
        uv_idle_start(&g->idle, choices_on_idle);
}

td_status_t router_choices_init(router_choices_t *g, router_state_t *s, int32_t n, const router_req_spec_t *spec,
                                const router_sink_ops_t *sink, const router_choices_ops_t *ops, void *owner)
{
    TD_ASSERT(n >= 1 && n <= ROUTER_CHOICES_MAX);
    *g = (router_choices_t){.s = s, .ops = ops, .sink = sink, .owner = owner, .n = n, .gp = spec->gp,
                            .priority = spec->priority, .cache_salt = spec->cache_salt};
    for (int32_t i = 0; i < n; i++)
        g->ch[i] = (router_choice_t){.g = g, .index = i};
    if (n > 1) { /* the later choices' copy of what the client sent */
        for (size_t i = 0; i < spec->gp.n_stop_strings; i++)
            if (!(g->stops[i] = strdup(spec->gp.stop_strings[i])))
                goto err_copies;
        if (spec->gp.n_stop_ids) {
            if (!(g->stop_ids = malloc(spec->gp.n_stop_ids * sizeof *g->stop_ids)))
                goto err_copies;
            memcpy(g->stop_ids, spec->stop_ids, spec->gp.n_stop_ids * sizeof *g->stop_ids);
        }
        if (spec->grammar && !(g->grammar = strdup(spec->grammar)))
            goto err_copies;
    }
    g->gp.stop_strings = (const char *const *)g->stops;
    if (spec->timeout_ms > 0)
        g->deadline_ms = uv_now(&s->proc.loop) + (uint64_t)spec->timeout_ms;
    uv_idle_init(&s->proc.loop, &g->idle); /* cannot fail on a live loop */
    g->idle.data = g;
    return TD_OK;
err_copies:
    choices_release(g);
    return TD_ERR_NOMEM;
}

uint64_t router_choices_seed(uint64_t seed, int32_t i)
{
    uint64_t x = seed + (uint64_t)i;
    return i ? td_splitmix64(&x) : seed;
}

/* Choice c failed (its request ended, or it could not start: `running` false): the first
 * failure answers the client and has the other choices end. */
static void choice_failed(router_choice_t *c, bool running, td_grpc_code_t code, const char *msg)
{
    router_choices_t *g = c->g;
    c->r = NULL;
    c->ended = true;
    g->n_running -= running;
    g->n_ended++;
    if (g->failed || g->answered) {
        choices_maybe_close(g);
        return;
    }
    g->failed = true;
    if (g->n_running > 0)
        choices_defer(g); /* the other choices end from the idle handle */
    g->ops->failed(g, c->index, code, msg);
}

void router_choices_fail(router_choice_t *c, td_grpc_code_t code, const char *msg)
{
    choice_failed(c, true, code, msg);
}

/* Opens and submits choice i with spec (its seed set here). false: it could not be opened;
 * the client is answered with why (as a failure of that choice). */
static bool choice_start(router_choices_t *g, int32_t i, router_req_spec_t *spec)
{
    router_choice_t *c = &g->ch[i];
    router_req_t *r;
    td_grpc_code_t code;
    char why[384];
    spec->gp.sampling.seed = router_choices_seed(g->gp.sampling.seed, i);
    if (router_req_open(g->s, spec, &code, why, sizeof why, &r) != TD_OK) {
        choice_failed(c, false, code, why);
        return false;
    }
    if (i == 0)
        snprintf(g->id, sizeof g->id, "%s", r->id);
    c->r = r;
    g->n_running++;
    r->sink = g->sink;
    r->client = c;
    if (g->ops->opened)
        g->ops->opened(g, i, r);
    router_req_submit(r, spec); /* may end r, answering through the sink */
    return true;
}

void router_choices_start(router_choices_t *g, router_req_spec_t *spec)
{
    choice_start(g, 0, spec);
}

/* Choice 0 has its prompt on a pair (or already finished): the others may start, from the
 * idle handle, with its token ids (r is choice 0's request). */
static void want_launch(router_choices_t *g, const router_req_t *r)
{
    if (g->launch_wanted || g->n == 1)
        return;
    g->launch_wanted = true;
    if (r->n_prompt > 0 && (g->ids = malloc((size_t)r->n_prompt * sizeof *g->ids))) {
        for (int32_t i = 0; i < r->n_prompt; i++)
            g->ids[i] = (uint32_t)r->prompt[i];
        g->n_ids = (size_t)r->n_prompt;
    }
    choices_defer(g);
}

void router_choices_prefilled(router_req_t *r)
{
    router_choice_t *c = r->client;
    if (c->index == 0)
        want_launch(c->g, r);
}

bool router_choices_finished(router_choice_t *c, router_req_t *r, const router_summary_t *sum)
{
    router_choices_t *g = c->g;
    if (c->index == 0) {
        want_launch(g, r); /* it finished before its Prefill call ended (e.g. one token) */
        g->sum0 = *sum;
    }
    c->r = NULL;
    c->ended = true;
    g->n_running--;
    g->n_ended++;
    g->completion_tokens += sum->completion_tokens;
    g->migrations += sum->migrations;
    if (g->failed || g->answered) { /* answered already: only g's end is left */
        choices_maybe_close(g);
        return false;
    }
    return true;
}

bool router_choices_all_ended(const router_choices_t *g)
{
    return g->n_ended == g->n;
}

void router_choices_answered(router_choices_t *g)
{
    g->answered = true;
    if (g->n_running > 0)
        choices_defer(g); /* the choices still running end from the idle handle */
    choices_maybe_close(g);
}

/* Ends every running choice as its client gone (a cancel: leases released). */
static void choices_end_running(router_choices_t *g, bool deadline)
{
    for (int32_t i = 0; i < g->n; i++) {
        router_req_t *r = g->ch[i].r;
        if (!r)
            continue;
        g->ch[i].r = NULL;
        g->ch[i].ended = true;
        g->n_running--;
        g->n_ended++;
        r->client = NULL;
        router_req_client_gone(r, deadline);
    }
}

void router_choices_gone(router_choices_t *g, bool deadline)
{
    g->answered = true;
    choices_end_running(g, deadline);
    choices_maybe_close(g);
}

void router_choices_writable(router_choices_t *g)
{
    for (int32_t i = 0; i < g->n && !g->closed; i++) /* the choices that waited */
        if (g->ch[i].r)
            router_req_writable(g->ch[i].r); /* may end it: g lives until its close callback */
}

/* The idle handle's work, outside the lifecycle's callbacks: after a failure (or once the
 * answer is gone) the running choices end; else the later choices start. */
static void choices_on_idle(uv_idle_t *h)
{
    router_choices_t *g = h->data;
    uv_idle_stop(h);
    if (!g->failed && !g->answered && g->launch_wanted && !g->launched) {
        g->launched = true;
        router_req_spec_t spec = {.gp = g->gp, .prompt_ids = g->ids, .stop_ids = g->stop_ids,
                                  .priority = g->priority, .cache_salt = g->cache_salt, .grammar = g->grammar};
        spec.gp.prompt_is_text = false;
        spec.gp.prompt_len = g->n_ids;
        if (g->deadline_ms) { /* what is left of the client's deadline */
            uint64_t now = uv_now(&g->s->proc.loop);
            spec.timeout_ms = (int64_t)TD_MAX(g->deadline_ms > now ? g->deadline_ms - now : 0, 1);
        }
        for (int32_t i = 1; i < g->n && !g->failed && !g->answered; i++)
            if (!g->s->shutting_down && g->n_ids)
                choice_start(g, i, &spec);
            else
                choice_failed(&g->ch[i], false, TD_GRPC_UNAVAILABLE,
                              g->n_ids ? "router shutting down" : "router: out of memory");
    }
    if (g->failed || g->answered)
        choices_end_running(g, false);
    choices_maybe_close(g);
}
