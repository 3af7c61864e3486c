"""Construction-time and forward-time agreement between ranks: same model, same starting state."""
from __future__ import annotations

import pickle
import warnings

import torch
import torch.distributed as dist

from pyreducer._ext import _C

BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024  # as torch DDP


# Object collectives of our own: torch's all_gather_object/broadcast_object_list put the bytes
# on torch.cuda.current_device() for an NCCL group, which is cuda:0 on every rank of a script
# that never calls set_device (valid with torch DDP, which uses the parameters' device): NCCL
# then fails with "Duplicate GPU" or hangs. These take the device explicitly.


def all_gather_object(obj, group, device) -> list:
    """Every rank's picklable `obj`, in group-rank order (collective; bytes travel on `device`)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data.to(device)
    gathered = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(gathered, padded, group=group)
    return [pickle.loads(g[:n].cpu().numpy().tobytes()) for g, n in zip(gathered, lengths)]


def broadcast_object(obj, group, device, src: int = 0):
    """Group rank `src`'s picklable `obj` on every rank (collective; bytes travel on `device`)."""
    group = dist.group.WORLD if group is None else group
    global_src = dist.get_global_rank(group, src)
    is_src = dist.get_rank(group) == src
    payload = pickle.dumps(obj) if is_src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, global_src, group=group)
    if is_src:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, global_src, group=group)
    return obj if is_src else pickle.loads(data.cpu().numpy().tobytes())


def from_rank0(obj, group, device):
    """Rank 0's `obj` (any picklable value) on every rank of `group`; collective."""
    return broadcast_object(obj, group, device, src=0)


def wait_for_device(device) -> None:
    """Blocks the host until `device` has run all its queued work (nothing to wait for on CPU).
    On CUDA a collective returns once it is enqueued: host clocks read without this time the
    enqueueing, not the communication."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def barrier(group, device) -> None:
    """Every rank of `group` has reached this point and its device is idle (collective on
    `device`; dist.barrier would pick torch.cuda.current_device() for an NCCL group)."""
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag, group=group)
    wait_for_device(device)


def slowest(seconds: float, group=None, device="cpu") -> float:
    """The largest of every rank's `seconds` (collective): a step is as slow as its slowest rank.
    `device`: the parameters' device (an NCCL group takes CUDA tensors only)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def _describe(meta) -> str:
    name, shape, dtype, strides = meta
    return f"{name} {tuple(shape)} {dtype} strides {tuple(strides)}"


class ModelMismatchError(RuntimeError, ValueError):
    """The ranks hold different models: a RuntimeError, as torch DDP raises, and a ValueError,
    as pyreducer raised before."""


def _mismatch(index: int, rank: int, mine, theirs) -> str:
    """torch DDP's words for a parameter that differs from rank 0's (its tests match on them),
    where torch has words for the difference (sizes, strides), then pyreducer's."""
    _, shape, _, strides = theirs
    layout = " (a different memory format, e.g. channels_last on one rank only)" \
        if mine[:3] == theirs[:3] else ""
    ours = (f"pyreducer.DistributedDataParallel expects the same model on every rank: parameter "
            f"#{index} is {_describe(mine)} on rank 0 but {_describe(theirs)} on rank "
            f"{rank}{layout}.")
    if shape != mine[1]:
        return (f"[{rank}]: params[{index}] in this process with sizes {list(shape)} appears not "
                f"to match sizes of the same param in process 0. ({ours})")
    if strides != mine[3]:
        return (f"[{rank}]: params[{index}] in this process with sizes {list(shape)} and strides "
                f"{list(strides)} appears not to match strides of the same param in process 0. "
                f"({ours})")
    return ours


def verify_same_model(named_params: list[tuple[str, torch.Tensor]], group, device) -> None:
    """Raises ModelMismatchError on every rank unless all ranks hold the same parameters.

    Compares, in order, every reduced parameter's name, shape, dtype and strides with rank 0's
    (as torch DDP compares sizes and strides: a parameter that is channels_last on one rank only
    would make the bucket views pair different elements); the error names the first difference
    and the ranks involved. All ranks receive the same data, so they all raise together (no
    rank is left waiting; torch DDP raises on the differing ranks only).
    """
    local = [(name, tuple(p.shape), str(p.dtype), tuple(p.stride())) for name, p in named_params]
    gathered = all_gather_object(local, group, device)
    reference = gathered[0]
    for rank, metas in enumerate(gathered[1:], start=1):
        if len(metas) != len(reference):
            raise ModelMismatchError(
                f"DDP expects same model across all ranks, but Rank {rank} has {len(metas)} "
                f"params, while rank 0 has inconsistent {len(reference)} params. (pyreducer: "
                f"parameters that require grad.)")
        for index, (mine, theirs) in enumerate(zip(reference, metas)):
            if mine != theirs:
                raise ModelMismatchError(_mismatch(index, rank, mine, theirs))


def verify_same_plan(plan: list[list[int]] | None, group, device,
                     problem: str | None = None) -> None:
    """Raises ValueError on every rank unless all ranks were given the same, usable bucket plan.
    `problem`: why this rank's plan could not be used (plan then None); every rank raises
    naming the ranks that had one, instead of leaving the others waiting here."""
    gathered = all_gather_object((plan, problem), group, device)
    problems = [(rank, why) for rank, (_, why) in enumerate(gathered) if why is not None]
    if problems:
        rank, why = problems[0]
        others = [r for r, _ in problems[1:]]
        raise ValueError(f"bucket_plan on rank {rank}: {why}"
                         + (f" (ranks {others} could not use theirs either)" if others else ""))
    plans = [theirs for theirs, _ in gathered]
    for rank, theirs in enumerate(plans[1:], start=1):
        if theirs != plans[0]:
            first = next((b for b, (x, y) in enumerate(zip(plans[0], theirs)) if x != y),
                         min(len(theirs), len(plans[0])))
            raise ValueError(f"bucket_plan differs between ranks: rank {rank} and rank 0 differ "
                             f"at bucket {first} (rank 0 has {len(plans[0])} buckets, rank "
                             f"{rank} has {len(theirs)}); every rank must replay the same plan.")


def sync_buffers(params, src: int, group=None) -> None:
    """Overwrites the module's synced buffers with rank `src`'s (collective; params is a
    ReducedParams) over `group` (default: the params' process group; src is a rank in it).
    Autograd version counters are kept: a forward that saved a buffer for backward may still
    run backward after the next forward's sync, as in torch DDP."""
    buffers = params.buffers()
    if not buffers:
        return
    with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
        broadcast_coalesced(buffers, params.process_group if group is None else group, src=src)


# Note [Buffers beside deferred reductions]
# torch DDP broadcasts rank 0's buffers (BatchNorm's running statistics) at the start of every
# forward (broadcast_buffers=True). With an overlapped optimizer the previous backward's
# reductions are still in flight then, and on the wrapper's process group the broadcast would
# queue behind them: Gloo runs a group's collectives from one FIFO (ProcessGroupGloo's worker
# threads take its work in order), NCCL one communicator's on one stream, in order. The forward
# would wait for the whole previous step's communication before its first layer, and every model
# with buffers would lose the overlap. So overlap_optimizer() (pyreducer/overlap/optimizer.py) gives
# the wrapper a second group over every rank (side_group, below) where the module has buffers, and
# the broadcast goes there: the same values, from the same rank, at the same point of the program as torch DDP's,
# beside the reductions (tests/multirank/test_overlap_beside.py: the group each broadcast used;
# test_overlap.py: the buffers bit for bit against torch DDP's on the cnn cases). On NCCL the
# two communicators' kernels then run at once; every rank issues them in the same order. A
# wrapper over a subgroup keeps its own group, with a warning: a second one would have to be
# made by every rank of the default group. On the second group the broadcast is then awaited
# where the forward first reads a buffer, not at its start (Note [Buffers awaited where read]
# in pending_buffers.py).

_side: tuple | None = None  # (the default group, its side group), per process


def side_group(group, device: torch.device):
    """A second process group over every rank, with the default group's backend and timeout,
    for collectives that must not queue behind the reductions left in flight on it (Note
    [Buffers beside deferred reductions] above); one per default group and
    process, made by the first caller, shared by the next (collective: every rank of the default
    group, in the same order, as torch.distributed.new_group requires). None where `group` is
    a subgroup (the caller keeps it): its non-members would not call new_group, and
    use_local_synchronization names the group from this process's own history of groups, which
    may differ between ranks (a hang)."""
    world = dist.group.WORLD
    if group is not None and group is not world:
        warnings.warn("pyreducer: overlap_optimizer on a process group other than the default "
                      "one: the buffers' broadcast stays on it, behind the reductions in flight "
                      "(Note [Buffers beside deferred reductions])", stacklevel=3)
        return None
    global _side
    if _side is not None and _side[0] is world:  # a new default group gets a new one
        return _side[1]
    try:
        timeout = world._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):  # not exposed by this backend: torch's default
        timeout = None
    _side = (world, dist.new_group(timeout=timeout, backend=dist.get_backend(world)))
    return _side[1]


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
