/*
 * fuzz_util.h: what every libFuzzer harness of tests/fuzz shares (issue 17: every parser
 * of outside bytes under -fsanitize=fuzzer,address,undefined). A harness is one
 * LLVMFuzzerTestOneInput over one parser; tests/fuzz/README.md lists them, their seeds and
 * how to run them.
 */
#ifndef FUZZ_UTIL_H
#define FUZZ_UTIL_H

#include <dirent.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_log.h"

/* Once per process: logging off (a parser's error is the expected outcome, and a line per
 * input would be most of the time spent), and a private folder for the files the file
 * parsers read (they take paths). */
static char fuzz_dir_path[64];

/* At exit (a run that ends, not a crash: its inputs stay for the report): the folder and
 * the files fuzz_file wrote there. */
static inline void fuzz_dir_remove(void)
{
    DIR *d = opendir(fuzz_dir_path);
    struct dirent *e;
    char path[sizeof fuzz_dir_path + 256];
    while (d && (e = readdir(d))) {
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(path, sizeof path, "%s/%s", fuzz_dir_path, e->d_name);
            unlink(path);
        }
    }
    if (d)
        closedir(d);
    rmdir(fuzz_dir_path);
}

static inline const char *fuzz_dir(void)
{
    if (!fuzz_dir_path[0]) {
        td_log_set_level(TD_LOG_OFF);
        snprintf(fuzz_dir_path, sizeof fuzz_dir_path, "/tmp/tandem-fuzz-XXXXXX");
        if (!mkdtemp(fuzz_dir_path)) {
            perror("fuzz: mkdtemp");
            abort();
        }
        atexit(fuzz_dir_remove);
    }
    return fuzz_dir_path;
}

/* data[0..size) as the file `name` of fuzz_dir(); its path (static storage, one per name
 * slot: callers use distinct names for files that must coexist). */
static inline const char *fuzz_file(const char *name, const uint8_t *data, size_t size, char *path, size_t cap)
{
    snprintf(path, cap, "%s/%s", fuzz_dir(), name);
    FILE *f = fopen(path, "wb");
    if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f) != 0) {
        perror(path);
        abort();
    }
    return path;
}

/* A NUL-terminated copy of data[0..size) (the parsers of text take C strings). */
static inline char *fuzz_cstr(const uint8_t *data, size_t size)
{
    char *s = malloc(size + 1);
    if (!s)
        abort();
    memcpy(s, data, size);
    s[size] = '\0';
    return s;
}

#endif /* FUZZ_UTIL_H */
