"""Writes what people look at after a run: trace JSON, raw timelines, plots, a text summary."""
from __future__ import annotations

import json
import os

from pyreducer import timeline as timeline_module
from pyreducer.observe.trace import chrome_trace


def summary_text(timelines: list[list[dict]]) -> str:
    lines = ["overlap of bucket all-reduces with backward (mean over recorded iterations, ms)",
             f"{'rank':>4} {'iters':>5} {'buckets':>7} {'backward':>9} {'comm busy':>9} "
             f"{'hidden':>8} {'exposed':>8} {'overlap':>8} {'wait':>8} {'last-bucket bound':>17}"]
    for rank, timeline in enumerate(timelines):
        stats = timeline_module.overlap_stats(timeline)
        m = stats["mean"]
        if not m:
            lines.append(f"{rank:>4} no recorded iterations")
            continue
        lines.append(f"{rank:>4} {len(timeline):>5} {stats['iterations'][-1]['num_buckets']:>7} "
                     f"{m['backward_ms']:>9.2f} {m['comm_busy_ms']:>9.2f} "
                     f"{m['hidden_comm_ms']:>8.2f} {m['exposed_comm_ms']:>8.2f} "
                     f"{m['overlap_fraction']:>8.2f} {m['wait_ms']:>8.2f} "
                     f"{m['last_bucket_bound_ms']:>17.2f}")
    lines.append("definitions: pyreducer/timeline.py (and the README)")
    return "\n".join(lines)


def write_report(timelines: list[list[dict]], out_dir, profile: dict | None = None) -> dict:
    """Writes trace.json, timeline.json, gantt.png, overlap.png, summary.txt (and profile.json,
    rank 0's step profile for `python -m pyreducer simulate`, if given) into out_dir."""
    from pyreducer.observe import plot

    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in
             ("trace.json", "timeline.json", "gantt.png", "overlap.png", "summary.txt")}
    with open(paths["trace.json"], "w") as f:
        json.dump(chrome_trace(timelines), f)
    with open(paths["timeline.json"], "w") as f:
        json.dump(timelines, f)
    plot.gantt(timelines, paths["gantt.png"])
    plot.exposed_vs_hidden(timelines, paths["overlap.png"])
    if profile is not None:
        paths["profile.json"] = os.path.join(out_dir, "profile.json")
        with open(paths["profile.json"], "w") as f:
            json.dump(profile, f)
    text = summary_text(timelines)
    with open(paths["summary.txt"], "w") as f:
        f.write(text + "\n")
    return dict(paths=paths, summary=text)
