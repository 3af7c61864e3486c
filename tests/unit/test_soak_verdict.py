"""The soak verdict (pyreducer/tools/soak.py): what counts as a leak, on made-up samples."""
import torch

from pyreducer.tools.soak import judge


def _rank(rss, fds=15, threads=5, params=None):
    samples = [dict(step=100 * (i + 1), seconds=i, rss_mb=mb, fds=fds, threads=threads)
               for i, mb in enumerate(rss)]
    return dict(samples=samples, params=torch.ones(3) if params is None else params)


def test_warmup_growth_is_not_counted_and_a_steady_run_passes():
    verdict = judge([_rank([300, 320, 321, 321.5]), _rank([300, 310, 310, 310])], warmup=200,
                    max_growth_mb=5)
    assert verdict["ok"], verdict
    assert [r["baseline_step"] for r in verdict["ranks"]] == [200, 200]
    assert verdict["ranks"][0]["rss_growth_mb"] == 1.5


def test_each_leak_fails_its_own_check():
    cases = {"rss": [_rank([300, 300, 306]), _rank([300, 300, 300])],
             "fds": [_rank([300, 300, 300]), dict(_rank([300] * 3), samples=[
                 dict(step=100 * (i + 1), seconds=i, rss_mb=300, fds=15 + i, threads=5)
                 for i in range(3)])],
             "identical": [_rank([300] * 3), _rank([300] * 3, params=torch.tensor([1., 1, 1.5]))]}
    for failing, per_rank in cases.items():
        verdict = judge(per_rank, warmup=100, max_growth_mb=5)
        assert not verdict["ok"]
        assert [name for name, ok in verdict["checks"].items() if not ok] == [failing], verdict
