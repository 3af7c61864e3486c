"""Note [BatchNorm's statistics deferred] (pyreducer/wrapper/pending_buffers.py), on one process:
a BatchNorm whose statistics are still on their way runs in training with the output and the
gradients of one that has them, and once they land its statistics are what it would have left;
what cannot be deferred waits, and an input changed in place before the landing is an error."""
import copy

import pytest
import torch
from torch import nn

from pyreducer.wrapper.pending_buffers import BufferBroadcast, PendingBuffer


class _Landed:
    """A broadcast already complete: wait() returns at once."""

    def wait(self):
        return True


def _pending(module: nn.Module, source: nn.Module) -> BufferBroadcast:
    """module's buffers made pending, to receive `source`'s bytes (as rank 0's would land)."""
    landing = BufferBroadcast(group=None)
    buffers = list(module.buffers())
    landing._flat = torch.cat([b.detach().reshape(-1).view(torch.uint8)
                               for b in source.buffers()])
    landing._work, landing._buffers, landing.defer = _Landed(), buffers, True
    for b in buffers:
        b._pyreducer_landing = landing
        b.__class__ = PendingBuffer
    return landing


def _pair():
    torch.manual_seed(0)
    ours = nn.BatchNorm2d(4)
    rank0 = copy.deepcopy(ours)  # rank 0's statistics: what lands
    with torch.no_grad():
        rank0.running_mean.normal_()
        rank0.running_var.uniform_(0.5, 2.0)
        rank0.num_batches_tracked.fill_(7)
    return ours, rank0


def test_training_batch_norm_runs_before_the_statistics_land_and_ends_as_with_them():
    ours, rank0 = _pair()
    reference = copy.deepcopy(rank0)  # torch DDP: rank 0's statistics before the forward
    landing = _pending(ours, rank0)
    x = torch.randn(3, 4, 5, 5)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), reference(xb)
    assert all(type(b) is PendingBuffer for b in ours.buffers())  # ran without them
    assert len(landing.deferred) == 2  # the counter's add_, the statistics' update
    g = torch.randn_like(ya)
    assert torch.equal(ya, yb)
    for a, b in zip(torch.autograd.grad(ya, (xa, ours.weight, ours.bias), g),
                    torch.autograd.grad(yb, (xb, reference.weight, reference.bias), g)):
        assert torch.equal(a, b)
    landing.complete()
    for (name, a), b in zip(ours.named_buffers(), reference.buffers()):
        assert type(a) is torch.Tensor and torch.equal(a, b), name


def test_what_cannot_be_deferred_waits():
    """No gradient (the input is not kept by autograd) and evaluation read the statistics."""
    for mode in ("no_grad", "eval"):
        ours, rank0 = _pair()
        reference = copy.deepcopy(rank0)
        landing = _pending(ours, rank0)
        if mode == "eval":
            ours.eval(), reference.eval()
        x = torch.randn(3, 4, 5, 5)
        with torch.no_grad():
            assert torch.equal(ours(x), reference(x))
        assert not landing.pending() and not landing.deferred, mode
        for a, b in zip(ours.buffers(), reference.buffers()):
            assert torch.equal(a, b), mode


def test_an_input_changed_in_place_before_the_landing_is_refused():
    ours, rank0 = _pair()
    landing = _pending(ours, rank0)
    x = torch.randn(3, 4, 5, 5, requires_grad=True)
    h = x * 1.0
    ours(h)
    with torch.no_grad():
        h.add_(1.0)  # after the BatchNorm read it, before the statistics landed
    with pytest.raises(RuntimeError, match="modified in place"):
        landing.complete()
