/*
 * td_util: assertions, clocks, file reads and maps, checked arithmetic, half floats.
 */
#include "td_util.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

void td_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "tandem: assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

uint64_t td_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double td_now_s(void)
{
    return (double)td_now_ns() * 1e-9;
}

td_status_t td_file_read_all(const char *path, size_t max_bytes, char **data_p, size_t *len_p)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return td_errorf(TD_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    td_status_t st = TD_OK;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 1 >= cap) {
            size_t ncap = cap ? cap * 2 : 65536;
            if (ncap > max_bytes + 1)
                ncap = max_bytes + 1;
            if (len + 1 >= ncap) {
                st = td_errorf(TD_ERR_RANGE, "%s: larger than the %zu-byte limit", path, max_bytes);
                goto err_buf;
            }
            char *nb = realloc(buf, ncap);
            if (!nb) {
                st = td_errorf(TD_ERR_NOMEM, "%s: out of memory reading file", path);
                goto err_buf;
            }
            buf = nb;
            cap = ncap;
        }
        size_t n = fread(buf + len, 1, cap - 1 - len, f);
        len += n;
        if (n == 0) {
            if (ferror(f)) {
                st = td_errorf(TD_ERR_IO, "%s: read failed: %s", path, strerror(errno));
                goto err_buf;
            }
            break;
        }
    }
    fclose(f);
    if (!buf) {
        buf = malloc(1);
        if (!buf)
            return td_errorf(TD_ERR_NOMEM, "%s: out of memory", path);
    }
    buf[len] = '\0';
    *data_p = buf;
    if (len_p)
        *len_p = len;
    return TD_OK;

err_buf:
    free(buf);
    fclose(f);
    return st;
}

td_status_t td_mmap_init(td_mmap_t *m, const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return td_errorf(TD_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return td_errorf(TD_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return td_errorf(TD_ERR_IO, "%s: not a regular file", path);
    }
    void *p = NULL;
    if (sb.st_size > 0) {
        p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            close(fd);
            return td_errorf(TD_ERR_IO, "%s: cannot map: %s", path, strerror(e));
        }
    }
    close(fd);
    m->data = p;
    m->size = (size_t)sb.st_size;
    return TD_OK;
}

void td_mmap_free(td_mmap_t *m)
{
    if (m && m->data)
        munmap(m->data, m->size);
    if (m) {
        m->data = NULL;
        m->size = 0;
    }
}

bool td_mul_size(size_t a, size_t b, size_t *out)
{
    size_t r;
    if (__builtin_mul_overflow(a, b, &r))
        return false;
    *out = r;
    return true;
}

bool td_add_size(size_t a, size_t b, size_t *out)
{
    size_t r;
    if (__builtin_add_overflow(a, b, &r))
        return false;
    *out = r;
    return true;
}

float td_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while ((mant & 0x400) == 0) {
                mant <<= 1;
                exp--;
            }
            mant &= 0x3ff;
            bits = sign | (exp << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t td_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t mant = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) /* inf / nan */
        return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31)
        return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10)
            return (uint16_t)sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)exp << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1)))
        half++; /* may carry into the exponent, which is the correct rounding */
    return (uint16_t)half;
}

float td_bf16_to_f32(uint16_t b)
{
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t td_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) /* nan: keep it a quiet nan */
        return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

td_status_t td_path_join(char *out, size_t cap, const char *dir, const char *name)
{
    int n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap)
        return td_errorf(TD_ERR_RANGE, "path too long: %s/%s", dir, name);
    return TD_OK;
}

bool td_is_dir(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

td_status_t td_mkdir_p(const char *path)
{
    char buf[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf)
        return td_errorf(TD_ERR_IO, "'%s': not a usable directory path", path);
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0')
            continue;
        char c = buf[i];
        buf[i] = '\0';
        if (mkdir(buf, 0777) != 0 && errno != EEXIST)
            return td_errorf(TD_ERR_IO, "%s: cannot create directory: %s", buf, strerror(errno));
        if (!td_is_dir(buf))
            return td_errorf(TD_ERR_IO, "%s: exists and is not a directory", buf);
        buf[i] = c;
    }
    return TD_OK;
}

bool td_is_file(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

int td_cpu_count(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

td_status_t td_mem_available(size_t *bytes_p)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f)
        return td_errorf(TD_ERR_IO, "/proc/meminfo: %s", strerror(errno));
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && fgets(line, sizeof line, f))
        found = sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
    fclose(f);
    if (!found)
        return td_errorf(TD_ERR_IO, "/proc/meminfo has no MemAvailable line (a kernel before 3.14)");
    *bytes_p = (size_t)kib << 10;
    return TD_OK;
}

const char *td_format_bytes(size_t bytes, char *buf, size_t cap)
{
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
    if (bytes < 1024) {
        snprintf(buf, cap, "%zu B", bytes);
        return buf;
    }
    double v = (double)bytes / 1024.0;
    size_t u = 0;
    while (v >= 1024.0 && u + 1 < TD_ARRAY_LEN(units)) {
        v /= 1024.0;
        u++;
    }
    snprintf(buf, cap, "%.1f %s", v, units[u]);
    return buf;
}

size_t td_utf8_bom_len(const void *data, size_t len)
{
    return len >= 3 && !memcmp(data, "\xef\xbb\xbf", 3) ? 3 : 0;
}

typedef struct populate_piece {
    pthread_t thread;
    void *p;
    size_t n;
    bool write;
    int err; /* errno, 0 on success */
} populate_piece_t;

static void *populate_run(void *arg)
{
    populate_piece_t *pc = arg;
#if defined(MADV_POPULATE_WRITE) && defined(MADV_POPULATE_READ)
    pc->err = madvise(pc->p, pc->n, pc->write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0 ? 0 : errno;
#else
    pc->err = EINVAL;
#endif
    return NULL;
}

td_status_t td_mem_populate(void *p, size_t n, int n_threads, bool write)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)(pg - 1);
    size_t len = n + ((uintptr_t)p - a);
    enum { MAX_PIECES = 16 };
    populate_piece_t pcs[MAX_PIECES];
    int k = n_threads < 1 ? 1 : n_threads > MAX_PIECES ? MAX_PIECES : n_threads;
    size_t per = (len / (size_t)k + pg - 1) / pg * pg;
    int n_pieces = 0;
    for (size_t off = 0; off < len && n_pieces < k; off += per, n_pieces++)
        pcs[n_pieces] = (populate_piece_t){.p = (void *)(a + off), .n = TD_MIN(per, len - off), .write = write};
    bool threaded[MAX_PIECES] = {false};
    for (int i = 1; i < n_pieces; i++)
        threaded[i] = pthread_create(&pcs[i].thread, NULL, populate_run, &pcs[i]) == 0;
    int err = 0;
    for (int i = 0; i < n_pieces; i++) {
        if (threaded[i])
            pthread_join(pcs[i].thread, NULL);
        else
            populate_run(&pcs[i]); /* the first piece, or one no thread could take */
        if (!err)
            err = pcs[i].err;
    }
    if (!err)
        return TD_OK;
    if (err == EINVAL)
        return td_errorf(TD_ERR_UNSUPPORTED, "this kernel cannot populate memory (MADV_POPULATE_%s)",
                         write ? "WRITE" : "READ");
    return td_errorf(TD_ERR_NOMEM, "cannot make %zu MiB resident: %s", n >> 20, strerror(err));
}

void td_memcpy_stream(void *dst, const void *src, size_t n)
{
#if defined(__SSE2__)
    char *d = dst;
    const char *sp = src;
    size_t head = TD_MIN(n, (16 - ((uintptr_t)d & 15)) & 15); /* streaming stores want 16-byte alignment */
    memcpy(d, sp, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(sp + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(sp + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(sp + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(sp + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, sp + i, n - i);
    _mm_sfence(); /* streaming stores are weakly ordered */
#else
    memcpy(dst, src, n);
#endif
}

td_status_t td_parse_i64(const char *s, int64_t min, int64_t max, const char *what, int64_t *out)
{
    char *end = NULL;
    errno = 0;
    long long v = s ? strtoll(s, &end, 10) : 0;
    if (!s || !*s || *end != '\0' || errno == ERANGE)
        return td_errorf(TD_ERR_INVALID, "%s: '%s' is not an integer", what, s ? s : "");
    if (v < min || v > max)
        return td_errorf(TD_ERR_INVALID, "%s: %lld is out of range [%lld, %lld]", what, v,
                         (long long)min, (long long)max);
    *out = v;
    return TD_OK;
}

td_status_t td_parse_f32(const char *s, float min, float max, const char *what, float *out)
{
    char *end = NULL;
    errno = 0;
    float v = s ? strtof(s, &end) : 0.0f;
    if (!s || !*s || *end != '\0' || errno == ERANGE || v != v)
        return td_errorf(TD_ERR_INVALID, "%s: '%s' is not a number", what, s ? s : "");
    if (v < min || v > max)
        return td_errorf(TD_ERR_INVALID, "%s: %g is out of range [%g, %g]", what, (double)v,
                         (double)min, (double)max);
    *out = v;
    return TD_OK;
}

long td_fd_limit_raise(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return -1;
    rlim_t want = rl.rlim_max == RLIM_INFINITY ? (rlim_t)1 << 20 : TD_MIN(rl.rlim_max, (rlim_t)1 << 20);
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
        struct rlimit up = {.rlim_cur = want, .rlim_max = rl.rlim_max};
        if (setrlimit(RLIMIT_NOFILE, &up) == 0)
            rl.rlim_cur = want;
    }
    return rl.rlim_cur == RLIM_INFINITY ? 1L << 20 : (long)TD_MIN(rl.rlim_cur, (rlim_t)1 << 20);
}

int td_hex_digit(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}
