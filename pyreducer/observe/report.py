"""Writes what people look at after a run: trace JSON, raw timelines, plots, a text summary.

    write_report(timelines, out_dir, profile)   from gathered, aligned timelines (one per rank)
    report_dir(out_dir)                         from the rank files PYREDUCER_TRACE wrote there
                                                (pyreducer/observe/recorder.py), merged
"""
from __future__ import annotations

import glob
import json
import os
import re

from pyreducer.observe import InputError, output_dir
from pyreducer.observe.trace import chrome_trace, shift_record
from pyreducer.wrapper import timeline as timeline_module

RANK_FILE = re.compile(r"rank(\d+)(?:\.model(\d+))?\.json$")


def compiled_text(compiled: dict | None) -> list[str]:
    """Lines on how torch.compile's graphs were split at buckets (a wrapper's compiled_summary(),
    rank 0's); none for an eager model."""
    if not compiled or not compiled.get("graphs"):
        return []
    graphs = compiled["graphs"]
    lines = [f"torch.compile: {len(graphs)} graph(s) captured, split at pyreducer's buckets into "
             f"{sum(g['pieces'] for g in graphs)} piece(s) (pyreducer/compiled)"]
    for i, g in enumerate(graphs):
        opened = "; ".join(f"piece {k}: {g['nodes'][k]} nodes, buckets {g['buckets'][k]} "
                           f"({', '.join(g['params'][k][:3])}{', ...' if len(g['params'][k]) > 3 else ''})"
                           for k in range(g["pieces"]))
        lines.append(f"  graph {i} ({g['compiler']}, plan of {g['plan_buckets']} buckets): {opened}")
    return lines


def tuning_text(tuning: dict | None) -> list[str]:
    """Lines on the tuning phase (rank 0's Recorder.tuning()): its stretches and decisions."""
    if not tuning or not tuning.get("phases"):
        return []
    from pyreducer.tuning import announce

    starts = tuning["forward_start_ns"]
    lines = ["tuning phase (rank 0; step = forward to next forward, ms; tuning.png):"]
    for first, last, name in announce.spans(tuning["phases"]):
        times = [(starts[i] - starts[i - 1]) / 1e6 for i in range(first, min(last + 1,
                                                                              len(starts)))]
        mean = f"{sum(times) / len(times):.1f}" if times else "-"
        lines.append(f"  steps {first}-{last} ({last - first + 1}): {name or 'untuned'}, "
                     f"mean step {mean}")
    lines += ["  " + line for line in announce.decisions(tuning.get("logs", {}))]
    return lines


def memory_text(timelines: list[list[dict]]) -> list[str]:
    """Lines on a sharded optimizer's memory per rank (its last recorded iteration's): when the
    step began (after the backward) and after the update (through the forward)."""
    lines = []
    for rank, timeline in enumerate(timelines):
        overlap = next((r["overlap"] for r in reversed(timeline)
                        if r.get("overlap", {}).get("memory")), None)
        for key, when in (("memory", "at the step"), ("memory_after_update", "after the update")):
            if overlap and overlap.get(key):
                lines.append(f"rank {rank} memory {when} (sharded optimizer, MB): " + ", ".join(
                    f"{name.replace('_', ' ')} {value / 2**20:.2f}"
                    for name, value in overlap[key].items()))
    return lines


def summary_text(timelines: list[list[dict]], compiled: dict | None = None,
                 tuning: dict | None = None) -> str:
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
    for rank, timeline in enumerate(timelines):
        waits = timeline_module.overlap_stats(timeline).get("forward_wait_by_module_ms")
        if waits:
            lines.append(f"rank {rank}: the next forward's waits for all-reduces by module that "
                         f"read (mean ms per iteration): " +
                         ", ".join(f"{name} {ms:.2f}" for name, ms in list(waits.items())[:8]))
    lines += compiled_text(compiled)
    lines += tuning_text(tuning)
    lines += memory_text(timelines)
    lines.append("definitions: pyreducer/wrapper/timeline.py (and docs/pages/guides/timeline.md)")
    return "\n".join(lines)


def write_report(timelines: list[list[dict]], out_dir, profile: dict | None = None,
                 compiled: dict | None = None, tuning: dict | None = None) -> dict:
    """Writes trace.json, timeline.json, gantt.png, overlap.png, summary.txt (and profile.json,
    rank 0's step profile for `python -m pyreducer simulate`, if given) into out_dir.

    Returns {"paths": {name: path}, "summary": text, "notes": [...]}; without matplotlib the
    plots are left out and a note says how to install it.
    """
    from pyreducer.observe import plot

    output_dir(out_dir, "output folder")
    paths = {name: os.path.join(out_dir, name) for name in
             ("trace.json", "timeline.json", "summary.txt")}
    with open(paths["trace.json"], "w") as f:
        json.dump(chrome_trace(timelines), f)
    with open(paths["timeline.json"], "w") as f:
        json.dump(timelines, f)
    notes = []
    try:
        paths["gantt.png"] = plot.gantt(timelines, os.path.join(out_dir, "gantt.png"))
        paths["overlap.png"] = plot.exposed_vs_hidden(timelines,
                                                      os.path.join(out_dir, "overlap.png"))
        if tuning and len(tuning["phases"]) >= 2:  # rank 0's tuning phase
            paths["tuning.png"] = plot.tuning_phase(tuning, os.path.join(out_dir, "tuning.png"))
        if len(plot.overlapped_iterations(timelines[0])) >= 2:  # two iterations, rank 0
            paths["overlap_gantt.png"] = plot.overlap_gantt(
                timelines[0], os.path.join(out_dir, "overlap_gantt.png"))
    except plot.PlottingUnavailable as error:
        notes.append(f"no plots: {error}")
    if profile is not None:
        paths["profile.json"] = os.path.join(out_dir, "profile.json")
        with open(paths["profile.json"], "w") as f:
            json.dump(profile, f)
    text = summary_text(timelines, compiled, tuning)
    with open(paths["summary.txt"], "w") as f:
        f.write(text + "\n")
    return dict(paths=paths, summary=text, notes=notes)


def load_rank_files(out_dir, model: int = 0) -> list[dict]:
    """The rank files of wrapper `model` in out_dir, by rank in the wrapper's group (InputError
    if there are none, they are not rank files, come from different runs, or ranks are missing)."""
    from pyreducer.observe.recorder import FORMAT

    by_rank, run_ids = {}, set()
    for path in sorted(glob.glob(os.path.join(out_dir, "rank*.json"))):
        match = RANK_FILE.search(os.path.basename(path))
        if not match or int(match.group(2) or 0) != model:
            continue
        try:
            with open(path) as f:
                data = json.load(f)
        except ValueError as error:
            raise InputError(f"{path}: not a rank file ({error}); PYREDUCER_TRACE writes them") \
                from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputError(f"{path}: not a {FORMAT} file; PYREDUCER_TRACE writes them")
        run_ids.add(data["run_id"])
        by_rank.setdefault(data["rank"], []).append((path, data))
    if not by_rank:
        raise InputError(f"{out_dir}: no rank*.json files; `PYREDUCER_TRACE={out_dir} torchrun "
                         f"... train.py` (any script that uses pyreducer) writes them")
    if len(run_ids) > 1:
        raise InputError(f"{out_dir}: rank files of {len(run_ids)} different runs; empty the "
                         f"folder before a new PYREDUCER_TRACE run")
    doubled = [[path for path, _ in entries] for entries in by_rank.values() if len(entries) > 1]
    if doubled:
        raise InputError(f"{out_dir}: several process groups traced one wrapper each "
                         f"({', '.join(doubled[0])} hold the same group rank); give each group "
                         f"its own PYREDUCER_TRACE folder")
    ranks = {rank: entries[0][1] for rank, entries in by_rank.items()}
    world_size = next(iter(ranks.values()))["world_size"]
    missing = [r for r in range(world_size) if r not in ranks]
    if missing:
        raise InputError(f"{out_dir}: rank files of ranks {missing} of {world_size} are missing "
                         f"(did those ranks exit before writing?)")
    return [ranks[r] for r in range(world_size)]


def report_dir(out_dir, model: int = 0, keep: int | None = None) -> dict:
    """Merges the rank files of out_dir (clocks aligned to rank 0; the last `keep` iterations,
    default all) and writes the report there, with rank 0's profile as profile.json."""
    ranks = load_rank_files(out_dir, model)
    timelines = [[shift_record(record, -rank["clock_offset_ns"])
                  for record in rank["timeline"][-keep if keep else 0:]] for rank in ranks]
    if not any(timelines):
        raise InputError(f"{out_dir}: the rank files hold no recorded iteration (no synced "
                         f"backward ran, or timeline_iterations=0)")
    return write_report(timelines, out_dir, profile=ranks[0]["profile"],
                        compiled=ranks[0].get("compiled"), tuning=ranks[0].get("tuning"))
