"""The buffers' broadcast awaited where the forward first reads a buffer (Note [Buffers awaited
where read]), for a wrapper with an overlapped optimizer.

Note [Buffers awaited where read]
torch DDP broadcasts rank 0's buffers at the start of every forward and waits for it there. With
an overlapped optimizer the broadcast goes beside the reductions still in flight (Note [Buffers
beside deferred reductions], sync.py), but it still crosses the link they fill: on 2 emulated
hosts at 1 Gbit/s, Hugging Face's ResNet-18 with the overlap in force, the forward waited 48 ms
for it on rank 0 and 12 ms on rank 1, its first layer behind it
(benchmarks/results/third_party_20261207.md). Here:
  - the buffers go as one collective: their bytes packed into one flat uint8 tensor (torch DDP,
    and sync.broadcast_coalesced, send one per dtype: BatchNorm's float statistics and its
    int64 counters make two), asynchronously;
  - the source rank does not wait: it sends a copy, and its buffers already hold the values.
    Its work is waited at the next broadcast (long done by then) or when the wrapper ends;
  - on the other ranks each buffer wears PendingBuffer until the broadcast lands: the first
    torch function that reads or writes one of them (BatchNorm's `num_batches_tracked.add_(1)`,
    `F.batch_norm`, a `state_dict()`) waits for it and copies rank 0's bytes into every buffer,
    then runs. Metadata reads (shape, dtype, ...) pass. Whatever the forward did not read is
    completed when it returns (or raises): outside the forward no buffer is ever pending.
The values, their source and the collectives' order on the group are torch DDP's: a buffer
holds rank 0's bytes before anything reads it. The version counters are kept, as in
sync.sync_buffers. What a torch function cannot see falls back to the wait at the forward's start:
buffers that are not plain contiguous tensors on one device, a module attribute holding a view
of a buffer (bypass.aliased), and a compiled module (dynamo would trace the class); the wrapper
decides at each forward (distributed.py).
"""
from __future__ import annotations

import collections
import time

import torch
import torch.distributed as dist

from pyreducer.overlap import bypass
from pyreducer.overlap.pending import is_metadata, tensors_in


class PendingBuffer(torch.Tensor):
    """The class a buffer wears while rank 0's bytes are on their way to it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_metadata(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        deferred = _defer(func, args, kwargs)
        if deferred is not None:
            return deferred()
        for value in tensors_in(args, kwargs):
            landing = _landing(value)
            if landing is not None:
                landing.complete()  # every buffer of it wears torch.Tensor again
        # Dispatched again, not run: the other arguments' classes act too (a pending
        # parameter's update: F.batch_norm's weight, after its running statistics).
        return func(*args, **kwargs)


# Note [BatchNorm's statistics deferred]
# In training, BatchNorm reads its running statistics only to update them: its output and its
# gradients come from the batch's own statistics. So on CPU, while the broadcast is on its way,
# `num_batches_tracked.add_(1)` and a training `F.batch_norm` whose running mean and variance
# are pending run without them: the add is recorded, and F.batch_norm runs with no running
# statistics (the same output and gradients, bit for bit: tests/multirank/test_overlap_buffers.py)
# while the update is recorded. When the broadcast lands (the first read that cannot wait, or
# the forward's end), rank 0's bytes are copied in and the recorded updates run, in their order,
# as the same calls on the same inputs: F.batch_norm with the statistics, output discarded.
# The statistics are then what torch DDP's forward left, bit for bit; a non-source rank pays one
# more BatchNorm forward per layer (under no_grad) for a forward that does not wait, so this is
# done only while reductions are in flight (the overlapped step: under the barrier the link is
# idle at the forward's start, the broadcast quick, and the replays would cost 22 ms (3% of
# Hugging Face's ResNet-18's compute at batch 16, one thread) for nothing). On CUDA
# the statistics are not deferred (cuDNN's kernel may take another path without them): the
# first read waits. A momentum of None reads the counter's value (float()), and waits.
_BATCH_NORM = torch.nn.functional.batch_norm
DEFER_BATCH_NORM = True  # False: the first read waits (benchmarks/bench.py --buffers read)


def _landing(value):
    return getattr(value, "_pyreducer_landing", None)


def _defer(func, args, kwargs):
    """A callable that runs `func` now with its buffer updates recorded for later (Note
    [BatchNorm's statistics deferred]), or None where `func` must see rank 0's values."""
    if not DEFER_BATCH_NORM:
        return None
    if func is torch.Tensor.add_ and len(args) == 2 and not kwargs \
            and isinstance(args[1], (int, float)) and type(args[0]) is PendingBuffer \
            and _landing(args[0]).defer:
        counter, amount = args
        _landing(counter).deferred.append(lambda: counter.add_(amount))
        return lambda: counter
    if func is not _BATCH_NORM:
        return None
    names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum",
             "eps")
    bound = dict(zip(names, args)) | kwargs
    mean, var, x = bound.get("running_mean"), bound.get("running_var"), bound.get("input")
    if not bound.get("training") or type(mean) is not PendingBuffer or \
            type(var) is not PendingBuffer or _landing(mean) is not _landing(var) or \
            not _landing(mean).defer or \
            type(x) is not torch.Tensor or x.device.type != "cpu" or not x.requires_grad or \
            not torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return None  # (autograd keeps a grad-requiring input as it is, for the backward)
    momentum, eps = bound.get("momentum", 0.1), bound.get("eps", 1e-5)
    saved, version = x.detach(), x._version

    def update():
        if saved._version != version:
            raise RuntimeError(
                "pyreducer: the input of a training F.batch_norm was modified in place after "
                "it ran, before rank 0's buffers arrived; its running statistics were to be "
                "updated from it then (Note [BatchNorm's statistics deferred]). Modify a copy.")
        _BATCH_NORM(saved, mean, var, None, None, True, momentum, eps)

    _landing(mean).deferred.append(update)
    # Dispatched again, without the statistics: a pending weight updates first
    return lambda: _BATCH_NORM(x, None, None, bound.get("weight"), bound.get("bias"), True,
                               momentum, eps)


def eligible(buffers: list[torch.Tensor], modules) -> bool:
    """Whether every buffer can wait where it is read: plain contiguous tensors on one device,
    none of whose memory a module attribute shares (a view of it would be read unseen)."""
    if not buffers or any(type(b) is not torch.Tensor or not b.is_contiguous() for b in buffers):
        return False
    if len({b.device for b in buffers}) != 1:
        return False
    return not bypass.aliased(modules, buffers, ignore=buffers)


class BufferBroadcast:
    """One wrapper's buffers broadcast over `group` (the side group: every rank of the default
    group), awaited where read. launch() at the start of a forward, complete() when it
    returns."""

    def __init__(self, group):
        self.group = group
        self._work = None  # the last broadcast's work (the source's, until waited)
        self._flat: torch.Tensor | None = None
        self._buffers: list[torch.Tensor] = []  # pending on this rank (none on the source)
        self.deferred: list = []  # Note [BatchNorm's statistics deferred]: to run once landed
        self.defer = False  # whether this forward defers them (reductions in flight)
        # the last forwards' waits for the broadcast, seconds (the source's too: at the next
        # launch): what benchmarks/netem_worker.py reports
        self.waits_s: collections.deque = collections.deque(maxlen=64)

    def launch(self, buffers: list[torch.Tensor], src: int, defer: bool) -> None:
        """Starts the broadcast of `buffers` (eligible ones) from `src` (a rank of the group)
        and, off the source, makes them pending; `defer`: BatchNorm's statistics may be
        deferred (reductions are in flight beside the broadcast). The previous broadcast is
        completed first."""
        self.complete()
        self.defer = defer
        global_src = dist.get_global_rank(self.group, src)
        with torch.no_grad():
            flat = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in buffers])
        self._work = dist.broadcast(flat, global_src, group=self.group, async_op=True)
        if dist.get_rank() == global_src:
            return  # it sent a copy; its buffers hold the values (waited at the next launch)
        self._flat = flat
        self._buffers = list(buffers)
        for b in self._buffers:
            b._pyreducer_landing = self
            b.__class__ = PendingBuffer

    def pending(self) -> bool:
        """Whether this rank's buffers still wait for the broadcast."""
        return bool(self._buffers)

    def complete(self) -> None:
        """Waits for the broadcast (the group's timeout bounds it), then gives every pending
        buffer rank `src`'s bytes and its own class back. Idempotent."""
        work, self._work = self._work, None
        buffers, self._buffers = self._buffers, []
        flat, self._flat = self._flat, None
        for b in buffers:  # first: the copies below must not come back here
            b.__class__ = torch.Tensor
            del b._pyreducer_landing
        if work is None:
            return
        start = time.perf_counter()
        work.wait()
        self.waits_s.append(time.perf_counter() - start)
        if not buffers:
            return
        offset = 0
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            for b in buffers:
                raw = b.detach().reshape(-1).view(torch.uint8)
                raw.copy_(flat[offset:offset + raw.numel()])
                offset += raw.numel()
        deferred, self.deferred = self.deferred, []
        with torch.no_grad():
            for update in deferred:
                update()
