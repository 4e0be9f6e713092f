/*
 * td_bench: the benchmarks behind `tandem bench <name>`. Each takes argc/argv starting
 * at its own name, accepts --json (one JSON document on stdout; keys in docs/bench.md),
 * and returns the process exit status.
 */
#ifndef TD_BENCH_H
#define TD_BENCH_H

#include <cjson/cJSON.h>
#include <stdio.h>

#include "td_backend.h"

int bench_engine(int argc, char **argv);  /* bench/bench_engine.c */
int bench_kernels(int argc, char **argv); /* bench/bench_kernels.c (CUDA kernels) */
int bench_kvxfer(int argc, char **argv);  /* bench/bench_kvxfer.c */
int bench_router(int argc, char **argv);  /* bench/bench_router.c */
int bench_http_server(int argc, char **argv); /* bench/bench_http_server.c */
int bench_grammar(int argc, char **argv); /* bench/bench_grammar.c: token masks of td_gram */
int bench_serve(int argc, char **argv);   /* bench/bench_serve.c: load against a running cluster */

/* Device ceilings through the backend interface (bench/bench_kernels.c), medians of 5 rounds
 * of `iters` calls after warm-up: bytes read + written per second by a device-to-device
 * copy of `bytes`, and FLOP/s of the backend's matmul at m x n x k (weights w_dtype,
 * activations the backend's) on random inputs. */
td_status_t bench_copy_bandwidth(td_backend_t *be, size_t bytes, int iters, double *bytes_per_s);
td_status_t bench_matmul_flops(td_backend_t *be, int32_t m, int32_t n, int32_t k, td_dtype_t w_dtype,
                               int iters, double *flops_p);

/* --json output (bench/bench.c): adds key: v rounded to `decimals` places (the precision
 * the text output shows) to obj; prints obj on one line to f, frees it and returns 0, or
 * returns 1 (with the reason on stderr) when it could not be built. A NULL obj (an
 * allocation that failed on the way) is that failure. */
void bench_json_number(cJSON *obj, const char *key, double v, int decimals);
int bench_json_print(FILE *f, cJSON *obj);

#endif /* TD_BENCH_H */
