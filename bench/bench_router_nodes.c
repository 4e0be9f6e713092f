/*
 * bench_router_nodes: the no-op nodes of `tandem bench router` (bench_router.c says what the
 * benchmark measures): a decode node that leases instantly and streams one token per live
 * lease per loop turn, a prefill node that answers FIRST_TOKEN then KV_DELIVERED at once,
 * both speaking the real control protocol (td_node_fake), run in a forked child process.
 */
#include "bench_router.h"

/* ---- no-op decode node: leases and steps ------------------------------------------------- */

static rb_lease_t *rb_lease_find(rb_state_t *s, uint64_t id)
{
    uint32_t slot = (uint32_t)(id & 0xffffffffu);
    if (slot >= s->n_leases || s->leases[slot].id != id || !id)
        return NULL;
    return &s->leases[slot];
}

static rb_lease_t *rb_lease_new(rb_state_t *s)
{
    uint32_t slot;
    if (s->free_head != UINT32_MAX) {
        slot = s->free_head;
        s->free_head = s->leases[slot].next_free;
    } else {
        if (s->n_leases == s->cap_leases) {
            uint32_t cap = s->cap_leases ? 2 * s->cap_leases : 1024;
            rb_lease_t *p = realloc(s->leases, cap * sizeof *p);
            if (!p)
                return NULL;
            s->leases = p;
            s->cap_leases = cap;
        }
        slot = s->n_leases++;
    }
    rb_lease_t *l = &s->leases[slot];
    memset(l, 0, sizeof *l);
    if (++s->lease_gen == 0)
        s->lease_gen = 1;
    l->id = ((uint64_t)s->lease_gen << 32) | slot;
    l->live_idx = UINT32_MAX;
    return l;
}

static void rb_lease_free(rb_state_t *s, rb_lease_t *l)
{
    if (l->live_idx != UINT32_MAX) { /* swap-remove from the subscriber's live array */
        rb_sub_t *sub = &s->subs[l->sub];
        uint32_t last = sub->live[--sub->n_live];
        sub->live[l->live_idx] = last;
        s->leases[last].live_idx = l->live_idx;
    }
    uint32_t slot = (uint32_t)(l - s->leases);
    l->id = 0;
    l->next_free = s->free_head;
    s->free_head = slot;
}

static void on_stepper(uv_idle_t *h);

static void rb_stepper_start(rb_state_t *s)
{
    if (!s->stepping) {
        s->stepping = true;
        uv_idle_start(&s->stepper, on_stepper);
    }
}

/* One step for one subscriber: a token for every live lease that is ready, the finish
 * entry after a lease's last token. Lease state changes only if the send was accepted. */
static void rb_step_sub(rb_state_t *s, int i, bool *pending)
{
    rb_sub_t *sub = &s->subs[i];
    if (!td_node_fake_subscribed(s->decode_node, i) || td_node_fake_blocked(s->decode_node, i) || !sub->n_live)
        return;
    if (sub->n_live * 2 > s->step_cap) {
        uint32_t cap = sub->n_live * 4;
        td_node_fake_entry_t *b = realloc(s->step_buf, cap * sizeof *b);
        if (!b) {
            s->failed = true;
            return;
        }
        s->step_buf = b;
        s->step_cap = cap;
    }
    uint64_t step_no = td_node_fake_last_step(s->decode_node);
    uint32_t n = 0;
    for (uint32_t k = 0; k < sub->n_live; k++) {
        const rb_lease_t *l = &s->leases[sub->live[k]];
        if (l->ready_turn > s->turn) {
            *pending = true;
            continue;
        }
        /* a letter: one byte of text in the --http router's byte-level tokenizer */
        s->step_buf[n++] = (td_node_fake_entry_t){.lease_id = l->id, .token = (uint32_t)('a' + (step_no + k) % 26),
                                                  .event = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN};
        if (l->remaining == 1)
            s->step_buf[n++] = (td_node_fake_entry_t){
                .lease_id = l->id, .event = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_LENGTH};
    }
    if (!n)
        return;
    if (td_node_fake_step(s->decode_node, i, s->step_buf, n, RB_CAPACITY_BLOCKS) != TD_OK)
        return; /* BUSY: the writable callback resumes; gone: the subscription ended */
    for (uint32_t k = 0; k < sub->n_live;) {
        rb_lease_t *l = &s->leases[sub->live[k]];
        if (l->ready_turn > s->turn) {
            k++;
            continue;
        }
        if (--l->remaining == 0) {
            rb_lease_free(s, l); /* swaps another lease into position k */
            continue;
        }
        k++;
    }
}

static void on_stepper(uv_idle_t *h)
{
    rb_state_t *s = h->data;
    s->turn++;
    bool pending = false;
    for (int i = 0; i < 2; i++)
        rb_step_sub(s, i, &pending);
    bool work = pending;
    for (int i = 0; i < 2; i++)
        if (td_node_fake_subscribed(s->decode_node, i) && !td_node_fake_blocked(s->decode_node, i) &&
            s->subs[i].n_live)
            work = true;
    if (!work) {
        s->stepping = false;
        uv_idle_stop(h);
    }
}

static void on_steps_writable(td_node_fake_t *f, int sub)
{
    rb_stepper_start(td_node_fake_data(f));
}

static void on_admit(td_node_fake_t *f, td_grpc_call_t *call, const Tandem__Control__V1__AdmitRequest *q)
{
    rb_state_t *s = td_node_fake_data(f);
    if (!q->max_tokens || q->prompt_tokens > RB_MAX_PROMPT) {
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, "no-op decode: max_tokens 0 or prompt too long");
        return;
    }
    rb_lease_t *l = rb_lease_new(s);
    if (!l) {
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, "no-op decode: out of memory");
        return;
    }
    l->remaining = q->max_tokens;
    l->sub = strncmp(q->request_id, RB_DIRECT_PREFIX, strlen(RB_DIRECT_PREFIX)) ? RB_SUB_ROUTER : RB_SUB_DIRECT;
    /* fake block ids for the prompt (what a prefill node writes), not the whole reservation:
     * keeps messages the size they are for short prompts whatever max_tokens is */
    uint32_t blocks[RB_MAX_PROMPT / RB_BLOCK + 1];
    size_t nb = q->prompt_tokens / RB_BLOCK + 1;
    for (size_t i = 0; i < nb; i++)
        blocks[i] = (uint32_t)i;
    td_node_fake_admit_reply(call, l->id, blocks, nb);
}

static void on_release(td_node_fake_t *f, td_grpc_call_t *call, const Tandem__Control__V1__ReleaseRequest *q)
{
    rb_state_t *s = td_node_fake_data(f);
    Tandem__Control__V1__ReleaseResponse r = TANDEM__CONTROL__V1__RELEASE_RESPONSE__INIT;
    rb_lease_t *l = rb_lease_find(s, q->lease_id);
    if (l) {
        rb_lease_free(s, l);
        r.released = true;
    }
    td_grpc_call_reply(call, &r.base);
}

/* ---- no-op prefill node ------------------------------------------------------------------ */

static void on_prefill(td_node_fake_t *f, td_grpc_call_t *call, const Tandem__Control__V1__PrefillRequest *q)
{
    rb_state_t *s = td_node_fake_data(f);
    rb_lease_t *l = rb_lease_find(s, q->lease_id);
    if (!l || l->live_idx != UINT32_MAX) {
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "no-op prefill: no such lease on the decode node");
        return;
    }
    if (td_node_fake_prefill_send(call, 1, TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_FIRST_TOKEN) != TD_OK) {
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "no-op prefill: stream gone");
        return;
    }
    td_node_fake_prefill_reply(call, 1, TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_KV_DELIVERED);
    /* the lease steps from the turn after the one that writes this reply, as a decode node
     * steps a sequence only after its kv-ready */
    rb_sub_t *sub = &s->subs[l->sub];
    if (sub->n_live == sub->cap_live) {
        uint32_t cap = sub->cap_live ? 2 * sub->cap_live : 1024;
        uint32_t *p = realloc(sub->live, cap * sizeof *p);
        if (!p) {
            s->failed = true;
            return;
        }
        sub->live = p;
        sub->cap_live = cap;
    }
    l->live_idx = sub->n_live;
    sub->live[sub->n_live++] = (uint32_t)(l - s->leases);
    l->ready_turn = s->turn + 2;
    rb_stepper_start(s);
}

static void rb_load(void *data, td_node_load_t *load)
{
    rb_state_t *s = data;
    load->free_blocks = RB_CAPACITY_BLOCKS;
    load->running_seqs = 0;
    load->queued_prefill_tokens = 0;
    load->step_ms = 0;
    /* a no-op prefill is instant: a rate the router's policy never waits on (unknown, 0, it
     * takes one prompt per heartbeat while the tokens it committed there count as queued) */
    load->prefill_tok_s = 1e12;
    (void)s;
}

static td_status_t rb_node_start(rb_state_t *s, td_node_role_t role)
{
    static const td_node_fake_ops_t decode_ops = {.admit = on_admit, .release = on_release,
                                                  .writable = on_steps_writable};
    static const td_node_fake_ops_t prefill_ops = {.prefill = on_prefill};
    td_node_fake_config_t fc = td_node_fake_config_default();
    fc.max_concurrent_streams = 1u << 20;
    fc.steps = role == TD_NODE_ROLE_DECODE;
    fc.sub_router_ids[RB_SUB_DIRECT] = "bench-direct";
    td_node_fake_t **node = role == TD_NODE_ROLE_DECODE ? &s->decode_node : &s->prefill_node;
    td_status_t st = td_node_fake_create(&s->loop, &fc, role == TD_NODE_ROLE_DECODE ? &decode_ops : &prefill_ops,
                                         s, node);
    if (st != TD_OK)
        return st;
    td_node_client_config_t cc = {.router_host = s->host, .router_port = s->ctl_port, .rpc_timeout_ms = 5000,
                                      .retry_ms = 50, .max_seq_len = ROUTER_MAX_SEQ_LEN, .max_prefill_tokens = 1u << 20};
    td_node_info_t *in = &cc.info;
    snprintf(in->id, sizeof in->id, "noop-%s", role == TD_NODE_ROLE_DECODE ? "decode" : "prefill");
    in->role = role;
    snprintf(in->model, sizeof in->model, "%s", RB_MODEL);
    in->layout = (td_kv_layout_t){.model_fingerprint = 0xbe4c4, .dtype = TD_BF16, .block_size = RB_BLOCK,
                                  .n_layers = 1, .n_kv_heads = 1, .head_dim = 64, .version = TD_KV_LAYOUT_VERSION};
    snprintf(in->address, sizeof in->address, "127.0.0.1:%u", td_node_fake_port(*node));
    in->capacity_blocks = RB_CAPACITY_BLOCKS;
    in->max_batch = ROUTER_MAX_BATCH; /* no-op nodes: never the bound */
    static const uint8_t fake_xfer[8] = "noop-kv";
    if (role == TD_NODE_ROLE_DECODE) {
        cc.xfer_desc = fake_xfer;
        cc.xfer_desc_len = sizeof fake_xfer;
    }
    return td_node_client_create(&s->loop, &cc, rb_load, s,
                                     role == TD_NODE_ROLE_DECODE ? &s->decode_cli : &s->prefill_cli);
}

/* ---- the no-op nodes' process ------------------------------------------------------------ */


/* Child: one line to the parent ("ports P D", "ready", "failed: why"). */
static void rb_report(rb_state_t *s, const char *line)
{
    size_t n = strlen(line);
    while (n) {
        ssize_t w = write(s->nodes_fd, line, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return;
        line += w;
        n -= (size_t)w;
    }
}

static void on_nodes_tick(uv_timer_t *t)
{
    rb_state_t *s = t->data;
    if (!s->nodes_ready_sent && rb_nodes_up(s)) {
        rb_report(s, "ready\n");
        s->nodes_ready_sent = true;
    }
}

static void rb_nodes_close(rb_state_t *s)
{
    td_node_client_close(s->prefill_cli);
    td_node_client_close(s->decode_cli);
    s->prefill_cli = s->decode_cli = NULL;
    td_node_fake_close(s->prefill_node);
    td_node_fake_close(s->decode_node);
    s->prefill_node = s->decode_node = NULL;
    if (s->stepper_up)
        uv_close((uv_handle_t *)&s->stepper, NULL);
    if (s->wake_up)
        uv_close((uv_handle_t *)&s->wake, NULL);
    if (s->sigterm_up)
        uv_close((uv_handle_t *)&s->sigterm, NULL);
    s->stepper_up = s->wake_up = s->sigterm_up = false;
}

static void on_nodes_sigterm(uv_signal_t *h, int sig)
{
    rb_nodes_close(h->data);
}

/* The child's whole life: serve the no-op nodes until SIGTERM (or the parent's death). */
static int rb_nodes_main(rb_state_t *s)
{
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    uv_loop_init(&s->loop);
    uv_timer_init(&s->loop, &s->wake);
    s->wake.data = s;
    s->wake_up = true;
    uv_timer_start(&s->wake, on_nodes_tick, 5, 5);
    uv_idle_init(&s->loop, &s->stepper);
    s->stepper.data = s;
    s->stepper_up = true;
    uv_signal_init(&s->loop, &s->sigterm);
    s->sigterm.data = s;
    s->sigterm_up = true;
    uv_signal_start(&s->sigterm, on_nodes_sigterm, SIGTERM);
    int rc = 0;
    char line[300];
    if (rb_node_start(s, TD_NODE_ROLE_PREFILL) != TD_OK || rb_node_start(s, TD_NODE_ROLE_DECODE) != TD_OK) {
        snprintf(line, sizeof line, "failed: %s\n", td_last_error());
        rb_report(s, line);
        rb_nodes_close(s);
        rc = 1;
    } else {
        snprintf(line, sizeof line, "ports %u %u\n", td_node_fake_port(s->prefill_node),
                 td_node_fake_port(s->decode_node));
        rb_report(s, line);
    }
    uv_run(&s->loop, UV_RUN_DEFAULT);
    uv_loop_close(&s->loop);
    return rc;
}

/* Forks the no-op nodes' process (before this process starts its loop): a fork that runs
 * rb_nodes_main, not a program, so not td_child_spawn; its reports come back on a pipe. */
td_status_t rb_nodes_fork(rb_state_t *s)
{
    int fds[2];
    if (pipe(fds) != 0)
        return td_errorf(TD_ERR_IO, "bench router: pipe: %s", strerror(errno));
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        int e = errno;
        close(fds[0]);
        close(fds[1]);
        return td_errorf(TD_ERR_IO, "bench router: fork: %s", strerror(e));
    }
    if (pid == 0) {
        close(fds[0]);
        td_child_close(&s->router);
        s->router.pid = 0;
        s->nodes_fd = fds[1];
        _exit(rb_nodes_main(s));
    }
    close(fds[1]);
    s->nodes = (td_child_t){.pid = pid, .out_fd = fds[0]};
    return TD_OK;
}

/* Parent: the child's report lines. */
void rb_on_nodes_out(uv_stream_t *st, ssize_t n, const uv_buf_t *buf)
{
    rb_state_t *s = st->data;
    if (n < 0) {
        uv_read_stop(st);
        if (!s->nodes_ready) {
            td_errorf(TD_ERR_IO, "bench router: the no-op nodes' process exited (see its stderr)");
            s->failed = true;
        }
        return;
    }
    for (ssize_t i = 0; i < n; i++) {
        char ch = buf->base[i];
        if (ch != '\n') {
            if (s->nodes_len + 1 < sizeof s->nodes_line)
                s->nodes_line[s->nodes_len++] = ch;
            continue;
        }
        s->nodes_line[s->nodes_len] = '\0';
        s->nodes_len = 0;
        unsigned p, d;
        if (sscanf(s->nodes_line, "ports %u %u", &p, &d) == 2) {
            s->prefill_port = (uint16_t)p;
            s->decode_port = (uint16_t)d;
        } else if (!strcmp(s->nodes_line, "ready")) {
            s->nodes_ready = true;
        } else {
            td_errorf(TD_ERR_IO, "bench router: no-op nodes: %s", s->nodes_line);
            s->failed = true;
        }
    }
}

