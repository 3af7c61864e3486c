"""The GPU kit's runner without a GPU (tests/gpu/run_kit.py, kit_plugin.py, kit_report.py,
gpu_kit.py): its deadline skips what it does not reach, with the reason; the rehearsal's plan
sees skip marks; the report counts what pytest wrote; a failing rank run is run once for all
the tests that read it. `make gpu-rehearsal` runs the whole runner up to its first CUDA call."""
import json
import os
import subprocess
import sys
import time

import pytest

GPU_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu")
sys.path.insert(0, GPU_TESTS)

import gpu_kit  # noqa: E402
import kit_report  # noqa: E402
from kit_plugin import NOT_REACHED  # noqa: E402

SAMPLE = '''
import pytest

def test_a():
    assert True

def test_b():
    assert 1 == 2, "one is not two"

@pytest.mark.skipif(True, reason="2 GPUs needed (NCCL takes one per rank), 1 visible")
def test_c():
    pass

@pytest.mark.skipif(False, reason="never")
def test_d():
    pass
'''


def _pytest(tmp_path, *args, **env):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "kit_plugin", "-q",
         str(tmp_path / "test_sample.py"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=GPU_TESTS, **{k: str(v) for k, v in env.items()}))


def test_the_report_counts_what_pytest_wrote(tmp_path):
    junit = tmp_path / "junit.xml"
    _pytest(tmp_path, "--junitxml", str(junit))
    outcome = kit_report.read_junit(str(junit))
    assert kit_report.counts(outcome) == {"passed": 2, "failed": 1, "skipped": 1}
    assert outcome["failed"][0]["id"].endswith("::test_b")
    assert "one is not two" in outcome["failed"][0]["message"]
    assert list(outcome["skipped"]) == ["2 GPUs needed (NCCL takes one per rank), 1 visible"]
    report = {"label": "x", "rehearse": False, "facts": {"date": "today", "torch": "2.11"},
              "steps": [dict(name="build", result="ok", seconds=3.0)], "tests": outcome}
    summary = kit_report.summary_markdown(report)
    assert "2 passed, 1 failed, 1 not run" in summary and "test_b" in summary
    assert "- 1: 2 GPUs needed" in summary


def test_tests_after_the_deadline_are_reported_as_not_reached(tmp_path):
    junit = tmp_path / "junit.xml"
    _pytest(tmp_path, "--junitxml", str(junit), PYREDUCER_KIT_DEADLINE=time.time() - 1)
    outcome = kit_report.read_junit(str(junit))
    assert kit_report.counts(outcome) == {"passed": 0, "failed": 0, "skipped": 4}
    assert len(outcome["skipped"][NOT_REACHED]) == 3  # test_c keeps its own reason


def test_the_plan_sees_skip_marks_without_running(tmp_path):
    plan_path = tmp_path / "plan.json"
    result = _pytest(tmp_path, "--collect-only", PYREDUCER_KIT_PLAN=plan_path)
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads(plan_path.read_text())
    assert [nodeid.split("::")[1] for nodeid in plan["run"]] == ["test_a", "test_b", "test_d"]
    assert list(plan["skip"]) == ["2 GPUs needed (NCCL takes one per rank), 1 visible"]


def test_a_failing_rank_run_runs_once_for_every_test_that_reads_it(monkeypatch):
    calls = []

    def failing(fn, world_size, **kwargs):
        calls.append((fn, world_size, kwargs["backend"]))
        raise RuntimeError("rank 1 of 2 failed first")

    def worker(rank, world_size):
        return rank

    monkeypatch.setattr(gpu_kit, "run_ranks", failing)
    monkeypatch.setattr(gpu_kit, "_RUNS", {})
    for _ in range(3):
        with pytest.raises(RuntimeError, match="worker on gloo x 2 failed .*rank 1 of 2"):
            gpu_kit.ranks(worker, ("gloo", 2))
    assert calls == [(worker, 2, "gloo")]


def test_settings_need_one_gpu_for_gloo_and_one_per_rank_for_nccl():
    marks = {p.id: p.marks[0] for p in gpu_kit.MULTI}
    assert set(marks) == {"gloo2", "gloo3", "nccl2", "nccl3"}
    if gpu_kit.GPUS == 0:  # here: every setting is skipped, with the reason
        assert all(mark.args[0] for mark in marks.values())
        assert "no GPU" in marks["gloo2"].kwargs["reason"]


def test_a_silent_step_is_killed_at_its_timeout(tmp_path):
    import argparse

    import run_kit

    kit = run_kit.Kit(argparse.Namespace(out=str(tmp_path), label="", rehearse=False))
    started = time.monotonic()
    status = kit.run([sys.executable, "-c", "import time; print('started', flush=True); "
                      "time.sleep(60)"], "build.log", timeout_s=2)
    assert status == -9 and time.monotonic() - started < 20
    assert (tmp_path / "build.log").read_text() == "started\n"
    assert kit.run([sys.executable, "-c", "raise SystemExit(3)"], "build.log") == 3
    assert "killed after 2 s" in (tmp_path / "kit.log").read_text()
