#!/usr/bin/python3
"""Reads what `KEEP=DIR bench/plan_validate.sh ...` kept (RATE.serve.json with per-request
results, RATE.plan.json) and prints, per rate, two checks of a planner validation
(docs/goodput.md "Validation on this machine", G and H):

- lone/fit: the median, over the requests that arrived with nothing else in the cluster
  being prefilled (unified: nothing else in flight at all), of their TTFT over the profile's
  prefill fit a + b*T + c*T^2 for their prompt length: how fast the machine ran during the
  run against the minute the profile was taken (1.0: the same);
- the measured TTFT and TPOT p90 with a bootstrap 90% interval (2000 resamples of the run's
  requests) beside the planner's prediction: an 80-request p90 is itself uncertain.

Usage: bench/plan_keep_stats.py PROFILE.json KEEPDIR [unified]
(numpy: Debian's python3-numpy, hence /usr/bin/python3)
"""
import glob
import json
import os
import statistics
import sys

import numpy as np


def lone_ratios(reqs, prefill, unified):
    a, b, c = prefill["a_s"], prefill["b_s_per_token"], prefill["c_s_per_token2"]
    ratios, busy_until, ends = [], -1.0, []
    for r in sorted(reqs, key=lambda r: r["arrival_s"]):
        t = r["input_tokens"]
        lone = all(e < r["arrival_s"] for e in ends) if unified else r["arrival_s"] > busy_until
        if lone:
            ratios.append(r["ttft_ms"] / 1000 / (a + b * t + c * t * t))
        busy_until = max(busy_until, r["arrival_s"] + r["ttft_ms"] / 1000)
        ends.append(r["arrival_s"] + r["e2el_ms"] / 1000)
    return ratios


def p90_interval(x, rng):
    boot = [np.percentile(rng.choice(x, len(x)), 90) for _ in range(2000)]
    return np.percentile(x, 90), np.percentile(boot, 5), np.percentile(boot, 95)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    prefill = json.load(open(sys.argv[1]))["prefill"]
    unified = len(sys.argv) > 3 and sys.argv[3] == "unified"
    files = sorted(glob.glob(os.path.join(sys.argv[2], "*.serve.json")))
    if not files:
        sys.exit(f"plan_keep_stats: no RATE.serve.json in {sys.argv[2]} (run plan_validate.sh with KEEP=DIR)")
    rng = np.random.default_rng(1)
    for f in files:
        m = json.load(open(f))
        p = json.load(open(f.replace(".serve.json", ".plan.json")))["simulated"]
        reqs = [r for r in m["requests"] if r["ok"]]
        lr = lone_ratios(reqs, prefill, unified)
        tt = np.array([r["ttft_ms"] for r in reqs])
        tp = np.array([r["tpot_ms"] for r in reqs if r["output_tokens"] > 1])
        a, b = p90_interval(tt, rng), p90_interval(tp, rng)
        rate = os.path.basename(f)[: -len(".serve.json")]
        print(f"rate {rate}: lone/fit {statistics.median(lr) if lr else float('nan'):.2f} ({len(lr)} requests) | "
              f"TTFT p90 {a[0]:.0f} [{a[1]:.0f}, {a[2]:.0f}] predicted {p['ttft_p90_ms']:.0f} | "
              f"TPOT p90 {b[0]:.1f} [{b[1]:.1f}, {b[2]:.1f}] predicted {p['tpot_p90_ms']:.1f}")


if __name__ == "__main__":
    main()
