/*
 * td_node_conf: table-driven configuration for the cluster processes (router, prefill,
 * decode). A process describes its config struct once as a table of keys; the same keys
 * are accepted as `--key VALUE` / `--key=VALUE` flags and as `key = value` lines of a
 * `--config FILE` (# comments, blank lines). Flags given on the command line win over the
 * file, whatever their order. Defaults are whatever the struct held before parsing.
 *
 * Threads: any; no global state. Errors are logged once (td_errorf) naming the key.
 */
#ifndef TD_NODE_CONF_H
#define TD_NODE_CONF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

typedef enum td_node_conf_type {
    TD_NODE_CONF_I64,  /* int64_t, range-checked */
    TD_NODE_CONF_STR,  /* const char *, pointing into argv or into the parse's own copy */
    TD_NODE_CONF_BOOL, /* bool: "true"/"false"/"1"/"0"; a bare flag means true */
} td_node_conf_type_t;

typedef struct td_node_conf_key {
    const char *name;   /* "max-batch" */
    td_node_conf_type_t type;
    void *ptr;          /* int64_t *, const char **, bool * */
    int64_t min, max;   /* I64 only */
    const char *help;
} td_node_conf_key_t;

/* Strings read from a config file live here until td_node_conf_free. */
typedef struct td_node_conf_store {
    char *file_text;
} td_node_conf_store_t;

/*
 * Parses argv[1..argc) against keys[0..n_keys) (plus --config FILE and --help). Returns
 * TD_OK, or TD_ERR_INVALID with the offending key logged. *help_p is set when --help
 * was given (nothing else is parsed then). `store` keeps file strings alive.
 */
td_status_t td_node_conf_parse(const char *prog, const td_node_conf_key_t *keys, int n_keys,
                              int argc, char **argv, td_node_conf_store_t *store, bool *help_p);

/* Prints "  --key VALUE   help (default ...)" lines for every key. */
void td_node_conf_usage(const char *prog, const td_node_conf_key_t *keys, int n_keys);

/* Frees what td_node_conf_parse kept. NULL-safe fields. */
void td_node_conf_free(td_node_conf_store_t *store);

/* Splits "host:port" into host (copied into host[0..cap)) and port. TD_ERR_INVALID. */
td_status_t td_node_conf_split_addr(const char *addr, char *host, size_t cap, uint16_t *port_p);

#endif /* TD_NODE_CONF_H */
