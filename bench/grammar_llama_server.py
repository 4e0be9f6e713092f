#!/usr/bin/env python3
"""llama-server's decode tokens/s with and without a json_schema on the same GGUF, at batch 1
and 32, for docs/grammar.md's side-by-side figures (bench/grammar_vs.sh runs it; the peer
is a reference, never a dependency). Starts llama-server on 127.0.0.1 with 32 slots, then per
batch size `reps` rounds of (unconstrained with ignore_eos; the schema), each round `batch`
concurrent /completion requests of n_predict tokens at temperature 1 (seeded per request).
Decode tokens/s of a round: the tokens predicted over the longest request's decode time
(llama-server's own timings.predicted_ms, so prompt processing is not counted). Medians of
the rounds, one JSON line per batch size on stdout. Stops the server it started.

usage: grammar_llama_server.py --server BIN --model GGUF --schema FILE [--threads N]
                               [--n-predict N] [--reps N] [--port P]
"""
import argparse
import json
import statistics
import subprocess
import threading
import time
import urllib.request


def post(url, body, out, i):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out[i] = json.loads(r.read())


def round_tps(url, batch, n_predict, schema, seed0):
    out = [None] * batch
    ths = []
    for i in range(batch):
        body = {"prompt": "<|im_start|>user\nDescribe an order as JSON.<|im_end|>\n<|im_start|>assistant\n",
                "n_predict": n_predict, "temperature": 1.0, "seed": seed0 + i, "cache_prompt": False}
        if schema is not None:
            body["json_schema"] = schema
        else:
            body["ignore_eos"] = True
        t = threading.Thread(target=post, args=(url, body, out, i))
        t.start()
        ths.append(t)
    for t in ths:
        t.join()
    n = sum(o["timings"]["predicted_n"] for o in out)
    ms = max(o["timings"]["predicted_ms"] for o in out)
    return n / (ms * 1e-3), n / batch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--schema", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--port", type=int, default=18431)
    a = ap.parse_args()
    schema = json.load(open(a.schema))
    proc = subprocess.Popen([a.server, "-m", a.model, "-t", str(a.threads), "-np", "32", "-c", str(32 * 256),
                             "--host", "127.0.0.1", "--port", str(a.port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = "http://127.0.0.1:%d" % a.port
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if time.time() > deadline or proc.poll() is not None:
                raise SystemExit("llama-server did not become healthy in 120 s")
            time.sleep(0.5)
        for batch in (1, 32):
            free, con, lens = [], [], []
            for r in range(a.reps):
                free.append(round_tps(base + "/completion", batch, a.n_predict, None, 100 * r)[0])
                tps, mean_len = round_tps(base + "/completion", batch, a.n_predict, schema, 100 * r)
                con.append(tps)
                lens.append(mean_len)
            f, c = statistics.median(free), statistics.median(con)
            print(json.dumps({"engine": "llama-server", "batch": batch, "free_tps": round(f, 1),
                              "schema_tps": round(c, 1), "ratio": round(c / f, 3),
                              "schema_mean_tokens": round(statistics.mean(lens), 1)}))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
