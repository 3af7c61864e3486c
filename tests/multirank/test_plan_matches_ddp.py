"""pyreducer's rebuilt bucket plan is torch DDP's, bucket for bucket and index for index, at the
same caps (2 spawned Gloo ranks). Equal caps mean equal plans: that is what makes results equal
bit for bit with 3+ ranks, and what the benchmarks compare at "equal bucket cap"."""
import copy

import pytest
import torch

CASES = [("transformer", None), ("resnet", 0.25), ("deep_narrow", 0.5), ("mlp_large", 8.0),
         ("tied", 0.001), ("cnn", None), ("vgg", None)]


def plans_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    out = {}
    for name, cap in CASES:
        spec = models.spec(name)
        torch.manual_seed(0)
        base = spec.build()
        theirs = TorchDDP(copy.deepcopy(base), bucket_cap_mb=cap)
        ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):  # iteration 1 records the ready order, iteration 2 rebuilds
            batch = spec.batch(gen, 4)
            spec.loss(theirs, batch).backward()
            spec.loss(ours, batch).backward()
        logged = theirs._get_ddp_logging_data()
        names = [n for n, p in ours.module.named_parameters() if p.requires_grad]
        out[(name, cap)] = dict(
            torch=[[int(i) for i in bucket.split()] for bucket in
                   logged["rebuilt_per_bucket_param_indices"].split(", ")],
            torch_sizes=[int(s) for s in logged["rebuilt_bucket_sizes"].split(", ")],
            ours=[[names.index(n) for n in b["params"]] for b in ours.bucket_plan()],
            ours_sizes=[b["size_bytes"] for b in ours.bucket_plan()])
    return out


@pytest.fixture(scope="module")
def plans(ranks_once):
    return ranks_once(plans_worker, 2, ())


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_rebuilt_plan_is_torch_ddps(plans, case):
    for rank, result in enumerate(plans):
        got = result[case]
        assert got["ours"] == got["torch"], f"rank {rank}: {case}"
        assert got["ours_sizes"] == got["torch_sizes"], f"rank {rank}: {case}"
    assert len(plans[0][CASES[3]]["ours"]) == 3  # mlp_large at 8 MB: really several buckets
