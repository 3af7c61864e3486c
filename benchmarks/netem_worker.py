"""One rank of benchmarks/bench.py, run inside an emulated host (pyreducer.tools.netem).

Runs every variant on the same model, seed and data: first checks that the communicating
variants end with the same parameters, then times them round-robin and writes rank 0's view
(step time = the slowest rank's, via an all-reduce MAX after each step) as JSON.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from datetime import timedelta

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pyreducer import DistributedDataParallel  # noqa: E402
from pyreducer.wrapper import pending_buffers  # noqa: E402

from pyreducer.testing import models  # noqa: E402
from pyreducer.tools.compare import paired_ratio, summarize  # noqa: E402
from pyreducer.wrapper.sync import slowest  # noqa: E402

VARIANTS = ("compute", "per_param", "flat", "torch", "pyreducer", "auto", "overlapped",
            "overlap", "sharded")
OVERLAPPED = ("overlapped", "overlap", "sharded")  # with the overlapped optimizer
# every run tunes from scratch: no decision remembered by an earlier run (pyreducer/tuning/memory.py)
os.environ["PYREDUCER_TUNING_CACHE"] = "off"
AUTO_WARMUP = 75  # autotune decides after 50-65 synced iterations (its link probe in pieces)
OVERLAP_WARMUP = 84  # the overlapped optimizer plans after ~12 steps (6 of them held), then times
# 2 rounds x 4 x 5 steps (its three best schedules and the step barrier) and a run-off of
# 2 x 3 x 5 steps; then more steps, if its tuner has not decided yet (settle_schedule)
SETTLE_MAX = 100  # at most this many more
COMPILE = None  # --compile: torch.compile's backend for every variant's module (set in main)
BUFFERS = "deferred"  # --buffers (set in main)
SHARDED_CAP_MB = 4  # the sharded variant's caps (as in benchmarks/results/sharded_*.md)


class Plain:
    """A model without a wrapper, with an explicit after-backward communication `mode`."""

    def __init__(self, module, mode):
        self.module, self.mode = module, mode

    def __call__(self, *args):
        return self.module(*args)

    def parameters(self):
        return self.module.parameters()

    def after_backward(self):
        world = dist.get_world_size()
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if self.mode == "per_param":  # the classic tutorial: one all-reduce per gradient
            for g in grads:
                dist.all_reduce(g)
                g.div_(world)
        elif self.mode == "flat":  # one flat all-reduce after backward (Apex delay_allreduce)
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(world)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def build(variant, base, cap):
    module = copy.deepcopy(base)
    if COMPILE:  # nanoGPT's order: compile, then wrap
        module = torch.compile(module, backend=COMPILE)
    if variant in ("compute", "per_param", "flat"):
        return Plain(module, variant)
    if variant == "torch":
        from torch.nn.parallel import DistributedDataParallel as TorchDDP
        return TorchDDP(module, bucket_cap_mb=cap)
    if variant == "sharded":  # (autotune refuses shard=True: each plan would move the state)
        return DistributedDataParallel(module, bucket_cap_mb=SHARDED_CAP_MB)
    if variant in ("auto", "overlap"):  # overlap: autotuned caps, then a planned schedule
        return DistributedDataParallel(module, bucket_cap_mb="auto")
    return DistributedDataParallel(module, bucket_cap_mb=cap)  # pyreducer, overlapped


def optimizer(variant, model, hold_back=0, schedule="auto"):
    """SGD; for "overlapped" the wrapper's overlapped optimizer around it
    (pyreducer/overlap/optimizer.py), with its own planned schedule ("auto"), or torch DDP's order
    ("fifo", implied by hold_back)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if variant not in OVERLAPPED:
        return opt
    if variant in ("overlap", "sharded"):  # its own schedule, always
        opt = model.overlap_optimizer(opt, shard=variant == "sharded")
    else:
        opt = model.overlap_optimizer(opt, hold_back=hold_back,
                                      schedule="fifo" if hold_back else schedule)
    if BUFFERS == "start":  # the A/B switches: Note [Buffers awaited where read] off ...
        model._buffer_broadcast = None
    pending_buffers.DEFER_BATCH_NORM = BUFFERS == "deferred"  # ... or its BatchNorm part
    timed = model._sync_buffers

    def sync_buffers():  # the forward's wait at its start (a launch only, where awaited later)
        start = time.perf_counter()
        timed()
        model.buffer_sync_s.append(time.perf_counter() - start)

    model.buffer_sync_s, model._sync_buffers = [], sync_buffers
    return opt


def settle_schedule(variant, model, spec, opt, batches) -> int:
    """Steps an overlapped variant on until its schedule tuner has decided (the same step on
    every rank: its decisions are collective), so that no trial is timed as the variant;
    returns the extra steps. Raises RuntimeError past SETTLE_MAX."""
    tuner = getattr(opt, "tuner", None)
    extra = 0
    while tuner is not None and not tuner.decided:
        if extra == SETTLE_MAX:
            raise RuntimeError(f"{variant}: the schedule tuner had not decided after "
                               f"{OVERLAP_WARMUP + SETTLE_MAX} warm-up steps")
        step(model, spec, opt, batches())
        extra += 1
    return extra


def finish(model):
    """Completes an overlapped optimizer's pending updates (nothing for the others)."""
    if hasattr(model, "synchronize"):
        model.synchronize()


def step(model, spec, opt, batch):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = spec.loss(model, batch)
    t1 = time.perf_counter()
    loss.backward()
    if isinstance(model, Plain):
        model.after_backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def schedule_arg(text: str):
    """overlap_optimizer's schedule from the command line: auto, fifo or a chunk size (MB)."""
    return text if text in ("auto", "fifo") else float(text)


def parity(spec, base, variants, cap, batch_size, hold_back, schedule, steps=3):
    """Max |param - pyreducer's param| after `steps` steps from the same start and data; for
    the wrapped variants (those that broadcast rank 0's buffers, as torch DDP), buffers too."""
    finals = {}
    for variant in variants:
        if variant == "compute":
            continue
        model = build(variant, base, cap)
        opt = optimizer(variant, model, hold_back, schedule)
        gen = torch.Generator().manual_seed(7 + dist.get_rank())
        for _ in range(steps):
            step(model, spec, opt, spec.batch(gen, batch_size))
        finish(model)
        tensors = list(model.parameters())
        if not isinstance(model, Plain):
            tensors += list(model.module.buffers())
        finals[variant] = [t.detach().clone() for t in tensors]
    reference = finals.get("pyreducer") or next(iter(finals.values()))
    return {v: max((a.double() - b.double()).abs().max().item() for a, b in zip(ps, reference))
            for v, ps in finals.items()}  # (zip: a Plain variant's parameters alone)


def buffer_waits_ms(model) -> tuple[list | None, list | None]:
    """Per rank, the median waits for the buffers' broadcast over the last forwards: at the
    forward's start ("start": the whole broadcast, or its launch where awaited later), and where
    awaited later ("later": the first read, or the forward's end; Note [Buffers awaited where
    read]); (None, None) without buffers."""
    landing = getattr(model, "_buffer_broadcast", None)
    started = getattr(model, "buffer_sync_s", [])[-64:]
    nan = float("nan")
    local = torch.tensor([statistics.median(started) * 1e3 if started else nan,
                          statistics.median(landing.waits_s) * 1e3 if landing and landing.waits_s
                          else nan], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    if all(v != v for g in gathered for v in g.tolist()):
        return None, None
    return [g.tolist()[0] for g in gathered], [g.tolist()[1] for g in gathered]


def comm_only_ms(base, reps=5) -> float:
    numel = sum(p.numel() for p in base.parameters())
    flat = torch.ones(numel)
    for _ in range(2):
        dist.all_reduce(flat)
    samples = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        samples.append(slowest(time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def slowest_rank_split(split, comm_ms) -> tuple[float, float, float, int]:
    """(forward, backward, step) medians of the rank whose bound is largest, and that rank.
    Step times are the slowest rank's, so the bound must be too: ranks on different cores
    differ (by up to 10% here), and rank 0's own split would make the bound too optimistic."""
    fwd, bwd, opt_step = (statistics.median(x) for x in zip(*split))
    local = torch.tensor([fwd, bwd, opt_step, fwd + max(bwd, comm_ms) + opt_step],
                         dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    rank = max(range(len(gathered)), key=lambda r: gathered[r][3].item())
    fwd, bwd, opt_step, _ = gathered[rank].tolist()
    return fwd, bwd, opt_step, rank


def compute_under_comm_ms(spec, base, batch_size, reps=5) -> tuple[float, float]:
    """Compute-only model beside one flat all-reduce of all gradients (issued just before the
    phase timed, waited after): median (backward, forward + backward) times, each under its
    own all-reduce. The second is one step's compute beside one step's communication, the
    floor with contention. On these emulated hosts a rank's one core also runs Gloo and the
    kernel's network stack, so communication is not free for compute; the floor and the
    overlap bound assume it is."""
    model = Plain(copy.deepcopy(base), "compute")
    numel = sum(p.numel() for p in base.parameters())
    flat = torch.ones(numel)
    gen = torch.Generator().manual_seed(5)
    backward, both = [], []
    for rep in range(2 * reps):
        batch = spec.batch(gen, batch_size)
        model.module.zero_grad(set_to_none=True)
        whole = rep % 2 == 1  # alternately: the backward alone, the forward and backward
        loss = None if whole else spec.loss(model, batch)
        dist.barrier()
        work = dist.all_reduce(flat, async_op=True)
        start = time.perf_counter()
        if whole:
            loss = spec.loss(model, batch)
        loss.backward()
        elapsed = time.perf_counter() - start
        work.wait()
        (both if whole else backward).append(slowest(elapsed) * 1e3)
    return statistics.median(backward), statistics.median(both)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--caps", default="default", help="'default' = DDP's default caps")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--interleave", action="store_true",
                        help="alternate variants every step (paired ratios with bootstrap CIs)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--loop-steps", type=int, default=0,
                        help="time blocks of this many steps (no barrier inside a block: a "
                             "per-step barrier waits behind in-flight buckets and erases the "
                             "overlapped optimizer's overlap); 0: step by step")
    parser.add_argument("--hold-back", type=int, default=0,
                        help="the overlapped variant's hold_back (first layers' buckets first)")
    parser.add_argument("--schedule", default="auto", type=schedule_arg,
                        help="the overlapped variant's schedule (overlap_optimizer(schedule=)): "
                             "auto, fifo, or a chunk size in MB")
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="torch.compile every variant's module with this backend")
    parser.add_argument("--buffers", choices=("start", "read", "deferred"), default="deferred",
                        help="overlapped variants wait for the buffers' broadcast at the "
                             "forward's start, where first read (Note [Buffers awaited where "
                             "read]), or also defer BatchNorm's statistics (the default)")
    parser.add_argument("--tuning-cache", metavar="PATH",
                        help="a tuning cache for this run's variants to share (bench.py "
                             "--caps-once); default: off, every variant tunes afresh")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.tuning_cache:  # (read where the autotuners consult it, after construction)
        os.environ["PYREDUCER_TUNING_CACHE"] = args.tuning_cache
    global BUFFERS
    BUFFERS = args.buffers
    if args.compile:
        global COMPILE
        import torch._dynamo as dynamo  # (binds no local `torch`)

        COMPILE = args.compile
        # every variant's model, and pyreducer's plans, are compiled code of the same forward:
        # above dynamo's default limit (8) a variant would silently run eagerly
        dynamo.config.recompile_limit = 256
        dynamo.config.accumulated_recompile_limit = 4096
        dynamo.config.fail_on_recompile_limit_hit = True
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    spec = models.spec(args.model)
    batch_size = args.batch or models.BENCH_BATCH.get(args.model, 32)
    variants = args.variants.split(",")
    caps = [None if c == "default" else float(c) for c in args.caps.split(",")]
    torch.manual_seed(0)
    base = spec.build()
    log = (lambda *a: print(f"[{args.model}]", *a, flush=True)) if rank == 0 else (lambda *a: None)

    checked = parity(spec, base, variants, caps[0], batch_size, args.hold_back, args.schedule)
    log("parity (max |param - pyreducer|):", {k: f"{v:.2g}" for k, v in checked.items()})
    comm_ms = comm_only_ms(base)
    log(f"one flat all-reduce of all gradients: {comm_ms:.1f} ms")
    from pyreducer.tuning import probe_contention, probe_link

    link, probe = probe_link(None, reps=3)
    loaded = probe_contention(link)
    log(f"link fit: latency {link.latency_s * 1e6:.0f} us ({loaded.latency_s * 1e6:.0f} us beside "
        f"compute), {link.bandwidth_bytes_per_s * 8 / 1e9:.3f} Gbit/s, "
        f"contention {loaded.contention:.2f}")

    results = {}
    for cap in caps:
        built = {v: build(v, base, cap) for v in variants}
        opts = {v: optimizer(v, m, args.hold_back, args.schedule) for v, m in built.items()}
        gens = {v: torch.Generator().manual_seed(11 + rank) for v in variants}
        times = {v: [] for v in variants}
        split = []  # compute-only forward/backward/step
        for v in variants:
            warmup = {"auto": AUTO_WARMUP, "overlapped": max(args.warmup, OVERLAP_WARMUP),
                      "overlap": AUTO_WARMUP + OVERLAP_WARMUP,
                      "sharded": OVERLAP_WARMUP}
            for _ in range(warmup.get(v, args.warmup)):
                step(built[v], spec, opts[v], spec.batch(gens[v], batch_size))
            extra = settle_schedule(v, built[v], spec, opts[v],
                                    lambda: spec.batch(gens[v], batch_size))  # noqa: B023
            if extra:
                log(f"{v}: {extra} more warm-up steps until its schedule was chosen")
        def timed_step(v):
            if args.loop_steps:
                return timed_block(v)
            batch = spec.batch(gens[v], batch_size)
            dist.barrier()
            fwd, bwd, opt_step = step(built[v], spec, opts[v], batch)
            times[v].append(slowest(fwd + bwd + opt_step) * 1e3)
            if v == "compute":
                split.append((fwd * 1e3, bwd * 1e3, opt_step * 1e3))

        def timed_block(v):
            """--loop-steps steps back to back; their mean, the slowest rank's. The block ends
            with the overlapped variant's last updates (its tail is not hidden: conservative)."""
            batches = [spec.batch(gens[v], batch_size) for _ in range(args.loop_steps)]
            dist.barrier()
            start = time.perf_counter()
            for batch in batches:
                fwd, bwd, opt_step = step(built[v], spec, opts[v], batch)
                if v == "compute":
                    split.append((fwd * 1e3, bwd * 1e3, opt_step * 1e3))
            finish(built[v])
            times[v].append(slowest((time.perf_counter() - start) / args.loop_steps) * 1e3)

        for r in range(args.rounds):
            if args.interleave:  # one step of each variant in turn, order reversed every step
                for s in range(args.steps):
                    for v in (variants if s % 2 == 0 else variants[::-1]):
                        timed_step(v)
            else:
                for v in variants:
                    for _ in range(args.steps):
                        timed_step(v)
            log(f"cap {cap if cap is not None else 'default'} MB round {r + 1}/{args.rounds}: "
                + ", ".join(f"{v} {statistics.median(times[v][-args.steps:]):.1f}"
                            for v in variants) + " ms (medians)")
        entry = {v: summarize([t / 1e3 for t in times[v]]) for v in variants}
        if args.interleave and "torch" in times:
            entry["paired_vs_torch"] = {v: paired_ratio(times[v], times["torch"])
                                        for v in variants if v not in ("torch", "compute")}
        if args.interleave and "auto" in times:  # the overlap against its own barrier
            entry["paired_vs_auto"] = {v: paired_ratio(times[v], times["auto"])
                                       for v in variants if v in OVERLAPPED}
        if split:
            fwd, bwd, opt_step, slow_rank = slowest_rank_split(split, comm_ms)
            entry["compute_split_ms"] = dict(forward=fwd, backward=bwd, step=opt_step,
                                             rank=slow_rank)
            entry["bound_ms"] = fwd + max(bwd, comm_ms) + opt_step
            entry["floor_ms"] = max(fwd + bwd + opt_step, comm_ms)  # with the barrier gone
            contended, beside = compute_under_comm_ms(spec, base, batch_size)
            entry["backward_under_comm_ms"] = contended
            entry["compute_under_comm_ms"] = beside
            entry["contended_bound_ms"] = fwd + max(contended, comm_ms) + opt_step
            # no barrier, one step's compute as slow as it is beside one step's communication
            entry["contended_floor_ms"] = max(beside + opt_step, comm_ms)
        if "pyreducer" in built:
            entry["buckets"] = len(built["pyreducer"].bucket_plan())
            entry["pyreducer_timeline"] = built["pyreducer"].timeline(4)  # rank 0's
            entry["pyreducer_compiled"] = built["pyreducer"].compiled_summary()
            entry["pyreducer_stats"] = built["pyreducer"].overlap_stats(last=5)["mean"]
            fwd_ms, opt_ms = (entry["compute_split_ms"]["forward"],
                              entry["compute_split_ms"]["step"]) if split else (0.0, 0.0)
            entry["profile"] = vars(built["pyreducer"].profile(fwd_ms, opt_ms, last=5))
        for v in OVERLAPPED:
            if v in built:
                stats = built[v].overlap_stats(last=5)
                entry[f"{v}_stats"] = stats["mean"]
                entry[f"{v}_waits_by_module_ms"] = stats.get("forward_wait_by_module_ms", {})
                entry[f"{v}_buckets"] = len(built[v].bucket_plan())
                entry[f"{v}_schedule"] = opts[v].schedule_log  # what was planned
                entry[f"{v}_timeline"] = built[v].timeline(4)  # rank 0's
                entry[f"{v}_buffer_start_ms"], entry[f"{v}_buffer_wait_ms"] = \
                    buffer_waits_ms(built[v])
        for v in ("auto", "overlap"):  # their bucket autotunes' logs (overlap: its buckets above)
            if v in built:
                entry[f"{v}_log"] = built[v].autotune_log
        if "auto" in built:
            entry["auto_buckets"] = len(built["auto"].bucket_plan())
        results["default" if cap is None else f"{cap:g}"] = entry
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, batch=batch_size, comm_only_ms=comm_ms,
                           link_fit=dict(latency_s=link.latency_s,
                                         bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                                         contention=loaded.contention,
                                         latency_under_load_s=loaded.latency_s,
                                         probe_s={str(k): v for k, v in probe.items()}),
                           parity_max_diff=checked, compiled=args.compile, results=results),
                      f, indent=1)
    built = opts = None  # the models dropped, torch DDP's before the group (see
    # pyreducer/testing/elastic_train.py)
    dist.destroy_process_group()
    # Skip interpreter teardown: torch 2.13 + Gloo was seen to abort there ("terminate called
    # without an active exception") after all work was done (see shared NETWORK notes).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
