"""The report from timelines, without processes: plots, trace and summary from a synthetic
two-rank timeline; without matplotlib everything but the plots, and a note saying how to get
them; the rank files PYREDUCER_TRACE writes are merged with their clock offsets."""
import json
import os
import sys

import pytest

from pyreducer.observe import InputError, plot, report
from pyreducer.wrapper import timeline


def _record(rank, offset_ns=0):
    base = 1_000_000_000 + offset_ns
    return dict(iteration=3, rank=rank, plan_version=1, backward_start_ns=base,
                backward_end_ns=base + 8_000_000, wait_start_ns=base + 8_100_000,
                wait_end_ns=base + 9_000_000, finalize_end_ns=base + 9_500_000,
                grads=[dict(name="w", ready_ns=base + 2_000_000),
                       dict(name="b", ready_ns=base + 5_000_000)],
                buckets=[dict(index=0, params=["b"], size_bytes=4096, ready_ns=base + 5_000_000,
                              launch_ns=base + 5_100_000, done_ns=base + 7_000_000),
                         dict(index=1, params=["w"], size_bytes=1 << 20,
                              ready_ns=base + 2_000_000, launch_ns=base + 7_000_000,
                              done_ns=base + 8_900_000)])


def test_plots_and_report_from_timelines(tmp_path):
    result = report.write_report([[_record(0)], [_record(1)]], tmp_path, profile={"x": 1})
    assert not result["notes"]
    for name in ("gantt.png", "overlap.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "profile.json").read_text()) == {"x": 1}
    assert "last-bucket bound" in (tmp_path / "summary.txt").read_text()


def _overlapped(iteration, start_ns):
    """An overlapped optimizer's record: its last bucket runs under the next forward."""
    record = _record(0, start_ns - 1_000_000_000)
    base = record["backward_start_ns"]
    record["iteration"] = iteration
    record["overlap"] = dict(forward_start_ns=base + 8_200_000, forward_end_ns=base + 12_000_000,
                             updates=[dict(bucket=1, read_ns=base + 8_300_000,
                                           reduced_ns=base + 8_900_000,
                                           updated_ns=base + 9_100_000, module="layer1"),
                                      dict(bucket=0, read_ns=base + 10_000_000,
                                           reduced_ns=base + 10_000_000,
                                           updated_ns=base + 10_200_000, module=None)])
    return record


def test_overlap_gantt_draws_two_iterations(tmp_path):
    records = [_overlapped(4, 1_000_000_000), _overlapped(5, 1_012_500_000)]
    result = report.write_report([records], tmp_path)
    assert (tmp_path / "overlap_gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["paths"]["overlap_gantt.png"].endswith("overlap_gantt.png")
    with pytest.raises(ValueError, match="two consecutive"):
        plot.overlap_gantt(records[:1], tmp_path / "one.png")
    # the forward waited 0.6 ms in layer1 (bucket 1) and 0 for bucket 0, read by no module
    waits = timeline.overlap_stats(records)["forward_wait_by_module_ms"]
    assert waits == {"layer1": pytest.approx(0.6), timeline.OUTSIDE: 0.0}
    assert "by module that read (mean ms per iteration): layer1 0.60, (no module" in \
        (tmp_path / "summary.txt").read_text()


def test_without_matplotlib_the_report_says_how_to_get_plots(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(plot.PlottingUnavailable, match=r"pip install .*\[plot\]"):
        plot.gantt([[_record(0)]], tmp_path / "g.png")
    result = report.write_report([[_record(0)]], tmp_path)
    assert result["notes"] and "pip install" in result["notes"][0]
    assert (tmp_path / "trace.json").is_file() and not (tmp_path / "gantt.png").exists()


def test_rank_files_merge_with_their_clock_offsets(tmp_path):
    offset = 123_456_789  # rank 1's clock runs this far ahead of rank 0's
    for rank, shift in ((0, 0), (1, offset)):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(_rank_file(
            rank, 2, clock_offset_ns=shift, timeline=[_record(rank, shift)],
            profile={"rank": rank})))
    report.report_dir(tmp_path)
    merged = json.loads((tmp_path / "timeline.json").read_text())
    assert merged[0][0]["backward_start_ns"] == merged[1][0]["backward_start_ns"]
    assert merged[1][0]["buckets"][1]["done_ns"] == _record(1)["buckets"][1]["done_ns"]
    assert json.loads((tmp_path / "profile.json").read_text()) == {"rank": 0}


def _rank_file(rank, world_size, run_id=7, **fields):
    return dict(dict(format="pyreducer.rank_trace", version=1, rank=rank, global_rank=rank,
                     world_size=world_size, run_id=run_id, clock_offset_ns=0, timeline=[],
                     profile=None), **fields)


@pytest.mark.parametrize("files,words", [
    ({"rank1.json": _rank_file(1, 3)}, r"ranks \[0, 2\] of 3 are missing"),
    ({"rank0.json": _rank_file(0, 2), "rank1.json": _rank_file(1, 2, run_id=8)},
     "2 different runs"),
    ({"rank0.json": _rank_file(0, 2), "rank2.json": _rank_file(0, 2, global_rank=2)},
     "several process groups"),
    ({"rank0.json": {"something": "else"}}, "not a pyreducer.rank_trace file"),
    ({"rank0.json": "{not json"}, "not a rank file"),
    ({"rank0.json": _rank_file(0, 1)}, "no recorded iteration"),
])
def test_unusable_rank_files_are_named(tmp_path, files, words):
    for name, content in files.items():
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(InputError, match=words):
        report.report_dir(tmp_path)


def test_overlap_stats_skip_a_bucket_whose_completion_was_not_recorded():
    """A completion stamp comes from a callback that can run after the iteration was recorded:
    such a bucket (done 0) is left out, not counted as a huge negative span."""
    import math

    from pyreducer.wrapper.timeline import iteration_stats

    record = _record(0)
    complete = iteration_stats(record)
    record["buckets"][0]["done_ns"] = 0
    stats = iteration_stats(record)
    assert math.isnan(stats["comm_ms"][0]) and stats["comm_ms"][1] == complete["comm_ms"][1]
    assert 0 < stats["comm_busy_ms"] < complete["comm_busy_ms"]
    assert stats["last_bucket_bound_ms"] == complete["last_bucket_bound_ms"]


def test_tuning_phase_is_drawn_and_told(tmp_path):
    """A Recorder's `tuning` (observe/recorder.py): step times per phase, and the decisions."""
    phases = ["buckets: warmup"] * 3 + ["buckets: measure_current"] * 4 + \
        ["schedule: held"] * 2 + ["decided"] * 3
    starts = [i * 100_000_000 for i in range(len(phases))]  # 100 ms steps ...
    starts[5] += 50_000_000  # ... but step 5 150 ms, step 6 50 ms
    logs = dict(buckets=[dict(event="chosen", iteration=7, plan="cap 1 MB", step_ms=99.5,
                              buckets=3)],
                schedule=[dict(event="chosen", describe="chunks of 1 MB", measured_ms=90.25,
                               predicted_ms=88.0)])
    result = report.write_report([[_record(0)]], tmp_path,
                                 tuning=dict(forward_start_ns=starts, phases=phases, logs=logs))
    assert os.path.getsize(result["paths"]["tuning.png"]) > 0
    text = result["summary"]
    assert "steps 1-3 (3): buckets: warmup, mean step 100.0" in text
    assert "steps 4-7 (4): buckets: measure_current, mean step 100.0" in text
    assert "steps 10-12 (3): decided, mean step 100.0" in text  # (the last has no next start)
    assert "bucket autotune, step 7: chosen plan cap 1 MB, step_ms 99.5, buckets 3" in text
    assert "overlap schedule: chosen chunks of 1 MB, measured_ms 90.2, predicted_ms 88.0" in text
