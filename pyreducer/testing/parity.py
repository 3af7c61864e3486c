"""The parity scenarios: the same models, optimizers and options trained with torch DDP and
with pyreducer (tests/multirank/test_parity.py on Gloo ranks, tests/gpu on NCCL ranks).

Every scenario trains the same model twice on each rank, once wrapped in torch's
DistributedDataParallel and once in pyreducer's, from the same (deliberately rank-dependent)
initialisation, so both must also broadcast rank 0's state. Batches are made on the CPU (the
same on every device), then moved to the model's device.
"""
import copy

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

STEPS = 5


class Branchy(nn.Module):
    """A branch skipped on some iterations on every rank, on some only on rank 1; a head that
    is never used (its .grad must stay as it was)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.branch = nn.Linear(16, 16), nn.Linear(16, 16)
        self.head, self.never = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, use_branch=True):
        h = torch.relu(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


class Checkpointed(nn.Module):
    """Reentrant activation checkpointing, the same block checkpointed twice (its hooks fire
    twice per backward), and an unused parameter."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.shared = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head, self.unused = nn.Linear(16, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.stem(x)
        h = checkpoint(self.shared, h, use_reentrant=True)
        h = checkpoint(self.shared, h, use_reentrant=True)
        return self.head(h)


class MixedDtypes(nn.Module):
    """float32, float64 and bfloat16 parameters, and a frozen layer in between."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.b = nn.Linear(16, 16).double()
        self.c = nn.Linear(16, 4).bfloat16()

    def forward(self, x):
        h = self.frozen(torch.relu(self.a(x)))
        h = torch.relu(self.b(h.double())).float()
        return self.c(h.bfloat16()).float()


class SparseEmbeddings(nn.Module):
    """Sparse-gradient nn.Embedding and nn.EmbeddingBag (each in a bucket of its own) beside
    dense layers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 16, sparse=True)
        self.bag = nn.EmbeddingBag(40, 16, mode="sum", sparse=True)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids):
        h = self.embed(ids).mean(1) + self.bag(ids)
        return self.head(torch.tanh(self.mix(h)))


class SkipsEverywhere(nn.Module):
    """A branch skipped on some iterations and a head never used, the same on every rank (as
    skip_all_reduce_unused_params requires). The unused head is large enough for buckets of
    its own at small caps."""

    def __init__(self):
        super().__init__()
        self.trunk, self.branch = nn.Linear(16, 16), nn.Linear(16, 16)
        self.head, self.never = nn.Linear(16, 4), nn.Linear(16, 64)

    def forward(self, x, use_branch=True):
        h = torch.relu(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def _regression(gen, size):
    return torch.randn(size, 16, generator=gen), torch.randn(size, 4, generator=gen)


def _branch_loss(model, batch, step, rank):
    use = step % 3 != 0 and not (rank == 1 and step % 2 == 0)
    x, y = batch
    return torch.nn.functional.mse_loss(model(x, use_branch=use), y)


def _plain_loss(model, batch, step, rank):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def gradient_penalty_loss(model, batch, step=0, rank=0):
    """MSE plus a gradient penalty (WGAN-GP, R1): the gradient of the outputs w.r.t. the inputs,
    taken through the wrapper by torch.autograd.grad (a backward through the outputs that
    accumulates into no parameter), squared into the loss."""
    x, y = batch
    x = x.detach().requires_grad_(True)
    out = model(x)
    grad, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return torch.nn.functional.mse_loss(out, y) + 0.1 * grad.pow(2).sum()


def _ids(gen, size):
    return torch.randint(0, 40, (size, 5), generator=gen), torch.randn(size, 4, generator=gen)


def _same_branch_loss(model, batch, step, rank):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x, use_branch=step % 2 == 0), y)


def _delay_last_layer(module):
    """torch DDP's delayed all-reduce of the mlp's last layer, hooked on its first weight (the
    last gradient of backward)."""
    return dict(delay_all_reduce_named_params=[(n, p) for n, p in module.named_parameters()
                                               if n.startswith("4.")],
                param_to_hook_all_reduce=module[0].weight)


LOCAL_MODELS = {"branchy": (Branchy, _regression, _branch_loss),
                "checkpointed": (Checkpointed, _regression, _plain_loss),
                "mixed_dtypes": (MixedDtypes, _regression, _plain_loss),
                "penalty": (Branchy, _regression, gradient_penalty_loss),
                "sparse": (SparseEmbeddings, _ids, _plain_loss),
                "skips": (SkipsEverywhere, _regression, _same_branch_loss),
                "skips_static": (SkipsEverywhere, _regression, _plain_loss)}

SCENARIOS = {
    "mlp_sgd": dict(model="mlp", opt="sgd"),
    "mlp_adam": dict(model="mlp", opt="adam"),
    "cnn_batchnorm_sgd": dict(model="cnn", opt="sgd"),
    "cnn_batchnorm_adam": dict(model="cnn", opt="adam"),
    "tied_weights_adam": dict(model="tied", opt="adam"),
    "bucket_per_param": dict(model="mlp", opt="adam", ddp=dict(bucket_cap_mb=0.001)),
    "one_bucket": dict(model="cnn", opt="sgd", ddp=dict(bucket_cap_mb=1000)),
    "bucket_cap_list": dict(model="mlp", opt="sgd", ddp=dict(bucket_cap_mb_list=[0.001, 0.01])),
    "no_sync_4_micro_batches": dict(model="mlp", opt="adam", micro=4, how="no_sync"),
    "no_sync_batchnorm": dict(model="cnn", opt="sgd", micro=4, how="no_sync"),
    "require_backward_grad_sync_toggle": dict(model="cnn", opt="adam", micro=3, how="attribute"),
    # find_unused_parameters: skipped branch (all ranks / one rank), a never-used head
    "find_unused_sgd": dict(model="branchy", opt="sgd", ddp=dict(find_unused_parameters=True)),
    "find_unused_adam_no_sync": dict(model="branchy", opt="adam", micro=2, how="no_sync",
                                     ddp=dict(find_unused_parameters=True)),
    # torch.autograd.grad through the outputs before the backward (it must not end the
    # iteration: torch DDP's reducer never sees it)
    "gradient_penalty": dict(model="penalty", opt="adam", ddp=dict(find_unused_parameters=True)),
    # static_graph: reentrant checkpointing with hooks firing twice, an unused parameter
    "static_graph_checkpoint": dict(model="checkpointed", opt="sgd", ddp=dict(static_graph=True)),
    "static_graph_checkpoint_adam": dict(model="checkpointed", opt="adam",
                                         ddp=dict(static_graph=True, bucket_cap_mb=0.001)),
    # gradient_as_bucket_view with both zero_grad styles, and across the rebuild under no_sync
    "bucket_view_set_to_none": dict(model="mlp", opt="adam",
                                    ddp=dict(gradient_as_bucket_view=True)),
    "bucket_view_zero_fill": dict(model="cnn", opt="sgd", set_to_none=False,
                                  ddp=dict(gradient_as_bucket_view=True, bucket_cap_mb=0.001)),
    "bucket_view_no_sync_rebuild": dict(model="mlp", opt="sgd", micro=3, how="no_sync",
                                        set_to_none=False,
                                        ddp=dict(gradient_as_bucket_view=True, bucket_cap_mb=0.3)),
    # batched_grad_copy: one fused copy per bucket (pyreducer::bucket_copy_in)
    "batched_grad_copy": dict(model="cnn", opt="adam", ddp=dict(batched_grad_copy=True)),
    "batched_grad_copy_views": dict(model="mlp", opt="sgd", micro=2, how="no_sync",
                                    ddp=dict(batched_grad_copy=True, bucket_cap_mb=0.3,
                                             gradient_as_bucket_view=True)),
    "batched_grad_copy_channels_last": dict(model="cnn", opt="sgd", channels_last=True,
                                            ddp=dict(batched_grad_copy=True)),
    "channels_last": dict(model="cnn", opt="adam", channels_last=True),
    # lazy_bucket_allocation (torch 2.15): buffers given back after backward, with bucket views
    # after zero_grad(set_to_none=True), with unused parameters marked ready at backward start
    "lazy_buckets": dict(model="cnn", opt="adam", ddp=dict(lazy_bucket_allocation=True)),
    "lazy_buckets_views_no_sync": dict(model="mlp", opt="sgd", micro=2, how="no_sync",
                                       ddp=dict(lazy_bucket_allocation=True, bucket_cap_mb=0.3,
                                                gradient_as_bucket_view=True)),
    "lazy_buckets_find_unused_batched": dict(model="branchy", opt="sgd",
                                             ddp=dict(lazy_bucket_allocation=True,
                                                      batched_grad_copy=True,
                                                      find_unused_parameters=True)),
    # mixed dtypes (float32 + float64 + bfloat16) and a frozen layer
    "mixed_dtypes_frozen": dict(model="mixed_dtypes", opt="sgd", ddp=dict(bucket_cap_mb=0.001)),
    # sparse gradients (SGD without momentum: torch's optimizers for sparse gradients)
    "sparse": dict(model="sparse", opt="sgd_plain"),
    "sparse_bucket_view_no_sync": dict(model="sparse", opt="sgd_plain", micro=2, how="no_sync",
                                       ddp=dict(gradient_as_bucket_view=True,
                                                bucket_cap_mb=0.001)),
    "sparse_batched_find_unused": dict(model="sparse", opt="sgd_plain",
                                       ddp=dict(batched_grad_copy=True,
                                                find_unused_parameters=True)),
    # buckets of parameters unused on every rank are not all-reduced (one bucket each)
    "skip_all_reduce_unused": dict(model="skips", opt="sgd",
                                   ddp=dict(find_unused_parameters=True, bucket_cap_mb=0.001,
                                            skip_all_reduce_unused_params=True)),
    "skip_all_reduce_unused_static": dict(model="skips_static", opt="adam",
                                          ddp=dict(static_graph=True, bucket_cap_mb=0.001,
                                                   skip_all_reduce_unused_params=True)),
    # the last layer's all-reduce delayed until the first layer's gradient (torch DDP never
    # waits for it: a barrier after backward lets torch's finish before the step)
    "delay_all_reduce": dict(model="mlp", opt="adam", ddp_from_module=_delay_last_layer,
                             barrier=True),
}


# Arguments that change only where gradients are held, never a sum: where the installed torch's
# DDP lacks one, that DDP without it is the oracle (torch 2.15's lazy_bucket_allocation).
MEMORY_ONLY = frozenset({"lazy_bucket_allocation"})


def oracle_missing(name: str) -> str | None:
    """Why the installed torch's DDP cannot run scenario `name` (an argument of a newer torch,
    pyreducer/wrapper/torch_versions.py, other than MEMORY_ONLY's), or None."""
    from pyreducer.wrapper.torch_versions import DDP_ARGUMENTS

    missing = sorted(set(SCENARIOS[name].get("ddp", {})) - DDP_ARGUMENTS - MEMORY_ONLY)
    return f"torch {torch.__version__}'s DDP has no {', '.join(missing)}: no oracle to compare " \
        "with" if missing else None


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "sgd_plain":
        return torch.optim.SGD(params, lr=0.05)
    return torch.optim.Adam(params, lr=1e-2)


def _model_fns(name):
    if name in LOCAL_MODELS:
        build, batch, loss = LOCAL_MODELS[name]
        return build, batch, loss
    from pyreducer.testing import models

    spec = models.spec(name)
    return spec.build, spec.batch, lambda model, batch, step, rank: spec.loss(model, batch)


def _on(batch, device):
    return tuple(t.to(device) for t in batch)


def train(cls, base, scenario, rank, device="cpu"):
    """STEPS steps of `scenario` with wrapper `cls` (torch's or pyreducer's DDP) around a copy of
    `base`; returns (state dict with .grad entries, the wrapper). On a GPU the module moves to
    `device` and the wrapper gets device_ids, as a GPU user passes them."""
    _, make_batch, loss_fn = _model_fns(scenario["model"])
    device = torch.device(device)
    kwargs = dict(scenario.get("ddp", {}))
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    module = copy.deepcopy(base).to(device)
    if "ddp_from_module" in scenario:
        kwargs.update(scenario["ddp_from_module"](module))
    if cls is TorchDDP:  # an older torch's DDP is the oracle without them (MEMORY_ONLY)
        from pyreducer.wrapper.torch_versions import DDP_ARGUMENTS

        kwargs = {k: v for k, v in kwargs.items() if k in DDP_ARGUMENTS or k not in MEMORY_ONLY}
    model = cls(module, **kwargs)
    opt = _optimizer(scenario["opt"], [p for p in model.parameters() if p.requires_grad])
    gen = torch.Generator().manual_seed(1000 + rank)
    micro = scenario.get("micro", 1)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=scenario.get("set_to_none", True))
        for m in range(micro):
            last = m == micro - 1
            if scenario.get("how") == "no_sync" and not last:
                with model.no_sync():
                    loss_fn(model, _on(make_batch(gen, 8), device), step, rank).backward()
                continue
            if scenario.get("how") == "attribute":
                model.require_backward_grad_sync = last
            loss_fn(model, _on(make_batch(gen, 8), device), step, rank).backward()
        if scenario.get("barrier"):
            torch.distributed.barrier()  # Gloo: completes every collective issued before it
        opt.step()
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    state.update({f"{n}.grad": (_dense(p.grad) if p.grad is not None else None)
                  for n, p in model.module.named_parameters()})
    return state, model


def _dense(grad):
    """A copy of `grad`, dense (sparse gradients compare as their dense values)."""
    return grad.to_dense() if grad.is_sparse else grad.clone()


def sparse_grads(model) -> list[str]:
    """Names of the parameters whose .grad is sparse."""
    return [n for n, p in model.module.named_parameters() if p.grad is not None and p.grad.is_sparse]


def parity_worker(rank, world_size, names, device_type="cpu"):
    """Trains every named scenario with torch DDP and with pyreducer on this rank; per scenario
    {"torch": state, "ours": state, "buckets": pyreducer's bucket plan, "num_params"}. With
    device_type "cuda", rank r trains on cuda:r, or shares the GPUs with other ranks where there
    are fewer GPUs than ranks (Gloo: cuda:r % GPUs)."""
    from pyreducer import DistributedDataParallel

    device = torch.device("cuda", rank % torch.cuda.device_count()) if device_type == "cuda" \
        else torch.device("cpu")
    out = {}
    for name in names:
        if oracle_missing(name):
            continue
        scenario = SCENARIOS[name]
        torch.manual_seed(17 + rank)  # ranks start different: both wrappers must broadcast
        base = _model_fns(scenario["model"])[0]()
        if scenario.get("channels_last"):
            base = base.to(memory_format=torch.channels_last)
        torch_state, theirs = train(TorchDDP, base, scenario, rank, device)
        ours_state, ours = train(DistributedDataParallel, base, scenario, rank, device)
        out[name] = dict(torch=torch_state, ours=ours_state, buckets=ours.bucket_plan(),
                         num_params=len(list(ours.parameters())),
                         sparse_grads=dict(torch=sparse_grads(theirs), ours=sparse_grads(ours)),
                         buckets_reduced=dict(
                             torch=theirs._get_ddp_logging_data().get("num_buckets_reduced"),
                             ours=ours._get_ddp_logging_data().get("num_buckets_reduced")))
    return out
