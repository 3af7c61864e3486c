"""The commands as a user runs them, in subprocesses: PYREDUCER_TRACE on a plain training script
under torchrun (no pyreducer code in the script beyond the import), then `report`; the demo,
whose step profile `simulate` must accept."""
import json
import subprocess
import sys

import pytest

from pyreducer.testing import subprocess_env

SCRIPT = """
import torch
import torch.distributed as dist

from pyreducer import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
    torch.nn.Linear(256, 4)), bucket_cap_mb=0.1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(dist.get_rank())
for step in range(STEPS):
    opt.zero_grad()
    model(torch.randn(8, 16, generator=gen)).square().mean().backward()
    opt.step()
with torch.no_grad():  # an evaluation forward: not a recorded iteration
    model(torch.randn(8, 16, generator=gen))
dist.barrier()  # all ranks done before Gloo is torn down (torch 2.13 can abort at exit otherwise)
dist.destroy_process_group()
"""
STEPS = 6


def _env(**extra):
    """The environment of a user's shell, with the pyreducer this test imported on the path."""
    return subprocess_env(OMP_NUM_THREADS="1", **extra)


def _run(args, cwd, timeout_s=240, **env):
    result = subprocess.run([sys.executable] + args, capture_output=True, text=True,
                            timeout=timeout_s, cwd=str(cwd), env=_env(**env))
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """train.py under torchrun with PYREDUCER_TRACE=out, then `report out`."""
    tmp = tmp_path_factory.mktemp("traced")
    (tmp / "train.py").write_text(SCRIPT.replace("STEPS", str(STEPS)))
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"],
         tmp, PYREDUCER_TRACE="out")
    report = _run(["-m", "pyreducer", "report", "out"], tmp)
    return tmp / "out", report.stdout


def test_every_rank_writes_its_file_at_exit(traced):
    out, _ = traced
    for rank in (0, 1):
        data = json.loads((out / f"rank{rank}.json").read_text())
        assert data["format"] == "pyreducer.rank_trace" and data["rank"] == rank
        assert data["world_size"] == 2
        assert [r["iteration"] for r in data["timeline"]] == list(range(1, STEPS + 1))
        assert data["profile"]["forward_ms"] > 0 and data["profile"]["optimizer_ms"] > 0
        assert len(data["profile"]["ready_ms"]) == 6  # 3 layers x (weight, bias)
    assert json.loads((out / "rank0.json").read_text())["clock_offset_ns"] == 0


def test_report_merges_the_ranks(traced):
    out, stdout = traced
    assert "overlap of bucket all-reduces" in stdout
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    for rank in (0, 1):
        compute = [e for e in events if e["pid"] == rank and e.get("cat") == "compute"]
        assert len(compute) == STEPS
    timelines = json.loads((out / "timeline.json").read_text())
    assert len(timelines) == 2 and max(len(r["buckets"]) for r in timelines[0]) > 1
    for name in ("gantt.png", "overlap.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    profile = json.loads((out / "profile.json").read_text())
    assert profile == json.loads((out / "rank0.json").read_text())["profile"]


def test_simulate_reads_the_reported_profile(traced, tmp_path):
    out, _ = traced
    _run(["-m", "pyreducer", "simulate", "--profile", str(out), "--ranks", "2,8",
          "--link", "1gbit", "--out", str(tmp_path / "sim.png")], tmp_path)
    rows = json.loads((tmp_path / "sim.json").read_text())
    assert [r["ranks"] for r in rows] == [2, 8]


def test_demo_writes_a_profile_that_simulate_accepts(tmp_path):
    result = _run(["-m", "pyreducer", "demo", "--steps", "3", "--out", "demo"], tmp_path,
                  timeout_s=300)
    assert "parity:" in result.stdout and "PASS" in result.stdout
    assert (tmp_path / "demo" / "profile.json").is_file()
    _run(["-m", "pyreducer", "simulate", "--profile", "demo", "--ranks", "2,64",
          "--link", "10gbit"], tmp_path)
    assert (tmp_path / "demo" / "simulate.png").is_file()


def two_wrappers_worker(rank, world_size):
    """Under PYREDUCER_TRACE: a wrapper trained and freed, then a second one in its place."""
    import gc

    import torch

    from pyreducer import DistributedDataParallel
    from pyreducer.observe import recorder

    def train(bucket_cap_mb):
        model = DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)),
            bucket_cap_mb=bucket_cap_mb)
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
        return model

    model = train(None)
    del model
    gc.collect()  # its recorder writes now, when the wrapper is freed
    kept = train(0.001)
    return recorder.write_all(), len(kept.bucket_plan())


def test_each_wrapper_gets_its_own_rank_files(tmp_path):
    from pyreducer.observe.report import load_rank_files
    from pyreducer.testing import run_ranks

    results = run_ranks(two_wrappers_worker, 2, timeout_s=120,
                        env={"PYREDUCER_TRACE": str(tmp_path)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank0.json", "rank0.model1.json", "rank1.json", "rank1.model1.json"]
    first, second = load_rank_files(tmp_path, 0), load_rank_files(tmp_path, 1)
    assert first[0]["run_id"] != second[0]["run_id"]  # one id per traced wrapper
    assert max(len(r["buckets"]) for r in first[0]["timeline"]) == 1  # default caps: one bucket
    assert max(len(r["buckets"]) for r in second[0]["timeline"]) == results[0][1] > 1
