"""openai_client.py: drives the router's OpenAI API with the official `openai` Python client
(tests/cluster/test_openai.sh runs it with the python of scripts/openai-venv).

    openai_client.py BASE_URL text chat|completions stream|whole MAX_TOKENS PROMPT
        prints the greedy answer's text (nothing else) after checking the response's shape:
        ids and objects, one choice, finish_reason, usage (the final usage chunk when
        streamed with include_usage)
    openai_client.py BASE_URL errors
        bad requests through the client: each must raise the right status with OpenAI's
        error body naming the parameter
    openai_client.py BASE_URL logprobs MAX_TOKENS PROMPT
        chat logprobs + top_logprobs and completions logprobs with echo: shapes and texts
    openai_client.py BASE_URL disconnect MAX_TOKENS PROMPT
        starts a streamed chat, reads two chunks and closes the connection
"""
import sys

import openai


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def text(client, model, kind, stream, max_tokens, prompt):
    common = dict(model=model, max_tokens=max_tokens, temperature=0, seed=1)
    if kind == "chat":
        call = lambda **kw: client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], **common, **kw)
        obj = "chat.completion"
    else:
        call = lambda **kw: client.completions.create(prompt=prompt, **common, **kw)
        obj = "text_completion"
    if not stream:
        r = call()
        if r.object != obj or len(r.choices) != 1 or r.choices[0].index != 0:
            fail("whole %s: object %r, choices %r" % (kind, r.object, r.choices))
        c = r.choices[0]
        out = c.message.content if kind == "chat" else c.text
        if kind == "chat" and c.message.role != "assistant":
            fail("role %r" % c.message.role)
        check_end(kind, c.finish_reason, r.usage, max_tokens)
        if not r.id.startswith("chatcmpl-" if kind == "chat" else "cmpl-"):
            fail("id %r" % r.id)
        return out
    pieces, finish, usage, ids, n_role = [], None, None, set(), 0
    for ch in call(stream=True, stream_options={"include_usage": True}):
        ids.add(ch.id)
        if ch.object != (obj + ".chunk" if kind == "chat" else obj):
            fail("chunk object %r" % ch.object)
        if ch.usage is not None:
            if ch.choices:
                fail("the usage chunk has choices")
            usage = ch.usage
            continue
        if usage is not None:
            fail("a chunk after the usage chunk")
        if len(ch.choices) != 1:
            fail("chunk with %d choices" % len(ch.choices))
        c = ch.choices[0]
        if finish is not None:
            fail("a chunk after the finish_reason")
        finish = c.finish_reason
        if kind == "chat":
            n_role += c.delta.role == "assistant"
            pieces.append(c.delta.content or "")
        else:
            pieces.append(c.text)
    if len(ids) != 1:
        fail("chunks of one stream carry ids %r" % ids)
    if kind == "chat" and n_role != 1:
        fail("role 'assistant' in %d chunks, want the first only" % n_role)
    if usage is None:
        fail("no usage chunk with include_usage")
    check_end(kind, finish, usage, max_tokens)
    return "".join(pieces)


def check_end(kind, finish, usage, max_tokens):
    if finish not in ("stop", "length"):
        fail("finish_reason %r" % finish)
    if usage is None or usage.prompt_tokens <= 0 or usage.total_tokens != usage.prompt_tokens + usage.completion_tokens:
        fail("usage %r" % usage)
    if not 0 <= usage.completion_tokens <= max_tokens or (finish == "length") != (usage.completion_tokens == max_tokens):
        fail("usage %r with finish_reason %s and max_tokens %d" % (usage, finish, max_tokens))


def errors(client, model):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ("temperature", 400, dict(temperature="hot")),
        ("top_p", 400, dict(top_p=7)),
        ("n", 400, dict(n=17)),
        ("logit_bias", 400, dict(logit_bias={"x": 5})),
        ("max_tokens", 400, dict(max_tokens=-3)),
        ("stop", 400, dict(stop=5)),
        ("top_logprobs", 400, dict(logprobs=True, top_logprobs=21)),
        ("top_logprobs", 400, dict(top_logprobs=2)),
        ("model", 400, dict(model="no-such-model")),
        ("messages", 400, dict(messages="hello")),
    ]
    for param, status, kw in cases:
        args = dict(model=model, messages=msgs, max_tokens=2)
        args.update(kw)
        try:
            client.chat.completions.create(**args)
            fail("%r was accepted" % kw)
        except openai.APIStatusError as e:
            body = e.body or {}
            if e.status_code != status or body.get("param") != param or not body.get("message"):
                fail("%r: status %d, body %r; want %d naming %s" % (kw, e.status_code, body, status, param))
    print("errors: %d bad requests refused with their parameter named" % len(cases))


def logprobs(client, model, max_tokens, prompt):
    """chat: one entry per generated token, their texts making the answer, 3 alternatives
    each, the greedy token the most likely; completions with echo: the prompt's tokens first
    (the first without a logprob), text offsets running over the returned text."""
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    lp = c.logprobs.content
    if len(lp) != r.usage.completion_tokens or "".join(e.token for e in lp) != c.message.content:
        fail("chat logprobs %r for %r" % (lp, c.message.content))
    for e in lp:
        if len(e.top_logprobs) != 3 or not e.logprob <= 0 or e.top_logprobs[0].token != e.token or \
                bytes(e.bytes).decode() != e.token:
            fail("chat logprob entry %r" % e)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2,
                                  echo=True)
    c = r.choices[0]
    l = c.logprobs
    n = r.usage.prompt_tokens + r.usage.completion_tokens
    if len(l.tokens) != n or l.token_logprobs[0] is not None or l.top_logprobs[0] is not None:
        fail("echo logprobs %r (%d tokens)" % (l, n))
    if not c.text.startswith(prompt) or "".join(l.tokens) != c.text:
        fail("echo text %r, tokens %r" % (c.text, l.tokens))
    if l.text_offset != [sum(len(t.encode()) for t in l.tokens[:i]) for i in range(n)]:
        fail("text_offset %r" % l.text_offset)
    if any(len(t) > 2 or max(t.values()) > 0 for t in l.top_logprobs[1:]):
        fail("top_logprobs %r" % l.top_logprobs)
    print("logprobs: chat %d entries, completions with echo %d" % (len(lp), n))


def disconnect(client, model, max_tokens, prompt):
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    n = 0
    for _ in stream:
        n += 1
        if n == 2:
            break
    stream.close()
    print("disconnect: closed after %d chunks" % n)


def main():
    base, what = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    if what == "text":
        kind, mode, max_tokens, prompt = sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
        sys.stdout.write(text(client, model, kind, mode == "stream", max_tokens, prompt))
    elif what == "errors":
        errors(client, model)
    elif what == "logprobs":
        logprobs(client, model, int(sys.argv[3]), sys.argv[4])
    elif what == "disconnect":
        disconnect(client, model, int(sys.argv[3]), sys.argv[4])
    else:
        fail("unknown command " + what)


if __name__ == "__main__":
    main()
