"""PNG plots of the timeline (matplotlib's object API: no display, and the user's backend is
left as it is).

    gantt(timelines, "gantt.png")           one iteration, a row per rank: backward compute vs
                                            each bucket's all-reduce, ready markers
    overlap_gantt(records, "overlap_gantt.png")  two consecutive iterations of one rank with an
                                            overlapped optimizer: backward, the next forward
                                            (its waits and updates), and each bucket's
                                            all-reduce of each iteration
    exposed_vs_hidden(timelines, "bars.png") per bucket, how much of its all-reduce ran during
                                            backward (hidden) and after it (exposed), mean over
                                            the recorded iterations of rank 0
`timelines` is one list of timeline records per rank, as pyreducer.observe.trace.gather_timelines
gives. matplotlib is optional (`pip install .[plot]`); without it these raise PlottingUnavailable,
which says how to install it.
"""
from __future__ import annotations

INSTALL_HINT = ("the plots need matplotlib, which is not installed: `pip install matplotlib` "
                "(or `pip install .[plot]` in pyreducer's checkout)")


class PlottingUnavailable(RuntimeError):
    """matplotlib is missing; the message says how to install it."""


def new_figure(width_in: float, height_in: float):
    """A figure outside pyplot: no backend is chosen or switched, nothing is left open."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise PlottingUnavailable(INSTALL_HINT) from error
    return Figure(figsize=(width_in, height_in))


def save(fig, path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def gantt(timelines: list[list[dict]], path, iteration: int | None = None) -> str:
    records = [tl[-1] if iteration is None else next(r for r in tl if r["iteration"] == iteration)
               for tl in timelines]
    origin = min(r["backward_start_ns"] for r in records)
    rows = sum(1 + len(r["buckets"]) for r in records)
    fig = new_figure(11, 0.35 * rows + 1.5)
    ax = fig.subplots()
    y, labels = 0, []
    for rank, r in enumerate(records):
        def ms(ns):
            return (ns - origin) / 1e6
        ax.barh(y, ms(r["backward_end_ns"]) - ms(r["backward_start_ns"]),
                left=ms(r["backward_start_ns"]), color="tab:blue", height=0.7)
        labels.append(f"rank {rank} backward")
        y += 1
        for b in r["buckets"]:
            ax.barh(y, ms(b["done_ns"]) - ms(b["launch_ns"]), left=ms(b["launch_ns"]),
                    color="tab:orange", height=0.7)
            ax.plot([ms(b["ready_ns"])], [y], marker="|", color="black", markersize=10)
            labels.append(f"rank {rank} bucket {b['index']} ({b['size_bytes'] / 2**20:.1f} MiB)")
            y += 1
        ax.axvline(ms(r["backward_end_ns"]), color="tab:blue", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the earliest backward start (clocks aligned to rank 0)")
    ax.set_title(f"iteration {records[0]['iteration']}: backward compute (blue) vs bucket "
                 f"all-reduce (orange, | = last gradient in)")
    return save(fig, path)


def exposed_vs_hidden(timelines: list[list[dict]], path) -> str:
    records = timelines[0]
    count = max(len(r["buckets"]) for r in records)
    hidden, exposed = [0.0] * count, [0.0] * count
    for r in records:
        end = r["backward_end_ns"]
        for b in r["buckets"]:
            span_h = max(0, min(b["done_ns"], end) - b["launch_ns"])
            span_e = max(0, b["done_ns"] - max(b["launch_ns"], end))
            hidden[b["index"]] += span_h / 1e6 / len(records)
            exposed[b["index"]] += span_e / 1e6 / len(records)
    fig = new_figure(max(5, 0.5 * count + 2), 4)
    ax = fig.subplots()
    xs = range(count)
    ax.bar(xs, hidden, color="tab:green", label="hidden (during backward)")
    ax.bar(xs, exposed, bottom=hidden, color="tab:red", label="exposed (after backward)")
    ax.set_xticks(list(xs))
    ax.set_xlabel("bucket (index: torch DDP's launch order)")
    ax.set_ylabel("ms in flight per iteration (mean)")
    ax.set_title(f"rank 0, {len(records)} iterations")
    ax.legend()
    return save(fig, path)


def overlapped_iterations(records: list[dict]) -> list[dict]:
    """The records whose next forward (an overlapped optimizer's) is recorded."""
    return [r for r in records if (r.get("overlap") or {}).get("forward_end_ns")]


def overlap_gantt(records: list[dict], path) -> str:
    """Two consecutive iterations of one rank (the last two whose next forward is recorded):
    iteration i's all-reduces running under the forward of i+1 are visible side by side."""
    done = overlapped_iterations(records)
    if len(done) < 2:
        raise ValueError("overlap_gantt needs two consecutive recorded iterations with an "
                         f"overlapped optimizer's events, got {len(done)}")
    pair = done[-2:]
    origin = pair[0]["backward_start_ns"]
    count = max(len(r["buckets"]) for r in pair)
    fig = new_figure(12, 0.32 * (count + 2) + 1.8)
    ax = fig.subplots()

    def ms(ns):
        return (ns - origin) / 1e6

    shown = set()

    def bar(row, start_ns, end_ns, colour, label, height=0.7):
        ax.barh(row, ms(end_ns) - ms(start_ns), left=ms(start_ns), color=colour, height=height,
                label=None if label in shown else label)
        shown.add(label)

    for r, colour in zip(pair, ("tab:orange", "tab:purple")):
        bar(0, r["backward_start_ns"], r["backward_end_ns"], "tab:blue", "backward")
        overlap = r["overlap"]
        bar(0, overlap["forward_start_ns"], overlap["forward_end_ns"], "tab:green",
            "next forward")
        for u in overlap["updates"]:
            bar(1, u["read_ns"], u["reduced_ns"], "tab:red", "forward waits")
            if u["updated_ns"]:
                bar(1, u["reduced_ns"], u["updated_ns"], "tab:olive", "updates")
        for b in r["buckets"]:
            if b["launch_ns"] and b["done_ns"]:
                bar(2 + b["index"], b["launch_ns"], b["done_ns"], colour,
                    f"all-reduces of iteration {r['iteration']}", height=0.6)
            ax.plot([ms(b["ready_ns"])], [2 + b["index"]], marker="|", color="black",
                    markersize=9)
    labels = ["compute", "waits, updates"] + [f"bucket {b}" for b in range(count)]
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since iteration %d's backward start" % pair[0]["iteration"])
    ax.set_title("overlapped optimizer: two iterations (| = bucket full; a bucket's bar spans "
                 "its first chunk's launch to its last chunk's completion)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save(fig, path)


def tuning_phase(tuning: dict, path) -> str:
    """One rank's step times (between synced forwards) over the recorded steps, shaded by what
    the tuners did (observe/recorder.py's `tuning`): bucket autotune blue, the schedule
    tuner orange, decided white."""
    from pyreducer.tuning import announce

    starts, phases = tuning["forward_start_ns"], tuning["phases"]
    fig = new_figure(11, 3.8)
    ax = fig.subplots()
    steps = list(range(1, len(starts)))
    ax.plot(steps, [(b - a) / 1e6 for a, b in zip(starts, starts[1:])], color="black", lw=1,
            marker=".", markersize=3)
    colours = {"buckets": "#cfe2f3", "schedule": "#fce5cd"}
    for first, last, name in announce.spans(phases):
        kind = name.split(":")[0]
        if kind in colours:
            ax.axvspan(first - 0.5, last + 0.5, color=colours[kind], lw=0)
        if name == "decided":
            ax.axvline(first - 0.5, color="tab:green", lw=1)
    ax.set_xlabel("synced step (recorded; shaded: bucket autotune blue, schedule tuning orange, "
                  "green line: decided)")
    ax.set_ylabel("step time, ms (forward to forward)")
    ax.set_title("the tuning phase, rank 0", fontsize=9)
    return save(fig, path)
