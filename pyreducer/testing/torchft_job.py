"""A torchft job on this machine, for tests and benchmarks: a Lighthouse in this process, one
process per replica group (pyreducer/testing/torchft_replica.py), a group that exits non-zero
restarted as torchrun's --max_restarts would (a new life heals from a live peer), a stopped one
killed once the others are done; and the replay that computes the parameters a logged schedule
must give.

Every wait is bounded: the job by `timeout_s` (replicas still running then are killed and it
raises), each collective by the replicas' Gloo timeout, each quorum by the Manager's.

On loopback by default; with `link` (a rate: "1gbit", or "unlimited") on emulated hosts
(pyreducer.tools.netem): replica group r on host r (its own network namespace, NIC rate-limited
by tc tbf, pinned to core r % cores, Gloo on that NIC), the Lighthouse on a host of its own
(a subprocess there), every address that host's. Needs root and iproute2 (NetemUnavailable).
"""
from __future__ import annotations

import contextlib
import json
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from pyreducer.testing.ranks import subprocess_env
from pyreducer.testing.torchft_replica import read_log

DEFAULTS = dict(pg_timeout_s=5, manager_timeout_s=10, quorum_timeout_s=40, bucket_cap_mb=0.005,
                pace_s=0.0)


class JobError(RuntimeError):
    """The job did not finish as expected (a replica failed unasked, or the time ran out)."""


def run_job(impl: str, replicas: int, steps: int, workdir, min_replicas: int | None = None,
            fail: dict | None = None, timeout_s: float = 100.0, heartbeat_timeout_ms: int = 2000,
            join_timeout_ms: int = 2000, link: str | None = None, start_together: bool = False,
            **options) -> dict:
    """Runs `replicas` replica groups of `impl` ("pyreducer" or "torchft") for `steps` steps.

    fail: {"replica", "step", "kind"} (kinds: torchft_replica's doc); the failed group is
    restarted, except a stopped one ("sigstop"), which is killed when the others are done.
    link: None (loopback) or the emulated hosts' link rate (the module's doc).
    start_together: every first life waits for the others before its first step (the
    replica's "barrier"), so that the first quorum has them all.
    Returns {"results": {replica: its last life's torch.save}, "log": every life's step log
    (dicts, in file order), "lives": {replica: exit codes of its ended lives}, "seconds",
    "events": [{"replica", "life", "event": "start" or "exit", "time" (time.time()), "code"}]}.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    quorum = dict(min_replicas=min_replicas or replicas, join_timeout_ms=join_timeout_ms,
                  heartbeat_timeout_ms=heartbeat_timeout_ms)
    with _placement(link, replicas, quorum, workdir) as place:
        config = dict(DEFAULTS, impl=impl, steps=steps, min_replicas=min_replicas or replicas,
                      replicas=replicas, lighthouse=place.lighthouse, **options)
        if start_together:
            shutil.rmtree(workdir / "start_barrier", ignore_errors=True)
            config["barrier"] = dict(dir=str(workdir / "start_barrier"), count=replicas,
                                     timeout_s=timeout_s)
        lives, events, begin = _run_replicas(place, config, replicas, fail, timeout_s, workdir)
    results = {r: torch.load(workdir / f"replica{r}.pt") for r in range(replicas)
               if (workdir / f"replica{r}.pt").exists()}
    log = [e for r in range(replicas) for e in read_log(str(workdir / f"replica{r}.jsonl"))]
    return dict(results=results, log=log, lives=lives, seconds=time.monotonic() - begin,
                events=events)


def _run_replicas(place, config, replicas, fail, timeout_s, workdir):
    """Starts the replicas, supervises them to the end; (lives, events, monotonic start)."""
    procs, lives, attempts = {}, {r: [] for r in range(replicas)}, {r: 0 for r in range(replicas)}
    events: list[dict] = []

    def start(replica):
        mine = dict(config, replica=replica, attempt=attempts[replica],
                    out=str(workdir / f"replica{replica}.pt"),
                    log=str(workdir / f"replica{replica}.jsonl"))
        if place.host(replica) != "localhost":
            mine["host"] = place.host(replica)
        if fail and fail["replica"] == replica:
            mine.update(fail=fail["kind"], fail_step=fail["step"])
        err = open(workdir / f"replica{replica}.life{attempts[replica]}.err", "w")
        events.append(dict(replica=replica, life=attempts[replica], event="start",
                           time=time.time()))
        procs[replica] = place.popen(
            replica, [sys.executable, "-m", "pyreducer.testing.torchft_replica", json.dumps(mine)],
            stdout=err, stderr=subprocess.STDOUT, env=subprocess_env(OMP_NUM_THREADS="1"))

    begin = time.monotonic()
    try:
        for r in range(replicas):
            start(r)
        _supervise(procs, lives, attempts, start, fail, begin + timeout_s, workdir, events)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return lives, events, begin


class _Loopback:
    """Replicas on this machine, the Lighthouse in this process."""

    def __init__(self, lighthouse):
        self.lighthouse = f"http://localhost:{lighthouse.address().rsplit(':', 1)[1]}"

    def host(self, replica: int) -> str:
        return "localhost"

    def popen(self, replica: int, argv, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(argv, **kwargs)


class _Hosts:
    """Replica r on emulated host r; the Lighthouse on host `replicas`."""

    def __init__(self, cluster, lighthouse_port: int, lighthouse_host: int):
        self.cluster = cluster
        self.lighthouse = f"http://{cluster.address(lighthouse_host)}:{lighthouse_port}"

    def host(self, replica: int) -> str:
        return self.cluster.address(replica)

    def popen(self, replica: int, argv, env=None, **kwargs) -> subprocess.Popen:
        return self.cluster.launch(replica, argv, env=env, **kwargs)


@contextlib.contextmanager
def _placement(link, replicas: int, quorum: dict, workdir: Path):
    """Where the replicas and the Lighthouse run (_Loopback or _Hosts), torn down after."""
    if link is None:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", quorum_tick_ms=50, **quorum)
        try:
            yield _Loopback(lighthouse)
        finally:
            lighthouse.shutdown()
        return
    from pyreducer.tools.netem import EmulatedCluster

    with EmulatedCluster(replicas + 1, link) as cluster:  # every process is killed on exit
        port = _start_lighthouse(cluster, replicas, quorum, workdir)
        yield _Hosts(cluster, port, replicas)


# the Lighthouse on an emulated host: prints its port, serves until its stdin closes
LIGHTHOUSE = ("import sys; from torchft.coordination import LighthouseServer; "
              "s = LighthouseServer(bind=sys.argv[1], min_replicas=int(sys.argv[2]), "
              "join_timeout_ms=int(sys.argv[3]), heartbeat_timeout_ms=int(sys.argv[4]), "
              "quorum_tick_ms=50); print(s.address().rsplit(':', 1)[1], flush=True); "
              "sys.stdin.read(); s.shutdown()")


def _start_lighthouse(cluster, host: int, quorum: dict, workdir: Path,
                      timeout_s: float = 120.0) -> int:
    """Starts the Lighthouse on emulated host `host`; its port, once it listens."""
    err = open(workdir / "lighthouse.err", "w")
    proc = cluster.launch(host, [sys.executable, "-c", LIGHTHOUSE, f"{cluster.address(host)}:0",
                                 str(quorum["min_replicas"]), str(quorum["join_timeout_ms"]),
                                 str(quorum["heartbeat_timeout_ms"])],
                          env=subprocess_env(RUST_LOG="warn"), stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=err, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().strip() if ready else ""
    if not line.isdigit():
        raise JobError(f"the Lighthouse on {cluster.address(host)} did not start within "
                       f"{timeout_s:.0f} s: {(workdir / 'lighthouse.err').read_text()[-1500:]}")
    return int(line)


def _supervise(procs, lives, attempts, start, fail, deadline, workdir, events) -> None:
    stalled = fail["replica"] if fail and fail["kind"] == "sigstop" else None
    while True:
        running = {r for r, p in procs.items() if p.poll() is None}
        for r, p in list(procs.items()):
            if r in running or len(lives[r]) > attempts[r]:
                continue
            lives[r].append(p.returncode)
            events.append(dict(replica=r, life=attempts[r], event="exit", time=time.time(),
                               code=p.returncode))
            if p.returncode != 0:
                if not fail or fail["replica"] != r or attempts[r] > 0:
                    raise JobError(f"replica {r} (life {attempts[r]}) exited with "
                                   f"{p.returncode}: {_tail(workdir, r, attempts[r])}")
                attempts[r] += 1  # as torchrun --max_restarts: a new life, which heals
                start(r)
                running.add(r)
        if stalled is not None and running == {stalled}:
            procs[stalled].send_signal(signal.SIGKILL)  # the others are done
            procs[stalled].wait()
            lives[stalled].append(procs[stalled].returncode)
            events.append(dict(replica=stalled, life=attempts[stalled], event="exit",
                               time=time.time(), code=procs[stalled].returncode))
            return
        if not running:
            return
        if time.monotonic() > deadline:
            raise JobError(f"replicas {sorted(running)} still running at the deadline: " +
                           "; ".join(_tail(workdir, r, attempts[r]) for r in sorted(running)))
        time.sleep(0.05)


def _tail(workdir, replica, attempt, chars=1500, steps=6) -> str:
    """A life's last output, then the last `steps` lines of its replica's step log."""
    path = Path(workdir) / f"replica{replica}.life{attempt}.err"
    out = path.read_text()[-chars:] if path.exists() else "(no output)"
    keys = ("attempt", "step", "quorum", "participants", "participating", "committed")
    logged = [{k: e.get(k) for k in keys}
              for e in read_log(str(Path(workdir) / f"replica{replica}.jsonl"))[-steps:]]
    return f"{out} (step log, last {len(logged)}: {logged})"


def replay(log: list[dict], steps: int | None = None) -> dict:
    """The parameters the logged schedule must give, recomputed in one process: at each step,
    the sum of the gradients of the replicas that participated in its committed attempt, on
    their own batches (a healing replica adds zeros), divided by the Manager's participant
    count, then the optimizer's step, for `steps` steps (None: every step committed in the
    log). Exact, bit for
    bit, where no step sums more than two gradients (a sum of two is the same in any order);
    beyond that the collective's summation order is not reproduced."""
    from pyreducer.testing import torchft_replica as replica_module

    torch.set_num_threads(1)
    model = replica_module.build_model()
    optimizer = replica_module.build_optimizer(model.parameters())
    if steps is None:
        steps = max(e["step"] for e in log if e["committed"]) + 1
    for step in range(steps):
        entries = [e for e in log if e["step"] == step and e["committed"] and e["participating"]]
        who = sorted({e["replica"] for e in entries})
        counts = {e["participants"] for e in entries}
        if not who or len(counts) != 1 or len(who) > min(counts):
            raise ValueError(f"step {step}: committed by {who} with participant counts {counts}")
        divisor = counts.pop()  # the Manager's: replicas at the quorum's step (healing ones too)
        total = None
        for r in who:
            model.zero_grad(set_to_none=True)
            x, y = replica_module.batch(r, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for p, g in zip(model.parameters(), total):
            p.grad = g / divisor
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}

