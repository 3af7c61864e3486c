"""Benchmarks on an emulated cluster network (pyreducer.tools.netem): pyreducer vs torch DDP vs the
classic baselines, bucket-size sweeps, and the overlap bound.

Each rank runs in its own network namespace ("host") with its NIC rate-limited by tc tbf and is
pinned to one core; all variants run in the same processes on the same model, seed and data,
after a check that the communicating ones end with the same parameters. Variants:
  compute    no communication (gives forward, backward and optimizer-step times)
  per_param  after backward, one all-reduce per gradient (the classic tutorial)
  flat       after backward, one flat all-reduce of all gradients (no overlap; Apex delay_allreduce)
  torch      torch DDP at the same bucket cap;  pyreducer  pyreducer at that cap
  auto       pyreducer with bucket_cap_mb="auto" (online autotune, 75 warm-up steps)
  overlapped pyreducer at that cap with its overlapped optimizer (model.overlap_optimizer,
             --schedule auto: chunks in a planned order; fifo: torch DDP's order, with
             --hold-back K the first layers' K buckets first); time it with --loop-steps N
  overlap    pyreducer with its own schedule: autotuned caps, then the overlapped optimizer's
             planned and measured schedule (70 warm-up steps)
  sharded    the overlapped optimizer with the optimizer's state and update sharded
             (overlap_optimizer(shard=True)), its own schedule, on 4 MB buckets (autotune refuses
             shard=True: each new plan would move the state between ranks)
With --loop-steps N every variant is timed in blocks of N steps with no barrier inside (the
per-step barrier would wait behind the overlapped variant's in-flight buckets and erase the
overlap being measured); blocks alternate like steps.
Step time = the slowest rank's. Variants alternate step by step (order reversed every step), so
the ratio to torch DDP comes from adjacent, paired steps, with a bootstrap 95% interval;
--no-interleave runs each variant for --steps steps in turn instead (the first session's records).
Overlap bound = forward + max(backward, comm) + step: compute-only medians of the rank with the
largest bound (step times are the slowest rank's too), comm the measured time of one flat
all-reduce of all gradients on this network. With one core per host, communication also costs
compute (Gloo and the kernel's network stack share the core), so the run also measures backward
while a flat all-reduce runs and reports the bound with that backward ("with contention").

    python benchmarks/bench.py --link 1gbit --nproc 2 --model transformer --impl all --json out.json
    python benchmarks/bench.py --link 1gbit --model transformer --impl compute,torch,pyreducer,auto \\
        --compile inductor --gantt gantt.png --json compiled.json
    python benchmarks/bench.py --link 1gbit,10gbit --model mlp_large --impl torch,pyreducer \\
        --bucket-cap-mb 0.5,1,2,4,8,16,25,64 --json sweep.json --plot sweep.png
Needs root and iproute2 (network namespaces, tc); exits non-zero saying so otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))

from pyreducer.testing import third_party  # noqa: E402
from pyreducer.tools.netem import EmulatedCluster, NetemUnavailable, check_available  # noqa: E402

sys.path.insert(0, HERE)
from tables import plot_sweep  # noqa: E402

ALL = "compute,per_param,flat,torch,pyreducer,auto,overlapped,overlap,sharded"


def run_one(model, link, nproc, variants, caps, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="pyreducer-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, os.path.join(HERE, "netem_worker.py"), "--model", model,
                "--variants", variants, "--caps", caps, "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--out", out]
        if args.batch:
            argv += ["--batch", str(args.batch)]
        if args.interleave:
            argv += ["--interleave"]
        if args.compile:
            argv += ["--compile", args.compile]
        argv += ["--buffers", args.buffers]
        if args.caps_once:  # a fresh cache, this run's: its first autotuned variant decides
            argv += ["--tuning-cache", os.path.join(tmp, "tuning.json")]
        if args.loop_steps:
            argv += ["--loop-steps", str(args.loop_steps), "--hold-back", str(args.hold_back),
                     "--schedule", args.schedule]
        start = time.monotonic()
        print(f"== {model}, {nproc} hosts, link {link}, caps {caps} MB", flush=True)
        with EmulatedCluster(nproc, link, port=29511 + os.getpid() % 1000) as cluster:
            procs = [cluster.launch(rank, argv, env={"PYTHONUNBUFFERED": "1"},
                                    stdout=None if rank == 0 else subprocess_devnull(),
                                    stderr=None if rank == 0 else subprocess_devnull())
                     for rank in range(nproc)]
            codes = cluster.wait(procs, timeout_s=args.timeout)
        if any(codes):
            raise SystemExit(f"{model} at {link}: ranks exited with {codes}")
        with open(out) as f:
            result = json.load(f)
        result.update(link=link, hosts=nproc, seconds=time.monotonic() - start)
        return result


def subprocess_devnull():
    return open(os.devnull, "w")


def table(result) -> str:
    lines = [f"{result['model']} (batch {result['batch']}), {result['hosts']} hosts at "
             f"{result['link']}; one flat all-reduce of all gradients: "
             f"{result['comm_only_ms']:.1f} ms; parity max diff: "
             + ", ".join(f"{k} {v:.1g}" for k, v in result["parity_max_diff"].items())]
    if result.get("compiled"):
        lines.append(f"  every variant's module compiled: torch.compile(backend="
                     f"{result['compiled']!r})")
    for cap, entry in result["results"].items():
        bound = entry.get("bound_ms")
        torch_ms = entry.get("torch", {}).get("median_ms")
        lines.append(f"  bucket cap {cap} MB" + (f" (pyreducer: {entry['buckets']} buckets)"
                                                  if "buckets" in entry else ""))
        lines.append(f"    {'variant':10s} {'median ms':>10s} {'IQR':>17s} {'/ torch DDP':>12s}"
                     f" {'/ bound':>8s}")
        for variant in ALL.split(","):
            if variant not in entry:
                continue
            e = entry[variant]
            ratio = f"{e['median_ms'] / torch_ms:.3f}" if torch_ms else "-"
            vs_bound = f"{e['median_ms'] / bound:.3f}" if bound and variant != "compute" else "-"
            lines.append(f"    {variant:10s} {e['median_ms']:10.1f} [{e['p25_ms']:7.1f}, "
                         f"{e['p75_ms']:7.1f}] {ratio:>12s} {vs_bound:>8s}")
        for over, name in (("torch", "torch DDP"), ("auto", "auto (the barrier)")):
            for variant, paired in entry.get(f"paired_vs_{over}", {}).items():
                lines.append(f"    {variant} / {name}, paired steps: {paired['ratio']:.3f} "
                             f"(95% CI {paired['ci95'][0]:.3f}-{paired['ci95'][1]:.3f}, "
                             f"{paired['n']} pairs)")
        if bound:
            s = entry["compute_split_ms"]
            lines.append(f"    bound = forward {s['forward']:.1f} + max(backward {s['backward']:.1f},"
                         f" comm {result['comm_only_ms']:.1f}) + step {s['step']:.1f} = "
                         f"{bound:.1f} ms")
        if "floor_ms" in entry:
            compute = s["forward"] + s["backward"] + s["step"]
            lines.append(f"    floor without the barrier = max(compute {compute:.1f}, comm "
                         f"{result['comm_only_ms']:.1f}) = {entry['floor_ms']:.1f} ms")
        if "pyreducer_stats" in entry:
            st = entry["pyreducer_stats"]
            lines.append(f"    pyreducer overlap: {st.get('overlap_fraction', float('nan')):.2f} of "
                         f"{st.get('comm_busy_ms', float('nan')):.1f} ms communication hidden in "
                         f"backward (last 5 iterations)")
        graphs = entry.get("pyreducer_compiled", {}).get("graphs", [])
        if graphs:
            lines.append(f"    pyreducer split {len(graphs)} captured graph(s) into "
                         f"{[g['pieces'] for g in graphs]} piece(s) at its buckets")
        for variant in ("overlapped", "overlap", "sharded"):
            lines += schedule_lines(variant, entry)
            start, later = (entry.get(f"{variant}_buffer_{k}_ms") for k in ("start", "wait"))
            if start or later:
                lines.append(f"    {variant}: the buffers' broadcast, median ms a forward per "
                             f"rank: at the forward's start "
                             + ", ".join(f"{w:.1f}" for w in start or []) + "; later "
                             + ", ".join(f"{w:.1f}" for w in later or []))
        if "backward_under_comm_ms" in entry:
            lines.append(f"    backward while a flat all-reduce runs: "
                         f"{entry['backward_under_comm_ms']:.1f} ms; bound with it: "
                         f"{entry['contended_bound_ms']:.1f} ms")
        if "contended_floor_ms" in entry:
            lines.append(f"    forward + backward beside one flat all-reduce: "
                         f"{entry['compute_under_comm_ms']:.1f} ms; floor with contention = "
                         f"max(that + step, comm) = {entry['contended_floor_ms']:.1f} ms")
    return "\n".join(lines)


def schedule_lines(variant, entry) -> list[str]:
    """The overlapped variant's schedule log (pyreducer/overlap/schedule_tuner.py) in words."""
    lines = []
    for event in entry.get(f"{variant}_schedule", []):
        if event["event"] == "planned":
            lines.append(f"    {variant} schedule, candidates (predicted ms): " + ", ".join(
                f"{t['describe']} {t['predicted_ms']:.1f}" for t in event["trials"])
                + f"; torch DDP's order {event['fifo_predicted_ms']:.1f}")
        elif event["event"] == "measured":
            lines.append(f"      measured {event['describe']}: {event['measured_ms']:.1f} ms")
        elif event["event"] == "runoff":
            lines.append(f"      run-off, fresh windows: {event['describe']} "
                         f"{event['measured_ms']:.1f} ms, the barrier {event['barrier_ms']:.1f} ms")
        elif event["event"] == "chosen":
            measured = entry[variant]["median_ms"]
            trials = "" if "measured_ms" not in event else \
                f"; {measured / event['measured_ms']:.2f} of its trials"  # none: a fixed size
            lines.append(f"    {variant} schedule chosen: {event['describe']}; predicted "
                         f"{event['predicted_ms']:.1f} ms, timed in the benchmark {measured:.1f}"
                         f" ms ({measured / event['predicted_ms']:.2f} of predicted{trials})")
    return lines


def draw_overlap_gantts(result, path) -> None:
    from pyreducer.observe import plot

    for cap, entry in result["results"].items():
        for variant in ("overlapped", "overlap", "sharded"):
            if not entry.get(f"{variant}_timeline"):
                continue
            if len(plot.overlapped_iterations(entry[f"{variant}_timeline"])) < 2:
                print(f"no overlap Gantt for {variant} at cap {cap}: no recorded iterations "
                      f"crossed the step (the schedule chosen was torch DDP's step barrier)",
                      flush=True)
                continue
            stem = path[:-4] if path.endswith(".png") else path
            out = (f"{stem}_{variant}_{result['model']}_{result['link']}_{result['hosts']}hosts_"
                   f"{cap}.png")
            print("wrote", plot.overlap_gantt(entry[f"{variant}_timeline"], out), flush=True)


def draw_gantts(result, path) -> None:
    """pyreducer's last recorded iteration on rank 0, per cap (compiled or eager)."""
    from pyreducer.observe import plot

    for cap, entry in result["results"].items():
        if entry.get("pyreducer_timeline"):
            stem = path[:-4] if path.endswith(".png") else path
            mode = f"compiled_{result['compiled']}" if result.get("compiled") else "eager"
            out = f"{stem}_{result['model']}_{result['link']}_{mode}_{cap}.png"
            print("wrote", plot.gantt([entry["pyreducer_timeline"]], out), flush=True)


def hosts_unavailable(script: str) -> bool:
    """True, having said why on stderr, where emulated hosts cannot be set up (no root or no
    iproute2): the benchmarks then stop rather than fall back to loopback."""
    try:
        check_available()
    except NetemUnavailable as error:
        print(f"{script}: cannot emulate hosts here: {error}. Not falling back to loopback.",
              file=sys.stderr)
        return True
    return False


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or platform.processor() where that is absent:
    machines of one kind differ (vgg's compute-only step: 190 ms on one, 270-290 on another)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment(args):
    import torch
    try:
        import transformers
        packages = dict(transformers=transformers.__version__)
    except ImportError:
        packages = {}
    return dict(torch=torch.__version__, python=platform.python_version(), **packages,
                cores=os.cpu_count(), machine=platform.machine(), cpu=cpu_model(),
                backend="gloo",
                emulation="network namespaces + bridge, tc tbf per host NIC (no latency model)",
                threads_per_rank=1, date=time.strftime("%Y-%m-%d %H:%M:%S"),
                steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                interleave=args.interleave, loop_steps=args.loop_steps,
                buffers=args.buffers,
                hold_back=args.hold_back, schedule=args.schedule)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="1gbit", help="rates, comma-separated; 'unlimited' ok")
    parser.add_argument("--nproc", type=int, default=2, help="hosts (one rank each)")
    parser.add_argument("--model", default="transformer", help="comma-separated")
    parser.add_argument("--impl", default="all", help=f"'all' or a subset of {ALL}")
    parser.add_argument("--bucket-cap-mb", default="default",
                        help="comma-separated (a sweep); 'default' = DDP's default caps")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                        help="alternate the variants every step (default) rather than run each "
                             "for --steps steps in turn; gives paired ratios to torch DDP with "
                             "95%% bootstrap intervals")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--loop-steps", type=int, default=0,
                        help="time blocks of N steps without a barrier inside (for overlap)")
    parser.add_argument("--hold-back", type=int, default=0,
                        help="the overlapped variant's hold_back")
    parser.add_argument("--schedule", default="auto",
                        help="the overlapped variant's schedule (overlap_optimizer(schedule=)): "
                             "auto, fifo, or a chunk size in MB")
    parser.add_argument("--overlap-gantt", metavar="PNG",
                        help="two overlapped iterations of rank 0 (per model, link and cap: "
                             "the name gets _<model>_<link>_<cap> before .png)")
    parser.add_argument("--compile", metavar="BACKEND",
                        help="torch.compile every variant's module (nanoGPT's order: compile, "
                             "then wrap), e.g. inductor")
    parser.add_argument("--gantt", metavar="PNG",
                        help="Gantt of pyreducer's last recorded iteration (rank 0), per run")
    parser.add_argument("--buffers", choices=("start", "read", "deferred"), default="deferred",
                        help="an A/B switch: overlapped variants wait for the buffers' broadcast "
                             "at the forward's start, where first read, or also defer "
                             "BatchNorm's statistics (pyreducer's behaviour, the default)")
    parser.add_argument("--caps-once", action="store_true",
                        help="the autotuned variants share one tuning cache, fresh for the run: "
                             "auto's caps are recalled by overlap (and confirmed in one window), "
                             "so overlap / auto compares schedules on the same buckets, not two "
                             "draws of the caps' trial noise (default: each tunes afresh)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json")
    parser.add_argument("--plot", help="PNG of step time vs bucket cap (sweeps)")
    args = parser.parse_args(argv)
    if hosts_unavailable("bench.py"):
        return 2
    variants = ALL if args.impl == "all" else args.impl
    results, skipped = [], {}
    for model in args.model.split(","):
        why = third_party.unavailable(model)
        if why:
            print(f"== {model}: skipped: {why}", flush=True)
            skipped[model] = why
            continue
        for link in args.link.split(","):
            result = run_one(model, link, args.nproc, variants, args.bucket_cap_mb, args)
            print(table(result), flush=True)
            if args.overlap_gantt:
                draw_overlap_gantts(result, args.overlap_gantt)
            if args.gantt:
                draw_gantts(result, args.gantt)
            results.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=environment(args), runs=results, skipped=skipped), f,
                      indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot_sweep(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
