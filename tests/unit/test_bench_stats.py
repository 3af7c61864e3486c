"""The benchmark statistics in pyreducer.tools.compare (summaries and paired ratios), and the
record tables of benchmarks/tables.py, and the overlap model check of
benchmarks/validate_overlap_model.py."""
import numpy as np
import pytest

from benchmarks import tables
from pyreducer.tools.compare import paired_ratio, summarize


def test_paired_ratio_of_a_constant_factor_is_exact():
    base = [100.0, 120.0, 90.0, 300.0, 110.0]
    result = paired_ratio([1.1 * x for x in base], base)
    assert result["ratio"] == pytest.approx(1.1)
    assert result["ci95"] == pytest.approx([1.1, 1.1])
    assert result["n"] == 5


def test_paired_ratio_interval_covers_the_truth_and_pairing_cancels_drift():
    rng = np.random.default_rng(1)
    drift = np.linspace(100.0, 200.0, 200)  # both series slow down alike over time
    a = drift * 0.97 * rng.normal(1.0, 0.01, 200)
    b = drift * rng.normal(1.0, 0.01, 200)
    result = paired_ratio(list(a), list(b))
    low, high = result["ci95"]
    assert low <= 0.97 <= high and high < 1.0, result
    assert result["pair_ratio_median"] == pytest.approx(0.97, abs=0.005)


def test_paired_ratio_rejects_unpaired_series():
    with pytest.raises(ValueError, match="equal length"):
        paired_ratio([1.0, 2.0, 3.0], [1.0, 2.0])


def test_summarize_reports_milliseconds():
    s = summarize([0.010, 0.020, 0.030])
    assert s["median_ms"] == pytest.approx(20.0) and s["n"] == 3
    assert s["min_ms"] == pytest.approx(10.0) and s["max_ms"] == pytest.approx(30.0)


def test_tables_render_ratios_bounds_and_sweeps():
    def entry(torch_ms, ours_ms):
        return {"compute": summarize([0.05]), "torch": summarize([torch_ms / 1e3]),
                "pyreducer": summarize([ours_ms / 1e3]), "bound_ms": 80.0,
                "compute_split_ms": {"forward": 20.0, "backward": 40.0, "step": 1.0},
                "backward_under_comm_ms": 50.0, "contended_bound_ms": 90.0,
                "paired_vs_torch": {"pyreducer": paired_ratio([ours_ms] * 3, [torch_ms] * 3)}}

    doc = {"runs": [{"model": "m", "link": "1gbit", "hosts": 2,
                     "results": {"default": entry(100.0, 99.0), "1": entry(90.0, 90.9)}}]}
    row = tables.main_table(doc).splitlines()[2]
    assert "| 0.990 (0.990-0.990) |" in row and "| 1.250 | 1.238 |" in row
    assert "| 40.0 / 50.0 | 90.0 | 1.100 |" in row
    sweep = tables.sweep_table(doc)
    assert "| 0.990 | 1.010 |" in sweep and "| 1 (90.0, 90.9) | 0.918 |" in sweep
    assert "over 2 points: median 1.000" in sweep


def test_overlap_table_against_the_targets():
    entry = {"torch": summarize([0.400]), "auto": summarize([0.300]),
             "overlap": summarize([0.240]), "floor_ms": 200.0, "contended_floor_ms": 230.0,
             "paired_vs_torch": {"overlap": paired_ratio([240.0] * 3, [400.0] * 3)},
             "overlap_schedule": [{"event": "planned", "link": {"bandwidth_scale": 0.8}},
                                  {"event": "chosen", "describe": "chunks of 4 MB, 10 all-reduces",
                                   "predicted_ms": 252.0}]}
    doc = {"runs": [{"model": "vgg", "link": "1gbit", "hosts": 2,
                     "results": {"default": entry, "4": {"torch": summarize([0.4])}}}]}
    lines = tables.overlap_table(doc).splitlines()
    assert len(lines) == 3  # the cap without the overlap variant has no row
    assert "| 0.600 (0.600-0.600) | 0.800 | 200.0 | 1.200 | 230.0 | 1.043 |" in lines[2]
    assert lines[2].endswith("| 0.80 | chunks of 4 MB, 10 all-reduces | 1.05 | - |")
    entry["overlap_schedule"][0] = {"event": "planned"}  # records from before loaded_link
    assert "| 1.043 | - | - | - | chunks of 4 MB" in tables.overlap_table(doc).splitlines()[2]


def test_first_read_is_the_exposed_part_of_the_first_read_buckets_all_reduce():
    ms = 1_000_000
    record = dict(backward_end_ns=100 * ms, buckets=[
        dict(size_bytes=8 << 20, ready_ns=50 * ms), dict(size_bytes=4 << 20, ready_ns=98 * ms)],
        overlap=dict(forward_start_ns=101 * ms, updates=[
            dict(bucket=0, read_ns=130 * ms), dict(bucket=1, read_ns=102 * ms)]))
    link = dict(latency_s=1e-3, bandwidth_bytes_per_s=(1 << 20) * 1e3 / 5)  # 5 ms per MB
    entry = {"overlap_schedule": [{"event": "planned", "link": link}],
             "overlap_timeline": [record, dict(record, overlap=dict(forward_start_ns=0,
                                                                     updates=[]))]}
    # bucket 1 is read first: 1 ms + 4 MB x 5 ms (2 ranks: ring factor 1), less the 2 ms it
    # could run before the backward's end
    assert tables.first_read_ms(entry, "overlap", 2) == pytest.approx(19.0)
    # 4 ranks: ring factor 1.5
    assert tables.first_read_ms(entry, "overlap", 4) == pytest.approx(29.0)
    assert tables.first_read_ms({"overlap_schedule": [{"event": "planned"}]}, "overlap", 2) is None


def test_first_read_is_the_first_leaf_module_the_forward_runs():
    assert tables.first_read("mlp") == ("0", {"0.weight": 32 * 288 * 4, "0.bias": 288 * 4})
    # the transformer's token embedding, tied to its output layer: read first, reduced last
    assert tables.first_read("transformer") == ("tokens", {"tokens.weight": 8192 * 256 * 4})
    assert tables.model_bytes("tied") == 4 * (64 * 32 + 2 * (32 * 32 + 32))  # tied once


def test_exact_bound_adds_the_first_modules_share_of_the_flat_all_reduce():
    ms = 1_000_000
    first = 4 * (32 * 288 + 288)  # "mlp": the first layer's bytes, of all its parameters'
    share = first / tables.model_bytes("mlp")
    # its gradients ready 2 ms before the backward's end: that much could run before
    record = dict(backward_end_ns=500 * ms, grads=[
        dict(name="0.weight", ready_ns=498 * ms), dict(name="0.bias", ready_ns=497 * ms),
        dict(name="2.weight", ready_ns=300 * ms)])
    entry = {"compute_split_ms": {"forward": 60.0, "backward": 120.0, "step": 20.0},
             "overlap_timeline": [dict(record, backward_end_ns=0), record]}
    run = {"model": "mlp", "hosts": 2, "comm_only_ms": 100.0}
    assert tables.exact_bound_ms(run, entry, "overlap") == pytest.approx(
        200.0 + share * 100.0 - 2.0)
    # communication-bound: the flat all-reduce is the bound
    assert tables.exact_bound_ms(dict(run, comm_only_ms=900.0), entry, "overlap") == 900.0
    # gradients ready long before the backward's end expose nothing
    record["grads"][0]["ready_ns"] = 10 * ms
    record["grads"][1]["ready_ns"] = 10 * ms
    assert tables.exact_bound_ms(run, entry, "overlap") == pytest.approx(200.0)
    assert tables.exact_bound_ms(dict(run, hosts=1), entry, "overlap") is None
    del record["grads"][1]  # 0.bias's gradient not in the record: no head start known
    assert tables.exact_bound_ms(run, entry, "overlap") is None
    assert tables.exact_bound_ms(run, {"compute_split_ms": entry["compute_split_ms"]},
                                 "overlap") is None


def test_overlap_model_validation_recomputes_predictions_from_the_logged_profile():
    import dataclasses

    from benchmarks import validate_overlap_model
    from pyreducer.overlap.schedule import OverlapProfile, Schedule
    from pyreducer.tuning.linkmodel import LinkModel

    profile = OverlapProfile(ready_ms=[1.0, 3.0], size_bytes=[4 << 20, 4 << 20], backward_ms=3.0,
                             read_order=[1, 0], segment_ms=[1.0, 1.0], tail_ms=0.0,
                             update_ms=[0.0, 0.0], gap_ms=0.0)
    link = LinkModel(latency_s=0.0, bandwidth_bytes_per_s=(1 << 20) * 1e3)  # 1 ms per MB
    fifo = dict(order=[0, 1], chunks=[1, 1], chunk_bytes=None, budget_bytes=None,
                barrier=False, describe="whole buckets")
    barrier = dict(fifo, barrier=True, describe="barrier")
    entry = {"overlap": summarize([0.020]), "overlap_schedule": [
        {"event": "planned", "profile": dataclasses.asdict(profile), "lanes": 1,
         "trials": [fifo, barrier],
         "link": {"latency_s": 0.0, "bandwidth_bytes_per_s": (1 << 20) * 1e3,
                  "contention": 0.0}},
        {"event": "measured", "describe": "whole buckets", "measured_ms": 11.0},
        {"event": "measured", "describe": "barrier", "measured_ms": 16.0},
        {"event": "chosen", "describe": "whole buckets"}]}
    rows = validate_overlap_model.predictions(entry, ranks=2)
    expected = Schedule([0, 1], [1, 1], None).predict(profile, link, 2).predicted_ms
    assert rows[0]["predicted_ms"] == pytest.approx(expected)
    assert rows[0]["measured_ms"] == 11.0 and rows[0]["bench_ms"] == pytest.approx(20.0)
    assert rows[1]["measured_ms"] == 16.0 and "bench_ms" not in rows[1]
    assert rows[1]["predicted_ms"] != rows[0]["predicted_ms"]  # the barrier waits for both
    del entry["overlap_schedule"][0]["profile"]  # a run from before the profile was logged
    assert validate_overlap_model.predictions(entry, ranks=2) is None
