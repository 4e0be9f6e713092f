/*
 * td_opts: the one table-driven command-line (and config file) parser (see td_opts.h).
 */
#include "td_opts.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "td_util.h"

static int find_opt(const td_opts_t *spec, const char *name, size_t len)
{
    for (int i = 0; i < spec->n_opts; i++)
        if (strlen(spec->opts[i].name) == len && !strncmp(spec->opts[i].name, name, len))
            return i;
    return -1;
}

/* Stores `v` (never NULL) for opts[i]; `from_file` lets a bool take a value. */
static td_status_t set_value(const td_opts_t *spec, int i, const char *v, bool from_file)
{
    const td_opt_t *o = &spec->opts[i];
    char what[128];
    snprintf(what, sizeof what, "%s: --%s", spec->prog, o->name);
    switch (o->type) {
    case TD_OPT_I64: return td_parse_i64(v, o->min, o->max, what, (int64_t *)o->ptr);
    case TD_OPT_F32: {
        bool any = o->fmin == 0.0f && o->fmax == 0.0f;
        return td_parse_f32(v, any ? -INFINITY : o->fmin, any ? INFINITY : o->fmax, what, (float *)o->ptr);
    }
    case TD_OPT_STR: *(const char **)o->ptr = v; return TD_OK;
    case TD_OPT_BOOL:
        if (!from_file)
            return td_errorf(TD_ERR_INVALID, "%s takes no value (given '%s')", what, v);
        if (!strcmp(v, "true") || !strcmp(v, "1"))
            *(bool *)o->ptr = true;
        else if (!strcmp(v, "false") || !strcmp(v, "0"))
            *(bool *)o->ptr = false;
        else
            return td_errorf(TD_ERR_INVALID, "%s: '%s' is not true or false", what, v);
        return TD_OK;
    case TD_OPT_FN: return o->parse(o, v);
    }
    return TD_ERR_INVALID;
}

/* Applies the `key = value` lines of `text` (modified in place). */
static td_status_t parse_file(const td_opts_t *spec, const char *path, char *text, td_opts_result_t *r)
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
            return td_errorf(TD_ERR_INVALID, "%s: %s:%d: expected 'key = value'", spec->prog, path, lineno);
        char *kend = eq;
        while (kend > p && (kend[-1] == ' ' || kend[-1] == '\t'))
            kend--;
        char *v = eq + 1;
        while (*v == ' ' || *v == '\t')
            v++;
        char *vend = v + strlen(v);
        while (vend > v && (vend[-1] == ' ' || vend[-1] == '\t' || vend[-1] == '\r'))
            *--vend = '\0';
        int i = find_opt(spec, p, (size_t)(kend - p));
        if (i < 0)
            return td_errorf(TD_ERR_INVALID, "%s: %s:%d: unknown key '%.*s'", spec->prog, path, lineno,
                             (int)(kend - p), p);
        td_status_t st = set_value(spec, i, v, true);
        if (st != TD_OK)
            return st;
        if (r->given)
            r->given[i] = -1;
    }
    return TD_OK;
}

/* Reads the first --config FILE of argv, if the spec takes one. */
static td_status_t read_config(const td_opts_t *spec, int argc, char **argv, td_opts_result_t *r)
{
    for (int i = 1; spec->config_file && i < argc; i++) {
        const char *path = NULL;
        if (!strcmp(argv[i], "--config") && i + 1 < argc)
            path = argv[i + 1];
        else if (!strncmp(argv[i], "--config=", 9))
            path = argv[i] + 9;
        if (!path)
            continue;
        size_t len;
        td_status_t st = td_file_read_all(path, 1 << 20, &r->file_text, &len);
        if (st != TD_OK)
            return st;
        return parse_file(spec, path, r->file_text, r);
    }
    return TD_OK;
}

td_status_t td_opts_parse(const td_opts_t *spec, int argc, char **argv, td_opts_result_t *r)
{
    r->help = false;
    r->n_args = 0;
    r->file_text = NULL;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            r->help = true;
            return TD_OK;
        }
    /* the file first, so that flags override it whatever their order */
    td_status_t st = read_config(spec, argc, argv, r);
    if (st != TD_OK)
        return st;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-' || !a[1]) {
            if (r->n_args >= spec->max_args)
                return td_errorf(TD_ERR_INVALID, "%s: unexpected argument '%s' (see --help)", spec->prog, a);
            r->args[r->n_args++] = argv[i];
            continue;
        }
        if (a[1] != '-')
            return td_errorf(TD_ERR_INVALID, "%s: unknown option '%s' (see --help)", spec->prog, a);
        a += 2;
        const char *eq = strchr(a, '=');
        size_t nlen = eq ? (size_t)(eq - a) : strlen(a);
        if (spec->config_file && nlen == 6 && !strncmp(a, "config", 6)) {
            if (!eq && ++i >= argc)
                return td_errorf(TD_ERR_INVALID, "%s: --config needs a value (FILE)", spec->prog);
            continue;
        }
        int k = find_opt(spec, a, nlen);
        if (k < 0)
            return td_errorf(TD_ERR_INVALID, "%s: unknown option '--%.*s' (see --help)", spec->prog, (int)nlen, a);
        const td_opt_t *o = &spec->opts[k];
        if (r->given)
            r->given[k] = i;
        if (o->type == TD_OPT_BOOL && !eq) {
            *(bool *)o->ptr = true;
        } else {
            const char *v = eq ? eq + 1 : NULL;
            if (!v) {
                if (i + 1 >= argc)
                    return td_errorf(TD_ERR_INVALID, "%s: --%s needs a value%s%s%s", spec->prog, o->name,
                                     o->arg ? " (" : "", o->arg ? o->arg : "", o->arg ? ")" : "");
                v = argv[++i];
            }
            if ((st = set_value(spec, k, v, false)) != TD_OK)
                return st;
            while (o->multi && !eq && i + 1 < argc && argv[i + 1][0] != '-')
                if ((st = set_value(spec, k, argv[++i], false)) != TD_OK)
                    return st;
        }
    }
    return TD_OK;
}

int td_opts_given(const td_opts_t *spec, const td_opts_result_t *r, const char *name)
{
    int i = find_opt(spec, name, strlen(name));
    return i >= 0 ? r->given[i] : 0;
}

void td_opts_result_free(td_opts_result_t *r)
{
    free(r->file_text);
    r->file_text = NULL;
}

void td_opts_usage(FILE *f, const td_opt_t *opts, int n_opts, bool show_defaults)
{
    int width = 0;
    for (int i = 0; i < n_opts; i++) {
        int w = 2 + (int)strlen(opts[i].name) + (opts[i].arg ? 1 + (int)strlen(opts[i].arg) : 0);
        width = TD_MAX(width, w);
    }
    width = TD_MIN(width, 24);
    for (int i = 0; i < n_opts; i++) {
        const td_opt_t *o = &opts[i];
        char label[96], def[64] = "";
        snprintf(label, sizeof label, "--%s%s%s", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
        if (show_defaults) {
            if (o->type == TD_OPT_I64)
                snprintf(def, sizeof def, "%" PRId64, *(int64_t *)o->ptr);
            else if (o->type == TD_OPT_F32)
                snprintf(def, sizeof def, "%g", (double)*(float *)o->ptr);
            else if (o->type == TD_OPT_BOOL)
                snprintf(def, sizeof def, "%s", *(bool *)o->ptr ? "true" : "false");
            else if (o->type == TD_OPT_STR && *(const char **)o->ptr)
                snprintf(def, sizeof def, "%s", *(const char **)o->ptr);
        }
        fprintf(f, "  %-*s", width, label);
        if ((int)strlen(label) > width)
            fprintf(f, "\n  %-*s", width, "");
        for (const char *h = o->help;;) {
            const char *nl = strchr(h, '\n');
            if (!nl) {
                fprintf(f, "  %s%s%s%s\n", h, def[0] ? " (default " : "", def, def[0] ? ")" : "");
                break;
            }
            fprintf(f, "  %.*s\n  %-*s", (int)(nl - h), h, width, "");
            h = nl + 1;
        }
    }
}
