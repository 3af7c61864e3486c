"""Emulated hosts on one machine: network namespaces joined by a bridge, each host's NIC
rate-limited with `tc tbf`, one training rank per host pinned to its own core.

On loopback a 25 MB all-reduce costs ~10 ms and overlap hardly matters; across a 1 Gbit/s link
it costs ~220 ms, as between real hosts. Usage:

    with EmulatedCluster(hosts=2, rate="1gbit") as cluster:
        procs = [cluster.launch(rank, [sys.executable, "train.py"]) for rank in range(2)]
        cluster.wait(procs, timeout_s=600)

or from the shell: `python -m pyreducer netem --hosts 2 --rate 1gbit -- python train.py`.
`launch_torchrun` (`netem --torchrun`) runs torchrun on each host instead, one node per host
joined by torchrun's own c10d rendezvous, as on a cluster.
Each rank gets env:// rendezvous variables (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK) and
GLOO_SOCKET_IFNAME for its host's NIC. Needs root and iproute2: without them EmulatedCluster
raises NetemUnavailable saying so; nothing falls back to loopback. Namespaces are removed on
exit, on errors, on Ctrl-C and on SIGTERM. The 10.211.0.0/24 addresses exist only inside the
namespaces created here. netem (delay, loss) is not available in this kernel: links have a rate,
not a latency.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

SUBNET = "10.211.0"
_instances = 0


class NetemUnavailable(RuntimeError):
    pass


def check_available() -> None:
    """Raises NetemUnavailable with the reason if emulated hosts cannot be built here."""
    if os.geteuid() != 0:
        raise NetemUnavailable("emulated hosts need root (network namespaces and tc); "
                               f"running as uid {os.geteuid()}")
    missing = [tool for tool in ("ip", "tc", "taskset") if shutil.which(tool) is None]
    if missing:
        raise NetemUnavailable(f"emulated hosts need {', '.join(missing)} (Debian: iproute2, "
                               f"util-linux); not found on PATH")


def unavailable_reason() -> str | None:
    """Why emulated hosts cannot be built here (for a test's skip), or None."""
    try:
        check_available()
    except NetemUnavailable as error:
        return str(error)
    return None


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {result.stderr.strip()}")


class EmulatedCluster:
    """`hosts` namespaces on a bridge; `rate` like "1gbit", "10gbit", or None/"unlimited"."""

    def __init__(self, hosts: int, rate: str | None, port: int = 29511,
                 burst: str = "256kb", latency: str = "20ms"):
        if hosts < 1 or hosts > 200:
            raise ValueError(f"hosts must be in 1..200, got {hosts}")
        self.hosts, self.port, self.burst, self.latency = hosts, port, burst, latency
        self.rate = None if rate in (None, "", "unlimited") else rate
        global _instances
        _instances += 1
        # Unique per process and instance, so that runs never collide (NIC names <= 15 chars).
        self.prefix = f"pr{os.getpid() % 100000}n{_instances % 100}"
        self.bridge_ns = f"{self.prefix}br"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._old_sigterm = None

    def namespaces(self) -> list[str]:
        return [self.bridge_ns] + [self.host_ns(r) for r in range(self.hosts)]

    def host_ns(self, rank: int) -> str:
        return f"{self.prefix}h{rank}"

    def nic(self, rank: int) -> str:
        return f"{self.prefix}v{rank}"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def __enter__(self) -> "EmulatedCluster":
        check_available()
        self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_sigterm(self, signum, frame):
        raise SystemExit(f"terminated by signal {signum}")

    def _build(self) -> None:
        _run("ip", "netns", "add", self.bridge_ns)
        self._created.append(self.bridge_ns)
        _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        for rank in range(self.hosts):
            ns, nic, peer = self.host_ns(rank), self.nic(rank), f"{self.prefix}b{rank}"
            _run("ip", "netns", "add", ns)
            self._created.append(ns)
            _run("ip", "link", "add", nic, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", nic, "netns", ns)
            _run("ip", "link", "set", peer, "netns", self.bridge_ns)
            _run("ip", "-n", self.bridge_ns, "link", "set", peer, "master", "br0")
            _run("ip", "-n", self.bridge_ns, "link", "set", peer, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", nic)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", nic, "up")
            if self.rate:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", nic, "root",
                     "tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency)

    def launch(self, rank: int, argv: list[str], env: dict | None = None,
               cpu: int | None = None, **popen_kwargs) -> subprocess.Popen:
        """Starts argv as `rank` on its host, pinned to `cpu` (default rank % cores)."""
        cpu = rank % (os.cpu_count() or 1) if cpu is None else cpu
        full_env = dict(os.environ, **(env or {}), MASTER_ADDR=self.address(0),
                        MASTER_PORT=str(self.port), WORLD_SIZE=str(self.hosts), RANK=str(rank),
                        GLOO_SOCKET_IFNAME=self.nic(rank))
        proc = subprocess.Popen(["ip", "netns", "exec", self.host_ns(rank), "taskset", "-c",
                                 str(cpu)] + list(argv), env=full_env, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def launch_torchrun(self, host: int, script_argv: list[str], max_restarts: int = 0,
                        rdzv_port: int = 29400, env: dict | None = None,
                        **popen_kwargs) -> subprocess.Popen:
        """Starts torchrun on `host`: one of `hosts` nodes, one worker each, joined by torchrun's
        c10d rendezvous on host 0 over the emulated network (never --standalone). script_argv is
        what follows torchrun's options (`train.py ARGS` or `-m module ARGS`).

        Facts this needs (../shared/notes/NETWORK.md): the c10d rendezvous orders nodes by
        address and all namespaces share one hostname, so each node gives its own address
        (--local-addr) and host 0 says it hosts the store (is_host=1); restarted workers must
        not reuse the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: else the restarted
        round reads the dead round's addresses and Gloo's connectFullMesh is refused)."""
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.hosts}",
                "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.address(0)}:{rdzv_port}",
                f"--local-addr={self.address(host)}", f"--max-restarts={max_restarts}",
                "--monitor-interval=0.5"] + (["--rdzv-conf=is_host=1"] if host == 0 else [])
        full_env = dict(env or {}, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        return self.launch(host, argv + list(script_argv), env=full_env, **popen_kwargs)

    def wait(self, procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
        """Waits for all; kills everything still running at the deadline (TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                running = [i for i, p in enumerate(procs) if p.poll() is None]
                self._kill_all()
                raise TimeoutError(f"ranks {running} of {len(procs)} did not finish within "
                                   f"{timeout_s:.0f} s; everything launched was killed")
        return codes

    def _kill_all(self) -> None:
        """Kills every launched process, then every process left in the hosts' namespaces:
        what a launch started lives there too, even in a session of its own (torchrun starts
        its workers so, and a killed agent leaves them running)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for ns in self._created:
            for _ in range(10):  # bounded: a process may fork while its siblings are killed
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                      text=True, timeout=30).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                time.sleep(0.05)

    def close(self) -> None:
        self._kill_all()
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._created.clear()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
