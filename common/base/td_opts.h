/*
 * td_opts: the one command-line parser of tandem, driven by a table. A command describes
 * its flags once as an array of td_opt_t (name, type, where the value goes, range, help);
 * td_opts_parse reads `--name VALUE` / `--name=VALUE` (and, when the command asks,
 * `key = value` lines of a `--config FILE`) into the destinations, and td_opts_usage prints
 * the option lines of --help from the same table. The processes (router, prefill, decode)
 * use it through td_node_conf; every `tandem` subcommand and benchmark uses it directly.
 *
 * Values: a destination keeps what it held before parsing when its flag is not given (that
 * is the default). Names match exactly (no abbreviations). Errors name the flag and what
 * is allowed ("--max-batch: 0 is out of range [1, 4096]", "unknown option '--bogus'") and
 * are logged once with td_errorf; a caller exits 2 (usage error) on them.
 *
 * Threads: any; no global state.
 */
#ifndef TD_OPTS_H
#define TD_OPTS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "td_status.h"

typedef enum td_opt_type {
    TD_OPT_I64,  /* int64_t, in [min, max] */
    TD_OPT_F32,  /* float, in [fmin, fmax] (both 0: any number, infinities included; never NaN) */
    TD_OPT_STR,  /* const char *, pointing into argv or into the config file's text */
    TD_OPT_BOOL, /* bool: a bare `--flag` sets true and takes no value; in a config file
                    "true"/"false"/"1"/"0" */
    TD_OPT_FN,   /* parse(opt, value): anything else (a device, an enum, a repeatable flag) */
} td_opt_type_t;

typedef struct td_opt td_opt_t;

/* Converts `value` of flag `opt` into opt->ptr; logs (td_errorf, naming --opt->name) and
 * returns TD_ERR_INVALID on a bad value. */
typedef td_status_t td_opt_parse_fn(const td_opt_t *opt, const char *value);

struct td_opt {
    const char *name;      /* "max-batch": the flag is --max-batch, the file key max-batch */
    td_opt_type_t type;
    void *ptr;             /* int64_t *, float *, const char **, bool *, or the parse fn's */
    int64_t min, max;      /* TD_OPT_I64 */
    const char *help;      /* one line, or several separated by '\n' */
    const char *arg;       /* the value's name in --help ("PATH"); NULL: none shown */
    td_opt_parse_fn *parse; /* TD_OPT_FN */
    float fmin, fmax;      /* TD_OPT_F32 */
    bool multi;            /* TD_OPT_FN: also takes each following argument that does not
                              start with '-', each handed to parse in turn (argparse's
                              nargs='+': `--goodput ttft:500 tpot:50`) */
};

/* The common entries, spelled once (designated, so the fields not named are zero). */
#define TD_OPT_INT(n, p, lo, hi, h) {.name = (n), .type = TD_OPT_I64, .ptr = (p), .min = (lo), .max = (hi), .help = (h)}
#define TD_OPT_STRING(n, p, h) {.name = (n), .type = TD_OPT_STR, .ptr = (p), .help = (h)}

/* What a command accepts besides its flags. */
typedef struct td_opts {
    const char *prog;      /* prefixes every message: "tandem generate", "decode" */
    const td_opt_t *opts;
    int n_opts;
    bool config_file;      /* --config FILE: `key = value` lines, # comments; flags win over
                              the file whatever their order */
    int max_args;          /* positional arguments allowed (more are refused) */
} td_opts_t;

/* What a parse found. Release with td_opts_result_free (the file's strings live here). */
typedef struct td_opts_result {
    bool help;             /* --help or -h was given: nothing else was parsed */
    int n_args;            /* positional arguments, in argv order */
    char **args;           /* args[0..n_args) point into argv (NULL when none allowed) */
    int *given;            /* given[i] != 0 when opts[i] was given: the argv index of its
                              last occurrence (-1: from the config file); NULL unless the
                              caller set it to an array of n_opts before parsing */
    char *file_text;
} td_opts_result_t;

/*
 * Parses argv[1..argc) against spec. Returns TD_OK, or TD_ERR_INVALID (or the config
 * file's read error) logged naming the flag. On --help, *r says so and nothing else is
 * parsed. r->given, if set, must hold spec->n_opts zeroed ints.
 */
td_status_t td_opts_parse(const td_opts_t *spec, int argc, char **argv, td_opts_result_t *r);

/* r->given's entry for the option called `name` (r->given must have been set): its argv
 * index, -1 from the config file, 0 when not given or when spec has no such option. */
int td_opts_given(const td_opts_t *spec, const td_opts_result_t *r, const char *name);

/* Frees the config file's text (the strings read from it go with it). */
void td_opts_result_free(td_opts_result_t *r);

/*
 * Prints one "  --name ARG   help" line per option to f (continuation lines of a help
 * with '\n' aligned under it); with show_defaults, " (default V)" from the destination's
 * current value where there is one (not for TD_OPT_FN).
 */
void td_opts_usage(FILE *f, const td_opt_t *opts, int n_opts, bool show_defaults);

#endif /* TD_OPTS_H */
