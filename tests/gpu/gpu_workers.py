"""Rank functions of the GPU kit (module-level, so spawned NCCL ranks can run them). Each
returns plain data (tensors come back on the CPU)."""
import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from gpu_kit import rank_device

# The link probe's pieces at every synced forward (AutotuneConfig.probe_every=1, not 6): these
# runs are a few dozen steps long and count on autotune deciding within them.
def _fast_probe():
    from pyreducer.tuning import AutotuneConfig
    return AutotuneConfig(probe_every=1)


def _mlp():
    return nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 8))


def _steps(model, device, steps, seed, cpu_inputs=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        out = model(x if cpu_inputs else x.to(device))
        # float: mixed precision's outputs are float16/bfloat16, and mse_loss wants one dtype
        torch.nn.functional.mse_loss(out.float(), y.to(device)).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
    return grads


def one_rank_worker(rank, world_size):
    """World size 1 on one GPU with NCCL: rebuild (its broadcast on the GPU), device timeline,
    inputs, hooks, unused parameters, autotune; then NCCL's own paths, each part on its own so
    that one failing leaves the others' results (one rank: no peer to fall out of step with):
    a 64 MiB bucket timed on the device clock, the finite-flag exchange, the sparse refusal."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    torch.manual_seed(0)
    base = _mlp().to(device)
    out = {}
    ours = DistributedDataParallel(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=0.5)
    theirs = TorchDDP(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=0.5)
    out["grads"] = dict(ours=_steps(ours, device, 4, 1, cpu_inputs=True),
                        torch=_steps(theirs, device, 4, 1, cpu_inputs=True))
    out["plans"] = [b["params"] for b in ours.bucket_plan()]
    out["timeline"] = ours.timeline(3)
    out["stats"] = ours.overlap_stats()
    out.update(_packed_sequence(rank))
    out.update(_nested_inputs(rank))
    out.update(_hooks(base, rank))
    out.update(_unused(rank))
    auto = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=_fast_probe())
    _steps(auto, device, 8, 2)
    out["autotune_log"] = auto.autotune_log
    from overlap_workers import sharded_worker

    for name, part in (("big_bucket", big_bucket_worker), ("check_finite", check_finite_worker),
                       ("sparse_error", sparse_on_nccl_worker), ("sharded", sharded_worker)):
        out[name] = _part(part, rank, world_size)
    return out


def _part(fn, rank, world_size):
    """fn's result, or {"error": its traceback}."""
    import traceback

    try:
        return fn(rank, world_size)
    except Exception:  # noqa: BLE001 - reported to the test that reads this part
        return {"error": traceback.format_exc()}


def _packed_sequence(rank):
    """An LSTM fed a PackedSequence made on the CPU (batch_sizes must stay there)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch.nn.utils.rnn import pack_padded_sequence

    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    torch.manual_seed(3)
    lstm = nn.LSTM(4, 8, batch_first=True).to(device)
    packed = pack_padded_sequence(torch.randn(3, 5, 4), torch.tensor([5, 3, 2]),
                                  batch_first=True, enforce_sorted=False)
    result = {}
    for key, cls in (("ours", DistributedDataParallel), ("torch", TorchDDP)):
        model = cls(copy.deepcopy(lstm), device_ids=[device.index])
        output, _ = model(packed)
        output.data.sum().backward()
        result[key] = [p.grad.clone() for p in model.parameters()]
    return {"packed": result}


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    extra: dict


class _Echo(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, batch, scale):
        self.seen = (batch.x.device, batch.extra["y"].device, scale.device)
        return self.linear(batch.x * scale).sum() + batch.extra["y"].sum()


def _nested_inputs(rank):
    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    model = DistributedDataParallel(_Echo().to(device), device_ids=[device.index])
    model(_Batch(torch.randn(2, 4), {"y": torch.ones(3)}), scale=torch.tensor(2.0)).backward()
    return {"input_devices": [str(d) for d in model.module.seen]}


def _hooks(base, rank):
    """torch's fp16 hook and pyreducer's built-in one, with the device timeline recording
    (its done events come from the hooks' futures)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    result = {}
    for key, cls in (("ours", DistributedDataParallel), ("torch", TorchDDP)):
        model = cls(copy.deepcopy(base), device_ids=[device.index], bucket_cap_mb=0.5)
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        result[key] = _steps(model, device, 3, 4)
        if key == "ours":
            result["timeline"] = model.timeline(1)
    builtin = DistributedDataParallel(copy.deepcopy(base), device_ids=[device.index])
    builtin.register_builtin_hook("bf16")
    result["builtin"] = _steps(builtin, device, 3, 4)
    return {"hooks": result}


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x):
        return self.used(self.trunk(x))


def _unused(rank):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    torch.manual_seed(5)
    base = _TwoHeads().to(device)
    result = {}
    for key, cls in (("ours", DistributedDataParallel), ("torch", TorchDDP)):
        model = cls(copy.deepcopy(base), device_ids=[device.index],
                    find_unused_parameters=True)
        for step in range(3):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)) \
                .sum().backward()
        result[key] = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    return {"unused": result}


def no_set_device_worker(rank, world_size):
    """A script that never calls torch.cuda.set_device: valid with torch DDP (everything uses the
    parameters' device), so it must be with pyreducer: construction (model check, broadcast),
    the rebuild, the timeline's clock alignment and autotune's collectives."""
    from pyreducer import DistributedDataParallel
    from pyreducer.observe.trace import gather_timelines

    device = torch.device("cuda", rank)  # NCCL, one GPU per rank
    assert torch.cuda.current_device() == 0  # the trap: every rank's current device is cuda:0
    torch.manual_seed(rank)
    model = DistributedDataParallel(_mlp().to(device), device_ids=[rank], bucket_cap_mb=0.5)
    grads = _steps(model, device, 3, 7)
    gathered = gather_timelines(model, 2)
    auto = DistributedDataParallel(_mlp().to(device), bucket_cap_mb=_fast_probe())
    _steps(auto, device, 40, 8)  # decides by forward 32 even after a close call
    return dict(grads=grads[-1], gathered=gathered is not None, log=auto.autotune_log)


def strides_worker(rank, world_size):
    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(device)
    if rank == 1:
        conv = conv.to(memory_format=torch.channels_last)
    try:
        DistributedDataParallel(conv, device_ids=[device.index])
    except ValueError as error:
        return str(error)
    return None


def big_bucket_worker(rank, world_size):
    """One 64 MiB bucket: its device-timed all-reduce takes real time (at most ~1 TB/s)."""
    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    model = DistributedDataParallel(nn.Linear(4096, 4096, bias=False).to(device),
                                    device_ids=[device.index], bucket_cap_mb=1000)
    for _ in range(4):
        model(torch.randn(8, 4096, device=device)).sum().backward()
    return dict(timeline=model.timeline(2), stats=model.overlap_stats(2))


def ddp_logging_worker(rank, world_size):
    """One 64 MiB bucket on NCCL: _get_ddp_logging_data() of iteration 4 (published by the 5th
    forward) and the device timeline's records it comes from (pyreducer/wrapper/ddp_logging.py);
    then the profiler's names of a backward's ranges (comm.cpp, launch_timed) and its NCCL
    kernels."""
    from torch.profiler import ProfilerActivity, profile

    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    model = DistributedDataParallel(nn.Linear(4096, 4096, bias=False).to(device),
                                    device_ids=[device.index], bucket_cap_mb=1000)
    x = torch.randn(8, 4096, device=device)
    for _ in range(4):
        model(x).sum().backward()
    records = model.timeline(2)
    model(x).sum().backward()  # its forward publishes iteration 4's stats
    data = model._get_ddp_logging_data()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(x).sum().backward()
        torch.cuda.synchronize(device)
    events = prof.events()
    return dict(data=data, timeline=records,
                ranges=sorted({e.name for e in events if e.name.startswith("pyreducer.")
                               and "bucket" in e.name}),
                nccl_kernels=sorted({e.name for e in events if "nccl" in e.name.lower()
                                     and e.device_type == torch.autograd.DeviceType.CUDA}))


def join_fp16_worker(rank, world_size):
    """Uneven inputs under join() with torch's fp16 hook, on NCCL (where a dtype mismatch between
    a joined rank's shadow all-reduce and the training ranks' would hang or corrupt)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    torch.manual_seed(9)
    base = _mlp().to(device)
    result = {}
    for key, cls in (("ours", DistributedDataParallel), ("torch", TorchDDP)):
        model = cls(copy.deepcopy(base), device_ids=[device.index], bucket_cap_mb=0.5)
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(rank)
        with model.join():
            for _ in range(2 + 2 * rank):
                opt.zero_grad()
                x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
                torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
                opt.step()
        result[key] = [p.detach().clone() for p in model.parameters()]
    return result


def link_probe_worker(rank, world_size):
    """The autotune's link probe (its first log entry) and the all-reduce bus bandwidth measured
    directly on the same ranks, to check the one against the other."""
    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    busbw_gbps = allreduce_busbw_gbps(rank, world_size)
    torch.manual_seed(0)
    auto = DistributedDataParallel(_mlp().to(device), device_ids=[device.index],
                                   bucket_cap_mb=_fast_probe())
    _steps(auto, device, 12, 8)
    return dict(busbw_gbps=busbw_gbps, log=auto.autotune_log)


def allreduce_busbw_gbps(rank, world_size):
    """All-reduce bus bandwidth of 256 MiB here (nccl-tests' definition), for checking the link
    probe against."""
    import time

    data = torch.ones(64 << 20, device=rank_device(rank))
    for _ in range(3):
        dist.all_reduce(data)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(data)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 10
    return 2 * (world_size - 1) / world_size * data.numel() * 4 / seconds / 1e9


class _TwoStreams(nn.Module):
    """The first layers run on a side stream (so do their backward and their gradients' hooks,
    autograd keeping each op's stream), the rest on the current stream."""

    def __init__(self, side_stream):
        super().__init__()
        self.side = side_stream
        self.a = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256))
        self.b = nn.Sequential(nn.ReLU(), nn.Linear(256, 8))

    def forward(self, x):
        if self.side is None:
            return self.b(self.a(x))
        current = torch.cuda.current_stream()
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            h = self.a(x)
        current.wait_stream(self.side)
        h.record_stream(current)
        return self.b(h)


def two_streams_worker(rank, world_size):
    """Gradients copied into one bucket from two streams (Note [Streams of a bucket]): the
    launch must wait for both. Reference: the same model on one stream."""
    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    results = {}
    for key, side in (("two_streams", torch.cuda.Stream(device)), ("one_stream", None)):
        torch.manual_seed(11)
        model = DistributedDataParallel(_TwoStreams(side).to(device), device_ids=[device.index],
                                        bucket_cap_mb=1000)
        gen = torch.Generator().manual_seed(rank)
        grads = []
        for _ in range(3):
            model.zero_grad()
            x, y = torch.randn(256, 32, generator=gen), torch.randn(256, 8, generator=gen)
            torch.nn.functional.mse_loss(model(x), y.to(device)).backward()
            torch.cuda.synchronize(device)
            grads.append([p.grad.detach().clone() for p in model.parameters()])
        results[key] = grads
    return results


def mixed_precision_worker(rank, world_size):
    """torch DDP's own mixed precision (it needs CUDA: here it is the oracle) against
    pyreducer's, fp16 and bf16, on NCCL; gradients and parameters after 4 steps."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch.nn.parallel.distributed import _MixedPrecision

    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    out = {}
    for name, dtypes in (("fp16", (torch.float16, torch.float16, torch.float16)),
                         ("bf16_reduce_fp32", (torch.bfloat16, torch.float32, torch.bfloat16))):
        torch.manual_seed(0)
        base = _mlp().to(device)
        for key, cls in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
            model = cls(copy.deepcopy(base), device_ids=[device.index],
                        mixed_precision=_MixedPrecision(*dtypes))
            grads = _steps(model, device, 4, 10 + rank)
            out[(name, key)] = dict(grads=grads, params=[p.detach().clone()
                                                         for p in model.parameters()])
    return out


def averaging_worker(rank, world_size):
    """pyreducer's averaging hook on CUDA (gradient_predivide_factor, reduce_dtype float32 on
    float16 gradients) against the same arithmetic written out with torch ops."""
    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    torch.manual_seed(0)
    base = _mlp().to(device).half()
    model = DistributedDataParallel(copy.deepcopy(base), device_ids=[device.index],
                                    bucket_cap_mb=1000,
                                    gradient_predivide_factor=2.0, reduce_dtype=torch.float32)
    reference = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
    for net in (model, reference):
        torch.nn.functional.mse_loss(net(x.to(device).half()).float(), y.to(device)).backward()
    params = list(reference.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in reversed(params)]).float()  # one bucket
    flat.mul_(1 / 2.0)
    dist.all_reduce(flat)
    flat.mul_(2.0 / world_size)
    expected, offset = [], 0
    for p in reversed(params):
        expected.append(flat[offset:offset + p.numel()].view_as(p).half())
        offset += p.numel()
    return dict(ours=[p.grad.clone() for p in reversed(list(model.parameters()))],
                expected=expected)


def sparse_on_nccl_worker(rank, world_size):
    from pyreducer import DistributedDataParallel
    from pyreducer.testing.parity import SparseEmbeddings

    try:
        device = rank_device(rank)
        DistributedDataParallel(SparseEmbeddings().to(device), device_ids=[device.index])
    except RuntimeError as error:
        return str(error)
    return None


def check_finite_worker(rank, world_size):
    """check_finite=True: a NaN in the last rank's gradient of one parameter at step 2. The
    local flags are device tensors, the reduced check one host read after the all-reduces
    (stream-ordered after them), the flag exchange an all-reduce on the GPU."""
    from pyreducer import DistributedDataParallel

    device = rank_device(rank)
    torch.manual_seed(0)
    model = DistributedDataParallel(_mlp().to(device), device_ids=[device.index],
                                    bucket_cap_mb=0.5, check_finite=True)
    weight = model.module[2].weight
    state = {"step": 0}

    def poison(grad):
        if rank == world_size - 1 and state["step"] == 2:
            grad = grad.clone()
            grad[0, 0] = float("nan")
        return grad

    weight.register_hook(poison)
    errors = []
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, 4):
        state["step"] = step
        model.zero_grad()  # else step 2's NaN stays in .grad and step 3 raises too
        try:
            model(torch.randn(16, 32, generator=gen).to(device)).square().mean().backward()
            errors.append(None)
        except RuntimeError as error:
            errors.append(str(error))
    return errors
