"""A rank for tests/netem/test_netem.py: rendezvous over the emulated network, time all-reduces of
SIZE_MB (the fastest of TIMED), train two pyreducer steps, then two with a sharded optimizer (its
one-thread Gloo backend across the hosts), and (rank 0) write the results as JSON to argv[1]."""
import json
import os
import sys
import time
from datetime import timedelta

# Fallback only: a pyreducer on PYTHONPATH (e.g. make cuda-check's build) comes first.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pyreducer import DistributedDataParallel  # noqa: E402

from pyreducer.testing import models  # noqa: E402

SIZE_MB = 4
TIMED = 3  # all-reduces timed; the fastest is reported

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    data = torch.ones(SIZE_MB * 2**20 // 4)
    dist.all_reduce(data)  # warm-up (connections)
    samples = []
    for _ in range(TIMED):
        data.fill_(1.0)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(data)
        samples.append(time.perf_counter() - start)
    seconds = min(samples)  # the link's time: a busy machine only adds the scheduler's
    spec = models.spec("mlp")
    model = DistributedDataParallel(spec.build())
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        spec.loss(model, spec.batch(gen, 4)).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, grads)
    # the sharded optimizer: its one-thread Gloo backend connects across the hosts
    model = DistributedDataParallel(spec.build(), bucket_cap_mb=0.1)
    opt = model.overlap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), shard=True)
    for _ in range(2):
        spec.loss(model, spec.batch(gen, 4)).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    sharded = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(sharded, params)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(dict(allreduce_s=seconds, sum_ok=bool(data[0].item() == dist.get_world_size()),
                           grads_equal=all(torch.equal(g, gathered[0]) for g in gathered),
                           sharded_equal=all(torch.equal(p, sharded[0]) for p in sharded),
                           interface=os.environ["GLOO_SOCKET_IFNAME"]), f)
    dist.destroy_process_group()
    # Skip interpreter teardown: torch 2.13 + Gloo was seen to abort there ("terminate called
    # without an active exception") after all work was done (see shared NETWORK notes).
    sys.stdout.flush()
    os._exit(0)
