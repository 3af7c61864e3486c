"""A script written the way nanoGPT's train.py is (pyreducer/testing/train_compiled.py:
torch.compile(model) then the wrapper, gradient accumulation through require_backward_grad_sync,
clipping, an evaluation on rank 0 alone), under torchrun with 2 Gloo ranks: the same loss curve
as with torch DDP, line for line (aot_eager: exact; with inductor the curves agreed within 1e-7
relative by hand, benchmarks/results/compiled_20261127.md)."""
import glob
import re
import subprocess
import sys

from pyreducer.testing import subprocess_env


def _run(wrapper, tmp_path):
    out = tmp_path / wrapper
    out.mkdir()
    env = subprocess_env(OMP_NUM_THREADS="1")
    env.pop("PYREDUCER_TRACE", None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--log-dir", "logs", "--redirects", "3", "-m", "pyreducer.testing.train_compiled",
         "--wrapper", wrapper, "--backend", "aot_eager"],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(out))
    logs = sorted(glob.glob(str(out / "logs" / "**" / "stdout.log"), recursive=True))
    texts = [open(path).read() for path in logs]
    assert len(texts) == 2, result.stdout[-2000:] + result.stderr[-3000:]
    if result.returncode != 0:  # torch's Gloo may abort a rank at exit (test_coming_from.py)
        assert "terminate called without an active exception" in result.stderr, \
            result.stdout[-2000:] + result.stderr[-3000:]
    curve = [line for line in texts[0].splitlines() if re.match(r"(step|eval) \d+ loss ", line)]
    params = [re.findall(r"^rank \d params (\S+)$", text, re.M) for text in texts]
    return curve, params


def test_nanogpt_style_script_gives_torch_ddps_loss_curve(tmp_path):
    theirs, their_params = _run("torch", tmp_path)
    ours, our_params = _run("pyreducer", tmp_path)
    assert len(theirs) == 8, theirs  # 6 steps, evaluations at steps 0 and 3
    assert ours == theirs
    assert our_params[0] == our_params[1] == their_params[0] == their_params[1]
