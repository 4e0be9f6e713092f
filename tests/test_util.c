/*
 * test_util: td_util's helpers that no other suite covers on their own: the streaming copy
 * (td_memcpy_stream) against memcpy for every alignment of both ends and sizes around its
 * 16- and 64-byte steps, the bytes around the destination left untouched.
 */
#include <criterion/criterion.h>
#include <stdint.h>
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
