"""Compares two benchmark JSON files (from bench.py or bench_ddp.py): median step time per
matching (model, link, hosts, bucket cap, variant), old vs new, and the ratio new / old.

    python benchmarks/diff.py old.json new.json [--threshold 0.05]
Rows whose ratio moves by more than the threshold are marked; exit status 0 either way.
"""
from __future__ import annotations

import argparse
import json
import sys


def rows(doc: dict) -> dict:
    """{(model, link, hosts, cap, variant): median_ms} for either JSON layout."""
    out = {}
    if "runs" in doc:  # bench.py
        for run in doc["runs"]:
            for cap, entry in run["results"].items():
                for variant, stats in entry.items():
                    if isinstance(stats, dict) and "median_ms" in stats:
                        out[(run["model"], run["link"], run["hosts"], cap, variant)] = \
                            stats["median_ms"]
    elif "results" in doc:  # bench_ddp.py
        env = doc.get("environment", {})
        for result in doc["results"]:
            for rank_entry in result["per_rank"]:
                for variant in ("torch_ddp", "pyreducer"):
                    key = (result["model"], env.get("link", "?"), env.get("ranks", "?"),
                           f"rank{rank_entry['rank']}", variant)
                    out[key] = rank_entry[variant]["median_ms"]
    else:
        raise SystemExit("unrecognised benchmark JSON: expected 'runs' or 'results'")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--threshold", type=float, default=0.05)
    args = parser.parse_args(argv)
    with open(args.old) as f:
        old = rows(json.load(f))
    with open(args.new) as f:
        new = rows(json.load(f))
    common = sorted(set(old) & set(new), key=str)
    if not common:
        print("no rows in common")
        return 0
    print(f"{'model':12s} {'link':10s} {'hosts':>5s} {'cap':>8s} {'variant':10s} "
          f"{'old ms':>9s} {'new ms':>9s} {'new/old':>8s}")
    for key in common:
        ratio = new[key] / old[key]
        flag = "  <-- changed" if abs(ratio - 1) > args.threshold else ""
        model, link, hosts, cap, variant = key
        print(f"{model:12s} {str(link):10s} {str(hosts):>5s} {str(cap):>8s} {variant:10s} "
              f"{old[key]:9.1f} {new[key]:9.1f} {ratio:8.3f}{flag}")
    only = sorted(set(old) ^ set(new), key=str)
    if only:
        print(f"{len(only)} row(s) in only one file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
