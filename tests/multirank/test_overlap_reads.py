"""Reads outside the forward with an overlapped optimizer (pyreducer/overlap/optimizer.py): after
step() the updates are pending, and each way of reading parameters, gradients or optimizer state
must see them done. Each read is checked on its own, right after step(), against the same loop and
read with torch DDP's step (pyreducer without the overlapped optimizer: every update done at
step()), bit for bit, at 2 and 3 ranks (schedule="fifo": torch DDP's sums); then one more step must
end equal too. Also that the read itself completed what it should (no pending class left); a
GradScaler, which reads every gradient between backward and step(); a forward compiled by
torch.compile; the optimizer's step hooks and an LR scheduler on the wrapped optimizer; and the
refusals (pickling the wrapper, a TorchScript module). The reads that apply, and the compiled
forward, with overlap_optimizer(shard=True) too (pyreducer/sharded)."""
import copy
import io
import os
import pickle
import types

import pytest
import torch
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

X = torch.linspace(-1, 1, 32).reshape(4, 8)  # a fixed input for evaluation forwards


def _scaled_by(weights: dict, x):
    """A library-style function whose tensors come in a dict (the pending parameter is not a
    top-level argument of the __torch_function__ call)."""
    if has_torch_function((weights["w"],)):
        return handle_torch_function(_scaled_by, (weights["w"],), weights, x)
    return x @ weights["w"].t()


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# read name -> (what it returns, whether it must complete every pending update)
READS = {
    "state_dict": (lambda m, o: copy.deepcopy(m.state_dict()), True),
    "optimizer_state_dict": (lambda m, o: copy.deepcopy(o.state_dict()["state"]), True),
    # a parameter's entry found by its hash, which no torch function sees
    "optimizer_state": (lambda m, o: [copy.deepcopy(o.state[p]) for p in m.parameters()], True),
    "synchronize": (lambda m, o: m.synchronize(), True),
    "module_forward": (lambda m, o: m.module(X).detach(), True),
    "eval_no_grad": (lambda m, o: _evaluate(m), True),
    "torch_save_module": (lambda m, o: [p.detach() for p in _saved(m.module).parameters()], True),
    "pickle_parameters": (lambda m, o: [p.detach() for p in
                                        pickle.loads(pickle.dumps(list(m.parameters())))], True),
    "deepcopy_module": (lambda m, o: _deepcopied(m.module), True),
    "grads": (lambda m, o: [p.grad.clone() for p in m.parameters()], True),
    "nested_dict_arg": (lambda m, o: _scaled_by({"w": m.module[0].weight}, X).detach(), False),
}


def _evaluate(model):
    model.eval()
    with torch.no_grad():
        out = model(X)
    model.train()
    return out


def _deepcopied(module):
    clone = copy.deepcopy(module)
    return [(type(p).__name__, p.detach()) for p in clone.parameters()]


def _loop(rank, read, overlapped):
    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)),
                                    bucket_cap_mb=0.0001)  # a bucket per parameter
    opt = torch.optim.Adam(model.parameters(), lr=0.1, foreach=False)
    if overlapped:  # True, or "sharded": overlap_optimizer(shard=True)
        opt = model.overlap_optimizer(opt, schedule="fifo", shard=overlapped == "sharded")
    gen = torch.Generator().manual_seed(rank)

    def train_step():
        model(torch.randn(4, 8, generator=gen)).sum().backward()
        opt.step()

    for _ in range(2):
        train_step()
        opt.zero_grad()
    train_step()  # overlapped: its updates pending now
    in_flight = len(model.reducer.pending_buckets())
    value = READS[read][0](model, opt)
    left = len(model.reducer.pending_buckets())
    classes = [type(p).__name__ for p in model.parameters()]  # looking at a class reads nothing
    opt.zero_grad()
    train_step()
    model.synchronize()
    return dict(in_flight=in_flight, value=value, left=left, classes=classes,
                params=[p.detach().clone() for p in model.parameters()],
                state=copy.deepcopy(opt.state_dict()["state"]))


def reads_worker(rank, world_size):
    return {read: dict(ours=_loop(rank, read, True), barrier=_loop(rank, read, False))
            for read in READS}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"{ws}ranks")
def reads(request, ranks_once):
    return ranks_once(reads_worker, request.param, ())


def _equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("read", list(READS))
def test_read_after_step_sees_every_update(reads, read):
    for rank, r in enumerate(reads):
        ours, barrier = r[read]["ours"], r[read]["barrier"]
        assert ours["in_flight"] > 0, "nothing was pending: the read checks nothing"
        assert _equal(ours["value"], barrier["value"]), f"rank {rank}: {read} saw stale values"
        if READS[read][1]:
            assert ours["left"] == 0 and ours["classes"] == ["Parameter"] * 4, \
                f"rank {rank}: {read} left {ours['left']} buckets pending ({ours['classes']})"


# With shard=True: the reads that do not look at .grad after step() (None once updated: Note
# [Sharded step]) nor at optimizer.state (empty: the state lives in the shards).
SHARDED_READS = [read for read in READS if read not in ("grads", "optimizer_state")]


def sharded_reads_worker(rank, world_size):
    return {read: dict(ours=_loop(rank, read, "sharded"), barrier=_loop(rank, read, False))
            for read in SHARDED_READS}


@pytest.mark.parametrize("read", SHARDED_READS)
def test_sharded_read_after_step_sees_every_update(ranks_once, read):
    """The same reads with overlap_optimizer(shard=True), 2 ranks, bit for bit; the training
    after them too."""
    for rank, r in enumerate(ranks_once(sharded_reads_worker, 2, ())):
        ours, barrier = r[read]["ours"], r[read]["barrier"]
        assert ours["in_flight"] > 0, "nothing was pending: the read checks nothing"
        assert _equal(ours["value"], barrier["value"]), f"rank {rank}: {read} saw stale values"
        if READS[read][1]:
            assert ours["left"] == 0 and ours["classes"] == ["Parameter"] * 4, ours["classes"]
        assert _equal(ours["params"], barrier["params"]), f"rank {rank}: parameters after {read}"
        assert _equal(ours["state"], barrier["state"]), f"rank {rank}: optimizer state"


@pytest.mark.parametrize("read", list(READS))
def test_training_after_the_read_ends_equal(reads, read):
    for rank, r in enumerate(reads):
        ours, barrier = r[read]["ours"], r[read]["barrier"]
        assert _equal(ours["params"], barrier["params"]), f"rank {rank}: parameters after {read}"
        assert _equal(ours["state"], barrier["state"]), f"rank {rank}: optimizer state"


def pickle_worker(rank, world_size):
    from pyreducer import DistributedDataParallel

    model = DistributedDataParallel(nn.Linear(8, 2))
    model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        pickle.dumps(model)
    except RuntimeError as error:
        return str(error)
    return None


def test_overlapped_wrapper_refuses_pickling_by_name(ranks_once):
    for message in ranks_once(pickle_worker, 2, ()):
        assert message and "overlapped optimizer cannot be pickled or deep-copied" in message, \
            message


def replace_worker(rank, world_size):
    """Overlapped Adam for 3 steps, then model.overlap_optimizer(SGD) again: the second
    replaces the first (its pending updates done), against torch DDP switching optimizers at
    the same step; the first's step() then raises. At step 2, two refused replacements (LBFGS,
    and the overlapped optimizer itself) leave the first working."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    out = {}
    for name in ("torch", "ours"):
        model = (TorchDDP if name == "torch" else DistributedDataParallel)(
            copy.deepcopy(base), bucket_cap_mb=1e-6)
        gen = torch.Generator().manual_seed(rank)
        first = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
        opt = model.overlap_optimizer(first) if name == "ours" else first
        for step in range(6):
            if step == 2 and name == "ours":
                for refused in (torch.optim.LBFGS(model.parameters()), opt):
                    try:
                        model.overlap_optimizer(refused)
                    except (TypeError, ValueError) as error:
                        out.setdefault("refused", []).append(str(error))
            if step == 3:
                second = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                         foreach=False)
                old, opt = opt, model.overlap_optimizer(second) if name == "ours" else second
            model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if name == "ours":
            model.synchronize()
            try:
                old.step()
            except RuntimeError as error:
                out["old_step"] = str(error)
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out


def test_overlap_optimizer_called_again_replaces_the_first(ranks_once):
    for rank, r in enumerate(ranks_once(replace_worker, 2, ())):
        assert "was replaced by another" in r.get("old_step", ""), r.get("old_step")
        lbfgs, itself = r["refused"]
        assert "LBFGS needs a closure" in lbfgs, lbfgs
        assert "got an overlapped optimizer: pass the optimizer it wraps" in itself, itself
        for ours, theirs in zip(r["ours"], r["torch"]):
            assert torch.equal(ours, theirs), f"rank {rank}"


def replaced_step_worker(rank, world_size):
    """overlap_optimizer over an optimizer whose step was replaced on the instance warns that
    the replacement is never called (the class's step runs per bucket); an LR scheduler's
    counting wrapper alone is no replacement, and a replacement under it is still found."""
    import warnings

    from pyreducer import DistributedDataParallel

    def counted_step(self, *args, **kwargs):
        return type(self).step(self, *args, **kwargs)

    out = {}
    for case in ("plain", "scheduler", "replaced", "replaced_then_scheduler"):
        model = DistributedDataParallel(nn.Linear(8, 2))
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        if case.startswith("replaced"):
            inner.step = types.MethodType(counted_step, inner)  # a scheduler needs a method
        if case.endswith("scheduler"):
            torch.optim.lr_scheduler.StepLR(inner, step_size=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.overlap_optimizer(inner, schedule="fifo")
        out[case] = [(str(w.message), os.path.basename(w.filename)) for w in caught
                     if "overlap_optimizer" in str(w.message)]
    return out


def test_a_step_replaced_on_the_optimizer_is_named_in_a_warning(ranks_once):
    for r in ranks_once(replaced_step_worker, 2, ()):
        assert r["plain"] == r["scheduler"] == [], r
        for case in ("replaced", "replaced_then_scheduler"):
            assert len(r[case]) == 1, r[case]
            message, filename = r[case][0]
            assert "SGD.step was replaced on this optimizer" in message, message
            assert "counted_step" in message, message
            assert filename == "test_overlap_reads.py", filename  # points at the caller


def compiled_worker(rank, world_size):
    """A forward compiled by torch.compile (aot_eager: no C++ compiler needed), both ways in,
    reads the parameters through dynamo's graphs (split at the buckets: pyreducer/compiled):
    every forward's output equals the one with torch DDP's step. A TorchScript module, whose
    forward reads them in C++, is refused by name."""
    import torch._dynamo

    from pyreducer import DistributedDataParallel

    outputs = {}
    for order in ("inner", "outer"):
        for overlapped in (True, "sharded", False):
            torch._dynamo.reset()
            torch.manual_seed(0)
            module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
            if order == "inner":
                model = DistributedDataParallel(torch.compile(module, backend="aot_eager"),
                                                bucket_cap_mb=0.0001)
            else:
                model = torch.compile(DistributedDataParallel(module, bucket_cap_mb=0.0001),
                                      backend="aot_eager")
            opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
            if overlapped:
                opt = model.overlap_optimizer(opt, schedule="fifo",
                                              shard=overlapped == "sharded")
            gen = torch.Generator().manual_seed(rank)
            outputs[order, overlapped] = []
            for _ in range(4):
                out = model(torch.randn(4, 8, generator=gen))
                outputs[order, overlapped].append(out.detach().clone())
                out.sum().backward()
                opt.step()
                opt.zero_grad()
    scripted = DistributedDataParallel(torch.jit.script(nn.Sequential(nn.Linear(8, 2))))
    try:
        scripted.overlap_optimizer(torch.optim.SGD(scripted.parameters(), lr=0.1))
        refused = None
    except ValueError as error:
        refused = str(error)
    return dict(outputs=outputs, refused=refused)


def test_compiled_forward_sees_every_update_and_torchscript_is_refused(ranks_once):
    for rank, r in enumerate(ranks_once(compiled_worker, 2, ())):
        for order in ("inner", "outer"):
            for overlapped in (True, "sharded"):
                assert _equal(r["outputs"][order, overlapped], r["outputs"][order, False]), \
                    f"rank {rank}, {order}, {overlapped}"
        assert r["refused"] and "holds TorchScript modules ((root), 0)" in r["refused"], r["refused"]


def _torch_ddp_and_ours():
    """("torch", torch DDP) and ("ours", pyreducer) over the same small model, a bucket per
    parameter, for the comparisons below."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    for name, cls in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
        yield name, cls(copy.deepcopy(base), bucket_cap_mb=0.0001)


def scaler_worker(rank, world_size):
    """torch.amp.GradScaler reads every gradient between backward and step() (unscale_): the
    reads wait for the all-reduces. A step whose gradients are not finite (an Inf input on rank
    1 at step 2) is skipped and the scale halved, as with torch DDP; parameters bit for bit."""
    out = {}
    for name, model in _torch_ddp_and_ours():
        opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)
        if name == "ours":
            opt = model.overlap_optimizer(opt, schedule="fifo")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        gen = torch.Generator().manual_seed(rank)
        scales = []
        for step in range(6):
            x = torch.randn(4, 8, generator=gen)
            if step == 2 and rank == 1:
                x[0, 0] = float("inf")
            scaler.scale(model(x).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        out[name] = dict(scales=scales, params=[p.detach().clone() for p in model.parameters()])
    return out


def test_grad_scaler_skips_the_non_finite_step_as_with_torch_ddp(ranks_once):
    for r in ranks_once(scaler_worker, 2, ()):
        assert r["ours"]["scales"] == r["torch"]["scales"] and r["ours"]["scales"][2] == 512.0
        assert _equal(r["ours"]["params"], r["torch"]["params"])


class _SubSGD(torch.optim.SGD):
    """A subclass whose step calls its parent's: torch hooks both classes' step (once an SGD
    exists), so torch runs the step hooks twice per step."""

    def step(self, closure=None):
        return super().step(closure)


def hooks_worker(rank, world_size):
    """Step hooks (the wrapped optimizer's, the overlapped one's, torch's global ones) run once
    per step() as with torch's optimizer, not once per bucket update, also where the class's
    step calls a parent's step that torch hooked too; an LR scheduler built on the wrapped
    optimizer gives torch DDP's results, without torch's warning that it stepped before the
    optimizer (whose updates come later)."""
    import warnings

    from torch.optim.optimizer import register_optimizer_step_post_hook

    out = {}
    subclassed = ((name + "_sub", model) for name, model in _torch_ddp_and_ours())
    for name, model in [*_torch_ddp_and_ours(), *subclassed]:
        cls = _SubSGD if name.endswith("_sub") else torch.optim.SGD
        inner = cls(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
        calls = []
        inner.register_step_pre_hook(lambda *args: calls.append("inner pre"))
        inner.register_step_post_hook(lambda *args: calls.append("inner post"))
        scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
        opt = model.overlap_optimizer(inner, schedule="fifo") if name.startswith("ours") \
            else inner
        handle = register_optimizer_step_post_hook(lambda *args: calls.append("global post"))
        gen = torch.Generator().manual_seed(rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                model(torch.randn(4, 8, generator=gen)).sum().backward()
                opt.step()
                scheduler.step()
                opt.zero_grad()
        handle.remove()
        out[name] = dict(calls=calls, warnings=[str(w.message) for w in caught],
                         params=[p.detach().clone() for p in model.parameters()])
    return out


def test_step_hooks_run_once_per_step_and_a_scheduler_on_the_wrapped_optimizer_works(ranks_once):
    for r in ranks_once(hooks_worker, 2, ()):
        assert r["ours"]["calls"] == r["torch"]["calls"] == \
            ["inner pre", "inner post", "global post"] * 4, r["ours"]["calls"]
        assert not [w for w in r["ours"]["warnings"] if "lr_scheduler" in w], r["ours"]["warnings"]
        assert all(torch.equal(a, b) for a, b in zip(r["ours"]["params"], r["torch"]["params"]))
        # the subclass: once per step() (torch runs its own hooks twice there, once per class)
        assert r["ours_sub"]["calls"] == ["inner pre", "inner post", "global post"] * 4, \
            r["ours_sub"]["calls"]
        assert all(torch.equal(a, b) for a, b in zip(r["ours_sub"]["params"],
                                                     r["torch_sub"]["params"]))


class _Aliased(nn.Module):
    """Reads a view of the last layer's weight, kept in an attribute since construction (and in
    a list), before the last layer runs: a read that bypasses the pending parameter's class
    (Note [Reads around the pending class] in pyreducer/overlap/bypass.py)."""

    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)
        self.view = self.last.weight.detach()[:, :4]  # a plain tensor sharing its memory
        self.held = [self.last.bias.data]

    def forward(self, x):
        side = x[:, :4] @ self.view.t() + self.held[0]
        return self.last(torch.tanh(self.first(x))) + side


class _Halved(nn.Parameter):
    """A parameter class with a __torch_function__ of its own (as quantized or float8 parameter
    classes have): F.linear sees half its value."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            x, weight, *rest = args
            args = (x, weight * 0.5, *rest)
        return super().__torch_function__(func, types, args, kwargs or {})


class _ReadsHalvedHead(nn.Module):
    """Reads its head's parameters itself, first (the head's forward never runs, so no forward
    hook updates them before): the read goes through the pending class."""

    def __init__(self):
        super().__init__()
        self.head, self.other = nn.Linear(8, 2), nn.Linear(8, 2)
        self.head.weight = _Halved(self.head.weight.detach().clone())

    def forward(self, x):
        return nn.functional.linear(x, self.head.weight, self.head.bias) + self.other(x)


def _with_halved_weight():
    torch.manual_seed(0)
    return _ReadsHalvedHead()


def bypass_worker(rank, world_size, shard):
    """Each model trained with torch DDP and with the overlapped (or sharded) optimizer: the
    outputs of every forward and the parameters at the end are equal; metadata reads after
    step() leave the updates pending."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    out = {}
    for case, build in (("alias", lambda: (torch.manual_seed(0), _Aliased())[1]),
                        ("own_torch_function", _with_halved_weight)):
        for name, cls in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
            module = build()  # (the same seed: the same values)
            model = cls(module, bucket_cap_mb=0.0001)
            opt = torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)
            if name == "ours":
                opt = model.overlap_optimizer(opt, schedule="fifo", shard=shard)
            gen = torch.Generator().manual_seed(rank)
            outputs, still_pending = [], []
            for step in range(4):
                y = model(torch.randn(4, 8, generator=gen))
                outputs.append(y.detach().clone())
                y.pow(2).sum().backward()
                opt.step()
                # (every other step: the forward after the others reads pending parameters)
                if name == "ours" and case == "own_torch_function" and step % 2:
                    before = len(model.reducer.pending_buckets())
                    [(tuple(p.shape), p.numel(), p.dim(), p.requires_grad, p.dtype, p.device,
                      p.is_leaf, p.stride(), p.is_contiguous()) for p in model.parameters()]
                    still_pending.append((before, sum(
                        type(p).__name__.startswith("Pending") for p in model.parameters())))
                opt.zero_grad()
            model(X)
            out[case, name] = dict(outputs=outputs, still_pending=still_pending,
                                   params=[p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("shard", [False, True], ids=["overlapped", "sharded"])
def test_reads_around_the_pending_class_see_the_update(ranks_once, shard):
    for rank, r in enumerate(ranks_once(bypass_worker, 2, (shard,))):
        for case in ("alias", "own_torch_function"):
            ours, theirs = r[case, "ours"], r[case, "torch"]
            assert _equal(ours["outputs"], theirs["outputs"]), f"rank {rank}, {case}: outputs"
            assert _equal(ours["params"], theirs["params"]), f"rank {rank}, {case}: parameters"
        pending = r["own_torch_function", "ours"]["still_pending"]
        assert pending and all(buckets > 0 and params > 0 for buckets, params in pending), \
            f"rank {rank}: metadata reads completed the updates: {pending}"
