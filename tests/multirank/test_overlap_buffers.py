"""The buffers' broadcast awaited where the forward first reads a buffer, with an overlapped
optimizer (Note [Buffers awaited where read] in pyreducer/wrapper/pending_buffers.py): the
buffers' values stay torch DDP's bit for bit (training forwards, evaluation forwards, a
BatchNorm that reads its counter, a state_dict between steps), one collective per forward, and
no buffer is pending outside a forward."""
import copy

import pytest
import torch
from torch import nn

STEPS = 6
CLASSES = 10_000
CAP_MB = 0.0001
WIDTH = 32  # 128 bytes a BatchNorm weight: over CAP_MB, a bucket each


class BufferNet(nn.Module):
    """Conv, BatchNorm2d (momentum 0.1), then a BatchNorm1d with momentum=None (its cumulative
    average reads num_batches_tracked's value), a linear classifier. `alias`: an attribute
    holding a view of a buffer (read unseen by a torch function on the buffer: the fallback).
    The classifier's 1.3 MB weight fills the first bucket (1 MB, as torch DDP's) alone, and at
    CAP_MB every other tensor has a bucket of its own: a BatchNorm's weight is still pending
    when its forward reads its statistics."""

    def __init__(self, alias: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, WIDTH, 3, padding=1)
        self.bn = nn.BatchNorm2d(WIDTH)
        self.bn1d = nn.BatchNorm1d(WIDTH, momentum=None)
        self.head = nn.Linear(WIDTH, CLASSES)
        if alias:
            self.mean_view = self.bn.running_mean[:2]

    def forward(self, x, fail: bool = False):
        h = self.conv(x)
        if self.training:
            h = self.bn(h)
        else:  # bn read from here, its own forward hooks not run: its weight may still be
            # pending when its statistics, the first buffers read, are
            h = nn.functional.batch_norm(h, self.bn.running_mean, self.bn.running_var,
                                         self.bn.weight, self.bn.bias, False, 0.0, self.bn.eps)
        h = torch.relu(h).mean((2, 3))
        if fail:
            raise RuntimeError("a forward that raises")
        return self.head(self.bn1d(h))


def _pending(module) -> list[str]:
    from pyreducer.wrapper.pending_buffers import PendingBuffer

    return [name for name, b in module.named_buffers() if type(b) is PendingBuffer]


def worker(rank, world_size, alias):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    base = BufferNet(alias)
    out = {}
    for name in ("torch", "ours"):
        module = copy.deepcopy(base)
        model = (TorchDDP if name == "torch" else DistributedDataParallel)(module,
                                                                           bucket_cap_mb=CAP_MB)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if name == "ours":
            opt = model.overlap_optimizer(opt, schedule="fifo")  # deferred from the rebuild on
        seen, broadcasts, real = [], [], dist.broadcast

        def counting(tensor, src, group=None, **kwargs):
            if group is not None and group is getattr(model, "_buffer_group", None):  # noqa: B023
                broadcasts.append(tensor.dtype)  # (not the schedule tuner's, on the main group)
            return real(tensor, src, group=group, **kwargs)

        hook = module.conv.register_forward_pre_hook(  # (pending, broadcasts so far)
            lambda m, args: seen.append((_pending(module), len(broadcasts))))  # noqa: B023
        after_bn = []  # (pending once the BatchNorm2d ran, deferring?): training forwards only
        bn_hook = module.bn.register_forward_hook(lambda m, args, output: after_bn.append((
            _pending(module), getattr(getattr(model, "_buffer_broadcast", None),  # noqa: B023
                                      "defer", False))))
        gen = torch.Generator().manual_seed(rank)
        states = []
        dist.broadcast = counting
        try:
            for step in range(STEPS):
                x = torch.randn(6, 3, 8, 8, generator=gen)
                y = torch.randint(0, CLASSES, (6,), generator=gen)
                loss = nn.functional.cross_entropy(model(x), y)
                after_forward = _pending(module)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if step == 4:  # an evaluation forward between steps (it broadcasts too; its
                    model.eval()  # BatchNorms read their statistics first, with the weight
                    with torch.no_grad():  # the step left pending)
                        evaluated = model(x)
                    model.train()
                if step % 2 == 0:  # (state_dict completes what is in flight: every other step,
                    # so that the next forward starts with reductions in flight)
                    states.append({k: v.clone() for k, v in model.state_dict().items()})
                assert not after_forward, (step, after_forward)
            try:
                model(x, fail=True)
            except RuntimeError:
                pass
            after_raise = _pending(module)
            if name == "ours":
                model.synchronize()
        finally:
            dist.broadcast = real
            hook.remove()
            bn_hook.remove()
        out[name] = dict(seen=seen, broadcasts=broadcasts, after_raise=after_raise,
                         after_bn=after_bn,
                         evaluated=evaluated,
                         states=states, buffers={k: v.clone() for k, v in module.named_buffers()})
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "alias"])
def runs(request, ranks_once):
    return request.param, ranks_once(worker, 2, (request.param,))


def test_buffers_and_states_are_torch_ddps_bit_for_bit(runs):
    _, results = runs
    for rank, r in enumerate(results):
        for step, (ours, theirs) in enumerate(zip(r["ours"]["states"], r["torch"]["states"])):
            for key, value in theirs.items():
                assert torch.equal(ours[key], value), f"rank {rank} step {step} {key}"
        for key, value in r["torch"]["buffers"].items():
            assert torch.equal(r["ours"]["buffers"][key], value), f"rank {rank} {key} at the end"
        assert torch.equal(r["ours"]["evaluated"], r["torch"]["evaluated"]), f"rank {rank}"


def _broadcast_at(seen) -> list[bool]:
    """Per forward, whether it broadcast the buffers (a forward after an evaluation forward
    does not: torch DDP's require_forward_param_sync)."""
    counts = [0] + [n for _, n in seen]
    return [b > a for a, b in zip(counts, counts[1:])]


def test_buffers_wait_where_read_off_the_source(runs):
    """Off rank 0, every buffer is pending when a forward that broadcast starts (the conv reads
    none) unless an attribute holds a view of one; on rank 0 never; after the forward, never
    (even one that raised)."""
    alias, results = runs
    names = sorted(results[0]["torch"]["buffers"])
    for rank, r in enumerate(results):
        seen = r["ours"]["seen"]
        assert len(seen) == STEPS + 2  # the evaluation forward, and the one that raised
        assert _broadcast_at(seen) == [True] * 6 + [False] + [True], seen
        expected = [names if b and rank and not alias else [] for b in _broadcast_at(seen)]
        assert [sorted(p) for p, _ in seen] == expected, (rank, seen)
        assert r["ours"]["after_raise"] == [], r["ours"]["after_raise"]


def test_batch_norm_statistics_are_deferred_in_training(runs):
    """Note [BatchNorm's statistics deferred]: off rank 0, in a forward that started with
    reductions in flight, a training BatchNorm2d runs without waiting (its counter's add_ and
    its statistics' update recorded): every buffer is still pending after it (the BatchNorm1d
    after it, with momentum=None, reads its counter and waits); the values stay torch DDP's
    (test_buffers_and_states_are_torch_ddps_bit_for_bit). Without reductions in flight (the
    first forwards) the first read waits."""
    alias, results = runs
    names = sorted(results[0]["torch"]["buffers"])
    for rank, r in enumerate(results):
        # training forwards: the steps but the one after the evaluation forward (no broadcast
        # there), and the one that raised
        broadcast = [b for b, training in zip(_broadcast_at(r["ours"]["seen"]),
                                              [True] * (STEPS - 1) + [False, True, True]) if training]
        after_bn = r["ours"]["after_bn"]
        expected = [names if b and rank and not alias and defer else []
                    for b, (_, defer) in zip(broadcast, after_bn)]
        assert [sorted(p) for p, _ in after_bn] == expected, (rank, after_bn)
        if not alias:
            assert sum(defer for _, defer in after_bn) >= 2, after_bn


def test_one_collective_per_forward(runs):
    """The float statistics and the int64 counters go as one uint8 broadcast (torch DDP sends
    one per dtype); the fallback sends as torch DDP does."""
    alias, results = runs
    for r in results:
        forwards = sum(_broadcast_at(r["ours"]["seen"]))
        expected = [torch.float32, torch.int64] if alias else [torch.uint8]
        assert r["ours"]["broadcasts"] == expected * forwards, r["ours"]["broadcasts"]
