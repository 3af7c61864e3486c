"""Rank functions of the GPU kit for the overlapped optimizer (Note [Overlapped step] and Note
[Streams] in pyreducer/overlap/optimizer.py): ranks (NCCL, or Gloo sharing a GPU) against torch DDP
+ the same Adam, with CUDA streams that do not wait for each other unless the code under test makes
them."""
import contextlib
import copy

import torch

from gpu_kit import rank_device

# overlap_worker's cases: the schedule ("fifo", or a chunk size in MB) and the variant.
OVERLAP_CASES = [(schedule, variant) for schedule in ("fifo", 0.0625)
                 for variant in ("plain", "bn", "bucket_view", "stream")]


def _sleep_cycles(seconds: float) -> int:
    """torch.cuda._sleep cycles for about `seconds` on this GPU (timed on the host)."""
    import time

    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(10**7)
    torch.cuda.synchronize()
    return int(10**7 / (time.perf_counter() - start) * seconds)


def _overlap_model(variant):
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
        if variant == "bn":  # buffers: broadcast beside the reductions in flight
            layers.append(torch.nn.BatchNorm1d(256))
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 4))


def overlap_worker(rank, world_size, schedule, variant="plain"):
    """The overlapped optimizer on NCCL (deferred completion: each bucket's wait makes the
    current stream wait, then its copy-out and update run on it) against torch DDP + the same
    Adam; `schedule`: "fifo", or a chunk size in MB (chunked all-reduces in the planned order).
    The last rank's stream sleeps ~20 ms before every other backward, so the other ranks'
    reductions are still running when their host queues the copy-out and the update: a wait on
    the wrong stream, or none, changes the values. `variant`: "plain"; "bn" (BatchNorm buffers:
    Note [Buffers beside deferred reductions]); "bucket_view" (gradient_as_bucket_view); "stream"
    (the loop on a side stream, the wrappers built on the default one)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    torch.cuda.set_device(device)
    lag = _sleep_cycles(0.02)
    torch.manual_seed(5)
    base = _overlap_model(variant)
    options = dict(gradient_as_bucket_view=variant == "bucket_view")
    out = {}
    for name in ("torch", "ours"):
        module = copy.deepcopy(base).to(device)
        cls = TorchDDP if name == "torch" else DistributedDataParallel
        model = cls(module, device_ids=[device.index], bucket_cap_mb=0.3, **options)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
        if name == "ours":
            opt = model.overlap_optimizer(opt, schedule=schedule)
        gen = torch.Generator().manual_seed(rank)
        stream = torch.cuda.Stream(device) if variant == "stream" else \
            torch.cuda.current_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for step in range(10):
                x = torch.randn(16, 256, generator=gen).to(device)
                loss = model(x).pow(2).mean()
                if rank == world_size - 1 and step % 2:
                    torch.cuda._sleep(lag)
                loss.backward()
                opt.step()
                opt.zero_grad()
            if name == "ours":
                model.synchronize()
                out["chunks"] = model.reducer.launch_chunks()
        torch.cuda.synchronize(device)
        out[name] = [p.detach().cpu().clone() for p in model.parameters()]
        out[name] += [b.detach().cpu().clone() for b in model.module.buffers()]
    return out


def overlap_cases_worker(rank, world_size):
    """overlap_worker for every case of OVERLAP_CASES on the same ranks (one start of the
    ranks instead of eight): {(schedule, variant): its result}."""
    return {case: overlap_worker(rank, world_size, *case) for case in OVERLAP_CASES}


class _SideStreamRead(torch.nn.Module):
    """A forward that forks a side stream (after side.wait_stream(current), as CUDA code does):
    `b` is read first, on the side stream, after a ~20 ms sleep there; `a`, in the same bucket,
    then on the main stream, which does not wait for the side until the join."""

    def __init__(self, lag: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
        self.head = torch.nn.Linear(256, 4)
        self.lag, self.side = lag, None

    def forward(self, x):
        current = torch.cuda.current_stream(x.device)
        if self.side is None:
            self.side = torch.cuda.Stream(x.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(self.lag)
            hb = self.b(x)
        ha = self.a(x)
        current.wait_stream(self.side)
        hb.record_stream(current)
        return self.head(torch.tanh(ha + hb))


def _six_steps_against_torch(base, rank, after_backward=None, shard=False):
    """`base` trained for 6 steps with torch DDP + Adam and with pyreducer's overlapped optimizer
    over the same Adam (schedule="fifo", 25 MB buckets; `shard`: overlap_optimizer's).
    `after_backward(model)`, if given, runs after each backward; what it returns comes back per
    step ("torch_reads", "ours_reads"), with each one's parameters and pyreducer's bucket
    count."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    out = {}
    for name in ("torch", "ours"):
        cls = TorchDDP if name == "torch" else DistributedDataParallel
        model = cls(copy.deepcopy(base).to(device), device_ids=[device.index], bucket_cap_mb=25)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
        if name == "ours":
            opt = model.overlap_optimizer(opt, schedule="fifo", shard=shard)
        gen = torch.Generator().manual_seed(rank)
        reads = []
        for _ in range(6):
            model(torch.randn(16, 256, generator=gen).to(device)).pow(2).mean().backward()
            if after_backward is not None:
                reads.append(after_backward(model))
            opt.step()
            opt.zero_grad()
        if name == "ours":
            model.synchronize()
            out["buckets"] = len(model.bucket_plan())
        torch.cuda.synchronize(device)
        out[name] = [p.detach().cpu().clone() for p in model.parameters()]
        out[name + "_reads"] = [r.cpu() for r in reads]
    return out


def two_stream_forward_worker(rank, world_size, shard=False):
    """Note [Streams] in pyreducer/overlap/optimizer.py: the overlapped optimizer with
    _SideStreamRead (one bucket: the update runs on the side stream at b's read; a's read on the
    main stream must wait for it) against torch DDP + the same Adam, parameters after 6 steps.
    `shard` (NCCL): Note [Streams of a sharded step] in pyreducer/sharded/optimizer.py: the
    step and the bucket's all-gather are launched on the side stream, after its sleep, and a's
    write from the gathered buffer on the main stream must wait for the gather itself."""
    torch.cuda.set_device(rank_device(rank))
    torch.manual_seed(5)
    return _six_steps_against_torch(_SideStreamRead(_sleep_cycles(0.02)), rank, shard=shard)


def _side_stream(rank):
    """For the side-stream workers: the rank's device made current, the seed, and a side
    stream; `late()` runs its block on the side stream once that stream waited for the current
    one and slept ~20 ms there, so that a missing wait on the main stream shows."""
    device = rank_device(rank)
    torch.cuda.set_device(device)
    lag = _sleep_cycles(0.02)
    torch.manual_seed(5)
    side = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def late():
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            torch.cuda._sleep(lag)
            yield

    return device, side, late


def early_read_worker(rank, world_size):
    """Note [Streams] in pyreducer/overlap/optimizer.py: after each backward, a gradient is read on
    a side stream (after side.wait_stream(current), then a ~20 ms sleep there) before step(): the
    read completes the bucket there, so its averages are written into .grad on the side
    stream; step() then runs on the main stream, which never waits for the side unless the
    optimizer fences the bucket. The plain tensor taken from .grad there is also read on the
    main stream at once, without a wait (torch has it ready there after the backward). Against
    torch DDP + the same Adam: the parameters after 6 steps and the gradient norms each stream
    read."""
    device, side, late = _side_stream(rank)

    def read_on_side(model):
        with late():
            grad = model.module[0].weight.grad  # ours: the bucket completes here
            grad.record_stream(side)
            on_side = grad.norm()
        on_main = grad.norm()  # the main stream, which has not waited for the side
        current = torch.cuda.current_stream(device)
        current.wait_stream(side)
        on_side.record_stream(current)
        return torch.stack([on_side, on_main])

    return _six_steps_against_torch(_overlap_model("plain"), rank, read_on_side)


def unread_completion_worker(rank, world_size):
    """Note [Streams] in pyreducer/overlap/optimizer.py (Fences.settle): after each backward, the
    module's state_dict() is taken on a side stream (after side.wait_stream(current), then a ~20 ms
    sleep there): ours completes every bucket there, with no read asking for it. The gradient is
    then read on the main stream, and step() runs there, which never waits for the side unless the
    optimizer makes it. Against torch DDP + the same Adam: the parameters after 6 steps and the
    gradient norms read on the main stream."""
    _, _, late = _side_stream(rank)

    def state_dict_on_side(model):
        with late():
            model.module.state_dict()  # ours: every bucket completes here
        return model.module[0].weight.grad.norm()  # the main stream

    return _six_steps_against_torch(_overlap_model("plain"), rank, state_dict_on_side)


def side_streams_worker(rank, world_size):
    """The side-stream cases on the same ranks: {name: its worker's result}; on NCCL also the
    two-stream forward with shard=True (Gloo's reduce-scatter takes CPU tensors only)."""
    import torch.distributed as dist

    result = dict(two_stream_forward=two_stream_forward_worker(rank, world_size),
                  early_read=early_read_worker(rank, world_size),
                  unread_completion=unread_completion_worker(rank, world_size))
    if dist.get_backend() == "nccl":
        result["two_stream_forward_sharded"] = two_stream_forward_worker(rank, world_size,
                                                                         shard=True)
    return result


def sharded_worker(rank, world_size):
    """overlap_optimizer(shard=True) on the GPU (pyreducer/sharded): on NCCL, the reduce-scatter
    launched by the Reducer and the all-gathers of the sharded step, against torch DDP + the same
    AdamW (and a clip), 6 steps, parameters and the gathered state; on Gloo, whose reduce-scatter
    takes CPU tensors only, the refusal by name."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    torch.cuda.set_device(device)
    torch.manual_seed(5)
    base = _overlap_model("plain")
    if dist.get_backend() == "gloo":
        model = DistributedDataParallel(copy.deepcopy(base).to(device), device_ids=[device.index])
        try:
            model.overlap_optimizer(torch.optim.AdamW(model.parameters()), shard=True)
            return dict(refused=None)
        except ValueError as error:
            return dict(refused=str(error))
    out = {}
    for name in ("torch", "ours"):
        cls = TorchDDP if name == "torch" else DistributedDataParallel
        model = cls(copy.deepcopy(base).to(device), device_ids=[device.index], bucket_cap_mb=0.3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        if name == "ours":
            opt = model.overlap_optimizer(opt, shard=True, max_grad_norm=0.5)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(6):
            model(torch.randn(16, 256, generator=gen).to(device)).pow(2).mean().backward()
            if name == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        state = opt.state_dict()["state"]  # (collective with shard=True)
        torch.cuda.synchronize(device)
        out[name] = [p.detach().cpu().clone() for p in model.parameters()] + [
            v.detach().cpu().clone() for k in sorted(state) for v in state[k].values()
            if torch.is_tensor(v)]
    return out


def _sharded_clip_costs(device, layers: int) -> dict:
    """One clip_grad_norm_ of a sharded step (NCCL), `layers` 256 x 256 layers and a head, once
    the index tensors are made: the CUDA kernels it launches (torch.profiler) and any host sync
    (torch.cuda.set_sync_debug_mode("error") raises on one); then a step with max_grad_norm (the
    clip, the update and the gathers run by synchronize()) under the same check."""
    from torch.profiler import ProfilerActivity, profile

    from pyreducer import DistributedDataParallel

    torch.manual_seed(5)
    module = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(layers)],
                                 torch.nn.Linear(256, 3)).to(device)
    model = DistributedDataParallel(module, device_ids=[device.index])
    opt = model.overlap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), shard=True,
                                  max_grad_norm=0.5)
    x = torch.randn(16, 256, device=device)
    for _ in range(3):  # past the rebuild
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.clip_grad_norm_(0.5)  # (the shards' .grad taken, the index tensors made)
    torch.cuda.synchronize(device)
    sync_error = None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.clip_grad_norm_(0.5)
        except RuntimeError as error:
            sync_error = str(error)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize(device)
    kernels = [e.name for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name]
    opt.step()
    opt.zero_grad()
    model(x).pow(2).mean().backward()  # the next clip, in the update: max_grad_norm
    opt.step()
    torch.cuda.set_sync_debug_mode("error")
    step_sync_error = None
    try:
        opt.synchronize()
    except RuntimeError as error:
        step_sync_error = str(error)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    owners = opt.pieces.owners()
    rank = opt.comm.rank
    return dict(kernels=len(kernels), names=sorted(set(kernels)), params=len(owners),
                lays_out=any(of[0] == rank for of in owners if len(of) > 1),
                sync_error=sync_error, step_sync_error=step_sync_error)


def sharded_clip_costs_worker(rank, world_size):
    """Note [Clipping shards] in pyreducer/sharded/clip.py on NCCL: _sharded_clip_costs for 8 and
    32 layers (18 and 66 parameters)."""
    device = rank_device(rank)
    torch.cuda.set_device(device)
    return {layers: _sharded_clip_costs(device, layers) for layers in (8, 32)}
