"""Command line: `python -m pyreducer demo | trace | simulate | netem`."""
from __future__ import annotations

import argparse


def trace_worker(rank, world_size, model_name, steps, bucket_cap_mb, batch, keep):
    import torch

    from pyreducer import DistributedDataParallel

    from pyreducer.testing import models
    from pyreducer.observe.trace import gather_timelines

    import statistics
    import time

    spec = models.spec(model_name)
    torch.manual_seed(0)
    model = DistributedDataParallel(spec.build(), bucket_cap_mb=bucket_cap_mb,
                                    timeline_iterations=keep)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    forward_ms, optimizer_ms = [], []
    for step in range(steps):
        opt.zero_grad()
        t0 = time.perf_counter()
        loss = spec.loss(model, spec.batch(gen, batch))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        forward_ms.append((t1 - t0) * 1e3)
        optimizer_ms.append((time.perf_counter() - t2) * 1e3)
        if rank == 0:
            print(f"  step {step + 1}/{steps}", flush=True)
    profile = model.profile(statistics.median(forward_ms), statistics.median(optimizer_ms), keep)
    return gather_timelines(model, keep), vars(profile)


def trace_main(args) -> int:
    from pyreducer.observe.report import write_report
    from pyreducer.testing import run_ranks

    print(f"pyreducer trace: model '{args.model}', {args.nproc} local Gloo ranks, "
          f"bucket_cap_mb={args.bucket_cap_mb}, {args.steps} steps", flush=True)
    results = run_ranks(trace_worker, args.nproc, timeout_s=1200,
                        args=(args.model, args.steps, args.bucket_cap_mb, args.batch,
                              min(args.steps, args.keep)))
    timelines, profile = results[0]
    report = write_report(timelines, args.out, profile=profile)
    print(report["summary"])
    for name, path in report["paths"].items():
        print(f"wrote {path}")
    return 0


def netem_main(args) -> int:
    import sys

    from pyreducer.tools.netem import EmulatedCluster, NetemUnavailable

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("netem: give the command to run after --", file=sys.stderr)
        return 2
    try:
        with EmulatedCluster(args.hosts, args.rate) as cluster:
            procs = [cluster.launch(rank, command) for rank in range(args.hosts)]
            codes = cluster.wait(procs, timeout_s=args.timeout)
    except NetemUnavailable as error:
        print(f"netem: {error}; not running on loopback instead", file=sys.stderr)
        return 2
    print(f"netem: exit codes per rank: {codes}")
    return max(codes)


def simulate_main(args) -> int:
    import json
    import os

    from pyreducer.tools import simulate

    profile = simulate.load_profile(args.profile)
    rows = simulate.simulate(profile, [int(r) for r in args.ranks.split(",")],
                             args.link.split(","))
    print(simulate.format_rows(rows))
    base = args.profile if os.path.isdir(args.profile) else os.path.dirname(args.profile)
    png = args.out or os.path.join(base, "simulate.png")
    simulate.plot(rows, png)
    with open(os.path.splitext(png)[0] + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {png}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyreducer")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train with torch DDP and pyreducer side by side")
    demo.add_argument("--nproc", type=int, default=2)
    demo.add_argument("--steps", type=int, default=20)
    demo.add_argument("--model", default="demo")
    demo.add_argument("--out", default="run/demo", help="where the trace and plots go")
    trace = commands.add_parser("trace", help="train with pyreducer; write trace, plots, summary")
    trace.add_argument("--model", default="mlp_large")
    trace.add_argument("--nproc", type=int, default=2)
    trace.add_argument("--bucket-cap-mb", type=float, default=None)
    trace.add_argument("--steps", type=int, default=20)
    trace.add_argument("--batch", type=int, default=32)
    trace.add_argument("--keep", type=int, default=5, help="iterations kept in the trace")
    trace.add_argument("--out", default="run/trace")
    simulate = commands.add_parser("simulate", help="predict many-host runs from a profile")
    simulate.add_argument("--profile", required=True, help="a trace output dir (profile.json)")
    simulate.add_argument("--ranks", default="2,8,64,512")
    simulate.add_argument("--link", default="1gbit,10gbit,100gbit")
    simulate.add_argument("--out", default=None, help="PNG path (default: next to the profile)")
    netem = commands.add_parser("netem", help="run a command as N ranks on emulated hosts")
    netem.add_argument("--hosts", type=int, default=2)
    netem.add_argument("--rate", default="1gbit", help="e.g. 1gbit, 10gbit, unlimited")
    netem.add_argument("--timeout", type=float, default=3600)
    netem.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ...")
    args = parser.parse_args(argv)
    if args.command == "netem":
        return netem_main(args)
    if args.command == "simulate":
        return simulate_main(args)
    if args.command == "demo":
        from pyreducer.tools import demo as demo_module

        return demo_module.main(nproc=args.nproc, steps=args.steps, model=args.model,
                                out=args.out)
    return trace_main(args)
