"""pyreducer.torchft's construction checks: wrong use is refused at construction, naming what is
wrong and why (no Manager, a process group of one's own, options that need collectives outside
the quorum's all-reduce, a torchft that is missing or of another version). That `import
pyreducer` loads nothing of torchft: test_layout.py. The wrapper under real failures:
tests/multirank/test_torchft.py."""
import importlib.metadata
import types

import pytest
from torch import nn

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install "
                                                "'.[torchft]')")

from pyreducer import torchft as ft  # noqa: E402


def test_a_manager_is_required_first():
    with pytest.raises(TypeError, match="expected a torchft.Manager first, got Linear"):
        ft.DistributedDataParallel(nn.Linear(2, 2), nn.Linear(2, 2))


@pytest.mark.parametrize("options, named", [
    (dict(process_group=object()), "process_group="),
    (dict(find_unused_parameters=True), "find_unused_parameters=True"),
    (dict(static_graph=True), "static_graph=True"),
    (dict(init_sync=True), "init_sync=True"),
    (dict(broadcast_buffers=True), "broadcast_buffers=True"),
    (dict(reduce_dtype="bfloat16"), "reduce_dtype="),
    (dict(check_finite=True), "check_finite=True"),
    (dict(bucket_cap_mb="auto"), "bucket_cap_mb='auto'"),
])
def test_options_that_need_other_collectives_are_refused_by_name(options, named):
    with pytest.raises(ValueError, match="cannot be used under torchft") as caught:
        ft.check_options(options)
    assert named in str(caught.value)


def test_the_options_that_work_pass():
    ft.check_options(dict(bucket_cap_mb=4, gradient_as_bucket_view=True, process_group=None,
                          find_unused_parameters=False, broadcast_buffers=False,
                          timeline_iterations=16))


def test_another_process_group_than_torchfts_gloo_is_refused():
    with pytest.raises(TypeError, match="the Manager's is ProcessGroupDummy"):
        ft._quorum_gloo(types.SimpleNamespace(_pg=torchft.process_group.ProcessGroupDummy(0, 1)),
                        torchft)


def test_the_overlapped_optimizer_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="before should_commit"):
        ft.DistributedDataParallel.overlap_optimizer(None, None)


@pytest.mark.parametrize("installed, message", [
    (None, r"needs torchft: pip install 'pyreducer\[torchft\]' \(torchft 0.2.x\)"),
    ("0.3.0", "supports torchft 0.2.x .*; found torchft 0.3.0"),
])
def test_a_missing_or_unsupported_torchft_is_named(monkeypatch, installed, message):
    def version(name):
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(ImportError, match=message):
        ft.check_torchft()
