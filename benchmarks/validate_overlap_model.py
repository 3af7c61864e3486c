"""Validates the overlap step model (pyreducer.overlap.schedule) against measured step times.

For every run of benchmarks/bench.py with the `overlap` variant, takes what its schedule tuner
planned from (the "planned" event of the schedule log: the profile, the schedule it was recorded
under, the loaded link, the lanes), predicts every schedule the tuner timed again, and compares
with the tuner's trial medians (rank 0, 6 steps over two rounds) and the chosen schedule with the
benchmark's median (whole loops, the slowest rank). The predictions are recomputed, not read
back: a model changed since the run is judged on the data the planner had.

    python benchmarks/validate_overlap_model.py vgg.json mlp_large.json ...
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import tables  # noqa: E402
from pyreducer.overlap.schedule import OverlapProfile, Schedule  # noqa: E402


def predictions(entry: dict, ranks: int, variant: str = "overlap") -> list[dict] | None:
    """Per schedule timed: describe, predicted_ms, measured_ms (trial median), and for the one
    chosen also bench_ms (the benchmark's median). None if the run logged no profile (before
    the planned event carried one)."""
    planned = tables.last_event(entry, variant, "planned")
    if planned is None or "profile" not in planned:
        return None
    profile = OverlapProfile(**planned["profile"])
    link = tables.planned_link(planned)
    measured = {e["describe"]: e["measured_ms"] for e in entry[f"{variant}_schedule"]
                if e["event"] == "measured"}
    chosen = tables.last_event(entry, variant, "chosen")
    rows = []
    for trial in planned["trials"]:
        schedule = Schedule(trial["order"], trial["chunks"], trial["chunk_bytes"],
                            budget_bytes=trial["budget_bytes"], barrier=trial["barrier"])
        row = dict(describe=trial["describe"],
                   predicted_ms=schedule.predict(profile, link, ranks,
                                                 planned["lanes"]).predicted_ms,
                   measured_ms=measured.get(trial["describe"]))
        if chosen and chosen["describe"] == trial["describe"] and variant in entry:
            row["bench_ms"] = entry[variant]["median_ms"]
        rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="benchmarks/bench.py JSON files")
    args = parser.parse_args(argv)
    ratios, bench_ratios = [], []
    print(f"{'run':<34} {'schedule':<58} {'predicted':>9} {'trial':>7} {'ratio':>6}"
          f" {'bench':>7} {'ratio':>6}")
    for path in args.results:
        with open(path) as f:
            doc = json.load(f)
        for run in doc["runs"]:
            for cap, entry in run["results"].items():
                rows = predictions(entry, run["hosts"])
                name = f"{run['model']} {run['link']} {run['hosts']}h {cap}"
                if rows is None:
                    print(f"{name:<34} (no profile logged)")
                    continue
                for row in rows:
                    trial = row["measured_ms"]
                    ratio = row["predicted_ms"] / trial if trial else None
                    bench = row.get("bench_ms")
                    bench_ratio = row["predicted_ms"] / bench if bench else None
                    if ratio is not None:
                        ratios.append(ratio)
                    if bench_ratio is not None:
                        bench_ratios.append(bench_ratio)
                    print(f"{name:<34} {row['describe'][:58]:<58} {row['predicted_ms']:9.1f} "
                          + (f"{trial:7.1f} {ratio:6.2f}" if ratio else f"{'-':>7} {'-':>6}")
                          + (f" {bench:7.1f} {bench_ratio:6.2f}" if bench else ""))
    for label, values in (("trials", ratios), ("benchmark (chosen)", bench_ratios)):
        if values:
            within = sum(abs(r - 1) <= 0.10 for r in values)
            print(f"{label}: predicted / measured within 10% for {within} of {len(values)} "
                  f"(range {min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
