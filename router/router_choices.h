/*
 * router_choices: the n choices of one client request (OpenAI's n, GenerateRequest.n), the
 * machinery both front doors share (router_http.c, router_gateway.c). Each choice is a
 * router request of its own; choice 0 starts at once with the client's prompt, choices
 * 1..n-1 once choice 0's Prefill call ended (router_sink_ops_t.prefilled) or it finished,
 * with choice 0's prompt token ids, so their Admit and Prefill find the prompt's full
 * blocks in the decode and prefill nodes' prefix caches (docs/openai.md "Several choices").
 * Choice i samples with router_choices_seed(seed, i). The first failure of a choice answers
 * the client (the door's `failed`) and ends the others; a client that goes ends them all.
 *
 * Lifetime: a router_choices_t lives inside the door's own state for the client (the
 * `owner`), which it frees in ops->closed, called from the group's idle handle's close
 * callback once the client is answered (router_choices_answered) or gone
 * (router_choices_gone) and no choice runs. Work the lifecycle's callbacks may not do
 * (ending another request, starting the later choices) is deferred to that idle handle.
 * Everything runs on the router's loop. Each choice's router request has r->client = its
 * router_choice_t and r->sink = the door's sink, whose ops call router_choices_prefilled,
 * _finished and _fail.
 */
#ifndef ROUTER_CHOICES_H
#define ROUTER_CHOICES_H

#include "router_int.h"
#include "router_openai.h"

#define ROUTER_CHOICES_MAX ROUTER_OAI_MAX_N

typedef struct router_choices router_choices_t;

/* One choice: its router request while it runs. */
typedef struct router_choice {
    router_choices_t *g;
    router_req_t *r;           /* NULL before it starts and once it ended */
    int32_t index;
    bool ended;
} router_choice_t;

/* The front door's side of a group (owner: g->owner). */
typedef struct router_choices_ops {
    /* optional: choice i's request r was opened and is about to be submitted (choice 0: g->id
     * is set); the door notes what it keeps of r. Must not end r. */
    void (*opened)(router_choices_t *g, int32_t i, router_req_t *r);
    /* the group's first failure (choice i: code, msg) while the client is not answered yet:
     * the door answers the client with it and calls router_choices_answered. The other
     * choices end later, from the idle handle. */
    void (*failed)(router_choices_t *g, int32_t i, td_grpc_code_t code, const char *msg);
    /* the group is over: the door frees its state (and the group in it; its strings are
     * already released). */
    void (*closed)(router_choices_t *g);
} router_choices_ops_t;

struct router_choices {
    router_state_t *s;
    const router_choices_ops_t *ops;
    const router_sink_ops_t *sink;  /* every choice's request's */
    void *owner;
    char id[64];                    /* choice 0's request id (the client's name for the answer) */
    int32_t n, n_running, n_ended;
    router_choice_t ch[ROUTER_CHOICES_MAX];
    bool answered;                  /* the client was answered or went: nothing more is written */
    bool launch_wanted, launched, failed, closed;
    uv_idle_t idle;                 /* deferred work: launch the later choices, end them after a failure */
    /* usage: choice 0's summary (prompt and cached tokens, timings), every choice's tokens */
    router_summary_t sum0;
    uint32_t completion_tokens, migrations;
    /* the later choices' request (the client's is gone when they start) */
    td_gen_params_t gp;
    char *stops[TD_STOP_MAX_STRINGS];
    uint32_t *stop_ids;             /* [gp.n_stop_ids] */
    char *grammar;
    uint32_t *ids;                  /* choice 0's prompt ids [n_ids] */
    size_t n_ids;
    int32_t priority;
    uint64_t cache_salt;
    uint64_t deadline_ms;           /* the client's deadline on the loop's clock; 0: none */
};

/*
 * Sets up g for n choices (1 <= n <= ROUTER_CHOICES_MAX) of spec (the later choices' copy of
 * its parameters, stops and grammar: spec's strings stay the caller's); sink and ops are the
 * door's, owner its state holding g. The idle handle is opened last, on success only.
 * TD_ERR_NOMEM: nothing held.
 */
td_status_t router_choices_init(router_choices_t *g, router_state_t *s, int32_t n, const router_req_spec_t *spec,
                                const router_sink_ops_t *sink, const router_choices_ops_t *ops, void *owner);

/* Starts choice 0 with spec (borrowed for the call; its seed is gp's). It may answer the
 * client before it returns (refused, or through the sink). */
void router_choices_start(router_choices_t *g, router_req_spec_t *spec);

/* Choice i's sampling seed: choice 0 keeps the request's (so n = 1 and choice 0 sample
 * alike), choice i > 0 draws from td_splitmix64 of seed + i, each its own reproducible stream. */
uint64_t router_choices_seed(uint64_t seed, int32_t i);

/* The sink's prefilled op, for every door: choice 0's prompt is on a pair. */
void router_choices_prefilled(router_req_t *r);

/* The sink's finish, first: choice c ended well with sum (its usage counted). true: the door
 * writes its last message; false: the client is answered already (nothing to write). */
bool router_choices_finished(router_choice_t *c, router_req_t *r, const router_summary_t *sum);

/* Every choice ended (the last finished: the door ends the answer). */
bool router_choices_all_ended(const router_choices_t *g);

/* The sink's fail: choice c failed; the first failure goes to ops->failed. */
void router_choices_fail(router_choice_t *c, td_grpc_code_t code, const char *msg);

/* The client is answered: the group closes once no choice runs. */
void router_choices_answered(router_choices_t *g);

/* The client went (a cancel, a closed connection; `deadline`: its own deadline): every
 * running choice ends as a cancel, its lease released. Not from the lifecycle's callbacks. */
void router_choices_gone(router_choices_t *g, bool deadline);

/* The client's stream drained: every running choice's pending output goes out. */
void router_choices_writable(router_choices_t *g);

#endif
