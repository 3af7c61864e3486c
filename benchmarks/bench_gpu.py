"""pyreducer vs torch DDP on one GPU: step time, paired, and the fused copy kernels' bandwidth.

1. Kernels: torch.ops.pyreducer.bucket_copy_in / bucket_copy_out on buckets shaped like the
   gradients of GPT-2 small and ResNet-50 (benchmarks/gpu_models.py; the first ~25 MiB that
   DDP's reverse order fills, and the whole model; float32), against a device-to-device copy of
   the same bytes (`flat.copy_(src)`). GB/s = bytes read + written / time; CUDA events around
   each call (host launch gaps count), median of repeats; results checked before timing.
2. Step time (zero_grad, forward + cross-entropy, backward, AdamW step; device synchronized
   before and after, host clock): both wrappers in the same rank processes, from the same
   initial weights (defaults: bucket_cap_mb 25, device_ids=[device]), same batches, steps
   interleaved A,B,B,A,... after warm-up; per step the slowest rank counts. One untimed step
   first checks that both give the same loss (close; bitwise recorded) and gradients (max
   |diff| <= 1e-2 max |grad|). Settings by priority: NCCL world size 1, then Gloo world size 2
   sharing the one GPU; gpt2 (batch 8 x seq 512), resnet50 (batch 32 x 224 x 224); float32,
   bfloat16 autocast. One run_ranks call per setting runs its cases that fit.
Cases run in that order while their estimate fits in --budget-s; the others are listed as
skipped ("time budget"). JSON and markdown are rewritten after each case.

Targets: step time <= 1.00 x torch DDP's (ratio of medians); kernels >= 0.80 x copy bandwidth.

    python benchmarks/bench_gpu.py --json gpu.json --markdown gpu.md --plot gpu.png
    python benchmarks/bench_gpu.py --smoke --json smoke.json   # CPU rehearsal, toy models
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

# The checkout's root, for `benchmarks`: appended, so that a pyreducer built elsewhere and put
# first on PYTHONPATH (the GPU kit's build/gpu-kit/pkg) is the one imported.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import pyreducer  # noqa: E402
from benchmarks import gpu_models  # noqa: E402
from benchmarks.gpu_models import step_rank  # noqa: E402
from pyreducer.testing import run_ranks  # noqa: E402
from pyreducer.tools.compare import paired_ratio, summarize  # noqa: E402

PRECISIONS = ("fp32", "bf16")
KERNEL_TARGET, STEP_TARGET = 0.80, 1.00
BUCKET_CAP_BYTES = {False: 25 * 2**20, True: 16 * 2**10}  # by smoke: DDP's cap; a toy one
# Conservative first guesses (seconds), replaced by measured durations as cases finish.
STARTUP_S = {False: 40.0, True: 8.0}  # spawn, import, CUDA and process-group init
STEP_GUESS_S = {False: {"gpt2": 0.15, "resnet50": 0.10}, True: {"gpt2": 0.05, "resnet50": 0.05}}
KERNEL_GUESS_S = {False: 20.0, True: 2.0}
CASE_SETUP_S = {False: 5.0, True: 1.0}  # build both wrappers and their optimizers, check step
# A group's ranks are killed after 3 x its estimate (a hang must not take the whole budget), but
# never sooner than this: the first group's estimate is the defaults above, and on a loaded
# machine spawning and importing alone can take longer than 3 x the rehearsal's 8 s.
MIN_GROUP_TIMEOUT_S = 120.0


def bucket_shapes(shapes, cap_bytes: int, element_bytes: int = 4) -> list:
    """The first bucket of cap_bytes that DDP fills: parameters in reverse order until full."""
    out, total_bytes = [], 0
    for shape in reversed(shapes):
        out.append(shape)
        total_bytes += math.prod(shape) * element_bytes
        if total_bytes >= cap_bytes:
            break
    return out


def time_ms(fn, device, repeats: int) -> float:
    """Median milliseconds of fn(): CUDA events around each call on a GPU, else the host clock."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) for start, end in events)
    samples_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples_ms.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples_ms)


def measure_bucket(shapes, device, repeats: int, divisor: float = 2.0) -> dict:
    grads = [torch.randn(s, device=device) for s in shapes]
    offsets = [sum(g.numel() for g in grads[:i]) for i in range(len(grads))]
    numel = sum(g.numel() for g in grads)
    flat, src = torch.empty(numel, device=device), torch.randn(numel, device=device)
    ops = torch.ops.pyreducer
    ops.bucket_copy_in(flat, grads, offsets, divisor)
    expected = torch.cat([(g / divisor).reshape(-1) for g in grads])
    bitwise = bool(torch.equal(flat, expected))
    if not torch.allclose(flat, expected, rtol=1e-6, atol=0):
        raise AssertionError("bucket_copy_in disagrees with g / divisor; not timing")
    flat.copy_(src)
    ops.bucket_copy_out(flat, grads, offsets)
    if not all(torch.equal(g.reshape(-1), flat[o:o + g.numel()]) for g, o in zip(grads, offsets)):
        raise AssertionError("bucket_copy_out disagrees with the bucket's slices; not timing")
    del expected
    calls = dict(copy_in=lambda: ops.bucket_copy_in(flat, grads, offsets, divisor),
                 copy_out=lambda: ops.bucket_copy_out(flat, grads, offsets),
                 copy=lambda: flat.copy_(src))
    times_ms = {f"{key}_ms": time_ms(fn, device, repeats) for key, fn in calls.items()}
    bucket_bytes = numel * flat.element_size()
    moved_bytes = 2 * bucket_bytes  # read once, written once, by the kernels and the copy alike
    out = dict(tensors=len(grads), bucket_bytes=bucket_bytes, moved_bytes=moved_bytes,
               copy_in_bitwise_equal=bitwise, **times_ms)
    for key in ("copy_in", "copy_out", "copy"):
        out[f"{key}_gbps"] = moved_bytes / (times_ms[f"{key}_ms"] * 1e-3) / 1e9
    for key in ("copy_in", "copy_out"):
        out[f"{key}_ratio"] = out[f"{key}_gbps"] / out["copy_gbps"]
    out["meets_target"] = min(out["copy_in_ratio"], out["copy_out_ratio"]) >= KERNEL_TARGET
    return out


def kernel_case(case, smoke: bool) -> list[dict]:
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    shapes = gpu_models.parameter_shapes(case["model"], tiny=smoke)
    cap_bytes = BUCKET_CAP_BYTES[smoke]
    size = f"{cap_bytes >> 20} MiB" if cap_bytes >= 2**20 else f"{cap_bytes >> 10} KiB"
    buckets = {f"first {size}": bucket_shapes(shapes, cap_bytes), "whole model": shapes}
    entries = []
    for label, bucket in buckets.items():
        entry = dict(model=case["model"], bucket=label, **measure_bucket(bucket, device,
                                                                         30 if smoke else 50))
        print(f"   {label:18s} {entry['tensors']:4d} tensors {entry['bucket_bytes'] / 1e6:8.2f} MB"
              f"  copy {entry['copy_gbps']:8.1f} GB/s  in {entry['copy_in_gbps']:8.1f} "
              f"({entry['copy_in_ratio']:.2f})  out {entry['copy_out_gbps']:8.1f} "
              f"({entry['copy_out_ratio']:.2f})", flush=True)
        entries.append(entry)
    if not smoke:
        torch.cuda.empty_cache()
    return entries


def summarize_case(results: list[dict], steps: int) -> dict:
    """One case from its ranks' results; a step lasts as long as its slowest rank."""
    out = dict(params=results[0]["params"], batch=results[0]["batch"], steps=steps,
               check=[r["check"] for r in results],
               peak_memory_gib=[r["peak_memory_gib"] for r in results],
               duration_s=max(r["duration_s"] for r in results))
    per_step_ms = {name: [max(r["seconds"][name][i] for r in results) * 1e3 for i in range(steps)]
                   for name in ("torch", "pyreducer")}
    for name, ms in per_step_ms.items():
        out[name] = summarize([m / 1e3 for m in ms])
    out["ratio"] = out["pyreducer"]["median_ms"] / out["torch"]["median_ms"]
    if steps >= 2:  # bootstrap interval over the pairs (pyreducer.tools.compare)
        out["paired"] = paired_ratio(per_step_ms["pyreducer"], per_step_ms["torch"])
    out["meets_target"] = out["ratio"] <= STEP_TARGET
    return out


def collect_group(group, cases, out_dir, error, steps) -> list[dict]:
    """The group's results from the files its ranks saved; the first case that lacks some
    carries the error, the ones after it say they did not run."""
    out, failed = [], False
    for case in cases:
        head = dict(setting=group["setting"], model=case["model"], precision=case["precision"])
        paths = [os.path.join(out_dir, f"{case['model']}-{case['precision']}.rank{r}.pt")
                 for r in range(group["world_size"])]
        if not failed and all(os.path.exists(p) for p in paths):
            out.append(head | summarize_case([torch.load(p, weights_only=False) for p in paths],
                                             steps))
            continue
        out.append(head | dict(error="not run: an earlier case in its processes failed"
                               if failed else (error or "no result saved")))
        failed = True
    return out


class Budget:
    """Runs cases while their estimate fits in what is left of total_s. A case's estimate is
    1.2 x the longest measured case of its kind, else its default scaled by the worst
    measured / default ratio of the rank processes so far (never below the default)."""

    def __init__(self, total_s: float):
        self.deadline = time.monotonic() + total_s
        self.measured_s: dict[str, list[float]] = {}
        self.scale = 1.0

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def estimate_s(self, kind: str, default_s: float) -> float:
        same = self.measured_s.get(kind)
        return 1.2 * max(same) if same else default_s * self.scale

    def record(self, kind: str, default_s: float, duration_s: float, rescale=True) -> None:
        self.measured_s.setdefault(kind, []).append(duration_s)
        if rescale:  # the in-process kernels (with CUDA's start) say little about the ranks
            self.scale = max(self.scale, duration_s / default_s)


def plan(args) -> list[dict]:
    """Kernel cases, then one group per setting (its cases run in one run_ranks call), in
    priority order, with default estimates in seconds: per case, and per group start-up."""
    smoke = args.smoke
    plans = [dict(type="kernels", model=m, label=f"kernels {m}", kind="kernels",
                  default_s=KERNEL_GUESS_S[smoke]) for m in gpu_models.MODELS]
    shared = "one GPU shared" if smoke or torch.cuda.device_count() == 1 else "one GPU each"
    settings = (("nccl", 1, "nccl ws1"), ("gloo", 2, f"gloo ws2 {shared}"))
    for backend, world_size, setting in settings:
        if smoke:  # no NCCL on the CPU: the rehearsal runs Gloo in its place
            backend, setting = "gloo", f"gloo ws{world_size} cpu"
        cases = [dict(model=model, precision=precision, label=f"{setting} {model} {precision}",
                      kind=f"{model} ws{world_size}", default_s=CASE_SETUP_S[smoke] + 2 * (
                          1 + args.warmup + args.steps) * STEP_GUESS_S[smoke][model]
                      * (4 if world_size > 1 else 1))
                 for model in gpu_models.MODELS for precision in PRECISIONS]
        plans.append(dict(type="step", setting=setting, backend=backend, world_size=world_size,
                          label=setting, cases=cases, startup_kind=f"start-up ws{world_size}",
                          startup_default_s=STARTUP_S[smoke]))
    return plans


def _probe(fn):
    """fn() or None: a missing detail of the environment must not stop the benchmark."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


def environment(args) -> dict:
    env = dict(torch=torch.__version__, pyreducer=pyreducer.__version__,
               python=platform.python_version(), machine=platform.machine(),
               cores=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M:%S"), smoke=args.smoke,
               command=" ".join([os.path.basename(sys.executable)] + sys.argv),
               optimizer="AdamW(lr=1e-4, weight_decay=0.01), torch's default implementation",
               cuda=torch.version.cuda, device="cpu")
    if args.smoke:
        return env
    smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    env.update(device=_probe(lambda: torch.cuda.get_device_name(0)),
               gpus=torch.cuda.device_count(),
               capability=_probe(lambda: "%d.%d" % torch.cuda.get_device_capability(0)),
               gpu_memory_gib=_probe(lambda: torch.cuda.get_device_properties(0).total_memory
                                     / 2**30),
               nccl=_probe(lambda: ".".join(map(str, torch.cuda.nccl.version()))),
               driver=_probe(lambda: subprocess.run(smi, capture_output=True, text=True,
                                                    timeout=20).stdout.split()[0]),
               matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
               cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
               cudnn_benchmark=torch.backends.cudnn.benchmark)
    return env


def markdown(report) -> str:
    lines = ["| setting | model | precision | params (M) | torch DDP ms [p25, p75] | "
             "pyreducer ms [p25, p75] | ratio (target <= 1.00) | results agree |",
             "|---|---|---|---|---|---|---|---|"]
    for c in report["cases"]:
        if "error" in c:
            lines.append(f"| {c['setting']} | {c['model']} | {c['precision']} | | | | "
                         f"failed: {_last_line(c['error'])[:80]} | |")
            continue
        t, p = c["torch"], c["pyreducer"]
        agree = all(k["passed"] for k in c["check"])
        bitwise = all(k["bitwise_equal"] for k in c["check"])
        lines.append(f"| {c['setting']} | {c['model']} | {c['precision']} | {c['params'] / 1e6:.3g}"
                     f" | {t['median_ms']:.2f} [{t['p25_ms']:.2f}, {t['p75_ms']:.2f}] | "
                     f"{p['median_ms']:.2f} [{p['p25_ms']:.2f}, {p['p75_ms']:.2f}] | "
                     f"{c['ratio']:.3f} | {'yes' if agree else 'NO'}"
                     f"{' (loss bitwise)' if bitwise else ''} |")
    lines += ["", "| model | bucket | tensors | MB | copy GB/s | copy_in GB/s (ratio) | "
                  "copy_out GB/s (ratio; target >= 0.80) |", "|---|---|---|---|---|---|---|"]
    for k in report["kernels"]:
        lines.append(f"| {k['model']} | {k['bucket']} | {k['tensors']} | "
                     f"{k['bucket_bytes'] / 1e6:.2f} | {k['copy_gbps']:.1f} | "
                     f"{k['copy_in_gbps']:.1f} ({k['copy_in_ratio']:.2f}) | "
                     f"{k['copy_out_gbps']:.1f} ({k['copy_out_ratio']:.2f}) |")
    lines += [""] + [f"- skipped: {s['label']} ({s['reason']})" for s in report["skipped"]]
    lines += [f"- failed: {e['label']}: {_last_line(e['error'])[:120]}"
              for e in report["kernel_errors"]]
    return "\n".join(lines).rstrip() + "\n"


def plot(report, path) -> None:
    from pyreducer.observe.plot import PlottingUnavailable, new_figure, save

    try:
        fig = new_figure(12, 4.5)
    except PlottingUnavailable as error:
        print(f"no plot: {error}", flush=True)
        return
    steps = [c for c in report["cases"] if "ratio" in c]
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    left.bar(range(len(steps)), [c["ratio"] for c in steps], color="tab:blue")
    left.set_xticks(range(len(steps)), [f"{c['setting']}\n{c['model']} {c['precision']}"
                                        for c in steps], rotation=60, ha="right", fontsize=7)
    left.axhline(STEP_TARGET, color="black", linestyle="--")
    left.set_ylabel("step time, pyreducer / torch DDP (median)")
    kernels = report["kernels"]
    for offset, key, colour in ((-0.2, "copy_in", "tab:green"), (0.2, "copy_out", "tab:orange")):
        right.bar([i + offset for i in range(len(kernels))], [k[f"{key}_ratio"] for k in kernels],
                  width=0.4, color=colour, label=key)
    right.set_xticks(range(len(kernels)), [f"{k['model']}\n{k['bucket']}" for k in kernels],
                     fontsize=7)
    right.axhline(KERNEL_TARGET, color="black", linestyle="--")
    right.set_ylabel("kernel / copy bandwidth")
    right.legend(fontsize=7)
    print(f"wrote {save(fig, path)}", flush=True)


def _last_line(text: str) -> str:
    return ([line.strip() for line in text.splitlines() if line.strip()] or [""])[-1]


def _skip(report, label, estimate_s, left_s) -> None:
    print(f"-- {label}: skipped (time budget: estimate {estimate_s:.0f} s, {left_s:.0f} s left)",
          flush=True)
    report["skipped"].append(dict(label=label, reason="time budget", estimate_s=estimate_s,
                                  left_s=left_s))


def run_kernels(case, args, budget, report) -> None:
    estimate_s, left_s = budget.estimate_s(case["kind"], case["default_s"]), budget.left_s()
    if estimate_s > left_s:
        return _skip(report, case["label"], estimate_s, left_s)
    print(f"== {case['label']} (estimate {estimate_s:.0f} s, {left_s:.0f} s left)", flush=True)
    start = time.monotonic()
    try:
        report["kernels"] += kernel_case(case, args.smoke)
    except Exception as error:  # noqa: BLE001 - one failed case must not lose the others
        report["kernel_errors"].append(dict(label=case["label"], error=f"{type(error).__name__}: "
                                                                       f"{error}"))
        print(f"   FAILED: {_last_line(report['kernel_errors'][-1]['error'])}", flush=True)
    budget.record(case["kind"], case["default_s"], time.monotonic() - start, rescale=False)


def run_group(group, args, budget, report) -> None:
    """The cases of one setting that fit (in priority order), in one run_ranks call."""
    planned_s, left_s = budget.estimate_s(group["startup_kind"], group["startup_default_s"]), \
        budget.left_s()
    run = []
    for case in group["cases"]:
        case_s = budget.estimate_s(case["kind"], case["default_s"])
        if planned_s + case_s > left_s:
            _skip(report, case["label"], planned_s + case_s, left_s)
            continue
        run.append(case)
        planned_s += case_s
    if not run:
        return
    print(f"== {group['label']}: {', '.join(c['model'] + ' ' + c['precision'] for c in run)} "
          f"(estimate {planned_s:.0f} s, {left_s:.0f} s left)", flush=True)
    threads = 1 if args.smoke else max(1, min(4, (os.cpu_count() or 1) // group["world_size"]))
    start, error = time.monotonic(), None
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as out_dir:
        config = dict(cases=[(c["model"], c["precision"]) for c in run], steps=args.steps,
                      warmup=args.warmup, smoke=args.smoke, cuda=not args.smoke, out_dir=out_dir)
        try:
            run_ranks(step_rank, group["world_size"], args=(config,), threads=threads,
                      timeout_s=min(left_s, max(3 * planned_s, MIN_GROUP_TIMEOUT_S)),
                      pg_timeout_s=max(60.0, left_s),
                      backend=group["backend"], set_device=not args.smoke)
        except Exception as failure:  # noqa: BLE001 - the cases finished before it are kept
            error = f"{type(failure).__name__}: {failure}"
            print(f"   FAILED: {_last_line(error)}", flush=True)
        results = collect_group(group, run, out_dir, error, args.steps)
    for case, result in zip(run, results):
        if "error" in result:
            continue
        budget.record(case["kind"], case["default_s"], result["duration_s"])
        t, p = result["torch"], result["pyreducer"]
        print(f"   {case['model']} {case['precision']}: torch DDP {t['median_ms']:9.2f} ms "
              f"[{t['p25_ms']:.2f}, {t['p75_ms']:.2f}]  pyreducer {p['median_ms']:9.2f} ms "
              f"[{p['p25_ms']:.2f}, {p['p75_ms']:.2f}]  ratio {result['ratio']:.3f}", flush=True)
    if error is None:  # a failed run says little about the start-up time of the next
        startup_s = time.monotonic() - start - sum(r["duration_s"] for r in results)
        budget.record(group["startup_kind"], group["startup_default_s"], startup_s)
    report["cases"] += results


def write(report, args) -> str:
    table = markdown(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=240.0, metavar="SECONDS",
                        help="wall-clock budget; cases that would not fit are skipped "
                             "(default 240)")
    parser.add_argument("--steps", type=int, default=20, metavar="N",
                        help="measured steps per wrapper (default 20)")
    parser.add_argument("--warmup", type=int, default=5, metavar="N",
                        help="untimed steps per wrapper after the check step (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables here too")
    parser.add_argument("--plot", metavar="PATH", help="bar chart of the ratios (matplotlib)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU rehearsal: toy models, Gloo only, CPU kernels")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0 (got {args.steps}, {args.warmup})")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no GPU visible: nothing to benchmark; use --smoke for the CPU rehearsal")
    if args.smoke:  # one thread, as each rank: parallel copies stall on a shared 2-core box
        torch.set_num_threads(1)
    budget = Budget(args.budget_s)
    report = dict(environment=environment(args), budget_s=args.budget_s, steps=args.steps,
                  warmup=args.warmup, cases=[], kernels=[], kernel_errors=[], skipped=[])
    for case in plan(args):
        (run_kernels if case["type"] == "kernels" else run_group)(case, args, budget, report)
        write(report, args)
    print("\n" + write(report, args), flush=True)
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(f"wrote {args.json}", flush=True)


if __name__ == "__main__":
    main()
