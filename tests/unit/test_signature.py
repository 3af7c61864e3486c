"""The constructor is torch DDP's: same argument names, order and defaults as the installed
torch's DistributedDataParallel; unsupported values raise NotImplementedError naming the
argument; nothing is silently ignored."""
import inspect

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from pyreducer import DistributedDataParallel

# The options pyreducer serves today. Adding one is a visible decision: update this list.
SUPPORTED = ["module", "device_ids", "output_device", "dim", "broadcast_buffers", "init_sync",
             "process_group", "bucket_cap_mb", "check_reduction", "device_mesh",
             "bucket_cap_mb_list", "forward_sync_buffers", "find_unused_parameters",
             "gradient_as_bucket_view", "static_graph", "batched_grad_copy"]
NOT_YET = {"delay_all_reduce_named_params": [], "param_to_hook_all_reduce": object(),
           "mixed_precision": object(), "skip_all_reduce_unused_params": True}


def _params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


# pyreducer's own arguments: keyword-only, after all of DDP's.
EXTRAS = ["bucket_plan", "timeline_iterations"]


def test_same_arguments_order_and_defaults_as_installed_torch():
    ours, theirs = _params(DistributedDataParallel.__init__), _params(TorchDDP.__init__)
    assert ours[:len(theirs)] == theirs
    extras = ours[len(theirs):]
    assert [name for name, _, _ in extras] == EXTRAS
    assert all(kind == inspect.Parameter.KEYWORD_ONLY for _, _, kind in extras)


def test_every_argument_is_either_supported_or_refused():
    names = [name for name, _, _ in _params(TorchDDP.__init__)][1:]
    assert sorted(names) == sorted(SUPPORTED + list(NOT_YET))


@pytest.mark.parametrize("name", sorted(NOT_YET))
def test_unsupported_argument_raises_naming_it(name):
    with pytest.raises(NotImplementedError, match=name):
        DistributedDataParallel(torch.nn.Linear(2, 2), **{name: NOT_YET[name]})


def test_ignore_helper_is_a_static_method_like_ddps():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, ["0.bias", "1.running_mean"])
    assert module._ddp_params_and_buffers_to_ignore == ["0.bias", "1.running_mean"]
    assert getattr(module[0].bias, "_ddp_ignored", False)
    assert getattr(module[1].running_mean, "_ddp_ignored", False)
    assert not hasattr(module[0].weight, "_ddp_ignored")


def test_no_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(torch.nn.Linear(2, 2))
