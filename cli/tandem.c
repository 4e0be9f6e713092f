/*
 * tandem: the one binary. Dispatches to a subcommand by its first argument.
 */
#include <stdio.h>
#include <string.h>

#include "td_backend.h"
#include "td_cli.h"

#ifndef TD_VERSION
#define TD_VERSION "0.0.0"
#endif

typedef struct cmd {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *help;
} cmd_t;

static const cmd_t cmds[] = {
    {"generate", cmd_generate, "generate text from a model on this machine"},
    {"chat", cmd_chat, "chat with a model on this machine (its chat template, turns on stdin)"},
    {"perplexity", cmd_perplexity, "perplexity of a model on a text file (llama-perplexity's method)"},
    {"tokenize", cmd_tokenize, "encode stdin to token ids (or decode ids with --decode)"},
    {"model", cmd_model, "model tools: synth (write a random-weight model), info"},
    {"bench", cmd_bench, "benchmarks: engine, kernels"},
    {"router", cmd_router, "cluster router: gateway gRPC API, node registry, token relay"},
    {"prefill", cmd_prefill, "cluster prefill node"},
    {"decode", cmd_decode, "cluster decode node"},
    {"unified", cmd_unified, "cluster unified node: prefill and decode in one engine (colocated baseline)"},
    {"local", cmd_local, "a whole cluster (router + prefill + decode processes) on 127.0.0.1"},
    {"drain", cmd_drain, "drain a cluster node: no new requests, finish what runs, exit (as SIGTERM)"},
    {"plan", cmd_plan, "capacity planning: profile a model, simulate a cluster (splits, rates, nodes)"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: tandem <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        fprintf(f, "  %-11s %s\n", cmds[i].name, cmds[i].help);
    fprintf(f, "\n  --version  print the version and compiled backends\n"
               "\n'tandem <command> --help' describes each command.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        printf("tandem %s\nbackends: cpu%s\n", TD_VERSION, td_backend_cuda_compiled() ? " cuda" : "");
        const char *isa, *best;
        if (td_backend_cpu_isa_choose(NULL, &isa, &best) != TD_OK)
            return 1; /* TANDEM_CPU_ISA is wrong: the message says why */
        printf("cpu kernels: %s (this CPU's best: %s%s)\n", isa, best,
               strcmp(isa, best) ? "; TANDEM_CPU_ISA chose a lower one" : "; TANDEM_CPU_ISA=avx2 or scalar measures lower ones");
        return 0;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (!strcmp(argv[1], cmds[i].name))
            return cmds[i].run(argc - 1, argv + 1);
    fprintf(stderr, "tandem: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
