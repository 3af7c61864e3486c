"""Markdown tables from a benchmarks/bench.py JSON result, for the records in benchmarks/results/.

    python benchmarks/tables.py result.json            # one row per (model, link, hosts, cap)
    python benchmarks/tables.py result.json --sweep    # pyreducer / torch DDP per cap (paired)
    python benchmarks/tables.py result.json --plot sweep.png   # step time vs cap, a panel a model
    python benchmarks/tables.py result.json --overlap  # the overlapped optimizer against its targets
Columns that a run did not measure are shown as "-".
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

# For pyreducer.observe.plot when run as a script from a checkout (appended: an installed
# pyreducer comes first).
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


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


def last_event(entry: dict, variant: str, event: str, log: str = "schedule") -> dict | None:
    """The last `event` ("planned", "chosen", ...) of the variant's schedule log (or of its
    bucket autotune's: log="log"), or None."""
    events = [x for x in entry.get(f"{variant}_{log}", []) if x.get("event") == event]
    return events[-1] if events else None


def planned_link(planned: dict):
    """The link a planned event's schedules were predicted on (the loaded one), as a LinkModel."""
    from pyreducer.tuning.linkmodel import LinkModel

    link = planned["link"]
    return LinkModel(link["latency_s"], link["bandwidth_bytes_per_s"], link.get("contention", 0.0),
                     link.get("queue_s", 0.0))


def first_read_ms(entry: dict, variant: str, ranks: int) -> float | None:
    """What no schedule can hide, from the variant's last overlapped record: the all-reduce of
    the bucket the next forward reads first, on the planner's (loaded) link, less the part of it
    that could run before the backward ends (it starts once that bucket is full). The forward
    cannot start before it completes, and backward has nothing left to compute. None without an
    overlapped record or a planned link."""
    planned = last_event(entry, variant, "planned")
    records = [r for r in entry.get(f"{variant}_timeline", [])  # followed by a forward
               if (r.get("overlap") or {}).get("updates") and r["overlap"]["forward_start_ns"]]
    if planned is None or "link" not in planned or not records or ranks < 2:
        return None
    record = records[-1]
    first = min(record["overlap"]["updates"], key=lambda u: u["read_ns"])["bucket"]
    bucket = record["buckets"][first]
    allreduce_ms = planned_link(planned).allreduce_s(bucket["size_bytes"], ranks) * 1e3
    head_start_ms = max(0, record["backward_end_ns"] - bucket["ready_ns"]) * 1e-6
    return max(0.0, allreduce_ms - head_start_ms)


@functools.lru_cache(maxsize=None)
def first_read(model: str) -> tuple[str, dict[str, int]]:
    """The first module with parameters whose forward runs in `model`'s forward (a bench model
    of pyreducer.testing.models; leaf modules), and its parameters' bytes by name: the next
    forward computes nothing before their update, and all that follows reads its output."""
    import torch

    from pyreducer.testing.models import spec

    s = spec(model)
    net = s.build()
    order: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda *_, name=name: order.append(name))
             for name, m in net.named_modules()
             if not any(True for _ in m.children()) and any(True for _ in m.parameters())]
    with torch.no_grad():
        s.loss(net, s.batch(torch.Generator().manual_seed(0), 2))
    for hook in hooks:
        hook.remove()
    name = order[0]
    return name, {f"{name}.{p}": t.numel() * t.element_size()
                  for p, t in net.get_submodule(name).named_parameters()}


@functools.lru_cache(maxsize=None)
def model_bytes(model: str) -> int:
    """All of a bench model's parameters' bytes (a tied parameter once)."""
    from pyreducer.testing.models import spec

    return sum(t.numel() * t.element_size() for t in spec(model).build().parameters())


def exact_bound_ms(run: dict, entry: dict, variant: str) -> float | None:
    """A lower bound on the step of any exact schedule, whatever its buckets, chunks and order,
    on a machine where communication costs the compute nothing: the compute alone (forward +
    backward + step, measured without communication) plus the all-reduce of the first module's
    parameters (first_read), less the part of it that could run before the backward ends (from
    when their last gradient was ready in the variant's last record); and no less than one flat
    all-reduce of all gradients (measured). Their sums must be exactly torch DDP's, so that
    all-reduce starts no earlier than their gradients are complete, and the next forward starts
    no earlier than it ends. It is taken as their share of the flat all-reduce's time: no more
    than it takes alone (the flat one's latency is spread over more bytes). None without a
    record of their gradients or a compute split."""
    split = entry.get("compute_split_ms")
    records = entry.get(f"{variant}_timeline", [])
    if not split or not records or run["hosts"] < 2:
        return None
    _, first = first_read(run["model"])
    record = records[-1]
    ready = [g["ready_ns"] for g in record["grads"] if g["name"] in first]
    if len(ready) != len(first):  # a record without them: no head start known
        return None
    head_start_ms = max(0, record["backward_end_ns"] - max(ready)) * 1e-6
    share = sum(first.values()) / model_bytes(run["model"])
    exposed_ms = max(0.0, share * run["comm_only_ms"] - head_start_ms)
    compute_ms = split["forward"] + split["backward"] + split["step"]
    return max(compute_ms + exposed_ms, run["comm_only_ms"])


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


def overlap_table(doc: dict, variant: str = "overlap") -> str:
    """The overlapped variant against issue 14's targets, one row per (model, link, hosts,
    cap): / torch DDP (paired), / the autotuned barrier, / the floor without the barrier, / the
    floor with contention (compute slowed as it is beside communication), that plus the
    first read's exposed all-reduce (first_read_ms), the share of the
    probed bandwidth the profiled backwards got (schedule.loaded_link), the schedule chosen
    and its prediction against the benchmark's time; and the exact bound (exact_bound_ms) over
    the floor: above 1.10, no exact schedule meets the floor target even without contention."""
    head = ["link", "hosts", "model", "cap", "torch DDP", "auto (barrier)", variant,
            f"{variant} / DDP (95% CI)", f"{variant} / auto", "floor", f"{variant} / floor",
            "floor with contention", f"{variant} / it", "+ first read", f"{variant} / it",
            "link scale", "schedule chosen", "predicted / measured", "exact bound / floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in doc["runs"]:
        for cap, e in run["results"].items():
            if variant not in e:
                continue
            chosen = last_event(e, variant, "chosen")
            schedule, predicted = "-", "-"
            planned = last_event(e, variant, "planned")
            scale = planned.get("link", {}).get("bandwidth_scale") if planned else None
            first = first_read_ms(e, variant, run["hosts"])
            bound = None if first is None or "contended_floor_ms" not in e else \
                e["contended_floor_ms"] + first
            exact = exact_bound_ms(run, e, variant)
            if chosen:
                schedule = chosen["describe"]
                predicted = f"{chosen['predicted_ms'] / e[variant]['median_ms']:.2f}"
            lines.append("| " + " | ".join([
                run["link"], str(run["hosts"]), run["model"], cap, _ms(e, "torch"),
                _ms(e, "auto"), _ms(e, variant), _paired(e, variant),
                (f"{e[variant]['median_ms'] / e['auto']['median_ms']:.3f}" if "auto" in e
                 else "-"),
                f"{e['floor_ms']:.1f}" if "floor_ms" in e else "-", _over(e, variant, "floor_ms"),
                f"{e['contended_floor_ms']:.1f}" if "contended_floor_ms" in e else "-",
                _over(e, variant, "contended_floor_ms"),
                "-" if bound is None else f"{bound:.1f}",
                "-" if bound is None else f"{e[variant]['median_ms'] / bound:.3f}",
                "-" if scale is None else f"{scale:.2f}", schedule, predicted,
                "-" if exact is None or "floor_ms" not in e else
                f"{exact / e['floor_ms']:.3f}"]) + " |")
    return "\n".join(lines)


def plot_sweep(runs: list[dict], path: str) -> None:
    """Step time vs bucket cap: one panel per model, colour = link and hosts, dashed = torch DDP,
    solid = pyreducer; DDP's default caps (1 MiB first bucket, then 25 MB) as a marker at 25."""
    from pyreducer.observe.plot import new_figure

    models = list(dict.fromkeys(run["model"] for run in runs))
    setups = list(dict.fromkeys((run["link"], run["hosts"]) for run in runs))
    colours = {s: f"C{i}" for i, s in enumerate(setups)}
    cols = min(2, len(models))
    rows = (len(models) + cols - 1) // cols
    fig = new_figure(6 * cols, 4 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, model in zip(axes.flat, models):
        for run in (r for r in runs if r["model"] == model):
            colour = colours[(run["link"], run["hosts"])]
            caps = [c for c in run["results"] if c != "default"]
            for variant, style in (("torch", "--"), ("pyreducer", "-")):
                if not caps or variant not in run["results"][caps[0]]:
                    continue
                ax.plot([float(c) for c in caps],
                        [run["results"][c][variant]["median_ms"] for c in caps], style,
                        marker="o", markersize=3, color=colour,
                        label=f"{'torch DDP' if variant == 'torch' else 'pyreducer'} "
                              f"{run['link']}, {run['hosts']} hosts")
                default = run["results"].get("default", {}).get(variant)
                if default:
                    ax.plot([25.0], [default["median_ms"]], "x" if variant == "torch" else "+",
                            color=colour, markersize=9)
        ax.set_xscale("log", base=2)
        ax.set_title(model)
        ax.set_xlabel("bucket_cap_mb (x/+ at 25: DDP's default caps)")
        ax.set_ylabel("median step ms (slowest rank)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    fig.suptitle("step time vs bucket size on the emulated network")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--overlap", action="store_true",
                        help="the overlapped optimizer's table (variant 'overlap')")
    parser.add_argument("--plot", help="write the sweep plot (PNG) here instead of a table")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        doc = json.load(f)
    if args.plot:
        plot_sweep(doc["runs"], args.plot)
        print(f"wrote {args.plot}")
        return 0
    print(overlap_table(doc) if args.overlap else sweep_table(doc) if args.sweep
          else main_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
