"""torchft on emulated hosts (pyreducer.tools.netem; default 3 hosts at 1 Gbit/s, one replica
group of one rank per host): the step time without failures of pyreducer's torchft wrapper,
torchft's own DDP, plain pyreducer DDP and plain torch DDP; and one failure (SIGKILL of a replica
during the all-reduce of a fixed step), torchft healing against torchrun's elastic restart from a
checkpoint taken every --checkpoint-every steps.

Variants (every one on torchft_replica's model --model, the same data: replica r's batch at step
s, SGD with momentum, bucket_cap_mb=--bucket-cap-mb):
  torchft_pyreducer  pyreducer.torchft.DistributedDataParallel: a torchft job of
                     pyreducer/testing/torchft_job.py on the emulated hosts (a Lighthouse on a
                     host of its own, min_replicas = hosts - 1, the replicas starting together)
  torchft_ddp        torchft's own DistributedDataParallel, the same job
  ddp_pyreducer      plain pyreducer DDP: torchrun on each host, one node each, c10d rendezvous
                     (benchmarks/torchft_plain_worker.py), rank 0 checkpointing every
                     --checkpoint-every steps (the reference of the ratios)
  ddp_torch          plain torch DDP, the same launch
Every run is a launch of its own on fresh emulated hosts, round-robin per repeat (the order
reversed every other repeat). Step times come from the step logs (each step's start and end).
One failure (--failure-variants, --fail-repeats runs each, in the first repeats): replica (rank)
--fail-replica SIGKILLs itself from its first layer's gradient hook at step --fail-step, the
other buckets' all-reduces in flight. torchft_*: the harness restarts it (as torchrun
--max-restarts would) and it heals from a live peer while the others go on; ddp_*: torchrun
--max-restarts 1 restarts every worker, which resume from the last checkpoint. What is measured
and how: benchmarks/torchft_report.py.

    python benchmarks/bench_torchft.py --out run/torchft                  # ~12 min, 14 launches
    python benchmarks/bench_torchft.py --quick --out /tmp/torchft         # smoke run, ~2 min
    python benchmarks/bench_torchft.py --quick --variants torchft_pyreducer \\
        --failure-variants '' --out /tmp/torchft_one                       # one launch
Writes results.json (after every run: a partial run is kept), summary.md, step_time.png and
timeline.png to --out. Progress goes to stderr. Needs root and iproute2 (network namespaces, tc);
exits non-zero saying so otherwise.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from bench import cpu_model, hosts_unavailable  # noqa: E402
from pyreducer.testing.ranks import subprocess_env  # noqa: E402
from pyreducer.tools.netem import EmulatedCluster  # noqa: E402
from torchft_report import REFERENCE, read_jsonl, write_outputs  # noqa: E402

VARIANTS = ("torchft_pyreducer", "torchft_ddp", "ddp_pyreducer", "ddp_torch")
FAILURE_VARIANTS = ("torchft_pyreducer", "ddp_pyreducer")
QUICK = dict(steps=12, warmup=3, repeats=1, fail_step=8, checkpoint_every=5)
FAIL_GRACE_S = 30  # once a host's torchrun has failed, the others' time before they are killed


def log(*parts) -> None:
    print("[bench_torchft]", *parts, file=sys.stderr, flush=True)


def run_torchft(variant: str, repeat: int, failure: bool, args, tmp: str) -> dict:
    """A torchft job (pyreducer/testing/torchft_job.py) on fresh emulated hosts."""
    from pyreducer.testing.torchft_job import JobError, run_job

    workdir = os.path.join(tmp, f"{variant}_{'fail' if failure else 'run'}{repeat}")
    fail = dict(replica=args.fail_replica, step=args.fail_step, kind="sigkill") \
        if failure else None
    run = dict(variant=variant, repeat=repeat, failure=failure)
    try:
        job = run_job("pyreducer" if variant == "torchft_pyreducer" else "torchft", args.hosts,
                      args.steps, workdir, min_replicas=max(1, args.hosts - 1), fail=fail,
                      timeout_s=args.timeout, link=args.link, start_together=True,
                      heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                      join_timeout_ms=args.join_timeout_ms,
                      model=args.model, bucket_cap_mb=args.bucket_cap_mb)
    except (JobError, TimeoutError, RuntimeError, OSError) as error:
        run["error"] = f"{type(error).__name__}: {str(error)[-3000:]}"
        return run
    run.update(log=job["log"], events=job["events"], seconds=job["seconds"],
               lives={str(r): codes for r, codes in job["lives"].items()})
    return run


def wait(procs, timeout_s: float) -> list:
    """Exit codes of the hosts' torchruns (None: killed at the deadline, or FAIL_GRACE_S after
    another failed: a rank left in a collective with a dead peer may never return)."""
    deadline, failed_at = time.monotonic() + timeout_s, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > FAIL_GRACE_S):
            break
        time.sleep(0.2)
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    return codes


def plain_argv(variant: str, failure: bool, args, out: str) -> list[str]:
    argv = [os.path.join(HERE, "torchft_plain_worker.py"), "--out", out,
            "--impl", "pyreducer" if variant == "ddp_pyreducer" else "torch",
            "--model", args.model, "--steps", str(args.steps),
            "--bucket-cap-mb", str(args.bucket_cap_mb),
            "--checkpoint-every", str(args.checkpoint_every)]
    if failure:
        argv += ["--fail-rank", str(args.fail_replica), "--fail-step", str(args.fail_step)]
    return argv


def run_plain(variant: str, repeat: int, failure: bool, args, tmp: str) -> dict:
    """Plain DDP under torchrun on fresh emulated hosts (--max-restarts 1 with a failure)."""
    out = os.path.join(tmp, f"{variant}_{'fail' if failure else 'run'}{repeat}")
    os.makedirs(out)
    logs = [os.path.join(out, f"host{h}.log") for h in range(args.hosts)]
    env = subprocess_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                         PYREDUCER_TUNING_CACHE="off")
    start = time.monotonic()
    with EmulatedCluster(args.hosts, args.link) as cluster:
        procs = []
        for host in range(args.hosts):
            with open(logs[host], "w") as sink:
                procs.append(cluster.launch_torchrun(
                    host, plain_argv(variant, failure, args, out),
                    max_restarts=1 if failure else 0, env=env, stdout=sink,
                    stderr=subprocess.STDOUT))
        codes = wait(procs, args.timeout)
    run = dict(variant=variant, repeat=repeat, failure=failure, exit_codes=codes,
               seconds=time.monotonic() - start)
    steps = [e for r in range(args.hosts) for e in read_jsonl(os.path.join(out, f"rank{r}.jsonl"))]
    events = [dict(e, replica=r, life=e["attempt"]) for r in range(args.hosts)
              for e in read_jsonl(os.path.join(out, f"rank{r}.events.jsonl"))]
    done = {e["replica"] for e in steps if e["step"] == args.steps - 1}
    if done == set(range(args.hosts)):
        if any(codes):  # e.g. torch's Gloo aborting a process at exit, after its work
            log(f"{variant}: exit codes {codes} after every rank's last step; kept")
        return dict(run, log=steps, events=events)
    run["error"] = f"exit codes {codes}; ranks {sorted(done)} done; " + " | ".join(
        f"host {h}: {tail(path, 300)}" for h, path in enumerate(logs))
    log(f"{variant}: FAILED ({codes}); log tails:\n" +
        "\n".join(f"--- host {h} ---\n{tail(path, 3000)}" for h, path in enumerate(logs)))
    return run


def tail(path: str, chars: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError as error:
        return f"(no log: {error})"


def one_line(run: dict, warmup: int) -> str:
    """A run's outcome for the progress lines: median step of the slowest replica, span."""
    from torchft_report import span_s, step_figures

    if "error" in run:
        return f"FAILED: {run['error'][:300]}"
    figures = step_figures([run], warmup)
    step = figures["step"]["median_ms"] if figures["step"] else float("nan")
    return (f"median step {step:.1f} ms (slowest replica), span {span_s(run['log']):.1f} s, "
            f"launch {run['seconds']:.1f} s")


def run_one(variant: str, repeat: int, failure: bool, args, tmp: str, began: float) -> dict:
    what = "one failure" if failure else "no failure"
    log(f"== {variant}, {what}, repeat {repeat + 1} ({time.monotonic() - began:.0f} s in)")
    runner = run_torchft if variant.startswith("torchft") else run_plain
    run = runner(variant, repeat, failure, args, tmp)
    log("  ", one_line(run, args.warmup))
    return run


def model_facts(model: str) -> dict:
    from pyreducer.testing.torchft_replica import MODELS, build_model

    params = sum(p.numel() for p in build_model(model).parameters())
    inputs, width, hidden, outputs, batch = MODELS[model]
    return dict(name=model, parameters=params, grad_mib=params * 4 / 2**20, batch=batch,
                layers=f"Linear({inputs}, {width}), {hidden} x Linear({width}, {width}), "
                       f"Linear({width}, {outputs}), ReLU between")


def environment(argv) -> dict:
    import torch

    return dict(torch=torch.__version__, torchft=importlib.metadata.version("torchft"),
                python=platform.python_version(), cores=os.cpu_count(), cpu=cpu_model(),
                machine=platform.machine(), backend="gloo", threads_per_rank=1,
                emulation="network namespaces + bridge, tc tbf per host NIC (no latency model); "
                          "host h's processes pinned to core h % cores (the Lighthouse's host "
                          "too)",
                date=time.strftime("%Y-%m-%d %H:%M:%S"),
                command="python benchmarks/bench_torchft.py " + shlex.join(argv))


SETTINGS = ("steps", "warmup", "repeats", "fail_repeats", "fail_step", "fail_replica",
            "checkpoint_every", "model", "bucket_cap_mb", "hosts", "link", "variants",
            "failure_variants")


def settings(args) -> dict:
    from pyreducer.testing.torchft_job import DEFAULTS

    return dict({k: getattr(args, k) for k in SETTINGS}, min_replicas=max(1, args.hosts - 1),
                heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                join_timeout_ms=args.join_timeout_ms, torchft_job=DEFAULTS)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"without failure, comma-separated, some of {','.join(VARIANTS)} "
                             f"('' for none); {REFERENCE} is the ratios' reference")
    parser.add_argument("--failure-variants", default=",".join(FAILURE_VARIANTS),
                        help="with one failure, comma-separated ('' for none); torchft_*: "
                             "healing, ddp_*: torchrun's elastic restart")
    parser.add_argument("--steps", type=int, default=100, help="steps a run (default 100)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps not timed")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of runs (default 3)")
    parser.add_argument("--fail-repeats", type=int, default=1,
                        help="runs of each failure variant (default 1)")
    parser.add_argument("--fail-step", type=int, default=75, help="default 75")
    parser.add_argument("--fail-replica", type=int, default=1, help="default 1")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="ddp_*: default 50")
    parser.add_argument("--model", default="mlp_16mb",
                        help="a torchft_replica.MODELS name (default mlp_16mb)")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0,
                        help="every variant's (default 4)")
    parser.add_argument("--hosts", type=int, default=3, help="emulated hosts, a replica each")
    parser.add_argument("--link", default="1gbit", help="each host's NIC rate (tc tbf)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    parser.add_argument("--timeout", type=float, default=300, help="per run, seconds")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000,
                        help="the Lighthouse's: a replica silent this long is dropped")
    parser.add_argument("--join-timeout-ms", type=int, default=2000,
                        help="the Lighthouse's wait for stragglers of a valid quorum")
    parser.add_argument("--out", required=True, help="directory for the results")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    for name in ("variants", "failure_variants"):
        chosen = [v for v in getattr(args, name).split(",") if v]
        unknown = [v for v in chosen if v not in VARIANTS]
        if unknown:
            parser.error(f"unknown {name} {unknown}; expected some of {','.join(VARIANTS)}")
        setattr(args, name, chosen)
    if not 0 <= args.fail_replica < args.hosts or args.hosts < 2:
        parser.error(f"--fail-replica {args.fail_replica} must name one of --hosts "
                     f"{args.hosts} (at least 2)")
    if not args.warmup <= args.fail_step < args.steps:
        parser.error("--fail-step must be in [--warmup, --steps)")
    return args


def save(doc: dict, out: str) -> None:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if hosts_unavailable("bench_torchft.py"):
        return 2
    os.makedirs(args.out, exist_ok=True)
    doc = dict(environment=environment(argv), settings=settings(args),
               model=model_facts(args.model), reference=REFERENCE, runs=[])
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pyreducer-torchft-") as tmp:
        for repeat in range(max(args.repeats, args.fail_repeats)):
            order = args.variants if repeat % 2 == 0 else args.variants[::-1]
            plan = [(v, False) for v in order] if repeat < args.repeats else []
            if repeat < args.fail_repeats:
                plan += [(v, True) for v in args.failure_variants]
            for variant, failure in plan:
                doc["runs"].append(run_one(variant, repeat, failure, args, tmp, began))
                save(doc, args.out)
    doc["seconds"] = time.monotonic() - began
    save(doc, args.out)
    for path in write_outputs(doc, args.out):
        log("wrote", path)
    print(open(os.path.join(args.out, "summary.md")).read(), flush=True)
    log("wrote", os.path.join(args.out, "results.json"), f"({doc['seconds']:.0f} s in all)")
    return 0 if all("log" in r for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
