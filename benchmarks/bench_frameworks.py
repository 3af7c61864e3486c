"""The Hugging Face Trainer and Lightning on emulated hosts (pyreducer.tools.netem, default 2 hosts
at 1 Gbit/s): step time and per-rank memory of the framework's stock torch DDP ("stock"),
pyreducer with the overlapped optimizer ("overlap") and pyreducer sharded ("shard"), each
through the framework's one-line swap, on a GPT-2 built from a config (issue 41, point 5).

Every run is a launch of its own on fresh emulated hosts: torchrun on each host (one rank per
host, pinned to core host % cores, one thread), joined by torchrun's c10d rendezvous over the
emulated link, runs benchmarks/frameworks_worker.py for one framework and variant: --warmup +
--steps optimizer steps, the last --steps timed (the interval between consecutive step ends,
taken by a framework callback), memory per rank, losses and final parameters. Runs go
round-robin: per repeat, per framework, every variant (the order reversed every other repeat, so
that a drift of the machine weighs on all alike). The default warm-up (90 steps) is what the
overlapped optimizer's schedule tuner takes to decide (its trials are not timed); every variant
runs it, so that all end at the same step and their parameters can be compared.

    python benchmarks/bench_frameworks.py --out run/frameworks             # ~17 min, 16 runs
    python benchmarks/bench_frameworks.py --tiny --out /tmp/frameworks     # smoke run, ~3 min
    python benchmarks/bench_frameworks.py --frameworks hf --variants stock,shard --out run/hf
Writes results.json (after every run: a partial run is kept), summary.md, step_time.png and
memory.png to --out. Progress goes to stderr. Needs root and iproute2 (network namespaces, tc);
exits non-zero saying so otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from bench import cpu_model, hosts_unavailable  # noqa: E402
from frameworks_report import plot_memory, plot_step_times, summary_md  # noqa: E402
from frameworks_worker import (FRAMEWORKS, MAX_GRAD_NORM, MODELS, REFERENCE, VARIANTS,  # noqa: E402
                               WHY)
from pyreducer.tools.netem import EmulatedCluster  # noqa: E402

TINY = dict(model="tiny", steps=4, warmup=3, repeats=1)
# every rank: one thread (torchrun sets OMP_NUM_THREADS=1 only with several processes per
# node); no tuning remembered from an earlier run (pyreducer/tuning/memory.py): each overlapped
# run plans its schedule afresh
RANK_ENV = dict(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                TRANSFORMERS_VERBOSITY="error", PYREDUCER_TUNING_CACHE="off",
                PYTHONPATH=os.path.join(HERE, ".."))
FAIL_GRACE_S = 30  # once a host's torchrun has failed, the others' time before they are killed


def log(*parts) -> None:
    print("[bench_frameworks]", *parts, file=sys.stderr, flush=True)


def relay_progress(path: str, offset: int) -> int:
    """Shows the worker's progress lines ("[hf/stock] step 10/120 ...") written to `path` since
    `offset`; returns the new offset."""
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            text = f.read()
    except OSError:
        return offset
    complete = text[:text.rfind("\n") + 1]
    for line in complete.splitlines():
        if "] step " in line:
            log("  ", line.strip())
    return offset + len(complete.encode(errors="replace"))


def wait(procs, timeout_s: float, progress_log: str) -> list:
    """Exit codes of the hosts' torchruns (None: killed at the deadline, or FAIL_GRACE_S after
    another failed: a rank left in a collective with a dead peer may never return)."""
    deadline, failed_at, offset = time.monotonic() + timeout_s, None, 0
    while any(p.poll() is None for p in procs):
        offset = relay_progress(progress_log, offset)
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > FAIL_GRACE_S):
            break
        time.sleep(0.5)
    relay_progress(progress_log, offset)
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    return codes


def tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError as error:
        return f"(no log: {error})"


def first_error(text: str) -> str:
    """The first exception line a rank printed (torch prefixes them "[rankN]: "), not
    torchrun's own ChildFailedError; else the text's last line."""
    for line in text.splitlines():
        found = re.search(r"\b(\w+(Error|Exception)|KeyboardInterrupt)\b:?.*", line)
        if found and "ChildFailedError" not in line and not line.lstrip().startswith("File "):
            return line.strip()[:500]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:500] if lines else "(no output)"


def launch_run(framework: str, variant: str, repeat: int, args, tmp: str) -> dict:
    """One framework and variant on fresh emulated hosts; its ranks' records, or its error."""
    out = os.path.join(tmp, f"{framework}_{variant}_r{repeat}")
    os.makedirs(out)
    argv = [os.path.join(HERE, "frameworks_worker.py"), "--framework", framework,
            "--variant", variant, "--model", args.model, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--clip", str(args.clip), "--out", out]
    logs = [os.path.join(out, f"host{h}.log") for h in range(args.hosts)]
    start = time.monotonic()
    with EmulatedCluster(args.hosts, args.link) as cluster:
        procs = []
        for host in range(args.hosts):
            sink = open(logs[host], "w")
            procs.append(cluster.launch_torchrun(host, argv, env=RANK_ENV, stdout=sink,
                                                 stderr=sink))
            sink.close()
        codes = wait(procs, args.timeout, logs[0])
    run = dict(framework=framework, variant=variant, repeat=repeat, exit_codes=codes,
               seconds=time.monotonic() - start, params=os.path.join(out, "params.pt"))
    paths = [os.path.join(out, f"rank{r}.json") for r in range(args.hosts)]
    if all(os.path.exists(p) for p in paths) and os.path.exists(run["params"]):
        run["ranks"] = [json.load(open(p)) for p in paths]
        if any(codes):  # e.g. torch's Gloo aborting a process at exit, after its work
            log(f"{framework}/{variant}: exit codes {codes} after writing every result; kept")
        return run
    run["error"] = f"exit codes {codes}; " + " | ".join(
        f"host {h}: {first_error(tail(path, 200_000))}" for h, path in enumerate(logs))
    log(f"{framework}/{variant}: FAILED ({codes}); log tails:\n" +
        "\n".join(f"--- host {h} ---\n{tail(path)}" for h, path in enumerate(logs)))
    return run


def compare_with_stock(runs: list[dict]) -> None:
    """Each run's parameters and losses against the stock run's of the same framework and
    repeat (max |difference|), recorded in the run; then the parameter files are removed."""
    import torch

    stock = next((r for r in runs if r["variant"] == REFERENCE and "ranks" in r), None)
    reference = torch.load(stock["params"]) if stock else None
    for run in runs:
        if "ranks" not in run or reference is None:
            continue
        params = torch.load(run["params"])
        run["max_param_diff"] = max(float((params[k].double() - v.double()).abs().max())
                                    for k, v in reference.items())
        ours, theirs = run["ranks"][0]["losses"], stock["ranks"][0]["losses"]
        run["losses_equal"] = ours == theirs
        run["max_loss_diff"] = max((abs(a - b) for a, b in zip(ours, theirs)), default=None) \
            if len(ours) == len(theirs) else None
    for run in runs:
        path = run.pop("params")
        if os.path.exists(path):
            os.remove(path)


def model_facts(model: str) -> dict:
    """The GPT-2's configuration and size (built here once, on the CPU)."""
    from frameworks_worker import gpt2

    spec = MODELS[model]
    params = sum(p.numel() for p in gpt2(spec).parameters())
    return dict(name=model, config={k: v for k, v in spec.items() if k != "batch"},
                batch_per_rank=spec["batch"], sequence=spec["n_positions"], parameters=params,
                param_mib=params * 4 / 2**20, why=WHY[model])


def environment(args, argv) -> dict:
    import lightning
    import torch
    import transformers

    return dict(torch=torch.__version__, transformers=transformers.__version__,
                lightning=lightning.__version__, python=platform.python_version(),
                cores=os.cpu_count(), cpu=cpu_model(), machine=platform.machine(),
                backend="gloo", link=args.link, hosts=args.hosts, threads_per_rank=1,
                emulation="network namespaces + bridge, tc tbf per host NIC (no latency model); "
                          "torchrun per host, its rank pinned to core host % cores",
                date=time.strftime("%Y-%m-%d %H:%M:%S"),
                command="python benchmarks/bench_frameworks.py " + shlex.join(argv),
                settings={k: getattr(args, k) for k in ("steps", "warmup", "repeats", "model",
                                                        "frameworks", "variants", "clip")})


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                        help=f"comma-separated, some of {','.join(FRAMEWORKS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, some of {','.join(VARIANTS)}; {REFERENCE} is "
                             "always run (the reference)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=90,
                        help="steps before them, every variant (default 90: the overlapped "
                             "optimizer's schedule tuner decides by then)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of runs (default 2)")
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--clip", type=float, default=MAX_GRAD_NORM,
                        help="gradient clipping by norm, both frameworks (default "
                             f"{MAX_GRAD_NORM}; 0: none)")
    parser.add_argument("--tiny", action="store_true",
                        help="a smoke run: " + ", ".join(f"{k}={v}" for k, v in TINY.items()))
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts, a rank each")
    parser.add_argument("--link", default="1gbit", help="each host's NIC rate (tc tbf)")
    parser.add_argument("--timeout", type=float, default=900, help="per run, seconds")
    parser.add_argument("--out", required=True, help="directory for the results")
    args = parser.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
    for name, known in (("frameworks", FRAMEWORKS), ("variants", VARIANTS)):
        chosen = [x for x in getattr(args, name).split(",") if x]
        unknown = [x for x in chosen if x not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown}; expected some of {','.join(known)}")
        setattr(args, name, chosen)
    if REFERENCE not in args.variants:
        args.variants.insert(0, REFERENCE)
    return args


def write_outputs(doc: dict, out: str) -> None:
    text = summary_md(doc)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    for name, draw in (("step_time.png", plot_step_times), ("memory.png", plot_memory)):
        log("wrote", draw(doc, os.path.join(out, name)))
    log("wrote", os.path.join(out, "results.json"), "and summary.md")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if hosts_unavailable("bench_frameworks.py"):
        return 2
    os.makedirs(args.out, exist_ok=True)
    doc = dict(environment=environment(args, argv), model=model_facts(args.model),
               reference=REFERENCE, runs=[])
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pyreducer-frameworks-") as tmp:
        for repeat in range(args.repeats):
            order = args.variants if repeat % 2 == 0 else args.variants[::-1]
            for framework in args.frameworks:
                runs = []
                for variant in order:
                    log(f"== repeat {repeat + 1}/{args.repeats}: {framework}/{variant} "
                        f"({time.monotonic() - start:.0f} s in)")
                    runs.append(launch_run(framework, variant, repeat, args, tmp))
                    doc["runs"].append(runs[-1])
                    with open(os.path.join(args.out, "results.json"), "w") as f:
                        json.dump(doc, f, indent=1)
                compare_with_stock(runs)
    doc["seconds"] = time.monotonic() - start
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    write_outputs(doc, args.out)
    return 0 if all("ranks" in r for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
