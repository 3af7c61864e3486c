"""The overlap schedule model (pyreducer/overlap/schedule.py): chunk counts, the priority launch
order, and the overlapped step's predicted period on hand-computable profiles."""
import math

import pytest

from pyreducer.tuning.linkmodel import LinkModel
from pyreducer.overlap.schedule import (OverlapProfile, barrier_schedule, best_schedule,
                                       channel_done_ms, chunk_counts, fifo_schedule, predict_ms,
                                       loaded_link, priority_order)

MB = 1 << 20
# 1 ms per MB, no latency, 2 ranks (ring factor 1): a bucket of s MB takes s ms
LINK = LinkModel(latency_s=0.0, bandwidth_bytes_per_s=MB * 1e3)


def three_buckets(**changes) -> OverlapProfile:
    """Bucket 0 (last layers) full at 1 ms, 1 at 2 ms, 2 (first layers) at 3 ms; backward
    3 ms; the forward reads 2, 1, 0, each after 1 ms of compute; no updates, no gap."""
    fields = dict(ready_ms=[1.0, 2.0, 3.0], size_bytes=[4 * MB, 4 * MB, 4 * MB], backward_ms=3.0,
                  read_order=[2, 1, 0], segment_ms=[1.0, 1.0, 1.0], tail_ms=0.0,
                  update_ms=[0.0, 0.0, 0.0], gap_ms=0.0)
    fields.update(changes)
    return OverlapProfile(**fields)


def test_chunk_counts_round_up_and_respect_limits():
    profile = three_buckets(size_bytes=[4 * MB, 1 * MB + 1, 10], max_chunks=[100, 100, 1])
    assert chunk_counts(profile, None) == [1, 1, 1]
    assert chunk_counts(profile, MB) == [4, 2, 1]


def test_priority_order_serves_the_first_read_bucket_as_soon_as_it_is_full():
    profile = three_buckets()
    chunks = chunk_counts(profile, MB)  # 4 chunks of 1 ms each
    order = priority_order(profile, chunks, LINK, 2)
    # t=1: bucket 0's chunks start; at t=2 bucket 1 is full and read before 0: it goes next;
    # at t=3 bucket 2 (read first) is full: its four chunks, then the rest of 1, then of 0
    assert order == [0, 1, 2, 2, 2, 2, 1, 1, 1, 0, 0, 0]
    assert sorted(order) == sorted(b for b, n in enumerate(chunks) for _ in range(n))


def test_fifo_prediction_by_hand():
    profile = three_buckets()
    fifo = fifo_schedule(profile)
    # Steady state. Backward from B: buckets done at B+5, B+9, B+13 (one 4 ms channel each).
    # Next forward starts at B+3: reads bucket 2 at B+4, waits until B+13, then 1 (done) at
    # B+14, 0 at B+15; the next backward starts at B+15: the period is 15 ms.
    assert predict_ms(profile, fifo.order, fifo.chunks, LINK, 2) == pytest.approx(15.0)


def test_priority_chunks_shorten_the_period():
    profile = three_buckets()
    chunks = chunk_counts(profile, MB)
    order = priority_order(profile, chunks, LINK, 2)
    # channel: 0@1-2, 1@2-3, 2: 3-7 (done B+7), 1: 7-10 (B+10), 0: 10-13 (B+13); forward from
    # B+3: read 2 at B+4 -> B+7, +1 = B+8 read 1 -> B+10, +1 = B+11 read 0 -> B+13
    period = predict_ms(profile, order, chunks, LINK, 2)
    assert period == pytest.approx(13.0)
    best, options = best_schedule(profile, LINK, 2, candidates=(None, MB))
    assert options[0].chunks == [1, 1, 1] and best.chunk_bytes == MB
    assert best.predicted_ms == pytest.approx(13.0) and best.predicted_ms < options[0].predicted_ms


def test_communication_bound_period_is_about_the_channel():
    profile = three_buckets(size_bytes=[40 * MB] * 3)  # 120 ms of communication per step
    for chunk in (None, 4 * MB):
        chunks = chunk_counts(profile, chunk)
        order = priority_order(profile, chunks, LINK, 2)
        # at least the channel's 120 ms; at most that plus the 6 ms of compute
        assert 120.0 <= predict_ms(profile, order, chunks, LINK, 2) <= 126.0


def test_latency_makes_tiny_chunks_lose():
    slow = LinkModel(latency_s=2e-3, bandwidth_bytes_per_s=MB * 1e3)
    best, options = best_schedule(three_buckets(), slow, 2, candidates=(None, MB // 4))
    by_chunk = {o.chunk_bytes: o.predicted_ms for o in options}
    assert by_chunk[MB // 4] > by_chunk[None] and best.chunk_bytes is None


def test_contention_slows_the_compute_while_a_reduction_runs():
    # compute-bound: buckets full at 10, 20, 30 ms of compute, 4 ms all-reduces; c = 0.5
    profile = three_buckets(ready_ms=[10.0, 20.0, 30.0], backward_ms=30.0)
    loaded = LinkModel(0.0, MB * 1e3, contention=0.5)
    # barrier: bucket 0 runs 10-14, the compute gets 2 ms of work done meanwhile: bucket 1
    # is full at 22, runs 22-26; bucket 2 full at 34, runs 34-38; 3 ms forward + 38 = 41
    # (without contention: 3 + max(30, 34) = 37)
    barrier = barrier_schedule(profile)
    assert barrier.predict(profile, loaded, 2).predicted_ms == pytest.approx(41.0)
    assert barrier.predict(profile, LINK, 2).predicted_ms == pytest.approx(37.0)
    # across the step: the backward ends at 34; the forward's first 1 ms segment runs beside
    # bucket 2 (34-38) at half speed, ends at 36, waits to 38, then 1 + 1 ms: period 40
    # (without contention: ends 30, reads at 31, waits to 34, 35, 36: 36)
    fifo = fifo_schedule(profile)
    assert predict_ms(profile, fifo.order, fifo.chunks, loaded, 2) == pytest.approx(40.0)
    assert predict_ms(profile, fifo.order, fifo.chunks, LINK, 2) == pytest.approx(36.0)
    # communication-bound, the compute waits for the channel anyway: contention costs nothing
    bound = three_buckets()
    assert predict_ms(bound, fifo.order, fifo.chunks, loaded, 2) == \
        pytest.approx(predict_ms(bound, fifo.order, fifo.chunks, LINK, 2))


def test_profile_from_records():
    ms = 1_000_000
    record = dict(
        backward_start_ns=100 * ms, backward_end_ns=110 * ms, plan_version=1,
        buckets=[dict(size_bytes=10, ready_ns=104 * ms), dict(size_bytes=20, ready_ns=109 * ms)],
        overlap=dict(forward_start_ns=112 * ms, forward_end_ns=130 * ms, updates=[
            dict(bucket=1, read_ns=115 * ms, reduced_ns=118 * ms, updated_ns=119 * ms),
            dict(bucket=0, read_ns=125 * ms, reduced_ns=125 * ms, updated_ns=127 * ms)]))
    profile = OverlapProfile.from_records([record, dict(record, overlap=None)])
    assert profile.ready_ms == [4.0, 9.0] and profile.backward_ms == 10.0
    assert profile.read_order == [1, 0] and profile.segment_ms == [3.0, 6.0]
    assert profile.update_ms == [2.0, 1.0] and profile.tail_ms == 3.0 and profile.gap_ms == 2.0
    with pytest.raises(ValueError, match="next forward"):
        OverlapProfile.from_records([dict(record, overlap=None)])


def test_channel_lanes_share_the_wire_and_overlap_latency():
    # one lane: each waits for the one before; latency is paid in turn
    assert channel_done_ms([0.0, 0.0], [4.0, 4.0], 1.0, lanes=1) == pytest.approx([5.0, 10.0])
    # two lanes (Gloo's two worker threads): both on the wire at once, at half the rate each
    assert channel_done_ms([0.0, 0.0], [4.0, 4.0], 1.0, lanes=2) == pytest.approx([9.0, 9.0])
    # a short one beside a long one leaves first; a third waits for a lane
    assert channel_done_ms([0.0, 0.0, 0.0], [8.0, 2.0, 2.0], 0.0, lanes=2) == \
        pytest.approx([12.0, 4.0, 8.0])
    # launched later than the channel frees: starts at its launch
    assert channel_done_ms([0.0, 10.0], [1.0, 1.0], 0.5, lanes=2) == pytest.approx([1.5, 11.5])


def test_a_reduction_started_beside_a_streaming_one_waits_behind_its_queued_bytes():
    # without a queue the 1 ms one shares the wire at once: done at 7; the 10 ms one at 11
    assert channel_done_ms([0.0, 5.0], [10.0, 1.0], 0.0, lanes=2) == pytest.approx([11.0, 7.0])
    # 3 ms queued ahead of it: the long one has the wire alone 5-8 (2 ms left at 8), then both
    # share it: the short one is done at 10, the long one at 11
    assert channel_done_ms([0.0, 5.0], [10.0, 1.0], 0.0, lanes=2, queue_ms=3.0) == \
        pytest.approx([11.0, 10.0])
    # never longer than what the other still has to send (1 ms at t=9)
    assert channel_done_ms([0.0, 9.0], [10.0, 1.0], 0.0, lanes=2, queue_ms=3.0) == \
        pytest.approx([10.0, 11.0])
    # nothing on the wire, no queue: latency only
    assert channel_done_ms([0.0], [1.0], 0.5, lanes=2, queue_ms=3.0) == pytest.approx([1.5])


def test_in_flight_budget_lets_more_chunks_ahead():
    profile = three_buckets()
    chunks = chunk_counts(profile, MB)
    # 2 MB in flight (two 1 ms chunks): t=1 bucket 0 twice (done 2, 3); t=2 one slot frees,
    # bucket 1 is full and read first: 1 (done 4); t=3 bucket 2 (done 5); t=4, 5, 6: bucket 2's
    # other three chunks; then 1's three; then 0's last two
    assert priority_order(profile, chunks, LINK, 2, budget_bytes=2 * MB) == \
        [0, 0, 1, 2, 2, 2, 2, 1, 1, 1, 0, 0]
    # a budget below one chunk still launches one at a time (never nothing)
    assert priority_order(profile, chunks, LINK, 2, budget_bytes=1) == \
        priority_order(profile, chunks, LINK, 2)
    # a budget as large as everything: each chunk as soon as its bucket is full
    assert priority_order(profile, chunks, LINK, 2, budget_bytes=12 * MB) == \
        [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    best, options = best_schedule(profile, LINK, 2, candidates=(MB,), budgets=(None, 2 * MB))
    assert {o.budget_bytes for o in options[1:]} == {None, 2 * MB}
    assert "up to 2 MB in flight" in [o for o in options if o.budget_bytes][0].describe()
    # whole buckets in torch DDP's order and in priority order are told apart
    whole = best_schedule(profile, LINK, 2, candidates=(None,), budgets=(None,))[1]
    assert [o.describe() for o in whole] == ["whole buckets, torch DDP's order, 3 all-reduces",
                                             "whole buckets, first read first, 3 all-reduces"]


def test_barrier_prediction_by_hand():
    profile = three_buckets()
    barrier = barrier_schedule(profile).predict(profile, LINK, 2)
    # forward 3 ms (no waits), backward from 3: buckets done at +5, +9, +13; the step ends
    # with the last: 3 + 13 = 16 ms, one more than fifo across the step (15, above)
    assert barrier.barrier and barrier.predicted_ms == pytest.approx(16.0)
    assert barrier.describe() == "torch DDP's step barrier (no overlap)"
    # compute-bound: the backward (30 ms) outlasts the communication, nothing is exposed
    slow = three_buckets(backward_ms=30.0)
    assert barrier_schedule(slow).predict(slow, LINK, 2).predicted_ms == pytest.approx(33.0)


def _record(size_mb, ready_ms, order, chunks, link, lanes):
    """A backward record whose buckets complete as `link` carries them (the Reducer's launch
    rule: an entry launches when its bucket is full and the entry before it has launched)."""
    ms = 1_000_000
    launches, previous, first = [], -math.inf, {}
    for b in order:
        previous = max(previous, ready_ms[b])
        launches.append(previous)
        first.setdefault(b, previous)
    wires = [link.wire_s(size_mb[b] * MB / chunks[b], 2) * 1e3 for b in order]
    done = {}
    for b, t in zip(order, channel_done_ms(launches, wires, link.latency_s * 1e3, lanes)):
        done[b] = max(done.get(b, 0.0), t)
    return dict(backward_start_ns=1000 * ms, buckets=[
        dict(size_bytes=size_mb[b] * MB, ready_ns=(1000 + ready_ms[b]) * ms,
             launch_ns=round((1000 + first[b]) * ms), done_ns=round((1000 + done[b]) * ms))
        for b in range(len(size_mb))])


@pytest.mark.parametrize("order,chunks", [([0, 1, 2], [1, 1, 1]),
                                          ([0, 0, 1, 2, 2, 1], [2, 2, 2])])
def test_loaded_link_recovers_the_rate_the_backward_got(order, chunks):
    probed = LinkModel(latency_s=0.5e-3, bandwidth_bytes_per_s=MB * 1e3)
    slower = LinkModel(latency_s=0.5e-3, bandwidth_bytes_per_s=0.7 * MB * 1e3)
    # buckets fill faster than the slower link drains them: a backlog, as on the bench
    records = [_record([4, 4, 2], [1.0 + jitter, 2.0, 3.0], order, chunks, slower, lanes=2)
               for jitter in (0.0, 0.3, 0.6)]
    link, scale = loaded_link(records, probed, 2, 2, order, chunks)
    assert scale == pytest.approx(0.7)
    assert link.bandwidth_bytes_per_s == pytest.approx(0.7 * MB * 1e3)
    assert link.latency_s == probed.latency_s
    # the probe's own rate is recovered when the backward got all of it
    exact = [_record([4, 4, 2], [1.0, 2.0, 3.0], order, chunks, probed, lanes=2)]
    assert loaded_link(exact, probed, 2, 2, order, chunks)[1] == pytest.approx(1.0)


def test_loaded_link_without_times_keeps_the_probe():
    record = dict(backward_start_ns=0, buckets=[dict(size_bytes=MB, launch_ns=0, done_ns=0)])
    assert loaded_link([record], LINK, 2, 2, [0], [1]) == (LINK, 1.0)
    assert loaded_link([], LINK, 2, 2, [0], [1]) == (LINK, 1.0)


def test_the_tuner_keeps_the_barrier_unless_an_overlap_beat_it_by_the_margin():
    from pyreducer.overlap.schedule_tuner import MARGIN, choose

    def candidates(*overlap_ms, barrier_ms=100.0):
        return [dict(measured_ms=m) for m in overlap_ms] + [dict(measured_ms=barrier_ms,
                                                                 barrier=True)]

    assert choose(candidates(95.0, 97.0)) == 0  # 5% faster: kept
    assert choose(candidates(101.0, 99.5)) == 2  # 0.5% faster: within the margin, a tie
    assert choose(candidates(100 * (1 - MARGIN) - 0.01)) == 0
    assert choose(candidates(120.0, barrier_ms=110.0)) == 1  # the barrier was fastest
    assert choose([dict(measured_ms=5.0), dict(measured_ms=4.0)]) == 1  # no barrier candidate


def test_a_trial_window_counts_as_its_slowest_rank():
    from pyreducer.overlap.schedule_tuner import slowest_windows

    # rank 0 ahead in window 0, behind in window 1 (the phase swings of a crossed step)
    assert slowest_windows([[0.30, 0.36, 0.31], [0.34, 0.32, 0.31]]) == [0.34, 0.36, 0.31]
    assert slowest_windows([[0.25]]) == [0.25]
    with pytest.raises(RuntimeError, match=r"different numbers of trial windows: \[2, 1\]"):
        slowest_windows([[0.3, 0.3], [0.3]])


class _FakeReducer:
    num_iterations = 0

    def __init__(self):
        self.installed = []

    def set_launch_order(self, order, chunks):
        self.installed.append((list(order), list(chunks)))


def _run_trials(monkeypatch, step_ms, until=None):
    """Drives a ScheduleTuner's trials with a fake clock: `step_ms(candidate, runoff)` is each
    step's time on rank 0; the other rank's windows are 1% slower. Returns the tuner, at the
    end of the trials or as soon as `until(tuner)` holds."""
    from types import SimpleNamespace

    from pyreducer.overlap import schedule_tuner, stepclock

    clock = [0.0]
    monkeypatch.setattr(stepclock.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(schedule_tuner.sync, "all_gather_object",
                        lambda obj, group, device: [obj, [[w * 1.01 for w in c] for c in obj]])
    params = SimpleNamespace(rank=0, world_size=2, process_group=None, device="cpu")
    tuning = SimpleNamespace(reducer=_FakeReducer(), params=params)
    tuner = schedule_tuner.ScheduleTuner(tuning, events=None, set_barrier=lambda b: None)
    tuner.candidates = [dict(order=[k], chunks=[1], describe=name, predicted_ms=1.0,
                             barrier=False) for k, name in enumerate("ab")]
    tuner.candidates.append(dict(order=[2], chunks=[1], describe="barrier", predicted_ms=1.0,
                                 barrier=True))
    tuner.trials, tuner.round = [0, 1, 2], 0
    tuner.samples = [[], [], []]
    tuner._next_trial()
    for _ in range(200):
        if tuner.trial is None or (until is not None and until(tuner)):
            return tuner
        clock[0] += step_ms(tuner.trial, tuner.runoff is not None) / 1e3
        tuner._measure()
    raise AssertionError("the trials did not end")


def test_an_overlap_that_won_the_rounds_runs_off_against_the_barrier(monkeypatch):
    from pyreducer.overlap.schedule_tuner import RUNOFF_WINDOWS

    # "a" won the rounds by 10% (its luck), but on fresh windows it is 1% behind the barrier
    tuner = _run_trials(monkeypatch, lambda k, runoff: (
        {0: 101.0, 1: 97.0, 2: 100.0} if runoff else {0: 90.0, 1: 97.0, 2: 100.0})[k])
    events = [e["event"] for e in tuner.log]
    assert events == ["measured"] * 3 + ["runoff", "chosen"]
    assert tuner.log[0]["measured_ms"] == pytest.approx(90.0 * 1.01)  # the slower rank's
    runoff = tuner.log[3]
    assert runoff["describe"] == "a"
    assert runoff["windows_ms"] == pytest.approx([101.0 * 1.01] * RUNOFF_WINDOWS)
    assert runoff["barrier_windows_ms"] == pytest.approx([100.0 * 1.01] * RUNOFF_WINDOWS)
    assert tuner.log[-1]["describe"] == "barrier"
    assert tuner.tuning.reducer.installed[-1] == ([2], [1])
    # two rounds over three candidates, the run-off's windows, the choice
    assert len(tuner.tuning.reducer.installed) == 2 * 3 + 2 * RUNOFF_WINDOWS + 1


def test_an_overlap_that_wins_the_run_off_too_is_kept(monkeypatch):
    tuner = _run_trials(monkeypatch, lambda k, runoff: (
        {0: 94.0, 1: 97.0, 2: 100.0} if runoff else {0: 90.0, 1: 97.0, 2: 100.0})[k])
    assert tuner.log[3]["event"] == "runoff"
    assert tuner.log[-1]["describe"] == "a"
    assert tuner.log[-1]["measured_ms"] == pytest.approx(94.0 * 1.01)  # the fresh time
    assert tuner.tuning.reducer.installed[-1] == ([0], [1])


def test_no_run_off_when_the_barrier_wins_the_rounds(monkeypatch):
    tuner = _run_trials(monkeypatch, lambda k, runoff: {0: 99.5, 1: 103.0, 2: 100.0}[k])
    assert [e["event"] for e in tuner.log] == ["measured"] * 3 + ["chosen"]
    assert tuner.log[-1]["describe"] == "barrier"  # 0.5% faster is within the margin


def test_a_new_bucket_plan_during_the_run_off_ends_it(monkeypatch):
    """A rebuild (or apply_bucket_plan) mid-run-off: the run-off is dropped with the trials, the
    overlap is let run (to be profiled again) and the new plan's warm-up starts."""
    tuner = _run_trials(monkeypatch, lambda k, runoff: {0: 90.0, 1: 97.0, 2: 100.0}[k],
                        until=lambda t: t.runoff is not None and len(t.trials) == 3)
    barrier_calls = []
    tuner.set_barrier = barrier_calls.append
    tuner.tuning.reducer.plan_version = lambda: 2  # the trials ran for plan 1
    tuner.planned_for = 1
    tuner.tuning.params.world_size = 2
    tuner.before_synced_forward()
    assert (tuner.trial, tuner.trials, tuner.runoff) == (None, [], None)
    assert barrier_calls == [False]
    assert [e["event"] for e in tuner.log] == ["measured"] * 3  # nothing chosen for plan 1
    assert tuner.since_change == 1  # warming up on the new plan


def test_the_step_clock_on_cpu_is_the_host_clock(monkeypatch):
    from pyreducer.overlap import stepclock

    clock = stepclock.for_device("cpu")
    assert isinstance(clock, stepclock.HostClock)
    readings = iter([1.25, 1.75])
    monkeypatch.setattr(stepclock.time, "perf_counter", lambda: next(readings))
    assert clock.seconds(clock.mark(), clock.mark()) == 0.5
