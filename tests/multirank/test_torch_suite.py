"""torch's own DDP tests (torch/testing/_internal/distributed/distributed_test.py) with pyreducer
swapped in for DistributedDataParallel, at 2 and 3 Gloo ranks (pyreducer/testing/torch_suite.py
runs them; docs/pages/development.md lists what runs and what skips, and why).

Every test of the module that reaches DistributedDataParallel is run; those needing CUDA skip
themselves, with torch's reason. Every test that runs on the CPU must pass, and the ones known to
run here must have run (a test that started skipping would otherwise go unnoticed).
"""
import json
import subprocess
import sys

import pytest

from pyreducer.testing import subprocess_env

# The DDP tests of torch's module that run on CPU with Gloo (the others need GPUs): the same
# 11 in torch 2.11, 2.13 and 2.15.
RUN_ON_CPU = ["test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view",
              "test_DistributedDataParallel_requires_grad", "test_accumulate_gradients_no_sync",
              "test_accumulate_gradients_no_sync_allreduce_hook",
              "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
              "test_accumulate_gradients_no_sync_grad_is_view", "test_ddp_create_graph",
              "test_ddp_logging_data_cpu", "test_grads_same_across_ranks_with_no_sync",
              "test_static_graph_api_cpu"]
# Reasons torch's own decorators give for skipping (no GPU: "CUDA", from torch 2.15 "accelerator";
# tests torch itself disabled; the last two in torch 2.11's module).
TORCH_SKIPS = ("CUDA", "accelerator", "github.com/pytorch/pytorch", "flakiness",
               "NVIDIA internal CI", "nccl metadata")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"{ws}ranks")
def suite(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_suite") / "outcomes.json"
    env = subprocess_env()
    env.pop("PYREDUCER_TRACE", None)
    result = subprocess.run(
        [sys.executable, "-m", "pyreducer.testing.torch_suite", "--world-size",
         str(request.param), "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(out.parent))
    print(result.stdout)  # the per-test list, shown with pytest -s or on failure
    assert out.exists(), result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(out.read_text()), result


def test_every_cpu_test_passes(suite):
    outcomes, result = suite
    bad = {name: o["detail"][-1500:] for name, o in outcomes.items()
           if o["outcome"] in ("failed", "error")}
    assert not bad, bad
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_known_cpu_tests_ran(suite):
    outcomes, _ = suite
    assert len(outcomes) > 90  # the selection found torch's DDP tests
    assert {name: outcomes.get(name, {}).get("outcome") for name in RUN_ON_CPU} == \
        {name: "passed" for name in RUN_ON_CPU}


def test_only_torchs_own_skips(suite):
    outcomes, _ = suite
    reasons = {o["detail"] for o in outcomes.values() if o["outcome"] == "skipped"}
    assert all(any(word in reason for word in TORCH_SKIPS) for reason in reasons), reasons
