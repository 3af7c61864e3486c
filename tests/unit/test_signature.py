"""The constructor is torch DDP's: same argument names, order and defaults as the installed
torch's DistributedDataParallel, every one of them served; pyreducer's own arguments come after,
keyword-only; construction checks run in torch's order with torch's exception types and
words."""
import inspect

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from pyreducer import DistributedDataParallel

# torch DDP's arguments, all served. A new torch argument fails this test: a visible decision.
SUPPORTED = ["module", "device_ids", "output_device", "dim", "broadcast_buffers", "init_sync",
             "process_group", "bucket_cap_mb", "check_reduction", "device_mesh",
             "bucket_cap_mb_list", "forward_sync_buffers", "find_unused_parameters",
             "gradient_as_bucket_view", "static_graph", "batched_grad_copy",
             "delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision",
             "skip_all_reduce_unused_params", "lazy_bucket_allocation"]


def _params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


# Arguments of torch 2.12-2.15 that older torch lacks: pyreducer serves them on every torch,
# after the installed DDP's own (pyreducer/wrapper/torch_versions.py).
NEWER_TORCH = ["batched_grad_copy", "forward_sync_buffers", "lazy_bucket_allocation"]
# pyreducer's own arguments: keyword-only, after all of DDP's.
EXTRAS = ["bucket_plan", "timeline_iterations", "gradient_predivide_factor", "reduce_dtype",
          "check_finite"]


def test_same_arguments_order_and_defaults_as_installed_torch():
    ours, theirs = _params(DistributedDataParallel.__init__), _params(TorchDDP.__init__)
    assert ours[:len(theirs)] == theirs
    installed = {name for name, _, _ in theirs}
    newer = [(name, default, kind) for name, default, kind in ours[len(theirs):]
             if name in NEWER_TORCH]
    assert [name for name, _, _ in newer] == [n for n in NEWER_TORCH if n not in installed]
    assert all(kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for _, _, kind in newer)
    extras = ours[len(theirs) + len(newer):]
    assert [name for name, _, _ in extras] == EXTRAS
    assert all(kind == inspect.Parameter.KEYWORD_ONLY for _, _, kind in extras)


def test_every_argument_is_served():
    names = [name for name, _, _ in _params(TorchDDP.__init__)][1:]  # without self
    assert set(names) <= set(SUPPORTED), set(names) - set(SUPPORTED)
    assert set(SUPPORTED) - set(names) <= set(NEWER_TORCH)


def test_broadcast_buffers_warns_as_the_installed_torch_does():
    """torch 2.13+ deprecates broadcast_buffers (a FutureWarning when given); before, passing it
    is silent. The derived settings are the same on both."""
    import warnings

    from pyreducer.wrapper.arguments import resolve_buffer_sync

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_buffer_sync(False, None) == (False, False)
        assert resolve_buffer_sync(True, False) == (False, True)
    deprecated = "forward_sync_buffers" in [name for name, _, _ in _params(TorchDDP.__init__)]
    assert len([w for w in caught if issubclass(w.category, FutureWarning)]) == \
        (2 if deprecated else 0)


def test_ignore_helper_is_a_static_method_like_ddps():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, ["0.bias", "1.running_mean"])
    assert module._ddp_params_and_buffers_to_ignore == ["0.bias", "1.running_mean"]
    assert getattr(module[0].bias, "_ddp_ignored", False)
    assert getattr(module[1].running_mean, "_ddp_ignored", False)
    assert not hasattr(module[0].weight, "_ddp_ignored")


def test_no_process_group_is_torchs_error():
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        DistributedDataParallel(torch.nn.Linear(2, 2))


_GROUP = object()  # no check below reaches the process group
CONSTRUCTION_ERRORS = {
    "no_parameters": (lambda: torch.nn.Module(), {}),
    "all_frozen": (lambda: torch.nn.Linear(2, 2).requires_grad_(False), {}),
    "two_device_ids": (lambda: torch.nn.Linear(2, 2), dict(device_ids=[0, 1])),
    "device_ids_on_cpu": (lambda: torch.nn.Linear(2, 2), dict(device_ids=[0])),
    "output_device_on_cpu": (lambda: torch.nn.Linear(2, 2), dict(output_device=1)),
    "two_device_types": (lambda: torch.nn.Sequential(torch.nn.Linear(2, 2),
                                                     torch.nn.Linear(2, 2, device="meta")), {}),
    "lazy": (lambda: torch.nn.LazyLinear(2), {}),
    "delay_without_hook_param": (lambda: torch.nn.Linear(2, 2),
                                 dict(delay_all_reduce_named_params=[])),
    "group_and_mesh": (lambda: torch.nn.Linear(2, 2), dict(device_mesh=object())),
}


@pytest.mark.parametrize("case", sorted(CONSTRUCTION_ERRORS))
def test_construction_errors_are_torchs(case):
    """Same exception type as torch DDP's for the same mistake, its message first (pyreducer
    may add detail after it), checked in the same order."""
    make, kwargs = CONSTRUCTION_ERRORS[case]
    errors = []
    for cls in (TorchDDP, DistributedDataParallel):
        with pytest.raises(Exception) as caught:
            cls(make(), process_group=_GROUP, **kwargs)
        errors.append(caught.value)
    theirs, ours = errors
    assert type(ours) is type(theirs), (theirs, ours)
    assert str(ours).startswith(str(theirs)), (str(theirs), str(ours))
