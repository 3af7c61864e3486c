"""Collectives beside the reductions an overlapped optimizer leaves in flight into the next
forward (Note [Deferred completion] in csrc/reducer.h): the buffers' broadcast goes to a second
process group (Note [Buffers beside deferred reductions] in pyreducer/wrapper/sync.py), and a bucket
whose parameters were all used on this rank is completed without waiting for the used-parameter
map (Note [Unused parameters]); the results stay torch DDP's bit for bit."""
import copy

import torch
from torch import nn


def buffers_worker(rank, world_size):
    """A model with buffers (BatchNorm) and an overlapped optimizer: every forward's broadcast of
    rank 0's buffers, and the process group it went to while reductions were in flight."""
    import torch.distributed as dist

    from pyreducer import DistributedDataParallel
    from pyreducer.testing.models import SmallCNN

    torch.manual_seed(0)
    model = DistributedDataParallel(SmallCNN(), bucket_cap_mb=0.01)
    opt = model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    seen, broadcast = [], dist.broadcast

    def recording(tensor, src, group=None, **kwargs):
        seen.append((step, len(model.reducer.pending_buckets()),
                     group is None or group is dist.group.WORLD))
        return broadcast(tensor, src, group=group, **kwargs)

    dist.broadcast = recording
    try:
        for step in range(5):
            model(torch.randn(4, 3, 8, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        model.synchronize()
    finally:
        dist.broadcast = broadcast
    other = DistributedDataParallel(SmallCNN())  # one second group per group and process
    other.overlap_optimizer(torch.optim.SGD(other.parameters(), lr=0.1))
    return dict(seen=seen, shared=other._buffer_group is model._buffer_group is not None)


def test_buffers_are_broadcast_beside_the_reductions_in_flight(ranks_once):
    """Note [Buffers beside deferred reductions] (pyreducer/wrapper/sync.py): on the wrapper's group
    the broadcast would wait behind the previous backward's reductions; it goes to a second
    group instead (the values are torch DDP's: test_matches_torch_ddp_bit_for_bit, cnn)."""
    for r in ranks_once(buffers_worker, 2, ()):
        in_flight = [(step, main) for step, pending, main in r["seen"] if pending]
        # forwards 3-5: the second forward completes what is in flight first (the rebuild)
        assert {step for step, _ in in_flight} == {2, 3, 4}, r["seen"]
        assert not any(main for _, main in in_flight), r["seen"]
        assert r["shared"]


class SometimesExtra(nn.Module):
    """`extra` is used on rank 1 at every step but 4, on rank 0 at steps 0 and 2 only
    (find_unused_parameters): its buckets need the used-parameter map, the first layer's do not
    (at a cap of 100 bytes every tensor but the last layer's has a bucket of its own)."""

    def __init__(self):
        super().__init__()
        self.first, self.extra, self.last = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 2)

    def forward(self, x, use_extra: bool):
        h = torch.tanh(self.first(x))
        return self.last(self.extra(h) if use_extra else h)


def used_map_worker(rank, world_size):
    """Whether the used map was still pending once the next forward's first layer had read its
    (completed, updated) parameters, per forward; and the end state against torch DDP's."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    base, out = SometimesExtra(), {}
    for name, cls in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
        model = cls(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=0.0001)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
        seen = []
        if name == "ours":
            opt = model.overlap_optimizer(opt, schedule="fifo")
            model.module.first.register_forward_hook(
                lambda *_: seen.append(model.reducer.used_map_pending()))
        gen = torch.Generator().manual_seed(rank)
        for step in range(6):
            x = torch.randn(4, 64, generator=gen)
            uses = step in (0, 2) or (rank == 1 and step != 4)  # step 4: unused everywhere
            model(x, use_extra=uses).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if name == "ours":
            model.synchronize()
            out["seen"] = seen
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out


def test_a_bucket_used_here_does_not_wait_for_the_used_map(ranks_once):
    """Note [Unused parameters], csrc/reducer_buckets.cpp defer_reductions: the used map's
    all-reduce goes after the last bucket; only a bucket holding a parameter unused on this rank
    needs it, so the first layer's update does not wait for all the communication."""
    results = ranks_once(used_map_worker, 2, ())
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["ours"], r["torch"]))
    # rank 0 at every forward after the first, also after backwards without `extra` (steps 1,
    # 3, 4): the map still pending (step 4, unused everywhere: its gradients stay None, as in
    # torch DDP, which the parity above checks through the momentum)
    assert results[0]["seen"][1:] == [True] * 5, results[0]["seen"]
