"""Several runs of benchmarks/bench_sharded.py taken together: per model and host count, each
variant's ratio to ddp_adamw (its paired median in each run), the median over the runs with
their range, and where the sharded variants' steps went (sharded_worker.sharded_phases: the
median over the runs of the slowest rank's median); a plot of the ratios.

    python benchmarks/sharded_runs.py run/r1 run/r2 run/r3 --out run/all  # summary.md, ratios.png
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))

REFERENCE = "ddp_adamw"


def load(run_dirs: list[str]) -> list[dict]:
    return [json.load(open(os.path.join(d, "results.json"))) for d in run_dirs]


def combined(docs: list[dict]) -> dict:
    """{(model, hosts): {"reference_ms": [...], "ratios": {variant: [...]}, "phases": {variant:
    {phase: [...]}}}}, one value per run."""
    out: dict = {}
    for doc in docs:
        for run in doc["runs"]:
            entry = out.setdefault((run["model"], run["hosts"]),
                                   dict(reference_ms=[], ratios={}, phases={}))
            entry["reference_ms"].append(run["step"][REFERENCE]["median_ms"])
            for variant, paired in run["paired_vs_ddp_adamw"].items():
                entry["ratios"].setdefault(variant, []).append(paired["ratio"])
            for variant, ranks in run.get("phases_ms", {}).items():
                phases = entry["phases"].setdefault(variant, {})
                for phase in ranks[0]:
                    phases.setdefault(phase, []).append(max(r[phase] for r in ranks))
    return out


def cell(values: list[float], digits: int = 3) -> str:
    """The median, and the range where there is more than one value."""
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def summary_md(table: dict, run_dirs: list[str]) -> str:
    setups = sorted(table, key=lambda s: (s[1], s[0] != "transformer"))
    variants = list(dict.fromkeys(v for s in setups for v in table[s]["ratios"]))
    head = " | ".join(f"{m}, {h} hosts" for m, h in setups)
    lines = [f"Runs: {', '.join(run_dirs)}. Ratio: a variant's step time over {REFERENCE}'s in "
             "the same run (the run's paired median); median over the runs (range).", "",
             f"| step time / {REFERENCE} | {head} |", "|---" * (len(setups) + 1) + "|",
             f"| {REFERENCE} ms | " + " | ".join(cell(table[s]["reference_ms"], 1)
                                                for s in setups) + " |"]
    for v in variants:
        lines.append(f"| {v} | " + " | ".join(
            cell(table[s]["ratios"][v]) if v in table[s]["ratios"] else "-" for s in setups)
            + " |")
    phased = list(dict.fromkeys(v for s in setups for v in table[s]["phases"]))
    for v in phased:
        phases = list(dict.fromkeys(p for s in setups for p in table[s]["phases"].get(v, {})))
        lines += ["", f"{v}: where a step's time went, ms (the slowest rank's median; median "
                  "over the runs):", "", f"| phase | {head} |",
                  "|---" * (len(setups) + 1) + "|"]
        for p in phases:
            lines.append(f"| {p.replace('_', ' ')} | " + " | ".join(
                cell(table[s]["phases"][v][p], 0) if p in table[s]["phases"].get(v, {})
                else "-" for s in setups) + " |")
    return "\n".join(lines) + "\n"


def plot(table: dict, path: str) -> str:
    """The ratios per setup: bars at the median over the runs, the range as error bars."""
    from pyreducer.observe.plot import new_figure, save

    setups = sorted(table, key=lambda s: (s[1], s[0] != "transformer"))
    variants = list(dict.fromkeys(v for s in setups for v in table[s]["ratios"]))
    fig = new_figure(9, 4.5)
    ax = fig.subplots()
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        for j, s in enumerate(setups):
            values = table[s]["ratios"].get(v)
            if not values:
                continue
            x = j + (i - (len(variants) - 1) / 2) * width
            median = statistics.median(values)
            ax.bar(x, median, width, color=f"C{i}", label=v if j == 0 else None,
                   yerr=[[median - min(values)], [max(values) - median]], capsize=2)
            ax.text(x, max(values), f"{median:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.95, color="red", linewidth=0.8, linestyle="--", label="0.95")
    ax.set_xticks(range(len(setups)), [f"{m}\n{h} hosts" for m, h in setups])
    ax.set_ylabel(f"step time / {REFERENCE} (same run)")
    ax.set_ylim(0.5, None)
    ax.set_title("median over runs (bar: range)")
    ax.legend(fontsize=7, ncol=2)
    return save(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="bench_sharded.py --out directories")
    parser.add_argument("--out", required=True, help="directory for summary.md and ratios.png")
    args = parser.parse_args(argv)
    table = combined(load(args.runs))
    os.makedirs(args.out, exist_ok=True)
    text = summary_md(table, args.runs)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    print("wrote", plot(table, os.path.join(args.out, "ratios.png")), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
