"""Command line: `python -m pyreducer demo | trace`."""
from __future__ import annotations

import argparse


def trace_worker(rank, world_size, model_name, steps, bucket_cap_mb, batch, keep):
    import torch

    from pyreducer import DistributedDataParallel, models
    from pyreducer.trace import gather_timelines

    spec = models.spec(model_name)
    torch.manual_seed(0)
    model = DistributedDataParallel(spec.build(), bucket_cap_mb=bucket_cap_mb,
                                    timeline_iterations=keep)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        opt.zero_grad()
        spec.loss(model, spec.batch(gen, batch)).backward()
        opt.step()
        if rank == 0:
            print(f"  step {step + 1}/{steps}", flush=True)
    return gather_timelines(model, keep)


def trace_main(args) -> int:
    from pyreducer.report import write_report
    from pyreducer.testing import run_ranks

    print(f"pyreducer trace: model '{args.model}', {args.nproc} local Gloo ranks, "
          f"bucket_cap_mb={args.bucket_cap_mb}, {args.steps} steps", flush=True)
    results = run_ranks(trace_worker, args.nproc, timeout_s=1200,
                        args=(args.model, args.steps, args.bucket_cap_mb, args.batch,
                              min(args.steps, args.keep)))
    report = write_report(results[0], args.out)
    print(report["summary"])
    for name, path in report["paths"].items():
        print(f"wrote {path}")
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
    args = parser.parse_args(argv)
    if args.command == "demo":
        from pyreducer import demo as demo_module

        return demo_module.main(nproc=args.nproc, steps=args.steps, model=args.model,
                                out=args.out)
    return trace_main(args)
