/*
 * Tests of td_auth: the API keys file's rules (comments, blanks, errors naming the line),
 * checking keys and Bearer headers, SIGHUP reload keeping the old keys on a bad file;
 * HMAC sign/verify of control calls: a wrong secret, another method or request, a stale
 * time, a replay (repeated counter), out-of-order counters inside the window; the secret
 * file written 0600; tenants (tenant=NAME) and their prefix-cache salts.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "td_auth.h"

#define KEY_A "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
#define KEY_B "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb-2"
#define KEY_C "cccccccccccccccccccccccccccccccc-3"
#define SECRET "0123456789abcdef0123456789abcdef0123456789abcdef"

static char dir[64];

static void setup(void)
{
    strcpy(dir, "/tmp/td_auth_XXXXXX");
    cr_assert(mkdtemp(dir));
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(auth, .init = setup, .fini = teardown);

static const char *write_file(const char *name, const char *text)
{
    static char path[128];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fputs(text, f);
    fclose(f);
    chmod(path, 0600);
    return path;
}

Test(auth, keys_file_comments_blanks_and_check)
{
    const char *p = write_file("keys", "# team keys\n\n   " KEY_A "  \r\n\t# old: " KEY_B "\n" KEY_B "\n");
    td_auth_keys_t *k = NULL;
    cr_assert_eq(td_auth_keys_load(p, &k), TD_OK);
    cr_assert_eq(td_auth_keys_count(k), 2);
    cr_assert_eq(td_auth_keys_check(k, KEY_A, strlen(KEY_A)), TD_AUTH_OK);
    cr_assert_eq(td_auth_keys_check(k, KEY_B, strlen(KEY_B)), TD_AUTH_OK);
    cr_assert_eq(td_auth_keys_check(k, KEY_A, strlen(KEY_A) - 1), TD_AUTH_WRONG, "a prefix is not the key");
    cr_assert_eq(td_auth_keys_check(k, KEY_A "a", strlen(KEY_A) + 1), TD_AUTH_WRONG);
    cr_assert_eq(td_auth_keys_check(k, "", 0), TD_AUTH_MISSING);
    cr_assert_eq(td_auth_keys_check_bearer(k, "Bearer " KEY_A), TD_AUTH_OK);
    cr_assert_eq(td_auth_keys_check_bearer(k, "bearer   " KEY_B " "), TD_AUTH_OK);
    cr_assert_eq(td_auth_keys_check_bearer(k, NULL), TD_AUTH_MISSING);
    cr_assert_eq(td_auth_keys_check_bearer(k, ""), TD_AUTH_MISSING);
    cr_assert_eq(td_auth_keys_check_bearer(k, "Basic " KEY_A), TD_AUTH_WRONG);
    cr_assert_eq(td_auth_keys_check_bearer(k, "Bearer"), TD_AUTH_WRONG);
    cr_assert_eq(td_auth_keys_check_bearer(k, "Bearer "), TD_AUTH_WRONG);
    cr_assert_eq(td_auth_keys_check_bearer(k, "Bearer" KEY_A), TD_AUTH_WRONG);
    cr_assert_eq(td_auth_keys_check_bearer(k, "Bearer # team keys"), TD_AUTH_WRONG, "a comment is no key");
    cr_assert_str_eq(td_auth_outcome_name(TD_AUTH_MISSING), "missing");
    td_auth_keys_destroy(k);
    td_auth_keys_destroy(NULL);
}

/* A key line may carry the flag `admin` (ClusterStatus wants one): the check says which key
 * matched was flagged, and the flag is no part of the key. */
Test(auth, keys_file_admin_flag)
{
    const char *p = write_file("keys", KEY_A "\t admin\r\n" KEY_B "\n");
    td_auth_keys_t *k = NULL;
    cr_assert_eq(td_auth_keys_load(p, &k), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_auth_keys_count(k), 2);
    bool admin = false;
    cr_assert_eq(td_auth_keys_check_bearer_role(k, "Bearer " KEY_A, &admin), TD_AUTH_OK);
    cr_assert(admin, "KEY_A's line says admin");
    cr_assert_eq(td_auth_keys_check_bearer_role(k, "Bearer " KEY_B, &admin), TD_AUTH_OK);
    cr_assert_not(admin, "KEY_B's line does not");
    cr_assert_eq(td_auth_keys_check_bearer_role(k, "Bearer " KEY_A " admin", &admin), TD_AUTH_WRONG);
    cr_assert_not(admin);
    cr_assert_eq(td_auth_keys_check_bearer_role(k, NULL, &admin), TD_AUTH_MISSING);
    cr_assert_not(admin);
    td_auth_keys_destroy(k);
}

/* A key line may carry priority=N and rate=R beside admin, in any order: the check gives the
 * matched key's flags and its place, and nothing for a key that does not match; a reload
 * that takes counts a generation (per-key state by place is stale then). */
Test(auth, keys_file_priority_and_rate_flags)
{
    const char *p = write_file("keys", KEY_A " rate=2.5 priority=-3\n# c\n" KEY_B "\n" KEY_C " admin priority=7\n");
    td_auth_keys_t *k = NULL;
    cr_assert_eq(td_auth_keys_load(p, &k), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_auth_keys_count(k), 3);
    td_auth_key_props_t kp;
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_A, &kp), TD_AUTH_OK);
    cr_assert(!kp.admin && kp.has_priority_cap && kp.max_priority == -3 && kp.rate == 2.5 && kp.index == 0);
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_B, &kp), TD_AUTH_OK);
    cr_assert(!kp.admin && !kp.has_priority_cap && kp.rate == 0 && kp.index == 1, "no flags: no cap, no limit");
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_C, &kp), TD_AUTH_OK);
    cr_assert(kp.admin && kp.has_priority_cap && kp.max_priority == 7 && kp.rate == 0 && kp.index == 2);
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_C "x", &kp), TD_AUTH_WRONG);
    cr_assert(!kp.admin && !kp.has_priority_cap && kp.rate == 0 && kp.index == 0, "a wrong key gets no flags");
    uint64_t g = td_auth_keys_generation(k);
    write_file("keys", KEY_B " rate=1\n");
    cr_assert_eq(td_auth_keys_reload(k), TD_OK);
    cr_assert_neq(td_auth_keys_generation(k), g);
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_B, &kp), TD_AUTH_OK);
    cr_assert(kp.rate == 1 && kp.index == 0);
    td_auth_keys_destroy(k);
}

/* tenant=NAME puts a key's prompts with every key naming the same tenant; a key without one
 * is a tenant of its own. The identity is stable across reloads (the nodes' caches stay
 * useful) and holds no part of the key. */
Test(auth, keys_file_tenant_flag)
{
    const char *p = write_file("keys", KEY_A " tenant=team-1\n" KEY_B " rate=5 tenant=team-1 admin\n" KEY_C "\n");
    td_auth_keys_t *k = NULL;
    cr_assert_eq(td_auth_keys_load(p, &k), TD_OK, "%s", td_last_error());
    td_auth_key_props_t a, b, c, w;
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_A, &a), TD_AUTH_OK);
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_B, &b), TD_AUTH_OK);
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_C, &c), TD_AUTH_OK);
    cr_assert(b.admin && b.rate == 5 && b.index == 1, "tenant= sits among the other flags");
    cr_assert_eq(memcmp(a.tenant, b.tenant, sizeof a.tenant), 0, "one tenant named twice");
    cr_assert_neq(memcmp(a.tenant, c.tenant, sizeof a.tenant), 0, "a key without tenant= is its own");
    static const uint8_t zero[TD_AUTH_TENANT_BYTES];
    cr_assert_neq(memcmp(c.tenant, zero, sizeof zero), 0);
    cr_assert_null(memmem(c.tenant, sizeof c.tenant, KEY_C, 4), "no part of the key");
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_C "x", &w), TD_AUTH_WRONG);
    cr_assert_eq(memcmp(w.tenant, zero, sizeof zero), 0, "a wrong key gets no tenant");

    /* reloaded, in another order, with other flags: the same identities */
    write_file("keys", KEY_C " priority=3\n" KEY_B " tenant=team-2\n" KEY_A " tenant=team-1\n");
    cr_assert_eq(td_auth_keys_reload(k), TD_OK, "%s", td_last_error());
    td_auth_key_props_t a2, b2, c2;
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_A, &a2), TD_AUTH_OK);
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_B, &b2), TD_AUTH_OK);
    cr_assert_eq(td_auth_keys_check_bearer_props(k, "Bearer " KEY_C, &c2), TD_AUTH_OK);
    cr_assert_eq(memcmp(a.tenant, a2.tenant, sizeof a.tenant), 0);
    cr_assert_eq(memcmp(c.tenant, c2.tenant, sizeof c.tenant), 0);
    cr_assert_neq(memcmp(a2.tenant, b2.tenant, sizeof a2.tenant), 0, "B moved to team-2");
    td_auth_keys_destroy(k);
}

/* Salts: under the cluster secret, the same key on every start (so, the same salt per
 * tenant); without one, a new random key each time; distinct tenants, distinct salts;
 * never 0 (which means "no salt"). */
Test(auth, tenant_salts)
{
    td_auth_cluster_config_t cfg = td_auth_cluster_config_default();
    td_auth_cluster_t *c1 = NULL, *c2 = NULL, *c3 = NULL;
    cr_assert_eq(td_auth_cluster_create(SECRET, strlen(SECRET), &cfg, &c1), TD_OK);
    cr_assert_eq(td_auth_cluster_create(SECRET, strlen(SECRET), &cfg, &c2), TD_OK);
    cr_assert_eq(td_auth_cluster_create(SECRET "x", strlen(SECRET) + 1, &cfg, &c3), TD_OK);
    uint8_t k1[TD_AUTH_SALT_KEY_BYTES], k2[TD_AUTH_SALT_KEY_BYTES], k3[TD_AUTH_SALT_KEY_BYTES];
    uint8_t r1[TD_AUTH_SALT_KEY_BYTES], r2[TD_AUTH_SALT_KEY_BYTES];
    cr_assert_eq(td_auth_salt_key(c1, k1), TD_OK);
    cr_assert_eq(td_auth_salt_key(c2, k2), TD_OK);
    cr_assert_eq(td_auth_salt_key(c3, k3), TD_OK);
    cr_assert_eq(td_auth_salt_key(NULL, r1), TD_OK);
    cr_assert_eq(td_auth_salt_key(NULL, r2), TD_OK);
    cr_assert_eq(memcmp(k1, k2, sizeof k1), 0, "one secret, one salt key: stable across restarts");
    cr_assert_neq(memcmp(k1, k3, sizeof k1), 0, "another secret, another key");
    cr_assert_neq(memcmp(r1, r2, sizeof r1), 0, "without a secret: random each start");
    cr_assert_neq(memcmp(r1, k1, sizeof r1), 0);
    cr_assert_null(memmem(k1, sizeof k1, SECRET, 4), "the key is not the secret");

    uint8_t ta[TD_AUTH_TENANT_BYTES] = {1}, tb[TD_AUTH_TENANT_BYTES] = {2};
    uint64_t sa1 = 0, sa2 = 0, sb = 0, sa3 = 0, sr = 0;
    cr_assert_eq(td_auth_tenant_salt(k1, ta, &sa1), TD_OK);
    cr_assert_eq(td_auth_tenant_salt(k2, ta, &sa2), TD_OK);
    cr_assert_eq(td_auth_tenant_salt(k1, tb, &sb), TD_OK);
    cr_assert_eq(td_auth_tenant_salt(k3, ta, &sa3), TD_OK);
    cr_assert_eq(td_auth_tenant_salt(r1, ta, &sr), TD_OK);
    cr_assert(sa1 && sb && sa3 && sr, "never 0");
    cr_assert_eq(sa1, sa2);
    cr_assert_neq(sa1, sb, "two tenants");
    cr_assert_neq(sa1, sa3, "two secrets");
    cr_assert_neq(sa1, sr);
    td_auth_cluster_destroy(c1);
    td_auth_cluster_destroy(c2);
    td_auth_cluster_destroy(c3);
}

/* Each bad file is refused with a message naming the file and line, never the key. */
Test(auth, keys_file_errors)
{
    static const struct {
        const char *text, *says;
    } bad[] = {
        {"", "has no key"},
        {"# only a comment\n\n", "has no key"},
        {"short\n", "line 1: the key has 5 characters"},
        {"# c\n" KEY_A " " KEY_B "\n", "line 2: a key is printable ASCII without spaces"},
        {KEY_A " admins\n", "line 1: a key is printable ASCII without spaces, followed by nothing or by flags "
                           "(admin, priority=N, rate=R, tenant=NAME); word 1 after the key"},
        {KEY_A " admin admin\n", "line 1: a key is printable ASCII without spaces, followed by nothing or by flags "
                                 "(admin, priority=N, rate=R, tenant=NAME); word 2 after the key (at character 40): "
                                 "the flag admin twice"},
        {KEY_A " priority=high\n", "priority= takes an integer"},
        {KEY_A " priority=9999999999\n", "priority= takes an integer"},
        {KEY_A " rate=0\n", "rate= takes requests a second, 0.001 .. 1000000"},
        {KEY_A " rate=nan\n", "rate= takes requests a second"},
        {KEY_A " rate=1 rate=2\n", "rate= twice"},
        {KEY_A " tenant=\n", "tenant= takes a name of 1 .. 64 letters, digits, '.', '_' or '-'"},
        {KEY_A " tenant=team/a\n", "tenant= takes a name of 1 .. 64"},
        {KEY_A " tenant=" "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" "\n", "tenant= takes a name"},
        {KEY_A " tenant=x tenant=y\n", "tenant= twice"},
        {KEY_A "\n" KEY_B "\n" KEY_A "\n", "line 3 repeats an earlier key"},
        {"\xc3\xa9" KEY_A "\n", "line 1: a key is printable ASCII"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *p = write_file("bad", bad[i].text);
        td_auth_keys_t *k = NULL;
        cr_assert_eq(td_auth_keys_load(p, &k), TD_ERR_FORMAT, "case %zu", i);
        cr_assert_null(k);
        cr_assert(strstr(td_last_error(), bad[i].says), "case %zu: %s", i, td_last_error());
        cr_assert(strstr(td_last_error(), p), "names the file: %s", td_last_error());
        cr_assert_null(strstr(td_last_error(), KEY_A), "never the key: %s", td_last_error());
    }
    td_auth_keys_t *k = NULL;
    cr_assert_eq(td_auth_keys_load("/nonexistent/keys", &k), TD_ERR_IO);
    cr_assert(strstr(td_last_error(), "/nonexistent/keys"), "%s", td_last_error());
}

Test(auth, reload_swaps_keys_and_keeps_old_ones_on_a_bad_file)
{
    const char *p = write_file("keys", KEY_A "\n");
    char path[128];
    snprintf(path, sizeof path, "%s", p);
    td_auth_keys_t *k = NULL;
    cr_assert_eq(td_auth_keys_load(path, &k), TD_OK);
    write_file("keys", KEY_B "\n");
    cr_assert_eq(td_auth_keys_reload(k), TD_OK);
    cr_assert_eq(td_auth_keys_check_bearer(k, "Bearer " KEY_A), TD_AUTH_WRONG, "rotated out");
    cr_assert_eq(td_auth_keys_check_bearer(k, "Bearer " KEY_B), TD_AUTH_OK);
    write_file("keys", "# emptied by mistake\n");
    cr_assert_eq(td_auth_keys_reload(k), TD_ERR_FORMAT);
    cr_assert_eq(td_auth_keys_check_bearer(k, "Bearer " KEY_B), TD_AUTH_OK, "the old keys stay in force");
    cr_assert_eq(td_auth_keys_count(k), 1);
    unlink(path);
    cr_assert_eq(td_auth_keys_reload(k), TD_ERR_IO);
    cr_assert_eq(td_auth_keys_check_bearer(k, "Bearer " KEY_B), TD_AUTH_OK);
    td_auth_keys_destroy(k);
}

static td_auth_cluster_t *cluster(const char *secret, int64_t window_ms)
{
    td_auth_cluster_config_t cfg = td_auth_cluster_config_default();
    if (window_ms)
        cfg.window_ms = window_ms;
    td_auth_cluster_t *c = NULL;
    cr_assert_eq(td_auth_cluster_create(secret, strlen(secret), &cfg, &c), TD_OK, "%s", td_last_error());
    return c;
}

#define M_ADMIT "/tandem.control.v1.DecodeNode/Admit"
#define AUD "decode0" /* the receiver the calls are signed for */

Test(auth, sign_verify_wrong_secret_method_body_stale)
{
    td_auth_cluster_t *a = cluster(SECRET, 0), *b = cluster(SECRET, 0), *rogue = cluster(SECRET "x", 0);
    td_auth_signer_t s, r;
    cr_assert_eq(td_auth_signer_init(&s, a, AUD), TD_OK);
    cr_assert_eq(td_auth_signer_init(&r, rogue, AUD), TD_OK);
    const char body[] = "\x0a\x03req";
    char v[TD_AUTH_HEADER_CHARS], why[256];
    int64_t now = 1700000000000;
    cr_assert_eq(td_auth_sign(&s, now, M_ADMIT, body, sizeof body - 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(b, now + 5, AUD, M_ADMIT, v, body, sizeof body - 1, why, sizeof why), TD_AUTH_OK, "%s", why);
    /* the same value again is a replay */
    cr_assert_eq(td_auth_verify(b, now + 6, AUD, M_ADMIT, v, body, sizeof body - 1, why, sizeof why), TD_AUTH_WRONG);
    cr_assert(strstr(why, "replayed"), "%s", why);
    /* another method or body under the same signature */
    cr_assert_eq(td_auth_sign(&s, now, M_ADMIT, body, sizeof body - 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(b, now, AUD, "/tandem.control.v1.DecodeNode/Release", v, body, sizeof body - 1, why,
                                sizeof why), TD_AUTH_WRONG);
    cr_assert(strstr(why, "signature does not match"), "%s", why);
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, v, "\x0a\x03reX", 5, why, sizeof why), TD_AUTH_WRONG);
    /* signed for another receiver: refused here (a call to one node cannot be replayed to another) */
    cr_assert_eq(td_auth_sign(&s, now, M_ADMIT, body, sizeof body - 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(b, now, "decode1", M_ADMIT, v, body, sizeof body - 1, why, sizeof why), TD_AUTH_WRONG);
    cr_assert(strstr(why, "another receiver than decode1"), "%s", why);
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, v, body, sizeof body - 1, why, sizeof why), TD_AUTH_OK, "%s", why);
    td_auth_signer_t bad;
    cr_assert_eq(td_auth_signer_init(&bad, a, ""), TD_ERR_INVALID);
    /* a wrong secret, no header, a malformed one */
    cr_assert_eq(td_auth_sign(&r, now, M_ADMIT, body, sizeof body - 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, v, body, sizeof body - 1, why, sizeof why), TD_AUTH_WRONG);
    cr_assert(strstr(why, "cluster secret differs"), "%s", why);
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, NULL, body, sizeof body - 1, why, sizeof why), TD_AUTH_MISSING);
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, "v1 zz", body, sizeof body - 1, why, sizeof why), TD_AUTH_WRONG);
    cr_assert(strstr(why, "malformed"), "%s", why);
    /* stale: a minute and more away, either way */
    cr_assert_eq(td_auth_sign(&s, now - 60001, M_ADMIT, body, sizeof body - 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, v, body, sizeof body - 1, why, sizeof why), TD_AUTH_WRONG);
    cr_assert(strstr(why, "stale"), "%s", why);
    cr_assert_eq(td_auth_sign(&s, now + 60001, M_ADMIT, body, sizeof body - 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, v, body, sizeof body - 1, why, sizeof why), TD_AUTH_WRONG);
    /* an empty request signs too */
    cr_assert_eq(td_auth_sign(&s, now, M_ADMIT, NULL, 0, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, v, NULL, 0, why, sizeof why), TD_AUTH_OK, "%s", why);
    td_auth_cluster_destroy(a);
    td_auth_cluster_destroy(b);
    td_auth_cluster_destroy(rogue);
}

/* Counters may arrive out of order within TD_AUTH_REPLAY_BITS, each accepted once; one
 * older than the window is refused. Shadowed by a plain set of accepted counters. */
Test(auth, replay_window_out_of_order)
{
    td_auth_cluster_t *a = cluster(SECRET, 0), *b = cluster(SECRET, 0);
    td_auth_signer_t s;
    cr_assert_eq(td_auth_signer_init(&s, a, AUD), TD_OK);
    enum { N = 3000 };
    static char vals[N][TD_AUTH_HEADER_CHARS];
    int64_t now = 1700000000000;
    for (int i = 0; i < N; i++)
        cr_assert_eq(td_auth_sign(&s, now, M_ADMIT, "x", 1, vals[i], sizeof vals[i]), TD_OK);
    static bool accepted[N];
    int64_t top = -1;
    char why[256];
    /* the edges first: a jump of exactly the window keeps the old top in it */
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, vals[0], "x", 1, why, sizeof why), TD_AUTH_OK, "%s", why);
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, vals[TD_AUTH_REPLAY_BITS], "x", 1, why, sizeof why), TD_AUTH_OK);
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, vals[0], "x", 1, why, sizeof why), TD_AUTH_WRONG);
    accepted[0] = accepted[TD_AUTH_REPLAY_BITS] = true;
    top = TD_AUTH_REPLAY_BITS;
    srand(7);
    for (int step = 0; step < 20000; step++) {
        int i = rand() % N;
        if (step % 3 == 0 && top >= 0) { /* often just above the top, as a connection delivers them */
            int64_t j = top + 1 + rand() % 5;
            i = (int)(j < N ? j : N - 1);
        }
        bool ok = td_auth_verify(b, now, AUD, M_ADMIT, vals[i], "x", 1, why, sizeof why) == TD_AUTH_OK;
        bool want = !accepted[i] && (i > top || top - i <= TD_AUTH_REPLAY_BITS);
        cr_assert_eq(ok, want, "counter %d (top %lld): %s", i + 1, (long long)top, why);
        if (ok) {
            accepted[i] = true;
            if (i > top)
                top = i;
        }
    }
    td_auth_cluster_destroy(a);
    td_auth_cluster_destroy(b);
}

Test(auth, secret_file_generate_load_rules)
{
    char path[128];
    snprintf(path, sizeof path, "%s/secret", dir);
    cr_assert_eq(td_auth_secret_generate(path), TD_OK);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0600);
    cr_assert_eq(td_auth_secret_generate(path), TD_ERR_INVALID, "never overwrites a secret");
    td_auth_cluster_config_t cfg = td_auth_cluster_config_default();
    td_auth_cluster_t *c = NULL, *d = NULL;
    cr_assert_eq(td_auth_cluster_load(path, &cfg, &c), TD_OK, "%s", td_last_error());
    td_auth_signer_t s;
    cr_assert_eq(td_auth_signer_init(&s, c, AUD), TD_OK);
    char v[TD_AUTH_HEADER_CHARS], why[256];
    cr_assert_eq(td_auth_sign(&s, td_auth_now_ms(), M_ADMIT, "x", 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(c, td_auth_now_ms(), AUD, M_ADMIT, v, "x", 1, why, sizeof why), TD_AUTH_OK, "%s", why);
    /* another generated secret is another cluster */
    snprintf(path, sizeof path, "%s/secret2", dir);
    cr_assert_eq(td_auth_secret_generate(path), TD_OK);
    cr_assert_eq(td_auth_cluster_load(path, &cfg, &d), TD_OK);
    cr_assert_eq(td_auth_sign(&s, td_auth_now_ms(), M_ADMIT, "x", 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(d, td_auth_now_ms(), AUD, M_ADMIT, v, "x", 1, why, sizeof why), TD_AUTH_WRONG);
    td_auth_cluster_destroy(c);
    td_auth_cluster_destroy(d);
    /* too short, two lines */
    cr_assert_eq(td_auth_cluster_load(write_file("short", "tooshort\n"), &cfg, &c), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "at least 32"), "%s", td_last_error());
    cr_assert_eq(td_auth_cluster_load(write_file("two", SECRET "\n" SECRET "\n"), &cfg, &c), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "one line"), "%s", td_last_error());
    cr_assert_eq(td_auth_cluster_load("/nonexistent/secret", &cfg, &c), TD_ERR_IO);
}

/* A verifier remembers TD_AUTH_MAX_SENDERS senders. One more within the window does not lock
 * new senders out (a node restarting in a loop once filled the table and no node could
 * join): the least recently accepted one is forgotten, and a call it signed cannot be
 * replayed under a fresh entry (a sender not in the table must have signed after the
 * forgotten one's latest call); forgotten, it is taken in again when it signs anew. Senders
 * silent for two windows are forgotten without raising that floor. */
Test(auth, sender_table_full_evicts_the_oldest)
{
    const int64_t W = 60000;
    td_auth_cluster_t *a = cluster(SECRET, W), *b = cluster(SECRET, W);
    int64_t now = 1700000000000;
    char v[TD_AUTH_HEADER_CHARS], old0[TD_AUTH_HEADER_CHARS], why[256];
    static td_auth_signer_t s[TD_AUTH_MAX_SENDERS];
    for (int i = 0; i < TD_AUTH_MAX_SENDERS; i++) { /* sender i last accepted at now + i */
        cr_assert_eq(td_auth_signer_init(&s[i], a, AUD), TD_OK);
        cr_assert_eq(td_auth_sign(&s[i], now + i, M_ADMIT, "x", 1, v, sizeof v), TD_OK);
        cr_assert_eq(td_auth_verify(b, now + i, AUD, M_ADMIT, v, "x", 1, why, sizeof why), TD_AUTH_OK, "sender %d: %s",
                     i, why);
    }
    /* a second call of sender 0 is found again, not a new entry; kept to replay later */
    cr_assert_eq(td_auth_sign(&s[0], now, M_ADMIT, "x", 1, old0, sizeof old0), TD_OK);
    cr_assert_eq(td_auth_verify(b, now, AUD, M_ADMIT, old0, "x", 1, why, sizeof why), TD_AUTH_OK, "%s", why);
    int64_t t = now + 2000;
    td_auth_signer_t extra;
    cr_assert_eq(td_auth_signer_init(&extra, a, AUD), TD_OK);
    cr_assert_eq(td_auth_sign(&extra, t, M_ADMIT, "x", 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(b, t, AUD, M_ADMIT, v, "x", 1, why, sizeof why), TD_AUTH_OK,
                 "a full table refused a new sender: %s", why);
    /* sender 0 was the oldest: forgotten, and its captured call is not taken again */
    cr_assert_eq(td_auth_verify(b, t, AUD, M_ADMIT, old0, "x", 1, why, sizeof why), TD_AUTH_WRONG);
    cr_assert(strstr(why, "forget"), "%s", why);
    /* sender 1 (still known) replayed: refused as a replay */
    cr_assert_eq(td_auth_sign(&s[1], t, M_ADMIT, "x", 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(b, t, AUD, M_ADMIT, v, "x", 1, why, sizeof why), TD_AUTH_OK, "%s", why);
    cr_assert_eq(td_auth_verify(b, t, AUD, M_ADMIT, v, "x", 1, why, sizeof why), TD_AUTH_WRONG);
    cr_assert(strstr(why, "replayed"), "%s", why);
    /* sender 0 signing anew is taken in again, once */
    cr_assert_eq(td_auth_sign(&s[0], t + 1, M_ADMIT, "x", 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(b, t + 1, AUD, M_ADMIT, v, "x", 1, why, sizeof why), TD_AUTH_OK, "%s", why);
    cr_assert_eq(td_auth_verify(b, t + 1, AUD, M_ADMIT, v, "x", 1, why, sizeof why), TD_AUTH_WRONG);
    /* two windows later every old entry is stale: a new sender takes one, its call accepted */
    int64_t later = t + 2 * W + 10;
    td_auth_signer_t late;
    cr_assert_eq(td_auth_signer_init(&late, a, AUD), TD_OK);
    cr_assert_eq(td_auth_sign(&late, later, M_ADMIT, "x", 1, v, sizeof v), TD_OK);
    cr_assert_eq(td_auth_verify(b, later, AUD, M_ADMIT, v, "x", 1, why, sizeof why), TD_AUTH_OK, "%s", why);
    cr_assert_eq(td_auth_verify(b, later, AUD, M_ADMIT, old0, "x", 1, why, sizeof why), TD_AUTH_WRONG);
    cr_assert(strstr(why, "stale"), "%s", why);
    td_auth_cluster_destroy(a);
    td_auth_cluster_destroy(b);
}
