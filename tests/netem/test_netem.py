"""Emulated hosts (pyreducer.tools.netem): namespaces joined by a bridge with a rate-limited NIC each.
Needs root and iproute2; skipped with the reason otherwise (never silently on loopback)."""
import json
import os
import subprocess
import sys
import time

import pytest

from pyreducer.testing import subprocess_env, wait_for_exit
from pyreducer.tools.netem import EmulatedCluster, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no emulated hosts: {REASON}")
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netem_rank.py")


def _existing(names):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    present = {line.split()[0] for line in out.splitlines() if line.strip()}
    return [n for n in names if n in present]


def _run(rate, tmp_path, hosts=2):
    out = tmp_path / f"result-{rate}.json"
    with EmulatedCluster(hosts, rate, port=29600 + os.getpid() % 100) as cluster:
        names = cluster.namespaces()
        assert _existing(names) == names
        procs = [cluster.launch(r, [sys.executable, RANK_SCRIPT, str(out)]) for r in range(hosts)]
        codes = cluster.wait(procs, timeout_s=120)
        assert codes == [0] * hosts, f"rank exit codes {codes}"
    assert _existing(names) == [], "namespaces left behind"
    return json.loads(out.read_text())


def test_rate_limit_is_applied_and_training_works(tmp_path):
    fast = _run("unlimited", tmp_path)
    slow = _run("100mbit", tmp_path)
    # ring all-reduce, 2 hosts: each NIC sends 4 MB; at 100 Mbit/s that takes >= 0.34 s
    assert slow["allreduce_s"] >= 0.8 * (4 * 2**20 * 8 / 100e6), slow
    assert slow["allreduce_s"] > 3 * fast["allreduce_s"], (fast, slow)
    for result in (fast, slow):
        assert result["sum_ok"] and result["grads_equal"] and result["sharded_equal"]
        assert result["interface"].endswith("v0")


def test_cleanup_on_failure(tmp_path):
    """What a rank started goes with it: a rank here starts a child in a session of its own,
    as torchrun starts its workers, which outlives a kill of the rank or of its group."""
    child = ("import subprocess, sys; "
             "p = subprocess.Popen(['sleep', '60'], start_new_session=True); "
             "open(sys.argv[1], 'w').write(str(p.pid)); p.wait()")
    pid_files = [tmp_path / f"child{r}" for r in range(2)]
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish"):
        with EmulatedCluster(2, "1gbit") as cluster:
            names = cluster.namespaces()
            procs = [cluster.launch(r, [sys.executable, "-c", child, str(pid_files[r])])
                     for r in range(2)]
            start = time.monotonic()
            cluster.wait(procs, timeout_s=3)
    assert time.monotonic() - start < 30
    assert _existing(names) == []
    assert all(p.poll() is not None for p in procs)
    for pid in [int(f.read_text()) for f in pid_files]:  # a child outliving the cluster raises
        wait_for_exit(pid, timeout_s=5)


def test_the_netem_command_runs_every_rank(tmp_path):
    """`python -m pyreducer netem -- CMD` as docs/pages/guides/many-hosts.md gives it: every rank
    runs CMD on its host (a regression: the command's words once replaced the subcommand's name)."""
    script = tmp_path / "rank.py"
    script.write_text("import os, pathlib, sys\n"
                      "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text("
                      "os.environ['GLOO_SOCKET_IFNAME'])\n")

    env = subprocess_env()  # the pyreducer under test
    result = subprocess.run([sys.executable, "-m", "pyreducer", "netem", "--hosts", "2",
                             "--timeout", "60", "--", sys.executable, str(script), str(tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                            env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exit codes per rank: [0, 0]" in result.stdout
    assert [(tmp_path / r).read_text()[-2:] for r in ("0", "1")] == ["v0", "v1"]
