/*
 * test_util: td_util's helpers that no other suite covers on their own: the streaming copy
 * (td_memcpy_stream) against memcpy for every alignment of both ends and sizes around its
 * 16- and 64-byte steps, the bytes around the destination left untouched; td_mkdir_p.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
