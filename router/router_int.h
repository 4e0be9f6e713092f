/*
 * router_int: the router's private state, shared by its files (router/router_*.c) and by
 * nothing else: the config (router_config_t), one peer per registered node
 * (router_peer_t), one request per Generate call (router_req_t) and the process's state
 * struct (router_state_t), built in router_main.c. The functions below are the seams
 * between the router's files; each is documented where it is defined.
 */
#ifndef ROUTER_INT_H
#define ROUTER_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "control.pb-c.h"
#include "router_policy.h"
#include "router_queue.h"
#include "router_registry.h"
#include "tandem.pb-c.h"
#include "td_auth.h"
#include "td_chat_source.h"
#include "td_tools.h"
#include "td_gen_params.h"
#include "td_grpc.h"
#include "td_hash.h"
#include "td_http.h"
#include "td_list.h"
#include "td_metrics.h"
#include "td_node.h"
#include "td_sampler.h"
#include "td_tokenizer.h"
#include "td_xfer.h"

#define ROUTER_DEADLINE_SLACK_NS 10000000ll /* a reset this close to the deadline counts as the deadline */
/* A stream refused a send (BUSY) and is still unwritable this many loop turns later: its
 * client is not reading, and a backlog past max-backlog-tokens ends it. A refusal within
 * one turn is normal (a burst of StepBatches read at once fills a small send queue before
 * the turn's write); the gRPC layer's prepare hook writes and tells a reading client's
 * call "writable" before the next poll. */
#define ROUTER_BACKLOG_GRACE_TURNS 2

/* The router's own keys; the common ones (model name, host, advertise, gateway and metrics
 * ports, log level) are td_node's. */
typedef struct router_config {
    const char *tokenizer;     /* tokenizer path (a model's tokenizer.bin / .json / dir) */
    int64_t control_port;
    int64_t max_active;        /* requests on nodes at once; more wait in the queue */
    int64_t max_queue;         /* requests waiting at most; beyond → RESOURCE_EXHAUSTED */
    int64_t request_timeout_ms;/* deadline of a request whose client gave none */
    int64_t max_backlog_tokens;/* tokens held for a client not reading; beyond → RESOURCE_EXHAUSTED */
    int64_t send_queue_bytes;  /* per gateway stream: queued bytes before tokens wait in the backlog */
    int64_t default_max_tokens;
    int64_t lease_ms;          /* lease and Prefill bound beyond the estimated prefill wait */
    int64_t max_prefill_wait_ms; /* a busy prefill node takes no prompt it would reach later */
    const char *prefill_policy;/* disaggregated | conditional (router_policy.h, rule 5) */
    const char *tool_call_format; /* auto (from the chat template) | hermes | llama3_json | mistral | none */
    int64_t tpot_objective_ms; /* conditional: longest decode step a local prefill's chunks may make */
    int64_t ttft_objective_ms; /* conditional: local only when remote would pass it (0: when sooner) */
    int64_t xfer_fixed_us;     /* conditional: a KV transfer's fixed cost */
    int64_t xfer_mb_per_s;     /* conditional: KV transfer bandwidth, MB/s */
    int64_t max_tokenizing;    /* text prompts being encoded and HTTP bodies parsed off the loop at most */
    int64_t rpc_timeout_ms;
    int64_t heartbeat_ms;
    int64_t heartbeat_timeout_ms;
    int64_t max_nodes;
    int64_t http_port;         /* the OpenAI HTTP API (router_http.c); -1 = off, 0 = any */
    int64_t http_max_body_bytes;
    int64_t http_max_connections;
    int64_t gateway_max_connections; /* the gRPC gateway's cap (both caps fit the open-file limit) */
    int64_t gateway_idle_timeout_ms; /* a gateway connection with no call running this long is closed */
    int64_t http_idle_timeout_ms;
    int64_t http_request_timeout_ms;
    bool http_metrics;         /* /metrics on the HTTP API port too (default: the metrics port only) */
    bool share_prefix_cache;   /* every API key's prompts share one prefix cache (no salt) */
    int64_t max_body_bytes_in_flight; /* request bodies held across both front doors at most */
    int64_t body_timeout_ms;   /* a request's first byte -> its whole body in (408 / reset) */
    int64_t max_migrations;    /* moves of a stream whose pair was lost after it sent tokens */
} router_config_t;

typedef struct router_peer {
    struct router_state *s;
    td_grpc_channel_t *ch;
    td_grpc_client_call_t *steps;
    uint8_t *xfer_desc;
    size_t xfer_desc_len;
    uint64_t generation;
    bool admit_refused;        /* refused an Admit: believed full until its next heartbeat or a
                                * finish there (its StepBatch free counts do not lift it, so a
                                * node refusing for want of request slots is not asked per step) */
} router_peer_t;

/* Where a request is in its life; the diagram and the one function that moves a request from
 * state to state (req_move) are in router_request.c. */
typedef enum {
    REQ_NEW,        /* built by the gateway, not yet submitted */
    REQ_TOKENIZING, /* its long text prompt is being encoded on libuv's thread pool (tok_job_t;
                     * a short one is encoded at once, router_req_submit) */
    REQ_QUEUED,     /* in the admission queue, waiting for room */
    REQ_RETRY,      /* off its node after a failure or an Admit refusal: placed next turn */
    REQ_ADMIT,      /* on a pair: Admit sent to the decode node */
    REQ_PREFILL,    /* Prefill sent to the prefill node, with the lease */
    REQ_RUNNING,    /* prefilled: tokens come from the decode node's steps */
    REQ_ENDED,      /* freed (never seen: the move to it frees the request) */
} router_req_state_t;

/* Where token index 0 came from: the Prefill stream's FIRST_TOKEN or the lease's first
 * SEQ_EVENT_TOKEN entry, whichever came first (the other is dropped); WITHHELD: the
 * prefill's first token is a stop id, so the decode node's finish entry ends the request. */
typedef enum { FIRST_NONE, FIRST_FROM_PREFILL, FIRST_FROM_DECODE, FIRST_WITHHELD } router_first_t;

typedef struct router_state router_state_t;
typedef struct tok_job tok_job_t;
typedef struct router_req router_req_t;

/* The output of a request that its client has not been sent yet (its front door was over
 * its send bound, or the StepBatch is still being read): flushed as one message. Arrays
 * grow by doubling and are kept across flushes; each token appends one entry to every
 * per-token array (keep them in step: out_reserve / out_clear in router_relay.c). */
typedef struct router_out {
    uint32_t *ids;             /* [n] generated token ids */
    uint32_t n, cap;
    char *text;                /* [n_text] + NUL: their text, stop strings held back */
    size_t n_text, cap_text;
    td_token_logprob_t *lps;   /* [n] with r->logprobs.on (else NULL): token i's */
    td_token_logprob_t *prompt_lps; /* [n_prompt_lps] from the Prefill stream when asked:
                                  sent with the next message (the first), then freed */
    uint32_t n_prompt_lps;
} router_out_t;

/* How a request ended well (the front door names it: gRPC's FinishReason, OpenAI's "stop"
 * for STOP and EOS, "length"). */
typedef enum { ROUTER_FINISH_LENGTH, ROUTER_FINISH_STOP, ROUTER_FINISH_EOS } router_finish_t;

/* What the last message of a request carries beside its pending output. */
typedef struct router_summary {
    router_finish_t reason;
    uint32_t prompt_tokens, completion_tokens, cached_tokens;
    uint32_t migrations;       /* times the stream moved to another pair (router_req_t's) */
    double queue_s, prefill_s, transfer_s, first_token_s, per_token_s, total_s;
    bool prefill_local;        /* prefilled on the decode (or unified) node itself (the last pair) */
    bool prefill_peer;         /* prefilled on another decode node (pick.peer, the last pair) */
    char prefill_node[TD_NODE_ID_MAX], decode_node[TD_NODE_ID_MAX]; /* the last pair's ids ("": gone) */
} router_summary_t;

/*
 * A front door's side of a request (its sink): the gRPC gateway's Generate call
 * (router_gateway.c) or an OpenAI HTTP request (router_http.c). The lifecycle and the
 * relay talk to the client only through these, so both front doors share admission,
 * deadlines, cancellation and relay. r->client is the front door's handle, NULL once the
 * client is answered or gone; the ops are called only while it is set.
 *   send:   r->out as one message. TD_OK: queued (the relay clears r->out); TD_ERR_BUSY: over
 *           the client's send bound, r->out kept until the front door calls
 *           router_req_writable; anything else: not sent, the client is going (its front door
 *           ends r through router_req_client_gone).
 *   finish: r->out and the summary as the last message; answers the client (r->client is
 *           cleared by the caller).
 *   fail:   answers the client with an error (code: the router's vocabulary, gRPC's codes;
 *           the HTTP front door maps them to statuses), whatever was sent before.
 *   prefilled: optional (NULL: none): r's prompt KV is on its decode node (the Prefill call
 *           ended well; r is RUNNING). The HTTP front door starts the other choices of an
 *           n > 1 request then, so they find the prompt's blocks in the prefix caches. It
 *           must not end r or any other request from inside (it is called from r's node
 *           call); it may only note and defer.
 * The front door tells the lifecycle about its client with router_req_writable and
 * router_req_client_gone.
 */
typedef struct router_sink_ops {
    td_status_t (*send)(router_req_t *r);
    void (*finish)(router_req_t *r, const router_summary_t *sum);
    void (*fail)(router_req_t *r, td_grpc_code_t code, const char *msg);
    void (*prefilled)(router_req_t *r);
} router_sink_ops_t;

/* A new request as a front door hands it over (router_req_open), its parameters checked by
 * that front door (td_gen_params_validate or _check: the router's one check of them).
 * Strings and arrays are borrowed for the call. */
typedef struct router_req_spec {
    td_gen_params_t gp;          /* valid (td_gen_params_validate) */
    const char *request_id;      /* the client's, or NULL/"" (the router numbers it) */
    const uint32_t *prompt_ids;  /* [gp.prompt_len] when !gp.prompt_is_text */
    const char *prompt;          /* a text prompt ([prompt_text_len] bytes), or NULL */
    size_t prompt_text_len;
    const td_chat_message_t *messages; /* [n_messages] a conversation instead of a prompt */
    size_t n_messages;
    const uint32_t *stop_ids;    /* [gp.n_stop_ids] */
    int32_t priority;
    uint64_t cache_salt;         /* router_key_terms_t's */
    int64_t timeout_ms;          /* the client's deadline from now; 0: request-timeout-ms */
    const char *grammar;         /* GBNF the output must follow (checked by td_gram_compile), or NULL */
    const char *tools_json;      /* with messages: OpenAI's tools array as JSON text for the chat
                                  * template, or NULL */
} router_req_spec_t;

struct router_req {
    td_list_t link;                 /* in router_state_t.reqs */
    router_queue_entry_t qe;        /* in the admission queue while REQ_QUEUED */
    router_state_t *s;
    const router_sink_ops_t *sink; /* the front door's (gRPC or HTTP) */
    void *client;              /* its handle for r; NULL once answered or gone */
    char id[64];
    int32_t *prompt;
    int32_t n_prompt;
    int32_t max_tokens;
    td_sampling_t sampling;    /* valid (the front door's td_gen_params_validate); in protobuf only in the
                                * node calls' messages (td_node_sampling_to_proto) */
    uint32_t stop_ids[TD_GEN_MAX_STOP_IDS];
    size_t n_stop_ids;
    bool ignore_eos;           /* the model's EOS ids do not end the output (td_gen_params_t's) */
    double tpot_objective_s;   /* the client's TPOT objective (td_gen_params_t's; 0: the router's) */
    char *grammar;             /* GBNF the output follows (AdmitRequest/PrefillRequest.grammar), or NULL */
    td_stop_t *stop;
    td_detok_t detok;
    bool from_text;            /* the prompt was text the router tokenized (not prompt_ids) */
    tok_job_t *tok_job;        /* while REQ_TOKENIZING: the job encoding the text */
    uint32_t n_no_text;        /* generated ids the router's tokenizer cannot detokenize (the
                                * model's vocabulary is larger): sent with empty text */
    uint32_t first_no_text;    /* the first of them (logged once, when the request ends) */
    router_pick_t pick;
    router_pair_t tried[2];
    int32_t n_tried;
    char retry_why[160];       /* why the last pair failed: the error names it if no other does */
    router_req_state_t state;
    int32_t priority;
    uint64_t cache_salt;       /* its tenant's (router_key_terms_t): seeds the prefix hashes of the
                                * pick, the Admit and the Prefill */
    int64_t deadline_ns;       /* td_now_ns() clock; bounds queue, Admit, Prefill, decoding */
    router_first_t first_src;
    uint32_t first_token;
    td_logprobs_want_t logprobs; /* what the client asked (td_gen_params_t's) */
    bool first_lp_wait;        /* token 0 came first from the decode node, which has no
                                * logprob for it: output held until the Prefill stream's */
    bool finish_deferred;      /* the decode node finished the sequence during first_lp_wait: */
    router_finish_t deferred_reason; /* req_finish runs once the Prefill stream's logprob came */
    uint32_t decode_tokens;    /* SEQ_EVENT_TOKEN entries seen for the current lease */
    router_out_t out;          /* output not yet sent to the client */
    bool blocked;              /* the last send was refused (BUSY); wait for writable */
    uint64_t blocked_turn;     /* s->turn when it became blocked */
    bool dirty;                /* output appended during this StepBatch */
    bool sent_msg;             /* a message went out (gRPC's first carries the id) */
    uint64_t decode_gen;
    uint64_t lease_id;
    bool have_lease;
    bool call_has_req_deadline; /* the pending node call's deadline is the request's */
    int64_t lease_ttl_ms;       /* this pick's lease and Prefill bound (lease_ttl) */
    uint32_t *blocks;          /* the lease's block ids, from Admit */
    size_t n_blocks;
    uint8_t xfer_token[TD_XFER_TOKEN_BYTES]; /* the lease's data-plane token, from Admit,
                                  passed on to the prefill node (opaque here) */
    size_t xfer_token_len;     /* 0: none (a unified node, or a decode node without one) */
    td_grpc_client_call_t *pending;
    uint32_t completion;       /* tokens sent: once one is, the request is the client's: a
                                * lost pair moves it (a migration), it is not retried afresh */
    uint32_t *gen;             /* [completion] every token sent (or pending), for a migration */
    uint32_t cap_gen;
    uint32_t resumed;          /* tokens the client had when this pair was picked (0: the first
                                * pair, or retries before any token): the decode node replays
                                * them (AdmitRequest.replay_ids), its first entry is token
                                * `resumed`, the Prefill stream's first token is not relayed */
    int32_t n_migrations;      /* moves so far (at most max-migrations) */
    uint64_t t_lost;           /* when the last pair was lost, until the next token is sent */
    uint32_t cached;
    uint64_t t_arrival, t_picked, t_prefill, t_first, t_last;
    double transfer_s, prefill_s;
};

/* The per-node gauges (labels node, role), as router_state.f_node indexes them. */
typedef enum router_node_gauge {
    ROUTER_NODE_QUEUED,   /* tandem_router_node_queued_prefill_tokens */
    ROUTER_NODE_RUNNING,  /* tandem_router_node_running_sequences */
    ROUTER_NODE_FREE,     /* tandem_router_node_kv_blocks_free */
    ROUTER_NODE_BLOCKS,   /* tandem_router_node_kv_blocks */
    ROUTER_NODE_STEP,     /* tandem_router_node_step_seconds */
    ROUTER_NODE_DRAINING, /* tandem_router_node_draining */
    ROUTER_NODE_GAUGES
} router_node_gauge_t;

struct router_state {
    td_node_t proc;        /* loop, signals, /metrics, common config */
    router_config_t cfg;
    td_rpc_budget_t body_budget; /* request bodies in flight on the gateway and the HTTP API */
    uv_timer_t tick;
    td_tokenizer_t *tok;
    td_chat_template_t *chat;  /* the model's chat template (from --tokenizer), or NULL */
    td_tools_format_t tool_format; /* how the model writes tool calls (td_tools_detect, or the flag) */
    router_registry_t *reg;
    router_policy_config_t policy;
    uint8_t cache_salt_key[TD_AUTH_SALT_KEY_BYTES]; /* tenants' salts are made under it
                                                     * (td_auth_salt_key: from the cluster secret, else random) */
    router_peer_t *peers;
    td_list_t reqs;            /* every request (router_req_t.link), newest first */
    int32_t n_retry;           /* requests in REQ_RETRY, placed by the pump's next run */
    int32_t n_active;          /* requests on nodes (max-active bound) */
    router_queue_t queue;
    td_hash_t leases;          /* the lease map (router_lease.c): requests by (decode, lease id) */
    uv_idle_t pump_idle;       /* runs pump() after the callback that made room */
    uv_prepare_t turn_prepare; /* counts loop turns (turn) */
    uint64_t turn;
    bool pump_wanted;          /* room may have appeared: try the queue's head after this callback */
    int32_t n_tokenizing;      /* tok_job_t and router_http parse jobs on the thread pool (max-tokenizing) */
    uint64_t next_id;
    td_grpc_server_t *gateway, *control;
    td_http_server_t *http;    /* the OpenAI API and /metrics (--http-port), or NULL */
    int64_t started_unix;      /* for GET /v1/models' "created" */
    td_metrics_t *metrics;
    td_metric_family_t *f_requests;
    td_metric_family_t *f_placement; /* tandem_router_prefill_placement_total{where, reason} */
    td_metric_t *m_ttft, *m_tpot, *m_active, *m_tokens, *m_retries, *m_nodes_prefill, *m_nodes_decode,
        *m_nodes_unified;
    td_metric_t *m_queue_depth, *m_queue_s, *m_first_mismatch;
    td_metric_t *m_migrations, *m_migration_s; /* streams moved; loss to the next token sent */
    /* what `tandem plan --metrics` reads: arrivals, prompt and output lengths, and each
     * node's load as its last heartbeat reported it (labels node, role) */
    td_metric_t *m_arrived, *m_prompt_tokens, *m_output_tokens;
    td_metric_family_t *f_node[ROUTER_NODE_GAUGES]; /* router_node_gauge_t: registered together,
                                                       set together, removed together */
    bool shutting_down;
    bool handles_up;
    char refused[320];         /* the last registration refused, logged once ("id: reason") */
};

/* On a node: counted in n_active (max-active), from the Admit until it ends or fails over. */
static inline bool router_req_on_node(const router_req_t *r)
{
    return r->state == REQ_ADMIT || r->state == REQ_PREFILL || r->state == REQ_RUNNING;
}

#define REQ_OF_QE(e) ((router_req_t *)((char *)(e) - offsetof(router_req_t, qe)))

/* router_request.c: the request lifecycle */
void router_want_pump(router_state_t *s);
void router_count_outcome(router_state_t *s, const char *outcome);

/* What the key in `authorization` makes of a request (docs/security.md "Tenants"). */
typedef struct router_key_terms {
    int32_t priority;    /* `asked` (the client's priority.value; 0 when it gives none) capped at
                            the key's priority=N when its line in the API keys file has one */
    uint64_t cache_salt; /* its tenant's prefix-cache salt (td_auth_tenant_salt under
                            cache_salt_key); 0 without API keys or with --share-prefix-cache */
} router_key_terms_t;

/* *terms_p for a request of the key in `authorization`: an uncounted, constant-time re-check
 * of the key (the gate counted it). Loop thread. Errors: TD_ERR_NOMEM (the salt's HMAC
 * failed; *terms_p untouched). */
td_status_t router_key_terms(router_state_t *s, const char *authorization, int32_t asked, router_key_terms_t *terms_p);
td_status_t router_req_open(router_state_t *s, const router_req_spec_t *spec, td_grpc_code_t *code_p,
                            char *why, size_t why_cap, router_req_t **r_p);
void router_req_submit(router_req_t *r, const router_req_spec_t *spec);
void router_req_writable(router_req_t *r);
void router_req_client_gone(router_req_t *r, bool deadline);
void router_req_end(router_req_t *r);
void router_req_fail(router_req_t *r, td_grpc_code_t code, const char *msg, const char *outcome);
void router_req_retry_or_fail(router_req_t *r, td_grpc_code_t code, const char *why);
void router_req_lost(router_req_t *r, const char *why);
void router_decode_lost(router_state_t *s, int32_t d, const char *why);

/* router_lease.c: the lease map */
void router_lease_set(router_req_t *r, uint64_t lease);
void router_lease_forget(router_req_t *r);
router_req_t *router_lease_find(router_state_t *s, int32_t decode, uint64_t gen, uint64_t lease);
void router_lease_release(router_req_t *r, Tandem__Control__V1__ReleaseRequest__Reason why);

/* router_relay.c: tokens from the nodes to the gateway stream */
/* now: td_now_ns() when the output became ready (the TTFT/TPOT it is accounted at) */
void router_out_flush(router_req_t *r, uint64_t now);
void router_req_finish(router_req_t *r, router_finish_t reason);
void router_first_from_prefill(router_req_t *r, const Tandem__Control__V1__PrefillResponse *p);
bool router_backlog_over(const router_req_t *r);
void router_req_fail_slow(router_req_t *r);
void router_on_steps_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data);
void router_on_steps_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data);

/* router_http.c: the OpenAI HTTP API (td_http_head_cb, td_http_handler_cb; data is the
 * router_state_t) */
void router_http_head(void *data, td_http_req_t *req);
void router_http_handler(void *data, td_http_req_t *req);
size_t router_http_error_body(void *data, int status, const char *message, char *out, size_t cap,
                              const char **content_type);

/* router_control.c: the Registry API (tandem.control.v1.Registry) and the node peers */
void router_print_nodes(router_state_t *s);
void router_peer_drop(router_state_t *s, int32_t idx);
void router_node_gone(router_state_t *s, int32_t idx, const char *why, bool leave);
/* Sets the per-node load gauges of node idx from its heartbeat (router_control.c). */
void router_node_load_metrics(router_state_t *s, int32_t idx, const td_node_load_t *l);
void on_register(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data);
void on_heartbeat(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data);

/* router_gateway.c: the gateway API (tandem.v1.Generation, grpc.health.v1.Health) */
void on_generate(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data);
void on_list_models(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data);
void on_cluster_status(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data);
void on_health(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data);

#endif /* ROUTER_INT_H */
