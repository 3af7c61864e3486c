"""Sharded optimizer state on emulated hosts (pyreducer.tools.netem): step time and per-rank
memory of AdamW under torch DDP, torch's ZeroRedundancyOptimizer, FSDP2 (ZeRO-2) and pyreducer's
overlapped optimizer with shard=True.

Variants, each on the same model (seed 0), data and AdamW(lr=1e-3, weight_decay=0.01):
  ddp_adamw          torch DDP + torch.optim.AdamW (the reference)
  zero               torch DDP + ZeroRedundancyOptimizer(optimizer_class=AdamW)
  fsdp2              fully_shard on every block (transformer) or layer (mlp_large), then the
                     root, reshard_after_forward=False (ZeRO-2: parameters stay gathered from
                     forward to backward; gradients and optimizer state sharded) + AdamW
  pyreducer_sharded  pyreducer DDP + model.overlap_optimizer(AdamW, shard=True)
  ddp_adamw_4mb, pyreducer_sharded_4mb  the same with bucket_cap_mb=4 (sharded_worker.SMALL_CAP_MB):
                     buckets small enough to pipeline the sharded step
  pyreducer_overlap  pyreducer DDP + model.overlap_optimizer(AdamW) (not sharded; optional:
                     its schedule tuner needs 84+ warm-up steps)
Per model and host count, two launches on fresh emulated hosts (sharded_worker.py): a memory
phase (each variant built fresh in turn: optimizer-state bytes, parameter and gradient bytes
after backward, peak-RSS rise) and a time phase (all variants in the same processes: warm-up,
parameters against ddp_adamw's, then blocks of steps round-robin, a block's time its slowest
rank's; ratios to ddp_adamw from adjacent blocks, with bootstrap 95% intervals). A variant that
cannot be built is reported as "variant unavailable: <error>" and the rest run; where its ranks
fail apart or hang (a rank stuck in a collective), the launch is killed FAIL_GRACE_S after the
first rank fails and the phase runs again without it (the time phase then skips it too).

    python benchmarks/bench_sharded.py --ranks 2 4 --out run/sharded          # ~15 min
    python benchmarks/bench_sharded.py --ranks 2 --quick --out /tmp/sharded   # smoke run
    python benchmarks/bench_sharded.py --variants ddp_adamw,pyreducer_sharded,pyreducer_overlap \\
        --model mlp_large --ranks 2 --out run/sharded_overlap
Writes results.json, summary.md, step_time.png and optimizer_state.png to --out. Progress goes to
stderr. Needs root and iproute2 (network namespaces, tc); exits non-zero saying so otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from bench import cpu_model, hosts_unavailable  # noqa: E402
from pyreducer.tools.netem import EmulatedCluster  # noqa: E402
from sharded_worker import DEFAULT_VARIANTS, REFERENCE, VARIANTS  # noqa: E402

QUICK = dict(steps=4, block=2, rounds=1, warmup=3, sharded_warmup=6, memory_steps=2)
# the memory phase's ranks: a fixed mmap threshold turns glibc's dynamic one off, so tensors
# above it are mmapped and returned when freed, and each variant's peak-RSS rise is its own
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
FAIL_GRACE_S = 30  # once a rank has failed, the others' time to finish before they are killed
_ports = iter(range(29711 + os.getpid() % 500 * 2, 65000))


def log(*parts) -> None:
    print("[bench_sharded]", *parts, file=sys.stderr, flush=True)


class RanksFailed(RuntimeError):
    """A launch's ranks failed or hung; `progress`: what each rank said it was doing."""

    def __init__(self, codes, progress):
        super().__init__(f"ranks exited with {codes}")
        self.codes, self.progress = codes, progress


def wait_fail_fast(procs, timeout_s, grace_s=FAIL_GRACE_S) -> list:
    """Exit codes of `procs` (None: killed). Once a rank has failed, the others get `grace_s`
    to finish, then are killed: a rank left in a collective with a dead peer may never return
    (seen: Gloo's connect of a new backend, which has no timeout of its own here)."""
    deadline = time.monotonic() + timeout_s
    failed_at, killed = None, set()
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > grace_s):
            killed = {i for i, p in enumerate(procs) if p.poll() is None}
            for i in killed:
                procs[i].kill()
                procs[i].wait(timeout=30)
            break
        time.sleep(0.5)
    return [None if i in killed else p.returncode for i, p in enumerate(procs)]


def launch(hosts, argv, args, tmp, env) -> None:
    """Runs argv as every rank on fresh emulated hosts. Rank 0's output is shown; the others'
    go to files, whose tails are shown if any rank fails (RanksFailed)."""
    logs = [os.path.join(tmp, f"rank{r}.log") for r in range(hosts)]
    with EmulatedCluster(hosts, args.link, port=next(_ports)) as cluster:
        procs = []
        for rank in range(hosts):
            sink = None if rank == 0 else open(logs[rank], "w")
            procs.append(cluster.launch(rank, argv, env=dict(env, PYTHONUNBUFFERED="1"),
                                        stdout=sink, stderr=sink))
        codes = wait_fail_fast(procs, args.timeout)
    if any(code != 0 for code in codes):
        for rank in range(1, hosts):
            with open(logs[rank]) as f:
                tail = f.read()[-3000:]
            print(f"--- rank {rank} (exit {codes[rank]}) ---\n{tail}", file=sys.stderr)
        progress = []
        for rank in range(hosts):
            try:
                with open(os.path.join(tmp, f"progress.{rank}")) as f:
                    progress.append(json.load(f))
            except (OSError, ValueError):
                progress.append({})
        raise RanksFailed(codes, progress)


def run_phase(phase, model, hosts, args, variants) -> dict:
    """One phase's launch. Where the ranks fail or hang while building or warming up a variant
    other than the reference, it is reported unavailable and the phase runs again without it
    (the result's "dropped" lists those)."""
    variants = list(variants)
    dropped = {}
    while True:
        try:
            result = launch_phase(phase, model, hosts, variants, args)
        except RanksFailed as failure:
            culprit = next((p.get("variant") for p in failure.progress if p.get("variant")),
                           None)
            if culprit in (None, REFERENCE) or culprit not in variants:
                raise SystemExit(f"bench_sharded: {model}, {hosts} hosts, {phase} phase: "
                                 f"{failure} ({failure.progress})") from None
            error = next((p["error"] for p in failure.progress if p.get("error")), "no error "
                         "recorded (a rank hung)")
            dropped[culprit] = f"{error} (the ranks failed or hung; {failure})"
            log(f"{culprit}: variant unavailable: {dropped[culprit]}; {phase} phase again "
                f"without it")
            variants.remove(culprit)
            continue
        result["unavailable"].update(dropped)
        return dict(result, dropped=dropped)


def launch_phase(phase, model, hosts, variants, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="pyreducer-sharded-") as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, os.path.join(HERE, "sharded_worker.py"), "--phase", phase,
                "--model", model, "--variants", ",".join(variants), "--out", out,
                "--progress", os.path.join(tmp, "progress")]
        for flag in ("warmup", "sharded_warmup", "steps", "block", "rounds", "memory_steps",
                     "batch"):
            if getattr(args, flag) is not None:
                argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
        launch(hosts, argv, args, tmp, MEMORY_ENV if phase == "memory" else {})
        with open(out) as f:
            return json.load(f)


def run_setup(model, hosts, args) -> dict:
    """Both phases for one model and host count, merged."""
    start = time.monotonic()
    log(f"== {model}, {hosts} hosts at {args.link}: memory phase")
    memory = run_phase("memory", model, hosts, args, args.variants)
    log(f"== {model}, {hosts} hosts at {args.link}: time phase")
    # a variant whose ranks failed or hung in the memory phase is not tried again (each try
    # costs a collective's timeout); one that raised alike on every rank is (cheap)
    timing = run_phase("time", model, hosts, args,
                       [v for v in args.variants if v not in memory["dropped"]])
    timing["unavailable"].update(memory["dropped"])
    unavailable = {}
    for v in args.variants:
        errors = {phase: r["unavailable"][v] for phase, r in (("memory", memory),
                                                              ("time", timing))
                  if v in r["unavailable"]}
        if len(set(errors.values())) == 1 and len(errors) == 2:
            unavailable[v] = errors["memory"]
        elif errors:
            unavailable[v] = "; ".join(f"{phase} phase: {e}" for phase, e in errors.items())
    run = dict(timing, memory=memory["memory"], unavailable=unavailable, link=args.link,
               variants=list(args.variants), seconds=time.monotonic() - start)
    log(f"== {model}, {hosts} hosts done in {run['seconds']:.0f} s")
    return run


def environment(args, argv) -> dict:
    import torch

    return dict(torch=torch.__version__, python=platform.python_version(),
                cores=os.cpu_count(), cpu=cpu_model(), machine=platform.machine(),
                backend="gloo", link=args.link, threads_per_rank=1,
                emulation="network namespaces + bridge, tc tbf per host NIC (no latency model); "
                          "each rank pinned to core rank % cores",
                optimizer="AdamW(lr=1e-3, weight_decay=0.01)",
                date=time.strftime("%Y-%m-%d %H:%M:%S"),
                command="python benchmarks/bench_sharded.py " + shlex.join(argv),
                settings={k: getattr(args, k) for k in ("warmup", "sharded_warmup", "steps",
                                                        "block", "rounds", "memory_steps",
                                                        "batch", "quick")})


def mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def measured_mib(measured) -> str:
    """The optimizer-state bytes its state tensors came to, or why they could not be read."""
    return f"{mib(measured)} MiB" if isinstance(measured, int) else f"not: {measured}"


def state_ratio(run, variant) -> float | None:
    """Max over ranks of the variant's optimizer-state bytes, over ddp_adamw's."""
    mem = run["memory"]
    if variant not in mem or REFERENCE not in mem:
        return None
    reference = max(r["optimizer_state"] for r in mem[REFERENCE])
    return max(r["optimizer_state"] for r in mem[variant]) / reference if reference else None


def table_row(run, variant) -> str:
    step = run["step"].get(variant)
    paired = run["paired_vs_ddp_adamw"].get(variant)
    ranks = run["memory"].get(variant)
    cells = [variant]
    cells += ([f"{step['median_ms']:.1f}", f"{step['p25_ms']:.1f}-{step['p75_ms']:.1f}"]
              if step else ["-", "-"])
    cells.append("1" if variant == REFERENCE and step else
                 f"{paired['ratio']:.3f} ({paired['ci95'][0]:.3f}-{paired['ci95'][1]:.3f})"
                 if paired else "-")
    if ranks:
        states = [r["optimizer_state"] for r in ranks]
        ratio = state_ratio(run, variant)
        cells += [f"{mib(max(states))} / {mib(sum(states) / len(states))}",
                  "-" if ratio is None else f"{ratio:.3f}",
                  mib(max(r["param_bytes"] for r in ranks)),
                  mib(max(r["grad_bytes"] for r in ranks)),
                  mib(ranks[0].get("bucket_bytes")),
                  mib(max(r["peak_rss_delta_bytes"] for r in ranks))]
    else:
        cells += ["-"] * 6
    diff = run["parity_max_diff"].get(variant)
    cells.append("-" if diff is None else f"{diff:.2g}")
    return "| " + " | ".join(cells) + " |"


HEADER = ("| variant | step ms (median) | IQR | / ddp_adamw (paired, 95% CI) | optimizer state "
          "MiB (max / mean rank) | state / ddp_adamw | params MiB | grads MiB | buckets MiB | "
          "peak RSS rise MiB | max abs param diff |\n|" + "---|" * 11)


def run_section(run) -> list[str]:
    comm = run["comm_ms"]
    warmup = ", ".join(f"{v} {n}" for v, n in run["warmup_steps"].items())
    lines = [f"### {run['model']} (batch {run['batch']}, {run['param_mib']:.1f} MiB of fp32 "
             f"parameters), {run['hosts']} hosts at {run['link']}", "",
             f"All gradients (fp32) in one collective: all-reduce {comm['all_reduce']:.1f} ms, "
             f"reduce-scatter {comm['reduce_scatter']:.1f} ms, all-gather "
             f"{comm['all_gather']:.1f} ms (slowest rank, median). Warm-up steps: {warmup}.",
             "", HEADER]
    lines += [table_row(run, v) for v in run["variants"]
              if v in run["step"] or v in run["memory"]]
    lines.append("")
    for v, error in run["unavailable"].items():
        lines.append(f"- {v}: variant unavailable: `{error}`")
    for v, ranks in run["memory"].items():
        reported = ranks[0].get("memory_bytes_reported")
        if reported:
            lines.append(f"- {v}: memory_bytes() (rank 0, MiB): " + ", ".join(
                f"{k} {mib(b) if isinstance(b, (int, float)) else b}"
                for k, b in reported.items()) + "; its optimizer's state tensors measured "
                f"{measured_mib(ranks[0]['optimizer_state_measured'])}")
    for v, ranks in run.get("phases_ms", {}).items():
        lines.append(f"- {v}: where a step's time went (median ms per rank, ranks 0..N-1; "
                     "sharded_worker.sharded_phases): " + "; ".join(
                         f"{k.replace('_', ' ')} " + "/".join(f"{r[k]:.0f}" for r in ranks)
                         for k in ranks[0]))
    if not run["zero_parity_ok"]:
        lines.append(f"- WARNING: zero's parameters differ from ddp_adamw's by "
                     f"{run['parity_max_diff']['zero']:.3g} after the common warm-up")
    return lines + [""]


def summary_md(doc) -> str:
    env = doc["environment"]
    lines = ["# Sharded optimizer state: step time and memory per rank", "",
             f"`{env['command']}`", "",
             f"torch {env['torch']}, Python {env['python']}, {env['cores']} cores ({env['cpu']}), "
             f"Gloo, one thread per rank; link {env['link']} per host ({env['emulation']}); "
             f"{env['optimizer']}; {env['date']}.", "",
             "Step time: median over blocks of consecutive steps (no barrier inside a block), "
             "each block its slowest rank's mean step; variants round-robin, so the ratio to "
             "ddp_adamw pairs adjacent blocks (bootstrap 95% interval). Memory per rank from a "
             "separate launch, each variant built fresh: optimizer state = the bytes of this "
             "rank's optimizer-state tensors (ZeroRedundancyOptimizer: its local optimizer's; "
             "FSDP2: the local shards; pyreducer_sharded: its memory_bytes() where it has one); "
             "params and grads = distinct storages held after the last backward (FSDP2: local "
             "shards: its gathered parameters are freed after backward); buckets = the "
             "wrapper's communication buckets (torch DDP's from its logging data); peak RSS "
             "rise = ru_maxrss after the steps minus before building (high-water mark reset). "
             "Max abs param diff: against ddp_adamw after the common warm-up.", ""]
    for run in doc["runs"]:
        lines += run_section(run)
    return "\n".join(lines)


def grouped_axes(runs, height):
    """A figure with one panel per model; (fig, {model: ax}, host counts)."""
    from pyreducer.observe.plot import new_figure

    model_names = list(dict.fromkeys(r["model"] for r in runs))
    fig = new_figure(6.5 * len(model_names), height)
    axes = fig.subplots(1, len(model_names), squeeze=False)[0]
    return fig, dict(zip(model_names, axes)), sorted({r["hosts"] for r in runs})


def unavailable_mark(ax, x, run, variant) -> None:
    """An empty slot's reason, written up from the axis: a variant that could not run."""
    if run is not None and variant in run["unavailable"]:
        ax.text(x, 0.02, f"{variant}: unavailable", rotation=90, ha="center", va="bottom",
                fontsize=7, color="grey", transform=ax.get_xaxis_transform())


def plot_step_times(runs, variants, path) -> str:
    """Median step time per variant, grouped by host count, one panel per model; the ratio to
    ddp_adamw above each bar, the IQR as the error bar."""
    from pyreducer.observe.plot import save

    fig, axes, hosts = grouped_axes(runs, 4.5)
    width = 0.8 / len(variants)
    for model, ax in axes.items():
        for i, v in enumerate(variants):
            for j, h in enumerate(hosts):
                run = next((r for r in runs if r["model"] == model and r["hosts"] == h), None)
                step = run and run["step"].get(v)
                x = j + (i - (len(variants) - 1) / 2) * width
                if not step:
                    unavailable_mark(ax, x, run, v)
                    continue
                ax.bar(x, step["median_ms"], width, color=f"C{i}", label=v if j == 0 else None,
                       yerr=[[step["median_ms"] - step["p25_ms"]],
                             [step["p75_ms"] - step["median_ms"]]], capsize=2)
                ref = run["step"].get(REFERENCE)
                if ref:
                    ax.text(x, step["p75_ms"], f"{step['median_ms'] / ref['median_ms']:.2f}",
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(hosts)), [f"{h} hosts" for h in hosts])
        ax.set_ylabel("median step ms (slowest rank)")
        ax.set_title(f"{model}: step time (label: / {REFERENCE})")
        ax.legend(fontsize=7)
    return save(fig, path)


def plot_optimizer_state(runs, variants, path) -> str:
    """Optimizer-state bytes per rank over ddp_adamw's (bar: the largest rank, dot: the mean),
    grouped by host count, with the 1/N line of an even shard."""
    from pyreducer.observe.plot import save

    fig, axes, hosts = grouped_axes(runs, 4.5)
    width = 0.8 / len(variants)
    for model, ax in axes.items():
        for j, h in enumerate(hosts):
            run = next((r for r in runs if r["model"] == model and r["hosts"] == h), None)
            if run is None or REFERENCE not in run["memory"]:
                continue
            reference = max(r["optimizer_state"] for r in run["memory"][REFERENCE])
            for i, v in enumerate(variants):
                ranks = run["memory"].get(v)
                x = j + (i - (len(variants) - 1) / 2) * width
                if not ranks or not reference:
                    unavailable_mark(ax, x, run, v)
                    continue
                states = [r["optimizer_state"] / reference for r in ranks]
                ax.bar(x, max(states), width, color=f"C{i}", label=v if j == 0 else None)
                ax.plot([x], [sum(states) / len(states)], "o", color="black", markersize=3)
                ax.text(x, max(states), f"{max(states):.2f}", ha="center", va="bottom",
                        fontsize=7)
            ax.hlines(1 / h, j - 0.45, j + 0.45, colors="red", linestyles="--",
                      label="1/N" if j == 0 else None)
        ax.set_xticks(range(len(hosts)), [f"{h} hosts" for h in hosts])
        ax.set_ylabel(f"optimizer state per rank / {REFERENCE}'s")
        ax.set_title(f"{model}: optimizer state (bar: largest rank, dot: mean)")
        ax.legend(fontsize=7)
    return save(fig, path)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                        help="host counts (one rank per host, pinned to core rank %% cores)")
    parser.add_argument("--model", nargs="+", default=["transformer", "mlp_large"])
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, some of {','.join(VARIANTS)}; {REFERENCE} is "
                             "always run (the reference)")
    parser.add_argument("--link", default="1gbit", help="each host's NIC rate (tc tbf)")
    parser.add_argument("--steps", type=int, default=10,
                        help="timed steps per variant per round (default 10)")
    parser.add_argument("--block", type=int, default=5,
                        help="steps per timed block (no barrier inside; default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="default 3")
    parser.add_argument("--warmup", type=int, default=8,
                        help="warm-up steps of every variant (default 8), after which its "
                             "parameters are compared with ddp_adamw's")
    parser.add_argument("--sharded-warmup", type=int, default=15,
                        help="pyreducer_sharded's warm-up in all (schedule fifo; default 15)")
    parser.add_argument("--memory-steps", type=int, default=3,
                        help="steps of each variant in the memory phase (default 3)")
    parser.add_argument("--batch", type=int, default=None,
                        help="per rank (default: models.BENCH_BATCH)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    parser.add_argument("--timeout", type=float, default=1200, help="per launch, seconds")
    parser.add_argument("--out", required=True, help="directory for the results")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; expected some of {','.join(VARIANTS)}")
    if REFERENCE not in args.variants:
        args.variants.insert(0, REFERENCE)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if hosts_unavailable("bench_sharded.py"):
        return 2
    os.makedirs(args.out, exist_ok=True)
    doc = dict(environment=environment(args, argv), runs=[])
    for hosts in args.ranks:
        for model in args.model:
            doc["runs"].append(run_setup(model, hosts, args))
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(doc, f, indent=1)  # after every setup: a partial run is kept
    text = summary_md(doc)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    for name, draw in (("step_time.png", plot_step_times),
                       ("optimizer_state.png", plot_optimizer_state)):
        log("wrote", draw(doc["runs"], args.variants, os.path.join(args.out, name)))
    log("wrote", os.path.join(args.out, "results.json"), "and summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
