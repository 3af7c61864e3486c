"""torch's Gloo race (pyreducer/wrapper/gloo_race.py): sparse buckets run on a one-thread Gloo
backend of the same ranks, and give torch DDP's results; the CI's short version of
benchmarks/sparse_race_soak.py (whose 300-run record is in benchmarks/results/)."""
import sys

from pyreducer.wrapper import torch_versions

sys.path.insert(0, "benchmarks")
import sparse_race_soak as soak  # noqa: E402

RUNS = 5


def guard_worker(rank, world_size):
    from torch import nn

    from pyreducer import DistributedDataParallel
    from pyreducer.testing.parity import SparseEmbeddings
    from pyreducer.wrapper import gloo_race

    def gloo_threads():  # Gloo's threads are not Python threads: the OS's, by name
        import os
        names = [open(f"/proc/self/task/{t}/comm").read().strip()
                 for t in os.listdir("/proc/self/task")]
        return sorted(n for n in names if "gloo" in n)

    DistributedDataParallel(nn.Linear(4, 4))
    made_for_dense = sum(gloo_race._made.values())
    before = gloo_threads()
    model = DistributedDataParallel(SparseEmbeddings())
    import time
    time.sleep(0.5)  # (threads name themselves once running)
    with_one = gloo_threads()
    backend = gloo_race.sparse_backend(None)  # another, to read its options
    out = dict(made_for_dense=made_for_dense, threads=backend.options._threads,
               size=backend.size(), rank=backend.rank(),
               added_threads={n: with_one.count(n) - before.count(n) for n in set(with_one)})
    del model, backend
    import gc
    gc.collect()
    out["threads_left"] = len(gloo_threads()) - len(before)
    return out


def test_sparse_buckets_get_a_one_thread_backend_dense_ones_none():
    from pyreducer.testing import run_ranks

    assert torch_versions.GLOO_STATUS_RACE  # every supported torch (2.11-2.15) has the race
    for rank, r in enumerate(run_ranks(guard_worker, 3, timeout_s=120)):
        assert r["made_for_dense"] == 0
        assert (r["threads"], r["size"], r["rank"]) == (1, 3, rank)
        # the sparse wrapper's one worker thread (and its TCP device's event loop, a named
        # thread from torch 2.13; torch 2.11 names it otherwise)
        added = {name: n for name, n in r["added_threads"].items() if n}
        assert added.pop("pt_gloo_runloop") == 1 and set(added.values()) <= {1}, r
        assert r["threads_left"] == 0  # joined with the wrapper


def test_sparse_scenarios_repeated_match_torch_ddp_without_crashing():
    reference, error = soak.run(soak.NAMES, "torch", 3)
    if error is not None:  # torch DDP is exposed to the race itself: once more
        reference, error = soak.run(soak.NAMES, "torch", 3)
    assert error is None, error
    results, error = soak.run(soak.NAMES, "ours", 3, RUNS)  # RUNS runs in one spawn
    assert error is None, error
    for rank, (mine, theirs) in enumerate(zip(results, reference)):
        assert mine["one_thread_backends"] == RUNS * len(soak.NAMES)  # one per wrapper
        assert mine["runs_equal_to_the_first"]
        for name in soak.NAMES:
            assert soak.same(mine[name], theirs[name]), (rank, name)


def slow_build_worker(rank, world_size):
    """Rank 1's backend constructor takes a second longer (a listening side slow to take its
    connection, as under load); each rank says when its own construction ended and when
    one_thread_backend returned."""
    import time

    import torch.distributed as dist

    from pyreducer.wrapper import gloo_race

    built = {}

    class SlowOnRank1(dist.ProcessGroupGloo):
        def __init__(self, *args):
            super().__init__(*args)
            if rank == 1:
                time.sleep(1.0)
            built["at"] = time.time()

    real, dist.ProcessGroupGloo = dist.ProcessGroupGloo, SlowOnRank1
    try:
        gloo_race.one_thread_backend(None, "test")
    finally:
        dist.ProcessGroupGloo = real
    return dict(built=built["at"], returned=time.time())


def test_one_thread_backend_returns_once_every_rank_built_it():
    """No rank leaves one_thread_backend while another is still building its backend: a rank
    that went on, failed and exited would close the connection the other is still taking
    (Gloo's "Connection closed by peer" in its construction; gloo_race.py)."""
    from pyreducer.testing import run_ranks

    results = run_ranks(slow_build_worker, 2, timeout_s=60)
    last_built = max(r["built"] for r in results)
    for rank, r in enumerate(results):
        assert r["returned"] >= last_built, \
            f"rank {rank} returned {last_built - r['returned']:.2f} s before rank " \
            f"{max(range(2), key=lambda k: results[k]['built'])} had built its backend"
