/*
 * bench: `tandem bench <name>` dispatches to one benchmark.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_bench.h"
#include "td_cli.h"

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *help;
} benches[] = {
    {"engine", bench_engine, "CPU engine: batch-1 decode vs memory bandwidth, prefill vs sgemm, batched decode"},
    {"kernels", bench_kernels, "CUDA kernels vs copy bandwidth and cuBLAS (needs a GPU)"},
    {"kvxfer", bench_kvxfer, "KV transfer over UCX vs ucx_perftest"},
    {"router", bench_router, "router overhead and token relay with no-op nodes (one core)"},
    {"http-server", bench_http_server, "the HTTP/1.1 server alone: tiny answers/s, latency, SSE events/s"},
    {"grammar", bench_grammar, "constrained decoding: grammar compile time and token-mask time per token"},
    {"serve", bench_serve, "a running cluster under load: TTFT/TPOT/ITL/E2EL, throughput, goodput (vLLM's)"},
};

int cmd_bench(int argc, char **argv)
{
    if (argc >= 2) {
        for (size_t i = 0; i < sizeof benches / sizeof benches[0]; i++)
            if (!strcmp(argv[1], benches[i].name))
                return benches[i].run(argc - 1, argv + 1);
    }
    FILE *f = argc >= 2 && strcmp(argv[1], "--help") ? stderr : stdout;
    if (argc >= 2 && f == stderr)
        fprintf(f, "tandem bench: unknown benchmark '%s'\n\n", argv[1]);
    fprintf(f, "usage: tandem bench <name> [--json] [options]\n\nbenchmarks:\n");
    for (size_t i = 0; i < sizeof benches / sizeof benches[0]; i++)
        fprintf(f, "  %-11s %s\n", benches[i].name, benches[i].help);
    fprintf(f, "\n'tandem bench <name> --help' lists each one's options; figures are ratios to a\n"
               "ceiling measured in the same run (docs/bench.md).\n");
    return f == stdout ? 0 : 2;
}

void bench_json_number(cJSON *obj, const char *key, double v, int decimals)
{
    double scale = pow(10.0, decimals);
    cJSON_AddNumberToObject(obj, key, isfinite(v) ? round(v * scale) / scale : v);
}

int bench_json_print(FILE *f, cJSON *obj)
{
    char *text = obj ? cJSON_PrintUnformatted(obj) : NULL;
    cJSON_Delete(obj);
    if (!text) {
        fprintf(stderr, "tandem bench: out of memory writing the JSON output\n");
        return 1;
    }
    fprintf(f, "%s\n", text);
    cJSON_free(text);
    return 0;
}
