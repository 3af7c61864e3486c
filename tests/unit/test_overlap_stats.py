"""overlap_stats on hand-built timeline records (every time is T0 + a whole number of ms): how the
communication splits into hidden under the backward, hidden under the next forward's compute and
exposed; overlapping all-reduces counted once; waits charged per module; the mean over the
iterations whose next forward ran; a barrier record without overlap events."""
import pytest

from pyreducer.wrapper.timeline import OUTSIDE, overlap_stats

T0 = 1_000_000_000  # the monotonic clock's reading at "0 ms"


def _ns(ms):
    return T0 + ms * 1_000_000


def _ms(value):
    return pytest.approx(value, abs=1e-9)


def _record(backward, spans, overlap=None, iteration=1, wait=(100, 101)):
    """backward: (start, end) ms; spans: per bucket in index order, (ready, launch, done) ms;
    overlap: ((forward start, end), [(bucket, read, reduced, updated, module)]), 0: not yet."""
    record = dict(iteration=iteration, rank=0, plan_version=0, clock="host",
                  backward_start_ns=_ns(backward[0]), backward_end_ns=_ns(backward[1]),
                  wait_start_ns=_ns(wait[0]), wait_end_ns=_ns(wait[1]),
                  finalize_end_ns=_ns(wait[1]),
                  grads=[dict(name=f"p{b}", ready_ns=_ns(s[0])) for b, s in enumerate(spans)],
                  buckets=[dict(index=b, params=[f"p{b}"], size_bytes=4096, ready_ns=_ns(ready),
                                launch_ns=_ns(launch), done_ns=_ns(done))
                           for b, (ready, launch, done) in enumerate(spans)])
    if overlap is not None:
        (start, end), updates = overlap
        record["overlap"] = dict(
            forward_start_ns=start and _ns(start), forward_end_ns=end and _ns(end),
            updates=[dict(bucket=b, read_ns=_ns(read), reduced_ns=_ns(reduced),
                          updated_ns=updated and _ns(updated), module=module)
                     for b, read, reduced, updated, module in updates])
    return record


def _overlapped():
    """Backward 0-100. Bucket 0 in flight 20-60 and bucket 1 62-70 (inside the backward), bucket 2
    80-150. The next forward runs 130-200: it waits for bucket 2 from 135 to 150 in
    "features.0" and updates it until 152; bucket 1 is read at 160 (done: no wait), updated
    until 163, in "classifier"; bucket 0 is updated 195-199 at the forward's end (no module)."""
    return _record((0, 100), [(15, 20, 60), (61, 62, 70), (75, 80, 150)], overlap=(
        (130, 200), [(2, 135, 150, 152, "features.0"), (1, 160, 160, 163, "classifier"),
                     (0, 195, 195, 199, None)]))


def test_communication_is_hidden_under_backward_or_next_forward_or_exposed():
    """Busy: 40 + 8 + 70 = 118 ms. Under the backward: 20-60, 62-70, 80-100 = 68 ms. In the
    forward: 130-150, less the wait 135-150: 5 ms. Exposed: 100-130 (gap) + 135-150 (waited)
    = 45 ms, not the barrier's 150 - 100 = 50. The three parts add up to the busy time. The
    last bucket ran alone (launched at 80, after bucket 1's done at 70): bound 70 ms."""
    stats = overlap_stats([_overlapped()])["iterations"][0]
    assert stats["backward_ms"] == _ms(100)
    assert stats["comm_ms"] == [_ms(40), _ms(8), _ms(70)]
    assert stats["comm_busy_ms"] == _ms(118)
    assert stats["hidden_comm_ms"] == _ms(68)
    assert stats["hidden_forward_comm_ms"] == _ms(5)
    assert stats["exposed_comm_ms"] == _ms(45)
    assert stats["hidden_comm_ms"] + stats["hidden_forward_comm_ms"] + \
        stats["exposed_comm_ms"] == _ms(stats["comm_busy_ms"])
    assert stats["overlap_fraction"] == _ms(68 / 118)
    assert stats["wait_ms"] == _ms(1)
    assert stats["last_bucket_bound_ms"] == _ms(70)


def test_next_forward_waits_and_updates_are_summed_and_charged_per_module():
    """Waits: 150 - 135 = 15 ms in features.0, 0 in classifier, 0 at the forward's end (no
    module: OUTSIDE). Updates: 2 + 3 + 4 = 9 ms; a bucket read before step() (updated_ns 0)
    has no update: without classifier's 3 ms, 6 ms."""
    record = _overlapped()
    stats = overlap_stats([record])
    assert stats["iterations"][0]["forward_wait_ms"] == _ms(15)
    assert stats["iterations"][0]["update_ms"] == _ms(9)
    assert stats["forward_wait_by_module_ms"] == {
        "features.0": _ms(15), "classifier": _ms(0), OUTSIDE: _ms(0)}
    record["overlap"]["updates"][1]["updated_ns"] = 0
    assert overlap_stats([record])["iterations"][0]["update_ms"] == _ms(6)


def test_overlapping_all_reduces_count_once():
    """Backward 0-100; all-reduces 10-115, 50-120 and 60-90 (summed: 205 ms) overlap: their
    union 10-120 is 110 ms busy, 10-100 = 90 ms hidden. The forward (110-140) sees 110-115 and
    110-120, union 10 ms (summed: 15); its wait 112-120 overlaps 112-115 and 112-120, union
    8 ms (summed: 11). Hidden under the forward: 10 - 8 = 2 ms; exposed 110 - 90 - 2 = 18 ms
    (the gap 100-110 and the wait 112-120)."""
    record = _record((0, 100), [(5, 10, 115), (45, 50, 120), (55, 60, 90)], overlap=(
        (110, 140), [(1, 112, 120, 121, "features.0"), (0, 125, 125, 126, "features.2")]))
    stats = overlap_stats([record])["iterations"][0]
    assert stats["comm_ms"] == [_ms(105), _ms(70), _ms(30)]
    assert stats["comm_busy_ms"] == _ms(110)
    assert stats["hidden_comm_ms"] == _ms(90)
    assert stats["hidden_forward_comm_ms"] == _ms(2)
    assert stats["exposed_comm_ms"] == _ms(18)
    assert stats["forward_wait_ms"] == _ms(8)


def test_barrier_record_exposes_what_is_left_after_the_backward():
    """No overlap events: backward 0-100, all-reduces 20-60 and 110-150. Busy 80 ms, hidden
    40 ms; exposed is the wall-clock tail to the last done, 150 - 100 = 50 ms (not busy minus
    hidden, 40), and no next-forward field appears. A record whose next forward has not run
    (overlap events, forward 0) gives the same."""
    spans = [(15, 20, 60), (100, 110, 150)]
    barrier = overlap_stats([_record((0, 100), spans)])
    pending = overlap_stats([_record((0, 100), spans, overlap=((0, 0), []))])
    for result in (barrier, pending):
        stats = result["iterations"][0]
        assert stats["comm_busy_ms"] == _ms(80)
        assert stats["hidden_comm_ms"] == _ms(40)
        assert stats["exposed_comm_ms"] == _ms(50)
        assert stats["overlap_fraction"] == _ms(0.5)
        assert stats["last_bucket_bound_ms"] == _ms(40)
        assert not {"hidden_forward_comm_ms", "forward_wait_ms", "update_ms",
                    "forward_wait_by_module_ms"} & set(stats)
        assert "forward_wait_by_module_ms" not in result
        assert result["mean"]["exposed_comm_ms"] == _ms(50)
        assert "forward_wait_ms" not in result["mean"]


def test_mean_covers_the_iterations_whose_next_forward_ran():
    """Iteration 1: _overlapped() (backward 100 ms, waits 15 in features.0). Iteration 2:
    backward 200-280, its forward waits 305-330 = 25 ms in classifier. Iteration 3: the next
    forward has not run; a read outside any forward waited 490-530 = 40 ms. Means over 1 and
    2: backward (100 + 80) / 2 = 90, wait (15 + 25) / 2 = 20; per module classifier 12.5,
    features.0 7.5, OUTSIDE 0 (iteration 3's 40 left out), largest first."""
    second = _record((200, 280), [(205, 210, 230), (235, 240, 260), (265, 270, 330)],
                     iteration=2, wait=(280, 281), overlap=(
                         (300, 360), [(2, 305, 330, 331, "classifier"),
                                      (1, 335, 335, 336, "features.0")]))
    third = _record((400, 480), [(405, 410, 430), (435, 440, 460), (465, 470, 530)],
                    iteration=3, wait=(480, 481),
                    overlap=((0, 0), [(2, 490, 530, 531, None)]))
    result = overlap_stats([_overlapped(), second, third])
    assert [s["iteration"] for s in result["iterations"]] == [1, 2, 3]
    assert result["mean"]["backward_ms"] == _ms(90)
    assert result["mean"]["forward_wait_ms"] == _ms(20)
    waits = result["forward_wait_by_module_ms"]
    assert list(waits) == ["classifier", "features.0", OUTSIDE]
    assert waits == {"classifier": _ms(12.5), "features.0": _ms(7.5), OUTSIDE: _ms(0)}


def test_last_bucket_bound_leaves_out_queueing_behind_the_bucket_before():
    """Bucket 0 in flight 10-60; bucket 1 launched at 40 but queued behind it until 60, done at
    90: its comm_ms is 50, its own all-reduce 90 - 60 = 30 ms."""
    stats = overlap_stats([_record((0, 100), [(5, 10, 60), (35, 40, 90)])])["iterations"][0]
    assert stats["comm_ms"][-1] == _ms(50)
    assert stats["last_bucket_bound_ms"] == _ms(30)


def test_last_bucket_bound_is_the_last_launched_buckets_own_time():
    """overlap_optimizer(hold_back=2) launches 3 buckets in the order 0, 2, 1: bucket 0 10-30,
    bucket 2 40-60, bucket 1 launched at 41, queued behind bucket 2, done at 90. The last
    launched is bucket 1: 90 - max(41, 60) = 30 ms (taking the records' last two entries, by
    index, gave 0: bucket 2, 60 - 90 < 0)."""
    record = _record((0, 100), [(8, 10, 30), (35, 41, 90), (38, 40, 60)])
    assert overlap_stats([record])["iterations"][0]["last_bucket_bound_ms"] == _ms(30)
