"""Uneven inputs: parity with torch DDP's join() when ranks have different numbers of batches
(joined ranks shadow the others' collectives, communication hooks included; the last joiner's
model is broadcast at the end)."""
import copy

import pytest
import torch
import torch.distributed as dist

CASES = {
    "mlp": dict(model="mlp", ddp={}),
    "cnn_buffers": dict(model="cnn", ddp={}),
    "mlp_small_buckets": dict(model="mlp", ddp=dict(bucket_cap_mb=0.1)),
    "mlp_find_unused": dict(model="mlp", ddp=dict(find_unused_parameters=True)),
    "mlp_static_graph": dict(model="mlp", ddp=dict(static_graph=True, bucket_cap_mb=0.1)),
    # rank 0 has no batch at all: it shadows the static graph's first iteration, whose
    # used-parameter map the training ranks all-reduce. torch DDP itself mismatches collectives
    # there (Gloo: "Received data size doesn't match expected size"), so its side runs without
    # static_graph: the same sums.
    "mlp_static_graph_join_at_once": dict(model="mlp", ddp=dict(static_graph=True,
                                                                bucket_cap_mb=0.1),
                                          torch_ddp=dict(bucket_cap_mb=0.1),
                                          batches=lambda rank: 0 if rank == 0 else 3),
    # the buckets are param.grad: the joined rank's gradients must survive its shadowing
    "mlp_bucket_view": dict(model="mlp", ddp=dict(gradient_as_bucket_view=True,
                                                 bucket_cap_mb=0.1)),
    "mlp_bucket_view_fp16_hook": dict(model="mlp", hook="fp16",
                                      ddp=dict(gradient_as_bucket_view=True, bucket_cap_mb=0.1)),
    # Hooks: the joined rank must issue what the hook issues (a float16 all-reduce; PowerSGD's
    # several collectives per bucket), not one all-reduce in the bucket's dtype.
    "mlp_fp16_hook": dict(model="mlp", ddp=dict(bucket_cap_mb=0.1), hook="fp16"),
    "mlp_powersgd_hook": dict(model="mlp", ddp=dict(bucket_cap_mb=1000), hook="powerSGD"),
    # pyreducer's built-in C++ fp16 hook, against the same arithmetic as a torch Python hook.
    "mlp_builtin_fp16": dict(model="mlp", ddp=dict(bucket_cap_mb=0.1), hook="builtin_fp16"),
    # divided by the ranks still training, not the initial world size
    "mlp_divide_by_training_ranks": dict(model="mlp", ddp=dict(bucket_cap_mb=0.1),
                                         join=dict(divide_by_initial_world_size=False)),
    "cnn_divide_by_training_ranks_views": dict(
        model="cnn", ddp=dict(gradient_as_bucket_view=True, bucket_cap_mb=0.01),
        join=dict(divide_by_initial_world_size=False)),
    # autotune (ours only; torch's side runs DDP's caps): rank 0 joins while the others probe,
    # measure and choose, so the joined rank must shadow the tuner's collectives too
    "mlp_autotune": dict(model="mlp", ddp={}, autotune=True, batches=lambda rank: 4 + 10 * rank),
    # an evaluation forward under no_grad after every step (ours only: torch DDP votes "backward
    # will sync" then too, and its joined ranks wait for a backward that never comes)
    "mlp_eval_forward": dict(model="mlp", ddp=dict(bucket_cap_mb=0.1), eval=True),
}


def _divide_then_fp16_hook(state, bucket):
    """The arithmetic of pyreducer's built-in fp16 hook as a torch DDP hook: divide by the world
    size in the bucket's precision, cast, all-reduce, cast back."""
    buffer = bucket.buffer()
    compressed = buffer.div(dist.get_world_size()).to(torch.float16)
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def _register_hook(model, name, ours):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "powerSGD":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, random_seed=0)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name == "builtin_fp16":
        if ours:
            model.register_builtin_hook("fp16")
        else:
            model.register_comm_hook(None, _divide_then_fp16_hook)


def _batches(rank):
    return 3 + 2 * rank  # rank 0 runs out first


def _train(cls, base, case, rank):
    from pyreducer.testing import models
    from pyreducer.tuning import AutotuneConfig

    spec = models.spec(case["model"])
    ours = cls.__module__.startswith("pyreducer")
    kwargs = dict(case["ddp"] if ours else case.get("torch_ddp", case["ddp"]))
    if case.get("autotune") and ours:
        kwargs["bucket_cap_mb"] = AutotuneConfig(warmup_iterations=1, measure_iterations=2, probe_every=1,
                                                 candidates=2)
    model = cls(copy.deepcopy(base), **kwargs)
    if "hook" in case:
        _register_hook(model, case["hook"], ours=ours)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(50 + rank)
    with model.join(**case.get("join", {})):
        for _ in range(case.get("batches", _batches)(rank)):
            opt.zero_grad()
            spec.loss(model, spec.batch(gen, 8)).backward()
            opt.step()
            if case.get("eval") and ours:
                with torch.no_grad():
                    spec.loss(model, spec.batch(torch.Generator().manual_seed(9), 8))
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    state.update({f"{n}.grad": None if p.grad is None else p.grad.detach().clone()
                  for n, p in model.module.named_parameters()})
    if ours:
        state["autotune_log"] = model.autotune_log
    return state


def join_worker(rank, world_size, names):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    out = {}
    for name in names:
        torch.manual_seed(5)
        base = models.spec(CASES[name]["model"]).build()
        out[name] = dict(torch=_train(TorchDDP, base, CASES[name], rank),
                         ours=_train(DistributedDataParallel, base, CASES[name], rank))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"{ws}ranks")
def joined(request, ranks_once):
    return request.param, ranks_once(join_worker, request.param, (tuple(CASES),))


@pytest.mark.parametrize("name", list(CASES))
def test_join_matches_torch_ddp(joined, name):
    world_size, results = joined
    for rank, r in enumerate(results):
        theirs, ours = r[name]["torch"], r[name]["ours"]
        for key in theirs:
            if key == "autotune_log":
                continue
            if theirs[key] is None or ours[key] is None:  # a rank that never had a batch
                assert theirs[key] is None and ours[key] is None, f"rank {rank}: {key}"
                continue
            if theirs[key].is_floating_point():
                diff = (ours[key] - theirs[key]).abs().max().item()
                assert diff <= 1e-6, f"rank {rank}: {key} differs by {diff:.3g}"
            else:
                assert torch.equal(ours[key], theirs[key]), f"rank {rank}: {key}"
    for rank in range(1, world_size):  # the final broadcast makes all ranks' parameters equal
        for key, value in results[rank][name]["ours"].items():
            if not key.endswith(".grad") and key != "autotune_log":
                assert torch.equal(value, results[0][name]["ours"][key]), f"rank {rank}: {key}"


def test_autotune_decides_while_a_rank_has_joined(joined):
    """Rank 0 joins after 4 batches; the tuner (warm-up 1, 2 steps per plan) decides later, with
    rank 0 shadowing its collectives; every rank logs the same decisions."""
    world_size, results = joined
    logs = [r["mlp_autotune"]["ours"]["autotune_log"] for r in results]
    events = [[e["event"] for e in log] for log in logs]
    assert events[0][-1] == "chosen" and all(e == events[0] for e in events), events
    assert [e.get("plan") for e in logs[0]] == [e.get("plan") for e in logs[-1]]
    chosen_at = logs[0][-1]["iteration"]
    assert chosen_at > 4, chosen_at  # decided after rank 0 had joined


def early_termination_worker(rank, world_size):
    """join(throw_on_early_termination=True), rank 0 with 2 batches, the others with 4: what each
    rank raises, with torch DDP and with pyreducer."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    out = {}
    for name, wrap in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
        torch.manual_seed(0)
        model = wrap(torch.nn.Linear(4, 2))
        try:
            with model.join(throw_on_early_termination=True):
                for _ in range(2 if rank == 0 else 4):
                    model(torch.randn(3, 4)).sum().backward()
            out[name] = None
        except RuntimeError as error:
            out[name] = str(error)
        dist.barrier()
    return out


def test_early_termination_raises_torchs_errors(ranks_once):
    """The early rank raises "Rank 0 exhausted all inputs.", the others "Detected at least one
    rank that exhausted inputs." (torch's Join and distributed_test.py's words), as with torch DDP."""
    results = ranks_once(early_termination_worker, 2, ())
    assert results[0]["ours"] is not None and "Rank 0 exhausted all inputs" in results[0]["ours"]
    assert results[1]["ours"] is not None \
        and "Detected at least one rank that exhausted inputs." in results[1]["ours"]
    for r in results:
        assert r["ours"] == r["torch"], r
