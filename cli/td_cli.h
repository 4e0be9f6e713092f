/*
 * td_cli: the subcommands of the `tandem` binary. Each lives in cli/cmd_<name>.c (or
 * bench/ for benchmarks), takes argc/argv starting at its own name, and returns the
 * process exit status (0 ok, 1 runtime failure, 2 usage error).
 */
#ifndef TD_CLI_H
#define TD_CLI_H

#include "td_opts.h"

int cmd_generate(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_perplexity(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_model(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_router(int argc, char **argv);
int cmd_prefill(int argc, char **argv);
int cmd_decode(int argc, char **argv);
int cmd_unified(int argc, char **argv);
int cmd_local(int argc, char **argv);
int cmd_drain(int argc, char **argv);
int cmd_plan(int argc, char **argv);

/* td_opts parse fns of the flags several commands share (cli/cli_opts.c): --device into a
 * td_device_spec_t (cpu, cuda, cuda:N), --dtype into a td_dtype_t (f32|f16|bf16), --quant
 * into an int holding a block td_dtype_t (q8_0|q4_0; leave it -1 for "not given"). */
td_status_t cli_opt_device(const td_opt_t *opt, const char *value);
td_status_t cli_opt_dtype(const td_opt_t *opt, const char *value);
td_status_t cli_opt_quant(const td_opt_t *opt, const char *value);
td_status_t cli_opt_kv_dtype(const td_opt_t *opt, const char *value); /* into an int, as cli_opt_quant */
/* --spec into a td_spec_mode_t (off|prompt-lookup|draft-model). */
td_status_t cli_opt_spec(const td_opt_t *opt, const char *value);

#endif /* TD_CLI_H */
