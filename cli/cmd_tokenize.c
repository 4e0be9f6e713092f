/*
 * tandem tokenize: encode stdin to token ids, or decode ids to text, with any tokenizer
 * td_tok loads. The output is meant for scripts and for comparing with reference
 * tokenizers: ids without BOS/EOS on one line (with --add-special, BOS/EOS where the
 * tokenizer's model adds them, as llama.cpp's llama-tokenize does by default); decoded text
 * exactly, no newline added.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_cli.h"
#include "td_tokenizer.h"
#include "td_util.h"

/* Reads stdin to EOF into a malloc'd buffer (NUL-terminated). */
static int read_stdin(char **buf_p, size_t *len_p)
{
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    if (!buf)
        goto nomem;
    for (;;) {
        if (cap - len < 4096) {
            char *b = realloc(buf, cap * 2);
            if (!b)
                goto nomem;
            buf = b;
            cap *= 2;
        }
        size_t n = fread(buf + len, 1, cap - len - 1, stdin);
        len += n;
        if (n == 0) {
            if (ferror(stdin)) {
                fprintf(stderr, "tandem tokenize: error reading stdin\n");
                free(buf);
                return 1;
            }
            break;
        }
    }
    buf[len] = 0;
    *buf_p = buf;
    *len_p = len;
    return 0;
nomem:
    free(buf);
    fprintf(stderr, "tandem tokenize: out of memory reading stdin\n");
    return 1;
}

static int do_encode(const td_tokenizer_t *tok, const char *text, size_t len, unsigned flags)
{
    int32_t *ids;
    size_t n;
    if (td_tokenizer_encode(tok, text, len, flags, &ids, &n) != TD_OK)
        return 1; /* td_errorf has said why */
    for (size_t i = 0; i < n; i++)
        printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
    free(ids);
    return 0;
}

static int do_decode(const td_tokenizer_t *tok, char *text)
{
    size_t cap = 1024, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    int rc = 1;
    char *out = NULL;
    size_t out_len;
    if (!ids) {
        fprintf(stderr, "tandem tokenize: out of memory\n");
        return 1;
    }
    for (char *w = strtok(text, " \t\r\n\v\f"); w; w = strtok(NULL, " \t\r\n\v\f")) {
        int64_t v;
        if (td_parse_i64(w, 0, td_tokenizer_vocab_size(tok) - 1, "token id", &v) != TD_OK)
            goto out;
        if (n == cap) {
            int32_t *b = realloc(ids, cap * 2 * sizeof *ids);
            if (!b) {
                fprintf(stderr, "tandem tokenize: out of memory\n");
                goto out;
            }
            ids = b;
            cap *= 2;
        }
        ids[n++] = (int32_t)v;
    }
    if (td_tokenizer_decode(tok, ids, n, &out, &out_len) != TD_OK)
        goto out;
    if (fwrite(out, 1, out_len, stdout) != out_len) {
        fprintf(stderr, "tandem tokenize: error writing stdout\n");
        goto out;
    }
    rc = 0;
out:
    free(out);
    free(ids);
    return rc;
}

int cmd_tokenize(int argc, char **argv)
{
    const char *path = NULL;
    bool decode = false, add_special = false, no_parse_special = false;
    const td_opt_t opts[] = {
        {.name = "tokenizer", .type = TD_OPT_STR, .ptr = &path, .arg = "PATH",
         .help = "tokenizer.bin (llama2.c), tokenizer.json, a directory\n"
                 "holding tokenizer.json (+ tokenizer_config.json), or a GGUF file"},
        {.name = "decode", .type = TD_OPT_BOOL, .ptr = &decode, .help = "ids -> text instead of text -> ids"},
        {.name = "add-special", .type = TD_OPT_BOOL, .ptr = &add_special,
         .help = "add BOS / EOS where the tokenizer's model does (GGUF\n"
                 "add_bos_token / add_eos_token): llama-tokenize's default"},
        {.name = "no-parse-special", .type = TD_OPT_BOOL, .ptr = &no_parse_special,
         .help = "encode the text of special tokens (<|im_start|>, <s>) as\n"
                 "plain text, as llama-tokenize --no-parse-special"},
    };
    td_opts_t spec = {.prog = "tokenize", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r = {0};
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return 2;
    if (r.help) {
        printf("usage: tandem tokenize --tokenizer PATH [--decode] [--add-special] [--no-parse-special]\n"
               "\n"
               "Reads all of stdin. Without --decode: encodes it exactly as given (no newline\n"
               "stripped) and prints the token ids, space-separated, on one line, without BOS/EOS\n"
               "unless --add-special. Special tokens written in the text (tokenizer.json, GGUF)\n"
               "become their ids.\n"
               "With --decode: reads whitespace-separated token ids and prints their text\n"
               "(special tokens skipped, no newline added).\n"
               "\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        return 0;
    }
    if (!path || !*path) {
        fprintf(stderr, "tandem tokenize: --tokenizer PATH is required (see --help)\n");
        return 2;
    }

    td_tokenizer_t *tok;
    if (td_tokenizer_load(path, &tok) != TD_OK)
        return 1; /* td_errorf has said why */
    char *text;
    size_t len;
    int rc = read_stdin(&text, &len);
    if (rc == 0) {
        unsigned flags = (no_parse_special ? TD_TOK_NO_PARSE_SPECIAL : 0) |
                         (add_special && td_tokenizer_add_bos(tok) ? TD_TOK_ADD_BOS : 0) |
                         (add_special && td_tokenizer_add_eos(tok) ? TD_TOK_ADD_EOS : 0);
        rc = decode ? do_decode(tok, text) : do_encode(tok, text, len, flags);
        free(text);
    }
    if (fflush(stdout) != 0 && rc == 0) {
        fprintf(stderr, "tandem tokenize: error writing stdout\n");
        rc = 1;
    }
    td_tokenizer_destroy(tok);
    return rc;
}
