"""The third-party model suite's record: a markdown table and a plot from the JSON that
benchmarks/bench.py wrote for the suite (`make bench-suite`: pyreducer/testing/third_party.py's
models, torch DDP, the autotuned barrier, the overlapped and the sharded optimizer).

    python benchmarks/suite_report.py suite.json --plot suite.png
Step times are whole loops' means (the slowest rank's), medians over blocks and rounds; ratios
to torch DDP are paired (blocks run next to each other), with their 95% bootstrap intervals.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from tables import last_event  # noqa: E402

VARIANTS = (("torch", "torch DDP"), ("auto", "barrier (autotuned)"),
            ("overlap", "overlap"), ("sharded", "sharded"))


def chosen(entry: dict, variant: str) -> str:
    event = last_event(entry, variant, "chosen")
    if event is None and variant == "sharded" and variant in entry:
        return "whole buckets, torch DDP's order (fixed)"  # shard=True: schedule="fifo" only
    return event["describe"] if event else "-"


def caps(entry: dict, variant: str) -> str:
    """What the variant's bucket autotune chose: "cap 1 MB, 11 buckets", or "recalled" (the
    run's shared tuning cache: bench.py --caps-once) with the buckets."""
    last = last_event(entry, variant, "chosen", log="log")
    if last is None:
        return "-"
    plan = "recalled (the barrier's)" if last.get("plan") == "remembered" else last.get("plan")
    return f"{plan}, {last.get('buckets')} buckets"


def ratio(entry: dict, variant: str, over: str) -> float | None:
    if variant not in entry or over not in entry:
        return None
    return entry[variant]["median_ms"] / entry[over]["median_ms"]


def paired(entry: dict, variant: str, over: str = "torch") -> str:
    p = entry.get(f"paired_vs_{over}", {}).get(variant)
    return "-" if p is None else f"{p['ratio']:.3f} ({p['ci95'][0]:.3f}-{p['ci95'][1]:.3f})"


def rows(data: dict) -> list[dict]:
    out = []
    for run in data["runs"]:
        entry = run["results"]["default"]
        out.append(dict(model=run["model"], batch=run["batch"], link=run["link"],
                        hosts=run["hosts"], entry=entry, parity=run["parity_max_diff"],
                        comm_ms=run["comm_only_ms"]))
    return out


def markdown(data: dict) -> str:
    head = ("| model (batch) | one flat all-reduce | " + " | ".join(n for _, n in VARIANTS)
            + " | overlap / barrier (paired, 95% CI) | overlap / torch DDP (paired) | sharded / "
            "torch DDP (paired) | barrier's caps | overlap's caps | overlap's choice | "
            "sharded's choice | max diff to pyreducer |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows(data):
        e = r["entry"]
        ms = [f"{e[v]['median_ms']:.1f}" if v in e else "-" for v, _ in VARIANTS]
        diff = max(r["parity"].values()) if r["parity"] else float("nan")
        lines.append(f"| {r['model']} ({r['batch']}) | {r['comm_ms']:.1f} | " + " | ".join(ms)
                     + f" | {paired(e, 'overlap', 'auto')} | {paired(e, 'overlap')}"
                     f" | {paired(e, 'sharded')} | {caps(e, 'auto')} | {caps(e, 'overlap')}"
                     f" | {chosen(e, 'overlap')} | "
                     f"{chosen(e, 'sharded')} | {diff:.1g} |")
    for model, why in data.get("skipped", {}).items():
        lines.append(f"\nNot run: {why}")
    return "\n".join(lines)


def plot(data: dict, path: str) -> str:
    """Step time over torch DDP's, a group of bars per model; the barrier's 1.02 dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = rows(data)
    fig, ax = plt.subplots(figsize=(1.9 * len(runs) + 2, 3.6))
    width = 0.8 / (len(VARIANTS) - 1)
    for k, (variant, name) in enumerate(VARIANTS[1:]):
        xs, ys = [], []
        for i, r in enumerate(runs):
            value = ratio(r["entry"], variant, "torch")
            if value is not None:
                xs.append(i + (k - 1) * width)
                ys.append(value)
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    for i, r in enumerate(runs):
        barrier = ratio(r["entry"], "auto", "torch")
        if barrier is not None:
            ax.plot([i - 0.45, i + 0.45], [1.02 * barrier] * 2, "k--", linewidth=0.8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(runs)), [f"{r['model']}\n(batch {r['batch']})" for r in runs])
    ax.set_ylabel("step time / torch DDP's")
    first = runs[0] if runs else {"hosts": "?", "link": "?"}
    ax.set_title(f"Third-party models, {first['hosts']} emulated hosts at {first['link']} "
                 f"(dashed: 1.02 x the barrier)", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--plot", metavar="PNG")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    print(markdown(data))
    if args.plot:
        print("wrote", plot(data, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
