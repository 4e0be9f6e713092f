/*
 * td_cpu_isa: which kernel level this CPU runs, read once, and the choice a CPU backend
 * makes from a name or TANDEM_CPU_ISA (td_cpu_isa.h).
 */
#include "td_cpu_isa.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* Whether this process may run AMX tile instructions: the CPU has AMX-TILE, AMX-INT8 and
 * AMX-BF16 (CPUID leaf 7 EDX bits 24, 25 and 22: every CPU with the first has all three), the OS saves the tile state (XCR0 bits 17 and 18) and
 * Linux grants the process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, which every
 * process must ask for before its first tile instruction; a VM or kernel that refuses it
 * leaves the level below). Asked once, for the whole process, by isa_detect. */
static bool amx_usable(void)
{
#if defined(__linux__) && defined(__x86_64__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)) ||
        !(d & (1u << 22)))
        return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) /* OSXSAVE: xgetbv runs */
        return false;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17))
        return false;
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
}

static const char *const isa_names[TD_CPU_ISA_COUNT] = {
    [TD_CPU_ISA_SCALAR] = "scalar",
    [TD_CPU_ISA_AVX2] = "avx2",
    [TD_CPU_ISA_AVX512] = "avx512",
    [TD_CPU_ISA_AVX512_VNNI] = "avx512vnni",
    [TD_CPU_ISA_AVX512_BF16] = "avx512bf16",
    [TD_CPU_ISA_AMX] = "amx",
};

/* The best level, found from CPUID on the first call. A race only computes it twice. */
static td_cpu_isa_t isa_detect(void)
{
    td_cpu_isa_t best = TD_CPU_ISA_SCALAR;
#if defined(__x86_64__) || defined(__i386__)
    /* F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports has no "f16c" */
    unsigned a, b, c, d;
    bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
    if (!(f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return best;
    best = TD_CPU_ISA_AVX2;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl")))
        return best;
    best = TD_CPU_ISA_AVX512;
    if (!__builtin_cpu_supports("avx512vnni"))
        return best;
    best = TD_CPU_ISA_AVX512_VNNI;
    /* AVX512_BF16 from CPUID leaf 7 sub-leaf 1 (EAX bit 5): older compilers' builtin lacks it */
    if (!(__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5))))
        return best;
    best = TD_CPU_ISA_AVX512_BF16;
    if (amx_usable())
        best = TD_CPU_ISA_AMX;
#endif
    return best;
}

td_cpu_isa_t td_cpu_isa_best(void)
{
    static _Atomic int known = -1;
    int v = atomic_load_explicit(&known, memory_order_relaxed);
    if (v < 0) {
        v = (int)isa_detect();
        atomic_store_explicit(&known, v, memory_order_relaxed);
    }
    return (td_cpu_isa_t)v;
}

bool td_cpu_isa_runs(td_cpu_isa_t isa)
{
    return isa >= TD_CPU_ISA_SCALAR && isa <= td_cpu_isa_best();
}

const char *td_cpu_isa_name(td_cpu_isa_t isa)
{
    return isa >= 0 && isa < TD_CPU_ISA_COUNT ? isa_names[isa] : "?";
}

td_status_t td_cpu_isa_choose(const char *want, td_cpu_isa_t *isa_p)
{
    const char *from = "the CPU backend's isa";
    if (!want || !*want) {
        want = getenv("TANDEM_CPU_ISA");
        from = "TANDEM_CPU_ISA";
    }
    td_cpu_isa_t best = td_cpu_isa_best();
    if (!want || !*want) {
        *isa_p = best;
        return TD_OK;
    }
    char runs[96] = "";
    for (int i = 0; i <= (int)best; i++)
        snprintf(runs + strlen(runs), sizeof runs - strlen(runs), "%s%s", i ? ", " : "",
                 isa_names[i]);
    for (int i = 0; i < TD_CPU_ISA_COUNT; i++) {
        if (strcmp(want, isa_names[i]))
            continue;
        if (i > (int)best)
            return td_errorf(TD_ERR_INVALID, "%s=%s: this CPU does not run %s kernels; it runs %s",
                             from, want, want, runs);
        *isa_p = (td_cpu_isa_t)i;
        return TD_OK;
    }
    return td_errorf(TD_ERR_INVALID, "%s=%s is not a kernel level: use one of scalar, avx2, avx512, "
                     "avx512vnni, avx512bf16, amx (this CPU runs %s)", from, want, runs);
}
