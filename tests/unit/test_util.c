/*
 * test_util: td_util's helpers that no other suite covers on their own: the streaming copy
 * (td_memcpy_stream) against memcpy for every alignment of both ends and sizes around its
 * 16- and 64-byte steps, the bytes around the destination left untouched; td_mkdir_p;
 * td_log escaping control characters.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "td_log.h"
#include "td_rate.h"
#include "td_util.h"

Test(util, memcpy_stream_equals_memcpy_at_every_alignment)
{
    static const size_t sizes[] = {0, 1, 7, 15, 16, 17, 63, 64, 65, 127, 128, 1000, 4095, 65536 + 13};
    size_t cap = 65536 + 64 + 64;
    uint8_t *src = malloc(cap), *dst = malloc(cap), *want = malloc(cap);
    cr_assert(src && dst && want);
    uint32_t r = 12345;
    for (size_t i = 0; i < cap; i++) {
        r = r * 1103515245u + 12345u;
        src[i] = (uint8_t)(r >> 16);
    }
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
        for (size_t so = 0; so < 16; so++)
            for (size_t doff = 0; doff < 16; doff++) {
                size_t n = sizes[si];
                memset(dst, 0xa5, cap);
                memset(want, 0xa5, cap);
                memcpy(want + doff, src + so, n);
                td_memcpy_stream(dst + doff, src + so, n);
                cr_assert(memcmp(dst, want, cap) == 0, "size %zu src offset %zu dst offset %zu differs", n, so,
                          doff);
            }
    free(src);
    free(dst);
    free(want);
}

Test(util, mkdir_p_makes_missing_parents_once)
{
    char root[] = "/tmp/td_mkdir_XXXXXX", path[256], file[256];
    cr_assert_not_null(mkdtemp(root));
    snprintf(path, sizeof path, "%s/a/b/c", root);
    cr_assert_eq(td_mkdir_p(path), TD_OK, "%s", td_last_error());
    cr_assert(td_is_dir(path));
    cr_assert_eq(td_mkdir_p(path), TD_OK, "an existing directory is fine");
    snprintf(file, sizeof file, "%s/a/f", root);
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fclose(f);
    snprintf(path, sizeof path, "%s/a/f/g", root);
    cr_assert_eq(td_mkdir_p(path), TD_ERR_IO, "a file in the way is an error");
    cr_assert(strstr(td_last_error(), "/a/f"), "the message names the part in the way: %s", td_last_error());
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    cr_assert_eq(system(cmd), 0);
}

/* Pages resident in [p, p + n), by mincore. */
static size_t resident_pages(void *p, size_t n)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE), np = (n + pg - 1) / pg, r = 0;
    unsigned char *v = malloc(np);
    cr_assert_not_null(v);
    cr_assert_eq(mincore(p, n, v), 0);
    for (size_t i = 0; i < np; i++)
        r += v[i] & 1;
    free(v);
    return r;
}

/* A KV pool is made resident at startup by several threads on disjoint pieces: every page
 * of the range (an unaligned start and an odd length included) ends up resident, none of
 * its contents change, and pages outside it stay untouched. */
Test(util, mem_populate_makes_every_page_resident)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE), n = 64 * pg + 123;
    char *m = mmap(NULL, n + 2 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(m, MAP_FAILED);
    char *p = m + pg + 7; /* unaligned start, one guard page before */
    p[0] = 42;            /* one page already resident with data */
    cr_assert_lt(resident_pages(m, n + 2 * pg), 4);
    for (int threads = 1; threads <= 5; threads += 4) {
        td_status_t st = td_mem_populate(p, n, threads, true);
        if (st == TD_ERR_UNSUPPORTED)
            cr_skip_test("this kernel has no MADV_POPULATE_WRITE");
        cr_assert_eq(st, TD_OK, "%s", td_last_error());
        cr_assert_eq(resident_pages(m + pg, n + 7), (n + 7 + pg - 1) / pg, "every page of the range");
        cr_assert_eq(resident_pages(m, pg), 0, "the page before it untouched");
        cr_assert_eq(p[0], 42, "contents unchanged");
    }
    munmap(m, n + 2 * pg);
}

/* A client's bytes in a log message (a request id with a newline and an escape sequence)
 * stay one line: control characters are written as \xNN (issue 35). */
Test(util, log_escapes_control_characters)
{
    char path[] = "/tmp/td_log_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    fflush(stderr);
    int saved = dup(2);
    cr_assert_geq(dup2(fd, 2), 0);
    td_log_level_t old = td_log_get_level();
    td_log_set_level(TD_LOG_WARN);
    td_warn("request %s: lost", "id\ntandem: error: forged\x1b[2J\x7f");
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    td_log_set_level(old);
    char buf[512] = {0};
    cr_assert_gt(pread(fd, buf, sizeof buf - 1, 0), 0);
    close(fd);
    unlink(path);
    cr_assert_str_eq(buf, "tandem: warn: request id\\x0atandem: error: forged\\x1b[2J\\x7f: lost\n");
}

/* td_fd_limit_raise takes the soft open-file limit up to the hard one (capped at 2^20), as
 * servers do at start: with the common soft 1024, ~1000 idle clients took every descriptor
 * of the router (issue 35). */
Test(util, fd_limit_raise_goes_to_the_hard_limit)
{
    struct rlimit rl;
    cr_assert_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
    rlim_t hard = rl.rlim_max;
    if (hard != RLIM_INFINITY && hard < 300)
        cr_skip_test("hard open-file limit %llu: nothing to raise", (unsigned long long)hard);
    struct rlimit low = {.rlim_cur = 256, .rlim_max = hard};
    cr_assert_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
    long got = td_fd_limit_raise();
    long want = hard == RLIM_INFINITY || hard > ((rlim_t)1 << 20) ? 1L << 20 : (long)hard;
    cr_assert_eq(got, want, "raised to %ld, want %ld", got, want);
    cr_assert_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
    cr_assert_eq((long)rl.rlim_cur, want);
    cr_assert_eq(td_fd_limit_raise(), want, "a second call changes nothing");
}

/* td_rate: a full bucket of burst tokens, refilled at rate a second; a refusal says when the
 * next token comes, and the time passed before it is counted, not lost. */
Test(util, rate_bucket_takes_burst_then_rate)
{
    td_rate_t b = {0};
    int64_t wait = 0, t = 1000000000;
    for (int i = 0; i < 3; i++)
        cr_assert(td_rate_take(&b, 2.0, 3.0, t, &wait), "a burst of 3 at once");
    cr_assert_not(td_rate_take(&b, 2.0, 3.0, t, &wait));
    cr_assert_eq(wait, 500, "2 a second: the next in 500 ms, not %lld", (long long)wait);
    cr_assert_not(td_rate_take(&b, 2.0, 3.0, t + 499000000, &wait));
    cr_assert_eq(wait, 1);
    cr_assert(td_rate_take(&b, 2.0, 3.0, t + 500000000, &wait));
    cr_assert(td_rate_take(&b, 2.0, 3.0, t + 10 * 1000000000ll, &wait));
    cr_assert(td_rate_take(&b, 2.0, 3.0, t + 10 * 1000000000ll, &wait));
    cr_assert(td_rate_take(&b, 2.0, 3.0, t + 10 * 1000000000ll, &wait), "refilled to the burst, no more");
    cr_assert_not(td_rate_take(&b, 2.0, 3.0, t + 10 * 1000000000ll, &wait));
    cr_assert_not(td_rate_take(&b, 2.0, 3.0, t + 5 * 1000000000ll, &wait), "time going back gives nothing");
    td_rate_t slow = {0};
    cr_assert(td_rate_take(&slow, 0.1, 1.0, t, &wait));
    cr_assert_not(td_rate_take(&slow, 0.1, 1.0, t, &wait));
    cr_assert_eq(wait, 10000, "0.1 a second: 10 s");
}
