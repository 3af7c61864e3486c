"""Bucket tuning without processes: link and step models on hand-computed cases, the planner
against brute force over all partitions, the simulator command, and autotune's decision rules
(the autotune runs are in tests/multirank/test_autotune.py)."""
import json
import random
import subprocess
import sys

import pytest

from pyreducer.testing import subprocess_env
from pyreducer.tuning import (LinkModel, Profile, best_plan, brute_force_plan, fit_link_model,
                              predict_step_ms)
from pyreducer.tuning.autotune import AutotuneConfig, close_call, enough_samples, final_choice
from pyreducer.tuning.stepmodel import bucket_done_ms, cap_plan, spread_compiled_landings


def test_link_model_hand_computed():
    link = LinkModel(latency_s=1e-3, bandwidth_bytes_per_s=1e9)
    assert link.allreduce_s(1e6, 2) == pytest.approx(1e-3 + 1e6 / 1e9)  # ring factor 1
    assert link.allreduce_s(1e6, 4) == pytest.approx(1e-3 + 1.5e6 / 1e9)  # 2(N-1)/N = 1.5
    assert link.allreduce_s(1e6, 1) == 0.0
    assert LinkModel.from_rate("10gbit").bandwidth_bytes_per_s == pytest.approx(1.25e9)


def test_fit_recovers_latency_and_bandwidth():
    sizes = [2**18, 2**20, 2**22, 2**24]
    truth = LinkModel(2e-4, 1.2e8)
    fitted = fit_link_model(sizes, [truth.allreduce_s(s, 4) for s in sizes], 4)
    assert fitted.latency_s == pytest.approx(2e-4, rel=1e-6)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(1.2e8, rel=1e-6)


def test_step_model_hand_computed():
    # ready at 1, 2, 10 ms; 1 MB each; link: 1 ms latency, 1 MB/ms (2 ranks: factor 1) -> 2 ms
    profile = Profile(ready_ms=[1.0, 2.0, 10.0], size_bytes=[10**6] * 3, backward_ms=10.5,
                      forward_ms=3.0, optimizer_ms=1.0)
    link = LinkModel(1e-3, 1e9)
    # one bucket per parameter: [1,3], [3,5], [10,12] -> last done 12
    assert bucket_done_ms(profile, [[0], [1], [2]], link, 2) == pytest.approx([3.0, 5.0, 12.0])
    assert predict_step_ms(profile, [[0], [1], [2]], link, 2) == pytest.approx(3 + 12 + 1)
    # one bucket: ready at 10, 3 MB -> 1 + 3 = 4 ms -> done 14
    assert predict_step_ms(profile, [[0, 1, 2]], link, 2) == pytest.approx(3 + 14 + 1)
    # comm finished inside backward: the step is compute-bound
    fast = LinkModel(0.0, 1e12)
    assert predict_step_ms(profile, [[0], [1], [2]], fast, 2) == pytest.approx(3 + 10.5 + 1)


def test_step_model_contention_delays_later_gradients_and_backward():
    # as above, with contention 0.5: each 1 MB bucket (1 ms on the wire) delays what follows
    # by 0.5 ms: ready 1, 2.5, 11 -> done [3, 5, 13]; backward end 10.5 + 0.5 + 0.5 = 11.5
    profile = Profile(ready_ms=[1.0, 2.0, 10.0], size_bytes=[10**6] * 3, backward_ms=10.5,
                      forward_ms=3.0, optimizer_ms=1.0)
    link = LinkModel(1e-3, 1e9, contention=0.5)
    assert bucket_done_ms(profile, [[0], [1], [2]], link, 2) == pytest.approx([3.0, 5.0, 13.0])
    assert predict_step_ms(profile, [[0], [1], [2]], link, 2) == pytest.approx(3 + 13 + 1)
    fast = LinkModel(0.0, 1e12, contention=0.5)  # negligible wire time: negligible delay
    assert predict_step_ms(profile, [[0], [1], [2]], fast, 2) == pytest.approx(3 + 10.5 + 1,
                                                                                abs=0.01)
    # one bucket: nothing runs during backward, so contention changes nothing
    assert predict_step_ms(profile, [[0, 1, 2]], link, 2) == pytest.approx(3 + 14 + 1)


def test_planning_for_contention_changes_the_plan_and_pays_under_it():
    profile = Profile(ready_ms=[1.0, 2.0, 3.0, 4.0], size_bytes=[10**6] * 4, backward_ms=4.0)
    free, loaded = LinkModel(1e-3, 1e9), LinkModel(1e-3, 1e9, contention=0.8)
    blind, aware = best_plan(profile, free, 2), best_plan(profile, loaded, 2)
    assert blind == [[0], [1, 2, 3]] and aware == [[0, 1], [2, 3]]
    # under contention the blind plan's early 1 MB bucket delays the other 3 gradients
    assert predict_step_ms(profile, aware, loaded, 2) < predict_step_ms(profile, blind, loaded, 2)


@pytest.mark.parametrize("seed", range(24))
def test_planner_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    ready = sorted(rng.uniform(0, 50) for _ in range(n))
    profile = Profile(ready_ms=ready, size_bytes=[rng.randint(1, 8) * 10**6 for _ in range(n)],
                      backward_ms=ready[-1] + 1)
    link = LinkModel(rng.choice([1e-5, 1e-3, 5e-3]), rng.choice([1e8, 1e9, 1e10]),
                     contention=rng.choice([0.0, 0.0, 0.2, 0.6]))
    ranks = rng.choice([2, 4, 64])
    plan = best_plan(profile, link, ranks)
    assert sorted(i for b in plan for i in b) == list(range(n))
    _, brute_ms = brute_force_plan(profile, link, ranks)
    assert bucket_done_ms(profile, plan, link, ranks)[-1] == pytest.approx(brute_ms)


def test_cap_plan_is_ddps_rebuild_plan():
    profile = Profile(ready_ms=[5.0, 1.0, 3.0, 2.0], size_bytes=[400, 300, 200, 100],
                      backward_ms=6.0)
    # ready order 1, 3, 2, 0; caps 350 then 500: [1, 3] (400), then [2, 0] (600)
    assert cap_plan(profile, [350, 500]) == [[1, 3], [2, 0]]


def test_simulate_command(tmp_path):
    profile = dict(ready_ms=[float(i) for i in range(1, 41)], size_bytes=[2**20] * 40,
                   backward_ms=41.0, forward_ms=20.0, optimizer_ms=2.0,
                   names=[f"p{i}" for i in range(40)], group_keys=["Float/cpu"] * 40)
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    env = subprocess_env()  # the pyreducer this test imported
    result = subprocess.run([sys.executable, "-m", "pyreducer", "simulate", "--profile",
                             str(tmp_path), "--ranks", "2,8,64", "--link", "1gbit,100gbit"],
                            capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                            env=env)
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "simulate.json").read_text())
    assert len(rows) == 6 and (tmp_path / "simulate.png").stat().st_size > 5000
    for row in rows:
        assert row["best_ms"] <= row["ddp_default_ms"] + 1e-9
        assert row["best_ms"] >= row["compute_ms"] - 1e-9
    slow = [r["best_ms"] for r in rows if r["link"] == "1gbit"]
    assert slow == sorted(slow)  # more ranks, more ring traffic per link


def test_planner_splits_when_overlap_pays():
    """Zero latency, communication as long as backward: one bucket per gradient is optimal."""
    profile = Profile(ready_ms=[1.0, 2.0, 3.0, 4.0], size_bytes=[10**6] * 4, backward_ms=4.0)
    plan = best_plan(profile, LinkModel(0.0, 1e9), 2)  # 1 ms per MB
    assert plan == [[0], [1], [2], [3]]
    assert len(best_plan(profile, LinkModel(0.1, 1e9), 2)) == 1  # 100 ms latency: one bucket


def test_fit_latency_survives_noise_on_the_largest_message():
    """A 1% slower 16 MiB all-reduce must not move the fitted latency by more than 20%
    (an unweighted fit moves it by 30% here)."""
    truth = LinkModel(5e-4, 1.2e8)
    sizes = [1 << 18, 1 << 20, 1 << 22, 1 << 24]
    times = [truth.allreduce_s(s, 2) for s in sizes]
    times[-1] *= 1.01
    fitted = fit_link_model(sizes, times, 2)
    assert fitted.latency_s == pytest.approx(5e-4, rel=0.2), fitted
    assert fitted.bandwidth_bytes_per_s == pytest.approx(1.2e8, rel=0.02), fitted


def test_autotune_drops_a_slower_candidate_after_one_or_two_steps():
    """Issue 31: a trial slower than the best plan so far (at first torch DDP's caps) is what
    the tuning phase must not show for long."""
    config = AutotuneConfig()
    measure, abandon = config.measure_iterations, config.abandon_ratio
    best = 0.100
    assert not enough_samples([], best, config)  # (a step not counted: recompiling)
    assert enough_samples([best * (2 * abandon - 1 + 0.05)], best, config)  # far slower: 1 step
    assert not enough_samples([best * (abandon + 0.05)], best, config)  # may be an outlier
    assert enough_samples([best * (abandon + 0.05)] * 2, best, config)  # ... two are not
    assert not enough_samples([best * (abandon + 0.05), best * 1.0], best, config)  # recovered
    assert not enough_samples([best * 1.05] * (measure - 1), best, config)
    assert enough_samples([best * 1.05] * measure, best, config)


def test_autotune_measures_a_close_call_again():
    config = AutotuneConfig()
    margin = config.confirm_margin
    a, b, c = [[0, 1]], [[0], [1]], [[1], [0]]
    assert close_call([("start", a, 0.100), ("x", b, 0.100 * (1 + margin / 2)),
                       ("y", c, 0.2)], config) == [("start", a), ("x", b)]
    assert close_call([("start", a, 0.100), ("x", b, 0.100 * (1 + 2 * margin))], config) == []
    assert close_call([("start", a, 0.100)], config) == []


def test_autotune_chooses_between_the_confirmed_plans_after_a_close_call():
    a, b, c = [[0, 1]], [[0], [1]], [[1], [0]]
    # "start" was third when the close call was made; confirming moved the finalists' medians
    # above it, but the choice stays between the two measured on all their steps
    measured = [("start", a, 0.100), ("optimal", b, 0.102), ("cap 0.5 MB", c, 0.101)]
    assert final_choice(measured, ["optimal", "cap 0.5 MB"])[0] == "cap 0.5 MB"
    assert final_choice(measured, [])[0] == "start"  # no close call: the fastest of all


@pytest.mark.parametrize("field,value", [("measure_iterations", 1), ("candidates", 0),
                                         ("caps_mb", (1, -2)), ("abandon_ratio", 0.9),
                                         ("confirm_margin", -0.1), ("warmup_iterations", 0)])
def test_autotune_config_rejects_nonsense_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        AutotuneConfig(**{field: value})


def test_compiled_landings_are_spread_over_their_piece_by_bytes():
    # Under torch.compile split at [[0, 1], [2, 3]], each bucket's gradients land together at its
    # piece's end (10 ms, 30 ms; the second of each 0.1 / 0.2 ms later: hooks and copies). Spread:
    # piece 1 runs 0-10 ms, parameter 0 holds 1 of its 4 MB -> 2.5 ms; parameter 1 keeps 10.1.
    # Piece 2 runs from the last landing of bucket 1 (10.1) to 30: parameter 2, half the bytes,
    # at 10.1 + 19.9 / 2 = 20.05; parameter 3 keeps 30.2.
    profile = Profile(ready_ms=[10.0, 10.1, 30.0, 30.2], size_bytes=[10**6, 3 * 10**6, 2 * 10**6,
                                                                     2 * 10**6],
                      backward_ms=30.5)
    plan = [[0, 1], [2, 3]]
    spread = spread_compiled_landings(profile, plan)
    assert spread.ready_ms == pytest.approx([2.5, 10.1, 20.05, 30.2])
    assert profile.ready_ms == [10.0, 10.1, 30.0, 30.2]  # the recorded profile is left as it was
    # the recorded plan is predicted as recorded; one bucket per gradient only after the spread
    link = LinkModel(1e-3, 1e9)
    assert predict_step_ms(spread, plan, link, 2) == pytest.approx(
        predict_step_ms(profile, plan, link, 2))
    fine = [[0], [1], [2], [3]]
    assert predict_step_ms(profile, fine, link, 2) >= predict_step_ms(profile, plan, link, 2)
    assert predict_step_ms(spread, fine, link, 2) < predict_step_ms(spread, plan, link, 2)
