"""Compiled-model scenarios: the parity models trained under torch.compile with torch DDP and with
pyreducer, both ways in (tests/multirank/test_compiled.py).

A scenario is a parity scenario (pyreducer/testing/parity.py SCENARIOS, its DDP options updated by
`ddp`) plus how it is compiled:
`order` "inner" is `DDP(torch.compile(model))` (nanoGPT's order), "outer" `torch.compile(DDP(model))`;
`backend` is torch.compile's. torch DDP splits its graphs with dynamo's DDPOptimizer at its own
estimate of its buckets, pyreducer at the buckets of its plan in force: where they cut alike and
the backend's kernels do not depend on the cut (aot_eager runs the same aten ops either way), the
parameters agree bit for bit; inductor fuses across whatever a piece holds, so different cuts round
differently (the test's tolerance says how much).
"""
from __future__ import annotations

import statistics

import torch

from pyreducer.testing import parity

COMPILED = {
    "mlp_aot_eager_inner": dict(base="mlp_adam", order="inner", backend="aot_eager"),
    "mlp_aot_eager_outer": dict(base="mlp_sgd", order="outer", backend="aot_eager"),
    "cnn_batchnorm_aot_eager_inner": dict(base="cnn_batchnorm_sgd", order="inner",
                                          backend="aot_eager"),
    "tied_aot_eager_inner": dict(base="tied_weights_adam", order="inner", backend="aot_eager"),
    "find_unused_aot_eager_inner": dict(base="find_unused_sgd", order="inner",
                                        backend="aot_eager"),
    "no_sync_aot_eager_outer": dict(base="no_sync_4_micro_batches", order="outer",
                                    backend="aot_eager"),
    # caps under 1 MB: dynamo's DDPOptimizer refuses them (its first bucket is 1 MB and must not
    # exceed the cap), so torch DDP runs its compiled graphs unsplit (optimize_ddp=False)
    "bucket_per_param_aot_eager_inner": dict(base="bucket_per_param", order="inner",
                                             backend="aot_eager", torch_unsplit=True),
    "bucket_cap_list_aot_eager_outer": dict(base="bucket_cap_list", order="outer",
                                            backend="aot_eager", torch_unsplit=True),
    "cnn_small_caps_inductor_inner": dict(base="bucket_view_zero_fill", order="inner",
                                          backend="inductor", torch_unsplit=True),
    # fullgraph=True for pyreducer only: torch DDP's forward cannot be traced whole (its
    # oracle compiles without fullgraph, the same graph with aot_eager)
    "cnn_fullgraph_aot_eager_outer": dict(base="bucket_view_zero_fill", order="outer",
                                          backend="aot_eager", torch_unsplit=True,
                                          fullgraph=True),
    "static_graph_aot_eager_inner": dict(base="cnn_batchnorm_adam", order="inner",
                                         backend="aot_eager", ddp=dict(static_graph=True)),
    # a bucket per parameter of a transformer: cuts beside MultiheadAttention's (output, None)
    "transformer_per_param_aot_eager_inner": dict(base="bucket_per_param", model="transformer",
                                                  order="inner", backend="aot_eager",
                                                  torch_unsplit=True),
    "mlp_inductor_inner": dict(base="mlp_adam", order="inner", backend="inductor"),
    "cnn_batchnorm_inductor_outer": dict(base="cnn_batchnorm_sgd", order="outer",
                                         backend="inductor"),
    "tied_inductor_outer": dict(base="tied_weights_adam", order="outer", backend="inductor"),
    "find_unused_inductor_outer": dict(base="find_unused_sgd", order="outer",
                                       backend="inductor"),
}


def compiled_wrapper(order: str, backend: str, fullgraph: bool = False):
    """A wrapper class (callable(module, **kwargs)) that compiles `order`-wise around `cls`."""
    def wrap(cls):
        def make(module, **kwargs):
            if order == "inner":
                return cls(torch.compile(module, backend=backend, fullgraph=fullgraph), **kwargs)
            return torch.compile(cls(module, **kwargs), backend=backend, fullgraph=fullgraph)
        return make
    return wrap


def compiled_worker(rank, world_size, names):
    """Per scenario name: {"torch": state, "ours": state, "graphs": graphs dynamo captured for
    pyreducer, "summary": pyreducer's split summary}."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    out = {}
    for name in names:
        spec = COMPILED[name]
        scenario = dict(parity.SCENARIOS[spec["base"]])
        scenario["ddp"] = {**scenario.get("ddp", {}), **spec.get("ddp", {})}
        scenario["model"] = spec.get("model", scenario["model"])
        torch.manual_seed(17 + rank)
        base = parity._model_fns(scenario["model"])[0]()
        torch._dynamo.reset()
        with torch._dynamo.config.patch(optimize_ddp=not spec.get("torch_unsplit", False)):
            wrap = compiled_wrapper(spec["order"], spec["backend"])
            torch_state, theirs = parity.train(wrap(TorchDDP), base, scenario, rank)
        torch._dynamo.reset()
        counters.clear()
        wrap = compiled_wrapper(spec["order"], spec["backend"], spec.get("fullgraph", False))
        ours_state, ours = parity.train(wrap(DistributedDataParallel), base, scenario, rank)
        wrapper = ours if isinstance(ours, DistributedDataParallel) else ours._orig_mod
        theirs = theirs if isinstance(theirs, TorchDDP) else theirs._orig_mod
        out[name] = dict(torch=_plain_keys(torch_state), ours=_plain_keys(ours_state),
                         graphs=counters["stats"]["unique_graphs"],
                         summary=wrapper.compiled_summary(),
                         layouts=(_torch_layout(theirs),
                                  [b["param_indices"] for b in wrapper.reducer.bucket_layout()]))
    return out


def _torch_layout(ddp):
    """torch DDP's rebuilt buckets (parameter indices, launch order) from its logging data, or
    None where it did not rebuild."""
    indices = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if not indices:
        return None
    return [[int(i) for i in bucket.split()] for bucket in indices.split(",")]


def _plain_keys(state):
    """State keys without torch.compile's `_orig_mod.` prefix."""
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}


def spread_worker(rank, world_size):
    """How far apart the buckets became ready in the last 3 of 6 iterations (median), as a share
    of that backward (eager: ~0.9; one compiled function without a split: all at its end, ~0.05),
    and the pieces the graph was split into; per way in: "inner", "outer", "submodule" (the
    model's body compiled, its stem eager), and "inner, unsplit" (the check's control: every
    graph one piece, as without pyreducer's backend)."""
    import torch._dynamo

    from pyreducer.compiled import split as split_module

    out = {}
    for how in ("inner", "outer", "submodule", "inner, unsplit"):
        torch._dynamo.reset()
        if how.endswith("unsplit"):
            split_module.plan_cuts = lambda gm, param_of, bucket_of: [
                split_module.Cut(0, len(split_module.compute_nodes(gm)))]
        out[how] = _spread(how.split(",")[0])
    return out


def _spread(how):
    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    body = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(256, 256),
                                                                torch.nn.Tanh())])
    if how == "inner":
        model = DistributedDataParallel(torch.compile(body, backend="aot_eager"),
                                        bucket_cap_mb=0.3)
    elif how == "outer":
        model = torch.compile(DistributedDataParallel(body, bucket_cap_mb=0.3),
                              backend="aot_eager")
    else:
        net = torch.nn.Sequential(torch.nn.Linear(256, 256),
                                  torch.compile(body, backend="aot_eager"))
        model = DistributedDataParallel(net, bucket_cap_mb=0.3)
    for _ in range(6):
        out = model(torch.randn(128, 256))
        producers = _gradient_producers(out)
        out.sum().backward()
    wrapper = model if isinstance(model, DistributedDataParallel) else model._orig_mod
    spreads = []
    for record in wrapper.timeline(last=3):  # the median: one backward of ~5 ms can be preempted
        ready = sorted(b["ready_ns"] for b in record["buckets"])
        spreads.append((ready[-1] - ready[0]) / (record["backward_end_ns"]
                                                 - record["backward_start_ns"]))
    return dict(spread=statistics.median(spreads), buckets=len(record["buckets"]),
                summary=wrapper.compiled_summary(), producers=producers)


def _gradient_producers(output) -> list[str]:
    """Per parameter reached from `output` (in the order found), the name of the autograd node
    that hands it its gradient, numbered per distinct node: "CompiledFunctionBackward#2" says the
    third compiled function seen. One compiled function per piece: each bucket's parameters get
    their gradients when their own piece's backward ends."""
    seen, labels, counts, found, stack = {}, {}, {}, [], [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        for child, _ in node.next_functions:
            if child is not None and hasattr(child, "variable"):  # AccumulateGrad
                if id(node) not in labels:
                    kind = type(node).__name__
                    labels[id(node)] = f"{kind}#{counts.get(kind, 0)}"
                    counts[kind] = counts.get(kind, 0) + 1
                found.append(labels[id(node)])
            else:
                stack.append(child)
    return found


def mixed_worker(rank, world_size):
    """mixed_precision (bfloat16 forward) compiled both ways (aot_eager) against pyreducer's eager
    mixed precision (torch's own needs CUDA: no oracle on CPU), after 4 steps; and the pieces."""
    import torch._dynamo
    from torch.nn.parallel.distributed import _MixedPrecision

    from pyreducer import DistributedDataParallel

    out = {}
    for how in ("eager", "inner", "outer"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        body = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(64, 64),
                                                                    torch.nn.Tanh())])
        kwargs = dict(bucket_cap_mb=0.02, mixed_precision=_MixedPrecision(
            torch.bfloat16, torch.float32, torch.bfloat16))
        if how == "inner":
            body = torch.compile(body, backend="aot_eager")
        model = DistributedDataParallel(body, **kwargs)
        if how == "outer":
            model = torch.compile(model, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(4):
            model(torch.randn(8, 64, generator=gen)).float().sum().backward()
            opt.step()
            opt.zero_grad()
        wrapper = model if isinstance(model, DistributedDataParallel) else model._orig_mod
        out[how] = dict(params=[p.detach().clone() for p in model.parameters()],
                        summary=wrapper.compiled_summary())
    return out


def eager_worker(rank, world_size):
    """An eager model trained through the wrapper: torch._dynamo never loaded (it costs seconds
    of CPU per process; pyreducer reaches dynamo through torch._C._dynamo only)."""
    import sys

    from pyreducer import DistributedDataParallel

    loaded_before = "torch._dynamo" in sys.modules
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()))
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
    return dict(before=loaded_before, after="torch._dynamo" in sys.modules)


def autotune_worker(rank, world_size, compiled):
    """Online autotune (2 candidates, 2 steps each) on an MLP, compiled (aot_eager) or not:
    its log. Compiled, the first step on each new plan recompiles and is not counted."""
    import torch._dynamo

    from pyreducer import DistributedDataParallel
    from pyreducer.testing import steady_link
    from pyreducer.tuning import AutotuneConfig

    steady_link.install()  # a loaded machine's probe can fail its fit: no search then
    torch._dynamo.reset()
    torch.manual_seed(0)
    body = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(128, 128),
                                                                torch.nn.Tanh())])
    if compiled:
        body = torch.compile(body, backend="aot_eager")
    # every candidate measured its 2 steps (none pruned by prediction nor dropped early, however
    # slow a step on a loaded machine): the test counts the steps between them
    config = AutotuneConfig(warmup_iterations=2, measure_iterations=2, candidates=2, probe_every=1,
                            caps_mb=(0.05, 0.1), confirm_margin=0.0, prune_ratio=100.0,
                            abandon_ratio=float("inf"))
    model = DistributedDataParallel(body, bucket_cap_mb=config)
    for _ in range(24):
        model(torch.randn(32, 128)).sum().backward()
    return model.autotune_log
