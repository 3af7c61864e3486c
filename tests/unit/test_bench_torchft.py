"""The figures of benchmarks/torchft_report.py (bench_torchft.py's summary) from made-up step logs:
the slowest replica's median step and the ratios to plain pyreducer DDP (pooled and per
repeat), a failed run reported as such, one failure under torchft (healing) and under torchrun's
elastic restart (steps redone since the checkpoint), the markdown, the plots, the tolerant
reading of a killed writer's log, and the script's arguments. Starts no process."""
import json

import pytest

from benchmarks import torchft_report as report

SETTINGS = dict(steps=7, warmup=1, repeats=2, fail_step=3, fail_replica=1, checkpoint_every=2,
                hosts=3, link="1gbit", bucket_cap_mb=4.0)


def _entry(replica, attempt, step, start, end, committed=True, participating=True,
           participants=3):
    return dict(replica=replica, attempt=attempt, step=step, participants=participants,
                participating=participating, committed=committed, loss=1.0, start=start, end=end)


def _steady(durations, t0=1000.0):
    """Every replica's 7 steps back to back, replica r's steps lasting durations[r]."""
    return [_entry(r, 0, s, t0 + s * d, t0 + (s + 1) * d)
            for r, d in enumerate(durations) for s in range(SETTINGS["steps"])]


def _torchft_failure() -> dict:
    """Replica 1 killed at 1000.35 during step 3; the survivors' step 3 uncommitted once, then
    committed by 2; replica 1's new life heals at step 5 (0.35 s) and joins in at step 6."""
    log = []
    for r in (0, 2):
        log += [_entry(r, 0, s, 1000 + 0.1 * s, 1000.1 + 0.1 * s) for s in range(3)]
        log += [_entry(r, 0, 3, 1000.3, 1000.5, committed=False),
                _entry(r, 0, 3, 1000.5, 1000.6, participants=2),
                _entry(r, 0, 4, 1000.6, 1000.7, participants=2),
                _entry(r, 0, 5, 1000.7, 1001.0), _entry(r, 0, 6, 1001.0, 1001.1)]
    log += [_entry(1, 0, s, 1000 + 0.1 * s, 1000.1 + 0.1 * s) for s in range(3)]
    log += [_entry(1, 1, 5, 1000.65, 1001.0, participating=False),
            _entry(1, 1, 6, 1001.0, 1001.1)]
    events = [dict(replica=r, life=0, event="start", time=999.0) for r in range(3)]
    events += [dict(replica=1, life=0, event="exit", time=1000.35, code=-9),
               dict(replica=1, life=1, event="start", time=1000.35)]
    return dict(variant="torchft_pyreducer", repeat=0, failure=True, log=log, events=events,
                seconds=5.0)


def _elastic_failure() -> dict:
    """Rank 1 killed at 2000.35 during step 3; every rank restarted, resuming at step 2 (the
    checkpoint of steps 0-1)."""
    log = [_entry(r, 0, s, 2000 + 0.1 * s, 2000.1 + 0.1 * s) for r in range(3) for s in range(3)]
    log += [_entry(r, 1, s, 2003 + 0.1 * (s - 2), 2003.1 + 0.1 * (s - 2))
            for r in range(3) for s in range(2, 7)]
    events = [dict(replica=1, life=0, event="kill", time=2000.35, step=3),
              dict(replica=0, life=0, event="checkpoint", time=2000.2, steps_done=2)]
    events += [dict(replica=r, life=1, event="start", time=2002.0) for r in range(3)]
    return dict(variant="ddp_pyreducer", repeat=0, failure=True, log=log, events=events,
                seconds=9.0)


def _run(variant, repeat, durations):
    return dict(variant=variant, repeat=repeat, failure=False, log=_steady(durations),
                events=[], seconds=3.0)


def _doc() -> dict:
    runs = []
    for repeat in range(2):
        runs += [_run("ddp_pyreducer", repeat, [0.100, 0.120, 0.110]),
                 _run("torchft_pyreducer", repeat, [0.123, 0.110, 0.100])]
    runs += [_run("torchft_ddp", 0, [0.130, 0.100, 0.100]),
             dict(variant="torchft_ddp", repeat=1, failure=False, error="JobError: boom"),
             _torchft_failure(), _elastic_failure()]
    return dict(settings=SETTINGS, reference="ddp_pyreducer", runs=runs,
                model=dict(name="mlp_16mb", parameters=4214800, grad_mib=16.1, batch=256))


def test_the_slowest_replicas_median_and_the_ratios_to_plain_pyreducer():
    steps = report.aggregate(_doc())["steps"]
    assert steps["ddp_pyreducer"]["step"]["median_ms"] == pytest.approx(120.0)  # replica 1's
    ours = steps["torchft_pyreducer"]
    assert ours["step"]["median_ms"] == pytest.approx(123.0)
    assert ours["ratio"] == pytest.approx(1.025)
    assert ours["per_repeat_ratio"] == pytest.approx([1.025, 1.025])
    assert ours["span_s"] == pytest.approx(7 * 0.123)
    theirs = steps["torchft_ddp"]  # repeat 1 failed: repeat 0 alone, paired with repeat 0
    assert theirs["per_repeat_ratio"] == pytest.approx([130 / 120])
    assert theirs["errors"] == ["JobError: boom"]


def test_one_failure_under_torchft():
    f = next(f for f in report.aggregate(_doc())["failures"]
             if f["variant"] == "torchft_pyreducer")
    assert f["steps_lost"] == 1  # each survivor's uncommitted attempt of step 3
    assert f["back_at_step_s"] == pytest.approx(0.25)  # kill (exit) to step 3 committed
    assert f["restart_s"] == pytest.approx(0.30)  # to its new life's first step
    assert f["heal_s"] == pytest.approx(0.35)
    assert f["rejoin_s"] == pytest.approx(0.75)
    assert f["batches_missing"] == 3  # replica 1's steps 3, 4 (away) and 5 (healing)
    assert f["seconds_lost"] == pytest.approx(1.1 - 7 * 0.123)
    assert f["budget_s"] == pytest.approx(0.123 + 0.35)
    assert f["target_met"] is True


def test_one_failure_under_torchruns_elastic_restart():
    f = next(f for f in report.aggregate(_doc())["failures"] if f["variant"] == "ddp_pyreducer")
    assert f["steps_lost"] == 2  # steps 2 and 3 again, from the checkpoint of step 2
    assert f["back_at_step_s"] == pytest.approx(2003.2 - 2000.35)  # from its "kill" event
    assert f["restart_s"] == pytest.approx(2003.0 - 2000.35)
    assert f["heal_s"] is None and f["batches_missing"] == 0
    assert f["seconds_lost"] == pytest.approx(3.5 - 7 * 0.120)
    assert f["target_met"] is False
    run = _elastic_failure()
    later = report.redone_from(run["log"])
    kinds = {(e["replica"], e["attempt"], e["step"]): report.bar_kind(e, later)[0]
             for e in run["log"]}
    assert kinds[(0, 0, 1)] == "committed" and kinds[(0, 0, 2)] == report.REDONE[0]
    assert kinds[(0, 1, 2)] == "committed"


def test_the_summary():
    text = report.summary_md(_doc())
    rows = {line.split(" | ")[0]: line for line in text.splitlines()
            if line.startswith("| torchft_pyreducer | pyreducer.torchft")}
    assert rows["| torchft_pyreducer"].startswith(
        "| torchft_pyreducer | pyreducer.torchft.DistributedDataParallel under torchft | 123.0 | "
        "123.0-123.0 | 1.025 | 1.025, 1.025 | 0.9 |")
    assert "- torchft_pyreducer / ddp_pyreducer = 1.025 (target <= 1.05): met" in text
    assert "- torchft_pyreducer 123.0 ms vs torchft_ddp 130.0 ms (target: below; ratio 0.946): " \
           "met" in text
    assert "- torchft_ddp: FAILED: `JobError: boom`" in text
    assert "| torchft_pyreducer | torchft: survivors go on, the restarted replica heals | 1 | " \
           "0.24 | 0.25 | 0.30 | 0.75 | 0.35 | 3 | met (budget 0.47 s) |" in text
    assert "| 2 | 2.66 | 2.85 | 2.65 | 2.75 | - | 0 | NOT met (budget 0.12 s) |" in text


def test_a_killed_writers_log_and_a_missing_one(tmp_path):
    path = tmp_path / "rank1.jsonl"
    path.write_text(json.dumps(_entry(1, 0, 0, 1.0, 2.0)) + "\n" + '{"replica": 1, "att')
    assert report.read_jsonl(str(path)) == [_entry(1, 0, 0, 1.0, 2.0)]
    assert report.read_jsonl(str(tmp_path / "absent.jsonl")) == []


def test_the_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    doc = _doc()
    for draw, name in ((report.plot_step_times, "step.png"), (report.plot_timeline, "tl.png")):
        assert name in draw(doc, str(tmp_path / name))
        assert (tmp_path / name).stat().st_size > 1000


def test_the_scripts_arguments():
    from benchmarks import bench_torchft

    args = bench_torchft.parse_args(["--quick", "--out", "x", "--failure-variants", ""])
    assert (args.steps, args.fail_step, args.repeats) == (12, 8, 1)
    assert args.variants == list(bench_torchft.VARIANTS) and args.failure_variants == []
    with pytest.raises(SystemExit):
        bench_torchft.parse_args(["--out", "x", "--variants", "nope"])
    with pytest.raises(SystemExit):
        bench_torchft.parse_args(["--out", "x", "--fail-step", "100"])
