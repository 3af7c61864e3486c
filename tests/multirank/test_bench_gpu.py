"""benchmarks/bench_gpu.py rehearsed on the CPU (`--smoke`: toy models, Gloo, CPU kernels): the
logic of the GPU benchmark (plan, budget, paired timing of pyreducer against torch DDP, loss
check, kernel bandwidth, report) runs here; only its CUDA calls do not. A tiny budget skips
every case with "time budget" instead of failing."""
import json
import math
import os
import subprocess
import sys

import pytest

from pyreducer.testing import subprocess_env

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "benchmarks", "bench_gpu.py")
SETTINGS = ("gloo ws1 cpu", "gloo ws2 cpu")
MODELS = ("gpt2", "resnet50")
PRECISIONS = ("fp32", "bf16")


def _bench(tmp_path, *args) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, SCRIPT, "--smoke", "--json", str(out),
                             "--markdown", str(tmp_path / "bench.md"), *args],
                            capture_output=True, text=True, timeout=150, cwd=str(tmp_path),
                            env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return _bench(tmp_path_factory.mktemp("smoke"), "--steps", "2", "--warmup", "1",
                  "--budget-s", "120")


def test_every_step_case_runs_with_agreeing_results(smoke):
    report, _ = smoke
    assert report["skipped"] == [], report["skipped"]
    cases = {(c["setting"], c["model"], c["precision"]): c for c in report["cases"]}
    expected = {(s, m, p) for s in SETTINGS for m in MODELS for p in PRECISIONS}
    assert set(cases) == expected, sorted(cases)
    for key, case in cases.items():
        assert "error" not in case, (key, case.get("error"))
        for wrapper in ("torch", "pyreducer"):
            median_ms = case[wrapper]["median_ms"]
            assert math.isfinite(median_ms) and median_ms > 0, (key, wrapper, case[wrapper])
            assert case[wrapper]["n"] == 2
        assert case["ratio"] == case["pyreducer"]["median_ms"] / case["torch"]["median_ms"]
        world_size = 2 if "ws2" in key[0] else 1
        assert len(case["check"]) == world_size  # one loss check per rank
        assert all(c["passed"] and c["close"] for c in case["check"]), case["check"]
        assert case["params"] > 0


def test_kernel_bandwidth_is_measured_for_both_models(smoke):
    report, _ = smoke
    assert report["kernel_errors"] == []
    entries = {(k["model"], k["bucket"]): k for k in report["kernels"]}
    assert {m for m, _ in entries} == set(MODELS)
    assert {b for _, b in entries} == {"first 16 KiB", "whole model"}
    for key, k in entries.items():
        assert k["moved_bytes"] == 2 * k["bucket_bytes"] > 0, key
        for name in ("copy_in", "copy_out", "copy"):
            assert math.isfinite(k[f"{name}_gbps"]) and k[f"{name}_gbps"] > 0, (key, name)
        assert k["copy_in_ratio"] == k["copy_in_gbps"] / k["copy_gbps"]


def test_report_states_environment_and_table(smoke):
    report, stdout = smoke
    assert report["environment"]["smoke"] is True
    assert {"torch", "python", "cores", "optimizer"} <= set(report["environment"])
    assert "| gloo ws2 cpu | resnet50 | bf16 |" in stdout  # the markdown table at the end
    assert "copy_in GB/s (ratio)" in stdout


def test_a_tiny_budget_skips_cases_instead_of_failing(tmp_path):
    report, stdout = _bench(tmp_path, "--steps", "2", "--warmup", "1", "--budget-s", "1")
    assert report["cases"] == [] and report["kernels"] == []
    labels = [s["label"] for s in report["skipped"]]
    assert len(labels) == 2 + len(SETTINGS) * len(MODELS) * len(PRECISIONS), labels
    assert {s["reason"] for s in report["skipped"]} == {"time budget"}
    assert "skipped: gloo ws2 cpu gpt2 bf16 (time budget)" in stdout


def test_without_a_gpu_it_says_so_and_points_to_the_rehearsal():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run")
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True,
                            timeout=60, env=subprocess_env())
    assert result.returncode != 0
    assert "no GPU visible: nothing to benchmark; use --smoke" in result.stderr


def test_a_failure_keeps_the_cases_finished_before_it(tmp_path):
    """Ranks save each finished case at once: after a failure in the second case the first is
    still reported, the failed one carries the error, the one after it did not run."""
    import torch

    from benchmarks import bench_gpu

    for rank in range(2):
        torch.save(dict(seconds={"torch": [0.002, 0.004], "pyreducer": [0.003, 0.003 + rank]},
                        check=[], params=10, batch="b", peak_memory_gib=None, duration_s=1.5),
                   tmp_path / f"gpt2-fp32.rank{rank}.pt")
    torch.save({}, tmp_path / "gpt2-bf16.rank0.pt")  # rank 1 never finished gpt2 bf16
    cases = [dict(model="gpt2", precision="fp32"), dict(model="gpt2", precision="bf16"),
             dict(model="resnet50", precision="fp32")]
    first, second, third = bench_gpu.collect_group(dict(setting="s", world_size=2), cases,
                                                   str(tmp_path), "RankError: rank 1", steps=2)
    assert first["torch"]["median_ms"] == pytest.approx(3.0)
    assert first["pyreducer"]["median_ms"] == pytest.approx((3.0 + 1003.0) / 2)  # slowest rank
    assert second == dict(setting="s", model="gpt2", precision="bf16", error="RankError: rank 1")
    assert third["error"].startswith("not run")
