/*
 * Tests of td_gram: each compiler's language on strings it must accept and refuse (regexes
 * also against PCRE2 on random strings), the refusals of unsupported features by name,
 * hostile inputs (deep nesting, huge repetition, left recursion, rules that never end)
 * as errors, the state's copy and serialization round trip, and, the heart of it, the
 * fast token mask against a plain reference (each token's bytes run through a fresh copy
 * of the state) at every step of many seeded random walks, over a synthetic vocabulary and,
 * with TANDEM_TEST_GGUF, SmolLM2's 49,152 tokens. Walks that end are checked for what the
 * grammar promised: JSON that parses (cJSON) and validates against its schema (a small
 * validator below, written apart from the compiler), a regex's full match (PCRE2).
 */
#include <criterion/criterion.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "td_constrain.h"
#include "td_gram.h"
#include "td_rng.h"
#include "td_tokenizer.h"

static td_gram_t *compile(td_gram_kind_t kind, const char *src)
{
    td_gram_t *g = NULL;
    td_status_t st = td_gram_compile(kind, src, strlen(src), &g);
    cr_assert_eq(st, TD_OK, "%s %s: %s", td_gram_kind_name(kind), src, td_last_error());
    return g;
}

/* Whether g accepts exactly the string s. */
static bool matches(td_gram_t *g, const char *s, size_t len)
{
    td_gram_state_t *st;
    cr_assert_eq(td_gram_state_create(g, &st), TD_OK);
    bool ok = td_gram_accept_bytes(st, s, len) == TD_OK && td_gram_can_end(st);
    td_gram_state_destroy(st);
    return ok;
}

static void expect(td_gram_kind_t kind, const char *src, const char *const *yes, const char *const *no)
{
    td_gram_t *g = compile(kind, src);
    for (; yes && *yes; yes++)
        cr_expect(matches(g, *yes, strlen(*yes)), "%s %s should accept %s\n%s", td_gram_kind_name(kind), src,
                  *yes, td_gram_source(g));
    for (; no && *no; no++)
        cr_expect(!matches(g, *no, strlen(*no)), "%s %s should refuse %s\n%s", td_gram_kind_name(kind), src, *no,
                  td_gram_source(g));
    td_gram_unref(g);
}

#define L(...) ((const char *const[]){__VA_ARGS__, NULL})

Test(gram, gbnf_language)
{
    expect(TD_GRAM_GBNF, "root ::= \"a\" | \"bc\"", L("a", "bc"), L("", "b", "abc", "ab"));
    expect(TD_GRAM_GBNF, "root ::= x+ \"!\"\nx ::= [a-c]", L("a!", "abcabc!"), L("!", "ad!", "a"));
    expect(TD_GRAM_GBNF, "root ::= \"a\"{2,3} [^x]? # comment\n", L("aa", "aaa", "aab", "aaay", "aaé"),
           L("a", "aaaaa", "aax", "aaaax"));
    expect(TD_GRAM_GBNF, "root ::= (\"x\" | \"y\")* \"z\"{2,}", L("zz", "xyxzzz"), L("z", "xz", "zzx"));
    expect(TD_GRAM_GBNF, "root ::= [\\u00e0-\\u00ff] \"\\n\" \"\\x41\"", L("é\nA", "ÿ\nA"), L("e\nA", "ß\nA"));
    expect(TD_GRAM_GBNF, "root ::= . .", L("ab", "é€", "😀x"), L("a", "\xff\xfe", "\xc3"));
    expect(TD_GRAM_GBNF, "root ::= [^a-z\\]]{3}", L("ABC", "€€€", "1 2"), L("AbC", "A]C"));
    expect(TD_GRAM_GBNF, "root ::= a\na ::= \"(\" a \")\" | \"\"", L("", "()", "((()))"), L("(", "())"));
    expect(TD_GRAM_GBNF, "root ::= \"a\" |\n  \"b\"\n", L("a", "b"), L("ab"));
    expect(TD_GRAM_GBNF, "root ::= (\n \"a\"\n | \"b\" )", L("a", "b"), L(""));
}

Test(gram, regex_language)
{
    expect(TD_GRAM_REGEX, "^[a-z]+@[a-z]+\\.com$", L("ab@cd.com"), L("ab@cd.org", "@cd.com", "AB@cd.com"));
    expect(TD_GRAM_REGEX, "\\d{3}-\\d{4}", L("555-1234"), L("55-1234", "555-12345", "abc-defg"));
    expect(TD_GRAM_REGEX, "(?:yes|no)(, (?P<x>maybe))?", L("yes", "no, maybe"), L("yesno", "maybe"));
    expect(TD_GRAM_REGEX, "a.c\\s\\S\\W", L("abc x!", "a€c\ty-"), L("a\nc x!", "abc  !", "abc xa"));
    expect(TD_GRAM_REGEX, "[^0-9\\s]+?z{0,2}", L("ab", "abzz", "é"), L("a1", "a b", ""));
    expect(TD_GRAM_REGEX, "x{2,}|\\{\\}", L("xx", "xxxx", "{}"), L("x", "{"));
}

Test(gram, choice_language)
{
    expect(TD_GRAM_CHOICE, "[\"red\", \"green\", \"re\\\"d\\n\"]", L("red", "green", "re\"d\n"), L("re", "blue", "redgreen"));
}

Test(gram, json_object_language)
{
    expect(TD_GRAM_JSON_OBJECT, "",
           L("{}", "{\"a\": 1}", "{ \"a\" : [1, 2.5e-3, true, null, {\"b\": \"x\\u00e9\\n\"}] }", "{\"\": -0.5}"),
           L("", "[]", "{a: 1}", "{\"a\": 01}", "{\"a\": 1,}", "{\"a\" 1}", "\"x\"", "{\"a\": tru}",
             "{                         }"));
}

Test(gram, json_schema_language)
{
    const char *person = "{\"type\":\"object\",\"properties\":{"
                         "\"name\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":8},"
                         "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
                         "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\"]},\"minItems\":1,\"maxItems\":2},"
                         "\"email\":{\"type\":[\"string\",\"null\"],\"format\":\"email\"}},"
                         "\"required\":[\"name\",\"age\"]}";
    expect(TD_GRAM_JSON_SCHEMA, person,
           L("{\"name\":\"Al\",\"age\":30}", "{ \"name\": \"Bo\", \"age\": 150, \"tags\": [\"a\", \"b\"] }",
             "{\"name\":\"x\",\"age\":0,\"email\":null}", "{\"name\":\"x\",\"age\":7,\"email\":\"a@b.co\"}",
             "{\"name\":\"x\",\"age\":7,\"tags\":[\"b\"],\"email\":\"a.b@c.d.e\"}"),
           L("{\"age\":30}", "{\"name\":\"Al\"}", "{\"name\":\"\",\"age\":1}", "{\"name\":\"Al\",\"age\":151}",
             "{\"name\":\"Al\",\"age\":-1}", "{\"name\":\"Al\",\"age\":1,\"tags\":[]}",
             "{\"name\":\"Al\",\"age\":1,\"tags\":[\"a\",\"b\",\"a\"]}", "{\"name\":\"Al\",\"age\":1,\"x\":1}",
             "{\"age\":1,\"name\":\"Al\"}", "{\"name\":\"Al\",\"age\":1,\"email\":\"nope\"}",
             "{\"name\":\"Al\",\"age\":01}"));
    expect(TD_GRAM_JSON_SCHEMA, "{\"type\":\"integer\",\"minimum\":-15,\"exclusiveMaximum\":120}",
           L("-15", "-9", "0", "7", "99", "119"), L("-16", "-0", "120", "1000", "00", "-"));
    expect(TD_GRAM_JSON_SCHEMA, "{\"type\":\"integer\",\"minimum\":1234}", L("1234", "1299", "9999", "12345", "1000000"),
           L("1233", "999", "0", "-5"));
    expect(TD_GRAM_JSON_SCHEMA, "{\"type\":\"integer\",\"maximum\":-20}", L("-20", "-21", "-100000"),
           L("-19", "0", "20"));
    expect(TD_GRAM_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"date-time\"}",
           L("\"2024-02-29T13:45:00Z\"", "\"1999-12-31T23:59:59.123+05:30\""),
           L("\"2024-13-01T00:00:00Z\"", "\"2024-01-01 00:00:00Z\"", "2024-01-01T00:00:00Z"));
    expect(TD_GRAM_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"uuid\"}",
           L("\"123e4567-e89b-12d3-a456-426614174000\""), L("\"123e4567e89b12d3a456426614174000\""));
    expect(TD_GRAM_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}\\\\d+$\"}", L("\"AB1\"", "\"XY123\""),
           L("\"A1\"", "\"ab1\"", "AB1"));
    expect(TD_GRAM_JSON_SCHEMA,
           "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"const\":1},"
           "\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/node\"},{\"type\":\"null\"}]}},\"required\":[\"v\",\"next\"]}},"
           "\"$ref\":\"#/$defs/node\"}",
           L("{\"v\":1,\"next\":null}", "{\"v\":1,\"next\":{\"v\":1,\"next\":null}}"),
           L("{\"v\":2,\"next\":null}", "{\"v\":1}"));
    expect(TD_GRAM_JSON_SCHEMA,
           "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"boolean\"},\"b\":{\"type\":\"number\"}},"
           "\"additionalProperties\":{\"type\":\"integer\"}}",
           L("{}", "{\"b\":1.5}", "{\"a\":true,\"zz\":3}", "{\"q\":1,\"r\":2}"),
           L("{\"zz\":\"s\"}", "{\"b\":1,\"a\":true}"));
    expect(TD_GRAM_JSON_SCHEMA, "{\"type\":\"number\",\"minimum\":0,\"nullable\":true}", L("0", "1.5", "2e3", "null"),
           L("-1", "\"1\""));
    expect(TD_GRAM_JSON_SCHEMA, "{\"oneOf\":[{\"type\":\"string\",\"enum\":[\"x\"]},{\"type\":\"array\",\"items\":{\"type\":\"boolean\"}}]}",
           L("\"x\"", "[]", "[true, false]"), L("\"y\"", "[1]"));
    expect(TD_GRAM_JSON_SCHEMA, "{}", L("1", "\"s\"", "{\"a\":[null]}"), L("", "x"));
}

/* ---- refusals and hostile input ---------------------------------------------------------- */

static void refused(td_gram_kind_t kind, const char *src, td_status_t want, const char *in_message)
{
    td_gram_t *g = NULL;
    td_clear_error();
    td_status_t st = td_gram_compile(kind, src, strlen(src), &g);
    cr_expect_eq(st, want, "%s %.80s: got %s (%s), want %s", td_gram_kind_name(kind), src, td_status_name(st),
                 td_last_error(), td_status_name(want));
    cr_expect(strstr(td_last_error(), in_message), "%s %.80s: message \"%s\" should name \"%s\"",
              td_gram_kind_name(kind), src, td_last_error(), in_message);
    if (st == TD_OK)
        td_gram_unref(g);
}

Test(gram, schema_refusals_name_the_keyword_and_path)
{
    refused(TD_GRAM_JSON_SCHEMA, "{\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"number\",\"multipleOf\":2}}}",
            TD_ERR_UNSUPPORTED, "$.properties.n.multipleOf: keyword \"multipleOf\"");
    refused(TD_GRAM_JSON_SCHEMA, "{\"type\":\"array\",\"uniqueItems\":true}", TD_ERR_UNSUPPORTED, "$.uniqueItems");
    refused(TD_GRAM_JSON_SCHEMA, "{\"type\":\"object\",\"patternProperties\":{}}", TD_ERR_UNSUPPORTED, "patternProperties");
    refused(TD_GRAM_JSON_SCHEMA, "{\"if\":{},\"then\":{}}", TD_ERR_UNSUPPORTED, "keyword \"if\"");
    refused(TD_GRAM_JSON_SCHEMA, "{\"allOf\":[{},{}]}", TD_ERR_UNSUPPORTED, "allOf");
    refused(TD_GRAM_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"ipv4\"}", TD_ERR_UNSUPPORTED, "format \"ipv4\"");
    refused(TD_GRAM_JSON_SCHEMA, "{\"type\":\"number\",\"maximum\":3.5}", TD_ERR_UNSUPPORTED, "$.maximum");
    refused(TD_GRAM_JSON_SCHEMA, "{\"$ref\":\"http://x/y\"}", TD_ERR_UNSUPPORTED, "$ref");
    refused(TD_GRAM_JSON_SCHEMA, "{\"$ref\":\"#/$defs/nope\"}", TD_ERR_INVALID, "no such definition");
    refused(TD_GRAM_JSON_SCHEMA, "{\"type\":\"items\"}", TD_ERR_FORMAT, "unknown type");
    refused(TD_GRAM_JSON_SCHEMA, "{\"type\":\"array\",\"items\":[{}]}", TD_ERR_UNSUPPORTED, "prefixItems");
    refused(TD_GRAM_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"(?=x)\"}", TD_ERR_UNSUPPORTED, "$.pattern");
    refused(TD_GRAM_JSON_SCHEMA, "{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", TD_ERR_INVALID, "no integer");
    refused(TD_GRAM_JSON_SCHEMA, "{\"type\":", TD_ERR_FORMAT, "not valid JSON");
    refused(TD_GRAM_REGEX, "(a)\\1", TD_ERR_UNSUPPORTED, "backreferences");
    refused(TD_GRAM_REGEX, "a\\bb", TD_ERR_UNSUPPORTED, "word boundaries");
    refused(TD_GRAM_REGEX, "a(?!b)", TD_ERR_UNSUPPORTED, "lookaround");
    refused(TD_GRAM_REGEX, "a^b", TD_ERR_UNSUPPORTED, "anchors");
    refused(TD_GRAM_REGEX, "(ab", TD_ERR_FORMAT, "not closed");
    refused(TD_GRAM_REGEX, "ab)", TD_ERR_FORMAT, "without its (");
    refused(TD_GRAM_REGEX, "a**", TD_ERR_FORMAT, "two quantifiers");
    refused(TD_GRAM_CHOICE, "[]", TD_ERR_FORMAT, "1 to");
    refused(TD_GRAM_CHOICE, "[\"a\", 3]", TD_ERR_FORMAT, "item 1");
    refused(TD_GRAM_GBNF, "root ::= x", TD_ERR_INVALID, "rule x is used but never defined");
    refused(TD_GRAM_GBNF, "start ::= \"a\"", TD_ERR_INVALID, "no rule named root");
    refused(TD_GRAM_GBNF, "root ::= \"a\"\nroot ::= \"b\"", TD_ERR_FORMAT, "defined twice");
    refused(TD_GRAM_GBNF, "root ::= \"a", TD_ERR_FORMAT, "line 1");
    refused(TD_GRAM_GBNF, "root ::= [a-", TD_ERR_FORMAT, "line 1");
    refused(TD_GRAM_GBNF, "root ::= \"\\q\"", TD_ERR_FORMAT, "unknown escape");
    refused(TD_GRAM_GBNF, "root ::= [^\\u0000-\\U0010FFFF]", TD_ERR_INVALID, "can never end");
}

Test(gram, hostile_inputs_are_errors)
{
    /* left recursion, direct and through a nullable prefix and another rule */
    refused(TD_GRAM_GBNF, "root ::= root \"a\" | \"b\"", TD_ERR_INVALID, "left-recursive");
    refused(TD_GRAM_GBNF, "root ::= e root \"a\" | \"b\"\ne ::= \"x\"?", TD_ERR_INVALID, "left-recursive");
    refused(TD_GRAM_GBNF, "root ::= x\nx ::= y \"a\"\ny ::= x | \"b\"", TD_ERR_INVALID, "left-recursive");
    refused(TD_GRAM_GBNF, "root ::= (root)* \"a\"", TD_ERR_INVALID, "left-recursive");
    /* no way to end */
    refused(TD_GRAM_GBNF, "root ::= \"a\" root", TD_ERR_INVALID, "can never end");
    refused(TD_GRAM_GBNF, "root ::= \"a\" | \"b\" x\nx ::= \"c\" x", TD_ERR_INVALID, "rule x can never end");
    /* repetition counts and expansion */
    refused(TD_GRAM_GBNF, "root ::= \"a\"{1000001}", TD_ERR_RANGE, "repetition count");
    refused(TD_GRAM_REGEX, "a{5000}", TD_ERR_RANGE, "repetition");
    char many[1024] = "root ::=";
    for (int i = 0; i < 25; i++)
        strcat(many, " \"a\"{0,1000}");
    refused(TD_GRAM_GBNF, many, TD_ERR_RANGE, "more than 20000 rules");
    /* huge languages from small grammars are fine: nested groups each become one rule */
    td_gram_t *big = compile(TD_GRAM_GBNF, "root ::= ((((\"a\"{1000}){1000}){1000}){1000}){1000}");
    cr_expect(!matches(big, "aaaa", 4));
    td_gram_unref(big);
    /* a repeated group that can be empty would loop without reading a byte */
    refused(TD_GRAM_GBNF, "root ::= (\"a\"* \"b\"?)*", TD_ERR_INVALID, "can match the empty string");
    refused(TD_GRAM_REGEX, "(a?)*", TD_ERR_INVALID, "can match the empty string");
    /* nesting */
    char *deep = malloc(200000);
    size_t n = (size_t)sprintf(deep, "root ::= ");
    for (int i = 0; i < 5000; i++)
        deep[n++] = '(';
    deep[n++] = '"', deep[n++] = 'a', deep[n++] = '"';
    for (int i = 0; i < 5000; i++)
        deep[n++] = ')';
    deep[n] = 0;
    refused(TD_GRAM_GBNF, deep, TD_ERR_RANGE, "nested");
    n = 0;
    for (int i = 0; i < 500; i++) /* cJSON's own limit is 1000 */
        n += (size_t)sprintf(deep + n, "{\"items\":");
    n += (size_t)sprintf(deep + n, "{}");
    for (int i = 0; i < 500; i++)
        deep[n++] = '}';
    deep[n] = 0;
    refused(TD_GRAM_JSON_SCHEMA, deep, TD_ERR_RANGE, "nested");
    n = 0;
    for (int i = 0; i < 5000; i++)
        deep[n++] = '(';
    for (int i = 0; i < 5000; i++)
        deep[n++] = ')';
    deep[n] = 0;
    refused(TD_GRAM_REGEX, deep, TD_ERR_RANGE, "nested");
    free(deep);
    /* ambiguity: (a|a|a)* keeps one stack per distinct position, not 3^n */
    td_gram_t *g = compile(TD_GRAM_GBNF, "root ::= (\"a\" | \"a\" | [a-b])* \"a\"* \"a\"*");
    char as[2001];
    memset(as, 'a', 2000);
    as[2000] = 0;
    cr_expect(matches(g, as, 2000));
    td_gram_unref(g);
}

/* ---- states ------------------------------------------------------------------------------- */

Test(gram, state_copy_and_serialization_round_trip)
{
    td_gram_t *g = compile(TD_GRAM_JSON_OBJECT, "");
    td_gram_t *other = compile(TD_GRAM_REGEX, "abc");
    td_gram_state_t *s;
    cr_assert_eq(td_gram_state_create(g, &s), TD_OK);
    const char *prefix = "{\"a\": [1, {\"b\": \"x";
    cr_assert_eq(td_gram_accept_bytes(s, prefix, strlen(prefix)), TD_OK);
    cr_assert_eq(td_gram_accept_bytes(s, "y\x01", 2), TD_ERR_INVALID, "a control byte is refused in a string");
    cr_assert_eq(td_gram_accept_bytes(s, "\"x", 2), TD_ERR_INVALID, "and changes nothing: \"x is refused");
    uint8_t *buf;
    size_t len;
    cr_assert_eq(td_gram_state_serialize(s, &buf, &len), TD_OK);
    td_gram_state_t *r, *c;
    cr_assert_eq(td_gram_state_deserialize(g, buf, len, &r), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_gram_state_copy(s, &c), TD_OK);
    uint8_t *buf2;
    size_t len2;
    cr_assert_eq(td_gram_state_serialize(r, &buf2, &len2), TD_OK);
    cr_assert(len2 == len && !memcmp(buf, buf2, len), "serialize(deserialize(x)) == x");
    free(buf2);
    const char *rest = "\"}]}";
    for (td_gram_state_t *x = s;; x = x == s ? r : c) {
        cr_assert_eq(td_gram_accept_bytes(x, rest, strlen(rest)), TD_OK);
        cr_assert(td_gram_can_end(x) && td_gram_is_done(x));
        if (x == c)
            break;
    }
    td_gram_state_t *bad;
    cr_expect_eq(td_gram_state_deserialize(other, buf, len, &bad), TD_ERR_MISMATCH);
    for (size_t cut = 0; cut < len; cut++)
        cr_expect_neq(td_gram_state_deserialize(g, buf, cut, &bad), TD_OK, "truncated at %zu", cut);
    buf[len - 1] ^= 0x7f; /* a position that is not a byte set of g */
    buf[len - 2] ^= 0x7f;
    cr_expect_eq(td_gram_state_deserialize(g, buf, len, &bad), TD_ERR_FORMAT);
    free(buf);
    td_gram_state_destroy(s);
    td_gram_state_destroy(r);
    td_gram_state_destroy(c);
    td_gram_unref(other);
    td_gram_unref(g);
}

/* ---- token masks against the reference --------------------------------------------------- */

typedef struct vocab {
    int32_t n;
    char **bytes;
    size_t *len;
    uint8_t *kind;
    td_gram_vocab_t *v;
} vocab_t;

static void vocab_build(vocab_t *vb)
{
    cr_assert_eq(td_gram_vocab_create(vb->n, (const char *const *)vb->bytes, vb->len, vb->kind, &vb->v), TD_OK,
                 "%s", td_last_error());
}

static void vocab_free(vocab_t *vb)
{
    for (int32_t i = 0; i < vb->n; i++)
        free(vb->bytes[i]);
    free(vb->bytes);
    free(vb->len);
    free(vb->kind);
    td_gram_vocab_destroy(vb->v);
}

/* Every byte alone, then random strings over JSON's and regexes' characters and pieces of
 * multi-byte UTF-8, then an empty token, a special and an EOS. Shared prefixes abound. */
static void vocab_synthetic(vocab_t *vb, int32_t n_random, uint64_t seed)
{
    static const char *const pieces[] = {"{", "}", "[", "]", "\"", ":", ",", " ", "\n", "\\", "u", "0", "1", "9",
                                         "-", ".", "e", "a", "b", "z", "A", "Z", "@", "_", "true", "false",
                                         "null", "T", "\t", "\xc3", "\xa9", "\xe2\x82", "\xac", "\xf0\x9f",
                                         "x", "ye", "s", "no", "!", "\": ", "\", \"", "{\"", "\"}"};
    const int np = (int)(sizeof pieces / sizeof pieces[0]);
    vb->n = 256 + n_random + 3;
    vb->bytes = calloc((size_t)vb->n, sizeof *vb->bytes);
    vb->len = calloc((size_t)vb->n, sizeof *vb->len);
    vb->kind = calloc((size_t)vb->n, 1);
    uint64_t x = seed;
    for (int32_t i = 0; i < vb->n; i++) {
        char buf[64];
        size_t n = 0;
        if (i < 256) {
            buf[n++] = (char)i;
        } else if (i < 256 + n_random) {
            int k = 1 + (int)(td_splitmix64(&x) % 4);
            for (int j = 0; j < k; j++) {
                const char *p = pieces[td_splitmix64(&x) % (uint64_t)np];
                size_t pl = strlen(p);
                if (n + pl < sizeof buf)
                    memcpy(buf + n, p, pl), n += pl;
            }
        } else if (i == vb->n - 2) {
            memcpy(buf, "<|special|>", 11), n = 11;
            vb->kind[i] = TD_GRAM_TOK_SPECIAL;
        } else if (i == vb->n - 1) {
            memcpy(buf, "</s>", 4), n = 4;
            vb->kind[i] = TD_GRAM_TOK_EOS;
        }
        vb->bytes[i] = malloc(n + 1);
        memcpy(vb->bytes[i], buf, n);
        vb->len[i] = n;
    }
    vocab_build(vb);
}

/* SmolLM2's vocabulary from the GGUF named by TANDEM_TEST_GGUF; false when unset. */
static bool vocab_smollm2(vocab_t *vb)
{
    const char *path = getenv("TANDEM_TEST_GGUF");
    if (!path || !*path)
        return false;
    td_tokenizer_t *tok;
    cr_assert_eq(td_tokenizer_load(path, &tok), TD_OK, "%s", td_last_error());
    vb->n = td_tokenizer_vocab_size(tok);
    vb->bytes = calloc((size_t)vb->n, sizeof *vb->bytes);
    vb->len = calloc((size_t)vb->n, sizeof *vb->len);
    vb->kind = calloc((size_t)vb->n, 1);
    for (int32_t i = 0; i < vb->n; i++) {
        size_t len = 0;
        const char *b = td_tokenizer_token_bytes(tok, i, &len);
        vb->bytes[i] = malloc(len + 1);
        if (b)
            memcpy(vb->bytes[i], b, len);
        vb->len[i] = b ? len : 0;
        vb->kind[i] = td_tokenizer_is_eos(tok, i) ? TD_GRAM_TOK_EOS
                      : td_tokenizer_is_special(tok, i) ? TD_GRAM_TOK_SPECIAL : TD_GRAM_TOK_TEXT;
    }
    td_tokenizer_destroy(tok);
    vocab_build(vb);
    return true;
}

/* The plain reference: each token's bytes through a fresh copy of the state. */
static void reference_mask(const vocab_t *vb, const td_gram_state_t *s, uint32_t *mask)
{
    memset(mask, 0, td_gram_mask_words(vb->n) * sizeof *mask);
    for (int32_t i = 0; i < vb->n; i++) {
        bool ok;
        if (vb->kind[i] == TD_GRAM_TOK_EOS) {
            ok = td_gram_can_end(s);
        } else if (vb->kind[i] == TD_GRAM_TOK_SPECIAL || vb->len[i] == 0) {
            ok = false;
        } else {
            td_gram_state_t *c;
            cr_assert_eq(td_gram_state_copy(s, &c), TD_OK);
            ok = td_gram_accept_bytes(c, vb->bytes[i], vb->len[i]) == TD_OK;
            td_gram_state_destroy(c);
        }
        if (ok)
            mask[i >> 5] |= 1u << (i & 31);
    }
}

typedef bool (*output_check_fn)(const char *src, const char *out, size_t len, char *why, size_t cap);

/*
 * n_walks seeded random walks of at most max_steps tokens: at every step the fast mask
 * must equal the reference; the next token is drawn uniformly from the allowed ones (EOS
 * with probability 1/4 when allowed, so walks end). A walk that ends is checked by check.
 * Returns how many ended.
 */
static int random_walks(const vocab_t *vb, td_gram_kind_t kind, const char *src, int n_walks, int max_steps,
                        uint64_t seed, output_check_fn check)
{
    td_gram_t *g = compile(kind, src);
    td_gram_matcher_t *m;
    cr_assert_eq(td_gram_matcher_create(g, vb->v, &m), TD_OK);
    size_t words = td_gram_mask_words(vb->n);
    uint32_t *fast = malloc(words * 4), *ref = malloc(words * 4);
    int32_t *allowed = malloc((size_t)vb->n * sizeof *allowed);
    char *out = malloc((size_t)max_steps * 64 + 64);
    uint64_t x = seed;
    int ended = 0;
    for (int w = 0; w < n_walks; w++) {
        td_gram_state_t *s;
        cr_assert_eq(td_gram_state_create(g, &s), TD_OK);
        size_t out_len = 0;
        for (int step = 0; step < max_steps; step++) {
            cr_assert_eq(td_gram_fill_mask(m, s, fast), TD_OK, "%s", td_last_error());
            reference_mask(vb, s, ref);
            for (size_t i = 0; i < words; i++) {
                if (fast[i] == ref[i])
                    continue;
                for (int b = 0; b < 32; b++) {
                    int32_t t = (int32_t)i * 32 + b;
                    if (((fast[i] ^ ref[i]) >> b) & 1)
                        cr_assert_fail("%s %.60s walk %d step %d after \"%.*s\": token %d \"%.*s\" fast %d reference %d",
                                       td_gram_kind_name(kind), src, w, step, (int)out_len, out, t, (int)vb->len[t],
                                       vb->bytes[t], (fast[i] >> b) & 1, (ref[i] >> b) & 1);
                }
            }
            int32_t n_allowed = 0, eos = -1;
            for (int32_t t = 0; t < vb->n; t++)
                if ((fast[t >> 5] >> (t & 31)) & 1) {
                    if (vb->kind[t] == TD_GRAM_TOK_EOS)
                        eos = t;
                    else
                        allowed[n_allowed++] = t;
                }
            cr_assert(n_allowed > 0 || eos >= 0, "a state with no way on and no way to end");
            if (eos >= 0 && (n_allowed == 0 || td_splitmix64(&x) % 4 == 0)) {
                cr_assert_eq(td_gram_accept_token(m, s, eos), TD_OK);
                ended++;
                if (check) {
                    char why[256] = "";
                    cr_expect(check(src, out, out_len, why, sizeof why), "%s %.80s: output \"%.*s\": %s",
                              td_gram_kind_name(kind), src, (int)out_len, out, why);
                }
                break;
            }
            int32_t t = allowed[td_splitmix64(&x) % (uint64_t)n_allowed];
            cr_assert_eq(td_gram_accept_token(m, s, t), TD_OK, "an allowed token is accepted");
            memcpy(out + out_len, vb->bytes[t], vb->len[t] < 64 ? vb->len[t] : 0);
            out_len += vb->len[t] < 64 ? vb->len[t] : 0;
        }
        td_gram_state_destroy(s);
    }
    free(fast);
    free(ref);
    free(allowed);
    free(out);
    td_gram_matcher_destroy(m);
    td_gram_unref(g);
    return ended;
}

/* ---- what a finished output must be (checks written apart from the compilers) ------------- */

static bool pcre_full(const char *re, const char *s, size_t len)
{
    int err;
    PCRE2_SIZE off;
    pcre2_code *c = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_ANCHORED | PCRE2_ENDANCHORED, &err,
                                  &off, NULL);
    cr_assert(c, "pcre2 cannot compile %s", re);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(c, NULL);
    int rc = pcre2_match(c, (PCRE2_SPTR)s, len, 0, 0, md, NULL);
    pcre2_match_data_free(md);
    pcre2_code_free(c);
    return rc >= 0;
}

static bool check_regex(const char *src, const char *out, size_t len, char *why, size_t cap)
{
    snprintf(why, cap, "PCRE2 does not match it whole");
    return pcre_full(src, out, len);
}

static size_t utf8_chars(const char *s)
{
    size_t n = 0;
    for (; *s; s++)
        n += ((unsigned char)*s & 0xc0) != 0x80;
    return n;
}

/* A JSON Schema validator for the supported subset. */
static bool valid(const cJSON *root, const cJSON *sch, const cJSON *v, char *why, size_t cap)
{
    if (cJSON_IsTrue(sch) || (cJSON_IsObject(sch) && !sch->child))
        return true;
    const cJSON *k;
    if ((k = cJSON_GetObjectItem(sch, "$ref"))) {
        const char *r = k->valuestring;
        const cJSON *t = !strcmp(r, "#") ? root : cJSON_GetObjectItem(cJSON_GetObjectItem(root, "$defs"), r + 8);
        return valid(root, t, v, why, cap);
    }
    if (cJSON_IsTrue(cJSON_GetObjectItem(sch, "nullable")) && cJSON_IsNull(v))
        return true;
    if ((k = cJSON_GetObjectItem(sch, "anyOf")) || (k = cJSON_GetObjectItem(sch, "oneOf"))) {
        for (const cJSON *a = k->child; a; a = a->next)
            if (valid(root, a, v, why, cap))
                return true;
        return snprintf(why, cap, "no alternative of anyOf/oneOf matches"), false;
    }
    if ((k = cJSON_GetObjectItem(sch, "enum"))) {
        for (const cJSON *a = k->child; a; a = a->next)
            if (cJSON_Compare(a, v, true))
                return true;
        return snprintf(why, cap, "not in enum"), false;
    }
    if ((k = cJSON_GetObjectItem(sch, "const")))
        return cJSON_Compare(k, v, true) || (snprintf(why, cap, "not the const"), false);
    const cJSON *ty = cJSON_GetObjectItem(sch, "type");
    if (ty) {
        bool any = false;
        for (const cJSON *t = cJSON_IsArray(ty) ? ty->child : ty; t && !any; t = cJSON_IsArray(ty) ? t->next : NULL) {
            const char *n = t->valuestring;
            any = (!strcmp(n, "string") && cJSON_IsString(v)) || (!strcmp(n, "boolean") && cJSON_IsBool(v)) ||
                  (!strcmp(n, "null") && cJSON_IsNull(v)) || (!strcmp(n, "object") && cJSON_IsObject(v)) ||
                  (!strcmp(n, "array") && cJSON_IsArray(v)) || (!strcmp(n, "number") && cJSON_IsNumber(v)) ||
                  (!strcmp(n, "integer") && cJSON_IsNumber(v) && v->valuedouble == floor(v->valuedouble));
        }
        if (!any)
            return snprintf(why, cap, "wrong type"), false;
    }
    if (cJSON_IsNumber(v)) {
        double d = v->valuedouble;
        if (((k = cJSON_GetObjectItem(sch, "minimum")) && d < k->valuedouble) ||
            ((k = cJSON_GetObjectItem(sch, "maximum")) && d > k->valuedouble) ||
            ((k = cJSON_GetObjectItem(sch, "exclusiveMinimum")) && d <= k->valuedouble) ||
            ((k = cJSON_GetObjectItem(sch, "exclusiveMaximum")) && d >= k->valuedouble))
            return snprintf(why, cap, "%g out of bounds", d), false;
    }
    if (cJSON_IsString(v)) {
        const char *s = v->valuestring;
        if (((k = cJSON_GetObjectItem(sch, "minLength")) && utf8_chars(s) < (size_t)k->valuedouble) ||
            ((k = cJSON_GetObjectItem(sch, "maxLength")) && utf8_chars(s) > (size_t)k->valuedouble))
            return snprintf(why, cap, "length of \"%s\"", s), false;
        if ((k = cJSON_GetObjectItem(sch, "pattern")) && !pcre_full(k->valuestring, s, strlen(s)))
            return snprintf(why, cap, "\"%s\" does not match the pattern", s), false;
        static const char *const fmts[][2] = {
            {"date", "\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\\d|3[01])"},
            {"date-time", "\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\\d|3[01])T([01]\\d|2[0-3]):[0-5]\\d:[0-5]\\d(\\.\\d+)?(Z|[+-]([01]\\d|2[0-3]):[0-5]\\d)"},
            {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
            {"email", "[^@\\s]+@[^@\\s]+\\.[^@\\s]+"}};
        if ((k = cJSON_GetObjectItem(sch, "format")))
            for (size_t i = 0; i < 4; i++)
                if (!strcmp(k->valuestring, fmts[i][0]) && !pcre_full(fmts[i][1], s, strlen(s)))
                    return snprintf(why, cap, "\"%s\" is not a %s", s, fmts[i][0]), false;
    }
    if (cJSON_IsArray(v)) {
        int n = cJSON_GetArraySize(v);
        if (((k = cJSON_GetObjectItem(sch, "minItems")) && n < k->valuedouble) ||
            ((k = cJSON_GetObjectItem(sch, "maxItems")) && n > k->valuedouble))
            return snprintf(why, cap, "%d items", n), false;
        if ((k = cJSON_GetObjectItem(sch, "items")))
            for (const cJSON *a = v->child; a; a = a->next)
                if (!valid(root, k, a, why, cap))
                    return false;
    }
    if (cJSON_IsObject(v)) {
        const cJSON *props = cJSON_GetObjectItem(sch, "properties"), *addl = cJSON_GetObjectItem(sch, "additionalProperties");
        for (const cJSON *r = cJSON_GetObjectItem(sch, "required") ? cJSON_GetObjectItem(sch, "required")->child : NULL; r;
             r = r->next)
            if (!cJSON_GetObjectItemCaseSensitive(v, r->valuestring))
                return snprintf(why, cap, "required %s missing", r->valuestring), false;
        for (const cJSON *m = v->child; m; m = m->next) {
            const cJSON *ps = props ? cJSON_GetObjectItemCaseSensitive(props, m->string) : NULL;
            if (!ps && (props || addl) && (!addl || cJSON_IsFalse(addl)))
                return snprintf(why, cap, "extra property %s", m->string), false;
            if (!valid(root, ps ? ps : addl ? addl : cJSON_GetObjectItem(root, "$no"), m, why, cap) && (ps || addl))
                return false;
        }
    }
    return true;
}

static bool check_schema(const char *src, const char *out, size_t len, char *why, size_t cap)
{
    cJSON *sch = cJSON_Parse(src), *v = cJSON_ParseWithLength(out, len);
    bool ok = v && valid(sch, sch, v, why, cap);
    if (!v)
        snprintf(why, cap, "cJSON cannot parse it");
    cJSON_Delete(sch);
    cJSON_Delete(v);
    return ok;
}

static bool check_json_object(const char *src, const char *out, size_t len, char *why, size_t cap)
{
    cJSON *v = cJSON_ParseWithLength(out, len);
    bool ok = v && cJSON_IsObject(v);
    snprintf(why, cap, "not a JSON object");
    cJSON_Delete(v);
    return ok;
}

static bool check_choice(const char *src, const char *out, size_t len, char *why, size_t cap)
{
    cJSON *a = cJSON_Parse(src);
    bool ok = false;
    for (const cJSON *c = a->child; c; c = c->next)
        ok = ok || (strlen(c->valuestring) == len && !memcmp(c->valuestring, out, len));
    snprintf(why, cap, "not one of the choices");
    cJSON_Delete(a);
    return ok;
}

static const char *const schemas[] = {
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":6},"
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},\"ok\":{\"type\":\"boolean\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\",1]},\"maxItems\":3}},\"required\":[\"name\",\"age\"]}",
    "{\"type\":\"array\",\"items\":{\"type\":[\"number\",\"null\"]},\"minItems\":1,\"maxItems\":4}",
    "{\"type\":\"object\",\"properties\":{\"when\":{\"type\":\"string\",\"format\":\"date\"},"
    "\"id\":{\"type\":\"string\",\"pattern\":\"^[a-z]{1,3}\\\\d?$\"}},\"additionalProperties\":{\"type\":\"integer\",\"maximum\":-3}}",
    "{\"$defs\":{\"t\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\",\"minimum\":-5,\"maximum\":5},"
    "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/t\"},\"maxItems\":2}},\"required\":[\"v\"]}},\"$ref\":\"#/$defs/t\"}",
    "{\"anyOf\":[{\"type\":\"string\",\"format\":\"uuid\"},{\"const\":{\"x\":[1,2]}},{\"type\":\"boolean\"}]}",
};
static const char *const regexes[] = {"[a-z]+@[a-z]+\\.(com|org)", "-?\\d{1,3}(\\.\\d+)?", "(yes|no|maybe)!*",
                                      "[^\"\\\\]{2,5}\\s\\S+", "é+[€-₿]?x{0,3}"};
static const char *const gbnfs[] = {
    "root ::= item (\", \" item)*\nitem ::= [a-z]+ | \"\\\"\" [^\"]* \"\\\"\"",
    "root ::= expr\nexpr ::= term ((\"+\" | \"-\") term)*\nterm ::= [0-9]+ | \"(\" expr \")\"",
    "root ::= (\"a\" | \"ab\" | \"abc\")* \"z\"?",
};

Test(gram, masks_equal_the_reference_synthetic_vocabulary, .timeout = 300)
{
    vocab_t vb = {0};
    vocab_synthetic(&vb, 3000, 42);
    int ended = 0;
    for (size_t i = 0; i < sizeof schemas / sizeof schemas[0]; i++)
        ended += random_walks(&vb, TD_GRAM_JSON_SCHEMA, schemas[i], 12, 60, 100 + i, check_schema);
    ended += random_walks(&vb, TD_GRAM_JSON_OBJECT, "", 12, 60, 7, check_json_object);
    for (size_t i = 0; i < sizeof regexes / sizeof regexes[0]; i++)
        ended += random_walks(&vb, TD_GRAM_REGEX, regexes[i], 12, 30, 200 + i, check_regex);
    for (size_t i = 0; i < sizeof gbnfs / sizeof gbnfs[0]; i++)
        ended += random_walks(&vb, TD_GRAM_GBNF, gbnfs[i], 12, 30, 300 + i, NULL);
    ended += random_walks(&vb, TD_GRAM_CHOICE, "[\"red\",\"green\",\"gr\\u00e9y\",\"{\\\"}\"]", 12, 30, 9, check_choice);
    cr_expect_gt(ended, 60, "%d walks ended: too few finished outputs were checked", ended);
    vocab_free(&vb);
}

Test(gram, masks_equal_the_reference_smollm2_vocabulary, .timeout = 600)
{
    vocab_t vb = {0};
    if (!vocab_smollm2(&vb))
        cr_skip_test("TANDEM_TEST_GGUF is not set (SmolLM2-135M-Instruct.Q4_1.gguf): SmolLM2's vocabulary is not checked");
    random_walks(&vb, TD_GRAM_JSON_SCHEMA, schemas[0], 2, 12, 1, check_schema);
    random_walks(&vb, TD_GRAM_JSON_SCHEMA, schemas[3], 2, 12, 2, check_schema);
    random_walks(&vb, TD_GRAM_JSON_OBJECT, "", 2, 12, 3, check_json_object);
    random_walks(&vb, TD_GRAM_REGEX, regexes[0], 2, 8, 4, check_regex);
    random_walks(&vb, TD_GRAM_GBNF, gbnfs[1], 2, 8, 5, NULL);
    vocab_free(&vb);
}

Test(gram, cache_hits_by_source)
{
    vocab_t vb = {0};
    vocab_synthetic(&vb, 100, 1);
    td_gram_cache_t *c;
    cr_assert_eq(td_gram_cache_create(vb.v, 2, &c), TD_OK);
    td_gram_matcher_t *a, *b, *d, *e;
    cr_assert_eq(td_gram_cache_get(c, TD_GRAM_REGEX, "ab", 2, &a), TD_OK);
    cr_assert_eq(td_gram_cache_get(c, TD_GRAM_REGEX, "ab", 2, &b), TD_OK);
    cr_expect_eq(a, b, "the same source is the same matcher");
    cr_assert_eq(td_gram_cache_get(c, TD_GRAM_GBNF, "root ::= \"ab\"", 13, &d), TD_OK);
    cr_expect_neq(a, d);
    cr_assert_eq(td_gram_cache_get(c, TD_GRAM_REGEX, "cd", 2, &e), TD_OK); /* evicts "ab" (least recent) */
    uint64_t hits, misses;
    td_gram_cache_stats(c, &hits, &misses);
    cr_expect(hits == 1 && misses == 3, "hits %llu misses %llu", (unsigned long long)hits, (unsigned long long)misses);
    cr_expect_eq(td_gram_cache_get(c, TD_GRAM_REGEX, "(", 1, &e), TD_ERR_FORMAT);
    td_gram_state_t *s; /* an evicted matcher still works while held */
    cr_assert_eq(td_gram_state_create(td_gram_matcher_grammar(a), &s), TD_OK);
    td_gram_state_destroy(s);
    td_gram_cache_release(c, a);
    td_gram_cache_release(c, b);
    td_gram_cache_release(c, d);
    td_gram_cache_release(c, e);
    td_gram_cache_destroy(c);
    vocab_free(&vb);
}

/* td_constrain_vocab on real vocabularies (the GGUF fixtures): byte-level pieces as their
 * bytes, SentencePiece's "▁" as a space and <0xNN> as one byte, EOS where the tokenizer says,
 * control tokens and padded ids never allowed; a grammar then allows " the"-like tokens by
 * their bytes. */
Test(gram, model_vocabulary_from_a_tokenizer)
{
    static const char *const names[] = {"smollm", "llama-spm"};
    for (size_t k = 0; k < 2; k++) {
        char path[512];
        snprintf(path, sizeof path, "%s/tests/fixtures/tokenizer/gguf/%s.gguf", TD_SOURCE_DIR, names[k]);
        td_tokenizer_t *tok;
        cr_assert_eq(td_tokenizer_load(path, &tok), TD_OK, "%s", td_last_error());
        int32_t n = td_tokenizer_vocab_size(tok), padded = n + 5, extra_eos = n - 1; /* a word: now an EOS */
        td_gram_vocab_t *v;
        cr_assert_eq(td_constrain_vocab(tok, padded, &extra_eos, 1, &v), TD_OK);
        td_gram_t *g = compile(TD_GRAM_REGEX, "[ a-z<>]+");
        td_gram_matcher_t *m;
        td_gram_state_t *s;
        cr_assert_eq(td_gram_matcher_create(g, v, &m), TD_OK);
        cr_assert_eq(td_gram_state_create(g, &s), TD_OK);
        uint32_t *mask = calloc(td_gram_mask_words(padded), 4);
        cr_assert_eq(td_gram_fill_mask(m, s, mask), TD_OK);
        int32_t n_text = 0, n_byte = 0;
        for (int32_t i = 0; i < padded; i++) {
            bool allowed = (mask[i >> 5] >> (i & 31)) & 1;
            if (i >= n || i == extra_eos || td_tokenizer_is_eos(tok, i) || td_tokenizer_is_special(tok, i)) {
                cr_expect(!allowed, "%s: token %d (special, EOS or padding) allowed at the start", names[k], i);
                continue;
            }
            size_t len;
            const char *b = td_tokenizer_token_bytes(tok, i, &len);
            bool want = len > 0;
            for (size_t j = 0; j < len; j++)
                want = want && (b[j] == ' ' || b[j] == '<' || b[j] == '>' || (b[j] >= 'a' && b[j] <= 'z'));
            cr_expect_eq(allowed, want, "%s: token %d \"%.*s\"", names[k], i, (int)len, b);
            n_text += allowed;
            size_t pl;
            const char *piece = td_tokenizer_id_to_piece(tok, i, &pl);
            if (pl == 6 && !strncmp(piece, "<0x", 3)) {
                cr_expect_eq(len, 1, "%s: byte-fallback piece %s is one byte", names[k], piece);
                n_byte++;
            }
        }
        cr_expect_gt(n_text, 100, "%s: %d tokens allowed", names[k], n_text);
        if (!strcmp(names[k], "llama-spm"))
            cr_expect_eq(n_byte, 256, "llama-spm has 256 byte-fallback pieces");
        /* after a space-led word, EOS is allowed where the regex may end */
        cr_assert_eq(td_gram_accept_bytes(s, " ab", 3), TD_OK);
        cr_assert_eq(td_gram_fill_mask(m, s, mask), TD_OK);
        cr_expect((mask[extra_eos >> 5] >> (extra_eos & 31)) & 1, "the model's EOS is allowed where it may end");
        free(mask);
        td_gram_state_destroy(s);
        td_gram_matcher_destroy(m);
        td_gram_unref(g);
        td_gram_vocab_destroy(v);
        td_tokenizer_destroy(tok);
    }
}
