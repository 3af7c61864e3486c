"""`python -m pyreducer simulate`: predict many-host runs from one recorded profile.

    python -m pyreducer simulate --profile run/trace --ranks 2,8,64,512 --link 1gbit,10gbit,100gbit

The profile (profile.json, written by `python -m pyreducer trace`, `report` and `demo`) holds one
rank's gradient
ready times, sizes, backward, forward and optimizer times. For each rank count and link, the
step model (pyreducer.tuning.stepmodel) predicts the step time of torch DDP's default plan and of
the optimal plan (pyreducer.tuning.planner), with a nominal link model (rate, 50 us latency)
and ring all-reduce. Scaling efficiency = compute-only step / predicted step.
Left out: contention (nominal links have none), stragglers, hierarchical topologies
(intra/inter-node), congestion, and per-message latency beyond one term per all-reduce: real
large-scale runs will be slower.
"""
from __future__ import annotations

import json
import os

from pyreducer.observe import InputError
from pyreducer.tuning import planner, stepmodel
from pyreducer.tuning.linkmodel import LinkModel
from pyreducer.wrapper.bucketing import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES

DEFAULT_CAPS = [DEFAULT_FIRST_BUCKET_CAP_BYTES, DEFAULT_BUCKET_CAP_BYTES]  # torch DDP's


PRODUCERS = ("`python -m pyreducer trace --out DIR`, `python -m pyreducer report DIR` (after "
             "`PYREDUCER_TRACE=DIR torchrun ... train.py`) or `make demo` (run/demo) write one")


def load_profile(path) -> stepmodel.Profile:
    """The step profile in `path` (a profile.json, or a folder holding one); InputError saying
    which command writes one if there is none or it is not a profile."""
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file or folder; {PRODUCERS}")
    file = os.path.join(path, "profile.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise InputError(f"{path} holds no profile.json; {PRODUCERS}")
    try:
        with open(file) as f:
            return stepmodel.Profile(**json.load(f))
    except (ValueError, TypeError) as error:  # not JSON, or not a profile's fields
        raise InputError(f"{file}: not a step profile ({error}); {PRODUCERS}") from None


def links_from_rates(rates: list[str]) -> dict[str, LinkModel]:
    """Nominal links by rate name; InputError naming a rate that is not one."""
    links = {}
    for rate in rates:
        try:
            links[rate] = LinkModel.from_rate(rate)
        except ValueError as error:
            raise InputError(f"--link: {error}") from None
    return links


def simulate(profile: stepmodel.Profile, ranks: list[int], links: list[str]) -> list[dict]:
    compute = profile.forward_ms + profile.backward_ms + profile.optimizer_ms
    default = stepmodel.cap_plan(profile, DEFAULT_CAPS)
    rows = []
    for link_name, link in links_from_rates(links).items():
        for n in ranks:
            best = planner.best_plan(profile, link, n)
            default_ms = stepmodel.predict_step_ms(profile, default, link, n)
            best_ms = stepmodel.predict_step_ms(profile, best, link, n)
            rows.append(dict(link=link_name, ranks=n, compute_ms=compute,
                             ddp_default_ms=default_ms, best_ms=best_ms,
                             best_buckets=len(best),
                             efficiency_default=compute / default_ms,
                             efficiency_best=compute / best_ms))
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'link':>8} {'ranks':>6} {'compute':>9} {'DDP default':>12} {'best plan':>10} "
             f"{'buckets':>8} {'eff. default':>13} {'eff. best':>10}"]
    for r in rows:
        lines.append(f"{r['link']:>8} {r['ranks']:>6} {r['compute_ms']:>9.1f} "
                     f"{r['ddp_default_ms']:>12.1f} {r['best_ms']:>10.1f} {r['best_buckets']:>8} "
                     f"{r['efficiency_default']:>13.2f} {r['efficiency_best']:>10.2f}")
    lines.append("times in ms per step; model: pyreducer/tools/simulate.py (what it leaves out)")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> str:
    from pyreducer.observe.plot import new_figure, save

    fig = new_figure(8, 5)
    ax = fig.subplots()
    for link in dict.fromkeys(r["link"] for r in rows):
        sel = [r for r in rows if r["link"] == link]
        xs = [r["ranks"] for r in sel]
        line, = ax.plot(xs, [r["best_ms"] for r in sel], marker="o", label=f"{link} best plan")
        ax.plot(xs, [r["ddp_default_ms"] for r in sel], "--", marker="x", color=line.get_color(),
                label=f"{link} DDP default")
    ax.axhline(rows[0]["compute_ms"], color="gray", linestyle=":", label="compute only")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("predicted step time, ms")
    ax.set_title("predicted step time vs ranks (ring all-reduce, nominal links)")
    ax.legend(fontsize=8)
    return save(fig, path)
