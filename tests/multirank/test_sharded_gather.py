"""The sharded step's all-gathers in read order (Note [Gathers in read order] in
pyreducer/sharded/gather_plan.py), against Gloo's all-gather and torch DDP + the same unsharded
optimizer: the planned ring all-gather (csrc/ring_gather.cpp) delivers every rank's elements
exactly, range by range as they arrive, and holds back what is not marked ready; a cancelled one
fails on every rank instead of hanging; in a training loop at torch's default caps, a rank steps
its segments in its plan's order and a parameter read early is torch DDP's value while the rest
of its bucket is still held back."""
import copy

import pytest
import torch

MIB = 2**20 // 4
# (params in slot order, numels by parameter index): buckets as the backward fills them
BUCKETS = [  # with the order each is gathered in at 2, 3 and 4 ranks
    (([2, 1, 0], [3, 1_000_001, 7]), ["read", "ring", "ring"]),  # odd sizes, padding
    (([7, 6, 5, 4, 3, 2, 0, 1], [MIB // 16, 8 * MIB, 64, MIB, 2 * MIB, 64, 2 * MIB, MIB // 2]),
     ["read"] * 3),  # transformer-like: the first reads are a part of it
    (([1, 0], [4 * MIB, 8]), ["read", "ring", "ring"]),  # one parameter fills it
]


def planned_ring_worker(rank, world_size):
    """Each bucket: this rank's shard filled with its own values, the planned gather started,
    its segments marked ready in this rank's step order, every parameter's range waited for in
    read order and checked at once, then the whole against Gloo's all-gather. With 2 ranks also:
    the first-read parameter arrives while the segments stepped after the first are held back
    (each rank's link sends its own pieces in read order: that parameter's first)."""
    import torch.distributed as dist

    from pyreducer._ext import _C
    from pyreducer.sharded import gather_plan
    from pyreducer.wrapper import gloo_race

    ring = _C.RingCollectives(gloo_race.one_thread_backend(None, "ring-test"), 30000)
    out = []
    for (params, numels), _ in BUCKETS:
        offsets, used = [], 0
        for i in params:
            offsets.append(used)
            used += numels[i]
        shard = _C.shard_numel(used, world_size, 4)
        plan = gather_plan.plan_bucket(params, numels, offsets, shard, world_size, 4,
                                       min_bytes=0)
        mine = torch.arange(shard, dtype=torch.float32) + 1e6 * (rank + 1)
        mine[max(0, used - rank * shard):] = 0  # the padding
        whole = torch.empty(shard * world_size)
        dist.all_gather_into_tensor(whole, mine)
        flat = torch.zeros(shard * world_size)
        flat.narrow(0, rank * shard, shard).copy_(mine)
        job = ring.all_gather_planned(flat, list(plan.begins), list(plan.ends),
                                      list(plan.sends[rank]), list(plan.receives(rank)), "test")
        order = plan.step_order(rank)
        early = None
        if world_size == 2 and len(order) > 1:  # only the first segment stepped may go
            job.mark_ready(order[0].begin, order[0].end)
            offset = offsets[params.index(0)]  # the first-read parameter (its pieces go first)
            first = slice(offset, offset + numels[0])
            job.wait_range(first.start, first.stop)
            early = dict(exact=torch.equal(flat[first], whole[first]),
                         in_flight=not job.is_completed())
            dist.barrier()  # (neither rank lets the rest go before both have looked)
        for segment in order:
            job.mark_ready(segment.begin, segment.end)
        exact = []
        for i, offset in sorted(zip(params, offsets)):
            job.wait_range(offset, offset + numels[i])
            exact.append(torch.equal(flat[offset:offset + numels[i]],
                                     whole[offset:offset + numels[i]]))
        job.wait()
        out.append(dict(order=plan.order, early=early, exact=exact,
                        whole=torch.equal(flat[:used], whole[:used])))
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_planned_ring_all_gather_matches_gloo(ranks_once, world_size):
    for rank, results in enumerate(ranks_once(planned_ring_worker, world_size, ())):
        for case in results:
            assert all(case["exact"]), (rank, case)
            assert case["whole"], (rank, case)
            if world_size == 2 and case["early"] is not None:
                assert case["early"] == dict(exact=True, in_flight=True), (rank, case)
        assert [case["order"] for case in results] == [orders[world_size - 2]
                                                       for _, orders in BUCKETS]


def cancel_worker(rank, world_size):
    """Rank 0 cancels its planned gather before marking anything ready (its step raised): its
    job fails at once, naming why; rank 1's fails by the ring's timeout (3 s), not hangs."""
    import time

    from pyreducer._ext import _C
    from pyreducer.sharded import gather_plan
    from pyreducer.wrapper import gloo_race

    ring = _C.RingCollectives(gloo_race.one_thread_backend(None, "ring-cancel"), 3000)
    params, numels = [1, 0], [MIB, MIB]
    shard = _C.shard_numel(2 * MIB, world_size, 4)
    plan = gather_plan.plan_bucket(params, numels, [0, MIB], shard, world_size, 4, min_bytes=0)
    flat = torch.zeros(shard * world_size)
    job = ring.all_gather_planned(flat, list(plan.begins), list(plan.ends),
                                  list(plan.sends[rank]), list(plan.receives(rank)), "test")
    start = time.monotonic()
    if rank == 0:
        job.cancel("the step raised ValueError")
    else:
        for segment in plan.segments:
            job.mark_ready(segment.begin, segment.end)
    try:
        job.wait()
        error = None
    except Exception as caught:  # the messages are checked by the test
        error = str(caught)
    return dict(error=error, seconds=time.monotonic() - start)


def test_a_cancelled_gather_fails_on_every_rank(ranks_once):
    zero, one = ranks_once(cancel_worker, 2, ())
    assert "stopped before its elements were ready (the step raised ValueError)" in \
        zero["error"], zero
    assert "test on rank 0 of 2 failed" in zero["error"]
    assert one["error"] is not None and "test on rank 1 of 2 failed" in one["error"], one
    assert one["seconds"] < 30, one


def early_read_worker(rank, world_size):
    """AdamW on the benchmarks' transformer at torch's default caps: torch DDP, and the sharded
    optimizer for 3 steps. After the third step(), the big bucket's segments are marked ready as
    the plan orders them, but the gather's later segments are held back: the first-read
    parameter (positions, in the first segment) is read and must be torch DDP's value, bit for
    bit, with the bucket's gather still in flight. Then the rest goes and the forward runs."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    spec = models.spec("transformer")
    torch.manual_seed(0)
    base = spec.build()
    runs = {}
    for which in ("torch", "ours"):
        cls = TorchDDP if which == "torch" else DistributedDataParallel
        model = cls(copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        if which == "ours":
            opt = model.overlap_optimizer(opt, shard=True)
        gen = torch.Generator().manual_seed(1000 + rank)
        for _ in range(3):
            spec.loss(model, spec.batch(gen, 2)).backward()
            opt.step()
            opt.zero_grad()
            if which == "torch" or _ < 2:
                continue
            runs["early"] = _read_early(model, opt, rank)
        spec.loss(model, spec.batch(gen, 2))  # the forward reads the rest
        if which == "ours":
            model.synchronize()
        runs[which] = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    early = runs["early"]
    early["exact"] = torch.equal(early.pop("value"), runs["torch"]["positions"])
    early["all_exact"] = all(torch.equal(runs["ours"][n], p) for n, p in runs["torch"].items())
    return early


class _Held:
    """A bucket's gather whose segments after the first are held back until let go."""

    def __init__(self, gather):
        self.gather, self.marked, self.held = gather, [], []

    def ready(self, begin, end):
        self.marked.append((begin, end))
        if len(self.marked) == 1:
            self.gather.ready(begin, end)
        else:
            self.held.append((begin, end))

    def let_go(self):
        for begin, end in self.held:
            self.gather.ready(begin, end)

    def __getattr__(self, name):
        return getattr(self.gather, name)


def _read_early(model, opt, rank):
    held = {}
    start = opt.comm.gather_bucket

    def holding(flat, own, plan, *rest):
        gather = start(flat, own, plan, *rest)
        if len(plan.segments) > 1 and not held:  # the first-read bucket: the big one
            held.update(gather=_Held(gather), plan=plan)
            return held["gather"]
        return gather

    opt.comm.gather_bucket = holding
    try:
        value = model.module.positions.detach().clone()  # a read: the update runs first
    finally:
        del opt.comm.gather_bucket
    gather, plan = held["gather"], held["plan"]
    in_flight = not gather.job.is_completed()
    gather.let_go()
    first = plan.step_order(rank)[0]
    return dict(value=value, in_flight=in_flight, steps_in_plan_order=gather.marked == [
        (s.begin, s.end) for s in plan.step_order(rank)],
        read_order=[min(s.params) for s in plan.segments],
        first_holds_positions=0 in plan.segments[0].params, first_stepped=first.params)


def test_a_parameter_read_early_is_exact_while_its_bucket_is_in_flight(ranks_once):
    for rank, r in enumerate(ranks_once(early_read_worker, 2, ())):
        assert r["first_holds_positions"] and r["read_order"] == sorted(r["read_order"]), r
        assert r["steps_in_plan_order"], r
        assert r["in_flight"], r  # the later segments were held back ...
        assert r["exact"], r      # ... and the first read was torch DDP's value
        assert r["all_exact"], r  # then everything, after the forward
