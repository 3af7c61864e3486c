"""Markdown tables from a benchmarks/bench.py JSON result, for the records in benchmarks/results/.

    python benchmarks/tables.py result.json            # one row per (model, link, hosts, cap)
    python benchmarks/tables.py result.json --sweep    # pyreducer / torch DDP per cap (paired)
Columns that a run did not measure are shown as "-".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def _ms(entry: dict, variant: str) -> str:
    return f"{entry[variant]['median_ms']:.1f}" if variant in entry else "-"


def _paired(entry: dict, variant: str) -> str:
    paired = entry.get("paired_vs_torch", {}).get(variant)
    if paired is None:
        return "-"
    low, high = paired["ci95"]
    return f"{paired['ratio']:.3f} ({low:.3f}-{high:.3f})"


def _over(entry: dict, variant: str, key: str) -> str:
    if variant not in entry or key not in entry:
        return "-"
    return f"{entry[variant]['median_ms'] / entry[key]:.3f}"


def main_table(doc: dict) -> str:
    head = ["link", "hosts", "model", "cap", "compute", "torch DDP", "pyreducer", "auto",
            "pyreducer / DDP (95% CI)", "auto / DDP (95% CI)", "bound", "DDP / bound",
            "pyreducer / bound", "auto / bound", "backward alone / under comm",
            "bound with contention", "pyreducer / it", "auto / it"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in doc["runs"]:
        for cap, e in run["results"].items():
            split = e.get("compute_split_ms", {})
            contention = (f"{split['backward']:.1f} / {e['backward_under_comm_ms']:.1f}"
                          if "backward_under_comm_ms" in e else "-")
            bound = f"{e['bound_ms']:.1f}" if "bound_ms" in e else "-"
            contended = f"{e['contended_bound_ms']:.1f}" if "contended_bound_ms" in e else "-"
            lines.append("| " + " | ".join([
                run["link"], str(run["hosts"]), run["model"], cap, _ms(e, "compute"),
                _ms(e, "torch"), _ms(e, "pyreducer"), _ms(e, "auto"), _paired(e, "pyreducer"),
                _paired(e, "auto"), bound, _over(e, "torch", "bound_ms"),
                _over(e, "pyreducer", "bound_ms"), _over(e, "auto", "bound_ms"), contention,
                contended, _over(e, "pyreducer", "contended_bound_ms"),
                _over(e, "auto", "contended_bound_ms")]) + " |")
    return "\n".join(lines)


def sweep_table(doc: dict) -> str:
    """pyreducer / torch DDP (paired) per cap, one row per (model, link), and the best cap."""
    caps = list(doc["runs"][0]["results"])
    head = ["link", "model"] + [f"{c} MB" for c in caps] + ["best cap (DDP, pyreducer ms)",
                                                           "best / default"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = []
    for run in doc["runs"]:
        cells = []
        for cap in caps:
            paired = run["results"][cap].get("paired_vs_torch", {}).get("pyreducer")
            cells.append(f"{paired['ratio']:.3f}" if paired else "-")
            if paired:
                ratios.append(paired["ratio"])
        timed = {c: e for c, e in run["results"].items() if "pyreducer" in e and "torch" in e}
        best = min(timed, key=lambda c: timed[c]["pyreducer"]["median_ms"])
        b = timed[best]
        default = timed.get("default", b)["pyreducer"]["median_ms"]
        lines.append("| " + " | ".join([run["link"], run["model"]] + cells + [
            f"{best} ({b['torch']['median_ms']:.1f}, {b['pyreducer']['median_ms']:.1f})",
            f"{b['pyreducer']['median_ms'] / default:.3f}"]) + " |")
    if ratios:
        lines.append("")
        lines.append(f"pyreducer / torch DDP over {len(ratios)} points: median "
                     f"{statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}, "
                     f"range {min(ratios):.3f}-{max(ratios):.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        doc = json.load(f)
    print(sweep_table(doc) if args.sweep else main_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
