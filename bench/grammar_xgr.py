#!/usr/bin/env python3
"""xgrammar's mask time on the grammars and vocabulary `tandem bench grammar --dump DIR` wrote,
by the protocol of `tandem bench grammar` (bench/bench_grammar.c), for docs/grammar.md's
side-by-side figures (bench/grammar_vs.sh runs it). A reference only: xgrammar (PyPI) is
never a dependency of tandem.

For each DIR/NAME.json: the compile time (median of 5, the compiler's cache off, one thread
as tandem's compile is), then seeded random walks (each next token uniform over the allowed
text tokens, an allowed EOS taken one time in 8, a walk restarted when it ends) timing
fill_next_token_bitmask + accept_token per token: a first pass (cold) and the same walks
again on the same compiled grammar (warm). One JSON line per grammar on stdout.

usage: grammar_xgr.py DIR [--tokens N] [--threads N]
"""
import argparse
import importlib.metadata
import json
import os
import random
import statistics
import sys
import time

import numpy as np
import xgrammar as xgr


def load_vocab(path):
    """Token bytes as tandem's grammar vocabulary has them; special tokens empty (xgrammar
    never allows an empty token), EOS ids apart."""
    toks, eos = [], []
    with open(path) as f:
        for line in f:
            i, kind, hx = line.rstrip("\n").split("\t")
            assert int(i) == len(toks)
            toks.append(bytes.fromhex(hx) if kind == "text" else b"")
            if kind == "eos":
                eos.append(int(i))
    return toks, eos


def walks(compiled, n_vocab, eos, n_tokens, seed):
    rng = random.Random(seed)
    eos_set = set(eos)
    bitmask = xgr.allocate_token_bitmask(1, n_vocab)
    m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=False)
    times = []
    while len(times) < n_tokens:
        t0 = time.perf_counter_ns()
        m.fill_next_token_bitmask(bitmask)
        t_mask = time.perf_counter_ns() - t0
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:n_vocab]
        allowed = np.flatnonzero(bits)
        text = [int(t) for t in allowed if int(t) not in eos_set]
        can_eos = len(text) < len(allowed)
        if not text or (can_eos and rng.randrange(8) == 0):  # ended: a new walk
            m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=False)
            continue
        t = text[rng.randrange(len(text))]
        t1 = time.perf_counter_ns()
        if not m.accept_token(t):
            raise SystemExit("xgrammar refused token %d that its mask allowed" % t)
        times.append(t_mask + time.perf_counter_ns() - t1)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    toks, eos = load_vocab(os.path.join(a.dir, "vocab.tsv"))
    info = xgr.TokenizerInfo(toks, vocab_type=xgr.VocabType.RAW, vocab_size=len(toks), stop_token_ids=eos)
    names = sorted(f[:-5] for f in os.listdir(a.dir)  # the dump's grammars, not grammar_vs.sh's output
                   if f.endswith(".json") and f != "tandem.json")
    for name in names:
        src = open(os.path.join(a.dir, name + ".json")).read()
        ct = []
        for _ in range(5):
            comp = xgr.GrammarCompiler(info, max_threads=a.threads, cache_enabled=False)
            t0 = time.perf_counter_ns()
            if name == "json_object":
                cg = comp.compile_builtin_json_grammar()
            else:
                cg = comp.compile_json_schema(src, strict_mode=True)
            ct.append(time.perf_counter_ns() - t0)
        cold = walks(cg, len(toks), eos, a.tokens, 12345)
        warm = walks(cg, len(toks), eos, a.tokens, 12345)
        warm_sorted = sorted(warm)
        print(json.dumps({
            "engine": "xgrammar " + importlib.metadata.version("xgrammar"),
            "name": name, "vocab": len(toks), "compile_ms": round(statistics.median(ct) * 1e-6, 3),
            "cold_us_per_token": round(sum(cold) / len(cold) * 1e-3, 1),
            "warm_us_per_token": round(sum(warm) / len(warm) * 1e-3, 1),
            "warm_p50_us": round(warm_sorted[len(warm) // 2] * 1e-3, 1),
            "warm_p99_us": round(warm_sorted[len(warm) * 99 // 100] * 1e-3, 1),
        }))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
