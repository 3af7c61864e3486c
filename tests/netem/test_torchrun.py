"""torchrun across emulated hosts: four network namespaces, one `torchrun --nnodes=4
--nproc-per-node=1 --rdzv-backend=c10d` per host, a real multi-node rendezvous over the emulated
network (never --standalone). The training script is pyreducer.testing.elastic_train
(DistributedSampler, SGD with momentum, atomic checkpoints with the bucket plan).

Compared against torch DDP's run of the same script (bitwise), and an elastic run (one worker
leaves mid-run, torchrun restarts all workers, they resume from the checkpoint) against the
uninterrupted run (bitwise). Needs root and iproute2; skipped with the reason otherwise."""
import json
import subprocess

import pytest
import torch

from pyreducer.testing import subprocess_env
from pyreducer.tools.netem import EmulatedCluster, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no emulated hosts: {REASON}")
HOSTS = 4
DIE_RANK, DIE_AT_STEP, CHECKPOINT_EVERY = 1, 13, 5


def _tails(logs):
    return "\n".join(f"--- host {h}:\n{log.read_text()[-3000:]}" for h, log in enumerate(logs))


def _torchrun(out, *script_args, max_restarts=0):
    """The script under torchrun on every host; returns each rank's info and parameters."""
    out.mkdir()
    env = subprocess_env(OMP_NUM_THREADS="1")  # the pyreducer under test
    argv = ["-m", "pyreducer.testing.elastic_train", "--out", str(out),
            "--checkpoint-every", str(CHECKPOINT_EVERY)] + list(script_args)
    logs = [out / f"host{host}.log" for host in range(HOSTS)]
    with EmulatedCluster(HOSTS, "1gbit") as cluster:
        procs = [cluster.launch_torchrun(host, argv, max_restarts=max_restarts, env=env,
                                         cwd=str(out), stdout=open(log, "w"),
                                         stderr=subprocess.STDOUT)
                 for host, log in enumerate(logs)]
        try:
            codes = cluster.wait(procs, timeout_s=240)
        except TimeoutError as timeout:
            raise TimeoutError(f"{timeout}\n{_tails(logs)}") from None
    assert codes == [0] * HOSTS, f"torchrun exit codes {codes}\n{_tails(logs)}"
    infos = [json.loads((out / f"info_rank{r}.json").read_text()) for r in range(HOSTS)]
    params = [torch.load(out / f"final_rank{r}.pt") for r in range(HOSTS)]
    return infos, params


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun")
    return dict(torch=_torchrun(tmp / "torch", "--impl", "torch"),
                pyreducer=_torchrun(tmp / "pyreducer"),
                elastic=_torchrun(tmp / "elastic", "--die-rank", str(DIE_RANK),
                                  "--die-at-step", str(DIE_AT_STEP), max_restarts=1),
                elastic_dir=tmp / "elastic")


def _assert_same(a, b, what):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), \
            f"{what}: {name} differs by up to {(a[name] - b[name]).abs().max().item():.3g}"


def test_every_host_is_one_node_of_one_rendezvous(runs):
    infos, _ = runs["pyreducer"]
    assert [info["rank"] for info in infos] == list(range(HOSTS))
    assert {info["world_size"] for info in infos} == {HOSTS}
    # each rank talked through its own host's NIC: four hosts, not four processes on loopback
    assert len({info["interface"] for info in infos}) == HOSTS
    assert all(info["interface"].startswith("pr") for info in infos)


def test_parameters_equal_torch_ddp_and_are_identical_on_every_host(runs):
    for impl in ("torch", "pyreducer"):
        _, params = runs[impl]
        for rank in range(1, HOSTS):
            _assert_same(params[0], params[rank], f"{impl}: rank {rank} against rank 0")
    _assert_same(runs["torch"][1][0], runs["pyreducer"][1][0], "pyreducer against torch DDP")


def test_elastic_restart_resumes_and_ends_bitwise_equal(runs):
    infos, params = runs["elastic"]
    out = runs["elastic_dir"]
    assert (out / "died").read_text().startswith(f"rank {DIE_RANK} left")
    # torchrun restarted the workers once; all resumed from the last checkpoint before the death
    last_checkpoint = DIE_AT_STEP // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    assert [info["resumed_at_step"] for info in infos] == [last_checkpoint] * HOSTS
    assert infos[DIE_RANK]["restart_count"] == 1
    for rank in range(HOSTS):
        _assert_same(params[0], params[rank], f"elastic: rank {rank} against rank 0")
    _assert_same(runs["pyreducer"][1][0], params[0], "restarted run against uninterrupted run")
    # checkpoints were written atomically: no temporary file is left beside the checkpoint
    assert sorted(p.name for p in out.glob("checkpoint*")) == ["checkpoint.pt"]
