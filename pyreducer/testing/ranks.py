"""Run a function on N local ranks (Gloo; or NCCL, one GPU each), with a hard wall-clock bound.

    results = run_ranks(fn, world_size=2, args=(...), timeout_s=120)

spawns one process per rank (start method "spawn"), initialises a process group (Gloo by default) over a file
store, calls fn(rank, world_size, *args) and returns the per-rank return values. A rank that
raises makes run_ranks raise RankError naming that rank with its traceback; ranks that have not
finished by the deadline are killed and run_ranks raises RankTimeout naming them. Results travel
through torch.save, so they may hold tensors.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_module
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta


class RankError(RuntimeError):
    """A rank raised; .rank is the first rank that reported an error."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


class RankTimeout(TimeoutError):
    """Some ranks did not finish in time; .ranks lists them."""

    def __init__(self, ranks: list[int], message: str):
        super().__init__(message)
        self.ranks = ranks


def _child(rank, world_size, init_file, fn, args, results, pg_timeout_s, threads, env, backend,
           set_device):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    from pyreducer.wrapper.nested import map_tensors

    torch.set_num_threads(threads)
    status, payload = "ok", None
    try:
        if set_device:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
        value = map_tensors(fn(rank, world_size, *args), lambda t: t.detach().cpu())
        buffer = io.BytesIO()
        torch.save(value, buffer)
        payload = buffer.getvalue()
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        status, payload = "error", traceback.format_exc()
    results.put((rank, status, payload))
    results.close()
    results.join_thread()  # flush to the pipe before os._exit
    if status == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    # os._exit: skip interpreter teardown, which can abort after Gloo errors.
    os._exit(0 if status == "ok" else 1)


def _collect(procs, results, deadline, may_die, error_grace_s) -> dict:
    """{rank: (status, payload)} of the ranks that reported by the deadline (shortened once a
    rank that may not die failed); then every rank still running is killed."""
    outcomes: dict[int, tuple[str, object]] = {}
    try:
        while len(outcomes) < len(procs):
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, status, payload = results.get(timeout=min(0.5, deadline - now))
            except queue_module.Empty:
                _mark_dead(procs, outcomes, results)
                continue
            outcomes[rank] = (status, payload)
            if status == "error" and rank not in may_die:
                deadline = min(deadline, time.monotonic() + error_grace_s)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(2.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return outcomes


def _mark_dead(procs, outcomes, results):
    """Records ranks whose process exited without reporting (segfault, abort, kill)."""
    dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
    if not dead:
        return
    try:  # a result may have reached the pipe just before the process exited
        while True:
            rank, status, payload = results.get(timeout=0.2)
            outcomes[rank] = (status, payload)
    except queue_module.Empty:
        pass
    for r in dead:
        if r not in outcomes:
            outcomes[r] = ("error", f"process exited with code {procs[r].exitcode} without "
                                    f"reporting a result")


def run_ranks(fn, world_size: int, args: tuple = (), timeout_s: float = 120.0,
              pg_timeout_s: float = 60.0, threads: int = 1, env: dict | None = None,
              error_grace_s: float = 5.0, may_die: tuple = (), backend: str = "gloo",
              set_device: bool | None = None) -> list:
    """Runs fn(rank, world_size, *args) on world_size spawned ranks; returns their results
    (tensors in them come back on the CPU).

    Args:
        fn: a module-level (picklable) function.
        timeout_s: hard bound on the whole run; ranks still running then are killed.
        pg_timeout_s: the process group's timeout (bounds every collective wait).
        threads: torch intra-op threads per rank.
        env: extra environment variables for the ranks.
        error_grace_s: after a rank fails, how long the others get to report before being killed.
        may_die: ranks that are expected to exit without a result (fault-injection tests); their
            result is None.
        backend: "gloo" (default) or "nccl" (one GPU per rank).
        set_device: call torch.cuda.set_device(rank) before init; default: with "nccl" only
            (False tests scripts that never call it).
    """
    if set_device is None:
        set_device = backend == "nccl"
    import torch

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pyreducer-ranks-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, daemon=True,
                             args=(rank, world_size, init_file, fn, args, results, pg_timeout_s,
                                   threads, dict(env or {}), backend, set_device))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        try:
            outcomes = _collect(procs, results, time.monotonic() + timeout_s, may_die,
                                error_grace_s)
        finally:
            results.close()

    # in the order the errors arrived: the first is usually the cause, the others its echo
    errors = [(r, payload) for r, (status, payload) in outcomes.items()
              if status == "error" and r not in may_die]
    if errors:
        rank, text = errors[0]
        others = "".join(f"\n--- rank {r} failed after it: {_last_line(t)}" for r, t in errors[1:])
        raise RankError(rank, f"rank {rank} of {world_size} failed first:\n{text}{others}")
    missing = [r for r in range(world_size) if r not in outcomes and r not in may_die]
    if missing:
        raise RankTimeout(missing, f"ranks {missing} of {world_size} did not finish within "
                                   f"{timeout_s:.0f} s and were killed")
    return [torch.load(io.BytesIO(outcomes[r][1]), weights_only=False)
            if outcomes.get(r, ("", None))[0] == "ok" else None for r in range(world_size)]


def subprocess_env(**extra) -> dict:
    """This process's environment with the pyreducer it imported first on PYTHONPATH, for
    subprocesses that must run the same build (make cuda-check tests another one than the
    checkout's), plus `extra`."""
    import pyreducer

    path = os.pathsep.join([os.path.dirname(os.path.dirname(pyreducer.__file__))] + sys.path)
    return dict(os.environ, PYTHONPATH=path, **extra)


# torch's Gloo can abort a rank at interpreter exit after its work is done (torch DDP as
# pyreducer; docs/pages/coming-from.md): the one non-zero exit that is not the run's failure.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def torchrun_module(module: str, args: list, cwd, timeout_s: float = 300.0, out=None,
                    **env) -> subprocess.CompletedProcess:
    """Runs `python -m module args` under torchrun (2 processes on this machine, Gloo; `env`
    added to the environment); raises AssertionError with the output's tail if it failed, unless
    `out` (the file the run writes last) exists and the only failure is GLOO_EXIT_ABORT."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", module, *map(str, args)],
        cwd=cwd, env=subprocess_env(OMP_NUM_THREADS="1", **env), capture_output=True, text=True,
        timeout=timeout_s)
    exited_after_work = out is not None and os.path.exists(out) and GLOO_EXIT_ABORT in proc.stderr
    assert proc.returncode == 0 or exited_after_work, \
        f"{module} {' '.join(map(str, args))}: exit {proc.returncode}\n" \
        f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return proc


def _last_line(text: str) -> str:
    lines = [line for line in str(text).splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


def wait_for_exit(pid: int, timeout_s: float = 30.0) -> None:
    """Returns once process `pid` has exited (gone, or a zombie its parent has not reaped yet);
    fault-injection tests wait so for a rank they killed before going on."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not exit within {timeout_s} s")
