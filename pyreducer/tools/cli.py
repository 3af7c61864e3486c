"""Command line: `python -m pyreducer demo | trace | report | simulate | netem | fuzz | soak`
(--help on each)."""
from __future__ import annotations

import argparse
import glob
import os
import sys

from pyreducer.observe import InputError, output_dir
from pyreducer.testing.models import SPECS

MODELS = sorted(SPECS)
DESCRIPTION = ("pyreducer's tools: train with torch DDP and pyreducer side by side (demo), record "
               "and report a run's per-bucket timeline (trace, report), predict runs on more "
               "hosts (simulate), run ranks on emulated hosts (netem), and test against torch "
               "DDP (soak, fuzz).")


def trace_worker(rank, world_size, model_name, steps, bucket_cap_mb, batch, keep):
    """One rank of `trace`: trains with PYREDUCER_TRACE set (run_ranks passes it), so the
    wrapper records itself as any user script's would; writes its rank file at the end."""
    import torch

    from pyreducer import DistributedDataParallel
    from pyreducer.observe import recorder
    from pyreducer.testing import models

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
    return recorder.write_all()  # run_ranks ends ranks with os._exit: no exit handlers


def trace_main(args) -> int:
    from pyreducer.observe.report import report_dir
    from pyreducer.testing import run_ranks

    print(f"pyreducer trace: model '{args.model}', {args.nproc} local Gloo ranks, "
          f"bucket_cap_mb={args.bucket_cap_mb}, {args.steps} steps", flush=True)
    output_dir(args.out, "--out")
    for stale in glob.glob(os.path.join(args.out, "rank*.json")):
        os.remove(stale)
    run_ranks(trace_worker, args.nproc, timeout_s=args.timeout,
              args=(args.model, args.steps, args.bucket_cap_mb, args.batch,
                    min(args.steps, args.keep)),
              env={"PYREDUCER_TRACE": args.out})
    return print_report(report_dir(args.out))


def report_main(args) -> int:
    from pyreducer.observe.report import report_dir

    return print_report(report_dir(args.dir, model=args.model_index, keep=args.keep))


def print_report(report: dict) -> int:
    print(report["summary"])
    for name, path in report["paths"].items():
        print(f"wrote {path}")
    for note in report["notes"]:
        print(note)
    return 0


def netem_main(args) -> int:
    from pyreducer.tools.netem import EmulatedCluster, NetemUnavailable

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise InputError("give the command to run after --, e.g. -- python train.py")
    try:
        with EmulatedCluster(args.hosts, args.rate) as cluster:
            if args.torchrun:
                procs = [cluster.launch_torchrun(host, command, max_restarts=args.max_restarts)
                         for host in range(args.hosts)]
            else:
                procs = [cluster.launch(rank, command) for rank in range(args.hosts)]
            codes = cluster.wait(procs, timeout_s=args.timeout)
    except NetemUnavailable as error:
        raise InputError(f"{error}; not running on loopback instead") from None
    print(f"netem: exit codes per rank: {codes}")
    return max(codes)


def fuzz_main(args) -> int:
    from pyreducer.tools import fuzz

    if args.cases < 1 or args.batch < 1:
        raise InputError(f"--cases and --batch must be >= 1, got {args.cases}, {args.batch}")
    return fuzz.main(args.cases, args.seed, args.replay, args.batch, args.json,
                     family="actions" if args.actions else "models")


def soak_main(args) -> int:
    from pyreducer.tools import soak

    if args.steps < 2 or args.every < 1 or not 0 <= args.warmup < args.steps:
        raise InputError(f"need --steps >= 2, --every >= 1 and 0 <= --warmup < --steps; got "
                         f"{args.steps}, {args.every}, {args.warmup}")
    return soak.main(args.steps, args.every, args.warmup, args.overlap, args.json, args.plot)


def simulate_main(args) -> int:
    import json

    from pyreducer.tools import simulate

    profile = simulate.load_profile(args.profile)
    rows = simulate.simulate(profile, _ints(args.ranks, "--ranks"), args.link.split(","))
    print(simulate.format_rows(rows))
    base = args.profile if os.path.isdir(args.profile) else os.path.dirname(args.profile)
    png = args.out or os.path.join(base, "simulate.png")
    output_dir(os.path.dirname(os.path.abspath(png)), "--out")
    with open(os.path.splitext(png)[0] + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {os.path.splitext(png)[0]}.json")
    from pyreducer.observe.plot import PlottingUnavailable

    try:
        print(f"wrote {simulate.plot(rows, png)}")
    except PlottingUnavailable as error:
        print(f"no plot: {error}")
    return 0


def demo_main(args) -> int:
    from pyreducer.tools import demo

    output_dir(args.out, "--out")  # before training, not after
    return demo.main(nproc=args.nproc, steps=args.steps, model=args.model, out=args.out)


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise InputError(f"{option} expects comma-separated whole numbers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise InputError(f"{option} expects positive numbers, got {text!r}")
    return values


def _add_training_options(parser, model_default: str, steps_default: int) -> None:
    parser.add_argument("--model", default=model_default, choices=MODELS,
                        help=f"reference model (pyreducer/testing/models.py); default "
                             f"{model_default}")
    parser.add_argument("--nproc", type=int, default=2, metavar="N",
                        help="local Gloo ranks (processes) to spawn; default 2")
    parser.add_argument("--steps", type=int, default=steps_default, metavar="N",
                        help=f"training steps; default {steps_default}")


def _add_harness_commands(commands) -> None:
    """`netem`, `soak` and `fuzz`: commands on emulated hosts, long runs, fuzzing against DDP."""
    netem = commands.add_parser("netem", help="run a command as N ranks on emulated hosts "
                                              "(needs root and iproute2)")
    netem.add_argument("--hosts", type=int, default=2, metavar="N",
                       help="emulated hosts, one rank each; default 2")
    netem.add_argument("--rate", default="1gbit", metavar="RATE",
                       help="each host's link rate in bits per second (tc syntax: 100mbit, "
                            "1gbit, 10gbit) or 'unlimited'; default 1gbit")
    netem.add_argument("--timeout", type=float, default=3600, metavar="SECONDS",
                       help="kill all ranks after this long; default 3600")
    netem.add_argument("--torchrun", action="store_true",
                       help="run torchrun on every host (one node each, c10d rendezvous on host "
                            "0); the command is torchrun's script: -- train.py ARGS; default: "
                            "run the command itself on every host")
    netem.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="with --torchrun: torchrun's --max-restarts; default 0")
    netem.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                       help="the command every rank runs, after --: -- python train.py ...")
    soak = commands.add_parser("soak", help="train long at world size 2, watching memory, file "
                                             "descriptors and threads (make soak: 10,000 steps)")
    soak.add_argument("--steps", type=int, default=10000, metavar="N",
                      help="training steps; default 10000")
    soak.add_argument("--every", type=int, default=500, metavar="N",
                      help="sample memory, descriptors and threads every N steps; default 500")
    soak.add_argument("--warmup", type=int, default=1000, metavar="N",
                      help="steps before the baseline sample; default 1000")
    soak.add_argument("--overlap", action="store_true",
                      help="soak the overlapped optimizer; default: the plain optimizer step")
    soak.add_argument("--json", default=None, metavar="PATH",
                      help="write the samples and verdict as JSON; default: not written")
    soak.add_argument("--plot", default=None, metavar="PNG",
                      help="plot memory, threads and descriptors per step; default: no plot")
    fuzz = commands.add_parser("fuzz", help="differential fuzzing against torch DDP: random "
                                             "models and options, parameters compared bit for "
                                             "bit")
    fuzz.add_argument("--cases", type=int, default=40, metavar="N",
                      help="random cases to run; default 40")
    fuzz.add_argument("--seed", type=int, default=0, metavar="S",
                      help="run seed the cases are drawn from; default 0")
    fuzz.add_argument("--replay", type=int, metavar="SEED",
                      help="run the one case with this seed (as printed for a failure)")
    fuzz.add_argument("--batch", type=int, default=10, metavar="N",
                      help="cases per set of spawned ranks; default 10")
    fuzz.add_argument("--actions", action="store_true",
                      help="fuzz user actions around the overlapped and sharded optimizers "
                           "(state_dict, evaluation forwards, checkpoints, clips, ...); default: "
                           "random models and DDP options")
    fuzz.add_argument("--json", metavar="PATH", help="write every case's outcome here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyreducer", description=DESCRIPTION,
                                     epilog="A command's options: python -m pyreducer COMMAND "
                                            "--help")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser("demo", help="train one model with torch DDP and with pyreducer "
                                            "on local Gloo ranks; print each step's loss and "
                                            "time, the parity and the step-time ratio")
    _add_training_options(demo, "demo", 20)
    demo.add_argument("--out", default="run/demo", metavar="DIR",
                      help="folder for the trace, plots and step profile; default run/demo")

    trace = commands.add_parser("trace", help="train a reference model with pyreducer on local "
                                              "Gloo ranks; write its trace, plots, summary and "
                                              "step profile")
    _add_training_options(trace, "mlp_large", 20)
    trace.add_argument("--bucket-cap-mb", type=float, default=None, metavar="MIB",
                       help="bucket cap in MiB (as DDP's bucket_cap_mb); default DDP's caps")
    trace.add_argument("--batch", type=int, default=32, metavar="N",
                       help="samples per rank and step; default 32")
    trace.add_argument("--keep", type=int, default=5, metavar="N",
                       help="last iterations recorded (timeline_iterations), shown in the trace "
                            "and plots and profiled; default 5")
    trace.add_argument("--timeout", type=float, default=1200, metavar="SECONDS",
                       help="kill the ranks after this long; default 1200")
    trace.add_argument("--out", default="run/trace", metavar="DIR",
                       help="output folder; default run/trace")

    report = commands.add_parser(
        "report", help="merge the rank files a PYREDUCER_TRACE=DIR run wrote into a trace, "
                       "plots and a summary")
    report.add_argument("dir", metavar="DIR", help="the folder PYREDUCER_TRACE named (its "
                                                   "rank<R>.json files)")
    report.add_argument("--keep", type=int, default=None, metavar="N",
                        help="last iterations shown; default all that were recorded")
    report.add_argument("--model-index", type=int, default=0, metavar="K",
                        help="which wrapper, for scripts that build several (rank<R>.model<K>."
                             "json); default 0, the first")

    simulate = commands.add_parser("simulate", help="predict step time and scaling on more "
                                                    "ranks and other links from a step profile")
    simulate.add_argument("--profile", required=True, metavar="PATH",
                          help="profile.json, or the folder holding it (written by trace, "
                               "report and demo)")
    simulate.add_argument("--ranks", default="2,8,64,512", metavar="N,N,...",
                          help="rank counts to predict; default 2,8,64,512")
    simulate.add_argument("--link", default="1gbit,10gbit,100gbit", metavar="RATE,...",
                          help="link rates in bits per second, e.g. 100mbit, 1gbit, 10gbit; "
                               "default 1gbit,10gbit,100gbit")
    simulate.add_argument("--out", default=None, metavar="PNG",
                          help="plot path (JSON beside it); default simulate.png next to the "
                               "profile")

    _add_harness_commands(commands)
    return parser


COMMANDS = {"demo": demo_main, "trace": trace_main, "report": report_main,
            "simulate": simulate_main, "netem": netem_main, "fuzz": fuzz_main,
            "soak": soak_main}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except InputError as error:
        print(f"python -m pyreducer {args.command}: error: {error}", file=sys.stderr)
        return 2
