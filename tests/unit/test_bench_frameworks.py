"""The figures of benchmarks/frameworks_report.py (bench_frameworks.py's summary), from a made-up
results.json: the slowest rank's median step, ratios to stock (pooled and per repeat), memory
per rank, the parity columns, and a failed run reported as such."""
import pytest

from benchmarks import frameworks_report


def _rank(rank: int, step_s: float, state_bytes: int, rss_bytes: int) -> dict:
    return dict(rank=rank, intervals_s=[step_s] * 5, optimizer_state_bytes=state_bytes,
                memory_bytes=None, peak_rss_rise_bytes=rss_bytes, losses=[3.0, 2.5],
                decided_at=1, total_steps=8, timed_steps=5, schedule=None,
                wrapper="torch.nn.parallel.distributed", optimizer="AdamW",
                inner_optimizer="AdamW", fused=False)


def _doc() -> dict:
    """hf: stock (rank 1 the slower), shard (10% faster per repeat in the second), and one
    failed overlap run."""
    runs = []
    for repeat in range(2):
        runs.append(dict(framework="hf", variant="stock", repeat=repeat, seconds=10.0,
                         max_param_diff=0.0, losses_equal=True, max_loss_diff=0.0,
                         ranks=[_rank(0, 0.100, 8 << 20, 50 << 20),
                                _rank(1, 0.120, 8 << 20, 60 << 20)]))
        shard_s = 0.090 if repeat == 0 else 0.108
        runs.append(dict(framework="hf", variant="shard", repeat=repeat, seconds=11.0,
                         max_param_diff=2e-7, losses_equal=repeat == 0, max_loss_diff=1e-6,
                         ranks=[_rank(0, shard_s, 4 << 20, 40 << 20),
                                _rank(1, shard_s, 4 << 20, 30 << 20)]))
    runs.append(dict(framework="hf", variant="overlap", repeat=0, seconds=3.0,
                     error="exit codes [1, 1]; host 0: RuntimeError: boom"))
    return dict(reference="stock", runs=runs)


def test_the_slowest_ranks_median_and_the_ratios_to_stock():
    table = frameworks_report.aggregate(_doc())["hf"]
    stock, shard = table["stock"], table["shard"]
    assert stock["step"]["median_ms"] == pytest.approx(120.0)  # rank 1's
    assert stock["per_repeat_ms"] == pytest.approx([120.0, 120.0])
    # shard's ranks pooled over both repeats: 90 x 5 and 108 x 5, median 99
    assert shard["step"]["median_ms"] == pytest.approx(99.0)
    assert shard["ratio"] == pytest.approx(99.0 / 120.0)
    assert shard["per_repeat_ratio"] == pytest.approx([0.75, 0.9])
    assert shard["optimizer_state_bytes"] == [4 << 20, 4 << 20]
    assert shard["peak_rss_rise_bytes"] == [40 << 20, 30 << 20]
    assert not shard["losses_equal"] and shard["max_param_diff"] == pytest.approx(2e-7)
    assert table["overlap"]["errors"] == ["exit codes [1, 1]; host 0: RuntimeError: boom"]
    assert "step" not in table["overlap"]


def test_the_summary_rows():
    rows = {line.split(" | ")[0]: line for line in
            (frameworks_report.table_row(v, f)
             for v, f in frameworks_report.aggregate(_doc())["hf"].items())}
    assert rows["| stock"].startswith("| stock | 120.0 | 120.0-120.0 | 1.000 | 1.000, 1.000 | "
                                      "8.0 / 8.0 | 50.0 / 60.0 | 2.5000 | yes | 0 |")
    assert "| 0.825 | 0.750, 0.900 | 4.0 / 4.0 |" in rows["| shard"]
    assert "no (max diff 1e-06)" in rows["| shard"]
    assert rows["| overlap"].startswith("| overlap | failed")
    notes = frameworks_report.notes("overlap", frameworks_report.aggregate(_doc())["hf"]["overlap"])
    assert notes == ["- overlap: FAILED: `exit codes [1, 1]; host 0: RuntimeError: boom`"]


def test_the_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    doc = _doc()
    for draw, name in ((frameworks_report.plot_step_times, "step.png"),
                       (frameworks_report.plot_memory, "memory.png")):
        assert (tmp_path / name).name in draw(doc, str(tmp_path / name))
        assert (tmp_path / name).stat().st_size > 1000
