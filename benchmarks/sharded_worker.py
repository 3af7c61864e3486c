"""One rank of benchmarks/bench_sharded.py, run inside an emulated host (pyreducer.tools.netem).

Every variant trains its own copy of one model (seed 0) with AdamW(lr=1e-3, weight_decay=0.01)
on the same data (a generator per variant, seeded alike). Two phases, each its own launch:
  memory  each variant in turn, built fresh, --memory-steps steps; per rank: optimizer-state
          bytes, parameter and gradient bytes held after the last backward (distinct storages;
          FSDP2's local shards), bucket bytes where known, and the rise of the process's peak
          RSS (ru_maxrss, its high-water mark reset before each variant through
          /proc/self/clear_refs; run with a fixed glibc mmap threshold so freed tensors go back)
  time    all variants in this process: --warmup steps each, then every variant's parameters
          against ddp_adamw's (max |diff|), the rest of each one's warm-up, then blocks of
          --block steps, round-robin (order reversed every block), no barrier inside a block;
          a block's time is its slowest rank's mean step (all-reduce MAX, as netem_worker);
          for the sharded variants also where each step's time went, from the timeline
          (sharded_phases: reduce-scatter wait, steps, the first-read bucket's gather)
Rank 0 writes its JSON to --out. A variant whose construction (or first step) raises on any
rank is left out and reported as unavailable with the error.
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import os
import resource
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import netem_worker as nw  # noqa: E402  (sets PYREDUCER_TUNING_CACHE=off: every run tunes afresh)
from pyreducer.testing import models  # noqa: E402
from pyreducer.tools.compare import paired_ratio, summarize  # noqa: E402
from pyreducer.wrapper.sync import slowest  # noqa: E402

VARIANTS = ("ddp_adamw", "zero", "fsdp2", "pyreducer_sharded", "ddp_adamw_4mb",
            "pyreducer_sharded_4mb", "pyreducer_overlap")
DEFAULT_VARIANTS = VARIANTS[:6]
SMALL_CAP_MB = 4  # the *_4mb variants' bucket_cap_mb: buckets small enough to pipeline a sharded
# step's reduce-scatters with the backward and its all-gathers with the next forward
REFERENCE = "ddp_adamw"
LR, WEIGHT_DECAY = 1e-3, 0.01
SHARDED_WARMUP = 15  # the sharded mode's schedule is "fifo": nothing to tune but the buckets
GROUP_TIMEOUT_S = 60  # the longest collective here takes < 1 s; a failed peer shows by then
ZERO_PARITY_TOL = 1e-6  # ZeRO steps the same AdamW on the same averaged gradients: exact


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def fsdp_units(module) -> list:
    """The submodules fully_shard wraps before the root: a transformer's blocks, else every
    child that owns parameters (mlp_large's Linear layers)."""
    blocks = getattr(module, "blocks", None)
    if blocks is not None:
        return list(blocks)
    return [m for m in module.children() if next(m.parameters(recurse=False), None) is not None]


def build(variant, base):
    """(model, optimizer) of `variant` around a copy of `base`; raises where it cannot run."""
    module = copy.deepcopy(base)
    caps = dict(bucket_cap_mb=SMALL_CAP_MB) if variant.endswith("_4mb") else {}
    if variant in ("ddp_adamw", "zero", "ddp_adamw_4mb"):
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        model = TorchDDP(module, **caps)
        if variant != "zero":
            return model, adamw(model.parameters())
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return model, ZeroRedundancyOptimizer(model.parameters(),
                                              optimizer_class=torch.optim.AdamW,
                                              lr=LR, weight_decay=WEIGHT_DECAY)
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for unit in fsdp_units(module):
            fully_shard(unit, reshard_after_forward=False)  # ZeRO-2: parameters stay gathered
        fully_shard(module, reshard_after_forward=False)
        return module, adamw(module.parameters())
    if variant in ("pyreducer_sharded", "pyreducer_sharded_4mb", "pyreducer_overlap"):
        import pyreducer

        model = pyreducer.DistributedDataParallel(module, **caps)
        options = {"shard": True} if variant.startswith("pyreducer_sharded") else {}
        return model, model.overlap_optimizer(adamw(model.parameters()), **options)
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


PROGRESS = {"path": None, "variant": None, "error": None}  # --progress: what this rank does


def mark(**fields) -> None:
    """Records what this rank is doing (the variant it builds or warms up, an error) in
    --progress.<rank>, where the driver reads it if the ranks fail or hang."""
    PROGRESS.update(fields)
    if PROGRESS["path"]:
        with open(f"{PROGRESS['path']}.{dist.get_rank()}", "w") as f:
            json.dump({k: v for k, v in PROGRESS.items() if k != "path"}, f)


def describe(exc: BaseException) -> str:
    """The exception's type and first line."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:400]


def agreed(ok: bool) -> bool:
    """True where every rank says ok (collective)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def try_build(variant, base, first_steps=None):
    """(model, opt, None), or (None, None, error) where building (or `first_steps(model, opt)`)
    raised on some rank; every rank gets the same answer."""
    model = opt = error = None
    mark(variant=variant, error=None)
    try:
        model, opt = build(variant, base)
        if first_steps is not None:
            first_steps(model, opt)
    except Exception as exc:  # noqa: BLE001  (reported, not hidden: "variant unavailable")
        error = describe(exc)
        mark(error=error)  # the cause, should a peer now hang in a collective
    if not agreed(error is None):
        error = error or "another rank failed to build it"
        return None, None, error
    return model, opt, None


def step(model, spec, opt, batch):
    """The training loop as users write it: backward, step, zero_grad."""
    loss = spec.loss(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def module_of(model):
    return getattr(model, "module", model)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied tensors counted once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        st = local(t).untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def raw_grad(param):
    """param.grad as stored, without a parameter subclass's __torch_function__: pyreducer's
    sharded optimizer refuses a .grad read between backward and step() by design (each rank
    then holds only its shards of the averaged gradients)."""
    with torch._C.DisableTorchFunctionSubclass():
        return param.grad


def optimizer_state(opt) -> dict:
    """This rank's optimizer state: the local optimizer's for ZeroRedundancyOptimizer."""
    inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer's local optimizer
    return (inner if isinstance(inner, torch.optim.Optimizer) else opt).state


def state_bytes(opt) -> dict:
    """Optimizer-state bytes measured from its state tensors; with the sharded optimizer's own
    account (memory_bytes()) beside it, which is taken where present."""
    reported = opt.memory_bytes() if hasattr(opt, "memory_bytes") else None
    try:
        measured = storage_bytes(v for entry in optimizer_state(opt).values()
                                 for v in entry.values() if isinstance(v, torch.Tensor))
    except Exception as exc:  # noqa: BLE001  (its own account may still stand)
        if not reported:
            raise
        measured = f"{type(exc).__name__}: {exc}"[:200]
    used = reported["optimizer_state"] if reported and "optimizer_state" in reported else measured
    return dict(optimizer_state=int(used), optimizer_state_measured=measured,
                memory_bytes_reported=reported)


def bucket_bytes(model) -> int | None:
    """Bytes of the wrapper's communication buckets, where it says (None for FSDP2/unknown)."""
    reducer = getattr(model, "reducer", None)
    if hasattr(reducer, "bucket_buffers"):  # pyreducer
        return storage_bytes(reducer.bucket_buffers())
    if hasattr(model, "_get_ddp_logging_data"):  # torch DDP: its buckets' sizes (bytes)
        sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
        return sum(int(s) for s in sizes.split(",") if s.strip()) or None
    return None


def reset_peak_rss() -> int:
    """Frees what can be freed, resets the peak RSS to the current RSS; returns it (KiB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: the high-water mark := the current RSS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def finish(model) -> None:
    nw.finish(model)  # an overlapped optimizer's pending updates (pyreducer); nothing otherwise


def measure_memory(variant, base, spec, batch_size, steps) -> dict:
    """One variant built fresh and stepped `steps` times; this rank's figures (bytes)."""
    start_kib = reset_peak_rss()
    gen = torch.Generator().manual_seed(11 + dist.get_rank())
    held = {}

    def run(model, opt):
        for i in range(steps):
            loss = spec.loss(model, spec.batch(gen, batch_size))
            loss.backward()
            if i == steps - 1:  # what backward leaves: parameters, gradients, buckets
                params = list(module_of(model).parameters())
                held.update(param_bytes=storage_bytes(params),
                            grad_bytes=storage_bytes(raw_grad(p) for p in params),
                            bucket_bytes=bucket_bytes(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
        finish(model)
        held.update(state_bytes(opt))

    model, opt, error = try_build(variant, base, run)
    if error:
        return dict(error=error)
    held["peak_rss_delta_bytes"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                    - start_kib) * 1024
    del model, opt
    dist.barrier()
    return held


def full_params(variant, model) -> list[torch.Tensor]:
    """Every parameter, whole, as ddp_adamw holds it (FSDP2: gathered; collective)."""
    finish(model)
    out = []
    for p in module_of(model).parameters():
        p = p.detach()
        out.append(p.full_tensor() if hasattr(p, "full_tensor") else p.clone())
    return out


def warm_up(variants, base, spec, batch_size, args, log):
    """Builds and warms up every variant; returns (built, opts, unavailable, parity, steps)."""
    rank = dist.get_rank()
    built, opts, unavailable, parity, steps = {}, {}, {}, {}, {}
    reference = None
    for v in variants:
        gen = torch.Generator().manual_seed(11 + rank)
        batches = lambda: spec.batch(gen, batch_size)  # noqa: E731,B023
        first = lambda m, o: step(m, spec, o, batches())  # noqa: E731,B023
        model, opt, error = try_build(v, base, first)
        if error:
            unavailable[v] = error
            log(f"{v}: variant unavailable: {error}")
            continue
        for _ in range(args.warmup - 1):
            step(model, spec, opt, batches())
        finals = full_params(v, model)
        if reference is None:
            reference = finals
        parity[v] = max((a - b).abs().max().item() for a, b in zip(finals, reference))
        del finals
        extra = {"pyreducer_sharded": args.sharded_warmup,
                 "pyreducer_sharded_4mb": args.sharded_warmup,
                 "pyreducer_overlap": nw.OVERLAP_WARMUP}.get(v, args.warmup) - args.warmup
        for _ in range(max(0, extra)):
            step(model, spec, opt, batches())
        extra = max(0, extra) + nw.settle_schedule(v, model, spec, opt, batches)
        steps[v] = args.warmup + extra
        log(f"{v}: warmed up ({steps[v]} steps); max |param - {variants[0]}| after "
            f"{args.warmup} steps: {parity[v]:.3g}")
        built[v], opts[v] = model, opt
    return built, opts, unavailable, parity, steps


def timed_block(model, spec, opt, batches) -> float:
    """Steps `batches` back to back (no barrier inside); the slowest rank's mean step (ms)."""
    dist.barrier()
    start = time.perf_counter()
    for batch in batches:
        step(model, spec, opt, batch)
    finish(model)
    return slowest((time.perf_counter() - start) / len(batches)) * 1e3


PHASES = ("backward", "forward", "reduce_scatter_wait", "steps", "first_read_ready",
          "first_bucket_gathered", "forward_after_gathers")


def sharded_phases(model, count: int) -> list[dict]:
    """Where a sharded step's time went, from this rank's timeline (the last `count` synced
    iterations whose next forward ran), ms: its backward; the next forward, and in it the first
    read's wait for the first-read bucket's reduce-scatter, the shards' steps (every bucket,
    reduce-scatter waits between them included), the first-read bucket's all-gather until the
    first read's elements were there and until all were (from its launch), and the forward
    after the last bucket was gathered."""
    out = []
    for record in model.timeline(count):
        overlap = record.get("overlap") or {}
        updates = sorted(overlap.get("updates", ()), key=lambda u: u["read_ns"])
        if not overlap.get("forward_start_ns") or not updates or \
                not all(u.get("gathered_ns") for u in updates):
            continue
        first = updates[0]
        ms = lambda a, b: (a - b) / 1e6  # noqa: E731
        out.append(dict(
            backward=ms(record["backward_end_ns"], record["backward_start_ns"]),
            forward=ms(overlap["forward_end_ns"], overlap["forward_start_ns"]),
            reduce_scatter_wait=ms(first["reduced_ns"], first["read_ns"]),
            steps=ms(max(u["updated_ns"] for u in updates), first["reduced_ns"]),
            first_read_ready=ms(first.get("first_ready_ns") or first["gathered_ns"],
                                first["gather_launch_ns"]),
            first_bucket_gathered=ms(first["gathered_ns"], first["gather_launch_ns"]),
            forward_after_gathers=ms(overlap["forward_end_ns"],
                                     max(u["gathered_ns"] for u in updates))))
    return out


def time_variants(built, opts, spec, batch_size, args, log) -> tuple[dict, dict]:
    """Blocks round-robin over the variants, order reversed every block; ms per block, and
    the sharded variants' phases (sharded_phases) per step."""
    names = list(built)
    gens = {v: torch.Generator().manual_seed(1000 + dist.get_rank()) for v in names}
    times = {v: [] for v in names}
    phases = {v: [] for v in names if v.startswith("pyreducer_sharded")}
    blocks = max(1, args.steps // args.block)
    for r in range(args.rounds):
        for b in range(blocks):
            for v in names if b % 2 == 0 else names[::-1]:
                batches = [spec.batch(gens[v], batch_size) for _ in range(args.block)]
                times[v].append(timed_block(built[v], spec, opts[v], batches))
                if v in phases:
                    phases[v] += sharded_phases(built[v], args.block)
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{v} {statistics.median(times[v][-blocks:]):.1f}" for v in names)
            + f" ms (median of {blocks} block(s) of {args.block} steps)")
    return times, phases


def phase_medians(phases: dict) -> dict:
    """{variant: per rank, {phase: median ms}} (collective: every rank's)."""
    mine = {v: {k: statistics.median(p[k] for p in steps) for k in PHASES}
            for v, steps in phases.items() if steps}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {v: [r[v] for r in ranks] for v in mine}


def comm_ms(numel: int, reps: int = 3) -> dict:
    """One all-reduce of `numel` floats (DDP's collective), one reduce-scatter and one all-gather
    of them (ZeRO-2's, FSDP2's) on this network; slowest rank, median of `reps`, ms."""
    world = dist.get_world_size()
    numel = (numel + world - 1) // world * world
    flat, shard = torch.ones(numel), torch.ones(numel // world)
    # torch 2.13 names them *_single (the *_tensor names warn); torch 2.11 has only *_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    collectives = (("all_reduce", lambda: dist.all_reduce(flat)),
                   ("reduce_scatter", lambda: reduce_scatter(shard, flat)),
                   ("all_gather", lambda: all_gather(flat, shard)))
    out = {}
    for name, fn in collectives:
        fn()
        samples = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            fn()
            samples.append(slowest(time.perf_counter() - start) * 1e3)
        out[name] = statistics.median(samples)
    return out


def time_phase(variants, base, spec, batch_size, args, log) -> dict:
    numel = sum(p.numel() for p in base.parameters())
    comm = comm_ms(numel)
    log("all gradients' " + ", ".join(f"{k} {v:.1f} ms" for k, v in comm.items()))
    built, opts, unavailable, parity, steps = warm_up(variants, base, spec, batch_size, args, log)
    mark(variant=None)  # timing: a failure now is no one variant's
    times, phases = time_variants(built, opts, spec, batch_size, args, log) if built else ({}, {})
    phases = phase_medians(phases)
    summary = {v: summarize([t / 1e3 for t in ts]) for v, ts in times.items()}
    ratios = {}
    if REFERENCE in times:
        for v, ts in times.items():
            if v != REFERENCE and len(ts) >= 2:
                ratios[v] = paired_ratio(ts, times[REFERENCE])
    zero_diff = parity.get("zero")
    parity_ok = zero_diff is None or zero_diff <= ZERO_PARITY_TOL
    if not parity_ok:
        log(f"WARNING: zero ended {zero_diff:.3g} away from ddp_adamw (expected <= "
            f"{ZERO_PARITY_TOL:g})")
    for v in built:
        finish(built[v])
    built = opts = None  # dropped before the group (see pyreducer/testing/elastic_train.py)
    gc.collect()
    return dict(comm_ms=comm, unavailable=unavailable, parity_max_diff=parity,
                parity_reference=variants[0], zero_parity_ok=parity_ok, warmup_steps=steps,
                block_ms=times, step=summary, paired_vs_ddp_adamw=ratios, phases_ms=phases,
                params=numel, param_mib=numel * 4 / 2**20)


def memory_phase(variants, base, spec, batch_size, args, log) -> dict:
    per_variant, unavailable = {}, {}
    # a first pass of the reference, not recorded: it carries the process's one-time costs
    # (Gloo's and autograd's threads and buffers, lazy initialisation), which would otherwise
    # all be charged to whichever variant came first (ddp_adamw's rise was 90 MiB higher)
    measure_memory(variants[0], base, spec, batch_size, 1)
    for v in variants:
        mine = measure_memory(v, base, spec, batch_size, args.memory_steps)
        if "error" in mine:
            unavailable[v] = mine["error"]
            log(f"{v}: variant unavailable: {mine['error']}")
            continue
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        per_variant[v] = ranks
        mark(variant=None)
        log(f"{v}: optimizer state " + ", ".join(
            f"{r['optimizer_state'] / 2**20:.1f}" for r in ranks) + " MiB per rank; peak RSS "
            "rise " + ", ".join(f"{r['peak_rss_delta_bytes'] / 2**20:.0f}" for r in ranks)
            + " MiB")
        gc.collect()
    return dict(memory=per_variant, unavailable=unavailable)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("memory", "time"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=8, help="steps every variant warms up "
                        "before the parameters are compared (at least 1)")
    parser.add_argument("--sharded-warmup", type=int, default=SHARDED_WARMUP)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--progress", help="where each rank records what it does (the driver "
                        "reads it if the ranks fail)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    args.warmup = max(1, args.warmup)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    PROGRESS["path"] = args.progress
    rank = dist.get_rank()
    spec = models.spec(args.model)
    batch_size = args.batch or models.BENCH_BATCH.get(args.model, 32)
    variants = [v for v in args.variants.split(",") if v]
    variants.sort(key=lambda v: v != REFERENCE)  # the reference first: parity is against it
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; expected some of {VARIANTS}")
    torch.manual_seed(0)
    base = spec.build()
    tag = f"[{args.model}, {dist.get_world_size()} hosts, {args.phase}]"
    log = (lambda *a: print(tag, *a, file=sys.stderr, flush=True)) if rank == 0 else \
        (lambda *a: None)
    phase = memory_phase if args.phase == "memory" else time_phase
    try:
        result = phase(variants, base, spec, batch_size, args, log)
    except BaseException as exc:
        cause = PROGRESS["error"]
        mark(error=f"{cause} (then {describe(exc)})" if cause else describe(exc))
        raise
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(result, model=args.model, batch=batch_size, variants=variants,
                           hosts=dist.get_world_size()), f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as netem_worker: torch 2.13 + Gloo may abort in interpreter teardown


if __name__ == "__main__":
    main()
