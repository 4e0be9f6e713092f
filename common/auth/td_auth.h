/*
 * td_auth: who may use a tandem cluster. Two independent mechanisms (docs/security.md has
 * the threat model):
 *
 * - API keys on the front doors (the router's gRPC gateway and its HTTP API): a file of
 *   keys, one a line, loaded at start and reloaded on SIGHUP; a request carries
 *   `authorization: Bearer KEY`. Keys are kept only as SHA-256 digests and a presented key
 *   is compared by its digest against every one with CRYPTO_memcmp, without an early exit,
 *   so neither the key's content nor its length shows in the time taken. Nothing here
 *   logs a key or a digest.
 *
 * - The cluster secret on the control plane: the router and every node read the same
 *   secret file; each control RPC carries a `tandem-cluster-auth` header
 *
 *       v1 <sender 16 hex> <counter> <unix ms> <HMAC-SHA256 64 hex>
 *
 *   with the HMAC (key SHA-256(secret)) over "tandem-cluster-auth v1", the audience (who
 *   the call is for: the node id of the node called, or "router"), the method path, the
 *   sender, counter and time, and the serialized request. The receiver recomputes it with
 *   its own audience, so a call signed for one node is refused by every other
 *   (CRYPTO_memcmp), refuses a time more than window_ms away from its clock, and keeps per
 *   sender (a random id per signer, i.e. per gRPC channel) the highest counter seen and a
 *   bitmap of the TD_AUTH_REPLAY_BITS before it, so each signed request is accepted once:
 *   a replay inside the time window is a repeated counter, one outside it is stale.
 *   Senders idle for 2 * window_ms are forgotten (any message of theirs is stale by then).
 *
 * Beside them, each key's tenant (tenant=NAME, or the key alone) and the tenant's
 * prefix-cache salt, which keeps one tenant's cached prompts from showing as another's hits.
 *
 * Threads: a td_auth_keys_t or td_auth_cluster_t is used on one thread (the loop's);
 * td_auth_keys_reload swaps the keys in place on that thread. No global state.
 */
#ifndef TD_AUTH_H
#define TD_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

/* How a credential fared: the label of tandem_auth_*_total{outcome}. */
typedef enum td_auth_outcome {
    TD_AUTH_OK = 0,
    TD_AUTH_MISSING = 1, /* no credential at all */
    TD_AUTH_WRONG = 2,   /* present but not valid (unknown key, bad MAC, stale, replayed) */
} td_auth_outcome_t;
#define TD_AUTH_N_OUTCOMES 3

/* "ok", "missing", "wrong". Never NULL. */
const char *td_auth_outcome_name(td_auth_outcome_t o);

/* ---- API keys ------------------------------------------------------------------------ */

/* Key rules: printable ASCII without spaces (0x21..0x7e), TD_AUTH_KEY_MIN..TD_AUTH_KEY_MAX
 * characters (`openssl rand -hex 32` makes one). */
#define TD_AUTH_KEY_MIN 16
#define TD_AUTH_KEY_MAX 256
#define TD_AUTH_KEYS_MAX 4096           /* keys per file */

typedef struct td_auth_keys td_auth_keys_t;

#define TD_AUTH_TENANT_MAX 64 /* characters of a tenant=NAME */
#define TD_AUTH_TENANT_BYTES 32 /* a tenant's identity (a SHA-256 digest) */

/* What a key's line says after the key (KEY [admin] [priority=N] [rate=R] [tenant=NAME]). */
typedef struct td_auth_key_props {
    bool admin;            /* admin: the key may call the admin RPCs (ClusterStatus) */
    bool has_priority_cap; /* priority=N given */
    int32_t max_priority;  /* N: a request's priority.value is capped at it */
    double rate;           /* rate=R: requests a second at most (bursts of max(1, R)); 0 = none */
    uint32_t index;        /* the key's place among the keys (0-based): per-key state of a
                            * caller, valid until td_auth_keys_generation changes */
    uint8_t tenant[TD_AUTH_TENANT_BYTES]; /* whose prompts the key's are (docs/security.md
                            * "Tenants"): SHA-256 over a tag and NAME for tenant=NAME (keys
                            * naming the same tenant share it), else over a tag and the key's
                            * digest (a tenant of its own). Stable across reloads and restarts;
                            * reveals neither the key nor, without the name, the tenant. */
} td_auth_key_props_t;

/*
 * Loads the API keys file `path`: one key per line, optionally followed by blanks and
 * flags, each at most once: `admin` (the key may also call the admin RPCs: ClusterStatus),
 * `priority=N` (its requests' priority.value is capped at N), `rate=R` (at most R requests
 * a second, in bursts of max(1, R); R in 0.001 .. 1e6), `tenant=NAME` (the key's prompts
 * are tenant NAME's: 1 .. TD_AUTH_TENANT_MAX letters, digits, '.', '_' or '-'; without it
 * the key is a tenant of its own; td_auth_key_props_t.tenant); leading and trailing
 * spaces, tabs and a CR are ignored; blank lines and lines whose first non-blank character
 * is '#' are comments. A file with no key, a key that breaks the rules above, a key repeated, more
 * than TD_AUTH_KEYS_MAX keys or a file that cannot be read is an error naming the file
 * and the line (never the key): TD_ERR_IO, TD_ERR_FORMAT, TD_ERR_NOMEM. A file readable by
 * group or others is loaded with a warning. *keys_p set only on success.
 */
td_status_t td_auth_keys_load(const char *path, td_auth_keys_t **keys_p);

/*
 * Reads the file again (SIGHUP). On success the new keys replace the old ones; on any
 * error (same as td_auth_keys_load, logged) the old keys stay in force.
 */
td_status_t td_auth_keys_reload(td_auth_keys_t *keys);

/* Keys in force. */
size_t td_auth_keys_count(const td_auth_keys_t *keys);

/* The path loaded from (for logs). */
const char *td_auth_keys_path(const td_auth_keys_t *keys);

/* Checks a key of len bytes (any bytes) in constant time for a given number of keys:
 * TD_AUTH_OK when it is one of them, TD_AUTH_MISSING when len is 0, else TD_AUTH_WRONG. */
td_auth_outcome_t td_auth_keys_check(const td_auth_keys_t *keys, const char *key, size_t len);

/* Checks an `authorization` header value ("Bearer KEY"; the scheme is case-insensitive,
 * blanks around the key ignored): NULL or "" → TD_AUTH_MISSING; another scheme or a wrong
 * key → TD_AUTH_WRONG. */
td_auth_outcome_t td_auth_keys_check_bearer(const td_auth_keys_t *keys, const char *authorization);

/* td_auth_keys_check_bearer, and *admin_p: true when the key matched carries the admin flag
 * (false unless TD_AUTH_OK). The time taken shows neither which key nor whether admin. */
td_auth_outcome_t td_auth_keys_check_bearer_role(const td_auth_keys_t *keys, const char *authorization,
                                                 bool *admin_p);

/* td_auth_keys_check_bearer, and *props_p: the matched key's flags and place (all zero
 * unless TD_AUTH_OK). The time taken shows neither which key nor its flags. */
td_auth_outcome_t td_auth_keys_check_bearer_props(const td_auth_keys_t *keys, const char *authorization,
                                                  td_auth_key_props_t *props_p);

/* Counts the reloads that took: a caller's per-key state (by td_auth_key_props_t.index)
 * is stale once it changes. */
uint64_t td_auth_keys_generation(const td_auth_keys_t *keys);

/* NULL is a no-op; the digests are wiped. */
void td_auth_keys_destroy(td_auth_keys_t *keys);

/* ---- prefix-cache salts -------------------------------------------------------------- */

/*
 * A router seeds the prefix-cache hash chain of each request with its tenant's salt
 * (docs/security.md "Tenants"), so one tenant's cached prefixes are never another's hits.
 * The salt is an HMAC of the tenant's identity under a salt key: the key comes from the
 * cluster secret when there is one (the same on every router start, so the nodes' caches
 * stay useful across a router restart; unknown to clients, who hold no secret), else it is
 * random for the process's life (a restarted router then misses what its nodes cached).
 */
#define TD_AUTH_SALT_KEY_BYTES 32

typedef struct td_auth_cluster td_auth_cluster_t;

/* Writes the salt key: HMAC-SHA256 of a label under the cluster secret's key when c is not
 * NULL, else 32 random bytes. Errors: TD_ERR_IO (no randomness), TD_ERR_INTERNAL (libcrypto
 * failed); key untouched then. */
td_status_t td_auth_salt_key(const td_auth_cluster_t *c, uint8_t key[TD_AUTH_SALT_KEY_BYTES]);

/* *salt_p: the tenant's salt under key, the first 8 bytes of HMAC-SHA256(key, tag || tenant)
 * read little-endian; never 0 (0 means "no salt": one cache for all). Any thread. Errors:
 * TD_ERR_NOMEM (libcrypto failed; *salt_p untouched). */
td_status_t td_auth_tenant_salt(const uint8_t key[TD_AUTH_SALT_KEY_BYTES], const uint8_t tenant[TD_AUTH_TENANT_BYTES],
                                uint64_t *salt_p);

/* ---- cluster secret ------------------------------------------------------------------ */

#define TD_AUTH_HEADER "tandem-cluster-auth" /* gRPC metadata name */
#define TD_AUTH_HEADER_CHARS 128             /* room for its value, NUL included */
#define TD_AUTH_SECRET_MIN 32                /* characters in a secret file */
#define TD_AUTH_REPLAY_BITS 1024             /* counters a sender may arrive out of order */
#define TD_AUTH_MAX_SENDERS 1024             /* senders remembered by a verifier */

typedef struct td_auth_cluster_config {
    int64_t window_ms; /* accepted clock difference between signer and verifier; 60000 */
} td_auth_cluster_config_t;

td_auth_cluster_config_t td_auth_cluster_config_default(void);

/*
 * Reads the secret file: its content with trailing blanks and newlines removed, at least
 * TD_AUTH_SECRET_MIN characters, one line. Errors name the file: TD_ERR_IO, TD_ERR_FORMAT,
 * TD_ERR_NOMEM. A file readable by group or others loads with a warning. *c_p on success.
 */
td_status_t td_auth_cluster_load(const char *path, const td_auth_cluster_config_t *cfg,
                                 td_auth_cluster_t **c_p);

/* The same from the secret's bytes (tests; len >= TD_AUTH_SECRET_MIN). */
td_status_t td_auth_cluster_create(const void *secret, size_t len, const td_auth_cluster_config_t *cfg,
                                   td_auth_cluster_t **c_p);

/* NULL is a no-op; keys are wiped. */
void td_auth_cluster_destroy(td_auth_cluster_t *c);

#define TD_AUTH_AUDIENCE_MAX 64 /* bytes of an audience, NUL included (a node id fits) */

/* One signer: a random sender id and its counter, for calls to one audience.
 * Caller-allocated; one per channel, so a verifier sees each sender's counters in nearly
 * the order they were signed. */
typedef struct td_auth_signer {
    td_auth_cluster_t *cluster;
    uint64_t sender;
    uint64_t counter;
    char audience[TD_AUTH_AUDIENCE_MAX];
} td_auth_signer_t;

/* Draws a random sender id; `audience` (copied) is who the calls are for. Errors:
 * TD_ERR_INVALID (audience empty or too long), TD_ERR_IO (no randomness). */
td_status_t td_auth_signer_init(td_auth_signer_t *s, td_auth_cluster_t *c, const char *audience);

/*
 * Signs `method` with request[0..len) at now_ms (unix ms) into value[0..cap)
 * (TD_AUTH_HEADER_CHARS fits). Errors: TD_ERR_RANGE (cap too small), TD_ERR_INTERNAL
 * (libcrypto failed).
 */
td_status_t td_auth_sign(td_auth_signer_t *s, int64_t now_ms, const char *method, const void *request,
                         size_t len, char *value, size_t cap);

/*
 * Verifies a header value (NULL when absent) for `method` and request[0..len) at now_ms,
 * signed for `audience` (this receiver: its node id, or "router"), and records its counter. TD_AUTH_OK, TD_AUTH_MISSING (no header) or TD_AUTH_WRONG with
 * why[0..cap) saying which check failed (malformed, bad MAC, stale, replayed, too many
 * senders); nothing is logged (the caller logs what it refuses, once).
 */
td_auth_outcome_t td_auth_verify(td_auth_cluster_t *c, int64_t now_ms, const char *audience, const char *method,
                                 const char *value, const void *request, size_t len, char *why, size_t cap);

/* Current unix time in ms (CLOCK_REALTIME): the clock both sides use. */
int64_t td_auth_now_ms(void);

/*
 * Writes a new random secret (32 bytes, 64 hex characters and a newline) to `path`,
 * created with mode 0600 (an existing file is refused: TD_ERR_INVALID). TD_ERR_IO.
 */
td_status_t td_auth_secret_generate(const char *path);

#endif /* TD_AUTH_H */
