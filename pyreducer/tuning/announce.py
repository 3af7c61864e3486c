"""One line on rank 0 when a tuner decides: what, after how many steps, the measured and the
predicted gain. Logged at INFO on the "pyreducer.tuning" logger where logging would show it;
printed to stderr otherwise, so that a user watching the first minutes sees it.
AutotuneConfig(announce=False) silences it; the decisions are also in model.autotune_log and
the overlapped optimizer's schedule_log."""
from __future__ import annotations

import logging
import sys

logger = logging.getLogger("pyreducer.tuning")


def say(params, line: str) -> None:
    """Rank 0 of the wrapper's group says `line` (the others say nothing): logged if logging
    would show it (a handler, INFO enabled for "pyreducer.tuning"), else printed to stderr."""
    if params.rank != 0:
        return
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info("%s", line)
    else:
        print(line, file=sys.stderr, flush=True)


def _gain(ms: float, reference_ms: float) -> str:
    return f"{(ms / reference_ms - 1) * 100:+.1f}%" if reference_ms > 0 else "n/a"


def chosen_plan(name: str, buckets: int, steps: int, measured_ms: float, start_ms: float,
                predicted: dict[str, float]) -> str:
    """Bucket autotune's decision after its search."""
    line = (f"pyreducer autotune: {name} ({buckets} buckets) chosen after {steps} steps: "
            f"{measured_ms:.1f} ms/step measured against {start_ms:.1f} with torch DDP's caps "
            f"({_gain(measured_ms, start_ms)})")
    if name in predicted and "start" in predicted:
        line += (f"; predicted {predicted[name]:.1f} against {predicted['start']:.1f} "
                 f"({_gain(predicted[name], predicted['start'])})")
    return line


def recalled_plan(entry: dict, measured_ms: float, steps: int, path: str | None) -> str:
    """Bucket autotune's decision taken from the tuning cache (memory.py)."""
    return (f"pyreducer autotune: {entry.get('name', 'a plan')} ({len(entry['plan'])} buckets) "
            f"recalled from {path} and kept after {steps} steps: {measured_ms:.1f} ms/step "
            f"measured against {entry['step_ms']:.1f} remembered")


def chosen_schedule(chosen: dict, candidates: list[dict], steps: int, recalled: bool = False,
                    path: str | None = None) -> str:
    """The overlapped optimizer's schedule decision (schedule_tuner.py): `chosen` against the
    step barrier, or, if the barrier was chosen, against the fastest overlap measured; each
    candidate with predicted_ms, and measured_ms where measured."""
    how = f"recalled from {path} and kept" if recalled else "chosen"
    line = f"pyreducer overlapped optimizer: {chosen['describe']} {how} after {steps} steps"
    measured = chosen.get("measured_ms")
    if measured is None:
        return line
    line += f": {measured:.1f} ms/step measured"
    if recalled:
        return line + f" against {chosen['remembered_ms']:.1f} remembered"
    others = [c for c in candidates if bool(c.get("barrier")) != bool(chosen.get("barrier"))
              and c.get("measured_ms") is not None]
    if not others:
        return line
    other = min(others, key=lambda c: c["measured_ms"])
    what = "torch DDP's step barrier" if other.get("barrier") else \
        f"the fastest overlap ({other['describe']})"
    return line + (f" against {other['measured_ms']:.1f} with {what} "
                   f"({_gain(measured, other['measured_ms'])}); predicted "
                   f"{chosen['predicted_ms']:.1f} against {other['predicted_ms']:.1f} "
                   f"({_gain(chosen['predicted_ms'], other['predicted_ms'])})")


def phase(autotune, overlap) -> str:
    """What a wrapper's tuners (its AutoTuner and its OverlapOptimizer, each may be None) do at
    the coming steps, in words: "buckets: ...", "schedule: ...", "decided", or "" when nothing
    tunes. Drawn by the report (pyreducer/observe/report.py) and the tuning-phase benchmark."""
    tuner = getattr(overlap, "tuner", None)
    if autotune is not None and not autotune.done:
        return autotune.phase_name
    if tuner is not None and not tuner.decided:
        return tuner.phase_name
    return "decided" if autotune is not None or tuner is not None else ""


def spans(phases: list[str]) -> list[tuple[int, int, str]]:
    """(first step, last step, phase) of each run of equal phases, steps counted from 1."""
    runs: list[tuple[int, int, str]] = []
    for step, name in enumerate(phases, start=1):
        if runs and runs[-1][2] == name:
            runs[-1] = (runs[-1][0], step, name)
        else:
            runs.append((step, step, name))
    return runs


def decisions(logs: dict) -> list[str]:
    """The decisions in a Recorder's tuning logs (observe/recorder.py), one line each."""
    lines = []
    for entry in logs.get("buckets", []):
        if entry.get("event") in ("chosen", "recalled", "recall rejected"):
            lines.append(f"bucket autotune, step {entry.get('iteration')}: {entry['event']} "
                         + ", ".join(f"{k} {_short(v)}" for k, v in entry.items()
                                     if k not in ("event", "iteration")))
    for entry in logs.get("schedule", []):
        if entry.get("event") in ("chosen", "recalled", "recall rejected", "runoff"):
            lines.append(f"overlap schedule: {entry['event']} {entry.get('describe', '')}"
                         + "".join(f", {k} {_short(entry[k])}" for k in
                                   ("measured_ms", "barrier_ms", "remembered_ms", "predicted_ms")
                                   if k in entry))
    return lines


def _short(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)
