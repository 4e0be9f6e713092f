#!/usr/bin/python3
"""Plots and tables of bench/goodput_sweep.sh's results (docs/goodput.md).

    /usr/bin/python3 bench/goodput_plot.py [OUT_DIR[,OUT_DIR...] [IMG_DIR]]

Reads OUT_DIR/{disagg,unified2,unified2@32,unified1,conditional,follow}-{prefill,decode}.json (several OUT_DIRs,
comma-separated: a configuration's runs of every one, e.g. a second sweep at more rates) (`tandem bench serve
--sweep ... --result-file`), writes IMG_DIR/goodput-{mix}.png (goodput, SLO attainment, TTFT p90
and TPOT p90 against the request rate, one line per configuration) and prints markdown tables:
per rate, and per configuration the highest rate at >= the sweep's attainment and goodput per core.
Where the runs carry every request (goodput_sweep.sh DETAILED=1), the same requests are scored
again against a range of TPOT objectives at the sweep's TTFT objective (DistServe's "SLO scale"):
a table of each configuration's highest rate at >= the attainment per objective, the ratio of
the disaggregated one to the best colocated one per core (and, with a conditional or follow sweep, of
the best of those to the better of the pure modes), and IMG_DIR/goodput-{mix}-slo.png.
Debian's python3-matplotlib (scripts/install-deps).
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CONFIGS = [  # name, label, cores
    ("disagg", "1 prefill + 1 decode (1 core each)", 2),
    ("unified2", "2 unified (1 core each)", 2),
    ("unified2@32", "2 unified, 32-token prompt chunks (1 core each)", 2),
    ("unified1", "1 unified (2 cores)", 2),
    ("conditional", "1 prefill + 1 decode, conditional (1 core each)", 2),
    ("conditional+ttft", "1 prefill + 1 decode, conditional, TTFT-aware (1 core each)", 2),
    ("follow", "2 decode nodes, follow (1 core each)", 2),
    ("follow@14", "2 decode nodes, follow, router's TPOT objective 14 ms (1 core each)", 2),
    ("follow@45", "2 decode nodes, follow, router's TPOT objective 45 ms (1 core each)", 2),
    ("follow@68", "2 decode nodes, follow, router's TPOT objective 68 ms (1 core each)", 2),
    ("conditional@45", "1 prefill + 1 decode, conditional, router's TPOT objective 45 ms (1 core each)", 2),
    ("conditional@68", "1 prefill + 1 decode, conditional, router's TPOT objective 68 ms (1 core each)", 2),
]
# the modes issue 37 measures against the better of the pure ones (disaggregated, colocated)
def placed(cfg):
    return cfg.startswith("conditional") or cfg.startswith("follow")


MIXES = ["prefill", "decode"]
STYLE = {"disagg": ("tab:red", "o"), "unified2": ("tab:blue", "s"), "unified2@32": ("tab:purple", "v"), "unified1": ("tab:green", "^"),
         "conditional": ("tab:orange", "D"), "conditional+ttft": ("tab:brown", "P"),
         "follow": ("tab:cyan", "X"),
         "follow@14": ("tab:olive", "*"), "follow@45": ("tab:gray", "p"), "follow@68": ("tab:pink", "h"),
         "conditional@45": ("gold", "d"), "conditional@68": ("black", "8")}


def load(outs):
    res = {}
    for out in outs.split(","):
        for cfg, _, _ in CONFIGS:
            for mix in MIXES:
                p = os.path.join(out, f"{cfg}-{mix}.json")
                if not os.path.exists(p):
                    continue
                with open(p) as f:
                    r = json.load(f)
                if (cfg, mix) in res:
                    res[(cfg, mix)]["runs"] += r["runs"]
                else:
                    res[(cfg, mix)] = r
    return res


def fmt(v, nd=2):
    return "-" if v is None else f"{v:.{nd}f}"


def best_rate(runs, att):
    ok = [r["request_rate"] for r in runs if r["slo_attainment"] is not None and r["slo_attainment"] >= att]
    return max(ok) if ok else None


# TPOT objectives the SLO scale scores, as multiples of the unloaded disaggregated TPOT median
# when the sweep has a --probe result beside it, else of the sweep's own TPOT objective / 2.2
SLO_SCALE = [1.25, 1.5, 1.75, 2.0, 2.2, 2.5, 3.0, 4.0, 6.0]


def finish_fig(fig, run, mix, what, path, alt):
    """titles fig with the mix's mean lengths (from one run) and what, writes it to path and
    prints its markdown line"""
    n = run.get("completed") or 1
    fig.suptitle(f"SmolLM2-135M Q4_1, {mix}-heavy mix (~{run['total_input_tokens'] // n} in / "
                 f"~{run['total_output_tokens'] // n} out), {what}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"\n![{alt}]({os.path.relpath(path, 'docs')})")


def rescore(run, ttft_ms, tpot_ms):
    """(attainment, goodput) of one run's requests against the two objectives, as bench serve
    scores them (bs_slo_met: completed, TTFT and TPOT each within its objective; attainment over
    every request sent, goodput over the run's duration)"""
    reqs = run["requests"]
    good = sum(1 for q in reqs if q["ok"] and q["ttft_ms"] is not None and q["ttft_ms"] <= ttft_ms
               and (q["tpot_ms"] or 0) <= tpot_ms)
    return good / len(reqs), good / run["duration"]


def slo_scale(res, mix, img, base_tpot):
    have = [(c, l, n) for c, l, n in CONFIGS if (c, mix) in res and all("requests" in x for x in res[(c, mix)]["runs"])]
    if not have:
        return
    g = res[(have[0][0], mix)].get("goodput_config", {})
    ttft = g.get("ttft") or float("inf")
    att = res[(have[0][0], mix)].get("sweep_attainment", 0.9)
    tpots = [round(base_tpot * k, 1) for k in SLO_SCALE]
    best = {}  # (cfg, tpot) -> (highest rate at >= att, the same with every lower rate meeting it too, max goodput)
    for cfg, _, _ in have:
        runs = sorted(res[(cfg, mix)]["runs"], key=lambda x: x["request_rate"])
        for tp in tpots:
            scored = [(x["request_rate"], *rescore(x, ttft, tp)) for x in runs]
            ok = [r for r, a, _ in scored if a >= att]
            below = None
            for r, a, _ in scored:
                if a < att:
                    break
                below = r
            best[(cfg, tp)] = (max(ok) if ok else None, below, max(gp for _, _, gp in scored))
    print(f"\n#### {mix}-heavy mix, the same requests scored against other TPOT objectives "
          f"(TTFT <= {ttft:g} ms; unloaded TPOT median {base_tpot:g} ms)\n")
    print("highest rate at >= {:.0f}% attainment (in brackets: the highest with every lower rate swept meeting it "
          "too), max goodput req/s; ratio: disaggregated over the best colocated, per core\n".format(100 * att))
    cond = [c for c, _, _ in have if placed(c)]
    # with several placed configurations: each one's ratios to the better pure mode, then the
    # better of them (named) over it
    each = cond if len(cond) > 1 else []
    print("| TPOT objective | scale | " + " | ".join(c for c, _, _ in have) + " | ratio (highest rate) | ratio (max goodput) |"
          + "".join(f" {c} / best pure (highest rate) | (max goodput) |" for c in each)
          + (f" {' or '.join(cond)} / best pure (highest rate) | (max goodput) |" if cond else ""))
    print("|---|---|" + "---|" * len(have) + "---|---|" + "---|---|" * len(each) + ("---|---|" if cond else ""))
    ratios = []
    for tp, k in zip(tpots, SLO_SCALE):
        cells = []
        for cfg, _, _ in have:
            b, lo, gm = best[(cfg, tp)]
            cells.append(f"{'none' if b is None else f'{b:g}'} ({'none' if lo is None else f'{lo:g}'}), {gm:.2f}")
        cores = {c: n for c, _, n in have}
        dis = best.get(("disagg", tp))
        colo = [(best[(c, tp)], cores[c]) for c, _, _ in have if c.startswith("unified")]
        r1 = r2 = "-"
        if dis and colo:
            cb = max(((x[0] or 0) / n for x, n in colo))
            cg = max((x[2] / n for x, n in colo))
            d1, d2 = (dis[0] or 0) / cores["disagg"], dis[2] / cores["disagg"]
            r1 = "inf (colocated: none)" if cb == 0 and d1 > 0 else ("-" if cb == 0 else f"{d1 / cb:.2f}x")
            r2 = f"{d2 / cg:.2f}x" if cg else "-"
            ratios.append((tp, d1 / cb if cb else None, d2 / cg if cg else None))
        r3 = r4 = ""
        if cond:
            pure = [best[(c, tp)] for c, _, _ in have if not placed(c)]
            pb, pg = max((x[1] or 0) for x in pure), max(x[2] for x in pure)

            def over_pure(x):
                return (" " + ("-" if not pb and not x[1] else ("inf" if not pb else f"{(x[1] or 0) / pb:.2f}x")) + " |",
                        f" {x[2] / pg:.2f}x |" if pg else " - |")
            for c in each:
                r3 += "".join(over_pure(best[(c, tp)]))
            name = max(cond, key=lambda c: ((best[(c, tp)][1] or 0), best[(c, tp)][2]))
            a, b = over_pure(best[(name, tp)])
            r3 += a
            r4 = b[:-2] + (f" ({name}) |" if each else " |")
        print(f"| {tp:g} ms | {k:g}x | " + " | ".join(cells) + f" | {r1} | {r2} |" + r3 + r4)
    fig, ax = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    for cfg, label, _ in have:
        col, mk = STYLE[cfg]
        kw = dict(color=col, marker=mk, label=label, linewidth=1.5, markersize=5)
        ax[0].plot(tpots, [best[(cfg, tp)][0] or 0 for tp in tpots], **kw)
        ax[1].plot(tpots, [best[(cfg, tp)][2] for tp in tpots], **kw)
    ax[0].set_ylabel(f"highest rate at >= {100 * att:.0f}% (req/s)")
    ax[1].set_ylabel("max goodput (req/s)")
    for a in ax:
        a.set_xlabel("TPOT objective (ms)")
        a.set_xscale("log")
        a.grid(True, alpha=0.3)
    ax[0].legend(fontsize=7)
    finish_fig(fig, res[(have[0][0], mix)]["runs"][0], mix,
               f"the same runs scored against TPOT objectives (TTFT <= {ttft:g} ms)",
               os.path.join(img, f"goodput-{mix}-slo.png"), f"{mix}-heavy, SLO scale")


def probe_tpot(outs, mix):
    """the unloaded disaggregated TPOT median of goodput_sweep.sh --probe, if one is there"""
    for out in outs.split(","):
        p = os.path.join(out, f"probe-disagg-{mix}.json")
        if os.path.exists(p):
            with open(p) as f:
                return json.load(f).get("median_tpot_ms")
    return None


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "bench/goodput-out"
    img = sys.argv[2] if len(sys.argv) > 2 else "docs/img"
    os.makedirs(img, exist_ok=True)
    res = load(out)
    summary = {}
    for mix in MIXES:
        have = [(c, l, n) for c, l, n in CONFIGS if (c, mix) in res]
        if not have:
            continue
        any_res = res[(have[0][0], mix)]
        g = any_res.get("goodput_config", {})
        obj = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in g.items() if v)
        print(f"\n#### {mix}-heavy mix (objectives: {obj})\n")
        print("| config | rate | req/s | goodput | attainment | TTFT p90 ms | TPOT p90 ms |")
        print("|---|---|---|---|---|---|---|")
        fig, ax = plt.subplots(2, 2, figsize=(8, 5.6), dpi=80)
        for cfg, label, cores in have:
            r = res[(cfg, mix)]
            runs = sorted(r["runs"], key=lambda x: x["request_rate"])
            for x in runs:
                print(f"| {cfg} | {x['request_rate']:g} | {fmt(x['request_throughput'])} | "
                      f"{fmt(x['request_goodput'])} | {fmt(x['slo_attainment'])} | "
                      f"{fmt(x['p90_ttft_ms'], 0)} | {fmt(x['p90_tpot_ms'], 1)} |")
            rates = [x["request_rate"] for x in runs]
            col, mk = STYLE[cfg]
            kw = dict(color=col, marker=mk, label=label, linewidth=1.5, markersize=5)
            ax[0][0].plot(rates, [x["request_goodput"] for x in runs], **kw)
            ax[0][1].plot(rates, [100 * (x["slo_attainment"] or 0) for x in runs], **kw)
            ax[1][0].plot(rates, [x["p90_ttft_ms"] for x in runs], **kw)
            ax[1][1].plot(rates, [x["p90_tpot_ms"] for x in runs], **kw)
            att = r.get("sweep_attainment", 0.9)
            gmax = max(x["request_goodput"] or 0 for x in runs)
            summary[(cfg, mix)] = (best_rate(runs, att), gmax, cores, label)
        ax[0][0].plot([0, max(rates)], [0, max(rates)], color="grey", linestyle=":", linewidth=1, label="rate")
        ax[0][0].set_ylabel("goodput (req/s)")
        ax[0][1].axhline(90, color="grey", linestyle=":", linewidth=1)
        ax[0][1].set_ylabel("SLO attainment (%)")
        ax[0][1].set_ylim(0, 105)
        for key, a in (("ttft", ax[1][0]), ("tpot", ax[1][1])):
            if g.get(key):
                a.axhline(g[key], color="grey", linestyle=":", linewidth=1)
            a.set_yscale("log")
            a.set_ylabel(f"{key.upper()} p90 (ms)")
        for a in ax.flat:
            a.set_xlabel("request rate (req/s)")
            a.grid(True, alpha=0.3)
        ax[0][0].legend(fontsize=7)
        finish_fig(fig, any_res["runs"][0], mix, f"{obj}; dotted: objective",
                   os.path.join(img, f"goodput-{mix}.png"), f"{mix}-heavy")
    # goodput per core two ways: DistServe's (the highest rate served at >= 90% attainment, per
    # core) and the highest goodput any rate of the sweep measured, per core
    print("\n| mix | config | highest rate at >= 90% attainment | per core | vs best colocated "
          "| max goodput req/s | per core | vs best colocated |")
    print("|---|---|---|---|---|---|---|---|")
    for mix in MIXES:
        colo = [summary[(c, mix)] for c, _, _ in CONFIGS if c.startswith("unified") and (c, mix) in summary]
        best_rate_colo = max(((x[0] or 0) / x[2] for x in colo), default=None)
        best_good_colo = max((x[1] / x[2] for x in colo), default=None)
        for cfg, _, _ in CONFIGS:
            if (cfg, mix) not in summary:
                continue
            br, gmax, cores, label = summary[(cfg, mix)]
            rpc = (br or 0) / cores
            r1 = f"{rpc / best_rate_colo:.2f}x" if best_rate_colo else "-"
            r2 = f"{gmax / cores / best_good_colo:.2f}x" if best_good_colo else "-"
            print(f"| {mix} | {label} | {'none' if br is None else f'{br:g}'} | {rpc:.2f} | {r1} | "
                  f"{gmax:.2f} | {gmax / cores:.2f} | {r2} |")
    for mix in MIXES:
        if not any((c, mix) in res for c, _, _ in CONFIGS):
            continue
        g = next(res[(c, mix)] for c, _, _ in CONFIGS if (c, mix) in res).get("goodput_config", {})
        base = probe_tpot(out, mix) or ((g.get("tpot") or 30) / 2.2)
        slo_scale(res, mix, img, base)


if __name__ == "__main__":
    main()
