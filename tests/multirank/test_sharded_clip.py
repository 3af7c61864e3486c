"""What a sharded clip costs (Note [Clipping shards] in pyreducer/sharded/clip.py), on CPU: the
operations one clip_grad_norm_ dispatches do not grow with the parameters (on a GPU each is a
kernel or two; tests/gpu counts the kernels and checks that no host sync happens), and its norm
is torch's clip_grad_norm_'s over the same gradients, bit for bit. The values across whole
trainings against torch DDP are tests/multirank/test_sharded.py's."""
import copy

import torch
from torch import nn


def _model(layers: int) -> nn.Module:
    """`layers` equal layers and a small head (its 3-element bias puts the slots after it off
    any 16-byte boundary, as a model's small tensors do)."""
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)], nn.Linear(16, 3))


def _top_level_ops(fn) -> list[str]:
    """The names of the aten operations `fn` dispatches itself (not those they call)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sorted(e.name for e in prof.events()
                  if e.cpu_parent is None and e.name.startswith("aten::"))


def clip_cost_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    out = {}
    for layers in (4, 16):
        torch.manual_seed(3)
        base = _model(layers)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
        model = DistributedDataParallel(base)  # torch's default caps: one bucket
        opt = model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard=True)
        for _ in range(2):  # past the rebuild
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        model.synchronize()  # (the update written: the reference starts from the same values)
        reference = TorchDDP(copy.deepcopy(model.module))
        model(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        total = opt.clip_grad_norm_(1e-3)  # (the shards' .grad taken; the index tensors made)
        torch_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
        ops = _top_level_ops(lambda: opt.clip_grad_norm_(1e-3))  # (clips the clipped: as cheap)
        owners = opt.pieces.owners()
        out[layers] = dict(ops=ops, params=len(owners), same_norm=torch.equal(total, torch_total),
                           cut=[i for i, of in enumerate(owners) if len(of) > 1],
                           lays_out=any(of[0] == rank for of in owners if len(of) > 1))
        opt.step()
        opt.zero_grad()
    return out


def test_a_clip_dispatches_the_same_operations_for_4_times_the_parameters(ranks_once):
    for rank, r in enumerate(ranks_once(clip_cost_worker, 2, ())):
        small, large = r[4], r[16]
        assert small["same_norm"] and large["same_norm"], f"rank {rank}: not torch's norm"
        assert large["params"] == 34 and small["params"] == 10, (small, large)
        # one parameter cut by the shard boundary in each (gathered: the same operations)
        assert len(small["cut"]) == len(large["cut"]) == 1, (small["cut"], large["cut"])
        assert small["lays_out"] == large["lays_out"], (small, large)
        assert large["ops"] == small["ops"], f"rank {rank}: {small['ops']} vs {large['ops']}"


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16, dtype=torch.float64)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4, dtype=torch.float64)

    def forward(self, x):
        return self.c(self.b(self.a(x.double()).tanh().float()).tanh().double())


def mixed_dtypes_worker(rank, world_size):
    """float32 and float64 layers, float64 first: torch stacks the groups' norms in its own
    grouping's order (a hash map's), which the total's rounding depends on."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    torch.manual_seed(5)
    base = _Mixed()
    totals = {}
    for name, cls in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
        model = cls(copy.deepcopy(base), bucket_cap_mb=0.002)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if name == "ours":
            opt = model.overlap_optimizer(opt, shard=True)
        gen = torch.Generator().manual_seed(rank)
        totals[name] = []
        for _ in range(3):
            model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
            totals[name].append(opt.clip_grad_norm_(1e-3) if name == "ours" else
                                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
            opt.step()
            opt.zero_grad()
    return totals


def test_mixed_dtypes_total_norm_is_torchs(ranks_once):
    for rank, r in enumerate(ranks_once(mixed_dtypes_worker, 3, ())):
        assert all(torch.equal(a, b) for a, b in zip(r["ours"], r["torch"])), (rank, r)
