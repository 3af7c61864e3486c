"""benchmarks/bench_gpu.py rehearsed on the CPU (`--smoke`: toy models, Gloo, CPU kernels): the
logic of the GPU benchmark (plan, budget, paired timing of pyreducer against torch DDP, loss
check, kernel bandwidth, report) runs here; only its CUDA calls do not. A tiny budget skips
every case with "time budget" instead of failing; what a budget admits is checked on a fake
clock. Nothing here asserts speed: how long a case takes is the benchmark's to report, and on a
loaded machine a wall-clock budget would skip cases that run in seconds alone."""
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
# Hang guards, not speed limits: the smoke run takes ~7 s alone, 30 s to 3 minutes beside six
# busy loops on 2 cores (and other test runs). NO_BUDGET_S is a budget no estimate reaches here,
# so every case runs however slow the machine is (skipping cases under load is the benchmark's
# behaviour: tested with a tiny budget, and on a fake clock below).
RUN_TIMEOUT_S = 600
NO_BUDGET_S = "86400"


def _bench(tmp_path, *args) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, SCRIPT, "--smoke", "--json", str(out),
                             "--markdown", str(tmp_path / "bench.md"), *args],
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                            cwd=str(tmp_path), env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return _bench(tmp_path_factory.mktemp("smoke"), "--steps", "2", "--warmup", "1",
                  "--budget-s", NO_BUDGET_S)


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
                            timeout=RUN_TIMEOUT_S, env=subprocess_env())
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


def test_a_budget_runs_the_cases_that_fit_and_learns_from_slow_ones(tmp_path, monkeypatch):
    """run_group on a fake clock: cases run in priority order while start-up + their estimates
    fit in what is left, the rest are skipped with "time budget"; cases measured at 3 x their
    guess make later estimates 3 x theirs; ranks are killed after 3 x the group's estimate, but
    never sooner than MIN_GROUP_TIMEOUT_S, nor later than the budget's end."""
    from types import SimpleNamespace

    import torch

    from benchmarks import bench_gpu

    clock, calls = [0.0], []
    monkeypatch.setattr(bench_gpu, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    def fake_run_ranks(fn, world_size, args, timeout_s, **kwargs):
        config = args[0]
        calls.append(dict(cases=config["cases"], timeout_s=timeout_s))
        for model, precision in config["cases"]:
            clock[0] += 30.0  # each case: 3 x its guess of 10 s
            for rank in range(world_size):
                torch.save(dict(seconds={"torch": [0.1, 0.1], "pyreducer": [0.1, 0.1]},
                                check=[], params=1, batch="b", peak_memory_gib=None,
                                duration_s=30.0),
                           os.path.join(config["out_dir"], f"{model}-{precision}.rank{rank}.pt"))
        clock[0] += 20.0  # start-up: 2 x its guess
        return [len(config["cases"])] * world_size

    monkeypatch.setattr(bench_gpu, "run_ranks", fake_run_ranks)

    def group(world_size, cases):
        return dict(setting=f"ws{world_size}", backend="gloo", world_size=world_size,
                    label=f"ws{world_size}", startup_kind=f"start-up ws{world_size}",
                    startup_default_s=10.0,
                    cases=[dict(model=m, precision=p, label=f"ws{world_size} {m} {p}",
                                kind=f"{m} ws{world_size}", default_s=10.0) for m, p in cases])

    budget = bench_gpu.Budget(200.0)
    report = dict(cases=[], skipped=[])
    args = SimpleNamespace(smoke=True, steps=2, warmup=1)
    bench_gpu.run_group(group(1, [("gpt2", "fp32"), ("resnet50", "fp32")]), args, budget, report)
    # estimate 10 + 2 x 10 s: all run; 3 x 30 s is below the floor
    assert calls[0] == dict(cases=[("gpt2", "fp32"), ("resnet50", "fp32")],
                            timeout_s=bench_gpu.MIN_GROUP_TIMEOUT_S)
    assert budget.scale == 3.0 and budget.left_s() == 120.0
    four = [(m, p) for m in MODELS for p in PRECISIONS]
    bench_gpu.run_group(group(2, four), args, budget, report)
    # now 30 s each (start-up included): 30 + 3 x 30 fits the 120 s left, a fourth does not
    assert calls[1] == dict(cases=four[:3], timeout_s=120.0)  # 3 x 120 s: the budget's end
    assert report["skipped"] == [dict(label="ws2 resnet50 bf16", reason="time budget",
                                      estimate_s=150.0, left_s=120.0)]
    assert [(c["setting"], c["model"], c["precision"]) for c in report["cases"]] == \
        [("ws1", "gpt2", "fp32"), ("ws1", "resnet50", "fp32")] + [("ws2", m, p)
                                                                  for m, p in four[:3]]
    assert all("error" not in c for c in report["cases"]), report["cases"]
