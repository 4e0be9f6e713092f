/*
 * fuzz_conf: command lines and --config files as every process reads them
 * (td_node_conf_parse over td_opts: the common keys of a node or the router, then keys of
 * each type the processes use). The input up to its first NUL byte is the config file;
 * the rest, split at NUL bytes, is argv (at most 32 arguments), with `--config FILE`
 * appended when the first byte of the file part is odd. The first byte also picks node or
 * router keys.
 * Seeds: tests/fuzz/corpus/conf (the deploy/ config examples' shape and typical flags).
 */
#include "fuzz_util.h"
#include "td_node_conf.h"
#include "td_opts.h"

static td_status_t parse_csv(const td_opt_t *opt, const char *value)
{
    (void)opt;
    return strlen(value) > 16 ? TD_ERR_INVALID : TD_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_dir(); /* logging off */
    if (size < 1)
        return 0;
    const uint8_t *nul = memchr(data, 0, size);
    size_t file_len = nul ? (size_t)(nul - data) : size;
    char cfg_path[256];
    fuzz_file("node.conf", data, file_len, cfg_path, sizeof cfg_path);
    char *args = fuzz_cstr(nul ? nul + 1 : data + size, nul ? size - file_len - 1 : 0);
    size_t args_len = nul ? size - file_len - 1 : 0;
    char *argv[36];
    int argc = 0;
    argv[argc++] = "fuzz";
    for (size_t i = 0; i <= args_len && argc < 33; ) {
        argv[argc++] = args + i;
        i += strlen(args + i) + 1;
    }
    if (data[0] % 2) {
        argv[argc++] = "--config";
        argv[argc++] = cfg_path;
    }
    argv[argc] = NULL;
    int64_t max_batch = 0, port = 0;
    float temp = 0;
    bool flag = false;
    const char *name = NULL;
    const td_opt_t keys[] = {
        TD_OPT_INT("max-batch", &max_batch, 1, 4096, "a bounded integer"),
        TD_OPT_INT("peer-port", &port, 0, 65535, "a port"),
        {.name = "temperature", .type = TD_OPT_F32, .ptr = &temp, .fmin = 0, .fmax = 2, .help = "a float"},
        {.name = "drain", .type = TD_OPT_BOOL, .ptr = &flag, .help = "a bool"},
        TD_OPT_STRING("label", &name, "a string"),
        {.name = "list", .type = TD_OPT_FN, .parse = parse_csv, .help = "a parsed value"},
    };
    td_node_config_t c = {0};
    td_opts_result_t r = {0};
    int given[6 + 64] = {0};
    (void)given;
    FILE *saved = stdout; /* --help prints the usage: keep it out of the fuzzer's output */
    stdout = fopen("/dev/null", "w");
    (void)td_node_conf_parse("fuzz", &c, size > 1 && data[1] % 2, keys, (int)(sizeof keys / sizeof keys[0]), argc,
                             argv, &r);
    fclose(stdout);
    stdout = saved;
    td_opts_result_free(&r);
    free(args);
    return 0;
}
