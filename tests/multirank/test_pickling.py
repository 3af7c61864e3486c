"""Pickling, as torch DDP: torch.save/torch.load and copy.deepcopy of a wrapper give a copy on
the default process group that trains, bit for bit, as torch DDP's own pickled copy does
(2 spawned Gloo ranks); a wrapper on another group refuses with torch's message."""
import copy
import io

import torch
import torch.distributed as dist

from pyreducer.testing import run_ranks

STEPS = 3


def _train(model, rank, steps=STEPS, seed=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed + rank)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 288, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def pickling_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    torch.manual_seed(0)
    base = models.spec("mlp").build()
    out = {}
    for key, cls in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
        model = cls(copy.deepcopy(base), bucket_cap_mb=0.3)
        _train(model, rank)
        loaded = _saved_and_loaded(model)
        copied = copy.deepcopy(model)
        out[key] = dict(loaded=_train(loaded, rank, seed=10), copied=_train(copied, rank, seed=20),
                        original=_train(model, rank, seed=30), type=type(loaded).__name__)
    subgroup = DistributedDataParallel(copy.deepcopy(base), process_group=dist.new_group([0, 1]))
    try:
        copy.deepcopy(subgroup)
        out["subgroup_error"] = None
    except RuntimeError as error:
        out["subgroup_error"] = str(error)
    return out


def test_pickled_copies_train_as_torch_ddps():
    for rank, result in enumerate(run_ranks(pickling_worker, 2, timeout_s=120)):
        assert result["ours"]["type"] == "DistributedDataParallel"
        for how in ("loaded", "copied", "original"):
            for a, b in zip(result["ours"][how], result["torch"][how]):
                assert torch.equal(a, b), f"rank {rank}: {how}"
        assert result["subgroup_error"].startswith(
            "DDP Pickling/Unpickling are only supported when using DDP with the default process")
        assert "ranks [0, 1]" in result["subgroup_error"]
