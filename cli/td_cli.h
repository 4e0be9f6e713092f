/*
 * td_cli: the subcommands of the `tandem` binary. Each lives in cli/cmd_<name>.c (or
 * bench/ for benchmarks), takes argc/argv starting at its own name, and returns the
 * process exit status (0 ok, 1 runtime failure, 2 usage error).
 */
#ifndef TD_CLI_H
#define TD_CLI_H

int cmd_generate(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_model(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_router(int argc, char **argv);
int cmd_prefill(int argc, char **argv);
int cmd_decode(int argc, char **argv);
int cmd_local(int argc, char **argv);

#endif /* TD_CLI_H */
