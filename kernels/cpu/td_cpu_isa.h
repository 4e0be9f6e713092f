/*
 * td_cpu_isa: the one list of x86 vector extensions the CPU kernels are written for, and
 * which of them this CPU runs. Every SIMD kernel is compiled with a target attribute, so
 * one binary (a -DTD_NATIVE=OFF build included) carries every path; the CPU backend picks
 * one level when it is created (td_cpu_kernels_fill) and every op then runs that level's
 * kernels. Levels are ordered: each one's CPUs run every lower one's kernels too.
 */
#ifndef TD_CPU_ISA_H
#define TD_CPU_ISA_H

#include <stdbool.h>

#include "td_status.h"

#if defined(__x86_64__) || defined(__i386__)
#define TD_CPU_X86 1
/* what every AVX2 kernel is compiled for (TD_CPU_ISA_AVX2), and its inlined helpers */
#define TD_CPU_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TD_CPU_AVX2_INLINE TD_CPU_AVX2 static inline __attribute__((always_inline))
/* Keeps a vector in its register where it stands: GCC otherwise reassociates a chain of adds
 * into a tree, holds every product at once and spills (td_cpu_pack's w16_tile: a third of the
 * speed), or folds a load into each use as a memory operand (the avx2 float matmul's X) */
#define AVX2_KEEP(x) __asm__("" : "+x"(x))
#else
#define TD_CPU_X86 0
#endif

typedef enum td_cpu_isa {
    TD_CPU_ISA_SCALAR,      /* plain C: the reference, and any CPU */
    TD_CPU_ISA_AVX2,        /* AVX2, FMA and F16C */
    TD_CPU_ISA_AVX512,      /* the above and AVX-512 F, BW and VL */
    TD_CPU_ISA_AVX512_VNNI, /* the above and AVX-512 VNNI */
    TD_CPU_ISA_AVX512_BF16, /* the above and AVX512_BF16 (cpu:q8's float matmul: td_cpu_bgemm) */
    TD_CPU_ISA_AMX,         /* the above and AMX-TILE, AMX-INT8 and AMX-BF16, enabled by the OS
                               for this process (the packed quantized prefill on tiles:
                               td_cpu_pack_avx512.c; cpu:q8's float matmul: td_cpu_bgemm.c) */
    TD_CPU_ISA_COUNT,
} td_cpu_isa_t;

/* True when this CPU runs `isa`'s kernels (always for TD_CPU_ISA_SCALAR). Cheap after the
 * first call: CPUID is read once (in a virtual machine it traps to the hypervisor). */
bool td_cpu_isa_runs(td_cpu_isa_t isa);

/* The highest level this CPU runs. */
td_cpu_isa_t td_cpu_isa_best(void);

/* "scalar", "avx2", "avx512", "avx512vnni", "avx512bf16", "amx" (what TANDEM_CPU_ISA and
 * --version spell). */
const char *td_cpu_isa_name(td_cpu_isa_t isa);

/*
 * The level the CPU backend runs for `want`: a level's name (above), or NULL or "" for the
 * environment's TANDEM_CPU_ISA, and when that is unset or empty the best this CPU runs.
 * Errors (logged, *isa_p untouched): TD_ERR_INVALID for a name that is no level, or a level
 * above what this CPU runs (the message lists the ones it does).
 */
td_status_t td_cpu_isa_choose(const char *want, td_cpu_isa_t *isa_p);

#endif /* TD_CPU_ISA_H */
