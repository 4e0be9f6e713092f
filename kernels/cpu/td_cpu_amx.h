/*
 * td_cpu_amx: the AMX tile instructions the CPU kernels use (td_cpu_pack_avx512.c's
 * quantized prefill, td_cpu_bgemm.c's bf16 matmul), written out as asm, and the tile
 * configuration LDTILECFG reads. Only on x86 (TD_CPU_X86), only at level amx
 * (td_cpu_isa.h: the process has been granted the tile state).
 *
 * Why asm: GCC 12's intrinsics tell the compiler neither that TILELOADD and LDTILECFG read
 * memory nor, for LDTILECFG, how much, so it could leave a store they read (a spread B tile,
 * the configuration) after them. Tile numbers are literal (the instructions take immediates).
 * A kernel configures its tiles and releases them (AMX_RELEASE) before it returns: a thread
 * holding tile state makes each context switch save 8 KiB more.
 */
#ifndef TD_CPU_AMX_H
#define TD_CPU_AMX_H

#include <stdint.h>

#define AMX_LOAD(tile, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tile ::"r"(base), "r"((long)(stride)) : "memory")
#define AMX_STORE(tile, base, stride) \
    __asm__ volatile("tilestored %%tmm" #tile ", (%0,%1,1)" ::"r"(base), "r"((long)(stride)) : "memory")
#define AMX_ZERO(tile) __asm__ volatile("tilezero %%tmm" #tile ::)
#define AMX_DPBSSD(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::) /* c += a(s8) b(s8) */
#define AMX_DPBSUD(c, a, b) __asm__ volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::) /* c += a(s8) b(u8) */
#define AMX_DPBF16PS(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::) /* c += a(bf16) b(bf16) */
#define AMX_CONFIGURE(cfg) __asm__ volatile("ldtilecfg (%0)" ::"r"(cfg) : "memory")
#define AMX_RELEASE() __asm__ volatile("tilerelease" ::)

/* What LDTILECFG reads (palette 1): per tile its rows and bytes a row. */
typedef struct td_cpu_amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} td_cpu_amx_config_t;
_Static_assert(sizeof(td_cpu_amx_config_t) == 64, "LDTILECFG reads 64 bytes");

#endif /* TD_CPU_AMX_H */
