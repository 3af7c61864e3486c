"""Faults (issue 15): a peer killed during construction, forward, backward (mid all-reduce) or
finalize (waiting for the reductions), or frozen (SIGSTOP) mid-backward. The surviving rank raises within the process group's timeout
(plus pyreducer.wrapper.failures.REPORT_WINDOW_S to name the lost ranks), naming the phase and the
rank it lost; after destroy_process_group no pyreducer thread or child process is left, and a script
that does not catch the error exits with its traceback (exit code 1), not an abort. Under the
built-in C++ hooks a bucket whose all-reduce failed is an error too, never a gradient left
unreduced."""
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pyreducer.testing import run_ranks, subprocess_env, wait_for_exit
from pyreducer.wrapper.failures import REPORT_WINDOW_S

PG_TIMEOUT_S = 8


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64),
                         nn.ReLU(), nn.Linear(64, 4))


def _threads():
    return len(os.listdir("/proc/self/task"))


def _children():
    return [c for t in os.listdir("/proc/self/task")
            for c in open(f"/proc/self/task/{t}/children").read().split()]


def _step(model, pause_s=0.0):
    loss = model(torch.randn(8, 16)).square().mean()
    time.sleep(pause_s)  # between the forward's collectives and the backward's
    loss.backward()


def fault_worker(rank, world_size, phase):
    """Rank 1 dies (or freezes) in `phase`; rank 0 returns its error, how long it took, and its
    threads and children before the wrapper and after the failure was cleaned up."""
    from pyreducer import DistributedDataParallel

    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    threads_before = _threads()
    victim = rank == 1
    if phase == "construction" and victim:
        os._exit(3)
    if phase == "construction":
        wait_for_exit(pids[1])  # the wrapper is built after the peer is gone
    start = time.monotonic()
    error = None
    try:
        model = DistributedDataParallel(_model(), bucket_cap_mb=0.005)
        for step in range(1, 4):
            if phase == "forward" and step == 3:
                if victim:
                    os._exit(3)
                wait_for_exit(pids[1])  # the forward below starts after the peer is gone
            if phase in ("backward", "frozen") and victim and step == 3:
                def leave(grad):
                    if phase == "frozen":
                        os.kill(os.getpid(), signal.SIGSTOP)
                    os._exit(3)
                model.module[3].weight.register_hook(leave)  # mid-backward: buckets in flight
            pause_s = 0.0
            if phase == "finalize" and step == 3:
                # rank 1 finishes its backward's compute at once and waits in finalize for the
                # reductions rank 0 has not launched yet; it dies there
                if victim:
                    threading.Timer(0.5, os._exit, (3,)).start()
                else:
                    pause_s = 1.5
            start = time.monotonic()
            _step(model, pause_s)
    except RuntimeError as caught:
        error = str(caught)
    seconds = time.monotonic() - start
    if phase == "frozen":
        os.kill(pids[1], signal.SIGKILL)  # the test's own cleanup of the frozen peer
    model = None
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
    return dict(error=error, seconds=seconds, threads=(threads_before, _threads()),
                children=_children())


@pytest.mark.parametrize("phase, where", [
    ("construction", "phase: construction"),
    ("forward", "phase: forward of iteration 3"),
    ("backward", "phase: backward of iteration 3"),
    ("finalize", "phase: backward of iteration 3"),
    ("frozen", "phase: backward of iteration 3")])
def test_survivor_names_the_lost_rank_and_the_phase(phase, where):
    result = run_ranks(fault_worker, 2, (phase,), timeout_s=90, pg_timeout_s=PG_TIMEOUT_S,
                       may_die=(1,))[0]
    error = result["error"]
    assert error is not None and f"[{where}; lost rank(s) 1 of 2: no report within" in error, \
        error
    assert "failed on rank 0 of 2" in error, error
    assert result["seconds"] < PG_TIMEOUT_S + REPORT_WINDOW_S + 3, result["seconds"]
    before, after = result["threads"]
    assert after <= before, f"threads before the wrapper {before}, after the cleanup {after}"
    assert result["children"] == []


SCRIPT = """
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
from pyreducer import DistributedDataParallel
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
                        timeout=timedelta(seconds=%d))
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                                    torch.nn.Linear(64, 4)), bucket_cap_mb=0.001)
for step in range(4):
    if rank == 1 and step == 2:
        model.module[0].weight.register_hook(lambda grad: os._exit(3))
    model(torch.randn(8, 16)).sum().backward()
print("not reached", flush=True)
""" % PG_TIMEOUT_S


def test_an_uncaught_failure_exits_with_its_traceback(tmp_path):
    """A plain script (no os._exit, no try): the survivor ends with exit code 1 and the error on
    stderr, within the timeout; no abort at interpreter exit (pyreducer/wrapper/teardown.py)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = subprocess_env(OMP_NUM_THREADS="1")
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), store], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    out, err = procs[0].communicate(timeout=60)
    procs[1].wait(timeout=30)
    assert procs[1].returncode == 3
    assert procs[0].returncode == 1, (procs[0].returncode, err[-3000:])
    assert "not reached" not in out
    assert "phase: backward of iteration 3; lost rank(s) 1 of 2" in err, err[-3000:]


def report_names_worker(rank, world_size):
    """Failure reports are keyed by the wrapper's name: a copy made on rank 0 alone and a
    wrapper on a subgroup of ranks 0 and 1 must not change the name of the next world wrapper
    on some ranks only (the ranks would then look for each other's reports under other keys,
    and name live ranks lost)."""
    import copy

    from pyreducer import DistributedDataParallel

    first = DistributedDataParallel(nn.Linear(4, 2))
    names = dict(first=first._failures.wrapper)
    if rank == 0:
        names["copy"] = copy.deepcopy(first)._failures.wrapper  # not collective
    subgroup = dist.new_group([0, 1])  # every rank creates it
    if rank in (0, 1):
        names["subgroup"] = DistributedDataParallel(nn.Linear(4, 2),
                                                    process_group=subgroup)._failures.wrapper
    names["next"] = DistributedDataParallel(nn.Linear(4, 2))._failures.wrapper
    return names


def test_report_names_agree_across_ranks_after_copies_and_subgroups():
    names = run_ranks(report_names_worker, 3, (), timeout_s=120)
    assert names[0]["copy"].startswith("copy")
    assert names[0]["subgroup"] == names[1]["subgroup"]
    assert len({n["next"] for n in names}) == 1 and len({n["first"] for n in names}) == 1, names


def hooked_fault_worker(rank, world_size, hook):
    """Rank 1 dies mid-backward under a built-in C++ hook (compression, or the averaging hook
    that reduce_dtype installs); rank 0 returns its error, or None if backward returned."""
    from pyreducer import DistributedDataParallel

    options = dict(reduce_dtype=torch.float64) if hook == "averaging" else {}
    model = DistributedDataParallel(_model(), bucket_cap_mb=0.005, **options)
    if hook == "fp16":
        model.register_builtin_hook("fp16")
    try:
        for step in range(1, 4):
            if rank == 1 and step == 3:
                model.module[3].weight.register_hook(lambda grad: os._exit(3))
            _step(model)
    except RuntimeError as caught:
        return str(caught)
    return None


@pytest.mark.parametrize("hook", ["fp16", "averaging"])
def test_a_builtin_hooks_failed_all_reduce_raises(hook):
    """The hooks' completion callbacks pass the collective's error on: a bucket whose
    all-reduce failed is an error on the survivor, never a gradient left unreduced."""
    error = run_ranks(hooked_fault_worker, 2, (hook,), timeout_s=90, pg_timeout_s=PG_TIMEOUT_S,
                      may_die=(1,))[0]
    assert error is not None and "phase: backward of iteration 3; lost rank(s) 1" in error, error
