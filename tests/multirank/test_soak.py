"""`python -m pyreducer soak` in short (make soak runs 10,000 steps; benchmarks/results/soak_*.md):
two ranks, samples taken, parameters identical across ranks, threads and descriptors constant."""
import pytest

from pyreducer.testing import run_ranks
from pyreducer.tools.soak import judge, soak_worker


@pytest.mark.parametrize("overlap", [False, True])
def test_short_soak_passes(overlap):
    per_rank = run_ranks(soak_worker, 2, (400, 100, overlap), timeout_s=120)
    assert [[s["step"] for s in r["samples"]] for r in per_rank] == [[100, 200, 300, 400]] * 2
    verdict = judge(per_rank, warmup=200, max_growth_mb=5)
    assert verdict["ok"], verdict
