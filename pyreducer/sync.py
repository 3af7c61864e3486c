"""Construction-time and forward-time agreement between ranks: same model, same starting state."""
from __future__ import annotations

import torch
import torch.distributed as dist

from pyreducer._ext import _C

BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024  # as torch DDP


def _describe(meta):
    name, shape, dtype = meta
    return f"{name} {tuple(shape)} {dtype}"


def verify_same_model(named_params: list[tuple[str, torch.Tensor]], group) -> None:
    """Raises ValueError on every rank unless all ranks hold the same parameters.

    Compares, in order, every reduced parameter's name, shape and dtype with rank 0's; the error
    names the first difference and the ranks involved. All ranks receive the same data, so they
    all raise together (no rank is left waiting).
    """
    local = [(name, tuple(p.shape), str(p.dtype)) for name, p in named_params]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    reference = gathered[0]
    for rank, metas in enumerate(gathered[1:], start=1):
        if len(metas) != len(reference):
            raise ValueError(
                "pyreducer.DistributedDataParallel expects the same model on every rank: "
                f"rank 0 has {len(reference)} parameters that require grad, rank {rank} has "
                f"{len(metas)}.")
        for index, (mine, theirs) in enumerate(zip(reference, metas)):
            if mine[1:] != theirs[1:] or mine[0] != theirs[0]:
                raise ValueError(
                    "pyreducer.DistributedDataParallel expects the same model on every rank: "
                    f"parameter #{index} is {_describe(mine)} on rank 0 but "
                    f"{_describe(theirs)} on rank {rank}.")


def verify_same_plan(plan: list[list[int]], group) -> None:
    """Raises ValueError on every rank unless all ranks were given the same bucket plan."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, plan, group=group)
    for rank, theirs in enumerate(gathered[1:], start=1):
        if theirs != gathered[0]:
            first = next((b for b, (x, y) in enumerate(zip(gathered[0], theirs)) if x != y),
                         min(len(theirs), len(gathered[0])))
            raise ValueError(f"bucket_plan differs between ranks: rank {rank} and rank 0 differ "
                             f"at bucket {first} (rank 0 has {len(gathered[0])} buckets, rank "
                             f"{rank} has {len(theirs)}); every rank must replay the same plan.")


def slowest(seconds: float, group=None) -> float:
    """The largest of every rank's `seconds` (collective): a step is as slow as its slowest rank.
    On an NCCL-only group the scalar travels on the current CUDA device."""
    device = "cpu"
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def from_rank0(obj, group):
    """Rank 0's `obj` (any picklable value) on every rank of `group`; collective."""
    payload = [obj]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    return payload[0]


def sync_buffers(params, src: int) -> None:
    """Overwrites the module's synced buffers with rank `src`'s (collective; params is a
    ReducedParams). Autograd version counters are kept: a forward that saved a buffer for
    backward may still run backward after the next forward's sync, as in torch DDP."""
    buffers = params.buffers()
    if not buffers:
        return
    with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
        broadcast_coalesced(buffers, params.process_group, src=src)


def broadcast_coalesced(tensors: list[torch.Tensor], group, src: int = 0,
                        chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> None:
    """Overwrites `tensors` on every rank with rank `src`'s values.

    Tensors are packed into flat chunks of one dtype and device, up to chunk_bytes each, so a
    model with hundreds of buffers costs a few collectives, not hundreds.
    """
    if not tensors:
        return
    global_src = dist.get_global_rank(group, src) if group is not None else src
    is_src = dist.get_rank() == global_src
    with torch.no_grad():
        for chunk in _chunks(tensors, chunk_bytes):
            flat = torch.cat([t.detach().reshape(-1) for t in chunk])
            dist.broadcast(flat, global_src, group=group)
            if is_src:
                continue  # its tensors already hold the values
            offset = 0
            for t in chunk:
                t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def _chunks(tensors, chunk_bytes):
    by_key: dict = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    for group_tensors in by_key.values():
        chunk, size = [], 0
        for t in group_tensors:
            nbytes = _C.size_bytes(t)
            if chunk and size + nbytes > chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(t)
            size += nbytes
        if chunk:
            yield chunk
