"""pyreducer.torchft under real failures: torchft 0.2's Lighthouse on loopback, one process per
replica group (pyreducer/testing/torchft_job.py), Gloo, CPU. Against torchft's own DDP where it
can be the oracle (no failure; a replica that leaves between steps): the same parameters bit for
bit at 2 replicas, and at 3 within float rounding with pyreducer's own buckets and bit for bit
with torchft's DDP's (bucket_plan=; Gloo's ring sums each element in an order that depends on
its bucket).
Where it cannot (a replica dies during the all-reduce: torchft's DDP fails an assertion in its
hook), against the run in which that replica left before the step instead: the survivors' failed
attempt at the step is not committed, so the step is then taken exactly as in that run. Where the
schedule depends on timing (a survivor training on alone until the killed replica rejoins), against
replay(): the logged schedule recomputed in one process, bit for bit when no step sums more than
two gradients. Every run is bounded (run_job's timeout_s; the replicas' Gloo timeout, 5 s)."""
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse's per-quorum lines, in this process
pytest.importorskip("torchft", reason="torchft is not installed (pip install '.[torchft]')")

from pyreducer.testing import torchft_job as job  # noqa: E402

STEPS = 10
FAIL_STEP = 4


def _params_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _all_equal(run) -> dict:
    """Every replica's final parameters, checked equal; returns them."""
    results = run["results"]
    assert len(results) == len({e["replica"] for e in run["log"]}), run["lives"]
    first = results[0]["params"]
    for replica, result in results.items():
        assert _params_equal(result["params"], first), f"replica {replica}"
    return first


def _healed_at(run, replica) -> list[int]:
    """Steps at which `replica`'s restarted life took part without contributing (healing)."""
    return [e["step"] for e in run["log"] if e["replica"] == replica and e["attempt"] > 0
            and not e["participating"]]


@pytest.fixture(scope="module")
def left_before_quorum(tmp_path_factory):
    """Replica 2 of 3 exits before step 4's quorum and is restarted; min_replicas=3, so the
    survivors take step 4 when it has rejoined (healing): a schedule timing cannot change.
    pyreducer's wrapper has torchft's DDP's buckets (plan="torchft"): at 3 replicas the sums
    are then the same, bit for bit."""
    runs = {}
    for impl in ("pyreducer", "torchft"):
        runs[impl] = job.run_job(impl, 3, STEPS, tmp_path_factory.mktemp(f"leave_{impl}"),
                                 fail=dict(replica=2, step=FAIL_STEP, kind="leave"),
                                 plan="torchft")
    return runs


@pytest.mark.parametrize("replicas", [2, 3])
def test_without_failures_the_parameters_are_torchfts_own_ddps(tmp_path, replicas):
    """pyreducer's default buckets differ from torchft's DDP's (pyreducer/torchft.py's doc): a
    sum of two is the same in any order, so at 2 replicas the parameters are the same bit for
    bit; at 3 Gloo's ring sums each element in an order that depends on the bucket's size, so
    they agree within float rounding, and bit for bit with torchft's buckets (plan="torchft")."""
    ours = job.run_job("pyreducer", replicas, STEPS, tmp_path / "ours")
    theirs = job.run_job("torchft", replicas, STEPS, tmp_path / "theirs")
    assert all(e["committed"] for e in ours["log"]), ours["log"]
    if replicas == 2:  # the replay is an oracle too
        assert _params_equal(_all_equal(ours), _all_equal(theirs))
        assert _params_equal(_all_equal(ours), job.replay(ours["log"], STEPS))
        return
    assert 0 < _max_diff(_all_equal(ours), _all_equal(theirs)) < 1e-6
    same_buckets = job.run_job("pyreducer", replicas, STEPS, tmp_path / "same",
                               plan="torchft")
    assert _params_equal(_all_equal(same_buckets), _all_equal(theirs))


def test_no_sync_accumulation_and_the_timeline(tmp_path):
    """Two micro-batches a step, the first under no_sync(): the parameters are torchft's own
    DDP's, bit for bit (2 replicas); every bucket of the last steps is on the timeline, launched
    after it was full and done after its launch."""
    ours = job.run_job("pyreducer", 2, 6, tmp_path / "ours", accumulate=2)
    theirs = job.run_job("torchft", 2, 6, tmp_path / "theirs", accumulate=2)
    assert _params_equal(_all_equal(ours), _all_equal(theirs))
    for replica, result in ours["results"].items():
        records = result["timeline"]
        assert len(records) == 2 and all(r["buckets"] for r in records), records
        for bucket in records[-1]["buckets"]:
            assert 0 < bucket["ready_ns"] <= bucket["launch_ns"] <= bucket["done_ns"], bucket


def test_a_replica_that_leaves_before_the_quorum_heals_and_rejoins(left_before_quorum):
    ours, theirs = left_before_quorum["pyreducer"], left_before_quorum["torchft"]
    assert ours["lives"][2] == [3, 0], ours["lives"]  # killed, restarted, finished
    assert _healed_at(ours, 2) and min(_healed_at(ours, 2)) == FAIL_STEP, ours["log"]
    assert not ours["results"][0]["failed_steps"]  # no all-reduce failed: it left between steps
    assert _params_equal(_all_equal(ours), _all_equal(theirs))
    # three gradients summed at most steps: the replay agrees within float rounding
    assert _max_diff(_all_equal(ours), job.replay(ours["log"], STEPS)) < 1e-6


@pytest.mark.parametrize("kind", ["exit", "sigkill"])
def test_a_replica_killed_during_the_all_reduce(tmp_path, left_before_quorum, kind):
    """os._exit / SIGKILL from replica 2's first-layer gradient hook at step 4, with the other
    buckets' all-reduces in flight: the survivors' attempt at step 4 fails, is reported to the
    Manager and not committed; they go on with the next quorum, without a restart, and the
    restarted replica heals and rejoins. The result is the run in which replica 2 left before
    step 4, bit for bit."""
    run = job.run_job("pyreducer", 3, STEPS, tmp_path, plan="torchft",
                      fail=dict(replica=2, step=FAIL_STEP, kind=kind))
    assert run["lives"][2][0] == (3 if kind == "exit" else -9), run["lives"]
    for survivor in (0, 1):
        failed = run["results"][survivor]["failed_steps"]
        assert [f["step"] for f in failed] == [FAIL_STEP], failed
        assert "all-reduce of bucket" in failed[0]["error"], failed
        attempts = [e["committed"] for e in run["log"]
                    if e["replica"] == survivor and e["step"] == FAIL_STEP]
        assert attempts[0] is False and attempts[-1] is True, attempts
        assert run["lives"][survivor] == [0]  # never restarted
    assert min(_healed_at(run, 2)) == FAIL_STEP, run["log"]
    expected = _all_equal(left_before_quorum["pyreducer"])
    assert _params_equal(_all_equal(run), expected)


def test_a_survivor_trains_on_alone_until_the_killed_replica_rejoins(tmp_path):
    """min_replicas=1: the survivor does not wait for the restart. Its failed step 4 is taken
    again alone; the restarted replica heals from it at whichever step it rejoins (the survivor
    trains on slowly until then, past STEPS if need be: await_rejoin). The schedule depends on
    timing, so the oracle is its replay (at most two gradients a step: exact)."""
    run = job.run_job("pyreducer", 2, STEPS, tmp_path, min_replicas=1, await_rejoin=0.2,
                      fail=dict(replica=1, step=FAIL_STEP, kind="sigkill"))
    assert run["lives"] == {0: [0], 1: [-9, 0]}, run["lives"]
    assert [f["step"] for f in run["results"][0]["failed_steps"]] == [FAIL_STEP]
    alone = [e for e in run["log"] if e["replica"] == 0 and e["step"] == FAIL_STEP
             and e["committed"]]
    assert alone, run["log"]
    assert any(e["replica"] == 1 and e["attempt"] == 1 and e["committed"] and e["participating"]
               for e in run["log"]), run["log"]  # the restarted replica trained with it again
    assert _params_equal(_all_equal(run), job.replay(run["log"]))


def test_a_stalled_replica_is_dropped_never_a_hang(tmp_path):
    """Replica 1 stops itself (SIGSTOP) during step 4's all-reduce: the survivor's all-reduce
    fails at the Gloo timeout (5 s), the Lighthouse drops the silent replica (heartbeat timeout
    2 s), and the survivor finishes alone; the job then kills the stopped process."""
    # (together: with min_replicas=1, a replica started late under load would join after step
    # FAIL_STEP, and the survivor would have no failed attempt to show)
    run = job.run_job("pyreducer", 2, STEPS, tmp_path, min_replicas=1, start_together=True,
                      fail=dict(replica=1, step=FAIL_STEP, kind="sigstop"))
    survivor = [e for e in run["log"] if e["replica"] == 0]
    assert [e["step"] for e in survivor if e["committed"]] == list(range(STEPS)), survivor
    stalled = [e for e in survivor if e["step"] == FAIL_STEP and not e["committed"]]
    assert len(stalled) == 1 and stalled[0]["end"] - stalled[0]["start"] < job.DEFAULTS[
        "pg_timeout_s"] + 3, stalled
    assert [f["step"] for f in run["results"][0]["failed_steps"]] == [FAIL_STEP]
    assert _params_equal(run["results"][0]["params"], job.replay(run["log"], STEPS))


GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "docs", "pages", "guides", "fault-tolerance.md")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_the_guides_script_runs_with_its_commands(tmp_path):
    """docs/pages/guides/fault-tolerance.md's train_ft.py, run as the page says: the
    torchft_lighthouse command, then one torchrun per replica group (its own master port); both
    groups end at step 200 with the same parameters."""
    from pyreducer.testing import docs_code, subprocess_env

    block = [b for b in docs_code.blocks(GUIDE, os.path.dirname(GUIDE))
             if b["kind"] == "not-run" and "test_torchft.py" in b["label"]]
    assert len(block) == 1, block
    (tmp_path / "train_ft.py").write_text(block[0]["code"])
    lighthouse_port = _free_port()
    lighthouse = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse"), "--min_replicas",
         "2", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000", "--bind",
         f"[::]:{lighthouse_port}"], stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "lighthouse.log", "w"))
    env = subprocess_env(TORCHFT_LIGHTHOUSE=f"http://localhost:{lighthouse_port}",
                         OMP_NUM_THREADS="1")
    logs = [tmp_path / f"group{g}.log" for g in range(2)]
    groups = []
    try:
        for g in range(2):
            with open(logs[g], "w") as sink:
                groups.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
                     f"--master-port={_free_port()}", "--max-restarts=3", "train_ft.py"],
                    cwd=tmp_path, env=dict(env, REPLICA_GROUP_ID=str(g)), stdout=sink,
                    stderr=subprocess.STDOUT))
        for group, log in zip(groups, logs):
            try:
                group.wait(timeout=100)
            except subprocess.TimeoutExpired:
                tails = "\n".join(f"--- {other.name}:\n{other.read_text()[-3000:]}"
                                  for other in logs)
                pytest.fail(f"{log.name} still running after 100 s (the Lighthouse's log: "
                            f"{tmp_path / 'lighthouse.log'}):\n{tails}")
    finally:
        for process in [lighthouse] + groups:
            process.kill()
            process.wait()
    outputs = [log.read_text() for log in logs]
    finals = [re.findall(r"group (\d) step (\d+) params (\S+)", out) for out in outputs]
    assert all(len(f) == 1 for f in finals), outputs
    assert [f[0][1] for f in finals] == ["200", "200"], finals
    assert finals[0][0][2] == finals[1][0][2], (finals, outputs)


def dropped_worker(rank, world_size):
    """A dropped torchft wrapper is freed (its QuorumHook holds its error sink weakly), and its
    module can be wrapped again and trained."""
    import gc
    import weakref
    from datetime import timedelta

    import torchft
    from torch import nn

    from pyreducer import DistributedDataParallel as PlainDDP
    from pyreducer.torchft import DistributedDataParallel

    # A Manager as far as the wrapper's construction reads one (its class and its Gloo group);
    # a real one needs a Lighthouse, and construction runs no collective.
    manager = torchft.Manager.__new__(torchft.Manager)
    manager._pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=5))
    module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    ref = weakref.ref(DistributedDataParallel(manager, module, bucket_cap_mb=0.0001))
    gc.collect()
    freed = ref() is None
    again = PlainDDP(module)  # the old wrapper's gradient hooks would refuse this backward
    again(torch.randn(4, 8)).sum().backward()
    return dict(freed=freed, trained=all(p.grad is not None for p in module.parameters()))


def test_a_dropped_wrapper_is_freed_and_its_module_rewrapped():
    from pyreducer.testing import run_ranks

    assert run_ranks(dropped_worker, 1, timeout_s=120) == [dict(freed=True, trained=True)]


def test_a_backward_without_a_quorum_of_its_own_is_refused_before_any_all_reduce(tmp_path):
    """Before the first start_quorum() and after the last should_commit(), a forward with grad
    on (an evaluation) runs, and its backward raises, naming the replica (Note [One quorum, one
    backward]); the steps between match torchft's own DDP's, bit for bit; after the last
    backward the wrapper no longer holds its quorum's process group."""
    ours = job.run_job("pyreducer", 2, 4, tmp_path / "ours", edges=True)
    theirs = job.run_job("torchft", 2, 4, tmp_path / "theirs")
    for replica, result in ours["results"].items():
        edges = result["edges"]
        assert edges["before_quorum"]["forward"] is None, edges
        assert "no quorum started" in edges["before_quorum"]["backward"], edges
        assert f"replica replica_{replica}" in edges["before_quorum"]["backward"], edges
        assert edges["holds_group"] is False, edges  # let go when the backward ended
        assert edges["after_commit"]["forward"] is None, edges
        assert "after should_commit() judged step 3's quorum" in \
            edges["after_commit"]["backward"], edges
    assert _params_equal(_all_equal(ours), _all_equal(theirs))


def test_parameters_off_the_cpu_are_refused_at_construction():
    """torchft's ProcessGroupGloo takes CPU tensors: a module elsewhere (here on the meta
    device, standing in for CUDA) is refused by parameter name."""
    from datetime import timedelta

    import torchft
    from torch import nn

    from pyreducer.torchft import DistributedDataParallel

    manager = torchft.Manager.__new__(torchft.Manager)  # as far as construction reads one
    manager._pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=5))
    with pytest.raises(ValueError, match=r"parameter 0\.weight is on meta"):
        DistributedDataParallel(manager, nn.Sequential(nn.Linear(4, 4, device="meta")))
