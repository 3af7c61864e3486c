"""Contention measured in place (pyreducer/overlap/contention.py): the compute model beside
running reductions, and c from held and loaded timeline records, on hand-computed cases."""
import pytest

from pyreducer.overlap.contention import (advance, compute_windows, measure_in_place, merge,
                                         overlap_length)
from pyreducer.overlap.schedule import OverlapProfile

MS = 1_000_000


def test_merge_and_overlap_length():
    busy = merge([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (9.0, 9.0)])
    assert busy == [(0.0, 3.0), (5.0, 7.0)]  # empty intervals dropped
    assert overlap_length(busy, 2.0, 6.0) == pytest.approx(2.0)


def test_advance_runs_at_one_minus_c_inside_busy_intervals():
    busy = [(2.0, 6.0)]
    assert advance(0.0, 1.0, busy, 0.5) == pytest.approx(1.0)  # before the reduction
    # 2 ms of work by t=2, then 4 ms at half speed give 2 more: 4 ms of work end at 6
    assert advance(0.0, 4.0, busy, 0.5) == pytest.approx(6.0)
    assert advance(0.0, 5.0, busy, 0.5) == pytest.approx(7.0)  # then full speed again
    assert advance(3.0, 1.0, busy, 0.5) == pytest.approx(5.0)  # starting inside
    assert advance(0.0, 5.0, busy, 0.0) == pytest.approx(5.0)  # no contention
    assert advance(4.0, 0.0, busy, 0.5) == 4.0


def _record(backward_ms, forward, updates=(), buckets=()):
    """A timeline record: backward from 0; the next forward from forward[0] to forward[1] (ms);
    updates as (read, reduced, updated) ms; buckets as (launch, done) ms."""
    return dict(iteration=1, plan_version=1, backward_start_ns=0, backward_end_ns=backward_ms * MS,
                buckets=[dict(size_bytes=1, ready_ns=MS, launch_ns=a * MS, done_ns=b * MS)
                         for a, b in buckets],
                overlap=dict(forward_start_ns=forward[0] * MS, forward_end_ns=forward[1] * MS,
                             updates=[dict(bucket=0, read_ns=r * MS, reduced_ns=d * MS,
                                           updated_ns=u * MS) for r, d, u in updates]))


def test_compute_windows_leave_out_waits_and_updates():
    record = _record(10, (12, 30), updates=[(15, 18, 19), (25, 25, 27)])
    assert compute_windows(record) == [(12.0, 15.0), (19.0, 25.0), (27.0, 30.0)]
    # an update before the forward (completed ahead of it) takes nothing from it
    assert compute_windows(_record(10, (12, 20), updates=[(11, 11, 12)])) == [(12.0, 20.0)]


def test_contention_from_held_and_loaded_iterations():
    # alone: backward 10 ms, forward 5 ms of compute
    held = [_record(10, (11, 16), updates=[(10.5, 10.6, 10.7)])]
    # beside communication: backward 14 ms, with a reduction running 6-14 (8 ms of it); the
    # forward from 15: 2 ms of compute (15-17, the reduction 14-16 beside 1 ms of it), a wait
    # and update 17-20, then 4 ms (20-24): 6 ms of compute, 1 ms of it beside communication.
    # c = (14 - 10 + 6 - 5) / (8 + 1) = 5/9
    loaded = [_record(14, (15, 24), updates=[(17, 19, 20)], buckets=[(6, 12), (8, 16)])]
    measured = measure_in_place(loaded, held)
    assert measured["backward_ms"] == pytest.approx(10.0)
    assert measured["forward_ms"] == pytest.approx(5.0)
    assert measured["busy_backward_ms"] == pytest.approx(8.0)
    assert measured["busy_forward_ms"] == pytest.approx(1.0)
    assert measured["contention"] == pytest.approx(5 / 9)
    assert (measured["held_records"], measured["loaded_records"]) == (1, 1)
    # faster beside communication than alone (noise) is no contention, not a negative one
    fast = [_record(9, (15, 19), buckets=[(2, 8)])]
    assert measure_in_place(fast, held)["contention"] == 0.0


def test_no_contention_measured_without_communication_or_records():
    held = [_record(10, (11, 16))]
    assert measure_in_place([_record(12, (13, 18))], held) is None  # nothing ran beside
    assert measure_in_place([], held) is None
    assert measure_in_place([_record(12, (13, 18), buckets=[(1, 9)])], []) is None


def test_profile_takes_the_held_iterations_compute():
    profile = OverlapProfile(ready_ms=[4.0, 9.0], size_bytes=[10, 20], backward_ms=14.0,
                             read_order=[1, 0], segment_ms=[3.0, 6.0], tail_ms=3.0,
                             update_ms=[2.0, 1.0], gap_ms=2.0)
    # held: everything completed before the forward (11-17), bucket 1 updated in 0.5 ms then
    held = _record(10, (11, 17), updates=[(10.5, 10.5, 11.0)])
    held["overlap"]["updates"][0]["bucket"] = 1
    held["buckets"] = [dict(size_bytes=10, ready_ns=3 * MS), dict(size_bytes=20, ready_ns=8 * MS)]
    clean = profile.with_compute_of([held])
    assert clean.ready_ms == [3.0, 8.0] and clean.backward_ms == 10.0
    # the forward's 12 ms of segments and tail scaled to the held forward's 6 ms
    assert clean.segment_ms == pytest.approx([1.5, 3.0]) and clean.tail_ms == pytest.approx(1.5)
    # bucket 1's update from the held iteration, bucket 0's (not updated there) as recorded
    assert clean.update_ms == pytest.approx([2.0, 0.5])
    assert (clean.gap_ms, clean.read_order) == (2.0, [1, 0])
    with pytest.raises(ValueError, match="held"):
        profile.with_compute_of([dict(held, overlap=None)])
