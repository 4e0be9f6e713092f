/*
 * td_util: the small things every module needs: invariant assertions, monotonic time,
 * whole-file reads, read-only memory maps, checked size arithmetic, half-precision
 * conversion. Nothing here allocates behind the caller's back except where documented.
 */
#ifndef TD_UTIL_H
#define TD_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

/* Invariant check, always on. Only for programming errors, never for bad input. */
#define TD_ASSERT(cond)                                                    \
    do {                                                                   \
        if (!(cond))                                                       \
            td_assert_fail(#cond, __FILE__, __LINE__);                     \
    } while (0)

_Noreturn void td_assert_fail(const char *expr, const char *file, int line);

#define TD_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define TD_MIN(a, b) ((a) < (b) ? (a) : (b))
#define TD_MAX(a, b) ((a) > (b) ? (a) : (b))
#define TD_DIV_CEIL(a, b) (((a) + (b)-1) / (b))

/* Monotonic clock in nanoseconds / seconds. */
uint64_t td_now_ns(void);
double td_now_s(void);

/*
 * Reads a whole file into a NUL-terminated heap buffer (*data_p, caller frees with free()).
 * Refuses files larger than max_bytes. Errors: TD_ERR_IO (with the path and errno text),
 * TD_ERR_RANGE (too large), TD_ERR_NOMEM.
 */
td_status_t td_file_read_all(const char *path, size_t max_bytes, char **data_p, size_t *len_p);

/* A read-only memory map of a whole file. */
typedef struct td_mmap {
    void *data;  /* NULL for an empty file */
    size_t size;
} td_mmap_t;

/* Maps `path` read-only. Errors: TD_ERR_IO naming the path. Release with td_mmap_free. */
td_status_t td_mmap_init(td_mmap_t *m, const char *path);
void td_mmap_free(td_mmap_t *m);

/* a*b and a+b with overflow detection: false on overflow, *out untouched. */
bool td_mul_size(size_t a, size_t b, size_t *out);
bool td_add_size(size_t a, size_t b, size_t *out);

/* IEEE half and bfloat16 <-> float. bf16 rounding is round-to-nearest-even. */
float td_f16_to_f32(uint16_t h);
uint16_t td_f32_to_f16(float f);
float td_bf16_to_f32(uint16_t b);
uint16_t td_f32_to_bf16(float f);

/* Path join into a caller buffer; returns TD_ERR_RANGE if it does not fit. */
td_status_t td_path_join(char *out, size_t cap, const char *dir, const char *name);

/* True if `path` names an existing directory / regular file. */
bool td_is_dir(const char *path);
/* Creates a directory and any missing parents (mkdir -p). Errors: TD_ERR_IO naming the
 * part that could not be made, or that exists and is not a directory. */
td_status_t td_mkdir_p(const char *path);
bool td_is_file(const char *path);

/* Bytes of a UTF-8 byte-order mark at the start of data[0..len): 3 or 0. A mark carries no
 * content (Windows editors write one), so every JSON reader skips it. */
size_t td_utf8_bom_len(const void *data, size_t len);

/* CPUs this process may run on (its sched_getaffinity mask, so a taskset or a container's
 * cpuset counts, not the machine's online CPUs), at least 1. */
int td_cpu_count(void);

/* Host memory available now for new allocations without swapping (MemAvailable of
 * /proc/meminfo: free memory plus the reclaimable page cache), in bytes. Errors: TD_ERR_IO
 * where /proc/meminfo cannot be read or has no MemAvailable (kernels before 3.14). */
td_status_t td_mem_available(size_t *bytes_p);

/* bytes as "3.0 GiB" / "80.0 MiB" / "512 KiB" / "100 B" into buf[0..cap); returns buf. */
const char *td_format_bytes(size_t bytes, char *buf, size_t cap);

/* dst = src (no overlap) with non-temporal stores where the CPU has them (SSE2): the
 * destination bypasses this core's caches, for a big copy whose reader is someone else (a
 * peer process, a device DMA). The stores are globally visible on return (fenced). Without
 * SSE2 it is memcpy. */
void td_memcpy_stream(void *dst, const void *src, size_t n);

/* Makes every page of [p, p + n) resident now, writable (write: MADV_POPULATE_WRITE) or
 * readable (MADV_POPULATE_READ, for a read-only file mapping: a model's weights), so that
 * nobody pays its page faults later (a KV pool or weights at startup, before a node
 * registers), with n_threads threads on disjoint pieces (page zeroing and reads scale with
 * cores; 1: this thread). Contents are unchanged. Errors: TD_ERR_NOMEM (the memory cannot
 * be had: message names the size), TD_ERR_UNSUPPORTED (a kernel before 5.14: the caller
 * may touch the pages itself where the range cannot vanish under it). Any thread. */
td_status_t td_mem_populate(void *p, size_t n, int n_threads, bool write);

/* Raises this process's soft limit of open files to its hard limit (at most 1 << 20), as
 * nginx (worker_rlimit_nofile) and Redis do at start: a server's connection caps assume it
 * (the common soft default, 1024, let ~1000 idle clients take every descriptor). Returns
 * the soft limit in force afterwards (the old one where it cannot be raised), or -1 when
 * it cannot be read. Call at start, before threads. */
long td_fd_limit_raise(void);


/* Strict number parsing for flags and config: the whole string must be a number within
 * [min, max]. Errors: TD_ERR_INVALID with a message naming `what`. */
/* The value of one hex digit (either case), or -1 when c is not one. */
int td_hex_digit(int c);

td_status_t td_parse_i64(const char *s, int64_t min, int64_t max, const char *what, int64_t *out);
td_status_t td_parse_f32(const char *s, float min, float max, const char *what, float *out);

#endif /* TD_UTIL_H */
