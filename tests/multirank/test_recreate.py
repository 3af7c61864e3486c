"""Re-creating the wrapper in the same process after destroy_process_group() and a new
init_process_group() (issue 15): each generation trains as torch DDP does, bit for bit, and
nothing piles up between reducers (threads)."""
import copy
import gc
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from pyreducer.testing import RankError, run_ranks

GENERATIONS = 6  # the three option sets twice


def _train(model, opt, gen, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    return [p.detach().clone() for p in model.parameters()]


def recreate_worker(rank, world_size, store_dir):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    options = [dict(bucket_cap_mb=0.001), dict(static_graph=True), dict(bucket_cap_mb=0.002)]
    options = (options * GENERATIONS)[:GENERATIONS]
    out = dict(equal=[], threads=[])
    for g in range(GENERATIONS):
        torch.manual_seed(g + 10 * rank)
        base = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
        finals = {}
        for name, cls in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
            model = cls(copy.deepcopy(base), **options[g])
            if g % 3 == 1:
                model.register_comm_hook(None, default_hooks.allreduce_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
            if name == "ours" and g % 3 == 2:
                opt = model.overlap_optimizer(opt, schedule="fifo", hold_back=1)
            finals[name] = _train(model, opt, torch.Generator().manual_seed(rank))
            del model, opt
        out["equal"].append(all(torch.equal(a, b)
                                for a, b in zip(finals["torch"], finals["ours"])))
        # every rank done with this group before any tears it down: a rank that closes its
        # connections while a peer still reads from them makes the peer's next rendezvous fail
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()
        out["threads"].append(len(os.listdir("/proc/self/task")))  # between process groups
        dist.init_process_group("gloo", init_method=f"file://{store_dir}/store{g}", rank=rank,
                                world_size=world_size)
    return out


def _run(tmp_path):
    """recreate_worker on 2 ranks. Gloo's own rendezvous (connectFullMesh) in a re-created group
    failed in about 1 of 100 runs under torch 2.14.1 ("Connection closed by peer"), before any
    pyreducer code of that generation ran; such a run is repeated once, with a warning. Any
    other failure, or a second one, fails the test. torch alone fails the same way: the same
    pattern without pyreducer (tests/upstream/gloo_rerendezvous.py, torch DDP only) failed in 3
    of 161 runs here (torch 2.13), with the same message, so the retry stays (issue 31)."""
    for attempt in range(2):
        store_dir = tmp_path / f"attempt{attempt}"
        store_dir.mkdir()
        try:
            return run_ranks(recreate_worker, 2, (str(store_dir),), timeout_s=180)
        except RankError as error:
            if attempt == 1 or "connectFullMesh" not in str(error):
                raise
            warnings.warn(f"Gloo's rendezvous failed, running again: {str(error)[-300:]}")


def test_wrapper_recreated_after_a_new_process_group(tmp_path):
    for r in _run(tmp_path):
        assert r["equal"] == [True] * GENERATIONS, r
        # earlier reducers and process groups leave no threads behind: counted between process
        # groups, the count varies by a few (torch's threads start lazily, pools), but a leak of
        # one thread per generation would add 4 from the second generation to the last
        assert r["threads"][-1] <= r["threads"][1] + 2, r["threads"]
