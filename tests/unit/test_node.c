/*
 * test_router_proc: the process skeleton's config and address rules, without starting a
 * process: common keys with a process's own table, defaults, --help, bad values, the
 * advertised address (defaults to --host; a wildcard host without --advertise, or a
 * wildcard --advertise, refused naming --advertise), a node's --model and --router, and
 * a shutdown before anything was served (the process's callback once, the loop closes),
 * and the one reading of a control call's sampling parameters and log-probabilities both
 * nodes and the router use.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "td_node.h"
#include "td_status.h"

typedef struct fake {
    int64_t kv_blocks;
    int shutdowns;
} fake_t;

static void on_shutdown(void *data)
{
    ((fake_t *)data)->shutdowns++;
}

static int32_t busy(void *data)
{
    return 0;
}

/* Runs td_node_configure over argv (NULL-terminated, argv[0] "tandem"). */
static bool configure(td_node_t *p, fake_t *f, td_node_kind_t kind, const char **argv, int *rc)
{
    int argc = 0;
    while (argv[argc])
        argc++;
    memset(p, 0, sizeof *p);
    const td_opt_t keys[] = {TD_OPT_INT("kv-blocks", &f->kv_blocks, 1, 1 << 20, "blocks")};
    td_node_spec_t spec = {.prog = kind == TD_NODE_NODE ? "decode" : "router", .kind = kind,
                               .on_shutdown = on_shutdown, .busy = busy, .data = f};
    return td_node_configure(p, &spec, keys, 1, argc, (char **)argv, rc);
}

static void done(td_node_t *p)
{
    td_node_stop(p);
    td_node_free(p);
}

Test(td_node, node_defaults_and_own_keys)
{
    td_node_t p;
    fake_t f = {.kv_blocks = 7};
    int rc = -1;
    const char *argv[] = {"tandem", "--model", "m.bin", "--kv-blocks", "9", NULL};
    cr_assert(configure(&p, &f, TD_NODE_NODE, argv, &rc), "%s", td_last_error());
    cr_assert_str_eq(p.cfg.host, "127.0.0.1");
    cr_assert_str_eq(p.cfg.advertise, "127.0.0.1", "advertise defaults to host");
    cr_assert_str_eq(p.cfg.node_id, "decode0");
    cr_assert_str_eq(p.cfg.model_name, "default");
    cr_assert_str_eq(p.router_host, "127.0.0.1");
    cr_assert_eq(p.router_port, 7070);
    cr_assert_eq(f.kv_blocks, 9);
    done(&p);
    cr_assert_eq(f.shutdowns, 1, "stop shuts down once when nothing ran");
}

Test(td_node, advertise_separate_from_host)
{
    td_node_t p;
    fake_t f = {0};
    int rc = -1;
    const char *argv[] = {"tandem", "--model", "m", "--host", "0.0.0.0", "--advertise", "10.1.2.3",
                          "--router", "10.0.0.1:9000", "--insecure", NULL};
    cr_assert(configure(&p, &f, TD_NODE_NODE, argv, &rc), "%s", td_last_error());
    cr_assert_str_eq(p.cfg.host, "0.0.0.0");
    cr_assert_str_eq(p.cfg.advertise, "10.1.2.3");
    cr_assert_str_eq(p.router_host, "10.0.0.1");
    cr_assert_eq(p.router_port, 9000);
    done(&p);
}

/* Off loopback without a cluster secret the control plane would be open to anyone: refused
 * (exit 2, the message naming the secret and --insecure) unless --insecure; loopback needs
 * nothing. */
Test(td_node, open_control_plane_off_loopback_needs_insecure)
{
    const char *refused[][8] = {
        {"tandem", "--model", "m", "--host", "10.0.0.5", NULL},
        {"tandem", "--model", "m", "--host", "0.0.0.0", "--advertise", "10.0.0.5", NULL},
        {"tandem", "--model", "m", "--host", "fd00::5", NULL},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        td_node_t p;
        fake_t f = {0};
        int rc = -1;
        cr_assert_not(configure(&p, &f, TD_NODE_NODE, refused[i], &rc), "case %zu accepted", i);
        cr_assert_eq(rc, 2);
        cr_assert(strstr(td_last_error(), "--cluster-secret-file") && strstr(td_last_error(), "--insecure"),
                  "case %zu: '%s'", i, td_last_error());
        done(&p);
    }
    const char *accepted[][8] = {
        {"tandem", "--model", "m", "--host", "10.0.0.5", "--insecure", NULL},
        {"tandem", "--model", "m", "--host", "127.0.0.2", NULL},
        {"tandem", "--model", "m", "--host", "::1", NULL},
    };
    for (size_t i = 0; i < sizeof accepted / sizeof accepted[0]; i++) {
        td_node_t p;
        fake_t f = {0};
        int rc = -1;
        cr_assert(configure(&p, &f, TD_NODE_NODE, accepted[i], &rc), "case %zu: %s", i, td_last_error());
        done(&p);
    }
    td_node_t p;
    fake_t f = {0};
    int rc = -1;
    const char *router_argv[] = {"tandem", "--host", "0.0.0.0", "--advertise", "10.0.0.5", NULL};
    cr_assert_not(configure(&p, &f, TD_NODE_ROUTER, router_argv, &rc));
    cr_assert_eq(rc, 2);
    cr_assert(strstr(td_last_error(), "register as a node"), "%s", td_last_error());
    cr_assert(td_node_is_loopback("127.9.8.7") && td_node_is_loopback("[::1]"));
    cr_assert_not(td_node_is_loopback("0.0.0.0") || td_node_is_loopback("::") || td_node_is_loopback("10.0.0.1") ||
                  td_node_is_loopback("::2") || td_node_is_loopback(NULL));
}

Test(td_node, wildcard_host_needs_advertise)
{
    const char *cases[][8] = {
        {"tandem", "--model", "m", "--host", "0.0.0.0", NULL},
        {"tandem", "--model", "m", "--host", "::", NULL},
        {"tandem", "--model", "m", "--host", "127.0.0.1", "--advertise", "0.0.0.0", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        td_node_t p;
        fake_t f = {0};
        int rc = -1;
        cr_assert_not(configure(&p, &f, TD_NODE_NODE, cases[i], &rc), "case %zu accepted", i);
        cr_assert_eq(rc, 2);
        cr_assert(strstr(td_last_error(), "--advertise"), "case %zu: '%s' does not name --advertise", i,
                  td_last_error());
        done(&p); /* no loop: no-op */
        cr_assert_eq(f.shutdowns, 0);
    }
    td_node_t p;
    fake_t f = {0};
    int rc = -1;
    const char *router_argv[] = {"tandem", "--host", "0.0.0.0", NULL};
    cr_assert_not(configure(&p, &f, TD_NODE_ROUTER, router_argv, &rc));
    cr_assert_eq(rc, 2);
}

Test(td_node, help_bad_values_and_node_requirements)
{
    struct {
        td_node_kind_t kind;
        const char *argv[8];
        int rc;
    } cases[] = {
        {TD_NODE_NODE, {"tandem", "--help", NULL}, 0},
        {TD_NODE_ROUTER, {"tandem", "--help", NULL}, 0},
        {TD_NODE_NODE, {"tandem", NULL}, 2},                                   /* no --model */
        {TD_NODE_NODE, {"tandem", "--model", "m", "--router", "nohost", NULL}, 2},
        {TD_NODE_NODE, {"tandem", "--model", "m", "--log-level", "loud", NULL}, 2},
        {TD_NODE_NODE, {"tandem", "--model", "m", "--port", "70000", NULL}, 2},
        {TD_NODE_ROUTER, {"tandem", "--model", "m", NULL}, 2},                 /* a node key */
        {TD_NODE_ROUTER, {"tandem", "--kv-blocks", "0", NULL}, 2},
        /* --check-config: checked and done, nothing started (no model, secret or loop) */
        {TD_NODE_NODE, {"tandem", "--model", "m", "--check-config", NULL}, 0},
        {TD_NODE_NODE, {"tandem", "--model", "m", "--cluster-secret-file", "/nonexistent", "--check-config", NULL}, 0},
        {TD_NODE_NODE, {"tandem", "--model", "m", "--host", "0.0.0.0", "--check-config", NULL}, 2},
        {TD_NODE_NODE, {"tandem", "--model", "m", "--drain-timeout-ms", "0", "--check-config", NULL}, 2},
        {TD_NODE_ROUTER, {"tandem", "--check-config", NULL}, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        td_node_t p;
        fake_t f = {0};
        int rc = -1;
        cr_assert_not(configure(&p, &f, cases[i].kind, cases[i].argv, &rc), "case %zu accepted", i);
        cr_assert_eq(rc, cases[i].rc, "case %zu: exit %d", i, rc);
        done(&p);
    }
}

Test(td_node, serve_then_shutdown_closes_everything)
{
    td_node_t p;
    fake_t f = {0};
    int rc = -1;
    const char *argv[] = {"tandem", NULL};
    cr_assert(configure(&p, &f, TD_NODE_ROUTER, argv, &rc), "%s", td_last_error());
    td_metrics_t *m;
    cr_assert_eq(td_metrics_create(&m), TD_OK);
    cr_assert_eq(td_node_serve(&p, m), TD_OK, "%s", td_last_error());
    cr_assert_neq(td_node_metrics_port(&p), 0);
    td_node_shutdown(&p);
    td_node_shutdown(&p); /* once */
    cr_assert_eq(td_node_run(&p), 0, "the loop ends once shutdown closed every handle");
    cr_assert_eq(f.shutdowns, 1);
    done(&p);
    td_metrics_destroy(m);
}

Test(td_node, sampling_params_one_conversion_each_way)
{
    td_sampling_t d = td_sampling_default(), s = td_node_sampling_from_proto(NULL);
    cr_assert_eq(memcmp(&s, &d, sizeof s), 0, "no sampling message: the defaults");

    Tandem__V1__SamplingParams p = TANDEM__V1__SAMPLING_PARAMS__INIT;
    s = td_node_sampling_from_proto(&p);
    cr_assert_float_eq(s.top_p, 1.0f, 0, "unset top_p is 1");
    cr_assert_float_eq(s.repetition_penalty, 1.0f, 0, "unset penalty is 1");
    cr_assert_float_eq(s.temperature, 0.0f, 0);

    p.temperature = 0.7f;
    p.top_k = 40;
    p.top_p = 0.9f;
    p.min_p = 0.05f;
    p.repetition_penalty = 1.3f;
    p.seed = 0x1234567890ull;
    p.presence_penalty = -0.5f;
    p.frequency_penalty = 1.25f;
    s = td_node_sampling_from_proto(&p);
    cr_assert_float_eq(s.presence_penalty, -0.5f, 0);
    cr_assert_float_eq(s.frequency_penalty, 1.25f, 0);
    cr_assert_float_eq(s.temperature, 0.7f, 0);
    cr_assert_eq(s.top_k, 40);
    cr_assert_float_eq(s.top_p, 0.9f, 0);
    cr_assert_float_eq(s.min_p, 0.05f, 0);
    cr_assert_float_eq(s.repetition_penalty, 1.3f, 0);
    cr_assert_eq(s.seed, 0x1234567890ull);
    cr_assert_eq(s.penalty_window, d.penalty_window, "fields the message lacks keep their defaults");

    Tandem__V1__SamplingParams back;
    td_node_sampling_to_proto(&s, &back);
    td_sampling_t again = td_node_sampling_from_proto(&back);
    cr_assert_eq(memcmp(&again, &s, sizeof s), 0, "a round trip changes nothing");

    p.top_k = UINT32_MAX; /* past INT32_MAX keeps every token, as INT32_MAX does */
    cr_assert_eq(td_node_sampling_from_proto(&p).top_k, INT32_MAX);
    p.top_p = -0.5f; /* out of range stays out of range: td_sampling_validate refuses it */
    s = td_node_sampling_from_proto(&p);
    cr_assert_neq(td_sampling_validate(&s, NULL, 0), TD_OK);
}

/* TD_SAMPLING_FIELDS and tandem.v1.SamplingParams agree: every .wire row is the message's
 * field of that name and a matching type, every field of the message is a .wire row, and
 * each travels alone in both directions. */
Test(td_node, sampling_table_matches_the_wire)
{
    const ProtobufCMessageDescriptor *md = &tandem__v1__sampling_params__descriptor;
    unsigned n_wire = 0;
    for (int f = TD_SAMPLING_FIELD_NONE + 1; f < TD_SAMPLING_FIELD_END; f++) {
        const td_sampling_field_desc_t *d = td_sampling_field_desc((td_sampling_field_t)f);
        const ProtobufCFieldDescriptor *pf = protobuf_c_message_descriptor_get_field_by_name(md, d->name);
        if (!d->wire) {
            cr_expect_null(pf, "%s is on the wire but its row says not", d->name);
            continue;
        }
        n_wire++;
        cr_assert_not_null(pf, "%s: no such field in tandem.v1.SamplingParams", d->name);
        protobuf_c_boolean same = (d->type == TD_SAMPLING_F32 && pf->type == PROTOBUF_C_TYPE_FLOAT) ||
                                  (d->type == TD_SAMPLING_I32 && pf->type == PROTOBUF_C_TYPE_UINT32) ||
                                  (d->type == TD_SAMPLING_U64 && pf->type == PROTOBUF_C_TYPE_UINT64);
        cr_expect(same, "%s: the wire type does not match the row's", d->name);

        /* one field away from its default: it alone changes, there and back */
        td_sampling_t want = td_sampling_default();
        void *v = td_sampling_field_ptr(&want, d);
        if (d->type == TD_SAMPLING_F32)
            *(float *)v = 0.375f;
        else if (d->type == TD_SAMPLING_I32)
            *(int32_t *)v = 7;
        else
            *(uint64_t *)v = 7;
        Tandem__V1__SamplingParams p;
        td_node_sampling_to_proto(&want, &p);
        td_sampling_t got = td_node_sampling_from_proto(&p);
        cr_expect_eq(memcmp(&got, &want, sizeof got), 0, "%s does not travel alone", d->name);
    }
    /* the two logit bias lists are the fields beside the rows */
    cr_assert_not_null(protobuf_c_message_descriptor_get_field_by_name(md, "logit_bias_ids"));
    cr_assert_not_null(protobuf_c_message_descriptor_get_field_by_name(md, "logit_bias"));
    cr_expect_eq(n_wire + 2, md->n_fields, "tandem.v1.SamplingParams has a field without a TD_SAMPLING_FIELDS row");
}

Test(td_node, logit_bias_travels_and_bad_lists_are_refused)
{
    td_sampling_t s = td_sampling_default();
    s.n_logit_bias = 3;
    for (int i = 0; i < 3; i++)
        s.logit_bias_ids[i] = 100 * i + 7, s.logit_bias[i] = (float)(i * 50 - 100);
    Tandem__V1__SamplingParams p;
    td_node_sampling_to_proto(&s, &p);
    cr_assert_eq(p.n_logit_bias_ids, 3);
    td_sampling_t got = td_node_sampling_from_proto(&p);
    cr_assert_eq(memcmp(&got, &s, sizeof got), 0, "the bias travels both ways");
    /* packed and unpacked, as a node reads it */
    size_t len = protobuf_c_message_get_packed_size(&p.base);
    uint8_t buf[256];
    cr_assert(len <= sizeof buf);
    protobuf_c_message_pack(&p.base, buf);
    Tandem__V1__SamplingParams *u = tandem__v1__sampling_params__unpack(NULL, len, buf);
    cr_assert_not_null(u);
    got = td_node_sampling_from_proto(u);
    cr_assert_eq(memcmp(&got, &s, sizeof got), 0, "the bias survives the wire");
    u->n_logit_bias = 2; /* one bias short */
    got = td_node_sampling_from_proto(u);
    char why[160];
    cr_assert_eq(td_sampling_validate(&got, why, sizeof why), TD_ERR_INVALID);
    cr_assert(strstr(why, "differ in length"), "%s", why);
    u->n_logit_bias = 3;
    u->logit_bias_ids[2] = UINT32_MAX; /* past int32: kept out of any vocabulary */
    got = td_node_sampling_from_proto(u);
    cr_assert(!td_sampling_check_bias(&got, 49152, why, sizeof why));
    tandem__v1__sampling_params__free_unpacked(u, NULL);
}

Test(td_node, logprobs_one_conversion_each_way)
{
    td_logprobs_want_t w = {.on = true, .top = 3};
    char why[128] = "";
    cr_assert_eq(td_node_logprobs_from_proto(NULL, &w, why, sizeof why), TD_OK);
    cr_assert(!w.on, "no LogprobsRequest: none");
    Tandem__V1__LogprobsRequest q = TANDEM__V1__LOGPROBS_REQUEST__INIT;
    q.top_logprobs = 20;
    q.prompt = true;
    cr_assert_eq(td_node_logprobs_from_proto(&q, &w, why, sizeof why), TD_OK);
    cr_assert(w.on && w.top == 20 && w.prompt);
    Tandem__V1__LogprobsRequest back;
    td_node_logprobs_to_proto(&w, &back);
    cr_assert(back.top_logprobs == 20 && back.prompt);
    q.top_logprobs = 21;
    cr_assert_eq(td_node_logprobs_from_proto(&q, &w, why, sizeof why), TD_ERR_INVALID);
    cr_assert_str_eq(why, "top_logprobs 21 is out of range [0, 20]");
    cr_assert(!w.on);

    /* answers: one message per position, in one allocation, back to the same values */
    td_token_logprob_t lps[3] = {{.token = 5},
                                 {.token = 6, .logprob = -1.5f, .n_top = 2, .top = {{6, -1.5f}, {9, -2.0f}}},
                                 {.token = 7, .logprob = -0.25f, .n_top = 1, .top = {{7, -0.25f}}}};
    Tandem__V1__TokenLogprob **msgs = NULL;
    void *mem = NULL;
    cr_assert_eq(td_node_logprobs_to_proto_array(lps, 3, &msgs, &mem), TD_OK);
    Tandem__V1__GenerateResponse r = TANDEM__V1__GENERATE_RESPONSE__INIT;
    r.logprobs = msgs;
    r.n_logprobs = 3;
    size_t len = protobuf_c_message_get_packed_size(&r.base);
    uint8_t *buf = malloc(len);
    cr_assert_not_null(buf);
    protobuf_c_message_pack(&r.base, buf);
    free(mem);
    Tandem__V1__GenerateResponse *u = tandem__v1__generate_response__unpack(NULL, len, buf);
    cr_assert_not_null(u);
    cr_assert_eq(u->n_logprobs, 3);
    for (int i = 0; i < 3; i++) {
        td_token_logprob_t got;
        td_node_logprob_from_proto(u->logprobs[i], &got);
        cr_assert_eq(got.token, lps[i].token);
        cr_assert_eq(got.logprob, lps[i].logprob);
        cr_assert_eq(got.n_top, lps[i].n_top);
        for (int k = 0; k < got.n_top; k++)
            cr_assert(got.top[k].token == lps[i].top[k].token && got.top[k].logprob == lps[i].top[k].logprob);
    }
    tandem__v1__generate_response__free_unpacked(u, NULL);
    free(buf);

    td_node_logprob_msg_t one;
    td_node_logprob_to_proto(&lps[1], &one);
    td_token_logprob_t got;
    td_node_logprob_from_proto(&one.m, &got);
    cr_assert(got.token == 6 && got.n_top == 2 && got.top[1].token == 9 && got.top[1].logprob == -2.0f);
}
