/*
 * fuzz_openai: the body of a POST /v1/completions (first byte even) or
 * /v1/chat/completions (odd) request through router_oai_parse, the router's JSON request
 * parser (cJSON underneath); a parse that succeeds is freed, one that fails must have
 * filled the OpenAI error it answers with.
 * Seeds: tests/fuzz/corpus/openai (requests using every documented parameter).
 */
#include "fuzz_util.h"
#include "router_openai.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_dir(); /* logging off */
    if (size < 1)
        return 0;
    router_oai_kind_t kind = data[0] % 2 ? ROUTER_OAI_CHAT : ROUTER_OAI_COMPLETIONS;
    /* the router hands the parser a body that is not NUL-terminated */
    char *body = malloc(size - 1 ? size - 1 : 1);
    if (!body)
        abort();
    memcpy(body, data + 1, size - 1);
    router_oai_req_t q;
    router_oai_error_t err = {0};
    if (router_oai_parse(kind, body, size - 1, &q, &err) == TD_OK) {
        router_oai_req_free(&q);
    } else if (err.status < 400 || err.status > 599 || !err.message[0]) {
        fprintf(stderr, "fuzz_openai: a refused body without an error status and message\n");
        abort();
    }
    free(body);
    return 0;
}
