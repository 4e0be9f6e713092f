/*
 * td_auth: API keys and the cluster secret (see td_auth.h), on OpenSSL's libcrypto:
 * SHA-256 digests of keys compared with CRYPTO_memcmp, HMAC-SHA256 through EVP_MAC,
 * randomness from RAND_bytes.
 */
#include "td_auth.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include "td_hash.h"
#include "td_log.h"
#include "td_util.h"

#define FILE_MAX_BYTES (4u << 20)

const char *td_auth_outcome_name(td_auth_outcome_t o)
{
    switch (o) {
    case TD_AUTH_OK:
        return "ok";
    case TD_AUTH_MISSING:
        return "missing";
    default:
        return "wrong";
    }
}

/* Warns (once per load) when a secret file is readable by group or others. */
static void warn_mode(const char *path, const char *what)
{
    struct stat st;
    if (stat(path, &st) == 0 && (st.st_mode & 077))
        td_warn("%s %s is readable by group or others (mode %03o): chmod 600 it", what, path,
                (unsigned)(st.st_mode & 0777));
}

static bool is_blank(char c)
{
    return c == ' ' || c == '\t' || c == '\r';
}

/* ---- API keys ------------------------------------------------------------------------ */

typedef struct digest {
    uint8_t b[SHA256_DIGEST_LENGTH];
    bool admin;           /* the line carried the admin flag */
    bool has_cap;         /* ... a priority=N */
    int32_t max_priority; /* N */
    double rate;          /* ... a rate=R (0: none) */
    bool has_tenant;      /* ... a tenant=NAME */
    uint8_t tenant[TD_AUTH_TENANT_BYTES]; /* td_auth_key_props_t.tenant */
} digest_t;

struct td_auth_keys {
    char *path;
    digest_t *d; /* n digests of the keys */
    size_t n;
    uint64_t generation; /* reloads that took */
};

#define FLAGS_NAMED "admin, priority=N, rate=R, tenant=NAME"

/* A tenant's identity: SHA-256 over a tag naming the kind (tenant=NAME, or a key without
 * one: its digest) and the bytes, so a name can never equal a key's identity. */
static void tenant_id(const char *kind, const void *b, size_t n, uint8_t out[TD_AUTH_TENANT_BYTES])
{
    char msg[32 + TD_AUTH_TENANT_MAX + SHA256_DIGEST_LENGTH];
    int tl = snprintf(msg, sizeof msg, "tandem-tenant v1 %s", kind) + 1; /* the NUL ends the tag */
    TD_ASSERT(tl <= 32 && n <= sizeof msg - 32);
    memcpy(msg + tl, b, n);
    SHA256((const unsigned char *)msg, (size_t)tl + n, out);
    OPENSSL_cleanse(msg, sizeof msg);
}

static bool tenant_name_ok(const char *v)
{
    size_t n = strlen(v);
    if (n < 1 || n > TD_AUTH_TENANT_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)v[i]) && v[i] != '.' && v[i] != '_' && v[i] != '-')
            return false;
    return true;
}

/* One flag of a key's line, w[0..n): admin, priority=N (a 32-bit integer), rate=R (requests
 * a second, 0.001 .. 1e6), tenant=NAME; each at most once. false with *why set otherwise. */
static bool key_flag(const char *w, size_t n, digest_t *d, bool seen[4], const char **why)
{
    char buf[96];
    if (n >= sizeof buf) {
        *why = "an unknown flag (the flags are " FLAGS_NAMED ")";
        return false;
    }
    memcpy(buf, w, n);
    buf[n] = '\0';
    char *end;
    if (!strcmp(buf, "admin")) {
        *why = seen[0] ? "the flag admin twice" : NULL;
        seen[0] = d->admin = true;
    } else if (!strncmp(buf, "priority=", 9)) {
        errno = 0;
        long long v = strtoll(buf + 9, &end, 10);
        *why = seen[1] ? "priority= twice"
               : (errno || end == buf + 9 || *end || v < INT32_MIN || v > INT32_MAX)
                   ? "priority= takes an integer (the highest priority.value the key's requests get)"
                   : NULL;
        seen[1] = d->has_cap = true;
        d->max_priority = (int32_t)v;
    } else if (!strncmp(buf, "rate=", 5)) {
        errno = 0;
        double v = strtod(buf + 5, &end);
        *why = seen[2] ? "rate= twice"
               : (errno || end == buf + 5 || *end || !(v >= 0.001 && v <= 1e6))
                   ? "rate= takes requests a second, 0.001 .. 1000000"
                   : NULL;
        seen[2] = true;
        d->rate = v;
    } else if (!strncmp(buf, "tenant=", 7)) {
        *why = seen[3] ? "tenant= twice"
               : !tenant_name_ok(buf + 7) ? "tenant= takes a name of 1 .. 64 letters, digits, '.', '_' or '-'"
                                          : NULL;
        seen[3] = d->has_tenant = true;
        if (!*why)
            tenant_id("name", buf + 7, strlen(buf + 7), d->tenant);
    } else {
        *why = "an unknown flag (the flags are " FLAGS_NAMED ")";
    }
    return !*why;
}

/* Parses the file's text into digests (*d_p, *n_p); errors name the line, never the key. */
static td_status_t keys_parse(const char *path, char *text, size_t len, digest_t **d_p, size_t *n_p)
{
    digest_t *d = NULL;
    size_t n = 0;
    td_status_t st = TD_OK;
    int line_no = 0;
    for (char *line = text; line && line < text + len;) {
        char *nl = memchr(line, '\n', (size_t)(text + len - line));
        char *end = nl ? nl : text + len;
        line_no++;
        while (line < end && is_blank(*line))
            line++;
        while (end > line && is_blank(end[-1]))
            end--;
        size_t kl = (size_t)(end - line);
        digest_t props = {0};
        if (kl && line[0] != '#') { /* KEY [flag ...]: flags after blanks */
            const char *sp = line;
            while (sp < end && !is_blank(*sp))
                sp++;
            kl = (size_t)(sp - line);
            bool seen[4] = {false, false, false, false};
            int word = 0;
            for (const char *w = sp; w < end;) {
                while (w < end && is_blank(*w))
                    w++;
                const char *we = w;
                while (we < end && !is_blank(*we))
                    we++;
                const char *why;
                word++;
                /* the word is not shown: it may be a key pasted on the same line */
                if (we > w && !key_flag(w, (size_t)(we - w), &props, seen, &why)) {
                    st = td_errorf(TD_ERR_FORMAT, "api keys file %s: line %d: a key is printable ASCII without "
                                   "spaces, followed by nothing or by flags (" FLAGS_NAMED "); word %d "
                                   "after the key (at character %zu): %s", path, line_no, word,
                                   (size_t)(w - line) + 1, why);
                    goto err_digests;
                }
                w = we;
            }

            for (size_t i = 0; i < kl && st == TD_OK; i++)
                if ((unsigned char)line[i] < 0x21 || (unsigned char)line[i] > 0x7e)
                    st = td_errorf(TD_ERR_FORMAT, "api keys file %s: line %d: a key is printable ASCII without "
                                   "spaces (character %zu is not)", path, line_no, i + 1);
            if (st == TD_OK && (kl < TD_AUTH_KEY_MIN || kl > TD_AUTH_KEY_MAX))
                st = td_errorf(TD_ERR_FORMAT, "api keys file %s: line %d: the key has %zu characters, allowed %d .. %d "
                               "(make one with `openssl rand -hex 32`)", path, line_no, kl, TD_AUTH_KEY_MIN,
                               TD_AUTH_KEY_MAX);
            if (st == TD_OK && n == TD_AUTH_KEYS_MAX)
                st = td_errorf(TD_ERR_FORMAT, "api keys file %s: more than %d keys", path, TD_AUTH_KEYS_MAX);
            if (st != TD_OK)
                goto err_digests;
            if (!(n & (n + 1)) || !d) { /* grow at 0, 1, 3, 7, ... */
                digest_t *g = realloc(d, (2 * n + 2) * sizeof *d);
                if (!g) {
                    st = td_errorf(TD_ERR_NOMEM, "api keys file %s: out of memory", path);
                    goto err_digests;
                }
                d = g;
            }
            d[n] = props;
            SHA256((const unsigned char *)line, kl, d[n].b);
            if (!d[n].has_tenant) /* a tenant of its own, named by its digest, never its text */
                tenant_id("key", d[n].b, sizeof d[n].b, d[n].tenant);
            for (size_t i = 0; i < n; i++)
                if (!memcmp(d[i].b, d[n].b, sizeof d[n].b)) {
                    st = td_errorf(TD_ERR_FORMAT, "api keys file %s: line %d repeats an earlier key: remove one",
                                   path, line_no);
                    goto err_digests;
                }
            n++;
        }
        line = nl ? nl + 1 : NULL;
    }
    if (!n) {
        st = td_errorf(TD_ERR_FORMAT, "api keys file %s has no key (one per line; '#' starts a comment); "
                       "to serve without keys, leave --api-keys-file out", path);
        goto err_digests;
    }
    *d_p = d;
    *n_p = n;
    return TD_OK;
err_digests:
    if (d)
        OPENSSL_cleanse(d, n * sizeof *d);
    free(d);
    return st;
}

static td_status_t keys_read(const char *path, digest_t **d_p, size_t *n_p)
{
    char *text;
    size_t len;
    td_status_t st = td_file_read_all(path, FILE_MAX_BYTES, &text, &len);
    if (st != TD_OK)
        return st; /* logged there, naming the path */
    st = keys_parse(path, text, len, d_p, n_p);
    OPENSSL_cleanse(text, len);
    free(text);
    if (st == TD_OK)
        warn_mode(path, "api keys file");
    return st;
}

td_status_t td_auth_keys_load(const char *path, td_auth_keys_t **keys_p)
{
    td_auth_keys_t *k = calloc(1, sizeof *k);
    if (!k || !(k->path = strdup(path))) {
        free(k);
        return td_errorf(TD_ERR_NOMEM, "api keys file %s: out of memory", path);
    }
    td_status_t st = keys_read(path, &k->d, &k->n);
    if (st != TD_OK) {
        free(k->path);
        free(k);
        return st;
    }
    *keys_p = k;
    return TD_OK;
}

td_status_t td_auth_keys_reload(td_auth_keys_t *keys)
{
    digest_t *d;
    size_t n;
    td_status_t st = keys_read(keys->path, &d, &n);
    if (st != TD_OK)
        return st;
    OPENSSL_cleanse(keys->d, keys->n * sizeof *keys->d);
    free(keys->d);
    keys->d = d;
    keys->n = n;
    keys->generation++;
    return TD_OK;
}

uint64_t td_auth_keys_generation(const td_auth_keys_t *keys)
{
    return keys->generation;
}

size_t td_auth_keys_count(const td_auth_keys_t *keys)
{
    return keys->n;
}

const char *td_auth_keys_path(const td_auth_keys_t *keys)
{
    return keys->path;
}

/* The check of td_auth_keys_check; *props_p: the matching key's flags and place. Every
 * key is compared and its flags blended in under a mask, so the time shows neither which
 * key matched nor what its line says. */
static td_auth_outcome_t keys_check(const td_auth_keys_t *keys, const char *key, size_t len,
                                    td_auth_key_props_t *props_p)
{
    *props_p = (td_auth_key_props_t){0};
    if (!len)
        return TD_AUTH_MISSING;
    digest_t h;
    SHA256((const unsigned char *)key, len, h.b);
    uint32_t match = 0, admin = 0, has_cap = 0, cap = 0, index = 0;
    uint64_t rate = 0;
    uint8_t tenant[TD_AUTH_TENANT_BYTES] = {0};
    for (size_t i = 0; i < keys->n; i++) { /* every key, no early exit */
        uint32_t m = (uint32_t)(CRYPTO_memcmp(h.b, keys->d[i].b, sizeof h.b) == 0);
        uint32_t mask = 0u - m;
        uint64_t rbits;
        memcpy(&rbits, &keys->d[i].rate, sizeof rbits);
        match |= m;
        admin |= m & (uint32_t)keys->d[i].admin;
        has_cap |= m & (uint32_t)keys->d[i].has_cap;
        cap |= mask & (uint32_t)keys->d[i].max_priority;
        index |= mask & (uint32_t)i;
        rate |= ((uint64_t)0 - m) & rbits;
        for (size_t j = 0; j < sizeof tenant; j++)
            tenant[j] |= (uint8_t)mask & keys->d[i].tenant[j];
    }
    OPENSSL_cleanse(&h, sizeof h);
    props_p->admin = admin;
    props_p->has_priority_cap = has_cap;
    props_p->max_priority = (int32_t)cap;
    memcpy(&props_p->rate, &rate, sizeof rate);
    props_p->index = index;
    memcpy(props_p->tenant, tenant, sizeof tenant);
    return match ? TD_AUTH_OK : TD_AUTH_WRONG;
}

td_auth_outcome_t td_auth_keys_check(const td_auth_keys_t *keys, const char *key, size_t len)
{
    td_auth_key_props_t props;
    return keys_check(keys, key, len, &props);
}

td_auth_outcome_t td_auth_keys_check_bearer(const td_auth_keys_t *keys, const char *authorization)
{
    td_auth_key_props_t props;
    return td_auth_keys_check_bearer_props(keys, authorization, &props);
}

td_auth_outcome_t td_auth_keys_check_bearer_role(const td_auth_keys_t *keys, const char *authorization,
                                                 bool *admin_p)
{
    td_auth_key_props_t props;
    td_auth_outcome_t o = td_auth_keys_check_bearer_props(keys, authorization, &props);
    *admin_p = props.admin;
    return o;
}

td_auth_outcome_t td_auth_keys_check_bearer_props(const td_auth_keys_t *keys, const char *authorization,
                                                  td_auth_key_props_t *props_p)
{
    *props_p = (td_auth_key_props_t){0};
    if (!authorization || !authorization[0])
        return TD_AUTH_MISSING;
    const char *p = authorization;
    while (*p == ' ' || *p == '\t')
        p++;
    if (strncasecmp(p, "bearer", 6) || (p[6] != ' ' && p[6] != '\t'))
        return TD_AUTH_WRONG;
    p += 6;
    while (*p == ' ' || *p == '\t')
        p++;
    size_t len = strlen(p);
    while (len && (p[len - 1] == ' ' || p[len - 1] == '\t'))
        len--;
    td_auth_outcome_t o = keys_check(keys, p, len, props_p);
    return o == TD_AUTH_MISSING ? TD_AUTH_WRONG : o; /* "Bearer" and nothing: a malformed credential */
}

void td_auth_keys_destroy(td_auth_keys_t *keys)
{
    if (!keys)
        return;
    if (keys->d)
        OPENSSL_cleanse(keys->d, keys->n * sizeof *keys->d);
    free(keys->d);
    free(keys->path);
    free(keys);
}

/* ---- prefix-cache salts -------------------------------------------------------------- */

#define SALT_KEY_LABEL "tandem-cache-salt-key v1"
#define SALT_TAG "tandem-cache-salt v1"

static bool hmac_sha256(const uint8_t *key, size_t key_len, const void *a, size_t a_len, const void *b,
                        size_t b_len, uint8_t out[SHA256_DIGEST_LENGTH])
{
    uint8_t msg[64];
    TD_ASSERT(a_len + b_len <= sizeof msg);
    memcpy(msg, a, a_len);
    if (b_len)
        memcpy(msg + a_len, b, b_len);
    size_t outl = 0;
    bool ok = EVP_Q_mac(NULL, "HMAC", NULL, "SHA256", NULL, key, key_len, msg, a_len + b_len, out,
                        SHA256_DIGEST_LENGTH, &outl) && outl == SHA256_DIGEST_LENGTH;
    OPENSSL_cleanse(msg, sizeof msg);
    return ok;
}

/* The cluster's HMAC key (SHA-256 of the secret), defined with the cluster state below. */
static const uint8_t *cluster_key(const td_auth_cluster_t *c);

td_status_t td_auth_salt_key(const td_auth_cluster_t *c, uint8_t key[TD_AUTH_SALT_KEY_BYTES])
{
    uint8_t k[SHA256_DIGEST_LENGTH];
    if (!c) {
        if (RAND_bytes(k, sizeof k) != 1)
            return td_errorf(TD_ERR_IO, "prefix-cache salts: no randomness for their key");
    } else if (!hmac_sha256(cluster_key(c), SHA256_DIGEST_LENGTH, SALT_KEY_LABEL, sizeof SALT_KEY_LABEL, NULL, 0,
                            k)) {
        return td_errorf(TD_ERR_INTERNAL, "prefix-cache salts: libcrypto's HMAC-SHA256 failed");
    }
    memcpy(key, k, sizeof k);
    OPENSSL_cleanse(k, sizeof k);
    return TD_OK;
}

td_status_t td_auth_tenant_salt(const uint8_t key[TD_AUTH_SALT_KEY_BYTES], const uint8_t tenant[TD_AUTH_TENANT_BYTES],
                                uint64_t *salt_p)
{
    uint8_t mac[SHA256_DIGEST_LENGTH];
    if (!hmac_sha256(key, TD_AUTH_SALT_KEY_BYTES, SALT_TAG, sizeof SALT_TAG, tenant, TD_AUTH_TENANT_BYTES, mac))
        return td_errorf(TD_ERR_NOMEM, "prefix-cache salt: libcrypto's HMAC-SHA256 failed (out of memory?)");
    uint64_t salt = 0;
    for (int i = 7; i >= 0; i--)
        salt = salt << 8 | mac[i];
    *salt_p = salt ? salt : 1; /* 0 is "no salt" */
    return TD_OK;
}

/* ---- cluster secret ------------------------------------------------------------------ */

/* What a verifier remembers of one sender: the highest counter accepted and which of the
 * TD_AUTH_REPLAY_BITS counters below it were (bit i: counter top - 1 - i). */
typedef struct sender {
    uint64_t id;
    uint64_t top;
    int64_t last_ms; /* when it was last accepted (the verifier's clock) */
    int64_t sig_ms;  /* the latest signing time it presented (its clock) */
    uint64_t seen[TD_AUTH_REPLAY_BITS / 64];
    bool used;
} sender_t;

struct td_auth_cluster {
    td_auth_cluster_config_t cfg;
    uint8_t key[SHA256_DIGEST_LENGTH]; /* SHA-256 of the secret: the HMAC key */
    EVP_MAC *mac;
    EVP_MAC_CTX *ctx;  /* keyed once; re-initialised with the same key for each message */
    sender_t *senders; /* TD_AUTH_MAX_SENDERS */
    td_hash_t by_id;   /* sender id -> index in senders */
    int64_t floor_ms;  /* the latest signing time of a sender forgotten while still fresh: a
                          sender not in the table must have signed after it (else it may be a
                          replay of the forgotten one's calls) */
};

static const uint8_t *cluster_key(const td_auth_cluster_t *c)
{
    return c->key;
}

td_auth_cluster_config_t td_auth_cluster_config_default(void)
{
    return (td_auth_cluster_config_t){.window_ms = 60000};
}

td_status_t td_auth_cluster_create(const void *secret, size_t len, const td_auth_cluster_config_t *cfg,
                                   td_auth_cluster_t **c_p)
{
    if (len < TD_AUTH_SECRET_MIN)
        return td_errorf(TD_ERR_INVALID, "cluster secret: %zu characters, at least %d", len, TD_AUTH_SECRET_MIN);
    if (cfg->window_ms <= 0)
        return td_errorf(TD_ERR_INVALID, "cluster secret: window_ms must be positive");
    td_auth_cluster_t *c = calloc(1, sizeof *c);
    if (!c || !(c->senders = calloc(TD_AUTH_MAX_SENDERS, sizeof *c->senders)) ||
        td_hash_init(&c->by_id, TD_AUTH_MAX_SENDERS) != TD_OK) {
        if (c)
            free(c->senders);
        free(c);
        return td_errorf(TD_ERR_NOMEM, "cluster secret: out of memory");
    }
    c->cfg = *cfg;
    SHA256(secret, len, c->key);
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_END};
    if (!(c->mac = EVP_MAC_fetch(NULL, "HMAC", NULL)) || !(c->ctx = EVP_MAC_CTX_new(c->mac)) ||
        !EVP_MAC_init(c->ctx, c->key, sizeof c->key, params)) {
        td_auth_cluster_destroy(c);
        return td_errorf(TD_ERR_INTERNAL, "cluster secret: libcrypto has no HMAC-SHA256");
    }
    *c_p = c;
    return TD_OK;
}

td_status_t td_auth_cluster_load(const char *path, const td_auth_cluster_config_t *cfg, td_auth_cluster_t **c_p)
{
    char *text;
    size_t len;
    td_status_t st = td_file_read_all(path, FILE_MAX_BYTES, &text, &len);
    if (st != TD_OK)
        return st; /* logged there, naming the path */
    while (len && (is_blank(text[len - 1]) || text[len - 1] == '\n'))
        len--;
    if (memchr(text, '\n', len) || memchr(text, '\0', len))
        st = td_errorf(TD_ERR_FORMAT, "cluster secret file %s: the secret is one line (make one with "
                       "`openssl rand -hex 32`)", path);
    else if (len < TD_AUTH_SECRET_MIN)
        st = td_errorf(TD_ERR_FORMAT, "cluster secret file %s: the secret has %zu characters, at least %d "
                       "(make one with `openssl rand -hex 32`)", path, len, TD_AUTH_SECRET_MIN);
    else
        st = td_auth_cluster_create(text, len, cfg, c_p);
    OPENSSL_cleanse(text, len);
    free(text);
    if (st == TD_OK)
        warn_mode(path, "cluster secret file");
    return st;
}

void td_auth_cluster_destroy(td_auth_cluster_t *c)
{
    if (!c)
        return;
    EVP_MAC_CTX_free(c->ctx);
    EVP_MAC_free(c->mac);
    OPENSSL_cleanse(c->key, sizeof c->key);
    td_hash_free(&c->by_id);
    free(c->senders);
    free(c);
}

td_status_t td_auth_signer_init(td_auth_signer_t *s, td_auth_cluster_t *c, const char *audience)
{
    if (!audience || !audience[0] || strlen(audience) >= TD_AUTH_AUDIENCE_MAX)
        return td_errorf(TD_ERR_INVALID, "cluster auth: audience '%s' is empty or over %d bytes",
                         audience ? audience : "", TD_AUTH_AUDIENCE_MAX - 1);
    uint64_t id;
    if (RAND_bytes((unsigned char *)&id, sizeof id) != 1)
        return td_errorf(TD_ERR_IO, "cluster secret: no randomness for a sender id");
    *s = (td_auth_signer_t){.cluster = c, .sender = id, .counter = 0};
    strcpy(s->audience, audience);
    return TD_OK;
}

int64_t td_auth_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* HMAC over the domain tag, audience, method, sender, counter, time and request into out[32]. */
static bool mac_compute(td_auth_cluster_t *c, const char *audience, const char *method, uint64_t sender,
                        uint64_t counter, int64_t ms, const void *request, size_t len, uint8_t out[SHA256_DIGEST_LENGTH])
{
    char head[480];
    int hl = snprintf(head, sizeof head, "tandem-cluster-auth v1\n%s\n%s\n%016llx\n%llu\n%lld\n", audience, method,
                      (unsigned long long)sender, (unsigned long long)counter, (long long)ms);
    if (hl < 0 || (size_t)hl >= sizeof head)
        return false; /* a method path this long is no method of ours */
    EVP_MAC_CTX *m = c->ctx;
    size_t outl = 0;
    return EVP_MAC_init(m, NULL, 0, NULL) && /* the same key again: no key schedule, no copy */
           EVP_MAC_update(m, (const unsigned char *)head, (size_t)hl) && (!len || EVP_MAC_update(m, request, len)) &&
           EVP_MAC_final(m, out, &outl, SHA256_DIGEST_LENGTH) && outl == SHA256_DIGEST_LENGTH;
}

td_status_t td_auth_sign(td_auth_signer_t *s, int64_t now_ms, const char *method, const void *request, size_t len,
                         char *value, size_t cap)
{
    uint8_t mac[SHA256_DIGEST_LENGTH];
    uint64_t ctr = ++s->counter;
    if (!mac_compute(s->cluster, s->audience, method, s->sender, ctr, now_ms, request, len, mac))
        return td_errorf(TD_ERR_INTERNAL, "cluster auth: signing %s failed in libcrypto", method);
    static const char digits[] = "0123456789abcdef";
    char hex[2 * SHA256_DIGEST_LENGTH + 1];
    for (int i = 0; i < SHA256_DIGEST_LENGTH; i++) {
        hex[2 * i] = digits[mac[i] >> 4];
        hex[2 * i + 1] = digits[mac[i] & 15];
    }
    hex[2 * SHA256_DIGEST_LENGTH] = '\0';
    int n = snprintf(value, cap, "v1 %016llx %llu %lld %s", (unsigned long long)s->sender, (unsigned long long)ctr,
                     (long long)now_ms, hex);
    if (n < 0 || (size_t)n >= cap)
        return td_errorf(TD_ERR_RANGE, "cluster auth: %zu bytes are too few for the header", cap);
    return TD_OK;
}

static int hexval(char ch)
{
    return ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
}

/* "v1 SENDER COUNTER MS MAC" → fields; false when malformed. */
static bool parse_value(const char *v, uint64_t *sender, uint64_t *ctr, int64_t *ms, uint8_t mac[SHA256_DIGEST_LENGTH])
{
    unsigned long long s, k;
    long long t;
    char hex[2 * SHA256_DIGEST_LENGTH + 2];
    int used = 0;
    if (strncmp(v, "v1 ", 3) || sscanf(v + 3, "%16llx %20llu %20lld %65s%n", &s, &k, &t, hex, &used) != 4 ||
        v[3 + used] != '\0' || strlen(hex) != 2 * SHA256_DIGEST_LENGTH)
        return false;
    for (int i = 0; i < SHA256_DIGEST_LENGTH; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return false;
        mac[i] = (uint8_t)(hi << 4 | lo);
    }
    *sender = s;
    *ctr = k;
    *ms = t;
    return k > 0;
}

/* A new sender's entry: a free one, or one idle past 2 windows (its messages are all stale
 * by now, so forgetting it lets nothing in again), or else the least recently accepted one,
 * whose latest signing time becomes the floor a new sender must sign after (so its calls
 * cannot be replayed under a fresh entry). A full table never locks new senders out (a
 * node restarting in a loop, or many of them, once filled it and no node could join). A new
 * entry is marked used by replay_accept. */
static sender_t *sender_new(td_auth_cluster_t *c, uint64_t id, int64_t now_ms)
{
    int victim = 0;
    for (int i = 0; i < TD_AUTH_MAX_SENDERS; i++) { /* a new sender: rare, one per process */
        sender_t *e = &c->senders[i];
        if (!e->used || now_ms - e->last_ms > 2 * c->cfg.window_ms) {
            victim = i;
            break;
        }
        if (e->last_ms < c->senders[victim].last_ms)
            victim = i;
    }
    sender_t *e = &c->senders[victim];
    if (e->used) {
        if (now_ms - e->last_ms <= 2 * c->cfg.window_ms)
            c->floor_ms = TD_MAX(c->floor_ms, e->sig_ms);
        td_hash_remove(&c->by_id, e->id, (uint64_t)victim);
    }
    td_hash_put(&c->by_id, id, (uint64_t)victim); /* cannot fail: sized for every slot */
    *e = (sender_t){.id = id};
    return e;
}

/* Accepts counter k of e once; false for a repeat or one older than the bitmap. */
static bool replay_accept(sender_t *e, uint64_t k)
{
    if (!e->used) {
        e->used = true;
        e->top = k;
        return true;
    }
    if (k > e->top) { /* slide the window up by k - top */
        uint64_t shift = k - e->top;
        enum { W = TD_AUTH_REPLAY_BITS / 64 };
        if (shift > TD_AUTH_REPLAY_BITS) {
            memset(e->seen, 0, sizeof e->seen);
        } else {
            /* bit i (counter top-1-i) moves to bit i+shift; the old top becomes bit shift-1 */
            uint64_t w = shift / 64, b = shift % 64;
            for (int i = W - 1; i >= 0; i--) {
                uint64_t v = 0;
                if ((uint64_t)i >= w) {
                    v = e->seen[i - w] << b;
                    if (b && (uint64_t)i > w)
                        v |= e->seen[i - w - 1] >> (64 - b);
                }
                e->seen[i] = v;
            }
            e->seen[(shift - 1) / 64] |= 1ull << ((shift - 1) % 64);
        }
        e->top = k;
        return true;
    }
    if (k == e->top)
        return false;
    uint64_t i = e->top - 1 - k;
    if (i >= TD_AUTH_REPLAY_BITS)
        return false;
    if (e->seen[i / 64] & (1ull << (i % 64)))
        return false;
    e->seen[i / 64] |= 1ull << (i % 64);
    return true;
}

td_auth_outcome_t td_auth_verify(td_auth_cluster_t *c, int64_t now_ms, const char *audience, const char *method,
                                 const char *value, const void *request, size_t len, char *why, size_t cap)
{
    if (!value || !value[0]) {
        snprintf(why, cap, "no %s header: the caller has no cluster secret (--cluster-secret-file)", TD_AUTH_HEADER);
        return TD_AUTH_MISSING;
    }
    uint64_t sender, ctr;
    int64_t ms;
    uint8_t mac[SHA256_DIGEST_LENGTH], want[SHA256_DIGEST_LENGTH];
    if (!parse_value(value, &sender, &ctr, &ms, mac)) {
        snprintf(why, cap, "malformed %s header", TD_AUTH_HEADER);
        return TD_AUTH_WRONG;
    }
    if (!mac_compute(c, audience, method, sender, ctr, ms, request, len, want) ||
        CRYPTO_memcmp(mac, want, sizeof mac) != 0) {
        snprintf(why, cap, "the signature does not match: the caller's cluster secret differs from ours, or the "
                 "call was signed for another receiver than %s", audience);
        return TD_AUTH_WRONG;
    }
    if (ms < now_ms - c->cfg.window_ms || ms > now_ms + c->cfg.window_ms) {
        snprintf(why, cap, "stale signature: signed %lld ms from now, allowed +-%lld ms (clocks out of sync, "
                 "or a replay)", (long long)(ms - now_ms), (long long)c->cfg.window_ms);
        return TD_AUTH_WRONG;
    }
    td_hash_slot_t *h = td_hash_find(&c->by_id, sender);
    if (!h && ms <= c->floor_ms) {
        snprintf(why, cap, "a sender this verifier does not know signed at %lld, not after %lld, the latest call of "
                 "a sender it had to forget (a replay, or a clock behind: the caller retries)",
                 (long long)ms, (long long)c->floor_ms);
        return TD_AUTH_WRONG;
    }
    sender_t *e = h ? &c->senders[h->value] : sender_new(c, sender, now_ms);
    if (!replay_accept(e, ctr)) {
        snprintf(why, cap, "replayed request (sender %016llx counter %llu seen before or too old)",
                 (unsigned long long)sender, (unsigned long long)ctr);
        return TD_AUTH_WRONG;
    }
    e->last_ms = now_ms;
    e->sig_ms = TD_MAX(e->sig_ms, ms);
    return TD_AUTH_OK;
}

td_status_t td_auth_secret_generate(const char *path)
{
    uint8_t raw[32];
    char text[2 * sizeof raw + 2];
    if (RAND_bytes(raw, sizeof raw) != 1)
        return td_errorf(TD_ERR_IO, "cluster secret %s: no randomness", path);
    for (size_t i = 0; i < sizeof raw; i++)
        snprintf(text + 2 * i, 3, "%02x", raw[i]);
    text[2 * sizeof raw] = '\n';
    text[2 * sizeof raw + 1] = '\0';
    OPENSSL_cleanse(raw, sizeof raw);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        td_status_t st = td_errorf(errno == EEXIST ? TD_ERR_INVALID : TD_ERR_IO, "cluster secret %s: %s", path,
                                   strerror(errno));
        OPENSSL_cleanse(text, sizeof text);
        return st;
    }
    size_t n = strlen(text);
    ssize_t w = write(fd, text, n);
    int werr = errno;
    OPENSSL_cleanse(text, sizeof text);
    if (close(fd) != 0 || w != (ssize_t)n) {
        unlink(path);
        return td_errorf(TD_ERR_IO, "cluster secret %s: write failed: %s", path, strerror(werr));
    }
    return TD_OK;
}
