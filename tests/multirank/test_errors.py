"""Errors instead of hangs: each case must raise a clear error (type, key words naming the
parameter and rank) promptly, on 2 spawned Gloo ranks, every run bounded in wall-clock time."""
import os
import re
import time

import pytest
import torch
from torch import nn

from pyreducer.testing import run_ranks, wait_for_exit


def _capture(fn):
    start = time.monotonic()
    try:
        fn()
        return dict(error=None, seconds=time.monotonic() - start)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return dict(error=f"{type(error).__name__}: {error}", seconds=time.monotonic() - start)


def different_models_worker(rank, world_size):
    from pyreducer import DistributedDataParallel

    width = 8 if rank == 0 else 9
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    return _capture(lambda: DistributedDataParallel(model))


def channels_last_on_one_rank_worker(rank, world_size):
    from pyreducer import DistributedDataParallel

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    if rank == 1:
        model = model.to(memory_format=torch.channels_last)  # same shapes, other strides
    return _capture(lambda: DistributedDataParallel(model))


def unused_parameter_worker(rank, world_size):
    from pyreducer import DistributedDataParallel

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk, self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            return self.used(self.trunk(x))

    model = DistributedDataParallel(TwoHeads())
    result = _capture(lambda: model(torch.randn(2, 4)).sum().backward())

    class Switch(TwoHeads):
        """static_graph=True: the `unused` head joins in when `both` is set."""
        both = False

        def forward(self, x):
            h = self.trunk(x)
            return self.used(h) + (self.unused(h) if self.both else 0)

    for key, first, second in (("graph_grew", False, True), ("graph_shrank", True, False)):
        model = DistributedDataParallel(Switch(), static_graph=True)
        model.module.both = first
        model(torch.randn(2, 4)).sum().backward()
        model.module.both = second
        result[key] = _capture(lambda: model(torch.randn(2, 4)).sum().backward())
    return result


class _TwoEmbeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Embedding(10, 3, sparse=True)
        self.skipped = nn.Embedding(10, 3, sparse=True)

    def forward(self, ids):
        return self.used(ids)


def sparse_gradient_missing_worker(rank, world_size):
    from pyreducer import DistributedDataParallel

    model = DistributedDataParallel(_TwoEmbeddings(), find_unused_parameters=True)
    return _capture(lambda: model(torch.tensor([1, 2])).sum().backward())


def peer_dies_worker(rank, world_size):
    import torch.distributed as dist

    from pyreducer import DistributedDataParallel

    model = DistributedDataParallel(nn.Linear(64, 64))
    for _ in range(2):  # healthy steps on both ranks (the second rebuilds the buckets)
        model(torch.randn(2, 64)).sum().backward()
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        os._exit(3)  # dies before the second backward
    wait_for_exit(pids[1], timeout_s=30)  # the backward below starts after the peer is gone
    return _capture(lambda: model(torch.randn(2, 64)).sum().backward())


def test_a_model_mismatch_is_a_runtime_error_and_a_value_error():
    from pyreducer.wrapper.sync import ModelMismatchError

    assert issubclass(ModelMismatchError, RuntimeError)  # torch DDP's type
    assert issubclass(ModelMismatchError, ValueError)  # pyreducer's until now


def test_different_models_named_at_construction():
    results = run_ranks(different_models_worker, 2, timeout_s=60)
    for r in results:
        assert r["error"] is not None
        assert "ModelMismatchError" in r["error"] and "same model" in r["error"]
        # torch's words (test_c10d_nccl's layout test matches on them)
        assert "[1]: params[0] in this process with sizes [9, 4] appears not to match sizes of " \
            "the same param in process 0." in r["error"], r["error"]
        assert "0.weight (8, 4)" in r["error"] and "0.weight (9, 4)" in r["error"]
        assert "rank 1" in r["error"]
        assert r["seconds"] < 30


def test_different_strides_named_at_construction():
    """Bucket views follow each parameter's strides: one rank in channels_last would sum
    different elements together, silently. torch DDP checks strides too."""
    results = run_ranks(channels_last_on_one_rank_worker, 2, timeout_s=60)
    for r in results:
        assert r["error"] is not None and "ModelMismatchError" in r["error"]
        assert re.search(r".* appears not to match strides of the same param in process 0",
                         r["error"]), r["error"]
        assert "parameter #0 is 0.weight (8, 3, 3, 3) torch.float32 strides (27, 9, 3, 1) on " \
               "rank 0" in r["error"]
        assert "strides (27, 1, 9, 3) on rank 1" in r["error"] and "channels_last" in r["error"]
        assert r["seconds"] < 30


def ready_twice_worker(rank, world_size):
    """A layer run twice under reentrant checkpointing, without static_graph: its gradient hook
    fires twice in one backward."""
    from torch.utils.checkpoint import checkpoint

    from pyreducer import DistributedDataParallel

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.layer = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = checkpoint(self.layer, self.first(x), use_reentrant=True)
            return checkpoint(self.layer, x, use_reentrant=True)

    model = DistributedDataParallel(Twice())
    return _capture(lambda: model(torch.randn(2, 4)).sum().backward())


def test_a_parameter_ready_twice_is_torchs_error():
    """torch's words first (test_c10d_common's checkpointing tests and test_c10d_nccl's
    find_unused_parameters tests match on the start), then pyreducer's hint."""
    for rank, r in enumerate(run_ranks(ready_twice_worker, 2, timeout_s=60)):
        assert r["error"] is not None, "no error"
        message = r["error"].split(": ", 1)[1]  # after the exception's type
        assert re.match(r"Expected to mark a variable ready only once\. Parameter at index "
                        r"(2 with name layer\.weight|3 with name layer\.bias) has been marked "
                        r"as ready twice\.", message), message
        assert f"rank {rank}" in message and "static_graph=True" in message, message


def test_unused_parameter_named_at_end_of_backward():
    results = run_ranks(unused_parameter_worker, 2, timeout_s=60)
    for rank, r in enumerate(results):
        assert r["error"] is not None
        assert f"rank {rank}" in r["error"]
        assert "unused.weight" in r["error"] and "unused.bias" in r["error"]
        assert "trunk.weight" not in r["error"]
        assert "_set_params_and_buffers_to_ignore_for_model" in r["error"]
        # torch DDP's words, which its own tests (distributed_test.py, the unused-parameter
        # tests) and users match on, with both of its ways of naming the parameters
        for words in ["Expected to have finished reduction in the prior iteration",
                      "passing the keyword argument `find_unused_parameters=True`",
                      "`forward` function outputs participate in calculating loss",
                      "set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or "
                      "DETAIL",
                      f"Parameter indices which did not receive grad for rank {rank}: 4 5",
                      f"Parameters which did not receive grad for rank {rank}: unused.weight, "
                      "unused.bias"]:
            assert words in r["error"], (words, r["error"])
        assert "Since `find_unused_parameters=True` is enabled" not in r["error"]
        # torch's static-graph wording (distributed_test.py's test_ddp_static_graph_... match
        # on the first, and on the second up to the parameter indices)
        grew, shrank = r["graph_grew"]["error"], r["graph_shrank"]["error"]
        assert grew is not None and "Your training graph has changed in this iteration, e.g., " \
            "one parameter is unused in first iteration, but then got used in the second " \
            "iteration. this is not compatible with static_graph set to True." in grew, grew
        assert "unused.weight" in grew or "unused.bias" in grew, grew
        assert shrank is not None and "Expected to have finished reduction in the prior " \
            "iteration before starting a new one. This error indicates that your training " \
            "graph has changed in this iteration, e.g., one parameter is used in first " \
            "iteration, but then got unused in the second iteration. this is not compatible " \
            "with static_graph set to True.\nParameter indices which did not receive grad for " \
            f"rank {rank}: 4 5" in shrank, shrank
        assert r["seconds"] < 30


def test_missing_sparse_gradient_named():
    """torch DDP cannot reduce a sparse gradient that is not there (it raises "Expected sparse
    gradient to be defined."); pyreducer says so with torch's words, naming the parameter."""
    results = run_ranks(sparse_gradient_missing_worker, 2, timeout_s=60)
    for rank, r in enumerate(results):
        assert r["error"] is not None
        assert "Expected sparse gradient to be defined." in r["error"]
        assert f"parameter skipped.weight on rank {rank}" in r["error"]


def test_dead_peer_raises_instead_of_hanging():
    start = time.monotonic()
    results = run_ranks(peer_dies_worker, 2, timeout_s=90, pg_timeout_s=20, may_die=(1,))
    assert results[1] is None
    assert results[0]["error"] is not None
    assert "all-reduce of bucket 0 failed on rank 0" in results[0]["error"]
    assert results[0]["seconds"] < 25  # bounded by the process group's timeout
    assert time.monotonic() - start < 90


def combinations_worker(rank, world_size):
    """Combinations that cannot work: each must raise at once, naming the problem (torch DDP
    hangs or fails mid-backward on several of them)."""
    from pyreducer import DistributedDataParallel
    from pyreducer.testing.parity import SkipsEverywhere, SparseEmbeddings

    out = {}
    sparse = DistributedDataParallel(SparseEmbeddings())
    out["builtin_hook_sparse"] = _capture(lambda: sparse.register_builtin_hook("fp16"))
    skip = DistributedDataParallel(SkipsEverywhere(), find_unused_parameters=True,
                                   skip_all_reduce_unused_params=True)
    out["join_skip"] = _capture(lambda: skip.join().__enter__())
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    delayed = DistributedDataParallel(mlp, delay_all_reduce_named_params=list(
        mlp[1].named_parameters(prefix="1")), param_to_hook_all_reduce=mlp[0].weight)
    out["join_delayed"] = _capture(lambda: delayed.join().__enter__())
    overlapped = DistributedDataParallel(nn.Linear(4, 2))
    overlapped.overlap_optimizer(torch.optim.SGD(overlapped.parameters(), lr=0.1))
    out["join_overlap"] = _capture(lambda: overlapped.join().__enter__())
    joined = DistributedDataParallel(nn.Linear(4, 2))

    def overlap_inside_join():
        with joined.join():
            joined.overlap_optimizer(torch.optim.SGD(joined.parameters(), lr=0.1))

    out["overlap_in_join"] = _capture(overlap_inside_join)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    plain = DistributedDataParallel(nn.Linear(4, 2))
    for key, make in [
            ("overlap_lbfgs", lambda: torch.optim.LBFGS(plain.parameters())),
            ("overlap_zero", lambda: ZeroRedundancyOptimizer(
                list(plain.parameters()), optimizer_class=torch.optim.SGD, lr=0.1)),
            ("overlap_not_optimizer", lambda: [p for p in plain.parameters()])]:
        out[key] = _capture(lambda: plain.overlap_optimizer(make()))
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    out["overlap_schedule"] = _capture(lambda: plain.overlap_optimizer(sgd, schedule="lifo"))
    out["overlap_hold_back"] = _capture(lambda: plain.overlap_optimizer(sgd, hold_back=2))
    from torch.nn.parallel.distributed import _MixedPrecision

    out["mixed_rnn"] = _capture(lambda: DistributedDataParallel(
        nn.LSTM(4, 4), mixed_precision=_MixedPrecision(torch.bfloat16)))
    return out


def second_backward_worker(rank, world_size):
    """Backwards that would leave a gradient un-averaged, refused in the backward: a second
    backward through one forward (torch DDP keeps its gradient local, silently), plain and with
    an overlapped optimizer (its reductions still in flight: that message named them once, and
    its advice did not fit); and, overlapped, a backward through a submodule's own forward."""
    from pyreducer import DistributedDataParallel

    out = {}
    for name in ("plain", "overlapped"):
        model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
                                        bucket_cap_mb=1e-6)
        if name == "overlapped":
            model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        loss = model(torch.randn(3, 4)).sum()
        loss.backward(retain_graph=True)
        out[f"twice_{name}"] = _capture(lambda: loss.backward())
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
                                    bucket_cap_mb=1e-6)
    opt = model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    out["submodule_backward"] = _capture(
        lambda: model.module[1](torch.randn(3, 4)).sum().backward())
    return out


@pytest.mark.parametrize("key,words", [
    ("twice_plain", ["parameter 1.", "second backward through one forward", "un-averaged"]),
    ("twice_overlapped", ["parameter 1.", "second backward through one forward",
                          "un-averaged"]),
    ("submodule_backward", ["parameter 1.", "a submodule called directly", "un-averaged",
                            "Run each forward through the wrapper"]),
])
def test_a_gradient_that_would_stay_local_is_refused_by_name(ranks_once, key, words):
    for rank, r in enumerate(ranks_once(second_backward_worker, 2, ())):
        error = r[key]["error"]
        assert error is not None, f"{key}: nothing raised"
        assert f"on rank {rank}" in error, error
        for word in words:
            assert word in error, error


@pytest.mark.parametrize("key,words", [
    ("builtin_hook_sparse", ["ValueError", "embed.weight", "sparse gradients"]),
    ("join_skip", ["ValueError", "join() cannot be combined with skip_all_reduce_unused_params"]),
    ("join_delayed", ["ValueError", "join() cannot be combined with delay_all_reduce_named_params"]),
    ("mixed_rnn", ["NotImplementedError", "mixed_precision with recurrent modules"]),
    ("join_overlap", ["ValueError", "join() cannot be combined with an overlapped optimizer"]),
    ("overlap_in_join", ["ValueError", "overlap_optimizer cannot be created inside join()"]),
    ("overlap_lbfgs", ["ValueError", "LBFGS needs a closure"]),
    ("overlap_zero", ["ValueError", "ZeroRedundancyOptimizer steps this rank's whole shard"]),
    ("overlap_not_optimizer", ["TypeError", "expects a torch.optim.Optimizer, got list"]),
    ("overlap_schedule", ["ValueError", "schedule must be 'auto', 'fifo' or a chunk size in MB",
                          "'lifo'"]),
    ("overlap_hold_back", ["ValueError", "hold_back applies to schedule='fifo'"]),
])
def test_combinations_that_cannot_work_raise_naming_them(ranks_once, key, words):
    for r in ranks_once(combinations_worker, 2, ()):
        error = r[key]["error"]
        assert error is not None, f"{key}: nothing raised"
        for word in words:
            assert word in error, error
