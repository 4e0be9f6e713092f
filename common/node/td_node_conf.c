/*
 * td_node_conf: the one config table reader of the cluster processes (see td_node_conf.h).
 */
#include "td_node_conf.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_util.h"

static const td_node_conf_key_t *find_key(const td_node_conf_key_t *keys, int n, const char *name,
                                         size_t len)
{
    for (int i = 0; i < n; i++)
        if (strlen(keys[i].name) == len && !strncmp(keys[i].name, name, len))
            return &keys[i];
    return NULL;
}

static td_status_t set_value(const char *prog, const td_node_conf_key_t *k, const char *v)
{
    switch (k->type) {
    case TD_NODE_CONF_I64: {
        char what[96];
        snprintf(what, sizeof what, "%s: %s", prog, k->name);
        return td_parse_i64(v, k->min, k->max, what, (int64_t *)k->ptr);
    }
    case TD_NODE_CONF_STR: *(const char **)k->ptr = v; return TD_OK;
    case TD_NODE_CONF_BOOL:
        if (!strcmp(v, "true") || !strcmp(v, "1"))
            *(bool *)k->ptr = true;
        else if (!strcmp(v, "false") || !strcmp(v, "0"))
            *(bool *)k->ptr = false;
        else
            return td_errorf(TD_ERR_INVALID, "%s: %s: '%s' is not true or false", prog, k->name, v);
        return TD_OK;
    }
    return TD_ERR_INVALID;
}

/* Applies key = value lines of `text` (modified in place). */
static td_status_t parse_file(const char *prog, const char *path, char *text, const td_node_conf_key_t *keys,
                              int n_keys)
{
    int lineno = 0;
    for (char *line = text, *next; line; line = next) {
        next = strchr(line, '\n');
        if (next)
            *next++ = '\0';
        lineno++;
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *eq = strchr(line, '=');
        char *p = line;
        while (*p == ' ' || *p == '\t')
            p++;
        if (!*p)
            continue;
        if (!eq)
            return td_errorf(TD_ERR_INVALID, "%s: %s:%d: expected 'key = value'", prog, path, lineno);
        char *kend = eq;
        while (kend > p && (kend[-1] == ' ' || kend[-1] == '\t'))
            kend--;
        char *v = eq + 1;
        while (*v == ' ' || *v == '\t')
            v++;
        char *vend = v + strlen(v);
        while (vend > v && (vend[-1] == ' ' || vend[-1] == '\t' || vend[-1] == '\r'))
            *--vend = '\0';
        const td_node_conf_key_t *k = find_key(keys, n_keys, p, (size_t)(kend - p));
        if (!k)
            return td_errorf(TD_ERR_INVALID, "%s: %s:%d: unknown key '%.*s'", prog, path, lineno,
                             (int)(kend - p), p);
        td_status_t st = set_value(prog, k, v);
        if (st != TD_OK)
            return st;
    }
    return TD_OK;
}

td_status_t td_node_conf_parse(const char *prog, const td_node_conf_key_t *keys, int n_keys, int argc,
                              char **argv, td_node_conf_store_t *store, bool *help_p)
{
    *help_p = false;
    store->file_text = NULL;
    /* the file first, so that flags override it whatever their order */
    for (int i = 1; i < argc; i++) {
        const char *path = NULL;
        if (!strcmp(argv[i], "--config") && i + 1 < argc)
            path = argv[i + 1];
        else if (!strncmp(argv[i], "--config=", 9))
            path = argv[i] + 9;
        if (!path)
            continue;
        size_t len;
        td_status_t st = td_file_read_all(path, 1 << 20, &store->file_text, &len);
        if (st != TD_OK)
            return st;
        if ((st = parse_file(prog, path, store->file_text, keys, n_keys)) != TD_OK)
            return st;
        break;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            *help_p = true;
            return TD_OK;
        }
        if (strncmp(a, "--", 2))
            return td_errorf(TD_ERR_INVALID, "%s: unexpected argument '%s'", prog, a);
        a += 2;
        const char *eq = strchr(a, '=');
        size_t nlen = eq ? (size_t)(eq - a) : strlen(a);
        if (nlen == 6 && !strncmp(a, "config", 6)) {
            if (!eq)
                i++;
            continue;
        }
        const td_node_conf_key_t *k = find_key(keys, n_keys, a, nlen);
        if (!k)
            return td_errorf(TD_ERR_INVALID, "%s: unknown option '--%.*s' (see --help)", prog, (int)nlen, a);
        const char *v = eq ? eq + 1 : NULL;
        if (!v && k->type == TD_NODE_CONF_BOOL && (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0 ||
                                                  (strcmp(argv[i + 1], "true") && strcmp(argv[i + 1], "false")))) {
            *(bool *)k->ptr = true;
            continue;
        }
        if (!v) {
            if (i + 1 >= argc)
                return td_errorf(TD_ERR_INVALID, "%s: --%s needs a value", prog, k->name);
            v = argv[++i];
        }
        td_status_t st = set_value(prog, k, v);
        if (st != TD_OK)
            return st;
    }
    return TD_OK;
}

void td_node_conf_usage(const char *prog, const td_node_conf_key_t *keys, int n_keys)
{
    printf("usage: tandem %s [--config FILE] [--key VALUE]...\n\n", prog);
    for (int i = 0; i < n_keys; i++) {
        const td_node_conf_key_t *k = &keys[i];
        char def[64] = "";
        if (k->type == TD_NODE_CONF_I64)
            snprintf(def, sizeof def, "%" PRId64, *(int64_t *)k->ptr);
        else if (k->type == TD_NODE_CONF_BOOL)
            snprintf(def, sizeof def, "%s", *(bool *)k->ptr ? "true" : "false");
        else if (*(const char **)k->ptr)
            snprintf(def, sizeof def, "%s", *(const char **)k->ptr);
        printf("  --%-22s %s%s%s%s\n", k->name, k->help, def[0] ? " (default " : "", def, def[0] ? ")" : "");
    }
    printf("\nEvery key can also be given as 'key = value' in the --config file; flags win.\n");
}

void td_node_conf_free(td_node_conf_store_t *store)
{
    free(store->file_text);
    store->file_text = NULL;
}

td_status_t td_node_conf_split_addr(const char *addr, char *host, size_t cap, uint16_t *port_p)
{
    const char *colon = addr ? strrchr(addr, ':') : NULL;
    if (!colon || colon == addr || (size_t)(colon - addr) >= cap)
        return td_errorf(TD_ERR_INVALID, "address '%s' is not HOST:PORT", addr ? addr : "");
    int64_t port;
    if (td_parse_i64(colon + 1, 1, 65535, "port", &port) != TD_OK)
        return TD_ERR_INVALID;
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = '\0';
    *port_p = (uint16_t)port;
    return TD_OK;
}
