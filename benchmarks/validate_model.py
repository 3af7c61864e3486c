"""Validates the step model (pyreducer.tuning.stepmodel) against measured step times.

For every run of benchmarks/bench.py that measured pyreducer with a recorded profile, predicts
the step time of that bucket cap's plan and compares it with the measured median:
  same-cap    the profile recorded at that cap (gradient ready times under that plan)
  cross-cap   the profile recorded at DDP's default caps, used to predict every other cap
              (what the planner does: one profile, many plans)
The link model is the one fitted on that network (probe of 4 sizes); forward and optimizer
times come from the compute-only variant of the same model (any run with it).

    python benchmarks/validate_model.py sweep.json h4.json h2_1gbit.json --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyreducer.tuning import LinkModel, Profile, predict_step_ms  # noqa: E402
from pyreducer.tuning.stepmodel import cap_plan  # noqa: E402

MIB = 1 << 20


def caps_for(cap: str) -> list[int]:
    return [MIB, 25 * MIB] if cap == "default" else [int(float(cap) * MIB)]


def compute_splits(runs) -> dict:
    splits = {}
    for run in runs:
        for entry in run["results"].values():
            if "compute_split_ms" in entry:
                splits.setdefault((run["model"], run["hosts"]), entry["compute_split_ms"])
    return splits


def rows_for(run, splits) -> list[dict]:
    link = LinkModel(run["link_fit"]["latency_s"], run["link_fit"]["bandwidth_bytes_per_s"])
    split = splits.get((run["model"], run["hosts"])) or next(
        (v for (m, _), v in splits.items() if m == run["model"]), None)
    if split is None:
        return []
    default_profile = run["results"].get("default", {}).get("profile")
    out = []
    for cap, entry in run["results"].items():
        if "profile" not in entry or "pyreducer" not in entry:
            continue
        measured = entry["pyreducer"]["median_ms"]
        for kind, data in (("same-cap", entry["profile"]), ("cross-cap", default_profile)):
            if data is None or (kind == "cross-cap" and cap == "default"):
                continue
            profile = Profile(**dict(data, forward_ms=split["forward"],
                                     optimizer_ms=split["step"]))
            predicted = predict_step_ms(profile, cap_plan(profile, caps_for(cap)), link,
                                        run["hosts"])
            out.append(dict(model=run["model"], link=run["link"], hosts=run["hosts"], cap=cap,
                            kind=kind, measured_ms=measured, predicted_ms=predicted,
                            error=(predicted - measured) / measured))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    runs = []
    for path in args.files:
        with open(path) as f:
            runs += json.load(f)["runs"]
    splits = compute_splits(runs)
    rows = [row for run in runs for row in rows_for(run, splits)]
    print(f"{'model':12s} {'link':7s} {'hosts':>5s} {'cap':>8s} {'kind':10s} {'measured':>9s} "
          f"{'predicted':>9s} {'error':>7s}")
    for r in rows:
        print(f"{r['model']:12s} {r['link']:7s} {r['hosts']:>5d} {r['cap']:>8s} {r['kind']:10s} "
              f"{r['measured_ms']:9.1f} {r['predicted_ms']:9.1f} {100 * r['error']:+6.1f}%")
    summary = {}
    for kind in ("same-cap", "cross-cap"):
        errors = [abs(r["error"]) for r in rows if r["kind"] == kind]
        if errors:
            summary[kind] = dict(n=len(errors), median_abs_error=statistics.median(errors),
                                 max_abs_error=max(errors))
            print(f"{kind}: {len(errors)} predictions, median |error| "
                  f"{100 * summary[kind]['median_abs_error']:.1f}%, max "
                  f"{100 * summary[kind]['max_abs_error']:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
