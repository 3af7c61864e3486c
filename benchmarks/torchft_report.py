"""summary.md and the plots of benchmarks/bench_torchft.py, from its results.json:

    python benchmarks/torchft_report.py run/torchft/results.json   # summary.md, PNGs again

A run is {"variant", "repeat", "failure", "log": step entries, "events", "seconds"} or, where it
failed, {"variant", "repeat", "failure", "error"}. A step entry is torchft_replica's log line
(replica, attempt, step, participants, participating, committed, start, end; the plain DDP
worker writes the same). Events: {"replica", "life", "event", "time"}, event "start" (a life
began), "exit" (with "code"), "kill" (the plain worker's, just before its SIGKILL),
"checkpoint".

Step time (step_figures): each replica's steps of its first life from --warmup on (committed,
participating), end - start; per run and replica the median; the variant's figure is the slowest
replica's, its steps pooled over the repeats (with quartiles); "per repeat": each run's slowest
replica's median. The ratio to the reference divides medians of the same benchmark run.
One failure (failure_metrics): see FAILURE_NOTES.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))

from pyreducer.tools.compare import summarize  # noqa: E402

REFERENCE = "ddp_pyreducer"
DESCRIBE = {"torchft_pyreducer": "pyreducer.torchft.DistributedDataParallel under torchft",
            "torchft_ddp": "torchft's own DistributedDataParallel (torch DDP + its comm hook)",
            "ddp_pyreducer": "plain pyreducer DDP, torchrun per host",
            "ddp_torch": "plain torch DDP, torchrun per host"}
RECOVERY = {"torchft_pyreducer": "torchft: survivors go on, the restarted replica heals",
            "torchft_ddp": "torchft: survivors go on, the restarted replica heals",
            "ddp_pyreducer": "torchrun --max-restarts 1, resume from the last checkpoint",
            "ddp_torch": "torchrun --max-restarts 1, resume from the last checkpoint"}
RATIO_TARGET = 1.05
FAILURE_NOTES = """\
- steps lost: torchft: the survivors' uncommitted step attempts (the most of any survivor);
  elastic: the steps redone since the last checkpoint, the interrupted step included
  (fail step - resumed step + 1).
- seconds lost: the failure run's span (first step's start to last step's end, over every
  replica and life) minus the median span of the same variant's runs without failure.
- back at step S after: from the kill to the end of the first committed step S (the step
  that failed), whoever commits it.
- restart after: from the kill to the start of the failed replica's (rank's) first step in
  its next life (process start, joining, and for torchrun the rendezvous and checkpoint load).
- failed replica in again after: from the kill to the end of its first committed step that it
  participated in.
- heal: torchft: the restarted replica's healing step (the first of its new life, in which it
  takes a live peer's state instead of contributing), start to end.
- batches missing: (replicas x steps) minus the batches that went into committed steps (a
  replica away, or healing, contributes none).
- target (issue): steps lost <= 1 and seconds lost <= one median step + the heal."""


def read_jsonl(path: str) -> list[dict]:
    """The records of a jsonl file; a last line cut short (a killed writer) is left out."""
    records = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return records


def durations(log: list[dict], warmup: int) -> dict[int, list[float]]:
    """Per replica, end - start of its first life's committed, participating steps >= warmup."""
    out: dict[int, list[float]] = {}
    for e in log:
        if e["attempt"] == 0 and e["committed"] and e["participating"] and e["step"] >= warmup:
            out.setdefault(e["replica"], []).append(e["end"] - e["start"])
    return out


def span_s(log: list[dict]) -> float | None:
    """First step's start to last step's end, every replica and life."""
    return max(e["end"] for e in log) - min(e["start"] for e in log) if log else None


def step_figures(runs: list[dict], warmup: int) -> dict:
    """The slowest replica's step (its steps pooled over `runs`), per-run slowest medians."""
    per_run = [durations(run["log"], warmup) for run in runs]
    replicas = sorted({r for d in per_run for r in d})
    pooled = [[s for d in per_run for s in d.get(r, [])] for r in replicas]
    step = max((summarize(p) for p in pooled if p), key=lambda s: s["median_ms"], default=None)
    per_repeat = [max(statistics.median(s) * 1e3 for s in d.values()) for d in per_run if d]
    spans = [span_s(run["log"]) for run in runs]
    return dict(step=step, per_repeat_ms=per_repeat, repeats=[run["repeat"] for run in runs],
                spans_s=spans, span_s=statistics.median(spans) if spans else None)


def kill_time(run: dict, replica: int) -> float | None:
    """When `replica` was killed: its "kill" event, else its first life's non-zero exit."""
    for e in run["events"]:
        if e["replica"] == replica and e["event"] == "kill":
            return e["time"]
    exits = [e["time"] for e in run["events"] if e["replica"] == replica
             and e["event"] == "exit" and e.get("code") not in (0, None)]
    return min(exits) if exits else None


def _first(entries, key="end") -> float | None:
    return min((e[key] for e in entries), default=None)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def steps_lost(run: dict, fail_step: int, fail_replica: int) -> int | None:
    """FAILURE_NOTES' steps lost, torchft's (uncommitted attempts) or elastic's (redone)."""
    log = run["log"]
    if run["variant"].startswith("torchft"):
        survivors = {e["replica"] for e in log} - {fail_replica}
        return max((sum(1 for e in log if e["replica"] == r and not e["committed"])
                    for r in survivors), default=None)
    resumed = [e["step"] for e in log if e["attempt"] >= 1]
    return fail_step - min(resumed) + 1 if resumed else None


def heal_s(run: dict, fail_replica: int) -> float | None:
    """The restarted replica's healing step (its new life's first non-participating step)."""
    healing = [e for e in run["log"] if e["replica"] == fail_replica and e["attempt"] >= 1
               and not e["participating"]]
    if not healing:
        return None
    first = min(healing, key=lambda e: e["start"])
    return first["end"] - first["start"]


def batches_missing(log: list[dict], replicas: int, steps: int) -> int:
    used = {(e["replica"], e["step"]) for e in log if e["committed"] and e["participating"]}
    return replicas * steps - len(used)


def failure_metrics(run: dict, baseline: dict | None, settings: dict) -> dict:
    """FAILURE_NOTES' figures of one failure run; baseline: its variant's step_figures."""
    fail_step, fail_replica = settings["fail_step"], settings["fail_replica"]
    log, kill = run["log"], kill_time(run, fail_replica)
    step_s = baseline["step"]["median_ms"] / 1e3 if baseline and baseline["step"] else None
    back = _first(e for e in log if e["step"] == fail_step and e["committed"]
                  and kill is not None and e["end"] > kill)
    restart = _first((e for e in log if e["replica"] == fail_replica and e["attempt"] >= 1),
                     key="start")
    rejoin = _first(e for e in log if e["replica"] == fail_replica and e["attempt"] >= 1
                    and e["committed"] and e["participating"])
    heal = heal_s(run, fail_replica)
    lost = _minus(span_s(log), baseline["span_s"] if baseline else None)
    figures = dict(steps_lost=steps_lost(run, fail_step, fail_replica), seconds_lost=lost,
                   back_at_step_s=_minus(back, kill), restart_s=_minus(restart, kill),
                   rejoin_s=_minus(rejoin, kill), heal_s=heal, step_s=step_s,
                   batches_missing=batches_missing(log, settings["hosts"], settings["steps"]),
                   span_s=span_s(log))
    budget = None if step_s is None else step_s + (heal or 0.0)
    figures["budget_s"] = budget
    figures["target_met"] = None if lost is None or budget is None or \
        figures["steps_lost"] is None else figures["steps_lost"] <= 1 and lost <= budget
    return figures


def aggregate(doc: dict) -> dict:
    """{"steps": {variant: step_figures + ratios + errors}, "failures": [failure figures]}."""
    settings, steps = doc["settings"], {}
    for variant in dict.fromkeys(r["variant"] for r in doc["runs"] if not r["failure"]):
        runs = [r for r in doc["runs"] if r["variant"] == variant and not r["failure"]]
        ok = sorted((r for r in runs if "log" in r), key=lambda r: r["repeat"])
        steps[variant] = dict(step_figures(ok, settings["warmup"]) if ok else {},
                              errors=[r["error"] for r in runs if "error" in r])
    reference = steps.get(doc.get("reference", REFERENCE), {})
    for figures in steps.values():
        if figures.get("step") and reference.get("step"):
            figures["ratio"] = figures["step"]["median_ms"] / reference["step"]["median_ms"]
            ref = dict(zip(reference["repeats"], reference["per_repeat_ms"]))
            figures["per_repeat_ratio"] = [ms / ref[r] for r, ms in
                                           zip(figures["repeats"], figures["per_repeat_ms"])
                                           if r in ref]
    failures = []
    for run in (r for r in doc["runs"] if r["failure"]):
        figures = dict(variant=run["variant"], repeat=run["repeat"])
        if "log" in run:
            figures.update(failure_metrics(run, steps.get(run["variant"]), settings))
        else:
            figures["error"] = run["error"]
        failures.append(figures)
    return dict(steps=steps, failures=failures)


def _f(value, fmt=".2f", none="-") -> str:
    return none if value is None else format(value, fmt)


def step_row(variant: str, f: dict) -> str:
    step = f.get("step")
    if not step:
        return f"| {variant} | {DESCRIBE.get(variant, '')} | failed: see below |" + " - |" * 4
    cells = [variant, DESCRIBE.get(variant, ""), f"{step['median_ms']:.1f}",
             f"{step['p25_ms']:.1f}-{step['p75_ms']:.1f}", _f(f.get("ratio"), ".3f"),
             ", ".join(f"{r:.3f}" for r in f.get("per_repeat_ratio", [])) or "-",
             _f(f.get("span_s"), ".1f")]
    return "| " + " | ".join(cells) + " |"


def failure_row(f: dict) -> str:
    if "error" in f:
        return f"| {f['variant']} | failed: `{f['error'][-300:]}` |" + " - |" * 9
    met = {None: "-", True: "met", False: "NOT met"}[f["target_met"]]
    cells = [f["variant"], RECOVERY.get(f["variant"], ""), _f(f["steps_lost"], "d"),
             _f(f["seconds_lost"]), _f(f["back_at_step_s"]), _f(f["restart_s"]),
             _f(f["rejoin_s"]), _f(f["heal_s"]), _f(f["batches_missing"], "d"),
             f"{met} (budget {_f(f['budget_s'])} s)"]
    return "| " + " | ".join(cells) + " |"


def target_lines(steps: dict) -> list[str]:
    """The issue's targets without failures, each with its measured value."""
    ours, theirs = steps.get("torchft_pyreducer", {}), steps.get("torchft_ddp", {})
    lines = []
    if "ratio" in ours:
        verdict = "met" if ours["ratio"] <= RATIO_TARGET else "NOT met"
        lines.append(f"- torchft_pyreducer / {REFERENCE} = {ours['ratio']:.3f} "
                     f"(target <= {RATIO_TARGET}): {verdict}")
    if ours.get("step") and theirs.get("step"):
        a, b = ours["step"]["median_ms"], theirs["step"]["median_ms"]
        lines.append(f"- torchft_pyreducer {a:.1f} ms vs torchft_ddp {b:.1f} ms (target: below; "
                     f"ratio {a / b:.3f}): {'met' if a < b else 'NOT met'}")
    return lines


STEP_HEADER = (f"| variant | what | step ms (median, slowest replica) | IQR | / {REFERENCE} | "
               f"/ {REFERENCE} per repeat | run span s (median) |\n|" + "---|" * 7)
FAILURE_HEADER = ("| variant | recovery | steps lost | seconds lost | back at step S after s | "
                  "restart after s | failed replica in again after s | heal s | "
                  "batches missing | target: <= 1 step + heal |\n|" + "---|" * 10)


def summary_md(doc: dict) -> str:
    table, s, m = aggregate(doc), doc["settings"], doc.get("model", {})
    lines = [f"# torchft on {s['hosts']} emulated hosts at {s['link']}: step time, and one "
             "failure against torchrun's elastic restart", "",
             f"Model `{m.get('name')}`: {m.get('parameters', 0):,} parameters, "
             f"{m.get('grad_mib', 0):.1f} MiB of gradients, batch {m.get('batch')} per replica; "
             f"bucket_cap_mb={s['bucket_cap_mb']} (every variant); {s['steps']} steps a run, the "
             f"first {s['warmup']} not timed; {s['repeats']} repeat(s), round-robin.", "",
             "## Step time without failures", "", STEP_HEADER]
    lines += [step_row(v, f) for v, f in table["steps"].items()]
    lines += [""] + target_lines(table["steps"])
    lines += [f"- {v}: FAILED: `{e[-600:]}`" for v, f in table["steps"].items()
              for e in f.get("errors", [])]
    lines += ["", f"## One failure: SIGKILL of replica {s['fail_replica']} during the all-reduce "
              f"of step S={s['fail_step']} (torchrun: checkpoint every {s['checkpoint_every']} "
              "steps)", "", FAILURE_HEADER]
    lines += [failure_row(f) for f in table["failures"]]
    lines += ["", FAILURE_NOTES]
    return "\n".join(lines)


def plot_step_times(doc: dict, path: str) -> str:
    """Median step (slowest replica) per variant, IQR as the error bar, the ratio to the
    reference above each bar, and the target (RATIO_TARGET x the reference) dashed."""
    from pyreducer.observe.plot import new_figure, save

    steps = aggregate(doc)["steps"]
    fig = new_figure(1.6 * max(3, len(steps)) + 2, 4.2)
    ax = fig.subplots()
    for i, (variant, f) in enumerate(steps.items()):
        step = f.get("step")
        if not step:
            ax.text(i, 0.02, "failed", ha="center", transform=ax.get_xaxis_transform())
            continue
        ax.bar(i, step["median_ms"], 0.6, color=f"C{i}",
               yerr=[[step["median_ms"] - step["p25_ms"]], [step["p75_ms"] - step["median_ms"]]],
               capsize=3)
        if "ratio" in f:
            ax.text(i, step["p75_ms"], f"{f['ratio']:.3f}", ha="center", va="bottom", fontsize=8)
    reference = steps.get(doc.get("reference", REFERENCE), {}).get("step")
    if reference:
        ax.axhline(reference["median_ms"] * RATIO_TARGET, color="grey", linestyle="--",
                   linewidth=1, label=f"{RATIO_TARGET} x {REFERENCE}")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(steps)), list(steps), fontsize=8)
    ax.set_ylabel("median step ms (slowest replica)")
    s = doc["settings"]
    ax.set_title(f"step time, {s['hosts']} hosts at {s['link']} (label: / {REFERENCE})")
    return save(fig, path)


# a step's bar: (label, colour)
COMMITTED = ("committed", "C0")
HEALING = ("healing (takes a peer's state)", "C1")
UNCOMMITTED = ("not committed", "C3")
REDONE = ("redone after the restart", "0.7")


def bar_kind(entry: dict, redone_from: dict) -> tuple[str, str]:
    """A step entry's bar: redone (a later life of its replica started at or before its
    step), healing (committed or not), not committed, or committed."""
    later = redone_from.get((entry["replica"], entry["attempt"]))
    if later is not None and entry["step"] >= later:
        return REDONE
    if not entry["participating"]:
        return HEALING
    return COMMITTED if entry["committed"] else UNCOMMITTED


def redone_from(log: list[dict]) -> dict:
    """(replica, attempt) -> the first step of that replica's next life."""
    first = {}
    for e in log:
        key = (e["replica"], e["attempt"])
        first[key] = min(first.get(key, e["step"]), e["step"])
    return {(r, a): first[(r, a + 1)] for r, a in first if (r, a + 1) in first}


def draw_timeline(ax, run: dict, settings: dict) -> None:
    """One failure run: a row per replica, a bar per step attempt over wall time."""
    log = run["log"]
    origin, later, seen = min(e["start"] for e in log), redone_from(log), set()
    for e in log:
        label, colour = bar_kind(e, later)
        ax.broken_barh([(e["start"] - origin, e["end"] - e["start"])], (e["replica"] - 0.35, 0.7),
                       facecolors=colour, edgecolors="white", linewidth=0.3,
                       label=None if label in seen else label)
        seen.add(label)
    kill = kill_time(run, settings["fail_replica"])
    if kill is not None:
        ax.axvline(kill - origin, color="C3", linestyle="--", linewidth=1)
        ax.plot([kill - origin], [settings["fail_replica"]], "X", color="C3", markersize=9,
                label="SIGKILL")
    starts = [e for e in run["events"] if e["event"] == "start" and e["life"] >= 1]
    for i, e in enumerate(starts):
        ax.plot([e["time"] - origin], [e["replica"]], ">", color="C2", markersize=8,
                label=None if i else "restarted life starts")
    marks = [e["time"] - origin for e in run["events"] if e["event"] == "checkpoint"]
    if marks:
        ax.plot(marks, [-0.6] * len(marks), "|", color="black", markersize=10, label="checkpoint")
    replicas = sorted({e["replica"] for e in log})
    ax.set_yticks(replicas, [f"replica {r}" for r in replicas])
    ax.set_ylim(-1, max(replicas) + 0.6)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first step's start")
    ax.legend(fontsize=7, loc="upper right", ncol=3)


def plot_timeline(doc: dict, path: str) -> str | None:
    """The first run of each failure variant, a panel each: steps as bars over wall time,
    committed or not, the kill and the restart marked."""
    from pyreducer.observe.plot import new_figure, save

    firsts = {}
    for run in doc["runs"]:
        if run["failure"] and "log" in run and run["log"]:
            firsts.setdefault(run["variant"], run)
    if not firsts:
        return None
    table = {(f["variant"], f["repeat"]): f for f in aggregate(doc)["failures"]}
    fig = new_figure(12, 2.6 * len(firsts) + 0.6)
    axes = fig.subplots(len(firsts), 1, squeeze=False)[:, 0]
    for ax, (variant, run) in zip(axes, firsts.items()):
        draw_timeline(ax, run, doc["settings"])
        f = table.get((variant, run["repeat"]), {})
        ax.set_title(f"{variant} ({RECOVERY.get(variant, '')}): SIGKILL at step "
                     f"{doc['settings']['fail_step']}; steps lost {_f(f.get('steps_lost'), 'd')}, "
                     f"seconds lost {_f(f.get('seconds_lost'))}", fontsize=9)
    return save(fig, path)


def write_outputs(doc: dict, out: str) -> list[str]:
    """summary.md, step_time.png and timeline.png in `out`; the paths written."""
    written = [os.path.join(out, "summary.md")]
    with open(written[0], "w") as f:
        f.write(summary_md(doc) + "\n")
    if any("log" in r for r in doc["runs"] if not r["failure"]):
        written.append(plot_step_times(doc, os.path.join(out, "step_time.png")))
    timeline = plot_timeline(doc, os.path.join(out, "timeline.png"))
    return written + ([timeline] if timeline else [])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    for path in write_outputs(doc, os.path.dirname(os.path.abspath(argv[0]))):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
