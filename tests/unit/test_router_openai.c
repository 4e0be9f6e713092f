/*
 * test_router_openai: the OpenAI front door's pure half. Request bodies read as OpenAI's
 * servers read them (every served parameter lands in the router's request, unknown fields
 * and nulls are "not given", wrong types are a 400 naming the field, one prompt and one
 * choice per request); responses written in OpenAI's shapes, checked by parsing them back
 * with cJSON (so an escape or a comma out of place fails), including text that is not
 * valid UTF-8.
 */
#include <criterion/criterion.h>
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router_openai.h"

static router_oai_req_t q;
static router_oai_error_t err;

static td_status_t parse(router_oai_kind_t kind, const char *body)
{
    memset(&err, 0, sizeof err);
    return router_oai_parse(kind, body, strlen(body), &q, &err);
}

static void refused(router_oai_kind_t kind, const char *body, const char *param)
{
    cr_assert_eq(parse(kind, body), TD_ERR_INVALID, "%s was accepted", body);
    cr_assert_eq(err.status, 400);
    cr_assert_str_eq(err.param, param, "%s: param '%s', message %s", body, err.param, err.message);
    cr_assert_gt(strlen(err.message), 10);
}

Test(router_openai, completions_every_parameter)
{
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS,
                       "{\"model\":\"m\",\"prompt\":\"Hello\",\"max_tokens\":7,\"temperature\":0.5,\"top_p\":0.9,"
                       "\"top_k\":40,\"min_p\":0.05,\"seed\":42,\"stop\":[\"a\",\"bc\"],\"repetition_penalty\":1.1,"
                       "\"presence_penalty\":0.5,\"frequency_penalty\":-0.25,\"n\":1,\"logprobs\":3,\"echo\":true,"
                       "\"user\":\"u1\",\"stream\":true,\"stream_options\":{\"include_usage\":true},"
                       "\"some_future_field\":{\"x\":[1]}}"),
                 TD_OK, "%s", err.message);
    cr_assert_str_eq(q.model, "m");
    cr_assert_str_eq(q.prompt, "Hello");
    cr_assert(q.gp.prompt_is_text);
    cr_assert_eq(q.gp.prompt_len, 5);
    cr_assert_eq(q.gp.max_tokens, 7);
    cr_assert_float_eq(q.gp.sampling.temperature, 0.5f, 1e-6);
    cr_assert_float_eq(q.gp.sampling.top_p, 0.9f, 1e-6);
    cr_assert_eq(q.gp.sampling.top_k, 40);
    cr_assert_float_eq(q.gp.sampling.min_p, 0.05f, 1e-6);
    cr_assert_eq(q.gp.sampling.seed, 42);
    cr_assert_float_eq(q.gp.sampling.repetition_penalty, 1.1f, 1e-6);
    cr_assert_float_eq(q.gp.sampling.presence_penalty, 0.5f, 1e-6);
    cr_assert_float_eq(q.gp.sampling.frequency_penalty, -0.25f, 1e-6);
    cr_assert_eq(q.gp.n_stop_strings, 2);
    cr_assert_str_eq(q.gp.stop_strings[1], "bc");
    cr_assert_eq(q.logprobs, 3);
    cr_assert(q.echo && q.stream && q.include_usage);
    cr_assert_str_eq(q.user, "u1");
    cr_assert_eq(td_gen_params_validate(&q.gp, NULL, 0), TD_OK);
    router_oai_req_free(&q);
    router_oai_req_free(&q); /* repeatable */
}

/* vLLM's extra parameter: EOS does not end the output (fixed lengths for benchmarks) */
Test(router_openai, ignore_eos_both_endpoints)
{
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\"}"), TD_OK, "%s", err.message);
    cr_assert_not(q.gp.ignore_eos, "off unless asked");
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":[1,2],\"ignore_eos\":true,\"max_tokens\":9}"), TD_OK,
                 "%s", err.message);
    cr_assert(q.gp.ignore_eos);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                        "\"ignore_eos\":true}"),
                 TD_OK, "%s", err.message);
    cr_assert(q.gp.ignore_eos);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"ignore_eos\":null}"), TD_OK, "%s", err.message);
    cr_assert_not(q.gp.ignore_eos, "null is not given");
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"ignore_eos\":false}"), TD_OK, "%s", err.message);
    cr_assert_not(q.gp.ignore_eos);
    router_oai_req_free(&q);
}

/* tandem's extension: the request's TPOT objective (conditional disaggregation), both endpoints;
 * a wrong type is named, a value out of range is the one check's (td_gen_params) */
Test(router_openai, tpot_objective_ms_both_endpoints)
{
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\"}"), TD_OK, "%s", err.message);
    cr_assert_eq(q.gp.tpot_objective_ms, 0, "the router's unless given");
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"tpot_objective_ms\":25}"), TD_OK, "%s",
                 err.message);
    cr_assert_eq(q.gp.tpot_objective_ms, 25);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                        "\"tpot_objective_ms\":40}"),
                 TD_OK, "%s", err.message);
    cr_assert_eq(q.gp.tpot_objective_ms, 40);
    router_oai_req_free(&q);
    cr_assert_neq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"tpot_objective_ms\":2.5}"), TD_OK);
    cr_assert(strstr(err.message, "tpot_objective_ms"), "%s", err.message);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"tpot_objective_ms\":-5}"), TD_OK, "%s",
                 err.message);
    cr_assert_eq(td_gen_params_validate(&q.gp, NULL, 0), TD_ERR_INVALID);
    cr_assert_eq(td_gen_params_check(&q.gp, NULL, 0), TD_GEN_FIELD_TPOT_OBJECTIVE);
    router_oai_req_free(&q);
}

Test(router_openai, defaults_are_openais_and_null_is_not_given)
{
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS,
                       "{\"prompt\":\"x\",\"temperature\":null,\"stop\":null,\"max_tokens\":null,\"model\":null}"),
                 TD_OK, "%s", err.message);
    cr_assert_null(q.model);
    cr_assert_float_eq(q.gp.sampling.temperature, 1.0f, 1e-6); /* OpenAI's default, not greedy */
    cr_assert_float_eq(q.gp.sampling.top_p, 1.0f, 1e-6);
    cr_assert_eq(q.gp.max_tokens, 0); /* the router's default-max-tokens */
    cr_assert_eq(q.gp.n_stop_strings, 0);
    cr_assert_eq(q.logprobs, -1);
    cr_assert(!q.stream && !q.echo && !q.include_usage);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_k\":-1,\"stop\":\"\\n\"}"), TD_OK);
    cr_assert_eq(q.gp.sampling.top_k, 0); /* vLLM's -1: off */
    cr_assert_eq(q.gp.n_stop_strings, 1);
    cr_assert_str_eq(q.gp.stop_strings[0], "\n");
    router_oai_req_free(&q);
}

Test(router_openai, completions_prompt_forms)
{
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":[1,2,300000]}"), TD_OK, "%s", err.message);
    cr_assert(!q.gp.prompt_is_text);
    cr_assert_eq(q.gp.prompt_len, 3);
    cr_assert_eq(q.prompt_ids[2], 300000);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":[[5,6]]}"), TD_OK);
    cr_assert_eq(q.gp.prompt_len, 2);
    cr_assert_eq(q.prompt_ids[1], 6);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":[\"one\"]}"), TD_OK);
    cr_assert_str_eq(q.prompt, "one");
    router_oai_req_free(&q);
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":[\"one\",\"two\"]}", "prompt");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":[1,-2]}", "prompt");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":[1,2.5]}", "prompt");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":[]}", "prompt");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":7}", "prompt");
    refused(ROUTER_OAI_COMPLETIONS, "{\"max_tokens\":3}", "prompt");
}

Test(router_openai, chat_messages)
{
    cr_assert_eq(parse(ROUTER_OAI_CHAT,
                       "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                       "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hi \"},"
                       "{\"type\":\"text\",\"text\":\"there\"}],\"name\":\"bob\"}],"
                       "\"max_completion_tokens\":5,\"max_tokens\":9,\"logprobs\":true,\"top_logprobs\":20}"),
                 TD_OK, "%s", err.message);
    cr_assert_eq(q.n_messages, 2);
    cr_assert_str_eq(q.messages[0].role, "system");
    cr_assert_str_eq(q.messages[1].content, "Hi there");
    cr_assert(q.gp.prompt_is_text);
    cr_assert_str_eq(q.messages[1].name, "bob", "the template sees a message's name");
    /* roles, contents, names and TD_GEN_MESSAGE_BYTES a message: empty messages count too */
    cr_assert_eq(q.gp.prompt_len, strlen("systemBe brief.userHi therebob") + 2 * TD_GEN_MESSAGE_BYTES);
    cr_assert_eq(q.gp.max_tokens, 5); /* the newer name wins */
    cr_assert_eq(q.logprobs, 20);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"content\":null}],\"logprobs\":false}"),
                 TD_OK);
    cr_assert_str_eq(q.messages[0].content, "");
    cr_assert_eq(q.logprobs, -1);
    router_oai_req_free(&q);
    refused(ROUTER_OAI_CHAT, "{\"messages\":[]}", "messages");
    refused(ROUTER_OAI_CHAT, "{\"prompt\":\"x\"}", "messages");
    refused(ROUTER_OAI_CHAT, "{\"messages\":\"hi\"}", "messages");
    refused(ROUTER_OAI_CHAT, "{\"messages\":[{\"content\":\"x\"}]}", "messages[0].role");
    refused(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":1}]}", "messages[1].role");
    refused(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", "messages[0].content");
    refused(ROUTER_OAI_CHAT,
            "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]}",
            "messages[0].content");
    refused(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}",
            "top_logprobs");
    refused(ROUTER_OAI_CHAT,
            "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":21}",
            "top_logprobs");
    refused(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":3}", "logprobs");
}

Test(router_openai, wrong_types_name_the_parameter)
{
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", "temperature");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":1.5}", "max_tokens");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":-1}", "max_tokens");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_k\":\"5\"}", "top_k");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"seed\":true}", "seed");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stream\":\"yes\"}", "stream");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"echo\":1}", "echo");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"ignore_eos\":\"true\"}", "ignore_eos");
    refused(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"ignore_eos\":1}",
            "ignore_eos");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":5}", "stop");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":[\"a\",3]}", "stop");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"model\":[]}", "model");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"user\":5}", "user");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stream_options\":true}", "stream_options");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":1}}",
            "stream_options.include_usage");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logprobs\":true}", "logprobs");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logprobs\":21}", "logprobs");
    refused(ROUTER_OAI_COMPLETIONS,
            "{\"prompt\":\"x\",\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\",\"12\","
            "\"13\",\"14\",\"15\",\"16\",\"17\"]}",
            "stop");
}

Test(router_openai, n_and_unserved_features_refused_by_name)
{
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":0}", "n");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":17}", "n");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":2.5}", "n");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"best_of\":3}", "best_of");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":2,\"best_of\":3}", "best_of");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"tools\":[{\"type\":\"function\"}]}", "tools");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"functions\":[{\"name\":\"f\"}]}", "functions");
    /* the empty forms clients send by default are no request for the feature */
    cr_assert_eq(parse(ROUTER_OAI_CHAT,
                       "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[],\"logit_bias\":{},"
                       "\"response_format\":{\"type\":\"text\"},\"n\":1}"),
                 TD_OK, "%s", err.message);
    cr_assert_eq(q.n, 1);
    cr_assert_eq(q.gp.sampling.n_logit_bias, 0);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":16,\"best_of\":16}"), TD_OK, "%s", err.message);
    cr_assert_eq(q.n, 16);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\"}"), TD_OK, "%s", err.message);
    cr_assert_eq(q.n, 1, "n defaults to 1");
    router_oai_req_free(&q);
}

/* The body's logit_bias as td_gen_params_check judges it: TD_GEN_FIELD_NONE or the field. */
static td_gen_field_t bias_check(const char *body)
{
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, body), TD_OK, "%s: %s", body, err.message);
    td_gen_field_t f = td_gen_params_check(&q.gp, err.message, sizeof err.message);
    return f;
}

Test(router_openai, logit_bias_read_in_both_forms_and_checked)
{
    cr_assert_eq(bias_check("{\"prompt\":\"x\",\"logit_bias\":{\"5\":100,\"1234\":-100,\"7\":0.5}}"),
                 TD_GEN_FIELD_NONE, "%s", err.message);
    cr_assert_eq(q.gp.sampling.n_logit_bias, 3);
    cr_assert_eq(q.gp.sampling.logit_bias_ids[1], 1234);
    cr_assert_float_eq(q.gp.sampling.logit_bias[1], -100.0f, 0);
    cr_assert_float_eq(q.gp.sampling.logit_bias[2], 0.5f, 0);
    router_oai_req_free(&q);
    /* llama.cpp's list form */
    cr_assert_eq(bias_check("{\"prompt\":\"x\",\"logit_bias\":[[9,-3],[10,2]]}"), TD_GEN_FIELD_NONE, "%s",
                 err.message);
    cr_assert_eq(q.gp.sampling.n_logit_bias, 2);
    cr_assert_eq(q.gp.sampling.logit_bias_ids[1], 10);
    router_oai_req_free(&q);

    /* out of range, a duplicate (list form), too many: td_gen_params_check names logit_bias */
    cr_assert_eq(bias_check("{\"prompt\":\"x\",\"logit_bias\":{\"5\":101}}"), TD_GEN_FIELD_LOGIT_BIAS);
    cr_assert(strstr(err.message, "out of range [-100, 100]"), "%s", err.message);
    router_oai_req_free(&q);
    cr_assert_eq(bias_check("{\"prompt\":\"x\",\"logit_bias\":[[5,1],[5,2]]}"), TD_GEN_FIELD_LOGIT_BIAS);
    cr_assert(strstr(err.message, "token 5 twice"), "%s", err.message);
    router_oai_req_free(&q);
    char body[8192] = "{\"prompt\":\"x\",\"logit_bias\":{";
    for (int i = 0; i < 301; i++)
        snprintf(body + strlen(body), sizeof body - strlen(body), "%s\"%d\":1", i ? "," : "", i);
    strcat(body, "}}");
    cr_assert_eq(bias_check(body), TD_GEN_FIELD_LOGIT_BIAS);
    cr_assert(strstr(err.message, "301 entries, at most 300"), "%s", err.message);
    cr_assert_str_eq(td_gen_field_names(TD_GEN_FIELD_LOGIT_BIAS).openai_chat, "logit_bias");
    router_oai_req_free(&q);

    /* what is not a token id, or not a bias, is refused while reading */
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":{\"abc\":1}}", "logit_bias");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":{\"-5\":1}}", "logit_bias");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":{\"5x\":1}}", "logit_bias");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":{\"99999999999\":1}}", "logit_bias");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":{\"5\":\"a lot\"}}", "logit_bias");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":[[1.5,2]]}", "logit_bias");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":[[1]]}", "logit_bias");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":5}", "logit_bias");
}

#define CHAT_X "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"

/* The constraint `body` carries is read as `kind` from `param` and translated to GBNF
 * equal to what td_gram makes of `src` (so the nodes compile the same grammar). */
static void constrained(const char *body, td_gram_kind_t kind, const char *param, const char *src)
{
    cr_assert_eq(parse(ROUTER_OAI_CHAT, body), TD_OK, "%s: %s", body, err.message);
    cr_assert_not_null(q.grammar, "%s: no grammar", body);
    cr_assert_eq(q.grammar_kind, kind, "%s: kind %s", body, td_gram_kind_name(q.grammar_kind));
    cr_assert_str_eq(q.grammar_param, param);
    td_gram_t *g = NULL;
    cr_assert_eq(td_gram_compile(kind, src, strlen(src), &g), TD_OK);
    cr_assert_str_eq(q.grammar, td_gram_source(g), "%s: GBNF differs", body);
    td_gram_unref(g);
    router_oai_req_free(&q);
    cr_assert_null(q.grammar);
}

Test(router_openai, structured_output_fields_become_gbnf)
{
    const char *schema = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]}";
    constrained(CHAT_X "\"response_format\":{\"type\":\"json_object\"}}", TD_GRAM_JSON_OBJECT, "response_format",
                "");
    constrained(CHAT_X "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"r\",\"strict\":true,"
                       "\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]}}}}",
                TD_GRAM_JSON_SCHEMA, "response_format.json_schema.schema", schema);
    constrained(CHAT_X "\"guided_json\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
                       "\"required\":[\"a\"]}}",
                TD_GRAM_JSON_SCHEMA, "guided_json", schema);
    /* vLLM also takes the schema as its JSON text */
    constrained(CHAT_X "\"guided_json\":\"{\\\"type\\\":\\\"object\\\",\\\"properties\\\":{\\\"a\\\":"
                       "{\\\"type\\\":\\\"integer\\\"}},\\\"required\\\":[\\\"a\\\"]}\"}",
                TD_GRAM_JSON_SCHEMA, "guided_json", schema);
    constrained(CHAT_X "\"guided_regex\":\"[a-c]{2}\\\\d\"}", TD_GRAM_REGEX, "guided_regex", "[a-c]{2}\\d");
    constrained(CHAT_X "\"guided_choice\":[\"yes\",\"no\"]}", TD_GRAM_CHOICE, "guided_choice", "[\"yes\",\"no\"]");
    constrained(CHAT_X "\"guided_grammar\":\"root ::= \\\"a\\\"+\"}", TD_GRAM_GBNF, "guided_grammar",
                "root ::= \"a\"+");
    constrained(CHAT_X "\"structured_outputs\":{\"choice\":[\"x\",\"y\"]}}", TD_GRAM_CHOICE,
                "structured_outputs.choice", "[\"x\",\"y\"]");
    constrained(CHAT_X "\"structured_outputs\":{\"json_object\":true}}", TD_GRAM_JSON_OBJECT,
                "structured_outputs.json_object", "");
    constrained(CHAT_X "\"structured_outputs\":{\"regex\":\"ab?\"}}", TD_GRAM_REGEX, "structured_outputs.regex",
                "ab?");
    /* llama.cpp's fields */
    constrained(CHAT_X "\"grammar\":\"root ::= [0-9]+\"}", TD_GRAM_GBNF, "grammar", "root ::= [0-9]+");
    constrained(CHAT_X "\"json_schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
                       "\"required\":[\"a\"]}}",
                TD_GRAM_JSON_SCHEMA, "json_schema", schema);
    /* no constraint: text, nulls and an empty structured_outputs */
    cr_assert_eq(parse(ROUTER_OAI_CHAT, CHAT_X "\"response_format\":{\"type\":\"text\"},\"guided_json\":null,"
                                            "\"grammar\":null,\"structured_outputs\":{}}"),
                 TD_OK, "%s", err.message);
    cr_assert_null(q.grammar);
    router_oai_req_free(&q);
    /* completions read the same fields */
    cr_assert_eq(parse(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\",\"guided_regex\":\"a|b\"}"), TD_OK, "%s",
                 err.message);
    cr_assert_not_null(q.grammar);
    cr_assert_eq(q.grammar_kind, TD_GRAM_REGEX);
    router_oai_req_free(&q);
}

Test(router_openai, structured_output_refusals_name_the_field)
{
    /* two constraints: which should win is not guessed */
    refused(ROUTER_OAI_CHAT, CHAT_X "\"response_format\":{\"type\":\"json_object\"},\"guided_regex\":\"a\"}",
            "guided_regex");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"guided_choice\":[\"a\"],\"grammar\":\"root ::= \\\"a\\\"\"}", "grammar");
    /* an unsupported schema keyword is named in the message */
    refused(ROUTER_OAI_CHAT,
            CHAT_X "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"r\",\"schema\":"
                   "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"multipleOf\":3}}}}}}",
            "response_format.json_schema.schema");
    cr_assert(strstr(err.message, "multipleOf"), "%s", err.message);
    refused(ROUTER_OAI_CHAT, CHAT_X "\"guided_json\":{\"type\":\"array\",\"uniqueItems\":true}}", "guided_json");
    cr_assert(strstr(err.message, "uniqueItems"), "%s", err.message);
    /* bad regex, a grammar that cannot match, malformed schema text */
    refused(ROUTER_OAI_CHAT, CHAT_X "\"guided_regex\":\"(a\"}", "guided_regex");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"guided_regex\":\"(?=a)b\"}", "guided_regex");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"grammar\":\"root ::= root \\\"a\\\"\"}", "grammar");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"guided_grammar\":\"root ::= undefined\"}", "guided_grammar");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"guided_json\":\"{not json\"}", "guided_json");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"guided_choice\":[]}", "guided_choice");
    /* wrong types and unknown response_format types */
    refused(ROUTER_OAI_CHAT, CHAT_X "\"guided_choice\":\"a\"}", "guided_choice");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"guided_regex\":5}", "guided_regex");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"response_format\":\"json\"}", "response_format");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"response_format\":{\"type\":\"xml\"}}", "response_format.type");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"response_format\":{\"type\":\"json_schema\"}}", "response_format.json_schema");
    refused(ROUTER_OAI_CHAT,
            CHAT_X "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"r\",\"strict\":1,"
                   "\"schema\":{}}}}",
            "response_format.json_schema.strict");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"structured_outputs\":{\"regex\":[1]}}", "structured_outputs.regex");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"structured_outputs\":{\"json_object\":1}}", "structured_outputs.json_object");
}

#define TOOL_W                                                                                     \
    "{\"type\":\"function\",\"function\":{\"name\":\"w\",\"parameters\":{\"type\":\"object\",\"properties\":" \
    "{\"c\":{\"type\":\"string\"}},\"required\":[\"c\"]}}}"

Test(router_openai, tools_and_tool_choice)
{
    /* tools, tool_choice defaulting to auto, messages with calls and results */
    cr_assert_eq(parse(ROUTER_OAI_CHAT,
                       "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\",\"content\":null,"
                       "\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"w\","
                       "\"arguments\":\"{\\\"c\\\": 1}\"}}]},{\"role\":\"tool\",\"content\":\"22\",\"tool_call_id\":"
                       "\"call_1\",\"name\":\"w\"}],\"tools\":[" TOOL_W "]}"),
                 TD_OK, "%s", err.message);
    cr_assert_eq(q.tool_choice, ROUTER_OAI_TOOLS_AUTO);
    cr_assert(q.parallel_tool_calls);
    cr_assert_eq(q.n_tools, 1);
    cr_assert_str_eq(q.tools[0].name, "w");
    cr_assert(strstr(q.tools[0].parameters, "\"required\""));
    cr_assert(strstr(q.tools_json, "\"name\":\"w\""));
    cr_assert(strstr(q.messages[1].tool_calls, "call_1"));
    cr_assert_str_eq(q.messages[2].tool_call_id, "call_1");
    cr_assert_str_eq(q.messages[2].name, "w");
    cr_assert_null(q.messages[0].tool_calls);
    cr_assert_eq(router_oai_tools_prepare(&q, TD_TOOLS_HERMES, &err), TD_OK);
    cr_assert_null(q.grammar, "auto: free generation");
    cr_assert_eq(router_oai_tools_prepare(&q, TD_TOOLS_NONE, &err), TD_ERR_INVALID, "no format: refused");
    cr_assert_str_eq(err.param, "tools");
    router_oai_req_free(&q);
    /* required and a named function: the grammar of a call, one with parallel_tool_calls false */
    const char *forced[] = {CHAT_X "\"tools\":[" TOOL_W "],\"tool_choice\":\"required\"}",
                            CHAT_X "\"tools\":[" TOOL_W "],\"tool_choice\":{\"type\":\"function\",\"function\":"
                                   "{\"name\":\"w\"}},\"parallel_tool_calls\":false}"};
    for (size_t i = 0; i < 2; i++) {
        cr_assert_eq(parse(ROUTER_OAI_CHAT, forced[i]), TD_OK, "%s", err.message);
        cr_assert_eq(router_oai_tools_prepare(&q, TD_TOOLS_HERMES, &err), TD_OK, "%s", err.message);
        cr_assert_not_null(q.grammar);
        cr_assert_str_eq(q.grammar_param, "tool_choice");
        td_tool_t t = {"w", "{\"type\":\"object\",\"properties\":{\"c\":{\"type\":\"string\"}},\"required\":[\"c\"]}"};
        char *want = NULL;
        cr_assert_eq(td_tools_grammar(TD_TOOLS_HERMES, &t, 1, i == 0, &want, NULL), TD_OK);
        cr_assert_str_eq(q.grammar, want, "the nodes get the forced call's grammar");
        free(want);
        router_oai_req_free(&q);
    }
    /* n > 1 with tools: each choice's calls are parsed on their own (router_http.c) */
    cr_assert_eq(parse(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[" TOOL_W "],\"n\":2}"), TD_OK, "%s", err.message);
    cr_assert_eq(router_oai_tools_prepare(&q, TD_TOOLS_HERMES, &err), TD_OK, "%s", err.message);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[" TOOL_W "],\"n\":2,\"tool_choice\":\"none\"}"), TD_OK);
    cr_assert_eq(router_oai_tools_prepare(&q, TD_TOOLS_HERMES, &err), TD_OK, "%s", err.message);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[" TOOL_W "],\"tool_choice\":\"none\"}"), TD_OK);
    cr_assert_eq(q.tool_choice, ROUTER_OAI_TOOLS_NONE);
    cr_assert_not_null(q.tools_json, "none: the tools are still rendered");
    router_oai_req_free(&q);
    /* refusals, each naming its field */
    refused(ROUTER_OAI_CHAT, CHAT_X "\"tools\":{}}", "tools");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[{\"type\":\"function\",\"function\":{}}]}", "tools[0]");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[{\"type\":\"x\",\"function\":{\"name\":\"a\"}}]}", "tools[0]");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a\",\"parameters\":1}}]}",
            "tools[0].function.parameters");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[" TOOL_W "],\"tool_choice\":\"any\"}", "tool_choice");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[" TOOL_W "],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"z\"}}}",
            "tool_choice.function.name");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"tool_choice\":\"required\"}", "tool_choice");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[" TOOL_W "],\"parallel_tool_calls\":1}", "parallel_tool_calls");
    refused(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"content\":\"x\",\"tool_calls\":{}}]}",
            "messages[0].tool_calls");
    refused(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"content\":\"x\",\"tool_calls\":[{\"id\":\"a\"}]}]}",
            "messages[0].tool_calls[0].function.name");
    refused(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"tool\",\"content\":\"x\",\"tool_call_id\":5}]}",
            "messages[0].tool_call_id");
    /* a forced call's schema keyword td_gram lacks, and a forced call beside another constraint */
    cr_assert_eq(parse(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[" TOOL_W ",{\"type\":\"function\",\"function\":{\"name\":"
                                        "\"m\",\"parameters\":{\"type\":\"object\",\"properties\":{\"n\":{\"type\":"
                                        "\"integer\",\"multipleOf\":2}}}}}],\"tool_choice\":\"required\"}"),
                 TD_OK);
    cr_assert_eq(router_oai_tools_prepare(&q, TD_TOOLS_HERMES, &err), TD_ERR_INVALID);
    cr_assert_str_eq(err.param, "tools[1].function.parameters");
    cr_assert(strstr(err.message, "multipleOf"), "%s", err.message);
    router_oai_req_free(&q);
    cr_assert_eq(parse(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[" TOOL_W "],\"tool_choice\":\"required\","
                                        "\"response_format\":{\"type\":\"json_object\"}}"),
                 TD_OK);
    cr_assert_eq(router_oai_tools_prepare(&q, TD_TOOLS_HERMES, &err), TD_ERR_INVALID);
    cr_assert_str_eq(err.code, "conflicting_parameters");
    router_oai_req_free(&q);
}

#define FN_W "{\"name\":\"w\",\"parameters\":{\"type\":\"object\",\"properties\":{\"c\":{\"type\":\"string\"}},\"required\":[\"c\"]}}"

/* OpenAI's older form: functions and function_call read as the tools and tool_choice they
 * are, the conversation's function_call and function messages as a call and a result. */
Test(router_openai, functions_and_function_call)
{
    cr_assert_eq(parse(ROUTER_OAI_CHAT,
                       "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\",\"content\":null,"
                       "\"function_call\":{\"name\":\"w\",\"arguments\":\"{\\\"c\\\": \\\"P\\\"}\"}},{\"role\":\"function\","
                       "\"name\":\"w\",\"content\":\"22\"}],\"functions\":[" FN_W "]}"),
                 TD_OK, "%s", err.message);
    cr_assert(q.legacy_functions);
    cr_assert_eq(q.tool_choice, ROUTER_OAI_TOOLS_AUTO, "auto by default with functions");
    cr_assert_not(q.parallel_tool_calls, "the older answer has one function_call");
    cr_assert_eq(q.n_tools, 1);
    cr_assert_str_eq(q.tools[0].name, "w");
    cr_assert(strstr(q.tools[0].parameters, "\"required\""));
    /* the template gets the newer tools array */
    cJSON *t = cJSON_Parse(q.tools_json);
    cr_assert_str_eq(cJSON_GetObjectItem(cJSON_GetArrayItem(t, 0), "type")->valuestring, "function", "%s", q.tools_json);
    cr_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetArrayItem(t, 0), "function"), "name")->valuestring,
                     "w");
    cJSON_Delete(t);
    cJSON *c = cJSON_Parse(q.messages[1].tool_calls);
    const cJSON *fn = cJSON_GetObjectItem(cJSON_GetArrayItem(c, 0), "function");
    cr_assert_str_eq(cJSON_GetObjectItem(fn, "name")->valuestring, "w", "%s", q.messages[1].tool_calls);
    cr_assert_str_eq(cJSON_GetObjectItem(fn, "arguments")->valuestring, "{\"c\": \"P\"}");
    cJSON_Delete(c);
    cr_assert_str_eq(q.messages[2].role, "tool", "a function result is a tool result");
    cr_assert_str_eq(q.messages[2].name, "w");
    cr_assert_eq(router_oai_tools_prepare(&q, TD_TOOLS_HERMES, &err), TD_OK, "%s", err.message);
    cr_assert_null(q.grammar, "auto: free generation");
    cr_assert_eq(router_oai_tools_prepare(&q, TD_TOOLS_NONE, &err), TD_ERR_INVALID, "no format: refused");
    cr_assert_str_eq(err.param, "functions");
    router_oai_req_free(&q);
    /* function_call none: rendered, never parsed */
    cr_assert_eq(parse(ROUTER_OAI_CHAT, CHAT_X "\"functions\":[" FN_W "],\"function_call\":\"none\"}"), TD_OK);
    cr_assert_eq(q.tool_choice, ROUTER_OAI_TOOLS_NONE);
    cr_assert_not_null(q.tools_json);
    router_oai_req_free(&q);
    /* function_call {"name"}: the named call's grammar, one call, as tool_choice's */
    cr_assert_eq(parse(ROUTER_OAI_CHAT, CHAT_X "\"functions\":[" FN_W "],\"function_call\":{\"name\":\"w\"}}"), TD_OK,
                 "%s", err.message);
    cr_assert_eq(q.tool_choice, ROUTER_OAI_TOOLS_NAMED);
    cr_assert_eq(router_oai_tools_prepare(&q, TD_TOOLS_HERMES, &err), TD_OK, "%s", err.message);
    td_tool_t tw = {"w", "{\"type\":\"object\",\"properties\":{\"c\":{\"type\":\"string\"}},\"required\":[\"c\"]}"};
    char *want = NULL;
    cr_assert_eq(td_tools_grammar(TD_TOOLS_HERMES, &tw, 1, false, &want, NULL), TD_OK);
    cr_assert_str_eq(q.grammar, want, "the nodes get the forced call's grammar, one call");
    cr_assert_str_eq(q.grammar_param, "function_call");
    free(want);
    router_oai_req_free(&q);
    /* the empty form is no request for tools */
    cr_assert_eq(parse(ROUTER_OAI_CHAT, CHAT_X "\"functions\":[]}"), TD_OK, "%s", err.message);
    cr_assert_eq(q.n_tools, 0);
    cr_assert_not(q.legacy_functions);
    router_oai_req_free(&q);
    /* refusals, each naming its field: both forms at once, bad shapes and choices */
    refused(ROUTER_OAI_CHAT, CHAT_X "\"functions\":[" FN_W "],\"tools\":[" TOOL_W "]}", "functions");
    cr_assert_str_eq(err.code, "conflicting_parameters");
    cr_assert(strstr(err.message, "'tools'"), "%s", err.message);
    refused(ROUTER_OAI_CHAT, CHAT_X "\"functions\":[" FN_W "],\"tool_choice\":\"auto\"}", "functions");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"tools\":[" TOOL_W "],\"function_call\":\"auto\"}", "function_call");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"functions\":{}}", "functions");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"functions\":[{\"description\":\"no name\"}]}", "functions[0]");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"functions\":[" FN_W ",{\"name\":\"a\",\"parameters\":1}]}",
            "functions[1].parameters");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"functions\":[" FN_W "],\"function_call\":\"required\"}", "function_call");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"functions\":[" FN_W "],\"function_call\":5}", "function_call");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"functions\":[" FN_W "],\"function_call\":{\"name\":\"z\"}}", "function_call.name");
    refused(ROUTER_OAI_CHAT, CHAT_X "\"function_call\":{\"name\":\"w\"}}", "function_call.name");
    refused(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"content\":\"x\",\"function_call\":{}}]}",
            "messages[0].function_call");
    refused(ROUTER_OAI_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"content\":\"x\",\"function_call\":{\"name\":\"w\"},"
                             "\"tool_calls\":[{\"type\":\"function\",\"function\":{\"name\":\"w\"}}]}]}",
            "messages[0].function_call");
    /* a forced call's schema keyword td_gram lacks: named as the function's parameters */
    cr_assert_eq(parse(ROUTER_OAI_CHAT, CHAT_X "\"functions\":[" FN_W ",{\"name\":\"m\",\"parameters\":{\"type\":"
                                        "\"object\",\"properties\":{\"n\":{\"type\":\"integer\",\"multipleOf\":2}}}}],"
                                        "\"function_call\":{\"name\":\"m\"}}"),
                 TD_OK, "%s", err.message);
    cr_assert_eq(router_oai_tools_prepare(&q, TD_TOOLS_HERMES, &err), TD_ERR_INVALID);
    cr_assert_str_eq(err.param, "functions[1].parameters");
    router_oai_req_free(&q);
}

/* Tool-call ids: OpenAI's shape (Mistral's 9 characters), the same for the same request, and
 * distinct over the calls of every choice of a request (n > 1 with tools). */
Test(router_openai, tool_call_ids)
{
    char ids[4 * 4][40], again[40];
    for (uint32_t c = 0; c < 4; c++)
        for (uint32_t i = 0; i < 4; i++) {
            char *id = ids[4 * c + i];
            router_oai_tool_call_id("chatcmpl-r7", TD_TOOLS_HERMES, c, i, id);
            cr_assert_eq(strlen(id), 5 + 24, "%s", id);
            cr_assert(!strncmp(id, "call_", 5), "%s", id);
            for (size_t k = 5; id[k]; k++)
                cr_assert(isalnum((unsigned char)id[k]), "%s", id);
            router_oai_tool_call_id("chatcmpl-r7", TD_TOOLS_HERMES, c, i, again);
            cr_assert_str_eq(id, again, "an id is a function of the request, choice and call");
            for (uint32_t j = 0; j < 4 * c + i; j++)
                cr_assert_str_neq(ids[j], id, "choice %u call %u repeats id %u", c, i, j);
        }
    router_oai_tool_call_id("chatcmpl-r8", TD_TOOLS_HERMES, 0, 0, again);
    cr_assert_str_neq(again, ids[0], "another request, other ids");
    router_oai_tool_call_id("chatcmpl-r7", TD_TOOLS_MISTRAL, 1, 0, again);
    cr_assert_eq(strlen(again), 9, "%s", again);
}

Test(router_openai, tool_call_shapes)
{
    router_oai_resp_t rs = {.kind = ROUTER_OAI_CHAT, .id = "chatcmpl-r1", .model = "m", .created = 1};
    router_oai_buf_t b = {0}, calls = {0};
    router_oai_tool_call_json(&calls, 0, "call_a", "w", "{\"c\": \"P\"}", 10);
    router_oai_buf_put(&calls, "", 0);
    router_oai_response_tools(&b, &rs, "", 0, calls.p, NULL, "tool_calls", &(router_oai_usage_t){1, 2, 0, 0});
    cJSON *j = cJSON_Parse(b.p);
    cr_assert_not_null(j, "%s", b.p);
    const cJSON *m = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "message");
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(m, "content")), "no content beside calls: null");
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(m, "tool_calls"), 0);
    cr_assert_str_eq(cJSON_GetObjectItem(c, "id")->valuestring, "call_a");
    cr_assert_str_eq(cJSON_GetObjectItem(c, "type")->valuestring, "function");
    cr_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(c, "function"), "arguments")->valuestring,
                     "{\"c\": \"P\"}");
    cJSON_Delete(j);
    b.n = 0;
    router_oai_tool_call_chunk(&b, &rs, true, 0, "call_a", "w", "{}", 2, false);
    router_oai_buf_put(&b, "", 0);
    char *second = strstr(b.p + 6, "data: ");
    cr_assert_not_null(second, "two events");
    cr_assert(strstr(b.p, "\"role\":\"assistant\"") < second && strstr(b.p, "\"name\":\"w\"") < second,
              "the first carries the role and the name");
    cr_assert(strstr(second, "\"arguments\":\"{}\""), "the second the arguments: %s", second);
    b.n = 0;
    rs.index = 2; /* choice 2 of n: both events carry it */
    router_oai_tool_call_chunk(&b, &rs, false, 0, "call_b", "w", "{}", 2, false);
    router_oai_buf_put(&b, "", 0);
    second = strstr(b.p + 6, "data: ");
    cr_assert_not_null(second, "two events");
    const char *at = strstr(b.p, "\"choices\":[{\"index\":2,");
    cr_assert(at && at < second && strstr(second, "\"choices\":[{\"index\":2,"), "choice 2's call: %s", b.p);
    router_oai_buf_free(&b);
    router_oai_buf_free(&calls);
}

/* The older answer to `functions`: message.function_call {name, arguments} and finish
 * function_call, streamed as delta.function_call with the name first, then arguments. */
Test(router_openai, function_call_shapes)
{
    router_oai_resp_t rs = {.kind = ROUTER_OAI_CHAT, .id = "chatcmpl-r1", .model = "m", .created = 1,
                            .legacy_functions = true};
    router_oai_buf_t b = {0}, call = {0};
    router_oai_function_call_json(&call, "w", "{\"c\": \"P\"}", 10);
    router_oai_buf_put(&call, "", 0);
    router_oai_response_tools(&b, &rs, "", 0, call.p, NULL, "function_call", &(router_oai_usage_t){1, 2, 0, 0});
    router_oai_buf_put(&b, "", 0);
    cJSON *j = cJSON_Parse(b.p);
    cr_assert_not_null(j, "%s", b.p);
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    const cJSON *m = cJSON_GetObjectItem(ch, "message");
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(m, "content")), "no content beside the call: null");
    cr_assert_null(cJSON_GetObjectItem(m, "tool_calls"), "%s", b.p);
    const cJSON *fc = cJSON_GetObjectItem(m, "function_call");
    cr_assert_str_eq(cJSON_GetObjectItem(fc, "name")->valuestring, "w", "%s", b.p);
    cr_assert_str_eq(cJSON_GetObjectItem(fc, "arguments")->valuestring, "{\"c\": \"P\"}");
    cr_assert_str_eq(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "function_call");
    cJSON_Delete(j);
    /* streamed: the name (and empty arguments) with the role, then a piece of arguments */
    b.n = 0;
    router_oai_tool_call_chunk(&b, &rs, true, 0, "call_a", "w", "{\"c\"", 4, false);
    router_oai_buf_put(&b, "", 0);
    char *second = strstr(b.p + 6, "data: ");
    cr_assert_not_null(second, "two events");
    second[-1] = 0;
    j = cJSON_Parse(b.p + 6);
    cr_assert_not_null(j, "%s", b.p);
    const cJSON *d = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "delta");
    cr_assert_str_eq(cJSON_GetObjectItem(d, "role")->valuestring, "assistant");
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(d, "content")));
    cr_assert_null(cJSON_GetObjectItem(d, "tool_calls"));
    cr_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(d, "function_call"), "name")->valuestring, "w");
    cr_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(d, "function_call"), "arguments")->valuestring, "");
    cJSON_Delete(j);
    j = cJSON_Parse(second + 6);
    cr_assert_not_null(j, "%s", second);
    d = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "delta");
    cr_assert_null(cJSON_GetObjectItem(d, "role"));
    cr_assert_null(cJSON_GetObjectItem(cJSON_GetObjectItem(d, "function_call"), "name"));
    cr_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(d, "function_call"), "arguments")->valuestring, "{\"c\"");
    cJSON_Delete(j);
    router_oai_buf_free(&b);
    router_oai_buf_free(&call);
}

Test(router_openai, bad_json)
{
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\": \"x\",", "");
    refused(ROUTER_OAI_COMPLETIONS, "", "");
    refused(ROUTER_OAI_COMPLETIONS, "[1,2]", "");
    refused(ROUTER_OAI_COMPLETIONS, "{\"prompt\":\"x\"} trailing", "");
    /* a NUL inside the body ends nothing early: the length is the body's */
    char body[] = "{\"prompt\":\"x\"}\0garbage";
    memset(&err, 0, sizeof err);
    cr_assert_eq(router_oai_parse(ROUTER_OAI_COMPLETIONS, body, sizeof body - 1, &q, &err), TD_ERR_INVALID);
}

/* ---- writing ------------------------------------------------------------------------- */

static cJSON *parsed(const router_oai_buf_t *b, const char *prefix)
{
    cr_assert(!b->oom);
    size_t pl = strlen(prefix);
    cr_assert_eq(strncmp(b->p, prefix, pl), 0, "'%s' does not begin with '%s'", b->p, prefix);
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithOpts(b->p + pl, &end, false);
    cr_assert_not_null(j, "not JSON: %s", b->p);
    return j;
}

static const cJSON *at(const cJSON *j, const char *path)
{
    char buf[128];
    snprintf(buf, sizeof buf, "%s", path);
    const cJSON *v = j;
    for (char *save, *k = strtok_r(buf, ".", &save); k; k = strtok_r(NULL, ".", &save))
        v = k[0] >= '0' && k[0] <= '9' ? cJSON_GetArrayItem(v, atoi(k)) : cJSON_GetObjectItemCaseSensitive(v, k);
    cr_assert_not_null(v, "no %s", path);
    return v;
}

Test(router_openai, json_strings_escape_and_repair_utf8)
{
    router_oai_buf_t b = {0};
    const char in[] = "q\"b\\n\n\t\x01 caf\xc3\xa9 \xe2\x82 \xff \xf0\x9f\x98\x80 \xed\xa0\x80";
    router_oai_buf_json_str(&b, in, sizeof in - 1);
    cJSON *j = cJSON_Parse(b.p);
    cr_assert_not_null(j, "%s", b.p);
    cr_assert_str_eq(j->valuestring, "q\"b\\n\n\t\x01 caf\xc3\xa9 \xef\xbf\xbd\xef\xbf\xbd \xef\xbf\xbd \xf0\x9f\x98\x80 "
                                     "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
    cJSON_Delete(j);
    router_oai_buf_free(&b);
}

Test(router_openai, stream_chunks)
{
    router_oai_resp_t chat = {.kind = ROUTER_OAI_CHAT, .id = "chatcmpl-r1", .model = "smol", .created = 1700000000};
    router_oai_buf_t b = {0};
    router_oai_chunk(&b, &chat, true, "Hel", 3, NULL, NULL, false);
    cr_assert_eq(strcmp(b.p + b.n - 2, "\n\n"), 0);
    cJSON *j = parsed(&b, "data: ");
    cr_assert_str_eq(at(j, "object")->valuestring, "chat.completion.chunk");
    cr_assert_str_eq(at(j, "id")->valuestring, "chatcmpl-r1");
    cr_assert_eq(at(j, "created")->valuedouble, 1700000000);
    cr_assert_str_eq(at(j, "choices.0.delta.role")->valuestring, "assistant");
    cr_assert_str_eq(at(j, "choices.0.delta.content")->valuestring, "Hel");
    cr_assert(cJSON_IsNull(at(j, "choices.0.finish_reason")));
    cr_assert_null(cJSON_GetObjectItem(j, "usage"));
    cJSON_Delete(j);
    b.n = 0;
    router_oai_chunk(&b, &chat, false, "", 0, NULL, "length", true);
    j = parsed(&b, "data: ");
    cr_assert_null(at(j, "choices.0.delta")->child, "the last chunk's delta is {}: %s", b.p);
    cr_assert_str_eq(at(j, "choices.0.finish_reason")->valuestring, "length");
    cr_assert(cJSON_IsNull(at(j, "usage")));
    cJSON_Delete(j);
    b.n = 0;
    router_oai_usage_t u = {.prompt_tokens = 10, .completion_tokens = 4, .cached_tokens = 2};
    router_oai_usage_chunk(&b, &chat, &u);
    j = parsed(&b, "data: ");
    cr_assert_eq(cJSON_GetArraySize(at(j, "choices")), 0);
    cr_assert_eq(at(j, "usage.total_tokens")->valuedouble, 14);
    cr_assert_eq(at(j, "usage.prompt_tokens_details.cached_tokens")->valuedouble, 2);
    cr_assert_null(cJSON_GetObjectItem(at(j, "usage"), "migrations"), "OpenAI's usage unless it moved: %s", b.p);
    cJSON_Delete(j);
    b.n = 0;
    u.migrations = 2; /* a stream that moved: tandem's own field */
    router_oai_usage_chunk(&b, &chat, &u);
    j = parsed(&b, "data: ");
    cr_assert_eq(at(j, "usage.migrations")->valuedouble, 2);
    cr_assert_eq(at(j, "usage.prompt_tokens_details.cached_tokens")->valuedouble, 2);
    cJSON_Delete(j);
    b.n = 0;
    router_oai_resp_t cmpl = {.kind = ROUTER_OAI_COMPLETIONS, .id = "cmpl-r2", .model = "smol", .created = 5};
    router_oai_chunk(&b, &cmpl, true, "a\"b", 3, NULL, "stop", false);
    j = parsed(&b, "data: ");
    cr_assert_str_eq(at(j, "object")->valuestring, "text_completion");
    cr_assert_str_eq(at(j, "choices.0.text")->valuestring, "a\"b");
    cr_assert_str_eq(at(j, "choices.0.finish_reason")->valuestring, "stop");
    cJSON_Delete(j);
    b.n = 0;
    router_oai_done(&b);
    cr_assert_str_eq(b.p, "data: [DONE]\n\n");
    router_oai_buf_free(&b);
}

Test(router_openai, whole_responses_errors_models)
{
    router_oai_buf_t b = {0};
    router_oai_usage_t u = {.prompt_tokens = 3, .completion_tokens = 2};
    router_oai_resp_t chat = {.kind = ROUTER_OAI_CHAT, .id = "chatcmpl-x", .model = "smol", .created = 9};
    router_oai_response(&b, &chat, "Paris.", 6, NULL, "stop", &u);
    cJSON *j = parsed(&b, "");
    cr_assert_str_eq(at(j, "object")->valuestring, "chat.completion");
    cr_assert_str_eq(at(j, "choices.0.message.role")->valuestring, "assistant");
    cr_assert_str_eq(at(j, "choices.0.message.content")->valuestring, "Paris.");
    cr_assert_eq(at(j, "choices.0.index")->valuedouble, 0);
    cr_assert_eq(at(j, "usage.completion_tokens")->valuedouble, 2);
    cJSON_Delete(j);
    router_oai_buf_free(&b);

    router_oai_error_t e;
    router_oai_error_from_code(8, "router: admission queue full; retry later", &e);
    cr_assert_eq(e.status, 429);
    router_oai_error_from_code(14, "no pair", &e);
    cr_assert_eq(e.status, 503);
    router_oai_error_from_code(3, "bad", &e);
    cr_assert_eq(e.status, 400);
    router_oai_error_set(&e, 400, "invalid_request_error", "temperature", "invalid_type", "temperature \"x\"");
    router_oai_error_json(&b, &e);
    j = parsed(&b, "");
    cr_assert_str_eq(at(j, "error.message")->valuestring, "temperature \"x\"");
    cr_assert_str_eq(at(j, "error.param")->valuestring, "temperature");
    cr_assert_str_eq(at(j, "error.code")->valuestring, "invalid_type");
    cJSON_Delete(j);
    router_oai_buf_free(&b);
    router_oai_error_set(&e, 404, "not_found_error", NULL, NULL, "no such path");
    router_oai_error_json(&b, &e);
    j = parsed(&b, "");
    cr_assert(cJSON_IsNull(at(j, "error.param")) && cJSON_IsNull(at(j, "error.code")));
    cJSON_Delete(j);
    router_oai_buf_free(&b);

    router_oai_models(&b, "smol", 7);
    j = parsed(&b, "");
    cr_assert_str_eq(at(j, "object")->valuestring, "list");
    cr_assert_str_eq(at(j, "data.0.id")->valuestring, "smol");
    cr_assert_str_eq(at(j, "data.0.object")->valuestring, "model");
    cJSON_Delete(j);
    router_oai_buf_free(&b);
}

/* ---- log-probabilities --------------------------------------------------------------- */

static size_t fake_text(void *ctx, int32_t id, char *buf, size_t cap)
{
    (void)ctx;
    return (size_t)snprintf(buf, cap, id == 7 ? "\xc3\xa9" : "t%d", id); /* 7: "é", two bytes */
}

Test(router_openai, logprobs_shapes)
{
    td_token_logprob_t lps[2] = {{.token = 5, .logprob = -0.5f, .n_top = 2,
                                  .top = {{.token = 5, .logprob = -0.5f}, {.token = 7, .logprob = -1.25f}}},
                                 {.token = 7, .logprob = -INFINITY, .n_top = 0}};
    router_oai_buf_t b = {0};
    size_t end = router_oai_logprobs(&b, ROUTER_OAI_COMPLETIONS, lps, 2, true, 10, fake_text, NULL);
    cr_assert_eq(end, 10 + 2 + 2, "text offsets run over the tokens' texts");
    cJSON *j = parsed(&b, "");
    cr_assert_str_eq(at(j, "tokens.0")->valuestring, "t5");
    cr_assert_str_eq(at(j, "tokens.1")->valuestring, "\xc3\xa9");
    cr_assert(cJSON_IsNull(at(j, "token_logprobs.0")), "echo: the prompt's first token has no logprob");
    cr_assert_eq(at(j, "token_logprobs.1")->valuedouble, -9999.0, "-inf is not JSON");
    cr_assert(cJSON_IsNull(at(j, "top_logprobs.0")));
    cr_assert_eq(cJSON_GetArraySize(at(j, "top_logprobs.1")), 0);
    cr_assert_eq(at(j, "text_offset.0")->valuedouble, 10);
    cr_assert_eq(at(j, "text_offset.1")->valuedouble, 12);
    cJSON_Delete(j);
    b.n = 0;
    router_oai_logprobs(&b, ROUTER_OAI_CHAT, lps, 1, false, 0, fake_text, NULL);
    j = parsed(&b, "");
    cr_assert_str_eq(at(j, "content.0.token")->valuestring, "t5");
    cr_assert_float_eq(at(j, "content.0.logprob")->valuedouble, -0.5, 1e-9);
    cr_assert_eq(at(j, "content.0.bytes.1")->valuedouble, '5');
    cr_assert_str_eq(at(j, "content.0.top_logprobs.1.token")->valuestring, "\xc3\xa9");
    cr_assert_eq(at(j, "content.0.top_logprobs.1.bytes.0")->valuedouble, 0xc3);
    cr_assert_float_eq(at(j, "content.0.top_logprobs.1.logprob")->valuedouble, -1.25, 1e-9);
    cr_assert(cJSON_IsNull(at(j, "refusal")));
    cJSON_Delete(j);
    /* carried in a chunk and a whole response */
    char lp[256];
    snprintf(lp, sizeof lp, "%s", b.p);
    router_oai_resp_t chat = {.kind = ROUTER_OAI_CHAT, .id = "chatcmpl-l", .model = "m", .created = 1};
    b.n = 0;
    router_oai_chunk(&b, &chat, true, "t5", 2, lp, NULL, false);
    j = parsed(&b, "data: ");
    cr_assert_str_eq(at(j, "choices.0.logprobs.content.0.token")->valuestring, "t5");
    cJSON_Delete(j);
    b.n = 0;
    router_oai_usage_t u = {.prompt_tokens = 1, .completion_tokens = 1};
    router_oai_response(&b, &chat, "t5", 2, lp, "length", &u);
    j = parsed(&b, "");
    cr_assert_str_eq(at(j, "choices.0.logprobs.content.0.top_logprobs.0.token")->valuestring, "t5");
    cJSON_Delete(j);
    router_oai_buf_free(&b);
}
