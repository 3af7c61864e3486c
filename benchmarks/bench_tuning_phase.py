"""The tuning phase as a new user meets it: the first steps of pyreducer with everything on auto
(`bucket_cap_mb="auto"`, then `model.overlap_optimizer(opt)`, schedule "auto"), paired with torch
DDP at its default caps, from a fresh wrapper, on emulated hosts (pyreducer.tools.netem).

Each round builds both from the same model and runs --steps steps of each back to back (which
goes first alternates by round), timing every step's start on every rank with no barrier inside
(whole-loop timing: the overlapped optimizer's updates run into the next forward). A window of
--window steps costs its slowest rank's time from its first step's start to the step after its
last; every window start is taken (sliding windows). The ratio of a window is pyreducer's over
torch DDP's same window, both the median over rounds. Also recorded: what the tuners were doing
at each step (their phase_name), and their decisions.

    python benchmarks/bench_tuning_phase.py --link 1gbit --model mlp_large --batch 512 \\
        --json tuning_mlp.json --plot tuning_mlp.png
    python benchmarks/bench_tuning_phase.py --link 1gbit --model transformer --json t.json
    python benchmarks/bench_tuning_phase.py --model mlp_large --batch 512 --cache warm ...
(--cache warm: an untimed run first writes the tuning cache the timed runs start from.)

Needs root and iproute2 (network namespaces, tc), as benchmarks/bench.py.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

LIMIT = 1.10  # issue 31: no window of the tuning phase slower than this x torch DDP's


def worker(args) -> None:
    """One rank (inside an emulated host): the rounds, rank 0 writes the marks to args.out."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import netem_worker as nw
    from pyreducer.testing import models

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    spec = models.spec(args.model)
    batch_size = args.batch or models.BENCH_BATCH.get(args.model, 32)
    torch.manual_seed(0)
    base = spec.build()
    runs = []
    if args.cache == "warm":  # one untimed run decides and writes the cache the rounds read
        os.environ["PYREDUCER_TUNING_CACHE"] = args.out + ".cache.json"  # (rank 0 reads it)
        model = nw.build("overlap", base, None)
        opt = nw.optimizer("overlap", model)
        gen = torch.Generator().manual_seed(11 + rank)
        for i in range(args.steps):
            nw.step(model, spec, opt, spec.batch(gen, batch_size))
        nw.finish(model)
        if rank == 0:
            print(f"[{args.model}] cache written by an untimed run ({phase_of(model, opt)})",
                  flush=True)
        del model, opt
        gc.collect()
    for r in range(args.rounds):
        for impl in (("torch", "auto") if r % 2 == 0 else ("auto", "torch")):
            model = nw.build("torch" if impl == "torch" else "overlap", base, None)
            opt = nw.optimizer("torch" if impl == "torch" else "overlap", model)
            gen = torch.Generator().manual_seed(11 + rank)
            marks, phases = [], []
            dist.barrier()
            for i in range(args.steps):
                marks.append(time.perf_counter())
                nw.step(model, spec, opt, spec.batch(gen, batch_size))
                phases.append(phase_of(model, opt))
                if rank == 0 and (i + 1) % 25 == 0:
                    print(f"[{args.model}] round {r + 1}/{args.rounds} {impl}: step {i + 1}/"
                          f"{args.steps} ({phases[-1]})", flush=True)
            nw.finish(model)
            marks.append(time.perf_counter())
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, marks)
            runs.append(dict(impl=impl, round=r, marks=every, phases=phases,
                             autotune_log=getattr(model, "autotune_log", []),
                             schedule_log=getattr(opt, "schedule_log", [])))
            del model, opt
            gc.collect()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, batch=batch_size, cache=args.cache, runs=runs), f,
                      default=str)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as netem_worker: torch 2.13 + Gloo may abort in interpreter teardown


def phase_of(model, opt) -> str:
    """What the tuners do now (torch DDP: "torch")."""
    from pyreducer.tuning import announce

    if not hasattr(model, "_autotune"):
        return "torch"
    return announce.phase(model._autotune, opt)


def windows_s(marks_by_rank: list[list[float]], window: int) -> list[float]:
    """Mean step (s) of every window of `window` steps (sliding), its slowest rank's."""
    steps = len(marks_by_rank[0]) - 1
    return [max(marks[i + window] - marks[i] for marks in marks_by_rank) / window
            for i in range(steps - window + 1)]


def analyse(result: dict, window: int) -> dict:
    """Per window start: pyreducer's and torch DDP's medians over rounds, and their ratio."""
    per = {impl: [windows_s(run["marks"], window) for run in result["runs"]
                  if run["impl"] == impl] for impl in ("auto", "torch")}
    auto = [statistics.median(col) for col in zip(*per["auto"])]
    torch_ = [statistics.median(col) for col in zip(*per["torch"])]
    ratio = [a / t for a, t in zip(auto, torch_)]
    per_round = [[a / t for a, t in zip(ra, rt)] for ra, rt in zip(per["auto"], per["torch"])]
    total = {impl: statistics.median(run["marks"][0][-1] - run["marks"][0][0]
                                     for run in result["runs"] if run["impl"] == impl)
             for impl in ("auto", "torch")}
    first_auto = next(run for run in result["runs"] if run["impl"] == "auto")
    decided = next((i for i, p in enumerate(first_auto["phases"]) if p == "decided"), None)
    after = ratio[decided + 1:] if decided is not None else []
    return dict(window=window, cache=result.get("cache"), auto_ms=[a * 1e3 for a in auto],
                torch_ms=[t * 1e3 for t in torch_], ratio=ratio, per_round_ratio=per_round,
                worst=max(ratio), worst_start=ratio.index(max(ratio)) + 1,
                worst_per_round=[max(r) for r in per_round],
                whole_run_ratio=total["auto"] / total["torch"],
                decided_after_steps=None if decided is None else decided + 1,
                after_decided_ratio=statistics.median(after) if after else None,
                phases=first_auto["phases"])


def plot(result: dict, analysis: dict, path: str) -> str:
    from pyreducer.observe import plot as plots
    from pyreducer.tuning import announce

    fig = plots.new_figure(11, 4.5)
    ax = fig.subplots()
    starts = list(range(1, len(analysis["ratio"]) + 1))
    for k, r in enumerate(analysis["per_round_ratio"]):
        ax.plot(starts, r, lw=0.8, alpha=0.5, label=f"round {k + 1}")
    ax.plot(starts, analysis["ratio"], lw=2, color="black", label="median over rounds")
    ax.axhline(LIMIT, color="red", ls="--", lw=1, label=f"limit {LIMIT}")
    ax.axhline(1.0, color="grey", lw=0.8)
    colours = {"buckets": "#cfe2f3", "schedule": "#fce5cd"}
    for first, last, phase in announce.spans(analysis["phases"]):
        kind = phase.split(":")[0]
        if kind in colours:
            ax.axvspan(first - 0.5, last + 0.5, color=colours[kind], alpha=0.5, lw=0)
    ax.set_xlabel(f"first step of the {analysis['window']}-step window (shaded: bucket tuning "
                  f"blue, schedule tuning orange)")
    ax.set_ylabel("pyreducer auto / torch DDP (window time)")
    ax.set_title(f"{result['model']} (batch {result['batch']}, cache {result.get('cache', 'cold')}"
                 f"), {result['hosts']} hosts at "
                 f"{result['link']}: worst window {analysis['worst']:.3f} (from step "
                 f"{analysis['worst_start']}), whole run {analysis['whole_run_ratio']:.3f}")
    ax.legend(fontsize=7, loc="upper right")
    return plots.save(fig, path)


def report(result: dict, analysis: dict) -> str:
    from pyreducer.tuning import announce

    lines = [f"{result['model']} (batch {result['batch']}), {result['hosts']} hosts at "
             f"{result['link']}, {len(result['runs']) // 2} rounds of {len(analysis['phases'])} "
             f"steps, tuning cache {result.get('cache', 'cold')}",
             f"  worst {analysis['window']}-step window: {analysis['worst']:.3f} of torch DDP "
             f"(from step {analysis['worst_start']}; per round "
             + ", ".join(f"{w:.3f}" for w in analysis["worst_per_round"]) + ")",
             f"  whole run: {analysis['whole_run_ratio']:.3f}; decided after step "
             f"{analysis['decided_after_steps']}; after that: "
             + (f"{analysis['after_decided_ratio']:.3f}" if analysis["after_decided_ratio"]
                else "-")]
    for first, last, phase in announce.spans(analysis["phases"]):
        span = analysis["ratio"][max(0, first - analysis["window"]):last]
        worst = f", worst window touching it {max(span):.3f}" if span else ""
        lines.append(f"    steps {first:3d}-{last:3d} {phase}{worst}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="mlp_large")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window", type=int, default=12)
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold",
                        help="cold: every run tunes from scratch; warm: an untimed run first "
                             "writes the tuning cache (pyreducer/tuning/memory.py) that the "
                             "timed runs start from")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from bench import cpu_model
    from pyreducer.tools.netem import EmulatedCluster

    with tempfile.TemporaryDirectory(prefix="pyreducer-tuning-") as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out,
                "--model", args.model, "--steps", str(args.steps), "--rounds", str(args.rounds),
                "--cache", args.cache]
        if args.batch:
            argv += ["--batch", str(args.batch)]
        with EmulatedCluster(args.nproc, args.link, port=29611 + os.getpid() % 1000) as cluster:
            procs = [cluster.launch(rank, argv, env={"PYTHONUNBUFFERED": "1"},
                                    stdout=None if rank == 0 else open(os.devnull, "w"),
                                    stderr=None if rank == 0 else open(os.devnull, "w"))
                     for rank in range(args.nproc)]
            codes = cluster.wait(procs, timeout_s=args.timeout)
        if any(codes):
            raise SystemExit(f"ranks exited with {codes}")
        with open(out) as f:
            result = json.load(f)
    import platform

    import torch
    result.update(link=args.link, hosts=args.nproc, environment=dict(
        torch=torch.__version__, python=platform.python_version(), cores=os.cpu_count(),
        cpu=cpu_model(), date=time.strftime("%Y-%m-%d %H:%M:%S"), threads_per_rank=1))
    analysis = analyse(result, args.window)
    print(report(result, analysis), flush=True)
    if args.plot:
        print("wrote", plot(result, analysis, args.plot))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(result, analysis=analysis), f, indent=1)


if __name__ == "__main__":
    main()
