/*
 * td_cpu_isa: the x86 vector extensions the CPU kernels choose between at run time. Their
 * SIMD code is compiled with target attributes, so one binary carries every path and
 * picks by what this CPU has (__builtin_cpu_supports); on other architectures nothing.
 */
#ifndef TD_CPU_ISA_H
#define TD_CPU_ISA_H

#include <stdatomic.h>
#include <stdbool.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

typedef enum td_cpu_isa {
    TD_CPU_ISA_AVX2,        /* AVX2, FMA and F16C */
    TD_CPU_ISA_AVX512,      /* the above and AVX-512 F, BW and VL */
    TD_CPU_ISA_AVX512_VNNI, /* the above and AVX-512 VNNI */
} td_cpu_isa_t;

static inline bool td_cpu_has(td_cpu_isa_t isa)
{
#if defined(__x86_64__) || defined(__i386__)
    /* F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports has no "f16c".
     * Read once: the kernels ask on every call, and in a virtual machine CPUID traps to the
     * hypervisor (asked each time it cost SmolLM2's 2-thread decode a fifth of its speed). */
    static _Atomic int f16c_known = -1;
    int known = atomic_load_explicit(&f16c_known, memory_order_relaxed);
    if (known < 0) {
        unsigned a, b, c, d;
        known = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
        atomic_store_explicit(&f16c_known, known, memory_order_relaxed);
    }
    bool f16c = known == 1;
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl");
    switch (isa) {
    case TD_CPU_ISA_AVX2: return avx2;
    case TD_CPU_ISA_AVX512: return avx512;
    case TD_CPU_ISA_AVX512_VNNI: return avx512 && __builtin_cpu_supports("avx512vnni");
    }
#else
    (void)isa;
#endif
    return false;
}

#endif /* TD_CPU_ISA_H */
