"""`make docs-figures`: the documentation's pictures of a real run, made again.

Trains a reference model with pyreducer on emulated hosts (network namespaces joined by
rate-limited links: `python -m pyreducer netem`; root and iproute2 needed), records it with
PYREDUCER_TRACE as any user's script would be, and turns the ranks' files into the report's
pictures (`python -m pyreducer report`): the Gantt chart of one iteration per rank and the
exposed and hidden communication per bucket. Twice: at torch DDP's default bucket caps
(gantt.png, overlap.png) and with smaller buckets (gantt-small-buckets.png,
overlap-small-buckets.png), so the guide can show what a bucket cap changes. They are copied into
docs/pages/img/ with the reports' summaries and the runs' settings beside them (figures.txt), so
a page's caption can say what it shows. Loopback is refused rather than used instead: there the communication is so fast
that the pictures would show no overlap to speak of, and the captions would be wrong.

    python docs/figures.py [--hosts 2] [--rate 1gbit] [--model transformer] [--steps 20]
                           [--small-cap-mb 2]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile

DOCS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(DOCS)
IMG = os.path.join(DOCS, "pages", "img")
PICTURES = ("gantt.png", "overlap.png")
RUNS = (("", None), ("-small-buckets", "small"))  # (suffix of the pictures, cap: None = DDP's)
MAX_PICTURE_BYTES = 200 * 1024  # tests/unit/test_docs.py keeps the pages' pictures under this


def worker(model_name: str, steps: int, batch: int, bucket_cap_mb: float | None) -> None:
    """One rank, started by `pyreducer netem` on its emulated host (RANK, WORLD_SIZE and
    MASTER_ADDR come from there); PYREDUCER_TRACE makes the wrapper write its rank file."""
    import torch
    import torch.distributed as dist

    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    torch.set_num_threads(1)  # one core per emulated host
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = models.spec(model_name)
    torch.manual_seed(0)
    model = DistributedDataParallel(spec.build(), bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for step in range(steps):
        optimizer.zero_grad()
        spec.loss(model, spec.batch(data, batch)).backward()
        optimizer.step()
        if rank == 0:
            print(f"  step {step + 1}/{steps}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _run(argv: list[str], **kwargs) -> None:
    print("$", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, cwd=REPO, **kwargs)


def trace_run(args, cap_mb: float | None) -> tuple[str, str]:
    """One traced run on emulated hosts and its report: (trace folder, summary)."""
    trace = tempfile.mkdtemp(prefix="pyreducer-figures-")
    env = dict(os.environ, PYREDUCER_TRACE=trace, OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cap = [] if cap_mb is None else ["--bucket-cap-mb", str(cap_mb)]
    _run([sys.executable, "-m", "pyreducer", "netem", "--hosts", str(args.hosts), "--rate",
          args.rate, "--timeout", "900", "--", sys.executable, os.path.abspath(__file__),
          "--worker", "--model", args.model, "--steps", str(args.steps), "--batch",
          str(args.batch), *cap], env=env)
    _run([sys.executable, "-m", "pyreducer", "report", trace, "--keep", str(args.keep)], env=env)
    return trace, open(os.path.join(trace, "summary.txt")).read()


def make(args) -> int:
    import torch

    os.makedirs(IMG, exist_ok=True)
    notes = [f"`python docs/figures.py --hosts {args.hosts} --rate {args.rate} --model "
             f"{args.model} --steps {args.steps} --batch {args.batch} --keep {args.keep} "
             f"--small-cap-mb {args.small_cap_mb}`\n"
             f"{args.hosts} emulated hosts (network namespaces, tc tbf at {args.rate}), one Gloo "
             f"rank and one core each; reference model '{args.model}' "
             f"(pyreducer/testing/models.py), SGD; torch {torch.__version__}, Python "
             f"{platform.python_version()}, {os.cpu_count()} cores."]
    for suffix, cap in RUNS:
        cap_mb = None if cap is None else args.small_cap_mb
        trace, summary = trace_run(args, cap_mb)
        for name in PICTURES:
            source = os.path.join(trace, name)
            size = os.path.getsize(source)
            if size > MAX_PICTURE_BYTES:
                raise SystemExit(f"{name}: {size} bytes, expected at most {MAX_PICTURE_BYTES}")
            target = name.replace(".png", f"{suffix}.png")
            shutil.copyfile(source, os.path.join(IMG, target))
            print(f"wrote docs/pages/img/{target} ({size // 1024} KiB)")
        caps = "torch DDP's bucket caps" if cap_mb is None else f"bucket_cap_mb={cap_mb}"
        notes.append(f"## {', '.join(n.replace('.png', suffix + '.png') for n in PICTURES)}: "
                     f"{caps}\n\n{summary}")
        shutil.rmtree(trace, ignore_errors=True)
    with open(os.path.join(IMG, "figures.txt"), "w") as f:
        f.write("\n\n".join(notes))
    print("wrote docs/pages/img/figures.txt")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts; default 2")
    parser.add_argument("--rate", default="1gbit", help="each host's link rate; default 1gbit")
    parser.add_argument("--model", default="transformer", help="reference model; default "
                                                                "transformer")
    parser.add_argument("--steps", type=int, default=20, help="training steps; default 20")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank; default 32")
    parser.add_argument("--keep", type=int, default=5, help="iterations shown; default 5")
    parser.add_argument("--small-cap-mb", type=float, default=2.0,
                        help="the second run's bucket cap in MiB; default 2")
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.model, args.steps, args.batch, args.bucket_cap_mb)
        return 0
    return make(args)


if __name__ == "__main__":
    sys.exit(main())
