/*
 * td_bench: the benchmarks behind `tandem bench <name>`. Each takes argc/argv starting
 * at its own name, accepts --json (one JSON document on stdout; keys in docs/bench.md),
 * and returns the process exit status.
 */
#ifndef TD_BENCH_H
#define TD_BENCH_H

int bench_engine(int argc, char **argv);  /* bench/bench_engine.c */
int bench_kernels(int argc, char **argv); /* bench/bench_kernels.c (CUDA kernels) */
int bench_kvxfer(int argc, char **argv);  /* bench/bench_kvxfer.c */
int bench_router(int argc, char **argv);  /* bench/bench_router.c */

#endif /* TD_BENCH_H */
